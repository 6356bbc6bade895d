"""Settle reservations whose lease ran out (their proxy died or lost its store mid-call).

Every instance runs one. An expired reservation is settled at its reserve with outcome
``lease_expired``: the call went out and nobody can say what it spent. Settlement is idempotent
by reservation id, so reapers racing each other (or a late real settle) charge it once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.config import Config
from proxy.errors import StoreError, StoreRejected
from proxy.journal import Journal, Unsynced
from proxy.journal_lines import PendingSettlement, reaper_line
from proxy.store import REGISTRATION_S, ExpiredLease, Store

log = logging.getLogger("proxy.reaper")
BATCH = 100


class _Stalled(StoreError):
    """A read of the reaper's the store answered, but only ``stall_s`` or more after it was sent:
    the store was not answering meanwhile. A stall no read of ours outlasted may have outlasted
    another process's settle, journaled now and landing a replay after the stall: reaped at once,
    its call would be billed at its reserve instead of its figures."""


def _answered_in_time(loop: asyncio.AbstractEventLoop, asked_at: float, stall_s: float | None) -> None:
    if stall_s is not None and (waited_s := loop.time() - asked_at) >= stall_s:
        raise _Stalled(f"the store took {waited_s:.2f} s to answer a read of the reaper's")


def _told_away(err: StoreError, tenant: str | None = None) -> None:
    extra = {"error": str(err)} if tenant is None else {"tenant": tenant, "error": str(err)}
    if isinstance(err, _Stalled):
        log.warning("the store was slow to answer the reaper: leases' grace starts again", extra=extra)
    else:
        log.error("reaper could not reach the store", extra=extra)


def _record(lease: ExpiredLease) -> dict[str, Any]:
    """What the call's reserve kept for a reaper (``reserve``'s record): {} when unreadable."""
    try:
        record = json.loads(lease.record)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _seconds(value: Any) -> int:
    """A record's count of seconds; 0 for none, or one that is no positive integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def marker_ttl_s(lease: ExpiredLease) -> int:
    """The settled marker's life the serving instance counted on (its record's; 0 when an older
    version's record says none): a journaled settle of the call may come up to 90% of it after
    the lease was confirmed, and must then find the reaper's marker."""
    return _seconds(_record(lease).get("marker_ttl_s"))


