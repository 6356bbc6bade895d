"""Shared fixtures: a real redis-server, the fake upstream, and a proxy built per test."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from proxy.app import build_app, server_options
from proxy.config import Config, EventLoopChoice
from proxy.config_load import parse_config
from proxy.redis_server import RedisServerProcess, free_port
from proxy.redis_store import RedisStore
from proxy.state import STATE
from proxy.tokenizer import Tokenizer
from proxy.workers import new_event_loop
from tests.cluster import RedisClusterProcesses
from tests.fake_upstream import FakeUpstream

KEY_A = "sk-proxy-team-a"
KEY_B = "sk-proxy-team-b"
UPSTREAM_KEY = "sk-upstream-secret"
TEST_EVENT_LOOP = os.environ.get("PROXY_TEST_EVENT_LOOP", "auto")
assert TEST_EVENT_LOOP in ("auto", "uvloop", "asyncio"), f"PROXY_TEST_EVENT_LOOP={TEST_EVENT_LOOP!r}"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServerProcess]:
    server = RedisServerProcess(tmp_path_factory.mktemp("redis"), port=free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis_client(redis_server: RedisServerProcess) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def store(redis_server: RedisServerProcess, redis_client: aioredis.Redis) -> AsyncIterator[RedisStore]:
    """A store of its own, on the shared server (flushed first by redis_client): its scripts are
    read from proxy/lua when it is built."""
    store = RedisStore.from_url(redis_server.url)
    yield store
    await store.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServerProcess]:
    """A Redis of the test's own, to stop, kill and restart."""
    server = RedisServerProcess(tmp_path / "own-redis", port=free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def own_client(own_redis: RedisServerProcess) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    upstream = FakeUpstream(api_key=UPSTREAM_KEY)
    await upstream.start()
    yield upstream
    await upstream.close()


@dataclass(frozen=True)
class PrivateCA:
    """A CA of the tests' own (``ca``, an upstream's ``ca_file``), the certificate it signed for
    127.0.0.1 (``server``, ``server_key``), and another CA's certificate, which signed nothing."""

    ca: Path
    server: Path
    server_key: Path
    other_ca: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.server, self.server_key)
        return context


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _new_ca(where: Path, name: str) -> tuple[Path, Path]:
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-days", "2", "-subj", f"/CN=Test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(key), "-out", str(cert),
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="session")
def private_ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCA:
    where = tmp_path_factory.mktemp("private-ca")
    ca, ca_key = _new_ca(where, "private-ca")
    other_ca, _ = _new_ca(where, "other-ca")
    server, server_key, request = where / "server.pem", where / "server.key", where / "server.csr"
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-subj", "/CN=127.0.0.1", "-keyout", str(server_key), "-out", str(request),
    )  # fmt: skip
    extensions = where / "server.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-set_serial", "2",
        "-days", "2", "-extfile", str(extensions), "-out", str(server),
    )  # fmt: skip
    return PrivateCA(ca=ca, server=server, server_key=server_key, other_ca=other_ca)


@pytest.fixture
async def https_upstream(fake: FakeUpstream, private_ca: PrivateCA) -> str:
    """The fake upstream's https base URL, its certificate signed by ``private_ca``."""
    return await fake.start_tls(private_ca.server_context())


def slow_stream(run: str, chunks: int = 30, delay_s: float = 0.1) -> tuple[dict[str, Any], dict[str, str]]:
    """A chat stream of ``chunks`` content chunks ``delay_s`` apart from the fake upstream, under
    run ``run``: (body, headers)."""
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": chunks,
        "stream": True,
        "fake": {"reply_tokens": chunks, "chunk_delay_s": delay_s},
    }
    return body, {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}


