"""Budgets end to end: ceilings, refusals before any upstream call, refunds, overshoot, clamp,
cost with cached and reasoning tokens, and hot reload of prices and ceilings."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client import generate_latest

import proxy.reserve
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.state import STATE
from proxy.store import Reservation, Scope
from proxy.tokenizer import Tokenizer
from tests.conftest import (
    KEY_A,
    UPSTREAM_KEY,
    Proxy,
    ProxyFactory,
    base_config,
    digest,
    serving,
    until_upstream_received,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries

MSGS: list[Any] = [{"role": "user", "content": "hi"}]
# Reserve of one call with MSGS and max_tokens=10, no tokenizer: input = 2 bytes + 4 + 3 = 9.
INPUT_RESERVE = 9
# The fake bills 1 word + 3 = 4 prompt tokens and min(8, max_tokens) completion tokens.
FAKE_PROMPT = 4


def tiers(**standard: Any) -> dict[str, Any]:
    return {"standard": standard}


async def call(proxy: Proxy, run: str, max_tokens: int = 10, **extra: Any) -> Any:
    client = proxy.client()
    return await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=MSGS,
        max_tokens=max_tokens,
        extra_headers={"X-Run-Id": run},
        **extra,
    )


async def meters(proxy: Proxy, run: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.url}/v1/billing/runs/{run}", headers={"Authorization": f"Bearer {KEY_A}"}) as r,
    ):
        assert r.status == 200, await r.text()
        body: dict[str, Any] = await r.json()
        return body


async def test_landing_exactly_on_the_ceiling_is_allowed(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers=tiers(run={"total_tokens": INPUT_RESERVE + 10}))
    response = await call(proxy, "exact")
    assert response.headers["x-billing-outcome"] == "ok"
    assert len(fake.bill) == 1


async def test_one_unit_over_is_refused_before_any_upstream_call(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers=tiers(run={"total_tokens": INPUT_RESERVE + 10 - 1}))
    with pytest.raises(openai.RateLimitError) as caught:
        await call(proxy, "over")
    err = caught.value
    assert err.status_code == 429
    assert err.response.headers["x-should-retry"] == "false"
    assert err.response.headers["x-billing-refused-meter"] == "total_tokens"
    body = err.response.json()["error"]
    assert body["type"] == "insufficient_quota" and body["code"] == "budget_exceeded"
    assert "scope 'run'" in body["message"] and "ceiling 18" in body["message"]
    assert "needs 19" in body["message"]
    assert fake.bill == [] and fake.received == []


async def test_requests_ceiling_and_refund_of_unused_reserve(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers=tiers(run={"requests": 2}))
    for _ in range(2):
        response = await call(proxy, "r2")
        assert response.headers["x-budget-remaining-requests"] in {"1", "0"}
    with pytest.raises(openai.RateLimitError):
        await call(proxy, "r2")
    assert len(fake.bill) == 2
    state = (await meters(proxy, "r2"))["meters"]
    assert state["requests"] == {"used": 2, "reserved": 0, "ceiling": 2, "refused": 1}
    # The reserve was 9 + 10 per call; the real figures replaced it.
    assert state["input_tokens"]["used"] == 2 * FAKE_PROMPT
    assert state["output_tokens"]["used"] == 2 * 8
    assert all(m["reserved"] == 0 for m in state.values())
    assert (await meters(proxy, "r2"))["summary"].startswith("requests 2/2")


async def test_actual_above_reserve_is_charged_in_full_as_overshoot(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy()
    response = await call(proxy, "big", extra_body={"fake": {"usage": {"prompt_tokens": 500}}})
    assert response.headers["x-billing-input-tokens"] == "500"
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.url}/v1/billing/runs/big/ledger", headers={"Authorization": f"Bearer {KEY_A}"}
        ) as r,
    ):
        (entry,) = (await r.json())["data"]
    assert entry["input_tokens"] == "500"
    assert int(entry["overshoot_tokens"]) == 500 + 8 - (INPUT_RESERVE + 10)
    assert (await meters(proxy, "big"))["meters"]["input_tokens"]["used"] == 500


PRICES = {"input": "1.0", "cached_input": "0.5", "output": "2.0", "reasoning": "3.0"}


async def test_cost_prices_cached_and_reasoning_tokens(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    models = {"gpt-4o-mini": {"upstream": "openai", "price_per_million": PRICES}}
    proxy = await make_proxy(models=models, tiers=tiers(run={"cost_usd": 1}))
    details = {
        "prompt_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 3},
        "completion_tokens_details": {"reasoning_tokens": 5},
    }
    response = await call(proxy, "cost", extra_body={"fake": {"usage": details}})
    # 7 input at 1.0 + 3 cached at 0.5 + 3 output at 2.0 + 5 reasoning at 3.0, per million tokens,
    # in micro-units: 7 + 1.5 + 6 + 15 = 29.5, rounded up once.
    assert response.headers["x-billing-cost-micros"] == "30"
    state = (await meters(proxy, "cost"))["meters"]
    assert state["cost_micros"] == {"used": 30, "reserved": 0, "ceiling": 1_000_000, "refused": 0}


async def test_model_without_price_is_refused_when_the_tier_limits_cost(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers=tiers(run={"cost_usd": 1}))
    with pytest.raises(openai.BadRequestError) as caught:
        await call(proxy, "unpriced")
    assert caught.value.code == "model_not_priced"
    assert fake.received == []


async def test_clamp_lowers_max_tokens_to_what_the_budget_affords(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(
        tiers=tiers(run={"output_tokens": 6}, on_budget_short="clamp", min_output_tokens=2)
    )
    response = await call(proxy, "clamp", max_tokens=100)
    assert fake.received[-1].body["max_tokens"] == 6
    assert response.headers["x-billing-outcome"] == "truncated"  # the fake honours the lowered cap
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.url}/v1/billing/runs/clamp/ledger", headers={"Authorization": f"Bearer {KEY_A}"}
        ) as r,
    ):
        (entry,) = (await r.json())["data"]
    assert entry["clamped"] == "1" and entry["reserved_output_tokens"] == "6"
    # Spent: nothing is left worth min_output_tokens, so the next call is refused.
    with pytest.raises(openai.RateLimitError):
        await call(proxy, "clamp", max_tokens=100)


async def test_clamp_caps_every_answer_of_every_prompt(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    # Legacy completions, 3 prompts, n=2: six answers written, each capped at 12 // 6 = 2.
    proxy = await make_proxy(
        tiers=tiers(run={"output_tokens": 12}, on_budget_short="clamp", min_output_tokens=1)
    )
    async with proxy.client() as client:
        await client.completions.create(
            model="gpt-4o-mini",
            prompt=["a", "b", "c"],
            max_tokens=100,
            n=2,
            extra_headers={"X-Run-Id": "prompts"},
        )
    assert fake.received[-1].body["max_tokens"] == 2
    state = (await meters(proxy, "prompts"))["meters"]
    assert state["output_tokens"]["used"] <= 12


async def test_without_clamp_the_same_request_is_refused(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers=tiers(run={"output_tokens": 6}))
    with pytest.raises(openai.RateLimitError):
        await call(proxy, "noclamp", max_tokens=100)
    assert fake.received == []


async def test_clamp_by_cost_never_overspends(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    models = {"gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "1", "output": "3"}}}
    # 9 input micro-units reserved; 30 micro-units affords 7 output tokens (9 + 21 = 30).
    proxy = await make_proxy(
        models=models, tiers=tiers(run={"cost_usd": "0.00003"}, on_budget_short="clamp", min_output_tokens=1)
    )
    await call(proxy, "costclamp", max_tokens=100)
    assert fake.received[-1].body["max_tokens"] == 7
    state = (await meters(proxy, "costclamp"))["meters"]
    assert state["cost_micros"]["used"] <= 30


async def test_key_window_refusal_has_retry_after(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(tiers=tiers(windows=[{"period": "minute", "requests": 1}]))
    await call(proxy, "w1")
    with pytest.raises(openai.RateLimitError) as caught:
        await call(proxy, "w2")
    headers = caught.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-billing-refused-scope"] == "key:minute"
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.url}/v1/billing/keys/self", headers={"Authorization": f"Bearer {KEY_A}"}) as r,
    ):
        body = await r.json()
    windows = {w["scope"]: w for w in body["windows"]}
    assert list(windows) == ["key", "key:minute", "key:day", "key:month", "tenant:day", "tenant:month"]
    assert windows["key"]["meters"]["requests"]["used"] == 1
    assert windows["key:minute"]["meters"]["requests"] == {
        "used": 1,
        "reserved": 0,
        "ceiling": 1,
        "refused": 1,
    }
    # Day and month are counted, limited or not: reported without a ceiling; the refusal is the
    # minute's, the window that refused the call, not theirs.
    assert windows["key:day"]["meters"]["requests"] == {
        "used": 1,
        "reserved": 0,
        "ceiling": None,
        "refused": 0,
    }


async def _in_flight(proxy: Proxy, fake: FakeUpstream, key: str = KEY_A) -> asyncio.Task[Any]:
    """A call the upstream holds until the test calls ``fake.release()``, once it has reached the
    upstream (a fixed delay may end before the test has looked, on a loaded machine)."""
    slow = asyncio.create_task(
        proxy.client(key).chat.completions.create(
            model="gpt-4o-mini",
            messages=MSGS,
            max_tokens=10,
            extra_headers={"X-Run-Id": "in-flight"},
            extra_body={"fake": {"hold": True}},
        )
    )
    await until_upstream_received(fake, 1)
    return slow


async def _holders(redis_client: aioredis.Redis) -> list[str]:
    """The scopes holding a reserve, named without their prefix nor their window's start."""
    return sorted(
        [
            key.split(":", 2)[2].split(":20")[0]
            async for key in redis_client.scan_iter("lbp:*")
            if await redis_client.type(key) == "hash" and await redis_client.hexists(key, "resv:requests")
        ]
    )


