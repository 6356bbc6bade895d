"""What a journaled settle costs during a store outage: its line made durable on this disk.

``.venv/bin/python bench/journal_cost.py [--calls N] [--concurrency C] [--disk-delay-ms MS] [--root DIR]``

During an outage every settle is journaled (``proxy.journal.Journal.append_off_loop``), and its
call goes on only once its line is synced (fsync). ``C`` calls settle at once, ``N`` in all; the
table gives lines per second, each append's wait (p50, p99) and the syncs made per line.
``--disk-delay-ms`` adds that much to every sync, as a disk slow to sync would (a network
volume, a busy disk); ``--dir`` puts the journal on another filesystem. ``--root`` measures
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


async def run(calls: int, concurrency: int, directory: Path) -> tuple[float, list[float]]:
    from proxy.journal import Journal
    from proxy.journal_lines import PendingSettlement

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
    journal.close()
    return elapsed_s, waits_s


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
    syncs = 0

    def counted_fsync(fd: int) -> None:
        nonlocal syncs
        syncs += 1
        if args.disk_delay_ms:
            time.sleep(args.disk_delay_ms / 1000)
        real_fsync(fd)

    os.fsync = counted_fsync  # the journal's syncs, counted (and slowed, when asked)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        elapsed_s, waits_s = asyncio.run(run(args.calls, args.concurrency, Path(tmp) / "journal"))
    waits_ms = sorted(w * 1000 for w in waits_s)
    p99_ms = waits_ms[min(len(waits_ms) - 1, int(len(waits_ms) * 0.99))]
    print(f"tree {args.root}")
    print("| calls | concurrency | disk delay ms | lines/s | wait p50 ms | wait p99 ms | syncs per line |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.calls} | {args.concurrency} | {args.disk_delay_ms:g} | {args.calls / elapsed_s:.0f} "
        f"| {statistics.median(waits_ms):.2f} | {p99_ms:.2f} | {syncs / args.calls:.3f} |"
    )


if __name__ == "__main__":
    main()
