"""Observe an upstream answer: usage, finish reasons, refusals and the generated text.

Fed with parsed JSON (a whole body, or one SSE chunk at a time). Keeps per choice only what a
missing usage or a JSON policy needs: the text generated, never the raw response.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Generic, TypeVar

import orjson

from proxy.values import value_class

# OpenRouter's reasoning_details that hold no text of the reasoning it bills (reasoning.text does).
HIDDEN_REASONING_DETAILS = frozenset({"reasoning.encrypted", "reasoning.summary"})


@value_class()
class ProviderUsage:
    input_tokens: int  # all input, cached and cache writes included
    output_tokens: int  # all output, reasoning included
    cached_input_tokens: int
    reasoning_tokens: int
    cache_creation_input_tokens: int = 0
    # Parts of the input and output priced apart: audio (OpenAI), and the cache writes kept an
    # hour (Anthropic; a part of cache_creation_input_tokens).
    audio_input_tokens: int = 0
    audio_output_tokens: int = 0
    cache_creation_1h_input_tokens: int = 0
    # Of cache_creation_input_tokens, the writes no TTL split tells (Anthropic's: a stream's
    # cumulative count grown past message_start's split, a gateway's usage with no split): kept
    # as long as the request asked, which only the call knows (``billed_usage``).
    cache_creation_untold_input_tokens: int = 0
    # Image tokens priced apart: an image model's output, the Responses image generation tool's
    # input images and output.
    image_input_tokens: int = 0
    image_output_tokens: int = 0
    # Whether the report split its output into images and text (``image_tokens`` told): a call
    # asking for images whose report does not is billed as though all were images (``billed_usage``).
    image_output_told: bool = False
    # False when the report gave no output count (only prompt tokens): the output is then
    # counted from the text, never taken as 0.
    output_known: bool = True


# Above this a count is not a usage report but garbage (and past 2**53 Lua loses integers).
MAX_SANE_TOKENS = 10**12


def add_id(ids: list[str], found: Any) -> None:
    """``found`` to ``ids`` (an answer's item or container ids) when it is one, and new."""
    if isinstance(found, str) and found and found not in ids:
        ids.append(found)


def token_count(value: Any) -> int | None:
    # bool is an int in Python; a provider sending true is not a count.
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SANE_TOKENS:
        return value
    return None


def function_calls(message: dict[str, Any]) -> list[Any]:
    """The calls of a message (or a delta): each of its ``tool_calls``' function (its ``name``
    and ``arguments``) or custom tool (``name`` and ``input``), and its legacy
    ``function_call``; what is not a dict is the caller's to skip."""
    calls = message.get("tool_calls")
    functions = (
        [call.get("function") or call.get("custom") for call in calls if isinstance(call, dict)]
        if isinstance(calls, list)
        else []
    )
    functions.append(message.get("function_call"))
    return functions


CALL_TEXT_FIELDS = ("name", "arguments", "input")


def parse_usage(raw: Any) -> ProviderUsage | None:
    """Provider usage, or None when absent or unusable. An explicit 0 is a real 0."""
    if not isinstance(raw, dict):
        return None
    prompt = token_count(raw.get("prompt_tokens", raw.get("input_tokens")))
    given = raw.get("completion_tokens", raw.get("output_tokens"))
    completion = 0 if given is None else token_count(given)
    if prompt is None or completion is None:
        return None
    prompt_details = raw.get("prompt_tokens_details") or raw.get("input_tokens_details") or {}
    completion_details = raw.get("completion_tokens_details") or raw.get("output_tokens_details") or {}
    # A detail absent or null is none of that kind; one that is not a count makes the whole
    # unusable, as Anthropic's do (a cached count read as 0 would bill cache reads at full price).
    cached = _detail(prompt_details, "cached_tokens")
    # DeepSeek's own name for its cache reads, which its answers without prompt_tokens_details
    # carry alone; Moonshot's (Kimi's) at the top of its usage. A part of prompt_tokens, both.
    hits = _detail(raw, "prompt_cache_hit_tokens")
    kimi_hits = _detail(raw, "cached_tokens")
    # Cache writes, a subset of the input: OpenRouter's and OpenAI's name, and LiteLLM's (with
    # the share kept an hour, priced apart).
    written = _detail(prompt_details, "cache_write_tokens")
    litellm_written = _detail(prompt_details, "cache_creation_tokens")
    split = prompt_details.get("cache_creation_token_details") if isinstance(prompt_details, dict) else None
    hour = _detail(split, "ephemeral_1h_input_tokens")
    minutes = _detail(split, "ephemeral_5m_input_tokens")
    # OpenAI's writes kept 12 hours (``prompt_cache_options.ttl``), at the operator's price for
    # writes kept longer, as the hour's are.
    ttls = prompt_details.get("cache_write_tokens_details") if isinstance(prompt_details, dict) else None
    half_day = _detail(ttls, "ttl_12h_tokens")
    half_hour = _detail(ttls, "ttl_30m_tokens")
    # Anthropic's own names, at the top of a gateway's OpenAI-format usage (LiteLLM, Portkey).
    read_top = _detail(raw, "cache_read_input_tokens")
    written_top = _detail(raw, "cache_creation_input_tokens")
    reasoning = _detail(completion_details, "reasoning_tokens")
    audio_in = _detail(prompt_details, "audio_tokens")
    audio_out = _detail(completion_details, "audio_tokens")
    # Images an image model wrote (OpenRouter's; Gemini's image models price them 12 times their
    # text). Not a prompt's image tokens: OpenAI's models read images at the text price.
    image_out = _detail(completion_details, "image_tokens")
    # Perplexity's, at the top of its usage and in none of its other counts (total_tokens is
    # prompt + completion): the search results its model read (citation_tokens, input at the input
    # price) and its research step's thinking (reasoning_tokens, priced apart).
    citations = _detail(raw, "citation_tokens")
    reasoning_beside = _detail(raw, "reasoning_tokens")
    if (
        cached is None
        or hits is None
        or kimi_hits is None
        or written is None
        or litellm_written is None
        or hour is None
        or half_day is None
        or minutes is None
        or half_hour is None
        or read_top is None
        or written_top is None
        or reasoning is None
        or audio_in is None
        or audio_out is None
        or image_out is None
        or citations is None
        or reasoning_beside is None
    ):
        return None
    cached = cached or hits or kimi_hits
    written = written or litellm_written
    total = token_count(raw.get("total_tokens"))
    # Whether prompt_tokens holds Anthropic's counts depends on the gateway and its version:
    # Portkey's leaves both out (its total_tokens counts them on top); LiteLLM's holds its reads
    # (also told as cached_tokens) and, in its versions that also tell them as
    # cache_creation_tokens, its writes, while others left the writes out. One the gateway does
    # not also tell the OpenAI way, or that prompt_tokens cannot hold, is billed beside it: where
    # that reading is wrong (LiteLLM before it told cache_creation_tokens), the writes are billed
    # once more at the input price, never less than the provider billed.
    top = read_top + written_top
    all_beside = bool(top) and total is not None and total >= prompt + completion + top
    given_prompt = prompt
    if read_top and (all_beside or not cached or read_top > given_prompt):
        prompt += read_top
    if written_top and (all_beside or not written or written_top > given_prompt):
        prompt += written_top
    cached, written = max(cached, read_top), max(written, written_top)
    prompt += citations
    if reasoning_beside and not reasoning:
        reasoning = reasoning_beside
        # SGLang's, of the same name and place (its total_tokens too is prompt + completion),
        # is a part of completion_tokens: Perplexity's comes with its citations, or is more.
        if "citation_tokens" in raw or reasoning > completion:
            completion += reasoning
    elif (
        reasoning
        and given is not None
        and (reasoning > completion or (total is not None and total >= prompt + completion + reasoning))
    ):
        # OpenAI counts reasoning within completion_tokens; Gemini's OpenAI-compatible usage (and
        # gateways that translate it) beside it: total_tokens then counts it on top, or it is more
        # than the completion count, which it cannot be a part of. Billed either way.
        completion += reasoning
    if given is not None and reasoning + audio_out + image_out > completion:
        # Parts told past their whole (1,290 images and 200 reasoning tokens in 1,000 of output):
        # the output is at least its parts, each priced as its kind; billed at the whole, the
        # images past what the count left were dropped from the cost and named in the ledger.
        completion = reasoning + audio_out + image_out
    if given is not None and total is not None and total > prompt + completion:
        # Gemini's own OpenAI-compatible usage tells no reasoning count: its total_tokens holds
        # the thoughts (billed as output) that completion_tokens leaves out, and any tool-use
        # prompt (input). What total_tokens counts beyond the rest is billed as reasoning: the
        # dearer reading, never less than the provider billed.
        extra = total - prompt - completion
        completion += extra
        reasoning += extra
    return ProviderUsage(
        prompt,
        completion,
        cached,
        reasoning,
        cache_creation_input_tokens=written,
        cache_creation_1h_input_tokens=min(max(hour, half_day), written),
        # Writes no split tells (a gateway's Anthropic writes, told at its usage's top alone):
        # kept an hour where the request's cache_control asks it (``billed_usage``).
        cache_creation_untold_input_tokens=max(0, written - hour - minutes - half_day - half_hour),
        audio_input_tokens=audio_in,
        audio_output_tokens=audio_out,
        image_output_tokens=image_out,
        image_output_told=isinstance(completion_details, dict)
        and completion_details.get("image_tokens") is not None,
        output_known=given is not None,
    )


def _detail(details: Any, name: str) -> int | None:
    value = details.get(name) if isinstance(details, dict) else None
    return 0 if value is None else token_count(value)


# Pieces of a text left apart before they are joined into one (see ``Pieces``): a stream's
# pieces are a token or so each, and a Python object of ~4 characters costs ten times its text.
LOOSE_PIECES = 64


_Piece = TypeVar("_Piece", str, str | bytes)


class Pieces(list[_Piece], Generic[_Piece]):
    """A text's pieces in order (str, or bytes still JSON-escaped), whose last ones are joined
    into one every ``LOOSE_PIECES`` (``compact``): the text held near its size, not as one object
    per token. Those before ``floor`` are left as they are (joined, or a position a caller holds:
    ``Observation.content_mark``)."""

    __slots__ = ("floor",)

    def __init__(self) -> None:
        super().__init__()
        self.floor = 0

    def add(self, piece: _Piece) -> None:
        self.append(piece)
        if len(self) - self.floor >= LOOSE_PIECES:
            self.compact()

    def compact(self) -> None:
        """Join the pieces after ``floor``: those of one type in a row into one (the text reads
        the same: ``Observation.content_of`` joins them so too)."""
        floor = self.floor
        loose: list[Any] = self[floor:]
        if not loose:
            return
        joined: list[Any]
        try:
            joined = [(b"" if isinstance(loose[0], bytes) else "").join(loose)]
        except TypeError:  # str and bytes mixed (the chat fast path's and the per-event path's)
            joined = [(b"" if kind is bytes else "").join(run) for kind, run in groupby(loose, type)]
        self[floor:] = joined
        self.floor = len(self)


def pieces_of(texts: dict[int, Pieces[_Piece]], index: int) -> Pieces[_Piece]:
    found = texts.get(index)
    if found is None:
        found = texts[index] = Pieces()
    return found


@dataclass(slots=True)
class Observation:
    usage: ProviderUsage | None = None
    usage_chunks: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    # Generated text per choice, held once: content pieces (raw JSON-escaped bytes from the
    # fast path, or decoded str) and the rest (refusals, tool calls).
    contents: dict[int, Pieces[str | bytes]] = field(default_factory=dict)
    extras: dict[int, Pieces[str]] = field(default_factory=dict)
    refused: bool = False
    # Choices that called a tool or function (OpenAI chat and Responses; the JSON policy holds
    # no other dialect): their answer is the call, not text.
    calls: set[int] = field(default_factory=set)
    # Output the provider bills that the answer does not show: a Responses reasoning item (its
    # tokens are hidden; a summary, when asked for, is a fraction of them). Not countable.
    hidden_output: bool = False
    first_token_at: float | None = None
    chunks: int = 0
    malformed: bool = False
    error: bool = False
    # A Responses answer still queued or in progress (with ``error``: not the answer, billed at
    # its reserve): the provider writes it later, outside the call, and keeps it.
    pending: bool = False
    done: bool = False
    # The processing tier the provider says it served (OpenAI's service_tier; priced apart).
    service_tier: str | None = None
    # Anthropic's answer told its speed or its geography (whether fast, whether the US's; None:
    # not told), not the two: the tier is the call's asked one with these in it (``served_tier``).
    tier_told: tuple[bool | None, bool | None] | None = None
    # Usage that arrives in parts (Anthropic: message_start, then message_delta).
    partial_usage: dict[str, Any] = field(default_factory=dict)
    usage_final: bool = True
    # An Anthropic stream's message_delta told an output count (message_start's is a placeholder).
    output_told: bool = False
    # The most output a report told that told no input count (a gateway's: unusable as usage, its
    # output is the provider's all the same): a count of the answer bills no less.
    output_alone_tokens: int = 0
    # The id of the answer the provider may keep (a Responses answer; a Messages answer, kept in a
    # thread or as a cache diagnostics fingerprint): a later call may continue or name it.
    response_id: str | None = None
    # The ids of its output items (Responses API) and audio answers (chat): a later call may name
    # them (an item reference, an assistant message's audio).
    item_ids: list[str] = field(default_factory=list)
    # The code execution containers it ran in (Responses, Messages): a later call may name them.
    container_ids: list[str] = field(default_factory=list)
    # The files its code execution wrote (Anthropic's ``*code_execution_output``), kept by the
    # provider's Files API under the key's workspace: a later call may name them.
    file_ids: list[str] = field(default_factory=list)
    # Responses messages that are not the final answer (a ``phase`` of ``commentary``), by
    # output index and item id: their text is output, never the structured answer.
    side_messages: set[int | str] = field(default_factory=set)
    # Streamed messages whose phase is not known yet, by output index: where their text starts
    # in choice 0's content.
    message_starts: dict[Any, int] = field(default_factory=dict)
    # Calls of the provider's hosted tools, by tool (``tool_fees``): Anthropic's
    # ``usage.server_tool_use``, a Responses answer's ``*_call`` items (its web searches by
    # ``tool_usage.web_search.num_requests`` where that is more).
    tool_calls: dict[str, int] = field(default_factory=dict)
    # Calls of hosted tools the answer showed as it went (Anthropic's server_tool_use blocks, a
    # Responses ``*_call`` item as it starts), by tool: billed where no final usage told them (a
    # stream cut under cancel, an answer without usage, ``tool_calls_told``). None until one is seen.
    tool_uses: dict[str, int] | None = None
    # A Responses stream's web search calls by output index, and whether each is in
    # ``tool_uses``: counted as it begins (the bound), taken back when its item is done with an
    # action that is no search (``observe_responses._billed_call``). None until one is seen.
    web_searches: dict[int, bool] | None = None
    # The provider counted those calls itself with its last usage (Anthropic's
    # ``usage.server_tool_use``, 0 for a search that failed): its count stands over the calls
    # shown. A usage without it counts no calls; nor does a Responses usage, ever: its count is
    # of the items the final response lists (which a failed one's empty output leaves out), or
    # its ``tool_usage``'s searches where more: the calls shown may still be more.
    tool_calls_told: bool = False

    def saw_tool_use(self, tool: Any) -> None:
        if isinstance(tool, str) and tool:
            if self.tool_uses is None:
                self.tool_uses = {}
            self.tool_uses[tool] = self.tool_uses.get(tool, 0) + 1

    def take_usage(self, usage: ProviderUsage) -> None:
        self.usage = usage
        self.usage_chunks += 1
        # A report without an output count is not the final word on the output (see ``billed_usage``).
        self.usage_final = usage.output_known

    def add_text(self, index: int, piece: Any, *, content: bool = False) -> None:
        if isinstance(piece, str) and piece:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            (pieces_of(self.contents, index) if content else pieces_of(self.extras, index)).add(piece)

    def content_mark(self, index: int) -> int:
        """Where choice ``index``'s content goes on from: its pieces from there are never joined
        with those before (``content_since``)."""
        pieces = self.contents.get(index)
        if pieces is None:
            return 0  # a choice without content is none of the answers yet
        pieces.floor = len(pieces)
        return pieces.floor

    def content_since(self, index: int, start: int) -> list[str | bytes]:
        """The content pieces from ``start`` (a ``content_mark``), taken out of the content."""
        pieces = self.contents.get(index)
        if pieces is None:
            return []
        taken = pieces[start:]
        del pieces[start:]
        pieces.floor = min(pieces.floor, len(pieces))
        return taken

    def raw_content(self, index: int, escaped: bytes) -> None:
        """A content piece still JSON-escaped (the relay's fast path): decoded only if needed."""
        self.chunks += 1
        if escaped:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            pieces_of(self.contents, index).add(escaped)

    def raw_run(self, index: int, escaped: bytes, events: int) -> None:
        """The texts of ``events`` content events at once, still JSON-escaped and joined."""
        self.chunks += events
        if escaped:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            pieces_of(self.contents, index).add(escaped)

    def _choice(self, choice: dict[str, Any], part: dict[str, Any] | None, position: int) -> None:
        index = choice.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            index = position  # choices without an index keep their own finish reasons
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:  # "" on every chunk (older Ollama, SGLang): none
            self.finish_reasons[index] = reason
        if reason == "error" or isinstance(choice.get("error"), dict):
            # OpenRouter: a choice that failed mid-answer, on HTTP 200 (its error on the choice,
            # not always at the top): the provider's failure, not a whole answer.
            self.error = True
        if part is None:
            # legacy completions carry "text" on the choice itself
            self.add_text(index, choice.get("text"), content=True)
            return
        content = part.get("content")
        if isinstance(content, str):
            self.add_text(index, content, content=True)
        elif isinstance(content, list):
            self._content_parts(index, content)
        else:
            # Only where no content came beside it: Together's chunks carry each piece twice,
            # as the choice's "text" and as its delta's content (one answer, not two).
            self.add_text(index, choice.get("text"), content=True)
        audio = part.get("audio")
        if isinstance(audio, dict):  # an audio answer's words (its sound is not text)
            self.add_text(index, audio.get("transcript"))
            add_id(self.item_ids, audio.get("id"))  # kept for a later turn to send back by id
        # OpenAI-compatible reasoning models' thinking, output tokens the provider bills:
        # reasoning_content (DeepSeek, vLLM, SGLang), reasoning (OpenRouter, Groq, Ollama; a
        # server sending both for compatibility sends the same text twice: one is read).
        thinking = part.get("reasoning_content")
        self.add_text(index, thinking if isinstance(thinking, str) and thinking else part.get("reasoning"))
        details = part.get("reasoning_details")
        if isinstance(details, list) and any(
            isinstance(d, dict) and d.get("type") in HIDDEN_REASONING_DETAILS for d in details
        ):
            # OpenRouter: reasoning billed in full, sent only encrypted or summarized (no text of
            # it to count, or a summary of it), as OpenAI's and Anthropic's models do.
            self.hidden_output = True
        refusal = part.get("refusal")
        if refusal:
            self.refused = True
            self.add_text(index, refusal)
        for function in function_calls(part):
            if isinstance(function, dict):
                self.calls.add(index)
                for key in CALL_TEXT_FIELDS:
                    self.add_text(index, function.get(key))

    def _content_parts(self, index: int, parts: list[Any]) -> None:
        """A content sent as a list of parts (Mistral's; its reasoning models, Magistral, send
        their thinking so, then the answer): the text parts are the answer, the thinking's texts
        output the provider bills beside it, as reasoning_content is (never held to JSON)."""
        for part in parts:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text":
                self.add_text(index, part.get("text"), content=True)
            elif kind == "thinking":
                thought = part.get("thinking")
                if isinstance(thought, list):  # Mistral's: text parts of its own
                    for inner in thought:
                        if isinstance(inner, dict):
                            self.add_text(index, inner.get("text"))
                else:
                    self.add_text(index, thought)

    def observe(self, obj: Any, *, streaming: bool) -> None:
        """One SSE chunk or one whole body."""
        if not isinstance(obj, dict):
            self.malformed = True
            return
        self.chunks += 1
        if obj.get("error") is not None:
            self.error = True
        tier = obj.get("service_tier")
        if isinstance(tier, str) and tier:
            self.service_tier = tier
        told = obj.get("usage")
        if told is not None:
            self._take_told(told)
        elif "x_groq" in obj:
            # Groq's streams tell their usage there, on their last chunk, asked for or not.
            groq = obj["x_groq"]
            if isinstance(groq, dict) and groq.get("usage") is not None:
                self._take_told(groq["usage"])
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        key = "delta" if streaming else "message"
        for position, choice in enumerate(choices):
            if isinstance(choice, dict):
                part = choice.get(key)
                self._choice(choice, part if isinstance(part, dict) else None, position)

    def _take_told(self, raw: Any) -> None:
        """A usage report, as the provider wrote it."""
        usage = parse_usage(raw)
        if usage is not None:
            self.take_usage(usage)
        else:
            self.take_output_alone(raw)

    def take_output_alone(self, raw: Any) -> None:
        """A report ``parse_usage`` could not use: its output count, when that is all it lacks
        an input count for (``output_alone_tokens``)."""
        if not isinstance(raw, dict) or raw.get("prompt_tokens", raw.get("input_tokens")) is not None:
            return
        told = token_count(raw.get("completion_tokens", raw.get("output_tokens")))
        if told:
            self.output_alone_tokens = max(self.output_alone_tokens, told)

    def content_of(self, index: int) -> str:
        out: list[str] = []
        raw: list[bytes] = []
        for piece in self.contents.get(index, ()):
            if isinstance(piece, bytes):
                raw.append(piece)
                continue
            if raw:
                out.append(_unescape(raw))
                raw.clear()
            out.append(piece)
        if raw:
            out.append(_unescape(raw))
        text = "".join(out)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # A surrogate: pieces decoded one at a time keep a pair split between them as two
            # lone ones, pieces joined raw pair it. One form for both: paired.
            return text.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")
        return text

    def all_text(self, echoes: Sequence[str] = ()) -> str:
        """Every answer's text (see ``answers``)."""
        return "".join(self.answers(echoes))

    def answers(self, echoes: Sequence[str] = ()) -> list[str]:
        """Each answer's text; ``echoes``: prompts an answer may begin with (a legacy
        completion's echo, billed as input), the shortest it does begin with left out. Not by
        the answer's index: an upstream that drops n numbers its answers otherwise, and a longer
        prompt may be what a shorter one's answer went on to write."""
        out: list[str] = []
        for index in sorted(set(self.contents) | set(self.extras)):
            text = self.content_of(index)
            # "" among them (an empty prompt) is every answer's shortest: nothing left out.
            echo = min((p for p in echoes if text.startswith(p)), key=len, default="")
            out.append(text[len(echo) :] + "".join(self.extras.get(index, ())))
        return out


def parse_json(data: bytes) -> Any:
    """``data`` as JSON, fast, yet taking what the client's SDK takes (Python's ``json``): a
    leading byte order mark, a lone surrogate escape (a text cut inside an emoji). ValueError
    when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            return json.loads(data)
        except RecursionError:
            raise ValueError("JSON nested too deep") from None


def json_text(value: Any) -> str:
    """``value`` written as JSON, to count it: what ``parse_json`` read with Python's ``json``
    (a lone surrogate escape, an integer past 64 bits), which orjson will not write, is written
    by ``json`` too (escaped: text a tokenizer takes); "" past its nesting (counted as nothing,
    as text no answer shows: the provider's usage tells it)."""
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):
        try:
            return json.dumps(value)
        except (TypeError, ValueError, RecursionError):
            return ""


def parse_event_data(data: bytes | memoryview) -> tuple[Any, bool]:
    """An event's data as JSON, as the client's SDK reads a stream's chunk: its lines decoded
    as strict UTF-8 (a byte order mark kept, which JSON then refuses, and bytes that are not
    UTF-8, a surrogate encoded raw among them, refused), then Python's ``json`` (which takes a
    lone surrogate escape, NaN and Infinity). With whether orjson read it: then orjson writes it
    again as it came (``chunks.dumps_chunk``). ValueError when the SDK could not read it."""
    try:
        return orjson.loads(data), True
    except orjson.JSONDecodeError:
        try:
            return json.loads(str(data, "utf-8")), False
        except RecursionError:
            raise ValueError("JSON nested too deep") from None


def _unescape(pieces: list[bytes]) -> str:
    """The text of JSON-escaped ``pieces`` in a row, quoted in the join itself: a join quoted
    after it is one more copy of the whole text alive when it is decoded."""
    quoted = b"".join([b'"', *pieces, b'"'])
    try:
        # As the client's SDK reads it (a lone surrogate escape too, which orjson refuses).
        value = parse_json(quoted)
    except ValueError:
        return quoted[1:-1].decode("utf-8", "replace")
    return value if isinstance(value, str) else ""


def string_end(data: bytes, start: int) -> int:
    """Index of the quote closing the JSON string that starts at ``start`` (after its opening
    quote), or -1."""
    pos = start
    while True:
        quote = data.find(b'"', pos)
        if quote < 0:
            return -1
        backslashes = 0
        k = quote - 1
        while k >= start and data[k] == 0x5C:
            backslashes += 1
            k -= 1
        if backslashes % 2 == 0:
            return quote
        pos = quote + 1
