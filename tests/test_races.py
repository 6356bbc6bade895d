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
from tests.conftest import KEY_A, ProxyFactory, base_config, busy_script, slow_stream
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess
from tests.test_resilience import until

LEDGER = "lbp:{team-a}:ledger"
LEASES = "lbp:{team-a}:leases"


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
    raw["redis"]["socket_timeout_s"] = 1.5  # below two thirds of the lease (3 s)
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


async def test_redis_killed_and_restarted_in_a_burst_through_two_instances_bills_what_went_out(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    redis = {"url": own_redis.url, "socket_timeout_s": 0.5}
    limits = {"journal_replay_s": 0.1, "reaper_interval_s": 0.2, "reap_grace_s": 2}
    tier = {"run": {"total_tokens": 3000, "concurrent": 6}}
    proxies = [
        await make_proxy(
            redis=redis, limits=limits, journal_dir=str(tmp_path / f"j{i}"), tiers={"standard": tier}
        )
        for i in range(2)
    ]

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        stream = i % 2 == 0
        body: dict[str, Any] = {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20,
            "stream": stream,
            "fake": {"reply_tokens": 20, "chunk_delay_s": 0.03, "delay_s": 0.0 if stream else 0.3},
        }
        await asyncio.sleep(0.02 * i)
        url = proxies[i % 2].url + "/v1/chat/completions"
        try:
            async with session.post(
                url, json=body, headers={"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "crash"}
            ) as resp:
                await resp.read()
                return resp.status
        except aiohttp.ClientError:
            return -1

    async def crash() -> None:
        await asyncio.sleep(0.5)
        await asyncio.to_thread(own_redis.kill)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(own_redis.start)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        statuses, _ = await asyncio.gather(asyncio.gather(*(one(session, i) for i in range(80))), crash())
    assert set(statuses) <= {200, 429, 503}, statuses
    await until(lambda: _settled(own_client), timeout_s=20)
    await asyncio.sleep(1)
    entries = [e for _, e in await own_client.xrange(LEDGER)]
    billed = [e for e in entries if e["outcome"] != "not_forwarded"]
    assert len(billed) == len(fake.bill) == len(fake.received) == statuses.count(200), (
        statuses,
        [e["outcome"] for e in entries],
    )
    run = {k: int(v) for k, v in (await own_client.hgetall("lbp:{team-a}:run:crash")).items() if k != "born"}
    assert all(v == 0 for k, v in run.items() if k.startswith("resv:")), run
    for meter in ("input_tokens", "output_tokens", "total_tokens"):
        assert run.get(f"used:{meter}", 0) == sum(int(e[meter]) for e in entries), meter
    assert sum(int(e["output_tokens"]) for e in billed) == fake.billed_completion_tokens


async def _settled(client: aioredis.Redis) -> bool:
    return await client.zcard(LEASES) == 0


async def test_a_settle_held_past_the_socket_timeout_by_a_slow_redis_is_billed_and_counted_once(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """A settle whose reply a busy Redis holds past the socket timeout is journaled, though the
    store runs it once free: the replay finds the entry that settle wrote, and the call is
    billed, metered and counted once."""
    from proxy.state import STATE
    from tests.conftest import until_redis_busy, until_upstream_received

    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 0.3},
        journal_dir=str(tmp_path / "journal"),
        limits={"journal_replay_s": 0.1},
    )
    busy = busy_script(2)
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "fake": {"hold": True},
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        pending = asyncio.ensure_future(
            session.post(
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "slow-settle"},
            )
        )
        await until_upstream_received(fake, 1)
        blocker = aioredis.Redis.from_url(own_redis.url)
        hold = asyncio.ensure_future(blocker.eval(busy, 0))
        assert own_redis.port is not None
        await until_redis_busy(own_redis.port)
        # Answered only once Redis is busy: after a fixed delay the settle could come first on a
        # loaded machine, and go through before the store was held.
        fake.release()
        async with await pending as resp:
            assert resp.status == 200
            await resp.read()
        await hold
        await blocker.aclose()
    await until(lambda: _settled(own_client), timeout_s=20)
    await asyncio.sleep(0.5)  # more replay rounds
    ((_, entry),) = await own_client.xrange(LEDGER)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider")
    metrics = proxy.app[STATE].metrics
    # The settle met the busy store: its reply was late and it went to the journal.
    assert [(names, v.value) for names, v in metrics.store_errors.items()] == [(["settle"], 1)]
    assert sum(v.value for _, v in metrics.requests.items()) == 1
    run = await own_client.hgetall("lbp:{team-a}:run:slow-settle")
    assert run["used:requests"] == "1" and run["resv:total_tokens"] == "0" and run["resv:concurrent"] == "0"


