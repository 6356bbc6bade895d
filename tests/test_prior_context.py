"""A Responses call that continues a stored context (``previous_response_id``, ``conversation``)
reserves that context's size: the provider bills it as input again, so a call sending "hi" may
cost what the whole conversation does. The official SDK as client; the fake upstream keeps its
contexts and bills them as OpenAI does."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import redis.asyncio as aioredis

from proxy.errors import StoreError
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.state import STATE
from proxy.tokenizer import Tokenizer
from tests import test_sdk_anthropic
from tests.conftest import (
    KEY_A,
    KEY_B,
    Proxy,
    ProxyFactory,
    digest,
    unreachable_port,
    unreachable_upstream,
    until_redis_busy,
    until_upstream_received,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries
from tests.test_bad_input import Plan, dumps
from tests.test_budgets import meters
from tests.test_dialects import both_with
from tests.test_estimate import TEXT, QuarterEncoding, until_quick
from tests.test_sdk_anthropic import Queue, claude_proxy, ev
from tests.test_sdk_anthropic import message as sdk_message
from tests.test_store_faults import _ledger_len, journaling_proxy, wait_for

ADMIN = "sk-admin-ops"
RUN = "lbp:{team-a}:run:chain"
LEDGER = "lbp:{team-a}:ledger"
# The first call: a short request the provider bills as a long one (a file, a search, a
# context of its own), and 8 output tokens.
FIRST_INPUT = 1000
FIRST_CONTEXT = FIRST_INPUT + 8
INPUT_CEILING = 1500  # room for the first call and the second's request, not for its context


def ctx(name: str) -> str:
    return "lbp:{team-a}:ctx:" + name


async def chained_proxy(make_proxy: ProxyFactory, **limits: Any) -> Proxy:
    return await make_proxy(
        tiers={"standard": {"run": {"input_tokens": INPUT_CEILING}}},
        limits=limits,
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}],
    )


def client(proxy: Proxy) -> openai.AsyncOpenAI:
    return proxy.client(default_headers={"X-Run-Id": "chain"})


async def first(proxy: Proxy, *, stream: bool = False, store: bool = True, **extra: Any) -> None:
    body = {"fake": {"usage": {"input_tokens": FIRST_INPUT}}, **extra}
    create = client(proxy).responses.create
    if stream:
        async for _ in await create(model="gpt-4o-mini", input="hello", stream=True, extra_body=body):
            pass
    else:
        await create(model="gpt-4o-mini", input="hello", store=store, extra_body=body)


async def used_input(redis_client: aioredis.Redis) -> int:
    return int(await redis_client.hget(RUN, "used:input_tokens") or 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_continuing_a_response_reserves_its_context(
    stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await chained_proxy(make_proxy)
    await first(proxy, stream=stream)
    assert int(await redis_client.get(ctx("resp_1")) or 0) == FIRST_CONTEXT
    assert 0 < await redis_client.ttl(ctx("resp_1")) <= 3600
    # Reserved at "hi" it fitted, and the provider billed 1,009 input tokens past the ceiling.
    with pytest.raises(openai.RateLimitError) as refused:
        await client(proxy).responses.create(
            model="gpt-4o-mini", input="hi", previous_response_id="resp_1", max_output_tokens=16
        )
    assert "input_tokens" in str(refused.value)
    assert len(fake.bill) == 1
    assert await used_input(redis_client) == FIRST_INPUT <= INPUT_CEILING


async def test_a_call_continuing_a_conversation_reserves_it(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await chained_proxy(make_proxy)
    fake.contexts["conv_1"] = 0
    await first(proxy, conversation="conv_1")
    assert int(await redis_client.get(ctx("conv_1")) or 0) == FIRST_CONTEXT
    with pytest.raises(openai.RateLimitError):
        await client(proxy).responses.create(
            model="gpt-4o-mini",
            input="hi",
            extra_body={"conversation": {"id": "conv_1"}},
            max_output_tokens=16,
        )
    assert len(fake.bill) == 1


async def test_what_fits_is_reserved_with_its_context_and_billed_as_the_provider_says(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy()
    await first(proxy)
    reply = await proxy.client().responses.with_raw_response.create(
        model="gpt-4o-mini", input="hi", previous_response_id="resp_1", max_output_tokens=16
    )
    assert reply.headers["x-billing-input-tokens"] == str(FIRST_CONTEXT + 1)
    entries = [dict(fields) for _, fields in await redis_client.xrange(LEDGER)]
    second = next(e for e in entries if e["request_id"] == reply.headers["x-request-id"])
    assert int(second["reserved_input_tokens"]) >= FIRST_CONTEXT + 1
    # The chain goes on: the second answer's context is the first's and its own.
    assert int(await redis_client.get(ctx("resp_2")) or 0) == FIRST_CONTEXT + 1 + 8
    assert fake.bill[1].prompt_tokens == FIRST_CONTEXT + 1


async def test_a_context_the_proxy_never_billed_is_reserved_at_the_request(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await chained_proxy(make_proxy)
    fake.contexts["resp_elsewhere"] = 3000  # made with the provider directly
    reply = await client(proxy).responses.with_raw_response.create(
        model="gpt-4o-mini", input="hi", previous_response_id="resp_elsewhere", max_output_tokens=16
    )
    assert reply.headers["x-billing-input-tokens"] == "3001"  # billed on the provider's figures
    await proxy.recorded()
    async with (
        aiohttp.ClientSession() as session,
        session.get(proxy.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as resp,
    ):
        metrics = await resp.text()
    assert 'llm_proxy_prior_contexts_total{result="unknown"} 1.0' in metrics


async def test_an_answer_not_stored_is_not_kept_and_a_failed_call_keeps_its_conversation(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await chained_proxy(make_proxy)
    fake.contexts["conv_1"] = 0
    await first(proxy, store=False, conversation="conv_1")
    assert await redis_client.exists(ctx("resp_1")) == 0
    assert int(await redis_client.get(ctx("conv_1")) or 0) == FIRST_CONTEXT
    # An upstream error made no response: the conversation is as it was, not 0.
    with pytest.raises(openai.APIStatusError):
        await proxy.client().responses.create(
            model="gpt-4o-mini",
            input="hi",
            extra_body={"conversation": "conv_1", "fake": {"mode": "error", "status": 500}},
        )
    assert int(await redis_client.get(ctx("conv_1")) or 0) == FIRST_CONTEXT


async def test_contexts_are_not_kept_when_turned_off(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await chained_proxy(make_proxy, prior_context_ttl_s=0)
    await first(proxy)
    assert await redis_client.exists(ctx("resp_1")) == 0
    await client(proxy).responses.create(
        model="gpt-4o-mini", input="hi", previous_response_id="resp_1", max_output_tokens=16
    )
    assert await used_input(redis_client) == FIRST_INPUT + FIRST_CONTEXT + 1 > INPUT_CEILING  # overspent


# Reserved at its 1,000 bytes and 11 tokens of overhead (no tiktoken files in tests), billed so.
RESPONSES_OVERHEAD = 4 * 2 + 3  # one input item, and the reply's priming
LONG_INPUT, LONG_BILLED = "x" * 1000, 1011


async def test_a_continuation_sent_once_the_stream_said_completed_reserves_the_context(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The client has the answer whole (and its id) at ``response.completed``: an agent continues
    it then, not once the connection has closed (an upstream may be slow to close it, and the
    settle takes a round trip). The size must be kept by then."""
    proxy = await chained_proxy(make_proxy)
    body = {
        "model": "gpt-4o-mini",
        "input": LONG_INPUT,
        "stream": True,
        "fake": {"usage": {"input_tokens": LONG_BILLED}, "tail_delay_s": 1.0},
    }
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "chain"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/responses", json=body, headers=headers) as first,
    ):
        assert first.status == 200, await first.text()
        completed = False
        async for line in first.content:
            completed = completed or line.startswith(b"event: response.completed")
            if completed and line == b"\n":
                break  # the event is whole: the SDK yields it
        assert completed
        # 1,019 of context on top of "hi", with the first call's 1,011 held: past the ceiling.
        with pytest.raises(openai.RateLimitError):
            await client(proxy).responses.create(
                model="gpt-4o-mini", input="hi", previous_response_id="resp_1", max_output_tokens=16
            )
    assert len(fake.bill) == 1
    assert await used_input(redis_client) <= INPUT_CEILING


# A gateway's response id (LiteLLM's: base64 of its routing and the provider's id), 157 characters.
GATEWAY_ID = (
    "resp_bGl0ZWxsbTpjdXN0b21fbGxtX3Byb3ZpZGVyOm9wZW5haTttb2RlbF9pZDpOb25lO3Jlc3BvbnNlX2lkOnJlc3Bf"
    "NjhiZjE2YzM0ZTk4ODE5NWIzYTA0YjljYTg5ZjAxZDEwN2M2MmFhZjQ2ZDg3NjUx_"
)


