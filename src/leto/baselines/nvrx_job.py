"""The NVRx baseline: NVIDIA's in-process restart (`nvidia-resiliency-ext` 0.7.0,
`nvidia_resiliency_ext.inprocess.Wrapper`) with warm spare ranks, over gloo, on the same GPT,
sampler, AdamW schedule and ZeRO-1 `Trainer` as the other baselines.

The harness (`run`) starts `workers + spares` processes at once (NVRx's world size is active +
spare ranks) and hosts the store NVRx coordinates through; every process builds the model and
loads the corpus, then calls the training function through `inprocess.Wrapper`. The first
`workers` ranks train, the others wait idle in NVRx's reserve. When a worker is SIGKILLed, its
NVRx monitor process reports it terminated, the survivors' collectives fail, every rank leaves
the training function (NVRx raises `RankShouldRestart` into it), NVRx reassigns ranks
(`ShiftRanks`, then `MaxActiveWorldSize(workers)` activates a spare) and calls the training
function again in the same processes: it rebuilds the process group on a new store prefix and,
as NVRx's usage guide "heavily recommends", reloads the state from a checkpoint - here a copy of
each rank's shard in host memory (tmpfs), taken after every step (NVRx's own local checkpointing
needs CUDA tensors), so no completed step is lost. With no spare left the job goes on with fewer
ranks (the checkpoint is resharded on load, the global batch stays the same); the reserve is
never refilled (NVRx cannot add processes to a running wrapper).

    python -m leto.baselines.restart --system nvrx --workers 4 --nodes 2 --kill 1@150 ...

Where the configuration departs from NVRx's defaults, and why, is in docs/baselines.md.
"""

# No `from __future__ import annotations` here: NVRx finds the `CallWrapper` parameter of the
# wrapped function by its annotation object (a string annotation makes its check raise).
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from leto.baselines.ckpt_job import write_whole
from leto.baselines.torchft_job import stop_processes
from leto.config import DEFAULT_TIMEOUT_S, JobConfig, Timeouts, TrainingConfig
from leto.console import read_jsonl
from leto.protocol.messages import node_of_rank
from leto.runtime import runlog
from leto.runtime.env import LOOPBACK, Job, loopback_store, network_env, solo
from leto.runtime.linux import describe_exit, die_with_parent, proc_stat
from leto.training import train_gpt
from leto.training.corpus import load_tokens
from leto.training.data import Sampler
from leto.training.member import RankMember
from leto.training.model import GPT, PRESETS
from leto.training.optim import MASTER, AdamW, warmup_cosine
from leto.training.trainer import Trainer

NVRX_VERSION = "0.7.0"
DEFAULT_SPARES = 1  # as many warm spares as Leto's default shadows
DEFAULT_SHM = Path("/dev/shm")
STOP_GRACE_S = 5.0
POLL_S = 0.01  # the harness's supervision loop (as Leto's controller)
STORE_PREFIX = "leto-nvrx/"

# NVRx Wrapper settings. Defaults are NVRx's; the ones below are tuned for 5 ranks on one host, the
# way the torchft baseline's lighthouse is tuned (heartbeat timeout 1 s instead of 5 s).
MONITOR_INTERVAL_S = 0.05  # monitor thread / monitor process / progress watchdog (default 1 s;
# NVRx's own tests use 0.01 s; the guide: scale with the number of ranks)
LAST_CALL_WAIT_S = 0.1  # default 1 s: wait for concurrent faults; 2 monitor intervals
HEARTBEAT_INTERVAL_S = 0.2  # default 1 s
HEARTBEAT_TIMEOUT_S = 1.0  # default 30 s; detects a rank whose monitor process died too (a node loss)
TERMINATION_GRACE_S = 0.0  # default 5 s; the guide: 0 is safe for workloads without SIGTERM handlers
# soft / hard progress timeouts (60 / 90 s), barrier and completion timeouts (120 s): NVRx's defaults


