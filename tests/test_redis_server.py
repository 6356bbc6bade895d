"""The embedded server's unix socket: a data directory deep enough that its socket path does
not fit sun_path (108 bytes) made the README's start command fail in a deep checkout."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from proxy.errors import ConfigError
from proxy.redis_server import (
    SOCKET_PATH_MAX_BYTES,
    EmbeddedKeeper,
    RedisServerProcess,
    free_port,
    socket_path_for,
)
from tests.conftest import KEY_A, base_config
from tests.fake_upstream import FakeUpstream
from tests.procs import ROOT, ProxyProcess


@pytest.fixture
def short_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private, short temporary base, so these tests never touch the shared one."""
    base = Path(tempfile.mkdtemp(prefix="lbp-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    for path in sorted(base.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    base.rmdir()


def _deep(tmp_path: Path) -> Path:
    deep = tmp_path.joinpath(*(["a-rather-long-directory-name"] * 4)) / "redis"
    assert len(os.fsencode(deep / "redis.sock")) > SOCKET_PATH_MAX_BYTES
    return deep


def test_a_short_data_dir_keeps_its_socket_inside(tmp_path: Path) -> None:
    assert socket_path_for(tmp_path / "redis") == tmp_path / "redis" / "redis.sock"


def test_a_deep_data_dir_starts_on_a_short_private_socket_found_again(
    tmp_path: Path, short_tmp: Path
) -> None:
    deep = _deep(tmp_path)
    server = RedisServerProcess(deep)
    server.start()
    try:
        assert len(os.fsencode(server.socket_path)) <= SOCKET_PATH_MAX_BYTES
        assert server.socket_path.is_relative_to(short_tmp)
        assert stat.S_IMODE(server.socket_path.parent.stat().st_mode) == 0o700
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
        # A second proxy on the same data directory finds the running server, as with a
        # socket inside it; another data directory does not.
        assert RedisServerProcess(deep).answers_ping()
        assert not RedisServerProcess(_deep(tmp_path / "other")).answers_ping()
        assert (deep / "redis.log").exists()  # the data stays in the data directory
    finally:
        server.stop()


def test_a_socket_directory_others_can_enter_is_refused(tmp_path: Path, short_tmp: Path) -> None:
    server = RedisServerProcess(_deep(tmp_path))
    server.socket_path.parent.mkdir(mode=0o755)
    os.chmod(server.socket_path.parent, 0o755)
    with pytest.raises(ConfigError, match="not a private directory"):
        server.start()
    assert server.process is None


def test_a_data_dir_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    # Was a NotADirectoryError traceback out of serve, exit 1 (not a documented code).
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"redis\.data_dir"):
        RedisServerProcess(tmp_path / "a-file" / "redis").start()


def test_a_server_of_another_answering_on_its_port_is_not_taken_for_its_own(tmp_path: Path) -> None:
    """A port picked free may be taken before the server listens on it (the suite's processes
    pick theirs side by side): the start waited only for a PONG, and took another's server for
    its own, whose data a test then flushed. Now it fails as its own server does, unable to
    listen, and the other is left as it was."""
    other = RedisServerProcess(tmp_path / "other", port=free_port())
    other.start()
    try:
        client = redis.Redis(port=other.port)
        client.set("others", "data")
        late = RedisServerProcess(tmp_path / "late", port=other.port)
        with pytest.raises(ConfigError, match="exited at start"):
            late.start()
        assert late.process is not None and late.process.poll() is not None
        assert client.get("others") == b"data"
        client.close()
    finally:
        other.stop()


# -- the keeper: the embedded server of a serving proxy (found by a hunt) --------------------


def _redis_pids(data_dir: Path) -> list[int]:
    """redis-server renames its process (and is a link to redis-check-rdb on Debian); it runs
    with its working directory in --dir."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            exe, cwd = os.readlink(f"/proc/{pid}/exe"), os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if exe.rsplit("/", 1)[-1] in ("redis-server", "redis-check-rdb") and Path(cwd) == data_dir.resolve():
            found.append(int(pid))
    return found


def _until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_killed_embedded_server_is_started_again_from_its_aof(tmp_path: Path) -> None:
    # Was never noticed: every call a 503 for ever while /healthz said alive.
    keeper = EmbeddedKeeper(RedisServerProcess(tmp_path / "redis"), interval_s=0.1)
    assert keeper.ensure()
    keeper.watch()
    try:
        client = redis.Redis.from_url(keeper.server.url)
        client.set("kept", "1")
        client.execute_command("BGREWRITEAOF")
        _until(lambda: client.info("persistence")["aof_rewrite_in_progress"] == 0)
        (pid,) = _redis_pids(tmp_path / "redis")
        os.kill(pid, signal.SIGKILL)  # the OOM killer's choice
        _until(lambda: bool(_redis_pids(tmp_path / "redis")) and keeper.server.answers_ping())
        assert redis.Redis.from_url(keeper.server.url).get("kept") == b"1"
    finally:
        keeper.close()
    assert not _redis_pids(tmp_path / "redis")


def test_proxies_on_one_data_dir_share_one_server_and_outlive_each_other(tmp_path: Path) -> None:
    # Two starting at once each started a server on one AOF; the one that attached lost its
    # store for good when the other stopped on its way out.
    keepers = [EmbeddedKeeper(RedisServerProcess(tmp_path / "redis"), interval_s=0.1) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        started = list(pool.map(lambda keeper: keeper.ensure(), keepers))
    try:
        assert sorted(started) == [False, False, False, True]
        assert len(_redis_pids(tmp_path / "redis")) == 1
        for keeper in keepers:
            keeper.watch()
        owner = keepers[started.index(True)]
        owner.close()  # stops the server it started
        _until(lambda: len(_redis_pids(tmp_path / "redis")) == 1 and keepers[0].server.answers_ping())
    finally:
        for keeper in keepers:
            keeper.close()
    assert not _redis_pids(tmp_path / "redis")


def test_a_proxy_waiting_on_a_server_on_its_way_out_starts_the_next_one(tmp_path: Path) -> None:
    # A keeper that found the lock held while the server was stopping waited for a PONG
    # nobody would send (start_timeout_s, 60 s by default): every keeper of the directory
    # could be waiting so, and the proxies served 503s meanwhile (CI saw it).
    data = tmp_path / "redis"
    data.mkdir()
    fd = os.open(data / "server.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    exiting = subprocess.Popen(["sleep", "0.5"], pass_fds=(fd,))  # holds the lock, answers nothing
    os.close(fd)
    keeper = EmbeddedKeeper(RedisServerProcess(data), interval_s=0.1, start_timeout_s=10)
    try:
        assert keeper.ensure()
        assert keeper.server.answers_ping()
    finally:
        keeper.close()
        exiting.wait()
    assert not _redis_pids(data)


def test_a_live_server_slow_to_answer_gets_no_second_server_on_its_aof(tmp_path: Path) -> None:
    # A PING unanswered (an AOF rewrite's fork, a long script) was taken for death: a second
    # server started on the same AOF and the live one's socket was unlinked.
    data = tmp_path / "redis"
    owner = EmbeddedKeeper(RedisServerProcess(data), interval_s=0.1, start_timeout_s=1)
    assert owner.ensure()
    other = EmbeddedKeeper(RedisServerProcess(data), interval_s=0.1, start_timeout_s=1)
    assert not other.ensure()
    other.watch()
    (pid,) = _redis_pids(data)
    try:
        os.kill(pid, signal.SIGSTOP)  # alive, not answering
        time.sleep(1.5)
        assert _redis_pids(data) == [pid]
    finally:
        os.kill(pid, signal.SIGCONT)
        other.close()
        owner.close()
    assert not _redis_pids(data)


def test_a_start_that_fails_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One OSError (a fork refused under the memory pressure that killed the server) ended the
    # keeper's thread: the server was never started again.
    keeper = EmbeddedKeeper(RedisServerProcess(tmp_path / "redis"), interval_s=0.1)
    assert keeper.ensure()
    keeper.watch()
    popen = subprocess.Popen
    refused: list[int] = []

    def refuse_once(*args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(1)
            raise OSError(12, "Cannot allocate memory")
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", refuse_once)
    try:
        (pid,) = _redis_pids(tmp_path / "redis")
        os.kill(pid, signal.SIGKILL)
        _until(lambda: bool(refused) and keeper.server.answers_ping())
        assert keeper._thread is not None and keeper._thread.is_alive()
    finally:
        keeper.close()
    assert not _redis_pids(tmp_path / "redis")


def _embedded(fake: FakeUpstream, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    raw = base_config(fake.base_url, "unused", **overrides)
    raw["redis"] = {"data_dir": str(tmp_path / "redis"), "socket_timeout_s": 1}
    return raw


async def test_an_embedded_server_a_killed_proxy_left_is_adopted_and_stopped(
    fake: FakeUpstream, tmp_path: Path
) -> None:
    """README: the embedded server is stopped on exit. Its proxy killed -9, the server (in a
    session of its own) lives on holding the directory's lock; the next start uses it, and on
    its own exit left it running: no proxy ever stops it again."""
    raw = _embedded(fake, tmp_path)
    first = ProxyProcess(raw, tmp_path).start()
    async with aiohttp.ClientSession() as session:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        headers = {"Authorization": f"Bearer {KEY_A}"}
        async with session.post(first.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
    assert first.process is not None
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait()
    assert len(_redis_pids(tmp_path / "redis")) == 1  # in a session of its own: it lives on
    second = ProxyProcess(raw, tmp_path).start()
    try:
        assert "started embedded redis-server" not in second.log()
        async with aiohttp.ClientSession() as session:
            async with session.post(second.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
    finally:
        second.stop()
    left = _redis_pids(tmp_path / "redis")
    for pid in left:
        os.kill(pid, signal.SIGTERM)
    assert left == [], "the orphaned redis-server outlived the proxy that adopted it"


def _kill_left(data: Path) -> list[int]:
    left = _redis_pids(data)
    for pid in left:
        os.kill(pid, signal.SIGTERM)
    return left


def test_report_does_not_stop_the_server_a_live_proxy_uses(fake: FakeUpstream, tmp_path: Path) -> None:
    """Two proxies serve from one data directory; the one that started the server is killed -9.
    ``report`` (read the ledger, serve nothing) finds the owner dead, takes the server over and
    stops it on its exit, under the proxy still serving on it (its calls fail until its keeper
    starts another). Before the owner file, ``report`` never stopped a server it found running."""
    data = tmp_path / "redis"
    raw = _embedded(fake, tmp_path)
    first = ProxyProcess(raw, tmp_path / "a").start()
    second = ProxyProcess(raw, tmp_path / "b").start()
    try:
        (server,) = _redis_pids(data)
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "proxy",
                "report",
                "--config",
                str(second.config_path),
                "--tenant",
                "team-a",
            ],
            capture_output=True,
            text=True,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert _redis_pids(data) == [server], "report stopped the server a live proxy serves on"
    finally:
        second.stop()
        first.stop()
        _kill_left(data)


_STARTING_PROXY = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from proxy.redis_server import EmbeddedKeeper, RedisServerProcess

    data, go = Path(sys.argv[1]), Path(sys.argv[2])
    start = RedisServerProcess.start

    def start_then_pause(self, *args, **kwargs):
        start(self, *args, **kwargs)
        # The server answers; this proxy has not yet got back from start(): a scheduler's
        # pause, a GC, the 20 ms between its PINGs. Held open here until the test says go.
        while not go.exists():
            time.sleep(0.02)

    RedisServerProcess.start = start_then_pause
    keeper = EmbeddedKeeper(RedisServerProcess(data))
    assert keeper.ensure()
    print("started", flush=True)
    sys.stdin.read()  # serving until the test closes stdin
    keeper.close()
    """
)


