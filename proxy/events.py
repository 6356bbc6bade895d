"""Observe a stream's SSE events and decide, event by event, what the client gets.

Every event is passed on byte for byte, except usage the client did not ask for (its
``"usage":null`` cut off, the usage-only chunk dropped), ``[DONE]`` (written by the relay
after the billing comment) and whatever follows the answer's end.

Most events of an OpenAI stream are content deltas that differ only in their text. The first
such event is parsed in full; its bytes around the text become a template, and later runs of
events that match it byte for byte are observed and passed on in one step: a few scans of the
whole run in C instead of Python work per event. Anything that does not match exactly (another
field, a quote or a line break in the text, a finish reason, usage, an error) goes through the
per-event path, so the template only ever changes the cost, never the result.
"""

from __future__ import annotations

import operator
from typing import Any

import orjson

from proxy.chunks import (
    CR,
    LF,
    NOT_PLAIN_CONTENT,
    PAD_END,
    PAD_FIELD,
    PARSED_TEXTS,
    data_event,
    dumps_chunk,
    event_over,
    is_done,
    odd_texts,
    without_usage_null,
)
from proxy.dialects import Dialect
from proxy.observe import Observation, Pieces, parse_event_data, pieces_of, string_end

# Tries at learning a template per stream: a stream whose events never fit one stops trying.
_TEMPLATE_TRIES = 3
# Tries at a run per read (see ``EventFilter.feed``).
_RUN_TRIES = 4
_BOM = b"\xef\xbb\xbf"
# Reads larger than this may let go of the events they are past (see ``EventFilter.feed``).
_LARGE_READ = 1 << 16


