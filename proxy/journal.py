"""A local journal for settlements the store could not take (Redis down between reserve and
settle). Each line is one settlement (``journal_lines``: what it holds, how a file's lines are
applied); replaying it is exactly-once because settling is idempotent by reservation id.

Each process writes its own file and holds an exclusive ``flock`` on it while alive. At start,
and on every replay round, a process adopts the files whose lock it can take (their writer
died) and replays them too; a file is removed once every line in it is applied. A file's name
carries a tag of the store its lines belong to (its address, credentials left out): a process
of another store sharing the directory leaves it alone and says so (applied there, a call
would be billed in two stores, and its real figures would never reach its own).

Lines are synced in groups: a sync covers every line written to its file before it began, so
the lines that queued behind a sync share the next one (``_FileSyncs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, BinaryIO

from redis.connection import parse_url

from proxy.journal_lines import (
    DEAD_LETTERS,
    OnApplied,
    OnParked,
    PendingSettlement,
    RoundCut,
    apply_lines,
    none_parked,
    nothing,
)
from proxy.store import Store

log = logging.getLogger("proxy.journal")


# journal-<store tag>-<pid>-<random>.jsonl; older versions' (and untagged) journal-<pid>-<random>.
_TAGGED = re.compile(r"journal-([0-9a-f]{16})-\d+-[0-9a-f]{8}\.jsonl")


def store_tag(url: str) -> str:
    """The store a journal belongs to: where its connection goes (host, port, database; or the
    socket's path), as redis-py reads the URL: credentials, options and the URL's spelling
    (the default port given or not, ``/0`` or ``?db=0``) leave it the same store."""
    try:
        where = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError:
        where = {}
    db = where.get("db") or 0
    if where.get("path"):
        address = f"unix:{os.path.normpath(where['path'])}/{db}"
    else:
        address = f"tcp:{str(where.get('host', '')).lower()}:{where.get('port') or 6379}/{db}"
    return hashlib.sha256(address.encode()).hexdigest()[:16]


class Unsynced(OSError):
    """A line written to the journal's file whose sync failed (EIO; ENOSPC on a file system that
    allocates at sync): the file holds it, and a replay applies it, as any other line; a host
    crash before the file's next sync may lose it. Raised by ``append`` and ``append_off_loop``
    in place of the sync's error: the line is journaled, and a caller that kept it elsewhere too
    would have it applied twice, its entry counted twice."""


class Journal:
    def __init__(self, directory: Path, *, store_url: str | None = None) -> None:
        self.directory = directory
        # None (tests, tools): untagged, as older versions' files: adopted by and adopting any.
        self.tag = store_tag(store_url) if store_url else None
        self._prefix = f"journal-{self.tag}-" if self.tag else "journal-"
        self.path = self._new_path()
        self._file: BinaryIO | None = None
        self._syncs = _FileSyncs()  # of ``_file``: a new file starts its own count
        # Lines in our file the store has not taken yet (``pending_lines``).
        self._pending_lines = 0
        self._foreign_seen: set[Path] = set()
        # By file: the reservations whose entries a round counted (``on_applied``) while their
        # lines stayed, the file not rewritten without them (a full disk). Applied again, the
        # store answers a call's own settle with its entry: counted once, not at every round.
        self._told: dict[Path, set[str]] = {}
        # Dead processes' files, locked, whose lines we counted and could not remove: kept
        # locked by us until those lines go (``_replay_orphan``).
        self._held: dict[Path, BinaryIO] = {}
        self._sync_thread: ThreadPoolExecutor | None = None  # started by the first off-loop sync
        # One replay at a time: a shutdown's last replay may start while a round's still runs.
        self._replaying = asyncio.Lock()

    def _new_path(self) -> Path:
        return self.directory / f"{self._prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"

    def _open(self) -> BinaryIO:
        if self._file is not None and not _still_at(self._file, self.path):
            # Our file was removed (its directory deleted during an outage): lines appended to it
            # would go with the process. Its pending lines move to a new file at our path.
            old = self._file
            old.seek(0)
            self._file = _locked_beside(self.path, old.read())  # synced: its lines with it
            self._syncs = _FileSyncs(self.directory)
            old.close()
            log.warning(
                "the journal file was removed; its pending lines written again",
                extra={"journal": str(self.path)},
            )
        if self._file is None:
            if self.path.exists():
                # Our file as ``close`` left it, its lines for the next process (which may be
                # adopting it now). A line journaled after the close (a reaper or a settle still
                # at work as the process stops) goes to a file of its own: a new one renamed
                # over it took every line there.
                self.path = self._new_path()
            self._file = _locked_beside(self.path, b"")
            self._syncs = _FileSyncs(self.directory)
        return self._file

    def append(self, pending: PendingSettlement) -> None:
        """Durable before returning, without an await: for a caller being cancelled (a reserve
        cut by shutdown), which must not lose the line to a second cancel."""
        handle = self._write(pending)
        with _syncing():
            self._syncs.name_synced()
            os.fsync(handle.fileno())
        self._journaled(pending)

    async def append_off_loop(self, pending: PendingSettlement) -> None:
        """``append``, its fsync on the journal's own thread: durable before returning, and a
        slow disk does not stall every other call (during an outage every settle is journaled),
        nor take the threads that resolve names and count tokens. The line is written before the
        first await: a cancel finds it in the file."""
        handle = self._write(pending)
        syncs = self._syncs
        line = syncs.written
        with _syncing():
            try:
                # A descriptor of its own, closed by the thread once synced: ``_open`` may close
                # the file meanwhile (after its removal).
                fd = os.dup(handle.fileno())
            except OSError:
                syncs.name_synced()  # no descriptor to spare: synced here, as ``append``
                os.fsync(handle.fileno())
                self._journaled(pending)
                return
            # A plain future, not a task: a shutdown that cancels every task (and the caller with
            # them) neither drops the sync from the thread's queue nor closes its descriptor.
            synced = asyncio.wrap_future(self._syncer().submit(syncs.sync, fd, line))
            try:
                await asyncio.shield(synced)
            except asyncio.CancelledError:
                synced.add_done_callback(_tell_unsynced)  # no caller left to hear it
                raise
        self._journaled(pending)

    def _syncer(self) -> ThreadPoolExecutor:
        if self._sync_thread is None:
            self._sync_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal-sync")
        return self._sync_thread

    def _write(self, pending: PendingSettlement) -> BinaryIO:
        # One whole line, written on the loop: a replay, also on the loop, never reads half of it.
        handle = self._open()
        _append_whole(handle.fileno(), json.dumps(asdict(pending), separators=(",", ":")).encode() + b"\n")
        self._syncs.written += 1  # once written: a sync that sees it covers the line
        self._pending_lines += 1
        return handle

    def _journaled(self, pending: PendingSettlement) -> None:
        log.warning(
            "marks journaled until the store takes them"
            if pending.marks_only
            else "settlement journaled until the store is back",
            extra={"reservation_id": pending.reservation_id, "journal": str(self.path)},
        )

    @property
    def pending_lines(self) -> int:
        """Settlements in this process's file waiting for the store: an outage's backlog."""
        return self._pending_lines

    async def replay(
        self, store: Store, on_applied: OnApplied = nothing, on_parked: OnParked = none_parked
    ) -> int:
        """Apply this process's pending lines, then any orphaned journals. Returns how many
        applied; ``on_applied`` gets each ledger entry the store took from them, ``on_parked`` is
        told of each line parked in the dead letters."""
        async with self._replaying:
            return await self._replay(store, on_applied, on_parked)

    async def _replay(self, store: Store, on_applied: OnApplied, on_parked: OnParked) -> int:
        applied = 0
        disk: OSError | None = None
        if self._file is not None:
            self._file.seek(0)
            text = self._file.read()
            lines = text.decode("utf-8", "replace").splitlines()
            told = self._told.setdefault(self.path, set())
            done, left, cut = await self._apply(store, lines, on_applied, on_parked, told)
            applied += done
            if done:
                # The lines applied go (applied again, a settle's own try gets its entry, and
                # would be counted again); those left, and those appended while we were
                # applying (settles failing meanwhile), stay. No await in between: no race.
                self._file.seek(len(text))
                rest = "".join(line + "\n" for line in left).encode() + self._file.read()
                try:
                    self._replace_file(rest)
                except OSError as err:
                    # A full disk: the lines applied stay in the file, told (counted once). The
                    # dead processes' files are still adopted: raised first, their calls would
                    # wait for as long as the disk stays full, and a reaper bill them at their
                    # reserve.
                    disk = err
                else:
                    _keep_told(told, left)  # the lines counted went with the rewrite
            if cut is not None:
                raise cut
        applied += await self._adopt(store, on_applied, on_parked)
        if disk is not None:
            raise disk
        return applied

    async def _apply(
        self, store: Store, lines: list[str], on_applied: OnApplied, on_parked: OnParked, told: set[str]
    ) -> tuple[int, list[str], RoundCut | None]:
        """``apply_lines``: how many lines went, those left, and the cancel that cut the round
        (a shutdown), for the caller to raise once it has rewritten its file: what went goes."""
        try:
            done, left = await apply_lines(
                store, lines, self.directory / DEAD_LETTERS, on_applied, on_parked, told=told
            )
        except RoundCut as cut:
            return cut.gone, cut.left, cut
        return done, left, None

    def _replace_file(self, rest: bytes) -> None:
        """Our file holding ``rest`` alone, replaced whole (``_locked_beside``). Truncated in
        place, a full disk (or a crash) between the truncate and the write lost the lines still
        pending: billed at their reserve by a reaper instead."""
        assert self._file is not None
        handle = _locked_beside(self.path, rest)
        self._file.close()
        self._file = handle
        self._syncs = _FileSyncs()
        self._pending_lines = rest.count(b"\n")
        _sync_directory(self.directory)  # the rename, durable: not the old file back after a crash

    async def _adopt(self, store: Store, on_applied: OnApplied, on_parked: OnParked) -> int:
        applied = 0
        disk: OSError | None = None
        listed = self.directory.glob("journal-*.jsonl") if self.directory.exists() else []
        for path in sorted({*listed, *self._held}):
            if path == self.path:
                continue
            tagged = _TAGGED.fullmatch(path.name)
            if tagged and self.tag and tagged.group(1) != self.tag:
                if path not in self._foreign_seen:
                    self._foreign_seen.add(path)
                    log.warning(
                        "a journal of another store left alone: a proxy of that store replays it",
                        extra={"journal": str(path)},
                    )
                continue
            handle = self._held.pop(path, None) or _lock_orphan(path)
            if handle is None:
                continue
            if not _still_at(handle, path):
                # Replayed meanwhile by another process, and removed or rewritten; or, one we
                # held, removed by hand.
                handle.close()
                self._told.pop(path, None)
                continue
            try:
                applied += await self._replay_orphan(path, handle, store, on_applied, on_parked)
            except OSError as err:
                # A full disk refused this file's rewrite (its lines stay, held and told): the
                # files after it are adopted all the same, or their calls would wait for as long
                # as the disk stays full, and a reaper bill them at their reserve.
                disk = err
        if disk is not None:
            raise disk
        return applied

    async def _replay_orphan(
        self, path: Path, handle: BinaryIO, store: Store, on_applied: OnApplied, on_parked: OnParked
    ) -> int:
        """Apply a dead process's file, locked by ``handle``; removed once every line went."""
        told = self._told.setdefault(path, set())
        try:
            handle.seek(0)
            # Bytes that are not UTF-8 (a torn tail) are kept as they are: that line is parked,
            # the others are applied, and the file is not left failing every round.
            lines = handle.read().decode("utf-8", "surrogateescape").splitlines()
            done, left, cut = await self._apply(store, lines, on_applied, on_parked, told)
            if not left:
                path.unlink()
                told.clear()
                log.info("orphaned journal replayed", extra={"journal": str(path), "lines": done})
            elif done:
                # Stopped part-way: the lines applied go (see ``replay``), atomically.
                rest = "".join(line + "\n" for line in left)
                written = _locked_beside(path, rest.encode("utf-8", "surrogateescape"))
                handle.close()
                handle = written
                _keep_told(told, left)
            if cut is not None:
                raise cut
            return done
        finally:
            if told:
                # Lines we counted are still in the file (its rewrite or removal failed: a full
                # disk): its lock stays ours, until they go. Let go, another process would
                # adopt it, the store answer each call's own settle with its entry again, and
                # that process count it again: summed over them, the metrics said two calls.
                self._held[path] = handle
            else:
                handle.close()
                self._told.pop(path, None)

    def close(self) -> None:
        for held in self._held.values():
            held.close()  # for the next process to adopt
        self._held.clear()
        if self._sync_thread is not None:
            self._sync_thread.shutdown(wait=True)  # every sync queued is done before we go
            self._sync_thread = None
        if self._file is not None:
            empty = os.fstat(self._file.fileno()).st_size == 0
            if not empty and not _still_at(self._file, self.path):
                try:
                    self._open()  # its pending lines left where the next process finds them
                except OSError as err:
                    log.critical("pending journal lines lost with a removed file", extra={"error": str(err)})
            self._file.close()
            self._file = None
            if empty:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()


