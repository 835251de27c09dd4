"""The torchft baseline (optional extra: `pip install torchft==0.2.0`): per-step fault tolerance
across replica groups, one replica group per worker, on the same GPT, data and AdamW.

Each worker is its own replica group (world size 1) and keeps the full model and AdamW state
(DDP, not ZeRO: torchft's replicas each hold a full copy, which is what lets a survivor serve a
healing replica). Every step: `manager.start_quorum()`, the batch split by the quorum (the global
batch stays the same whatever the number of participants), a SUM `manager.allreduce` of the
weighted gradient, and the AdamW update only if `manager.should_commit()`. When a worker dies the
survivors' all-reduce fails, the step is not committed, the lighthouse forms a smaller quorum and
training goes on; the harness restarts the dead worker (as torchx would), which heals from a
survivor over torchft's HTTP checkpoint transport and rejoins. A replacement that comes up after the
survivors have finished stops without training (alone, it would form a quorum of one and train a
second model from its own step 0).

The harness (`run`) starts the lighthouse in its own process (the Rust server from the wheel),
the workers, keeps run_dir/procs.json current, restarts dead workers and writes summary.json.
Every server of the job (the lighthouse, each replica's store, manager server, checkpoint server
and gloo) listens on, and is advertised at, 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from leto.config import DEFAULT_TIMEOUT_S
from leto.console import read_jsonl
from leto.protocol.messages import node_of_rank
from leto.runtime import runlog
from leto.runtime.env import LOOPBACK, loopback_store, network_env
from leto.runtime.linux import describe_exit
from leto.training import train_gpt
from leto.training.corpus import load_tokens
from leto.training.data import Sampler
from leto.training.flat import bind_grads, flatten, state_digest
from leto.training.model import GPT, PRESETS
from leto.training.optim import MASTER, AdamW, warmup_cosine
from leto.training.shard import STATE_NAMES

HEARTBEAT_TIMEOUT_MS = 1000  # the lighthouse's default is 5000; a tuned deployment detects faster
JOIN_TIMEOUT_MS = 2000
QUORUM_TICK_MS = 50
STOP_GRACE_S = 5.0
DONE = "done"  # run_dir/DONE: a replica reached the last step; later quorums must not start


def _quiet_rust_logs() -> None:
    os.environ.setdefault("RUST_LOG", "warn")


# ----- the worker
def _flatten(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Make every parameter and gradient a view of one flat buffer (full replica, DDP)."""
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    flat, grad = flatten(params, numel), torch.zeros(numel)
    bind_grads(params, grad)
    return flat, grad, numel


def digest(step: int, flat: torch.Tensor, state: torch.Tensor) -> str:
    """The same digest as `Trainer.digest` (step, params, master, exp_avg, exp_avg_sq)."""
    return state_digest(step, {"params": flat, **dict(zip(STATE_NAMES, state, strict=True))})


