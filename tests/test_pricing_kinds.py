"""Token kinds a provider prices apart from plain text: each billed at its own price, and named
alike in the ledger, the stream's billing comment, the token counters and the report.
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from proxy.observe import Observation, parse_usage
from proxy.observe_responses import _with_image_tokens
from proxy.report import TOKEN_FIELDS
from proxy.state import STATE
from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream
from tests.test_observe import SONAR_DEEP_RESEARCH_USAGE

# gpt-4o-audio-preview's list prices per million: text 2.5 in, 10 out; audio 40 in, 80 out.
AUDIO_PRICE = {"input": "2.5", "output": "10", "audio_input": "40", "audio_output": "80"}
# Claude Sonnet 4.5's: input 3, output 15, cache reads 0.30, writes 3.75 (5 minutes), 6 (an hour).
CLAUDE_PRICE = {
    "input": "3",
    "output": "15",
    "cached_input": "0.3",
    "cache_creation_input": "3.75",
    "cache_creation_input_1h": "6",
}


def _sse(event: str, obj: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(obj)}\n\n".encode()


async def _post(url: str, path: str, body: dict[str, Any], run: str) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run, "anthropic-version": "2023-06-01"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.read()


async def _claude_proxy(make_proxy: ProxyFactory, script: ScriptedUpstream) -> Proxy:
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    return await make_proxy(
        upstreams={"anthropic": upstream},
        models={"claude-sonnet-4-5": {"upstream": "anthropic", "price_per_million": CLAUDE_PRICE}},
    )


def _claude_message(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "m",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": usage,
    }


def _claude_request(content: Any = "hi", *, max_tokens: int = 100, **extra: Any) -> dict[str, Any]:
    """A Messages request to CLAUDE_PRICE's model: one user message of ``content``."""
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": max_tokens,
        **extra,
        "messages": [{"role": "user", "content": content}],
    }


def _chat_answer(model: str, usage: dict[str, Any], served: str | None = None) -> Plan:
    answer = {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": usage,
    }
    if served is not None:
        answer["service_tier"] = served
    return Plan(chunks=[json.dumps(answer).encode()])


async def _entry(redis_client: aioredis.Redis) -> dict[str, str]:
    [(_, fields)] = await redis_client.xrange("lbp:{team-a}:ledger")
    return dict(fields)


async def test_audio_tokens_are_billed_at_their_own_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gpt-4o-audio-preview": {"upstream": "openai", "price_per_million": AUDIO_PRICE}},
    )
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 500,
        "total_tokens": 600,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 80, "text_tokens": 20},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 400, "text_tokens": 100},
    }
    script.plan = _chat_answer("gpt-4o-audio-preview", usage)
    request = {
        "model": "gpt-4o-audio-preview",
        "modalities": ["text", "audio"],
        "messages": [{"role": "user", "content": "say hi"}],
        "max_completion_tokens": 1000,
    }
    status, _ = await _post(proxy.url, "/v1/chat/completions", request, "audio")
    assert status == 200
    entry = await _entry(redis_client)
    assert int(entry["cost_micros"]) == 20 * 2.5 + 80 * 40 + 100 * 10 + 400 * 80  # 36,250, not 5,250
    assert (entry["audio_input_tokens"], entry["audio_output_tokens"]) == ("80", "400")


def test_output_parts_told_past_their_whole_raise_the_whole() -> None:
    """1,290 images and 200 reasoning tokens told in 1,000 of output: the cost capped the images
    at the 800 the count left while the ledger named 1,290 (a report rebuilt from it billed
    another figure), the provider having written at least 1,490 (the views hunt). The output is
    at least its parts, each then priced as its kind; audio alike."""
    told = {
        "prompt_tokens": 10,
        "completion_tokens": 1000,
        "total_tokens": 1010,
        "completion_tokens_details": {"reasoning_tokens": 200, "image_tokens": 1290},
    }
    usage = parse_usage(told)
    assert usage is not None
    assert (usage.output_tokens, usage.reasoning_tokens, usage.image_output_tokens) == (1490, 200, 1290)
    audio = parse_usage({**told, "completion_tokens_details": {"audio_tokens": 1200}})
    assert audio is not None and audio.output_tokens == 1200
    details = {"reasoning_tokens": 200, "image_tokens": 700}
    within = parse_usage({**told, "completion_tokens_details": details})
    assert within is not None and within.output_tokens == 1000  # parts within it: as told


