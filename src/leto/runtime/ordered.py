"""A gradient sum whose bits do not depend on how many processes compute it.

The job keeps the L data-parallel replicas of its launch; after a shrink a DP rank hosts
several of them (`replica_hosts`). gloo's all-reduce adds in an order that depends on the
number of ranks in the group, and on nothing else, so a shrunk job sums over a group of the L
replicas: a DP rank joins it once for each replica it hosts (`join_replicas`), and
`reduce_replicas` runs one all-reduce per hosted replica, all in flight at once. Same group
size, same algorithm, same bits as at full width, where the DP group itself is that group and
nothing extra runs: a failure-free step pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from leto.runtime import threads
from leto.runtime.comm import Comm, PeerFailure


def contiguous_part(n: int, parts: int, i: int) -> range:
    """Part `i` of `range(n)` cut into `parts` contiguous pieces whose sizes differ by at most
    one, the first `n % parts` pieces the longer (rows of a batch, replicas, pipeline stages)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (1 if i < extra else 0))


def _check(replicas: int, dp_size: int) -> None:
    if not 1 <= dp_size <= replicas:
        raise ValueError(f"{replicas} logical replicas cannot be hosted by {dp_size} DP ranks")


def replica_hosts(replicas: int, dp_size: int) -> list[int]:
    """host_of[l]: the DP rank that computes logical replica l (contiguous, balanced blocks)."""
    _check(replicas, dp_size)
    return [d for d in range(dp_size) for _ in contiguous_part(replicas, dp_size, d)]


def hosted(replicas: int, dp_size: int, dp_rank: int) -> range:
    """The logical replicas that `dp_rank` computes."""
    _check(replicas, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"DP rank {dp_rank} is not one of {dp_size}")
    return contiguous_part(replicas, dp_size, dp_rank)


def join_replicas(
    store: dist.Store,
    generation: int,
    name: str,
    mine: Sequence[int],
    replicas: int,
    timeout_s: float,
    abort_check: Callable[[], str | None],
    device: torch.device | None,
    backend: str,
) -> dict[int, Comm]:
    """This rank's members of the group `name` of all `replicas` replicas: one Comm for each
    replica in `mine`, built at once (each constructor waits for the whole group). NCCL cannot
    hold two ranks of a group on one device, so the group runs on gloo there."""
    backend = "gloo" if backend == "nccl" else backend
    box: dict[int, Comm | BaseException] = {}

    def build(r: int) -> None:
        try:
            box[r] = Comm(store, generation, r, replicas, timeout_s, abort_check, device, name, backend)
        except BaseException as e:  # handed to the joining thread
            box[r] = e

    # each Comm joins through a store client of its own, so the joins may run at once
    joiners = [threads.start(build, f"leto-join-replica-{r}", r) for r in mine]
    for t in joiners:
        t.join(timeout_s + 5)  # each Comm gives up by itself within timeout_s
    comms = {r: c for r, c in box.items() if isinstance(c, Comm)}
    if len(comms) < len(mine):
        for c in comms.values():
            c.close(abandon=True)
        why = next((str(e) for e in box.values() if isinstance(e, BaseException)), "timed out")
        raise PeerFailure(f"joining the group of {replicas} replicas failed: {why}")
    return comms


def reduce_replicas(dp: Comm, comms: dict[int, Comm], grads: dict[int, torch.Tensor]) -> None:
    """In place, every tensor of `grads` (replica -> its gradient, one for each replica this DP
    rank hosts) becomes the sum over all replicas, with the bits of a full-width run: over the
    DP group where it hosts one replica each (`comms` empty), else over `comms`, the group of
    all replicas (`join_replicas`)."""
    if not comms:
        (grad,) = grads.values()
        dp.all_reduce(grad)
        return
    if sorted(comms) != sorted(grads):
        raise ValueError(f"gradients of replicas {sorted(grads)}, members of the group for {sorted(comms)}")
    waits = [comms[r].start_all_reduce(g) for r, g in grads.items()]
    for wait in waits:
        wait()
