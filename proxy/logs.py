"""Structured logging: one JSON object per line (or plain text for a terminal).

Fields passed with ``extra=`` become top-level keys. Anything that looks like a credential is
redacted on the way out, whatever path logged it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import select
import stat
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
# Keys of any shape after a header or field that carries one (a parser error quotes the raw
# header line), bearer tokens in any case, and OpenAI-style keys where a word starts, after an
# escape too (a repr's "\n", a URL's "%20"): not the "sk-" inside one, as in an id "task-4f2a9c"
# or a tenant "risk-analytics".
_SECRET = re.compile(
    r"(?i)((?:(?<![A-Za-z0-9])|(?<=\\[a-z])|(?<=\\x[0-9a-f]{2})|(?<=\\u[0-9a-f]{4})|(?<=%[0-9a-f]{2}))"
    r"sk-[A-Za-z0-9_-]{6,}"
    r"|(?:x-api-key|api[-_]key|authorization)[\"']?\s*[:=]\s*[\"']?(?:[a-z]+\s+)?[^\s\"',]+"
    r"|bearer\s+[^\s\"',]+)"
)
_SECRET_FIELDS = {"authorization", "api_key", "x-api-key", "key_value", "upstream_key"}


def redact(text: str) -> str:
    if text.isascii():
        # What every match holds, lowered; only for ASCII text: under IGNORECASE a letter outside
        # ASCII can match one of the pattern's (the Kelvin sign a "k", a long s an "s"). The
        # per-call line's fields hold none: a regex scan of each cost more than the rest of the
        # line (about 8,000 instructions a field).
        lowered = text.lower()
        if "key" in lowered or "sk-" in lowered or "bearer" in lowered or "authorization" in lowered:
            return _SECRET.sub("[REDACTED]", text)
        return text
    return _SECRET.sub("[REDACTED]", text)


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: "[REDACTED]" if str(k).lower() in _SECRET_FIELDS else _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


# ``extra={TRUSTED_FIELDS: {...}}``: flat fields already free of secrets (see ``redact``).
TRUSTED_FIELDS = "trusted_fields"


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def _time(self, record: logging.LogRecord) -> str:
        return self.stamp(record.created)

    def stamp(self, created: float) -> str:
        # One strftime per second, not per line: this runs once per call.
        second = int(created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        trusted = record.__dict__.get(TRUSTED_FIELDS)
        if trusted is not None:
            # The per-call line: its fields are built redacted by the caller; no scan needed.
            line = {
                "ts": self._time(record),
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.msg,
                **trusted,
            }
            return orjson.dumps(line).decode()
        payload: dict[str, Any] = {
            "ts": self._time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(_clean(payload), default=str, option=orjson.OPT_NON_STR_KEYS).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        trusted = extras.pop(TRUSTED_FIELDS, None)
        if isinstance(trusted, dict):
            # The per-call line's fields, flat as in the JSON format (still scanned: a terminal's
            # format is not on the hot path).
            extras = {**trusted, **extras}
        line = f"{record.levelname.lower():7} {record.name}: {record.getMessage()}"
        if extras:
            line += " " + json.dumps(_clean(extras), default=str, separators=(",", ":"))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


class _WholeLinesWriter(io.RawIOBase):
    """stderr as a pipe or a stream socket, which every worker of ``--workers N`` shares: a
    write of more than PIPE_BUF bytes is not atomic there, and when the reader lags another
    writer's bytes land inside it (lines no log shipper can parse). What the buffer hands over
    goes out in writes of whole lines of at most PIPE_BUF bytes (a longer line alone, whole)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, b: Any) -> int | None:
        # Called by the buffer once per flush (64 KiB at most), not per line.
        view = memoryview(b).cast("B")
        data = view.tobytes()  # to search (``find``): one copy a flush, not a line
        total = len(data)
        done = 0
        while done < total:
            end = done + select.PIPE_BUF
            if end < total:
                cut = data.rfind(b"\n", done, end)
                if cut < 0:  # one line longer than PIPE_BUF: alone, whole
                    cut = data.find(b"\n", end)
                end = total if cut < 0 else cut + 1
            else:
                end = total
            while done < end:
                try:
                    done += os.write(self._fd, view[done:end])
                except BlockingIOError:
                    # The buffer keeps what was not written (``None``: nothing was).
                    return done or None
        return total


