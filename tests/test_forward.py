"""The stall guard of streams: only the upstream's silence while the relay waits counts."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

import aiohttp

from proxy.forward import StallGuard


class Content:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def set_exception(self, exc: BaseException) -> None:
        self.errors.append(exc)


def response() -> Any:
    return SimpleNamespace(connection=None, content=Content())


async def test_a_wait_longer_than_the_timeout_fails_the_read() -> None:
    upstream = response()
    guard = StallGuard(cast(aiohttp.ClientResponse, upstream), 0.2)
    guard.waiting_since = time.monotonic()
    await asyncio.sleep(0.35)
    (error,) = upstream.content.errors
    assert isinstance(error, TimeoutError)
    guard.cancel()


async def test_time_spent_elsewhere_does_not_count() -> None:
    upstream = response()
    guard = StallGuard(cast(aiohttp.ClientResponse, upstream), 0.2)
    await asyncio.sleep(0.3)  # not waiting on the upstream (writing to the client, say)
    for _ in range(4):  # short waits, each well under the timeout
        guard.waiting_since = time.monotonic()
        await asyncio.sleep(0.1)
        guard.waiting_since = None
    assert upstream.content.errors == []
    guard.waiting_since = time.monotonic()
    await asyncio.sleep(0.45)
    assert len(upstream.content.errors) == 1
    guard.cancel()
