"""Tests that kill mutants of the stream-reading code (events.py, chunks.py, body_reader.py,
observe.py) which the rest of the suite let live: each pins what the client receives from a
stream, what the answer is read as (its usage, finish reasons, text) or what is billed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from proxy.body_reader import BodyReader
from proxy.chunks import event_over
from proxy.dialects import DIALECTS
from proxy.events import EventFilter
from proxy.observe import Observation, string_end
from tests.conftest import ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, send
from tests.test_body_reader import events as body_events
from tests.test_body_reader import serve
from tests.test_events import BASE, ROLE, USAGE, content, crafted, finish
from tests.test_stream_dialects import proxy_for

LIMIT = 1 << 20


def chat_filter(*, wants_usage: bool = False) -> tuple[Observation, EventFilter]:
    obs = Observation()
    return obs, EventFilter(
        obs, dialect=DIALECTS["chat.completions"], choices=1, client_wants_usage=wants_usage
    )


def read_all(events: EventFilter, *reads: bytes, limit: int = LIMIT) -> bytes:
    out = b""
    for piece in reads:
        passed = events.read(piece, limit=limit)
        assert passed is not None
        out += passed
    return out


def client_chunks(out: bytes) -> list[object]:
    """What the client's SDK reads from the bytes: each data event's JSON."""
    return [
        orjson.loads(line[len(b"data: ") :])
        for line in out.split(b"\n")
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


# -- events.py: framing ------------------------------------------------------------------------


def test_a_read_mixing_crlf_and_lf_line_ends_is_read_as_its_events() -> None:
    # The one-step path (a read ending in a blank line) is only for reads without a CR: taken
    # there, "\r\n\r\n" is no event boundary and two chunks read as one malformed event.
    obs, events = chat_filter(wants_usage=True)
    first, second = content("a", usage_null=False), content("b", usage_null=False)
    out = read_all(events, first.replace(b"\n", b"\r\n") + second)
    assert out == first + second
    assert (obs.malformed, obs.content_of(0), obs.chunks) == (False, "ab", 2)


def test_a_stray_line_break_after_the_last_event_does_not_leave_the_stream_inside_an_event() -> None:
    # ``incomplete`` makes a stream that ended after every choice finished (no [DONE], as
    # Perplexity sends it) an upstream_error: a lone "\n" in the body's last read is no event.
    obs, events = chat_filter()
    read_all(events, ROLE + content("a") + finish(), b"\n")
    assert not events.incomplete
    assert obs.finish_reasons == {0: "stop"}
    read_all(events, b"data: {")
    assert events.incomplete


@pytest.mark.parametrize(
    ("last", "relayed", "done"),
    [
        (USAGE[:-1], USAGE, False),
        (USAGE[:-2], USAGE, False),
        (b"data: [DONE]\n", b"", True),
        (b"data: [DONE]", b"", True),
        (b"data: [DONE]\r", b"", True),
    ],
    ids=["usage-one-lf", "usage-no-lf", "done-one-lf", "done-no-lf", "done-cr"],
)
def test_an_event_whose_data_is_whole_is_read_at_the_bodys_end_without_its_blank_line(
    last: bytes, relayed: bytes, done: bool
) -> None:
    """The body's last event came without its blank line: its bytes stayed held, the stream
    ``incomplete`` (an event cut short), its usage or [DONE] never read."""
    obs, events = chat_filter(wants_usage=True)
    read_all(events, ROLE + content("a") + finish(), last)
    assert events.incomplete
    assert events.end() == relayed
    assert (events.incomplete, obs.done, obs.usage is not None) == (False, done, not done)


@pytest.mark.parametrize("last", [b'data: {"id":"c","choi', b"data: [DON", b"event: ping", b"data: \xff"])
def test_an_event_cut_inside_its_data_stays_incomplete_at_the_bodys_end(last: bytes) -> None:
    """The counterpart: data cut short (or none at all) is no event to read at the end."""
    obs, events = chat_filter(wants_usage=True)
    read_all(events, ROLE + content("a") + finish(), last)
    assert events.end() == b""
    assert events.incomplete and not obs.done and not obs.malformed


async def test_a_stream_without_done_whose_last_read_is_a_line_break_is_a_whole_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """End to end, as Perplexity ends a stream (no [DONE]), with one line break more in a read
    of its own: billed ok on the provider's usage, not an upstream_error at its reserve."""
    proxy = await proxy_for(make_proxy, script)
    answer = ROLE + content("Hello") + finish() + USAGE
    script.plan = Plan(content_type="text/event-stream", chunks=[answer, b"\n"], delay_s=0.2)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "5"), entry
    assert b"error" not in reply.body


