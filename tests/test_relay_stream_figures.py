"""What a streaming answer carries besides its events' bytes: each test kills a mutant of
``proxy/relay_stream.py`` the suite let live (its headers, the proxy's overhead that must not
count the upstream's time, the lease renewal's end, a key cut across reads, a rejection's code)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from proxy.state import STATE
from tests.conftest import UPSTREAM_KEY, ProxyFactory, digest
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MODEL, MSGS, data_chunks, parse_sse, raw_post, the_entry
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, scripted_upstreams, send
from tests.test_metrics import ADMIN, scrape, total
from tests.test_outcomes_stream import REJECT_ALL, raw_stream
from tests.test_stream_dialects import CHAT, CONTENT, FINISH, USAGE, CutAfterTheEnd, chunk, proxy_for

CHAT_PATH = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


WHOLE = [sse(CONTENT), sse(FINISH), sse(USAGE), DONE]


async def test_a_stream_is_uncached_and_keeps_an_http11_connection_open(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A proxy or CDN in front may cache (or buffer) an event stream without ``no-cache``; and
    an HTTP/1.1 client's stream has chunked framing: closing its connection (as HTTP/1.0's
    must) costs every SDK call a new connection."""
    proxy = await proxy_for(make_proxy, script)
    script.plan = Plan(content_type="text/event-stream", chunks=WHOLE)
    reply = await send(proxy, lambda: script.received, redis_client, CHAT_PATH, dumps(CHAT))
    assert reply.status == 200, reply.describe()
    assert reply.headers["Content-Type"] == "text/event-stream", reply.headers
    assert reply.headers.get("Cache-Control") == "no-cache", reply.headers
    assert reply.headers.get("Transfer-Encoding") == "chunked", reply.headers
    assert "close" not in reply.headers.get("Connection", "").lower(), reply.headers
    assert reply.body.endswith(DONE), reply.body[-200:]


async def test_the_proxys_overhead_does_not_count_the_upstreams_silences_mid_stream(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """``llm_proxy_proxy_overhead_seconds`` is the call's time less the upstream's: the waits
    between a stream's events are the upstream's. Counted as the proxy's, an operator reads a
    slow provider as a slow proxy."""
    proxy = await proxy_for(make_proxy, script, admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}])
    # 1.5 s of the upstream's silences, between events: far above any overhead of one call.
    script.plan = Plan(content_type="text/event-stream", chunks=WHOLE, delay_s=0.5)
    reply = await send(proxy, lambda: script.received, redis_client, CHAT_PATH, dumps(CHAT))
    assert reply.body.endswith(DONE), reply.body[-200:]
    await proxy.recorded()
    values = await scrape(proxy)
    assert total(values, "llm_proxy_proxy_overhead_seconds_count") == 1, values
    assert total(values, "llm_proxy_proxy_overhead_seconds_sum") < 0.75, values


async def scripts_run(redis_client: aioredis.Redis) -> int:
    """How many scripts the server has run (every store call of the proxy is one)."""
    stats = await redis_client.info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


