"""Threads for work too long for the event loop (a large body's parse and plan, a long count),
shared between tenants so that none queues work ahead of another's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from proxy.errors import Busy
from proxy.logs import Throttle

log = logging.getLogger("proxy.thread_pools")

T = TypeVar("T")


@dataclass(slots=True)
class _Turns:
    semaphore: asyncio.Semaphore
    held: int = 0  # its tenant's jobs waiting or running


class TenantPool:
    """Threads of their own for one kind of work. At most ``per_tenant`` of a tenant's jobs are
    in the threads' queue at once: its others wait their turn apart, so one tenant's many long
    jobs hold another's behind one of theirs at most, not behind all of them (asyncio's default
    executor is one queue for everything). Bounded, a job is refused (``Busy``) past
    ``a_tenant_holds_most`` of its tenant's waiting or running, and a tenant's first past
    ``tenants_most`` tenants holding jobs: what one tenant holds never refuses another's first,
    and every new key a tenant of its own (pass-through) holds a tenant's place. Used from the
    event loop only."""

    def __init__(
        self,
        name: str,
        *,
        threads: int,
        per_tenant: int,
        tenants_most: int | None = None,
        a_tenant_holds_most: int | None = None,
    ) -> None:
        self._name = name
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._per_tenant = per_tenant
        self._tenants_most = tenants_most
        self._a_tenant_holds_most = a_tenant_holds_most
        self._turns: dict[str, _Turns] = {}
        # Refusals told at once, then every few seconds: a flood's one per job would flood the log.
        self._refusals = Throttle()

    @property
    def held(self) -> int:
        """Jobs waiting or running."""
        return sum(turns.held for turns in self._turns.values())

    @property
    def tenants(self) -> int:
        """Tenants holding jobs (waiting or running)."""
        return len(self._turns)

    async def run(self, tenant: str, job: Callable[[], T]) -> T:
        turns = self._turns.get(tenant)
        if turns is None:
            if self._tenants_most is not None and len(self._turns) >= self._tenants_most:
                raise self._refused(tenant, "tenants_most")
            turns = self._turns[tenant] = _Turns(asyncio.Semaphore(self._per_tenant))
        elif self._a_tenant_holds_most is not None and turns.held >= self._a_tenant_holds_most:
            raise self._refused(tenant, "a_tenant_holds_most")
        turns.held += 1
        try:
            await turns.semaphore.acquire()
        except BaseException:
            self._left(tenant, turns)
            raise
        future = self._executor.submit(job)
        try:
            done = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel():
                # Running, it goes on to its end on its thread (a call's count cancelled by its
                # settle, whose figures came first): its tenant's turn is held until then, or the
                # tenant's next job would run beside it, ahead of another tenant's.
                loop = asyncio.get_running_loop()
                future.add_done_callback(lambda _: self._ended_from_thread(loop, tenant, turns))
                raise
            self._ended(tenant, turns)
            raise
        except BaseException:
            self._ended(tenant, turns)
            raise
        self._ended(tenant, turns)
        return done

    def _ended_from_thread(self, loop: asyncio.AbstractEventLoop, tenant: str, turns: _Turns) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown): nobody waits
            loop.call_soon_threadsafe(self._ended, tenant, turns)

    def _ended(self, tenant: str, turns: _Turns) -> None:
        turns.semaphore.release()
        self._left(tenant, turns)

    def _left(self, tenant: str, turns: _Turns) -> None:
        turns.held -= 1
        if not turns.held:
            del self._turns[tenant]

    def _refused(self, tenant: str, bound: str) -> Busy:
        refused = self._refusals.tell()
        if refused:
            log.warning(
                "too much long work waiting for its threads: calls answered 503 proxy_busy",
                extra={"pool": self._name, "bound": bound, "tenant": tenant, "refused": refused},
            )
        return Busy()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
