"""The HTTP level and the secrets on the request path: compressed answers, an HTTP/1.0
client's stream, and the operator's credentials (its key, or those of its ``base_url``) never
reaching a client nor letting one tenant act as another."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import brotli
import openai
import pytest
from aiohttp import web
from pydantic import ValidationError

from proxy.auth import Identity
from proxy.config import UpstreamConfig
from proxy.forward import caller_key_sent, operator_secrets, url_credentials
from tests.conftest import KEY_A, KEY_B, UPSTREAM_KEY, Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries, the_entry
from tests.test_forward import unsendable_base_url

JsonDict = dict[str, Any]
CHAT = "/v1/chat/completions"
BODY: JsonDict = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": USAGE,
}
# Credentials in base_url, as a gateway's basic auth: the config takes them (``_one_credential``).
GW_USER, GW_PASSWORD = "gw-user", "gw-pass-0123456789"
GW_TOKEN = base64.b64encode(f"{GW_USER}:{GW_PASSWORD}".encode()).decode()


def _chunk(delta: JsonDict, finish: str | None = None, usage: JsonDict | None = None) -> bytes:
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    event = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini"}
    event.update(choices=choices, usage=usage)
    return b"data: " + json.dumps(event).encode() + b"\n\n"


STREAM = (
    _chunk({"role": "assistant", "content": "hel"})
    + _chunk({"content": "lo"}, "stop")
    + _chunk({}, usage=USAGE)
    + b"data: [DONE]\n\n"
)


class Upstream:
    """An upstream answering every path with ``handler``."""

    def __init__(self) -> None:
        self.handler: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None
        self.calls = 0
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        assert self.handler is not None
        return await self.handler(request)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.base_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    def upstreams(self, *, in_url: bool = False, password: str = GW_PASSWORD) -> JsonDict:
        upstream: JsonDict = {"base_url": self.base_url, "timeout_s": 5, "connect_timeout_s": 2}
        if in_url:
            credentials = f"{GW_USER}:{quote(password, safe='')}"
            upstream["base_url"] = self.base_url.replace("http://", f"http://{credentials}@")
        else:
            upstream["api_key_env"] = "TEST_UPSTREAM_KEY"
        return {"openai": upstream}


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    assert up.runner is not None
    await up.runner.cleanup()


async def request(
    proxy: Proxy, path: str, body: JsonDict | None, run: str = "r", method: str = "POST"
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run, "Accept-Encoding": "gzip, br"}
    async with (
        aiohttp.ClientSession(auto_decompress=False) as session,
        session.request(method, proxy.url + path, json=body, headers=headers) as resp,
    ):
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()


def assert_no_secret(headers: dict[str, str], body: bytes, secrets: tuple[str, ...]) -> None:
    for secret in secrets:
        assert secret.encode() not in body, body
        assert all(secret not in value for value in headers.values()), headers


# -- the operator's key echoed in a response header -------------------------------------------


@pytest.mark.parametrize("name", ["x-request-id", "request-id", "x-ratelimit-limit-requests", "retry-after"])
@pytest.mark.parametrize("route", ["json", "stream", "models"])
async def test_a_provider_header_echoing_the_operators_key_never_reaches_the_client(
    make_proxy: ProxyFactory, upstream: Upstream, name: str, route: str
) -> None:
    """Bodies, stream events and the model list were scrubbed of the operator's key, not the
    provider's headers passed on (its request id as ``x-upstream-request-id``, its limits)."""
    echoed = {name: f"key={UPSTREAM_KEY}"}

    async def handler(request: web.Request) -> web.StreamResponse:
        if route == "stream":
            return web.Response(body=STREAM, headers={"Content-Type": "text/event-stream", **echoed})
        if route == "models":
            return web.json_response({"object": "list", "data": []}, headers=echoed)
        return web.json_response(ANSWER, headers=echoed)

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams())
    if route == "models":
        status, headers, body = await request(proxy, "/v1/models", None, method="GET")
    else:
        status, headers, body = await request(proxy, CHAT, {**BODY, "stream": route == "stream"})
    assert status == 200, body
    assert_no_secret(headers, body, (UPSTREAM_KEY,))
    assert any("[REDACTED]" in value for value in headers.values()), headers  # still passed on


# -- credentials in base_url are the operator's too -------------------------------------------


