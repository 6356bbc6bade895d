"""The pipelined connection of the hot-path scripts, against a real Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import hiredis
import pytest
import redis.asyncio as aioredis

from proxy.redis_server import RedisServerProcess
from proxy.resp import ConnectionLost, PipelinedConnection, RespError, encode, pack
from tests.conftest import KEY_A, ProxyFactory, busy_script, refused_port


async def test_every_kind_of_argument_arrives_as_sent(redis_server: RedisServerProcess) -> None:
    pipe = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        args = (b"\x00raw\r\nbytes", "ünïcödé ✓", -1, 0, 2**62, '{"json": ["x"]}', "")
        got = await pipe.call("EVAL", "return ARGV", 0, *args)
        assert got == ["\x00raw\r\nbytes", "ünïcödé ✓", "-1", "0", str(2**62), '{"json": ["x"]}', ""]
    finally:
        await pipe.close()


def test_a_command_in_parts_packs_byte_for_byte_as_in_one() -> None:
    head = ("EVALSHA", "a" * 40, 3, "k1")
    parts = (pack("k2", b"\x00raw"), (), ("ünï", -1), pack(), pack(0, 2**62, ""), (7,))
    flat = (*head, "k2", b"\x00raw", "ünï", -1, 0, 2**62, "", 7)
    assert encode(head, parts) == hiredis.pack_command(flat)
    assert encode(head) == hiredis.pack_command(head)
    assert pack("a", 1).args == ("a", 1) and pack().resp == b""


async def test_a_command_in_parts_arrives_as_sent(redis_server: RedisServerProcess) -> None:
    pipe = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        got = await pipe.call(
            "EVAL", "return {KEYS[1], ARGV[1], ARGV[2], ARGV[3]}", 1, parts=(pack("k"), ("a",), pack(1, "ü"))
        )
        assert got == ["k", "a", "1", "ü"]
        with pytest.raises(TypeError):
            await pipe.call("ECHO", parts=((True,),))  # hiredis packs no bool: nothing sent
        assert await asyncio.wait_for(pipe.call("ECHO", parts=(pack("b"),)), 3) == "b"
    finally:
        await pipe.close()


async def test_replies_reach_their_callers_in_order(redis_server: RedisServerProcess) -> None:
    pipe = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        replies = await asyncio.gather(*(pipe.call("EVAL", "return ARGV[1]", 0, i) for i in range(500)))
        assert replies == [str(i) for i in range(500)]
        with pytest.raises(RespError):
            await pipe.call("EVAL", "return redis.error_reply('ERR nope')", 0)
        assert await pipe.call("EVAL", "return 7", 0) == 7  # an error reply leaves the stream in step
    finally:
        await pipe.close()


class _CountingTransport:
    """The connection's transport, its writes noted (uvloop's transports take no new attributes)."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def test_commands_wait_for_a_reply_and_leave_together(redis_server: RedisServerProcess) -> None:
    """While a command is in flight, later ones queue up and go out in one write when a reply
    comes, instead of one send each."""
    pipe = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        assert await pipe.call("EVAL", "return 1", 0) == 1
        protocol = pipe._protocol
        assert protocol is not None and protocol.transport is not None
        writes: list[bytes] = []
        protocol.transport = _CountingTransport(protocol.transport, writes)  # type: ignore[assignment]
        # 2 s, measured: a loop of so many steps ran for as long as the machine gave it, and a
        # stall of the test's process past its end sent the rest one by one.
        slow = asyncio.ensure_future(pipe.call("EVAL", busy_script(2), 0))
        calls = []
        for i in range(100):  # one command per turn of the event loop, all while the slow one runs
            calls.append(asyncio.ensure_future(pipe.call("EVAL", "return ARGV[1]", 0, i)))
            await asyncio.sleep(0)
        assert await slow == 1
        assert await asyncio.gather(*calls) == [str(i) for i in range(100)]
        assert len(writes) <= 3, len(writes)
    finally:
        await pipe.close()


async def test_a_command_that_cannot_be_packed_leaves_the_replies_in_step(
    redis_server: RedisServerProcess,
) -> None:
    pipe = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        assert await pipe.call("ECHO", "warm") == "warm"
        with pytest.raises(TypeError):
            await pipe.call("ECHO", True)  # hiredis packs no bool
        replies = await asyncio.wait_for(asyncio.gather(pipe.call("ECHO", "a"), pipe.call("ECHO", "b")), 3)
        assert replies == ["a", "b"]
    finally:
        await pipe.close()


async def test_a_refused_auth_closes_its_connection(redis_server: RedisServerProcess) -> None:
    # This server has no password: AUTH is refused, and every retry must not leave a socket.
    pipe = PipelinedConnection(redis_server.url.replace("redis://", "redis://:wrong@"), timeout_s=5)
    check = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        before = len((await check.call("CLIENT", "LIST")).splitlines())
        for _ in range(5):
            with pytest.raises(RespError):
                await pipe.call("PING")
        after = 0
        for _ in range(100):  # until the server has seen the closes (not within 0.1 s when loaded)
            after = len((await check.call("CLIENT", "LIST")).splitlines())
            if after == before:
                break
            await asyncio.sleep(0.05)
        assert after == before
    finally:
        await pipe.close()
        await check.close()


