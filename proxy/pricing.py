"""Cost of a call in integer micro-units of the operator's currency, and what a call reserves.

Rounding rule: the exact cost of all token types of one call is summed first (in millionths of
a micro-unit, as integers) and rounded up once to a whole micro-unit. No floats on this path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from proxy.config_base import MAX_COUNT
from proxy.estimate import Estimate

TOKENS_PER_MILLION = 1_000_000
# A call of a hosted tool priced at P micro-units per 1,000 calls costs P * 1,000 millionths of a
# micro-unit, the unit a call's exact cost is summed in before its one round-up.
EXACT_PER_CALL_PER_THOUSAND = TOKENS_PER_MILLION // 1000
# The largest figure the store takes (settle.lua: 15 digits, exact as a Lua number). A reserve past
# it could never be settled, nor released. Config bounds ceilings and prices by it too.
MAX_AMOUNT = MAX_COUNT


def cost_micros(
    rates: Mapping[str, int] | None,
    *,
    input_tokens: int,
    cached_input_tokens: int = 0,
    output_tokens: int,
    reasoning_tokens: int = 0,
    cache_creation_input_tokens: int = 0,
    cache_creation_1h_input_tokens: int = 0,
    audio_input_tokens: int = 0,
    audio_output_tokens: int = 0,
    image_input_tokens: int = 0,
    image_output_tokens: int = 0,
    tool_fees_exact: int = 0,
) -> int:
    """``rates`` are micro-units per million tokens (``PricePerMillion.micros_per_million``).
    Each part is taken out of what is left of its whole (never below zero): a provider's parts
    that overlap or pass the whole are never billed twice. ``tool_fees_exact``: the hosted tool
    calls' cost in millionths of a micro-unit (``tool_fees_exact``), in the same round-up."""
    if rates is None:
        return 0
    cached = min(cached_input_tokens, input_tokens)
    creation = min(cache_creation_input_tokens, input_tokens - cached)
    creation_1h = min(cache_creation_1h_input_tokens, creation)
    audio_in = min(audio_input_tokens, input_tokens - cached - creation)
    # Most calls have none, and then the part is 0 whatever is left (never below 0): the min()
    # is skipped on every call's costs (the reserve's, the settle's).
    image_in = (
        min(image_input_tokens, input_tokens - cached - creation - audio_in) if image_input_tokens else 0
    )
    reasoning = min(reasoning_tokens, output_tokens)
    audio_out = min(audio_output_tokens, output_tokens - reasoning)
    image_out = min(image_output_tokens, output_tokens - reasoning - audio_out) if image_output_tokens else 0
    exact = (
        (input_tokens - cached - creation - audio_in - image_in) * rates["input"]
        + cached * rates["cached_input"]
        + (creation - creation_1h) * rates["cache_creation_input"]
        + creation_1h * rates["cache_creation_input_1h"]
        + audio_in * rates["audio_input"]
        + image_in * rates["image_input"]
        + (output_tokens - reasoning - audio_out - image_out) * rates["output"]
        + reasoning * rates["reasoning"]
        + audio_out * rates["audio_output"]
        + image_out * rates["image_output"]
        + tool_fees_exact
    )
    return -(-exact // TOKENS_PER_MILLION)


def tool_fees_exact(calls: Iterable[tuple[str, int]], micros_per_thousand: Mapping[str, int]) -> int:
    """The cost of hosted tool calls (by tool, as counted) in millionths of a micro-unit, at
    ``micros_per_thousand`` (``ModelConfig.tool_rates``); a tool not priced there costs nothing."""
    return sum(
        count * micros_per_thousand.get(tool, 0) * EXACT_PER_CALL_PER_THOUSAND for tool, count in calls
    )


INPUT_RATES = ("input", "cached_input", "cache_creation_input", "cache_creation_input_1h", "audio_input")
OUTPUT_RATES = ("output", "reasoning", "audio_output")
IMAGE_RATES = ("image_input", "image_output")


def worst_rates(rates: dict[str, int] | None, *, images: bool = False) -> dict[str, int] | None:
    """For the reserve, every input token at the dearest input rate (a cache write or audio can
    cost more than plain text) and every output token at the dearest output rate. The image
    output rate joins them for a call that asks for images (``Call.asks_images``): an image
    model's image output is dearer than its text, and no other call's answer is written in
    images (the Responses image generation tool's, told apart, are never reserved: overshoot).
    No answer's input is billed as images but that tool's: its rate stays its own."""
    if rates is None:
        return None
    output_kinds = (*OUTPUT_RATES, "image_output") if images else OUTPUT_RATES
    top_in = max(rates[kind] for kind in INPUT_RATES)
    top_out = max(rates[kind] for kind in output_kinds)
    worst = {**dict.fromkeys(INPUT_RATES, top_in), **dict.fromkeys(output_kinds, top_out)}
    worst["image_input"] = rates["image_input"]
    if not images:
        worst["image_output"] = rates["image_output"]
    return worst


def reserve_amounts(est: Estimate, rates: dict[str, int] | None, *, images: bool = False) -> dict[str, int]:
    return {
        "requests": 1,
        "input_tokens": est.input_tokens,
        "output_tokens": est.output_tokens,
        "total_tokens": est.input_tokens + est.output_tokens,
        "cost_micros": cost_micros(
            worst_rates(rates, images=images),
            input_tokens=est.input_tokens,
            output_tokens=est.output_tokens,
            tool_fees_exact=est.tool_fees_exact,
        ),
        "concurrent": 1,
    }
