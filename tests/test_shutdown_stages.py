"""A call cut or repeated at a stage of its path (the openai SDK's own retries, shutdown),
checked against the fake upstream's own bill: one ledger entry per call that went
out, billed; nothing billed for one that never went out; nothing left reserved."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from proxy.app import build_app, server_options
from proxy.config_load import parse_config
from proxy.redis_server import RedisServerProcess
from proxy.tokenizer import Tokenizer
from tests.cluster import RedisClusterProcesses
from tests.conftest import (
    KEY_A,
    UPSTREAM_KEY,
    Proxy,
    base_config,
    slow_stream,
    unreachable_port,
    until_upstream_received,
)
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess

LEDGER = "lbp:{team-a}:ledger"
LEASES = "lbp:{team-a}:leases"
MSGS: list[Any] = [{"role": "user", "content": "hi there"}]
AUTH = {"Authorization": f"Bearer {KEY_A}"}


async def books(proxy: Proxy, fake: FakeUpstream, client: aioredis.Redis) -> list[dict[str, str]]:
    """The ledger once it holds an entry per call the upstream got and nothing is held; every
    meter's reserved fields back to 0."""
    deadline = time.monotonic() + 10
    while True:
        await proxy.recorded()
        entries = [dict(f) for _, f in await client.xrange(LEDGER)]
        leases = await client.zcard(LEASES)
        if (len(entries) >= fake.calls and not leases) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert leases == 0, "a reservation was left"
    async for key in client.scan_iter("lbp:{team-a}:*"):
        if ":resv:" not in key and await client.type(key) == "hash":
            held = {
                k: v for k, v in (await client.hgetall(key)).items() if k.startswith("resv:") and v != "0"
            }
            assert not held, (key, held)
    return entries


ShuttingProxy = Callable[..., Awaitable[tuple[Proxy, web.AppRunner]]]


@pytest.fixture
def shutting_proxy(fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path) -> ShuttingProxy:
    """A proxy served in this process whose shutdown (``runner.cleanup()``) the test starts,
    with a grace period of ``grace_s``."""

    async def make(grace_s: float, **overrides: Any) -> tuple[Proxy, web.AppRunner]:
        raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"), **overrides)
        config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
        app = build_app(config, tokenizer=Tokenizer({}))
        runner = web.AppRunner(app, shutdown_timeout=grace_s, **server_options(config))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return Proxy(url=url, app=app, config=config, runner=runner), runner

    return make


async def test_sigterm_ends_inflight_calls_after_the_grace_period_not_twice_it(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """README: SIGTERM "lets in-flight calls finish for shutdown_grace_s, ends and settles the
    rest". aiohttp waits its ``shutdown_timeout`` twice for a running handler (for it to end,
    then again once it failed the request's body) before it cancels it: passed the grace as it
    was, a live stream ran twice the grace, past a supervisor's stop timeout sized on it (killed
    then: unsettled, reaped at its reserve, its stream cut without its bill)."""
    grace_s = 2.0
    raw = base_config(fake.base_url, redis_server.url, shutdown_grace_s=grace_s)
    raw["upstreams"]["openai"]["timeout_s"] = 60
    proc = ProxyProcess(raw, tmp_path).start()
    try:
        body, headers = slow_stream("graced", chunks=600, delay_s=0.05)  # 30 s of stream
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proc.url + "/v1/chat/completions", json=body, headers=headers)
            await resp.content.readuntil(b"\n\n")
            proc.signal(signal.SIGTERM)
            signalled = time.monotonic()
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await resp.read()
            cut_after_s = time.monotonic() - signalled
        assert await asyncio.to_thread(proc.wait) == 0
    finally:
        proc.stop()
    # At the grace, with a loaded machine's slack; not at twice it (4 s at the least).
    assert grace_s * 0.9 <= cut_after_s < grace_s * 1.75, (
        f"cut {cut_after_s:.1f} s after SIGTERM (grace {grace_s} s)"
    )
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["outcome"] == "shutdown"
    assert await redis_client.zcard(LEASES) == 0


