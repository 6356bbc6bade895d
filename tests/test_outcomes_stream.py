"""End to end: every streamed call ends with one ledger entry, the right outcome and the
provider's figures; usage the client did not ask for is stripped, a rejected stream ends in an
SSE error event, and a client that leaves mid-stream is still billed."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionChunk

from proxy.tokenizer import Tokenizer
from tests.conftest import (
    KEY_A,
    UPSTREAM_KEY,
    Proxy,
    ProxyFactory,
    leave_once_upstream_received,
    refused_port,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import (
    CHARS_PROMPT_TOKENS,
    DETAILS,
    FAKE_PROMPT_TOKENS,
    MODEL,
    MSGS,
    PROMPT,
    JsonDict,
    RawResult,
    assert_no_secret,
    assert_provider_usage,
    assert_reserve_usage,
    auth,
    billing_comment,
    byte_encoding,
    chars_tokens,
    data_chunks,
    parse_sse,
    raw_post,
    reply_text,
    run_headers,
    the_entry,
    upstream_override,
)

REJECT_ALL = {"on_truncate": "reject", "on_invalid_json": "reject"}
JSON_FORMAT: Any = {"type": "json_object"}
USAGE_ON: Any = {"include_usage": True}


async def sdk_stream(proxy: Proxy, run: str, ctl: JsonDict, **kwargs: Any) -> list[ChatCompletionChunk]:
    async with proxy.client() as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            stream=True,
            extra_body={"fake": ctl},
            extra_headers=run_headers(run),
            **kwargs,
        )
        return [chunk async for chunk in stream]


async def stream_until_error(proxy: Proxy, run: str, ctl: JsonDict, **kwargs: Any) -> openai.APIError:
    """Open a stream (which must succeed), then iterate it until the SDK raises."""
    chunks: list[ChatCompletionChunk] = []
    async with proxy.client() as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            stream=True,
            extra_body={"fake": ctl},
            extra_headers=run_headers(run),
            **kwargs,
        )
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                chunks.append(chunk)
    assert chunks, "the error came before any chunk"
    assert not isinstance(caught.value, openai.APIStatusError)
    return caught.value


async def raw_stream(proxy: Proxy, run: str, ctl: JsonDict, **fields: Any) -> RawResult:
    body = {"model": MODEL, "messages": MSGS, "stream": True, "fake": ctl, **fields}
    return await raw_post(proxy, body, run)


def content_of(chunks: list[JsonDict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def assert_comment_matches(payload: JsonDict, entry: JsonDict, run: str) -> None:
    assert payload["run_id"] == run
    assert payload["outcome"] == entry["outcome"]
    assert payload["usage_source"] == entry["usage_source"]
    assert str(payload["input_tokens"]) == entry["input_tokens"]
    assert str(payload["output_tokens"]) == entry["output_tokens"]


async def test_client_asking_for_usage_gets_the_providers_chunk(proxy: Proxy, fake: FakeUpstream) -> None:
    chunks = await sdk_stream(proxy, "r1", {"usage": DETAILS}, stream_options=USAGE_ON)
    *rest, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (FAKE_PROMPT_TOKENS, 8)
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 3
    assert last.usage.completion_tokens_details is not None
    assert last.usage.completion_tokens_details.reasoning_tokens == 4
    assert all(c.usage is None for c in rest)
    assert "".join(c.choices[0].delta.content or "" for c in rest) == reply_text(8)
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["stream"], entry["finish_reasons"]) == ("ok", "1", "stop")
    assert_provider_usage(entry, fake.bill[0])
    assert fake.received[-1].body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "options",
    [None, {"include_usage": False}, {"include_usage": None}],
    ids=["no-options", "include-false", "include-null"],
)
async def test_usage_the_client_did_not_ask_for_is_stripped(
    proxy: Proxy, fake: FakeUpstream, options: JsonDict | None
) -> None:
    fields = {} if options is None else {"stream_options": options}
    result = await raw_stream(proxy, "r1", {"usage": DETAILS}, **fields)
    assert result.status == 200
    assert result.headers["content-type"].startswith("text/event-stream")
    assert b'"usage"' not in result.body
    events = parse_sse(result.body)
    chunks = data_chunks(events)
    assert all(c["choices"] != [] for c in chunks)
    assert content_of(chunks) == reply_text(8)
    # the upstream was asked for usage all the same, and the ledger has it
    sent = fake.received[-1]
    assert sent.body["stream_options"]["include_usage"] is True
    assert sent.headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert KEY_A.encode() not in sent.raw
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "ok"
    assert_provider_usage(entry, fake.bill[0])
    # the billing comment comes last, just before [DONE], in its block (see the id test)
    assert events[-1].data == "[DONE]"
    assert any(c.startswith("billing ") for c in events[-1].comments)
    assert result.body.endswith(b"\ndata: [DONE]\n\n") and b"\n\n: billing " in result.body
    assert_comment_matches(billing_comment(events), entry, "r1")


@pytest.mark.parametrize(
    ("ctl", "kwargs", "outcome", "finish"),
    [
        ({"mode": "truncate"}, {}, "truncated", "length"),
        ({"mode": "content_filter"}, {}, "refused", "content_filter"),
        ({"mode": "refusal"}, {}, "refused", "stop"),
        ({"content": '{"answer": [1, 2, 3]}'}, {"response_format": JSON_FORMAT}, "ok", "stop"),
    ],
    ids=["truncate", "content_filter", "refusal", "valid-json"],
)
async def test_answer_outcomes(
    make_proxy: ProxyFactory, fake: FakeUpstream, ctl: JsonDict, kwargs: JsonDict, outcome: str, finish: str
) -> None:
    # invalid JSON is rejected, yet valid JSON and answers outside JSON mode are not
    proxy = await make_proxy(policy={"on_invalid_json": "reject"})
    chunks = await sdk_stream(proxy, "r1", ctl, **kwargs)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        finish
    ]
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["finish_reasons"]) == (outcome, finish)
    assert_provider_usage(entry, fake.bill[0])


REJECTIONS = [
    pytest.param({"mode": "truncate"}, {}, "rejected:output-truncated", id="output-truncated"),
    pytest.param(
        {"content": "Sure! Here is your JSON: {}"},
        {"response_format": JSON_FORMAT},
        "rejected:parse-json: ",
        id="parse-json",
    ),
    pytest.param(
        {"content": '{"answer": [1, 2, 3, 4, 5]}', "mode": "truncate"},
        {"response_format": JSON_FORMAT, "max_tokens": 3},
        "rejected:parse-json-truncated",
        id="parse-json-truncated",
    ),
]


@pytest.mark.parametrize(("ctl", "kwargs", "outcome"), REJECTIONS)
async def test_rejected_stream_raises_in_the_sdk(
    make_proxy: ProxyFactory, fake: FakeUpstream, ctl: JsonDict, kwargs: JsonDict, outcome: str
) -> None:
    proxy = await make_proxy(policy=REJECT_ALL)
    error = await stream_until_error(proxy, "r1", ctl, **kwargs)
    assert "rejected" in error.message
    assert len(fake.bill) == 1
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"].startswith(outcome)
    if not outcome.endswith(": "):
        assert entry["outcome"] == outcome
    assert_provider_usage(entry, fake.bill[0])  # charged in full


@pytest.mark.parametrize(("ctl", "kwargs", "outcome"), REJECTIONS)
async def test_rejected_stream_ends_with_an_error_event(
    make_proxy: ProxyFactory, fake: FakeUpstream, ctl: JsonDict, kwargs: JsonDict, outcome: str
) -> None:
    proxy = await make_proxy(policy=REJECT_ALL)
    result = await raw_stream(proxy, "r1", ctl, **kwargs)
    assert result.status == 200
    events = parse_sse(result.body)
    assert all(e.data != "[DONE]" for e in events)
    last = events[-1]
    assert last.event == "error"
    error = last.json()["error"]
    assert error["type"] == "output_rejected"
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"].startswith(outcome)
    assert entry["outcome"].removeprefix("rejected:") in error["message"]
    assert_provider_usage(entry, fake.bill[0])
    assert_comment_matches(billing_comment(events), entry, "r1")


async def test_n2_with_one_truncated_choice_is_truncated(proxy: Proxy, fake: FakeUpstream) -> None:
    await sdk_stream(proxy, "r1", {"finish_reasons": ["stop", "length"]}, n=2)
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["finish_reasons"]) == ("truncated", "stop,length")
    assert_provider_usage(entry, fake.bill[0])


async def test_missing_usage_counts_characters(proxy: Proxy, fake: FakeUpstream) -> None:
    result = await raw_stream(proxy, "r1", {"no_usage": True})
    events = parse_sse(result.body)
    assert events[-1].data == "[DONE]"
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "chars")
    assert int(entry["input_tokens"]) == CHARS_PROMPT_TOKENS
    assert int(entry["output_tokens"]) == chars_tokens(reply_text(8)) > 0
    assert_comment_matches(billing_comment(events), entry, "r1")


async def test_missing_usage_counts_with_tiktoken(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": byte_encoding()}))
    await sdk_stream(proxy, "r1", {"no_usage": True}, stream_options=USAGE_ON)
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "tokenizer")
    assert int(entry["input_tokens"]) == len(PROMPT) + 4 + 3
    assert int(entry["output_tokens"]) == len(reply_text(8))


async def test_legacy_completions_stream(proxy: Proxy, fake: FakeUpstream) -> None:
    async with proxy.client() as client:
        stream = await client.completions.create(
            model=MODEL, prompt="write a short poem", stream=True, extra_headers=run_headers("r1")
        )
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply_text(8)
    assert all(c.usage is None for c in chunks)
    assert fake.received[-1].body["stream_options"]["include_usage"] is True
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["endpoint"]) == ("ok", "completions")
    assert_provider_usage(entry, fake.bill[0])


@pytest.mark.parametrize(
    "ctl",
    [{"two_usage": True}, {"usage_early": True}, {"keepalive": True}],
    ids=["two-usage", "usage-early", "keepalive"],
)
async def test_usage_chunk_variants(proxy: Proxy, fake: FakeUpstream, ctl: JsonDict) -> None:
    result = await raw_stream(proxy, "r1", ctl)
    assert b'"usage"' not in result.body
    events = parse_sse(result.body)
    assert content_of(data_chunks(events)) == reply_text(8)
    assert events[-1].data == "[DONE]"
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "ok"
    assert_provider_usage(entry, fake.bill[0])  # the same usage twice is not billed twice


async def leave_mid_stream(proxy: Proxy, run: str, ctl: JsonDict, **fields: Any) -> None:
    """Read the first couple of data events, then drop the connection."""
    body = {"model": MODEL, "messages": MSGS, "stream": True, "fake": ctl, **fields}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={**auth(), **run_headers(run)}
        )
        assert resp.status == 200
        seen = 0
        while seen < 3:
            line = await asyncio.wait_for(resp.content.readline(), 5)
            assert line, "stream ended early"
            seen += line.startswith(b"data:")
        resp.close()


SLOW: JsonDict = {"chunk_delay_s": 0.05, "reply_tokens": 40}


async def test_a_finished_stream_without_done_is_counted_when_the_client_left(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    # Drained to a clean end with every choice finished: a whole answer, counted (it was billed
    # at its reserve, as an unfinished one).
    await leave_mid_stream(proxy, "left", {**SLOW, "mode": "no_done", "no_usage": True})
    entry = await the_entry(proxy, "left", wait_s=8)
    assert entry["outcome"] == "client_disconnected"
    assert (entry["usage_source"], entry["output_tokens"]) == ("chars", str(chars_tokens(reply_text(40))))


async def test_client_disconnect_drains_and_bills_provider_usage(proxy: Proxy, fake: FakeUpstream) -> None:
    await leave_mid_stream(proxy, "r1", SLOW)
    entry = await the_entry(proxy, "r1", wait_s=5)
    assert entry["outcome"] == "client_disconnected"
    assert_provider_usage(entry, fake.bill[0])
    assert fake.bill[0].completion_tokens == 40


async def left_once_received(proxy: Proxy, fake: FakeUpstream, body: JsonDict) -> None:
    """A chat call of run r1 whose client leaves once the upstream has it."""
    async with aiohttp.ClientSession() as session:
        post = session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={**auth(), **run_headers("r1")}
        )
        await leave_once_upstream_received(post, fake)


async def test_client_gone_before_the_first_byte_is_a_disconnect(proxy: Proxy, fake: FakeUpstream) -> None:
    # A slow start (a reasoning model, say): the client gives up before the upstream's headers.
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 900}
    body["fake"] = {"delay_s": 1.0, "reply_tokens": 5}
    await left_once_received(proxy, fake, body)
    entry = await the_entry(proxy, "r1", wait_s=5)
    # Not an upstream error billed at the 900-token reserve: the provider's own figures.
    assert entry["outcome"] == "client_disconnected"
    assert_provider_usage(entry, fake.bill[0])
    assert fake.bill[0].completion_tokens == 5


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("policy", ["drain", "cancel"])
async def test_client_gone_before_an_upstream_that_then_times_out_is_a_disconnect(
    make_proxy: ProxyFactory, fake: FakeUpstream, stream: bool, policy: str
) -> None:
    """The client gives up (its own timeout, shorter than the upstream's) while the upstream says
    nothing, and the upstream then times out: the call was tagged ``upstream_timeout``, the
    provider's fault for an answer no one waited on (the SDK hunt). The bill is its reserve."""
    proxy = await make_proxy(
        policy={"on_client_disconnect": policy}, upstreams=upstream_override(fake.base_url, timeout_s=1)
    )
    body = {"model": MODEL, "messages": MSGS, "stream": stream, "max_tokens": 6}
    body["fake"] = {"mode": "stall_before_headers", "stall_s": 3}
    await left_once_received(proxy, fake, body)
    entry = await the_entry(proxy, "r1", wait_s=5)
    assert entry["outcome"] == "client_disconnected", entry
    assert entry["usage_source"] == "reserve"


async def test_under_cancel_a_stream_whose_client_left_before_the_headers_is_cut(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """``cancel``: a stream whose client leaves while the upstream has not answered (a reasoning
    model's silence, the client's short timeout) is cut then, as one cut mid-answer is, not
    waited for until the upstream answers or times out (the SDK hunt). Billed at its reserve:
    it went out, and the provider said nothing of what it spent."""
    proxy = await make_proxy(
        policy={"on_client_disconnect": "cancel"}, upstreams=upstream_override(fake.base_url, timeout_s=60)
    )
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 6, "fake": {"hold": True}}
    await left_once_received(proxy, fake, body)
    try:
        entry = await the_entry(proxy, "r1", wait_s=10)  # while the upstream still holds it
    finally:
        fake.release()
    assert entry["outcome"] == "client_disconnected", entry
    assert entry["usage_source"] == "reserve"


async def test_headers_reach_the_client_while_the_upstream_withholds_its_first_event(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """The proxy's headers wait to go out with the first events only while those are already
    there: an upstream that answers its headers and then thinks still lets the client see 200."""
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 50}
    body["fake"] = {"first_event_delay_s": 3, "reply_tokens": 5}
    async with aiohttp.ClientSession() as session:
        post = session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={**auth(), **run_headers("r1")}
        )
        # Below the upstream's 3 s: only headers sent before the first event arrive in time.
        resp = await asyncio.wait_for(post, timeout=2)
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["x-request-id"]
        resp.close()
    entry = await the_entry(proxy, "r1", wait_s=8)
    assert entry["outcome"] == "client_disconnected"
    assert_provider_usage(entry, fake.bill[0])