async def test_a_percent_encoded_redis_password_is_sent_as_the_password(
    make_proxy: ProxyFactory, own_redis: RedisServerProcess
) -> None:
    """A password holding '@', '/' or ':' must be percent-encoded in the URL (redis-py, which the
    config check and the pool use, decodes it); the proxy's own pipelined client sent it still
    encoded: AUTH refused, every call a 503 though the store is up and the password right."""
    password = "p@ss/w:rd"
    admin = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        await admin.execute_command("ACL", "SETUSER", "billing", "on", f">{password}", "~*", "&*", "+@all")
    finally:
        await admin.aclose()
    url = f"redis://billing:p%40ss%2Fw%3Ard@127.0.0.1:{own_redis.port}/0"
    proxy = await make_proxy(redis={"url": url})
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp,
    ):
        text = await resp.text()
    assert resp.status == 200, text
    assert json.loads(text)["choices"]


async def test_on_sent_is_told_once_the_command_is_written_not_when_queued(
    redis_server: RedisServerProcess,
) -> None:
    """``on_sent`` says a command is on the wire, ahead of what this process sends later: one
    queued behind a command in flight is written with that command's reply, and only then told."""
    pipe = PipelinedConnection(redis_server.url, timeout_s=5)
    try:
        # Holds Redis 3 s (TIME's seconds alone could end it at once, at a second's end): the
        # checks below take 0.3 s, with room for a loaded machine's stalls.
        hold = (
            "local function now() local t = redis.call('TIME') return t[1] * 1e6 + t[2] end "
            "local t0 = now() while now() - t0 < 3e6 do end"
        )
        slow = asyncio.ensure_future(pipe.call("EVAL", hold, 0))
        await asyncio.sleep(0.1)  # written, and Redis runs it
        told: list[bool] = []
        ping: asyncio.Future[Any] = asyncio.ensure_future(
            pipe.call("PING", on_sent=lambda: told.append(ping.done()))
        )
        await asyncio.sleep(0.2)
        assert told == []  # queued behind the script in flight, not written yet
        assert await ping == "PONG"
        assert slow.done()
        assert told == [False]  # written once the script's reply came, before its own reply
    finally:
        await pipe.close()


async def test_on_sent_is_not_told_of_a_command_never_written() -> None:
    pipe = PipelinedConnection(f"redis://127.0.0.1:{refused_port()}/0", timeout_s=1)
    told: list[str] = []
    try:
        with pytest.raises(ConnectionLost) as refused:
            await pipe.call("PING", on_sent=lambda: told.append("sent"))
        assert not refused.value.sent
        assert told == []
    finally:
        await pipe.close()


async def test_on_sent_waits_for_a_script_the_connection_has_not_run(
    own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """A new connection's server may have lost its scripts (restarted, failed over): an EVALSHA
    refused there (NOSCRIPT) is sent again behind what was written meanwhile, so it is not told
    sent; once the connection has run the script it is."""
    sha = await own_client.script_load("return 7")
    pipe = PipelinedConnection(own_redis.url, timeout_s=5)
    told: list[int] = []
    try:
        assert await pipe.call("EVALSHA", sha, 0, on_sent=lambda: told.append(1)) == 7
        assert told == []
        assert await pipe.call("EVALSHA", sha, 0, on_sent=lambda: told.append(2)) == 7
        assert told == [2]
        await own_client.script_flush()
        with pytest.raises(RespError, match="NOSCRIPT"):
            await pipe.call("EVALSHA", sha, 0, on_sent=lambda: told.append(3))
        await own_client.script_load("return 7")
        assert await pipe.call("EVALSHA", sha, 0, on_sent=lambda: told.append(4)) == 7
        assert told == [2, 3]  # flushed on a live connection: told once, then not until it ran
    finally:
        await pipe.close()


async def test_a_socket_path_with_escapes_is_read_as_redis_py_reads_it(tmp_path: Path) -> None:
    """The embedded server's URL held its socket path as it is; redis-py (the billing views, the
    reaper's reads) decodes a path's percent-escapes, and this client did not: a data directory
    named with a '%41' (or a '?') had the two clients look for two different sockets."""
    server = RedisServerProcess(tmp_path / "odd %41 ?dir", appendonly=False)
    assert "%41 ?" in str(server.socket_path)
    await asyncio.to_thread(server.start)
    pipe = PipelinedConnection(server.url, timeout_s=2.0)
    client = aioredis.from_url(server.url, decode_responses=True)
    try:
        await pipe.call("SET", "k", "v")
        assert await client.get("k") == "v"
    finally:
        await pipe.close()
        await client.aclose()
        await asyncio.to_thread(server.stop)


async def test_a_readonly_reply_has_the_next_call_connect_again(tmp_path: Path) -> None:
    """A failover that does not close connections (behind a DNS name) leaves the connection on a
    replica: every write refused READONLY until it dropped, which nothing made it do. After a
    READONLY reply the next call connects again, to whatever the address names by then."""
    server = RedisServerProcess(tmp_path / "r", appendonly=False)
    await asyncio.to_thread(server.start)
    pipe = PipelinedConnection(server.url, timeout_s=2.0)
    admin = aioredis.from_url(server.url, decode_responses=True)
    try:
        first = await pipe.call("CLIENT", "ID")
        await admin.execute_command("REPLICAOF", "127.0.0.1", str(refused_port()))  # a master never there
        with pytest.raises(RespError, match="READONLY"):
            await pipe.call("SET", "k", "v")
        await admin.execute_command("REPLICAOF", "NO", "ONE")  # the address names a master again
        assert await pipe.call("SET", "k", "v") == "OK"
        assert await pipe.call("CLIENT", "ID") != first  # was: the same connection, kept
    finally:
        await pipe.close()
        await admin.aclose()
        await asyncio.to_thread(server.stop)
