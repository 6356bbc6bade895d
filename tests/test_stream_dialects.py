"""Streams of the Responses and Anthropic APIs, and odd framing of any stream, found by a hunt:
each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import anthropic
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from proxy.state import STATE
from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, scripted_upstreams, send
from tests.test_contract_edges import read_until_then_leave
from tests.test_fault_matrix import only_entry

AUTH = {"Authorization": f"Bearer {KEY_A}"}
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
LEDGER = "lbp:{team-a}:ledger"


async def proxy_for(make_proxy: ProxyFactory, script: ScriptedUpstream, **overrides: Any) -> Proxy:
    upstreams = {
        **scripted_upstreams(script.base_url),
        "anthropic": {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"},
    }
    models = {"claude-*": {"upstream": "anthropic"}, "*": {"upstream": "openai"}}
    return await make_proxy(upstreams=upstreams, models=models, **overrides)


def ev(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj}, separators=(',', ':'))}\n\n".encode()


def chunk(choices: list[Any], usage: Any = None) -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices}
    return dumps({**obj, "usage": usage})


CONTENT = chunk([{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}])
FINISH = chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])
USAGE = chunk([], {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})
CHAT = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 10,
}

RESPONSE = {"id": "resp_1", "object": "response", "model": "gpt-4o-mini", "output": []}
RESPONSES_BODY = {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 500, "stream": True}
MESSAGE_START = ev(
    "message_start",
    {"message": {"id": "m", "type": "message", "role": "assistant", "content": [], "model": "claude-x",
                 "stop_reason": None, "usage": {"input_tokens": 700, "output_tokens": 1}}},
)  # fmt: skip
ANTHROPIC_BODY = {
    "model": "claude-x",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 500,
    "stream": True,
}


# -- [DONE] is how chat and completions streams end, not Responses or Anthropic streams ---------


async def test_done_does_not_end_a_responses_stream_as_complete(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # Was: ok on the counted text (3 tokens against a reserve of 500), the [DONE] swallowed.
    proxy = await proxy_for(make_proxy, script)
    events = [
        ev("response.created", {"sequence_number": 0, "response": {**RESPONSE, "status": "in_progress"}}),
        ev("response.output_text.delta", {"sequence_number": 1, "item_id": "m", "delta": "Hello world"}),
        b"data: [DONE]\n\n",
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=events)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/responses", dumps(RESPONSES_BODY))
    (entry,) = reply.new_entries
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry
    assert b"data: [DONE]\n\n" in reply.body  # passed on as it came


async def test_done_does_not_end_an_anthropic_stream_as_complete(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script)
    delta = ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello"}})
    block = ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    script.plan = Plan(
        content_type="text/event-stream", chunks=[MESSAGE_START, block, delta, b"data: [DONE]\n\n"]
    )
    body = dumps(ANTHROPIC_BODY)
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", body, headers=ANTHROPIC_HEADERS
    )
    (entry,) = reply.new_entries
    assert entry["outcome"] == "upstream_error", entry


async def test_done_with_trailing_space_ends_a_chat_stream(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # Was upstream_error, the "[DONE] " passed on before the billing comment.
    proxy = await proxy_for(make_proxy, script)
    chunks = [b"data: " + event + b"\n\n" for event in (CONTENT, FINISH, USAGE)] + [b"data: [DONE] \n\n"]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(CHAT))
    (entry,) = reply.new_entries
    assert entry["outcome"] == "ok", entry
    assert reply.body.endswith(b"data: [DONE]\n\n") and reply.body.count(b"[DONE]") == 1


# -- calls and other output that is not text ----------------------------------------------------


async def test_a_responses_custom_tool_call_is_not_held_to_json(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script, policy={"on_invalid_json": "reject"})
    item = {
        "type": "custom_tool_call",
        "id": "ctc_1",
        "call_id": "call_1",
        "name": "shell",
        "input": "ls -la",
    }
    answer = {
        **RESPONSE,
        "status": "completed",
        "output": [item],
        "usage": {"input_tokens": 20, "output_tokens": 7},
    }
    events = [
        ev(
            "response.output_item.added",
            {"sequence_number": 0, "output_index": 0, "item": {**item, "input": ""}},
        ),
        ev(
            "response.custom_tool_call_input.delta",
            {"sequence_number": 1, "item_id": "ctc_1", "delta": "ls -la"},
        ),
        ev("response.completed", {"sequence_number": 2, "response": answer}),
    ]
    schema = {"type": "json_schema", "name": "a", "schema": {"type": "object"}}
    body = {**RESPONSES_BODY, "tools": [{"type": "custom", "name": "shell"}], "text": {"format": schema}}
    script.plan = Plan(content_type="text/event-stream", chunks=events)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/responses", dumps(body))
    assert reply.new_entries[0]["outcome"] == "ok", reply.describe()
    script.plan = Plan(chunks=[dumps(answer)])
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/responses", dumps({**body, "stream": False})
    )
    assert reply.status == 200, reply.describe()


async def test_streamed_reasoning_summaries_are_counted_when_the_client_leaves(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # Cancel bills the prompt and the streamed text counted: it counted 0 output tokens for
    # 1,600 tokens of reasoning summary.
    proxy = await proxy_for(make_proxy, script, policy={"on_client_disconnect": "cancel"})
    summary = " ".join(f"step{i} considered carefully" for i in range(400))
    live = {**RESPONSE, "status": "in_progress"}
    first = ev("response.created", {"sequence_number": 0, "response": live}) + ev(
        "response.reasoning_summary_text.delta", {"sequence_number": 1, "item_id": "rs_1", "delta": summary}
    )
    more = ev(
        "response.reasoning_summary_text.delta", {"sequence_number": 2, "item_id": "rs_1", "delta": " more"}
    )
    script.plan = Plan(content_type="text/event-stream", chunks=[first, more, more], delay_s=0.5)
    body = {**RESPONSES_BODY, "max_output_tokens": 4000}  # the provider writes no more than that
    await read_until_then_leave(proxy, "/v1/responses", body, b"step399")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected"
    assert int(entry["output_tokens"]) >= 1000, entry


async def test_a_chat_custom_tool_call_is_counted_without_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script)
    command = "grep -rn TODO src/ | " * 200  # about 4 KB
    call = {"index": 0, "id": "call_1", "type": "custom", "custom": {"name": "shell", "input": command}}
    chunks = [
        b"data: " + chunk([{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]) + b"\n\n",
        b"data: " + chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]) + b"\n\n",
        b"data: [DONE]\n\n",  # no usage chunk
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    body = {**CHAT, "max_tokens": 2000, "tools": [{"type": "custom", "custom": {"name": "shell"}}]}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert int(entry["output_tokens"]) >= len(command) // 8, entry  # was 0


# -- framing ----------------------------------------------------------------------------------


async def test_the_other_fields_of_a_stripped_event_are_kept(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script)
    chunks = [b"id: 1\ndata: " + CONTENT + b"\n\n", b"id: 2\nretry: 500\ndata: " + FINISH + b"\n\n"]
    chunks += [b"id: 3\ndata: " + USAGE + b"\n\n", b"data: [DONE]\n\n"]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(CHAT))
    # The usage-only event is dropped with its id; the others keep theirs (were dropped).
    assert reply.body.count(b"id: ") == 2 and b"id: 2\nretry: 500\ndata: " in reply.body, reply.body
    assert b'"usage"' not in reply.body


async def test_a_byte_order_mark_before_the_first_event(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script)
    chunks = [b"\xef\xbb\xbfdata: " + CONTENT + b"\n\n"] + [b"data: " + e + b"\n\n" for e in (FINISH, USAGE)]
    script.plan = Plan(content_type="text/event-stream", chunks=[*chunks, b"data: [DONE]\n\n"])
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(CHAT))
    assert b'"usage"' not in reply.body  # the first event was neither observed nor stripped
    assert reply.new_entries[0]["outcome"] == "ok"


CHAT_USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}


def chat_event(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
    return b"data: " + chunk([{"index": 0, "delta": delta, "finish_reason": finish}], usage) + b"\n\n"


async def read_with_sdk(base_url: str) -> tuple[str, str | None]:
    """What the OpenAI SDK makes of a chat stream: its text, and what it raised."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY_A, max_retries=0)
    text, error = "", None
    try:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    except Exception as err:  # what the SDK raises is the point
        error = repr(err)
    finally:
        await client.close()
    return text, error


