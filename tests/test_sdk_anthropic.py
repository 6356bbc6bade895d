"""The real anthropic SDK against /v1/messages: what it parses, what it raises, what is billed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream, dumps

LEDGER = "lbp:{team-a}:ledger"
MODEL = "claude-sonnet-4-5"
MSGS: list[Any] = [{"role": "user", "content": "hello"}]


class Queue(ScriptedUpstream):
    """A scripted upstream answering its plans in turn (the last one again once they run out)."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[Plan] = []
        self.headers_seen: list[dict[str, str]] = []

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.headers_seen.append(dict(request.headers))
        if self.plans:
            self.plan = self.plans.pop(0) if len(self.plans) > 1 else self.plans[0]
        return await super()._handle(request)


@pytest.fixture
async def queue() -> AsyncIterator[Queue]:
    upstream = Queue()
    await upstream.start()
    yield upstream
    await upstream.close()


async def claude_proxy(make_proxy: ProxyFactory, up: Queue, **overrides: Any) -> Proxy:
    upstream = {
        "base_url": up.base_url,
        "kind": "anthropic",
        "api_key_env": "TEST_UPSTREAM_KEY",
        "timeout_s": 5,
        "connect_timeout_s": 2,
    }
    models = {"claude-*": {"upstream": "claude"}}
    overrides.setdefault("upstreams", {"claude": upstream})
    overrides.setdefault("models", models)
    return await make_proxy(**overrides)


def client(proxy: Proxy, key: str = KEY_A, retries: int = 0) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key=key, max_retries=retries)


async def entries(redis_client: aioredis.Redis) -> list[dict[str, str]]:
    return [fields for _id, fields in await redis_client.xrange(LEDGER)]


def ev(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj}, separators=(',', ':'))}\n\n".encode()


def message(content: list[Any], stop: str = "end_turn", usage: Any = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "msg_01", "type": "message", "role": "assistant", "model": MODEL, "content": content,
        "stop_reason": stop, "stop_sequence": None,
        "usage": usage or {"input_tokens": 10, "output_tokens": 5}, **extra,
    }  # fmt: skip


def anthropic_error(status: int, kind: str, message: str = "no") -> Plan:
    body = {"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_up"}
    return Plan(status=status, chunks=[dumps(body)], extra_headers={"request-id": "req_up"})


USAGE = {
    "input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 100,
    "cache_creation_input_tokens": 50,
    "cache_creation": {"ephemeral_5m_input_tokens": 20, "ephemeral_1h_input_tokens": 30},
    "service_tier": "standard",
}  # fmt: skip


async def test_create_parses_and_bills(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    proxy = await claude_proxy(make_proxy, queue)
    content = [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "redacted_thinking", "data": "xxx"},
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"a": 1}},
    ]
    queue.plans = [Plan(chunks=[dumps(message(content, "tool_use", USAGE))])]
    c = client(proxy)
    raw = await c.messages.with_raw_response.create(model=MODEL, max_tokens=100, messages=MSGS)
    msg = await raw.parse()
    assert [b.type for b in msg.content] == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert msg.stop_reason == "tool_use"
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    assert msg.usage.cache_creation is not None and msg.usage.cache_creation.ephemeral_1h_input_tokens == 30
    (entry,) = await entries(redis_client)
    assert entry["outcome"] == "ok"
    assert entry["input_tokens"] == "160"
    assert entry["cached_input_tokens"] == "100"
    assert entry["cache_creation_input_tokens"] == "50"
    assert entry["cache_creation_1h_input_tokens"] == "30"
    assert entry["output_tokens"] == "5"
    assert entry["usage_source"] == "provider"
    await c.close()


