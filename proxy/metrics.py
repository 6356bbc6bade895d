"""Prometheus metrics, built against an injected registry (one per app, so tests stay apart).

Label values are bounded: tenants come from config (pass-through callers fold into
``passthrough``), models from the config's exact names (anything else is ``other``). Never a
run id, request id or key in a label.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.config import Config

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
RATIO_BUCKETS = (0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2, 3, 5, 10)
PASSTHROUGH_TENANT = "passthrough"
OTHER_MODEL = "other"


class Metrics:
    def __init__(self, registry: CollectorRegistry, *, currency: str = "USD") -> None:
        self.registry = registry
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "llm_proxy_requests",
            "Forwarded calls by outcome.",
            ["tenant", "model", "endpoint", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "llm_proxy_tokens",
            "Tokens charged, by type (input, cached_input, output, reasoning) and usage source.",
            ["tenant", "model", "type", "source"],
            registry=registry,
        )
        self.cost = Counter(
            "llm_proxy_cost",
            f"Cost charged, in {currency} (the operator's price list).",
            ["tenant", "model"],
            registry=registry,
        )
        self.budget_refusals = Counter(
            "llm_proxy_budget_refusals",
            "Calls refused before forwarding because a budget would be exceeded.",
            ["tenant", "scope", "meter"],
            registry=registry,
        )
        self.clamped = Counter(
            "llm_proxy_clamped",
            "Calls whose output cap was lowered to fit the budget.",
            ["tenant"],
            registry=registry,
        )
        self.overshoot = Counter(
            "llm_proxy_overshoot_tokens",
            "Tokens charged above the call's reserve.",
            ["tenant", "model"],
            registry=registry,
        )
        self.reserve_error = Histogram(
            "llm_proxy_reserve_error_ratio",
            "Estimated input tokens / provider input tokens.",
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.inflight = Gauge(
            "llm_proxy_inflight_requests",
            "Calls between reserve and settle in this process.",
            ["tenant"],
            registry=registry,
        )
        self.leases_expired = Counter(
            "llm_proxy_leases_expired",
            "Reservations settled at their reserve by a reaper.",
            registry=registry,
        )
        self.store_errors = Counter(
            "llm_proxy_store_errors", "Store operations that failed.", ["operation"], registry=registry
        )
        self.duration = Histogram(
            "llm_proxy_request_duration_seconds",
            "Whole call duration as the client sees it.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "llm_proxy_upstream_ttft_seconds",
            "Time to the first generated token from the upstream.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            "llm_proxy_proxy_overhead_seconds",
            "Time spent in the proxy itself, excluding the upstream.",
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached: label sets are few and reused on every call."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found


def tenant_label(tenant: str, config: Config) -> str:
    return tenant if tenant in config.tenants else PASSTHROUGH_TENANT


def model_label(model: str, config: Config) -> str:
    return model if model in config.models and "*" not in model and "?" not in model else OTHER_MODEL
