"""Tests that kill mutants of the billing path which the rest of the suite let live: each pins a
figure the ledger, a meter or a refusal depends on."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from proxy.billed_usage import billed_usage
from proxy.call import Call
from proxy.journal import Journal
from proxy.observe import Observation
from proxy.outcome import NOTHING_BILLED, Outcome, provider_usage
from proxy.pricing import MAX_AMOUNT, cost_micros, reserve_amounts
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.scopes import scopes_for
from proxy.settle import _cost, settle
from proxy.store import Clamp, Reservation, Scope
from tests.conftest import KEY_A, ProxyFactory, digest
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import Plan, ScriptedUpstream
from tests.test_billed_usage import TOKENIZER, answered, chat, planned, told
from tests.test_budgets import call as budget_call
from tests.test_metrics import ADMIN, scrape, total
from tests.test_pricing_kinds import _billed_chat, _claude_message, _claude_proxy, _post

RATES = {
    "input": 1_000_000,
    "cached_input": 100_000,
    "cache_creation_input": 2_000_000,
    "cache_creation_input_1h": 3_000_000,
    "audio_input": 4_000_000,
    "output": 10_000_000,
    "reasoning": 10_000_000,
    "audio_output": 40_000_000,
    "image_input": 1_000_000,
    "image_output": 10_000_000,
}


AMOUNTS = {"requests": 1, "input_tokens": 10, "output_tokens": 20, "total_tokens": 30, "concurrent": 1}


async def _reserve_run(
    store: RedisStore, rid: str, scope: Scope, amounts: dict[str, int] = AMOUNTS, **extra: Any
) -> Reservation:
    """``rid`` reserved on the run ``scope`` alone, its run named by the scope's key."""
    res = await store.reserve(
        tenant="team-a",
        reservation_id=rid,
        run_id=scope.key.rpartition(":")[2],
        scopes=[scope],
        amounts=amounts,
        lease_ms=60_000,
        record="{}",
        **extra,
    )
    assert isinstance(res, Reservation)
    return res


def test_output_parts_that_overlap_past_the_whole_are_never_billed_twice() -> None:
    """100 output tokens, 50 of them reasoning and (so a provider says) 80 audio: at most the 50
    that are not reasoning can be audio. Billed 50 reasoning + 50 audio, not 50 + 80 less 30
    text tokens that do not exist (a negative part)."""
    cost = cost_micros(RATES, input_tokens=0, output_tokens=100, reasoning_tokens=50, audio_output_tokens=80)
    assert cost == 50 * 10 + 50 * 40


def test_input_parts_that_overlap_past_the_whole_are_never_billed_twice() -> None:
    """100 input tokens, 60 cache reads and 60 cache writes (or 60 audio): only 40 can be
    writes (or audio)."""
    cost = cost_micros(
        RATES, input_tokens=100, cached_input_tokens=60, cache_creation_input_tokens=60, output_tokens=0
    )
    assert cost == 60 // 10 + 40 * 2
    audio = cost_micros(
        RATES, input_tokens=100, cached_input_tokens=60, audio_input_tokens=60, output_tokens=0
    )
    assert audio == 60 // 10 + 40 * 4


def test_output_the_observation_says_is_hidden_is_billed_at_the_reserve() -> None:
    """An answer whose output the stream does not show (OpenRouter's encrypted reasoning, a
    Responses reasoning item) and no final usage: its text is not its output."""
    call = planned(chat(max_tokens=50))
    obs = answered("short")
    obs.hidden_output = True
    usage = billed_usage(call, obs, TOKENIZER, complete=True)
    assert (usage.output_tokens, usage.source) == (50, "reserve")
    told_input = answered("short", told(12, 0, output_known=False))
    told_input.hidden_output = True
    usage = billed_usage(call, told_input, TOKENIZER, complete=True)
    assert (usage.input_tokens, usage.output_tokens, usage.source) == (12, 50, "reserve")


def test_an_unfinished_report_with_no_input_count_leaves_the_input_at_the_reserve() -> None:
    """Output no count sees and a report that is not final and tells no input (0): nothing of
    the input is known, so the whole call is billed at its reserve, not 0 input tokens."""
    call = planned(chat(max_tokens=50), **{"gpt-4o-mini": {"upstream": "openai", "hidden_reasoning": True}})
    assert call.reserved_input_tokens > 0
    usage = billed_usage(call, answered("short", told(0, 0, output_known=False)), TOKENIZER, complete=True)
    assert (usage.input_tokens, usage.output_tokens, usage.source, usage.input_known) == (
        call.reserved_input_tokens,
        50,
        "reserve",
        False,
    )


