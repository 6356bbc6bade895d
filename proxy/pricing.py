"""Cost of a call in integer micro-units of the operator's currency.

Rounding rule: the exact cost of all token types of one call is summed first (in millionths of
a micro-unit, as integers) and rounded up once to a whole micro-unit. No floats on this path.
"""

from __future__ import annotations

from collections.abc import Mapping

TOKENS_PER_MILLION = 1_000_000


def cost_micros(
    rates: Mapping[str, int] | None,
    *,
    input_tokens: int,
    cached_input_tokens: int = 0,
    output_tokens: int,
    reasoning_tokens: int = 0,
    cache_creation_input_tokens: int = 0,
) -> int:
    """``rates`` are micro-units per million tokens (``PricePerMillion.micros_per_million``)."""
    if rates is None:
        return 0
    cached = min(cached_input_tokens, input_tokens)
    creation = min(cache_creation_input_tokens, input_tokens - cached)
    reasoning = min(reasoning_tokens, output_tokens)
    exact = (
        (input_tokens - cached - creation) * rates["input"]
        + cached * rates["cached_input"]
        + creation * rates["cache_creation_input"]
        + (output_tokens - reasoning) * rates["output"]
        + reasoning * rates["reasoning"]
    )
    return -(-exact // TOKENS_PER_MILLION)
