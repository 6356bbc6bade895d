"""Responses answers in phases (gpt-5.3-codex on): commentary, then the final answer. With a
structured output only the final answer is JSON, as the SDK reads it; the policy judges that one.
Driven by the openai SDK, on answers shaped exactly as OpenAI sends them."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.conftest import UPSTREAM_KEY, ProxyFactory
from tests.outcome_helpers import ledger_entries
from tests.test_bad_input import Plan, ScriptedUpstream, scripted_upstreams

MODEL = "gpt-5.3-codex"


class Weather(BaseModel):
    city: str
    temp: int


# -- Responses: a commentary message before the final answer -----------------------------------
# Models from gpt-5.3-codex label their messages with a phase: intermediate commentary (plain
# text), then the final answer. With a structured output only the final answer is JSON; the SDK
# parses only it (openai/lib/_parsing/_responses.py: parse_text).

COMMENTARY = "Let me look up the weather."
FINAL = '{"city":"Paris","temp":20}'
USAGE = {
    "input_tokens": 30,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 25,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 55,
}


def _message(item_id: str, phase: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "phase": phase,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def response_object(status: str, output: list[Any], usage: Any) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": status,
        "model": MODEL,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "temperature": 1.0,
        "top_p": 1.0,
        "text": {"format": {"type": "json_schema", "name": "Weather", "strict": True, "schema": {}}},
    }


OUTPUT = [_message("msg_1", "commentary", COMMENTARY), _message("msg_2", "final_answer", FINAL)]


def _sse(obj: dict[str, Any]) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _stream(output: list[dict[str, Any]], *, phase_when_added: bool = True) -> list[bytes]:
    """The events OpenAI sends for ``output``; ``phase_when_added=False``: each message's phase
    told only once it is done (``response.output_item.done``), not when it is added."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response_object("in_progress", [], None)},
        {"type": "response.in_progress", "response": response_object("in_progress", [], None)},
    ]
    for index, item in enumerate(output):
        text = item["content"][0]["text"]
        added = item if phase_when_added else {k: v for k, v in item.items() if k != "phase"}
        empty = {**added, "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        events += [
            {"type": "response.output_item.added", "output_index": index, "item": empty},
            {"type": "response.content_part.added", **where, "part": part},
            {"type": "response.output_text.delta", **where, "delta": text[:10], "logprobs": []},
            {"type": "response.output_text.delta", **where, "delta": text[10:], "logprobs": []},
            {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": {**part, "text": text}},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]
    events.append({"type": "response.completed", "response": response_object("completed", output, USAGE)})
    return [_sse({**e, "sequence_number": n}) for n, e in enumerate(events)]


async def _parse(client: openai.AsyncOpenAI, run: str) -> Any:
    return await client.responses.parse(
        model=MODEL, input="weather in Paris?", text_format=Weather, extra_headers={"X-Run-Id": run}
    )


async def _stream_parse(client: openai.AsyncOpenAI, run: str) -> Any:
    async with client.responses.stream(
        model=MODEL, input="weather in Paris?", text_format=Weather, extra_headers={"X-Run-Id": run}
    ) as stream:
        async for _ in stream:
            pass
        return await stream.get_final_response()


@pytest.mark.parametrize("streamed", [False, True], ids=["body", "stream"])
async def test_a_structured_answer_after_commentary_is_not_rejected(
    make_proxy: ProxyFactory, script: ScriptedUpstream, streamed: bool
) -> None:
    if streamed:
        script.plan = Plan(content_type="text/event-stream", chunks=_stream(OUTPUT))
    else:
        body = json.dumps(response_object("completed", OUTPUT, USAGE)).encode()
        script.plan = Plan(chunks=[body])
    call = _stream_parse if streamed else _parse
    # What the SDK makes of it from the provider directly: the final answer, parsed.
    async with openai.AsyncOpenAI(base_url=script.base_url, api_key=UPSTREAM_KEY, max_retries=0) as direct:
        assert (await call(direct, "direct")).output_parsed == Weather(city="Paris", temp=20)
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    async with proxy.client() as client:
        reply = await call(client, "phase")  # was: 422 / an error event, rejected:parse-json
    assert reply.output_parsed == Weather(city="Paris", temp=20)
    [entry] = await ledger_entries(proxy, "phase")
    assert entry["outcome"] == "ok", entry
    assert (entry["input_tokens"], entry["output_tokens"]) == ("30", "25"), entry


@pytest.mark.parametrize("streamed", [False, True], ids=["body", "stream"])
async def test_a_final_answer_that_is_not_json_is_still_rejected(
    make_proxy: ProxyFactory, script: ScriptedUpstream, streamed: bool
) -> None:
    # Only the final answer is judged: one that is not JSON is still rejected.
    output = [_message("msg_1", "commentary", COMMENTARY), _message("msg_2", "final_answer", "not json")]
    if streamed:
        script.plan = Plan(content_type="text/event-stream", chunks=_stream(output))
    else:
        script.plan = Plan(chunks=[json.dumps(response_object("completed", output, USAGE)).encode()])
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    async with proxy.client() as client:
        with pytest.raises(openai.APIError):
            if streamed:  # not the SDK's helper: it parses the final text itself first
                stream = await client.responses.create(
                    model=MODEL,
                    input="weather in Paris?",
                    stream=True,
                    text={"format": {"type": "json_schema", "name": "W", "schema": {}}},
                    extra_headers={"X-Run-Id": "bad"},
                )
                async for _ in stream:
                    pass
            else:
                await _parse(client, "bad")
    [entry] = await ledger_entries(proxy, "bad")
    assert entry["outcome"].startswith("rejected:parse-json"), entry


async def test_a_tool_call_after_commentary_is_not_rejected(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    # An agent's turn: a preamble, then the call (no final answer yet). Its text is not the
    # structured answer.
    call = {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }
    output = [_message("msg_1", "commentary", COMMENTARY), call]
    script.plan = Plan(chunks=[json.dumps(response_object("completed", output, USAGE)).encode()])
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    async with proxy.client() as client:
        reply = await client.responses.create(  # was: 422 rejected:parse-json
            model=MODEL,
            input="weather in Paris?",
            tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
            text={"format": {"type": "json_schema", "name": "W", "schema": {"type": "object"}}},
            extra_headers={"X-Run-Id": "turn"},
        )
    assert reply.output[1].type == "function_call"
    [entry] = await ledger_entries(proxy, "turn")
    assert entry["outcome"] == "ok", entry


async def test_a_structured_answer_after_commentary_whose_phase_comes_late_is_not_rejected(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """The phase of a streamed message may be known only once it is done (the final response
    holds it, which is what the SDK parses): its commentary is still not the JSON answer."""
    script.plan = Plan(content_type="text/event-stream", chunks=_stream(OUTPUT, phase_when_added=False))
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_invalid_json": "reject"}
    )
    async with proxy.client() as client:
        stream = await client.responses.create(  # not the SDK's helper: it parses every text itself
            model=MODEL,
            input="weather in Paris?",
            stream=True,
            text={"format": {"type": "json_schema", "name": "Weather", "schema": {}}},
            extra_headers={"X-Run-Id": "late-phase"},
        )
        events = [event async for event in stream]  # was: an error event, rejected:parse-json
    final = events[-1].response
    assert [m.phase for m in final.output] == ["commentary", "final_answer"]
    assert Weather.model_validate_json(final.output[1].content[0].text) == Weather(city="Paris", temp=20)
    [entry] = await ledger_entries(proxy, "late-phase")
    assert entry["outcome"] == "ok", entry
