"""Self-tests for the fake upstream, driven by the real openai SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from tests.fake_upstream import BillEntry, FakeUpstream

KEY = "sk-upstream-secret"
MSGS: list[Any] = [{"role": "user", "content": "hello there big world"}]  # 4 words + 3 = 7


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
