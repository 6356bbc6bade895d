"""Tests that kill mutants of the reserve, settle, lease, reaper and record code which the rest
of the suite let live: each pins a figure the ledger, a meter, a release or a bill depends on."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from proxy.journal_lines import reaper_line
from proxy.outcome import NOTHING_BILLED, Outcome, reserve_usage
from proxy.reaper import lease_entry, reap_tenant
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.reserve import _refusal_error
from proxy.scrub import NO_SECRETS
from proxy.settle import (
    LEDGER_REASONS_CHARS,
    Settlement,
    _actual,
    _cost,
    _release,
    billing_comment,
    entry_fields,
    ledger_reasons,
)
from proxy.store import ExpiredLease, Refusal, Reservation, Scope
from tests.conftest import KEY_A, UPSTREAM_KEY, ProxyFactory, until_upstream_received, upstream_timing_out
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, scripted_upstreams
from tests.test_billed_usage import chat, planned
from tests.test_billing_edges import _reserved
from tests.test_budgets import call as budget_call
from tests.test_prior_context import answer_items
from tests.test_reaper import post_and_expire_its_lease


async def _ledger(redis_client: aioredis.Redis) -> list[dict[str, str]]:
    """team-a's ledger entries, oldest first."""
    raw = await redis_client.xrange("lbp:{team-a}:ledger")
    assert raw is not None
    return [{str(k): str(v) for k, v in (fields or {}).items()} for _, fields in raw]


def test_a_release_of_a_reserve_whose_reply_was_lost_names_what_it_asked_for_in_order() -> None:
    """A reserve whose reply was lost has no reservation: the release's entry names the input
    and the output it asked for, each in its own field."""
    call = planned(chat(max_tokens=50))
    assert call.reservation is None and call.reserved_input_tokens != 50
    entry = entry_fields(call, Outcome("not_forwarded"), NOTHING_BILLED, 0, "")
    assert (entry["reserved_input_tokens"], entry["reserved_output_tokens"]) == (
        str(call.reserved_input_tokens),
        "50",
    )


def test_an_answer_served_at_the_default_tier_names_no_tier_in_the_ledger() -> None:
    """OpenAI's answers say ``service_tier: "default"`` on every call: the default's prices, and
    no tier named; a priority answer is named."""
    call = planned(chat(max_tokens=5))
    call.served_tier = "default"
    assert "service_tier" not in entry_fields(call, Outcome("ok"), NOTHING_BILLED, 0, "stop")
    call.served_tier = "priority"
    assert entry_fields(call, Outcome("ok"), NOTHING_BILLED, 0, "stop")["service_tier"] == "priority"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_key_echoed_in_a_finish_reason_is_not_kept_in_the_ledger(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, stream: bool
) -> None:
    """The answer's bytes are scrubbed on their way to the client, not what the proxy read of
    them: a finish reason echoing the operator's key (a gateway's ``"error: ..."``) went out
    ``[REDACTED]`` and into the ledger entry as it came, kept in Redis for good and read back by
    the tenant from ``GET /v1/billing/runs/{run}/ledger`` (the scrub hunt)."""
    proxy = await make_proxy()
    fake = {"finish_reasons": [f"error: invalid key {UPSTREAM_KEY}"]}
    body = {**chat(max_tokens=50), "stream": stream, "fake": fake}
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "fr-run"}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            answer = await resp.read()
    assert UPSTREAM_KEY.encode() not in answer and b"[REDACTED]" in answer, answer
    await proxy.recorded()
    (entry,) = await ledger_entries(proxy, "fr-run")
    assert entry["finish_reasons"] == "error: invalid key [REDACTED]", entry
    assert UPSTREAM_KEY not in json.dumps(await _ledger(redis_client))


async def test_a_key_echoed_as_the_service_tier_is_not_kept_in_the_ledger(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The served tier an answer names went into the entry (``service_tier``) as the answer
    wrote it, as a finish reason did: the operator's key, or a megabyte, kept for good."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    for run, tier in (("tier-key", f"tier-of-{UPSTREAM_KEY}"), ("tier-long", "x" * 1_000_000)):
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "gpt-4o-mini",
            "service_tier": tier,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
        }
        script.plan = Plan(chunks=[dumps(answer)])
        headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
        async with aiohttp.ClientSession() as session:
            url = proxy.url + "/v1/chat/completions"
            async with session.post(url, json=chat(max_tokens=50), headers=headers) as resp:
                assert resp.status == 200
                assert UPSTREAM_KEY.encode() not in await resp.read()
        await proxy.recorded()
        (entry,) = await ledger_entries(proxy, run)
        assert entry["service_tier"] in ("tier-of-[REDACTED]", "x" * 61 + "..."), entry
    assert UPSTREAM_KEY not in json.dumps(await _ledger(redis_client))


