"""End to end: every non-streaming call ends with one ledger entry, the right outcome and the
provider's figures; rejected answers are 422s that are billed and not retried."""

from __future__ import annotations

import ssl
from typing import Any

import openai
import pytest
import tiktoken

from proxy.forward import _connect_refusal
from proxy.observe import Observation
from proxy.tokenizer import Tokenizer
from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy, ProxyFactory, refused_port
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import (
    CHARS_PROMPT_TOKENS,
    DETAILS,
    FAKE_PROMPT_TOKENS,
    MODEL,
    MSGS,
    PROMPT,
    JsonDict,
    assert_no_secret,
    assert_provider_usage,
    assert_reserve_usage,
    assert_zero_usage,
    byte_encoding,
    chars_tokens,
    ledger_entries,
    raw_post,
    reply_text,
    run_headers,
    the_entry,
    upstream_override,
)
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, scripted_upstreams
from tests.test_responses_phases import Weather, response_object

REJECT_ALL = {"on_truncate": "reject", "on_invalid_json": "reject"}
JSON_FORMAT: Any = {"type": "json_object"}


def assert_billing_headers(headers: Any, entry: JsonDict) -> None:
    assert headers["x-billing-outcome"] == entry["outcome"]
    assert headers["x-billing-input-tokens"] == entry["input_tokens"]
    assert headers["x-billing-output-tokens"] == entry["output_tokens"]
    assert headers["x-billing-usage-source"] == entry["usage_source"]


async def test_ok_charges_provider_usage_and_tags_headers(proxy: Proxy, fake: FakeUpstream) -> None:
    async with proxy.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MSGS,
            extra_body={"fake": {"usage": DETAILS}},
            extra_headers=run_headers("r1"),
        )
    completion = raw.parse()
    assert completion.choices[0].message.content == reply_text(8)
    (bill,) = fake.bill
    assert (bill.prompt_tokens, bill.completion_tokens, bill.cached_tokens, bill.reasoning_tokens) == (
        FAKE_PROMPT_TOKENS,
        8,
        3,
        4,
    )
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "ok"
    assert entry["finish_reasons"] == "stop"
    assert (entry["stream"], entry["endpoint"], entry["upstream_status"]) == ("0", "chat.completions", "200")
    assert_provider_usage(entry, bill)
    assert_billing_headers(raw.headers, entry)
    assert_no_secret(raw.headers, raw.content)
    # The client's key stays at the proxy; the upstream gets the configured one.
    received = fake.received[-1]
    assert received.headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert all(KEY_A not in value for value in received.headers.values())
    assert KEY_A.encode() not in received.raw


@pytest.mark.parametrize(
    ("ctl", "outcome", "finish"),
    [
        ({"mode": "truncate"}, "truncated", "length"),
        ({"mode": "content_filter"}, "refused", "content_filter"),
        ({"mode": "refusal"}, "refused", "stop"),
    ],
    ids=["truncate", "content_filter", "refusal"],
)
async def test_answer_outcomes(
    proxy: Proxy, fake: FakeUpstream, ctl: JsonDict, outcome: str, finish: str
) -> None:
    async with proxy.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MSGS, extra_body={"fake": ctl}, extra_headers=run_headers("r1")
        )
    assert raw.status_code == 200
    assert raw.parse().choices[0].finish_reason == finish
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["finish_reasons"]) == (outcome, finish)
    assert_provider_usage(entry, fake.bill[0])
    assert_billing_headers(raw.headers, entry)


async def test_valid_json_passes_as_ok(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(policy=REJECT_ALL)
    async with proxy.client() as client:
        completion = await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            response_format=JSON_FORMAT,
            extra_body={"fake": {"content": '{"answer": [1, 2, 3]}'}},
            extra_headers=run_headers("r1"),
        )
    assert completion.choices[0].message.content == '{"answer": [1, 2, 3]}'
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "ok"
    assert_provider_usage(entry, fake.bill[0])


