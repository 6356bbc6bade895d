"""What a call's plan reads from a request that the other tests of the plan leave open (the
refusals' param and code, the model's own estimate settings, what a stream asks of each dialect,
the reasoning a request asks for, what it continues and names by id) and the ids a caller sees
(x-request-id echoed or made, a run's id, a reservation's)."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from proxy.auth import Identity
from proxy.call import context_key
from proxy.config_load import parse_config
from proxy.errors import BadRequest, NotFound
from proxy.ids import IdSource
from proxy.payload import Endpoint, parse_body
from proxy.plan import least_cap_accepted, plan_call
from proxy.tokenizer import Tokenizer
from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import CHAT_PATH, ledger_entries
from tests.test_estimate import QuarterEncoding
from tests.test_plan_and_record_figures import (
    MSGS,
    PRIORITY,
    STANDARD,
    TIERED_MODELS,
    claude,
    claude_model,
    config_of,
    planned,
    rates,
)

THINKING = {"thinking": {"type": "enabled", "budget_tokens": 2000}}


# -- the least cap and the plan's refusals ------------------------------------------------------------


def test_interleaved_thinking_is_found_among_several_betas_and_a_bool_budget_is_no_budget() -> None:
    # The SDK joins its betas with commas into one anthropic-beta header.
    several = "token-efficient-tools-2025-02-19,interleaved-thinking-2025-05-14"
    assert least_cap_accepted("messages", THINKING, anthropic_beta=several) == 1
    # A JSON true is an int to Python: no budget of 1 token, nothing for max_tokens to pass.
    flagged = {"thinking": {"type": "enabled", "budget_tokens": True}}
    assert least_cap_accepted("messages", flagged) == 1


def test_a_model_not_served_is_a_404_naming_the_model_field() -> None:
    # The tests' config routes every name ("*"): one without that serves only its own.
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:9")
    raw["models"] = {"gpt-4o-mini": {"upstream": "openai"}}
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY}, key_secrets=False)
    with pytest.raises(NotFound) as refused:
        planned({"model": "gpt-4o", "messages": MSGS}, config=config)
    assert (refused.value.status, refused.value.param, refused.value.code) == (
        404,
        "model",
        "model_not_found",
    )


def test_a_model_of_another_dialects_upstream_is_refused_naming_the_model_field() -> None:
    with pytest.raises(BadRequest) as refused:
        planned(
            {"model": "claude-x", "messages": MSGS}, config=config_of(models={"claude-x": claude_model()})
        )
    assert (refused.value.status, refused.value.param, refused.value.code) == (
        400,
        "model",
        "wrong_endpoint_for_model",
    )


def test_a_cap_too_low_outside_messages_names_no_thinking_field() -> None:
    with pytest.raises(BadRequest) as refused:
        planned(
            {"model": "tiny", "input": "hi"},
            "responses",
            tiny={"upstream": "openai", "max_output_tokens": 15},
        )
    assert (refused.value.param, refused.value.code) == (None, "output_cap_too_low")
    assert "thinking" not in refused.value.message


# -- the model's own estimate settings -----------------------------------------------------------------


def test_a_models_encoding_template_and_media_settings_each_reach_its_estimate() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": ["look", image]}]
    models = {
        "gpt-4o-plain": {"upstream": "openai"},
        "gpt-4o-cl100k": {"upstream": "openai", "encoding": "cl100k_base"},
        "gpt-4o-media": {"upstream": "openai", "media_part_input_tokens": 1000},
        "gpt-4o-call": {"upstream": "openai", "prompt_overhead_tokens": 25},
        "gpt-4o-message": {"upstream": "openai", "message_overhead_tokens": 5},
    }
    config = config_of(models=models)
    calls = {name: planned({"model": name, "messages": messages}, config=config) for name in models}
    assert calls["gpt-4o-plain"].encoding == "o200k_base"
    assert calls["gpt-4o-cl100k"].encoding == "cl100k_base"
    plain = calls["gpt-4o-plain"].reserved_input_tokens
    extra = {name: call.reserved_input_tokens - plain for name, call in calls.items()}
    # One image part; one call; two messages.
    assert (extra["gpt-4o-media"], extra["gpt-4o-call"], extra["gpt-4o-message"]) == (1000, 25, 10)


def test_a_model_without_a_cap_of_its_own_reserves_the_configured_default_output() -> None:
    config = config_of(limits={"default_max_output_tokens": 123})
    call = planned({"model": "gpt-4o", "messages": MSGS}, config=config)
    assert (call.estimate.output_cap, call.reserved_output_tokens) == (123, 123)


def test_long_text_counted_for_one_key_is_remembered_for_its_tenants_other_keys_only() -> None:
    tokenizer = Tokenizer({"o200k_base": QuarterEncoding()})
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "word " * 400}]}

    def plan_as(tenant: str, key_name: str) -> None:
        data, view = parse_body(orjson.dumps(body), "chat.completions")
        plan_call(
            request_id="req-1",
            identity=Identity(tenant=tenant, tier="standard", key_name=key_name),
            run_id="run-1",
            endpoint="chat.completions",
            body=data,
            view=view,
            config=config_of(),
            tokenizer=tokenizer,
            ids=IdSource(),
        )

    # Whether a text was counted before shows in a reserve: never across tenants.
    plan_as("team-a", "a-ci")
    plan_as("team-b", "b-dev")
    assert tokenizer.cache.hits == 0
    plan_as("team-a", "a-laptop")
    assert tokenizer.cache.hits == 1


# -- what a stream, a format and a tool price ask of the plan -------------------------------------------


def test_only_the_chat_dialects_streams_are_sent_stream_options() -> None:
    responses = planned({"model": "gpt-4o-mini", "input": "hi", "stream": True}, "responses")
    assert responses.stream is True and "stream_options" not in responses.body
    messages = planned(claude(stream=True), "messages", config=config_of(models={"claude-x": claude_model()}))
    assert messages.stream is True and "stream_options" not in messages.body
    legacy = planned({"model": "gpt-4o-mini", "prompt": "hi", "stream": True}, "completions")
    assert legacy.body["stream_options"] == {"include_usage": True}


def test_a_responses_call_asking_for_a_json_object_is_in_json_mode() -> None:
    body = {"model": "gpt-4o-mini", "input": "hi", "text": {"format": {"type": "json_object"}}}
    assert planned(body, "responses").json_mode is True


def test_a_priced_tool_without_a_call_limit_reserves_the_configured_default_calls() -> None:
    tools = {"web_search": "10"}
    models = {
        "paid": {"upstream": "openai", "price_per_million": STANDARD, "price_per_thousand_calls": tools}
    }
    config = config_of(models=models, limits={"default_max_tool_calls": 3})
    body = {"model": "paid", "input": "hi", "tools": [{"type": "web_search"}]}
    call = planned(body, "responses", config=config)
    assert (call.tool_rates, call.estimate.tool_calls) == ({"web_search": 10_000_000}, (("web_search", 3),))


def test_web_search_preview_priced_apart_bills_web_search_calls_under_its_name() -> None:
    tools = {"web_search_preview": "25"}
    models = {
        "paid": {"upstream": "openai", "price_per_million": STANDARD, "price_per_thousand_calls": tools}
    }
    body = {"model": "paid", "input": "hi", "tools": [{"type": "web_search_preview"}]}
    call = planned(body, "responses", config=config_of(models=models))
    assert call.estimate.tool_aliases == (("web_search", "web_search_preview"),)


def test_a_call_is_reserved_at_its_reserve_prices_and_billed_at_the_tier_its_answer_names() -> None:
    call = planned({"model": "tiered", "messages": MSGS}, config=config_of(models=TIERED_MODELS))
    assert call.rates_reserved == rates(PRIORITY)
    assert call.tier_rates == {"default": rates(STANDARD), "priority": rates(PRIORITY)}
    assert call.rates_served == rates(STANDARD)
    call.served_tier = "priority"
    assert call.rates_served == rates(PRIORITY)
    # A tier the operator did not price: the prices of the one asked for.
    call.served_tier = "flex"
    assert call.rates_served == rates(STANDARD)


# -- the reasoning a request asks for -------------------------------------------------------------------

BASES: dict[str, dict[str, Any]] = {
    "chat.completions": {"model": "gpt-4o-mini", "messages": MSGS},
    "completions": {"model": "gpt-4o-mini", "prompt": "hi"},
    "responses": {"model": "gpt-4o-mini", "input": "hi"},
}
GEMINI_THINKS = {"extra_body": {"google": {"thinking_config": {"thinking_budget": 1024}}}}


@pytest.mark.parametrize(
    ("endpoint", "fields", "hidden"),
    [
        ("chat.completions", GEMINI_THINKS, True),
        # OpenRouter's switch turned off outright: its effort is not read.
        ("chat.completions", {"reasoning": {"enabled": False, "effort": "high"}}, False),
        # A budget of 0 leaves the call's own reasoning_effort to say.
        ("chat.completions", {"reasoning": {"max_tokens": 0}, "reasoning_effort": "low"}, True),
        ("completions", {"reasoning": {"enabled": True}}, True),
        ("responses", {"reasoning": {"effort": "none"}, "reasoning_effort": "high"}, False),
    ],
)
def test_the_reasoning_a_request_asks_for_is_read_from_its_dialects_fields(
    endpoint: Endpoint, fields: dict[str, Any], hidden: bool
) -> None:
    assert planned({**BASES[endpoint], **fields}, endpoint).hidden_reasoning is hidden


def test_media_output_is_a_chat_calls_alone() -> None:
    # Elsewhere a modalities field is an extra the provider reads, or refuses, as it likes.
    call = planned({"model": "gpt-4o-mini", "input": "hi", "modalities": ["audio"]}, "responses")
    assert call.media_output is False
    assert planned({"model": "gpt-4o-mini", "messages": MSGS, "modalities": ["audio"]}).media_output is True


# -- what a call continues and names by id ---------------------------------------------------------------


def prompt_key(named: str) -> str:
    return "#" + hashlib.sha256(f"prompt:{named}".encode()).hexdigest()


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        ({"id": "pmpt_1", "version": "2"}, "pmpt_1@2"),
        ({"id": "pmpt_1", "version": 3}, "pmpt_1@3"),
        # A JSON true names no version: the current one's, as none does.
        ({"id": "pmpt_1", "version": True}, "pmpt_1"),
        ({"id": "pmpt_1"}, "pmpt_1"),
    ],
)
def test_a_stored_prompt_is_kept_under_a_digest_of_its_id_and_version(
    prompt: dict[str, Any], named: str
) -> None:
    call = planned({"model": "gpt-4o-mini", "prompt": prompt}, "responses")
    assert call.stored_prompt == prompt_key(named)


def test_a_call_continues_its_previous_response_its_conversation_and_its_stored_prompt() -> None:
    body = {
        "model": "gpt-4o-mini",
        "input": "hi",
        "previous_response_id": "resp_1",
        "conversation": {"id": "conv.1"},
        "prompt": {"id": "pmpt_1"},
    }
    call = planned(body, "responses")
    # A plain id is its own key; any other form is kept under a digest of it.
    conversation = "#" + hashlib.sha256(b"conv.1").hexdigest()
    assert call.continues == ("resp_1", conversation, prompt_key("pmpt_1"))
    assert (call.conversation, call.stores_answer) == (conversation, True)
    unstored = planned({"model": "gpt-4o-mini", "input": "hi", "store": False}, "responses")
    assert (unstored.continues, unstored.stores_answer) == ((), False)


@pytest.mark.parametrize(
    ("context_id", "plain"),
    [
        ("resp_" + "a" * 123, True),
        ("resp_" + "a" * 124, False),
        ("resp_1.2", False),
        ("resp_1 2", False),
        ("resp_1\n", False),
    ],
)
def test_a_context_id_is_its_own_key_only_when_plain(context_id: str, plain: bool) -> None:
    digested = "#" + hashlib.sha256(context_id.encode()).hexdigest()
    assert context_key(context_id) == (context_id if plain else digested)


def test_the_ids_a_chat_or_messages_call_names_for_the_provider_to_look_up() -> None:
    messages = [
        {"role": "user", "content": "hi", "audio": {"id": "audio_user"}},
        {"role": "assistant", "audio": {"id": "audio_1"}},
        {"role": "user", "content": "again"},
    ]
    assert planned({"model": "gpt-4o-mini", "messages": messages}).references == (("audio", "audio_1"),)
    claude_models = {"claude-x": claude_model()}
    named = planned(claude(container={"id": "cntr_1"}), "messages", config=config_of(models=claude_models))
    assert named.references == (("container", "cntr_1"),)


def test_the_files_a_messages_call_puts_in_its_container_or_reads_are_named() -> None:
    """A Files API id reaches the provider in a ``container_upload`` and as a document's or an
    image's ``{"type": "file"}`` source, in a tool result too; not a base64 or a URL source."""
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "print the files"},
        {"type": "container_upload", "file_id": "file_1"},
        {"type": "document", "source": {"type": "file", "file_id": "file_2"}},
        {"type": "image", "source": {"type": "file", "file_id": "file_3"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}},
        {"type": "container_upload", "file_id": ""},
    ]
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "image", "source": {"type": "file", "file_id": "file_4"}}],
    }
    messages = [{"role": "user", "content": content}, {"role": "user", "content": [result]}]
    claude_models = {"claude-x": claude_model()}
    named = planned(claude(messages=messages), "messages", config=config_of(models=claude_models))
    assert named.references == tuple(("file", f"file_{n}") for n in range(1, 5))


