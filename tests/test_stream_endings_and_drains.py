"""Streams whose end the relay must not take for a whole answer, and the error event it writes
when the answer broke: each test kills a mutant of ``proxy/relay_stream.py`` the suite let live
(an unfinished answer of n, an Anthropic stream without message_stop, a drain that ended early,
a malformed stream's tail)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.conftest import ProxyFactory
from tests.outcome_helpers import parse_sse
from tests.test_bad_input import Plan, Reply, ScriptedUpstream, dumps, send
from tests.test_contract_edges import read_until_then_leave
from tests.test_fault_matrix import only_entry
from tests.test_outcomes_stream import stalled_reader
from tests.test_stream_dialects import (
    ANTHROPIC_BODY,
    ANTHROPIC_HEADERS,
    CHAT,
    MESSAGE_START,
    RESPONSE,
    RESPONSES_BODY,
    chunk,
    ev,
    proxy_for,
)

CHAT_PATH = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"
BAD_JSON = b"data: {not json\n\n"
USAGE = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def text(index: int, piece: str) -> bytes:
    return sse(chunk([{"index": index, "delta": {"content": piece}, "finish_reason": None}]))


def finish(index: int, reason: str = "stop") -> bytes:
    return sse(chunk([{"index": index, "delta": {}, "finish_reason": reason}]))


def usage_chunk() -> bytes:
    return sse(chunk([], USAGE))


def billed(entry: dict[str, str]) -> tuple[str, str, str, str]:
    return entry["outcome"], entry["usage_source"], entry["input_tokens"], entry["output_tokens"]


def error_events(body: bytes) -> list[Any]:
    """The payloads of the stream's ``event: error`` events."""
    return [e.json() for e in parse_sse(body) if e.event == "error"]


async def chat_stream(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    chunks: list[bytes],
    **fields: Any,
) -> tuple[Reply, dict[str, str]]:
    proxy = await proxy_for(make_proxy, script)
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    reply = await send(proxy, lambda: script.received, redis_client, CHAT_PATH, dumps({**CHAT, **fields}))
    (entry,) = reply.new_entries
    return reply, entry


async def anthropic_stream(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, parts: list[bytes]
) -> tuple[Reply, dict[str, str]]:
    proxy = await proxy_for(make_proxy, script)
    script.plan = Plan(content_type="text/event-stream", chunks=parts)
    body = dumps(ANTHROPIC_BODY)
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", body, headers=ANTHROPIC_HEADERS
    )
    (entry,) = reply.new_entries
    return reply, entry


# -- n = 2: one answer finished, the other never did -------------------------------------------


@pytest.mark.parametrize("with_usage", [False, True], ids=["no-usage", "usage"])
async def test_a_stream_of_two_answers_that_ends_with_one_unfinished_is_not_whole(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, with_usage: bool
) -> None:
    """No [DONE], and only answer 0 told how it ended: the body's clean end is no sign of a
    whole answer (that holds only once every choice finished). Taken as whole (the finish
    reasons counted against 1, not n), it was ``ok`` and, without usage, billed on the counted
    text: 6 output tokens for a call that may have written up to its cap of 10, twice."""
    chunks = [text(0, "hello world"), text(1, "other answer"), finish(0)]
    reply, entry = await chat_stream(
        make_proxy, script, redis_client, chunks + ([usage_chunk()] if with_usage else []), n=2
    )
    if with_usage:
        assert billed(entry) == ("upstream_error", "provider", "5", "9"), entry
    else:
        assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry
        assert entry["output_tokens"] == entry["reserved_output_tokens"] == "20", entry
    # The client's SDK raises: the answer it has is not whole.
    assert [e["error"]["code"] for e in error_events(reply.body)] == ["upstream_error"], reply.body[-300:]
    assert DONE not in reply.body


# -- Anthropic: message_stop never came ------------------------------------------------------