@pytest.mark.parametrize("prefix", [GATEWAY_ID, "resp_a+b/c=="], ids=["long", "base64"])
async def test_a_context_under_an_id_of_any_form_is_reserved(
    prefix: str, make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Ids are the provider's to shape (a gateway's are long, base64): one the proxy does not
    look up is a context reserved at the request alone, and not even counted as unknown."""
    proxy = await chained_proxy(make_proxy)
    await first(proxy, fake={"usage": {"input_tokens": FIRST_INPUT}, "id_prefix": prefix})
    with pytest.raises(openai.RateLimitError):
        await client(proxy).responses.create(
            model="gpt-4o-mini", input="hi", previous_response_id=prefix + "1", max_output_tokens=16
        )
    assert len(fake.bill) == 1


async def test_a_quick_estimate_keeps_the_context_through_its_count_and_a_settle_without_usage(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Much new text continuing a context: reserved at its bytes and the context, lowered to its
    count and the context (not to the count alone), and billed, with no usage from the provider,
    at its count and the context (what the provider bills)."""
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": QuarterEncoding()}))
    await first(proxy)
    call = asyncio.ensure_future(
        client(proxy).responses.with_raw_response.create(
            model="gpt-4o-mini",
            input=TEXT,
            previous_response_id="resp_1",
            max_output_tokens=16,
            extra_body={"fake": {"no_usage": True, "hold": True}},
        )
    )
    # Answered once lowered to the count (while it runs): an answer after a fixed delay may come
    # first on a loaded machine, and the settle then drops the count.
    await until_quick(proxy, "lowered")
    fake.release()
    reply = await call
    exact = len(TEXT) // 4 + RESPONSES_OVERHEAD
    [entry] = [
        e for e in await ledger_entries(proxy, "chain") if e["request_id"] == reply.headers["x-request-id"]
    ]
    assert int(entry["reserved_input_tokens"]) == exact + FIRST_CONTEXT
    assert reply.headers["x-billing-input-tokens"] == str(exact + FIRST_CONTEXT)
    assert reply.headers["x-billing-usage-source"] != "provider"


async def test_a_stream_billed_at_its_reserve_keeps_its_context_at_the_count_it_bills(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Much new text, its count still queued on the estimate thread when the last event goes, and
    no usage (a reasoning model's output is billed at its reserve): the context is kept at what
    the call bills, the exact count, not at the byte bound, which a later bound never lowers and
    every call continuing it would reserve (and, without usage, pay for) again."""
    queued = threading.Event()

    class Queued(QuarterEncoding):
        def encode_ordinary(self, text: str) -> list[int]:
            if threading.current_thread().name.startswith("estimate"):
                assert queued.wait(10), "the estimate thread was never released"
            return super().encode_ordinary(text)

    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": Queued()}))
    try:
        stream = await client(proxy).responses.create(
            model="gpt-4o-mini",
            input=TEXT,
            max_output_tokens=16,
            reasoning={"effort": "low"},
            stream=True,
            extra_body={"fake": {"no_usage": True}},
        )
        async for _ in stream:
            pass
    finally:
        queued.set()
    [entry] = await ledger_entries(proxy, "chain")
    assert entry["usage_source"] == "reserve"
    assert int(entry["input_tokens"]) == len(TEXT) // 4 + RESPONSES_OVERHEAD  # the exact count
    billed = int(entry["input_tokens"]) + int(entry["output_tokens"])
    assert await redis_client.get(ctx("resp_1")) == f"{billed}~0"
    # A call continuing it without usage is billed at its own count and that size.
    reply = await client(proxy).responses.with_raw_response.create(
        model="gpt-4o-mini",
        input="hi",
        previous_response_id="resp_1",
        extra_body={"fake": {"no_usage": True}},
    )
    assert billed < int(reply.headers["x-billing-input-tokens"]) < billed + 50


async def test_a_stream_cut_after_it_started_keeps_its_answer_at_what_it_billed(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """``response.created`` names the answer: a stream cut after it leaves a response the client
    can continue, billed at its reserve, and kept at that."""
    proxy = await make_proxy()
    with pytest.raises(openai.APIError):
        await first(proxy, stream=True, fake={"mode": "cut", "usage": {"input_tokens": FIRST_INPUT}})
    [entry] = await ledger_entries(proxy, "chain")
    assert entry["usage_source"] == "reserve"
    billed = int(entry["input_tokens"]) + int(entry["output_tokens"])
    assert await redis_client.get(ctx("resp_1")) == f"{billed}~0"  # a bound: its reserve, on nothing


async def test_a_size_that_cannot_be_kept_never_fails_the_call(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """Redis refusing writes (out of memory) while a call ends: the settle is journaled, and the
    size, a hint for a later reserve, is given up; the answer is delivered all the same."""
    proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 1})
    # Both held until Redis refuses writes: an answer after a fixed delay could come before.
    body = {"model": "gpt-4o-mini", "input": "hello", "fake": {"hold": True}}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession() as session:

        async def answered(stream: bool) -> None:
            async with session.post(
                proxy.url + "/v1/responses", json={**body, "stream": stream}, headers=headers
            ) as reply:
                assert reply.status == 200, await reply.text()
                assert b"response.completed" in await reply.read() or not stream

        sent = asyncio.gather(answered(False), answered(True))
        await until_upstream_received(fake, 2)
        await own_client.config_set("maxmemory", "1")  # over its limit: writes get -OOM
        try:
            fake.release()
            await sent
        finally:
            await own_client.config_set("maxmemory", "0")
    assert len(fake.bill) == 2
    assert await own_client.exists("lbp:{team-a}:ctx:resp_1", "lbp:{team-a}:ctx:resp_2") == 0


async def test_a_store_down_before_the_reserve_is_a_503_and_nothing_goes_out(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess
) -> None:
    proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 0.5})
    await first(proxy)
    await asyncio.to_thread(own_redis.stop)
    with pytest.raises(openai.APIStatusError) as refused:
        await client(proxy).responses.create(model="gpt-4o-mini", input="hi", previous_response_id="resp_1")
    assert refused.value.status_code == 503
    assert len(fake.received) == 1


async def test_a_failed_response_leaves_its_conversation_as_it_was(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A response that failed (``status: failed``) added nothing to its conversation: the size
    kept is not replaced by the failed call's own figures (0 here: it failed before its input),
    or the next call on it is reserved at its request alone."""
    proxy = await make_proxy()
    fake.contexts["conv_1"] = 0
    await first(proxy, conversation="conv_1")
    zero = {"mode": "failed", "after_chunks": 0, "usage": {"input_tokens": 0, "output_tokens": 0}}
    reply = await client(proxy).responses.with_raw_response.create(
        model="gpt-4o-mini", input="hi", extra_body={"conversation": "conv_1", "fake": zero}
    )
    assert reply.headers["x-billing-outcome"] == "upstream_error"
    assert int(await redis_client.get(ctx("conv_1")) or 0) == FIRST_CONTEXT
    await first(proxy, stream=True, conversation="conv_1", fake=zero)  # its response.failed event
    assert int(await redis_client.get(ctx("conv_1")) or 0) == FIRST_CONTEXT


async def read_until_completed(reply: aiohttp.ClientResponse) -> None:
    completed = False
    async for line in reply.content:
        completed = completed or line.startswith(b"event: response.completed")
        if completed and line == b"\n":
            return  # the event is whole: the SDK yields it
    raise AssertionError("no response.completed")


async def test_a_stream_settled_after_its_continuation_leaves_the_conversation_at_the_later_size(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """An agent continues a conversation at ``response.completed``; the first stream's upstream
    closes later and its settle writes the conversation's size again: not the older, smaller
    figure over the continuation's, or the next call on it is reserved short by a whole turn."""
    proxy = await make_proxy()
    fake.contexts["conv_1"] = 0
    body = {
        "model": "gpt-4o-mini",
        "input": "hello",
        "stream": True,
        "conversation": "conv_1",
        "fake": {"usage": {"input_tokens": FIRST_INPUT}, "tail_delay_s": 1.0},
    }
    headers = {"Authorization": f"Bearer {KEY_A}"}
    second = FIRST_CONTEXT + 1 + 8  # the first's context, "hi", 8 output tokens
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/responses", json=body, headers=headers) as first_reply,
    ):
        assert first_reply.status == 200, await first_reply.text()
        await read_until_completed(first_reply)
        await proxy.client().responses.create(
            model="gpt-4o-mini", input="hi", extra_body={"conversation": "conv_1"}, max_output_tokens=16
        )
        assert int(await redis_client.get(ctx("conv_1")) or 0) == second
        await first_reply.read()  # the first stream ends: settled
    assert fake.contexts["conv_1"] == second
    assert int(await redis_client.get(ctx("conv_1")) or 0) == second


async def test_a_slow_store_does_not_hold_a_streams_last_event(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess
) -> None:
    """The size written before ``response.completed`` goes out is a hint for a later reserve: a
    store that does not answer (a long script holds it) delays the answer's last event by a
    bounded wait, not by the store's socket timeout; the write lands all the same."""
    proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 5})
    body = {"model": "gpt-4o-mini", "input": "hello", "stream": True, "fake": {"chunk_delay_s": 0.05}}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    # Holds the store 4 s and says when it let go (the store's clock is the machine's).
    busy = (
        "local t0 = redis.call('TIME')[1] while tonumber(redis.call('TIME')[1]) - t0 < 4 do end "
        "return redis.call('TIME')"
    )
    blocker = aioredis.Redis.from_url(own_redis.url)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + "/v1/responses", json=body, headers=headers) as reply,
        ):
            assert reply.status == 200
            hold = asyncio.ensure_future(blocker.eval(busy, 0))
            assert own_redis.port is not None
            await until_redis_busy(own_redis.port)
            await read_until_completed(reply)
            completed_at = time.time()
            await reply.read()
        seconds, micros = await hold
        # An order, not a duration: the answer went out while the store was still held.
        assert completed_at < int(seconds) + int(micros) / 1e6, "response.completed waited for the store"
        assert int(await blocker.get("lbp:{team-a}:ctx:resp_1") or 0) > 0  # kept all the same
    finally:
        await blocker.aclose()


