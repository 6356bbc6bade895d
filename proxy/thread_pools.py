"""Threads for work too long for the event loop (a large body's parse and plan, a long count),
shared between tenants so that none queues work ahead of another's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from proxy.errors import Busy

T = TypeVar("T")


@dataclass(slots=True)
class _Turns:
    semaphore: asyncio.Semaphore
    held: int = 0  # its tenant's jobs waiting or running


class TenantPool:
    """Threads of their own for one kind of work. At most ``per_tenant`` of a tenant's jobs are
    in the threads' queue at once: its others wait their turn apart, so one tenant's many long
    jobs hold another's behind one of theirs at most, not behind all of them (asyncio's default
    executor is one queue for everything). With ``most``, a job past that many waiting or running
    in all is refused (``Busy``): every new key a tenant of its own, in pass-through. Used from
    the event loop only."""

    def __init__(self, name: str, *, threads: int, per_tenant: int, most: int | None = None) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._per_tenant = per_tenant
        self._most = most
        self._turns: dict[str, _Turns] = {}
        self.held = 0  # jobs waiting or running

    async def run(self, tenant: str, job: Callable[[], T]) -> T:
        if self._most is not None and self.held >= self._most:
            raise Busy()
        turns = self._turns.get(tenant)
        if turns is None:
            turns = self._turns[tenant] = _Turns(asyncio.Semaphore(self._per_tenant))
        turns.held += 1
        self.held += 1
        try:
            async with turns.semaphore:
                # A cancel (shutdown) drops a job not started; one running ends on its own.
                return await asyncio.wrap_future(self._executor.submit(job))
        finally:
            self.held -= 1
            turns.held -= 1
            if not turns.held:
                del self._turns[tenant]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
