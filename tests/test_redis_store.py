"""The store's Lua scripts against a single Redis and, unchanged, a 3-master Redis Cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import NoPermissionError, ResponseError

from proxy.auth import Identity
from proxy.config_tiers import TierConfig
from proxy.errors import StoreError
from proxy.reaper import reap_tenant
from proxy.redis_server import RedisServerProcess, free_port
from proxy.redis_store import RedisStore
from proxy.scopes import scopes_for, window_bounds
from proxy.store import ACTUAL_METERS, Clamp, Eviction, Refusal, Reservation, Scope, Tentative, WindowEnded
from tests.cluster import RedisClusterProcesses
from tests.conftest import (
    KEY_A,
    ProxyFactory,
    busy_script,
    refused_port,
    until_redis_busy,
    until_upstream_received,
)
from tests.fake_upstream import FakeUpstream

AMOUNTS = {
    "requests": 1,
    "input_tokens": 10,
    "output_tokens": 20,
    "total_tokens": 30,
    "cost_micros": 0,
    "concurrent": 1,
}
ACTUAL = {
    "requests": 1,
    "input_tokens": 8,
    "output_tokens": 5,
    "total_tokens": 13,
    "cost_micros": 0,
    "cached_input_tokens": 2,
    "reasoning_tokens": 1,
}
IDENTITY = Identity(tenant="team-a", tier="standard", key_name="a-ci")
TIER = TierConfig.model_validate(
    {
        "run": {"requests": 3, "total_tokens": 100},
        "windows": [{"period": "minute", "requests": 2}],
        "tenant": [{"period": "month", "total_tokens": 1000}],
    }
)

# When the scripts' windows are picked: a window that has ended by the store's clock is never
# reserved in (reserve.lua), so one no test outlives, the same keys every run.
WHEN = datetime(2099, 11, 30, 12, 0, 30, tzinfo=UTC)


def ahead(when: datetime) -> list[Scope]:
    """The call's scopes at ``when``, ahead of the store's clock, sent without their windows'
    start: reserve.lua holds a call to windows that have begun by its clock (the window tests
    below), and these tests read its figures, not its clock."""
    return [replace(s, begins_at_s=None) for s in scopes_for(IDENTITY, "run1", TIER, when, run_ttl_s=0)]


@pytest.fixture(params=["single", "cluster"])
async def store(
    request: pytest.FixtureRequest, redis_server: RedisServerProcess, redis_client: object
) -> AsyncIterator[RedisStore]:
    if request.param == "cluster":
        nodes: RedisClusterProcesses = request.getfixturevalue("cluster")
        store = RedisStore.from_url(nodes.url, cluster=True)
        await store.client.flushall()
    else:
        store = RedisStore.from_url(redis_server.url)
    yield store
    await store.close()


async def reserve(
    store: RedisStore,
    rid: str,
    scopes: list[Scope],
    lease_ms: int = 60_000,
    *,
    run_id: str = "run1",
    record: str = "{}",
    amounts: dict[str, int] | None = None,
    **kw: object,
) -> Reservation | Refusal | Tentative | WindowEnded:
    return await store.reserve(
        tenant="team-a",
        reservation_id=rid,
        run_id=run_id,
        scopes=scopes,
        amounts=dict(amounts or AMOUNTS),
        lease_ms=lease_ms,
        record=record,
        **kw,
    )  # type: ignore[arg-type]


async def settle(
    store: RedisStore, res: Reservation, actual: dict[str, int] = ACTUAL, *, live: bool = False
) -> str | None:
    return await store.settle(
        tenant="team-a",
        reservation_id=res.id,
        run_id="run1",
        scope_keys=[s.key for s in res.scopes],
        actual=actual,
        entry={"request_id": res.id, "outcome": "ok"},
        bill_if_lost=live,
        scope_ttls_s=[s.ttl_s for s in res.scopes],
    )


async def test_reserve_settle_across_all_scopes(store: RedisStore) -> None:
    scopes = ahead(WHEN)
    assert [s.name for s in scopes] == [
        "run",
        "key",
        "key:minute",
        "key:day",
        "key:month",
        "tenant:day",
        "tenant:month",
    ]
    res = await reserve(store, "r1", scopes)
    assert isinstance(res, Reservation)
    # The limited meters' room, each scope's, this call aside: the minute window's 2 requests.
    assert ("requests", 2, 2) in res.rooms
    # The run, the key's lifetime and the scopes a ceiling names hold the reserve; the others
    # (the key's day and month, the tenant's day) hold nothing and are only counted at the settle.
    holding = {"run", "key", "key:minute", "tenant:month"}
    for scope in scopes:
        state = await store.meters(scope.key)
        held = 30 if scope.name in holding else 0
        assert state["total_tokens"].reserved == held, scope.name
        assert state["concurrent"].reserved == (scope.name in holding), scope.name
    entry_id = await settle(store, res)
    assert entry_id is not None
    assert await settle(store, res) is None  # idempotent: a second settle changes nothing
    for scope in scopes:
        state = await store.meters(scope.key)
        assert state["total_tokens"].used == 13 and state["total_tokens"].reserved == 0
        assert state["cached_input_tokens"].used == 2 and state["reasoning_tokens"].used == 1
        assert state["concurrent"].reserved == 0
        assert state["peak_concurrent"].used == (scope.name in holding)
        # A key only a settle wrote expires all the same (the windows), or never (the key's own).
        assert await store.client.ttl(scope.key) == (-1 if scope.name in ("run", "key") else scope.ttl_s)
    (entry,) = await store.run_ledger(tenant="team-a", run_id="run1")
    assert entry["outcome"] == "ok" and entry["id"] == entry_id


async def test_a_scopes_arguments_are_packed_once_for_all_its_reserves(store: RedisStore) -> None:
    scopes = ahead(WHEN)  # the key's: the last test's too
    first = await reserve(store, "r1", scopes)
    packed = [s.packed for s in scopes]
    assert all(p is not None for p in packed)
    second = await reserve(store, "r2", scopes)
    assert all(a is b for a, b in zip(packed, [s.packed for s in scopes], strict=True))
    assert isinstance(first, Reservation) and isinstance(second, Reservation)
    for scope in scopes:  # both reserves held where the scope holds, from the packed arguments
        held = await store.meters(scope.key)
        assert held["total_tokens"].reserved == (60 if scope.holds else 0), scope.name


async def test_a_settle_writes_each_scope_once(redis_server: RedisServerProcess, redis_client: Any) -> None:
    """One HMGET and one HSET per scope, whatever the number of meters (a command from a script
    costs Redis a few microseconds, mostly outside the command): it made one HINCRBY per meter
    released or counted, 62 of the 88 commands of this settle over seven scopes (35 now)."""
    store = RedisStore.from_url(redis_server.url)
    try:
        scopes = ahead(WHEN)
        res = await reserve(store, "r1", scopes)
        assert isinstance(res, Reservation)
        await redis_client.config_resetstat()
        assert await settle(store, res) is not None
        stats = await redis_client.info("commandstats")
    finally:
        await store.close()
    calls = {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}
    assert calls.get("hincrby", 0) == 0, calls
    assert calls["hset"] == len(scopes) + 1  # every scope, and the settled marker
    assert calls["hmget"] == len(scopes) + 1  # every scope, and the record (settled or not)
    assert calls.get("hexists", 0) == 0, calls
    for scope in scopes:
        used = await redis_client.hget(scope.key, "used:total_tokens")
        assert used == "13", scope.name


async def test_a_reserve_writes_each_holding_scope_once(
    redis_server: RedisServerProcess, redis_client: Any
) -> None:
    """One read and one write of every scope that holds the reserve, whatever the number of
    meters: one HINCRBY per meter held made 20 of the 45 commands of this reserve (25 now)."""
    store = RedisStore.from_url(redis_server.url)
    try:
        scopes = ahead(WHEN)
        await redis_client.config_resetstat()
        res = await reserve(store, "r1", scopes)
        assert isinstance(res, Reservation)
        stats = await redis_client.info("commandstats")
        # A second call on the same keys: the fields it adds to are there now.
        await redis_client.config_resetstat()
        again = await reserve(store, "r2", scopes)
        assert isinstance(again, Reservation)
        second = await redis_client.info("commandstats")
    finally:
        await store.close()
    holding = 4  # the run, the key's lifetime, the minute window, the tenant's month
    for name, stat in (("first", stats), ("second", second)):
        calls = {key.removeprefix("cmdstat_"): value["calls"] for key, value in stat.items()}
        assert calls.get("hincrby", 0) == 0, (name, calls)
        assert calls["hset"] == holding + 1, (name, calls)  # every holding scope, and the record
        assert calls["hmget"] == holding, (name, calls)
    for scope in scopes:
        held = await redis_client.hget(scope.key, "resv:total_tokens")
        if scope.name in ("run", "key", "key:minute", "tenant:month"):
            assert held == "60", scope.name
            assert await redis_client.hget(scope.key, "peak:concurrent") == "2", scope.name
            assert await redis_client.hget(scope.key, "born") == "r1", scope.name
        else:
            assert held is None, scope.name


async def test_a_reserve_adds_exactly_past_what_a_double_holds(store: RedisStore) -> None:
    """Reserves are added in Lua's doubles, exact below 2**53; past it HINCRBY adds, and the
    settle releases exactly what was held."""
    run = Scope(name="run", key="lbp:{team-a}:run:big")
    big = 2**53 + 1  # not a double
    await store.client.hset(run.key, mapping={"resv:input_tokens": str(big), "born": "r0"})
    res = await reserve(store, "r1", [run])
    assert isinstance(res, Reservation)
    assert int(await store.client.hget(run.key, "resv:input_tokens")) == big + AMOUNTS["input_tokens"]
    assert int(await store.client.hget(run.key, "resv:total_tokens")) == AMOUNTS["total_tokens"]
    assert await store.client.hget(run.key, "born") == "r0"  # the key's life it landed in
    assert await settle(store, res) is not None
    assert int(await store.client.hget(run.key, "resv:input_tokens")) == big


async def test_a_settle_adds_exactly_past_what_a_double_holds(store: RedisStore) -> None:
    """Sums are worked out in Lua's doubles, exact below 2**53; past it HINCRBY adds."""
    scopes = ahead(WHEN)
    res = await reserve(store, "r1", scopes)
    assert isinstance(res, Reservation)
    big = 2**53 + 1  # not a double
    await store.client.hset(scopes[0].key, "used:input_tokens", str(big))
    assert await settle(store, res) is not None
    assert int(await store.client.hget(scopes[0].key, "used:input_tokens")) == big + ACTUAL["input_tokens"]
    assert int(await store.client.hget(scopes[1].key, "used:input_tokens")) == ACTUAL["input_tokens"]


