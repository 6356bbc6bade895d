"""A stream's lease renewals (proxy/lease.py)."""

from __future__ import annotations

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, ProxyFactory, until_upstream_received
from tests.fake_upstream import FakeUpstream


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
