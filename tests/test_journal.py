"""The settle journal under hostile disk conditions: dead letters that cannot be written, bytes
that are not UTF-8, a journal directory removed during an outage, two processes replaying one
directory."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.errors import StoreError
from proxy.journal import Journal
from proxy.journal_lines import DEAD_LETTERS, REPLAY_WINDOW, PendingSettlement
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.settle import release_unforwarded, release_unforwarded_off_loop, settle_or_journal
from tests.conftest import refused_port
from tests.test_billed_usage import chat, planned
from tests.test_reaper import ScriptsInFlight
from tests.test_store_faults import LEDGER, _settlement_line, held_reservations, replaying


async def test_a_dead_letters_file_that_cannot_be_written_does_not_count_applied_lines_again(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A good line, then a torn one (a crash mid-append), then a good one; the dead letters
    cannot be written (a full or read-only disk; here a directory in its place). The round
    stops at the torn line with an OSError: the line applied before it stays in the file, and
    every round applies it again and counts it again in the spend metrics."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    (journal_dir / DEAD_LETTERS).mkdir()  # cannot be appended to
    await held_reservations(redis_client, "ok-1", "ok-2")
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"  # a dead process's
    orphan.write_text(
        json.dumps(_settlement_line("ok-1"))
        + "\n"
        + '{"tenant":"team-a","reserv\n'
        + json.dumps(_settlement_line("ok-2"))
        + "\n"
    )
    counted: list[Any] = []
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        for _ in range(3):  # three replay rounds, as app.py's loop runs them
            with contextlib.suppress(OSError):
                await journal.replay(store, counted.append)
    assert [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)] == ["ok-1"]
    assert [c["reservation_id"] for c in counted] == ["ok-1"]  # counted once, not every round


@pytest.mark.parametrize("whose", ["its own", "an orphan's"])
async def test_a_round_whose_file_could_not_be_rewritten_counts_no_entry_twice(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    whose: str,
) -> None:
    """A round applied its lines, then could not rewrite its file without them (a full disk:
    the journal grows during an outage) or remove an orphan's: they stayed, the next round
    applied them again, the store answered each call's own settle with its entry, and every
    such round counted them again in the spend metrics (found by the metrics hunt)."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    await held_reservations(redis_client, "first", "second")
    counted: list[Any] = []
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        if whose == "its own":
            journal.append(PendingSettlement(**_settlement_line("first")))
            journal.append(PendingSettlement(**_settlement_line("second")))
            failing = "proxy.journal._locked_beside"
        else:
            orphan = journal_dir / "journal-99999-deadbeef.jsonl"  # a dead process's
            orphan.write_text("".join(json.dumps(_settlement_line(r)) + "\n" for r in ("first", "second")))
            failing = "pathlib.Path.unlink"

        unlink = Path.unlink

        def full(path: Path, *args: Any, **kwargs: Any) -> Any:
            if failing == "pathlib.Path.unlink" and path.name != orphan.name:
                return unlink(path, *args, **kwargs)
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as disk:
            disk.setattr(failing, full)
            for _ in range(2):  # app.py's loop: a failed round is logged, the next one runs
                with contextlib.suppress(OSError):
                    await journal.replay(store, counted.append)
        await journal.replay(store, counted.append)  # room again: the lines go
        assert not journal.path.exists() or journal.path.read_text() == ""
        assert whose == "its own" or not orphan.exists()
    assert sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)) == ["first", "second"]
    assert sorted(c["reservation_id"] for c in counted) == ["first", "second"]  # once each


async def test_a_counted_line_the_store_then_failed_for_stays_told_after_the_rewrite(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round 1 counts both lines and cannot rewrite its file; round 2 the store fails for the
    first, the second goes and the file is rewritten: the first, counted and still in the file,
    was forgotten with the rewrite and counted again in round 3 (found by the review)."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    await held_reservations(redis_client, "first", "second")
    counted: list[Any] = []
    failing_first = False
    settle = RedisStore.settle

    async def flaky(self: RedisStore, **kwargs: Any) -> Any:
        if failing_first and kwargs["reservation_id"] == "first":
            raise StoreError("connection reset")
        return await settle(self, **kwargs)

    monkeypatch.setattr(RedisStore, "settle", flaky)
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        journal.append(PendingSettlement(**_settlement_line("first")))
        journal.append(PendingSettlement(**_settlement_line("second")))

        def full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as disk:
            disk.setattr("proxy.journal._locked_beside", full)
            with contextlib.suppress(OSError):
                await journal.replay(store, counted.append)
        failing_first = True
        await journal.replay(store, counted.append)  # "second" goes, "first" stays
        failing_first = False
        await journal.replay(store, counted.append)  # "first" goes
        assert journal.path.read_text() == ""
    assert sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)) == ["first", "second"]
    assert sorted(c["reservation_id"] for c in counted) == ["first", "second"]  # once each


