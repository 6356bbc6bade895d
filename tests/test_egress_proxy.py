"""An egress proxy between the gateway and its upstreams: calls (whole and streamed) and the model
list go through it, an https upstream tunnelled by CONNECT, an http one in absolute form; billed as
usual; a proxy that refuses (its connection, its credentials, the CONNECT) fails the call before
it goes out, billed nothing and told without the proxy's password; a tunnel cut after the request
went out bills the reserve; NO_PROXY; a reload changes it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from proxy.auth import Identity
from proxy.config_load import parse_config
from proxy.forward import operator_secrets
from proxy.redis_server import RedisServerProcess
from proxy.scrub import scrubbed
from tests.conftest import KEY_A, PrivateCA, Proxy, ProxyFactory, base_config, refused_port
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import (
    JsonDict,
    assert_zero_usage,
    raw_post,
    run_headers,
    the_entry,
    upstream_override,
)
from tests.procs import ProxyProcess
from tests.test_budgets import _proxy_from_file, _reload_to

MODEL = "gpt-4o-mini"
MSGS: list[Any] = [{"role": "user", "content": "hi"}]
PROXY_USER = "gateway"
PROXY_PASSWORD = "pr0xy-s3cret-pw"


class ForwardProxy:
    """A small forward proxy: CONNECT tunnels (``connects``) and absolute-form requests
    (``forwarded``, each on a connection of its own to the origin, its Proxy-* headers taken off).
    ``password``: Proxy-Authorization demanded (407 without it); ``connect_status``: every
    CONNECT answered so; ``close_after_connect``: the tunnel accepted, then closed."""

    def __init__(self, *, password: str | None = None, connect_status: int | None = None) -> None:
        self.password = password
        self.connect_status = connect_status
        self.close_after_connect = False
        self.connects: list[str] = []
        self.forwarded: list[str] = []
        self.authorizations: list[str | None] = []
        self.refused = 0
        self.tunnelled_bytes = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    def url(self, credentials: str = "") -> str:
        return f"http://{credentials}127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        """Every connection through it closed at once."""
        for writer in list(self._writers):
            writer.transport.abort()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self._one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        request_line, *lines = head.split("\r\n")[:-2]
        method, target, _ = request_line.split(" ")
        headers = [line.split(":", 1) for line in lines]
        found = {name.strip().lower(): value.strip() for name, value in headers}
        authorization = found.get("proxy-authorization")
        self.authorizations.append(authorization)
        if self.password is not None and authorization != aiohttp.encode_basic_auth(
            PROXY_USER, self.password
        ):
            self.refused += 1
            # A page quoting what it was sent, as some proxies' do: never to reach a client.
            page = f"<html>407: {authorization} is not {PROXY_USER}</html>".encode()
            writer.write(
                b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=x\r\n"
                b"Content-Type: text/html\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(page), page)
            )
            await writer.drain()
            return
        if method == "CONNECT":
            self.connects.append(target)
            if self.connect_status is not None:
                writer.write(b"HTTP/1.1 %d Refused\r\nContent-Length: 0\r\n\r\n" % self.connect_status)
                await writer.drain()
                return
            host, _, port = target.rpartition(":")
            origin_reader, origin_writer = await asyncio.open_connection(host, int(port))
            self._writers.add(origin_writer)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            if self.close_after_connect:
                origin_writer.close()
                return
            await self._splice(reader, writer, origin_reader, origin_writer)
            return
        self.forwarded.append(target)
        url = urlsplit(target)
        length = int(found.get("content-length", "0"))
        body = await reader.readexactly(length) if length else b""
        kept = [
            f"{name}:{value}"
            for name, value in headers
            if not name.lower().startswith(("proxy-", "connection"))
        ]
        path = url.path + (f"?{url.query}" if url.query else "")
        sent = "\r\n".join([f"{method} {path} HTTP/1.1", *kept, "Connection: close", "", ""]).encode(
            "latin-1"
        )
        origin_reader, origin_writer = await asyncio.open_connection(url.hostname, url.port)
        self._writers.add(origin_writer)
        origin_writer.write(sent + body)
        await origin_writer.drain()
        await self._copy(origin_reader, writer)
        origin_writer.close()

    async def _splice(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        origin_reader: asyncio.StreamReader,
        origin_writer: asyncio.StreamWriter,
    ) -> None:
        both = [
            asyncio.ensure_future(self._copy(reader, origin_writer)),
            asyncio.ensure_future(self._copy(origin_reader, writer)),
        ]
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        for task in both:
            task.cancel()
        origin_writer.close()

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                self.tunnelled_bytes += len(data)
                writer.write(data)
                await writer.drain()


async def tunnelled(
    make_proxy: ProxyFactory, https_upstream: str, egress: ForwardProxy, private_ca: PrivateCA
) -> Proxy:
    """A gateway whose https upstream is reached through ``egress``, its certificate trusted."""
    return await make_proxy(
        upstreams=upstream_override(https_upstream, proxy=egress.url(), ca_file=str(private_ca.ca))
    )


async def billed_nothing(proxy: Proxy, run: str = "r1") -> JsonDict:
    """The run's one entry, which counts no request and bills no token."""
    entry = await the_entry(proxy, run, requests=0)
    assert_zero_usage(entry)
    return entry