async def test_an_answer_cut_before_its_id_keeps_its_conversation_at_what_it_billed(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """An answer the proxy never saw whole (a body cut mid-JSON; an upstream timeout alike) went
    out: the provider may have made it and added it to the conversation. Its size is kept at what
    the call billed (its reserve: never below what the provider added), not left at the older
    figure the next call on it would be reserved at."""
    proxy = await make_proxy()
    fake.contexts["conv_1"] = 0
    await first(proxy, conversation="conv_1")
    with pytest.raises(openai.APIError):
        await proxy.client().responses.create(
            model="gpt-4o-mini",
            input="hi",
            max_output_tokens=16,
            extra_body={"conversation": "conv_1", "fake": {"mode": "cut"}},
        )
    assert fake.contexts["conv_1"] == FIRST_CONTEXT + 1 + 8  # the provider made it
    assert int((await redis_client.get(ctx("conv_1")) or "0").split("~")[0]) >= fake.contexts["conv_1"]
    # An error answer made none: the conversation is as it was (not the reserve of the call).
    with pytest.raises(openai.APIStatusError):
        await proxy.client().responses.create(
            model="gpt-4o-mini",
            input="hi",
            max_output_tokens=16,
            extra_body={"conversation": "conv_2", "fake": {"mode": "error", "status": 500}},
        )
    assert await redis_client.exists(ctx("conv_2")) == 0


@pytest.mark.parametrize("kind", ["refused", "connect_timeout"])
@pytest.mark.parametrize("stream", [False, True])
async def test_nothing_went_out_keeps_no_conversation(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, kind: str, stream: bool
) -> None:
    with unreachable_port(kind) as port:
        proxy = await make_proxy(upstreams={"openai": unreachable_upstream(port)})
        await redis_client.set("lbp:{team-a}:ctx:conv_1", 77, ex=100)
        with pytest.raises(openai.APIStatusError) as failed:
            await proxy.client(max_retries=0).responses.create(
                model="gpt-4o-mini", input="hi", stream=stream, extra_body={"conversation": "conv_1"}
            )
        assert failed.value.status_code in (502, 504)
    assert await redis_client.get("lbp:{team-a}:ctx:conv_1") == "77"
    assert await redis_client.ttl("lbp:{team-a}:ctx:conv_1") <= 100
    assert await redis_client.keys("lbp:{team-a}:ctx:*") == ["lbp:{team-a}:ctx:conv_1"]


async def test_a_cut_answers_reserve_does_not_stick_to_its_conversation(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A cut call keeps its conversation at its reserve (output at the model's cap), a bound; the
    next real size replaces it, or every later call on the conversation was reserved that much
    too high (a size is never lowered by another of its kind)."""
    proxy = await make_proxy()
    fake.contexts["conv_1"] = 0
    responses = proxy.client().responses
    await responses.create(model="gpt-4o-mini", input="hello", extra_body={"conversation": "conv_1"})
    before = fake.contexts["conv_1"]
    with pytest.raises(openai.APIError):
        await responses.create(
            model="gpt-4o-mini", input="hi", extra_body={"conversation": "conv_1", "fake": {"mode": "cut"}}
        )
    inflated = await redis_client.get(ctx("conv_1"))
    assert inflated is not None and inflated.endswith(f"~{before}")  # a bound, on what it continued
    await responses.create(model="gpt-4o-mini", input="hi", extra_body={"conversation": "conv_1"})
    assert await redis_client.get(ctx("conv_1")) == str(fake.contexts["conv_1"])
    assert fake.contexts["conv_1"] < int(inflated.split("~")[0])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ttl", [3600, 0], ids=["kept", "not-kept"])
async def test_a_tenant_cannot_continue_another_tenants_response_or_conversation(
    stream: bool, ttl: int, make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Every tenant's calls go out with the operator's key: at the provider, all their stored
    responses and conversations are one account's. Tenant B sending tenant A's response id (from
    a log, a shared trace) would have the provider answer from A's whole conversation (and bill B
    for it): A's context must stay A's, as another tenant's run is a 404."""
    proxy = await make_proxy(limits={"prior_context_ttl_s": ttl})
    fake.contexts["conv_1"] = 0
    a = proxy.client()
    mine = await a.responses.create(model="gpt-4o-mini", input="my secret plan")
    await a.responses.create(model="gpt-4o-mini", input="more secrets", extra_body={"conversation": "conv_1"})
    sent = len(fake.received)
    b = proxy.client(KEY_B)
    attempts: list[dict[str, Any]] = [
        {"previous_response_id": mine.id},
        {"extra_body": {"conversation": "conv_1"}},
        {"extra_body": {"conversation": {"id": "conv_1"}}},
    ]
    for extra in attempts:
        with pytest.raises(openai.APIStatusError):
            if stream:
                async for _ in await b.responses.create(
                    model="gpt-4o-mini", input="repeat everything above", stream=True, **extra
                ):
                    pass
            else:
                await b.responses.create(model="gpt-4o-mini", input="repeat everything above", **extra)
    assert len(fake.received) == sent, "another tenant's context went upstream with the operator's key"
    # Its owner continues it as before.
    await a.responses.create(model="gpt-4o-mini", input="go on", previous_response_id=mine.id)
    await a.responses.create(model="gpt-4o-mini", input="go on", extra_body={"conversation": "conv_1"})
    assert len(fake.received) == sent + 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_keyless_upstream_keeps_one_tenants_response_from_another(
    stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """An upstream configured without a key (README: "a server that needs none answers": vLLM
    without --api-key, a gateway that admits the proxy by its address) serves every tenant's
    calls as one account, as the operator's key does: vLLM's Responses API stores each answer
    and answers a later ``previous_response_id`` from it. The guard ran only when the
    operator's key was sent, so tenant B continued tenant A's response or conversation and was
    answered from A's context."""
    fake.api_key = None  # it admits any call, with no key
    proxy = await make_proxy(upstreams={"openai": {"base_url": fake.base_url, "timeout_s": 5}})
    fake.contexts["conv_1"] = 0
    a = proxy.client()
    mine = await a.responses.create(model="gpt-4o-mini", input="my secret plan")
    await a.responses.create(model="gpt-4o-mini", input="more secrets", extra_body={"conversation": "conv_1"})
    await proxy.recorded()
    sent = len(fake.received)
    assert "Authorization" not in fake.received[-1].headers
    b = proxy.client(KEY_B)
    for extra in ({"previous_response_id": mine.id}, {"extra_body": {"conversation": "conv_1"}}):
        with pytest.raises(openai.APIStatusError):
            if stream:
                async for _ in await b.responses.create(
                    model="gpt-4o-mini", input="repeat everything above", stream=True, **extra
                ):
                    pass
            else:
                await b.responses.create(model="gpt-4o-mini", input="repeat everything above", **extra)
    assert len(fake.received) == sent, "another tenant's context went upstream to the shared account"
    await a.responses.create(model="gpt-4o-mini", input="go on", previous_response_id=mine.id)
    assert len(fake.received) == sent + 1
    await a.close()
    await b.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("named", ["previous_response_id", "conversation", "conversation_object"])
async def test_another_tenants_context_is_refused_as_an_unknown_one(
    named: str, stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Tenant B naming tenant A's response or conversation got the proxy's own 404 ("Previous
    response not found.", code not_found) where an id no one has gets the provider's answer
    (OpenAI: a 400 "Previous response with id 'resp_X' not found.", code
    previous_response_not_found): B learnt the id was in use, and an SDK or agent matching
    OpenAI's code for a lost response did not take it for one. Both now read the same, but for
    the id they name; neither reaches the upstream with A's id."""
    proxy = await make_proxy()
    fake.contexts["conv_mine"] = 0
    a = proxy.client()
    mine = await a.responses.create(model="gpt-4o-mini", input="my secret plan")
    await a.responses.create(model="gpt-4o-mini", input="more", extra_body={"conversation": "conv_mine"})

    def naming(context: str) -> dict[str, Any]:
        if named == "previous_response_id":
            return {"previous_response_id": context}
        return {"extra_body": {"conversation": context if named == "conversation" else {"id": context}}}

    async def refusal(b: openai.AsyncOpenAI, context: str) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as refused:
            if stream:
                async for _ in await b.responses.create(
                    model="gpt-4o-mini", input="hi", stream=True, **naming(context)
                ):
                    pass
            else:
                await b.responses.create(model="gpt-4o-mini", input="hi", **naming(context))
        return refused.value

    theirs = mine.id if named == "previous_response_id" else "conv_mine"
    unknown = "resp_424242" if named == "previous_response_id" else "conv_424242"
    async with proxy.client(KEY_B) as b:
        provider = await refusal(b, unknown)  # forwarded: the provider's answer
        await proxy.recorded()
        sent, billed = len(fake.received), await redis_client.xlen("lbp:{team-b}:ledger")
        proxys = await refusal(b, theirs)
    assert len(fake.received) == sent, "another tenant's context went upstream with the operator's key"
    # Refused before anything is reserved, as every refusal of the proxy's: no ledger entry (the
    # unknown id's, forwarded, is an upstream_4xx at 0).
    await proxy.recorded()
    assert await redis_client.xlen("lbp:{team-b}:ledger") == billed == 1
    assert proxys.status_code == provider.status_code
    assert proxys.body == {**provider.body, "message": provider.body["message"].replace(unknown, theirs)}
    if named == "previous_response_id":  # OpenAI's, as the fake answers it
        assert provider.status_code == 400
        assert provider.body == {
            "message": f"Previous response with id '{unknown}' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    await a.close()


async def test_a_conversations_mark_lasts_as_long_as_the_provider_keeps_it(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """OpenAI keeps a conversation, and the items of the answers within it, with no expiry (not
    the 30 days of a response). Their marks were kept 30 days (``CONTEXT_OWNER_TTL_S``): a
    conversation left idle a month, or its first answer's items a month on, were no one's again,
    and another tenant naming them was answered from them with the operator's key (and marked
    them its own, locking their owner out). Now kept for good, also once an item of one is
    named by a call outside it; a response outside a conversation keeps its 30 days."""
    proxy = await make_proxy()
    fake.contexts["conv_1"] = 0
    a = proxy.client()
    answer = await a.responses.create(
        model="gpt-4o-mini", input="my secret", extra_body={"conversation": "conv_1"}
    )
    (item,) = [i.id for i in answer.output]
    await a.responses.create(model="gpt-4o-mini", input=[{"type": "item_reference", "id": item}])
    alone = await a.responses.create(model="gpt-4o-mini", input="outside it")
    await proxy.recorded()
    for kept in ("conv_1", answer.id, item):
        assert await redis_client.get(f"lbp:ctxowner:{kept}") == "team-a"
        assert await redis_client.ttl(f"lbp:ctxowner:{kept}") == -1, kept  # no expiry
    assert await redis_client.ttl(f"lbp:ctxowner:{alone.id}") > 0
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError):
            await b.responses.create(
                model="gpt-4o-mini", input="repeat all", extra_body={"conversation": "conv_1"}
            )
        with pytest.raises(openai.NotFoundError):
            await b.responses.create(model="gpt-4o-mini", input=[{"type": "item_reference", "id": item}])
    assert len(fake.received) == sent, "another tenant's conversation went upstream with the operator's key"
    await a.close()


async def test_a_stored_prompt_is_anyones_to_name(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A stored prompt is the operator's template, not a context a tenant made: a second tenant
    naming the one a first tenant used is served (its size kept per tenant)."""
    proxy = await make_proxy()
    named = {"prompt": {"id": "pmpt_support_agent", "version": "3", "variables": {"customer": "Ada"}}}
    for key in (KEY_A, KEY_B, KEY_A):
        async with proxy.client(key) as client:
            await client.responses.create(model="gpt-4o-mini", extra_body=named)
    assert len(fake.received) == 3


async def test_a_response_whose_settle_was_journaled_stays_its_tenants(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """Redis down as tenant A's Responses call ends: its settle is journaled and replayed once
    Redis is back, but the mark that the answer is A's was tried once, beside the settle, and
    lost. Tenant B then continues A's answer with the operator's key, served from A's context."""
    proxy, _ = await journaling_proxy(make_proxy, own_redis, tmp_path)
    a = proxy.client()
    asked = asyncio.ensure_future(
        a.responses.create(model="gpt-4o-mini", input="my secret plan", extra_body={"fake": {"hold": True}})
    )
    await until_upstream_received(fake, 1)
    await asyncio.to_thread(own_redis.stop)  # graceful: the reservation is in the AOF
    fake.release()  # answered once Redis is down: a stop slower than a fixed delay missed the end
    mine = await asyncio.wait_for(asked, 30)
    await asyncio.to_thread(own_redis.start)
    await wait_for(lambda: _ledger_len(own_client, 1))  # the journal replayed: A's call billed
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.BadRequestError):  # was: answered from A's context
            for _ in range(5):  # the pool's connections from before the restart fail first (a 503)
                try:
                    await b.responses.create(
                        model="gpt-4o-mini", input="repeat all above", previous_response_id=mine.id
                    )
                except openai.InternalServerError:
                    continue
                break
    assert len(fake.received) == sent, "another tenant's context went upstream with the operator's key"
    await a.close()


async def owner_marks_of(redis_client: aioredis.Redis, opening: Awaitable[Any]) -> list[bytes]:
    """The owner.lua calls a stream makes, read to its end and settled (the second ledger entry):
    counted with the slow log at 0 us, where every command is logged."""
    await redis_client.config_set("slowlog-log-slower-than", 0)
    await redis_client.config_set("slowlog-max-len", 10000)
    try:
        await redis_client.slowlog_reset()
        async for _ in await opening:
            pass
        await wait_for(lambda: _ledger_len(redis_client, 2))
        logged = await redis_client.slowlog_get(10000)
    finally:
        await redis_client.config_set("slowlog-log-slower-than", 10000)
    # The scripts' own commands are logged too: only the calls of the script.
    return [
        e["command"][:120]
        for e in logged
        if e["command"].startswith(b"EVAL") and b"lbp:ctxowner:" in e["command"]
    ]


async def test_a_responses_stream_marks_its_answer_as_its_tenants_once(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A stream marks its answer as its tenant's before its last event goes out; the settle
    marked it again (owner.lua once more per id, in every Responses stream's settle): a Redis
    round trip per call for nothing. Counted with the slow log at 0 us (every command logged)."""
    proxy = await make_proxy()
    a = proxy.client()
    await a.responses.create(model="gpt-4o-mini", input="warm up")  # scripts loaded, tenant known
    marks = await owner_marks_of(
        redis_client, a.responses.create(model="gpt-4o-mini", input="hi", stream=True)
    )
    # Once each: the answer and its one output item.
    assert sorted(m.split()[3] for m in marks) == [b"lbp:ctxowner:msg_2", b"lbp:ctxowner:resp_2"], marks
    await a.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_marks_lost_beside_a_settle_that_landed_are_journaled_and_made(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """The settle lands and the command marking the answer as its tenant's fails alone (on a
    Cluster, the master of a mark is not always the tenant's): the answer was left unmarked for
    good, open to another tenant's call continuing it. The marks are journaled on their own and
    made once the store takes them; the call is billed once."""
    proxy = await make_proxy(limits={"journal_replay_s": 0.1})
    failing = True
    claim = RedisStore.claim_contexts

    async def flaky(self: RedisStore, **kwargs: Any) -> Any:
        if failing:
            raise StoreError("CLUSTERDOWN The cluster is down")
        return await claim(self, **kwargs)

    monkeypatch.setattr(RedisStore, "claim_contexts", flaky)
    a = proxy.client()
    if stream:
        async with await a.responses.create(model="gpt-4o-mini", input="hi", stream=True) as events:
            (answer_id,) = [e.response.id async for e in events if e.type == "response.completed"]
    else:
        answer_id = (await a.responses.create(model="gpt-4o-mini", input="hi")).id
    await proxy.recorded()
    journal = proxy.app[STATE].journal
    lines = [json.loads(line) for line in journal.path.read_text().splitlines()]
    assert [(line["marks_only"], line["tenant"]) for line in lines] == [(True, "team-a")]
    assert any(answer_id in mark for mark in lines[0]["owned_contexts"]), lines
    failing = False

    async def replayed() -> bool:
        return journal.path.read_text() == ""

    await wait_for(replayed)
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.APIStatusError) as refused:
            await b.responses.create(
                model="gpt-4o-mini", input="repeat all above", previous_response_id=answer_id
            )
    assert refused.value.status_code in (400, 404)
    assert len(fake.received) == sent, "tenant A's answer went upstream for tenant B"
    assert await _ledger_len(redis_client, 1)  # A's call, once
    await a.close()


async def test_a_response_a_tenant_continued_is_its_tenants(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """README: stored responses another tenant *made or continued* are a 404. A continues a
    response no one marked (made with the provider directly, or before the upgrade): only the
    conversation and the new answer are marked, the response continued stays anyone's."""
    proxy = await make_proxy()
    fake.contexts["resp_legacy"] = 0
    a = proxy.client()
    await a.responses.create(model="gpt-4o-mini", input="go on", previous_response_id="resp_legacy")
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.BadRequestError):
            await b.responses.create(
                model="gpt-4o-mini", input="repeat all above", previous_response_id="resp_legacy"
            )
    assert len(fake.received) == sent, "a response tenant A continued went upstream for tenant B"
    await a.responses.create(model="gpt-4o-mini", input="again", previous_response_id="resp_legacy")
    await a.close()


async def test_a_call_continuing_its_tenants_own_response_marks_only_its_answer(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A chain of calls (each continuing the last answer, the common use of previous_response_id):
    the reserve has just read that the response continued is this tenant's, yet every call
    marks it again (owner.lua once more, before a stream's last event goes out): a Redis round
    trip per continuing call for nothing, which the stream's answer waits for. Counted with the
    slow log at 0 us (every command logged), as test_a_responses_stream_marks_its_answer_..."""
    proxy = await make_proxy()
    a = proxy.client()
    first = await a.responses.create(model="gpt-4o-mini", input="warm up")  # marked A's
    marks = await owner_marks_of(
        redis_client,
        a.responses.create(model="gpt-4o-mini", input="go on", previous_response_id=first.id, stream=True),
    )
    # Its answer and the answer's item only, not the response it continued.
    assert sorted(m.split()[3] for m in marks) == [b"lbp:ctxowner:msg_2", b"lbp:ctxowner:resp_2"], marks
    assert await redis_client.get(f"lbp:ctxowner:{first.id}") == "team-a"
    await a.close()


async def answer_items(client: openai.AsyncOpenAI, *, stream: bool, **extra: Any) -> list[str]:
    """The ids of the output items of one stored answer, streamed or not."""
    if not stream:
        answer = await client.responses.create(model="gpt-4o-mini", **extra)
        return [item.id for item in answer.output if item.id]
    ids: list[str] = []
    async for event in await client.responses.create(model="gpt-4o-mini", stream=True, **extra):
        if event.type == "response.completed":
            ids = [item.id for item in event.response.output if item.id]
    return ids


def assert_not_found(refused: openai.APIStatusError, message: str, param: str) -> None:
    """Refused as OpenAI refuses an id it does not know."""
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert refused.body == body, refused.body


def naming(item_id: str, form: str) -> list[Any]:
    """An input naming a stored item by id, in each form the provider looks one up."""
    shapes = {
        "item_reference": {"type": "item_reference", "id": item_id},
        "untyped": {"id": item_id},  # the SDK's ItemReference: its type may be left out
        "reasoning": {"type": "reasoning", "id": item_id, "summary": []},  # no encrypted_content
    }
    return [shapes[form], {"role": "user", "content": "repeat everything above"}]


@pytest.mark.parametrize("form", ["item_reference", "untyped", "reasoning"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_cannot_name_another_tenants_stored_item(
    stream: bool, form: str, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The items of a stored answer (its messages, calls, reasoning) are the provider's to look up
    by id for any call with the operator's key: tenant B naming one of tenant A's (from a log, a
    shared trace) had the provider read A's text into B's answer, as continuing A's response
    would. Refused as the provider refuses an id it does not know, before anything is reserved
    or forwarded; A names its own as before."""
    proxy = await make_proxy()
    a = proxy.client()
    (mine,) = await answer_items(a, stream=stream, input="my secret plan")
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError) as refused:
            await b.responses.create(model="gpt-4o-mini", input=naming(mine, form))
    assert len(fake.received) == sent, "another tenant's item went upstream with the operator's key"
    assert_not_found(refused.value, f"Item with id '{mine}' not found.", "input")
    await a.responses.create(model="gpt-4o-mini", input=naming(mine, form))
    assert len(fake.received) == sent + 1
    await a.close()


# An answer of the image generation tool: the image, kept with the answer, and a message.
IMAGE_ANSWER: dict[str, Any] = {
    "id": "resp_img1",
    "object": "response",
    "created_at": 1,
    "status": "completed",
    "model": "gpt-4o-mini",
    "output": [
        {
            "type": "image_generation_call",
            "id": "ig_secret1",
            "status": "completed",
            "result": "iVBORw0KGgo=",
        },
        {
            "type": "message",
            "id": "msg_img1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "here", "annotations": []}],
        },
    ],
    "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
}


@pytest.mark.parametrize(
    "named",
    [
        {"type": "image_generation_call", "id": "ig_secret1"},
        {"type": "image_generation_call", "id": "ig_secret1", "status": "completed", "result": None},
        {"type": "message", "id": "msg_img1"},  # any item of its id alone, typed
    ],
    ids=["image", "image-no-result", "typed-id-alone"],
)
async def test_a_tenant_cannot_name_another_tenants_generated_image_by_id(
    named: dict[str, Any], make_proxy: ProxyFactory, script: Any, redis_client: aioredis.Redis
) -> None:
    """OpenAI's image generation tool takes an earlier image back by its id alone (multi-turn
    editing: ``{"type": "image_generation_call", "id": "ig_..."}`` in the input), read from the
    stored answer as a reasoning item without its content is. Only item references, items of an
    id alone untyped and such reasoning items were checked: tenant B naming tenant A's image
    so went upstream with the operator's key, and the provider read A's image into B's call. An
    item that names a stored one for the provider to look up (an image without its result, a
    typed item of its id alone) is refused as an item reference to A's item is."""
    from tests.test_bad_input import Plan

    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}}
    )
    script.plan = Plan(chunks=[json.dumps(IMAGE_ANSWER).encode()])
    async with proxy.client() as a:
        await a.responses.create(
            model="gpt-4o-mini", input="draw my secret", tools=[{"type": "image_generation"}]
        )
    assert await redis_client.get(f"lbp:ctxowner:{named['id']}") == "team-a"
    sent = len(script.received)
    asked = [named, {"role": "user", "content": "describe this image in detail"}]
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError) as refused:
            await b.responses.create(model="gpt-4o-mini", input=asked, tools=[{"type": "image_generation"}])
    assert len(script.received) == sent, "another tenant's stored image went upstream with the operator's key"
    assert_not_found(refused.value, f"Item with id '{named['id']}' not found.", "input")
    async with proxy.client() as a:  # its owner names it as before
        await a.responses.create(model="gpt-4o-mini", input=asked, tools=[{"type": "image_generation"}])
    assert len(script.received) == sent + 1


async def test_an_item_a_tenant_named_first_is_its_tenants(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """An item no tenant marked (made with the provider directly, or before the upgrade) passes,
    and becomes the tenant's that named it, as a response it continues does."""
    proxy = await make_proxy()
    fake.items["msg_legacy"] = 5
    a = proxy.client()
    await a.responses.create(model="gpt-4o-mini", input=naming("msg_legacy", "item_reference"))
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError):
            await b.responses.create(model="gpt-4o-mini", input=naming("msg_legacy", "item_reference"))
    assert len(fake.received) == sent
    await a.close()


async def test_the_items_of_an_answer_not_stored_are_no_ones(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """``store: false``: the provider keeps nothing to look up, and the proxy marks nothing."""
    proxy = await make_proxy()
    async with proxy.client() as a:
        (item,) = await answer_items(a, stream=False, input="hello", store=False)
    fake.items[item] = 1  # as if kept all the same: whose it is was never written
    async with proxy.client(KEY_B) as b:
        await b.responses.create(model="gpt-4o-mini", input=naming(item, "item_reference"))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_naming_a_stored_item_reserves_what_its_answer_wrote(
    stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The provider reads a named item into the input and bills it: reserved at "hi", a call
    naming an item of 600 tokens fitted a run ceiling of 500 input tokens and was billed past it.
    Each item is kept at its answer's output (a bound of what it holds) and reserved so."""
    proxy = await make_proxy(tiers={"standard": {"run": {"input_tokens": 500}}})
    (item,) = await answer_items(
        client(proxy),
        stream=stream,
        input="hello",
        max_output_tokens=800,
        extra_body={"fake": {"reply_tokens": 600}},
    )
    assert int(await redis_client.get(ctx(item)) or 0) == 600
    used = await used_input(redis_client)
    with pytest.raises(openai.RateLimitError) as refused:
        await client(proxy).responses.create(
            model="gpt-4o-mini", input=naming(item, "item_reference"), max_output_tokens=16
        )
    assert "input_tokens" in str(refused.value)
    assert len(fake.bill) == 1 and await used_input(redis_client) == used


async def test_what_fits_is_reserved_with_the_items_it_names(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy()
    a = proxy.client()
    (one,) = await answer_items(a, stream=False, input="hello", extra_body={"fake": {"reply_tokens": 40}})
    (two,) = await answer_items(a, stream=True, input="hello", extra_body={"fake": {"reply_tokens": 60}})
    reply = await a.responses.with_raw_response.create(
        model="gpt-4o-mini", input=[{"id": one}, {"type": "item_reference", "id": two}], max_output_tokens=16
    )
    entries = [dict(fields) for _, fields in await redis_client.xrange(LEDGER)]
    third = next(e for e in entries if e["request_id"] == reply.headers["x-request-id"])
    assert int(third["reserved_input_tokens"]) >= 100
    assert fake.bill[2].prompt_tokens == 100 == int(reply.headers["x-billing-input-tokens"])


async def test_a_call_naming_many_items_does_not_drain_the_stores_connections(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_server: RedisServerProcess
) -> None:
    """The owners of the ids a call names are read in a bounded number of commands: one GET
    each, all at once, took a connection of the pool each, and a body naming some thousands of
    items (well under the body limit) had its check, and another tenant's read waiting for the
    pool meanwhile, fail as the store failing (503)."""
    proxy = await make_proxy(redis={"url": redis_server.url, "pool_size": 2, "socket_timeout_s": 1.0})
    a = proxy.client()
    first = await a.responses.create(model="gpt-4o-mini", input="hello")
    body = {"model": "gpt-4o-mini", "input": [{"id": f"msg_x{i}"} for i in range(20_000)]}

    async def naming_many() -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {KEY_B}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + "/v1/responses", json=body, headers=headers) as resp,
        ):
            return resp.status, await resp.text()

    named, continued = await asyncio.gather(
        naming_many(),
        a.responses.create(model="gpt-4o-mini", input="go on", previous_response_id=first.id),
        return_exceptions=True,
    )
    # No tenant marked them: they pass, for the provider to refuse (it knows none of them).
    assert not isinstance(named, BaseException), repr(named)
    assert named[0] == 404 and "Item with id 'msg_x0' not found." in named[1], named
    assert not isinstance(continued, BaseException), repr(continued)
    await a.close()


async def audio_answer(client: openai.AsyncOpenAI, *, stream: bool) -> str:
    """The id of a chat audio answer, streamed or not (the provider keeps it for later turns)."""
    asked: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "messages": [{"role": "user", "content": "my secret plan"}],
    }
    if not stream:
        reply = await client.chat.completions.create(**asked)
        assert reply.choices[0].message.audio is not None
        return reply.choices[0].message.audio.id
    ids = set()
    async for chunk in await client.chat.completions.create(stream=True, **asked):
        for choice in chunk.choices:
            audio = choice.delta.audio
            if audio is not None and audio.id:
                ids.add(audio.id)
    (found,) = ids
    return str(found)


def sending_back(audio_id: str) -> list[Any]:
    return [
        {"role": "user", "content": "say it"},
        {"role": "assistant", "audio": {"id": audio_id}},
        {"role": "user", "content": "repeat it"},
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_cannot_send_back_another_tenants_audio_answer(
    stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A chat audio answer is kept by the provider for later turns, sent back by its id: with
    the operator's key any tenant's call could send back any tenant's. Tenant B naming tenant
    A's (from a log, a shared trace) had the provider read A's audio into B's conversation.
    Refused before anything is reserved or forwarded, as another tenant's stored items are."""
    proxy = await make_proxy()
    a = proxy.client()
    mine = await audio_answer(a, stream=stream)
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError) as refused:
            await b.chat.completions.create(model="gpt-4o-mini", messages=sending_back(mine))
    assert len(fake.received) == sent, "another tenant's audio went upstream with the operator's key"
    assert_not_found(refused.value, f"Audio with id '{mine}' not found.", "messages")
    await a.chat.completions.create(model="gpt-4o-mini", messages=sending_back(mine))
    assert len(fake.received) == sent + 1
    await a.close()


CODE_TOOL = {"type": "code_interpreter", "container": {"type": "auto"}}


async def only_its_tenant_runs_in(
    proxy: Proxy, fake: FakeUpstream, container: str, tool: dict[str, Any]
) -> None:
    """Tenant B naming the container in ``tool`` is refused, nothing going upstream; its owner
    (tenant A) runs in it as before."""
    sent = len(fake.received)
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError) as refused:
            await b.responses.create(model="gpt-4o-mini", input="print every file", tools=[tool])  # type: ignore[list-item]
    assert len(fake.received) == sent, "another tenant's container went upstream with the operator's key"
    assert_not_found(refused.value, f"Container with id '{container}' not found.", "tools")
    async with proxy.client() as a:
        await a.responses.create(model="gpt-4o-mini", input="print every file", tools=[tool])  # type: ignore[list-item]
    assert len(fake.received) == sent + 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_cannot_run_in_another_tenants_code_container(
    stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A code interpreter's container keeps the files its code wrote, and a later call runs in
    it by id: with the operator's key tenant B naming tenant A's container (its id is in A's
    answer) had B's code read A's files. Refused before anything is reserved or forwarded."""
    proxy = await make_proxy()
    a = proxy.client()
    asked: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "input": "save my secret to a file",
        "tools": [CODE_TOOL],
    }
    containers: set[str] = set()
    if stream:
        async for event in await a.responses.create(stream=True, **asked):
            if event.type == "response.completed":
                containers = {
                    i.container_id for i in event.response.output if i.type == "code_interpreter_call"
                }
    else:
        answer = await a.responses.create(**asked)
        containers = {i.container_id for i in answer.output if i.type == "code_interpreter_call"}
    (mine,) = containers
    await only_its_tenant_runs_in(proxy, fake, mine, {"type": "code_interpreter", "container": mine})
    await a.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_cannot_run_in_another_tenants_anthropic_container(
    stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The same for Anthropic's code execution: its container (told in the answer, or in a
    stream's message_delta) is the tenant's that ran code in it; another tenant naming it in
    ``container`` gets Anthropic's 404, and nothing goes upstream."""
    proxy = await both_with(make_proxy, fake, timeout_s=2)
    asked: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "save my secret to a file"}],
        "tools": [{"type": "code_execution_20250825", "name": "code_execution"}],
    }
    a = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    if stream:
        async with a.messages.stream(**asked) as events:
            answer = await events.get_final_message()
    else:
        answer = await a.messages.create(**asked)
    assert answer.container is not None
    mine = answer.container.id
    sent = len(fake.received)
    again = {**asked, "container": mine, "messages": [{"role": "user", "content": "print every file"}]}
    b = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_B, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as refused:
        await b.messages.create(**again)
    assert len(fake.received) == sent, "another tenant's container went upstream with the operator's key"
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": f"Container with id '{mine}' not found."},
    }, refused.value.body
    await a.messages.create(**again)
    assert len(fake.received) == sent + 1


CODE_FILE = "file_011CodeExecSecretOfTeamA"
CODE_TOOLS = [{"type": "code_execution_20250825", "name": "code_execution"}]


def code_answer(stream: bool) -> Plan:
    """A Messages answer whose code wrote a file, told by its Files API id (a
    ``bash_code_execution_output``), in container ``container_a``; whole or streamed (a server
    tool's result comes whole in its ``content_block_start``, the container with the stop)."""
    blocks: list[dict[str, Any]] = [
        {
            "type": "server_tool_use",
            "id": "srvtoolu_1",
            "name": "bash_code_execution",
            "input": {"command": "echo secret > /tmp/outputs/a.txt"},
        },
        {
            "type": "bash_code_execution_tool_result",
            "tool_use_id": "srvtoolu_1",
            "content": {
                "type": "bash_code_execution_result",
                "stdout": "",
                "stderr": "",
                "return_code": 0,
                "content": [{"type": "bash_code_execution_output", "file_id": CODE_FILE}],
            },
        },
    ]
    container = {"id": "container_a", "expires_at": "2099-01-01T00:00:00Z"}
    whole = sdk_message([*blocks, {"type": "text", "text": "saved"}], container=container)
    if not stream:
        return Plan(chunks=[dumps(whole)])
    start = {**whole, "content": [], "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 1}}
    del start["container"]
    chunks = [ev("message_start", {"message": start})]
    for k, block in enumerate(blocks):
        chunks.append(ev("content_block_start", {"index": k, "content_block": block}))
        chunks.append(ev("content_block_stop", {"index": k}))
    chunks += [
        ev("content_block_start", {"index": 2, "content_block": {"type": "text", "text": ""}}),
        ev("content_block_delta", {"index": 2, "delta": {"type": "text_delta", "text": "saved"}}),
        ev("content_block_stop", {"index": 2}),
        ev(
            "message_delta",
            {
                "delta": {"stop_reason": "end_turn", "stop_sequence": None, "container": container},
                "usage": {"output_tokens": 5},
            },
        ),
        ev("message_stop", {}),
    ]
    return Plan(content_type="text/event-stream", chunks=chunks)


async def messages_call(proxy: Proxy, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    """A Messages call's status and its body (a stream's read whole, as text)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/messages",
            json={"model": "claude-sonnet-4-5", "max_tokens": 50, "tools": CODE_TOOLS, **body},
            headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        ) as resp,
    ):
        if resp.content_type == "text/event-stream":
            return resp.status, await resp.text()
        return resp.status, await resp.json()


def naming_file(file_id: str, how: str) -> dict[str, Any]:
    """A user message putting ``file_id`` in its container, or reading it as a document."""
    if how == "container_upload":
        block: dict[str, Any] = {"type": "container_upload", "file_id": file_id}
    else:
        block = {"type": "document", "source": {"type": "file", "file_id": file_id}}
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "print the file"}, block]}]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["container_upload", "document"])
async def test_a_tenant_cannot_read_the_files_another_tenants_code_execution_wrote(
    how: str, stream: bool, make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """Anthropic's code execution tells each file its code wrote by a Files API id
    (``bash_code_execution_output.file_id``), kept in the workspace of the operator's key until
    deleted; a later call names it in a ``container_upload`` (put in its container) or a
    ``document`` whose source is ``{"type": "file"}``. A's container was refused to tenant B,
    but B naming A's file went upstream with the operator's key: B's code read A's file. It is
    now refused as the Files API answers a file it does not hold, nothing forwarded; its owner
    names it as before, and a file no call here wrote (the operator's upload) is anyone's."""
    proxy = await claude_proxy(make_proxy, queue)
    queue.plans = [code_answer(stream)]
    status, answer = await messages_call(
        proxy,
        KEY_A,
        {"messages": [{"role": "user", "content": "save my secret to a file"}], "stream": stream},
    )
    assert status == 200, answer
    assert CODE_FILE in str(answer)
    await proxy.recorded()
    # The mark lasts as long as the Files API keeps the file: until it is deleted.
    assert await redis_client.get(f"lbp:ctxowner:{CODE_FILE}") == "team-a"
    assert await redis_client.ttl(f"lbp:ctxowner:{CODE_FILE}") == -1
    queue.plans = [answer_of("msg_02", stream=False)]
    status, refused = await messages_call(proxy, KEY_B, {"container": "container_a", **naming_file("x", how)})
    assert status == 404, refused  # the container itself, as before ...
    sent = len(queue.received)
    status, refused = await messages_call(proxy, KEY_B, naming_file(CODE_FILE, how))
    assert len(queue.received) == sent, "another tenant's code execution file went upstream"
    assert (status, refused) == (
        404,
        {"type": "error", "error": {"type": "not_found_error", "message": f"File not found: {CODE_FILE}"}},
    )
    status, _ = await messages_call(proxy, KEY_A, naming_file(CODE_FILE, how))
    assert status == 200 and len(queue.received) == sent + 1
    # A file no call here wrote: uploaded by the operator, named by any tenant, first or not.
    for key in (KEY_B, KEY_A, KEY_B):
        status, _ = await messages_call(proxy, key, naming_file("file_011OperatorsOwn", how))
        assert status == 200
        await proxy.recorded()
    assert len(queue.received) == sent + 4
    assert await redis_client.get("lbp:ctxowner:file_011OperatorsOwn") is None


async def containers_of(client: openai.AsyncOpenAI, **asked: Any) -> set[str]:
    """The containers a Responses stream's items told, as they came (the SDK's events)."""
    found: set[str] = set()
    async for event in await client.responses.create(model="gpt-4o-mini", stream=True, **asked):
        if event.type in ("response.output_item.added", "response.output_item.done"):
            item = event.item.model_dump()
            env = item.get("environment") or {}
            for ref in (item.get("container_id"), env.get("container_id")):
                if ref:
                    found.add(ref)
    return found


async def test_a_container_a_failed_response_ran_code_in_stays_its_tenants(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The code ran (its container, with the files it wrote, told in a code_interpreter_call
    item) and then the response failed: the container is kept all the same, and its id reached
    the client. Not marked, tenant B naming it ran in A's files (and claimed it: A's own later
    call in it was then refused)."""
    proxy = await make_proxy()
    a = proxy.client()
    (mine,) = await containers_of(
        a, input="save my secret to a file", tools=[CODE_TOOL], extra_body={"fake": {"mode": "failed"}}
    )
    assert mine in fake.containers
    await proxy.recorded()
    await only_its_tenant_runs_in(proxy, fake, mine, {"type": "code_interpreter", "container": mine})
    await a.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_cannot_run_in_another_tenants_shell_container(
    stream: bool, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A hosted shell tool (``environment: container_auto``) runs in a container OpenAI makes,
    told in the shell_call item's ``environment`` (a ``container_reference``), not in a
    ``container_id`` of the item: never marked, tenant B naming it in its shell tool's
    ``container_reference`` ran in A's files, though the request side of it is checked."""
    proxy = await make_proxy()
    a = proxy.client()
    asked: dict[str, Any] = {
        "input": "save my secret to a file",
        "tools": [{"type": "shell", "environment": {"type": "container_auto"}}],
    }
    if stream:
        (mine,) = await containers_of(a, **asked)
    else:
        answer = await a.responses.create(model="gpt-4o-mini", **asked)
        (mine,) = {i.environment.container_id for i in answer.output if i.type == "shell_call"}
    await proxy.recorded()
    tool = {"type": "shell", "environment": {"type": "container_reference", "container_id": mine}}
    await only_its_tenant_runs_in(proxy, fake, mine, tool)
    await a.close()


async def test_a_call_item_sent_back_cannot_name_another_tenants_container(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A code interpreter's call sent back as input names its container, which the tool may take
    up again: tenant B sending back a made-up call naming tenant A's container is refused as
    naming it in its tool is; A sending back its own answer's items (the usual agent loop) is
    not."""
    proxy = await make_proxy()
    async with proxy.client() as a:
        answer = await a.responses.create(model="gpt-4o-mini", input="save my secret", tools=[CODE_TOOL])  # type: ignore[list-item]
        (mine,) = {i.container_id for i in answer.output if i.type == "code_interpreter_call"}
        sent_back = [item.model_dump(exclude_none=True) for item in answer.output]
        await a.responses.create(
            model="gpt-4o-mini",
            input=[*sent_back, {"role": "user", "content": "go on"}],
            tools=[CODE_TOOL],  # type: ignore[list-item]
        )
    sent = len(fake.received)
    call = {
        "type": "code_interpreter_call",
        "id": "ci_x",
        "status": "completed",
        "code": "ls",
        "container_id": mine,
    }
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError) as refused:
            await b.responses.create(
                model="gpt-4o-mini",
                input=[call, {"role": "user", "content": "cat every file"}],
                tools=[CODE_TOOL],  # type: ignore[list-item]
            )
    assert len(fake.received) == sent
    assert_not_found(refused.value, f"Container with id '{mine}' not found.", "input")


_PROMPT = {"prompt": {"id": "pmpt_support_agent", "version": "3", "variables": {"customer": "Ada"}}}


async def _responses_entry(proxy: Any, run: str, body: dict[str, Any]) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
    payload = {"model": "gpt-4o-mini", "max_output_tokens": 16, **body}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/responses", json=payload, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    await proxy.recorded()
    (entry,) = await ledger_entries(proxy, run)
    return entry


async def test_a_stored_prompt_on_a_conversation_reserves_the_template_and_the_conversation(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A stored prompt's template is input the provider adds to every call, a conversation's
    context is input again: a call naming both is billed both, and was reserved at the larger
    of the two kept sizes alone (the prior context hunt)."""
    proxy = await make_proxy()
    # A fresh call naming the prompt: its 3,000-token template billed, kept as the prompt's size.
    fresh = {**_PROMPT, "input": "hi", "fake": {"usage": {"input_tokens": 3000}}}
    await _responses_entry(proxy, "tpl", fresh)
    # A conversation of 5,000 tokens billed here.
    fake.contexts["conv_1"] = 0
    body = {"conversation": "conv_1", "input": "hello", "fake": {"usage": {"input_tokens": 5000}}}
    await _responses_entry(proxy, "conv", body)
    kept = int(await redis_client.get("lbp:{team-a}:ctx:conv_1") or 0)
    assert kept >= 5000
    # The next turn names both: the provider bills the conversation, the template and "hi"
    # (the fake knows no stored prompts: its bill says what OpenAI's does).
    billed = kept + 3000 + 1
    both = {**_PROMPT, "conversation": "conv_1", "input": "hi", "fake": {"usage": {"input_tokens": billed}}}
    entry = await _responses_entry(proxy, "both", both)
    assert int(entry["input_tokens"]) == billed
    assert int(entry["reserved_input_tokens"]) >= billed, entry


# -- Anthropic's message threads and cache diagnostics ---------------------------------------------

queue = test_sdk_anthropic.queue  # the fixture: an upstream answering what each test queues
THREAD_INPUT = 1500  # the thread's first call: input the provider then holds, with its output


def answer_of(msg_id: str, stream: bool, usage: dict[str, int] | None = None) -> Plan:
    """A Messages answer of id ``msg_id``, whole or streamed (its id told in message_start)."""
    usage = usage or {"input_tokens": 10, "output_tokens": 5}
    whole = sdk_message([{"type": "text", "text": "noted"}], usage=usage)
    whole["id"] = msg_id
    if not stream:
        return Plan(chunks=[dumps(whole)])
    start = {**whole, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    return Plan(
        content_type="text/event-stream",
        chunks=[
            ev("message_start", {"message": start}),
            ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "noted"}}),
            ev("content_block_stop", {"index": 0}),
            ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": usage["output_tokens"]}}),
            ev("message_stop", {}),
        ],
    )  # fmt: skip


async def asked(c: anthropic.AsyncAnthropic, stream: bool, **kw: Any) -> str:
    """The id of the answer to a Messages call (the beta's, which takes ``thread``)."""
    body: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 100, **kw}
    body.setdefault("messages", [{"role": "user", "content": "my secret plan"}])
    if stream:
        async with c.beta.messages.stream(**body) as events:
            return (await events.get_final_message()).id
    return (await c.beta.messages.create(**body)).id


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_cannot_continue_another_tenants_anthropic_thread(
    stream: bool, make_proxy: ProxyFactory, queue: Queue
) -> None:
    """Anthropic's message threads (``thread: {"type": "continue", "previous_message_id": ...}``):
    the provider answers from the whole conversation it holds under that id. With the operator's
    key every tenant's threads are one account's: tenant B naming tenant A's message id (from a
    log, a shared trace) had the model answer from A's conversation. Refused as the provider
    refuses a thread it does not hold (a 404 ``thread_not_found``), nothing forwarded; its owner
    continues it, and an id no tenant used here goes upstream as before."""
    proxy = await claude_proxy(make_proxy, queue)
    queue.plans = [answer_of("msg_01Secret", stream)]
    a = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    b = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_B, max_retries=0)
    mine = await asked(a, stream, thread={"type": "create"})
    assert mine == "msg_01Secret"
    sent = len(queue.received)
    continuing: dict[str, Any] = {
        "messages": [{"role": "user", "content": "repeat it all"}],
        "thread": {"type": "continue", "previous_message_id": mine},
    }
    with pytest.raises(anthropic.NotFoundError) as refused:
        await asked(b, stream, **continuing)
    assert len(queue.received) == sent, "another tenant's thread went upstream with the operator's key"
    assert refused.value.error_code == "thread_not_found", refused.value.body
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": f"No usable Thread state was found for previous_message_id '{mine}'.",
            "details": {"error_code": "thread_not_found"},
        },
    }, refused.value.body
    queue.plans = [answer_of("msg_02Next", stream)]
    assert await asked(a, stream, **continuing) == "msg_02Next"
    assert len(queue.received) == sent + 1
    # The continuation's answer is the thread's now (continued next): A's as well.
    later = {**continuing, "thread": {"type": "continue", "previous_message_id": "msg_02Next"}}
    with pytest.raises(anthropic.NotFoundError):
        await asked(b, stream, **later)
    unknown = {**continuing, "thread": {"type": "continue", "previous_message_id": "msg_0Else"}}
    await asked(b, stream, **unknown)
    assert len(queue.received) == sent + 2, "an id no tenant used here is the provider's to answer"
    await a.close()
    await b.close()


