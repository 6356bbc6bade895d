"""Memory soak: ``.venv/bin/python bench/soak.py [--calls 100000] [--concurrency 16]``.

Starts, on loopback only, the fast fake upstream (``bench/upstream.py``), a throwaway
``redis-server`` (AOF on, as the proxy runs it) and the proxy (``python -m proxy serve --config
<generated yaml>``, the same config as ``bench/run.py``). Then drives ``--calls`` calls through the
proxy's ``budget`` tier (run ceilings + key windows per minute and per day + a tenant window per
month, all out of reach: every call reserves and settles against seven scopes) in ``--batches``
equal batches, ``--concurrency`` keep-alive clients, client ``i`` sending ``X-Run-Id: soak-<i>``.
Every ``--stream-every``-th call is a ``--chunks``-chunk stream, the others are non-streaming.

After each batch it samples the proxy's RSS (``VmRSS`` of ``/proc/<pid>/status``, summed over
the process tree) and prints a row. At the end: RSS(last) / RSS(after the first batch), the slope
in KiB per 10k calls over the last half of the run (least squares), the ledger length (``XLEN
lbp:{bench}:ledger``, must equal the calls made) and the leases left (``ZCARD
lbp:{bench}:leases``, must be 0). One JSON line per sample plus a summary line go to
``bench/results/soak.jsonl``. Exit status 1 when a call failed or a ledger/lease check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.procstats import Server, cpu_seconds, process_tree, sigterm_exits  # noqa: E402
from bench.run import RESULTS, git_revision, start_proxy, start_upstream  # noqa: E402
from bench.scenarios import KEYS, SMALL_PROMPT, proxy_config  # noqa: E402
from proxy.redis_server import RedisServerProcess, free_port  # noqa: E402
from proxy.store import key_prefix  # noqa: E402

TENANT = "bench"  # the one tenant of bench.scenarios.proxy_config
TIER = "budget"
RUN_ID_PREFIX = "soak"


def rss_kib(pids: Sequence[int]) -> int:
    """Resident set size (VmRSS) of these processes, in KiB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total


@dataclass
class Soak:
    upstream: Server
    proxy: Server
    redis: RedisServerProcess


@contextlib.contextmanager
def soak_stack(workdir: Path, log_level: str, max_seconds: float) -> Iterator[Soak]:
    servers: list[Server] = []
    store = RedisServerProcess(workdir / "redis", port=free_port())
    try:
        upstream = start_upstream(workdir, max_seconds + 120)
        servers.append(upstream)
        store.start()
        config_path = workdir / "proxy.yaml"
        config_path.write_text(yaml.safe_dump(proxy_config(free_port(), upstream.url, store.url, log_level)))
        proxy = start_proxy(config_path, workdir, workers=None)
        servers.append(proxy)
        yield Soak(upstream=upstream, proxy=proxy, redis=store)
    finally:
        for server in reversed(servers):
            server.stop()
        store.stop()


