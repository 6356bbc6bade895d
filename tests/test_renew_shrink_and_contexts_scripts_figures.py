"""The figures of renew.lua, shrink.lua, context.lua, expired.lua and owner.lua, pinned where a
hunt of hand mutants of them (and of their callers' arguments) found them unwatched: the lease
a renewal leaves, the lives it gives a call's scope keys and its run's ledger index, what a
shrink holds and releases, how a kept context's size and life change, which leases a reaper is
handed, and how long a context stays its tenant's."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
import redis.asyncio as aioredis

from proxy.redis_contexts import CONTEXT_OWNER_TTL_S
from proxy.redis_store import RedisStore
from proxy.store import Reservation, Scope
from tests.conftest import ProxyFactory, slow_stream, until_upstream_received, upstream_timing_out
from tests.fake_upstream import FakeUpstream
from tests.test_redis_store import AMOUNTS, reserve
from tests.test_redis_store_figures import held

TENANT = "team-a"
LEASES = "lbp:{team-a}:leases"


async def store_now_ms(redis_client: aioredis.Redis) -> int:
    """The store's clock, the one the scripts count leases on."""
    secs, micros = await redis_client.time()
    return int(secs) * 1000 + int(micros) // 1000


def nonzero(amounts: Mapping[str, int]) -> dict[str, int]:
    """The reserve a scope holds of ``amounts``: a meter reserved nothing is not written."""
    return {meter: amount for meter, amount in amounts.items() if amount}


# ---- renew.lua: the lease ----