async def test_the_calls_own_settle_sent_again_gets_its_entry_a_reapers_does_not(store: RedisStore) -> None:
    """A settle sent again after a reply that came late (the cluster client retries a timeout)
    or was lost (the journal replays it) ran the first time: the call's own settle gets that
    try's entry, not "settled before", which is a reaper's (the client would be told its call
    was billed at its reserve). A reaper's settle sent again, or the call's own settle after a
    reaper's, gets "settled before", as always."""
    run = Scope(name="run", key="lbp:{team-a}:run:own")

    async def settle_as(res: Reservation, *, own: bool) -> str | None:
        return await store.settle(
            tenant="team-a",
            reservation_id=res.id,
            run_id="own",
            scope_keys=[run.key],
            actual=ACTUAL,
            entry={"request_id": res.id, "outcome": "ok"},
            bill_if_lost=own,
            scope_ttls_s=[0],
            own=own,
        )

    mine = await reserve(store, "own-1", [run], run_id="own")
    assert isinstance(mine, Reservation)
    first = await settle_as(mine, own=True)
    assert first is not None
    assert await settle_as(mine, own=True) == first  # its own again: its entry
    assert await settle_as(mine, own=False) is None  # a reaper after it: settled before
    reaped = await reserve(store, "own-2", [run], run_id="own")
    assert isinstance(reaped, Reservation)
    assert await settle_as(reaped, own=False) is not None  # a reaper's, first
    assert await settle_as(reaped, own=False) is None
    assert await settle_as(reaped, own=True) is None  # the call's own after a reaper's
    assert len(await store.client.xrange("lbp:{team-a}:ledger")) == 2  # each billed once
    used = await store.meters(run.key)
    assert used["total_tokens"].used == 2 * ACTUAL["total_tokens"] and used["total_tokens"].reserved == 0


async def test_a_window_another_tier_limits_holds_the_reserve_without_a_ceiling(store: RedisStore) -> None:
    shared = Scope(name="tenant:month", key="lbp:{team-a}:tenant:month:shared", shared_limit=True)
    unlimited = Scope(name="tenant:day", key="lbp:{team-a}:tenant:day:shared")
    res = await reserve(store, "h1", [shared, unlimited])
    assert isinstance(res, Reservation)
    assert (await store.meters(shared.key))["total_tokens"].reserved == 30
    assert (await store.meters(unlimited.key))["total_tokens"].reserved == 0
    assert await settle(store, res) is not None
    for scope in (shared, unlimited):
        state = await store.meters(scope.key)
        assert (state["total_tokens"].used, state["total_tokens"].reserved) == (13, 0)


@pytest.mark.parametrize("settled", ["before the index is read", "after the index is read"])
async def test_scope_meters_never_counts_a_call_twice(store: RedisStore, settled: str) -> None:
    """A scope that holds nothing shows the calls in flight from their records, read after the
    scope's own hash: a call that settles while the view reads is missed by that view, never
    shown both used and reserved; one reserved before the lease index is read is shown."""
    run = Scope(name="run", key="lbp:{team-a}:run:view")
    day = Scope(name="key:day", key="lbp:{team-a}:key:a-ci:day:view")
    first = await reserve(store, "v1", [run, day], run_id="view")
    assert isinstance(first, Reservation)
    client: Any = store.client
    original = client.zrange

    async def meanwhile(*args: Any, **kwargs: Any) -> Any:
        if settled == "before the index is read":
            assert await settle(store, first) is not None
            assert isinstance(await reserve(store, "v2", [run, day], run_id="view"), Reservation)
        ids = await original(*args, **kwargs)
        if settled == "after the index is read":
            assert await settle(store, first) is not None
        return ids

    client.zrange = meanwhile
    try:
        found = await store.scope_meters(tenant="team-a", keys=[day.key])
    finally:
        del client.zrange
    state = found[day.key]
    reserved_now = 30 if settled == "before the index is read" else 0  # v2's, not v1's
    assert (state["total_tokens"].used, state["total_tokens"].reserved) == (0, reserved_now)
    assert state["concurrent"].reserved == reserved_now // 30
    after = (await store.scope_meters(tenant="team-a", keys=[day.key]))[day.key]
    assert (after["total_tokens"].used, after["total_tokens"].reserved) == (13, reserved_now)


async def test_overlapping_calls_keep_the_first_reserves_life_and_release_everything(
    store: RedisStore,
) -> None:
    """The born stamp is written once per life of a key: a reserve that wrote it again would
    make every call reserved before it release nothing at its settle (room lost for good)."""
    key = Scope(name="key", key="lbp:{team-a}:key:overlap:all")
    day = Scope(name="key:day", key="lbp:{team-a}:key:overlap:day", ceilings={"requests": 100})
    first = await reserve(store, "o1", [key, day], run_id="o")
    second = await reserve(store, "o2", [key, day], run_id="o")
    assert isinstance(first, Reservation) and isinstance(second, Reservation)
    await settle(store, first)
    third = await reserve(store, "o3", [key, day], run_id="o")
    assert isinstance(third, Reservation)
    for scope in (key, day):
        fields = await store.client.hgetall(scope.key)
        assert (
            fields["born"] == "o1" and fields["resv:concurrent"] == "2" and fields["peak:concurrent"] == "2"
        )
    for res in (third, second):
        await settle(store, res)
    for scope in (key, day):
        fields = await store.client.hgetall(scope.key)
        assert all(v == "0" for f, v in fields.items() if f.startswith("resv:")), fields
        assert fields["used:requests"] == "3" and fields["peak:concurrent"] == "2"


async def test_all_or_nothing_refusal_names_the_scope_and_changes_nothing(store: RedisStore) -> None:
    scopes = ahead(WHEN)
    for rid in ("a", "b"):
        assert isinstance(await reserve(store, rid, scopes), Reservation)
    refused = await reserve(store, "c", scopes)
    assert isinstance(refused, Refusal)
    assert refused.scope.name == "key:minute" and refused.meter == "requests"
    assert (refused.ceiling, refused.used, refused.reserved, refused.amount) == (2, 0, 2, 1)
    for scope in scopes:  # the refused call reserved nothing anywhere
        state = await store.meters(scope.key)
        held = scope.name in ("run", "key", "key:minute", "tenant:month")  # the others hold nothing
        assert state["requests"].reserved == 2 * held and state["total_tokens"].reserved == 60 * held
    assert await store.client.zcard("lbp:{team-a}:leases") == 2
    assert not await store.client.exists("lbp:{team-a}:resv:c")
    assert await store.client.hget(scopes[2].key, "refused:requests") == "1"  # counted, not charged


