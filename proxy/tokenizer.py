"""Token counting for when the provider gives no usage, and for reservation estimates.

Encodings are loaded once at start, each within a time bound (tiktoken may try to download
its files, and this proxy must never fetch anything at request time). A missing encoding
falls back to 4 characters per token for usage estimates, and to the UTF-8 byte length (an
upper bound of any byte-level BPE count) for reservations.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

log = logging.getLogger("proxy.tokenizer")

# "none": the call never left the proxy (the upstream refused the connection).
UsageSource = Literal["provider", "tokenizer", "chars", "reserve", "none"]
DEFAULT_ENCODING = "o200k_base"
# No tokenizer, on purpose: reserves at the UTF-8 bytes (never below any byte-level tokenizer's
# count, Claude's among them, which tiktoken's may be), usage estimated at 4 characters a token.
BYTES_ENCODING = "bytes"
CHARS_PER_TOKEN = 4
# Texts at least this long have their counts remembered: an agent sends its whole conversation
# again on every turn, and counting 100 KB with tiktoken takes milliseconds.
CACHED_TEXT_CHARS = 1024
DEFAULT_CACHE_CHARS = 8 * 1024 * 1024
# Above this many characters not counted before, a reservation starts from the UTF-8 byte
# length and is counted exactly after (see ``quick_bound_of_parts``): tiktoken takes about a
# millisecond per 16 KB, which the reserve, and the call behind it, need not wait for.
QUICK_BOUND_CHARS = 16 * 1024


class Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


# Encodings that count ordinary text (no special tokens) as another does: the same ranks, with
# special tokens of their own.
SAME_ORDINARY_TEXT = {"o200k_harmony": "o200k_base"}


@functools.lru_cache(maxsize=1024)  # once per model name, not per call
def encoding_for_model(model: str, configured: str | None) -> str:
    if configured:
        return configured
    try:
        import tiktoken.model

        return str(tiktoken.model.encoding_name_for_model(model))
    except Exception:
        return DEFAULT_ENCODING


def _load_one(name: str, timeout_s: float) -> Encoding | None:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            import tiktoken

            box["enc"] = tiktoken.get_encoding(name)
        except Exception as err:
            box["err"] = err

    # A daemon thread: a hung download must neither block start-up past the bound nor exit.
    thread = threading.Thread(target=target, name=f"tiktoken-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "enc" in box:
        return box["enc"]  # type: ignore[no-any-return]
    reason = box.get("err", f"not loaded within {timeout_s}s")
    log.warning(
        "tiktoken encoding unavailable, estimates fall back to characters",
        extra={"encoding": name, "reason": str(reason)[:200]},
    )
    return None


class CountCache:
    """Token counts of long texts, least recently used first out, bounded by the characters
    of the texts it keeps. Safe across threads (large estimates run in worker threads). Each
    count is its scope's (the caller's tenant): whether a text is remembered shows in the reserve,
    and must not tell one tenant what another sent."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._counts: OrderedDict[tuple[str, str, str], int] = OrderedDict()  # scope, encoding, text
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, encoding: str, text: str, scope: str = "") -> int | None:
        with self._lock:
            found = self._counts.get((scope, encoding, text))
            if found is None:
                self.misses += 1
                return None
            self._counts.move_to_end((scope, encoding, text))
            self.hits += 1
            return found

    def put(self, encoding: str, text: str, count: int, scope: str = "") -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            if (scope, encoding, text) in self._counts:
                return
            self._counts[(scope, encoding, text)] = count
            self._chars += len(text)
            while self._chars > self.max_chars:
                (_, _, old), _count = self._counts.popitem(last=False)
                self._chars -= len(old)

    @property
    def chars(self) -> int:
        return self._chars


