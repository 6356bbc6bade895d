"""Edges of the three contracts (bad input refused up front, every forwarded call billed once,
budgets never overspent), found by a review hunting for ways to break them: each test failed
before its fix."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries
from tests.test_bad_input import (
    Plan,
    Reply,
    ScriptedUpstream,
    assert_contract,
    assert_refused,
    dumps,
    scripted_upstreams,
    send,
)


@pytest.fixture
def poster(proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis) -> Any:
    async def call(path: str, data: bytes | None) -> Reply:
        return await send(proxy, lambda: fake.received, redis_client, path, data)

    return call


# 1. orjson reads 1024 levels of nesting but writes only 254 ---------------------------------

NESTED = b"[" * 300 + b"]" * 300


async def test_passthrough_field_300_deep_is_not_a_500_nor_billed_unsent(poster: Any) -> None:
    data = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"metadata":' + NESTED + b"}"
    reply = await poster("/v1/chat/completions", data)
    # now: 500 "Internal proxy error", nothing forwarded, one ledger entry upstream_error at the reserve
    assert_contract(reply)


async def test_tool_parameters_300_deep_are_not_a_500(poster: Any) -> None:
    data = (
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],'
        b'"tools":[{"type":"function","function":{"name":"f","parameters":' + NESTED + b"}}]}"
    )
    reply = await poster("/v1/chat/completions", data)  # now: 500 from estimate._with_tools
    assert_contract(reply)


# 2. JSON policy on a deeply nested answer ----------------------------------------------------

JSON_BODY = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "hi"}],
    "response_format": {"type": "json_object"},
    "fake": {"content": "[" * 5000, "chunk_chars": 1000},  # a model looping on "["
}


async def test_deeply_nested_answer_under_json_reject_is_rejected_not_a_500(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(policy={"on_invalid_json": "reject"})
    reply = await send(proxy, lambda: fake.received, redis_client, "/v1/chat/completions", dumps(JSON_BODY))
    assert reply.status == 422, reply.describe()  # now: 500, billed as upstream_error
    assert_contract(reply)


async def test_deeply_nested_stream_under_json_reject_ends(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(policy={"on_invalid_json": "reject"})
    body = {**JSON_BODY, "stream": True}
    # now: the stream never ends (send raises "the proxy never finished its answer")
    reply = await send(proxy, lambda: fake.received, redis_client, "/v1/chat/completions", dumps(body))
    assert (reply.status, reply.upstream_calls, reply.ledger_growth) == (200, 1, 1), reply.describe()
    assert reply.new_entries[0]["outcome"] == "rejected:parse-json: nested too deeply to parse"
    assert b"output_rejected" in reply.body, reply.describe()
    assert b"output_rejected" in reply.body.rstrip().rsplit(b"\n\n", 1)[-1]  # the stream's last event


# 3. A reserve past 15 digits could never be settled nor released: refused up front ------------


async def test_a_reserve_past_what_the_store_takes_is_refused_before_anything(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url),
        models={"gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "30", "output": "60"}}},
    )
    # Were it forwarded, a gateway error page would bill it at its reserve, which settle.lua
    # refuses (16 digits): no ledger entry, its reservation (a concurrent slot) held for ever.
    script.plan = Plan(status=502, content_type="text/html", chunks=[b"<html>bad gateway</html>"])
    body = {"model": "gpt-4o-mini", "prompt": [""] * 20_000, "max_tokens": 10_000_000, "best_of": 128}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/completions", dumps(body))
    error = assert_refused(reply, 400)
    assert "more than the proxy can account for" in error["message"]
    key = await redis_client.hgetall("lbp:{team-a}:key:a-ci:all")
    assert key.get("resv:concurrent", "0") == "0", key
    assert await redis_client.zcard("lbp:{team-a}:leases") == 0
    # The same request within bounds goes out, and its reserve-billed settle lands.
    body["prompt"] = [""] * 2
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/completions", dumps(body))
    assert (reply.upstream_calls, reply.ledger_growth) == (1, 1), reply.describe()
    assert reply.new_entries[0]["usage_source"] == "reserve"


# 4. Legacy `functions` are not counted in the reserve ----------------------------------------

BIG_FUNCTION = {
    "name": "lookup",
    "description": " ".join(f"word{i}" for i in range(2000)),
    "parameters": {"type": "object", "properties": {}},
}


def chat_answer(prompt_tokens: int) -> bytes:
    return dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 1,
            "model": "gpt-4o-mini",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 1,
                "total_tokens": prompt_tokens + 1,
            },
        }
    )


async def test_functions_count_against_the_input_ceiling_as_tools_do(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"input_tokens": 1000}}}
    )
    script.plan = Plan(chunks=[chat_answer(4000)])  # the provider bills the definitions as prompt
    base = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    as_tools = {**base, "tools": [{"type": "function", "function": BIG_FUNCTION}]}
    as_functions = {**base, "functions": [BIG_FUNCTION]}
    ask = lambda b: send(  # noqa: E731
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/chat/completions",
        dumps(b),
        headers={"X-Run-Id": "r1"},
    )
    assert (await ask(as_tools)).status == 429
    reply = await ask(as_functions)
    assert reply.status == 429, reply.describe()  # now: 200, reserved 13 input tokens
    run = await redis_client.hgetall("lbp:{team-a}:run:r1")
    assert int(run.get("used:input_tokens", 0)) <= 1000, run  # now: 4000


async def test_legacy_function_call_in_history_counts_as_tool_calls_do(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"input_tokens": 1000}}}
    )
    script.plan = Plan(chunks=[chat_answer(4000)])
    args = " ".join(f"word{i}" for i in range(2000))
    user = {"role": "user", "content": "hi"}
    call = {"name": "lookup", "arguments": args}
    as_tool_call = [
        user,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    as_function_call = [
        user,
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "lookup", "content": "ok"},
    ]
    for run, messages in (("r1", as_tool_call), ("r2", as_function_call)):
        body = dumps({"model": "gpt-4o-mini", "messages": messages, "max_tokens": 5})
        reply = await send(
            proxy,
            lambda: script.received,
            redis_client,
            "/v1/chat/completions",
            body,
            headers={"X-Run-Id": run},
        )
        assert reply.status == 429, reply.describe()
    assert script.received == []


# 5. Responses background mode: queued, answered later outside the proxy: refused up front -----


@pytest.mark.parametrize("stream", [False, True])
async def test_background_responses_are_refused_before_anything(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"output_tokens": 1000}}}
    )
    # Were it forwarded: OpenAI's answer to background=true, queued, usage null; the generation it
    # bills later was never counted here (three such calls all passed a 1000-token ceiling).
    queued = {"id": "resp_1", "object": "response", "status": "queued", "output": [], "usage": None}
    script.plan = Plan(chunks=[dumps(queued)])
    body = {"model": "gpt-4o-mini", "input": "write an essay", "max_output_tokens": 1000, "background": True}
    body["stream"] = stream
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/responses", dumps(body), headers={"X-Run-Id": "bg"}
    )
    error = assert_refused(reply, 400)
    assert (error["param"], error["code"]) == ("background", "unsupported_parameter")
    body["background"] = False
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/responses", dumps(body), headers={"X-Run-Id": "bg"}
    )
    assert reply.upstream_calls == 1, reply.describe()


async def test_a_response_the_upstream_queued_anyway_is_billed_at_its_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    # A call sent without background, answered as a background one is (an upstream or gateway
    # that queues on its own): the generation comes later, outside the proxy. Was: ok, billed
    # the prompt counted and 0 output tokens.
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    queued = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "queued",
        "model": "gpt-4o-mini",
    }
    script.plan = Plan(chunks=[dumps({**queued, "output": [], "usage": None, "error": None, "tools": []})])
    async with proxy.client() as client:
        reply = await client.responses.create(
            model="gpt-4o-mini",
            input="write an essay",
            max_output_tokens=1000,
            extra_headers={"X-Run-Id": "q"},
        )
    assert reply.status == "queued"  # passed on as it came
    [entry] = await ledger_entries(proxy, "q")
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == (
        "upstream_error",
        "reserve",
        "1000",
    ), entry


# 6. Anthropic usage with an unusable count is billed as 0 ------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("odd", [-1, 12.5, "12", True, 10**13])
async def test_anthropic_unusable_output_tokens_are_not_billed_as_zero(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, odd: Any, stream: bool
) -> None:
    root = fake.base_url.removesuffix("/v1")
    proxy = await make_proxy(
        upstreams={
            "openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY"},
            "anthropic": {"base_url": root + "/v1", "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"},
        },
        models={"claude-*": {"upstream": "anthropic"}, "*": {"upstream": "openai"}},
    )
    body = {
        "model": "claude-x",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "fake": {"reply_tokens": 40, "usage": {"output_tokens": odd}},
    }
    reply = await send(
        proxy,
        lambda: fake.received,
        redis_client,
        "/v1/messages",
        dumps(body),
        headers={"anthropic-version": "2023-06-01"},
    )
    (entry,) = reply.new_entries
    # The OpenAI dialect treats such a count as no usage and counts the 40 words streamed.
    assert int(entry["output_tokens"]) > 0, entry  # now: 0, usage_source "provider"


# 7. Legacy function_call deltas are not counted ----------------------------------------------


async def test_streamed_function_call_arguments_are_counted_without_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    args = json.dumps({"query": " ".join(f"w{i}" for i in range(200))})

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + dumps(obj) + b"\n\n"

    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[
            chunk({"role": "assistant"}),
            chunk({"function_call": {"name": "lookup", "arguments": args}}),
            chunk({}, "function_call"),
            b"data: [DONE]\n\n",  # no usage chunk: the proxy counts what was streamed
        ],
    )
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "functions": [{"name": "lookup", "parameters": {"type": "object"}}],
    }
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert int(entry["output_tokens"]) >= len(args) // 4, entry  # now: 0 (tool_calls: 227)


# -- a second review -------------------------------------------------------------------------

RUN = "lbp:{team-a}:run:r1"
HDR = {"X-Run-Id": "r1"}


def chat_body(content: str, usage: dict[str, Any]) -> bytes:
    return dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 1,
            "model": "gpt-4o-mini",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
            "usage": usage,
        }
    )


def legacy_body(usage: dict[str, Any]) -> bytes:
    return dumps(
        {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
            "usage": usage,
        }
    )


def responses_body(usage: dict[str, Any], text: str = "ok") -> bytes:
    return dumps(
        {
            "id": "resp_1",
            "object": "response",
            "status": "completed",
            "model": "gpt-4o-mini",
            "output": [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
            ],
            "usage": usage,
        }
    )


# 1. Prompt text the estimate skips: a run ceiling is overspent ------------------------------

DOC = "word " * 2000  # 10,000 characters: 2,000 tokens with any OpenAI encoding
PROMPT_TOKENS = 2002  # what the provider bills for it (plus "hi")
CEILING = 1000
SKIPPED = {
    # Legacy completions insert mode: the suffix is prompt text.
    "completions-suffix": (
        "/v1/completions",
        {"model": "gpt-4o-mini", "prompt": "hi", "suffix": DOC, "max_tokens": 5},
        legacy_body(
            {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}
        ),
    ),
    # Structured outputs: the schema is sent to the model as prompt.
    "chat-json_schema": (
        "/v1/chat/completions",
        {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "description": DOC}},
            },
        },
        chat_body(
            "{}", {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}
        ),
    ),
    "responses-text.format": (
        "/v1/responses",
        {
            "model": "gpt-4o-mini",
            "input": "hi",
            "max_output_tokens": 5,
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "object", "description": DOC},
                }
            },
        },
        responses_body(
            {"input_tokens": PROMPT_TOKENS, "output_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}
        ),
    ),
    # A stored prompt's variables are substituted into the prompt.
    "responses-prompt.variables": (
        "/v1/responses",
        {
            "model": "gpt-4o-mini",
            "input": "hi",
            "max_output_tokens": 5,
            "prompt": {"id": "pmpt_1", "variables": {"doc": DOC}},
        },
        responses_body(
            {"input_tokens": PROMPT_TOKENS, "output_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}
        ),
    ),
    # Not covered (README): previous_response_id / conversation (an earlier conversation the
    # proxy never sees) and images (85 to ~1,100 tokens each, by model and size).
}


@pytest.mark.parametrize("case", list(SKIPPED))
async def test_prompt_text_outside_messages_counts_against_a_run_ceiling(
    case: str, make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    path, body, answer = SKIPPED[case]
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"total_tokens": CEILING}}}
    )
    script.plan = Plan(chunks=[answer])
    reply = await send(proxy, lambda: script.received, redis_client, path, dumps(body), headers=HDR)
    used = int(await redis_client.hget(RUN, "used:total_tokens") or 0)
    # Before: 200, reserved_input_tokens 2-40, used:total_tokens 2003 > 1000.
    assert (reply.status, reply.upstream_calls) == (429, 0), reply.describe()
    assert used <= CEILING


async def test_control_same_text_in_the_prompt_is_refused(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The same text in the prompt itself: refused before anything, as it always was."""
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"total_tokens": CEILING}}}
    )
    body = {"model": "gpt-4o-mini", "prompt": "hi" + DOC, "max_tokens": 5}
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/completions", dumps(body), headers=HDR
    )
    assert reply.status == 429 and reply.upstream_calls == 0


