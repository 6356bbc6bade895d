"""Tests that kill mutants of reading a request (``payload``), its prompt parts for the estimate
(``prompt_parts``), the dialects' tables (``dialects``) and Responses contexts (``contexts``):
each pins a figure (prompts, answers, generations, a cap, a tier, the text or media counted as
prompt) or a field read that a small change of the code would alter."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from proxy.contexts import answer_items, contexts_made, contexts_owned
from proxy.dialects import DIALECTS, dialect_of_path
from proxy.errors import BadRequest
from proxy.observe import Observation
from proxy.payload import (
    Endpoint,
    RequestView,
    compacts,
    generations,
    messages_tier,
    parse_body,
    prompts,
    set_output_cap,
)
from proxy.prompt_parts import items_parts, media_parts, prompt_texts, variable_texts
from proxy.relay import Exchange
from proxy.store import KEPT_FOR_GOOD
from tests.conftest import KEY_A, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.test_observed_answers_figures import planned
from tests.test_prior_context import FIRST_CONTEXT, chained_proxy, ctx, first

USER = {"role": "user", "content": "hi"}


def view_of(endpoint: Endpoint, body: dict[str, Any]) -> RequestView:
    return parse_body(orjson.dumps(body), endpoint)[1]


def legacy(**fields: Any) -> RequestView:
    return view_of("completions", {"model": "m", **fields})


def claude(**fields: Any) -> RequestView:
    return view_of("messages", {"model": "c", "max_tokens": 5, "messages": [USER], **fields})


# -- payload: how many prompts, answers and generations ----------------------------------------


def test_a_flat_list_of_token_ids_is_one_prompt_and_a_list_of_lists_is_many() -> None:
    """Each prompt is answered n times: ids read as prompts would reserve one answer per token."""
    assert prompts(legacy(prompt=[101, 102, 103, 104])) == 1
    assert generations(legacy(prompt=[101, 102, 103, 104], n=2)) == 2
    assert prompts(legacy(prompt=[[1, 2], [3], [4, 5, 6]])) == 3
    assert prompts(legacy(prompt=["a", "b"])) == 2


def test_generations_are_n_when_best_of_is_below_it() -> None:
    """best_of under n (refused by OpenAI, not by every server): n answers are still written."""
    assert generations(legacy(prompt=["a", "b"], n=3, best_of=2)) == 6
    assert generations(legacy(prompt="a", n=2, best_of=5)) == 5


COMPACT = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50000}}


@pytest.mark.parametrize(
    "edits",
    [
        [COMPACT],
        [{**COMPACT, "type": "compact_20270101"}],  # any version of the edit
        [{"type": "clear_tool_uses_20250919"}, COMPACT],  # beside another edit
    ],
)
def test_any_compact_edit_among_a_messages_calls_edits_reserves_a_second_generation(
    edits: list[dict[str, Any]],
) -> None:
    view = claude(context_management={"edits": edits})
    assert compacts(view)
    assert generations(view) == 2


def test_edits_that_do_not_compact_are_one_generation() -> None:
    view = claude(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]})
    assert not compacts(view)
    assert generations(view) == 1


def test_each_messages_tier_by_fast_mode_and_us_inference() -> None:
    assert messages_tier(fast=False, us=False) is None
    assert messages_tier(fast=False, us=True) == "us"
    assert messages_tier(fast=True, us=False) == "fast"
    assert messages_tier(fast=True, us=True) == "fast-us"


# -- payload: what a body may hold ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "field", "body"),
    [
        ("chat.completions", "max_completion_tokens", {"messages": [USER]}),
        ("responses", "max_output_tokens", {"input": "hi"}),
        ("messages", "max_tokens", {"messages": [USER]}),
        ("completions", "max_tokens", {"prompt": "hi"}),
    ],
)
def test_an_output_cap_of_ten_million_is_read_and_one_more_is_refused(
    endpoint: Endpoint, field: str, body: dict[str, Any]
) -> None:
    # The literal, not the module's constant: a test reading the constant moves with it.
    assert getattr(view_of(endpoint, {"model": "m", **body, field: 10_000_000}), field) == 10_000_000
    with pytest.raises(BadRequest) as refused:
        view_of(endpoint, {"model": "m", **body, field: 10_000_001})
    assert refused.value.param == field


def test_a_body_nested_past_what_orjson_writes_by_objects_alone_is_refused_before_the_reserve() -> None:
    """Nested objects count as nested arrays do: a body orjson cannot write again is a 400 here,
    not a failure once the call is reserved."""
    nested = b'{"a":' * 300 + b'"x"' + b"}" * 300
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"metadata":%s}' % nested
    with pytest.raises(BadRequest) as refused:
        parse_body(raw, "chat.completions")
    assert "nested" in refused.value.message


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"chat_template": ""}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": ""}}, "chat_template_kwargs"),
    ],
)
def test_a_requests_own_chat_template_is_refused_even_empty(sent: dict[str, Any], param: str) -> None:
    """Any template sent (not null) is refused, as vLLM's own check of untrusted templates has it."""
    with pytest.raises(BadRequest) as refused:
        view_of("chat.completions", {"model": "m", "messages": [USER], **sent})
    assert (refused.value.param, refused.value.code) == (param, "unsupported_parameter")
    # Null is no template: the model's own applies.
    view_of("chat.completions", {"model": "m", "messages": [USER], "chat_template": None})


