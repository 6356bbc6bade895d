"""Which figures bill a call (``billed_usage``): the provider's first, else a count of a complete
answer, else the reserve, decided on the call and what was observed of its answer, without a
server. The paths through the proxy that lead here are in the outcome and dialect tests."""

from __future__ import annotations

import threading
from typing import Any

import orjson
import pytest

import proxy.billed_usage as billed_usage_module
from proxy.auth import Identity
from proxy.billed_usage import INLINE_COUNT_CHARS, Uncounted, billed_usage, usage_counted, usage_now
from proxy.call import Call
from proxy.config import Config
from proxy.config_load import parse_config
from proxy.ids import IdSource
from proxy.observe import Observation, ProviderUsage
from proxy.outcome import BilledUsage
from proxy.payload import Endpoint, parse_body
from proxy.plan import plan_call
from proxy.thread_pools import TenantPool
from proxy.tokenizer import CACHED_TEXT_CHARS, Tokenizer
from tests.conftest import base_config
from tests.test_tokenizer import CountingEncoding

TOKENIZER = Tokenizer({})  # no encodings here: a count is 4 characters a token
PROMPT = "a prompt of some forty characters, about"


def plan_of(
    config: Config,
    body: dict[str, Any],
    endpoint: Endpoint,
    *,
    tier: str = "standard",
    anthropic_beta: str = "",
) -> Call:
    """The call ``body`` makes under ``config``, planned as a handler plans it, without a server."""
    data, view = parse_body(orjson.dumps(body), endpoint)
    return plan_call(
        request_id="req-1",
        identity=Identity(tenant="team-a", tier=tier, key_name="a-ci"),
        run_id="run-1",
        endpoint=endpoint,
        body=data,
        view=view,
        config=config,
        tokenizer=TOKENIZER,
        ids=IdSource(),
        anthropic_beta=anthropic_beta,
    )


def planned(body: dict[str, Any], endpoint: Endpoint = "chat.completions", **models: Any) -> Call:
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:9")
    raw["models"] = {**raw["models"], **models}
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-up"}, key_secrets=False)
    return plan_of(config, body, endpoint)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": PROMPT}], **fields}


def answered(text: str, usage: ProviderUsage | None = None) -> Observation:
    obs = Observation()
    obs.add_text(0, text, content=True)
    obs.finish_reasons[0] = "stop"
    if usage is not None:
        obs.take_usage(usage)
    return obs


def told(input_tokens: int, output_tokens: int, *, output_known: bool = True) -> ProviderUsage:
    return ProviderUsage(input_tokens, output_tokens, 0, 0, output_known=output_known)


@pytest.mark.parametrize("complete", [True, False])
def test_the_providers_figures_bill_the_call_whatever_came_of_it(complete: bool) -> None:
    call = planned(chat(max_tokens=50))
    usage = billed_usage(call, answered("hi", told(12, 3)), TOKENIZER, complete=complete)
    assert (usage.input_tokens, usage.output_tokens, usage.source) == (12, 3, "provider")


def test_a_complete_answer_without_figures_is_counted_and_never_above_its_reserved_output() -> None:
    call = planned(chat(max_tokens=5))
    short = billed_usage(call, answered("four"), TOKENIZER, complete=True)
    assert short.source == "chars"  # no encoding: 4 characters a token
    assert short.output_tokens == 1  # "four"
    # The prompt counted (40 characters: 10, and the chat template's 7), not reserved at its
    # bytes as a bound.
    assert (short.input_tokens, call.reserved_input_tokens) == (17, 47)
    long = billed_usage(call, answered("x" * 400), TOKENIZER, complete=True)
    assert long.output_tokens == 5  # 100 by the count: the upstream was held to 5


def test_an_unfinished_answer_without_figures_is_billed_its_reserve() -> None:
    call = planned(chat(max_tokens=50))
    usage = billed_usage(call, answered("cut sh"), TOKENIZER, complete=False)
    assert usage.source == "reserve"
    assert (usage.input_tokens, usage.output_tokens) == (
        call.reserved_input_tokens,
        call.reserved_output_tokens,
    )