# 2. Usage without an output count bills the output as 0 -------------------------------------

ANSWER = "word " * 200  # 200 output tokens the provider wrote


def sse(*objs: Any) -> list[bytes]:
    return [b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs]


def chunk(
    delta: dict[str, Any], fr: str | None = None, usage: Any = None, choices: bool = True
) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "delta": delta, "finish_reason": fr}] if choices else [],
        "usage": usage,
    }


def ev(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj})}\n\n".encode()


OUTPUT_LOST = {
    "chat": ("/v1/chat/completions", False, [chat_body(ANSWER, {"prompt_tokens": 3})]),
    "chat-stream": (
        "/v1/chat/completions",
        True,
        [
            *sse(
                chunk({"content": ANSWER}),
                chunk({}, "stop"),
                chunk({}, None, {"prompt_tokens": 3}, choices=False),
            ),
            b"data: [DONE]\n\n",
        ],
    ),
    "responses-stream": (
        "/v1/responses",
        True,
        [
            ev("response.output_text.delta", {"delta": ANSWER}),
            ev("response.completed", {"response": {"status": "completed", "usage": {"input_tokens": 3}}}),
        ],
    ),
    "messages-stream-null-output": (
        "/v1/messages",
        True,
        [
            ev(
                "message_start",
                {
                    "message": {
                        "id": "m",
                        "role": "assistant",
                        "content": [],
                        "usage": {"input_tokens": 3, "output_tokens": 1},
                    }
                },
            ),
            ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": ANSWER}}),
            ev("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": None}}),
            ev("message_stop", {}),
        ],
    ),
}


