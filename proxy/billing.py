"""Reserve before the call, settle after it: the two store steps of the billing path."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import orjson

from proxy.call import Call
from proxy.config import Config, TierConfig
from proxy.errors import BadRequest, BudgetExceeded, StoreError
from proxy.journal import Journal, PendingSettlement
from proxy.metrics import Metrics
from proxy.outcome import BilledUsage, Outcome
from proxy.payload import set_output_cap
from proxy.pricing import MAX_AMOUNT, cost_micros, reserve_amounts, worst_rates
from proxy.refine import Counter, count_first, refine
from proxy.scopes import scopes_for
from proxy.store import ACTUAL_METERS, Clamp, Refusal, Reservation, Scope, Store, Tentative

log = logging.getLogger("proxy.billing")


@dataclass(frozen=True, slots=True, kw_only=True)
class Settlement:
    outcome: Outcome
    usage: BilledUsage
    cost_micros: int
    # The ledger entry this call wrote; None when the store did not answer (``stored`` False:
    # journaled, written on replay) or the reservation was settled before (a reaper took it).
    entry_id: str | None
    finish_reasons: str
    actual: dict[str, int]
    overshoot_tokens: int
    stored: bool = True


def lease_ms(call: Call, config: Config) -> int:
    return int((call.upstream.timeout_s + config.limits.lease_margin_s) * 1000)


def _refusal_error(refusal: Refusal) -> BudgetExceeded:
    scope = refusal.scope
    needed = refusal.amount
    message = (
        f"Budget exceeded: scope '{scope.name}', meter '{refusal.meter}', ceiling {refusal.ceiling}, "
        f"used {refusal.used}, reserved {refusal.reserved}, this request needs {needed}."
    )
    if passing(refusal):
        message += " Calls in flight hold that room: the same request may fit when they end."
    headers = {
        "x-should-retry": "true" if passing(refusal) else "false",
        "x-billing-refused-meter": refusal.meter,
        "x-billing-refused-scope": scope.name,
    }
    if passing(refusal):
        headers["retry-after"] = "1"
    elif scope.resets_at_s is not None:
        headers["retry-after"] = str(max(1, scope.resets_at_s - int(time.time())))
    return BudgetExceeded(message, headers=headers)


def passing(refusal: Refusal) -> bool:
    """Whether the room this call lacks is held only by calls in flight: a concurrency ceiling,
    or token or cost reserves that settle at what the calls really used. A retry may fit
    moments later (the SDK retries when told to). Requests in flight all count when they
    settle: a request ceiling never frees itself that way."""
    if refusal.meter == "concurrent":
        return True
    return (
        refusal.meter != "requests"
        and refusal.reserved > 0
        and refusal.used + refusal.amount <= refusal.ceiling
    )


def _clamp_for(call: Call, tier: TierConfig | None) -> Clamp | None:
    if tier is None or tier.on_budget_short != "clamp" or call.endpoint == "embeddings":
        return None
    rates = worst_rates(call.rates) or {"input": 0, "output": 0}
    return Clamp(
        min_output_tokens=max(tier.min_output_tokens, _least_cap_accepted(call)),
        choices=call.generations,  # the cap holds for every answer written, returned or not
        input_cost_exact=call.estimate.input_tokens * rates["input"],
        output_rate=rates["output"],
    )


# The Responses API refuses a max_output_tokens below 16 (integer_below_min_value).
RESPONSES_LEAST_CAP = 16


def _least_cap_accepted(call: Call) -> int:
    """The smallest cap the provider takes for this request: a clamp below it would have the
    call refused upstream instead of refused (or answered) here."""
    if call.endpoint == "responses":
        return RESPONSES_LEAST_CAP
    thinking = call.body.get("thinking") if call.endpoint == "messages" else None
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
            return budget + 1  # Anthropic: max_tokens must be above the thinking budget
    return 1


def _apply_clamp(call: Call, reservation: Reservation) -> None:
    """Lower the request's own output cap to what the budget affords."""
    per_choice = reservation.clamped_output_per_choice
    field = call.estimate.output_cap_field or "max_tokens"
    set_output_cap(call.body, field, per_choice)
    call.clamped = True
    call.estimate = replace(
        call.estimate, output_tokens=reservation.amounts["output_tokens"], output_cap_field=field
    )


