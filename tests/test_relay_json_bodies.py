"""A stream call's answer that held no event but one JSON answer (labelled neither JSON nor SSE)
is billed on what it carries, and only such a body; a 200 that is no JSON is not to be retried
only when its framing shows it came whole. Found by the third review of this session's diffs."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from tests.conftest import ProxyFactory
from tests.memory import MB, alive_when_awaited, split
from tests.test_bad_input import Plan, ScriptedUpstream, send
from tests.test_pricing_kinds import _entry, _post
from tests.test_tool_fees import ANSWER, SEARCH_ITEM, _proxy, _response
from tests.test_upstream_bodies import CHAT, chat_body, dumps, proxy_before
from tests.test_whole_answers_as_sent import answer


async def _responses_searches(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, content_type: str
) -> dict[str, str]:
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10"})
    final = _response([SEARCH_ITEM, {**SEARCH_ITEM, "id": "ws_2"}, ANSWER])
    script.plan = Plan(content_type=content_type, chunks=[json.dumps(final).encode()])
    body = {"model": "gpt-x", "input": "news?", "tools": [{"type": "web_search"}], "stream": True}
    await _post(proxy.url, "/v1/responses", body, "r")
    return await _entry(redis_client)


async def test_json_answer_under_text_html_bills_the_hosted_tool_calls_it_carries(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Only the usage was taken: the two web searches the answer says it ran (billed when the
    same body is labelled application/json) were dropped from the bill."""
    entry = await _responses_searches(make_proxy, script, redis_client, "text/html")
    assert entry["usage_source"] == "provider", entry
    assert entry.get("tool_calls") == "web_search=2", entry


async def test_json_answer_under_text_html_is_priced_at_the_tier_that_served_it(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The tier the answer names (priced apart) was not taken: a priority-served call was
    priced at default prices."""
    model = {
        "upstream": "openai",
        "max_output_tokens": 1000,
        "price_per_million": {"input": "1", "output": "1"},
        "service_tiers": {"priority": {"input": "2", "output": "2"}},
    }
    from tests.test_bad_input import scripted_upstreams

    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url), models={"gpt-4o-mini": model})
    body = {**chat_body(), "service_tier": "priority"}
    reply = await answer(proxy, script, redis_client, 200, dumps(body), stream=True, content_type="text/html")
    (entry,) = reply.new_entries
    assert entry["usage_source"] == "provider", entry
    assert entry.get("service_tier") == "priority", entry


async def test_a_200_json_body_cut_by_a_clean_close_stays_retryable(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """An upstream that answers without Content-Length or chunking (HTTP/1.0-style, read to the
    close) and dies mid-body: aiohttp sees a clean end, the body is no JSON, and the proxy said
    x-should-retry: false though the next try may come whole."""
    body = dumps(chat_body())

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
        writer.write(body[: len(body) // 2])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        proxy = await proxy_before(make_proxy, f"http://127.0.0.1:{port}/v1")
        import aiohttp

        from tests.test_bad_input import auth

        async with aiohttp.ClientSession() as session:
            async with session.post(
                proxy.url + "/v1/chat/completions",
                json={
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 50,
                },
                headers=auth(),
            ) as resp:
                await resp.read()
                status, retry = resp.status, resp.headers.get("x-should-retry")
        assert status == 502
        assert retry != "false", "a body cut short is marked never to retry"
    finally:
        server.close()
        await server.wait_closed()


async def test_control_json_labelled_answer_bills_the_searches(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The counterpart: the same body labelled application/json bills web_search=2."""
    entry = await _responses_searches(make_proxy, script, redis_client, "application/json")
    assert entry.get("tool_calls") == "web_search=2", entry


async def test_a_stream_with_events_is_not_billed_on_a_trailing_json_blob(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Only a body that held no event is read so: a real stream (content, finish_reason stop)
    followed by a JSON object without a blank line was billed on that object's usage (900/900
    against a 50-token cap)."""
    proxy = await proxy_before(make_proxy, script.base_url)
    event = (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
    )
    trail = dumps(chat_body(usage={"prompt_tokens": 900, "completion_tokens": 900, "total_tokens": 1800}))
    reply = await answer(
        proxy, script, redis_client, 200, event + trail, stream=True, content_type="text/event-stream"
    )
    (entry,) = reply.new_entries
    assert entry["outcome"] == "upstream_error", entry
    assert (entry["usage_source"], entry["output_tokens"]) != ("provider", "900"), entry


@pytest.mark.parametrize("stream", [False, True], ids=["json-call", "stream-call-answered-json"])
async def test_a_json_answer_is_not_held_twice_as_chunks_and_their_join_when_parsed(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """The body was read into a list of pieces that stayed beside their join in
    ``relay_body``'s frame through the parse and the settle: an 8 MiB answer held 16.2 MB when
    its parse began (and a third time once parsed). A stream call whose provider ignored
    ``stream`` and answered JSON takes the same path."""
    import proxy.relay_body as relay_body_module

    n = 8 * MB
    body = dumps(chat_body("x" * n))
    script.plan = Plan(chunks=split(body))
    proxy = await proxy_before(make_proxy, script.base_url)
    path, request = CHAT
    data = dumps({**request, "stream": stream})
    reply, alive = await alive_when_awaited(
        monkeypatch,
        relay_body_module,
        "parse_json",
        lambda: send(proxy, lambda: script.received, redis_client, path, data),
    )
    assert reply.status == 200 and len(reply.body) == len(body), reply.status
    assert alive < 1.5 * n, f"{alive / MB:.1f} MB alive for an {n // MB} MB answer when it is parsed"