@pytest.mark.parametrize("case", list(OUTPUT_LOST))
async def test_usage_without_output_count_is_not_billed_as_zero_output(
    case: str, make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    path, stream, chunks = OUTPUT_LOST[case]
    upstreams = {
        **scripted_upstreams(script.base_url),
        "anthropic": {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"},
    }
    proxy = await make_proxy(
        upstreams=upstreams, models={"claude-*": {"upstream": "anthropic"}, "*": {"upstream": "openai"}}
    )
    script.plan = Plan(content_type="text/event-stream" if stream else "application/json", chunks=chunks)
    if path == "/v1/messages":
        body: dict[str, Any] = {
            "model": "claude-x",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 500,
        }
    elif path == "/v1/responses":
        body = {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 500}
    else:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    body["stream"] = stream
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        path,
        dumps(body),
        headers={"anthropic-version": "2023-06-01"},
    )
    (entry,) = reply.new_entries
    # Before: outcome ok, usage_source provider, output_tokens 0 (1 for the Anthropic case).
    assert int(entry["output_tokens"]) >= 100, entry


# 3. Upstream SSE framing -----------------------------------------------------------------


def _stream_body() -> bytes:
    return dumps(
        {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 50,
            "stream": True,
        }
    )


USAGE_CHUNK = chunk({}, None, {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, choices=False)


async def test_sse_comment_mentioning_data_is_not_an_upstream_error(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[
            b": heartbeat, no data: yet\n\n",  # a comment line: ignored by every SSE parser
            *sse(chunk({"content": "hello"}), chunk({}, "stop"), USAGE_CHUNK),
            b"data: [DONE]\n\n",
        ],
    )
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", _stream_body())
    (entry,) = reply.new_entries
    assert entry["outcome"] == "ok", entry  # before: upstream_error


def client_events(body: bytes) -> list[str]:
    """The data of each event as an SSE client (the openai SDK, a browser) reads it."""
    out = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        data = [ln[5:].removeprefix(" ") for ln in block.split("\n") if ln.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


@pytest.mark.parametrize("client_usage", [False, True])
async def test_multi_line_data_reaches_the_client_as_valid_events(
    client_usage: bool, make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    first = json.dumps(chunk({"content": "hello"}), separators=(",", ":"))
    head, tail = first.split('"choices"', 1)
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[
            b"data: " + head.encode() + b'\ndata: "choices"' + tail.encode() + b"\n\n",
            *sse(chunk({}, "stop"), USAGE_CHUNK),
            b"data: [DONE]\n\n",
        ],
    )
    body = json.loads(_stream_body())
    if client_usage:
        body["stream_options"] = {"include_usage": True}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    for data in client_events(reply.body):
        if data != "[DONE]":
            json.loads(data)  # before (client_usage=False): JSONDecodeError


async def test_cr_line_endings_are_a_complete_stream(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    events = [json.dumps(c).encode() for c in (chunk({"content": "hello"}), chunk({}, "stop"), USAGE_CHUNK)]
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[b"data: " + e + b"\r\r" for e in events] + [b"data: [DONE]\r\r"],
    )
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", _stream_body())
    (entry,) = reply.new_entries
    # Before: upstream_error, usage_source reserve (9 + 50 tokens billed for a 3 + 2 answer).
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry


# 4. A redirect from the upstream is not an answer -----------------------------------------


async def test_upstream_redirect_is_not_passed_on_as_an_ok_call(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(
        status=307,
        chunks=[b"{}"],
        extra_headers={"Location": "https://elsewhere.invalid/v1/chat/completions"},
    )
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    # Before: HTTP 307 with body {} and no Location passed on; ledger outcome ok, usage_source chars.
    assert entry["outcome"] != "ok", (reply.status, entry)
    assert reply.status >= 400 and b'"error"' in reply.body, reply.describe()


# -- a review of those fixes ------------------------------------------------------------------


async def test_an_image_variable_of_a_stored_prompt_is_not_reserved_as_text(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Images reserve nothing (README), as a variable as in ``input``: its base64 is not text."""
    image = "data:image/png;base64," + base64.b64encode(bytes(range(256)) * 1200).decode()  # ~400 KB
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"total_tokens": 50_000}}}
    )
    script.plan = Plan(chunks=[responses_body({"input_tokens": 800, "output_tokens": 20})])
    body = {
        "model": "gpt-4o-mini",
        "input": "describe",
        "max_output_tokens": 50,
        "prompt": {"id": "pmpt_1", "variables": {"photo": {"type": "input_image", "image_url": image}}},
    }
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/responses", dumps(body), headers=HDR
    )
    assert (reply.status, reply.upstream_calls) == (200, 1), reply.describe()


async def test_the_suffix_of_each_prompt_counts_against_a_run_ceiling(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Insert mode sends the suffix with every prompt of a list: reserved once per prompt."""
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"total_tokens": 15_000}}}
    )
    script.plan = Plan(
        chunks=[legacy_body({"prompt_tokens": 40_040, "completion_tokens": 20, "total_tokens": 40_060})]
    )
    body = {"model": "gpt-4o-mini", "prompt": [f"p{i}" for i in range(20)], "suffix": DOC, "max_tokens": 1}
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/completions", dumps(body), headers=HDR
    )
    assert (reply.status, reply.upstream_calls) == (429, 0), reply.describe()
    assert int(await redis_client.hget(RUN, "used:total_tokens") or 0) == 0