async def reserve(
    store: Store,
    journal: Journal,
    call: Call,
    config: Config,
    *,
    metrics: Metrics,
    count_now: Counter,
    count_later: Counter,
) -> Reservation:
    """Reserve the worst case against every scope, all or nothing; raise when it does not fit.

    A quick estimate (much new text at its byte length) reserves tentatively: when that does not
    fit, the input is counted exactly first and reserved again, so a budget refuses or clamps only
    on the exact count; when it fits, the call goes on at once and the reserve is lowered to the
    exact count in the background (``refine``). ``count_now`` counts for a reserve that waits
    (not queued behind the refinements of other calls, which ``count_later`` runs)."""
    tier = config.tiers.get(call.identity.tier)
    run_ttl_s = config.limits.run_ttl_s
    scopes = scopes_for(
        call.identity,
        call.run_id,
        tier,
        datetime.now(UTC),
        run_ttl_s=run_ttl_s,
        tenant_periods=config.tenant_periods,
    )
    if call.rates is None and any("cost_micros" in s.ceilings for s in scopes):
        raise BadRequest(
            f"The model '{call.model}' has no price in the config, and your tier limits cost; "
            "refusing rather than pricing it at 0.",
            param="model",
            code="model_not_priced",
        )
    record = orjson.dumps(
        {
            "request_id": call.request_id,
            "run_id": call.run_id,
            "key": call.identity.key_name,
            "endpoint": call.endpoint,
            "model": call.model,
            "upstream": call.upstream_name,
            "stream": call.stream,
            "time_ms": call.started_wall_ms,
            "run_ttl_s": run_ttl_s,  # for a reaper's settle: how long the run's ledger index stays
        },
    ).decode()
    asked = time.monotonic()  # the lease runs from the script's run, a little after this
    in_flight = False  # a reserve sent, its answer not read yet
    try:
        if not call.estimate.input_exact and not config.limits.quick_estimates:
            await count_first(call, count_later, metrics)  # one count at a time, as configured
            asked = time.monotonic()
        in_flight = True
        result = await _reserve(store, call, config, tier, scopes, record)
        in_flight = False
        if isinstance(result, Tentative):
            metrics.quick_estimates.labels("counted_first").inc()
            await count_first(call, count_now, metrics)
            asked = time.monotonic()
            in_flight = True
            result = await _reserve(store, call, config, tier, scopes, record)
    except StoreError as err:
        if err.maybe_applied:
            release_unforwarded(call, journal, [sc.key for sc in scopes], run_ttl_s)
        raise
    except asyncio.CancelledError:
        if in_flight:
            # Shutdown past its grace period: the reserve may still happen, for a call that never
            # goes out. Released (once the store answers), not reaped at its reserve.
            release_unforwarded(call, journal, [sc.key for sc in scopes], run_ttl_s)
        raise
    assert not isinstance(result, Tentative), "a final reserve is never tentative"
    if isinstance(result, Refusal):
        raise _refusal_error(result)
    if result.clamped_output_per_choice:
        _apply_clamp(call, result)
    call.reservation = result
    call.lease_confirmed_at = asked
    if not call.estimate.input_exact:
        # Counted and lowered whatever this call's own ceilings: its counters (a run, a tenant
        # window) are shared with keys of other tiers, whose ceilings must not meet the bound.
        call.refining = asyncio.ensure_future(refine(store, call, count_later, metrics))
    return result


