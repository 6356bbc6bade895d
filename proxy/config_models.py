"""A served model's configuration (``models:``): its upstream, how its tokens are counted and
reserved, and its prices per million tokens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from functools import cached_property
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from proxy.config_base import MAX_UNITS, Frozen, not_a_bool, whole_micros


class PricePerMillion(Frozen):
    """Prices in the operator's currency per million tokens; stored exactly as decimals."""

    input: Decimal = Field(ge=0, le=MAX_UNITS)
    output: Decimal = Field(ge=0, le=MAX_UNITS)
    cached_input: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)
    reasoning: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)
    # Anthropic prompt-cache writes; priced as input unless given. Those kept an hour (a dearer
    # write): as cache_creation_input unless given.
    cache_creation_input: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)
    cache_creation_input_1h: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)
    # Audio tokens (OpenAI audio models), parts of input and output: as text unless given.
    audio_input: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)
    audio_output: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)
    # Image tokens, parts of input and output: as text unless given. An image model prices its
    # image tokens above its text (gpt-image-1: text in 5, image in 10, image out 40), and the
    # Responses image generation tool's are told apart from the model's (``tool_usage.image_gen``).
    image_input: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)
    image_output: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS)

    @cached_property
    def rates(self) -> dict[str, int]:
        """Micro-units per million tokens by token type, computed once per config."""
        return self.micros_per_million()

    def micros_per_million(self) -> dict[str, int]:
        def micros(price: Decimal) -> int:
            return whole_micros(price, "prices are limited to 6 decimal places per million tokens")

        def given(price: Decimal | None, otherwise: Decimal) -> Decimal:
            return otherwise if price is None else price

        creation = given(self.cache_creation_input, self.input)
        return {
            "input": micros(self.input),
            "cached_input": micros(given(self.cached_input, self.input)),
            "cache_creation_input": micros(creation),
            "cache_creation_input_1h": micros(given(self.cache_creation_input_1h, creation)),
            "audio_input": micros(given(self.audio_input, self.input)),
            "image_input": micros(given(self.image_input, self.input)),
            "output": micros(self.output),
            "reasoning": micros(given(self.reasoning, self.output)),
            "audio_output": micros(given(self.audio_output, self.output)),
            "image_output": micros(given(self.image_output, self.output)),
        }

    @model_validator(mode="after")
    def _six_places(self) -> PricePerMillion:
        self.micros_per_million()
        return self


