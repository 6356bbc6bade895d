"""The stream event filter: runs of template events must give exactly what one event at a time
gives (client bytes and observation), however the stream is cut into reads."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder

from proxy.dialects import DIALECTS
from proxy.events import EventFilter
from proxy.observe import Observation
from tests.memory import held_after

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def event(obj: Any, *, usage_null: bool = True) -> bytes:
    if usage_null and isinstance(obj, dict):
        obj = {**obj, "usage": None}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def content(text: str, *, usage_null: bool = True, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return event({**BASE, **extra, "choices": [choice]}, usage_null=usage_null)


def finish(reason: str = "stop") -> bytes:
    choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
    return event({**BASE, "choices": [choice]})


def obfuscated(text: str, padding: str) -> bytes:
    """A content chunk as OpenAI sends it (``include_obfuscation`` defaults to true)."""
    return content(text)[:-3] + b',"obfuscation":"' + padding.encode() + b'"}\n\n'


def crafted(raw_text: bytes) -> bytes:
    """A template event whose text bytes are ``raw_text`` as sent, escaped or not."""
    return content("tok ").replace(b'"content":"tok "', b'"content":"' + raw_text + b'"')


USAGE = event(
    {**BASE, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}, usage_null=False
)
ROLE = event(
    {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
)
DONE = b"data: [DONE]\n\n"

TEXTS = st.one_of(
    st.sampled_from(
        ["tok ", "", " a", "x\\", '"', '\\"', "\\", "\n", "\\n", "é🚀", "}", '"},', "\\\\", "error", "usage"]
    ),
    st.text(max_size=8),
)
ODD = (
    ROLE,
    finish(),
    finish("length"),
    USAGE,
    b": keep-alive\n\n",
    b"data: {not json}\n\n",
    b'data: {"choices":[{"index":0,"delta":{"refusal":"no"},"finish_reason":null}],"usage":null}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}],"usage":null,"x":1}\n\n',
    # Texts that break out of their string, or span lines: never part of a run.
    crafted(b'a","refusal":"no'),
    crafted(b'a","finish_reason":"length'),
    crafted(b'a"},"x":{"content":"b'),
    crafted(b"tok \\"),
    crafted(b"a\nb"),
    crafted(b"a\n\nb"),
    crafted(b'a\\"'),
    # Texts the per-event path parses in full (they match its "anything unusual" test).
    crafted(b"error"),
    crafted(b"tool_calls"),
    crafted(b"function_call"),
    crafted(b"usage"),
    crafted(b"\\x"),
    # Texts ending in an escaped quote and such a word: with the closing quote, a quoted word.
    crafted(b'a\\"error'),
    crafted(b'\\"usage'),
    crafted(b'\\ud83d\\"tool_calls'),
    # Prefix and suffix overlapping by their shared quote: an event with no text at all.
    content("tok ").replace(b'"content":"tok "', b'"content":"'),
    content("tok ", usage_null=False),
    content("tok ", created=2),
    content("tok ", service_tier="priority"),
    b'data: {"error":{"message":"boom"}}\n\n',
    b"event: x\ndata: " + content("multi")[6:],
    # Not JSON, which the client's SDK refuses: a raw control byte, escapes JSON has not.
    crafted(b"a\tb"),
    crafted(b"a\x00"),
    crafted(b"a\\qb"),
    crafted(b"\\u12"),
    crafted(b"\\\\\\x"),
    # OpenAI's own shape: "usage":null before a field of padding of its own length.
    obfuscated("x", "Ab3"),
)
ODD_EVENTS = st.sampled_from(ODD)
PADDING = st.text(alphabet="aB3Zy9", max_size=6) | st.sampled_from(["a-b", "a\\", "é", 'a"'])
EVENTS = st.lists(
    st.one_of(TEXTS.map(content), TEXTS.map(content), st.builds(obfuscated, TEXTS, PADDING), ODD_EVENTS),
    max_size=40,
)
PADDED_STREAMS = st.lists(st.builds(obfuscated, TEXTS, PADDING), max_size=30)


def relay(stream: bytes, cuts: list[int], *, runs: bool, wants_usage: bool, choices: int = 1) -> Any:
    """The stream cut into reads at ``cuts``, each read handed to the filter as the relay does."""
    obs = Observation()
    events = EventFilter(
        obs, dialect=DIALECTS["chat.completions"], choices=choices, client_wants_usage=wants_usage, runs=runs
    )
    out = b""
    edges = [0, *sorted(set(c % (len(stream) + 1) for c in cuts)), len(stream)]
    for start, end in itertools.pairwise(edges):
        passed = events.read(stream[start:end], limit=1 << 20)
        assert passed is not None
        out += passed
    assert not events.incomplete
    seen = (
        obs.content_of(0),
        obs.all_text(),
        obs.usage,
        obs.finish_reasons,
        obs.refused,
        obs.malformed,
        obs.error,
        obs.done,
        obs.chunks,
        obs.first_token_at is None,
        obs.service_tier,
    )
    return out, seen, events.run_events


@settings(max_examples=400, deadline=None)
@given(
    body=EVENTS,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
    wants_usage=st.booleans(),
    tail=st.booleans(),
)
def test_runs_give_what_one_event_at_a_time_gives(
    body: list[bytes], cuts: list[int], wants_usage: bool, tail: bool
) -> None:
    stream = b"".join([ROLE, *body, *([finish(), USAGE, DONE] if tail else [])])
    fast = relay(stream, cuts, runs=True, wants_usage=wants_usage)
    reference = relay(stream, cuts, runs=False, wants_usage=wants_usage)
    assert fast[:2] == reference[:2]
    assert reference[2] == 0


@pytest.mark.parametrize("odd", ODD)
@pytest.mark.parametrize("wants_usage", [False, True])
def test_an_odd_event_inside_a_run_is_read_as_itself(odd: bytes, wants_usage: bool) -> None:
    before = ROLE + content("a") + content("b")
    stream = before + odd + content("c") + content("d") + finish() + USAGE + DONE
    # In one read with its neighbours, and read alone (after the template was learned).
    for cuts in ([], [len(ROLE) + 5], [len(before), len(before) + len(odd)]):
        fast = relay(stream, cuts, runs=True, wants_usage=wants_usage)
        assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=wants_usage)[:2]


def test_a_plain_stream_goes_in_runs_and_strips_usage_null() -> None:
    texts = [f"tok{i} " for i in range(200)]
    stream = ROLE + b"".join(content(t) for t in texts) + finish() + USAGE + DONE
    out, seen, in_runs = relay(stream, [4096, 30_000], runs=True, wants_usage=False)
    assert seen[0] == "".join(texts)
    assert seen[2] is not None and seen[2].output_tokens == 5
    assert seen[3] == {0: "stop"}
    # Only the first content event (which makes the template) and those cut by a read go alone.
    assert in_runs >= 195
    assert b'"usage"' not in out  # null cut from every chunk, the usage-only chunk dropped
    assert out.count(b"\n\n") == 1 + 200 + 1
    assert out == relay(stream, [4096, 30_000], runs=False, wants_usage=False)[0]


def test_a_client_that_asked_for_usage_gets_every_byte() -> None:
    stream = ROLE + b"".join(content(f"t{i}") for i in range(50)) + finish() + USAGE + DONE
    out, _, in_runs = relay(stream, [], runs=True, wants_usage=True)
    assert in_runs == 49
    assert out == stream[: -len(DONE)]


def test_escaped_quotes_line_breaks_and_backslashes_stay_in_runs() -> None:
    """Common in real answers (code, JSON): each is escaped in its string, so its event is
    still a template event, whether read with others or alone."""
    texts = ["a", 'say "hi"', "line\nbreak", "d\\", '\\"', "e"] * 5
    stream = ROLE + b"".join(content(t) for t in texts) + finish() + DONE
    first = len(ROLE) + len(content(texts[0]))
    one_by_one = list(itertools.accumulate(len(content(t)) for t in texts))
    for cuts in ([], [first], [len(ROLE) + n for n in one_by_one]):
        fast = relay(stream, cuts, runs=True, wants_usage=False)
        assert fast[1][0] == "".join(texts)
        assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=False)[:2]
        assert fast[2] == len(texts) - 1  # all but the first, which makes the template


def test_a_run_ends_at_an_odd_event_and_goes_on_after_it() -> None:
    texts = [f"t{i}" for i in range(30)]
    odd = crafted(b'a","refusal":"no')
    stream = ROLE + b"".join(content(t) for t in texts[:15]) + odd
    stream += b"".join(content(t) for t in texts[15:]) + finish() + USAGE + DONE
    fast = relay(stream, [], runs=True, wants_usage=False)
    assert fast[:2] == relay(stream, [], runs=False, wants_usage=False)[:2]
    assert fast[2] == 29  # the events on both sides of the odd one, in one read


def test_a_template_that_is_not_compact_leaves_parsed_texts_alone() -> None:
    """With spaces in the JSON the per-event path re-serialises what it parses in full: a run
    must not pass such an event on as it came."""

    def spaced(text: bytes) -> bytes:
        return b'data: {"id": "c", "choices":[{"index":0,"delta":{"content":"' + text + b'"}}]}\n\n'

    for word in (b"usage", b"error", b"tool_calls", b"function_call"):
        stream = ROLE + spaced(b"a") + spaced(b"b") + spaced(word) + spaced(b"c") + finish() + DONE
        for cuts in ([], [len(ROLE) + len(spaced(b"a")) * 2]):
            for wants_usage in (False, True):
                fast = relay(stream, cuts, runs=True, wants_usage=wants_usage)
                assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=wants_usage)[:2]


def test_no_template_from_an_event_that_says_more_than_its_text() -> None:
    def legacy(text: bytes) -> bytes:
        return b'data: {"choices":[{"index":0,"text":"X","delta":{"content":"' + text + b'"}}]}\n\n'

    stream = ROLE + legacy(b"a") + legacy(b"b") + legacy(b"c") + finish() + DONE
    fast = relay(stream, [], runs=True, wants_usage=False)
    assert fast[2] == 0  # a "text" beside the delta: no template
    assert fast[:2] == relay(stream, [], runs=False, wants_usage=False)[:2]


def test_a_content_of_parts_is_never_read_as_a_template_event() -> None:
    """Mistral's contents of parts (Magistral's thinking, then text parts) among string ones: no
    template learnt from the string ones fits them, and each is read as the per-event path
    reads it, its text parts as the answer, its thinking beside it."""

    def parts(*texts: str, thought: str = "") -> bytes:
        listed: list[Any] = [{"type": "text", "text": t} for t in texts]
        if thought:
            listed.insert(0, {"type": "thinking", "thinking": [{"type": "text", "text": thought}]})
        return event({**BASE, "choices": [{"index": 0, "delta": {"content": listed}, "finish_reason": None}]})

    events = [content("a"), content("b"), parts("c", thought="hm"), content("d"), parts("e", "f")]
    events.append(content("g"))
    stream = ROLE + b"".join(events) + finish() + USAGE + DONE
    each = list(itertools.accumulate(len(e) for e in [ROLE, *events]))
    for cuts in ([], each):
        fast = relay(stream, cuts, runs=True, wants_usage=False)
        assert (fast[1][0], fast[1][1]) == ("abcdefg", "abcdefghm")
        assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=False)[:2]
        assert fast[2] == 3  # b, d and g: a made the template


def test_no_runs_with_several_choices() -> None:
    stream = ROLE + b"".join(content(f"t{i}") for i in range(20)) + DONE
    assert relay(stream, [], runs=True, wants_usage=False, choices=2)[2] == 0


def test_a_text_that_makes_a_quoted_word_with_its_closing_quote_is_read_alone() -> None:
    """``\\"error`` then the string's closing quote reads "error": the per-event path parses
    such an event in full (here with a lone surrogate, which it reads as the SDK's json does),
    so runs must not take it."""
    odd = crafted(b'\\ud83d\\"error')
    stream = ROLE + content("a") + odd + content("b") + finish() + USAGE + DONE
    alone = len(ROLE) + len(content("a"))
    for cuts in ([], [alone, alone + len(odd)]):
        fast = relay(stream, cuts, runs=True, wants_usage=False)
        assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=False)[:2]
        assert fast[1][5] is False  # not malformed: Python's json takes a lone surrogate


def test_an_event_without_a_usage_field_passes_as_it_came() -> None:
    """The bytes "usage" inside a text (no usage field, no "usage":null tail): nothing to strip,
    so the event is not re-serialised (which would rewrite its escapes)."""
    odd = content("tok ", usage_null=False).replace(b'"content":"tok "', b'"content":"\\u00e9\\"usage"')
    stream = ROLE + content("a", usage_null=False) + odd + finish() + USAGE + DONE
    for runs in (True, False):
        out = relay(stream, [], runs=runs, wants_usage=False)[0]
        assert odd in out


def test_many_events_in_one_read_are_not_one_large_event() -> None:
    """The limit bounds one event: a read of many small ones (a fast upstream, a slow client)
    is not refused, one event past it is, however it comes."""
    events = b"".join(content(f"word{i} ") for i in range(40))
    assert len(content("word1 ")) < 4096 < len(events)
    for runs in (True, False):
        obs = Observation()
        filt = EventFilter(
            obs, dialect=DIALECTS["chat.completions"], choices=1, client_wants_usage=False, runs=runs
        )
        for piece in (ROLE + events[:1000], events[1000:] + finish()[:20], finish()[20:] + USAGE + DONE):
            assert filt.read(piece, limit=4096) is not None
        assert obs.content_of(0) == "".join(f"word{i} " for i in range(40)) and obs.done
    large = content("x" * 5000)
    for pieces in ([large], [large[:3000], large[3000:]], [content("a") + large[:4000], large[4000:]]):
        filt = EventFilter(
            Observation(), dialect=DIALECTS["chat.completions"], choices=1, client_wants_usage=False
        )
        assert [filt.read(piece, limit=4096) for piece in pieces][-1] is None


@pytest.mark.parametrize("runs", [True, False])
def test_usage_null_before_another_field_is_cut_from_the_bytes(runs: bool) -> None:
    """OpenAI's chunks end in "obfuscation" (padding of a random length), after "usage":null:
    the client that did not ask for usage gets every other byte as it came, the text's escapes
    and a lone surrogate (half an emoji, which orjson cannot write again) included."""
    events = [obfuscated("a", "x1"), obfuscated("b", "yy2"), obfuscated("c", "x1"), obfuscated("c", "x1")]
    odd = obfuscated("x", "p").replace(b'"content":"x"', b'"content":"\\ud83d\\u00e9"')
    stream = ROLE + b"".join(events) + odd + finish() + USAGE + DONE
    for cuts in ([], [len(ROLE) + len(events[0]) + 3]):
        out, seen, _ = relay(stream, cuts, runs=runs, wants_usage=False)
        assert b'"usage"' not in out
        expected = ROLE + b"".join(events) + odd + finish()
        assert out == expected.replace(b',"usage":null', b"")
        assert seen[0] == "abcc\ud83d\u00e9"
        assert seen[5] is False  # not malformed
        assert relay(stream, cuts, runs=runs, wants_usage=True)[0] == stream[: -len(DONE)]


@pytest.mark.parametrize("text", [b"a\tb", b"a\x01", b"a\\qb", b"\\u12", b"\\u12zz", b"\\\\\\"], ids=repr)
def test_a_text_that_is_not_json_is_a_malformed_answer(text: bytes) -> None:
    """The client's SDK cannot read such a chunk: never an answer billed as good, alone, in a run
    after the template was learned, or before any template."""
    bad = crafted(text)
    stream = ROLE + content("a") + content("b") + bad + content("c") + finish() + USAGE + DONE
    alone = len(ROLE) + len(content("a")) * 2
    for runs in (True, False):
        for cuts in ([], [alone, alone + len(bad)], [len(ROLE) + 3]):
            assert relay(stream, cuts, runs=runs, wants_usage=False)[1][5] is True
    assert relay(ROLE + bad + finish() + DONE, [], runs=True, wants_usage=False)[1][5] is True
    broken = content("x").replace(b"}]", b"}]}}")  # extra closing braces: not JSON
    assert relay(ROLE + broken + finish() + DONE, [], runs=True, wants_usage=False)[1][5] is True


@settings(max_examples=300, deadline=None)
@given(
    body=PADDED_STREAMS,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
    wants_usage=st.booleans(),
)
def test_padded_events_give_what_one_event_at_a_time_gives(
    body: list[bytes], cuts: list[int], wants_usage: bool
) -> None:
    """OpenAI's chunks, each padded to its own length: after the first, each is read as a
    template event (no parse), and the client and the observation see what the full parse of
    every event gives."""
    stream = b"".join([ROLE, *body, finish(), USAGE, DONE])
    fast = relay(stream, cuts, runs=True, wants_usage=wants_usage)
    assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=wants_usage)[:2]


def test_a_padded_stream_is_read_without_parsing_each_event() -> None:
    texts = [f"tok{i} " for i in range(50)]
    pads = ["x", "Ab3", "q9Z0pLm", "", "kJ"]
    stream = (
        ROLE + b"".join(obfuscated(t, pads[i % 5]) for i, t in enumerate(texts)) + finish() + USAGE + DONE
    )
    for cuts in ([], [len(ROLE) + 500, 4000]):
        out, seen, templated = relay(stream, cuts, runs=True, wants_usage=False)
        assert seen[0] == "".join(texts) and templated == 49  # all but the one that made the template
        assert b'"usage"' not in out and out.count(b'"obfuscation":"') == 50
        assert (out, seen) == relay(stream, cuts, runs=False, wants_usage=False)[:2]


@pytest.mark.parametrize("wants_usage", [False, True])
@pytest.mark.parametrize("one_event_a_read", [False, True])
def test_a_padding_never_closed_is_not_read_as_a_padded_event(
    wants_usage: bool, one_event_a_read: bool
) -> None:
    """'"obfuscation":"}': the field's opening quote is not its closing one (a review)."""
    bad = obfuscated("b", "").replace(b'"obfuscation":""}', b'"obfuscation":"}')
    first = ROLE + obfuscated("a", "Xy")
    stream = first + bad + finish() + USAGE + DONE
    cuts = [len(first), len(first) + len(bad)] if one_event_a_read else []
    fast = relay(stream, cuts, runs=True, wants_usage=wants_usage)
    assert fast[1][5] is True  # malformed, as parsed
    assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=wants_usage)[:2]