def stream_plan(usage_start: dict[str, Any], usage_end: dict[str, Any], stop: str = "end_turn") -> Plan:
    start = message([], None, usage_start)  # type: ignore[arg-type]
    start["stop_reason"] = None
    chunks = [
        ev("message_start", {"message": start}),
        ev("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),  # noqa: E501
        ev("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "let me think"}}),  # noqa: E501
        ev("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": "EqQBCgIYAhIM"}}),  # noqa: E501
        ev("content_block_stop", {"index": 0}),
        ev("content_block_start", {"index": 1, "content_block": {"type": "redacted_thinking", "data": "EmwKAhgB"}}),  # noqa: E501
        ev("content_block_stop", {"index": 1}),
        ev("ping", {}),
        ev("content_block_start", {"index": 2, "content_block": {"type": "text", "text": ""}}),
        ev("content_block_delta", {"index": 2, "delta": {"type": "text_delta", "text": "Hello"}}),
        ev("content_block_delta", {"index": 2, "delta": {"type": "text_delta", "text": " world"}}),
        ev("content_block_stop", {"index": 2}),
        ev("content_block_start", {"index": 3, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}}}),  # noqa: E501
        ev("content_block_delta", {"index": 3, "delta": {"type": "input_json_delta", "partial_json": ""}}),
        ev("content_block_delta", {"index": 3, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": \"Par"}}),  # noqa: E501
        ev("content_block_delta", {"index": 3, "delta": {"type": "input_json_delta", "partial_json": "is\"}"}}),  # noqa: E501
        ev("content_block_stop", {"index": 3}),
        ev("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage_end}),
        ev("message_stop", {}),
    ]  # fmt: skip
    return Plan(content_type="text/event-stream", chunks=chunks)


