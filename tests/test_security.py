"""Security: tenants are isolated, keys stay where they belong, and no client can steer the
proxy to another host.

* a key never reads nor charges another tenant's run or ledger (another tenant's run is a 404,
  never a 403: its existence is not disclosed);
* no key, or a wrong one, is a 401 in OpenAI's error format, and nothing is forwarded;
* the client's credentials and hop-by-hop headers never reach the upstream; the upstream gets
  the configured key only;
* no body field or header redirects the call: it reaches the configured upstream only;
* the upstream key never appears in a response (body or header), in Redis, or in the logs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.store import TENANTS_KEY
from tests.conftest import KEY_A, KEY_B, UPSTREAM_KEY, Proxy, ProxyFactory, refused_port
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import _raw

JsonDict = dict[str, Any]
MODEL = "gpt-4o-mini"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
MSGS: list[JsonDict] = [{"role": "user", "content": "hello there"}]
CHAT_BODY: JsonDict = {"model": MODEL, "messages": MSGS}
BODIES: dict[str, JsonDict] = {
    CHAT: CHAT_BODY,
    COMPLETIONS: {"model": MODEL, "prompt": "hello there"},
    EMBEDDINGS: {"model": "text-embedding-3-small", "input": "hello there"},
}
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=15)


@dataclass
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def describe(self) -> str:
        return f"status={self.status} headers={dict(self.headers)} body={self.body[:400]!r}"


async def serve_everything_with(handler: Any) -> web.AppRunner:
    """A server on a free loopback port answering every path and method with ``handler``."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(
    proxy: Proxy,
    path: str,
    *,
    method: str = "POST",
    body: Any = None,
    headers: dict[str, str] | None = None,
    key: str | None = KEY_A,
) -> Reply:
    sent = {**(bearer(key) if key is not None else {}), **(headers or {})}
    data = json.dumps(body).encode() if body is not None else None
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.request(method, proxy.url + path, data=data, headers=sent) as resp,
    ):
        return Reply(resp.status, resp.headers, await resp.read())


def assert_openai_error(reply: Reply, status: int) -> JsonDict:
    assert reply.status == status, reply.describe()
    assert reply.headers.get("Content-Type", "").startswith("application/json"), reply.describe()
    body = reply.json()
    assert isinstance(body, dict) and set(body) == {"error"}, reply.describe()
    error = body["error"]
    assert isinstance(error, dict), reply.describe()
    assert isinstance(error.get("message"), str) and error["message"], reply.describe()
    assert isinstance(error.get("type"), str) and error["type"], reply.describe()
    assert "param" in error and "code" in error, reply.describe()
    return error


def assert_no_upstream_key(reply: Reply) -> None:
    assert UPSTREAM_KEY.encode() not in reply.body, reply.describe()
    for name, value in reply.headers.items():
        assert UPSTREAM_KEY not in name and UPSTREAM_KEY not in value, reply.describe()


async def dump_keys(redis_client: aioredis.Redis, pattern: str = "*") -> dict[str, Any]:
    """Every key matching ``pattern`` with its type and whole value."""
    out: dict[str, Any] = {}
    async for key in redis_client.scan_iter(match=pattern, count=1000):
        kind = await redis_client.type(key)
        value: Any
        if kind == "hash":
            value = await redis_client.hgetall(key)
        elif kind == "stream":
            value = await redis_client.xrange(key)
        elif kind == "list":
            value = await redis_client.lrange(key, 0, -1)
        elif kind == "zset":
            value = await redis_client.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            value = sorted(await redis_client.smembers(key))
        elif kind == "string":
            value = await redis_client.get(key)
        else:
            value = None
        out[key] = (kind, value)
    return out


# -- authentication ---------------------------------------------------------------------------

ENDPOINTS: list[tuple[str, str, JsonDict | None]] = [
    ("POST", CHAT, CHAT_BODY),
    ("POST", COMPLETIONS, BODIES[COMPLETIONS]),
    ("POST", EMBEDDINGS, BODIES[EMBEDDINGS]),
    ("POST", CHAT, {**CHAT_BODY, "stream": True}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/billing/runs/some-run", None),
    ("GET", "/v1/billing/runs/some-run/ledger", None),
    ("GET", "/v1/billing/keys/self", None),
]
ENDPOINT_IDS = ["chat", "completions", "embeddings", "chat-stream", "models", "run", "ledger", "keys-self"]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=ENDPOINT_IDS)
async def test_missing_key_is_a_401_in_openai_format(
    proxy: Proxy, fake: FakeUpstream, method: str, path: str, body: JsonDict | None
) -> None:
    reply = await call(proxy, path, method=method, body=body, key=None)
    error = assert_openai_error(reply, 401)
    assert error["code"] == "invalid_api_key"
    assert fake.received == []


