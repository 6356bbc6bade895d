"""Applying a journal's lines (``journal_lines.apply_lines``, through ``Journal.replay``): a round
cut by shutdown's cancel, then the shutdown's last replay, counts each entry once; where a round
stopped by the store leaves the lines after it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.journal import Journal
from proxy.journal_lines import DEAD_LETTERS, REPLAY_WINDOW, PendingSettlement, marks_line, reaper_line
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.store import DEFAULT_SETTLED_MARKER_TTL_S, MAX_SETTLED_MARKER_TTL_S, Reservation, Scope
from tests.test_journal import _line
from tests.test_store_faults import LEDGER, _settlement_line, held_reservations, replaying

# A pass-through caller's tenant (``auth``), whose key is named as it.
PASSTHROUGH = "pt-" + "ab" * 16

IDS = [f"r{i}" for i in range(9)]


class GatedStore(RedisStore):
    """The real store; the settle of ``r4``, and of each id in ``swallowing``, waits for ``gate``
    before it is sent. With ``swallows``, a cancel delivered to ``r4`` mid-settle is swallowed
    and the settle finishes (what the app says redis-py may do mid-command: see app._stopped);
    the ids in ``swallowing`` swallow every cancel (as redis-py's teardowns do:
    ``_UncancellableFuture``)."""

    swallows = False
    swallowing: frozenset[str] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.waiting = 0
        self.settled = 0  # settles not held that returned (their lines' tasks end in that step)

    async def settle(self, **kwargs: Any) -> str | None:
        rid = kwargs["reservation_id"]
        if rid != "r4" and rid not in self.swallowing:
            found = await RedisStore.settle(self, **kwargs)
            self.settled += 1
            return found

        async def sent() -> str | None:
            self.waiting += 1
            self.entered.set()
            await self.gate.wait()
            return await RedisStore.settle(self, **kwargs)

        if rid == "r4" and not self.swallows:
            return await sent()
        inner = asyncio.ensure_future(sent())
        while True:
            try:
                return await asyncio.shield(inner)
            except asyncio.CancelledError:
                if rid == "r4":
                    return await inner


async def _cut_round_then_last_replay(
    url: str, tmp_path: Path, *, swallows: bool = False, swallowing: frozenset[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """Shutdown's cut of a replay round once the lines not held went, then its last replay:
    what each line's entry was counted, in order, and the lines the cut round left."""
    store = GatedStore.from_url(url)
    store.swallows, store.swallowing = swallows, swallowing
    held = 1 + len(swallowing)
    await store.load_scripts()
    journal = Journal(tmp_path / "journal")
    counted: list[str] = []

    def count(entry: Any) -> None:
        counted.append(entry["reservation_id"])

    try:
        for rid in IDS:
            journal.append(_line(rid))
        round_ = asyncio.ensure_future(journal.replay(store, count))
        for _ in range(500):  # the lines not held are applied
            if store.waiting == held and len(counted) == len(IDS) - held:
                break
            await asyncio.sleep(0.01)
        assert store.waiting == held and len(counted) == len(IDS) - held, counted
        round_.cancel()  # aiohttp's shutdown: app._stopped(loop task)
        await asyncio.sleep(0)  # r4's cancel lands first
        store.gate.set()
        with contextlib.suppress(asyncio.CancelledError):
            await round_
        left = [json.loads(line)["reservation_id"] for line in journal.path.read_text().splitlines()]
        await journal.replay(store, count)  # journal_ctx: "a last try before the process goes"
        assert journal.path.read_text() == ""
    finally:
        journal.close()
        await store.close()
    return counted, left


async def _counted_once(redis_client: aioredis.Redis, counted: list[str]) -> None:
    twice = {rid: n for rid, n in collections.Counter(counted).items() if n > 1}
    assert not twice, twice
    assert sorted(counted) == IDS
    assert await redis_client.xlen(LEDGER) == len(IDS)


@pytest.mark.parametrize("swallows", [False, True], ids=["cancelled", "cancel-swallowed"])
async def test_a_round_cut_by_a_cancel_counts_no_entry_twice(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path, swallows: bool
) -> None:
    """Shutdown cancels a round mid-window, then replays once more. The lines the store took
    before the cancel go from the file before the cancel goes on; the lines it did not reach
    stay. Left in the file, the last replay applied and counted them again (before windows,
    those before the line in flight). A cancel the store client swallows mid-settle (redis-py
    may: ``app._stopped``) still ends the round once its window is done, the same way."""
    await held_reservations(redis_client, *IDS)
    counted, _ = await _cut_round_then_last_replay(redis_server.url, tmp_path, swallows=swallows)
    await _counted_once(redis_client, counted)


