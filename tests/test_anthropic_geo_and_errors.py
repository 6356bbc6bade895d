"""/v1/messages against Anthropic's wire format and prices: US-only inference priced as a tier of
its own, and the error types the proxy's own errors on this route name."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
import redis.asyncio as aioredis

from tests import test_sdk_anthropic
from tests.conftest import ProxyFactory
from tests.test_bad_input import Plan, dumps
from tests.test_sdk_anthropic import MODEL, MSGS, Queue, client, entries, ev, message

queue = test_sdk_anthropic.queue  # the fixture: an upstream answering what each test queues

STANDARD = {"input": "5", "output": "25"}
# US-only inference (inference_geo "us"): 1.1 times every price on Opus 4.6 and later.
US_ONLY = {"input": "5.5", "output": "27.5"}


async def geo_proxy(
    make_proxy: ProxyFactory, up: Queue, service_tiers: dict[str, Any] | None = None, **kw: Any
) -> Any:
    upstream = {"base_url": up.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    model: dict[str, Any] = {"upstream": "claude", "price_per_million": STANDARD}
    if service_tiers:
        model["service_tiers"] = service_tiers
    return await make_proxy(upstreams={"claude": upstream}, models={"claude-*": model}, **kw)


def us_answer(stream: bool, delta_usage: dict[str, Any] | None = None) -> Plan:
    usage = {"input_tokens": 1000, "output_tokens": 100, "service_tier": "standard", "inference_geo": "us"}
    if not stream:
        return Plan(chunks=[dumps(message([{"type": "text", "text": "Hi."}], usage=usage))])
    start = message([], usage={**usage, "output_tokens": 1})
    start["stop_reason"] = None
    chunks = [
        ev("message_start", {"message": start}),
        ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hi."}}),
        ev("content_block_stop", {"index": 0}),
        ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": delta_usage or {"output_tokens": 100}}),
        ev("message_stop", {}),
    ]  # fmt: skip
    return Plan(content_type="text/event-stream", chunks=chunks)


async def ask(c: anthropic.AsyncAnthropic, stream: bool, **extra: Any) -> None:
    if stream:
        async with c.messages.stream(model=MODEL, max_tokens=100, messages=MSGS, **extra) as s:
            await s.get_final_message()
    else:
        await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS, **extra)


async def test_us_only_inference_unpriced_is_refused_as_an_unpriced_tier(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """``inference_geo: "us"`` costs 1.1 times the standard prices (Anthropic's data residency):
    on a priced model it was forwarded and billed at the standard prices, as fast mode was before
    it became a tier. Unpriced, it is refused as an unpriced service tier is."""
    proxy = await geo_proxy(make_proxy, queue)
    queue.plans = [us_answer(False)]
    c = client(proxy)
    with pytest.raises(anthropic.BadRequestError) as refused:  # was: 200, billed at the standard prices
        await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS, inference_geo="us")
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "inference_geo" in refused.value.body["error"]["message"]  # type: ignore[index]
    assert queue.received == []
    # The default geography is the standard prices: taken as before.
    queue.plans = [Plan(chunks=[dumps(message([{"type": "text", "text": "Hi."}]))])]
    await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS, inference_geo="global")
    await c.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_us_only_inference_is_billed_at_its_prices(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis, stream: bool
) -> None:
    proxy = await geo_proxy(make_proxy, queue, {"us": US_ONLY})
    queue.plans = [us_answer(stream)]
    c = client(proxy)
    await ask(c, stream, inference_geo="us")
    (entry,) = await entries(redis_client)
    # was: 7,500 (1,000 x 5 + 100 x 25), the standard prices
    assert (entry.get("service_tier"), entry["cost_micros"]) == ("us", str(int(1000 * 5.5 + 100 * 27.5)))
    await c.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_workspace_that_defaults_to_us_only_inference_is_billed_at_its_prices(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis, stream: bool
) -> None:
    """A request that names no geography is served where the workspace's
    ``default_inference_geo`` says, which the proxy cannot know: reserved at the dearest priced
    tier (as a call naming no service tier is; that held), billed at the prices of the one its
    answer names (``usage.inference_geo``), as a tier named in ``usage.service_tier`` is."""
    proxy = await geo_proxy(make_proxy, queue, {"us": US_ONLY})
    queue.plans = [us_answer(stream)]
    c = client(proxy)
    await ask(c, stream)
    (entry,) = await entries(redis_client)
    assert (entry.get("service_tier"), entry["cost_micros"]) == ("us", "8250")  # was: (None, 7500)
    await c.close()


async def test_a_message_delta_naming_the_tier_alone_keeps_the_geography_message_start_told(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """A stream's usage is told in parts: message_start's, then message_delta's over it. A
    message_delta that repeats ``service_tier`` and not ``inference_geo`` (a gateway's, which
    writes the fields it knows) leaves the call served in the US: the tier is read off the whole
    usage told, not off the last part alone."""
    proxy = await geo_proxy(make_proxy, queue, {"us": US_ONLY})
    queue.plans = [us_answer(True, {"output_tokens": 100, "service_tier": "standard"})]
    c = client(proxy)
    await ask(c, True, inference_geo="us")
    (entry,) = await entries(redis_client)
    assert (entry.get("service_tier"), entry["cost_micros"]) == ("us", "8250")  # was: (None, "7500")
    await c.close()


async def test_the_proxys_own_timeout_and_overload_errors_name_anthropics_types(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """The errors the proxy writes itself on /v1/messages carry the type Anthropic gives its
    status: 504 is ``timeout_error`` and 529 ``overloaded_error`` (Anthropic's errors docs), as
    401 is ``authentication_error``; both were ``api_error``. Streamed, a silence is a
    ``timeout_error`` event too."""
    upstream = {
        "base_url": queue.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 0.5,
    }  # fmt: skip
    proxy = await make_proxy(upstreams={"claude": upstream}, models={"claude-*": {"upstream": "claude"}})
    c = client(proxy)
    # A 529 whose body is not Anthropic's error JSON (a gateway's page): the proxy writes the error.
    queue.plans = [Plan(status=529, content_type="text/html", chunks=[b"<html>busy</html>"])]
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS)
    assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]  # was: api_error
    # An upstream silent past timeout_s: the proxy's own 504.
    queue.plans = [Plan(chunks=[b'{"id": "msg_1",', b'"type": "message"}'], delay_s=2)]
    with pytest.raises(anthropic.InternalServerError) as timed_out:
        await c.messages.create(model=MODEL, max_tokens=100, messages=MSGS)
    assert timed_out.value.status_code == 504
    assert timed_out.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]  # was: api_error
    # Streamed: the event the proxy ends a silent stream with.
    start = message([], usage={"input_tokens": 10, "output_tokens": 1})
    start["stop_reason"] = None
    queue.plans = [
        Plan(
            content_type="text/event-stream", chunks=[ev("message_start", {"message": start}), b""], delay_s=2
        )
    ]
    with pytest.raises(anthropic.APIStatusError) as silent:
        async with c.messages.stream(model=MODEL, max_tokens=100, messages=MSGS) as s:
            await s.get_final_message()
    assert silent.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]  # was: api_error
    outcomes = [e["outcome"] for e in await entries(redis_client)]
    assert outcomes == ["upstream_error", "upstream_timeout", "upstream_timeout"]
    await c.close()


async def test_fast_mode_with_us_only_inference_is_a_tier_of_its_own(
    make_proxy: ProxyFactory, queue: Queue, redis_client: aioredis.Redis
) -> None:
    """Both price modifiers at once: priced as ``fast-us`` (refused while unpriced), never at the
    fast or the US-only prices alone."""
    fast = {"input": "30", "output": "150"}
    fast_us = {"input": "33", "output": "165"}
    proxy = await geo_proxy(make_proxy, queue, {"us": US_ONLY, "fast": fast})
    c = client(proxy)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await c.messages.create(
            model=MODEL, max_tokens=100, messages=MSGS, inference_geo="us", extra_body={"speed": "fast"}
        )
    assert "'fast-us'" in refused.value.body["error"]["message"]  # type: ignore[index]
    assert queue.received == []
    proxy = await geo_proxy(make_proxy, queue, {"us": US_ONLY, "fast": fast, "fast-us": fast_us})
    c2 = client(proxy)
    usage = {"input_tokens": 1000, "output_tokens": 100, "speed": "fast", "inference_geo": "us"}
    queue.plans = [Plan(chunks=[dumps(message([{"type": "text", "text": "Hi."}], usage=usage))])]
    await c2.messages.create(
        model=MODEL, max_tokens=100, messages=MSGS, inference_geo="us", extra_body={"speed": "fast"}
    )
    (entry,) = await entries(redis_client)
    assert (entry.get("service_tier"), entry["cost_micros"]) == ("fast-us", str(1000 * 33 + 100 * 165))
    await c.close()
    await c2.close()
