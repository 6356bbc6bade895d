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
