"""Memory a piece of the proxy holds, measured with tracemalloc in-process."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

MB = 1024 * 1024
_T = TypeVar("_T")


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


def alive_when_called(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, run: Callable[[], _T]
) -> tuple[_T, int]:
    """``run()``'s result and the most traced memory alive (above where it started) at any entry
    into ``module.name``: what is held at that moment, before that function allocates."""
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
        result = run()
    finally:
        tracemalloc.stop()
    assert seen, f"{name} was never called"
    return result, max(seen) - base
