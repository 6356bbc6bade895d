"""Streams as providers shape them, through the `openai` SDK: OpenAI's padded chunks, many events
in one read, texts that are not JSON, half an emoji in a JSON answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream, scripted_upstreams, send
from tests.test_contract_edges import cancel_proxy, read_until_then_leave
from tests.test_fault_matrix import only_entry
from tests.test_stream_dialects import proxy_for
from tests.test_upstream_bodies import read_request

HEAD = '{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'


def content(escaped_text: str, tail: str = "") -> bytes:
    """A content chunk whose text is ``escaped_text`` as sent; ``tail``: fields after usage."""
    delta = '"delta":{"content":"' + escaped_text + '"},"logprobs":null,"finish_reason":null}],'
    return ("data: " + HEAD + delta + '"usage":null' + tail + "}\n\n").encode()


FINISH = ("data: " + HEAD + '"delta":{},"logprobs":null,"finish_reason":"stop"}],"usage":null}\n\n').encode()


DONE = b"data: [DONE]\n\n"


def usage(output_tokens: int) -> bytes:
    counts = f'"prompt_tokens":9,"completion_tokens":{output_tokens},"total_tokens":{9 + output_tokens}'
    head = '{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{'
    return f"data: {head}{counts}}}}}\n\n".encode()


async def read_stream(client: openai.AsyncOpenAI, **extra: Any) -> tuple[str, Exception | None]:
    text, error = "", None
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True, **extra
    )
    try:
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    except (openai.APIError, ValueError) as err:
        error = err
    return text, error


async def test_many_small_events_in_one_read_are_billed_on_the_provider_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script, limits={"max_upstream_body_bytes": 4096})
    events = b"".join(content(f"word{i} ") for i in range(40))  # about 6 KB, 170 bytes an event
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[events + FINISH[:20], FINISH[20:] + usage(40) + b"data: [DONE]\n\n"],
        delay_s=0.2,
    )
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0)
    text, error = await read_stream(client)
    assert error is None and text == "".join(f"word{i} " for i in range(40))
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "40")


@pytest.mark.parametrize("tail", ["", ',"obfuscation":"Xy3"'], ids=["usage-last", "openai-padding"])
async def test_half_an_emoji_in_a_json_answer_is_valid_json(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, tail: str
) -> None:
    """A lone surrogate escape (a text cut inside an emoji) is JSON to the client's SDK: the
    proxy reads it so too, and cuts the usage field out without writing the chunk again."""
    proxy = await proxy_for(make_proxy, script, policy={"on_invalid_json": "reject"})
    pieces = ['{\\"emoji\\": \\"', "\\ud83d", '\\"}']
    chunks = [content(p, tail) for p in pieces] + [FINISH, usage(7), b"data: [DONE]\n\n"]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0)
    text, error = await read_stream(client, response_format={"type": "json_object"})
    assert error is None and json.loads(text) == {"emoji": "\ud83d"}
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["output_tokens"]) == ("ok", "7")


@pytest.mark.parametrize(
    "bad",
    [
        content("x").replace(b"}],", b"}]}},"),  # extra closing braces
        content("a\tb"),  # a raw tab in the string
        content("a\\qb"),  # an escape JSON has not
        content("b").replace(b'"content":"b"', b'"content":"b\xff"'),  # not UTF-8
        content("b", ',"obfuscation":"Q"').replace(b'"obfuscation":"Q"}', b'"obfuscation":"}'),
    ],
    ids=["extra-braces", "raw-tab", "bad-escape", "not-utf8", "padding-never-closed"],
)
async def test_a_chunk_that_is_not_json_is_an_upstream_error(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, bad: bytes
) -> None:
    proxy = await proxy_for(make_proxy, script)
    good = content("hello", ',"obfuscation":"Xy"' if b"obfuscation" in bad else "")
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[good, bad, good, FINISH, usage(3), b"data: [DONE]\n\n"],
    )
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0)
    _, error = await read_stream(client)
    assert isinstance(error, ValueError)  # the SDK cannot read the answer
    entry = await only_entry(redis_client)
    # Billed all the same, on the provider's figures, and tagged as the failure it is.
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "provider")


async def test_every_answer_of_n_is_held_to_json_whether_or_not_its_finish_reason_came(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """n = 2 from a server that sends "" for a finish reason it has not (SGLang, older Ollama):
    the second answer, not JSON, is rejected as the first would be."""
    proxy = await proxy_for(make_proxy, script, policy={"on_invalid_json": "reject"})

    def piece(index: int, text: str, reason: str = "") -> bytes:
        choice = {"index": index, "delta": {"content": text}, "finish_reason": reason}
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        return f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode()

    chunks = [piece(0, '{"a": 1}'), piece(1, "Sure! "), piece(1, "{}"), piece(0, "", "stop"), usage(5)]
    script.plan = Plan(content_type="text/event-stream", chunks=[*chunks, b"data: [DONE]\n\n"])
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0)
    _, error = await read_stream(client, n=2, response_format={"type": "json_object"})
    assert isinstance(error, openai.APIError) and "rejected" in error.message
    entry = await only_entry(redis_client)
    assert entry["outcome"].startswith("rejected:parse-json: "), entry  # was "ok"
    assert (entry["usage_source"], entry["output_tokens"]) == ("provider", "5")


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def test_an_answer_whole_before_its_connection_broke_is_billed_whole_behind_a_slow_client(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """The upstream sends its finish, usage and [DONE], then closes before the chunked body's
    end, while the relay waits on a client slow to read: the bytes it had sent were dropped (a
    read raised the cut first), the whole answer was an upstream_error billed at its reserve
    (1,000 output tokens, not 3) and the client told the stream failed."""
    sent = asyncio.Event()
    first = content("first ")
    large = content("x" * 100_000)  # past aiohttp's 64 KiB: the relay's write waits for the client
    tail = FINISH + usage(3) + b"data: [DONE]\n\n"

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            writer.write(head + http_chunk(first))
            await sent.wait()  # the client stopped reading
            writer.write(http_chunk(large))
            await writer.drain()
            await asyncio.sleep(0.2)  # the relay has it, and waits on the client
            writer.write(http_chunk(tail))  # and no last chunk: the connection closes
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = await make_proxy(upstreams=scripted_upstreams(f"http://127.0.0.1:{port}/v1"))
    body = json.dumps(
        {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 1000,
        }
    ).encode()
    host, proxy_port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(proxy_port), limit=1 << 20)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY_A}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        async with asyncio.timeout(10):
            received = await reader.readuntil(b"first ")
            (handler,) = proxy.runner.server.connections  # type: ignore[union-attr]
            handler.pause_writing()  # a client that reads no more, for now
            sent.set()
            await asyncio.sleep(0.5)  # the tail came and the connection closed meanwhile
            handler.resume_writing()
            received += await reader.readuntil(b"0\r\n\r\n")
    finally:
        writer.close()
        server.close()
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "3"), entry
    assert b"data: [DONE]" in received and b"error" not in received, received[-400:]


# -- providers' own chunk shapes ----------------------------------------------------------------


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat(**extra: Any) -> bytes:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 500, **extra}  # fmt: skip
    return json.dumps(body).encode()


def figures(entry: dict[str, str]) -> tuple[str, ...]:
    return (entry["usage_source"], entry["input_tokens"], entry["output_tokens"],
            entry.get("cached_input_tokens", "0"), entry.get("reasoning_tokens", "0"))  # fmt: skip


def together(piece: str, finish: str | None = None, usage: Any = None, seed: Any = None) -> bytes:
    """Together AI's chat chunk: each piece twice, the choice's ``text`` and its delta's
    ``content`` (as lzell/AIProxySwift's TogetherAIChatCompletionStreamingChunkTests record it),
    usage on the chunk that ends the answer (finish_reason ``eos``)."""
    delta = {"token_id": 30, "role": "assistant", "content": piece, "tool_calls": None}
    choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish, "seed": seed,
              "delta": delta}  # fmt: skip
    model = "meta-llama/Meta-Llama-3.1-8B-Instruct-Turbo"
    return sse({"id": "8b43a5cfadf99e5c-SJC", "object": "chat.completion.chunk", "created": 1723834621,
                "choices": [choice], "model": model, "usage": usage})  # fmt: skip


async def test_a_together_json_answer_is_read_once_and_not_rejected(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """JSON mode, ``on_invalid_json: reject``: Together's answer ``{"a": 1}`` was read from both
    of its copies (``{"a"{"a": 1: 1}}``...), which does not parse: a valid answer rejected."""
    proxy = await proxy_for(make_proxy, script, policy={"on_invalid_json": "reject"})
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    chunks = [together('{"a"'), together(": 1"), together("}", "eos", usage, 2039908639335532000), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions",
                       chat(response_format={"type": "json_object"}))  # fmt: skip
    (entry,) = reply.new_entries
    assert entry["outcome"] == "ok", entry  # was rejected:parse-json
    assert figures(entry) == ("provider", "12", "5", "0", "0"), entry
    assert b"error" not in reply.body, reply.body


async def test_together_text_left_by_the_client_is_counted_once(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """``on_client_disconnect: cancel``, the client leaves before Together's usage: the streamed
    text is counted (README), each piece once, though it comes twice."""
    proxy = await cancel_proxy(make_proxy, script, "openai")
    usage = {"prompt_tokens": 12, "completion_tokens": 100, "total_tokens": 112}
    chunks = [together("abcd" * 100), together(" more"), together("", "eos", usage), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks, delay_s=0.5)
    await read_until_then_leave(proxy, "/v1/chat/completions", json.loads(chat()), b'abcdabcd"')
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("client_disconnected", "chars"), entry
    # 405 characters at most reached the proxy ("abcd" * 100, " more"): 102 tokens at most.
    assert int(entry["output_tokens"]) <= 102, entry  # was 203


async def test_together_completion_text_left_by_the_client_is_counted_once(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The same for a legacy completion: Together's completion chunks carry ``text`` and
    ``delta.content`` too (mlflow's Together gateway tests record them)."""

    def piece(text: str, finish: str | None = None, usage: Any = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "delta": {"token_id": 546, "content": text}}  # fmt: skip
        return sse({"id": "test-id", "object": "completion.chunk", "created": 1, "choices": [choice],
                    "model": "m", "usage": usage})  # fmt: skip

    proxy = await cancel_proxy(make_proxy, script, "openai")
    usage = {"prompt_tokens": 12, "completion_tokens": 100, "total_tokens": 112}
    chunks = [piece("abcd" * 100), piece(" more"), piece("", "eos", usage), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks, delay_s=0.5)
    body = {"model": "gpt-4o-mini", "prompt": "hi", "max_tokens": 500, "stream": True}
    await read_until_then_leave(proxy, "/v1/completions", body, b'abcdabcd"')
    entry = await only_entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("client_disconnected", "chars"), entry
    assert int(entry["output_tokens"]) <= 102, entry  # was 203


def magistral(content: Any, finish: str | None = None, usage: Any = None) -> bytes:
    """Mistral's reasoning models' chunk: a content of a list of parts, thinking parts
    (``{"type": "thinking", "thinking": [{"type": "text", "text": ...}]}``) then text parts
    (as BerriAI/litellm#16272 records the stream)."""
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    obj = {"id": "c3c7", "object": "chat.completion.chunk", "created": 1762355135,
           "model": "magistral-medium-2509", "choices": [choice]}  # fmt: skip
    return sse(obj if usage is None else {**obj, "usage": usage})


def thinking(text: str) -> list[Any]:
    return [{"type": "thinking", "thinking": [{"type": "text", "text": text}]}]


def said(text: str) -> list[Any]:
    return [{"type": "text", "text": text}]


async def test_magistral_thinking_is_counted_when_the_client_leaves(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """``cancel``, the client leaves mid-thinking: the README bills the prompt and the streamed
    text counted, the thinking among it (output the provider bills). Magistral's thinking
    (1,600 characters, 400 tokens at 4 a token) was in parts the proxy did not read: 0."""
    proxy = await proxy_for(make_proxy, script, policy={"on_client_disconnect": "cancel"})
    first = magistral("") + magistral(thinking("abcd" * 400))
    usage = {"prompt_tokens": 10, "total_tokens": 900, "completion_tokens": 890}
    chunks = [first, magistral(thinking(" more")), magistral(said("Hi"), "stop", usage), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks, delay_s=0.5)
    body = json.loads(chat(max_tokens=4000))
    await read_until_then_leave(proxy, "/v1/chat/completions", body, b'abcdabcd"')
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected", entry
    assert int(entry["output_tokens"]) >= 400, entry  # was 0


async def test_a_magistral_answer_without_usage_is_counted(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A whole Magistral-shaped stream without usage (a self-hosted server): its thinking and
    its text are counted (2,000 characters, 500 tokens at 4 a token; 1 when only string
    contents were read)."""
    proxy = await proxy_for(make_proxy, script)
    chunks = [magistral(thinking("abcd" * 400)), magistral(said("efgh" * 100), "stop"), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    body = chat(max_tokens=4000)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", body)
    (entry,) = reply.new_entries
    assert entry["usage_source"] == "chars", entry
    assert int(entry["output_tokens"]) >= 500, entry


async def test_a_magistral_json_answer_is_held_to_json_without_its_thinking(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """JSON mode, ``on_invalid_json: reject``: Magistral's answer ``{"a": 1}`` comes in text
    parts after its thinking parts. No text of a list content was read (an empty answer,
    rejected); the thinking is no part of the answer held to JSON."""
    proxy = await proxy_for(make_proxy, script, policy={"on_invalid_json": "reject"})
    usage = {"prompt_tokens": 10, "total_tokens": 30, "completion_tokens": 20}
    answer = [magistral(said('{"a": 1}')), magistral("", "stop", usage), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=[magistral(thinking("so: JSON")), *answer])
    body = chat(response_format={"type": "json_object"})
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", body)
    (entry,) = reply.new_entries
    assert entry["outcome"] == "ok", entry  # was rejected:parse-json
    assert figures(entry) == ("provider", "10", "20", "0", "0"), entry


async def test_a_groq_streams_usage_under_x_groq_is_the_providers(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Groq tells a stream's usage under ``x_groq`` on its last chunk, asked for or not: it was
    not read (the call billed on a count of its text). Groq's field, not the usage the proxy
    asked for: a client that did not ask gets it as Groq sent it, as it would calling Groq."""
    proxy = await proxy_for(make_proxy, script)
    told = {"queue_time": 0.061348671, "prompt_tokens": 18, "prompt_time": 0.000211569,
            "completion_tokens": 439, "completion_time": 0.798181818, "total_tokens": 457,
            "total_time": 0.798393387}  # fmt: skip
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    last = sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "x_groq": {"id": "req_1", "usage": told}})  # fmt: skip
    chunks = [
        sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
             "x_groq": {"id": "req_1"}}),
        sse({**head, "choices": [{"index": 0, "delta": {"content": "Hello there"}, "finish_reason": None}]}),
        last,
        DONE,
    ]  # fmt: skip
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", chat())
    (entry,) = reply.new_entries
    assert figures(entry) == ("provider", "18", "439", "0", "0"), entry  # was chars, 3 output tokens
    assert last in reply.body, reply.body


