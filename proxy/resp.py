"""One pipelined connection to a single Redis server for the hot-path scripts.

redis-py takes a pooled connection, a retry wrapper and two timeout scopes per command: about
45 us of CPU. Redis answers each connection's commands in order, so concurrent calls can share
one connection: each writes its command and waits for its turn in a FIFO of futures. Replies
are parsed by hiredis. Anything but EVALSHA/EVAL stays on redis-py.

Failure semantics match what the store promises: a connection lost while commands wait fails
them as "maybe applied" (they may have run); a refused connection fails them as "not sent".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlparse

import hiredis


class RespError(Exception):
    """A reply that is an error (``-ERR ...``)."""


class ConnectionLost(Exception):
    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


# hiredis packs a command in C: a third of the CPU of doing it here, byte for byte the same.
_encode = hiredis.pack_command


@dataclass(frozen=True, slots=True)
class Packed:
    """Arguments packed once for commands that send them again and again (a budget scope's key
    and ceilings: most of a reserve's arguments, and packing arguments was most of what this
    client spent): their RESP bulk strings, and the arguments themselves (how many; and for a
    client that packs its own, redis-py)."""

    resp: bytes
    args: tuple[Any, ...]


def _bulk_strings(args: Sequence[Any]) -> bytes:
    command: bytes = _encode(tuple(args))
    return command[command.index(b"\n") + 1 :]  # without its "*<count>" line


def pack(*args: Any) -> Packed:
    return Packed(_bulk_strings(args), args)


def encode(args: tuple[Any, ...], parts: Sequence[tuple[Any, ...] | Packed] = ()) -> bytes:
    """A command: ``args``, then each part's arguments in turn."""
    if not parts:
        return cast(bytes, _encode(args))
    count = 0
    pieces = [b""]
    # Arguments not packed yet are packed together up to the next packed part: each packing is
    # a call into hiredis whose own cost is several arguments' (an EVALSHA's name, SHA and key
    # count go with the keys after them).
    loose: list[Any] = list(args)
    for part in parts:
        if isinstance(part, Packed):
            if loose:
                pieces.append(_bulk_strings(loose))
                count += len(loose)
                loose = []
            pieces.append(part.resp)
            count += len(part.args)
        else:
            loose += part
    if loose:
        pieces.append(_bulk_strings(loose))
        count += len(loose)
    pieces[0] = b"*%d\r\n" % count
    return b"".join(pieces)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=RespError, encoding="utf-8")
        self.waiters: deque[asyncio.Future[Any]] = deque()
        # When each waiting command was sent, oldest first (the same order as ``waiters``).
        self.sent_at: deque[float] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # Commands issued in one turn of the event loop leave in one write.
        self.outgoing: list[bytes] = []
        self.in_flight = 0  # written, reply not yet read
        # Told once their command is written (``PipelinedConnection.call``'s ``on_sent``).
        self.on_written: list[Callable[[], None]] = []
        # The scripts an EVALSHA on this connection has run: a new connection's server may have
        # none (restarted, failed over), and their EVALSHA is refused (NOSCRIPT).
        self.scripts_run: set[str] = set()

    def queue(self, command: bytes, on_sent: Callable[[], None] | None = None) -> None:
        # Commands wait while earlier ones are in flight and leave together when a reply comes
        # (a send to Redis costs more CPU than the command): never more than one reply away.
        if not self.outgoing and not self.in_flight:
            asyncio.get_running_loop().call_soon(self.flush)
        self.outgoing.append(command)
        if on_sent is not None:
            self.on_written.append(on_sent)

    def flush(self) -> None:
        written = False
        if self.outgoing and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.outgoing))
            self.in_flight += len(self.outgoing)
            written = True
        self.outgoing.clear()
        if self.on_written:
            told, self.on_written = self.on_written, []
            if written:  # else their commands fail, and their callers hear it so
                for on_sent in told:
                    on_sent()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an ``asyncio.Transport`` subclass (uvloop's).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            reply = self.reader.gets()
            if reply is False:
                if self.outgoing:
                    self.flush()
                return
            self.in_flight -= 1
            if not self.waiters:  # an answer nobody asked for: the stream is out of step
                self._fail(ConnectionLost("unexpected reply from Redis", sent=True))
                return
            waiter = self.waiters.popleft()
            self.sent_at.popleft()
            if waiter.done():
                continue  # its caller went away; the order still holds
            if isinstance(reply, RespError):
                waiter.set_exception(reply)
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionLost(f"connection to Redis lost: {exc or 'closed'}", sent=True))

    def overdue(self, timeout_s: float) -> bool:
        return bool(self.sent_at) and time.monotonic() - self.sent_at[0] > timeout_s

    def _fail(self, error: ConnectionLost) -> None:
        self.closed = True
        self.sent_at.clear()
        self.on_written.clear()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class PipelinedConnection:
    """A lazily (re)connected, shared connection; ``call`` is safe from many tasks at once."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        parsed = urlparse(url)
        # Percent-encoded, as redis-py reads it (the embedded server's URL quotes its path).
        self._unix = unquote(parsed.path) if parsed.scheme == "unix" else None
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 6379
        query = parse_qs(parsed.query)
        db_text = query.get("db", [""])[0] or (parsed.path.lstrip("/") if parsed.scheme != "unix" else "")
        self._db = int(db_text or 0)
        # Percent-encoded in the URL (a password holding '@', '/' or ':'), as redis-py reads it.
        self._password = unquote(parsed.password) if parsed.password else parsed.password
        self._username = unquote(parsed.username) if parsed.username else parsed.username
        self._timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._attempt: asyncio.Future[_Protocol] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._unix:
                    _, protocol = await loop.create_unix_connection(_Protocol, self._unix)
                else:
                    _, protocol = await loop.create_connection(_Protocol, self._host, self._port)
        except (OSError, TimeoutError) as err:
            raise ConnectionLost(f"cannot connect to Redis: {err}", sent=False) from err
        setup: list[tuple[Any, ...]] = []
        if self._password:
            setup.append(
                ("AUTH", self._username, self._password) if self._username else ("AUTH", self._password)
            )
        if self._db:
            setup.append(("SELECT", self._db))
        try:
            async with asyncio.timeout(self._timeout_s):
                for command in setup:
                    await self._send(protocol, encode(command))
        except TimeoutError:
            protocol._fail(ConnectionLost("Redis did not answer AUTH/SELECT in time", sent=False))
            raise ConnectionLost("Redis did not answer AUTH/SELECT in time", sent=False) from None
        except BaseException:
            # Refused (a wrong password, too many clients): close it, or every retry leaks one.
            protocol._fail(ConnectionLost("AUTH/SELECT refused", sent=False))
            raise
        return protocol

    async def _ready(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and not protocol.closed:
            return protocol
        # One connect attempt at a time, shared by every call waiting for it: its failure is
        # theirs too. Each trying its own in turn, the Nth caller waited N timeouts for its 503
        # while connects hung (a host gone, SYNs dropped).
        attempt = self._attempt
        if attempt is None:
            attempt = self._attempt = asyncio.ensure_future(self._connect_shared())
            attempt.add_done_callback(self._attempt_done)
        protocol = await asyncio.shield(attempt)
        if protocol.closed:  # lost again before this caller's turn came: nothing was sent
            raise ConnectionLost("connection to Redis lost as it was made", sent=False)
        return protocol

    async def _connect_shared(self) -> _Protocol:
        self._protocol = await self._connect()
        return self._protocol

    def _attempt_done(self, attempt: asyncio.Future[_Protocol]) -> None:
        self._attempt = None
        if not attempt.cancelled():
            attempt.exception()  # read: a failure every waiter left before is not reported unread

    async def _send(
        self, protocol: _Protocol, command: bytes, on_sent: Callable[[], None] | None = None
    ) -> Any:
        assert protocol.transport is not None
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        protocol.waiters.append(waiter)
        protocol.sent_at.append(time.monotonic())
        protocol.queue(command, on_sent)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return await waiter

    async def _watch(self) -> None:
        """One timer for all commands instead of one per command: replies come in order, so if
        the oldest is overdue the connection is stuck; everything waiting on it fails as
        "maybe applied" and the next call reconnects."""
        interval = min(0.1, self._timeout_s / 4)
        while self._protocol is not None and not self._protocol.closed:
            await asyncio.sleep(interval)
            protocol = self._protocol
            if protocol is not None and protocol.overdue(self._timeout_s):
                protocol._fail(ConnectionLost("Redis did not answer in time", sent=True))

    async def call(
        self,
        *args: Any,
        on_sent: Callable[[], None] | None = None,
        parts: Sequence[tuple[Any, ...] | Packed] = (),
    ) -> Any:
        """Send a command (``args``, then each of ``parts``' arguments) and return its reply.
        ``on_sent`` is called once the command is written to the connection, ahead of every
        command sent on it after it (not when it never is: the call then raises
        ``ConnectionLost``). Nor for an EVALSHA of a script this connection has not run yet:
        refused (NOSCRIPT), its caller's EVAL would go behind the commands written meanwhile."""
        # Packed first: a command that cannot be packed must leave no waiter behind, or every
        # later reply would go to the caller before its own.
        command = encode(args, parts)
        protocol = await self._ready()
        sha = args[1] if len(args) > 1 and args[0] == "EVALSHA" else None
        if sha is not None and sha not in protocol.scripts_run:
            on_sent = None
        try:
            reply = await self._send(protocol, command, on_sent)
        except RespError as err:
            if sha is not None and str(err).startswith("NOSCRIPT"):  # SCRIPT FLUSH on this server
                protocol.scripts_run.discard(sha)
            elif str(err).startswith("READONLY") and not protocol.closed:
                # A replica now (a failover that did not close connections: behind a DNS name,
                # say): this connection would be refused every write until it dropped. The next
                # call connects again, to whatever the address names now; what was in flight on
                # this one fails as maybe applied (on a replica, none of it was).
                protocol._fail(ConnectionLost("Redis answered READONLY: reconnecting", sent=True))
            raise
        if sha is not None:
            protocol.scripts_run.add(sha)
        return reply

    async def close(self) -> None:
        if self._attempt is not None:
            self._attempt.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(BaseException):
                await self._watchdog
        if self._protocol is not None and self._protocol.transport is not None:
            with contextlib.suppress(Exception):
                self._protocol.transport.close()
        self._protocol = None
