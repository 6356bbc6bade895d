"""Settle after the call: the real figures replace the reserve, and the ledger entry is written
in the same script, once; what the client is told of its bill (headers, the stream's comment).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import orjson

from proxy.call import Call
from proxy.errors import StoreError
from proxy.forward import operator_secrets
from proxy.journal import Journal, Unsynced
from proxy.journal_lines import OnApplied, PendingSettlement
from proxy.outcome import NOTHING_BILLED, BilledUsage, Outcome, reserve_usage
from proxy.pricing import MAX_AMOUNT, OUTPUT_RATES, cost_micros, tool_fees_exact, worst_rates
from proxy.scrub import Secrets, text_scrubbed
from proxy.service_tiers import dearest
from proxy.store import ACTUAL_METERS, MARKER_TRUST, Store
from proxy.tool_fees import ToolCalls, billed_tool_calls, tool_calls_field
from proxy.values import value_class

log = logging.getLogger("proxy.settle")

# What of a string the upstream chose (a finish reason, the tier it says served the call) an entry
# keeps, kept for good and read by the tenant: the names providers use are a few characters.
LEDGER_TEXT_CHARS = 64
# And of the finish reasons of every answer (``n``), each so cut: 128 "tool_calls" fit.
LEDGER_REASONS_CHARS = 4096
CUT = "..."


@value_class(kw_only=True)
class Settlement:
    outcome: Outcome
    usage: BilledUsage
    cost_micros: int
    # The ledger entry this call wrote; None when the store did not answer (``stored`` False:
    # journaled, written on replay), the reservation was settled before (a reaper took it), or
    # not known yet (the settlement handed to ``settle``'s ``on_sent``).
    entry_id: str | None
    finish_reasons: str
    actual: dict[str, int]
    overshoot_tokens: int
    stored: bool = True


def bill_if_lost_until_ms(call: Call, marker_ttl_s: int, *, now_s: float) -> int:
    """Until when a call that went out is billed even if the store lost its reservation.

    A reaper settles a call only after Redis last confirmed its lease (the reserve, a renewal),
    and its settle leaves the marker for ``marker_ttl_s``: until that long after the last
    confirmation, a settle finding neither reservation nor marker cannot be a second one.
    ``now_s``: the store's clock (``Store.now``), which a journal replayed elsewhere reads too."""
    left_s = marker_ttl_s * MARKER_TRUST - (time.monotonic() - call.lease_confirmed_at)
    return int(now_s * 1000 + left_s * 1000) if left_s > 0 else 0


def held_tokens(call: Call) -> tuple[int, int]:
    """The input and output tokens the store held for the call: its reservation as last lowered.
    Not its estimate, which a quick bound's count may have lowered with no shrink behind it (the
    count landed after the lease ran out or with the store failing, or at the settle itself, to
    bill a call without usage at the exact count): the bound was held, and released, then."""
    if call.reservation is None:  # a reserve whose reply was lost: what it asked for
        return call.reserved_input_tokens, call.reserved_output_tokens
    held = call.reservation.amounts
    return held.get("input_tokens", 0), held.get("output_tokens", 0)


def utf8_text(text: str) -> str:
    """``text`` as UTF-8 holds it. An answer's strings are read as the client's SDK reads them
    (``observe.parse_json``, ``parse_event_data``: Python's json), a lone surrogate escape too
    (a string cut inside an emoji), which neither orjson (the ledger entry, the journal line)
    nor Redis writes: it is made U+FFFD, as a UTF-8 decoder makes a broken sequence."""
    if text.isascii():  # the finish reasons and tiers providers name: no copy
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def ledger_text(text: str, secrets: Secrets) -> str:
    """``text``, a string the upstream chose, as an entry keeps it: the operator's ``secrets``
    replaced (an answer echoing its key: the answer's bytes are scrubbed, what the proxy read of
    them is not), cut to ``LEDGER_TEXT_CHARS``, as UTF-8 holds it."""
    # Scrubbed first: the start of a key cut short would not be found.
    return utf8_text(_cut(text_scrubbed(text, secrets), LEDGER_TEXT_CHARS))


