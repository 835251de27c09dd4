"""The job's store on etcd: a `torch.distributed.Store` whose keys live in a replicated etcd cluster.

With `--rdzv etcd://...` every Leto process (supervisors, coordinator, workers, keepers, shadows)
and every process group's rendezvous uses this store, so the store dies with no single host:
etcd keeps it while a quorum of its members lives. It talks to etcd's v3 JSON gateway through
`etcd3gw`'s client (docs/design.md, "Multi-host"), to the first endpoint that answers, trying the next
ones when one does not (a host's own etcd member is put first).

etcd has no increment and no blocking get: `add` is a compare-and-swap transaction retried on
conflict, and `get`/`wait` watch the keys they wait for (etcd pushes the change), each with a
deadline.

A process group's rendezvous reads every rank's key, one after the other, and each key is
written once (`keys.RENDEZVOUS`): such a read fetches the whole group's keys in one request and
keeps them, so a group of N ranks costs each rank about one read instead of N.

A store that polls (a supervisor's and the coordinator's: commands, reports, the job's state,
the host records, every 10-100 ms) reads from a `Mirror` instead: a local copy of the keys under
a prefix, kept current by one watch, so that a poll costs no request.
"""
from __future__ import annotations

import base64
import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import etcd3gw
import requests
import torch.distributed as dist
import urllib3
from etcd3gw import exceptions as gw

from leto.protocol import keys as job_keys
from leto.runtime import threads

SCHEME = "etcd://"
# One HTTP request. A member that is frozen (SIGSTOP) or whose host froze still accepts connections
# (the kernel answers) but never replies: this is how long it can hold a request before the next
# endpoint is tried. etcd itself gives up on a write without a quorum after ~5 s.
REQUEST_TIMEOUT_S = 1.0
SHUN_S = 5.0              # an endpoint that failed is tried after the others for this long
WATCH_S = 1.0             # the longest single watch of a wait: then the keys (and `abort`) are checked again
POLL_MIN_S = 0.002        # the longest random pause before an `add` retries a conflict
FOLLOW_S = 1.0            # a mirror's watch that brings nothing this long is made again (it proves the member answers)
FRESH_S = 2.5             # a mirror not heard from for this long is not read: reads go to etcd


