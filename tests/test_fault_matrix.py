"""Client and upstream faults beyond the outcome matrix: 429s, huge chunks, slow bodies, early
disconnects, oversized events, leases renewed by live streams, reload by file check."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
import yaml

import proxy.app as app_module
from proxy.redis_server import RedisServerProcess, free_port
from proxy.state import STATE
from tests.conftest import (
    KEY_A,
    UPSTREAM_KEY,
    Proxy,
    ProxyFactory,
    base_config,
    leave_once_upstream_received,
)
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess

LEDGER = "lbp:{team-a}:ledger"
MSGS: list[Any] = [{"role": "user", "content": "hi"}]
AUTH = {"Authorization": f"Bearer {KEY_A}"}


async def only_entry(client: aioredis.Redis, timeout_s: float = 5.0) -> dict[str, str]:
    for _ in range(int(timeout_s / 0.05)):
        entries = await client.xrange(LEDGER)
        if entries:
            ((_, fields),) = entries
            return dict(fields)
        await asyncio.sleep(0.05)
    raise AssertionError("no ledger entry")


@pytest.mark.parametrize("error_body", ["json", "none"])
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_429_is_passed_on_and_costs_nothing(
    proxy: Any, fake: FakeUpstream, redis_client: aioredis.Redis, error_body: str, stream: bool
) -> None:
    client = proxy.client()
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MSGS,
            stream=stream,
            extra_body={"fake": {"mode": "error", "status": 429, "error_body": error_body}},
        )
    assert caught.value.status_code == 429
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "upstream_4xx" and entry["upstream_status"] == "429"
    assert entry["input_tokens"] == entry["output_tokens"] == "0"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_huge_chunk_passes_through_and_is_billed(
    proxy: Any, fake: FakeUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    content = "x" * 1_000_000
    client = proxy.client()
    fake_ctl = {"content": content, "chunk_chars": len(content)}
    if stream:
        got = ""
        s = await client.chat.completions.create(
            model="gpt-4o-mini", messages=MSGS, stream=True, extra_body={"fake": fake_ctl}
        )
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                got += chunk.choices[0].delta.content
    else:
        reply = await client.chat.completions.create(
            model="gpt-4o-mini", messages=MSGS, extra_body={"fake": fake_ctl}
        )
        got = reply.choices[0].message.content or ""
    assert got == content
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "ok" and int(entry["output_tokens"]) == fake.bill[0].completion_tokens


async def test_an_event_larger_than_the_limit_is_an_upstream_error(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(limits={"max_upstream_body_bytes": 4096})
    body = {
        "model": "gpt-4o-mini",
        "messages": MSGS,
        "stream": True,
        "fake": {"content": "y" * 10_000, "chunk_chars": 10_000},
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
            text = (await resp.read()).decode()
    assert "event: error" in text and "upstream_error" in text
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "upstream_error" and entry["usage_source"] == "reserve"


async def test_a_body_sent_slowly_is_billed_normally(
    proxy: Any, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    payload = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "slow body"}]}'

    async def dribble() -> Any:
        for i in range(0, len(payload), 10):
            yield payload[i : i + 10]
            await asyncio.sleep(0.02)

    async with aiohttp.ClientSession() as session:
        async with session.post(
            proxy.url + "/v1/chat/completions",
            data=dribble(),
            headers={**AUTH, "Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 200
    assert (await only_entry(redis_client))["outcome"] == "ok"


async def test_client_gone_before_a_non_streaming_answer_is_still_billed(
    proxy: Any, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    body = {
        "model": "gpt-4o-mini",
        "messages": MSGS,
        "fake": {"hold": True},  # answered once the client has left, however slow the machine
    }
    async with aiohttp.ClientSession() as session:
        await leave_once_upstream_received(
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=AUTH), fake
        )
    # The proxy serves on this loop: it reads the client's FIN (on loopback, at once) in a turn of
    # the loop well before this timer's.
    await asyncio.sleep(0.3)
    fake.release()
    entry = await only_entry(redis_client, timeout_s=5)
    assert entry["outcome"] == "client_disconnected" and entry["usage_source"] == "provider"
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens


async def test_many_idle_connections_do_not_block_calls(
    proxy: Any, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(100)]
    try:
        for _reader, writer in idle[:50]:  # half of them start a request and never finish it
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            await writer.drain()
        reply = await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=MSGS)
        assert reply.choices[0].finish_reason == "stop"
    finally:
        for _reader, writer in idle:
            writer.close()
    assert len(fake.bill) == 1


async def stream_beside_a_reaper(
    raw: dict[str, Any], tmp_path: Path, redis_client: aioredis.Redis, fake_ctl: dict[str, Any]
) -> None:
    """A stream through one proxy while another's reaper runs: it must end whole and be billed
    from the provider's usage, never reaped."""
    procs = [ProxyProcess(raw, tmp_path).start(), ProxyProcess(raw, tmp_path).start()]
    try:
        tokens = fake_ctl["reply_tokens"]
        body = {
            "model": "gpt-4o-mini",
            "messages": MSGS,
            "stream": True,
            "max_tokens": tokens,
            "fake": fake_ctl,
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(procs[0].url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
                text = await resp.read()
        assert text.endswith(b"data: [DONE]\n\n")
    finally:
        for proc in procs:
            proc.stop()
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "ok" and entry["usage_source"] == "provider"


async def test_a_live_stream_renews_its_lease_and_is_not_reaped(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    raw = base_config(fake.base_url, redis_server.url)
    raw["upstreams"]["openai"]["timeout_s"] = 1
    # lease 1.5 s, stream ~4 s; the store's timeout below two thirds of the lease
    raw["limits"] = {**raw["limits"], "lease_margin_s": 0.5, "reaper_interval_s": 0.1}
    raw["redis"]["socket_timeout_s"] = 0.9
    await stream_beside_a_reaper(raw, tmp_path, redis_client, {"reply_tokens": 40, "chunk_delay_s": 0.1})


async def test_a_live_stream_keeps_its_run_key_alive(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A stream outliving its run key's TTL: the key would go with the reserve it holds, and the
    settle would release it from a key that no longer holds it. Each renewal gives it its TTL again."""
    raw = base_config(fake.base_url, redis_server.url)
    raw["upstreams"]["openai"]["timeout_s"] = 1
    raw["limits"] = {"lease_margin_s": 0.5}  # lease 1.5 s: renewed every 0.5 s
    raw["redis"]["socket_timeout_s"] = 0.9  # below two thirds of the lease
    proc = ProxyProcess(raw, tmp_path).start()
    run_key = "lbp:{team-a}:run:long-stream"
    try:
        body = {"model": "gpt-4o-mini", "messages": MSGS, "stream": True, "max_tokens": 20}
        body["fake"] = {"reply_tokens": 40, "chunk_delay_s": 0.1}  # about 4 s
        headers = {**AUTH, "X-Run-Id": "long-stream"}
        async with aiohttp.ClientSession() as session:
            async with session.post(proc.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.content.readany()
                assert await redis_client.expire(run_key, 3)  # late in its life
                for _ in range(50):  # until a renewal (every 0.5 s), within the key's 3 s left
                    await asyncio.sleep(0.05)
                    ttl = await redis_client.ttl(run_key)
                    if ttl > 3000:
                        break
                meters = await redis_client.hgetall(run_key)  # still streaming: its reserve held
                await resp.read()
    finally:
        proc.stop()
    assert ttl > 3000, ttl  # the run TTL (default) again, not what was left
    assert meters["resv:concurrent"] == "1"


async def test_a_stream_silent_for_longer_than_its_lease_keeps_it(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """Renewal runs on a timer, not on reads: reads until just before the first renewal is due,
    then a silence shorter than the stall timeout but longer than the lease left."""
    raw = base_config(fake.base_url, redis_server.url)
    raw["upstreams"]["openai"]["timeout_s"] = 8  # lease 8.3 s, renewed every 2.77 s
    raw["limits"] = {**raw["limits"], "lease_margin_s": 0.3, "reaper_interval_s": 0.1}
    fake_ctl = {
        "reply_tokens": 24,
        "chunk_delay_s": 0.1,
        "mode": "stall_mid_stream",
        "after_chunks": 20,  # reads for about 2 s
        # Back at about 8.5 s: past the first lease, 1.5 s before the stall timeout (0.4 s under
        # it left a loaded machine no room).
        "stall_s": 6.5,
    }
    await stream_beside_a_reaper(raw, tmp_path, redis_client, fake_ctl)


async def test_reload_by_file_check_without_a_signal(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    raw = base_config(fake.base_url, redis_server.url, tiers={"standard": {"run": {"requests": 1}}})
    proc = ProxyProcess(raw, tmp_path).start()
    try:
        async with aiohttp.ClientSession() as session:

            async def status() -> int:
                body = {"model": "gpt-4o-mini", "messages": MSGS}
                async with session.post(
                    proc.url + "/v1/chat/completions", json=body, headers={**AUTH, "X-Run-Id": "poll"}
                ) as resp:
                    return resp.status

            assert await status() == 200
            assert await status() == 429
            raw["tiers"] = {"standard": {"run": {"requests": 2}}}
            raw["listen"] = {"host": "127.0.0.1", "port": proc.port}
            raw["journal_dir"] = str(tmp_path / "journal")
            proc.config_path.write_text(yaml.safe_dump(raw))
            for _ in range(200):  # polled every 2 s
                await asyncio.sleep(0.1)
                if "config reloaded" in proc.log_path.read_text():
                    break
            assert await status() == 200
            assert await status() == 429
    finally:
        proc.stop()


async def test_start_warns_when_redis_keeps_nothing_on_disk(
    make_proxy: ProxyFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    volatile = RedisServerProcess(tmp_path / "volatile", port=free_port(), appendonly=False)
    volatile.start()
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.app"):
            await make_proxy(redis={"url": volatile.url})
        assert any("keeps nothing on disk" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="proxy.app"):
            await make_proxy()  # the session server runs with AOF
        assert not any("keeps nothing on disk" in r.getMessage() for r in caplog.records)
    finally:
        volatile.stop()
    assert UPSTREAM_KEY not in caplog.text


def drops_keys(proxy: Proxy, policy: str) -> float | None:
    return proxy.app[STATE].metrics.registry.get_sample_value(
        "llm_proxy_store_drops_keys", {"policy": policy}
    )


def eviction_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "may drop the proxy's keys" in r.getMessage()]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
async def test_start_warns_when_redis_may_evict_the_proxys_keys(
    make_proxy: ProxyFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """Under memory pressure such a Redis drops keys (volatile-*: those with a TTL, as a budget
    window's counter and a lease have): a ceiling starts again from zero and is overspent."""
    evicting = RedisServerProcess(
        tmp_path / "evicting",
        port=free_port(),
        extra_args=("--maxmemory", "100mb", "--maxmemory-policy", policy),
    )
    evicting.start()
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.app"):
            proxy = await make_proxy(redis={"url": evicting.url})
        (record,) = eviction_warnings(caplog)
        assert f"maxmemory-policy is {policy}" in record.getMessage()
        assert "noeviction" in record.getMessage() and record.__dict__["policy"] == policy
        assert drops_keys(proxy, policy) == 1
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="proxy.app"):
            proxy = await make_proxy()  # the session server: noeviction, as the embedded one
        assert not eviction_warnings(caplog)
        assert drops_keys(proxy, "noeviction") == 0 and drops_keys(proxy, policy) is None
    finally:
        evicting.stop()


async def test_a_policy_changed_on_a_live_redis_is_noticed(
    make_proxy: ProxyFactory,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(app_module, "CLOCK_SYNC_S", 0.05)
    with caplog.at_level(logging.WARNING, logger="proxy.app"):
        proxy = await make_proxy(redis={"url": own_redis.url})
        assert drops_keys(proxy, "noeviction") == 0
        await own_client.config_set("maxmemory", "100mb")
        await own_client.config_set("maxmemory-policy", "allkeys-lfu")
        for _ in range(200):
            if drops_keys(proxy, "allkeys-lfu") == 1:
                break
            await asyncio.sleep(0.05)
        assert drops_keys(proxy, "allkeys-lfu") == 1 and drops_keys(proxy, "noeviction") is None
    (record,) = eviction_warnings(caplog)
    assert record.__dict__["policy"] == "allkeys-lfu"


async def test_a_redis_down_at_start_is_read_once_it_answers(
    make_proxy: ProxyFactory,
    own_redis: RedisServerProcess,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(app_module, "CLOCK_SYNC_S", 0.05)
    own_redis.stop()
    with caplog.at_level(logging.WARNING, logger="proxy.app"):
        proxy = await make_proxy(redis={"url": own_redis.url})
        assert drops_keys(proxy, "allkeys-random") is None
        own_redis.extra_args = ("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-random")
        own_redis.start()
        for _ in range(200):
            if drops_keys(proxy, "allkeys-random") == 1:
                break
            await asyncio.sleep(0.05)
        assert drops_keys(proxy, "allkeys-random") == 1
    (record,) = eviction_warnings(caplog)
    assert record.__dict__["policy"] == "allkeys-random"


async def test_a_redis_down_at_start_that_keeps_nothing_on_disk_is_warned_of_once_it_answers(
    make_proxy: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A proxy started before its Redis (a container started first, a Redis restarting) read the
    persistence settings once, after a ping that failed, never again (the store faults hunt):
    a Redis with neither AOF nor RDB then served calls, its ledger lost on its next restart,
    unwarned. Read once it answers (as the eviction policy is), and warned of once."""
    monkeypatch.setattr(app_module, "CLOCK_SYNC_S", 0.05)
    volatile = RedisServerProcess(tmp_path / "volatile", port=free_port(), appendonly=False)

    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "keeps nothing on disk" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="proxy.app"):
        await make_proxy(redis={"url": volatile.url, "socket_timeout_s": 0.5})
        assert any("store unreachable at start" in r.getMessage() for r in caplog.records)
        volatile.start()
        try:
            for _ in range(100):
                if warnings():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # ten more turns of the loop that read it
        finally:
            volatile.stop()
    assert len(warnings()) == 1, [r.getMessage() for r in caplog.records]


async def test_client_gone_right_after_the_last_chunk_is_billed_once(
    proxy: Any, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    body = {"model": "gpt-4o-mini", "messages": MSGS, "stream": True, "fake": {"reply_tokens": 5}}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.url + "/v1/chat/completions", json=body, headers=AUTH)
        seen = b""
        while b'"finish_reason":"stop"' not in seen:
            seen += await resp.content.readuntil(b"\n\n")
        resp.close()  # before [DONE]
    entry = await only_entry(redis_client)
    assert entry["outcome"] in ("ok", "client_disconnected")
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens
    assert entry["usage_source"] == "provider"


@pytest.mark.parametrize("run_ttl_s", [3600, 0])
async def test_a_run_expires_after_its_last_call_unless_kept_for_ever(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, run_ttl_s: int
) -> None:
    # A call without X-Run-Id is a run of its own: its meters and ledger index must not stay
    # in Redis for ever. The tenant ledger keeps the entry either way.
    proxy = await make_proxy(limits={"run_ttl_s": run_ttl_s})
    await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=MSGS)
    entry = await only_entry(redis_client)
    run = entry["run_id"]
    for key in (f"lbp:{{team-a}}:run:{run}", f"lbp:{{team-a}}:runlog:{run}"):
        ttl = await redis_client.ttl(key)
        assert (3500 < ttl <= 3600) if run_ttl_s else ttl == -1, (key, ttl)
