"""Forwarding: the stall guard of streams (only the upstream's silence while the relay waits
counts), a request that cannot go out, and what a call leaves in the connection it opened."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import parse_qs

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from pydantic import SecretStr
from yarl import URL

from proxy.app import build_app
from proxy.call import Call
from proxy.config_load import parse_config
from proxy.forward import StallGuard
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from proxy.tokenizer import Tokenizer
from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy, ProxyFactory, base_config, unreachable_port
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import raw_post, the_entry, upstream_override

MSGS: list[Any] = [{"role": "user", "content": "hi"}]


class Content:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def set_exception(self, exc: BaseException) -> None:
        self.errors.append(exc)


def response() -> Any:
    return SimpleNamespace(connection=None, content=Content())


async def test_a_wait_longer_than_the_timeout_fails_the_read() -> None:
    upstream = response()
    guard = StallGuard(cast(aiohttp.ClientResponse, upstream), 0.2)
    guard.waiting_since = time.monotonic()
    await asyncio.sleep(0.35)
    (error,) = upstream.content.errors
    assert isinstance(error, TimeoutError)
    guard.cancel()


async def test_time_spent_elsewhere_does_not_count() -> None:
    # A short wait overslept on a loaded machine must stay under the timeout: a wide margin.
    upstream = response()
    guard = StallGuard(cast(aiohttp.ClientResponse, upstream), 0.6)
    await asyncio.sleep(0.8)  # not waiting on the upstream (writing to the client, say)
    for _ in range(4):  # short waits, each well under the timeout
        guard.waiting_since = time.monotonic()
        await asyncio.sleep(0.1)
        guard.waiting_since = None
    assert upstream.content.errors == []
    guard.waiting_since = time.monotonic()
    await asyncio.sleep(1.2)
    assert len(upstream.content.errors) == 1
    guard.cancel()


@pytest.mark.skewed_loop_clock
async def test_the_guard_fails_a_stall_on_a_loop_whose_clock_is_not_monotonics() -> None:
    # It re-armed with call_at(a time.monotonic() instant): on a loop 1000 s behind, never again.
    await test_time_spent_elsewhere_does_not_count()


async def test_a_request_aiohttp_refuses_to_send_is_not_billed(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A header value aiohttp cannot send (a key with a line break, as a secrets file gives it,
    before the config stripped it): nothing went out, so nothing is billed. It was a 500 billed
    at its reserve."""
    raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "j"))
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    broken = config.upstreams["openai"].model_copy(update={"api_key": SecretStr("sk-one\nsk-two")})
    config = config.model_copy(update={"upstreams": {"openai": broken}})
    runner = web.AppRunner(build_app(config, tokenizer=Tokenizer({}), run_reaper_task=False))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=body, headers={"Authorization": f"Bearer {KEY_A}"}) as resp:
                assert resp.status == 502, await resp.text()
    finally:
        await runner.cleanup()
    assert fake.received == []
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert (entry["usage_source"], entry["total_tokens"], entry["outcome"]) == ("none", "0", "upstream_error")