BLOCK = ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
HELLO = ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello there"}})
BLOCK_STOP = ev("content_block_stop", {"index": 0})
STOPPED = ev("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}})


@pytest.mark.parametrize("stopped", [True, False], ids=["after-message-delta", "before-message-delta"])
async def test_an_anthropic_stream_without_message_stop_is_an_upstream_error(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stopped: bool
) -> None:
    """message_stop is how a Messages stream ends; a stop reason in message_delta is not (no
    [DONE] to read, the chat rule of "every choice finished" must not apply). Taken as whole,
    the stream that had its message_delta was ``ok``, with no error event for the SDK."""
    parts = [MESSAGE_START, BLOCK, HELLO, BLOCK_STOP] + ([STOPPED] if stopped else [])
    reply, entry = await anthropic_stream(make_proxy, script, redis_client, parts)
    # The provider's final figures when they came; else its input and the reserved output.
    assert billed(entry) == (
        "upstream_error",
        "provider" if stopped else "reserve",
        "700",
        "3" if stopped else "500",
    )
    assert [e["error"]["type"] for e in error_events(reply.body)] == ["api_error"], reply.body[-300:]


# -- the last event's blank line never came ---------------------------------------------------


@pytest.mark.parametrize(
    "last",
    [DONE[:-1], DONE[:-2], usage_chunk()[:-1], usage_chunk()[:-2]],
    ids=["done-one-lf", "done-no-lf", "usage-one-lf", "usage-no-lf"],
)
async def test_a_whole_stream_whose_last_event_lacks_its_blank_line_is_a_whole_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, last: bytes
) -> None:
    """The body ended cleanly right after its last event ([DONE], or the usage chunk of a server
    that sends no [DONE]) but before that event's blank line, as gateways that close right after
    the last field send it (openai/openai-node#2725). Those bytes were held as an event cut
    short: an upstream_error told by the proxy's error event (the client's SDK raised), billed
    at the reserve when they carried the usage."""
    ended = [usage_chunk(), last] if DONE[:-2] in last else [last]
    chunks = [text(0, "hello"), text(0, " world"), finish(0), *ended]
    reply, entry = await chat_stream(
        make_proxy, script, redis_client, chunks, stream_options={"include_usage": True}
    )
    assert billed(entry) == ("ok", "provider", "5", "9"), entry
    assert error_events(reply.body) == [], reply.body[-300:]
    # The usage chunk reaches the client whole, with its blank line; [DONE] as the upstream
    # ended with it (after the billing comment).
    assert usage_chunk() in reply.body, reply.body[-300:]
    assert reply.body.endswith(DONE) == (DONE[:-2] in last), reply.body[-300:]


