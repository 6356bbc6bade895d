"""A stream's lease renewals (proxy/lease.py)."""

from __future__ import annotations

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, ProxyFactory, until_upstream_received
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import GOOD_BODY, Plan, ScriptedUpstream


@pytest.mark.skewed_loop_clock
async def test_a_stream_renews_its_lease_on_a_loop_whose_clock_is_not_monotonics(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Renewals were timed with call_at(a time.monotonic() instant): on a loop whose clock is
    behind it, none came, the lease ran out mid-stream and the reaper billed the call at its
    reserve."""
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 1}},
        limits={"lease_margin_s": 0.5, "reaper_interval_s": 0.1, "reap_grace_s": 0},  # lease 1.5 s
    )
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 30,
        "fake": {"reply_tokens": 30, "chunk_delay_s": 0.1},  # about 3 s: two lease lengths
    }
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        )
        await until_upstream_received(fake, 1)
        text = await resp.read()
    assert text.endswith(b"data: [DONE]\n\n")
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "30")


async def test_a_stream_call_answered_by_a_slow_json_body_keeps_its_lease(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A ``stream: true`` call the upstream answers with one JSON body (a server that ignores
    ``stream``, a gateway's error page) that comes slowly, each piece within ``timeout_s``: a
    stream's timeout bounds only silence, so the body may take as long as it takes, but nothing
    renews the call's lease while it comes (only the event-stream relay does). A live reaper
    then bills the healthy call at its reserve as ``lease_expired``, the provider's usage is
    thrown away, and the client is told its call's lease expired."""
    proxy = await make_proxy(
        upstreams={
            "openai": {
                "base_url": script.base_url,
                "api_key_env": "TEST_UPSTREAM_KEY",
                "timeout_s": 1,
                "connect_timeout_s": 1,
            }
        },
        limits={"lease_margin_s": 0.5, "reaper_interval_s": 0.1},
    )
    # 12 pieces 0.3 s apart: 3.3 s in all, never 1 s of silence; the lease is 1.5 s.
    step = len(GOOD_BODY) // 12 + 1
    script.plan = Plan(chunks=[GOOD_BODY[i : i + step] for i in range(0, len(GOOD_BODY), step)], delay_s=0.3)
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "stream": True,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "slow-json"},
        ) as resp:
            assert resp.status == 200
            await resp.read()
            outcome = resp.headers.get("x-billing-outcome")
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry
    assert entry["output_tokens"] == "1" and outcome == "ok"
    assert await redis_client.zcard("lbp:{team-a}:leases") == 0
    run = await redis_client.hgetall("lbp:{team-a}:run:slow-json")
    assert run["resv:total_tokens"] == "0" and run["resv:concurrent"] == "0"
