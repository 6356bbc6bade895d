"""The bytes of one SSE event of an OpenAI stream, as ``events.EventFilter`` reads them: its
framing, the end of the stream, the usage field cut out of a chunk, and whether a text between the
quotes of a JSON string is plain content (what the template fast path may take without a parse).
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from proxy.observe import parse_json

USAGE_NULL_TAIL = b',"usage":null}'
# A "usage" key, at any depth: a string "usage" that is not a key (a content text, a token of its
# logprobs) is never followed by a colon.
USAGE_KEY = re.compile(rb'"usage"\s*:')
USAGE_NULL_FIELD = b',"usage":null'
# OpenAI's padding field (stream_options.include_obfuscation, on by default), last in a chunk.
PAD_FIELD = b',"obfuscation":"'
PAD_END = b'"}\n\n'
# Anything in a chunk besides a content delta: these go through the full JSON parse.
NOT_PLAIN_CONTENT = re.compile(
    rb'"finish_reason"\s*:\s*"|"usage"\s*:\s*\{|"refusal"\s*:\s*"|"tool_calls"|"function_call"|"error"'
    rb'|"choices"\s*:\s*\[\s*\]'
)
# Texts that, between the quotes of their string, match NOT_PLAIN_CONTENT (or the per-event
# path's "usage" test): one event at a time such an event is parsed in full, so runs leave them
# to that path.
PARSED_TEXTS = frozenset({b"error", b"tool_calls", b"function_call", b"usage"})
QUOTED_WORD_AT_END = re.compile(rb'"(?:error|tool_calls|function_call|usage)$', re.MULTILINE)
# Single bytes, tested as ints: ``int in bytes`` is a memchr, where ``bytes in bytes`` first tries
# its operand as an int and formats and drops a TypeError (140 ns against 20 for a short text, per
# event); longer needles are looked for with ``find``.
LF, CR, QUOTE, BACKSLASH, COMMA = b'\n\r"\\,'
# Bytes JSON refuses raw in a string (a line break is the texts' separator: see odd_texts),
# found by deleting them (bytes.translate: a tenth of a regex's time over a run's texts).
CONTROL = bytes(range(0x0A)) + bytes(range(0x0B, 0x20))
JSON_ESCAPE = re.compile(rb'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')


def data_event(data: bytes, event: bytes = b"") -> bytes:
    """An event carrying ``data``: one ``data:`` line per line of it (data an upstream sent on
    several lines has line breaks, which a single line would cut short for the client), after
    the other fields of ``event`` (the one it replaces: its ``id:``, ``event:``, ``retry:``)."""
    out = b"data: " + data.replace(b"\n", b"\ndata: ") + b"\n\n"
    if LF not in event:
        return out  # the common event: one data line and nothing else
    fields = [line for line in event.split(b"\n") if not line.startswith(b"data:")]
    return b"\n".join(fields) + b"\n" + out if fields else out


def event_over(events: bytes | bytearray, limit: int) -> bool:
    """Whether one of ``events`` (the last maybe not complete yet) is longer than ``limit``: the
    limit bounds an event, not a read, which may carry many (a fast upstream, a slow client)."""
    if len(events) <= limit:
        return False
    pos = 0
    while True:
        sep = events.find(b"\n\n", pos)
        if (len(events) if sep < 0 else sep) - pos > limit:
            return True
        if sep < 0:
            return False
        pos = sep + 2


def without_usage_null(data: bytes) -> bytes | None:
    """``data`` (a chunk whose top-level ``usage`` is null) with that field cut out of its bytes,
    every other byte as it came; None when the bytes do not say where it is for sure."""
    # The one "usage" key of the bytes is the top-level field: not a nested one, nor one of two
    # (the parser kept the last). Several: the cut is checked (a legacy completion's
    # top_logprobs names its tokens as keys, "usage" among them).
    keys = len(USAGE_KEY.findall(data))
    if not keys:
        return None
    if data.endswith(USAGE_NULL_TAIL):  # OpenAI's place for it, before the object's end
        cut = data[: -len(USAGE_NULL_TAIL)] + b"}"
    else:  # before another field (OpenAI's "obfuscation")
        at = data.find(USAGE_NULL_FIELD)
        if at < 0 or data[at + len(USAGE_NULL_FIELD)] != COMMA:
            return None
        cut = data[:at] + data[at + len(USAGE_NULL_FIELD) :]
    if keys > 1:
        whole = parse_json(data)
        whole.pop("usage", None)
        try:
            return cut if parse_json(cut) == whole else None
        except ValueError:
            return None
    # A key spelled with escapes ("us\u0061ge") is "usage" all the same: the count did not see it.
    if data.find(b"\\u") >= 0 and "usage" in parse_json(cut):
        return None
    return cut


def dumps_chunk(obj: dict[str, Any], *, read_by_orjson: bool) -> bytes:
    """A chunk parsed by ``observe.parse_event_data`` written again. Only Python's ``json`` read
    one holding a lone surrogate escape (a text cut inside an emoji), NaN or Infinity (a logprob
    of -inf, as a Python server writes it): it writes them again as they came, where orjson
    would write NaN and Infinity as null."""
    if read_by_orjson:
        return orjson.dumps(obj)
    return json.dumps(obj, separators=(",", ":")).encode()


def is_done(data: bytes | memoryview) -> bool:
    return data[:6] == b"[DONE]" and bytes(data).rstrip() == b"[DONE]"


def odd_texts(texts: bytes) -> bool:
    """Whether a text (or any of several, each followed by a line break), as the bytes between
    the quotes of a JSON string, is not one the per-event path reads as plain content: it is not
    JSON (a raw control byte, an escape JSON has not, which the client's SDK would refuse), it
    could close its string early (an unescaped quote) or escape the closing quote (a lone
    trailing backslash), or it ends in an escaped quote and a word of PARSED_TEXTS, which the
    closing quote makes a quoted word that path parses in full (``\\"error`` then ``"``)."""
    if len(texts.translate(None, CONTROL)) != len(texts):
        return True
    if not texts.isascii():
        try:  # as the client's SDK decodes a stream's lines (``observe.parse_event_data``)
            texts.decode("utf-8")
        except UnicodeDecodeError:
            return True
    if QUOTE not in texts and BACKSLASH not in texts:
        return False
    # JSON's escapes, read left to right as a parser does: what is left must hold no quote nor
    # backslash.
    unescaped = JSON_ESCAPE.sub(b"", texts)
    if QUOTE in unescaped or BACKSLASH in unescaped:
        return True
    return QUOTE in texts and QUOTED_WORD_AT_END.search(texts) is not None
