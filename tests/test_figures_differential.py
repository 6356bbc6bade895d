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


# What the provider bills for each case of test_figures_differential, worked out by hand from
# the fake's token rule (words + 3 per message; 6 reply tokens) and the usage each case sends,
# not read from the proxy: (input, cached input, cache writes, of them kept 1 h, output,
# reasoning, cost in micro-units at test_figures_differential.PRICE, rounded up once).
#   chat:      4 x 3 + 2 x 0.3 + 3 x 15 + 3 x 20                       = 117.6 -> 118
#   responses: "a b c" is 3 words (no role item): 1 x 3 + 0.6 + 45 + 60 = 108.6 -> 109
#   messages:  6 + 40 read + 30 written (10 for 5 min, 20 for 1 h):
#              6 x 3 + 40 x 0.3 + 10 x 3.75 + 20 x 6 + 6 x 15          = 277.5 -> 278
#   messages_full_delta: the 30 written with no split, kept as the request asked (5 min):
#              18 + 12 + 30 x 3.75 + 90                                = 232.5 -> 233
EXPECTED: dict[str, dict[str, str]] = {
    "chat": {
        "input_tokens": "6",
        "cached_input_tokens": "2",
        "cache_creation_input_tokens": "0",
        "cache_creation_1h_input_tokens": "0",
        "output_tokens": "6",
        "reasoning_tokens": "3",
        "cost_micros": "118",
    },
    "responses": {
        "input_tokens": "3",
        "cached_input_tokens": "2",
        "cache_creation_input_tokens": "0",
        "cache_creation_1h_input_tokens": "0",
        "output_tokens": "6",
        "reasoning_tokens": "3",
        "cost_micros": "109",
    },
    "messages": {
        "input_tokens": "76",
        "cached_input_tokens": "40",
        "cache_creation_input_tokens": "30",
        "cache_creation_1h_input_tokens": "20",
        "output_tokens": "6",
        "reasoning_tokens": "0",
        "cost_micros": "278",
    },
    "messages_full_delta": {
        "input_tokens": "76",
        "cached_input_tokens": "40",
        "cache_creation_input_tokens": "30",
        "cache_creation_1h_input_tokens": "0",
        "output_tokens": "6",
        "reasoning_tokens": "0",
        "cost_micros": "233",
    },
}


@pytest.mark.parametrize("case", list(CASES))
async def test_streamed_and_whole_answers_write_the_same_figures(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, case: str
) -> None:
    """Each part, and the cost, held to the provider's bill worked out by hand: held only to each
    other and their input and output totals to the fake's bill, the two entries passed with
    Anthropic's cache writes read as reads or 1-hour writes priced at 5 minutes' (the vacuous-
    tests hunt)."""
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
    # The fake's bill, pinned to the hand-worked figures (the oracle itself is checked), and each
    # entry's parts and cost to them.
    want = EXPECTED[case]
    for bill in fake.bill:
        anthropic = path == "/v1/messages"
        cached = bill.cache_read_tokens if anthropic else bill.cached_tokens
        told = (cached, bill.cache_creation_tokens, bill.completion_tokens, bill.reasoning_tokens)
        names = ("cached_input_tokens", "cache_creation_input_tokens", "output_tokens", "reasoning_tokens")
        assert tuple(str(n) for n in told) == tuple(want[name] for name in names), bill
    assert whole == {**want, "usage_source": "provider", "outcome": "ok"}, (case, whole)