WRONG_AUTH: dict[str, dict[str, str]] = {
    "unknown-key": bearer("sk-proxy-team-c"),
    "prefix-of-key": bearer(KEY_A[:-1]),
    "key-plus-char": bearer(KEY_A + "x"),
    "upstream-key": bearer(UPSTREAM_KEY),
    "key-digest": bearer(hashlib.sha256(KEY_A.encode()).hexdigest()),
    "basic-scheme": {"Authorization": f"Basic {KEY_A}"},
    "empty-bearer": {"Authorization": "Bearer "},
    "no-scheme": {"Authorization": KEY_A},
    "token-scheme": {"Authorization": f"Token {KEY_A}"},
    "x-api-key-wrong": {"X-Api-Key": "sk-proxy-team-c"},
    "key-in-query-only": {},
    "non-ascii": {"Authorization": "Bearer sk-proxy-t\u00e9am-a"},
}


@pytest.mark.parametrize("auth_name", list(WRONG_AUTH))
@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS[:5], ids=ENDPOINT_IDS[:5])
async def test_wrong_key_is_a_401_and_nothing_is_forwarded(
    proxy: Proxy,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    auth_name: str,
    method: str,
    path: str,
    body: JsonDict | None,
) -> None:
    target = path + (f"?api_key={KEY_A}" if auth_name == "key-in-query-only" else "")
    reply = await call(proxy, target, method=method, body=body, headers=WRONG_AUTH[auth_name], key=None)
    error = assert_openai_error(reply, 401)
    assert error["code"] == "invalid_api_key"
    assert KEY_A not in error["message"]
    assert_no_upstream_key(reply)
    assert fake.received == []
    # Nothing of the call; the registry of the config's tenants is the reaper's, written anyway.
    assert set(await redis_client.keys("lbp:*")) <= {TENANTS_KEY}


SEVERAL_HEADERS: dict[str, list[tuple[str, str]]] = {
    "two-bearers": [("Authorization", f"Bearer {KEY_A}"), ("Authorization", f"Bearer {KEY_B}")],
    "two-x-api-keys": [("X-Api-Key", KEY_A), ("X-Api-Key", KEY_B)],
    "a-bearer-and-another-x-api-key": [("Authorization", f"Bearer {KEY_A}"), ("X-Api-Key", KEY_B)],
    "two-run-ids": [("Authorization", f"Bearer {KEY_A}"), ("X-Run-Id", "one"), ("X-Run-Id", "two")],
}


@pytest.mark.parametrize("name", list(SEVERAL_HEADERS))
async def test_a_key_or_a_run_id_sent_twice_differently_is_refused_and_nothing_is_forwarded(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis, name: str
) -> None:
    """Which of two a gateway in front of the proxy reads is its own choice: the key (or the run)
    it checked may not be the one the proxy would bill. Refused, before anything is reserved."""
    headers = [("Content-Type", "application/json"), *SEVERAL_HEADERS[name]]
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.post(proxy.url + CHAT, data=json.dumps(CHAT_BODY), headers=headers) as resp,
    ):
        reply = Reply(resp.status, resp.headers, await resp.read())
    if name == "two-run-ids":
        error = assert_openai_error(reply, 400)
        assert error["param"] == "X-Run-Id" and error["message"].startswith("Two different X-Run-Id")
    else:
        error = assert_openai_error(reply, 401)
        assert error["message"].startswith("Two different keys"), error
    assert fake.received == []
    assert set(await redis_client.keys("lbp:*")) <= {TENANTS_KEY}


async def test_a_key_and_a_run_id_sent_twice_alike_are_taken(proxy: Proxy, fake: FakeUpstream) -> None:
    """The same value twice (a client's default header and its own, say) names one key and one
    run: nothing to choose between."""
    headers = [
        ("Content-Type", "application/json"),
        ("Authorization", f"Bearer {KEY_A}"),
        ("Authorization", f"bearer {KEY_A}"),
        ("X-Api-Key", KEY_A),
        ("X-Run-Id", "twice"),
        ("X-Run-Id", "twice"),
    ]
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.post(proxy.url + CHAT, data=json.dumps(CHAT_BODY), headers=headers) as resp,
    ):
        reply = Reply(resp.status, resp.headers, await resp.read())
    assert reply.status == 200, reply.describe()
    assert reply.headers["x-billing-run-id"] == "twice"
    assert len(fake.received) == 1


async def test_x_api_key_authenticates_like_bearer(proxy: Proxy, fake: FakeUpstream) -> None:
    reply = await call(proxy, CHAT, body=CHAT_BODY, headers={"X-Api-Key": KEY_A}, key=None)
    assert reply.status == 200, reply.describe()
    assert reply.headers["x-billing-outcome"] == "ok"


# -- tenant isolation: reading ----------------------------------------------------------------