@pytest.mark.parametrize("speed", [5, ["fast"], True])
def test_a_speed_that_is_no_string_is_refused_not_forwarded_unread(speed: Any) -> None:
    """Read as no fast mode, it would be reserved and priced at the default tier."""
    with pytest.raises(BadRequest) as refused:
        claude(speed=speed)
    assert refused.value.param == "speed"


@pytest.mark.parametrize("budget", [2048.0, "2048", True], ids=repr)
def test_a_thinking_budget_that_is_no_integer_is_refused(budget: Any) -> None:
    """Anthropic refuses it (2048.0 too); unread, a clamp of max_tokens could pass below it."""
    with pytest.raises(BadRequest) as refused:
        claude(thinking={"type": "enabled", "budget_tokens": budget})
    assert refused.value.param == "thinking.budget_tokens"


@pytest.mark.parametrize(
    ("management", "compacting"),
    [
        # Anthropic's edits on a Responses call: a field of another API, passed through unread.
        ({"edits": [COMPACT]}, False),
        ([COMPACT], False),
        # OpenAI's own: a compaction entry, its threshold given or not (the server's default).
        ([{"type": "compaction", "compact_threshold": 200000}], True),
        ([{"type": "compaction"}], True),
        ([{"type": "other"}, {"type": "compaction", "compact_threshold": 1000}], True),
        # Any JSON there: no compaction entry read, nothing refused (OpenAI refuses it).
        ([{"type": ["compaction"]}, "compaction", 5], False),
        ("compaction", False),
        (None, False),
    ],
)
def test_a_responses_call_compacts_by_openai_s_own_compaction_entry(
    management: Any, compacting: bool
) -> None:
    """OpenAI's server-side compaction (``context_management: [{"type": "compaction", ...}]``): a
    pass mid-answer reads the context again and writes a summary, within the response's
    ``max_output_tokens`` (no second answer reserved, as Anthropic's compaction has)."""
    view = view_of("responses", {"model": "m", "input": "hi", "context_management": management})
    assert compacts(view) is compacting
    assert generations(view) == 1


# -- payload: the cap forwarded ------------------------------------------------------------------


def test_every_cap_field_above_the_reserve_is_lowered_to_it_and_one_below_is_kept() -> None:
    body: dict[str, Any] = {"max_tokens": 101, "max_completion_tokens": 99, "max_output_tokens": 100}
    set_output_cap(body, "max_completion_tokens", 100)
    assert body == {"max_tokens": 100, "max_completion_tokens": 99, "max_output_tokens": 100}


def test_the_cap_field_is_set_when_absent_or_null_and_another_null_one_stays_null() -> None:
    """Giving a null one a value would send both of chat's caps, which OpenAI refuses."""
    body: dict[str, Any] = {"max_completion_tokens": None}
    set_output_cap(body, "max_tokens", 64)
    assert body == {"max_completion_tokens": None, "max_tokens": 64}
    body = {"max_tokens": None}
    set_output_cap(body, "max_tokens", 64)
    assert body == {"max_tokens": 64}
    for field in ("max_completion_tokens", "max_output_tokens"):
        body = {}
        set_output_cap(body, field, 64)
        assert body == {field: 64}


