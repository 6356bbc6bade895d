"""The Redis store's figures, pinned where a hunt of hand mutants of ``proxy/redis_store.py``,
``proxy/redis_scripts.py``, ``proxy/redis_contexts.py`` and ``proxy/store.py`` found them
unwatched: what the reserve, settle, renew and context scripts are told, what the store reports
back of their replies, and the settings it is built with."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.errors import StoreError, StoreRejected
from proxy.redis_cluster import PIPELINE_CONNECTIONS
from proxy.redis_contexts import OWNERS_A_COMMAND
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.store import Clamp, Eviction, Refusal, Reservation, Scope
from tests.conftest import busy_script, until_redis_busy
from tests.test_redis_store import AMOUNTS, reserve

TENANT = "team-a"


async def settle(store: RedisStore, rid: str, scope_keys: list[str], **kw: Any) -> str | None:
    return await store.settle(
        tenant=TENANT,
        reservation_id=rid,
        run_id=kw.pop("run_id", "run1"),
        scope_keys=scope_keys,
        actual=kw.pop("actual", {"requests": 1, "input_tokens": 8, "output_tokens": 5, "total_tokens": 13}),
        entry={"outcome": "ok"},
        **kw,
    )


async def held(redis_client: aioredis.Redis, key: str) -> dict[str, int]:
    """What a scope holds in reserve, per meter."""
    fields = await redis_client.hgetall(key)
    return {k.removeprefix("resv:"): int(v) for k, v in fields.items() if k.startswith("resv:")}


# ---- the clamp: the amounts the store reports are those Redis holds ----


async def test_a_clamped_cost_is_reported_rounded_up_as_redis_holds_it(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:clamp-cost", ceilings={"output_tokens": 3})
    # 1 + 3 * 1.5 M = 4_500_001 millionths of a micro-unit: 5 micro-units, not 4.
    clamp = Clamp(min_output_tokens=1, choices=1, input_cost_exact=1, output_rate=1_500_000)
    res = await reserve(store, "cc1", [scope], amounts={**AMOUNTS, "cost_micros": 100}, clamp=clamp)
    assert isinstance(res, Reservation) and res.clamped_output_per_choice == 3
    assert res.amounts["cost_micros"] == 5
    assert res.amounts == {**AMOUNTS, "output_tokens": 3, "total_tokens": 13, "cost_micros": 5}
    assert (await held(redis_client, scope.key))["cost_micros"] == 5


async def test_a_clamp_prices_the_output_of_a_call_whose_reserve_named_no_cost(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # A priced output with no cost in the amounts asked for: the script reserves its cost all
    # the same, and the reservation must say so (a call billed at its reserve is billed it).
    scope = Scope(name="run", key="lbp:{team-a}:run:clamp-rate", ceilings={"output_tokens": 4})
    clamp = Clamp(min_output_tokens=1, choices=2, input_cost_exact=0, output_rate=1_000_000)
    res = await reserve(store, "cr1", [scope], clamp=clamp)
    assert isinstance(res, Reservation) and res.clamped_output_per_choice == 2
    assert res.amounts["cost_micros"] == 4 == (await held(redis_client, scope.key))["cost_micros"]


async def test_a_clamp_the_budget_did_not_need_leaves_the_amounts_as_asked(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:clamp-unused", ceilings={"output_tokens": 1000})
    clamp = Clamp(min_output_tokens=1, choices=2, input_cost_exact=10, output_rate=1_000_000)
    asked = {**AMOUNTS, "cost_micros": 21}
    res = await reserve(store, "cu1", [scope], amounts=asked, clamp=clamp)
    assert isinstance(res, Reservation) and res.clamped_output_per_choice == 0
    assert res.amounts == asked
    assert (await held(redis_client, scope.key))["output_tokens"] == 20


# 900,000 input tokens at 999,999,999.999999 per million (the dearest price the config takes):
# the input's cost in millionths of a micro-unit is near 9 * 10^20, where a double is off by
# tens of thousands.
DEAREST_INPUT = 900_000 * 999_999_999_999_999


@pytest.mark.parametrize(
    ("input_cost_exact", "output_rate", "ceiling", "choices", "asked", "per_choice"),
    [
        # 900,000 output tokens at 0.000001 per million fit; in doubles the room came out 17,504
        # tokens larger and every trial below it passed the ceiling: refused, told to retry.
        (DEAREST_INPUT, 1, 900_000_000_000_000, 1, 1_000_000, 900_000),
        (DEAREST_INPUT, 1, 900_000_000_000_000, 2, 1_000_000, 450_000),
        # One token short of the cap asked: 25 + 19 * 3 = 82 micro-units fit, 85 do not.
        (25_000_000, 3_000_000, 82, 1, 20, 19),
        # The same past 2^53 millionths of a micro-unit, where the script's estimate starts one
        # above the quotient: there at the cap asked, which left no lower output to try.
        (0, 1_000_000_000, 10_000_000_000, 1, 10_000_001, 10_000_000),
    ],
    ids=["dearest-input", "dearest-input-two-choices", "one-token-short", "one-token-short-past-2-53"],
)
async def test_a_clamp_lowers_the_output_to_the_most_that_fits_exactly(
    store: RedisStore,
    redis_client: aioredis.Redis,
    input_cost_exact: int,
    output_rate: int,
    ceiling: int,
    choices: int,
    asked: int,
    per_choice: int,
) -> None:
    def cost_micros(output_tokens: int) -> int:
        return -(-(input_cost_exact + output_tokens * output_rate) // 10**6)

    assert cost_micros(per_choice * choices) <= ceiling < cost_micros((per_choice + 1) * choices)
    scope = Scope(name="run", key="lbp:{team-a}:run:clamp-exact", ceilings={"cost_micros": ceiling})
    clamp = Clamp(
        min_output_tokens=1, choices=choices, input_cost_exact=input_cost_exact, output_rate=output_rate
    )
    asked_amounts = {
        **AMOUNTS,
        "output_tokens": asked,
        "total_tokens": 10 + asked,
        "cost_micros": cost_micros(asked),
    }
    res = await reserve(store, "ce1", [scope], amounts=asked_amounts, clamp=clamp)
    assert isinstance(res, Reservation), res
    assert res.clamped_output_per_choice == per_choice
    assert res.amounts["cost_micros"] == cost_micros(per_choice * choices)
    assert (await held(redis_client, scope.key))["cost_micros"] == res.amounts["cost_micros"]


# ---- settings the store is built with ----


async def test_a_settled_marker_is_kept_an_hour_by_default(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    scope = Scope(name="run", key="lbp:{team-a}:run:marker")
    res = await reserve(store, "mk1", [scope])
    assert isinstance(res, Reservation)
    settled = await store.settle(
        tenant=TENANT,
        reservation_id="mk1",
        run_id="run1",
        scope_keys=[scope.key],
        actual={"requests": 1},
        entry={"outcome": "ok"},
    )
    assert settled is not None
    assert 3000 < await redis_client.ttl("lbp:{team-a}:resv:mk1") <= 3600


# ---- what the store reports of the server's settings ----


async def test_either_kind_of_persistence_is_enough_to_keep_the_ledger(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    store = RedisStore.from_url(own_redis.url)
    try:
        await own_client.config_set("appendonly", "no")
        await own_client.config_set("save", "3600 1")
        assert await store.persistence_warning() is None  # RDB alone
        await own_client.config_set("save", "")
        assert "keeps nothing on disk" in str(await store.persistence_warning())
        await own_client.config_set("appendonly", "yes")
        assert await store.persistence_warning() is None  # AOF alone
    finally:
        await store.close()
        # As it was: a server told to save stops slowly (it saves first).
        await own_client.config_set("appendonly", "no")


def test_eviction_drops_keys_only_under_a_dropping_policy_with_a_memory_limit() -> None:
    assert not Eviction("allkeys-lru", 0).drops_keys  # no maxmemory: nothing is ever evicted
    assert not Eviction("noeviction", 1 << 30).drops_keys
    assert Eviction("volatile-lru", 1).drops_keys
    assert Eviction(None).drops_keys


# ---- what a reserve reports back ----


async def test_a_reserve_reports_each_limited_meters_room_and_ceiling(store: RedisStore) -> None:
    limited = Scope(
        name="key:minute",
        key="lbp:{team-a}:key:a-ci:minute:tight",
        ceilings={"total_tokens": 100, "concurrent": 2},
    )
    res = await reserve(store, "t1", [Scope(name="run", key="lbp:{team-a}:run:tight"), limited])
    assert isinstance(res, Reservation)
    # This call aside: all 100 tokens and both slots (the run limits nothing).
    assert res.rooms == (("total_tokens", 100, 100), ("concurrent", 2, 2))
    again = await reserve(store, "t3", [Scope(name="run", key="lbp:{team-a}:run:tight"), limited])
    assert isinstance(again, Reservation)
    assert again.rooms == (("total_tokens", 70, 100), ("concurrent", 1, 2))  # t1's 30 and slot held
    free = await reserve(store, "t2", [Scope(name="run", key="lbp:{team-a}:run:free")])
    assert isinstance(free, Reservation) and free.rooms == ()  # nothing limited


async def test_a_refusal_reports_the_scope_and_each_figure_that_refused(store: RedisStore) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:refuse")
    window = Scope(
        name="key:minute", key="lbp:{team-a}:key:a-ci:minute:refuse", ceilings={"total_tokens": 50}
    )
    day = Scope(name="key:day", key="lbp:{team-a}:key:a-ci:day:refuse")  # unlimited, after it
    first = await reserve(store, "f1", [run, window, day])
    assert isinstance(first, Reservation)
    assert await settle(store, "f1", [run.key, window.key, day.key]) is not None  # 13 used
    small = {**AMOUNTS, "output_tokens": 10, "total_tokens": 20}
    assert isinstance(await reserve(store, "f2", [run, window, day], amounts=small), Reservation)
    refused = await reserve(store, "f3", [run, window, day])  # 13 + 20 + 30 > 50
    assert isinstance(refused, Refusal)
    assert (refused.scope, refused.meter) == (window, "total_tokens")
    assert (refused.ceiling, refused.used, refused.reserved, refused.amount) == (50, 13, 20, 30)
    assert refused.clears and refused.waits_on == ()  # 13 + 30 fits once f2 ends


async def test_a_refusal_no_call_in_flight_clears_names_the_scope_it_waits_on(store: RedisStore) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:stuck")
    window = Scope(name="key:minute", key="lbp:{team-a}:key:a-ci:minute:stuck", ceilings={"total_tokens": 35})
    assert isinstance(await reserve(store, "s1", [run, window]), Reservation)
    assert await settle(store, "s1", [run.key, window.key]) is not None  # 13 used
    refused = await reserve(store, "s2", [run, window])  # 13 + 30 > 35, in flight or not
    assert isinstance(refused, Refusal)
    assert (refused.scope, refused.ceiling, refused.used, refused.reserved) == (window, 35, 13, 0)
    assert not refused.clears and refused.waits_on == (window,)


# ---- what a settle is told ----


async def test_a_reapers_try_sent_again_gets_its_entry_and_another_try_does_not(store: RedisStore) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:try")
    assert isinstance(await reserve(store, "rt1", [run], run_id="try"), Reservation)
    first = await settle(store, "rt1", [run.key], run_id="try", reaper_try="r0a1")
    assert first is not None
    assert await settle(store, "rt1", [run.key], run_id="try", reaper_try="r0a1") == first
    assert await settle(store, "rt1", [run.key], run_id="try", reaper_try="r0b2") is None


async def test_a_settle_outside_any_run_scope_keeps_the_run_index_as_long_as_it_is_told(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    window = Scope(name="key:day", key="lbp:{team-a}:key:a-ci:day:loose", ttl_s=86_400)
    assert isinstance(await reserve(store, "lo1", [window], run_id="loose"), Reservation)
    assert await settle(store, "lo1", [window.key], run_id="loose", runlog_ttl_s=500) is not None
    assert 400 < await redis_client.ttl("lbp:{team-a}:runlog:loose") <= 500


async def test_a_settle_keeps_the_run_index_as_long_as_the_runs_meters(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # Told which scope is the run's, the settle follows that key's life, not runlog_ttl_s.
    run = Scope(name="run", key="lbp:{team-a}:run:kept", ttl_s=1000)
    assert isinstance(await reserve(store, "k1", [run], run_id="kept"), Reservation)
    await redis_client.persist("lbp:{team-a}:runlog:kept")
    settled = await settle(store, "k1", [run.key], run_id="kept", runlog_ttl_s=0, scope_ttls_s=[1000])
    assert settled is not None
    assert 900 < await redis_client.ttl("lbp:{team-a}:runlog:kept") <= 1000


async def test_a_store_keeps_settled_markers_as_long_as_it_was_built_to(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    store = RedisStore.from_url(redis_server.url, settled_marker_ttl_s=120)
    try:
        run = Scope(name="run", key="lbp:{team-a}:run:short-marker")
        assert isinstance(await reserve(store, "sm1", [run]), Reservation)
        assert await settle(store, "sm1", [run.key]) is not None
    finally:
        await store.close()
    assert 60 < await redis_client.ttl("lbp:{team-a}:resv:sm1") <= 120


# ---- the leases a reaper reads ----


async def test_expired_leases_skip_and_grace_are_each_what_the_reaper_asked(store: RedisStore) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:reap")
    for rid in ("e1", "e2"):
        res = await store.reserve(
            tenant=TENANT,
            reservation_id=rid,
            run_id="reap",
            scopes=[run],
            amounts=AMOUNTS,
            lease_ms=1,
            record="{}",
        )
        assert isinstance(res, Reservation)
    await asyncio.sleep(0.05)  # both leases run out (1 ms each)
    ids = [lease.id for lease in await store.expired_leases(tenant=TENANT, limit=10)]
    assert ids == ["e1", "e2"]
    skipped = await store.expired_leases(tenant=TENANT, limit=10, skip=1)
    assert [lease.id for lease in skipped] == ["e2"]
    assert await store.expired_leases(tenant=TENANT, limit=10, grace_ms=3_600_000) == []


async def test_an_expired_lease_reads_back_as_reserved(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    run = Scope(name="run", key="lbp:{team-a}:run:lease-read", ceilings={"output_tokens": 6})
    day = Scope(name="key:day", key="lbp:{team-a}:key:a-ci:day:lease-read", ttl_s=86_400)
    clamp = Clamp(min_output_tokens=1, choices=1, input_cost_exact=0, output_rate=0)
    res = await store.reserve(
        tenant=TENANT,
        reservation_id="lr1",
        run_id="lease-read",
        scopes=[run, day],
        amounts=AMOUNTS,
        lease_ms=1,
        record='{"run_id": "lease-read"}',
        clamp=clamp,
    )
    assert isinstance(res, Reservation) and res.clamped_output_per_choice == 6
    await asyncio.sleep(0.05)  # the lease (1 ms) runs out
    (lease,) = await store.expired_leases(tenant=TENANT, limit=10)
    assert (lease.id, lease.tenant, lease.record) == ("lr1", TENANT, '{"run_id": "lease-read"}')
    assert lease.scope_keys == (run.key, day.key) and lease.scope_ttls_s == (0, 86_400)
    assert lease.amounts == {**AMOUNTS, "output_tokens": 6, "total_tokens": 16}
    assert lease.clamped and lease.readable
    # A damaged record is told apart, for an operator, not read as figures.
    await redis_client.hset("lbp:{team-a}:resv:lr1", "amounts", "1 x 3")
    (damaged,) = await store.expired_leases(tenant=TENANT, limit=10)
    assert damaged.id == "lr1" and not damaged.readable and damaged.amounts == {}


# ---- the store's own settings: pool, timeouts, scripts, clock ----


async def test_the_pool_is_sized_and_timed_as_configured(redis_server: RedisServerProcess) -> None:
    store = RedisStore.from_url(redis_server.url, pool_size=3, socket_timeout_s=0.5)
    try:
        pool: Any = store.client.connection_pool
        assert (pool.max_connections, pool.timeout) == (3, 0.5)
    finally:
        await store.close()


async def test_a_cluster_client_is_sized_as_configured() -> None:
    # Built without connecting: a port nothing listens on will do.
    store = RedisStore.from_url("redis://127.0.0.1:1", cluster=True, pool_size=3, socket_timeout_s=0.5)
    try:
        client: Any = store.client
        assert client.nodes_manager.connection_kwargs["max_connections"] == 3 + PIPELINE_CONNECTIONS
        assert client.nodes_manager.connection_kwargs["socket_timeout"] == 0.5
    finally:
        await store.close()


async def test_a_script_held_past_the_socket_timeout_fails_the_call_as_maybe_applied(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    # The pipelined connection and redis-py (a Cluster's, TLS) alike: the script was sent and
    # may run once Redis is free, so the call must be settled, not released as never reserved.
    piped = RedisStore.from_url(redis_server.url, socket_timeout_s=0.3)
    plain = RedisStore(aioredis.Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=0.3))
    blocker = aioredis.Redis.from_url(redis_server.url)
    try:
        for store in (piped, plain):
            await store.ping()
        busy = asyncio.ensure_future(blocker.eval(busy_script(2.0), 0))
        await until_redis_busy(redis_server.port)
        run = Scope(name="run", key="lbp:{team-a}:run:slow")
        for store, rid in ((piped, "slow1"), (plain, "slow2")):
            with pytest.raises(StoreError) as failed:
                await reserve(store, rid, [run])
            assert failed.value.maybe_applied, rid
        await busy
    finally:
        await blocker.aclose()
        await piped.close()
        await plain.close()


async def test_a_script_refusing_its_arguments_is_rejected_not_a_store_failure(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    # A settle told to keep no marker: settle.lua answers an error, the same on every try.
    piped = RedisStore.from_url(redis_server.url, settled_marker_ttl_s=0)
    plain = RedisStore(
        aioredis.Redis.from_url(redis_server.url, decode_responses=True), settled_marker_ttl_s=0
    )
    try:
        run = Scope(name="run", key="lbp:{team-a}:run:rejected")
        for store, rid in ((piped, "rj1"), (plain, "rj2")):
            assert isinstance(await reserve(store, rid, [run]), Reservation)
            with pytest.raises(StoreRejected):
                await settle(store, rid, [run.key])
    finally:
        await piped.close()
        await plain.close()


async def test_a_settle_after_the_scripts_are_loaded_says_when_it_is_sent(
    store: RedisStore, redis_client: aioredis.Redis
) -> None:
    # A script the connection has not run by its SHA says nothing (refused, its EVAL would go
    # behind later commands): the scripts loaded at start make the second settle say it.
    await redis_client.script_flush()
    await store.load_scripts()
    run = Scope(name="run", key="lbp:{team-a}:run:sent")
    sent: list[str] = []
    for rid in ("se1", "se2"):
        assert isinstance(await reserve(store, rid, [run]), Reservation)
        assert await settle(store, rid, [run.key], on_sent=lambda rid=rid: sent.append(rid)) is not None
    assert sent[-1:] == ["se2"]


async def test_a_script_redis_forgot_runs_in_full(store: RedisStore, redis_client: aioredis.Redis) -> None:
    await store.load_scripts()
    await redis_client.script_flush()  # a restart, a failover: the cache is empty
    run = Scope(name="run", key="lbp:{team-a}:run:forgot")
    assert isinstance(await reserve(store, "fo1", [run]), Reservation)
    assert await settle(store, "fo1", [run.key]) is not None


async def test_the_store_clock_is_the_servers(store: RedisStore, redis_client: aioredis.Redis) -> None:
    await store.sync_clock()
    secs, micros = await redis_client.time()
    assert abs(store.now() - (secs + micros / 1e6)) < 5


async def test_the_store_clock_measured_behind_a_slow_script_is_not_off_by_half_its_wait(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """One TIME read, taken at the middle of its round trip: read behind a 3 s script, the clock
    was 1.5 s ahead until the next measure (30 s on), and calls in a minute's last 1.5 s were
    charged to the next one (found by the races hunt). The shortest of a few reads is taken."""
    store = RedisStore.from_url(own_redis.url, socket_timeout_s=10)
    blocker = aioredis.Redis.from_url(own_redis.url)
    try:
        hold = asyncio.ensure_future(blocker.eval(busy_script(3.0), 0))
        assert own_redis.port is not None
        await until_redis_busy(own_redis.port)
        await store.sync_clock()
        await hold
        secs, micros = await own_client.time()
        assert abs(store.now() - (secs + micros / 1e6)) < 0.5
    finally:
        await blocker.aclose()
        await store.close()


# ---- contexts ----


async def test_a_claimed_context_is_kept_for_a_month(store: RedisStore, redis_client: aioredis.Redis) -> None:
    await store.claim_contexts(tenant=TENANT, ids=["resp_owned"])
    assert await store.context_owners(ids=["resp_owned", "resp_other"]) == [TENANT, None]
    assert 29 * 86_400 < await redis_client.ttl("lbp:ctxowner:resp_owned") <= 30 * 86_400


async def test_a_call_naming_more_items_than_one_command_reads_counts_and_claims_each(
    store: RedisStore,
) -> None:
    # Past one command's worth (OWNERS_A_COMMAND, CLAIMS_AT_ONCE): every batch, every item.
    ids = [f"item_{i}" for i in range(OWNERS_A_COMMAND + 1)]
    await store.remember_context(tenant=TENANT, ids=ids, tokens=1, ttl_s=600)
    assert await store.item_tokens(tenant=TENANT, ids=ids) == len(ids)
    await store.claim_contexts(tenant=TENANT, ids=ids)
    assert await store.context_owners(ids=ids) == [TENANT] * len(ids)


# ---- no silent fallback ----


async def test_every_command_of_a_store_that_is_down_fails_as_a_store_error(
    own_redis: RedisServerProcess,
) -> None:
    store = RedisStore.from_url(own_redis.url, socket_timeout_s=1.0)
    try:
        await store.ping()
        own_redis.stop()
        run = Scope(name="run", key="lbp:{team-a}:run:down")
        commands: dict[str, Callable[[], Awaitable[object]]] = {
            "ping": store.ping,
            "register_tenant": lambda: store.register_tenant(TENANT),
            "reserve": lambda: reserve(store, "d1", [run]),
            "prior_context_tokens": lambda: store.prior_context_tokens(tenant=TENANT, ids=["resp_1"]),
            "item_tokens": lambda: store.item_tokens(tenant=TENANT, ids=["item_1"]),
            "context_owners": lambda: store.context_owners(ids=["resp_1"]),
            "claim_contexts": lambda: store.claim_contexts(tenant=TENANT, ids=["resp_1"]),
            "remember_context": lambda: store.remember_context(
                tenant=TENANT, ids=["resp_1"], tokens=5, ttl_s=60
            ),
        }
        for name, command in commands.items():
            with pytest.raises(StoreError) as failed:
                await command()
                pytest.fail(name)
            # Nothing went out (no connection): released as never reserved, not left to a reaper.
            assert not failed.value.maybe_applied, name
    finally:
        await store.close()