def base_config(upstream_url: str, redis_url: str, **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "redis": {"url": redis_url},
        "upstreams": {
            "openai": {
                "base_url": upstream_url,
                "api_key_env": "TEST_UPSTREAM_KEY",
                "timeout_s": 5,
                "connect_timeout_s": 2,
            }
        },
        "models": {
            "gpt-4o-mini": {"upstream": "openai", "max_output_tokens": 1000},
            "*": {"upstream": "openai"},
        },
        "keys": [
            {"name": "a-ci", "sha256": digest(KEY_A), "tenant": "team-a", "tier": "standard"},
            {"name": "b-dev", "sha256": digest(KEY_B), "tenant": "team-b", "tier": "standard"},
        ],
    }
    for key, value in overrides.items():
        raw[key] = value
    # The tests' Redis unless a test names its own: ``redis={"socket_timeout_s": 1}`` alone is
    # the tests' Redis with that timeout (one coherent with a test's short leases).
    raw["redis"] = {"url": redis_url, **raw["redis"]}
    # Leases reaped as soon as they run out, as the tests of reapers expect (a test of the grace
    # sets it).
    raw["limits"] = {"reap_grace_s": 0, **raw.get("limits", {})}
    return raw


def big_config(
    upstream_url: str,
    redis_url: str,
    *,
    keys: int = 5000,
    models: int = 300,
    upstreams: int = 20,
    tenants: int = 1000,
    tier_count: int = 10,
) -> dict[str, Any]:
    """A production-sized config: ``keys`` keys (``key-<i>``, secret ``big_config_secret(i)``)
    over ``tenants`` tenants and ``tier_count`` tiers (run, key and windowed key and tenant
    ceilings), ``models`` models over ``upstreams`` upstreams, a third with service tiers and
    long-context prices, a fifth of them globs."""
    ups = {
        f"up{i}": {
            "base_url": upstream_url,
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": 5,
            "connect_timeout_s": 2,
        }
        for i in range(upstreams)
    }
    entries: dict[str, Any] = {
        "gpt-4o-mini": {
            "upstream": "up0",
            "max_output_tokens": 1000,
            "price_per_million": {"input": "1", "output": "1"},
        }
    }
    for i in range(models):
        entry: dict[str, Any] = {
            "upstream": f"up{i % upstreams}",
            "max_output_tokens": 1000,
            "price_per_million": {"input": "1.25", "output": "10", "cached_input": "0.125"},
        }
        if i % 3 == 0:
            entry["service_tiers"] = {
                "flex": {"input": "0.625", "output": "5"},
                "priority": {"input": "2.5", "output": "20"},
            }
            entry["long_context"] = {
                "above_input_tokens": 200000,
                "price_per_million": {"input": "2.5", "output": "15"},
                "service_tiers": {
                    "flex": {"input": "1.25", "output": "7.5"},
                    "priority": {"input": "5", "output": "30"},
                },
            }
        entries[f"family-{i}-*" if i % 5 == 0 else f"model-{i}"] = entry
    tiers = {
        f"tier{t}": {
            "run": {"requests": 1000, "cost_usd": 10},
            "key": {"concurrent": 50},
            "windows": [{"period": "minute", "requests": 600}, {"period": "day", "cost_usd": 100}],
            "tenant": [
                {"period": "hour", "total_tokens": 10_000_000},
                {"period": "month", "cost_usd": 5000},
            ],
        }
        for t in range(tier_count)
    }
    key_list = [
        {
            "name": f"key-{i}",
            "sha256": digest(big_config_secret(i)),
            "tenant": f"tenant-{i % tenants}",
            "tier": f"tier{i % tier_count}",
        }
        for i in range(keys)
    ]
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "redis": {"url": redis_url},
        "upstreams": ups,
        "models": entries,
        "keys": key_list,
        "tiers": tiers,
        "limits": {"reap_grace_s": 0},
    }


def big_config_secret(index: int) -> str:
    """The secret of ``big_config``'s key ``key-<index>``."""
    return f"sk-scale-key-{index}"


def upstream_timing_out(base_url: str, timeout_s: float) -> dict[str, Any]:
    """The tests' upstream with a timeout of its own: a call's lease is that plus
    ``limits.lease_margin_s``."""
    return {
        "openai": {
            "base_url": base_url,
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": timeout_s,
            "connect_timeout_s": 2,
        }
    }


