"""The Prometheus exposition, built on a thread of its own and shared by the scrapes that come
while it is built."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, generate_latest


class Expositions:
    """Builds ``registry``'s exposition for every scrape, one build at a time. A build costs the
    series' (a second of CPU at 140,000 of them): scrapes that come while one is under way (an HA
    pair of Prometheus, a dashboard, a curl loop; the main port's and ``metrics.listen``'s alike)
    are answered its body rather than each building their own side by side. Its one thread is its
    own, not asyncio's default executor, which aiohttp's DNS lookups and redis-py's reconnects
    wait on. Used from the event loop only."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-exposition")
        self._building: asyncio.Future[bytes] | None = None
        self.waiting = 0  # scrapes awaiting the build under way

    async def latest(self) -> bytes:
        building = self._building
        if building is None or building.done():
            # Never a finished build's body: a scrape that comes after it ended reads the counters
            # as they are now.
            loop = asyncio.get_running_loop()
            building = self._building = loop.run_in_executor(self._executor, generate_latest, self._registry)
            building.add_done_callback(self._built)
        self.waiting += 1
        try:
            # Shielded: one scrape's client gone (its handler cancelled) leaves the build to the others.
            return await asyncio.shield(building)
        finally:
            self.waiting -= 1

    def _built(self, building: asyncio.Future[bytes]) -> None:
        if self._building is building:
            self._building = None
        if not building.cancelled():
            building.exception()  # retrieved: every scrape that waited on a failed one may be gone

    def shutdown(self) -> None:
        # Not waited for: a build under way ends on its own, its scrapes already cut.
        self._executor.shutdown(wait=False, cancel_futures=True)
