"""Every store key of the job, in one place. Control keys are written by the coordinator (memberships,
commands), a supervisor (reports, fork requests) or the job's processes (heartbeats, progress,
results); protection keys carry their generation."""

# ----- control: membership, liveness, the job's end
SHUTDOWN = "control/shutdown"  # set once the job stops: every wait gives up
RESULT = "control/result"  # rank 0's final digest and loss (JSON)
FATAL = "control/fatal"  # set by a worker that found the job unrecoverable (the reason)
ZYGOTES_OFF = "control/zygotes-off"  # why this job cannot use zygotes (set by one)
PERSIST_EVERY = "persist/every"  # {"every": K, "first": step} once rank 0 has chosen K


def membership(gen: int) -> str:
    """The `messages.Membership` of generation `gen`."""
    return f"control/gen/{gen}"


def warm(proc_id: str) -> str:
    """Set by a shadow (or zygote) once it is fully initialized and waiting."""
    return f"control/warm/{proc_id}"


def heartbeat(proc_id: str) -> str:
    """A process's latest heartbeat (`messages.format_beat`)."""
    return f"control/hb/{proc_id}"


def fork(zygote_id: str, seq: int) -> str:
    """A supervisor's `seq`-th fork request to its zygote (`messages.ForkRequest`)."""
    return f"control/fork/{zygote_id}/{seq}"


def forked(proc_id: str) -> str:
    """The pid of the shadow a zygote forked as `proc_id`."""
    return f"control/forked/{proc_id}"


def recovery(gen: int) -> str:
    """The recovery record rank 0 writes once generation `gen` has joined."""
    return f"control/recovery/{gen}"


def inject_fired(index: int) -> str:
    return f"control/inject/fired/{index}"


def inject_time(proc_id: str) -> str:
    """When an injected fault hit `proc_id` (the failure time of its recovery)."""
    return f"control/inject/time/{proc_id}"


# ----- control: supervisor <-> coordinator (docs/design.md, "Supervisor and coordinator")
# Two streams, each a store counter (`store.add`) and one key per entry: the supervisor's reports
# (process events) and the coordinator's commands (spawn, fork, boost, wake, stop).
REPORTS = "control/sup/reports"  # counter: reports the supervisor has written
COMMANDS = "control/coord/commands"  # counter: commands the coordinator has written
PROC_SEQ = "control/proc-seq"  # counter: numbers the process ids of the job
JOB_STATE = "control/state"  # `messages.JobState`: the generation and whether it is recovering
PROGRESS = "control/progress"  # `messages.StepProgress`: rank 0's latest completed step


EXIT_CODE = "control/exit-code"  # the job's exit code, set by the coordinator when it ends

# ----- control: the hosts of a multi-host job (etcd; docs/deployment.md)
HOST_SEQ = "control/host-seq"  # counter: numbers the hosts as they join (a host is a node)
COORDINATOR = "control/coordinator"  # the elected coordinator's node (bound to its host's lease)


def host(node: int) -> str:
    """The live host that is `node` (`messages.HostRecord`), bound to that host's lease: gone
    once the lease is revoked or expires, and every write of that host's processes with it."""
    return f"control/host/{node}"


def join_request(lease: int) -> str:
    """A host asking to enter the running job (`messages.JoinRequest`), bound to its lease: a
    joiner that dies before it is admitted leaves nothing behind."""
    return f"{JOIN_PREFIX}{lease:x}"


def admission(lease: int) -> str:
    """The coordinator's answer to `join_request(lease)` (`messages.Admission`), bound to the
    joiner's lease."""
    return f"{ADMISSION_PREFIX}{lease:x}"


JOIN_PREFIX = "control/join/"
ADMISSION_PREFIX = "control/admitted/"


def stopped(node: int) -> str:
    """Set by a supervisor once every process of its host is stopped."""
    return f"control/sup/stopped/{node}"


REPORT_PREFIX = "control/sup/report/"
COMMAND_PREFIX = "control/coord/cmd/"


def sup_report(seq: int) -> str:
    """The supervisor's `seq`-th `messages.SupervisorReport`."""
    return f"{REPORT_PREFIX}{seq}"


def command(seq: int) -> str:
    """The coordinator's `seq`-th `messages.Command`."""
    return f"{COMMAND_PREFIX}{seq}"


# ----- protection
def layout(gen: int) -> str:
    return f"prot/g{gen}/layout"


def ready(gen: int, node: int) -> str:
    return f"prot/g{gen}/ready/{node}"


def committed(gen: int, node: int) -> str:
    return f"prot/g{gen}/committed/{node}"


def keeper_pg(gen: int) -> str:
    return f"kpg/g{gen}/"


def tier2_address(gen: int, node: int) -> str:
    """Where generation `gen`'s keeper of `node` listens for its peers' tier-2 connections."""
    return f"kpg/g{gen}/tier2/{node}"


def group(gen: int, name: str) -> str:
    """The rendezvous prefix of generation `gen`'s process group `name` (workers' groups)."""
    return f"pg/g{gen}/{name}/"


# The keys of a process group's rendezvous: every group has a prefix of its own, and gloo and
# NCCL write each of its keys once (an address, a unique id) and read it from the other ranks.
RENDEZVOUS = ("pg/", "kpg/")


def drain(gen: int) -> str:
    return f"prot/g{gen}/drain"


def sent(gen: int, src: int, dst: int) -> str:
    return f"prot/g{gen}/sent/{src}/{dst}"


def report(gen: int, node: int) -> str:
    return f"prot/g{gen}/report/{node}"


def barrier_state(gen: int, node: int) -> str:
    """A draining keeper's barrier state: the next barrier and whether it entered it."""
    return f"prot/g{gen}/barrier/{node}"


# ----- baselines (on the job's store; the torchft and NVRx baselines' own stores keep their keys)
CKPT_PG = "leto-dcp/"  # prefix of the checkpoint baselines' own gloo group (torch.distributed.checkpoint)