async def test_another_tenants_run_is_a_404_whatever_the_headers(proxy: Proxy) -> None:
    made = await call(proxy, CHAT, body=CHAT_BODY, headers={"X-Run-Id": "same-run"})
    assert made.status == 200, made.describe()
    own = await call(proxy, "/v1/billing/runs/same-run", method="GET")
    assert own.status == 200, own.describe()
    assert own.json()["tenant"] == "team-a"
    own_ledger = await call(proxy, "/v1/billing/runs/same-run/ledger", method="GET")
    assert own_ledger.status == 200 and len(own_ledger.json()["data"]) == 1, own_ledger.describe()

    sneaky_headers: list[dict[str, str]] = [
        {},
        {"X-Run-Id": "same-run"},
        {"X-Run-Id": "other"},
        {"X-Tenant": "team-a", "OpenAI-Organization": "team-a", "OpenAI-Project": "team-a"},
        {"X-Api-Key": KEY_A},  # a second key in another header: refused, never switches tenants
        {"Cookie": f"key={KEY_A}"},
    ]
    paths = [
        "/v1/billing/runs/same-run",
        "/v1/billing/runs/same-run/ledger",
        "/v1/billing/runs/same-run?tenant=team-a",
        "/v1/billing/runs/same-run/ledger?tenant=team-a",
    ]
    for headers in sneaky_headers:
        for path in paths:
            reply = await call(proxy, path, method="GET", headers=headers, key=KEY_B)
            error = assert_openai_error(reply, 401 if "X-Api-Key" in headers else 404)
            assert error["type"] != "permission_denied", reply.describe()
            assert b"team-a" not in reply.body, reply.describe()
            assert b"a-ci" not in reply.body, reply.describe()


@pytest.mark.parametrize(
    "run_path",
    [
        "%7Bteam-a%7D",
        "..%2F..%2F%7Bteam-a%7D%3Arun%3Asame-run",
        "same-run%00",
        "same-run%20",
        "*",
        "same-*",
        "same-run%2F..%2Fsame-run",
        "lbp:%7Bteam-a%7D:run:same-run",
        "x" * 129,
    ],
)
async def test_crafted_run_ids_never_reach_another_tenant(proxy: Proxy, run_path: str) -> None:
    made = await call(proxy, CHAT, body=CHAT_BODY, headers={"X-Run-Id": "same-run"})
    assert made.status == 200, made.describe()
    for suffix in ("", "/ledger"):
        reply = await call(proxy, f"/v1/billing/runs/{run_path}{suffix}", method="GET", key=KEY_B)
        assert_openai_error(reply, 404)
        # The message may quote the path the caller sent; it never carries team-a's data.
        assert b"a-ci" not in reply.body and b'"tenant"' not in reply.body, reply.describe()
        assert b"req_" not in reply.body and b"used" not in reply.body, reply.describe()


async def test_keys_self_shows_the_callers_tenant_only(proxy: Proxy) -> None:
    made = await call(proxy, CHAT, body=CHAT_BODY, headers={"X-Run-Id": "a-run"})
    assert made.status == 200, made.describe()
    reply = await call(proxy, "/v1/billing/keys/self", method="GET", key=KEY_B)
    assert reply.status == 200, reply.describe()
    body = reply.json()
    assert (body["tenant"], body["key"]) == ("team-b", "b-dev")
    assert b"team-a" not in reply.body and b"a-ci" not in reply.body, reply.describe()
    assert_no_upstream_key(reply)


# -- tenant isolation: charging ---------------------------------------------------------------


async def test_a_call_with_another_tenants_run_id_is_charged_to_the_caller(
    proxy: Proxy, redis_client: aioredis.Redis
) -> None:
    made = await call(proxy, CHAT, body=CHAT_BODY, headers={"X-Run-Id": "same-run"})
    assert made.status == 200, made.describe()
    team_a_before = await dump_keys(redis_client, "lbp:{team-a}:*")
    assert "lbp:{team-a}:run:same-run" in team_a_before

    attempts: list[tuple[dict[str, str], JsonDict]] = [
        ({"X-Run-Id": "same-run"}, CHAT_BODY),
        ({"X-Run-Id": "same-run", "X-Tenant": "team-a", "OpenAI-Organization": "team-a"}, CHAT_BODY),
        ({"X-Run-Id": "same-run"}, {**CHAT_BODY, "user": "team-a", "metadata": {"tenant": "team-a"}}),
        ({"X-Run-Id": "same-run"}, {**CHAT_BODY, "stream": True}),
        ({"X-Run-Id": "run:same-run"}, CHAT_BODY),
        ({"X-Run-Id": "same-run:ledger"}, CHAT_BODY),
    ]
    for headers, body in attempts:
        reply = await call(proxy, CHAT, body=body, headers=headers, key=KEY_B)
        assert reply.status == 200, reply.describe()
    # A second key in another header switches nothing: the call is refused, charged to nobody.
    both = await call(
        proxy, CHAT, body=CHAT_BODY, headers={"X-Run-Id": "same-run", "X-Api-Key": KEY_A}, key=KEY_B
    )
    assert_openai_error(both, 401)

    assert await dump_keys(redis_client, "lbp:{team-a}:*") == team_a_before
    team_b = await dump_keys(redis_client, "lbp:{team-b}:*")
    assert team_b["lbp:{team-b}:run:same-run"][0] == "hash"
    assert int(team_b["lbp:{team-b}:run:same-run"][1]["used:requests"]) == 4
    ledger_b = team_b["lbp:{team-b}:ledger"][1]
    assert len(ledger_b) == len(attempts)
    assert {fields["tenant"] for _id, fields in ledger_b} == {"team-b"}
    assert {fields["key"] for _id, fields in ledger_b} == {"b-dev"}

    # Each key reads its own run of that name, and only its own.
    a_run = await call(proxy, "/v1/billing/runs/same-run/ledger", method="GET", key=KEY_A)
    b_run = await call(proxy, "/v1/billing/runs/same-run/ledger", method="GET", key=KEY_B)
    assert [e["tenant"] for e in a_run.json()["data"]] == ["team-a"]
    assert [e["tenant"] for e in b_run.json()["data"]] == ["team-b"] * 4
    a_meters = await call(proxy, "/v1/billing/runs/same-run", method="GET", key=KEY_A)
    assert a_meters.json()["meters"]["requests"]["used"] == 1


