"""The reaper of every instance: expired leases settled at their reserve, whatever a tenant's
registration went through."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

import proxy.app as app_module
from proxy.errors import StoreError, StoreRejected
from proxy.journal import Journal
from proxy.reaper import BATCH, Unsure, reap_tenant, run_reaper
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.state import STATE
from proxy.store import OLD_TENANTS_KEY, TENANTS_KEY, Reservation, Scope
from tests.conftest import (
    KEY_A,
    Proxy,
    ProxyFactory,
    busy_script,
    until_monotonic,
    until_redis_busy,
    until_upstream_received,
    upstream_timing_out,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MODEL, MSGS, run_headers


async def reaped_orphan(proxy: Proxy, redis_client: aioredis.Redis, tenant: str, run: str) -> int:
    """Drop the tenant registry, leave a dead instance's expired lease of ``tenant`` and wait
    up to 5 s for a reaper round: the leases of ``tenant`` left."""
    store = proxy.app[STATE].store
    assert store is not None
    await redis_client.delete(TENANTS_KEY)  # first: a lease made while registered could be reaped
    orphan = await run_lease(store, tenant, "dead-instance", run)
    assert isinstance(orphan, Reservation)
    leases = f"lbp:{{{tenant}}}:leases"
    for _ in range(100):
        if await redis_client.zcard(leases) == 0:
            break
        await asyncio.sleep(0.05)
    return int(await redis_client.zcard(leases))


async def test_a_tenant_lost_from_the_registry_is_registered_again_and_reaped(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """This process registered team-a once (its first call). Should the store's set of tenants
    lose it (evicted, deleted), a lease of team-a left by a dead instance is still reaped."""
    proxy = await make_proxy(limits={"reaper_interval_s": 0.1})
    async with proxy.client() as client:
        await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers=run_headers("r1"))
    assert await reaped_orphan(proxy, redis_client, "team-a", "r2") == 0
    assert await redis_client.zscore(TENANTS_KEY, "team-a") is not None
    outcomes = [entry["outcome"] for _, entry in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert outcomes == ["ok", "lease_expired"]


async def test_a_tenant_of_the_config_lost_from_the_registry_is_reaped(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """team-b's only instance died with a lease out, and the registry lost team-b: this process
    never served team-b, but its config names it."""
    proxy = await make_proxy(limits={"reaper_interval_s": 0.1})
    assert await reaped_orphan(proxy, redis_client, "team-b", "r1") == 0
    outcomes = [entry["outcome"] for _, entry in await redis_client.xrange("lbp:{team-b}:ledger")]
    assert outcomes == ["lease_expired"]


async def post_and_expire_its_lease(
    proxy: Proxy,
    redis_client: aioredis.Redis,
    body: dict[str, Any],
    run: str,
    held: FakeUpstream | None = None,
    before_release: Callable[[float], Awaitable[None]] | None = None,
) -> aiohttp.ClientResponse:
    """Post ``body`` and, once it holds its lease, make that lease run out (as a store outage
    during its renewals would): the reaper bills it while it is still in flight. ``held``: the
    upstream holds the answer (``"hold": true``) and is released once the reaper's entry is in,
    and ``before_release`` (handed the ``time.monotonic()`` the lease was seen at, after its
    reserve was asked) has returned."""
    leases = "lbp:{team-a}:leases"
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
    async with aiohttp.ClientSession() as session:
        answer = asyncio.ensure_future(
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        )
        while not await redis_client.zcard(leases):
            await asyncio.sleep(0.01)
        leased_at = time.monotonic()
        (reservation,) = await redis_client.zrange(leases, 0, -1)
        await redis_client.zadd(leases, {reservation: 0})  # its lease ran out
        if held is not None:
            for _ in range(500):
                if await redis_client.xlen("lbp:{team-a}:ledger"):
                    break
                await asyncio.sleep(0.01)
            if before_release is not None:
                await before_release(leased_at)
            held.release()
        resp = await answer
        assert resp.status == 200
        await resp.read()
    return resp


async def test_a_live_call_a_reaper_billed_first_is_told_what_the_ledger_holds(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
) -> None:
    """Its lease ran out under it (a store outage during renewals, say): the reaper's entry
    stands, and the client was told the figures of a settle that wrote nothing. A whole answer
    waits for its settle's reply once half its lease is gone; before that it goes out with the
    settle on its way (``test_relay``)."""
    ceiling = 100_000
    timeout_s, margin_s = 4, 0.1
    proxy = await make_proxy(
        redis={"socket_timeout_s": 2},  # below two thirds of the lease
        upstreams=upstream_timing_out(fake.base_url, timeout_s),
        limits={"reaper_interval_s": 0.05, "reap_grace_s": 0, "lease_margin_s": margin_s},
        tiers={"standard": {"run": {"total_tokens": ceiling}}},
    )
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "fake": {"hold": True}}
    blocker = aioredis.Redis.from_url(redis_server.url)
    busy: list[asyncio.Future[Any]] = []

    async def past_half_its_lease_with_the_store_slow(leased_at: float) -> None:
        # Answered past half the lease (2.05 s) and well within the upstream's timeout (a fixed
        # delay raced both on a loaded machine), while Redis holds the settle's reply: an answer
        # that went out with its settle on its way would say "ok" every time, not only when it
        # outran a quick reply.
        half_lease_s = (timeout_s + margin_s) / 2
        await until_monotonic(leased_at + half_lease_s - 0.6)
        busy.append(asyncio.ensure_future(blocker.eval(busy_script(2), 0)))
        assert redis_server.port is not None
        await until_redis_busy(redis_server.port)
        await until_monotonic(leased_at + half_lease_s + 0.2)

    try:
        resp = await post_and_expire_its_lease(
            proxy, redis_client, body, "overtaken", fake, past_half_its_lease_with_the_store_slow
        )
    finally:
        await asyncio.gather(*busy)
        await blocker.aclose()
    entries = [fields for _, fields in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert [e["outcome"] for e in entries] == ["lease_expired"]
    assert resp.headers["x-billing-outcome"] == "lease_expired"
    assert resp.headers["x-billing-usage-source"] == "reserve"
    assert resp.headers["x-billing-input-tokens"] == entries[0]["input_tokens"]
    assert resp.headers["x-billing-output-tokens"] == entries[0]["output_tokens"]
    assert resp.headers["x-billing-cost-micros"] == entries[0]["cost_micros"]
    assert resp.headers["x-budget-remaining-total-tokens"] == str(ceiling - int(entries[0]["total_tokens"]))


CLAMP = {"standard": {"run": {"output_tokens": 6}, "on_budget_short": "clamp", "min_output_tokens": 2}}


async def test_a_clamped_call_a_reaper_bills_is_clamped_in_the_ledger(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The reaper's entry of a clamped call (its lease ran out: a store outage during renewals,
    a dead instance) said clamped 0, though it billed the lowered reserve: the ledger and the
    clamped counter, which counts ledger entries, missed it."""
    proxy = await make_proxy(limits={"reaper_interval_s": 0.05, "reap_grace_s": 0}, tiers=CLAMP)
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        # Answered once reaped: after a fixed delay the settle may come first on a loaded machine.
        "fake": {"hold": True},
    }
    await post_and_expire_its_lease(proxy, redis_client, body, "reaped-clamp", held=fake)
    assert fake.received[-1].body["max_tokens"] == 6  # clamped
    (entry,) = [fields for _, fields in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert entry["outcome"] == "lease_expired"
    assert entry["reserved_output_tokens"] == "6"
    assert entry["clamped"] == "1", entry


async def test_leases_a_round_settled_before_a_store_error_are_counted(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A round settles the first expired lease, then the store fails on the second (a failover,
    a timeout): the first is in the ledger, and was never handed to ``on_settled`` (the spend
    counters), as the round's entries went with the error; the next rounds do not find it."""
    admin = RedisStore.from_url(redis_server.url)
    await admin.load_scripts()
    for run in ("r1", "r2"):
        reserved = await run_lease(admin, "team-a", f"lease-{run}", run)
        assert isinstance(reserved, Reservation)
        await asyncio.sleep(0.01)  # lease-r1 runs out first: the round reaps it first
    await admin.close()
    # A user that may not touch r2's meters yet: its settle fails with NOPERM, a store error
    # that passes (the round stops there, to be tried again).
    keys = ["~lbp:tenants*", "~lbp:{team-a}:leases", "~lbp:{team-a}:resv:*", "~lbp:{team-a}:ledger"]
    keys += ["~lbp:{team-a}:runlog:*", "~lbp:{team-a}:run:r1"]
    await redis_client.execute_command("ACL", "SETUSER", "reaper7", "on", ">pw", "+@all", *keys)
    store = RedisStore.from_url(redis_server.url.replace("redis://", "redis://reaper7:pw@"))
    await store.load_scripts()
    counted: list[str] = []

    def count(entry: Mapping[str, str]) -> None:
        counted.append(entry["reservation_id"])

    task = asyncio.create_task(run_reaper(store, 0.05, count, known=lambda: ["team-a"]))
    try:
        for _ in range(100):
            if counted:
                break
            await asyncio.sleep(0.05)
        assert await redis_client.xlen("lbp:{team-a}:ledger") == 1  # lease-r1 billed
        assert counted == ["lease-r1"]  # before: [], billed and never counted
        await redis_client.execute_command("ACL", "SETUSER", "reaper7", "allkeys")
        for _ in range(100):
            if len(counted) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()
        await redis_client.execute_command("ACL", "DELUSER", "reaper7")
    ledger = [e["reservation_id"] for _, e in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert ledger == counted == ["lease-r1", "lease-r2"]


class ScriptsInFlight(RedisStore):
    """The real store, noting the most scripts of each name it was running at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.running: dict[str, int] = {}
        self.most: dict[str, int] = {}

    async def _script(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.running[name] = self.running.get(name, 0) + 1
        self.most[name] = max(self.most.get(name, 0), self.running[name])
        try:
            return await super()._script(name, *args, **kwargs)
        finally:
            self.running[name] -= 1


async def run_lease(store: RedisStore, tenant: str, rid: str, run: str, lease_ms: int = 1) -> Reservation:
    """A call of ``tenant``'s run ``run`` reserved (12 tokens) under a lease of ``lease_ms``."""
    reserved = await store.reserve(
        tenant=tenant,
        reservation_id=rid,
        run_id=run,
        scopes=[Scope(name="run", key=f"lbp:{{{tenant}}}:run:{run}")],
        amounts={"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
        lease_ms=lease_ms,
        record=f'{{"run_id": "{run}"}}',
    )
    assert isinstance(reserved, Reservation)
    return reserved


async def expired_reservations(
    store: RedisStore, redis_client: aioredis.Redis, scope: Scope, ids: list[str]
) -> None:
    """Reserve ``ids`` in turn on ``scope`` (12 tokens each, a 1 ms lease: each runs out after
    the one before) and wait until every lease ran out by the store's clock."""
    for rid in ids:
        held = await store.reserve(
            tenant="team-a",
            reservation_id=rid,
            run_id=scope.key.rpartition(":")[2],
            scopes=[scope],
            amounts={"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
            lease_ms=1,
            record=f'{{"run_id": "{scope.key.rpartition(":")[2]}"}}',
        )
        assert isinstance(held, Reservation)
    # By the store's own clock, which the reaper's script reads (this process's measure of it
    # may be a few milliseconds ahead under load).
    while len(await store.expired_leases(tenant="team-a", limit=len(ids))) < len(ids):
        await asyncio.sleep(0.01)


async def test_a_round_reads_and_settles_a_batch_of_leases_together(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A dead instance's leases held their budgets' room until reaped, and a round read each
    lease, then settled each, one round trip after another. A batch's reads go together, then
    its settles; each lease is billed once, at its reserve."""
    store = ScriptsInFlight.from_url(redis_server.url)
    await store.load_scripts()
    scope = Scope(name="run", key="lbp:{team-a}:run:dead", ttl_s=600)
    ids = [f"dead-{i}" for i in range(30)]
    try:
        await expired_reservations(store, redis_client, scope, ids)
        counted: list[str] = []
        reaped = await reap_tenant(
            store, "team-a", on_settled=lambda entry: counted.append(entry["reservation_id"])
        )
        assert sorted(e["reservation_id"] for e in reaped) == sorted(counted) == sorted(ids)
        assert store.most["lease"] > 1 and store.most["settle"] > 1  # one at a time: 1 and 1
        meter = (await store.meters(scope.key))["total_tokens"]
        assert (meter.used, meter.reserved) == (12 * len(ids), 0)
    finally:
        await store.close()


async def test_a_batch_of_damaged_leases_at_the_head_hides_none_after_them(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """Leases a round leaves in the index (a record it cannot read, a settle the store refuses
    for good) stay at its head, oldest first. A batch's worth of them there hid every lease that
    ran out after them, round after round: their reserves held their budgets' room for good.
    The next batch starts past them."""
    store = RedisStore.from_url(redis_server.url)
    await store.load_scripts()
    scope = Scope(name="run", key="lbp:{team-a}:run:behind", ttl_s=600)
    damaged = [f"damaged-{i:03d}" for i in range(BATCH)]
    try:
        await expired_reservations(store, redis_client, scope, [*damaged, "good"])
        for rid in damaged:
            await redis_client.hset(f"lbp:{{team-a}}:resv:{rid}", "amounts", "not numbers")
        for _ in range(2):  # round after round
            reaped = await reap_tenant(store, "team-a")
            assert [e["reservation_id"] for e in reaped] in (["good"], [])
        ledger = [e["reservation_id"] for _, e in await redis_client.xrange("lbp:{team-a}:ledger")]
        assert ledger == ["good"]  # billed once, at its reserve
        assert await redis_client.zcard("lbp:{team-a}:leases") == BATCH  # the damaged, for an operator
    finally:
        await store.close()


class BusyBeforeItsFirstSettle(RedisStore):
    """The real store, Redis made busy (a script on another connection) just as its first settle
    goes out: that settle runs once the script ends, after the client's timeout, and its reply
    is lost. What a slow node, a failover or a long script of another client does to a reply."""

    port = 0
    busy: asyncio.Future[Any] | None = None

    async def settle(self, **kwargs: Any) -> str | None:  # type: ignore[override]
        if self.busy is None:
            blocker = aioredis.Redis(port=self.port)
            self.busy = asyncio.ensure_future(blocker.eval(busy_script(1.5), 0))
            await until_redis_busy(self.port)
        return await super().settle(**kwargs)


async def test_a_lease_whose_reaped_settle_reply_was_lost_is_counted_once(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """The reaper's settle ran, its reply did not come (a timeout): the ledger has the
    ``lease_expired`` entry, and the lease left the index with it, so no later round found it:
    its tokens and cost never reached the spend counters. The call's own settle, in the same
    case, gets its entry when its journal sends it again (settle.lua's ``own``): the README's
    spend query (``increase(llm_proxy_cost_total)``) under-reported what the ledger charged."""
    assert redis_server.port is not None
    store = BusyBeforeItsFirstSettle.from_url(redis_server.url, socket_timeout_s=0.5)
    store.port = redis_server.port
    await store.load_scripts()
    reserved = await store.reserve(
        tenant="team-a",
        reservation_id="dead-instance",
        run_id="r-dead",
        scopes=[Scope(name="run", key="lbp:{team-a}:run:r-dead")],
        amounts={"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12, "concurrent": 1},
        lease_ms=1,
        record='{"run_id": "r-dead", "model": "gpt-4o-mini"}',
    )
    assert isinstance(reserved, Reservation)
    counted: list[Mapping[str, str]] = []
    reaper = asyncio.create_task(run_reaper(store, 0.05, counted.append, known=lambda: ["team-a"]))
    try:
        for _ in range(1000):  # until a later round, the store answering again, counts it
            if counted:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # a few more rounds: none counts it again
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await store.close()
    entries = [fields for _, fields in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert [e["outcome"] for e in entries] == ["lease_expired"]
    assert [e["reservation_id"] for e in counted] == ["dead-instance"]


def spend(proxy: Proxy) -> dict[str, float]:
    """What ``proxy``'s reaped and spend counters hold, over every label; tokens by type."""
    metrics = proxy.app[STATE].metrics
    out = {
        name: float(sum(value.value for _, value in getattr(metrics, name).items()))
        for name in ("leases_expired", "requests", "cost_micros")
    }
    for labels, value in metrics.tokens.items():
        kind = dict(zip(metrics.tokens.labelnames, labels, strict=True))["type"]
        out[kind] = out.get(kind, 0) + value.value
    return out


class LostThenDown:
    """A store's reaper tries (``reaper_try``): the first runs and its reply is lost, the next
    fail unsent while ``down`` (an outage); what each try sent is kept."""

    def __init__(self, settle: Callable[..., Awaitable[str | None]]) -> None:
        self.settle = settle
        self.tries: list[dict[str, Any]] = []
        self.down = True

    async def __call__(self, **how: Any) -> str | None:
        if not how.get("reaper_try"):
            return await self.settle(**how)
        self.tries.append(how)
        if len(self.tries) == 1:
            await self.settle(**how)  # it ran
            raise StoreError("settle: connection lost", maybe_applied=True)
        if self.down:
            raise StoreError("settle: connection refused")
        return await self.settle(**how)


async def losing_store(url: str, *, down: bool = True) -> tuple[RedisStore, LostThenDown]:
    """A store on ``url`` whose reaper tries go through ``LostThenDown`` (``down``: the tries
    after the first fail unsent)."""
    store = RedisStore.from_url(url)
    await store.load_scripts()
    lost = LostThenDown(store.settle)
    lost.down = down
    store.settle = lost  # type: ignore[method-assign]
    return store, lost


async def test_a_reapers_settle_whose_reply_was_lost_is_counted_after_its_instance_stopped(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper's settle ran, its reply was lost and the store stayed away until the instance
    stopped. The try was kept in memory alone (the lease has left the index with it: no other
    reaper, nor a restart, finds it), so the ``lease_expired`` entry the ledger holds was in no
    instance's metrics (the metrics hunt). It is journaled: the instance started next adopts
    the file, sends that try again and counts its entry, once."""
    first = await make_proxy(limits={"reaper_interval_s": 0.05, "journal_replay_s": 0.05})
    store = first.app[STATE].store
    assert store is not None
    lost = LostThenDown(store.settle)
    monkeypatch.setattr(store, "settle", lost)
    await run_lease(store, "team-a", "dead-instance", "r-dead")
    for _ in range(100):
        if len(lost.tries) >= 3:  # sent again by the journal's replay, the store still away
            break
        await asyncio.sleep(0.05)
    assert len(lost.tries) >= 3
    await first.runner.cleanup()  # stopped during the outage
    second = await make_proxy(limits={"journal_replay_s": 0.05})
    for _ in range(100):
        if spend(second)["leases_expired"]:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # a few more replays: none counts it again
    entries = [fields for _, fields in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert [e["outcome"] for e in entries] == ["lease_expired"]
    assert spend(first) == {"leases_expired": 0, "requests": 0, "cost_micros": 0}
    counted = spend(second)
    assert [counted.get(name) for name in ("leases_expired", "requests", "input", "output")] == [1, 1, 5, 7]
    # Every try was the reaper's first, as it sent it: the replay's got the entry that one wrote.
    assert all(how == lost.tries[0] for how in lost.tries)
    assert lost.tries[0]["marker_ttl_s"] == 0 and "bill_if_lost" not in lost.tries[0]
    assert await redis_client.hget("lbp:{team-a}:resv:dead-instance", "try") == lost.tries[0]["reaper_try"]


async def test_a_reaper_without_a_journal_sends_its_unsure_settles_once_more_as_it_stops(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A reaper given no journal (or whose disk refuses the line) keeps its settle whose reply
    was lost in memory: one more try as it stops, the store back by then, counts the entry."""
    store, lost = await losing_store(redis_server.url)
    counted: list[Mapping[str, str]] = []
    reaper = asyncio.create_task(run_reaper(store, 0.05, counted.append, known=lambda: ["team-a"]))
    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        for _ in range(100):
            if len(lost.tries) >= 2:
                break
            await asyncio.sleep(0.05)
        assert counted == []
        lost.down = False
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
    finally:
        reaper.cancel()
        await store.close()
    assert [e["reservation_id"] for e in counted] == ["dead-instance"]
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 1


@pytest.mark.parametrize("descriptor", ["spared", "none to spare"])
async def test_a_reapers_line_written_whose_sync_failed_is_counted_by_the_replay_alone(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    descriptor: str,
) -> None:
    """The reaper's settle ran and its reply was lost; the journal wrote its line and the sync
    failed (EIO; ENOSPC on a file system that allocates at sync), on the sync thread or, with no
    descriptor to spare, on the loop. The try was taken for not journaled and kept in memory
    too: the reaper's next round sent it again and counted the entry, then the replay, which
    reads the line in the file, sent it again and counted the same entry again. One
    ``lease_expired`` entry, two in the metrics (the review's
    test_a_reaper_line_whose_sync_failed_is_not_counted_twice)."""
    store, _ = await losing_store(redis_server.url, down=False)
    journal = Journal(tmp_path / "journal")
    counted: list[Mapping[str, str]] = []
    unsure: Unsure = {}

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    def no_descriptor(fd: int) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        await asyncio.sleep(0.01)
        monkeypatch.setattr(os, "fsync", failing_fsync)
        if descriptor == "none to spare":
            monkeypatch.setattr(os, "dup", no_descriptor)
        with pytest.raises(StoreError):
            await reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure, journal=journal)
        monkeypatch.undo()
        assert (journal.pending_lines, unsure) == (1, {})  # the journal's alone
        await reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure, journal=journal)
        await journal.replay(store, counted.append)
    finally:
        monkeypatch.undo()
        journal.close()
        await store.close()
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 1
    assert [e["reservation_id"] for e in counted] == ["dead-instance"]


async def test_a_reapers_try_from_memory_cut_during_its_lines_sync_is_counted_by_the_replay_alone(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A try whose reply was lost that the full disk kept from the journal stays in memory. Its
    next round fails unsent (the store away) and journals it, the disk back; the reaper is
    cancelled (a shutdown) while the line's sync runs. The line was in the file and the try
    left in memory all the same: sent once more as the reaper stopped, its entry counted, and
    counted again by the replay."""
    store, lost = await losing_store(redis_server.url)
    journal = Journal(tmp_path / "journal")
    counted: list[Mapping[str, str]] = []
    unsure: Unsure = {}
    started, go_on = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def disk_full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def held_fsync(fd: int) -> None:
        started.set()
        go_on.wait(5)
        real_fsync(fd)

    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        await asyncio.sleep(0.01)
        monkeypatch.setattr(os, "write", disk_full)
        with pytest.raises(StoreError):
            await reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure, journal=journal)
        monkeypatch.undo()
        assert (journal.pending_lines, list(unsure)) == (0, ["dead-instance"])
        monkeypatch.setattr(os, "fsync", held_fsync)
        round_ = asyncio.ensure_future(
            reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure, journal=journal)
        )
        assert await asyncio.to_thread(started.wait, 5)  # its line written, being synced
        round_.cancel()
        with pytest.raises(asyncio.CancelledError):
            await round_
        go_on.set()
        monkeypatch.undo()
        assert (journal.pending_lines, unsure) == (1, {})
        lost.down = False
        await reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure, journal=journal)
        await journal.replay(store, counted.append)
    finally:
        go_on.set()
        monkeypatch.undo()
        journal.close()
        await store.close()
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 1
    assert [e["reservation_id"] for e in counted] == ["dead-instance"]


async def test_an_unsure_reaper_settle_the_store_then_rejects_is_dropped(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A reaper's try kept in memory (reply lost, no journal), which the store rejects when sent
    again: logged and dropped, not sent again every round for good (its tenant never idle)."""
    store, _ = await losing_store(redis_server.url)
    unsure: Unsure = {}
    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        await asyncio.sleep(0.01)
        with pytest.raises(StoreError):
            await reap_tenant(store, "team-a", unsure=unsure)
        assert list(unsure) == ["dead-instance"]

        async def rejects(**how: Any) -> str | None:
            raise StoreRejected("settle: ERR damaged")

        store.settle = rejects  # type: ignore[method-assign]
        assert await reap_tenant(store, "team-a", unsure=unsure) == []
        assert unsure == {}
    finally:
        await store.close()


async def test_a_reaper_cancelled_mid_settle_keeps_its_try(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A reaper stopped while its settle is in flight (the settle may have run: the lease left
    the index with it) keeps the try, so that sending it again counts the entry it wrote."""
    store = RedisStore.from_url(redis_server.url)
    await store.load_scripts()
    real = store.settle
    sent = asyncio.Event()

    async def runs_then_hangs(**how: Any) -> str | None:
        await real(**how)
        sent.set()
        await asyncio.sleep(30)
        raise AssertionError("not cancelled")

    store.settle = runs_then_hangs  # type: ignore[method-assign]
    unsure: Unsure = {}
    counted: list[Mapping[str, str]] = []
    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        await asyncio.sleep(0.01)
        round_ = asyncio.ensure_future(reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure))
        await asyncio.wait_for(sent.wait(), 10)
        round_.cancel()
        with pytest.raises(asyncio.CancelledError):
            await round_
        assert list(unsure) == ["dead-instance"]
        store.settle = real  # type: ignore[method-assign]
        await reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure)
    finally:
        await store.close()
    assert [e["reservation_id"] for e in counted] == ["dead-instance"]
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 1


async def test_a_stopping_reaper_whose_store_is_still_away_stops_quietly(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """The reaper's last tries (no journal) fail, the store still away: logged, and the reaper
    stops as cancelled, not with the store's error."""
    store, lost = await losing_store(redis_server.url)
    reaper = asyncio.create_task(run_reaper(store, 0.05, lambda e: None, known=lambda: ["team-a"]))
    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        for _ in range(200):
            if len(lost.tries) >= 2:
                break
            await asyncio.sleep(0.02)
        reaper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reaper
    finally:
        reaper.cancel()
        await store.close()


async def test_a_reapers_try_journaled_is_not_kept_in_memory_too(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A reaper's settle whose reply was lost, journaled (its sync fine): the journal's alone.
    Kept in memory as well, the reaper's next round and the replay would each count its entry."""
    store, _ = await losing_store(redis_server.url, down=False)
    journal = Journal(tmp_path / "journal")
    counted: list[Mapping[str, str]] = []
    unsure: Unsure = {}
    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        await asyncio.sleep(0.01)
        with pytest.raises(StoreError):
            await reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure, journal=journal)
        assert (journal.pending_lines, unsure) == (1, {})
        await reap_tenant(store, "team-a", on_settled=counted.append, unsure=unsure, journal=journal)
        await journal.replay(store, counted.append)
    finally:
        journal.close()
        await store.close()
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 1
    assert [e["reservation_id"] for e in counted] == ["dead-instance"]


async def test_a_running_reapers_rounds_journal_their_lost_tries(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """``run_reaper``'s journal takes a round's try whose reply was lost while the reaper runs
    (a host crash before it stops loses nothing), not only the tries left when it stops."""
    store, lost = await losing_store(redis_server.url)
    journal = Journal(tmp_path / "journal")
    reaper = asyncio.create_task(
        run_reaper(store, 0.05, lambda e: None, known=lambda: ["team-a"], journal=journal)
    )
    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        for _ in range(200):
            if lost.tries:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # a few more rounds
        assert journal.pending_lines == 1
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        journal.close()
        await store.close()


async def test_a_stopping_reaper_journals_the_tries_its_disk_refused_before(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tries the journal's full disk kept in memory, the store still away as the reaper stops:
    its last tries fail and go to the journal (its disk back), not with the process."""
    store, lost = await losing_store(redis_server.url)
    journal = Journal(tmp_path / "journal")

    def disk_full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    reaper = asyncio.create_task(
        run_reaper(store, 0.05, lambda e: None, known=lambda: ["team-a"], journal=journal)
    )
    try:
        await run_lease(store, "team-a", "dead-instance", "r-dead")
        monkeypatch.setattr(os, "write", disk_full)
        for _ in range(200):
            if len(lost.tries) >= 3:
                break
            await asyncio.sleep(0.02)
        assert journal.pending_lines == 0
        monkeypatch.undo()
        reaper.cancel()  # no await between: no round runs with the disk back
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        assert journal.pending_lines == 1
    finally:
        monkeypatch.undo()
        reaper.cancel()
        journal.close()
        await store.close()


async def test_a_reapers_try_sent_again_gets_its_entry_and_no_other_settle_does(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    store = RedisStore.from_url(redis_server.url)
    await store.load_scripts()
    try:
        reserved = await run_lease(store, "team-a", "tried", "r")
        assert isinstance(reserved, Reservation)

        async def settle(**how: Any) -> str | None:
            return await store.settle(
                tenant="team-a",
                reservation_id="tried",
                run_id="r",
                scope_keys=["lbp:{team-a}:run:r"],
                actual={"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
                entry={"outcome": "lease_expired"},
                **how,
            )

        first = await settle(reaper_try="r0123")
        assert first is not None
        assert await settle(reaper_try="r0123") == first  # the same try again: its entry
        assert await settle(reaper_try="r4567") is None  # another reaper's
        assert await settle() is None  # a reaper without a token
        assert await settle(own=True) is None  # the call's own, after a reaper's
        assert await redis_client.xlen("lbp:{team-a}:ledger") == 1
        used = (await store.meters("lbp:{team-a}:run:r"))["total_tokens"]
        assert (used.used, used.reserved) == (12, 0)
    finally:
        await store.close()


def passthrough_tenant(key: str) -> str:
    return "pt-" + hashlib.sha256(key.encode()).hexdigest()[:32]


async def until_registry_lacks(redis_client: aioredis.Redis, tenants: set[str]) -> set[str]:
    """Up to 5 s for reaper rounds to drop ``tenants`` from the registry: what it holds then."""
    registry: set[str] = set()
    for _ in range(100):
        registry = set(await redis_client.zrange(TENANTS_KEY, 0, -1))
        if not registry & tenants:
            break
        await asyncio.sleep(0.05)
    return registry


async def test_keys_refused_upstream_leave_the_registry_once_no_registration_keeps_them(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """In pass-through mode each key is a tenant of its own, and each was registered for good:
    40 keys the provider refused (401) were 40 tenants every reaper round read, for ever, and
    keys sprayed at the proxy grew the registry, the process's own set and every round without
    bound. A tenant no registration keeps (two of the longest lease since its last call: set
    back here, as that much time would) and that holds no lease is dropped from both; a key
    still in use stays, and what the ledger holds of the others stays."""
    proxy = await make_proxy(
        passthrough=True,
        upstreams={"openai": {"base_url": fake.base_url, "passthrough_auth": True}},
        limits={"reaper_interval_s": 0.05},
    )
    fake.api_key = "sk-caller-good"
    junk = {passthrough_tenant(f"sk-junk-{i}") for i in range(40)}
    body = {"model": MODEL, "messages": MSGS}
    async with aiohttp.ClientSession() as session:
        for i in range(40):
            headers = {"Authorization": f"Bearer sk-junk-{i}"}
            async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                assert resp.status == 401, await resp.text()
        headers = {"Authorization": "Bearer sk-caller-good"}
        async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    good = passthrough_tenant("sk-caller-good")
    assert junk | {good} <= set(await redis_client.zrange(TENANTS_KEY, 0, -1))
    registered = proxy.app[STATE].registered_tenants
    for tenant in junk:  # their registrations ran out, by the registry's clock and the process's
        await redis_client.zadd(TENANTS_KEY, {tenant: 1}, xx=True)
        registered[tenant] = 1
    registry = await until_registry_lacks(redis_client, junk)
    assert not registry & junk
    assert good in registry
    assert set(registered) == {good}
    for tenant in junk:  # a dropped tenant's ledger is its own: its entry is still there
        assert await redis_client.xlen(f"lbp:{{{tenant}}}:ledger") == 1


class TenantsRead(RedisStore):
    """The real store, noting the tenants whose leases it was asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    async def expired_leases(self, *, tenant: str, **kwargs: Any) -> Any:  # type: ignore[override]
        self.read.add(tenant)
        return await super().expired_leases(tenant=tenant, **kwargs)


async def test_a_round_reads_the_tenants_that_may_hold_a_lease_and_reaps_a_dead_instances(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """Every round read every tenant ever registered. One whose registration ran out is read
    until it holds no lease, then dropped: here 40 that hold none at once, and one whose call a
    dead instance left in flight (its lease renewed past the registration, a long stream) only
    once that lease ran out and was billed at its reserve. A tenant registered lately stays."""
    store = TenantsRead.from_url(redis_server.url)
    await store.load_scripts()
    junk = {f"pt-junk-{i:02d}" for i in range(40)}
    reaper: asyncio.Task[None] | None = None
    try:
        await store.register_tenants([*junk, "crashed", "live"])
        reserved = await run_lease(store, "crashed", "in-flight", "r", lease_ms=600_000)
        assert isinstance(reserved, Reservation)
        for tenant in [*junk, "crashed"]:  # registered two leases ago, by the registry's clock
            await redis_client.zadd(TENANTS_KEY, {tenant: 1}, xx=True)
        reaper = asyncio.create_task(run_reaper(store, 0.05, lambda entry: None))
        registry = await until_registry_lacks(redis_client, junk)
        assert registry == {"crashed", "live"}  # crashed holds a lease: kept
        store.read.clear()
        await asyncio.sleep(0.3)  # rounds after the drop
        assert store.read == {"crashed", "live"}
        await redis_client.zadd("lbp:{crashed}:leases", {"in-flight": 0})  # the lease ran out
        registry = await until_registry_lacks(redis_client, {"crashed"})
        assert registry == {"live"}
    finally:
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await store.close()
    entries = [fields for _, fields in await redis_client.xrange("lbp:{crashed}:ledger")]
    assert [(e["reservation_id"], e["outcome"]) for e in entries] == [("in-flight", "lease_expired")]


async def test_the_registry_as_written_before_is_moved_in_and_its_tenants_reaped(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A deployment upgraded from the registry as a set (``lbp:tenants``, kept for good, and
    still written by an instance not upgraded yet): its tenants' leases are reaped, and they
    are moved into the registry, registered from then on, dropped as any other."""
    store = RedisStore.from_url(redis_server.url)
    await store.load_scripts()
    await run_lease(store, "team-old", "dead-instance", "r")
    await redis_client.delete(TENANTS_KEY)
    await redis_client.sadd(OLD_TENANTS_KEY, "team-old", "pt-idle")
    reaper = asyncio.create_task(run_reaper(store, 0.05, lambda entry: None))
    try:
        for _ in range(100):
            if await redis_client.xlen("lbp:{team-old}:ledger"):
                break
            await asyncio.sleep(0.05)
        now_ms = int(await store.synced_now() * 1000)
        registry = dict(await redis_client.zrange(TENANTS_KEY, 0, -1, withscores=True))
        assert await redis_client.exists(OLD_TENANTS_KEY) == 0
        await redis_client.sadd(OLD_TENANTS_KEY, "team-not-upgraded")  # an older instance's reaper
        for _ in range(100):
            if await redis_client.zscore(TENANTS_KEY, "team-not-upgraded") is not None:
                break
            await asyncio.sleep(0.05)
        assert await redis_client.exists(OLD_TENANTS_KEY) == 0
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await store.close()
    assert set(registry) == {"team-old", "pt-idle"}
    assert all(until_ms > now_ms + 600_000 for until_ms in registry.values()), (registry, now_ms)
    outcomes = [fields["outcome"] for _, fields in await redis_client.xrange("lbp:{team-old}:ledger")]
    assert outcomes == ["lease_expired"]


async def test_a_call_s_record_names_the_marker_life_its_instance_counts_on(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(limits={"settled_marker_ttl_s": 7200})
    body = {"model": MODEL, "messages": MSGS, "fake": {"hold": True}}
    async with aiohttp.ClientSession() as session:
        call = asyncio.ensure_future(
            session.post(
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY_A}", **run_headers("marked")},
            )
        )
        await until_upstream_received(fake, 1)
        [key] = await redis_client.keys("lbp:{team-a}:resv:*")
        record = json.loads(await redis_client.hget(key, "record"))
        fake.release()
        async with await call as resp:
            assert resp.status == 200
    assert record["marker_ttl_s"] == 7200


async def test_a_reaper_set_shorter_leaves_its_marker_as_long_as_the_serving_instance_counts_on(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """Instances sharing a Redis with settled_marker_ttl_s differing (a rolling restart lowering
    it): the one serving a call journals its settle, billable if the reservation is lost for up
    to 90% of its own marker life; another's reaper bills the call meanwhile. Its marker, kept
    for the reaper's shorter setting, expired before the journal's replay, which then found
    neither record nor marker and billed the call a second time (the races hunt)."""
    serving = RedisStore.from_url(redis_server.url, settled_marker_ttl_s=3600)
    reaping = RedisStore.from_url(redis_server.url, settled_marker_ttl_s=60)
    try:
        for rid, named_s in (("named", 3600), ("older", None), ("shorter", 30)):
            record = {"run_id": rid} if named_s is None else {"run_id": rid, "marker_ttl_s": named_s}
            held = await serving.reserve(
                tenant="team-a",
                reservation_id=rid,
                run_id=rid,
                scopes=[Scope(name="run", key=f"lbp:{{team-a}}:run:{rid}")],
                amounts={"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
                lease_ms=1,
                record=json.dumps(record),
            )
            assert isinstance(held, Reservation)
        await asyncio.sleep(0.05)
        reaped = await reap_tenant(reaping, "team-a")
        assert sorted(e["reservation_id"] for e in reaped) == ["named", "older", "shorter"]
        ttls = {
            rid: await redis_client.ttl(f"lbp:{{team-a}}:resv:{rid}") for rid in ("named", "older", "shorter")
        }
        assert 3500 < ttls["named"] <= 3600, ttls  # the serving instance's, past the reaper's 60 s
        assert 0 < ttls["older"] <= 60 and 0 < ttls["shorter"] <= 60, ttls  # the reaper's own
    finally:
        await serving.close()
        await reaping.close()


@pytest.mark.parametrize(
    ("tenant", "key_name", "kept_s"), [("pt-" + "ab" * 16, "pt-" + "ab" * 16, 3600), ("team-a", "a-ci", -1)]
)
async def test_a_reaper_s_settle_of_a_pass_through_call_expires_its_ledger_and_key_s_lifetime(
    store: RedisStore, redis_client: aioredis.Redis, tenant: str, key_name: str, kept_s: int
) -> None:
    """A lease the version before left: its key's lifetime at TTL 0 in the record (persistent).
    Reaped, a pass-through caller's tenant's ledger and its key's lifetime meters expire with
    its runs (the record's run TTL), as its live settle has them; a configured tenant's stay
    kept for ever."""
    run, lifetime = f"lbp:{{{tenant}}}:run:r1", f"lbp:{{{tenant}}}:key:{key_name}:all"
    held = await store.reserve(
        tenant=tenant,
        reservation_id="dead-instance",
        run_id="r1",
        scopes=[Scope(name="run", key=run, ttl_s=3600), Scope(name="key", key=lifetime)],
        amounts={"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
        lease_ms=1,
        record='{"run_id": "r1", "run_ttl_s": 3600}',
    )
    assert isinstance(held, Reservation)
    # Run out by the store's own clock, which the reaper's script reads (this process's measure
    # of it may be a few milliseconds ahead under load).
    while not await store.expired_leases(tenant=tenant, limit=1):
        await asyncio.sleep(0.01)
    assert len(await reap_tenant(store, tenant)) == 1
    ledger = f"lbp:{{{tenant}}}:ledger"
    assert [entry["outcome"] for _, entry in await redis_client.xrange(ledger)] == ["lease_expired"]
    for key in (ledger, lifetime):
        left = await redis_client.ttl(key)
        assert left == -1 if kept_s < 0 else 3000 < left <= kept_s, (key, left)


# -- a store that stalls without failing ----------------------------------------------------------

# The reaper of these tests: a grace of a second, a round every 50 ms, a read that waits 0.2 s or
# more counted as the store away (``stall_s``), a pause of the store's longer than that.
STALL_GRACE_S = 1.0
STALL_S = 0.2
PAUSE_S = 0.6


async def lease_past_its_grace_in(store: RedisStore, tenant: str, rid: str, after_s: float) -> None:
    """A lease of ``tenant`` whose grace ends ``after_s`` from now by the store's clock."""
    await run_lease(store, tenant, rid, f"run-{rid}", lease_ms=60_000)
    ran_out_ms = int((await store.synced_now() + after_s - STALL_GRACE_S) * 1000)
    await store.client.zadd(f"lbp:{{{tenant}}}:leases", {rid: ran_out_ms})


async def stall_reaper(
    store: RedisStore, tenants: list[str], interval_s: float = 0.05
) -> asyncio.Future[None]:
    """A reaper on ``store`` whose grace has run (the store answered it that long)."""
    reaper = asyncio.ensure_future(
        run_reaper(
            store, interval_s, lambda entry: None, lambda: tenants, grace_s=STALL_GRACE_S, stall_s=STALL_S
        )
    )
    await asyncio.sleep(STALL_GRACE_S + 0.3)
    return reaper


async def reaped_a_grace_after(
    client: aioredis.Redis, reaper: asyncio.Future[None], rid: str, pause_s: float
) -> None:
    """team-a's lease ``rid`` still held half a grace after a pause of ``pause_s`` begun now, then
    reaped all the same (the grace over); ``reaper`` stopped."""
    await asyncio.sleep(pause_s + STALL_GRACE_S / 2)
    assert await client.zscore("lbp:{team-a}:leases", rid) is not None
    async with asyncio.timeout(10):
        while await client.zscore("lbp:{team-a}:leases", rid) is not None:
            await asyncio.sleep(0.05)
    reaper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reaper


async def test_a_lease_past_its_grace_when_the_store_stalled_waits_a_grace_after_the_stall(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """The store stalls (paused) for less than a socket timeout: no read of the reaper's fails,
    yet a settle sent before the stall may have failed in it, and its journal lands a replay
    after it. A lease past its grace when the stall ends is reaped only a grace later, as after
    an outage: reaped as the stall ended, its call was billed at its reserve, not its figures."""
    store = RedisStore.from_url(own_redis.url, socket_timeout_s=5.0)
    try:
        reaper = await stall_reaper(store, ["team-a"])
        await run_lease(store, "team-a", "stalled", "run-stalled", lease_ms=60_000)
        due_ms = int((await store.synced_now() + PAUSE_S / 2 - STALL_GRACE_S) * 1000)
        # Due within the pause, made so in its transaction: no read of the reaper's comes between.
        async with own_client.pipeline(transaction=True) as both:
            both.zadd("lbp:{team-a}:leases", {"stalled": due_ms})
            both.execute_command("CLIENT", "PAUSE", str(int(PAUSE_S * 1000)), "ALL")
            await both.execute()
        await reaped_a_grace_after(own_client, reaper, "stalled", PAUSE_S)
    finally:
        await store.close()


class PausingAfter(RedisStore):
    """A real store that, once a read of ``tenant``'s leases has been answered, makes the lease
    ``rid`` of that tenant due for reaping as a pause of its Redis (``pause_s``) ends, and pauses
    it: the next tenant's read, in the same round, fails in the pause."""

    tenant = ""
    rid = ""
    pause_s = 0.0
    paused = False

    async def expired_leases(self, **kwargs: Any) -> Any:
        leases = await super().expired_leases(**kwargs)
        if kwargs.get("tenant") == self.tenant and self.pause_s and not self.paused:
            self.paused = True
            due_ms = int((await self.synced_now() + self.pause_s - STALL_GRACE_S) * 1000)
            await self.client.zadd(f"lbp:{{{self.tenant}}}:leases", {self.rid: due_ms})
            await self.client.execute_command("CLIENT", "PAUSE", str(int(self.pause_s * 1000)), "ALL")
        return leases


async def test_one_tenants_read_failing_on_one_redis_starts_every_tenants_grace_again(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """On one Redis, a read of team-b's that fails (the store away past a socket timeout) says
    the store was away for every process: team-a's settles failed in it too and are journaled.
    Its lease past its grace when the store is back is reaped a grace later, not in the next
    round (which reads after the store is back: no read of it waits)."""
    pause_s = 0.5  # past the store's socket timeout (0.3 s), over before the next round (0.3 s on)
    store = PausingAfter.from_url(own_redis.url, socket_timeout_s=0.3)
    assert isinstance(store, PausingAfter)
    try:
        reaper = await stall_reaper(store, ["team-a", "team-b"], interval_s=0.3)
        await run_lease(store, "team-a", "graced", "run-graced", lease_ms=60_000)
        store.tenant, store.rid, store.pause_s = "team-a", "graced", pause_s
        async with asyncio.timeout(10):
            while not store.paused:
                await asyncio.sleep(0.01)
        await reaped_a_grace_after(own_client, reaper, "graced", pause_s)
    finally:
        await store.close()


async def test_a_large_registry_is_no_stall_and_its_idle_tenants_are_still_forgotten(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """The registry's read is a ZSCAN page per 1,000 tenants: their sum is no round trip of a
    stalled store. Timed as one read, a registry a key spray grew (here 30,000 tenants against a
    20 ms threshold) read as a stall every round: no lease was reaped, no idle tenant forgotten,
    and the registry never shrank again (the second review's test)."""
    store = RedisStore.from_url(own_redis.url, socket_timeout_s=5.0)
    reaper: asyncio.Future[None] | None = None
    try:
        sprayed = [f"pt-{i:06d}" for i in range(30_000)]
        await store.register_tenants(sprayed, kept_s=0.001)  # ran out at once, no lease held
        await lease_past_its_grace_in(store, "team-a", "dead-instance", after_s=-10 * STALL_GRACE_S)
        reaper = asyncio.ensure_future(
            run_reaper(
                store, 0.3, lambda entry: None, lambda: ["team-a"], grace_s=STALL_GRACE_S, stall_s=0.02
            )
        )
        async with asyncio.timeout(40):
            while await own_client.zscore("lbp:{team-a}:leases", "dead-instance") is not None:
                await asyncio.sleep(0.05)
        assert await own_client.zcard(TENANTS_KEY) < len(sprayed)
    finally:
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await store.close()


class StallingRead(RedisStore):
    """A real store that pauses its Redis for ``pause_s`` (``CLIENT PAUSE``) just before sending
    team-a's ``nth`` read of its leases made with ``limit`` (0: a grace read, ``BATCH``: a read of
    leases to settle); each read after that one is logged with its limit and whether the lease
    ``rid`` was still held as it was sent."""

    limit = 0
    nth = 1
    pause_s = 0.0
    rid = ""
    seen = 0
    stalled = False
    after: list[tuple[int, bool]]

    async def expired_leases(self, **kwargs: Any) -> Any:
        if kwargs.get("tenant") == "team-a":
            if self.stalled:
                held = await self.client.zscore("lbp:{team-a}:leases", self.rid) is not None
                self.after.append((kwargs["limit"], held))
            elif kwargs["limit"] == self.limit:
                self.seen += 1
                if self.seen == self.nth:
                    await self.client.execute_command("CLIENT", "PAUSE", str(int(self.pause_s * 1000)), "ALL")
                    try:
                        return await super().expired_leases(**kwargs)
                    finally:
                        self.stalled = True
        return await super().expired_leases(**kwargs)


@pytest.mark.parametrize(("limit", "nth"), [(0, 3), (BATCH, 1)], ids=["grace read", "batch read"])
async def test_each_read_of_a_tenants_leases_that_stalls_starts_its_grace_again(
    own_redis: RedisServerProcess, limit: int, nth: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A read of team-a's leases answered ``STALL_S`` or more late, its grace read or its read of
    the leases to settle, is an outage: nothing it listed is settled, and the next round reads in
    a grace again (the lease still held) before settling. Without that check a grace read's stall
    longer than the grace, or a stalled read of the leases to settle, settled the lease as the
    stall ended; a stall is logged as one (a warning), not as the store unreachable."""
    store = StallingRead.from_url(own_redis.url, socket_timeout_s=5.0)
    assert isinstance(store, StallingRead)
    store.limit, store.nth, store.pause_s, store.rid, store.after = limit, nth, 1.5, "stalled", []
    caplog.set_level("WARNING", logger="proxy.reaper")
    reaper: asyncio.Future[None] | None = None
    try:
        await lease_past_its_grace_in(store, "team-a", "stalled", after_s=-10 * STALL_GRACE_S)
        reaper = asyncio.ensure_future(
            run_reaper(
                store, 0.05, lambda entry: None, lambda: ["team-a"], grace_s=STALL_GRACE_S, stall_s=STALL_S
            )
        )
        async with asyncio.timeout(20):
            while await store.client.zscore("lbp:{team-a}:leases", "stalled") is not None:
                await asyncio.sleep(0.05)
        assert store.after[0] == (0, True)  # a grace read first, the lease still held
        told = [r for r in caplog.records if r.name == "proxy.reaper"]
        assert any(r.levelname == "WARNING" and "slow to answer" in r.getMessage() for r in told)
        assert not any("could not reach" in r.getMessage() for r in told)
    finally:
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await store.close()


async def test_the_proxys_reaper_counts_a_read_half_a_replay_interval_late_as_an_outage(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's reaper is given ``limits.journal_replay_s`` halved as its ``stall_s``: without
    it no stall of the store's short of a failed read restarts the leases' grace."""
    asked: list[dict[str, Any]] = []

    def recorded(*args: Any, **kwargs: Any) -> Awaitable[None]:
        asked.append(kwargs)
        return run_reaper(*args, **kwargs)

    monkeypatch.setattr(app_module, "run_reaper", recorded)
    proxy = await make_proxy()
    assert [kwargs.get("stall_s") for kwargs in asked] == [proxy.config.limits.journal_replay_s / 2]
