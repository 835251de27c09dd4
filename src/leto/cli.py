"""The `leto` command: run, train, bench, simulate, data."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from leto.config import JobConfig
from leto.errors import UsageError
from leto.training.model import PRESETS
from leto.training.train_gpt import SHRINK_MODES
from leto.training.trainer import DEFAULT_CHUNK_BYTES

ENV_PERSIST_DEFAULT = "LETO_PERSIST_DEFAULT"  # the default of --persist (on | off), e.g. for a test suite

if TYPE_CHECKING:
    from leto.persistence.resume import Start


class _Parser(argparse.ArgumentParser):
    commands: dict[str, argparse.ArgumentParser]  # the job commands' parsers (the root's)

    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(f"{self.prog}: error: {message}")


def _finite(text: str) -> float:
    """An argparse type: a finite number (nan and inf would slip past every range check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


_ASK_FIELD = object()  # an option's default: its config field's


@dataclass(frozen=True)
class _Option:
    """An option of `leto run` and `leto train`. One that sets a field of a `JobConfig` section
    (`field`, "section.name") takes that field's default, shown in its help as " [default]";
    one with no field (`field` None) belongs to this attempt or to how the CLI resolves the job."""

    flag: str
    field: str | None
    help: str
    kwargs: dict  # argparse's: type, choices, metavar, action
    words: tuple[str, str] | None = None  # a bool field's (true, false) on the command line
    default: object = _ASK_FIELD  # the command line's own default (a callable: read when the parser is built)
    shown: str | None = None  # the default as the help names it, where not the default itself

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def flag_value(self, value: object) -> object:
        """A field's value as this option's value."""
        if self.words is not None:
            return self.words[0] if value else self.words[1]
        return list(value) if isinstance(value, tuple) else value

    def field_value(self, value: object) -> object:
        """This option's value (checked, not None) as its field's value."""
        if self.words is not None:
            return value == self.words[0]
        return tuple(value) if isinstance(value, list) else value


def _opt(
    flag: str,
    field: str | None,
    help: str,
    *,
    words: tuple[str, str] | None = None,
    default: object = _ASK_FIELD,
    shown: str | None = None,
    **kwargs: object,
) -> _Option:
    if words is not None:
        kwargs.setdefault("choices", list(words))
    return _Option(flag, field, help, kwargs, words, default, shown)


_ON_OFF = ("on", "off")

# The options of both job commands, in the order --help lists them. A new section of `JobConfig`
# adds its options here; their defaults are its fields'.
JOB_OPTIONS = (
    _opt("--workers", "training.workers", "worker processes (ranks)", type=int),
    _opt("--spares", "recovery.spares", "shadow trainers kept ready", type=int),
    _opt("--nodes", "training.nodes", "failure domains the workers are split over", type=int),
    _opt(
        "--tp",
        "mesh.tp",
        "tensor-parallel ranks per pipeline stage; world = DP x PP x TP, TP innermost, inside one node",
        type=int,
        metavar="T",
    ),
    _opt(
        "--pp",
        "mesh.pp",
        "pipeline stages per model replica (the model cut into stages of whole blocks, 1F1B schedule); "
        "with it leto train's --workers defaults to two replicas at least",
        type=int,
        metavar="P",
    ),
    _opt("--run-dir", None, "output folder", type=Path, default=None, shown="a new one under ./runs"),
    _opt("--timeout", "timeouts.collective_s", "collective and store timeout in seconds", type=_finite),
    _opt("--protection", "protection.enabled", "erasure-coded in-memory protection of every step", words=_ON_OFF),
    _opt(
        "--no-spare",
        "recovery.no_spare",
        "ranks lost with no shadow left: survivors take over their shards (shrink; the job grows back when a "
        "shadow is ready), or wait for a newly started shadow (wait)",
        choices=["shrink", "wait"],
    ),
    _opt(
        "--zygotes",
        "recovery.zygotes",
        "one zygote per node forks replacement shadows in milliseconds instead of starting them (CPU jobs; costs "
        "one more warm copy of the model per node)",
        words=_ON_OFF,
    ),
    _opt(
        "--fork-server",
        "training.fork_server",
        "fork each host's processes from one interpreter that imported torch once, instead of starting an "
        "interpreter for each (seconds of CPU each)",
        words=_ON_OFF,
    ),
    _opt(
        "--ec",
        "protection.ec",
        "tier-2 code across nodes, k+m (e.g. 1+1, 3+1, 2+2) or none; auto: (nodes-1)+1",
        default="auto",
    ),
    _opt(
        "--protect-every",
        "protection.every",
        "protect the state every N steps (for very large models): a recovery redoes at most N steps plus the one "
        "in flight; costs one more shard of memory per worker",
        type=int,
        metavar="N",
    ),
    _opt(
        "--protect-grads",
        "protection.grads",
        "hand each step's gradient shard to the keepers: auto does so only where the reduction leaves a rank alone "
        "with its shard (NCCL's reduce-scatter); on gloo every rank holds the whole reduced gradient and a replay "
        "takes it from a survivor; on: always",
        words=("on", "auto"),
        choices=["auto", "on"],
    ),
    _opt(
        "--rdzv",
        "rendezvous.url",
        "a multi-host job: the etcd cluster where the hosts meet; run the same command on every host "
        "(docs/deployment.md)",
        metavar="etcd://H1:2379,H2:2379,...",
        shown="one host, no etcd",
    ),
    _opt("--job-id", "rendezvous.job_id", "names the job in etcd, the same on every host (with --rdzv)", default=None),
    _opt(
        "--lease",
        "rendezvous.lease_s",
        "seconds a host may be silent before the others declare it lost (with --rdzv)",
        type=int,
        metavar="S",
    ),
    _opt(
        "--join",
        "rendezvous.join",
        "enter the running job --job-id on this new host (a replacement): admitted at the next step boundary, it "
        "gives back the ranks a lost host took, or waits as a standby (with --rdzv)",
        action="store_true",
        shown="",
    ),
    _opt(
        "--standby",
        "rendezvous.standby",
        "this host holds no rank until one is needed: it keeps warm shadows and a keeper; not counted in --nodes "
        "(with --rdzv)",
        action="store_true",
        shown="",
    ),
    # persistence, the last line of defence (docs/design.md, "Persistence")
    _opt(
        "--persist",
        None,
        "an asynchronous DCP checkpoint of the whole state every K steps, off the critical path; the last 2 "
        "complete ones are kept",
        choices=list(_ON_OFF),
        default=lambda: os.environ.get(ENV_PERSIST_DEFAULT, "on"),
        shown=f"on, or ${ENV_PERSIST_DEFAULT}",
    ),
    _opt("--persist-dir", None, "checkpoint folder", type=Path, default=None, shown="RUN_DIR/checkpoints"),
    _opt(
        "--mtbf",
        "persistence.mtbf",
        "expected time between failures the codes cannot absorb (e.g. 90s, 5m, 2h): K is the Young/Daly interval "
        "for it and the measured cost of a checkpoint",
        metavar="DURATION",
    ),
    _opt(
        "--persist-every",
        "persistence.every",
        "checkpoint every K steps instead of Young/Daly's K",
        type=int,
        metavar="K",
    ),
    _opt(
        "--persist-timeout",
        "timeouts.persist_write_s",
        "a checkpoint write unfinished after S seconds (a hung file system) is reported and abandoned; the next "
        "checkpoints go on",
        type=float,
        metavar="S",
    ),
    _opt(
        "--resume",
        None,
        "continue the run in RUN_DIR from its newest complete checkpoint, with the flags it recorded; flags given "
        "with it must agree, except --steps, the persistence flags and those of protection, recovery and timeouts",
        type=Path,
        default=None,
        metavar="RUN_DIR",
    ),
)
# `leto train`'s own (`leto run` leaves them to their defaults), after its job's arguments
TRAIN_OPTIONS = (
    _opt(
        "--inject",
        "recovery.inject",
        "inject a failure (kill, stop, hang, node-kill); repeatable",
        action="append",
        metavar="KIND:rank=R|node=N:step=S[:phase=P]",
    ),
    _opt(
        "--heartbeat-timeout",
        "timeouts.heartbeat_s",
        "seconds without a heartbeat before a worker or keeper is declared hung",
        type=_finite,
    ),
    _opt(
        "--progress-floor",
        "timeouts.progress_floor_s",
        "a worker whose training thread has not advanced for max(S, F x median step time) seconds is declared "
        "hung, though its process heartbeats",
        type=_finite,
        metavar="S",
    ),
    _opt("--progress-factor", "recovery.progress_factor", "F of --progress-floor", type=_finite, metavar="F"),
)
# the built-in job's shape where it is not a job's default: 4 workers on 2 nodes, with a shadow
TRAIN_DEFAULTS = {"training.workers": 4, "training.nodes": 2, "recovery.spares": 1}


def _options(cmd: str) -> tuple[_Option, ...]:
    return JOB_OPTIONS + (TRAIN_OPTIONS if cmd == "train" else ())


def _add_options(p: argparse.ArgumentParser, options: tuple[_Option, ...], defaults: dict[str, object]) -> None:
    """Add `options` to `p`, each with its default (a field's: `defaults`, else the section's)."""
    sections = {name: cls() for name, cls in JobConfig.sections().items()}
    for opt in options:
        if opt.default is not _ASK_FIELD:
            default = opt.default() if callable(opt.default) else opt.default
        else:
            section, name = opt.field.split(".")  # type: ignore[union-attr]
            default = opt.flag_value(defaults.get(opt.field, getattr(sections[section], name)))
        shown = opt.shown if opt.shown is not None else _shown_default(default)
        p.add_argument(opt.flag, default=default, help=f"{opt.help} [{shown}]" if shown else opt.help, **opt.kwargs)


def _shown_default(value: object) -> str:
    """A default as the help names it: none for nothing."""
    if value is None or value in ("", [], ()):
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)


