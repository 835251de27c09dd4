"""The job's store on etcd: a `torch.distributed.Store` whose keys live in a replicated etcd cluster.

With `--rdzv etcd://...` every Leto process (supervisors, coordinator, workers, keepers, shadows)
and every process group's rendezvous uses this store, so the store dies with no single host:
etcd keeps it while a quorum of its members lives. Requests go through `EtcdClient`
(`etcd_client.py`); leases and fencing are `EtcdControl`'s (`etcd_control.py`).

etcd has no increment and no blocking get: `add` is a compare-and-swap transaction retried on
conflict, and `get`/`wait` watch the keys they wait for (etcd pushes the change), each with a
deadline.

A process group's rendezvous reads every rank's key, one after the other, and each key is
written once (`keys.RENDEZVOUS`): such a read fetches the whole group's keys in one request and
keeps them, so a group of N ranks costs each rank about one read instead of N.

A store that polls (a supervisor's and the coordinator's: commands, reports, the job's state,
the host records, every 10-100 ms) reads from a `Mirror` instead (`etcd_mirror.py`): a local
copy of the keys under a prefix, kept current by one watch, so that a poll costs no request.
"""

from __future__ import annotations

import base64
import random
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from leto.protocol import keys as job_keys
from leto.runtime.etcd_client import SCHEME, EtcdError, Fenced, StoreUnavailable, b64, parse_endpoints, prefix_end
from leto.runtime.etcd_control import EtcdControl
from leto.runtime.etcd_mirror import Mirror

__all__ = ["SCHEME", "EtcdError", "EtcdStore", "Fenced", "StoreUnavailable", "parse_endpoints"]

WATCH_S = 1.0  # the longest single watch of a wait: then the keys (and `abort`) are checked again
POLL_MIN_S = 0.002  # the longest random pause before an `add` retries a conflict