async def test_an_orphaned_journal_with_bytes_not_utf8_is_replayed_and_blocks_no_other(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A dead process's journal whose torn tail holds bytes that are not UTF-8 (garbage a crash
    or a bad block left): reading it raised UnicodeDecodeError on every round. Its good lines
    were never applied (the reaper bills those calls at their reserve), and neither were those
    of every orphaned journal sorted after it."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    await held_reservations(redis_client, "first", "second")
    torn = journal_dir / "journal-99998-aaaaaaaa.jsonl"
    torn.write_bytes(json.dumps(_settlement_line("first")).encode() + b'\n{"tenant":\xff\xfe\x00\x80')
    other = journal_dir / "journal-99999-bbbbbbbb.jsonl"
    other.write_text(json.dumps(_settlement_line("second")) + "\n")
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        with contextlib.suppress(ValueError):
            await journal.replay(store)
    applied = sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER))
    assert applied == ["first", "second"]
    assert not torn.exists() and not other.exists()
    assert (journal_dir / DEAD_LETTERS).exists()  # the torn line parked, not dropped


def _line(rid: str) -> Any:
    from proxy.journal_lines import PendingSettlement

    return PendingSettlement(**_settlement_line(rid))


async def test_lines_journaled_after_the_journal_directory_was_removed_survive_the_process(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """During an outage the journal's directory is removed (a cleanup of a temporary directory,
    an operator). The process kept appending to its open, now unlinked, file and said each line
    was journaled: once it dies before the store is back, they are gone, and the calls are billed
    at their reserve instead of their real figures; its close at shutdown raised."""

    journal_dir = tmp_path / "journal"
    await held_reservations(redis_client, "before", "after")
    dying = Journal(journal_dir)
    dying.append(_line("before"))
    shutil.rmtree(journal_dir)
    dying.append(_line("after"))
    dying.close()  # the process goes before the store is back
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        await journal.replay(store)
    applied = sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER))
    assert applied == ["after", "before"]


async def test_a_line_journaled_after_the_close_leaves_the_lines_the_close_left(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """The store away at shutdown, the journal's close leaves its pending lines in its file for
    the next process. A writer still at work after it (a reaper that did not stop within
    ``app.STOP_LOOP_S``, its try's reply lost; a settle past the settling bound) opened a new,
    empty file at the same path and renamed it over that one: every pending line gone, their
    calls billed at their reserve by a reaper. Its line goes to a file of its own."""
    journal_dir = tmp_path / "journal"
    await held_reservations(redis_client, "pending", "late")
    journal = Journal(journal_dir)
    journal.append(_line("pending"))
    journal.close()
    await journal.append_off_loop(_line("late"))
    journal.close()  # the process goes: its lock with it
    async with replaying(redis_server.url, journal_dir) as (store, next_process):
        assert await next_process.replay(store) == 2
    assert sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)) == ["late", "pending"]


async def test_two_processes_replaying_one_directory_apply_and_count_each_line_once(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    rids = []
    for f in range(20):
        lines = []
        for i in range(10):
            rid = f"two-{f}-{i}"
            rids.append(rid)
            record = {"amounts": "1 3 4 7 0 1", "born": "-"}
            await redis_client.hset(f"lbp:{{team-a}}:resv:{rid}", mapping=record)
            lines.append(json.dumps(_settlement_line(rid)))
            if i == 5:
                lines.append("{torn")
        (journal_dir / f"journal-{90000 + f}-deadbeef.jsonl").write_text("\n".join(lines) + "\n")
    stores = [RedisStore.from_url(redis_server.url) for _ in range(2)]
    for s in stores:
        await s.load_scripts()
    journals = [Journal(journal_dir) for _ in range(2)]
    counted: list[Any] = []
    try:
        for _ in range(3):
            await asyncio.gather(
                *(j.replay(s, counted.append) for j, s in zip(journals, stores, strict=True))
            )
    finally:
        for j in journals:
            j.close()
        for s in stores:
            await s.close()
    assert sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)) == sorted(rids)
    assert sorted(c["reservation_id"] for c in counted) == sorted(rids)
    assert list(journal_dir.glob("journal-*")) == []
    assert (journal_dir / "rejected.jsonl").read_text().count("{torn") == 20


