"""A model's dearer prices past a number of input tokens (``models.X.long_context``): the whole
call, input and output, at them, as Gemini's Pro models and OpenAI's price lists bill a call past
200K or 272K input tokens; reserved at them when its input estimate passes the threshold."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.tokenizer import Tokenizer
from tests.conftest import ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream
from tests.test_billed_usage import planned
from tests.test_config import UP, error_of
from tests.test_estimate import QuarterEncoding
from tests.test_pricing_kinds import _chat_answer, _claude_message, _entry, _post
from tests.test_stream_dialects import ev
from tests.test_tool_fees import SEARCH_MICROS, WEB_SEARCH
from tests.test_tool_fees_and_tiers import searched

PRICE = {"input": "1.25", "cached_input": "0.125", "output": "10"}
LONG = {"input": "2.5", "cached_input": "0.25", "output": "15"}
MODEL = {
    "upstream": "openai",
    "price_per_million": PRICE,
    "service_tiers": {"priority": {"input": "2.5", "output": "20"}},
    "long_context": {
        "above_input_tokens": 200_000,
        "price_per_million": LONG,
        "service_tiers": {"priority": {"input": "5", "output": "30"}},
    },
}


@pytest.mark.parametrize(
    ("usage", "asked", "served", "cost_micros"),
    [
        # At the threshold: its own prices.
        ({"prompt_tokens": 200_000}, None, None, 200_000 * 1.25 + 2_000 * 10),
        # One past it: the whole call at the long-context prices (500,002.5 rounded up).
        ({"prompt_tokens": 200_001}, None, None, 530_003),
        # Cached input counts toward the threshold, and is priced at its long-context price.
        (
            {"prompt_tokens": 250_000, "prompt_tokens_details": {"cached_tokens": 100_000}},
            None,
            None,
            150_000 * 2.5 + 100_000 * 0.25 + 2_000 * 15,
        ),
        # A processing tier past the threshold: that tier's long-context prices.
        ({"prompt_tokens": 300_000}, "priority", "priority", 300_000 * 5 + 2_000 * 30),
        # Asked for nothing, served by priority, as its answer says.
        ({"prompt_tokens": 300_000}, None, "priority", 300_000 * 5 + 2_000 * 30),
        ({"prompt_tokens": 100_000}, "priority", "priority", 100_000 * 2.5 + 2_000 * 20),
    ],
)
async def test_a_call_past_the_threshold_is_billed_at_the_long_context_prices(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    usage: dict[str, Any],
    asked: str | None,
    served: str | None,
    cost_micros: float,
) -> None:
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gpt-long": MODEL},
    )
    told = {**usage, "completion_tokens": 2_000, "total_tokens": usage["prompt_tokens"] + 2_000}
    script.plan = _chat_answer("gpt-long", told, served)
    request: dict[str, Any] = {"model": "gpt-long", "messages": [{"role": "user", "content": "hi"}]}
    if asked is not None:
        request["service_tier"] = asked
    status, _ = await _post(proxy.url, "/v1/chat/completions", request, "long")
    assert status == 200
    entry = await _entry(redis_client)
    assert int(entry["cost_micros"]) == cost_micros
    assert entry["usage_source"] == "provider"


async def test_a_call_whose_estimate_passes_the_threshold_is_reserved_at_the_long_context_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """Three models of the same prices, one without long-context prices, one whose threshold the
    request's input estimate passes, one whose threshold it does not: a cost ceiling of one
    micro-unit refuses each, naming the cost its reserve needs."""
    short = {"input": "1", "output": "10"}
    long = {"input": "2", "output": "15"}

    def model(above: int | None) -> dict[str, Any]:
        extra = {"long_context": {"above_input_tokens": above, "price_per_million": long}} if above else {}
        return {"upstream": "openai", "price_per_million": short, **extra}

    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"m-flat": model(None), "m-past": model(10), "m-below": model(1_000_000)},
        tiers={"standard": {"run": {"cost_usd": "0.000001"}}},
    )
    needs = {}
    for name in ("m-flat", "m-past", "m-below"):
        request = {"model": name, "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 1000}
        status, raw = await _post(proxy.url, "/v1/chat/completions", request, name)
        assert status == 429
        needs[name] = int(json.loads(raw)["error"]["message"].rsplit(" ", 1)[1].rstrip("."))
    estimated = needs["m-flat"] - 1000 * 10  # its input tokens, at 1 micro-unit each
    assert estimated > 10
    assert needs["m-past"] == estimated * 2 + 1000 * 15
    assert needs["m-below"] == needs["m-flat"]
    assert script.received == []


async def test_long_context_prices_below_the_models_own_still_reserve_the_dearest(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Long-context prices the config sets below the model's own (its input, its output, or
    both): a call whose estimate passes the threshold and whose told input is within it is billed
    at the model's own, so the reserve holds each price at the dearer of the two. Was: reserved at
    the long-context prices alone, a call the cost ceiling admitted billed 7 times past it."""
    own = {"input": "2", "output": "15"}
    models: dict[str, dict[str, str] | None] = {
        "m-flat": None,
        "m-cheap": {"input": "1", "output": "10"},
        "m-cheap-input": {"input": "1", "output": "20"},
    }

    def model(long: dict[str, str] | None) -> dict[str, Any]:
        extra = {"long_context": {"above_input_tokens": 10, "price_per_million": long}} if long else {}
        return {"upstream": "openai", "price_per_million": own, **extra}

    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={name: model(long) for name, long in models.items()},
        tiers={"standard": {"run": {"cost_usd": "0.000001"}}},
    )
    needs = {}
    for name in models:
        request = {"model": name, "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 1000}
        status, raw = await _post(proxy.url, "/v1/chat/completions", request, name)
        assert status == 429, raw
        needs[name] = int(json.loads(raw)["error"]["message"].rsplit(" ", 1)[1].rstrip("."))
    estimated = (needs["m-flat"] - 1000 * 15) // 2
    assert estimated > 10
    assert needs["m-cheap"] == needs["m-flat"]  # the model's own prices, not 1 and 10
    assert needs["m-cheap-input"] == estimated * 2 + 1000 * 20  # each at its dearer
    assert script.received == []

    # Admitted under a ceiling its reserve fits, told an input within the threshold: billed at
    # the model's own prices, within the ceiling.
    ceiling_micros = needs["m-cheap"]
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"m-cheap": model(models["m-cheap"])},
        tiers={"standard": {"run": {"cost_usd": f"0.{ceiling_micros:06d}"}}},
    )
    told = {"prompt_tokens": 7, "completion_tokens": 1000, "total_tokens": 1007}
    script.plan = _chat_answer("m-cheap", told, None)
    request = {"model": "m-cheap", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 1000}
    status, raw = await _post(proxy.url, "/v1/chat/completions", request, "admitted")
    assert status == 200, raw
    entry = await _entry(redis_client)
    assert int(entry["cost_micros"]) == 7 * 2 + 1000 * 15 <= ceiling_micros, entry


