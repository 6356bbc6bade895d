"""Whole (non-streaming) answers and refusals as upstreams really send them: the status the
client gets, the bill, and the operator's secrets kept out of both."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import tracemalloc
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from proxy import relay
from proxy.auth import Identity
from proxy.config import UpstreamConfig
from proxy.forward import operator_secrets, url_credentials
from proxy.scrub import scrubbed
from tests.conftest import KEY_A, UPSTREAM_KEY, ProxyFactory
from tests.memory import MB, split
from tests.outcome_helpers import run_headers, the_entry
from tests.test_bad_input import Plan, Reply, ScriptedUpstream, scripted_upstreams, send
from tests.test_pricing_kinds import _entry, _post
from tests.test_tool_fees import SEARCH_ITEM, _proxy, _response
from tests.test_upstream_bodies import CHAT, chat_body, dumps, proxy_before, send_to_raw

CALLER = Identity(tenant="team-a", tier="standard", key_name="a")
# A lease of 4 s (the upstream's 3 s and a margin of 1 s): writes time out after a third of it;
# the store's socket timeout below two thirds of it.
A_LEASE_OF_4_S: dict[str, Any] = {"limits": {"lease_margin_s": 1}, "redis": {"socket_timeout_s": 2}}


async def answer(
    proxy: Any,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    status: int,
    body: bytes,
    *,
    stream: bool = False,
    **plan: Any,
) -> Reply:
    """The chat call ``CHAT`` (``stream``: asking for a stream) answered ``status`` and ``body``
    by the scripted upstream."""
    script.plan = Plan(status=status, chunks=[body], **plan)
    path, request = CHAT
    return await send(
        proxy,
        lambda: script.received,
        redis_client,
        path,
        dumps({**request, "stream": True} if stream else request),
    )


def assert_billed_at_reserve(entry: dict[str, Any]) -> None:
    assert entry["usage_source"] == "reserve", entry
    assert entry["input_tokens"] == entry["reserved_input_tokens"] != "0", entry
    assert entry["output_tokens"] == entry["reserved_output_tokens"] != "0", entry


async def test_an_upstream_that_closes_without_answering_bills_the_reserve(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    # The connection was made and the request written: the provider may have run it. Taken for a
    # connection never made, it would be billed nothing.
    reply = await send_to_raw(make_proxy, redis_client, b"", stall=False)
    (entry,) = reply.new_entries
    assert reply.status == 502 and entry["outcome"] == "upstream_error", reply.describe()
    assert_billed_at_reserve(entry)


async def test_an_answer_exactly_as_large_as_the_limit_is_relayed_and_one_byte_more_is_not(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # "Larger upstream bodies are an upstream_error": one at the limit is an answer like any other
    # (the provider billed it; refused, each retry of the SDK is billed again).
    raw = dumps(chat_body(content="x" * 2000))
    at_limit = await proxy_before(make_proxy, script.base_url, limits={"max_upstream_body_bytes": len(raw)})
    reply = await answer(at_limit, script, redis_client, 200, raw)
    assert reply.status == 200 and reply.body == raw, reply.describe()
    assert reply.headers["x-billing-outcome"] == "ok"
    below = await proxy_before(make_proxy, script.base_url, limits={"max_upstream_body_bytes": len(raw) - 1})
    reply = await answer(below, script, redis_client, 200, raw)
    assert (reply.status, reply.headers["x-should-retry"]) == (502, "false"), reply.describe()


async def test_a_success_status_other_than_200_is_passed_on_as_it_came(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A gateway's 201 or 203 with a whole answer: relayed and billed, under its own status.
    proxy = await proxy_before(make_proxy, script.base_url)
    reply = await answer(proxy, script, redis_client, 203, dumps(chat_body()))
    (entry,) = reply.new_entries
    assert reply.status == 203 and json.loads(reply.body)["usage"]["prompt_tokens"] == 3, reply.describe()
    assert (entry["outcome"], entry["usage_source"], entry["input_tokens"]) == ("ok", "provider", "3")


async def test_a_5xx_whose_error_is_a_bare_string_is_billed_at_the_reserve_in_openais_format(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # {"error": "..."} (a gateway's or an inference server's own shape) is not an error in the
    # provider's format: a 5xx without one may hide spent tokens (README: "else the reserve"), and
    # the SDK reads an error object. Taken for one, it was billed 0 and passed on as it came.
    proxy = await proxy_before(make_proxy, script.base_url)
    reply = await answer(proxy, script, redis_client, 500, dumps({"error": "the model crashed mid-answer"}))
    (entry,) = reply.new_entries
    error = reply.json()["error"]
    assert reply.status == 500 and "the model crashed mid-answer" in error["message"], reply.describe()
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_error")
    assert entry["outcome"] == "upstream_error"
    assert_billed_at_reserve(entry)


async def test_a_403_refusing_the_operators_key_is_the_proxys_fault_and_not_retried(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A 403 (a project without access, an IP allow-list) refuses the operator's credentials as a
    # 401 does: passed on, the caller's SDK reads its own key as wrong.
    proxy = await proxy_before(make_proxy, script.base_url)
    refusal = {"error": {"message": "Project does not have access", "type": "invalid_request_error"}}
    advice = {"x-should-retry": "true"}
    reply = await answer(proxy, script, redis_client, 403, dumps(refusal), extra_headers=advice)
    (entry,) = reply.new_entries
    assert (reply.status, reply.json()["error"]["code"]) == (502, "upstream_auth"), reply.describe()
    assert reply.headers["x-should-retry"] == "false"
    assert (entry["outcome"], entry["total_tokens"]) == ("upstream_4xx", "0")


async def test_the_operators_key_echoed_twice_is_scrubbed_both_times(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A gateway quoting the request's headers and the key again in its message: only the first
    # echo was replaced.
    proxy = await proxy_before(make_proxy, script.base_url)
    message = f"key {UPSTREAM_KEY} refused (Authorization: Bearer {UPSTREAM_KEY})"
    for status in (400, 200):
        reply = await answer(proxy, script, redis_client, status, dumps({"error": {"message": message}}))
        assert reply.status == status and UPSTREAM_KEY.encode() not in reply.body, reply.describe()
        assert reply.body.count(b"[REDACTED]") == 2, reply.describe()


def test_a_user_name_that_is_a_token_of_its_own_is_scrubbed() -> None:
    # ``https://TOKEN@gateway``: the token is the credential (no password); only its basic auth
    # form was sought, and a gateway echoing the user name it read passed the token on.
    token = "gw-tok-0123456789abcdef"
    upstream = UpstreamConfig(base_url=f"https://{token}@gw.example/v1")
    echo = dumps({"error": {"message": f"user {token} is not allowed"}})
    assert token.encode() not in scrubbed(echo, operator_secrets(upstream, CALLER))


def test_a_password_of_eight_characters_is_sought_in_answers() -> None:
    # The shortest sought (``_MIN_SECRET``): one of 8 passed on as the gateway echoed it.
    assert "pw-12345" in url_credentials("https://gw-user:pw-12345@gw.example/v1")


def test_a_password_echoed_by_an_encoder_that_keeps_non_ascii_is_scrubbed() -> None:
    # Go's and Rust's JSON encoders escape a quote but write "ä" as it is: neither the raw
    # password nor Python's all-ASCII escape of it matched such an echo.
    password = 'pä"ss-0123456789'
    upstream = UpstreamConfig(base_url="https://gw-user:p%C3%A4%22ss-0123456789@gw.example/v1")
    echo = json.dumps({"error": {"message": f"wrong password {password}"}}, ensure_ascii=False).encode()
    assert b'p\xc3\xa4\\"ss' in echo
    assert scrubbed(echo, operator_secrets(upstream, CALLER)).count(b"[REDACTED]") == 1


async def test_a_whole_answer_trickling_in_past_its_timeout_is_an_upstream_timeout(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A non-streaming call's timeout_s bounds the whole call (README: "total (non-streaming)"):
    # as a bound on silences alone, a body sent a byte at a time held the call (and its lease) for
    # as long as it came.
    upstream = {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 0.5}
    proxy = await make_proxy(upstreams={"openai": upstream})
    raw = dumps(chat_body())
    trickle = [raw[i : i + 1] for i in range(len(raw))]
    timeout = aiohttp.ClientTimeout(total=15)
    script.plan = Plan(chunks=trickle, delay_s=0.1)
    path, request = CHAT
    reply = await send(proxy, lambda: script.received, redis_client, path, dumps(request), timeout=timeout)
    (entry,) = reply.new_entries
    assert (reply.status, entry["outcome"]) == (504, "upstream_timeout"), reply.describe()
    assert_billed_at_reserve(entry)


async def test_a_redirect_is_a_502_the_sdk_does_not_retry_billed_nothing(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A base_url to fix: the same call meets the same redirect, and an SDK retries a 502 (each
    # retry reserved again) unless told not to, whatever the upstream's own advice said.
    proxy = await proxy_before(make_proxy, script.base_url)
    moved = {"Location": "https://elsewhere.example/v1/chat/completions", "x-should-retry": "true"}
    reply = await answer(proxy, script, redis_client, 308, b"moved", extra_headers=moved)
    (entry,) = reply.new_entries
    assert (reply.status, reply.json()["error"]["code"]) == (502, "upstream_redirect"), reply.describe()
    assert reply.headers["x-should-retry"] == "false" and "location" not in reply.headers
    assert (entry["outcome"], entry["total_tokens"]) == ("upstream_error", "0")


async def test_a_refusal_of_a_pass_through_callers_own_key_is_passed_on_as_it_came(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # The caller's own key was refused, not the operator's: a 502 upstream_auth would have its
    # SDK retry a key that is wrong (each retry a call) instead of raising AuthenticationError.
    proxy = await make_proxy(
        passthrough=True, upstreams={"openai": {"base_url": script.base_url, "passthrough_auth": True}}
    )
    refusal = dumps({"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error"}})
    for status in (401, 403):
        reply = await answer(proxy, script, redis_client, status, refusal)
        assert (reply.status, reply.body) == (status, refusal), reply.describe()


async def test_an_error_page_is_told_in_the_apis_format_with_its_start_and_its_status(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A gateway's HTML page, or nothing: the SDK reads an error object; its type says whose side
    # failed, its code the outcome, and its message the page's first 200 bytes (not a page of
    # megabytes in every log line of the caller's).
    proxy = await proxy_before(make_proxy, script.base_url)
    page = b"<html><body>404 Not Found: no such route" + b" " * 300 + b"nginx</body></html>"
    reply = await answer(proxy, script, redis_client, 404, page, content_type="text/html")
    error, (entry,) = reply.json()["error"], reply.new_entries
    assert reply.status == 404, reply.describe()
    assert (error["type"], error["code"]) == ("invalid_request_error", "upstream_4xx")
    assert error["message"] == "Upstream returned HTTP 404: " + page[:200].decode().strip()
    assert (entry["outcome"], entry["total_tokens"]) == ("upstream_4xx", "0")  # refused: no work done
    reply = await answer(proxy, script, redis_client, 502, b"", content_type="text/html")
    error, (entry,) = reply.json()["error"], reply.new_entries
    assert reply.status == 502, reply.describe()
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_error")
    assert error["message"] == "Upstream returned HTTP 502: no body"
    assert_billed_at_reserve(entry)  # a bare 5xx may hide spent tokens


async def test_a_rate_limit_in_plain_text_keeps_its_status_and_retry_advice_billed_nothing(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A gateway's 429 is not in the provider's format: still a refusal (no work done, nothing
    # billed), with the retry-after the SDK waits for.
    proxy = await proxy_before(make_proxy, script.base_url)
    limited = {"retry-after": "7", "x-ratelimit-remaining-requests": "0"}
    plain = {"content_type": "text/plain", "extra_headers": limited}
    reply = await answer(proxy, script, redis_client, 429, b"Too Many Requests", **plain)
    (entry,) = reply.new_entries
    assert (reply.status, reply.json()["error"]["code"]) == (429, "upstream_4xx"), reply.describe()
    assert (reply.headers["retry-after"], reply.headers["x-ratelimit-remaining-requests"]) == ("7", "0")
    assert (entry["outcome"], entry["total_tokens"]) == ("upstream_4xx", "0")


async def test_an_error_that_reports_usage_is_billed_on_it(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # README: upstream_4xx "0 unless it sent usage", upstream_error "provider usage if any": a
    # refusal that says what it spent (a context overflow found after the prompt was read) bills
    # that, not 0.
    proxy = await proxy_before(make_proxy, script.base_url)
    usage = {"prompt_tokens": 40, "completion_tokens": 0, "total_tokens": 40}
    for status, outcome in ((400, "upstream_4xx"), (500, "upstream_error")):
        error = {"error": {"message": "context too long", "type": "invalid_request_error"}, "usage": usage}
        reply = await answer(proxy, script, redis_client, status, dumps(error))
        (entry,) = reply.new_entries
        assert reply.status == status, reply.describe()
        assert (entry["outcome"], entry["usage_source"], entry["input_tokens"]) == (outcome, "provider", "40")


async def test_a_failed_answer_billed_at_its_reserve_keeps_the_searches_it_showed_past_the_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # Billed at its reserve, the call's exact input count replaces the quick one at the settle:
    # the usage made again from the reserve dropped the searches the answer showed, and billed
    # the one reserved (max_tool_calls) instead of the three made.
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10"})
    searches = [{**SEARCH_ITEM, "id": f"ws_{i}"} for i in range(3)]
    failed = {**_response(searches, status="failed"), "usage": None, "error": {"code": "server_error"}}
    body = {"model": "gpt-x", "input": "news?", "tools": [{"type": "web_search"}], "max_tool_calls": 1}
    script.plan = Plan(chunks=[dumps(failed)])
    status, _ = await _post(proxy.url, "/v1/responses", body, "searched")
    entry = await _entry(redis_client)
    assert (status, entry["outcome"], entry["usage_source"]) == (200, "upstream_error", "reserve"), entry
    assert entry["tool_calls"] == "web_search=3", entry


async def test_an_unexpected_error_after_the_call_went_out_is_billed_not_dropped(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The safety net of ``Exchange.run``: a bug of the proxy's while it relays an answer the
    # provider ran and billed must not leave the call free (nor a stack trace to the client).
    async def broken(ex: Any, upstream: aiohttp.ClientResponse) -> Any:
        raise RuntimeError("a bug while relaying")

    monkeypatch.setattr(relay, "relay_body", broken)
    proxy = await proxy_before(make_proxy, script.base_url)
    reply = await answer(proxy, script, redis_client, 200, dumps(chat_body()))
    (entry,) = reply.new_entries
    assert reply.status == 500 and b"a bug while relaying" not in reply.body, reply.describe()
    assert entry["outcome"] == "upstream_error"
    assert_billed_at_reserve(entry)


async def _raw_chat_call(proxy: Any, receive_buffer: int | None = 4096) -> socket.socket:
    """A client connected to ``proxy`` that sent the chat call ``CHAT`` and reads nothing yet
    (a small receive buffer: what it does not read stays with the proxy)."""
    path, request = CHAT
    data = dumps(request)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    loop = asyncio.get_running_loop()
    client = socket.socket()
    if receive_buffer is not None:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    client.setblocking(False)
    await loop.sock_connect(client, ("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])))
    await loop.sock_sendall(client, head.encode() + data)
    return client


async def test_a_client_that_stops_reading_a_whole_answer_is_dropped_and_billed_as_answered(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A stream's client that stops reading is dropped after the write timeout (a third of the
    lease: here 4/3 s). A whole answer went into the client's transport buffer at once, and
    aiohttp waited without bound for it to be taken: a client that kept its connection and never
    read held a 16 MiB answer twice (32.1 MB still held after 3 s: the buffer and the response's
    body) for as long as it liked. Its call was settled before the write: billed as before."""
    n = 16 * MB
    body = dumps(chat_body("x" * n))
    script.plan = Plan(chunks=split(body))
    proxy = await proxy_before(make_proxy, script.base_url, **A_LEASE_OF_4_S)
    loop = asyncio.get_running_loop()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        client = await _raw_chat_call(proxy)
    except BaseException:
        tracemalloc.stop()
        raise
    try:
        try:
            await asyncio.sleep(3)  # more than twice the write timeout
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert held < n, f"{held / MB:.1f} MB still held for a {n // MB} MB answer its client does not read"
        got = 0
        with contextlib.suppress(ConnectionResetError):  # ended: reset or closed
            while piece := await asyncio.wait_for(loop.sock_recv(client, 1024 * 1024), 10):
                got += len(piece)
    finally:
        client.close()
    assert got < len(body), "the client's connection ended with the whole answer"
    entry = await _entry(redis_client)
    billed = (entry["outcome"], entry["usage_source"], entry["input_tokens"], entry["output_tokens"])
    assert billed == ("ok", "provider", "3", "1"), entry


