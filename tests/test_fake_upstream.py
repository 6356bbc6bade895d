"""Self-tests for the fake upstream, driven by the real openai SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import anthropic
import httpx2
import openai
import pytest

from tests.fake_upstream import REFUSAL_TEXT, BillEntry, FakeUpstream

KEY = "sk-upstream-secret"
MSGS: list[Any] = [{"role": "user", "content": "hello there big world"}]  # 4 words + 3 = 7
TOKS = "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"


def run(test: Callable[[FakeUpstream, openai.AsyncOpenAI], Awaitable[None]]) -> FakeUpstream:
    fake = FakeUpstream()

    async def main() -> None:
        base_url = await fake.start()
        client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0)
        try:
            await test(fake, client)
        finally:
            await client.close()
            await fake.close()

    asyncio.run(main())
    return fake


def test_non_streaming_ok_with_usage() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        r = await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS)
        assert r.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"
        assert r.choices[0].finish_reason == "stop"
        assert r.usage is not None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (7, 8, 15)
        assert r.id == "chatcmpl-1" and r.system_fingerprint == "fp_fake"
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSGS)
        assert raw.headers["x-request-id"] == "req_2"
        assert raw.headers["content-type"] == "application/json"

    fake = run(body)
    assert fake.calls == 2
    assert fake.received[0].headers["Authorization"] == f"Bearer {KEY}"


def test_streaming_with_include_usage() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MSGS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"fake": {"reply_tokens": 3}},
        )
        chunks = [c async for c in stream]
        *rest, last = chunks
        assert last.choices == [] and last.usage is not None
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (7, 3)
        assert all(c.usage is None for c in rest)
        text = "".join(c.choices[0].delta.content or "" for c in rest)
        assert text == "tok0 tok1 tok2"
        assert rest[0].choices[0].delta.role == "assistant"
        assert rest[-1].choices[0].finish_reason == "stop"

    fake = run(body)
    assert fake.bill == [BillEntry(1, "/v1/chat/completions", "gpt-4o-mini", True, 7, 3, 0, 0, "ok")]


def test_truncate_and_refusal() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        r = await client.chat.completions.create(
            model="m", messages=MSGS, max_tokens=2, extra_body={"fake": {"mode": "truncate"}}
        )
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content == "tok0 tok1"
        r = await client.chat.completions.create(
            model="m", messages=MSGS, extra_body={"fake": {"mode": "refusal"}}
        )
        msg = r.choices[0].message
        assert msg.content is None and msg.refusal == "I can't help with that."
        stream = await client.chat.completions.create(
            model="m", messages=MSGS, stream=True, extra_body={"fake": {"mode": "refusal"}}
        )
        refusal = "".join([c.choices[0].delta.refusal or "" async for c in stream if c.choices])
        assert refusal == "I can't help with that."

    fake = run(body)
    assert [b.completion_tokens for b in fake.bill] == [2, 5, 5]


def test_error_mode_raises_and_is_not_billed() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model="m", messages=MSGS, extra_body={"fake": {"mode": "error"}}
            )
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="m", messages=MSGS, extra_body={"fake": {"mode": "error", "status": 400}}
            )
        async with openai.AsyncOpenAI(base_url=fake.base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="m", messages=MSGS)

    fake = run(body)
    assert fake.bill == [] and fake.calls == 3


def test_no_usage_still_billed_and_usage_override() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        r = await client.chat.completions.create(
            model="m", messages=MSGS, extra_body={"fake": {"no_usage": True}}
        )
        assert r.usage is None
        stream = await client.chat.completions.create(
            model="m",
            messages=MSGS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"fake": {"no_usage": True}},
        )
        assert all(c.usage is None for c in [c async for c in stream])
        details = {
            "prompt_tokens_details": {"cached_tokens": 3},
            "completion_tokens_details": {"reasoning_tokens": 4},
        }
        r = await client.chat.completions.create(
            model="m",
            messages=MSGS,
            n=2,
            extra_body={"fake": {"usage": {"completion_tokens": 20, **details}}},
        )
        assert len(r.choices) == 2 and r.usage is not None and r.usage.total_tokens == 27

    fake = run(body)
    assert [(b.completion_tokens, b.cached_tokens, b.reasoning_tokens) for b in fake.bill] == [
        (8, 0, 0),
        (8, 0, 0),
        (20, 3, 4),
    ]
    assert fake.billed_prompt_tokens == 21 and fake.billed_completion_tokens == 36


def test_legacy_completions_and_embeddings() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        c = await client.completions.create(model="m", prompt=["a b", "c"], max_tokens=3)
        assert c.object == "text_completion" and c.choices[0].text == "tok0 tok1 tok2"
        assert c.choices[0].finish_reason == "length"
        e = await client.embeddings.create(model="e", input=["one two", ""])
        assert len(e.data) == 2 and e.usage.prompt_tokens == 3
        models = await client.models.list()
        assert [m.id for m in models.data][:1] == ["gpt-4o-mini"]
        with pytest.raises(openai.NotFoundError):
            await client.post("/nope", cast_to=object, body={})

    fake = run(body)
    assert [(b.path, b.prompt_tokens, b.completion_tokens) for b in fake.bill] == [
        ("/v1/completions", 3, 3),
        ("/v1/embeddings", 3, 0),
    ]


def test_cut_and_stall_are_billed() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.APIConnectionError):
            await client.chat.completions.create(
                model="m", messages=MSGS, extra_body={"fake": {"mode": "cut"}}
            )
        stream = await client.chat.completions.create(
            model="m", messages=MSGS, stream=True, extra_body={"fake": {"mode": "cut"}}
        )
        got: list[str] = []
        with pytest.raises(openai.APIConnectionError):
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content or "")
        assert "".join(got) == "tok0 tok1 "
        quick = client.with_options(timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            await quick.chat.completions.create(
                model="m", messages=MSGS, extra_body={"fake": {"mode": "stall_before_headers"}}
            )

    fake = run(body)
    modes = [(b.mode, b.completion_tokens) for b in fake.bill]
    assert modes == [("cut", 8), ("cut", 8), ("stall_before_headers", 8)]


def test_raw_sse_framing() -> None:
    async def main() -> bytes:
        fake = FakeUpstream()
        base_url = await fake.start()
        req = {
            "model": "m",
            "messages": MSGS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "fake": {"reply_tokens": 2, "keepalive": True},
        }
        try:
            async with (
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s,
                s.post(f"{base_url}/chat/completions", json=req) as resp,
            ):
                assert resp.headers["Content-Type"] == "text/event-stream"
                assert resp.headers["x-request-id"] == "req_1"
                return await resp.read()
        finally:
            await fake.close()

    raw = asyncio.run(main())
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.decode().split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    assert events.count(": keep-alive") == 1
    datas = [e for e in events if e != ": keep-alive"]
    assert all(e.startswith("data: ") and "\n" not in e for e in datas)
    objs = [json.loads(e[6:]) for e in datas[:-1]]
    assert [o["choices"][0]["delta"] for o in objs[:4]] == [
        {"role": "assistant", "content": "", "refusal": None},
        {"content": "tok0 "},
        {"content": "tok1"},
        {},
    ]
    assert all(o["usage"] is None for o in objs[:-1])
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["total_tokens"] == 9
    created = objs[1]["created"]
    assert datas[1] == (
        f'data: {{"id":"chatcmpl-1","object":"chat.completion.chunk","created":{created},"model":"m",'
        '"system_fingerprint":"fp_fake","choices":[{"index":0,"delta":{"content":"tok0 "},'
        '"logprobs":null,"finish_reason":null}],"usage":null}'
    )


# -- OpenAI Responses API ------------------------------------------------------------------------


def test_responses_non_streaming_ok() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        r = await client.responses.create(model="gpt-4o-mini", input="hello there")
        assert r.output_text == TOKS and r.status == "completed" and r.incomplete_details is None
        assert r.id == "resp_1" and r.object == "response" and r.model == "gpt-4o-mini"
        msg = r.output[0]
        assert msg.type == "message" and msg.id == "msg_1" and msg.status == "completed"
        assert r.usage is not None
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (2, 8, 10)
        assert r.usage.input_tokens_details.cached_tokens == 0
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        items: Any = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "input_text", "text": "a b c"}]},
        ]
        details = {
            "input_tokens_details": {"cached_tokens": 4},
            "output_tokens_details": {"reasoning_tokens": 2},
        }
        r = await client.responses.create(
            model="m",
            input=items,
            instructions="be nice",
            max_output_tokens=50,
            extra_body={"fake": {"reply_tokens": 3, "usage": details}},
        )
        assert r.usage is not None and r.instructions == "be nice"
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (13, 3, 16)
        r = await client.responses.create(model="m", input="x", extra_body={"fake": {"no_usage": True}})
        assert r.usage is None

    fake = run(body)
    assert fake.bill == [
        BillEntry(1, "/v1/responses", "gpt-4o-mini", False, 2, 8, 0, 0, "ok"),
        BillEntry(2, "/v1/responses", "m", False, 13, 3, 4, 2, "ok"),
        BillEntry(3, "/v1/responses", "m", False, 1, 8, 0, 0, "ok"),
    ]
    assert fake.calls == 3 and fake.received[0].headers["Authorization"] == f"Bearer {KEY}"


RESPONSES_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_responses_streaming_ends_with_completed_usage() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        stream = await client.responses.create(
            model="m", input="hello there", stream=True, extra_body={"fake": {"reply_tokens": 3}}
        )
        events = [e async for e in stream]
        assert [e.type for e in events] == [*RESPONSES_EVENTS, "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == "tok0 tok1 tok2"
        last = events[-1]
        assert last.type == "response.completed" and last.response.status == "completed"
        assert last.response.output_text == "tok0 tok1 tok2"
        usage = last.response.usage
        assert usage is not None and (usage.input_tokens, usage.output_tokens) == (2, 3)
        first = events[0]
        assert first.type == "response.created" and first.response.usage is None
        assert first.response.status == "in_progress"
        async with client.responses.stream(model="m", input=[{"role": "user", "content": "hi"}]) as s:
            final = await s.get_final_response()
        assert final.output_text == TOKS and final.usage is not None and final.usage.input_tokens == 4

    fake = run(body)
    assert [(b.stream, b.prompt_tokens, b.completion_tokens) for b in fake.bill] == [
        (True, 2, 3),
        (True, 4, 8),
    ]


def test_responses_truncate_refusal_content_filter() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        r = await client.responses.create(
            model="m", input="hi", max_output_tokens=3, extra_body={"fake": {"mode": "truncate"}}
        )
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
        msg = r.output[0]
        assert msg.type == "message" and msg.status == "incomplete" and r.output_text == "tok0 tok1 tok2"
        stream = await client.responses.create(model="m", input="hi", max_output_tokens=2, stream=True)
        events = [e async for e in stream]
        last = events[-1]
        assert last.type == "response.incomplete" and last.response.usage is not None
        assert last.response.usage.output_tokens == 2
        r = await client.responses.create(model="m", input="hi", extra_body={"fake": {"mode": "refusal"}})
        msg = r.output[0]
        assert msg.type == "message"
        part = msg.content[0]
        assert part.type == "refusal" and part.refusal == "I can't help with that."
        assert r.status == "completed" and r.output_text == ""
        stream = await client.responses.create(
            model="m", input="hi", stream=True, extra_body={"fake": {"mode": "refusal"}}
        )
        events = [e async for e in stream]
        assert "".join(e.delta for e in events if e.type == "response.refusal.delta") == REFUSAL_TEXT
        assert [e.type for e in events][-5:-1] == [
            "response.refusal.delta",
            "response.refusal.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        r = await client.responses.create(
            model="m", input="hi", extra_body={"fake": {"mode": "content_filter"}}
        )
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "content_filter" and r.output_text == "tok0 tok1 tok2 tok3 "

    fake = run(body)
    assert [b.completion_tokens for b in fake.bill] == [3, 2, 5, 5, 4]


def test_responses_failed_error_and_auth() -> None:
    async def body(fake: FakeUpstream, client: openai.AsyncOpenAI) -> None:
        stream = await client.responses.create(
            model="m", input="hi", stream=True, extra_body={"fake": {"mode": "failed", "after_chunks": 3}}
        )
        events = [e async for e in stream]
        assert [e.type for e in events] == [*RESPONSES_EVENTS[:7], "response.failed"]
        last = events[-1]
        assert last.type == "response.failed" and last.response.status == "failed"
        assert last.response.error is not None and last.response.error.code == "server_error"
        assert last.response.usage is None
        stream = await client.responses.create(
            model="m", input="hi", stream=True, extra_body={"fake": {"mode": "failed", "usage": {}}}
        )
        last = [e async for e in stream][-1]
        assert last.type == "response.failed" and last.response.usage is not None
        assert last.response.usage.output_tokens == 2
        r = await client.responses.create(model="m", input="hi", extra_body={"fake": {"mode": "failed"}})
        assert r.status == "failed" and r.output == [] and r.usage is None and r.error is not None
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(model="m", input="hi", extra_body={"fake": {"mode": "error"}})
        async with openai.AsyncOpenAI(base_url=fake.base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.responses.create(model="m", input="hi")
        stream = await client.responses.create(
            model="m", input="hi", stream=True, extra_body={"fake": {"mode": "cut"}}
        )
        got: list[str] = []
        with pytest.raises(openai.APIConnectionError):
            async for e in stream:
                got.append(e.type)
        assert got == RESPONSES_EVENTS[:6]

    fake = run(body)
    assert [(b.mode, b.prompt_tokens, b.completion_tokens) for b in fake.bill] == [
        ("failed", 1, 3),
        ("failed", 1, 2),
        ("failed", 1, 2),
        ("cut", 1, 8),
    ]
    assert fake.calls == 6


async def _raw_post(path: str, req: Any, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    fake = FakeUpstream()
    base_url = await fake.start()
    try:
        async with aiohttp.ClientSession() as s, s.post(f"{base_url}{path}", json=req, headers=headers) as r:
            return r.status, dict(r.headers), await r.read()
    finally:
        await fake.close()


def _sse_events(raw: bytes) -> list[tuple[str, Any]]:
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == ""
    out: list[tuple[str, Any]] = []
    for block in blocks[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        out.append((event[7:], json.loads(data[6:])))
    return out


def test_responses_raw_sse_framing() -> None:
    req = {"model": "m", "input": "hi", "stream": True, "fake": {"reply_tokens": 1}}
    status, headers, raw = asyncio.run(_raw_post("/responses", req, {"Authorization": f"Bearer {KEY}"}))
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert b"[DONE]" not in raw
    events = _sse_events(raw)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(9))
    delta = events[4][1]
    assert delta == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "tok0",
        "logprobs": [],
    }
    final = events[-1][1]["response"]
    assert final["usage"] == {
        "input_tokens": 1,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 2,
    }
    assert final["output"] == [
        {
            "id": "msg_1",
            "type": "message",
            "status": "completed",
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "tok0"}],
            "role": "assistant",
        }
    ]


# -- Anthropic Messages API ----------------------------------------------------------------------

AMSGS: Any = [{"role": "user", "content": "hello there big world"}]  # 4 words + 3 = 7


def run_anthropic(test: Callable[[FakeUpstream, anthropic.AsyncAnthropic], Awaitable[None]]) -> FakeUpstream:
    fake = FakeUpstream()

    async def main() -> None:
        await fake.start()
        root = fake.base_url.removesuffix("/v1")
        client = anthropic.AsyncAnthropic(base_url=root, api_key=KEY, max_retries=0)
        try:
            await test(fake, client)
        finally:
            await client.close()
            await fake.close()

    asyncio.run(main())
    return fake


def test_messages_non_streaming_usage_equals_bill() -> None:
    async def body(fake: FakeUpstream, client: anthropic.AsyncAnthropic) -> None:
        cache = {"cache_creation_input_tokens": 5, "cache_read_input_tokens": 7}
        m = await client.messages.create(
            model="claude-x",
            max_tokens=100,
            system="be brief",
            messages=AMSGS,
            extra_body={"fake": {"usage": cache}},
        )
        assert m.id == "msg_1" and m.type == "message" and m.role == "assistant" and m.model == "claude-x"
        assert m.content[0].type == "text" and m.content[0].text == TOKS
        assert m.stop_reason == "end_turn" and m.stop_sequence is None
        u = m.usage
        got = (u.input_tokens, u.output_tokens, u.cache_creation_input_tokens, u.cache_read_input_tokens)
        assert got == (9, 8, 5, 7)
        blocks: Any = [{"role": "user", "content": [{"type": "text", "text": "a b"}]}]
        m = await client.messages.create(model="c", max_tokens=2, messages=blocks)
        assert m.stop_reason == "max_tokens" and m.content[0].type == "text"
        assert m.content[0].text == "tok0 tok1" and m.usage.input_tokens == 5

    fake = run_anthropic(body)
    assert fake.bill == [
        BillEntry(1, "/v1/messages", "claude-x", False, 9, 8, 0, 0, "ok", 5, 7),
        BillEntry(2, "/v1/messages", "c", False, 5, 2, 0, 0, "ok"),
    ]
    assert fake.received[0].headers["anthropic-version"]


def test_messages_stream_final_message() -> None:
    async def body(fake: FakeUpstream, client: anthropic.AsyncAnthropic) -> None:
        async with client.messages.stream(
            model="c", max_tokens=100, messages=AMSGS, extra_body={"fake": {"reply_tokens": 3}}
        ) as s:
            final = await s.get_final_message()
        assert final.stop_reason == "end_turn" and final.content[0].type == "text"
        assert final.content[0].text == "tok0 tok1 tok2"
        assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 3)
        async with client.messages.stream(
            model="c", max_tokens=4, messages=AMSGS, extra_body={"fake": {"mode": "truncate"}}
        ) as s:
            final = await s.get_final_message()
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4
        async with client.messages.stream(
            model="c", max_tokens=100, messages=AMSGS, extra_body={"fake": {"mode": "refusal"}}
        ) as s:
            final = await s.get_final_message()
        assert final.stop_reason == "refusal" and final.usage.output_tokens == 5
        m = await client.messages.create(
            model="c", max_tokens=10, messages=AMSGS, extra_body={"fake": {"mode": "truncate"}}
        )
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 10

    fake = run_anthropic(body)
    assert [(b.stream, b.prompt_tokens, b.completion_tokens) for b in fake.bill] == [
        (True, 7, 3),
        (True, 7, 4),
        (True, 7, 5),
        (False, 7, 10),
    ]


def test_messages_error_mid_stream_and_errors() -> None:
    async def body(fake: FakeUpstream, client: anthropic.AsyncAnthropic) -> None:
        got: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as err:
            async with client.messages.stream(
                model="c", max_tokens=100, messages=AMSGS, extra_body={"fake": {"mode": "error_mid_stream"}}
            ) as s:
                async for text in s.text_stream:
                    got.append(text)
        assert got == ["tok0 ", "tok1 "]
        assert err.value.body == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Overloaded"},
        }
        with pytest.raises(anthropic.InternalServerError) as err:
            await client.messages.create(
                model="c", max_tokens=5, messages=AMSGS, extra_body={"fake": {"mode": "error"}}
            )
        assert err.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        with pytest.raises(anthropic.RateLimitError):
            await client.messages.create(
                model="c", max_tokens=5, messages=AMSGS, extra_body={"fake": {"mode": "error", "status": 429}}
            )
        root = fake.base_url.removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=root, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as err:
                await bad.messages.create(model="c", max_tokens=5, messages=AMSGS)
        assert err.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "invalid x-api-key"},
        }
        # the anthropic SDK lets the transport error of a broken stream through unwrapped
        with pytest.raises((anthropic.APIConnectionError, httpx2.TransportError)):
            async with client.messages.stream(
                model="c", max_tokens=100, messages=AMSGS, extra_body={"fake": {"mode": "cut"}}
            ) as s:
                await s.get_final_message()

    fake = run_anthropic(body)
    assert [(b.mode, b.prompt_tokens, b.completion_tokens) for b in fake.bill] == [
        ("error_mid_stream", 7, 2),
        ("cut", 7, 8),
    ]
    assert fake.calls == 5


def test_messages_raw_sse_framing_and_validation() -> None:
    hdrs = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    req: Any = {"model": "c", "max_tokens": 9, "messages": AMSGS, "stream": True, "fake": {"reply_tokens": 2}}
    status, headers, raw = asyncio.run(_raw_post("/messages", req, hdrs))
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert headers["request-id"] == "req_1"
    events = _sse_events(raw)
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"] == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "c",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 7,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 1,
        },
    }
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert events[3][1] == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "tok0 "},
    }
    assert events[6][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 2},
    }
    req["fake"] = {"mode": "error_mid_stream", "after_chunks": 1}
    _, _, raw = asyncio.run(_raw_post("/messages", req, hdrs))
    assert raw.endswith(
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"tok0 "}}\n\n'
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    )
    del req["max_tokens"]
    status, _, raw = asyncio.run(_raw_post("/messages", req, hdrs))
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, _, raw = asyncio.run(_raw_post("/messages", {**req, "max_tokens": 5}, {"x-api-key": KEY}))
    assert status == 400 and json.loads(raw)["error"]["message"] == "anthropic-version: header is required"
