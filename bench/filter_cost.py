"""CPU per stream of the proxy's event filter alone (``proxy.events.EventFilter``), no network.

``.venv/bin/python bench/filter_cost.py [--root DIR]``

Streams of 20 and 200 content chunks shaped as OpenAI sends them, with and without its
``obfuscation`` padding (a field of random length after ``"usage":null``, on by default), for a
client that did not ask for usage (the proxy cuts it out): read at once (one read, as from a
fast upstream) and one event a read (as from a provider generating as it sends). ``--root``
measures another source tree (a ``git worktree`` of an earlier commit) for a before/after. The
best of 5 repeats; machine noise still moves figures by 10-20%.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import timeit
from pathlib import Path
from typing import Any


def chunk(text: str, pad: str | None) -> bytes:
    obj: dict[str, Any] = {
        "id": "chatcmpl-D0q8CZXN1uEzngZGkU7FuV92lnXWq",
        "object": "chat.completion.chunk",
        "created": 1769092764,
        "model": "gpt-4o-mini-2024-07-18",
        "service_tier": "default",
        "system_fingerprint": "fp_29330a9688",
        "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
        "usage": None,
    }
    if pad is not None:
        obj["obfuscation"] = pad
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    from proxy.dialects import DIALECTS
    from proxy.events import EventFilter
    from proxy.observe import Observation

    rng = random.Random(1)
    alphabet = string.ascii_letters + string.digits
    print("| chunks | OpenAI padding | at once, us/stream | one event a read, us/stream |")
    print("|---:|---|---:|---:|")
    for n in (20, 200):
        for padded in (False, True):
            pads = [
                "".join(rng.choices(alphabet, k=rng.randint(1, 12))) if padded else None for _ in range(n + 1)
            ]
            events = [chunk("", pads[0])] + [chunk(f" word{i}", pads[i + 1]) for i in range(n)]
            burst = b"".join(events)

            def fresh() -> Any:
                return EventFilter(
                    Observation(), dialect=DIALECTS["chat.completions"], choices=1, client_wants_usage=False
                )

            def at_once(burst: bytes = burst) -> None:
                fresh().read(burst, limit=1 << 26)

            def spaced(events: list[bytes] = events) -> None:
                filt = fresh()
                for event in events:
                    filt.read(event, limit=1 << 26)

            number = 2000 if n == 20 else 200
            once = min(timeit.repeat(at_once, number=number, repeat=5)) / number * 1e6
            apart = min(timeit.repeat(spaced, number=number, repeat=5)) / number * 1e6
            print(f"| {n} | {'yes' if padded else 'no'} | {once:.1f} | {apart:.1f} |")


if __name__ == "__main__":
    main()