async def test_run_id_cannot_escape_the_tenant_key_prefix(
    proxy: Proxy, redis_client: aioredis.Redis, fake: FakeUpstream
) -> None:
    for run_id in ["}:run:x", "{team-a}", "x}{team-a", "lbp:{team-a}:run:same-run", "../team-a"]:
        reply = await call(proxy, CHAT, body=CHAT_BODY, headers={"X-Run-Id": run_id}, key=KEY_B)
        error = assert_openai_error(reply, 400)
        assert error["param"] == "X-Run-Id"
    assert fake.received == []
    assert [k for k in await redis_client.keys("*") if "team-a" in k] == []


# -- what reaches the upstream ----------------------------------------------------------------

HOP_BY_HOP = {
    "Connection": "keep-alive, X-Hop-Secret",
    "X-Hop-Secret": "hop-value-1",
    "Keep-Alive": "timeout=99",
    "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0LXByb3h5LWNyZWQ=",
    "Proxy-Connection": "keep-alive",
    "TE": "trailers",
    "Upgrade": "websocket",
    "Cookie": "session=client-cookie-value",
    "OpenAI-Organization": "org-client-chosen",
    "X-Forwarded-For": "10.9.8.7",
}


@pytest.mark.parametrize("auth_style", ["bearer", "x-api-key", "both"])
@pytest.mark.parametrize(
    ("path", "stream"), [(CHAT, False), (CHAT, True), (COMPLETIONS, False), (EMBEDDINGS, False)]
)
async def test_client_credentials_and_hop_by_hop_headers_never_reach_the_upstream(
    proxy: Proxy, fake: FakeUpstream, auth_style: str, path: str, stream: bool
) -> None:
    headers = dict(HOP_BY_HOP)
    if auth_style in ("x-api-key", "both"):
        headers["X-Api-Key"] = KEY_A
    key = KEY_A if auth_style in ("bearer", "both") else None
    body = {**BODIES[path], **({"stream": True} if stream else {})}
    reply = await call(proxy, path, body=body, headers=headers, key=key)
    assert reply.status == 200, reply.describe()
    assert_no_upstream_key(reply)
    (received,) = fake.received
    sent = {name.lower(): value for name, value in received.headers.items()}
    assert sent["authorization"] == f"Bearer {UPSTREAM_KEY}"
    for name in ("x-api-key", "proxy-authorization", "x-hop-secret", "keep-alive", "cookie", "upgrade"):
        assert name not in sent, (name, sent)
    assert "x-hop-secret" not in sent.get("connection", "").lower(), sent
    for value in (KEY_A, "hop-value-1", "cHJveHk6c2VjcmV0", "client-cookie-value", "org-client-chosen"):
        assert all(value not in v for v in sent.values()), (value, sent)
        assert value.encode() not in received.raw, value


async def test_authorization_in_the_body_is_not_used_upstream(proxy: Proxy, fake: FakeUpstream) -> None:
    body = {**CHAT_BODY, "api_key": "sk-client-body-key", "headers": {"Authorization": "Bearer sk-client-x"}}
    reply = await call(proxy, CHAT, body=body)
    assert reply.status == 200, reply.describe()
    (received,) = fake.received
    assert received.headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"


# -- no redirection to another host -----------------------------------------------------------


