"""Read an upstream body in whole runs: everything buffered at once, in one step.

aiohttp's ``StreamReader.readany`` hands out what is buffered one HTTP chunk at a time inside,
and for each chunk (an SSE event, as providers send them) it asks the connection to resume
reading: five Python frames and a parser call per event, the largest per-event cost of a relayed
stream (a tenth of the proxy's CPU on 200-event streams). ``BodyReader.read`` takes every
buffered chunk in one join and asks once. It reaches into the reader's internals, so it is used
only on the aiohttp minor version it was written and tested against, with every internal it
touches present (``FAST``, checked at import); elsewhere ``read`` is ``readany`` itself.
"""

from __future__ import annotations

import aiohttp
from aiohttp import StreamReader

_TESTED_MINOR = "3.14."

# The internals ``BodyReader`` reads and writes; a version of aiohttp without one of them
# falls back to ``readany``.
_INTERNALS = (
    "_buffer",
    "_buffer_offset",
    "_size",
    "_cursor",
    "_http_chunk_splits",
    "_low_water",
    "_low_water_chunks",
    "_protocol",
    "_exception",
    "_eof",
    "_timer",
    "_wait",
)
FAST = aiohttp.__version__.startswith(_TESTED_MINOR) and all(
    name in getattr(StreamReader, "__slots__", ()) or hasattr(StreamReader, name) for name in _INTERNALS
)


class BodyReader:
    """``await read()`` returns what came since the last read (waiting for some when nothing
    did), ``b""`` at the body's end; raises what the connection failed with once what came
    before the failure was read (``readany`` raises it at once, dropping those bytes)."""

    __slots__ = ("_content", "read", "read_nowait")

    def __init__(self, content: StreamReader, *, fast: bool = FAST) -> None:
        self._content = content
        # Only aiohttp's own reader: the body of a 204 (EMPTY_PAYLOAD, a subclass) has none of
        # the internals set.
        fast = fast and type(content) is StreamReader
        self.read = self._read_fast if fast else content.readany
        # What is buffered now, ``b""`` when nothing is.
        self.read_nowait = self._read_nowait_fast if fast else content.read_nowait

    def at_eof(self) -> bool:
        """The body's end came and every byte of it was read."""
        return self._content.at_eof()

    def _read_nowait_fast(self) -> bytes:
        content = self._content
        if content._buffer:
            return self._take()
        if content._exception is not None:
            raise content._exception
        return b""

    async def _read_fast(self) -> bytes:
        content = self._content
        # What came before the connection failed first: an upstream that closed or reset right
        # after its answer's end ([DONE], its usage) while the relay was writing to a slow client
        # has sent it all; raising at once dropped it (a whole answer billed at its reserve).
        while not content._buffer:
            if content._exception is not None:
                raise content._exception
            if content._eof:
                return b""
            await content._wait("readany")
        return self._take()

    def _take(self) -> bytes:
        # As ``_read_nowait(-1)``, with every chunk taken in one join and one resume.
        content = self._content
        content._timer.assert_timeout()
        buffer = content._buffer
        data = buffer[0] if len(buffer) == 1 else b"".join(buffer)
        if content._buffer_offset:
            data = data[content._buffer_offset :]
            content._buffer_offset = 0
        buffer.clear()
        size = len(data)
        content._size -= size
        content._cursor = cursor = content._cursor + size
        splits = content._http_chunk_splits
        if splits and splits[-1] < cursor:
            splits.clear()  # every chunk's end taken: the common case, one step, not one a chunk
        while splits and splits[0] < cursor:
            splits.popleft()
        if content._size < content._low_water and (splits is None or len(splits) < content._low_water_chunks):
            content._protocol.resume_reading()
        return data
