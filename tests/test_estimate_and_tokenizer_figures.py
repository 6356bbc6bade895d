"""The figures the estimate, the tokenizer and the refinement of a quick reserve decide, pinned
exactly where the rest of the suite let a wrong one pass: each test names what is reserved or
billed, and which count source a call records."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
import tiktoken
from prometheus_client import CollectorRegistry

from proxy.auth import Identity
from proxy.config_load import parse_config
from proxy.config_tiers import TierConfig
from proxy.estimate import Estimate, counted, estimate
from proxy.metrics import Metrics
from proxy.payload import (
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    Endpoint,
    MessagesBody,
    RequestView,
    ResponsesBody,
    compacts,
    generations,
)
from proxy.plan import tools_input_tokens
from proxy.pricing import INPUT_RATES, OUTPUT_RATES, reserve_amounts
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.refine import count_first, refine
from proxy.scopes import scopes_for
from proxy.store import Reservation
from proxy.tokenizer import (
    BYTES_ENCODING,
    CACHED_TEXT_CHARS,
    DEFAULT_ENCODING,
    QUICK_BOUND_CHARS,
    CountCache,
    Tokenizer,
    encoding_for_model,
)
from tests.conftest import base_config
from tests.outcome_helpers import byte_encoding

ENC = "o200k_base"


class QuarterEncoding:
    """A tiktoken stand-in at one token per 4 bytes: a count below the byte bound."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [0] * -(-len(text.encode()) // 4)


