"""`leto run --rdzv etcd://...`: one host of a multi-host job (docs/deployment.md).

Every host runs the same command and becomes that host's supervisor. The hosts meet in etcd:
each takes the next node number, holds a lease and a lease-bound host record, and waits for the
others. One of them is elected coordinator (the first to create the coordinator key, bound to
its lease); when its host is lost, the key goes with the lease and another host takes over
(`Coordinator.restore`) while the training processes keep their state. Every store client of a
host is fenced by its host record, so a host that lost its lease cannot write into the job.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from leto.config import JobConfig
from leto.control import takeover
from leto.control.coordinator import POLL_S, Coordinator
from leto.control.join import JoinError, admit, enter, join_requests
from leto.control.lease import HostLease, Liveness, LivenessWatch, reaches_any
from leto.control.standby import WarmStandby
from leto.control.supervisor import Supervisor
from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import HostRecord, JoinRequest, Refusals, parse_int
from leto.runtime import linux, threads, trace
from leto.runtime.env import ENV_HOST_STORE, LOOPBACK, loopback_store, network_env
from leto.runtime.etcd_store import (
    EtcdError,
    EtcdStore,
    Fenced,
    StoreUnavailable,
    parse_endpoints,
)

HOST_CHECK_S = 0.05  # how often the coordinator reads the host records (the lease's verdict)
ELECTION_CHECK_S = 0.1
_refused = Refusals()  # malformed store values this host ignored (said once each)
LEADER_CHECK_S = 2.0  # how often the coordinator's host checks that its etcd member leads


class HostLost(RuntimeError):
    """This host is out of the job: its lease is gone, or etcd has no quorum for it."""


class Cluster:
    """The coordinator's view of the hosts: the lease-bound records, and a liveness connection
    to every other supervisor for early evidence (a closed connection, or beats that report no
    lease refresh for a lease time). A host found dead is fenced out (its record deleted under
    this host's fence, its lease revoked) before it is reported lost, so that none of its
    processes can write again."""

    def __init__(self, store: EtcdStore, nodes: int, me: int, watch: LivenessWatch) -> None:
        """`watch`: this host's follower's (`LeaderWatch.watch`), which knows when the previous
        coordinator's host was last heard from."""
        self.store, self.nodes, self.me = store, nodes, me
        self.records: dict[int, HostRecord] = {}
        self._lost: set[int] = set()
        self._admitted: set[int] = set()  # admitted here, its record not yet seen in the mirror
        self._fencing: dict[int, tuple[str, float]] = {}  # found dead, not yet fenced out
        self._watch = watch
        self._last_check = 0.0
        self.read()

    def read(self) -> dict[int, HostRecord]:
        """The host records now in etcd."""
        found = {}
        for key, value in self.store.under("control/host/").items():
            try:
                node = parse_int(key.rsplit("/", 1)[1], key, minimum=0, maximum=self.nodes - 1)
            except BadValue as e:  # not a host of this job: never watched, never fenced
                _refused.refuse(e, value)
                continue
            try:
                rec = HostRecord.from_json(value, key)
                if rec.node != node:
                    raise BadValue(key, f"names node {rec.node}")
            except BadValue as e:  # its key is there, so is the host: as last read, if ever
                _refused.refuse(e, value)
                if node not in self.records:
                    continue
                rec = self.records[node]
            found[node] = rec
        for node, rec in found.items():
            self.records[node] = rec
            if node != self.me:
                self._watch.watch(node, rec.addr, rec.port)
        return found

    def up(self) -> list[int]:
        return [n for n in range(self.nodes) if n not in self._lost]

    def lost(self) -> dict[int, tuple[str, float]]:
        """Hosts newly out of the job (fenced out already): why, and when (time.time()) each was
        last heard from. Raises `Fenced` when this host is out itself: a deposed coordinator
        (cut off, its link back) reports no one, and so records nothing in the shared run dir."""
        for n, why in self._watch.dead().items():
            if n not in self._lost:
                self._fencing[n] = (f"{why}; fenced out", self._watch.last_heard(n) or time.time())
        out: dict[int, tuple[str, float]] = {}
        for node in list(self._fencing):
            record = self.records.get(node)  # None: its record was gone before this coordinator read
            try:  # them (a follower fenced out the previous coordinator's host before the election)
                if record is not None:
                    self.store.fence_out(keys.host(node), record.lease)
            except StoreUnavailable:
                continue  # not reported before it is fenced: tried again at the next round
            out[node] = self._fencing.pop(node)
        now = time.monotonic()
        if now - self._last_check >= HOST_CHECK_S:
            self._last_check = now
            live = self.read()
            self._admitted -= set(live)
            if self.me not in live:
                raise Fenced(
                    f"this host's record ({keys.host(self.me)}) is gone, its lease revoked or expired: "
                    f"it is no longer part of the job"
                )
            ended = [
                n
                for n in range(self.nodes)  # every host joined at the start
                if n not in live and n not in self._lost and n not in out and n not in self._admitted
            ]
            if ended:  # seen in the mirror, not proved by a fenced write of this host's: ask etcd
                self.store.confirm_fence()
            for n in ended:
                self._fencing.pop(n, None)
                out[n] = ("its etcd lease ended", self._watch.last_heard(n) or time.time())
        self._lost |= set(out)
        return out

    def confirm(self) -> None:
        """Raise `Fenced` unless this host is still in the job (as etcd says now)."""
        self.store.confirm_fence()

    def joiners(self) -> list[tuple[int, JoinRequest]]:
        """Hosts asking to enter, each with the lost node it would take (as many as are free)."""
        live = self.read()
        free = [n for n in sorted(self._lost) if n not in live]
        hosts = {r.lease for n, r in self.records.items() if n not in self._lost}  # (the mirror may lag)
        asking = [r for r in join_requests(self.store, _refused) if r.lease not in hosts]
        return list(zip(free, asking, strict=False))

    def admit(self, node: int, request: JoinRequest, first_command: int) -> HostRecord | None:
        """Make the joiner `request` lost node `node`'s host, watched from now on like the others;
        None when it died waiting (forgotten) or the node is taken."""
        record = admit(self.store, node, request, first_command)
        if record is None:
            return None
        self.records[node] = record
        self._lost.discard(node)
        self._admitted.add(node)
        self._watch.forget(node)
        self._watch.watch(node, record.addr, record.port)
        return record

    def admissions(self, first_command: int) -> dict[int, int]:
        """The nodes of admitted hosts among the records read at this coordinator's start, each
        with its first command (`takeover.admissions`)."""
        return takeover.admissions(self.store, self.records, first_command, _refused)

    def close(self) -> None:
        self._watch.close()


class EtcdLeaderHere:
    """While this host coordinates, its own etcd member is etcd's Raft leader (moved there with
    etcd's MoveLeader, and again whenever an election put it elsewhere). Fencing a lost host is
    an etcd write: with the leader on the lost host it waited for an election (~1 s here, with a
    500 ms election timeout) before the recovery could be announced. With the leader on the
    coordinator's host only that host's loss costs an election, and its loss costs a takeover
    anyway."""

    def __init__(self, store: EtcdStore, own: tuple[str, int]) -> None:
        self._store, self._own = store.client(), own
        self._stop = threading.Event()
        threads.Thread(target=self._run, name="leto-etcd-leader", daemon=True).start()

    def _run(self) -> None:
        failures = 0
        while True:
            try:
                if self._store.lead_from(self._own):
                    trace.mark("etcd_leader_moved", to=f"{self._own[0]}:{self._own[1]}")
                failures = 0
            except (StoreUnavailable, EtcdError) as e:  # an election, a member down: try again later
                failures += 1
                if failures == 3:  # said once, after a few tries (one failure is an election)
                    print(
                        f"leto: could not make this host's etcd member the leader (host losses may wait "
                        f"for an etcd election): {e}",
                        file=sys.stderr,
                    )
            if self._stop.wait(LEADER_CHECK_S):
                return

    def close(self) -> None:
        self._stop.set()


def _own_endpoint(endpoints: list[tuple[str, int]]) -> tuple[tuple[str, int] | None, str]:
    """This host's own etcd endpoint if it has one (tried first by its processes), and its address."""
    addrs = {ep: linux.source_address(*ep) for ep in endpoints}
    own = next((ep for ep, src in addrs.items() if src == ep[0]), None)
    return own, (own[0] if own else addrs[endpoints[0]])


def _join(base: EtcdStore, cfg: JobConfig, lease: HostLease, addr: str, liveness: Liveness) -> tuple[int, int]:
    """Take the next node number and this host's record; (node, the record's create revision)."""
    node = base.add(keys.HOST_SEQ, 1) - 1
    if node >= cfg.training.nodes:
        raise HostLost(
            f"job {cfg.rendezvous.job_id!r} already has its {cfg.training.nodes} hosts (--nodes); "
            f"this host is number {node + 1}"
        )
    rev = base.create(keys.host(node), HostRecord(node, addr, liveness.port, os.getpid(), lease.id).to_json(), lease.id)
    if rev is None:
        raise HostLost(f"node {node} of job {cfg.rendezvous.job_id!r} already has a host")
    return node, rev


def _enter(
    base: EtcdStore, cfg: JobConfig, lease: HostLease, addr: str, liveness: Liveness
) -> tuple[int, int, int] | None:
    """A joining host: wait to be admitted (`join.enter`); (node, its record's create revision,
    the first command that is this host's), or None when the job ended first."""
    admission = enter(base, cfg, lease, addr, liveness)
    if admission is None:
        return None
    entry = base.entry(keys.host(admission.node))
    if entry is None or entry[2] != lease.id:
        raise JoinError(f"node {admission.node}'s host record is not this host's (its lease ended?)")
    print(
        f"leto: host {addr} joined job {cfg.rendezvous.job_id!r} as node {admission.node}",
        file=sys.stderr,
        flush=True,
    )
    return admission.node, entry[1], admission.first_command


def _await_hosts(store: EtcdStore, cfg: JobConfig, lease: HostLease) -> None:
    deadline = time.monotonic() + cfg.timeouts.collective_s
    while len(store.under("control/host/")) < cfg.training.nodes:
        if (why := lease.lost()) is not None:
            raise HostLost(why)
        if time.monotonic() > deadline:
            raise HostLost(
                f"only {len(store.under('control/host/'))} of {cfg.training.nodes} hosts joined job "
                f"{cfg.rendezvous.job_id!r} within {cfg.timeouts.collective_s:.0f}s"
            )
        time.sleep(0.05)


def run_host(config: JobConfig, summary_extra: dict | None = None) -> int:
    """Run this host's part of the job to its end; the job's exit code."""
    r = config.rendezvous
    t0 = time.monotonic()
    endpoints = parse_endpoints(r.url)
    own, addr = _own_endpoint(endpoints)
    ordered = ([own] if own else []) + [e for e in endpoints if e != own]  # this host's member first, for all
    base = EtcdStore(ordered, r.job_id, config.timeouts.collective_s)
    liveness = Liveness(addr)
    try:
        lease = HostLease(base, r.lease_s)
    except (StoreUnavailable, EtcdError) as e:
        print(f"leto: cannot join job {r.job_id!r} at {r.url}: {e}", file=sys.stderr)
        return 1
    liveness.beat(lease.age)
    coordinator: Coordinator | None = None
    supervisor: Supervisor | None = None
    etcd_leader: EtcdLeaderHere | None = None
    code: int | None = None
    left = local_error = False  # this host left the job (fenced: never the job-wide stop)
    warm: WarmStandby | None = None  # a joiner's processes, warm before it has a node
    try:
        # the host's store serves only its own processes (loopback); gloo and NCCL listen only on
        # the job's network address, as the liveness socket does
        host_store = loopback_store(config.timeouts.collective_s)
        child_env = {ENV_HOST_STORE: f"{LOOPBACK}:{host_store.port}", **network_env(addr)}
        first_command = 0
        if r.join or r.standby:
            warm = WarmStandby(config, child_env, host_store)
            admitted = _enter(base, config, lease, addr, liveness)
            if admitted is None:  # the job ended first
                code = 0
                return 0
            node, rev, first_command = admitted
        else:
            node, rev = _join(base, config, lease, addr, liveness)
        fence = (keys.host(node), rev)
        store = base.client(fence, abort=lease.lost, mirror="control/")  # it polls: reads from a mirror
        url = store.url()
        if not (r.join or r.standby):
            _await_hosts(store, config, lease)
        supervisor = Supervisor(
            store,
            config,
            url,
            f"{r.job_id}-h{node}",
            node=node,
            child_env=child_env,
            host_store=host_store,
            first_command=first_command,
            forker=warm.forker if warm is not None else None,
            warm=warm,
        )
        supervisor.start()
        last_election = 0.0
        leader = LeaderWatch(store, node, lease, [e for e in endpoints if e != own])
        while True:
            if (why := lease.lost()) is not None:
                raise HostLost(why)
            supervisor.tick()
            if supervisor.stopped:  # the coordinator stopped the job
                code = _exit_code(store)
                break
            now = time.monotonic()
            if coordinator is None and (leader.died() or now - last_election >= ELECTION_CHECK_S):
                last_election = now
                if not leader.follow():  # a read; the election is a write, tried only without a coordinator
                    coordinator = _elect(store, config, node, lease, supervisor, leader, summary_extra)
                    if coordinator is not None and own is not None:
                        etcd_leader = EtcdLeaderHere(base, own)
            if coordinator is not None and (code := coordinator.tick()) is not None:
                store.set(keys.EXIT_CODE, str(code))
                coordinator.stop()
                coordinator.write_summary(time.monotonic() - t0, code)
                break
            time.sleep(POLL_S)
    except JoinError as e:  # nothing of the job was started here
        print(f"leto: host {addr} cannot join job {r.job_id!r}: {e}", file=sys.stderr, flush=True)
        code, left = 1, True
    except (HostLost, Fenced, StoreUnavailable) as e:
        _leave(addr, str(e), supervisor, coordinator)
        code, left = 1, True
    except Exception as e:  # this host's own trouble: it leaves, and the job goes on without it
        _leave(addr, f"unexpected error: {type(e).__name__}: {e}", supervisor, coordinator)
        if not isinstance(e, OSError):  # not the machine's doing but a fault of Leto's: where it was
            traceback.print_exc()
        code, left, local_error = 1, True, True
    finally:
        if supervisor is None and warm is not None:  # not admitted: the supervisor never owned them
            warm.close(grace_s=None if code == 0 else 0)
        if etcd_leader is not None:
            etcd_leader.close()
        if supervisor is not None and not supervisor.stopped and not left:
            supervisor.close()
        # a host that leaves on its own error ends its lease at once: the others see it lost now
        lease.close(revoke=code == 0 or local_error)
    return code if code is not None else 1


def _exit_code(store: EtcdStore) -> int:
    """The job's exit code as the coordinator set it (1 if it set none, or a malformed one)."""
    if not store.check([keys.EXIT_CODE]):
        return 1
    value = store.get(keys.EXIT_CODE)
    try:
        return parse_int(value, keys.EXIT_CODE, minimum=0, maximum=255)
    except BadValue as e:
        _refused.refuse(e, value)
        return 1


def _leave(addr: str, why: str, supervisor: Supervisor | None, coordinator: Coordinator | None) -> None:
    """This host is out of the job: SIGKILL its processes (fenced like a lost host), never the
    job-wide stop (`Supervisor.stop_all`): the other hosts go on without it."""
    print(f"leto: host {addr} leaves the job: {why}; stopping its processes", file=sys.stderr, flush=True)
    if coordinator is not None:
        coordinator.release()
    if supervisor is not None:
        try:
            supervisor.fence()
        except Exception as e:  # its processes are killed first; what failed after is only said
            print(f"leto: host {addr}: while stopping its processes: {type(e).__name__}: {e}", file=sys.stderr)


class LeaderWatch:
    """A non-coordinator's liveness connection to the coordinator's host: when it closes, or its
    beats report no lease refresh for a lease time, that host is fenced out and a new
    coordinator elected at once, instead of after etcd expires its lease."""

    def __init__(self, store: EtcdStore, me: int, lease: HostLease, others: list[tuple[str, int]]) -> None:
        """`others`: the etcd endpoints on other hosts (whether this host reaches them tells a
        cut-off host from an etcd election)."""
        self.store, self.me = store, me
        self.watch = LivenessWatch(lease.ttl_s, lease.fresh, reaches_any(others))
        self._leader: HostRecord | None = None

    def follow(self) -> bool:
        """Watch whoever is coordinator now; False if there is none."""
        value = self.store.value(keys.COORDINATOR)
        if value is None:
            return False
        try:
            node = parse_int(value, keys.COORDINATOR, minimum=0)
        except BadValue as e:  # someone holds the key: there is no election to win, nor a host to watch
            _refused.refuse(e, value)
            return True
        if node == self.me:
            return True
        if self._leader is None or self._leader.node != node:
            rec = self.store.value(keys.host(node))
            if rec is None:
                return True
            try:
                self._leader = HostRecord.from_json(rec, keys.host(node))
            except BadValue as e:
                _refused.refuse(e, rec)
                return True
        self.watch.watch(node, self._leader.addr, self._leader.port)  # (again, if a connect timed out)
        return True

    def died(self) -> bool:
        """The coordinator's host died or went silent (then it is fenced out already)."""
        if self._leader is None or self._leader.node not in self.watch.dead():
            return False
        self.store.fence_out(keys.host(self._leader.node), self._leader.lease)
        self._leader = None
        return True


def _elect(
    store: EtcdStore,
    config: JobConfig,
    node: int,
    lease: HostLease,
    supervisor: Supervisor,
    leader: LeaderWatch,
    summary_extra: dict | None,
) -> Coordinator | None:
    """Become the coordinator if there is none (the key is bound to this host's lease)."""
    if store.create(keys.COORDINATOR, str(node), lease.id) is None:
        return None
    # the supervisor's store (this thread's, reading control/ from its mirror): the coordinator polls too
    hosts = Cluster(store, config.training.nodes, node, leader.watch)
    coordinator = Coordinator(store, config, serve=supervisor.serve_commands, summary_extra=summary_extra, hosts=hosts)
    if store.check([keys.membership(0)]):
        coordinator.restore(store.under(keys.COMMAND_PREFIX), store.under(keys.REPORT_PREFIX))
    else:
        coordinator.prepare()
        coordinator.start()
    return coordinator