async def test_a_responses_stream_whose_completed_event_lacks_its_blank_line_is_billed_on_its_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The same for the Responses API, whose usage comes only in ``response.completed`` (the
    event openai-node#2725 names): the answer came whole with the provider's figures, and was
    billed at its reserve as an upstream_error."""
    done = {**RESPONSE, "status": "completed", "usage": {"input_tokens": 20, "output_tokens": 7}}
    events = [
        ev("response.created", {"sequence_number": 0, "response": {**RESPONSE, "status": "in_progress"}}),
        ev("response.output_text.delta", {"sequence_number": 1, "item_id": "msg_1", "output_index": 0,
                                          "content_index": 0, "delta": "hello world"}),
        ev("response.completed", {"sequence_number": 2, "response": done})[:-1],  # one \n, then the end
    ]  # fmt: skip
    proxy = await proxy_for(make_proxy, script)
    script.plan = Plan(content_type="text/event-stream", chunks=events)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/responses", dumps(RESPONSES_BODY))
    (entry,) = reply.new_entries
    assert billed(entry) == ("ok", "provider", "20", "7"), entry
    assert error_events(reply.body) == [], reply.body[-300:]
    assert events[-1] + b"\n" in reply.body


async def test_an_anthropic_stream_whose_message_stop_lacks_its_blank_line_is_a_whole_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Likewise message_stop, the end of a Messages stream, with no line break after it."""
    stop = ev("message_stop", {})[:-2]
    parts = [MESSAGE_START, BLOCK, HELLO, BLOCK_STOP, STOPPED, stop]
    reply, entry = await anthropic_stream(make_proxy, script, redis_client, parts)
    assert billed(entry) == ("ok", "provider", "700", "3"), entry
    assert error_events(reply.body) == [], reply.body[-300:]
    assert stop + b"\n\n" in reply.body


# -- drained after the client left: only a whole answer is counted -----------------------------


# A chunk of ``Gated``'s plan that breaks the connection instead (no end of its chunked body).
CUT = b""


class Gated(ScriptedUpstream):
    """Sends its first chunk, then the rest once ``gate`` is set (or it closes)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def close(self) -> None:
        self.gate.set()  # a handler still waiting ends (its writes fail) rather than hold the close
        await super().close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first, *rest = self.plan.chunks
        try:
            await resp.write(first)
            await asyncio.wait_for(self.gate.wait(), 10)
            for piece in rest:
                await asyncio.sleep(0.02)  # each its own read: the proxy's writes find the client gone
                if piece == CUT:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                await resp.write(piece)
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp


DRAIN_TAILS = {
    # The body ends cleanly, the answer unfinished: it may have gone on to its cap.
    "unfinished": [text(0, " there")],
    # Finished without [DONE], but a chunk was not JSON: not a whole answer.
    "malformed": [BAD_JSON, finish(0)],
    # OpenRouter's failed choice, then [DONE]: the provider's failure, not a whole answer.
    "failed": [finish(0, "error"), DONE],
    # Finished, then the connection broke before [DONE] and the usage: no usage, no whole answer.
    "broken": [finish(0), CUT],
    # Finished, then the body ended inside an event.
    "cut-inside-an-event": [finish(0), b'data: {"id":"c","choi'],
}


@pytest.mark.parametrize("tail", DRAIN_TAILS)
async def test_a_drained_stream_that_did_not_end_whole_is_billed_its_reserve(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, tail: str
) -> None:
    """The client left; the proxy drained the stream to its end (``drain``), which was not a
    whole answer: no usage came, so the reserve, as when the client stays. Marked complete, the
    drain billed the counted text: a few tokens of a 400-token reserve."""
    upstream = Gated()
    await upstream.start()
    try:
        proxy = await proxy_for(make_proxy, upstream)
        upstream.plan = Plan(
            chunks=[text(0, "Hello"), text(0, " my"), text(0, " friend"), *DRAIN_TAILS[tail]]
        )
        await read_until_then_leave(proxy, CHAT_PATH, {**CHAT, "max_tokens": 400}, b"Hello")
        upstream.gate.set()
        entry = await only_entry(redis_client)
    finally:
        await upstream.close()
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == (
        "client_disconnected",
        "reserve",
        "400",
    ), entry


# -- a malformed stream: what the client gets after it -----------------------------------------


@pytest.mark.parametrize("done", [True, False], ids=["done", "no-done"])
async def test_a_chunk_that_is_not_json_is_passed_on_and_the_stream_ends_as_the_upstream_ended_it(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, done: bool
) -> None:
    """The bad chunk reaches the client as it came (its SDK raises on it, as on the provider's
    own); no error event of the proxy's follows it, and [DONE] only when the upstream sent it.
    The call is an upstream_error at its reserve, never ``ok`` on the counted text."""
    chunks = [text(0, "hello world"), BAD_JSON, finish(0)] + ([DONE] if done else [])
    reply, entry = await chat_stream(make_proxy, script, redis_client, chunks)
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry
    assert BAD_JSON in reply.body
    assert error_events(reply.body) == [], reply.body[-300:]
    assert reply.body.endswith(DONE) == done and reply.body.count(b"[DONE]") == int(done)


async def test_a_stream_that_ends_inside_an_event_gets_the_proxys_error_event(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Every choice finished and the usage came, then the body ended inside an event: an
    upstream_error on the provider's figures, told to the client's SDK by an error event."""
    chunks = [text(0, "hello world"), finish(0), usage_chunk(), b'data: {"id":"c","choi']
    reply, entry = await chat_stream(make_proxy, script, redis_client, chunks)
    assert billed(entry) == ("upstream_error", "provider", "5", "9"), entry
    assert [e["error"]["code"] for e in error_events(reply.body)] == ["upstream_error"], reply.body[-300:]
    assert DONE not in reply.body


async def test_a_stall_mid_stream_is_told_to_the_client_as_a_timeout(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """The error event's code is the outcome's (upstream_timeout), not a generic one."""
    upstream = Gated()  # never opened while the proxy waits: silent past its timeout
    await upstream.start()
    try:
        config = {"base_url": upstream.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 0.2}
        proxy = await make_proxy(upstreams={"openai": config})
        upstream.plan = Plan(chunks=[text(0, "hello"), finish(0)])
        reply = await send(proxy, lambda: upstream.received, redis_client, CHAT_PATH, dumps(CHAT))
    finally:
        await upstream.close()
    (entry,) = reply.new_entries
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_timeout", "reserve"), entry
    assert [e["error"]["code"] for e in error_events(reply.body)] == ["upstream_timeout"], reply.body[-300:]


async def test_the_providers_own_error_event_is_not_followed_by_the_proxys(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A chat stream that ends on the provider's error chunk: the SDK raises that one, with its
    code; an error event of the proxy's after it would be what the SDK read instead."""
    error = b'{"error":{"message":"overloaded","type":"server_error","code":"overloaded"}}'
    reply, entry = await chat_stream(make_proxy, script, redis_client, [text(0, "hello"), sse(error)])
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry
    assert sse(error) in reply.body
    assert error_events(reply.body) == [], reply.body[-300:]


async def test_an_anthropic_error_event_is_not_followed_by_the_proxys(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """As for chat: the SDK raises Anthropic's overloaded_error, not the proxy's api_error."""
    overloaded = ev("error", {"error": {"type": "overloaded_error", "message": "Overloaded"}})
    reply, entry = await anthropic_stream(
        make_proxy, script, redis_client, [MESSAGE_START, BLOCK, HELLO, overloaded]
    )
    assert (entry["outcome"], entry["input_tokens"]) == ("upstream_error", "700"), entry
    assert [e["error"]["type"] for e in error_events(reply.body)] == ["overloaded_error"], reply.body[-300:]


# -- a client dropped by its last write ---------------------------------------------------------


async def test_a_client_dropped_while_the_answers_end_was_written_to_it_is_a_disconnect(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The client stopped reading; the write that held the answer's end (a 6 MB event, then
    [DONE]) timed out and the connection was dropped: the client never had the answer whole.
    Taken as written (the timeout not marking the client gone), it was ``ok``."""
    config = {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 0.3}
    proxy = await make_proxy(upstreams={"openai": config})  # writes time out after 0.3 s
    end = text(0, "x" * 6_000_000) + finish(0) + usage_chunk() + DONE  # past any socket buffer
    script.plan = Plan(content_type="text/event-stream", chunks=[text(0, "Hello"), end])
    sock = await stalled_reader(proxy, "r1", 50)
    try:
        entry = await only_entry(redis_client)
    finally:
        sock.close()
    assert billed(entry) == ("client_disconnected", "provider", "5", "9"), entry


@pytest.mark.parametrize("asks_usage", [False, True])
@pytest.mark.parametrize("policy", ["drain", "cancel"])
async def test_a_client_gone_before_the_answers_end_is_a_disconnect_even_when_nothing_more_is_written(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    policy: str,
    asks_usage: bool,
) -> None:
    """The client has the last content event and leaves; 0.5 s later the upstream sends its usage
    chunk and [DONE]. Without usage asked for, nothing more was written to it (the usage chunk is
    dropped, [DONE] held for the tail), so the relay never noticed it gone and billed ``ok``
    where it abandoned the stream (the client transport hunt); with usage asked for, the write
    of that chunk noticed."""
    upstream = {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 5}
    proxy = await make_proxy(upstreams={"openai": upstream}, policy={"on_client_disconnect": policy})
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[text(0, "Hello") + finish(0), usage_chunk() + DONE],
        delay_s=0.5,
    )
    body: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    if asks_usage:
        body["stream_options"] = {"include_usage": True}
    # Gone before the usage chunk and [DONE], 0.5 s off.
    await read_until_then_leave(proxy, "/v1/chat/completions", body, b'"stop"')
    entry = await only_entry(redis_client)  # one entry, nothing left leased
    assert billed(entry) == ("client_disconnected", "provider", "5", "9"), entry


# -- a client that leaves once it has the answer's end ------------------------------------------

MAX_TOKENS_DELTA = ev(
    "message_delta",
    {"delta": {"stop_reason": "max_tokens", "stop_sequence": None}, "usage": {"output_tokens": 500}},
)
REFUSAL_DELTA = ev(
    "message_delta",
    {"delta": {"stop_reason": "refusal", "stop_sequence": None}, "usage": {"output_tokens": 4}},
)
RESPONSES_USAGE = {"input_tokens": 20, "output_tokens": 5, "total_tokens": 25}
# Each answer whole, up to its last event (what the client reads to), its tag and its figures.
ENDS_THEN_LEAVES = {
    "messages-truncated": (
        "/v1/messages",
        MESSAGE_START + MAX_TOKENS_DELTA + ev("message_stop", {}),
        b"message_stop",
        ("truncated", "provider", "700", "500"),
    ),
    "messages-refused": (
        "/v1/messages",
        MESSAGE_START + REFUSAL_DELTA + ev("message_stop", {}),
        b"message_stop",
        ("refused", "provider", "700", "4"),
    ),
    "responses-ok": (
        "/v1/responses",
        ev("response.completed", {"response": {**RESPONSE, "status": "completed", "usage": RESPONSES_USAGE}}),
        b"response.completed",
        ("ok", "provider", "20", "5"),
    ),
    "responses-truncated": (
        "/v1/responses",
        ev(
            "response.incomplete",
            {
                "response": {
                    **RESPONSE,
                    "status": "incomplete",
                    "incomplete_details": {"reason": "max_output_tokens"},
                    "usage": RESPONSES_USAGE,
                }
            },
        ),
        b"response.incomplete",
        ("truncated", "provider", "20", "5"),
    ),
    # [DONE] waits for the tail: a client gone before it never had the answer's end.
    "chat-disconnected": (
        CHAT_PATH,
        text(0, "Hello") + finish(0) + usage_chunk() + DONE,
        b'"stop"',
        ("client_disconnected", "provider", "5", "9"),
    ),
}


@pytest.mark.parametrize("case", list(ENDS_THEN_LEAVES))
async def test_a_client_that_leaves_once_it_has_the_answers_last_event_keeps_the_answers_tag(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, case: str
) -> None:
    """The client reads to message_stop / response.completed / incomplete and closes; the
    upstream keeps its body open a second longer. The relay's brief wait for the body's end
    noticed the client gone, and tagged the call ``client_disconnected`` as if it never had the
    answer's end: true of chat, whose [DONE] waits for the tail, not of these two dialects,
    whose last event went out as it came (a truncated or refused answer's tag was lost)."""
    path, answer, marker, expected = ENDS_THEN_LEAVES[case]
    proxy = await proxy_for(make_proxy, script)
    # The body's end comes a second after the answer's: past the relay's wait for it.
    script.plan = Plan(content_type="text/event-stream", chunks=[answer, b": slow close\n\n"], delay_s=1.0)
    body = {
        CHAT_PATH: {**CHAT, "stream_options": {"include_usage": True}},
        "/v1/messages": ANTHROPIC_BODY,
        "/v1/responses": RESPONSES_BODY,
    }[path]
    await read_until_then_leave(proxy, path, body, marker)
    entry = await only_entry(redis_client)  # settled after the relay's 0.25 s wait, not the upstream's
    assert billed(entry) == expected, entry
