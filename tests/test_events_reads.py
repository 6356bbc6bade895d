"""Reads of an event stream, as the upstream's body is cut into them: the client's bytes and
the observation must not depend on where the cuts fall. Found by differential fuzzing (EventFilter
with and without runs, streams cut into reads at every byte)."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from proxy.dialects import DIALECTS
from proxy.events import EventFilter
from proxy.observe import Observation
from tests.conftest import ProxyFactory
from tests.memory import MB, alive_when_called
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, send
from tests.test_events import DONE, ROLE, USAGE, content, finish
from tests.test_stream_dialects import MESSAGE_START, ev, proxy_for

BOM = b"\xef\xbb\xbf"


def relay(endpoint: str, stream: bytes, cuts: list[int], *, runs: bool = True) -> tuple[bytes, Any]:
    obs = Observation()
    events = EventFilter(
        obs,
        dialect=DIALECTS[endpoint],  # type: ignore[index]
        choices=1,
        client_wants_usage=False,
        runs=runs,
    )
    out = b""
    for start, end in itertools.pairwise([0, *cuts, len(stream)]):
        passed = events.read(stream[start:end], limit=1 << 20)
        assert passed is not None
        out += passed
    usage = obs.usage and (obs.usage.input_tokens, obs.usage.output_tokens)
    return out, (obs.content_of(0), usage, obs.finish_reasons, obs.chunks, obs.done, events.incomplete)


LEGACY = (
    b"".join(
        b"data: " + orjson.dumps(obj) + b"\n\n"
        for obj in (
            {
                "id": "c",
                "object": "text_completion",
                "choices": [{"text": "Hello", "index": 0, "finish_reason": None}],
            },
            {
                "id": "c",
                "object": "text_completion",
                "choices": [{"text": " world", "index": 0, "finish_reason": None}],
            },
            {
                "id": "c",
                "object": "text_completion",
                "choices": [{"text": "", "index": 0, "finish_reason": "stop"}],
            },
        )
    )
    + DONE
)
MESSAGES = (
    MESSAGE_START
    + ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello"}})
    + ev("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}})
    + ev("message_stop", {})
)


@pytest.mark.parametrize("runs", [True, False])
@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("chat.completions", ROLE + content("Hi") + finish() + USAGE + DONE),
        ("completions", LEGACY),
        ("messages", MESSAGES),
    ],
    ids=["chat", "completions", "messages"],
)
@pytest.mark.parametrize("cut", [1, 2])
def test_a_byte_order_mark_cut_by_a_read_is_still_a_byte_order_mark(
    endpoint: str, body: bytes, cut: int, runs: bool
) -> None:
    """A BOM before the first field is dropped when it comes whole in the first read; cut by the
    read (its first byte or two alone), it stayed in front of the first event and reached the
    client; where that event's first line is its data (chat, completions) the line read as an
    unknown field: the event passed on unobserved (a completion's first text lost to billing,
    its "usage":null not cut)."""
    stream = BOM + body
    whole = relay(endpoint, stream, [], runs=runs)
    assert whole[0] == body.replace(b',"usage":null', b"").replace(USAGE, b"").replace(DONE, b"")
    assert relay(endpoint, stream, [cut], runs=runs) == whole


@pytest.mark.parametrize("runs", [True, False])
def test_an_extra_blank_line_is_passed_on_the_same_however_the_reads_fall(runs: bool) -> None:
    """An upstream's blank line too many (``\\n\\n\\n``) reached the client as it came when the
    next event came in the same read, but as three line breaks more (two blank lines added)
    when the read ended right after it: the client's bytes depended on the reads."""
    stream = ROLE + b"\n" + content("a") + content("b") + finish() + DONE
    whole = relay("chat.completions", stream, [], runs=runs)
    assert relay("chat.completions", stream, [len(ROLE) + 1], runs=runs) == whole


