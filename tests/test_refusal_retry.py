"""A budget refusal tells the client whether trying again can help: x-should-retry: true and a
short retry-after only when every ceiling in its way is held by calls in flight (a tentative
byte-length input, a clamp tier's least output taken into account); else the time the last
window in its way resets, or nothing for a scope that never resets.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from proxy.tokenizer import Tokenizer
from tests.conftest import KEY_A, ProxyFactory, until_upstream_received
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import ScriptedUpstream
from tests.test_estimate import EXACT_INPUT, TEXT, QuarterEncoding
from tests.test_pricing_kinds import GPT5, _chat_answer

MODEL = "gpt-4o-mini"
SHORT = [{"role": "user", "content": "hi"}]


async def _in_flight(
    client: openai.AsyncOpenAI, upstream: FakeUpstream, *, max_tokens: int, **fake: Any
) -> asyncio.Task[Any]:
    """A call that holds its reserve (and its concurrency slot) until the test calls
    ``upstream.release()``, well under way (a fixed delay may end first on a loaded machine)."""
    slow = asyncio.create_task(
        client.chat.completions.create(
            model=MODEL,
            messages=SHORT,
            max_tokens=max_tokens,
            extra_headers={"X-Run-Id": "slow"},
            extra_body={"fake": {"hold": True, **fake}},
        )
    )
    await until_upstream_received(upstream, len(upstream.received) + 1)
    return slow


async def _refused_while_one_in_flight(
    proxy: Any, upstream: FakeUpstream, messages: list[dict[str, Any]], **kw: Any
) -> Any:
    client = proxy.client()
    slow = await _in_flight(client, upstream, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=messages, extra_headers={"X-Run-Id": "next"}, **kw
        )
    upstream.release()
    await slow
    # Once the call in flight ended, the very same request is served.
    again = await client.chat.completions.create(
        model=MODEL, messages=messages, extra_headers={"X-Run-Id": "next2"}, **kw
    )
    assert again.choices
    return caught.value.response


async def test_tentative_reserve_refused_on_concurrency_says_retry(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # key: one call at a time; tenant day: input tokens between the exact count and the byte bound.
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": QuarterEncoding()}),
        tiers={
            "standard": {
                "key": {"concurrent": 1},
                "tenant": [{"period": "day", "input_tokens": EXACT_INPUT + 100}],
            }
        },
    )
    response = await _refused_while_one_in_flight(
        proxy, fake, [{"role": "user", "content": TEXT}], max_tokens=5
    )
    assert response.headers["x-billing-refused-meter"] == "concurrent"
    # The room lacking is held only by the call in flight: the retry above was served.
    assert response.headers["x-should-retry"] == "true", dict(response.headers)


async def test_exact_reserve_refused_on_concurrency_says_retry_control(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(
        tiers={
            "standard": {
                "key": {"concurrent": 1},
                "tenant": [{"period": "day", "input_tokens": 1000}],
            }
        },
    )
    response = await _refused_while_one_in_flight(proxy, fake, SHORT, max_tokens=5)
    assert response.headers["x-should-retry"] == "true"


async def test_clamp_tier_refusal_that_clears_once_in_flight_ends_says_retry(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Clamp tier, output ceiling 100. A call in flight reserves 95 of it; the next asks 50 with a
    # floor of 10: refused now (5 left), clamped to a served call once the first ends.
    proxy = await make_proxy(
        tiers={
            "standard": {
                "key": {"output_tokens": 100},
                "on_budget_short": "clamp",
                "min_output_tokens": 10,
            }
        },
    )
    client = proxy.client()
    slow = await _in_flight(client, fake, max_tokens=95, reply_tokens=2)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=SHORT, max_tokens=200, extra_headers={"X-Run-Id": "next"}
        )
    fake.release()
    await slow
    again = await client.chat.completions.create(
        model=MODEL, messages=SHORT, max_tokens=200, extra_headers={"X-Run-Id": "next2"}
    )
    assert again.choices  # served (clamped) once the call in flight ended
    assert caught.value.response.headers["x-should-retry"] == "true", dict(caught.value.response.headers)


async def test_a_window_that_blocks_gives_its_reset_even_when_another_scope_is_refused_first(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(
        tiers={"standard": {"key": {"concurrent": 1}, "windows": [{"period": "minute", "requests": 1}]}}
    )
    client = proxy.client()
    slow = await _in_flight(client, fake, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=5)
    fake.release()
    await slow
    headers = caught.value.response.headers
    assert headers["x-billing-refused-scope"] == "key" and headers["x-should-retry"] == "false"
    # The request fits again when the minute window resets: the only hint a client could get.
    assert "retry-after" in headers, dict(headers)


async def test_a_reaped_priority_call_names_its_tier(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = await make_proxy(
        upstreams={
            # Room for the scripted answer on a loaded machine; the lease (1.2 s) still runs out soon.
            "openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 1}
        },
        models={"gpt-5": GPT5},
        redis={"socket_timeout_s": 0.7},  # below two thirds of the lease
        limits={"lease_margin_s": 0.2, "reaper_interval_s": 0.1},
    )
    script.plan = _chat_answer("gpt-5", {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12})

    async def died(store: Any, journal: Any, pending: Any, **_: Any) -> tuple[None, bool]:
        return None, False  # the process died before its settle reached the store

    monkeypatch.setattr("proxy.settle.settle_or_journal", died)
    body = {
        "model": "gpt-5",
        "service_tier": "priority",
        "max_completion_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "reaped"},
        ) as resp,
    ):
        assert resp.status == 200
    for _ in range(100):
        rows = await redis_client.xrange("lbp:{team-a}:ledger")
        if rows:
            break
        await asyncio.sleep(0.1)
    [(_, entry)] = rows
    assert entry["outcome"] == "lease_expired"
    # Billed at the priority tier's dearest rates (the reserve's): right.
    assert int(entry["cost_micros"]) > 0
    assert entry.get("service_tier") == "priority", entry