class EtcdStore(EtcdControl, dist.Store):
    """Keys under `/leto/<namespace>/` of an etcd cluster, as a torch.distributed Store; every
    write is fenced (`EtcdClient`)."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        namespace: str,
        timeout_s: float,
        fence: tuple[str, int] | None = None,
        abort: Callable[[], str | None] | None = None,
        mirror: str | None = None,
        write_once: Sequence[str] = job_keys.RENDEZVOUS,
    ) -> None:
        """`abort`: a check that makes every retry give up at once with its reason (a
        supervisor whose host lost its lease stops waiting for etcd). `mirror`: reads of keys
        under this prefix come from a `Mirror` (a store that polls them). `write_once`: prefixes
        whose keys are written once and never change (their reads are kept, `_get_once`)."""
        dist.Store.__init__(self)
        EtcdControl.__init__(self, endpoints, namespace, timeout_s, fence, abort)
        self.write_once = tuple(write_once)
        self._once: dict[str, bytes] = {}  # values read of write-once keys
        self._once_lock = threading.Lock()
        self._mirror = Mirror(self, mirror) if mirror is not None else None

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> EtcdStore:
        """`etcd://H1:P1,H2:P2/NAMESPACE[?fence=KEY@REVISION]`, as `url` writes it."""
        rest, _, query = url[len(SCHEME) :].partition("?")
        namespace = rest.split("/", 1)[1] if "/" in rest else "default"
        fence = None
        if query.startswith("fence="):
            key, _, rev = query[len("fence=") :].rpartition("@")
            fence = (key, int(rev))
        return cls(parse_endpoints(url), namespace, timeout_s, fence)

    def client(
        self,
        fence: tuple[str, int] | None = None,
        abort: Callable[[], str | None] | None = None,
        timeout_s: float | None = None,
        mirror: str | None = None,
    ) -> EtcdStore:
        """Another client of the same store (its own connections: one per thread or role)."""
        return EtcdStore(
            self.endpoints,
            self.namespace,
            self.timeout_s if timeout_s is None else timeout_s,
            fence,
            abort,
            mirror,
            self.write_once,
        )

    def clone(self) -> EtcdStore:
        """Another client with this one's fence (torch's `Store.clone`: a thread of its own that
        waits on the store while this one does)."""
        return self.client(self.fence, self.abort)

    def close(self) -> None:
        """Stop the mirror's watch, if it has one."""
        if self._mirror is not None:
            self._mirror.close()

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
                result = self.request("kv/range", {"key": b64(self.prefix + key)}, max(deadline, time.monotonic() + 1))
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
        folder = key[: key.rfind("/") + 1]
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

    def _write(self, ops: list[dict], compare: list[dict] | None = None, deadline: float | None = None) -> dict:
        """`EtcdClient._write`; what this store wrote is in its mirror at once."""
        result = super()._write(ops, compare, deadline)
        if self._mirror is not None and result.get("succeeded"):
            self._mirror.apply_writes(ops, int(result["header"]["revision"]), len(self.prefix))
        return result

    def fence_out(self, key: str, lease: int) -> None:
        """`EtcdControl.fence_out`, after forgetting any kept value of `key`."""
        self._forget(key)
        super().fence_out(key, lease)

    def value(self, key: str) -> bytes | None:
        """The value of `key` now, or None if it does not exist: no wait (from the mirror, where
        it covers the key)."""
        if self._mirror is not None and self._mirror.covers([key]) and self._mirror.fresh():
            return self._mirror.lookup(key)
        kv = self._range(key)
        return None if kv is None else base64.b64decode(kv.get("value", ""))

    def under(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with `prefix` (relative to this store's), with its value."""
        if self._mirror is not None and self._mirror.covers([prefix]) and self._mirror.fresh():
            return self._mirror.under(prefix)
        return self._read_under(prefix)[0]

    # ----- the Store interface
    def set(self, key: str, value: str | bytes) -> None:
        self._write([{"request_put": {"key": b64(self.prefix + key), "value": b64(value)}}])
        if self._is_once(key):
            with self._once_lock:
                self._once[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        if self._is_once(key):
            return self._get_once(key, self.timeout_s)
        return self._await([key], self.timeout_s)[key]

    def add(self, key: str, value: int) -> int:
        self._forget(key)  # a counter is not write-once, whatever its name
        full = b64(self.prefix + key)
        deadline = time.monotonic() + self.timeout_s
        while True:
            kv = self._range(key)
            current = int(base64.b64decode(kv["value"])) if kv and kv.get("value") else 0
            compare = (
                {"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
                if kv
                else {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            )
            result = self._write(
                [{"request_put": {"key": full, "value": b64(str(current + value))}}], [compare], deadline
            )
            if result.get("succeeded"):
                return current + value
            if time.monotonic() >= deadline:
                raise StoreUnavailable(f"add to {key!r}: still contended after {self.timeout_s:.1f}s")
            time.sleep(random.uniform(0, POLL_MIN_S))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._forget(key)
        full = b64(self.prefix + key)
        expect = expected.encode() if isinstance(expected, str) else expected
        compare = (
            {"key": full, "target": "VALUE", "result": "EQUAL", "value": b64(expect)}
            if expect
            else {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        )
        if self._write([{"request_put": {"key": full, "value": b64(desired)}}], [compare]).get("succeeded"):
            return desired.encode() if isinstance(desired, str) else desired
        kv = self._range(key)
        return base64.b64decode(kv.get("value", "")) if kv else expect

    def delete_key(self, key: str) -> bool:
        self._forget(key)
        result = self._write([{"request_delete_range": {"key": b64(self.prefix + key)}}])
        return int(result["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def check(self, keys: list[str]) -> bool:
        if self._mirror is not None and self._mirror.covers(keys) and self._mirror.fresh():
            return all(self._mirror.lookup(k) is not None for k in keys)
        return all(self._range(k) is not None for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        ops = [{"request_put": {"key": b64(self.prefix + k), "value": b64(v)}} for k, v in zip(keys, values)]
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
        result = self.request(
            "kv/range", {"key": b64(self.prefix), "range_end": prefix_end(self.prefix), "count_only": True}
        )
        return int(result.get("count", 0))

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()