@pytest.mark.parametrize("one_event_a_read", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_a_template_text_that_is_not_utf8_is_a_malformed_answer(one_event_a_read: bool, padded: bool) -> None:
    learn = obfuscated("a", "Xy") if padded else content("a")
    bad = (obfuscated("b", "Q") if padded else content("b")).replace(b'"content":"b"', b'"content":"b\xff"')
    first = ROLE + learn
    stream = first + bad + finish() + USAGE + DONE
    cuts = [len(first), len(first) + len(bad)] if one_event_a_read else []
    fast = relay(stream, cuts, runs=True, wants_usage=False)
    assert fast[1][5] is True
    assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=False)[:2]


def test_an_emoji_split_over_two_events_reads_the_same_either_way() -> None:
    stream = ROLE + content("a") + crafted(b"\\ud83d") + crafted(b"\\ude80") + finish() + USAGE + DONE
    fast = relay(stream, [], runs=True, wants_usage=False)
    assert fast[1][0] == relay(stream, [], runs=False, wants_usage=False)[1][0] == "a\U0001f680"


def test_a_usage_key_spelled_with_an_escape_is_not_taken_for_a_nested_one() -> None:
    event = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a","usage":null,"x":1},'
        b'"finish_reason":null}],"us\\u0061ge":null}\n\n'
    )
    out = relay(ROLE + event + DONE, [], runs=False, wants_usage=False)[0]
    assert b'"delta":{"content":"a","usage":null,"x":1}' in out  # written again without the top one
    assert b"u0061ge" not in out