async def test_the_billing_comment_is_no_event_to_an_sdk_that_saw_an_event_id(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """SSE keeps the last event id, and then a block holding only a comment is an event: the SDK
    parsed the billing comment's empty data as JSON and raised."""
    proxy = await proxy_for(make_proxy, script)
    events = [
        chat_event({"role": "assistant", "content": ""}),
        chat_event({"content": "Hel"}),
        chat_event({"content": "lo"}),
        chat_event({}, "stop"),
        b"data: " + chunk([], CHAT_USAGE) + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    script.plan = Plan(
        content_type="text/event-stream", chunks=[b"id: %d\n" % i + e for i, e in enumerate(events)]
    )
    assert await read_with_sdk(script.base_url) == ("Hello", None)
    assert await read_with_sdk(proxy.url + "/v1") == ("Hello", None)
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "2")


@pytest.mark.parametrize("tail", [b": keep-alive\n", b": keep-alive", b": ping\nretry: 3000"])
async def test_a_stream_without_done_ending_in_a_block_without_data_is_a_whole_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, tail: bytes
) -> None:
    """A server that sends no [DONE] ends its body in a keep-alive comment (or a retry field)
    whose blank line never came: a block with no data dispatches nothing (the SSE spec),
    the SDK has the whole answer. It was billed upstream_error, with an error event the SDK
    raised on (the SSE framing hunt)."""
    proxy = await proxy_for(make_proxy, script)
    finished = [
        chat_event({"role": "assistant", "content": "Hel"}),
        chat_event({"content": "lo"}),
        chat_event({}, "stop", usage=CHAT_USAGE),
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=[*finished, tail])
    assert await read_with_sdk(proxy.url + "/v1") == ("Hello", None)
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "2")