def ledger_reasons(finish_reasons: dict[int, str], secrets: Secrets) -> str:
    """The entry's ``finish_reasons``: each answer's, in order, as ``ledger_text`` keeps it."""
    reasons = ",".join(ledger_text(finish_reasons[i], secrets) for i in sorted(finish_reasons))
    return _cut(reasons, LEDGER_REASONS_CHARS)  # an upstream naming answers never asked for


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - len(CUT)] + CUT


def entry_fields(
    call: Call,
    outcome: Outcome,
    usage: BilledUsage,
    cost: int,
    finish_reasons: str,
    tool_calls: ToolCalls = (),
) -> dict[str, str]:
    now = time.monotonic()
    ttft_ms = "" if call.first_token_at is None else str(int((call.first_token_at - call.started_at) * 1000))
    held_input, held_output = held_tokens(call)
    overshoot = max(0, usage.input_tokens + usage.output_tokens - held_input - held_output)
    entry = {
        "request_id": call.request_id,
        "reservation_id": call.reservation_id,
        "time_ms": str(call.started_wall_ms),
        "tenant": call.identity.tenant,
        "key": call.identity.key_name,
        "run_id": call.run_id,
        "endpoint": call.endpoint,
        "model": call.model,
        "upstream": call.upstream_name,
        "stream": "1" if call.stream else "0",
        "outcome": outcome.label,
        "finish_reasons": utf8_text(finish_reasons),
        "input_tokens": str(usage.input_tokens),
        "cached_input_tokens": str(usage.cached_input_tokens),
        "cache_creation_input_tokens": str(usage.cache_creation_input_tokens),
        "output_tokens": str(usage.output_tokens),
        "reasoning_tokens": str(usage.reasoning_tokens),
        "total_tokens": str(usage.total_tokens),
        "usage_source": usage.source,
        "cost_micros": str(cost),
        "reserved_input_tokens": str(held_input),
        "reserved_output_tokens": str(held_output),
        "overshoot_tokens": str(overshoot),
        "clamped": "1" if call.clamped else "0",
        "upstream_status": str(call.upstream_status),
        "latency_ms": str(int((now - call.started_at) * 1000)),
        "ttft_ms": ttft_ms,
    }
    # The tier that served the call, as its answer says (else the one asked for); priced at its
    # prices when the operator set them (``Call.rates_served``).
    tier = call.served_tier or call.service_tier
    if tier is not None and tier != "default":
        entry["service_tier"] = ledger_text(tier, operator_secrets(call.upstream, call.identity))
    # Kinds most calls have none of: only when there are some (an entry is kept for good).
    for kind, count in usage.by_kind():
        if count and f"{kind}_tokens" not in entry:
            entry[f"{kind}_tokens"] = str(count)
    if tool_calls:  # the priced hosted tools' calls billed, in its cost: "web_search=3"
        entry["tool_calls"] = tool_calls_field(tool_calls)
    return entry


async def settle(
    store: Store,
    journal: Journal,
    call: Call,
    outcome: Outcome,
    usage: BilledUsage,
    finish_reasons: dict[int, str],
    *,
    marker_ttl_s: int,
    owned_contexts: Sequence[str] = (),
    on_sent: Callable[[Settlement], None] | None = None,
) -> Settlement:
    """Replace the reserve by the actual figures and append the ledger entry, exactly once (the
    caller shields it: see ``relay.Exchange.settle``); journaled when the store fails.

    ``on_sent`` is handed the settlement the store is asked to write once that is on its way
    (``Store.settle``): its figures are those returned, unless a reaper billed the call first
    (its ``entry_id`` is not known yet)."""
    reservation = call.reservation
    assert reservation is not None, "settle without reserve"
    tool_calls = _tool_calls(call, usage)
    cost = _cost(call, usage, tool_calls)
    reasons = ledger_reasons(finish_reasons, operator_secrets(call.upstream, call.identity))
    entry = entry_fields(call, outcome, usage, cost, reasons, tool_calls)
    actual = _actual(usage, cost)
    pending = PendingSettlement(
        tenant=reservation.tenant,
        reservation_id=reservation.id,
        run_id=reservation.run_id,
        scope_keys=[s.key for s in reservation.scopes],
        actual=actual,
        entry=entry,
        bill_if_lost_until_ms=bill_if_lost_until_ms(call, marker_ttl_s, now_s=store.now()),
        scope_ttls_s=[s.ttl_s for s in reservation.scopes],
        runlog_ttl_s=next((s.ttl_s for s in reservation.scopes if s.name == "run"), 0),
        owned_contexts=list(owned_contexts),
    )
    asked = Settlement(
        outcome=outcome,
        usage=usage,
        cost_micros=cost,
        entry_id=None,
        finish_reasons=entry["finish_reasons"],
        actual=actual,
        overshoot_tokens=int(entry["overshoot_tokens"]),
    )
    told = functools.partial(on_sent, asked) if on_sent is not None else None
    entry_id, stored = await settle_or_journal(store, journal, pending, on_sent=told)
    if stored and entry_id is None:
        # A reaper billed it first (its lease ran out while it ran): the client is told what
        # the ledger holds (and the budget it left), not what this settle would have written.
        # The reaper billed the amounts the reservation's record held, which the call's estimate
        # may since have left (a quick bound counted after the lease ran out, when shrink.lua
        # lowers nothing; a settle at the reserve counting it now).
        held = reservation.amounts
        usage = reserve_usage(held.get("input_tokens", 0), held.get("output_tokens", 0))
        cost = held.get("cost_micros", 0)
        return replace(
            asked,
            outcome=Outcome("lease_expired"),
            usage=usage,
            cost_micros=cost,
            actual=_actual(usage, cost),
            overshoot_tokens=0,
        )
    # Built, not ``dataclasses.replace``d: that walks the fields on every call.
    return Settlement(
        outcome=outcome,
        usage=usage,
        cost_micros=cost,
        entry_id=entry_id,
        finish_reasons=entry["finish_reasons"],
        actual=actual,
        overshoot_tokens=asked.overshoot_tokens,
        stored=stored,
    )