def test_the_image_tool_s_output_told_without_its_split_is_all_images() -> None:
    """``output_tokens_details`` "can be omitted" (the SDK's ``ToolUsage``): the tool's output is
    then all images (gpt-image-1 writes nothing else), as an unsure reading bills the more; a
    split told is taken, and one that does not add up is not."""
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}

    def image_usage(image_gen: dict[str, Any]) -> tuple[int, int]:
        obs = Observation()
        parsed = parse_usage(usage)
        assert parsed is not None
        obs.take_usage(_with_image_tokens(parsed, {"image_gen": image_gen}))
        assert obs.usage is not None
        return obs.usage.image_input_tokens, obs.usage.image_output_tokens

    assert image_usage({"input_tokens": 40, "output_tokens": 1000}) == (40, 1000)
    told = {"image_tokens": 900, "text_tokens": 100}
    split = {"input_tokens": 40, "output_tokens": 1000, "output_tokens_details": told}
    assert image_usage(split) == (40, 900)
    short = {"image_tokens": 10, "text_tokens": 20}
    assert image_usage({"input_tokens": 40, "input_tokens_details": short, "output_tokens": 0}) == (40, 0)


async def test_an_image_model_s_images_are_billed_and_reserved_at_the_image_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """An image model behind a chat endpoint (OpenRouter's Gemini image models: text out at 2.50,
    images at 30 per million) tells the images it wrote in ``completion_tokens_details``; a call
    asking for them (``modalities``) reserves its output at the image price."""
    price = {"input": "0.3", "output": "2.5", "image_output": "30"}
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gemini-image": {"upstream": "openai", "price_per_million": price}},
        tiers={"standard": {"run": {"cost_usd": "0.000001"}}},
    )
    request = {
        "model": "gemini-image",
        "modalities": ["image", "text"],
        "messages": [{"role": "user", "content": "a cat"}],
        "max_completion_tokens": 2000,
    }
    status, answer = await _post(proxy.url, "/v1/chat/completions", request, "reserve")
    assert status == 429, answer
    needs = int(re.search(rb"this request needs (\d+)", answer).group(1))  # type: ignore[union-attr]
    assert needs >= 2000 * 30, answer  # 2,000 output tokens at 30 per million, not 2.5
    text_only = {**request, "modalities": ["text"]}
    status, answer = await _post(proxy.url, "/v1/chat/completions", text_only, "text")
    assert status == 429, answer
    assert int(re.search(rb"this request needs (\d+)", answer).group(1)) < 2000 * 30  # type: ignore[union-attr]

    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gemini-image": {"upstream": "openai", "price_per_million": price}},
    )
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 1300,
        "total_tokens": 1310,
        "completion_tokens_details": {"reasoning_tokens": 0, "image_tokens": 1290},
    }
    script.plan = _chat_answer("gemini-image", usage)
    status, answer = await _post(proxy.url, "/v1/chat/completions", request, "image")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry["image_output_tokens"] == "1290"
    assert int(entry["cost_micros"]) == -(-(10 * 300_000 + 10 * 2_500_000 + 1290 * 30_000_000) // 1_000_000)

    # A usage that does not say how many it wrote (OpenRouter's per-image models, Gemini's own):
    # all of the output is images, as an unsure reading bills the more (the first review of the
    # day: billed at the text price).
    await redis_client.delete("lbp:{team-a}:ledger")
    untold = {"prompt_tokens": 10, "completion_tokens": 1300, "total_tokens": 1310}
    script.plan = _chat_answer("gemini-image", untold)
    status, answer = await _post(proxy.url, "/v1/chat/completions", request, "untold")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry["image_output_tokens"] == "1300"
    assert int(entry["cost_micros"]) == -(-(10 * 300_000 + 1300 * 30_000_000) // 1_000_000)
    # A call not asking for images is billed at the text price.
    await redis_client.delete("lbp:{team-a}:ledger")
    status, answer = await _post(proxy.url, "/v1/chat/completions", text_only, "text")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert "image_output_tokens" not in entry
    assert int(entry["cost_micros"]) == -(-(10 * 300_000 + 1300 * 2_500_000) // 1_000_000)


@pytest.mark.parametrize("stream", [False, True])
async def test_cache_writes_kept_an_hour_are_billed_at_their_price(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    proxy = await _claude_proxy(make_proxy, script)
    usage = {
        "input_tokens": 50,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 100_000,
        "cache_creation": {"ephemeral_5m_input_tokens": 40_000, "ephemeral_1h_input_tokens": 60_000},
        "output_tokens": 20,
    }
    if stream:
        script.plan = _claude_stream(usage, {"output_tokens": 20})
    else:
        script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    request = _claude_request(stream=stream)
    status, raw = await _post(proxy.url, "/v1/messages", request, "hour")
    assert status == 200
    entry = await _entry(redis_client)
    assert int(entry["cost_micros"]) == 50 * 3 + 40_000 * 3.75 + 60_000 * 6 + 20 * 15  # 510,450
    assert (entry["cache_creation_input_tokens"], entry["cache_creation_1h_input_tokens"]) == (
        "100000",
        "60000",
    )
    if stream:
        comment = next(line for line in raw.split(b"\n") if line.startswith(b": billing "))
        billed = json.loads(comment.removeprefix(b": billing "))
        assert billed["cache_creation_input_tokens"] == 100_000
        assert billed["cache_creation_1h_input_tokens"] == 60_000


def _claude_stream(usage: dict[str, Any], delta_usage: dict[str, Any] | None, *, end: bool = True) -> Plan:
    """A streamed answer "hi": ``usage`` in its message_start (its output a placeholder 1),
    ``delta_usage`` in its message_delta; ``end``: False cuts it after the text."""
    start = {**_claude_message(usage), "content": [], "stop_reason": None}
    start["usage"] = {**usage, "output_tokens": 1}
    chunks = [
        _sse("message_start", {"type": "message_start", "message": start}),
        _sse(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        _sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
        ),
    ]
    if end:
        delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
        if delta_usage is not None:
            delta["usage"] = delta_usage
        chunks += [
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _sse("message_delta", delta),
            _sse("message_stop", {"type": "message_stop"}),
        ]
    return Plan(content_type="text/event-stream", chunks=chunks)


def _hour(tokens: int) -> dict[str, int]:
    return {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": tokens}


# message_start's writes, all kept an hour; message_delta's cumulative count (the SDK's
# MessageDeltaUsage has no ``cache_creation`` split) grown past them by a server tool's results.
HOUR_START = {
    "input_tokens": 50,
    "cache_read_input_tokens": 0,
    "cache_creation_input_tokens": 60_000,
    "cache_creation": _hour(60_000),
    "output_tokens": 1,
}
GROWN_DELTA = {"input_tokens": 50, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 100_000}
# 50 input, 100,000 writes kept an hour, 20 output.
HOUR_COST = 50 * 3 + 100_000 * 6 + 20 * 15


@pytest.mark.parametrize("ttl", ["1h", None])
async def test_cache_writes_grown_in_message_delta_are_billed_at_the_ttl_the_request_asked(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, ttl: str | None
) -> None:
    """The 40,000 writes message_delta's count grew by carry no split: they were billed at
    message_start's, the 5-minute price (3.75) for writes a request keeping every breakpoint an
    hour (top-level ``cache_control``, ``ttl: 1h``) had kept an hour (6): 90,000 micro-units
    under the provider's bill (the usage hunt). Written at the dearest TTL the request names; one
    naming none keeps them five minutes."""
    proxy = await _claude_proxy(make_proxy, script)
    script.plan = _claude_stream(HOUR_START, {**GROWN_DELTA, "output_tokens": 20})
    request = _claude_request(stream=True)
    if ttl is not None:
        request["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    status, _ = await _post(proxy.url, "/v1/messages", request, "grow")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["cache_creation_input_tokens"] == "100000"
    if ttl is None:
        assert int(entry["cost_micros"]) == HOUR_COST - 40_000 * (6 - 3.75), entry
    else:  # was 510,000
        assert int(entry["cost_micros"]) == HOUR_COST, entry


async def test_cache_writes_a_message_delta_s_iterations_split_are_billed_at_their_ttl(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The same stream, its message_delta carrying ``usage.iterations`` (the beta's sampling
    iterations, each ``message`` entry with its own ``cache_creation`` split): all 100,000
    writes kept an hour, 60,000 in the first turn and 40,000 after the search. Iterations were
    read only for compaction's step: 40,000 billed at the 5-minute price (the usage hunt)."""
    proxy = await _claude_proxy(make_proxy, script)
    iterations = [
        {"type": "message", "input_tokens": 20, "output_tokens": 8, "cache_read_input_tokens": 0,
         "cache_creation_input_tokens": 60_000, "cache_creation": _hour(60_000)},
        {"type": "message", "input_tokens": 30, "output_tokens": 12, "cache_read_input_tokens": 0,
         "cache_creation_input_tokens": 40_000, "cache_creation": _hour(40_000)},
    ]  # fmt: skip
    script.plan = _claude_stream(HOUR_START, {**GROWN_DELTA, "output_tokens": 20, "iterations": iterations})
    request = _claude_request(stream=True)
    status, _ = await _post(proxy.url, "/v1/messages", request, "iterations")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["cache_creation_1h_input_tokens"] == "100000", entry  # was 60,000
    assert int(entry["cost_micros"]) == HOUR_COST, entry


async def test_cache_writes_a_whole_answer_tells_no_split_of_are_kept_as_the_request_asked(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A usage with writes and no ``cache_creation`` split (a gateway's): kept an hour when a
    breakpoint of the request (here a message's block) asks for an hour."""
    proxy = await _claude_proxy(make_proxy, script)
    usage = {"input_tokens": 50, "cache_creation_input_tokens": 100_000, "output_tokens": 20}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    block = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    request = _claude_request([block])
    status, _ = await _post(proxy.url, "/v1/messages", request, "unsplit")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["cache_creation_1h_input_tokens"] == "100000", entry
    assert int(entry["cost_micros"]) == HOUR_COST, entry


@pytest.mark.parametrize("longer", ["5", None])
async def test_openai_cache_writes_kept_twelve_hours_are_billed_at_the_price_of_writes_kept_longer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, longer: str | None
) -> None:
    """A Responses usage tells its cache writes by TTL (``input_tokens_details.
    cache_write_tokens_details``: ``ttl_30m_tokens``, ``ttl_12h_tokens``, the latter asked with
    ``prompt_cache_options.ttl: "12h"``): every write was billed at the 30 minutes' price (the
    usage hunt). The 12 hours' are at ``cache_creation_input_1h``, the operator's price for
    writes kept longer, where it is set; else at the write price, as before."""
    price = {"input": "2.5", "output": "15", "cache_creation_input": "3.125"}
    if longer is not None:
        price["cache_creation_input_1h"] = longer
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gpt-x": {"upstream": "openai", "price_per_million": price}},
    )
    usage = {
        "input_tokens": 100_000,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 90_000,
            "cache_write_tokens_details": {"ttl_30m_tokens": 0, "ttl_12h_tokens": 90_000},
        },
        "output_tokens": 20,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 100_020,
    }
    answer = {
        "id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "gpt-x",
        "output": [], "usage": usage,
    }  # fmt: skip
    script.plan = Plan(chunks=[json.dumps(answer).encode()])
    body = {"model": "gpt-x", "input": "hi", "max_output_tokens": 100, "prompt_cache_options": {"ttl": "12h"}}
    status, raw = await _post(proxy.url, "/v1/responses", body, "half-day")
    assert status == 200, raw
    entry = await _entry(redis_client)
    written = 90_000 * float(longer or "3.125")  # was 90,000 * 3.125 either way
    assert int(entry["cost_micros"]) == 10_000 * 2.5 + written + 20 * 15, entry


async def test_the_report_and_the_counters_name_every_kind_the_ledger_does(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    # An operator rebuilds a bill from the report or the token counters: the cache writes and
    # the audio tokens were missing from both.
    for kind in (
        "cache_creation_input",
        "cache_creation_1h_input",
        "audio_input",
        "audio_output",
        "image_input",
        "image_output",
    ):
        assert f"{kind}_tokens" in TOKEN_FIELDS
    proxy = await _claude_proxy(make_proxy, script)
    usage = {"input_tokens": 5, "cache_creation_input_tokens": 700, "output_tokens": 2}
    message = _claude_message(usage)
    script.plan = Plan(chunks=[json.dumps(message).encode()])
    request = _claude_request(max_tokens=10)
    assert (await _post(proxy.url, "/v1/messages", request, "kinds"))[0] == 200
    await proxy.recorded()
    exported = generate_latest(proxy.app[STATE].metrics.registry).decode()
    written = [line for line in exported.splitlines() if 'type="cache_creation_input"' in line]
    assert written[0].endswith(" 700.0")


# gpt-5's list prices per million: 1.25 in, 10 out; priority processing 2.5 in, 20 out; flex half.
GPT5 = {
    "upstream": "openai",
    "price_per_million": {"input": "1.25", "output": "10"},
    "service_tiers": {
        "priority": {"input": "2.5", "output": "20"},
        "flex": {"input": "0.625", "output": "5"},
    },
}


async def _gpt5_proxy(
    make_proxy: ProxyFactory, script: ScriptedUpstream, cost_usd: str | None = None
) -> Proxy:
    """A proxy serving GPT5's tiers from ``script``; ``cost_usd``: a run's cost ceiling."""
    tiers = {"standard": {"run": {"cost_usd": cost_usd}}} if cost_usd else None
    return await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gpt-5": GPT5},
        **({"tiers": tiers} if tiers else {}),
    )


async def _gpt5_chat_entry(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    asked: str | None,
    served: str | None = None,
) -> dict[str, str]:
    """The ledger entry of one GPT-5 chat call asking for ``asked`` (None: no field), its answer
    naming ``served`` (None: none): 10,000 input and 2,000 output tokens."""
    proxy = await _gpt5_proxy(make_proxy, script)
    usage = {"prompt_tokens": 10_000, "completion_tokens": 2_000, "total_tokens": 12_000}
    script.plan = _chat_answer("gpt-5", usage, served)
    request: dict[str, Any] = {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}
    if asked is not None:
        request["service_tier"] = asked
    status, _ = await _post(proxy.url, "/v1/chat/completions", request, "tier")
    assert status == 200
    return await _entry(redis_client)


@pytest.mark.parametrize(
    ("tier", "cost_micros"),
    [(None, 10_000 * 1.25 + 2_000 * 10), ("auto", 32_500), ("priority", 65_000), ("flex", 16_250)],
)
async def test_a_processing_tier_is_billed_at_its_own_prices(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    tier: str | None,
    cost_micros: float,
) -> None:
    entry = await _gpt5_chat_entry(make_proxy, script, redis_client, tier)
    assert int(entry["cost_micros"]) == cost_micros
    assert entry.get("service_tier") == (tier if tier in ("priority", "flex") else None)


async def test_a_processing_tier_the_operator_did_not_price_is_refused(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    # Forwarded and billed at the default's prices, a priority call cost the operator twice what
    # the tenant was charged.
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gpt-5": {"upstream": "openai", "price_per_million": {"input": "1.25", "output": "10"}}},
    )
    request = {"model": "gpt-5", "service_tier": "priority", "messages": [{"role": "user", "content": "hi"}]}
    status, raw = await _post(proxy.url, "/v1/chat/completions", request, "unpriced")
    assert status == 400
    assert json.loads(raw)["error"]["code"] == "unsupported_service_tier"
    assert script.received == []


@pytest.mark.parametrize(
    ("asked", "served", "cost_micros", "tier_in_ledger"),
    [
        (None, "priority", 65_000, "priority"),  # the project's default tier is priority
        ("auto", "flex", 16_250, "flex"),
        ("priority", "default", 32_500, None),  # the provider says it served the default
        (None, "default", 32_500, None),
        ("priority", "scale", 65_000, "scale"),  # a tier nobody priced: the asked one's prices
    ],
)
async def test_a_call_is_billed_at_the_tier_its_answer_says_served_it(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    asked: str | None,
    served: str,
    cost_micros: int,
    tier_in_ledger: str | None,
) -> None:
    entry = await _gpt5_chat_entry(make_proxy, script, redis_client, asked, served)
    assert int(entry["cost_micros"]) == cost_micros
    assert entry.get("service_tier") == tier_in_ledger


async def test_a_call_that_names_no_tier_is_reserved_at_the_dearest_priced_tier(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Its project may default to priority: a cost ceiling must hold at priority prices."""
    proxy = await _gpt5_proxy(make_proxy, script, cost_usd="0.03")  # 30,000 micro-units
    usage = {"prompt_tokens": 10, "completion_tokens": 1_000, "total_tokens": 1_010}
    script.plan = _chat_answer("gpt-5", usage, "default")
    # 1,000 output tokens: 10,000 micro-units at default prices, 20,000 at priority's.
    request: dict[str, Any] = {
        "model": "gpt-5",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1000,
    }
    for run, tier, expected in (("a", "default", 200), ("b", "auto", 200), ("c", None, 200)):
        body = {**request, **({"service_tier": tier} if tier else {})}
        status, _ = await _post(proxy.url, "/v1/chat/completions", body, run)
        assert status == expected
    # A run that spent 15,000: the default's reserve (10,000 more) fits, priority's does not.
    spent = {"prompt_tokens": 0, "completion_tokens": 1_500, "total_tokens": 1_500}
    script.plan = _chat_answer("gpt-5", spent, "default")
    pinned = {**request, "service_tier": "default"}
    assert (await _post(proxy.url, "/v1/chat/completions", {**pinned, "max_tokens": 1500}, "d"))[0] == 200
    script.plan = _chat_answer("gpt-5", usage, "default")
    assert (await _post(proxy.url, "/v1/chat/completions", request, "d"))[0] == 429
    assert (await _post(proxy.url, "/v1/chat/completions", pinned, "d"))[0] == 200


async def test_a_stream_is_billed_at_the_tier_its_chunks_say_served_it(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await _gpt5_proxy(make_proxy, script)
    head = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-5",
        "service_tier": "priority",
    }

    def chunk(choices: list[Any], usage: Any = None) -> bytes:
        return b"data: " + json.dumps({**head, "choices": choices, "usage": usage}).encode() + b"\n\n"

    texts = [chunk([{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]) for i in range(5)]
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[
            *texts,
            chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
            chunk([], {"prompt_tokens": 10_000, "completion_tokens": 2_000, "total_tokens": 12_000}),
            b"data: [DONE]\n\n",
        ],
    )
    request = {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, _ = await _post(proxy.url, "/v1/chat/completions", request, "stream")
    assert status == 200
    entry = await _entry(redis_client)
    assert (int(entry["cost_micros"]), entry.get("service_tier")) == (65_000, "priority")


async def test_anthropic_says_which_tier_served_it_in_its_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    model = {
        "upstream": "anthropic",
        "price_per_million": {"input": "3", "output": "15"},
        "service_tiers": {"priority": {"input": "6", "output": "30"}},
    }
    proxy = await make_proxy(upstreams={"anthropic": upstream}, models={"claude-x": model})
    request = {"model": "claude-x", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]}
    for run, tier, cost in (("p", "priority", 1000 * 6 + 1000 * 30), ("s", "standard", 1000 * 3 + 1000 * 15)):
        usage = {"input_tokens": 1000, "output_tokens": 1000, "service_tier": tier}
        message = {
            "id": "m",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [{"type": "text", "text": "hi"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
        script.plan = Plan(chunks=[json.dumps(message).encode()])
        status, raw = await _post(proxy.url, "/v1/messages", request, run)
        assert status == 200, raw
        entries = await redis_client.xrange("lbp:{team-a}:ledger")
        entry = dict(entries[-1][1])
        assert int(entry["cost_micros"]) == cost
        assert entry.get("service_tier") == ("priority" if tier == "priority" else None)


async def test_a_tier_field_an_endpoint_does_not_price_changes_nothing(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """Legacy completions do not price service_tier: the field, passed on as an extra, must not
    turn off the reserve at the dearest tier either."""
    proxy = await _gpt5_proxy(make_proxy, script, cost_usd="0.0101")
    base = {"model": "gpt-5", "prompt": "hi", "max_tokens": 1000}  # 20,003 at priority's prices
    assert (await _post(proxy.url, "/v1/completions", base, "l1"))[0] == 429
    assert (await _post(proxy.url, "/v1/completions", {**base, "service_tier": "default"}, "l2"))[0] == 429
    assert script.received == []


async def test_reasoning_left_out_of_completion_tokens_is_still_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Gemini's OpenAI-compatible shape (and gateways translating it): completion_tokens holds
    the visible answer only, the thinking is in reasoning_tokens, and total_tokens counts both.
    The provider bills 60 output tokens: billing 0 charges the caller nothing for them."""
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={
            "gemini-2.5-pro": {"upstream": "openai", "price_per_million": {"input": "1", "output": "10"}}
        },
    )
    usage = {
        "prompt_tokens": 21,
        "completion_tokens": 0,
        "total_tokens": 81,
        "completion_tokens_details": {"reasoning_tokens": 60},
    }
    script.plan = _chat_answer("gemini-2.5-pro", usage)
    request = {"model": "gemini-2.5-pro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    status, _ = await _post(proxy.url, "/v1/chat/completions", request, "gemini")
    assert status == 200
    entry = await _entry(redis_client)
    assert (entry["input_tokens"], entry["output_tokens"], entry["total_tokens"]) == ("21", "60", "81")
    assert int(entry["cost_micros"]) == 21 * 1 + 60 * 10


def _chat_stream(model: str, usage: dict[str, Any]) -> Plan:
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": model}
    chunks = [
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**base, "choices": [], "usage": usage},
    ]
    body = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)
    return Plan(content_type="text/event-stream", chunks=[body + b"data: [DONE]\n\n"])


async def _billed_chat(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    *,
    model: str,
    price: dict[str, str],
    usage: dict[str, Any],
    stream: bool,
) -> dict[str, str]:
    """One chat call of ``model`` (priced ``price``) whose answer reports ``usage``, streamed or
    not: its ledger entry."""
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={model: {"upstream": "openai", "price_per_million": price}},
    )
    script.plan = _chat_stream(model, usage) if stream else _chat_answer(model, usage)
    request = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    status, _ = await _post(proxy.url, "/v1/chat/completions", request, model)
    assert status == 200
    return await _entry(redis_client)


@pytest.mark.parametrize("stream", [False, True])
async def test_perplexity_citation_and_reasoning_tokens_are_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """sonar-deep-research's usage (a real answer's figures): citation tokens are input beside
    prompt_tokens, reasoning tokens beside completion_tokens at their own price, neither in
    total_tokens. Its cost object bills them all: 0.58704 in tokens (and 0.25 for 50 searches,
    a fee per search no token price holds)."""
    price = {"input": "2", "output": "8", "reasoning": "3"}
    usage = SONAR_DEEP_RESEARCH_USAGE
    entry = await _billed_chat(
        make_proxy, script, redis_client, model="sonar-deep-research", price=price, usage=usage, stream=stream
    )
    assert (entry["input_tokens"], entry["output_tokens"], entry["reasoning_tokens"]) == (
        "20700",
        "159383",
        "145885",
    )
    assert int(entry["cost_micros"]) == 460 + 107_984 + 40_940 + 437_655  # 108,444 when read as 0


@pytest.mark.parametrize("stream", [False, True])
async def test_deepseek_cache_hits_are_billed_at_the_cached_price(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """DeepSeek's documented usage names its cache reads prompt_cache_hit_tokens (answers
    without prompt_tokens_details carry only that): a tenth of the price of a miss."""
    price = {"input": "0.28", "cached_input": "0.028", "output": "0.42"}
    usage = {
        "prompt_tokens": 100_000,
        "completion_tokens": 1000,
        "total_tokens": 101_000,
        "prompt_cache_hit_tokens": 90_000,
        "prompt_cache_miss_tokens": 10_000,
    }
    entry = await _billed_chat(
        make_proxy, script, redis_client, model="deepseek-chat", price=price, usage=usage, stream=stream
    )
    assert entry["cached_input_tokens"] == "90000"
    # 10,000 misses, 90,000 hits, 1,000 output: 5,740 micro-units, not 28,420.
    assert int(entry["cost_micros"]) == 2_800 + 2_520 + 420


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_top_level_reasoning_tokens_are_a_part_of_its_completion_tokens(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """SGLang's usage names its reasoning count reasoning_tokens at the top, as Perplexity does,
    but counts it within completion_tokens (total_tokens is prompt + completion for both): 80 of
    its 105 output tokens had been billed twice, 185 output tokens."""
    price = {"input": "1", "output": "10", "reasoning": "10"}
    usage = {
        "prompt_tokens": 29,
        "total_tokens": 134,
        "completion_tokens": 105,
        "prompt_tokens_details": None,
        "reasoning_tokens": 80,
    }
    entry = await _billed_chat(
        make_proxy, script, redis_client, model="qwen3-8b", price=price, usage=usage, stream=stream
    )
    assert (entry["input_tokens"], entry["output_tokens"], entry["reasoning_tokens"]) == ("29", "105", "80")
    assert int(entry["cost_micros"]) == 29 * 1 + 105 * 10


@pytest.mark.parametrize("stream", [False, True])
async def test_gemini_thoughts_told_only_in_total_tokens_are_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """Gemini's own OpenAI-compatible endpoint tells no reasoning count: completion_tokens is the
    answer only, total_tokens (Gemini's totalTokenCount) holds the 93 thought tokens too, which
    Google bills as output. They had been billed 0: 3 output tokens of 96."""
    price = {"input": "1", "output": "10"}
    usage = {"completion_tokens": 3, "prompt_tokens": 9, "total_tokens": 105}
    entry = await _billed_chat(
        make_proxy,
        script,
        redis_client,
        model="gemini-3-flash-preview",
        price=price,
        usage=usage,
        stream=stream,
    )
    assert (entry["input_tokens"], entry["output_tokens"], entry["reasoning_tokens"]) == ("9", "96", "93")
    assert int(entry["cost_micros"]) == 9 * 1 + 96 * 10


async def test_a_gateways_chat_usage_telling_no_split_is_kept_as_the_request_asked(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Claude through an OpenAI-format gateway (LiteLLM, OpenRouter: chat content blocks carrying
    Anthropic's ``cache_control``), whose usage names Anthropic's writes at its top
    (``cache_creation_input_tokens``, read by ``parse_usage``) and no TTL split. The README's
    ``cache_creation_input_1h`` row: "writes no split tells when a cache_control of the request
    names ttl: "1h"" are billed at the hour's price; only a Messages usage told its untold
    writes, and these were billed at five minutes (the second review)."""
    upstream = {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}
    proxy = await make_proxy(
        upstreams={"gateway": upstream},
        models={"claude-sonnet-4-5": {"upstream": "gateway", "price_per_million": CLAUDE_PRICE}},
    )
    usage = {
        "prompt_tokens": 1100,
        "completion_tokens": 10,
        "total_tokens": 1110,
        "prompt_tokens_details": {"cached_tokens": 0, "cache_creation_tokens": 1000},
        "cache_creation_input_tokens": 1000,  # LiteLLM's: its writes told both ways, within the prompt
    }
    script.plan = _chat_answer("claude-sonnet-4-5", usage)
    block = {"type": "text", "text": "a long prefix", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    body = {"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": [block]}]}
    status, answer = await _post(proxy.url, "/v1/chat/completions", body, "gw")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry["cache_creation_input_tokens"] == "1000", entry
    assert int(entry["cost_micros"]) == 100 * 3 + 1000 * 6 + 10 * 15, entry  # at 5 minutes: 4,200
