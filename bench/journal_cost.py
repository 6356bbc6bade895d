"""What the journal costs around a store outage: a settle's line made durable on this disk, and
the replay of the lines once the store is back.

``.venv/bin/python bench/journal_cost.py [--calls N] [--concurrency C] [--disk-delay-ms MS] [--root DIR]``

During an outage every settle is journaled (``proxy.journal.Journal.append_off_loop``), and its
call goes on only once its line is synced (fsync). ``C`` calls settle at once, ``N`` in all; the
table gives lines per second, each append's wait (p50, p99) and the syncs made per line.
``--disk-delay-ms`` adds that much to every sync, as a disk slow to sync would (a network
volume, a busy disk); ``--dir`` puts the journal on another filesystem. Then a throwaway Redis
holds the calls' reservations and the journal is replayed into it (``Journal.replay``): lines
per second, which bounds how long an outage's lines take to be billed once the store is back
(a reaper bills at its reserve what is left after ``reap_grace_s``). ``--root`` measures
another source tree (a ``git worktree`` of an earlier commit) for a before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def line(i: int) -> dict[str, Any]:
    """A settlement as the proxy journals it: a whole call's figures and its ledger entry."""
    return {
        "tenant": "team-a",
        "reservation_id": f"res-{i:08d}",
        "run_id": "run-1",
        "scope_keys": ["lbp:{team-a}:run:run-1", "lbp:{team-a}:day:2026-12-03"],
        "actual": {"requests": 1, "input_tokens": 120, "output_tokens": 40, "total_tokens": 160},
        "entry": {
            "request_id": f"req-{i:08d}",
            "model": "gpt-4o-mini",
            "outcome": "ok",
            "input_tokens": "120",
            "output_tokens": "40",
            "cost_micros": "42",
            "usage_source": "provider",
        },
        "bill_if_lost_until_ms": 0,
        "scope_ttls_s": [172800, 172800],
        "runlog_ttl_s": 172800,
        "owned_contexts": [],
    }


async def run(
    calls: int, concurrency: int, directory: Path, syncs: list[int]
) -> tuple[float, list[float], float, int]:
    """Journal ``calls`` settles, ``concurrency`` at once; then replay them into a new Redis.
    Returns the journaling's seconds, each append's wait, the replay's seconds, and the syncs
    made while journaling (``syncs[0]`` counts them all)."""
    import redis.asyncio as aioredis

    from proxy.journal import Journal
    from proxy.journal_lines import PendingSettlement
    from proxy.redis_server import RedisServerProcess
    from proxy.redis_store import RedisStore

    journal = Journal(directory)
    waits_s: list[float] = []
    todo = iter(range(calls))

    async def settler() -> None:
        for i in todo:
            started = time.perf_counter()
            await journal.append_off_loop(PendingSettlement(**line(i)))
            waits_s.append(time.perf_counter() - started)

    began = time.perf_counter()
    await asyncio.gather(*(settler() for _ in range(concurrency)))
    elapsed_s = time.perf_counter() - began
    journaling_syncs = syncs[0]

    redis = RedisServerProcess(directory.parent / "redis")
    await asyncio.to_thread(redis.start)
    try:
        admin = aioredis.Redis.from_url(redis.url)
        async with admin.pipeline(transaction=False) as pipe:
            for i in range(calls):  # the reservations the calls held, as a reserve leaves them
                pipe.hset(
                    f"lbp:{{team-a}}:resv:res-{i:08d}", mapping={"amounts": "1 120 40 160 42 1", "born": "-"}
                )
            await pipe.execute()
        await admin.aclose()
        store = RedisStore.from_url(redis.url)
        await store.load_scripts()
        began = time.perf_counter()
        replayed = await journal.replay(store)
        replay_s = time.perf_counter() - began
        await store.close()
    finally:
        journal.close()
        await asyncio.to_thread(redis.stop)
    assert replayed == calls, f"{replayed} of {calls} lines replayed"
    return elapsed_s, waits_s, replay_s, journaling_syncs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disk-delay-ms", type=float, default=0.0)
    parser.add_argument("--dir", default=None, help="where the journal goes (default: a temporary directory)")
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    import logging

    logging.disable(logging.WARNING)  # one "journaled" warning per line otherwise

    real_fsync = os.fsync
    syncs = [0]

    def counted_fsync(fd: int) -> None:
        syncs[0] += 1
        if args.disk_delay_ms:
            time.sleep(args.disk_delay_ms / 1000)
        real_fsync(fd)

    os.fsync = counted_fsync  # the journal's syncs, counted (and slowed, when asked)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        elapsed_s, waits_s, replay_s, syncs_journaling = asyncio.run(
            run(args.calls, args.concurrency, Path(tmp) / "journal", syncs)
        )
    waits_ms = sorted(w * 1000 for w in waits_s)
    p99_ms = waits_ms[min(len(waits_ms) - 1, int(len(waits_ms) * 0.99))]
    print(f"tree {args.root}")
    print(
        "| calls | concurrency | disk delay ms | journaled lines/s | wait p50 ms | wait p99 ms "
        "| syncs per line | replayed lines/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.calls} | {args.concurrency} | {args.disk_delay_ms:g} | {args.calls / elapsed_s:.0f} "
        f"| {statistics.median(waits_ms):.2f} | {p99_ms:.2f} | {syncs_journaling / args.calls:.3f} "
        f"| {args.calls / replay_s:.0f} |"
    )


if __name__ == "__main__":
    main()