# -- an upstream that refuses stream_options (stream_usage_option: false) -------------------------


class MistralLike(ScriptedUpstream):
    """Mistral's API validates its body strictly: ``stream_options`` is an extra input it
    refuses with 422 (openai/openai-agents-python#442, avante.nvim#2347, BerriAI/litellm#8978);
    its streams carry their usage on the last content chunk unasked."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if "stream_options" in json.loads(raw):
            self.received.append(raw)
            detail = [{"type": "extra_forbidden", "loc": ["body", "stream_options", "include_usage"],
                       "msg": "Extra inputs are not permitted", "input": True}]  # fmt: skip
            error = {"object": "error", "message": {"detail": detail}, "type": "invalid_request_error",
                     "param": None, "code": None}  # fmt: skip
            return web.json_response(error, status=422)
        return await super()._handle(request)


async def unasked_proxy(make_proxy: ProxyFactory, upstream: ScriptedUpstream) -> Proxy:
    """A proxy before ``upstream`` that does not ask its streams for usage."""
    upstreams = scripted_upstreams(upstream.base_url)
    upstreams["openai"]["stream_usage_option"] = False
    return await make_proxy(upstreams=upstreams)


def mistral(delta: dict[str, Any], finish: str | None = None, **usage: Any) -> bytes:
    head = {"id": "m1", "object": "chat.completion.chunk", "created": 1, "model": "mistral-small-latest"}
    return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **usage})


async def test_a_mistral_stream_is_not_refused_for_the_proxys_stream_options(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """Called directly, a streamed chat call to Mistral works and carries its usage; through the
    proxy, which asked for usage in a field Mistral refuses, every one was a 422 (billed 0).
    ``stream_usage_option: false`` sends the client's body as it came."""
    upstream = MistralLike()
    await upstream.start()
    try:
        proxy = await unasked_proxy(make_proxy, upstream)
        usage = {"prompt_tokens": 10, "total_tokens": 11, "completion_tokens": 1}
        chunks = [mistral({"content": "Hi"}), mistral({"content": ""}, "stop", usage=usage), DONE]
        upstream.plan = Plan(content_type="text/event-stream", chunks=chunks)
        reply = await send(proxy, lambda: upstream.received, redis_client, "/v1/chat/completions", chat())
    finally:
        await upstream.close()
    assert reply.status == 200, reply.body
    assert figures(reply.new_entries[0]) == ("provider", "10", "1", "0", "0")
    assert b'"usage"' not in reply.body  # the client did not ask: stripped, as ever


async def test_a_stream_not_asked_for_usage_that_tells_none_is_billed_on_a_count(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await unasked_proxy(make_proxy, script)
    text = "abcd" * 100
    chunks = [mistral({"role": "assistant", "content": text}), mistral({"content": ""}, "stop"), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", chat())
    (entry,) = reply.new_entries
    assert "stream_options" not in json.loads(script.received[-1])
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "chars", "100"), entry
