"""Figures of the store's own processes and clients that no other test pinned (found by a
mutation hunt): how the embedded ``redis-server`` is launched, where its socket goes, how it is
stopped, started again and taken over (``redis_server``), and how the Cluster client queues its
commands and tells a command never sent from one that may have run (``redis_cluster``)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from proxy.errors import ConfigError, StoreError
from proxy.redis_cluster import PIPELINE_CONNECTIONS, QueuedCluster
from proxy.redis_server import (
    SOCKET_PATH_MAX_BYTES,
    EmbeddedKeeper,
    RedisServerProcess,
    find_server_binary,
    free_port,
    socket_path_for,
)
from proxy.redis_store import RedisStore
from proxy.store import Reservation, Scope
from tests import test_cluster_resharding as resharding_tests
from tests import test_redis_cluster as cluster_tests
from tests import test_redis_server as server_tests
from tests.cluster import RedisClusterProcesses
from tests.procs import ROOT

_redis_pids = server_tests._redis_pids
_until = server_tests._until
# A private, short temporary base (a deep data directory's socket goes there).
short_tmp = server_tests.short_tmp
own_cluster = cluster_tests.own_cluster


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[RedisServerProcess]:
    """The embedded server as ``serve`` starts it: on a unix socket in its data directory."""
    server = RedisServerProcess(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def _config(server: RedisServerProcess, name: str) -> str:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        return str(client.config_get(name)[name])
    finally:
        client.close()


# -- which binary ---------------------------------------------------------------------------


def test_redis_server_is_preferred_to_valkey_server_and_neither_is_an_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README: "starts redis-server (or valkey-server)".
    real = shutil.which("redis-server")
    assert real is not None
    both, valkey_only = tmp_path / "both", tmp_path / "valkey-only"
    for directory, names in ((both, ("valkey-server", "redis-server")), (valkey_only, ("valkey-server",))):
        directory.mkdir()
        for name in names:
            (directory / name).symlink_to(real)
    monkeypatch.setenv("PATH", str(both))
    assert find_server_binary() == str(both / "redis-server")
    monkeypatch.setenv("PATH", str(valkey_only))
    assert find_server_binary() == str(valkey_only / "valkey-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="apt-get install redis-server"):
        find_server_binary()


# -- how the embedded server runs ----------------------------------------------------------


def test_the_embedded_server_keeps_an_aof_synced_every_second_and_no_snapshots(
    embedded: RedisServerProcess,
) -> None:
    # README: "a private redis-server child with AOF persistence". ``always`` would fsync every
    # reserve (the hot path); an RDB snapshot forks the whole store every so often for nothing.
    assert _config(embedded, "appendonly") == "yes"
    assert _config(embedded, "appendfsync") == "everysec"
    assert _config(embedded, "save") == ""


def test_the_embedded_server_never_evicts_a_budgets_counter(embedded: RedisServerProcess) -> None:
    # README: "Give it maxmemory-policy noeviction (the embedded server runs so)".
    assert _config(embedded, "maxmemory-policy") == "noeviction"


def test_the_embedded_server_listens_on_its_private_socket_only(embedded: RedisServerProcess) -> None:
    # The socket's permissions are the store's only access control: no TCP port beside it (a
    # redis-server started without --port listens on 6379 for anyone on the host), and a socket
    # only its user may connect to.
    assert _config(embedded, "port") == "0"
    assert _config(embedded, "unixsocketperm") == "700"
    assert stat.S_IMODE(embedded.socket_path.stat().st_mode) == 0o700


def test_a_server_on_a_port_listens_on_loopback_only(own_redis: RedisServerProcess) -> None:
    assert own_redis.url == f"redis://127.0.0.1:{own_redis.port}/0"
    assert _config(own_redis, "bind") == "127.0.0.1"


def test_the_embedded_servers_url_names_database_0(embedded: RedisServerProcess) -> None:
    # An operator's redis-cli on the socket (database 0 unless told) sees what the proxy wrote.
    client = redis.Redis.from_url(embedded.url, decode_responses=True)
    client.set("written-through-the-url", "1")
    client.close()
    plain = redis.Redis(unix_socket_path=str(embedded.socket_path), db=0, decode_responses=True)
    try:
        assert plain.get("written-through-the-url") == "1"
    finally:
        plain.close()


def test_the_embedded_server_runs_in_a_session_of_its_own(embedded: RedisServerProcess) -> None:
    # A ^C in the proxy's terminal goes to its whole process group: a server in that group would
    # die before the proxy settled its calls in flight.
    assert embedded.process is not None
    assert os.getsid(embedded.process.pid) == embedded.process.pid


async def test_a_data_dir_whose_path_holds_url_characters_is_reached_by_its_url(short_tmp: Path) -> None:
    # '#' and '?' would end the URL's path, '%41' would be read as 'A': the URL quotes them, for
    # redis-py and the scripts' own connection (``resp``) alike.
    data = short_tmp / "a#b?c%41"
    server = RedisServerProcess(data)
    assert server.socket_path == data / "redis.sock"
    await asyncio.to_thread(server.start)
    store = RedisStore.from_url(server.url)
    try:
        await store.ping()
        await store.load_scripts()
        assert isinstance(await cluster_tests.reserve(store), Reservation)
    finally:
        await store.close()
        await asyncio.to_thread(server.stop)


# -- where the socket goes -----------------------------------------------------------------


def _data_dir_with_socket_of(base: Path, size: int) -> Path:
    """A data directory under ``base`` whose socket inside is exactly ``size`` bytes long."""
    pad = size - len(os.fsencode(base / "d" / "redis.sock"))
    data = base / ("d" * (1 + pad))
    assert len(os.fsencode(data / "redis.sock")) == size
    return data


def test_a_socket_path_of_exactly_the_limit_stays_inside_the_data_dir(tmp_path: Path) -> None:
    data = _data_dir_with_socket_of(tmp_path, SOCKET_PATH_MAX_BYTES)
    assert socket_path_for(data) == data / "redis.sock"


def test_a_socket_path_one_byte_over_what_macos_takes_goes_to_the_short_path(tmp_path: Path) -> None:
    # sun_path is 104 bytes on macOS, its NUL included: a 104-byte path fails to bind there.
    assert SOCKET_PATH_MAX_BYTES == 103
    data = _data_dir_with_socket_of(tmp_path, 104)
    assert socket_path_for(data).parent != data


def test_a_deep_data_dirs_socket_path_is_the_one_every_version_looks_for(short_tmp: Path) -> None:
    # A proxy upgraded while the server an older one started still runs must find it there,
    # and a user's directory is its own (another user's proxy would find it not private).
    deep = server_tests._deep(short_tmp)
    digest = hashlib.sha256(os.fsencode(deep)).hexdigest()[:16]
    expected = short_tmp / f"llm-billing-proxy-{os.getuid()}" / f"redis-{digest}.sock"
    assert socket_path_for(deep) == expected


def test_a_short_path_of_exactly_the_limit_is_used_in_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = server_tests._deep(tmp_path)
    tail = f"/llm-billing-proxy-{os.getuid()}/redis-{'0' * 16}.sock"
    base = Path(tempfile.mkdtemp(prefix="lbp-", dir="/tmp"))
    try:
        padded = base / ("p" * (SOCKET_PATH_MAX_BYTES - len(os.fsencode(str(base) + "/" + tail))))
        monkeypatch.setattr(tempfile, "tempdir", str(padded))
        short = socket_path_for(deep)
        assert len(os.fsencode(short)) == SOCKET_PATH_MAX_BYTES
        assert short.is_relative_to(padded)
    finally:
        base.rmdir()


def test_a_socket_directory_of_another_user_is_refused(tmp_path: Path, short_tmp: Path) -> None:
    server = RedisServerProcess(server_tests._deep(tmp_path))
    server.socket_path.parent.mkdir(mode=0o700)
    if os.getuid() != 0:
        pytest.skip("only root can hand a directory to another user")
    os.chown(server.socket_path.parent, os.getuid() + 4242, -1)
    with pytest.raises(ConfigError, match="not a private directory"):
        server.start()
    assert server.process is None


def test_a_file_where_the_socket_directory_goes_is_refused(tmp_path: Path, short_tmp: Path) -> None:
    server = RedisServerProcess(server_tests._deep(tmp_path))
    server.socket_path.parent.write_text("")
    os.chmod(server.socket_path.parent, 0o600)
    with pytest.raises(ConfigError, match="not a private directory"):
        server.start()
    assert server.process is None


def test_a_socket_directory_its_group_can_enter_is_refused(tmp_path: Path, short_tmp: Path) -> None:
    server = RedisServerProcess(server_tests._deep(tmp_path))
    server.socket_path.parent.mkdir()
    os.chmod(server.socket_path.parent, 0o750)
    with pytest.raises(ConfigError, match="not a private directory"):
        server.start()
    assert server.process is None


# -- start and stop ------------------------------------------------------------------------


def test_a_server_that_fails_to_start_says_why_from_the_end_of_its_log(tmp_path: Path) -> None:
    # The log holds every earlier run too: the reason is at its end.
    data = tmp_path / "redis"
    earlier = RedisServerProcess(data, port=free_port())
    earlier.start()
    earlier.stop()
    assert len((data / "redis.log").read_text()) > 500
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = RedisServerProcess(data, port=int(taken.getsockname()[1]))
        with pytest.raises(ConfigError, match="exited at start") as failed:
            server.start()
    assert "Address already in use" in str(failed.value)


def test_a_server_that_does_not_answer_in_time_is_stopped(tmp_path: Path) -> None:
    server = RedisServerProcess(tmp_path / "redis")
    try:
        with pytest.raises(ConfigError, match="did not answer"):
            server.start(timeout_s=0)
        assert server.process is not None and server.process.poll() is not None
    finally:
        if server.process is not None and server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_a_server_tells_its_pid_is_stopped_gracefully_and_killed_as_a_crash(tmp_path: Path) -> None:
    # SIGTERM: redis fsyncs its AOF, removes its socket and exits 0.
    stopped = RedisServerProcess(tmp_path / "stopped")
    stopped.start()
    assert stopped.process is not None
    # The pid a proxy taking a server over signals on its way out.
    assert stopped.server_pid() == stopped.process.pid
    stopped.stop()
    assert stopped.process is not None and stopped.process.returncode == 0
    assert not stopped.socket_path.exists()
    killed = RedisServerProcess(tmp_path / "killed")
    killed.start()
    killed.kill()
    assert killed.process is not None and killed.process.returncode == -signal.SIGKILL


def test_a_server_that_ignores_its_stop_is_killed(tmp_path: Path) -> None:
    server = RedisServerProcess(tmp_path / "redis")
    server.start()
    assert server.process is not None
    pid = server.process.pid
    os.kill(pid, signal.SIGSTOP)  # hung: SIGTERM does nothing
    stopping = threading.Thread(target=server.stop, kwargs={"timeout_s": 0.2})
    stopping.start()
    stopping.join(15)
    try:
        assert not stopping.is_alive(), "stop() waits for ever on a hung server"
        assert server.process.returncode == -signal.SIGKILL
    finally:
        if stopping.is_alive():
            os.kill(pid, signal.SIGKILL)
            stopping.join()


def test_a_server_that_does_not_answer_is_not_taken_for_answering(own_redis: RedisServerProcess) -> None:
    # A server slow to answer (an AOF rewrite's fork, a long script): answers_ping says no rather
    # than raise, which would end the keeper's thread (never started again) or the CLI.
    assert own_redis.process is not None
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    try:
        assert not own_redis.answers_ping()
    finally:
        os.kill(own_redis.process.pid, signal.SIGCONT)
    assert own_redis.answers_ping()


# -- the keeper ----------------------------------------------------------------------------


def test_the_keeper_looks_every_second_and_waits_a_minute_for_a_start(tmp_path: Path) -> None:
    # README: a server that dies "is started again from its AOF within a second"; a large AOF
    # takes a while to load.
    keeper = EmbeddedKeeper(RedisServerProcess(tmp_path / "redis"))
    assert (keeper.interval_s, keeper.start_timeout_s) == (1.0, 60.0)


def test_a_server_started_by_hand_on_the_data_dir_gets_no_second_server_on_its_aof(tmp_path: Path) -> None:
    # It holds no lock (started by hand, or by an older version): the keeper finds the lock free,
    # yet a second server there would unlink the first's socket and write the same AOF.
    data = tmp_path / "redis"
    by_hand = RedisServerProcess(data)
    by_hand.start()
    keeper = EmbeddedKeeper(RedisServerProcess(data))
    try:
        assert not keeper.ensure()
        assert by_hand.process is not None
        assert _redis_pids(data) == [by_hand.process.pid]
    finally:
        keeper.close()
        by_hand.stop()
    assert not _redis_pids(data)


_KILLED_PROXY = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from proxy.redis_server import EmbeddedKeeper, RedisServerProcess\n"
    "assert EmbeddedKeeper(RedisServerProcess(Path(sys.argv[1]))).ensure()\n"
    "os._exit(0)  # as a proxy killed -9: its server lives on\n"
)


def test_a_server_taken_over_is_owned_then_stopped_gracefully_before_close_returns(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", _KILLED_PROXY, str(data)], cwd=str(ROOT), env=env, check=True)
    assert len(_redis_pids(data)) == 1  # in a session of its own: it outlived its proxy
    keeper = EmbeddedKeeper(RedisServerProcess(data))
    try:
        assert not keeper.ensure()
        # The next proxy on the directory must find this live owner, not take the server over too.
        assert (data / "server.owner").read_text() == str(os.getpid())
    finally:
        keeper.close()
    assert _redis_pids(data) == [], "close() returned with the taken-over server still running"
    # SIGTERM, not SIGKILL: its AOF is flushed.
    assert "ready to exit" in (data / "redis.log").read_text()
    server_tests._kill_left(data)


def test_a_server_that_cannot_start_is_tried_until_it_can(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An AOF that redis refuses (an operator repairs it with redis-check-aof): each round's
    # failed start is logged and the next one tried; one failure must not end the keeper.
    caplog.set_level(logging.ERROR, "proxy.redis_server")
    data = tmp_path / "redis"
    keeper = EmbeddedKeeper(RedisServerProcess(data), interval_s=0.1, start_timeout_s=5)
    assert keeper.ensure()
    keeper.watch()
    try:
        client = redis.Redis.from_url(keeper.server.url)
        client.set("kept", "1")
        client.close()
        (manifest,) = (data / "appendonlydir").glob("*.manifest")
        good = manifest.read_bytes()
        manifest.write_bytes(b"not a manifest\n")
        keeper.server.kill()
        _until(lambda: any("could not be started again" in r.getMessage() for r in caplog.records))
        manifest.write_bytes(good)
        _until(keeper.server.answers_ping)
        client = redis.Redis.from_url(keeper.server.url)
        assert client.get("kept") == b"1"
        client.close()
    finally:
        keeper.close()
    assert not _redis_pids(data)


# -- the Cluster client's queue ------------------------------------------------------------


def test_a_cluster_nodes_pool_holds_the_commands_and_8_connections_for_the_views() -> None:
    # README: "commands at once per process ... plus 8 connections per node for the billing views".
    assert PIPELINE_CONNECTIONS == 8
    client = QueuedCluster.queued_from_url("redis://127.0.0.1:1", pool_size=3, socket_timeout_s=0.5)
    assert client.nodes_manager.connection_kwargs["max_connections"] == 11


async def test_a_reserve_that_finds_every_command_permit_taken_waits_then_was_never_sent(
    cluster: RedisClusterProcesses,
) -> None:
    """``pool_size`` commands at once, the next waiting its turn up to the socket timeout: one
    that got none never went out (the call is released, not billed at its reserve)."""
    store = RedisStore.from_url(cluster.url, cluster=True, pool_size=2, socket_timeout_s=0.3)
    client: Any = store.client
    try:
        await store.load_scripts()
        # Two calls' commands in flight hold both permits (what a burst does, minus the timing).
        for _ in range(2):
            await client._permits.acquire()
        async with asyncio.timeout(10):
            with pytest.raises(StoreError) as failed:
                await cluster_tests.reserve(store)
        assert "no connection to the cluster free within 0.3 s" in str(failed.value)
        assert not failed.value.maybe_applied
        client._permits.release()  # one of them done: the next command goes
        assert isinstance(await cluster_tests.reserve(store), Reservation)
        client._permits.release()
    finally:
        await store.close()


async def test_at_most_8_billing_view_pipelines_run_at_once_the_next_waits_the_socket_timeout(
    cluster: RedisClusterProcesses,
) -> None:
    store = RedisStore.from_url(cluster.url, cluster=True, pool_size=2, socket_timeout_s=0.3)
    client: Any = store.client
    keys = ["lbp:{team-a}:run:v1", "lbp:{team-a}:run:v2"]
    try:
        for _ in range(8):  # eight views' pipelines in flight
            await client._pipeline_permits.acquire()
        async with asyncio.timeout(10):
            with pytest.raises(StoreError, match=r"no connection to the cluster free within 0\.3 s"):
                await store.scope_meters(tenant="team-a", keys=keys)
        client._pipeline_permits.release()
        assert set(await store.scope_meters(tenant="team-a", keys=keys)) == set(keys)
        for _ in range(7):
            client._pipeline_permits.release()
    finally:
        await store.close()


def _move_slot_of(cluster: RedisClusterProcesses, tag: str) -> None:
    with resharding_tests.resharding(cluster, tag):
        pass


async def test_a_billing_view_follows_its_tenants_slot_moved_to_another_master(
    cluster: RedisClusterProcesses,
) -> None:
    # The client still names the slot's old master: the view's pipeline is answered MOVED and
    # must follow it, not fail a view (503) for every resharding.
    store = RedisStore.from_url(cluster.url, cluster=True, socket_timeout_s=2)
    try:
        scope = await resharding_tests.reserved(store, "team-moved", "moved-1", "moved-run")
        await asyncio.to_thread(_move_slot_of, cluster, "team-moved")
        meters = await store.scope_meters(tenant="team-moved", keys=[scope.key])
        assert meters[scope.key]["requests"].reserved == 1
    finally:
        await store.close()


async def test_a_reserve_whose_master_refuses_every_connection_was_never_sent(
    own_cluster: RedisClusterProcesses,
) -> None:
    """The tenant's master gone before the call, no connection to it open: every try was
    refused at connect, so the reserve never went out and the call is released, not billed at
    its reserve by a reaper."""
    victim = await asyncio.to_thread(own_cluster.master_of, "team-a")
    entry = next(node for node in own_cluster.nodes if node is not victim)
    store = RedisStore.from_url(entry.url, cluster=True, socket_timeout_s=1)
    client = store.client
    assert isinstance(client, RedisCluster)
    try:
        # The topology known, as in a serving proxy; a connection open to the victim would make
        # the first try a write to a dead socket, which may have gone out.
        await client.initialize()
        victim_node = client.get_node(host="127.0.0.1", port=victim.port)
        assert victim_node is not None
        await victim_node.disconnect()
        await asyncio.to_thread(victim.kill)
        with pytest.raises(StoreError) as failed:
            await cluster_tests.reserve(store)
        assert not failed.value.maybe_applied, failed.value
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("setting", "value", "reply"),
    [("min-replicas-to-write", "1", "NOREPLICAS"), ("maxmemory", "1", "maxmemory")],
    ids=["NOREPLICAS", "OOM"],
)
async def test_a_reserve_its_master_refused_with_an_error_reply_was_not_applied(
    cluster: RedisClusterProcesses, setting: str, value: str, reply: str
) -> None:
    """An error reply says the script did not run: the call is released (503), not held as a
    reserve that may have run and billed at it by a reaper."""
    master = await asyncio.to_thread(cluster.master_of, "team-a")
    assert master.port is not None
    admin = redis.Redis(port=master.port, decode_responses=True)
    before = str(admin.config_get(setting)[setting])
    store = RedisStore.from_url(cluster.url, cluster=True, socket_timeout_s=1)
    try:
        await store.load_scripts()
        admin.config_set(setting, value)
        with pytest.raises(StoreError, match=reply) as failed:
            await store.reserve(
                tenant="team-a",
                reservation_id=f"refused-{reply}",
                run_id="refused",
                scopes=[Scope(name="run", key="lbp:{team-a}:run:refused")],
                amounts=cluster_tests.AMOUNTS,
                lease_ms=60_000,
                record="{}",
            )
        assert not failed.value.maybe_applied
    finally:
        admin.config_set(setting, before)
        admin.close()
        await store.close()


def test_a_start_refused_before_the_log_opens_quotes_what_the_server_said(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    earlier = RedisServerProcess(data, port=free_port())
    earlier.start()
    earlier.stop()
    # A bad option is told on stderr only: this start never opens the log, whose end is the
    # earlier run's, a server that was ready and then stopped: no reason for this failure.
    server = RedisServerProcess(data, port=free_port(), extra_args=("--no-such-option", "1"))
    with pytest.raises(ConfigError, match="exited at start") as failed:
        server.start()
    assert "no-such-option" in str(failed.value), failed.value
    assert "bye bye" not in str(failed.value), failed.value