def _append_whole(fd: int, line: bytes) -> None:
    """``line`` at the end of the file (opened to append), whole or not at all. Through the file
    object, a full disk left part of a refused line in the file and the rest in its buffer: every
    later seek tried to flush it and failed, so no replay ran while the disk stayed full (the
    lines journaled before it billed at their reserve by a reaper), and a torn line would have
    swallowed the next one written."""
    size = os.fstat(fd).st_size  # ours alone to append to (locked), on the loop
    try:
        written = 0
        while written < len(line):
            wrote = os.write(fd, line[written:])  # a full disk: short, then ENOSPC
            if not wrote:
                raise OSError(errno.ENOSPC, "the journal line was not written")
            written += wrote
    except OSError:
        try:
            os.ftruncate(fd, size)  # the part written goes: the next line starts a line
        except OSError as err:
            log.critical("a torn journal line could not be cut off", extra={"error": str(err)})
        raise


def _lock_orphan(path: Path) -> BinaryIO | None:
    """``path`` open and locked by us, or None: removed meanwhile (by another process that
    replayed it), or locked by its writer, alive, who replays it, or by another adopter."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def _keep_told(told: set[str], left: list[str]) -> None:
    """Once a file is rewritten: the counted reservations whose lines it still holds stay told
    (a line counted in a round whose rewrite failed, which the store then failed for, stays in
    the file; forgotten, it is counted again when it goes)."""
    kept = set()
    for line in left:
        try:
            kept.add(str(json.loads(line)["reservation_id"]))
        except (ValueError, TypeError, KeyError):
            continue
    told &= kept


def _locked_beside(path: Path, content: bytes) -> BinaryIO:
    """A journal file at ``path`` holding ``content``, open and locked: written beside it,
    synced, locked and then renamed there, so no other process finds it unlocked and adopts it
    (a file created at its path and locked after could be taken, found empty and removed, in
    between), and a full disk or a crash leaves the file that was there whole."""
    # Removed during an outage (or never made): the rename puts the file there again.
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = path.with_name(f".{path.name}.tmp")  # no journal-*.jsonl: none adopts it
    with contextlib.suppress(FileNotFoundError):
        kept.unlink()  # a crash's, mid-rewrite
    handle = kept.open("a+b")  # appended to as a journal is, wherever a read left it
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if content:  # a new file's first lines are synced by their appends
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(kept, path)
    except BaseException:
        # Unlinked first: the close flushes again what a full disk refused, and fails too.
        with contextlib.suppress(FileNotFoundError):
            kept.unlink()
        with contextlib.suppress(OSError):
            handle.close()
        raise
    return handle


class _FileSyncs:
    """Group commit for one journal file: how many lines were written to it (counted on the
    loop, once flushed) and how many a finished sync covers (set on the sync thread). A line's
    sync that finds it covered already, by a sync that began after the line was written, only
    closes its descriptor: during an outage the settles of many calls share one fsync instead
    of queueing one each behind a slow disk. Per file: a sync of an earlier file (one replaced
    or removed) covers none of a later one's lines."""

    __slots__ = ("_unnamed_in", "synced", "written")

    def __init__(self, unnamed_in: Path | None = None) -> None:
        self.written = 0
        self.synced = 0
        # The directory of a file just made there, until the file's name in it is synced: a
        # line's sync covers the file's data, not its name, and a host crash could lose the
        # name, and with it every line its callers were told was journaled.
        self._unnamed_in = unnamed_in

    def name_synced(self) -> None:
        if self._unnamed_in is not None:
            _sync_directory(self._unnamed_in)
            self._unnamed_in = None

    def sync(self, fd: int, line: int) -> None:
        """On the sync thread (one: syncs of a file run one at a time): make line ``line``
        durable, then close ``fd``."""
        try:
            if self.synced < line:
                # Read before the sync: every line counted so far was flushed before it.
                covered = self.written
                self.name_synced()
                os.fsync(fd)
                self.synced = max(self.synced, covered)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _syncing() -> Iterator[None]:
    """Around the sync of a line already written: its failure raised as ``Unsynced``."""
    try:
        yield
    except OSError as err:
        raise Unsynced(*err.args) from err


def _tell_unsynced(synced: asyncio.Future[None]) -> None:
    if not synced.cancelled() and synced.exception() is not None:
        log.critical(
            "a journaled line could not be synced; if the host fails before its next sync, a "
            "reaper bills its call at the reserve",
            extra={"error": str(synced.exception())},
        )


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _still_at(handle: IO[Any], path: Path) -> bool:
    """Whether the file locked is still the one at ``path``: another process may have replayed
    it, removed it or put the lines it did not reach in its place, between our open and our lock.
    Its lines, read again, would be applied (and counted) again."""
    try:
        return os.fstat(handle.fileno()).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False
