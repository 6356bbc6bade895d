"""The observation of answers: usage parsing, and the relay's no-parse content fast path."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis.asyncio as aioredis

from proxy.config import PolicyConfig
from proxy.observe import Observation, parse_usage, string_end
from proxy.outcome import classify_answer
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream


@pytest.mark.parametrize(
    "text",
    ["plain", 'with "quotes"', "back\\slash\\", 'ends with \\"', "ünïcödé ✓ 🚀", "line\nbreak\ttab", ""],
)
def test_string_end_and_lazy_decoding_agree_with_json(text: str) -> None:
    chunk = orjson.dumps({"choices": [{"delta": {"content": text}, "finish_reason": None}]})
    start = chunk.find(b'"content":"') + len(b'"content":"')
    end = string_end(chunk, start)
    assert chunk[end : end + 2] == b'"}'
    obs = Observation()
    obs.raw_content(0, chunk[start:end])
    obs.observe({"choices": [{"index": 0, "delta": {"content": "+parsed"}}]}, streaming=True)
    obs.raw_content(0, chunk[start:end])
    assert obs.content_of(0) == text + "+parsed" + text
    assert obs.all_text() == text + "+parsed" + text


def test_usage_zero_is_real_and_garbage_is_missing() -> None:
    assert parse_usage({"prompt_tokens": 0, "completion_tokens": 0}) is not None
    assert parse_usage({"prompt_tokens": True, "completion_tokens": 1}) is None
    assert parse_usage({"prompt_tokens": -1, "completion_tokens": 1}) is None
    assert parse_usage("nope") is None
    usage = parse_usage(
        {
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 2},
            "completion_tokens_details": {"reasoning_tokens": 3},
        }
    )
    assert usage is not None and (usage.cached_input_tokens, usage.reasoning_tokens) == (2, 3)


def test_usage_parts_named_by_deepseek_and_perplexity_are_read() -> None:
    # DeepSeek's cache reads, in an answer without prompt_tokens_details (its documented shape).
    deepseek = parse_usage(
        {
            "prompt_tokens": 1000,
            "completion_tokens": 10,
            "total_tokens": 1010,
            "prompt_cache_hit_tokens": 900,
            "prompt_cache_miss_tokens": 100,
        }
    )
    assert deepseek is not None
    assert (deepseek.input_tokens, deepseek.cached_input_tokens, deepseek.output_tokens) == (1000, 900, 10)
    # Perplexity's sonar-deep-research: citation and reasoning tokens beside prompt and completion
    # (its cost object bills 230 + 20,470 input, 13,498 output and 145,885 reasoning tokens).
    perplexity = parse_usage(
        {
            "prompt_tokens": 230,
            "completion_tokens": 13498,
            "total_tokens": 13728,
            "citation_tokens": 20470,
            "num_search_queries": 50,
            "reasoning_tokens": 145885,
            "search_context_size": "low",
        }
    )
    assert perplexity is not None
    assert (perplexity.input_tokens, perplexity.output_tokens, perplexity.reasoning_tokens) == (
        20700,
        159383,
        145885,
    )
    # Not counts: the whole report is unusable, as for OpenAI's details.
    assert parse_usage({"prompt_tokens": 5, "completion_tokens": 1, "prompt_cache_hit_tokens": "4"}) is None
    assert parse_usage({"prompt_tokens": 5, "completion_tokens": 1, "reasoning_tokens": -1}) is None
    # Reasoning in completion_tokens_details stands: a top-level copy is not counted again.
    both = parse_usage(
        {
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "total_tokens": 12,
            "reasoning_tokens": 3,
            "completion_tokens_details": {"reasoning_tokens": 3},
        }
    )
    assert both is not None and (both.output_tokens, both.reasoning_tokens) == (7, 3)


def test_sglang_s_top_level_reasoning_tokens_are_within_its_completion_tokens() -> None:
    # The same name at the same place as Perplexity's, and total_tokens prompt + completion for
    # both; SGLang counts it within completion_tokens (a count that fits there, no citations).
    usage = {"prompt_tokens": 29, "total_tokens": 134, "completion_tokens": 105, "reasoning_tokens": 80}
    sglang = parse_usage(usage)
    assert sglang is not None and (sglang.output_tokens, sglang.reasoning_tokens) == (105, 80)


async def test_streamed_text_with_escapes_is_estimated_from_the_decoded_text(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    content = 'He said "hi" \\ ünïcödé 🚀\n{"json": [1, 2]}'
    proxy = await make_proxy()
    stream = await proxy.client().chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        extra_body={"fake": {"content": content, "chunk_chars": 3, "no_usage": True}},
    )
    got = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += chunk.choices[0].delta.content
    assert got == content
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert entry["usage_source"] == "chars"
    assert int(entry["output_tokens"]) == -(-len(content) // 4)


def test_the_fast_path_leaves_anything_unusual_to_the_parser() -> None:
    from proxy.chunks import NOT_PLAIN_CONTENT as _NOT_PLAIN_CONTENT

    for chunk in (
        b'{"choices":[{"index":0,"delta":{},"finish_reason": "length"}]}',
        b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        b'{"choices":[],"usage":{"prompt_tokens":1}}',
        b'{"choices": [ ], "usage": {"prompt_tokens":1}}',
        b'{"choices":[{"index":0,"delta":{"refusal":"no"},"finish_reason":null}]}',
        b'{"choices":[{"index":0,"delta":{"tool_calls":[]},"finish_reason":null}]}',
        b'{"error":{"message":"x"}}',
    ):
        assert _NOT_PLAIN_CONTENT.search(chunk), chunk
    plain = (
        b'{"choices":[{"index":0,"delta":{"content":"tok1 "},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}'
    )
    assert not _NOT_PLAIN_CONTENT.search(plain)


@pytest.mark.parametrize(
    ("reason", "tag"),
    [
        ("stop", "ok"),
        ("length", "truncated"),
        ("max_output_tokens", "truncated"),
        ("max_tokens", "truncated"),
        ("model_context_window_exceeded", "truncated"),  # Anthropic: was "ok"
        ("content_filter", "refused"),
        ("refusal", "refused"),
    ],
)
def test_finish_reasons_of_every_dialect_give_their_outcome(reason: str, tag: str) -> None:
    obs = Observation(finish_reasons={0: reason})
    assert classify_answer(obs, PolicyConfig(), json_mode=False).tag == tag


# Anthropic's own bill for one call: 10 input tokens after the cache breakpoint, 2,000 read from the
# cache, 1,000 written to it (400 of them kept an hour), 50 output. Priced below (micro-units per
# token): 10 * 1 + 2,000 * 0.1 + 600 * 5 + 400 * 10 + 50 * 2.
GATEWAY_PRICES = {
    "input": "1",
    "cached_input": "0.1",
    "cache_creation_input": "5",
    "cache_creation_input_1h": "10",
    "output": "2",
}
ANTHROPIC_BILL = 10 + 200 + 3000 + 4000 + 100
WRITTEN_1H = {
    "cache_creation_token_details": {"ephemeral_5m_input_tokens": 600, "ephemeral_1h_input_tokens": 400}
}
# The same call as OpenAI-format gateways in front of Claude report it.
GATEWAY_USAGES = {
    # LiteLLM (1.80): every input token in prompt_tokens, both kinds told the OpenAI way too.
    "litellm": {
        "prompt_tokens": 3010,
        "completion_tokens": 50,
        "total_tokens": 3060,
        "prompt_tokens_details": {"cached_tokens": 2000, "cache_creation_tokens": 1000, **WRITTEN_1H},
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 1000,
    },
    # LiteLLM's calculate_usage of 2025: the reads in prompt_tokens, the writes beside it.
    "litellm-2025": {
        "prompt_tokens": 2010,
        "completion_tokens": 50,
        "total_tokens": 2060,
        "prompt_tokens_details": {"cached_tokens": 2000, **WRITTEN_1H},
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 1000,
    },
    # Portkey: prompt_tokens is Anthropic's input_tokens, total_tokens counts the cache on top.
    "portkey": {
        "prompt_tokens": 10,
        "completion_tokens": 50,
        "total_tokens": 3060,
        "prompt_tokens_details": {"cached_tokens": 2000, **WRITTEN_1H},
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 1000,
    },
    # Portkey before it told cached_tokens or counted the cache in total_tokens.
    "portkey-2024": {
        "prompt_tokens": 10,
        "completion_tokens": 50,
        "total_tokens": 60,
        "prompt_tokens_details": WRITTEN_1H,
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 1000,
    },
}


@pytest.mark.parametrize("gateway", sorted(GATEWAY_USAGES))
def test_anthropic_cache_counts_told_by_a_gateway_are_each_read_once(gateway: str) -> None:
    usage = parse_usage(GATEWAY_USAGES[gateway])
    assert usage is not None
    assert (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens) == (3010, 2000, 50)
    assert (usage.cache_creation_input_tokens, usage.cache_creation_1h_input_tokens) == (1000, 400)


def test_moonshot_cache_reads_at_the_top_of_its_usage_are_a_part_of_the_prompt() -> None:
    usage = parse_usage(
        {"prompt_tokens": 2010, "completion_tokens": 50, "total_tokens": 2060, "cached_tokens": 2000}
    )
    assert usage is not None and (usage.input_tokens, usage.cached_input_tokens) == (2010, 2000)
    assert parse_usage({"prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": "4"}) is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("gateway", sorted(GATEWAY_USAGES))
async def test_a_gateway_in_front_of_claude_is_billed_what_anthropic_bills(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, gateway: str, stream: bool
) -> None:
    # Was: LiteLLM's writes priced as plain input (1 not 5), Portkey's reads taken out of its
    # 10-token prompt_tokens, its writes not billed at all.
    proxy = await make_proxy(models={"*": {"upstream": "openai", "price_per_million": GATEWAY_PRICES}})
    answer = await proxy.client().chat.completions.create(
        model="claude-sonnet-4-5",
        messages=[{"role": "user", "content": "hi"}],
        stream=stream,
        extra_body={"fake": {"usage": GATEWAY_USAGES[gateway]}},
    )
    if stream:
        async for _ in answer:  # type: ignore[union-attr]
            pass
    for _ in range(100):
        entries = await redis_client.xrange("lbp:{team-a}:ledger")
        if entries:
            break
        await asyncio.sleep(0.05)
    ((_, entry),) = entries
    assert (entry["input_tokens"], entry["cached_input_tokens"]) == ("3010", "2000"), entry
    assert int(entry["cost_micros"]) == ANTHROPIC_BILL, entry


def test_a_top_level_count_not_told_the_openai_way_too_is_never_billed_below_the_provider() -> None:
    # LiteLLM's Anthropic usage of 2024 counted the writes in prompt_tokens and told them only at
    # the top; its 2025 usage, otherwise the same, left them out. Read as beside: the first is
    # billed 1,000 input tokens more than Anthropic billed, the second exactly.
    usage = parse_usage(
        {
            "prompt_tokens": 3010,
            "completion_tokens": 50,
            "total_tokens": 3060,
            "prompt_tokens_details": {"cached_tokens": 2000},
            "cache_read_input_tokens": 2000,
            "cache_creation_input_tokens": 1000,
        }
    )
    assert usage is not None
    assert (usage.input_tokens, usage.cached_input_tokens, usage.cache_creation_input_tokens) == (
        4010,
        2000,
        1000,
    )