def test_a_boolean_in_another_cap_field_is_no_cap_below_the_reserve() -> None:
    """``true`` is 1 to Python: kept as a lower cap, an upstream reading it as no cap at all would
    write past the reserve."""
    body: dict[str, Any] = {"max_tokens": 500, "max_output_tokens": True}
    set_output_cap(body, "max_tokens", 100)
    assert body == {"max_tokens": 100, "max_output_tokens": 100}


# -- payload: what a refusal names ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        ("responses", {"input": 5}, "input"),
        ("messages", {"max_tokens": 5, "messages": [USER], "system": 5}, "system"),
    ],
)
def test_a_field_of_two_shapes_is_named_with_both(
    endpoint: Endpoint, body: dict[str, Any], field: str
) -> None:
    """Not pydantic's first union branch ("input.str: Input should be a valid string")."""
    with pytest.raises(BadRequest) as refused:
        view_of(endpoint, {"model": "m", **body})
    assert refused.value.param == field
    assert refused.value.message.endswith(f"{field}: Input should be a string or an array of objects")


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        ("chat.completions", {"messages": [USER], "stream_options": "on"}, "stream_options"),
        ("messages", {"max_tokens": 5, "messages": [USER], "thinking": "on"}, "thinking"),
    ],
)
def test_an_object_field_sent_as_another_type_is_told_it_should_be_an_object(
    endpoint: Endpoint, body: dict[str, Any], field: str
) -> None:
    """Not pydantic's "instance of StreamOptions": the client sent JSON, not the proxy's classes."""
    with pytest.raises(BadRequest) as refused:
        view_of(endpoint, {"model": "m", **body})
    assert refused.value.param == field
    assert refused.value.message == f"Invalid request body: {field}: Input should be an object"


# -- prompt_parts: what is media, what is text ----------------------------------------------------

MEDIA_TYPES = [
    "image_url",
    "input_audio",
    "video_url",
    "audio_url",
    "file",
    "input_image",
    "input_file",
    "image",
    "document",
    "computer_screenshot",
]


@pytest.mark.parametrize("kind", MEDIA_TYPES)
def test_each_media_part_type_is_one_media_part_whose_payload_is_no_text(kind: str) -> None:
    part = {"type": kind, kind: {"data": "QUJD", "format": "wav"}, "file_id": "file-1"}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "look"}]}]
    assert media_parts(messages) == 1
    assert prompt_texts(messages) == ["look"]


def test_media_in_a_tool_results_output_or_a_dict_content_is_counted() -> None:
    """A function call's output of parts, and Anthropic's web fetch result (its content an object
    holding the fetched document)."""
    output = {
        "type": "function_call_output",
        "call_id": "c1",
        "output": [{"type": "input_image", "image_url": "https://e.com/a.png"}],
    }
    fetched = {
        "type": "web_fetch_tool_result",
        "tool_use_id": "s1",
        "content": {
            "type": "web_fetch_result",
            "url": "https://e.com",
            "content": {"type": "document", "source": {"type": "base64", "data": "JVBERi0x"}},
        },
    }
    assert media_parts([output]) == 1
    assert media_parts([{"role": "user", "content": [fetched]}]) == 1


def test_an_object_with_a_role_is_a_message_whatever_type_it_names() -> None:
    message = {"role": "user", "type": "file", "content": "read me"}
    assert media_parts([message]) == 0
    assert prompt_texts([message]) == ["read me"]


def test_only_an_assistant_message_naming_earlier_audio_reads_it_again() -> None:
    """The SDK sends an unset field as null: no audio is read again for ``"audio": null``."""
    again = {"role": "assistant", "audio": {"id": "audio_1"}}
    assert media_parts([again]) == 1
    assert media_parts([{"role": "assistant", "content": "hi", "audio": None}]) == 0
    assert media_parts([{"role": "user", "content": "hi", "audio": {"id": "audio_1"}}]) == 0
    assert media_parts([{"role": "assistant", "content": "hi", "audio": "audio_1"}]) == 0  # no reference


NOT_TEXT = [
    "type",
    "id",
    "call_id",
    "tool_call_id",
    "tool_use_id",
    "status",
    "signature",
    "encrypted_content",
    "result",
    "cache_control",
    "audio",
    "data",
    "url",
    "file_id",
    "file_data",
    "image_url",
    "media_type",
    "mime_type",
    "detail",
    "format",
]


