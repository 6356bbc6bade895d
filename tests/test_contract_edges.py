"""Edges of the three contracts (bad input refused up front, every forwarded call billed once,
budgets never overspent), found by a review hunting for ways to break them: each test failed
before its fix."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
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
async def script() -> AsyncIterator[ScriptedUpstream]:
    upstream = ScriptedUpstream()
    await upstream.start()
    yield upstream
    await upstream.close()


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
