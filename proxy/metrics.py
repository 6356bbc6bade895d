"""Prometheus metrics, built against an injected registry (one per app, so tests stay apart).

Label values are bounded: tenants come from configs (this one's, or an earlier one's or another
instance's for spend reaped or replayed here; pass-through callers fold into ``passthrough``),
models from the config's exact names (anything else is ``other``). Never a run id, request id or
key in a label.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from proxy.config import Config
from proxy.config_base import OTHER_MODEL, PASSTHROUGH_TENANT, PASSTHROUGH_TENANT_ID

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
RATIO_BUCKETS = (0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2, 3, 5, 10)


class CounterValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: int | float = 0

    def inc(self, amount: int | float = 1) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class GaugeValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: int | float = 0

    def inc(self, amount: int | float = 1) -> None:
        self.value += amount

    def dec(self, amount: int | float = 1) -> None:
        self.value -= amount

    def set(self, value: int | float) -> None:
        self.value = value


class HistogramValue:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (``le``).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


V = TypeVar("V", CounterValue, GaugeValue, HistogramValue)


class _Family(Generic[V]):
    """One metric's label sets and their values.

    Why not ``prometheus_client``'s own metric classes: each of their updates takes a lock and
    checks its arguments, about ten times per call on the hot path, for a process whose updates
    all run on one event loop thread. Here an update is a dict lookup and an addition; the
    exposition (names, ``_total``/``_bucket``/``_sum``/``_count`` samples, ``le`` labels) is the
    same, built at scrape time, without ``_created`` samples.

    The scrape builds it on another thread (so the loop keeps serving calls), while the loop adds
    label sets: the lock keeps the dict from changing size under the scrape's walk. Only a new
    label set takes it, not an update, and the scrape holds it for a copy, not the formatting.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], V] = {}
        self._lock = threading.Lock()

    def labels(self, *values: str) -> V:
        found = self._values.get(values)
        if found is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, given {values}")
            with self._lock:
                # setdefault: a scrape may have added the label-less one meanwhile (``items``).
                found = self._values.setdefault(values, self._new())
        return found

    def _new(self) -> V:
        raise NotImplementedError

    def clear(self) -> None:
        """Drop every label set (a state read again: the old one is no longer true)."""
        with self._lock:
            self._values.clear()

    def items(self) -> list[tuple[list[str], V]]:
        if not self.labelnames and not self._values:
            self.labels()  # a metric without labels is exported from the start, at zero
        with self._lock:
            current = self._values.copy()
        return [(list(labels), value) for labels, value in current.items()]


class Counter(_Family[CounterValue]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, divisor: int = 1):
        super().__init__(name, documentation, labelnames)
        self.divisor = divisor  # e.g. integer micro-units counted, whole units exported

    def _new(self) -> CounterValue:
        return CounterValue()

    def inc(self, amount: int | float = 1) -> None:
        self.labels().inc(amount)

    def family(self) -> Metric:
        return _scalar_family(CounterMetricFamily, self, self.divisor)


