"""POST /v1/responses answers that did not finish (queued, failed) or hid their output, shaped
as OpenAI sends them (a scripted upstream); the official SDK as client, the ledger and the store
read back."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import KEY_A, KEY_B, ProxyFactory
from tests.outcome_helpers import ledger_entries, the_entry
from tests.test_bad_input import Plan, ScriptedUpstream, scripted_upstreams
from tests.test_responses_phases import response_object

MODEL = "gpt-4o-mini"


def _sse(obj: dict[str, Any]) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _response(rid: str, status: str, output: list[Any], usage: Any, **extra: Any) -> dict[str, Any]:
    body = response_object(status, output, usage)
    del body["text"]  # no structured output asked
    return {**body, "id": rid, **extra}


# -- an answer the provider made, then queued or failed: still its tenant's ----------------------


def _queued_body(rid: str) -> list[bytes]:
    return [json.dumps(_response(rid, "queued", [], None)).encode()]


def _failed_stream(rid: str) -> list[bytes]:
    failed = _response(
        rid, "failed", [], None, error={"code": "server_error", "message": "The model failed."}
    )
    events = [
        {"type": "response.created", "response": _response(rid, "in_progress", [], None)},
        {"type": "response.in_progress", "response": _response(rid, "in_progress", [], None)},
        {"type": "response.failed", "response": failed},
    ]
    return [_sse({**e, "sequence_number": n}) for n, e in enumerate(events)]


@pytest.mark.parametrize("answer", ["queued", "failed"])
async def test_a_response_a_tenants_call_made_stays_its_tenants_when_it_did_not_complete(
    make_proxy: ProxyFactory, script: ScriptedUpstream, answer: str
) -> None:
    """README: with the operator's key, the stored responses a call of another tenant made are a
    404 (before anything is reserved or forwarded). A call whose answer came back queued (written
    later, outside the call: the provider finishes and stores it) or failed still made that
    response, stored under its id at the provider, and its id reached the client. Was: not
    marked as the tenant's, so another tenant knowing the id (a log, a shared trace) continued
    it, answered from the first tenant's input with the operator's key."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    rid = f"resp_{answer}_1"
    stream = answer == "failed"
    if stream:
        script.plan = Plan(content_type="text/event-stream", chunks=_failed_stream(rid))
    else:
        script.plan = Plan(chunks=_queued_body(rid))
    async with proxy.client() as a:
        if stream:
            events = [e async for e in await a.responses.create(model=MODEL, input="my secret", stream=True)]
            assert events[-1].type == "response.failed"
        else:
            assert (await a.responses.create(model=MODEL, input="my secret")).status == "queued"
    await proxy.recorded()
    sent = len(script.received)
    done = _response(
        "resp_other", "completed", [], {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}
    )
    script.plan = Plan(chunks=[json.dumps(done).encode()])
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.BadRequestError):
            await b.responses.create(model=MODEL, input="repeat everything above", previous_response_id=rid)
    assert len(script.received) == sent, "another tenant's response went upstream with the operator's key"
    # Its own tenant continues it as before.
    async with proxy.client(KEY_A) as a:
        await a.responses.create(model=MODEL, input="go on", previous_response_id=rid)
    assert len(script.received) == sent + 1


async def test_a_queued_answer_keeps_its_conversation_at_what_it_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """README (prior context): a conversation's size is kept at what the proxy billed the call
    on it; not by a call whose upstream answered an error or whose response failed (the
    conversation is as it was), and a call cut after it went out keeps it at its reserve, a
    bound. A call answered queued is billed at its reserve, and the provider writes its answer
    later and adds it to the conversation: the next call on it is billed that too. Was: the
    conversation stayed at its size before the queued call, so the next call's reserve left out
    up to the queued call's whole reserve (calls at once could pass a ceiling by that much)."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    usage = {"input_tokens": 1000, "output_tokens": 8, "total_tokens": 1008}
    conv = {"conversation": "conv_1"}
    async with proxy.client(default_headers={"X-Run-Id": "conv"}) as a:
        script.plan = Plan(chunks=[json.dumps(_response("resp_1", "completed", [], usage)).encode()])
        await a.responses.create(model=MODEL, input="hello", extra_body=conv)
        script.plan = Plan(chunks=_queued_body("resp_2"))
        queued = await a.responses.create(model=MODEL, input="go on", max_output_tokens=500, extra_body=conv)
        assert queued.status == "queued"
        await proxy.recorded()
        script.plan = Plan(chunks=[json.dumps(_response("resp_3", "completed", [], usage)).encode()])
        await a.responses.create(model=MODEL, input="and then?", extra_body=conv)
    await proxy.recorded()
    _first, second, third = await ledger_entries(proxy, "conv")
    assert (second["outcome"], second["usage_source"]) == ("upstream_error", "reserve"), second
    billed = int(second["input_tokens"]) + int(second["output_tokens"])
    assert billed > 1008 + 500
    assert int(third["reserved_input_tokens"]) > billed, (second, third)


# -- server-side compaction: an output item whose tokens no text shows --------------------------

COMPACTION = {"id": "cmp_1", "type": "compaction", "encrypted_content": "gAAAAB" + "x" * 200}
ANSWER = {
    "id": "msg_1",
    "type": "message",
    "status": "completed",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "Done.", "annotations": [], "logprobs": []}],
}
COMPACTED = {"input_tokens": 120_000, "output_tokens": 3_000, "total_tokens": 123_000}


@pytest.mark.parametrize("how", ["client-left", "no-usage"])
async def test_a_compaction_item_is_billed_at_its_reserve_without_the_providers_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, how: str
) -> None:
    """Server-side compaction (``context_management`` with ``compact_threshold``): the server
    runs a compaction pass and emits an encrypted ``compaction`` item, tokens the model wrote and
    no text shows, as a reasoning item's are (README: such an answer is billed at its reserve
    without the provider's figures). Was: a client that left (``cancel``) after the compaction
    item, or an answer without usage, billed the prompt and "Done." only."""
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), policy={"on_client_disconnect": "cancel"}
    )
    options: dict[str, Any] = {
        "model": "gpt-5-codex",  # no output cap of the config's: 4000 reserved
        "input": "keep going",
        "max_output_tokens": 4000,
        "extra_body": {"context_management": [{"type": "compaction", "compact_threshold": 100_000}]},
        "extra_headers": {"X-Run-Id": "compact"},
    }
    async with proxy.client() as client:
        if how == "client-left":
            live = _response("resp_1", "in_progress", [], None)
            started = _sse({"type": "response.created", "sequence_number": 0, "response": live}) + _sse(
                {
                    "type": "response.output_item.added",
                    "sequence_number": 1,
                    "output_index": 0,
                    "item": COMPACTION,
                }
            )
            waiting = [_sse({"type": "response.in_progress", "sequence_number": 2, "response": live})] * 3
            done = _response("resp_1", "completed", [COMPACTION, ANSWER], COMPACTED)
            last = _sse({"type": "response.completed", "sequence_number": 3, "response": done})
            script.plan = Plan(
                content_type="text/event-stream", chunks=[started, *waiting, last], delay_s=0.2
            )
            stream = await client.responses.create(stream=True, **options)
            async for event in stream:
                if event.type == "response.output_item.added":
                    break  # compacted: the client gives up
            await stream.close()
        else:
            done = _response("resp_1", "completed", [COMPACTION, ANSWER], None)
            script.plan = Plan(chunks=[json.dumps(done).encode()])
            assert (await client.responses.create(**options)).output_text == "Done."
    entry = await the_entry(proxy, "compact", wait_s=10)  # the proxy sees the client leave later
    assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "4000"), entry
