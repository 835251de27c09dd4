"""Draining a keeper: at a membership change it applies what is staged and what live peers
sent, then reports its region to the recovery (a reported region never changes); and the
drains it reads from the store (docs/protection.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from leto.errors import BadValue
from leto.protection.shm import H_DCOMMIT, H_GCOMMIT, H_STATE, STATE_DRAINED
from leto.protection.transport import Link
from leto.protocol import keys
from leto.protocol.messages import Refusals
from leto.protocol.protection import Drain, KeeperReport, SentCounts, StripeReport
from leto.runtime import env as rt

if TYPE_CHECKING:
    from leto.protection.keeper import Keeper

T = TypeVar("T")
_refused = Refusals("leto keeper")  # malformed store values this keeper ignored (said once each)


def report(keeper: Keeper) -> KeeperReport:
    """What recovery needs from `keeper` (after draining)."""
    parity = keeper.parity
    r, h = keeper.region, keeper.region.header
    g = int(h[H_GCOMMIT])
    base = {
        "node": keeper.node,
        "generation": keeper.gen,
        "d_commit": int(h[H_DCOMMIT]),
        "v1": r["v1"].tolist(),
        "crc1": r["crc1"].tolist(),
    }
    if not keeper.grads:  # the step every delta is folded at (and an interval's pre-images)
        pre = {"crc_pre": r["crc1_pre"].tolist(), "pre_step": r["p1_pre_step"].tolist()} if parity.interval else {}
        return KeeperReport(
            **base,
            **pre,
            applied=parity.applied_step(),
            stripes={si: _stripe_report(keeper, si) for si in parity.stripes},
        )
    return KeeperReport(
        **base,
        g_commit=g,
        grads_complete=[s for s in (g, g + 1) if parity.grads_complete(s)],
        gcrc1=r["gcrc1"].tolist(),
        g1_step=r["g1_step"].tolist(),
        stripes={si: _stripe_report(keeper, si) for si in parity.stripes},
    )


def _stripe_report(keeper: Keeper, si: int) -> StripeReport:
    r = keeper.region
    pre = (
        {"crc_pre": r[f"crc2_{si}_pre"].tolist(), "pre_step": r[f"p2_{si}_pre_step"].tolist()}
        if keeper.layout.tier2_preimages
        else {}
    )
    if keeper.grads:
        return StripeReport(**{k: r[f"{k}_{si}"].tolist() for k in ("v2", "crc2", "gcrc2", "g2_step")}, **pre)
    return StripeReport(r[f"v2_{si}"].tolist(), r[f"crc2_{si}"].tolist(), **pre)


def drain(
    keeper: Keeper, live_nodes: set[int], timeout_s: float, abandoned: Callable[[], bool] = lambda: False
) -> KeeperReport:
    """Apply everything `keeper` has staged and everything live peers sent, then report. Waits
    for peers end early once `abandoned()`: a later membership change (a peer died meanwhile) makes
    this report moot, and the next drain must not sit out the timeout on a dead peer."""
    if keeper.reported:  # drained before (that recovery was cut short): the region is as then reported
        with keeper.lock:
            return report(keeper)
    deadline = time.monotonic() + timeout_s
    # everything staged goes into tier 1 before the report: a worker updated its chunk in place
    # once the slot was published (a live link's full send buffers only make it wait a moment)
    while time.monotonic() < deadline:
        if keeper.consume_slots():
            continue
        if not keeper.staged() or abandoned():
            break
        time.sleep(1e-3)
    for kind in keeper.nbytes:  # batches a dead worker left unfinished
        keeper.flush(kind)
    for n, link in keeper.links.items():  # let our queued sends leave, then say how many
        if not link.bufs:
            continue
        while (
            n in live_nodes
            and not link.idle()
            and link.error is None
            and time.monotonic() < deadline
            and not abandoned()
        ):
            time.sleep(1e-3)
        keeper.store.set(keys.sent(keeper.gen, keeper.node, n), SentCounts(dict(link.sent)).to_json())
    for n, link in keeper.links.items():  # wait for what live senders sent us
        key = keys.sent(keeper.gen, n, keeper.node)
        if n not in live_nodes or n not in keeper.layout.senders_to(keeper.node):
            continue
        left = max(0.0, deadline - time.monotonic())

        def stop(link: Link = link) -> str | None:
            return str(link.error) if link.error is not None else "abandoned" if abandoned() else None

        if rt.await_keys(keeper.store, [key], left, stop):
            continue
        value = keeper.store.get(key)
        try:
            want = SentCounts.from_json(value, key).messages
        except BadValue as e:  # report what arrived: the recovery checks versions and checksums
            _refused.refuse(e, value)
            want = {}
        while (
            not all(link.received[k] >= v for k, v in want.items())
            and link.error is None
            and time.monotonic() < deadline
            and not abandoned()
        ):
            time.sleep(1e-3)  # what the receiver thread has not folded yet: local, no store
    keeper.region.header[H_STATE] = STATE_DRAINED
    with keeper.lock:
        keeper.freeze()
        return report(keeper)


def superseded(request: Drain, job: rt.Job) -> Callable[[], bool]:
    """Whether the drain `request` became moot: the job shuts down or a later drain was announced."""
    later = keys.drain(request.next_generation)
    return lambda: job.shutdown_requested() or job.store.check([later])


def report_for(committed: Keeper | None, request: Drain, job: rt.Job) -> KeeperReport:
    """Drain and describe the last committed generation for the drain `request`; a keeper with none
    says so."""
    if committed is None:
        return KeeperReport(job.node, empty=True)
    drained = drain(committed, set(request.live_nodes), job.timeout_s, superseded(request, job))
    return replace(drained, generation_used=committed.gen)


def read_drain(job: rt.Job, gen: int) -> Drain:
    """The drain this keeper saw a moment ago (`drain_of`): malformed since, it ends the keeper
    with one line (the coordinator replaces it like any failed keeper)."""
    key = keys.drain(gen)
    try:
        return Drain.from_json(job.store.get(key), key)
    except BadValue as e:
        raise SystemExit(f"leto: keeper of node {job.node}: cannot go on: malformed value of {e}") from None


def drain_of(job: rt.Job, gen: int) -> Drain | None:
    """Generation `gen`'s drain once written; a malformed one is ignored (said once) as if none
    were written yet: the coordinator's own drain replaces it."""
    return message(job, Drain.from_json, keys.drain(gen))


def message(job: rt.Job, parse: Callable[[bytes, str], T], key: str) -> T | None:
    """The message at `key` if it is there and well-formed (a malformed one is said once)."""
    if not job.store.check([key]):
        return None
    value = job.store.get(key)
    try:
        return parse(value, key)
    except BadValue as e:
        _refused.refuse(e, value)
        return None