@pytest.mark.parametrize("key", NOT_TEXT)
def test_a_string_under_an_id_enum_or_payload_key_is_no_prompt_text(key: str) -> None:
    assert prompt_texts([{"type": "thing", key: "NOT TEXT", "text": "text"}]) == ["text"]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_a_role_the_chat_format_writes_as_a_token_is_no_text(role: str) -> None:
    assert prompt_texts([{"role": role, "content": "x"}]) == ["x"]


@pytest.mark.parametrize("role", ["ipython", "environment", "critic"])
def test_any_other_role_is_text_the_template_writes(role: str) -> None:
    assert prompt_texts([{"role": role, "content": "x"}]) == [role, "x"]


@pytest.mark.parametrize("key", ["input", "arguments", "input_schema", "parameters", "schema"])
def test_an_object_or_array_the_model_reads_as_json_is_counted_with_its_keys(key: str) -> None:
    value = {"city_name_key": "Paris"}
    assert prompt_texts([{key: value}]) == ['{"city_name_key":"Paris"}']
    assert prompt_texts([{key: [value]}]) == ['[{"city_name_key":"Paris"}]']


def test_prompt_texts_keep_the_order_they_are_sent_in() -> None:
    """Without usage, the bill is a count of the texts joined in this order."""
    messages = [{"role": "user", "content": ["first", "second"]}, {"role": "assistant", "content": "third"}]
    assert prompt_texts(messages) == ["first", "second", "third"]


def test_a_stored_prompts_variables_are_their_values_not_their_names() -> None:
    variables = {"customer_name": "Ada", "notes": {"type": "input_text", "text": "long notes"}}
    assert variable_texts(variables) == ["Ada", "long notes"]
    assert variable_texts(["not", "an object"]) == []


def test_the_system_prompt_is_text_before_the_items_and_an_empty_input_one_empty_part() -> None:
    """Instructions (Responses) and a system prompt (Messages) are billed input; an input of no
    text is still a part of the prompt its break joins (a stored prompt's variables follow it)."""
    assert items_parts([USER], "Be brief.") == ["Be brief.", "hi"]
    assert items_parts([USER], [{"type": "text", "text": "Be brief."}]) == ["Be brief.", "hi"]
    assert items_parts([], "Be brief.") == ["Be brief.", ""]
    assert items_parts("hi") == ["hi"]


# -- dialects: the table, what an embeddings body bills, how errors are written ------------------


def test_each_dialects_path_upstream_and_stream_format() -> None:
    table = {
        endpoint: (d.path, d.upstream_kind, d.injects_usage, d.done_marker, d.anthropic_errors)
        for endpoint, d in DIALECTS.items()
    }
    done = b"data: [DONE]\n\n"
    assert table == {
        "chat.completions": ("/chat/completions", "openai", True, done, False),
        "completions": ("/completions", "openai", True, done, False),
        "embeddings": ("/embeddings", "openai", False, None, False),
        "responses": ("/responses", "openai", False, None, False),
        "messages": ("/messages", "anthropic", False, None, True),
    }


@pytest.mark.parametrize(
    ("usage", "input_tokens"),
    [
        ({"total_tokens": 7}, 7),  # Voyage AI: a total alone is all input
        ({"input_tokens": 5, "total_tokens": 9}, 5),
        ({"prompt_tokens": 4, "total_tokens": 9}, 4),
    ],
)
def test_an_embeddings_answers_input_is_its_prompt_or_input_count_else_its_total(
    usage: dict[str, Any], input_tokens: int
) -> None:
    obs = Observation()
    DIALECTS["embeddings"].observe_body(obs, {"object": "list", "data": [], "usage": usage})
    assert obs.usage is not None
    assert (obs.usage.input_tokens, obs.usage.output_tokens) == (input_tokens, 0)


def test_a_chat_body_is_read_as_a_whole_message_not_as_a_delta() -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"}}]}
    for endpoint in ("chat.completions", "completions"):
        obs = Observation()
        DIALECTS[endpoint].observe_body(obs, body)
        assert obs.all_text() == "whole"


def test_the_call_id_is_sent_where_each_sdk_reads_it() -> None:
    assert DIALECTS["messages"].id_headers("req-1") == {"x-request-id": "req-1", "request-id": "req-1"}
    for endpoint in ("chat.completions", "completions", "embeddings", "responses"):
        assert DIALECTS[endpoint].id_headers("req-1") == {"x-request-id": "req-1"}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