# -- a third hunt: disconnects and failed answers ----------------------------------------------

LEDGER = "lbp:{team-a}:ledger"
AUTH = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "r1"}


async def only_entry(client: aioredis.Redis) -> dict[str, str]:
    for _ in range(100):
        got = await client.xrange(LEDGER)
        if got:
            assert len(got) == 1, got
            assert await client.zcard("lbp:{team-a}:leases") == 0
            return dict(got[0][1])
        await asyncio.sleep(0.05)
    raise AssertionError("no ledger entry")


# The upstream's pieces come 0.5 s apart (Plan.delay_s): the client leaves between them.


async def cancel_proxy(make_proxy: ProxyFactory, script: ScriptedUpstream, kind: str) -> Proxy:
    upstream = {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 5, "kind": kind}
    return await make_proxy(
        upstreams={"openai": upstream},
        models={"*": {"upstream": "openai"}},
        policy={"on_client_disconnect": "cancel"},
    )


async def read_until_then_leave(proxy: Proxy, path: str, body: Any, marker: bytes) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.url + path, json=body, headers=AUTH)
        assert resp.status == 200
        seen = b""
        while marker not in seen:
            piece = await asyncio.wait_for(resp.content.readany(), 5)
            assert piece, seen
            seen += piece
        resp.close()


def named_event(event: str, obj: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(obj)}\n\n".encode()


# -- a non-streaming answer that says it failed was billed ok ----------------------------------