class EventFilter:
    """One stream's events: ``feed`` takes complete events, returns the client's bytes."""

    def __init__(
        self, obs: Observation, *, dialect: Dialect, choices: int, client_wants_usage: bool, runs: bool = True
    ) -> None:
        self.obs = obs
        self.dialect = dialect
        self.client_wants_usage = client_wants_usage
        # The content fast paths hold for one choice, where every content piece is choice 0's.
        self._fast = choices == 1 and dialect.injects_usage
        self._content_field = b'"content"' if dialect.endpoint == "chat.completions" else b'"text"'
        self._content_key = self._content_field + b':"'
        self._strip = not client_wants_usage
        # Events passed on in runs (``runs=False``: never; one event at a time, as a reference).
        self.run_events = 0
        # The template: an event is prefix + quote-free text + suffix.
        self._prefix = b""
        self._suffix = b""
        self._separator = b""
        # Derived once per template, not per read (a stream's reads are many and small).
        self._prefix_len = 0
        self._suffix_len = 0
        self._cut = operator.itemgetter(slice(0))
        # Where template events' texts go: the observation's list of choice 0's content.
        self._sink: Pieces[str | bytes] = Pieces()
        # The service tier the template names (None: none), which prices the call: each
        # template event names it again, as the per-event path reads it (last one wins).
        self._tier: str | None = None
        # The client's version of the template when it did not ask for usage (empty: the same).
        self._stripped_suffix = b""
        self._stripped_separator = b""
        # A padded template (OpenAI's chunks end in padding of a random length): its suffix is
        # this, the padding, then PAD_END; the client's version of it (None: the same).
        self._pad_mid = b""
        self._pad_mid_stripped: bytes | None = None
        # Bytes of an event not complete yet, held until the next read.
        self._held = bytearray()
        # The last read ended in \r: a \n starting the next one is the same line break.
        self._after_cr = False
        self._tries = _TEMPLATE_TRIES if self._fast and runs else 0
        self._fresh = True  # nothing read yet: a byte order mark may come first
        self._head = b""  # the first bytes while they may be a byte order mark cut by the read

    def read(self, piece: bytes, *, limit: int) -> bytes | None:
        """One read of the upstream body: the client's bytes for the events it completes (none
        held over when it ends in a blank line: no copies), or None when an event grows past
        ``limit`` bytes."""
        if self.obs.done:
            return b""  # past the answer's end: nothing more goes out (see ``feed``)
        if self._after_cr:
            self._after_cr = False
            if piece.startswith(b"\n"):
                piece = piece[1:]  # the \n of a \r\n the last read ended inside
        if self._fresh and piece:
            # Allowed before a stream's first field (SSE), and a read may end inside it.
            piece = self._head + piece
            if len(piece) < len(_BOM) and _BOM.startswith(piece):
                self._head = piece
                return b""
            self._fresh = False
            self._head = b""
            piece = piece.removeprefix(_BOM)
        held = self._held
        if not held:
            if self._prefix_len and len(piece) <= limit and (out := self._single(piece)) is not None:
                return out
            if piece.endswith(b"\n\n") and CR not in piece and not event_over(piece, limit):
                return self.feed(piece)
        if CR in piece:
            # SSE ends a line with \r\n, \n or a lone \r (never inside JSON: it escapes \r).
            self._after_cr = piece.endswith(b"\r")
            piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        # What was held holds no blank line: only the new bytes (and the one before) can end an
        # event. Searching all of a long event at each read was quadratic in its size.
        start = max(len(held) - 1, 0)
        held += piece
        if event_over(held, limit):
            return None
        complete = held.rfind(b"\n\n", start) + 2
        if complete < 2:
            return b""
        # Handed over without a name here: ``feed`` may let go of them (see there).
        return self.feed(self._take(complete))

    def _take(self, complete: int) -> bytes:
        """The held bytes up to ``complete``, copied once (not sliced, then copied) and let go
        of before they are read: an event as large as the answer (Responses' last, a gateway's
        one chunk) was held twice more while it was parsed."""
        held = self._held
        with memoryview(held) as view:
            events = view[:complete].tobytes()
        del held[:complete]
        return events

    def _single(self, event: bytes) -> bytes | None:
        """The client's bytes when ``event`` is exactly one template event, else None.

        The common read when chunks come spaced out, so it does as little as it can: a text with
        no line break whose quotes are all escaped cannot hold a second event, nor leave its
        string; the text goes straight to the observation's list (its first token was seen when
        the template was learned)."""
        if self._pad_mid:
            return self._single_padded(event)
        size = len(event)
        end = size - self._suffix_len
        if (
            end < self._prefix_len  # prefix and suffix would overlap: not this template
            or not event.startswith(self._prefix)
            or not event.endswith(self._suffix)
        ):
            return None
        text = event[self._prefix_len : end]
        if not self._took(text):
            return None
        if self._stripped_suffix:
            return self._prefix + text + self._stripped_suffix
        return event

    def _took(self, text: bytes) -> bool:
        """Observe ``text`` as one template event's, unless it is not plain content (then the
        per-event path reads the event)."""
        if LF in text or CR in text or text in PARSED_TEXTS or odd_texts(text):
            return False
        if text:
            self._sink.add(text)
        self.obs.chunks += 1
        if self._tier is not None:
            self.obs.service_tier = self._tier
        self.run_events += 1
        return True

    def _single_padded(self, event: bytes) -> bytes | None:
        """``_single`` for a padded template: the padding (letters and digits) after its field's
        opening quote, the text before the field's fixed bytes (which hold quotes no text
        leaves unescaped)."""
        if not event.startswith(self._prefix) or not event.endswith(PAD_END):
            return None
        at = event.rfind(self._pad_mid)
        pad_at = at + len(self._pad_mid)
        pad = event[pad_at : -len(PAD_END)]
        # The field's opening quote is not the closing one of PAD_END ('"obfuscation":"}').
        if at < self._prefix_len or pad_at > len(event) - len(PAD_END) or (pad and not pad.isalnum()):
            return None
        text = event[self._prefix_len : at]
        if not self._took(text):
            return None
        if self._pad_mid_stripped is not None:
            return self._prefix + text + self._pad_mid_stripped + pad + PAD_END
        return event

    @property
    def incomplete(self) -> bool:
        """Whether the body so far ends inside an event: not in a block of comments alone (a
        keep-alive whose blank line never came), which dispatches nothing to the SDK."""
        if self._head:
            return True
        held = self._held.strip()
        return bool(held) and not all(
            line.startswith(_NO_DATA_LINES) for line in held.split(b"\n") if line.strip()
        )

    def held(self) -> bytes:
        """What came after the last event, no blank line ending it (at the body's end: all of a
        body that held no event)."""
        return self._head + bytes(self._held)

    def end(self) -> bytes:
        """At the body's clean end: the client's bytes for an event whose blank line never came
        but whose data is whole (a gateway that closes right after the last field, as
        openai/openai-node#2725 met: the answer's end, [DONE], its usage), read as the last
        event; ``b""`` when nothing was held, or what was is cut inside its data (then still
        ``incomplete``). Once per stream, never per read: the reads' path stays as it was."""
        event = bytes(self._held).strip(b"\n")
        if not event or not _data_whole(event):
            return b""
        self._held.clear()
        return self.feed(event + b"\n\n")

    def feed(self, events: bytes) -> bytes:
        """``events``: one or more complete events, each ending in a blank line (``\\n\\n``)."""
        size = len(events)
        out: list[bytes] = []
        pos = 0
        # Each try at a run splits what is left of the piece: a few per piece, so that a piece of
        # many odd events (each a run's end) is not split again at each of them.
        tries = _RUN_TRIES
        while pos < size:
            if self.obs.done:
                # The answer's end ([DONE], which the relay writes again after the billing
                # comment; response.completed / incomplete / failed, message_stop, passed on):
                # what follows it in the same read is dropped, as the relay drops the reads after
                # it. Passed on, the client's SDK would read it (an error event: a whole answer
                # raised), and observed it would bill the call otherwise (upstream_error).
                break
            if events[pos] == LF:
                # Blank lines too many ("\n\n\n"): passed on as they came, not as the start
                # of the next event, which a read may end before (then they were an event).
                blank = pos
                while pos < size and events[pos] == LF:
                    pos += 1
                out.append(events[blank:pos])
                continue
            if tries and self._prefix_len and not self._pad_mid and events.startswith(self._prefix, pos):
                tries -= 1
                found = self._run(events, pos)
                if found is not None:
                    run, texts = found
                    out.append(self._pass_run(run, texts))
                    pos += len(run)
                    continue
            sep = events.find(b"\n\n", pos)
            if sep < 0:  # not a complete event: the caller only hands over complete ones
                sep = size
                framed = events[pos:] + b"\n\n"
            elif pos or sep + 2 != size:
                framed = events[pos : sep + 2]
            else:
                framed = events  # a read of one event (most are): not copied
            # Padded template events differ from each other beyond their texts: one at a time.
            passed = self._single_padded(framed) if self._pad_mid else None
            if passed is None:
                passed = self.safe_event(framed)
            if passed is not None:
                out.append(passed)
            pos = sep + 2
            if _LARGE_READ < pos < size and size - pos < pos:
                # Past a large event (as large as the answer, say), what is left is kept alone:
                # the whole is not held beside that event's bytes for the client and its text
                # while the rest is read. Only when most is behind: copied a few times at most.
                events = events[pos:]
                size -= pos
                pos = 0
        return b"".join(out)

    # -- runs of template events -----------------------------------------------------------

    def _run(self, events: bytes, pos: int) -> tuple[bytes, list[bytes]] | None:
        """The run of template events from ``pos``, and their texts: as many events as are
        template events, up to the template's last occurrence in ``events``."""
        end = events.rfind(self._suffix, pos) + self._suffix_len
        if end - pos < self._prefix_len + self._suffix_len:
            return None
        run = events[pos:end]
        # Each event a line, then an empty line. Split on the one byte (much faster than on the
        # blank line: bytes.split's single-byte path), each event's text cut out in C
        # (itemgetter of a slice: a comprehension doing the same took twice as long).
        lines = run.split(b"\n")
        texts = list(map(self._cut, lines[:-1:2]))
        # Rebuilt from the texts, the run must come out byte for byte: every event is then the
        # template around its text. Each text must not leave its JSON string (an unescaped
        # quote, a trailing backslash); one scan of them joined checks that.
        if (
            self._prefix + self._separator.join(texts) + self._suffix != run
            or odd_texts(b"\n".join(texts) + b"\n")
            or not PARSED_TEXTS.isdisjoint(texts)
        ):
            # The run ends before its first odd event, which goes through the per-event path.
            count = self._template_events(lines)
            if not count:
                return None
            texts = texts[:count]
            run = run[: self._prefix_len * count + sum(map(len, texts)) + self._suffix_len * count]
        return run, texts

    def _template_events(self, lines: list[bytes]) -> int:
        """How many of ``lines`` (a run split at its line breaks) are template events, each
        followed by an empty line, before the first that is not."""
        prefix, line_end = self._prefix, self._suffix[:-2]
        least = self._prefix_len + len(line_end)
        for count in range(len(lines) // 2):
            line = lines[2 * count]
            if (
                lines[2 * count + 1]
                or len(line) < least
                or not line.startswith(prefix)
                or not line.endswith(line_end)
                or (text := self._cut(line)) in PARSED_TEXTS
                or odd_texts(text)
            ):
                return count
        return len(lines) // 2

    def _pass_run(self, run: bytes, texts: list[bytes]) -> bytes:
        self.obs.raw_run(0, b"".join(texts), len(texts))
        if self._tier is not None:
            self.obs.service_tier = self._tier
        self.run_events += len(texts)
        if self._stripped_suffix:
            return self._prefix + self._stripped_separator.join(texts) + self._stripped_suffix
        return run

    def _learn(self, data: bytes, obj: Any, start: int, end: int) -> None:
        """Make ``data`` (a content event's JSON, parsed as ``obj``, its text at ``start:end``)
        the template when the parse confirms it is nothing but one piece of text for choice 0."""
        self._tries -= 1
        try:
            text = orjson.loads(b'"' + data[start:end] + b'"')
        except orjson.JSONDecodeError:
            return
        scratch = Observation()
        scratch.observe(obj, streaming=True)
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not (
            isinstance(choices, list)
            and len(choices) == 1
            and isinstance(choices[0], dict)
            and choices[0].get("index") == 0
            and not scratch.finish_reasons
            and not scratch.extras
            and not scratch.refused
            and not scratch.error
            and scratch.usage is None
            and obj.get("usage", None) is None
            # Nothing observed but this one text.
            and scratch.contents == {0: [text]}
            # Nor a choice's "text" beside its delta (Together's): which of the two is read
            # depends on the delta's content, which a template's bytes may leave free.
            and ("text" not in choices[0] or "delta" not in choices[0])
        ):
            return
        prefix = b"data: " + data[:start]
        suffix = data[end:] + b"\n\n"
        if LF in prefix or LF in suffix[:-2] or CR in prefix or CR in suffix:
            return
        stripped = b""
        if self._strip and "usage" in obj:  # spelled with escapes or not
            # The client's version cuts the usage field out of the bytes after the text.
            cut = without_usage_null(data)
            if cut is None or cut[:end] != data[:end]:
                return
            stripped = cut[end:] + b"\n\n"
        pad_at = suffix.rfind(PAD_FIELD) + len(PAD_FIELD)
        pad = suffix[pad_at : -len(PAD_END)]
        if pad_at >= len(PAD_FIELD) and suffix.endswith(PAD_END) and (not pad or pad.isalnum()):
            self._pad_mid = suffix[:pad_at]
            if stripped:
                self._pad_mid_stripped = stripped[: len(stripped) - len(pad) - len(PAD_END)]
        self._prefix, self._suffix = prefix, suffix
        self._prefix_len, self._suffix_len = len(prefix), len(suffix)
        self._cut = operator.itemgetter(slice(len(prefix), 2 - len(suffix)))
        self._sink = pieces_of(self.obs.contents, 0)
        self._tier = scratch.service_tier
        self._separator = suffix + prefix
        if stripped:
            self._stripped_suffix = stripped
            self._stripped_separator = stripped + prefix
        self._tries = 0

    # -- one event at a time ---------------------------------------------------------------

    def safe_event(self, framed: bytes) -> bytes | None:
        """``framed`` (one event and the blank line ending it), but an answer shaped so oddly
        that observing it fails is a malformed answer (``upstream_error``), passed on as it
        came: it never breaks the stream."""
        try:
            return self._event(framed)
        except Exception:
            self.obs.malformed = True
            return framed

    def _typed_event(self, framed: bytes, data: bytes | memoryview) -> bytes:
        """Responses / Anthropic events: observed, passed on unchanged."""
        try:
            obj, _ = parse_event_data(data)
        except ValueError:
            self.obs.malformed = True
            return framed
        if isinstance(obj, dict):
            self.dialect.observe_event(self.obs, obj)
        else:
            self.obs.malformed = True
        return framed

    def _try_template(self, data: bytes, obj: Any) -> None:
        """Learn the template from ``data`` (parsed as ``obj``) when it is a compact chunk whose
        one choice carries only a non-empty text (the role chunk's empty one makes none)."""
        if NOT_PLAIN_CONTENT.search(data):
            return
        key = self._content_key
        found = data.find(key)
        if found < 0:
            return
        start = found + len(key)
        end = string_end(data, start)
        if end > start and data.find(key, end) < 0:
            self._learn(data, obj, start, end)

    def _event(self, framed: bytes) -> bytes | None:
        """Observe one SSE event (``framed``: with the blank line ending it, as it is passed on);
        return the bytes the client gets, or None to drop it."""
        one_line = framed.startswith(b"data: ") and framed.find(b"\n") == len(framed) - 2
        # Parsed from a view of the event's bytes, not a copy: an event may be as large as the
        # answer (Responses' last repeats it all).
        view = memoryview(framed)[6:-2] if one_line else _data_of(framed)
        if view is None:
            return framed  # comments (keep-alives) and field-only events pass through
        if is_done(view):
            if not self.dialect.done_marker:
                # Not how these APIs end (response.completed, message_stop do): passed on,
                # never taken for a complete answer.
                return framed
            self.obs.done = True
            return None  # written after the billing comment
        if not self.dialect.injects_usage:
            return self._typed_event(framed, view)
        # Parsed whole, even a plain content delta: the SDK parses it too, and a chunk it
        # cannot read is a malformed answer. (Runs of template events skip this: see _run.)
        try:
            obj, read_by_orjson = parse_event_data(view)
        except ValueError:
            self.obs.malformed = True
            return framed
        self.obs.observe(obj, streaming=True)
        if self._tries:
            self._try_template(bytes(view), obj)
        if self.client_wants_usage or not isinstance(obj, dict) or "usage" not in obj:
            return framed  # no usage field: as it came
        event = b"" if one_line else framed[:-2]  # the fields data_event keeps
        if obj["usage"] is None:
            cut = without_usage_null(bytes(view))
            if cut is not None:
                return data_event(cut, event)
        elif not obj.get("choices") and obj.get("error") is None:
            # The usage-only chunk the client did not ask for: choices [] (OpenAI's), or none at
            # all (another server's; an SDK would hand it on as a chunk without choices). Not a
            # provider's error event carrying the usage so far: the SDK raises that one.
            return None
        obj.pop("usage")
        return data_event(dumps_chunk(obj, read_by_orjson=read_by_orjson), event)


def _data_of(framed: bytes) -> bytes | memoryview | None:
    """The data of an event of several lines (its ``data:`` lines' values, a line break between
    them; None: it has none), a view of its bytes when one line holds it all (Responses' and
    Anthropic's events: ``event:``, then ``data:``)."""
    view = memoryview(framed)
    found: list[memoryview] = []
    pos, last = 0, len(framed) - 1  # the blank line ending the event starts there
    while pos < last:
        end = framed.find(b"\n", pos)
        if framed.startswith(b"data:", pos):
            start = pos + 5
            found.append(view[start + 1 if framed.startswith(b" ", start) else start : end])
        pos = end + 1
    if len(found) == 1:
        return found[0]
    return b"\n".join(found) if found else None


# Lines that start no event: a comment, a reconnection delay. An ``event:`` or ``id:`` line may
# be the head of an event whose data was cut off (Anthropic's and Responses' events begin so).
_NO_DATA_LINES = (b":", b"retry:")


def _data_whole(event: bytes) -> bool:
    """Whether ``event`` (its lines, without the blank line that ends it) has data as the SDK
    reads a whole event's: ``[DONE]`` or JSON (data cut inside its JSON is not)."""
    lines = [ln[5:].removeprefix(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return False  # fields or comments alone: no answer's end to read
    data = b"\n".join(lines)
    if is_done(data):
        return True
    try:
        parse_event_data(data)
    except ValueError:
        return False
    return True
