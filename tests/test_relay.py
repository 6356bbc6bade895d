"""The exchange's settle (proxy/relay.py): the answer goes out before the call is recorded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Awaitable
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from proxy import billed_usage, relay
from proxy.errors import StoreError
from proxy.journal import Unsynced
from proxy.logs import TRUSTED_FIELDS
from proxy.outcome import Outcome
from proxy.redis_scripts import read_scripts
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from proxy.tokenizer import Tokenizer
from tests.conftest import (
    KEY_A,
    Proxy,
    ProxyFactory,
    refused_port,
    until_redis_busy,
    until_upstream_received,
    upstream_timing_out,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MODEL, PROMPT, run_headers, the_entry, upstream_override

T = TypeVar("T")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_goes_out_before_the_call_is_recorded(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The metrics and the call's log line are not the client's to wait for: the settle's figures
    go out with the answer (headers, or the billing event before [DONE]) and the record follows.
    Seen from the client's socket: when the call is recorded, the whole answer is there."""
    proxy = await make_proxy()
    host, port = proxy.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    seen: list[bytes] = []
    record_call = relay.record_call

    def noting(*args: Any, **kwargs: Any) -> None:
        try:
            seen.append(sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            seen.append(b"")
        record_call(*args, **kwargs)

    monkeypatch.setattr("proxy.relay.record_call", noting)
    body = orjson.dumps(
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        for _ in range(500):
            if seen:
                break
            await asyncio.sleep(0.01)
        (answer,) = seen
    finally:
        sock.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    if stream:
        assert b": billing " in payload and payload.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    else:
        length = int(head.lower().partition(b"content-length: ")[2].split(b"\r\n")[0])
        assert len(payload) == length and orjson.loads(payload)["usage"]["completion_tokens"] > 0
    assert len(fake.bill) == 1
    registry = proxy.app[STATE].metrics.registry
    assert (
        registry.get_sample_value(
            "llm_proxy_requests_total",
            {"tenant": "team-a", "model": "gpt-4o-mini", "endpoint": "chat.completions", "outcome": "ok"},
        )
        == 1
    )  # recorded all the same


async def test_a_settle_that_fails_after_its_handler_was_cancelled_is_reported_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Shutdown past its grace period cancels a handler waiting on its settle; when the settle
    then fails (neither settled nor journaled: the reaper bills it), the failure is logged once,
    not also as an exception nobody retrieved (a review)."""

    async def failing(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.05)
        raise RuntimeError("the settle failed")

    monkeypatch.setattr("proxy.relay.settle", failing)
    ex = relay.Exchange.__new__(relay.Exchange)
    ex.call = SimpleNamespace(  # type: ignore[assignment]
        first_token_at=None,
        served_tier=None,
        request_id="req-1",
        started_at=0.0,
        refining=None,
        endpoint="embeddings",  # no context the provider keeps
    )
    ex.obs = SimpleNamespace(first_token_at=None, service_tier=None, tier_told=None, finish_reasons={})  # type: ignore[assignment]
    limits = SimpleNamespace(settled_marker_ttl_s=60)
    ex.services = SimpleNamespace(  # type: ignore[assignment]
        settling=set(), store=None, journal=None, config=SimpleNamespace(limits=limits)
    )
    ex._settling = ex._settlement = ex.keeping = None
    ex.streamed = False
    ex.upstream_s = 0.0
    handler = asyncio.ensure_future(ex.settle(Outcome("ok"), SimpleNamespace(source="provider")))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    (task,) = ex.services.settling
    settlement = ex._settlement
    await asyncio.wait({task})
    await asyncio.sleep(0)
    assert settlement is not None and settlement.done()
    # asyncio's own flag for an exception nobody read, which it logs when the future is collected.
    assert not settlement._log_traceback  # type: ignore[attr-defined]
    assert isinstance(settlement.exception(), RuntimeError)
    # Once, for the operator: the reservation now waits for a reaper.
    failed = [r for r in caplog.records if r.getMessage() == "settle or its record failed"]
    assert [(r.levelname, getattr(r, "request_id", None)) for r in failed] == [("ERROR", "req-1")]


# Holds a Redis this long and says when it let go (the store's clock is the machine's).
HOLD_S = 3
HOLDING = (
    "local function now() local t = redis.call('TIME') return t[1] * 1e6 + t[2] end "
    f"local t0 = now() while now() - t0 < {HOLD_S} * 1e6 do end return redis.call('TIME')"
)
# The fake upstream answers no sooner than this after it has the call (past half a 2.9 s lease).
UPSTREAM_DELAY_S = 1.5


async def _answered_while_the_store_was_held(
    store: RedisServerProcess, fake: FakeUpstream, call: Awaitable[T]
) -> tuple[bool, T]:
    """Send ``call`` (which asks the fake to hold its answer), hold the store once the upstream has
    it (reserved), release the answer once the store is held and UPSTREAM_DELAY_S have passed,
    and say whether the answer came while the store was held: an order, not a duration. Its
    settle is sent to the held store."""
    blocker = aioredis.Redis.from_url(store.url)
    loop = asyncio.get_running_loop()
    try:
        received = len(fake.received)
        asked = asyncio.ensure_future(call)
        await until_upstream_received(fake, received + 1)
        due = loop.time() + UPSTREAM_DELAY_S
        hold = asyncio.ensure_future(blocker.eval(HOLDING, 0))
        assert store.port is not None
        # Answered only once the store is held: after a fixed delay it could come first on a
        # loaded machine. The delay stays a floor (the lease's age at the answer).
        await until_redis_busy(store.port)
        await asyncio.sleep(max(0.0, due - loop.time()))
        fake.release()
        answer = await asked
        answered_at = time.time()
        seconds, micros = await hold
    finally:
        await blocker.aclose()
    return answered_at < int(seconds) + int(micros) / 1e6, answer


async def _held_chat(proxy: Proxy, store: RedisServerProcess, fake: FakeUpstream) -> tuple[bool, Any]:
    """A first call (the tenant registered, the scripts run on the proxy's connection), then a
    chat call in run "held", answered while the store is held: whether it came before the store
    let go, and its raw answer."""
    client = proxy.client()
    await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    return await _answered_while_the_store_was_held(
        store,
        fake,
        client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "hello there"}],
            extra_headers={"X-Run-Id": "held"},
            extra_body={"fake": {"hold": True}},
        ),
    )


async def _ledger(client: aioredis.Redis, tenant: str, count: int) -> list[dict[str, str]]:
    """The tenant's ledger once it holds ``count`` entries: settles sent early land a little later."""
    for _ in range(500):
        entries = await client.xrange(f"lbp:{{{tenant}}}:ledger")
        if len(entries) >= count:
            return [fields for _, fields in entries]
        await asyncio.sleep(0.01)
    raise AssertionError(f"the ledger has {len(entries)} entries, not {count}")


async def test_a_whole_answer_does_not_wait_for_the_store_to_answer_its_settle(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """A non-streaming answer goes out once its settle is on its way to the store, not once the
    store has run it: the round trip and the script are not the client's to wait for. What its
    headers say is what the store then writes."""
    proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 10})
    early, raw = await _held_chat(proxy, own_redis, fake)
    assert early, "the answer waited for the store"
    assert raw.status_code == 200
    (entry,) = [e for e in await _ledger(own_client, "team-a", 2) if e["run_id"] == "held"]
    assert raw.headers["x-billing-outcome"] == entry["outcome"] == "ok"
    assert raw.headers["x-billing-input-tokens"] == entry["input_tokens"] == str(fake.bill[-1].prompt_tokens)
    assert raw.headers["x-billing-output-tokens"] == entry["output_tokens"]
    assert raw.headers["x-billing-cost-micros"] == entry["cost_micros"]
    assert raw.headers["x-billing-usage-source"] == entry["usage_source"] == "provider"
    meters = await own_client.hgetall("lbp:{team-a}:run:held")
    assert meters["used:requests"] == "1" and meters["resv:concurrent"] == "0"
    assert await own_client.zcard("lbp:{team-a}:leases") == 0


async def test_an_answer_whose_lease_is_old_waits_for_its_settle(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess
) -> None:
    """Past half its lease a reaper may be billing the call (its headers would then say
    lease_expired, at the reserve): the answer waits for what the store says."""
    proxy = await make_proxy(
        # The settle waits out the rest of the hold (HOLD_S - UPSTREAM_DELAY_S) within the socket
        # timeout, which stays below two thirds of the lease.
        redis={"url": own_redis.url, "socket_timeout_s": 1.9},
        upstreams=upstream_timing_out(fake.base_url, 2),  # lease 2.9 s: half gone at the answer
        limits={"lease_margin_s": 0.9, "reaper_interval_s": 60},
    )
    early, raw = await _held_chat(proxy, own_redis, fake)
    assert not early, "the answer did not wait for its settle"
    assert raw.status_code == 200 and raw.headers["x-billing-outcome"] == "ok"


async def test_an_answer_whose_context_is_kept_waits_for_its_settle(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess
) -> None:
    """A stored Responses answer's size is written with its settle, for the next call that
    continues it (sent once this answer is in): that answer waits for both."""
    proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 10})
    client = proxy.client()
    await client.responses.create(model="gpt-4o-mini", input="hi")
    early, raw = await _answered_while_the_store_was_held(
        own_redis,
        fake,
        client.responses.with_raw_response.create(
            model="gpt-4o-mini", input="hello", extra_body={"fake": {"hold": True}}
        ),
    )
    assert not early, "the answer did not wait for its context's write"
    assert raw.status_code == 200


