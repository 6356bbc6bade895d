"""Quick estimates after their reserve: count the input exactly, lower the reserve to it.

A quick estimate reserves much new prompt text at its UTF-8 bytes (``proxy.tokenizer``), so the
call need not wait for tiktoken. The count follows on the estimate thread while the call runs
and ``shrink.lua`` lowers the reserve to it; where the reserve must wait (the bound did not fit,
or quick estimates are off), the count comes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from proxy.call import Call
from proxy.errors import Busy, StoreError
from proxy.estimate import Estimate
from proxy.metrics import Metrics
from proxy.pricing import reserve_amounts
from proxy.store import Store

log = logging.getLogger("proxy.refine")

# Counts a quick estimate's input exactly (tiktoken, off the event loop).
Counter = Callable[[Call], Awaitable[Estimate]]
# Tries of a shrink whose reply is lost (each bounded by the store's socket timeout).
SHRINK_TRIES = 5


def take_count(call: Call, exact: Estimate) -> None:
    """The exact count of a quick estimate's input in place of its bound, and the prices the call
    is reserved at chosen again by it: a bound past the long-context threshold chose those
    prices (``plan``), and an exact count within it is reserved, and billed at its reserve, at
    the model's own, as the same request is whose count was remembered. A count is never above
    its bound: it never passes a threshold the bound did not."""
    call.estimate = exact
    above = call.long_context_above
    if call.reserve_rates_short is not None and above is not None and exact.input_tokens <= above:
        call.reserve_rates = call.reserve_rates_short
        call.reserve_rates_short = None


async def count_first(call: Call, count: Counter) -> bool:
    """Count a quick estimate before its reserve; should that fail (False), the bound (still an
    upper bound) is reserved as final."""
    try:
        take_count(call, await count(call))
    except Busy:
        raise  # refused, not judged on its bound: the count may well fit
    except Exception as err:
        log.warning("could not count a reserve", extra={"request_id": call.request_id, "error": repr(err)})
        call.estimate = replace(call.estimate, uncounted=())
        return False
    return True


async def refine(store: Store, call: Call, count: Counter, metrics: Metrics) -> None:
    """Count a quick reserve's input exactly while the call runs, and lower the reserve to it.
    Best effort: should either step fail, the byte-length reserve stands until the settle
    replaces it."""
    reservation = call.reservation
    assert reservation is not None
    try:
        exact = await count(call)
    except Exception as err:  # a refinement never fails the call
        metrics.quick_estimates.labels("failed").inc()
        log.warning(
            "could not count a quick reserve", extra={"request_id": call.request_id, "error": repr(err)}
        )
        return
    # What Redis holds, not the estimate: a settle billing at the reserve, or a stream keeping
    # its context, may have counted the estimate meanwhile.
    before = dict(reservation.amounts)
    # Billed at its reserve (no usage came back), the call is billed at the exact count, at the
    # prices it chooses; a reaper bills the reserve as lowered to them.
    take_count(call, exact)
    after = reserve_amounts(exact, call.rates_reserved, images=call.asks_images)
    if after == before:
        return
    for tries in range(1, SHRINK_TRIES + 1):
        shrinking = asyncio.ensure_future(
            store.shrink(
                tenant=reservation.tenant,
                reservation_id=reservation.id,
                scope_keys=[s.key for s in reservation.scopes],
                amounts=after,
            )
        )
        try:
            if not await _landed(shrinking):
                return  # settled already
        except StoreError as err:
            # Its reply lost (Redis busy past the socket timeout), the shrink may have landed all
            # the same: sent again, it lowers the reserve to the same amounts, or finds it there,
            # and says so. Not known, the settle's ledger entry would name the bound as the
            # reserve and a call a reaper billed would be told the bound's figures, where Redis
            # held the count. Not while the settle waits for this (it cancelled it).
            task = asyncio.current_task()
            if err.maybe_applied and tries < SHRINK_TRIES and not (task and task.cancelling()):
                continue
            metrics.quick_estimates.labels("failed").inc()
            log.warning(
                "could not lower a quick reserve", extra={"request_id": call.request_id, "error": str(err)}
            )
            return
        break
    metrics.quick_estimates.labels("lowered").inc()
    call.reservation = replace(reservation, amounts=after)


async def _landed(shrinking: asyncio.Future[bool]) -> bool:
    """The shrink's answer, even when the settle cancels the refinement while it is on its way:
    sent, it may land all the same, and the settle (which waits for this) must know the reserve
    Redis then holds, not the bound (its ledger entry's figure, what a reaper billed)."""
    try:
        return await asyncio.shield(shrinking)
    except asyncio.CancelledError:
        return await shrinking
