"""Store faults: Redis down between reserve and settle, a journal left by a dead process, and a
Redis restart from its AOF. The bill stays equal to the provider's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from proxy.errors import StoreError, StoreRejected
from proxy.journal import Journal, store_tag
from proxy.journal_lines import DEAD_LETTERS, PendingSettlement
from proxy.logs import CALL_LOGGER, TRUSTED_FIELDS
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.state import STATE
from proxy.store import Scope
from tests.conftest import KEY_A, Proxy, ProxyFactory, slow_stream, unreachable_port, until_upstream_received
from tests.fake_upstream import FakeUpstream

LEDGER = "lbp:{team-a}:ledger"
LEASES = "lbp:{team-a}:leases"


@contextlib.asynccontextmanager
async def replaying(url: str, journal_dir: Path) -> AsyncIterator[tuple[RedisStore, Journal]]:
    """A store with its scripts loaded and a journal on ``journal_dir``, both closed after."""
    store = RedisStore.from_url(url)
    await store.load_scripts()
    journal = Journal(journal_dir)
    try:
        yield store, journal
    finally:
        journal.close()
        await store.close()


async def held_reservations(redis_client: aioredis.Redis, *ids: str) -> None:
    """Reservation records of team-a as a reserve leaves them, for journaled settles to find."""
    for rid in ids:
        await redis_client.hset(f"lbp:{{team-a}}:resv:{rid}", mapping={"amounts": "1 3 4 7 0 1", "born": "-"})


async def wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def _call_lines(caplog: pytest.LogCaptureFixture, count: int) -> bool:
    return sum(r.name == CALL_LOGGER for r in caplog.records) >= count


async def journaling_proxy(
    make_proxy: ProxyFactory, redis: RedisServerProcess, tmp_path: Path
) -> tuple[Proxy, Path]:
    """A proxy on a Redis of the test's own, its journal replayed every 0.1 s."""
    journal_dir = tmp_path / "journal"
    proxy = await make_proxy(
        redis={"url": redis.url, "socket_timeout_s": 1},
        journal_dir=str(journal_dir),
        limits={"journal_replay_s": 0.1},
    )
    return proxy, journal_dir


async def leased_stream(
    session: aiohttp.ClientSession,
    proxy: Proxy,
    fake: FakeUpstream,
    client: aioredis.Redis,
    run: str,
    *,
    chunks: int,
) -> asyncio.Future[aiohttp.ClientResponse]:
    """A slow stream, reserved and its lease in Redis, that the upstream answers once the test
    calls ``fake.release()``: a fault the test brings about before that comes before the settle
    (a stream already under way may end first on a loaded machine)."""
    body, headers = slow_stream(run, chunks=chunks, delay_s=0.05)
    body["fake"]["hold"] = True
    received = len(fake.received)
    resp = asyncio.ensure_future(session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers))
    await until_upstream_received(fake, received + 1)
    assert await client.zcard(LEASES) == 1
    return resp


async def test_redis_down_between_reserve_and_settle_is_journaled_and_applied_once(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=CALL_LOGGER)
    proxy, journal_dir = await journaling_proxy(make_proxy, own_redis, tmp_path)
    async with aiohttp.ClientSession() as session:
        pending = await leased_stream(session, proxy, fake, own_client, "outage", chunks=20)
        await asyncio.to_thread(own_redis.stop)  # graceful: the reservation is in the AOF
        fake.release()
        rest = await (await pending).read()
    assert rest.endswith(b"data: [DONE]\n\n")  # the client got its whole answer
    (journal_file,) = journal_dir.glob("journal-*.jsonl")
    (line,) = journal_file.read_text().splitlines()
    assert json.loads(line)["entry"]["output_tokens"] == "20"
    # The call's log line says it is not in the ledger yet (journaled), with its real figures.
    await wait_for(lambda: _call_lines(caplog, 1))
    (call_line,) = [r.__dict__[TRUSTED_FIELDS] for r in caplog.records if r.name == CALL_LOGGER]
    assert call_line["settled"] is False
    assert call_line["outcome"] == "ok" and call_line["output_tokens"] == 20
    # Replayed within most of the marker's life after the last confirmation of its lease, it
    # bills even if the store lost the reservation; later, only if the reservation is there.
    until = json.loads(line)["bill_if_lost_until_ms"]
    assert time.time() * 1000 < until < (time.time() + 3600) * 1000

    metrics = proxy.app[STATE].metrics
    # The spend counters count what the ledger holds: not yet this call, journaled.
    assert _counted(metrics.requests) == 0 and _counted(metrics.store_errors) == 1
    await wait_for(_gauge_reads(metrics.journal_pending, 1))  # the outage's backlog, at a round
    await asyncio.to_thread(own_redis.start)
    await wait_for(lambda: _ledger_len(own_client, 1))
    await wait_for(_gauge_reads(metrics.journal_pending, 0))
    await asyncio.sleep(0.3)  # more replay rounds: still applied once
    # Counted once, when the replay wrote its entry.
    assert _counted(metrics.requests) == 1
    assert _counted(metrics.tokens, type="output", source="provider") == 20
    ((_, entry),) = await own_client.xrange(LEDGER)
    assert entry["outcome"] == "ok" and entry["usage_source"] == "provider"
    assert int(entry["input_tokens"]) == fake.bill[0].prompt_tokens
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens == 20
    assert await own_client.zcard(LEASES) == 0
    run = await own_client.hgetall("lbp:{team-a}:run:outage")
    assert run["used:requests"] == "1" and run["resv:total_tokens"] == "0"
    assert journal_file.read_text() == ""