def _barrier(run_dir: Path, replica: int, expect: int, timeout_s: float) -> None:
    """At the first start, wait until `expect` replicas heartbeat, so the first quorum has them all."""
    (run_dir / f"ready-{replica}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(run_dir.glob("ready-*"))) < expect:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(run_dir.glob('ready-*')))} of {expect} replicas started")
        time.sleep(0.02)


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="leto.baselines.torchft_job worker")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--expect", type=int, default=0, help="replicas to wait for before the first quorum")
    ours, rest = p.parse_known_args(argv)
    args = train_gpt.parse(rest)
    _quiet_rust_logs()
    from torch.distributed import ReduceOp
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    t_start = time.time()
    cfg = PRESETS[args.model]
    torch.manual_seed(args.seed)  # every replica starts from the same weights (init_sync=False)
    model = GPT(cfg)
    flat, grad, numel = _flatten(model)
    state = torch.zeros(3, numel)
    state[MASTER].copy_(flat)
    optimizer = AdamW(lr=warmup_cosine(args.lr, warmup=min(20, args.steps // 10), total=args.steps))
    sampler = Sampler(load_tokens(), cfg.block_size, cfg.batch_size, args.seed)
    scratch, loss_t = torch.zeros(numel), torch.zeros(1)
    heal_s: list[float] = []  # load times of the state a peer sent (healing)

    def load_state_dict(sd: dict) -> None:
        t0 = time.perf_counter()
        state.copy_(sd["state"])
        flat.copy_(state[MASTER])
        heal_s.append(time.perf_counter() - t0)

    store = loopback_store(ours.timeout)  # this replica group's own
    timeout = timedelta(seconds=ours.timeout)
    transport = _loopback_transport(timeout)  # (before the manager is made: it binds its server too)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"state": state},
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"replica{ours.replica}",
        store_addr=LOOPBACK,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=ours.lighthouse,
        timeout=timeout,
        quorum_timeout=timeout,
        init_sync=False,
        hostname=LOOPBACK,
        checkpoint_transport=transport,
    )
    run_dir = ours.run_dir
    runlog.event(run_dir, "replica_up", replica=ours.replica, startup_s=round(time.time() - t_start, 3))
    _barrier(run_dir, ours.replica, ours.expect, ours.timeout)
    tokens = cfg.batch_size * cfg.block_size
    t_last = time.perf_counter()
    done = run_dir / DONE
    try:
        while manager.current_step() < args.steps:
            if done.exists():
                # the survivors finished without us: a quorum now would be ours alone, from whatever
                # step we are at, and would train a second, different model; the job's state is theirs
                runlog.event(run_dir, "abandoned", replica=ours.replica, step=manager.current_step())
                return
            t_q = time.perf_counter()
            manager.start_quorum()
            if heal_s:
                runlog.event(
                    run_dir,
                    "heal",
                    replica=ours.replica,
                    step=manager.current_step(),
                    restore_s=round(heal_s.pop(), 6),
                    quorum_s=round(time.perf_counter() - t_q, 6),
                )
            step = manager.current_step()
            if step >= args.steps:
                break
            rank, world = manager.participating_rank(), manager.num_participants()
            if rank is None:
                continue
            x, y, weight = sampler.batch(step, rank, world)
            grad.zero_()
            loss = model(x, y)
            (loss * weight).backward()
            loss_t.fill_(loss.item() * weight)
            manager.allreduce(grad, reduce_op=ReduceOp.SUM).wait()
            manager.allreduce(loss_t, reduce_op=ReduceOp.SUM).wait()
            if manager.should_commit():
                optimizer.update(state, grad, state, step + 1, scratch)
                flat.copy_(state[MASTER])
                now = time.perf_counter()
                if rank == 0:
                    runlog.append(
                        run_dir,
                        {
                            "step": step + 1,
                            "loss": float(loss_t.item()),
                            "step_s": round(now - t_last, 6),
                            "tokens_per_s": round(tokens / (now - t_last), 1),
                            "participants": world,
                        },
                    )
                t_last = now
            elif rank == 0:
                runlog.event(run_dir, "step_failed", step=step + 1, participants=world)
        result = {
            "steps": manager.current_step(),
            "final_loss": float(loss_t.item()),
            "digest": digest(manager.current_step(), flat, state),
        }
        (run_dir / f"result-{ours.replica}.json").write_text(json.dumps(result))
        done.touch()
    finally:
        manager.shutdown(wait=False)


def _loopback_transport(timeout: timedelta) -> object:
    """torchft's HTTP checkpoint transport, bound to and advertised at 127.0.0.1; and its
    manager server bound there. torchft binds both to every interface (`[::]`) and advertises the
    host name, with no option to say otherwise: its module globals are replaced here."""
    from http.server import ThreadingHTTPServer

    from torchft import manager
    from torchft.checkpointing import http_transport

    class LoopbackServer(ThreadingHTTPServer):
        request_queue_size = 1024

        def __init__(self, address: tuple, handler: type) -> None:
            super().__init__((LOOPBACK, address[1]), handler)

    class LoopbackTransport(http_transport.HTTPTransport):
        def address(self) -> str:
            return f"http://{LOOPBACK}:{self._server.socket.getsockname()[1]}/checkpoint/"

    server = manager.ManagerServer

    def manager_server(*, bind: str, **kw: object) -> object:
        return server(bind=f"{LOOPBACK}:{bind.rsplit(':', 1)[1]}", **kw)

    http_transport._IPv6HTTPServer = LoopbackServer
    manager.ManagerServer = manager_server
    return LoopbackTransport(timeout=timeout, num_chunks=0)


# ----- the harness
def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(
            [sys.executable, *cmd],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"), **network_env(LOOPBACK)),
        )


def _write_procs(
    run_dir: Path, procs: dict[int, subprocess.Popen], lighthouse: subprocess.Popen, workers: int, nodes: int
) -> None:
    recs = [
        {"role": "controller", "rank": None, "node": None, "pid": os.getpid(), "id": "controller"},
        {"role": "lighthouse", "rank": None, "node": None, "pid": lighthouse.pid, "id": "lighthouse"},
    ]
    recs += [
        {"role": "worker", "rank": r, "node": node_of_rank(r, workers, nodes), "pid": p.pid, "id": f"replica{r}"}
        for r, p in procs.items()
        if p.poll() is None
    ]
    runlog.write_procs(run_dir, recs)


def stop_processes(popens: list[subprocess.Popen]) -> None:
    """SIGTERM each live process, SIGKILL what is left after STOP_GRACE_S, reap all."""
    for p in popens:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in popens:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _lighthouse_addr(log: Path, popen: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"the torchft lighthouse exited with {popen.returncode}; see {log}")
        text = log.read_text() if log.exists() else ""
        for line in text.splitlines():
            if line.startswith("LIGHTHOUSE "):
                return line.split()[1]
        time.sleep(0.05)
    raise TimeoutError(f"the torchft lighthouse did not start in {timeout_s}s; see {log}")


def lighthouse_main(argv: list[str]) -> None:
    """Serve a torchft lighthouse until SIGTERM (its address is printed as `LIGHTHOUSE <addr>`)."""
    _quiet_rust_logs()
    from torchft._torchft import LighthouseServer

    min_replicas = int(argv[0]) if argv else 1
    server = LighthouseServer(
        bind=f"{LOOPBACK}:0",
        min_replicas=min_replicas,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    port = server.address().rsplit(":", 1)[1]  # it advertises the host name
    print(f"LIGHTHOUSE http://{LOOPBACK}:{port}", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"]:
            time.sleep(0.1)
    finally:
        server.shutdown()


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
    max_restarts: int = 3,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_args: list[str] | None = None,
    **_: object,
) -> dict:
    """Run the torchft baseline; returns the summary (same format as the other baselines)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stale_files = [f.name for pattern in ("result-*.json", "ready-*") for f in run_dir.glob(pattern)]
    for stale in ("metrics.jsonl", "summary.json", DONE, *stale_files):
        (run_dir / stale).unlink(missing_ok=True)
    t0 = time.time()
    lh_log = run_dir / "lighthouse.log"
    lighthouse = _spawn(["-m", "leto.baselines.torchft_job", "lighthouse", "1"], lh_log)
    procs: dict[int, subprocess.Popen] = {}
    failures: list[dict] = []
    restarts = 0
    code = 0
    try:
        addr = _lighthouse_addr(lh_log, lighthouse, 60)

        def cmd(r: int, expect: int) -> list[str]:
            return [
                "-m",
                "leto.baselines.torchft_job",
                "worker",
                "--replica",
                str(r),
                "--lighthouse",
                addr,
                "--run-dir",
                str(run_dir),
                "--timeout",
                str(timeout_s),
                "--expect",
                str(expect),
                "--steps",
                str(steps),
                "--seed",
                str(seed),
                "--model",
                model,
                *(job_args or []),
            ]

        for r in range(workers):
            procs[r] = _spawn(cmd(r, workers), run_dir / f"worker{r}.log")
        _write_procs(run_dir, procs, lighthouse, workers, nodes)
        deadline = time.monotonic() + max(600.0, steps * 10.0)
        while True:
            if time.monotonic() > deadline:
                code = 124
                break
            done = [r for r, p in procs.items() if p.poll() == 0]
            for r, p in list(procs.items()):
                rc = p.poll()
                if rc is None or rc == 0:
                    continue
                failures.append(
                    {
                        "event": "failure",
                        "time": time.time(),
                        "role": "worker",
                        "rank": r,
                        "node": node_of_rank(r, workers, nodes),
                        "pid": p.pid,
                        "code": rc,
                    }
                )
                runlog.append(run_dir, failures[-1])
                if (run_dir / DONE).exists():  # nothing to rejoin: the survivors have finished
                    del procs[r]
                    continue
                if restarts >= max_restarts:
                    code = 1
                    break
                restarts += 1
                procs[r] = _spawn(cmd(r, 0), run_dir / f"worker{r}.log")  # a fresh process rejoins and heals
                _write_procs(run_dir, procs, lighthouse, workers, nodes)
            if code or len(done) == len(procs):
                break
            time.sleep(0.05)
    finally:
        stop_processes([*procs.values(), lighthouse])
        _write_procs(run_dir, {}, lighthouse, workers, nodes)
    results = [json.loads(f.read_text()) for f in sorted(run_dir.glob("result-*.json"))]
    kills = sorted(getattr(injector, "kills", []), key=lambda k: k.time)
    summary = {
        **(results[0] if results else {"steps": None, "final_loss": None, "digest": None}),
        "replicas_agree": len({r["digest"] for r in results}) == 1 if results else False,
        "replicas_finished": len(results),
        "wall_s": round(time.time() - t0, 3),
        "workers": workers,
        "spares": 0,
        "nodes": nodes,
        "exit_code": code,
        "system": "torchft",
        "restarts": restarts,
        "recoveries": _recoveries(run_dir, failures, kills),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _recoveries(run_dir: Path, failures: list[dict], kills: list) -> list[dict]:
    recs = read_jsonl(run_dir / runlog.METRICS)
    steps = [r for r in recs if "event" not in r and "step" in r]
    out = []
    for fail in failures:
        before = [k for k in kills if k.time <= fail["time"]]
        t_fail = before[-1].time if before else fail["time"]
        failed_at = max((r["step"] for r in steps if r["time"] <= t_fail), default=0)
        after = [r for r in steps if r["time"] > t_fail]
        heals = [
            r
            for r in recs
            if r.get("event") == "heal" and r.get("replica") == fail["rank"] and r["time"] > fail["time"]
        ]
        ups = [
            r
            for r in recs
            if r.get("event") == "replica_up" and r.get("replica") == fail["rank"] and r["time"] > fail["time"]
        ]
        first = after[0] if after else None
        out.append(
            {
                "cause": f"worker rank {fail['rank']} {describe_exit(fail['code'])}",
                "rank": fail["rank"],
                "node": fail["node"],
                "failed_at_step": failed_at,
                # the survivors never lose a committed step; the step in flight is recomputed
                "lost_steps": (first["step"] - 1 - failed_at) if first else None,
                "detect_s": round(fail["time"] - t_fail, 3) if before else None,
                "first_step_s": round(first["time"] - t_fail, 3) if first else None,
                "total_s": round(first["time"] - t_fail, 3) if first else None,
                "participants_after": first.get("participants") if first else None,
                "restore_s": heals[0]["restore_s"] if heals else None,  # the replacement's heal, off the critical path
                "rejoin_s": round(heals[0]["time"] - t_fail, 3) if heals else None,
                "replacement_up_s": round(ups[0]["time"] - t_fail, 3) if ups else None,
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker_main(argv[1:])
    elif argv[:1] == ["lighthouse"]:
        lighthouse_main(argv[1:])
    else:
        raise SystemExit("usage: python -m leto.baselines.torchft_job worker|lighthouse ...")


if __name__ == "__main__":
    main()