def build_parser() -> _Parser:
    root = _Parser(prog="leto", description="Fault-tolerant training that recovers in place.")
    sub = root.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a training script under the Leto controller (like torchrun)")
    _add_options(run, JOB_OPTIONS, {})
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    run.add_argument(
        "script", nargs="?", default=None, help="the training script (or module with -m); with --resume, the run's"
    )
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    train = sub.add_parser("train", help="train the built-in GPT job")
    _add_options(train, JOB_OPTIONS, TRAIN_DEFAULTS)
    train.add_argument("--steps", type=int, default=300, help="training steps [300]")
    train.add_argument("--seed", type=int, default=0, help="seed of model init and data order [0]")
    train.add_argument("--model", default="tiny", help=f"size preset: {', '.join(PRESETS)} [tiny]")
    train.add_argument("--lr", type=_finite, default=3e-3, help="peak learning rate [3e-3]")
    train.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows (sequences) of the global batch, split over the workers [the model preset's]",
    )
    train.add_argument(
        "--max-grad-norm",
        type=_finite,
        default=None,
        metavar="N",
        help="clip the gradients to this global norm (over every shard, TP slice and stage) [no clipping]",
    )
    train.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="with --pp: micro-batches of each replica's batch in the pipeline schedule [2 x --pp]",
    )
    _add_options(train, TRAIN_OPTIONS, TRAIN_DEFAULTS)
    train.add_argument(
        "--shrink",
        choices=SHRINK_MODES,
        default="exact",
        help="with no shadow left: each rank left computes the launch's replicas it hosts, keeping "
        "the failure-free bits (exact), or the global batch is re-split over the ranks left, balancing "
        "the work (balanced) [exact]",
    )
    train.add_argument(
        "--chunk-bytes",
        type=int,
        default=DEFAULT_CHUNK_BYTES,
        help=f"bytes of unique state per protected chunk, a multiple of 12 [{DEFAULT_CHUNK_BYTES}]",
    )

    bench = sub.add_parser("bench", help="benchmarks that print measured ratios")
    bench.add_argument("what", choices=list(BENCHES), help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("--steps", type=int, default=None, help="measured steps per run [per benchmark]")
    bench.add_argument("--trials", type=int, default=3, help="trials per system (recovery, productivity) [3]")
    bench.add_argument(
        "--failures",
        type=int,
        default=None,
        help="productivity: worker SIGKILLs per run, at seeded random steps, the same for every system [6]",
    )
    bench.add_argument(
        "--rank-cpu",
        default=None,
        metavar="auto|off|CPUS",
        help="productivity: each process that runs a rank gets this CPU quota (a cgroup of its own), so a job "
        "that shrinks loses its lost ranks' hardware as on a GPU cluster; auto = the machine's cores / the "
        "ranks when cgroups allow it, else off [auto]",
    )
    bench.add_argument("--out", type=Path, default=None, help="folder for plots and raw results [a temp folder]")
    bench.add_argument("--workers", type=int, default=4)
    bench.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="recovery: lose a whole host of a multi-host job on a cluster of network-namespace hosts "
        "(root, etcd; 2 workers per host), next to checkpoint-restart on the same hosts",
    )
    bench.add_argument("--model", default="tiny")
    bench.add_argument(
        "--tp",
        type=int,
        default=1,
        help="overhead, recovery: tensor-parallel ranks per pipeline stage (world = DP x PP x TP, inside nodes) [1]",
    )
    bench.add_argument(
        "--pp",
        type=int,
        default=1,
        help="overhead, recovery: pipeline stages per model replica, with 2 x P micro-batches [1]",
    )
    # overhead only (docs/benchmarks.md, "Protection overhead")
    bench.add_argument(
        "--rounds", type=int, default=None, help="interleaved off/on rounds of the default job (overhead; median) [3]"
    )
    bench.add_argument(
        "--curve",
        default=None,
        metavar="none|default|full|POINTS",
        help="overhead: points of the curve of compute per protected byte besides the default job: "
        "default = 512 rows, full = 128 and 512 rows and the small preset, none, or a comma "
        "list of row counts (of --model) and preset names [default]",
    )
    bench.add_argument(
        "--curve-rounds",
        type=int,
        default=None,
        help="interleaved off/on rounds of every other curve point (overhead) [3]",
    )
    bench.add_argument(
        "--curve-steps",
        type=int,
        default=None,
        help="measured steps per run of every other curve point (overhead) [12]",
    )
    bench.add_argument(
        "--rss",
        choices=["on", "off"],
        default=None,
        help="overhead: one more protected run with a shadow and zygotes to measure the memory of "
        "the processes that exist for protection [on]",
    )

    sim = sub.add_parser("simulate", help="project productivity to large clusters", add_help=False)
    sim.add_argument("sim_args", nargs=argparse.REMAINDER)

    data = sub.add_parser("data", help="prepare the training corpus (run once at install)")
    data.add_argument("action", choices=["prepare", "info"])
    root.commands = {"run": run, "train": train}
    return root


