"""Real proxy processes for the tests that need them (races, kill -9, SIGTERM)."""

from __future__ import annotations

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
from tests.conftest import UPSTREAM_KEY

ROOT = Path(__file__).resolve().parent.parent


class ProxyProcess:
    def __init__(self, raw_config: dict[str, Any], workdir: Path, *, args: tuple[str, ...] = ()) -> None:
        self.args = args
        self.port = free_port()
        raw = dict(raw_config)
        raw["listen"] = {"host": "127.0.0.1", "port": self.port}
        raw.setdefault("log", {"level": "info", "format": "json"})
        raw.setdefault("journal_dir", str(workdir / "journal"))
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / f"proxy-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(raw))
        self.log_path = workdir / f"proxy-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ProxyProcess:
        env = {**os.environ, "TEST_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(self.config_path), *self.args],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(ROOT),
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"proxy did not become ready: {self.log_path.read_text()[-2000:]}")

    def signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
