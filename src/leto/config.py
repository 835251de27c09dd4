"""One typed configuration of a job, built once by the CLI and handed whole to every child.

A child reads it from one environment variable (`ENV_CONFIG`, the JSON of `JobConfig`); only
what differs per process (role, rank, node, process id) and where the running job is (its store
address and id, known once the store is up) travel in variables of their own (`runtime/env.py`).
The whole configuration is also recorded as `RUN_DIR/config.json` and in `summary.json`.

Each section is a keyword-only dataclass whose field defaults are the job's defaults: the CLI
derives its options and their defaults from them (`cli.py`, `JOB_OPTIONS`). A new section is
one dataclass here, one field of `JobConfig`, and its options in that table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace

ENV_CONFIG = "LETO_CONFIG"  # the JSON of the job's JobConfig
DEFAULT_TIMEOUT_S = 60.0  # every collective and store wait of a job, unless --timeout says otherwise


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """What runs: the script and its processes."""

    command: tuple[str, ...] = ()  # argv after the python interpreter
    workers: int = 1  # ranks (--workers)
    nodes: int = 1  # failure domains the ranks are split over (--nodes)
    steps: int | None = None  # for the progress bar only
    fork_server: bool = True  # fork the host's processes from one warm interpreter (--fork-server)


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """How the ranks are laid out: world = DP x PP x TP, TP innermost (`runtime/mesh.py`)."""

    tp: int = 1  # tensor-parallel ranks per pipeline stage, inside one node (--tp)
    pp: int = 1  # pipeline stages per model replica (--pp)

    @property
    def replica_ranks(self) -> int:
        """Ranks per model replica (one pipeline of `pp` stages of `tp` ranks each)."""
        return self.tp * self.pp


@dataclass(frozen=True, kw_only=True)
class ProtectionConfig:
    """Erasure-coded in-memory protection (docs/protection.md)."""

    enabled: bool = True  # start keepers and protect every step (--protection)
    ec: tuple[int, int] | None = None  # tier-2 code (k, m); None: tier 1 only (--ec)
    every: int = 1  # protect the state every N steps (--protect-every)
    grads: bool = False  # stage gradients even where every rank holds them (--protect-grads on)


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """How lost ranks come back."""

    spares: int = 0  # shadow trainers kept ready (--spares)
    no_spare: str = "shrink"  # lost ranks without a shadow: "shrink" the job, or "wait" for a cold one
    zygotes: bool = True  # one zygote per node forks replacement shadows (--zygotes)
    progress_factor: float = 20.0  # hung: no progress for max(floor, factor x median step time)
    inject: tuple[str, ...] = ()  # fault injections (--inject, tests and demos)


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Every timeout of a job, in seconds."""

    collective_s: float = DEFAULT_TIMEOUT_S  # every collective and store wait (--timeout)
    heartbeat_s: float = 3.0  # a worker or keeper silent this long is hung and fenced (--heartbeat-timeout)
    progress_floor_s: float = 30.0  # the floor of the progress timeout (--progress-floor)
    fork_s: float = 2.0  # a zygote that delivers no shadow by then is passed over
    stop_grace_s: float = 5.0  # SIGTERM to SIGKILL when the job stops
    persist_write_s: float = (
        600.0  # a checkpoint write still unfinished then is reported and abandoned (--persist-timeout)
    )


@dataclass(frozen=True, kw_only=True)
class RendezvousConfig:
    """Where the hosts of a multi-host job meet (docs/deployment.md); url None: one host."""

    url: str | None = None  # etcd://H1:2379,H2:2379,... (--rdzv)
    job_id: str = ""  # names the job in etcd, the same on every host (--job-id)
    lease_s: int = 2  # a host whose supervisor is silent this long is lost (--lease)
    join: bool = False  # this host enters a job that is already running (--join)
    standby: bool = False  # this host holds no rank until one is needed: warm shadows and a keeper (--standby)


@dataclass(frozen=True, kw_only=True)
class PersistenceConfig:
    """Persistent checkpoints, the last line of defence (docs/design.md, "Persistence")."""

    dir: str | None = None  # where the workers write checkpoints (--persist, --persist-dir); None: nowhere
    fingerprint: str = ""  # names the trajectory: only its own checkpoints are resumed
    mtbf: str = "5m"  # a duration: Young/Daly's K for failures this often (--mtbf)
    every: int | None = None  # a checkpoint every K steps instead of Young/Daly's K (--persist-every)
    start_step: int = 0  # the step the job starts from (its checkpoint's, on --resume)
    resume_from: str | None = None  # the checkpoint every rank loads at the start (--resume)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The resolved configuration of one job: its sections, where it writes, and how loudly."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    protection: ProtectionConfig = field(default_factory=ProtectionConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    run_dir: str = "runs"
    quiet: bool = False  # no progress output, nor the children's prints (benchmarks)

    @staticmethod
    def sections() -> dict[str, type]:
        """The sections by field name (each a dataclass, its JSON an object of its own)."""
        return {f.name: f.default_factory for f in fields(JobConfig) if is_dataclass(f.default_factory)}  # type: ignore[misc]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_dict(d: dict) -> JobConfig:
        """The configuration from its JSON; what it leaves out takes its default."""
        values: dict = {name: _section(cls, d.get(name, {})) for name, cls in JobConfig.sections().items()}
        for name, convert in (("run_dir", str), ("quiet", bool)):
            if name in d:
                values[name] = convert(d[name])
        return JobConfig(**values)

    @staticmethod
    def from_json(text: str | bytes) -> JobConfig:
        return JobConfig.from_dict(json.loads(text))

    def with_run_dir(self, run_dir: object) -> JobConfig:
        return replace(self, run_dir=str(run_dir))


def _section(cls: type, d: dict) -> object:
    """A section from its JSON: lists become tuples again (command, ec, inject)."""
    values = {}
    for f in fields(cls):
        if f.name in d:
            v = d[f.name]
            values[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**values)