async def test_a_client_that_keeps_reading_a_whole_answer_slower_than_the_write_timeout_gets_it_all(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """What drops a client is a write timeout (4/3 s here) in which it took none of the answer,
    not the time the whole answer takes: a 24 MiB answer read at about 6 MB/s comes whole."""
    body = dumps(chat_body("x" * 24 * MB))
    script.plan = Plan(chunks=split(body))
    proxy = await proxy_before(make_proxy, script.base_url, **A_LEASE_OF_4_S)
    loop = asyncio.get_running_loop()
    client = await _raw_chat_call(proxy, receive_buffer=None)
    started, got = loop.time(), bytearray()
    try:
        while not got.endswith(body[-100:]):
            piece = await asyncio.wait_for(loop.sock_recv(client, 256 * 1024), 10)
            assert piece, f"the connection ended after {len(got)} bytes of {len(body)}"
            got += piece
            await asyncio.sleep(0.04)
    finally:
        client.close()
    assert loop.time() - started > 2, "read fast: nothing tested"
    assert got.endswith(body)
    entry = await _entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry


# A placeholder key (vLLM's documented "EMPTY", Ollama's "ollama") is no secret: scrubbed, it was
# replaced in answers that name it or happen to hold it (the legacy endpoints hunt).
# A float32 vector whose base64 holds the five letters of the key (any 5 letters of base64's
# alphabet turn up in about 1 in 10^9 positions: a 2,048 batch of 3,072-dimension vectors holds
# 33 million positions, so a few per cent of such batches).
VECTOR_B64 = "AAAEMPTY" + "A" * 24


async def test_an_embeddings_base64_answer_reaches_the_client_as_the_provider_sent_it(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url), upstream_key="EMPTY")
    answer = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": VECTOR_B64}],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
    }
    script.plan = Plan(chunks=[dumps(answer)])
    async with proxy.client() as client:
        raw = await client.embeddings.with_raw_response.create(
            model="text-embedding-3-small", input="hello world", extra_headers=run_headers("b64")
        )
    sent = raw.http_response.json()["data"][0]["embedding"]
    assert sent == VECTOR_B64, sent  # was "AAA[REDACTED]AAAA...": the SDK could not decode it