async def test_a_new_window_needs_no_reset(store: RedisStore) -> None:
    minute = WHEN
    first = ahead(minute)
    for rid in ("a", "b"):
        await reserve(store, rid, first)
    assert isinstance(await reserve(store, "c", first), Refusal)
    later = ahead(minute + timedelta(minutes=1))
    assert later[2].key != first[2].key and later[3].key == first[3].key
    assert isinstance(await reserve(store, "c", later), Reservation)


def test_window_bounds_are_calendar_windows() -> None:
    now = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert window_bounds("minute", now)[1] == datetime(2027, 1, 1, tzinfo=UTC)
    assert window_bounds("day", now) == (datetime(2026, 12, 31, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert window_bounds("month", now) == (
        datetime(2026, 12, 1, tzinfo=UTC),
        datetime(2027, 1, 1, tzinfo=UTC),
    )
    assert window_bounds("hour", now)[0] == datetime(2026, 12, 31, 23, tzinfo=UTC)


async def test_clamp_in_the_script(store: RedisStore) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:clamp", ceilings={"output_tokens": 12})
    clamp = Clamp(min_output_tokens=4, choices=2, input_cost_exact=0, output_rate=0)
    res = await reserve(store, "c1", [scope], clamp=clamp)
    assert isinstance(res, Reservation)
    assert res.clamped_output_per_choice == 6 and res.amounts["output_tokens"] == 12
    assert res.amounts["total_tokens"] == 22
    refused = await reserve(store, "c2", [scope], clamp=clamp)  # nothing left worth 4 per choice
    assert isinstance(refused, Refusal)


async def test_a_retried_reserve_gets_the_clamp_of_its_first_try(store: RedisStore) -> None:
    """A retry after a lost reply (the cluster client retries by itself) must not send the body
    out unclamped while Redis holds only the clamped amounts."""
    scope = Scope(name="run", key="lbp:{team-a}:run:clamp", ceilings={"output_tokens": 12})
    clamp = Clamp(min_output_tokens=4, choices=2, input_cost_exact=0, output_rate=0)
    first = await reserve(store, "c1", [scope], clamp=clamp)
    again = await reserve(store, "c1", [scope], clamp=clamp)
    assert isinstance(first, Reservation) and isinstance(again, Reservation)
    assert again.clamped_output_per_choice == first.clamped_output_per_choice == 6
    assert again.amounts == first.amounts
    state = await store.client.hgetall("lbp:{team-a}:run:clamp")
    assert state["resv:output_tokens"] == "12"  # reserved once


async def test_expired_leases_are_reaped_once_and_renew_extends(store: RedisStore) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:run1")
    short = await reserve(store, "short", [scope], lease_ms=1, record='{"run_id": "run1"}')
    long = await reserve(store, "long", [scope])
    assert isinstance(short, Reservation) and isinstance(long, Reservation)
    before = await store.client.zscore("lbp:{team-a}:leases", "long")
    assert await store.renew(tenant="team-a", reservation_id="long", lease_ms=3_600_000)
    after = await store.client.zscore("lbp:{team-a}:leases", "long")
    assert after is not None and before is not None and after - before > 3_000_000  # extended
    await store.register_tenant("team-a")

    await asyncio.sleep(0.01)
    assert len(await reap_tenant(store, "team-a")) == 1
    assert await reap_tenant(store, "team-a") == []
    (entry,) = await store.run_ledger(tenant="team-a", run_id="run1")
    assert entry["outcome"] == "lease_expired" and entry["total_tokens"] == "30"
    # No run_ttl_s in the record (a reserve of an older version): the index stays for ever.
    assert await store.client.ttl("lbp:{team-a}:runlog:run1") == -1
    assert not await store.renew(tenant="team-a", reservation_id="short", lease_ms=1000)
    assert await settle(store, long) is not None


async def test_the_proxy_bills_through_a_redis_cluster(
    cluster: RedisClusterProcesses, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(
        redis={"url": cluster.url, "cluster": True}, tiers={"standard": {"run": {"requests": 1}}}
    )
    client = proxy.client()
    stream = await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"X-Run-Id": "on-cluster"},
    )
    async for _chunk in stream:
        pass
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Run-Id": "on-cluster"},
        )
    store = RedisStore.from_url(cluster.url, cluster=True)
    try:
        (entry,) = await store.run_ledger(tenant="team-a", run_id="on-cluster")
    finally:
        await store.close()
    assert entry["outcome"] == "ok" and int(entry["output_tokens"]) == fake.bill[0].completion_tokens


async def test_a_burst_above_the_cluster_pool_waits_for_connections(
    cluster: RedisClusterProcesses, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """redis-py's cluster client fails a command at once when its node has no connection free
    (a tenant's keys share one slot, so one node): a burst of more calls than ``pool_size`` was
    refused, 503 (12 of 20 here), each reserve taken for one whose reply was lost. They wait
    for a connection, as on a single Redis, and every call is served and billed."""
    proxy = await make_proxy(redis={"url": cluster.url, "cluster": True, "pool_size": 4})
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> int:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"call {i}"}]}
            headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "burst"}
            async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one(i) for i in range(20)))
    assert statuses == [200] * 20
    store = RedisStore.from_url(cluster.url, cluster=True)
    try:
        for _ in range(100):  # the last settles' entries, written once their answers went
            entries = await store.run_ledger(tenant="team-a", run_id="burst")
            if len(entries) == 20:
                break
            await asyncio.sleep(0.05)
    finally:
        await store.close()
    assert len(entries) == 20 and {e["outcome"] for e in entries} == {"ok"}


