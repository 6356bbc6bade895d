"""Races and crashes with real proxy processes sharing one Redis."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from proxy.reaper import reap_tenant
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from tests.conftest import KEY_A, base_config, slow_stream
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess

LEDGER = "lbp:{team-a}:ledger"


async def post_chat(session: aiohttp.ClientSession, url: str, run: str, **extra: Any) -> int:
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        **extra,
    }
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def open_reservations(client: aioredis.Redis) -> int:
    return int(await client.zcard("lbp:{team-a}:leases"))


async def test_200_concurrent_requests_through_two_processes_respect_the_run_ceiling(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    raw = base_config(fake.base_url, redis_server.url, tiers={"standard": {"run": {"requests": 50}}})
    procs = [ProxyProcess(raw, tmp_path).start(), ProxyProcess(raw, tmp_path).start()]
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            statuses = await asyncio.gather(
                *(post_chat(session, procs[i % 2].url, "race") for i in range(200))
            )
    finally:
        for proc in procs:
            proc.stop()
    assert statuses.count(200) == 50, sorted(set(statuses))
    assert statuses.count(429) == 150, [s for s in statuses if s not in (200, 429)][:5]
    assert len(fake.bill) == 50
    entries = await redis_client.xrange(LEDGER)
    assert len(entries) == 50
    assert sum(int(f["input_tokens"]) for _, f in entries) == fake.billed_prompt_tokens
    assert sum(int(f["output_tokens"]) for _, f in entries) == fake.billed_completion_tokens
    run = await redis_client.hgetall("lbp:{team-a}:run:race")
    assert run["used:requests"] == "50"
    assert all(v == "0" for k, v in run.items() if k.startswith("resv:"))
    assert await open_reservations(redis_client) == 0


async def test_kill_9_mid_stream_is_settled_at_reserve_by_the_other_instance(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    raw = base_config(fake.base_url, redis_server.url)
    raw["upstreams"]["openai"]["timeout_s"] = 2
    raw["limits"] = {**raw["limits"], "lease_margin_s": 1, "reaper_interval_s": 0.2}
    victim = ProxyProcess(raw, tmp_path).start()
    survivor = ProxyProcess(raw, tmp_path).start()
    try:
        body, headers = slow_stream("killed", chunks=40, delay_s=0.1)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(victim.url + "/v1/chat/completions", json=body, headers=headers)
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            assert await open_reservations(redis_client) == 1
            victim.signal(signal.SIGKILL)
            victim.wait()
            resp.close()
        entries: list[Any] = []
        for _ in range(100):  # lease 3 s, reaper every 0.2 s
            entries = await redis_client.xrange(LEDGER)
            if entries:
                break
            await asyncio.sleep(0.1)
    finally:
        victim.stop()
        survivor.stop()
    (entry,) = [fields for _, fields in entries]
    assert entry["outcome"] == "lease_expired"
    assert entry["usage_source"] == "reserve"
    assert entry["run_id"] == "killed"
    assert entry["output_tokens"] == "40"  # the reserve: the call may have spent that much
    assert await open_reservations(redis_client) == 0
    run = await redis_client.hgetall("lbp:{team-a}:run:killed")
    assert run["used:requests"] == "1" and run["resv:requests"] == "0" and run["resv:concurrent"] == "0"


async def test_racing_reapers_settle_an_expired_lease_once(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    from proxy.store import Scope

    stores = [RedisStore.from_url(redis_server.url) for _ in range(4)]
    try:
        scope = Scope(name="run", key="lbp:{team-a}:run:reaped")
        for i in range(20):
            await stores[0].reserve(
                tenant="team-a",
                reservation_id=f"r{i}",
                run_id="reaped",
                scopes=[scope],
                amounts={
                    "requests": 1,
                    "input_tokens": 5,
                    "output_tokens": 7,
                    "total_tokens": 12,
                    "concurrent": 1,
                },
                lease_ms=1,
                record='{"run_id": "reaped"}',
            )
        await asyncio.sleep(0.05)
        settled = await asyncio.gather(*(reap_tenant(store, "team-a") for store in stores))
    finally:
        for store in stores:
            await store.close()
    assert sum(map(len, settled)) == 20
    assert len(await redis_client.xrange(LEDGER)) == 20
    run = await redis_client.hgetall("lbp:{team-a}:run:reaped")
    assert run["used:requests"] == "20" and run["used:total_tokens"] == "240"
    assert run["resv:total_tokens"] == "0" and run["resv:concurrent"] == "0"
