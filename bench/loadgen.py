"""Load generator: N concurrent keep-alive clients against one chat-completions URL.

Runs for a fixed ``--duration`` (seconds) or a fixed ``--requests`` count, after an optional
``--warmup`` whose results are discarded. Prints one JSON object on stdout:

  requests, ok, errors, status_counts, error_kinds, duration_s, rps (completed requests per
  second, errors included), latency_ms {p50, p90, p99, mean, max} (request sent -> body fully
  read), ttfb_ms {p50, p99} (request sent -> first body byte; streams only), bytes_in. The
  latencies and TTFBs are those of the calls that succeeded (ok) alone, null when none did: a
  fast error answer (a 502 in a millisecond) would otherwise pass for a fast call.

``--sync``: after the warm-up, write ``warm`` on stderr and wait for a line on stdin before the
measured phase starts, so a driver can sample the server's CPU counters exactly around it.

A stream counts as ok only when it ends with ``data: [DONE]``; a response counts as ok only
with the ``--expect-status`` (200 by default; 429 for the refusal scenario).

``--rate R`` paces the clients to R requests per second in all (open loop, no catch-up bursts),
as for the background load of the ``mixed-100k-*`` scenarios. SIGTERM or SIGINT ends the phase
early: in-flight requests finish and the JSON is printed as usual.

``--prompt-style words`` (default) repeats 15 short words; ``english`` is varied English-like
prose (a few hundred distinct words, capitals, punctuation, numbers, paragraphs: about 4 bytes
per cl100k token, as real English), for tokenizer-cost scenarios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog",
    "while", "billing", "every", "token", "it", "sees",
)  # fmt: skip


def prompt_text(size: int) -> str:
    """About ``size`` bytes of plain ASCII words."""
    out: list[str] = []
    total = 0
    i = 0
    while total < size:
        word = WORDS[i % len(WORDS)]
        out.append(word)
        total += len(word) + 1
        i += 1
    return " ".join(out)[: max(1, size)]


_ENGLISH_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no will more "
    "about can said them some could into than other time only new these two may first then do any "
    "like my now over such our man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against "
    "go came right used take three invoice ledger settlement reconciliation throughput latency "
    "budget tenant reservation upstream streaming tokenizer quarterly forecast procurement "
    "compliance amortization idempotent heuristic asynchronous configuration deployment observability "
    "customer contract renewal discount revenue margin escalation incident postmortem rollback "
    "migration schema partition replica failover benchmark regression anomaly threshold"
)
ENGLISH = _ENGLISH_WORDS.split()


def english_text(size: int, seed: int = 7) -> str:
    """About ``size`` bytes of deterministic English-like prose (sentences and paragraphs)."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    total = 0
    while total < size:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            words = [rng.choice(ENGLISH) for _ in range(rng.randint(6, 22))]
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), str(rng.choice((rng.randint(2, 999), 2024, 1.5))))
            if rng.random() < 0.4:
                cut = rng.randrange(1, len(words))
                words[cut - 1] += ","
            sentence = " ".join(words)
            sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".....?!:"))
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        total += len(paragraph) + 2
    return "\n\n".join(paragraphs)[: max(1, size)]


# --unique-prompts: replaced in every request by the process id and a call number, so no two
# prompts are alike (the proxy remembers token counts of texts it has seen: this measures a
# first sight, as for a new conversation).
UNIQUE_MARK = b"@@@@@@@@@@@@"


def request_body(args: argparse.Namespace) -> bytes:
    text = english_text if args.prompt_style == "english" else prompt_text
    content = text(args.prompt_bytes)
    if args.unique_prompts:
        content = UNIQUE_MARK.decode() + content[len(UNIQUE_MARK) :]  # same size, made unique per call
    body: dict[str, Any] = {
        "model": args.model,
        "messages": [{"role": "user", "content": content}],
    }
    if args.max_tokens:
        body["max_tokens"] = args.max_tokens
    if args.stream:
        body["stream"] = True
        body["x_bench_chunks"] = args.chunks
        if args.include_usage:
            body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    error_kinds: Counter[str] = field(default_factory=Counter)
    ok: int = 0
    errors: int = 0
    bytes_in: int = 0


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(pct / 100 * len(ordered)) - 1))
    return round(ordered[rank], 3)