async def test_a_connection_redis_py_tears_down_under_a_call_is_a_store_failure_not_a_500(
    cluster: RedisClusterProcesses,
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py 8.1 leaks AttributeError (or TypeError) when a connection is torn down under a
    write, as in a Cluster's failover (redis/redis-py#4287; seen in this suite's failover test:
    ``self._writer.writelines`` on a writer gone None). Redis stays real; only that write of
    redis-py's fails, once, as it does then. The call is refused as the store being down (503,
    nothing forwarded), not answered with a 500; the next is served."""
    proxy = await make_proxy(redis={"url": cluster.url, "cluster": True})
    write = AbstractConnection._send_packed_command
    torn: list[bool] = []

    async def torn_down_once(self: AbstractConnection, command: Any) -> None:
        # The call's reserve (the first write naming a reservation), not the reaper's rounds.
        if not torn and b"resv:" in b"".join(bytes(part) for part in command):
            torn.append(True)
            raise AttributeError("'NoneType' object has no attribute 'writelines'")
        await write(self, command)

    monkeypatch.setattr(AbstractConnection, "_send_packed_command", torn_down_once)
    client = proxy.client()
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(model="gpt-4o-mini", messages=hi)
    assert refused.value.status_code == 503, refused.value
    assert torn and fake.received == []
    reply = await client.chat.completions.create(model="gpt-4o-mini", messages=hi)
    assert reply.choices[0].finish_reason == "stop"


async def test_a_retried_reserve_reserves_once(store: RedisStore) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:retry")
    first = await reserve(store, "same-id", [scope], run_id="retry")
    again = await reserve(store, "same-id", [scope], run_id="retry")
    assert isinstance(first, Reservation) and isinstance(again, Reservation)
    assert (await store.meters(scope.key))["total_tokens"].reserved == 30
    assert await settle(store, first) is not None
    assert (await store.meters(scope.key))["total_tokens"].reserved == 0


async def test_a_reserve_run_after_one_of_its_windows_ended_writes_nothing(store: RedisStore) -> None:
    """Its windows are picked by the caller's measure of the store's clock before it is sent;
    run once one of them has ended (a store slow to run it: a stall, a pause), the call was held
    to it: refused by a ceiling that had reset, or counted in a window that was over (the store
    faults hunt). Nothing is written, and the store's clock is said, to pick them again; a retry
    of a reserve that ran is one still (its reply lost, it is sent again as it was)."""
    now_s = await store.synced_now()
    kept = await reserve(store, "kept", ahead(WHEN))
    ended = scopes_for(IDENTITY, "run1", TIER, datetime.fromtimestamp(now_s - 60, UTC), run_ttl_s=0)
    assert isinstance(kept, Reservation) and isinstance(await reserve(store, "kept", ended), Reservation)
    windows = [s for s in ended if s.resets_at_s is not None]
    found = await reserve(store, "late", ended)
    assert isinstance(found, WindowEnded) and found.now_s >= min(s.resets_at_s or 0 for s in windows)
    assert not any([await store.client.exists(s.key) for s in windows])
    assert not await store.client.exists("lbp:{team-a}:resv:late")
    assert await store.client.zcard("lbp:{team-a}:leases") == 1
    picked = scopes_for(IDENTITY, "run1", TIER, datetime.fromtimestamp(found.now_s, UTC), run_ttl_s=0)
    assert isinstance(await reserve(store, "late", picked), Reservation)


async def test_a_reserve_run_before_one_of_its_windows_began_writes_nothing(store: RedisStore) -> None:
    """Its windows picked by a measure of the store's clock that runs ahead of it (the store's
    clock stepped back, a failover to a replica whose clock is behind, since the measure), the
    call was counted in a window not begun by TIME, where the current window's ceiling does not
    see it (the calendar hunt). Nothing is written, and the store's clock is said, to pick them
    again."""
    now_s = await store.synced_now()
    early = scopes_for(IDENTITY, "run1", TIER, datetime.fromtimestamp(now_s + 120, UTC), run_ttl_s=0)
    found = await reserve(store, "early", early)
    assert isinstance(found, WindowEnded)
    assert found.now_s < max(s.begins_at_s or 0 for s in early)
    assert not any([await store.client.exists(s.key) for s in early])
    assert not await store.client.exists("lbp:{team-a}:resv:early")
    picked = scopes_for(IDENTITY, "run1", TIER, datetime.fromtimestamp(found.now_s, UTC), run_ttl_s=0)
    assert isinstance(await reserve(store, "early", picked), Reservation)


async def test_a_tentative_reserve_that_does_not_fit_writes_nothing(store: RedisStore) -> None:
    """A quick (byte-length) input bound that does not fit leaves no trace: no reserve, no
    record, no refusal counted; the final reserve with the exact count decides."""
    scope = Scope(name="run", key="lbp:{team-a}:run:tentative", ceilings={"total_tokens": 29})
    assert isinstance(await reserve(store, "t1", [scope], tentative=True), Tentative)
    assert (await store.meters(scope.key))["total_tokens"].reserved == 0
    assert not await store.client.exists("lbp:{team-a}:resv:t1")
    assert not any(f.startswith("refused:") for f in await store.client.hkeys(scope.key))
    exact = {**AMOUNTS, "input_tokens": 9, "total_tokens": 29}
    res = await store.reserve(
        tenant="team-a",
        reservation_id="t1",
        run_id="run1",
        scopes=[scope],
        amounts=exact,
        lease_ms=60_000,
        record="{}",
    )
    assert isinstance(res, Reservation)
    assert (await store.meters(scope.key))["total_tokens"].reserved == 29


async def test_a_tentative_reserve_refused_on_calls_is_a_final_refusal(store: RedisStore) -> None:
    # No exact count of the input changes how many calls fit: no second round trip for that.
    scope = Scope(name="run", key="lbp:{team-a}:run:tentative-calls", ceilings={"requests": 0})
    refused = await reserve(store, "t2", [scope], tentative=True)
    assert isinstance(refused, Refusal) and refused.meter == "requests"
    assert await store.client.hget(scope.key, "refused:requests") == "1"


async def test_shrink_lowers_every_scope_and_the_settle_releases_what_is_left(store: RedisStore) -> None:
    scopes = [
        Scope(name="run", key="lbp:{team-a}:run:shrink"),
        Scope(name="tenant:month", key="lbp:{team-a}:tenant:month:shrink", ceilings={"total_tokens": 1000}),
        Scope(name="key:day", key="lbp:{team-a}:key:a-ci:day:shrink"),  # no ceiling: holds nothing
    ]
    res = await reserve(store, "s1", scopes, run_id="shrink")
    assert isinstance(res, Reservation)
    # Another call's reserve where this one holds nothing: never released by this one.
    other = Scope(name="key:day", key=scopes[2].key, ceilings={"requests": 10})
    assert isinstance(await reserve(store, "other", [other], run_id="other"), Reservation)
    lower = {**AMOUNTS, "input_tokens": 4, "total_tokens": 24}
    keys = [s.key for s in scopes]
    assert await store.shrink(tenant="team-a", reservation_id="s1", scope_keys=keys, amounts=lower)
    for key in keys[:2]:
        state = await store.meters(key)
        assert (state["input_tokens"].reserved, state["total_tokens"].reserved) == (4, 24)
        assert state["requests"].reserved == 1
    assert (await store.meters(keys[2]))["total_tokens"].reserved == 30  # the other call's
    # Never raised: an amount above the reserve changes nothing.
    higher = {**lower, "output_tokens": 21, "total_tokens": 25}
    assert not await store.shrink(tenant="team-a", reservation_id="s1", scope_keys=keys, amounts=higher)
    assert (await store.meters(keys[0]))["output_tokens"].reserved == 20
    assert await settle(store, res) is not None
    for key in keys:
        state = await store.meters(key)
        assert all(m.reserved == (key == keys[2]) * AMOUNTS.get(n, 0) for n, m in state.items()), state
        assert state["input_tokens"].used == ACTUAL["input_tokens"]
    # Settled: nothing left to lower.
    assert not await store.shrink(tenant="team-a", reservation_id="s1", scope_keys=keys, amounts=lower)
    assert all(m.reserved == 0 for m in (await store.meters(keys[0])).values())


async def test_a_lease_that_ran_out_is_not_renewed(store: RedisStore) -> None:
    """Once expired it is the reapers': one may have read the amounts it will bill, and a live
    lease again would let the call's own settle and a shrink act beside that reaper."""
    scope = Scope(name="run", key="lbp:{team-a}:run:renew-expired")
    res = await reserve(store, "r-exp", [scope], lease_ms=50)
    assert isinstance(res, Reservation)
    expiry = await store.client.zscore("lbp:{team-a}:leases", "r-exp")
    time.sleep(0.1)
    assert not await store.renew(tenant="team-a", reservation_id="r-exp", lease_ms=60_000)
    assert await store.client.zscore("lbp:{team-a}:leases", "r-exp") == expiry


async def test_shrink_leaves_a_lease_that_ran_out_to_the_reaper(store: RedisStore) -> None:
    """A reaper bills the amounts it read: lowering them after that would release less than it
    bills (room given to another call, then charged again)."""
    scope = Scope(name="run", key="lbp:{team-a}:run:shrink-expired")
    res = await reserve(store, "s2", [scope], lease_ms=50, run_id="shrink-expired")
    assert isinstance(res, Reservation)
    time.sleep(0.1)
    lower = {**AMOUNTS, "input_tokens": 4, "total_tokens": 24}
    assert not await store.shrink(tenant="team-a", reservation_id="s2", scope_keys=[scope.key], amounts=lower)
    assert (await store.meters(scope.key))["total_tokens"].reserved == 30


async def test_scripts_run_the_same_without_the_pipelined_connection(
    redis_server: RedisServerProcess,
) -> None:
    """The redis-py path (Cluster and TLS use it) gives the same answers as the pipelined one."""
    import redis.asyncio as aioredis_

    plain = RedisStore(aioredis_.Redis.from_url(redis_server.url, decode_responses=True))
    piped = RedisStore.from_url(redis_server.url)
    try:
        scope = Scope(name="run", key="lbp:{team-a}:run:paths", ceilings={"requests": 2})
        for store, rid in ((plain, "p1"), (piped, "p2")):
            res = await reserve(store, rid, [scope])
            assert isinstance(res, Reservation) and res.rooms[0][0] == "requests"
        assert isinstance(await reserve(plain, "p3", [scope]), Refusal)
        assert isinstance(await reserve(piped, "p3", [scope]), Refusal)
        assert (
            await settle(
                plain,
                Reservation(
                    id="p2", tenant="team-a", run_id="run1", scopes=(scope,), amounts=AMOUNTS, lease_ms=1
                ),
            )
            is not None
        )
    finally:
        await plain.close()
        await piped.close()


async def test_a_settled_reservation_leaves_a_marker_and_a_second_settle_changes_nothing(
    store: RedisStore,
) -> None:
    scopes = ahead(WHEN)
    res = await reserve(store, "m", scopes)
    assert isinstance(res, Reservation)
    assert await settle(store, res) is not None
    assert await store.client.hgetall("lbp:{team-a}:resv:m") == {"settled": "1"}
    ttl = await store.client.ttl("lbp:{team-a}:resv:m")
    assert 0 < ttl <= 3600
    before = await store.meters(scopes[0].key)
    assert await settle(store, res) is None
    assert await store.meters(scopes[0].key) == before
    assert len(await store.run_ledger(tenant="team-a", run_id="run1")) == 1
    assert not await store.renew(tenant="team-a", reservation_id="m", lease_ms=60_000)