class Trap:
    """A host nobody should call: counts whatever reaches it."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def handle(request: web.Request) -> web.Response:
            self.hits.append(f"{request.method} {request.path_qs} {dict(request.headers)}")
            return web.json_response({"trap": True})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def trap() -> AsyncIterator[Trap]:
    evil = Trap()
    await evil.start()
    yield evil
    await evil.close()


def redirect_attempts(evil: str) -> list[tuple[str, JsonDict, dict[str, str]]]:
    host = evil.removeprefix("http://")
    return [
        ("body-base_url", {**CHAT_BODY, "base_url": evil + "/v1"}, {}),
        ("body-api_base", {**CHAT_BODY, "api_base": evil + "/v1", "url": evil, "endpoint": evil}, {}),
        ("body-upstream", {**CHAT_BODY, "upstream": evil, "host": host, "provider": {"base_url": evil}}, {}),
        ("model-url", {**CHAT_BODY, "model": evil + "/v1/chat/completions"}, {}),
        ("model-at-host", {**CHAT_BODY, "model": f"gpt-4o-mini@{host}"}, {}),
        ("header-host", CHAT_BODY, {"Host": host}),
        ("header-forwarded-host", CHAT_BODY, {"X-Forwarded-Host": host, "X-Forwarded-Proto": "http"}),
        ("header-forwarded", CHAT_BODY, {"Forwarded": f"host={host};proto=http"}),
        ("header-original-url", CHAT_BODY, {"X-Original-URL": evil + "/v1", "X-Rewrite-URL": evil}),
        ("header-base-url", CHAT_BODY, {"OpenAI-Base-URL": evil + "/v1", "X-Upstream": evil}),
        ("stream-base_url", {**CHAT_BODY, "stream": True, "base_url": evil + "/v1"}, {"Host": host}),
    ]


async def test_no_field_or_header_redirects_the_call(proxy: Proxy, fake: FakeUpstream, trap: Trap) -> None:
    for name, body, headers in redirect_attempts(trap.url):
        before = len(fake.received)
        reply = await call(proxy, CHAT, body=body, headers=headers)
        assert reply.status == 200, (name, reply.describe())
        assert len(fake.received) == before + 1, name
        assert fake.received[-1].path == CHAT, name
        assert trap.hits == [], (name, trap.hits)


async def test_absolute_form_request_target_does_not_redirect(
    proxy: Proxy, fake: FakeUpstream, trap: Trap
) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    body = json.dumps(CHAT_BODY).encode()
    evil_host = trap.url.removeprefix("http://")
    request = (
        f"POST {trap.url}/v1/chat/completions HTTP/1.1\r\n"
        f"Host: {evil_host}\r\n"
        f"Authorization: Bearer {KEY_A}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert len(fake.received) == 1
    assert trap.hits == []


async def test_upstream_redirect_is_not_followed(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, trap: Trap
) -> None:
    """An upstream answering 307 to another host must not make the proxy send the request (and
    its upstream key) there."""
    redirected: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        redirected.append(request.path)
        raise web.HTTPTemporaryRedirect(trap.url + request.path)

    runner = await serve_everything_with(handle)
    try:
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        proxy = await make_proxy(upstreams=upstream_config(base))
        for body in (CHAT_BODY, {**CHAT_BODY, "stream": True}):
            reply = await call(proxy, CHAT, body=body)
            assert reply.status != 200 or b"trap" not in reply.body, reply.describe()
            assert_no_upstream_key(reply)
        assert len(redirected) == 2
        assert trap.hits == []
        assert await redis_client.xlen("lbp:{team-a}:ledger") == 2
    finally:
        await runner.cleanup()


def upstream_config(base_url: str) -> JsonDict:
    return {
        "openai": {
            "base_url": base_url,
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": 5,
            "connect_timeout_s": 2,
        }
    }


# -- the upstream key never leaks -------------------------------------------------------------

FAKE_MODES: list[JsonDict] = [
    {},
    {"mode": "error", "status": 500, "error_body": "json"},
    {"mode": "error", "status": 500, "error_body": "text"},
    {"mode": "error", "status": 502, "error_body": "none"},
    {"mode": "error", "status": 400, "error_body": "json"},
    {"mode": "error", "status": 401, "error_body": "json"},
    {"mode": "error", "status": 429, "error_body": "text"},
    {"mode": "non_json"},
    {"mode": "truncate"},
    {"mode": "refusal"},
    {"mode": "cut"},
    {"mode": "malformed_sse"},
    {"mode": "no_done"},
]


async def mixed_workload(proxy: Proxy) -> list[Reply]:
    """Normal, failing, streamed, refused and reporting calls; returns every reply."""
    replies: list[Reply] = []
    for ctl in FAKE_MODES:
        for stream in (False, True):
            body = {**CHAT_BODY, "stream": stream, "fake": ctl}
            replies.append(await call(proxy, CHAT, body=body, headers={"X-Run-Id": "leak-run"}))
    replies.append(await call(proxy, COMPLETIONS, body=BODIES[COMPLETIONS], headers={"X-Run-Id": "leak-run"}))
    replies.append(await call(proxy, EMBEDDINGS, body=BODIES[EMBEDDINGS], headers={"X-Run-Id": "leak-run"}))
    replies.append(await call(proxy, CHAT, body={**CHAT_BODY, "max_tokens": "x"}))  # 400
    replies.append(await call(proxy, CHAT, body=CHAT_BODY, key=None))  # 401
    replies.append(await call(proxy, CHAT, body=CHAT_BODY, key=UPSTREAM_KEY))  # 401 with the key itself
    replies.append(await call(proxy, "/v1/images/generations", body={}))  # 404
    replies.append(await call(proxy, CHAT, method="GET"))  # 405
    for path in (
        "/v1/models",
        "/v1/billing/runs/leak-run",
        "/v1/billing/runs/leak-run/ledger",
        "/v1/billing/keys/self",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        replies.append(await call(proxy, path, method="GET"))
    return replies


async def test_upstream_key_never_in_any_response(proxy: Proxy) -> None:
    replies = await mixed_workload(proxy)
    assert {r.status for r in replies} >= {200, 400, 401, 404, 405, 500, 502}
    for reply in replies:
        assert_no_upstream_key(reply)


async def test_upstream_key_never_in_transport_failure_responses(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    closed = f"http://127.0.0.1:{refused_port()}/v1"
    proxy = await make_proxy(upstreams=upstream_config(closed))
    for body in (CHAT_BODY, {**CHAT_BODY, "stream": True}):
        reply = await call(proxy, CHAT, body=body)
        assert reply.status == 502, reply.describe()
        assert_no_upstream_key(reply)
    for path in ("/v1/models", "/readyz"):
        assert_no_upstream_key(await call(proxy, path, method="GET"))


@pytest.mark.parametrize(
    ("status", "content_type", "body"),
    [
        (
            401,
            "application/json",
            json.dumps(
                {
                    "error": {
                        "message": f"Incorrect API key provided: {UPSTREAM_KEY}.",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                }
            ),
        ),
        (500, "text/plain", f"gateway failed; request had Authorization: Bearer {UPSTREAM_KEY}"),
        (400, "application/json", json.dumps({"detail": f"bad key {UPSTREAM_KEY}"})),
    ],
    ids=["json-401", "text-500", "json-400-no-error-object"],
)
async def test_upstream_error_echoing_the_key_is_not_relayed(
    make_proxy: ProxyFactory, status: int, content_type: str, body: str
) -> None:
    """Some providers and gateways echo the credential they were sent in their error messages;
    the proxy relays upstream errors to tenants, who must never learn the provider key."""

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=status, text=body, content_type=content_type)

    runner = await serve_everything_with(handle)
    try:
        proxy = await make_proxy(upstreams=upstream_config(f"http://127.0.0.1:{runner.addresses[0][1]}/v1"))
        for request_body in (CHAT_BODY, {**CHAT_BODY, "stream": True}):
            reply = await call(proxy, CHAT, body=request_body)
            assert reply.status >= 400, reply.describe()  # the status may be mapped (401 -> 502)
            assert_no_upstream_key(reply)
    finally:
        await runner.cleanup()


async def test_no_key_is_stored_in_redis(proxy: Proxy, redis_client: aioredis.Redis) -> None:
    await mixed_workload(proxy)
    await call(proxy, CHAT, body=CHAT_BODY, key=KEY_B, headers={"X-Run-Id": "b-run"})
    everything = await dump_keys(redis_client)
    assert "lbp:{team-a}:ledger" in everything
    assert "lbp:{team-b}:ledger" in everything
    text = repr(everything)
    assert UPSTREAM_KEY not in text
    assert KEY_A not in text and KEY_B not in text  # keys are named in the ledger, never stored


def record_text(record: logging.LogRecord) -> str:
    """Everything a handler could write for a record: message, every attribute, traceback."""
    parts = [record.getMessage(), repr(vars(record))]
    if record.exc_info:
        parts.append(logging.Formatter().formatException(record.exc_info))
    if record.exc_text:
        parts.append(record.exc_text)
    return "\n".join(parts)


async def test_upstream_key_never_in_logs(
    proxy: Proxy, caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    caplog.set_level(logging.DEBUG)
    await mixed_workload(proxy)
    # Failures the proxy logs at error level: an unreachable upstream.
    unreachable = await make_proxy(upstreams=upstream_config(f"http://127.0.0.1:{refused_port()}/v1"))
    await call(unreachable, CHAT, body=CHAT_BODY)
    await call(unreachable, "/v1/models", method="GET")
    records = caplog.records
    assert records, "the workload logged nothing at DEBUG level"
    leaking = [record_text(r) for r in records if UPSTREAM_KEY in record_text(r)]
    assert leaking == []
    client_keys = [record_text(r) for r in records if KEY_A in record_text(r) or KEY_B in record_text(r)]
    assert client_keys == []


# -- the operator's key echoed by an upstream, and callers' keys in the log (found by a hunt) --

CHAT_BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


async def _echoing_upstream(handler: Any) -> tuple[web.AppRunner, dict[str, Any]]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    upstream = {"base_url": base, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 5, "connect_timeout_s": 2}
    return runner, {"openai": upstream}


async def _post(proxy: Proxy, body: Any) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp,
    ):
        return resp.status, await resp.read()


@pytest.mark.parametrize("shape", ["200 error object", "stream error event"])
async def test_an_upstream_echoing_the_operators_key_in_an_answer_never_passes_it_on(
    shape: str, make_proxy: ProxyFactory
) -> None:
    # Scrubbed in 4xx/5xx bodies only: a 200 error object or an error event mid-stream carried
    # the operator's key to the tenant.
    error = {"error": {"message": f"Invalid key {UPSTREAM_KEY} for this deployment", "type": "auth"}}

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        if shape == "200 error object":
            return web.json_response(error)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    runner, upstreams = await _echoing_upstream(handle)
    try:
        proxy = await make_proxy(upstreams=upstreams)
        status, body = await _post(proxy, {**CHAT_BODY, "stream": shape == "stream error event"})
    finally:
        await runner.cleanup()
    assert status == 200
    assert UPSTREAM_KEY.encode() not in body and b"[REDACTED]" in body


async def test_a_passthrough_auth_upstream_in_a_config_file_still_guards_the_operators_key(
    make_proxy: ProxyFactory,
) -> None:
    # Config mode: callers present proxy keys, so the operator's key goes out even to an upstream
    # marked passthrough_auth; its 401 echoing that key was passed on as it came.
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("Authorization", ""))
        error = {
            "error": {"message": f"Incorrect API key provided: {UPSTREAM_KEY}", "code": "invalid_api_key"}
        }
        return web.json_response(error, status=401)

    runner, upstreams = await _echoing_upstream(handle)
    upstreams["openai"]["passthrough_auth"] = True
    try:
        proxy = await make_proxy(upstreams=upstreams)
        status, body = await _post(proxy, CHAT_BODY)
    finally:
        await runner.cleanup()
    assert seen == [f"Bearer {UPSTREAM_KEY}"]
    assert status == 502 and json.loads(body)["error"]["code"] == "upstream_auth"
    assert UPSTREAM_KEY.encode() not in body


@pytest.mark.parametrize("header", ["x-api-key: ", "authorization: bearer "])
@pytest.mark.parametrize("bad", ["\x00", "\r"])
async def test_a_header_line_the_parser_refuses_does_not_log_the_callers_key(
    make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture, bad: str, header: str
) -> None:
    # aiohttp's error line quotes the raw header: a key not shaped sk-... (x-api-key, a
    # lower-case bearer) went to the log as it came.
    from proxy.logs import JsonFormatter, TextFormatter

    key = "pk-live-7f3a9c2e41d84b6f"
    keys = [{"name": "c-key", "sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": "team-c"}]
    proxy = await make_proxy(keys=keys)
    caplog.set_level(logging.DEBUG)
    body = b'{"model":"claude-x","messages":[],"max_tokens":1}'
    request = (
        f"POST /v1/messages HTTP/1.1\r\nHost: x\r\n{header}{key}{bad}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    await asyncio.wait_for(reader.read(), 10)
    writer.close()
    lines = [f().format(r) for r in caplog.records for f in (JsonFormatter, TextFormatter)]
    assert lines and not [line for line in lines if key in line]


async def test_the_model_list_does_not_follow_an_upstream_redirect_with_the_operators_key(
    make_proxy: ProxyFactory,
) -> None:
    """README: an upstream redirect is not followed (it would carry the upstream key to whatever
    host it names). GET /v1/models followed it: aiohttp drops Authorization on a redirect to
    another origin, not Anthropic's x-api-key, so a model list of an Anthropic upstream sent the
    operator's key to the redirect's host, and passed that host's answer on as the list."""
    trap = Trap()
    await trap.start()

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(trap.url + request.path)

    runner = await serve_everything_with(redirect)
    try:
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        proxy = await make_proxy(
            upstreams={
                "anthropic": {"base_url": base, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
            },
            models={"claude-*": {"upstream": "anthropic"}},
        )
        async with (
            aiohttp.ClientSession() as session,
            session.get(proxy.url + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}) as resp,
        ):
            body = await resp.read()
        assert UPSTREAM_KEY not in "".join(trap.hits), trap.hits  # now: x-api-key: sk-upstream-secret
        assert trap.hits == [], trap.hits
        assert b"trap" not in body, body  # now: 200 {"trap": true}, another host's answer as the list
    finally:
        await runner.cleanup()
        await trap.close()


