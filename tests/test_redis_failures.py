"""Which replies of a real Redis say "not now" (the call may be tried again, a settle journaled
and replayed) and which say "never", as redis-py raises them and as the proxy's own client
(``resp``) does. ``refused`` is asked of redis-py's only (the checks of the server's config)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.redis_failures import never_sent, refused, transient
from proxy.redis_server import RedisServerProcess
from proxy.resp import PipelinedConnection, RespError

Send = Callable[..., Awaitable[Any]]


@pytest.fixture(params=["redis-py", "resp"])
async def send(request: pytest.FixtureRequest, redis_server: RedisServerProcess) -> AsyncIterator[Send]:
    if request.param == "redis-py":
        client = aioredis.Redis.from_url(redis_server.url)
        yield client.execute_command
        await client.aclose()
    else:
        pipe = PipelinedConnection(redis_server.url, timeout_s=5)
        yield pipe.call
        await pipe.close()


async def reply_error(send: Send, *command: Any) -> ResponseError | RespError:
    with pytest.raises((ResponseError, RespError)) as caught:
        await send(*command)
    assert isinstance(caught.value, ResponseError | RespError)
    return caught.value


async def test_out_of_memory_is_not_now(send: Send, redis_client: aioredis.Redis) -> None:
    await redis_client.config_set("maxmemory-policy", "noeviction")
    await redis_client.config_set("maxmemory", 1)
    try:
        err = await reply_error(send, "EVAL", "return redis.call('SET', KEYS[1], 'x')", 1, "k")
    finally:
        await redis_client.config_set("maxmemory", 0)
    assert transient(err)
    assert not isinstance(err, ResponseError) or not refused(err)


async def test_a_script_refusing_its_input_is_never(send: Send) -> None:
    err = await reply_error(send, "EVAL", "return redis.error_reply('ERR amounts must be integers')", 0)
    assert not transient(err)
    assert not isinstance(err, ResponseError) or refused(err)


async def test_a_command_this_user_may_not_run_is_never_though_auth_trouble_passes(
    send: Send, redis_client: aioredis.Redis, redis_server: RedisServerProcess
) -> None:
    """NOPERM is among the replies that may pass (an ACL fixed by the operator): a settle is
    journaled and replayed for it; a check of the server that meets it stops asking."""
    await redis_client.execute_command("ACL", "SETUSER", "default", "-config")
    try:
        err = await reply_error(send, "CONFIG", "GET", "maxmemory-policy")
    finally:
        await redis_client.execute_command("ACL", "SETUSER", "default", "+@all")
    assert transient(err)
    assert not isinstance(err, ResponseError) or refused(err)


async def test_an_unknown_command_is_never(send: Send) -> None:
    err = await reply_error(send, "NOSUCHCOMMAND")
    assert not transient(err)
    assert not isinstance(err, ResponseError) or refused(err)


def test_a_wait_for_a_free_connection_that_ran_out_never_sent_its_command() -> None:
    """A command whose connection was refused, or that found none free in time (the blocking
    pool's wait, the cluster's), never went out: a reserve failing so is not taken for one
    whose reply was lost (released through the journal). A timeout or a reset may have sent it."""
    assert never_sent(MaxConnectionsError())  # the cluster client's, and ``QueuedCluster``'s
    assert never_sent(RedisConnectionError("No connection available."))  # the blocking pool's
    assert never_sent(RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."))
    assert not never_sent(RedisTimeoutError("Timeout reading from socket"))
    assert not never_sent(RedisConnectionError("Connection reset by peer"))