async def test_a_call_whose_reservation_was_lost_is_billed_all_the_same(store: RedisStore) -> None:
    """A Redis failover can lose a reserve the old master acknowledged but had not replicated:
    the call went out, so its live settle bills it without a reservation to release. A journal
    replay does not: it may come long after the reaper settled the call and its marker expired."""
    scopes = ahead(WHEN)
    lost = Reservation(
        id="lost",
        tenant="team-a",
        run_id="run1",
        scopes=tuple(scopes),
        amounts=dict(AMOUNTS),
        lease_ms=60_000,
    )
    assert await settle(store, lost) is None  # a journal replay or the reaper: nothing without one
    assert await store.run_ledger(tenant="team-a", run_id="run1") == []
    entry_id = await settle(store, lost, live=True)
    assert entry_id is not None
    (entry,) = await store.run_ledger(tenant="team-a", run_id="run1")
    assert entry["reservation"] == "lost" and entry["id"] == entry_id
    for scope in scopes:
        state = await store.meters(scope.key)
        assert state["total_tokens"].used == ACTUAL["total_tokens"]
        assert state["total_tokens"].reserved == 0 and state["concurrent"].reserved == 0
        # Keys it wrote without a reserve before it expire as a reserve would have made them.
        ttl = await store.client.ttl(scope.key)
        assert ttl == -1 if scope.ttl_s == 0 else scope.ttl_s - 5 <= ttl <= scope.ttl_s
    assert {s.ttl_s > 0 for s in scopes} == {True, False}  # windows expire, the run does not
    assert await settle(store, lost, live=True) is None  # and only once


async def test_releasing_a_reserve_that_never_happened_writes_nothing(store: RedisStore) -> None:
    scopes = ahead(WHEN)
    released = await store.settle(
        tenant="team-a",
        reservation_id="never",
        run_id="run1",
        scope_keys=[s.key for s in scopes],
        actual=dict.fromkeys(ACTUAL, 0),
        entry={"request_id": "never", "outcome": "not_forwarded"},
    )
    assert released is None
    assert await store.run_ledger(tenant="team-a", run_id="run1") == []
    assert not await store.client.exists("lbp:{team-a}:resv:never")


def test_the_window_for_billing_a_lost_reservation_runs_from_the_last_lease_confirmation() -> None:
    from types import SimpleNamespace
    from typing import cast

    from proxy.call import Call
    from proxy.settle import MARKER_TRUST, bill_if_lost_until_ms

    now_ms = time.time() * 1000
    fresh = cast(Call, SimpleNamespace(lease_confirmed_at=time.monotonic()))
    until = bill_if_lost_until_ms(fresh, 3600, now_s=now_ms / 1000)
    assert abs(until - (now_ms + 3600 * MARKER_TRUST * 1000)) < 1000
    stale = cast(Call, SimpleNamespace(lease_confirmed_at=time.monotonic() - 3600))
    assert bill_if_lost_until_ms(stale, 3600, now_s=now_ms / 1000) == 0


async def test_a_reaped_call_keeps_its_run_index_as_long_as_its_reserve_said(store: RedisStore) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:run2", ttl_s=600)
    await reserve(
        store, "gone", [scope], lease_ms=1, run_id="run2", record='{"run_id": "run2", "run_ttl_s": 600}'
    )
    await store.register_tenant("team-a")
    await asyncio.sleep(0.01)
    assert len(await reap_tenant(store, "team-a")) == 1
    for key in ("lbp:{team-a}:run:run2", "lbp:{team-a}:runlog:run2"):
        assert 590 < await store.client.ttl(key) <= 600, key


async def test_a_settle_gives_a_key_that_expired_mid_call_its_ttl_again(store: RedisStore) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:run3", ttl_s=7200)
    reserved = await reserve(store, "mid", [scope], run_id="run3")
    assert isinstance(reserved, Reservation)
    await store.client.delete(scope.key)  # the run idle past its TTL while this call ran
    await store.settle(
        tenant="team-a",
        reservation_id="mid",
        run_id="run3",
        scope_keys=[scope.key],
        actual={"requests": 1},
        entry={"a": "b"},
        scope_ttls_s=[7200],
        runlog_ttl_s=7200,
    )
    for key in (scope.key, "lbp:{team-a}:runlog:run3"):
        assert 7100 < await store.client.ttl(key) <= 7200, key


async def _fill(store: RedisStore, scope: Scope, prefix: str) -> int:
    """Reserve and settle calls (30 tokens each) until the scope refuses; how many fitted."""
    for i in range(10):
        reserved = await reserve(store, f"{prefix}{i}", [scope], run_id="run4")
        if isinstance(reserved, Refusal):
            return i
        assert isinstance(reserved, Reservation)
        await settle(store, reserved, {"requests": 1, "total_tokens": 30})
    return 10


async def test_a_release_from_a_key_that_expired_mid_call_leaves_no_negative_reserve(
    store: RedisStore,
) -> None:
    # The key outlived by a call no longer holds its reserve: releasing it anyway left -30
    # reserved, free room for the next calls past the ceiling.
    scope = Scope(name="run", key="lbp:{team-a}:run:run4", ceilings={"total_tokens": 90}, ttl_s=3600)
    long_call = await reserve(store, "long", [scope], run_id="run4")
    assert isinstance(long_call, Reservation)
    await store.client.delete(scope.key)  # its TTL ran out (a renewal now prevents it: below)
    await settle(store, long_call, {"requests": 1, "total_tokens": 30})
    meters = await store.meters(scope.key)
    assert meters["total_tokens"].reserved == 0 and meters["concurrent"].reserved == 0
    assert await _fill(store, scope, "next") == 2  # 30 used + 2 x 30 = the ceiling of 90
    assert (await store.meters(scope.key))["total_tokens"].used == 90


async def test_a_release_never_takes_the_reserve_of_another_life_of_the_key(store: RedisStore) -> None:
    # The key expired under call A and call B reserved into it anew: A's release must not take
    # B's reserve (it did, down to 0: room past the ceiling while B ran).
    scope = Scope(name="run", key="lbp:{team-a}:run:run4", ceilings={"total_tokens": 90}, ttl_s=3600)
    first = await reserve(store, "a", [scope], run_id="run4")
    assert isinstance(first, Reservation)
    await store.client.delete(scope.key)

    async def reserve_total(rid: str, total: int) -> Reservation | Refusal | Tentative:
        return await store.reserve(
            tenant="team-a",
            reservation_id=rid,
            run_id="run4",
            scopes=[scope],
            amounts={**AMOUNTS, "total_tokens": total},
            lease_ms=60_000,
            record="{}",
        )

    second = await reserve_total("b", 20)
    assert isinstance(second, Reservation)
    await settle(store, first, {"requests": 1, "total_tokens": 30})
    assert (await store.meters(scope.key))["total_tokens"].reserved == 20  # B's, still held
    assert isinstance(await reserve_total("c", 60), Refusal)  # 30 used + 20 held + 60 > 90
    await settle(store, second, {"requests": 1, "total_tokens": 20})
    meters = await store.meters(scope.key)
    assert meters["total_tokens"].reserved == 0 and meters["total_tokens"].used == 50


async def test_a_shrink_takes_nothing_from_another_life_of_the_key(store: RedisStore) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:run4", ceilings={"total_tokens": 90}, ttl_s=3600)
    reserved = await reserve(store, "s", [scope], run_id="run4")
    assert isinstance(reserved, Reservation)
    await store.client.delete(scope.key)
    assert await store.shrink(
        tenant="team-a", reservation_id="s", scope_keys=[scope.key], amounts={**AMOUNTS, "total_tokens": 10}
    )
    assert (await store.meters(scope.key))["total_tokens"].reserved == 0  # not below zero
    other = await reserve(store, "o", [scope], run_id="run4")  # the key's next life: 30 held
    assert isinstance(other, Reservation)
    assert await store.shrink(
        tenant="team-a", reservation_id="s", scope_keys=[scope.key], amounts={**AMOUNTS, "total_tokens": 0}
    )
    assert (await store.meters(scope.key))["total_tokens"].reserved == 30  # the other call's, kept