def test_an_input_count_alone_keeps_the_input_and_takes_the_reserved_output_when_cut() -> None:
    call = planned(chat(max_tokens=50))
    obs = answered("cut sh", told(12, 0, output_known=False))
    usage = billed_usage(call, obs, TOKENIZER, complete=False)
    assert (usage.input_tokens, usage.output_tokens, usage.source) == (12, 50, "reserve")
    assert usage.input_known
    above = billed_usage(call, answered("cut", told(12, 60, output_known=False)), TOKENIZER, complete=False)
    assert above.output_tokens == 60  # never below what the provider told


def test_an_input_count_alone_counts_a_complete_answer_never_below_what_was_told() -> None:
    call = planned(chat(max_tokens=500))
    counted = billed_usage(
        call, answered("y" * 80, told(12, 2, output_known=False)), TOKENIZER, complete=True
    )
    assert (counted.input_tokens, counted.output_tokens) == (12, 20)
    kept = billed_usage(call, answered("y" * 8, told(12, 9, output_known=False)), TOKENIZER, complete=True)
    assert (kept.input_tokens, kept.output_tokens, kept.source) == (12, 9, "provider")


def test_output_no_count_sees_is_billed_at_the_reserve_without_a_final_report() -> None:
    """A model that reasons in tokens it does not show: its text is not its output."""
    call = planned(chat(max_tokens=50), **{"gpt-4o-mini": {"upstream": "openai", "hidden_reasoning": True}})
    assert call.hidden_reasoning
    whole = billed_usage(call, answered("short"), TOKENIZER, complete=True)
    assert (whole.output_tokens, whole.source) == (50, "reserve")
    told_input = billed_usage(
        call, answered("short", told(12, 0, output_known=False)), TOKENIZER, complete=True
    )
    assert (told_input.input_tokens, told_input.output_tokens, told_input.source) == (12, 50, "reserve")
    final = billed_usage(call, answered("short", told(12, 30)), TOKENIZER, complete=True)
    assert (final.output_tokens, final.source) == (30, "provider")


def test_an_embeddings_report_is_final_without_an_output_count() -> None:
    call = planned({"model": "gpt-4o-mini", "input": PROMPT}, "embeddings")
    obs = Observation()
    obs.take_usage(told(9, 0, output_known=False))
    usage = billed_usage(call, obs, TOKENIZER, complete=False)
    assert (usage.input_tokens, usage.output_tokens, usage.source) == (9, 0, "provider")