@pytest.fixture
async def egress() -> AsyncIterator[ForwardProxy]:
    server = ForwardProxy()
    await server.start()
    yield server
    await server.close()


async def chat_and_stream(proxy: Proxy) -> None:
    async with proxy.client() as client:
        answer = await client.chat.completions.create(
            model=MODEL, messages=MSGS, extra_headers=run_headers("r1")
        )
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSGS, stream=True, extra_headers=run_headers("r2")
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text
    await proxy.recorded()
    for run in ("r1", "r2"):
        entry = await the_entry(proxy, run)
        assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry


async def test_an_https_upstream_is_reached_through_the_proxy_by_connect_billed_as_usual(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    egress: ForwardProxy,
    https_upstream: str,
    private_ca: PrivateCA,
) -> None:
    egress.password = PROXY_PASSWORD
    proxy = await make_proxy(
        upstreams=upstream_override(
            https_upstream, proxy=egress.url(), proxy_auth_env="EGRESS_AUTH", ca_file=str(private_ca.ca)
        ),
        environ={"EGRESS_AUTH": f"{PROXY_USER}:{PROXY_PASSWORD}"},
    )
    await chat_and_stream(proxy)
    port = urlsplit(https_upstream).port
    # One tunnel, kept for the second call (the connection pooled through the proxy).
    assert egress.connects == [f"127.0.0.1:{port}"]
    assert egress.authorizations == [aiohttp.encode_basic_auth(PROXY_USER, PROXY_PASSWORD)]
    assert egress.tunnelled_bytes > 0
    assert len(fake.received) == 2
    # The proxy's credentials went in the CONNECT alone, never inside the tunnel.
    assert all("Proxy-Authorization" not in received.headers for received in fake.received)


async def test_an_http_upstream_and_its_model_list_go_through_the_proxy_in_absolute_form(
    make_proxy: ProxyFactory, fake: FakeUpstream, egress: ForwardProxy
) -> None:
    egress.password = PROXY_PASSWORD
    proxy = await make_proxy(
        upstreams=upstream_override(fake.base_url, proxy=egress.url(f"{PROXY_USER}:{PROXY_PASSWORD}@"))
    )
    await chat_and_stream(proxy)
    async with proxy.client() as client:
        models = await client.models.list()
    assert models.data
    assert egress.forwarded == [
        f"{fake.base_url}/chat/completions",
        f"{fake.base_url}/chat/completions",
        f"{fake.base_url}/models",
    ]
    assert egress.refused == 0 and egress.connects == []
    assert len(fake.received) == 3
    assert all("Proxy-Authorization" not in received.headers for received in fake.received)


