"""Record a settled call: metrics and the one JSON log line per call."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from proxy.call import Call
from proxy.config import Config
from proxy.errors import BudgetExceeded
from proxy.logs import CALL_LOGGER, log_call, redact
from proxy.metrics import Metrics, model_label, tenant_label
from proxy.outcome import TOKEN_KINDS
from proxy.settle import Settlement

call_log = logging.getLogger(CALL_LOGGER)


def record_call(
    metrics: Metrics, config: Config, call: Call, settlement: Settlement, overhead_s: float, status: int
) -> None:
    """``status``: what the client is answered (0: nothing, a shutdown cut the call), which the
    upstream's (``call.upstream_status``, 0: it never answered) need not be: a rejected answer
    is a 422, a connection refused a 502."""
    tenant = tenant_label(call.identity.tenant, config)
    model = model_label(call.model, config)
    usage = settlement.usage
    # The spend counters count the ledger entries this process wrote, when it wrote them: a
    # journaled settle when it is replayed, one a reaper took first by that reaper's process.
    if settlement.entry_id is not None:
        _count_spend(
            metrics,
            tenant,
            model,
            endpoint=call.endpoint,
            outcome_tag=settlement.outcome.tag,
            source=usage.source,
            tokens=usage.by_kind(),
            cost_micros=settlement.cost_micros,
            overshoot_tokens=settlement.overshoot_tokens,
            clamped=call.clamped,
        )
    if usage.source == "provider" and usage.input_tokens > 0:
        metrics.reserve_error.observe(call.reserved_input_tokens / usage.input_tokens)
    elapsed = (call.answered_at or time.monotonic()) - call.started_at
    metrics.duration.labels(call.endpoint).observe(elapsed)
    if call.first_token_at is not None:
        metrics.ttft.labels(model).observe(call.first_token_at - call.started_at)
    metrics.overhead.observe(overhead_s)
    if call_log.isEnabledFor(logging.INFO):
        log_call(
            {
                # What a client chooses (its X-Request-Id, X-Run-Id, model) may hold a key.
                "request_id": redact(call.request_id),
                "tenant": call.identity.tenant,
                "key_name": call.identity.key_name,
                "run_id": redact(call.run_id),
                "endpoint": call.endpoint,
                "model": redact(call.model),
                "stream": call.stream,
                "outcome": redact(settlement.outcome.label),
                "input_tokens": usage.input_tokens,
                "cached_input_tokens": usage.cached_input_tokens,
                "output_tokens": usage.output_tokens,
                "reasoning_tokens": usage.reasoning_tokens,
                "usage_source": usage.source,
                "cost_micros": settlement.cost_micros,
                "status": status,
                "upstream_status": call.upstream_status,
                "latency_ms": int(elapsed * 1000),
                "settled": settlement.entry_id is not None,
            }
        )


def _count_spend(
    metrics: Metrics,
    tenant: str,
    model: str,
    *,
    endpoint: str,
    outcome_tag: str,
    source: str,
    tokens: Iterable[tuple[str, int]],
    cost_micros: int,
    overshoot_tokens: int,
    clamped: bool,
) -> None:
    metrics.requests.labels(tenant, model, endpoint, outcome_tag).inc()
    for kind, count in tokens:  # cached_input a part of input, reasoning of output...: as the ledger
        if count:
            metrics.tokens.labels(tenant, model, kind, source).inc(count)
    if cost_micros:
        metrics.cost_micros.labels(tenant, model).inc(cost_micros)
    if overshoot_tokens:
        metrics.overshoot.labels(tenant, model).inc(overshoot_tokens)
    if clamped:
        metrics.clamped.labels(tenant).inc()


def record_entry(metrics: Metrics, config: Config, entry: Mapping[str, str]) -> None:
    """A ledger entry this process wrote off the request path (a journaled settle replayed, a
    lease reaped): in the spend counters as a call's own (``record_call``) would be."""
    _count_spend(
        metrics,
        tenant_label(entry["tenant"], config),
        model_label(entry["model"], config),
        endpoint=entry["endpoint"],
        outcome_tag=entry["outcome"].partition(":")[0],
        source=entry["usage_source"],
        tokens=[(kind, int(entry.get(f"{kind}_tokens") or 0)) for kind in TOKEN_KINDS],
        cost_micros=int(entry.get("cost_micros") or 0),
        overshoot_tokens=int(entry.get("overshoot_tokens") or 0),
        clamped=entry.get("clamped") == "1",
    )


def record_reaped(metrics: Metrics, config: Config, entry: Mapping[str, str]) -> None:
    """A lease this process's reaper settled at its reserve: a call the ledger charged."""
    metrics.leases_expired.inc()
    record_entry(metrics, config, entry)


def record_refusal(metrics: Metrics, config: Config, tenant: str, err: BudgetExceeded) -> None:
    scope = err.headers.get("x-billing-refused-scope", "")
    meter = err.headers.get("x-billing-refused-meter", "")
    metrics.budget_refusals.labels(tenant_label(tenant, config), scope, meter).inc()
    call_log.info("budget refusal", extra={"tenant": tenant, "scope": scope, "meter": meter})
