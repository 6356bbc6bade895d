"""The observation of answers: usage parsing, and the relay's no-parse content fast path."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from proxy.billed_usage import with_tool_calls
from proxy.config import PolicyConfig
from proxy.observe import LOOSE_PIECES, Observation, parse_usage, string_end
from proxy.observe_responses import responses_event
from proxy.outcome import classify_answer, reserve_usage
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.memory import MB, alive_when_called


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


# A real sonar-deep-research answer's usage: citation and reasoning tokens beside prompt and
# completion, neither in total_tokens; its cost object bills them all (0.58704 in tokens, and
# 0.25 for 50 searches, a fee per search no token price holds).
SONAR_DEEP_RESEARCH_USAGE = {
    "prompt_tokens": 230,
    "completion_tokens": 13498,
    "total_tokens": 13728,
    "citation_tokens": 20470,
    "num_search_queries": 50,
    "reasoning_tokens": 145885,
    "search_context_size": "low",
    "cost": {
        "input_tokens_cost": 0.00046,
        "output_tokens_cost": 0.10798,
        "citation_tokens_cost": 0.04094,
        "reasoning_tokens_cost": 0.43766,
        "search_queries_cost": 0.25,
        "total_cost": 0.83704,
    },
}


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
    perplexity = parse_usage(SONAR_DEEP_RESEARCH_USAGE)
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


@pytest.mark.parametrize(
    ("finish", "call"),
    [
        (
            "tool_calls",
            {"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        ),
        ("function_call", {"function_call": {"name": "f", "arguments": "{}"}}),  # legacy functions
    ],
)
def test_a_call_said_before_it_is_not_held_to_json_whichever_way_it_is_called(
    finish: str, call: dict[str, object]
) -> None:
    # A model may say a few words before it calls: the call ends the turn, not a JSON answer.
    # Legacy functions end such a turn with "function_call" as tools do with "tool_calls": was
    # rejected (parse-json), its answer withheld from the client.
    obs = Observation()
    message = {"role": "assistant", "content": "Let me look that up.", **call}
    obs.observe({"choices": [{"index": 0, "message": message, "finish_reason": finish}]}, streaming=False)
    policy = PolicyConfig(on_invalid_json="reject")
    assert classify_answer(obs, policy, json_mode=True).tag == "ok"


def test_a_whole_answer_of_content_parts_is_its_text_parts_beside_its_thinking() -> None:
    """Magistral's whole answer (Mistral's content of parts): its text parts are the answer held
    to JSON, its thinking's texts output beside it; none was read."""
    obs = Observation()
    thought = {"type": "thinking", "thinking": [{"type": "text", "text": "JSON, so"}]}
    message = {"role": "assistant", "content": [thought, {"type": "text", "text": '{"a": 1}'}]}
    obs.observe({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}, streaming=False)
    assert obs.content_of(0) == '{"a": 1}'
    assert obs.all_text() == '{"a": 1}JSON, so'
    assert classify_answer(obs, PolicyConfig(on_invalid_json="reject"), json_mode=True).tag == "ok"


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