async def test_a_stream_without_done_reaches_the_sdk_as_directly(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script)
    running = {**CHAT_USAGE, "completion_tokens": 1}
    finished = [
        chat_event({"role": "assistant", "content": "Hel"}, usage=running),  # usage on every chunk
        chat_event({"content": "lo"}, usage=CHAT_USAGE),
        chat_event({}, "stop", usage=CHAT_USAGE),
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=finished)  # no [DONE]
    assert await read_with_sdk(script.base_url) == ("Hello", None)
    assert await read_with_sdk(proxy.url + "/v1") == ("Hello", None)
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "2")
    # Cut cleanly before its choice finished: not a whole answer, and the SDK is told.
    await redis_client.delete(LEDGER)
    script.plan = Plan(content_type="text/event-stream", chunks=finished[:2])
    text, error = await read_with_sdk(proxy.url + "/v1")
    assert text == "Hello" and error is not None and "upstream_error" in error
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "provider")


async def test_an_empty_finish_reason_does_not_finish_a_stream_cut_short(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Older Ollama and SGLang send "finish_reason": "" on every content chunk: no finish."""
    proxy = await proxy_for(make_proxy, script)
    pieces = [
        b"data: " + chunk([{"index": 0, "delta": {"content": t}, "finish_reason": ""}]) + b"\n\n"
        for t in "ab"
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=pieces)
    body = {**CHAT, "stream": True}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert entry["outcome"] == "upstream_error", entry
    assert b"event: error" in reply.body


class CutAfterTheEnd(ScriptedUpstream):
    """Sends its plan, then drops the connection ``linger_s`` later without ending the chunked
    body."""

    linger_s = 0.05

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.read())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in self.plan.chunks:
            await response.write(piece)
        await asyncio.sleep(self.linger_s)
        assert request.transport is not None
        request.transport.close()
        return response


@pytest.mark.parametrize("after", [b"", b"event: keepalive\ndata: {"], ids=["nothing", "part-of-an-event"])
async def test_a_connection_broken_past_the_answers_end_takes_nothing_from_it(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, after: bytes
) -> None:
    """The client had the whole answer and no error; the ledger said upstream_error."""
    cut = CutAfterTheEnd()
    await cut.start()
    try:
        proxy = await proxy_for(make_proxy, cut)
        done = {**RESPONSE, "status": "completed", "usage": {"input_tokens": 100, "output_tokens": 20}}
        cut.plan = Plan(
            content_type="text/event-stream",
            chunks=[
                ev(
                    "response.created",
                    {"sequence_number": 0, "response": {**RESPONSE, "status": "in_progress"}},
                ),
                ev("response.completed", {"sequence_number": 1, "response": done}),
                after,
            ],
        )
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0)
        stream = await client.responses.create(model="gpt-4o-mini", input="hi", stream=True)
        assert [event.type async for event in stream] == ["response.created", "response.completed"]
        await client.close()
        entry = await only_entry(redis_client)
        assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "20")
    finally:
        await cut.close()


COMPACTED = {
    "input_tokens": 23000,
    "output_tokens": 1000,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 500,
    "iterations": [
        {"type": "compaction", "input_tokens": 180000, "output_tokens": 3500,
         "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        {"type": "message", "input_tokens": 23000, "output_tokens": 1000,
         "cache_creation_input_tokens": 0, "cache_read_input_tokens": 500},
    ],
}  # fmt: skip


async def test_a_compaction_step_is_billed_beside_the_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Anthropic's top-level usage leaves the compaction iteration out (its 180,000 tokens read):
    it was never billed."""
    proxy = await proxy_for(make_proxy, script)
    answer = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "stop_reason": "end_turn",
        "stop_sequence": None, "usage": COMPACTED,
        "content": [{"type": "compaction", "content": "Summary."}, {"type": "text", "text": "Go on."}],
    }  # fmt: skip
    script.plan = Plan(chunks=[dumps(answer)])
    body = {"model": "claude-x", "max_tokens": 4096, "messages": [{"role": "user", "content": "go on"}]}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body))
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    assert (entry["input_tokens"], entry["cached_input_tokens"], entry["output_tokens"]) == (
        "203500",
        "500",
        "4500",
    )
    # Streamed: the iterations come with message_delta's usage.
    await redis_client.delete(LEDGER)
    start = {
        **answer,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": 23000, "output_tokens": 1},
    }
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[
            ev("message_start", {"message": start}),
            ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Go on."}}),
            ev("content_block_stop", {"index": 0}),
            ev(
                "message_delta",
                {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": COMPACTED},
            ),
            ev("message_stop", {}),
        ],
    )
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    async with client.messages.stream(**body) as stream:  # type: ignore[arg-type]
        await stream.get_final_message()
    await client.close()
    entry = await only_entry(redis_client)
    assert (entry["input_tokens"], entry["output_tokens"]) == ("203500", "4500"), entry