async def _reserve(
    store: Store,
    call: Call,
    config: Config,
    tier: TierConfig | None,
    scopes: list[Scope],
    record: str,
) -> Reservation | Refusal | Tentative:
    amounts = reserve_amounts(call.estimate, call.rates)
    if max(amounts.values()) > MAX_AMOUNT:
        # Thousands of prompts x best_of x max_tokens, say: refused before anything is written.
        raise BadRequest(
            f"This request's worst case ({amounts['output_tokens']} output tokens, "
            f"{amounts['cost_micros']} micro-units) is more than the proxy can account for: "
            "lower max_tokens, n, best_of or the number of prompts."
        )
    return await store.reserve(
        tenant=call.identity.tenant,
        reservation_id=call.reservation_id,
        run_id=call.run_id,
        scopes=scopes,
        amounts=amounts,
        lease_ms=lease_ms(call, config),
        record=record,
        clamp=_clamp_for(call, tier),
        tentative=not call.estimate.input_exact,
    )


# The part of the settled marker's life the proxy counts on (clocks and delays differ).
MARKER_TRUST = 0.9


def bill_if_lost_until_ms(call: Call, marker_ttl_s: int) -> int:
    """Until when a call that went out is billed even if the store lost its reservation.

    A reaper settles a call only after Redis last confirmed its lease (the reserve, a renewal),
    and its settle leaves the marker for ``marker_ttl_s``: until that long after the last
    confirmation, a settle finding neither reservation nor marker cannot be a second one."""
    left_s = marker_ttl_s * MARKER_TRUST - (time.monotonic() - call.lease_confirmed_at)
    return int(time.time() * 1000 + left_s * 1000) if left_s > 0 else 0


def entry_fields(
    call: Call, outcome: Outcome, usage: BilledUsage, cost: int, finish_reasons: str
) -> dict[str, str]:
    now = time.monotonic()
    ttft_ms = "" if call.first_token_at is None else str(int((call.first_token_at - call.started_at) * 1000))
    overshoot = max(
        0, usage.input_tokens + usage.output_tokens - call.reserved_input_tokens - call.reserved_output_tokens
    )
    return {
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
        "finish_reasons": finish_reasons,
        "input_tokens": str(usage.input_tokens),
        "cached_input_tokens": str(usage.cached_input_tokens),
        "cache_creation_input_tokens": str(usage.cache_creation_input_tokens),
        "output_tokens": str(usage.output_tokens),
        "reasoning_tokens": str(usage.reasoning_tokens),
        "total_tokens": str(usage.total_tokens),
        "usage_source": usage.source,
        "cost_micros": str(cost),
        "reserved_input_tokens": str(call.reserved_input_tokens),
        "reserved_output_tokens": str(call.reserved_output_tokens),
        "overshoot_tokens": str(overshoot),
        "clamped": "1" if call.clamped else "0",
        "upstream_status": str(call.upstream_status),
        "latency_ms": str(int((now - call.started_at) * 1000)),
        "ttft_ms": ttft_ms,
    }


