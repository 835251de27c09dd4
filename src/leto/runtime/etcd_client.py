"""Requests to etcd: its v3 JSON gateway through `etcd3gw`'s client (docs/design.md, "Multi-host"),
to the first endpoint that answers, trying the next ones when one does not (a host's own etcd
member is put first); watches; and transactions under the process's fence."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator, Sequence

import etcd3gw
import requests
import urllib3
from etcd3gw import exceptions as gw

from leto.runtime.etcd_errors import SCHEME, EtcdError, Fenced, StoreUnavailable

# One HTTP request. A member that is frozen (SIGSTOP) or whose host froze still accepts connections
# (the kernel answers) but never replies: this is how long it can hold a request before the next
# endpoint is tried. etcd itself gives up on a write without a quorum after ~5 s.
REQUEST_TIMEOUT_S = 1.0
SHUN_S = 5.0  # an endpoint that failed is tried after the others for this long


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """`etcd://H1:2379,H2:2379` -> [(H1, 2379), (H2, 2379)]; ValueError naming what is wrong."""
    if not url.startswith(SCHEME):
        raise ValueError(f"{url!r}: an etcd rendezvous address starts with {SCHEME}")
    out = []
    for part in url[len(SCHEME) :].split("/", 1)[0].split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{url!r}: {part!r} is not HOST:PORT")
        out.append((host, int(port)))
    return out


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix`."""
    raw = prefix.encode()
    return b64(raw[:-1] + bytes([raw[-1] + 1]))


def _read_timed_out(e: requests.RequestException) -> bool:
    """Whether a streamed response went quiet for its read timeout: requests raises that as a
    ConnectionError around urllib3's ReadTimeoutError once the body is streaming."""
    return isinstance(e, requests.exceptions.ReadTimeout) or any(
        isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in e.args
    )


class EtcdClient:
    """Requests to the keys under `/leto/<namespace>/` of an etcd cluster.

    `fence` = (key, create_revision): every write is one transaction that succeeds only while
    that key (a host's lease-bound record) is the one this process was started under, so a
    host that lost its lease can never write into the job again (`Fenced`). `abort`: a check
    that makes every retry give up at once with its reason (a supervisor whose host lost its
    lease stops waiting for etcd)."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        namespace: str,
        timeout_s: float,
        fence: tuple[str, int] | None = None,
        abort: Callable[[], str | None] | None = None,
    ) -> None:
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

    def url(self, first: tuple[str, int] | None = None, fence: tuple[str, int] | None = None) -> str:
        """This store's address for a child process; `first`: the endpoint it tries first."""
        eps = ([first] if first else []) + [e for e in self.endpoints if e != first]
        fence = fence or self.fence
        return (
            SCHEME
            + ",".join(f"{h}:{p}" for h, p in eps)
            + "/"
            + self.namespace
            + (f"?fence={fence[0]}@{fence[1]}" if fence else "")
        )

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
                    errors.append(f"{client.host}:{client.port}: {type(e).__name__} {(e.detail_text or str(e))[:200]}")
                    self._failed(i)
                except gw.Etcd3Exception as e:  # an answer that refuses the request, not a failed endpoint
                    raise EtcdError(f"etcd refused {path}: {(e.detail_text or str(e))[:300]}") from e
                if time.monotonic() >= deadline:
                    raise StoreUnavailable(
                        "etcd unreachable or without quorum (" + "; ".join(errors[-len(self.endpoints) :]) + ")"
                    )
            time.sleep(0.05)  # every endpoint failed once: do not spin

    def _range(self, key: str) -> dict | None:
        kvs = self.request("kv/range", {"key": b64(self.prefix + key)}).get("kvs")
        return kvs[0] if kvs else None

    def _watch(self, key: str, start_revision: int, seconds: float) -> None:
        """Return once `key` changes at or after `start_revision`, or after about `seconds`."""
        body = {"create_request": {"key": b64(self.prefix + key), "start_revision": str(start_revision)}}
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
            with client.session.post(
                client.get_url("watch"), json=body, stream=True, timeout=(REQUEST_TIMEOUT_S, quiet_s)
            ) as resp:
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
        fence = (
            []
            if self.fence is None
            else [
                {
                    "key": b64(self.prefix + self.fence[0]),
                    "target": "CREATE",
                    "result": "EQUAL",
                    "create_revision": str(self.fence[1]),
                }
            ]
        )
        if not fence:
            return self.request("kv/txn", {"compare": compare or [], "success": ops}, deadline)
        result = self.request(
            "kv/txn",
            {
                "compare": fence + (compare or []),
                "success": ops,
                "failure": [{"request_range": {"key": fence[0]["key"]}}],
            },
            deadline,
        )
        if not result.get("succeeded"):
            kvs = result["responses"][0]["response_range"].get("kvs") or []
            if not kvs or int(kvs[0].get("create_revision", 0)) != self.fence[1]:
                raise Fenced(f"this host lost its lease ({self.fence[0]} is gone): it is no longer part of the job")
        return result

    def _read_under(self, prefix: str, deadline: float | None = None) -> tuple[dict[str, bytes], int]:
        """Every key under `prefix` with its value, read from etcd; and the revision read at."""
        full = self.prefix + prefix
        result = self.request("kv/range", {"key": b64(full), "range_end": prefix_end(full)}, deadline)
        n = len(self.prefix)
        found = {
            base64.b64decode(kv["key"]).decode()[n:]: base64.b64decode(kv.get("value", ""))
            for kv in result.get("kvs") or []
        }
        return found, int(result["header"]["revision"])
