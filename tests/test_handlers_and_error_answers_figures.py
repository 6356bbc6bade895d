"""The figures of the HTTP handlers, the error answers and authentication, as a client or an
operator reads them: the status, error type, code and param of each refusal, the headers an SDK
acts on (retry advice, request ids, ``Allow``), which upstream the model list asks and what of its
answer is passed on, and which keys and headers name a caller."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import logging
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

import proxy.app as app_module
import proxy.planning as planning
from proxy.auth import PASSTHROUGH_ID_DIGITS
from proxy.config_load import parse_config
from proxy.errors import StoreRejected
from proxy.payload import parse_body
from proxy.plan import plan_call
from proxy.reaper import registration_s
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from proxy.store import TENANTS_KEY
from tests.conftest import (
    KEY_A,
    KEY_B,
    UPSTREAM_KEY,
    Proxy,
    ProxyFactory,
    base_config,
    digest,
    refused_port,
)
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess
from tests.test_bad_input import Plan, ScriptedUpstream, _raw, dumps, scripted_upstreams
from tests.test_request_body_limits import answer_to, chunked_head, read_answer
from tests.test_security import Reply, assert_openai_error, call, serve_everything_with
from tests.test_thread_pools import until_held

JsonDict = dict[str, Any]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
CHAT_BODY: JsonDict = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 5,
}
MODEL_LIST = {"object": "list", "data": [{"id": "m-1", "object": "model", "created": 1, "owned_by": "x"}]}
ERROR_OBJECT = dumps(
    {"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": "x"}}
)


async def raw_exchange(proxy: Proxy, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """The proxy's answer to ``request`` sent as it is: its status line, headers (lower-cased
    names) and body, read until the proxy closes the connection."""
    return answer_parts(await _raw(proxy.url, request))


def answer_parts(whole: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """An answer's status line, headers (lower-cased names) and body."""
    head, _, body = whole.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
    }
    return status_line.encode(), headers, body


# -- GET /v1/models: which upstream, and what of its answer --------------------------------------


