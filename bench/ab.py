"""Paired A/B of two revisions of the proxy: ``.venv/bin/python bench/ab.py [--base REV]``.

A change that saves a few percent of CPU per call is invisible in ``run.py``'s rounds on a
noisy 2-core machine, where the relay itself drifts 20-30% between runs. Here the two proxies
run side by side against one upstream and one Redis, under the same paced (open-loop) load,
alternating A B B A round after round, so drift hits both alike: what is reported is the
median and spread of the per-round ratio B / A of proxy CPU ms per call.

A is ``--base`` (default ``HEAD``), checked out into a temporary ``git worktree``; B is this
working tree, uncommitted changes included. Each proxy imports its own tree (``PYTHONPATH``);
both run the same generated config (``bench/scenarios.py``) on ports of their own.
``--python-a`` / ``--python-b``: the interpreter each arm's proxy runs on (a venv with the
project's dependencies; default this one), to compare interpreters on the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procstats import Server, cpu_seconds, sigterm_exits  # noqa: E402
from bench.run import Settings, loadgen_argv, start_proxy, start_upstream  # noqa: E402
from bench.scenarios import SCENARIOS, proxy_config  # noqa: E402
from proxy.redis_server import RedisServerProcess, free_port  # noqa: E402


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ab-base-") as parent:
        path = Path(parent) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
            check=True,
            capture_output=True,
        )
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def cpu_ms_per_call(
    server: Server, argv: list[str], redis_pid: int | None = None
) -> tuple[float, float, dict[str, Any]]:
    """Run one load generator (``--sync``) and sample the proxy's CPU (and Redis's: the arms
    take turns, so what Redis spends meanwhile is this arm's) around its measured phase."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        deadline = time.monotonic() + 120
        while True:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"ab: loadgen did not warm up: {proc.stderr.read().decode()[-2000:]}")
            ready, _, _ = select.select([proc.stderr], [], [], 0.5)
            if ready and proc.stderr.readline().strip() == b"warm":
                break
        tree = server.tree()
        redis = [redis_pid] if redis_pid is not None else []
        before, redis_before = cpu_seconds(tree), cpu_seconds(redis)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
        spent, redis_spent = cpu_seconds(tree) - before, cpu_seconds(redis) - redis_before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads(out.decode().strip().splitlines()[-1])
    if proc.returncode != 0 or result["errors"]:
        raise SystemExit(f"ab: loadgen failed: {result} {err.decode()[-2000:]}")
    calls = max(1, int(result["requests"]))
    return spent * 1000 / calls, redis_spent * 1000 / calls, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="HEAD", help="git revision of arm A (default HEAD)")
    parser.add_argument("--scenario", default="nonstream-small", choices=[s.name for s in SCENARIOS])
    parser.add_argument("--rate", type=float, default=600.0, help="requests/s, both arms (open loop)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--chunk-delay-ms",
        type=float,
        default=0.0,
        help="space a stream's events (each then reaches the proxy in a read of its own, as from a "
        "provider generating as it sends; without it reads carry several events, however the "
        "scheduler batches them: noisier)",
    )
    parser.add_argument(
        "--obfuscation", action="store_true", help="stream chunks end in OpenAI's padding field (run.py)"
    )
    parser.add_argument(
        "--python-a",
        default=sys.executable,
        help="the interpreter arm A's proxy runs on, from a venv with the project's dependencies "
        "(default: this one)",
    )
    parser.add_argument("--python-b", default=sys.executable, help="the same for arm B")
    args = parser.parse_args(argv)
    known = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", args.base + "^{commit}"],
        capture_output=True,
        check=False,
    )
    if known.returncode != 0:
        parser.error(f"--base: not a revision of this repository: {args.base!r}")
    scenario = next(s for s in SCENARIOS if s.name == args.scenario)
    settings = Settings(
        "ab",
        args.warmup,
        args.duration,
        (args.concurrency,),
        None,
        1,
        (scenario,),
        {"paced": {"*": args.rate}},
    )
    servers: list[Server] = []
    # SIGTERM runs the cleanups below: servers stopped, work dir and worktree removed.
    with (
        sigterm_exits(),
        tempfile.TemporaryDirectory(prefix="ab-") as scratch,
        worktree(args.base) as base_root,
    ):
        workdir = Path(scratch)
        redis = RedisServerProcess(workdir / "redis", port=free_port())
        try:
            upstream = start_upstream(
                workdir, 3600, chunk_delay_ms=args.chunk_delay_ms, obfuscation=args.obfuscation
            )
            servers.append(upstream)
            redis.start()
            proxies: dict[str, Server] = {}
            arms = (("A", base_root, args.python_a), ("B", ROOT, args.python_b))
            for arm, root, python in arms:
                (workdir / arm).mkdir()
                config_path = workdir / arm / "proxy.yaml"
                config = proxy_config(free_port(), upstream.url, redis.url, "info")
                config_path.write_text(yaml.safe_dump(config))
                proxies[arm] = start_proxy(config_path, workdir / arm, None, root=root, python=python)
                servers.append(proxies[arm])
            ratios: list[float] = []
            redis_ratios: list[float] = []
            p50s: dict[str, list[float]] = {"A": [], "B": []}
            ttfbs: dict[str, list[float]] = {"A": [], "B": []}  # a stream's first byte
            redis_pid = redis.process.pid if redis.process is not None else None
            for round_no in range(args.rounds):
                order = ("A", "B", "B", "A") if round_no % 2 == 0 else ("B", "A", "A", "B")
                spent: dict[str, list[float]] = {"A": [], "B": []}
                redis_spent: dict[str, list[float]] = {"A": [], "B": []}
                for arm in order:
                    url = proxies[arm].url + "/v1/chat/completions"
                    load = loadgen_argv(scenario, "proxy", url, args.concurrency, settings)
                    ms, redis_ms, result = cpu_ms_per_call(proxies[arm], load, redis_pid)
                    spent[arm].append(ms)
                    redis_spent[arm].append(redis_ms)
                    p50s[arm].append(float(result["latency_ms"]["p50"]))
                    ttfb = (result.get("ttfb_ms") or {}).get("p50")
                    if ttfb is not None:
                        ttfbs[arm].append(float(ttfb))
                    print(
                        f"round {round_no} {arm}: {ms:.4f} ms/call, Redis {redis_ms:.4f} ms/call, "
                        f"{result['rps']} req/s, p50 {result['latency_ms']['p50']} ms",
                        file=sys.stderr,
                    )
                ratio = statistics.mean(spent["B"]) / statistics.mean(spent["A"])
                ratios.append(ratio)
                if statistics.mean(redis_spent["A"]) > 0:
                    redis_ratios.append(statistics.mean(redis_spent["B"]) / statistics.mean(redis_spent["A"]))
                print(f"round {round_no}: B/A {ratio:.3f}", file=sys.stderr)
        finally:
            for server in reversed(servers):
                server.stop()
            redis.stop()
    print(
        json.dumps(
            {
                "scenario": scenario.name,
                "rate": args.rate,
                "concurrency": args.concurrency,
                "base": args.base,
                "python": {"A": args.python_a, "B": args.python_b},
                "chunk_delay_ms": args.chunk_delay_ms,
                "obfuscation": args.obfuscation,
                "ratio_b_over_a_median": round(statistics.median(ratios), 4),
                "ratio_min": round(min(ratios), 4),
                "ratio_max": round(max(ratios), 4),
                "ratios": [round(r, 4) for r in ratios],
                # What the shared Redis spent while each arm ran, B / A: the scripts' cost.
                **(
                    {
                        "redis_ratio_b_over_a_median": round(statistics.median(redis_ratios), 4),
                        "redis_ratio_min": round(min(redis_ratios), 4),
                        "redis_ratio_max": round(max(redis_ratios), 4),
                    }
                    if redis_ratios
                    else {}
                ),
                "p50_ms_median": {arm: round(statistics.median(v), 3) for arm, v in p50s.items()},
                **(
                    {"ttfb_p50_ms_median": {arm: round(statistics.median(v), 3) for arm, v in ttfbs.items()}}
                    if ttfbs["A"] and ttfbs["B"]
                    else {}
                ),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
