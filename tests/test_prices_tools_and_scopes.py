"""Tests that kill mutants of pricing, processing tiers, hosted tool fees, tier ceilings and the
budget scopes a call is reserved against: each pins a figure (micro-units, calls, a scope's key,
ceilings, window bounds) that a small change of that code would get wrong."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.auth import Identity
from proxy.config import Config
from proxy.config_base import Period
from proxy.config_load import parse_config, passthrough_config
from proxy.config_models import ModelConfig
from proxy.config_tiers import Ceilings, TierConfig, WindowCeilings
from proxy.errors import BadRequest
from proxy.estimate import Estimate
from proxy.payload import ChatBody, MessagesBody, ResponsesBody
from proxy.pricing import (
    IMAGE_RATES,
    INPUT_RATES,
    OUTPUT_RATES,
    cost_micros,
    reserve_amounts,
    tool_fees_exact,
    worst_rates,
)
from proxy.scopes import PASSTHROUGH_CALLERS_KEPT, KeyScopes, scopes_for, window_bounds
from proxy.service_tiers import dearest, rates_for, tier_rates
from proxy.store import Scope
from proxy.tool_fees import billed_tool_calls, counted_as, pools_tool_calls, reserved_tool_calls
from tests.conftest import big_config
from tests.test_tool_fees import _config

# -- cost_micros: each part out of what is left of its whole, at its own price ------------------

# One distinct price per kind (whole micro-units per token: no rounding in the way), so a part
# billed at another kind's price, or counted twice, changes the total.
M = 1_000_000
RATES = {
    "input": 2 * M,
    "cached_input": 3 * M,
    "cache_creation_input": 5 * M,
    "cache_creation_input_1h": 7 * M,
    "audio_input": 11 * M,
    "output": 13 * M,
    "reasoning": 17 * M,
    "audio_output": 19 * M,
    "image_input": 23 * M,
    "image_output": 29 * M,
}


def test_every_part_is_billed_at_its_own_price() -> None:
    cost = cost_micros(
        RATES,
        input_tokens=100,
        cached_input_tokens=10,
        cache_creation_input_tokens=20,
        cache_creation_1h_input_tokens=5,
        audio_input_tokens=30,
        image_input_tokens=4,
        output_tokens=50,
        reasoning_tokens=20,
        audio_output_tokens=10,
        image_output_tokens=6,
    )
    plain_in = (100 - 10 - 20 - 30 - 4) * 2
    plain_out = (50 - 20 - 10 - 6) * 13
    parts = 10 * 3 + 15 * 5 + 5 * 7 + 30 * 11 + 4 * 23 + 20 * 17 + 10 * 19 + 6 * 29
    assert cost == plain_in + plain_out + parts


def test_parts_past_their_whole_take_only_what_is_left() -> None:
    """Input 10: 8 cached leave 2 for cache writes (of which 2 kept an hour), none for audio nor
    images; output 10: all reasoning, none left for audio nor images."""
    cost = cost_micros(
        RATES,
        input_tokens=10,
        cached_input_tokens=8,
        cache_creation_input_tokens=5,
        cache_creation_1h_input_tokens=4,
        audio_input_tokens=3,
        image_input_tokens=3,
        output_tokens=10,
        reasoning_tokens=12,
        audio_output_tokens=4,
        image_output_tokens=4,
    )
    assert cost == 8 * 3 + 2 * 7 + 10 * 17


def test_cached_tokens_past_the_prompt_are_billed_as_the_prompt() -> None:
    assert cost_micros(RATES, input_tokens=5, cached_input_tokens=9, output_tokens=0) == 5 * 3


def test_audio_input_comes_out_of_what_cache_writes_left() -> None:
    cost = cost_micros(
        RATES, input_tokens=10, cache_creation_input_tokens=6, audio_input_tokens=8, output_tokens=0
    )
    assert cost == 6 * 5 + 4 * 11


def test_image_input_comes_out_of_what_cache_and_audio_left() -> None:
    """Input 10: 4 audio leave 6 for images (told 8), none for text."""
    cost = cost_micros(RATES, input_tokens=10, audio_input_tokens=4, image_input_tokens=8, output_tokens=0)
    assert cost == 4 * 11 + 6 * 23


def test_image_output_comes_out_of_what_reasoning_and_audio_left() -> None:
    """Output 10: 2 reasoning and 5 audio leave 3 for images (told 6), none for text."""
    cost = cost_micros(
        RATES,
        input_tokens=0,
        output_tokens=10,
        reasoning_tokens=2,
        audio_output_tokens=5,
        image_output_tokens=6,
    )
    assert cost == 2 * 17 + 5 * 19 + 3 * 29


def test_the_exact_cost_is_rounded_up_once_to_a_whole_micro_unit() -> None:
    one = {kind: 1 for kind in RATES}  # one micro-unit per million tokens
    assert cost_micros(one, input_tokens=1, output_tokens=0) == 1
    assert cost_micros(one, input_tokens=1_000_000, output_tokens=0) == 1
    assert cost_micros(one, input_tokens=1_000_001, output_tokens=0) == 2
    assert cost_micros(one, input_tokens=0, output_tokens=0) == 0
    # A tool call at 1 micro-unit per 1,000 calls is a thousandth of one, beside a millionth of
    # one for the token: rounded once, 1 (apart, 2).
    fee = tool_fees_exact((("web_search", 1),), {"web_search": 1})
    assert fee == 1_000
    assert cost_micros(one, input_tokens=1, output_tokens=0, tool_fees_exact=fee) == 1
    assert cost_micros(one, input_tokens=0, output_tokens=0, tool_fees_exact=1000 * fee) == 1
    assert cost_micros(None, input_tokens=10, output_tokens=10) == 0


def test_tool_fees_are_the_calls_times_the_price_per_thousand() -> None:
    # $10 per 1,000 searches (10,000,000 micro-units per thousand): 10,000 micro-units a search.
    prices = {"web_search": 10_000_000, "file_search": 2_500_000}
    fee = tool_fees_exact((("web_search", 3), ("file_search", 2), ("code", 7)), prices)
    assert cost_micros(RATES, input_tokens=0, output_tokens=0, tool_fees_exact=fee) == 30_000 + 5_000


# -- the reserve: every token at the dearest price of its side ----------------------------------


@pytest.mark.parametrize("dearest_kind", INPUT_RATES + OUTPUT_RATES)
def test_the_reserve_prices_each_side_at_its_dearest_kind(dearest_kind: str) -> None:
    rates = {kind: 1 for kind in INPUT_RATES + OUTPUT_RATES + IMAGE_RATES}
    rates[dearest_kind] = 100
    worst = worst_rates(rates)
    assert worst is not None
    dear_side, cheap_side = (
        (INPUT_RATES, OUTPUT_RATES) if dearest_kind in INPUT_RATES else (OUTPUT_RATES, INPUT_RATES)
    )
    assert {kind: worst[kind] for kind in dear_side} == dict.fromkeys(dear_side, 100)
    assert {kind: worst[kind] for kind in cheap_side} == dict.fromkeys(cheap_side, 1)
    assert worst_rates(None) is None


@pytest.mark.parametrize("asks_images", [False, True])
def test_the_image_output_price_joins_the_reserve_of_a_call_asking_for_images_alone(
    asks_images: bool,
) -> None:
    """gpt-5 priced for its image tool's images (10 in, 40 out per million) reserves its text
    answers at 10, not 40: no answer of its is written in images but the tool's, never reserved.
    A chat call asking for images (``modalities``) may be all images: its output reserved at
    their price. No chat input is billed as images: its input stays at the text's."""
    rates = {kind: 1 for kind in INPUT_RATES + OUTPUT_RATES + IMAGE_RATES}
    rates["image_input"], rates["image_output"] = 50, 100
    worst = worst_rates(rates, images=asks_images)
    assert worst is not None
    assert {kind: worst[kind] for kind in INPUT_RATES} == dict.fromkeys(INPUT_RATES, 1)
    top_out = 100 if asks_images else 1
    assert {kind: worst[kind] for kind in OUTPUT_RATES} == dict.fromkeys(OUTPUT_RATES, top_out)
    # Their own prices, for the tokens a settle bills as images.
    assert (worst["image_input"], worst["image_output"]) == (50, 100)