async def test_non_streaming_failed_response_is_an_upstream_error(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    body = {"model": "gpt-4o-mini", "input": "hello", "max_output_tokens": 10, "fake": {"mode": "failed"}}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/responses", json=body, headers=AUTH) as resp:
            header_outcome = resp.headers["x-billing-outcome"]
    entry = await only_entry(redis_client)
    # The same answer streamed (response.failed) is upstream_error at the reserve.
    assert (header_outcome, entry["outcome"]) == ("upstream_error", "upstream_error"), entry
    assert entry["usage_source"] == "reserve", entry


# -- cancel dropped the provider's usage already read ------------------------------------------


async def test_cancel_ignores_anthropic_final_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await cancel_proxy(make_proxy, script, "anthropic")
    start = named_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "m",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "claude-3",
                "stop_reason": None,
                "usage": {"input_tokens": 200, "cache_read_input_tokens": 1000, "output_tokens": 1},
            },
        },
    )
    block = named_event(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    delta = named_event(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi there"}},
    )
    stop = named_event("content_block_stop", {"type": "content_block_stop", "index": 0})
    final = named_event(
        "message_delta",
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 300}},
    )
    end = named_event("message_stop", {"type": "message_stop"})
    script.plan = Plan(
        content_type="text/event-stream", chunks=[start + block + delta + stop, final, end], delay_s=0.5
    )
    body = {
        "model": "claude-3",
        "max_tokens": 500,
        "stream": True,
        "messages": [{"role": "user", "content": "hello"}],
    }
    await read_until_then_leave(proxy, "/v1/messages", body, b"content_block_stop")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected"
    # The proxy read message_delta (final usage: 1200 in, 300 out) before it found the client gone.
    assert (entry["usage_source"], entry["input_tokens"], entry["output_tokens"]) == (
        "provider",
        "1200",
        "300",
    ), entry


async def test_cancel_ignores_chat_usage_chunk(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await cancel_proxy(make_proxy, script, "openai")
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini"}

    def chunk(obj: Any) -> bytes:
        return b"data: " + json.dumps({**base, **obj}).encode() + b"\n\n"

    text = chunk({"choices": [{"index": 0, "delta": {"content": "Hi there"}, "finish_reason": None}]})
    fin = chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = chunk(
        {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 250, "total_tokens": 1150}}
    )
    script.plan = Plan(
        content_type="text/event-stream", chunks=[text + fin, usage, b"data: [DONE]\n\n"], delay_s=0.5
    )
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    await read_until_then_leave(proxy, "/v1/chat/completions", body, b'"stop"')
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected"
    assert (entry["usage_source"], entry["input_tokens"], entry["output_tokens"]) == (
        "provider",
        "900",
        "250",
    ), entry


# -- drain, a disconnect, then a failed stream: billed on its text as if complete ----------------


async def test_disconnected_failed_response_is_billed_like_a_connected_one(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    body = {
        "model": "gpt-4o-mini",
        "input": "hello",
        "max_output_tokens": 100,
        "stream": True,
        "fake": {"mode": "failed", "after_chunks": 4, "reply_tokens": 20, "chunk_delay_s": 0.2},
    }
    await read_until_then_leave(proxy, "/v1/responses", body, b"output_text.delta")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected"
    # Connected, the same stream settles upstream_error at the reserve (no usage, not complete);
    # disconnected it is billed on the counted text of the failed answer (5 tokens, "chars").
    assert entry["usage_source"] == "reserve", entry


def response_event(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj})}\n\n".encode()


RESPONSE_DELTA = response_event(
    "response.output_text.delta", {"item_id": "m", "output_index": 0, "content_index": 0, "delta": "Hi there"}
)
RESPONSE_ERROR = response_event(
    "error", {"code": "server_error", "message": "The server had an error", "param": None}
)
RESPONSES_STREAM = {"model": "gpt-4o-mini", "input": "hello", "max_output_tokens": 500, "stream": True}


async def test_a_failed_stream_connected_is_billed_at_its_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await cancel_proxy(make_proxy, script, "openai")
    script.plan = Plan(content_type="text/event-stream", chunks=[RESPONSE_DELTA, RESPONSE_ERROR], delay_s=0.5)
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/responses", json=RESPONSES_STREAM, headers=AUTH) as r:
            await r.read()
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry


@pytest.mark.parametrize("bad", [RESPONSE_ERROR, b"data: {not json\n\n"], ids=["error-event", "malformed"])
async def test_cancel_after_the_upstream_failed_bills_the_reserve_as_connected(
    bad: bytes, make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await cancel_proxy(make_proxy, script, "openai")
    # The client leaves after the delta; the upstream then fails (error event, never a
    # response.completed). The proxy reads the error, then finds the client gone on its write.
    script.plan = Plan(
        content_type="text/event-stream", chunks=[RESPONSE_DELTA, bad, b": keep-alive\n\n"], delay_s=0.5
    )
    await read_until_then_leave(proxy, "/v1/responses", RESPONSES_STREAM, b"output_text.delta")
    entry = await only_entry(redis_client)
    # Connected or drained the same stream bills its reserve (500 output): no usage, not complete.
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == (
        "client_disconnected",
        "reserve",
        "500",
    ), entry


# -- the JSON policy rejected answers that are a tool call, not text ---------------------------

CALL = {"name": "get_weather", "arguments": '{"city":"Paris"}'}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
JSON_CHAT = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "max_tokens": 100,
    "response_format": {"type": "json_object"},
    "tools": CHAT_TOOLS,
}
SCHEMA = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}


def call_answer(finish: str, message: dict[str, Any]) -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": None, **message},
        "finish_reason": finish,
    }
    usage = {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}
    return dumps({"id": "c", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
                  "choices": [choice], "usage": usage})  # fmt: skip


def chat_chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o-mini",
        "choices": choices,
    }
    if usage:
        obj["usage"] = usage
    return b"data: " + dumps(obj) + b"\n\n"