def _actual(usage: BilledUsage, cost: int) -> dict[str, int]:
    """What a settle puts on the meters in place of the reserve."""
    return {
        # A call the upstream refused to connect to was not a request made (source "none").
        "requests": 0 if usage.source == "none" else 1,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
        "cost_micros": cost,
        "cached_input_tokens": usage.cached_input_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
        "cache_creation_input_tokens": usage.cache_creation_input_tokens,
    }


def _rates(call: Call, usage: BilledUsage) -> dict[str, int] | None:
    if usage.source != "reserve":
        return call.rates_billed(usage.input_tokens)
    reserved = call.rates_reserved
    if reserved is None:
        return None
    if not usage.input_known:
        # At the reserve, nobody knows which kinds its tokens were: priced as the reserve was
        # (and as a reaper bills it), every token at its dearest rate.
        return worst_rates(reserved, images=call.asks_images)
    # The provider's input (its kinds known), the reserve's output: only the output is unknown.
    # The input at the prices of the tier the answer names, else the reserve's (the dearest
    # tier that may have served it); past the long-context threshold by the provider's count,
    # no cheaper than the long-context prices, its output too.
    long = call.long_context_above is not None and usage.input_tokens > call.long_context_above
    if not long and call.reserve_rates_short is not None and not usage.tool_calls:
        # Reserved past the threshold by its estimate, the input told does not pass it: the
        # whole call at the model's own prices, as the reserve would be had the estimate not
        # passed it (the long-context prices are for a call whose input passes it, output too).
        # Not once a server tool ran: its results are read as input, so an input told before
        # them (Anthropic's message_start) is no final count, and may pass the threshold.
        reserved = call.reserve_rates_short
    billed = call.rates_billed(usage.input_tokens) or reserved
    either = dearest((reserved, billed))
    known = billed if call.served_tier else either
    worst = worst_rates(either if long else reserved, images=call.asks_images)
    assert worst is not None
    return {**known, **{kind: worst[kind] for kind in OUTPUT_RATES}}


def _tool_calls(call: Call, usage: BilledUsage) -> ToolCalls:
    """The priced hosted tools' calls billed: as the answer counts them; billed at its reserve
    (no usage came), the calls reserved, or the answer's count where that is more (of a pool,
    ``max_tool_calls``: the calls counted and what they leave of it). None for a call that
    went nowhere (source ``none``)."""
    if not call.tool_rates or usage.source == "none":
        return ()
    # A chat call's one search (``tool_fees.chat_searches``) is in no answer's count: billed as
    # reserved once the provider answered (a refusal bills no token, nor any search).
    answered_chat = call.endpoint == "chat.completions" and (usage.input_tokens or usage.output_tokens) > 0
    return billed_tool_calls(
        call.tool_rates,
        usage.tool_calls,
        call.estimate.tool_calls,
        at_reserve=usage.source == "reserve" or answered_chat,
        aliases=call.estimate.tool_aliases,
        pooled=call.estimate.tool_calls_pooled,
    )