def _estimate(input_tokens: int, output_tokens: int, fees: int = 0) -> Estimate:
    return Estimate(
        prompt_text="",
        prompt_overhead_tokens=0,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        output_cap_field=None,
        tool_fees_exact=fees,
    )


def test_reserve_amounts_hold_the_worst_case_with_its_tool_fees() -> None:
    fee = tool_fees_exact((("web_search", 5),), {"web_search": 10_000_000})
    amounts = reserve_amounts(_estimate(100, 40, fee), RATES)
    assert amounts == {
        "requests": 1,
        "input_tokens": 100,
        "output_tokens": 40,
        "total_tokens": 140,
        "cost_micros": 100 * 11 + 40 * 19 + 50_000,
        "concurrent": 1,
    }
    assert reserve_amounts(_estimate(100, 40), None)["cost_micros"] == 0


# -- processing tiers ----------------------------------------------------------------------------


def _price(scale: int) -> dict[str, str]:
    return {"input": str(scale), "output": str(2 * scale)}


TIERS = {"priority": _price(2), "flex": _price(3), "fast": _price(6), "us": _price(5), "fast-us": _price(7)}


def _tiered(service_tiers: dict[str, Any] | None = None, priced: bool = True) -> ModelConfig:
    model: dict[str, Any] = {"service_tiers": TIERS if service_tiers is None else service_tiers}
    if priced:
        model["price_per_million"] = _price(1)
    else:
        model.pop("service_tiers")
    return _config(model).models["m"]


MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**extra: Any) -> ChatBody:
    return ChatBody.model_validate({"model": "m", "messages": MESSAGES, **extra})


def _messages(**extra: Any) -> MessagesBody:
    return MessagesBody.model_validate({"model": "m", "max_tokens": 10, "messages": MESSAGES, **extra})


def _responses(**extra: Any) -> ResponsesBody:
    return ResponsesBody.model_validate({"model": "m", "input": "hi", **extra})


def _tier_rates(name: str) -> dict[str, int]:
    return _tiered().service_tiers[name].rates


def test_auto_and_default_are_the_default_tiers_prices() -> None:
    model = _tiered()
    assert model.price_per_million is not None
    default = model.price_per_million.rates
    for tier in ("auto", "default", None):
        assert rates_for(_chat(service_tier=tier), model) == (None, default)
        assert rates_for(_responses(service_tier=tier), model) == (None, default)
    assert rates_for(_messages(), model) == (None, default)


@pytest.mark.parametrize(
    ("body", "tier"),
    [
        (_chat(service_tier="priority"), "priority"),
        (_responses(service_tier="flex"), "flex"),
        (_messages(speed="fast"), "fast"),
        (_messages(inference_geo="us"), "us"),
        (_messages(speed="fast", inference_geo="us"), "fast-us"),
    ],
    ids=["chat-priority", "responses-flex", "fast", "us", "fast-us"],
)
def test_an_asked_tier_is_priced_at_its_own_prices(body: Any, tier: str) -> None:
    assert rates_for(body, _tiered()) == (tier, _tier_rates(tier))


