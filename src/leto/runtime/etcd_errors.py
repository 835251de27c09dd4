"""What a job's processes know of etcd without loading its client (`etcd_client`, whose HTTP
libraries cost ~0.1 s at import, paid by every process of a one-host job that never uses them):
the scheme of an etcd address and the store errors a multi-host job's processes catch."""

from __future__ import annotations

import torch.distributed as dist

SCHEME = "etcd://"


class StoreUnavailable(dist.DistStoreError):
    """No etcd endpoint answered, or the cluster has no quorum."""


class EtcdError(dist.DistStoreError):
    """etcd answered, and refused the request (e.g. a lease it does not know)."""


class Fenced(dist.DistStoreError):
    """A write refused because this process's host lost its lease: the job has moved on without it."""
