"""A gradient sum whose bits do not depend on how many processes compute it.

The job has a fixed number L of logical data-parallel replicas; after a shrink a process hosts
several of them. gloo's all-reduce adds in an order that depends on the number of ranks, so a
shrunk run would drift from a failure-free one by rounding. `ordered_all_reduce` is a ring over
the logical replicas instead: every element's additions happen in an order fixed by logical
indices alone, so any hosting of the L replicas ends with exactly the same bits. Messages
between replicas on one process are local copies; the rest go point to point. Each process sends
and receives what a ring all-reduce does, 2(L-1)/L of the gradient, in 2(L-1) steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leto.runtime.comm import Comm

REDUCE, GATHER = 0, 1  # the ring's two phases: reduce-scatter, then all-gather


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
    replica this rank hosts) becomes the sum over all len(host_of) logical replicas.

    A ring over logical replicas: at reduce step k, replica i sends segment (i-k) mod L to
    replica i+1, which adds it to its own; after L-1 steps replica i holds the whole sum of
    segment i+1, and L-1 all-gather steps pass the sums on round the same ring."""
    n = len(host_of)
    mine = sorted(grads)
    if mine != [r for r in range(n) if host_of[r] == comm.rank]:
        raise ValueError(f"rank {comm.rank} hosts replicas {mine}, not those host_of gives it")
    if n == 1 or not mine:
        return
    numel = grads[mine[0]].numel()
    if any(g.dim() != 1 or g.numel() != numel or not g.is_contiguous() for g in grads.values()):
        raise ValueError("every gradient must be a contiguous 1-D tensor of one size")
    seg = [slice(p.start, p.stop) for p in (_part(numel, n, s) for s in range(n))]
    first = grads[mine[0]]
    bufs = {  # one segment's receive buffer for each replica whose predecessor is elsewhere
        r: torch.empty(-(-numel // n), dtype=first.dtype, device=first.device)
        for r in mine
        if host_of[(r - 1) % n] != comm.rank
    }
    for phase in (REDUCE, GATHER):
        for step in range(n - 1):
            sends, recvs, adds = [], [], []
            for r in mine:
                src, dst = (r - 1) % n, (r + 1) % n
                out, into = (r - step + phase) % n, (src - step + phase) % n  # segment sent, received
                if host_of[dst] != comm.rank:
                    sends.append((grads[r][seg[out]], host_of[dst], _tag(n, phase, step, r)))
                mine_part = grads[r][seg[into]]
                if host_of[src] == comm.rank:  # disjoint from what anyone sends or receives this step
                    if phase == REDUCE:
                        mine_part += grads[src][seg[into]]
                    else:
                        mine_part.copy_(grads[src][seg[into]])
                elif phase == REDUCE:
                    buf = bufs[r][: mine_part.numel()]
                    recvs.append((buf, host_of[src], _tag(n, phase, step, src)))
                    adds.append((mine_part, buf))
                else:
                    recvs.append((mine_part, host_of[src], _tag(n, phase, step, src)))
            comm.exchange(sends, recvs, "ordered all-reduce")
            for mine_part, buf in adds:
                mine_part += buf


def _tag(n: int, phase: int, step: int, source: int) -> int:
    """The tag of the message logical replica `source` sends at (phase, step)."""
    return (phase * (n - 1) + step) * n + source