async def _key_view(proxy: Proxy) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.url}/v1/billing/keys/self", headers={"Authorization": f"Bearer {KEY_A}"}) as r,
    ):
        assert r.status == 200, await r.text()
        body = await r.json()
    return {w["scope"]: w["meters"] for w in body["windows"]}


async def test_a_call_in_flight_shows_in_every_window_a_ceiling_names_or_not(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Only the run and the scopes a ceiling names hold a call's reserve in Redis (holding it
    everywhere was most of what Redis spent on a call); the key's view still shows in every
    window what the calls in flight reserved, from their records."""
    # A day window, not a minute: the view must read the window the call reserved against.
    proxy = await make_proxy(tiers=tiers(windows=[{"period": "day", "requests": 5}]))
    slow = await _in_flight(proxy, fake)
    during = await _key_view(proxy)
    assert list(during) == ["key", "key:day", "key:month", "tenant:day", "tenant:month"]
    for name, view in during.items():
        assert view["requests"] == {
            "used": 0,
            "reserved": 1,
            "ceiling": 5 if name == "key:day" else None,
            "refused": 0,
        }
        assert view["total_tokens"]["reserved"] == INPUT_RESERVE + 10, name
        assert view["concurrent"]["reserved"] == 1, name
        # A peak is kept where the reserve is held; a window that holds nothing has none.
        assert view["concurrent"]["peak"] == (1 if name in ("key", "key:day") else None), name
    # The key's lifetime, the window its ceiling names and the run; not the day and month windows.
    assert await _holders(redis_client) == ["key:a-ci:all", "key:a-ci:day", "run:in-flight"]
    fake.release()
    await slow
    after = await _key_view(proxy)
    for name, view in after.items():
        assert view["requests"]["used"] == 1 and view["requests"]["reserved"] == 0, name
        assert view["total_tokens"]["used"] == FAKE_PROMPT + 8 and view["concurrent"]["reserved"] == 0, name


async def test_tenant_window_is_shared_by_all_keys_of_the_tenant(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    keys = [
        {"name": "a1", "sha256": digest("sk-a1"), "tenant": "team-a", "tier": "standard"},
        {"name": "a2", "sha256": digest("sk-a2"), "tenant": "team-a", "tier": "standard"},
    ]
    proxy = await make_proxy(keys=keys, tiers=tiers(tenant=[{"period": "month", "requests": 1}]))
    await proxy.client("sk-a1").chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=5)
    with pytest.raises(openai.RateLimitError):
        await proxy.client("sk-a2").chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=5)
    assert len(fake.bill) == 1


async def test_a_tenant_window_another_tier_limits_sees_the_calls_in_flight_of_every_tier(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A key whose own tier sets no tenant ceiling still holds its reserve on the tenant window
    another tier limits: that ceiling counts its call in flight, not only once it settles."""
    keys = [
        {"name": "a1", "sha256": digest("sk-a1"), "tenant": "team-a", "tier": "limited"},
        {"name": "a2", "sha256": digest("sk-a2"), "tenant": "team-a", "tier": "open"},
    ]
    ceiling = 2 * (INPUT_RESERVE + 10) - 3  # room for one reserve, or a settled call and a reserve
    proxy = await make_proxy(
        keys=keys, tiers={"limited": {"tenant": [{"period": "month", "total_tokens": ceiling}]}, "open": {}}
    )
    slow = await _in_flight(proxy, fake, "sk-a2")
    with pytest.raises(openai.RateLimitError) as caught:
        await proxy.client("sk-a1").chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=10)
    assert caught.value.response.headers["x-should-retry"] == "true"  # fits once that call ends
    fake.release()
    await slow
    await proxy.client("sk-a1").chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=10)
    assert len(fake.bill) == 2


async def test_a_tenant_holds_nothing_on_windows_only_other_tenants_limit(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Another tenant's tier limiting its month, or a window named without a ceiling, makes no
    key of this tenant hold its calls there (each hold costs Redis on every call)."""
    keys = [
        {"name": "a1", "sha256": digest("sk-a1"), "tenant": "team-a", "tier": "limited"},
        {"name": "b1", "sha256": digest("sk-b1"), "tenant": "team-b", "tier": "open"},
    ]
    tiers_ = {
        "limited": {"tenant": [{"period": "month", "total_tokens": 1000}]},
        "open": {"tenant": [{"period": "day"}]},
    }
    proxy = await make_proxy(keys=keys, tiers=tiers_)
    slow = await _in_flight(proxy, fake, "sk-b1")
    holders = await _holders(redis_client)
    fake.release()
    await slow
    assert holders == ["key:b1:all", "run:in-flight"], holders


async def test_a_tenant_window_named_without_a_ceiling_counts_every_key_and_holds_nothing(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A tier naming a tenant's hour window without a ceiling (to see it) makes every key of the
    tenant count there, whatever its own tier; as nothing limits it, nobody holds there."""
    keys = [
        {"name": "a1", "sha256": digest("sk-a1"), "tenant": "team-a", "tier": "watch"},
        {"name": "a2", "sha256": digest("sk-a2"), "tenant": "team-a", "tier": "other"},
    ]
    proxy = await make_proxy(keys=keys, tiers={"watch": {"tenant": [{"period": "hour"}]}, "other": {}})
    for key in ("sk-a2", "sk-a1"):
        await proxy.client(key).chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=10)
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.url}/v1/billing/keys/self", headers={"Authorization": "Bearer sk-a1"}) as r,
    ):
        windows = {w["scope"]: w["meters"] for w in (await r.json())["windows"]}
    assert windows["tenant:hour"]["requests"] == {"used": 2, "reserved": 0, "ceiling": None, "refused": 0}
    hour_keys = [key async for key in redis_client.scan_iter("lbp:{team-a}:tenant:hour:*")]
    assert len(hour_keys) == 1 and not await redis_client.hexists(hour_keys[0], "born")  # never held


