"""Joining a generation's group: a rendezvous abandoned for a newer generation leaves the process free."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from leto.runtime.comm import Comm, PeerFailure
from leto.runtime.env import LOOPBACK

STORE_TIMEOUT_S = 30.0


def test_an_abandoned_rendezvous_leaves_the_processs_store_client_free() -> None:
    """A peer named in the new generation dies before it joins: the rendezvous, given up when the
    next generation is announced, stays blocked in its thread on the dead peer's key until the
    store's timeout. The process's own store client must answer meanwhile: it reads the next
    generation through it (a shared client serves one request at a time, and held it 60 s)."""
    server = dist.TCPStore(LOOPBACK, 0, 1, True, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    client = dist.TCPStore(LOOPBACK, server.port, 1, False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    announced = threading.Event()
    threading.Timer(0.5, announced.set).start()  # the next generation, once the rendezvous waits
    with pytest.raises(PeerFailure, match="aborted"):
        Comm(client, 1, 0, 2, STORE_TIMEOUT_S, lambda: "generation 2 was announced" if announced.is_set() else None)
    answered = threading.Event()
    threading.Thread(target=lambda: (client.check(["membership/2"]), answered.set()), daemon=True).start()
    assert answered.wait(STORE_TIMEOUT_S / 3), "the process's store client is held by the abandoned rendezvous"
