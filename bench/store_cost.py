"""What one billed call costs Redis: server CPU, commands and AOF bytes per reserve + settle.

``.venv/bin/python bench/store_cost.py [--calls 20000] [--concurrency 16]``

Starts a throwaway ``redis-server`` (AOF on, ``appendfsync everysec``, as the proxy runs it),
then drives the proxy's own store (``proxy.redis_store.RedisStore``, its pipelined client)
through reserve and settle for the scopes a call of each tier reserves against (``open``: the
run, the key and the day and month windows of key and tenant, the reserve held on the run and
the tenant's month, which the other tier limits; ``budget``: the same with limits and a minute
window, held on the run, the minute, the day and the tenant's month), and, as the floor, two
calls of a two-``HINCRBY`` script per call (the relay+redis arm of ``bench/run.py``). Redis's
CPU is read from ``/proc`` around each phase; commands per call from ``INFO commandstats``
(commands a script runs count there too); AOF bytes from the file's growth (automatic AOF
rewrites off while it runs). Nothing else should run on the machine: Redis CPU is per process,
but a busy machine slows it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.auth import Identity
from proxy.config_tiers import Ceilings, TierConfig, WindowCeilings
from proxy.redis_server import RedisServerProcess, free_port
from proxy.redis_store import RedisStore
from proxy.resp import PipelinedConnection
from proxy.scopes import scopes_for
from proxy.store import Reservation

HUGE = 10**12
FLOOR_SCRIPT = (
    "redis.call('HINCRBY', KEYS[1], 'a', ARGV[1]); return redis.call('HINCRBY', KEYS[1], 'b', ARGV[1])"
)
ENTRY = {
    "ts_ms": "1764590000000",
    "tenant": "bench",
    "key": "bench-open",
    "run": "run-1",
    "model": "gpt-4o-mini",
    "endpoint": "chat.completions",
    "outcome": "ok",
    "finish_reason": "stop",
    "input_tokens": "90",
    "output_tokens": "60",
    "total_tokens": "150",
    "cost_micros": "50",
    "usage_source": "provider",
    "reserved_input_tokens": "120",
    "reserved_output_tokens": "1000",
}


def tiers() -> dict[str, TierConfig | None]:
    big = {"requests": HUGE, "total_tokens": HUGE, "cost_usd": 10**8}
    limited = Ceilings(
        requests=HUGE, input_tokens=HUGE, output_tokens=HUGE, total_tokens=HUGE, concurrent=100_000
    )
    return {
        "open": TierConfig(),
        "budget": TierConfig(
            run=limited,
            windows=(WindowCeilings(period="minute", **big), WindowCeilings(period="day", **big)),
            tenant=(WindowCeilings(period="month", **big),),
        ),
    }


def redis_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def commands(pipe: PipelinedConnection) -> int:
    info = await pipe.call("INFO", "commandstats")
    text = info.decode() if isinstance(info, bytes) else str(info)
    total = 0
    for line in text.splitlines():
        if line.startswith("cmdstat_") and not line.startswith(("cmdstat_info", "cmdstat_config")):
            total += int(line.split("calls=", 1)[1].split(",", 1)[0])
    return total


async def drive(calls: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> None:
    todo = iter(range(calls))

    async def worker() -> None:
        for i in todo:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def measure(
    label: str,
    server: RedisServerProcess,
    pipe: PipelinedConnection,
    calls: int,
    concurrency: int,
    one: Callable[[int], Awaitable[None]],
) -> dict[str, Any]:
    await drive(min(2000, calls), concurrency, one)  # warm-up: keys created, scripts loaded
    await pipe.call("CONFIG", "RESETSTAT")
    aof = sum(f.stat().st_size for f in server.data_dir.rglob("*.aof*"))
    assert server.process is not None
    cpu0, t0 = redis_cpu_s(server.process.pid), time.perf_counter()
    await drive(calls, concurrency, one)
    wall = time.perf_counter() - t0
    cpu = redis_cpu_s(server.process.pid) - cpu0
    n_commands = await commands(pipe)
    aof_bytes = sum(f.stat().st_size for f in server.data_dir.rglob("*.aof*")) - aof
    return {
        "arm": label,
        "calls_per_s": calls / wall,
        "redis_cpu_us_per_call": cpu / calls * 1e6,
        "redis_commands_per_call": n_commands / calls,
        "aof_bytes_per_call": aof_bytes / calls,
    }


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="lbp-store-cost-") as tmp:
        server = RedisServerProcess(Path(tmp) / "redis", port=free_port())
        server.start()
        store = RedisStore.from_url(server.url)
        pipe = PipelinedConnection(server.url, timeout_s=5.0)
        try:
            await store.load_scripts()
            # An AOF rewrite in a phase would shrink the file under it (a negative growth): none
            # while this runs, so the growth is what the phase appended.
            await pipe.call("CONFIG", "SET", "auto-aof-rewrite-percentage", "0")
            rows = []
            floor_sha = await pipe.call("SCRIPT", "LOAD", FLOOR_SCRIPT)

            async def floor(i: int) -> None:
                await pipe.call("EVALSHA", floor_sha, 1, f"floor:{i % 64}", 1)
                await pipe.call("EVALSHA", floor_sha, 1, f"floor:{i % 64}", 1)

            rows.append(
                await measure(
                    "floor: 2 x EVALSHA(2 HINCRBY)", server, pipe, args.calls, args.concurrency, floor
                )
            )
            # One tenant, as in bench/run.py's config: the budget tier's tenant window is held by
            # the open tier's calls too.
            named = frozenset(w.period for t in tiers().values() if t for w in t.tenant)
            periods = (named, named)  # every window named there has a ceiling
            for name, tier in tiers().items():
                identity = Identity(tenant="bench", tier=name, key_name=f"bench-{name}")

                async def billed(
                    i: int, identity: Identity = identity, tier: TierConfig | None = tier, name: str = name
                ) -> None:
                    # Windows picked at each call, as the proxy does: a run crosses a minute's end
                    # (the reserve script writes nothing in a window that has ended).
                    scopes = scopes_for(
                        identity,
                        f"run-{i % 64}",
                        tier,
                        datetime.now(UTC),
                        run_ttl_s=86400,
                        tenant_periods=periods,
                    )
                    amounts = {
                        "requests": 1,
                        "input_tokens": 120,
                        "output_tokens": 1000,
                        "total_tokens": 1120,
                        "cost_micros": 620,
                        "concurrent": 1,
                    }
                    res = await store.reserve(
                        tenant="bench",
                        reservation_id=f"{name}-{i}-{time.monotonic_ns()}",
                        run_id=f"run-{i % 64}",
                        scopes=scopes,
                        amounts=amounts,
                        lease_ms=60_000,
                        record='{"model":"gpt-4o-mini"}',
                    )
                    assert isinstance(res, Reservation), res
                    await store.settle(
                        tenant="bench",
                        reservation_id=res.id,
                        run_id=res.run_id,
                        scope_keys=[s.key for s in scopes],
                        actual={
                            "requests": 1,
                            "input_tokens": 90,
                            "output_tokens": 60,
                            "total_tokens": 150,
                            "cost_micros": 50,
                        },
                        entry=ENTRY,
                        bill_if_lost=True,
                        scope_ttls_s=[s.ttl_s for s in scopes],
                        runlog_ttl_s=86400,
                    )

                shown = scopes_for(
                    identity, "run-0", tier, datetime.now(UTC), run_ttl_s=86400, tenant_periods=periods
                )
                held = sum(1 for s in shown if s.holds or s.name == "run")
                label = f"reserve + settle, tier {name} ({len(shown)} scopes, {held} holding the reserve)"
                rows.append(await measure(label, server, pipe, args.calls, args.concurrency, billed))
        finally:
            await pipe.close()
            await store.close()
            server.stop()
    floor_cpu = rows[0]["redis_cpu_us_per_call"]
    print(f"# Redis cost per call ({args.calls} calls, concurrency {args.concurrency}, AOF everysec)\n")
    print("| arm | calls/s | Redis CPU us/call | x floor | commands/call | AOF bytes/call |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['calls_per_s']:,.0f} | {r['redis_cpu_us_per_call']:.1f} | "
            f"{r['redis_cpu_us_per_call'] / floor_cpu:.2f} | {r['redis_commands_per_call']:.1f} | "
            f"{r['aof_bytes_per_call']:,.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=16)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
