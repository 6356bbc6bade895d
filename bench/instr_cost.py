"""Instructions per call, counted by valgrind's callgrind: ``.venv/bin/python bench/instr_cost.py``.

CPU time per call on this 2-core machine drifts 20-30% between runs and a change of a few
percent hides in it (``bench/ab.py`` pairs arms to see through it). Callgrind counts the
instructions a process executes in user space instead: the same code doing the same calls counts
within a fraction of a percent of the same total, whatever else the machine is doing. What it
does not count: the kernel's side of system calls and the cost of cache misses, so it is a
measure of the Python (and C) a call runs, beside ``ab.py``'s CPU time, not instead of it.

Each arm's server runs under ``valgrind --tool=callgrind`` (some 50 times slower), against the
fast fake upstream and one Redis. After ``--warmup`` calls its counters are zeroed
(``callgrind_control -z``); then ``--calls`` calls are made at ``--concurrency`` (default 1: no
batching of reads between calls, so a call's count does not depend on the scheduler) and the
counters are dumped. Reported: instructions per call, and each arm ÷ the first arm.

Arms: ``relay`` (``bench/relay.py`` on asyncio's loop: the issue's bare relay), ``relay-uvloop``
(the same on uvloop, the proxy's default loop), ``floor`` (relay on uvloop plus two Redis
scripts through the proxy's pipelined client: ``--lean-floor``), ``proxy`` (this tree), and with
``--base REV`` ``base`` (the proxy at REV, in a temporary ``git worktree``), to count a change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))

from bench.ab import worktree  # noqa: E402
from bench.procstats import Server, start_ready_line  # noqa: E402
from bench.run import start_proxy, start_upstream  # noqa: E402
from bench.scenarios import KEYS, SCENARIOS, proxy_config  # noqa: E402
from proxy.redis_server import RedisServerProcess, free_port  # noqa: E402

PYTHON = sys.executable
ARMS = ("relay", "relay-uvloop", "floor", "proxy")
START_TIMEOUT_S = 600.0  # imports under callgrind are slow


def callgrind(out_dir: Path, arm: str) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out_dir / f'callgrind.{arm}.%p'}",
        "--dump-instr=no",
        "--collect-jumps=no",
    ]


def start_arm(arm: str, workdir: Path, upstream_url: str, redis_url: str, root: Path) -> Server:
    wrap = callgrind(workdir, arm)
    if arm in ("proxy", "base"):
        (workdir / arm).mkdir(exist_ok=True)
        config_path = workdir / arm / "proxy.yaml"
        config_path.write_text(yaml.safe_dump(proxy_config(free_port(), upstream_url, redis_url, "info")))
        return start_proxy(
            config_path, workdir / arm, None, root=root, wrap=wrap, ready_timeout_s=START_TIMEOUT_S
        )
    argv = [*wrap, PYTHON, str(BENCH / "relay.py"), "--upstream", upstream_url, "--port", "0"]
    if arm != "relay":
        argv.append("--uvloop")
    if arm == "floor":
        argv += ["--redis", redis_url, "--pipelined"]
    return start_ready_line(arm, argv, workdir, timeout_s=START_TIMEOUT_S)


def load(url: str, calls: int, concurrency: int, scenario_name: str, key: str) -> dict[str, object]:
    scenario = next(s for s in SCENARIOS if s.name == scenario_name)
    argv = [
        PYTHON,
        str(BENCH / "loadgen.py"),
        "--url",
        url,
        "--requests",
        str(calls),
        "--concurrency",
        str(concurrency),
        "--prompt-bytes",
        str(scenario.prompt_bytes),
        "--model",
        scenario.model,
        "--key",
        key,
        "--run-id-prefix",
        "instr",
        "--timeout",
        "60",
        "--max-seconds",
        "900",
    ]
    if scenario.stream:
        argv += ["--stream", "--chunks", str(scenario.chunks)]
    out = subprocess.run(argv, capture_output=True, check=True, timeout=1000)
    result: dict[str, object] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    if result.get("errors"):
        raise SystemExit(f"instr_cost: load failed: {result} {out.stderr.decode()[-2000:]}")
    return result


def control(option: str, pid: int) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True, timeout=300)


def dumped_total(workdir: Path, arm: str, pid: int, before: set[Path]) -> int:
    """The instruction total of the dump ``callgrind_control -d`` just wrote."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        new = sorted(set(workdir.glob(f"callgrind.{arm}.{pid}*")) - before)
        for path in new:
            match = re.search(r"^(?:summary|totals):\s*(\d+)", path.read_text(errors="replace"), re.M)
            if match:
                return int(match.group(1))
        time.sleep(0.5)
    raise SystemExit(f"instr_cost: no dump of {arm} appeared")


def measure(
    arm: str, workdir: Path, upstream_url: str, redis_url: str, root: Path, args: argparse.Namespace
) -> float:
    server = start_arm(arm, workdir, upstream_url, redis_url, root)
    try:
        url = server.url + "/v1/chat/completions"
        key = KEYS[args.tier] if arm in ("proxy", "base") else KEYS["open"]
        load(url, args.warmup, args.concurrency, args.scenario, key)
        pid = server.process.pid
        control("-z", pid)
        load(url, args.calls, args.concurrency, args.scenario, key)
        before = set(workdir.glob(f"callgrind.{arm}.{pid}*"))
        control("-d", pid)
        calls: int = args.calls
        return dumped_total(workdir, arm, pid, before) / calls
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario", default="stream-20", choices=("nonstream-small", "stream-20", "stream-200")
    )
    parser.add_argument(
        "--tier", default="open", choices=("open", "budget"), help="the proxy's key (bench tiers)"
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=(*ARMS, "base"))
    parser.add_argument("--base", default=None, help="git revision for the arm 'base' (added to --arms)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="copy the callgrind dumps here (callgrind_annotate reads them)",
    )
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind (with callgrind_control) is not installed")
    arms = list(args.arms)
    if args.base and "base" not in arms:
        arms.append("base")
    if "base" in arms and not args.base:
        parser.error("the arm 'base' needs --base REV")
    results: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="instr-")))
        base_root = stack.enter_context(worktree(args.base)) if args.base else None
        redis = RedisServerProcess(workdir / "redis", port=free_port())
        upstream = start_upstream(workdir, 7200)
        stack.callback(upstream.stop)
        redis.start()
        stack.callback(redis.stop)
        for arm in arms:
            root = base_root if arm == "base" and base_root is not None else ROOT
            results[arm] = measure(arm, workdir, upstream.url, redis.url, root, args)
            print(
                f"instr_cost: {arm}: {results[arm]:,.0f} instructions per call", file=sys.stderr, flush=True
            )
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for path in workdir.glob("callgrind.*"):
                shutil.copy(path, args.keep / path.name)
    first = arms[0]
    print(f"\n{args.scenario}, tier {args.tier}, {args.calls} calls at concurrency {args.concurrency}\n")
    print(f"| arm | instructions per call | ÷ {first} |")
    print("|---|---:|---:|")
    for arm in arms:
        print(f"| {arm} | {results[arm]:,.0f} | {results[arm] / results[first]:.3f} |")
    print(json.dumps({"scenario": args.scenario, "tier": args.tier, "calls": args.calls, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