@pytest.mark.parametrize("one_event_a_read", [False, True])
def test_a_usage_key_spelled_with_an_escape_is_stripped_on_every_path(one_event_a_read: bool) -> None:
    def escaped(text: str) -> bytes:
        return content(text).replace(b'"usage":null', b'"us\\u0061ge":null')

    events = [ROLE, *(escaped(t) for t in "abcd"), finish(), USAGE, DONE]
    stream = b"".join(events)
    cuts = list(itertools.accumulate(len(e) for e in events)) if one_event_a_read else []
    fast = relay(stream, cuts, runs=True, wants_usage=False)
    assert b"u0061ge" not in fast[0]
    assert fast[:2] == relay(stream, cuts, runs=False, wants_usage=False)[:2]


def test_a_chunk_with_two_usage_keys_reaches_the_client_without_either() -> None:
    """The parser keeps the last (null): cutting that one out of the bytes left the first."""
    doubled = content("a").replace(b'{"id"', b'{"usage":{"prompt_tokens":1,"completion_tokens":1},"id"', 1)
    for runs in (True, False):
        out, seen, _ = relay(ROLE + doubled + finish() + DONE, [], runs=runs, wants_usage=False)
        assert b'"usage"' not in out and seen[0] == "a"


@pytest.mark.parametrize("choices", ["missing", "null"])
def test_a_usage_only_chunk_without_a_choices_list_is_dropped_for_a_client_that_did_not_ask(
    choices: str,
) -> None:
    """A usage chunk whose choices are absent or null, not [] (an upstream's own shape): the
    client did not ask for usage and gets no chunk for it (its SDK would hand it a chunk without
    choices, which code reading chunk.choices[0] does not expect), and the usage is read."""
    usage_only: dict[str, Any] = {**BASE, "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    if choices == "null":
        usage_only["choices"] = None
    stream = ROLE + content("hi") + finish() + event(usage_only, usage_null=False) + DONE
    for runs in (True, False):
        out, seen, _ = relay(stream, [], runs=runs, wants_usage=False)
        assert b"prompt_tokens" not in out and out.count(b"data: ") == 3, out
        assert seen[2] is not None and seen[2].output_tokens == 5


@pytest.mark.parametrize("one_event_a_read", [False, True])
@pytest.mark.parametrize("runs", [True, False])
def test_a_text_or_logprob_token_that_is_the_word_usage_keeps_its_bytes(
    runs: bool, one_event_a_read: bool
) -> None:
    """A content piece or a logprobs token that is the word "usage" is a string, not a key: the
    client that did not ask for usage gets that chunk as every other one, byte for byte (written
    again, its numbers and escapes came out in orjson's spelling: -1e-05 as -0.00001)."""

    def piece(text: str) -> bytes:
        token = {"token": text, "logprob": -1e-05, "bytes": list(text.encode()), "top_logprobs": []}
        logprobs = {"content": [token], "refusal": None}
        choice = {"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        # As Python's json writes it: non-ASCII escaped, floats in repr.
        chunk = json.dumps({**BASE, "choices": [choice], "usage": None}, separators=(",", ":"))
        return b"data: " + chunk.encode() + b"\n\n"

    events = [ROLE, piece("usage"), piece("caf\u00e9"), piece("usage"), finish()]
    stream = b"".join([*events, USAGE, DONE])
    cuts = list(itertools.accumulate(len(e) for e in events)) if one_event_a_read else []
    out, seen, _ = relay(stream, cuts, runs=runs, wants_usage=False)
    assert out == b"".join(events).replace(b',"usage":null}', b"}")
    assert seen[0] == "usagecaf\u00e9usage"


def test_a_legacy_completion_s_top_logprob_token_usage_keeps_the_chunk_s_bytes() -> None:
    """A legacy completion's ``top_logprobs`` names each token as a key: a token that is the word
    "usage" is a nested key, not the top-level field. The chunk went out written again (its
    numbers in orjson's spelling: -1e-05 as -0.00001) for a client that did not ask for usage."""
    logprobs = {
        "tokens": ["usage"],
        "token_logprobs": [-1e-05],
        "top_logprobs": [{"usage": -1e-05, " use": -12.5}],
        "text_offset": [0],
    }
    choice = {"text": "usage", "index": 0, "logprobs": logprobs, "finish_reason": None}
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    chunk = json.dumps({**base, "choices": [choice], "usage": None}, separators=(",", ":")).encode()
    end = {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}]}
    last = json.dumps({**end, "usage": None}, separators=(",", ":")).encode()
    stream = b"data: " + chunk + b"\n\ndata: " + last + b"\n\n" + DONE
    obs = Observation()
    events = EventFilter(obs, dialect=DIALECTS["completions"], choices=1, client_wants_usage=False)
    out = events.read(stream, limit=1 << 20)
    expected = chunk.replace(b',"usage":null}', b"}")
    assert out is not None and out.startswith(b"data: " + expected + b"\n\n"), out
    assert obs.content_of(0) == "usage"