@pytest.mark.parametrize("route", ["json", "stream", "models"])
async def test_base_url_credentials_refused_are_the_proxys_fault_and_never_echoed(
    make_proxy: ProxyFactory, upstream: Upstream, route: str
) -> None:
    """A gateway's basic auth in base_url is the operator's credential: its refusal was passed on
    as a 401 (the caller's SDK reads its own key as wrong), and its echo as it came."""

    async def handler(request: web.Request) -> web.StreamResponse:
        message = f"bad credentials {request.headers.get('Authorization')} ({GW_PASSWORD})"
        error = {"error": {"message": message, "type": "auth", "param": None, "code": "invalid_api_key"}}
        return web.json_response(error, status=401, headers={"x-request-id": GW_TOKEN})

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams(in_url=True))
    if route == "models":
        status, headers, body = await request(proxy, "/v1/models", None, method="GET")
    else:
        status, headers, body = await request(proxy, CHAT, {**BODY, "stream": route == "stream"})
    assert status == 502 and json.loads(body)["error"]["code"] == "upstream_auth", (status, body)
    assert_no_secret(headers, body, (GW_PASSWORD, GW_TOKEN))


@pytest.mark.parametrize("route", ["json", "stream", "models"])
@pytest.mark.parametrize("unset", ["typo", "empty"])
async def test_an_upstream_key_variable_not_set_is_a_502_upstream_auth_not_the_callers_401(
    make_proxy: ProxyFactory, upstream: Upstream, route: str, unset: str
) -> None:
    """api_key_env names a variable not set (a typo, a secret not mounted) or empty: load_config
    warned that every call would come back a 502 upstream_auth, but each went out with no key,
    and the provider's 401 invalid_api_key reached the caller as its own key refused (its SDK
    raises AuthenticationError). Now refused before forwarding: nothing reserved nor billed."""

    async def handler(request: web.Request) -> web.StreamResponse:
        error = {"error": {"message": "Incorrect API key provided", "type": "x", "code": "invalid_api_key"}}
        return web.json_response(error, status=401)

    upstream.handler = handler
    upstreams = upstream.upstreams()
    if unset == "typo":
        upstreams["openai"]["api_key_env"] = "OPENAI_KEY_TYPO"
    proxy = await make_proxy(upstreams=upstreams, upstream_key="" if unset == "empty" else UPSTREAM_KEY)
    if route == "models":
        status, headers, body = await request(proxy, "/v1/models", None, method="GET")
    else:
        status, headers, body = await request(proxy, CHAT, {**BODY, "stream": route == "stream"}, run="unset")
    assert status == 502 and json.loads(body)["error"]["code"] == "upstream_auth", (status, body)
    assert headers.get("x-should-retry") == "false"
    assert upstream.calls == 0
    assert await ledger_entries(proxy, "unset") == []


@pytest.mark.parametrize("passthrough", [False, True], ids=["no-key", "passthrough-with-a-proxy-key"])
@pytest.mark.parametrize("route", ["json", "stream", "models"])
async def test_an_upstream_sent_no_key_refusing_the_call_is_a_502_upstream_auth(
    make_proxy: ProxyFactory, upstream: Upstream, passthrough: bool, route: str
) -> None:
    """An upstream configured without a key (none at all, or one taking its callers' own keys
    called with a proxy key) is sent none: a provider that wants one refuses it, and its 401
    reached the caller as its own (good) key refused. The operator's to mend, as a refused key
    of the operator's is; a server that needs no key still answers (below)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        assert "Authorization" not in request.headers
        error = {"error": {"message": "Missing API key", "type": "x", "code": "invalid_api_key"}}
        return web.json_response(error, status=401)

    upstream.handler = handler
    openai_upstream: JsonDict = {"base_url": upstream.base_url, "timeout_s": 5}
    if passthrough:
        openai_upstream["passthrough_auth"] = True
    proxy = await make_proxy(upstreams={"openai": openai_upstream})
    if route == "models":
        status, headers, body = await request(proxy, "/v1/models", None, method="GET")
    else:
        status, headers, body = await request(proxy, CHAT, {**BODY, "stream": route == "stream"})
    assert status == 502 and json.loads(body)["error"]["code"] == "upstream_auth", (status, body)
    assert headers.get("x-should-retry") == "false"
    assert upstream.calls == 1


@pytest.mark.parametrize("passthrough", [False, True], ids=["no-key", "passthrough-with-a-proxy-key"])
async def test_an_upstream_that_needs_no_key_is_called_without_one(
    make_proxy: ProxyFactory, upstream: Upstream, passthrough: bool
) -> None:
    """A local server (llama.cpp, vLLM without --api-key) configured without a key answers."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(ANSWER)

    upstream.handler = handler
    openai_upstream: JsonDict = {"base_url": upstream.base_url, "timeout_s": 5}
    if passthrough:
        openai_upstream["passthrough_auth"] = True
    proxy = await make_proxy(upstreams={"openai": openai_upstream})
    status, _, body = await request(proxy, CHAT, BODY)
    assert status == 200, body
    assert upstream.calls == 1