def test_an_unpriced_model_names_the_asked_tier_and_no_prices() -> None:
    assert rates_for(_chat(service_tier="priority"), _tiered(priced=False)) == ("priority", None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_messages(speed="fast"), "speed"),
        (_messages(inference_geo="us"), "inference_geo"),
        (_chat(service_tier="priority"), "service_tier"),
        (_responses(service_tier="priority"), "service_tier"),
    ],
    ids=["fast", "us", "chat", "responses"],
)
def test_a_tier_not_priced_is_refused_naming_the_field_that_asked(body: Any, param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        rates_for(body, _tiered({}))
    assert refused.value.param == param
    assert refused.value.code == "unsupported_service_tier"


def test_tier_rates_hold_the_default_beside_every_priced_tier() -> None:
    model = _tiered({"priority": _price(2)})
    assert model.price_per_million is not None
    assert tier_rates(model) == {
        "default": model.price_per_million.rates,
        "priority": model.service_tiers["priority"].rates,
    }
    assert tier_rates(_tiered(priced=False)) == {}


def test_dearest_takes_each_price_at_its_highest() -> None:
    assert dearest([{"input": 1, "output": 9}, {"input": 5, "output": 2}, {"input": 3, "output": 4}]) == {
        "input": 5,
        "output": 9,
    }


# -- hosted tools: the calls reserved, the calls billed --------------------------------------------

SEARCH = 10_000_000  # $10 per 1,000 calls
PRICES = {"web_search": SEARCH, "file_search": SEARCH // 4}


def _reserved(body: Any, prices: dict[str, int] = PRICES) -> tuple[tuple[str, int], ...]:
    return reserved_tool_calls(body, prices, 10)


def test_responses_web_search_preview_and_dated_types_reserve_as_web_search() -> None:
    only_search = {"web_search": SEARCH}
    for kind in ("web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26"):
        assert _reserved(_responses(tools=[{"type": kind}]), only_search) == (("web_search", 10),), kind
    # Both types enabled are one tool counted once: its calls are reserved once, not twice.
    assert _reserved(_responses(tools=BOTH), only_search) == (("web_search", 10),)


def test_a_responses_tool_not_priced_reserves_nothing() -> None:
    assert _reserved(_responses(tools=[{"type": "file_search"}]), {"web_search": SEARCH}) == ()
    body = _responses(tools=[{"type": "file_search"}], max_tool_calls=3)
    assert _reserved(body, {"web_search": SEARCH}) == ()


def test_responses_max_tool_calls_bounds_every_call_at_the_dearest_tool() -> None:
    tools = [{"type": "file_search"}, {"type": "web_search"}]
    assert _reserved(_responses(tools=tools, max_tool_calls=4)) == (("web_search", 4),)
    assert _reserved(_responses(tools=tools)) == (("file_search", 10), ("web_search", 10))
    # A bound of 0: no call may be made, none is reserved.
    zero = _reserved(_responses(tools=tools, max_tool_calls=0))
    assert tool_fees_exact(zero, PRICES) == 0


def test_anthropic_max_uses_that_is_no_count_reserves_the_default() -> None:
    for uses in (True, 0, -1, 2.0, "3"):
        body = _messages(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": uses}])
        assert _reserved(body) == (("web_search", 10),), uses
    body = _messages(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}])
    assert _reserved(body) == (("web_search", 3),)


def test_two_anthropic_tools_of_one_name_reserve_both_their_uses() -> None:
    tools = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
        {"type": "web_search_20260209", "name": "web_search_2", "max_uses": 3},
    ]
    assert _reserved(_messages(tools=tools)) == (("web_search", 5),)


def test_an_anthropic_type_without_a_version_is_no_priced_tool() -> None:
    for kind in ("web_search", "web_search_beta", "web_search_"):
        assert _reserved(_messages(tools=[{"type": kind, "name": "x", "max_uses": 2}])) == (), kind


PREVIEW = {"web_search": SEARCH, "web_search_preview": 25_000_000}
BOTH = [{"type": "web_search"}, {"type": "web_search_preview"}]


def test_search_items_are_billed_as_the_preview_when_it_is_enabled_and_not_cheaper() -> None:
    alias = (("web_search", "web_search_preview"),)
    assert counted_as(_responses(tools=[{"type": "web_search_preview"}]), PREVIEW) == alias
    assert counted_as(_responses(tools=BOTH), PREVIEW) == alias
    # At the same price either name bills the same: the preview's is named.
    same = {"web_search": SEARCH, "web_search_preview": SEARCH}
    assert counted_as(_responses(tools=BOTH), same) == alias
    # web_search dearer beside it, or the preview not enabled: billed as web_search.
    dearer = {"web_search": 30_000_000, "web_search_preview": 25_000_000}
    assert counted_as(_responses(tools=BOTH), dearer) == ()
    assert counted_as(_responses(tools=[{"type": "web_search"}]), PREVIEW) == ()