def test_an_upstreams_finish_reasons_are_cut_in_the_entry() -> None:
    """Each to 64 characters (a megabyte was kept whole, in every entry), and all of them to
    ``LEDGER_REASONS_CHARS`` (an upstream naming answers by the thousand)."""
    assert ledger_reasons({1: "stop", 0: "y" * 1_000_000}, NO_SECRETS) == "y" * 61 + "...,stop"
    many = ledger_reasons(dict.fromkeys(range(10_000), "tool_calls"), NO_SECRETS)
    assert len(many) == LEDGER_REASONS_CHARS and many.endswith("...")
    assert ledger_reasons(dict.fromkeys(range(128), "tool_calls"), NO_SECRETS) == ",".join(
        ["tool_calls"] * 128
    )


def test_a_ledger_entry_names_a_kind_of_token_only_when_it_has_some() -> None:
    """An entry is kept for good: the kinds most calls have none of (audio, hour-long cache
    writes) are named only when the call has some."""
    call = planned(chat(max_tokens=5))
    plain = replace(
        NOTHING_BILLED,
        input_tokens=12,
        cached_input_tokens=2,
        output_tokens=3,
        reasoning_tokens=1,
        source="provider",
    )
    entry = entry_fields(call, Outcome("ok"), plain, 0, "stop")
    for kind in ("audio_input", "audio_output", "cache_creation_1h_input"):
        assert f"{kind}_tokens" not in entry, entry
    named = ("input", "cached_input", "cache_creation_input", "output", "reasoning", "total")
    assert [entry[f"{kind}_tokens"] for kind in named] == ["12", "2", "0", "3", "1", "15"]
    spoken = entry_fields(call, Outcome("ok"), replace(plain, audio_output_tokens=2), 0, "stop")
    assert spoken["audio_output_tokens"] == "2" and "audio_input_tokens" not in spoken


def test_a_call_that_never_went_out_is_no_request_on_the_meters() -> None:
    """A call the upstream refused to connect to (source ``none``) puts nothing on the meters,
    not even a request; any other settle counts one."""
    assert _actual(NOTHING_BILLED, 0) == dict.fromkeys(_actual(NOTHING_BILLED, 0), 0)
    told = replace(NOTHING_BILLED, input_tokens=12, output_tokens=3, source="provider")
    assert _actual(told, 7)["requests"] == 1
    assert _actual(replace(told, source="reserve"), 7)["requests"] == 1


def test_a_reaped_lease_is_billed_and_named_as_its_record_says() -> None:
    """A lease settled at its reserve: its amounts on the meters, and an entry naming the call
    as the reserve's record kept it (stream, tier, run and how long its index stays), its
    reserve as both billed and reserved."""
    kept = {
        "request_id": "req-9",
        "run_id": "run-9",
        "key": "a-ci",
        "endpoint": "chat.completions",
        "model": "gpt-4o-mini",
        "upstream": "openai",
        "stream": True,
        "time_ms": 1234,
        "service_tier": "priority",
        "run_ttl_s": 600,
    }
    lease = ExpiredLease(
        id="resv-9",
        tenant="team-a",
        scope_keys=("lbp:{team-a}:run:run-9",),
        amounts={
            "requests": 1,
            "input_tokens": 40,
            "output_tokens": 7,
            "total_tokens": 47,
            "cost_micros": 90,
        },
        record=orjson.dumps(kept).decode(),
        clamped=True,
    )
    actual, entry, run_id, run_ttl_s = lease_entry(lease)
    assert (run_id, run_ttl_s) == ("run-9", 600)
    assert actual == {
        "requests": 1,
        "input_tokens": 40,
        "output_tokens": 7,
        "total_tokens": 47,
        "cost_micros": 90,
        "cached_input_tokens": 0,
        "reasoning_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    assert entry == {
        "request_id": "req-9",
        "reservation_id": "resv-9",
        "time_ms": "1234",
        "tenant": "team-a",
        "key": "a-ci",
        "run_id": "run-9",
        "endpoint": "chat.completions",
        "model": "gpt-4o-mini",
        "upstream": "openai",
        "stream": "1",
        "outcome": "lease_expired",
        "finish_reasons": "",
        "input_tokens": "40",
        "cached_input_tokens": "0",
        "cache_creation_input_tokens": "0",
        "output_tokens": "7",
        "reasoning_tokens": "0",
        "total_tokens": "47",
        "usage_source": "reserve",
        "cost_micros": "90",
        "reserved_input_tokens": "40",
        "reserved_output_tokens": "7",
        "overshoot_tokens": "0",
        "clamped": "1",
        "upstream_status": "0",
        "latency_ms": "",
        "ttft_ms": "",
        "service_tier": "priority",
    }
    # A record that cannot be read: billed all the same, under its reservation's id as its run.
    _, bare, bare_run, bare_ttl = lease_entry(replace(lease, record="not json", clamped=False))
    assert (bare_run, bare_ttl, bare["stream"], bare["clamped"]) == ("resv-9", 0, "0", "0")
    assert "service_tier" not in bare


