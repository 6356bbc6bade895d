"""Tests that kill mutants of the answer observers (Messages, Responses), ``billed_usage`` and
``outcome``: each pins a billed figure, a usage source, a tier or an outcome tag that a small
change of the code would alter, read on the observation of an answer, without a server."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.billed_usage import billed_usage
from proxy.call import Call
from proxy.config import PolicyConfig
from proxy.config_load import parse_config
from proxy.observe import Observation, ProviderUsage, parse_usage
from proxy.observe_anthropic import anthropic_body, anthropic_event, anthropic_usage
from proxy.observe_responses import responses_body, responses_event
from proxy.outcome import classify_answer
from proxy.payload import Endpoint
from tests.conftest import base_config
from tests.test_billed_usage import TOKENIZER, answered, plan_of

MESSAGES = [{"role": "user", "content": "a prompt of some forty characters, about"}]


def planned(body: dict[str, Any], endpoint: Endpoint) -> Call:
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:9")
    raw["upstreams"]["anthropic"] = {
        "base_url": "http://127.0.0.1:9",
        "kind": "anthropic",
        "api_key_env": "TEST_UPSTREAM_KEY",
    }
    raw["models"] = {**raw["models"], "claude-x": {"upstream": "anthropic"}}
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-up"}, key_secrets=False)
    return plan_of(config, body, endpoint)


def claude(**fields: Any) -> Call:
    return planned({"model": "claude-x", "max_tokens": 100, "messages": MESSAGES, **fields}, "messages")


def chat(**fields: Any) -> Call:
    return planned({"model": "gpt-4o-mini", "messages": MESSAGES, **fields}, "chat.completions")


def events(*objs: dict[str, Any]) -> Observation:
    obs = Observation()
    for obj in objs:
        anthropic_event(obs, obj)
    return obs


def start(usage: dict[str, Any]) -> dict[str, Any]:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x"}
    return {"type": "message_start", "message": {**message, "content": [], "usage": usage}}


def text(piece: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}


def search_block(index: int) -> dict[str, Any]:
    block = {"type": "server_tool_use", "id": f"srvtoolu_{index}", "name": "web_search", "input": {}}
    return {"type": "content_block_start", "index": index, "content_block": block}


# -- billed_usage -------------------------------------------------------------------------------


def code_result(kind: str, *file_ids: str) -> dict[str, Any]:
    """A code execution tool's result block (``kind``: ``bash_code_execution`` or, older,
    ``code_execution``) telling the files its code wrote."""
    outputs = [{"type": f"{kind}_output", "file_id": f} for f in file_ids]
    result = {"type": f"{kind}_result", "stdout": "", "stderr": "", "return_code": 0, "content": outputs}
    return {"type": f"{kind}_tool_result", "tool_use_id": "srvtoolu_1", "content": result}


FILE_RESULTS = [
    code_result("bash_code_execution", "file_1", "file_2"),
    code_result("code_execution", "file_3"),
    # PFC with web search: stdout encrypted, the files told as ever.
    {
        "type": "code_execution_tool_result",
        "tool_use_id": "srvtoolu_2",
        "content": {
            "type": "encrypted_code_execution_result",
            "encrypted_stdout": "AAAA",
            "stderr": "",
            "return_code": 0,
            "content": [{"type": "code_execution_output", "file_id": "file_4"}],
        },
    },
    # An error tells none; a text editor's result names no file id.
    {
        "type": "bash_code_execution_tool_result",
        "tool_use_id": "srvtoolu_3",
        "content": {"type": "bash_code_execution_tool_result_error", "error_code": "unavailable"},
    },
    {
        "type": "text_editor_code_execution_tool_result",
        "tool_use_id": "srvtoolu_4",
        "content": {"type": "text_editor_code_execution_create_result", "is_file_update": False},
    },
]


def test_the_files_anthropic_s_code_execution_wrote_are_told_whole_and_streamed() -> None:
    """Kept by the Files API in the key's workspace, for a later call to name: its tenant's."""
    whole = Observation()
    message = {"id": "msg_1", "type": "message", "content": FILE_RESULTS, "usage": {"input_tokens": 1}}
    anthropic_body(whole, message)
    streamed = events(
        *(
            {"type": "content_block_start", "index": k, "content_block": block}
            for k, block in enumerate(FILE_RESULTS)
        )
    )
    assert whole.file_ids == streamed.file_ids == ["file_1", "file_2", "file_3", "file_4"]


def test_searches_seen_above_a_partial_count_are_billed_when_the_stream_is_cut() -> None:
    """message_start told one search; two ran before the cut: the two are billed."""
    usage = {"input_tokens": 12, "output_tokens": 1, "server_tool_use": {"web_search_requests": 1}}
    obs = events(start(usage), search_block(1), search_block(2))
    billed = billed_usage(claude(), obs, TOKENIZER, complete=False)
    assert billed.tool_calls == (("web_search", 2),)


def test_an_error_event_after_message_start_bills_the_told_input_and_the_counted_text() -> None:
    """The README's choice: the provider's input and the text counted, not the reserved output."""
    obs = events(start({"input_tokens": 12, "output_tokens": 1}), text("x" * 40), {"type": "error"})
    assert obs.error
    billed = billed_usage(claude(), obs, TOKENIZER, complete=False)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (12, 10, "chars")
    assert not billed.input_known


def test_a_count_equal_to_what_the_provider_told_keeps_the_provider_as_source() -> None:
    obs = Observation()
    obs.add_text(0, "y" * 8, content=True)  # 2 tokens by the count
    obs.take_usage(ProviderUsage(12, 2, 0, 0, output_known=False))
    billed = billed_usage(chat(max_tokens=500), obs, TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (12, 2, "provider")


def test_a_count_above_what_the_provider_told_is_sourced_as_the_count() -> None:
    obs = Observation()
    obs.add_text(0, "y" * 80, content=True)  # 20 tokens by the count
    obs.take_usage(ProviderUsage(12, 2, 0, 0, output_known=False))
    billed = billed_usage(chat(max_tokens=500), obs, TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (12, 20, "chars")


def test_a_server_tool_loops_answer_counted_without_figures_is_held_to_every_pass_cap() -> None:
    """A Messages call with a server tool (2 searches: 3 passes of max_tokens 10) whose answer
    came without figures: its count (100 characters, 25 tokens) is held to all its passes'
    caps (30), not one pass's (10)."""
    call = claude(max_tokens=10, tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}])
    assert (call.estimate.output_passes, call.reserved_output_tokens) == (3, 30)
    usage = billed_usage(call, answered("x" * 100), TOKENIZER, complete=True)
    assert (usage.source, usage.output_tokens) == ("chars", 25)


