"""The Responses API and Anthropic Messages billed like chat completions: the official SDKs as
clients, every outcome checked against the fake upstream's bill."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import redis.asyncio as aioredis

from proxy.dialects import DIALECTS
from proxy.observe import Observation
from proxy.payload import Endpoint
from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, scripted_upstreams, send

LEDGER = "lbp:{team-a}:ledger"


@pytest.fixture
async def both(make_proxy: ProxyFactory, fake: FakeUpstream) -> Proxy:
    """One proxy serving gpt-* from the OpenAI-style fake and claude-* from the Anthropic-style fake."""
    return await both_with(make_proxy, fake, timeout_s=2)


async def both_with(make_proxy: ProxyFactory, fake: FakeUpstream, *, timeout_s: float) -> Proxy:
    root = fake.base_url.removesuffix("/v1")
    return await make_proxy(
        upstreams={
            "openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": timeout_s},
            "anthropic": {
                "base_url": root + "/v1",
                "kind": "anthropic",
                "api_key_env": "TEST_UPSTREAM_KEY",
                "timeout_s": timeout_s,
            },
        },
        models={
            "claude-*": {
                "upstream": "anthropic",
                "max_output_tokens": 1000,
                "price_per_million": {
                    "input": "3",
                    "output": "15",
                    "cached_input": "0.3",
                    "cache_creation_input": "3.75",
                },
            },
            "*": {"upstream": "openai"},
        },
        policy={"on_truncate": "pass"},
    )


def claude(proxy: Proxy, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, **{"max_retries": 0, **kw})


async def the_entry(client: aioredis.Redis) -> dict[str, str]:
    for _ in range(100):
        entries = await client.xrange(LEDGER)
        if entries:
            ((_, fields),) = entries
            assert await client.zcard("lbp:{team-a}:leases") == 0
            return dict(fields)
        await asyncio.sleep(0.05)
    raise AssertionError("no ledger entry")


# -- Responses API ------------------------------------------------------------------------------


async def test_responses_non_streaming(both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis) -> None:
    reply = await both.client().responses.with_raw_response.create(
        model="gpt-4o-mini",
        input="hello there",
        instructions="be brief",
        extra_body={
            "fake": {
                "usage": {
                    "input_tokens_details": {"cached_tokens": 2},
                    "output_tokens_details": {"reasoning_tokens": 3},
                }
            }
        },
    )
    assert reply.headers["x-billing-outcome"] == "ok"
    assert reply.parse().output_text
    entry = await the_entry(redis_client)
    (bill,) = fake.bill
    assert entry["endpoint"] == "responses" and entry["usage_source"] == "provider"
    assert int(entry["input_tokens"]) == bill.prompt_tokens
    assert int(entry["output_tokens"]) == bill.completion_tokens
    assert (entry["cached_input_tokens"], entry["reasoning_tokens"]) == ("2", "3")


async def test_responses_streaming_passes_events_and_bills(
    both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    stream = await both.client().responses.create(model="gpt-4o-mini", input="hello there", stream=True)
    kinds = []
    text = ""
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    entry = await the_entry(redis_client)
    (bill,) = fake.bill
    assert entry["outcome"] == "ok" and entry["stream"] == "1"
    assert int(entry["output_tokens"]) == bill.completion_tokens
    assert text.strip()


async def test_responses_stream_ends_with_the_billing_comment(both: Proxy, fake: FakeUpstream) -> None:
    body = {"model": "gpt-4o-mini", "input": "hi", "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            both.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp:
            raw = await resp.read()
    assert b"[DONE]" not in raw
    tail = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert tail.startswith(b": billing {") and b'"outcome":"ok"' in tail


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("mode", "outcome"), [("truncate", "truncated"), ("content_filter", "refused"), ("refusal", "refused")]
)
async def test_responses_outcomes(
    both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis, mode: str, outcome: str, stream: bool
) -> None:
    client = both.client()
    if stream:
        s = await client.responses.create(
            model="gpt-4o-mini",
            input="hi",
            stream=True,
            max_output_tokens=3,
            extra_body={"fake": {"mode": mode}},
        )
        async for _ in s:
            pass
    else:
        await client.responses.create(
            model="gpt-4o-mini", input="hi", max_output_tokens=3, extra_body={"fake": {"mode": mode}}
        )
    entry = await the_entry(redis_client)
    assert entry["outcome"] == outcome
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens


async def test_responses_failed_is_an_upstream_error_charged_with_its_usage(
    both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    s = await both.client().responses.create(
        model="gpt-4o-mini",
        input="hi",
        stream=True,
        extra_body={"fake": {"mode": "failed", "usage": {"input_tokens": 9, "output_tokens": 4}}},
    )
    kinds = [event.type async for event in s]
    assert kinds[-1] == "response.failed"  # passed on to the client unchanged
    entry = await the_entry(redis_client)
    assert entry["outcome"] == "upstream_error" and entry["usage_source"] == "provider"
    assert (entry["input_tokens"], entry["output_tokens"]) == ("9", "4")


async def test_responses_truncation_rejected_by_policy(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(policy={"on_truncate": "reject"})
    with pytest.raises(openai.UnprocessableEntityError):
        await proxy.client(max_retries=2).responses.create(
            model="gpt-4o-mini", input="hi", max_output_tokens=3, extra_body={"fake": {"mode": "truncate"}}
        )
    assert len(fake.bill) == 1
    entry = await the_entry(redis_client)
    assert entry["outcome"] == "rejected:output-truncated"
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens


async def test_responses_reserve_uses_max_output_tokens_and_counts_input(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers={"standard": {"run": {"output_tokens": 5}}})
    with pytest.raises(openai.RateLimitError):
        await proxy.client().responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=6)
    await proxy.client().responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=5)
    assert len(fake.bill) == 1


# -- Anthropic Messages -------------------------------------------------------------------------


async def test_messages_non_streaming_with_cache_meters(
    both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    reply = await claude(both).messages.with_raw_response.create(
        model="claude-sonnet-4",
        max_tokens=50,
        messages=[{"role": "user", "content": "hello there"}],
        extra_body={"fake": {"usage": {"cache_creation_input_tokens": 5, "cache_read_input_tokens": 7}}},
    )
    assert reply.headers["x-billing-outcome"] == "ok"
    message = await reply.parse()
    assert message.stop_reason == "end_turn"
    (bill,) = fake.bill
    entry = await the_entry(redis_client)
    assert entry["endpoint"] == "messages"
    assert int(entry["input_tokens"]) == bill.prompt_tokens + 5 + 7  # ours include cache reads and writes
    assert (entry["cached_input_tokens"], entry["cache_creation_input_tokens"]) == ("7", "5")
    assert int(entry["output_tokens"]) == bill.completion_tokens
    # input 3, cache read 0.3, cache write 3.75, output 15 per million, in micro-units
    exact = bill.prompt_tokens * 3 * 10**6 + 7 * 300_000 + 5 * 3_750_000 + bill.completion_tokens * 15 * 10**6
    assert int(entry["cost_micros"]) == -(-exact // 10**6)
    assert fake.received[-1].headers["x-api-key"] == UPSTREAM_KEY
    assert "anthropic-version" in fake.received[-1].headers
    assert "Authorization" not in fake.received[-1].headers


async def test_messages_streaming(both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis) -> None:
    async with claude(both).messages.stream(
        model="claude-sonnet-4", max_tokens=50, messages=[{"role": "user", "content": "hello there"}]
    ) as stream:
        final = await stream.get_final_message()
    (bill,) = fake.bill
    assert final.usage.output_tokens == bill.completion_tokens
    entry = await the_entry(redis_client)
    assert entry["outcome"] == "ok" and entry["stream"] == "1" and entry["usage_source"] == "provider"
    assert int(entry["input_tokens"]) == bill.prompt_tokens
    assert int(entry["output_tokens"]) == bill.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("mode", "outcome"), [("truncate", "truncated"), ("refusal", "refused")])
async def test_messages_outcomes(
    both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis, mode: str, outcome: str, stream: bool
) -> None:
    client = claude(both)
    kwargs: dict[str, Any] = {
        "model": "claude-sonnet-4",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
        "extra_body": {"fake": {"mode": mode}},
    }
    if stream:
        async with client.messages.stream(**kwargs) as s:
            await s.get_final_message()
    else:
        await client.messages.create(**kwargs)
    entry = await the_entry(redis_client)
    assert entry["outcome"] == outcome
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens


async def test_messages_error_mid_stream_is_charged_with_message_start_input(
    both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    with pytest.raises(anthropic.APIError):
        async with claude(both).messages.stream(
            model="claude-sonnet-4",
            max_tokens=50,
            messages=[{"role": "user", "content": "hello there"}],
            extra_body={"fake": {"mode": "error_mid_stream", "after_chunks": 3}},
        ) as s:
            await s.get_final_message()
    entry = await the_entry(redis_client)
    (bill,) = fake.bill
    assert entry["outcome"] == "upstream_error"
    assert int(entry["input_tokens"]) == bill.prompt_tokens
    assert int(entry["output_tokens"]) >= 1


async def test_messages_errors_come_in_anthropic_format(both: Proxy, fake: FakeUpstream) -> None:
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await anthropic.AsyncAnthropic(base_url=both.url, api_key="wrong", max_retries=0).messages.create(
            model="claude-sonnet-4", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        await claude(both).messages.create(
            model="claude-sonnet-4",
            max_tokens=-1,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "hi"}],
        )
    with pytest.raises(openai.BadRequestError) as wrong:  # a claude model on the OpenAI endpoint
        await both.client().chat.completions.create(
            model="claude-sonnet-4", messages=[{"role": "user", "content": "hi"}]
        )
    assert wrong.value.code == "wrong_endpoint_for_model"
    assert fake.received == []


async def test_messages_budget_refusal_is_a_429_the_sdk_does_not_retry(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    root = fake.base_url.removesuffix("/v1")
    proxy = await make_proxy(
        upstreams={
            "anthropic": {"base_url": root + "/v1", "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"},
            "openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY"},
        },
        models={"claude-*": {"upstream": "anthropic"}, "*": {"upstream": "openai"}},
        tiers={"standard": {"run": {"output_tokens": 10}}},
    )
    with pytest.raises(anthropic.RateLimitError) as caught:
        await claude(proxy, max_retries=2).messages.create(
            model="claude-sonnet-4", max_tokens=11, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert fake.received == []


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_without_usage_are_counted(
    both: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    client = both.client()
    if stream:
        s = await client.responses.create(
            model="gpt-4o-mini", input="hello there", stream=True, extra_body={"fake": {"no_usage": True}}
        )
        async for _ in s:
            pass
    else:
        await client.responses.create(
            model="gpt-4o-mini", input="hello there", extra_body={"fake": {"no_usage": True}}
        )
    entry = await the_entry(redis_client)
    assert entry["usage_source"] == "chars" and entry["outcome"] == "ok"
    assert int(entry["output_tokens"]) > 0 and int(entry["input_tokens"]) > 0


async def test_messages_clients_may_send_their_key_as_x_api_key(both: Proxy, fake: FakeUpstream) -> None:
    body = {"model": "claude-sonnet-4", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            both.url + "/v1/messages",
            json=body,
            headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["type"] == "message"
    assert fake.received[-1].headers["x-api-key"] == UPSTREAM_KEY


async def test_messages_framework_errors_come_in_anthropic_format(both: Proxy) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(both.url + "/v1/messages", headers={"x-api-key": KEY_A}) as resp:
            assert resp.status == 405
            body = await resp.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        async with session.post(
            both.url + "/v1/messages",
            data=b"x" * (5 * 1024 * 1024),
            headers={"x-api-key": KEY_A, "content-type": "application/json"},
        ) as resp:
            assert resp.status == 413
            body = await resp.json()
        assert body["error"]["type"] == "request_too_large"


async def _post(proxy: Proxy, path: str, body: dict[str, Any]) -> bytes:
    headers = {"Authorization": f"Bearer {KEY_A}", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        async with session.post(proxy.url + path, json=body, headers=headers) as resp:
            try:
                return await resp.read()
            except aiohttp.ClientPayloadError:
                return b""


@pytest.mark.parametrize("mode", ["cut", "stall_mid_stream"])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_a_stream_broken_mid_answer_is_billed_at_least_what_the_provider_bills(
    both: Proxy,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    mode: str,
    path: str,
) -> None:
    fake_ctl = {"mode": mode, "after_chunks": 2, "reply_tokens": 40, "stall_s": 5}
    if path == "/v1/messages":
        body = {
            "model": "claude-sonnet-4",
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "hello there"}],
            "fake": fake_ctl,
        }
    else:
        body = {
            "model": "gpt-4o-mini",
            "input": "hello there",
            "max_output_tokens": 50,
            "stream": True,
            "fake": fake_ctl,
        }
    await _post(both, path, body)
    entry = await the_entry(redis_client)
    (bill,) = fake.bill
    assert entry["outcome"] in ("upstream_error", "upstream_timeout"), entry
    # The provider generated (and bills) the whole answer; the proxy saw 2 of its 40 tokens and
    # no output count: the README says such a call is billed at its reserve.
    assert int(entry["output_tokens"]) >= bill.completion_tokens, (entry, bill)


# -- a Responses answer without usage: its reasoning summary is output too --------------------


SUMMARY = " ".join(f"step{i}" for i in range(300))


def _sse_ev(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj})}\n\n".encode()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_responses_reasoning_summary_is_counted_without_usage_streamed_or_not(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    reasoning = {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": SUMMARY}]}
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
    }
    final = {"id": "resp_1", "object": "response", "status": "completed", "output": [reasoning, message]}
    if stream:
        chunks = [
            _sse_ev("response.created", {"response": {**final, "status": "in_progress", "output": []}}),
            _sse_ev("response.reasoning_summary_text.delta", {"delta": SUMMARY}),
            _sse_ev("response.output_text.delta", {"delta": "ok"}),
            _sse_ev("response.completed", {"response": final}),
        ]
        script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    else:
        script.plan = Plan(chunks=[dumps(final)])
    body = {"model": "gpt-4o-mini", "input": "think", "max_output_tokens": 2000, "stream": stream}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/responses", dumps(body))
    assert reply.status == 200
    (entry,) = reply.new_entries
    assert entry["usage_source"] != "provider"
    # 300 words of summary the model wrote (and the provider bills, and more): counted either way.
    assert int(entry["output_tokens"]) >= 300, entry


CODE = "import math\n" + "".join(f"print(math.factorial({i}))\n" for i in range(100))


@pytest.mark.parametrize("stream", [True, False])
async def test_a_responses_code_interpreter_call_s_code_is_counted_without_usage_streamed_or_not(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    # The code the model writes for the code interpreter is output it bills: counted from its
    # deltas when streamed, it was not counted from the whole body (0 output tokens for it).
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    call = {"id": "ci_1", "type": "code_interpreter_call", "status": "completed", "code": CODE,
            "container_id": "cntr_1", "outputs": None}  # fmt: skip
    final = {"id": "resp_1", "object": "response", "status": "completed", "output": [call]}
    if stream:
        chunks = [
            _sse_ev("response.created", {"response": {**final, "status": "in_progress", "output": []}}),
            _sse_ev("response.output_item.added", {"output_index": 0, "item": {**call, "code": ""}}),
            _sse_ev("response.code_interpreter_call_code.delta", {"item_id": "ci_1", "delta": CODE}),
            _sse_ev("response.completed", {"response": final}),
        ]
        script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    else:
        script.plan = Plan(chunks=[dumps(final)])
    body = {"model": "gpt-4o-mini", "input": "compute", "max_output_tokens": 4000, "stream": stream,
            "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}  # fmt: skip
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/responses", dumps(body))
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    assert entry["usage_source"] != "provider"
    assert int(entry["output_tokens"]) >= len(CODE) // 4, entry


# A tool's name the model writes when it calls it, as long as OpenAI takes (64 characters).
TOOL = "look_up_the_current_weather_forecast_for_a_city_by_its_full_name"
TOOL_INPUT = {"city": "Paris"}


@pytest.mark.parametrize(
    ("endpoint", "stream", "answer"),
    [
        ("chat.completions", False, [{"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": TOOL, "arguments": json.dumps(TOOL_INPUT)}}]}}]}]),
        ("responses", False, [{"id": "r", "status": "completed", "output": [{
            "type": "function_call", "id": "fc", "call_id": "c", "name": TOOL,
            "arguments": json.dumps(TOOL_INPUT)}]}]),
        ("responses", True, [
            {"type": "response.output_item.added", "output_index": 0, "item": {
                "type": "function_call", "id": "fc", "call_id": "c", "name": TOOL, "arguments": ""}},
            {"type": "response.function_call_arguments.delta", "item_id": "fc",
             "delta": json.dumps(TOOL_INPUT)}]),
        # An MCP approval request streams no deltas: its item is told whole, as it starts and ends.
        ("responses", True, [
            {"type": f"response.output_item.{event}", "output_index": 0, "item": {
                "type": "mcp_approval_request", "id": "mcpr", "server_label": "w", "name": TOOL,
                "arguments": json.dumps(TOOL_INPUT)}} for event in ("added", "done")]),
        ("messages", False, [{"type": "message", "stop_reason": "tool_use", "content": [
            {"type": "tool_use", "id": "t", "name": TOOL, "input": TOOL_INPUT}]}]),
        ("messages", True, [
            {"type": "content_block_start", "index": 0, "content_block": {
                "type": "tool_use", "id": "t", "name": TOOL, "input": {}}},
            {"type": "content_block_delta", "index": 0, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(TOOL_INPUT)}}]),
    ],
)  # fmt: skip
def test_a_call_s_name_is_counted_as_output_in_every_dialect(
    endpoint: Endpoint, stream: bool, answer: list[dict[str, Any]]
) -> None:
    # The model writes the name of the tool it calls: output chat's count holds (its answers'
    # tool_calls), the Responses and Anthropic ones left out, streamed or not (a call cut
    # under cancel, an answer without usage, billed for its arguments alone; a streamed MCP
    # approval request for nothing at all).
    obs = Observation()
    dialect = DIALECTS[endpoint]
    for obj in answer:
        (dialect.observe_event if stream else dialect.observe_body)(obs, obj)
    text = obs.all_text()
    assert (text.count(TOOL), text.count("Paris")) == (1, 1), text


def _observed_item(item: dict[str, Any], *, stream: bool, completed: bool = False) -> Observation:
    """A Responses answer of one output ``item``: streamed, the item told whole as it starts and
    ends (no deltas), then ``response.completed`` when ``completed``; else a whole body."""
    obs = Observation()
    dialect = DIALECTS["responses"]
    body = {"id": "r", "status": "completed", "output": [item]}
    if not stream:
        dialect.observe_body(obs, body)
        return obs
    for event in ("added", "done"):
        dialect.observe_event(obs, {"type": f"response.output_item.{event}", "output_index": 0, "item": item})
    if completed:
        dialect.observe_event(obs, {"type": "response.completed", "response": body})
    return obs


@pytest.mark.parametrize("stream", [True, False])
def test_a_local_shell_call_s_command_is_counted_as_output_streamed_or_not(stream: bool) -> None:
    # The command is the model's output; a local shell call streams no deltas (its item is told
    # whole as it starts and ends): it was counted neither way.
    item = {"type": "local_shell_call", "id": "lsh", "call_id": "c", "status": "completed",
            "action": {"type": "exec", "command": ["curl", "wttr.in/Paris"], "env": {}}}  # fmt: skip
    obs = _observed_item(item, stream=stream)
    assert obs.all_text().count("wttr.in/Paris") == 1, obs.all_text()


# Calls whose model-written part is a structure: an action, a batch of them, search queries. A
# search's results and sources are the tool's, not the model's output.
WRITTEN_CALLS = [
    {"type": "computer_call", "id": "cu", "call_id": "c", "status": "completed",
     "action": {"type": "type", "text": "Paris weather"}, "pending_safety_checks": []},
    {"type": "computer_call", "id": "cu", "call_id": "c", "status": "completed",
     "actions": [{"type": "type", "text": "Paris weather"}], "pending_safety_checks": [],
     "action": None},
    {"type": "web_search_call", "id": "ws", "status": "completed",
     "action": {"type": "search", "query": "Paris weather"}},
    {"type": "web_search_call", "id": "ws", "status": "completed",
     "action": {"type": "search", "query": "Paris weather", "queries": ["Paris weather"],
                "sources": [{"type": "url", "url": "https://Rainy.example"}]}},
    {"type": "file_search_call", "id": "fs", "status": "completed", "queries": ["Paris weather"],
     "results": [{"file_id": "f", "filename": "w.txt", "score": 0.9, "text": "Rainy all week."}]},
]  # fmt: skip
WRITTEN_CALL_IDS = ["computer", "computer-batch", "web-search", "web-search-sources", "file-search"]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("item", WRITTEN_CALLS, ids=WRITTEN_CALL_IDS)
def test_a_call_s_action_or_queries_are_counted_as_output_once_streamed_or_not(
    item: dict[str, Any], stream: bool
) -> None:
    """These calls stream no deltas (their items are told whole as they start and end). Was: a
    streamed one counted nothing, a computer call's batch of actions and a file search's queries
    nothing streamed or not (a call cut under cancel, an answer without usage)."""
    obs = _observed_item(item, stream=stream)
    text = obs.all_text()
    assert (text.count("Paris weather"), text.count("Rainy")) == (1, 0), text
    assert obs.contents == {}  # not the answer held to JSON


def test_an_apply_patch_operation_is_counted_as_output_once_streamed_or_not() -> None:
    """The model writes the file's path and diff. Was: an answer without usage counted neither;
    streamed, the diff comes as deltas and is counted from them alone."""
    item = {"type": "apply_patch_call", "id": "ap", "call_id": "c", "status": "completed",
            "operation": {"type": "create_file", "path": "paris.md", "diff": "+Paris weather"}}  # fmt: skip
    body = Observation()
    DIALECTS["responses"].observe_body(body, {"id": "r", "status": "completed", "output": [item]})
    streamed = Observation()
    for event in (
        {"type": "response.output_item.added", "output_index": 0,
         "item": {**item, "status": "in_progress", "operation": {**item["operation"], "diff": ""}}},
        {"type": "response.apply_patch_call_operation_diff.delta", "output_index": 0,
         "item_id": "ap", "delta": "+Paris weather"},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
    ):  # fmt: skip
        DIALECTS["responses"].observe_event(streamed, event)
    assert body.all_text().count("Paris weather") == 1, body.all_text()
    assert "paris.md" in body.all_text()
    assert streamed.all_text().count("Paris weather") == 1, streamed.all_text()


@pytest.mark.parametrize("how", ["deltas", "whole-at-start", "body"])
def test_an_anthropic_compaction_summary_is_counted_as_output_once(how: str) -> None:
    """Threshold compaction writes a summary of the context (its own iteration's output tokens,
    billed). Was: an answer without the final usage (a client gone under cancel) counted the
    answer alone, the summary nothing."""
    summary = "The user asked about Paris weather twice."
    obs = Observation()
    dialect = DIALECTS["messages"]
    if how == "body":
        content = [{"type": "compaction", "content": summary, "encrypted_content": "EnC"},
                   {"type": "text", "text": "Sunny."}]  # fmt: skip
        dialect.observe_body(obs, {"type": "message", "stop_reason": "end_turn", "content": content})
    else:
        start = summary if how == "whole-at-start" else None
        events = [
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "compaction", "content": start, "encrypted_content": None}},
            *([] if start else [{"type": "content_block_delta", "index": 0, "delta": {
                "type": "compaction_delta", "content": summary, "encrypted_content": "EnC"}}]),
            {"type": "content_block_stop", "index": 0},
            {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Sunny."}},
        ]  # fmt: skip
        for event in events:
            dialect.observe_event(obs, event)
    assert obs.all_text().count("Paris weather") == 1, obs.all_text()
    assert "EnC" not in obs.all_text() and obs.content_of(0) == "Sunny."


# What the model writes in a computer use action or a web search's query.
QUERY = "weather forecast for Paris tomorrow"


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "item",
    [
        {"type": "computer_call", "id": "cu", "call_id": "c", "status": "completed",
         "pending_safety_checks": [], "action": {"type": "type", "text": QUERY}},
        {"type": "web_search_call", "id": "ws", "status": "completed",
         "action": {"type": "search", "query": QUERY}},
    ],
    ids=["computer_call", "web_search_call"],
)  # fmt: skip
def test_a_call_s_action_is_counted_as_output_streamed_as_whole(stream: bool, item: dict[str, Any]) -> None:
    # A computer use action and a search's query are the model's output, counted from a whole
    # body's item; streamed, the item is told whole as it starts and ends, with no deltas (as a
    # local shell call's): its action was not counted, an answer without usage billed without it.
    obs = _observed_item(item, stream=stream, completed=True)
    assert obs.all_text().count(QUERY) == 1, obs.all_text()


@pytest.mark.parametrize("stream", [True, False])
def test_the_sources_a_web_search_found_are_not_counted_as_its_output(stream: bool) -> None:
    # With include ["web_search_call.action.sources"] a search's action lists the pages it found:
    # results it read, not text the model wrote. Counted with its query, an answer without usage
    # was billed every URL as output.
    sources = [{"type": "url", "url": f"https://example.com/forecast/paris/{i}"} for i in range(50)]
    item = {"type": "web_search_call", "id": "ws", "status": "completed",
            "action": {"type": "search", "query": QUERY, "sources": sources}}  # fmt: skip
    obs = _observed_item(item, stream=stream)
    text = obs.all_text()
    assert (text.count(QUERY), text.count("example.com")) == (1, 0), text


# -- a Responses answer that reasons: its hidden reasoning tokens cannot be counted ------------

# What OpenAI bills for it (the answer the proxy never read, or that came without usage): 2,990
# reasoning tokens that no event nor body shows, and 10 tokens of text.
THOUGHT = {"input_tokens": 5, "output_tokens": 3000, "output_tokens_details": {"reasoning_tokens": 2990}}
REASONING_ITEM = {"id": "rs_1", "type": "reasoning", "summary": []}
ANSWER_ITEM = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "The proof is complete.", "annotations": []}],
}


def _reasoned(status: str, output: list[Any], usage: Any) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "o4-mini",
        "status": status,
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


@pytest.mark.parametrize("how", ["client-left", "no-usage"])
async def test_a_responses_answer_that_reasons_is_billed_at_its_reserve_without_the_providers_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, how: str
) -> None:
    """Its reasoning tokens are billed as output and never shown (a summary, when asked for, is a
    fraction of them): a count of what came back is prompt and text alone. Was: 0 output tokens
    for a client that left while the model thought (``cancel``), 5 for the text without usage."""
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_client_disconnect": "cancel"}
    )
    run = {"X-Run-Id": "think"}
    async with proxy.client() as client:
        if how == "client-left":
            live = _reasoned("in_progress", [], None)
            started = _sse_ev("response.created", {"sequence_number": 0, "response": live}) + _sse_ev(
                "response.output_item.added",
                {"sequence_number": 1, "output_index": 0, "item": REASONING_ITEM},
            )
            waiting = [_sse_ev("response.in_progress", {"sequence_number": 2, "response": live})] * 3
            done = _reasoned("completed", [REASONING_ITEM, ANSWER_ITEM], THOUGHT)
            last = _sse_ev("response.completed", {"sequence_number": 3, "response": done})
            script.plan = Plan(
                content_type="text/event-stream", chunks=[started, *waiting, last], delay_s=0.2
            )
            stream = await client.responses.create(
                model="o4-mini", input="prove it", max_output_tokens=4000, stream=True, extra_headers=run
            )
            async for event in stream:
                if event.type == "response.output_item.added":
                    break  # the model is thinking: the client gives up
            await stream.close()
        else:
            script.plan = Plan(chunks=[dumps(_reasoned("completed", [REASONING_ITEM, ANSWER_ITEM], None))])
            reply = await client.responses.create(
                model="o4-mini", input="prove it", max_output_tokens=4000, extra_headers=run
            )
            assert reply.output_text == "The proof is complete."
    entry = await the_entry(redis_client)
    assert entry["outcome"] == ("client_disconnected" if how == "client-left" else "ok"), entry
    assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "4000"), entry
    assert int(entry["output_tokens"]) >= THOUGHT["output_tokens"]


# -- the image generation tool's tokens: reported apart from usage, billed all the same --------

IMAGE_CALL = {"id": "ig_1", "type": "image_generation_call", "status": "completed", "result": "aGVsbG8="}
TOOL_USAGE = {
    "image_gen": {
        "input_tokens": 50,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 50},
        "output_tokens": 1056,
        "total_tokens": 1106,
    },
    "web_search": {"num_requests": 0},
}


async def _draw_a_cat(proxy: Proxy, *, stream: bool, svg: bool = False, **options: Any) -> Any:
    """A Responses call with the image generation tool (``svg``: drawing an SVG), through the
    openai SDK; the final response (a stream's, from its last event)."""
    tool: Any = {"type": "image_generation", **({"output_format": "svg"} if svg else {})}
    async with proxy.client() as client:
        reply: Any = await client.responses.create(
            model="gpt-4o",
            input="draw a cat",
            tools=[tool],
            stream=stream,
            extra_headers={"X-Run-Id": "img"},
            **options,
        )
        if stream:
            reply = [event async for event in reply][-1].response
    return reply


@pytest.mark.parametrize("stream", [False, True])
async def test_the_image_generation_tools_tokens_are_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """OpenAI reports them in ``tool_usage``, apart from the model's ``usage``, and bills them.
    Was: billed the model's 20 + 30 tokens only, the image's 1,106 not at all."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    usage = {"input_tokens": 20, "output_tokens": 30, "total_tokens": 50}
    final = {**_reasoned("completed", [IMAGE_CALL], usage), "model": "gpt-4o", "tool_usage": TOOL_USAGE}
    if stream:
        started = _sse_ev(
            "response.created", {"sequence_number": 0, "response": {**final, "status": "in_progress"}}
        )
        done = _sse_ev("response.completed", {"sequence_number": 1, "response": final})
        script.plan = Plan(content_type="text/event-stream", chunks=[started, done])
    else:
        script.plan = Plan(chunks=[dumps(final)])
    reply = await _draw_a_cat(proxy, stream=stream)
    assert reply.tool_usage is not None and reply.tool_usage.image_gen.output_tokens == 1056
    entry = await the_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry
    assert (entry["input_tokens"], entry["output_tokens"]) == ("70", "1086"), entry


SVG_CALL = {
    **IMAGE_CALL,
    "output_format": "svg",
    "svg_usage": {
        "model": "gpt-4o", "input_tokens": 2000, "output_tokens": 6000, "reasoning_tokens": 3000,
        "total_tokens": 8000,
    },
}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_an_svg_s_authoring_tokens_are_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """With ``output_format: "svg"`` a model authors the SVG: the call item's ``svg_usage`` tells
    its tokens, "separate from image rendering usage", in neither ``usage`` nor
    ``tool_usage.image_gen``. They went unbilled (2,000 in, 6,000 out: the usage hunt); added to
    the input and output at the model's prices, as the image's tokens are, its reasoning too."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    usage = {"input_tokens": 20, "output_tokens": 30, "total_tokens": 50}
    final = {**_reasoned("completed", [SVG_CALL], usage), "model": "gpt-4o", "tool_usage": TOOL_USAGE}
    if stream:
        done = _sse_ev("response.completed", {"sequence_number": 0, "response": final})
        script.plan = Plan(content_type="text/event-stream", chunks=[done])
    else:
        script.plan = Plan(chunks=[dumps(final)])
    reply = await _draw_a_cat(proxy, stream=stream, svg=True)
    assert reply.output[0].svg_usage.output_tokens == 6000
    entry = await the_entry(redis_client)
    assert (entry["input_tokens"], entry["output_tokens"]) == ("2070", "7086"), entry  # was 70, 1,086
    assert entry["reasoning_tokens"] == "3000", entry


@pytest.mark.parametrize("stream", [False, True])
async def test_a_generated_image_without_usage_is_billed_its_reserved_output(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """Its image tokens (1,056 here, and 100 more for each partial image) are billed as output and
    no text shows them: its base64 is not their count. Was: an answer without usage billed only
    its few words of text, the image nothing."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    final = {**_reasoned("completed", [IMAGE_CALL, ANSWER_ITEM], None), "model": "gpt-4o"}
    if stream:
        events = [
            ("response.created", {"response": {**final, "status": "in_progress", "output": []}}),
            ("response.output_item.added",
             {"output_index": 0, "item": {**IMAGE_CALL, "status": "in_progress"}}),
            ("response.image_generation_call.partial_image",
             {"output_index": 0, "item_id": "ig_1", "partial_image_index": 0, "partial_image_b64": "aGk="}),
            ("response.output_item.done", {"output_index": 0, "item": IMAGE_CALL}),
            ("response.completed", {"response": final}),
        ]  # fmt: skip
        chunks = [_sse_ev(kind, {"sequence_number": n, **obj}) for n, (kind, obj) in enumerate(events)]
        script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    else:
        script.plan = Plan(chunks=[dumps(final)])
    reply = await _draw_a_cat(proxy, stream=stream, max_output_tokens=4000)
    assert reply.output[0].type == "image_generation_call"
    entry = await the_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "reserve"), entry
    assert entry["output_tokens"] == "4000", entry


# -- the Anthropic SDK's other Messages calls get Anthropic's error format --------------------


async def test_an_unbilled_messages_subpath_is_refused_in_anthropics_format(
    both: Proxy,
    fake: FakeUpstream,
) -> None:
    client = anthropic.AsyncAnthropic(base_url=both.url, api_key=KEY_A, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as caught:
        await client.messages.count_tokens(
            model="claude-sonnet-4", messages=[{"role": "user", "content": "hello"}]
        )
    body = caught.value.body
    assert isinstance(body, dict) and body.get("type") == "error", body
    assert body["error"]["type"] == "not_found_error", body
    assert caught.value.request_id, "the SDK reads request-id"
    assert not fake.received


# -- an upstream slow to close after its answer's last event does not hold the client ---------


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_the_sdk_has_the_whole_answer_as_soon_as_its_last_event_came(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, api: str
) -> None:
    both = await both_with(make_proxy, fake, timeout_s=60)  # the silence is not cut by a timeout
    lingering = {"fake": {"tail_delay_s": 30}}  # the upstream closes 30 s after its last event
    started = time.monotonic()
    if api == "messages":
        client = anthropic.AsyncAnthropic(base_url=both.url, api_key=KEY_A, max_retries=0)
        async with client.messages.stream(
            model="claude-sonnet-4",
            max_tokens=20,
            messages=[{"role": "user", "content": "hello"}],
            extra_body=lingering,
        ) as stream:
            message = await stream.get_final_message()
        assert message.stop_reason == "end_turn"
    else:
        async with both.client().responses.stream(
            model="gpt-4o-mini", input="hello", extra_body=lingering
        ) as rstream:
            response = await rstream.get_final_response()
        assert response.status == "completed"
    took = time.monotonic() - started
    entry = await the_entry(redis_client)
    assert entry["outcome"] == "ok"
    # message_stop / response.completed ends the answer: nothing may follow it.
    assert took < 15, f"the SDK waited {took:.2f} s for the upstream to close"


# -- Anthropic message_delta usage: cumulative ---------------------------------------------------

CACHED_START = {
    "input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 50,
    "cache_creation": {"ephemeral_5m_input_tokens": 20, "ephemeral_1h_input_tokens": 30},
}  # fmt: skip
CACHE_PRICES = {"input": "3", "output": "15", "cached_input": "0.3", "cache_creation_input": "3.75",
                "cache_creation_input_1h": "6"}  # fmt: skip


def _anthropic_stream(tail: list[bytes], start_usage: dict[str, Any] = CACHED_START) -> Plan:
    start = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage,
    }  # fmt: skip
    head = [
        _sse_ev("message_start", {"message": start}),
        _sse_ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        _sse_ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello world"}}),
        _sse_ev("content_block_stop", {"index": 0}),
    ]
    return Plan(content_type="text/event-stream", chunks=head + tail)


async def _streamed_message(
    proxy: Proxy, script: ScriptedUpstream, redis_client: aioredis.Redis, **fields: Any
) -> tuple[int, dict[str, str]]:
    """One streamed Messages call (``fields`` added to its body): its status and ledger entry."""
    body = {
        "model": "claude-x",
        "max_tokens": 1000,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body),
        headers={"anthropic-version": "2023-06-01"},
    )  # fmt: skip
    (entry,) = reply.new_entries
    return reply.status, entry


async def _cache_priced(make_proxy: ProxyFactory, script: ScriptedUpstream) -> Proxy:
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    return await make_proxy(
        upstreams={"anthropic": upstream},
        models={"claude-*": {"upstream": "anthropic", "price_per_million": CACHE_PRICES}},
    )


@pytest.mark.parametrize(
    ("delta_usage", "billed"),
    [
        # Anthropic repeats the input counts (cumulative): the same figures.
        ({**CACHED_START, "output_tokens": 42}, ("160", "100", "50", "30")),
        # Server tools read more input during the turn: the final, larger figures.
        (
            {"input_tokens": 2500, "cache_read_input_tokens": 300, "cache_creation_input_tokens": 50,
             "output_tokens": 42, "server_tool_use": {"web_search_requests": 1}},
            ("2850", "300", "50", "30"),
        ),
        # A placeholder 0 (upstreams that tell the input in message_start alone): message_start's.
        (
            {"input_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
             "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
             "output_tokens": 42},
            ("160", "100", "50", "30"),
        ),
    ],
    ids=["repeated", "grown", "zeros"],
)  # fmt: skip
async def test_an_anthropic_streams_input_is_its_last_cumulative_count_a_zero_placeholder_aside(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    delta_usage: dict[str, Any],
    billed: tuple[str, ...],
) -> None:
    """message_delta's usage is cumulative. An upstream whose message_delta says input 0 (SGLang's
    Anthropic API did; gateways do) had its whole input billed as 0: 160 tokens, 315 of the call's
    945 micro-units, gone from the bill."""
    proxy = await _cache_priced(make_proxy, script)
    end = {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": delta_usage}
    script.plan = _anthropic_stream([_sse_ev("message_delta", end), _sse_ev("message_stop", {})])
    client = claude(proxy)
    async with client.messages.stream(
        model="claude-x", max_tokens=1000, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = await stream.get_final_message()
    await client.close()
    assert final.usage.output_tokens == 42
    entry = await the_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "42")
    got = tuple(
        entry[k]
        for k in (
            "input_tokens",
            "cached_input_tokens",
            "cache_creation_input_tokens",
            "cache_creation_1h_input_tokens",
        )
    )
    assert got == billed, entry
    fresh, read, written, hour = (int(n) for n in billed)
    fresh -= read + written
    exact = (
        fresh * 3_000_000 + read * 300_000 + (written - hour) * 3_750_000 + hour * 6_000_000 + 42 * 15_000_000
    )
    assert entry["cost_micros"] == str(-(-exact // 10**6)), entry


async def test_an_anthropic_stream_cut_after_a_message_delta_before_its_stop_is_billed_its_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A turn may send several message_delta events (server tools); the one with the stop reason
    carries the final output count. Cut after an earlier one, the stream was billed that one's 30
    output tokens as final, where a cut stream's output is its reserve's until the final count
    came (README, faults)."""
    proxy = await _cache_priced(make_proxy, script)
    early = {
        "delta": {"stop_reason": None, "stop_sequence": None},
        "usage": {"input_tokens": 2000, "output_tokens": 30},
    }
    script.plan = _anthropic_stream([_sse_ev("message_delta", early)])  # then the connection ends
    _, entry = await _streamed_message(proxy, script, redis_client)
    assert entry["outcome"] == "upstream_error", entry
    # The input the provider told stands (2,000 + 150 cache reads and writes); the output is the reserve's.
    assert (entry["input_tokens"], entry["output_tokens"], entry["usage_source"]) == (
        "2150",
        "1000",
        "reserve",
    )


@pytest.mark.parametrize(
    "tail",
    [
        # The usage, then the stop reason in a message_delta of its own.
        [
            _sse_ev("message_delta", {"delta": {"stop_reason": None}, "usage": {"output_tokens": 42}}),
            _sse_ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
        ],
        # No stop reason at all (a gateway's translation that maps none).
        [_sse_ev("message_delta", {"delta": {"stop_reason": None}, "usage": {"output_tokens": 42}})],
    ],
    ids=["stop-reason-later", "no-stop-reason"],
)
async def test_an_anthropic_stream_that_ends_with_message_stop_is_billed_its_last_output_count(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, tail: list[bytes]
) -> None:
    """message_stop ends the answer: the last message_delta's output count is final, whether its
    stop reason came with it, after it or never. A thinking call had been billed its reserved
    output (1,000 tokens, not the 42 the provider told) for a stream that came whole."""
    proxy = await _cache_priced(make_proxy, script)
    script.plan = _anthropic_stream([*tail, _sse_ev("message_stop", {})])
    thinking = {"type": "enabled", "budget_tokens": 500}
    status, entry = await _streamed_message(proxy, script, redis_client, thinking=thinking)
    assert status == 200
    billed = (entry["outcome"], entry["usage_source"], entry["output_tokens"])
    assert billed == ("ok", "provider", "42"), entry


async def test_an_anthropic_stream_s_input_estimate_is_replaced_by_the_final_count(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A server that translates another API's stream (NVIDIA Dynamo's /v1/messages) tells an
    estimate of the whole prompt in message_start and the provider's counts in message_delta:
    1,200 tokens, 1,000 of them cache reads. Its lower input_tokens (200, the uncached part) is
    no placeholder: kept at 1,200, the cache reads were billed twice, once at the full price."""
    proxy = await _cache_priced(make_proxy, script)
    start = {"input_tokens": 1200, "output_tokens": 0, "cache_creation_input_tokens": 0}
    final = {"input_tokens": 200, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 0}
    end = {"delta": {"stop_reason": "end_turn"}, "usage": {**final, "output_tokens": 42}}
    tail = [_sse_ev("message_delta", end), _sse_ev("message_stop", {})]
    script.plan = _anthropic_stream(tail, start_usage=start)
    _, entry = await _streamed_message(proxy, script, redis_client)
    billed = (entry["input_tokens"], entry["cached_input_tokens"], entry["output_tokens"])
    assert billed == ("1200", "1000", "42"), entry
    # 200 x 3 + 1,000 x 0.30 + 42 x 15, in micro-units.
    assert entry["cost_micros"] == str(600 + 300 + 630), entry


def test_an_anthropic_error_carries_anthropics_own_code_only() -> None:
    """An error code Anthropic has too (a thread it does not hold) is told where its SDK reads it
    (``error.details.error_code``, the exception's ``error_code``, on which a client replays the
    conversation); the proxy's OpenAI codes (``budget_exceeded``) are not Anthropic's to tell."""
    messages = DIALECTS["messages"]
    told = json.loads(
        messages.error_body("gone", "invalid_request_error", code="thread_not_found", status=404)
    )
    assert told == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "gone",
            "details": {"error_code": "thread_not_found"},
        },
    }
    other = json.loads(messages.error_body("over", "insufficient_quota", code="budget_exceeded", status=429))
    assert other == {"type": "error", "error": {"type": "rate_limit_error", "message": "over"}}