@pytest.mark.parametrize("one_event_a_read", [False, True])
def test_template_events_name_their_service_tier_again(one_event_a_read: bool) -> None:
    """The tier an answer names prices it (the last one named). An event that differs from the
    template only in its tier is read alone and names its own; the template events after it
    name the template's again, which the per-event path reads and the template path took no
    notice of: the call was priced at the odd event's tier (the stream events hunt)."""
    events = [
        ROLE,
        content("a", service_tier="default"),  # makes the template
        content("b", service_tier="priority"),  # not the template: read alone
        content("c", service_tier="default"),
        content("d", service_tier="default"),
    ]
    stream = b"".join(events)
    cuts = list(itertools.accumulate(map(len, events)))[:-1] if one_event_a_read else []
    obs = {runs: Observation() for runs in (True, False)}
    for runs, seen in obs.items():
        filt = EventFilter(
            seen, dialect=DIALECTS["chat.completions"], choices=1, client_wants_usage=False, runs=runs
        )
        for start, end in itertools.pairwise([0, *cuts, len(stream)]):
            assert filt.read(stream[start:end], limit=1 << 20) is not None
        assert filt.run_events == (2 if runs else 0)
    assert obs[True].service_tier == obs[False].service_tier == "default"
    assert obs[True].content_of(0) == "abcd"


