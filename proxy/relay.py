"""Forward a reserved call and settle it exactly once, whatever happens to it.

The steps after ``reserve``: forward, observe, settle, record. ``Exchange`` holds the call's
state and its one settle; how the answer is carried lives beside it: ``relay_body`` (a JSON
answer, an upstream's error) and ``relay_stream`` (an event stream, relayed as it arrives); which
figures bill it is ``billed_usage``'s to say, and what it leaves for a later call ``contexts``'.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace

import aiohttp
from aiohttp import web

from proxy.billed_usage import Uncounted, Usage, usage_counted, usage_now, with_tool_calls
from proxy.call import Call
from proxy.config import Config
from proxy.contexts import claim, contexts_made, contexts_owned, remember
from proxy.estimate import counted
from proxy.forward import (
    TransportFailure,
    caller_key_sent,
    open_upstream,
    operator_secrets,
    provider_headers,
    unless_client_leaves,
)
from proxy.journal import Journal, Unsynced
from proxy.journal_lines import marks_line
from proxy.lease import LeaseRenewal
from proxy.metrics import Metrics, tenant_label
from proxy.observe import Observation
from proxy.outcome import (
    CLIENT_CLOSED,
    NOTHING_BILLED,
    BilledUsage,
    Outcome,
    OutcomeTag,
    reserve_usage,
)
from proxy.payload import messages_tier_served
from proxy.record import record_call
from proxy.refine import take_count
from proxy.relay_body import relay_body, relay_upstream_error
from proxy.relay_stream import relay_stream
from proxy.scrub import Secrets, scrubbed
from proxy.settle import Settlement, billing_headers, settle
from proxy.store import MARKER_TRUST, Store
from proxy.thread_pools import TenantPool
from proxy.tokenizer import Tokenizer

log = logging.getLogger("proxy.relay")
# A whole answer goes out with the settle on its way (``Exchange.settle_early``) only while its
# lease has at least this part of its time left: past that a reaper might be billing the call.
EARLY_ANSWER_LEASE_PART = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    store: Store
    session: aiohttp.ClientSession
    tokenizer: Tokenizer
    config: Config
    metrics: Metrics
    journal: Journal
    # Settle tasks still running (see ``Exchange.settle``); shutdown waits for them.
    settling: set[asyncio.Future[Settlement]]
    # Where a settle counts a call (``billed_usage.usage_counted``, ``Exchange.count_input``).
    settle_counts: TenantPool


def _tell(early: asyncio.Future[Settlement], call: Call, settlement: Settlement) -> None:
    if not early.done():
        call.answered_at = time.monotonic()  # the client's wait ends now, not at the store's reply
        early.set_result(settlement)


class Exchange:
    """One call from forward to settle; settles exactly once whatever happens."""

    def __init__(self, request: web.Request, call: Call, services: Services) -> None:
        self.request = request
        self.call = call
        self.services = services
        self.obs = Observation()
        self._settling: asyncio.Future[Settlement] | None = None
        # The settle's result, known before the task records it (see ``_settle_and_record``).
        self._settlement: asyncio.Future[Settlement] | None = None
        lease_s = call.reservation.lease_ms / 1000 if call.reservation else call.upstream.timeout_s
        # A client that stops reading is dropped after this long (see relay_stream._to_client,
        # relay_body.WholeAnswer).
        self.write_timeout_s = min(call.upstream.timeout_s, lease_s / 3)
        # Time spent waiting on the upstream, so the proxy's own overhead can be told apart.
        self.upstream_s = 0.0
        self.provider_headers: dict[str, str] = {}  # once it answered: see forward.provider_headers
        self.context_kept = False  # see ``contexts.keep_context``
        self.keeping: asyncio.Future[None] | None = None  # its write, once started
        self.claimed: set[str] = set()  # the contexts marked as its tenant's (``contexts.claim``)
        # The status the client is answered, for the call's log line (``record_call``): set
        # before the settle, which records it (0: none, a shutdown cut the call).
        self.answer_status = 0
        self.streamed = False  # relayed as an event stream (``relay_stream``), not answered whole

    @functools.cached_property
    def caller_key(self) -> bool:
        """Whether the caller's own provider key went (``forward.caller_key_sent``): what its
        call makes at the provider is then its own account's, no tenant's here."""
        return caller_key_sent(self.call.upstream, self.call.identity)

    @functools.cached_property
    def operator_secrets(self) -> Secrets:
        return operator_secrets(self.call.upstream, self.call.identity)

    def reserve_usage(self) -> BilledUsage:
        usage = reserve_usage(self.call.reserved_input_tokens, self.call.reserved_output_tokens)
        return with_tool_calls(usage, self.obs)  # the reserved calls, or more if it counted more

    def usage(self, *, complete: bool) -> Usage:
        """What bills the call as it stands (``billed_usage``); a count of much text is left to
        the settle, which runs it off the event loop (``billed``)."""
        return usage_now(self.call, self.obs, self.services.tokenizer, complete=complete)

    async def billed(self, usage: Usage) -> BilledUsage:
        if isinstance(usage, Uncounted):
            return await usage_counted(
                self.call, self.obs, self.services.tokenizer, usage, self.services.settle_counts
            )
        return usage

    async def settle(self, outcome: Outcome, usage: Usage) -> Settlement:
        """Settle and record the call, once: the first outcome wins, later calls get its result.

        Both run in one task that a cancelled handler does not stop (shutdown past its grace
        period cancels handlers mid-settle): such a call is neither settled a second time nor
        left out of the metrics and the log, and shutdown waits for the task
        (``Services.settling``) before it closes the journal and the store. A count of much
        text (``Uncounted``) runs in that task too: a cancelled handler's call is billed at it.

        A settle that fails on the proxy's side (a bug; a store that fails journals it instead)
        is not tried again: a first try's write may still be on its way, or journaled, and each
        would be counted (the second review). Its reservation waits for a reaper.
        """
        return await asyncio.shield(self._start_settle(outcome, usage))

    async def settle_early(self, outcome: Outcome, usage: Usage) -> Settlement:
        """``settle`` for an answer the client gets whole, with the settlement in its headers
        (a non-streaming body): that settlement as soon as the settle is on its way to the
        store, not once the store has answered. A round trip and the script's run less for the
        client to wait, and the settle is still ahead of every later command on the connection
        the reserves share: the client's next call, reserved here, finds this one's reserve
        replaced (one another worker or instance serves may, rarely, reach the store first).

        Where the store's answer may differ from what was asked (a reaper may have billed the
        call, its lease half gone; a reservation the store lost would no longer be billed, 90%
        of the settled marker's life gone), where context writes ride with the settle (the next
        call may continue this one), or when the store cannot say it sent the settle, this waits
        for the answer as ``settle`` does. A settle that then fails is journaled as before."""
        loop = asyncio.get_running_loop()
        early: asyncio.Future[Settlement] = loop.create_future()
        settled = self._start_settle(outcome, usage, early)
        await asyncio.wait((early, settled), return_when=asyncio.FIRST_COMPLETED)
        if early.done() and not settled.done():
            return early.result()
        return await asyncio.shield(settled)

    def _start_settle(
        self, outcome: Outcome, usage: Usage, early: asyncio.Future[Settlement] | None = None
    ) -> asyncio.Future[Settlement]:
        if self._settling is None:
            # A whole answer's text is all read at once (a stream call's too, answered whole): its
            # "first token" would be its whole duration, mixed into the streams' per model.
            self.call.first_token_at = self.obs.first_token_at if self.streamed else None
            served = self.obs.service_tier
            if served is None and self.obs.tier_told is not None:  # told in part (Anthropic)
                served = messages_tier_served(
                    self.call.service_tier,
                    self.obs.tier_told,
                    geo_named=self.call.body.get("inference_geo") is not None,
                    priced=self.call.tier_rates,
                )
            self.call.served_tier = served
            self._settlement = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(self._settle_and_record(outcome, usage, self._settlement, early))
            self.services.settling.add(task)
            task.add_done_callback(self._settled)
            self._settling = task
        assert self._settlement is not None
        return self._settlement

    def _settled(self, task: asyncio.Future[Settlement]) -> None:
        self.services.settling.discard(task)
        settlement = self._settlement
        if settlement is not None and not settlement.done():
            # Failed or cancelled before it settled: the handler's wait ends the same way.
            error = None if task.cancelled() else task.exception()
            if error is None:
                settlement.cancel()
            else:
                settlement.set_exception(error)
                # Read here: a handler cancelled while it waited (shutdown past its grace period)
                # no longer reads it, and asyncio would report it a second time, as unread.
                settlement.exception()
        if not task.cancelled() and task.exception() is not None:
            # Neither settled nor journaled (a store failure journals): its reservation waits
            # for a reaper, which settles it at its reserve.
            log.error(
                "settle or its record failed",
                exc_info=task.exception(),
                extra={"request_id": self.call.request_id},
            )

    async def _settle_and_record(
        self,
        outcome: Outcome,
        usage: Usage,
        settled: asyncio.Future[Settlement],
        early: asyncio.Future[Settlement] | None,
    ) -> Settlement:
        # A failure reaches ``settled`` in _settled.
        settlement = await self._settle(outcome, usage, early)
        settled.set_result(settlement)
        ended_at = self.call.answered_at or time.monotonic()
        overhead = ended_at - self.call.started_at - self.upstream_s
        # Recorded once the answer has gone (its headers or last event carry the settlement):
        # the client does not wait for the metrics and the call's log line. Two turns of the
        # loop: the handler's wait, through a shield, wakes on the second and answers in it
        # (unless its write must wait for the client: recorded then, all the same).
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        record_call(
            self.services.metrics, self.services.config, self.call, settlement, overhead, self.answer_status
        )
        return settlement

    async def _settle(
        self, outcome: Outcome, usage: Usage, early: asyncio.Future[Settlement] | None = None
    ) -> Settlement:
        # Counted here, in the settle's task: a handler cancelled meanwhile still settles the
        # call at the count, and the count is the first settle's alone.
        if isinstance(usage, Uncounted):  # not ``billed``: a coroutine more on every settle
            try:
                usage = await usage_counted(
                    self.call, self.obs, self.services.tokenizer, usage, self.services.settle_counts
                )
            except Exception as err:
                # Raised here, it failed the settle: the call stayed reserved for a reaper, a
                # lease and a grace later. Billed at its reserve now, as a count that cannot be
                # made (``count_input``): what it may have spent.
                log.warning(
                    "could not count a call's texts; billed at its reserve",
                    extra={"request_id": self.call.request_id, "error": repr(err)},
                )
                usage = self.reserve_usage()
        refining = self.call.refining
        if refining is not None and not refining.done():
            # What it has not done yet would only lower a reserve about to go; and a backlog of
            # counts not started (a fast upstream, new large prompts) would grow without bound.
            # A shrink already on its way is waited for (``refine``): it may land all the same,
            # and the reserve this call knows must stay the one Redis holds.
            refining.cancel()
            await asyncio.wait((refining,))
            if refining.cancelled():
                self.services.metrics.quick_estimates.labels("dropped").inc()
        if usage.source == "reserve" and not usage.input_known:
            # Billed at its reserve: at the exact count, not the quick bound, and taken from the
            # estimate as it is now: a count that landed since the usage was worked out may have
            # lowered the reserve already.
            await self.count_input()
            usage = self.reserve_usage()
        made = contexts_made(self)
        owned = contexts_owned(self, made)
        if (made or owned) and not usage.input_tokens + usage.output_tokens:
            made = owned = []  # billed nothing (it never went out): it made no context
        kept = made if made and self.services.config.limits.prior_context_ttl_s else []
        waits: list[Awaitable[None]] = [remember(self, kept, usage)] if kept else []
        # A stream's early write marked them already (unless still on its way, or it failed).
        keeping = self.keeping is not None and not self.keeping.done()
        claims = owned if keeping else [i for i in owned if i not in self.claimed]
        if claims:
            waits.append(claim(self, claims))
        if self.keeping is not None and not self.keeping.done():
            waits.append(self.keeping)  # a stream's early write, still waiting on the store
        told = None
        if early is not None and not waits and self._lease_fresh():
            told = functools.partial(_tell, early, self.call)
        settling = settle(
            self.services.store,
            self.services.journal,
            self.call,
            outcome,
            usage,
            self.obs.finish_reasons,
            marker_ttl_s=self.services.config.limits.settled_marker_ttl_s,
            owned_contexts=owned,  # journaled: a mark lost with the store is made when it is back
            on_sent=told,
        )
        if waits:
            # In the settle's round trip: a client's next call, continuing this one, is sent only
            # once this answer has gone. A size kept is never lowered (``remember_context``): the
            # order in which the two writes land does not matter.
            settlement, _ = await asyncio.gather(settling, asyncio.gather(*waits))
        else:
            settlement = await settling
        if not settlement.stored:
            self.services.metrics.store_errors.labels("settle").inc()
        elif owned and (unmarked := [c for c in owned if c not in self.claimed]):
            await self._journal_marks(unmarked)
        return settlement

    async def _journal_marks(self, ids: list[str]) -> None:
        """The settle landed and its marks did not (on a Cluster, the master of a mark is not
        always the tenant's): journaled on their own, made once the store takes them, or the
        contexts stay unmarked, open to another tenant's call continuing them. A settle that
        did not land journaled them with it."""
        reservation = self.call.reservation
        assert reservation is not None
        line = marks_line(
            tenant=reservation.tenant, reservation_id=reservation.id, run_id=reservation.run_id, ids=ids
        )
        try:
            await self.services.journal.append_off_loop(line)
        except Unsynced as disk:  # in the file: replayed as any line
            log.error(
                "contexts' marks journaled, their sync failed",
                extra={"request_id": self.call.request_id, "error": str(disk)},
            )
        except OSError as disk:
            log.critical(
                "contexts left unmarked: their marks could not be journaled",
                extra={"request_id": self.call.request_id, "error": str(disk)},
            )

    def _lease_fresh(self) -> bool:
        """Whether the store writes what the settle asks: no reaper can have billed the call (its
        lease, as Redis last confirmed it, has at least half its time left: clocks and delays
        differ; a whole answer's call ends within its timeout, 95% of its lease by default), and
        a reservation the store lost is still billed (``settle.bill_if_lost_until_ms``)."""
        reservation = self.call.reservation
        if reservation is None:
            return False
        age_s = time.monotonic() - self.call.lease_confirmed_at
        marker_s = self.services.config.limits.settled_marker_ttl_s * MARKER_TRUST
        return age_s < min(reservation.lease_ms / 1000 * EARLY_ANSWER_LEASE_PART, marker_s)

    async def count_input(self) -> None:
        """Count a quick bound for a call billed at its reserve, if the background count has not
        landed: on the settle count threads, not behind other calls' counts on the estimate
        thread or reserves' counts."""
        if self.call.estimate.input_exact:
            return
        try:
            est = self.call.estimate
            # At the prices the count chooses (``refine.take_count``), as the settle bills it.
            count = functools.partial(counted, est, self.services.tokenizer, self.call.encoding)
            take_count(self.call, await self.services.settle_counts.run(self.call.identity.tenant, count))
        except Exception as err:  # the quick bound is an upper bound: billed at it
            self.services.metrics.quick_estimates.labels("failed").inc()
            log.warning(
                "could not count a reserve", extra={"request_id": self.call.request_id, "error": repr(err)}
            )
            # Final: a stream keeping its context counts before its settle, which tries no more.
            self.call.estimate = replace(self.call.estimate, uncounted=())

    def error(
        self,
        status: int,
        message: str,
        error_type: str,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        return self.call.dialect.error_response(status, message, error_type, code=code, headers=headers)

    def headers(self, settlement: Settlement) -> dict[str, str]:
        return {
            **self.provider_headers,
            **self.call.dialect.id_headers(self.call.request_id),
            **billing_headers(self.call, settlement),
        }

    # -- the exchange ---------------------------------------------------------------------

    async def run(self) -> web.StreamResponse:
        tenant = tenant_label(self.call.identity.tenant, self.services.config)
        inflight = self.services.metrics.inflight.labels(tenant)
        inflight.inc()
        try:
            client = self.request.transport
            if client is None or client.is_closing():
                # The client left while its call was reserved (a slow store, a client's short
                # timeout): its answer would reach nobody, and the provider would bill it all the
                # same. Nothing goes out, and nothing is billed.
                return await self.failed(
                    "client_disconnected",
                    CLIENT_CLOSED,
                    "The client closed the connection before the call went out.",
                    NOTHING_BILLED,
                )
            # A stream call's lease is renewed from the moment it goes out: its headers may take
            # its connection's time and timeout_s more, its body is bounded only by its silences
            # (``timeout_for``), and its lease covers timeout_s (a whole answer's every wait).
            renewal = None
            if self.call.stream:
                renewal = LeaseRenewal(self.call, self.services.store, self.services.metrics)
            try:
                return await self._forward(renewal)
            finally:
                if renewal is not None:
                    renewal.stop()
        except asyncio.CancelledError:
            # The server is shutting down past its grace period: a call that went out is
            # charged at its reserve unless the provider already told us its usage.
            if self._settling is None:
                await self.settle(Outcome("shutdown"), self._cut_usage())
            raise
        except Exception:
            # The error middleware's answer to it (a started stream's: its connection closed).
            self.answer_status = 500
            raise
        finally:
            inflight.dec()
            if self._settling is None:
                # An unexpected error after the call went out (a stream ends itself on one, its
                # status gone out: ``relay_stream``): charged, never dropped.
                await self.settle(Outcome("upstream_error"), self._cut_usage())

    async def _forward(self, renewal: LeaseRenewal | None) -> web.StreamResponse:
        started = time.monotonic()
        query = self.request.rel_url.raw_query_string
        opening = open_upstream(self.services.session, self.call, query)
        if self.call.stream and self.call.policy.on_client_disconnect == "cancel":
            upstream = await unless_client_leaves(opening, self.call, self.request.transport)
        else:
            upstream = await opening
        self.upstream_s += time.monotonic() - started
        if isinstance(upstream, TransportFailure):
            return await self._transport_failure(upstream)
        try:
            self.call.upstream_status = upstream.status
            self.provider_headers = provider_headers(upstream, self.operator_secrets)
            if renewal is not None and upstream.status < 300 and not _is_json(upstream.content_type):
                # A stream asked for is read as one whatever its type, as the SDK reads it
                # (servers label theirs x-ndjson, text/plain, or nothing); JSON is a provider
                # that ignored ``stream``, relayed whole.
                self.streamed = True
                return await relay_stream(self, upstream, renewal)
            if upstream.status >= 300:  # redirects are not followed: not an answer either
                return await relay_upstream_error(self, upstream)
            return await relay_body(self, upstream)
        finally:
            upstream.close()

    def _cut_usage(self) -> Usage:
        """What bills a call cut short: nothing while its connection to the upstream was still
        being made (nothing of it went out, as for a connection refused), else what was seen or
        its reserve."""
        return NOTHING_BILLED if self.call.connecting else self.usage(complete=False)

    async def _transport_failure(self, failure: TransportFailure) -> web.Response:
        timed_out = failure.kind in ("timeout", "connect_timeout")
        tag: OutcomeTag = "upstream_timeout" if timed_out else "upstream_error"
        client = self.request.transport
        if client is None or client.is_closing():
            # The client had left (its own timeout, shorter than the upstream's): the call is
            # tagged as its stream's or body's would be once answered, the bill the same.
            tag = "client_disconnected"
        usage = self.reserve_usage() if failure.went_out else NOTHING_BILLED
        return await self.failed(tag, 504 if timed_out else 502, failure.detail, usage, retry=failure.retry)

    async def failed(
        self,
        tag: OutcomeTag,
        status: int,
        message: str,
        usage: BilledUsage | None = None,
        *,
        retry: bool | None = None,
    ) -> web.Response:
        """Settle a call the upstream failed (at ``usage``, else what was seen or the reserve)
        and answer the client with the API's error, the bill in its headers."""
        self.answering(status)
        settlement = await self.settle(
            Outcome(tag), usage if usage is not None else self.usage(complete=False)
        )
        headers = self.headers(settlement)
        if retry is not None:
            headers["x-should-retry"] = "true" if retry else "false"
        return self.error(status, message, "upstream_error", code=tag, headers=headers)

    def answering(self, status: int) -> None:
        """The status the client is answered, for the call's log line: none (``CLIENT_CLOSED``)
        when it has left already."""
        client = self.request.transport
        self.answer_status = CLIENT_CLOSED if client is None or client.is_closing() else status

    def scrub(self, raw: bytes) -> bytes:
        """An upstream that echoes the proxy's key (in an error, a 200 error object, a stream's
        error event) never gets it past the proxy."""
        return scrubbed(raw, self.operator_secrets)

    def rejection_message(self, settlement: Settlement) -> str:
        return (
            f"The answer was rejected by the proxy's policy ({settlement.outcome.reason}). "
            f"It was billed: {settlement.usage.input_tokens} input tokens, "
            f"{settlement.usage.output_tokens} output tokens. Retrying will be billed again."
        )


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")