@dataclass
class Proxy:
    url: str
    app: web.Application
    config: Config
    runner: web.AppRunner

    async def recorded(self) -> None:
        """Until every call answered so far is recorded: a whole answer goes out once its settle
        is on its way (``Exchange.settle_early``); its metrics and log line follow the reply."""
        settling = self.app[STATE].settling
        if settling:
            await asyncio.wait(set(settling), timeout=10)

    def client(self, key: str = KEY_A, **kwargs: Any) -> openai.AsyncOpenAI:
        # One TLS context for every client (the proxy is plain HTTP): the SDK's own loads the CA
        # bundle, 30 ms of a blocked loop per client, which many clients at once made last
        # seconds, and an upstream's timeout pass under a test's own load.
        http_client = openai.DefaultAsyncHttpxClient(verify=_client_tls())
        options = {"max_retries": 0, "http_client": http_client, **kwargs}
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, **options)


@functools.cache
def _client_tls() -> ssl.SSLContext:
    return ssl.create_default_context()


ProxyFactory = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def make_proxy(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> AsyncIterator[ProxyFactory]:
    runners: list[web.AppRunner] = []

    async def factory(
        tokenizer: Tokenizer | None = None,
        passthrough: bool = False,
        upstream_key: str = UPSTREAM_KEY,
        environ: dict[str, str] | None = None,
        **overrides: Any,
    ) -> Proxy:
        overrides.setdefault("journal_dir", str(tmp_path / "journal"))
        raw = base_config(fake.base_url, redis_server.url, **overrides)
        # ``environ``: the rest of the environment the config is read with (HTTPS_PROXY...).
        config = parse_config(raw, {**(environ or {}), "TEST_UPSTREAM_KEY": upstream_key})
        app = build_app(config, passthrough=passthrough, tokenizer=tokenizer or Tokenizer({}))
        runner = web.AppRunner(app, **server_options(config))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return Proxy(url=f"http://127.0.0.1:{port}", app=app, config=config, runner=runner)

    yield factory
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def proxy(make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy()


def tmp_data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture
async def script() -> AsyncIterator[Any]:
    """An upstream answering exactly the bytes its ``plan`` says (tests.test_bad_input's)."""
    from tests.test_bad_input import ScriptedUpstream

    upstream = ScriptedUpstream()
    await upstream.start()
    yield upstream
    await upstream.close()


async def until_upstream_received(fake: FakeUpstream, count: int, timeout_s: float = 10.0) -> None:
    """Until the fake upstream has ``count`` requests: a call is then reserved and in flight
    (a fixed sleep is too short on a loaded machine)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(fake.received) < count:
        assert asyncio.get_running_loop().time() < deadline, f"the upstream got {len(fake.received)} calls"
        await asyncio.sleep(0.01)


async def until_monotonic(due: float) -> None:
    """Until ``time.monotonic()``, the clock a call's lease age is read on, reaches ``due``. A
    sleep alone may end early by it: a loop's timers run on the loop's clock (uvloop's is libuv's,
    read once a turn)."""
    while (left := due - time.monotonic()) > 0:
        await asyncio.sleep(left)


def busy_script(seconds: float) -> str:
    """A Lua script that holds Redis ``seconds``, counted in microseconds: TIME's seconds alone
    would end it up to a second early (at a second's end), eating a test's margin."""
    return (
        "local function now() local t = redis.call('TIME') return t[1] * 1e6 + t[2] end "
        f"local t0 = now() while now() - t0 < {seconds} * 1e6 do end return 1"
    )


async def until_redis_busy(port: int, timeout_s: float = 10.0) -> None:
    """Until the Redis on ``port`` answers no PING within 0.5 s: a script sent to it just before
    holds it (a fixed sleep may end before that script even reached it on a loaded machine)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        assert asyncio.get_running_loop().time() < deadline, "Redis never got busy"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"PING\r\n")
            await writer.drain()
            await asyncio.wait_for(reader.readline(), 0.5)
        except TimeoutError:
            return
        finally:
            writer.close()
        await asyncio.sleep(0.02)


async def until_redis_has_unread(port: int, *, besides: set[int], timeout_s: float = 10.0) -> None:
    """Until a command waits, unread, on a connection to the busy Redis on ``port`` other than
    ``besides`` (``unread_at`` before the command was sent): a call has sent its script. From
    Linux's socket tables: a busy Redis answers no CLIENT LIST, and reads nothing until its
    script ends."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not unread_at(port) - besides:
        assert asyncio.get_running_loop().time() < deadline, "no command reached Redis"
        await asyncio.sleep(0.01)


def unread_at(port: int) -> set[int]:
    """The client ports of the open connections to ``port`` holding bytes its server has not
    read (a PING of ``until_redis_busy``'s, closed, may still count until its close is out)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, remote, state, queues = row.split()[1:5]
            established = state == "01"
            if established and int(local.rsplit(":", 1)[1], 16) == port and int(queues.split(":")[1], 16):
                found.add(int(remote.rsplit(":", 1)[1], 16))
    return found


async def leave_once_upstream_received(request: Awaitable[Any], fake: FakeUpstream) -> None:
    """Send ``request`` and leave (drop the connection) once the fake upstream has the call, before
    its answer: a client timeout of a fixed 0.1 s could fire before the proxy even had the request
    on a loaded machine."""
    task = asyncio.ensure_future(request)
    await until_upstream_received(fake, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# Sockets bound for the life of this test process (``refused_port``).
_HELD_PORTS: list[socket.socket] = []


def refused_port() -> int:
    """A loopback port where a connection is refused while this test process lives: bound and
    never listening, so no server of the suite's other processes (which run side by side and
    pick their ports free) can take it, as they could one picked free and let go."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _HELD_PORTS.append(sock)
    return int(sock.getsockname()[1])


@contextlib.contextmanager
def unreachable_port(kind: str) -> Iterator[int]:
    """A loopback port no upstream answers on: ``refused`` (nothing listens), or
    ``connect_timeout`` (a full accept queue: the kernel drops further SYNs and a connect hangs)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    fillers = []
    if kind == "connect_timeout":
        listener.listen(0)
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
    # ``refused``: bound, never listening, until the test ends (see ``refused_port``).
    try:
        yield port
    finally:
        for sock in (*fillers, listener):
            sock.close()


def unreachable_upstream(port: int) -> dict[str, Any]:
    """The config of the ``openai`` upstream on an ``unreachable_port``."""
    return {
        "base_url": f"http://127.0.0.1:{port}/v1",
        "api_key_env": "TEST_UPSTREAM_KEY",
        "timeout_s": 3,
        "connect_timeout_s": 0.3,
    }


class SkewedClockLoop(asyncio.SelectorEventLoop):
    """asyncio's loop with a clock 1000 s behind ``time.monotonic``: a loop's clock need not be
    that one (uvloop's is libuv's), so timers must not mix the two."""

    def time(self) -> float:
        return super().time() - 1000.0


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Tests run on the loop the proxy serves on (``event_loop: auto``, uvloop where installed);
    ``PROXY_TEST_EVENT_LOOP=asyncio`` runs them on asyncio's own (``.ci/run`` runs part of the
    suite so); a test marked ``skewed_loop_clock`` on ``SkewedClockLoop``."""
    if item.get_closest_marker("skewed_loop_clock") is not None:
        return {"skewed-clock": SkewedClockLoop}
    choice = cast(EventLoopChoice, TEST_EVENT_LOOP)
    return {choice: lambda: new_event_loop(choice)[0]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """A real Redis Cluster (three masters), one for the tests of a module."""
    nodes = RedisClusterProcesses(tmp_path_factory.mktemp("cluster")).start()
    yield nodes
    nodes.stop()


@contextlib.asynccontextmanager
async def loop_ticks(every_s: float = 0.005) -> AsyncIterator[list[float]]:
    """The times (``time.perf_counter``) a task on the event loop woke, every ``every_s``, while
    the block ran: none inside a span means the loop stood still for it."""
    ticks: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            await asyncio.sleep(every_s)
            ticks.append(time.perf_counter())

    ticking = asyncio.create_task(ticker())
    try:
        yield ticks
    finally:
        stop.set()
        await ticking


async def serving(app: web.Application) -> Proxy:
    """``app`` served on a free loopback port (its runner for the test to clean up)."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return Proxy(url=url, app=app, config=app[STATE].config, runner=runner)
