"""Tell the Redis store's failures apart: which errors are the store failing (never our own
code), and which replies say "not now" (the call may be tried again) rather than "never".
"""

from __future__ import annotations

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterError,
    MasterDownError,
    MaxConnectionsError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from proxy.resp import RespError

# What a store call can raise: redis-py's errors, the cluster client's own (not a RedisError),
# and what redis-py's asyncio connection leaks when the socket under it is torn down mid-write
# (a Cluster's failover, a peer's reset): AttributeError or TypeError on a transport gone None
# (redis/redis-py#4287, 8.1). Each ``try`` in the store that catches them wraps only the
# client's call, so these are the store failing, never our own code.
STORE_FAILURES = (RedisError, RedisClusterException, AttributeError, TypeError)
# Error replies that say "not now" rather than "never": the call may be tried again (a settle
# refused for them is journaled and replayed, never parked). Out of memory, a failed disk
# write, too few replicas, a replica after a failover and auth or ACL trouble all pass or get
# fixed; what never passes is a script refusing its input.
TRANSIENT_REPLIES = (
    "BUSY",
    "LOADING",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "READONLY",
    "OOM",
    "MISCONF",
    "NOREPLICAS",
    "NOAUTH",
    "WRONGPASS",
    "NOPERM",
    "ERR max number of clients",
)
# The same replies as redis-py raises them: it strips the code off those it has a class for.
TRANSIENT_ERRORS = (
    ClusterError,
    TryAgainError,
    MasterDownError,
    ReadOnlyError,
    OutOfMemoryError,
    NoPermissionError,
)
# Replies redis-py raises as connection errors, though the command never ran.
NOT_RUN_ERRORS = (AuthenticationError, BusyLoadingError)
# What redis-py says of a command it never sent: a connection refused, or no connection free in
# time (its blocking pool's wait, the cluster's; ``redis_cluster``).
_NOT_SENT_MESSAGES = ("connecting to", "Connection refused", "No connection available")
# Set (True) on the error of a command an earlier try of which may have gone out: the cluster
# client retries a try that timed out or lost its connection (``redis_cluster``).
SENT_BEFORE = "lbp_sent_before"


def transient(err: ResponseError | RespError) -> bool:
    return isinstance(err, TRANSIENT_ERRORS) or str(err).startswith(TRANSIENT_REPLIES)


def refused(err: ResponseError) -> bool:
    """A command this server will never run for us (disabled, renamed, not this user's), rather
    than one it cannot run now."""
    return isinstance(err, NoPermissionError) or not transient(err)


def sent_before(err: BaseException) -> bool:
    """An earlier try of the failed command may have gone out (``redis_cluster``): whatever
    this error says of the last try, the command may have run."""
    return bool(getattr(err, SENT_BEFORE, False))


def never_sent(err: Exception) -> bool:
    """A store failure that never carried its command (a timeout or a reset may have), nor did
    any earlier try of it."""
    if sent_before(err):
        return False
    return isinstance(err, MaxConnectionsError) or any(m in str(err) for m in _NOT_SENT_MESSAGES)
