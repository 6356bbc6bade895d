"""What an SDK user sees through the proxy, as they would from the provider: retries asked for
where a retry helps and refused where it cannot, optional fields left optional, feature headers
passed on, an id on every answer where the SDK reads it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import httpx2
import openai
import pytest
from multidict import CIMultiDict

from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy, ProxyFactory, until_upstream_received
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries, run_meters, the_entry
from tests.test_bad_input import GOOD_BODY, Plan, ScriptedUpstream, scripted_upstreams
from tests.test_stream_endings_and_drains import DONE, finish, text, usage_chunk
from tests.test_upstream_bodies import read_request

MODEL = "gpt-4o-mini"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
CLAUDE = {
    "upstreams": {"claude": {"base_url": "", "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}},
    "models": {"claude-*": {"upstream": "claude"}},
}


async def _claude_proxy(make_proxy: ProxyFactory, fake: FakeUpstream) -> Proxy:
    upstreams = {"claude": {**CLAUDE["upstreams"]["claude"], "base_url": fake.base_url}}
    return await make_proxy(upstreams=upstreams, models=CLAUDE["models"])


# -- retries --------------------------------------------------------------------------------


async def _second_call_while_first_in_flight(
    proxy: Proxy, fake: FakeUpstream, run: str
) -> tuple[Any, list[int]]:
    """A second call sent while the first is held upstream, and what its SDK made of it (a
    refusal it did not retry past is returned): the result, and the status of each try. A
    refusal answers the first, and the retry waits for that answer (with its settle ahead of
    the retry's reserve): the retry meets the room it was told would clear, however long the
    SDK's wait and however slow the machine. After a fixed delay the first could end before
    the second was even refused, or after all its retries."""
    headers = {"X-Run-Id": run}
    statuses: list[int] = []
    held: list[asyncio.Task[Any]] = []

    async def tried(response: httpx2.Response) -> None:
        statuses.append(response.status_code)
        if response.status_code == 429:
            fake.release()
            await held[0]

    hooked = openai.DefaultAsyncHttpxClient(event_hooks={"response": [tried]})
    async with (
        proxy.client(max_retries=0) as slow_client,
        proxy.client(max_retries=2, http_client=hooked) as client,
    ):
        held.append(
            asyncio.create_task(
                slow_client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=10,
                    extra_headers=headers,
                    extra_body={"fake": {"hold": True}},
                )
            )
        )
        await until_upstream_received(fake, 1)  # the first call holds its slot or its reserve
        try:
            second: Any = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=10, extra_headers=headers
            )
        except openai.RateLimitError as err:
            second = err
        fake.release()  # never refused: the first is still held
        await held[0]
    return second, statuses


async def test_a_concurrency_refusal_is_retried_by_the_sdk(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(tiers={"standard": {"key": {"concurrent": 1}}})
    second, statuses = await _second_call_while_first_in_flight(proxy, fake, "conc")
    assert not isinstance(second, openai.RateLimitError), second.response.headers
    assert statuses == [429, 200] and fake.calls == 2


async def test_room_held_only_by_reserves_in_flight_is_retried(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # A call reserves 19 total tokens and uses 12: a second one fits once the first settled.
    proxy = await make_proxy(tiers={"standard": {"run": {"total_tokens": 31}}})
    second, statuses = await _second_call_while_first_in_flight(proxy, fake, "inflight")
    assert not isinstance(second, openai.RateLimitError), second.response.headers
    assert statuses == [429, 200] and fake.calls == 2


async def test_a_concurrency_ceiling_of_zero_is_final(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(tiers={"standard": {"key": {"concurrent": 0}}})
    async with proxy.client(max_retries=2) as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "may fit" not in caught.value.message


async def test_a_refusal_is_final_when_any_ceiling_never_clears(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # The run's tokens are held by a call in flight (that would clear), but the key's requests
    # are spent for good: the script reports the first; the answer must not say "retry".
    proxy = await make_proxy(tiers={"standard": {"run": {"total_tokens": 31}, "key": {"requests": 2}}})
    async with proxy.client() as client:
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_headers={"X-Run-Id": "other"}
        )
        slow = asyncio.create_task(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=10,
                extra_headers={"X-Run-Id": "r"},
                # In flight until the next call is refused: a fixed delay may end first on a
                # loaded machine, and the key's requests alone then refuse it.
                extra_body={"fake": {"hold": True}},
            )
        )
        await until_upstream_received(fake, 2)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=10, extra_headers={"X-Run-Id": "r"}
            )
        fake.release()
        await slow
    assert caught.value.response.headers["x-billing-refused-scope"] == "run"
    assert caught.value.response.headers["x-should-retry"] == "false"


async def test_a_refusal_no_wait_mends_stays_final(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(tiers={"standard": {"run": {"requests": 1}}})
    async with proxy.client(max_retries=2) as client:
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_headers={"X-Run-Id": "one"}
        )
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_headers={"X-Run-Id": "one"}
            )
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert fake.calls == 1


async def test_the_operators_key_refused_upstream_is_not_retried(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    fake.api_key = "sk-rotated"  # the operator's key no longer works: no retry mends that
    proxy = await make_proxy()
    async with proxy.client(max_retries=2) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_headers={"X-Run-Id": "auth"}
            )
        with pytest.raises(openai.InternalServerError) as listed:
            await client.models.list()
    assert caught.value.code == "upstream_auth"
    assert listed.value.response.headers["x-should-retry"] == "false"
    meters = await run_meters(proxy, "auth")
    assert meters["requests"]["used"] == 1


# -- optional fields ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": {"id": "pmpt_abc", "variables": {"city": "Paris"}}},
        {"previous_response_id": "resp_1", "instructions": "continue"},
    ],
)
async def test_a_responses_call_without_input_is_forwarded(
    proxy: Proxy, fake: FakeUpstream, fields: dict[str, Any]
) -> None:
    fake.contexts["resp_1"] = 0  # a response the provider keeps (else a 404, as OpenAI's)
    async with proxy.client() as client:
        reply = await client.responses.create(model=MODEL, extra_headers={"X-Run-Id": "np"}, **fields)
    assert reply.status == "completed" and fake.calls == 1


async def test_a_completion_with_a_null_prompt_is_forwarded(proxy: Proxy, fake: FakeUpstream) -> None:
    async with proxy.client() as client:
        reply = await client.completions.create(model="gpt-3.5-turbo-instruct", prompt=None, max_tokens=5)
    assert reply.choices and fake.calls == 1


async def test_a_null_cap_stays_unset(proxy: Proxy, fake: FakeUpstream) -> None:
    # The SDK sends None as null ("not set"): the proxy's cap goes in one field, never both
    # (OpenAI refuses max_tokens beside max_completion_tokens).
    async with proxy.client() as client:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=None)
    sent = fake.received[-1].body
    assert sent["max_completion_tokens"] == 1000
    assert sent.get("max_tokens") is None, sent


# -- streams ----------------------------------------------------------------------------------


def _sse(kind: str, obj: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(obj)}\n\n".encode()


_RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "status": "in_progress",
    "model": MODEL,
    "output": [],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": None,
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "metadata": {},
    "temperature": 1.0,
    "top_p": 1.0,
}
_ENDED_BY_AN_ERROR = [
    _sse("response.created", {"type": "response.created", "response": _RESPONSE, "sequence_number": 0}),
    _sse(
        "response.output_text.delta",
        {
            "type": "response.output_text.delta",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": "Hel",
            "logprobs": [],
            "sequence_number": 1,
        },
    ),
    _sse(
        "error",
        {"type": "error", "code": "server_error", "message": "boom", "param": None, "sequence_number": 2},
    ),
]


async def _event_types(client: openai.AsyncOpenAI) -> list[str]:
    stream = await client.responses.create(
        model=MODEL, input="hi", stream=True, extra_headers={"X-Run-Id": "re"}
    )
    return [event.type async for event in stream]


async def test_a_stream_the_provider_ends_with_its_error_reaches_the_sdk_as_it_sent_it(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    script.plan = Plan(content_type="text/event-stream", chunks=_ENDED_BY_AN_ERROR)
    async with openai.AsyncOpenAI(base_url=script.base_url, api_key=UPSTREAM_KEY, max_retries=0) as direct:
        want = await _event_types(direct)
    assert want == ["response.created", "response.output_text.delta", "error"]
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    async with proxy.client() as client:
        assert await _event_types(client) == want
    [entry] = await ledger_entries(proxy, "re")
    assert entry["outcome"] == "upstream_error"  # billed as before: a failed answer


_UNREADABLE_CHUNKS = {
    "mark-in-data": text(0, " world").replace(b"data: ", b"data: \xef\xbb\xbf", 1),
    "raw-surrogate": text(0, " wXrld").replace(b"wXrld", b"w\xed\xa0\xbdrld"),
}


@pytest.mark.parametrize("kind", list(_UNREADABLE_CHUNKS))
async def test_a_stream_the_sdk_cannot_read_is_not_billed_as_a_good_answer(
    kind: str, make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """A chunk whose data starts with a byte order mark, or holds a surrogate encoded raw: the
    SDK (strict UTF-8 per line, then ``json.loads``) raises on it, directly and through the
    proxy, and the ledger said ``ok`` (the stream events hunt)."""
    chunks = [text(0, "Hello"), _UNREADABLE_CHUNKS[kind], finish(0), usage_chunk(), DONE]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    direct = openai.AsyncOpenAI(base_url=script.base_url, api_key=UPSTREAM_KEY, max_retries=0)
    async with direct, proxy.client() as client:
        for sdk in (direct, client):
            # Asking for usage, the client gets every chunk as it came (one written again to cut
            # its usage would lose the mark, and hide what the provider sent).
            stream = await sdk.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"X-Run-Id": "unreadable"},
            )
            with pytest.raises(ValueError):  # JSONDecodeError, UnicodeDecodeError
                async for _ in stream:
                    pass
    # The client left mid-stream: the call settles once the proxy has read the upstream's rest,
    # maybe after the SDK raised (under CI's load, after the ledger was first read).
    entry = await the_entry(proxy, "unreadable", wait_s=10)
    assert entry["outcome"] == "upstream_error", entry


# -- headers ----------------------------------------------------------------------------------


async def test_anthropic_betas_reach_the_upstream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await _claude_proxy(make_proxy, fake)
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    await client.beta.messages.create(
        model="claude-x", max_tokens=50, messages=MESSAGES, betas=["context-1m-2025-08-07"]
    )
    sent = {k.lower(): v for k, v in fake.received[-1].headers.items()}
    assert sent.get("anthropic-beta") == "context-1m-2025-08-07"


async def test_every_anthropic_beta_line_goes_upstream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    # Two lines of a header are one comma-separated list (RFC 9110).
    proxy = await _claude_proxy(make_proxy, fake)
    headers = CIMultiDict(
        [
            ("x-api-key", KEY_A),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "context-1m-2025-08-07"),
            ("anthropic-beta", "interleaved-thinking-2025-05-14"),
        ]
    )
    body = {"model": "claude-x", "max_tokens": 20, "messages": MESSAGES}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/messages", json=body, headers=headers) as response,
    ):
        assert response.status == 200
    sent = {k.lower(): v for k, v in fake.received[-1].headers.items()}
    assert sent["anthropic-beta"] == "context-1m-2025-08-07,interleaved-thinking-2025-05-14"


async def test_the_anthropic_sdk_reads_the_calls_id(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await _claude_proxy(make_proxy, fake)
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0)
    message = await client.messages.create(
        model="claude-x", max_tokens=20, messages=MESSAGES, extra_headers={"X-Run-Id": "ids"}
    )
    with pytest.raises(anthropic.APIStatusError) as failed:
        await client.messages.create(
            model="claude-x",
            max_tokens=20,
            messages=MESSAGES,
            extra_body={"fake": {"mode": "error", "status": 500}},
        )
    with pytest.raises(anthropic.APIStatusError) as refused:
        await client.messages.create(model="claude-x", max_tokens=-1, messages=MESSAGES)
    async with client.messages.stream(model="claude-x", max_tokens=20, messages=MESSAGES) as stream:
        await stream.get_final_message()
        streamed = stream.response.headers.get("request-id")
    assert message._request_id and failed.value.request_id and refused.value.request_id and streamed
    assert message._request_id == (await ledger_entries(proxy, "ids"))[0]["request_id"]


async def test_every_answer_carries_an_id(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy(limits={"max_body_bytes": 2048})
    async with proxy.client() as client:
        listed = await client.models.with_raw_response.list()
        with pytest.raises(openai.APIStatusError) as too_large:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x" * 5000}]
            )
    async with proxy.client("sk-wrong") as stranger:
        with pytest.raises(openai.AuthenticationError) as unknown:
            await stranger.models.list()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/chat/completions",
            data=b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}',
            headers={
                "Authorization": f"Bearer {KEY_A}",
                "Expect": "200-ok",
                "Content-Type": "application/json",
            },
        ) as expectation,
    ):
        assert expectation.status == 417 and expectation.headers.get("x-request-id")
    assert listed.headers.get("x-request-id")
    assert too_large.value.status_code == 413 and too_large.value.request_id
    assert unknown.value.request_id


async def _raw_get(port: int, path: str, extra: str) -> tuple[bytes, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {
        k.strip().lower().decode(): v.strip().decode() for k, _, v in (x.partition(b":") for x in lines[1:])
    }
    return lines[0], headers, body


@pytest.mark.parametrize("path", ["/v1/billing/runs/r1", "/v1/billing/keys/self", "/metrics", "/readyz"])
async def test_an_unknown_expectation_on_a_get_is_refused_in_the_apis_format(proxy: Proxy, path: str) -> None:
    port = int(proxy.url.rsplit(":", 1)[1])
    status, headers, body = await _raw_get(port, path, f"Authorization: Bearer {KEY_A}\r\nExpect: foo\r\n")
    assert b" 417 " in status and "x-request-id" in headers
    assert json.loads(body)["error"]["code"] == "expectation_failed"


async def test_an_unknown_expectation_on_an_anthropic_callers_model_list_is_refused_in_its_format(
    proxy: Proxy,
) -> None:
    """The Anthropic SDK's model list (``anthropic-version``) is answered in its API's format, its
    refusals too: the expect handler read the dialect from the path alone (a review)."""
    port = int(proxy.url.rsplit(":", 1)[1])
    extra = f"x-api-key: {KEY_A}\r\nanthropic-version: 2023-06-01\r\nExpect: foo\r\n"
    status, headers, body = await _raw_get(port, "/v1/models", extra)
    assert b" 417 " in status and "request-id" in headers, (status, headers)
    refusal = json.loads(body)
    assert refusal["type"] == "error" and refusal["error"]["type"] == "invalid_request_error", refusal


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("POST", "/v1/billing/keys/self", "GET"),
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/metrics", "GET"),
    ],
)
async def test_a_method_not_allowed_names_the_allowed_ones(
    proxy: Proxy, method: str, path: str, allowed: str
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, proxy.url + path, headers={"Authorization": f"Bearer {KEY_A}"}) as response,
    ):
        assert response.status == 405
        assert allowed in response.headers.get("Allow", "")


async def test_an_answer_too_large_to_relay_is_not_retried(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # The provider answered (and billed) an embeddings call whose body is over the proxy's limit:
    # the same inputs make the same body again, so each of the SDK's retries is a billed call
    # that can only fail the same way.
    proxy = await make_proxy(limits={"max_upstream_body_bytes": 4096})
    async with proxy.client(max_retries=2) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.embeddings.create(
                model="text-embedding-3-small",
                input=[f"text {i}" for i in range(200)],
                extra_headers={"X-Run-Id": "big"},
            )
    assert caught.value.response.headers.get("x-should-retry") == "false", dict(caught.value.response.headers)
    assert fake.calls == 1
    assert len(await ledger_entries(proxy, "big")) == 1


async def _raw_upstream(head_extra: bytes, served: list[None]) -> Any:
    import asyncio

    body = GOOD_BODY

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                served.append(None)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + head_extra
                    + b"Content-Length: %d\r\n\r\n" % len(body)
                    + body
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize(
    "header",
    [b"x-ratelimit-note: caf\xe9\r\n", b"x-request-id: req-\xc3\xa9\r\n"],
    ids=["latin1", "utf8"],
)
async def test_a_provider_header_the_proxy_cannot_resend_does_not_lose_a_billed_answer(
    make_proxy: ProxyFactory, header: bytes
) -> None:
    served: list[None] = []
    server = await _raw_upstream(header, served)
    try:
        port = server.sockets[0].getsockname()[1]
        upstream = {
            "base_url": f"http://127.0.0.1:{port}/v1",
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": 3,
        }
        proxy = await make_proxy(upstreams={"openai": upstream})
        async with proxy.client(max_retries=2) as client:
            reply = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Run-Id": "hdr"}
            )
        assert reply.choices[0].message.content == "fine"
        assert len(served) == 1
        assert len(await ledger_entries(proxy, "hdr")) == 1
    finally:
        server.close()


async def test_an_anthropic_answer_too_large_to_relay_is_not_retried(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    import anthropic

    proxy = await make_proxy(
        limits={"max_upstream_body_bytes": 4096},
        upstreams={
            "claude": {"base_url": fake.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
        },
        models={"claude-*": {"upstream": "claude"}},
    )
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-proxy-team-a", max_retries=2)
    with pytest.raises(anthropic.InternalServerError) as caught:
        await client.messages.create(
            model="claude-x",
            max_tokens=3000,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Run-Id": "big-claude"},
            extra_body={"fake": {"reply_tokens": 2000}},
        )
    assert caught.value.response.headers.get("x-should-retry") == "false", dict(caught.value.response.headers)
    assert fake.calls == 1
    assert len(await ledger_entries(proxy, "big-claude")) == 1


@pytest.mark.parametrize("name", ["X-Should-Retry", "x-should-retry"])
async def test_the_operators_key_refused_is_not_retried_whatever_the_headers_case(
    make_proxy: ProxyFactory, name: str
) -> None:
    # An upstream (or a gateway before it) that writes its headers capitalised: the proxy's own
    # "x-should-retry: false" must replace the provider's, not go out beside it (httpx reads two
    # lines as "true, false", neither, and the SDK retries the 502).
    from tests.test_bad_input import Plan, ScriptedUpstream

    script = ScriptedUpstream()
    await script.start()
    try:
        error = (
            b'{"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", '
            b'"code": "invalid_api_key"}}'
        )
        script.plan = Plan(status=401, chunks=[error], extra_headers={name: "true"})
        upstream = {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 3}
        proxy = await make_proxy(upstreams={"openai": upstream})
        async with proxy.client(max_retries=2) as client:
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"X-Run-Id": "auth"},
                )
        assert caught.value.code == "upstream_auth"
        assert len(script.received) == 1, caught.value.response.headers.get_list("x-should-retry")
        assert caught.value.response.headers.get_list("x-should-retry") == ["false"]
    finally:
        await script.close()


async def test_a_request_the_http_parser_refuses_reads_as_an_error_in_both_sdks(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A header past the HTTP parser's 64 KiB field limit (a long anthropic-beta list, say) is
    refused before any route is known: the answer carries both APIs' error fields, so the
    Anthropic SDK on /v1/messages reads an ``invalid_request_error`` as the OpenAI SDK does
    (it was OpenAI's format alone: no ``"type": "error"`` for the Anthropic SDK; the request
    fuzzing hunt)."""
    proxy = await _claude_proxy(make_proxy, fake)
    long = {"x-long": "x" * 70_000}
    claude = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY_A, max_retries=0, default_headers=long)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model="claude-x", max_tokens=5, messages=MESSAGES)
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and "not valid HTTP" in body["error"]["message"]
    gpt = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0, default_headers=long)
    with pytest.raises(openai.BadRequestError) as refused_too:
        await gpt.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert refused_too.value.code == "bad_http_request" and refused_too.value.type == "invalid_request_error"
    assert not fake.received