async def test_anthropic_fast_mode_is_priced_as_a_tier_of_its_own(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Fast mode costs six times the standard price: it was forwarded and billed at the
    standard price. Unpriced, it is refused as an unpriced service tier is."""
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    standard = {"input": "3", "output": "15"}
    fast = {"input": "18", "output": "90"}
    body = {"model": "claude-x", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    usage = {"input_tokens": 1000, "output_tokens": 100, "service_tier": "standard", "speed": "fast"}
    answer = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "stop_reason": "end_turn",
        "stop_sequence": None, "usage": usage, "content": [{"type": "text", "text": "Quick."}],
    }  # fmt: skip
    unpriced = await make_proxy(
        upstreams={"anthropic": upstream},
        models={"claude-*": {"upstream": "anthropic", "price_per_million": standard}},
    )
    reply = await send(
        unpriced, lambda: script.received, redis_client, "/v1/messages", dumps({**body, "speed": "fast"})
    )
    assert (reply.status, reply.upstream_calls) == (400, 0), reply.describe()
    assert json.loads(reply.body)["error"]["message"].startswith("The service tier 'fast'")
    # Priced: billed at fast mode's prices when the answer says it ran so; a call that does not
    # ask for it is reserved at the standard prices (fast mode serves only those that ask).
    models = {
        "claude-*": {"upstream": "anthropic", "price_per_million": standard, "service_tiers": {"fast": fast}}
    }
    # Room in the run, after the fast call's 27,000, for a second call at the standard prices
    # (about 1,530 reserved) but not at fast mode's (about 9,180).
    room = {"cost_usd": "0.0345"}
    proxy = await make_proxy(
        upstreams={"anthropic": upstream}, models=models, tiers={"standard": {"run": room}}
    )
    script.plan = Plan(chunks=[dumps(answer)])
    headers = {"X-Run-Id": "one-run"}
    fast_body = dumps({**body, "speed": "fast"})
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", fast_body, headers=headers
    )
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    assert (entry["service_tier"], entry["cost_micros"]) == ("fast", str(1000 * 18 + 100 * 90))
    plain = {**answer, "usage": {"input_tokens": 1000, "output_tokens": 100, "service_tier": "standard"}}
    script.plan = Plan(chunks=[dumps(plain)])
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body), headers=headers
    )
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    assert entry["cost_micros"] == str(1000 * 3 + 100 * 15)


@pytest.mark.parametrize(
    "trailer",
    [b": keep-alive\n\n", b'data: {"error": {"message": "late", "type": "server_error"}}\n\n'],
    ids=["keepalive", "error"],
)
async def test_what_an_upstream_sends_after_done_never_reaches_the_client(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, trailer: bytes
) -> None:
    """The SDK stops at [DONE]; the proxy writes its own last, so what came after the
    upstream's went out before it: read by the SDK (an empty event once it has seen an id, an
    error) and billed as a failure."""
    proxy = await proxy_for(make_proxy, script)
    events = [
        chat_event({"role": "assistant", "content": "Hello"}),
        chat_event({}, "stop"),
        b"data: " + chunk([], CHAT_USAGE) + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    with_ids = [b"id: %d\n" % i + e for i, e in enumerate(events)]
    script.plan = Plan(content_type="text/event-stream", chunks=[b"".join(with_ids) + trailer])
    assert await read_with_sdk(script.base_url) == ("Hello", None)
    assert await read_with_sdk(proxy.url + "/v1") == ("Hello", None)
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry
    # In a read of its own, the same.
    await redis_client.delete(LEDGER)
    script.plan = Plan(content_type="text/event-stream", chunks=[*with_ids, trailer])
    assert await read_with_sdk(proxy.url + "/v1") == ("Hello", None)
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "ok", entry


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_streamed_chat_reasoning_is_counted_when_the_client_leaves(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, field: str
) -> None:
    """OpenAI-compatible reasoning models (DeepSeek, vLLM, SGLang: delta.reasoning_content;
    OpenRouter, Groq, Ollama: delta.reasoning) stream their thinking before any content. Cancel
    bills the prompt and the streamed text counted: the thinking is output the provider bills."""
    proxy = await proxy_for(make_proxy, script, policy={"on_client_disconnect": "cancel"})
    thinking = " ".join(f"step{i} considered carefully" for i in range(400))
    role = {"role": "assistant", "content": None}
    first = (
        b"data: " + chunk([{"index": 0, "delta": {**role, field: thinking}, "finish_reason": None}]) + b"\n\n"
    )
    more = b"data: " + chunk([{"index": 0, "delta": {field: " more"}, "finish_reason": None}]) + b"\n\n"
    script.plan = Plan(content_type="text/event-stream", chunks=[first, more, more], delay_s=0.5)
    body = {**CHAT, "max_tokens": 4000}
    await read_until_then_leave(proxy, "/v1/chat/completions", body, b"step399")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected"
    assert int(entry["output_tokens"]) >= 1000, entry  # was 0


@pytest.mark.parametrize(
    "how",
    [
        "reasoning_effort",
        "model",
        "neither",
        "openrouter-budget",
        "openrouter-effort",
        "openrouter-off",
        "gemini-budget",
        "gemini-off",
        "anthropic-thinking",
        "anthropic-thinking-off",
    ],
)
async def test_a_chat_stream_that_reasons_unseen_is_billed_its_reserve_when_the_client_leaves(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, how: str
) -> None:
    """OpenAI's reasoning models bill reasoning tokens they never stream, all written before the
    first text. Cancel counted the prompt and the streamed text: 1 output token for an answer
    that may have thought thousands. Asked for (reasoning_effort), or a model the operator says
    reasons unasked (o-series, gpt-5): its reserve. Neither: the text counted, as before."""
    models = {"o4-mini": {"upstream": "openai", "hidden_reasoning": how == "model"}}
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url),
        models=models,
        policy={"on_client_disconnect": "cancel"},
    )
    first = b"data: " + chunk([{"index": 0, "delta": {"role": "assistant", "content": "Hello"}}]) + b"\n\n"
    more = b"data: " + chunk([{"index": 0, "delta": {"content": " there"}}]) + b"\n\n"
    script.plan = Plan(content_type="text/event-stream", chunks=[first, more, more], delay_s=0.5)
    body = {**CHAT, "model": "o4-mini", "max_tokens": 4000}
    if how == "reasoning_effort":
        body["reasoning_effort"] = "high"
    # OpenRouter's unified reasoning parameter (exclude: the reasoning is hidden, and billed).
    openrouter = {
        "openrouter-budget": {"max_tokens": 2000, "exclude": True},
        "openrouter-effort": {"effort": "high"},
        "openrouter-off": {"enabled": False, "effort": "high"},
    }
    if how in openrouter:
        body["reasoning"] = openrouter[how]
    if how.startswith("gemini"):
        # Gemini's OpenAI-compatible thinking switch, as the openai SDK sends it (its thoughts
        # are billed, never streamed): a budget of 0 turns thinking off.
        budget = 0 if how == "gemini-off" else 2000
        body["extra_body"] = {"google": {"thinking_config": {"thinking_budget": budget}}}
    if how.startswith("anthropic"):
        # Anthropic's OpenAI-compatible endpoint, as the openai SDK sends its extra_body: Claude
        # thinks, billed, and that endpoint never returns the thinking (the routing hunt).
        kind = "disabled" if how.endswith("-off") else "enabled"
        body["thinking"] = {"type": kind, "budget_tokens": 2000} if kind == "enabled" else {"type": kind}
    await read_until_then_leave(proxy, "/v1/chat/completions", body, b"Hello")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected", entry
    if how in ("neither", "openrouter-off", "gemini-off", "anthropic-thinking-off"):
        assert entry["usage_source"] != "reserve" and int(entry["output_tokens"]) < 10, entry
    else:
        assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "4000"), entry


@pytest.mark.parametrize("detail", ["reasoning.encrypted", "reasoning.summary", "reasoning.text"])
async def test_openrouter_reasoning_details_without_its_text_are_billed_the_reserve_when_the_client_leaves(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, detail: str
) -> None:
    """OpenRouter streams a model's reasoning as reasoning_details: encrypted (nothing to count)
    or a summary of what it bills. Cancel counted the streamed text: 1 output token for an answer
    that thought thousands. Sent as text (reasoning.text, with delta.reasoning), it is counted."""
    proxy = await proxy_for(make_proxy, script, policy={"on_client_disconnect": "cancel"})
    item = {"type": detail, "id": "rs_1", "format": "openai-responses-v1", "index": 0}
    item |= {"data": "gAAAAB" + "x" * 200} if detail == "reasoning.encrypted" else {}
    item |= {"summary": "Thought about it."} if detail == "reasoning.summary" else {}
    delta: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_details": [item]}
    if detail == "reasoning.text":
        item["text"] = delta["reasoning"] = "Thought about it."
    first = b"data: " + chunk([{"index": 0, "delta": delta, "finish_reason": None}]) + b"\n\n"
    text = b"data: " + chunk([{"index": 0, "delta": {"content": "Hello"}}]) + b"\n\n"
    script.plan = Plan(content_type="text/event-stream", chunks=[first + text, text, text], delay_s=0.5)
    await read_until_then_leave(proxy, "/v1/chat/completions", {**CHAT, "max_tokens": 4000}, b"Hello")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected", entry
    if detail == "reasoning.text":
        assert entry["usage_source"] != "reserve" and int(entry["output_tokens"]) < 20, entry
    else:
        assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "4000"), entry  # was 1


@pytest.mark.parametrize("thinking", [True, False])
async def test_an_anthropic_stream_that_thinks_is_billed_its_reserved_output_when_the_client_leaves(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, thinking: bool
) -> None:
    """Claude 4 streams a summary of its thinking and bills the whole of it: cancel counted the
    summary. With thinking on, the output is the reserve's; message_start's input stands."""
    proxy = await proxy_for(make_proxy, script, policy={"on_client_disconnect": "cancel"})
    kind = "thinking" if thinking else "text"
    block = ev("content_block_start", {"index": 0, "content_block": {"type": kind, kind: ""}})
    piece = (
        {"type": "thinking_delta", "thinking": "Let me see"}
        if thinking
        else {"type": "text_delta", "text": "Let me see"}
    )
    delta = ev("content_block_delta", {"index": 0, "delta": piece})
    script.plan = Plan(
        content_type="text/event-stream", chunks=[MESSAGE_START + block + delta, delta, delta], delay_s=0.5
    )
    body: dict[str, Any] = {**ANTHROPIC_BODY, "max_tokens": 4000}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 2000}
    await read_until_then_leave(proxy, "/v1/messages", body, b"Let me see")
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["input_tokens"]) == ("client_disconnected", "700"), entry
    if thinking:
        assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "4000"), entry
    else:
        assert entry["usage_source"] != "reserve" and int(entry["output_tokens"]) < 10, entry


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_chat_reasoning_is_counted_without_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, field: str
) -> None:
    proxy = await proxy_for(make_proxy, script)
    thinking = "I weigh every option in turn. " * 100  # 3,000 characters
    chunks = [
        b"data: " + chunk([{"index": 0, "delta": {"role": "assistant", field: thinking}}]) + b"\n\n",
        b"data: " + chunk([{"index": 0, "delta": {"content": "Yes."}}]) + b"\n\n",
        b"data: " + chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]) + b"\n\n",
        b"data: [DONE]\n\n",  # no usage chunk
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    body = {**CHAT, "max_tokens": 2000}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert entry["outcome"] == "ok", entry
    assert int(entry["output_tokens"]) >= len(thinking) // 8, entry  # was 1


class _LingeringUpstream(ScriptedUpstream):
    """Sends its plan, then keeps the body open ``linger_s`` before ending it."""

    linger_s = 30.0  # far past what a loaded machine adds to a call

    def __init__(self) -> None:
        super().__init__()
        self.peers: list[Any] = []  # the proxy's address, per call: one per kept-alive connection

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.read())
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in self.plan.chunks:
            await response.write(piece)
        await asyncio.sleep(self.linger_s)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response


async def test_the_sdk_has_done_as_soon_as_the_upstream_sent_it(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """Directly, the SDK's loop ends at the upstream's [DONE]; through the proxy it ended only
    once the upstream closed its body (up to timeout_s later: 600 s by default), the [DONE]
    held back behind a read whose bytes are all dropped."""
    upstream = _LingeringUpstream()
    await upstream.start()
    try:
        proxy = await proxy_for(make_proxy, upstream)
        events = [
            chat_event({"role": "assistant", "content": "Hel"}),
            chat_event({"content": "lo"}),
            chat_event({}, "stop"),
            b"data: " + chunk([], CHAT_USAGE) + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        upstream.plan = Plan(content_type="text/event-stream", chunks=events)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await read_with_sdk(upstream.base_url) == ("Hello", None)
        direct_s = loop.time() - started
        started = loop.time()
        assert await read_with_sdk(proxy.url + "/v1") == ("Hello", None)
        proxied_s = loop.time() - started
        assert direct_s < 15
        assert proxied_s < 15, proxied_s  # was 30 s: the upstream's linger
        entry = await only_entry(redis_client)
        assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "2")
    finally:
        await upstream.close()


async def test_a_stream_ended_by_done_leaves_its_upstream_connection_for_the_next_call(
    make_proxy: ProxyFactory,
) -> None:
    """The relay stops reading at [DONE] (see above) once the body's end has come, when it
    comes soon after in a read of its own, as it may from a provider: a connection closed with
    its last chunk unread is a new connection (a TLS handshake, with a real provider) for every
    stream."""
    upstream = _LingeringUpstream()
    upstream.linger_s = 0.05  # the body's end, a moment after [DONE]
    await upstream.start()
    try:
        proxy = await proxy_for(make_proxy, upstream)
        events = [
            chat_event({"role": "assistant", "content": "Hel"}),
            chat_event({}, "stop"),
            b"data: " + chunk([], CHAT_USAGE) + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        upstream.plan = Plan(content_type="text/event-stream", chunks=events)
        for _ in range(3):
            assert await read_with_sdk(proxy.url + "/v1") == ("Hel", None)
        assert len(upstream.peers) == 3 and len(set(upstream.peers)) == 1, upstream.peers
    finally:
        await upstream.close()


async def test_the_wait_for_the_body_end_after_done_is_not_proxy_overhead(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """After [DONE] the relay waits up to 0.25 s for the upstream to end its body: that is the
    upstream's time, not the proxy's (llm_proxy_proxy_overhead_seconds excludes the upstream)."""
    upstream = _LingeringUpstream()
    await upstream.start()
    try:
        proxy = await proxy_for(make_proxy, upstream)
        upstream.plan.content_type = "text/event-stream"
        upstream.plan.chunks = [
            chat_event({"role": "assistant", "content": "Hel"}),
            chat_event({}, "stop"),
            b"data: " + chunk([], CHAT_USAGE) + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        for _ in range(4):
            assert await read_with_sdk(proxy.url + "/v1") == ("Hel", None)
        metrics = proxy.app[STATE].metrics
        for _ in range(50):  # recorded once the answer has gone
            if sum(metrics.overhead.labels().counts) == 4:
                break
            await asyncio.sleep(0.02)
        overhead = metrics.overhead.labels()
        assert sum(overhead.counts) == 4
        # Counted as the proxy's, the drain's wait puts every call at 0.25 s at least: a loaded
        # machine may slow one call past 0.1 s of the proxy's own time, hardly all four.
        assert sum(overhead.counts[: overhead.bounds.index(0.1) + 1]), overhead.counts
    finally:
        await upstream.close()


async def test_a_provider_error_event_carrying_usage_reaches_a_client_that_did_not_ask_for_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A mid-stream error event (no choices) that carries the usage so far is the provider's
    failure, not the usage-only chunk: its usage is cut out for a client that did not ask, the
    error itself must reach the SDK (which raises it), not be dropped whole."""
    proxy = await proxy_for(make_proxy, script)
    error = b'{"error":{"message":"overloaded","type":"server_error","code":"overloaded"},"usage":'
    error += b'{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}'
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[chat_event({"role": "assistant", "content": "Hel"}), b"data: " + error + b"\n\n"],
    )
    text, raised = await read_with_sdk(proxy.url + "/v1")
    assert text == "Hel"
    assert raised is not None and "overloaded" in raised, raised  # now: None, a clean end
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "upstream_error", entry