class LoadGen:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.body = request_body(args)
        self.calls = 0
        self.headers = {"Authorization": f"Bearer {args.key}", "Content-Type": "application/json"}
        self.remaining = 0  # for --requests mode
        self.stopping = False  # set by SIGTERM/SIGINT: end the phase early
        self.stopped_at = 0.0
        self.last_done = 0.0  # when the last call ended
        self.interval = 1.0 / args.rate if args.rate > 0 else 0.0
        self.next_slot = 0.0  # --rate: when the next request may start

    async def one(self, session: aiohttp.ClientSession, client: int, stats: Stats) -> None:
        args = self.args
        headers = dict(self.headers)
        if args.run_id_prefix:
            headers["X-Run-Id"] = f"{args.run_id_prefix}-{client}"
        started = time.perf_counter()
        ttfb: float | None = None
        tail = b""
        size = 0
        try:
            body = self.body
            if args.unique_prompts:
                self.calls += 1
                body = body.replace(UNIQUE_MARK, b"%06d%06d" % (os.getpid() % 10**6, self.calls % 10**6), 1)
            async with session.post(args.url, data=body, headers=headers) as resp:
                if args.stream and resp.status == 200:
                    async for piece in resp.content.iter_any():
                        if ttfb is None:
                            ttfb = time.perf_counter() - started
                        size += len(piece)
                        tail = (tail + piece)[-64:]
                else:
                    data = await resp.read()
                    size = len(data)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as err:
            stats.errors += 1
            stats.error_kinds[type(err).__name__] += 1
            return
        elapsed = time.perf_counter() - started
        stats.statuses[status] += 1
        stats.bytes_in += size
        if status != args.expect_status:
            stats.errors += 1
            stats.error_kinds[f"status_{status}"] += 1
        elif args.stream and status == 200 and not tail.rstrip().endswith(b"data: [DONE]"):
            stats.errors += 1
            stats.error_kinds["stream_without_done"] += 1
        else:
            stats.ok += 1
            # Successful calls' times alone: a failed call's is how fast it failed.
            stats.latencies.append(elapsed * 1000)
            if ttfb is not None:
                stats.ttfbs.append(ttfb * 1000)

    async def client(
        self, session: aiohttp.ClientSession, client: int, deadline: float, stats: Stats, counted: bool
    ) -> None:
        while time.perf_counter() < deadline and not self.stopping:
            if counted:
                if self.remaining <= 0:
                    return
                self.remaining -= 1
            if self.interval:
                now = time.perf_counter()
                slot = max(self.next_slot, now)  # a late client does not make up for lost slots
                self.next_slot = slot + self.interval
                if slot >= deadline:
                    return
                if slot > now:
                    await asyncio.sleep(slot - now)
                if self.stopping:
                    return
            await self.one(session, client, stats)
            self.last_done = time.perf_counter()

    async def phase(
        self, session: aiohttp.ClientSession, seconds: float, requests: int
    ) -> tuple[Stats, float]:
        stats = Stats()
        counted = requests > 0
        self.remaining = requests
        started = time.perf_counter()
        self.last_done = started
        self.next_slot = started
        deadline = started + seconds
        await asyncio.gather(
            *(self.client(session, i, deadline, stats, counted) for i in range(self.args.concurrency))
        )
        end = time.perf_counter()
        if self.stopping:
            # Clients asleep until a booked slot wake only then: the phase ended at the stop, or
            # with the last call in flight then, not with them (nor before the phase began).
            end = max(started, self.stopped_at, min(end, self.last_done))
        return stats, end - started

    def stop(self) -> None:
        if not self.stopping:
            self.stopped_at = time.perf_counter()
        self.stopping = True

    async def run(self) -> dict[str, Any]:
        args = self.args
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        connector = aiohttp.TCPConnector(
            limit=args.concurrency, force_close=False, enable_cleanup_closed=True
        )
        timeout = aiohttp.ClientTimeout(total=args.timeout)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            if args.warmup > 0:
                await self.phase(session, args.warmup, 0)
            if args.sync:
                sys.stderr.write("warm\n")
                sys.stderr.flush()
                await loop.run_in_executor(None, sys.stdin.readline)
            if args.requests > 0:
                stats, elapsed = await self.phase(session, args.max_seconds, args.requests)
            else:
                stats, elapsed = await self.phase(session, args.duration, 0)
        done = stats.ok + stats.errors
        return {
            "url": args.url,
            "concurrency": args.concurrency,
            "stream": args.stream,
            "chunks": args.chunks if args.stream else None,
            "include_usage": bool(args.stream and args.include_usage),
            "prompt_bytes": args.prompt_bytes,
            "request_bytes": len(self.body),
            "expect_status": args.expect_status,
            "requests": done,
            "ok": stats.ok,
            "errors": stats.errors,
            "status_counts": {str(k): v for k, v in sorted(stats.statuses.items())},
            "error_kinds": dict(stats.error_kinds),
            "duration_s": round(elapsed, 3),
            "rps": round(done / elapsed, 2) if elapsed > 0 else 0.0,
            "latency_ms": {
                "p50": percentile(stats.latencies, 50),
                "p90": percentile(stats.latencies, 90),
                "p99": percentile(stats.latencies, 99),
                "mean": round(sum(stats.latencies) / len(stats.latencies), 3) if stats.latencies else None,
                "max": round(max(stats.latencies), 3) if stats.latencies else None,
            },
            "ttfb_ms": {"p50": percentile(stats.ttfbs, 50), "p99": percentile(stats.ttfbs, 99)}
            if args.stream
            else None,
            "bytes_in": stats.bytes_in,
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", required=True, help="full endpoint URL, e.g. http://127.0.0.1:8080/v1/chat/completions"
    )
    parser.add_argument("--concurrency", "-c", type=int, default=16)
    parser.add_argument("--duration", "-d", type=float, default=5.0, help="measured seconds (default 5)")
    parser.add_argument("--requests", "-n", type=int, default=0, help="measure this many requests instead")
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds of discarded warm-up load")
    parser.add_argument("--sync", action="store_true", help="handshake with a driver after the warm-up")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--chunks", type=int, default=20, help="content chunks asked of the bench upstream")
    parser.add_argument("--include-usage", action="store_true", help="send stream_options.include_usage")
    parser.add_argument("--prompt-bytes", type=int, default=64)
    parser.add_argument("--prompt-style", choices=("words", "english"), default="words")
    parser.add_argument(
        "--unique-prompts", action="store_true", help="a different prompt on every call (same size)"
    )
    parser.add_argument("--rate", type=float, default=0.0, help="pace to R requests/s (0: closed loop)")
    parser.add_argument("--max-tokens", type=int, default=0, help="send max_tokens (0: omit)")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--key", default="sk-bench")
    parser.add_argument("--run-id-prefix", default="", help="send X-Run-Id: PREFIX-<client index>")
    parser.add_argument("--expect-status", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request total timeout (s)")
    # --duration is a bound of its own: it is not cut to this (run.py --duration 300 ran 120 s).
    parser.add_argument("--max-seconds", type=float, default=120.0, help="bound for --requests mode")
    args = parser.parse_args(argv)
    host = urlsplit(args.url).hostname or ""
    if host not in LOOPBACK:
        parser.error("the load generator only targets loopback addresses")
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(LoadGen(args).run())
    sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
