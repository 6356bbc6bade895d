"""Process helpers for the benchmark: process trees, CPU and peak-RSS sampling from ``/proc``,
and a handle on a started server process (``Server``)."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (a proxy with workers is a tree)."""
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of these processes (all their threads), in seconds."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return total / CLK_TCK


def system_busy_seconds() -> float:
    """Busy CPU time of the whole machine (all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def children_cpu_seconds() -> float:
    """CPU of this process's reaped children (a finished load generator)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reset_peak_rss(pids: Sequence[int]) -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > clear_refs``); False where not allowed."""
    ok = True
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            ok = False
    return ok


def peak_rss_mib(pids: Sequence[int]) -> float:
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return round(total_kb / 1024, 1)


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def tree(self) -> list[int]:
        return process_tree(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_head(self, chars: int) -> str:
        try:
            with self.log_path.open("rb") as log:
                return log.read(chars).decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While this holds, SIGTERM (``kill``, a CI job's timeout) raises SystemExit(143) in the main
    thread, as Ctrl-C raises KeyboardInterrupt: a driver's ``finally`` blocks then stop the
    servers it started and remove its work dir, where Python's default action would end it at
    once and leave them (the proxy and Redis for good). Only the first SIGTERM raises, so that a
    second one does not cut that cleanup short."""
    raised = False

    def on_sigterm(signum: int, _frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_ready_line(name: str, argv: list[str], workdir: Path, timeout_s: float = 20.0) -> Server:
    """Start a bench helper that prints ``READY <url>`` on stdout when it listens."""
    log_path = workdir / f"{name}.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=str(ROOT)
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([process.stdout], [], [], 0.2)
            if ready:
                line = process.stdout.readline().decode().strip()
                if line.startswith("READY "):
                    return Server(name, process, line.split(" ", 1)[1], log_path)
                if not line and process.poll() is not None:
                    break
            elif process.poll() is not None:
                break
    except BaseException:
        # A SIGTERM's SystemExit while it starts: no caller holds it yet to stop it.
        process.kill()
        process.wait()
        raise
    process.kill()
    process.wait()
    raise SystemExit(f"bench: {name} did not start: {log_path.read_text(errors='replace')[-2000:]}")


def wait_http_ok(url: str, server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