def test_a_reserved_output_after_a_known_input_is_priced_at_the_dearest_output_rate() -> None:
    """A stream cut after the provider told its input: the input at its own kinds' prices, the
    output the reserve's, at the dearest output rate (it may all have been reasoning)."""
    price = {"input": "1", "output": "10", "reasoning": "30"}
    call = planned(chat(max_tokens=50), **{"gpt-4o-mini": {"upstream": "openai", "price_per_million": price}})
    usage = billed_usage(call, answered("cut", told(12, 0, output_known=False)), TOKENIZER, complete=False)
    assert (usage.input_tokens, usage.output_tokens, usage.input_known) == (12, 50, True)
    # 12 input at 1 a million, 50 output at 30 (not at output's 10: 512).
    assert _cost(call, usage) == 12 * 1 + 50 * 30


def test_a_known_input_is_priced_at_the_tier_that_served_it_when_the_output_is_the_reserves() -> None:
    """Reserved at the dearest priced tier (the call named none), cut after the provider told its
    input and the tier that served it (Anthropic's message_start): the input at that tier's
    prices, only the reserved output at the dearest rate."""
    model = {
        "upstream": "openai",
        "price_per_million": {"input": "3", "output": "15"},
        "service_tiers": {"priority": {"input": "6", "output": "30"}},
    }
    call = planned(chat(max_tokens=50), **{"gpt-4o-mini": model})
    assert call.rates_reserved is not None and call.rates_reserved["input"] == 6_000_000
    usage = billed_usage(call, answered("cut", told(1000, 0, output_known=False)), TOKENIZER, complete=False)
    assert (usage.input_tokens, usage.output_tokens, usage.source) == (1000, 50, "reserve")
    call.served_tier = "default"
    assert _cost(call, usage) == 1000 * 3 + 50 * 30  # not 1000 * 6: the input's tier is known