def test_long_context_prices_below_the_models_own_are_reserved_at_the_dearer_of_each_tier() -> None:
    """The dearest of the tiers that may serve the call, each price at the dearer of its own and
    its long-context one: as reserved past the threshold by the estimate, and as taken up when a
    context the call continues takes its input past it (``reserve_rates_long``)."""
    tiered = {
        "upstream": "openai",
        "price_per_million": {"input": "2", "output": "15"},
        "service_tiers": {"priority": {"input": "4", "output": "30"}},
        "long_context": {
            "price_per_million": {"input": "3", "output": "10"},
            "service_tiers": {"priority": {"input": "5", "output": "20"}},
        },
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}
    dearer = {"input": 5_000_000, "output": 30_000_000}

    def above(tokens: int) -> dict[str, Any]:
        return {**tiered, "long_context": {**tiered["long_context"], "above_input_tokens": tokens}}

    past = planned(body, m=above(10))
    reserved = past.rates_reserved
    assert reserved is not None and {kind: reserved[kind] for kind in dearer} == dearer
    assert past.reserve_rates_short is not None and past.reserve_rates_short["output"] == 30_000_000
    within = planned(body, m=above(10**6))
    assert within.reserve_rates_long is not None
    assert {kind: within.reserve_rates_long[kind] for kind in dearer} == dearer