def nvrx_status() -> str | None:
    """None if NVRx's in-process restart imports here, else why not (e.g. "not installed")."""
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except ModuleNotFoundError as e:
        return (
            "not installed"
            if e.name and e.name.startswith("nvidia_resiliency_ext")
            else f"not importable (missing {e.name})"
        )
    except Exception as e:  # installed but broken: say so rather than crash
        return f"not importable ({type(e).__name__}: {e})"
    return None


# ----- the in-memory checkpoint: one copy of each rank's shard per step, in tmpfs
class ShardCheckpoint:
    """Two slots per (world size, rank) under `root` (tmpfs): `w<W>.rank<r>.slot<s>` holds the raw
    shard [n_chunks, 3, chunk_elems], `...commit` (JSON: step, world, nbytes, fingerprint) is
    written after the bytes, so a torn write is never loaded. Step n goes to slot n % 2.

    Restore loads the newest step that every rank of one world size committed. In the same world
    size each rank reads its own file (a memcpy, bit-exact); after a shrink each rank reads its
    new range out of the old shards (ZeRO-1 shards are contiguous ranges of the flat state).
    """

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root, self.fingerprint = root, fingerprint
        root.mkdir(parents=True, exist_ok=True)
        self._fds: dict[tuple[int, int, int], int] = {}

    def path(self, world: int, rank: int, slot: int) -> Path:
        return self.root / f"w{world}.rank{rank}.slot{slot}"

    def _committed(self, world: int, rank: int) -> dict[int, int]:
        """{step: slot} of the slots of (world, rank) with a matching commit marker."""
        out: dict[int, int] = {}
        for slot in (0, 1):
            p = self.path(world, rank, slot)
            try:
                mark = json.loads(p.with_name(p.name + ".commit").read_text())
                size = p.stat().st_size
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if not isinstance(mark, dict) or not isinstance(mark.get("step"), int):
                continue
            if (mark.get("fingerprint"), mark.get("slot"), mark.get("world"), mark.get("nbytes")) == (
                self.fingerprint,
                slot,
                world,
                size,
            ):
                out[mark["step"]] = slot
        return out

    def newest(self) -> tuple[int, int] | None:
        """(step, world size) of the newest step that every rank of some world size committed."""
        best: tuple[int, int] | None = None
        for world in sorted({int(p.name.split(".")[0][1:]) for p in self.root.glob("w*.rank*.slot*.commit")}):
            common: set[int] | None = None
            for r in range(world):
                steps = set(self._committed(world, r))
                common = steps if common is None else common & steps
            if common:
                cand = (max(common), world)
                best = cand if best is None or cand[0] > best[0] else best
        return best

    def _load(self, world: int, rank: int, step: int, out: torch.Tensor) -> None:
        p = self.path(world, rank, self._committed(world, rank)[step])
        nbytes = out.numel() * out.element_size()
        with open(p, "rb") as f:
            if f.readinto(memoryview(out.numpy()).cast("B")) != nbytes:
                raise RuntimeError(f"{p} is shorter than its commit marker says")

    def restore(self, member: RankMember) -> tuple[int, int] | None:
        """Load the newest complete checkpoint into `member` (a collective); (step, its world size)."""
        found = self.newest()
        step, world = found if found is not None else (-1, 0)
        agree = torch.tensor([step, -step, world, -world], dtype=torch.int64)
        member.comm.all_reduce(agree, dist.ReduceOp.MAX)
        if agree[0] != -agree[1] or agree[2] != -agree[3]:
            raise RuntimeError(f"ranks see different checkpoints: {agree.tolist()}")
        if found is None:
            return None
        member.set_step(step)  # first: `member.state` may be a buffer chosen by the step
        state = member.state
        if world == member.world_size:
            self._load(world, member.rank, step, state)
        else:
            self._reshard(world, step, member)
        member.param_shard.copy_(state[:, MASTER, :].reshape(-1))
        member.comm.all_gather(member.flat_param, member.param_shard)
        return step, world

    def _reshard(self, world: int, step: int, member: RankMember) -> None:
        ce = member.chunk_elems
        old_chunks = -(-member.numel // (world * ce))
        old_elems = old_chunks * ce
        new_elems = member.shard_elems
        lo, hi = member.rank * new_elems, (member.rank + 1) * new_elems
        rows = torch.zeros(3, new_elems)  # this rank's new range of (master, exp_avg, exp_avg_sq)
        buf = torch.empty(old_chunks, 3, ce)
        for q in range(world):
            a, b = max(lo, q * old_elems), min(hi, (q + 1) * old_elems)
            if a >= b:
                continue
            self._load(world, q, step, buf)
            old_rows = buf.transpose(0, 1).reshape(3, old_elems)
            rows[:, a - lo : b - lo] = old_rows[:, a - q * old_elems : b - q * old_elems]
        member.state.copy_(rows.view(3, member.n_chunks, ce).transpose(0, 1))

    def save(self, member: RankMember) -> float:
        """Copy this rank's shard at the trainer's step; returns the seconds it took."""
        t0 = time.perf_counter()
        step, world, rank = member.step_count, member.world_size, member.rank
        slot = step % 2
        p = self.path(world, rank, slot)
        marker = p.with_name(p.name + ".commit")
        marker.unlink(missing_ok=True)  # from here until the new marker, the slot is not loadable
        key = (world, rank, slot)
        fd = self._fds.get(key)
        if fd is None:
            fd = self._fds[key] = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
        data = memoryview(member.state.numpy()).cast("B")
        write_whole(fd, data)
        tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps(
                {"step": step, "slot": slot, "world": world, "nbytes": len(data), "fingerprint": self.fingerprint}
            )
        )
        os.replace(tmp, marker)
        return time.perf_counter() - t0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def fingerprint(args: argparse.Namespace) -> str:
    """What a checkpoint must match (not the world size: a shrunk job reshards the state)."""
    import hashlib

    cfg = {"model": args.model, "seed": args.seed, "lr": args.lr, "steps": args.steps, "chunk_bytes": args.chunk_bytes}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


