"""The exchange's figures as an operator and an SDK see them (proxy/relay.py, proxy/relay_body.py):
the metrics a call leaves, the error each failure is told as, and the bill each one leaves. Found by
a mutation hunt: each test fails on a change of the exchange the other tests let through."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from proxy.redis_scripts import read_scripts
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from tests.conftest import (
    UPSTREAM_KEY,
    Proxy,
    ProxyFactory,
    unreachable_port,
    unreachable_upstream,
    until_upstream_received,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MODEL, MSGS, run_headers
from tests.test_bad_input import LEDGER_A, Plan, ScriptedUpstream, scripted_upstreams, send
from tests.test_estimate import until_script_parked
from tests.test_stream_dialects import chunk
from tests.test_upstream_bodies import CHAT, USAGE, chat_body, dumps, proxy_before
from tests.test_whole_answers_as_sent import answer

# The upstream's own wait in the overhead tests: the proxy's own share of a call is far below it.
UPSTREAM_WAIT_S = 1.0
# How long the store holds a settle back, in the duration test: far above a call's own time.
SETTLE_HELD_S = 1.0


def sample(proxy: Proxy, name: str, labels: dict[str, str] | None = None) -> float:
    value = proxy.app[STATE].metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def test_answered_calls_count_no_store_error_and_leave_none_in_flight(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    # A settle the store took is not a store error (an alert on llm_proxy_store_errors would page
    # for every call), and a call answered is no longer in flight (a gauge that only grows).
    async with proxy.client() as client:
        await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers=run_headers("whole"))
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSGS, stream=True, extra_headers=run_headers("streamed")
        )
        async for _ in stream:
            pass
    await proxy.recorded()
    assert sample(proxy, "llm_proxy_store_errors_total", {"operation": "settle"}) == 0
    assert sample(proxy, "llm_proxy_inflight_requests", {"tenant": "team-a"}) == 0
    labels = {"tenant": "team-a", "model": MODEL, "endpoint": "chat.completions", "outcome": "ok"}
    assert sample(proxy, "llm_proxy_requests_total", labels) == 2
    assert len(fake.bill) == 2


async def overhead_of(proxy: Proxy) -> tuple[float, float]:
    """The recorded overhead and duration of the one call ``proxy`` answered."""
    await proxy.recorded()
    assert sample(proxy, "llm_proxy_proxy_overhead_seconds_count") == 1
    overhead = sample(proxy, "llm_proxy_proxy_overhead_seconds_sum")
    duration = sample(proxy, "llm_proxy_request_duration_seconds_sum", {"endpoint": "chat.completions"})
    return overhead, duration


async def test_the_overhead_leaves_out_an_upstream_slow_to_answer(proxy: Proxy) -> None:
    # The metric says "excluding the upstream": an upstream a second slow to send its headers
    # counted as the proxy's own time sends an operator looking for a slow proxy.
    async with proxy.client() as client:
        await client.chat.completions.create(
            model=MODEL, messages=MSGS, extra_body={"fake": {"delay_s": UPSTREAM_WAIT_S}}
        )
    overhead, duration = await overhead_of(proxy)
    assert duration >= UPSTREAM_WAIT_S > overhead


async def test_a_whole_answers_duration_ends_when_it_went_out_not_when_its_settle_came_back(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """A whole answer goes out with its settle on its way (``settle_early``): the client's wait
    ends then. A store slow to reply to the settle (writes paused here) is not the client's time,
    in the duration it is shown as nor in the proxy's overhead."""
    # No reaper round in the pause (its script, in flight, would hold the settle behind it).
    proxy = await make_proxy(redis={"url": own_redis.url}, limits={"reaper_interval_s": 9})
    async with proxy.client() as client:
        # The settle script run once on the store's connection: a first EVALSHA may be refused
        # (NOSCRIPT), and its answer waits for the reply.
        await client.chat.completions.create(model=MODEL, messages=MSGS)
    await proxy.recorded()
    proxy.app[STATE].metrics.duration.clear()
    proxy.app[STATE].metrics.overhead.clear()
    call = asyncio.ensure_future(
        proxy.client().chat.completions.create(
            model=MODEL,
            messages=MSGS,
            extra_body={"fake": {"hold": True}},
            extra_headers=run_headers("paused"),
        )
    )
    await until_upstream_received(fake, 2)  # the warm-up call, then this one: reserved
    await own_client.execute_command("CLIENT", "PAUSE", "10000", "WRITE")  # the settle waits
    sent_at = time.monotonic()
    fake.release()
    await call
    client_waited_s = time.monotonic() - sent_at
    await until_script_parked(own_client)  # the settle, sent and not yet run
    await asyncio.sleep(SETTLE_HELD_S)
    await own_client.execute_command("CLIENT", "UNPAUSE")
    overhead, duration = await overhead_of(proxy)
    assert client_waited_s < SETTLE_HELD_S  # the answer did not wait for the store
    assert overhead < SETTLE_HELD_S and duration < SETTLE_HELD_S, (overhead, duration)