async def test_a_reaper_settling_after_the_key_expired_leaves_no_negative_reserve_and_a_ttl(
    store: RedisStore,
) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:run4", ceilings={"total_tokens": 90}, ttl_s=3600)
    orphan = await reserve(store, "orphan", [scope], lease_ms=1, run_id="run4", record='{"run_id": "run4"}')
    assert isinstance(orphan, Reservation)
    await store.client.delete(scope.key)
    await store.register_tenant("team-a")
    await asyncio.sleep(0.01)
    assert len(await reap_tenant(store, "team-a")) == 1
    assert (await store.meters(scope.key))["total_tokens"].reserved == 0
    assert 3500 < await store.client.ttl(scope.key) <= 3600  # written anew, it still expires
    assert await _fill(store, scope, "next") == 2


async def test_a_renewal_keeps_the_scope_keys_of_a_live_call(store: RedisStore) -> None:
    # A stream longer than its run's TTL: each renewal gives the scope keys their TTL again, so
    # the key never expires under the reserve it holds.
    scope = Scope(name="run", key="lbp:{team-a}:run:run4", ceilings={"total_tokens": 90}, ttl_s=3600)
    reserved = await reserve(store, "live", [scope], run_id="run4")
    assert isinstance(reserved, Reservation)
    await store.client.expire(scope.key, 5)  # late in its life
    assert await store.renew(tenant="team-a", reservation_id="live", lease_ms=60_000, scopes=[scope])
    assert 3500 < await store.client.ttl(scope.key) <= 3600
    assert (await store.meters(scope.key))["total_tokens"].reserved == 30


async def test_a_refusal_that_writes_a_key_first_gives_it_its_ttl(store: RedisStore) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:run5", ceilings={"total_tokens": 10}, ttl_s=3600)
    refused = await reserve(store, "no", [scope], run_id="run5")
    assert isinstance(refused, Refusal)
    assert 3500 < await store.client.ttl(scope.key) <= 3600  # was -1: a key kept for ever


async def test_a_record_written_before_born_stamps_still_releases(store: RedisStore) -> None:
    # Reserved by an older version (no 'born' in its record): released as before, never below 0.
    scope = Scope(name="run", key="lbp:{team-a}:run:run6", ceilings={"total_tokens": 90}, ttl_s=3600)
    reserved = await reserve(store, "old", [scope], run_id="run6")
    assert isinstance(reserved, Reservation)
    await store.client.hdel("lbp:{team-a}:resv:old", "born")
    await settle(store, reserved)
    meters = await store.meters(scope.key)
    assert meters["total_tokens"].reserved == 0 and meters["concurrent"].reserved == 0


async def _settle_with_ttls(store: RedisStore, res: Reservation, ttl_s: int) -> None:
    await store.settle(
        tenant="team-a",
        reservation_id=res.id,
        run_id=res.run_id,
        scope_keys=[s.key for s in res.scopes],
        actual={"requests": 1},
        entry={"a": "b"},
        scope_ttls_s=[ttl_s],
        runlog_ttl_s=ttl_s,
    )


async def test_runs_kept_for_ever_after_a_reload_lose_the_ttl_an_earlier_setting_gave_them(
    store: RedisStore,
) -> None:
    # run_ttl_s reloaded from 3600 to 0 ("kept for ever"): the next call's reserve and settle
    # end the TTL the old setting gave the run's keys, or the run would expire and its ceiling
    # be spent again. A call reserved under the old setting and settled after does not bring
    # the TTL back.
    old = Scope(name="run", key="lbp:{team-a}:run:kept", ttl_s=3600)
    new = Scope(name="run", key=old.key, ttl_s=0)
    before = await reserve(store, "before", [old], run_id="kept")
    straddling = await reserve(store, "straddling", [old], run_id="kept")
    assert isinstance(before, Reservation) and isinstance(straddling, Reservation)
    await _settle_with_ttls(store, before, 3600)
    assert await store.client.ttl("lbp:{team-a}:runlog:kept") > 0
    after = await reserve(store, "after", [new], run_id="kept")
    assert isinstance(after, Reservation)
    assert await store.client.ttl(old.key) == -1
    await _settle_with_ttls(store, after, 0)
    await _settle_with_ttls(store, straddling, 3600)
    for key in (old.key, "lbp:{team-a}:runlog:kept"):
        assert await store.client.ttl(key) == -1, key


async def test_a_settle_under_an_older_shorter_setting_does_not_shorten_a_run(store: RedisStore) -> None:
    old = Scope(name="run", key="lbp:{team-a}:run:longer", ttl_s=3600)
    new = Scope(name="run", key=old.key, ttl_s=86400)
    straddling = await reserve(store, "straddling", [old], run_id="longer")
    after = await reserve(store, "after", [new], run_id="longer")
    assert isinstance(straddling, Reservation) and isinstance(after, Reservation)
    await _settle_with_ttls(store, after, 86400)
    await _settle_with_ttls(store, straddling, 3600)
    assert await store.renew(tenant="team-a", reservation_id="gone", lease_ms=1000, scopes=[old]) is False
    for key in (old.key, "lbp:{team-a}:runlog:longer"):
        assert 86000 < await store.client.ttl(key) <= 86400, key


async def test_a_runs_ledger_index_lives_as_long_as_its_meters(store: RedisStore) -> None:
    # Kept for ever under run_ttl_s 0, then the setting is N again: the index follows the run's
    # meters (it kept no TTL for ever, a leak that listed an expired run's earlier life).
    run = Scope(name="run", key="lbp:{team-a}:run:follows", ttl_s=0)
    first = await reserve(store, "under-0", [run], run_id="follows")
    assert isinstance(first, Reservation)
    await _settle_with_ttls(store, first, 0)
    assert await store.client.ttl("lbp:{team-a}:runlog:follows") == -1
    for rid in ("under-n", "under-n-again"):
        reserved = await reserve(store, rid, [Scope(name="run", key=run.key, ttl_s=3600)], run_id="follows")
        assert isinstance(reserved, Reservation)
        await _settle_with_ttls(store, reserved, 3600)
    meters_ms = await store.client.pttl(run.key)
    assert 0 < meters_ms <= 3_600_000
    assert abs(await store.client.pttl("lbp:{team-a}:runlog:follows") - meters_ms) < 1000


ZERO = dict.fromkeys(ACTUAL_METERS, 0)


async def test_zero_settle_of_a_lost_reservation_leaves_the_run_index_for_good(store: RedisStore) -> None:
    # A live settle of a call whose reservation a failover lost (bill_if_lost), the upstream having
    # refused the connection (source "none": every actual 0): the run's key is never written.
    run = Scope(name="run", key="lbp:{team-a}:run:lost", ttl_s=3600)
    entry_id = await store.settle(
        tenant="team-a",
        reservation_id="r-lost",
        run_id="lost",
        scope_keys=[run.key],
        actual=ZERO,
        entry={"outcome": "upstream_error"},
        bill_if_lost=True,
        scope_ttls_s=[3600],
        runlog_ttl_s=3600,
    )
    assert entry_id is not None
    assert await store.client.exists(run.key) == 0
    ttl = await store.client.ttl("lbp:{team-a}:runlog:lost")
    assert 0 < ttl <= 3600, ttl  # -1: kept for ever


async def test_zero_release_after_the_run_key_expired_leaves_the_run_index_for_good(
    store: RedisStore,
) -> None:
    # release_unforwarded's journaled zero settlement, replayed after the run's key expired.
    run = Scope(name="run", key="lbp:{team-a}:run:late", ttl_s=3600)
    res = await reserve(store, "r-late", [run], run_id="late")
    assert isinstance(res, Reservation)
    await store.client.delete(run.key)  # expired
    await store.settle(
        tenant="team-a",
        reservation_id="r-late",
        run_id="late",
        scope_keys=[run.key],
        actual=ZERO,
        entry={"outcome": "not_forwarded"},
        runlog_ttl_s=3600,
    )
    ttl = await store.client.ttl("lbp:{team-a}:runlog:late")
    assert 0 < ttl <= 3600, ttl


async def test_a_reserve_and_a_renewal_keep_the_runs_ledger_index_as_long_as_its_meters(
    store: RedisStore,
) -> None:
    # A call reserved late in the run's life (or a stream longer than it) outlived the index's old
    # TTL: the index expired mid-call and the run's earlier entries left its ledger view.
    run = Scope(name="run", key="lbp:{team-a}:run:late-call", ttl_s=3600)
    index = "lbp:{team-a}:runlog:late-call"
    first = await reserve(store, "first", [run], run_id="late-call")
    assert isinstance(first, Reservation)
    await _settle_with_ttls(store, first, 3600)
    for key in (run.key, index):
        await store.client.pexpire(key, 1000)  # the run idle for nearly its TTL
    late = await reserve(store, "late", [run], run_id="late-call")
    assert isinstance(late, Reservation)
    assert await store.client.ttl(index) > 3500
    await store.client.pexpire(index, 1000)
    assert await store.renew(tenant="team-a", reservation_id="late", lease_ms=60_000, scopes=[run])
    assert await store.client.ttl(index) > 3500