# ----- the worker
@dataclass
class _Ctx:
    """What outlives a restart: built once per process (NVRx's advanced example: process-group
    independent objects are created outside the wrapped function and reused)."""

    args: argparse.Namespace
    run_dir: Path
    store: Any  # a client of the harness's store (training process groups)
    initial_rank: int
    node: int
    nodes: int
    timeout_s: float
    model: GPT
    init: list[torch.Tensor]  # the initial parameters: a restart with no checkpoint starts from them
    sampler: Sampler
    tokens: int
    ckpt: ShardCheckpoint
    save_s: list[float] = field(default_factory=list)


def _train(ctx: _Ctx, call_wrapper) -> dict:
    """The wrapped function: one NVRx restart iteration, from the checkpoint to the end."""
    t_call = time.perf_counter()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # active rank / size, set by NVRx
    it = call_wrapper.iteration
    store = dist.PrefixStore(f"{STORE_PREFIX}iter{it}/", ctx.store)
    with torch.no_grad():
        for p, v in zip(ctx.model.parameters(), ctx.init):
            p.copy_(v)
    config = solo(
        JobConfig(
            training=TrainingConfig(workers=world, nodes=ctx.nodes), timeouts=Timeouts(collective_s=ctx.timeout_s)
        )
    )
    job = Job(
        config=config,
        role="worker",
        rank=rank,
        world_size=world,
        node=ctx.node,
        run_dir=ctx.run_dir,
        store=store,
        proc_id="solo",  # "solo": no Leto membership or heartbeat (RankMember.connect)
        device=torch.device("cpu"),
    )
    args = ctx.args
    optimizer = AdamW(lr=warmup_cosine(args.lr, warmup=min(20, args.steps // 10), total=args.steps))
    trainer = Trainer(ctx.model, job, optimizer, chunk_bytes=args.chunk_bytes)
    try:
        # the harness names this process by its new rank in procs.json before any step is recorded
        store.set(f"assign/{rank}", json.dumps({"initial_rank": ctx.initial_rank, "pid": os.getpid()}))
        t_connect = time.perf_counter()
        trainer.member.connect()
        t_connected = time.perf_counter()
        if rank == 0:  # numbered in order of publication: an iteration cut short publishes nothing
            assign = {json.loads(store.get(f"assign/{r}"))["initial_rank"]: r for r in range(world)}
            seq = ctx.store.add(f"{STORE_PREFIX}assignments", 1) - 1
            ctx.store.set(f"{STORE_PREFIX}assignment/{seq}", json.dumps(assign))
            ctx.store.wait([f"{STORE_PREFIX}procs/{seq}"], timedelta(seconds=ctx.timeout_s))
            runlog.event(
                ctx.run_dir,
                "job_up",
                iteration=it,
                world_size=world,
                assignment={str(k): v for k, v in assign.items()},
                build_s=round(t_connect - t_call, 4),  # model reset, Trainer
                connect_s=round(t_connected - t_connect, 4),  # gloo group + broadcast
                call_s=round(time.perf_counter() - t_call, 4),
            )
        t0 = time.perf_counter()
        restored = ctx.ckpt.restore(trainer.member)
        restore_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        trainer.member.comm.all_reduce(restore_s, dist.ReduceOp.MAX)
        if restored is not None and rank == 0:
            runlog.event(
                ctx.run_dir,
                "restore",
                iteration=it,
                step=restored[0],
                restore_s=round(float(restore_s), 6),
                from_world_size=restored[1],
                world_size=world,
                resharded=restored[1] != world,
            )
        for step in trainer.steps(args.steps):
            x, y, weight = ctx.sampler.batch(step, trainer.rank, trainer.world_size)
            trainer.step(lambda: ctx.model(x, y), weight=weight, tokens=ctx.tokens)
            with call_wrapper.atomic():  # the guide: no checkpoint write once a restart has begun
                ctx.save_s.append(ctx.ckpt.save(trainer.member))
        result = {
            "steps": trainer.step_count,
            "final_loss": trainer.last_loss,
            "digest": trainer.digest(),
            "iteration": it,
            "world_size": world,
        }
        if rank == 0:
            result["ckpt_save_s_median"] = round(statistics.median(ctx.save_s), 6) if ctx.save_s else None
            (ctx.run_dir / "result.json").write_text(json.dumps(result))
        return result
    except BaseException:
        if trainer.member.comm is not None:  # a gloo group with a dead peer: never destroy it (it may block)
            trainer.member.comm.close(abandon=True)
        raise


def _wrapper(ctx: _Ctx, host: str, port: int, workers: int, max_iterations: int | None):
    """`inprocess.Wrapper` configured for this job (see docs/baselines.md)."""
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess.abort import Abort, AbortTorchDistributed
    from nvidia_resiliency_ext.inprocess.store import StoreMixin

    class HarnessStore(torch.distributed.TCPStore, StoreMixin):
        """NVRx's store as a client of the store the harness hosts. By default NVRx's rank 0 hosts
        it and "node failure on rank 0 causes termination of the entire job"; the guide's remedy is
        a `StoreMixin` subclass passed as `store_factory`. No rank is critical then."""

        def __init__(self, host_name: str, port: int, timeout: timedelta = timedelta(seconds=300)) -> None:
            super().__init__(host_name, port, is_master=False, timeout=timeout, wait_for_workers=False, use_libuv=True)

        def get_packed(self, key: str, sep: str) -> list[str]:
            # NVRx 0.7.0 bug: when a rank's monitor process dies too (a node loss), the sibling
            # monitor enters the termination barrier for it with the raw bytes of
            # `get_initial_ranks` (`b'2'`), and every survivor's final barrier then fails to parse
            # that entry and hangs until the hard timeout. Read such entries as the rank they name.
            return [v[2:-1] if v.startswith("b'") and v.endswith("'") else v for v in super().get_packed(key, sep)]

    failure_store = dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=ctx.timeout_s), wait_for_workers=False
    )

    class RecordFailure(Abort):
        """Runs first in NVRx's abort (the monitor thread, once a fault is seen): the first rank to
        get there records NVRx's detection as the run's `failure` event."""

        def __call__(self, state):
            try:
                if failure_store.add(f"{STORE_PREFIX}failure/{state.iteration}", 1) == 1:
                    runlog.event(
                        ctx.run_dir,
                        "failure",
                        iteration=state.iteration,
                        seen_by_initial_rank=state.initial_rank,
                        cause="nvrx restart",
                    )
            except Exception:  # the record is evidence, never a reason to fail the abort
                pass
            return state

    def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict:
        return _train(ctx, call_wrapper)

    run_dir = ctx.run_dir
    return inprocess.Wrapper(
        store_factory=HarnessStore,
        store_kwargs={"host_name": host, "port": port, "timeout": timedelta(seconds=ctx.timeout_s)},
        initialize=inprocess.initialize.RetryController(
            max_iterations=max_iterations, min_world_size=1, min_active_world_size=1
        ),
        abort=inprocess.Compose(AbortTorchDistributed(), RecordFailure()),  # the last one runs first
        rank_assignment=inprocess.Compose(
            inprocess.rank_assignment.MaxActiveWorldSize(workers),  # ranks past `workers` are spares
            inprocess.rank_assignment.ShiftRanks(),  # survivors close the gaps
        ),
        monitor_thread_interval=timedelta(seconds=MONITOR_INTERVAL_S),
        monitor_process_interval=timedelta(seconds=MONITOR_INTERVAL_S),
        progress_watchdog_interval=timedelta(seconds=MONITOR_INTERVAL_S),
        heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
        heartbeat_timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_S),
        last_call_wait=timedelta(seconds=LAST_CALL_WAIT_S),
        termination_grace_time=timedelta(seconds=TERMINATION_GRACE_S),
        monitor_process_logfile=str(run_dir / "nvrx" / "monitor-{rank}.log"),
        monitor_process_pidfile=str(run_dir / "nvrx" / "monitor-{rank}.pid"),
    )(train)


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="leto.baselines.nvrx_job worker")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--store", required=True, help="host:port of the harness's store")
    p.add_argument("--workers", type=int, required=True, help="active ranks (the others are spares)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node", type=int, default=0)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--max-iterations", type=int, default=None)
    ours, rest = p.parse_known_args(argv)
    args = train_gpt.parse(rest)
    torch.set_num_threads(1)  # workers share the machine's cores
    host, port = ours.store.rsplit(":", 1)
    cfg = PRESETS[args.model]
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    store = dist.TCPStore(
        host, int(port), is_master=False, timeout=timedelta(seconds=ours.timeout), wait_for_workers=False
    )
    ctx = _Ctx(
        args,
        ours.run_dir,
        store,
        int(os.environ["RANK"]),
        ours.node,
        ours.nodes,
        ours.timeout,
        model,
        [p.detach().clone() for p in model.parameters()],
        Sampler(load_tokens(), cfg.block_size, cfg.batch_size, args.seed),
        cfg.batch_size * cfg.block_size,
        ShardCheckpoint(ours.ckpt_dir, fingerprint(args)),
    )
    wrapped = _wrapper(ctx, host, int(port), ours.workers, ours.max_iterations)
    try:
        wrapped()  # spares return None; every rank returns once the job is done
    finally:
        ctx.ckpt.close()


