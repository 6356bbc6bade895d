"""Token counting for when the provider gives no usage, and for reservation estimates.

Encodings are loaded once at start, each within a time bound (tiktoken may try to download
its files, and this proxy must never fetch anything at request time). A missing encoding
falls back to 4 characters per token for usage estimates, and to the UTF-8 byte length (an
upper bound of any byte-level BPE count) for reservations.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol

log = logging.getLogger("proxy.tokenizer")

# "none": the call never left the proxy (the upstream refused the connection).
UsageSource = Literal["provider", "tokenizer", "chars", "reserve", "none"]
DEFAULT_ENCODING = "o200k_base"
CHARS_PER_TOKEN = 4


class Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


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


class Tokenizer:
    def __init__(self, encodings: Mapping[str, Encoding | None]) -> None:
        self._encodings = dict(encodings)

    @classmethod
    def load(cls, names: Iterable[str], *, timeout_s: float = 5.0) -> Tokenizer:
        return cls({name: _load_one(name, timeout_s) for name in set(names)})

    def available(self, encoding: str) -> bool:
        return self._encodings.get(encoding) is not None

    def count(self, text: str, encoding: str) -> tuple[int, UsageSource]:
        """Best estimate of the tokens in ``text``: tiktoken, else 4 characters per token."""
        if not text:
            return 0, "tokenizer" if self.available(encoding) else "chars"
        enc = self._encodings.get(encoding)
        if enc is not None:
            return len(enc.encode_ordinary(text)), "tokenizer"
        return max(1, -(-len(text) // CHARS_PER_TOKEN)), "chars"

    def upper_bound(self, text: str, encoding: str) -> int:
        """A count that is never below the real one: tiktoken, else the UTF-8 byte length."""
        if not text:
            return 0
        enc = self._encodings.get(encoding)
        if enc is not None:
            return len(enc.encode_ordinary(text))
        return len(text.encode("utf-8", "surrogatepass"))