def _stderr_stream() -> Any:
    fd = sys.stderr.fileno()
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return io.TextIOWrapper(io.BufferedWriter(_WholeLinesWriter(fd), 1 << 16), encoding="utf-8")
    # A regular file or a tty: one write is not interleaved with another writer's, whatever its size.
    return open(fd, "w", buffering=1 << 16, closefd=False, encoding="utf-8")


class BufferedStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Per-call lines go out in batches, not one write each: flushed when the buffer fills, when
    a line finds the last flush older than ``interval_s``, by ``flush_now`` (a timer in the app)
    and on ``close``; every other line (start-up, reloads, warnings) is flushed at once."""

    def __init__(self, interval_s: float = 0.25) -> None:
        stream: Any
        try:
            stream = _stderr_stream()
        except (AttributeError, OSError, ValueError):  # stderr replaced (captured): write to it as is
            stream = sys.stderr
        super().__init__(stream)
        self.interval_s = interval_s
        self._flushed_at = time.monotonic()
        self._urgent = False

    def emit(self, record: logging.LogRecord) -> None:
        # Only the per-call lines wait in the buffer; anything else goes out with them at once.
        self._urgent = record.levelno >= logging.WARNING or TRUSTED_FIELDS not in record.__dict__
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        # A line a background thread (an encoding's load, a count) logs after its stream closed
        # (a replaced stderr, closed at shutdown or by a test's capture) has nowhere to go: not a
        # "--- Logging error ---" traceback on stderr for it.
        if getattr(self.stream, "closed", False):
            return
        super().handleError(record)

    def write_call_line(self, fields: dict[str, Any]) -> None:
        """The per-call line without a LogRecord: what ``JsonFormatter`` makes of it, byte for
        byte, at a fraction of the cost of the logging machinery."""
        formatter = self.formatter
        assert isinstance(formatter, JsonFormatter)
        line = {"ts": formatter.stamp(time.time()), "level": "info", "logger": CALL_LOGGER, "msg": "call"}
        text = orjson.dumps({**line, **fields}).decode() + self.terminator
        with self.lock:  # type: ignore[union-attr]  # created in Handler.__init__
            try:
                self.stream.write(text)
            except (ValueError, OSError):  # a stream closed under us (tests, exit)
                return
            self._urgent = False
            self.flush()

    def flush(self) -> None:
        now = time.monotonic()
        if self._urgent or now - self._flushed_at >= self.interval_s:
            self.flush_now()

    def flush_now(self) -> None:
        self._flushed_at = time.monotonic()
        self._urgent = False
        with contextlib.suppress(ValueError, OSError):  # a stream closed under us (tests, exit)
            super().flush()

    def close(self) -> None:
        self.flush_now()
        super().close()


class Throttle:
    """How often a failure that repeats is told in the log: the first at once, then at most once
    every ``every_s`` seconds, the line counting those not told since (a store refusing every
    call is one line every few seconds, not one a call). One per app, not per module: each
    process, and each app a test builds, counts its own."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._told_at: float | None = None
        self._untold = 0

    def tell(self) -> int:
        """One more failure: how many to tell now, this one included (0: not yet)."""
        self._untold += 1
        now = self._clock()
        if self._told_at is not None and now - self._told_at < self.every_s:
            return 0
        self._told_at = now
        told, self._untold = self._untold, 0
        return told


CALL_LOGGER = "proxy.call"
_call_logger = logging.getLogger(CALL_LOGGER)


def log_call(fields: dict[str, Any]) -> None:
    """Write the per-call line (``fields`` already free of secrets, see ``redact``); the caller
    has checked that ``proxy.call`` logs at info, before building ``fields``.

    Straight into the buffered JSON handler when it is the only one in place, as ``serve`` sets
    it up; through ``logging`` otherwise (tests that capture logs, an embedding application).
    """
    # ``logging.getLogger`` takes the logging module's lock: twice per call was a third of this.
    logger = _call_logger
    handlers = logging.root.handlers
    if (
        len(handlers) == 1
        and type(handlers[0]) is BufferedStderrHandler
        and type(handlers[0].formatter) is JsonFormatter
        and not logger.handlers
        and not logger.filters
        and logger.propagate
    ):
        handlers[0].write_call_line(fields)
    else:
        logger.info("call", extra={TRUSTED_FIELDS: fields})


def flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, BufferedStderrHandler):
            handler.flush_now()


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = BufferedStderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