REJECTIONS = [
    pytest.param({"mode": "truncate"}, {}, "rejected:output-truncated", id="output-truncated"),
    pytest.param(
        {"content": "Sure! Here is your JSON: {}"},
        {"response_format": JSON_FORMAT},
        "rejected:parse-json: ",
        id="parse-json",
    ),
    pytest.param(
        {"content": '{"answer": [1, 2, 3, 4, 5]}', "mode": "truncate"},
        {"response_format": JSON_FORMAT, "max_tokens": 3},
        "rejected:parse-json-truncated",
        id="parse-json-truncated",
    ),
]


@pytest.mark.parametrize(("ctl", "kwargs", "outcome"), REJECTIONS)
async def test_rejected_answer_is_a_billed_422_the_sdk_does_not_retry(
    make_proxy: ProxyFactory, fake: FakeUpstream, ctl: JsonDict, kwargs: JsonDict, outcome: str
) -> None:
    proxy = await make_proxy(policy=REJECT_ALL)
    async with proxy.client() as client:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await client.with_options(max_retries=2).chat.completions.create(
                model=MODEL,
                messages=MSGS,
                extra_body={"fake": ctl},
                extra_headers=run_headers("r1"),
                **kwargs,
            )
    assert len(fake.bill) == 1  # not retried
    err = caught.value
    assert err.status_code == 422
    assert err.response.headers["x-should-retry"] == "false"
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"].startswith(outcome)
    if outcome.endswith(": "):
        assert len(entry["outcome"]) > len(outcome)  # the parser's complaint follows
    else:
        assert entry["outcome"] == outcome
    assert_provider_usage(entry, fake.bill[0])  # charged in full
    assert_billing_headers(err.response.headers, entry)


@pytest.mark.parametrize(("ctl", "kwargs", "outcome"), REJECTIONS)
async def test_rejected_answer_error_body(
    make_proxy: ProxyFactory, fake: FakeUpstream, ctl: JsonDict, kwargs: JsonDict, outcome: str
) -> None:
    proxy = await make_proxy(policy=REJECT_ALL)
    body = {"model": MODEL, "messages": MSGS, "fake": ctl, **kwargs}
    result = await raw_post(proxy, body, "r1")
    assert result.status == 422
    assert result.headers["x-should-retry"] == "false"
    assert result.headers["content-type"].startswith("application/json")
    error = result.json()["error"]
    assert error["type"] == "output_rejected"
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"].startswith(outcome)
    reason = entry["outcome"].removeprefix("rejected:")
    message = error["message"]
    assert reason in message
    bill = fake.bill[0]
    assert f"{bill.prompt_tokens} input tokens" in message
    assert f"{bill.completion_tokens} output tokens" in message
    assert_provider_usage(entry, bill)
    assert_billing_headers(result.headers, entry)


async def test_n2_with_one_truncated_choice_is_truncated(proxy: Proxy, fake: FakeUpstream) -> None:
    async with proxy.client() as client:
        completion = await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            n=2,
            extra_body={"fake": {"finish_reasons": ["stop", "length"]}},
            extra_headers=run_headers("r1"),
        )
    assert [c.finish_reason for c in completion.choices] == ["stop", "length"]
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["finish_reasons"]) == ("truncated", "stop,length")
    assert fake.bill[0].completion_tokens == 16
    assert_provider_usage(entry, fake.bill[0])


async def test_missing_usage_counts_characters(proxy: Proxy, fake: FakeUpstream) -> None:
    async with proxy.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MSGS,
            extra_body={"fake": {"no_usage": True}},
            extra_headers=run_headers("r1"),
        )
    assert raw.parse().usage is None
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "chars")
    assert int(entry["input_tokens"]) > 0 and int(entry["output_tokens"]) > 0
    assert int(entry["input_tokens"]) == CHARS_PROMPT_TOKENS
    assert int(entry["output_tokens"]) == chars_tokens(reply_text(8))
    assert_billing_headers(raw.headers, entry)


async def test_missing_usage_counts_with_tiktoken(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": byte_encoding()}))
    async with proxy.client() as client:
        await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            extra_body={"fake": {"no_usage": True}},
            extra_headers=run_headers("r1"),
        )
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "tokenizer")
    # one token per byte, plus 4 per message and 3 for the reply
    assert int(entry["input_tokens"]) == len(PROMPT) + 4 + 3
    assert int(entry["output_tokens"]) == len(reply_text(8))