def test_an_anthropic_errors_type_follows_its_status_first(status: int, kind: str) -> None:
    # An error type of its own that would name another: the status wins.
    body = DIALECTS["messages"].error_body("m", "invalid_request_error", status=status)
    assert orjson.loads(body) == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_an_anthropic_errors_status_wins_over_its_code() -> None:
    body = DIALECTS["messages"].error_body("m", "upstream_error", code="upstream_timeout", status=502)
    assert orjson.loads(body)["error"]["type"] == "api_error"


@pytest.mark.parametrize(
    ("error_type", "code", "kind"),
    [
        ("upstream_error", "upstream_timeout", "timeout_error"),  # a stream's error: no status
        ("invalid_request_error", None, "invalid_request_error"),
        ("insufficient_quota", None, "rate_limit_error"),
        ("permission_denied", None, "permission_error"),
        ("upstream_error", None, "api_error"),
        ("service_unavailable", None, "overloaded_error"),
        ("server_error", None, "api_error"),
        ("some_new_type", None, "some_new_type"),
    ],
)
def test_an_anthropic_errors_type_without_a_known_status_follows_its_code_then_its_type(
    error_type: str, code: str | None, kind: str
) -> None:
    body = DIALECTS["messages"].error_body("m", error_type, code=code, status=400)
    assert orjson.loads(body)["error"]["type"] == kind


def test_an_openai_error_names_its_param_and_code_apart() -> None:
    body = DIALECTS["chat.completions"].error_body("m", "invalid_request_error", code="c", param="p")
    assert orjson.loads(body) == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}
    }


def test_a_streams_error_event_in_each_dialects_format() -> None:
    def data(endpoint: Endpoint) -> Any:
        event = DIALECTS[endpoint].error_event("m", "upstream_error", "upstream_timeout")
        assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
        return orjson.loads(event.removeprefix(b"event: error\ndata: "))

    assert data("responses") == {
        "type": "error",
        "code": "upstream_timeout",
        "message": "m",
        "param": None,
        "error": {"type": "upstream_error", "code": "upstream_timeout", "message": "m"},
    }
    assert data("messages") == {"type": "error", "error": {"type": "timeout_error", "message": "m"}}
    assert data("chat.completions") == {
        "error": {"message": "m", "type": "upstream_error", "param": None, "code": "upstream_timeout"}
    }


@pytest.mark.parametrize(
    ("path", "anthropic"),
    [
        ("/v1/messages", True),
        ("/v1/messages/count_tokens", True),
        ("/v1/messages/batches", True),
        ("/v1/messagesx", False),
        ("/v1/chat/completions", False),
        ("/v1/responses", False),
    ],
)
def test_the_dialect_an_error_on_a_path_is_written_in(path: str, anthropic: bool) -> None:
    assert dialect_of_path(path).anthropic_errors is anthropic


# -- contexts: what a call leaves for a later call, and whose it becomes ---------------------------


def exchange(body: dict[str, Any], endpoint: Endpoint = "responses", *, status: int = 200) -> Exchange:
    """An exchange as the relay has it once the upstream answered ``status`` (its observation
    empty: a test fills in what the answer said)."""
    ex = Exchange.__new__(Exchange)
    model = "claude-x" if endpoint == "messages" else "gpt-4o-mini"
    ex.call = planned({"model": model, **body}, endpoint)
    ex.call.upstream_status = status
    ex.obs = Observation()
    return ex


def answered(ex: Exchange, response_id: str = "resp_9", *items: str) -> Exchange:
    ex.obs.response_id = response_id
    ex.obs.item_ids.extend(items)
    return ex


def test_a_responses_call_leaves_its_conversation_and_its_stored_answer() -> None:
    ex = answered(exchange({"input": "hi", "conversation": "conv_1"}))
    assert contexts_made(ex) == ["conv_1", "resp_9"]
    ex = answered(exchange({"input": "hi", "conversation": "conv_1", "store": False}))
    assert contexts_made(ex) == ["conv_1"]


def test_a_call_naming_a_stored_prompt_alone_leaves_the_prompt_at_what_it_billed() -> None:
    """Not one that also continues a response: it billed that too, and the prompt's size, never
    lowered, would be reserved for every fresh call naming it."""
    alone = answered(exchange({"input": "hi", "prompt": {"id": "pmpt_1"}}))
    prompt = alone.call.stored_prompt
    assert prompt is not None and contexts_made(alone) == [prompt, "resp_9"]
    continuing = answered(
        exchange({"input": "hi", "prompt": {"id": "pmpt_1"}, "previous_response_id": "resp_0"})
    )
    assert contexts_made(continuing) == ["resp_9"]


