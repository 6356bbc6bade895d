"""Keep a live call's reservation leased: renew it every third of its lease while it streams.

A reservation whose lease runs out belongs to the reapers, which bill it at its reserve; a long
stream renews its lease (and its scope keys' lives) on a timer, because reads may be far apart.
"""

from __future__ import annotations

import asyncio
import logging
import time

from proxy.call import Call
from proxy.errors import StoreError
from proxy.metrics import Metrics
from proxy.store import Store

log = logging.getLogger("proxy.lease")


class LeaseRenewal:
    """Renews ``call``'s lease every third of it, counted from the reserve, until ``stop``."""

    def __init__(self, call: Call, store: Store, metrics: Metrics) -> None:
        self._call = call
        self._store = store
        self._metrics = metrics
        self._timer: asyncio.TimerHandle | None = None
        self._renewing: set[asyncio.Future[None]] = set()
        self._arm(None)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, since: float | None) -> None:
        reservation = self._call.reservation
        if reservation is not None:
            due = (self._call.started_at if since is None else since) + reservation.lease_ms / 3000
            # A delay, not call_at(due): the loop's clock need not be time.monotonic's (uvloop's
            # is libuv's); a renewal late by a clock's difference could let the lease run out.
            self._timer = asyncio.get_running_loop().call_later(due - time.monotonic(), self._due)

    def _due(self) -> None:
        task = asyncio.ensure_future(self._renew())
        self._renewing.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._renewing.discard)
        self._arm(time.monotonic())

    async def _renew(self) -> None:
        reservation = self._call.reservation
        assert reservation is not None
        asked = time.monotonic()
        try:
            if await self._store.renew(
                tenant=reservation.tenant,
                reservation_id=reservation.id,
                lease_ms=reservation.lease_ms,
                scopes=reservation.scopes,  # a stream may outlive its run key's TTL
            ):
                self._call.lease_confirmed_at = asked
        except StoreError as err:
            # Not fatal: the stream goes on; the settle (or the journal) still follows.
            self._metrics.store_errors.labels("renew").inc()
            log.warning(
                "lease renewal failed", extra={"request_id": self._call.request_id, "error": str(err)}
            )