ISOLATION_BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def _isolation_call(
    session: aiohttp.ClientSession, proxy: Proxy, key: str, run: str | None = None
) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if run is not None:
        headers["X-Run-Id"] = run
    async with session.post(proxy.url + "/v1/chat/completions", json=ISOLATION_BODY, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return dict(resp.headers)


def _counted_apart(first: str, second: str) -> int | None:
    """How far apart two ids are when they are one prefix and a hex counter: None if not."""
    pairs = enumerate(zip(first, second, strict=False))
    shared = next((i for i, (a, b) in pairs if a != b), min(len(first), len(second)))
    at = max(shared - 1, 0)  # from the last shared character: a counter's carry
    tail1, tail2 = first[at:], second[at:]
    try:
        return int(tail2, 16) - int(tail1, 16)
    except ValueError:
        return None


async def test_ids_a_caller_sees_do_not_count_other_tenants_calls(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The ids the proxy makes up (x-request-id, the run of a call without X-Run-Id, the ledger's
    reservation_id) are shown to the caller: drawn from one counter of the process, two of them
    tell a tenant how many calls every other tenant made in between (their traffic, call by call)."""
    proxy = await make_proxy()
    others = 7
    async with aiohttp.ClientSession() as session:
        before = await _isolation_call(session, proxy, KEY_A, run="mine")
        for _ in range(others):
            await _isolation_call(session, proxy, KEY_B)
        after = await _isolation_call(session, proxy, KEY_A, run="mine")
        async with session.get(
            proxy.url + "/v1/billing/runs/mine/ledger", headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp:
            entries = (await resp.json())["data"]
    seen = [
        ("x-request-id", before["X-Request-ID"], after["X-Request-ID"]),
        ("reservation_id", entries[0]["reservation_id"], entries[1]["reservation_id"]),
    ]
    for name, first, second in seen:
        apart = _counted_apart(first, second)
        # Three ids a call (request, run, reservation): tenant B's 7 calls, counted from A's ids.
        assert apart is None or not (others <= apart <= 4 * (others + 1)), (name, first, second, apart)


async def test_a_tenant_cannot_tell_whether_another_tenant_sent_a_text(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Token counts of long texts are remembered (``limits.token_count_cache_chars``). Shared by
    every tenant, the memory answers one tenant's question "did anyone send exactly this text?"
    (another tenant's system prompt, a document): a text another tenant sent is reserved at its
    exact count at once, one never seen at its UTF-8 bytes until it is counted. The reserve is
    the caller's to see (its run's meters, the ledger's reserved_input_tokens). Providers scope
    their own prompt caches to an organization for that reason."""
    import threading

    import openai

    from proxy.tokenizer import Tokenizer
    from tests.outcome_helpers import ledger_entries, run_headers
    from tests.test_estimate import EXACT_INPUT, MODEL, TEXT, QuarterEncoding

    enc = QuarterEncoding()
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}))
    # Tenant B sends its text; the proxy counts it while the call runs. Answered once counted:
    # an answer after a fixed delay may come first on a loaded machine, and the count is dropped.
    sent = asyncio.ensure_future(
        proxy.client(KEY_B).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=5,
            extra_body={"fake": {"hold": True}},
        )
    )
    for _ in range(500):
        if len(TEXT) in enc.counted:
            break
        await asyncio.sleep(0.01)
    assert len(TEXT) in enc.counted
    fake.release()
    await sent
    # From now on no long text is counted before its call ends (a busy estimate thread).
    enc.gate = threading.Event()
    try:
        client: openai.AsyncOpenAI = proxy.client(KEY_A)
        other = TEXT.replace("word", "wurd")  # as long, never sent
        for run, text in (("guess", TEXT), ("control", other)):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": text}],
                max_tokens=5,
                extra_headers=run_headers(run),
            )
        [guess] = await ledger_entries(proxy, "guess")
        [control] = await ledger_entries(proxy, "control")
    finally:
        enc.gate.set()
    # Tenant A's guess is reserved as any text A never sent: not at B's exact count.
    assert int(guess["reserved_input_tokens"]) != EXACT_INPUT
    assert guess["reserved_input_tokens"] == control["reserved_input_tokens"]


