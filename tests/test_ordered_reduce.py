"""The sum of the L replicas' gradients has the same bits whichever processes host the
replicas (a shrunk job reduces over a group of the L replicas, each rank a member once per
replica it hosts), across real gloo processes on 127.0.0.1; a dead peer is a `PeerFailure`,
not a hang.

Run as a script, this file is one of those processes (see `_worker`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from leto.runtime.comm import Comm, PeerFailure
from leto.runtime.env import LOOPBACK, connect, loopback_store, network_env
from leto.runtime.ordered import hosted, join_replicas, reduce_replicas, replica_hosts

PROCESSES = 4
# name -> (logical replicas, gradient numel, host_of); the ranks of a case are 0..max(host_of)
CASES: dict[str, tuple[int, int, list[int]]] = {
    **{f"L4-D{d}": (4, 4096, replica_hosts(4, d)) for d in (4, 3, 2, 1)},
    "L4-interleaved": (4, 4096, [0, 1, 0, 1]),
    **{f"L4-n1001-D{d}": (4, 1001, replica_hosts(4, d)) for d in (4, 3, 1)},
    **{f"L4-n2-D{d}": (4, 2, replica_hosts(4, d)) for d in (4, 1)},
    **{f"L3-D{d}": (3, 1001, replica_hosts(3, d)) for d in (3, 2, 1)},
    **{f"L2-D{d}": (2, 1001, replica_hosts(2, d)) for d in (2, 1)},
    "L1-D1": (1, 1001, [0]),
}


def gradient(replicas: int, numel: int, replica: int) -> torch.Tensor:
    """Logical replica `replica`'s gradient: fixed by its seed, magnitudes from 1e-6 to 1e6 so
    that the order of a sum shows in its bits."""
    g = torch.Generator().manual_seed(1000 * replicas + replica)
    return torch.randn(numel, generator=g) * 10.0 ** torch.randint(-6, 7, (numel,), generator=g)


def _spawn(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *map(str, args)],
        env=dict(os.environ, **network_env(LOOPBACK)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> dict[str, dict[int, dict[int, torch.Tensor]]]:
    """Every case reduced by real processes: case -> rank -> logical replica -> its result."""
    out = tmp_path_factory.mktemp("ordered")
    store = loopback_store(60)
    procs = [_spawn("reduce", f"{LOOPBACK}:{store.port}", r, out) for r in range(PROCESSES)]
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        _stop(procs)
    assert [p.returncode for p in procs] == [0] * PROCESSES, errs
    return {
        name: {d: torch.load(out / f"{name}.{d}.pt") for d in range(max(host_of) + 1)}
        for name, (_, _, host_of) in CASES.items()
    }


def results(reduced: dict, name: str) -> list[torch.Tensor]:
    """Every result tensor of a case, from every process; one per logical replica."""
    got = [t for by_replica in reduced[name].values() for t in by_replica.values()]
    assert len(got) == CASES[name][0]
    return got


def the_sum(reduced: dict, name: str) -> torch.Tensor:
    """The case's one result: every process's every replica holds the same bits."""
    first, *rest = results(reduced, name)
    assert all(torch.equal(first, t) for t in rest)
    return first


@pytest.mark.parametrize(
    "names",
    [
        ["L4-D4", "L4-D3", "L4-D2", "L4-D1", "L4-interleaved"],
        ["L4-n1001-D4", "L4-n1001-D3", "L4-n1001-D1"],
        ["L4-n2-D4", "L4-n2-D1"],
        ["L3-D3", "L3-D2", "L3-D1"],
        ["L2-D2", "L2-D1"],
    ],
)
def test_the_sum_has_the_same_bits_on_any_number_of_processes(reduced, names: list[str]) -> None:
    sums = [the_sum(reduced, name) for name in names]
    assert all(torch.equal(sums[0], s) for s in sums[1:])


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("-D1") or n == "L1-D1"])
def test_the_sum_is_the_float32_sum_of_every_replica(reduced, name: str) -> None:
    """Within recursive summation's bound of the exact (float64) sum."""
    replicas, numel, _ = CASES[name]
    grads = torch.stack([gradient(replicas, numel, r) for r in range(replicas)]).double()
    bound = replicas * 2.0**-24 * grads.abs().sum(0)
    assert ((the_sum(reduced, name).double() - grads.sum(0)).abs() <= bound).all()


@pytest.mark.parametrize("name", ["L4-D4", "L4-n1001-D4", "L3-D3"])
def test_the_order_of_the_sum_shows_in_the_bits_of_this_data(reduced, name: str) -> None:
    """So the same bits above are not a matter of luck: a sum in another order differs."""
    replicas, numel, _ = CASES[name]
    reverse = gradient(replicas, numel, replicas - 1)
    for r in reversed(range(replicas - 1)):
        reverse = reverse + gradient(replicas, numel, r)
    assert not torch.equal(the_sum(reduced, name), reverse)


def test_one_replica_is_left_as_it_is(reduced) -> None:
    assert torch.equal(the_sum(reduced, "L1-D1"), gradient(1, 1001, 0))