# ----- the harness
def _alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in "ZX"


def _state(pid: int) -> str:
    """ "ours" (a live process of this job: a pid read from a pidfile may have been reused),
    "exiting" (its command line is already gone), "gone", or "other"."""
    if not _alive(pid):
        return "gone"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    if not cmd:
        return "exiting"
    return "ours" if b"leto.baselines.nvrx_job" in cmd else "other"


def _wait_gone(pid: int, deadline: float) -> str:
    state = _state(pid)
    while state in ("ours", "exiting") and time.monotonic() < deadline:
        time.sleep(0.02)
        state = _state(pid)
    return state


class _Harness:
    """Starts the ranks, hosts the store, keeps procs.json current, stops everything at the end."""

    def __init__(self, run_dir: Path, workers: int, spares: int, nodes: int, timeout_s: float) -> None:
        self.run_dir, self.workers, self.spares, self.nodes = run_dir, workers, spares, nodes
        self.timeout_s = timeout_s
        self.world = workers + spares
        # initial placement: workers as Leto's controller places them, spare i on node i % nodes
        self.node = [
            node_of_rank(r, workers, nodes) if r < workers else (r - workers) % nodes for r in range(self.world)
        ]
        self.procs: dict[int, subprocess.Popen] = {}
        self.active: dict[int, int] = {r: r for r in range(workers)}  # initial rank -> current rank
        self.exits: dict[int, int] = {}  # initial rank -> exit code
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.store = loopback_store(timeout_s)  # (NVRx's stores are clients of this one)
        self.thread = threading.Thread(target=self._follow, daemon=True, name="leto-nvrx-assign")

    def monitor_pid(self, r: int) -> int | None:
        try:
            return int((self.run_dir / "nvrx" / f"monitor-{r}.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def write_procs(self) -> None:
        recs = [{"role": "controller", "rank": None, "node": None, "pid": os.getpid(), "id": "harness"}]
        with self.lock:
            for r, popen in self.procs.items():
                if r in self.exits:
                    continue
                cur = self.active.get(r)
                recs.append(
                    {
                        "role": "worker" if cur is not None else "spare",
                        "rank": cur,
                        "node": self.node[r],
                        "pid": popen.pid,
                        "id": f"rank{r}",
                    }
                )
                mon = self.monitor_pid(r)
                if mon is not None and _alive(mon):
                    recs.append(
                        {"role": "monitor", "rank": None, "node": self.node[r], "pid": mon, "id": f"monitor{r}"}
                    )
        runlog.write_procs(self.run_dir, recs)

    def _follow(self) -> None:
        """Each restart iteration, rank 0 publishes initial rank -> rank; procs.json follows before
        the iteration records its first step (the fault injector picks its target from it)."""
        client = dist.TCPStore(
            "127.0.0.1",
            self.store.port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        seq = 0
        while not self.stop.is_set():
            key = f"{STORE_PREFIX}assignment/{seq}"
            if not client.check([key]):  # polled: a timed-out wait logs a warning in this process
                time.sleep(0.002)
                continue
            assign = {int(k): v for k, v in json.loads(client.get(key)).items()}
            with self.lock:
                self.active = assign
            self.write_procs()
            client.set(f"{STORE_PREFIX}procs/{seq}", "1")
            seq += 1

    def spawn(self, cmd: list[str]) -> None:
        (self.run_dir / "nvrx").mkdir(exist_ok=True)
        runlog.event(self.run_dir, "launch", workers=self.workers, spares=self.spares)
        for r in range(self.world):
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(self.world),
                MASTER_ADDR=LOOPBACK,
                MASTER_PORT=str(self.store.port),
                **network_env(LOOPBACK),
            )
            env.setdefault("TORCH_CPP_LOG_LEVEL", "error")  # the guide: store-wait timeouts warn otherwise
            env.pop("LOCAL_RANK", None)  # with LOCAL_RANK NVRx adds GPU, NVLink and NIC health checks
            with open(self.run_dir / f"rank{r}.log", "a") as log:
                self.procs[r] = subprocess.Popen(
                    [sys.executable, "-m", "leto.baselines.nvrx_job", "worker", *cmd, "--node", str(self.node[r])],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                    preexec_fn=die_with_parent,
                )  # nothing outlives a SIGKILLed harness
        self.write_procs()
        self.thread.start()

    def supervise(self, deadline_s: float) -> int:
        """Until every rank has exited; 0 if the job finished (result.json), else 1 (124: too long)."""
        deadline = time.monotonic() + deadline_s
        monitors_listed: set[int] = set()
        while True:
            changed = False
            for r, popen in self.procs.items():
                rc = popen.poll()
                if rc is not None and r not in self.exits:
                    with self.lock:
                        self.exits[r] = rc
                        cur = self.active.get(r)
                    changed = True
                    if rc != 0:
                        runlog.event(
                            self.run_dir,
                            "exit",
                            initial_rank=r,
                            rank=cur,
                            node=self.node[r],
                            pid=popen.pid,
                            code=rc,
                            cause=describe_exit(rc),
                        )
                if r not in monitors_listed and self.monitor_pid(r) is not None:
                    monitors_listed.add(r)
                    changed = True
            if changed:
                self.write_procs()
            if len(self.exits) == len(self.procs):
                return 0 if (self.run_dir / "result.json").exists() else 1
            if time.monotonic() > deadline:
                return 124
            time.sleep(POLL_S)

    def shutdown(self) -> None:
        self.stop.set()
        stop_processes(list(self.procs.values()))
        # NVRx's monitor processes are daemons (double fork, own session): by PID from their pidfiles;
        # a monitor exits by itself once its rank has exited
        end = time.monotonic() + STOP_GRACE_S
        for pid in filter(None, (self.monitor_pid(r) for r in range(self.world))):
            if _wait_gone(pid, end) == "ours":
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, time.monotonic() + STOP_GRACE_S)
        self.thread.join(timeout=1.0)
        with self.lock:
            self.exits.update({r: p.returncode for r, p in self.procs.items()})
        self.write_procs()


def run(
    *,
    workers: int,
    steps: int,
    seed: int,
    model: str,
    run_dir: Path,
    injector: object = None,
    quiet: bool = True,
    nodes: int = 1,
    spares: int = DEFAULT_SPARES,
    max_restarts: int = 3,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_args: list[str] | None = None,
    ckpt_dir: Path | None = None,
    **_: object,
) -> dict:
    """Run the NVRx baseline; returns the summary (same format as the other baselines)."""
    status = nvrx_status()
    if status is not None:
        raise RuntimeError(f"nvidia-resiliency-ext=={NVRX_VERSION} is {status}")
    run_dir = Path(run_dir).absolute()  # NVRx takes only absolute paths for its monitors' logs
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json", "result.json", "procs.json"):
        (run_dir / stale).unlink(missing_ok=True)
    for f in (run_dir / "nvrx").glob("monitor-*.pid") if (run_dir / "nvrx").exists() else []:
        f.unlink()
    own_ckpt = ckpt_dir is None
    ckpt = Path(ckpt_dir) if ckpt_dir is not None else DEFAULT_SHM / f"leto-nvrx-{uuid.uuid4().hex[:12]}"
    t0 = time.time()
    harness = _Harness(run_dir, workers, spares, nodes, timeout_s)
    cmd = [
        "--run-dir",
        str(run_dir),
        "--store",
        f"127.0.0.1:{harness.store.port}",
        "--workers",
        str(workers),
        "--nodes",
        str(nodes),
        "--ckpt-dir",
        str(ckpt),
        "--timeout",
        str(timeout_s),
        "--max-iterations",
        str(max_restarts + 1),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--model",
        model,
        *(job_args or []),
    ]
    try:
        harness.spawn(cmd)
        code = harness.supervise(max(600.0, steps * 10.0))
    finally:
        harness.shutdown()
        if own_ckpt:
            import shutil

            shutil.rmtree(ckpt, ignore_errors=True)
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        result = {"steps": None, "final_loss": None, "digest": None}
    if result.get("steps") != steps and code == 0:
        code = 1
    kills = sorted(getattr(injector, "kills", []), key=lambda k: k.time)
    records = _records(run_dir)
    iterations = [r for r in records if r.get("event") == "job_up"]
    summary = {
        "steps": result.get("steps"),
        "final_loss": result.get("final_loss"),
        "digest": result.get("digest"),
        "wall_s": round(time.time() - t0, 3),
        "workers": workers,
        "spares": spares,
        "nodes": nodes,
        "exit_code": code,
        "system": "nvrx",
        "nvrx": NVRX_VERSION,
        "restarts": len(iterations) - 1 if iterations else 0,
        "final_world_size": result.get("world_size"),
        "ckpt_save_s_median": result.get("ckpt_save_s_median"),
        "exits": [{"initial_rank": r, "code": c} for r, c in sorted(harness.exits.items()) if c != 0],
        "recoveries": _recoveries(records, kills),
        "injection_errors": list(getattr(injector, "errors", [])),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _records(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / runlog.METRICS)


def _recoveries(records: list[dict], kills: list) -> list[dict]:
    """One record per NVRx restart (its `failure` event), all times from the failure: the injected
    kill when there was one, else the first death the harness saw, else NVRx's detection."""
    steps = sorted((r for r in records if "event" not in r and isinstance(r.get("step"), int)), key=lambda r: r["time"])
    ev = lambda kind: sorted((r for r in records if r.get("event") == kind), key=lambda r: r["time"])  # noqa: E731
    failures, ups, restores, exits = ev("failure"), ev("job_up"), ev("restore"), ev("exit")
    rnd = lambda x: None if x is None else round(x, 3)  # noqa: E731
    out = []
    for fail in failures:
        prev = [u for u in ups if u["time"] <= fail["time"]]
        lo = prev[-1]["time"] if prev else float("-inf")
        up = next((u for u in ups if u["time"] > fail["time"]), None)
        hi = up["time"] if up else float("inf")
        kill = ([k for k in kills if lo < k.time <= fail["time"]] or [None])[-1]
        gone = [e for e in exits if lo < e["time"] <= hi]
        t = kill.time if kill else min([e["time"] for e in gone] + [fail["time"]])
        failed_at = max((r["step"] for r in steps if r["time"] <= t), default=0)
        res = next((r for r in restores if up and r.get("iteration") == up.get("iteration")), None)
        after = [r for r in steps if r["time"] > t]
        regain = next((r for r in after if r["step"] > failed_at), None)
        before = {int(i) for i in (prev[-1]["assignment"] if prev else {})}
        now = {int(i) for i in (up["assignment"] if up else {})}
        spec = kill.spec if kill else None
        cause = (
            f"{spec.get('kind')} of "
            + (f"worker rank {spec['rank']}" if spec.get("rank") is not None else f"node {spec.get('node')}")
            if spec
            else "; ".join(f"initial rank {e['initial_rank']} {e['cause']}" for e in gone) or "an exception"
        )
        out.append(
            {
                "cause": cause,
                "injected": spec,
                "iteration": fail.get("iteration"),
                "rank": spec.get("rank") if spec else None,
                "node": spec.get("node") if spec else None,
                "failed_initial_ranks": sorted(e["initial_rank"] for e in gone),
                "promoted_spares": sorted(now - before),
                "world_size_after": up["world_size"] if up else None,
                "failed_at_step": failed_at,
                "restored_step": res["step"] if res else (0 if up else None),
                "lost_steps": (failed_at - res["step"]) if res else (failed_at if up else None),
                "detect_s": rnd(fail["time"] - t),
                "restart_s": rnd(up["time"] - fail["time"]) if up else None,
                "restore_s": res["restore_s"] if res else None,
                "first_step_s": rnd(after[0]["time"] - t) if after else None,
                "total_s": rnd(regain["time"] - t) if regain else None,
                "time": t,
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker_main(argv[1:])
    else:
        raise SystemExit(
            "usage: python -m leto.baselines.nvrx_job worker ... (the harness is leto.baselines.restart --system nvrx)"
        )


if __name__ == "__main__":
    main()