async def _proxy_from_file(raw: dict[str, Any], path: Path) -> Proxy:
    """A proxy serving the config file ``path`` (written from ``raw``), reloaded on SIGHUP."""
    from proxy.app import build_app
    from proxy.config_load import load_config
    from proxy.tokenizer import Tokenizer

    path.write_text(yaml.safe_dump(raw))
    os.environ["TEST_UPSTREAM_KEY"] = UPSTREAM_KEY
    return await serving(build_app(load_config(path), tokenizer=Tokenizer({}), config_path=path))


async def test_reload_applies_new_prices_and_ceilings_and_keeps_usage(
    fake: FakeUpstream, tmp_path: Path, redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    raw = base_config(fake.base_url, redis_server.url)
    raw["models"] = {
        "gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "1", "output": "1"}}
    }
    raw["tiers"] = tiers(run={"requests": 3})
    path = tmp_path / "config.yaml"
    proxy = await _proxy_from_file(raw, path)
    app, runner = proxy.app, proxy.runner
    try:
        first = await call(proxy, "reload")
        assert first.headers["x-billing-cost-micros"] == "12"  # 4 input + 8 output at 1 per token

        raw["models"]["gpt-4o-mini"]["price_per_million"] = {"input": "2", "output": "2"}
        raw["tiers"] = tiers(run={"requests": 2})
        path.write_text(yaml.safe_dump(raw))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if app[STATE].config.tiers["standard"].run.requests == 2:
                break
            await asyncio.sleep(0.02)
        second = await call(proxy, "reload")
        assert second.headers["x-billing-cost-micros"] == "24"
        # Usage survived the reload: 2 used against the new ceiling of 2.
        with pytest.raises(openai.RateLimitError):
            await call(proxy, "reload")

        path.write_text("tiers: [this is not valid")
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.1)
        assert app[STATE].config.tiers["standard"].run.requests == 2  # the old config stays
    finally:
        await runner.cleanup()


async def test_concurrent_calls_per_key_are_limited(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(tiers=tiers(key={"concurrent": 2}))
    slow = {"fake": {"mode": "stall_before_headers", "stall_s": 2}}
    # All three reserve long before the first settles (the upstream stalls 2 s).
    results = await asyncio.gather(
        *(call(proxy, f"c{i}", extra_body=slow) for i in range(3)), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 1 and refused[0].response.headers["x-billing-refused-meter"] == "concurrent"
    assert len(fake.bill) == 2
    await call(proxy, "after")  # released on settle


async def test_a_100kb_prompt_is_estimated_off_the_event_loop_and_bounded(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    prompt = "ä" * 50_000  # 100 KB of UTF-8: the byte count bounds any byte-level BPE count
    proxy = await make_proxy()
    client = proxy.client()
    response = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=5,
        extra_headers={"X-Run-Id": "big-prompt"},
    )
    assert response.headers["x-billing-outcome"] in ("ok", "truncated")
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.url}/v1/billing/runs/big-prompt/ledger", headers={"Authorization": f"Bearer {KEY_A}"}
        ) as r,
    ):
        (entry,) = (await r.json())["data"]
    assert entry["reserved_input_tokens"] == str(len(prompt.encode()) + 4 + 3)


async def test_an_upstream_that_reads_only_max_tokens_gets_the_cap_there(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Many OpenAI-compatible servers read only max_tokens (and some refuse a field they do not
    know): with no cap of the client's own, one would write past the reserve."""
    upstream = {
        "base_url": fake.base_url,
        "api_key_env": "TEST_UPSTREAM_KEY",
        "chat_output_cap_field": "max_tokens",
    }
    proxy = await make_proxy(upstreams={"openai": upstream}, tiers=tiers(run={"total_tokens": 1100}))
    client = proxy.client()
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS)
    assert fake.received[-1].body["max_tokens"] == 1000  # the model's max_output_tokens
    assert "max_completion_tokens" not in fake.received[-1].body
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_completion_tokens=7)
    assert fake.received[-1].body["max_tokens"] == 7
    assert "max_completion_tokens" not in fake.received[-1].body
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=900)
    assert fake.received[-1].body["max_tokens"] == 900  # the client's own, as it came
    extra: Any = {"max_completion_tokens": None}  # null, as some SDKs send an unset field
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=5, extra_body=extra)
    assert fake.received[-1].body["max_tokens"] == 5
    assert "max_completion_tokens" not in fake.received[-1].body
    assert "max_completion_tokens" not in fake.received[-1].body


async def test_the_upstream_never_gets_more_output_than_was_reserved(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers=tiers(run={"total_tokens": 1100}))  # gpt-4o-mini: max_output_tokens 1000
    await call(proxy, "capped", max_tokens=5000)
    assert fake.received[-1].body["max_tokens"] == 1000
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Run-Id": "uncapped"}
    )
    assert fake.received[-1].body["max_completion_tokens"] == 1000  # the request named no cap
    state = (await meters(proxy, "capped"))["meters"]
    assert state["total_tokens"]["used"] <= 1100


async def test_cost_is_reserved_at_the_dearest_rates(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    prices = {"input": "1", "output": "1", "reasoning": "10", "cache_creation_input": "5"}
    models = {"gpt-4o-mini": {"upstream": "openai", "price_per_million": prices}}
    # 9 input x 5 + 10 output x 10 = 145 micro-units reserved; 144 is one short.
    proxy = await make_proxy(models=models, tiers=tiers(run={"cost_usd": "0.000144"}))
    with pytest.raises(openai.RateLimitError):
        await call(proxy, "dear")
    proxy = await make_proxy(models=models, tiers=tiers(run={"cost_usd": "0.000145"}))
    await call(proxy, "dear2")


async def test_a_tenant_window_counts_the_keys_of_every_tier(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Key a2's tier names no tenant window: its calls did not count in the tenant's month, so
    # a1 (whose tier limits the tenant to 2 calls a month) could still spend past it.
    keys = [
        {"name": "a1", "sha256": digest("sk-a1"), "tenant": "team-a", "tier": "capped"},
        {"name": "a2", "sha256": digest("sk-a2"), "tenant": "team-a", "tier": "free"},
    ]
    proxy = await make_proxy(
        keys=keys, tiers={"capped": {"tenant": [{"period": "month", "requests": 2}]}, "free": {}}
    )
    for _ in range(2):
        await proxy.client("sk-a2").chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=5)
    async with (
        aiohttp.ClientSession() as session,
        session.get(proxy.url + "/v1/billing/keys/self", headers={"Authorization": "Bearer sk-a1"}) as resp,
    ):
        windows = (await resp.json())["windows"]
    (month,) = [w for w in windows if w["scope"] == "tenant:month"]
    assert month["meters"]["requests"]["used"] == 2
    with pytest.raises(openai.RateLimitError):
        await proxy.client("sk-a1").chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=5)
    # a2 itself is not limited by a1's tier: the window counts it, nothing more.
    await proxy.client("sk-a2").chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=5)


async def _post(proxy: Proxy, path: str, body: dict[str, Any], run: str, **headers: str) -> int:
    auth = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run, **headers}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + path, json=body, headers=auth) as resp,
    ):
        await resp.read()
        return resp.status


async def test_a_request_with_both_chat_caps_is_held_to_the_reserve_by_both(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # OpenAI refuses both at once; an upstream honouring max_tokens was let past the reserve.
    proxy = await make_proxy(
        tiers=tiers(run={"output_tokens": 6}, on_budget_short="clamp", min_output_tokens=2)
    )
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 100, "max_completion_tokens": 100}
    assert await _post(proxy, "/v1/chat/completions", body, "both") == 200
    sent = fake.received[-1].body
    assert (sent["max_completion_tokens"], sent["max_tokens"]) == (6, 6)  # max_tokens was 100
    # Without a clamp the reserve covers the larger of the two (it covered 10 of 900).
    proxy = await make_proxy(tiers=tiers(run={"output_tokens": 50}))
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 900, "max_completion_tokens": 10}
    assert await _post(proxy, "/v1/chat/completions", body, "both-2") == 429