def test_long_context_prices_are_checked_against_the_models_prices() -> None:
    priced = {"upstream": "openai", "price_per_million": PRICE}
    long = {"above_input_tokens": 200_000, "price_per_million": LONG}

    def models(model: dict[str, Any]) -> dict[str, Any]:
        return {**UP, "models": {"m": model}}

    # Nothing to be dearer than: an unpriced model's calls cost 0.
    assert "long_context: price_per_million" in error_of(models({"upstream": "openai", "long_context": long}))
    # A tier's long calls at its short prices would be billed below their cost.
    tiered = {**priced, "service_tiers": {"priority": PRICE}}
    unpriced = error_of(models({**tiered, "long_context": long}))
    assert "no long-context prices for the tier 'priority'" in unpriced
    stray = {**long, "service_tiers": {"flex": LONG}}
    assert "long_context.service_tiers.flex" in error_of(models({**priced, "long_context": stray}))
    for threshold in (0, -1, True, "many"):
        assert "above_input_tokens" in error_of(
            models({**priced, "long_context": {**long, "above_input_tokens": threshold}})
        )


async def test_a_stream_cut_after_its_input_was_told_is_billed_at_the_long_context_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Anthropic told the input in ``message_start``, then the stream broke: the provider's
    input and the reserved output, both at the long-context prices when the input passes the
    threshold (the reserve, from a short estimate, was at the short ones)."""
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    long = {"above_input_tokens": 200_000, "price_per_million": {"input": "6", "output": "22.5"}}
    price = {"input": "3", "output": "15"}
    model = {"upstream": "anthropic", "price_per_million": price, "long_context": long}
    proxy = await make_proxy(upstreams={"anthropic": upstream}, models={"claude-long": model})
    start = {**_claude_message({"input_tokens": 300_000, "output_tokens": 1}), "content": []}
    script.plan = Plan(content_type="text/event-stream", chunks=[ev("message_start", {"message": start})])
    request = {
        "model": "claude-long",
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    status, _ = await _post(proxy.url, "/v1/messages", request, "cut")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["outcome"] == "upstream_error"
    assert (entry["input_tokens"], entry["output_tokens"]) == ("300000", "100")
    assert int(entry["cost_micros"]) == 300_000 * 6 + 100 * 22.5


US = {"input": "3.3", "output": "16.5"}


@pytest.mark.parametrize(
    ("tiers", "told", "cost_micros"),
    [
        # Was 5 * 6 + 100 * 22.5: the whole call at prices its told input never reached.
        ({}, {}, 5 * 3 + 100 * 15),
        # Was 5 * 3 + 100 * 22.5: half at the model's own prices, half at the long-context ones.
        ({}, {"service_tier": "standard"}, 5 * 3 + 100 * 15),
        # Reserved at the dearer of the default and US-only inference: the output at it, the
        # input too when the answer names no tier (1,666.5 rounded up); Anthropic's "standard"
        # capacity names none (it tells no geography: a workspace may default to the US).
        ({"us": US}, {}, 1667),
        ({"us": US}, {"service_tier": "standard"}, 1667),
        (
            {"us": US},
            {"service_tier": "standard", "speed": "standard", "inference_geo": "global"},
            5 * 3 + 100 * 16.5,
        ),
        ({"us": US}, {"inference_geo": "us"}, 1667),
    ],
    ids=[
        "told-nothing",
        "told-standard",
        "tiers-told-nothing",
        "tiers-told-standard",
        "tiers-told-global",
        "tiers-told-us",
    ],
)
async def test_a_stream_cut_after_its_input_was_told_within_the_threshold_is_billed_at_the_models_prices(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    tiers: dict[str, Any],
    told: dict[str, Any],
    cost_micros: float,
) -> None:
    """Its estimate passes the threshold (reserved at the long-context prices), then Anthropic's
    message_start tells an input of 5 tokens, within it, and the stream breaks: the told input
    and the reserved output at the model's own prices, the output at the dearest of the tiers
    that may have served it, as a reserve within the threshold is."""
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    long_tiers = {"us": {"input": "6.6", "output": "24.75"}} if tiers else {}
    long = {
        "above_input_tokens": 10,
        "price_per_million": {"input": "6", "output": "22.5"},
        "service_tiers": long_tiers,
    }
    model = {
        "upstream": "anthropic",
        "price_per_million": {"input": "3", "output": "15"},
        "service_tiers": tiers,
        "long_context": long,
    }
    proxy = await make_proxy(upstreams={"anthropic": upstream}, models={"claude-long": model})
    start = {**_claude_message({"input_tokens": 5, "output_tokens": 1, **told}), "content": []}
    script.plan = Plan(content_type="text/event-stream", chunks=[ev("message_start", {"message": start})])
    request = {
        "model": "claude-long",
        "max_tokens": 100,
        "stream": True,
        "messages": [
            {"role": "user", "content": "a long enough prompt for an estimate past ten tokens " * 3}
        ],
    }
    status, _ = await _post(proxy.url, "/v1/messages", request, "cut-short")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["outcome"] == "upstream_error"
    assert int(entry["reserved_input_tokens"]) > 10  # reserved at the long-context prices
    assert (entry["input_tokens"], entry["output_tokens"], entry["usage_source"]) == ("5", "100", "reserve")
    assert int(entry["cost_micros"]) == cost_micros, entry


async def test_an_input_told_before_a_server_tool_ran_keeps_the_long_context_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # Reserved past the threshold, message_start tells 5 input tokens, then a web search runs
    # (its results are read as input: Anthropic's later count grows) and the stream breaks: the
    # 5 told is no final input, and the provider may bill the call past the threshold.
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    long = {"above_input_tokens": 10, "price_per_million": {"input": "6", "output": "22.5"}}
    model = {
        "upstream": "anthropic",
        "price_per_million": {"input": "3", "output": "15"},
        "long_context": long,
        "price_per_thousand_calls": {"web_search": "10"},
    }
    proxy = await make_proxy(upstreams={"anthropic": upstream}, models={"claude-long": model})
    start = {**_claude_message({"input_tokens": 5, "output_tokens": 1}), "content": []}
    script.plan = Plan(content_type="text/event-stream", chunks=[b"".join(searched(start))])
    request = {
        "model": "claude-long",
        "max_tokens": 100,
        "stream": True,
        "tools": [{**WEB_SEARCH, "max_uses": 1}],
        "messages": [{"role": "user", "content": "an estimate past ten tokens, " * 5}],
    }
    status, _ = await _post(proxy.url, "/v1/messages", request, "cut-after-search")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["usage_source"] == "reserve", entry
    assert entry.get("tool_calls") == "web_search=1", entry
    # Its output at the reserve: a pass of max_tokens after the search and the last (505bf9c).
    assert int(entry["cost_micros"]) == 5 * 6 + 2 * 100 * 22.5 + SEARCH_MICROS, entry


# 20,000 characters of new text: a quick (byte) bound of 20,000 tokens, past a threshold of
# 10,000; its exact count (QuarterEncoding: a token per 4 bytes) about 5,000, well within it.
COUNTED_ABOVE = 10_000
COUNTED_TEXT = "abcd" * 5_000


def _counted_model(long_context: bool) -> dict[str, Any]:
    long = {"above_input_tokens": COUNTED_ABOVE, "price_per_million": {"input": "2", "output": "15"}}
    extra = {"long_context": long} if long_context else {}
    return {
        "upstream": "openai",
        "encoding": "o200k_base",
        "price_per_million": {"input": "1", "output": "10"},
        **extra,
    }


async def test_a_byte_bound_past_the_threshold_does_not_price_the_exact_count_at_long_context_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """A quick estimate's bound that does not fit is counted exactly, "so a budget refuses or
    clamps only on the exact count"; long-context prices apply when the input estimate passes
    the threshold. Was: the exact count (~5,000), far within it, priced at the long-context
    prices the byte bound (20,000) chose."""
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": QuarterEncoding()}),
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"m-flat": _counted_model(False), "m-long": _counted_model(True)},
        tiers={"standard": {"run": {"cost_usd": "0.000001"}}},
    )
    needs = {}
    # m-long first: its count is then remembered, and m-flat's estimate of the same text exact.
    for name in ("m-long", "m-flat"):
        request = {"model": name, "messages": [{"role": "user", "content": COUNTED_TEXT}], "max_tokens": 100}
        status, raw = await _post(proxy.url, "/v1/chat/completions", request, f"need-{name}")
        assert status == 429, raw
        needs[name] = int(json.loads(raw)["error"]["message"].rsplit(" ", 1)[1].rstrip("."))
    assert needs["m-flat"] - 100 * 10 < COUNTED_ABOVE  # the exact count is within the threshold
    assert needs["m-long"] == needs["m-flat"], needs  # was 2 * input + 15 * output
    assert script.received == []


# A stream of m-long cut after its first piece, no usage told: billed at its reserve.
CUT_CHUNK = (
    b"data: "
    + json.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m-long",
            "choices": [{"index": 0, "delta": {"content": "hel"}, "finish_reason": None}],
        }
    ).encode()
    + b"\n\n"
)
CUT_REQUEST = {
    "model": "m-long",
    "stream": True,
    "messages": [{"role": "user", "content": COUNTED_TEXT}],
    "max_tokens": 100,
}


async def test_a_byte_bound_past_the_threshold_does_not_bill_a_reserve_billed_call_at_long_context_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A stream cut before any usage is billed at its reserve, at the exact count: within the
    threshold (~5,000 input tokens), at the model's own prices. Was: at the long-context prices
    the byte bound (20,000) chose, never chosen again once counted."""
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": QuarterEncoding()}),
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"m-long": _counted_model(True)},
    )
    script.plan = Plan(content_type="text/event-stream", chunks=[CUT_CHUNK])
    status, _ = await _post(proxy.url, "/v1/chat/completions", CUT_REQUEST, "cut")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["usage_source"] == "reserve", entry
    billed_in, billed_out = int(entry["input_tokens"]), int(entry["output_tokens"])
    assert billed_in < COUNTED_ABOVE, entry  # billed at the exact count, within the threshold
    assert int(entry["cost_micros"]) == billed_in * 1 + billed_out * 10, entry


