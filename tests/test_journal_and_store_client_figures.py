"""The settle journal and the store's client, pinned where a hunt of hand mutants found them
unwatched: which journals a process adopts, that a replay cut by a cancel stops there, what a
replayed line writes and counts, the syncs that make a line durable, and what the pipelined
connection and the failure classes say of a command that failed."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError, MaxConnectionsError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.errors import StoreError, StoreRejected
from proxy.journal import Journal, store_tag
from proxy.journal_lines import DEAD_LETTERS, REPLAY_WINDOW, PendingSettlement
from proxy.redis_failures import SENT_BEFORE, never_sent, transient
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.resp import ConnectionLost, PipelinedConnection, RespError
from tests.conftest import busy_script, refused_port, until_redis_busy
from tests.test_journal import HeldSyncs, _line
from tests.test_journal_lines import GatedStore
from tests.test_redis_failures import Send, reply_error
from tests.test_store_faults import LEDGER, _settlement_line, held_reservations, replaying

# ---- which journals a process takes ----


def test_a_socket_path_spelled_another_way_is_the_same_store() -> None:
    # redis-py connects to the same socket: a dead process's journal must be replayed, not left.
    assert store_tag("unix:///run/redis/../redis/redis.sock") == store_tag("unix:///run/redis/redis.sock")
    assert store_tag("unix:///run//redis/./redis.sock") == store_tag("unix:///run/redis/redis.sock")


async def test_a_journal_of_no_store_adopts_a_tagged_orphan(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A journal opened without a store URL (a tool, an older version) adopts any orphan, tagged
    or not: it has no store of its own to tell apart."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    await held_reservations(redis_client, "tagged")
    orphan = journal_dir / f"journal-{store_tag(redis_server.url)}-99999-deadbeef.jsonl"
    orphan.write_text(json.dumps(_settlement_line("tagged")) + "\n")
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        assert journal.tag is None
        assert await journal.replay(store) == 1
    assert [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)] == ["tagged"]
    assert not orphan.exists()


async def test_an_orphan_another_process_replayed_between_our_open_and_our_lock_is_not_applied_again(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process took the orphan's lock first, applied its line and removed it, between our
    open and our lock: the lock we then get is on a file no longer there, whose line applied
    again would get its entry (settle.lua) and be counted a second time."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    await held_reservations(redis_client, "raced")
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"
    orphan.write_text(json.dumps(_settlement_line("raced")) + "\n")
    real_flock = fcntl.flock

    def flock_after_another_replay(handle: Any, operation: int) -> None:
        if getattr(handle, "name", None) == str(orphan) and orphan.exists():
            orphan.unlink()  # the other process's replay, done just before our lock
        real_flock(handle, operation)

    counted: list[Any] = []
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        assert await _line("raced").apply(store) is not None  # what the other process applied
        monkeypatch.setattr(fcntl, "flock", flock_after_another_replay)
        assert await journal.replay(store, counted.append) == 0
        monkeypatch.undo()
    assert counted == []
    assert await redis_client.xlen(LEDGER) == 1


# ---- a round cut by a cancel ----


async def _cut_replay(
    store: GatedStore, journal: Journal, *, before_cancel: Callable[[], Awaitable[bool]] | None = None
) -> None:
    """Replay until the held line's settle is entered (and ``before_cancel`` holds), then cancel
    the round (a shutdown): the cancel goes on to the caller."""
    round_ = asyncio.ensure_future(journal.replay(store))
    await asyncio.wait_for(store.entered.wait(), 10)
    while before_cancel is not None and not await before_cancel():
        assert not round_.done()
        await asyncio.sleep(0.01)
    round_.cancel()
    store.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await round_


@pytest.mark.parametrize("held_in", ["own file", "orphan"])
async def test_a_replay_cut_by_a_cancel_raises_it_and_takes_no_later_journal(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path, held_in: str
) -> None:
    """Shutdown cancels a round held in a line of its own file or of an orphan: the cancel goes
    on (the round raises it) once the file is rewritten, and no journal after it is taken; a
    round that swallowed it went on applying other journals while the process stopped."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    ids = [f"r{i}" for i in range(9)]  # the store holds r4
    await held_reservations(redis_client, *ids, "later")
    later = journal_dir / "journal-99999-ffffffff.jsonl"  # sorted after the held orphan
    later.write_text(json.dumps(_settlement_line("later")) + "\n")
    store = GatedStore.from_url(redis_server.url)
    await store.load_scripts()
    journal = Journal(journal_dir)
    try:
        if held_in == "own file":
            for rid in ids:
                journal.append(_line(rid))
        else:
            held = journal_dir / "journal-99998-aaaaaaaa.jsonl"
            held.write_text("".join(json.dumps(_settlement_line(rid)) + "\n" for rid in ids))
        await _cut_replay(store, journal)
        assert later.exists()
        assert "later" not in {e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)}
    finally:
        journal.close()
        await store.close()