def lease_entry(lease: ExpiredLease) -> tuple[dict[str, int], dict[str, str], str, int]:
    """Actual figures, ledger entry, run id and the run's TTL (0: none) for a lease settled at
    its reserve."""
    record = _record(lease)
    amounts = lease.amounts
    actual = {
        "requests": amounts.get("requests", 1),
        "input_tokens": amounts.get("input_tokens", 0),
        "output_tokens": amounts.get("output_tokens", 0),
        "total_tokens": amounts.get("total_tokens", 0),
        "cost_micros": amounts.get("cost_micros", 0),
        "cached_input_tokens": 0,
        "reasoning_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    run_id = str(record.get("run_id", lease.id))
    entry = {
        "request_id": str(record.get("request_id", "")),
        "reservation_id": lease.id,
        "time_ms": str(record.get("time_ms", "")),
        "tenant": lease.tenant,
        "key": str(record.get("key", "")),
        "run_id": run_id,
        "endpoint": str(record.get("endpoint", "")),
        "model": str(record.get("model", "")),
        "upstream": str(record.get("upstream", "")),
        "stream": "1" if record.get("stream") else "0",
        "outcome": "lease_expired",
        "finish_reasons": "",
        "input_tokens": str(actual["input_tokens"]),
        "cached_input_tokens": "0",
        "cache_creation_input_tokens": "0",
        "output_tokens": str(actual["output_tokens"]),
        "reasoning_tokens": "0",
        "total_tokens": str(actual["total_tokens"]),
        "usage_source": "reserve",
        "cost_micros": str(actual["cost_micros"]),
        "reserved_input_tokens": str(actual["input_tokens"]),
        "reserved_output_tokens": str(actual["output_tokens"]),
        "overshoot_tokens": "0",
        "clamped": "1" if lease.clamped else "0",
        "upstream_status": "0",
        "latency_ms": "",
        "ttft_ms": "",
    }
    if isinstance(record.get("service_tier"), str):
        entry["service_tier"] = record["service_tier"]
    if isinstance(record.get("tool_calls"), str) and record["tool_calls"]:
        entry["tool_calls"] = record["tool_calls"]  # the hosted tools' calls its cost holds
    return actual, entry, run_id, _seconds(record.get("run_ttl_s"))


# Per reaper (``run_reaper``): reservation id -> its settle (``reaper_line``) whose reply was
# lost and that no journal took (none given, or its disk refused the line; one written whose
# sync failed is the journal's, ``Unsynced``): tried again first in each of its tenant's rounds,
# and once more when the reaper stops.
Unsure = dict[str, PendingSettlement]


@dataclass(slots=True)
class _Tries:
    """A reaper's settles, each sent with its try's token. One whose reply was lost, which the
    store may have run (the lease has left the index with it), is journaled: whoever replays it
    (this process, a restart, an instance adopting the file) sends that try again and counts
    the entry it wrote. Kept in memory alone, it went with the process: an entry the ledger
    holds that no instance's metrics counted."""

    store: Store
    unsure: Unsure
    journal: Journal | None
    on_settled: Callable[[Mapping[str, str]], None]
    settled: list[dict[str, str]] = field(default_factory=list)

    async def send(self, attempt: PendingSettlement) -> str | None:
        reservation_id = attempt.reaped
        try:
            entry_id = await attempt.apply(self.store)
        except StoreRejected:
            self.unsure.pop(reservation_id, None)
            raise
        except StoreError as err:
            if err.maybe_applied or reservation_id in self.unsure:
                await self._keep(attempt)  # it may have run: its entry is asked for again
            raise
        except asyncio.CancelledError:
            # Stopped mid-settle: it may run all the same. (The line is written before the
            # journal's first await: a second cancel does not cut it.)
            await self._keep(attempt)
            raise
        self.unsure.pop(reservation_id, None)
        if entry_id is not None:
            self.settled.append(attempt.entry)
            self.on_settled(attempt.entry)
            log.warning("lease expired, settled at reserve", extra={"entry": attempt.entry})
        return entry_id

    async def _keep(self, attempt: PendingSettlement) -> None:
        if self.journal is not None:
            # Out of memory as its line is written (before the journal's first await: a cancel
            # during the sync finds it there). Kept in both, the reaper's try again and the
            # replay's each counted the one entry its token gets.
            self.unsure.pop(attempt.reaped, None)
            try:
                await self.journal.append_off_loop(attempt)
            except Unsynced as err:
                log.error(
                    "a reaper's unsure settle journaled, its sync failed: the replay counts its "
                    "entry, unless the host fails before the file's next sync",
                    extra={"reservation_id": attempt.reaped, "error": str(err)},
                )
                return
            except OSError as err:  # nothing written
                log.error("a reaper's unsure settle could not be journaled", extra={"error": str(err)})
            else:
                return
        self.unsure[attempt.reaped] = attempt

    async def again(self, tenant: str) -> None:
        """Send again the unsure settles of ``tenant``; a store error raises."""
        for reservation_id, attempt in list(self.unsure.items()):
            if attempt.tenant == tenant:
                try:
                    await self.send(attempt)
                except StoreRejected as err:
                    log.error(
                        "expired lease could not be settled",
                        extra={"reservation_id": reservation_id, "error": str(err)},
                    )


async def reap_tenant(
    store: Store,
    tenant: str,
    *,
    grace_s: float = 0.0,
    on_settled: Callable[[Mapping[str, str]], None] = lambda entry: None,
    unsure: Unsure | None = None,
    journal: Journal | None = None,
    stall_s: float | None = None,
) -> list[dict[str, str]]:
    """Settle every lease of one tenant that ran out ``grace_s`` ago or more; returns the ledger
    entries this call wrote, each given to ``on_settled`` as soon as it is written: a store error
    later in the round raises, and the entries written before it would go uncounted. A lease
    that cannot be settled is logged and skipped: it never blocks the others.

    A settle whose reply was lost (the store may have run it) goes to ``journal``, whose replay
    counts the entry it wrote; without one, or should its disk refuse the line, to ``unsure``
    (kept across rounds by the caller), tried again first, with its token, so the entry is
    counted once, as a lease settled now is.

    A batch's leases are settled at once: their settles share round trips (one at a time, the
    leases a dead instance left held their budgets' room a round trip each longer).

    ``stall_s``: a batch the store took that long to list raises ``StoreError`` before any of it
    is settled (see ``run_reaper``)."""
    loop = asyncio.get_running_loop()
    tries = _Tries(store, {} if unsure is None else unsure, journal, on_settled)
    await tries.again(tenant)

    async def reap(lease: ExpiredLease) -> bool:
        """Settle one lease at its reserve; False when it stays in the index: its record cannot
        be read, or the store refuses its settle for good."""
        if not lease.readable:
            log.error(
                "expired lease with a damaged record left for an operator", extra={"reservation_id": lease.id}
            )
            return False
        actual, entry, run_id, run_ttl_s = lease_entry(lease)
        attempt = reaper_line(
            tenant=tenant,
            reservation_id=lease.id,
            run_id=run_id,
            scope_keys=list(lease.scope_keys),
            actual=actual,
            entry=entry,
            scope_ttls_s=list(lease.scope_ttls_s),  # a scope key written anew still expires
            runlog_ttl_s=run_ttl_s,
            marker_ttl_s=marker_ttl_s(lease),  # the store keeps its own when that is longer
        )
        try:
            await tries.send(attempt)
        except StoreRejected as err:
            log.error(
                "expired lease could not be settled", extra={"reservation_id": lease.id, "error": str(err)}
            )
            return False
        return True

    # The leases this round left in the index (oldest first): the next batch starts past them,
    # or a batch's worth of them at its head hid every lease after them, round after round.
    left = 0
    while True:
        asked_at = loop.time()
        leases = await store.expired_leases(
            tenant=tenant, limit=BATCH, grace_ms=int(grace_s * 1000), skip=left
        )
        _answered_in_time(loop, asked_at, stall_s)
        # Every settle of the batch runs to its end (and is counted) before a store error raises.
        outcomes = await asyncio.gather(*(reap(lease) for lease in leases), return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        left += outcomes.count(False)
        if len(leases) < BATCH:
            return tries.settled


def registration_s(config: Config) -> float:
    """How long a registration keeps a tenant in the registry the reapers read: two of the
    config's longest lease. A process registers a tenant again once half of it is gone, so every
    lease it writes lands while the tenant's registration holds (the waits before a reserve
    script, a count or the store's reads, are shorter than a lease); a reaper drops a tenant only
    once its registration ran out and it holds no lease."""
    return 2 * config.longest_lease_s


def known_tenants(registered: dict[str, int], config: Config, now_s: float) -> set[str]:
    """The tenants a process knows, for its reaper: its config's, and those it registered whose
    registration has not run out (``registered``: each until when, ms; the others are dropped
    from it, or a process would keep every key ever sprayed at it, and register them again)."""
    for tenant in [tenant for tenant, until_ms in registered.items() if until_ms <= now_s * 1000]:
        del registered[tenant]
    return set(registered) | config.tenants


async def run_reaper(
    store: Store,
    interval_s: float,
    on_settled: Callable[[Mapping[str, str]], None],
    known: Callable[[], Iterable[str]] = tuple,
    *,
    grace_s: float = 0.0,
    kept_s: float = REGISTRATION_S,
    journal: Journal | None = None,
    stall_s: float | None = None,
) -> None:
    """Loop until cancelled; a store outage only delays reaping.

    ``grace_s``: a lease is reaped only that long after it ran out, and only once the store has
    answered this reaper that long without a break (on a Cluster, the master of the lease's
    tenant: each tenant's grace and round are its own). A process that lost its store mid-call
    journals the call's real figures and applies them once the store answers again
    (``journal_replay_s``): reaped first, the call would be billed at its reserve instead; and
    after a long outage every lease that ran out during it is past its own grace.

    An outage is a read that failed, or one the store answered ``stall_s`` or more after it was
    sent (``limits.journal_replay_s`` halved): a Redis that stalls without failing a command of
    the reaper's may have failed a settle sent earlier in the stall, whose journal replays it a
    replay interval after the stall at most. With ``reaper_interval_s`` at most ``reap_grace_s -
    journal_replay_s``, a stall long enough for its leases to be past their grace when it ends
    leaves a read of the reaper's waiting half a replay or more. On one Redis any outage is every
    tenant's: each one's grace starts again.

    ``known``: the tenants this process knows (its config's, those it has registered lately).
    Should the registry lose one (evicted, deleted) its leases would go unreaped, those of a
    dead instance included: it is registered again (for ``kept_s``) and reaped all the same.
    A tenant of the registry no registration keeps any longer (``registration_s``: no call of it
    for that long, a key sprayed at the proxy and refused upstream) is read until it holds no
    lease, then dropped: a round reads the tenants that may hold one, not every tenant ever
    seen. The registry as written before is moved in first (``Store.adopt_old_tenants``).
    ``on_settled`` gets each ledger entry this process wrote; ``journal`` takes its settles whose
    reply was lost (``reap_tenant``): those it cannot take are sent once more as the reaper
    stops, the store back by then maybe."""
    unsure: Unsure = {}  # settles whose reply was lost no journal took, retried first each round
    try:
        await _rounds(store, interval_s, on_settled, known, grace_s, kept_s, journal, unsure, stall_s)
    finally:
        if unsure:
            await _last_tries(store, unsure, on_settled, journal)


async def _rounds(
    store: Store,
    interval_s: float,
    on_settled: Callable[[Mapping[str, str]], None],
    known: Callable[[], Iterable[str]],
    grace_s: float,
    kept_s: float,
    journal: Journal | None,
    unsure: Unsure,
    stall_s: float | None,
) -> None:
    loop = asyncio.get_running_loop()
    # Since when each tenant's keys have answered without a break. Per tenant, not per store: on
    # a Redis Cluster each tenant's keys live on one master, which may be down while the others
    # (the tenant registry's among them) answer. A tenant whose master failed must not stop the
    # round (every tenant after it went unreaped, for as long as it was down), and its grace is
    # its own master's: the registry answering says nothing of whether its journals could land.
    answering: dict[str, float] = {}
    # The registry's tenants as last read: on a Cluster the registry is one key on one master,
    # and that master down must not stop the reaping of the tenants on the others (each
    # tenant's own reads say whether its master answers, and restart its grace when not).
    last_read: set[str] = set()
    while True:
        # Each tenant of the registry as read this round, until when it is kept (ms); none when
        # it could not be read: nothing is dropped from a registry not read.
        registered: dict[str, int] = {}
        mine: set[str] = set()
        # The longest of the registry's round trips (a page each): its read takes many, their
        # sum says nothing of a stall. The old registry's adoption and the registration of the
        # missing tenants are rare (an upgrade, a registry lost) and are not timed.
        longest_s = 0.0

        def waited(wait_s: float) -> None:
            nonlocal longest_s
            longest_s = max(longest_s, wait_s)

        try:
            mine = set(known())
            registered = await store.tenants(waited=waited)
            await _adopt_old_tenants(store, registered, kept_s)
            missing = mine - registered.keys()
            if missing:
                registered.update(
                    dict.fromkeys(missing, await store.register_tenants(missing, kept_s=kept_s))
                )
            tenants = set(registered)
            last_read = set(tenants)
            if stall_s is not None and longest_s >= stall_s:
                raise _Stalled(f"the store took {longest_s:.2f} s to answer a read of the registry")
        except StoreError as err:
            _told_away(err)
            registered = {}
            if store.spans_masters:
                # The registry's master down says nothing of the others': each tenant's own
                # reads tell (and restart its grace when they fail).
                tenants = last_read | mine
            else:
                # One Redis down: every tenant's grace starts again from its next answer.
                answering.clear()
                tenants = set()
        except Exception:
            log.exception("reaper round failed")
            registered = {}
            tenants = set()
        idle: dict[str, int] = {}  # tenants no registration keeps that hold no lease
        for tenant in sorted(tenants):
            since = answering.get(tenant)
            try:
                if grace_s > 0 and (since is None or loop.time() - since < grace_s):
                    # Its keys' node is asked all the same during its grace (a read that changes
                    # nothing): one down meanwhile starts the grace again, from its first answer.
                    asked_at = loop.time()
                    await store.expired_leases(tenant=tenant, limit=0)
                    _answered_in_time(loop, asked_at, stall_s)
                if since is None:
                    answering[tenant] = since = loop.time()
                if loop.time() - since >= grace_s:
                    await reap_tenant(
                        store,
                        tenant,
                        grace_s=grace_s,
                        on_settled=on_settled,
                        unsure=unsure,
                        journal=journal,
                        stall_s=stall_s,
                    )
                until_ms = registered.get(tenant)
                if (
                    until_ms is not None
                    and until_ms <= store.now() * 1000
                    and tenant not in mine
                    and not any(attempt.tenant == tenant for attempt in unsure.values())
                    and not await store.leases_held(tenant=tenant)
                ):
                    idle[tenant] = until_ms
            except StoreError as err:
                _told_away(err, tenant)
                if store.spans_masters:
                    answering.pop(tenant, None)
                else:
                    # One Redis: what failed this tenant's read failed every process's settles.
                    answering.clear()
            except Exception:
                log.exception("reaper round failed", extra={"tenant": tenant})
        if idle:
            await _forget(store, idle, answering, last_read)
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            return  # cancelled inside a store client that swallowed it (redis-py may, mid-command)
        await asyncio.sleep(interval_s)


async def _last_tries(
    store: Store, unsure: Unsure, on_settled: Callable[[Mapping[str, str]], None], journal: Journal | None
) -> None:
    """The settles whose reply was lost that no journal took, sent once more as the reaper stops:
    kept in memory alone, they go with the process."""
    tries = _Tries(store, unsure, journal, on_settled)
    for tenant in sorted({attempt.tenant for attempt in unsure.values()}):
        try:
            await tries.again(tenant)
        except StoreError as err:
            log.error("reaper could not reach the store", extra={"tenant": tenant, "error": str(err)})
    if unsure:
        log.error(
            "a reaper stopped with settles whose reply was lost: the entries they wrote, if any, "
            "are in the ledger and no instance's metrics",
            extra={"reservation_ids": sorted(unsure)},
        )


async def _adopt_old_tenants(store: Store, registered: dict[str, int], kept_s: float) -> None:
    """Move the registry as written before into ``registered`` (and the store's). Its key is on
    another slot: its master down stops neither the round nor the reaping of the others."""
    try:
        adopted = await store.adopt_old_tenants(kept_s=kept_s)
    except StoreError as err:
        log.warning("reaper could not read the old tenant registry", extra={"error": str(err)})
        return
    for tenant, until_ms in adopted.items():
        registered[tenant] = max(until_ms, registered.get(tenant, until_ms))


async def _forget(
    store: Store, idle: dict[str, int], answering: dict[str, float], last_read: set[str]
) -> None:
    try:
        dropped = await store.forget_tenants(idle)
    except StoreError as err:
        log.error("reaper could not drop idle tenants", extra={"error": str(err)})
        return
    for tenant in dropped:
        answering.pop(tenant, None)
        last_read.discard(tenant)
