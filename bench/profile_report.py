"""Summarise a py-spy ``--format raw`` (collapsed stacks) profile of the proxy.

``python bench/profile_report.py bench/results/profile-budgets-on.collapsed.txt [--top 25]``

Prints, as percentages of the CPU samples:

* **by proxy line**: each sample charged to the deepest frame in the proxy's own code (``--scope``,
  default ``proxy/``), so library work (pydantic, json, redis-py, logging) is charged to the
  proxy line that asked for it;
* **inclusive by function**: the share of samples in which a function is on the stack;
* **self**: the leaf frames, where the interpreter actually was.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def short_path(path: str) -> str:
    for marker in ("/site-packages/", "/lib/python3.11/", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def parse(path: Path) -> list[tuple[list[tuple[str, str, str]], int]]:
    stacks = []
    for raw in path.read_text(errors="replace").splitlines():
        stack_text, _, count = raw.rpartition(" ")
        if not count.isdigit():
            continue
        frames = []
        for part in stack_text.split(";"):
            match = FRAME.match(part.strip())
            if match is None:
                continue  # "process 123:..." / "thread ..." headers
            frames.append((match["func"], short_path(match["file"]), match["line"] or "?"))
        if frames:
            stacks.append((frames, int(count)))
    return stacks


def report(path: Path, top: int, scope: str, ignore: tuple[str, ...] = ()) -> str:
    stacks = parse(path)
    total = sum(count for _, count in stacks)
    if not total:
        return f"{path}: no samples"
    by_line: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for frames, count in stacks:
        owner = "(outside the proxy's code: event loop, aiohttp server, redis-py internals)"
        for func, file, line in reversed(frames):
            if file.startswith(scope) and file not in ignore:
                owner = f"{file}:{line} {func}"
                break
        by_line[owner] += count
        for name in {f"{file} {func}" for func, file, _ in frames}:
            inclusive[name] += count
        func, file, line = frames[-1]
        leaf[f"{file}:{line} {func}"] += count

    def table(title: str, counter: Counter[str]) -> list[str]:
        rows = [f"## {title}", ""]
        rows += [f"{100 * n / total:6.1f}%  {name}" for name, n in counter.most_common(top)]
        return [*rows, ""]

    lines = [f"# {path.name}: {total} CPU samples", ""]
    lines += table(f"by {scope} line (deepest frame in {scope})", by_line)
    lines += table("inclusive by function", inclusive)
    lines += table("self (leaf frames)", leaf)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--scope", default="proxy/", help="path prefix of the code to charge (proxy/)")
    parser.add_argument(
        "--ignore",
        default="proxy/cli.py,proxy/__main__.py",
        help="comma-separated files never charged (the entry point that runs the event loop)",
    )
    args = parser.parse_args()
    ignore = tuple(f for f in args.ignore.split(",") if f)
    print(report(args.profile, args.top, args.scope, ignore))
    return 0


if __name__ == "__main__":
    sys.exit(main())