class Driver:
    """``concurrency`` clients on one keep-alive session, sharing one call counter."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        common = [
            "--url",
            url,
            "--concurrency",
            str(args.concurrency),
            "--key",
            KEYS[TIER],
            "--run-id-prefix",
            RUN_ID_PREFIX,
            "--prompt-bytes",
            str(SMALL_PROMPT),
            "--timeout",
            "30",
        ]
        self.plain = loadgen.LoadGen(loadgen.parse_args(common))
        self.stream = loadgen.LoadGen(loadgen.parse_args([*common, "--stream", "--chunks", str(args.chunks)]))
        self.concurrency = args.concurrency
        self.every = args.stream_every
        self.next_call = 0
        self.streams = 0

    def is_stream(self, index: int) -> bool:
        return self.every > 0 and index % self.every == self.every - 1

    async def batch(self, session: aiohttp.ClientSession, end: int, deadline: float) -> loadgen.Stats:
        stats = loadgen.Stats()

        async def client(idx: int) -> None:
            while self.next_call < end and time.monotonic() < deadline:
                index = self.next_call
                self.next_call += 1
                if self.is_stream(index):
                    self.streams += 1
                    await self.stream.one(session, idx, stats)
                else:
                    await self.plain.one(session, idx, stats)

        await asyncio.gather(*(client(i) for i in range(self.concurrency)))
        return stats


def slope_kib_per_10k(samples: list[dict[str, Any]]) -> float | None:
    """Least-squares slope of RSS over calls, from the middle sample to the last, per 10k calls."""
    if len(samples) < 2:
        return None
    half = samples[(len(samples) - 1) // 2 :]
    if len(half) < 2:
        half = samples[-2:]
    xs = [float(s["calls"]) for s in half]
    ys = [float(s["rss_kib"]) for s in half]
    if len(set(xs)) < 2:
        return None
    return statistics.linear_regression(xs, ys).slope * 10_000


def wait_store(client: redis.Redis, tenant: str, calls: int, timeout_s: float) -> tuple[int, int, float]:
    """(XLEN ledger, ZCARD leases, seconds waited): polls until the ledger has ``calls`` entries
    and no lease is left, or ``timeout_s`` passes (settles may trail the last response)."""
    prefix = key_prefix(tenant)
    started = time.monotonic()
    while True:
        ledger = int(client.xlen(f"{prefix}ledger"))
        leases = int(client.zcard(f"{prefix}leases"))
        waited = time.monotonic() - started
        if (ledger >= calls and leases == 0) or waited > timeout_s:
            return ledger, leases, round(waited, 2)
        time.sleep(0.1)


async def drive(stack: Soak, args: argparse.Namespace, out: Any) -> dict[str, Any]:
    driver = Driver(stack.proxy.url + "/v1/chat/completions", args)
    batch_size = -(-args.calls // args.batches)
    deadline = time.monotonic() + args.max_seconds
    samples: list[dict[str, Any]] = []
    errors = 0
    error_kinds: dict[str, int] = {}
    pid = stack.proxy.process.pid

    def sample(batch: int, seconds: float, done_in_batch: int, cpu: float, stats: Any) -> dict[str, Any]:
        tree = process_tree(pid)
        row = {
            "kind": "sample",
            "batch": batch,
            "calls": driver.next_call,
            "streams": driver.streams,
            "rss_kib": rss_kib(tree),
            "batch_s": round(seconds, 2),
            "rps": round(done_in_batch / seconds, 1) if seconds > 0 else None,
            "cpu_ms_per_call": round(cpu * 1000 / done_in_batch, 3) if done_in_batch else None,
            "errors": stats.errors if stats else 0,
            "p50_ms": loadgen.percentile(stats.latencies, 50) if stats else None,
            "p99_ms": loadgen.percentile(stats.latencies, 99) if stats else None,
        }
        row["rss_mib"] = round(row["rss_kib"] / 1024, 1)
        samples.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        return row

    header = (
        f"{'batch':>5} {'calls':>8} {'streams':>8} {'RSS MiB':>8} {'d MiB':>7} "
        f"{'s':>6} {'req/s':>7} {'CPU ms/call':>11} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}"
    )
    print(header)
    print("-" * len(header))

    def show(row: dict[str, Any]) -> None:
        first = samples[1]["rss_kib"] if len(samples) > 1 else row["rss_kib"]
        delta = (row["rss_kib"] - first) / 1024
        print(
            f"{row['batch']:>5} {row['calls']:>8} {row['streams']:>8} {row['rss_mib']:>8.1f} "
            f"{delta:>+7.1f} {row['batch_s']:>6.1f} {row['rps'] or 0:>7.0f} "
            f"{row['cpu_ms_per_call'] or 0:>11.3f} {row['p50_ms'] or 0:>7.2f} {row['p99_ms'] or 0:>7.2f} "
            f"{row['errors']:>6}",
            flush=True,
        )

    show(sample(0, 0.0, 0, 0.0, None))  # the freshly started proxy, before any call
    connector = aiohttp.TCPConnector(limit=args.concurrency, enable_cleanup_closed=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30), auto_decompress=False
    ) as session:
        for batch in range(1, args.batches + 1):
            if stack.proxy.process.poll() is not None:
                raise SystemExit(f"soak: the proxy died:\n{stack.proxy.log_tail()}")
            end = min(args.calls, batch * batch_size)
            if driver.next_call >= end:
                break
            start_calls = driver.next_call
            cpu_before = cpu_seconds(process_tree(pid))
            started = time.monotonic()
            stats = await driver.batch(session, end, deadline)
            seconds = time.monotonic() - started
            cpu = cpu_seconds(process_tree(pid)) - cpu_before
            errors += stats.errors
            for kind, count in stats.error_kinds.items():
                error_kinds[kind] = error_kinds.get(kind, 0) + count
            show(sample(batch, seconds, driver.next_call - start_calls, cpu, stats))
            if time.monotonic() >= deadline:
                print(f"soak: --max-seconds {args.max_seconds} reached; stopping early", file=sys.stderr)
                break

    client = redis.Redis.from_url(stack.redis.url)
    try:
        ledger, leases, waited = wait_store(client, TENANT, driver.next_call, timeout_s=15.0)
        redis_used = int(client.info("memory")["used_memory"])
    finally:
        client.close()
    final_rss = rss_kib(process_tree(pid))
    first = samples[1]["rss_kib"] if len(samples) > 1 else None
    last = samples[-1]["rss_kib"]
    summary = {
        "kind": "summary",
        "calls_requested": args.calls,
        "calls": driver.next_call,
        "streams": driver.streams,
        "concurrency": args.concurrency,
        "stream_every": args.stream_every,
        "chunks": args.chunks,
        "batches": len(samples) - 1,
        "tenant": TENANT,
        "tier": TIER,
        "run_ids": [f"{RUN_ID_PREFIX}-{i}" for i in range(args.concurrency)],
        "errors": errors,
        "error_kinds": error_kinds,
        "rss_start_mib": round(samples[0]["rss_kib"] / 1024, 1),
        "rss_first_batch_mib": round(first / 1024, 1) if first else None,
        "rss_last_mib": round(last / 1024, 1),
        "rss_after_settle_mib": round(final_rss / 1024, 1),
        "growth_ratio": round(last / first, 3) if first else None,
        "slope_kib_per_10k_calls_last_half": (
            round(slope, 1) if (slope := slope_kib_per_10k(samples[1:])) is not None else None
        ),
        "ledger_xlen": ledger,
        "ledger_ok": ledger == driver.next_call == args.calls,
        "leases_zcard": leases,
        "leases_ok": leases == 0,
        "store_wait_s": waited,
        "redis_used_memory_mib": round(redis_used / 2**20, 1),
        "git": git_revision(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out.write(json.dumps(summary) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=100_000, help="total calls (default 100000)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients, one run id each")
    parser.add_argument("--stream-every", type=int, default=4, help="every Nth call streams (0: none)")
    parser.add_argument("--chunks", type=int, default=20, help="content chunks per streamed call")
    parser.add_argument("--batches", type=int, default=10, help="RSS is sampled after each batch")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="stop issuing calls after this")
    parser.add_argument("--proxy-log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.jsonl", help="JSON lines output")
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs, config and Redis data")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.concurrency < 1 or args.batches < 1 or args.stream_every < 0:
        parser.error("--calls, --concurrency and --batches must be >= 1, --stream-every >= 0")
    args.batches = min(args.batches, args.calls)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # SIGTERM runs the finally blocks below: servers stopped, work dir removed.
    with sigterm_exits():
        workdir = Path(tempfile.mkdtemp(prefix="llm-proxy-soak-"))
        try:
            with (
                soak_stack(workdir, args.proxy_log_level, args.max_seconds) as stack,
                args.out.open("w") as out,
            ):
                print(
                    f"soak: upstream {stack.upstream.url}, proxy {stack.proxy.url} (pid "
                    f"{stack.proxy.process.pid}), redis {stack.redis.url}; workdir {workdir}\n"
                    f"soak: {args.calls} calls, concurrency {args.concurrency}, every "
                    f"{args.stream_every or '-'}th a {args.chunks}-chunk stream; tenant {TENANT!r}, tier "
                    f"{TIER!r}, run ids {RUN_ID_PREFIX}-0..{RUN_ID_PREFIX}-{args.concurrency - 1}",
                    file=sys.stderr,
                )
                summary = asyncio.run(drive(stack, args, out))
        finally:
            if args.keep_workdir:
                print(f"soak: workdir kept: {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)

    s = summary
    print()
    print(
        f"RSS: start {s['rss_start_mib']} MiB, after batch 1 {s['rss_first_batch_mib']} MiB, "
        f"last {s['rss_last_mib']} MiB (after settling {s['rss_after_settle_mib']} MiB)"
    )
    print(f"growth ratio RSS(last) / RSS(after batch 1): {s['growth_ratio']}")
    print(f"slope over the last half: {s['slope_kib_per_10k_calls_last_half']} KiB per 10k calls")
    print(
        f"ledger XLEN {key_prefix(TENANT)}ledger: {s['ledger_xlen']} (expected {args.calls}: "
        f"{'ok' if s['ledger_ok'] else 'MISMATCH'})"
    )
    print(
        f"leases ZCARD {key_prefix(TENANT)}leases: {s['leases_zcard']} "
        f"({'ok' if s['leases_ok'] else 'LEFT RESERVED'})"
    )
    print(
        f"errors: {s['errors']} {s['error_kinds'] or ''}; "
        f"redis used_memory {s['redis_used_memory_mib']} MiB; "
        f"wall {time.monotonic() - started:.0f}s; JSON lines in {args.out}"
    )
    return 0 if s["ledger_ok"] and s["leases_ok"] and not s["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