@pytest.mark.parametrize(
    ("stream", "timeout_s", "connect_timeout_s"),
    # A bound of the whole call below the connect's fired in the connect: a stream's bound on
    # its headers, a whole answer's total timeout (a bare TimeoutError, taken for a call out).
    # The first's total is past the client's patience (``send``'s 15 s): without its own connect
    # bound, a whole answer's connect waited for the total instead.
    [(False, 30, 0.3), (True, 0.5, 1.5), (False, 0.5, 1.5)],
    ids=["json", "stream-timeout-below-connect", "json-timeout-below-connect"],
)
async def test_a_connect_timeout_is_billed_nothing_for_nothing_went_out(
    make_proxy: Any, redis_client: aioredis.Redis, stream: bool, timeout_s: float, connect_timeout_s: float
) -> None:
    # Was billed at the reserve (1,009 tokens) as a call that may have run: the connection was
    # never made, so the request never left.
    from tests.test_bad_input import dumps, send

    with unreachable_port("connect_timeout") as port:
        upstream = {
            "base_url": f"http://127.0.0.1:{port}/v1",
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": timeout_s,
            "connect_timeout_s": connect_timeout_s,
        }
        proxy = await make_proxy(upstreams={"openai": upstream})
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        reply = await send(proxy, lambda: [], redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert reply.status == 504 and entry["outcome"] == "upstream_timeout"
    assert (entry["usage_source"], entry["input_tokens"], entry["output_tokens"]) == ("none", "0", "0")


async def test_the_client_s_query_string_goes_upstream_as_it_came(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Was dropped: an Azure-style gateway's api-version, a server's options in the query (the
    # SDKs' default_query / extra_query) never reached the upstream.
    proxy = await make_proxy()
    client = proxy.client(default_query={"api-version": "2024-06-01"})
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, extra_query={"opt": "a b&c=/é+"})
    sent = fake.received[-1]
    assert sent.path == "/v1/chat/completions"
    assert parse_qs(sent.query) == {"api-version": ["2024-06-01"], "opt": ["a b&c=/é+"]}
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, stream=True, extra_query={"x": "1"}
    )
    async for _chunk in stream:
        pass
    assert fake.received[-1].query == "api-version=2024-06-01&x=1"
    await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=MSGS)
    assert fake.received[-1].query == ""
    # Byte for byte, percent-encoding included; on an Anthropic upstream too (the anthropic
    # SDK's beta namespace sends ?beta=true).
    upstream = {"base_url": fake.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    claude = await make_proxy(upstreams={"claude": upstream}, models={"*": {"upstream": "claude"}})
    body = {"model": "claude-sonnet-4", "max_tokens": 10, "messages": MSGS}
    query = "beta=true&q=a%2Bb+c%26%C3%A9&flag"
    url = URL(f"{claude.url}/v1/messages?{query}", encoded=True)
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    assert (fake.received[-1].path, fake.received[-1].query) == ("/v1/messages", query)


async def test_a_query_s_escapes_go_upstream_as_they_came(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Escapes a URL parser may decode (%2F, %3F, %3A, %40, %7E: a signed query's, a SAS token's
    base64 %2F) go as sent: the query is the client's, byte for byte."""
    proxy = await make_proxy()
    query = "sig=ab%2Fcd%3D&next=%3Fx%3Ay%40z&t=%7E"
    url = URL(f"{proxy.url}/v1/chat/completions?{query}", encoded=True)
    body = {"model": "gpt-4o-mini", "messages": MSGS}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    assert fake.received[-1].query == query


def unsendable_base_url(proxy: Proxy, base_url: str) -> None:
    """The proxy's upstream moved to ``base_url`` around the config's checks (as a model_copy
    would), for what the call does with a URL aiohttp refuses."""
    state = proxy.app[STATE]
    config = state.config
    moved = config.upstreams["openai"].model_copy(update={"base_url": base_url})
    state.config = config.model_copy(update={"upstreams": {**config.upstreams, "openai": moved}})


async def test_a_url_aiohttp_cannot_build_is_not_billed_with_a_query_either(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """A base_url whose host has no IDNA form (an empty label): aiohttp refuses the URL, nothing
    goes out, a 502 billed 0. With a query the URL was built before that guard: a 500, its
    reservation left to a reaper, which bills its reserve."""
    from tests.test_bad_input import dumps, send

    proxy = await make_proxy()
    unsendable_base_url(proxy, "http://ex\u00e4mple..com/v1")  # the config refuses it now
    body = {"model": "gpt-4o-mini", "messages": MSGS}
    for path in ("/v1/chat/completions", "/v1/chat/completions?api-version=1"):
        reply = await send(proxy, lambda: [], redis_client, path, dumps(body))
        assert reply.status == 502, (path, reply.body)
        (entry,) = reply.new_entries
        billed = (entry["outcome"], entry["usage_source"], entry["total_tokens"])
        assert billed == ("upstream_error", "none", "0"), entry


async def test_a_call_does_not_outlive_itself_in_the_upstream_connection_it_opened(
    make_proxy: ProxyFactory,
) -> None:
    """The context ``open_upstream`` sends a call in held the call for good, and the upstream
    connection made in it keeps a copy of that context (its transport, its keep-alive timer):
    a call with a 1 MB prompt stayed alive after ten later calls had reused its connection, for
    as long as the pool kept it (one per concurrent call: a burst of large prompts pinned them
    all)."""
    proxy = await make_proxy()
    big = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "big " * 250_000}],
        "max_tokens": 5,
    }
    small = {"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 5}
    auth = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=big, headers=auth) as resp:
            assert resp.status == 200
            first = resp.headers["x-request-id"]
            await resp.read()
        for _ in range(10):  # later calls, on the same upstream connection
            async with session.post(proxy.url + "/v1/chat/completions", json=small, headers=auth) as resp:
                assert resp.status == 200
                await resp.read()
    await proxy.recorded()
    await asyncio.sleep(0.2)  # the last call's handler and settle tasks end
    gc.collect()
    alive = [(c.request_id == first, len(json.dumps(c.body))) for c in gc.get_objects() if type(c) is Call]
    assert not alive, f"calls alive once ended ((the first?, body bytes)): {alive}"