def test_parts_the_provider_leaves_untold_never_add_up_past_their_whole() -> None:
    """Writes no TTL split tells, on a request keeping writes an hour, are billed as kept an hour
    up to the writes told (never more, even where the counts handed over overlap); an image
    call's output that tells no image count is images but for what reasoning and audio take of
    it (never the whole beside them). The ledger's parts stay within their whole."""
    hour_block = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    hourly = claude(messages=[{"role": "user", "content": [hour_block]}])
    gateway = anthropic_usage({"input_tokens": 50, "cache_creation_input_tokens": 300, "output_tokens": 10})
    # Untold writes overlapping the hour's told: no observer counts so, the cap holds all the same.
    overlapping = ProviderUsage(
        650,
        10,
        0,
        0,
        cache_creation_input_tokens=300,
        cache_creation_1h_input_tokens=100,
        cache_creation_untold_input_tokens=250,
    )
    images = chat(modalities=["image", "text"])
    details = {"reasoning_tokens": 30, "audio_tokens": 20}
    told = parse_usage({"prompt_tokens": 10, "completion_tokens": 100, "completion_tokens_details": details})
    past = ProviderUsage(10, 100, 0, 80, audio_output_tokens=40)  # parts past the whole: none left
    cases = [
        (hourly, gateway, 300, 0),
        (hourly, overlapping, 300, 0),
        (images, told, 0, 50),
        (images, past, 0, 0),
    ]
    for call, usage, hour, image_output in cases:
        assert usage is not None
        obs = Observation()
        obs.take_usage(usage)
        billed = billed_usage(call, obs, TOKENIZER, complete=True)
        assert (billed.cache_creation_1h_input_tokens, billed.image_output_tokens) == (hour, image_output), (
            usage
        )
        assert (
            billed.cache_creation_1h_input_tokens <= billed.cache_creation_input_tokens <= billed.input_tokens
        )
        left = billed.output_tokens - billed.reasoning_tokens - billed.audio_output_tokens
        assert 0 <= billed.image_output_tokens <= max(left, 0), billed


# -- outcome ------------------------------------------------------------------------------------

