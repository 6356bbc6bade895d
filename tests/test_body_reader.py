"""The upstream body read in whole runs: the same bytes as ``readany``, each run in one read
with one resume of the connection, across flow-control pauses, partial reads and a cut body
(what came before the cut read before its failure, where ``readany`` drops it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.body_reader import FAST, BodyReader

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'


def events(count: int) -> list[bytes]:
    return [EVENT.replace(b"tok", b"t%04d" % i) for i in range(count)]


async def serve(aiohttp_server: Callable[..., object], handler: Callable[..., object]) -> TestServer:
    app = web.Application()
    app.router.add_get("/", handler)  # type: ignore[arg-type]
    server = await aiohttp_server(app)  # type: ignore[operator]
    assert isinstance(server, TestServer)
    return server


def chunked(chunks: list[bytes]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler sending ``chunks``, one HTTP chunk each, then the body's end."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
        return response

    return handler


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def read_all(reader: BodyReader, pause_s: float = 0.0) -> bytes:
    parts = []
    while piece := await reader.read():
        parts.append(piece)
        if pause_s:
            await asyncio.sleep(pause_s)
    return b"".join(parts)


def test_the_fast_path_is_on_for_the_aiohttp_it_was_written_against() -> None:
    # An upgrade that drops it (a new minor, a renamed internal) is correct but slower: this
    # says so rather than letting the profile find it.
    if not aiohttp.__version__.startswith("3.14."):
        pytest.skip(f"aiohttp {aiohttp.__version__}: BodyReader falls back to readany")
    assert FAST


async def test_a_run_of_buffered_events_is_one_read_with_one_resume(
    aiohttp_server: Callable[..., object], session: aiohttp.ClientSession
) -> None:
    sent = events(50)
    finish = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for event in sent:
            await response.write(event)  # one HTTP chunk each, as a provider's stream
        await finish.wait()
        await response.write_eof()
        return response

    server = await serve(aiohttp_server, handler)
    async with session.get(server.make_url("/")) as upstream:
        content = upstream.content
        async with asyncio.timeout(5):
            while content.total_bytes < len(b"".join(sent)):
                await asyncio.sleep(0.01)
        assert upstream.connection is not None
        protocol = upstream.connection.protocol
        assert protocol is not None
        resumes = []
        resume = protocol.resume_reading
        protocol.resume_reading = lambda *a, **k: (resumes.append(1), resume(*a, **k))[1]  # type: ignore[method-assign]
        reader = BodyReader(content)
        assert await reader.read() == b"".join(sent)
        assert len(resumes) <= 1  # readany: one per event
        finish.set()
        assert await reader.read() == b""


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readany"])
async def test_a_body_past_the_flow_control_marks_comes_whole(
    aiohttp_server: Callable[..., object], session: aiohttp.ClientSession, fast: bool
) -> None:
    # 2 MiB in 1 KiB chunks against a reader that lags: reading pauses and must resume.
    sent = [bytes([65 + i % 26]) * 1024 for i in range(2048)]

    server = await serve(aiohttp_server, chunked(sent))
    async with session.get(server.make_url("/"), read_bufsize=16 * 1024) as upstream:
        async with asyncio.timeout(20):
            got = await read_all(BodyReader(upstream.content, fast=fast), pause_s=0.001)
    assert got == b"".join(sent)


async def test_a_partial_read_before_leaves_the_rest_from_its_offset(
    aiohttp_server: Callable[..., object], session: aiohttp.ClientSession
) -> None:
    sent = events(5)

    server = await serve(aiohttp_server, chunked(sent))
    async with session.get(server.make_url("/")) as upstream:
        head = await upstream.content.read(7)  # leaves an offset into the first chunk
        reader = BodyReader(upstream.content)
        rest = reader.read_nowait() + await read_all(reader)
    assert head + rest == b"".join(sent)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readany"])
async def test_a_body_cut_short_fails_the_read_as_readany_does(
    aiohttp_server: Callable[..., object], session: aiohttp.ClientSession, fast: bool
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(EVENT)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # no terminating chunk
        return response

    server = await serve(aiohttp_server, handler)
    async with session.get(server.make_url("/")) as upstream:
        reader = BodyReader(upstream.content, fast=fast)
        got = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with asyncio.timeout(5):
                while piece := await reader.read():
                    got += piece
    assert got == EVENT


@pytest.mark.parametrize("first_read", ["read", "read_nowait"])
async def test_what_came_before_the_connection_failed_is_read_before_its_failure(
    aiohttp_server: Callable[..., object], session: aiohttp.ClientSession, first_read: str
) -> None:
    # Read only once the cut is known (the relay busy writing to a slow client meanwhile):
    # readany raises it at once, and the answer's end that came before it ([DONE], the usage)
    # is lost.
    sent = events(3)

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"".join(sent))
        assert request.transport is not None
        request.transport.close()  # no terminating chunk
        return response

    server = await serve(aiohttp_server, handler)
    async with session.get(server.make_url("/")) as upstream:
        async with asyncio.timeout(5):
            while upstream.content.exception() is None:
                await asyncio.sleep(0.01)
        reader = BodyReader(upstream.content)
        got = reader.read_nowait() if first_read == "read_nowait" else await reader.read()
        assert got == b"".join(sent)
        with pytest.raises(aiohttp.ClientPayloadError):
            await reader.read()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readany"])
async def test_the_body_of_a_204_is_read_as_empty(fast: bool) -> None:
    # aiohttp's EMPTY_PAYLOAD (a 204's body, whatever its content type) has none of the internals
    # set: a stream relay of one failed on an AttributeError, logged as the proxy's own fault.
    reader = BodyReader(aiohttp.EMPTY_PAYLOAD, fast=fast)
    assert reader.read_nowait() == b""
    assert await reader.read() == b""
    assert reader.at_eof()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readany"])
async def test_at_eof_once_the_end_came_and_every_byte_was_read(
    aiohttp_server: Callable[..., object], session: aiohttp.ClientSession, fast: bool
) -> None:
    # The stream relay skips its drain's timer when the body's end came with the answer's.
    server = await serve(aiohttp_server, chunked(events(3)))
    async with session.get(server.make_url("/")) as response:
        reader = BodyReader(response.content, fast=fast)
        await asyncio.sleep(0.05)  # the whole body, its end with it, buffered
        assert not reader.at_eof()  # bytes still buffered
        assert reader.read_nowait() == b"".join(events(3))
        assert reader.at_eof()