# A chunk whose data starts with a byte order mark, and one whose text holds a surrogate encoded
# raw (b"\xed\xa0\xbd": not UTF-8). Python's json.loads(bytes) takes both (it drops the mark,
# decodes with surrogatepass); the client's SDK decodes each line of a stream as strict UTF-8,
# then json.loads(str), and takes neither.
UNREADABLE = {
    "mark-in-data": content(" world").replace(b"data: ", b"data: \xef\xbb\xbf", 1),
    "raw-surrogate": content(" wXrld").replace(b"wXrld", b"w\xed\xa0\xbdrld"),
}


def sdk_reads(body: bytes) -> None:
    for sse in SSEDecoder().iter_bytes(iter([body])):
        if sse.data.startswith("[DONE]"):
            return
        sse.json()


@pytest.mark.parametrize("runs", [True, False])
@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_a_chunk_the_sdk_cannot_read_is_a_malformed_answer(kind: str, runs: bool) -> None:
    """Read as the SDK reads it: one it cannot read makes the answer an ``upstream_error``; these
    two were read as Python's json reads bytes, and billed as a good answer (the stream events
    hunt). After the template too, read alone or with others."""
    stream = ROLE + content("Hello") + content("there") + UNREADABLE[kind] + finish() + USAGE + DONE
    with pytest.raises(ValueError):  # JSONDecodeError, UnicodeDecodeError
        sdk_reads(stream)
    alone = len(ROLE) + len(content("Hello")) + len(content("there"))
    for cuts in ([], [alone, alone + len(UNREADABLE[kind])]):
        for wants_usage in (False, True):
            seen = relay(stream, cuts, runs=runs, wants_usage=wants_usage)[1]
            assert seen[5] is True, (cuts, wants_usage)  # malformed


