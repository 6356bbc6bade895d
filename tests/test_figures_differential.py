"""The same answer streamed and not: the same figures and cost in the ledger, and the fake's own bill."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, ProxyFactory
from tests.fake_upstream import FakeUpstream

PRICE = {
    "input": "3",
    "output": "15",
    "cached_input": "0.3",
    "cache_creation_input": "3.75",
    "cache_creation_input_1h": "6",
    "reasoning": "20",
}
FIELDS = (
    "input_tokens",
    "cached_input_tokens",
    "cache_creation_input_tokens",
    "cache_creation_1h_input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "usage_source",
    "cost_micros",
    "outcome",
)


async def _proxy(make_proxy: ProxyFactory, fake: FakeUpstream) -> Any:
    upstreams = {
        "openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY"},
        "anthropic": {"base_url": fake.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"},
    }
    models = {
        "claude-x": {"upstream": "anthropic", "price_per_million": PRICE},
        "gpt-x": {"upstream": "openai", "price_per_million": PRICE},
    }
    return await make_proxy(upstreams=upstreams, models=models)


CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "gpt-x", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 20},
        {"prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens_details": {"reasoning_tokens": 3}},
    ),
    "responses": (
        "/v1/responses",
        {"model": "gpt-x", "input": "a b c", "max_output_tokens": 20},
        {"input_tokens_details": {"cached_tokens": 2}, "output_tokens_details": {"reasoning_tokens": 3}},
    ),
    "messages": (
        "/v1/messages",
        {"model": "claude-x", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 20},
        {
            "cache_read_input_tokens": 40,
            "cache_creation_input_tokens": 30,
            "cache_creation": {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 20},
        },
    ),
    "messages_full_delta": (
        "/v1/messages",
        {"model": "claude-x", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 20},
        {"cache_read_input_tokens": 40, "cache_creation_input_tokens": 30},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_streamed_and_whole_answers_write_the_same_figures(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, case: str
) -> None:
    proxy = await _proxy(make_proxy, fake)
    path, body, usage = CASES[case]
    for stream in (False, True):
        ctl: dict[str, Any] = {"reply_tokens": 6, "usage": usage}
        if case.endswith("full_delta"):
            ctl["full_delta_usage"] = True
        headers = {
            "Authorization": f"Bearer {KEY_A}",
            "anthropic-version": "2023-06-01",
            "X-Run-Id": f"{case}{stream}",
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                proxy.url + path, json={**body, "stream": stream, "fake": ctl}, headers=headers
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
            await resp.read()
        await proxy.recorded()
    raw = await redis_client.xrange("lbp:{team-a}:ledger")
    entries = [dict(f) for _, f in raw]
    assert len(entries) == 2
    whole, streamed = ({k: e.get(k, "0") for k in FIELDS} for e in entries)
    assert whole == streamed
    # Both billed on the provider's figures, as the fake billed them (Anthropic's cache reads
    # and writes on top of its input_tokens).
    for entry, bill in zip(entries, fake.bill, strict=True):
        prompt = bill.prompt_tokens + bill.cache_read_tokens + bill.cache_creation_tokens
        assert (int(entry["input_tokens"]), int(entry["output_tokens"])) == (prompt, bill.completion_tokens)