def _check_job(args: argparse.Namespace, prog: str) -> None:
    if args.workers < 1:
        raise UsageError(f"{prog}: error: --workers must be at least 1, got {args.workers}")
    if args.spares < 0:
        raise UsageError(f"{prog}: error: --spares cannot be negative, got {args.spares}")
    if args.nodes < 1:
        raise UsageError(f"{prog}: error: --nodes must be at least 1, got {args.nodes}")
    if args.nodes > args.workers:
        raise UsageError(f"{prog}: error: --nodes ({args.nodes}) cannot exceed --workers ({args.workers})")
    if args.timeout <= 0:
        raise UsageError(f"{prog}: error: --timeout must be positive, got {args.timeout}")
    if not 0 < args.persist_timeout < float("inf"):
        raise UsageError(
            f"{prog}: error: --persist-timeout must be a positive number of seconds, got {args.persist_timeout}"
        )
    if args.protect_every < 1:
        raise UsageError(f"{prog}: error: --protect-every must be at least 1, got {args.protect_every}")
    _check_mesh(args, prog)
    args.ec = _tier2_code(args.ec, args.nodes, prog)
    _check_rdzv(args, prog)
    if args.persist not in ("on", "off"):
        raise UsageError(f"{prog}: error: ${ENV_PERSIST_DEFAULT} must be 'on' or 'off', got {args.persist!r}")
    from leto.protection.dataplane import ENV_DATA_PLANE, PLANES

    if os.environ.get(ENV_DATA_PLANE, "native") not in PLANES:
        raise UsageError(
            f"{prog}: error: ${ENV_DATA_PLANE} must be one of {', '.join(PLANES)}, got {os.environ[ENV_DATA_PLANE]!r}"
        )
    from leto.persistence.resume import check_flags

    try:
        check_flags(args.persist, args.mtbf, args.persist_every)
    except ValueError as e:
        raise UsageError(f"{prog}: error: {e}") from e