@pytest.mark.parametrize("outage_s", [2.0, 4.5])
async def test_after_an_outage_longer_than_the_lease_the_journal_bills_before_any_reaper(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
    outage_s: float,
) -> None:
    """A call whose lease ran out while Redis was down is billed at the provider's figures, which
    the process that served it journaled: another instance's reaper (polling every 0.1 s, the
    journal replayed every second) waits ``reap_grace_s`` after a lease ran out and after it
    reached Redis again; before, it billed the call at its reserve first. The longer outage ends
    past the lease's own grace (1.5 s lease, 2 s grace)."""
    upstreams = {
        "openai": {
            "base_url": fake.base_url,
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": 1,
            "connect_timeout_s": 1,
        }
    }
    # A socket timeout below two thirds of the lease (1 s), the grace past it and a replay.
    redis = {"url": own_redis.url, "socket_timeout_s": 0.9}
    limits = {"journal_replay_s": 1.0, "lease_margin_s": 0.5}
    serving = await make_proxy(
        redis=redis, upstreams=upstreams, journal_dir=str(tmp_path / "j1"), limits=limits
    )
    await make_proxy(  # the other instance: its reaper only
        redis=redis,
        upstreams=upstreams,
        journal_dir=str(tmp_path / "j2"),
        limits={**limits, "reaper_interval_s": 0.1, "reap_grace_s": 2},
    )
    async with aiohttp.ClientSession() as session:
        pending = await leased_stream(session, serving, fake, own_client, "outage", chunks=10)
        await asyncio.to_thread(own_redis.stop)
        fake.release()
        assert (await (await pending).read()).endswith(b"data: [DONE]\n\n")
    await asyncio.sleep(outage_s)  # the lease (1 s + 0.5 s) runs out while Redis is down
    await asyncio.to_thread(own_redis.start)
    await wait_for(lambda: _ledger_len(own_client, 1))
    await asyncio.sleep(0.5)
    ((_, entry),) = await own_client.xrange(LEDGER)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens == 10
    assert await own_client.zcard(LEASES) == 0


def _counted(family: Any, **labels: str) -> float:
    """The sum of a metric family's values over the label sets that match ``labels``."""
    return sum(
        value.value
        for names, value in family.items()
        if all(dict(zip(family.labelnames, names, strict=True)).get(k) == v for k, v in labels.items())
    )


def _gauge_reads(family: Any, value: float) -> Callable[[], Awaitable[bool]]:
    async def reads() -> bool:
        return bool(_counted(family) == value)

    return reads


async def _ledger_len(client: aioredis.Redis, n: int) -> bool:
    try:
        return len(await client.xrange(LEDGER)) == n
    except aioredis.ConnectionError:
        return False


async def test_calls_while_redis_is_down_are_refused_without_an_upstream_call(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 0.5})
    await asyncio.to_thread(own_redis.stop)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "store_unavailable"
        async with session.get(proxy.url + "/readyz") as resp:
            assert resp.status == 503
            # Says why, but not where the store is (the page needs no key).
            assert await resp.json() == {"status": "unavailable", "store": "unreachable"}
        await asyncio.to_thread(own_redis.start)
        async with session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp:
            assert resp.status == 200  # no restart of the proxy needed once the store is back
        async with session.get(proxy.url + "/readyz") as resp:
            assert resp.status == 200
    assert len(fake.bill) == 1