def _cost(call: Call, usage: BilledUsage, tool_calls: ToolCalls = ()) -> int:
    cost = cost_micros(
        _rates(call, usage),
        input_tokens=usage.input_tokens,
        cached_input_tokens=usage.cached_input_tokens,
        output_tokens=usage.output_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        cache_creation_input_tokens=usage.cache_creation_input_tokens,
        cache_creation_1h_input_tokens=usage.cache_creation_1h_input_tokens,
        audio_input_tokens=usage.audio_input_tokens,
        audio_output_tokens=usage.audio_output_tokens,
        image_input_tokens=usage.image_input_tokens,
        image_output_tokens=usage.image_output_tokens,
        tool_fees_exact=tool_fees_exact(tool_calls, call.tool_rates) if tool_calls else 0,
    )
    if cost > MAX_AMOUNT:
        # Counts up to 10**12 are taken from a provider; at a high unit price their cost can
        # pass what the store holds, and a settle it refuses would leave no ledger entry.
        log.warning("cost above the store's limit, billed at the limit", extra={"cost_micros": cost})
        return MAX_AMOUNT
    return cost


async def settle_or_journal(
    store: Store, journal: Journal, pending: PendingSettlement, *, on_sent: Callable[[], None] | None = None
) -> tuple[str | None, bool]:
    """The ledger entry's id (None: settled before, by a reaper or an earlier try) and whether
    the store answered (False: journaled, or left to a reaper)."""
    try:
        return await pending.apply(store, on_sent), True
    except StoreError as err:
        # The answer is not held back: the settlement waits in the local journal and is applied
        # when the store is back (exactly once: settling is idempotent by reservation id).
        try:
            await journal.append_off_loop(pending)
        except OSError as disk:
            if isinstance(disk, Unsynced):
                # In the file, its sync failed: replayed as any line (a host crash before the
                # file's next sync may lose it, to a reaper billing the reserve).
                level, said = logging.ERROR, "settle failed; journaled, its sync failed"
            else:
                # Not lost: its reservation stays in the store, where a reaper bills it at its
                # reserve once the store is back. The answer still goes to the client: an error
                # now would have its SDK retry, and pay, the same call again.
                level, said = (
                    logging.CRITICAL,
                    "settle failed and could not be journaled; a reaper will bill the reserve",
                )
            log.log(
                level,
                said,
                extra={
                    "reservation_id": pending.reservation_id,
                    "error": str(err),
                    "journal_error": str(disk),
                },
            )
            return None, False
        log.error(
            "settle failed; journaled", extra={"reservation_id": pending.reservation_id, "error": str(err)}
        )
        return None, False


def release_unforwarded(call: Call, journal: Journal, scopes: list[str], run_ttl_s: int) -> None:
    """A reserve whose reply was lost may still have happened: journal a zero settlement for it,
    so that, once the store answers, its reservation is released (not reaped at full reserve).
    If the reserve never happened, applying it changes nothing. Synced without an await: for a
    reserve cut by shutdown, whose task is being cancelled."""
    try:
        journal.append(_release(call, scopes, run_ttl_s))
    except OSError as disk:
        _release_lost(call, disk)


async def release_unforwarded_off_loop(
    call: Call, journal: Journal, scopes: list[str], run_ttl_s: int
) -> None:
    """``release_unforwarded``, synced on a worker thread (``Journal.append_off_loop``): a store
    that times out every reserve has each one released this way."""
    try:
        await journal.append_off_loop(_release(call, scopes, run_ttl_s))
    except OSError as disk:
        _release_lost(call, disk)


async def release_now(
    call: Call, store: Store, journal: Journal, scopes: list[str], run_ttl_s: int, on_applied: OnApplied
) -> None:
    """Release a reserve that ran for a call that will not go out as reserved: at once, with a
    ``not_forwarded`` entry at zero; journaled (``release_unforwarded_off_loop``) should the
    store fail it. ``on_applied`` counts the entry written, as a journal's replay counts the
    same release (which counts it instead when the store failed this one)."""
    pending = _release(call, scopes, run_ttl_s)
    try:
        entry_id = await pending.apply(store)
    except StoreError:
        await release_unforwarded_off_loop(call, journal, scopes, run_ttl_s)
        return
    if entry_id is not None:
        on_applied(pending.entry)