async def _meters(client: aioredis.Redis, key: str) -> dict[str, int]:
    return {k: int(v) for k, v in (await client.hgetall(key)).items() if k != "born"}


async def test_a_burst_through_two_instances_against_tight_ceilings_never_overspends(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Streams and whole answers, some left by their clients, some with a long new prompt (a
    quick estimate lowered while the call runs), raced through two instances sharing Redis
    against ceilings on tokens, cost, calls in flight and a window: nothing past a ceiling, no
    refused call upstream, the ledger equal to the meters and to the provider's bill."""
    prices = {"input": "1", "output": "2"}
    models = {"gpt-4o-mini": {"upstream": "openai", "max_output_tokens": 1000, "price_per_million": prices}}
    tier = {
        "run": {"total_tokens": 6000, "cost_usd": "0.009", "concurrent": 5},
        "windows": [{"period": "minute", "requests": 40}],
        "tenant": [{"period": "hour", "output_tokens": 900}],
    }
    proxies = [await make_proxy(models=models, tiers={"standard": tier}) for _ in range(2)]
    long_text = " ".join(f"w{i}" for i in range(4000))  # 20K characters: a quick estimate

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        stream = i % 3 == 0
        body: dict[str, Any] = {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": long_text if i % 7 == 0 else "hi"}],
            "max_tokens": 20,
            "stream": stream,
            "fake": {"reply_tokens": 20, "chunk_delay_s": 0.01},
        }
        url = proxies[i % 2].url + "/v1/chat/completions"
        headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "burst"}
        async with session.post(url, json=body, headers=headers) as resp:
            if stream and resp.status == 200 and i % 2:
                await resp.content.readuntil(b"\n\n")
                return resp.status  # left mid-stream
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        statuses = await asyncio.gather(*(one(session, i) for i in range(120)))
    assert set(statuses) <= {200, 429}, statuses
    for _ in range(200):  # the drained streams settle
        if await redis_client.zcard(LEASES) == 0:
            break
        await asyncio.sleep(0.05)
    entries = [e for _, e in await redis_client.xrange(LEDGER)]
    assert len(entries) == statuses.count(200) == len(fake.bill) == len(fake.received)
    run = await _meters(redis_client, "lbp:{team-a}:run:burst")
    for meter in ("input_tokens", "output_tokens", "total_tokens", "cost_micros"):
        assert run.get(f"used:{meter}", 0) == sum(int(e[meter]) for e in entries), meter
    assert run["used:requests"] == len(entries)
    assert all(v == 0 for k, v in run.items() if k.startswith("resv:")), run
    assert run["used:total_tokens"] <= 6000 and run["used:cost_micros"] <= 9000
    assert run["peak:concurrent"] <= 5
    assert sum(int(e["input_tokens"]) for e in entries) == fake.billed_prompt_tokens
    assert sum(int(e["output_tokens"]) for e in entries) == fake.billed_completion_tokens
    for key in await redis_client.keys("lbp:{team-a}:*:minute:*") + await redis_client.keys(
        "lbp:{team-a}:tenant:hour:*"
    ):
        window = await _meters(redis_client, key)
        assert all(v == 0 for k, v in window.items() if k.startswith("resv:")), (key, window)
        assert window.get("used:requests", 0) <= 40 and window.get("used:output_tokens", 0) <= 900
