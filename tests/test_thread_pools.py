"""TenantPool: one job of a tenant's at a time on the threads, and its bounds, a tenant's own and
the tenants', so that what one tenant holds never refuses another tenant's first job."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from proxy.errors import Busy
from proxy.thread_pools import TenantPool


async def until_held(pool: TenantPool | None, held: int) -> None:
    """Until ``pool`` (an app's, which may not be made: None) holds ``held`` jobs."""
    assert pool is not None
    for _ in range(500):
        if pool.held == held:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{pool.held} jobs held, not {held}")


async def until_started(started: threading.Event) -> None:
    """Until a job on a thread has set ``started``."""
    for _ in range(1000):
        if started.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the job never started")


async def test_a_tenants_jobs_past_its_own_bound_are_refused_never_another_tenants_first() -> None:
    """Tenant a at its bound (one job running, the others waiting a's turn): a's next is refused,
    b's first is taken and runs before a's waiting ones; a third tenant's first is refused only
    because two tenants hold jobs, and taken once one of them holds none."""
    pool = TenantPool("test", threads=1, per_tenant=1, tenants_most=2, a_tenant_holds_most=3)
    gate = threading.Event()
    ran: list[str] = []

    def job(name: str) -> str:
        if not ran:
            assert gate.wait(10), "the first job was never let go"
        ran.append(name)
        return name

    try:
        a_jobs = [asyncio.ensure_future(pool.run("a", lambda i=i: job(f"a{i}"))) for i in range(3)]
        await until_held(pool, 3)
        with pytest.raises(Busy):
            await pool.run("a", lambda: job("a3"))
        b_job = asyncio.ensure_future(pool.run("b", lambda: job("b0")))
        await until_held(pool, 4)
        assert pool.tenants == 2
        with pytest.raises(Busy):
            await pool.run("c", lambda: job("c0"))
    finally:
        gate.set()
    assert await asyncio.gather(*a_jobs, b_job) == ["a0", "a1", "a2", "b0"]
    assert ran == ["a0", "b0", "a1", "a2"]  # b behind a's job under way, not behind a's others
    assert (pool.held, pool.tenants) == (0, 0)
    assert await pool.run("c", lambda: job("c0")) == "c0"
    pool.shutdown()


async def test_an_unbounded_pool_refuses_nothing() -> None:
    """The settle counts' pool: a settle is never refused."""
    pool = TenantPool("test", threads=1, per_tenant=1)
    assert await asyncio.gather(*(pool.run(str(i % 3), lambda i=i: i) for i in range(50))) == list(range(50))
    assert (pool.held, pool.tenants) == (0, 0)
    pool.shutdown()


async def test_a_refusal_is_logged_at_once_then_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    """Each refusal its own line, a flood of them (a tenant's thousands of large bodies) would
    flood the log: the first is told at once, with the bound it met, the others with the next."""
    pool = TenantPool("test", threads=1, per_tenant=1, tenants_most=0)
    with caplog.at_level(logging.WARNING, logger="proxy.thread_pools"):
        for _ in range(3):
            with pytest.raises(Busy):
                await pool.run("a", lambda: None)
    [record] = caplog.records
    assert "503 proxy_busy" in record.getMessage()
    assert (record.pool, record.bound, record.tenant, record.refused) == ("test", "tenants_most", "a", 1)
    pool.shutdown()


async def test_a_cancelled_running_job_keeps_its_tenants_turn_until_it_ends() -> None:
    """A settle cancels its call's count while it runs (a fast upstream's figures came first):
    the count goes on in the thread. Its tenant's turn was given back at once, so the tenant's
    next count ran beside it, ahead of another tenant's that came first: b waited behind two of
    a's, not one (the fourth review of the day). The turn is held until the job ends."""
    pool = TenantPool("estimate", threads=1, per_tenant=1)
    gate = threading.Event()
    started = threading.Event()
    ran: list[str] = []

    def first() -> str:
        started.set()
        assert gate.wait(10)
        ran.append("a1")
        return "a1"

    def job(name: str) -> str:
        ran.append(name)
        return name

    try:
        a1 = asyncio.ensure_future(pool.run("a", first))
        await until_started(started)
        a1.cancel()  # the settle drops the count: it runs on all the same
        await asyncio.wait((a1,))
        assert (pool.held, pool.tenants) == (1, 1)  # still a's, on its thread
        a2 = asyncio.ensure_future(pool.run("a", lambda: job("a2")))
        await asyncio.sleep(0.05)
        b1 = asyncio.ensure_future(pool.run("b", lambda: job("b1")))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.gather(a2, b1), 10)
        assert ran == ["a1", "b1", "a2"], ran
        await until_held(pool, 0)
        assert pool.tenants == 0
    finally:
        gate.set()
        pool.shutdown()