@pytest.mark.parametrize(
    ("finish", "message"),
    [
        (
            "stop",
            {"tool_calls": [{"id": "call_1", "type": "function", "function": CALL}]},
        ),  # forced tool_choice
        ("function_call", {"function_call": CALL}),  # legacy functions
    ],
    ids=["forced-tool-choice", "legacy-function-call"],
)
async def test_a_chat_answer_that_is_a_call_is_not_rejected_as_json(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    finish: str,
    message: Any,
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    script.plan = Plan(chunks=[call_answer(finish, message)])
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(JSON_CHAT))
    assert reply.status == 200, reply.describe()  # was 422 rejected:parse-json
    assert reply.new_entries[0]["outcome"] == "ok", reply.describe()


async def test_a_streamed_tool_call_ending_with_stop_is_not_rejected_as_json(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    call = {"index": 0, "id": "call_1", "type": "function", "function": CALL}
    chunks = [
        chat_chunk({"role": "assistant", "content": None, "tool_calls": [call]}),
        chat_chunk({}, "stop"),
        chat_chunk({}, usage={"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}),
        b"data: [DONE]\n\n",
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    body = dumps({**JSON_CHAT, "stream": True})
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", body)
    assert reply.new_entries[0]["outcome"] == "ok", reply.describe()
    assert b"output_rejected" not in reply.body and reply.body.endswith(b"data: [DONE]\n\n"), reply.describe()


async def test_a_responses_function_call_under_a_json_schema_is_not_rejected(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    usage = {"input_tokens": 20, "output_tokens": 7, "total_tokens": 27}
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "status": "completed", **CALL}
    answer = {"id": "resp_1", "object": "response", "status": "completed", "model": "gpt-4o-mini",
              "output": [item], "usage": usage}  # fmt: skip
    script.plan = Plan(chunks=[dumps(answer)])
    body = {
        "model": "gpt-4o-mini",
        "input": "weather in Paris?",
        "max_output_tokens": 100,
        "text": {"format": SCHEMA},
    }
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/responses", dumps(body))
    assert reply.status == 200, reply.describe()  # was 422 rejected:parse-json
    assert reply.new_entries[0]["outcome"] == "ok", reply.describe()
    # Streamed: the call's arguments arrive as deltas, the status with response.completed.
    events = [
        named_event("response.function_call_arguments.delta", {
            "type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": CALL["arguments"]}),
        named_event("response.completed", {"type": "response.completed", "response": answer}),
    ]  # fmt: skip
    script.plan = Plan(content_type="text/event-stream", chunks=events)
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/responses", dumps({**body, "stream": True})
    )
    assert reply.new_entries[0]["outcome"] == "ok", reply.describe()


async def test_a_call_with_text_that_is_not_json_is_still_rejected(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    message = {
        "content": "Sure! here:",
        "tool_calls": [{"id": "call_1", "type": "function", "function": CALL}],
    }
    script.plan = Plan(chunks=[call_answer("stop", message)])
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(JSON_CHAT))
    assert reply.status == 422, reply.describe()
    assert reply.new_entries[0]["outcome"].startswith("rejected:parse-json"), reply.describe()
    assert reply.new_entries[0]["output_tokens"] == "7"  # rejected, still billed


# -- the bill's arithmetic --------------------------------------------------------------------

PRICED = {"input": "1", "output": "2", "cached_input": "0.1", "cache_creation_input": "5", "reasoning": "8"}


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_cache_writes_are_priced_as_cache_writes(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    # Was: cache_write_tokens never read, the written tokens priced as plain input (1 not 5).
    proxy = await make_proxy(models={"*": {"upstream": "openai", "price_per_million": PRICED}})
    usage = {"input_tokens": 1000, "output_tokens": 0, "input_tokens_details": {"cache_write_tokens": 1000}}
    answer = await proxy.client().responses.create(
        model="gpt-4o-mini", input="hello there", stream=stream, extra_body={"fake": {"usage": usage}}
    )
    if stream:
        async for _ in answer:  # type: ignore[union-attr]
            pass
    (bill,) = fake.bill
    assert bill.cache_creation_tokens == 1000  # the provider's own bill
    entry = await only_entry(redis_client)
    assert entry["cache_creation_input_tokens"] == "1000", entry
    assert int(entry["cost_micros"]) == 5000 + bill.completion_tokens * 2


async def test_chat_cache_writes_are_priced_as_cache_writes(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(models={"*": {"upstream": "openai", "price_per_million": PRICED}})
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 0,
        "prompt_tokens_details": {"cache_write_tokens": 600},
    }
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"fake": {"usage": usage}},
    )
    entry = await only_entry(redis_client)
    assert entry["cache_creation_input_tokens"] == "600"
    assert int(entry["cost_micros"]) == 400 * 1 + 600 * 5


async def test_a_call_billed_at_its_reserve_is_priced_as_the_reserve_was(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # Was: plain rates (input 1, output 2) where the reserve (and a reaper, for the same
    # unknown spend) used the dearest (cache write 5, reasoning 8).
    proxy = await make_proxy(models={"*": {"upstream": "openai", "price_per_million": PRICED}})
    with pytest.raises(openai.InternalServerError):
        await proxy.client(max_retries=0).chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=100,
            extra_body={"fake": {"mode": "error", "error_body": "text"}},
        )
    entry = await only_entry(redis_client)
    assert entry["usage_source"] == "reserve"
    i, o = int(entry["input_tokens"]), int(entry["output_tokens"])
    assert int(entry["cost_micros"]) == -(-(i * 5 + o * 8) // 1)  # whole micro-units per token here


async def test_a_legacy_completion_without_max_tokens_keeps_to_the_models_cap(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Was: reserved (and forwarded) at the legacy default of 16 past a model cap of 10.
    proxy = await make_proxy(
        models={"*": {"upstream": "openai", "max_output_tokens": 10}},
        tiers={"standard": {"run": {"output_tokens": 10}}},
    )
    await proxy.client(max_retries=0).completions.create(model="gpt-3.5-turbo-instruct", prompt="hi")
    assert fake.received[-1].body["max_tokens"] == 10


def _claude_answer(input_tokens: int) -> bytes:
    return dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1},
        }
    )


async def _claude_proxy(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    *,
    max_output_tokens: int | None = None,
    **options: Any,
) -> Proxy:
    """A proxy whose claude-* models go to ``script`` as an Anthropic upstream."""
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    model: dict[str, Any] = {"upstream": "anthropic"}
    if max_output_tokens is not None:
        model["max_output_tokens"] = max_output_tokens
    return await make_proxy(upstreams={"anthropic": upstream}, models={"claude-*": model}, **options)


@pytest.mark.parametrize(
    ("tool", "billed_input"),
    [
        # Anthropic's figures: its tool-use system prompt (346 on current models), a tool's own
        # definition (bash: 245), and the few tokens of the definition and the message.
        ({"name": "f", "input_schema": {"type": "object"}}, 346 + 15 + 8),
        ({"type": "bash_20250124", "name": "bash"}, 346 + 245 + 8),
    ],
    ids=["custom-tool", "bash-tool"],
)
async def test_anthropic_tool_use_input_is_reserved(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    tool: dict[str, Any],
    billed_input: int,
) -> None:
    """A Messages call with tools is billed a system prompt the request does not carry: the
    reserve holds it, so a run ceiling the call would pass refuses it first."""
    proxy = await _claude_proxy(make_proxy, script, tiers={"standard": {"run": {"total_tokens": 300}}})
    script.plan = Plan(chunks=[_claude_answer(billed_input)])
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 16,
        "tools": [tool],
        "messages": [{"role": "user", "content": "hi"}],
    }
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/messages",
        dumps(body),
        headers={"X-Run-Id": "tools"},
    )
    assert (reply.status, reply.upstream_calls) == (429, 0), reply.describe()
    # Without tools the same call fits, and with the operator's own figure for its models too.
    del body["tools"]
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/messages",
        dumps(body),
        headers={"X-Run-Id": "plain"},
    )
    assert reply.status == 200, reply.describe()


