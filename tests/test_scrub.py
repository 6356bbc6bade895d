"""The operator's credentials found however a JSON string spells them, and what is no spelling
of one left as it came (``proxy.scrub``)."""

from __future__ import annotations

import json

import pytest

from proxy.scrub import scrubbed, secrets_of

# A '/', a quote, a backslash, a character past Latin-1 and one past U+FFFF: each spelled apart.
SECRET = 'gw/pä"ss\\w€rd-\U0001f600-0123'
SECRETS = secrets_of([SECRET, "sk-upstream-key-0123456789"])


def message(spelling: str) -> bytes:
    return b'{"error": {"message": "bad ' + spelling.encode() + b' here"}}'


def every_escaped(text: str, hex_case: str) -> str:
    """``text`` with every character as \\uXXXX (past U+FFFF its surrogate pair)."""
    units = text.encode("utf-16-be")
    spelled = "".join(f"\\u{units[i] << 8 | units[i + 1]:04x}" for i in range(0, len(units), 2))
    return spelled.upper().replace("\\U", "\\u") if hex_case == "upper" else spelled


@pytest.mark.parametrize(
    "spelling",
    [
        json.dumps(SECRET)[1:-1],  # Python's json
        json.dumps(SECRET, ensure_ascii=False)[1:-1],  # Go's, Rust's: non-ASCII as it is
        json.dumps(SECRET)[1:-1].replace("/", "\\/"),  # PHP's
        every_escaped(SECRET, "lower"),
        every_escaped(SECRET, "upper"),  # .NET writes its hex in upper case
        # Mixed: the '/' escaped, the quote as \u0022, the euro sign as it is, the emoji's pair in
        # upper case, a digit escaped.
        "gw\\/p\\u00e4\\u0022ss\\\\w€rd-\\uD83D\\uDE00-01\\u00323",
    ],
)
def test_every_json_spelling_of_a_secret_is_replaced(spelling: str) -> None:
    assert json.loads(message(spelling))["error"]["message"] == f"bad {SECRET} here"  # the client reads it
    out = scrubbed(message(spelling), SECRETS)
    assert json.loads(out)["error"]["message"] == "bad [REDACTED] here", out


def test_a_spelling_after_an_escaped_backslash_is_read_as_the_decoder_reads_it() -> None:
    """``\\\\u0073k-...`` is an escaped backslash and the text "u0073k-...": no key, left as it
    came. After three backslashes, the key, replaced past the escaped backslash: cut from the
    second, the backslash left would escape the replacement's "[", and the body be no JSON."""
    spelled = "\\u0073k-upstream-key-0123456789"
    literal = message("\\" + spelled)
    assert scrubbed(literal, SECRETS) == literal
    out = scrubbed(message("\\\\" + spelled), SECRETS)
    assert json.loads(out)["error"]["message"] == "bad \\[REDACTED] here", out


def test_a_spelling_after_many_escapes_is_replaced() -> None:
    # A code answer's event: line breaks and quotes before the key's escape.
    text = 'print(\\"a\\")\\n' * 12 + "\\u0073k-upstream-key-0123456789"
    out = scrubbed(message(text), SECRETS)
    assert json.loads(out)["error"]["message"].endswith(")\n[REDACTED] here"), out


@pytest.mark.parametrize(
    "text",
    [
        "\\u4f60\\u597d " * 50,  # an answer escaped whole (ensure_ascii)
        "a \\u003cb\\u003e tag \\u0026 sk-upstream-key-012345678",  # Go's HTML escapes; a key cut short
    ],
)
def test_escapes_that_spell_no_secret_are_left_as_they_came(text: str) -> None:
    assert scrubbed(message(text), SECRETS) == message(text)