async def test_a_dead_process_journal_is_replayed_once_by_a_new_process(
    make_proxy: ProxyFactory, own_redis: RedisServerProcess, own_client: aioredis.Redis, tmp_path: Path
) -> None:
    journal_dir = tmp_path / "journal"
    store = RedisStore.from_url(own_redis.url)
    scope = Scope(name="run", key="lbp:{team-a}:run:orphan")
    await store.reserve(
        tenant="team-a",
        reservation_id="orphan-1",
        run_id="orphan",
        scopes=[scope],
        amounts={"requests": 1, "input_tokens": 9, "output_tokens": 10, "total_tokens": 19, "concurrent": 1},
        lease_ms=600_000,
        record="{}",
    )
    await store.close()
    dead = Journal(journal_dir)
    dead.append(
        PendingSettlement(
            tenant="team-a",
            reservation_id="orphan-1",
            run_id="orphan",
            scope_keys=[scope.key],
            actual={"requests": 1, "input_tokens": 4, "output_tokens": 8, "total_tokens": 12},
            entry={"request_id": "orphan-req", "outcome": "ok", "output_tokens": "8"},
        )
    )
    assert dead._file is not None
    dead._file.close()  # the process died: its lock is gone, its file stays

    await make_proxy(
        redis={"url": own_redis.url}, journal_dir=str(journal_dir), limits={"journal_replay_s": 0.1}
    )
    await wait_for(lambda: _ledger_len(own_client, 1))
    await make_proxy(
        redis={"url": own_redis.url}, journal_dir=str(journal_dir), limits={"journal_replay_s": 0.1}
    )
    await asyncio.sleep(0.3)
    assert len(await own_client.xrange(LEDGER)) == 1
    assert not dead.path.exists()
    run = await own_client.hgetall("lbp:{team-a}:run:orphan")
    assert run["used:total_tokens"] == "12" and run["resv:total_tokens"] == "0"


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_redis_restart_from_aof_keeps_ledger_and_meters(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    how: str,
) -> None:
    proxy = await make_proxy(redis={"url": own_redis.url})
    client = proxy.client()
    for _ in range(3):
        await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Run-Id": "durable"},
        )
    before_ledger = await own_client.xrange(LEDGER)
    before_run = await own_client.hgetall("lbp:{team-a}:run:durable")
    if how == "kill":
        await asyncio.sleep(1.5)  # appendfsync everysec: a crash loses at most the last second
        await asyncio.to_thread(own_redis.kill)
    else:
        await asyncio.to_thread(own_redis.stop)
    await asyncio.to_thread(own_redis.start)
    await wait_for(lambda: _ledger_len(own_client, 3))
    assert await own_client.xrange(LEDGER) == before_ledger
    assert await own_client.hgetall("lbp:{team-a}:run:durable") == before_run


async def test_a_reservation_lost_mid_call_is_billed_by_the_live_settle(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """As when a failed-over Redis master took the reserve with it: the call went out, so its
    settle bills it (tagged reservation=lost) rather than taking it for settled. The scope keys
    lost with it come back with the TTLs a reserve gives them."""
    proxy = await make_proxy(tiers={"standard": {"windows": [{"period": "hour", "requests": 100}]}})
    body, headers = slow_stream("lost", chunks=10, delay_s=0.05)
    body["fake"]["hold"] = True  # answered once the reservation is lost, not raced against it
    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        )
        await until_upstream_received(fake, 1)
        (record,) = await redis_client.keys("lbp:{team-a}:resv:*")
        (window,) = await redis_client.keys("lbp:{team-a}:key:a-ci:hour:*")
        assert await redis_client.ttl(window) > 3600
        await redis_client.delete(record, window, "lbp:{team-a}:run:lost")
        fake.release()
        assert (await (await pending).read()).endswith(b"data: [DONE]\n\n")
    assert await redis_client.hget(window, "used:requests") == "1"
    assert await redis_client.ttl(window) > 3600  # a window key: kept a week past its window
    # A run key: limits.run_ttl_s (a week by default), as a reserve gives it.
    assert 7 * 24 * 3600 - 100 < await redis_client.ttl("lbp:{team-a}:run:lost") <= 7 * 24 * 3600
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["reservation"] == "lost" and entry["outcome"] == "ok"
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens == 10
    assert (await redis_client.hgetall(record))["settled"] == "1"