class StoreUnavailable(dist.DistStoreError):
    """No etcd endpoint answered, or the cluster has no quorum."""


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """`etcd://H1:2379,H2:2379` -> [(H1, 2379), (H2, 2379)]; ValueError naming what is wrong."""
    if not url.startswith(SCHEME):
        raise ValueError(f"{url!r}: an etcd rendezvous address starts with {SCHEME}")
    out = []
    for part in url[len(SCHEME):].split("/", 1)[0].split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{url!r}: {part!r} is not HOST:PORT")
        out.append((host, int(port)))
    return out


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix`."""
    raw = prefix.encode()
    return _b64(raw[:-1] + bytes([raw[-1] + 1]))


def _read_timed_out(e: requests.RequestException) -> bool:
    """Whether a streamed response went quiet for its read timeout: requests raises that as a
    ConnectionError around urllib3's ReadTimeoutError once the body is streaming."""
    return isinstance(e, requests.exceptions.ReadTimeout) or any(
        isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in e.args)


class EtcdError(dist.DistStoreError):
    """etcd answered, and refused the request (e.g. a lease it does not know)."""


class Fenced(dist.DistStoreError):
    """A write refused because this process's host lost its lease: the job has moved on without it."""


class Mirror:
    """A local copy of every key under `prefix`, kept current by one etcd watch (a thread).

    Reads of a covered key are answered from the copy while it is fresh: its watch was heard
    from (an event, or the watch made again after FOLLOW_S of quiet) within FRESH_S. Otherwise
    they go to etcd, so a frozen or dead member delays what the copy shows by FRESH_S at most.
    Its store's own writes are applied at once (a process reads what it wrote). A copy is as
    current as a read from its member; what it misses it never invents: a key it shows existed."""

    def __init__(self, store: EtcdStore, prefix: str) -> None:
        self.prefix = prefix
        self._store = store.client()  # its own connections
        self._full = store.prefix + prefix
        self._kv: dict[str, tuple[bytes | None, int]] = {}  # key -> (value or None if deleted, mod revision)
        self._revision = 0    # everything up to this revision is applied
        self._heard = 0.0     # monotonic time the watch was last heard from
        self._synced = False
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threads.Thread(target=self._run, name="leto-etcd-mirror", daemon=True)
        self._thread.start()

    def covers(self, keys: Sequence[str]) -> bool:
        return all(k.startswith(self.prefix) for k in keys)

    def fresh(self) -> bool:
        return self._synced and time.monotonic() - self._heard < FRESH_S

    def lookup(self, key: str) -> bytes | None:
        """The value of a covered key (None: it does not exist); only while `fresh()`."""
        with self._changed:
            return self._kv.get(key, (None, 0))[0]

    def under(self, prefix: str) -> dict[str, bytes]:
        with self._changed:
            return {k: v for k, (v, _) in self._kv.items() if v is not None and k.startswith(prefix)}

    def wait(self, keys: Sequence[str], deadline: float) -> dict[str, bytes] | None:
        """The values of `keys` once all exist; None when the copy is (or goes) stale first;
        DistStoreError at `deadline`."""
        with self._changed:
            while self.fresh():
                values = {k: self._kv.get(k, (None, 0))[0] for k in keys}
                if all(v is not None for v in values.values()):
                    return values  # type: ignore[return-value]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(f"wait timeout for keys {[k for k, v in values.items() if v is None]}")
                self._changed.wait(min(0.2, left))
        return None

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """A put (or, with None, a delete) of a key at `revision`; an older one is ignored."""
        if not key.startswith(self.prefix):
            return
        with self._changed:
            if revision > self._kv.get(key, (None, 0))[1]:
                self._kv[key] = (value, revision)
                self._changed.notify_all()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._synced:
                    self._sync()
                self._follow()
            except (StoreUnavailable, EtcdError, requests.RequestException, ValueError, KeyError):
                self._synced = self._synced and time.monotonic() - self._heard < FRESH_S
                self._stop.wait(0.05)

    def _sync(self) -> None:
        """Read the whole prefix: the copy from scratch (at the start, or after etcd compacted the
        revisions the watch needs)."""
        result = self._store.request("kv/range", {"key": _b64(self._full), "range_end": _prefix_end(self._full)})
        n = len(self._store.prefix)
        kvs = {base64.b64decode(kv["key"]).decode()[n:]: (base64.b64decode(kv.get("value", "")),
                                                          int(kv["mod_revision"])) for kv in result.get("kvs") or []}
        with self._changed:
            self._kv = kvs
            self._revision = int(result["header"]["revision"])
            self._heard, self._synced = time.monotonic(), True
            self._changed.notify_all()

    def _follow(self) -> None:
        """One watch from the next revision, until it is quiet for FOLLOW_S."""
        body = {"create_request": {"key": _b64(self._full), "range_end": _prefix_end(self._full),
                                   "start_revision": str(self._revision + 1)}}
        n = len(self._store.prefix)
        for result in self._store.watch_stream(body, FOLLOW_S, shun_silent=True):
            if self._stop.is_set():
                return
            if result.get("canceled") or int(result.get("compact_revision", 0) or 0):
                self._synced = False  # the revisions it needs are compacted: read everything again
                return
            for ev in result.get("events") or []:
                kv = ev["kv"]
                value = None if ev.get("type") == "DELETE" else base64.b64decode(kv.get("value", ""))
                self.apply(base64.b64decode(kv["key"]).decode()[n:], value, int(kv["mod_revision"]))
                # only events move the revision on: a header's may be ahead of events still to come
                self._revision = max(self._revision, int(kv["mod_revision"]))
            self._heard = time.monotonic()


class EtcdStore(dist.Store):
    """Keys under `/leto/<namespace>/` of an etcd cluster, as a torch.distributed Store.

    `fence` = (key, create_revision): every write is one transaction that succeeds only while
    that key (a host's lease-bound record) is the one this process was started under, so a
    host that lost its lease can never write into the job again (`Fenced`)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], namespace: str, timeout_s: float,
                 fence: tuple[str, int] | None = None, abort: Callable[[], str | None] | None = None,
                 mirror: str | None = None, write_once: Sequence[str] = job_keys.RENDEZVOUS) -> None:
        """`abort`: a check that makes every retry give up at once with its reason (a
        supervisor whose host lost its lease stops waiting for etcd). `mirror`: reads of keys
        under this prefix come from a `Mirror` (a store that polls them). `write_once`: prefixes
        whose keys are written once and never change (their reads are kept, `_get_once`)."""
        super().__init__()
        self.abort = abort
        if not endpoints:
            raise ValueError("an etcd store needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.namespace = namespace
        self.prefix = f"/leto/{namespace}/"
        self.timeout_s = timeout_s
        self.fence = fence
        session = requests.Session()
        self._clients = [etcd3gw.client(host=h, port=p, api_path="/v3/", session=session) for h, p in self.endpoints]
        self._shunned = [0.0] * len(self.endpoints)  # until when an endpoint that failed is tried last
        self.write_once = tuple(write_once)
        self._once: dict[str, bytes] = {}  # values read of write-once keys
        self._once_lock = threading.Lock()
        self._mirror = Mirror(self, mirror) if mirror is not None else None

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> EtcdStore:
        """`etcd://H1:P1,H2:P2/NAMESPACE[?fence=KEY@REVISION]`, as `url` writes it."""
        rest, _, query = url[len(SCHEME):].partition("?")
        namespace = rest.split("/", 1)[1] if "/" in rest else "default"
        fence = None
        if query.startswith("fence="):
            key, _, rev = query[len("fence="):].rpartition("@")
            fence = (key, int(rev))
        return cls(parse_endpoints(url), namespace, timeout_s, fence)

    def client(self, fence: tuple[str, int] | None = None, abort: Callable[[], str | None] | None = None,
               timeout_s: float | None = None, mirror: str | None = None) -> EtcdStore:
        """Another client of the same store (its own connections: one per thread or role)."""
        return EtcdStore(self.endpoints, self.namespace, self.timeout_s if timeout_s is None else timeout_s,
                         fence, abort, mirror, self.write_once)

    def close(self) -> None:
        """Stop the mirror's watch, if it has one."""
        if self._mirror is not None:
            self._mirror.close()

    def url(self, first: tuple[str, int] | None = None, fence: tuple[str, int] | None = None) -> str:
        """This store's address for a child process; `first`: the endpoint it tries first."""
        eps = ([first] if first else []) + [e for e in self.endpoints if e != first]
        fence = fence or self.fence
        return (SCHEME + ",".join(f"{h}:{p}" for h, p in eps) + "/" + self.namespace
                + (f"?fence={fence[0]}@{fence[1]}" if fence else ""))

    # ----- the wire
    def _order(self) -> list[int]:
        """The endpoints to try, in order: the given order (this host's own member first), but
        one that failed in the last SHUN_S seconds after every other."""
        now = time.monotonic()
        return sorted(range(len(self.endpoints)), key=lambda i: self._shunned[i] > now)

    def _failed(self, i: int) -> None:
        self._shunned[i] = time.monotonic() + SHUN_S

    def request(self, path: str, body: dict, deadline: float | None = None) -> dict:
        """One request of etcd's v3 JSON API, to the first endpoint that answers (`_order`),
        until `deadline` (default: the store timeout from now)."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout_s
        errors: list[str] = []
        while True:
            for i in self._order():
                if self.abort is not None and (why := self.abort()) is not None:
                    raise StoreUnavailable(f"gave up on etcd: {why}")
                client = self._clients[i]
                client.timeout = max(0.05, min(REQUEST_TIMEOUT_S, deadline - time.monotonic()))
                try:
                    return client.post(client.get_url(path), json=body)
                except (gw.ConnectionFailedError, gw.ConnectionTimeoutError, gw.InternalServerError) as e:
                    errors.append(f"{client.host}:{client.port}: {type(e).__name__} "
                                  f"{(e.detail_text or str(e))[:200]}")
                    self._failed(i)
                except gw.Etcd3Exception as e:  # an answer that refuses the request, not a failed endpoint
                    raise EtcdError(f"etcd refused {path}: {(e.detail_text or str(e))[:300]}") from e
                if time.monotonic() >= deadline:
                    raise StoreUnavailable("etcd unreachable or without quorum ("
                                           + "; ".join(errors[-len(self.endpoints):]) + ")")
            time.sleep(0.05)  # every endpoint failed once: do not spin

    def _range(self, key: str) -> dict | None:
        kvs = self.request("kv/range", {"key": _b64(self.prefix + key)}).get("kvs")
        return kvs[0] if kvs else None

    def _await(self, keys: list[str], timeout_s: float) -> dict[str, bytes]:
        """Wait until every key exists (etcd pushes the change: a watch, not a poll); their
        values. DistStoreError after `timeout_s`, as TCPStore's waits."""
        deadline = time.monotonic() + timeout_s
        if self._mirror is not None and self._mirror.covers(keys):
            values = self._mirror.wait(keys, deadline)
            if values is not None:
                return values
        while True:
            found: dict[str, dict] = {}
            revision = 0
            for key in keys:
                result = self.request("kv/range", {"key": _b64(self.prefix + key)}, max(deadline, time.monotonic() + 1))
                revision = max(revision, int(result["header"]["revision"]))
                if result.get("kvs"):
                    found[key] = result["kvs"][0]
            missing = [k for k in keys if k not in found]
            if not missing:
                return {k: base64.b64decode(kv.get("value", "")) for k, kv in found.items()}
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {timeout_s:.3f}s for keys {missing}")
            self._watch(missing[0], revision + 1, min(left, WATCH_S))

    def _get_once(self, key: str, timeout_s: float) -> bytes:
        """A write-once key's value: kept from an earlier read, or read with every key of its
        folder (the other ranks' keys of one rendezvous) in one request; a watch while it is
        missing. DistStoreError after `timeout_s`."""
        with self._once_lock:
            if key in self._once:
                return self._once[key]
        folder = key[:key.rfind("/") + 1]
        deadline = time.monotonic() + timeout_s
        while True:
            found, revision = self._read_under(folder, max(deadline, time.monotonic() + 1))
            with self._once_lock:
                self._once.update(found)
            if key in found:
                return found[key]
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {timeout_s:.3f}s for keys {[key]}")
            self._watch(key, revision + 1, min(left, WATCH_S))

    def _forget(self, key: str) -> None:
        with self._once_lock:
            self._once.pop(key, None)

    def _is_once(self, key: str) -> bool:
        return key.startswith(self.write_once)

    def _watch(self, key: str, start_revision: int, seconds: float) -> None:
        """Return once `key` changes at or after `start_revision`, or after about `seconds`."""
        body = {"create_request": {"key": _b64(self.prefix + key), "start_revision": str(start_revision)}}
        try:
            for result in self.watch_stream(body, max(0.01, seconds)):
                if result.get("events") or result.get("canceled"):
                    return
        except (requests.RequestException, ValueError):
            time.sleep(min(0.05, seconds))

    def watch_stream(self, body: dict, quiet_s: float, shun_silent: bool = False) -> Iterator[dict]:
        """The results of one watch on the first endpoint, until it is quiet for `quiet_s`. An
        endpoint that fails is tried last for a while (`_failed`) and the error raised; with
        `shun_silent`, so is one that took the watch and never answered it (a frozen member)."""
        first = self._order()[0]
        client = self._clients[first]
        answered = False
        try:
            with client.session.post(client.get_url("watch"), json=body, stream=True,
                                     timeout=(REQUEST_TIMEOUT_S, quiet_s)) as resp:
                for line in resp.iter_lines():
                    if line:
                        answered = True
                        yield json.loads(line).get("result", {})
        except requests.RequestException as e:
            if _read_timed_out(e) and (answered or not shun_silent):
                return  # quiet for quiet_s: the watch's normal end
            self._failed(first)
            raise

    def _write(self, ops: list[dict], compare: list[dict] | None = None, deadline: float | None = None) -> dict:
        """One transaction of `ops` under `compare` and this process's fence; raises `Fenced`
        when the fence fails. The response's `succeeded` says whether `compare` held."""
        fence = [] if self.fence is None else [{"key": _b64(self.prefix + self.fence[0]), "target": "CREATE",
                                                "result": "EQUAL", "create_revision": str(self.fence[1])}]
        if not fence:
            result = self.request("kv/txn", {"compare": compare or [], "success": ops}, deadline)
            self._mirror_writes(ops, result)
            return result
        result = self.request("kv/txn", {"compare": fence + (compare or []), "success": ops,
                                         "failure": [{"request_range": {"key": fence[0]["key"]}}]}, deadline)
        if not result.get("succeeded"):
            kvs = result["responses"][0]["response_range"].get("kvs") or []
            if not kvs or int(kvs[0].get("create_revision", 0)) != self.fence[1]:
                raise Fenced(f"this host lost its lease ({self.fence[0]} is gone): it is no longer part of the job")
        self._mirror_writes(ops, result)
        return result

    def _mirror_writes(self, ops: list[dict], result: dict) -> None:
        """What this store wrote is in its mirror at once."""
        if self._mirror is None or not result.get("succeeded"):
            return
        revision = int(result["header"]["revision"])
        n = len(self.prefix)
        for op in ops:
            if "request_put" in op:
                put = op["request_put"]
                self._mirror.apply(base64.b64decode(put["key"]).decode()[n:], base64.b64decode(put["value"]), revision)
            elif "request_delete_range" in op:
                self._mirror.apply(base64.b64decode(op["request_delete_range"]["key"]).decode()[n:], None, revision)

    # ----- etcd's own: leases and lease-bound keys (the control plane's)
    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        return int(self.request("lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int, deadline: float) -> int:
        """Refresh `lease`; its TTL now (0: it has expired)."""
        return int(self.request("lease/keepalive", {"ID": lease}, deadline).get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End `lease` now: every key bound to it is deleted (a lease already gone is fine)."""
        try:
            self.request("kv/lease/revoke", {"ID": lease})
        except EtcdError as e:
            if "lease not found" not in str(e):
                raise

    def lead_from(self, endpoint: tuple[str, int]) -> bool:
        """Make the member serving `endpoint` etcd's Raft leader (etcd's MoveLeader, asked of
        whichever member leads now); False if it leads already."""
        def post(client: etcd3gw.Etcd3Client, path: str, body: dict) -> dict:
            client.timeout = REQUEST_TIMEOUT_S
            return client.post(client.get_url(path), json=body)

        try:
            status = post(self._clients[self.endpoints.index(endpoint)], "maintenance/status", {})
        except gw.Etcd3Exception as e:
            raise StoreUnavailable(f"etcd member {endpoint[0]}:{endpoint[1]}: {e}") from e
        member, leader = status["header"]["member_id"], status.get("leader")
        if member == leader:
            return False
        for client in self._clients:  # only the leader takes the request; the others say "not leader"
            try:
                post(client, "maintenance/transfer-leadership", {"targetID": member})
                return True
            except gw.Etcd3Exception:
                continue
        raise StoreUnavailable(f"no member took the request to make {endpoint[0]}:{endpoint[1]} etcd's leader")

    def confirm_fence(self) -> None:
        """Raise `Fenced` unless this process's fence holds now: its host record, read from etcd
        (a linearizable read: the quorum's answer, not this member's or the mirror's)."""
        if self.fence is None:
            return
        kv = self._range(self.fence[0])
        if kv is None or int(kv["create_revision"]) != self.fence[1]:
            raise Fenced(f"this host lost its lease ({self.fence[0]} is gone): it is no longer part of the job")

    def fence_out(self, key: str, lease: int) -> None:
        """Take another host out of the job: delete its lease-bound record `key` under this
        process's own fence, then end `lease`. A process that is itself out (say, a cut-off
        coordinator whose requests reach etcd only once the link is back) gets `Fenced` and
        removes no one: only a host still in the job judges the others."""
        full = _b64(self.prefix + key)
        self._forget(key)
        self._write([{"request_delete_range": {"key": full}}],
                    [{"key": full, "target": "LEASE", "result": "EQUAL", "lease": str(lease)}])
        self.revoke(lease)

    def create(self, key: str, value: str | bytes, lease: int | None = None) -> int | None:
        """Create `key` if it does not exist (bound to `lease`); its create revision, or None
        if it existed."""
        full = _b64(self.prefix + key)
        put = {"key": full, "value": _b64(value), **({"lease": lease} if lease else {})}
        result = self._write([{"request_put": put}],
                             [{"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}])
        return int(result["header"]["revision"]) if result.get("succeeded") else None

    def value(self, key: str) -> bytes | None:
        """The value of `key` now, or None if it does not exist: no wait (from the mirror, where
        it covers the key)."""
        if self._mirror is not None and self._mirror.covers([key]) and self._mirror.fresh():
            return self._mirror.lookup(key)
        kv = self._range(key)
        return None if kv is None else base64.b64decode(kv.get("value", ""))

    def entry(self, key: str) -> tuple[bytes, int, int] | None:
        """(value, create revision, lease) of `key`, or None if it does not exist."""
        kv = self._range(key)
        if kv is None:
            return None
        return base64.b64decode(kv.get("value", "")), int(kv["create_revision"]), int(kv.get("lease", 0))

    def under(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with `prefix` (relative to this store's), with its value."""
        if self._mirror is not None and self._mirror.covers([prefix]) and self._mirror.fresh():
            return self._mirror.under(prefix)
        return self._read_under(prefix)[0]

    def _read_under(self, prefix: str, deadline: float | None = None) -> tuple[dict[str, bytes], int]:
        """Every key under `prefix` with its value, read from etcd; and the revision read at."""
        full = self.prefix + prefix
        result = self.request("kv/range", {"key": _b64(full), "range_end": _prefix_end(full)}, deadline)
        n = len(self.prefix)
        found = {base64.b64decode(kv["key"]).decode()[n:]: base64.b64decode(kv.get("value", ""))
                 for kv in result.get("kvs") or []}
        return found, int(result["header"]["revision"])

    # ----- the Store interface
    def set(self, key: str, value: str | bytes) -> None:
        self._write([{"request_put": {"key": _b64(self.prefix + key), "value": _b64(value)}}])
        if self._is_once(key):
            with self._once_lock:
                self._once[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        if self._is_once(key):
            return self._get_once(key, self.timeout_s)
        return self._await([key], self.timeout_s)[key]

    def add(self, key: str, value: int) -> int:
        self._forget(key)  # a counter is not write-once, whatever its name
        full = _b64(self.prefix + key)
        deadline = time.monotonic() + self.timeout_s
        while True:
            kv = self._range(key)
            current = int(base64.b64decode(kv["value"])) if kv and kv.get("value") else 0
            compare = ({"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]} if kv
                       else {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
            result = self._write([{"request_put": {"key": full, "value": _b64(str(current + value))}}],
                                 [compare], deadline)
            if result.get("succeeded"):
                return current + value
            if time.monotonic() >= deadline:
                raise StoreUnavailable(f"add to {key!r}: still contended after {self.timeout_s:.1f}s")
            time.sleep(random.uniform(0, POLL_MIN_S))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._forget(key)
        full = _b64(self.prefix + key)
        expect = expected.encode() if isinstance(expected, str) else expected
        compare = ({"key": full, "target": "VALUE", "result": "EQUAL", "value": _b64(expect)} if expect
                   else {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
        if self._write([{"request_put": {"key": full, "value": _b64(desired)}}], [compare]).get("succeeded"):
            return desired.encode() if isinstance(desired, str) else desired
        kv = self._range(key)
        return base64.b64decode(kv.get("value", "")) if kv else expect

    def delete_key(self, key: str) -> bool:
        self._forget(key)
        result = self._write([{"request_delete_range": {"key": _b64(self.prefix + key)}}])
        return int(result["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def check(self, keys: list[str]) -> bool:
        if self._mirror is not None and self._mirror.covers(keys) and self._mirror.fresh():
            return all(self._mirror.lookup(k) is not None for k in keys)
        return all(self._range(k) is not None for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        ops = [{"request_put": {"key": _b64(self.prefix + k), "value": _b64(v)}} for k, v in zip(keys, values)]
        self._write(ops)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = self.timeout_s if timeout is None else timeout.total_seconds()
        if keys and all(self._is_once(k) for k in keys):
            deadline = time.monotonic() + timeout_s
            for k in keys:
                self._get_once(k, max(0.0, deadline - time.monotonic()))
            return
        self._await(keys, timeout_s)

    def num_keys(self) -> int:
        result = self.request("kv/range", {"key": _b64(self.prefix), "range_end": _prefix_end(self.prefix),
                                         "count_only": True})
        return int(result.get("count", 0))

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()