async def test_sequential_calls_find_the_last_ones_reserve_replaced(make_proxy: ProxyFactory) -> None:
    """An answer that went out before its settle's reply: the client's next call, reserved
    behind that settle, finds its concurrency slot free (a run allowing one call at a time)."""
    proxy = await make_proxy(tiers={"standard": {"run": {"concurrent": 1, "requests": 50}}})
    client = proxy.client()
    for i in range(30):
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": f"call {i}"}],
            extra_headers={"X-Run-Id": "one-at-a-time"},
        )
        assert raw.status_code == 200


async def test_the_first_settle_after_a_redis_restart_is_ahead_of_the_next_call(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """A restarted (or failed over) Redis has no scripts: the first settle on the new connection
    comes back NOSCRIPT and is sent again whole, behind whatever was written meanwhile. Its answer
    must not go out on the refused try: the client's next call, reserved in between, found this
    one's slot still held (a run allowing one call at a time) and was refused."""
    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 10},
        tiers={"standard": {"run": {"concurrent": 1, "requests": 50}}},
    )
    client = proxy.client()
    run = {"X-Run-Id": "one-at-a-time"}
    messages: Any = [{"role": "user", "content": "hi"}]
    await client.chat.completions.create(model="gpt-4o-mini", messages=messages, extra_headers=run)
    # The restart as the proxy sees it: its connections drop and the scripts are gone. The first
    # reserve after it loads reserve.lua again (EVAL): here, as another call's would have.
    await own_client.script_flush()
    await own_client.client_kill_filter(_type="normal", skipme=True)
    await own_client.script_load(read_scripts()["reserve"][0])
    blocker = aioredis.Redis.from_url(own_redis.url)
    try:
        received = len(fake.received)
        asked = asyncio.ensure_future(
            client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=messages,
                extra_headers=run,
                extra_body={"fake": {"hold": True}},
            )
        )
        await until_upstream_received(fake, received + 1)
        hold = asyncio.ensure_future(blocker.eval(HOLDING, 0))
        assert own_redis.port is not None
        await until_redis_busy(own_redis.port)
        # Answered only once the store is held, its settle refused only once the store lets go:
        # after a fixed delay the whole settle could be over first on a loaded machine. No floor
        # here: the sooner the answer, the longer a next call sent on an early answer has to
        # reach the held store.
        fake.release()
        first = await asked
        assert first.status_code == 200
        # Sent at once, as a client's next call is: while the store still holds the settle.
        second = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=messages, extra_headers=run
        )
        await hold
    finally:
        await blocker.aclose()
    assert second.status_code == 200, second.headers.get("x-billing-refused-meter")


