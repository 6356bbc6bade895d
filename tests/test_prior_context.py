"""A Responses call that continues a stored context (``previous_response_id``, ``conversation``)
reserves that context's size: the provider bills it as input again, so a call sending "hi" may
cost what the whole conversation does. The official SDK as client; the fake upstream keeps its
contexts and bills them as OpenAI does."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from tests.conftest import Proxy, ProxyFactory, digest
from tests.fake_upstream import FakeUpstream

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