async def test_another_tenants_message_id_is_not_sent_for_cache_diagnostics(
    make_proxy: ProxyFactory, queue: Queue
) -> None:
    """Cache diagnostics (``diagnostics: {"previous_message_id": ...}``): the provider compares the
    request's prompt with the one of the message named, kept (a fingerprint of it) for each call
    that asked for diagnostics, and says why the cache missed (the model, the system prompt, the
    tools or the messages changed) and about how many tokens. With the operator's key tenant B
    naming tenant A's message got an oracle on A's prompt. Refused (a 404, nothing forwarded);
    A names its own as before."""
    proxy = await claude_proxy(make_proxy, queue)
    queue.plans = [answer_of("msg_01OfTenantA", False)]
    a = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    b = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_B, max_retries=0)
    first: dict[str, Any] = {
        "system": "A's confidential system prompt",
        "diagnostics": {"previous_message_id": None},
    }
    mine = await asked(a, False, **first)
    sent = len(queue.received)
    guess: dict[str, Any] = {
        "system": "a guess at A's system prompt",
        "diagnostics": {"previous_message_id": mine},
    }
    with pytest.raises(anthropic.NotFoundError) as refused:
        await asked(b, False, **guess)
    assert len(queue.received) == sent, "tenant A's message id went upstream for tenant B"
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": f"Message with id '{mine}' not found."},
    }, refused.value.body
    await asked(a, False, **guess)
    assert len(queue.received) == sent + 1