def _check_mesh(args: argparse.Namespace, prog: str) -> None:
    from leto.runtime.mesh import layout_problem

    problem = layout_problem(args.workers, args.nodes, args.tp, args.pp)
    if problem is not None:
        raise UsageError(f"{prog}: error: {problem}")


def _check_pipeline(args: argparse.Namespace, rows: int) -> None:
    """`leto train --pp P --microbatches M`: P stages of whole blocks, M micro-batches of at
    least one row in every replica's batch (sets the default M, 2 x P)."""
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    elif args.pp == 1 and args.microbatches != 1:
        raise UsageError("leto train: error: --microbatches is for a pipeline: it needs --pp 2 or more")
    if args.microbatches < 1:
        raise UsageError(f"leto train: error: --microbatches must be at least 1, got {args.microbatches}")
    layers = PRESETS[args.model].n_layer
    if args.pp > layers:
        raise UsageError(
            f"leto train: error: --pp {args.pp}: model {args.model!r} has {layers} blocks, fewer than the stages"
        )
    per_replica = rows // (args.workers // (args.tp * args.pp))
    if args.microbatches > per_replica:
        raise UsageError(
            f"leto train: error: --microbatches {args.microbatches} exceeds the {per_replica} rows of a "
            f"replica's batch (--rows {rows} over {args.workers // (args.tp * args.pp)} replicas)"
        )


