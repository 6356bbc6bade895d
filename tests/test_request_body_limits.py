"""What the proxy does with a request body it will not take whole: one announced with
``Expect: 100-continue`` and a ``Content-Length`` past ``limits.max_body_bytes`` is refused before
it is sent, as an unknown key is (before, the proxy answered ``100 Continue``, had megabytes
uploaded, then refused them with 413; RFC 9110, 10.1.1, lets a server answer a final status
instead); one that does not arrive whole within ``limits.body_timeout_s`` is a 408 that closes
the connection (before, a stalled upload or a chunked body whose framing broke, which aiohttp
never fails the read for, held its handler until the client left).
"""

from __future__ import annotations

import asyncio
import json

from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream


def announcing(length: int) -> bytes:
    """A chat call's head that waits for 100 Continue before its body of ``length`` bytes."""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def first_head(proxy: Proxy, head: bytes) -> bytes:
    """The first answer's head to a request ``head`` that waits for 100 Continue."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()


async def test_a_body_announced_past_the_limit_is_refused_before_it_is_sent(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    answer = await answer_to(proxy, announcing(proxy.config.limits.max_body_bytes + 1))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:300]
    error = error_of(answer)
    assert (error["type"], error["code"]) == ("invalid_request_error", "body_too_large"), error
    assert fake.received == []


async def test_a_body_announced_at_the_limit_still_gets_its_100_continue(proxy: Proxy) -> None:
    head = await first_head(proxy, announcing(proxy.config.limits.max_body_bytes))
    assert head.startswith(b"HTTP/1.1 100 Continue"), head


async def test_a_compressed_body_announced_past_the_limit_is_asked_for(proxy: Proxy) -> None:
    # Its limit is on the decoded size, which the length on the wire does not tell.
    announced = announcing(proxy.config.limits.max_body_bytes + 1)
    head = await first_head(proxy, announced.replace(b"Expect:", b"Content-Encoding: gzip\r\nExpect:"))
    assert head.startswith(b"HTTP/1.1 100 Continue"), head


async def test_an_unknown_caller_announcing_a_body_past_the_limit_is_told_401(proxy: Proxy) -> None:
    # Who is calling is judged first: the answer a stranger gets does not depend on the body.
    announced = announcing(proxy.config.limits.max_body_bytes + 1)
    head = await first_head(proxy, announced.replace(KEY_A.encode(), b"sk-nobody"))
    assert head.startswith(b"HTTP/1.1 401"), head


def chunked_head() -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()


async def answer_to(proxy: Proxy, *parts: bytes, pause_s: float = 0.0) -> bytes:
    """The answer's head and body (by its ``Content-Length``) for ``parts`` sent in turn. Not
    read to the connection's end: aiohttp lingers, reading what may still come of an unread
    body for up to 10 s before it closes."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        return head + await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


def error_of(answer: bytes) -> dict[str, object]:
    _head, _, body = answer.partition(b"\r\n\r\n")
    error: dict[str, object] = json.loads(body)["error"]
    return error


async def test_a_body_that_stalls_is_a_408_that_closes_the_connection(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(limits={"body_timeout_s": 0.3})
    answer = await answer_to(proxy, chunked_head() + b'5\r\n{"mod\r\n')
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:300]
    error = error_of(answer)
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_timeout"), error
    assert error["message"] == "The request body did not arrive whole within 0.3 s."
    assert fake.received == []


async def test_a_chunked_body_whose_framing_breaks_is_answered_not_held(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # aiohttp queues the parser's error behind the request being read, whose body never ends.
    proxy = await make_proxy(limits={"body_timeout_s": 0.5})
    answer = await answer_to(proxy, chunked_head() + b'5\r\n{"mod\r\n', b"zz\r\nabc\r\n", pause_s=0.1)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert fake.received == []


async def test_a_body_sent_in_parts_within_the_timeout_is_served(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(limits={"body_timeout_s": 5})
    body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    answer = await answer_to(proxy, head + body[:10], body[10:], pause_s=0.1)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert len(fake.received) == 1
