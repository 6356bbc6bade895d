"""What the proxy does with a request body it will not take whole: one announced with
``Expect: 100-continue`` and a ``Content-Length`` past ``limits.max_body_bytes`` is refused before
it is sent, as an unknown key is (before, the proxy answered ``100 Continue``, had megabytes
uploaded, then refused them with 413; RFC 9110, 10.1.1, lets a server answer a final status
instead); one that does not arrive whole within ``limits.body_timeout_s`` is a 408 that closes
the connection (before, a stalled upload or a chunked body whose framing broke, which aiohttp
never fails the read for, held its handler until the client left). A compressed body refused
before it is read whole is not decoded after its answer (before, aiohttp's read of an unread body's
rest, its lingering, decoded a few KiB of Brotli to GiBs in one run, the worker's loop frozen).
Every answer to a request whose body came chunked closes its connection (before, aiohttp's C parser
filed the body's last trailer field among the next request's headers: its key paid for the next
call, or refused it as a second key; its ``X-Run-Id`` picked the next call's run).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable
from typing import TypeVar

import brotli
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, KEY_B, Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import CHAT, assert_refused, send

T = TypeVar("T")


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


@functools.cache
def brotli_bomb() -> bytes:
    """A chat body of 1 GiB of 'a' in its content, Brotli-compressed to under 1 KiB (made once:
    0.8 s). Decoding it whole takes 1.5-2 s."""
    compressor = brotli.Compressor(quality=3, lgwin=24)
    block = b"a" * (16 * 1024 * 1024)
    parts = [compressor.process(b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"')]
    parts += [compressor.process(block) for _ in range(64)]
    parts += [compressor.process(b'"}]}'), compressor.finish()]
    return b"".join(parts)


async def longest_stall(answer: Awaitable[T]) -> tuple[T, float]:
    """``answer``'s result and the longest the event loop (the proxy's: it is the test's) went
    without running a 5 ms ticker, while it came and for 0.5 s after (aiohttp lingers after it)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            gaps.append(time.perf_counter() - last)
            last += gaps[-1]

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    result = await answer
    await asyncio.sleep(0.5)
    done.set()
    await ticker
    return result, max(gaps)


# Decoding the bomb whole stalls the loop 1.5 s and more; a loaded machine (CI beside other work)
# has stalled it 0.7 s without decoding anything.
DECODED_STALL_S = 1.0


@pytest.mark.parametrize(
    ("path", "key", "status"),
    [
        (CHAT, "sk-proxy-nobody", 401),  # refused before its body is read: no key needed
        ("/v1/nothing-here", KEY_A, 404),  # the router's own
        (CHAT, KEY_A, 413),  # read up to the limit, refused
    ],
    ids=["unauthenticated-401", "unknown-path-404", "past-the-limit-413"],
)
async def test_a_compressed_body_refused_unread_is_not_decoded_after_its_answer(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis, path: str, key: str, status: int
) -> None:
    body = brotli_bomb()
    headers = {"Content-Encoding": "br", "Authorization": f"Bearer {key}"}
    reply, stall = await longest_stall(
        send(proxy, lambda: fake.received, redis_client, path, body, headers=headers)
    )
    assert_refused(reply, status)  # the answer arrives whole before the connection ends
    assert stall < DECODED_STALL_S, f"the event loop froze {stall:.2f} s for one {len(body)}-byte request"
    assert reply.headers.get("Connection", "").lower() == "close", reply.describe()


async def test_a_compressed_body_sent_despite_its_refused_expectation_is_not_decoded(proxy: Proxy) -> None:
    # The expectation's refusal is answered before any middleware; a client may send its body
    # without waiting for 100 Continue.
    body = brotli_bomb()
    head = announcing(len(body)).replace(KEY_A.encode(), b"sk-nobody")
    head = head.replace(b"Expect:", b"Content-Encoding: br\r\nExpect:")
    answer, stall = await longest_stall(answer_to(proxy, head + body))
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:300]
    assert stall < DECODED_STALL_S, f"the event loop froze {stall:.2f} s for one {len(body)}-byte request"


# -- a chunked body's trailer and the connection's next request ----------------------------------


Call = tuple[bytes, bytes]