class LongContextPrices(Frozen):
    """A model's prices for a call whose input passes a number of tokens: the whole call, its
    input and its output, at these (Gemini's Pro models past 200K input tokens, OpenAI's past
    272K, as their price lists say)."""

    # Past this many input tokens (every kind: cached, cache writes and audio included).
    above_input_tokens: int = Field(gt=0, le=10**12)
    price_per_million: PricePerMillion
    # The long-context prices of each processing tier the model prices (``service_tiers``).
    service_tiers: dict[str, PricePerMillion] = {}  # noqa: RUF012 (a pydantic field)

    @field_validator("above_input_tokens", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        return not_a_bool(value)


# The bounds of a price per 1,000 calls of a hosted tool, as a price per million tokens's.
ToolPrice = Annotated[Decimal, Field(ge=0, le=MAX_UNITS)]


def micros_per_thousand_calls(prices: Mapping[str, Decimal]) -> dict[str, int]:
    """Micro-units per 1,000 calls by tool name; ValueError past 6 decimal places."""
    refusal = "{}: prices are limited to 6 decimal places per 1,000 calls"
    return {tool: whole_micros(price, refusal.format(tool)) for tool, price in prices.items()}


# What an answer counts a tool's calls under is its bare name: not the field of its count
# (web_search_requests), its item's type (web_search_call) or a dated version of its type
# (web_search_20250305): priced under those, its calls would never be billed, and no error said so.
_NOT_A_TOOL_NAME = re.compile(r".+(_requests|_call|_\d{8}|_\d{4}_\d{2}_\d{2})")

# Every name an answer counts a tool under is lowercase snake_case (Anthropic's server_tool_use
# keys, the Responses API's item types): a price under web-search, Web_Search, WebSearch or
# "web search" loaded and was never billed.
_TOOL_NAME = re.compile(r"[a-z][a-z0-9_]*")


# Responses tool types whose calls are counted under another name than their own: their output
# items' (``computer_call``: computer). ``tool_fees`` reserves them under it.
RESPONSES_COUNTED_AS = {
    "web_search_preview": "web_search",
    "computer_use_preview": "computer",
    "computer_use": "computer",
    "custom": "custom_tool",
}


def _counted_name(tool: str) -> None:
    if _TOOL_NAME.fullmatch(tool) is None:
        raise ValueError(
            f"{tool[:60]!r}: no answer counts calls under this name: a tool's name is lowercase "
            "letters, digits and underscores, as the answers spell it (web_search, web_fetch, file_search)"
        )
    counted = RESPONSES_COUNTED_AS.get(tool)
    if counted is not None and tool != "web_search_preview":  # priced apart when named
        raise ValueError(f"{tool}: no answer counts calls under this name: price the tool as '{counted}'")
    found = _NOT_A_TOOL_NAME.fullmatch(tool)
    if found is not None:
        raise ValueError(
            f"{tool}: no answer counts calls under this name: price the tool by its bare name, "
            f"'{tool[: found.start(1)]}' (web_search, web_fetch, file_search)"
        )


class ModelConfig(Frozen):
    upstream: str
    encoding: str | None = None
    # At most a count a provider may tell, as ``limits.default_max_output_tokens``.
    max_output_tokens: int | None = Field(default=None, ge=1, le=10**12)
    # Input tokens reserved for each image, audio or file part of a prompt: their count depends
    # on the model, the size and the detail, which the proxy cannot know (0: not reserved).
    media_part_input_tokens: int = Field(default=0, ge=0, le=10_000_000)
    # Input tokens a provider adds to a call that carries tools, beyond their definitions (the
    # system prompt of Anthropic's tool use). None: 600 for an Anthropic upstream, else 0.
    tools_input_tokens: int | None = Field(default=None, ge=0, le=10_000_000)
    # Input tokens the served model's chat template adds beyond OpenAI's chat format, which the
    # estimate counts (``estimate.TOKENS_PER_MESSAGE``): per call (a default system block: Llama
    # 3.1's date lines on vLLM, about 25) and per message (its role headers, about 5 more). Not
    # counted, each short call is billed past its reserve by that much (0: nothing added).
    prompt_overhead_tokens: int = Field(default=0, ge=0, le=10_000_000)
    message_overhead_tokens: int = Field(default=0, ge=0, le=10_000_000)
    # The model reasons in tokens it bills and never streams, unasked (OpenAI's o-series and
    # gpt-5): a call of it left without the provider's final usage is billed at its reserve, as
    # one that asks to reason (reasoning_effort, Anthropic's thinking) is; a count of what came
    # back would miss the reasoning.
    hidden_reasoning: bool = False
    price_per_million: PricePerMillion | None = None
    # Prices of the processing tiers a client may ask for (OpenAI's service_tier: priority,
    # flex), beside the default's; a priced model refuses a tier not priced here.
    service_tiers: dict[str, PricePerMillion] = {}  # noqa: RUF012 (a pydantic field: copied per instance)
    # Prices per 1,000 calls of a provider's hosted tools, beside the tokens (Anthropic's
    # web_search, web_fetch; OpenAI's Responses web_search, file_search): by tool name, any name
    # the answers count (``tool_fees``). A tool not named here costs nothing.
    price_per_thousand_calls: dict[str, ToolPrice] = {}  # noqa: RUF012 (a pydantic field)
    # Dearer prices past a number of input tokens (None: the same prices at any length).
    long_context: LongContextPrices | None = None

    @cached_property
    def priced_tiers(self) -> Mapping[str, dict[str, int]]:
        """Micro-units per million tokens by processing tier ("default": the model's own),
        computed once per config (``service_tiers.tier_rates``; empty: the model is unpriced)."""
        price = self.price_per_million
        if price is None:
            return {}
        tiers = {name: self._own_images(tier) for name, tier in self.service_tiers.items()}
        return {"default": price.rates, **tiers}

    @cached_property
    def long_priced_tiers(self) -> Mapping[str, dict[str, int]]:
        """``priced_tiers`` past the long-context threshold (``service_tiers.long_tier_rates``;
        empty: no such prices)."""
        long = self.long_context
        if long is None or self.price_per_million is None:
            return {}
        tiers = {name: self._own_images(tier) for name, tier in long.service_tiers.items()}
        return {"default": self._own_images(long.price_per_million), **tiers}

    def _own_images(self, table: PricePerMillion) -> dict[str, int]:
        """``table``'s rates, its image prices the model's own where it names none: the image
        tool's tokens are the image model's, priced alike whatever tier or context the calling
        model ran at; taken as ``table``'s text, a flex table billed gpt-image-1's pictures at
        gpt-5's flex output price."""
        own = self.price_per_million
        rates = table.rates
        if own is None:
            return rates
        kept = {
            kind: own.rates[kind]
            for kind, given in (("image_input", own.image_input), ("image_output", own.image_output))
            if given is not None and getattr(table, kind) is None
        }
        return {**rates, **kept} if kept else rates

    @cached_property
    def tool_rates(self) -> dict[str, int]:
        """Micro-units per 1,000 calls by tool, computed once per config (empty: none priced)."""
        return micros_per_thousand_calls(self.price_per_thousand_calls)

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str | None) -> str | None:
        # A name tiktoken does not know (a typo: o200k, o200k-base) loaded nothing at start and
        # left the model reserved at UTF-8 bytes and counted at 4 characters a token, unseen.
        if value is None or value == "bytes":
            return value
        import tiktoken

        known = tiktoken.list_encoding_names()
        if value not in known:
            raise ValueError(
                f"unknown tiktoken encoding {value[:60]!r} (known: {', '.join(known)}; or bytes)"
            )
        return value

    @field_validator(
        "max_output_tokens",
        "media_part_input_tokens",
        "tools_input_tokens",
        "prompt_overhead_tokens",
        "message_overhead_tokens",
        mode="before",
    )
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        # YAML's no/off/false would be 0 tokens (the 600 of Anthropic's tool prompt unreserved).
        return not_a_bool(value)

    @field_validator("price_per_thousand_calls", mode="before")
    @classmethod
    def _prices_not_bools(cls, value: Any) -> Any:
        # YAML's yes/no would be a price of 1 or 0 per 1,000 calls.
        if isinstance(value, dict):
            for tool, price in value.items():
                if not isinstance(tool, str) or not tool:
                    raise ValueError("a tool's name is a non-empty string (web_search, file_search, ...)")
                _counted_name(tool)
                not_a_bool(price, f"{tool}: a price")
        return value

    @field_validator("price_per_thousand_calls")
    @classmethod
    def _tool_prices_six_places(cls, value: dict[str, Decimal]) -> dict[str, Decimal]:
        micros_per_thousand_calls(value)
        return value

    @model_validator(mode="after")
    def _tiers_beside_a_price(self) -> ModelConfig:
        if self.service_tiers and self.price_per_million is None:
            # An unpriced model's calls cost 0: a tier's prices would be ignored.
            raise ValueError("service_tiers: price_per_million (the default tier's prices) is needed too")
        if self.price_per_thousand_calls and self.price_per_million is None:
            # An unpriced model's calls cost 0: its tools' prices would be ignored.
            raise ValueError("price_per_thousand_calls: price_per_million is needed too")
        for name in self.service_tiers:
            if name in ("auto", "default"):
                raise ValueError(f"service_tiers.{name}: the default tier's prices are price_per_million")
        long = self.long_context
        if long is not None:
            if self.price_per_million is None:
                raise ValueError("long_context: price_per_million (the prices below it) is needed too")
            # A tier's long calls at its short prices would be billed below their cost.
            unpriced = sorted(set(self.service_tiers) - set(long.service_tiers))
            if unpriced:
                raise ValueError(
                    f"long_context.service_tiers: no long-context prices for the tier '{unpriced[0]}' "
                    "(service_tiers prices it): price each tier past the threshold too"
                )
            stray = sorted(set(long.service_tiers) - set(self.service_tiers))
            if stray:
                raise ValueError(
                    f"long_context.service_tiers.{stray[0]}: not a tier of service_tiers (price it there too)"
                )
        return self
