"""The figures a call's plan fixes before its reserve (the output caps, the reserve's prices, the
prompt's tool overhead, json mode, the usage a stream's client asked for, the tier's policy) and
what ``record`` makes of a settled call for an operator: the spend counters, the histograms and
the per-call log line, each field against the settlement it reports."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.call import Call
from proxy.config import Config
from proxy.config_load import parse_config
from proxy.errors import BadRequest, BudgetExceeded
from proxy.estimate import ANTHROPIC_TOOLS_INPUT_TOKENS
from proxy.logs import TRUSTED_FIELDS
from proxy.metrics import Metrics
from proxy.outcome import BilledUsage, Outcome
from proxy.payload import Endpoint
from proxy.plan import least_cap_accepted, tools_input_tokens
from proxy.record import record_call, record_reaped, record_refusal
from proxy.settle import Settlement
from tests.conftest import UPSTREAM_KEY, base_config
from tests.test_billed_usage import plan_of
from tests.test_operator_figures import counted

MSGS: list[Any] = [{"role": "user", "content": "a prompt of some forty characters, about"}]
ANTHROPIC = {"base_url": "http://127.0.0.1:9/v1", "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
CAPPED = {
    "base_url": "http://127.0.0.1:9/v1",
    "api_key_env": "TEST_UPSTREAM_KEY",
    "chat_output_cap_field": "max_tokens",
}
# An upstream that refuses stream_options (Mistral's API).
UNASKED = {**CAPPED, "chat_output_cap_field": "max_completion_tokens", "stream_usage_option": False}
STANDARD = {"input": "3", "output": "15"}
PRIORITY = {"input": "5", "output": "20"}
# A model priced at STANDARD by default and at PRIORITY on the priority tier.
TIERED_MODELS = {
    "tiered": {"upstream": "openai", "price_per_million": STANDARD, "service_tiers": {"priority": PRIORITY}}
}
THINKING_BUDGET = 2000
INTERLEAVED = "interleaved-thinking-2025-05-14"


def config_of(**overrides: Any) -> Config:
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:9")
    upstreams = {"anthropic": ANTHROPIC, "capped": CAPPED, **overrides.pop("upstreams", {})}
    raw["upstreams"] = {**raw["upstreams"], **upstreams}
    raw["models"] = {**overrides.pop("models", {}), **raw["models"]}
    raw.update(overrides)
    return parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY}, key_secrets=False)


def planned(
    body: dict[str, Any],
    endpoint: Endpoint = "chat.completions",
    *,
    config: Config | None = None,
    anthropic_beta: str = "",
    tier: str = "standard",
    **models: Any,
) -> Call:
    config = config or config_of(models=models)
    return plan_of(config, body, endpoint, tier=tier, anthropic_beta=anthropic_beta)


def claude(**fields: Any) -> dict[str, Any]:
    return {"model": "claude-x", "max_tokens": 100, "messages": MSGS, **fields}


def claude_model(**fields: Any) -> dict[str, Any]:
    return {"upstream": "anthropic", "price_per_million": STANDARD, **fields}


def rates(prices: dict[str, str]) -> dict[str, int]:
    return (
        config_of(models={"priced": {"upstream": "openai", "price_per_million": prices}})
        .models["priced"]
        .price_per_million.rates
    )  # type: ignore[union-attr]


# -- the prompt's overhead and the output caps ----------------------------------------------------


def test_an_anthropic_models_tools_cost_600_input_tokens_unless_its_config_says_0() -> None:
    config = config_of(models={"claude-x": claude_model(), "claude-bare": claude_model(tools_input_tokens=0)})
    anthropic = config.upstreams["anthropic"]
    assert tools_input_tokens(config.models["claude-x"], anthropic) == ANTHROPIC_TOOLS_INPUT_TOKENS == 600
    assert tools_input_tokens(config.models["claude-bare"], anthropic) == 0
    assert tools_input_tokens(config.models["gpt-4o-mini"], config.upstreams["openai"]) == 0
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    default = planned(claude(tools=tools), "messages", config=config)
    bare = planned(claude(tools=tools, model="claude-bare"), "messages", config=config)
    assert default.reserved_input_tokens - bare.reserved_input_tokens == 600


def test_max_tokens_must_pass_the_thinking_budget_unless_thinking_is_interleaved() -> None:
    thinking = {"thinking": {"type": "enabled", "budget_tokens": THINKING_BUDGET}}
    assert least_cap_accepted("messages", thinking) == THINKING_BUDGET + 1
    assert least_cap_accepted("messages", thinking, anthropic_beta=INTERLEAVED) == 1
    assert least_cap_accepted("messages", {"thinking": {"type": "enabled", "budget_tokens": 0}}) == 1
    adaptive = {"thinking": {"type": "adaptive", "budget_tokens": THINKING_BUDGET}}
    assert least_cap_accepted("messages", adaptive) == 1
    # Anthropic's OpenAI-compatible endpoint takes thinking on chat, with the same rule (the
    # routing hunt): a clamp below the budget was a 400 from the provider, not the proxy's refusal.
    assert least_cap_accepted("chat.completions", thinking) == THINKING_BUDGET + 1
    assert least_cap_accepted("completions", thinking) == 1
    assert least_cap_accepted("responses", {}) == 16


def test_a_model_cap_below_the_thinking_budget_is_refused_naming_the_budget() -> None:
    body = claude(max_tokens=5000, thinking={"type": "enabled", "budget_tokens": THINKING_BUDGET})
    with pytest.raises(BadRequest) as refused:
        planned(body, "messages", **{"claude-x": claude_model(max_output_tokens=THINKING_BUDGET)})
    assert (refused.value.param, refused.value.code) == ("thinking.budget_tokens", "output_cap_too_low")
    # A cap exactly one past the budget is the least the provider takes: served.
    call = planned(body, "messages", **{"claude-x": claude_model(max_output_tokens=THINKING_BUDGET + 1)})
    assert call.estimate.enforce_cap == THINKING_BUDGET + 1


def test_an_upstream_reading_max_tokens_gets_the_lower_cap_reserved_for_every_answer() -> None:
    models = {"small": {"upstream": "capped", "max_output_tokens": 1000}}
    call = planned(
        {"model": "small", "messages": MSGS, "max_completion_tokens": 80, "max_tokens": 50, "n": 3}, **models
    )
    assert "max_completion_tokens" not in call.body and call.body["max_tokens"] == 50
    est = call.estimate
    assert (est.output_cap_field, est.enforce_cap, est.output_cap, est.output_tokens) == (
        "max_tokens",
        50,
        50,
        150,
    )
    call = planned(
        {"model": "small", "messages": MSGS, "max_completion_tokens": 30, "max_tokens": 60}, **models
    )
    assert call.body["max_tokens"] == call.estimate.output_tokens == 30
    # No cap of the client's: the model's goes.
    call = planned({"model": "small", "messages": MSGS}, **models)
    assert call.body["max_tokens"] == call.estimate.output_tokens == 1000


# -- a stream's usage and json mode -----------------------------------------------------------------


def test_a_stream_always_asks_for_usage_but_the_client_gets_it_only_if_it_asked() -> None:
    asked = planned(
        {"model": "gpt-4o-mini", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert (asked.stream, asked.client_wants_usage) == (True, True)
    for options in ({}, {"include_usage": False}, None):
        body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": MSGS, "stream": True}
        if options is not None:
            body["stream_options"] = options
        call = planned(body)
        assert (call.stream, call.client_wants_usage) == (True, False), options
        assert call.body["stream_options"]["include_usage"] is True
    kept = planned(
        {
            "model": "gpt-4o-mini",
            "messages": MSGS,
            "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True},
        }
    )
    assert kept.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    whole = planned({"model": "gpt-4o-mini", "messages": MSGS, "stream_options": {"include_usage": True}})
    assert (whole.stream, whole.client_wants_usage) == (False, False)


@pytest.mark.parametrize(
    ("endpoint", "base"), [("chat.completions", {"messages": MSGS}), ("completions", {"prompt": "hi"})]
)
def test_an_upstream_not_asked_for_usage_is_sent_the_clients_stream_options_as_they_came(
    endpoint: Endpoint, base: dict[str, Any]
) -> None:
    """``stream_usage_option: false`` (a server that refuses the field): nothing added, nothing
    taken; the client still gets usage only if it asked."""
    config = config_of(models={"small": {"upstream": "unasked"}}, upstreams={"unasked": UNASKED})
    for options in (None, {"include_usage": True}, {"include_usage": False, "continuous_usage_stats": True}):
        body: dict[str, Any] = {"model": "small", "stream": True, **base}
        if options is not None:
            body["stream_options"] = options
        call = planned(body, endpoint, config=config)
        assert call.body.get("stream_options") == options
        assert (call.stream, call.client_wants_usage) == (True, options == {"include_usage": True})


@pytest.mark.parametrize(
    ("endpoint", "body", "json_mode"),
    [
        (
            "chat.completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            True,
        ),
        ("chat.completions", {"response_format": {"type": "json_object"}}, True),
        ("chat.completions", {"response_format": {"type": "text"}}, False),
        ("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, True),
        ("responses", {"text": {"format": {"type": "text"}}}, False),
        ("messages", {"output_config": {"format": {"type": "json_schema", "schema": {}}}}, True),
        ("messages", {"output_config": {"effort": "low"}, "output_format": {"type": "json_schema"}}, True),
        ("messages", {"output_config": {"format": {"type": "text"}}}, False),
    ],
)
def test_json_mode_is_a_json_format_asked_in_the_endpoints_own_field(
    endpoint: Endpoint, body: dict[str, Any], json_mode: bool
) -> None:
    base: dict[str, Any] = {
        "chat.completions": {"model": "gpt-4o-mini", "messages": MSGS},
        "responses": {"model": "gpt-4o-mini", "input": "hi"},
        "messages": claude(),
    }[endpoint]
    call = planned({**base, **body}, endpoint, **{"claude-x": claude_model()})
    assert call.json_mode is json_mode


# -- the reserve's prices -----------------------------------------------------------------------------


def test_a_call_naming_no_tier_or_auto_is_reserved_at_the_dearest_tier_it_may_be_served_at() -> None:
    for tier in ({}, {"service_tier": "auto"}):
        call = planned({"model": "tiered", "messages": MSGS, **tier}, **TIERED_MODELS)
        assert call.rates == rates(STANDARD)
        assert call.reserve_rates == rates(PRIORITY), tier
    asked = planned({"model": "tiered", "messages": MSGS, "service_tier": "priority"}, **TIERED_MODELS)
    assert asked.reserve_rates == asked.rates == rates(PRIORITY)


def test_a_messages_call_in_another_geography_is_not_reserved_at_us_or_fast_prices() -> None:
    tiers = {"fast": {"input": "30", "output": "150"}, "us": {"input": "3.3", "output": "16.5"}}
    model = claude_model(service_tiers=tiers)
    call = planned(claude(inference_geo="global"), "messages", **{"claude-x": model})
    assert call.reserve_rates == rates(STANDARD)
    unnamed = planned(claude(), "messages", **{"claude-x": model})
    assert unnamed.reserve_rates == rates(tiers["us"])


def test_fast_mode_naming_no_geography_is_reserved_at_each_price_dearest_of_fast_and_fast_us() -> None:
    fast, fast_us = {"input": "30", "output": "150"}, {"input": "33", "output": "140"}
    model = claude_model(service_tiers={"fast": fast, "fast-us": fast_us})
    call = planned(claude(speed="fast"), "messages", **{"claude-x": model})
    assert (call.rates, call.service_tier) == (rates(fast), "fast")
    both = rates({"input": "33", "output": "150"})
    assert call.reserve_rates == both
    named = planned(claude(speed="fast", inference_geo="global"), "messages", **{"claude-x": model})
    assert named.reserve_rates == rates(fast)


# -- the call's other figures ------------------------------------------------------------------------


def test_a_keys_tier_policy_and_the_answers_kept_apart_from_those_billed() -> None:
    config = config_of(tiers={"standard": {}, "gold": {"policy": {"on_invalid_json": "reject"}}})
    call = planned(
        {"model": "gpt-4o-mini", "prompt": "hi", "n": 2, "best_of": 3},
        "completions",
        config=config,
        tier="gold",
    )
    assert call.policy.on_invalid_json == "reject" != config.policy.on_invalid_json
    assert (call.choices, call.generations) == (2, 3)


def test_reasoning_hidden_is_the_models_setting_or_any_thinking_but_disabled() -> None:
    hidden = {"claude-x": claude_model(hidden_reasoning=True)}
    assert planned(claude(), "messages", **hidden).hidden_reasoning is True
    plain = {"claude-x": claude_model()}
    assert planned(claude(), "messages", **plain).hidden_reasoning is False
    adaptive = claude(thinking={"type": "adaptive"})
    assert planned(adaptive, "messages", **plain).hidden_reasoning is True


# -- what a settled call records -------------------------------------------------------------------


def _settled(call: Call, *, entry_id: str | None) -> Settlement:
    usage = BilledUsage(
        input_tokens=40, cached_input_tokens=8, output_tokens=30, reasoning_tokens=12, source="tokenizer"
    )
    return Settlement(
        outcome=Outcome("rejected", "parse-json"),
        usage=usage,
        cost_micros=1,
        entry_id=entry_id,
        finish_reasons="stop",
        actual={},
        overshoot_tokens=7,
    )


def _call_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    (line,) = [r.__dict__[TRUSTED_FIELDS] for r in caplog.records if TRUSTED_FIELDS in r.__dict__]
    return line


def test_a_settled_call_is_counted_and_logged_with_the_settlements_figures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = config_of()
    metrics = Metrics(CollectorRegistry())
    call = planned({"model": "gpt-4o-mini", "messages": MSGS, "stream": True}, config=config)
    call.started_at = time.monotonic() - 100
    call.first_token_at = call.started_at + 0.5
    call.upstream_status = 201
    call.clamped = True
    caplog.set_level(logging.INFO)
    record_call(metrics, config, call, _settled(call, entry_id="1-0"), overhead_s=0.25, status=422)
    assert [names for names, _ in metrics.requests.items()] == [
        ["team-a", "gpt-4o-mini", "chat.completions", "rejected"]
    ]
    assert counted(metrics.tokens, type="reasoning", source="tokenizer") == 12
    assert counted(metrics.tokens, source="provider") == 0
    assert counted(metrics.cost_micros, tenant="team-a") == 1
    assert counted(metrics.overshoot, tenant="team-a") == 7
    assert counted(metrics.clamped, tenant="team-a") == 1
    assert metrics.reserve_error.labels().counts == [0] * len(metrics.reserve_error.labels().counts)
    assert metrics.ttft.labels("gpt-4o-mini").sum == pytest.approx(0.5)
    assert metrics.overhead.labels().sum == pytest.approx(0.25)
    assert [names for names, _ in metrics.duration.items()] == [["chat.completions"]]
    line = _call_line(caplog)
    assert line["latency_ms"] >= 100_000
    assert {k: v for k, v in line.items() if k != "latency_ms"} == {
        "request_id": "req-1",
        "tenant": "team-a",
        "key_name": "a-ci",
        "run_id": "run-1",
        "endpoint": "chat.completions",
        "model": "gpt-4o-mini",
        "stream": True,
        "outcome": "rejected:parse-json",
        "input_tokens": 40,
        "cached_input_tokens": 8,
        "output_tokens": 30,
        "reasoning_tokens": 12,
        "usage_source": "tokenizer",
        "cost_micros": 1,
        "status": 422,  # the client's: a rejected answer
        "upstream_status": 201,
        "settled": True,
    }


def test_a_call_whose_entry_this_process_did_not_write_is_logged_unsettled_and_not_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = config_of()
    metrics = Metrics(CollectorRegistry())
    call = planned({"model": "gpt-4o-mini", "messages": MSGS}, config=config)
    caplog.set_level(logging.INFO)
    record_call(metrics, config, call, _settled(call, entry_id=None), overhead_s=0.0, status=200)
    assert metrics.requests.items() == [] and metrics.tokens.items() == []
    assert metrics.ttft.items() == []
    line = _call_line(caplog)
    assert (line["settled"], line["stream"]) == (False, False)


REAPED_ENTRY = {
    "tenant": "team-a",
    "model": "gpt-4o-mini",
    "endpoint": "chat.completions",
    "outcome": "lease_expired",
    "usage_source": "reserve",
    "input_tokens": "3",
}


def test_a_reaped_lease_and_a_refusal_are_counted_under_their_own_labels() -> None:
    config = config_of()
    metrics = Metrics(CollectorRegistry())
    record_reaped(metrics, config, REAPED_ENTRY)
    assert metrics.leases_expired.labels().value == 1
    assert counted(metrics.requests, outcome="lease_expired") == 1
    refused = BudgetExceeded(
        "no", headers={"x-billing-refused-scope": "run", "x-billing-refused-meter": "output_tokens"}
    )
    record_refusal(metrics, config, "team-a", refused)
    assert [names for names, _ in metrics.budget_refusals.items()] == [["team-a", "run", "output_tokens"]]


def test_a_replayed_entry_of_a_call_not_clamped_counts_no_clamp() -> None:
    """The settle and the reaper write ``clamped`` as "0" or "1": the string "0" is no clamp."""
    config = config_of()
    metrics = Metrics(CollectorRegistry())
    entry = {**REAPED_ENTRY, "clamped": "0"}
    record_reaped(metrics, config, entry)
    assert counted(metrics.clamped, tenant="team-a") == 0
    record_reaped(metrics, config, {**entry, "clamped": "1"})
    assert counted(metrics.clamped, tenant="team-a") == 1


@pytest.mark.parametrize(
    ("endpoint", "body", "field", "value"),
    [
        ("chat.completions", {"modalities": ["text", "image"]}, "media_output", True),
        ("chat.completions", {"prediction": {"type": "content", "content": ""}}, "predicted_output", False),
        ("chat.completions", {"reasoning_effort": "none"}, "hidden_reasoning", False),
        ("chat.completions", {"reasoning": {"max_tokens": 100}}, "hidden_reasoning", True),
        (
            "chat.completions",
            {"extra_body": {"google": {"thinking_config": {"thinking_budget": 0}}}},
            "hidden_reasoning",
            False,
        ),
        ("completions", {"echo": True}, "echo", True),
        ("responses", {}, "stores_answer", True),
        ("embeddings", {"stream": True}, "stream", False),
    ],
)
def test_what_a_request_asks_of_its_answer_is_read_from_its_own_fields(
    endpoint: Endpoint, body: dict[str, Any], field: str, value: bool
) -> None:
    base: dict[str, Any] = {
        "chat.completions": {"model": "gpt-4o-mini", "messages": MSGS},
        "completions": {"model": "gpt-4o-mini", "prompt": "hi"},
        "responses": {"model": "gpt-4o-mini", "input": "hi"},
        "embeddings": {"model": "gpt-4o-mini", "input": "hi"},
    }[endpoint]
    assert getattr(planned({**base, **body}, endpoint), field) is value