async def test_an_answer_past_the_window_a_lost_reservation_is_billed_in_waits_for_its_settle(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past 90% of the settled marker's life since its lease was confirmed, a settle that finds its
    reservation lost (a failover) writes nothing: the headers must not say what it would have
    written. The window is made short here (the marker's life is at least 60 s)."""
    monkeypatch.setattr("proxy.relay.MARKER_TRUST", 0.001)  # 60 ms of a 60 s marker
    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 10}, limits={"settled_marker_ttl_s": 60}
    )
    early, raw = await _held_chat(proxy, own_redis, fake)
    assert not early, "the answer did not wait for its settle"
    assert raw.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_gone_while_its_call_was_reserved_has_nothing_forwarded_nor_billed(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    stream: bool,
) -> None:
    """A client that leaves while the store is slow to reserve (its SDK's timeout ran out) gets
    no answer: its call must not go out, or the provider would bill it and the ledger with it.
    Its reserve is released, nothing is billed, and the ledger says why."""
    proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 10})
    # A first call: the tenant is known to the store and the store's clock read, so the second
    # call's only wait on the store is its reserve.
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    await proxy.recorded()  # its settle answered: the one command the store is then sent is the reserve
    received = len(fake.received)
    pipe = proxy.app[STATE].store._pipe  # type: ignore[union-attr]
    assert pipe is not None and pipe._protocol is not None
    blocker = aioredis.Redis.from_url(own_redis.url)
    host, port = proxy.url.removeprefix("http://").split(":")
    body = orjson.dumps(
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    try:
        hold = asyncio.ensure_future(blocker.eval(HOLDING, 0))
        assert own_redis.port is not None
        await until_redis_busy(own_redis.port)
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"X-Run-Id: gone-early\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        # Until the proxy's reserve is on its way to the held store: then the client leaves.
        deadline = time.monotonic() + 10
        while not pipe._protocol.waiters:
            assert time.monotonic() < deadline, "the reserve never went out"
            await asyncio.sleep(0.01)
        writer.close()
        await hold
    finally:
        await blocker.aclose()
    entries: list[Any] = []
    deadline = time.monotonic() + 10
    while len(entries) < 2:
        assert time.monotonic() < deadline, "the second call was never settled"
        await asyncio.sleep(0.02)
        entries = await own_client.xrange("lbp:{team-a}:ledger")
    assert len(fake.received) == received, "a call whose client had left went out"
    entry = entries[-1][1]
    assert entry["outcome"] == "client_disconnected"
    assert entry["usage_source"] == "none"
    assert entry["input_tokens"] == entry["output_tokens"] == entry["cost_micros"] == "0"
    run = await own_client.hgetall("lbp:{team-a}:run:gone-early")
    assert run.get("used:requests", "0") == "0"  # not a request made
    assert all(run[f"resv:{m}"] == "0" for m in ("requests", "input_tokens", "output_tokens"))
    assert await own_client.zcard("lbp:{team-a}:leases") == 0


# The characters of a token of ``Coarse``: an answer of 64 KiB fits gpt-4o-mini's cap of 1,000
# in the tests' config.
TOKEN_CHARS = 128


class Coarse:
    """An o200k_base stand-in built in-process: a token per TOKEN_CHARS characters begun."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [0] * -(-len(text) // TOKEN_CHARS)


class ThreadNoting(Tokenizer):
    """A tokenizer noting the thread each count of a call without usage (``count``, a settle's
    alone) ran on, and the characters it counted; one off the event loop of ``hold_chars`` or
    more says so (``holding``) and waits for ``release``."""

    def __init__(self, hold_chars: int = 0) -> None:
        super().__init__({"o200k_base": Coarse()})
        self.loop_thread = threading.get_ident()  # built by the test, on the loop's thread
        self.counts: list[tuple[int, int]] = []
        self.hold_chars = hold_chars
        self.holding = threading.Event()
        self.release = threading.Event()

    def count(self, text: str, encoding: str, *, scope: str | None = None) -> tuple[int, Any]:
        thread = threading.get_ident()
        self.counts.append((thread, len(text)))
        if self.hold_chars and len(text) >= self.hold_chars:
            self.holding.set()  # on the loop too: the test's wait ends, and it fails on the thread
            if thread != self.loop_thread:
                self.release.wait(30)  # a guard: the test releases it
        return super().count(text, encoding, scope=scope)

    def threads_counting(self, chars: int) -> list[bool]:
        """For each count of ``chars`` characters: whether it ran on the event loop's thread."""
        return [thread == self.loop_thread for thread, n in self.counts if n == chars]


# An answer (and a prompt) past INLINE_COUNT_CHARS, and a chunk size the fake sends it in.
LARGE_CHARS = 64 * 1024
CHUNK_CHARS = 1024


async def _no_usage_call(
    proxy: Proxy, dialect: str, stream: bool, run: str, content: str, prompt: str
) -> None:
    """A call whose upstream answers ``content`` and tells no usage (the proxy counts it)."""
    fake = {"no_usage": True, "content": content, "chunk_chars": CHUNK_CHARS}
    options: dict[str, Any] = {
        "stream": stream,
        "extra_body": {"fake": fake},
        "extra_headers": run_headers(run),
    }
    async with proxy.client() as client:
        if dialect == "chat":
            messages = [{"role": "user", "content": prompt}]
            answer: Any = await client.chat.completions.create(model=MODEL, messages=messages, **options)
        else:
            answer = await client.responses.create(model=MODEL, input=prompt, **options)
        if stream:
            async for _ in answer:
                pass
    await proxy.recorded()


def _figures(entry: dict[str, Any]) -> dict[str, Any]:
    names = ("input_tokens", "output_tokens", "total_tokens", "cost_micros", "usage_source", "outcome")
    return {name: entry[name] for name in names}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", ["chat", "responses"])
async def test_a_large_answer_without_usage_is_counted_off_the_event_loop(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    monkeypatch: pytest.MonkeyPatch,
    dialect: str,
    stream: bool,
) -> None:
    """Issue 6: a count never blocks the event loop for other calls. An answer of 64 KiB without
    usage was tokenized on the loop at its settle, every other call of the process waiting; it is
    counted in a thread now, and billed the same as counted on the loop (the threshold raised
    past it). A small one is still counted on the loop: a thread hop costs more than its count."""
    tokenizer = ThreadNoting()
    proxy = await make_proxy(tokenizer=tokenizer)
    large = "word " * (LARGE_CHARS // 5)
    await _no_usage_call(proxy, dialect, stream, "small", "hello there", PROMPT)
    await _no_usage_call(proxy, dialect, stream, "large", large, PROMPT)
    # A Responses stream keeps its context's size before its last event: counted there too.
    counts = 2 if dialect == "responses" and stream else 1
    assert tokenizer.threads_counting(len("hello there")) == [True] * counts
    assert tokenizer.threads_counting(len(large)) == [False] * counts
    monkeypatch.setattr(billed_usage, "INLINE_COUNT_CHARS", 10 * LARGE_CHARS)
    await _no_usage_call(proxy, dialect, stream, "inline", large, PROMPT)
    assert tokenizer.threads_counting(len(large)) == [False] * counts + [True] * counts
    small, off_loop, inline = [await the_entry(proxy, run) for run in ("small", "large", "inline")]
    assert small["usage_source"] == off_loop["usage_source"] == "tokenizer"
    assert _figures(off_loop) == _figures(inline)
    assert (
        int(off_loop["output_tokens"])
        == tokenizer.count(large, "o200k_base")[0]
        == -(-len(large) // TOKEN_CHARS)
    )
    assert int(off_loop["input_tokens"]) == int(small["input_tokens"])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_large_prompt_without_usage_is_counted_off_the_event_loop(
    make_proxy: ProxyFactory, fake: FakeUpstream, stream: bool
) -> None:
    """A prompt of 64 KiB with a small answer and no usage: counted at the settle in a thread too
    (the reserve's own count of it ran on the estimate thread, and is no count of the joined text
    the settle bills)."""
    tokenizer = ThreadNoting()
    proxy = await make_proxy(tokenizer=tokenizer)
    prompt = "word " * (LARGE_CHARS // 5)
    await _no_usage_call(proxy, "chat", stream, "prompt", "hello there", prompt)
    assert tokenizer.counts and not any(thread == tokenizer.loop_thread for thread, _ in tokenizer.counts)
    entry = await the_entry(proxy, "prompt")
    assert entry["usage_source"] == "tokenizer"
    assert (
        int(entry["input_tokens"]) == tokenizer.count(prompt, "o200k_base")[0] + 4 + 3
    )  # a message, a reply
    assert int(entry["output_tokens"]) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_handler_cancelled_while_its_answer_is_counted_settles_at_the_count(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The count runs in the settle's task, shielded as the settle is: shutdown past its grace
    period cancelling the handler while a large answer is being counted neither bills the call
    at its reserve (a cut call's) nor settles it twice; it is billed at the count, tagged ok."""
    tokenizer = ThreadNoting(hold_chars=LARGE_CHARS // 2)
    proxy = await make_proxy(tokenizer=tokenizer)
    handlers: list[asyncio.Task[Any]] = []
    run = relay.Exchange.run

    async def noted(self: relay.Exchange) -> Any:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        return await run(self)

    monkeypatch.setattr(relay.Exchange, "run", noted)
    large = "word " * (LARGE_CHARS // 5)
    call = asyncio.ensure_future(_no_usage_call(proxy, "chat", stream, "cut", large, PROMPT))
    try:
        assert await asyncio.to_thread(tokenizer.holding.wait, 30)
        assert tokenizer.threads_counting(len(large)) == [False]  # not on the loop
        (handler,) = handlers
        handler.cancel()
        await asyncio.wait((handler,))
    finally:
        tokenizer.release.set()
        with contextlib.suppress(Exception):
            await call
    await proxy.recorded()
    entry = await the_entry(proxy, "cut")
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "tokenizer")
    assert int(entry["output_tokens"]) == -(-len(large) // TOKEN_CHARS)


class FailingOffLoop(Tokenizer):
    """A tokenizer whose count of a large text raises (a bug, a MemoryError on a multi-MB
    answer)."""

    def __init__(self) -> None:
        super().__init__({"o200k_base": Coarse()})

    def count(self, text: str, encoding: str, *, scope: str | None = None) -> tuple[int, Any]:
        if len(text) >= LARGE_CHARS // 2:
            raise RuntimeError("count failed")
        return super().count(text, encoding, scope=scope)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_count_that_fails_in_the_settle_bills_the_reserve_at_once(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, stream: bool
) -> None:
    """The count of a large answer runs in the settle's task: raised there, it failed the settle,
    and the call stayed reserved for a reaper, a lease and a grace later (the first review). Now
    settled at once, at its reserve, its tag kept."""
    proxy = await make_proxy(tokenizer=FailingOffLoop())
    large = "word " * (LARGE_CHARS // 5)
    await _no_usage_call(proxy, "chat", stream, "failing", large, PROMPT)
    await proxy.recorded()
    assert await redis_client.zcard("lbp:{team-a}:leases") == 0, "left reserved for a reaper"
    entry = await the_entry(proxy, "failing", wait_s=5)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "reserve")


@pytest.mark.parametrize(
    ("case", "answered", "upstream_status"),
    [
        ("rejected", 422, 200),  # on_invalid_json: reject
        ("refused", 502, 0),  # the connection to the upstream refused: no answer from it
        ("operator_key_refused", 502, 401),
        ("passed_on", 429, 429),
        ("stream", 200, 200),
    ],
)
async def test_the_call_lines_status_is_the_clients_and_the_upstreams_is_beside_it(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    caplog: pytest.LogCaptureFixture,
    case: str,
    answered: int,
    upstream_status: int,
) -> None:
    """README, Logs: the call's line carries its status. It was the upstream's (the ledger's
    ``upstream_status``), not the answer's: a rejected answer, answered 422, was logged 200 and a
    connection refused, answered 502, was logged 0 (the docs hunt). Now ``status`` is the
    client's, ``upstream_status`` the upstream's."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    overrides: dict[str, Any] = {}
    if case == "rejected":
        overrides["policy"] = {"on_invalid_json": "reject"}
        body.update(response_format={"type": "json_object"}, fake={"content": "not json"})
    elif case == "refused":
        overrides["upstreams"] = upstream_override(f"http://127.0.0.1:{refused_port()}/v1")
    elif case == "operator_key_refused":
        body["fake"] = {"mode": "error", "status": 401}
    elif case == "passed_on":
        body["fake"] = {"mode": "error", "status": 429}
    else:
        body["stream"] = True
    proxy = await make_proxy(**overrides)
    caplog.set_level(logging.INFO)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp,
    ):
        await resp.read()
    await proxy.recorded()
    (line,) = [r.__dict__[TRUSTED_FIELDS] for r in caplog.records if TRUSTED_FIELDS in r.__dict__]
    assert resp.status == answered
    assert (line["status"], line.get("upstream_status")) == (answered, upstream_status), line


async def _logged_once_its_client_left(
    proxy: Proxy, body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> dict[str, Any]:
    """The call's log line, its client gone (a timeout of 0.2 s) before the upstream answered."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
            ) as resp:
                await resp.read()
    await asyncio.sleep(1.0)
    await proxy.recorded()
    lines: list[dict[str, Any]] = [
        r.__dict__[TRUSTED_FIELDS] for r in caplog.records if TRUSTED_FIELDS in r.__dict__
    ]
    (line,) = lines
    return line


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_call_whose_client_left_before_its_answer_is_logged_499(
    make_proxy: ProxyFactory, fake: FakeUpstream, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """A client gone while its answer was on its way was answered nothing: logged 499, as one
    gone before the call went out is, where a whole answer's was logged the upstream's 200 (the
    review). A stream's headers wait for the upstream's: its client, gone before them, was
    answered nothing either."""
    proxy = await make_proxy()
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body["fake"] = {"delay_s": 0.6}
    line = await _logged_once_its_client_left(proxy, body, caplog)
    assert (line["outcome"], line["upstream_status"], line["status"]) == ("client_disconnected", 200, 499)


@pytest.mark.parametrize("status", [500, 429])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_call_whose_client_left_before_the_upstreams_error_is_logged_499(
    make_proxy: ProxyFactory, fake: FakeUpstream, caplog: pytest.LogCaptureFixture, stream: bool, status: int
) -> None:
    """As a call whose client left before its answer, the upstream answering an error
    (``relay_upstream_error``): the client, gone before it, was answered nothing, where the line
    said the upstream's status (the second review)."""
    proxy = await make_proxy()
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body["fake"] = {"delay_s": 0.6, "mode": "error", "status": status}
    line = await _logged_once_its_client_left(proxy, body, caplog)
    assert (line["upstream_status"], line["status"]) == (status, 499), line


async def _chat(proxy: Proxy, stream: bool, run: str) -> tuple[int, Any, bytes, str]:
    """One chat call: its status, headers, what came, and how it ended: "whole", "dropped" (its
    connection closed before its end) or "open" (still, at the client's timeout)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    got = b""
    async with (
        # Generous for one local call; a stream left open fails the test, not hangs it.
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as session,
        session.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY_A}", **run_headers(run)},
        ) as resp,
    ):
        try:
            async for piece in resp.content.iter_any():
                got += piece
        except aiohttp.ClientPayloadError:
            return resp.status, resp.headers, got, "dropped"
        except TimeoutError:
            return resp.status, resp.headers, got, "open"
        return resp.status, resp.headers, got, "whole"


async def test_a_settle_journaled_by_a_try_that_failed_beside_it_is_counted_once(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A settle's write went to the journal (the store failed it) while a write beside it in
    the settle's round (the mark of a stored response as the tenant's) failed on the proxy's
    side. A settle tried again at once (a83d2cb) wrote the entry and counted it; the journal's
    replay of the first try's line got the same entry and counted it again: one ledger entry,
    two requests in the metrics (the second review). Not tried again: the journal counts it."""
    proxy = await make_proxy(limits={"journal_replay_s": 0.1})
    store = proxy.app[STATE].store
    real_settle = store.settle
    settles: list[str] = []

    async def settle_failing_once(*args: Any, **kwargs: Any) -> Any:
        settles.append("try")
        if len(settles) == 1:
            await asyncio.sleep(0.05)  # the reply is late, then lost
            raise StoreError("connection reset", maybe_applied=False)
        return await real_settle(*args, **kwargs)

    monkeypatch.setattr(store, "settle", settle_failing_once)
    claims: list[str] = []
    real_claim = relay.claim

    async def claim_failing_once(*args: Any, **kwargs: Any) -> None:
        claims.append("try")
        if len(claims) == 1:
            raise RuntimeError("a bug in the marks' write")
        await real_claim(*args, **kwargs)

    monkeypatch.setattr("proxy.relay.claim", claim_failing_once)
    client = proxy.client(default_headers={"X-Run-Id": "twice"})
    with contextlib.suppress(Exception):  # a 500: the settle failed on the proxy's side
        await client.responses.create(model=MODEL, input="hello", store=True)
    for _ in range(60):  # the journal's replay rounds
        await asyncio.sleep(0.1)
        if await redis_client.xlen("lbp:{team-a}:ledger"):
            break
    await asyncio.sleep(0.3)
    await proxy.recorded()
    assert len(await redis_client.xrange("lbp:{team-a}:ledger")) == 1
    registry = proxy.app[STATE].metrics.registry
    labels = {"tenant": "team-a", "model": MODEL, "endpoint": "responses", "outcome": "ok"}
    assert registry.get_sample_value("llm_proxy_requests_total", labels) == 1


@pytest.mark.parametrize("fails", ["after_its_settle", "every_settle", "its_relay"])
async def test_a_stream_the_proxy_fails_once_started_still_ends_and_is_billed(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """A failure of the proxy's own once a stream's headers went out: the error middleware
    wrote a 500 of its own into the stream, and its client waited for an end that never came.
    Now the stream ends: with an error event (a failure after its settle, or of every settle),
    or, when the relay itself failed, its connection dropped; and the call is billed: settled
    before, by the handler's end (``Exchange.run``), or at its reserve by a reaper."""
    if fails == "after_its_settle":

        def broken_comment(*args: Any) -> bytes:
            raise RuntimeError("the billing comment failed")

        monkeypatch.setattr("proxy.relay_stream.billing_comment", broken_comment)
    elif fails == "every_settle":

        async def broken_settle(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("every settle fails")

        monkeypatch.setattr("proxy.relay.settle", broken_settle)
    else:

        async def broken_relay(ex: Any, upstream: Any, renewal: Any) -> Any:
            response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(ex.request)
            await response.write(b"data: {}\n\n")
            raise RuntimeError("the relay failed")

        monkeypatch.setattr("proxy.relay.relay_stream", broken_relay)
    # A short lease: a call no settle billed is reaped within the test.
    limits = {"lease_margin_s": 0.2, "reaper_interval_s": 0.1}
    proxy = await make_proxy(
        redis={"socket_timeout_s": 0.7},  # below two thirds of the lease (1.2 s)
        upstreams=upstream_override(fake.base_url, timeout_s=1),
        limits=limits,
    )
    status, _, body, ended = await _chat(proxy, True, "failed")
    assert (status, ended) == (200, "dropped" if fails == "its_relay" else "whole"), body[-300:]
    if fails != "its_relay":
        assert body.endswith(b'"code":"internal_error"}}\n\n'), body[-300:]  # an error event
    assert b"HTTP/1.1 500" not in body
    await proxy.recorded()
    entry = await the_entry(proxy, "failed", wait_s=10)  # nothing left reserved
    billed = {
        "after_its_settle": ("ok", "provider"),
        "every_settle": ("lease_expired", "reserve"),
        "its_relay": ("upstream_error", "reserve"),
    }
    assert (entry["outcome"], entry["usage_source"]) == billed[fails], entry


async def test_marks_journaled_whose_sync_failed_are_logged_as_journaled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call's context marks whose journal line was written and whose sync failed
    (``journal.Unsynced``) are replayed as any line: logged as journaled, not critical as
    "contexts left unmarked" (6f52e51; the fifth review's test)."""

    class SyncFailing:
        async def append_off_loop(self, line: Any) -> None:
            raise Unsynced(5, "Input/output error")

    reservation = SimpleNamespace(tenant="t", id="r", run_id="run")
    exchange = SimpleNamespace(
        call=SimpleNamespace(reservation=reservation, request_id="req"),
        services=SimpleNamespace(journal=SyncFailing()),
    )
    with caplog.at_level(logging.INFO):
        await relay.Exchange._journal_marks(exchange, ["ctx1"])  # type: ignore[arg-type]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "proxy.relay"]
    assert said == [(logging.ERROR, "contexts' marks journaled, their sync failed")]