@pytest.mark.parametrize("stream", [False, True])
async def test_another_tenants_response_id_is_not_sent_for_prompt_cache_diagnostics(
    stream: bool, proxy: Proxy, fake: FakeUpstream
) -> None:
    """Prompt cache diagnostics (``prompt_cache_options.comparison_response_id``): the provider
    compares the request's prompt with the one of the response named and tells why the cache
    missed (the input, the instructions, the tools changed) with the tokens after the first
    divergence and the compared response's reusable prefix. With the operator's key tenant B
    naming tenant A's response got an oracle on A's prompt, as with Anthropic's
    ``diagnostics.previous_message_id``. Refused (a 404, nothing forwarded); A names its own as
    before, and an id no tenant used here passes."""
    async with proxy.client() as a, proxy.client(KEY_B) as b:
        mine = await a.responses.create(
            model="gpt-4o-mini", instructions="A's confidential system prompt", input="my secret plan"
        )
        await proxy.recorded()
        sent = len(fake.received)

        async def compared(client: openai.AsyncOpenAI, response_id: str) -> None:
            options: Any = {"comparison_response_id": response_id}
            if stream:
                async for _ in await client.responses.create(
                    model="gpt-4o-mini", input="hi", prompt_cache_options=options, stream=True
                ):
                    pass
            else:
                await client.responses.create(model="gpt-4o-mini", input="hi", prompt_cache_options=options)

        with pytest.raises(openai.NotFoundError) as refused:
            await compared(b, mine.id)
        assert len(fake.received) == sent, "tenant A's response id went upstream for tenant B"
        param = "prompt_cache_options.comparison_response_id"
        assert_not_found(refused.value, f"Response with id '{mine.id}' not found.", param)
        await compared(a, mine.id)
        await compared(b, "resp_0Elsewhere")
    assert len(fake.received) == sent + 2