REJECT_JSON = PolicyConfig(on_invalid_json="reject")


@pytest.mark.parametrize("reason", ["pause_turn", "compaction"])
def test_a_turn_paused_or_compacted_is_not_held_to_json(reason: str) -> None:
    """The turn goes on in the next call: its few words (or none) are not the JSON answer."""
    body = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Let me search"}],
        "stop_reason": reason,
        "usage": {"input_tokens": 12, "output_tokens": 3},
    }
    obs = Observation()
    anthropic_body(obs, body)
    assert classify_answer(obs, REJECT_JSON, json_mode=True).tag == "ok"


def test_an_answer_with_nothing_in_it_is_not_json() -> None:
    """No finish reason, no text, no call: the one answer is empty, and empty is not JSON."""
    outcome = classify_answer(Observation(), REJECT_JSON, json_mode=True)
    assert (outcome.tag, outcome.label) == (
        "rejected",
        "rejected:parse-json: Expecting value at line 1 column 1",
    )


def test_an_answer_that_is_only_a_call_on_its_second_choice_is_not_held_to_json() -> None:
    obs = Observation()
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    obs.observe({"choices": [{"index": 1, "delta": {"tool_calls": [call]}}]}, streaming=True)
    assert obs.calls == {1}
    assert classify_answer(obs, REJECT_JSON, json_mode=True).tag == "ok"


def test_words_beside_a_call_that_ends_with_stop_are_held_to_json() -> None:
    """A forced call ends with "stop": only a call with no words is let off the JSON check."""
    obs = Observation()
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message: dict[str, Any] = {"role": "assistant", "content": "not json", "tool_calls": [call]}
    obs.observe({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}, streaming=False)
    assert classify_answer(obs, REJECT_JSON, json_mode=True).label.startswith("rejected:parse-json")
    bare = Observation()
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    bare.observe({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}, streaming=False)
    assert classify_answer(bare, REJECT_JSON, json_mode=True).tag == "ok"


def test_text_that_is_not_json_passes_where_the_policy_lets_it() -> None:
    obs = Observation(finish_reasons={0: "stop"})
    obs.add_text(0, "not json", content=True)
    assert classify_answer(obs, PolicyConfig(), json_mode=True).tag == "ok"
    assert classify_answer(obs, REJECT_JSON, json_mode=True).tag == "rejected"


def test_json_nested_past_what_a_parser_takes_is_rejected_as_such() -> None:
    obs = Observation(finish_reasons={0: "stop"})
    obs.add_text(0, "[" * 100_000 + "]" * 100_000, content=True)
    outcome = classify_answer(obs, REJECT_JSON, json_mode=True)
    assert outcome.label == "rejected:parse-json: nested too deeply to parse"


def test_an_answer_asked_to_write_nothing_is_whole_at_its_cap() -> None:
    obs = Observation(finish_reasons={0: "length"})
    reject = PolicyConfig(on_truncate="reject")
    assert classify_answer(obs, reject, json_mode=False, writes_nothing=True).tag == "ok"
    assert classify_answer(obs, reject, json_mode=False).label == "rejected:output-truncated"


def test_a_prewarm_that_wrote_nothing_holds_no_json_to_judge() -> None:
    obs = Observation(finish_reasons={0: "completed"})  # a Responses prewarm: no output
    assert classify_answer(obs, REJECT_JSON, json_mode=True, prewarm=True).tag == "ok"
    assert classify_answer(obs, REJECT_JSON, json_mode=True).label.startswith("rejected:parse-json")
    # An upstream that does not know the option wrote an answer: judged as any (the review).
    wrote = Observation(finish_reasons={0: "completed"}, contents={0: ["not json"]})
    assert classify_answer(wrote, REJECT_JSON, json_mode=True, prewarm=True).label.startswith(
        "rejected:parse-json"
    )


# -- observe_anthropic ----------------------------------------------------------------------------


