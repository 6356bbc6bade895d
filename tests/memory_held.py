"""Memory the proxy holds on a call, measured in-process with tracemalloc: the upstream writes
prebuilt bytes and the client drops what it reads, so what is traced is, up to small buffers,
what the proxy holds."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

MB = 1024 * 1024
T = TypeVar("T")


def split(raw: bytes, size: int = 64 * 1024) -> list[bytes]:
    """As a provider's server writes a large body: in pieces (each a read of the relay's)."""
    return [raw[i : i + size] for i in range(0, len(raw), size)]


async def alive_when_called(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, run: Callable[[], Awaitable[T]]
) -> tuple[T, int]:
    """``run()``'s result and the most traced memory alive (above where it started) at any
    entry into ``module.name``: what the proxy holds at that moment, before that function
    allocates."""
    seen: list[int] = []
    original = getattr(module, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if tracemalloc.is_tracing():
            seen.append(tracemalloc.get_traced_memory()[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, hooked)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = await run()
    finally:
        tracemalloc.stop()
    assert seen, f"{name} was never called"
    return result, max(seen) - base