async def test_a_renewal_leases_the_call_for_its_lease_from_now(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # From now, not from the lease it replaces (a stream renewing every third of its lease would
    # push its expiry further out each time), and in ms: a lease 1000 times longer leaves a dead
    # instance's reserve held for days before a reaper bills it.
    run = Scope(name="run", key="lbp:{team-a}:run:lease")
    assert isinstance(await reserve(store, "l1", [run], lease_ms=60_000, run_id="lease"), Reservation)
    before = await store_now_ms(redis_client)
    assert await store.renew(tenant=TENANT, reservation_id="l1", lease_ms=600_000, scopes=[run])
    after = await store_now_ms(redis_client)
    expiry = await redis_client.zscore(LEASES, "l1")
    assert expiry is not None and before + 600_000 <= expiry <= after + 600_000


async def test_a_renewal_of_a_reservation_whose_record_is_gone_extends_nothing(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # A record lost (evicted, a failover) while its lease stays in the index: no renewal may
    # confirm it as live; the reaper's read drops it from the index (lease.lua).
    run = Scope(name="run", key="lbp:{team-a}:run:lost-record")
    assert isinstance(await reserve(store, "gone", [run], run_id="lost-record"), Reservation)
    expiry = await redis_client.zscore(LEASES, "gone")
    await redis_client.delete("lbp:{team-a}:resv:gone")
    assert not await store.renew(tenant=TENANT, reservation_id="gone", lease_ms=3_600_000, scopes=[run])
    assert await redis_client.zscore(LEASES, "gone") == expiry


async def test_a_streams_renewal_leases_it_anew_and_gives_its_run_key_its_ttl_again(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # What lease.py asks of renew.lua: the call's whole lease (3.5 s here) from the renewal on,
    # not less, and its scopes, so a run key late in its life (a stream longer than what the run
    # had left) keeps the reserve it holds.
    proxy = await make_proxy(
        redis={"socket_timeout_s": 2},  # below two thirds of the lease
        upstreams=upstream_timing_out(fake.base_url, 3),
        limits={"lease_margin_s": 0.5, "reaper_interval_s": 60},
    )
    body, headers = slow_stream("renewed", chunks=30, delay_s=0.1)
    run_key = "lbp:{team-a}:run:renewed"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        await until_upstream_received(fake, 1)
        await redis_client.expire(run_key, 100)
        # The first renewal comes a third of the lease (about 1.2 s) after the reserve.
        deadline = asyncio.get_running_loop().time() + 3
        while await redis_client.ttl(run_key) <= 100:
            assert asyncio.get_running_loop().time() < deadline, "no renewal gave the run key its TTL"
            await asyncio.sleep(0.02)
        leased = await redis_client.zrange(LEASES, 0, -1)
        assert len(leased) == 1, "the stream ended before its first renewal"
        reservation_id = str(leased[0])
        expiry = await redis_client.zscore(LEASES, reservation_id)
        now_ms = await store_now_ms(redis_client)
        await resp.read()
    assert expiry is not None and 2500 < expiry - now_ms <= 3500
    assert await redis_client.ttl(run_key) > 7 * 86_400 - 100  # run_ttl_s's default, a week


# ---- renew.lua: the lives of the scope keys and of the run's ledger index ----


async def test_a_renewal_ends_the_ttl_of_a_scope_key_its_setting_keeps_for_ever(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # run_ttl_s reloaded to 0 while a stream ran on a run kept under the old TTL: the stream's
    # renewals keep the run for ever, as its reserve and settle do, or it expires and its ceiling
    # can be spent again.
    run = Scope(name="run", key="lbp:{team-a}:run:for-ever", ttl_s=0)
    assert isinstance(await reserve(store, "fe", [run], run_id="for-ever"), Reservation)
    await redis_client.expire(run.key, 100)
    # The index as an earlier call's settle left it under the old TTL.
    await redis_client.rpush("lbp:{team-a}:runlog:for-ever", "1-0")
    await redis_client.expire("lbp:{team-a}:runlog:for-ever", 100)
    assert await store.renew(tenant=TENANT, reservation_id="fe", lease_ms=60_000, scopes=[run])
    assert await redis_client.ttl(run.key) == -1
    # The ledger index follows its run's meters: kept for ever too.
    assert await redis_client.ttl("lbp:{team-a}:runlog:for-ever") == -1


async def test_a_renewal_gives_a_scope_key_with_a_fraction_of_its_ttl_left_its_whole_ttl(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # The TTL left is in ms, the setting in s: a key with 1000 of its 3600 s left is renewed.
    run = Scope(name="run", key="lbp:{team-a}:run:part-left", ttl_s=3600)
    assert isinstance(await reserve(store, "pl", [run], run_id="part-left"), Reservation)
    await redis_client.expire(run.key, 1000)
    assert await store.renew(tenant=TENANT, reservation_id="pl", lease_ms=60_000, scopes=[run])
    assert 3500 < await redis_client.ttl(run.key) <= 3600


async def test_a_renewal_gives_the_runs_ledger_index_exactly_its_meters_life(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # Not longer: a PTTL in ms given as seconds kept an expired run's index for weeks, listing
    # its earlier life with the next one.
    index = "lbp:{team-a}:runlog:follow"
    run = Scope(name="run", key="lbp:{team-a}:run:follow", ttl_s=3600)
    assert isinstance(await reserve(store, "f1", [run], run_id="follow"), Reservation)
    await redis_client.rpush(index, "1-0")  # an earlier call's entry
    await redis_client.expire(index, 60)
    assert await store.renew(tenant=TENANT, reservation_id="f1", lease_ms=60_000, scopes=[run])
    meters_ms = await redis_client.pttl(run.key)
    assert 3_500_000 < meters_ms <= 3_600_000
    assert abs(await redis_client.pttl(index) - meters_ms) < 1000


# ---- shrink.lua ----


async def test_a_shrink_by_one_token_releases_that_token(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:by-one", ceilings={"total_tokens": 100})
    assert isinstance(await reserve(store, "b1", [run], run_id="by-one"), Reservation)
    lower = {**AMOUNTS, "input_tokens": 9, "total_tokens": 29}
    assert await store.shrink(tenant=TENANT, reservation_id="b1", scope_keys=[run.key], amounts=lower)
    assert await held(redis_client, run.key) == nonzero(lower)


async def test_a_lowered_reserve_is_what_a_reaper_bills(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # The record's amounts are lowered with the scopes': a reaper billing the call at its reserve
    # bills the exact count, and releases exactly what the scopes still hold.
    run = Scope(name="run", key="lbp:{team-a}:run:reaped-low", ceilings={"total_tokens": 100})
    assert isinstance(await reserve(store, "rl", [run], run_id="reaped-low"), Reservation)
    lower = {**AMOUNTS, "input_tokens": 4, "total_tokens": 24}
    assert await store.shrink(tenant=TENANT, reservation_id="rl", scope_keys=[run.key], amounts=lower)
    await redis_client.zadd(LEASES, {"rl": 0})  # its instance died: the lease ran out long ago
    (lease,) = await store.expired_leases(tenant=TENANT, limit=10)
    assert lease.amounts == lower


async def test_a_shrink_of_a_reservation_whose_record_is_gone_lowers_nothing(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # Told apart from a store failure: nothing to lower, as for a call settled meanwhile.
    run = Scope(name="run", key="lbp:{team-a}:run:no-record", ceilings={"total_tokens": 100})
    assert isinstance(await reserve(store, "nr", [run], run_id="no-record"), Reservation)
    await redis_client.delete("lbp:{team-a}:resv:nr")
    lower = {**AMOUNTS, "input_tokens": 4, "total_tokens": 24}
    assert not await store.shrink(tenant=TENANT, reservation_id="nr", scope_keys=[run.key], amounts=lower)
    assert await held(redis_client, run.key) == nonzero(AMOUNTS)


async def test_a_shrink_to_a_negative_amount_changes_nothing(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:negative", ceilings={"total_tokens": 100})
    assert isinstance(await reserve(store, "n1", [run], run_id="negative"), Reservation)
    below = {**AMOUNTS, "input_tokens": -1, "total_tokens": 19}
    assert not await store.shrink(tenant=TENANT, reservation_id="n1", scope_keys=[run.key], amounts=below)
    assert await held(redis_client, run.key) == nonzero(AMOUNTS)


async def test_a_record_written_before_born_stamps_is_lowered_and_never_below_zero(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # Reserved by an older version (no 'born' in its record), during a rolling upgrade: its
    # shrink lowers every scope holding its reserve, and one whose key expired meanwhile is left
    # at nothing held, not a negative reserve (room past the ceiling for the next calls).
    run = Scope(name="run", key="lbp:{team-a}:run:unborn", ceilings={"total_tokens": 100})
    month = Scope(name="tenant:month", key="lbp:{team-a}:tenant:month:unborn", ceilings={"total_tokens": 900})
    assert isinstance(await reserve(store, "u1", [run, month], run_id="unborn"), Reservation)
    await redis_client.hdel("lbp:{team-a}:resv:u1", "born")
    await redis_client.delete(month.key)
    lower = {**AMOUNTS, "input_tokens": 4, "total_tokens": 24}
    keys = [run.key, month.key]
    assert await store.shrink(tenant=TENANT, reservation_id="u1", scope_keys=keys, amounts=lower)
    assert await held(redis_client, run.key) == nonzero(lower)
    assert all(v >= 0 for v in (await held(redis_client, month.key)).values())


# ---- context.lua ----


async def test_a_kept_size_lives_as_long_as_the_setting_says_from_its_last_use(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # In seconds: a size kept 600 ms instead of 600 s is gone when the next call continues it,
    # reserved without its context.
    key = "lbp:{team-a}:ctx:resp_life"
    await store.remember_context(tenant=TENANT, ids=["resp_life"], tokens=120, ttl_s=600)
    assert 590 < await redis_client.ttl(key) <= 600
    # prior_context_ttl_s reloaded shorter: the next use keeps the size that long from then,
    # not the longer life the old setting gave it.
    await store.remember_context(tenant=TENANT, ids=["resp_life"], tokens=50, ttl_s=60)
    assert await redis_client.get(key) == "120"
    assert 50 < await redis_client.ttl(key) <= 60


async def test_a_bound_as_large_as_the_real_size_kept_does_not_replace_it(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # A cut call's bound equal to the provider's figure kept: the figure stays, so an older
    # call's smaller figures, ending late, still cannot lower it.
    key = "lbp:{team-a}:ctx:conv_eq"
    await store.remember_context(tenant=TENANT, ids=["conv_eq"], tokens=500, ttl_s=60)
    await store.remember_context(
        tenant=TENANT, ids=["conv_eq"], tokens=500, ttl_s=60, bound=True, base_tokens=100
    )
    assert await redis_client.get(key) == "500"
    await store.remember_context(tenant=TENANT, ids=["conv_eq"], tokens=200, ttl_s=60)
    assert await store.prior_context_tokens(tenant=TENANT, ids=["conv_eq"]) == 500


# ---- expired.lua ----


async def test_a_reaper_is_handed_at_most_the_leases_it_asked_for_oldest_first(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:limit")
    for rid in ("x1", "x2", "x3"):
        assert isinstance(await reserve(store, rid, [run], run_id="limit"), Reservation)
    await redis_client.zadd(LEASES, {"x1": 2, "x2": 1, "x3": 3})  # ran out long ago, x2 first
    assert [lease.id for lease in await store.expired_leases(tenant=TENANT, limit=2)] == ["x2", "x1"]
    # The reaper's probe of a tenant's node during its grace reads no lease.
    assert await store.expired_leases(tenant=TENANT, limit=0) == []


async def test_a_live_lease_is_not_handed_to_a_reaper(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # Counted on the store's clock in ms: a lease with seconds to go is the live call's.
    run = Scope(name="run", key="lbp:{team-a}:run:live")
    assert isinstance(await reserve(store, "live", [run], lease_ms=5_000, run_id="live"), Reservation)
    assert await store.expired_leases(tenant=TENANT, limit=10) == []


# ---- owner.lua ----


async def test_a_context_its_own_tenant_uses_again_is_kept_its_tenants_a_month_from_then(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # A conversation continued for longer than a month stays its tenant's: each of its calls
    # marks it anew, for the provider's retention from then.
    key = "lbp:ctxowner:conv_long"
    await store.claim_contexts(tenant=TENANT, ids=["conv_long"])
    await redis_client.expire(key, 60)  # nearly a month on
    await store.claim_contexts(tenant=TENANT, ids=["conv_long"])
    assert CONTEXT_OWNER_TTL_S - 100 < await redis_client.ttl(key) <= CONTEXT_OWNER_TTL_S
    # Another tenant's call takes nothing from it, its life included.
    await redis_client.expire(key, 60)
    await store.claim_contexts(tenant="team-b", ids=["conv_long"])
    assert await store.context_owners(ids=["conv_long"]) == [TENANT]
    assert await redis_client.ttl(key) <= 60