@pytest.mark.parametrize("scheme", ["https", "http"])
async def test_a_proxy_refusing_the_credentials_bills_nothing_and_says_so_without_the_password(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    egress: ForwardProxy,
    https_upstream: str,
    private_ca: PrivateCA,
    scheme: str,
) -> None:
    egress.password = "another-password"
    base_url = https_upstream if scheme == "https" else fake.base_url
    proxy = await make_proxy(
        upstreams=upstream_override(
            base_url,
            proxy=egress.url(f"{PROXY_USER}:{PROXY_PASSWORD}@"),
            **({"ca_file": str(private_ca.ca)} if scheme == "https" else {}),
        )
    )
    async with proxy.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers=run_headers("r1"))
        with pytest.raises(openai.InternalServerError) as listed:
            await client.models.list()
    response = caught.value.response
    assert response.status_code == 502
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["message"].endswith("the egress proxy refused the proxy's credentials (HTTP 407)"), error
    assert error["code"] == "upstream_error"
    assert "proxy's credentials (HTTP 407)" in listed.value.response.json()["error"]["message"]
    for told in (response, listed.value.response):
        assert PROXY_PASSWORD not in told.text and str(egress.port) not in told.text
        assert "gateway" not in told.text.replace("the egress proxy", "")
    entry = await the_entry(proxy, "r1", requests=0)
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "none")
    assert_zero_usage(entry)
    assert egress.refused == 2 and fake.received == []


async def test_a_proxy_refusing_the_connection_bills_nothing_and_is_told_in_openais_format(
    make_proxy: ProxyFactory, fake: FakeUpstream, https_upstream: str
) -> None:
    closed = f"http://{PROXY_USER}:{PROXY_PASSWORD}@127.0.0.1:{refused_port()}"
    proxy = await make_proxy(upstreams=upstream_override(https_upstream, proxy=closed))
    async with proxy.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers=run_headers("r1"))
    response = caught.value.response
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert message.endswith("cannot connect to the egress proxy: Connection refused"), message
    assert PROXY_PASSWORD not in response.text and "127.0.0.1" not in response.text
    entry = await the_entry(proxy, "r1", requests=0)
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "none")
    assert_zero_usage(entry)
    assert fake.received == []


@pytest.mark.parametrize("status", [502, 503, 403])
async def test_a_connect_the_proxy_refuses_never_reached_the_provider_and_bills_nothing(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    egress: ForwardProxy,
    https_upstream: str,
    private_ca: PrivateCA,
    status: int,
) -> None:
    egress.connect_status = status
    proxy = await tunnelled(make_proxy, https_upstream, egress, private_ca)
    result = await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")
    assert result.status == 502
    message = result.json()["error"]["message"]
    assert message.endswith(
        f"the egress proxy could not connect to the upstream (HTTP {status} to its CONNECT)"
    )
    await billed_nothing(proxy)
    assert len(egress.connects) == 1 and fake.received == []


async def test_a_certificate_re_signed_by_a_ca_not_trusted_is_refused_in_the_tunnel_billed_nothing(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    egress: ForwardProxy,
    https_upstream: str,
    private_ca: PrivateCA,
) -> None:
    # An intercepting proxy (Squid's ssl-bump) shows a certificate its own CA signed: trusted by
    # ca_file through the tunnel (above), refused without it (the system's CAs) or with another
    # CA's, before the request is written.
    for run, extra in (("r1", {}), ("r2", {"ca_file": str(private_ca.other_ca)})):
        proxy = await make_proxy(upstreams=upstream_override(https_upstream, proxy=egress.url(), **extra))
        result = await raw_post(proxy, {"model": MODEL, "messages": MSGS}, run)
        assert result.status == 502
        error = result.json()["error"]
        assert error["code"] == "upstream_error"
        assert error["message"].startswith(
            "cannot connect to upstream: its TLS certificate is not trusted ("
        ), error
        assert b"127.0.0.1" not in result.body and str(egress.port).encode() not in result.body
        entry = await the_entry(proxy, run, requests=0)
        assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "none")
        assert_zero_usage(entry)
    assert len(egress.connects) == 2 and fake.received == []