async def test_a_completion_text_naming_the_upstream_key_reaches_the_client_as_sent(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url), upstream_key="ollama")
    text = " Run `ollama pull llama3` first."
    answer = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "llama3",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
    }
    script.plan = Plan(chunks=[dumps(answer)])
    async with proxy.client() as client:
        reply = await client.completions.create(
            model="llama3", prompt="How do I get llama3?", max_tokens=20, extra_headers=run_headers("t")
        )
    assert reply.choices[0].text == text, reply.choices[0].text  # was "Run `[REDACTED] pull ...`"


async def test_a_streamed_completion_naming_the_upstream_key_reaches_the_client_as_sent(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url), upstream_key="ollama")
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "llama3"}
    pieces = [" Run", " `ollama", " pull", " llama3`."]
    events = [
        {**head, "choices": [{"index": 0, "text": p, "logprobs": None, "finish_reason": None}]}
        for p in pieces
    ]
    events.append({**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]})
    events.append(
        {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}
    )
    chunks = [b"data: " + dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    async with proxy.client() as client:
        stream = await client.completions.create(
            model="llama3",
            prompt="How do I get llama3?",
            max_tokens=20,
            stream=True,
            extra_headers=run_headers("s"),
        )
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    entry = await the_entry(proxy, "s")
    assert (entry["usage_source"], entry["output_tokens"]) == ("provider", "4"), entry
    assert text == "".join(pieces), text  # was " Run `[REDACTED] pull llama3`."
