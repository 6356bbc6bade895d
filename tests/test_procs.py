"""The suite's own proxy processes (``tests/procs.py``): a start is ready only when its proxy is."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.redis_server import RedisServerProcess
from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess, listening_inodes, sockets_of


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def another_server() -> Iterator[int]:
    """A server that answers ``/readyz`` on a port of its own, as another test process's proxy."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_sockets_listening_are_told_by_their_process(another_server: int) -> None:
    ours = listening_inodes(another_server)
    assert ours and ours <= sockets_of([os.getpid()])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not ours & sockets_of([child.pid])
    finally:
        child.kill()
        child.wait()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening
        assert not listening_inodes(unused.getsockname()[1])


async def test_a_start_is_not_ready_on_another_servers_answer(
    another_server: int, fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """Another process answering on the port picked for the proxy (picked free, then taken
    first) is not the proxy being ready: the proxy cannot bind it and exits, and the start says
    so, where it had returned as ready and the test went on against the other server."""
    proc = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path, port=another_server)
    try:
        with pytest.raises(RuntimeError, match="proxy exited"):
            proc.start(timeout_s=30)
        assert "cannot serve" in proc.log()
    finally:
        proc.stop()
