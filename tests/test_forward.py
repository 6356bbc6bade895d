"""Forwarding: the stall guard of streams (only the upstream's silence while the relay waits
counts), and a request that cannot go out."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from pydantic import SecretStr

from proxy.app import build_app
from proxy.config_load import parse_config
from proxy.forward import StallGuard
from proxy.redis_server import RedisServerProcess
from proxy.tokenizer import Tokenizer
from tests.conftest import KEY_A, UPSTREAM_KEY, base_config, unreachable_port
from tests.fake_upstream import FakeUpstream


class Content:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def set_exception(self, exc: BaseException) -> None:
        self.errors.append(exc)


def response() -> Any:
    return SimpleNamespace(connection=None, content=Content())


async def test_a_wait_longer_than_the_timeout_fails_the_read() -> None:
    upstream = response()
    guard = StallGuard(cast(aiohttp.ClientResponse, upstream), 0.2)
    guard.waiting_since = time.monotonic()
    await asyncio.sleep(0.35)
    (error,) = upstream.content.errors
    assert isinstance(error, TimeoutError)
    guard.cancel()


async def test_time_spent_elsewhere_does_not_count() -> None:
    # A short wait overslept on a loaded machine must stay under the timeout: a wide margin.
    upstream = response()
    guard = StallGuard(cast(aiohttp.ClientResponse, upstream), 0.6)
    await asyncio.sleep(0.8)  # not waiting on the upstream (writing to the client, say)
    for _ in range(4):  # short waits, each well under the timeout
        guard.waiting_since = time.monotonic()
        await asyncio.sleep(0.1)
        guard.waiting_since = None
    assert upstream.content.errors == []
    guard.waiting_since = time.monotonic()
    await asyncio.sleep(1.2)
    assert len(upstream.content.errors) == 1
    guard.cancel()


@pytest.mark.skewed_loop_clock
async def test_the_guard_fails_a_stall_on_a_loop_whose_clock_is_not_monotonics() -> None:
    # It re-armed with call_at(a time.monotonic() instant): on a loop 1000 s behind, never again.
    await test_time_spent_elsewhere_does_not_count()


async def test_a_request_aiohttp_refuses_to_send_is_not_billed(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A header value aiohttp cannot send (a key with a line break, as a secrets file gives it,
    before the config stripped it): nothing went out, so nothing is billed. It was a 500 billed
    at its reserve."""
    raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "j"))
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    broken = config.upstreams["openai"].model_copy(update={"api_key": SecretStr("sk-one\nsk-two")})
    config = config.model_copy(update={"upstreams": {"openai": broken}})
    runner = web.AppRunner(build_app(config, tokenizer=Tokenizer({}), run_reaper_task=False))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=body, headers={"Authorization": f"Bearer {KEY_A}"}) as resp:
                assert resp.status == 502, await resp.text()
    finally:
        await runner.cleanup()
    assert fake.received == []
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert (entry["usage_source"], entry["total_tokens"], entry["outcome"]) == ("none", "0", "upstream_error")


@pytest.mark.parametrize(
    ("stream", "timeout_s", "connect_timeout_s"),
    # A stream's bound on its headers fired in the connect when timeout_s was below it.
    [(False, 3, 0.3), (True, 0.5, 1.5)],
    ids=["json", "stream-timeout-below-connect"],
)
async def test_a_connect_timeout_is_billed_nothing_for_nothing_went_out(
    make_proxy: Any, redis_client: aioredis.Redis, stream: bool, timeout_s: float, connect_timeout_s: float
) -> None:
    # Was billed at the reserve (1,009 tokens) as a call that may have run: the connection was
    # never made, so the request never left.
    from tests.test_bad_input import dumps, send

    with unreachable_port("connect_timeout") as port:
        upstream = {
            "base_url": f"http://127.0.0.1:{port}/v1",
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": timeout_s,
            "connect_timeout_s": connect_timeout_s,
        }
        proxy = await make_proxy(upstreams={"openai": upstream})
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        reply = await send(proxy, lambda: [], redis_client, "/v1/chat/completions", dumps(body))
    (entry,) = reply.new_entries
    assert reply.status == 504 and entry["outcome"] == "upstream_timeout"
    assert (entry["usage_source"], entry["input_tokens"], entry["output_tokens"]) == ("none", "0", "0")