async def test_a_journaled_settle_bills_a_lost_reservation_only_within_its_window(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    store = RedisStore.from_url(redis_server.url)
    try:
        now_ms = int(time.time() * 1000)

        def line(rid: str, until_ms: int) -> PendingSettlement:
            return PendingSettlement(
                tenant="team-a",
                reservation_id=rid,
                run_id="window",
                scope_keys=["lbp:{team-a}:run:window"],
                actual={"requests": 1, "total_tokens": 7},
                entry={"request_id": rid, "outcome": "ok"},
                bill_if_lost_until_ms=until_ms,
            )

        # Too late: a reaper may have settled it and its marker may be gone.
        assert await line("late", now_ms - 1).apply(store) is None
        assert await line("never", 0).apply(store) is None  # a release, or an older line
        assert await redis_client.xrange(LEDGER) == []
        assert await line("in-time", now_ms + 60_000).apply(store) is not None
        ((_, entry),) = await redis_client.xrange(LEDGER)
        assert entry["request_id"] == "in-time" and entry["reservation"] == "lost"
        # Applied again (its reply was lost, say): billed once, and told which entry it wrote.
        again = await line("in-time", now_ms + 60_000).apply(store)
        assert [entry_id for entry_id, _ in await redis_client.xrange(LEDGER)] == [again]
    finally:
        await store.close()


async def test_journal_lines_of_other_versions_are_applied_and_unreadable_ones_parked(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """Across an upgrade or a rollback, a journal written by another version still settles: fields
    this version does not know are left out, fields it added are defaulted. A line it cannot
    read at all is parked for an operator with the rejected ones, never dropped."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    store = RedisStore.from_url(redis_server.url)
    try:
        lines = []
        for rid, extra in (("newer", {"from_a_later_version": [1, 2]}), ("older", None)):
            scope = Scope(name="run", key=f"lbp:{{team-a}}:run:{rid}")
            await store.reserve(
                tenant="team-a",
                reservation_id=rid,
                run_id=rid,
                scopes=[scope],
                amounts={"requests": 1, "total_tokens": 19, "concurrent": 1},
                lease_ms=600_000,
                record="{}",
            )
            line = asdict(
                PendingSettlement(
                    tenant="team-a",
                    reservation_id=rid,
                    run_id=rid,
                    scope_keys=[scope.key],
                    actual={"requests": 1, "total_tokens": 12},
                    entry={"request_id": rid, "outcome": "ok"},
                )
            )
            if extra is None:  # written before these fields existed
                del line["scope_ttls_s"], line["bill_if_lost_until_ms"]
            else:
                line.update(extra)
            lines.append(json.dumps(line))
        lines.insert(1, '{"tenant": "team-a", "truncated')
        orphan = journal_dir / "journal-999999-dead.jsonl"
        orphan.write_text("\n".join(lines) + "\n")

        journal = Journal(journal_dir)
        assert await journal.replay(store) == 3
        journal.close()
    finally:
        await store.close()
    assert sorted(e["request_id"] for _, e in await redis_client.xrange(LEDGER)) == ["newer", "older"]
    assert not orphan.exists()
    assert (journal_dir / DEAD_LETTERS).read_text() == lines[1] + "\n"


async def test_a_settle_refused_while_redis_is_out_of_memory_is_replayed_once_memory_is_back(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    proxy, journal_dir = await journaling_proxy(make_proxy, own_redis, tmp_path)
    async with aiohttp.ClientSession() as session:
        pending = await leased_stream(session, proxy, fake, own_client, "oom", chunks=10)
        await own_client.config_set("maxmemory", "1")  # over its limit: writes get -OOM
        fake.release()
        rest = await (await pending).read()
        assert rest.endswith(b"data: [DONE]\n\n")
        await asyncio.sleep(0.5)  # replays meet -OOM too
        assert await own_client.xlen(LEDGER) == 0
        await own_client.config_set("maxmemory", "0")
    # A passing condition, not a refusal of the settlement: replayed, not parked.
    await wait_for(lambda: own_client.xlen(LEDGER), timeout_s=5)
    assert not (journal_dir / DEAD_LETTERS).exists()
    ((_, entry),) = await own_client.xrange(LEDGER)
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens
    assert await own_client.zcard(LEASES) == 0


async def test_a_replica_refusing_writes_is_a_passing_error_on_both_clients(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
) -> None:
    # A client still on a master that failed over gets -READONLY: the pipelined client sees
    # the reply as sent, redis-py (rediss://, Cluster) as its ReadOnlyError without the code.
    # (The master's sync at once, not after its default 5 s wait for more replicas.)
    (delay_s,) = (await redis_client.config_get("repl-diskless-sync-delay")).values()
    await redis_client.config_set("repl-diskless-sync-delay", 0)
    await own_client.execute_command("REPLICAOF", "127.0.0.1", str(redis_server.port))
    piped = RedisStore.from_url(own_redis.url)
    plain = RedisStore(aioredis.Redis.from_url(own_redis.url, decode_responses=True))
    try:
        await wait_for(lambda: _link_up(own_client))
        for store in (piped, plain):
            with pytest.raises(StoreError) as raised:
                await store.settle(
                    tenant="t",
                    reservation_id="r1",
                    run_id="run",
                    scope_keys=["lbp:{t}:run:run"],
                    actual={"requests": 1, "input_tokens": 1},
                    entry={"a": "b"},
                    bill_if_lost=True,
                    scope_ttls_s=[0],
                )
            assert not isinstance(raised.value, StoreRejected), raised.value
    finally:
        await piped.close()
        await plain.close()
        await own_client.execute_command("REPLICAOF", "NO", "ONE")
        await redis_client.config_set("repl-diskless-sync-delay", delay_s)
        # A replica rewrites its AOF after a sync, and refuses a SIGTERM until it has: the
        # fixture's stop would wait for it 10 s, then kill it.
        await wait_for(lambda: _aof_written(own_client))


async def _aof_written(client: aioredis.Redis) -> bool:
    info = await client.info("persistence")
    return not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled")


async def _link_up(client: aioredis.Redis) -> bool:
    return bool((await client.info("replication")).get("master_link_status") == "up")


async def test_a_settle_that_cannot_be_journaled_still_delivers_the_answer(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """Redis down at the settle and the journal unwritable (a full or read-only disk): the call
    is still billed (its reservation stays; a reaper bills it at its reserve once Redis is back)
    and the answer still goes out. It was a retryable 500: the SDK's retry paid for it twice."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # the journal's directory cannot be made
    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 1},
        journal_dir=str(blocker / "journal"),
        limits={"lease_margin_s": 0.5, "reaper_interval_s": 0.2},
    )
    # The upstream holds the answer until Redis is stopped: before the settle.
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "fake": {"hold": True}}
    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(
            session.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
            )
        )
        await until_upstream_received(fake, 1)  # reserved; the call is at the upstream
        await asyncio.to_thread(own_redis.stop)
        fake.release()
        async with await pending as resp:
            status, answer = resp.status, await resp.json()
    assert status == 200 and answer["object"] == "chat.completion"
    await asyncio.to_thread(own_redis.start)
    for _ in range(100):
        if await own_client.xlen(LEDGER):
            break
        await asyncio.sleep(0.1)
    ((_, entry),) = await own_client.xrange(LEDGER)
    assert entry["outcome"] == "lease_expired" and entry["usage_source"] == "reserve"
    assert len(fake.bill) == 1