@pytest.mark.parametrize("status", [302, 400, 500])
def test_an_answer_that_is_no_success_leaves_and_owns_nothing(status: int) -> None:
    ex = answered(exchange({"input": "hi", "conversation": "conv_1"}, status=status), "resp_9", "msg_1")
    assert contexts_made(ex) == []
    assert contexts_owned(ex, []) == []


def test_a_queued_answer_that_errored_still_leaves_its_conversation() -> None:
    """``pending``: the provider writes it later and adds it to its conversation."""
    ex = exchange({"input": "hi", "conversation": "conv_1"})
    ex.obs.error = ex.obs.pending = True
    assert contexts_made(ex) == ["conv_1"]
    ex.obs.pending = False
    assert contexts_made(ex) == []


@pytest.mark.parametrize("endpoint", ["chat.completions", "messages"])
def test_only_a_responses_call_leaves_a_context_to_continue(endpoint: Endpoint) -> None:
    body = {"messages": [USER], "max_tokens": 5} if endpoint == "messages" else {"messages": [USER]}
    ex = answered(exchange(body, endpoint), "resp_9", "msg_1")
    assert contexts_made(ex) == []


def test_what_a_call_made_and_named_becomes_its_tenants_but_not_its_stored_prompt() -> None:
    body = {
        "input": [USER, {"type": "item_reference", "id": "msg_0"}],
        "prompt": {"id": "pmpt_1"},
        "previous_response_id": "resp_0",
    }
    ex = answered(exchange(body), "resp_9", "msg_9")
    ex.obs.container_ids.append("cntr_9")
    made = contexts_made(ex)
    assert made == ["resp_9"]
    assert contexts_owned(ex, made) == ["resp_9", "resp_0", "msg_9", "cntr_9", "msg_0"]
    # Those the reserve found this tenant's already are not marked again.
    ex.call.continues_owned = ("resp_0", "msg_0")
    assert contexts_owned(ex, made) == ["resp_9", "msg_9", "cntr_9"]
    # A made list naming the prompt (a call of it alone): the operator's, no tenant's.
    prompt = ex.call.stored_prompt
    assert prompt is not None and prompt not in contexts_owned(ex, [prompt, "resp_9"])


def test_a_container_alone_is_enough_to_mark() -> None:
    ex = exchange({"messages": [USER], "max_tokens": 5}, "messages")
    ex.obs.container_ids.append("cntr_9")
    assert contexts_owned(ex, []) == ["cntr_9"]


def test_the_files_a_tenants_code_wrote_are_its_for_good_not_a_file_it_named() -> None:
    """The Files API keeps a file until it is deleted: its mark is kept for good, in a call on no
    conversation too. A file a call names that no call here wrote was uploaded to the Files API
    by the operator (the proxy serves no upload), for any tenant to name: not marked."""
    content = [{"type": "container_upload", "file_id": "file_operators"}]
    ex = exchange({"messages": [{"role": "user", "content": content}], "max_tokens": 5}, "messages")
    ex.obs.container_ids.append("cntr_9")
    ex.obs.file_ids.append("file_9")
    assert answer_items(ex) == ["cntr_9", "file_9"]
    assert contexts_owned(ex, []) == ["cntr_9", KEPT_FOR_GOOD + "file_9"]
    ex.obs.error = True  # a failed answer's files stay its tenant's
    assert contexts_owned(ex, []) == ["cntr_9", KEPT_FOR_GOOD + "file_9"]
    ex.obs.file_ids.clear()
    ex.obs.container_ids.clear()
    ex.obs.error = False
    assert contexts_owned(ex, []) == []


def test_a_pass_through_callers_contexts_are_no_ones() -> None:
    """Their own key went upstream: what they made is theirs at the provider, not a tenant's here."""
    ex = answered(exchange({"input": "hi"}), "resp_9", "msg_9")
    ex.__dict__["caller_key"] = True  # what ``Exchange.caller_key`` is for a caller's own key
    assert contexts_owned(ex, contexts_made(ex)) == []


def test_a_keyless_upstreams_contexts_are_their_tenants() -> None:
    """No key goes (a server that needs none): every tenant's calls are one account's there, as
    with the operator's key, so what a call makes is its tenant's."""
    ex = answered(exchange({"input": "hi"}), "resp_9", "msg_9")
    ex.call.upstream = ex.call.upstream.model_copy(update={"api_key": None, "api_key_env": None})
    assert contexts_owned(ex, contexts_made(ex)) == ["resp_9", "msg_9"]