async def test_a_chat_stream_whose_bom_comes_in_a_read_of_its_own_is_billed_on_its_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """End to end: a server that sends its answer in one chunk (text, finish reason and usage)
    behind a BOM the first read cut: the chunk went unobserved and reached the client with the
    BOM in front (the SDK reads "\\ufeffdata" as an unknown field: no chunk) and with the usage it
    did not ask for, and the call was billed 0 output tokens for an answer of 120."""
    proxy = await proxy_for(make_proxy, script)
    answer = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "word " * 120}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 120, "total_tokens": 129},
    }
    first = b"data: " + orjson.dumps(answer) + b"\n\n"
    script.plan = Plan(
        content_type="text/event-stream", chunks=[BOM[:1], BOM[1:] + first + DONE], delay_s=0.2
    )
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 500,
    }
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert reply.body.startswith(b"data: {") and b"prompt_tokens" not in reply.body.split(b": billing")[0]
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "120"), (
        entry
    )


def _read_in_pieces(endpoint: str, reads: list[bytes], *, pieces: int = 1 << 16) -> tuple[bytes, Observation]:
    """The client's bytes and the observation of ``reads``, each cut as a provider's server
    writes a large body: in pieces, each a read."""
    obs = Observation()
    events = EventFilter(obs, dialect=DIALECTS[endpoint], choices=1, client_wants_usage=False)  # type: ignore[index]
    out = []
    for one in reads:
        for at in range(0, len(one), pieces):
            got = events.read(one[at : at + pieces], limit=1 << 26)
            assert got is not None
            out.append(got)
    return b"".join(out), obs


def test_a_responses_streams_last_event_is_parsed_holding_its_text_and_itself_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Responses stream ends in ``response.completed``, whose response repeats the whole
    answer: an event as large as the text, over many reads. When it was parsed, the text (once,
    observed) was alive beside the held bytes, their slice and its copy, the event cut out of
    it, its data line and that line's value: 6N. Now the text and the event's bytes: 2N."""
    import proxy.events as events_module

    n = 4 * MB
    piece = "x" * 4096
    delta = {"output_index": 0, "item_id": "msg_1", "delta": piece}
    message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed"}
    text = {"type": "output_text", "text": piece * (n // len(piece)), "annotations": []}
    done = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [{**message, "content": [text]}],
    }
    done["usage"] = {"input_tokens": 5, "output_tokens": n // 4}
    reads = [ev("response.created", {"response": {**done, "status": "in_progress", "output": []}})]
    reads += [ev("response.output_text.delta", delta)] * (n // len(piece))
    reads.append(ev("response.completed", {"response": done}))
    (out, obs), alive = alive_when_called(
        monkeypatch, events_module, "parse_event_data", lambda: _read_in_pieces("responses", reads)
    )
    assert out == b"".join(reads) and obs.done and obs.usage is not None
    assert len(obs.all_text()) == n
    assert alive < 2.5 * n, (
        f"{alive / MB:.1f} MB alive for a {n // MB} MB answer when its last event is parsed"
    )


def test_one_large_chat_chunk_is_not_held_four_times_when_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that streams its answer in one chunk (a gateway wrapping a non-streaming
    backend) sends one event as large as the text (up to ``limits.max_upstream_body_bytes``).
    Its last read also brings the events after it. Held were the bytes read, their slice and its
    copy, the event cut out of them, its data cut out of that: 4N when it and the events after it
    were parsed. Now 2N: the bytes read and the event when it is parsed; when the events after it
    are, the event's bytes for the client and its text, observed (both needed: the client's are
    written once the read's events are all read, the text is counted when no usage comes)."""
    import proxy.events as events_module

    n = 4 * MB
    big = content("y" * n)
    last = (len(big) // (1 << 16)) * (1 << 16)
    reads = [big[:last], big[last:] + finish() + USAGE + DONE]  # the last read: its end, and more
    (out, obs), alive = alive_when_called(
        monkeypatch, events_module, "parse_event_data", lambda: _read_in_pieces("chat.completions", reads)
    )
    assert obs.done and obs.usage is not None and len(obs.all_text()) == n
    assert out.count(b"y" * 1000) == n // 1000 and b'"usage"' not in out
    assert alive < 2.5 * n, f"{alive / MB:.1f} MB alive for one {n // MB} MB event when it is parsed"
