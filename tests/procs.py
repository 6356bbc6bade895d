"""Real proxy processes for the tests that need them (races, kill -9, SIGTERM)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from proxy.redis_server import free_port
from tests.conftest import TEST_EVENT_LOOP, UPSTREAM_KEY

ROOT = Path(__file__).resolve().parent.parent
_TCP_LISTEN = "0A"  # /proc/net/tcp's state field


def listening_inodes(port: int) -> set[str]:
    """The inodes of the IPv4 and IPv6 sockets listening on ``port`` (``/proc/net/tcp``)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == _TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def sockets_of(pids: list[int]) -> set[str]:
    """The inodes of the sockets the processes ``pids`` hold open."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    return inodes


class ProxyProcess:
    """``serve`` in a session of its own (a signal to its group reaches it and its workers, as
    systemd's stop or a terminal's Ctrl-C does); ``raw_config`` None: zero-config, ``args``
    naming ``--upstream``."""

    def __init__(
        self,
        raw_config: dict[str, Any] | None,
        workdir: Path,
        *,
        args: tuple[str, ...] = (),
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        if raw_config is None:
            self.args: tuple[str, ...] = (*args, "--port", str(self.port))
        else:
            raw = dict(raw_config)
            raw["listen"] = {"host": "127.0.0.1", "port": self.port}
            raw.setdefault("log", {"level": "info", "format": "json"})
            raw.setdefault("journal_dir", str(workdir / "journal"))
            raw.setdefault("event_loop", TEST_EVENT_LOOP)  # the loop the suite runs on
            self.config_path = workdir / f"proxy-{self.port}.yaml"
            self.config_path.write_text(yaml.safe_dump(raw))
            self.args = ("--config", str(self.config_path), *args)
        self.log_path = workdir / f"proxy-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(
        self,
        timeout_s: float = 20.0,
        *,
        ready: bool = True,
        script: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> ProxyProcess:
        """``script``: Python run in place of ``-m proxy`` (``serve`` and the args follow it), a
        test's way to patch the process before the command line runs."""
        env = {**os.environ, "TEST_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT), **(extra_env or {})}
        entry = ["-m", "proxy"] if script is None else ["-c", script]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, *entry, "serve", *self.args],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(ROOT),
                start_new_session=True,
            )
        if not ready:
            return self
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as resp:
                    # Answered by this proxy, not by another test process's that took the port
                    # picked free first (this one then fails to bind it, and exits).
                    if resp.status == 200 and self._listening():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"proxy did not become ready: {self.log_path.read_text()[-2000:]}")

    def _listening(self) -> bool:
        """Whether every socket listening on the port is this proxy's (its own or its workers',
        ``--workers`` binding it with SO_REUSEPORT, as another proxy's workers could too)."""
        assert self.process is not None
        inodes = listening_inodes(self.port)
        return bool(inodes) and inodes <= sockets_of([self.process.pid, *self.workers()])

    def signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> list[int]:
        """The pids of its worker processes (``--workers N``)."""
        assert self.process is not None
        out = subprocess.run(
            ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(self.process.pid)], capture_output=True, text=True
        ).stdout
        return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]

    def signal_group(self, sig: signal.Signals) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, sig)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # workers it left behind