def _settlement_line(reservation_id: str) -> dict[str, Any]:
    return asdict(
        PendingSettlement(
            tenant="team-a",
            reservation_id=reservation_id,
            run_id="r1",
            scope_keys=["lbp:{team-a}:run:r1"],
            actual={
                "requests": 1,
                "input_tokens": 3,
                "output_tokens": 4,
                "total_tokens": 7,
                "cost_micros": 0,
            },
            entry={"reservation_id": reservation_id, "outcome": "ok", "tenant": "team-a", "run_id": "r1"},
            bill_if_lost_until_ms=int(time.time() * 1000) + 600_000,
            scope_ttls_s=[3600],
            runlog_ttl_s=3600,
        )
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("actual", None), ("scope_keys", None), ("scope_ttls_s", None), ("actual", [1, 2]), ("entry", None)],
)
async def test_a_journal_line_of_the_wrong_shape_is_parked_and_the_rest_applied(
    field: str, value: object, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    # JSON with a null where a list goes failed every replay round: the lines after it were
    # never applied and the file never went.
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    bad = _settlement_line("bad-1")
    bad[field] = value
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"  # a dead process's
    orphan.write_text(json.dumps(bad) + "\n" + json.dumps(_settlement_line("good-1")) + "\n")
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        await journal.replay(store)
    assert [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)] == ["good-1"]
    assert not orphan.exists()
    assert "bad-1" in (journal_dir / DEAD_LETTERS).read_text()