def echo_error(said: str, stream: bool) -> web.StreamResponse:
    """A gateway's error echoing ``said``: a 400 JSON body, or an error event on a 200 stream."""
    error = {"error": {"message": said, "type": "invalid_request_error", "param": None, "code": None}}
    if stream:
        event = b"data: " + json.dumps(error).encode() + b"\n\n"
        return web.Response(body=event, headers={"Content-Type": "text/event-stream"})
    return web.json_response(error, status=400)


@pytest.mark.parametrize("stream", [False, True])
async def test_base_url_credentials_echoed_in_an_answer_never_reach_the_client(
    make_proxy: ProxyFactory, upstream: Upstream, stream: bool
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return echo_error(f"{request.headers.get('Authorization')} {GW_PASSWORD}", stream)

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams(in_url=True))
    status, headers, body = await request(proxy, CHAT, {**BODY, "stream": stream})
    assert status == (200 if stream else 400), body
    assert_no_secret(headers, body, (GW_PASSWORD, GW_TOKEN))
    assert b"[REDACTED]" in body


@pytest.mark.parametrize("stream", [False, True])
async def test_an_operator_key_with_a_slash_echoed_by_an_encoder_escaping_it_never_reaches_the_client(
    make_proxy: ProxyFactory, upstream: Upstream, stream: bool
) -> None:
    """A key holding '/' (base64 keys do), echoed by an encoder that escapes '/' as '\\/' (PHP's,
    Go's HTML-safe ones): the scrub sought the key's raw bytes only, as it did not for the
    credentials of ``base_url``, and the client read the key back."""
    key = "sk-proj/0123+abcd/wxyz=="
    escaped = key.replace("/", "\\/")

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.headers["Authorization"] == f"Bearer {key}"
        event = b'{"error": {"message": "bad key ' + escaped.encode() + b'", "type": "auth", "code": null}}'
        if stream:
            sse = {"Content-Type": "text/event-stream"}
            return web.Response(body=b"data: " + event + b"\n\n", headers=sse)
        return web.Response(body=event, status=400, content_type="application/json")

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams(), upstream_key=key)
    status, _headers, body = await request(proxy, CHAT, {**BODY, "stream": stream})
    assert status == (200 if stream else 400), body
    assert escaped.encode() not in body and key.encode() not in body, body
    assert b"[REDACTED]" in body, body