async def slow_body(make_proxy: ProxyFactory, script: ScriptedUpstream, status: int, body: bytes) -> Proxy:
    """A proxy whose call was answered ``status``, its ``body`` in two halves a wait apart."""
    proxy: Proxy = await proxy_before(make_proxy, script.base_url)
    half = len(body) // 2
    script.plan = Plan(status=status, chunks=[body[:half], body[half:]], delay_s=UPSTREAM_WAIT_S)
    async with proxy.client() as client:
        try:
            await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS)
        except Exception as err:  # the error answer is the point, not its class
            assert status >= 400, err
    return proxy


async def test_the_overhead_leaves_out_a_whole_answers_body_slow_to_come(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await slow_body(make_proxy, script, 200, dumps(chat_body()))
    overhead, duration = await overhead_of(proxy)
    assert duration >= UPSTREAM_WAIT_S > overhead


async def test_the_overhead_leaves_out_an_error_body_slow_to_come(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    error = {"error": {"message": "overloaded", "type": "server_error"}}
    proxy = await slow_body(make_proxy, script, 503, dumps(error))
    overhead, duration = await overhead_of(proxy)
    assert duration >= UPSTREAM_WAIT_S > overhead


async def test_upstreams_never_reached_are_told_as_the_proxys_upstream_errors_billed_nothing(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    # The SDK reads the error's type and code: a timeout is told apart from a refusal by its code
    # (and status), and both are the upstream's failure, not the caller's request.
    path, request = CHAT
    for kind, status, code in (
        ("refused", 502, "upstream_error"),
        ("connect_timeout", 504, "upstream_timeout"),
    ):
        with unreachable_port(kind) as port:
            proxy = await make_proxy(upstreams={"openai": unreachable_upstream(port)})
            reply = await send(proxy, lambda: [], redis_client, path, dumps(request))
        (entry,) = reply.new_entries
        error = reply.json()["error"]
        assert (reply.status, error["type"], error["code"]) == (status, "upstream_error", code), (
            reply.describe()
        )
        assert (entry["outcome"], entry["usage_source"], entry["total_tokens"]) == (code, "none", "0")
        assert reply.headers["x-billing-outcome"] == code


async def test_a_whole_answer_that_is_json_but_not_an_object_is_a_502_billed_at_the_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A gateway's ``[]`` or ``"ok"`` is not an answer the SDK can read, and says nothing of what
    # the provider spent: relayed as a 200, the caller's SDK failed on it and the call was "ok".
    proxy = await proxy_before(make_proxy, script.base_url)
    for body in (b"[]", b'"ok"'):
        reply = await answer(proxy, script, redis_client, 200, body)
        (entry,) = reply.new_entries
        error = reply.json()["error"]
        assert (reply.status, error["type"], error["code"]) == (502, "upstream_error", "upstream_error")
        assert error["message"] == "The upstream answer is not a JSON object."
        assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry


async def test_an_error_page_past_the_size_limit_shows_none_of_what_came_of_it(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # The part of a page read before the limit may end inside the operator's key, which the scrub
    # (matching it whole) would miss: the page is told as "no body", and billed as a bare 5xx.
    proxy = await proxy_before(make_proxy, script.base_url, limits={"max_upstream_body_bytes": 1024})
    cut_key = f"<html>upstream auth {UPSTREAM_KEY[:9]}".encode()
    script.plan = Plan(status=502, content_type="text/html", chunks=[cut_key, b"x" * 4096], delay_s=0.2)
    path, request = CHAT
    reply = await send(proxy, lambda: script.received, redis_client, path, dumps(request))
    (entry,) = reply.new_entries
    assert reply.json()["error"]["message"] == "Upstream returned HTTP 502: no body", reply.describe()
    assert UPSTREAM_KEY[:9].encode() not in reply.body
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry


async def test_a_redirect_is_billed_nothing_whatever_usage_its_body_shows(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # README: a redirect is billed nothing (the provider did no work here); a gateway's body with
    # a usage object in it is not the provider's bill.
    proxy = await proxy_before(make_proxy, script.base_url)
    moved = {"Location": "https://elsewhere.example/v1/chat/completions"}
    reply = await answer(proxy, script, redis_client, 307, dumps({"usage": USAGE}), extra_headers=moved)
    (entry,) = reply.new_entries
    assert (reply.status, reply.json()["error"]["code"]) == (502, "upstream_redirect"), reply.describe()
    assert (entry["outcome"], entry["total_tokens"]) == ("upstream_error", "0"), entry


async def test_a_stream_call_redirected_with_an_event_stream_is_still_a_redirect(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # Only a success is relayed as a stream: a 300 that happens to say text/event-stream is not
    # an answer either, and the SDK must be told not to retry it.
    proxy = await proxy_before(make_proxy, script.base_url)
    events = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    reply = await answer(
        proxy, script, redis_client, 300, events, stream=True, content_type="text/event-stream"
    )
    (entry,) = reply.new_entries
    assert (reply.status, reply.json()["error"]["code"]) == (502, "upstream_redirect"), reply.describe()
    assert reply.headers["x-should-retry"] == "false"
    assert (entry["outcome"], entry["total_tokens"]) == ("upstream_error", "0"), entry


async def test_a_stream_call_answered_with_a_whole_json_body_is_relayed_and_billed_as_one(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # A gateway that ignores ``stream`` answers JSON: read as an event stream it has no events,
    # and the call's usage, right there in the body, would be lost for the reserve.
    proxy = await proxy_before(make_proxy, script.base_url)
    reply = await answer(proxy, script, redis_client, 200, dumps(chat_body()), stream=True)
    (entry,) = reply.new_entries
    assert (reply.status, reply.body) == (200, dumps(chat_body())), reply.describe()
    assert reply.headers["content-type"].startswith("application/json")
    assert (entry["outcome"], entry["usage_source"], entry["input_tokens"]) == ("ok", "provider", "3"), entry


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


STREAM_USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
# A whole, healthy chat stream as the SDK reads it: two words, a finish, the usage asked for.
STREAM = [
    sse(chunk([{"index": 0, "delta": {"role": "assistant", "content": "hello"}, "finish_reason": None}])),
    sse(chunk([{"index": 0, "delta": {"content": " world"}, "finish_reason": None}])),
    sse(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])),
    sse(chunk([], STREAM_USAGE)),
    b"data: [DONE]\n\n",
]


async def stream_text(client: openai.AsyncOpenAI) -> tuple[str, Any]:
    """The text and the usage of a chat stream, as the SDK reads them."""
    stream = await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for part in stream:
        if part.choices and part.choices[0].delta.content:
            text += part.choices[0].delta.content
        if part.usage is not None:
            usage = part.usage.model_dump(exclude_none=True)
    return text, usage


def billed_as(entry: dict[str, str]) -> tuple[str, str, str, str]:
    return entry["outcome"], entry["usage_source"], entry["input_tokens"], entry["output_tokens"]


async def billed_since(redis_client: aioredis.Redis, before: int) -> list[tuple[str, str, str, str]]:
    return [billed_as(e) for _, e in (await redis_client.xrange(LEDGER_A))[before:]]


@pytest.mark.parametrize(
    "content_type",
    [
        "application/x-ndjson",  # LitServe's OpenAISpec (Lightning-AI/LitServe#359)
        "application/octet-stream",  # what aiohttp reads when there is none (a Starlette
        # StreamingResponse without its media_type: nearai/private-ml-sdk#20)
        "text/plain; charset=utf-8",
    ],
)
async def test_a_stream_not_labelled_text_event_stream_is_relayed_and_billed_on_its_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, content_type: str
) -> None:
    """The openai SDK reads a stream it asked for as SSE whatever its Content-Type, so these
    servers work when called directly. Through the proxy such a 200 was read as one JSON body:
    a 502 "broken or non-JSON answer" (which the SDK retries), billed at the reserve although
    the provider's usage came whole."""
    script.plan = Plan(content_type=content_type, chunks=STREAM)
    direct = openai.AsyncOpenAI(base_url=script.base_url, api_key="sk-x", max_retries=0)
    assert await stream_text(direct) == ("hello world", STREAM_USAGE)

    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    before = await redis_client.xlen(LEDGER_A)
    got = await stream_text(proxy.client())
    await proxy.recorded()
    assert (got, await billed_since(redis_client, before)) == (
        ("hello world", STREAM_USAGE),
        [("ok", "provider", "5", "2")],
    )


async def test_a_stream_labelled_otherwise_is_one_call_not_three_at_the_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The same stream with the SDK's default retries: the proxy's 502 carried no
    ``x-should-retry: false``, so the SDK sent the call twice more, each attempt answered whole
    by the provider and billed at the reserve: three charges for one call."""
    script.plan = Plan(content_type="application/x-ndjson", chunks=STREAM)
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    before = await redis_client.xlen(LEDGER_A)
    with contextlib.suppress(openai.APIStatusError):  # the calls and charges are what counts
        await stream_text(proxy.client(max_retries=2, timeout=10))
    await proxy.recorded()
    billed = await billed_since(redis_client, before)
    assert (len(script.received), billed) == (1, [("ok", "provider", "5", "2")])


@pytest.mark.parametrize("content_type", ["application/json", "application/problem+json"])
async def test_a_stream_call_answered_with_any_json_type_is_relayed_whole(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, content_type: str
) -> None:
    # The counterpart: a JSON type (a +json one too) is a provider that ignored ``stream``.
    proxy = await proxy_before(make_proxy, script.base_url)
    body = dumps(chat_body())
    reply = await answer(proxy, script, redis_client, 200, body, stream=True, content_type=content_type)
    (entry,) = reply.new_entries
    assert (reply.status, reply.body) == (200, body), reply.describe()
    assert (entry["outcome"], entry["usage_source"], entry["input_tokens"]) == ("ok", "provider", "3"), entry


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", b"<html><body>maintenance</body></html>"),
        ("application/json", b"[]"),
        ("text/event-stream", b"".join(STREAM)),
    ],
    ids=["html-as-json", "not-an-object", "events"],
)
async def test_a_whole_answer_that_is_no_json_object_is_not_retried_into_three_billed_calls(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    content_type: str,
    body: bytes,
) -> None:
    """A 200 the proxy cannot relay as a whole answer: called directly, the SDK raises once (it
    never retries a 200); the proxy's 502 said nothing of retrying, and the SDK's default retries
    ran and billed the call twice more (found by the SDK helpers hunt)."""
    script.plan = Plan(content_type=content_type, chunks=[body])
    proxy = await proxy_before(make_proxy, script.base_url)
    before = await redis_client.xlen(LEDGER_A)
    with pytest.raises(openai.APIStatusError) as raised:
        await proxy.client(max_retries=2).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=50)
    assert raised.value.response.headers.get("x-should-retry") == "false"
    assert len(script.received) == 1
    assert len(await billed_since(redis_client, before)) == 1


@pytest.mark.parametrize("content_type", ["text/plain", "text/html", "application/octet-stream"])
async def test_a_stream_call_answered_whole_json_under_another_type_is_billed_on_its_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, content_type: str
) -> None:
    """A provider that ignored ``stream`` and labels its JSON neither JSON nor SSE (Flask's
    ``return json.dumps(...)`` is text/html): read as a stream, it is one that holds no event
    (the client gets the proxy's error event, as its SDK reads no event either), and it was
    billed at the reserve though the answer carried the provider's usage (found by the review).
    Its usage is taken; the answer is not relayed as an event (it never was one)."""
    proxy = await proxy_before(make_proxy, script.base_url)
    reply = await answer(
        proxy, script, redis_client, 200, dumps(chat_body()), stream=True, content_type=content_type
    )
    (entry,) = reply.new_entries
    assert reply.status == 200 and b"event: error" in reply.body, reply.describe()
    assert (entry["outcome"], entry["usage_source"], entry["input_tokens"]) == (
        "upstream_error",
        "provider",
        "3",
    ), entry


@pytest.mark.parametrize(
    "events",
    [b"".join(STREAM), b"".join(STREAM[:4])[:-2]],
    ids=["done", "usage-last-without-its-blank-line"],
)
async def test_a_whole_answer_call_answered_as_a_stream_is_billed_on_the_usage_it_carries(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, events: bytes
) -> None:
    """A server that streams whatever ``stream`` says, the provider's usage in its last chunk
    (Together, Groq, Mistral, TGI and llama.cpp put it there unasked): the body, not JSON, was
    a 502 billed at the reserve. Still a 502 (not the answer the SDK asked for), now billed on
    the provider's usage, as the README's Faults table says of a non-JSON body."""
    proxy = await proxy_before(make_proxy, script.base_url)
    reply = await answer(proxy, script, redis_client, 200, events, content_type="text/event-stream")
    (entry,) = reply.new_entries
    assert (reply.status, reply.json()["error"]["code"]) == (502, "upstream_error"), reply.describe()
    assert billed_as(entry) == ("upstream_error", "provider", "5", "2"), entry


async def test_a_whole_answer_call_answered_as_a_stream_then_timed_out_is_billed_on_its_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The same events, their usage chunk come, then the body stalls past the call's timeout: the
    path of a body cut or timed out read it as JSON alone, and billed the reserve (found by the
    review of the fix above)."""
    proxy = await proxy_before(make_proxy, script.base_url)  # timeout_s 3
    chunks = [b"".join(STREAM[:4]), STREAM[4]]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks, delay_s=5.0)
    path, request = CHAT
    reply = await send(proxy, lambda: script.received, redis_client, path, dumps(request))
    (entry,) = reply.new_entries
    assert reply.status == 504, reply.describe()
    assert billed_as(entry) == ("upstream_timeout", "provider", "5", "2"), entry


async def test_a_whole_answer_call_answered_as_a_stream_without_usage_is_billed_its_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # The counterpart: events without the provider's figures say nothing of what it spent.
    proxy = await proxy_before(make_proxy, script.base_url)
    events = b"".join(STREAM[:3] + STREAM[4:])
    reply = await answer(proxy, script, redis_client, 200, events, content_type="text/event-stream")
    (entry,) = reply.new_entries
    assert reply.status == 502, reply.describe()
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "reserve"), entry


async def test_a_stream_call_answered_whole_stops_renewing_its_lease_once_answered(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
) -> None:
    # A stream call whose upstream answers JSON renews its lease while the body comes (a slow one
    # must not be reaped); a renewal left running after the answer sends the store a script every
    # third of the lease for as long as the process lives, one timer more for each such call.
    upstream = {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 0.5}
    proxy = await make_proxy(
        # The store's timeout below two thirds of the lease (0.6 s).
        redis={"url": own_redis.url, "socket_timeout_s": 0.3},
        upstreams={"openai": upstream},
        limits={"lease_margin_s": 0.1},
    )
    renew_sha = read_scripts()["renew"][1]
    path, request = CHAT
    script.plan = Plan(chunks=[dumps(chat_body())])
    reply = await send(proxy, lambda: script.received, own_client, path, dumps({**request, "stream": True}))
    assert reply.status == 200, reply.describe()
    await proxy.recorded()
    # Every command from here on, with its arguments: Redis's own record of what it ran.
    await own_client.config_set("slowlog-log-slower-than", 0)
    await own_client.slowlog_reset()
    await asyncio.sleep(0.6)  # three renewals' worth of a 0.6 s lease
    ran = [entry["command"] for entry in await own_client.slowlog_get(1000)]
    assert not [c for c in ran if renew_sha.encode() in c], ran


async def test_an_answer_that_wrote_nothing_still_keeps_the_context_it_read(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # Only a call billed nothing at all (it never went out) made no context: one that read its
    # input and wrote no output (a tool call cut to nothing, a max_output_tokens of its reasoning)
    # is continued all the same, and the next call must reserve what it read.
    proxy = await make_proxy()
    body = {"fake": {"usage": {"input_tokens": 1000, "output_tokens": 0}}}
    answer = await proxy.client().responses.create(model=MODEL, input="hello", store=True, extra_body=body)
    await proxy.recorded()
    assert int(await redis_client.get(f"lbp:{{team-a}}:ctx:{answer.id}") or 0) == 1000
