"""A body announced with ``Expect: 100-continue`` and a ``Content-Length`` past
``limits.max_body_bytes`` is refused before it is sent, as an unknown key is: before this, the
proxy answered ``100 Continue``, had megabytes uploaded, then refused them with 413. RFC 9110
(10.1.1) lets a server answer a final status instead of 100; clients then never send the body.
"""

from __future__ import annotations

import asyncio
import json

from tests.conftest import KEY_A, Proxy
from tests.fake_upstream import FakeUpstream


def announcing(length: int) -> bytes:
    """A chat call's head that waits for 100 Continue before its body of ``length`` bytes."""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def test_a_body_announced_past_the_limit_is_refused_before_it_is_sent(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    limit = proxy.config.limits.max_body_bytes
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(announcing(limit + 1))
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    try:
        assert head.startswith(b"HTTP/1.1 413"), head
        assert b"\r\nconnection: close\r\n" in head.lower(), head
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:]
        )
        error = json.loads(await asyncio.wait_for(reader.readexactly(length), 5))["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "body_too_large"), error
    finally:
        writer.close()
    assert fake.received == []


async def test_a_body_announced_at_the_limit_still_gets_its_100_continue(proxy: Proxy) -> None:
    limit = proxy.config.limits.max_body_bytes
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(announcing(limit))
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 100 Continue"), head


async def test_a_compressed_body_announced_past_the_limit_is_asked_for(proxy: Proxy) -> None:
    # Its limit is on the decoded size, which the length on the wire does not tell.
    limit = proxy.config.limits.max_body_bytes
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = announcing(limit + 1).replace(b"Expect:", b"Content-Encoding: gzip\r\nExpect:")
    writer.write(head)
    await writer.drain()
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 100 Continue"), answer


async def test_an_unknown_caller_announcing_a_body_past_the_limit_is_told_401(proxy: Proxy) -> None:
    # Who is calling is judged first: the answer a stranger gets does not depend on the body.
    limit = proxy.config.limits.max_body_bytes
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(announcing(limit + 1).replace(KEY_A.encode(), b"sk-nobody"))
    await writer.drain()
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer
