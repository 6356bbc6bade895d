"""The operator's credentials kept out of what an upstream sends back (``forward.operator_secrets``),
however a JSON string there spells them."""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

REDACTED = b"[REDACTED]"
BACKSLASH = 0x5C  # an int: see chunks.LF

# Each escape JSON has besides \uXXXX, by the character it stands for.
_SHORT_ESCAPES = {
    '"': r"\\\"",
    "\\": r"\\\\",
    "/": r"\\/",
    "\b": r"\\b",
    "\f": r"\\f",
    "\n": r"\\n",
    "\r": r"\\r",
    "\t": r"\\t",
}


@dataclass(frozen=True, slots=True)
class Secrets:
    """Credentials sought in what an upstream sends back (``scrubbed``), worked out once per
    upstream (``forward.UpstreamSending``): ``scrubbed`` runs on every stream event."""

    # Each as it reads, and as Python's json writes it: what data holding no \u escape may hold.
    forms: tuple[bytes, ...] = ()
    # A \u escape of one of their characters, and then any spelling of one (``spelled``): sought
    # only in data holding such an escape.
    escapes: re.Pattern[bytes] | None = None
    spelled: re.Pattern[bytes] | None = None

    def __bool__(self) -> bool:
        return bool(self.forms)


NO_SECRETS = Secrets()


def secrets_of(texts: Iterable[str]) -> Secrets:
    """``texts`` (each a credential) as ``scrubbed`` seeks them."""
    ordered = sorted(dict.fromkeys(texts), key=len, reverse=True)  # one inside another: the longer whole
    if not ordered:
        return NO_SECRETS
    forms: dict[bytes, None] = {}
    for text in ordered:
        forms.update(dict.fromkeys(_as_echoed(text)))
        with contextlib.suppress(UnicodeEncodeError):  # its bytes as a basic auth token carries them
            forms[text.encode("latin1")] = None
    units = {unit for text in ordered for char in text for unit in _utf16_units(char)}
    return Secrets(
        forms=tuple(forms),
        escapes=re.compile(rb"\\u(?:" + _hex_alternatives(units) + rb")"),
        spelled=re.compile(b"|".join(spelled(text) for text in ordered)),
    )


def scrubbed(raw: bytes, secrets: Secrets) -> bytes:
    """``raw`` with every one of ``secrets`` replaced, however a JSON string spells it."""
    for secret in secrets.forms:
        if raw.find(secret) >= 0:  # not ``in``: see chunks.LF
            raw = raw.replace(secret, REDACTED)
    # A spelling that none of ``forms`` is holds a \u escape of one of its characters (another
    # encoder's: Go's \u0026 for "&", .NET's \u002B for "+", upper-case hex); only then the
    # regex, tens of times slower than the rest over an event.
    escapes = secrets.escapes
    if escapes is not None and BACKSLASH in raw:  # a memchr: most events hold no escape at all
        at = _unicode_escape(raw)
        if at >= 0 and escapes.search(raw, at) is not None:
            assert secrets.spelled is not None
            raw = spelled_scrubbed(raw, secrets.spelled)
    return raw


def text_scrubbed(text: str, secrets: Secrets) -> str:
    """``text`` (a string read out of an answer, its escapes read) with every one of ``secrets``
    replaced."""
    if not secrets:
        return text
    raw = text.encode("utf-8", "surrogatepass")
    out = scrubbed(raw, secrets)
    return text if out is raw else out.decode("utf-8", "surrogatepass")


def _unicode_escape(raw: bytes) -> int:
    """Where ``raw`` may hold its first \\u escape (-1: it holds none). Its first backslashes
    looked at one by one (each found by a memchr; an event holds a few: a line break, a quote):
    a search for the two bytes takes five times as long as the rest of ``scrubbed``."""
    at = raw.find(BACKSLASH)
    for _ in range(8):
        if at < 0 or raw[at + 1 : at + 2] == b"u":
            return at
        at = raw.find(BACKSLASH, at + 2)  # past the escaped character: a backslash too
    return -1 if at < 0 else raw.find(b"\\u", at)


def spelled(text: str) -> bytes:
    """A pattern of ``text`` however a JSON string may spell it: each character as itself, as
    \\uXXXX in either case (past U+FFFF a surrogate pair), or as its short escape."""
    parts = []
    for char in text:
        ways = [re.escape(char), "".join(_escaped(unit) for unit in _utf16_units(char))]
        if char in _SHORT_ESCAPES:
            ways.append(_SHORT_ESCAPES[char])
        parts.append("(?:" + "|".join(ways) + ")")
    return "".join(parts).encode()


def spelled_scrubbed(raw: bytes, pattern: re.Pattern[bytes]) -> bytes:
    """``raw`` with what ``pattern`` (of ``spelled`` texts) finds replaced, but a match that
    starts inside an escape: after an odd run of backslashes, ``\\\\u0073k-...`` reads as a
    backslash and "u0073k-...", no key (and cut there, the lone backslash left would escape the
    replacement's "[": no JSON)."""
    return pattern.sub(functools.partial(_redacted, raw), raw)


def _redacted(raw: bytes, match: re.Match[bytes]) -> bytes:
    start = end = match.start()
    while start > 0 and raw[start - 1] == BACKSLASH:
        start -= 1
    return match[0] if (end - start) % 2 else REDACTED


def _as_echoed(text: str) -> list[bytes]:
    """``text`` as it reads, and as an echo of it in JSON (an error's message, an event) reads:
    a quote, a backslash or a control character escaped, and any non-ASCII character too by the
    encoders that escape it (Python's json by default); a '/' escaped by those that escape it."""
    forms = [text, json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]]
    forms += [form.replace("/", "\\/") for form in forms if "/" in form]
    return [form.encode() for form in dict.fromkeys(forms)]


def _utf16_units(char: str) -> tuple[int, ...]:
    code = ord(char)
    if code < 0x10000:
        return (code,)
    code -= 0x10000
    return 0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)


def _escaped(unit: int) -> str:
    """A pattern of \\uXXXX of ``unit``, its hex digits in either case."""
    return r"\\u" + "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in f"{unit:04x}")


def _hex_alternatives(units: Iterable[int]) -> bytes:
    """A pattern of the four hex digits of any of ``units``, in either case: one branch per
    first three digits, so that an escape of none (a CJK answer escaped whole) fails fast."""
    last: dict[str, set[str]] = {}
    for unit in units:
        digits = f"{unit:04x}"
        last.setdefault(digits[:3], set()).update((digits[3], digits[3].upper()))
    branches = []
    for first, ends in sorted(last.items()):
        head = "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in first)
        branches.append(f"{head}[{''.join(sorted(ends))}]")
    return "|".join(branches).encode()
