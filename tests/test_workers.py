"""Serving processes as an operator runs them: signals to the whole group (systemd's stop,
Ctrl-C), SIGHUP, a worker that cannot serve, a supervisor killed. Found by a hunt; each test
failed before proxy/workers.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from proxy.redis_server import RedisServerProcess, free_port
from proxy.workers import new_event_loop
from tests.conftest import TEST_EVENT_LOOP, UPSTREAM_KEY, base_config, slow_stream
from tests.fake_upstream import FakeUpstream
from tests.procs import ROOT, ProxyProcess

LEDGER = "lbp:{team-a}:ledger"


async def _until(predicate: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def _two_workers(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path, raw: dict[str, Any] | None = None
) -> ProxyProcess:
    """``serve --workers 2`` on ``raw`` (default: the tests' base config)."""
    return ProxyProcess(
        raw or base_config(fake.base_url, redis_server.url), tmp_path, args=("--workers", "2")
    )


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_to_the_whole_group_is_still_a_graceful_shutdown(
    sig: signal.Signals,
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    # Each worker got the signal twice (the group's, the supervisor's): the second cut the grace
    # period short, the stream was billed "shutdown" at its reserve and serve exited 1.
    raw = base_config(fake.base_url, redis_server.url, shutdown_grace_s=20)
    proxy = _two_workers(fake, redis_server, tmp_path, raw).start()
    try:
        await _until(lambda: proxy.log().count('"msg":"listening"') == 2)
        body, headers = slow_stream("group-stop", chunks=20, delay_s=0.1)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
            await resp.content.readuntil(b"\n\n")
            proxy.signal_group(sig)
            rest = await resp.read()
        code = await asyncio.to_thread(proxy.wait, 60)
    finally:
        proxy.stop()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert code == 0
    assert [(e["outcome"], e["usage_source"]) for _, e in await redis_client.xrange(LEDGER)] == [
        ("ok", "provider")
    ]


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_sighup_to_a_zero_config_proxy_is_ignored(
    workers: str, fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    # Nothing to reload: SIGHUP kept its default action and killed the process mid-stream.
    args = ("--upstream", fake.base_url, "--redis-url", redis_server.url, "--workers", workers)
    proxy = ProxyProcess(None, tmp_path, args=args).start()
    try:
        await _until(lambda: proxy.log().count('"msg":"listening"') == int(workers))
        body = {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 20,
            "fake": {"reply_tokens": 20, "chunk_delay_s": 0.05},
        }
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {UPSTREAM_KEY}"},
            )
            await resp.content.readuntil(b"\n\n")
            proxy.signal(signal.SIGHUP)
            rest = await resp.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        assert proxy.process is not None and proxy.process.poll() is None
    finally:
        proxy.stop()


async def test_sighup_while_workers_start_does_not_kill_them(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    # Forwarded to workers that had not yet installed their reloader: both died, serve exited 129.
    proxy = _two_workers(fake, redis_server, tmp_path)
    proxy.start(ready=False)
    try:
        await _until(lambda: len(proxy.workers()) == 2)
        proxy.signal(signal.SIGHUP)
        await _until(lambda: proxy.log().count('"msg":"listening"') == 2)
        await asyncio.sleep(0.5)
        assert proxy.process is not None and proxy.process.poll() is None
        assert len(proxy.workers()) == 2
    finally:
        proxy.stop()


def test_a_worker_that_cannot_serve_makes_serve_exit_with_its_code(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    # Worker 1's metrics port (base + 1) taken: it exited 4 and serve ran on with one worker
    # until stopped. One worker alone exits 4 at once: so do N now.
    with socket.socket() as busy:
        while True:
            base = free_port()
            try:
                busy.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                continue
        busy.listen()
        raw = base_config(fake.base_url, redis_server.url)
        raw["metrics"] = {"listen": {"host": "127.0.0.1", "port": base}}
        proxy = _two_workers(fake, redis_server, tmp_path, raw).start(ready=False)
        try:
            assert proxy.wait(30) == 4
        finally:
            proxy.stop()
    assert "a worker ended: stopping the others" in proxy.log()


def test_the_workers_of_a_killed_supervisor_shut_down(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    # They served on as orphans, holding the port (SO_REUSEPORT) beside a restarted instance.
    proxy = _two_workers(fake, redis_server, tmp_path).start()
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = proxy.workers()
            time.sleep(0.1)
        assert len(workers) == 2
        assert proxy.process is not None
        os.kill(proxy.process.pid, signal.SIGKILL)
        proxy.process.wait()
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)]
        assert "the supervisor is gone: shutting down" in proxy.log()
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proxy.stop()


def test_serve_exit_code_when_stopped_is_zero(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    proxy = _two_workers(fake, redis_server, tmp_path).start()
    try:
        proxy.signal(signal.SIGTERM)
        assert proxy.wait(30) == 0
    finally:
        proxy.stop()


async def test_ctrl_c_while_the_workers_start_is_a_clean_stop(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    # A KeyboardInterrupt in a worker's bootstrap made serve exit 1; a stop cut into the app's
    # start hung the worker for good (a cancel redis-py swallowed mid-command left the reaper
    # looping, and shutdown waiting on it).
    proxy = _two_workers(fake, redis_server, tmp_path)
    proxy.start(ready=False)
    try:
        await _until(lambda: len(proxy.workers()) == 2)
        await asyncio.sleep(0.3)  # in run_worker's imports or the app's start
        proxy.signal_group(signal.SIGINT)
        code = await asyncio.to_thread(proxy.wait, 60)
    finally:
        proxy.stop()
    assert code == 0, proxy.log()[-2000:]


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
async def test_a_served_process_runs_on_the_loop_its_config_names_and_bills_on_it(
    choice: str,
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """uvloop by default (``event_loop: auto``), asyncio's own when asked: the listening line
    names it, and a stream, a JSON answer and a stream its client leaves are billed as the
    provider billed them on either."""
    raw = {**base_config(fake.base_url, redis_server.url), "event_loop": choice}
    proxy = ProxyProcess(raw, tmp_path).start()
    try:
        body, headers = slow_stream("loop", chunks=6, delay_s=0.01)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            resp = await session.post(
                proxy.url + "/v1/chat/completions", json={**body, "stream": False}, headers=headers
            )
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 6
            resp = await session.post(
                proxy.url + "/v1/chat/completions", json=slow_stream("loop", 40, 0.05)[0], headers=headers
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()  # the client leaves mid-stream
        await _until(lambda: len(fake.bill) == 3)
        ledger: list[dict[str, Any]] = []

        async def three_billed() -> bool:
            ledger[:] = [e for _, e in await redis_client.xrange(LEDGER)]
            return len(ledger) == 3

        deadline = time.monotonic() + 30
        while not await three_billed():
            assert time.monotonic() < deadline, ledger
            await asyncio.sleep(0.05)
    finally:
        proxy.stop()
    listening = [line for line in proxy.log().splitlines() if '"msg":"listening"' in line]
    named = "uvloop" if choice == "auto" else choice
    assert len(listening) == 1 and f'"event_loop":"{named}"' in listening[0]
    assert [e["outcome"] for e in ledger] == ["ok", "ok", "client_disconnected"]
    assert [int(e["output_tokens"]) for e in ledger] == [b.completion_tokens for b in fake.bill]
    assert [int(e["input_tokens"]) for e in ledger] == [b.prompt_tokens for b in fake.bill]


def test_auto_serves_on_asyncios_loop_where_uvloop_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop: ImportError
    loop, name = new_event_loop("auto")
    loop.close()
    assert (name, type(loop).__module__.split(".")[0]) == ("asyncio", "asyncio")
    with pytest.raises(ImportError):
        new_event_loop("uvloop")


async def test_the_suite_runs_on_the_loop_the_proxy_serves_on() -> None:
    module = type(asyncio.get_running_loop()).__module__.split(".")[0]
    assert module == ("asyncio" if TEST_EVENT_LOOP == "asyncio" else "uvloop")


_STOP_BEFORE_THE_LOOP_RUNS = """
import os, signal, sys
from pathlib import Path
from proxy import workers
from proxy.config_load import load_config

run_app = workers.web.run_app

def signalled_first(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # a stop after the worker's set-up, before its loop runs
    return run_app(*args, **kwargs)

workers.web.run_app = signalled_first
sys.exit(workers.run_worker(load_config(Path(sys.argv[1]), dict(os.environ)), False, None, 0, 1))
"""


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
def test_a_stop_just_before_the_loop_runs_is_kept(
    choice: str, fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """On uvloop the loop's signal handlers, installed before it ran, took the signal over but
    listened only once it ran: the stop was lost and the worker served on."""
    raw = {**base_config(fake.base_url, redis_server.url), "event_loop": choice}
    raw["listen"] = {"host": "127.0.0.1", "port": free_port()}
    raw["journal_dir"] = str(tmp_path / "journal")
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "TEST_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _STOP_BEFORE_THE_LOOP_RUNS, str(path)],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"msg":"stopped"' in done.stderr, done.stderr[-2000:]


def test_a_second_instance_with_workers_on_a_served_port_cannot_serve(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """README: exit 4 when the address cannot be served (port in use). With ``--workers`` the
    listeners set SO_REUSEPORT, and a second ``serve --workers 2`` (a stale instance, an old
    version left running) binds beside the first and takes half the connections."""
    import yaml

    raw = base_config(fake.base_url, redis_server.url)
    first = ProxyProcess(raw, tmp_path / "a", args=("--workers", "2")).start()
    second = ProxyProcess(raw, tmp_path / "b", args=("--workers", "2"))
    on_disk = yaml.safe_load(second.config_path.read_text())
    on_disk["listen"]["port"] = first.port
    second.config_path.write_text(yaml.safe_dump(on_disk))
    second.port = first.port
    try:
        second.start(ready=False)
        try:
            code = second.wait(20)
        except Exception:
            code = None
        assert code == 4, second.log()[-2000:]
        assert "cannot serve" in second.log()
    finally:
        second.stop()
        first.stop()
    # Once it has stopped (its connections in TIME_WAIT), the port is served again at once.
    third = ProxyProcess(raw, tmp_path / "c", args=("--workers", "2"))
    on_disk["journal_dir"] = str(tmp_path / "c" / "journal")
    third.config_path.write_text(yaml.safe_dump(on_disk))
    third.port = first.port
    try:
        third.start()
    finally:
        third.stop()


def _on_port(proc: ProxyProcess, port: int, workdir: Path) -> ProxyProcess:
    on_disk: dict[str, Any] = yaml.safe_load(proc.config_path.read_text())
    on_disk["listen"]["port"] = port
    on_disk["journal_dir"] = str(workdir / "journal")
    proc.config_path.write_text(yaml.safe_dump(on_disk))
    proc.port = port
    return proc


def _served_and_closed_by_the_server(port: int) -> None:
    """A call the server ends (``Connection: close``): its side of the connection is the one
    left in TIME_WAIT, on the listen port, for a minute."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):  # until the server's FIN: it closed first
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_workers_start_right_after_a_single_process_serve_on_the_same_port(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """Moving an instance from ``serve`` to ``serve --workers 2`` (a restart with a new unit
    file): the single process served calls and stopped; its connections sit in TIME_WAIT. The
    workers' own bind passes them (SO_REUSEADDR), but the supervisor's claim (SO_REUSEPORT alone)
    does not: exit 4, 'Address already in use', on a port nothing serves."""
    raw = base_config(fake.base_url, redis_server.url)
    single = ProxyProcess(raw, tmp_path / "a").start()
    try:
        for _ in range(3):
            _served_and_closed_by_the_server(single.port)
    finally:
        single.stop()
    assert single.wait(15) == 0
    workers = _on_port(
        ProxyProcess(raw, tmp_path / "b", args=("--workers", "2")), single.port, tmp_path / "b"
    )
    try:
        workers.start()  # raises 'proxy exited' with the log where it could not serve
    finally:
        workers.stop()


def test_a_second_instance_is_still_refused_while_the_first_starts_or_serves(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """The claim keeps its point after the fix: a second ``--workers`` instance on a port a
    first one (started where TIME_WAIT connections were) serves exits 4."""
    raw = base_config(fake.base_url, redis_server.url)
    single = ProxyProcess(raw, tmp_path / "a").start()
    try:
        _served_and_closed_by_the_server(single.port)
    finally:
        single.stop()
    first = _on_port(ProxyProcess(raw, tmp_path / "b", args=("--workers", "2")), single.port, tmp_path / "b")
    second = _on_port(ProxyProcess(raw, tmp_path / "c", args=("--workers", "2")), single.port, tmp_path / "c")
    try:
        first.start()
        second.start(ready=False)
        assert second.wait(20) == 4, second.log()[-2000:]
    finally:
        second.stop()
        first.stop()


async def test_a_grace_period_of_0_ends_inflight_calls_at_once(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """``shutdown_grace_s: 0`` was passed on to aiohttp as a shutdown timeout of 0, which it
    reads as none at all: SIGTERM waited for every in-flight call to end by itself (the stream
    here ran to its end, billed ``ok``)."""
    raw = base_config(fake.base_url, redis_server.url, shutdown_grace_s=0)
    raw["upstreams"]["openai"]["timeout_s"] = 60
    proxy = ProxyProcess(raw, tmp_path).start()
    try:
        body, headers = slow_stream("no-grace", chunks=100, delay_s=0.05)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
            await resp.content.readuntil(b"\n\n")
            proxy.signal(signal.SIGTERM)
            rest = b""
            with contextlib.suppress(aiohttp.ClientPayloadError):
                rest = await resp.read()
        code = await asyncio.to_thread(proxy.wait, 60)
    finally:
        proxy.stop()
    ledger = [e for _, e in await redis_client.xrange(LEDGER)]
    assert [e["outcome"] for e in ledger] == ["shutdown"], rest[-60:]
    assert not rest.endswith(b"data: [DONE]\n\n")
    assert code == 0


# ``serve`` as the command line runs it, with a Ctrl-C at the terminal (SIGINT to the whole
# process group) timed to land while the supervisor starts its workers: right after the first
# one is started. Nothing else is changed.
_CTRL_C_AS_THE_WORKERS_START = """
import os, signal, sys
import multiprocessing.context as context
from proxy import cli

start = context.SpawnProcess.start

def start_then_ctrl_c(self):
    start(self)
    if self.name == "worker-0":
        os.killpg(0, signal.SIGINT)

context.SpawnProcess.start = start_then_ctrl_c
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_ctrl_c_while_the_supervisor_starts_its_workers_stops_serve(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """README, Shutdown: SIGTERM (or SIGINT) stops the proxy and exits 0. The supervisor set
    SIGINT to SIG_IGN while it started its workers (so that they inherited it across exec), and
    the workers kept it ignored until ``run_worker`` installed its handler: a Ctrl-C in that
    window was dropped by every process of the group, and ``serve --workers 2`` served on for
    good (the workers hunt). Held (blocked) instead, it is taken once the handlers are in place."""
    proxy = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path, args=("--workers", "2"))
    # In a session of its own: the Ctrl-C reaches it and its workers only.
    proxy.start(ready=False, script=_CTRL_C_AS_THE_WORKERS_START)
    try:
        try:
            code: int | None = proxy.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        serving = proxy.log().count('"msg":"listening"')
    finally:
        proxy.stop()
    assert code == 0, f"serve still running 30 s after Ctrl-C, {serving} workers listening"


# ``serve`` as the command line runs it, recording the signal mask each process it spawns
# inherits (the mask of the calling thread when the spawn is made), then stopping itself once
# both workers are started. Nothing else is changed.
_RECORD_SPAWN_MASKS = """
import os, signal, sys
import multiprocessing.util as util
import multiprocessing.context as context
from proxy import cli

spawnv = util.spawnv_passfds

def recording(path, args, passfds):
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    kind = "tracker" if "resource_tracker" in repr(args) else "worker"
    with open(os.environ["SPAWN_MASKS"], "a") as out:
        out.write(f"{kind} {int(signal.SIGINT in blocked)} {int(signal.SIGHUP in blocked)}\\n")
    return spawnv(path, args, passfds)

util.spawnv_passfds = recording
start = context.SpawnProcess.start

def start_then_stop(self):
    start(self)
    if self.name == "worker-1":
        os.kill(os.getpid(), signal.SIGTERM)  # every worker started: serve may stop now

context.SpawnProcess.start = start_then_stop
sys.exit(cli.main(sys.argv[1:]))
"""


def test_every_worker_is_spawned_with_ctrl_c_and_sighup_held(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """The first worker's start launched multiprocessing's resource tracker, whose
    ``ensure_running`` blocks SIGINT around its own spawn and then unblocks it in the caller:
    every worker was spawned with SIGINT deliverable, a Ctrl-C in its bootstrap a
    KeyboardInterrupt traceback (the review of 6d9600c)."""
    masks = tmp_path / "spawn-masks.txt"
    proxy = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path, args=("--workers", "2"))
    proxy.start(ready=False, script=_RECORD_SPAWN_MASKS, extra_env={"SPAWN_MASKS": str(masks)})
    try:
        proxy.wait(60)
    finally:
        proxy.stop()
    spawned = [line.split() for line in masks.read_text().splitlines()]
    workers = [(int(sigint), int(sighup)) for kind, sigint, sighup in spawned if kind == "worker"]
    assert len(workers) == 2, spawned
    # (SIGINT held, SIGHUP held) in each worker as it is spawned; found: SIGINT not held in either.
    assert workers == [(1, 1), (1, 1)], f"{spawned}: a Ctrl-C in a worker's bootstrap is not held"