def _check_rdzv(args: argparse.Namespace, prog: str) -> None:
    import socket

    from leto.protection.shm import check_job_id
    from leto.runtime.etcd_store import parse_endpoints

    if args.rdzv is None:
        if args.job_id is not None:
            raise UsageError(f"{prog}: error: --job-id names a multi-host job: it needs --rdzv")
        for flag, given in (("--join", args.join), ("--standby", args.standby)):
            if given:
                raise UsageError(
                    f"{prog}: error: {flag} is for a host of a multi-host job: it needs --rdzv and --job-id"
                )
        return
    if args.join and args.resume is not None:
        raise UsageError(
            f"{prog}: error: --join enters a job that is running; --resume starts one from its checkpoint: give one"
        )
    try:
        endpoints = parse_endpoints(args.rdzv)
    except ValueError as e:
        raise UsageError(f"{prog}: error: --rdzv: {e}") from e
    if "/" in args.rdzv[len("etcd://") :]:
        raise UsageError(f"{prog}: error: --rdzv lists endpoints only; the job is named by --job-id")
    for host, port in endpoints:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            why = e.strerror if isinstance(e, socket.gaierror) else "not a valid host name"
            raise UsageError(
                f"{prog}: error: --rdzv: the host {host!r} of endpoint {host}:{port} does not resolve ({why})"
            ) from e
    problem = check_job_id(args.job_id) if args.job_id else "it is missing"
    if problem is not None:
        raise UsageError(f"{prog}: error: --rdzv needs --job-id NAME, the same on every host: {problem}")
    if args.lease < 1:
        raise UsageError(
            f"{prog}: error: --lease must be at least 1 second (etcd's leases count whole seconds), got {args.lease}"
        )


def _run_job(config: JobConfig, summary_extra: dict) -> int:
    """One host's job, or this host's part of a multi-host one."""
    if config.rendezvous.url is not None:
        from leto.control.hosts import run_host

        return run_host(config, summary_extra)
    from leto.control.one_host import run_job

    return run_job(config, summary_extra)


def _start(args: argparse.Namespace, command: list[str], prog: str, config: JobConfig) -> tuple[Path, Start]:
    """The run folder and what persistence (or --resume) adds to the job `config` from the
    flags: `command` is what identifies the trajectory (checked on --resume)."""
    from leto.persistence import resume
    from leto.persistence.ckpt_format import CheckpointError

    flags, persist = args.recorded, args.persist == "on"
    try:
        if args.resume is not None:
            run_dir = args.resume.resolve()
            return run_dir, resume.resume(
                run_dir,
                command,
                config.persistence,
                persist=persist,
                attempt=args.job_id if args.rdzv else None,
                persist_dir=args.persist_dir,
                steps=getattr(args, "steps", None),
                flags=flags,
                tp=config.mesh.tp,
            )
        run_dir = make_run_dir(args.run_dir, prog)
        earlier = resume.earlier_run(run_dir, args.job_id if args.rdzv else None)
        if earlier:
            raise UsageError(
                f"{prog}: error: run dir {run_dir} holds an earlier run's {' and '.join(earlier)}, "
                f"which a new job would overwrite: continue that run with --resume {run_dir}, "
                f"or choose another --run-dir"
            )
        return run_dir, resume.fresh(
            run_dir, command, config.persistence, persist=persist, persist_dir=args.persist_dir, flags=flags
        )
    except CheckpointError as e:
        flag = f"--resume {args.resume}" if args.resume is not None else "--persist-dir"
        raise UsageError(f"{prog}: error: {flag}: {e}") from e


# `--resume RUN_DIR`: the flags a run records (persist.json) and continues with. This attempt's
# own are never recorded: where it meets, where its checkpoints are read, its injections.
_ATTEMPT_ONLY = ("help", "cmd", "resume", "run_dir", "persist_dir", "rdzv", "job_id", "join", "standby", "inject")
# What the trajectory is made of: given with --resume, they must agree with the record (another
# value would not continue the same training); every other flag may change on resume.
_TRAJECTORY = (
    "workers",
    "tp",
    "pp",
    "microbatches",
    "seed",
    "model",
    "lr",
    "rows",
    "chunk_bytes",
    "module",
    "script",
    "script_args",
)