async def settle(
    store: Store,
    journal: Journal,
    call: Call,
    outcome: Outcome,
    usage: BilledUsage,
    finish_reasons: dict[int, str],
    *,
    marker_ttl_s: int,
) -> Settlement:
    """Replace the reserve by the actual figures and append the ledger entry, exactly once (the
    caller shields it: see ``Exchange._settle``); journaled when the store fails."""
    reservation = call.reservation
    assert reservation is not None, "settle without reserve"
    cost = cost_micros(
        # At the reserve, nobody knows which kinds its tokens were: priced as the reserve was
        # (and as a reaper bills it), every token at its dearest rate.
        worst_rates(call.rates) if usage.source == "reserve" else call.rates,
        input_tokens=usage.input_tokens,
        cached_input_tokens=usage.cached_input_tokens,
        output_tokens=usage.output_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        cache_creation_input_tokens=usage.cache_creation_input_tokens,
    )
    if cost > MAX_AMOUNT:
        # Counts up to 10**12 are taken from a provider; at a high unit price their cost can
        # pass what the store holds, and a settle it refuses would leave no ledger entry.
        log.warning("cost above the store's limit, billed at the limit", extra={"cost_micros": cost})
        cost = MAX_AMOUNT
    reasons = ",".join(finish_reasons[i] for i in sorted(finish_reasons))
    entry = entry_fields(call, outcome, usage, cost, reasons)
    actual = {
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
    pending = PendingSettlement(
        tenant=reservation.tenant,
        reservation_id=reservation.id,
        run_id=reservation.run_id,
        scope_keys=[s.key for s in reservation.scopes],
        actual=actual,
        entry=entry,
        bill_if_lost_until_ms=bill_if_lost_until_ms(call, marker_ttl_s),
        scope_ttls_s=[s.ttl_s for s in reservation.scopes],
        runlog_ttl_s=next((s.ttl_s for s in reservation.scopes if s.name == "run"), 0),
    )
    entry_id, stored = await settle_or_journal(store, journal, pending)
    return Settlement(
        stored=stored,
        outcome=outcome,
        usage=usage,
        cost_micros=cost,
        entry_id=entry_id,
        finish_reasons=reasons,
        actual=actual,
        overshoot_tokens=int(entry["overshoot_tokens"]),
    )


async def settle_or_journal(
    store: Store, journal: Journal, pending: PendingSettlement
) -> tuple[str | None, bool]:
    """The ledger entry's id (None: settled before, by a reaper or an earlier try) and whether
    the store answered (False: journaled, or left to a reaper)."""
    try:
        return await pending.apply(store), True
    except StoreError as err:
        # The answer is not held back: the settlement waits in the local journal and is applied
        # when the store is back (exactly once: settling is idempotent by reservation id).
        try:
            journal.append(pending)
        except OSError as disk:
            # Not lost: its reservation stays in the store, where a reaper bills it at its
            # reserve once the store is back. The answer still goes to the client: an error now
            # would have its SDK retry, and pay, the same call again.
            log.critical(
                "settle failed and could not be journaled; a reaper will bill the reserve",
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
    If the reserve never happened, applying it changes nothing."""
    zero = dict.fromkeys(ACTUAL_METERS, 0)
    usage = BilledUsage(
        input_tokens=0, cached_input_tokens=0, output_tokens=0, reasoning_tokens=0, source="none"
    )
    entry = entry_fields(call, Outcome("not_forwarded"), usage, 0, "")
    try:
        journal.append(
            PendingSettlement(
                tenant=call.identity.tenant,
                reservation_id=call.reservation_id,
                run_id=call.run_id,
                scope_keys=scopes,
                actual=zero,
                entry=entry,
                runlog_ttl_s=run_ttl_s,
            )
        )
    except OSError as disk:
        # The client still hears that nothing went out (not a 500); should the reserve have
        # happened, a reaper bills it at its reserve, as for a process that died here.
        log.critical(
            "the release of an unforwarded reserve could not be journaled",
            extra={"reservation_id": call.reservation_id, "journal_error": str(disk)},
        )


def budget_headers(call: Call, settlement: Settlement) -> dict[str, str]:
    """Room left on the tightest limited meter, after this call's real figures replaced its reserve."""
    reservation = call.reservation
    if reservation is None or reservation.tightest_meter is None:
        return {}
    meter = reservation.tightest_meter
    actual = settlement.actual.get(meter, 0) if meter != "concurrent" else 0
    refund = reservation.amounts.get(meter, 0) - actual
    return {f"x-budget-remaining-{meter.replace('_', '-')}": str(reservation.tightest_remaining + refund)}


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
    """An SSE comment SDKs ignore, carrying the tag a non-streaming call gets as headers."""
    payload = {
        "request_id": call.request_id,
        "run_id": call.run_id,
        "outcome": settlement.outcome.label,
        "input_tokens": settlement.usage.input_tokens,
        "cached_input_tokens": settlement.usage.cached_input_tokens,
        "output_tokens": settlement.usage.output_tokens,
        "reasoning_tokens": settlement.usage.reasoning_tokens,
        "usage_source": settlement.usage.source,
        "cost_micros": settlement.cost_micros,
    }
    return b": billing " + orjson.dumps(payload) + b"\n\n"
