"""Decide a call's outcome tag and the usage it is charged with.

Every forwarded call ends with exactly one outcome. Refused, truncated and rejected answers
keep their tokens: the policy may refuse the text, never the bill.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

from proxy.config import PolicyConfig
from proxy.observe import Observation
from proxy.tokenizer import Tokenizer, UsageSource
from proxy.values import value_class

OutcomeTag = Literal[
    "ok",
    "truncated",
    "refused",
    "rejected",
    "client_disconnected",
    "upstream_error",
    "upstream_timeout",
    "upstream_4xx",
    "lease_expired",
    "shutdown",
    "not_forwarded",
]
REFUSAL_REASONS = frozenset({"content_filter", "refusal"})
# "length" (OpenAI chat), "max_output_tokens" (Responses), "max_tokens" and
# "model_context_window_exceeded" (Anthropic: the answer filled what the context had left).
TRUNCATION_REASONS = frozenset({"length", "max_output_tokens", "max_tokens", "model_context_window_exceeded"})
# The answer is a call, not text (OpenAI's "tool_calls" and legacy functions' "function_call",
# Anthropic's "tool_use"), or a turn an Anthropic server tool paused ("pause_turn"), or its
# compaction step did ("compaction", with pause_after_compaction: the compaction block alone):
# continued by the next call.
NOT_THE_ANSWER_REASONS = frozenset({"tool_calls", "function_call", "tool_use", "pause_turn", "compaction"})

# The status a call whose client left before it was answered is logged with (nginx's word for
# it; the call's log line, ``record_call``).
CLIENT_CLOSED = 499


@value_class()
class Outcome:
    tag: OutcomeTag
    reason: str | None = None

    @property
    def label(self) -> str:
        return f"rejected:{self.reason}" if self.tag == "rejected" else self.tag


@value_class(kw_only=True)
class BilledUsage:
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    reasoning_tokens: int
    source: UsageSource
    cache_creation_input_tokens: int = 0
    cache_creation_1h_input_tokens: int = 0
    audio_input_tokens: int = 0
    audio_output_tokens: int = 0
    image_input_tokens: int = 0
    image_output_tokens: int = 0
    # Source "reserve" with the provider's input (a stream cut after Anthropic's message_start):
    # only the output is the reserve's, and only it is priced at its dearest rate.
    input_known: bool = False
    # Calls of the provider's hosted tools the answer counts (``Observation.tool_calls``), by
    # tool; priced per call where the operator priced the tool (``settle``).
    tool_calls: tuple[tuple[str, int], ...] = ()

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def by_kind(self) -> tuple[tuple[str, int], ...]:
        """Each kind's count (``TOKEN_KINDS``): the ledger's ``<kind>_tokens`` fields."""
        return (
            ("input", self.input_tokens),
            ("cached_input", self.cached_input_tokens),
            ("cache_creation_input", self.cache_creation_input_tokens),
            ("cache_creation_1h_input", self.cache_creation_1h_input_tokens),
            ("audio_input", self.audio_input_tokens),
            ("image_input", self.image_input_tokens),
            ("output", self.output_tokens),
            ("reasoning", self.reasoning_tokens),
            ("audio_output", self.audio_output_tokens),
            ("image_output", self.image_output_tokens),
        )


# What a call that never went out is billed: nothing, and no request counted (``settle._actual``).
NOTHING_BILLED = BilledUsage(
    input_tokens=0, cached_input_tokens=0, output_tokens=0, reasoning_tokens=0, source="none"
)
# Token kinds a bill names: input and output, and the parts of them priced apart (cache reads
# and writes, writes kept an hour, audio, images, reasoning).
TOKEN_KINDS = tuple(kind for kind, _ in NOTHING_BILLED.by_kind())


def _json_problem(text: str) -> str | None:
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        return f"{err.msg} at line {err.lineno} column {err.colno}"
    except RecursionError:
        # Valid JSON perhaps, but nested past what any parser of the client's is likely to take.
        return "nested too deeply to parse"
    return None


def classify_answer(
    obs: Observation,
    policy: PolicyConfig,
    *,
    json_mode: bool,
    writes_nothing: bool = False,
    prewarm: bool = False,
) -> Outcome:
    """The outcome of an answer that arrived in full (``writes_nothing``: no output was asked
    for, so an answer ending at its cap is whole; ``prewarm``: none was asked for, so an answer
    that wrote none holds no JSON to judge, whatever format the call names; one that wrote some,
    the option not known upstream, is judged as any)."""
    reasons = obs.finish_reasons.values()
    truncated = not writes_nothing and any(r in TRUNCATION_REASONS for r in reasons)
    if obs.refused or any(r in REFUSAL_REASONS for r in reasons):
        return Outcome("refused")
    wrote_none = prewarm and not obs.contents and not obs.calls
    if json_mode and policy.on_invalid_json == "reject" and not writes_nothing and not wrote_none:
        # Every answer, those whose finish reason never came (or came empty) too: n > 1.
        for index in sorted(set(obs.finish_reasons) | obs.calls | set(obs.contents)) or [0]:
            if obs.finish_reasons.get(index) in NOT_THE_ANSWER_REASONS:
                continue
            text = obs.content_of(index)
            if index in obs.calls and not text.strip():
                # The answer is a call (a forced tool_choice ends with "stop", legacy functions
                # with "function_call", Responses with its status): no text to hold to JSON.
                continue
            problem = _json_problem(text)
            if problem is not None:
                if obs.finish_reasons.get(index) in TRUNCATION_REASONS:
                    return Outcome("rejected", "parse-json-truncated")
                return Outcome("rejected", f"parse-json: {problem}")
    if truncated:
        if policy.on_truncate == "reject":
            return Outcome("rejected", "output-truncated")
        return Outcome("truncated")
    return Outcome("ok")


def estimated_usage(
    obs: Observation,
    *,
    prompt_text: str,
    prompt_overhead_tokens: int,
    encoding: str,
    tokenizer: Tokenizer,
    echoes: Sequence[str] = (),
    separate_texts: Sequence[str] = (),
    answer_cap: int = 0,
    prompt_scope: str | None = None,
) -> BilledUsage:
    """Count what was sent and what came back, when the provider said nothing (``echoes``: see
    ``Observation.answers``; ``separate_texts``: the prompt's texts the provider counts each on
    its own, the line breaks that join them in ``prompt_text`` no part of its input). Each answer
    is counted on its own too: joined, answers would share tokens (4 characters of four answers
    "a", merges across their ends), each of which the provider bills apart; and held to
    ``answer_cap`` (0: none), the cap each answer was sent with: a count above it (4 characters a
    token, another tokenizer's) is the count's error, not tokens the provider wrote.
    ``prompt_scope``: where the reserve remembered its counts of the prompt's texts (its
    tenant's), taken as they are (``Tokenizer.count``)."""
    prompts = separate_texts or [prompt_text]
    counts = [tokenizer.count(text, encoding, scope=prompt_scope) for text in prompts]
    answers = [tokenizer.count(text, encoding) for text in obs.answers(echoes)]
    input_tokens, source = sum(n for n, _ in counts), counts[0][1]
    output_tokens = sum(min(n, answer_cap) if answer_cap else n for n, _ in answers)
    if any(out_source == "chars" for _, out_source in answers):
        source = "chars"
    return BilledUsage(
        input_tokens=input_tokens + prompt_overhead_tokens,
        cached_input_tokens=0,
        output_tokens=output_tokens,
        reasoning_tokens=0,
        source=source,
    )


def provider_usage(obs: Observation) -> BilledUsage | None:
    if obs.usage is None:
        return None
    u = obs.usage
    return BilledUsage(
        input_tokens=u.input_tokens,
        cached_input_tokens=u.cached_input_tokens,
        output_tokens=u.output_tokens,
        reasoning_tokens=u.reasoning_tokens,
        source="provider",
        cache_creation_input_tokens=u.cache_creation_input_tokens,
        cache_creation_1h_input_tokens=u.cache_creation_1h_input_tokens,
        audio_input_tokens=u.audio_input_tokens,
        audio_output_tokens=u.audio_output_tokens,
        image_input_tokens=u.image_input_tokens,
        image_output_tokens=u.image_output_tokens,
    )


def reserve_usage(input_tokens: int, output_tokens: int) -> BilledUsage:
    return BilledUsage(
        input_tokens=input_tokens,
        cached_input_tokens=0,
        output_tokens=output_tokens,
        reasoning_tokens=0,
        source="reserve",
    )


ZERO_USAGE = BilledUsage(
    input_tokens=0, cached_input_tokens=0, output_tokens=0, reasoning_tokens=0, source="provider"
)