def test_a_compaction_step_s_cache_reads_and_writes_are_billed_beside_the_answer_s() -> None:
    step = {
        "type": "compaction",
        "input_tokens": 100,
        "output_tokens": 20,
        "cache_read_input_tokens": 300,
        "cache_creation_input_tokens": 50,
        "cache_creation": {"ephemeral_1h_input_tokens": 40},
    }
    answer = {"type": "message", "input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 7}
    usage = anthropic_usage(
        {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_read_input_tokens": 7,
            "cache_creation_input_tokens": 3,
            "cache_creation": {"ephemeral_1h_input_tokens": 2},
            "iterations": [step, answer],
        }
    )
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (10 + 7 + 3 + 100 + 300 + 50, 25)
    assert (usage.cached_input_tokens, usage.cache_creation_input_tokens) == (307, 53)
    assert usage.cache_creation_1h_input_tokens == 42


THINKING = {"output_tokens_details": {"thinking_tokens": 6}}


def test_anthropic_s_thinking_tokens_are_its_reasoning_within_the_output() -> None:
    """``usage.output_tokens_details.thinking_tokens``, a part of ``output_tokens`` (as OpenAI's
    reasoning_tokens are of completion_tokens), was recorded as 0 reasoning tokens on every
    Claude call (the Anthropic SDK hunt); never more than the output it is a part of."""
    usage = anthropic_usage({"input_tokens": 5, "output_tokens": 8, **THINKING})
    assert usage is not None and (usage.output_tokens, usage.reasoning_tokens) == (8, 6)
    over = anthropic_usage({"input_tokens": 5, "output_tokens": 4, **THINKING})
    assert over is not None and (over.output_tokens, over.reasoning_tokens) == (4, 4)
    none = anthropic_usage({"input_tokens": 5, "output_tokens": 8, "output_tokens_details": None})
    assert none is not None and none.reasoning_tokens == 0
    # Not a count: the usage is unusable, as a cache count that is not one makes it.
    assert (
        anthropic_usage(
            {"input_tokens": 5, "output_tokens": 8, "output_tokens_details": {"thinking_tokens": -1}}
        )
        is None
    )


def test_anthropic_s_thinking_tokens_are_read_from_a_stream_s_and_a_body_s_usage() -> None:
    body = Observation()
    anthropic_body(body, {"type": "message", "content": [], "stop_reason": "end_turn",
                          "usage": {"input_tokens": 5, "output_tokens": 8, **THINKING}})  # fmt: skip
    stream = events(
        start({"input_tokens": 5, "output_tokens": 1}),
        text("hi"),
        delta({"output_tokens": 8, **THINKING}, "end_turn"),
        {"type": "message_stop"},
    )
    for obs in (body, stream):
        billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
        assert (billed.output_tokens, billed.reasoning_tokens, billed.source) == (8, 6, "provider")


def test_an_advisor_s_consultation_told_only_in_the_iterations_is_counted() -> None:
    """The advisor tool is refused up front (another model, at its prices); an answer that tells
    one all the same has its tokens counted, as compaction's are: they are outside the top-level
    counts, and went unbilled."""
    it = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    raw = {
        "input_tokens": 30, "output_tokens": 20,
        "iterations": [
            {"type": "message", "input_tokens": 10, "output_tokens": 5, **it},
            {"type": "advisor_message", "model": "claude-opus-4-6", "input_tokens": 1000,
             "output_tokens": 1500, **it, "cache_read_input_tokens": 200},
            {"type": "message", "input_tokens": 20, "output_tokens": 15, **it},
        ],
    }  # fmt: skip
    usage = anthropic_usage(raw)
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens) == (1230, 1520, 200)


@pytest.mark.parametrize(
    "iterations",
    [
        {"type": "compaction", "input_tokens": 100, "output_tokens": 20},  # not a list
        [{"type": "compaction", "input_tokens": 100}],  # the step's output not told
        [{"type": "compaction", "input_tokens": 100, "output_tokens": -1}],  # not a count
    ],
)
def test_a_compaction_step_that_cannot_be_read_makes_the_usage_unusable(iterations: Any) -> None:
    """Counted, then, never billed without the step's tokens."""
    raw = {"input_tokens": 10, "output_tokens": 5, "iterations": iterations}
    assert anthropic_usage(raw) is None


def test_an_output_count_that_is_not_one_makes_the_usage_unusable() -> None:
    assert anthropic_usage({"input_tokens": 10, "output_tokens": "five"}) is None
    assert anthropic_usage({"input_tokens": 10, "output_tokens": -1}) is None