def _interpreter(memory: str) -> dict[str, Any]:
    return {"type": "code_interpreter", "container": {"type": "auto", "memory_limit": memory}}


def test_calls_of_interpreters_of_several_sizes_are_billed_at_the_dearest_size_asked() -> None:
    """A request asking containers of 4g and 16g: its calls (an item does not say which container
    ran it) are billed at 16g's price; where the operator priced a larger size below the least
    asked, at the least's."""
    prices = {"code_interpreter": 30_000, "code_interpreter_4g": 120_000, "code_interpreter_16g": 480_000}
    tools = [_interpreter("4g"), _interpreter("16g")]
    assert counted_as(_responses(tools=tools), prices) == (("code_interpreter", "code_interpreter_16g"),)
    odd = {"code_interpreter": 200_000, "code_interpreter_4g": 120_000}
    assert counted_as(_responses(tools=[_interpreter("1g"), _interpreter("4g")]), odd) == ()


def test_billed_tool_calls_count_every_report_under_its_billed_name() -> None:
    observed = (("web_search", 1), ("file_search", 1), ("web_search", 2))
    assert billed_tool_calls(PRICES, observed, (), at_reserve=False) == (
        ("web_search", 3),
        ("file_search", 1),
    )
    aliased = billed_tool_calls(
        PREVIEW, (("web_search", 2),), (), at_reserve=False, aliases=(("web_search", "web_search_preview"),)
    )
    assert aliased == (("web_search_preview", 2),)


def test_billed_tool_calls_at_the_reserve_are_the_more_of_reserved_and_counted() -> None:
    reserved = (("web_search", 5), ("file_search", 2))
    assert billed_tool_calls(PRICES, (("web_search", 2),), reserved, at_reserve=True) == (
        ("web_search", 5),
        ("file_search", 2),
    )
    assert billed_tool_calls(PRICES, (("web_search", 7),), reserved, at_reserve=True) == (
        ("web_search", 7),
        ("file_search", 2),
    )
    # Not at the reserve: only what the answer counts.
    assert billed_tool_calls(PRICES, (("web_search", 2),), reserved, at_reserve=False) == (("web_search", 2),)


def test_billed_tool_calls_at_a_pooled_reserve_are_those_counted_and_what_they_leave_of_it() -> None:
    """max_tool_calls 2 over web_search and file_search, reserved as 2 web searches: a file
    search counted took one of the 2, not one beside them (was: web_search=2,file_search=2)."""
    tools = [{"type": "web_search"}, {"type": "file_search"}]
    assert pools_tool_calls(_responses(tools=tools, max_tool_calls=2))
    assert not pools_tool_calls(_responses(tools=tools))
    assert not pools_tool_calls(_messages(max_tool_calls=2))
    pool = (("web_search", 2),)

    def billed(*observed: tuple[str, int]) -> tuple[tuple[str, int], ...]:
        return billed_tool_calls(PRICES, observed, pool, at_reserve=True, pooled=True)

    assert billed(("file_search", 2)) == (("file_search", 2),)
    assert billed(("file_search", 1)) == (("web_search", 1), ("file_search", 1))
    assert billed(("web_search", 1)) == (("web_search", 2),)
    assert billed() == pool
    # A function call is no hosted tool's: it leaves the pool whole.
    assert billed(("function", 2)) == pool
    # More counted than the pool held: billed as counted.
    assert billed(("file_search", 3)) == (("file_search", 3),)
    for observed in [
        (),
        (("file_search", 1),),
        (("file_search", 2),),
        (("web_search", 1), ("file_search", 1)),
    ]:
        assert tool_fees_exact(billed(*observed), PRICES) <= tool_fees_exact(pool, PRICES), observed
    # Not at the reserve: only what the answer counts.
    assert billed_tool_calls(PRICES, (("file_search", 1),), pool, at_reserve=False, pooled=True) == (
        ("file_search", 1),
    )