async def test_a_tunnel_closed_before_the_tls_handshake_ends_bills_nothing(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    egress: ForwardProxy,
    https_upstream: str,
    private_ca: PrivateCA,
) -> None:
    # The proxy took the CONNECT (200), then closed: the connection was never made, the request
    # never written.
    egress.close_after_connect = True
    proxy = await tunnelled(make_proxy, https_upstream, egress, private_ca)
    result = await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")
    assert result.status == 502
    await billed_nothing(proxy)
    assert fake.received == []


async def test_a_tunnel_cut_after_the_request_went_out_bills_the_reserve(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    egress: ForwardProxy,
    https_upstream: str,
    private_ca: PrivateCA,
) -> None:
    proxy = await tunnelled(make_proxy, https_upstream, egress, private_ca)
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 50, "fake": {"hold": True}}
    posting = asyncio.ensure_future(raw_post(proxy, body, "r1"))
    for _ in range(500):
        if fake.received:
            break
        await asyncio.sleep(0.01)
    egress.cut()
    result = await posting
    assert result.status == 502
    entry = await the_entry(proxy, "r1")  # a request made: it reached the provider
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry
    assert int(entry["output_tokens"]) == 50
    fake.release()


async def test_a_messages_call_refused_by_the_proxy_is_told_in_anthropics_format(
    make_proxy: ProxyFactory, fake: FakeUpstream, egress: ForwardProxy
) -> None:
    egress.password = PROXY_PASSWORD
    upstreams = upstream_override(fake.base_url, kind="anthropic", proxy=egress.url())
    proxy = await make_proxy(upstreams=upstreams, models={"claude-sonnet-4": {"upstream": "openai"}})
    body = {"model": "claude-sonnet-4", "max_tokens": 20, "messages": MSGS}
    result = await raw_post(proxy, body, "r1", path="/v1/messages")
    assert result.status == 502
    told = result.json()
    assert told["type"] == "error" and "HTTP 407" in told["error"]["message"], told
    await billed_nothing(proxy)


@pytest.mark.parametrize(
    ("environ", "through"),
    [
        ({"HTTP_PROXY": "{proxy}"}, True),  # a loopback upstream is proxied unless named, as curl's
        ({"http_proxy": "{proxy}", "NO_PROXY": "example.com, 127.0.0.1"}, False),
        ({"HTTP_PROXY": "{proxy}", "no_proxy": "*"}, False),
        ({"HTTP_PROXY": "{proxy}", "NO_PROXY": "127.0.0.1:{port}"}, False),
        ({"HTTP_PROXY": "{proxy}", "NO_PROXY": "127.0.0.1:1"}, True),
        ({"HTTP_PROXY": "{proxy}", "NO_PROXY": "127.0.0.0/8"}, False),
        ({"HTTPS_PROXY": "{proxy}"}, False),  # an http upstream reads HTTP_PROXY
    ],
)
async def test_the_environments_proxy_and_no_proxy(
    make_proxy: ProxyFactory, fake: FakeUpstream, egress: ForwardProxy, environ: dict[str, str], through: bool
) -> None:
    port = str(urlsplit(fake.base_url).port)
    filled = {name: value.format(proxy=egress.url(), port=port) for name, value in environ.items()}
    proxy = await make_proxy(environ=filled)
    result = await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")
    assert result.status == 200
    assert len(egress.forwarded) == (1 if through else 0)
    assert len(fake.received) == 1


@pytest.mark.parametrize("off", [None, ""])
async def test_an_upstreams_own_proxy_null_or_empty_turns_the_environments_off(
    make_proxy: ProxyFactory, fake: FakeUpstream, egress: ForwardProxy, off: str | None
) -> None:
    proxy = await make_proxy(
        upstreams=upstream_override(fake.base_url, proxy=off), environ={"HTTP_PROXY": egress.url()}
    )
    assert proxy.config.upstreams["openai"].egress is None
    result = await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")
    assert result.status == 200 and egress.forwarded == []


