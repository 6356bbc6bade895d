"""Which figures bill a call: the provider's first; else a count of a complete answer (tiktoken,
else 4 characters a token); else the reserve, which the call may have spent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from proxy.call import Call
from proxy.observe import Observation
from proxy.outcome import BilledUsage, estimated_usage, provider_usage, reserve_usage
from proxy.payload import asks_hour_cache_writes
from proxy.thread_pools import TenantPool
from proxy.tokenizer import QUICK_BOUND_CHARS, Tokenizer

# A count of the prompt and answers (no usage came) of more characters than this runs in a
# thread, not on the event loop, where it would hold every other call of the process. Below it
# the loop is held at most about a millisecond (tiktoken's time for 16 KB), the stall a reserve
# allows itself too (QUICK_BOUND_CHARS); a hop to a thread and back costs about 0.1 ms, more on
# a loaded machine, as much as counting 2 KB: most answers are counted sooner than sent away.
INLINE_COUNT_CHARS = QUICK_BOUND_CHARS


@dataclass(frozen=True, slots=True)
class Uncounted:
    """What bills a call whose figures need much text counted (``INLINE_COUNT_CHARS``): worked
    out by ``usage_counted``, in a thread, by the call's settle (shielded from a cancel of its
    handler as the settle is, and only by the settle that wins)."""

    complete: bool


# What bills a call, worked out (``billed_usage``) or to be (``usage_counted``).
Usage = BilledUsage | Uncounted


def usage_now(call: Call, obs: Observation, tokenizer: Tokenizer, *, complete: bool) -> Usage:
    """``billed_usage``, unless it may count more than ``INLINE_COUNT_CHARS``: then left to
    ``usage_counted``, off the event loop."""
    if _chars_to_count(call, obs) > INLINE_COUNT_CHARS:
        return Uncounted(complete)
    return billed_usage(call, obs, tokenizer, complete=complete)


async def usage_counted(
    call: Call, obs: Observation, tokenizer: Tokenizer, usage: Uncounted, counts: TenantPool
) -> BilledUsage:
    """``billed_usage`` on the settle count threads (``counts``): not queued behind the estimate
    thread's counts of other calls' prompts, nor behind reserves' counts, which a settle (and the
    client waiting on it) need not wait for; one of a tenant's at a time. The observation is
    whole by now (its answer has ended, or its relay was cut): the thread reads what no one
    writes."""
    count = functools.partial(billed_usage, call, obs, tokenizer, complete=usage.complete)
    return await counts.run(call.identity.tenant, count)


def _chars_to_count(call: Call, obs: Observation) -> int:
    """At most how many characters ``billed_usage`` may count (the answers' JSON escapes taken
    as characters): the prompt's and the answers'; none where the provider's final usage
    bills the call."""
    if obs.usage is not None and _final(call, obs):
        return 0
    est = call.estimate
    prompt = sum(map(len, est.separate_texts)) if est.separate_texts else len(est.prompt_text)
    answers = sum(len(piece) for pieces in obs.contents.values() for piece in pieces)
    return prompt + answers + sum(len(piece) for pieces in obs.extras.values() for piece in pieces)


def billed_usage(call: Call, obs: Observation, tokenizer: Tokenizer, *, complete: bool) -> BilledUsage:
    """Provider figures first; else count a complete answer; else the reserve. With the calls
    of hosted tools the answer counts, if any (billed where priced: ``settle``)."""
    usage = _billed_tokens(call, obs, tokenizer, complete=complete)
    return with_tool_calls(usage, obs)


def with_tool_calls(usage: BilledUsage, obs: Observation) -> BilledUsage:
    """``usage`` with the hosted tool calls ``obs`` counted (nearly every call: none): the
    provider's final count, where its final usage told one (Anthropic's); else (a stream cut,
    an answer without usage or whose usage counts no calls, a Responses answer's final output,
    empty in a failed one) the calls the answer showed where they are more than it counted."""
    calls = obs.tool_calls
    told = obs.tool_calls_told and obs.usage_final and obs.usage is not None
    if obs.tool_uses and not told:
        seen = obs.tool_uses
        calls = {**seen, **{tool: max(count, seen.get(tool, 0)) for tool, count in calls.items()}}
    if not calls:
        return usage
    return replace(usage, tool_calls=tuple(calls.items()))


def _billed_tokens(call: Call, obs: Observation, tokenizer: Tokenizer, *, complete: bool) -> BilledUsage:
    found = _untold_writes_priced(call, obs, provider_usage(obs))
    if call.asks_images:
        found = _untold_images_priced(obs, found)
    final = _final(call, obs)
    # Output no count of the answer sees: audio and image tokens (its text is only a
    # transcript, or words beside the image), reasoning tokens (never streamed, or streamed
    # as a summary), a Predicted Output's rejected tokens (written, thrown away, billed), and
    # the answers best_of wrote (and the provider bills) but did not return.
    unseen = call.media_output or call.hidden_reasoning or call.predicted_output or obs.hidden_output
    if (unseen or call.generations > call.choices) and (found is None or not final):
        # The output is the reserve's; the input the provider told (message_start) stands.
        if found is None or not found.input_tokens:
            return reserve_usage(call.reserved_input_tokens, call.reserved_output_tokens)
        return _reserved_output(call, found)
    if found is not None and not final and not found.input_tokens:
        # A report of no input before the final one (a gateway's message_start: 0 and 0, its
        # counts in message_delta; no call has no input): nothing of the input is known. A
        # complete answer is counted, a broken one billed at its reserve.
        found = None
    if found is not None and not final and not complete and not obs.error:
        # Input is known (message_start) but the stream broke or stalled before the output
        # count: the provider may have written up to the cap, as for a stream with no usage.
        return _reserved_output(call, found)
    if found is not None and not final and obs.all_text():
        # Input is known (message_start, a report of prompt tokens only) but the final
        # output count never came: count what was streamed, never less than what the
        # provider last said.
        counted = _estimated_usage(call, obs, tokenizer)
        if counted.output_tokens > found.output_tokens:
            return replace(found, output_tokens=counted.output_tokens, source=counted.source)
    if found is not None:
        return found
    if complete:
        return _estimated_usage(call, obs, tokenizer)
    return reserve_usage(call.reserved_input_tokens, call.reserved_output_tokens)


def _untold_writes_priced(call: Call, obs: Observation, found: BilledUsage | None) -> BilledUsage | None:
    """``found`` with the cache writes no TTL split tells (``cache_creation_untold_input_tokens``)
    kept an hour when the request keeps any an hour (``asks_hour_cache_writes``): written at the
    dearest price it could have been, as an unsure reading bills; else at the five minutes'."""
    untold = obs.usage.cache_creation_untold_input_tokens if obs.usage is not None else 0
    if found is None or not untold or not asks_hour_cache_writes(call.body):
        return found
    hour = min(found.cache_creation_1h_input_tokens + untold, found.cache_creation_input_tokens)
    return replace(found, cache_creation_1h_input_tokens=hour)