async def test_the_release_of_an_unforwarded_reserve_keeps_the_run_index_for_the_runs_ttl(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A reserve whose reply was lost did happen; its release is applied after the run's keys
    expired (a long outage): the not_forwarded entry's run index gets the run's TTL, not kept
    for ever."""
    call = planned(chat(max_tokens=50))
    store = RedisStore.from_url(redis_server.url)
    try:
        res = await _reserved(store, call, run_ttl_s=3600)
        await redis_client.delete(*(s.key for s in res.scopes))
        call.reservation = None  # its reply was lost
        entry_id = await _release(call, [s.key for s in res.scopes], 3600).apply(store)
    finally:
        await store.close()
    assert entry_id is not None
    (entry,) = await _ledger(redis_client)
    assert (entry["outcome"], entry["cost_micros"], entry["usage_source"]) == ("not_forwarded", "0", "none")
    ttl = await redis_client.ttl(f"lbp:{{team-a}}:runlog:{call.run_id}")
    assert 0 < ttl <= 3600, ttl  # -1: kept for ever


def test_a_streams_billing_comment_names_each_kind_of_token_in_its_own_field() -> None:
    """The ``: billing`` comment is what a stream's client is told of its bill: cache reads and
    reasoning each in their own field, the rarer kinds only when there are some."""
    call = planned(chat(max_tokens=50, stream=True))
    usage = replace(
        NOTHING_BILLED,
        input_tokens=12,
        cached_input_tokens=2,
        output_tokens=9,
        reasoning_tokens=5,
        audio_output_tokens=3,
        source="provider",
    )
    settled = Settlement(
        outcome=Outcome("ok"),
        usage=usage,
        cost_micros=77,
        entry_id="1-0",
        finish_reasons="stop",
        actual=_actual(usage, 77),
        overshoot_tokens=0,
    )
    line = billing_comment(call, settled)
    assert line.startswith(b": billing ") and line.endswith(b"\n") and line.count(b"\n") == 1
    assert orjson.loads(line.removeprefix(b": billing ")) == {
        "request_id": call.request_id,
        "run_id": call.run_id,
        "outcome": "ok",
        "input_tokens": 12,
        "cached_input_tokens": 2,
        "output_tokens": 9,
        "reasoning_tokens": 5,
        "audio_output_tokens": 3,
        "usage_source": "provider",
        "cost_micros": 77,
    }


async def test_a_calls_lease_is_its_upstreams_timeout_and_the_margin(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A whole answer never renews its lease: it must outlast the upstream's timeout by the
    margin (its connect, its settle), or a reaper bills a healthy call at its reserve."""
    proxy = await make_proxy(
        upstreams=upstream_timing_out(fake.base_url, 5),
        limits={"lease_margin_s": 600, "reaper_interval_s": 60, "reap_grace_s": 120},
    )
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "fake": {"hold": True}}
    async with aiohttp.ClientSession() as session:
        answer = asyncio.ensure_future(
            session.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
            )
        )
        try:
            await until_upstream_received(fake, 1)
            leases = await redis_client.zrange("lbp:{team-a}:leases", 0, -1, withscores=True)
            assert len(leases) == 1, leases
            expiry_ms = float(leases[0][1])
            seconds, micros = await redis_client.time()
            left_ms = expiry_ms - (int(seconds) * 1000 + int(micros) // 1000)
        finally:
            fake.release()
            resp = await answer
            await resp.read()
    assert resp.status == 200
    # 605 s from its reserve (a few of them gone by now); 5 s alone without the margin.
    assert 300_000 < left_ms <= 605_000, left_ms


CLAMP = {"standard": {"run": {"output_tokens": 6}, "on_budget_short": "clamp", "min_output_tokens": 2}}


async def test_a_clamped_call_billed_at_its_reserve_is_billed_the_clamped_output(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A call whose output cap the budget lowered, then timed out (no usage): billed at what it
    reserved, the lowered output, never at the cap it asked for, past its budget."""
    proxy = await make_proxy(upstreams=upstream_timing_out(fake.base_url, 1), tiers=CLAMP)
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "fake": {"mode": "stall_before_headers", "stall_s": 30},
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp,
    ):
        assert resp.status == 504, await resp.text()
        assert resp.headers["x-billing-output-tokens"] == "6"
    assert fake.received[-1].body["max_tokens"] == 6  # clamped
    (entry,) = await _ledger(redis_client)
    assert (entry["outcome"], entry["usage_source"], entry["clamped"]) == ("upstream_timeout", "reserve", "1")
    assert entry["output_tokens"] == entry["reserved_output_tokens"] == "6", entry
    assert entry["overshoot_tokens"] == "0", entry


async def test_a_clamp_tier_request_whose_least_output_of_every_choice_never_fits_gets_no_retry_after(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """n=2 at its least output (5 each) needs 9 + 10 = 19 of a window of 16: never served, so no
    reset is named, though one choice's least output alone (14) would fit."""
    proxy = await make_proxy(
        tiers={
            "standard": {
                "windows": [{"period": "minute", "total_tokens": 16}],
                "on_budget_short": "clamp",
                "min_output_tokens": 5,
            }
        }
    )
    with pytest.raises(openai.RateLimitError) as caught:
        await budget_call(proxy, "never", max_tokens=100, n=2)
    headers = caught.value.response.headers
    assert headers["x-should-retry"] == "false"
    assert "retry-after" not in headers, dict(headers)
    assert fake.received == []


async def test_a_reaped_stream_is_named_a_stream_at_the_tier_it_asked_for(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The reaper's entry is written from what the reserve kept of the call: a priority stream
    reaped is a stream, at the priority tier (whose prices its reserve was at)."""
    price = {"input": "1", "output": "2"}
    model = {
        "upstream": "openai",
        "price_per_million": price,
        "service_tiers": {"priority": {"input": "2", "output": "4"}},
    }
    proxy = await make_proxy(
        models={"gpt-4o-mini": model}, limits={"reaper_interval_s": 0.05, "reap_grace_s": 0}
    )
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "stream": True,
        "service_tier": "priority",
        "fake": {"hold": True},
    }
    await post_and_expire_its_lease(proxy, redis_client, body, "reaped-stream", held=fake)
    (entry,) = await _ledger(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("lease_expired", "reserve")
    assert (entry["stream"], entry.get("service_tier")) == ("1", "priority"), entry


async def test_a_reapers_settle_after_the_calls_own_gets_no_entry(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A reaper that listed a lease just before the call's own settle landed: its settle finds
    the call's marker and gets nothing (it would count the call's entry as one it reaped); the
    call's own settle sent again gets its entry."""
    store = RedisStore.from_url(redis_server.url)
    await store.load_scripts()
    scope = Scope(name="run", key="lbp:{team-a}:run:r")
    figures = {"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12}
    try:
        reserved = await store.reserve(
            tenant="team-a",
            reservation_id="owned",
            run_id="r",
            scopes=[scope],
            amounts=figures,
            lease_ms=60_000,
            record='{"run_id": "r"}',
        )
        assert isinstance(reserved, Reservation)

        async def settle(outcome: str, *, own: bool = False, reaper_try: str | None = None) -> str | None:
            return await store.settle(
                tenant="team-a",
                reservation_id="owned",
                run_id="r",
                scope_keys=[scope.key],
                actual=figures,
                entry={"outcome": outcome},
                own=own,
                reaper_try=reaper_try,
            )

        own = await settle("ok", own=True)
        assert own is not None
        assert await settle("lease_expired", reaper_try="r0123") is None
        assert await settle("lease_expired") is None
        assert await settle("ok", own=True) == own
    finally:
        await store.close()
    assert [e["outcome"] for e in await _ledger(redis_client)] == ["ok"]


async def test_a_clamp_on_a_total_tokens_ceiling_leaves_room_for_the_input(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A run of 20 total tokens and a request of 9 input: its output cap is lowered to the 11
    left once the input is held, and it is served, not refused."""
    tier = {"standard": {"run": {"total_tokens": 20}, "on_budget_short": "clamp", "min_output_tokens": 2}}
    proxy = await make_proxy(tiers=tier)
    response = await budget_call(proxy, "total-clamp", max_tokens=100)
    assert fake.received[-1].body["max_tokens"] == 11
    headers = response.headers
    billed = int(headers["x-billing-input-tokens"]) + int(headers["x-billing-output-tokens"])
    assert headers["x-budget-remaining-total-tokens"] == str(20 - billed)


async def test_a_call_continuing_a_context_and_naming_an_item_reserves_both(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The provider reads both into the input: the context the call continues (its kept size,
    input and output) and the stored item it names (its answer's output): each reserved."""
    proxy = await make_proxy()
    client = proxy.client()
    earlier = await client.responses.create(
        model="gpt-4o-mini", input="hello", extra_body={"fake": {"usage": {"input_tokens": 1000}}}
    )
    (item,) = await answer_items(
        client, stream=False, input="hello", extra_body={"fake": {"reply_tokens": 60}}
    )
    reply = await client.responses.with_raw_response.create(
        model="gpt-4o-mini",
        previous_response_id=earlier.id,
        input=[{"type": "item_reference", "id": item}],
        max_output_tokens=16,
    )
    third = next(e for e in await _ledger(redis_client) if e["request_id"] == reply.headers["x-request-id"])
    # The context alone is 1000 and more, the item 60: reserved at the item alone, 60 and the text.
    assert int(third["reserved_input_tokens"]) >= 1000 + 60, third


async def test_a_reapers_unsure_settle_is_tried_again_in_its_own_tenants_round_only(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A reaper's settle of team-a whose reply was lost waits for team-a's round: on a Cluster,
    team-b's round must not hang on team-a's master (down, maybe) nor count team-a's entry."""
    store = RedisStore.from_url(redis_server.url)
    await store.load_scripts()
    scope = Scope(name="run", key="lbp:{team-a}:run:r")
    figures = {"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12}
    try:
        reserved = await store.reserve(
            tenant="team-a",
            reservation_id="unsure",
            run_id="r",
            scopes=[scope],
            amounts=figures,
            lease_ms=60_000,
            record='{"run_id": "r"}',
        )
        assert isinstance(reserved, Reservation)
        entry = {"outcome": "lease_expired", "reservation_id": "unsure"}
        attempt = reaper_line(
            tenant="team-a",
            reservation_id="unsure",
            run_id="r",
            scope_keys=[scope.key],
            actual=figures,
            entry=entry,
            scope_ttls_s=[],
            runlog_ttl_s=0,
            marker_ttl_s=0,
        )
        unsure = {"unsure": attempt}
        assert await reap_tenant(store, "team-b", unsure=unsure) == []
        assert unsure == {"unsure": attempt}
        assert await redis_client.xlen("lbp:{team-a}:ledger") == 0
        assert await reap_tenant(store, "team-a", unsure=unsure) == [entry]
        assert unsure == {}
    finally:
        await store.close()


def test_a_call_billed_wholly_at_its_reserve_is_priced_at_the_dearest_rates() -> None:
    """No usage came: nobody knows which kinds its tokens were, so its output is priced at the
    dearest output rate (all of it may have been reasoning), as the reserve was."""
    price = {"input": "1", "output": "10", "reasoning": "30"}
    models: dict[str, Any] = {"gpt-4o-mini": {"upstream": "openai", "price_per_million": price}}
    call = planned(chat(max_tokens=50), **models)
    usage = reserve_usage(call.reserved_input_tokens, 50)
    assert not usage.input_known
    assert _cost(call, usage) == call.reserved_input_tokens * 1 + 50 * 30


def test_a_window_that_reset_while_the_reserve_ran_still_names_a_retry_after_of_a_second() -> None:
    """The window was read by the store's clock before the reserve; its reset may be past by the
    time the refusal is written: retry-after is never 0 nor negative."""
    window = Scope(
        name="key:minute", key="lbp:{team-a}:key:a-ci:minute", ceilings={"requests": 1}, resets_at_s=1000
    )
    refusal = Refusal(scope=window, meter="requests", ceiling=1, used=1, reserved=0, amount=1)
    for now_s in (999.5, 1000.2, 1003.0):
        assert _refusal_error(refusal, now_s=now_s).headers["retry-after"] == "1", now_s