@pytest.fixture
async def syncs_after_a_turn(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``os.fsync`` that syncs only once the event loop has turned: at once when it runs off the
    loop; on the loop (which it then holds) never, and it gives up after 5 s. One flag per
    sync: whether the loop turned."""
    loop = asyncio.get_running_loop()
    real_fsync = os.fsync
    flags: list[bool] = []

    def slow_fsync(fd: int) -> None:
        turned = threading.Event()
        loop.call_soon_threadsafe(turned.set)
        flags.append(turned.wait(5))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    return flags


async def test_a_disk_slow_to_sync_does_not_hold_the_event_loop_while_a_settle_is_journaled(
    tmp_path: Path, syncs_after_a_turn: list[bool]
) -> None:
    """During an outage every settle is journaled, durable (fsync) before its call goes on. On
    the event loop, a disk slow to sync held every other call of the process meanwhile."""
    store = RedisStore.from_url(f"redis://127.0.0.1:{refused_port()}/0")  # nothing there: it fails
    journal = Journal(tmp_path / "journal")
    try:
        entry_id, stored = await settle_or_journal(store, journal, _line("journaled"))
    finally:
        await store.close()
    assert (entry_id, stored) == (None, False)
    assert syncs_after_a_turn == [True, True]  # the new file's name in its directory, the line
    lines = journal.path.read_text().splitlines()
    assert [json.loads(line)["reservation_id"] for line in lines] == ["journaled"]
    journal.close()


async def test_a_settle_journaled_whose_sync_failed_is_not_logged_as_left_to_a_reaper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A settle whose line went into the file and whose sync failed (``journal.Unsynced``) is
    replayed at its real figures: it was logged critical, "could not be journaled; a reaper will
    bill the reserve", an operator told of a bill at the reserve that does not come (the reaper
    fix's report)."""

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    store = RedisStore.from_url(f"redis://127.0.0.1:{refused_port()}/0")  # nothing there: it fails
    journal = Journal(tmp_path / "journal")
    monkeypatch.setattr(os, "fsync", failing_fsync)
    try:
        entry_id, stored = await settle_or_journal(store, journal, _line("unsynced"))
    finally:
        monkeypatch.undo()
        await store.close()
    assert (entry_id, stored) == (None, False)
    assert journal.pending_lines == 1
    journal.close()
    said = [record.getMessage() for record in caplog.records if record.name == "proxy.settle"]
    assert said == ["settle failed; journaled, its sync failed"]


@pytest.mark.parametrize("off_loop", [False, True])
async def test_a_release_journaled_whose_sync_failed_is_not_logged_as_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, off_loop: bool
) -> None:
    """As the settle's (d841c8e): the release of an unforwarded reserve whose line is in the file,
    its sync failed, was logged critical as "could not be journaled", a reaper to bill the
    reserve, where the replay releases it (the fourth review of the day)."""

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    call = planned(chat(max_tokens=5))
    journal = Journal(tmp_path / "journal")
    monkeypatch.setattr(os, "fsync", failing_fsync)
    try:
        if off_loop:
            await release_unforwarded_off_loop(call, journal, ["lbp:{team-a}:run:run-1"], 60)
        else:
            release_unforwarded(call, journal, ["lbp:{team-a}:run:run-1"], 60)
    finally:
        monkeypatch.undo()
    assert journal.pending_lines == 1  # the line is in the file: the replay releases it
    journal.close()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "proxy.settle"]
    assert said == [(logging.ERROR, "the release of an unforwarded reserve journaled, its sync failed")]


async def test_the_release_of_a_reserve_whose_reply_was_lost_is_synced_off_the_loop(
    tmp_path: Path, syncs_after_a_turn: list[bool]
) -> None:
    """A store that times out every reserve has each one released through the journal: as for
    a settle, its sync does not hold the other calls."""
    call = planned(chat(max_tokens=5))
    journal = Journal(tmp_path / "journal")
    await release_unforwarded_off_loop(call, journal, ["lbp:{team-a}:run:run-1"], 60)
    assert syncs_after_a_turn == [True, True]  # the new file's name in its directory, the line
    (line,) = journal.path.read_text().splitlines()
    assert json.loads(line)["reservation_id"] == call.reservation_id
    assert json.loads(line)["entry"]["outcome"] == "not_forwarded"
    journal.close()