class Tokenizer:
    def __init__(
        self,
        encodings: Mapping[str, Encoding | None],
        *,
        cache_chars: int = DEFAULT_CACHE_CHARS,
        loads_missing: bool = False,
    ) -> None:
        self._encodings = dict(encodings)
        self.cache = CountCache(cache_chars)
        # Whether an encoding a call names and nobody tried is loaded (``resolve``): the app's
        # tokenizer (``load``); one given its encodings (tests, tools) has all it will have.
        self._loads_missing = loads_missing

    @classmethod
    def load(
        cls, names: Iterable[str], *, timeout_s: float = 5.0, cache_chars: int = DEFAULT_CACHE_CHARS
    ) -> Tokenizer:
        loaded = {name: None if name == BYTES_ENCODING else _load_one(name, timeout_s) for name in set(names)}
        return cls(loaded, cache_chars=cache_chars, loads_missing=True)

    def load_more(self, names: Iterable[str], *, timeout_s: float = 5.0) -> threading.Thread | None:
        """Encodings not tried yet (those of models a reload added), each loaded within the
        same time bound on a thread of its own, off the event loop: until one lands, its models
        are counted as without it (the byte bound, never below the real count)."""
        new = [name for name in set(names) if name != BYTES_ENCODING and name not in self._encodings]
        if not new:
            return None
        for name in new:
            self._encodings[name] = None  # tried: a later reload does not start it again

        def target() -> None:
            for name in new:
                enc = _load_one(name, timeout_s)
                if enc is not None:
                    self._encodings[name] = enc

        thread = threading.Thread(target=target, name="tiktoken-reload", daemon=True)
        thread.start()
        return thread

    def available(self, encoding: str) -> bool:
        return self._encodings.get(encoding) is not None

    def resolve(self, encoding: str) -> str:
        """The encoding a model's text is counted with: ``encoding`` when loaded, else one
        that counts ordinary text the same (o200k_harmony is o200k_base with special tokens of
        its own); else ``encoding``, loaded off the event loop from now on when it was never
        tried: a model that reaches a glob of the config (``gpt-oss-*`` by ``*``) names an
        encoding no pattern of the config did, and its calls were counted as without tiktoken
        (reserved at their bytes, an answer without usage billed at 4 characters a token)."""
        if encoding == BYTES_ENCODING or self._encodings.get(encoding) is not None:
            return encoding
        same = SAME_ORDINARY_TEXT.get(encoding)
        if same is not None and self._encodings.get(same) is not None:
            return same
        if self._loads_missing and encoding not in self._encodings:
            self.load_more([encoding])
        return encoding

    def count(self, text: str, encoding: str, *, scope: str | None = None) -> tuple[int, UsageSource]:
        """Best estimate of the tokens in ``text``: tiktoken, else 4 characters per token. With
        ``scope``, a count remembered under it (a reserve's, ``upper_bound_of_parts``) is taken:
        the same figure, as it was counted by the same encoder (an encoding, once loaded, is
        never replaced), never counted again."""
        if not text:
            return 0, "tokenizer" if self.available(encoding) else "chars"
        enc = self._encodings.get(encoding)
        if enc is not None:
            known = None
            if scope is not None and len(text) >= CACHED_TEXT_CHARS:
                known = self.cache.get(encoding, text, scope)
            return len(enc.encode_ordinary(text)) if known is None else known, "tokenizer"
        return max(1, -(-len(text) // CHARS_PER_TOKEN)), "chars"

    def upper_bound(self, text: str, encoding: str) -> int:
        """A count that is never below the real one: tiktoken, else the UTF-8 byte length."""
        if not text:
            return 0
        enc = self._encodings.get(encoding)
        if enc is not None:
            return len(enc.encode_ordinary(text))
        return len(text.encode("utf-8", "surrogatepass"))

    def upper_bound_of_parts(self, parts: Sequence[str], encoding: str, *, scope: str = "") -> int:
        """``upper_bound`` of the parts joined by line breaks, counted part by part (as a chat
        provider counts message by message, each in its own template) plus one per break;
        with the byte fallback exactly the joined text's UTF-8 length. Long parts' counts are
        remembered, so a conversation sent again is counted only where it grew: under ``scope``
        (the caller's tenant), as what one tenant sent is none of another's business (whether a
        text was counted before shows in how it is reserved)."""
        enc = self._encodings.get(encoding)
        if enc is None:
            return max(0, len(parts) - 1) + sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)
        known, new = self._remembered(parts, encoding, scope)
        return known + sum(self._count_and_remember(part, encoding, enc, scope) for part in new)

    def quick_bound_of_parts(
        self, parts: Sequence[str], encoding: str, *, quick_chars: int = QUICK_BOUND_CHARS, scope: str = ""
    ) -> tuple[int, bool]:
        """``upper_bound_of_parts`` without waiting for tiktoken on much new text: when the parts
        whose counts are not remembered hold ``quick_chars`` characters or more, those count as
        their UTF-8 bytes (never below tiktoken's count: every token is at least one byte).
        Returns the bound and whether it is the exact count (False: count again later)."""
        enc = self._encodings.get(encoding)
        if enc is None:
            return self.upper_bound_of_parts(parts, encoding), True
        known, new = self._remembered(parts, encoding, scope)
        if sum(map(len, new)) < quick_chars:
            return known + sum(self._count_and_remember(part, encoding, enc, scope) for part in new), True
        return known + sum(len(part.encode("utf-8", "surrogatepass")) for part in new), False

    def _remembered(self, parts: Sequence[str], encoding: str, scope: str = "") -> tuple[int, list[str]]:
        """The remembered counts of ``parts`` plus one per break between them, and the parts
        whose counts are not remembered."""
        total = max(0, len(parts) - 1)
        new: list[str] = []
        for part in parts:
            count = self.cache.get(encoding, part, scope) if len(part) >= CACHED_TEXT_CHARS else None
            if count is None:
                new.append(part)
            else:
                total += count
        return total, new

    def _count_and_remember(self, part: str, encoding: str, enc: Encoding, scope: str = "") -> int:
        count = len(enc.encode_ordinary(part)) if part else 0
        if len(part) >= CACHED_TEXT_CHARS:
            self.cache.put(encoding, part, count, scope)
        return count
