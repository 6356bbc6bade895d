"""The billing views (GET /v1/billing/...): a run's meters with the refusals the store counts; a
run's ledger written a page at a time."""

from __future__ import annotations

import asyncio
import json
import logging
import tracemalloc
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from proxy.redis_server import RedisServerProcess
from tests.conftest import KEY_A, Proxy, ProxyFactory, digest, refused_port
from tests.fake_upstream import FakeUpstream
from tests.test_cli import LEDGER_ENTRY
from tests.test_metrics import ADMIN, scrape, total
from tests.test_redis_store import _old_and_recent_entries

MSGS: list[Any] = [{"role": "user", "content": "hi"}]


async def _run_view(url: str, run: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/v1/billing/runs/{run}", headers={"Authorization": f"Bearer {KEY_A}"}) as resp,
    ):
        return resp.status, await resp.json()


async def test_a_run_refused_from_its_first_call_is_a_run_not_no_such_run(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """reserve.lua writes the run's key with the refusal it counts; the view found a run by what
    it used or held only, and answered "No run 'R' for this tenant." (404) right after a 429 that
    named scope 'run'."""
    proxy = await make_proxy(tiers={"standard": {"run": {"total_tokens": 10}}})
    with pytest.raises(openai.RateLimitError) as refused:
        await proxy.client().chat.completions.create(
            model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Run-Id": "R"}
        )
    assert refused.value.response.headers["x-billing-refused-scope"] == "run"
    assert await redis_client.hgetall("lbp:{team-a}:run:R") == {"refused:total_tokens": "1"}
    status, body = await _run_view(proxy.url, "R")
    assert status == 200, body
    assert body["meters"]["total_tokens"] == {"used": 0, "reserved": 0, "ceiling": 10, "refused": 1}
    assert body["meters"]["requests"]["refused"] == 0


async def test_the_run_view_reports_the_refusals_the_store_and_metrics_count(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Every refusal is counted in the refusing scope's hash (``refused:<meter>``) and in
    ``llm_proxy_budget_refusals_total``; the run view showed used / reserved / ceiling only."""
    proxy = await make_proxy(
        tiers={"standard": {"run": {"requests": 1}}},
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}],
    )
    client = proxy.client()
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Run-Id": "T"})
    for _ in range(3):
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(
                model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Run-Id": "T"}
            )
    await proxy.recorded()
    stored = await redis_client.hget("lbp:{team-a}:run:T", "refused:requests")
    metric = total(await scrape(proxy), "llm_proxy_budget_refusals_total", scope="run", meter="requests")
    assert stored == "3" and metric == 3
    status, body = await _run_view(proxy.url, "T")
    assert status == 200
    assert body["meters"]["requests"] == {"used": 1, "reserved": 0, "ceiling": 1, "refused": 3}
    assert all(view["refused"] == 0 for meter, view in body["meters"].items() if meter != "requests")


async def _long_run(client: aioredis.Redis, run: str, entries: int) -> None:
    """``entries`` ledger entries of team-a's run ``run``, as settle.lua writes them."""
    for start in range(0, entries, 1000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + 1000, entries)):
            pipe.xadd("lbp:{team-a}:ledger", {**LEDGER_ENTRY, "run_id": run, "request_id": f"req_{i:032d}"})
        ids = await pipe.execute()
        await client.rpush(f"lbp:{{team-a}}:runlog:{run}", *ids)


def _ledger_view(session: aiohttp.ClientSession, url: str, run: str) -> Any:
    return session.get(f"{url}/v1/billing/runs/{run}/ledger", headers={"Authorization": f"Bearer {KEY_A}"})


async def _raw(proxy: Proxy, request: str) -> bytes:
    """What the proxy answers ``request``, sent as it is, read until it closes the connection."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request.encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


async def _peak_of_view(url: str, run: str) -> tuple[int, int]:
    """The peak of memory allocated while the run's ledger view is answered (the proxy runs in
    this process), its body read and dropped chunk by chunk; and the entries the body held."""
    tracemalloc.start()
    try:
        async with (
            aiohttp.ClientSession() as session,
            _ledger_view(session, url, run) as resp,
        ):
            assert resp.status == 200
            count, tail = 0, b""
            async for chunk in resp.content.iter_chunked(64 * 1024):
                seen = tail + chunk
                count += seen.count(b'"request_id"')
                tail = seen[-(len(b'"request_id"') - 1) :]
        return tracemalloc.get_traced_memory()[1], count
    finally:
        tracemalloc.stop()


async def test_a_long_runs_ledger_view_holds_one_page_not_every_entry(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """The README's exports are read and written 1,000 entries at a time, never every entry in
    memory at once; the run's ledger view built every entry of the run, then their whole JSON, in
    the proxy's memory: about 4 KB an entry, so a run of millions of entries (calls the provider
    refused cost nothing) took gigabytes of the process every tenant's calls go through, on each
    read of it."""
    proxy = await make_proxy()
    await _long_run(redis_client, "short", 1000)
    await _long_run(redis_client, "long", 8000)
    small, small_count = await _peak_of_view(proxy.url, "short")
    large, large_count = await _peak_of_view(proxy.url, "long")
    assert (small_count, large_count) == (1000, 8000)
    assert large < 2 * small, (small, large)


async def test_a_long_runs_ledger_view_is_the_json_it_was_with_every_entry_in_order(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy()
    await _long_run(redis_client, "paged", 2345)
    async with (
        aiohttp.ClientSession() as session,
        _ledger_view(session, proxy.url, "paged") as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        assert resp.headers["x-request-id"]
        body = await resp.json()
    assert body["object"] == "list" and body["run_id"] == "paged"
    assert [e["request_id"] for e in body["data"]] == [f"req_{i:032d}" for i in range(2345)]
    ids = [i for i, _ in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert [e["id"] for e in body["data"]] == ids


async def test_a_runs_ledger_view_skips_the_entries_the_retention_trimmed(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """limits.ledger_retention_s trims a tenant's ledger at each settle; the run's index still
    names the entries trimmed: the view answers 200 with the rest, in order."""
    proxy = await make_proxy(limits={"ledger_retention_s": 86400})
    old, recent = await _old_and_recent_entries(redis_client, "trimmed")
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Run-Id": "trimmed"}
    )
    ledger = [i for i, _ in await redis_client.xrange("lbp:{team-a}:ledger")]
    assert len(set(ledger) & set(old)) < 100  # whole stream nodes trimmed
    async with (
        aiohttp.ClientSession() as session,
        _ledger_view(session, proxy.url, "trimmed") as resp,
    ):
        assert resp.status == 200
        body = await resp.json()
    assert [e["id"] for e in body["data"]] == ledger
    assert [e["id"] for e in body["data"]][-11:-1] == recent
    assert body["data"][-1]["run_id"] == "trimmed"


async def test_a_store_lost_while_a_long_run_is_written_cuts_the_body(
    make_proxy: ProxyFactory, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """Written page by page, the view has sent its status before the store fails: the client
    must see the body end early (an error), never a list that parses as the whole run."""
    proxy = await make_proxy(redis={"url": own_redis.url})
    await _long_run(own_client, "cut", 20000)
    got = b""
    async with (
        aiohttp.ClientSession() as session,
        _ledger_view(session, proxy.url, "cut") as resp,
    ):
        assert resp.status == 200
        got += await resp.content.read(1024)
        await asyncio.to_thread(own_redis.stop)
        with pytest.raises(aiohttp.ClientPayloadError):
            while chunk := await resp.content.read(64 * 1024):
                got += chunk
    with pytest.raises(ValueError):
        json.loads(got)


async def test_the_ledger_view_answers_an_http_1_0_client(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy()
    await _long_run(redis_client, "old-client", 3)
    ask = f"GET /v1/billing/runs/old-client/ledger HTTP/1.0\r\nAuthorization: Bearer {KEY_A}\r\n\r\n"
    data = await _raw(proxy, ask)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    assert len(json.loads(body)["data"]) == 3


async def test_a_head_of_the_ledger_view_sends_no_body(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """The next answer on the connection must start where the HEAD's headers end."""
    proxy = await make_proxy()
    await _long_run(redis_client, "headed", 2)
    ask = f"/v1/billing/runs/headed/ledger HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
    data = await _raw(proxy, f"HEAD {ask}\r\nGET {ask}Connection: close\r\n\r\n")
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert rest.startswith(b"HTTP/1.1 200"), rest[:200]