def _untold_images_priced(obs: Observation, found: BilledUsage | None) -> BilledUsage | None:
    """``found`` with its output all images (but its reasoning and audio), for a chat call asking
    for images (``Call.asks_images``), when its usage does not say how many it wrote: an image
    model's pictures cost many times its text (Gemini's 30 per million against 2.50), and an
    unsure reading bills the more."""
    if found is None or obs.usage is None or obs.usage.image_output_told:
        return found
    images = found.output_tokens - min(
        found.reasoning_tokens + found.audio_output_tokens, found.output_tokens
    )
    return replace(found, image_output_tokens=images)


def _final(call: Call, obs: Observation) -> bool:
    """Whether the provider's usage, if any, is its last word on the call."""
    # An embeddings usage has no output count, and no output to count: it is final as it is.
    return obs.usage_final or call.endpoint == "embeddings"


def _estimated_usage(call: Call, obs: Observation, tokenizer: Tokenizer) -> BilledUsage:
    est = call.estimate
    counted = estimated_usage(
        obs,
        prompt_text=est.prompt_text,
        prompt_overhead_tokens=est.prompt_overhead_tokens,
        encoding=call.encoding,
        tokenizer=tokenizer,
        echoes=_echoes(call),  # billed as input: not output again
        separate_texts=est.separate_texts,
        answer_cap=_answer_cap(call),
        # A text of the prompt the reserve counted on its own (a batch's input, a prompt of one
        # message) has its count remembered: not counted again. Not the joined text of several
        # parts: the reserve counted each part on its own, and the line break joining two may
        # merge into one token with the whitespace beside it.
        prompt_scope=est.cache_scope,
    )
    # The upstream was held to the reserved output (its cap went in every cap field): a
    # count of the text above it (4 characters a token, another tokenizer's) is the count's
    # error, not tokens the provider wrote.
    reserved = call.reserved_output_tokens
    if counted.output_tokens > reserved:
        counted = replace(counted, output_tokens=reserved)
    # A report that told the output and no input (a gateway's): the provider's figure, never
    # less (the README's real figures first), the input counted.
    if obs.output_alone_tokens > counted.output_tokens:
        counted = replace(counted, output_tokens=obs.output_alone_tokens)
    return counted


def _answer_cap(call: Call) -> int:
    """The output each answer may hold: the cap it went with (its request's, the model's, a
    clamp's) for each pass of a server-tool loop (``Estimate.output_passes``: each pass is held
    to the cap, the answer is all of them)."""
    cap = call.estimate.output_cap
    clamped = call.reservation.clamped_output_per_choice if call.reservation is not None else 0
    per_pass = min(cap, clamped) if cap and clamped else cap or clamped
    return per_pass * call.estimate.output_passes


def _echoes(call: Call) -> list[str]:
    """The prompts a legacy completion with echo repeats at the start of its answers; none for
    token-id prompts, whose text the proxy cannot be sure of."""
    prompt = call.body.get("prompt") if call.echo else None
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    return prompts if all(isinstance(p, str) for p in prompts) else []


def _reserved_output(call: Call, found: BilledUsage) -> BilledUsage:
    """The provider's input count, the reserve's output (never below what it told): not redone
    as a whole reserve by the settle (``input_known``)."""
    reserved = call.reserved_output_tokens
    return replace(
        found, output_tokens=max(found.output_tokens, reserved), source="reserve", input_known=True
    )