def delta(usage: dict[str, Any] | None, stop_reason: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": stop_reason}}
    if usage is not None:
        obj["usage"] = usage
    return obj


def test_an_output_count_told_before_the_stop_reason_is_not_final_when_the_stream_is_cut() -> None:
    """A turn with server tools tells its output so far in an early message_delta: cut then, the
    provider may have written up to the cap."""
    obs = events(start({"input_tokens": 12, "output_tokens": 1}), text("hi"), delta({"output_tokens": 5}))
    billed = billed_usage(claude(), obs, TOKENIZER, complete=False)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (12, 100, "reserve")


def test_an_output_count_told_before_the_stop_reason_is_final_once_the_message_stops() -> None:
    """The stop reason's own message_delta tells no output count: the one told earlier is the
    final one once message_stop comes, not a count of the text."""
    obs = events(
        start({"input_tokens": 12, "output_tokens": 1}),
        text("x" * 400),  # 100 tokens by the count
        delta({"output_tokens": 50}),
        delta({"input_tokens": 12}, "end_turn"),
        {"type": "message_stop"},
    )
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (12, 50, "provider")


def test_message_delta_s_zero_input_is_a_placeholder_below_a_count_held() -> None:
    obs = events(
        start({"input_tokens": 12, "cache_read_input_tokens": 30, "output_tokens": 1}),
        text("hi"),
        delta({"input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 5}, "end_turn"),
        {"type": "message_stop"},
    )
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.cached_input_tokens, billed.output_tokens) == (42, 30, 5)
    assert billed.source == "provider"


def test_message_delta_s_zero_input_where_none_was_held_is_the_count() -> None:
    """message_start told no input count: the 0 message_delta tells is the count, not a gap."""
    obs = events(
        start({"output_tokens": 1}),
        text("hi"),
        delta({"input_tokens": 0, "output_tokens": 5}, "end_turn"),
        {"type": "message_stop"},
    )
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (0, 5, "provider")


def test_message_delta_s_zero_hour_writes_are_a_placeholder_below_those_held() -> None:
    split = {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 40}
    obs = events(
        start(
            {
                "input_tokens": 12,
                "cache_creation_input_tokens": 50,
                "cache_creation": split,
                "output_tokens": 1,
            }
        ),
        delta(
            {
                "output_tokens": 5,
                "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            },
            "end_turn",
        ),
        {"type": "message_stop"},
    )
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.cache_creation_input_tokens, billed.cache_creation_1h_input_tokens) == (50, 40)


def test_the_largest_search_count_told_stands() -> None:
    obs = events(
        start({"input_tokens": 12, "output_tokens": 1, "server_tool_use": {"web_search_requests": 2}}),
        delta({"output_tokens": 5, "server_tool_use": {"web_search_requests": 1}}, "end_turn"),
        {"type": "message_stop"},
    )
    assert billed_usage(claude(), obs, TOKENIZER, complete=True).tool_calls == (("web_search", 2),)


def test_only_counts_named_as_requests_are_calls_of_a_tool() -> None:
    server = {"web_search_requests": 1, "execution_time_seconds": 7}
    obs = Observation()
    body = {
        "type": "message",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 12, "output_tokens": 5, "server_tool_use": server},
    }
    anthropic_body(obs, body)
    assert obs.tool_calls == {"web_search": 1}


def test_a_streamed_call_s_name_is_output_counted_without_usage() -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "n" * 40, "input": {}}
    obs = events(
        {"type": "content_block_start", "index": 0, "content_block": block},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{}"},
        },
        delta(None, "tool_use"),
        {"type": "message_stop"},
    )
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.output_tokens, billed.source) == (11, "chars")  # 42 characters


@pytest.mark.parametrize(
    ("block", "tokens"),
    [
        ({"type": "tool_use", "id": "toolu_1", "name": "look", "input": {"q": "q" * 32}}, 1 + 10),
        ({"type": "thinking", "thinking": "t" * 40, "signature": "sig"}, 10),
        ({"type": "compaction", "content": "c" * 40}, 10),
    ],
)
def test_a_whole_answer_s_output_no_text_shows_is_counted_without_usage(
    block: dict[str, Any], tokens: int
) -> None:
    """A call's input, thinking, a compaction's summary: output the provider bills."""
    obs = Observation()
    body = {
        "type": "message",
        "content": [{"type": "text", "text": "a" * 40}, block],
        "stop_reason": "end_turn",
    }
    anthropic_body(obs, body)
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.output_tokens, billed.source) == (10 + tokens, "chars")


def test_a_gateway_s_openai_shaped_error_body_is_an_error() -> None:
    obs = Observation()
    anthropic_body(obs, {"error": {"message": "overloaded", "type": "server_error"}})
    assert obs.error