class Gauge(_Family[GaugeValue]):
    def _new(self) -> GaugeValue:
        return GaugeValue()

    def set_only(self, labels: tuple[str, ...], value: int | float) -> None:
        """Set the series of ``labels`` to ``value``, every other series of the gauge dropped, in
        one step: a scrape, on its thread, never sees the gauge with no series (a ``clear`` and
        a ``labels(...).set`` apart would let it)."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, given {labels}")
        only = GaugeValue()
        only.set(value)
        with self._lock:
            self._values = {labels: only}

    def family(self) -> Metric:
        return _scalar_family(GaugeMetricFamily, self)


def _scalar_family(
    kind: type[CounterMetricFamily | GaugeMetricFamily],
    metric: _Family[CounterValue] | _Family[GaugeValue],
    divisor: int = 1,
) -> Metric:
    family = kind(metric.name, metric.documentation, labels=metric.labelnames)
    for labels, value in metric.items():
        family.add_metric(labels, value.value / divisor if divisor != 1 else value.value)
    return family


class Histogram(_Family[HistogramValue]):
    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        # prometheus_client's own spelling of ``le`` (untyped there), so the series keep their names.
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]

    def _new(self) -> HistogramValue:
        return HistogramValue(self.bounds)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._le, value.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(labels, buckets, value.sum)
        return family


class Metrics:
    """Every metric of the proxy, exported through one collector registered in ``registry``.

    Updates run on the app's event loop, unlocked; a scrape collects on another thread, and reads
    each value whole (an attribute or a list slot: a histogram's sum and buckets may disagree by
    an observation made meanwhile, until the next scrape)."""

    def __init__(self, registry: CollectorRegistry, *, currency: str = "USD") -> None:
        self.registry = registry
        self.requests = Counter(
            "llm_proxy_requests",
            "Calls settled in the ledger, by outcome, those that never went out among them "
            "(not_forwarded; a client gone, or the upstream's connection refused, first).",
            ["tenant", "model", "endpoint", "outcome"],
        )
        self.tokens = Counter(
            "llm_proxy_tokens",
            "Tokens charged, by type (input, output and their parts priced apart) and usage source.",
            ["tenant", "model", "type", "source"],
        )
        # Counted in integer micro-units, exported in whole units: no float drift in the sum.
        self.cost_micros = Counter(
            "llm_proxy_cost",
            f"Cost charged, in {currency} (the operator's price list).",
            ["tenant", "model"],
            divisor=1_000_000,
        )
        self.budget_refusals = Counter(
            "llm_proxy_budget_refusals",
            "Calls refused before forwarding because a budget would be exceeded.",
            ["tenant", "scope", "meter"],
        )
        self.clamped = Counter(
            "llm_proxy_clamped", "Calls whose output cap was lowered to fit the budget.", ["tenant"]
        )
        self.overshoot = Counter(
            "llm_proxy_overshoot_tokens", "Tokens charged above the call's reserve.", ["tenant", "model"]
        )
        self.reserve_error = Histogram(
            "llm_proxy_reserve_error_ratio",
            "Estimated input tokens / provider input tokens.",
            buckets=RATIO_BUCKETS,
        )
        self.inflight = Gauge(
            "llm_proxy_inflight_requests", "Calls between reserve and settle in this process.", ["tenant"]
        )
        self.leases_expired = Counter(
            "llm_proxy_leases_expired", "Reservations settled at their reserve by a reaper."
        )
        self.store_errors = Counter("llm_proxy_store_errors", "Store operations that failed.", ["operation"])
        self.journal_pending = Gauge(
            "llm_proxy_journal_pending_lines",
            "Settlements in this process's journal waiting for the store (an outage's backlog, until "
            "a replay applies them). Read at each replay round (limits.journal_replay_s).",
            [],
        )
        self.journal_parked = Counter(
            "llm_proxy_journal_parked_lines",
            "Journal lines parked in the dead letters (rejected.jsonl) for an operator: the store "
            "refused them for good, or no version can read them.",
        )
        self.store_drops_keys = Gauge(
            "llm_proxy_store_drops_keys",
            "1 when the store may drop keys when its memory is full (its maxmemory-policy, the label, "
            "is not noeviction and a maxmemory is set; unknown: it would not say), budget counters and "
            "leases among them: a ceiling then overspent. Read at start and every 30 s.",
            ["policy"],
        )
        self.prior_contexts = Counter(
            "llm_proxy_prior_contexts",
            "Responses calls that continue a stored context (previous_response_id, conversation), and "
            "Messages calls that continue a thread, by "
            "whether the proxy knew its size (found: reserved on top of the request) or not (unknown: "
            "reserved at the request alone).",
            ["result"],
        )
        self.quick_estimates = Counter(
            "llm_proxy_quick_estimates",
            "Calls reserved at the UTF-8 bytes of much new text, by what followed: lowered (counted "
            "while the call ran, the reserve lowered), counted_first (the bound did not fit: counted "
            "before the reserve), dropped (settled before its reserve was lowered), failed (not "
            "counted, or not lowered for a store error).",
            ["result"],
        )
        self.config_reloads = Counter(
            "llm_proxy_config_reloads",
            "Config reloads (SIGHUP, the file saved) by result: applied, or refused (the file did not "
            "validate; the old config stays in force).",
            ["result"],
        )
        self.duration = Histogram(
            "llm_proxy_request_duration_seconds",
            "Whole call duration as the client sees it.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
        )
        self.ttft = Histogram(
            "llm_proxy_upstream_ttft_seconds",
            "Time to the first generated token from the upstream, of streamed answers.",
            ["model"],
            buckets=LATENCY_BUCKETS,
        )
        self.overhead = Histogram(
            "llm_proxy_proxy_overhead_seconds",
            "Time spent in the proxy itself, excluding the upstream.",
            buckets=OVERHEAD_BUCKETS,
        )
        self._all = [m for m in vars(self).values() if isinstance(m, Counter | Gauge | Histogram)]
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        for metric in self._all:
            yield metric.family()

    def describe(self) -> Iterator[Metric]:
        # The names, so that the registry refuses a second collector with the same ones.
        return self.collect()


def tenant_label(tenant: str, config: Config) -> str:
    if tenant in config.tenants:
        return tenant
    # A tenant no longer in this config (a reload removed its keys while its calls were in
    # flight, journaled or left to a reaper) is still the ledger's: its spend keeps its name.
    # Every other name came from a config, so the labels stay bounded. A pass-through caller's
    # tenant, one per key a caller sends, is unbounded: one label for them all (config refuses it).
    return PASSTHROUGH_TENANT if PASSTHROUGH_TENANT_ID.fullmatch(tenant) else tenant


def model_label(model: str, config: Config) -> str:
    return model if model in config.models and "*" not in model and "?" not in model else OTHER_MODEL