@pytest.mark.parametrize("stream", [True, False])
async def test_an_openrouter_choice_that_ends_in_error_is_an_upstream_error(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """OpenRouter, on HTTP 200: a choice that failed mid-answer ends with finish_reason "error"
    (its error on the choice). Was ok, billed on the few tokens counted (a stream without
    usage) or shown: now upstream_error at its reserve, the answer passed on as it came."""
    proxy = await proxy_for(make_proxy, script)
    failed = {"index": 0, "finish_reason": "error", "native_finish_reason": "error",
              "error": {"code": 502, "message": "Provider disconnected"}}  # fmt: skip
    if stream:
        chunks = [
            b": OPENROUTER PROCESSING\n\n",
            chat_event({"role": "assistant", "content": "Hel"}),
            b"data: " + chunk([{**failed, "delta": {"content": ""}}]) + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    else:
        answer = {"id": "gen-1", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{**failed, "message": {"role": "assistant", "content": "Hel"}}]}  # fmt: skip
        chunks = [dumps(answer)]
        script.plan = Plan(chunks=chunks)
    body: dict[str, Any] = {**CHAT, "stream": stream, "max_tokens": 500}
    if stream:  # its events' "usage": null kept: every byte as it came
        body["stream_options"] = {"include_usage": True}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry
    if stream:
        assert reply.body.startswith(b"".join(chunks[:3])) and reply.body.endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(reply.body) == json.loads(chunks[0])


async def cut_after_message_start(
    proxy: Proxy, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> dict[str, str]:
    """A Messages stream cut after its first text: message_start said 700 input tokens and 5,000
    cache reads. The call's ledger entry."""
    usage = {"input_tokens": 700, "cache_read_input_tokens": 5000, "output_tokens": 1}
    start = ev(
        "message_start",
        {"message": {"id": "m", "type": "message", "role": "assistant", "content": [],
                     "model": "claude-x", "stop_reason": None, "usage": usage}},
    )  # fmt: skip
    block = ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    delta = ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello"}})
    script.plan = Plan(content_type="text/event-stream", chunks=[start, block, delta])  # cut here
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", dumps(ANTHROPIC_BODY),
        headers=ANTHROPIC_HEADERS,
    )  # fmt: skip
    (entry,) = reply.new_entries
    return entry


async def test_an_anthropic_stream_cut_mid_answer_keeps_message_starts_input_count(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """README (faults): an Anthropic stream cut mid-answer is billed its output at the reserve,
    "its input count from message_start stands". The input the provider reported (700, 5000 of
    them cache reads) must be what the ledger holds, not the proxy's estimate of "hi"."""
    proxy = await proxy_for(make_proxy, script)
    entry = await cut_after_message_start(proxy, script, redis_client)
    assert entry["outcome"] == "upstream_error", entry
    assert entry["output_tokens"] == "500", entry  # the reserve's
    assert (entry["input_tokens"], entry["cached_input_tokens"]) == ("5700", "5000"), entry


CUT_PRICE = {"input": "3", "output": "15", "cached_input": "0.3", "cache_creation_input_1h": "6"}


async def test_an_anthropic_stream_cut_mid_answer_prices_its_known_input_at_its_kinds(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """README (faults): a cut Anthropic stream's "input count from message_start stands"; its
    output is the reserve's. The input's kinds are the provider's (5,000 cache reads at 0.30),
    not unknown: priced every one at the dearest input rate (a 1h cache write, 6.00), the input
    cost 34,200 micro-units for the provider's 3,600."""
    upstreams: dict[str, Any] = {
        "anthropic": {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    }
    proxy = await make_proxy(
        upstreams=upstreams, models={"claude-*": {"upstream": "anthropic", "price_per_million": CUT_PRICE}}
    )
    entry = await cut_after_message_start(proxy, script, redis_client)
    assert entry["outcome"] == "upstream_error", entry
    assert (entry["input_tokens"], entry["cached_input_tokens"], entry["output_tokens"]) == (
        "5700",
        "5000",
        "500",
    )
    # 700 x 3 + 5,000 x 0.30 for the input; the output at the reserve, at its dearest rate.
    assert entry["cost_micros"] == str(700 * 3 + 5000 * 3 // 10 + 500 * 15), entry


@pytest.mark.parametrize("kind", ["between_tools", "adaptive"])
async def test_an_anthropic_stream_thinking_in_any_mode_is_billed_its_reserved_output_when_the_client_leaves(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, kind: str
) -> None:
    """Thinking is on for every type but disabled (the anthropic SDK's between_tools thinks
    between tool calls): cancel had counted the summary, as for a call that does not think."""
    proxy = await proxy_for(make_proxy, script, policy={"on_client_disconnect": "cancel"})
    block = ev("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": ""}})
    delta = ev(
        "content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me see"}}
    )
    script.plan = Plan(
        content_type="text/event-stream", chunks=[MESSAGE_START + block + delta, delta, delta], delay_s=0.5
    )
    body: dict[str, Any] = {**ANTHROPIC_BODY, "max_tokens": 4000, "thinking": {"type": kind}}
    await read_until_then_leave(proxy, "/v1/messages", body, b"Let me see")
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["input_tokens"]) == ("client_disconnected", "700"), entry
    assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "4000"), entry
