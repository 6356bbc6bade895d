"""A stream's lease renewals (proxy/lease.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, ProxyFactory, until_upstream_received
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import GOOD_BODY, Plan, ScriptedUpstream


def _stream(**fake: Any) -> dict[str, Any]:
    """A stream call of 30 output tokens, the fake upstream told ``fake`` beside them."""
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 30,
        "fake": {"reply_tokens": 30, **fake},
    }


@pytest.mark.skewed_loop_clock
async def test_a_stream_renews_its_lease_on_a_loop_whose_clock_is_not_monotonics(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Renewals were timed with call_at(a time.monotonic() instant): on a loop whose clock is
    behind it, none came, the lease ran out mid-stream and the reaper billed the call at its
    reserve."""
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": fake.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 1}},
        redis={"socket_timeout_s": 0.9},  # below two thirds of the lease
        limits={"lease_margin_s": 0.5, "reaper_interval_s": 0.1, "reap_grace_s": 0},  # lease 1.5 s
    )
    body = _stream(chunk_delay_s=0.1)  # about 3 s: two lease lengths
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        )
        await until_upstream_received(fake, 1)
        text = await resp.read()
    assert text.endswith(b"data: [DONE]\n\n")
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "30")


async def test_a_stream_call_answered_by_a_slow_json_body_keeps_its_lease(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A ``stream: true`` call the upstream answers with one JSON body (a server that ignores
    ``stream``, a gateway's error page) that comes slowly, each piece within ``timeout_s``: a
    stream's timeout bounds only silence, so the body may take as long as it takes, but nothing
    renews the call's lease while it comes (only the event-stream relay does). A live reaper
    then bills the healthy call at its reserve as ``lease_expired``, the provider's usage is
    thrown away, and the client is told its call's lease expired."""
    proxy = await make_proxy(
        upstreams={
            "openai": {
                "base_url": script.base_url,
                "api_key_env": "TEST_UPSTREAM_KEY",
                "timeout_s": 1,
                "connect_timeout_s": 1,
            }
        },
        redis={"socket_timeout_s": 0.9},  # below two thirds of the lease
        limits={"lease_margin_s": 0.5, "reaper_interval_s": 0.1},
    )
    # 12 pieces 0.3 s apart: 3.3 s in all, never 1 s of silence; the lease is 1.5 s.
    step = len(GOOD_BODY) // 12 + 1
    script.plan = Plan(chunks=[GOOD_BODY[i : i + step] for i in range(0, len(GOOD_BODY), step)], delay_s=0.3)
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "stream": True,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "slow-json"},
        ) as resp:
            assert resp.status == 200
            await resp.read()
            outcome = resp.headers.get("x-billing-outcome")
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry
    assert entry["output_tokens"] == "1" and outcome == "ok"
    assert await redis_client.zcard("lbp:{team-a}:leases") == 0
    run = await redis_client.hgetall("lbp:{team-a}:run:slow-json")
    assert run["resv:total_tokens"] == "0" and run["resv:concurrent"] == "0"


class SlowDoor:
    """A loopback port whose connections go through only after a while: its accept queue is
    full, so the kernel leaves a client's handshake unfinished (it tries again 1 s later, then 2 s
    after that); ``open`` empties the queue, and each connection from then on is piped to
    ``port``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.listener.setblocking(False)
        self.fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(self.listener.getsockname())
            self.fillers.append(filler)
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.pipes: set[asyncio.Task[None]] = set()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"

    async def open(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.listener.accept()[0].close()
        self.server = await asyncio.start_server(self._pipe, sock=self.listener)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pipes.add(asyncio.current_task())  # type: ignore[arg-type]
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [writer, up_writer]

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer), return_exceptions=True)

    async def close(self) -> None:
        """Closed, its pipes ended (each reads the end of its connections)."""
        if self.server is not None:
            self.server.close()
            for writer in self.writers:
                writer.close()
            await asyncio.gather(*self.pipes)
        for sock in (*self.fillers, self.listener):
            sock.close()


async def test_a_stream_whose_connection_outlasts_its_lease_keeps_it(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A stream's headers may take its connection's time (up to ``connect_timeout_s``: a name
    to resolve, a TCP or TLS handshake) and ``timeout_s`` more, where its lease covers
    ``timeout_s`` and ``limits.lease_margin_s``, and it was renewed only once the stream had
    started: a connection slower than the margin let a reaper bill the live call at its reserve
    (``lease_expired``), and the provider's usage was thrown away."""
    door = SlowDoor(fake.port)
    try:
        upstream = {"base_url": door.base_url, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 1}
        proxy = await make_proxy(
            upstreams={"openai": {**upstream, "connect_timeout_s": 10}},
            redis={"socket_timeout_s": 0.9},  # below two thirds of the lease
            limits={"lease_margin_s": 0.5, "reaper_interval_s": 0.1, "reap_grace_s": 0},  # lease 1.5 s
        )
        body = _stream()
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {KEY_A}"}
            url = proxy.url + "/v1/chat/completions"
            call = asyncio.ensure_future(session.post(url, json=body, headers=headers))
            await asyncio.sleep(2)  # past the lease (and a reaper's round after it)
            assert not fake.received
            await door.open()
            resp = await call
            text = await resp.read()
        assert text.endswith(b"data: [DONE]\n\n")
        ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
        assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "30")
        assert await redis_client.zcard("lbp:{team-a}:leases") == 0
    finally:
        await door.close()