async def test_a_journal_is_replayed_only_into_the_store_it_belongs_to(
    tmp_path: Path, redis_server: RedisServerProcess, own_redis: RedisServerProcess, redis_client: Any
) -> None:
    # Two proxies of two stores sharing a journal directory (the default one, relative to where
    # they start): one's journaled settle was adopted by the other, the call billed in both
    # stores (as a lost reservation there) and its real figures never reached its own.
    mine, theirs = RedisStore.from_url(redis_server.url), RedisStore.from_url(own_redis.url)
    scope = Scope(name="run", key="lbp:{team-a}:run:shared-dir")
    amounts = {"requests": 1, "input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "concurrent": 1}
    try:
        await mine.reserve(
            tenant="team-a",
            reservation_id="shared",
            run_id="shared-dir",
            scopes=[scope],
            amounts=amounts,
            lease_ms=600_000,
            record="{}",
        )
        dead = Journal(tmp_path, store_url=redis_server.url)
        dead.append(
            PendingSettlement(
                tenant="team-a",
                reservation_id="shared",
                run_id="shared-dir",
                scope_keys=[scope.key],
                actual={"requests": 1, "total_tokens": 2},
                entry={"outcome": "ok"},
                bill_if_lost_until_ms=int(time.time() * 1000) + 600_000,
            )
        )
        dead.close()  # its writer died: the file is its store's processes' to adopt
        other = Journal(tmp_path, store_url=own_redis.url)
        assert await other.replay(theirs) == 0
        assert await theirs.client.xlen("lbp:{team-a}:ledger") == 0
        # The same store, its password given in the address or not: the same journal.
        user, _, rest = redis_server.url.partition("://")
        own = Journal(tmp_path, store_url=f"{user}://:secret@{rest}")
        assert await own.replay(mine) == 1
        assert list(tmp_path.glob("journal-*.jsonl")) == []
    finally:
        await mine.close()
        await theirs.close()


@pytest.mark.parametrize(
    ("one", "same"),
    [
        ("redis://db.example:6379", "redis://db.example:6379/"),
        ("redis://db.example:6379", "redis://db.example"),
        ("redis://db.example:6379/0", "redis://db.example:6379?db=0"),
        ("redis://db.example:6379/0", "redis://db.example:6379/0?socket_timeout=5"),
        ("redis://:old@db.example:6379/0", "redis://user:new@DB.example:6379/0"),
        ("unix:///run/redis.sock?db=0", "unix://:pw@/run/redis.sock"),
    ],
)
def test_a_store_written_another_way_keeps_its_journals(one: str, same: str) -> None:
    # A config edit that leaves the store as it is (a slash, the default port, a password
    # rotated) stranded the journals of the processes before it.
    assert store_tag(one) == store_tag(same)


def test_other_stores_have_other_journals() -> None:
    tags = {
        store_tag(url) for url in ("redis://h:6379/0", "redis://h:6379/1", "redis://h:6380/0", "redis://g/0")
    }
    assert len(tags) == 4


async def test_a_journaled_settle_whose_first_try_ran_is_counted_once_when_replayed(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A settle whose reply was lost (it ran) goes to the journal. Its replay finds the marker
    its first try left and gets that try's entry: the replay counts it (the spend metrics), as
    the live settle would have. It was taken for a reaper's, and never counted."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    line = _settlement_line("lost-reply-1")
    await held_reservations(redis_client, "lost-reply-1")
    counted: list[Any] = []
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        first = await PendingSettlement(**line).apply(store)  # the try whose reply was lost
        assert first is not None
        orphan = journal_dir / "journal-99999-deadbeef.jsonl"
        orphan.write_text(json.dumps(line) + "\n")
        await journal.replay(store, counted.append)
        await journal.replay(store, counted.append)  # nothing left: nothing counted again
    ((entry_id, entry),) = await redis_client.xrange(LEDGER)  # billed once
    assert entry_id == first and entry["reservation_id"] == "lost-reply-1"
    assert [c["reservation_id"] for c in counted] == ["lost-reply-1"]  # counted once


async def test_a_replay_round_cut_short_does_not_count_its_applied_lines_again(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    first = _settlement_line("cut-1")
    second = {**_settlement_line("cut-2"), "tenant": "team-b", "scope_keys": ["lbp:{team-b}:run:r1"]}
    second["entry"] = {**second["entry"], "tenant": "team-b"}
    await held_reservations(redis_client, "cut-1")
    await redis_client.hset("lbp:{team-b}:resv:cut-2", mapping={"amounts": "1 3 4 7 0 1", "born": "-"})
    # A user that may not touch team-b's keys yet: its settle fails with NOPERM, a store error
    # that passes (the round stops there, to be tried again).
    await redis_client.execute_command("ACL", "SETUSER", "rv6", "on", ">pw", "+@all", "~lbp:{team-a}:*")
    url = redis_server.url.replace("redis://", "redis://rv6:pw@")
    store = RedisStore.from_url(url)
    await store.load_scripts()
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"  # a dead process's
    orphan.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    journal = Journal(journal_dir)
    counted: list[Any] = []
    try:
        await journal.replay(store, counted.append)  # cut-1 applied, cut-2 refused: stops
        assert [c["reservation_id"] for c in counted] == ["cut-1"]
        assert orphan.exists()
        await redis_client.execute_command("ACL", "SETUSER", "rv6", "allkeys")
        await journal.replay(store, counted.append)  # both again: cut-1 was applied before
    finally:
        journal.close()
        await store.close()
        await redis_client.execute_command("ACL", "DELUSER", "rv6")
    assert sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)) == ["cut-1"]
    assert not orphan.exists()
    assert [c["reservation_id"] for c in counted] == ["cut-1", "cut-2"]  # now: cut-1 counted twice


async def test_calls_while_redis_cannot_be_connected_to_are_refused_together_not_one_after_another(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Redis unreachable with connects that hang (a host gone, a firewall dropping SYNs; here a
    full accept queue): every call waiting for the store should get its 503 within about one
    socket timeout. The pipelined connection let each waiting call make its own connect attempt
    in turn, under one lock: the 30th caller waited 30 timeouts (15 s at 0.5 s) for its 503, and
    the proxy's throughput fell to one call per timeout."""
    with unreachable_port("connect_timeout") as port:
        proxy = await make_proxy(redis={"url": f"redis://127.0.0.1:{port}/0", "socket_timeout_s": 0.5})
        proxy.app[STATE].registered_tenants["team-a"] = 2**62  # registered before the outage
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

        async def one(session: aiohttp.ClientSession) -> int:
            async with session.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
            ) as resp:
                await resp.read()
                return resp.status

        started = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            statuses = await asyncio.gather(*(one(session) for _ in range(30)))
        took = time.monotonic() - started
    assert statuses == [503] * 30
    assert fake.received == []
    # Generous, for a loaded machine: 24 socket timeouts; one after another they take 30 (15 s).
    assert took < 12, f"30 calls took {took:.1f} s to be refused"


async def test_a_line_parked_by_a_replay_is_counted_for_the_operator(
    make_proxy: ProxyFactory, own_redis: RedisServerProcess, tmp_path: Path
) -> None:
    """A journal line the store will never take, or no version can read, waits in the dead
    letters for an operator: only the log said so, so nothing an alert could watch."""
    proxy, journal_dir = await journaling_proxy(make_proxy, own_redis, tmp_path)
    journal_dir.mkdir(parents=True, exist_ok=True)
    (journal_dir / "journal-999999-deadbeef.jsonl").write_text('{"tenant": "team-a", "torn\n')
    metrics = proxy.app[STATE].metrics
    await wait_for(_gauge_reads(metrics.journal_parked, 1))
    assert (journal_dir / DEAD_LETTERS).read_text() == '{"tenant": "team-a", "torn\n'
    await asyncio.sleep(0.3)  # more replay rounds: parked once
    assert _counted(metrics.journal_parked) == 1
    assert _counted(metrics.journal_pending) == 0  # a dead process's lines are not this one's
