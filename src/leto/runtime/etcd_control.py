"""etcd's own operations, for the control plane: leases, lease-bound keys, fencing a host out
of the job, and moving etcd's Raft leader."""

from __future__ import annotations

import base64

import etcd3gw
from etcd3gw import exceptions as gw

from leto.runtime.etcd_client import REQUEST_TIMEOUT_S, EtcdClient, EtcdError, Fenced, StoreUnavailable, b64


class EtcdControl(EtcdClient):
    """Leases and lease-bound keys: a host's record lives as long as its lease, and a host
    still in the job fences out one whose lease it judges lost."""

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
        full = b64(self.prefix + key)
        self._write(
            [{"request_delete_range": {"key": full}}],
            [{"key": full, "target": "LEASE", "result": "EQUAL", "lease": str(lease)}],
        )
        self.revoke(lease)

    def create(self, key: str, value: str | bytes, lease: int | None = None) -> int | None:
        """Create `key` if it does not exist (bound to `lease`); its create revision, or None
        if it existed."""
        full = b64(self.prefix + key)
        put = {"key": full, "value": b64(value), **({"lease": lease} if lease else {})}
        result = self._write(
            [{"request_put": put}], [{"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}]
        )
        return int(result["header"]["revision"]) if result.get("succeeded") else None

    def entry(self, key: str) -> tuple[bytes, int, int] | None:
        """(value, create revision, lease) of `key`, or None if it does not exist."""
        kv = self._range(key)
        if kv is None:
            return None
        return base64.b64decode(kv.get("value", "")), int(kv["create_revision"]), int(kv.get("lease", 0))