def _recordable(parser: _Parser, args: argparse.Namespace) -> dict:
    """The flags of this job that a resume continues with (JSON values; the script resolved)."""
    flags = {a.dest: getattr(args, a.dest) for a in parser.commands[args.cmd]._actions if a.dest not in _ATTEMPT_ONLY}
    if args.cmd == "run" and not args.module and args.script is not None:
        flags["script"] = str(Path(args.script).resolve())
    return {"cmd": args.cmd, **flags}


def _given(argv: list[str], cmd: str) -> set[str]:
    """The flags given on the command line (not left to their defaults)."""
    parser = build_parser()
    for action in parser.commands[cmd]._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(argv))) - {"cmd"}
    return given if "script" in given else given - {"script_args"}


def _fits(action: argparse.Action, value: object) -> bool:
    """Whether a recorded `value` is one the flag of `action` could have parsed to."""
    if action.dest == "script_args":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if action.nargs == 0:  # store_true
        return isinstance(value, bool)
    if value is None:
        return action.default is None
    if isinstance(value, bool) or (action.choices is not None and value not in action.choices):
        return False
    if action.type is None:
        return isinstance(value, str)
    try:
        return action.type(str(value)) == value  # type: ignore[operator]
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False


def _shown(action: argparse.Action, value: object) -> str:
    if action.dest == "script":
        return f"the script {value}"
    if action.dest == "script_args":
        return f"the script's arguments {shlex.join(value)!r}"  # type: ignore[arg-type]
    flag = action.option_strings[-1]
    return (flag if value else f"no {flag}") if action.nargs == 0 else f"{flag} {value}"