def test_blank_lines_too_many_reach_the_client_as_they_came() -> None:
    obs, events = chat_filter(wants_usage=True)
    stream = ROLE + b"\n\n" + content("a") + content("b") + b"\n" + finish() + USAGE
    assert read_all(events, stream) == stream
    assert obs.content_of(0) == "ab"


def test_a_comment_keep_alive_reaches_the_client() -> None:
    # A client's read timeout is kept from firing by the upstream's keep-alives.
    _, events = chat_filter()
    assert read_all(events, b": keep-alive\n\n", b": ping\n\n") == b": keep-alive\n\n: ping\n\n"


def test_a_template_event_longer_than_the_limit_is_refused_when_read_alone() -> None:
    # The template's one-event path must bound an event as the other paths do.
    _, events = chat_filter()
    read_all(events, ROLE + content("a"))
    long = content("x" * 200)
    assert events.read(long, limit=len(long) - 5) is None
    _, events = chat_filter()
    read_all(events, ROLE + content("a"))
    assert events.read(long, limit=len(long) - 2) == long.replace(b',"usage":null', b"")


# -- events.py: the template fast path ---------------------------------------------------------


def test_an_event_sharing_the_template_s_prefix_but_not_its_end_is_read_in_full() -> None:
    # Same start, a shorter end (no usage field, a finish reason): cut at the template's suffix
    # length its text was taken short and its finish reason was never seen.
    obs, events = chat_filter()
    read_all(events, ROLE + content("a"), content("b"))
    text = "x" * 80
    odd = content(text, usage_null=False).replace(b'"finish_reason":null', b'"finish_reason":"stop"')
    odd = odd.replace(b',"logprobs":null', b"")
    read_all(events, odd)
    assert obs.finish_reasons == {0: "stop"}
    assert obs.content_of(0) == "ab" + text


def test_no_template_from_a_chunk_whose_finish_reason_is_spelled_with_an_escape() -> None:
    # The escape hides it from the plain-content test, not from the parse: a template holding
    # it would pass later such chunks on unread, keeping a finish reason told in between.
    obs, events = chat_filter()

    def told(text: str) -> bytes:
        return content(text).replace(b'"finish_reason":null', b'"finish\\u005freason":"stop"')

    read_all(events, ROLE, told("a"))
    assert obs.finish_reasons == {0: "stop"}
    read_all(events, finish("length"), told("b"))
    assert obs.finish_reasons == {0: "stop"}
    assert obs.content_of(0) == "ab"


def test_a_usage_null_before_the_choices_is_cut_from_every_chunk_the_client_gets() -> None:
    # Cutting it shifts the bytes before the text: no template then, whose client version
    # would be the template's suffix cut at the wrong place (JSON the client cannot read).
    def early(text: str) -> bytes:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        return b"data: " + orjson.dumps({**BASE, "usage": None, "choices": [choice]}) + b"\n\n"

    texts = [f"t{i} " for i in range(6)]
    for reads in ([b"".join(map(early, texts))], [early(t) for t in texts]):
        obs, events = chat_filter()
        out = read_all(events, ROLE, *reads)
        chunks = client_chunks(out)
        assert len(chunks) == 7
        assert all(isinstance(c, dict) and "usage" not in c for c in chunks)
        assert obs.content_of(0) == "".join(texts)


def test_no_template_from_a_chunk_sent_on_several_data_lines() -> None:
    # Its bytes are not what later events' bytes are: a later event whose second line has no
    # "data:" (to the client, a chunk cut short) matched such a template and was read as text.
    obs, events = chat_filter()
    data = content("a")[len(b"data: ") : -2].replace(b',"logprobs"', b',\n"logprobs"')
    read_all(events, ROLE, b"data: " + data.replace(b"\n", b"\ndata: ") + b"\n\n")
    assert not obs.malformed
    read_all(events, b"data: " + data.replace(b'"a"', b'"b"') + b"\n\n")
    assert obs.malformed