def chat(*, key: str | None = KEY_A, run: str | None = None, stream: bool = False, path: str = CHAT) -> Call:
    """A chat call's head, short of its framing and its end, and its body."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {key}\r\n" if key is not None else ""
    head += f"X-Run-Id: {run}\r\n" if run is not None else ""
    return head.encode(), json.dumps({**body, "stream": stream}).encode()


def framed(call: Call, *, chunked: bool = False, trailer: str = "") -> bytes:
    """``call`` framed by its length, or in 7-byte chunks ending in ``trailer``."""
    head, body = call
    if not chunked:
        return head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    pieces = [body[at : at + 7] for at in range(0, len(body), 7)]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + f"0\r\n{trailer}\r\n".encode()


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """An answer's head (lowercased) and body, read by its length or chunked framing."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).lower()
    lengths = [int(line[15:]) for line in head.split(b"\r\n") if line.startswith(b"content-length:")]
    if lengths:
        return head, await asyncio.wait_for(reader.readexactly(lengths[0]), 10)
    body = b""
    while size := int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).split(b";")[0], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return head, body


async def answers_in_turn(proxy: Proxy, first: bytes, second: bytes) -> tuple[bytes, bytes]:
    """The answers' heads to ``first`` then ``second``, sent once the first is answered: on the
    same connection, or on a new one when the first answer closed it (as a client does)."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(first)
        first_head, _ = await read_answer(reader)
        if b"\r\nconnection: close\r\n" in first_head:
            writer.close()
            reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(second)
        second_head, _ = await read_answer(reader)
        return first_head, second_head
    finally:
        writer.close()


async def test_a_trailer_of_one_request_does_not_authenticate_the_next_one(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """aiohttp's C parser added a chunked body's last trailer field to the next request's headers
    on the connection: a call with no key at all was served and billed under the key the trailer
    named (another tenant's). Through a gateway pooling its clients' calls on kept-alive
    connections, one client's trailer picks who pays for the next client's call."""
    first = framed(chat(), chunked=True, trailer=f"Authorization: Bearer {KEY_B}\r\n")
    first_head, second_head = await answers_in_turn(proxy, first, framed(chat(key=None)))
    assert first_head.startswith(b"http/1.1 200"), first_head
    assert second_head.startswith(b"http/1.1 401"), second_head
    await proxy.recorded()
    assert await redis_client.xrange("lbp:{team-b}:ledger") == []
    assert len(fake.received) == 1


async def test_a_trailer_of_one_request_does_not_make_the_next_one_refused(proxy: Proxy) -> None:
    """Its own key and the trailer's were read as two keys: a good call refused."""
    first = framed(chat(), chunked=True, trailer=f"Authorization: Bearer {KEY_B}\r\n")
    _, second_head = await answers_in_turn(proxy, first, framed(chat()))
    assert second_head.startswith(b"http/1.1 200"), second_head


async def test_a_trailer_of_one_request_does_not_pick_the_next_calls_run(proxy: Proxy) -> None:
    """A call sent without X-Run-Id is a run of its own; the trailer put it in the run it named."""
    first = framed(chat(run="first"), chunked=True, trailer="X-Run-Id: smuggled\r\n")
    _, second_head = await answers_in_turn(proxy, first, framed(chat()))
    assert second_head.startswith(b"http/1.1 200"), second_head
    assert b"\r\nx-billing-run-id: smuggled\r\n" not in second_head, second_head


async def test_a_request_pipelined_behind_a_chunked_one_is_not_answered(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """Sent before the first is answered, the next request is parsed with the trailer already:
    the connection ends after the first answer, the next one unanswered (the client sends it
    again on a new connection)."""
    first = framed(chat(), chunked=True, trailer=f"Authorization: Bearer {KEY_B}\r\n")
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(first + framed(chat(key=None)))
        head, _ = await read_answer(reader)
        rest = await asyncio.wait_for(reader.read(300), 10)  # b"": the connection's end
    finally:
        writer.close()
    assert head.startswith(b"http/1.1 200"), head
    assert rest == b"", rest[:300]
    assert len(fake.received) == 1


@pytest.mark.parametrize(
    ("call", "status"),
    [
        (chat(), 200),
        (chat(stream=True), 200),
        (chat(key="sk-proxy-nobody"), 401),
        (chat(path="/v1/nothing"), 404),
    ],
    ids=["answer", "stream", "refusal", "router-404"],
)
async def test_every_answer_to_a_chunked_body_closes_its_connection(
    proxy: Proxy, call: Call, status: int
) -> None:
    chunked_head, length_head = await answers_in_turn(proxy, framed(call, chunked=True), framed(call))
    assert chunked_head.startswith(b"http/1.1 %d" % status), chunked_head
    assert b"\r\nconnection: close\r\n" in chunked_head, chunked_head
    # A body sent with its length (as SDKs send theirs) keeps the connection.
    assert length_head.startswith(b"http/1.1 %d" % status), length_head
    assert b"\r\nconnection: close\r\n" not in length_head, length_head