async def test_a_call_cut_by_shutdown_while_connecting_upstream_is_not_billed(
    shutting_proxy: ShuttingProxy, redis_client: aioredis.Redis
) -> None:
    """A call still connecting to its upstream when shutdown ends it never went out (README: a
    connection never made bills nothing, source none, not a request). It was billed its whole
    reserve as ``shutdown``, a request made."""
    with unreachable_port("connect_timeout") as port:
        upstream = {
            "base_url": f"http://127.0.0.1:{port}/v1",
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": 30,
            "connect_timeout_s": 20,
        }
        proxy, runner = await shutting_proxy(0.3, upstreams={"openai": upstream})
        body = {"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 50}
        async with aiohttp.ClientSession() as session:
            url = proxy.url + "/v1/chat/completions"
            call = asyncio.ensure_future(session.post(url, json=body, headers={**AUTH, "X-Run-Id": "conn"}))
            deadline = time.monotonic() + 10
            while not await redis_client.zcard(LEASES):  # reserved: on to its connect, which hangs
                assert time.monotonic() < deadline, "never reserved"
                await asyncio.sleep(0.02)
            await runner.cleanup()
            with contextlib.suppress(aiohttp.ClientError):
                await call
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["outcome"] == "shutdown"
    assert entry["usage_source"] == "none", entry
    assert entry["input_tokens"] == entry["output_tokens"] == entry["cost_micros"] == "0", entry
    assert await redis_client.zcard(LEASES) == 0
    run = await redis_client.hgetall("lbp:{team-a}:run:conn")
    assert run.get("used:requests", "0") == "0", run  # not a request made
    assert all(v == "0" for k, v in run.items() if k.startswith("resv:")), run


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["before_headers", "mid_stream"])
async def test_a_call_cut_by_shutdown_once_out_is_billed_and_the_sdk_retries_go_nowhere(
    shutting_proxy: ShuttingProxy, fake: FakeUpstream, redis_client: aioredis.Redis, stream: bool, where: str
) -> None:
    """The other side of the one above: a call that went out (its upstream answering, or not
    yet) is billed when shutdown cuts it, and the SDK's retries of the cut call reach no upstream."""
    proxy, runner = await shutting_proxy(0.3)
    ctl: dict[str, Any] = {"hold": True}
    if where == "mid_stream":
        ctl = {"reply_tokens": 50, "chunk_delay_s": 0.05}
    client = proxy.client(max_retries=2)

    async def call() -> Any:
        create = client.chat.completions.create
        if stream:
            chunks = await create(
                model="gpt-4o-mini", messages=MSGS, max_tokens=50, stream=True, extra_body={"fake": ctl}
            )
            return [chunk async for chunk in chunks]
        return await create(model="gpt-4o-mini", messages=MSGS, max_tokens=50, extra_body={"fake": ctl})

    task = asyncio.ensure_future(call())
    await until_upstream_received(fake, 1)
    await runner.cleanup()
    fake.release()
    with contextlib.suppress(openai.APIError):
        await task
    entries = [dict(f) for _, f in await redis_client.xrange(LEDGER)]
    assert fake.calls == 1 and len(entries) == 1, entries
    assert entries[0]["usage_source"] != "none", entries
    assert int(entries[0]["output_tokens"]) > 0, entries
    assert await redis_client.zcard(LEASES) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_each_try_of_an_sdk_that_times_out_is_billed_once(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """The SDK gives up on a slow answer and sends the call again, twice: three calls went out,
    three ledger entries, the upstream's figures (drained to the end), nothing left reserved."""
    client = proxy.client(max_retries=2, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MSGS,
            max_tokens=5,
            stream=stream,
            extra_body={"fake": {"delay_s": 1.0}},
        )
    deadline = time.monotonic() + 10
    while len(await redis_client.xrange(LEDGER)) < 3:
        assert time.monotonic() < deadline, "not every try was billed"
        await asyncio.sleep(0.05)
    entries = await books(proxy, fake, redis_client)
    assert fake.calls == len(entries) == 3, entries
    assert {e["outcome"] for e in entries} == {"client_disconnected"}
    assert sum(int(e["output_tokens"]) for e in entries) == fake.billed_completion_tokens
    assert sum(int(e["input_tokens"]) for e in entries) == fake.billed_prompt_tokens


async def test_shutdown_waits_for_a_settle_as_long_as_the_store_timeout_in_force(
    fake: FakeUpstream, cluster: RedisClusterProcesses, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a Cluster (and over rediss://) redis-py runs every command with the URL's
    ``socket_timeout`` over ``redis.socket_timeout_s``. Shutdown waited for the settles under
    way a bound made of the field's timeout (4 x 0.25 + 1 s here), not the one in force (4 s): a
    settle the store held 3 s was given up on at 2 s ("settlements still under way at exit")
    and the store closed under it, though it would have landed."""
    url = f"{cluster.url}?socket_timeout=4"
    raw = base_config(fake.base_url, url, journal_dir=str(tmp_path / "journal"))
    raw["redis"] = {"url": url, "cluster": True, "socket_timeout_s": 0.25}
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    runner = web.AppRunner(build_app(config, tokenizer=Tokenizer({})), shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url_of_proxy = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
    master = aioredis.Redis.from_url(cluster.master_of("team-a").url, decode_responses=True)
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 50, "fake": {"hold": True}}
    try:
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(
                session.post(url_of_proxy, json=body, headers={**AUTH, "X-Run-Id": "held"})
            )
            await until_upstream_received(fake, 1)
            await master.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # the settle waits 3 s
            fake.release()
            await asyncio.sleep(0.3)  # the answer read, its settle sent
            with caplog.at_level("ERROR", logger="proxy"):
                await runner.cleanup()
            with contextlib.suppress(aiohttp.ClientError):
                (await call).release()
        assert "settlements still under way at exit" not in caplog.text
        entries = [dict(f) for _, f in await master.xrange(LEDGER)]
        assert [e["usage_source"] for e in entries if e["run_id"] == "held"] == ["provider"], entries
    finally:
        await master.aclose()