async def test_a_client_leaving_a_long_run_ledger_midway_is_no_unhandled_error(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader that stops early (``curl ... | head``, a client's timeout) is what the CLI's own
    ``ledger | head`` now ends quietly for; the paged view's next write failed inside its
    handler, and the error middleware logged it as an unhandled error, with its traceback, on
    every such read (the whole body, written by aiohttp after the handler, never was)."""
    proxy = await make_proxy()
    await _long_run(redis_client, "left", 6000)
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    ask = f"GET /v1/billing/runs/left/ledger HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n"
    writer.write(ask.encode())
    assert (await reader.read(1024)).startswith(b"HTTP/1.1 200")
    writer.transport.abort()  # the reader leaves
    for _ in range(100):
        await asyncio.sleep(0.02)
        if any(r.getMessage() == "unhandled error" for r in caplog.records):
            break
    await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


async def test_the_views_and_health_answers_carry_the_proxys_request_id(proxy: Proxy) -> None:
    # README: x-request-id "on every answer": these answers set none of their own; the error
    # middleware adds it to each one not yet sent (a stream's went out with its headers).
    paths = ("/v1/billing/keys/self", "/v1/billing/runs/none-yet", "/healthz", "/readyz", "/v1/models")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY_A}"}) as session:
        for path in paths:
            async with session.get(proxy.url + path) as resp:
                assert resp.headers.get("x-request-id", "").startswith("req_"), (path, resp.status)


async def test_a_view_while_the_store_is_unreachable_is_a_503_in_openais_format(
    make_proxy: ProxyFactory,
) -> None:
    # A read the store cannot serve is the store's outage (the SDK retries a 503), not a 500
    # "internal proxy error" with a stack trace in the operator's log for each poll.
    proxy = await make_proxy(redis={"url": f"redis://127.0.0.1:{refused_port()}/0", "socket_timeout_s": 0.5})
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY_A}"}) as session,
        session.get(proxy.url + "/v1/billing/keys/self") as resp,
    ):
        assert resp.status == 503, await resp.text()
        error = (await resp.json())["error"]
        assert error["code"] == "store_unavailable"
        # A read: nothing was to be forwarded (it said "the call was not forwarded").
        assert error["message"] == "The billing store is unavailable; nothing could be read from it."


async def test_an_admin_key_on_a_billing_view_is_told_what_it_reads(make_proxy: ProxyFactory) -> None:
    """The admin key was refused on the billing views as "Incorrect API key provided.", though
    it was right: only not a tenant's (the operator walkthrough)."""
    proxy = await make_proxy(admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}])
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as session,
        session.get(proxy.url + "/v1/billing/keys/self") as resp,
    ):
        assert resp.status == 401
        message = (await resp.json())["error"]["message"]
    assert message.startswith("An admin key reads /metrics only"), message
