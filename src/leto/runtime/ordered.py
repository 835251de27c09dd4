"""A gradient sum whose bits do not depend on how many processes compute it.

The job has a fixed number L of logical data-parallel replicas; after a shrink a process hosts
several of them. gloo's all-reduce adds in an order that depends on the number of ranks, so a
shrunk run would drift from a failure-free one by rounding. `ordered_all_reduce` adds every
element in replica order, ((g0 + g1) + g2) + ..., whatever the hosting: an all-to-all hands each
of the D processes its segment of every replica's gradient, the process folds them in replica
order, and an all-gather returns the sums. Two of gloo's own collectives (asynchronous, so an
abort releases them); each process sends what a ring all-reduce sends, 2(D-1)/D of the gradient
(times the replicas it hosts, for the all-to-all), and holds one gradient-sized receive buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leto.runtime.comm import Comm


def _part(n: int, parts: int, i: int) -> range:
    """Part `i` of `range(n)` cut into `parts` contiguous pieces whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (1 if i < extra else 0))


def _check(replicas: int, dp_size: int) -> None:
    if not 1 <= dp_size <= replicas:
        raise ValueError(f"{replicas} logical replicas cannot be hosted by {dp_size} DP ranks")


def replica_hosts(replicas: int, dp_size: int) -> list[int]:
    """host_of[l]: the DP rank that computes logical replica l (contiguous, balanced blocks)."""
    _check(replicas, dp_size)
    return [d for d in range(dp_size) for _ in _part(replicas, dp_size, d)]


def hosted(replicas: int, dp_size: int, dp_rank: int) -> range:
    """The logical replicas that `dp_rank` computes."""
    _check(replicas, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"DP rank {dp_rank} is not one of {dp_size}")
    return _part(replicas, dp_size, dp_rank)


def ordered_all_reduce(comm: Comm, grads: dict[int, torch.Tensor], host_of: Sequence[int]) -> None:
    """In place, every tensor of `grads` (logical replica -> its flat gradient, one for each
    replica this rank hosts) becomes the sum over all len(host_of) logical replicas, each
    element added in replica order."""
    n = len(host_of)
    mine = sorted(grads)
    if mine != [r for r in range(n) if host_of[r] == comm.rank]:
        raise ValueError(f"rank {comm.rank} hosts replicas {mine}, not those host_of gives it")
    if not mine or n == 1:
        return
    d, first = comm.world_size, grads[mine[0]]
    numel = first.numel()
    if any(g.dim() != 1 or g.numel() != numel or not g.is_contiguous() for g in grads.values()):
        raise ValueError("every gradient must be a contiguous 1-D tensor of one size")
    seg = -(-numel // d)  # every rank's segment, the last ones padded
    # what goes to rank q: segment q of each replica this rank hosts, in replica order
    if d == 1:
        inp = None
    elif len(mine) == 1 and numel == seg * d:
        inp = first
    else:
        inp = torch.zeros(d, len(mine), seg, dtype=first.dtype, device=first.device)
        for q in range(d):
            for i, r in enumerate(mine):
                piece = grads[r][q * seg : (q + 1) * seg]
                inp[q, i, : piece.numel()] = piece
    parts = _segments(grads, mine, inp, comm, n, seg, host_of)
    length = max(0, min(numel, (comm.rank + 1) * seg) - comm.rank * seg)  # of this rank's segment
    total = parts[0][:length].clone()
    for part in parts[1:]:  # the fold, in replica order
        total += part[:length]
    if d == 1:
        for r in mine:
            grads[r].copy_(total)
        return
    gathered = first if numel == seg * d else torch.empty(seg * d, dtype=first.dtype, device=first.device)
    block = torch.zeros(seg, dtype=first.dtype, device=first.device)
    block[: total.numel()] = total
    comm.all_gather(gathered, block)
    for r in mine:
        if grads[r] is not gathered:
            grads[r].copy_(gathered[:numel])


def _segments(
    grads: dict[int, torch.Tensor],
    mine: list[int],
    inp: torch.Tensor | None,
    comm: Comm,
    n: int,
    seg: int,
    host_of: Sequence[int],
) -> list[torch.Tensor]:
    """This rank's segment of every replica's gradient, in replica order (an all-to-all)."""
    if inp is None:  # one process hosts every replica
        return [grads[r][:seg] for r in range(n)]
    d = comm.world_size
    hosted_by = [[r for r in range(n) if host_of[r] == q] for q in range(d)]
    out = torch.empty(n, seg, dtype=inp.dtype, device=inp.device)
    comm.all_to_all(out.view(-1), inp.reshape(-1), [len(h) * seg for h in hosted_by], [len(mine) * seg] * d)
    # out holds rank 0's replicas, then rank 1's, ...: put them in replica order
    order = [r for h in hosted_by for r in h]
    by_replica = dict(zip(order, out))
    return [by_replica[r] for r in range(n)]