async def test_a_shutdown_that_cancels_every_task_drops_no_sync_queued_nor_its_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp's shutdown cancels every task, the calls waiting on their lines' syncs among
    them. A sync still queued behind a slow one (the disk slow, the case the thread is for)
    must run all the same, and close its descriptor: none left open."""
    started, go_on = threading.Event(), threading.Event()
    synced: list[int] = []
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:
        started.set()
        go_on.wait(5)
        real_fsync(fd)
        synced.append(fd)

    journal = Journal(tmp_path / "journal")
    journal.append(_line("opened"))  # the journal's own file is open from here
    open_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fsync", held_fsync)
    waiting = [asyncio.ensure_future(journal.append_off_loop(_line("slow")))]
    assert await asyncio.to_thread(started.wait, 5)  # the first sync runs
    # Written once that sync began, so not covered by it: its own waits, queued behind it.
    waiting.append(asyncio.ensure_future(journal.append_off_loop(_line("queued"))))
    while len(journal.path.read_text().splitlines()) < 3:
        await asyncio.sleep(0.01)
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.cancel()
    for task in waiting:
        with pytest.raises(asyncio.CancelledError):
            await task
    go_on.set()
    for _ in range(500):
        if len(synced) == 2 and len(os.listdir("/proc/self/fd")) == open_before:
            break
        await asyncio.sleep(0.01)
    assert len(synced) == 2  # both lines synced all the same
    assert len(os.listdir("/proc/self/fd")) == open_before
    journal.close()


class HeldSyncs:
    """``os.fsync`` whose first call waits for ``go_on``; each call's file (inode) and size."""

    def __init__(self) -> None:
        self.started, self.go_on = threading.Event(), threading.Event()
        self.calls: list[tuple[int, int]] = []
        self._real = os.fsync
        self._entered = 0

    def __call__(self, fd: int) -> None:
        self._entered += 1
        if self._entered == 1:
            self.started.set()
            self.go_on.wait(5)
        stat = os.fstat(fd)
        self.calls.append((stat.st_ino, stat.st_size))
        self._real(fd)


async def test_the_lines_queued_behind_a_slow_sync_share_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During an outage every settle is journaled, and a line is durable before its call goes
    on. One fsync each, queued on the sync thread behind a slow disk, the Nth call waited N
    syncs; a sync covers every line written before it began, so those queued share one."""
    syncs = HeldSyncs()
    journal = Journal(tmp_path / "journal")
    monkeypatch.setattr(os, "fsync", syncs)
    first = asyncio.ensure_future(journal.append_off_loop(_line("first")))
    assert await asyncio.to_thread(syncs.started.wait, 5)
    queued = [asyncio.ensure_future(journal.append_off_loop(_line(f"queued-{i}"))) for i in range(20)]
    while len(journal.path.read_text().splitlines()) < 21:
        await asyncio.sleep(0.01)
    syncs.go_on.set()
    await asyncio.gather(first, *queued)
    size, inode = journal.path.stat().st_size, journal.path.stat().st_ino
    file_syncs = [call for call in syncs.calls if call[0] == inode]  # not its directory's
    assert len(file_syncs) == 2, syncs.calls  # the slow one, and one for the 20 behind it
    assert file_syncs[-1] == (inode, size)  # every line, synced
    monkeypatch.undo()
    journal.close()


async def test_a_sync_of_a_removed_journal_file_covers_no_line_of_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's directory removed during an outage, the next line goes to a new file. A
    sync of the old file, however late it began, makes none of the new file's lines durable:
    the line there is synced on its own."""
    syncs = HeldSyncs()
    journal = Journal(tmp_path / "journal")
    monkeypatch.setattr(os, "fsync", syncs)
    held = asyncio.ensure_future(journal.append_off_loop(_line("held")))
    assert await asyncio.to_thread(syncs.started.wait, 5)
    # Queued behind the held sync; it begins after the next line is written, to another file.
    old_file = asyncio.ensure_future(journal.append_off_loop(_line("old-file")))
    while len(journal.path.read_text().splitlines()) < 2:
        await asyncio.sleep(0.01)
    shutil.rmtree(tmp_path / "journal")
    new_file = asyncio.ensure_future(journal.append_off_loop(_line("new-file")))
    while not journal.path.exists() or len(journal.path.read_text().splitlines()) < 3:
        await asyncio.sleep(0.01)
    syncs.go_on.set()
    await asyncio.gather(held, old_file, new_file)
    assert (journal.path.stat().st_ino, journal.path.stat().st_size) in syncs.calls, syncs.calls
    monkeypatch.undo()
    journal.close()


