"""redis-py's Redis Cluster client, made to queue a burst of commands rather than fail it.

A node's connection pool in redis-py's cluster client does not wait: a command that finds every
connection to its node busy fails at once (``MaxConnectionsError``). A tenant's keys share one
slot, so one node: a burst of more of its calls than ``redis.pool_size`` was refused (503), and
each refused reserve taken for one whose reply was lost. Here every command first takes one of
``pool_size`` permits, waiting for one up to the socket timeout, as the single-node client's
blocking pool makes a burst wait. The billing views' pipelines take their connections straight
from the pools (8 more per node): at most 8 run at once, the others waiting, since one that
found its node's pool full closed the whole client (redis-py's answer to a ConnectionError),
every call's command in flight with it.

redis-py retries a command whose try timed out or lost its connection, and raises the last
try's error: a retry that found no connection (the master gone, the pool full) would pass for a
command never sent, and a reserve that ran for one never made (not released: billed at its
reserve by a reaper). A try that may have carried the command marks the error raised
(``redis_failures.SENT_BEFORE``).
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any, cast

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.exceptions import MaxConnectionsError, ResponseError

from proxy.redis_failures import NOT_RUN_ERRORS, SENT_BEFORE, never_sent

# The command being run by ``QueuedCluster.execute_command`` in this task: whether one of its
# tries failed in a way that may have carried it (a list, shared with the tasks redis-py starts
# for a command sent to several nodes).
_tries_sent: ContextVar[list[bool] | None] = ContextVar("_tries_sent", default=None)

# Connections to a node beyond the permits: for the billing views' pipelines, which take theirs
# straight from the nodes' pools.
PIPELINE_CONNECTIONS = 8


class QueuedPipeline(ClusterPipeline):
    """A billing view's pipeline: at most ``PIPELINE_CONNECTIONS`` at once, the others waiting
    (one that found its node's pool full would fail MaxConnectionsError, which redis-py retries
    by closing the whole client: every connection, the scripts' in flight too). Its own
    semaphore, not the commands': redis-py sends a pipeline's redirected commands again through
    ``execute_command``, which takes a command permit (none is held here while waiting)."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client = cast(QueuedCluster, self.cluster_client)
        try:
            async with asyncio.timeout(client._wait_s):
                await client._pipeline_permits.acquire()
        except TimeoutError:
            await self.reset()  # type: ignore[no-untyped-call]
            wait_s = client._wait_s
            raise MaxConnectionsError(f"no connection to the cluster free within {wait_s} s") from None
        try:
            return await super().execute(raise_on_error, allow_redirections)
        finally:
            client._pipeline_permits.release()


class QueuedCluster(RedisCluster):
    """At most ``pool_size`` commands at once, the others waiting their turn (FIFO)."""

    _permits: asyncio.Semaphore
    _pipeline_permits: asyncio.Semaphore
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
        client._pipeline_permits = asyncio.Semaphore(PIPELINE_CONNECTIONS)
        client._wait_s = socket_timeout_s
        return client

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused there
        return QueuedPipeline(self, transaction)  # type: ignore[abstract]

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self._wait_s):
                await self._permits.acquire()
        except TimeoutError:
            # Never sent: the store's callers read this error as a command that did not go out.
            raise MaxConnectionsError(f"no connection to the cluster free within {self._wait_s} s") from None
        sent: list[bool] = []
        token = _tries_sent.set(sent)
        try:
            return await super().execute_command(*args, **kwargs)
        except Exception as err:
            # redis-py retries a command whose try timed out or lost its connection: a later
            # try that found no connection (a master gone, a pool full) does not unsend it.
            if sent:
                setattr(err, SENT_BEFORE, True)
            raise
        finally:
            _tries_sent.reset(token)
            self._permits.release()

    async def _execute_command(self, target_node: ClusterNode, *args: Any, **kwargs: Any) -> Any:
        """One try of a command (redis-py follows MOVED, ASK and TRYAGAIN replies within it:
        each says the command did not run)."""
        try:
            return await super()._execute_command(target_node, *args, **kwargs)
        except Exception as err:
            sent = _tries_sent.get()
            # An error reply (NOSCRIPT, LOADING, CLUSTERDOWN, ...) says this try did not run.
            replied = isinstance(err, (ResponseError, *NOT_RUN_ERRORS))
            if sent is not None and not sent and not replied and not never_sent(err):
                sent.append(True)
            raise