async def test_a_streams_lease_is_no_longer_renewed_once_it_ended(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The renewal of a stream's lease stops with the stream: left running, every stream the
    proxy ever relayed goes on calling the store every third of its lease, for ever."""
    upstream = {**scripted_upstreams(script.base_url)["openai"], "timeout_s": 0.6}
    # A lease of 0.9 s, renewed every 0.3 s; no reaper runs while the test watches the store.
    proxy = await make_proxy(
        redis={"socket_timeout_s": 0.5},  # below two thirds of the lease
        upstreams={"openai": upstream},
        limits={"lease_margin_s": 0.3, "reaper_interval_s": 3600},
    )
    script.plan = Plan(content_type="text/event-stream", chunks=WHOLE)
    reply = await send(proxy, lambda: script.received, redis_client, CHAT_PATH, dumps(CHAT))
    assert reply.body.endswith(DONE), reply.body[-200:]
    assert [e["outcome"] for e in reply.new_entries] == ["ok"], reply.new_entries
    await proxy.recorded()
    before = await scripts_run(redis_client)
    await asyncio.sleep(1.0)  # three renewals' time
    assert await scripts_run(redis_client) == before


async def test_the_upstream_key_echoed_in_a_stream_is_redacted_even_cut_across_two_reads(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A provider (or a model told to) may echo the key it was called with: the client must
    never read it, not even when the upstream's reads cut it in two (whole events are
    scrubbed, never the bytes of one read)."""
    proxy = await proxy_for(make_proxy, script)
    echoed = sse(
        chunk([{"index": 0, "delta": {"content": f"your key is {UPSTREAM_KEY}."}, "finish_reason": None}])
    )
    cut = echoed.index(UPSTREAM_KEY.encode()) + len(UPSTREAM_KEY) // 2
    script.plan = Plan(
        content_type="text/event-stream",
        chunks=[echoed[:cut], echoed[cut:], sse(FINISH), sse(USAGE), DONE],
        delay_s=0.05,  # each its own read of the proxy's
    )
    reply = await send(proxy, lambda: script.received, redis_client, CHAT_PATH, dumps(CHAT))
    assert UPSTREAM_KEY.encode() not in reply.body, reply.body
    contents = [
        c["choices"][0]["delta"].get("content") for c in data_chunks(parse_sse(reply.body)) if c["choices"]
    ]
    assert contents[0] == "your key is [REDACTED].", contents
    assert reply.body.endswith(DONE), reply.body[-200:]
    assert [e["outcome"] for e in reply.new_entries] == ["ok"], reply.new_entries


async def test_a_rejected_streams_error_event_carries_the_same_type_and_code_as_a_rejected_answer(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """An SDK (and the operator's alerting) tells a rejection by ``error.code``: the stream's
    error event says ``output_rejected`` there, as the answer of a call without stream does."""
    proxy = await make_proxy(policy=REJECT_ALL)
    streamed = await raw_stream(proxy, "streamed", {"mode": "truncate"})
    whole = await raw_post(proxy, {"model": MODEL, "messages": MSGS, "fake": {"mode": "truncate"}}, "whole")
    last = parse_sse(streamed.body)[-1]
    assert last.event == "error", streamed.body[-300:]
    got = last.json()["error"]
    expected = whole.json()["error"]
    assert (
        (got["type"], got["code"])
        == (expected["type"], expected["code"])
        == ("output_rejected", "output_rejected")
    )
    assert (await the_entry(proxy, "streamed"))["outcome"] == "rejected:output-truncated"


class BrokenAfterDone(CutAfterTheEnd):
    """Breaks the connection while the proxy waits in its drain after [DONE]."""

    linger_s = 0.2


async def test_a_body_broken_after_done_is_the_upstreams_time_not_the_proxys(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """The wait after [DONE] for the body's end is the upstream's time even when the body
    breaks instead of ending: the answer was whole (``ok``), and the 0.2 s before the break are
    not the proxy's overhead."""
    upstream = BrokenAfterDone()
    await upstream.start()
    try:
        proxy = await proxy_for(make_proxy, upstream)
        upstream.plan = Plan(content_type="text/event-stream", chunks=WHOLE)
        for _ in range(3):
            reply = await send(proxy, lambda: upstream.received, redis_client, CHAT_PATH, dumps(CHAT))
            assert reply.body.endswith(DONE), reply.body[-200:]
            assert [e["outcome"] for e in reply.new_entries] == ["ok"], reply.new_entries
        await proxy.recorded()
        overhead = proxy.app[STATE].metrics.overhead.labels()
        assert sum(overhead.counts) == 3, overhead.counts
        # Counted as the proxy's, every call's overhead is 0.2 s at least: a loaded machine may
        # slow one call past 0.1 s of the proxy's own time, hardly all three.
        assert sum(overhead.counts[: overhead.bounds.index(0.1) + 1]), overhead.counts
    finally:
        await upstream.close()
