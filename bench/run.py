"""The benchmark, in one command: ``.venv/bin/python bench/run.py [--quick] [--workers 2]``.

Starts, on loopback only: the fast fake upstream (``bench/upstream.py``), a throwaway
``redis-server`` with AOF on (as the proxy runs it), the proxy (``python -m proxy serve
--config <generated yaml>``) and the bare relay (``bench/relay.py``). Then, for every scenario
and concurrency, it drives the same load in turn directly at the upstream, through the relay and
through the proxy (``bench/loadgen.py``, its own process), sampling each server's CPU counters
exactly around the measured phase. Results: a Markdown table on stdout and in
``bench/results/latest.md``, one JSON line per arm in ``bench/results/latest.jsonl``.

See ``bench/README.md`` for the columns.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
sys.path.insert(0, str(ROOT))

from proxy.redis_server import RedisServerProcess, free_port  # noqa: E402

PYTHON = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
UPSTREAM_KEY = "sk-bench-upstream"
KEYS = {"open": "sk-bench-open", "budget": "sk-bench-budget", "refuse": "sk-bench-refuse"}
HUGE = 10**12
TARGETS = {"nonstream-small": 2.0, "stream-20": 1.5, "stream-200": 1.3}
SMALL_PROMPT = 256


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    stream: bool = False
    chunks: int = 0
    prompt_bytes: int = SMALL_PROMPT
    key: str = "open"  # which proxy key (tier) the proxy arm uses
    expect_status: int = 200
    # Arms measured; a scenario without direct/relay arms borrows them from ``baseline``.
    arms: tuple[str, ...] = ("direct", "relay", "proxy")
    baseline: str | None = None


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("nonstream-small", f"non-streaming, {SMALL_PROMPT} B prompt, tier without ceilings"),
    Scenario("stream-20", "streaming, 20 content chunks", stream=True, chunks=20),
    Scenario("stream-200", "streaming, 200 content chunks", stream=True, chunks=200),
    Scenario("prompt-100k", "non-streaming, 100 KB prompt", prompt_bytes=100 * 1024),
    Scenario(
        "budgets-on",
        "non-streaming small, tier with run + key-window + tenant-window ceilings (never reached)",
        key="budget",
        arms=("proxy",),
        baseline="nonstream-small",
    ),
    Scenario(
        "refusal",
        "non-streaming small, run budget 0: every call refused with 429 before forwarding",
        key="refuse",
        expect_status=429,
        arms=("proxy",),
        baseline="nonstream-small",
    ),
)


# -- process helpers ---------------------------------------------------------------------


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


def start_ready_line(name: str, argv: list[str], workdir: Path, timeout_s: float = 20.0) -> Server:
    """Start a bench helper that prints ``READY <url>`` on stdout when it listens."""
    log_path = workdir / f"{name}.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=str(ROOT)
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
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


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def proxy_config(port: int, upstream_url: str, redis_url: str, log_level: str) -> dict[str, Any]:
    big_window = {"requests": HUGE, "total_tokens": HUGE, "cost_usd": HUGE}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log": {"level": log_level, "format": "json"},
        "redis": {"url": redis_url},
        "upstreams": {
            "bench": {
                "base_url": upstream_url,
                "api_key_env": "BENCH_UPSTREAM_KEY",
                "timeout_s": 30,
                "connect_timeout_s": 5,
            }
        },
        "models": {
            "gpt-4o-mini": {
                "upstream": "bench",
                "max_output_tokens": 1000,
                "price_per_million": {"input": "0.15", "cached_input": "0.075", "output": "0.60"},
            },
            "*": {"upstream": "bench"},
        },
        "keys": [
            {"name": f"bench-{tier}", "sha256": sha256(key), "tenant": "bench", "tier": tier}
            for tier, key in KEYS.items()
        ],
        "tiers": {
            "open": {},
            "budget": {
                "run": {
                    "requests": HUGE,
                    "input_tokens": HUGE,
                    "output_tokens": HUGE,
                    "total_tokens": HUGE,
                    "cost_usd": HUGE,
                    "concurrent": 100_000,
                },
                "windows": [{"period": "minute", **big_window}, {"period": "day", **big_window}],
                "tenant": [{"period": "month", **big_window}],
            },
            "refuse": {"run": {"requests": 0}},
        },
        "limits": {"max_body_bytes": 8 * 1024 * 1024},
    }


def start_proxy(config_path: Path, workdir: Path, workers: int | None) -> Server:
    argv = [PYTHON, "-m", "proxy", "serve", "--config", str(config_path)]
    if workers is not None:
        argv += ["--workers", str(workers)]
    env = {**os.environ, "BENCH_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}
    log_path = workdir / "proxy.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=str(ROOT), env=env
        )
    config = yaml.safe_load(config_path.read_text())
    url = f"http://127.0.0.1:{config['listen']['port']}"
    server = Server("proxy", process, url, log_path)
    wait_http_ok(url + "/readyz", server, timeout_s=60)
    if process.poll() is not None:
        tail = server.log_tail()
        hint = ""
        if workers is not None and "--workers" in tail:
            hint = "\nbench: this proxy does not accept --workers yet (run without --workers)."
        raise SystemExit(
            f"bench: the proxy exited at start (code {process.returncode}): {' '.join(argv)}\n{tail}{hint}"
        )
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
            if resp.status != 200:
                raise OSError(resp.status)
    except OSError as err:
        server.stop()
        raise SystemExit(f"bench: the proxy did not become ready ({err}):\n{server.log_tail()}") from None
    return server


# -- one measured arm --------------------------------------------------------------------


@dataclass
class Stack:
    upstream: Server
    relay: Server
    proxy: Server
    redis: RedisServerProcess

    def server(self, arm: str) -> Server:
        return {"direct": self.upstream, "relay": self.relay, "proxy": self.proxy}[arm]

    def url(self, arm: str) -> str:
        if arm == "direct":
            return self.upstream.url + "/chat/completions"
        return self.server(arm).url + "/v1/chat/completions"

    def check_alive(self) -> None:
        for server in (self.upstream, self.relay, self.proxy):
            if server.process.poll() is not None:
                raise SystemExit(f"bench: {server.name} died:\n{server.log_tail()}")


@dataclass
class Settings:
    mode: str
    warmup_s: float
    duration_s: float
    concurrencies: tuple[int, ...]
    workers: int | None
    rounds: int
    scenarios: tuple[Scenario, ...]
    extra: dict[str, Any] = field(default_factory=dict)


def loadgen_argv(scenario: Scenario, arm: str, url: str, concurrency: int, settings: Settings) -> list[str]:
    key = KEYS[scenario.key] if arm == "proxy" else KEYS["open"]
    argv = [
        PYTHON,
        str(BENCH / "loadgen.py"),
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(settings.duration_s),
        "--warmup",
        str(settings.warmup_s),
        "--sync",
        "--prompt-bytes",
        str(scenario.prompt_bytes),
        "--key",
        key,
        "--run-id-prefix",
        f"bench-{scenario.name}-c{concurrency}",
        "--expect-status",
        str(scenario.expect_status if arm == "proxy" else 200),
    ]
    if scenario.stream:
        argv += ["--stream", "--chunks", str(scenario.chunks)]
    return argv


def measure(
    stack: Stack, scenario: Scenario, arm: str, concurrency: int, settings: Settings
) -> dict[str, Any]:
    stack.check_alive()
    server = stack.server(arm)
    argv = loadgen_argv(scenario, arm, stack.url(arm), concurrency, settings)
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT)
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    bound = settings.warmup_s + settings.duration_s + 60
    deadline = time.monotonic() + bound
    stderr_lines: list[str] = []
    try:
        while True:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: loadgen warm-up did not finish: {' '.join(argv)}")
            ready, _, _ = select.select([proc.stderr], [], [], 0.5)
            if ready:
                line = proc.stderr.readline().decode(errors="replace")
                if line.strip() == "warm":
                    break
                if not line:
                    raise SystemExit(f"bench: loadgen exited early: {''.join(stderr_lines)[-2000:]}")
                stderr_lines.append(line)
        tree = server.tree()
        rss_reset = reset_peak_rss(tree)
        redis_pid = stack.redis.process.pid if stack.redis.process is not None else None
        upstream_tree = stack.upstream.tree()
        before = cpu_seconds(tree)
        before_up = cpu_seconds(upstream_tree)
        before_redis = cpu_seconds([redis_pid]) if redis_pid else 0.0
        before_loadgen = cpu_seconds([proc.pid])  # its warm-up, to subtract
        before_children = children_cpu_seconds()
        before_busy = system_busy_seconds()
        wall_before = time.monotonic()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        wall = time.monotonic() - wall_before
        busy = system_busy_seconds() - before_busy
        loadgen_cpu = children_cpu_seconds() - before_children - before_loadgen
        tree = server.tree()  # workers may have come and gone
        after = cpu_seconds(tree)
        after_up = cpu_seconds(upstream_tree)
        after_redis = cpu_seconds([redis_pid]) if redis_pid else 0.0
        peak = peak_rss_mib(tree)
        ours = (after - before) + (after_redis - before_redis) + loadgen_cpu
        if arm != "direct":
            ours += after_up - before_up
        # CPU this benchmark did not spend (other jobs on the machine): a noise indicator.
        foreign_util = max(0.0, busy - ours) / wall if wall > 0 else 0.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"bench: loadgen failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    requests = max(1, int(result["requests"]))
    record: dict[str, Any] = {
        "mode": settings.mode,
        "scenario": scenario.name,
        "concurrency": concurrency,
        "arm": arm,
        "workers": settings.workers if arm == "proxy" else None,
        "requests": result["requests"],
        "ok": result["ok"],
        "errors": result["errors"],
        "status_counts": result["status_counts"],
        "error_kinds": result["error_kinds"],
        "duration_s": result["duration_s"],
        "rps": result["rps"],
        "p50_ms": result["latency_ms"]["p50"],
        "p90_ms": result["latency_ms"]["p90"],
        "p99_ms": result["latency_ms"]["p99"],
        "mean_ms": result["latency_ms"]["mean"],
        "ttfb_p50_ms": (result["ttfb_ms"] or {}).get("p50"),
        "ttfb_p99_ms": (result["ttfb_ms"] or {}).get("p99"),
        "cpu_ms_per_req": round((after - before) * 1000 / requests, 4),
        "cpu_util": round((after - before) / wall, 3) if wall > 0 else None,
        "upstream_cpu_ms_per_req": round((after_up - before_up) * 1000 / requests, 4),
        "redis_cpu_ms_per_req": round((after_redis - before_redis) * 1000 / requests, 4)
        if arm == "proxy"
        else None,
        "loadgen_cpu_util": round(loadgen_cpu / wall, 3) if wall > 0 else None,
        "foreign_cpu_util": round(foreign_util, 3),
        "peak_rss_mib": peak,
        "peak_rss_is_window": rss_reset,
        "server_pids": len(tree),
        "request_bytes": result["request_bytes"],
        "bytes_in": result["bytes_in"],
    }
    return record


# -- aggregation and reporting -----------------------------------------------------------

NUMERIC = (
    "rps",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "mean_ms",
    "ttfb_p50_ms",
    "ttfb_p99_ms",
    "cpu_ms_per_req",
    "cpu_util",
    "upstream_cpu_ms_per_req",
    "redis_cpu_ms_per_req",
    "peak_rss_mib",
    "loadgen_cpu_util",
    "foreign_cpu_util",
)


def median_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(records[-1])
    for key in NUMERIC:
        values = [r[key] for r in records if r.get(key) is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    out["requests"] = sum(r["requests"] for r in records)
    out["errors"] = sum(r["errors"] for r in records)
    out["rounds"] = len(records)
    return out


def add_comparisons(rows: dict[tuple[str, int, str], dict[str, Any]], scenarios: Sequence[Scenario]) -> None:
    """Latency added vs direct, and proxy/relay ratios, on every row that has a baseline."""
    by_name = {s.name: s for s in scenarios}
    for (name, conc, arm), row in rows.items():
        base_name = by_name[name].baseline or name
        direct = rows.get((base_name, conc, "direct"))
        relay = rows.get((base_name, conc, "relay"))
        row["baseline_scenario"] = base_name
        if direct is not None and arm != "direct":
            for key in ("p50_ms", "p99_ms"):
                if row.get(key) is not None and direct.get(key) is not None:
                    row[f"added_{key}"] = round(row[key] - direct[key], 3)
        if arm == "proxy" and relay is not None:
            if relay.get("cpu_ms_per_req"):
                row["cpu_ratio_vs_relay"] = round(row["cpu_ms_per_req"] / relay["cpu_ms_per_req"], 2)
            if relay.get("rps"):
                row["rps_ratio_vs_relay"] = round(row["rps"] / relay["rps"], 2)


def _fmt(value: Any, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int):
        return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"
    return str(value)


def markdown(rows: dict[tuple[str, int, str], dict[str, Any]], settings: Settings, notes: list[str]) -> str:
    lines = [
        f"# Proxy benchmark ({settings.mode})",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M:%S')}, git {settings.extra.get('git', '?')}, "
        f"{os.cpu_count()} cores, Python {sys.version.split()[0]}",
        f"- warm-up {settings.warmup_s}s + {settings.duration_s}s measured per arm, "
        f"{settings.rounds} round(s) (medians), proxy workers: {settings.workers or 'default (1 process)'}",
        "- CPU ms/req: utime+stime of the server process tree over the measured phase / requests. "
        "Proxy rows also show Redis CPU ms/req. Ratios are proxy / relay (same scenario's relay, or "
        "the baseline scenario's for budgets-on and refusal).",
        *[f"- {note}" for note in notes],
        "",
        "| scenario | conc | arm | req/s | p50 ms | p99 ms | +p50 vs direct | +p99 vs direct "
        "| TTFB p50 ms | CPU ms/req | redis ms/req | peak RSS MiB | errors "
        "| CPU/req x relay | req/s x relay |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {s.name: i for i, s in enumerate(settings.scenarios)}
    arm_order = {"direct": 0, "relay": 1, "proxy": 2}
    for key in sorted(rows, key=lambda k: (k[1], order[k[0]], arm_order[k[2]])):
        r = rows[key]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["scenario"],
                    str(r["concurrency"]),
                    r["arm"],
                    _fmt(r["rps"], 0),
                    _fmt(r["p50_ms"]),
                    _fmt(r["p99_ms"]),
                    _fmt(r.get("added_p50_ms"), signed=True),
                    _fmt(r.get("added_p99_ms"), signed=True),
                    _fmt(r.get("ttfb_p50_ms")),
                    _fmt(r["cpu_ms_per_req"], 3),
                    _fmt(r.get("redis_cpu_ms_per_req"), 3),
                    _fmt(r["peak_rss_mib"], 1),
                    str(r["errors"]),
                    _fmt(r.get("cpu_ratio_vs_relay")),
                    _fmt(r.get("rps_ratio_vs_relay")),
                ]
            )
            + " |"
        )
    lines += ["", "## CPU per request, proxy / relay, against the targets", ""]
    lines += ["| scenario | conc | proxy CPU ms/req | relay CPU ms/req | ratio | target | met |"]
    lines += ["|---|---:|---:|---:|---:|---:|---|"]
    for (name, conc, arm), r in sorted(rows.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        if arm != "proxy" or name not in TARGETS:
            continue
        relay = rows.get((name, conc, "relay"))
        ratio = r.get("cpu_ratio_vs_relay")
        met = "-" if ratio is None else ("yes" if ratio <= TARGETS[name] else "**no**")
        lines.append(
            f"| {name} | {conc} | {_fmt(r['cpu_ms_per_req'], 3)} | "
            f"{_fmt(relay['cpu_ms_per_req'] if relay else None, 3)} | {_fmt(ratio)} | "
            f"≤{TARGETS[name]} | {met} |"
        )
    lines += ["", "Scenarios:", ""]
    lines += [f"- `{s.name}`: {s.description}" for s in settings.scenarios]
    return "\n".join(lines) + "\n"


# -- the driver --------------------------------------------------------------------------


@contextlib.contextmanager
def stack_running(workdir: Path, settings: Settings, log_level: str) -> Iterator[Stack]:
    servers: list[Server] = []
    redis = RedisServerProcess(workdir / "redis", port=free_port())  # appendonly, as the proxy runs it
    try:
        upstream = start_ready_line(
            "upstream",
            [PYTHON, str(BENCH / "upstream.py"), "--port", "0", "--max-seconds", "1800"],
            workdir,
        )
        servers.append(upstream)
        relay = start_ready_line(
            "relay",
            [
                PYTHON,
                str(BENCH / "relay.py"),
                "--upstream",
                upstream.url,
                "--port",
                "0",
                "--max-seconds",
                "1800",
            ],
            workdir,
        )
        servers.append(relay)
        redis.start()
        config_path = workdir / "proxy.yaml"
        config_path.write_text(yaml.safe_dump(proxy_config(free_port(), upstream.url, redis.url, log_level)))
        proxy = start_proxy(config_path, workdir, settings.workers)
        servers.append(proxy)
        yield Stack(upstream=upstream, relay=relay, proxy=proxy, redis=redis)
    finally:
        for server in reversed(servers):
            server.stop()
        redis.stop()


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "proxy"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        return rev + ("+dirty(proxy/)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def profile(stack: Stack, settings: Settings, name: str, seconds: float, out_dir: Path) -> list[Path]:
    """py-spy the proxy under one scenario at concurrency 16 (a separate, unrecorded run)."""
    py_spy = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")
    if not Path(py_spy).exists():
        print(
            "bench: py-spy not installed (.venv/bin/pip install py-spy); skipping --profile", file=sys.stderr
        )
        return []
    scenario = next(s for s in SCENARIOS if s.name == name)
    written = []
    for fmt, suffix in (("raw", "collapsed.txt"), ("speedscope", "speedscope.json")):
        path = out_dir / f"profile-{name}.{suffix}"
        run_settings = Settings(
            mode="profile",
            warmup_s=1.0,
            duration_s=seconds + 2,
            concurrencies=(16,),
            workers=settings.workers,
            rounds=1,
            scenarios=(scenario,),
        )
        argv = loadgen_argv(scenario, "proxy", stack.url("proxy"), 16, run_settings)
        argv.remove("--sync")
        load = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT))
        try:
            time.sleep(1.5)
            spy = [
                py_spy,
                "record",
                "--pid",
                str(stack.proxy.process.pid),
                "--duration",
                str(int(seconds)),
                "--rate",
                "200",
                "--format",
                fmt,
                "--output",
                str(path),
            ]
            if settings.workers:
                spy.append("--subprocesses")
            subprocess.run(spy, capture_output=True, timeout=seconds + 60, check=True)
            written.append(path)
        except subprocess.CalledProcessError as err:
            print(f"bench: py-spy failed: {err.stderr.decode(errors='replace')[-1000:]}", file=sys.stderr)
        finally:
            load.wait(timeout=seconds + 60)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="concurrency 16 only, short runs (< ~2 min)")
    parser.add_argument("--workers", type=int, default=None, help="pass --workers N to the proxy")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="override concurrencies")
    parser.add_argument("--duration", type=float, default=None, help="measured seconds per arm")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up seconds per arm")
    parser.add_argument("--rounds", type=int, default=1, help="repeat everything; report medians")
    parser.add_argument("--scenarios", nargs="+", default=None, help="only these scenarios")
    parser.add_argument("--proxy-log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument(
        "--profile",
        nargs="*",
        metavar="SCENARIO",
        default=None,
        help="then py-spy the proxy under these scenarios (none given: budgets-on)",
    )
    parser.add_argument("--profile-seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs, config and Redis data")
    args = parser.parse_args(argv)
    known = {s.name for s in SCENARIOS}
    if args.profile and set(args.profile) - known:
        parser.error(f"unknown --profile scenarios: {sorted(set(args.profile) - known)}")

    scenarios: tuple[Scenario, ...] = SCENARIOS
    if args.scenarios:
        unknown = set(args.scenarios) - {s.name for s in SCENARIOS}
        if unknown:
            parser.error(f"unknown scenarios: {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
        wanted = set(args.scenarios)
        wanted |= {s.baseline for s in SCENARIOS if s.name in wanted and s.baseline}
        scenarios = tuple(s for s in SCENARIOS if s.name in wanted)
    settings = Settings(
        mode="quick" if args.quick else "full",
        warmup_s=args.warmup if args.warmup is not None else (1.0 if args.quick else 1.5),
        duration_s=args.duration if args.duration is not None else (3.0 if args.quick else 5.0),
        concurrencies=tuple(args.concurrency or ((16,) if args.quick else (1, 16, 64))),
        workers=args.workers,
        rounds=max(1, args.rounds),
        scenarios=scenarios,
        extra={"git": git_revision()},
    )
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="llm-proxy-bench-"))
    started = time.monotonic()
    raw: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    notes: list[str] = []
    try:
        with stack_running(workdir, settings, args.proxy_log_level) as stack:
            print(
                f"bench: upstream {stack.upstream.url}, relay {stack.relay.url}, proxy {stack.proxy.url} "
                f"(pid {stack.proxy.process.pid}), redis {stack.redis.url}; workdir {workdir}",
                file=sys.stderr,
            )
            for round_no in range(settings.rounds):
                for concurrency in settings.concurrencies:
                    for scenario in scenarios:
                        for arm in scenario.arms:  # direct, relay, proxy: in alternation
                            record = measure(stack, scenario, arm, concurrency, settings)
                            record["round"] = round_no
                            raw.setdefault((scenario.name, concurrency, arm), []).append(record)
                            print(
                                f"bench: {scenario.name:16} c={concurrency:<3} {arm:6} "
                                f"{record['rps']:8.0f} req/s  p50 {record['p50_ms'] or 0:7.2f} ms  "
                                f"CPU {record['cpu_ms_per_req']:.3f} ms/req  errors {record['errors']}",
                                file=sys.stderr,
                            )
            if "tiktoken encoding unavailable" in stack.proxy.log_head(50_000):
                notes.append(
                    "tiktoken encodings were not available to the proxy (no cache, no network): it "
                    "estimated with the UTF-8 byte-length fallback, so tokenizer cost is not measured."
                )
            for name in (args.profile or ["budgets-on"]) if args.profile is not None else []:
                for path in profile(stack, settings, name, args.profile_seconds, args.out):
                    print(f"bench: profile written to {path}", file=sys.stderr)
                    if path.name.endswith(".collapsed.txt"):
                        summary = subprocess.run(
                            [PYTHON, str(BENCH / "profile_report.py"), str(path)],
                            capture_output=True,
                            text=True,
                            timeout=60,
                        ).stdout
                        summary_path = path.with_name(path.name.replace(".collapsed.txt", ".md"))
                        summary_path.write_text(summary)
                        print(f"bench: profile summary in {summary_path}", file=sys.stderr)
    finally:
        if args.keep_workdir:
            print(f"bench: workdir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    rows = {key: median_record(records) for key, records in raw.items()}
    add_comparisons(rows, scenarios)
    noisy = [r for r in rows.values() if (r.get("foreign_cpu_util") or 0) > 0.15]
    if noisy:
        worst = max(r["foreign_cpu_util"] for r in noisy)
        notes.append(
            f"other processes on this machine used CPU during {len(noisy)} arm(s) (up to {worst:.2f} "
            "cores; foreign_cpu_util in latest.jsonl): their throughput and latency are noisy; CPU "
            "ms/req is per process and less affected."
        )
    if any(r["errors"] for r in rows.values()):
        notes.append("some arms had errors: see the errors column and error_kinds in latest.jsonl.")
    notes.append(f"total wall time {time.monotonic() - started:.0f}s")
    table = markdown(rows, settings, notes)
    with (args.out / "latest.jsonl").open("w") as out:
        for records in raw.values():
            for record in records:
                key = (record["scenario"], record["concurrency"], record["arm"])
                row = rows[key]
                extra = {k: row[k] for k in row if k.startswith(("added_", "cpu_ratio", "rps_ratio"))}
                out.write(json.dumps({**record, **extra, "git": settings.extra["git"]}) + "\n")
    (args.out / "latest.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
