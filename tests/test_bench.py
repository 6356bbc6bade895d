"""The benchmark (bench/): what its report makes of failed calls, how long the servers it starts
live, and what a SIGTERM to its drivers leaves behind."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench import loadgen, run, table
from bench.procstats import Server, process_tree
from bench.scenarios import SCENARIOS, encoding_installed, proxy_config
from proxy.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


def _row(
    name: str, arm: str, *, rps: float, p50: float, cpu: float, requests: int, errors: int
) -> dict[str, Any]:
    return {
        "scenario": name,
        "concurrency": 16,
        "arm": arm,
        "requests": requests,
        "ok": requests - errors,
        "errors": errors,
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": p50 * 2,
        "ttfb_p50_ms": None,
        "cpu_ms_per_req": cpu,
        "redis_cpu_ms_per_req": 0.01,
        "peak_rss_mib": 100.0,
    }


def test_an_arm_whose_every_call_failed_is_compared_with_nothing_and_meets_no_target() -> None:
    """A proxy that answers every call with a fast 502 (an upstream key it lacks, say) does not
    come out as 'met: yes' at a fine ratio: its CPU per 'request' is that of an error answer."""
    rows: table.Rows = {
        ("nonstream-small", 16, "direct"): _row(
            "nonstream-small", "direct", rps=5000, p50=3, cpu=0.09, requests=5000, errors=0
        ),
        ("nonstream-small", 16, "relay"): _row(
            "nonstream-small", "relay", rps=2500, p50=6, cpu=0.17, requests=2500, errors=0
        ),
        ("nonstream-small", 16, "proxy"): _row(
            "nonstream-small", "proxy", rps=6000, p50=2, cpu=0.2, requests=6000, errors=6000
        ),
    }
    scenarios = [s for s in SCENARIOS if s.name == "nonstream-small"]
    table.add_comparisons(rows, scenarios)
    proxy = rows[("nonstream-small", 16, "proxy")]
    assert proxy.get("cpu_ratio_vs_relay") is None, proxy
    assert proxy.get("rps_ratio_vs_direct") is None, proxy
    assert proxy.get("p50_ratio_vs_direct") is None, proxy
    targets = "\n".join(table._targets_table(rows, {"nonstream-small": 0}))
    assert "| yes |" not in targets, targets
    assert "every call failed" in targets, targets
    main = table._main_table(rows, {"nonstream-small": 0})
    assert "**⚠ 6000 (all)**" in next(line for line in main if "| proxy |" in line)


class _Fake:
    """What ``run.main`` reads of a started stack, without starting one."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def test_a_run_where_an_arm_had_errors_exits_non_zero_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose proxy failed a call or more exited 0, a CI job reading only its status none
    the wiser: it exits 1 and names the arms in error last."""
    server = _Fake(url="http://127.0.0.1:1", process=_Fake(pid=1), log_head=lambda _chars: "")
    stack = _Fake(
        upstream=server, relay=server, proxy=server, redis=server, litellm=None, arms=lambda s: s.arms
    )

    @contextlib.contextmanager
    def stack_running(*_: Any) -> Iterator[_Fake]:
        yield stack

    def measure(_stack: Any, scenario: Any, arm: str, concurrency: int, _settings: Any) -> dict[str, Any]:
        errors = 7 if arm == "proxy" else 0
        record = _row(scenario.name, arm, rps=1000, p50=3, cpu=0.2, requests=1000, errors=errors)
        return {**record, "concurrency": concurrency, "foreign_cpu_util": 0.0}

    monkeypatch.setattr(run, "stack_running", stack_running)
    monkeypatch.setattr(run, "measure", measure)
    status = run.main(["--quick", "--scenarios", "nonstream-small", "--out", str(tmp_path)])
    assert status == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "nonstream-small c=16 proxy (7)" in err[-1] and "exit status 1" in err[-1], err[-1]
    assert "**⚠ 7**" in (tmp_path / "latest.md").read_text()


async def test_loadgen_latencies_are_those_of_the_calls_that_succeeded() -> None:
    """Two calls in three failed fast (a 502 at once) and one succeeded slowly: the p50 was a
    failure's millisecond; it is now the successful calls' own."""
    calls = itertools.count()

    async def answer(_request: web.Request) -> web.Response:
        if next(calls) % 3:
            return web.json_response({"error": "bad gateway"}, status=502)
        await asyncio.sleep(0.05)
        return web.json_response({"choices": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("/v1/chat/completions"))
        result = await loadgen.LoadGen(loadgen.parse_args(["--url", url, "-c", "2", "-d", "0.5"])).run()
        assert result["ok"] and result["errors"] > result["ok"], result
        assert result["latency_ms"]["p50"] >= 50, result
        assert result["latency_ms"]["mean"] >= 50, result

        failing = loadgen.parse_args(["--url", url, "-c", "2", "-d", "0.3", "--expect-status", "201"])
        result = await loadgen.LoadGen(failing).run()
        assert result["ok"] == 0 and result["errors"], result
        assert result["latency_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}


class _Abort(Exception):
    pass


def test_the_upstream_and_relays_outlive_a_full_run_of_five_rounds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``bench/run.py --rounds 5`` (what the README advises) measures for longer than the 1,800 s
    after which the upstream and both relays exited by themselves: the run died midway with
    'bench: upstream died'. Their bound follows the planned run, and stays a bound."""
    seen: dict[str, float] = {}

    def fake_upstream(workdir: Path, max_seconds: float, **_: Any) -> Server:
        seen["upstream"] = max_seconds
        gone = types.SimpleNamespace(poll=lambda: 0, pid=0)  # already ended: stop() leaves it
        return Server("upstream", gone, "http://127.0.0.1:1/v1", workdir / "u.log")  # type: ignore[arg-type]

    def fake_ready_line(name: str, argv: list[str], workdir: Path, timeout_s: float = 20.0) -> Server:
        seen[name] = float(argv[argv.index("--max-seconds") + 1])
        raise _Abort

    monkeypatch.setattr(run, "start_upstream", fake_upstream)
    monkeypatch.setattr(run, "start_ready_line", fake_ready_line)
    with pytest.raises(_Abort):
        run.main(["--rounds", "5", "--out", str(tmp_path)])
    # The measured arms alone, no start-up, no loadgen start, no LiteLLM: a lower bound.
    arms = sum(
        len(s.arms) for s in SCENARIOS if s.needs_encoding is None or encoding_installed(s.needs_encoding)
    )
    planned = 5 * 3 * arms * (1.5 + 5.0)
    assert planned > 1800
    assert planned <= seen["upstream"] < 24 * 3600, (seen, planned)
    assert planned <= seen["relay"] < 24 * 3600, (seen, planned)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