def test_streamed_text_is_the_answer_held_to_json() -> None:
    obs = events(
        start({"input_tokens": 12, "output_tokens": 1}),
        text('{"a": 1}'),
        delta({"output_tokens": 5}, "end_turn"),
    )
    assert classify_answer(obs, REJECT_JSON, json_mode=True).tag == "ok"


def test_streamed_thinking_is_output_counted_without_a_final_count() -> None:
    thinking = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "thinking_delta", "thinking": "t" * 40},
    }
    obs = events(
        start({"input_tokens": 12, "output_tokens": 1}), thinking, text("a" * 40), {"type": "message_stop"}
    )
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (12, 20, "chars")


def test_searches_message_start_told_are_billed_when_the_stream_is_cut() -> None:
    usage = {"input_tokens": 12, "output_tokens": 1, "server_tool_use": {"web_search_requests": 2}}
    obs = events(start(usage), text("hi"))
    assert billed_usage(claude(), obs, TOKENIZER, complete=False).tool_calls == (("web_search", 2),)


def test_a_streamed_compaction_summary_is_output_counted_without_a_final_count() -> None:
    """The summary streams as compaction_delta, or comes whole as its block starts."""
    streamed = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "compaction_delta", "content": "c" * 40},
    }
    whole = {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "compaction", "content": "d" * 40},
    }
    obs = events(
        start({"input_tokens": 12, "output_tokens": 1}),
        streamed,
        whole,
        text("a" * 40),
        {"type": "message_stop"},
    )
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (12, 30, "chars")


def test_a_whole_answer_s_text_is_the_answer_held_to_json() -> None:
    obs = Observation()
    body = {"type": "message", "content": [{"type": "text", "text": '{"a": 1}'}], "stop_reason": "end_turn"}
    anthropic_body(obs, body)
    assert classify_answer(obs, REJECT_JSON, json_mode=True).tag == "ok"


# -- observe_responses ----------------------------------------------------------------------------

RESPONSES_USAGE = {"input_tokens": 12, "output_tokens": 5, "total_tokens": 17}