# -- tier ceilings ----------------------------------------------------------------------------------


def test_ceilings_read_as_meters_with_cost_in_micro_units() -> None:
    raw = {
        "requests": 0,
        "input_tokens": 1,
        "output_tokens": 2,
        "total_tokens": 3,
        "concurrent": 4,
        "cost_usd": "0.5",
    }
    assert Ceilings.model_validate(raw).meters == {
        "requests": 0,
        "input_tokens": 1,
        "output_tokens": 2,
        "total_tokens": 3,
        "concurrent": 4,
        "cost_micros": 500_000,
    }
    assert Ceilings.model_validate({"cost_usd": "0.000001"}).meters == {"cost_micros": 1}
    assert Ceilings.model_validate({"cost_usd": 0}).meters == {"cost_micros": 0}


@pytest.mark.parametrize(
    ("model", "raw"),
    [
        (Ceilings, {"cost_usd": "0.0000001"}),
        (Ceilings, {"cost_usd": Decimal("1.0000005")}),
        (Ceilings, {"requests": True}),
        (Ceilings, {"concurrent": False}),
        (WindowCeilings, {"period": "day", "concurrent": 1}),
        (TierConfig, {"min_output_tokens": 0}),
        (TierConfig, {"min_output_tokens": True}),
        (TierConfig, {"tenant": [{"period": "day"}, {"period": "day", "requests": 1}]}),
        (TierConfig, {"windows": [{"period": "hour"}, {"period": "hour", "requests": 1}]}),
    ],
    ids=[
        "cost-7-places",
        "cost-7-places-decimal",
        "requests-bool",
        "concurrent-bool",
        "window-concurrent",
        "min-output-0",
        "min-output-bool",
        "tenant-period-twice",
        "window-period-twice",
    ],
)
def test_tier_config_refuses(model: type[Ceilings | TierConfig], raw: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(raw)


def test_a_tier_refuses_a_short_budget_unless_it_says_clamp() -> None:
    assert TierConfig().on_budget_short == "refuse"
    assert TierConfig().min_output_tokens == 1


# -- scopes: which keys and ceilings a call is reserved against -------------------------------------

NOW = datetime(2026, 12, 4, 7, 41, 30, tzinfo=UTC)


def _tier() -> TierConfig:
    return TierConfig.model_validate(
        {
            "run": {"requests": 7},
            "key": {"concurrent": 2},
            "windows": [{"period": "minute", "requests": 3}, {"period": "hour", "input_tokens": 100}],
            "tenant": [{"period": "hour", "output_tokens": 50}],
        }
    )


def _by_name(scopes: list[Scope]) -> dict[str, Scope]:
    named = {scope.name: scope for scope in scopes}
    assert len(named) == len(scopes), [scope.name for scope in scopes]
    return named


def _utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def _ts(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> int:
    return int(_utc(year, month, day, hour, minute).timestamp())


def test_scopes_of_a_call_are_its_run_key_and_windows_at_their_ceilings() -> None:
    identity = Identity(tenant="acme", tier="std", key_name="k1")
    named_periods: frozenset[Period] = frozenset({"hour", "minute"})
    limited_periods: frozenset[Period] = frozenset({"hour"})
    scopes = scopes_for(
        identity, "r1", _tier(), NOW, run_ttl_s=99, tenant_periods=(named_periods, limited_periods)
    )
    named = _by_name(scopes)
    assert list(named) == [
        "run",
        "key",
        "key:minute",
        "key:hour",
        "key:day",
        "key:month",
        "tenant:minute",
        "tenant:hour",
        "tenant:day",
        "tenant:month",
    ]
    pre = "lbp:{acme}:"
    run = named["run"]
    assert (run.key, dict(run.ceilings), run.ttl_s) == (f"{pre}run:r1", {"requests": 7}, 99)
    assert (named["key"].key, dict(named["key"].ceilings)) == (f"{pre}key:k1:all", {"concurrent": 2})
    week = 7 * 24 * 3600
    expected = {
        "key:minute": (f"{pre}key:k1:minute:20261204T0741", {"requests": 3}, _ts(2026, 12, 4, 7, 42), False),
        "key:hour": (f"{pre}key:k1:hour:20261204T0700", {"input_tokens": 100}, _ts(2026, 12, 4, 8), False),
        "key:day": (f"{pre}key:k1:day:20261204T0000", {}, _ts(2026, 12, 5), False),
        "key:month": (f"{pre}key:k1:month:20261201T0000", {}, _ts(2027, 1, 1), False),
        "tenant:minute": (f"{pre}tenant:minute:20261204T0741", {}, _ts(2026, 12, 4, 7, 42), False),
        "tenant:hour": (f"{pre}tenant:hour:20261204T0700", {"output_tokens": 50}, _ts(2026, 12, 4, 8), True),
        "tenant:day": (f"{pre}tenant:day:20261204T0000", {}, _ts(2026, 12, 5), False),
        "tenant:month": (f"{pre}tenant:month:20261201T0000", {}, _ts(2027, 1, 1), False),
    }
    minute_start = _ts(2026, 12, 4, 7, 41)
    for name, (key, ceilings, resets_at, shared) in expected.items():
        scope = named[name]
        assert (scope.key, dict(scope.ceilings), scope.resets_at_s, scope.shared_limit) == (
            key,
            ceilings,
            resets_at,
            shared,
        ), name
        # Kept a week past the window's end (counted from the minute the scopes were made).
        assert scope.ttl_s == resets_at - minute_start + week, name


def test_a_tenant_window_is_one_counter_for_every_key_and_a_key_window_its_own() -> None:
    tier = _tier()
    first = _by_name(scopes_for(Identity(tenant="t", tier="std", key_name="a"), "r", tier, NOW, run_ttl_s=0))
    second = _by_name(scopes_for(Identity(tenant="t", tier="std", key_name="b"), "r", tier, NOW, run_ttl_s=0))
    other = _by_name(scopes_for(Identity(tenant="u", tier="std", key_name="a"), "r", tier, NOW, run_ttl_s=0))
    for name in ("tenant:hour", "tenant:day", "tenant:month"):
        assert first[name].key == second[name].key, name
        assert first[name].key != other[name].key, name
    for name in ("key", "key:minute", "key:hour", "key:day", "key:month"):
        assert first[name].key != second[name].key, name
        assert first[name].key != other[name].key, name
    assert first["run"].key == second["run"].key != other["run"].key
    assert [
        s.name for s in scopes_for(Identity(tenant="t", tier="x", key_name="a"), "r", None, NOW, run_ttl_s=0)
    ] == ["run"]


def test_the_minute_window_moves_with_the_minute() -> None:
    identity = Identity(tenant="t", tier="std", key_name="a")
    keys = set()
    for second in (0, 59, 60, 61, 125):
        now = datetime.fromtimestamp(_ts(2026, 12, 4, 7, 41) + second, UTC)
        keys.add(_by_name(scopes_for(identity, "r", _tier(), now, run_ttl_s=0))["key:minute"].key)
    assert keys == {f"lbp:{{t}}:key:a:minute:20261204T07{m}" for m in ("41", "42", "43")}


@pytest.mark.parametrize(
    ("now", "period", "start", "end"),
    [
        (datetime(2026, 1, 31, 23, 59, 59, tzinfo=UTC), "month", (2026, 1, 1), (2026, 2, 1)),
        (datetime(2026, 2, 14, 12, tzinfo=UTC), "month", (2026, 2, 1), (2026, 3, 1)),
        (datetime(2026, 4, 30, 1, tzinfo=UTC), "month", (2026, 4, 1), (2026, 5, 1)),
        (datetime(2026, 12, 31, 23, 30, tzinfo=UTC), "day", (2026, 12, 31), (2027, 1, 1)),
        (datetime(2026, 12, 31, 23, 30, 5, tzinfo=UTC), "hour", (2026, 12, 31, 23), (2027, 1, 1)),
        (datetime(2026, 12, 31, 23, 59, 5, tzinfo=UTC), "minute", (2026, 12, 31, 23, 59), (2027, 1, 1)),
    ],
)
def test_window_bounds_are_calendar_periods_in_utc(
    now: datetime, period: str, start: tuple[int, ...], end: tuple[int, ...]
) -> None:
    assert window_bounds(period, now) == (_utc(*start), _utc(*end))


def test_a_named_runs_scope_is_built_once_and_a_run_of_one_call_is_not_kept() -> None:
    """A run's scope serves its calls as the key's do (built and packed for Redis once); a run
    the proxy named for a call that sent no X-Run-Id has that call alone: kept, 4,096 of them
    pushed out the named runs' scopes (the second review)."""
    from proxy.ids import MADE_RUN_PREFIX
    from proxy.scopes import _run_scope

    who = Identity(tenant="team-scope", tier="t", key_name="k")
    now = datetime(2026, 12, 5, tzinfo=UTC)
    first = scopes_for(who, "agent-7", None, now, run_ttl_s=3600)[0]
    assert scopes_for(who, "agent-7", None, now, run_ttl_s=3600)[0] is first
    held = _run_scope.cache_info().currsize
    made = f"{MADE_RUN_PREFIX}0123456789abcdef"
    one = scopes_for(who, made, None, now, run_ttl_s=3600)[0]
    assert one.key.endswith(made) and scopes_for(who, made, None, now, run_ttl_s=3600)[0] is not one
    assert _run_scope.cache_info().currsize == held


def _calls_in_turn(config: Config, callers: list[Identity], now: datetime) -> None:
    for identity in callers:
        scopes_for(
            identity,
            "agent-7",
            config.tiers[identity.tier],
            now,
            run_ttl_s=config.limits.run_ttl_s,
            tenant_periods=config.tenant_periods(identity.tenant),
            key_scopes=config.key_scopes,
        )


def test_the_keys_of_a_big_config_calling_in_turn_find_their_scopes_kept() -> None:
    """The key scopes were kept in one cache of 4,096 whatever the config: 5,000 keys calling in
    turn never found theirs, and every call built them again, about 55 us (the config-scale
    hunt). The cache has room for every key the config names."""
    config = parse_config(big_config("http://127.0.0.1:1/v1", "redis://127.0.0.1:1/0", keys=5000), {})
    callers = [Identity(tenant=key.tenant, tier=key.tier, key_name=key.name) for key in config.keys]
    now = datetime(2026, 12, 5, 12, 0, 10, tzinfo=UTC)
    _calls_in_turn(config, callers, now)
    hits = config.key_scopes.hits
    _calls_in_turn(config, callers, now.replace(second=50))  # the same minute: the same scopes
    assert config.key_scopes.hits - hits == 5000
    assert config.key_scopes.held == 5000
    # The next minute's take the places of the last's, one a key.
    _calls_in_turn(config, callers, now.replace(minute=1))
    assert config.key_scopes.held == 5000
    # A reload's config keeps its own (its tiers' ceilings in its scopes).
    assert config.model_copy().key_scopes is not config.key_scopes


def test_the_key_scopes_kept_for_pass_through_callers_are_bounded() -> None:
    """Every bearer token sent in pass-through is a caller of its own: their scopes are kept for
    a bounded number of them, whatever they send."""
    config = passthrough_config("http://127.0.0.1:1/v1", host="127.0.0.1", port=0, redis_url=None)
    callers = [
        Identity(tenant=f"pt-{i:032x}", tier="standard", key_name=f"pt-{i:032x}")
        for i in range(PASSTHROUGH_CALLERS_KEPT + 100)
    ]
    _calls_in_turn(config, callers, datetime(2026, 12, 5, 12, 0, 10, tzinfo=UTC))
    assert config.key_scopes.held == PASSTHROUGH_CALLERS_KEPT


def test_a_configs_key_scopes_have_room_for_its_keys_and_at_least_4096_pass_through_callers() -> None:
    assert PASSTHROUGH_CALLERS_KEPT == 4096
    assert KeyScopes(0).most == KeyScopes(4096).most == 4096
    assert KeyScopes(5000).most == 5000