@pytest.mark.parametrize("value", [float("-inf"), float("nan"), 1e999], ids=["-Infinity", "NaN", "1e999"])
def test_a_chunk_written_again_without_its_usage_keeps_its_values(value: float) -> None:
    """A finish chunk that carries the usage (the client did not ask for it) is written again
    without it. Python's json, the SDK's, reads -Infinity, NaN (a Python server writes them for
    a logprob of -inf) and a number past a float's range; orjson wrote them as null, and the
    client's SDK got a logprob of None (the stream events hunt)."""
    logprobs = {"content": [{"token": "Hi", "logprob": value, "bytes": [72, 105], "top_logprobs": []}]}
    choice = {"index": 0, "delta": {"content": "Hi"}, "logprobs": logprobs, "finish_reason": "stop"}
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    data = json.dumps({**BASE, "choices": [choice], "usage": usage}, separators=(",", ":")).encode()
    if value == 1e999:
        data = data.replace(b"Infinity", b"1e999")
    stream = b"data: " + data + b"\n\n" + DONE
    for runs in (True, False):
        out, seen, _ = relay(stream, [], runs=runs, wants_usage=False)
        assert b"prompt_tokens" not in out and seen[2] is not None and seen[0] == "Hi"
        (sse,) = list(SSEDecoder().iter_bytes(iter([out])))
        sent = sse.json()["choices"][0]["logprobs"]["content"][0]["logprob"]
        assert isinstance(sent, float) and repr(sent) == repr(float(value)), out