async def test_a_cancel_swallowed_by_the_store_client_still_stops_the_round_after_its_window(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """The store client swallows the cancel mid-settle (redis-py may: app._stopped): the window
    in flight finishes, and the round stops there; the next window waits for another round."""
    ids = [f"r{i}" for i in range(REPLAY_WINDOW + 3)]  # r4, in the first window, is held
    await held_reservations(redis_client, *ids)
    store = GatedStore.from_url(redis_server.url)
    store.swallows = True
    await store.load_scripts()
    journal = Journal(tmp_path / "journal")
    try:
        for rid in ids:
            journal.append(_line(rid))

        async def only_the_held_line_in_flight() -> bool:
            # The store client's replies read, not the ledger's entries written: an entry in Redis
            # whose reply the round had not read yet was cut by the cancel (seen once in CI).
            return store.settled == REPLAY_WINDOW - 1

        # The cancel reaches the held settle alone, which swallows it: every line of the window goes.
        await _cut_replay(store, journal, before_cancel=only_the_held_line_in_flight)
        assert await redis_client.xlen(LEDGER) == REPLAY_WINDOW
        kept = [json.loads(line)["reservation_id"] for line in journal.path.read_text().splitlines()]
        assert kept == ids[REPLAY_WINDOW:]
        assert journal.pending_lines == 3
    finally:
        journal.close()
        await store.close()


# ---- what a replayed line writes and counts ----


def _orphan_of(journal_dir: Path, *lines: dict[str, Any] | str) -> Path:
    journal_dir.mkdir(exist_ok=True)
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"
    orphan.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return orphan


async def test_a_line_whose_reservation_was_settled_elsewhere_is_applied_but_not_counted(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """No record left and past its window (a reaper billed it): the settle writes nothing, and
    the spend metrics must not count the call a second time."""
    await held_reservations(redis_client, "live")
    reaped = {**_settlement_line("reaped"), "bill_if_lost_until_ms": 0}
    orphan = _orphan_of(tmp_path / "journal", reaped, _settlement_line("live"))
    counted: list[Any] = []
    async with replaying(redis_server.url, tmp_path / "journal") as (store, journal):
        assert await journal.replay(store, counted.append) == 2
    assert [c["reservation_id"] for c in counted] == ["live"]
    assert [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)] == ["live"]
    assert not orphan.exists()


async def test_a_replayed_line_marks_every_context_of_its_call_as_its_tenants(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    await held_reservations(redis_client, "ctx")
    line = {**_settlement_line("ctx"), "owned_contexts": ["resp_1", "resp_2"]}
    _orphan_of(tmp_path / "journal", line)
    async with replaying(redis_server.url, tmp_path / "journal") as (store, journal):
        await journal.replay(store)
    assert await redis_client.mget("lbp:ctxowner:resp_1", "lbp:ctxowner:resp_2") == ["team-a", "team-a"]


async def test_a_context_mark_the_store_rejects_leaves_the_replayed_settle_applied_and_counted(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """The settle is in: a mark the store refuses (a key of the wrong type there) must not park
    the line for an operator to apply again, nor leave the call uncounted."""
    await held_reservations(redis_client, "ctx-refused")
    await redis_client.rpush("lbp:ctxowner:clobbered", "not a string")  # WRONGTYPE for owner.lua
    line = {**_settlement_line("ctx-refused"), "owned_contexts": ["clobbered"]}
    orphan = _orphan_of(tmp_path / "journal", line)
    counted: list[Any] = []
    async with replaying(redis_server.url, tmp_path / "journal") as (store, journal):
        assert await journal.replay(store, counted.append) == 1
    assert [c["reservation_id"] for c in counted] == ["ctx-refused"]
    assert not orphan.exists()
    assert not (tmp_path / "journal" / DEAD_LETTERS).exists()


async def test_a_replayed_line_gives_the_runs_ledger_index_its_ttl(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """No run scope (no budget names the run) to keep the index alive as long as it: the line's
    own TTL does, else the index of every such run stays in the store for good."""
    await held_reservations(redis_client, "ttl")
    line = {**_settlement_line("ttl"), "scope_keys": [], "scope_ttls_s": [], "runlog_ttl_s": 3600}
    _orphan_of(tmp_path / "journal", line)
    async with replaying(redis_server.url, tmp_path / "journal") as (store, journal):
        await journal.replay(store)
    assert 3500 < await redis_client.ttl("lbp:{team-a}:runlog:r1") <= 3600


class StoreClockBehind(RedisStore):
    """The real store, whose clock reads an hour behind this host's (a replay on another host):
    as its clock is measured, the hour is taken off."""

    async def sync_clock(self) -> None:
        await super().sync_clock()
        assert self._clock_offset_s is not None
        self._clock_offset_s -= 3600


async def test_a_lost_reservations_window_is_read_on_the_stores_clock_measured_first(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A line replayed by a process that never measured the store's clock measures it first:
    read on this host's clock, a call still within its window by the store's went unbilled."""
    store = StoreClockBehind.from_url(redis_server.url)
    try:
        line = PendingSettlement(
            **{**_settlement_line("lost"), "bill_if_lost_until_ms": int(time.time() * 1000) - 60_000}
        )
        assert await line.apply(store) is not None  # no record: billed as a lost reservation
    finally:
        await store.close()
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["reservation_id"] == "lost" and entry["reservation"] == "lost"


async def test_a_round_that_cannot_park_an_unreadable_line_keeps_it_and_every_line_after(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """The dead letters cannot be written: the unreadable line and the lines after it stay in the
    orphan for a later round, never dropped with it."""
    journal_dir = tmp_path / "journal"
    await held_reservations(redis_client, "ok-1", "ok-2")
    orphan = _orphan_of(
        journal_dir, _settlement_line("ok-1"), '{"tenant":"team-a","reserv', _settlement_line("ok-2")
    )
    (journal_dir / DEAD_LETTERS).mkdir()  # cannot be appended to
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        await journal.replay(store)
        kept = orphan.read_text().splitlines()
        assert kept[0] == '{"tenant":"team-a","reserv' and json.loads(kept[1])["reservation_id"] == "ok-2"
        (journal_dir / DEAD_LETTERS).rmdir()  # the disk writable again
        await journal.replay(store)
    applied = [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)]
    assert applied == ["ok-1", "ok-2"]
    assert not orphan.exists()
    assert (journal_dir / DEAD_LETTERS).read_text() == '{"tenant":"team-a","reserv\n'


# ---- what makes a line durable ----


@pytest.fixture
def synced_inodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``os.fsync``, recording the inode of each file it syncs."""
    real_fsync = os.fsync
    inodes: list[int] = []

    def recording_fsync(fd: int) -> None:
        inodes.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return inodes


def test_a_line_appended_on_the_loop_is_synced_before_append_returns(
    tmp_path: Path, synced_inodes: list[int]
) -> None:
    # Its caller (a reserve cut by shutdown) is told the line is durable, with no await to wait on.
    journal = Journal(tmp_path / "journal")
    try:
        journal.append(_line("first"))
        journal.append(_line("second"))
        assert synced_inodes.count(journal.path.stat().st_ino) == 2
    finally:
        journal.close()


async def test_a_parked_line_is_synced_before_it_leaves_its_journal(
    redis_server: RedisServerProcess, tmp_path: Path, synced_inodes: list[int]
) -> None:
    # The orphan is removed once its lines went: a parked line not yet on disk went with it.
    orphan = _orphan_of(tmp_path / "journal", "{torn")
    async with replaying(redis_server.url, tmp_path / "journal") as (store, journal):
        await journal.replay(store)
    assert not orphan.exists()
    assert (tmp_path / "journal" / DEAD_LETTERS).stat().st_ino in synced_inodes


async def test_a_sync_of_a_file_a_replay_replaced_covers_no_line_of_the_new_one(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay replaces the journal's file with the lines it left (none here). A sync of the old
    file, queued before the replacement and begun after the next line went to the new one, makes
    that line durable no more than the removal of a file does: it is synced on its own."""
    await held_reservations(redis_client, "held", "old-file")
    syncs = HeldSyncs()
    async with replaying(redis_server.url, tmp_path / "journal") as (store, journal):
        monkeypatch.setattr(os, "fsync", syncs)
        held = asyncio.ensure_future(journal.append_off_loop(_line("held")))
        assert await asyncio.to_thread(syncs.started.wait, 5)
        old_file = asyncio.ensure_future(journal.append_off_loop(_line("old-file")))
        while len(journal.path.read_text().splitlines()) < 2:
            await asyncio.sleep(0.01)
        old_inode = journal.path.stat().st_ino
        assert await journal.replay(store) == 2
        assert journal.path.stat().st_ino != old_inode
        new_file = asyncio.ensure_future(journal.append_off_loop(_line("new-file")))
        while not journal.path.read_text():
            await asyncio.sleep(0.01)
        syncs.go_on.set()
        await asyncio.gather(held, old_file, new_file)
        assert (journal.path.stat().st_ino, journal.path.stat().st_size) in syncs.calls, syncs.calls
        monkeypatch.undo()


async def test_a_journal_closed_after_its_file_was_removed_writes_its_pending_lines_again(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """The directory removed during an outage, and no line appended since: the process's close
    puts the pending lines back where the next process finds them (else: billed at the reserve)."""
    journal_dir = tmp_path / "journal"
    await held_reservations(redis_client, "pending")
    dying = Journal(journal_dir)
    dying.append(_line("pending"))
    shutil.rmtree(journal_dir)
    dying.close()
    assert dying.path.exists()
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        assert await journal.replay(store) == 1
    assert [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)] == ["pending"]


# ---- the pipelined connection: what a failed command says ----


async def test_a_connection_lost_with_a_command_in_flight_fails_it_as_maybe_applied(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    # A settle whose connection drops may have run: taken for one never sent, it is counted twice.
    pipe = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        client_id = await pipe.call("CLIENT", "ID")
        blocked = asyncio.ensure_future(pipe.call("BLPOP", "lbp:test:never-pushed", 0))
        while not any(
            c["id"] == str(client_id) and c["cmd"] == "blpop" for c in await redis_client.client_list()
        ):
            await asyncio.sleep(0.01)
        await redis_client.client_kill_filter(_id=client_id)
        with pytest.raises(ConnectionLost) as lost:
            await blocked
        assert lost.value.sent
    finally:
        await pipe.close()


async def test_a_command_unanswered_past_the_timeout_fails_as_maybe_applied_while_others_follow(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """Redis held by a script: the oldest command waiting is the one overdue, however recently
    the others were sent; it fails, as one that may have run, before Redis answers."""
    assert own_redis.port is not None
    busy = asyncio.ensure_future(own_client.eval(busy_script(2.5), 0))
    await until_redis_busy(own_redis.port)
    pipe = PipelinedConnection(own_redis.url, timeout_s=0.3)
    later: list[asyncio.Future[Any]] = []
    try:
        first = asyncio.ensure_future(pipe.call("PING"))
        while not first.done() and not busy.done():
            later.append(asyncio.ensure_future(pipe.call("PING")))  # sent well within the timeout
            await asyncio.sleep(0.05)
        assert first.done() and not busy.done()  # failed while Redis was still held
        assert isinstance(first.exception(), ConnectionLost)
        assert first.exception().sent  # type: ignore[union-attr]
    finally:
        await asyncio.gather(busy, *later, return_exceptions=True)
        await pipe.close()


async def test_an_idle_connection_outlives_the_timeout(redis_server: RedisServerProcess) -> None:
    # Every command answered: nothing is overdue, and the connection stays (no reconnect per idle spell).
    pipe = PipelinedConnection(redis_server.url, timeout_s=0.2)
    try:
        first = await pipe.call("CLIENT", "ID")
        await asyncio.sleep(0.6)  # three timeouts, the watchdog looking meanwhile
        assert await pipe.call("CLIENT", "ID") == first
    finally:
        await pipe.close()


async def test_the_database_named_in_the_query_is_the_one_written(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    # redis-py reads ?db=; the scripts' connection writing database 0 meanwhile split the store in two.
    assert redis_server.port is not None
    pipe = PipelinedConnection(f"redis://127.0.0.1:{redis_server.port}?db=5", timeout_s=5)
    try:
        await pipe.call("SET", "lbp:test:db", "five")
    finally:
        await pipe.close()
    db5 = aioredis.Redis.from_url(f"redis://127.0.0.1:{redis_server.port}/5", decode_responses=True)
    try:
        assert await db5.get("lbp:test:db") == "five"
        assert await redis_client.get("lbp:test:db") is None
    finally:
        await db5.flushdb()
        await db5.aclose()


# ---- how a failure is told apart ----


@pytest.fixture(params=["redis-py", "resp"])
async def send_to_own(request: pytest.FixtureRequest, own_redis: RedisServerProcess) -> AsyncIterator[Send]:
    """A command sent to the test's own Redis by either client."""
    if request.param == "redis-py":
        client = aioredis.Redis.from_url(own_redis.url)
        yield client.execute_command
        await client.aclose()
    else:
        pipe = PipelinedConnection(own_redis.url, timeout_s=5)
        yield pipe.call
        await pipe.close()


async def test_too_few_replicas_is_not_now(send_to_own: Send, own_client: aioredis.Redis) -> None:
    # A settle refused for it is journaled and replayed once replicas are back, never parked.
    await own_client.config_set("min-replicas-to-write", 1)
    err = await reply_error(send_to_own, "EVAL", "return redis.call('SET', KEYS[1], 'x')", 1, "k")
    assert transient(err)


async def test_a_script_running_too_long_is_not_now(send_to_own: Send, own_client: aioredis.Redis) -> None:
    await own_client.config_set("busy-reply-threshold", 10)
    busy = asyncio.ensure_future(own_client.eval(busy_script(1), 0))
    try:
        while True:  # until the script holds Redis past the threshold: answered BUSY
            try:
                await send_to_own("EVAL", "return 1", 0)
            except (ResponseError, RespError) as refused:
                err = refused
                break
            assert not busy.done(), "never answered BUSY"
    finally:
        await busy
    assert str(err).startswith("BUSY") or not isinstance(err, RespError)
    assert transient(err), err


async def test_a_command_sent_without_the_password_the_server_asks_is_not_now(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    # An operator setting a password on a live Redis: the settles meanwhile are replayed once fixed.
    pipe = PipelinedConnection(own_redis.url, timeout_s=5)
    try:
        await own_client.config_set("requirepass", "now-needed")
        err = await reply_error(pipe.call, "EVAL", "return 1", 0)
    finally:
        await pipe.close()
    assert str(err).startswith("NOAUTH")
    assert transient(err)


@pytest.mark.parametrize(
    "reply",
    [
        "ERR max number of clients reached",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
        "LOADING Redis is loading the dataset in memory",
    ],
)
def test_replies_redis_sends_while_it_cannot_serve_now_are_not_now(reply: str) -> None:
    # As the scripts' connection raises them (redis-py strips or reclasses these): journaled, not parked.
    assert transient(RespError(reply))


async def test_a_cluster_node_serving_no_slot_is_not_now(tmp_path: Path) -> None:
    """A cluster with a slot unserved (a node failing over) answers CLUSTERDOWN: redis-py raises it
    with its code stripped, the scripts' connection with it."""
    server = RedisServerProcess(
        tmp_path / "clusterdown", appendonly=False, extra_args=("--cluster-enabled", "yes")
    )
    await asyncio.to_thread(server.start)
    client = aioredis.Redis.from_url(server.url)
    pipe = PipelinedConnection(server.url, timeout_s=5)
    try:
        for send in (client.execute_command, pipe.call):
            err = await reply_error(send, "EVAL", "return redis.call('GET', KEYS[1])", 1, "k")
            assert transient(err), err
    finally:
        await pipe.close()
        await client.aclose()
        await asyncio.to_thread(server.stop)


def test_a_failure_after_an_earlier_try_went_out_is_never_taken_for_one_never_sent() -> None:
    # The cluster client's retry: its last try refused, the first may have run (settle counted twice).
    refused = RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    setattr(refused, SENT_BEFORE, True)
    assert not never_sent(refused)
    assert not never_sent(_sent_before(MaxConnectionsError()))


def _sent_before(err: Exception) -> Exception:
    setattr(err, SENT_BEFORE, True)
    return err


async def test_a_connect_that_failed_for_any_reason_never_sent_its_command(tmp_path: Path) -> None:
    # redis-py says "connecting to" of every connect that failed: a socket gone, a timeout, a refusal.
    client = aioredis.Redis.from_url(f"unix://{tmp_path / 'no-such.sock'}", socket_connect_timeout=1)
    try:
        with pytest.raises(RedisConnectionError) as caught:
            await client.ping()
    finally:
        await client.aclose()
    assert "Connection refused" not in str(caught.value)
    assert never_sent(caught.value)
    assert never_sent(RedisTimeoutError("Timeout connecting to server"))  # redis-py's connect timeout


async def test_a_settle_refused_while_redis_loads_its_data_never_ran_on_either_client(tmp_path: Path) -> None:
    """LOADING: the command was not run (redis-py raises it as a connection error); a settle
    refused so is not one whose reply was lost, to be counted again when it is replayed."""
    # Clients served every KB of a load: Redis answers LOADING meanwhile.
    options = ("--enable-debug-command", "yes", "--loading-process-events-interval-bytes", "1024")
    server = RedisServerProcess(tmp_path / "loading", appendonly=False, extra_args=options)
    await asyncio.to_thread(server.start)
    admin, reloader = aioredis.Redis.from_url(server.url), aioredis.Redis.from_url(server.url)
    stores = [RedisStore.from_url(server.url), RedisStore(aioredis.Redis.from_url(server.url))]
    try:
        pipe = admin.pipeline(transaction=False)
        for i in range(2000):
            pipe.set(f"filler:{i}", "x" * 50)
        await pipe.execute()
        await admin.config_set("key-load-delay", 500)  # microseconds a key: a reload of about 1 s
        reload = asyncio.ensure_future(reloader.execute_command("DEBUG", "RELOAD"))
        while True:
            try:
                await admin.ping()
            except BusyLoadingError:
                break
            assert not reload.done(), "never saw Redis loading"
        for store in stores:
            with pytest.raises(StoreError) as refused:
                await _line("loading").apply(store)
            assert not isinstance(refused.value, StoreRejected)
            assert not refused.value.maybe_applied, refused.value
        await reload
    finally:
        for store in stores:
            await store.close()
        await admin.aclose()
        await reloader.aclose()
        await asyncio.to_thread(server.stop)


# ---- the store's reads ----


async def _settled(redis_client: aioredis.Redis, store: RedisStore, *ids: str) -> None:
    await held_reservations(redis_client, *ids)
    for rid in ids:
        assert await _line(rid).apply(store) is not None


@pytest.mark.parametrize("count", [4, 5])
async def test_the_ledger_read_page_by_page_holds_each_entry_once(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, count: int
) -> None:
    # Pages of 2 over a whole number of pages and over one more: an export or a run's bill, each entry once.
    ids = [f"page-{i}" for i in range(count)]
    store = RedisStore.from_url(redis_server.url)
    try:
        await _settled(redis_client, store, *ids)
        run_pages = [p async for p in store.run_ledger_pages(tenant="team-a", run_id="r1", page=2)]
        assert [e["reservation_id"] for p in run_pages for e in p] == ids
        ledger_pages = [p async for p in store.ledger_pages(tenant="team-a", page=2)]
        assert [f["reservation_id"] for p in ledger_pages for _, f in p] == ids
        assert [len(p) for p in ledger_pages] == [2] * (count // 2) + [1] * (count % 2)
    finally:
        await store.close()


async def test_a_damaged_record_of_a_call_in_flight_leaves_the_scope_view_readable(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    # One record whose amounts are not numbers (written by hand, a bad restore) must not fail every view.
    scope = "lbp:{team-a}:run:view"
    await redis_client.hset(scope, mapping={"used:total_tokens": 7, "resv:total_tokens": 3})
    await redis_client.zadd("lbp:{team-a}:leases", {"damaged": 1})
    await redis_client.hset(
        "lbp:{team-a}:resv:damaged", mapping={"scopes": scope, "amounts": "x y", "born": "-"}
    )
    store = RedisStore.from_url(redis_server.url)
    try:
        meters = (await store.scope_meters(tenant="team-a", keys=[scope]))[scope]
    finally:
        await store.close()
    assert (meters["total_tokens"].used, meters["total_tokens"].reserved) == (7, 3)


async def test_every_read_of_a_store_that_cannot_be_reached_fails_as_a_store_error() -> None:
    # A StoreError is what the views answer 503 for: anything else is a 500 and a traceback.
    store = RedisStore.from_url(f"redis://127.0.0.1:{refused_port()}/0")
    try:
        with pytest.raises(StoreError):
            await store.meters("lbp:{team-a}:run:r1")
        with pytest.raises(StoreError):
            await store.tenants()
        with pytest.raises(StoreError):
            await store.run_ledger(tenant="team-a", run_id="r1")
        with pytest.raises(StoreError):
            await anext(aiter(store.ledger_pages(tenant="team-a")))
        with pytest.raises(StoreError):
            await store.scope_meters(tenant="team-a", keys=["lbp:{team-a}:run:r1"])
    finally:
        await store.close()


async def test_a_connection_closed_as_it_was_made_fails_its_callers_rather_than_hold_them(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """Redis at its client limit accepts the connection, says so and closes it, often before the
    callers waiting for it resume: a command queued there then was never written nor failed, and
    its call (a reserve, a settle) waited for good, no watchdog left to fail it."""
    await own_client.config_set("maxclients", 1)  # this client's connection is the one
    try:
        for _ in range(10):
            pipe = PipelinedConnection(own_redis.url, timeout_s=1)
            calls = [asyncio.ensure_future(pipe.call("PING")) for _ in range(5)]
            _, waiting = await asyncio.wait(calls, timeout=5)  # a bound for a hang, not a speed
            for call in waiting:
                call.cancel()
            await pipe.close()
            assert not waiting
            for call in calls:
                assert isinstance(call.exception(), ConnectionLost | RespError), call.exception()
    finally:
        await own_client.config_set("maxclients", 100)
