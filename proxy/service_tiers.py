"""The processing tier a call asks for (a provider's ``service_tier``: priority, flex; not a
budget tier of ``config_tiers``), and the prices it is reserved and billed at."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from proxy.config_models import ModelConfig
from proxy.errors import BadRequest
from proxy.payload import (
    FAST_TIER,
    US_GEO,
    ChatBody,
    MessagesBody,
    RequestView,
    ResponsesBody,
    messages_tier,
)

# Tiers that are the default's price: OpenAI's "auto" is the project's default tier.
DEFAULT_SERVICE_TIERS = frozenset({"auto", "default"})


def asked_tier(view: RequestView) -> str | None:
    """The processing tier a request asks for: OpenAI's service_tier, Anthropic's fast mode and
    US-only inference."""
    if type(view) is ChatBody or type(view) is ResponsesBody:
        return view.service_tier
    if type(view) is MessagesBody:
        return messages_tier(fast=view.speed == FAST_TIER, us=view.inference_geo == US_GEO)
    return None


def rates_for(view: RequestView, model: ModelConfig) -> tuple[str | None, dict[str, int] | None]:
    """The tier a request asks for (None: the default) and its prices per million tokens, or
    the refusal of a tier the operator did not price (billing it at the default's prices would
    charge a priority call at half its cost)."""
    asked = asked_tier(view)
    price = model.price_per_million
    if asked is None or asked in DEFAULT_SERVICE_TIERS:
        return None, price.rates if price else None
    if price is None:  # an unpriced model: its cost is not counted, whatever the tier
        return asked, None
    if asked not in model.service_tiers:
        field = "service_tier"
        if type(view) is MessagesBody:
            field = "speed" if asked == FAST_TIER else "inference_geo"
        raise BadRequest(
            f"The service tier '{asked[:64]}' has no price for the model '{view.model}' in this proxy's "
            f"config: leave {field} unset, or ask the operator to price that tier.",
            param=field,
            code="unsupported_service_tier",
        )
    # Its table as priced (``ModelConfig.priced_tiers``): the model's own image prices where the
    # tier names none, as for an answer that names its tier.
    return asked, model.priced_tiers[asked]


def tier_rates(model: ModelConfig) -> Mapping[str, dict[str, int]]:
    """The model's prices by processing tier ("default": its own; empty: unpriced), shared by
    every call of the config: not to be changed."""
    return model.priced_tiers


def long_tier_rates(model: ModelConfig) -> Mapping[str, dict[str, int]]:
    """``tier_rates`` past the model's long-context threshold (empty: no such prices)."""
    return model.long_priced_tiers


def dearest(rates: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Each price at its highest among ``rates``."""
    top: dict[str, int] = {}
    for each in rates:
        for kind, rate in each.items():
            top[kind] = max(rate, top.get(kind, rate))
    return top