# Each driver with a long run, and what shows it is under way: run.py's and ab.py's first arm's
# load generator in its process tree, soak.py's line before it drives its calls (in-process).
DRIVERS = {
    "run": (
        ["--quick", "--scenarios", "nonstream-small", "--duration", "30", "--warmup", "0.5"],
        "loadgen.py",
    ),
    "soak": (["--calls", "1000000", "--max-seconds", "60"], "soak: 1000000 calls"),
    "ab": (["--rounds", "1", "--duration", "30", "--warmup", "0.5"], "loadgen.py"),
}


@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_sigterm_to_a_benchmark_driver_stops_its_servers_and_removes_its_workdirs(
    driver: str, tmp_path: Path
) -> None:
    """``kill <run.py>`` (a CI job's timeout, a supervisor) left the upstream, relays, proxy, Redis
    and load generator running (the proxy and Redis for ever) and the work dir in /tmp, as did
    soak.py and ab.py (its git worktree too): SIGTERM now runs their cleanup."""
    args, under_way = DRIVERS[driver]
    out = {"run": ["--out", str(tmp_path)], "soak": ["--out", str(tmp_path / "soak.jsonl")], "ab": []}[driver]
    argv = [sys.executable, str(ROOT / "bench" / f"{driver}.py"), *args, *out]
    stderr = tmp_path / "stderr"
    with stderr.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, cwd=str(ROOT))
    tree: list[int] = []
    dirs: set[Path] = set()
    try:
        deadline = time.monotonic() + 60
        while under_way not in stderr.read_text() and not any(
            under_way in " ".join(_cmdline(pid)) for pid in tree
        ):
            assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-2000:]
            time.sleep(0.2)
            tree = [pid for pid in process_tree(proc.pid) if pid != proc.pid]
        time.sleep(0.5)  # into the calls
        tree = [pid for pid in process_tree(proc.pid) if pid != proc.pid]
        for pid in tree:
            cmdline = _cmdline(pid)
            if "serve" in cmdline:  # a proxy: its config is in the driver's work dir
                config = Path(cmdline[cmdline.index("--config") + 1])
                dirs.add(config.parent if config.parent.name not in ("A", "B") else config.parent.parent)
                cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
                if cwd != ROOT:
                    dirs.add(cwd.parent)  # ab.py's worktree of --base is in a temporary dir of its own
        assert dirs, tree
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 5
        while (left := [pid for pid in tree if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, [" ".join(_cmdline(pid))[:120] for pid in left]
        assert not [path for path in dirs if path.exists()], dirs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in tree:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)
        if driver == "ab":
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)


def test_a_proxy_refusing_a_workers_value_is_not_said_to_lack_the_option(tmp_path: Path) -> None:
    """``run.py --workers 0``: the proxy refuses the value ('--workers must be at least 1') and
    the benchmark said it did not accept --workers at all; that hint is for an option unknown."""
    config_path = tmp_path / "proxy.yaml"
    config = proxy_config(free_port(), "http://127.0.0.1:1/v1", "redis://127.0.0.1:1", "info")
    config_path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as refused:
        run.start_proxy(config_path, tmp_path, 0)
    assert "--workers must be at least 1" in str(refused.value)
    assert "does not accept --workers" not in str(refused.value)

    # A proxy of before --workers: its argparse knows no such option.
    older = tmp_path / "older"
    (older / "proxy").mkdir(parents=True)
    parser = (
        "import argparse; p = argparse.ArgumentParser(); p.add_argument('serve'); p.add_argument('--config')"
    )
    (older / "proxy" / "__main__.py").write_text(parser + "\np.parse_args()\n")
    with pytest.raises(SystemExit) as unknown:
        run.start_proxy(config_path, tmp_path, 2, root=older)
    assert "does not accept --workers yet" in str(unknown.value)


def test_loadgen_runs_the_duration_asked_beyond_its_requests_mode_bound() -> None:
    """``run.py --duration 300`` had its load generators measure 120 s, cut to the --max-seconds
    bound of --requests mode without a word, while the report said 300."""
    args = loadgen.parse_args(["--url", "http://127.0.0.1:1/v1/chat/completions", "--duration", "300"])
    assert args.duration == 300