def test_replicas_are_hosted_in_contiguous_balanced_blocks() -> None:
    assert replica_hosts(4, 4) == [0, 1, 2, 3]
    assert replica_hosts(4, 3) == [0, 0, 1, 2]
    assert replica_hosts(4, 2) == [0, 0, 1, 1]
    assert replica_hosts(4, 1) == [0, 0, 0, 0]
    assert replica_hosts(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    assert [hosted(7, 3, d) for d in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    for replicas in range(1, 9):
        for dp in range(1, replicas + 1):
            host_of = replica_hosts(replicas, dp)
            assert [list(hosted(replicas, dp, d)) for d in range(dp)] == [
                [r for r in range(replicas) if host_of[r] == d] for d in range(dp)
            ]


@pytest.mark.parametrize("replicas, dp_size", [(4, 5), (4, 0), (0, 1), (3, -1)])
def test_more_dp_ranks_than_replicas_or_none_is_a_value_error(replicas: int, dp_size: int) -> None:
    with pytest.raises(ValueError):
        replica_hosts(replicas, dp_size)
    with pytest.raises(ValueError):
        hosted(replicas, dp_size, 0)


@pytest.mark.parametrize("dp_rank", [-1, 2])
def test_a_dp_rank_outside_the_group_is_a_value_error(dp_rank: int) -> None:
    with pytest.raises(ValueError):
        hosted(4, 2, dp_rank)


def test_gradients_of_replicas_the_rank_is_no_member_for_are_a_value_error() -> None:
    comms = {0: SimpleNamespace(), 1: SimpleNamespace()}
    with pytest.raises(ValueError):
        reduce_replicas(SimpleNamespace(), comms, {0: torch.zeros(8), 2: torch.zeros(8)})  # type: ignore[arg-type]


def test_a_replica_whose_host_never_joins_fails_the_join_after_the_timeout() -> None:
    """This process hosts replicas 0 and 1 of 3; nobody hosts replica 2."""
    store = loopback_store(60)
    with pytest.raises(PeerFailure, match="joining the group of 3 replicas failed"):
        join_replicas(store, 0, "replicas", [0, 1], 3, 3.0, lambda: None, None, "gloo")


def _failing_reduction(timeout_s: float) -> tuple[list[subprocess.Popen], subprocess.Popen]:
    """A shrunk job: ranks 0 and 1 start the reduction of 4 replicas (rank 0 hosting two); rank
    2 joins the groups and never takes part. Returns once the survivors are in it and rank 2 has
    joined."""
    store = loopback_store(60)
    addr = f"{LOOPBACK}:{store.port}"
    survivors = [_spawn("survive", addr, r, timeout_s) for r in (0, 1)]
    victim = _spawn("stall", addr, 2, timeout_s)
    procs = [*survivors, victim]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["reducing", "reducing", "joined"], [
            p.communicate(timeout=60)[1] for p in procs
        ]
    except BaseException:
        _stop(procs)
        raise
    time.sleep(0.5)  # the survivors' first messages are posted
    return survivors, victim


def _failures(survivors: list[subprocess.Popen]) -> list[str]:
    outs = [p.communicate(timeout=60) for p in survivors]
    assert [p.returncode for p in survivors] == [0, 0], [err for _, err in outs]
    return [json.loads(out.strip().splitlines()[-1])["failure"] for out, _ in outs]


def test_a_peer_that_never_sends_is_a_peer_failure_after_the_timeout() -> None:
    survivors, victim = _failing_reduction(timeout_s=5)
    try:
        failures = _failures(survivors)
    finally:
        _stop([*survivors, victim])
    assert all("all-reduce timed out after 5.0s" in f for f in failures), failures


def test_a_killed_peer_is_a_peer_failure_at_once() -> None:
    """With a 120 s comm timeout that the survivors never reach: the dead connection fails them."""
    survivors, victim = _failing_reduction(timeout_s=120)
    try:
        os.kill(victim.pid, signal.SIGKILL)
        failures = _failures(survivors)
    finally:
        _stop([*survivors, victim])
    assert all(f.startswith("all-reduce failed in generation 0") for f in failures), failures


def _worker(mode: str, addr: str, rank: int, arg: str) -> None:
    torch.set_num_threads(1)
    store = connect(addr, 60)
    if mode == "reduce":  # every case in turn, one generation each; arg: the output folder
        for gen, (name, (replicas, numel, host_of)) in enumerate(CASES.items()):
            if rank > max(host_of):
                continue
            dp, comms = _join(store, gen, rank, replicas, host_of, 30)
            grads = {r: gradient(replicas, numel, r) for r in range(replicas) if host_of[r] == rank}
            reduce_replicas(dp, comms, grads)
            torch.save(grads, Path(arg) / f"{name}.{rank}.pt")
            for comm in (dp, *comms.values()):
                comm.close()
        return
    host_of = [0, 0, 1, 2]  # shrunk: rank 0 hosts two replicas, the victim (rank 2) one
    dp, comms = _join(store, 0, rank, 4, host_of, float(arg))  # arg: the comm timeout
    if mode == "stall":
        print("joined", flush=True)
        time.sleep(600)
        return
    grads = {r: gradient(4, 1 << 20, r) for r in range(4) if host_of[r] == rank}
    print("reducing", flush=True)
    try:
        reduce_replicas(dp, comms, grads)
    except PeerFailure as e:
        print(json.dumps({"failure": str(e)}), flush=True)
        os._exit(0)  # the group is left to its background timeout
    sys.exit("the reduction finished without the victim's replica")


def _join(
    store: object, gen: int, rank: int, replicas: int, host_of: list[int], timeout_s: float
) -> tuple[Comm, dict[int, Comm]]:
    """The DP group of a case and, where it runs on fewer ranks than replicas, this rank's
    members of the group of all replicas (what `make_comms` builds in a job)."""
    size = max(host_of) + 1
    dp = Comm(store, gen, rank, size, timeout_s)
    if size == replicas:
        return dp, {}
    mine = [r for r in range(replicas) if host_of[r] == rank]
    return dp, join_replicas(store, gen, "replicas", mine, replicas, timeout_s, lambda: None, None, "gloo")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