def _with_record(parser: _Parser, argv: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """`--resume RUN_DIR`: the flags not given come from the run's record; given ones that make
    up its trajectory must agree with it. A record without flags changes nothing (the command
    line must then repeat them)."""
    from leto.persistence.ckpt_format import CheckpointError
    from leto.persistence.resume import RECORD, read_record

    where = f"leto {args.cmd}: error: --resume {args.resume}"
    if args.run_dir is not None and args.run_dir.resolve() != args.resume.resolve():
        raise UsageError(f"{where} continues that run in its own folder; drop --run-dir {args.run_dir}")
    try:
        flags = read_record(args.resume.resolve()).get("flags")
    except CheckpointError as e:
        raise UsageError(f"{where}: {e}") from e
    if not flags:
        return args
    if flags.get("cmd") != args.cmd:
        raise UsageError(
            f"{where}: it is a `leto {flags.get('cmd')}` run: resume it with `leto {flags.get('cmd')} --resume`"
        )
    actions = {a.dest: a for a in parser.commands[args.cmd]._actions if a.dest not in _ATTEMPT_ONLY}
    given, now = _given(argv, args.cmd), _recordable(parser, args)
    merged, changed = argparse.Namespace(**vars(args)), []
    for dest, value in flags.items():
        action = actions.get(dest)
        if dest == "cmd":
            continue
        if action is None or not _fits(action, value):
            raise UsageError(f"{where}: its {RECORD} is corrupt (it records {dest}={value!r})")
        if dest not in given:
            setattr(merged, dest, value)
        elif now[dest] != value and dest in _TRAJECTORY:
            raise UsageError(
                f"{where}: {_shown(action, now[dest])} differs from the run's {_shown(action, value)}: "
                f"its checkpoints belong to another configuration (drop it to continue the run as "
                f"recorded)"
            )
        elif now[dest] != value:
            changed.append(f"{_shown(action, now[dest])} (the run had {value})")
    if changed:
        print(f"leto: resuming with {', '.join(changed)}", file=sys.stderr)
    return merged


def _tier2_code(spec: str, nodes: int, prog: str) -> tuple[int, int] | None:
    from leto.protection.codec import parse_ec
    from leto.protection.placement import default_code, valid_specs

    if spec == "none":
        return None
    if spec == "auto":
        return default_code(nodes)
    try:
        k, m = parse_ec(spec)
    except ValueError as e:
        raise UsageError(f"{prog}: error: --ec: {e}") from e
    if nodes % (k + m):
        raise UsageError(
            f"{prog}: error: --ec {spec} needs a multiple of {k + m} nodes, got --nodes {nodes}; "
            f"valid: {', '.join(valid_specs(nodes)) or 'none'}"
        )
    return (k, m)


def make_run_dir(path: Path | None, prog: str, what: str = "run dir") -> Path:
    """Create the run folder (default: a new one under ./runs) and check that it is writable."""
    if path is None:
        path = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a name of its own: every host of a multi-host job may check a shared run dir at once
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{prog}: error: {what} {path} is not writable: {e.strerror or e}") from e
    return path.resolve()


def _config(args: argparse.Namespace, command: list[str], steps: int | None = None) -> JobConfig:
    """The job's one configuration from the checked flags: each option's value in its field,
    every other field its default (`leto run` has no injections nor hang-detection flags)."""
    values: dict[str, dict] = {name: {} for name in JobConfig.sections()}
    for opt in _options(args.cmd):
        value = getattr(args, opt.dest)
        if opt.field is not None and value is not None:  # None: not given, the field's default
            section, name = opt.field.split(".")
            values[section][name] = opt.field_value(value)
    values["training"].update(command=tuple(command), steps=steps)
    return JobConfig(**{name: cls(**values[name]) for name, cls in JobConfig.sections().items()})


def _job(
    args: argparse.Namespace, command: list[str], ident: list[str], prog: str, steps: int | None = None
) -> tuple[Path, int]:
    """Start the job (`ident`: what identifies its trajectory) and wait for it: its run folder
    and its exit code."""
    config = _config(args, command, steps)
    run_dir, start = _start(args, ident, prog, config)
    code = _run_job(replace(config, run_dir=str(run_dir), persistence=start.persistence), start.summary)
    if code != 0:
        from leto.persistence.resume import after_failure

        after_failure(run_dir, start.persist_dir, prog)
    return run_dir, code


def _run(args: argparse.Namespace) -> int:
    _check_job(args, "leto run")
    if args.script is None:
        raise UsageError(
            "leto run: error: the following arguments are required: script (or --resume RUN_DIR of "
            "a run that recorded it)"
        )
    if args.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(args.script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"leto run: error: module {args.script!r} not found")
        command = ["-m", args.script, *args.script_args]
    else:
        if not Path(args.script).is_file():
            raise UsageError(f"leto run: error: script {args.script!r} not found")
        command = [args.script, *args.script_args]
    ident = [str(Path(command[0]).resolve()), *command[1:]] if not args.module else command
    return _job(args, command, ident, "leto run")[1]


def _train(args: argparse.Namespace) -> int:
    from leto.training.corpus import CorpusError, load_tokens

    _check_job(args, "leto train")
    if args.steps < 1:
        raise UsageError(f"leto train: error: --steps must be at least 1, got {args.steps}")
    if args.model not in PRESETS:
        raise UsageError(f"leto train: error: unknown --model {args.model!r}; choose from {', '.join(PRESETS)}")
    rows = PRESETS[args.model].batch_size if args.rows is None else args.rows
    if rows < 1:
        raise UsageError(f"leto train: error: --rows must be at least 1, got {rows}")
    if args.workers > rows:
        raise UsageError(
            f"leto train: error: --workers ({args.workers}) exceeds the global batch of "
            f"{rows} rows of model {args.model!r}"
        )
    _check_pipeline(args, rows)
    if args.chunk_bytes < 12 or args.chunk_bytes % 12:
        raise UsageError(f"leto train: error: --chunk-bytes must be a positive multiple of 12, got {args.chunk_bytes}")
    if args.lr <= 0:
        raise UsageError(f"leto train: error: --lr must be positive, got {args.lr}")
    if args.max_grad_norm is not None and args.max_grad_norm <= 0:
        raise UsageError(f"leto train: error: --max-grad-norm must be positive, got {args.max_grad_norm}")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"leto train: error: --seed must be in 0..2**63-1, got {args.seed}")
    from leto.recovery.inject import parse as parse_inject

    for i, spec in enumerate(args.inject):
        try:
            inj = parse_inject(spec, i)
        except ValueError as e:
            raise UsageError(f"leto train: error: {e}") from e
        if inj.rank is not None and not 0 <= inj.rank < args.workers:
            raise UsageError(f"leto train: error: --inject {spec!r}: rank {inj.rank} is not in 0..{args.workers - 1}")
        if inj.node is not None and not 0 <= inj.node < args.nodes:
            raise UsageError(f"leto train: error: --inject {spec!r}: node {inj.node} is not in 0..{args.nodes - 1}")
        if inj.step > args.steps:
            raise UsageError(f"leto train: error: --inject {spec!r}: step {inj.step} is past --steps {args.steps}")
    if args.heartbeat_timeout <= 0:
        raise UsageError(f"leto train: error: --heartbeat-timeout must be positive, got {args.heartbeat_timeout}")
    if args.progress_floor <= 0 or args.progress_factor < 0:
        raise UsageError(
            f"leto train: error: --progress-floor must be positive and --progress-factor not negative, "
            f"got {args.progress_floor} and {args.progress_factor}"
        )
    try:
        load_tokens()
    except CorpusError as e:
        raise UsageError(f"leto train: error: {e}") from e
    rows_flag = ["--rows", str(args.rows)] if args.rows is not None else []
    if args.pp > 1:
        rows_flag += ["--microbatches", str(args.microbatches)]
    if args.max_grad_norm is not None:
        rows_flag += ["--max-grad-norm", str(args.max_grad_norm)]
    trajectory = [
        "-m",
        "leto.training.train_gpt",
        "--seed",
        str(args.seed),
        "--model",
        args.model,
        "--lr",
        str(args.lr),
        "--chunk-bytes",
        str(args.chunk_bytes),
        *rows_flag,
    ]
    command = [*trajectory[:2], "--steps", str(args.steps), *trajectory[2:], "--shrink", args.shrink]
    run_dir, code = _job(args, command, trajectory, "leto train", args.steps)  # --steps may change on resume
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else None  # another host's coordinator wrote it
    if code == 0 and summary is not None and summary.get("steps") is not None:
        print(
            f"leto: trained {summary['steps']} steps in {summary['wall_s']:.1f}s, final loss "
            f"{summary['final_loss']:.4f}, digest {str(summary['digest'])[:16]}…; summary: {run_dir / 'summary.json'}"
        )
    return code