async def test_a_count_without_usage_is_never_above_the_output_the_upstream_was_held_to(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """The provider wrote at most the cap it was sent; 4 characters a token counts its 10 words
    as 13. That was billed (past a ceiling the reserve fitted exactly) as if it had written more."""
    async with proxy.client() as client:
        await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=10,
            extra_body={"fake": {"no_usage": True, "reply_tokens": 10}},
            extra_headers=run_headers("capped"),
        )
    assert fake.bill[0].completion_tokens == 10
    assert chars_tokens(reply_text(10)) > 10
    entry = await the_entry(proxy, "capped")
    assert (entry["usage_source"], entry["output_tokens"]) == ("chars", "10")


async def test_legacy_completions(proxy: Proxy, fake: FakeUpstream) -> None:
    async with proxy.client() as client:
        completion = await client.completions.create(
            model=MODEL,
            prompt="write a short poem",
            extra_body={"fake": {"usage": DETAILS}},
            extra_headers=run_headers("r1"),
        )
    assert completion.choices[0].text == reply_text(8)
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["endpoint"], entry["finish_reasons"]) == ("ok", "completions", "stop")
    assert fake.bill[0].prompt_tokens == 4
    assert_provider_usage(entry, fake.bill[0])


async def test_embeddings(proxy: Proxy, fake: FakeUpstream) -> None:
    async with proxy.client() as client:
        result = await client.embeddings.create(
            model="text-embedding-3-small", input=["one two", "three"], extra_headers=run_headers("r1")
        )
    assert len(result.data) == 2
    entry = await the_entry(proxy, "r1")
    assert (entry["outcome"], entry["endpoint"]) == ("ok", "embeddings")
    assert fake.bill[0].prompt_tokens == 3
    assert_provider_usage(entry, fake.bill[0])
    assert entry["output_tokens"] == "0"


def merging_encoding() -> tiktoken.Encoding:
    """A tokenizer that writes "aa" as one token: text joined across answers merges."""
    ranks = {bytes([i]): i for i in range(256)} | {b"aa": 256}
    return tiktoken.Encoding(name="o200k_base", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})


@pytest.mark.parametrize("counter", ["chars", "tokenizer"])
async def test_without_usage_each_answer_is_counted_on_its_own(
    make_proxy: ProxyFactory, fake: FakeUpstream, counter: str
) -> None:
    """Four answers "a", a token each to the provider, were counted as the one text "aaaa": 1 token
    at 4 characters a token, 2 with a tokenizer that merges "aa"."""
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": merging_encoding()} if counter == "tokenizer" else {})
    )
    async with proxy.client() as client:
        await client.completions.create(
            model=MODEL,
            prompt="say a",
            n=4,
            max_tokens=5,
            extra_body={"fake": {"no_usage": True, "content": "a"}},
            extra_headers=run_headers("n4"),
        )
    entry = await the_entry(proxy, "n4")
    assert entry["usage_source"] == counter, entry
    assert int(entry["output_tokens"]) == fake.bill[0].completion_tokens == 4, entry