@pytest.mark.parametrize("prompt_tokens", [9, 5_000_000])
async def test_the_ledger_names_the_tokens_billed_past_the_whole_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, prompt_tokens: int
) -> None:
    """overshoot_tokens: what the call was billed past what it held, input and output together
    (none for a call within its reserve)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3}
    entry = await _billed_chat(
        make_proxy,
        script,
        redis_client,
        model="m",
        price={"input": "1", "output": "1"},
        usage=usage,
        stream=False,
    )
    held = int(entry["reserved_input_tokens"]) + int(entry["reserved_output_tokens"])
    assert int(entry["overshoot_tokens"]) == max(0, prompt_tokens + 3 - held)
    assert (entry["overshoot_tokens"] == "0") == (prompt_tokens == 9)


async def test_a_call_a_reaper_billed_first_is_told_the_cost_the_ledger_holds(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """Its lease ran out and a reaper billed it at its reserve: the settle that follows writes
    nothing, and what the call is told (headers, the stream's comment, the spend counters) is
    the reaper's entry, its cost too, not the provider's figures priced."""
    price = {"input": "1", "output": "10"}
    call = planned(chat(max_tokens=50), **{"gpt-4o-mini": {"upstream": "openai", "price_per_million": price}})
    store = RedisStore.from_url(redis_server.url)
    try:
        res = await _reserved(store, call)
        amounts = res.amounts
        meters = ("requests", "input_tokens", "output_tokens", "total_tokens", "cost_micros")
        reaped = {meter: amounts[meter] for meter in meters}
        assert await store.settle(
            tenant="team-a",
            reservation_id=res.id,
            run_id=call.run_id,
            scope_keys=[s.key for s in res.scopes],
            actual=reaped,
            entry={"outcome": "lease_expired", "cost_micros": str(amounts["cost_micros"])},
        )
        obs = answered("hi", told(3, 1))
        usage = provider_usage(obs)
        assert usage is not None
        done = await settle(
            store, Journal(tmp_path / "journal"), call, Outcome("ok"), usage, {0: "stop"}, marker_ttl_s=3600
        )
    finally:
        await store.close()
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert done.outcome == Outcome("lease_expired") and done.entry_id is None
    assert done.cost_micros == amounts["cost_micros"] == int(entry["cost_micros"]) > _cost(call, usage)
    assert done.actual["cost_micros"] == amounts["cost_micros"]


async def _reserved(store: RedisStore, call: Call, *, run_ttl_s: int = 0) -> Reservation:
    """The call reserved in the store as ``reserve`` would (no tier: its run's scope only)."""
    scopes = scopes_for(call.identity, call.run_id, None, datetime.now(UTC), run_ttl_s=run_ttl_s)
    res = await store.reserve(
        tenant=call.identity.tenant,
        reservation_id=call.reservation_id,
        run_id=call.run_id,
        scopes=scopes,
        amounts=reserve_amounts(call.estimate, call.rates_reserved),
        lease_ms=60_000,
        record="{}",
    )
    assert isinstance(res, Reservation)
    call.reservation = res
    call.lease_confirmed_at = time.monotonic()
    return res


async def test_a_lost_reservation_settled_at_nothing_keeps_the_run_index_for_the_runs_ttl(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A failover lost the reservation and the run's meters, then the upstream refused the
    connection (nothing billed): the live settle writes the entry and no meter, and the run's
    ledger index gets the run's TTL, not kept for ever."""
    call = planned(chat(max_tokens=50))
    store = RedisStore.from_url(redis_server.url)
    try:
        res = await _reserved(store, call, run_ttl_s=3600)
        await redis_client.delete(f"lbp:{{team-a}}:resv:{res.id}", *(s.key for s in res.scopes))
        done = await settle(
            store,
            Journal(tmp_path / "journal"),
            call,
            Outcome("upstream_error"),
            NOTHING_BILLED,
            {},
            marker_ttl_s=3600,
        )
    finally:
        await store.close()
    assert done.entry_id is not None
    ttl = await redis_client.ttl(f"lbp:{{team-a}}:runlog:{call.run_id}")
    assert 0 < ttl <= 3600, ttl  # -1: kept for ever


async def test_a_cost_past_what_the_store_holds_is_billed_at_its_limit(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A provider's count of 10**12 tokens at a high price costs more than settle.lua takes (15
    digits): billed at the limit, never a settle the store refuses and no ledger entry."""
    usage = {"prompt_tokens": 10**12, "completion_tokens": 1, "total_tokens": 10**12 + 1}
    entry = await _billed_chat(
        make_proxy,
        script,
        redis_client,
        model="m",
        price={"input": "10000", "output": "1"},
        usage=usage,
        stream=False,
    )
    assert entry["input_tokens"] == str(10**12)
    assert int(entry["cost_micros"]) == MAX_AMOUNT


async def test_a_runs_meters_count_its_cache_reads_and_writes(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """GET /v1/billing/runs/{run}: the parts of the input priced apart are counted on the run's
    meters as the ledger names them."""
    proxy = await _claude_proxy(make_proxy, script)
    usage = {
        "input_tokens": 50,
        "cache_read_input_tokens": 700,
        "cache_creation_input_tokens": 900,
        "output_tokens": 20,
    }
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    request = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
    }
    status, _ = await _post(proxy.url, "/v1/messages", request, "parts")
    assert status == 200
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            proxy.url + "/v1/billing/runs/parts", headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp,
    ):
        assert resp.status == 200
        meters = (await resp.json())["meters"]
    assert meters["input_tokens"]["used"] == 1650
    assert meters["cached_input_tokens"]["used"] == 700
    assert meters["cache_creation_input_tokens"]["used"] == 900
    assert meters["output_tokens"]["used"] == 20


async def test_a_refusal_two_windows_stand_in_gets_the_later_reset(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The minute and the day window both full: a client that honours retry-after and comes
    back when the minute resets is refused again. retry-after is when the last of them resets."""
    now = datetime.now(UTC)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    if (midnight - now).total_seconds() < 300:
        pytest.skip("too near the day's reset to tell it from the minute's")
    windows = [{"period": "minute", "requests": 1}, {"period": "day", "requests": 1}]
    proxy = await make_proxy(tiers={"standard": {"windows": windows}})
    await budget_call(proxy, "w1")
    with pytest.raises(openai.RateLimitError) as caught:
        await budget_call(proxy, "w2")
    headers = caught.value.response.headers
    assert headers["x-should-retry"] == "false"
    to_midnight = (midnight - datetime.now(UTC)).total_seconds()
    assert abs(int(headers["retry-after"]) - to_midnight) < 10, (headers["retry-after"], to_midnight)


async def test_a_reserve_under_a_shorter_setting_does_not_shorten_a_run_with_calls_in_flight(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A reload shortened run_ttl_s while a call of the run (reserved under the longer one, which
    its lease counted on) is in flight: the next reserve of the run leaves the run's keys their
    life. Shortened, they would expire under that call, its reserve and the run's spend with
    them. Once nothing is in flight, the first reserve applies the shorter setting."""
    key = "lbp:{team-a}:run:busy"
    store = RedisStore.from_url(redis_server.url)

    async def reserve(rid: str, ttl_s: int) -> Reservation:
        return await _reserve_run(store, rid, Scope(name="run", key=key, ttl_s=ttl_s))

    try:
        await reserve("long", 86400)
        await reserve("short", 3600)  # "long" in flight
        assert 86000 < await redis_client.ttl(key) <= 86400
        for rid in ("long", "short"):
            await store.settle(
                tenant="team-a",
                reservation_id=rid,
                run_id="busy",
                scope_keys=[key],
                actual={"requests": 1},
                entry={"a": "b"},
                scope_ttls_s=[3600],
                runlog_ttl_s=3600,
            )
        await reserve("idle", 3600)  # control: nothing in flight, the new setting applies
        assert 3500 < await redis_client.ttl(key) <= 3600
    finally:
        await store.close()


async def test_a_record_without_born_stamps_releases_from_a_key_that_expired_never_below_zero(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """Reserved by an older version (no 'born' in its record), its run's key expired mid-call:
    its release finds nothing held there, and must leave 0 reserved, not -30 (free room past
    the ceiling for the next calls)."""
    key = "lbp:{team-a}:run:old"
    scope = Scope(name="run", key=key, ceilings={"total_tokens": 90}, ttl_s=3600)
    store = RedisStore.from_url(redis_server.url)
    try:
        await _reserve_run(store, "old", scope)
        await redis_client.hdel("lbp:{team-a}:resv:old", "born")
        await redis_client.delete(key)  # its TTL ran out under the call
        await store.settle(
            tenant="team-a",
            reservation_id="old",
            run_id="old",
            scope_keys=[key],
            actual={"requests": 1, "total_tokens": 30},
            entry={"a": "b"},
            scope_ttls_s=[3600],
        )
        meters = await store.meters(key)
        assert meters["total_tokens"].reserved == 0 and meters["concurrent"].reserved == 0
        assert meters["total_tokens"].used == 30
    finally:
        await store.close()


LOWER = {**AMOUNTS, "input_tokens": 4, "total_tokens": 24}


async def test_a_shrunk_reserve_is_released_and_reaped_at_its_lowered_amounts(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """After a shrink the record holds the lowered amounts: the settle releases those (not the
    first ones, which would take 6 tokens of another call's reserve: room past the ceiling while
    it runs), and a reaper bills those."""
    scope = Scope(name="run", key="lbp:{team-a}:run:shrunk", ceilings={"total_tokens": 90}, ttl_s=3600)
    store = RedisStore.from_url(redis_server.url)
    try:
        await _reserve_run(store, "a", scope)
        await _reserve_run(store, "b", scope)
        assert await store.shrink(tenant="team-a", reservation_id="a", scope_keys=[scope.key], amounts=LOWER)
        assert (await store.meters(scope.key))["total_tokens"].reserved == 24 + 30
        await redis_client.zadd("lbp:{team-a}:leases", {"a": 0})  # its lease ran out
        (lease,) = await store.expired_leases(tenant="team-a", limit=10)
        assert lease.id == "a" and lease.amounts["total_tokens"] == 24
        await store.settle(
            tenant="team-a",
            reservation_id="a",
            run_id="shrunk",
            scope_keys=[scope.key],
            actual={"requests": 1, "total_tokens": 24},
            entry={"a": "b"},
            scope_ttls_s=[3600],
        )
        meters = await store.meters(scope.key)
        assert meters["total_tokens"].reserved == 30  # b's, whole
        assert meters["input_tokens"].reserved == 10
    finally:
        await store.close()


async def test_a_shrink_of_a_record_without_born_stamps_never_leaves_a_negative_reserve(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """Reserved by an older version (no 'born'), its run's key expired mid-call: the shrink finds
    nothing held there and must not write -6 reserved (room past the ceiling)."""
    scope = Scope(name="run", key="lbp:{team-a}:run:oldshrink", ceilings={"total_tokens": 90}, ttl_s=3600)
    store = RedisStore.from_url(redis_server.url)
    try:
        await _reserve_run(store, "old", scope)
        await redis_client.hdel("lbp:{team-a}:resv:old", "born")
        await redis_client.delete(scope.key)
        await store.shrink(tenant="team-a", reservation_id="old", scope_keys=[scope.key], amounts=LOWER)
        meters = await store.meters(scope.key)
        assert all(m.reserved >= 0 for m in meters.values()), meters
    finally:
        await store.close()


async def test_a_reserve_clamped_by_cost_knows_the_cost_the_store_holds(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """The reservation's amounts after a clamp are what reserve.lua held (its cost rounded up):
    the budget headers' refund and the cost told when a reaper bills the call first read them."""
    scope = Scope(name="run", key="lbp:{team-a}:run:cc", ceilings={"cost_micros": 10}, ttl_s=3600)
    # 10 input tokens at 0.15 a token (1.5 micro-units), output 1 a token: 8 output fit (9.5 -> 10).
    clamp = Clamp(min_output_tokens=1, choices=1, input_cost_exact=1_500_000, output_rate=1_000_000)
    amounts = {**AMOUNTS, "output_tokens": 100, "total_tokens": 110, "cost_micros": 102}
    store = RedisStore.from_url(redis_server.url)
    try:
        res = await _reserve_run(store, "cc", scope, amounts, clamp=clamp)
        assert res.clamped_output_per_choice == 8
        held = await store.meters(scope.key)
        assert res.amounts["cost_micros"] == held["cost_micros"].reserved == 10
    finally:
        await store.close()


async def test_the_reserve_error_ratio_counts_only_calls_the_provider_told_the_input_of(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """llm_proxy_reserve_error_ratio: the estimate against the provider's input count. A call
    billed on the proxy's own count has no provider figure to compare: observing it would
    measure the estimate against itself (a ratio near 1, hiding the estimate's real error)."""
    proxy = await make_proxy(admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}])
    client = proxy.client()
    messages = [{"role": "user", "content": "hi"}]
    await client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=messages,
        extra_body={"fake": {"no_usage": True}},
    )
    await proxy.recorded()
    values = await scrape(proxy)
    assert total(values, "llm_proxy_reserve_error_ratio_count") == 1


async def test_the_overshoot_counter_counts_what_the_ledger_names(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """llm_proxy_overshoot_tokens: the tokens charged past the reserve, as the ledger's
    overshoot_tokens (an estimate that falls short shows there, and nowhere else live)."""
    proxy = await make_proxy(admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}])
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        extra_body={"fake": {"usage": {"prompt_tokens": 5000, "total_tokens": 5008}}},
    )
    await proxy.recorded()
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert int(entry["overshoot_tokens"]) > 0
    values = await scrape(proxy)
    assert total(values, "llm_proxy_overshoot_tokens_total", tenant="team-a") == int(
        entry["overshoot_tokens"]
    )


def test_each_counted_answer_of_n_is_held_to_its_own_cap() -> None:
    """n=2, max_tokens=5: each answer went with a cap of 5. A count of 100 for the first (400
    characters at 4 a token) is the count's error above its cap: billed 5 + 1, not the 10 reserved
    for both, which only the sum was held to (the usage fallback hunt)."""
    call = planned(chat(max_tokens=5, n=2))
    assert (call.estimate.output_cap, call.reserved_output_tokens) == (5, 10)
    obs = Observation()
    for chunk in (
        {"choices": [{"index": 0, "delta": {"content": "x" * 400}}]},
        {"choices": [{"index": 1, "delta": {"content": "hi"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}]},
    ):
        obs.observe(chunk, streaming=True)
    billed = billed_usage(call, obs, TOKENIZER, complete=True)
    assert billed.output_tokens == 5 + 1, billed