async def test_stream_parses_and_bills(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    proxy = await claude_proxy(make_proxy, queue)
    start = {**USAGE, "output_tokens": 1}
    queue.plans = [stream_plan(start, {"output_tokens": 42})]
    c = client(proxy)
    async with c.messages.stream(model=MODEL, max_tokens=1000, messages=MSGS) as stream:
        texts = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Hello world"
    assert [b.type for b in final.content] == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert final.content[0].signature == "EqQBCgIYAhIM"  # type: ignore[union-attr]
    assert final.content[3].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert final.usage.output_tokens == 42
    (entry,) = await entries(redis_client)
    assert entry["outcome"] == "ok"
    assert (entry["input_tokens"], entry["output_tokens"]) == ("160", "42")
    assert entry["cache_creation_1h_input_tokens"] == "30"
    await c.close()


@pytest.mark.parametrize(
    ("stop", "outcome"),
    [("max_tokens", "truncated"), ("refusal", "refused"), ("pause_turn", "ok"), ("stop_sequence", "ok"),
     ("model_context_window_exceeded", "truncated")],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_reasons(
    make_proxy: ProxyFactory,
    queue: Queue,
    redis_client: aioredis.Redis,
    stop: str,
    outcome: str,
    stream: bool,
) -> None:
    proxy = await claude_proxy(make_proxy, queue)
    c = client(proxy)
    if stream:
        queue.plans = [stream_plan({"input_tokens": 10, "output_tokens": 1}, {"output_tokens": 7}, stop)]
        async with c.messages.stream(model=MODEL, max_tokens=1000, messages=MSGS) as s:
            final = await s.get_final_message()
    else:
        body = message([{"type": "text", "text": "x"}], stop, {"input_tokens": 10, "output_tokens": 7})
        if stop == "stop_sequence":
            body["stop_sequence"] = "END"
        queue.plans = [Plan(chunks=[dumps(body)])]
        final = await c.messages.create(model=MODEL, max_tokens=1000, messages=MSGS)
    assert final.stop_reason == stop
    (entry,) = await entries(redis_client)
    assert entry["outcome"] == outcome
    assert (entry["input_tokens"], entry["output_tokens"]) == ("10", "7")
    await c.close()


@pytest.mark.parametrize(
    ("status", "kind", "exc"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError),
        (404, "not_found_error", anthropic.NotFoundError),
        (413, "request_too_large", anthropic.RequestTooLargeError),
        (429, "rate_limit_error", anthropic.RateLimitError),
        (500, "api_error", anthropic.InternalServerError),
        (529, "overloaded_error", anthropic.OverloadedError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_errors(
    make_proxy: ProxyFactory,
    queue: Queue,
    redis_client: aioredis.Redis,
    status: int,
    kind: str,
    exc: Any,
    stream: bool,
) -> None:
    proxy = await claude_proxy(make_proxy, queue)
    queue.plans = [anthropic_error(status, kind)]
    c = client(proxy)
    with pytest.raises(exc) as caught:
        if stream:
            async with c.messages.stream(model=MODEL, max_tokens=100, messages=MSGS) as s:
                await s.get_final_message()
        else:
            await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS)
    err = caught.value
    assert err.status_code == status
    assert err.body == {"type": "error", "error": {"type": kind, "message": "no"}, "request_id": "req_up"}
    assert err.request_id == err.response.headers["x-request-id"]
    (entry,) = await entries(redis_client)
    assert entry["outcome"] == ("upstream_4xx" if status < 500 else "upstream_error")
    assert entry["output_tokens"] == "0"
    await c.close()


async def test_sdk_retries_529_each_billed(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    proxy = await claude_proxy(make_proxy, queue)
    ok = Plan(chunks=[dumps(message([{"type": "text", "text": "x"}]))])
    queue.plans = [anthropic_error(529, "overloaded_error"), ok]
    queue.plans[0].extra_headers["x-should-retry"] = "true"
    queue.plans[0].extra_headers["retry-after-ms"] = "10"
    c = client(proxy, retries=2)
    msg = await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS)
    assert msg.content[0].text == "x"  # type: ignore[union-attr]
    got = await entries(redis_client)
    assert [e["outcome"] for e in got] == ["upstream_error", "ok"]
    await c.close()


async def test_proxy_refusals_in_anthropic_shape(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    proxy = await claude_proxy(make_proxy, queue, tiers={"standard": {"run": {"requests": 0}}})
    c = client(proxy, retries=2)
    with pytest.raises(anthropic.RateLimitError) as budget:
        await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS)
    assert budget.value.body["type"] == "error"
    assert budget.value.body["error"]["type"] == "rate_limit_error"
    assert budget.value.request_id
    bad = client(proxy, key="sk-wrong")
    with pytest.raises(anthropic.AuthenticationError) as unauth:
        await bad.messages.create(model=MODEL, max_tokens=100, messages=MSGS)
    assert unauth.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as badreq:
        await c.messages.create(model=MODEL, max_tokens=0, messages=MSGS)
    assert badreq.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as counted:
        await c.messages.count_tokens(model=MODEL, messages=MSGS)
    assert counted.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError) as batch:
        await c.messages.batches.create(
            requests=[{"custom_id": "a", "params": {"model": MODEL, "max_tokens": 5, "messages": MSGS}}]
        )
    assert batch.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        await c.messages.batches.list()
    assert queue.received == []
    await c.close()
    await bad.close()


async def test_stream_rejected_truncation(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    proxy = await claude_proxy(make_proxy, queue, policy={"on_truncate": "reject"})
    queue.plans = [stream_plan({"input_tokens": 10, "output_tokens": 1}, {"output_tokens": 7}, "max_tokens")]
    c = client(proxy)
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with c.messages.stream(model=MODEL, max_tokens=1000, messages=MSGS) as s:
            await s.get_final_message()
    assert caught.value.body["error"]["type"] == "output_rejected"  # type: ignore[index]
    body = message([{"type": "text", "text": "x"}], "max_tokens", {"input_tokens": 10, "output_tokens": 7})
    queue.plans = [Plan(chunks=[dumps(body)])]
    with pytest.raises(anthropic.UnprocessableEntityError) as nonstream:
        await c.messages.create(model=MODEL, max_tokens=1000, messages=MSGS)
    assert nonstream.value.response.headers["x-should-retry"] == "false"
    await c.close()


async def test_x_api_key_refusal(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    import aiohttp

    proxy = await claude_proxy(make_proxy, queue)
    body = dumps({"model": MODEL, "max_tokens": 5, "messages": MSGS})
    async with aiohttp.ClientSession() as s:
        for headers in (
            {"x-api-key": "sk-wrong"},
            {},
            {"x-api-key": KEY_A, "Authorization": "Bearer sk-ant-oat-x"},
        ):
            async with s.post(
                proxy.url + "/v1/messages",
                data=body,
                headers={"content-type": "application/json", "anthropic-version": "2023-06-01", **headers},
            ) as r:
                assert r.status == 401
                assert (await r.json())["error"]["type"] == "authentication_error"
                assert r.headers["request-id"]


async def test_abandoned_stream(make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis) -> None:
    proxy = await claude_proxy(make_proxy, queue)
    plan = stream_plan({"input_tokens": 10, "output_tokens": 1}, {"output_tokens": 7})
    plan.delay_s = 0.05
    queue.plans = [plan]
    c = client(proxy)
    async with c.messages.stream(model=MODEL, max_tokens=1000, messages=MSGS) as s:
        async for _event in s:
            break
    import asyncio

    for _ in range(100):
        got = await entries(redis_client)
        if got:
            break
        await asyncio.sleep(0.05)
    assert [e["outcome"] for e in got] == ["client_disconnected"]
    assert (got[0]["input_tokens"], got[0]["output_tokens"]) == ("10", "7")
    await c.close()


async def test_too_large_and_headers(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    proxy = await claude_proxy(make_proxy, queue, limits={"max_body_bytes": 2000})
    c = client(proxy)
    with pytest.raises(anthropic.APIStatusError) as big:
        await c.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x" * 5000}])
    assert isinstance(big.value, anthropic.ContentTooLargeError)
    assert big.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    await c.close()


PRICES = {"input": "3", "output": "15", "cached_input": "0.3", "cache_creation_input": "3.75",
          "cache_creation_input_1h": "6"}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_cache_write_split_priced(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis, stream: bool
) -> None:
    upstream = {"base_url": queue.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    proxy = await claude_proxy(
        make_proxy,
        queue,
        upstreams={"claude": upstream},
        models={"claude-*": {"upstream": "claude", "price_per_million": PRICES}},
    )
    c = client(proxy)
    if stream:
        queue.plans = [stream_plan({**USAGE, "output_tokens": 1}, {"output_tokens": 5})]
        async with c.messages.stream(model=MODEL, max_tokens=1000, messages=MSGS) as s:
            await s.get_final_message()
    else:
        queue.plans = [Plan(chunks=[dumps(message([{"type": "text", "text": "x"}], usage=USAGE))])]
        raw = await c.messages.with_raw_response.create(model=MODEL, max_tokens=100, messages=MSGS)
        assert raw.headers["x-billing-cost-micros"] == "390"
    (entry,) = await entries(redis_client)
    assert entry["cost_micros"] == "390", entry
    await c.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_tokens_are_recorded_as_reasoning_and_billed_once_as_output(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis, stream: bool
) -> None:
    """Anthropic tells the thinking part of the output in ``usage.output_tokens_details.
    thinking_tokens`` (the SDK's ``OutputTokensDetails``): the ledger's ``reasoning_tokens`` were
    0 on every Claude call (the Anthropic SDK hunt). A part of ``output_tokens``, priced as output:
    the bill is what it was."""
    prices = {"input": "3", "output": "15"}
    proxy = await claude_proxy(
        make_proxy, queue, models={"claude-*": {"upstream": "claude", "price_per_million": prices}}
    )
    usage = {"input_tokens": 5, "output_tokens": 8, "output_tokens_details": {"thinking_tokens": 6}}
    c = client(proxy)
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    if stream:
        queue.plans = [stream_plan({"input_tokens": 5, "output_tokens": 1}, usage)]
        async with c.messages.stream(model=MODEL, max_tokens=2000, messages=MSGS, thinking=thinking) as s:
            final = await s.get_final_message()
    else:
        queue.plans = [Plan(chunks=[dumps(message([{"type": "text", "text": "x"}], usage=usage))])]
        final = await c.messages.create(model=MODEL, max_tokens=2000, messages=MSGS, thinking=thinking)
    await c.close()
    assert final.usage.output_tokens_details is not None
    assert final.usage.output_tokens_details.thinking_tokens == 6
    (entry,) = await entries(redis_client)
    assert (entry["output_tokens"], entry["reasoning_tokens"]) == ("8", "6"), entry
    assert entry["cost_micros"] == str(5 * 3 + 8 * 15), entry


async def test_beta_messages(make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis) -> None:
    proxy = await claude_proxy(make_proxy, queue)
    queue.plans = [Plan(chunks=[dumps(message([{"type": "text", "text": "x"}], usage=USAGE))])]
    c = client(proxy)
    msg = await c.beta.messages.create(
        model=MODEL, max_tokens=100, messages=MSGS, betas=["context-1m-2025-08-07"]
    )
    assert msg.content[0].text == "x"  # type: ignore[union-attr]
    with pytest.raises(anthropic.NotFoundError) as nf:
        await c.beta.messages.count_tokens(model=MODEL, messages=MSGS)
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert queue.headers_seen[0]["anthropic-beta"] == "context-1m-2025-08-07"
    await c.close()


@pytest.mark.parametrize("fallbacks", [[{"model": "claude-opus-4-6", "max_tokens": 64000}], "default"])
async def test_server_side_fallbacks_are_refused_before_anything_is_reserved_or_forwarded(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis, fallbacks: Any
) -> None:
    """Anthropic's server-side fallback (beta server-side-fallback-2026-07-01): a model that
    declines hands the call to another, at its own price and its own ``max_tokens``. Reserved at
    100 output tokens of the call's model and forwarded, a run's ceiling of 1,000 was billed the
    fallback's 5,000 (the Anthropic SDK hunt). Refused as OpenRouter's ``models`` list is."""
    run = {"standard": {"run": {"output_tokens": 1000}}}
    proxy = await claude_proxy(make_proxy, queue, tiers=run)
    c = client(proxy)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await c.beta.messages.create(
            model=MODEL,
            max_tokens=100,
            messages=MSGS,
            fallbacks=fallbacks,
            betas=["server-side-fallback-2026-07-01"],
        )
    await c.close()
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"  # Anthropic's shape: a type and a message
    assert "'fallbacks'" in error["message"]
    assert queue.received == []
    assert await entries(redis_client) == []


async def test_the_advisor_tool_is_refused_before_anything_is_reserved_or_forwarded(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """Anthropic's advisor tool (beta advisor-tool-2026-03-01): the model consults another (the
    tool's ``model``, an Opus) mid-answer, which reads the whole transcript and writes its advice,
    billed at its own prices and told only as an ``advisor_message`` entry of
    ``usage.iterations``. Forwarded, the call was billed 30 input and 20 output tokens where the
    provider charged 1,030 and 1,520 (the Anthropic SDK hunt)."""
    proxy = await claude_proxy(make_proxy, queue)
    c = client(proxy)
    advisor = {"type": "advisor_20260301", "name": "advisor", "model": "claude-opus-4-6", "max_uses": 1}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await c.beta.messages.create(
            model=MODEL,
            max_tokens=100,
            messages=MSGS,
            tools=[advisor],  # type: ignore[list-item]
            betas=["advisor-tool-2026-03-01"],
        )
    await c.close()
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert "advisor" in error["message"]
    assert queue.received == []
    assert await entries(redis_client) == []


# -- on_invalid_json: reject holds for Anthropic structured outputs (output_config.format, what the
# SDK's messages.parse(output_format=...) sends) as for OpenAI's JSON mode.

SCHEMA: dict[str, Any] = {
    "type": "json_schema",
    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
               "additionalProperties": False},
}  # fmt: skip
JSON_USAGE = {"input_tokens": 10, "output_tokens": 7}


def stream_of(text: str, stop: str) -> Plan:
    start = message([], usage={"input_tokens": 10, "output_tokens": 1})
    start["stop_reason"] = None
    return Plan(
        content_type="text/event-stream",
        chunks=[
            ev("message_start", {"message": start}),
            ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}),
            ev("content_block_stop", {"index": 0}),
            ev(
                "message_delta",
                {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 7}},
            ),
            ev("message_stop", {}),
        ],
    )


@pytest.mark.parametrize(
    ("text", "stop", "reason"),
    [('{"a": 1', "max_tokens", "parse-json-truncated"), ("{'a': 1}", "end_turn", "parse-json: ")],
)
async def test_an_anthropic_structured_output_that_does_not_parse_is_rejected(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis, text: str, stop: str, reason: str
) -> None:
    proxy = await claude_proxy(make_proxy, queue, policy={"on_invalid_json": "reject"})
    queue.plans = [Plan(chunks=[dumps(message([{"type": "text", "text": text}], stop, JSON_USAGE))])]
    c = client(proxy)
    with pytest.raises(anthropic.UnprocessableEntityError):
        await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS, output_config={"format": SCHEMA})
    (entry,) = await entries(redis_client)
    assert entry["outcome"].startswith(f"rejected:{reason}"), entry
    assert (entry["input_tokens"], entry["output_tokens"]) == ("10", "7")
    # Streamed: the SDK gets the proxy's error event after the answer.
    await redis_client.delete("lbp:{team-a}:ledger")
    queue.plans = [stream_of(text, stop)]
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with c.messages.stream(
            model=MODEL, max_tokens=100, messages=MSGS, output_config={"format": SCHEMA}
        ) as stream:
            await stream.get_final_message()
    assert caught.value.body["error"]["type"] == "output_rejected"  # type: ignore[index]
    (entry,) = await entries(redis_client)
    assert entry["outcome"].startswith(f"rejected:{reason}"), entry
    await c.close()


async def test_a_tool_call_answer_to_a_structured_output_request_is_not_held_to_json(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    proxy = await claude_proxy(make_proxy, queue, policy={"on_invalid_json": "reject"})
    content = [
        {"type": "text", "text": "Let me look that up."},
        {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Paris"}},
    ]
    queue.plans = [Plan(chunks=[dumps(message(content, "tool_use", JSON_USAGE))])]
    c = client(proxy)
    tools: Any = [{"name": "get", "input_schema": {"type": "object"}}]
    answer = await c.messages.create(
        model=MODEL, max_tokens=100, messages=MSGS, tools=tools, output_config={"format": SCHEMA}
    )
    assert answer.stop_reason == "tool_use"
    (entry,) = await entries(redis_client)
    assert entry["outcome"] == "ok"
    await c.close()


async def test_a_turn_paused_after_compaction_is_not_held_to_json(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """Threshold compaction with ``pause_after_compaction``: the answer is the compaction block
    alone, ``stop_reason: "compaction"``, and the next request continues the turn (the SDK's tool
    runner resumes it, as a ``pause_turn``). No text yet to hold to the structured output: it
    was rejected:parse-json (a 422 for a turn the SDK would have resumed)."""
    proxy = await claude_proxy(make_proxy, queue, policy={"on_invalid_json": "reject"})
    usage = {
        "input_tokens": 0, "output_tokens": 0,
        "iterations": [{"type": "compaction", "input_tokens": 60000, "output_tokens": 3500}],
    }  # fmt: skip
    paused = message([{"type": "compaction", "content": "Summary."}], "compaction", usage)
    queue.plans = [Plan(chunks=[dumps(paused)])]
    c = client(proxy)
    edit = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50000},
            "pause_after_compaction": True}  # fmt: skip
    answer = await c.beta.messages.create(  # was: 422 rejected:parse-json
        model=MODEL,
        max_tokens=100,
        messages=MSGS,
        context_management={"edits": [edit]},  # type: ignore[list-item]
        output_config={"format": SCHEMA},  # type: ignore[typeddict-item]
        betas=["compact-2026-01-12"],
    )
    assert answer.stop_reason == "compaction"
    (entry,) = await entries(redis_client)
    assert entry["outcome"] == "ok", entry
    assert (entry["input_tokens"], entry["output_tokens"]) == ("60000", "3500")
    await c.close()


async def test_the_betas_output_format_is_held_to_json_beside_an_output_config_of_effort(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """The beta's top-level ``output_format`` (still taken, deprecated for output_config.format)
    beside an ``output_config`` that sets only the effort: a structured output all the same. The
    proxy read the format from output_config alone once one was there, and passed an answer
    that does not parse as ok."""
    proxy = await claude_proxy(make_proxy, queue, policy={"on_invalid_json": "reject"})
    answer = message([{"type": "text", "text": "{'a': 1}"}], "end_turn", JSON_USAGE)
    queue.plans = [Plan(chunks=[dumps(answer)])]
    c = client(proxy)
    with pytest.raises(anthropic.UnprocessableEntityError):  # was: 200, outcome ok
        await c.beta.messages.create(
            model=MODEL,
            max_tokens=100,
            messages=MSGS,
            output_config={"effort": "medium"},
            betas=["structured-outputs-2025-11-13"],
            extra_body={"output_format": SCHEMA},
        )
    (entry,) = await entries(redis_client)
    assert entry["outcome"].startswith("rejected:parse-json"), entry
    await c.close()