class DoubleEncoding:
    """A stand-in writing two tokens per byte: a count above the byte bound."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [0] * (2 * len(text.encode()))


def byte_estimate(endpoint: Endpoint, view: Any, **kwargs: Any) -> Estimate:
    """An estimate with no encoding installed (the UTF-8 byte bound), 100 output tokens by default."""
    options: dict[str, Any] = {
        "encoding": ENC,
        "tokenizer": Tokenizer({}),
        "model_max_output_tokens": None,
        "default_max_output_tokens": 100,
        **kwargs,
    }
    return estimate(endpoint, view, **options)


def chat(content: str | list[Any] = "hi", **fields: Any) -> ChatBody:
    return ChatBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    )


# -- the estimate's fixed figures ---------------------------------------------------------------


def test_each_input_of_a_batch_reserves_three_special_tokens() -> None:
    est = byte_estimate("embeddings", EmbeddingBody(model="m", input=["abc", "de"]))
    # "abc\nde": 6 bytes, and BOS, EOS and a word-start piece for each of the two inputs.
    assert (est.input_tokens, est.special_tokens) == (6 + 2 * 3, 2 * 3)


def test_a_legacy_completion_without_a_cap_reserves_and_forwards_sixteen_tokens() -> None:
    est = byte_estimate("completions", CompletionBody(model="m", prompt="hi"))
    assert (est.output_tokens, est.enforce_cap, est.output_cap_field) == (16, 16, "max_tokens")
    below = byte_estimate("completions", CompletionBody(model="m", prompt="hi"), model_max_output_tokens=8)
    assert (below.output_tokens, below.enforce_cap) == (8, 8)


def test_an_anthropic_upstream_reserves_600_tokens_for_its_tool_use_system_prompt() -> None:
    # 530 at most (Claude 3 Opus): a lower figure could reserve less than the provider bills.
    upstream = {"base_url": "http://127.0.0.1:9", "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    raw = base_config("http://127.0.0.1:9", "redis://127.0.0.1:9", upstreams={"anthropic": upstream})
    raw["models"] = {"claude-*": {"upstream": "anthropic"}}
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "k"})
    assert tools_input_tokens(config.models["claude-*"], config.upstreams["anthropic"]) == 600


def test_the_computer_tool_reserves_its_definition_and_its_system_prompt() -> None:
    tools = [{"type": "computer_20250124", "name": "computer", "display_width_px": 1, "display_height_px": 1}]
    view = MessagesBody(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=tools)
    plain = MessagesBody(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with_tool = byte_estimate("messages", view).prompt_overhead_tokens
    assert with_tool - byte_estimate("messages", plain).prompt_overhead_tokens == 735 + 499


def test_a_legacy_completion_reserves_its_prompt_and_its_special_tokens() -> None:
    est = byte_estimate("completions", CompletionBody(model="m", prompt="hi"))
    assert (est.input_tokens, est.special_tokens, est.separate_texts) == (2 + 3, 3, ("hi",))


def test_every_prompt_of_a_list_is_sent_with_the_suffix() -> None:
    est = byte_estimate("completions", CompletionBody(model="m", prompt=["a", "b"], suffix="xyz"))
    # "a\nb\nxyz\nxyz", and the special tokens of each of the four texts.
    assert est.separate_texts == ("a", "b", "xyz", "xyz")
    assert est.input_tokens == 1 + 1 + 3 + 3 + 3 + 4 * 3


def test_a_chat_template_adds_nothing_to_legacy_completions_and_embeddings() -> None:
    template = {"template_call_tokens": 50, "template_message_tokens": 7}
    views: list[tuple[Endpoint, RequestView]] = [
        ("completions", CompletionBody(model="m", prompt="hi")),
        ("embeddings", EmbeddingBody(model="m", input="hi")),
    ]
    for endpoint, view in views:
        assert byte_estimate(endpoint, view, **template) == byte_estimate(endpoint, view)


def test_an_anthropic_web_search_results_encrypted_page_is_reserved_at_its_bytes() -> None:
    result: dict[str, Any] = {
        "type": "web_search_result",
        "url": "https://e.com",
        "title": "",
        "encrypted_content": "Z" * 900,
    }
    answer: dict[str, Any] = {"type": "web_search_tool_result", "tool_use_id": "t", "content": [result]}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [answer]},
        {"role": "user", "content": "and?"},
    ]
    without = [*messages[:1], {"role": "assistant", "content": [{**answer, "content": []}]}, messages[2]]
    est = byte_estimate("messages", MessagesBody(model="m", max_tokens=5, messages=messages))
    plain = byte_estimate("messages", MessagesBody(model="m", max_tokens=5, messages=without))
    assert est.prompt_overhead_tokens - plain.prompt_overhead_tokens == 900


def test_a_chat_call_sending_both_caps_reserves_the_larger() -> None:
    est = byte_estimate("chat.completions", chat(max_completion_tokens=10, max_tokens=50))
    assert (est.output_tokens, est.output_cap_field, est.enforce_cap) == (50, "max_completion_tokens", None)


def test_a_chat_call_without_a_cap_is_held_to_its_reserve_by_max_completion_tokens() -> None:
    est = byte_estimate("chat.completions", chat(), model_max_output_tokens=300)
    assert (est.output_tokens, est.output_cap_field, est.enforce_cap, est.output_cap) == (
        300,
        "max_completion_tokens",
        300,
        300,
    )


def test_a_cap_above_the_models_is_lowered_and_forwarded_and_one_within_it_is_left_alone() -> None:
    # The upstream must never be allowed more output than the reserve covers.
    above = byte_estimate("chat.completions", chat(max_tokens=50), model_max_output_tokens=10)
    assert (above.output_tokens, above.enforce_cap, above.output_cap) == (10, 10, 10)
    within = byte_estimate("chat.completions", chat(max_tokens=10), model_max_output_tokens=10)
    assert (within.output_tokens, within.enforce_cap) == (10, None)


def test_a_legacy_completion_scoring_its_prompt_reserves_one_token_for_each_answer() -> None:
    view = CompletionBody.model_validate(
        {"model": "m", "prompt": "hi", "max_tokens": 0, "echo": True, "n": 3}
    )
    est = byte_estimate("completions", view)
    # vLLM runs max_tokens 0 as 1 and bills that token; the cap forwarded stays the one asked.
    assert (est.output_tokens, est.output_cap, est.enforce_cap) == (3, 0, None)


def test_an_embeddings_batch_of_token_ids_keeps_its_ids_as_fixed_input() -> None:
    est = byte_estimate("embeddings", EmbeddingBody(model="m", input=[[1, 2, 3], [4, 5]]))
    # Billed without usage as the count of no text plus this: every id is a token.
    assert (est.input_tokens, est.prompt_overhead_tokens) == (5, 5)


# -- counting a quick estimate ------------------------------------------------------------------


def test_counting_an_estimate_already_exact_leaves_it_as_it_is() -> None:
    est = byte_estimate("chat.completions", chat("word " * 100))
    assert est.input_exact
    assert counted(est, Tokenizer({ENC: QuarterEncoding()}), ENC) == est


def test_a_compacting_call_counted_after_a_quick_reserve_keeps_both_readings() -> None:
    text = "word " * (QUICK_BOUND_CHARS // 4)  # 20,480 bytes of new text: a quick estimate
    view = MessagesBody.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": text}],
            "context_management": {"edits": [{"type": "compact_20260112"}]},
        }
    )
    tokenizer = Tokenizer({ENC: QuarterEncoding()})
    quick = estimate(
        "messages",
        view,
        encoding=ENC,
        tokenizer=tokenizer,
        model_max_output_tokens=None,
        default_max_output_tokens=5,
    )
    overhead = 4 * 2 + 3  # one message and the system prompt's, and the reply's priming
    assert not quick.input_exact and quick.input_tokens == 2 * (len(text) + overhead)
    assert counted(quick, tokenizer, ENC).input_tokens == 2 * (len(text) // 4 + overhead)


def test_a_responses_compaction_pass_reserves_the_input_again_and_the_output_it_reads() -> None:
    """OpenAI's compaction pass comes mid-answer: it reads the input and what was written before
    it, writes a summary, and the inference after it reads that summary. Reserved: the input
    twice, the output once (``max_output_tokens`` bounds the whole response, summary and all),
    and that output again as input, kept when a quick estimate is counted (the params hunt)."""
    text = "word " * (QUICK_BOUND_CHARS // 4)  # a quick estimate
    body = {"model": "m", "input": text, "max_output_tokens": 500}
    management = [{"type": "compaction", "compact_threshold": 1000}]
    tokenizer = Tokenizer({ENC: QuarterEncoding()})
    options: dict[str, Any] = {
        "encoding": ENC,
        "tokenizer": tokenizer,
        "model_max_output_tokens": None,
        "default_max_output_tokens": 5,
    }
    plain = estimate("responses", ResponsesBody.model_validate(body), **options)
    quick = estimate(
        "responses", ResponsesBody.model_validate({**body, "context_management": management}), **options
    )
    assert quick.output_tokens == 500 and quick.output_cap == 500 and quick.enforce_cap is None
    assert quick.input_tokens == 2 * plain.input_tokens + 500
    exact = counted(plain, tokenizer, ENC).input_tokens
    assert counted(quick, tokenizer, ENC).input_tokens == 2 * exact + 500


def test_a_count_above_the_quick_bound_never_raises_the_reserve() -> None:
    text = "x" * QUICK_BOUND_CHARS
    tokenizer = Tokenizer({ENC: DoubleEncoding()})
    quick = estimate(
        "chat.completions",
        chat(text),
        encoding=ENC,
        tokenizer=tokenizer,
        model_max_output_tokens=None,
        default_max_output_tokens=5,
    )
    assert not quick.input_exact
    assert counted(quick, tokenizer, ENC).input_tokens == quick.input_tokens == len(text) + 4 + 3


# -- what is sent as prompt ---------------------------------------------------------------------


def test_an_empty_tools_list_adds_nothing_to_the_reserve() -> None:
    assert byte_estimate("chat.completions", chat(tools=[])) == byte_estimate("chat.completions", chat())


def test_tools_without_any_input_are_reserved_after_a_break() -> None:
    tools = [{"type": "function", "name": "f"}]
    est = byte_estimate("responses", ResponsesBody(model="m", tools=tools))
    # The empty prompt and the tools' JSON, joined by a line break; one message and the reply.
    assert est.input_tokens == 1 + len('[{"type":"function","name":"f"}]') + 4 + 3


def test_a_json_schema_response_format_is_reserved_as_prompt_and_json_mode_is_not() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    plain = byte_estimate("chat.completions", chat()).input_tokens
    added = byte_estimate("chat.completions", chat(response_format=schema)).input_tokens - plain
    assert added == 1 + len(json.dumps(schema, separators=(",", ":")))
    assert (
        byte_estimate("chat.completions", chat(response_format={"type": "json_object"})).input_tokens == plain
    )


def test_an_anthropic_beta_output_format_is_reserved_as_prompt() -> None:
    form = {"type": "json_schema", "schema": {"type": "object"}}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    plain = byte_estimate("messages", MessagesBody.model_validate(body)).input_tokens
    beta = byte_estimate(
        "messages", MessagesBody.model_validate({**body, "output_format": form})
    ).input_tokens
    assert beta - plain == 1 + len(json.dumps(form, separators=(",", ":")))


def test_tools_beside_messages_without_text_are_reserved_after_a_break() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    est = byte_estimate("chat.completions", chat([], tools=tools))
    assert est.input_tokens == 1 + len('[{"type":"function","function":{"name":"f"}}]') + 4 + 3


def test_an_anthropic_system_prompts_image_is_reserved_as_a_media_part() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with_image = MessagesBody.model_validate({**body, "system": [image]})
    plain = byte_estimate("messages", with_image).input_tokens
    assert byte_estimate("messages", with_image, media_part_input_tokens=1000).input_tokens == plain + 1000


def test_legacy_functions_add_the_tool_use_system_prompt() -> None:
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    plain = byte_estimate("chat.completions", chat(functions=functions)).input_tokens
    assert byte_estimate(
        "chat.completions", chat(functions=functions), tools_input_tokens=50
    ).input_tokens == (plain + 50)


def compact(value: Any) -> int:
    """The bytes of ``value`` as the estimate writes it: compact JSON."""
    return len(json.dumps(value, separators=(",", ":")))


@pytest.mark.parametrize("field", ["documents", "chat_template_kwargs"])
def test_a_chat_templates_documents_and_arguments_are_reserved_as_prompt(field: str) -> None:
    value: Any = [{"title": "t", "text": "some text"}] if field == "documents" else {"enable_thinking": True}
    plain = byte_estimate("chat.completions", chat()).input_tokens
    assert byte_estimate("chat.completions", chat(**{field: value})).input_tokens == plain + 1 + compact(
        value
    )


def test_a_stored_prompts_variables_are_reserved_as_prompt() -> None:
    stored = {"id": "pmpt_1", "variables": {"city": "Lisbon", "note": {"type": "input_text", "text": "abc"}}}
    plain = byte_estimate("responses", ResponsesBody(model="m", input="hi")).input_tokens
    est = byte_estimate("responses", ResponsesBody(model="m", input="hi", prompt=stored))
    assert est.input_tokens == plain + len("\nLisbon\nabc")


def test_a_responses_text_format_schema_is_reserved_as_prompt() -> None:
    form = {"type": "json_schema", "name": "s", "schema": {"type": "object"}}
    plain = byte_estimate("responses", ResponsesBody(model="m", input="hi")).input_tokens
    est = byte_estimate("responses", ResponsesBody(model="m", input="hi", text={"format": form}))
    assert est.input_tokens == plain + 1 + compact(form)


def test_an_anthropic_output_config_format_is_reserved_as_prompt() -> None:
    form = {"type": "json_schema", "schema": {"type": "object"}}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    plain = byte_estimate("messages", MessagesBody.model_validate(body)).input_tokens
    config = MessagesBody.model_validate({**body, "output_config": {"format": form}})
    assert byte_estimate("messages", config).input_tokens == plain + 1 + compact(form)


def test_anthropic_mcp_servers_add_the_tool_use_system_prompt_and_an_empty_list_does_not() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    server = {"type": "url", "url": "https://example.com/mcp", "name": "s"}

    def overhead(**fields: Any) -> int:
        view = MessagesBody.model_validate({**body, **fields})
        return byte_estimate("messages", view, tools_input_tokens=600).prompt_overhead_tokens

    assert overhead(mcp_servers=[]) == overhead()
    assert overhead(mcp_servers=[server]) == overhead() + 600


@pytest.mark.parametrize(
    ("fields", "passes"),
    [
        ({}, 1),  # no tools: one pass
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 1),  # the client runs it
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, 1),  # Anthropic's, the client runs it
        ({"tools": [{"type": "memory_20250818", "name": "memory"}]}, 1),  # its memory tool: alike
        ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, 4),
        # Priced or not, bounded or not (the default's 7): every server tool's calls, and the last.
        ({"tools": [{"type": "web_fetch_20250910", "name": "web_fetch"}]}, 8),
        ({"tools": [{"type": "code_execution_20250825", "name": "code_execution", "max_uses": 2}]}, 3),
        ({"tools": [{"type": "tool_search_tool_regex", "name": "tool_search_tool_regex"}]}, 8),
        # A max_uses that is no count is the default's (Anthropic refuses it: billed nothing).
        ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": "3"}]}, 8),
        (
            {
                "tools": [
                    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                    {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2},
                ]
            },
            6,
        ),
        ({"mcp_servers": [{"type": "url", "url": "https://example.com/mcp", "name": "s"}] * 2}, 15),
        ({"mcp_servers": "not a list"}, 1),
    ],
)
def test_a_server_tool_loops_every_pass_is_reserved_its_output_cap(
    fields: dict[str, Any], passes: int
) -> None:
    """Anthropic: "The limit applies to each call to the requested model. A request that uses
    server tools can call the model more than once, so usage.output_tokens can exceed max_tokens"
    (the SDK's max_tokens). Reserved at one max_tokens, a loop of searches wrote past it (the
    params hunt): each pass is reserved its cap, one after each server tool call it may make
    (``max_uses``, else the default) and the last; the cap forwarded stays the one of a pass."""
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    view = MessagesBody.model_validate({**body, **fields})
    est = byte_estimate("messages", view, default_tool_calls=7)
    assert (est.output_tokens, est.output_cap, est.output_passes) == (100 * passes, 100, passes)
    assert est.enforce_cap is None  # the client's own cap goes as it came
    # A compacting call's summary is written up to the cap in every pass as well.
    compacting = MessagesBody.model_validate({**body, **fields, "compaction": {"type": "summarize"}})
    assert byte_estimate("messages", compacting, default_tool_calls=7).output_tokens == 2 * 100 * passes


def test_a_server_tool_loop_of_another_endpoint_is_one_pass() -> None:
    """A Responses call's max_output_tokens bounds the whole response, every pass of its hosted
    tools' loop together: its output is reserved once."""
    tools = [{"type": "web_search", "max_uses": 3}]
    view = ResponsesBody.model_validate(
        {"model": "m", "input": "hi", "max_output_tokens": 100, "tools": tools}
    )
    est = byte_estimate("responses", view, default_tool_calls=7)
    assert (est.output_tokens, est.output_passes) == (100, 1)


