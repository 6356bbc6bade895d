"""Reserve before the call: the worst case against every scope, all or nothing.

A call whose reserve does not fit is refused here, before anything goes upstream; a clamp tier
lowers its output cap to what fits instead. The settle after the call is ``settle``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

import orjson

from proxy.call import Call, context_key
from proxy.config import Config
from proxy.config_tiers import TierConfig
from proxy.errors import BadRequest, BudgetExceeded, StoreError, UnknownId
from proxy.forward import caller_key_sent
from proxy.journal import Journal
from proxy.metrics import Counter as MetricCounter
from proxy.metrics import Metrics
from proxy.payload import set_output_cap
from proxy.plan import least_cap_accepted
from proxy.pricing import MAX_AMOUNT, reserve_amounts, worst_rates
from proxy.record import record_entry
from proxy.refine import Counter, count_first, refine
from proxy.scopes import scopes_for
from proxy.settle import release_now, release_unforwarded, release_unforwarded_off_loop
from proxy.store import Clamp, Refusal, Reservation, Scope, Store, Tentative, WindowEnded
from proxy.tool_fees import billed_tool_calls, tool_calls_field

log = logging.getLogger("proxy.reserve")
# How many times a reserve script is sent, its windows picked again each time it ran after one of
# them ended or before one began: picked again by the store's clock as it ran, a window ends
# before the next send only if the store is that slow again, for as long as the shortest window
# (a minute), and begins after it only if that clock steps back again.
WINDOW_PICKS = 3


class Reloaded(Exception):
    """The config was reloaded while the reserve waited (a count, the store): nothing is
    reserved; the call is to be judged again under the config in force (``handlers``)."""


class Told:
    """What a call has counted in the metrics, kept across its plans: a reload before its
    reserve script plans it again (``Reloaded``), and what the first plan counted (the context
    it continues, its bound counted first) would be counted twice for the one call."""

    def __init__(self) -> None:
        self._told: set[tuple[int, str]] = set()

    def once(self, counter: MetricCounter, label: str) -> None:
        key = (id(counter), label)
        if key not in self._told:
            self._told.add(key)
            counter.labels(label).inc()


def lease_ms(call: Call, config: Config) -> int:
    return int((call.upstream.timeout_s + config.limits.lease_margin_s) * 1000)


def _refusal_error(refusal: Refusal, *, now_s: float, fits_nowhere: bool = False) -> BudgetExceeded:
    """``fits_nowhere``: a window in its way would refuse the request even empty (it alone passes
    the ceiling): no reset helps, so none is named."""
    scope = refusal.scope
    needed = refusal.amount
    message = (
        f"Budget exceeded: scope '{scope.name}', meter '{refusal.meter}', ceiling {refusal.ceiling}, "
        f"used {refusal.used}, reserved {refusal.reserved}, this request needs {needed}."
    )
    if refusal.clears:
        message += " Calls in flight hold that room: the same request may fit when they end."
    headers = {
        "x-should-retry": "true" if refusal.clears else "false",
        "x-billing-refused-meter": refusal.meter,
        "x-billing-refused-scope": scope.name,
    }
    resets = [s.resets_at_s for s in refusal.waits_on or (scope,)]
    if refusal.clears:
        headers["retry-after"] = "1"
    elif not fits_nowhere and all(at is not None for at in resets):
        # When the last window that refuses it has reset (a scope for good, such as a key's
        # lifetime: none).
        headers["retry-after"] = str(max(1, max(at for at in resets if at is not None) - int(now_s)))
    return BudgetExceeded(message, headers=headers)


def _clamp_for(call: Call, tier: TierConfig | None) -> Clamp | None:
    if tier is None or tier.on_budget_short != "clamp" or call.endpoint == "embeddings":
        return None
    rates = worst_rates(call.rates_reserved, images=call.asks_images) or {"input": 0, "output": 0}
    return Clamp(
        min_output_tokens=max(
            tier.min_output_tokens,
            least_cap_accepted(
                call.endpoint, call.body, anthropic_beta=call.feature_headers.get("anthropic-beta", "")
            ),
        ),
        # The cap holds for every answer written, returned or not, in each of its passes.
        choices=call.generations * call.estimate.output_passes,
        # The fixed part of the cost: the input, and the hosted tools' calls reserved.
        input_cost_exact=call.estimate.input_tokens * rates["input"] + call.estimate.tool_fees_exact,
        output_rate=rates["output"],
    )


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
    in_force: Callable[[], Config],
    told: Told | None = None,
) -> Reservation:
    """Reserve the worst case against every scope, all or nothing; raise when it does not fit.

    A quick estimate (much new text at its byte length) reserves tentatively: when that does not
    fit, the input is counted exactly first and reserved again, so a budget refuses or clamps only
    on the exact count; when it fits, the call goes on at once and the reserve is lowered to the
    exact count in the background (``refine``). ``count_now`` counts for a reserve that waits
    (not queued behind the refinements of other calls, which ``count_later`` runs).

    ``in_force``: the config in force now. Each reserve script runs under ``config`` only while
    that is still the one in force; a reload during a wait before it raises ``Reloaded``; ``told``
    is kept by the caller across the plans of one call."""
    told = told if told is not None else Told()
    tier = config.tiers.get(call.identity.tier)
    limits = config.limits  # read once: a config's fields are slow reads (pydantic's __getattr__)
    run_ttl_s = limits.run_ttl_s

    picked_s = 0.0  # the store's time the windows were last picked at

    def windows_at(now_s: float) -> list[Scope]:
        nonlocal picked_s
        picked_s = now_s
        # The window by the store's clock, which every instance shares (a host's own may be off).
        return scopes_for(
            call.identity,
            call.run_id,
            tier,
            datetime.fromtimestamp(now_s, UTC),
            run_ttl_s=run_ttl_s,
            tenant_periods=config.tenant_periods(call.identity.tenant),
            key_scopes=config.key_scopes,
        )

    scopes = windows_at(await store.synced_now())
    # Whether the call waited (the store's reads, its count) since its windows were picked: they
    # are picked again for the script, else a window that ended meanwhile would hold the call
    # (a day's spend past the next day's ceiling; a refusal naming a window that has reset).
    waited = False
    if call.rates_reserved is None and any("cost_micros" in s.ceilings for s in scopes):
        raise BadRequest(
            f"The model '{call.model}' has no price in the config, and your tier limits cost; "
            "refusing rather than pricing it at 0.",
            param="model",
            code="model_not_priced",
        )
    # Unless the caller's own key goes: the operator's, or none (a server that needs none, as
    # vLLM without --api-key, keeps every tenant's stored responses as one account's too).
    if (call.continues or call.references) and not caller_key_sent(call.upstream, call.identity):
        await _refuse_another_tenants_context(store, call)
        waited = True
    # Sizes are kept for Responses answers and Messages threads only: a chat message's earlier
    # audio answer is reserved as a media part (``estimate``), and what else a Messages call names
    # (a container, a message for cache diagnostics) is read as no input.
    if limits.prior_context_ttl_s and (
        (call.endpoint == "responses" and (call.continues or call.references))
        or (call.endpoint == "messages" and call.continues)
    ):
        found = await _add_prior_context(store, call)
        waited = True
        if found is not None:
            told.once(metrics.prior_contexts, found)
    kept: dict[str, object] = {
        "request_id": call.request_id,
        "run_id": call.run_id,
        "key": call.identity.key_name,
        "endpoint": call.endpoint,
        "model": call.model,
        "upstream": call.upstream_name,
        "stream": call.stream,
        "time_ms": call.started_wall_ms,
        "service_tier": call.service_tier,
        "run_ttl_s": run_ttl_s,  # for a reaper's settle: how long the run's ledger index stays
        # The marker life this instance's window to bill a lost reservation counts on (its
        # settle, journaled, may come that long after): a reaper of an instance set shorter
        # leaves its marker at least this long, or the late settle bills the call again.
        "marker_ttl_s": limits.settled_marker_ttl_s,
    }
    if call.estimate.tool_calls:  # the reserve's cost holds their fees: a reaper's entry names them
        kept["tool_calls"] = tool_calls_field(
            billed_tool_calls(call.tool_rates, (), call.estimate.tool_calls, at_reserve=True)
        )
    record = orjson.dumps(kept).decode()
    asked = time.monotonic()  # the lease runs from the script's run, a little after this
    in_flight = False  # a reserve sent, its answer not read yet

    async def send() -> Reservation | Refusal | Tentative:
        """The reserve script, sent again with its windows picked again when it ran after one of
        them ended by the store's clock (the store slow to run it: a stall, a pause; a wait here
        is ``waited``'s), or before one began (this process's measure of that clock ahead of it:
        the store's clock stepped back, a failover to a replica whose clock is behind). Picked
        at the store's clock as the script ran, which the measure may be behind or ahead of
        until it is taken again (the store's reply has that done at once)."""
        nonlocal scopes, in_flight, asked
        for _ in range(WINDOW_PICKS):
            in_flight = True
            result = await _reserve(store, call, config, tier, scopes, record)
            in_flight = False
            if not isinstance(result, WindowEnded):
                return result
            _still_in_force(config, in_force)  # the script wrote nothing
            scopes = windows_at(result.now_s)
            asked = time.monotonic()
        raise StoreError(f"reserve: the store ran it outside its windows {WINDOW_PICKS} times")

    try:
        if not call.estimate.input_exact and not limits.quick_estimates:
            # As a reserve that waits on its count: not behind every other tenant's counts.
            if not await count_first(call, count_now):
                told.once(metrics.quick_estimates, "failed")
            asked = time.monotonic()
            waited = True
        _still_in_force(config, in_force)
        if waited:
            scopes = windows_at(store.now())
        result = await send()
        if isinstance(result, Tentative):
            counted = await count_first(call, count_now)  # refused Busy: not counted first
            told.once(metrics.quick_estimates, "counted_first")
            if not counted:
                told.once(metrics.quick_estimates, "failed")
            asked = time.monotonic()
            _still_in_force(config, in_force)  # the tentative reserve wrote nothing
            scopes = windows_at(store.now())
            result = await send()
    except StoreError as err:
        if err.maybe_applied:
            await release_unforwarded_off_loop(call, journal, [sc.key for sc in scopes], run_ttl_s)
        raise
    except asyncio.CancelledError:
        if in_flight:
            # Shutdown past its grace period: the reserve may still happen, for a call that never
            # goes out. Released (once the store answers), not reaped at its reserve.
            release_unforwarded(call, journal, [sc.key for sc in scopes], run_ttl_s)
        raise
    assert not isinstance(result, Tentative), "a final reserve is never tentative"
    if in_force() is not config:
        # Reloaded while the script waited for the store after the last check (a connection
        # made again, its AUTH and SELECT; a pool's free connection): it ran under the config it
        # replaced, a key since revoked, a price since raised. Released, nothing forwarded, and
        # the call planned again under the config in force (as ``_still_in_force``).
        if isinstance(result, Reservation):
            keys = [sc.key for sc in scopes]
            try:
                await release_now(
                    call,
                    store,
                    journal,
                    keys,
                    run_ttl_s,
                    lambda entry: record_entry(metrics, in_force(), entry),
                )
            except asyncio.CancelledError:
                # Shutdown past its grace while the store took the release: journaled (synced,
                # no await), not left held for a reaper to bill a call that never went out.
                release_unforwarded(call, journal, keys, run_ttl_s)
                raise
        elif isinstance(result, Refusal):
            # Counted on its scope by the script, and the call, planned again, is counted again
            # if refused again (one 429, two refusals in the views), or served (a refusal never
            # told). A count, not a bill: one the store cannot take back is logged, not retried.
            try:
                await store.uncount_refusal(result)
            except StoreError as err:
                log.warning(
                    "a refusal under a replaced config stays counted",
                    extra={"request_id": call.request_id, "error": str(err)},
                )
        raise Reloaded
    if isinstance(result, Refusal):
        # Its reset counted from the time its windows were picked at: picked again at the store's
        # clock from its reply, the measure (``store.now()``) may be minutes off it.
        raise _refusal_error(result, now_s=picked_s, fits_nowhere=_never_fits(call, tier, scopes))
    if result.clamped_output_per_choice:
        _apply_clamp(call, result)
    call.reservation = result
    call.lease_confirmed_at = asked
    if not call.estimate.input_exact:
        # Counted and lowered whatever this call's own ceilings: its counters (a run, a tenant
        # window) are shared with keys of other tiers, whose ceilings must not meet the bound.
        call.refining = asyncio.ensure_future(refine(store, call, count_later, metrics))
    return result


def _still_in_force(config: Config, in_force: Callable[[], Config]) -> None:
    """Called after the last wait before a reserve script, with nothing of the call's in the
    store. A reload during those waits (the store's clock, prior contexts, the count, which may
    take a while) may have revoked the key or changed a ceiling, a price or the route: the
    script must not run under the config it replaced."""
    if in_force() is not config:
        raise Reloaded


def _never_fits(call: Call, tier: TierConfig | None, scopes: list[Scope]) -> bool:
    """Whether some ceiling is below what the request needs at the least (a clamp tier's least
    output): it is refused in any window, however empty."""
    est = call.estimate
    clamp = _clamp_for(call, tier)
    if clamp is not None:
        est = replace(est, output_tokens=min(est.output_tokens, clamp.min_output_tokens * clamp.choices))
    least = reserve_amounts(est, call.rates_reserved, images=call.asks_images)
    return any(
        least.get(meter, 0) > 0 and ceiling < least[meter]
        for scope in scopes
        for meter, ceiling in scope.ceilings.items()
    )


async def _refuse_another_tenants_context(store: Store, call: Call) -> None:
    """With the operator's key (or none: an upstream that needs none), every tenant's stored
    responses, conversations and their items (and Messages threads) are one account's at the
    provider: a call continuing another tenant's
    (its id seen in a log, a shared trace), or naming one of its items, would be answered from
    that tenant's context.
    Refused as the provider refuses an id it does not know, before anything is reserved or
    forwarded. An id no tenant used here (made with the provider directly, or older than the
    provider keeps it) passes, as before."""
    # Not a stored prompt: the operator's, for any tenant to name.
    contexts = [ctx for ctx in call.continues if ctx != call.stored_prompt]
    named = {context_key(ref): (what, ref) for what, ref in call.references}
    ids = contexts + [key for key in named if key not in contexts]
    if not ids:
        return
    owners = await store.context_owners(ids=ids)
    mine = (None, call.identity.tenant)
    theirs = [ctx for ctx, owner in zip(ids, owners, strict=True) if owner not in mine]
    if not theirs:
        call.continues_owned = tuple(ctx for ctx, owner in zip(ids, owners, strict=True) if owner is not None)
        return
    # In the provider's own words for an id it does not know (its status, the id in its message,
    # its code or none): an answer of the proxy's own ("Previous response not found.", a 404 with
    # a code for the provider's 400) told the tenant the id was another's, and an SDK or agent
    # matching OpenAI's code for a lost response did not take it for one.
    if call.conversation is not None and call.conversation in theirs:
        raise UnknownId(
            f"Conversation with id '{_as_given(call, 'conversation')}' not found.", param="conversation"
        )
    if call.endpoint == "messages" and any(ctx in contexts for ctx in theirs):
        # A thread continued: Anthropic's 404 for one it does not hold (expired, or never made),
        # its ``error_code`` the one an SDK or agent branches on to replay the conversation.
        thread = call.body.get("thread")
        named_id = thread.get("previous_message_id") if isinstance(thread, dict) else None
        raise UnknownId(
            f"No usable Thread state was found for previous_message_id '{named_id}'.",
            param="thread.previous_message_id",
            code="thread_not_found",
        )
    if any(ctx in contexts for ctx in theirs):
        raise BadRequest(
            f"Previous response with id '{_as_given(call, 'previous_response_id')}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    what, ref = named[theirs[0]]
    message, param = _NOT_FOUND[what]
    raise UnknownId(
        message.format(ref),
        param="container" if what == "container" and call.endpoint == "messages" else param,
    )


def _as_given(call: Call, field: str) -> str:
    """The id the body gave (the call keeps a long one as its digest): the provider names it."""
    value = call.body.get(field)
    if isinstance(value, dict):  # a conversation as an object
        value = value.get("id")
    return str(value)


# How the provider refuses an id it does not know, by what the request names (``Call.references``).
_NOT_FOUND = {
    "item": ("Item with id '{}' not found.", "input"),
    "audio": ("Audio with id '{}' not found.", "messages"),
    "container": ("Container with id '{}' not found.", "tools"),
    "input_container": ("Container with id '{}' not found.", "input"),
    # (The provider tells one it has no fingerprint of in the answer's ``diagnostics``,
    # ``previous_message_not_found``: another tenant's is refused, its prompt never compared.)
    "diagnostics": ("Message with id '{}' not found.", "diagnostics.previous_message_id"),
    # A response a Responses call's prompt cache diagnostics compare its prompt with (the provider
    # tells one it does not know in the answer, ``comparison_response_not_found``: likewise).
    "comparison": ("Response with id '{}' not found.", "prompt_cache_options.comparison_response_id"),
    # A Files API id a Messages call names (Anthropic's Files API answers one it does not hold
    # with a 404 of these words).
    "file": ("File not found: {}", "messages"),
}


async def _add_prior_context(store: Store, call: Call) -> str | None:
    """Reserve what the provider adds to the input from a context it keeps (a previous response,
    a conversation, the message a Messages thread continues): its size when the proxy billed it,
    input and output. The provider bills that context as input again, so a call sending "hi" may
    cost 100,000 input tokens; reserved at "hi", calls at once could pass a ceiling by that much.
    A context the proxy did not bill (made elsewhere, or kept past ``limits.prior_context_ttl_s``)
    is reserved at the request alone, as before, and billed on the provider's figures. The
    stored items the input names are input too: each reserved at the output of the answer that
    made it. Returns how the context was found (``prior_contexts``' label), None when none is
    continued."""
    tenant = call.identity.tenant
    added = 0
    found: str | None = None
    if call.continues:
        # A stored prompt's template is read beside the response or conversation continued,
        # which the provider never takes together: the larger of those, and the template.
        prompt = [call.stored_prompt] if call.stored_prompt is not None else []
        others = [ctx for ctx in call.continues if ctx != call.stored_prompt]
        tokens = await store.prior_context_tokens(tenant=tenant, ids=others, added=prompt)
        found = "unknown" if tokens is None else "found"
        call.prior_context_tokens = added = tokens or 0
    items = [context_key(ref) for what, ref in call.references if what == "item"]
    if items:
        added += await store.item_tokens(tenant=tenant, ids=items)
    if added:
        est = call.estimate
        # As overhead: a count of the request's text (``counted``, a settle without provider
        # usage) keeps it. Read as often as the request's input (a compacting call's summarizing
        # step reads the whole input, the context with it, before the answer does).
        call.estimate = replace(
            est,
            input_tokens=est.input_tokens + added * est.input_reads,
            prompt_overhead_tokens=est.prompt_overhead_tokens + added,
        )
        above = call.long_context_above
        if call.reserve_rates_long is not None and above is not None and call.estimate.input_tokens > above:
            # The provider bills the whole input, the context with it, at the long-context prices:
            # reserved at them, the worst case (within the threshold by a count, the model's own:
            # ``refine.take_count``).
            call.reserve_rates_short = call.rates_reserved
            call.reserve_rates = call.reserve_rates_long
            call.reserve_rates_long = None
    return found


async def _reserve(
    store: Store,
    call: Call,
    config: Config,
    tier: TierConfig | None,
    scopes: list[Scope],
    record: str,
) -> Reservation | Refusal | Tentative | WindowEnded:
    amounts = reserve_amounts(call.estimate, call.rates_reserved, images=call.asks_images)
    if max(amounts.values()) > MAX_AMOUNT:
        # Thousands of prompts x best_of x max_tokens, say: refused before anything is written.
        lower = "max_tokens, n, best_of or the number of prompts"
        if call.estimate.tool_calls or call.estimate.output_passes > 1:  # ``tool_fees``
            lower = "max_tokens, or the hosted tool calls it allows (max_uses, max_tool_calls)"
        raise BadRequest(
            f"This request's worst case ({amounts['output_tokens']} output tokens, "
            f"{amounts['cost_micros']} micro-units) is more than the proxy can account for: "
            f"lower {lower}."
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