# -- chunks.py: the bytes of an event ----------------------------------------------------------


def sse_data(out: bytes) -> list[bytes]:
    """Each event's data as an SSE client reads it: its data lines joined, one space cut."""
    found = []
    for block in out.split(b"\n\n"):
        lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            found.append(b"\n".join(lines))
    return found


def test_a_chunk_sent_on_several_data_lines_reaches_the_client_on_as_many() -> None:
    # Cut of its usage null in its bytes, its data keeps its line break: each line of it must
    # start a data line, or the client reads the rest as an unknown field (JSON cut short).
    obs, events = chat_filter()
    data = content("hi")[len(b"data: ") : -2].replace(b',"object"', b',\n"object"')
    out = read_all(events, b"data: " + data.replace(b"\n", b"\ndata: ") + b"\n\n")
    assert out.count(b"\ndata: ") == 1
    (got,) = sse_data(out)
    assert got == data.replace(b',"usage":null', b"")
    assert obs.content_of(0) == "hi"


def test_an_event_whose_data_lines_have_no_space_keeps_its_other_fields_only() -> None:
    # ``data:{...}`` (SSE's space is optional): replaced by the cut data, not kept as a field.
    obs, events = chat_filter()
    out = read_all(events, b"id: 3\n" + content("hi").replace(b"data: ", b"data:"))
    assert out.startswith(b"id: 3\ndata: ")
    (got,) = sse_data(out)
    assert b'"usage"' not in got and orjson.loads(got)["choices"][0]["delta"] == {"content": "hi"}
    assert obs.content_of(0) == "hi"


def test_event_over_measures_each_event_from_its_own_first_byte() -> None:
    assert not event_over(b"a" * 5 + b"\n\n" + b"b" * 5 + b"\n\n", 5)
    assert not event_over(b"a" * 5 + b"\n\n" + b"b" * 5, 5)
    assert event_over(b"a" * 5 + b"\n\n" + b"b" * 6, 5)


def test_a_template_text_with_a_raw_unit_separator_or_a_vertical_tab_escape_is_malformed() -> None:
    # Neither is JSON (a raw 0x1f; "\v" is no JSON escape): the client's SDK refuses the chunk,
    # so it is not taken as plain content by the template's paths either.
    for raw in (b"a\x1fb", b"a\\vb"):
        for reads in ([ROLE + content("a") + crafted(raw)], [ROLE + content("a"), crafted(raw)]):
            obs, events = chat_filter()
            read_all(events, *reads)
            assert obs.malformed, raw


def test_a_nested_usage_null_is_not_taken_for_the_top_level_one_spelled_with_spaces() -> None:
    # Two "usage" keys (the top-level one with a space before its colon): the byte cut is
    # checked against the parse, or the nested one went and the top-level null reached the client.
    obs, events = chat_filter()
    obj = {**BASE, "choices": [], "x": {"a": 1, "usage": None, "b": 2}}
    data = orjson.dumps(obj)[:-1] + b',"usage" : null}'
    out = read_all(events, b"data: " + data + b"\n\n")
    assert [orjson.loads(d) for d in sse_data(out)] == [obj]
    assert not obs.malformed


# -- observe.py: choices -----------------------------------------------------------------------