async def test_a_refusal_that_keeps_a_spent_run_alive_keeps_its_ledger_index_too(store: RedisStore) -> None:
    # An agent retrying on a spent run: each refusal renewed the run's meters but not its index,
    # and the run's ledger view came back empty while its meters still showed the spend.
    run = Scope(name="run", key="lbp:{team-a}:run:spent", ceilings={"requests": 1}, ttl_s=3600)
    index = "lbp:{team-a}:runlog:spent"
    first = await reserve(store, "first", [run], run_id="spent")
    assert isinstance(first, Reservation)
    await _settle_with_ttls(store, first, 3600)
    for key in (run.key, index):
        await store.client.pexpire(key, 1000)
    assert isinstance(await reserve(store, "again", [run], run_id="spent"), Refusal)
    assert await store.client.ttl(index) > 3500


async def test_a_quick_reserve_refused_on_calls_waits_for_the_windows_the_exact_count_meets(
    store: RedisStore,
) -> None:
    # The byte-length bound passes a month's token ceiling that the exact count fits: the month
    # is not a window the call waits for (a retry-after of a month for a minute's refusal).
    minute = Scope(name="key:minute", key="lbp:{team-a}:key:k:minute:x", ceilings={"requests": 1}, ttl_s=600)
    month = Scope(
        name="tenant:month", key="lbp:{team-a}:tenant:month:x", ceilings={"input_tokens": 15}, ttl_s=600
    )
    assert isinstance(await reserve(store, "fills-the-minute", [minute, month]), Reservation)
    quick = {**AMOUNTS, "input_tokens": 40, "total_tokens": 60}
    found = await store.reserve(
        tenant="team-a",
        reservation_id="quick",
        run_id="run1",
        scopes=[minute, month],
        amounts=quick,
        lease_ms=60_000,
        record="{}",
        tentative=True,
    )
    assert isinstance(found, Tentative)  # counted exactly first: the final reserve decides
    exact = await reserve(store, "quick", [minute, month])
    assert isinstance(exact, Refusal) and exact.waits_on == (minute,)


# -- the sizes of contexts a provider keeps (Responses API) ----------------------------------


async def test_a_context_size_is_kept_per_tenant_and_the_largest_is_read(store: RedisStore) -> None:
    assert await store.prior_context_tokens(tenant="t", ids=["resp_a"]) is None
    await store.remember_context(tenant="t", ids=["resp_a", "conv_b"], tokens=120, ttl_s=60)
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=300, ttl_s=60)
    assert await store.prior_context_tokens(tenant="t", ids=["resp_a", "conv_b"]) == 300
    assert await store.prior_context_tokens(tenant="t", ids=["resp_a"]) == 120
    assert await store.prior_context_tokens(tenant="other", ids=["resp_a"]) is None
    # A stored prompt's template, read beside the one context continued: added to it.
    assert await store.prior_context_tokens(tenant="t", ids=["resp_a", "conv_b"], added=["resp_a"]) == 420
    assert await store.prior_context_tokens(tenant="t", ids=[], added=["resp_a"]) == 120
    assert await store.prior_context_tokens(tenant="t", ids=["nowhere"], added=["nor_here"]) is None


async def test_a_kept_size_is_never_lowered_by_its_kind_and_garbage_is_replaced(store: RedisStore) -> None:
    c = store.client
    await c.script_flush()  # loaded again on NOSCRIPT
    await store.remember_context(tenant="t", ids=["resp_a", "conv_b"], tokens=120, ttl_s=60)
    assert await c.get("lbp:{t}:ctx:conv_b") == "120"
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=50, ttl_s=600)
    assert await c.get("lbp:{t}:ctx:conv_b") == "120"  # not lowered
    assert await c.ttl("lbp:{t}:ctx:conv_b") > 60  # its life extended
    await c.set("lbp:{t}:ctx:conv_c", "garbage")
    await store.remember_context(tenant="t", ids=["conv_c"], tokens=7, ttl_s=60)
    assert await c.get("lbp:{t}:ctx:conv_c") == "7"
    assert await store.prior_context_tokens(tenant="t", ids=["resp_a", "conv_b"]) == 120


async def test_a_ttl_of_0_keeps_nothing_and_deletes_nothing(store: RedisStore) -> None:
    # EXPIRE 0 deleted a kept size; SET EX 0 failed the script half-way through its keys.
    c = store.client
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=120, ttl_s=60)
    await store.remember_context(tenant="t", ids=["conv_b", "conv_c"], tokens=50, ttl_s=0)
    assert await c.get("lbp:{t}:ctx:conv_b") == "120"
    assert await c.exists("lbp:{t}:ctx:conv_c") == 0


async def test_a_bound_gives_way_to_the_next_real_size(store: RedisStore) -> None:
    # A cut call's reserve (output at the model's cap) stayed on its conversation for as long as
    # it was used: every later, real size was smaller, and a size was never lowered.
    c = store.client
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=100, ttl_s=60)
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=16_000, ttl_s=60, bound=True)
    assert await store.prior_context_tokens(tenant="t", ids=["conv_b"]) == 16_000
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=15_000, ttl_s=60, bound=True)
    assert await store.prior_context_tokens(tenant="t", ids=["conv_b"]) == 16_000  # the larger bound
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=180, ttl_s=60)
    assert await c.get("lbp:{t}:ctx:conv_b") == "180"  # a real size replaces a bound
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=90, ttl_s=60, bound=True)
    assert await c.get("lbp:{t}:ctx:conv_b") == "180"  # a smaller bound never lowers a real size


async def test_a_bound_is_not_replaced_by_an_older_calls_figures(store: RedisStore) -> None:
    # A stream (100) continued at its response.completed by a call that was cut (its bound, on
    # top of the 100 it continued); the stream's settle, ending late, wrote 100 over the bound:
    # the next call on the conversation was reserved without the cut call's turn.
    c = store.client
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=100, ttl_s=60)
    cut = {"tokens": 16_100, "bound": True, "base_tokens": 100}
    await store.remember_context(tenant="t", ids=["conv_b"], ttl_s=60, **cut)
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=100, ttl_s=60)
    assert await store.prior_context_tokens(tenant="t", ids=["conv_b"]) == 16_100
    # The next call's, which continued the bound it read (16,100: its prior context):
    await store.remember_context(tenant="t", ids=["conv_b"], tokens=1_200, ttl_s=60, base_tokens=16_100)
    assert await c.get("lbp:{t}:ctx:conv_b") == "1200"


async def test_a_size_that_is_not_digits_is_read_as_unknown_and_replaced(store: RedisStore) -> None:
    c = store.client
    for junk in ("1e9", "inf", "0x10", "12.5", "\u00b2", "7~~"):
        await c.set("lbp:{t}:ctx:conv_j", junk)
        assert await store.prior_context_tokens(tenant="t", ids=["conv_j"]) is None
        await store.remember_context(tenant="t", ids=["conv_j"], tokens=7, ttl_s=60)
        assert await c.get("lbp:{t}:ctx:conv_j") == "7", junk


BUSY_3_S = busy_script(3)


async def test_a_call_whose_settle_reply_came_late_is_told_what_the_ledger_holds(
    cluster: RedisClusterProcesses, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """End to end: a Redis Cluster node busy for a moment while a call settles. The call is
    billed once, 'ok', on the provider's figures; the client must be told that, not
    'lease_expired' at its reserve (nothing expired: no reaper ran)."""
    flusher = RedisStore.from_url(cluster.url, cluster=True)
    await flusher.client.flushall()
    await flusher.close()
    proxy = await make_proxy(redis={"url": cluster.url, "cluster": True, "socket_timeout_s": 0.3})
    blocker = RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        await blocker.initialize()
        node = blocker.get_node_from_key("lbp:{team-a}:ledger")
        call = asyncio.create_task(
            proxy.client().chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=10,
                extra_headers={"X-Run-Id": "late-reply"},
                extra_body={"fake": {"hold": True}},
            )
        )
        while not fake.received and not call.done():
            await asyncio.sleep(0.01)
        if call.done():
            call.result()
        await until_upstream_received(fake, 1)  # reserved, in flight
        hold = asyncio.create_task(blocker.eval(BUSY_3_S, 1, "lbp:{team-a}:busy"))
        await until_redis_busy(node.port)
        # Answered only once the node is busy: after a fixed delay the settle could come first on
        # a loaded machine, its reply in time, and nothing sent again.
        fake.release()
        response = await call
        await hold
        ledger = await blocker.xrange("lbp:{team-a}:ledger")
        assert [fields["outcome"] for _, fields in ledger] == ["ok"]  # billed once, as it was
        assert response.headers["x-billing-outcome"] == ledger[0][1]["outcome"]
        assert response.headers["x-billing-cost-micros"] == ledger[0][1]["cost_micros"]
        assert response.headers["x-billing-input-tokens"] == ledger[0][1]["input_tokens"]
    finally:
        await blocker.aclose()