# -- the tokenizer ------------------------------------------------------------------------------


def test_without_an_encoding_a_count_is_four_characters_a_token_rounded_up() -> None:
    tokenizer = Tokenizer({})
    assert [tokenizer.count(text, ENC) for text in ("a", "abcd", "abcde", "é" * 8)] == [
        (1, "chars"),
        (1, "chars"),
        (2, "chars"),
        (2, "chars"),  # characters, not bytes
    ]


def test_an_empty_text_is_counted_under_the_source_that_would_count_it() -> None:
    assert Tokenizer({ENC: byte_encoding()}).count("", ENC) == (0, "tokenizer")
    assert Tokenizer({ENC: byte_encoding()}).count("abc", ENC) == (3, "tokenizer")
    # An encoding tried at start that never loaded counts as none.
    assert Tokenizer({ENC: None}).count("", ENC) == (0, "chars")
    assert Tokenizer({ENC: None}).count("abc", ENC) == (1, "chars")


def test_the_byte_bound_counts_utf8_bytes_not_characters() -> None:
    assert Tokenizer({}).upper_bound("ü€", ENC) == 2 + 3
    assert Tokenizer({}).upper_bound("", ENC) == 0
    assert Tokenizer({ENC: byte_encoding()}).upper_bound("abc", ENC) == 3


