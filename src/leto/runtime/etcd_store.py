"""The job's store on etcd: a `torch.distributed.Store` whose keys live in a replicated etcd cluster.

With `--rdzv etcd://...` every Leto process (supervisors, coordinator, workers, keepers, shadows)
and every process group's rendezvous uses this store, so the store dies with no single host:
etcd keeps it while a quorum of its members lives. It talks to etcd's v3 JSON gateway through
`etcd3gw`'s client (docs/design.md, "Multi-host"), to the first endpoint that answers, trying the next
ones when one does not (a host's own etcd member is put first).

etcd has no increment and no blocking get: `add` is a compare-and-swap transaction retried on
conflict, and `get`/`wait` watch the keys they wait for (etcd pushes the change), each with a
deadline.
"""
from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import etcd3gw
import requests
import torch.distributed as dist
from etcd3gw import exceptions as gw

SCHEME = "etcd://"
# One HTTP request. A member that is frozen (SIGSTOP) or whose host froze still accepts connections
# (the kernel answers) but never replies: this is how long it can hold a request before the next
# endpoint is tried. etcd itself gives up on a write without a quorum after ~5 s.
REQUEST_TIMEOUT_S = 1.0
SHUN_S = 5.0              # an endpoint that failed is tried after the others for this long
WATCH_S = 1.0             # the longest single watch of a wait: then the keys (and `abort`) are checked again
POLL_MIN_S = 0.002        # the longest random pause before an `add` retries a conflict


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


class EtcdError(dist.DistStoreError):
    """etcd answered, and refused the request (e.g. a lease it does not know)."""


class Fenced(dist.DistStoreError):
    """A write refused because this process's host lost its lease: the job has moved on without it."""


class EtcdStore(dist.Store):
    """Keys under `/leto/<namespace>/` of an etcd cluster, as a torch.distributed Store.

    `fence` = (key, create_revision): every write is one transaction that succeeds only while
    that key (a host's lease-bound record) is the one this process was started under, so a
    host that lost its lease can never write into the job again (`Fenced`)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], namespace: str, timeout_s: float,
                 fence: tuple[str, int] | None = None, abort: Callable[[], str | None] | None = None) -> None:
        """`abort`: a check that makes every retry give up at once with its reason (a
        supervisor whose host lost its lease stops waiting for etcd)."""
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
               timeout_s: float | None = None) -> EtcdStore:
        """Another client of the same store (its own connections: one per thread or role)."""
        return EtcdStore(self.endpoints, self.namespace, self.timeout_s if timeout_s is None else timeout_s,
                         fence, abort)

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

    def _await(self, keys: list[str], timeout_s: float) -> dict[str, dict]:
        """Wait until every key exists (etcd pushes the change: a watch, not a poll); their
        entries. DistStoreError after `timeout_s`, as TCPStore's waits."""
        deadline = time.monotonic() + timeout_s
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
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {timeout_s:.3f}s for keys {missing}")
            self._watch(missing[0], revision + 1, min(left, WATCH_S))

    def _watch(self, key: str, start_revision: int, seconds: float) -> None:
        """Return once `key` changes at or after `start_revision`, or after about `seconds`."""
        first = self._order()[0]
        client = self._clients[first]
        body = {"create_request": {"key": _b64(self.prefix + key), "start_revision": str(start_revision)}}
        try:
            with client.session.post(client.get_url("watch"), json=body, stream=True,
                                     timeout=(REQUEST_TIMEOUT_S, max(0.01, seconds))) as resp:
                for line in resp.iter_lines():
                    result = json.loads(line).get("result", {}) if line else {}
                    if result.get("events") or result.get("canceled"):
                        return
        except requests.exceptions.ReadTimeout:
            return
        except (requests.RequestException, ValueError):
            self._failed(first)
            time.sleep(min(0.05, seconds))

    def _write(self, ops: list[dict], compare: list[dict] | None = None, deadline: float | None = None) -> dict:
        """One transaction of `ops` under `compare` and this process's fence; raises `Fenced`
        when the fence fails. The response's `succeeded` says whether `compare` held."""
        fence = [] if self.fence is None else [{"key": _b64(self.prefix + self.fence[0]), "target": "CREATE",
                                                "result": "EQUAL", "create_revision": str(self.fence[1])}]
        if not fence:
            return self.request("kv/txn", {"compare": compare or [], "success": ops}, deadline)
        result = self.request("kv/txn", {"compare": fence + (compare or []), "success": ops,
                                         "failure": [{"request_range": {"key": fence[0]["key"]}}]}, deadline)
        if not result.get("succeeded"):
            kvs = result["responses"][0]["response_range"].get("kvs") or []
            if not kvs or int(kvs[0].get("create_revision", 0)) != self.fence[1]:
                raise Fenced(f"this host lost its lease ({self.fence[0]} is gone): it is no longer part of the job")
        return result

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

    def create(self, key: str, value: str | bytes, lease: int | None = None) -> int | None:
        """Create `key` if it does not exist (bound to `lease`); its create revision, or None
        if it existed."""
        full = _b64(self.prefix + key)
        put = {"key": full, "value": _b64(value), **({"lease": lease} if lease else {})}
        result = self._write([{"request_put": put}],
                             [{"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}])
        return int(result["header"]["revision"]) if result.get("succeeded") else None

    def entry(self, key: str) -> tuple[bytes, int, int] | None:
        """(value, create revision, lease) of `key`, or None if it does not exist."""
        kv = self._range(key)
        if kv is None:
            return None
        return base64.b64decode(kv.get("value", "")), int(kv["create_revision"]), int(kv.get("lease", 0))

    def under(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with `prefix` (relative to this store's), with its value."""
        full = self.prefix + prefix
        kvs = self.request("kv/range", {"key": _b64(full), "range_end": _prefix_end(full)}).get("kvs") or []
        return {base64.b64decode(kv["key"]).decode()[len(self.prefix):]: base64.b64decode(kv.get("value", ""))
                for kv in kvs}

    # ----- the Store interface
    def set(self, key: str, value: str | bytes) -> None:
        self._write([{"request_put": {"key": _b64(self.prefix + key), "value": _b64(value)}}])

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._await([key], self.timeout_s)[key].get("value", ""))

    def add(self, key: str, value: int) -> int:
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
        full = _b64(self.prefix + key)
        expect = expected.encode() if isinstance(expected, str) else expected
        compare = ({"key": full, "target": "VALUE", "result": "EQUAL", "value": _b64(expect)} if expect
                   else {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
        if self._write([{"request_put": {"key": full, "value": _b64(desired)}}], [compare]).get("succeeded"):
            return desired.encode() if isinstance(desired, str) else desired
        kv = self._range(key)
        return base64.b64decode(kv.get("value", "")) if kv else expect

    def delete_key(self, key: str) -> bool:
        result = self._write([{"request_delete_range": {"key": _b64(self.prefix + key)}}])
        return int(result["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def check(self, keys: list[str]) -> bool:
        return all(self._range(k) is not None for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        ops = [{"request_put": {"key": _b64(self.prefix + k), "value": _b64(v)}} for k, v in zip(keys, values)]
        self._write(ops)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, self.timeout_s if timeout is None else timeout.total_seconds())

    def num_keys(self) -> int:
        result = self.request("kv/range", {"key": _b64(self.prefix), "range_end": _prefix_end(self.prefix),
                                         "count_only": True})
        return int(result.get("count", 0))

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()
