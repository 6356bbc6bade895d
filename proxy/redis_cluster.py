"""redis-py's Redis Cluster client, made to queue a burst of commands rather than fail it.

A node's connection pool in redis-py's cluster client does not wait: a command that finds every
connection to its node busy fails at once (``MaxConnectionsError``). A tenant's keys share one
slot, so one node: a burst of more of its calls than ``redis.pool_size`` was refused (503), and
each refused reserve taken for one whose reply was lost. Here every command first takes one of
``pool_size`` permits, waiting for one up to the socket timeout, as the single-node client's
blocking pool makes a burst wait.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import MaxConnectionsError

# Connections to a node beyond the permits: for the billing views' pipelines, which take theirs
# straight from the nodes' pools.
PIPELINE_CONNECTIONS = 8


class QueuedCluster(RedisCluster):
    """At most ``pool_size`` commands at once, the others waiting their turn (FIFO)."""

    _permits: asyncio.Semaphore
    _wait_s: float

    @classmethod
    def queued_from_url(cls, url: str, *, pool_size: int, socket_timeout_s: float) -> QueuedCluster:
        client = cast(
            QueuedCluster,
            cls.from_url(
                url,
                decode_responses=True,
                max_connections=pool_size + PIPELINE_CONNECTIONS,
                socket_timeout=socket_timeout_s,
            ),
        )
        client._permits = asyncio.Semaphore(pool_size)
        client._wait_s = socket_timeout_s
        return client

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self._wait_s):
                await self._permits.acquire()
        except TimeoutError:
            # Never sent: the store's callers read this error as a command that did not go out.
            raise MaxConnectionsError(f"no connection to the cluster free within {self._wait_s} s") from None
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self._permits.release()
