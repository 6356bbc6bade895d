"""Store trouble in the middle of a call: failed lease renewals, a reserve whose reply is lost,
a journal written to while it is replayed; and run ids that a client cannot merge."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from proxy.journal import Journal
from proxy.journal_lines import PendingSettlement
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.store import Scope
from tests.conftest import KEY_A, ProxyFactory, busy_script, until_redis_busy
from tests.fake_upstream import FakeUpstream

LEDGER = "lbp:{team-a}:ledger"
LEASES = "lbp:{team-a}:leases"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
MSGS: list[Any] = [{"role": "user", "content": "hi"}]


async def until(predicate: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        try:
            if await predicate():
                return
        except aioredis.ConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_redis_lost_during_a_renewing_stream_does_not_break_it(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 0.3},
        upstreams={"openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 1}},
        limits={"lease_margin_s": 0.5, "journal_replay_s": 0.1, "reaper_interval_s": 60},
    )
    body = {
        "model": "gpt-4o-mini",
        "messages": MSGS,
        "stream": True,
        "max_tokens": 30,
        "fake": {"reply_tokens": 30, "chunk_delay_s": 0.1},
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        resp = await session.post(proxy.url + "/v1/chat/completions", json=body, headers=AUTH)
        await resp.content.readuntil(b"\n\n")
        await asyncio.to_thread(own_redis.stop)  # renewals every 0.5 s now fail
        text = await resp.read()
    assert text.endswith(b"data: [DONE]\n\n")  # the client got its whole answer, no hang
    await asyncio.to_thread(own_redis.start)
    await until(lambda: _count(own_client, 1))
    ((_, entry),) = await own_client.xrange(LEDGER)
    assert entry["outcome"] == "ok" and entry["usage_source"] == "provider"
    assert entry["output_tokens"] == "30"
    assert await own_client.zcard(LEASES) == 0


async def _count(client: aioredis.Redis, n: int) -> bool:
    return len(await client.xrange(LEDGER)) == n


@pytest.mark.parametrize("journal", ["writable", "unwritable"])
async def test_a_reserve_whose_reply_is_lost_is_released_not_charged(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
    journal: str,
) -> None:
    extra: dict[str, Any] = {}
    if journal == "unwritable":
        # The release cannot be journaled (a full disk): still a 503 (was a 500), and the
        # reserve, which happened, is reaped at its reserve (nobody can tell it never went out).
        (tmp_path / "a-file").write_text("x")
        extra = {"journal_dir": str(tmp_path / "a-file" / "journal")}
    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 0.3},
        limits={"journal_replay_s": 0.1, "lease_margin_s": 0.5, "reaper_interval_s": 0.2},
        **extra,
    )
    await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=MSGS)  # warm up
    await own_client.delete(LEDGER)
    fake.received.clear()
    # A busy script holds the server for 3 s: our reserve waits behind it, times out on our
    # side, and then runs all the same.
    busy = busy_script(3)
    blocker = aioredis.Redis.from_url(own_redis.url)
    hold = asyncio.create_task(blocker.eval(busy, 0))
    assert own_redis.port is not None
    await until_redis_busy(own_redis.port)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "gpt-4o-mini", "messages": MSGS},
            headers={**AUTH, "X-Run-Id": "lost-reply"},
        ) as resp:
            assert resp.status == 503
    await hold
    await blocker.aclose()
    assert fake.received == []  # nothing went out
    await until(lambda: _count(own_client, 1))
    ((_, entry),) = await own_client.xrange(LEDGER)
    assert await own_client.zcard(LEASES) == 0
    if journal == "unwritable":
        assert entry["outcome"] == "lease_expired"
        return
    assert entry["outcome"] == "not_forwarded" and entry["total_tokens"] == "0"
    run = await own_client.hgetall("lbp:{team-a}:run:lost-reply")
    assert run["resv:total_tokens"] == "0" and run["resv:concurrent"] == "0"
    assert run.get("used:requests", "0") == "0"


async def test_lines_appended_during_a_replay_survive_it(
    own_redis: RedisServerProcess, own_client: aioredis.Redis, tmp_path: Path
) -> None:
    store = RedisStore.from_url(own_redis.url)
    scope = Scope(name="run", key="lbp:{team-a}:run:j")
    journal = Journal(tmp_path / "journal")
    amounts = {"requests": 1, "input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "concurrent": 1}
    pending = []
    for rid in ("j1", "j2", "j3"):
        await store.reserve(
            tenant="team-a",
            reservation_id=rid,
            run_id="j",
            scopes=[scope],
            amounts=amounts,
            lease_ms=600_000,
            record="{}",
        )
        pending.append(
            PendingSettlement(
                tenant="team-a",
                reservation_id=rid,
                run_id="j",
                scope_keys=[scope.key],
                actual={"requests": 1, "total_tokens": 2},
                entry={"outcome": "ok"},
            )
        )
    journal.append(pending[0])
    journal.append(pending[1])
    replay = asyncio.create_task(journal.replay(store))
    await asyncio.sleep(0)  # the replay is now waiting on the store
    journal.append(pending[2])
    assert await replay == 2
    lines = journal.path.read_text().splitlines()
    assert [json.loads(line)["reservation_id"] for line in lines] == ["j3"]
    assert await journal.replay(store) == 1
    assert len(await own_client.xrange(LEDGER)) == 3
    journal.close()
    await store.close()


async def test_a_repeated_x_request_id_does_not_merge_runs(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers={"standard": {"run": {"requests": 1}}})
    client = proxy.client()
    for _ in range(2):
        reply = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Request-Id": "gateway-fixed-id"}
        )
        assert reply.headers["x-request-id"] == "gateway-fixed-id"
    assert len(fake.bill) == 2


async def test_models_list_is_bounded_and_scrubbed(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "note": "key sk-upstream-secret"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        proxy = await make_proxy(upstreams={"openai": {"base_url": url, "api_key_env": "TEST_UPSTREAM_KEY"}})
        async with aiohttp.ClientSession() as session:
            async with session.get(proxy.url + "/v1/models", headers=AUTH) as resp:
                body = await resp.text()
        assert resp.status == 200 and "sk-upstream-secret" not in body and "[REDACTED]" in body
    finally:
        await runner.cleanup()