async def test_a_message_the_provider_keeps_nothing_of_is_not_marked(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """A Messages call without a thread or diagnostics (nearly every one): the provider keeps
    nothing under its answer's id, so nothing is marked (no Redis write, no memory for 30 days).
    The cache diagnostics beta's header alone has the provider keep a fingerprint: marked."""
    proxy = await claude_proxy(make_proxy, queue)
    queue.plans = [answer_of("msg_01Plain", False)]
    a = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    await asked(a, False)
    assert await redis_client.get("lbp:ctxowner:msg_01Plain") is None
    queue.plans = [answer_of("msg_01Beta", False)]
    await asked(a, False, betas=["cache-diagnosis-2026-04-07"])
    assert await redis_client.get("lbp:ctxowner:msg_01Beta") is not None
    await a.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_continuing_an_anthropic_thread_reserves_its_context(
    stream: bool, make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """A thread's continuation is billed by the provider for the whole conversation it holds (the
    earlier turns, read again as input), as a Responses ``previous_response_id`` is: reserved at
    the size the proxy billed the call that made it, so a run's ceiling refuses a continuation
    that would pass it (reserved at its new turn's few words, it went out and passed it)."""
    proxy = await claude_proxy(make_proxy, queue, tiers={"standard": {"run": {"input_tokens": 2000}}})
    # The continuation, should it go out: the provider reads the 1,600 tokens it holds.
    queue.plans = [
        answer_of("msg_01Held", stream, {"input_tokens": THREAD_INPUT, "output_tokens": 100}),
        answer_of("msg_02", stream, {"input_tokens": 1610, "output_tokens": 5}),
    ]
    c = anthropic.AsyncAnthropic(
        base_url=proxy.url, api_key=KEY_A, max_retries=0, default_headers={"X-Run-Id": "thread"}
    )
    await asked(c, stream, messages=[{"role": "user", "content": "hello there"}], thread={"type": "create"})
    assert await redis_client.get("lbp:{team-a}:ctx:msg_01Held") == str(THREAD_INPUT + 100)
    sent = len(queue.received)
    # 1,500 used of 2,000: a continuation that reads the 1,600 held tokens does not fit.
    continuing = {"type": "continue", "previous_message_id": "msg_01Held"}
    with pytest.raises(anthropic.RateLimitError):
        await asked(c, stream, max_tokens=16, messages=[{"role": "user", "content": "hi"}], thread=continuing)
    assert len(queue.received) == sent
    used = [int(f["input_tokens"]) for _i, f in await redis_client.xrange(LEDGER)]
    assert sum(used) <= 2000, f"run billed {used} input tokens past its ceiling of 2000"
    await c.close()


async def test_a_context_that_takes_the_input_past_the_long_context_threshold_is_reserved_at_its_prices(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The request alone within the threshold, the context it continues past it: the provider
    bills the whole input at the long-context prices, which the reserve must hold. Reserved at
    the model's own, a call fitted under a cost ceiling the provider's bill then passed."""
    model = {
        "upstream": "openai",
        "max_output_tokens": 1000,
        "price_per_million": {"input": "1", "output": "10"},
        "long_context": {"above_input_tokens": 500, "price_per_million": {"input": "2", "output": "15"}},
    }
    # The first call: 1,000 input tokens and 8 output at the long-context prices (2,120). The
    # second with its context (1,008 and a few) fits at the model's prices (at most 3,308 in
    # all), not at the long-context ones (at least 4,378).
    proxy = await make_proxy(
        models={"gpt-4o-mini": model}, tiers={"standard": {"run": {"cost_usd": "0.0038"}}}
    )
    await first(proxy, max_output_tokens=8)
    assert int(await redis_client.hget(RUN, "used:cost_micros") or 0) == 2120
    with pytest.raises(openai.RateLimitError) as refused:
        await client(proxy).responses.create(
            model="gpt-4o-mini", input="hi", previous_response_id="resp_1", max_output_tokens=16
        )
    assert "cost" in str(refused.value)
    assert len(fake.bill) == 1


LONG_THREAD_INPUT = 60_000  # the thread's first call, as the provider billed it (its history)
LONG_THREAD_CONTEXT = LONG_THREAD_INPUT + 5  # kept: its input and output
COMPACT_EDITS = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50000}}]}


def _thread_answer(msg_id: str, usage: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": "noted"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
    ).encode()


async def test_a_compacting_call_continuing_a_thread_reserves_the_thread_for_both_reads(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """A Messages call with threshold compaction is reserved at its input twice (its summarizing
    step reads the whole input, then the answer at most as much), and the thread it continues is
    input too: read by both. Reserved once, a run input ceiling the reserve fitted was overspent
    by the summarizing step's read of the thread (the overshoot hunt)."""
    queue = Queue()
    await queue.start()
    try:
        proxy = await claude_proxy(
            make_proxy, queue, tiers={"standard": {"run": {"input_tokens": LONG_THREAD_CONTEXT + 1000}}}
        )

        async def post(run: str, body: dict[str, Any]) -> int:
            headers = {
                "x-api-key": KEY_A, "X-Run-Id": run, "anthropic-version": "2023-06-01",
                "anthropic-beta": "compact-2026-01-12",
            }  # fmt: skip
            async with (
                aiohttp.ClientSession() as session,
                session.post(proxy.url + "/v1/messages", json=body, headers=headers) as resp,
            ):
                await resp.read()
                return resp.status

        told = {"input_tokens": LONG_THREAD_INPUT, "output_tokens": 5}
        queue.plans = [Plan(chunks=[_thread_answer("msg_01", told)])]
        first = {
            "model": "claude-sonnet-4-5", "max_tokens": 100, "thread": {"type": "create"},
            "messages": [{"role": "user", "content": "the long history"}],
        }  # fmt: skip
        assert await post("thread-first", first) == 200
        assert int(await redis_client.get("lbp:{team-a}:ctx:msg_01") or 0) == LONG_THREAD_CONTEXT
        # The summarizing step reads the whole input (thread and "hi"), writes a 3,500-token
        # summary; the answer reads the summary and the last turn (Anthropic's documented shape).
        read = LONG_THREAD_CONTEXT + 15
        usage = {
            "input_tokens": 3600, "output_tokens": 200,
            "iterations": [
                {"type": "compaction", "input_tokens": read, "output_tokens": 3500},
                {"type": "message", "input_tokens": 3600, "output_tokens": 200},
            ],
        }  # fmt: skip
        queue.plans = [Plan(chunks=[_thread_answer("msg_02", usage)])]
        second = {
            "model": "claude-sonnet-4-5", "max_tokens": 4096, "context_management": COMPACT_EDITS,
            "thread": {"type": "continue", "previous_message_id": "msg_01"},
            "messages": [{"role": "user", "content": "hi"}],
        }  # fmt: skip
        status = await post("thread-second", second)
        assert status == 429  # its reserve: the thread twice, past the ceiling
        state = (await meters(proxy, "thread-second"))["meters"]["input_tokens"]
        entries = [dict(f) for _, f in await redis_client.xrange(LEDGER) if f["run_id"] == "thread-second"]
        seen = {k: v for e in entries for k, v in e.items() if "input" in k}
        assert state["used"] <= state["ceiling"], (status, state, seen)
    finally:
        await queue.close()