# -- eviction ---------------------------------------------------------------------------------

EVICTING = ("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")


async def test_eviction_is_read_from_every_primary(store: RedisStore) -> None:
    assert await store.eviction() == Eviction("noeviction", 0)
    assert not (await store.eviction()).drops_keys
    client = store.client
    # On a Cluster, a primary other than the one keyless commands go to.
    where: dict[str, Any] = {}
    if isinstance(client, RedisCluster):
        where = {"target_nodes": next(n for n in client.get_primaries() if n != client.get_default_node())}
    await client.execute_command(
        "CONFIG SET", "maxmemory-policy", "volatile-lru", "maxmemory", "100mb", **where
    )
    try:
        found = await store.eviction()
    finally:
        await client.execute_command(
            "CONFIG SET", "maxmemory-policy", "noeviction", "maxmemory", "0", **where
        )
    assert found == Eviction("volatile-lru", 100 * 1024 * 1024) and found.drops_keys


async def test_eviction_is_read_from_info_where_config_is_renamed(tmp_path: Path) -> None:
    server = RedisServerProcess(
        tmp_path / "redis", port=free_port(), extra_args=(*EVICTING, "--rename-command", "CONFIG", "")
    )
    server.start()
    store = RedisStore.from_url(server.url)
    try:
        with pytest.raises(ResponseError):  # as a managed Redis answers it
            await store.client.config_get("maxmemory-policy")
        assert await store.eviction() == Eviction("allkeys-lru", 100 * 1024 * 1024)
    finally:
        await store.close()
        server.stop()


async def test_eviction_not_told_cannot_rule_out_dropped_keys(tmp_path: Path) -> None:
    server = RedisServerProcess(tmp_path / "redis", port=free_port())
    server.start()
    admin = RedisStore.from_url(server.url)
    await admin.client.acl_setuser("proxy", enabled=True, passwords=["+pw"], keys=["*"], commands=[
        "+@all", "-config", "-info"
    ])  # fmt: skip
    store = RedisStore.from_url(f"redis://proxy:pw@127.0.0.1:{server.port}/0")
    try:
        with pytest.raises(NoPermissionError):
            await store.client.info("memory")
        found = await store.eviction()
    finally:
        await store.close()
        await admin.close()
        server.stop()
    assert found == Eviction(None) and found.drops_keys


async def test_an_older_calls_figure_ending_late_does_not_replace_a_cut_calls_bound(
    store: RedisStore,
) -> None:
    """A bound gives way to a later call's figures, which hold what the cut call added, not to
    an older call's ending late: told apart by size alone, an older call (it continued the
    conversation at 500) whose figure passed the 1,000 the cut call continued replaced the
    bound, though it held nothing of what the cut call added (the prior context hunt)."""
    tenant = "t"
    await store.remember_context(tenant=tenant, ids=["conv_late"], tokens=1000, ttl_s=60)
    # A call continuing it at 1,000 is cut: kept at its reserve (up to 4,000 more), a bound.
    await store.remember_context(
        tenant=tenant, ids=["conv_late"], tokens=5000, ttl_s=60, bound=True, base_tokens=1000
    )
    # An older call, which continued the conversation at 500, ends late at 1,100.
    await store.remember_context(tenant=tenant, ids=["conv_late"], tokens=1100, ttl_s=60, base_tokens=500)
    assert await store.prior_context_tokens(tenant=tenant, ids=["conv_late"]) == 5000
    # A later call's, which continued what the cut call continued or more, does.
    await store.remember_context(tenant=tenant, ids=["conv_late"], tokens=1300, ttl_s=60, base_tokens=1000)
    assert await store.prior_context_tokens(tenant=tenant, ids=["conv_late"]) == 1300


DAY_S = 24 * 3600


async def _old_and_recent_entries(client: Any, run_id: str = "run1") -> tuple[list[str], list[str]]:
    """Team-a's ledger with 1,000 entries three days old by the store's clock, then 10 an hour
    old, all of run ``run_id``: approximate trimming (``MINID ~``) removes whole stream nodes
    (at most 100 entries each), so the old ones fill several."""
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    written: list[list[str]] = []
    for at_ms, count in ((now_ms - 3 * DAY_S * 1000, 1000), (now_ms - 3600 * 1000, 10)):
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            pipe.xadd("lbp:{team-a}:ledger", {"request_id": f"r{at_ms}-{i}"}, id=f"{at_ms}-{i}")
        ids = list(await pipe.execute())
        await client.rpush(f"lbp:{{team-a}}:runlog:{run_id}", *ids)
        written.append(ids)
    return written[0], written[1]


@pytest.mark.parametrize("retention_s", [DAY_S, 0])
async def test_a_settle_trims_the_ledger_of_entries_older_than_the_retention(
    redis_server: RedisServerProcess, redis_client: Any, retention_s: int
) -> None:
    """Each configured tenant's ledger kept every entry for good (about 260 bytes of Redis a
    call): with limits.ledger_retention_s, a settle's XADD trims those older than it, by the
    store's clock, and keeps the recent ones; 0 keeps them all. The run's index still names the
    trimmed ones: a read of the run skips them."""
    store = RedisStore.from_url(redis_server.url, ledger_retention_s=retention_s)
    run = Scope(name="run", key="lbp:{team-a}:run:run1")

    async def own_settle(res: Reservation) -> str | None:
        return await store.settle(
            tenant="team-a",
            reservation_id=res.id,
            run_id="run1",
            scope_keys=[run.key],
            actual=ACTUAL,
            entry={"request_id": res.id, "outcome": "ok"},
            bill_if_lost=True,
            own=True,
        )

    try:
        old, recent = await _old_and_recent_entries(redis_client)
        res = await reserve(store, "trim", [run])
        assert isinstance(res, Reservation)
        new = await own_settle(res)
        assert new is not None
        ids = [i for i, _ in await redis_client.xrange("lbp:{team-a}:ledger")]
        kept_old = [i for i in ids if i in set(old)]
        if retention_s:
            assert len(kept_old) < 100, len(kept_old)  # at most the node the recent ones start in
        else:
            assert kept_old == old
        assert ids == [*kept_old, *recent, new]
        entries = await store.run_ledger(tenant="team-a", run_id="run1")
        assert [entry["id"] for entry in entries] == ids
        # The call's own settle sent again after its entry was trimmed gets that id, no error.
        await redis_client.xtrim("lbp:{team-a}:ledger", maxlen=0)
        assert await own_settle(res) == new
        assert await store.run_ledger(tenant="team-a", run_id="run1") == []
    finally:
        await store.close()


async def test_a_reapers_settle_trims_the_ledger_as_a_calls_does(
    redis_server: RedisServerProcess, redis_client: Any
) -> None:
    """The retention is the store's, set at start: a reaper's settle (and a journal's replay,
    which goes through the same ``Store.settle``) trims as the call's own would have."""
    store = RedisStore.from_url(redis_server.url, ledger_retention_s=DAY_S)
    try:
        old, recent = await _old_and_recent_entries(redis_client, "run2")
        run = Scope(name="run", key="lbp:{team-a}:run:run2")
        await reserve(store, "reaped", [run], lease_ms=1, run_id="run2")
        await store.register_tenant("team-a")
        await asyncio.sleep(0.01)
        assert len(await reap_tenant(store, "team-a")) == 1
        ids = [i for i, _ in await redis_client.xrange("lbp:{team-a}:ledger")]
        assert len(set(ids) & set(old)) < 100 and ids[-11:-1] == recent
    finally:
        await store.close()


async def test_a_refusal_taken_back_on_a_store_that_cannot_be_reached_is_a_store_error() -> None:
    # ``reserve`` logs a StoreError and goes on planning the call again; anything else is a 500.
    store = RedisStore.from_url(f"redis://127.0.0.1:{refused_port()}/0")
    refusal = Refusal(
        scope=Scope(name="run", key="lbp:{team-a}:run:r1"),
        meter="requests",
        ceiling=1,
        used=1,
        reserved=0,
        amount=1,
    )
    try:
        with pytest.raises(StoreError):
            await store.uncount_refusal(refusal)
    finally:
        await store.close()