def test_a_proxy_starting_beside_one_that_is_starting_never_takes_its_server_over(tmp_path: Path) -> None:
    """The owner file says a dead pid whenever the directory was served before (a clean exit
    leaves it; so does a reboot). Two proxies start at once: the first starts the server and
    records itself only after its start() returns; the second, polling for a PONG, can get it
    in between, read the old owner, find it dead and take over the live proxy's fresh server,
    then stop it on its own exit under the first."""
    data = tmp_path / "redis"
    data.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (data / "server.owner").write_text(str(gone.pid))  # a proxy that ran here before
    go = tmp_path / "go"
    first = subprocess.Popen(
        [sys.executable, "-c", _STARTING_PROXY, str(data), str(go)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    second = EmbeddedKeeper(RedisServerProcess(data))
    try:
        _until(second.server.answers_ping)
        assert not second.ensure()  # the first's server: shared
        go.touch()
        assert first.stdout is not None
        assert first.stdout.readline() == b"started\n"
        (server,) = _redis_pids(data)
        second.close()  # the second proxy stops (an adopted server is stopped before this returns)
        assert _redis_pids(data) == [server], "the second proxy stopped the server of the live first"
    finally:
        go.touch()
        assert first.stdin is not None
        first.stdin.close()
        first.wait(30)
        _kill_left(data)


_SERVING_PROXY = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from proxy.redis_server import EmbeddedKeeper, RedisServerProcess

    assert EmbeddedKeeper(RedisServerProcess(Path(sys.argv[1]))).ensure()
    print("started", flush=True)
    sys.stdin.read()  # serving until killed
    """
)


def test_a_server_whose_proxy_was_killed_is_taken_over_by_one_still_serving_on_it(tmp_path: Path) -> None:
    """Two proxies share a directory's server and the one that started it is killed -9. Only a
    proxy starting there took a server over (``ensure``), never one already serving on it: once
    that one too exited, no proxy was left and the server ran on."""
    data = tmp_path / "redis"
    first = subprocess.Popen(
        [sys.executable, "-c", _SERVING_PROXY, str(data)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    second = EmbeddedKeeper(RedisServerProcess(data), interval_s=0.1)
    try:
        assert first.stdout is not None and first.stdout.readline() == b"started\n"
        assert not second.ensure()  # shared
        second.watch()
        first.kill()  # the OOM killer's choice
        first.wait()
        _until(lambda: (data / "server.owner").read_text() == str(os.getpid()))
    finally:
        first.kill()
        first.wait()
        second.close()
        left = _kill_left(data)
    assert left == [], "the server outlived the last proxy of its directory"