async def test_a_cap_the_client_set_lower_is_never_raised(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Lowering one of chat's two caps to the model's (or a clamp's) raised the other one the
    client had set lower: an upstream honouring that one could write (and bill) far more."""
    proxy = await make_proxy()  # gpt-4o-mini: max_output_tokens 1000
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_completion_tokens": 10, "max_tokens": 5000}
    assert await _post(proxy, "/v1/chat/completions", body, "low-mct") == 200
    sent = fake.received[-1].body
    assert (sent["max_completion_tokens"], sent["max_tokens"]) == (10, 1000)
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_completion_tokens": 5000, "max_tokens": 10}
    assert await _post(proxy, "/v1/chat/completions", body, "low-mt") == 200
    sent = fake.received[-1].body
    assert (sent["max_completion_tokens"], sent["max_tokens"]) == (1000, 10)
    clamping = tiers(run={"output_tokens": 50}, on_budget_short="clamp", min_output_tokens=2)
    proxy = await make_proxy(tiers=clamping)
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_completion_tokens": 100, "max_tokens": 20}
    assert await _post(proxy, "/v1/chat/completions", body, "clamped") == 200
    sent = fake.received[-1].body
    assert (sent["max_completion_tokens"], sent["max_tokens"]) == (50, 20)
    # An upstream that reads only max_tokens gets the lower of the client's two, reserved so.
    upstream = {
        "base_url": fake.base_url,
        "api_key_env": "TEST_UPSTREAM_KEY",
        "chat_output_cap_field": "max_tokens",
    }
    proxy = await make_proxy(upstreams={"openai": upstream}, tiers=tiers(run={"output_tokens": 20}))
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_completion_tokens": 10, "max_tokens": 500}
    assert await _post(proxy, "/v1/chat/completions", body, "only-mt") == 200
    sent = fake.received[-1].body
    assert sent["max_tokens"] == 10 and "max_completion_tokens" not in sent


async def test_a_clamp_never_goes_below_what_the_provider_takes(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Responses refuses max_output_tokens under 16; Anthropic a max_tokens not above the
    # thinking budget: a clamp below those had the call refused upstream (billed 0, a 400).
    root = fake.base_url
    upstreams = {
        "anthropic": {"base_url": root, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"},
        "openai": {"base_url": root, "api_key_env": "TEST_UPSTREAM_KEY"},
    }
    models = {"claude-*": {"upstream": "anthropic"}, "*": {"upstream": "openai"}}
    responses = {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 100}
    budget = {"type": "enabled", "budget_tokens": 2048}
    thinking = {"model": "claude-sonnet-4", "max_tokens": 4096, "thinking": budget, "messages": MSGS}
    version = {"anthropic-version": "2023-06-01"}
    for ceiling, answered in ((5, False), (20, True)):
        proxy = await make_proxy(tiers=tiers(run={"output_tokens": ceiling}, on_budget_short="clamp"))
        status = await _post(proxy, "/v1/responses", responses, f"r{ceiling}")
        assert status == (200 if answered else 429)
        if answered:
            assert fake.received[-1].body["max_output_tokens"] == 20
    for ceiling, answered in ((1500, False), (3000, True)):
        tier = tiers(run={"output_tokens": ceiling}, on_budget_short="clamp")
        proxy = await make_proxy(upstreams=upstreams, models=models, tiers=tier)
        status = await _post(proxy, "/v1/messages", thinking, f"t{ceiling}", **version)
        assert status == (200 if answered else 429)
        if answered:
            assert fake.received[-1].body["max_tokens"] == 3000


@pytest.mark.parametrize("budget", [2048.0, 2048.5, "2048", True], ids=repr)
async def test_a_thinking_budget_that_is_no_integer_is_refused_before_a_clamp_can_pass_it(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, budget: Any
) -> None:
    # Was not read as a budget at all: the clamp lowered max_tokens to 1500, below 2048, and the
    # call went out for Anthropic to refuse (it refuses any budget_tokens but an integer, 2048.0
    # included: "thinking.enabled.budget_tokens: Input should be a valid integer").
    upstream = {"base_url": fake.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    proxy = await make_proxy(
        upstreams={"anthropic": upstream},
        models={"*": {"upstream": "anthropic"}},
        tiers=tiers(run={"output_tokens": 1500}, on_budget_short="clamp"),
    )
    thinking = {"type": "enabled", "budget_tokens": budget}
    body = {"model": "claude-sonnet-4", "max_tokens": 4096, "thinking": thinking, "messages": MSGS}
    auth = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "float", "anthropic-version": "2023-06-01"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/messages", json=body, headers=auth) as resp,
    ):
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and "thinking.budget_tokens" in error["message"]
    assert fake.received == []
    assert await redis_client.hgetall("lbp:{team-a}:run:float") == {}  # nothing reserved


@pytest.mark.parametrize("owner", ["tenant", "windows"])
async def test_a_day_or_month_ceiling_a_reload_adds_sees_what_was_spent_before(
    owner: str, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Was: only periods some ceiling named were counted, so a month ceiling added mid-month
    # started from 0 and the tenant (or key) could spend it again on top of the month so far.
    from proxy.config_load import parse_config

    proxy = await make_proxy(tiers=tiers())
    for i in range(3):
        await call(proxy, f"before-{i}")  # 12 tokens each (4 input, 8 output)
    raw = base_config(
        fake.base_url, "redis://unused", tiers=tiers(**{owner: [{"period": "month", "total_tokens": 40}]})
    )
    state = proxy.app[STATE]
    state.config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY}).model_copy(
        update={"redis": state.config.redis, "journal_dir": state.config.journal_dir}
    )
    with pytest.raises(openai.RateLimitError) as caught:
        await call(proxy, "after")  # 36 spent: 12 more passes 40
    scope = "tenant:month" if owner == "tenant" else "key:month"
    assert caught.value.response.headers["x-billing-refused-scope"] == scope
    assert len(fake.bill) == 3


async def test_a_clamp_in_a_large_cost_room_never_passes_the_ceiling(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Room x 10^6 past 2^53 (about 9,000 units of room: yen, won): reserve.lua worked the clamp
    # out in doubles and picked a cap one token too large, reserving 1 micro-unit less than its
    # settle then charged: the run ended 1 micro-unit over its ceiling.
    ceiling_micros = 13_500_001_518
    out_rate = 1_500_000_001  # micro-units per million output tokens (1500.000001 a million)
    affordable = (ceiling_micros * 10**6 - 9 * 10**6) // out_rate  # input: 9 tokens at 1 a million
    proxy = await make_proxy(
        models={"big": {"upstream": "openai", "price_per_million": {"input": "1", "output": "1500.000001"}}},
        tiers=tiers(run={"cost_usd": "13500.001518"}, on_budget_short="clamp"),
    )
    response = await proxy.client().chat.completions.with_raw_response.create(
        model="big",
        messages=MSGS,
        max_tokens=10_000_000,
        extra_headers={"X-Run-Id": "large-room"},
        extra_body={"fake": {"usage": {"prompt_tokens": 9, "completion_tokens": affordable}}},
    )
    assert fake.received[-1].body["max_tokens"] == affordable  # the most that fits, exactly
    used = (await meters(proxy, "large-room"))["meters"]["cost_micros"]
    assert used["used"] == int(response.headers["x-billing-cost-micros"]) <= ceiling_micros
    assert used["reserved"] == 0


async def test_a_reload_to_keep_runs_for_ever_keeps_a_live_run_for_ever(
    fake: FakeUpstream, tmp_path: Path, redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    # The run's keys had the TTL of the old setting: left, the run would expire under its next
    # calls and its ceiling be spent again.
    raw = base_config(fake.base_url, redis_server.url)
    raw["limits"] = {"run_ttl_s": 3600}
    raw["tiers"] = tiers(run={"requests": 5})
    path = tmp_path / "config.yaml"
    proxy = await _proxy_from_file(raw, path)
    app, runner = proxy.app, proxy.runner
    keys = ("lbp:{team-a}:run:for-ever", "lbp:{team-a}:runlog:for-ever")
    try:
        await call(proxy, "for-ever")
        assert all([await redis_client.ttl(key) > 0 for key in keys])
        raw["limits"] = {"run_ttl_s": 0}
        path.write_text(yaml.safe_dump(raw))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if app[STATE].config.limits.run_ttl_s == 0:
                break
            await asyncio.sleep(0.02)
        await call(proxy, "for-ever")
        assert [await redis_client.ttl(key) for key in keys] == [-1, -1]
    finally:
        await runner.cleanup()


async def _send_head(
    proxy: Proxy, body: bytes, run: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A call's request line and headers, its body held back."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAuthorization: Bearer {KEY_A}\r\nX-Run-Id: {run}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode())
    await writer.drain()
    return reader, writer


async def _send_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> int:
    writer.write(body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    return int(answer.split(b" ", 2)[1])


async def _reload_to(proxy: Proxy, raw: dict[str, Any], path: Path) -> None:
    before = proxy.app[STATE].config
    path.write_text(yaml.safe_dump(raw))
    os.kill(os.getpid(), signal.SIGHUP)
    for _ in range(500):
        if proxy.app[STATE].config is not before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reloaded")


@pytest.mark.parametrize("change", ["key revoked", "ceiling lowered", "price raised", "body limit lowered"])
async def test_a_body_that_comes_after_a_reload_is_judged_by_the_new_config(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    change: str,
) -> None:
    """The headers came before the reload, the body after it (a client decides when): the call is
    reserved after the reload, so under the new config, whatever the handler read first."""
    raw = base_config(fake.base_url, redis_server.url)
    raw["journal_dir"] = str(tmp_path / "journal")
    raw["tiers"] = tiers(key={"requests": 100})
    raw["models"]["gpt-4o-mini"]["price_per_million"] = {"input": "1", "output": "1"}
    path = tmp_path / "config.yaml"
    proxy = await _proxy_from_file(raw, path)
    body = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'
    if change == "body limit lowered":
        body = body.replace(b'"hi"', b'"' + b"hi " * 500 + b'"')  # 1,581 bytes
    run = change.replace(" ", "-")
    try:
        reader, writer = await _send_head(proxy, body, run)
        await asyncio.sleep(0.2)  # the handler authenticated and waits on the body
        if change == "key revoked":
            raw["keys"] = [k for k in raw["keys"] if k["name"] != "a-ci"]
        elif change == "ceiling lowered":
            raw["tiers"] = tiers(key={"requests": 0})
        elif change == "body limit lowered":
            # Read under the limit of its start (4 MiB): forwarded, past the one in force.
            raw["limits"] = {**raw["limits"], "max_body_bytes": 1024}
        else:
            raw["models"]["gpt-4o-mini"]["price_per_million"] = {"input": "100", "output": "100"}
        await _reload_to(proxy, raw, path)
        status = await _send_body(reader, writer, body)
        if change == "price raised":
            assert status == 200
            ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
            tokens = int(entry["input_tokens"]) + int(entry["output_tokens"])
            assert int(entry["cost_micros"]) == 100 * tokens  # 100 per million: micro-units a token
        else:
            assert status == {"key revoked": 401, "ceiling lowered": 429, "body limit lowered": 413}[change]
            assert fake.received == []
    finally:
        await proxy.runner.cleanup()


async def test_a_file_saved_while_the_proxy_starts_is_in_force_once_it_serves(
    fake: FakeUpstream, tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Saved between the load of the config and the reloader's start (the store, the tokenizer,
    the workers: seconds, a SIGHUP then ignored): applied when the proxy starts serving."""
    from aiohttp import web

    from proxy.app import build_app
    from proxy.config_load import load_config
    from proxy.tokenizer import Tokenizer

    raw = base_config(fake.base_url, redis_server.url)
    raw["journal_dir"] = str(tmp_path / "journal")
    raw["tiers"] = tiers(key={"requests": 100})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    os.environ["TEST_UPSTREAM_KEY"] = UPSTREAM_KEY
    app = build_app(load_config(path), tokenizer=Tokenizer({}), config_path=path)
    raw["tiers"] = tiers(key={"requests": 1})
    path.write_text(yaml.safe_dump(raw))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        tier = app[STATE].config.tiers["standard"]
        assert tier.key is not None and tier.key.requests == 1
    finally:
        await runner.cleanup()


async def test_a_request_larger_than_a_windows_ceiling_gets_no_retry_after(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # 15 tokens a minute; the request needs 9 + 10 = 19: no minute will ever take it.
    proxy = await make_proxy(tiers={"standard": {"windows": [{"period": "minute", "total_tokens": 15}]}})
    with pytest.raises(openai.RateLimitError) as caught:
        await call(proxy, "never", max_tokens=10)
    headers = caught.value.response.headers
    assert headers["x-should-retry"] == "false"
    assert headers["x-billing-refused-scope"] == "key:minute"
    # A client honouring retry-after would wait for the reset and be refused again, for ever.
    assert "retry-after" not in headers, dict(headers)
    # The same request that fits an empty window still gets its reset (control).
    proxy = await make_proxy(tiers={"standard": {"windows": [{"period": "minute", "total_tokens": 19}]}})
    await call(proxy, "fits")
    with pytest.raises(openai.RateLimitError) as caught:
        await call(proxy, "fits")
    assert "retry-after" in caught.value.response.headers
    assert fake.received and len(fake.bill) == 1


async def test_a_clamp_tier_request_whose_least_output_never_fits_gets_no_retry_after(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # At its least output (5) the request needs 9 + 5 = 14 of a window of 12: never served.
    proxy = await make_proxy(
        tiers={
            "standard": {
                "windows": [{"period": "minute", "total_tokens": 12}],
                "on_budget_short": "clamp",
                "min_output_tokens": 5,
            }
        }
    )
    with pytest.raises(openai.RateLimitError) as caught:
        await call(proxy, "never", max_tokens=100)
    assert "retry-after" not in caught.value.response.headers, dict(caught.value.response.headers)
    assert fake.received == []


async def test_budget_remaining_is_the_least_room_of_that_meter_whatever_the_scope(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # The key's lifetime has 100,000 total tokens, each run 1,000. One run spends 94,012 (the key
    # at 6% left), another 898 (the run at 10% left).
    proxy = await make_proxy(
        tiers={"standard": {"run": {"total_tokens": 1000}, "key": {"total_tokens": 100_000}}}
    )
    await call(proxy, "big", extra_body={"fake": {"usage": {"prompt_tokens": 94_000}}})
    await call(proxy, "small", extra_body={"fake": {"usage": {"prompt_tokens": 890}}})
    response = await call(proxy, "small")  # 12 more: the run has 1000 - 898 - 12 = 90 left
    remaining = int(response.headers["x-budget-remaining-total-tokens"])
    assert remaining == 1000 - 898 - 12, remaining
    # With no other call of the run beside it, what the header says is left is what the next
    # call of the run can have, exactly (README: the room its reserve found, less its own bill).
    served = await call(proxy, "small", max_tokens=remaining - INPUT_RESERVE)
    assert served.headers["x-billing-outcome"] == "ok"


async def test_budget_remaining_after_an_overshoot_is_never_negative(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A call reserved at 19 tokens and billed 158 (an overshoot, charged in full) passes a day
    window of 100: the header said -58, which a client reading an unsigned count, or capping its
    next call's output by it, cannot use (the windows hunt). None left: 0."""
    proxy = await make_proxy(tiers={"standard": {"windows": [{"period": "day", "total_tokens": 100}]}})
    response = await call(proxy, "over", extra_body={"fake": {"usage": {"prompt_tokens": 150}}})
    assert response.headers["x-billing-outcome"] == "ok"
    assert response.headers["x-budget-remaining-total-tokens"] == "0"


def _budget_headers(response: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-budget")}


async def test_budget_remaining_is_not_hidden_behind_the_calls_own_concurrency_slot(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The tightest meter was chosen at the reserve, this call's worst case held: a key's one
    concurrency slot, held by the call itself, was always the tightest (0 of 1 left), and the
    header said ``concurrent: 1`` however little of the run's tokens was left (the budgets
    hunt). One call at a time per key, 40 tokens a run: two calls billed 12 each leave 16."""
    proxy = await make_proxy(tiers={"standard": {"run": {"total_tokens": 40}, "key": {"concurrent": 1}}})
    await call(proxy, "conc")
    response = await call(proxy, "conc")
    assert _budget_headers(response) == {"x-budget-remaining-total-tokens": str(40 - 2 * (FAKE_PROMPT + 8))}


async def test_budget_remaining_names_the_tightest_meter_once_the_call_is_billed(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """3 calls a run and 1,000 tokens: a call reserving 900 output tokens and billed 12 leaves 2
    of 3 calls (67%) and 988 tokens (99%). Judged on its worst case (91 tokens left, 9%), the
    header named the tokens (the budgets hunt)."""
    proxy = await make_proxy(tiers={"standard": {"run": {"requests": 3, "total_tokens": 1000}}})
    response = await call(proxy, "tight", max_tokens=900)
    assert _budget_headers(response) == {"x-budget-remaining-requests": "2"}


async def test_legacy_functions_reserve_the_models_tool_prompt_as_tools_do(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    models = {"gpt-4o-mini": {"upstream": "openai", "tools_input_tokens": 500}, "*": {"upstream": "openai"}}
    proxy = await make_proxy(models=models)
    client = proxy.client()
    fn = {"name": "lookup", "parameters": {"type": "object"}}
    await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=MSGS,
        max_tokens=10,
        tools=[{"type": "function", "function": fn}],
        extra_headers={"X-Run-Id": "tools"},
    )
    await client.chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, max_tokens=10, functions=[fn], extra_headers={"X-Run-Id": "fns"}
    )
    [with_tools] = await ledger_entries(proxy, "tools")
    [with_functions] = await ledger_entries(proxy, "fns")
    # The provider's tool-use prompt is added for functions as for tools (the legacy form of tools).
    assert int(with_functions["reserved_input_tokens"]) >= INPUT_RESERVE + 500, with_functions
    assert int(with_tools["reserved_input_tokens"]) >= INPUT_RESERVE + 500


async def test_a_clamp_refused_for_a_concurrency_slot_names_the_slot_not_the_output(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # The run affords 50 output tokens (a clamp to 50 fits); the key's one slot is taken.
    proxy = await make_proxy(
        tiers={
            "standard": {
                "run": {"output_tokens": 50},
                "key": {"concurrent": 1},
                "on_budget_short": "clamp",
                "min_output_tokens": 5,
            }
        }
    )
    client = proxy.client()
    slow = asyncio.create_task(
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MSGS,
            max_tokens=5,
            extra_headers={"X-Run-Id": "slow"},
            extra_body={"fake": {"hold": True}},  # in flight until the next call was refused
        )
    )
    await until_upstream_received(fake, 1)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(
            model="gpt-4o-mini", messages=MSGS, max_tokens=100, extra_headers={"X-Run-Id": "next"}
        )
    fake.release()
    await slow
    headers = caught.value.response.headers
    assert headers["x-should-retry"] == "true"
    # Not "scope 'run', meter 'output_tokens', used 0, reserved 0": the run is untouched, and
    # an operator's refusal metrics would blame the run's budget for a concurrency limit.
    assert (headers["x-billing-refused-scope"], headers["x-billing-refused-meter"]) == (
        "key",
        "concurrent",
    ), caught.value.message
    # Served (clamped) once the slot is free.
    again = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=MSGS, max_tokens=100, extra_headers={"X-Run-Id": "next"}
    )
    assert again.headers["x-billing-outcome"] in ("ok", "truncated")
    assert fake.received[-1].body["max_tokens"] == 50


async def test_spend_of_a_tenant_a_reload_removed_is_not_counted_as_pass_through(
    fake: FakeUpstream, tmp_path: Path, redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """team-b's call was in flight on an instance that died; a reload then removed team-b's keys
    here. This reaper bills team-b's reserve: the ledger says team-b, and the cost counter must
    too, not pass-through callers' (there are none here), or the counters per tenant no longer
    agree with the ledger."""
    raw = base_config(fake.base_url, redis_server.url)
    raw["journal_dir"] = str(tmp_path / "journal")
    raw["limits"] = {**raw["limits"], "reaper_interval_s": 0.1}
    path = tmp_path / "config.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        raw["keys"] = [k for k in raw["keys"] if k["tenant"] != "team-b"]
        await _reload_to(proxy, raw, path)
        store = proxy.app[STATE].store
        assert store is not None
        await store.register_tenant("team-b")  # as the dead instance did, serving team-b
        orphan = await store.reserve(
            tenant="team-b",
            reservation_id="dead-instance",
            run_id="gone",
            scopes=[Scope(name="run", key="lbp:{team-b}:run:gone")],
            amounts={
                "requests": 1,
                "input_tokens": 5,
                "output_tokens": 7,
                "total_tokens": 12,
                "cost_micros": 77,
            },
            lease_ms=1,
            record='{"run_id": "gone", "model": "gpt-4o-mini", "endpoint": "chat.completions"}',
        )
        assert isinstance(orphan, Reservation)
        for _ in range(100):
            if not await redis_client.zcard("lbp:{team-b}:leases"):
                break
            await asyncio.sleep(0.05)
        ((_, entry),) = await redis_client.xrange("lbp:{team-b}:ledger")
        assert entry["outcome"] == "lease_expired"
        exported = generate_latest(proxy.app[STATE].metrics.registry).decode()
        cost = [line for line in exported.splitlines() if line.startswith("llm_proxy_cost_total{")]
        assert cost == ['llm_proxy_cost_total{model="gpt-4o-mini",tenant="team-b"} 7.7e-05'], cost
    finally:
        await proxy.runner.cleanup()


HI: list[Any] = [{"role": "user", "content": "hi"}]
SKEW_S = 120.0


async def _redis_now(redis_client: aioredis.Redis) -> float:
    secs, micros = await redis_client.time()
    return secs + micros / 1e6


def _skew_clock(monkeypatch: pytest.MonkeyPatch, behind_s: float) -> None:
    """This process's wall clock ``behind_s`` behind (an instance on a host whose clock is off):
    both of the stdlib's wall-clock readings, as a host's clock would be."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - behind_s)

    class Skewed(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.fromtimestamp(real_time() - behind_s, tz)

    monkeypatch.setattr(proxy.reserve, "datetime", Skewed)


async def test_instances_with_skewed_clocks_share_one_minute_window(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two instances on one store, one of them with a clock two minutes behind: a key's
    `requests: 1` per minute must hold across them, judged by the one clock they share (the
    store's), not by each host's own clock."""
    tiers = {"standard": {"windows": [{"period": "minute", "requests": 1}]}}
    # Not in the last seconds of the store's minute: both calls fall in one minute of its clock.
    while (await _redis_now(redis_client)) % 60 > 50:
        await asyncio.sleep(0.5)
    started_minute = int(await _redis_now(redis_client)) // 60

    right = await make_proxy(tiers=tiers)
    await right.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)

    with monkeypatch.context() as patch:
        _skew_clock(patch, SKEW_S)
        behind = await make_proxy(tiers=tiers)  # starts, and serves, on its own (skewed) clock
        with pytest.raises(openai.RateLimitError) as caught:
            await behind.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)
    assert int(await _redis_now(redis_client)) // 60 == started_minute, "the test straddled a minute"
    assert caught.value.response.headers["x-billing-refused-scope"] == "key:minute"
    assert len(fake.received) == 1


STEP_S = 120.0
MINUTE_TIERS = {"standard": {"windows": [{"period": "minute", "requests": 1}]}}


async def _early_in_a_minute(client: aioredis.Redis) -> int:
    while (await _redis_now(client)) % 60 > 45:
        await asyncio.sleep(0.5)
    return int(await _redis_now(client)) // 60


async def test_a_host_clock_stepped_between_syncs_does_not_move_the_window(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host's clock is stepped 2 min back after the start's measure (the next is up to 30 s
    away): Store.now adds the offset to the wall clock, so the window moves with the step."""
    minute = await _early_in_a_minute(redis_client)
    proxy = await make_proxy(tiers=MINUTE_TIERS)
    client = proxy.client()
    await client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - STEP_S)  # the host's clock stepped
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)
    monkeypatch.undo()
    assert int(await _redis_now(redis_client)) // 60 == minute, "the test straddled a minute"
    assert len(fake.received) == 1


async def test_an_instance_whose_store_answered_late_follows_the_stores_clock(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An instance 2 min behind starts while the store is down: its offset stays 0 until the
    clock loop's next turn (30 s); calls meanwhile pick windows by the host's clock."""
    first = await make_proxy(tiers=MINUTE_TIERS, redis={"url": own_redis.url, "socket_timeout_s": 1})
    minute = await _early_in_a_minute(own_client)
    await first.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)
    await asyncio.to_thread(own_redis.stop)  # graceful: the window is in the AOF
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - STEP_S)
    behind = await make_proxy(tiers=MINUTE_TIERS, redis={"url": own_redis.url, "socket_timeout_s": 1})
    await asyncio.to_thread(own_redis.start)
    client = behind.client()
    refused = False
    for _ in range(20):  # the pool's connections from before the restart fail first (a 503)
        try:
            await client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)
        except openai.RateLimitError:
            refused = True
            break
        except openai.InternalServerError:
            await asyncio.sleep(0.2)
            continue
        break
    monkeypatch.undo()
    async with aioredis.Redis.from_url(own_redis.url) as fresh:
        assert int(await _redis_now(fresh)) // 60 == minute, "the test straddled a minute"
    assert refused, "a second call in one minute of the store's clock was let through"
    assert len(fake.received) == 1


# Llama 3.1 on vLLM: its chat template adds a system block (about 25 tokens) and about 5 tokens
# a message beyond OpenAI's chat format, which the estimate counts.
TEMPLATE = {"prompt_overhead_tokens": 25, "message_overhead_tokens": 5}
TEMPLATE_RESERVE = INPUT_RESERVE + 25 + 5


@pytest.mark.parametrize("ceiling", [TEMPLATE_RESERVE, TEMPLATE_RESERVE - 1])
async def test_a_chat_templates_tokens_are_reserved_against_the_ceiling(
    make_proxy: ProxyFactory, fake: FakeUpstream, ceiling: int
) -> None:
    """Reserved at the text alone, a short call went out under a ceiling its template's tokens
    then passed (billed by the provider some 30 tokens above its reserve, per call in flight)."""
    models = {"gpt-4o-mini": {"upstream": "openai", **TEMPLATE}}
    proxy = await make_proxy(models=models, tiers=tiers(run={"input_tokens": ceiling}))
    if ceiling < TEMPLATE_RESERVE:
        with pytest.raises(openai.RateLimitError):
            await call(proxy, "template")
        assert fake.received == []
        return
    await call(proxy, "template")
    (entry,) = await ledger_entries(proxy, "template")
    assert int(entry["reserved_input_tokens"]) == TEMPLATE_RESERVE
    # Reserved, never billed by itself: the provider's usage holds the template's tokens.
    assert int(entry["input_tokens"]) == FAKE_PROMPT and entry["usage_source"] == "provider"


async def test_a_reload_changes_a_chat_templates_reserve_for_the_next_call(
    fake: FakeUpstream, tmp_path: Path, redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    raw = base_config(fake.base_url, redis_server.url)
    raw["journal_dir"] = str(tmp_path / "journal")
    path = tmp_path / "config.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        await call(proxy, "before")
        raw["models"]["gpt-4o-mini"].update(TEMPLATE)
        await _reload_to(proxy, raw, path)
        await call(proxy, "after")
        (before,) = await ledger_entries(proxy, "before")
        (after,) = await ledger_entries(proxy, "after")
        assert int(before["reserved_input_tokens"]) == INPUT_RESERVE
        assert int(after["reserved_input_tokens"]) == TEMPLATE_RESERVE
    finally:
        await proxy.runner.cleanup()


async def test_a_clamp_never_lowers_max_tokens_below_the_requests_min_tokens(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """vLLM refuses a ``min_tokens`` above ``max_tokens`` (a 400): a clamp to 6 output tokens of
    a request asking for at least 50 made a request the provider refuses, where the client's own
    (100 and 50) was valid; refused here instead, as a clamp below the Responses API's 16 or
    Anthropic's thinking budget is (the budgets hunt)."""
    proxy = await make_proxy(
        tiers={"standard": {"run": {"output_tokens": 6}, "on_budget_short": "clamp", "min_output_tokens": 2}}
    )
    with pytest.raises(openai.RateLimitError):
        await call(proxy, "min-tokens", max_tokens=100, extra_body={"min_tokens": 50})
    assert fake.received == []
    # Within what is left, the clamp still serves it.
    await call(proxy, "min-tokens", max_tokens=100, extra_body={"min_tokens": 5})
    sent = fake.received[-1].body
    assert (sent["max_tokens"], sent["min_tokens"]) == (6, 5)


async def test_a_models_cap_below_the_requests_min_tokens_is_refused_naming_it(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(models={"gpt-4o-mini": {"upstream": "openai", "max_output_tokens": 20}})
    with pytest.raises(openai.BadRequestError) as refused:
        await call(proxy, "min-cap", max_tokens=100, extra_body={"min_tokens": 50})
    assert (refused.value.param, refused.value.code) == ("min_tokens", "output_cap_too_low")
    assert fake.received == []


@pytest.mark.parametrize("quick_estimates", [True, False], ids=["bound-does-not-fit", "quick-estimates-off"])
async def test_a_call_that_waited_on_its_count_across_a_minute_is_held_to_the_minute_its_reserve_ran(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    quick_estimates: bool,
) -> None:
    """A call's windows were picked by the store's clock when its reserve began, before it waited
    on its prompt's exact count: a minute that ended meanwhile held it, a day's spend charged to
    the day before (and the next day's ceiling passed by it), a refusal naming a window that had
    reset (found by the races hunt). Picked again once the call has waited.

    Here the proxy's measure of the store's clock, set 0.4 s before a minute ends, crosses it
    during the count while the store's own clock (TIME) stays in its minute: the reserve is sent
    for the minute picked again after the wait, which the script finds not begun by TIME; the
    call is held to the store's minute (the calendar hunt)."""
    import threading
    from datetime import UTC

    from tests.test_estimate import QuarterEncoding

    while (await _redis_now(redis_client)) % 60 > 50:  # the call within the store's minute
        await asyncio.sleep(0.5)
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    tier = {"run": {"total_tokens": 10000}, "windows": [{"period": "minute", "requests": 5}]}
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}),
        tiers={"standard": tier},
        limits={"quick_estimates": quick_estimates},
    )
    store = proxy.app[STATE].store
    assert isinstance(store, RedisStore)
    await store.synced_now()
    store_minute_s = int(await _redis_now(redis_client)) // 60 * 60
    # The measure of the store's clock set 0.4 s before a minute ends (taken again every 30 s).
    now_s = store.now()
    boundary_s = (int(now_s) // 60 + 1) * 60
    assert store._clock_offset_s is not None
    store._clock_offset_s += boundary_s - 0.4 - now_s
    reserve = store.reserve
    sent: list[str] = []

    async def minutes_sent(**kw: Any) -> Any:
        sent.extend(s.key.rsplit(":", 1)[1] for s in kw["scopes"] if s.name == "key:minute")
        return await reserve(**kw)

    monkeypatch.setattr(store, "reserve", minutes_sent)
    long_text = " ".join(f"w{i}" for i in range(3400))  # ~17 KB: a byte bound of ~17K tokens
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": long_text}], "max_tokens": 5}
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "across-a-minute"}

    async def post() -> int:
        async with aiohttp.ClientSession() as session:
            async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.read()
                return resp.status

    long_call = asyncio.ensure_future(post())
    try:
        assert await asyncio.to_thread(enc.entered.wait, 10)  # its count began in the old minute
        assert store.now() < boundary_s
        while store.now() < boundary_s + 0.05:
            await asyncio.sleep(0.02)
    finally:
        gate.set()
    assert await long_call == 200
    used = {
        key.rsplit(":", 1)[1]: fields.get("used:requests")
        for key in await redis_client.keys("lbp:{team-a}:key:a-ci:minute:*")
        if (fields := await redis_client.hgetall(key))
    }
    assert int(await _redis_now(redis_client)) // 60 * 60 == store_minute_s, "the test straddled a minute"
    new_minute, store_minute = (
        f"{datetime.fromtimestamp(start_s, UTC):%Y%m%dT%H%M}" for start_s in (boundary_s, store_minute_s)
    )
    assert sent[-2:] == [new_minute, store_minute], sent  # picked again after the wait, then by TIME
    assert used == {store_minute: "1"}, used


async def test_a_reserve_the_store_ran_after_its_minute_ended_is_held_to_the_next_minute(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The windows are picked by the proxy's measure of the store's clock before the reserve
    script is sent. A store slow to run it (stopped for less than the socket timeout: a stalled
    fsync, a pause) ran it once the minute had ended, and the call was held to that minute:
    refused by its full ceiling with x-should-retry: false, the window having reset, or, had it
    fitted, counted in it (the store faults hunt). The script writes nothing then, and the call
    is held to the minute it ran in by the store's clock. Here the measure of the clock, set back
    across the minute's start, stands in for the stall."""
    from datetime import UTC

    from proxy.scopes import window_key

    while (await _redis_now(redis_client)) % 60 > 50:  # the call within the store's minute
        await asyncio.sleep(0.5)
    proxy = await make_proxy(tiers=MINUTE_TIERS)
    store = proxy.app[STATE].store
    assert isinstance(store, RedisStore) and store._clock_offset_s is not None
    now_s = store.now()
    minute_s = int(now_s) // 60 * 60
    ended, current = (
        window_key("team-a", "key:a-ci", "minute", datetime.fromtimestamp(start_s, UTC))
        for start_s in (minute_s - 60, minute_s)
    )
    await redis_client.hset(ended, "used:requests", "1")  # the minute that ended had its request
    store._clock_offset_s -= now_s - minute_s + 1  # the minute before, by the proxy's measure
    await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)
    assert await redis_client.hget(ended, "used:requests") == "1"
    assert await redis_client.hget(current, "used:requests") == "1"


async def test_a_reserve_whose_windows_end_each_time_it_runs_is_sent_a_bounded_number_of_times(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that runs every reserve after its windows ended (slow for a minute each time, or
    a clock gone wrong) is not sent it for ever: a 503, nothing forwarded."""
    from proxy.reserve import WINDOW_PICKS
    from proxy.store import WindowEnded

    proxy = await make_proxy(tiers=MINUTE_TIERS)
    store = proxy.app[STATE].store
    assert store is not None
    sent: list[list[str]] = []

    async def each_time_too_late(**kw: Any) -> WindowEnded:
        sent.append([s.key for s in kw["scopes"]])
        return WindowEnded(now_s=int(store.now()) + 60 * len(sent))

    monkeypatch.setattr(store, "reserve", each_time_too_late)
    with pytest.raises(openai.APIStatusError) as caught:
        await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=10)
    assert caught.value.status_code == 503 and fake.received == []
    assert len(sent) == WINDOW_PICKS
    assert len({tuple(keys) for keys in sent}) == len(sent)  # each sent with its windows picked again


def _minute_key(start_s: int) -> str:
    from datetime import UTC

    from proxy.scopes import window_key

    return window_key("team-a", "key:a-ci", "minute", datetime.fromtimestamp(start_s, UTC))


async def _measure_moved(proxy: Proxy, by_s: float) -> RedisStore:
    """This process's measure of the store's clock moved ``by_s`` since it was taken (the store's
    clock stepped, a failover to a replica whose clock differs): TIME, which the reserve script
    reads, stays the truth."""
    store = proxy.app[STATE].store
    assert isinstance(store, RedisStore)
    await store.synced_now()
    assert store._clock_offset_s is not None
    store._clock_offset_s += by_s
    return store


async def test_a_reserve_run_before_its_windows_began_by_the_stores_clock_is_held_to_the_stores_window(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """README: windows are "calendar windows in UTC by the store's clock, which every instance
    shares". reserve.lua checked only that the first window had not ended by TIME; a process
    whose measure runs ahead of the store's clock (the store's clock stepped back, or a failover
    to a replica whose clock is behind, since the last measure: up to 30 s of calls) picked
    windows that had not begun yet by TIME, and the script counted the call there. A key limited
    to 1 request a minute, whose minute (by the store's clock) was full, got a call through,
    counted in a minute two ahead (the calendar hunt); an instance measuring right is refused
    the same call."""
    proxy = await make_proxy(tiers=MINUTE_TIERS)
    minute_s = int(await _redis_now(redis_client)) // 60 * 60
    # The store's current minute (and the next, should the test straddle one) already hold
    # their one request.
    for start_s in (minute_s, minute_s + 60):
        await redis_client.hset(_minute_key(start_s), "used:requests", "1")
    await _measure_moved(proxy, SKEW_S)  # this process's measure 2 min ahead of the store's clock
    admitted = True
    try:
        await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=5)
    except openai.RateLimitError:
        admitted = False
    assert int(await _redis_now(redis_client)) <= minute_s + 119, "the test took more than a minute"
    counted = sorted(k for k in await redis_client.keys("lbp:{team-a}:key:a-ci:minute:*"))
    future = [k for k in counted if k not in (_minute_key(minute_s), _minute_key(minute_s + 60))]
    assert not future, f"counted in a minute the store's clock has not reached: {future}"
    assert not admitted and fake.received == [], "a second request in one minute of the store's clock"


async def test_a_reserve_run_outside_its_windows_has_the_stores_clock_measured_again_at_once(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A measure off the store's clock (ahead: every window picked by it not begun by TIME)
    made every reserve go twice, picked again each time, until the clock loop's next turn, up
    to 30 s on. The store's answer that its windows had not begun has it taken again at once,
    without holding the call."""
    proxy = await make_proxy(tiers=MINUTE_TIERS)
    store = await _measure_moved(proxy, SKEW_S)
    await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=5)
    off_s = SKEW_S
    for _ in range(200):  # the measure is taken in the background
        off_s = abs(store.now() - await _redis_now(redis_client))
        if off_s < 5:
            break
        await asyncio.sleep(0.05)
    assert off_s < 5, off_s  # the clock loop's turn is 30 s away
    assert len(fake.received) == 1


async def test_a_refusal_after_the_windows_were_picked_again_names_the_reset_by_the_stores_clock(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A process whose measure runs behind the store's clock (its clock stepped forward, or a
    failover to a replica whose clock is ahead, since the last measure) sends the reserve for
    windows that have ended by TIME: the script answers {3, TIME} and the windows are picked
    again at the store's clock as it ran. A refusal there worked out its retry-after from
    ``store.now()``, the measure behind, not from the clock the windows were picked by: a minute
    window that resets within 60 s was said to reset up to 2 min later (README: `retry-after`
    "when the last window in its way resets"; the calendar hunt)."""
    proxy = await make_proxy(tiers=MINUTE_TIERS)
    minute_s = int(await _redis_now(redis_client)) // 60 * 60
    for start_s in (minute_s, minute_s + 60):
        await redis_client.hset(_minute_key(start_s), "used:requests", "1")
    await _measure_moved(proxy, -SKEW_S)  # this process's measure 2 min behind the store's clock
    with pytest.raises(openai.RateLimitError) as caught:
        await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=5)
    headers = caught.value.response.headers
    assert headers["x-billing-refused-scope"] == "key:minute"
    assert fake.received == []
    # The refusal came from a minute of the store's clock (its key filled above), which resets
    # within 60 s of the refusal.
    assert 1 <= int(headers["retry-after"]) <= 60, headers["retry-after"]
