"""A local copy of the keys under a prefix of etcd, kept current by one watch: a store that
polls (a supervisor's and the coordinator's: commands, reports, the job's state, the host
records, every 10-100 ms) reads from it, so that a poll costs no request."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Sequence

import requests
import torch.distributed as dist

from leto.runtime import threads
from leto.runtime.etcd_client import EtcdClient, EtcdError, StoreUnavailable, b64, prefix_end

FOLLOW_S = 1.0  # a mirror's watch that brings nothing this long is made again (it proves the member answers)
FRESH_S = 2.5  # a mirror not heard from for this long is not read: reads go to etcd


class Mirror:
    """A local copy of every key under `prefix`, kept current by one etcd watch (a thread).

    Reads of a covered key are answered from the copy while it is fresh: its watch was heard
    from (an event, or the watch made again after FOLLOW_S of quiet) within FRESH_S. Otherwise
    they go to etcd, so a frozen or dead member delays what the copy shows by FRESH_S at most.
    Its store's own writes are applied at once (a process reads what it wrote). A copy is as
    current as a read from its member; what it misses it never invents: a key it shows existed."""

    def __init__(self, store: EtcdClient, prefix: str) -> None:
        self.prefix = prefix
        self._store = EtcdClient(store.endpoints, store.namespace, store.timeout_s)  # its own connections
        self._full = store.prefix + prefix
        self._kv: dict[str, tuple[bytes | None, int]] = {}  # key -> (value or None if deleted, mod revision)
        self._revision = 0  # everything up to this revision is applied
        self._heard = 0.0  # monotonic time the watch was last heard from
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

    def apply_writes(self, ops: list[dict], revision: int, strip: int) -> None:
        """The puts and deletes of a transaction its store committed at `revision` (their
        keys carry the store's prefix, `strip` characters)."""
        for op in ops:
            if "request_put" in op:
                put = op["request_put"]
                self.apply(base64.b64decode(put["key"]).decode()[strip:], base64.b64decode(put["value"]), revision)
            elif "request_delete_range" in op:
                self.apply(base64.b64decode(op["request_delete_range"]["key"]).decode()[strip:], None, revision)

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
        result = self._store.request("kv/range", {"key": b64(self._full), "range_end": prefix_end(self._full)})
        n = len(self._store.prefix)
        kvs = {
            base64.b64decode(kv["key"]).decode()[n:]: (base64.b64decode(kv.get("value", "")), int(kv["mod_revision"]))
            for kv in result.get("kvs") or []
        }
        with self._changed:
            self._kv = kvs
            self._revision = int(result["header"]["revision"])
            self._heard, self._synced = time.monotonic(), True
            self._changed.notify_all()

    def _follow(self) -> None:
        """One watch from the next revision, until it is quiet for FOLLOW_S."""
        body = {
            "create_request": {
                "key": b64(self._full),
                "range_end": prefix_end(self._full),
                "start_revision": str(self._revision + 1),
            }
        }
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