async def test_an_embeddings_usage_of_a_total_alone_is_the_providers_input(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """Voyage AI's embeddings report {"total_tokens": N} alone: all of it input, as an embedding
    writes nothing. It was ignored, and the input counted (4 characters a token: 6, not 9)."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    data = [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}]
    answer = {"object": "list", "data": data, "model": "voyage-3", "usage": {"total_tokens": 9}}
    script.plan = Plan(chunks=[dumps(answer)])
    async with proxy.client() as client:
        result = await client.embeddings.create(
            model="voyage-3", input="one two three four five", extra_headers=run_headers("v")
        )
    assert result.data[0].embedding == [0.5, 0.25]
    entry = await the_entry(proxy, "v")
    assert (entry["usage_source"], entry["input_tokens"]) == ("provider", "9"), entry
    assert entry["output_tokens"] == "0", entry


@pytest.mark.parametrize("counter", ["chars", "tokenizer"])
@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/completions"])
async def test_without_usage_each_input_of_a_batch_is_counted_on_its_own(
    make_proxy: ProxyFactory, fake: FakeUpstream, path: str, counter: str
) -> None:
    """A provider counts each input of an embeddings batch (each prompt of a completions list)
    on its own. Counted joined, the line breaks between them were billed (with a tokenizer: one
    token more per input than the provider's 100), and at 4 characters a token short inputs
    shared their tokens (50 for 100 one-letter inputs)."""
    encodings = {"cl100k_base": byte_encoding(), "o200k_base": byte_encoding()}
    proxy = await make_proxy(tokenizer=Tokenizer(encodings if counter == "tokenizer" else {}))
    inputs = ["a"] * 100
    no_usage: Any = {"fake": {"no_usage": True}}
    async with proxy.client() as client:
        if path == "/v1/embeddings":
            await client.embeddings.create(
                model="text-embedding-3-small",
                input=inputs,
                extra_body=no_usage,
                extra_headers=run_headers("b"),
            )
        else:
            await client.completions.create(
                model=MODEL, prompt=inputs, max_tokens=1, extra_body=no_usage, extra_headers=run_headers("b")
            )
    entry = await the_entry(proxy, "b")
    assert entry["usage_source"] == counter, entry
    assert int(entry["input_tokens"]) == fake.bill[0].prompt_tokens == 100, entry


UPSTREAM_FAILURES = [
    pytest.param(
        {"mode": "error", "status": 500}, 500, openai.InternalServerError, "upstream_error", "zero", id="500"
    ),
    pytest.param(
        {"mode": "error", "status": 400}, 400, openai.BadRequestError, "upstream_4xx", "zero", id="400"
    ),
    pytest.param(
        {"mode": "error", "status": 503, "error_body": "text"},
        503,
        openai.InternalServerError,
        "upstream_error",
        "reserve",
        id="503-text",
    ),
    pytest.param({"mode": "cut"}, 502, openai.InternalServerError, "upstream_error", "reserve", id="cut"),
]


@pytest.mark.parametrize(("ctl", "status", "error", "outcome", "charge"), UPSTREAM_FAILURES)
async def test_upstream_failures(
    proxy: Proxy,
    fake: FakeUpstream,
    ctl: JsonDict,
    status: int,
    error: type[openai.APIStatusError],
    outcome: str,
    charge: str,
) -> None:
    async with proxy.client() as client:
        with pytest.raises(error) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=MSGS, extra_body={"fake": ctl}, extra_headers=run_headers("r1")
            )
    err = caught.value
    assert err.status_code == status
    assert_no_secret(err.response.headers, err.response.content)
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == outcome
    if charge == "zero":
        assert_zero_usage(entry)
    else:
        assert_reserve_usage(entry)
    assert_billing_headers(err.response.headers, entry)
    assert fake.calls == 1


async def test_upstream_timeout_before_headers(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(upstreams=upstream_override(fake.base_url, timeout_s=1))
    async with proxy.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                extra_body={"fake": {"mode": "stall_before_headers", "stall_s": 10}},
                extra_headers=run_headers("r1"),
            )
    assert caught.value.status_code == 504
    entry = await the_entry(proxy, "r1")
    assert entry["outcome"] == "upstream_timeout"
    assert_reserve_usage(entry)
    assert_billing_headers(caught.value.response.headers, entry)


async def test_upstream_connection_refused(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    closed = f"http://127.0.0.1:{refused_port()}/v1"
    proxy = await make_proxy(upstreams=upstream_override(closed))
    async with proxy.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers=run_headers("r1"))
    assert caught.value.status_code == 502
    assert_no_secret(caught.value.response.headers, caught.value.response.content)
    # In the system's words, without the upstream's address (the operator's network, not the
    # client's business: asyncio's own words were "Connect call failed ('127.0.0.1', port)").
    message = caught.value.response.json()["error"]["message"]
    assert message.endswith("cannot connect to upstream: Connection refused"), message
    assert "127.0.0.1" not in caught.value.response.text
    # Not a request made: a requests ceiling (a window of calls) is not spent on it.
    entry = await the_entry(proxy, "r1", requests=0)
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "none")
    assert_zero_usage(entry)
    assert fake.bill == [] and fake.received == []


async def test_legacy_completions_reserve_every_answer_best_of_writes(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    # best_of=3, n=1: the provider writes (and bills) three answers and returns the best.
    async with proxy.client() as client:
        await client.completions.create(
            model=MODEL, prompt="write", max_tokens=50, best_of=3, extra_headers=run_headers("r1")
        )
    entry = await the_entry(proxy, "r1")
    assert entry["reserved_output_tokens"] == "150"
    assert entry["output_tokens"] == str(fake.bill[-1].completion_tokens) == "24"  # 3 x 8 words


async def test_legacy_completions_without_usage_bill_the_answers_best_of_did_not_return(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """best_of=3, n=1 and no usage: a count of the one answer returned would bill a third of
    what the provider wrote; the unseen answers settle at the reserve, as a call without usage
    it cannot count does."""
    async with proxy.client() as client:
        await client.completions.create(
            model=MODEL,
            prompt="write",
            max_tokens=50,
            best_of=3,
            extra_headers=run_headers("r1"),
            extra_body={"fake": {"no_usage": True}},
        )
    entry = await the_entry(proxy, "r1")
    assert fake.bill[-1].completion_tokens == 24  # what the provider wrote: 3 answers of 8 words
    assert entry["usage_source"] == "reserve", entry
    assert int(entry["output_tokens"]) == 150 >= fake.bill[-1].completion_tokens, entry


def _best_of_answer(stream: bool) -> list[bytes]:
    """One answer of the three best_of=3 wrote, and a usage with the prompt's count only."""
    head = {"id": "cmpl-1", "object": "text_completion", "model": MODEL}
    usage = {"prompt_tokens": 1}
    if not stream:
        choice = {"index": 0, "text": "one answer", "logprobs": None, "finish_reason": "stop"}
        return [dumps({**head, "choices": [choice], "usage": usage})]
    chunks = [
        {"choices": [{"index": 0, "text": "one answer", "logprobs": None, "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]},
        {"choices": [], "usage": usage},
    ]
    return [*(b"data: " + dumps({**head, **c}) + b"\n\n" for c in chunks), b"data: [DONE]\n\n"]


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_a_best_of_usage_without_an_output_count_bills_the_answers_it_did_not_return(
    make_proxy: ProxyFactory, script: ScriptedUpstream, stream: bool
) -> None:
    """A usage with the prompt's count only: its output was counted from the one answer
    returned (2 tokens), as if best_of had written nothing else."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(
        content_type="text/event-stream" if stream else "application/json", chunks=_best_of_answer(stream)
    )
    body = {"model": MODEL, "prompt": "write", "best_of": 3, "max_tokens": 50, "stream": stream}
    result = await raw_post(proxy, body, "best-of", path="/v1/completions")
    assert result.status == 200, result.body
    entry = await the_entry(proxy, "best-of")
    assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "150"), entry


@pytest.mark.parametrize(
    ("prompt", "reserved"),
    [
        (["one", "two", "three"], 300),  # three prompts, each answered n=2 times
        ([[1, 2], [3], [4, 5, 6]], 300),  # the same as token id lists
        ([1, 2, 3], 100),  # a flat list of ids is one prompt
    ],
)
async def test_legacy_completions_reserve_every_prompts_answers(
    proxy: Proxy, fake: FakeUpstream, prompt: list[Any], reserved: int
) -> None:
    async with proxy.client() as client:
        await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=50, n=2, extra_headers=run_headers("r1")
        )
    entry = await the_entry(proxy, "r1")
    assert entry["reserved_output_tokens"] == str(reserved)


async def test_an_echoed_prompt_is_not_counted_as_output(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """With echo each answer begins with its prompt, billed as input: counted as output again
    when no usage came."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    prompt = "word " * 100  # 125 tokens at 4 characters a token
    answer = {
        "id": "cmpl-1", "object": "text_completion", "model": MODEL,
        "choices": [
            {"index": i, "text": prompt + " ok", "logprobs": None, "finish_reason": "stop"} for i in range(2)
        ],
    }  # fmt: skip
    script.plan = Plan(chunks=[dumps(answer)])
    body = {"model": MODEL, "prompt": prompt, "echo": True, "n": 2, "max_tokens": 500}
    result = await raw_post(proxy, body, "echo", path="/v1/completions")
    assert result.status == 200, result.body
    entry = await the_entry(proxy, "echo")
    assert entry["usage_source"] == "chars"
    assert int(entry["output_tokens"]) <= 2 * chars_tokens(" ok") + 2, entry  # was 252


@pytest.mark.parametrize("usage", [None, {"prompt_tokens": 12}], ids=["no-usage", "no-output-count"])
async def test_an_audio_answer_without_an_output_count_is_billed_at_its_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream, usage: JsonDict | None
) -> None:
    """Its audio tokens cannot be counted from the answer (its text is only the transcript): it
    was billed 0 output tokens with no usage, content being null, and its transcript alone
    with a usage that has no output count."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    message = {
        "role": "assistant", "content": None, "refusal": None,
        "audio": {"id": "audio_1", "data": "UklGRiQAAABXQVZF" * 200, "transcript": "Hello there."},
    }  # fmt: skip
    answer = {"id": "c", "object": "chat.completion", "model": MODEL, "usage": usage,
              "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}  # fmt: skip
    script.plan = Plan(chunks=[dumps(answer)])
    body = {
        "model": MODEL, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
        "messages": [{"role": "user", "content": "Say something."}], "max_completion_tokens": 2000,
    }  # fmt: skip
    result = await raw_post(proxy, body, "audio")
    assert result.status == 200, result.body
    entry = await the_entry(proxy, "audio")
    assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "1000"), entry  # the model's cap


async def test_an_image_answer_without_usage_is_billed_at_its_reserve(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """OpenRouter's image models (``modalities`` with ``image``) bill the image's tokens as output
    (1,290 for a Gemini image) and return it as a data URL beside a few words of text. Was: the
    words alone counted, the image billed nothing."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0KGgo" * 200}}
    message = {"role": "assistant", "content": "Here is your cat.", "images": [image]}
    answer = {"id": "c", "object": "chat.completion", "model": MODEL,
              "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}  # fmt: skip
    script.plan = Plan(chunks=[dumps(answer)])
    body = {
        "model": MODEL, "modalities": ["image", "text"], "max_completion_tokens": 2000,
        "messages": [{"role": "user", "content": "Draw a cat."}],
    }  # fmt: skip
    result = await raw_post(proxy, body, "image")
    assert result.status == 200, result.body
    entry = await the_entry(proxy, "image")
    assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "1000"), entry  # the model's cap


def test_an_audio_answers_transcript_is_its_text() -> None:
    obs = Observation()
    obs.observe(
        {"choices": [{"index": 0, "delta": {"audio": {"id": "a", "transcript": "Hi there"}}}]}, streaming=True
    )
    assert obs.all_text() == "Hi there"


def _completion(texts: list[str]) -> bytes:
    choices = [
        {"index": i, "text": t, "logprobs": None, "finish_reason": "stop"} for i, t in enumerate(texts)
    ]
    return dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": choices})


WRITTEN = " " + "word " * 200  # 1,001 characters: 251 tokens at 4 characters a token


@pytest.mark.parametrize(
    ("prompt", "answers", "least"),
    [
        # Token ids: the echo's text is not sure (ids that are not canonical, another tokenizer).
        ([64] * 400, ["a" * 400 + WRITTEN], chars_tokens(WRITTEN)),
        # An upstream that ignores echo (many OpenAI-compatible servers).
        ("word " * 200, [WRITTEN], chars_tokens(WRITTEN)),
        # Each short prompt rounded up on its own, taken off the answers counted together.
        (["a"] * 16, ["abcd"] * 16, chars_tokens("bcd" * 16)),
    ],
    ids=["token-ids", "echo-ignored", "many-short-prompts"],
)
async def test_an_echo_is_left_out_only_where_it_is(
    make_proxy: ProxyFactory, script: ScriptedUpstream, prompt: Any, answers: list[str], least: int
) -> None:
    """The echoes' counts were taken off the answers' whatever the answers held: output the
    upstream wrote was billed as 0."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(chunks=[_completion(answers)])
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 500}
    result = await raw_post(proxy, body, "echo", path="/v1/completions")
    assert result.status == 200, result.body
    entry = await the_entry(proxy, "echo")
    assert entry["usage_source"] == "chars"
    assert int(entry["output_tokens"]) >= least, entry


async def test_an_echo_is_never_matched_to_another_prompts_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """An upstream that drops n answers once per prompt: mapped by index (n=2), answer 1 was
    checked against prompt 0, which the text it wrote happens to continue, and that text was
    left out of the count."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    long_prompt, short_prompt = "Once upon a time, in a land far, far away,", "Once upon a time"
    written = [" there lived a king.", ", in a land far, far away, there lived a queen."]
    script.plan = Plan(chunks=[_completion([long_prompt + written[0], short_prompt + written[1]])])
    body = {"model": MODEL, "prompt": [long_prompt, short_prompt], "echo": True, "n": 2, "max_tokens": 500}
    result = await raw_post(proxy, body, "echo", path="/v1/completions")
    assert result.status == 200, result.body
    entry = await the_entry(proxy, "echo")
    assert int(entry["output_tokens"]) >= chars_tokens("".join(written)), entry


def test_an_empty_prompts_answer_keeps_all_its_text() -> None:
    # Its echo is nothing: another prompt its written text begins with was left out.
    obs = Observation()
    obs.observe({"choices": [{"index": 0, "text": "abc def"}]}, streaming=False)
    assert obs.all_text(["", "abc"]) == "abc def"
    assert obs.all_text(["abc"]) == " def"


async def test_scoring_a_prompt_is_not_a_truncated_answer(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # max_tokens 0 with echo and logprobs asks the provider to score the prompt and write nothing
    # (lm-eval-harness's loglikelihood requests): every such answer ends with "length", by
    # construction, not because the answer was cut. Rejecting it as truncated makes the call
    # one that can never succeed, each retry billed.
    proxy = await make_proxy(policy={"on_truncate": "reject"})
    async with proxy.client() as client:
        scored = await client.completions.create(  # was: 422 rejected:output-truncated
            model="davinci-002",
            prompt="The capital of France is Paris",
            echo=True,
            logprobs=0,
            max_tokens=0,
            extra_headers={"X-Run-Id": "score"},
        )
    assert scored.choices[0].finish_reason == "length"
    [entry] = await ledger_entries(proxy, "score")
    assert entry["outcome"] == "ok", entry
    assert entry["usage_source"] == "provider" and entry["output_tokens"] == "0", entry


# A prewarm's answer: no output, its input (the cache written) billed.
PREWARM_USAGE = {
    "input_tokens": 1200,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 1200,
}


def _prewarmed(stream: bool) -> Plan:
    whole = response_object("completed", [], PREWARM_USAGE)
    if not stream:
        return Plan(chunks=[dumps(whole)])
    events = [
        {"type": "response.created", "response": response_object("in_progress", [], None)},
        {"type": "response.completed", "response": whole},
    ]
    chunks = [
        b"event: " + e["type"].encode() + b"\ndata: " + dumps({**e, "sequence_number": n}) + b"\n\n"
        for n, e in enumerate(events)
    ]
    return Plan(content_type="text/event-stream", chunks=chunks)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_a_prewarm_with_a_structured_output_is_not_held_to_json(
    make_proxy: ProxyFactory, script: ScriptedUpstream, stream: bool
) -> None:
    """``prompt_cache_options.prewarm: true`` prepares the prompt cache and writes nothing (the
    SDK: it overrides ``generate`` to false): a completed response with no output, billed its
    input. A client prewarming a structured-output conversation sends the ``text.format`` of its
    later calls (a changed format misses the cache). Under ``on_invalid_json: reject`` its empty
    output was held to JSON, a 422 ``rejected:parse-json`` for an answer that asked for none; it
    is judged as a legacy ``max_tokens: 0`` is, whole with nothing written."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url), policy=REJECT_ALL)
    script.plan = _prewarmed(stream)
    asked: Any = {
        "model": MODEL,
        "input": "a long shared prefix",
        "text_format": Weather,
        "extra_body": {"prompt_cache_options": {"prewarm": True}},
        "extra_headers": run_headers("prewarm"),
    }
    async with proxy.client() as client:
        if stream:
            async with client.responses.stream(**asked) as events:
                async for _ in events:
                    pass
                reply = await events.get_final_response()
        else:
            reply = await client.responses.parse(**asked)  # was: 422 rejected:parse-json
    assert reply.output == [] and reply.output_parsed is None
    entry = await the_entry(proxy, "prewarm")
    assert entry["outcome"] == "ok", entry
    assert (entry["input_tokens"], entry["output_tokens"]) == ("1200", "0"), entry


def _written(text: str, status: str) -> Plan:
    message = {
        "id": "msg_1",
        "type": "message",
        "status": "completed" if status == "completed" else "incomplete",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }
    usage = {**PREWARM_USAGE, "input_tokens": 30, "output_tokens": 25, "total_tokens": 55}
    whole = response_object(status, [message], usage)
    if status == "incomplete":
        whole["incomplete_details"] = {"reason": "max_output_tokens"}
    return Plan(chunks=[dumps(whole)])


@pytest.mark.parametrize(
    ("text", "status", "label"),
    [
        ("this is not json", "completed", "rejected:parse-json"),
        ('{"city": "Par', "incomplete", "rejected:parse-json-truncated"),
    ],
    ids=["invalid-json", "truncated"],
)
async def test_a_prewarm_an_upstream_answered_all_the_same_is_judged_as_its_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, text: str, status: str, label: str
) -> None:
    """An upstream or model that does not know ``prewarm`` writes an answer: held to the
    policy as any (the prewarm flag let a client past ``on_invalid_json`` and ``on_truncate``,
    a cut answer logged ok: the review)."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url), policy=REJECT_ALL)
    script.plan = _written(text, status)
    async with proxy.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.responses.create(
                model=MODEL,
                input="hi",
                text={"format": {"type": "json_object"}},
                extra_body={"prompt_cache_options": {"prewarm": True}},
                extra_headers=run_headers("prewarm-ignored"),
            )
    assert caught.value.status_code == 422
    entry = await the_entry(proxy, "prewarm-ignored")
    assert entry["outcome"].startswith(label), entry


@pytest.mark.parametrize(
    "err",
    [
        ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"),
        ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
        ssl.SSLEOFError(8, "[SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in violation of protocol"),
    ],
)
def test_a_tls_failure_is_not_told_as_an_unrelated_system_error(err: OSError) -> None:
    """A TLS error's number is OpenSSL's: read as the system's, a handshake that failed was told
    "Operation not permitted" (a review)."""
    told = _connect_refusal(err)
    # A certificate refused is told as such (the operator's ca_file to mend), the others as a
    # handshake that failed.
    said = "its TLS certificate is not trusted" if isinstance(err, ssl.SSLCertVerificationError) else None
    assert told.startswith(said or "the TLS handshake failed"), told
    assert told not in ("Operation not permitted", "Exec format error"), told


async def test_an_https_upstream_that_speaks_plain_http_is_told_as_a_tls_failure(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """base_url https:// on a port that speaks HTTP (a common slip): the handshake fails with
    WRONG_VERSION_NUMBER, which the client (and the operator reading its 502) is told."""
    tls_to_plain = fake.base_url.replace("http://", "https://", 1)
    proxy = await make_proxy(upstreams=upstream_override(tls_to_plain))
    async with proxy.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers=run_headers("r1"))
    assert caught.value.status_code == 502
    message = caught.value.response.json()["error"]["message"]
    assert "Operation not permitted" not in message and "WRONG_VERSION_NUMBER" in message, message
    assert "127.0.0.1" not in caught.value.response.text