class FirstCountHeld:
    """QuarterEncoding's count, the first long text's (the background refinement's) held until
    ``gate`` is set: a later count (the settle's own) comes first."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._lock = threading.Lock()

    def encode_ordinary(self, text: str) -> list[int]:
        if len(text) >= 1_024:
            with self._lock:
                first = not self.entered.is_set()
                self.entered.set()
            if first:
                assert self.gate.wait(10), "the count was never released"
        return [0] * -(-len(text.encode()) // 4)


async def test_a_reserve_billed_call_counted_at_its_settle_is_billed_at_the_prices_its_count_chooses(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The background count has not landed when the stream is cut: the settle counts the input
    itself, and bills that count at the prices it chooses (the model's own, within the
    threshold), not at the long-context prices the byte bound chose."""
    enc = FirstCountHeld()
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}),
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"m-long": _counted_model(True)},
    )
    # The refinement's count begins (and is held) first.
    script.plan = Plan(content_type="text/event-stream", chunks=[CUT_CHUNK], delay_s=0.2)
    try:
        status, _ = await _post(proxy.url, "/v1/chat/completions", CUT_REQUEST, "cut-counted-at-settle")
    finally:
        enc.gate.set()
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["usage_source"] == "reserve", entry
    assert int(entry["reserved_input_tokens"]) > COUNTED_ABOVE, entry  # the bound, never lowered
    billed_in, billed_out = int(entry["input_tokens"]), int(entry["output_tokens"])
    assert billed_in < COUNTED_ABOVE, entry
    assert int(entry["cost_micros"]) == billed_in * 1 + billed_out * 10, entry