def _anthropic_delta(text: str) -> bytes:
    obj = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
    return b"event: content_block_delta\ndata: " + orjson.dumps(obj) + b"\n\n"


@pytest.mark.parametrize(
    ("endpoint", "make_event"),
    [("chat.completions", content), ("messages", _anthropic_delta)],
    ids=["chat-template-path", "anthropic-per-event-path"],
)
def test_a_streams_observed_text_is_held_near_its_size(
    endpoint: str, make_event: Callable[[str], bytes]
) -> None:
    """Providers stream a token or so an event, each a read of its own when they come spaced out
    (``EventFilter._single``). The observation kept one Python object a piece (a bytes slice on
    the template path, a str on the per-event path): 37 to 53 bytes of header and a list slot for
    ~4 characters, 11.5x the text (chat) and 15.5x (Anthropic) for the stream's whole life. Its
    pieces are joined every ``LOOSE_PIECES``: about 1.2x."""
    events = [make_event(f"w{i % 1000:03d}") for i in range(50_000)]  # 4 characters each

    def observe() -> Observation:
        obs = Observation()
        relay = EventFilter(obs, dialect=DIALECTS[endpoint], choices=1, client_wants_usage=False)
        for one in events:  # one read an event, as when the provider's chunks come spaced out
            assert relay.read(one, limit=1 << 26) is not None
        return obs

    obs, held = held_after(observe)
    text = obs.all_text()
    assert text == "".join(f"w{i % 1000:03d}" for i in range(50_000))
    assert held < 2 * len(text), f"{held} bytes held for {len(text)} bytes of text ({held / len(text):.1f}x)"