async def test_client_gone_before_the_upstreams_headers_then_a_slow_first_event(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """Our headers, written before the first wait, find the client gone: a disconnect billed
    on the provider's figures, not an upstream error at the reserve."""
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 900}
    body["fake"] = {"delay_s": 1.0, "first_event_delay_s": 0.2, "reply_tokens": 5}
    await left_once_received(proxy, fake, body)
    entry = await the_entry(proxy, "r1", wait_s=5)
    assert entry["outcome"] == "client_disconnected", entry
    assert_provider_usage(entry, fake.bill[0])


class _HeadersWithData(web.StreamResponse):
    _send_headers_immediately = False  # the upstream's headers and first bytes in one send


async def test_headers_are_not_held_while_the_first_event_is_incomplete(make_proxy: ProxyFactory) -> None:
    """The upstream's headers come with part of its first event, then it thinks: the client
    still gets our headers at once."""

    def event(obj: JsonDict) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    role = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": ""}}]}
    last = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }

    release = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = _HeadersWithData(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = event(role)
        await resp.write(first[:-1])  # with the headers: the first event but its last line break
        await asyncio.wait_for(release.wait(), 30)  # the rest only once the client has our headers
        await resp.write(first[-1:] + event(last) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        proxy = await make_proxy(upstreams={"openai": {"base_url": base, "api_key_env": "TEST_UPSTREAM_KEY"}})
        body = {"model": MODEL, "messages": MSGS, "stream": True}
        async with aiohttp.ClientSession() as session:
            post = session.post(proxy.url + "/v1/chat/completions", json=body, headers=auth())
            # The upstream's second send waits for this: headers held for it never come.
            resp = await asyncio.wait_for(post, timeout=10)
            assert resp.status == 200
            release.set()
            assert b"data: [DONE]" in await resp.read()
    finally:
        await runner.cleanup()


async def test_a_stream_whose_events_came_with_the_headers_is_valid_chunked_http(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """When the upstream's first events come with its headers, ours go out with them (one send:
    not observable here); what is checked is that the client still reads a well-formed
    response, raw bytes de-chunked, not just the SDK's view."""
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 50, "fake": {"reply_tokens": 3}}
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    raw_body = orjson.dumps(body)
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"X-Run-Id: r1\r\nContent-Type: application/json\r\nContent-Length: {len(raw_body)}\r\n"
        f"Connection: close\r\n\r\n".encode()
        + raw_body
    )
    raw = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Transfer-Encoding: chunked" in head
    # De-chunk: every chunk's size line must match, and the body must end with the last chunk.
    payload, rest = b"", chunked
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        payload += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
    assert payload.count(b"data: ") >= 5 and payload.endswith(b"data: [DONE]\n\n")
    assert b"tok0" in payload and b"tok2" in payload
    entry = await the_entry(proxy, "r1", wait_s=5)
    assert entry["outcome"] == "ok"
    assert_provider_usage(entry, fake.bill[0])


async def stalled_reader(proxy: Proxy, run: str, reply_tokens: int) -> socket.socket:
    """A client that sends a stream request and then never reads (a small receive buffer)."""
    body = orjson.dumps(
        {
            "model": "gpt-4o",  # no output cap in the test config: max_tokens stands
            "messages": MSGS,
            "stream": True,
            "max_tokens": 2 * reply_tokens,
            "fake": {"reply_tokens": reply_tokens},  # about 200 bytes an event, sent at once
        }
    )
    host, port = proxy.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"X-Run-Id: {run}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


async def test_a_client_that_stops_reading_is_settled_after_the_write_timeout(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Lease 6 s (upstream timeout 5 + margin 1): renewed every 2 s, writes time out after 2 s.
    proxy = await make_proxy(redis={"socket_timeout_s": 3}, limits={"lease_margin_s": 1})
    sock = await stalled_reader(proxy, "r1", 60_000)
    try:
        # Held open and unread: without a bound on every blocking write, the stream stays in
        # one write for ever, its lease renewed, its reserve never settled.
        # The write timeout (2 s), then the drain of some 12 MB of events: CPU-bound, far longer
        # than 10 s on a loaded machine.
        entry = await the_entry(proxy, "r1", wait_s=60)
        # And the connection is ended: reading, the client comes to its end. Read off the loop:
        # a blocking read on it also held the proxy, which may close the connection only after
        # its ledger entry showed (the read then timed out on a loaded machine).

        def read_to_the_end() -> None:
            sock.settimeout(30)
            while sock.recv(1 << 20):
                pass

        await asyncio.to_thread(read_to_the_end)
    finally:
        sock.close()
    assert entry["outcome"] == "client_disconnected"
    assert_provider_usage(entry, fake.bill[0])  # drained (the default policy)


async def test_a_connection_left_paused_with_little_buffered_still_bounds_the_write(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """uvloop resumes writing to a connection only when a whole queued write has gone, so one can
    stay paused with a few KiB buffered; aiohttp's write then waits for it every 64 KiB. Writes
    that left under 16 KiB buffered took no timeout: one waited as long as the client held the
    socket open unread, its lease renewed, its reserve never settled (a hunt, on uvloop, 0 of
    such states on asyncio's loop). Here the connection is paused so by hand (nothing resumes
    it) once the client has its first event and stops reading."""
    # Writes time out after 2 s (a lease of 6 s; the store's timeout below two thirds of it).
    proxy = await make_proxy(redis={"socket_timeout_s": 3}, limits={"lease_margin_s": 1})
    body = orjson.dumps(
        {
            "model": "gpt-4o",
            "messages": MSGS,
            "stream": True,
            "max_tokens": 4000,
            "fake": {"reply_tokens": 2000, "chunk_delay_s": 0.001},  # ~400 KB, events one by one
        }
    )
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"X-Run-Id: r1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        await asyncio.wait_for(reader.readuntil(b"data: "), 5)
        (handler,) = proxy.runner.server.connections  # type: ignore[union-attr]
        handler.pause_writing()  # as uvloop leaves it; the client reads no more
        entry = await the_entry(proxy, "r1", wait_s=60)  # a drain of ~400 KB of events as well
    finally:
        writer.close()
    assert entry["outcome"] == "client_disconnected"
    assert_provider_usage(entry, fake.bill[0])  # drained (the default policy)


async def test_a_client_reset_while_a_write_waits_is_a_disconnect(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(limits={"lease_margin_s": 30})  # writes time out after 5 s
    sock = await stalled_reader(proxy, "r1", 60_000)
    await asyncio.sleep(3)  # the proxy's buffers fill; its write waits
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset, while the proxy waits for the client to take its bytes
    entry = await the_entry(proxy, "r1", wait_s=60)  # then the drain of some 12 MB of events
    # Not "upstream_error" at the reserve: the client left, the provider's figures stand.
    assert entry["outcome"] == "client_disconnected"
    assert_provider_usage(entry, fake.bill[0])


async def test_client_disconnect_cancel_counts_what_was_seen(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(policy={"on_client_disconnect": "cancel"})
    await leave_mid_stream(proxy, "r1", SLOW)
    entry = await the_entry(proxy, "r1", wait_s=5)
    assert (entry["outcome"], entry["usage_source"]) == ("client_disconnected", "chars")
    assert int(entry["input_tokens"]) == CHARS_PROMPT_TOKENS
    assert 0 < int(entry["output_tokens"]) < fake.bill[0].completion_tokens == 40


async def test_cut_mid_stream(proxy: Proxy, fake: FakeUpstream) -> None:
    await stream_until_error(proxy, "r1", {"mode": "cut"}, stream_options=USAGE_ON)
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "upstream_error"
    assert_reserve_usage(entry)  # the usage chunk never came


async def test_broken_stream_with_provider_usage(proxy: Proxy, fake: FakeUpstream) -> None:
    result = await raw_stream(proxy, "r1", {"mode": "malformed_sse"})
    assert result.status == 200
    events = parse_sse(result.body)
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "upstream_error"
    assert_provider_usage(entry, fake.bill[0])
    assert_comment_matches(billing_comment(events), entry, "r1")


async def test_a_finished_stream_without_done_is_a_whole_answer_passed_on_as_it_came(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """Servers that never send [DONE] (Perplexity) end a whole answer with the body: it was an
    upstream_error, with an error event that made the SDK raise."""
    result = await raw_stream(proxy, "r1", {"mode": "no_done"})
    events = parse_sse(result.body)
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "ok"
    assert_provider_usage(entry, fake.bill[0])
    assert_comment_matches(billing_comment(events), entry, "r1")
    assert b"[DONE]" not in result.body and b"error" not in result.body
    assert content_of(data_chunks(events)) == reply_text(8)


async def test_stall_mid_stream_times_out(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(upstreams=upstream_override(fake.base_url, timeout_s=1))
    await stream_until_error(proxy, "r1", {"mode": "stall_mid_stream", "stall_s": 10})
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "upstream_timeout"
    assert_reserve_usage(entry)


BEFORE_THE_STREAM = [
    pytest.param({"mode": "error", "status": 500}, 500, "upstream_error", "zero", id="500"),
    pytest.param({"mode": "error", "status": 400}, 400, "upstream_4xx", "zero", id="400"),
    pytest.param(
        {"mode": "error", "status": 503, "error_body": "text"}, 503, "upstream_error", "reserve", id="503"
    ),
    pytest.param(
        {"mode": "stall_before_headers", "stall_s": 10}, 504, "upstream_timeout", "reserve", id="stall"
    ),
    pytest.param({}, 502, "upstream_error", "none", id="refused"),
]


@pytest.mark.parametrize(("ctl", "status", "outcome", "charge"), BEFORE_THE_STREAM)
async def test_upstream_failure_before_the_stream(
    make_proxy: ProxyFactory, fake: FakeUpstream, ctl: JsonDict, status: int, outcome: str, charge: str
) -> None:
    base_url = f"http://127.0.0.1:{refused_port()}/v1" if charge == "none" else fake.base_url
    proxy = await make_proxy(upstreams=upstream_override(base_url, timeout_s=1))
    with pytest.raises(openai.APIStatusError) as caught:
        await sdk_stream(proxy, "r1", ctl)
    assert caught.value.status_code == status
    headers = caught.value.response.headers
    assert_no_secret(headers, caught.value.response.content)
    entry = await the_entry(proxy, "r1", requests=0 if charge == "none" else 1)
    assert entry["outcome"] == headers["x-billing-outcome"] == outcome
    assert entry["usage_source"] == headers["x-billing-usage-source"]
    if charge == "reserve":
        assert_reserve_usage(entry)
    else:
        assert (entry["input_tokens"], entry["output_tokens"]) == ("0", "0")
    if charge == "none":
        assert entry["usage_source"] == "none"
        assert fake.received == []