BENCHES = ("throughput", "overhead", "recovery", "productivity")


def _bench(args: argparse.Namespace) -> int:
    import importlib

    if args.steps is not None and args.steps < 2:
        raise UsageError(f"leto bench: error: --steps must be at least 2, got {args.steps}")
    if args.trials < 1:
        raise UsageError(f"leto bench: error: --trials must be at least 1, got {args.trials}")
    if args.model not in PRESETS:
        raise UsageError(f"leto bench: error: unknown --model {args.model!r}; choose from {', '.join(PRESETS)}")
    if args.hosts is not None and (args.what != "recovery" or not 3 <= args.hosts <= 5):
        raise UsageError(
            "leto bench: error: --hosts is for `leto bench recovery`, with 3 to 5 hosts (one etcd member each)"
        )
    if args.failures is not None and args.what != "productivity":
        raise UsageError("leto bench: error: --failures is for `leto bench productivity`")
    if not 1 <= args.workers <= PRESETS[args.model].batch_size:
        raise UsageError(f"leto bench: error: --workers must be in 1..{PRESETS[args.model].batch_size}")
    if args.out is not None:
        args.out = make_run_dir(args.out, "leto bench", "--out")
    try:
        return importlib.import_module(f"leto.bench.{args.what}").main(args)
    except RuntimeError as e:  # a benchmark job failed: its run folder says why
        print(f"leto bench {args.what}: error: {e}", file=sys.stderr)
        return 1


def _data(args: argparse.Namespace) -> int:
    from leto.training import corpus

    if args.action == "prepare":
        try:
            path = corpus.prepare()
        except corpus.CorpusError as e:
            print(f"leto data: error: {e}", file=sys.stderr)
            return 1
        print(f"leto: corpus ready at {path} ({path.stat().st_size:,} bytes)")
        return 0
    meta = corpus.data_dir() / corpus.META_FILE
    print(meta.read_text() if meta.exists() else "corpus not prepared; run `leto data prepare`")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # its own parser: argparse.REMAINDER does not pass on --flags
        from leto.simulation.cli import main as simulate

        return simulate(argv[1:])
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.cmd in parser.commands:
            if args.resume is not None:
                args = _with_record(parser, argv, args)
            elif args.cmd == "train" and args.pp > 1 and "workers" not in _given(argv, "train"):
                args.workers = max(args.workers, 2 * args.tp * args.pp)  # the built-in job: two replicas at least
            args.recorded = _recordable(parser, args)
        return {"run": _run, "train": _train, "bench": _bench, "data": _data}[args.cmd](args)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
