"""A journal's lines: the settlement each holds, and applying a file's lines (a window of them at
once), those the store will never take (and those no version can read) parked in the dead
letters, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import field, fields
from pathlib import Path
from typing import Any

from proxy.errors import StoreError, StoreRejected
from proxy.scopes import kept_with_runs
from proxy.store import MAX_SETTLED_MARKER_TTL_S, Store
from proxy.values import value_class

log = logging.getLogger("proxy.journal")
DEAD_LETTERS = "rejected.jsonl"


@value_class(kw_only=True)
class PendingSettlement:
    tenant: str
    reservation_id: str
    run_id: str
    scope_keys: list[str]
    actual: dict[str, int]
    entry: dict[str, str]
    # Until when (wall clock, ms) a call that went out is billed even if the store lost its
    # reservation: while a reaper's settle of it would still have left its marker (see
    # settle.settle). 0 (releases of unforwarded reserves, lines of older versions): never.
    bill_if_lost_until_ms: int = 0
    # The scope keys' TTLs (Scope.ttl_s), for keys a lost reservation's settle creates anew.
    # Empty (lines of older versions): such keys get none.
    scope_ttls_s: list[int] = field(default_factory=list)
    # The run's ledger index expires this long after the settle (0, older versions: never).
    runlog_ttl_s: int = 0
    # The contexts the provider keeps that the call made or continued with the operator's key:
    # marked as its tenant's once the store is back (Store.claim_contexts), as the live settle
    # would have.
    owned_contexts: list[str] = field(default_factory=list)
    # The marks alone (``marks_line``): the call's settle landed, the command marking its contexts
    # failed (on a Cluster, another master than its tenant's). Applying it makes the marks only.
    marks_only: bool = False
    # A reaper's settle at the reserve (``reaper_line``): the lease's reservation id, the try's
    # token and the marker's life it asks for. Empty (the call's own settle): none.
    reaped: str = ""
    reaper_try: str = ""
    marker_ttl_s: int = 0

    async def apply(self, store: Store, on_sent: Callable[[], None] | None = None) -> str | None:
        """Settle it; idempotent by reservation id, so applying it again changes nothing. It is
        the call's own settle, tried live or replayed from a journal: applied again after a try
        whose reply was lost, it gets that try's entry (settle.lua), which is then counted. A
        reaper's line is that reaper's settle, sent again as it was, with its token."""
        ledger_ttl_s, lifetime_key = kept_with_runs(self.tenant, self.runlog_ttl_s)
        if self.reaper_try:
            return await store.settle(
                tenant=self.tenant,
                reservation_id=self.reaped,
                run_id=self.run_id,
                scope_keys=self.scope_keys,
                actual=self.actual,
                entry=self.entry,
                scope_ttls_s=self.scope_ttls_s,
                runlog_ttl_s=self.runlog_ttl_s,
                ledger_ttl_s=ledger_ttl_s,
                lifetime_key=lifetime_key,
                on_sent=on_sent,
                reaper_try=self.reaper_try,
                marker_ttl_s=self.marker_ttl_s,
            )
        # The store's clock: the journal may be replayed by an instance on another host. A
        # damaged line's window of ages (digits past a float's, Infinity) is held to the longest
        # marker the config takes before any arithmetic: an EXPIRE Redis refused would fail the
        # script after it wrote the settle, and an OverflowError kept the line for good.
        now_ms = int(await store.synced_now() * 1000)
        window_left_ms = min(now_ms + MAX_SETTLED_MARKER_TTL_S * 1000, self.bill_if_lost_until_ms) - now_ms
        return await store.settle(
            tenant=self.tenant,
            reservation_id=self.reservation_id,
            run_id=self.run_id,
            scope_keys=self.scope_keys,
            actual=self.actual,
            entry=self.entry,
            bill_if_lost=window_left_ms > 0,
            scope_ttls_s=self.scope_ttls_s,
            runlog_ttl_s=self.runlog_ttl_s,
            ledger_ttl_s=ledger_ttl_s,
            lifetime_key=lifetime_key,
            own=True,
            on_sent=on_sent,
            # Its window was counted on the marker of the instance that served the call, which a
            # replay (restarted with a shorter one, or adopting its file) may not keep: this
            # settle's reply lost, the next replay, inside the window, must find its marker. A
            # second over, for the clocks' offsets measured apart.
            marker_ttl_s=min(-(-int(window_left_ms) // 1000) + 1, MAX_SETTLED_MARKER_TTL_S)
            if window_left_ms > 0
            else 0,
        )


OnApplied = Callable[[Mapping[str, str]], None]
OnParked = Callable[[], None]


def nothing(entry: Mapping[str, str]) -> None:
    pass


def none_parked() -> None:
    pass


def pending_of(fields_of_line: dict[str, Any]) -> PendingSettlement:
    """A line's settlement; fields this version does not know (a later version's) are left out,
    fields it added since are defaulted: both ways across an upgrade, the line is applied."""
    known = {f.name for f in fields(PendingSettlement)}
    return PendingSettlement(**{k: v for k, v in fields_of_line.items() if k in known})


def park(dead_letters: Path, line: str) -> bool:
    """Never dropped: kept for an operator with the other lines the store cannot take. False
    when the dead letters cannot be written (a full or read-only disk): the line stays where it
    is, and the round stops there, the lines applied before it removed (not applied again)."""
    try:
        with dead_letters.open("a", encoding="utf-8", errors="surrogateescape") as parked:
            parked.write(line + "\n")
            parked.flush()
            os.fsync(parked.fileno())
    except OSError as err:
        log.critical("a journal line could not be parked; kept", extra={"error": str(err)})
        return False
    return True


# Lines settled at once by a replay: their settles share round trips to the store (one write,
# one read, on the connection the reserves share), where one at a time a replay of an outage's
# lines took a round trip each, and a reaper, once ``reap_grace_s`` was up, billed at their
# reserve the lines it had not reached.
REPLAY_WINDOW = 64


async def apply_lines(
    store: Store,
    lines: list[str],
    dead_letters: Path,
    on_applied: OnApplied,
    on_parked: OnParked = none_parked,
    *,
    told: set[str] | None = None,
) -> tuple[int, list[str]]:
    """Settle the lines, a window of them at a time, and park those the store will never take;
    after a window in which the store failed, stop (the rest is retried on the next round).
    Returns how many went (applied or parked) and the lines left, in order: not only a prefix,
    since a line the store failed for may sit among lines of its window it took. ``on_parked``
    is told of each line parked; ``told`` holds the reservations whose entries were counted
    already (their lines left in the file by a rewrite that failed): not counted again."""
    told = set() if told is None else told
    gone = 0
    left: list[str] = []
    window: list[tuple[str, PendingSettlement]] = []
    cut = False  # cancelled (a shutdown): the round stops, and RoundCut says what went

    async def flush() -> bool:
        """Apply the window; False when the round must stop."""
        nonlocal gone, cut
        tasks = [
            asyncio.ensure_future(_apply_line(store, pending, on_applied, told)) for _, pending in window
        ]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            # The lines the store took before the cancel (counted already) go all the same:
            # left in the file, the shutdown's last replay would apply and count them again.
            cut = True
            for task in tasks:
                task.cancel()
            # gather gives up at the first line cancelled, while others may still run: one whose
            # store client swallowed the cancel settles and is counted after we looked, and kept
            # in the file, the last replay counted it again. Looked at once all have ended (a
            # store call is bounded by its timeout; shutdown waits for a round a bounded time).
            while not all(task.done() for task in tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(tasks)
        going_on = not cut
        for (line, _), task in zip(window, tasks, strict=True):
            outcome = task.result() if task.done() and not task.cancelled() else _Line.KEPT
            if outcome is _Line.APPLIED or (outcome is _Line.TO_PARK and parked(line)):
                gone += 1
            else:
                left.append(line)
                going_on = False
        window.clear()
        return going_on

    def parked(line: str) -> bool:
        if not park(dead_letters, line):
            return False
        on_parked()
        return True

    def ended() -> tuple[int, list[str]]:
        if cut:
            raise RoundCut(gone, left)
        return gone, left

    for at, line in enumerate(lines):
        if not line.strip():
            gone += 1
            continue
        try:
            pending = pending_of(json.loads(line))
        except (ValueError, TypeError, AttributeError):
            # Never dropped: parked for an operator with the lines the store rejects, in its turn.
            if window and not await flush():
                left.extend(lines[at:])
                return ended()
            log.error("unreadable journal line parked", extra={"line": line[:200]})
            if not parked(line):
                left.extend(lines[at:])
                return gone, left
            gone += 1
            continue
        window.append((line, pending))
        if len(window) == REPLAY_WINDOW and not await flush():
            left.extend(lines[at + 1 :])
            return ended()
    if window:
        await flush()
    return ended()


def marks_line(*, tenant: str, reservation_id: str, run_id: str, ids: list[str]) -> PendingSettlement:
    """A line making only the marks ``ids`` of a call whose settle has landed. Under an id of its
    own, no reservation's: a version before marks lines (a rollback) reads one as the call's
    settle, and under the call's id found its marker and logged a settle it did not make (a
    traceback counting an empty entry); under this one it finds nothing, settles nothing, and
    makes the marks."""
    return PendingSettlement(
        tenant=tenant,
        reservation_id=f"{reservation_id}:marks",
        run_id=run_id,
        scope_keys=[],
        actual={},
        entry={},
        owned_contexts=ids,
        marks_only=True,
    )


def reaper_line(
    *,
    tenant: str,
    reservation_id: str,
    run_id: str,
    scope_keys: list[str],
    actual: dict[str, int],
    entry: dict[str, str],
    scope_ttls_s: list[int],
    runlog_ttl_s: int,
    marker_ttl_s: int,
) -> PendingSettlement:
    """A reaper's settle of an expired lease at its reserve, with a token of its own: the reaper
    sends it, and journals it when its reply is lost (the lease has left the index with it: no
    other reaper, nor a restart, finds it), so whoever replays it gets the entry that try wrote
    (settle.lua) and counts it. Under an id of its own, as ``marks_line``: a version before
    reaper lines (a rollback) reads one as the call's own settle, which, the try not run, billed
    the call at its reserve as the call's (its real settle, replayed later, then counted figures
    the ledger never got) and kept the marker only the store's own time; under this one it finds
    nothing and settles nothing (the entry goes uncounted, as it did before these lines)."""
    return PendingSettlement(
        tenant=tenant,
        reservation_id=f"{reservation_id}:reaped",
        run_id=run_id,
        scope_keys=scope_keys,
        actual=actual,
        entry=entry,
        scope_ttls_s=scope_ttls_s,
        runlog_ttl_s=runlog_ttl_s,
        reaped=reservation_id,
        reaper_try=f"r{os.urandom(12).hex()}",
        marker_ttl_s=marker_ttl_s,
    )


async def _apply_marks(store: Store, pending: PendingSettlement) -> _Line:
    try:
        await store.claim_contexts(tenant=pending.tenant, ids=list(pending.owned_contexts))
    except StoreRejected as err:
        log.error(
            "journaled marks rejected by the store; parked",
            extra={"reservation_id": pending.reservation_id, "error": str(err)},
        )
        return _Line.TO_PARK
    except StoreError:
        return _Line.KEPT
    log.info("journaled marks applied", extra={"reservation_id": pending.reservation_id})
    return _Line.APPLIED


class RoundCut(asyncio.CancelledError):
    """``apply_lines`` cancelled: how many lines went before the cancel and the lines left, for
    its caller to rewrite its file with before the cancel goes on."""

    def __init__(self, gone: int, left: list[str]) -> None:
        super().__init__()
        self.gone = gone
        self.left = left


class _Line(enum.Enum):
    APPLIED = enum.auto()  # or settled before: it goes
    TO_PARK = enum.auto()  # the store will never take it
    KEPT = enum.auto()  # the store failed: tried again on the next round


async def _apply_line(
    store: Store, pending: PendingSettlement, on_applied: OnApplied, told: set[str]
) -> _Line:
    try:
        if pending.marks_only:
            return await _apply_marks(store, pending)
        entry_id = await pending.apply(store)
        if pending.owned_contexts:
            # After the settle: a round stopped here applies the line again, idempotently.
            try:
                await store.claim_contexts(tenant=pending.tenant, ids=list(pending.owned_contexts))
            except StoreRejected as err:  # the settle is in: not a line to park
                log.error("could not mark a journaled call's contexts", extra={"error": str(err)})
    except (TypeError, AttributeError, ValueError, ArithmeticError) as err:
        # JSON of the wrong shape (a null where a list goes, a number past a float's): it would
        # stop every round here, holding back every line after it. Parked, as a line the store rejects.
        log.error(
            "journal line of the wrong shape parked",
            extra={"reservation_id": str(pending.reservation_id)[:100], "error": repr(err)[:200]},
        )
        return _Line.TO_PARK
    except StoreRejected as err:
        # The store will never take this line: park it for an operator, go on.
        log.error(
            "journaled settlement rejected by the store; parked",
            extra={"reservation_id": pending.reservation_id, "error": str(err)},
        )
        return _Line.TO_PARK
    except StoreError:
        return _Line.KEPT
    except Exception:
        # Our own fault: kept, and the lines of its window the store took still go (raised, the
        # round would leave them all in the file, to be applied and counted again).
        log.exception("a journal line could not be applied", extra={"reservation_id": pending.reservation_id})
        return _Line.KEPT
    log.info(
        "journaled settlement applied" if entry_id else "journaled settlement was already settled",
        extra={"reservation_id": pending.reservation_id},
    )
    if entry_id is not None and pending.reservation_id not in told:
        told.add(pending.reservation_id)
        try:
            on_applied(pending.entry)
        except Exception:
            # The metrics of an entry of another shape (an older version's): the ledger has it;
            # the line must not be applied again and again for them.
            log.exception(
                "a replayed settlement was not counted", extra={"reservation_id": pending.reservation_id}
            )
    return _Line.APPLIED