def response(output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": "completed", "output": output, **fields}


def message(words: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": words, "annotations": []}
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [part]}


def test_a_response_cut_at_its_output_cap_is_truncated() -> None:
    obs = Observation()
    incomplete = {"reason": "max_output_tokens"}
    responses_body(obs, response([message("cut")], status="incomplete", incomplete_details=incomplete))
    assert obs.finish_reasons == {0: "max_output_tokens"}
    assert classify_answer(obs, PolicyConfig(), json_mode=False).tag == "truncated"


def test_the_tier_a_response_was_served_at_is_read() -> None:
    obs = Observation()
    responses_body(obs, response([message("hi")], service_tier="flex", usage=RESPONSES_USAGE))
    assert obs.service_tier == "flex"


def test_the_image_tool_s_tokens_are_billed_beside_the_model_s() -> None:
    obs = Observation()
    image = {"image_gen": {"input_tokens": 30, "output_tokens": 1000}}
    responses_body(obs, response([message("hi")], usage=RESPONSES_USAGE, tool_usage=image))
    assert obs.usage is not None
    assert (obs.usage.input_tokens, obs.usage.output_tokens) == (42, 1005)


def responses(*objs: dict[str, Any]) -> Observation:
    obs = Observation()
    for obj in objs:
        responses_event(obs, obj)
    return obs


def item_added(item: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return {"type": "response.output_item.added", "output_index": index, "item": item}


def item_done(item: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return {"type": "response.output_item.done", "output_index": index, "item": item}


def test_each_hosted_tool_call_of_a_response_is_counted() -> None:
    search = {"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "q"}}
    obs = Observation()
    responses_body(obs, response([{**search, "id": "ws_1"}, {**search, "id": "ws_2"}], usage=RESPONSES_USAGE))
    assert obs.tool_calls == {"web_search": 2}


@pytest.mark.parametrize("kind", ["reasoning", "image_generation_call", "compaction"])
def test_a_whole_response_with_output_no_text_shows_is_billed_at_the_reserve_without_usage(kind: str) -> None:
    obs = Observation()
    responses_body(obs, response([{"type": kind, "id": "it_1"}, message("hi")]))
    assert obs.hidden_output
    call = planned({"model": "gpt-4o-mini", "input": "hello", "max_output_tokens": 100}, "responses")
    billed = billed_usage(call, obs, TOKENIZER, complete=True)
    assert (billed.output_tokens, billed.source) == (100, "reserve")


@pytest.mark.parametrize("kind", ["reasoning", "image_generation_call", "compaction"])
def test_a_streamed_item_no_text_shows_is_hidden_output(kind: str) -> None:
    assert responses(item_added({"type": kind, "id": "it_1"})).hidden_output


def test_a_streamed_reasoning_summary_is_hidden_output() -> None:
    obs = responses({"type": "response.reasoning_summary_text.delta", "output_index": 0, "delta": "thinking"})
    assert obs.hidden_output


def test_a_whole_response_s_texts_beside_its_answer_are_output() -> None:
    """A reasoning summary and its text, a refusal: counted when no usage comes."""
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "s" * 40}],
        "content": [{"type": "reasoning_text", "text": "r" * 40}],
    }
    refusal = {"type": "message", "id": "msg_2", "content": [{"type": "refusal", "refusal": "n" * 40}]}
    obs = Observation()
    responses_body(obs, response([reasoning, refusal, message("a" * 40)]))
    assert obs.refused
    assert obs.answers() == ["a" * 40 + "s" * 40 + "r" * 40 + "n" * 40]


def test_commentary_is_not_the_answer_held_to_json() -> None:
    commentary = {**message("Let me check."), "id": "msg_0", "phase": "commentary"}
    answer = {**message('{"a": 1}'), "phase": "final_answer"}
    obs = Observation()
    responses_body(obs, response([commentary, answer]))
    assert obs.content_of(0) == '{"a": 1}'
    assert classify_answer(obs, REJECT_JSON, json_mode=True).tag == "ok"


def test_streamed_commentary_is_not_the_answer_held_to_json() -> None:
    commentary = {"type": "message", "id": "msg_0", "role": "assistant", "content": []}
    answer = {"type": "message", "id": "msg_1", "role": "assistant", "content": [], "phase": "final_answer"}
    obs = responses(
        item_added(commentary, 0),
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "item_id": "msg_0",
            "delta": "Let me check.",
        },
        item_done({**commentary, "phase": "commentary"}, 0),
        item_added(answer, 1),
        {"type": "response.output_text.delta", "output_index": 1, "item_id": "msg_1", "delta": '{"a": 1}'},
    )
    assert obs.content_of(0) == '{"a": 1}'
    assert obs.answers() == ['{"a": 1}Let me check.']
    side = responses(
        item_added({**commentary, "phase": "commentary"}, 0),
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "item_id": "msg_0",
            "delta": "Let me check.",
        },
    )
    assert side.content_of(0) == ""


@pytest.mark.parametrize(
    ("item", "written"),
    [
        ({"type": "web_search_call", "action": {"type": "search", "query": "q" * 8}}, ["web_search"]),
        ({"type": "computer_call", "action": {"type": "click", "x": 1, "y": 2}}, ["computer"]),
    ],
)
def test_a_streamed_call_told_whole_in_its_item_is_output(item: dict[str, Any], written: list[str]) -> None:
    obs = responses(item_added({**item, "id": "c_1"}), item_done({**item, "id": "c_1"}))
    assert orjson.dumps(item["action"]).decode() in obs.all_text()
    assert sorted(obs.tool_uses or {}) == written


def test_a_code_interpreter_s_code_is_output() -> None:
    call = {"type": "code_interpreter_call", "id": "ci_1", "code": "print(1)", "container_id": "cntr_1"}
    obs = Observation()
    responses_body(obs, response([call]))
    assert "print(1)" in obs.all_text()
    assert obs.container_ids == ["cntr_1"]


def test_a_call_s_structures_are_counted_once() -> None:
    """A computer call's batch holds its lone action too; a search's query repeats its queries."""
    computer = {
        "type": "computer_call",
        "id": "cu_1",
        "action": {"type": "click"},
        "actions": [{"type": "click"}],
    }
    search = {
        "type": "web_search_call",
        "id": "ws_1",
        "action": {"type": "search", "query": "a", "queries": ["a"]},
    }
    patch = {"type": "apply_patch_call", "id": "ap_1", "operation": {"path": "p", "diff": "d"}}
    files = {"type": "file_search_call", "id": "fs_1", "queries": ["b"]}
    obs = Observation()
    responses_body(obs, response([computer, search, patch, files]))
    assert obs.answers() == [
        '[{"type":"click"}]{"type":"search","queries":["a"]}{"path":"p","diff":"d"}["b"]'
    ]