def test_the_proxys_password_is_among_the_operators_secrets_scrubbed(fake: FakeUpstream) -> None:
    raw = base_config("https://api.example.com/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["openai"] |= {
        "proxy": "http://squid:3128",
        "proxy_auth_env": "EGRESS_AUTH",
        "passthrough_auth": True,
    }
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-k", "EGRESS_AUTH": f"{PROXY_USER}:{PROXY_PASSWORD}"})
    upstream = config.upstreams["openai"]
    token = aiohttp.encode_basic_auth(PROXY_USER, PROXY_PASSWORD).removeprefix("Basic ")
    for identity in (
        Identity(tenant="t", key_name="k", tier="standard"),
        Identity(tenant="t", key_name="k", tier="standard", upstream_key="sk-caller-own"),
    ):
        secrets = operator_secrets(upstream, identity)
        echoed = f'{{"error": "bad {PROXY_PASSWORD} and {token}"}}'.encode()
        assert PROXY_PASSWORD.encode() not in scrubbed(echoed, secrets)
        assert token.encode() not in scrubbed(echoed, secrets)
    # Nor in what a dump of the config shows (a log line, check-config).
    assert PROXY_PASSWORD not in repr(config) and PROXY_PASSWORD not in str(config.model_dump())


async def test_a_reload_changes_the_upstreams_proxy(
    fake: FakeUpstream,
    egress: ForwardProxy,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
) -> None:
    raw = base_config(fake.base_url, redis_server.url)
    raw["journal_dir"] = str(tmp_path / "journal")
    raw["upstreams"]["openai"]["proxy"] = ""
    path = tmp_path / "config.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")).status == 200
        assert egress.forwarded == []
        raw["upstreams"]["openai"]["proxy"] = egress.url()
        await _reload_to(proxy, raw, path)
        assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r2")).status == 200
        assert egress.forwarded == [f"{fake.base_url}/chat/completions"]
    finally:
        await proxy.runner.cleanup()


class SlowConnectProxy(ForwardProxy):
    """Answers every CONNECT only after ``delay_s``."""

    delay_s = 3.0

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.delay_s)
        await super()._one(reader, writer)


class ProxyAnsweringFor(ForwardProxy):
    """An http upstream's request answered by the proxy itself, as Squid or Envoy do when they
    cannot reach the origin: a 502, an HTML page, and RFC 9209's Proxy-Status naming why."""

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        await reader.readexactly(length)
        self.forwarded.append(head.split(b" ")[1].decode())
        page = b"<html><body>ERR_CONNECT_FAIL: the origin refused the connection</body></html>"
        writer.write(
            b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\n"
            b"Proxy-Status: squid; error=connection_refused\r\n"
            b"X-Squid-Error: ERR_CONNECT_FAIL 111\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(page), page)
        )
        await writer.drain()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_proxy_slow_to_answer_the_connect_is_a_connect_timeout_billed_nothing(
    make_proxy: ProxyFactory, fake: FakeUpstream, https_upstream: str, private_ca: PrivateCA, stream: bool
) -> None:
    egress = SlowConnectProxy()
    await egress.start()
    try:
        proxy = await make_proxy(
            upstreams=upstream_override(
                https_upstream,
                proxy=egress.url(),
                ca_file=str(private_ca.ca),
                connect_timeout_s=0.5,
                timeout_s=30,
            )
        )
        started = time.monotonic()
        result = await raw_post(proxy, {"model": MODEL, "messages": MSGS, "stream": stream}, "r1")
        took = time.monotonic() - started
    finally:
        await egress.close()
    assert result.status == 504, result.body
    assert took < 2.5, took
    entry = await the_entry(proxy, "r1", requests=0)
    assert entry["outcome"] == "upstream_timeout"
    assert_zero_usage(entry)
    assert fake.received == []


async def test_a_407_the_provider_answers_inside_the_tunnel_is_not_the_egress_proxys_refusal(
    make_proxy: ProxyFactory, fake: FakeUpstream, https_upstream: str, private_ca: PrivateCA
) -> None:
    # The CONNECT went through (200, the proxy's credentials taken): whatever answers inside the
    # tunnel is the provider (or its gateway), whose answer the call reached. Told as the egress
    # proxy refusing its credentials, the operator mends credentials that were accepted.
    egress = ForwardProxy(password=PROXY_PASSWORD)
    await egress.start()
    try:
        proxy = await make_proxy(
            upstreams=upstream_override(
                https_upstream,
                proxy=egress.url(f"{PROXY_USER}:{PROXY_PASSWORD}@"),
                ca_file=str(private_ca.ca),
            )
        )
        body = {"model": MODEL, "messages": MSGS, "fake": {"mode": "error", "status": 407}}
        result = await raw_post(proxy, body, "r1")
    finally:
        await egress.close()
    assert len(fake.received) == 1 and egress.refused == 0
    assert "egress proxy refused" not in result.body.decode(), result.body
    await the_entry(proxy, "r1", requests=1)  # the call reached the provider: a request made