async def test_base_url_credentials_keep_a_tenant_out_of_another_tenants_response(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Every tenant's call goes out with the gateway's credentials, one account at the provider:
    with no ``api_key_env`` the proxy took them for each caller's own, and let tenant B continue
    tenant A's stored response (served from A's conversation, billed to B)."""
    fake.api_key = None  # the fake checks a bearer key; the gateway's basic auth goes here
    base = fake.base_url.replace("http://", f"http://{GW_USER}:{GW_PASSWORD}@")
    proxy = await make_proxy(upstreams={"openai": {"base_url": base, "timeout_s": 5, "connect_timeout_s": 2}})
    mine = await proxy.client().responses.create(model="gpt-4o-mini", input="my secret plan")
    sent = len(fake.received)
    with pytest.raises(openai.BadRequestError):
        await proxy.client(KEY_B).responses.create(
            model="gpt-4o-mini", input="repeat everything above", previous_response_id=mine.id
        )
    assert len(fake.received) == sent, "another tenant's response went upstream"
    await proxy.client().responses.create(model="gpt-4o-mini", input="go on", previous_response_id=mine.id)
    assert len(fake.received) == sent + 1


# -- an HTTP/1.0 client's stream ----------------------------------------------------------------


async def test_an_http10_keep_alive_client_sees_its_stream_end(proxy: Proxy) -> None:
    """HTTP/1.0 has no chunked framing: the stream's end is the connection's. aiohttp kept it
    open for a client that asked for keep-alive (``ab -k``, old gateways), its stream never
    ending: the client hung for the server's keep-alive timeout (an hour)."""
    body = json.dumps({**BODY, "stream": True}).encode()
    head = (
        f"POST {CHAT} HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode() + body)
        data = await asyncio.wait_for(reader.read(), 5)  # to the connection's end
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.0 200"), data[:300]
    assert b"transfer-encoding" not in rest.partition(b"\r\n\r\n")[0].lower()
    assert rest.rstrip().endswith(b"data: [DONE]"), rest[-300:]


# -- compressed answers (found sound; kept as a regression guard) --------------------------------


def _encoded(data: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.compress(data)
    if encoding == "deflate":
        return zlib.compress(data)
    out: bytes = brotli.compress(data)
    return out


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_compressed_answer_is_billed_on_its_usage_and_relayed_decoded(
    make_proxy: ProxyFactory, upstream: Upstream, encoding: str, stream: bool
) -> None:
    raw, content_type = (STREAM, "text/event-stream") if stream else (json.dumps(ANSWER).encode(), "")

    async def handler(request: web.Request) -> web.StreamResponse:
        headers = {"Content-Type": content_type or "application/json", "Content-Encoding": encoding}
        return web.Response(body=_encoded(raw, encoding), headers=headers)

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams())
    run = f"enc-{encoding}-{stream}"
    status, headers, body = await request(proxy, CHAT, {**BODY, "stream": stream}, run)
    assert status == 200, body
    assert "content-encoding" not in headers, headers
    if stream:
        assert body.rstrip().endswith(b"data: [DONE]"), body
    else:
        assert int(headers["content-length"]) == len(body) and json.loads(body)["usage"] == USAGE
    entry = await the_entry(proxy, run)
    assert entry["usage_source"] == "provider" and entry["input_tokens"] == "11", entry


@pytest.mark.parametrize(
    ("password", "escaped"),
    [("pässwörd-0123456789", "p%C3%A4ssw%C3%B6rd-0123456789"), ('pa"ss\\word-0123', "pa%22ss%5Cword-0123")],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_base_url_password_echoed_in_json_never_reaches_the_client(
    make_proxy: ProxyFactory, upstream: Upstream, password: str, escaped: str, stream: bool
) -> None:
    """A gateway that echoes the password in a JSON error writes it JSON-escaped (a quote, a
    backslash, or any non-ASCII character as Python's json and most encoders write it): the
    scrub looked for its raw bytes only, and the client's SDK read the password back whole."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return echo_error(f"wrong password {password} for this gateway", stream)

    upstream.handler = handler
    base = upstream.base_url.replace("http://", f"http://gw-user:{escaped}@")
    proxy = await make_proxy(upstreams={"openai": {"base_url": base, "timeout_s": 5, "connect_timeout_s": 2}})
    status, _headers, body = await request(proxy, CHAT, {**BODY, "stream": stream})
    assert status == (200 if stream else 400), body
    text = body.decode()
    if stream:
        text = text.partition("data: ")[2].partition("\n")[0]
    message = json.loads(text)["error"]["message"]
    assert password not in message, message
    assert "[REDACTED]" in message, message


async def test_a_base_url_password_echoed_as_the_bytes_it_went_as_never_reaches_the_client(
    make_proxy: ProxyFactory, upstream: Upstream
) -> None:
    """aiohttp sends the basic auth token in Latin-1 (``BasicAuth``): a gateway that echoes the
    password it decoded, byte for byte, echoes Latin-1 bytes, not the UTF-8 the scrub sought."""
    password = "pässwörd-0123456789"

    async def handler(request: web.Request) -> web.StreamResponse:
        sent = base64.b64decode(request.headers["Authorization"].removeprefix("Basic "))
        echoed = sent.partition(b":")[2]
        assert echoed == password.encode("latin1")
        body = b'{"error": {"message": "wrong password ' + echoed + b'", "type": "auth", "code": null}}'
        return web.Response(body=body, status=400, content_type="application/json")

    upstream.handler = handler
    base = upstream.base_url.replace("http://", "http://gw-user:p%C3%A4ssw%C3%B6rd-0123456789@")
    proxy = await make_proxy(upstreams={"openai": {"base_url": base, "timeout_s": 5, "connect_timeout_s": 2}})
    status, _headers, body = await request(proxy, CHAT, BODY)
    assert status == 400, body
    assert password.encode("latin1") not in body, body
    assert b"[REDACTED]" in body, body


def as_read(body: bytes) -> str:
    """What the client's JSON decoder reads of ``body``: the whole body or each SSE data line,
    its escapes read, written again without any."""
    out = []
    for line in body.decode("utf-8", "replace").split("\n"):
        data = line.removeprefix("data: ")
        try:
            out.append(json.dumps(json.loads(data), ensure_ascii=False))
        except ValueError:
            out.append(line)
    return "\n".join(out)


def error_json(message: str) -> bytes:
    """An error object whose message is ``message`` as its JSON string is written, escapes and all."""
    return (
        '{"error": {"message": "' + message + '", "type": "invalid_request_error", "code": null}}'
    ).encode()


# The key with its first letter as a \u escape: a client's JSON decoder reads the key.
ESCAPED_KEY = "\\u0073" + UPSTREAM_KEY[1:]


@pytest.mark.parametrize("route", ["error", "answer", "stream", "models"])
async def test_a_key_echoed_with_a_json_unicode_escape_never_reaches_the_client(
    make_proxy: ProxyFactory, upstream: Upstream, route: str
) -> None:
    """A JSON echo may spell any character as \\uXXXX (an encoder escaping more than Python's,
    a gateway's template), which the client's SDK reads back as the character: the scrub sought
    the key as written and as Python's json writes it, and ``"\\u0073k-upstream-secret"`` went
    out in a 400, an answer, a stream's error event and the model list (the scrub hunt)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if route == "error":
            return web.Response(
                body=error_json(f"bad key {ESCAPED_KEY}"), status=400, content_type="application/json"
            )
        if route == "stream":
            event = b"data: " + error_json(f"bad key {ESCAPED_KEY}") + b"\n\n"
            return web.Response(body=event, headers={"Content-Type": "text/event-stream"})
        if route == "models":
            models = {"object": "list", "data": [{"id": "@@", "object": "model", "owned_by": "x"}]}
            raw = json.dumps(models).replace("@@", f"ft:gpt-4o-mini:{ESCAPED_KEY}")
            return web.Response(body=raw.encode(), content_type="application/json")
        raw = json.dumps(ANSWER).replace('"hello"', f'"your key: {ESCAPED_KEY}"')
        return web.Response(body=raw.encode(), content_type="application/json")

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams())
    if route == "models":
        status, _headers, body = await request(proxy, "/v1/models", None, method="GET")
    else:
        status, _headers, body = await request(proxy, CHAT, {**BODY, "stream": route == "stream"})
    assert status == (400 if route == "error" else 200), body
    assert UPSTREAM_KEY not in as_read(body), body
    assert b"[REDACTED]" in body, body


@pytest.mark.parametrize(
    ("password", "what", "escapes"),
    [
        # Go's encoding/json escapes <, > and & (HTML-safe), as \u003c, \u003e, \u0026.
        pytest.param("gw&pass<0123456789", "password", {"&": "\\u0026", "<": "\\u003c"}, id="go"),
        # .NET's System.Text.Json escapes +, ', ", <, >, &, ` and every non-ASCII character, in
        # upper-case hex (\u002B, \u00E4); Python's json writes lower case (\u00e4).
        pytest.param("gw+pass'0123456789", "password", {"+": "\\u002B", "'": "\\u0027"}, id="dotnet"),
        pytest.param("gwp\u00e4ss-0123456789", "password", {"\u00e4": "\\u00E4"}, id="dotnet-hex"),
        # The basic auth token (base64 of user:password, here with a +), echoed by a .NET gateway.
        pytest.param("gw-pass->>0123456789", "token", {"+": "\\u002B"}, id="dotnet-token"),
    ],
)
async def test_a_base_url_password_echoed_as_go_or_dotnet_escape_it_never_reaches_the_client(
    make_proxy: ProxyFactory, upstream: Upstream, password: str, what: str, escapes: dict[str, str]
) -> None:
    """A gateway written in Go or .NET echoing the password or its token in a JSON error: their
    encoders escape characters Python's json does not (``&`` as ``\\u0026``, ``+`` as
    ``\\u002B``), and non-ASCII ones in upper-case hex. The scrub sought the forms Python's json
    writes only, and the client's SDK read the password (or the token) back whole."""
    token = base64.b64encode(f"{GW_USER}:{password}".encode("latin1")).decode()  # as aiohttp sends it
    secret = token if what == "token" else password
    echoed = secret
    for char, escape in escapes.items():
        assert char in echoed
        echoed = echoed.replace(char, escape)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=error_json(f"wrong credentials {echoed}"), status=400, content_type="application/json"
        )

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams(in_url=True, password=password))
    status, _headers, body = await request(proxy, CHAT, BODY)
    assert status == 400, body
    assert secret not in as_read(body), body
    assert b"[REDACTED]" in body, body