async def test_anthropic_mcp_servers_without_tools_reserve_the_tool_use_input(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Anthropic's MCP connector (``mcp_servers``, beta mcp-client-2025-04-04) needs no ``tools``:
    Anthropic fetches the server's tools and the model uses them as tools, with the tool-use
    system prompt (346 tokens) billed. Without ``tools`` it was not reserved: a call under a
    300-token run ceiling went out reserved at 29 tokens and was billed 394."""
    proxy = await _claude_proxy(make_proxy, script, tiers={"standard": {"run": {"total_tokens": 300}}})
    script.plan = Plan(chunks=[_claude_answer(346 + 40 + 8)])  # prompt, one small tool, "hi"
    server = {"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 16,
        "mcp_servers": [server],
        "messages": [{"role": "user", "content": "hi"}],
    }
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/messages",
        dumps(body),
        headers={"X-Run-Id": "mcp", "anthropic-beta": "mcp-client-2025-04-04"},
    )
    assert (reply.status, reply.upstream_calls) == (429, 0), reply.describe()  # was 200, billed 394


def test_the_tool_use_input_of_a_model_is_the_operator_s_to_set() -> None:
    from proxy.config import UpstreamConfig
    from proxy.config_models import ModelConfig
    from proxy.plan import tools_input_tokens

    anthropic = UpstreamConfig(base_url="http://a", kind="anthropic")
    openai_upstream = UpstreamConfig(base_url="http://o")
    assert tools_input_tokens(ModelConfig(upstream="a"), anthropic) == 600
    assert tools_input_tokens(ModelConfig(upstream="o"), openai_upstream) == 0
    assert tools_input_tokens(ModelConfig(upstream="a", tools_input_tokens=350), anthropic) == 350


async def test_a_model_cap_that_would_leave_no_room_above_the_thinking_budget_is_refused_here(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Anthropic refuses max_tokens not above thinking.budget_tokens: lowered to the model's cap
    (4096) under a budget of 10,000, a valid request went out invalid (a 400 about a mistake the
    client did not make)."""
    proxy = await _claude_proxy(make_proxy, script, max_output_tokens=4096)
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 16000,
        "thinking": {"type": "enabled", "budget_tokens": 10000},
        "messages": [{"role": "user", "content": "hi"}],
    }
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body))
    assert (reply.status, reply.upstream_calls) == (400, 0), reply.describe()
    error = json.loads(reply.body)
    assert error["type"] == "error" and "thinking.budget_tokens" in error["error"]["message"]
    script.plan = Plan(chunks=[_claude_answer(10)])
    body["thinking"]["budget_tokens"] = 2000
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body))
    assert reply.status == 200, reply.describe()
    assert json.loads(script.received[-1])["max_tokens"] == 4096
    # Interleaved thinking: the budget covers the turn's every thinking block and may pass
    # max_tokens, which Anthropic then takes.
    body["thinking"]["budget_tokens"] = 10000
    beta = {"anthropic-beta": "interleaved-thinking-2025-05-14"}
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body), headers=beta
    )
    assert reply.status == 200, reply.describe()
    assert json.loads(script.received[-1])["max_tokens"] == 4096


