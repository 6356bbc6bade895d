"""Health, readiness and graceful shutdown of real proxy processes."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from proxy.app import build_app, server_options
from proxy.config_load import parse_config
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from proxy.tokenizer import Tokenizer
from proxy.workers import GC_YOUNG_THRESHOLD
from tests.conftest import (
    KEY_A,
    UPSTREAM_KEY,
    ProxyFactory,
    base_config,
    busy_script,
    refused_port,
    slow_stream,
    unread_at,
    until_redis_busy,
    until_redis_has_unread,
)
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess

LEDGER = "lbp:{team-a}:ledger"


async def read_all(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except aiohttp.ClientPayloadError:
        return b""


async def test_sigterm_lets_an_inflight_stream_finish_and_refuses_new_calls(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    raw = base_config(fake.base_url, redis_server.url, shutdown_grace_s=20)
    proc = ProxyProcess(raw, tmp_path).start()
    try:
        body, headers = slow_stream("graceful", chunks=30)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proc.url + "/v1/chat/completions", json=body, headers=headers)
            await resp.content.readuntil(b"\n\n")
            proc.signal(signal.SIGTERM)
            # Until the process has handled the signal (a fixed 0.3 s is short on a loaded machine).
            refused = False
            for _ in range(40):
                try:
                    async with aiohttp.ClientSession() as fresh, fresh.get(proc.url + "/healthz") as probe:
                        await probe.read()
                except aiohttp.ClientConnectionError:
                    refused = True
                    break
                await asyncio.sleep(0.05)
            assert refused, "a new connection was accepted during shutdown"
            rest = await read_all(resp)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.to_thread(proc.wait) == 0
    finally:
        proc.stop()
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["outcome"] == "ok" and entry["usage_source"] == "provider"
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens


async def test_sigterm_past_the_grace_period_settles_the_cut_stream(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    raw = base_config(fake.base_url, redis_server.url, shutdown_grace_s=0.5)
    proc = ProxyProcess(raw, tmp_path).start()
    try:
        body, headers = slow_stream("cut", chunks=100)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proc.url + "/v1/chat/completions", json=body, headers=headers)
            await resp.content.readuntil(b"\n\n")
            proc.signal(signal.SIGTERM)
            await read_all(resp)
        assert await asyncio.to_thread(proc.wait) == 0
    finally:
        proc.stop()
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["outcome"] == "shutdown" and entry["usage_source"] == "reserve"
    assert entry["output_tokens"] == "100"
    assert await redis_client.zcard("lbp:{team-a}:leases") == 0


async def test_health_and_readiness(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/healthz") as resp:
            assert resp.status == 200
        async with session.get(proxy.url + "/readyz") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ready"


async def test_store_down_at_start_gives_503_and_no_upstream_call(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(redis={"url": f"redis://127.0.0.1:{refused_port()}/0", "socket_timeout_s": 0.5})
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/readyz") as resp:
            assert resp.status == 503
        body, headers = slow_stream("nostore")
        async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert error["code"] == "store_unavailable"
    assert fake.received == []


BILLING_VIEWS = ["/v1/billing/runs/r1", "/v1/billing/runs/r1/ledger", "/v1/billing/keys/self"]


@pytest.mark.parametrize("path", BILLING_VIEWS)
async def test_the_billing_views_answer_503_while_the_store_is_down(
    make_proxy: ProxyFactory, path: str
) -> None:
    proxy = await make_proxy(redis={"url": f"redis://127.0.0.1:{refused_port()}/0", "socket_timeout_s": 0.5})
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + path, headers={"Authorization": f"Bearer {KEY_A}"}) as resp:
            assert resp.status == 503
            assert resp.headers["retry-after"] == "1"
            assert resp.headers["x-request-id"]
            error = (await resp.json())["error"]
            assert (error["code"], error["type"]) == ("store_unavailable", "service_unavailable")


async def test_two_workers_share_the_port_and_stop_together(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    proc = ProxyProcess(
        base_config(fake.base_url, redis_server.url), tmp_path, args=("--workers", "2")
    ).start()

    def listening() -> set[str]:
        return {line for line in proc.log_path.read_text().splitlines() if '"msg":"listening"' in line}

    try:
        # /readyz answered as soon as one worker was up: give the other its start-up time.
        for _ in range(200):
            if len(listening()) == 2:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> int:
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"call {i}"}]}
                async with session.post(
                    proc.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
                ) as resp:
                    await resp.read()
                    return resp.status

            statuses = await asyncio.gather(*(one(i) for i in range(40)))
        assert statuses == [200] * 40
        proc.signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait) == 0
    finally:
        proc.stop()
    entries = await redis_client.xrange(LEDGER)
    assert len(entries) == 40 == len(fake.bill)
    lines = [json.loads(line) for line in listening()]
    assert len(lines) == 2
    # Each worker froze what it built at start-up out of the collector's scans.
    assert all(line["gc_frozen_objects"] > 10_000 for line in lines)
    assert all(line["gc_thresholds"][0] == GC_YOUNG_THRESHOLD for line in lines)


async def test_a_served_process_refuses_huge_headers_in_openai_format(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    proc = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path).start()
    try:
        async with aiohttp.ClientSession() as session:
            body, headers = slow_stream("big-headers")
            async with session.post(
                proc.url + "/v1/chat/completions", json=body, headers={**headers, "X-Padding": "p" * 20_000}
            ) as resp:
                assert resp.status == 431
                assert (await resp.json())["error"]["code"] == "headers_too_large"
        assert "Failed to create request handler" not in proc.log_path.read_text()
    finally:
        proc.stop()
    assert fake.received == []


async def test_a_call_cut_during_its_settle_is_settled_and_recorded_once(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """Shutdown past its grace period cancels a handler whose settle waits on a paused Redis: the
    settle it started goes on and shutdown waits for it; no second (``shutdown``) settle, and the
    metrics and log line say what the ledger says."""
    raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    app = build_app(config, tokenizer=Tokenizer({}))
    runner = web.AppRunner(app, shutdown_timeout=0.3, **server_options(config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
    body, headers = slow_stream("cut-settle", chunks=5, delay_s=0.05)
    cleanup: asyncio.Task[None] | None = None
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url, json=body, headers=headers)
            await resp.content.readuntil(b"\n\n")  # reserved and forwarded
            # Every client waits 1.5 s from here: the settle at the stream's end is held.
            await redis_client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
            events = b""
            while b'"finish_reason":"stop"' not in events:  # [DONE] waits for the settle
                events += await resp.content.readuntil(b"\n\n")
            cleanup = asyncio.create_task(runner.cleanup())
            await read_all(resp)
        await cleanup
    finally:
        if cleanup is None:
            await runner.cleanup()
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["outcome"] == "ok" and entry["usage_source"] == "provider"
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens
    registry = app[STATE].metrics.registry
    assert registry.get_sample_value("llm_proxy_requests_total", labels(outcome="ok")) == 1
    assert registry.get_sample_value("llm_proxy_requests_total", labels(outcome="shutdown")) is None
    assert app[STATE].settling == set()
    assert await redis_client.zcard("lbp:{team-a}:leases") == 0


def labels(**overrides: str) -> dict[str, str]:
    return {"tenant": "team-a", "model": "gpt-4o-mini", "endpoint": "chat.completions", **overrides}


async def test_a_reserve_cut_by_shutdown_is_released_not_reaped(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """Shutdown past its grace period cancels a call whose reserve script is on its way: the
    script may still run (here: once a busy Redis gets to it), and the call never goes out. It
    is released through the journal, not left for a reaper to bill at its reserve."""
    # No reaper round while Redis is busy: the only command then waiting on it is the reserve.
    raw = base_config(
        fake.base_url, redis_server.url, shutdown_grace_s=0.5, limits={"reaper_interval_s": 600}
    )
    proc = ProxyProcess(raw, tmp_path).start()
    busy = aioredis.Redis.from_url(redis_server.url)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    try:
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "first"}
            async with session.post(proc.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200  # the tenant is registered: the next call's first write is its reserve
            spin = busy_script(4)
            blocking = asyncio.ensure_future(busy.eval(spin, 0))
            assert redis_server.port is not None
            await until_redis_busy(redis_server.port)
            headers["X-Run-Id"] = "cut"
            waiting = unread_at(redis_server.port)  # the PING that found Redis busy, say
            cut = asyncio.ensure_future(
                session.post(proc.url + "/v1/chat/completions", json=body, headers=headers)
            )
            # The call reaches its reserve, which waits behind the script.
            await until_redis_has_unread(redis_server.port, besides=waiting)
            proc.signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait) == 0
            cut.cancel()
            await blocking
    finally:
        proc.stop()
        await busy.aclose()
    assert len(fake.received) == 1  # the cut call never went out
    # Released by the journal's last replay before the process went (it waits for Redis), else
    # by the next process on the same journal.
    again = ProxyProcess(raw, tmp_path).start()
    try:
        for _ in range(100):
            if await redis_client.zcard("lbp:{team-a}:leases") == 0:
                break
            await asyncio.sleep(0.05)
    finally:
        again.stop()
    assert await redis_client.zcard("lbp:{team-a}:leases") == 0
    meters = await redis_client.hgetall("lbp:{team-a}:run:cut")
    assert all(int(v) == 0 for k, v in meters.items() if k.startswith("resv:")), meters
    spent = {k: v for k, v in meters.items() if k.startswith("used:") and k != "used:requests"}
    assert not any(int(v) for v in spent.values()), meters
    # Its reserve did run (a release finding no reservation writes no entry), and was released.
    outcomes = [entry["outcome"] for _, entry in await redis_client.xrange(LEDGER)]
    assert outcomes[1:] == ["not_forwarded"]


async def test_a_last_journal_replay_the_full_disk_fails_still_closes_the_journal(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shutdown's last replay let only a StoreError by: an OSError (a full disk refusing the
    file's rewrite) escaped it and the journal was never closed (its queued syncs not waited
    for, a removed file's pending lines not written again)."""
    raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    app = build_app(config, tokenizer=Tokenizer({}))
    runner = web.AppRunner(app, shutdown_timeout=0.3, **server_options(config))
    await runner.setup()
    journal = app[STATE].journal
    closed: list[bool] = []
    close = journal.close

    async def full(*args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device")

    def closing() -> None:
        closed.append(True)
        close()

    monkeypatch.setattr(journal, "replay", full)
    monkeypatch.setattr(journal, "close", closing)
    await runner.cleanup()
    assert closed == [True]