def test_an_empty_finish_reason_is_no_finish_reason() -> None:
    # Older Ollama and SGLang send "" on every chunk: taken for a reason, a stream cut before
    # its end (no [DONE]) read as a whole answer.
    obs = Observation()
    for piece in ("a", "b"):
        obs.observe(
            {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": ""}]}, streaming=True
        )
    assert obs.finish_reasons == {}
    obs.observe({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, streaming=True)
    assert obs.finish_reasons == {0: "length"}


def test_choices_without_an_index_keep_their_own_text_and_finish_reason() -> None:
    obs = Observation()
    choices = [
        {"delta": {"content": "one"}, "finish_reason": "stop"},
        {"delta": {"content": "two two"}, "finish_reason": "length"},
    ]
    obs.observe({"choices": choices}, streaming=True)
    assert obs.finish_reasons == {0: "stop", 1: "length"}
    assert obs.answers() == ["one", "two two"]


def test_reasoning_content_is_counted_and_the_same_text_as_reasoning_once() -> None:
    # DeepSeek, vLLM: reasoning_content alone; a server sending both (compatibility) repeats it.
    obs = Observation()
    obs.observe({"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]}, streaming=True)
    obs.observe(
        {"choices": [{"index": 0, "delta": {"reasoning_content": " more", "reasoning": " more"}}]},
        streaming=True,
    )
    obs.observe({"choices": [{"index": 0, "delta": {"reasoning": " then"}}]}, streaming=True)
    assert obs.all_text() == "think more then"


def test_a_chunk_with_any_error_value_but_null_is_a_failed_answer() -> None:
    # An error object without a message is still the provider's failure, never a whole answer.
    for error in ({}, {"message": "boom"}):
        obs = Observation()
        obs.observe({"choices": [], "error": error}, streaming=True)
        assert obs.error, error
    obs = Observation()
    obs.observe({"choices": [], "error": None}, streaming=True)
    assert not obs.error


def test_a_custom_tool_call_s_input_is_counted_text() -> None:
    # The call is the answer (billed on its text when no usage comes): its name and its input.
    obs = Observation()
    call = {"index": 0, "id": "c1", "type": "custom", "custom": {"name": "shell", "input": "ls -la /tmp"}}
    obs.observe({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}, streaming=True)
    assert obs.all_text() == "shellls -la /tmp"
    assert obs.calls == {0}


def test_string_end_counts_a_backslash_at_the_string_s_first_byte() -> None:
    for text in ('"quoted" first', "\\ first", "\\"):
        chunk = orjson.dumps({"delta": {"content": text}})
        start = chunk.find(b'"content":"') + len(b'"content":"')
        assert chunk[string_end(chunk, start) :] == b'"}}', text


def test_an_audio_id_sent_on_every_chunk_is_one_item() -> None:
    # Each chunk of a streamed audio answer repeats its id: kept once for a later turn to name.
    obs = Observation()
    for piece in ("Hel", "lo"):
        delta = {"audio": {"id": "audio_1", "transcript": piece}}
        obs.observe({"choices": [{"index": 0, "delta": delta}]}, streaming=True)
    assert obs.item_ids == ["audio_1"]
    assert obs.all_text() == "Hello"


def test_an_empty_service_tier_on_a_later_chunk_keeps_the_tier_that_served() -> None:
    # The served tier prices the call: one chunk's "" says nothing, the tier told stands.
    obs = Observation()
    obs.observe({**BASE, "service_tier": "flex", "choices": []}, streaming=True)
    obs.observe({**BASE, "service_tier": "", "choices": []}, streaming=True)
    assert obs.service_tier == "flex"


def test_the_role_chunk_s_empty_content_is_not_the_first_token() -> None:
    # The time to the first token (the ledger's ttft_ms) is the first text's, not the role's.
    obs = Observation()
    obs.observe({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, streaming=True)
    assert obs.first_token_at is None and obs.contents == {}
    obs.observe({"choices": [{"index": 0, "delta": {"content": "hi"}}]}, streaming=True)
    assert obs.first_token_at is not None


def test_a_legacy_function_call_is_the_answer_and_counted_text() -> None:
    obs = Observation()
    delta = {"function_call": {"name": "lookup", "arguments": '{"q": 1}'}}
    obs.observe({"choices": [{"index": 0, "delta": delta}]}, streaming=True)
    assert obs.calls == {0}
    assert obs.all_text() == 'lookup{"q": 1}'


# -- body_reader.py ----------------------------------------------------------------------------


async def test_a_read_after_one_from_a_partial_read_s_offset_loses_nothing(
    aiohttp_server: Callable[..., object],
) -> None:
    # The offset a partial read left applies to the first read only: kept, every later read
    # lost as many bytes from its front.
    first, second = body_events(3), body_events(6)[3:]
    more = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"".join(first))
        await more.wait()
        for chunk in second:
            await response.write(chunk)
        await response.write_eof()
        return response

    server = await serve(aiohttp_server, handler)
    async with aiohttp.ClientSession() as session, session.get(server.make_url("/")) as upstream:
        head = await upstream.content.read(7)
        reader = BodyReader(upstream.content)
        got = head + await reader.read()
        more.set()
        async with asyncio.timeout(5):
            while piece := await reader.read():
                got += piece
    assert got == b"".join(first + second)