LARGE = "word " * (INLINE_COUNT_CHARS // 5 + 1)  # past INLINE_COUNT_CHARS


async def test_much_text_to_count_is_left_to_a_thread_and_counted_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 6: a settle's count of much text runs off the event loop (``usage_counted``, on the
    settle count threads, apart from reserves' counts: the DoS hunt): the same figures as counted
    on it. A small count, and a large answer the provider's final usage bills (nothing to count),
    are worked out at once."""
    threads: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> BilledUsage:
        threads.append(threading.current_thread().name)
        return billed_usage(*args, **kwargs)

    monkeypatch.setattr(billed_usage_module, "billed_usage", recording)
    counts = TenantPool("settle-count", threads=1, per_tenant=1)
    call = planned(chat(max_tokens=1000))
    assert usage_now(call, answered("four"), TOKENIZER, complete=True) == billed_usage(
        call, answered("four"), TOKENIZER, complete=True
    )
    told_usage = usage_now(call, answered(LARGE, told(12, 3)), TOKENIZER, complete=True)
    assert not isinstance(told_usage, Uncounted) and told_usage.source == "provider"
    for complete in (True, False):
        later = usage_now(call, answered(LARGE), TOKENIZER, complete=complete)
        assert later == Uncounted(complete)
        counted = await usage_counted(call, answered(LARGE), TOKENIZER, later, counts)
        assert counted == billed_usage(call, answered(LARGE), TOKENIZER, complete=complete)
    # A large prompt of texts counted one by one (an embeddings batch): the prompt's characters.
    batch = planned({"model": "gpt-4o-mini", "input": [LARGE[:INLINE_COUNT_CHARS], "one more"]}, "embeddings")
    assert usage_now(batch, Observation(), TOKENIZER, complete=True) == Uncounted(True)
    counted = await usage_counted(batch, Observation(), TOKENIZER, Uncounted(True), counts)
    assert counted == billed_usage(batch, Observation(), TOKENIZER, complete=True)
    assert counted.input_tokens == INLINE_COUNT_CHARS // 4 + 2  # each input on its own
    assert threads.count("settle-count_0") == 3
    counts.shutdown()


def _planned_with(tokenizer: Tokenizer, body: dict[str, Any], endpoint: Endpoint) -> Call:
    """``planned``, its reserve counted by ``tokenizer``."""
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:9")
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-up"}, key_secrets=False)
    data, view = parse_body(orjson.dumps(body), endpoint)
    identity = Identity(tenant="team-a", tier="standard", key_name="a-ci")
    return plan_call(
        request_id="req-1",
        identity=identity,
        run_id="run-1",
        endpoint=endpoint,
        body=data,
        view=view,
        config=config,
        tokenizer=tokenizer,
        ids=IdSource(),
        anthropic_beta="",
    )


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("chat.completions", {"messages": [{"role": "user", "content": "long " * CACHED_TEXT_CHARS}]}),
        ("embeddings", {"input": ["long " * CACHED_TEXT_CHARS, "x " * CACHED_TEXT_CHARS]}),
        ("completions", {"prompt": "long " * CACHED_TEXT_CHARS, "max_tokens": 5}),
    ],
)
def test_a_prompt_text_the_reserve_counted_is_not_counted_again_without_usage(
    endpoint: Endpoint, body: dict[str, Any]
) -> None:
    """A text of the prompt the reserve counted on its own (a message alone, each input of a
    batch, a legacy prompt), long enough to be remembered, was tokenized again by the count of a
    call without usage: its remembered count is taken, the same figure."""
    enc = CountingEncoding()
    tokenizer = Tokenizer({"o200k_base": enc})
    call = _planned_with(tokenizer, {"model": "gpt-4o-mini", **body}, endpoint)
    assert call.estimate.input_exact  # counted, not a quick bound
    texts = list(call.estimate.separate_texts or [call.estimate.prompt_text])
    assert sorted(t for t in enc.encoded if len(t) >= CACHED_TEXT_CHARS) == sorted(texts)
    enc.encoded.clear()
    obs = Observation() if endpoint == "embeddings" else answered("four")
    usage = billed_usage(call, obs, tokenizer, complete=True)
    assert enc.encoded == ([] if endpoint == "embeddings" else ["four"])
    direct = sum(len(enc.inner.encode_ordinary(text)) for text in texts)
    assert usage.input_tokens == direct + call.estimate.prompt_overhead_tokens
    assert usage.source == "tokenizer"


def test_a_prompt_of_several_parts_is_counted_joined_as_before() -> None:
    """The reserve counted each message on its own, one token per break: no count of the text
    the settle bills (the messages joined), which is counted as ever."""
    enc = CountingEncoding()
    tokenizer = Tokenizer({"o200k_base": enc})
    messages = [{"role": "user", "content": "long " * CACHED_TEXT_CHARS}, {"role": "user", "content": "more"}]
    call = _planned_with(tokenizer, {"model": "gpt-4o-mini", "messages": messages}, "chat.completions")
    enc.encoded.clear()
    usage = billed_usage(call, answered("four"), tokenizer, complete=True)
    assert enc.encoded == [call.estimate.prompt_text, "four"]
    assert usage.input_tokens == len(enc.inner.encode_ordinary(call.estimate.prompt_text)) + 4 * 2 + 3