def test_short_base_url_credentials_are_the_operators_and_leave_answers_alone() -> None:
    """Credentials of a few characters (``x:y``) still make every call the operator's (its
    tenants' stored responses kept apart), but no form of them shorter than 8 characters is
    sought in answers: their basic auth token (``eDp5``) would be cut out of an image's base64."""
    upstream = UpstreamConfig(base_url="https://x:y@gw.example/v1")
    caller = Identity(tenant="team-a", tier="standard", key_name="a")
    assert not caller_key_sent(upstream, caller)  # the operator's account: every tenant's
    assert not operator_secrets(upstream, caller)
    assert url_credentials("https://gw-user:s3cret-gateway@gw.example/v1")  # long ones are sought


GW_PASSWORD = "gw-pass-0123456789"
CHAT_BODY: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 5,
}


@pytest.mark.parametrize(
    ("base_url", "shown"),
    [
        (f"http://gw-user:{GW_PASSWORD}@api\u200b.example.com/v1", GW_PASSWORD),  # a zero-width space
        (f"http://gw-user:{GW_PASSWORD}@\ufffd.example.com/v1", GW_PASSWORD),
        ("http://gw-user:gw-pass-%C5%82-0123456789@127.0.0.1:9/v1", "\\u0142"),  # not latin-1
    ],
    ids=["zero-width-space", "replacement-character", "password-not-latin-1"],
)
async def test_a_base_url_aiohttp_cannot_send_to_never_shows_its_password(
    make_proxy: ProxyFactory, base_url: str, shown: str
) -> None:
    """A base_url the config takes (a host pasted with a zero-width space; a gateway password
    outside latin-1, which aiohttp sends basic auth in) that aiohttp refuses when the call is
    sent: the proxy's 502 quoted aiohttp's error, which is the whole URL with the gateway's
    password, or the codec's, which names a character of the password and where it stands
    (found by the headers hunt). The config refuses such a base_url now."""
    with pytest.raises(ValidationError, match="invalid URL") as refused:  # check-config says so
        UpstreamConfig(base_url=base_url)
    (said,) = (error["msg"] for error in refused.value.errors())
    assert shown not in said and "gw-pass" not in said, said
    # A config built around the check (as a model_copy is): still never shown to the client.
    proxy = await make_proxy()
    unsendable_base_url(proxy, base_url)
    async with proxy.client(KEY_A, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(**CHAT_BODY, extra_headers={"X-Run-Id": "bad-url"})
    response = caught.value.response
    assert response.status_code == 502
    assert shown not in response.text and "gw-pass" not in response.text, response.text
    assert "upstreams.openai" in response.json()["error"]["message"]


GATEWAY_401 = b"<html><head><title>401 Authorization Required</title></head><body>nginx</body></html>"


@pytest.mark.parametrize("in_url", [True, False], ids=["gateway-basic-auth", "api-key"])
async def test_the_model_list_refused_the_operators_credentials_with_a_page_is_upstream_auth(
    make_proxy: ProxyFactory, upstream: Upstream, in_url: bool
) -> None:
    """The gateway in front of the provider (base_url's basic auth) or the provider refuses the
    operator's credentials with a page of HTML: a billed call reads that as 502 upstream_auth
    with x-should-retry: false; the model list answered a plain 502 upstream_error, which the
    SDK retried twice (found by the headers hunt)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=401, body=GATEWAY_401, content_type="text/html")

    upstream.handler = handler
    proxy = await make_proxy(upstreams=upstream.upstreams(in_url=in_url))
    async with proxy.client(KEY_A, max_retries=2) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.models.list()
    response = caught.value.response
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_auth", response.text
    assert response.headers.get("x-should-retry") == "false"
    assert upstream.calls == 1


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_a_call_without_a_key_is_told_both_headers_a_key_may_come_in(proxy: Proxy, path: str) -> None:
    """Anthropic's clients send x-api-key: the 401 named Authorization: Bearer alone (the docs
    hunt). Both are read, both are named, in the API's own error shape."""
    body = {"model": "gpt-4o-mini", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session, session.post(proxy.url + path, json=body) as resp:
        assert resp.status == 401
        answer = await resp.json()
    message = answer["error"]["message"]
    assert "x-api-key" in message and "Authorization: Bearer" in message, answer