def test_the_ids_a_responses_call_names_for_the_provider_to_look_up() -> None:
    items = [
        {"type": "item_reference", "id": "msg_1"},
        {"id": "msg_2"},
        {"id": "msg_3", "content": "an item of its own"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAA"},
        {"type": "code_interpreter_call", "id": "ci_1", "container_id": "cntr_1"},
        {"type": "shell_call", "id": "sh_1", "environment": {"container_id": "cntr_2"}},
        {"type": "item_reference", "id": "msg_1"},
        {"type": "item_reference", "id": ""},
    ]
    tools = [
        {"type": "code_interpreter", "container": "cntr_3"},
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "shell", "environment": {"type": "container_reference", "container_id": "cntr_4"}},
        {"type": "shell", "environment": {"type": "container_auto", "container_id": "cntr_5"}},
    ]
    call = planned({"model": "gpt-4o-mini", "input": items, "tools": tools}, "responses")
    assert call.references == (
        ("item", "msg_1"),
        ("item", "msg_2"),
        ("item", "rs_1"),
        ("input_container", "cntr_1"),
        ("input_container", "cntr_2"),
        ("container", "cntr_3"),
        ("container", "cntr_4"),
    )


# -- the ids a caller sees -----------------------------------------------------------------------------

HEX_128 = re.compile(r"[0-9a-f]{32}")
CHAT = {"model": "gpt-4o-mini", "messages": MSGS}


