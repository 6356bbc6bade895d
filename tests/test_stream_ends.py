"""What an upstream sends after the end of a Responses or Anthropic answer (response.completed /
incomplete / failed, message_stop), as after a chat stream's [DONE]: dropped, whether it came in
the same read as the end or in a read of its own. Each test failed before its fix."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.dialects import DIALECTS
from proxy.events import EventFilter
from proxy.observe import Observation
from tests.conftest import ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, send
from tests.test_stream_dialects import (
    ANTHROPIC_BODY,
    ANTHROPIC_HEADERS,
    MESSAGE_START,
    RESPONSE,
    RESPONSES_BODY,
    ev,
    proxy_for,
)

MESSAGES = (
    MESSAGE_START
    + ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    + ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello"}})
    + ev("content_block_stop", {"index": 0})
    + ev("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}})
    + ev("message_stop", {})
)
MESSAGES_LATE_ERROR = ev("error", {"error": {"type": "overloaded_error", "message": "Overloaded"}})
COMPLETED = {**RESPONSE, "status": "completed", "usage": {"input_tokens": 100, "output_tokens": 20}}
RESPONSES = ev(
    "response.created", {"sequence_number": 0, "response": {**RESPONSE, "status": "in_progress"}}
) + ev("response.completed", {"sequence_number": 1, "response": COMPLETED})
RESPONSES_LATE_ERROR = ev("error", {"code": "server_error", "message": "late", "param": None})


def relay(endpoint: str, reads: list[bytes]) -> tuple[bytes, Any]:
    """The reads as the relay hands them over: none once the answer has ended."""
    obs = Observation()
    events = EventFilter(obs, dialect=DIALECTS[endpoint], choices=1, client_wants_usage=False)  # type: ignore[index]
    out = b""
    for piece in reads:
        if obs.done:
            break
        passed = events.read(piece, limit=1 << 20)
        assert passed is not None
        out += passed
    return out, (obs.done, obs.error, dict(obs.finish_reasons), obs.usage)


@pytest.mark.parametrize(
    ("endpoint", "body", "late"),
    [("messages", MESSAGES, MESSAGES_LATE_ERROR), ("responses", RESPONSES, RESPONSES_LATE_ERROR)],
    ids=["messages", "responses"],
)
def test_what_follows_the_end_of_a_typed_stream_is_dropped_however_the_reads_fall(
    endpoint: str, body: bytes, late: bytes
) -> None:
    """In a read of its own, an event after message_stop / response.completed was dropped (the
    relay stops reading at the end); in the same read as the end it reached the client and was
    observed: an error event there made a whole answer an upstream_error, and the SDK raised."""
    apart = relay(endpoint, [body, late])
    assert apart[0] == body and apart[1][1] is False
    for cut in itertools.chain([len(body)], range(len(body) - 3, len(body) + len(late))):
        stream = body + late
        assert relay(endpoint, [stream[:cut], stream[cut:]]) == apart, cut
    assert relay(endpoint, [body + late]) == apart


async def test_an_error_event_after_message_stop_in_the_same_read_takes_nothing_from_the_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script)
    script.plan = Plan(content_type="text/event-stream", chunks=[MESSAGES + MESSAGES_LATE_ERROR])
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/messages",
        dumps(ANTHROPIC_BODY),
        headers=ANTHROPIC_HEADERS,
    )
    (entry,) = reply.new_entries
    billed = (entry["outcome"], entry["usage_source"], entry["output_tokens"])
    assert billed == ("ok", "provider", "3"), entry
    assert b"overloaded_error" not in reply.body, reply.body[-400:]


async def test_an_error_event_after_response_completed_in_the_same_read_takes_nothing_from_the_answer(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await proxy_for(make_proxy, script)
    script.plan = Plan(content_type="text/event-stream", chunks=[RESPONSES + RESPONSES_LATE_ERROR])
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/responses", dumps(RESPONSES_BODY))
    (entry,) = reply.new_entries
    billed = (entry["outcome"], entry["usage_source"], entry["output_tokens"])
    assert billed == ("ok", "provider", "20"), entry
    assert b"late" not in reply.body, reply.body[-400:]