@pytest.mark.parametrize("where", ["output_config.format", "output_format"])
async def test_an_anthropic_structured_output_schema_counts_against_a_run_ceiling(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, where: str
) -> None:
    """Anthropic's structured outputs (``output_config.format``, the beta's ``output_format``) send
    the schema to the model as prompt, as OpenAI's ``response_format`` does (a schema changed is
    a prompt cache missed). It was not reserved: reserved at 13 input tokens, billed 2,010, a run
    ceiling of 1,000 passed by one call."""
    proxy = await _claude_proxy(make_proxy, script, tiers={"standard": {"run": {"total_tokens": CEILING}}})
    script.plan = Plan(chunks=[_claude_answer(PROMPT_TOKENS + 8)])
    form = {"type": "json_schema", "schema": {"type": "object", "description": DOC}}
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if where == "output_format":
        body["output_format"] = form
    else:
        body["output_config"] = {"effort": "low", "format": form}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body), headers=HDR)
    assert (reply.status, reply.upstream_calls) == (429, 0), reply.describe()  # was 200, billed 2,011
    assert int(await redis_client.hget(RUN, "used:total_tokens") or 0) <= CEILING


@pytest.mark.parametrize("functions", [["lookup"], "lookup", {"name": "lookup"}, [1]])
async def test_a_functions_field_on_a_messages_call_is_passed_through_not_a_500(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, functions: Any
) -> None:
    """``functions`` is chat's legacy tools; on a Messages call it is a field the proxy does not
    read, passed through as any other. The tool-use estimate read it all the same (pydantic hands
    an unvalidated extra to ``getattr``) and took each item for a tool object: a 500."""
    proxy = await _claude_proxy(make_proxy, script)
    script.plan = Plan(chunks=[_claude_answer(10)])
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "functions": functions,
    }
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body))
    assert reply.status != 500, reply.describe()  # was 500, "Internal proxy error"
    assert (reply.status, reply.upstream_calls, reply.ledger_growth) == (200, 1, 1), reply.describe()


CHAT_MSGS: list[Any] = [{"role": "user", "content": "hi"}]
INTERLEAVED_BETA = "interleaved-thinking-2025-05-14"


async def _post_chat(
    proxy: Any, body: dict[str, Any], run: str, **headers: str
) -> tuple[int, dict[str, Any]]:
    auth = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run, **headers}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/chat/completions", json=body, headers=auth) as resp,
    ):
        return resp.status, await resp.json()


async def test_an_anthropic_beta_header_the_upstream_never_gets_does_not_let_a_model_cap_pass_the_budget(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Claude through Anthropic's OpenAI-compatible endpoint (an upstream of kind openai): the
    client's anthropic-beta header is not forwarded there, so the provider wants max_tokens above
    thinking.budget_tokens. The clamp read the header as forwarded and kept the cap above the
    budget; the cap check read it as the client sent it and let the model's cap (1000, budget
    2048) go out to be refused (the clamp hunt)."""
    proxy = await make_proxy(
        models={
            "claude-compat": {"upstream": "openai", "max_output_tokens": 1000},
            "*": {"upstream": "openai"},
        },
    )
    body = {
        "model": "claude-compat",
        "messages": CHAT_MSGS,
        "max_completion_tokens": 4096,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    status, error = await _post_chat(proxy, body, "no-beta")
    assert status == 400 and error["error"]["code"] == "output_cap_too_low"  # as it stands: right
    assert fake.received == []
    status, error = await _post_chat(proxy, body, "beta", **{"anthropic-beta": INTERLEAVED_BETA})
    assert status == 400 and error["error"]["code"] == "output_cap_too_low"
    assert error["error"]["param"] == "thinking.budget_tokens"
    assert fake.received == []


async def test_output_cap_too_low_never_blames_a_proxy_cap_that_does_not_exist(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """An upstream that reads only max_tokens (chat_output_cap_field: max_tokens) is sent the
    client's own cap there, which the cap check judged as the config's: a model with none was
    said to be capped at the client's 10 (the clamp hunt). Forwarded as to any upstream."""
    upstream = {
        "base_url": fake.base_url,
        "api_key_env": "TEST_UPSTREAM_KEY",
        "chat_output_cap_field": "max_tokens",
    }
    proxy = await make_proxy(upstreams={"openai": upstream}, models={"*": {"upstream": "openai"}})
    body = {"model": "qwen", "messages": CHAT_MSGS, "max_tokens": 10, "min_tokens": 50}
    status, error = await _post_chat(proxy, body, "mine")
    assert status == 200, error
    assert fake.received[-1].body["max_tokens"] == 10


async def test_a_cap_below_min_tokens_names_min_tokens_beside_a_thinking_without_budget(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A chat call to a model served by vLLM or a GLM-style API (``thinking`` without a budget)
    with ``min_tokens`` 50 and a model cap of 10: the least cap is min_tokens, yet the refusal
    named thinking.budget_tokens, a field the client never sent (the third review)."""
    proxy = await make_proxy(models={"glm": {"upstream": "openai", "max_output_tokens": 10}})
    for thinking in ({"type": "disabled"}, {"type": "enabled"}):
        body: dict[str, Any] = {
            "model": "glm",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100,
            "min_tokens": 50,
            "thinking": thinking,
        }
        headers = {"Authorization": f"Bearer {KEY_A}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            status, error = resp.status, await resp.json()
        assert status == 400 and error["error"]["code"] == "output_cap_too_low", error
        assert error["error"]["param"] == "min_tokens", (thinking, error["error"])
    assert fake.received == []