def _release(call: Call, scopes: list[str], run_ttl_s: int) -> PendingSettlement:
    return PendingSettlement(
        tenant=call.identity.tenant,
        reservation_id=call.reservation_id,
        run_id=call.run_id,
        scope_keys=scopes,
        actual=dict.fromkeys(ACTUAL_METERS, 0),
        entry=entry_fields(call, Outcome("not_forwarded"), NOTHING_BILLED, 0, ""),
        runlog_ttl_s=run_ttl_s,
    )


def _release_lost(call: Call, disk: OSError) -> None:
    if isinstance(disk, Unsynced):
        # In the file, its sync failed: replayed as any line (a host crash before the file's
        # next sync may lose it). Not the critical line below (the settle's, ``settle_or_journal``).
        log.error(
            "the release of an unforwarded reserve journaled, its sync failed",
            extra={"reservation_id": call.reservation_id, "journal_error": str(disk)},
        )
        return
    # The client still hears that nothing went out (not a 500); should the reserve have
    # happened, a reaper bills it at its reserve, as for a process that died here.
    log.critical(
        "the release of an unforwarded reserve could not be journaled",
        extra={"reservation_id": call.reservation_id, "journal_error": str(disk)},
    )


def budget_headers(call: Call, settlement: Settlement) -> dict[str, str]:
    """Room left on the tightest limited meter (the least part of its ceiling left, over every
    scope), once this call's real figures replaced its reserve: its concurrency slot free again;
    the figure is the meter's least room over the scopes that limit it."""
    reservation = call.reservation
    if reservation is None or not reservation.rooms:
        return {}
    left = [
        (meter, room - (settlement.actual.get(meter, 0) if meter != "concurrent" else 0), ceiling)
        for meter, room, ceiling in reservation.rooms
    ]
    # The least part of its ceiling left, compared in integers (a ceiling of 0: none left); the
    # first of equals.
    tight, part, whole = "", 0, 0
    for meter, room, ceiling in left:
        room, ceiling = (room, ceiling) if ceiling > 0 else (0, 1)
        if not whole or room * whole < part * ceiling:
            tight, part, whole = meter, room, ceiling
    least = min(room for meter, room, _ in left if meter == tight)
    # Past its ceiling (an overshoot, billed in full): none left, as a rate limit's remaining is
    # never below 0; the views tell by how much it was passed (used above the ceiling).
    return {f"x-budget-remaining-{tight.replace('_', '-')}": str(max(least, 0))}


def billing_headers(call: Call, settlement: Settlement) -> dict[str, str]:
    return {
        **budget_headers(call, settlement),
        "x-billing-outcome": settlement.outcome.label,
        "x-billing-input-tokens": str(settlement.usage.input_tokens),
        "x-billing-output-tokens": str(settlement.usage.output_tokens),
        "x-billing-usage-source": settlement.usage.source,
        "x-billing-cost-micros": str(settlement.cost_micros),
        "x-billing-run-id": call.run_id,
    }


def billing_comment(call: Call, settlement: Settlement) -> bytes:
    """An SSE comment SDKs ignore, carrying the tag a non-streaming call gets as headers.

    One line, no blank line after it: it joins the block that follows (``[DONE]``, an error
    event) or ends the stream. A block of its own is an event to a client that has seen an
    ``id:`` field (SSE keeps the last event id, and dispatches a block holding nothing else):
    OpenAI's SDK then parses its empty data as JSON and fails."""
    usage = settlement.usage
    payload: dict[str, str | int] = {
        "request_id": call.request_id,
        "run_id": call.run_id,
        "outcome": settlement.outcome.label,
        "input_tokens": usage.input_tokens,
        "cached_input_tokens": usage.cached_input_tokens,
        "output_tokens": usage.output_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
    }
    for kind, count in usage.by_kind():  # the kinds most calls have none of, when there are some
        if count and f"{kind}_tokens" not in payload:
            payload[f"{kind}_tokens"] = count
    payload["usage_source"] = usage.source
    payload["cost_micros"] = settlement.cost_micros
    return b": billing " + orjson.dumps(payload) + b"\n"
