"""Memory a piece of the proxy holds, measured with tracemalloc in-process: upstreams write
prebuilt bytes and clients drop what they read, so what is traced is, up to small buffers, what
the proxy holds."""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

MB = 1024 * 1024
_T = TypeVar("_T")


def split(raw: bytes, size: int = 64 * 1024) -> list[bytes]:
    """As a provider's server writes a large body: in pieces (each a read of the relay's)."""
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def held_after(run: Callable[[], _T]) -> tuple[_T, int]:
    """``run()``'s result and the traced memory still alive once it returned (what it keeps)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = run()
        gc.collect()
        return result, tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


@contextlib.contextmanager
def _peak_at_entries(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> Iterator[list[int]]:
    """Traces memory while the block runs; the list it yields ends up holding one figure: the
    most alive (above where tracing started) at any entry into ``module.name``."""
    seen: list[int] = []
    original = getattr(module, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if tracemalloc.is_tracing():
            seen.append(tracemalloc.get_traced_memory()[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, hooked)
    gc.collect()
    tracemalloc.start()
    peak: list[int] = []
    try:
        base = tracemalloc.get_traced_memory()[0]
        yield peak
    finally:
        tracemalloc.stop()
    assert seen, f"{name} was never called"
    peak.append(max(seen) - base)


def alive_when_called(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, run: Callable[[], _T]
) -> tuple[_T, int]:
    """``run()``'s result and the most traced memory alive (above where it started) at any entry
    into ``module.name``: what is held at that moment, before that function allocates."""
    with _peak_at_entries(monkeypatch, module, name) as peak:
        result = run()
    return result, peak[0]


async def alive_when_awaited(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, run: Callable[[], Awaitable[_T]]
) -> tuple[_T, int]:
    """``alive_when_called`` for a coroutine: what the proxy holds on a call it serves."""
    with _peak_at_entries(monkeypatch, module, name) as peak:
        result = await run()
    return result, peak[0]
