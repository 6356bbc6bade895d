"""Tests that kill mutants of the answer-reading code which the rest of the suite let live: each
pins what the client receives, what is billed, the outcome's inputs or what is recorded."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.billed_usage import billed_usage
from proxy.dialects import DIALECTS
from proxy.events import EventFilter
from proxy.observe import Observation, parse_usage
from proxy.observe_anthropic import anthropic_usage
from tests.test_billed_usage import TOKENIZER, chat, planned
from tests.test_dialects import _observed_item
from tests.test_events import DONE, ROLE, USAGE, content, finish
from tests.test_events import relay as relay_chat
from tests.test_events_reads import MESSAGES
from tests.test_events_reads import relay as relay_dialect
from tests.test_stream_dialects import COMPACTED


def typed_filter(endpoint: str) -> tuple[Observation, EventFilter]:
    obs = Observation()
    return obs, EventFilter(obs, dialect=DIALECTS[endpoint], choices=1, client_wants_usage=False)  # type: ignore[index]


# -- events.py / chunks.py: the client's bytes and the stream's reading ------------------------


def test_a_crlf_line_break_cut_between_its_cr_and_lf_inside_an_event_keeps_the_event_whole() -> None:
    """A read ending in the \\r of a \\r\\n between an event's lines (``event:`` then ``data:``):
    the \\n starting the next read is the same line break. Read as another one, the event was
    split in two for the client (its ``event:`` name alone, its data an unnamed event, which
    Anthropic's SDK skips)."""
    stream = MESSAGES.replace(b"\n", b"\r\n")
    cuts = [at + 1 for at in range(len(stream)) if stream[at] == ord("\r")]
    whole = relay_dialect("messages", stream, [])
    assert whole[0] == MESSAGES
    assert relay_dialect("messages", stream, cuts) == whole


def test_a_field_after_the_data_line_inside_a_run_stays_with_its_event() -> None:
    """A template event followed by a field line (``id:``) in a run, for a client that did not
    ask for usage: the run ends before it and the per-event path keeps its field, byte for byte
    what one event at a time gives. Taken as a template event, its ``"usage":null`` was cut, its
    field line mangled and split off into an event of its own."""
    odd = content("b")[:-2] + b"\nid: 7\n\n"
    stream = ROLE + content("a") + odd + content("c") + finish() + USAGE + DONE
    fast = relay_chat(stream, [], runs=True, wants_usage=False)
    reference = relay_chat(stream, [], runs=False, wants_usage=False)
    assert fast[:2] == reference[:2]
    assert b"\nid: 7\ndata: " in fast[0] and b'"usage"' not in fast[0]


def test_data_lines_without_a_space_after_the_colon_are_read() -> None:
    """SSE allows ``data:{...}`` (the space is optional): the chunks are the answer, not
    malformed ones."""
    stream = (ROLE + content("a") + content("b") + finish() + USAGE + DONE).replace(b"data: ", b"data:")
    out, seen, _ = relay_chat(stream, [], runs=True, wants_usage=True)
    text, malformed, done = seen[0], seen[5], seen[7]
    assert (text, malformed, done) == ("ab", False, True)
    assert seen[2] is not None and seen[2].output_tokens == 5
    assert out == stream[: -len(b"data:[DONE]\n\n")]


def test_an_event_exactly_as_long_as_the_limit_is_not_too_long() -> None:
    """The limit bounds an event's size: one of exactly that many bytes is relayed, one more is
    refused (an upstream_error)."""
    event = content("hi", usage_null=False)
    size = len(event) - 2  # its blank line is no part of it
    for reads in ([event], [event[:10], event[10:]]):
        events = EventFilter(
            Observation(), dialect=DIALECTS["chat.completions"], choices=1, client_wants_usage=True
        )
        assert b"".join(events.read(piece, limit=size) or b"" for piece in reads) == event
        events = EventFilter(
            Observation(), dialect=DIALECTS["chat.completions"], choices=1, client_wants_usage=True
        )
        assert None in [events.read(piece, limit=size - 1) for piece in reads]


@pytest.mark.parametrize(
    ("endpoint", "event"),
    [
        ("responses", b"event: response.output_text.delta\ndata: [1, 2]"),
        ("messages", b"event: content_block_delta\ndata: 5"),
        # Shaped so oddly that observing it fails: its output is not a list.
        (
            "responses",
            b'event: response.completed\ndata: {"type":"response.completed","response":{"output":5}}',
        ),
    ],
    ids=["responses-array", "messages-number", "responses-odd-output"],
)
def test_a_typed_event_that_cannot_be_read_is_a_malformed_answer(endpoint: str, event: bytes) -> None:
    """Responses and Anthropic events that are not objects, or whose observing fails, make the
    answer malformed (upstream_error), passed on as they came."""
    obs, events = typed_filter(endpoint)
    assert events.read(event + b"\n\n", limit=1 << 20) == event + b"\n\n"
    assert obs.malformed


# -- observe.py: OpenAI-format usage and choices -----------------------------------------------


def test_a_portkey_prompt_larger_than_its_cache_reads_is_billed_with_them() -> None:
    """Portkey: prompt_tokens is Anthropic's uncached input, total_tokens counts the cache reads
    on top (exactly). With more uncached input than reads, the reads were left out."""
    usage = parse_usage(
        {
            "prompt_tokens": 3000,
            "completion_tokens": 50,
            "total_tokens": 5050,
            "prompt_tokens_details": {"cached_tokens": 2000},
            "cache_read_input_tokens": 2000,
        }
    )
    assert usage is not None and (usage.input_tokens, usage.cached_input_tokens) == (5000, 2000)


def test_a_litellm_prompt_read_whole_from_the_cache_is_not_billed_twice() -> None:
    """LiteLLM: prompt_tokens holds its reads (told as cached_tokens too). A prompt read whole from
    the cache (reads equal to prompt_tokens) is those tokens, not twice as many."""
    usage = parse_usage(
        {
            "prompt_tokens": 2000,
            "completion_tokens": 50,
            "total_tokens": 2050,
            "prompt_tokens_details": {"cached_tokens": 2000},
            "cache_read_input_tokens": 2000,
        }
    )
    assert usage is not None and (usage.input_tokens, usage.cached_input_tokens) == (2000, 2000)


def test_the_writes_kept_an_hour_are_never_more_than_the_writes() -> None:
    """The hour's share of the cache writes, told larger than the writes: recorded (a ledger
    field) as at most the writes, in both usage formats."""
    openai_format = parse_usage(
        {
            "prompt_tokens": 100,
            "completion_tokens": 5,
            "prompt_tokens_details": {
                "cache_write_tokens": 30,
                "cache_creation_token_details": {"ephemeral_1h_input_tokens": 40},
            },
        }
    )
    anthropic_format = anthropic_usage(
        {
            "input_tokens": 70,
            "output_tokens": 5,
            "cache_creation_input_tokens": 30,
            "cache_creation": {"ephemeral_1h_input_tokens": 40},
        }
    )
    for usage in (openai_format, anthropic_format):
        assert usage is not None
        assert (usage.cache_creation_input_tokens, usage.cache_creation_1h_input_tokens) == (30, 30)


def test_reasoning_beside_a_smaller_completion_count_is_billed_on_top_of_it() -> None:
    """A top-level reasoning_tokens larger than completion_tokens cannot be a part of it (no
    citations beside): billed on top."""
    usage = parse_usage(
        {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15, "reasoning_tokens": 50}
    )
    assert usage is not None and (usage.output_tokens, usage.reasoning_tokens) == (60, 50)


@pytest.mark.parametrize("count", ["7", -1, True, 1.5], ids=repr)
def test_an_output_count_that_is_not_one_makes_the_usage_unusable(count: Any) -> None:
    """Never read as 0 output tokens: the answer's text is counted instead."""
    assert parse_usage({"prompt_tokens": 5, "completion_tokens": count}) is None
    assert parse_usage({"input_tokens": 5, "output_tokens": count}) is None


@pytest.mark.parametrize("streaming", [True, False])
def test_a_choice_ending_in_error_without_an_error_object_is_the_providers_failure(streaming: bool) -> None:
    """finish_reason "error" alone (no error object on the choice nor at the top) is a failed
    answer all the same (upstream_error), not a whole one."""
    obs = Observation()
    part = {"delta" if streaming else "message": {"content": "Hel"}}
    obs.observe({"choices": [{"index": 0, "finish_reason": "error", **part}]}, streaming=streaming)
    assert obs.error


# -- observe_responses.py ----------------------------------------------------------------------


def test_a_failed_response_is_an_error_however_it_says_so() -> None:
    """A body whose status is failed (its error object null), a response.failed event whose
    response tells no status: both a failed answer."""
    body = Observation()
    DIALECTS["responses"].observe_body(body, {"id": "r", "status": "failed", "error": None, "output": []})
    assert body.error
    event = Observation()
    DIALECTS["responses"].observe_event(event, {"type": "response.failed", "response": {"id": "r"}})
    assert event.error and event.done


def test_a_streamed_refusal_is_a_refusal_when_the_end_does_not_repeat_it() -> None:
    obs = Observation()
    for obj in (
        {"type": "response.refusal.delta", "output_index": 0, "delta": "I can't help with that."},
        {"type": "response.completed", "response": {"id": "r", "status": "completed", "output": []}},
    ):
        DIALECTS["responses"].observe_event(obs, obj)
    assert obs.refused and obs.done


def test_streamed_audio_is_not_counted_as_text() -> None:
    """Base64 audio deltas are not the answer's words: counted as text they billed (without
    usage) a token per few characters of the encoding."""
    obs = Observation()
    DIALECTS["responses"].observe_event(
        obs, {"type": "response.audio.delta", "delta": "UklGRiQAAABXQVZF" * 8}
    )
    assert obs.all_text() == ""


@pytest.mark.parametrize("stream", [True, False])
def test_a_computer_call_s_lone_action_told_beside_its_batch_is_counted_once(stream: bool) -> None:
    action = {"type": "type", "text": "Paris weather"}
    item = {"type": "computer_call", "id": "cu", "call_id": "c", "status": "completed",
            "action": action, "actions": [action], "pending_safety_checks": []}  # fmt: skip
    obs = _observed_item(item, stream=stream)
    assert obs.all_text().count("Paris weather") == 1, obs.all_text()


# -- observe_anthropic.py ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_anthropic_s_standard_tier_is_recorded_as_the_default(stream: bool) -> None:
    """Anthropic's "standard" is the default tier: no service_tier of its own in the ledger.
    It tells the capacity, not the speed or the geography: alone, it leaves the tier the call
    asked for (fast mode, say) standing (None); beside a speed and a geography that are neither
    fast nor the US, it is the default."""
    for told, tier in (({}, None), ({"speed": "standard", "inference_geo": "global"}, "default")):
        obs = Observation()
        usage = {"input_tokens": 10, "output_tokens": 2, "service_tier": "standard", **told}
        if stream:
            message = {"id": "m", "type": "message", "role": "assistant", "content": [], "usage": usage}
            DIALECTS["messages"].observe_event(obs, {"type": "message_start", "message": message})
        else:
            body = {"type": "message", "stop_reason": "end_turn", "content": [], "usage": usage}
            DIALECTS["messages"].observe_body(obs, body)
        assert obs.service_tier == tier


def test_a_compaction_turn_s_top_level_counts_replace_message_start_s_zero_included() -> None:
    """Beside compaction's iterations the top-level counts are the last iteration's: a 0 there
    is a real 0, not a placeholder for message_start's count (which was the compaction's)."""
    obs = Observation()
    start = {"input_tokens": 180000, "cache_creation_input_tokens": 4000, "output_tokens": 1}
    message = {"id": "m", "type": "message", "role": "assistant", "content": [], "usage": start}
    for obj in (
        {"type": "message_start", "message": message},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": COMPACTED},
        {"type": "message_stop"},
    ):
        DIALECTS["messages"].observe_event(obs, obj)
    assert obs.usage is not None
    assert (obs.usage.input_tokens, obs.usage.cache_creation_input_tokens) == (203500, 0)


def test_an_anthropic_body_without_an_output_count_is_billed_on_its_text() -> None:
    """A body whose usage tells no output_tokens: its text is counted, not billed as 0 output."""
    obs = Observation()
    body = {"type": "message", "stop_reason": "end_turn", "usage": {"input_tokens": 12},
            "content": [{"type": "text", "text": "Paris is rainy all week, bring a coat."}]}  # fmt: skip
    DIALECTS["messages"].observe_body(obs, body)
    usage = billed_usage(planned(chat(max_tokens=50)), obs, TOKENIZER, complete=True)
    assert usage.input_tokens == 12 and usage.output_tokens > 0, usage