async def test_an_http_upstreams_proxy_saying_it_never_reached_the_origin_bills_nothing(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # RFC 9209: Proxy-Status error=connection_refused (dns_error, connection_timeout,
    # destination_unavailable...) says the proxy never reached the origin. The call never went
    # to the provider, yet it bills its whole reserve (a 5xx with no error body in its format).
    egress = ProxyAnsweringFor()
    await egress.start()
    try:
        proxy = await make_proxy(upstreams=upstream_override(fake.base_url, proxy=egress.url()))
        result = await raw_post(proxy, {"model": MODEL, "messages": MSGS, "max_tokens": 500}, "r1")
    finally:
        await egress.close()
    assert result.status == 502
    assert len(egress.forwarded) == 1 and fake.received == []
    await billed_nothing(proxy)


def test_the_proxys_password_in_its_url_is_not_in_the_configs_repr() -> None:
    # test_egress_proxy checks the repr for proxy_auth_env's password; the URL's own (as the
    # README offers it: http://USER:PASSWORD@HOST:PORT) is shown whole by repr and model_dump.
    raw = base_config("https://api.example.com/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["openai"]["proxy"] = f"http://{PROXY_USER}:{PROXY_PASSWORD}@squid:3128"
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-k"})
    assert PROXY_PASSWORD not in repr(config)
    assert PROXY_PASSWORD not in str(config.model_dump())


async def test_a_reload_changing_the_proxys_credentials_opens_a_new_tunnel(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    https_upstream: str,
    private_ca: PrivateCA,
) -> None:
    egress = ForwardProxy()
    await egress.start()
    raw = base_config(fake.base_url, redis_server.url)
    raw["journal_dir"] = str(tmp_path / "journal")
    raw["upstreams"]["openai"] |= {
        "base_url": https_upstream,
        "ca_file": str(private_ca.ca),
        "proxy": egress.url("a:old-password@"),
    }
    path = tmp_path / "config.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")).status == 200
        raw["upstreams"]["openai"]["proxy"] = egress.url("a:new-password@")
        await _reload_to(proxy, raw, path)
        assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r2")).status == 200
    finally:
        await proxy.runner.cleanup()
        await egress.close()
    assert egress.authorizations == [
        aiohttp.encode_basic_auth("a", "old-password"),
        aiohttp.encode_basic_auth("a", "new-password"),
    ]


async def test_two_workers_serve_through_a_proxy_with_credentials_and_a_ca_file(
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    https_upstream: str,
    private_ca: PrivateCA,
) -> None:
    egress = ForwardProxy(password=PROXY_PASSWORD)
    await egress.start()
    raw = base_config(https_upstream, redis_server.url)
    raw["upstreams"]["openai"] |= {
        "ca_file": str(private_ca.ca),
        "proxy": egress.url(),
        "proxy_auth_env": "EGRESS_AUTH",
    }
    served = ProxyProcess(raw, tmp_path, args=("--workers", "2"))
    try:
        await asyncio.to_thread(
            served.start, 40.0, extra_env={"EGRESS_AUTH": f"{PROXY_USER}:{PROXY_PASSWORD}"}
        )
        async with aiohttp.ClientSession() as session:
            for n in range(6):
                async with session.post(
                    served.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": MSGS},
                    headers={"Authorization": f"Bearer {KEY_A}", "X-Run-Id": f"w{n}"},
                ) as resp:
                    assert resp.status == 200, await resp.text()
    finally:
        served.stop()
        await egress.close()
    assert egress.refused == 0 and len(fake.received) == 6