async def test_a_sync_that_fails_after_its_caller_left_is_told_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    started, go_on = threading.Event(), threading.Event()

    def failing_fsync(fd: int) -> None:
        started.set()
        go_on.wait(5)
        raise OSError(5, "Input/output error")

    journal = Journal(tmp_path / "journal")
    monkeypatch.setattr(os, "fsync", failing_fsync)
    waiting = asyncio.ensure_future(journal.append_off_loop(_line("lost-sync")))
    assert await asyncio.to_thread(started.wait, 5)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    go_on.set()
    for _ in range(500):
        if any("could not be synced" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    assert any(r.levelname == "CRITICAL" and "could not be synced" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    journal.close()


async def test_a_replay_after_the_journal_directory_was_removed_keeps_its_file(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """Lines journaled, the directory removed (a cleanup), no line since, the store back: the
    replay applies them and writes what is left at its path again, round after round without
    an error (each line counted once)."""
    journal_dir = tmp_path / "journal"
    await held_reservations(redis_client, "a", "b")
    counted: list[Any] = []
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        journal.append(_line("a"))
        journal.append(_line("b"))
        shutil.rmtree(journal_dir)
        for _ in range(3):
            await journal.replay(store, counted.append)
        assert journal.path.exists() and journal.path.read_bytes() == b""
    assert sorted(c["reservation_id"] for c in counted) == ["a", "b"]
    assert not journal_dir.exists() or not list(journal_dir.glob("journal-*.jsonl"))


FILLS_THE_DISK = """
import asyncio, resource, sys
from pathlib import Path
from proxy.journal import Journal
from proxy.journal_lines import PendingSettlement
from proxy.redis_store import RedisStore
from tests.test_store_faults import _settlement_line

async def main(url: str, directory: str) -> None:
    store = RedisStore.from_url(url)
    await store.load_scripts()
    journal = Journal(Path(directory))
    journal.append(PendingSettlement(**_settlement_line("first")))
    room = journal.path.stat().st_size

    async def disk_fills_meanwhile() -> None:
        # While the replay applies the first line: two more, then no file may grow past the
        # size of one line (a full disk, to this process).
        journal.append(PendingSettlement(**_settlement_line("second")))
        journal.append(PendingSettlement(**_settlement_line("third")))
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, resource.RLIM_INFINITY))

    replay = asyncio.ensure_future(journal.replay(store))
    filling = asyncio.ensure_future(disk_fills_meanwhile())
    try:
        print("applied", await replay)
    except OSError as err:
        print("replay failed:", err)
    await filling
    try:
        journal.close()
    except OSError as err:  # what the full disk left in its buffer: the process goes all the same
        print("close failed:", err)
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_disk_full_while_the_journal_drops_its_applied_lines_loses_none_pending(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A replay drops the lines it applied by writing the rest again. In place (truncate, then
    write), a disk that filled meanwhile left the file empty or torn: the lines still pending
    were lost, and their calls billed at their reserve by a reaper instead of their figures."""
    journal_dir = tmp_path / "journal"
    await held_reservations(redis_client, "first", "second", "third")
    root = Path(__file__).resolve().parents[1]
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", FILLS_THE_DISK, redis_server.url, str(journal_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr
    assert "replay failed" in done.stdout, done.stdout  # the disk was full for the rewrite
    async with replaying(redis_server.url, journal_dir) as (store, journal):
        await journal.replay(store)  # the dead process's journal, adopted
    applied = [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)]
    assert sorted(applied) == ["first", "second", "third"]  # each once
    assert not (journal_dir / DEAD_LETTERS).exists()  # no torn line
    assert not list(journal_dir.glob(".*.tmp"))  # nor the rewrite the disk refused


ADOPTS_THE_DIRECTORY = """
import asyncio, sys
from pathlib import Path
from proxy.journal import Journal
from proxy.redis_store import RedisStore

print("adopted", asyncio.run(Journal(Path(sys.argv[1])).replay(RedisStore.from_url("redis://127.0.0.1:9"))))
"""


async def test_a_new_journal_file_is_never_at_its_path_unlocked_for_another_process_to_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process made its file at its path, then locked it. Another process's replay round in
    between took the file for a dead process's, found it empty and removed it: the lines
    appended next went to a file no path leads to, and with the process if it died before its
    next append noticed. Here the other process runs just before the first lock is taken."""
    journal_dir = tmp_path / "journal"
    root = Path(__file__).resolve().parents[1]
    real_flock = fcntl.flock
    adopters: list[str] = []

    def flock_after_another_round(handle: Any, operation: int) -> None:
        if not adopters:
            done = subprocess.run(
                [sys.executable, "-c", ADOPTS_THE_DIRECTORY, str(journal_dir)],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=root,
                env={**os.environ, "PYTHONPATH": str(root)},
            )
            adopters.append(done.stdout + done.stderr)
        real_flock(handle, operation)

    journal = Journal(journal_dir)
    monkeypatch.setattr(fcntl, "flock", flock_after_another_round)
    journal.append(_line("first"))
    monkeypatch.undo()
    assert "adopted 0" in adopters[0], adopters
    assert journal.path.exists(), "our file was taken and removed"
    (line,) = journal.path.read_text().splitlines()
    assert json.loads(line)["reservation_id"] == "first"
    journal.close()


async def test_a_line_the_store_fails_for_holds_back_no_line_of_its_window(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A replay settles its lines a window at a time. One line the store fails for (NOPERM
    here, an ACL the operator then fixes: a failure that passes) stays for the next round; the
    lines around it that the store took go, and none is applied or counted twice. Before, the
    round stopped at that line, and every line after it waited for the next round."""
    ids = [f"r{i}" for i in range(9)]
    await held_reservations(redis_client, *ids, "blocked")
    keys = ["~lbp:{team-a}:leases", "~lbp:{team-a}:resv:*", "~lbp:{team-a}:ledger"]
    keys += ["~lbp:{team-a}:runlog:*", "~lbp:{team-a}:run:r1"]
    await redis_client.execute_command("ACL", "SETUSER", "replayer", "on", ">pw", "+@all", *keys)
    blocked = {**_settlement_line("blocked"), "scope_keys": ["lbp:{team-a}:run:blocked"]}
    counted: list[str] = []
    try:
        async with replaying(redis_server.url.replace("redis://", "redis://replayer:pw@"), tmp_path) as (
            store,
            journal,
        ):
            for rid in ids[:4]:
                journal.append(_line(rid))
            journal.append(PendingSettlement(**blocked))
            for rid in ids[4:]:
                journal.append(_line(rid))
            assert journal.pending_lines == len(ids) + 1
            await journal.replay(store, lambda entry: counted.append(entry["reservation_id"]))
            assert sorted(counted) == ids  # all but the one the store failed for
            assert journal.pending_lines == 1
            (left,) = journal.path.read_text().splitlines()
            assert json.loads(left)["reservation_id"] == "blocked"
            await redis_client.execute_command("ACL", "SETUSER", "replayer", "allkeys")
            await journal.replay(store, lambda entry: counted.append(entry["reservation_id"]))
            assert journal.path.read_text() == "" and journal.pending_lines == 0
    finally:
        await redis_client.execute_command("ACL", "DELUSER", "replayer")
    assert sorted(counted) == sorted([*ids, "blocked"])  # each once
    ledger = [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)]
    assert sorted(ledger) == sorted([*ids, "blocked"])


async def test_a_replay_sends_the_settles_of_a_window_together(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """One at a time, a replay took a round trip per line: after a long outage a reaper, once
    ``reap_grace_s`` was up, billed at their reserve the lines it had not reached. A window's
    settles go together (one write on the shared connection)."""
    ids = [f"r{i}" for i in range(REPLAY_WINDOW + 10)]
    await held_reservations(redis_client, *ids)
    orphan = tmp_path / "journal-99999-deadbeef.jsonl"  # a dead process's: adopted
    orphan.write_text("".join(json.dumps(_settlement_line(rid)) + "\n" for rid in ids))
    store = ScriptsInFlight.from_url(redis_server.url)
    await store.load_scripts()
    journal = Journal(tmp_path)
    try:
        assert await journal.replay(store) == len(ids)
    finally:
        journal.close()
        await store.close()
    assert store.most["settle"] > 1  # one at a time: 1 (each waited for its reply); here most of a window
    assert not orphan.exists()
    assert await redis_client.xlen(LEDGER) == len(ids)


@pytest.mark.parametrize("descriptor", ["spared", "none to spare"])
async def test_a_new_journal_file_has_its_name_synced_before_its_first_line_is_told_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, descriptor: str
) -> None:
    """A line's sync makes the file's data durable, not its name in the directory: made during
    an outage (or again after its removal) and never synced there, a host crash could lose the
    file with every line its callers were told was journaled. Alike when no descriptor is left
    for the sync thread and the line is synced on the loop, as ``append`` does."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def no_descriptor(fd: int) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "fsync", fsync)
    if descriptor == "none to spare":
        monkeypatch.setattr(os, "dup", no_descriptor)
    journal = Journal(tmp_path / "journal")
    await journal.append_off_loop(_line("first"))
    assert synced[:2] == ["directory", "file"]
    shutil.rmtree(tmp_path / "journal")
    synced.clear()
    await journal.append_off_loop(_line("after-removal"))
    assert synced[-2:] == ["directory", "file"]  # after the new file (its lines copied, synced)
    monkeypatch.undo()
    journal.close()


REFUSED_THEN_REPLAYED = """
import asyncio, json, resource, signal, sys
from pathlib import Path
from proxy.journal import Journal
from proxy.journal_lines import PendingSettlement
from proxy.redis_store import RedisStore
from tests.test_store_faults import _settlement_line

async def main(url: str, directory: str, refused: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(2), as ENOSPC would be
    store = RedisStore.from_url(url)
    await store.load_scripts()
    journal = Journal(Path(directory))
    # A dead process's journal, waiting for this one to adopt it.
    orphan = Path(directory) / "journal-99999-deadbeef.jsonl"
    orphan.write_text(json.dumps(_settlement_line("orphaned")) + "\\n")
    # Redis down: a call's settle journaled, durable.
    journal.append(PendingSettlement(**_settlement_line("first")))
    # The disk fills up (an outage's journal, logs): the next call's line does not fit.
    room = journal.path.stat().st_size + 40
    resource.setrlimit(resource.RLIMIT_FSIZE, (room, resource.RLIM_INFINITY))
    if refused == "yes":
        try:
            journal.append(PendingSettlement(**_settlement_line("second")))
        except OSError as err:  # settle_or_journal: "a reaper will bill the reserve"
            print("not journaled:", err)
    # Redis is back; the disk is still full. app.py's replay loop, a few rounds.
    for _ in range(3):
        try:
            print("applied", await journal.replay(store))
        except OSError as err:
            print("replay failed:", err)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    await store.close()

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("refused", ["no", "yes"])
async def test_a_line_the_full_disk_refused_stops_no_replay_of_the_lines_journaled_before_it(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path, refused: str
) -> None:
    """A line journaled during an outage, then the disk fills and the next settle's line is
    refused (its call left to a reaper, as logged). Redis comes back while the disk is still
    full. With no refused line ("no"), the replay applies the first line (its rewrite fails,
    the line is in Redis: billed at its real figures). With one ("yes"), the refused line's
    bytes wait in the file object's buffer; every round's seek(0) tries to flush them and
    raises, so no line of the journal is applied for as long as the disk is full, and a reaper
    bills every such call at its reserve once reap_grace_s is up. Nor is a dead process's
    journal adopted: the round raises before it gets there."""
    journal_dir = tmp_path / "journal"
    await held_reservations(redis_client, "first", "second", "orphaned")
    journal_dir.mkdir()
    root = Path(__file__).resolve().parents[1]
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", REFUSED_THEN_REPLAYED, redis_server.url, str(journal_dir), refused],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr
    applied = [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)]
    assert sorted(applied) == ["first", "orphaned"], done.stdout


@pytest.mark.parametrize("refused", ["its rewrite", "its removal"])
async def test_an_orphan_whose_rewrite_the_full_disk_refused_is_counted_once_over_the_processes(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    refused: str,
) -> None:
    """Two processes (``serve --workers 2``) share the journal directory; a dead worker's
    journal holds a good line and a torn one, the dead letters cannot be written and the disk
    is full. Worker A adopts it, applies and counts the good line, cannot rewrite the file
    without it, and lets go of its lock; worker B adopts it next, the store answers the call's
    own settle with its entry, and B counts it again: the spend metrics summed over the
    instances say two calls where the ledger holds one (A's ``told`` is its own). The same
    with a file of the good line alone whose removal failed."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    (journal_dir / DEAD_LETTERS).mkdir()  # cannot be appended to (a full disk)
    await held_reservations(redis_client, "first")
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"
    torn = '{"tenant":"team-a","reserv\n' if refused == "its rewrite" else ""
    orphan.write_text(json.dumps(_settlement_line("first")) + "\n" + torn)
    unlink = Path.unlink

    def full(path: Path, *args: Any, **kwargs: Any) -> Any:
        if refused == "its removal" and path != orphan:
            return unlink(path, *args, **kwargs)
        raise OSError(28, "No space left on device")

    counted: list[Any] = []
    async with replaying(redis_server.url, journal_dir) as (store, worker_a):
        worker_b = Journal(journal_dir)
        try:
            with monkeypatch.context() as disk:
                disk.setattr("proxy.journal._locked_beside" if torn else "pathlib.Path.unlink", full)
                for journal in (worker_a, worker_b, worker_a, worker_b):  # their replay loops
                    with contextlib.suppress(OSError):
                        await journal.replay(store, counted.append)
            for journal in (worker_a, worker_b, worker_a):  # room again
                await journal.replay(store, counted.append)
        finally:
            worker_b.close()
    assert [e["reservation_id"] for _, e in await redis_client.xrange(LEDGER)] == ["first"]
    assert [c["reservation_id"] for c in counted] == ["first"]  # once over both workers
    # The good line gone from the file (the torn one waits for the dead letters), its lock let go.
    assert (orphan.read_text() == torn) if torn else not orphan.exists()


async def test_an_own_file_whose_rewrite_the_full_disk_refuses_stops_no_adoption_of_an_orphan(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This process's own file rewritten with lines left in it (a line the dead letters cannot
    take on a full disk, beside one the store took): the rewrite's OSError left the replay before
    it adopted a dead process's journal, round after round for as long as the disk stayed full,
    and a reaper billed the orphan's calls at their reserve (the review of a710aab)."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    (journal_dir / DEAD_LETTERS).mkdir()  # cannot be appended to (a full disk)
    await held_reservations(redis_client, "first", "orphaned")
    orphan = journal_dir / "journal-99999-deadbeef.jsonl"
    orphan.write_text(json.dumps(_settlement_line("orphaned")) + "\n")

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    async with replaying(redis_server.url, journal_dir) as (store, journal):
        journal.append(PendingSettlement(**_settlement_line("first")))
        fd = os.open(journal.path, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b'{"tenant":"team-a","reserv\n')  # a torn line, for the dead letters
        os.close(fd)
        with monkeypatch.context() as disk:
            disk.setattr("proxy.journal._locked_beside", full)
            for _ in range(3):  # app.py's replay loop, the disk still full
                with contextlib.suppress(OSError):
                    await journal.replay(store)
            applied = sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER))
    assert applied == ["first", "orphaned"]


async def test_an_orphan_whose_rewrite_the_full_disk_refuses_stops_no_adoption_of_another(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a full disk, a dead process's file whose rewrite failed (a line the store took beside
    one the dead letters could not take) raised out of the adoption, so the files sorted after it
    were never adopted while the disk stayed full (the second review of 750ccb0)."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    (journal_dir / DEAD_LETTERS).mkdir()  # cannot be appended to (a full disk)
    await held_reservations(redis_client, "first", "second")
    # Sorted first: a line the store takes, and a torn one for the dead letters.
    (journal_dir / "journal-11111-aaaaaaaa.jsonl").write_text(
        json.dumps(_settlement_line("first")) + "\n" + '{"tenant":"team-a","reserv\n'
    )
    (journal_dir / "journal-99999-deadbeef.jsonl").write_text(json.dumps(_settlement_line("second")) + "\n")

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    async with replaying(redis_server.url, journal_dir) as (store, journal):
        with monkeypatch.context() as disk:
            disk.setattr("proxy.journal._locked_beside", full)
            for _ in range(3):  # app.py's replay loop, the disk still full
                with contextlib.suppress(OSError):
                    await journal.replay(store)
            applied = sorted(e["reservation_id"] for _, e in await redis_client.xrange(LEDGER))
    assert applied == ["first", "second"]