async def test_models_asks_the_upstream_of_the_catch_all_route_not_the_first_model(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The list is of what any model name reaches: the ``*`` route's upstream, whatever model
    happens to come first in the config."""
    listed = {"object": "list", "data": [{"id": "from-the-catch-all", "object": "model"}]}

    async def other(request: web.Request) -> web.Response:
        return web.json_response(listed)

    runner = await serve_everything_with(other)
    try:
        other_url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        upstreams = {
            "openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY"},
            "other": {"base_url": other_url, "api_key_env": "TEST_UPSTREAM_KEY"},
        }
        models = {"gpt-4o-mini": {"upstream": "openai"}, "*": {"upstream": "other"}}
        proxy = await make_proxy(upstreams=upstreams, models=models)
        reply = await call(proxy, "/v1/models", method="GET")
        assert reply.status == 200, reply.describe()
        assert reply.json() == listed
        assert fake.received == []
    finally:
        await runner.cleanup()


GATEWAY = (502, "upstream_error")
MODELS_ANSWERS: dict[str, tuple[Plan, tuple[int, str | None]]] = {
    # What the upstream answers; the status the client gets and the error code it reads.
    "a-300-is-a-redirect-too": (Plan(status=300, chunks=[dumps(MODEL_LIST)]), (502, "upstream_redirect")),
    "a-5xx-error-object-is-no-callers-error": (Plan(status=500, chunks=[ERROR_OBJECT]), GATEWAY),
    "a-4xx-that-is-no-json": (Plan(status=404, content_type="text/html", chunks=[b"<h1>no</h1>"]), GATEWAY),
    "a-4xx-whose-error-is-a-string": (Plan(status=404, chunks=[dumps({"error": "no"})]), GATEWAY),
    "a-4xx-json-array": (Plan(status=404, chunks=[b"[]"]), GATEWAY),
    "a-201-is-no-list": (Plan(status=201, chunks=[dumps(MODEL_LIST)]), GATEWAY),
    "a-200-that-is-no-object": (Plan(status=200, content_type="text/html", chunks=[b"<html/>"]), GATEWAY),
    "a-200-list-after-whitespace": (Plan(status=200, chunks=[b"\n  " + dumps(MODEL_LIST)]), (200, None)),
    "a-4xx-error-object-is-passed-on": (Plan(status=404, chunks=[ERROR_OBJECT]), (404, "x")),
}


@pytest.mark.parametrize("name", list(MODELS_ANSWERS))
async def test_models_answers_what_the_upstream_said_or_a_502_of_its_own(
    make_proxy: ProxyFactory, script: ScriptedUpstream, name: str
) -> None:
    """An SDK retries a 502 and shows a 4xx as its caller's error: only a 4xx error object of
    the provider's is the caller's to read; anything else the upstream says is a bad gateway."""
    plan, (status, code) = MODELS_ANSWERS[name]
    script.plan = plan
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    reply = await call(proxy, "/v1/models", method="GET")
    assert reply.status == status, reply.describe()
    assert reply.headers["Content-Type"].startswith("application/json"), reply.describe()
    if status == 200:
        assert reply.json() == MODEL_LIST
        return
    error = reply.json()["error"]
    assert error["code"] == code, reply.describe()
    if status == 502:
        assert error["type"] == "upstream_error", error


@pytest.mark.parametrize(("status", "code"), [(302, "upstream_redirect"), (403, "upstream_auth")])
async def test_models_tells_the_sdk_not_to_retry_what_only_the_operator_can_fix(
    make_proxy: ProxyFactory, script: ScriptedUpstream, status: int, code: str
) -> None:
    """A redirect (its base_url) or its own key refused (a 403 as a 401) will not pass on a retry:
    ``x-should-retry: false`` keeps the OpenAI SDK from retrying the 502."""
    extra = {"Location": "http://127.0.0.1:9/v1/models"} if status == 302 else {}
    script.plan = Plan(status=status, chunks=[ERROR_OBJECT], extra_headers=extra)
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    reply = await call(proxy, "/v1/models", method="GET")
    error = assert_openai_error(reply, 502)
    assert (error["type"], error["code"]) == ("upstream_error", code), error
    assert reply.headers.get("x-should-retry") == "false", reply.describe()
    assert "x-request-id" in reply.headers, reply.describe()


async def test_models_from_an_upstream_that_is_down_passes_on_its_retry_advice(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """A 503 saying when to come back: the proxy's 502 dropped its retry-after and x-should-retry
    (the SDK hunt), which a billed call's error answer passes on."""
    extra = {"retry-after": "7", "x-should-retry": "true"}
    script.plan = Plan(status=503, chunks=[b"<html>down</html>"], extra_headers=extra)
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    reply = await call(proxy, "/v1/models", method="GET")
    error = assert_openai_error(reply, 502)
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_error"), error
    assert reply.headers.get("retry-after") == "7", reply.describe()
    assert reply.headers.get("x-should-retry") == "true", reply.describe()


@pytest.mark.parametrize("kind", ["refused", "too-large"])
async def test_models_from_an_upstream_that_fails_is_a_502_upstream_error(
    make_proxy: ProxyFactory, script: ScriptedUpstream, kind: str
) -> None:
    """Nothing listening, or a list past the proxy's bound (4 MiB): a bad gateway the SDK may
    retry, never the upstream's bytes nor a 500."""
    if kind == "refused":
        proxy = await make_proxy(upstreams=scripted_upstreams(f"http://127.0.0.1:{refused_port()}/v1"))
    else:
        script.plan = Plan(chunks=[b'{"object": "list", "data": [' + b" " * (4 * 1024 * 1024) + b"]}"])
        proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    reply = await call(proxy, "/v1/models", method="GET")
    error = assert_openai_error(reply, 502)
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_error"), error
    assert error["message"] == "The upstream could not list models.", error


async def test_models_passes_on_a_list_of_a_few_hundred_kilobytes_whole(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """A gateway in front of many providers lists thousands of models: its list is passed on
    whole, however far past the few kilobytes of OpenAI's own."""
    listed = {"object": "list", "data": [{"id": f"model-{i:05d}", "object": "model"} for i in range(8000)]}
    script.plan = Plan(chunks=[dumps(listed)])
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    reply = await call(proxy, "/v1/models", method="GET")
    assert reply.status == 200, reply.describe()
    assert len(reply.body) > 256 * 1024 and reply.json() == listed


CLAUDE_LIST = {
    "data": [
        {
            "type": "model",
            "id": "claude-sonnet-4-5",
            "display_name": "Claude Sonnet 4.5",
            "created_at": "2025-09-29T00:00:00Z",
        }
    ],
    "has_more": False,
    "first_id": "claude-sonnet-4-5",
    "last_id": "claude-sonnet-4-5",
}
ANTHROPIC_CALLER = {"anthropic-version": "2023-06-01"}


def claude_upstream(base_url: str) -> JsonDict:
    return {
        "base_url": base_url,
        "kind": "anthropic",
        "api_key_env": "TEST_UPSTREAM_KEY",
        "timeout_s": 5,
        "connect_timeout_s": 2,
    }


async def test_the_anthropic_sdks_model_list_comes_from_the_anthropic_upstream(
    make_proxy: ProxyFactory, fake: FakeUpstream, script: ScriptedUpstream
) -> None:
    """A proxy serving Claude models from an ``anthropic`` upstream beside an OpenAI one (``*``):
    the Anthropic SDK's ``models.list()`` (GET /v1/models with ``anthropic-version``) was answered
    with the OpenAI upstream's list (gpt-4o-mini...), in OpenAI's shape (no ``type``,
    ``display_name`` nor ``created_at``), which the SDK takes without a word: a model picker
    offers models /v1/messages cannot serve, and never the Claude models it can."""
    script.plan = Plan(chunks=[json.dumps(CLAUDE_LIST).encode()])
    openai_upstream = {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 5}
    proxy = await make_proxy(
        upstreams={"claude": claude_upstream(script.base_url), "openai": openai_upstream},
        models={"claude-*": {"upstream": "claude"}, "*": {"upstream": "openai"}},
    )
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    try:
        page = await client.models.list()
    finally:
        await client.close()
    assert [model.id for model in page.data] == ["claude-sonnet-4-5"], page.data
    assert page.data[0].type == "model" and page.data[0].display_name == "Claude Sonnet 4.5"
    assert len(script.received) == 1 and not fake.received


async def test_an_anthropic_callers_list_is_asked_of_the_first_anthropic_route_with_its_own_headers(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The upstream of the first route (in config order) whose upstream speaks Messages, asked
    with its own credentials (``x-api-key``, its ``anthropic-version``), never a bearer key, and
    with the caller's query (the SDK's ``?beta=true``)."""
    seen: list[tuple[str, str, dict[str, str]]] = []

    async def first(request: web.Request) -> web.Response:
        seen.append((request.path, request.rel_url.raw_query_string, dict(request.headers)))
        return web.json_response(CLAUDE_LIST)

    runner = await serve_everything_with(first)
    try:
        first_url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        upstreams = {
            "openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY"},
            "first": claude_upstream(first_url),
            "second": claude_upstream(fake.base_url),
        }
        models = {
            "gpt-4o-mini": {"upstream": "openai"},
            "claude-opus-*": {"upstream": "first"},
            "claude-*": {"upstream": "second"},
            "*": {"upstream": "openai"},
        }
        proxy = await make_proxy(upstreams=upstreams, models=models)
        reply = await call(proxy, "/v1/models?beta=true", method="GET", headers=ANTHROPIC_CALLER)
        assert reply.status == 200, reply.describe()
        assert reply.json() == CLAUDE_LIST
        assert fake.received == []
        [(path, query, headers)] = seen
        assert (path, query) == ("/v1/models", "beta=true")
        assert headers.get("x-api-key") == UPSTREAM_KEY and "Authorization" not in headers, headers
        assert headers.get("anthropic-version") == "2023-06-01", headers
    finally:
        await runner.cleanup()


async def test_an_anthropic_caller_with_no_anthropic_upstream_gets_an_empty_list(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """No model here is one /v1/messages serves: the OpenAI upstream's list would offer only
    models it cannot call. An empty page, in Anthropic's shape, and no upstream asked."""
    client = anthropic.AsyncAnthropic(base_url=(await make_proxy()).url, api_key=KEY_A, max_retries=0)
    try:
        page = await client.models.list()
    finally:
        await client.close()
    assert page.data == [] and page.has_more is False and page.first_id is None
    assert fake.received == []


MODELS_REFUSALS: dict[str, tuple[int, str]] = {
    # What goes wrong; the status and Anthropic error type the caller reads.
    "no-key": (401, "authentication_error"),
    "the-operators-key-unset": (502, "api_error"),
    "the-upstream-refuses-the-operators-key": (502, "api_error"),
    "the-upstream-unreachable": (502, "api_error"),
    "the-upstream-answers-a-page": (502, "api_error"),
}


@pytest.mark.parametrize("name", list(MODELS_REFUSALS))
async def test_the_model_list_refuses_an_anthropic_caller_in_anthropics_format(
    make_proxy: ProxyFactory, fake: FakeUpstream, script: ScriptedUpstream, name: str
) -> None:
    """The Anthropic SDK reads its own error format and ``request-id``: an OpenAI error body
    would reach its caller as an unreadable error."""
    base_url = {
        # The fake upstream wants a bearer key: the anthropic upstream's x-api-key is refused.
        "the-upstream-refuses-the-operators-key": fake.base_url,
        "the-upstream-unreachable": f"http://127.0.0.1:{refused_port()}/v1",
    }.get(name, script.base_url)
    script.plan = Plan(status=503, content_type="text/html", chunks=[b"<html>down</html>"])
    proxy = await make_proxy(
        upstreams={"claude": claude_upstream(base_url)},
        models={"claude-*": {"upstream": "claude"}},
        upstream_key="" if name == "the-operators-key-unset" else UPSTREAM_KEY,
    )
    key = None if name == "no-key" else KEY_A
    reply = await call(proxy, "/v1/models", method="GET", headers=ANTHROPIC_CALLER, key=key)
    status, kind = MODELS_REFUSALS[name]
    assert reply.status == status, reply.describe()
    body = reply.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", reply.describe()
    assert body["error"]["type"] == kind and body["error"]["message"], reply.describe()
    request_id = reply.headers.get("x-request-id")
    assert request_id and reply.headers.get("request-id") == request_id, reply.describe()


# -- refusals before the upstream, in the API's own format --------------------------------------


async def anthropic_proxy(make_proxy: ProxyFactory, base_url: str, **overrides: Any) -> Proxy:
    upstream = {"base_url": base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    model = {"upstream": "claude", "price_per_million": {"input": "3", "output": "15"}}
    return await make_proxy(upstreams={"claude": upstream}, models={"claude-*": model}, **overrides)


async def test_a_store_down_on_messages_is_an_anthropic_overloaded_error_with_retry_advice(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The Anthropic SDK reads its own error format and ``request-id``: the billing store down
    before the reserve was answered in OpenAI's, which it cannot read. The operator's counter of
    store failures names the reserve."""
    redis = {"url": f"redis://127.0.0.1:{refused_port()}/0", "socket_timeout_s": 0.5}
    proxy = await anthropic_proxy(make_proxy, fake.base_url, redis=redis)
    body = {"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    reply = await call(proxy, MESSAGES, body=body, headers={"x-request-id": "req-store-down"})
    assert reply.status == 503, reply.describe()
    assert reply.json() == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": reply.json()["error"]["message"]},
    }
    assert (reply.headers.get("x-should-retry"), reply.headers.get("retry-after")) == ("true", "1")
    assert (reply.headers.get("request-id"), reply.headers.get("x-request-id")) == ("req-store-down",) * 2
    registry = proxy.app[STATE].metrics.registry
    assert registry.get_sample_value("llm_proxy_store_errors_total", {"operation": "reserve"}) == 1
    assert fake.received == []


def reserve_lines(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name == "proxy.handlers" and getattr(r, "operation", None) == "reserve"]


async def test_a_store_that_refuses_every_reserve_says_why_in_the_log(
    make_proxy: ProxyFactory,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis full under ``noeviction`` (the policy the README asks for, the embedded server's):
    every reserve is refused (OOM), every call answered 503 ``store_unavailable``, /readyz says
    ready (PING passes). The README's log has "structured lines for ... store errors", yet
    nothing was logged, neither per call nor once: the reserve's StoreError (its text names the
    OOM) was dropped, counted only in a metric. An operator paged for 503s found an empty log
    and a ready store. 100 such calls are told in a line or two, not 100."""
    proxy = await make_proxy(redis={"url": own_redis.url}, limits={"reaper_interval_s": 0.5})
    auth = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + CHAT, json=CHAT_BODY, headers=auth) as resp:
            assert resp.status == 200  # the tenant registered, the scripts loaded
        await asyncio.sleep(0.3)
        caplog.set_level(logging.INFO)
        caplog.clear()
        await own_client.config_set("maxmemory", "1")  # full: every write refused
        try:
            statuses = []
            for _ in range(100):
                async with session.post(proxy.url + CHAT, json=CHAT_BODY, headers=auth) as resp:
                    statuses.append((resp.status, (await resp.json())["error"]["code"]))
            async with session.get(proxy.url + "/readyz") as resp:
                ready = resp.status
            await asyncio.sleep(2)  # several reaper rounds
        finally:
            await own_client.config_set("maxmemory", "0")
    assert statuses == [(503, "store_unavailable")] * 100
    assert ready == 200
    told = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and "OOM" in json.dumps(r.__dict__, default=str)
    ]
    assert told, "100 calls refused for a full store, and no log line says so: " + repr(
        [(r.levelname, r.name, r.getMessage()) for r in caplog.records if r.name != "aiohttp.access"]
    )
    lines = reserve_lines(caplog.records)
    assert 1 <= len(lines) <= 2, [r.__dict__ for r in lines]
    assert lines[0].levelno == logging.WARNING and lines[0].__dict__["refused"] == 1  # the first at once
    assert "OOM" in lines[0].__dict__["error"]
    registry = proxy.app[STATE].metrics.registry
    assert registry.get_sample_value("llm_proxy_store_errors_total", {"operation": "reserve"}) == 100


async def test_a_reserve_the_store_rejects_is_logged_at_error_level_every_few_seconds(
    make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script refusing its input will refuse it again (a bug of ours, or a store that is not
    ours): each call is answered 503 as a store down is, and the log tells it at error level."""

    async def rejected(*args: Any, **kwargs: Any) -> None:
        raise StoreRejected("reserve: ERR user_script:1: bad argument")

    monkeypatch.setattr("proxy.handlers.reserve", rejected)
    proxy = await make_proxy()
    caplog.set_level(logging.INFO)
    for _ in range(5):
        reply = await call(proxy, CHAT, body=CHAT_BODY)
        assert reply.status == 503, reply.describe()
    (line,) = reserve_lines(caplog.records)
    assert line.levelno == logging.ERROR and "bad argument" in line.__dict__["error"]
    # Then the next line, a few seconds on, counts those not told since.
    proxy.app[STATE].reserve_rejections.every_s = 0
    assert (await call(proxy, CHAT, body=CHAT_BODY)).status == 503
    assert [r.__dict__["refused"] for r in reserve_lines(caplog.records)] == [1, 5]


async def test_a_passthrough_callers_tenant_is_registered_with_the_store_by_its_call(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The reaper finds tenants through the store's set of them: a configured tenant is put there
    by the reaper, a pass-through caller's only by its call. One missing had its leases (a dead
    instance's among them) never reaped."""
    upstreams = {"openai": {"base_url": fake.base_url, "passthrough_auth": True}}
    proxy = await make_proxy(passthrough=True, upstreams=upstreams)
    fake.api_key = None  # any key: the caller's own
    reply = await call(proxy, CHAT, body=CHAT_BODY, key="sk-own-key")
    assert reply.status == 200, reply.describe()
    tenant = "pt-" + digest("sk-own-key")[:PASSTHROUGH_ID_DIGITS]
    assert await redis_client.zscore(TENANTS_KEY, tenant) is not None


async def test_a_tenant_whose_registration_is_half_gone_is_registered_again_by_its_call(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A registration keeps a tenant in the registry for two of the longest lease (a reaper
    drops it after that if it holds no lease): its calls register it again once half of that is
    gone, so every lease a call writes lands while the tenant is kept. Not at each call."""
    upstreams = {"openai": {"base_url": fake.base_url, "passthrough_auth": True}}
    proxy = await make_proxy(
        passthrough=True, upstreams=upstreams, limits={"reaper_interval_s": 3000, "reap_grace_s": 3600}
    )
    fake.api_key = None  # any key: the caller's own
    tenant = "pt-" + digest("sk-own-key")[:PASSTHROUGH_ID_DIGITS]
    assert (await call(proxy, CHAT, body=CHAT_BODY, key="sk-own-key")).status == 200
    registered = proxy.app[STATE].registered_tenants
    first = await redis_client.zscore(TENANTS_KEY, tenant)
    assert first is not None and registered[tenant] == first
    kept_ms = registration_s(proxy.config) * 1000
    assert kept_ms == 2 * (600 + 30) * 1000  # the upstream's timeout_s and lease_margin_s
    store = proxy.app[STATE].store
    assert store is not None
    now_ms = int(store.now() * 1000)
    assert now_ms + kept_ms - 5000 < first <= now_ms + kept_ms
    half_gone = now_ms + kept_ms / 2 + 5000  # not yet
    await redis_client.zadd(TENANTS_KEY, {tenant: half_gone})
    registered[tenant] = int(half_gone)
    assert (await call(proxy, CHAT, body=CHAT_BODY, key="sk-own-key")).status == 200
    assert await redis_client.zscore(TENANTS_KEY, tenant) == half_gone
    half_gone = now_ms + kept_ms / 2 - 5000  # now
    await redis_client.zadd(TENANTS_KEY, {tenant: half_gone})
    registered[tenant] = int(half_gone)
    assert (await call(proxy, CHAT, body=CHAT_BODY, key="sk-own-key")).status == 200
    again = await redis_client.zscore(TENANTS_KEY, tenant)
    assert again is not None and again > now_ms + kept_ms - 5000
    assert registered[tenant] == again


# -- the parse and the plan of a large body, off the event loop ----------------------------------


def _deep_lists(depth: int) -> list[Any]:
    deep: list[Any] = []
    inner = deep
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return deep


# Bodies whose walks (the parse, the estimate's) are long: many small values (40,000 ``{}``, a
# JSON value each: 0.5 µs of walking apiece), deep ones (orjson reads deep nesting slowly), or
# many bytes. And one as nearly every call's.
PLANNED_BODIES: dict[str, tuple[str, JsonDict]] = {
    "items": ("/v1/responses", {"model": "gpt-4o-mini", "input": [{}] * 20_000, "max_output_tokens": 16}),
    "deep": (
        CHAT,
        {**CHAT_BODY, "messages": [{"role": "user", "content": [_deep_lists(240)] * 60}]},
    ),
    "long": (CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": "word " * 60_000}]}),
    "short": (CHAT, CHAT_BODY),
}


def planned_on(monkeypatch: pytest.MonkeyPatch, gate: threading.Event | None = None) -> list[str]:
    """The threads ``planning`` parses and plans bodies on, in order; with ``gate``, a plan off
    the event loop's thread waits for it."""
    threads: list[str] = []
    loop_thread = threading.current_thread()

    def recording(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread()
            threads.append("loop" if thread is loop_thread else thread.name)
            if gate is not None and thread is not loop_thread and fn is plan_call:
                assert gate.wait(10), "the plan was never let go"
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(planning, "parse_body", recording(parse_body))
    monkeypatch.setattr(planning, "plan_call", recording(plan_call))
    return threads


@pytest.mark.parametrize("shape", list(PLANNED_BODIES))
async def test_a_body_of_many_values_or_bytes_is_parsed_and_planned_off_the_event_loop(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """The parse and the estimate walk a body value by value on whatever thread runs them: 4 MiB
    of ``{}`` (1.3 million values, under ``limits.max_body_bytes``) held the event loop 2 s, every
    other tenant's call waiting as long (the DoS hunt). A body of many values or bytes is parsed
    and planned on the plan thread; a small one, nearly every call's, on the loop (no thread's
    hop to pay)."""
    threads = planned_on(monkeypatch)
    proxy = await make_proxy()
    path, body = PLANNED_BODIES[shape]
    reply = await call(proxy, path, body=body)
    assert reply.status == 200, reply.describe()
    expected = "loop" if shape == "short" else "plan_0"
    assert threads == [expected, expected]


def test_a_small_flat_array_of_many_values_is_planned_off_the_loop() -> None:
    """The values a body holds are counted by the ``[``, ``{`` and ``,`` before them: a flat
    list of thousands of numbers (a batch of token ids) under 64 KiB has few brackets and a
    comma before each value, and is walked long enough to be planned off the loop."""
    many = (
        b'{"model":"m","input":[' + b",".join(b"1" for _ in range(planning.PLAN_ON_LOOP_VALUES + 10)) + b"]}"
    )
    assert len(many) <= planning.PLAN_ON_LOOP_BYTES
    assert not planning.plans_on_loop(many)
    assert planning.plans_on_loop(b'{"model":"m","input":[' + b",".join(b"1" for _ in range(100)) + b"]}")


async def test_a_call_planned_off_the_loop_is_judged_by_a_config_reloaded_meanwhile(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A call is judged by the config in force when it is decided: one whose plan, off the loop,
    refused it under a config a reload replaced meanwhile (its model unknown there, routed now)
    is planned again under the new one."""
    gate = threading.Event()
    threads = planned_on(monkeypatch, gate)
    only = {"gpt-4o-mini": {"upstream": "openai", "max_output_tokens": 1000}}
    proxy = await make_proxy(models=only)
    path, body = PLANNED_BODIES["long"]
    answer = asyncio.ensure_future(call(proxy, path, body={**body, "model": "gpt-new"}))
    try:
        for _ in range(500):
            if "plan_0" in threads:
                break
            await asyncio.sleep(0.01)
        raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
        proxy.app[STATE].config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})  # routes "*"
    finally:
        gate.set()
    reply = await answer
    assert reply.status == 200, reply.describe()
    assert threads == ["plan_0", "plan_0", "plan_0", "plan_0"]  # planned twice
    assert len(fake.received) == 1


async def test_a_tenants_large_bodies_wait_their_turn_behind_no_other_tenants(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan thread takes one body of a tenant's at a time: a tenant sending many large
    bodies has its next planned after another tenant's, not all of its own first; past
    ``PLANS_A_TENANT_HOLDS_MOST`` of its own waiting, its next is refused, 503 with retry advice.
    Its own waiting never refuse another tenant's body: the pool's one bound counted them with
    the rest, and one tenant's 256 shut every other tenant's large bodies out."""
    gate = threading.Event()
    planned: list[str] = []

    def gated(**kwargs: Any) -> Any:
        planned.append(kwargs["identity"].tenant)
        if len(planned) == 1:
            assert gate.wait(10), "the plan was never let go"
        return plan_call(**kwargs)

    monkeypatch.setattr(planning, "plan_call", gated)
    monkeypatch.setattr(app_module, "PLANS_A_TENANT_HOLDS_MOST", 3)
    monkeypatch.setattr(app_module, "PLANS_TENANTS_MOST", 2)
    proxy = await make_proxy()
    state = proxy.app[STATE]
    path, body = PLANNED_BODIES["long"]
    answers: list[asyncio.Future[Reply]] = []
    try:
        # The first holds the thread; the next two wait for team-a's turn, team-b's for the thread.
        for key in (KEY_A, KEY_A, KEY_A, KEY_B):
            answers.append(asyncio.ensure_future(call(proxy, path, body=body, key=key)))
            await until_held(state.planner, len(answers))
        refused = await call(proxy, path, body=body, key=KEY_A)
        error = assert_openai_error(refused, 503)
        assert error["code"] == "proxy_busy"
        assert refused.headers["retry-after"] == "1" and refused.headers["x-should-retry"] == "true"
    finally:
        gate.set()
    assert [reply.status for reply in await asyncio.gather(*answers)] == [200] * 4
    assert planned == ["team-a", "team-b", "team-a", "team-a"]
    await until_held(state.planner, 0)


async def test_large_bodies_of_as_many_tenants_as_pass_through_makes_keys_are_bounded(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In pass-through every key is a tenant of its own: past ``PLANS_TENANTS_MOST`` of them
    holding large bodies, a new key's is refused 503; a key holding some still has its next
    taken, within its own bound."""
    gate = threading.Event()
    threads = planned_on(monkeypatch, gate)
    monkeypatch.setattr(app_module, "PLANS_TENANTS_MOST", 2)
    upstreams = {"openai": {"base_url": fake.base_url, "passthrough_auth": True}}
    proxy = await make_proxy(passthrough=True, upstreams=upstreams)
    fake.api_key = None  # any key: the caller's own
    state = proxy.app[STATE]
    path, body = PLANNED_BODIES["long"]
    answers: list[asyncio.Future[Reply]] = []
    try:
        for key in ("sk-own-1", "sk-own-2", "sk-own-1"):
            answers.append(asyncio.ensure_future(call(proxy, path, body=body, key=key)))
            await until_held(state.planner, len(answers))
        refused = await call(proxy, path, body=body, key="sk-own-3")
        assert assert_openai_error(refused, 503)["code"] == "proxy_busy"
    finally:
        gate.set()
    assert [reply.status for reply in await asyncio.gather(*answers)] == [200] * 3
    assert threads == ["plan_0"] * 6  # each parsed and planned there
    await until_held(state.planner, 0)
    assert (await call(proxy, path, body=body, key="sk-own-3")).status == 200


# -- /metrics on the main port -------------------------------------------------------------------

ADMIN_1 = "sk-admin-first"
ADMIN_2 = "sk-admin-second"


async def test_metrics_takes_every_admin_key_not_only_the_last(make_proxy: ProxyFactory) -> None:
    admins = [{"name": "ops-1", "sha256": digest(ADMIN_1)}, {"name": "ops-2", "sha256": digest(ADMIN_2)}]
    proxy = await make_proxy(admin_keys=admins)
    for key in (ADMIN_1, ADMIN_2):
        reply = await call(proxy, "/metrics", method="GET", key=key)
        assert reply.status == 200, reply.describe()
        assert reply.headers["Content-Type"] == CONTENT_TYPE_LATEST, reply.describe()
        assert b"llm_proxy_store_errors" in reply.body
    refused = assert_openai_error(await call(proxy, "/metrics", method="GET", key=KEY_A), 401)
    assert refused["code"] == "invalid_api_key", refused


async def test_metrics_refuses_a_key_that_is_not_utf8_as_any_wrong_key(make_proxy: ProxyFactory) -> None:
    """A header's bytes that are not UTF-8 reach the handler as surrogate escapes: a 401 as any
    key it does not know, not a 500."""
    proxy = await make_proxy(admin_keys=[{"name": "ops", "sha256": digest(ADMIN_1)}])
    request = (
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer sk-\xff\r\n\r\n"
    )
    status, headers, body = await raw_exchange(proxy, request)
    assert status.startswith(b"HTTP/1.1 401"), (status, body)
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert "x-request-id" in headers


# -- authentication ------------------------------------------------------------------------------


async def test_a_key_that_is_not_utf8_is_a_401_not_a_tenant_of_its_own(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """In pass-through any key names a tenant: bytes that are not UTF-8 would name one by a key
    the upstream never gets as sent. Refused as a wrong key, in either mode."""
    for passthrough in (False, True):
        proxy = await make_proxy(passthrough=passthrough)
        status, _, body = await raw_exchange(
            proxy,
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
            + b"Authorization: Bearer sk-\xff\xfe-own\r\n"
            + f"Content-Type: application/json\r\nContent-Length: {len(dumps(CHAT_BODY))}\r\n\r\n".encode()
            + dumps(CHAT_BODY),
        )
        assert status.startswith(b"HTTP/1.1 401"), (passthrough, status, body)
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key"), error
    assert fake.received == []


async def test_a_passthrough_caller_is_named_by_128_bits_of_its_keys_digest(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The tenant and key name a billing view shows for a caller's own key: ``pt-`` and the first
    32 hex digits of its SHA-256, on the standard tier."""
    upstreams = {"openai": {"base_url": fake.base_url, "passthrough_auth": True}}
    proxy = await make_proxy(passthrough=True, upstreams=upstreams)
    reply = await call(proxy, "/v1/billing/keys/self", method="GET", key="sk-own-key")
    assert reply.status == 200, reply.describe()
    name = "pt-" + digest("sk-own-key")[:PASSTHROUGH_ID_DIGITS]
    assert PASSTHROUGH_ID_DIGITS == 32
    view = reply.json()
    assert (view["key"], view["tenant"], view["tier"]) == (name, name, "standard"), view


# -- what the HTTP parser refuses, in OpenAI's format ----------------------------------------------

PARSER_REFUSALS: dict[str, tuple[bytes, str]] = {
    "a-method-of-no-token": (b"GE(T /v1/models HTTP/1.1\r\n", "the method is not valid"),
    "an-unknown-http-version": (b"GET /v1/models HTTP/9.x\r\n", "the request line is not valid"),
    "a-header-past-the-parsers-limit": (
        b"GET /v1/models HTTP/1.1\r\nX-Long: " + b"x" * 70_000 + b"\r\n",
        "a request line or header is too long",
    ),
    "a-space-in-a-header-name": (b"GET /v1/models HTTP/1.1\r\nX Trace: a\r\n", "it is malformed"),
}


@pytest.mark.parametrize("name", list(PARSER_REFUSALS))
async def test_a_parser_refusal_names_its_reason_and_carries_a_request_id(proxy: Proxy, name: str) -> None:
    """Each refusal says which part of the request was wrong (in words of the proxy's own, never
    the bytes: they may hold a key), with the id a support request quotes."""
    start, reason = PARSER_REFUSALS[name]
    status, headers, body = await raw_exchange(
        proxy, start + f"Host: x\r\nAuthorization: Bearer {KEY_A}\r\nConnection: close\r\n\r\n".encode()
    )
    assert status.split(b" ")[1] == b"400", (status, body)
    assert headers["content-type"].startswith("application/json"), headers
    assert json.loads(body) == {
        "type": "error",  # Anthropic's, beside OpenAI's error: the path is not known there
        "error": {
            "message": f"The request is not valid HTTP: {reason}.",
            "type": "invalid_request_error",
            "param": None,
            "code": "bad_http_request",
        },
    }
    request_id = headers.get("x-request-id", "")
    assert request_id.startswith("req_") and len(request_id) == 36, headers


# -- the error middleware: the header limit, unknown routes, methods, the store -------------------

LIMIT = 1024


def headers_of_size(total: int, *, pad_in_name: bool) -> bytes:
    """A GET whose header names and values add up to ``total`` bytes (what the limit counts)."""
    fixed = [("Host", "x"), ("Connection", "close")]
    used = sum(len(n) + len(v) for n, v in fixed)
    if pad_in_name:
        name, value = "X-" + "n" * (total - used - 2 - 1), "v"
    else:
        name, value = "X-Pad", "v" * (total - used - 5)
    lines = [*fixed, (name, value)]
    assert sum(len(n) + len(v) for n, v in lines) == total
    return b"GET /healthz HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in lines).encode() + b"\r\n"


@pytest.mark.parametrize("pad_in_name", [False, True], ids=["long-value", "long-name"])
async def test_the_header_limit_counts_names_and_values_and_takes_headers_at_the_limit(
    make_proxy: ProxyFactory, pad_in_name: bool
) -> None:
    """The README's limit: all header names and values together, a request at it taken."""
    proxy = await make_proxy(limits={"max_header_bytes": LIMIT})
    status, _, body = await raw_exchange(proxy, headers_of_size(LIMIT, pad_in_name=pad_in_name))
    assert status.startswith(b"HTTP/1.1 200"), (status, body)
    status, headers, body = await raw_exchange(proxy, headers_of_size(LIMIT + 1, pad_in_name=pad_in_name))
    assert status.startswith(b"HTTP/1.1 431"), (status, body)
    assert json.loads(body)["error"] == {
        "message": f"The request headers exceed {LIMIT} bytes.",
        "type": "invalid_request_error",
        "param": None,
        "code": "headers_too_large",
    }
    assert "x-request-id" in headers


async def test_a_head_at_the_largest_header_limit_beside_the_longest_line_is_taken(
    make_proxy: ProxyFactory,
) -> None:
    """What aiohttp's parser may hold of a head (the next test) lies above every head the
    config takes: 60 KiB of names and values, the most ``limits.max_header_bytes`` takes, in 1,000
    headers, behind a request line near the parser's 64 KiB."""
    largest = 60 * 1024
    proxy = await make_proxy(limits={"max_header_bytes": largest})
    fixed = [("Host", "x"), ("Connection", "close")]
    room = largest - sum(len(n) + len(v) for n, v in fixed)
    names = [f"X-{i:03}" for i in range(1000)]
    value_bytes, extra_bytes = divmod(room - sum(map(len, names)), len(names))
    lines = [*fixed, *((n, "v" * (value_bytes + (i < extra_bytes))) for i, n in enumerate(names))]
    assert sum(len(n) + len(v) for n, v in lines) == largest
    target = "/healthz?" + "q" * (64 * 1024 - 100)
    head = f"GET {target} HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in lines) + "\r\n"
    status, _, body = await raw_exchange(proxy, head.encode())
    assert status.startswith(b"HTTP/1.1 200"), (status, body)


async def test_a_head_past_what_the_parser_may_hold_is_refused_as_it_arrives(
    make_proxy: ProxyFactory,
) -> None:
    """``limits.max_header_bytes`` is counted once aiohttp's parser has the whole head, which its
    own limits (1,024 fields of 64 KiB each) let reach 64 MiB: held, no key needed, until it
    ended, or for the keep-alive timeout when it never did (4 connections sending 60 MB each grew
    the process by 470 MB). A head past a request line and 64 KiB of fields is refused as it
    comes: 431 in the parser refusals' JSON, the connection closed, its end never sent."""
    proxy = await make_proxy()
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    field = b"X-Filler: " + b"v" * 8 * 1024 + b"\r\n"
    sent_bytes, answer, closed = 0, b"", False
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        while not answer and sent_bytes < 512 * 1024:
            writer.write(field)
            await writer.drain()
            sent_bytes += len(field)
            with contextlib.suppress(TimeoutError):
                answer = await asyncio.wait_for(reader.read(65536), 0.01)
    except ConnectionError:
        closed = True  # while sending: its answer is read below
    assert answer or closed, f"a head of {sent_bytes} bytes, not ended, is still being read and held"
    try:  # to the connection's end (an HTTP/1.0 answer, as every parser refusal's: no keep-alive)
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            answer += chunk
    except ConnectionResetError:
        pass  # the head's rest, sent after the answer, reset the closed connection
    finally:
        writer.close()
    assert answer, f"a head of {sent_bytes} bytes, not ended, closed unanswered"
    status, headers, body = answer_parts(answer)
    assert status.split(b" ")[1] == b"431", answer
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "headers_too_large"), error
    assert error["message"] == "The request line and headers exceed 136192 bytes.", error  # 133 KiB
    assert headers["x-request-id"].startswith("req_"), headers


async def test_the_head_count_starts_again_with_each_request_on_a_kept_connection(proxy: Proxy) -> None:
    """The bytes counted against the head bound are those of one head: on a kept connection
    (an SDK's pool), 24 requests whose heads of 12 KB each come in three reads, 290 KB in all,
    twice the bound, are all answered, none refused with 431."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    pad = b"X-Pad: " + b"p" * 4000 + b"\r\n"
    parts = [b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + pad, pad, pad + b"\r\n"]
    try:
        for _ in range(24):
            for part in parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.01)  # a read of its own: what ends no head is counted
            head, body = await read_answer(reader)
            assert head.startswith(b"http/1.1 200"), (head, body)
            assert b"\r\nconnection: close\r\n" not in head, head
    finally:
        writer.close()
    assert 24 * sum(map(len, parts)) > 2 * HEAD_BOUND_BYTES


# A chunked body's trailer section is header fields too, held by the same parser (C: as bytes and
# as strings, up to 1,024 fields of 64 KiB; Python: as lines), and it comes while the body is
# pending, which the head's count does not cover.
HEAD_BOUND_BYTES = 136_192


def chunked_call(
    body: bytes, *, chunk_bytes: int, trailer: bytes = b"", coding: str = "", key: str = KEY_A
) -> bytes:
    """A chat call whose ``body`` comes in chunks of ``chunk_bytes``, ending in ``trailer``."""
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
    head += "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    head += f"Content-Encoding: {coding}\r\n" if coding else ""
    pieces = (body[at : at + chunk_bytes] for at in range(0, len(body), chunk_bytes))
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return head.encode() + b"\r\n" + chunks + b"0\r\n" + trailer + b"\r\n"


async def assert_chunked_calls_are_served(url: str) -> None:
    """Bodies in 1-byte chunks, whose framing (5 bytes a data byte) passes the head bound many
    times over, plain or gzipped (the body's reader then counts decoded bytes), and a body with a
    small trailer: each served."""
    content = base64.b64encode(random.Random(7).randbytes(30 * 1024)).decode()  # gzip leaves 30 KiB
    body = json.dumps({**CHAT_BODY, "messages": [{"role": "user", "content": content}]}).encode()
    calls = {
        "1-byte chunks": chunked_call(body, chunk_bytes=1),
        "gzipped, 1-byte chunks": chunked_call(gzip.compress(body), chunk_bytes=1, coding="gzip"),
        "a small trailer": chunked_call(dumps(CHAT_BODY), chunk_bytes=7, trailer=b"X-Checksum: 1f3a\r\n"),
    }
    assert len(gzip.compress(body)) * 5 > HEAD_BOUND_BYTES
    for name, request in calls.items():
        status, _, answer = answer_parts(await _raw(url, request))
        assert status.startswith(b"HTTP/1.1 200"), (name, status, answer[:300])


async def trailers_past_the_head_bound(url: str, key: str = KEY_A) -> tuple[int, bytes]:
    """A chunked call whose body ends at once and whose trailer section then comes, 8 KiB fields,
    never ended, until the connection closes or 1 MiB is sent: what was sent, and the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    field = b"X-Trailer: " + b"v" * 8 * 1024 + b"\r\n"
    sent_bytes, answer = 0, b""
    try:
        writer.write(chunked_call(b"{}", chunk_bytes=2, key=key).removesuffix(b"\r\n"))
        while sent_bytes < 1024 * 1024:
            writer.write(field)
            await writer.drain()
            sent_bytes += len(field)
            with contextlib.suppress(TimeoutError):
                answer += await asyncio.wait_for(reader.read(65536), 0.01)
        return sent_bytes, answer
    except ConnectionError:
        pass  # closed: what is left of its answer is read below
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            answer += chunk
    except ConnectionError:
        pass  # the trailers sent after the answer reset the closed connection
    finally:
        writer.close()
    return sent_bytes, answer


def assert_trailers_refused(sent_bytes: int, answer: bytes) -> None:
    assert sent_bytes < 1024 * 1024, f"{sent_bytes} bytes of trailer fields read and held"
    assert answer, f"{sent_bytes} bytes of trailer fields, not ended, closed unanswered"
    status, headers, body = answer_parts(answer)
    assert status.split(b" ")[1] == b"400", answer[:300]
    assert headers["connection"] == "close", headers
    assert json.loads(body)["error"] == {
        "message": "The request is not valid HTTP: a chunked body's trailer fields are too large.",
        "type": "invalid_request_error",
        "param": None,
        "code": "bad_http_request",
    }


async def test_a_chunked_bodys_trailers_past_the_head_bound_are_refused_as_they_arrive(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Past the head bound of bytes since a chunked body last had data (its trailer section: no
    data comes after it), the body is refused as it comes: 400 in the parser refusals' words, the
    connection closed. Measured before: two connections sending 60 MB of trailers each grew a
    process by 230 MB, held for as long as the body may take (``limits.body_timeout_s``)."""
    proxy = await make_proxy()
    assert_trailers_refused(*await trailers_past_the_head_bound(proxy.url))
    assert not fake.received


async def test_trailers_past_the_head_bound_after_the_answer_end_the_connection_with_no_error_logged(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Answered before its body's end (a wrong key's 401), a chunked body is still read (aiohttp
    reads its rest for 10 s so that the client reads the answer): its trailers are refused the
    same, the connection closed, with no "Unhandled exception" traceback in the log."""
    sent_bytes, answer = await trailers_past_the_head_bound(proxy.url, key="sk-wrong")
    assert sent_bytes < 1024 * 1024, f"{sent_bytes} bytes of trailer fields read and held"
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_chunked_body_in_one_byte_chunks_or_with_a_small_trailer_is_served(proxy: Proxy) -> None:
    """What is counted is what comes after the body's data, not its framing."""
    await assert_chunked_calls_are_served(proxy.url)


async def test_a_large_chunked_body_in_many_reads_is_not_taken_for_trailers(proxy: Proxy) -> None:
    """A chunked body of 320 KB, past the head bound twice over, sent a 32 KB chunk a read, each
    read bringing data: none counts towards the trailers' bound, and the call is answered."""
    content = "x " * 160_000
    body = dumps({**CHAT_BODY, "messages": [{"role": "user", "content": content}]})
    pieces = [body[at : at + 32_000] for at in range(0, len(body), 32_000)]
    assert len(body) > 2 * HEAD_BOUND_BYTES
    parts = [chunked_head(), *(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces), b"0\r\n\r\n"]
    answer = await answer_to(proxy, *parts, pause_s=0.02)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


async def test_a_chunked_bodys_trailers_are_bounded_under_the_pure_python_parser(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's parser keeps trailer lines in its payload parser, up to the fields the head left
    of 1,024, 64 KiB each: refused the same, and the same bodies served."""
    monkeypatch.setenv("AIOHTTP_NO_EXTENSIONS", "1")
    proc = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path).start()
    try:
        assert_trailers_refused(*await trailers_past_the_head_bound(proc.url))
        assert not fake.received
        await assert_chunked_calls_are_served(proc.url)
    finally:
        proc.stop()


async def test_an_unknown_url_is_a_404_unknown_url_in_the_apis_format(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    error = assert_openai_error(await call(proxy, "/v1/assistants", body={"x": 1}), 404)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unknown_url", None)
    assert error["message"].startswith("Unknown endpoint POST /v1/assistants"), error
    # Under /v1/messages (the Anthropic SDK's batches, count_tokens): Anthropic's format.
    reply = await call(proxy, "/v1/messages/batches", body={"x": 1})
    assert reply.status == 404, reply.describe()
    assert reply.json()["error"]["type"] == "not_found_error", reply.describe()
    assert reply.headers["request-id"] == reply.headers["x-request-id"], reply.describe()
    assert fake.received == []


async def test_a_wrong_method_is_a_405_naming_the_allowed_ones(proxy: Proxy) -> None:
    """RFC 9110 (15.5.6) asks a 405 for ``Allow``; a client reads the error's code."""
    reply = await call(proxy, CHAT, method="PUT", body=CHAT_BODY)
    error = assert_openai_error(reply, 405)
    assert (error["type"], error["code"]) == ("invalid_request_error", "method_not_allowed"), error
    assert error["message"] == f"Method PUT is not allowed on {CHAT}.", error
    assert reply.headers["Allow"] == "POST", reply.describe()
    reply = await call(proxy, "/v1/models", method="DELETE")
    assert assert_openai_error(reply, 405)["code"] == "method_not_allowed"
    assert set(reply.headers["Allow"].split(", ")) == {"GET", "HEAD"}, reply.describe()


async def test_a_billing_view_with_the_store_down_is_a_503_with_retry_advice(
    make_proxy: ProxyFactory,
) -> None:
    """A view the error middleware answers: the SDK's retry advice as on a billed call."""
    redis = {"url": f"redis://127.0.0.1:{refused_port()}/0", "socket_timeout_s": 0.5}
    proxy = await make_proxy(redis=redis)
    reply = await call(proxy, "/v1/billing/keys/self", method="GET")
    error = assert_openai_error(reply, 503)
    assert (error["type"], error["code"]) == ("service_unavailable", "store_unavailable"), error
    assert (reply.headers.get("x-should-retry"), reply.headers.get("retry-after")) == ("true", "1")


# -- health and readiness -------------------------------------------------------------------------


async def test_health_and_readiness_bodies(make_proxy: ProxyFactory) -> None:
    """What a load balancer's check reads: alive always, ready only with the store answering."""
    proxy = await make_proxy()
    for path, status, said in [("/healthz", 200, {"status": "ok"}), ("/readyz", 200, {"status": "ready"})]:
        reply = await call(proxy, path, method="GET", key=None)
        assert (reply.status, reply.json()) == (status, said), reply.describe()
    redis = {"url": f"redis://127.0.0.1:{refused_port()}/0", "socket_timeout_s": 0.5}
    down = await make_proxy(redis=redis)
    reply = await call(down, "/readyz", method="GET", key=None)
    assert (reply.status, reply.json()) == (503, {"status": "unavailable", "store": "unreachable"})
    assert (await call(down, "/healthz", method="GET", key=None)).status == 200


# -- aiohttp's pure-Python HTTP parser ------------------------------------------------------------

# What each request is refused for, in the proxy's words, under aiohttp's pure-Python parser.
PURE_PYTHON_REFUSALS: dict[str, tuple[bytes, str]] = {
    **PARSER_REFUSALS,
    # The C parser's is a bare BadHttpMessage ("it is malformed"); Python's names the header.
    "a-space-in-a-header-name": (PARSER_REFUSALS["a-space-in-a-header-name"][0], "a header is not valid"),
    "a-chunk-size-that-is-not-one": (
        b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "the body's framing is not valid",
    ),
    "length-beside-chunked": (
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        "it is malformed",
    ),
    "a-length-that-is-not-a-number": (
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        "a header is not valid",
    ),
    "a-body-that-does-not-decode": (
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\nhello",
        "the body does not decode as its Content-Encoding says",
    ),
    # The body in a read of its own, after the handler began to wait for it (``|``: a pause):
    # what failed is told by the parser's error, not by the Content-Encoding the request names
    # (aiohttp decodes none it does not know, "gzip, br" among them).
    "a-chunk-size-that-is-not-one-in-a-later-read": (
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Encoding: gzip\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n|zz\r\n{}\r\n0\r\n\r\n",
        "the body's framing is not valid",
    ),
    "a-chunk-size-that-is-not-one-under-two-codings": (
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Encoding: gzip, br\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n|zz\r\n{}\r\n0\r\n\r\n",
        "the body's framing is not valid",
    ),
    "a-body-that-does-not-decode-in-a-later-read": (
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\n|hello",
        "the body does not decode as its Content-Encoding says",
    ),
}


async def _raw_in_parts(url: str, parts: list[bytes]) -> bytes:
    """``parts`` sent 0.3 s apart on one connection, then what the proxy answers until it closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(0.3)
        writer.write(part)
        await writer.drain()
    whole = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return whole


async def test_the_pure_python_http_parser_is_answered_in_the_same_words(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where aiohttp's C extensions are absent or turned off (``AIOHTTP_NO_EXTENSIONS``, PyPy, a
    platform without its wheel) its parser is Python's, whose refusals are other exceptions with
    other texts: each is still OpenAI's error in the proxy's own words, the request's bytes never
    quoted, and nothing forwarded."""
    monkeypatch.setenv("AIOHTTP_NO_EXTENSIONS", "1")
    probe = "from aiohttp import http_parser as p; print(p.HttpRequestParser is p.HttpRequestParserPy)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout == "True\n"
    proc = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path).start()
    try:
        for name, (start, said) in PURE_PYTHON_REFUSALS.items():
            line, _, rest = start.partition(b"\r\n")
            request = (
                line
                + f"\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\nConnection: close\r\n".encode()
                + rest
            )
            if b"\r\n\r\n" not in request:
                request += b"\r\n"
            whole = await _raw_in_parts(proc.url, request.split(b"|"))
            head, _, body = whole.partition(b"\r\n\r\n")
            assert head.split(b" ")[1] == b"400", (name, whole)
            assert b"content-type: application/json" in head.lower(), (name, whole)
            error = json.loads(body)["error"]
            assert error == {
                "message": f"The request is not valid HTTP: {said}.",
                "type": "invalid_request_error",
                "param": None,
                "code": "bad_http_request",
            }, (name, error)
            assert KEY_A.encode() not in whole, name
    finally:
        proc.stop()
    assert not fake.received