async def post_chat(proxy: Proxy, body: dict[str, Any], headers: CIMultiDict[str]) -> tuple[int, Any, Any]:
    headers.add("Authorization", f"Bearer {KEY_A}")
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + CHAT_PATH, json=body, headers=headers) as resp,
    ):
        return resp.status, resp.headers, await resp.json(content_type=None)


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [("gw-1.2:3_a", True), ("r" * 128, True), ("r" * 129, False), ("gw/1", False), ("gw 1", False)],
)
async def test_a_sane_request_id_is_echoed_and_any_other_replaced_by_one_of_the_proxys(
    proxy: Proxy, sent: str, echoed: bool
) -> None:
    # A body without a model: refused before any upstream, with the id all the same.
    status, headers, _ = await post_chat(proxy, {"messages": MSGS}, CIMultiDict({"X-Request-Id": sent}))
    assert status == 400
    answered = headers["x-request-id"]
    if echoed:
        assert answered == sent
    else:
        assert answered[:4] == "req_" and HEX_128.fullmatch(answered[4:]), answered


async def test_a_call_naming_no_run_is_a_run_of_its_own_and_its_ids_are_new_each_call(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    seen: list[tuple[str, str, str]] = []
    for _ in range(2):
        status, headers, body = await post_chat(proxy, CHAT, CIMultiDict())
        assert status == 200, body
        run = headers["x-billing-run-id"]
        assert run[:4] == "run_" and HEX_128.fullmatch(run[4:]), run
        await proxy.recorded()
        (entry,) = await ledger_entries(proxy, run)
        assert (entry["run_id"], entry["request_id"]) == (run, headers["x-request-id"])
        assert HEX_128.fullmatch(entry["reservation_id"]), entry
        seen.append((run, entry["request_id"], entry["reservation_id"]))
    # Ids of one source each, never repeated: not the client's either.
    assert len({id_ for ids in seen for id_ in ids}) == 6
    assert len(fake.received) == 2


@pytest.mark.parametrize(
    "runs",
    [["run 1"], ["r" * 129], ["run-1", "run-2"]],
    ids=["space", "too-long", "two-different"],
)
async def test_a_run_id_not_sane_or_sent_twice_apart_is_refused_naming_the_header(
    proxy: Proxy, fake: FakeUpstream, runs: list[str]
) -> None:
    headers: CIMultiDict[str] = CIMultiDict()
    for run in runs:
        headers.add("X-Run-Id", run)
    status, _, body = await post_chat(proxy, CHAT, headers)
    assert (status, body["error"]["param"]) == (400, "X-Run-Id"), body
    assert fake.received == []


async def test_a_run_id_sent_twice_alike_is_one_run(proxy: Proxy) -> None:
    headers: CIMultiDict[str] = CIMultiDict([("X-Run-Id", "run:1.a"), ("X-Run-Id", "run:1.a")])
    status, response_headers, body = await post_chat(proxy, CHAT, headers)
    assert (status, response_headers["x-billing-run-id"]) == (200, "run:1.a"), body