def http_answer(status: bytes, body: bytes) -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    return head % (status, len(body)) + body


class KeepAliveUpstream:
    """A raw HTTP/1.1 upstream that keeps its connections open: its n-th request (over all its
    connections) is answered ``answer n``, with 10 + n input tokens. ``stray`` is written once
    after the first answer, while the proxy holds that connection idle in its pool."""

    def __init__(self, stray: bytes = b"") -> None:
        self.stray = stray
        self.requests = 0
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> dict[str, Any]:
        """The ``upstreams`` of a proxy sending to it."""
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return upstream_override(f"http://127.0.0.1:{port}/v1", timeout_s=3)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                n, self.requests = self.requests, self.requests + 1
                usage = {"prompt_tokens": 10 + n, "completion_tokens": 1, "total_tokens": 11 + n}
                message = {"role": "assistant", "content": f"answer {n}"}
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
                body = {"id": "c", "object": "chat.completion", "model": "gpt-4o-mini", "usage": usage}
                writer.write(http_answer(b"200 OK", json.dumps({**body, "choices": [choice]}).encode()))
                await writer.drain()
                if n == 0 and self.stray:
                    await asyncio.sleep(0.05)  # the proxy has read the answer and pooled the connection
                    writer.write(self.stray)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


CHAT = {"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 50}


async def test_an_answer_the_upstream_sent_on_an_idle_pooled_connection_is_no_call_s_answer(
    make_proxy: ProxyFactory,
) -> None:
    """An upstream (a gateway) that writes one answer too many on a keep-alive connection (a
    duplicate, or its answer to bytes it took for a request) while the proxy holds it idle:
    aiohttp read and queued it, and the next call sent on that connection took it for its own.
    That call was billed on the stray answer (a 400: nothing) though the upstream ran it, and its
    own answer, text and usage, went to the call after it (another tenant's, as likely): answers
    crossed between callers. Such a connection is closed, not reused."""
    error = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
    upstream = KeepAliveUpstream(stray=http_answer(b"400 Bad Request", json.dumps(error).encode()))
    try:
        proxy = await make_proxy(upstreams=await upstream.start())
        first = await raw_post(proxy, CHAT, "one")
        assert (first.status, b"answer 0" in first.body) == (200, True), first
        await asyncio.sleep(0.2)  # the stray answer has come in
        second = await raw_post(proxy, CHAT, "two")
        third = await raw_post(proxy, CHAT, "three")
    finally:
        upstream.close()
    assert (second.status, b"answer 1" in second.body) == (200, True), second
    assert (third.status, b"answer 2" in third.body) == (200, True), third
    entry = await the_entry(proxy, "two")
    assert (entry["outcome"], entry["input_tokens"]) == ("ok", "11"), entry
    assert upstream.connections == 2  # the second on a new one, the third reusing it