def test_a_quick_bound_of_much_new_text_is_its_utf8_bytes() -> None:
    text = "é" * QUICK_BOUND_CHARS
    bound = Tokenizer({ENC: QuarterEncoding()}).quick_bound_of_parts([text], ENC)
    assert bound == (2 * QUICK_BOUND_CHARS, False)


def test_new_text_of_exactly_the_quick_threshold_is_bounded_not_counted() -> None:
    tokenizer = Tokenizer({ENC: QuarterEncoding()})
    assert tokenizer.quick_bound_of_parts(["x" * QUICK_BOUND_CHARS], ENC) == (QUICK_BOUND_CHARS, False)
    below = "x" * (QUICK_BOUND_CHARS - 1)
    assert tokenizer.quick_bound_of_parts([below], ENC) == (-(-len(below) // 4), True)


def test_empty_parts_count_nothing_but_their_breaks() -> None:
    tokenizer = Tokenizer({ENC: byte_encoding()})
    assert tokenizer.quick_bound_of_parts(["", "ab"], ENC) == (1 + 2, True)
    assert tokenizer.quick_bound_of_parts([], ENC) == (0, True)


def test_a_prompt_of_token_ids_alone_reserves_its_ids_with_an_encoding_installed() -> None:
    est = byte_estimate(
        "completions",
        CompletionBody(model="m", prompt=[1, 2, 3]),
        tokenizer=Tokenizer({ENC: byte_encoding()}),
    )
    assert est.input_tokens == 3


def remembered_parts(tokenizer: Tokenizer, count: int, scope: str = "") -> list[str]:
    """``count`` distinct texts of CACHED_TEXT_CHARS characters, counted (and so remembered)."""
    parts = [chr(ord("a") + i) * CACHED_TEXT_CHARS for i in range(count)]
    tokenizer.upper_bound_of_parts(parts, ENC, scope=scope)
    return parts


def test_a_text_of_exactly_the_cached_length_is_remembered() -> None:
    # Enough text for a quick bound: remembered, it is counted at once, at its count.
    tokenizer = Tokenizer({ENC: QuarterEncoding()})
    parts = remembered_parts(tokenizer, QUICK_BOUND_CHARS // CACHED_TEXT_CHARS)
    assert tokenizer.quick_bound_of_parts(parts, ENC) == (
        len(parts) - 1 + len(parts) * CACHED_TEXT_CHARS // 4,
        True,
    )


def test_one_tenants_remembered_counts_are_not_another_tenants() -> None:
    # Whether a text was remembered shows in the reserve: it must not tell what another sent.
    tokenizer = Tokenizer({ENC: QuarterEncoding()})
    parts = remembered_parts(tokenizer, QUICK_BOUND_CHARS // CACHED_TEXT_CHARS, scope="team-a")
    assert tokenizer.quick_bound_of_parts(parts, ENC, scope="team-b") == (
        len(parts) - 1 + len(parts) * CACHED_TEXT_CHARS,
        False,
    )
    assert tokenizer.quick_bound_of_parts(parts, ENC, scope="team-a")[1]


def test_a_cache_filled_exactly_to_its_size_keeps_every_text() -> None:
    tokenizer = Tokenizer({ENC: QuarterEncoding()}, cache_chars=QUICK_BOUND_CHARS)
    parts = remembered_parts(tokenizer, QUICK_BOUND_CHARS // CACHED_TEXT_CHARS)
    assert tokenizer.cache.chars == QUICK_BOUND_CHARS
    assert tokenizer.quick_bound_of_parts(parts, ENC)[1]


def test_the_cache_drops_the_least_recently_used_text_first() -> None:
    cache = CountCache(2 * CACHED_TEXT_CHARS)
    a, b, c = ("a" * CACHED_TEXT_CHARS, "b" * CACHED_TEXT_CHARS, "c" * CACHED_TEXT_CHARS)
    cache.put(ENC, a, 1)
    cache.put(ENC, b, 2)
    assert cache.get(ENC, a) == 1  # a used since b was put
    cache.put(ENC, c, 3)
    assert (cache.get(ENC, a), cache.get(ENC, b), cache.get(ENC, c)) == (1, None, 3)


def test_a_text_longer_than_the_whole_cache_evicts_nothing() -> None:
    cache = CountCache(2 * CACHED_TEXT_CHARS)
    a = "a" * CACHED_TEXT_CHARS
    cache.put(ENC, a, 1)
    cache.put(ENC, "z" * (3 * CACHED_TEXT_CHARS), 9)
    assert cache.get(ENC, a) == 1 and cache.chars == CACHED_TEXT_CHARS


def test_a_models_encoding_is_the_configured_one_else_tiktokens_else_o200k_base() -> None:
    assert encoding_for_model("gpt-4o", "bytes") == "bytes"
    assert encoding_for_model("gpt-4", None) == "cl100k_base"
    assert encoding_for_model("no-such-model-anywhere", None) == DEFAULT_ENCODING == "o200k_base"


def test_an_encoding_tried_once_is_not_loaded_again_on_a_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def refuse(name: str) -> None:  # never a download
        asked.append(name)
        raise ValueError(name)

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    tokenizer = Tokenizer({ENC: None})
    assert tokenizer.load_more([ENC, BYTES_ENCODING]) is None
    thread = tokenizer.load_more(["cl100k_base"])
    assert thread is not None
    thread.join(10)
    assert tokenizer.load_more(["cl100k_base"]) is None
    assert asked == ["cl100k_base"] and not tokenizer.available("cl100k_base")


# -- refining a quick reserve -------------------------------------------------------------------

IDENTITY = Identity(tenant="team-a", tier="standard", key_name="a-ci")
RUN_TIER = TierConfig.model_validate({"run": {"total_tokens": 10**6}})


@pytest.fixture
async def one_store(redis_server: RedisServerProcess, redis_client: object) -> AsyncIterator[RedisStore]:
    """A store on the session's Redis, flushed by ``redis_client``."""
    store = RedisStore.from_url(redis_server.url)
    yield store
    await store.close()


def quick_chat() -> Estimate:
    """A quick estimate of much new text: reserved at its bytes, counted later (a quarter)."""
    est = estimate(
        "chat.completions",
        chat("x" * QUICK_BOUND_CHARS),
        encoding=ENC,
        tokenizer=Tokenizer({ENC: QuarterEncoding()}),
        model_max_output_tokens=None,
        default_max_output_tokens=10,
    )
    assert not est.input_exact
    return est


async def reserved_call(
    store: RedisStore,
    est: Estimate,
    rates: dict[str, int] | None = None,
    *,
    short: dict[str, int] | None = None,
    above: int | None = None,
) -> Any:
    """What ``refine`` reads of a call, its reserve made in Redis (a call's other fields unread):
    reserved at ``rates``; at the long-context prices past ``above``, ``short`` within it."""
    scopes = scopes_for(IDENTITY, "run1", RUN_TIER, datetime.now(UTC), run_ttl_s=0)
    reservation = await store.reserve(
        tenant="team-a",
        reservation_id="r1",
        run_id="run1",
        scopes=scopes,
        amounts=reserve_amounts(est, rates),
        lease_ms=60_000,
        record="{}",
    )
    assert isinstance(reservation, Reservation)
    return RefinedCall("r1", reservation, est, rates, short, above)


def per_token(input_micros: int, output_micros: int) -> dict[str, int]:
    """Rates (micro-units per million tokens) of every input kind and every output kind."""
    return {
        **dict.fromkeys((*INPUT_RATES, "image_input"), input_micros * 1_000_000),
        **dict.fromkeys((*OUTPUT_RATES, "image_output"), output_micros * 1_000_000),
    }


@dataclass
class RefinedCall:
    """What ``refine`` reads and writes of a call."""

    request_id: str
    reservation: Reservation
    estimate: Estimate
    reserve_rates: dict[str, int] | None = None
    reserve_rates_short: dict[str, int] | None = None
    long_context_above: int | None = None
    asks_images: bool = False

    @property
    def rates_reserved(self) -> dict[str, int] | None:
        return self.reserve_rates


def metric(metrics: Metrics, result: str) -> int:
    return int(metrics.quick_estimates.labels(result).value)


async def test_a_refined_call_keeps_the_exact_count_to_be_billed_at(one_store: RedisStore) -> None:
    quick = quick_chat()
    call = await reserved_call(one_store, quick)
    metrics = Metrics(CollectorRegistry())

    async def count(_call: Any) -> Estimate:
        return counted(quick, Tokenizer({ENC: QuarterEncoding()}), ENC)

    await refine(one_store, call, count, metrics)
    assert call.estimate.input_exact and call.estimate.input_tokens == QUICK_BOUND_CHARS // 4 + 4 + 3
    assert call.reservation.amounts["input_tokens"] == call.estimate.input_tokens
    assert metric(metrics, "lowered") == 1


async def test_a_bound_past_the_long_context_threshold_counted_within_it_is_lowered_to_the_models_prices(
    one_store: RedisStore,
) -> None:
    """Reserved at the long-context prices by its bound, the call's count within the threshold
    lowers the reserve in Redis (what a reaper bills) to the model's own prices, and the call is
    billed at its reserve at them. Was: the exact count at the long-context prices."""
    quick = quick_chat()
    # Per million tokens: 1 and 10 micro-units a token within the threshold, 2 and 15 past it.
    short, long = per_token(1, 10), per_token(2, 15)
    exact = counted(quick, Tokenizer({ENC: QuarterEncoding()}), ENC)
    above = quick.input_tokens - 1  # the bound passes it; its count does not
    assert exact.input_tokens <= above
    call = await reserved_call(one_store, quick, long, short=short, above=above)

    async def count(_call: Any) -> Estimate:
        return exact

    await refine(one_store, call, count, Metrics(CollectorRegistry()))
    assert call.rates_reserved == short
    held = call.reservation.amounts
    assert held["cost_micros"] == exact.input_tokens * 1 + exact.output_tokens * 10
    record = await one_store.client.hget("lbp:{team-a}:resv:r1", "amounts")
    assert record is not None and int(record.split()[4]) == held["cost_micros"]


async def test_a_count_equal_to_the_bound_neither_shrinks_nor_counts_as_lowered(
    one_store: RedisStore,
) -> None:
    quick = quick_chat()
    call = await reserved_call(one_store, quick)
    metrics = Metrics(CollectorRegistry())

    async def count(_call: Any) -> Estimate:
        return replace(quick, uncounted=())  # every byte a token

    await refine(one_store, call, count, metrics)
    assert call.estimate.input_exact and metric(metrics, "lowered") == 0


async def test_a_count_that_fails_before_the_reserve_makes_the_bound_final() -> None:
    quick = quick_chat()
    call: Any = SimpleNamespace(request_id="r1", estimate=quick)  # what count_first reads of a call

    async def count(_call: Any) -> Estimate:
        raise RuntimeError("the encoder failed on purpose")

    assert not await count_first(call, count)  # told as quick_estimates{failed} by the reserve
    # Final: no count is tried again after the reserve, nor at the settle.
    assert call.estimate.input_exact and call.estimate.input_tokens == quick.input_tokens


def test_a_compactions_own_instructions_are_reserved() -> None:
    """Anthropic's threshold compaction: ``instructions`` is the summarizing step's prompt (it
    replaces Anthropic's own), read beside the conversation and billed with that step; the
    estimate left it out of the input, and a long one passed a ceiling by its whole count, with
    no estimate error at all (the request estimate hunt)."""
    text = "word " * 200
    instructions = "Summarize keeping every identifier, path and number verbatim. " * 40

    def reserved(edit: dict[str, Any]) -> int:
        view = MessagesBody.model_validate(
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": text}],
                "context_management": {"edits": [edit]},
            }
        )
        return byte_estimate("messages", view).input_tokens

    plain = reserved({"type": "compact_20260112"})
    told = reserved({"type": "compact_20260112", "instructions": instructions})
    # Both readings of the input are reserved (the step's and the answer's), the prompt in them.
    assert told - plain >= len(instructions.encode())


@pytest.mark.parametrize("instructions", [None, "Keep every path verbatim. " * 40])
def test_a_compaction_request_is_reserved_as_a_compacting_edit_is(instructions: str | None) -> None:
    """The beta's compaction request (a top-level ``compaction``): the conversation summarized,
    its ``instructions`` the summarizing step's prompt. Read by no estimate, its instructions
    passed a ceiling by their whole count (the params hunt); reserved as a ``compact_*`` edit
    giving the same instructions is: the input twice with them, the output twice."""
    told = {} if instructions is None else {"instructions": instructions}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 200}]}
    edit = MessagesBody.model_validate(
        {**body, "context_management": {"edits": [{"type": "compact_20260112", **told}]}}
    )
    request = MessagesBody.model_validate({**body, "compaction": {"type": "summarize", **told}})
    plain = byte_estimate("messages", MessagesBody.model_validate(body))
    assert compacts(request) and generations(request) == 2
    est = byte_estimate("messages", request)
    assert (est.input_tokens, est.output_tokens) == (
        byte_estimate("messages", edit).input_tokens,
        byte_estimate("messages", edit).output_tokens,
    )
    assert est.input_tokens >= 2 * (plain.input_tokens + len(instructions or ""))
    assert est.output_tokens == 2 * plain.output_tokens