async def test_an_answer_to_a_request_the_parser_refused_carries_a_request_id(
    make_proxy: ProxyFactory,
) -> None:
    """README: x-request-id is the proxy's, on every answer, errors included. The answer to a
    request aiohttp's parser refuses (a control character in a header, chunked beside a length)
    is written outside the middleware that sets it, and had none."""
    proxy = await make_proxy()
    host, port = proxy.url.removeprefix("http://").split(":")
    for request in (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
    ):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
        assert head.startswith("http/1.") and " 400 " in head.split("\r\n")[0], head
        lines = head.split("\r\n")
        ids = [line.split(":", 1)[1].strip() for line in lines if line.startswith("x-request-id:")]
        assert len(ids) == 1 and ids[0].startswith("req_"), head


async def test_a_passthrough_key_is_sent_upstream_as_the_key_that_named_its_tenant(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # Pass-through: the tenant is the digest of the key as presented, its budget is that
    # tenant's. A key with a byte that is not UTF-8 (\x80) names a new tenant, with fresh
    # budgets, yet the byte does not reach the upstream: the provider gets (and bills) the
    # key it stood in, whose tenant's budget is spent. Any number of such spellings of one
    # provider key each get a budget of their own.
    proxy = await make_proxy(
        passthrough=True,
        upstreams={"openai": {"base_url": fake.base_url, "passthrough_auth": True}},
        tiers={"standard": {"key": {"requests": 1}}},
    )
    body = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}'

    def post(key: bytes) -> bytes:
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer " + key + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )

    first = await _raw(proxy.url, post(b"sk-upstream-secret"))
    assert first.startswith(b"HTTP/1.1 200"), first[:300]
    # The same provider key spelt with a stray byte: its one request is spent.
    second = await _raw(proxy.url, post(b"sk-upstream-\x80secret"))
    status = int(second.split(b" ", 2)[1])
    assert 400 <= status < 500, second[:400]
    assert len(fake.received) == 1, [r.headers.get("Authorization") for r in fake.received]