async def test_a_line_whose_cancel_was_swallowed_beside_one_cancelled_is_counted_once(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A window's gather gives up at its first line cancelled, while a line whose store client
    swallowed the cancel still runs: looked at then, it was kept in the file, then settled and
    counted, and the last replay applied it again and counted it twice (seen once in CI, as
    ``r8: 2`` of the test above). The round waits for every line of its window: the line it
    settled goes with the round (the journal's told set would keep it from being counted twice
    all the same, not from being applied again)."""
    await held_reservations(redis_client, *IDS)
    counted, left = await _cut_round_then_last_replay(
        redis_server.url, tmp_path, swallowing=frozenset({"r8"})
    )
    assert left == ["r4"]
    await _counted_once(redis_client, counted)


ACL_KEYS = [
    "~lbp:{team-a}:leases",
    "~lbp:{team-a}:resv:*",
    "~lbp:{team-a}:ledger",
    "~lbp:{team-a}:runlog:*",
    "~lbp:{team-a}:run:r1",
]


def _blocked() -> PendingSettlement:
    return PendingSettlement(**{**_settlement_line("blocked"), "scope_keys": ["lbp:{team-a}:run:blocked"]})


async def test_a_full_window_the_store_failed_for_leaves_each_line_after_it_once(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A window the store failed for (one line of it) stops the round: the lines after the
    window stay, each once (a line of the window repeated there is applied and counted twice)."""
    ids = [f"w{i}" for i in range(REPLAY_WINDOW + 5)]
    await held_reservations(redis_client, *ids, "blocked")
    await redis_client.execute_command("ACL", "SETUSER", "replayer", "on", ">pw", "+@all", *ACL_KEYS)
    try:
        url = redis_server.url.replace("redis://", "redis://replayer:pw@")
        async with replaying(url, tmp_path) as (store, journal):
            journal.append(_blocked())  # in the first window, which then fails
            for rid in ids:
                journal.append(_line(rid))
            await journal.replay(store)
            kept = [json.loads(line)["reservation_id"] for line in journal.path.read_text().splitlines()]
            # the window's other 63 went; the lines after the window stay, each once
            assert kept == ["blocked", *ids[REPLAY_WINDOW - 1 :]], kept
    finally:
        await redis_client.execute_command("ACL", "DELUSER", "replayer")


async def test_an_unreadable_line_after_a_window_the_store_failed_for_stays(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """An unreadable line after a window the store failed for stays in the file, unparked,
    for the next round: never dropped."""
    await held_reservations(redis_client, "a", "blocked")
    await redis_client.execute_command("ACL", "SETUSER", "replayer", "on", ">pw", "+@all", *ACL_KEYS)
    try:
        url = redis_server.url.replace("redis://", "redis://replayer:pw@")
        async with replaying(url, tmp_path) as (store, journal):
            journal.append(_line("a"))
            journal.append(_blocked())
            with journal.path.open("ab") as raw:
                raw.write(b'{"tenant":"team-a","reserv\n')  # torn
            await journal.replay(store)
            kept = journal.path.read_text().splitlines()
            assert len(kept) == 2 and kept[1] == '{"tenant":"team-a","reserv', kept
            assert not (tmp_path / DEAD_LETTERS).exists()  # not parked yet: the round stopped
    finally:
        await redis_client.execute_command("ACL", "DELUSER", "replayer")


async def test_a_marks_line_makes_the_marks_and_settles_nothing(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A line of marks alone (its call's settle landed, its marks failed): replayed, the marks
    are made; no settle is sent (the reservation held under its id stays as it is, no entry is
    written, none counted), and a line of the wrong shape is parked, not applied."""
    await held_reservations(redis_client, "marked")
    counted: list[Any] = []
    async with replaying(redis_server.url, tmp_path) as (store, journal):
        journal.append(marks_line(tenant="team-a", reservation_id="marked", run_id="r1", ids=["resp:resp_1"]))
        with journal.path.open("a") as raw:
            raw.write(
                json.dumps(
                    {
                        **asdict(marks_line(tenant="team-a", reservation_id="x", run_id="r1", ids=[])),
                        "owned_contexts": None,
                    }
                )
                + "\n"
            )
        await journal.replay(store, counted.append)
        assert journal.path.read_text() == ""
        assert await store.context_owners(ids=["resp:resp_1"]) == ["team-a"]
    assert counted == [] and await redis_client.xlen(LEDGER) == 0
    assert await redis_client.exists("lbp:{team-a}:resv:marked") == 1
    assert len((tmp_path / DEAD_LETTERS).read_text().splitlines()) == 1


async def test_a_marks_line_read_as_a_settle_by_an_older_version_settles_nothing(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A version before marks lines (a rollback) reads one as the call's own settle. Under the
    call's id it found the call's settled marker, got its entry back and logged a settle it did
    not make, counting an empty entry (a traceback; the upgrade hunt). A marks line's id is its
    own: read so, it finds neither reservation nor marker and settles nothing."""
    await held_reservations(redis_client, "called")
    async with replaying(redis_server.url, tmp_path) as (store, _):
        assert await PendingSettlement(**_settlement_line("called")).apply(store) is not None
        line = marks_line(tenant="team-a", reservation_id="called", run_id="r1", ids=["resp:resp_1"])
        assert line.reservation_id != "called"
        as_an_older_version_reads_it = asdict(line)
        del as_an_older_version_reads_it["marks_only"]
        assert await PendingSettlement(**as_an_older_version_reads_it).apply(store) is None
    assert await redis_client.xlen(LEDGER) == 1


async def test_a_reaper_line_read_as_a_settle_by_an_older_version_settles_nothing(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A version before reaper lines (a rollback) reads one as the call's own settle: under the
    lease's id, its try not run, it would bill the call at its reserve as the call's own, which
    the call's real settle, replayed later, takes for its own (counting figures the ledger never
    got). Under its own id it finds nothing and settles nothing; this version sends the
    reaper's try, and again gets that try's entry."""
    await held_reservations(redis_client, "reaped")
    line = reaper_line(
        tenant="team-a",
        reservation_id="reaped",
        run_id="r1",
        scope_keys=["lbp:{team-a}:run:r1"],
        actual={"requests": 1, "input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
        entry={"reservation_id": "reaped", "outcome": "lease_expired", "tenant": "team-a"},
        scope_ttls_s=[3600],
        runlog_ttl_s=3600,
        marker_ttl_s=0,
    )
    as_an_older_version_reads_it = {
        name: value
        for name, value in asdict(line).items()
        if name not in ("reaped", "reaper_try", "marker_ttl_s")
    }
    async with replaying(redis_server.url, tmp_path) as (store, _):
        assert await PendingSettlement(**as_an_older_version_reads_it).apply(store) is None
        assert await redis_client.hget("lbp:{team-a}:resv:reaped", "amounts") is not None
        first = await line.apply(store)
        assert first is not None
        assert await line.apply(store) == first  # its reply lost, the try sent again
        assert await PendingSettlement(**_settlement_line("reaped")).apply(store) is None  # the call's
    assert await redis_client.xlen(LEDGER) == 1


async def test_a_replay_by_a_process_set_to_a_shorter_marker_keeps_it_for_the_line_s_window(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A line journaled by a process set to ``settled_marker_ttl_s: 3600`` bills a lost
    reservation for 3,240 s; replayed by one set to 60 s (restarted, or adopting the file), its
    marker lived 60 s. That replay's reply lost (the line stays), the next one a minute on found
    neither reservation nor marker, inside the line's window, and billed the call again (the
    TTL hunt). The marker outlives the line's window."""
    await held_reservations(redis_client, "adopted")
    window_ms = 3_240_000
    line = PendingSettlement(
        **{**_settlement_line("adopted"), "bill_if_lost_until_ms": int(time.time() * 1000) + window_ms}
    )
    marker = "lbp:{team-a}:resv:adopted"
    store = RedisStore.from_url(redis_server.url, settled_marker_ttl_s=60)
    try:
        assert await line.apply(store) is not None  # its reply lost: the line stays journaled
        left_ms = await redis_client.pttl(marker)
        assert left_ms >= window_ms - 1_000, left_ms
        # A minute on, as Redis counts it (a marker kept 60 s is gone: a TTL at or below 0 deletes).
        await redis_client.pexpire(marker, left_ms - 61_000)
        assert await line.apply(store) is not None  # the next replay gets the first one's entry
    finally:
        await store.close()
    assert await redis_client.xlen(LEDGER) == 1


async def test_a_replayed_settle_keeps_its_marker_a_second_past_its_whole_window(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A journaled settle's window left (7,200.5 s, past the store's own hour) is kept on its
    marker in whole seconds rounded up, and a second more for the clocks' offsets: 7,202 s."""
    await held_reservations(redis_client, "windowed")
    store = RedisStore.from_url(redis_server.url)
    try:
        until_ms = int(await store.synced_now() * 1000) + 7_200_500
        line = PendingSettlement(**{**_settlement_line("windowed"), "bill_if_lost_until_ms": until_ms})
        assert await line.apply(store) is not None
    finally:
        await store.close()
    assert await redis_client.pttl("lbp:{team-a}:resv:windowed") > 7_201_000


async def test_a_replayed_settle_past_its_window_keeps_the_stores_own_marker(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A journaled settle whose window has passed asks for no marker of its own: the store's
    hour, by the store's clock in milliseconds."""
    await held_reservations(redis_client, "late")
    store = RedisStore.from_url(redis_server.url)
    try:
        until_ms = int(await store.synced_now() * 1000) - 1000
        line = PendingSettlement(**{**_settlement_line("late"), "bill_if_lost_until_ms": until_ms})
        assert await line.apply(store) is not None
    finally:
        await store.close()
    assert 0 < await redis_client.ttl("lbp:{team-a}:resv:late") <= DEFAULT_SETTLED_MARKER_TTL_S


async def test_a_damaged_line_s_window_of_centuries_keeps_its_marker_no_longer_than_the_config_may(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis
) -> None:
    """A line whose ``bill_if_lost_until_ms`` is damaged (ages on) asked for a marker Redis's
    EXPIRE refuses ("invalid expire time"): the script failed after its writes, the settle
    refused and the line parked with the dead letters though it had billed the call. Held to the
    longest marker the config takes."""
    await held_reservations(redis_client, "damaged")
    line = PendingSettlement(**{**_settlement_line("damaged"), "bill_if_lost_until_ms": 10**19})
    store = RedisStore.from_url(redis_server.url)
    try:
        assert await line.apply(store) is not None
        assert await line.apply(store) is not None
    finally:
        await store.close()
    assert await redis_client.xlen(LEDGER) == 1
    assert 0 < await redis_client.ttl("lbp:{team-a}:resv:damaged") <= MAX_SETTLED_MARKER_TTL_S


@pytest.mark.parametrize("window", ["400-digits", "Infinity"])
async def test_a_damaged_line_s_window_past_a_float_neither_sticks_nor_holds_back_the_lines_after_it(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path, window: str
) -> None:
    """A window past what a float holds (a 400-digit int, JSON's ``Infinity``) raised an
    OverflowError where 295a083 worked out its time left in floats, not one of the wrong-shape
    errors a line is parked for: kept every round, never billed nor parked, its file never
    removed, each round stopping after its window (the first review of the day). Before, the same
    line was compared, not divided, and applied; it is again."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    await held_reservations(redis_client, "damaged")
    bad = _settlement_line("damaged")
    bad["bill_if_lost_until_ms"] = 10**400 if window == "400-digits" else float("inf")
    good = [_settlement_line(f"good-{i}") for i in range(REPLAY_WINDOW + 5)]
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"  # a dead process's
    orphan.write_text("".join(json.dumps(line) + "\n" for line in [bad, *good]))
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        await journal.replay(store)
        await journal.replay(store)
    billed = {e["reservation_id"] for _, e in await redis_client.xrange(LEDGER, count=1000)}
    assert billed == {"damaged", *(f"good-{i}" for i in range(REPLAY_WINDOW + 5))}
    assert not orphan.exists()


@pytest.mark.parametrize(
    ("tenant", "key_name", "kept_s"), [(PASSTHROUGH, PASSTHROUGH, 3600), ("team-a", "a-ci", -1)]
)
async def test_a_replayed_settle_of_a_pass_through_call_expires_its_ledger_and_key_s_lifetime(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    tenant: str,
    key_name: str,
    kept_s: int,
) -> None:
    """A line as the version before wrote it: its key's lifetime at TTL 0, as then reserved
    (persistent), and no word of the ledger. Replayed, a pass-through caller's tenant's ledger
    and its key's lifetime meters expire with its runs (the line's run TTL), as the live settle
    has them; a configured tenant's stay kept for ever."""
    run, lifetime = f"lbp:{{{tenant}}}:run:r1", f"lbp:{{{tenant}}}:key:{key_name}:all"
    async with replaying(redis_server.url, tmp_path) as (store, journal):
        held = await store.reserve(
            tenant=tenant,
            reservation_id="journaled",
            run_id="r1",
            scopes=[Scope(name="run", key=run, ttl_s=3600), Scope(name="key", key=lifetime)],
            amounts={"requests": 1, "input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
            lease_ms=600_000,
            record="{}",
        )
        assert isinstance(held, Reservation)
        journal.append(
            PendingSettlement(
                tenant=tenant,
                reservation_id="journaled",
                run_id="r1",
                scope_keys=[run, lifetime],
                actual={"requests": 1, "input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
                entry={"reservation_id": "journaled", "outcome": "ok", "tenant": tenant, "run_id": "r1"},
                bill_if_lost_until_ms=int(time.time() * 1000) + 600_000,
                scope_ttls_s=[3600, 0],
                runlog_ttl_s=3600,
            )
        )
        assert await journal.replay(store) == 1
    ledger = f"lbp:{{{tenant}}}:ledger"
    assert await redis_client.xlen(ledger) == 1
    for key in (ledger, lifetime):
        left = await redis_client.ttl(key)
        assert left == -1 if kept_s < 0 else 3000 < left <= kept_s, (key, left)