def test_a_failed_answer_owns_its_stored_answer_and_items_not_what_it_named() -> None:
    body = {"input": [USER, {"type": "item_reference", "id": "msg_0"}], "previous_response_id": "resp_0"}
    ex = answered(exchange(body), "resp_9", "msg_9")
    ex.obs.error = True
    assert contexts_owned(ex, contexts_made(ex)) == ["resp_9", "msg_9"]
    ex = answered(exchange({**body, "store": False}), "resp_9", "msg_9")
    ex.obs.error = True
    assert contexts_owned(ex, contexts_made(ex)) == []


def test_a_chat_answers_audio_is_kept_whatever_store_says() -> None:
    ex = exchange({"messages": [USER], "store": False}, "chat.completions")
    ex.obs.item_ids.append("audio_9")
    assert answer_items(ex) == ["audio_9"]
    unstored = exchange({"input": "hi", "store": False})
    unstored.obs.item_ids.append("msg_9")
    unstored.obs.container_ids.append("cntr_9")
    assert answer_items(unstored) == ["cntr_9"]


def test_a_chat_answers_audio_becomes_its_tenants() -> None:
    """A later turn sends it back by id: another tenant's call naming it is refused."""
    ex = exchange({"messages": [USER]}, "chat.completions")
    ex.obs.item_ids.append("audio_9")
    assert contexts_owned(ex, contexts_made(ex)) == ["audio_9"]


def test_a_queued_answer_that_errored_owns_what_it_continued() -> None:
    """``pending``: not a failed call; the provider writes its answer later, onto what it named."""
    ex = answered(exchange({"input": "hi", "previous_response_id": "resp_0"}), "resp_9")
    ex.obs.error = ex.obs.pending = True
    assert contexts_owned(ex, contexts_made(ex)) == ["resp_9", "resp_0"]


# -- contexts: what a call writes to the store (a proxy, the fake upstream, a real Redis) ----------


async def test_the_items_of_an_answer_not_stored_are_not_kept_beside_its_conversation(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The provider keeps no item of it: a size kept for one would be reserved for a call naming it."""
    proxy = await chained_proxy(make_proxy)
    fake.contexts["conv_1"] = 0
    await first(proxy, store=False, conversation="conv_1")
    assert int(await redis_client.get(ctx("conv_1")) or 0) == FIRST_CONTEXT
    assert await redis_client.exists(ctx("resp_1"), ctx("msg_1")) == 0


async def test_a_streams_answer_is_its_tenants_once_its_last_event_came(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Marked before ``response.completed`` goes out, not at the settle once the upstream closes:
    an agent continues the answer as soon as it has its id."""
    proxy = await make_proxy()
    body = {"model": "gpt-4o-mini", "input": "hi", "stream": True, "fake": {"tail_delay_s": 1.0}}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/responses", json=body, headers=headers) as reply,
    ):
        assert reply.status == 200, await reply.text()
        completed = False
        async for line in reply.content:
            completed = completed or line.startswith(b"event: response.completed")
            if completed and line == b"\n":
                break  # the event is whole: the SDK yields it
        assert completed
        assert await redis_client.get("lbp:ctxowner:resp_1") == "team-a"


def test_the_images_of_a_document_of_its_own_content_are_media_parts_each() -> None:
    """Anthropic's custom content document (``source.type: "content"``) holds text and image
    blocks, each image billed as one: reserved as one each, beside the document."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}
    source = {"type": "content", "content": [{"type": "text", "text": "slide"}, image, image, image]}
    document = {"type": "document", "source": source, "citations": {"enabled": True}}
    messages = [{"role": "user", "content": [document, {"type": "text", "text": "summarize"}]}]
    assert media_parts(messages) == 4
    assert prompt_texts(messages) == ["slide", "summarize"]
    inside_a_result = {"type": "tool_result", "tool_use_id": "t1", "content": [document]}
    assert media_parts([{"role": "user", "content": [inside_a_result]}]) == 4
    # A document of a base64 or text source is one part, whatever its source holds.
    pdf = {"type": "document", "source": {"type": "base64", "data": "JVBERi0x", "content": [image]}}
    assert media_parts([{"role": "user", "content": [pdf]}]) == 1