# Usage objects as providers and gateways send them (the source of each beside it; "shape" where
# the figures are illustrative and only the fields are the provider's), and what the provider
# bills: (input, cached reads, cache writes, output, reasoning), each whole with its parts.
PROVIDER_USAGES: dict[str, tuple[dict[str, object], tuple[int, int, int, int, int]]] = {
    # OpenAI API reference, chat completion object.
    "openai-chat": (
        {
            "prompt_tokens": 19,
            "completion_tokens": 10,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        (19, 0, 0, 10, 0),
    ),
    # OpenAI prompt caching guide.
    "openai-chat-cached": (
        {
            "prompt_tokens": 2006,
            "completion_tokens": 300,
            "total_tokens": 2306,
            "prompt_tokens_details": {"cached_tokens": 1920},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        (2006, 1920, 0, 300, 0),
    ),
    # Shape: OpenAI's o-series, reasoning within completion_tokens.
    "openai-chat-reasoning": (
        {
            "prompt_tokens": 75,
            "completion_tokens": 1186,
            "total_tokens": 1261,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 1024,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        (75, 0, 0, 1186, 1024),
    ),
    # Shape: OpenAI's predicted outputs, rejected prediction tokens within completion_tokens.
    "openai-chat-prediction": (
        {
            "prompt_tokens": 242,
            "completion_tokens": 288,
            "total_tokens": 530,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 18,
                "rejected_prediction_tokens": 10,
            },
        },
        (242, 0, 0, 288, 0),
    ),
    # Shape: OpenAI's gpt-4o-audio-preview, audio within completion_tokens.
    "openai-chat-audio": (
        {
            "prompt_tokens": 17,
            "completion_tokens": 98,
            "total_tokens": 115,
            "prompt_tokens_details": {
                "cached_tokens": 0,
                "audio_tokens": 0,
                "text_tokens": 17,
                "image_tokens": 0,
            },
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 76,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
                "text_tokens": 22,
            },
        },
        (17, 0, 0, 98, 0),
    ),
    # Shape: OpenAI's Responses API.
    "openai-responses": (
        {
            "input_tokens": 36,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 87,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 123,
        },
        (36, 0, 0, 87, 0),
    ),
    "openai-responses-reasoning": (
        {
            "input_tokens": 75,
            "input_tokens_details": {"cached_tokens": 64},
            "output_tokens": 1186,
            "output_tokens_details": {"reasoning_tokens": 1024},
            "total_tokens": 1261,
        },
        (75, 64, 0, 1186, 1024),
    ),
    # Shape: Azure OpenAI (o1), as OpenAI's.
    "azure-openai": (
        {
            "completion_tokens": 1518,
            "prompt_tokens": 1566,
            "total_tokens": 3084,
            "completion_tokens_details": {"reasoning_tokens": 576},
            "prompt_tokens_details": {"cached_tokens": 1408},
        },
        (1566, 1408, 0, 1518, 576),
    ),
    # Gemini's own OpenAI-compatible endpoint (gemini-3-flash-preview, discuss.ai.google.dev
    # thread 127400): no reasoning count at all; total_tokens is Gemini's totalTokenCount, which
    # holds the thoughts (billed as output) that completion_tokens leaves out.
    "gemini-openai-compat": (
        {"completion_tokens": 3, "prompt_tokens": 9, "total_tokens": 105},
        (9, 0, 0, 96, 93),
    ),
    # A gateway's translation of Gemini (router-for-me/CLIProxyAPI#5733): thoughts told beside a
    # completion_tokens that leaves them out.
    "gemini-thoughts-beside": (
        {
            "completion_tokens": 0,
            "total_tokens": 81,
            "prompt_tokens": 21,
            "completion_tokens_details": {"reasoning_tokens": 60},
        },
        (21, 0, 0, 60, 60),
    ),
    # Translations that fold the thoughts in (mozilla-ai/any-llm#1291, gemini-2.5-flash).
    "gemini-thoughts-within": (
        {
            "prompt_tokens": 20,
            "completion_tokens": 533,
            "total_tokens": 553,
            "completion_tokens_details": {"reasoning_tokens": 382},
        },
        (20, 0, 0, 533, 382),
    ),
    # DeepSeek (deepseek-v4-flash, a logged receipt): both names for its cache reads.
    "deepseek": (
        {
            "completion_tokens": 1957,
            "completion_tokens_details": {"reasoning_tokens": 42},
            "prompt_cache_hit_tokens": 0,
            "prompt_cache_miss_tokens": 810,
            "prompt_tokens": 810,
            "prompt_tokens_details": {"cached_tokens": 0},
            "total_tokens": 2767,
        },
        (810, 0, 0, 1957, 42),
    ),
    # DeepSeek's older shape: hits and misses, no prompt_tokens_details.
    "deepseek-cached": (
        {
            "prompt_tokens": 120,
            "prompt_cache_hit_tokens": 96,
            "prompt_cache_miss_tokens": 24,
            "completion_tokens": 15,
            "total_tokens": 135,
        },
        (120, 96, 0, 15, 0),
    ),
    # OpenRouter usage accounting docs: cache writes within prompt_tokens.
    "openrouter": (
        {
            "completion_tokens": 2,
            "completion_tokens_details": {"reasoning_tokens": 0},
            "cost": 0.95,
            "cost_details": {"upstream_inference_cost": 19},
            "prompt_tokens": 194,
            "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 100, "audio_tokens": 0},
            "total_tokens": 196,
        },
        (194, 0, 100, 2, 0),
    ),
    # OpenRouter in front of Claude (mozilla-ai/any-llm#622): nulls among the details.
    "openrouter-claude": (
        {
            "completion_tokens": 122,
            "prompt_tokens": 13559,
            "total_tokens": 13681,
            "completion_tokens_details": {
                "accepted_prediction_tokens": None,
                "audio_tokens": None,
                "reasoning_tokens": 0,
                "rejected_prediction_tokens": None,
                "image_tokens": 0,
            },
            "prompt_tokens_details": {"audio_tokens": 0, "cached_tokens": 0, "video_tokens": 0},
            "cost": 0.017558,
            "is_byok": False,
        },
        (13559, 0, 0, 122, 0),
    ),
    # A gateway in front of xAI (x-ai/grok-4.1-fast-reasoning): reasoning within completion.
    "openrouter-style-grok-reasoning": (
        {
            "completion_tokens": 241,
            "completion_tokens_details": {"audio_tokens": 0, "image_tokens": 0, "reasoning_tokens": 204},
            "prompt_tokens": 163,
            "prompt_tokens_details": {"audio_tokens": 0, "cache_write_tokens": 0, "cached_tokens": 162},
            "total_tokens": 404,
        },
        (163, 162, 0, 241, 204),
    ),
    # LiteLLM 1.80.11 in front of Claude on Bedrock (BerriAI/litellm#11364).
    "litellm-claude": (
        {
            "total_tokens": 103925,
            "prompt_tokens": 98805,
            "completion_tokens": 5120,
            "prompt_tokens_details": {
                "text_tokens": None,
                "audio_tokens": None,
                "image_tokens": None,
                "cached_tokens": 66360,
                "cache_creation_tokens": 32435,
            },
            "cache_read_input_tokens": 66360,
            "completion_tokens_details": {
                "text_tokens": None,
                "audio_tokens": None,
                "image_tokens": None,
                "reasoning_tokens": 1710,
                "accepted_prediction_tokens": None,
                "rejected_prediction_tokens": None,
            },
            "cache_creation_input_tokens": 32435,
        },
        (98805, 66360, 32435, 5120, 1710),
    ),
    # LiteLLM's AnthropicConfig.calculate_usage of 2025 (reads added to prompt_tokens, writes not)
    # for Anthropic's input 10, reads 2,000, writes 1,000, output 50.
    "litellm-claude-2025": (
        {
            "prompt_tokens": 2010,
            "completion_tokens": 50,
            "total_tokens": 2060,
            "prompt_tokens_details": {"cached_tokens": 2000},
            "cache_creation_input_tokens": 1000,
            "cache_read_input_tokens": 2000,
        },
        (3010, 2000, 1000, 50, 0),
    ),
    # Portkey's AnthropicChatCompleteResponseTransform, same call.
    "portkey-claude": (
        {
            "prompt_tokens": 10,
            "completion_tokens": 50,
            "total_tokens": 3060,
            "cache_read_input_tokens": 2000,
            "cache_creation_input_tokens": 1000,
        },
        (3010, 2000, 1000, 50, 0),
    ),
    # Shape: Groq, its timings beside.
    "groq": (
        {
            "queue_time": 0.037493756,
            "prompt_tokens": 18,
            "prompt_time": 0.000680594,
            "completion_tokens": 556,
            "completion_time": 0.463333333,
            "total_tokens": 574,
            "total_time": 0.464013927,
        },
        (18, 0, 0, 556, 0),
    ),
    # xAI's Chat Completions reasoning example: reasoning beside completion_tokens.
    "xai-reasoning": (
        {
            "prompt_tokens": 32,
            "completion_tokens": 9,
            "total_tokens": 135,
            "prompt_tokens_details": {
                "text_tokens": 32,
                "audio_tokens": 0,
                "image_tokens": 0,
                "cached_tokens": 6,
            },
            "completion_tokens_details": {
                "reasoning_tokens": 94,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
            "num_sources_used": 0,
        },
        (32, 6, 0, 103, 94),
    ),
    # xAI's prompt caching docs.
    "xai-cached": (
        {
            "prompt_tokens": 125,
            "completion_tokens": 48,
            "total_tokens": 173,
            "prompt_tokens_details": {
                "text_tokens": 125,
                "audio_tokens": 0,
                "image_tokens": 0,
                "cached_tokens": 98,
            },
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        (125, 98, 0, 48, 0),
    ),
    # Shape: xAI's Responses API, its reasoning beside output_tokens too.
    "xai-responses": (
        {
            "input_tokens": 100,
            "output_tokens": 20,
            "output_tokens_details": {"reasoning_tokens": 15},
            "total_tokens": 135,
            "cost_in_usd_ticks": 37756000,
        },
        (100, 0, 0, 35, 15),
    ),
    # Shape: Mistral.
    "mistral": ({"prompt_tokens": 16, "completion_tokens": 34, "total_tokens": 50}, (16, 0, 0, 34, 0)),
    # Shape: Fireworks (and Together), cached reads in prompt_tokens_details.
    "fireworks": (
        {
            "prompt_tokens": 1200,
            "total_tokens": 1230,
            "completion_tokens": 30,
            "prompt_tokens_details": {"cached_tokens": 1024},
        },
        (1200, 1024, 0, 30, 0),
    ),
    # vLLM with --enable-prompt-tokens-details (vllm-project/vllm#18067).
    "vllm": (
        {
            "total_tokens": 2306,
            "prompt_tokens": 2006,
            "completion_tokens": 300,
            "prompt_tokens_details": {"cached_tokens": 1920},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
        (2006, 1920, 0, 300, 0),
    ),
    "vllm-null-details": (
        {"prompt_tokens": 36, "total_tokens": 164, "prompt_tokens_details": None, "completion_tokens": 128},
        (36, 0, 0, 128, 0),
    ),
    # SGLang with a reasoning parser (the shape of sgl-project/sglang#17156, the count made up):
    # a part of completion_tokens.
    "sglang-reasoning": (
        {
            "prompt_tokens": 29,
            "total_tokens": 134,
            "completion_tokens": 105,
            "prompt_tokens_details": None,
            "reasoning_tokens": 80,
        },
        (29, 0, 0, 105, 80),
    ),
    # Shape: Ollama's OpenAI-compatible API.
    "ollama": ({"prompt_tokens": 26, "completion_tokens": 300, "total_tokens": 326}, (26, 0, 0, 300, 0)),
    # Kimi K2.5 (openclaw/openclaw#25436; its completion and total made up): the reads at the
    # top and in the details.
    "moonshot": (
        {
            "prompt_tokens": 1113,
            "completion_tokens": 40,
            "total_tokens": 1153,
            "cached_tokens": 1024,
            "prompt_tokens_details": {"cached_tokens": 1024},
        },
        (1113, 1024, 0, 40, 0),
    ),
    # Shape: Perplexity sonar.
    "perplexity-sonar": (
        {"prompt_tokens": 14, "completion_tokens": 70, "total_tokens": 84, "search_context_size": "low"},
        (14, 0, 0, 70, 0),
    ),
    # Perplexity sonar-deep-research (API reference): citations and reasoning beside the rest.
    "perplexity-deep-research": (
        {
            "prompt_tokens": 230,
            "completion_tokens": 13498,
            "total_tokens": 13728,
            "citation_tokens": 20470,
            "num_search_queries": 50,
            "reasoning_tokens": 145885,
            "search_context_size": "low",
        },
        (20700, 0, 0, 159383, 145885),
    ),
    # Shape: Cerebras.
    "cerebras": (
        {
            "prompt_tokens": 12,
            "completion_tokens": 34,
            "total_tokens": 46,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        (12, 0, 0, 34, 0),
    ),
}


@pytest.mark.parametrize("provider", sorted(PROVIDER_USAGES))
def test_each_provider_s_usage_is_read_as_it_bills(provider: str) -> None:
    raw, expected = PROVIDER_USAGES[provider]
    usage = parse_usage(raw)
    assert usage is not None
    got = (
        usage.input_tokens,
        usage.cached_input_tokens,
        usage.cache_creation_input_tokens,
        usage.output_tokens,
        usage.reasoning_tokens,
    )
    assert got == expected


def test_pieces_joined_as_they_come_read_as_the_pieces_do() -> None:
    """A stream's pieces are joined every ``LOOSE_PIECES`` (to hold its text near its size):
    escaped bytes (the fast path's) and str (the per-event path's) in any order read the same
    text, a surrogate pair split between them too."""
    obs = Observation()
    parts: list[str] = []
    for i in range(5 * LOOSE_PIECES + 3):
        if i % 7 == 3:
            obs.observe({"choices": [{"index": 0, "delta": {"content": f"<{i}>"}}]}, streaming=True)
            parts.append(f"<{i}>")
        elif i % 11 == 5:
            obs.raw_content(0, b"\\ud83d")  # an emoji cut by the events between its two halves
            obs.raw_content(0, b"\\ude80")
            parts.append("\U0001f680")
        else:
            obs.raw_content(0, orjson.dumps(f'"{i}"\n')[1:-1])
            parts.append(f'"{i}"\n')
        obs.add_text(0, f"({i})")
    assert len(obs.contents[0]) < 2 * LOOSE_PIECES
    assert obs.content_of(0) == "".join(parts)
    assert obs.answers() == ["".join(parts) + "".join(f"({i})" for i in range(5 * LOOSE_PIECES + 3))]


def test_a_streamed_commentary_is_taken_out_whole_however_its_pieces_were_joined() -> None:
    """A Responses message whose phase is told at its end (commentary: not the answer) is taken
    back out of the content from where it started, joined pieces or not on either side."""
    answer = {"type": "message", "id": "msg_0", "role": "assistant", "content": []}
    side = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}

    def delta(index: int, text: str) -> dict[str, Any]:
        return {"type": "response.output_text.delta", "output_index": index, "item_id": "x", "delta": text}

    obs = Observation()
    responses_event(obs, {"type": "response.output_item.added", "output_index": 0, "item": answer})
    for i in range(LOOSE_PIECES + 5):
        responses_event(obs, delta(0, f"a{i}"))
    responses_event(obs, {"type": "response.output_item.done", "output_index": 0, "item": answer})
    responses_event(obs, {"type": "response.output_item.added", "output_index": 1, "item": side})
    for i in range(3 * LOOSE_PIECES):
        responses_event(obs, delta(1, f"c{i}"))
    done = {**side, "phase": "commentary"}
    responses_event(obs, {"type": "response.output_item.done", "output_index": 1, "item": done})
    answer_text = "".join(f"a{i}" for i in range(LOOSE_PIECES + 5))
    assert obs.content_of(0) == answer_text
    assert obs.answers() == [answer_text + "".join(f"c{i}" for i in range(3 * LOOSE_PIECES))]


def test_a_streamed_web_search_call_counts_as_a_search_unless_its_done_item_tells_another_action() -> None:
    """Only a search action is a billed web search (OpenAI's web search guide); a call's action
    is told when its item is done. Begun and never done (a stream cut), a call counts as a
    search: the bound. Done without having begun, it counts by its action."""

    def item(index: int, action: str | None) -> dict[str, Any]:
        found: dict[str, Any] = {"type": "web_search_call", "id": f"ws_{index}", "status": "completed"}
        return found if action is None else {**found, "action": {"type": action}}

    def added(index: int) -> dict[str, Any]:
        return {"type": "response.output_item.added", "output_index": index, "item": item(index, None)}

    def done(index: int, action: str | None) -> dict[str, Any]:
        return {"type": "response.output_item.done", "output_index": index, "item": item(index, action)}

    obs = Observation()
    for event in (
        added(0),
        done(0, "search"),
        added(1),
        done(1, "open_page"),
        added(2),
        done(2, "find_in_page"),
        added(3),
        done(3, "a_new_action"),  # not known: a search
        added(4),
        done(4, None),  # no action told: a search
        done(5, "open_page"),  # never begun: nothing to take back
        done(6, "search"),  # never begun: counted when done
        added(7),  # begun, never done: the bound
    ):
        responses_event(obs, event)
    assert obs.tool_uses == {"web_search": 5}


def test_counting_a_streams_text_does_not_copy_it_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream without usage is billed on a count of its text: ``content_of`` joined its escaped
    pieces and quoted that join, two copies alive when it was decoded (2.0x the text); quoted
    as it is joined, one (1.0x)."""
    import proxy.observe as observe_module

    obs = Observation()
    piece = b"x" * 4095 + b"\\n"  # an escape in each, as a text's line breaks come
    for _ in range(1024):
        obs.raw_run(0, piece, 1)
    n = 1024 * len(piece)
    text, alive = alive_when_called(monkeypatch, observe_module, "parse_json", lambda: obs.content_of(0))
    assert text == ("x" * 4095 + "\n") * 1024
    assert alive < 1.5 * n, f"{alive / MB:.1f} MB alive for {n / MB:.1f} MB of text when it is decoded"


def test_a_stream_whose_only_web_search_call_read_a_page_saw_no_tool_run() -> None:
    """Begun, a web search call counts as a search (the bound); done with a page action (either
    of its names, ``find`` and ``find_in_page``), it is taken back. None left: no tool ran, as a
    stream with none says (``tool_uses`` None: ``settle._rates`` reads an empty count as a tool
    that ran, the review of 9027be3)."""
    for action in ("find", "find_in_page", "open_page"):
        obs = Observation()
        item: dict[str, Any] = {"type": "web_search_call", "id": "ws_1"}
        responses_event(obs, {"type": "response.output_item.added", "output_index": 0, "item": item})
        assert obs.tool_uses == {"web_search": 1}
        done = {**item, "action": {"type": action}}
        responses_event(obs, {"type": "response.output_item.done", "output_index": 0, "item": done})
        assert obs.tool_uses is None, (action, obs.tool_uses)


@pytest.mark.parametrize("told", [0, 1, 3])
def test_a_streams_final_count_of_web_searches_stands_over_its_items(told: int) -> None:
    """A web search call begun counts as a search (the bound, should the stream be cut); the
    final response's ``tool_usage.web_search.num_requests``, the searches OpenAI bills, stands
    over it when above (a search of several queries); below (a discounted search, or one whose
    usage was not recorded) the item stays counted, as it does in a stream cut before it."""
    item: dict[str, Any] = {"type": "web_search_call", "id": "ws_1"}
    done = {**item, "action": {"type": "search", "queries": ["a", "b", "c"]}}
    final = {
        "id": "resp_1",
        "status": "completed",
        "output": [done],
        "usage": {"input_tokens": 10, "output_tokens": 2, "total_tokens": 12},
        "tool_usage": {"web_search": {"num_requests": told}},
    }
    obs, cut = Observation(), Observation()
    for seen in (obs, cut):
        responses_event(seen, {"type": "response.output_item.added", "output_index": 0, "item": item})
        responses_event(seen, {"type": "response.output_item.done", "output_index": 0, "item": done})
    responses_event(obs, {"type": "response.completed", "response": final})
    billed = with_tool_calls(reserve_usage(10, 2), obs)
    assert billed.tool_calls == (("web_search", max(told, 1)),), billed
    assert with_tool_calls(reserve_usage(10, 2), cut).tool_calls == (("web_search", 1),)