def test_streamed_audio_is_not_counted_as_text() -> None:
    obs = responses({"type": "response.audio.delta", "delta": "QUJD" * 100})
    assert obs.all_text() == ""


def test_a_failed_or_queued_response_is_not_an_answer() -> None:
    failed = responses({"type": "response.failed", "response": {"id": "resp_1", "error": {"code": "x"}}})
    assert failed.error and failed.done
    queued = Observation()
    responses_body(queued, {"id": "resp_1", "status": "queued", "output": []})
    assert (queued.error, queued.pending) == (True, True)
    fine = Observation()
    responses_body(fine, response([message("hi")], error=None, usage=RESPONSES_USAGE))
    assert (fine.error, fine.pending, fine.finish_reasons) == (False, False, {0: "completed"})


def test_streamed_call_arguments_make_the_answer_a_call() -> None:
    obs = responses({"type": "response.function_call_arguments.delta", "output_index": 0, "delta": "{}"})
    assert obs.calls == {0}


# A gateway's message_start: its counts come with message_delta.
PLACEHOLDER = {"input_tokens": 0, "output_tokens": 0}


def test_a_cut_stream_after_a_placeholder_input_of_0_is_billed_at_its_reserve() -> None:
    """Cut before message_delta: an input of 0 before the final report is no count (no call has
    no input), so the whole call is billed at its reserve, as when the output is unseen; it was
    billed 0 input tokens and the reserved output (the usage fallback hunt)."""
    call = claude()
    assert call.reserved_input_tokens > 0
    billed = billed_usage(call, events(start(PLACEHOLDER), text("hello there")), TOKENIZER, complete=False)
    assert (billed.input_tokens, billed.output_tokens, billed.source) == (
        call.reserved_input_tokens,
        call.reserved_output_tokens,
        "reserve",
    )


def test_a_cancelled_stream_after_a_placeholder_input_of_0_has_its_input_counted() -> None:
    """Cut by the proxy (cancel) after the placeholder: counted as a stream that told no usage
    at all, its prompt included; it was billed 0 input tokens."""
    call = claude()
    untold = {
        "type": "message_start",
        "message": {"id": "m", "type": "message", "role": "assistant", "content": []},
    }
    counted = billed_usage(call, events(untold, text("hello there")), TOKENIZER, complete=True)
    assert counted.input_tokens > 0
    billed = billed_usage(call, events(start(PLACEHOLDER), text("hello there")), TOKENIZER, complete=True)
    assert (billed.input_tokens, billed.output_tokens) == (counted.input_tokens, counted.output_tokens)


def test_an_output_count_without_an_input_count_is_the_providers_output() -> None:
    """A report that tells the output and no input is unusable as usage, but its output is the
    provider's figure: a count of the 6 characters streamed (2 tokens) billed less than the 50 it
    said (the usage fallback hunt). The input is counted."""
    call = chat(max_tokens=100)
    obs = Observation()
    for chunk in (
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "answer"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"completion_tokens": 50}},
    ):
        obs.observe(chunk, streaming=True)
    billed = billed_usage(call, obs, TOKENIZER, complete=True)
    assert billed.output_tokens == 50 and billed.input_tokens > 0, billed
    body = Observation()
    body.observe(
        {
            "choices": [{"index": 0, "message": {"content": "answer"}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 7},
        },
        streaming=False,
    )
    assert billed_usage(call, body, TOKENIZER, complete=True).output_tokens == 7


def test_an_anthropic_output_count_without_an_input_count_is_the_providers_output() -> None:
    """message_start told no usage (a gateway's), message_delta the final output (50, with the
    stop reason): billed 50, not the 1 token "hi" counts to."""
    untold = {
        "type": "message_start",
        "message": {"id": "m", "type": "message", "role": "assistant", "content": []},
    }
    obs = events(untold, text("hi"), delta({"output_tokens": 50}, "end_turn"), {"type": "message_stop"})
    billed = billed_usage(claude(), obs, TOKENIZER, complete=True)
    assert billed.output_tokens == 50 and billed.input_tokens > 0, billed
    body = Observation()
    message = {
        "id": "m",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "stop_reason": "end_turn",
    }
    anthropic_body(
        body, {**message, "content": [{"type": "text", "text": "hi"}], "usage": {"output_tokens": 9}}
    )
    assert billed_usage(claude(), body, TOKENIZER, complete=True).output_tokens == 9