async def test_a_failed_job_gives_its_tenants_turn_and_place_back() -> None:
    """A job that raises (a count's error) ends its tenant's turn: else the tenant held a place
    for good, its next job waiting forever on the turn, and tenants_most refused every other."""
    pool = TenantPool("test", threads=1, per_tenant=1, tenants_most=1)

    def fails() -> None:
        raise ValueError("boom")

    try:
        with pytest.raises(ValueError):
            await pool.run("a", fails)
        assert (pool.held, pool.tenants) == (0, 0)
        assert await asyncio.wait_for(pool.run("b", lambda: "b"), 10) == "b"
        assert await asyncio.wait_for(pool.run("a", lambda: "a"), 10) == "a"
    finally:
        pool.shutdown()


async def test_a_job_cancelled_while_waiting_its_tenants_turn_leaves_nothing_held() -> None:
    """A call gone (client disconnect) while its job waits behind its tenant's running one: the
    job is no longer counted, and the tenant's place goes once its running job ends."""
    pool = TenantPool("test", threads=1, per_tenant=1, a_tenant_holds_most=2)
    gate, started = threading.Event(), threading.Event()

    def first() -> str:
        started.set()
        assert gate.wait(10)
        return "a1"

    try:
        a1 = asyncio.ensure_future(pool.run("a", first))
        await until_started(started)
        a2 = asyncio.ensure_future(pool.run("a", lambda: "a2"))
        await until_held(pool, 2)
        a2.cancel()
        await asyncio.wait((a2,))
        assert pool.held == 1
        gate.set()
        assert await asyncio.wait_for(a1, 10) == "a1"
        assert (pool.held, pool.tenants) == (0, 0)
    finally:
        gate.set()
        pool.shutdown()


async def test_a_job_cancelled_while_queued_for_a_thread_never_runs_and_holds_nothing() -> None:
    """b's job queued behind a's on the one thread, cancelled: it is taken off the queue (it
    never runs) and b holds nothing at once, its turn given back."""
    pool = TenantPool("test", threads=1, per_tenant=1)
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def first() -> str:
        started.set()
        assert gate.wait(10)
        return "a1"

    try:
        a1 = asyncio.ensure_future(pool.run("a", first))
        await until_started(started)
        b1 = asyncio.ensure_future(pool.run("b", lambda: ran.append("b1")))
        await until_held(pool, 2)
        b1.cancel()
        await asyncio.wait((b1,))
        assert (pool.held, pool.tenants) == (1, 1)  # a's alone
        gate.set()
        await asyncio.wait_for(a1, 10)
        assert await asyncio.wait_for(pool.run("b", lambda: "b2"), 10) == "b2"
        assert ran == []
        assert (pool.held, pool.tenants) == (0, 0)
    finally:
        gate.set()
        pool.shutdown()


async def test_shutdown_drops_the_jobs_still_queued_for_a_thread() -> None:
    """At shutdown a job queued for the threads (a count behind another tenant's) is dropped,
    not run after the loop has gone (the process's exit would wait for it)."""
    pool = TenantPool("test", threads=1, per_tenant=1)
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def first() -> None:
        started.set()
        assert gate.wait(10)

    a1 = asyncio.ensure_future(pool.run("a", first))
    await until_started(started)
    b1 = asyncio.ensure_future(pool.run("b", lambda: ran.append("b1")))
    await until_held(pool, 2)
    pool.shutdown()
    gate.set()
    await asyncio.wait_for(a1, 10)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(b1, 10)
    assert ran == []
