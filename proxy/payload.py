"""Parse and validate a client's request body before anything is reserved or forwarded.

Only the fields the proxy reads are validated (strictly: no "5" for 5, no 1e30 for an int);
every other field passes through to the upstream unchanged.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Container
from typing import Any, Literal, Union, final, get_args, get_origin

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.errors import BadRequest

Endpoint = Literal["chat.completions", "completions", "embeddings", "responses", "messages"]
MAX_TOKENS_LIMIT = 10_000_000
# The deepest nesting orjson writes (it reads deeper): what the proxy forwards is written by it.
MAX_NESTING = 254

# orjson reads an integer outside [-2^63, 2^64) as a float (1e+20): written again, the body
# would carry another number. Only a run of 19 digits can be one (found on a copy of the body
# whose digits are all '0', every other byte a space: a C scan, not a regex's per-byte tries).
_ONLY_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_DIGITS = b"0" * 19
_LEAST_EXACT_INT, _MOST_EXACT_INT = -(2**63), 2**64 - 1

_TokenCount = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)


# A view's kind is told by ``type(view) is ChatBody``, not ``isinstance``: pydantic's model
# classes are ABCs, and every isinstance of a view that is not of the class asked (most of them:
# a call asks of each kind in turn) runs ABCMeta's check, some thousand instructions each, some
# twenty times a call. The body classes are final, so mypy narrows on ``type(view) is`` both ways.
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    model: str = Field(min_length=1, max_length=256)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    # Sent upstream as true (the proxy reads the usage chunk; as it came to an upstream whose
    # stream_usage_option is off) and the chunk stripped unless this is true: anything but a
    # bool is refused, as OpenAI refuses it.
    include_usage: bool | None = None


@final
class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    # Priority or flex processing is priced apart (``service_tiers.rates_for``).
    service_tier: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = _TokenCount
    max_completion_tokens: int | None = _TokenCount
    n: int | None = Field(default=None, ge=1, le=128)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # The legacy form of tools: sent to the model as prompt all the same.
    functions: list[dict[str, Any]] | None = None


@final
class CompletionBody(_Body):
    # Null is the API's "<|endoftext|>": named, but empty.
    prompt: str | list[str] | list[int] | list[list[int]] | None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # From 0 here (OpenAI's spec): with echo and logprobs, a prompt is scored, nothing written.
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)
    n: int | None = Field(default=None, ge=1, le=128)
    # Generated server-side, the best n of them returned: each is billed.
    best_of: int | None = Field(default=None, ge=1, le=128)
    # Insert mode: text after the completion, prompt all the same.
    suffix: str | None = None


def prompts(view: object) -> int:
    """How many prompts one request sends: legacy completions take a list of them (strings, or
    token id lists), each answered n times; a flat list of ids is one prompt."""
    if type(view) is CompletionBody and isinstance(view.prompt, list) and view.prompt:
        return 1 if isinstance(view.prompt[0], int) else len(view.prompt)
    return 1


def _n(view: object) -> int:
    """``n`` where the API has it (validated there); elsewhere a field of that name is only
    passed through (an extra field of any type), and one answer is what comes back."""
    if (type(view) is ChatBody or type(view) is CompletionBody) and view.n is not None:
        return view.n
    return 1


def answers(view: object) -> int:
    """How many answers the client gets back: n for every prompt."""
    return _n(view) * prompts(view)


def generations(view: object) -> int:
    """How many answers the provider writes (and bills) for one request: n, or best_of, for
    every prompt; a compacting Messages request's summary besides its answer (``compacts``: a
    Responses request's ``max_output_tokens`` bounds its whole response, summary and all)."""
    if type(view) is CompletionBody:
        return max(_n(view), view.best_of or 1) * prompts(view)
    if type(view) is MessagesBody and compacts(view):
        return 2
    return _n(view)


def compacts(view: object) -> bool:
    """A Messages request with Anthropic's compaction on: threshold compaction (a ``compact_*``
    edit in ``context_management``: once its input reaches the trigger, a summarizing step reads
    the whole input and writes a summary before the answer, billed beside it,
    ``usage.iterations``), or the beta's compaction request (a top-level ``compaction``: the
    conversation summarized); a Responses request with OpenAI's server-side compaction on (a
    ``compaction`` entry in the list ``context_management`` is: once the context crosses its
    ``compact_threshold``, a pass mid-answer reads it again and writes a summary the answer goes
    on from). Reserved as a second reading of the input and, for Anthropic's, a second answer of
    up to the cap; for OpenAI's, whose ``max_output_tokens`` bounds the whole response, the output
    read again as input (``estimate``)."""
    if type(view) is ResponsesBody:
        management = (view.model_extra or {}).get("context_management")
        return isinstance(management, list) and any(
            isinstance(entry, dict) and entry.get("type") == "compaction" for entry in management
        )
    return type(view) is MessagesBody and bool(_compactions(view))


def _compactions(view: MessagesBody) -> list[dict[str, Any]]:
    """The compaction settings of a Messages request: its ``compact_*`` edits and its top-level
    ``compaction`` (which Anthropic refuses beside ``context_management``: read all the same)."""
    extra = view.model_extra or {}
    management = extra.get("context_management")
    edits = management.get("edits") if isinstance(management, dict) else None
    found = [
        edit
        for edit in (edits if isinstance(edits, list) else ())
        if isinstance(edit, dict) and str(edit.get("type")).startswith("compact_")
    ]
    request = extra.get("compaction")
    if isinstance(request, dict):
        found.append(request)
    return found


def compaction_instructions(view: object) -> list[str]:
    """The summarizing prompts a Messages request's compaction gives (``instructions``: it
    replaces Anthropic's own), which the summarizing step reads beside the input."""
    if type(view) is not MessagesBody:
        return []
    prompts = (found.get("instructions") for found in _compactions(view))
    return [prompt for prompt in prompts if isinstance(prompt, str)]


@final
class EmbeddingBody(_Body):
    input: str | list[str] | list[int] | list[list[int]]


@final
class ResponsesBody(_Body):
    """OpenAI Responses API."""

    # Optional: a stored prompt or a previous response may be all the input there is.
    input: str | list[dict[str, Any]] | None = None
    service_tier: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = _TokenCount
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    background: bool | None = None
    # Read for what the model is sent as prompt: a structured output's schema (text.format) and
    # a stored prompt's variables.
    text: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # What the input continues (stored at the provider) and whether this answer is stored.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    store: bool | None = None


# Anthropic's fast mode (``speed: "fast"``, at several times the price): priced as a tier of
# this name, and only ever the tier of a call that asks for it.
FAST_TIER = "fast"
# Anthropic's US-only inference (``inference_geo: "us"``, 1.1 times every price on the models
# that take it): priced as a tier of this name, and as ``fast-us`` beside fast mode. A workspace
# may make it the default of a call that names no geography (its answer's ``usage`` says).
US_GEO = "us"
US_TIER = "us"
FAST_US_TIER = "fast-us"
# The tiers that serve only the calls that ask for them: never a reserve's guess.
FAST_TIERS = frozenset({FAST_TIER, FAST_US_TIER})


def messages_tier(*, fast: bool, us: bool) -> str | None:
    """The tier a Messages call is priced as: fast mode, US-only inference, both, or the default
    (None)."""
    if fast:
        return FAST_US_TIER if us else FAST_TIER
    return US_TIER if us else None


def messages_tier_served(
    asked: str | None, told: tuple[bool | None, bool | None], *, geo_named: bool, priced: Container[str]
) -> str:
    """The tier that served a Messages call whose answer told whether it ran fast, or in the US,
    not both (``told``: None where not told): the asked tier (``messages_tier``) with what was.
    A geography neither told nor named (``geo_named``) may be the US, a workspace's default, as
    the reserve took it: the US's tier where ``priced``, as an unsure reading bills the more."""
    fast, us = told
    if fast is None:
        fast = asked in FAST_TIERS
    if us is None:
        us = asked in (US_TIER, FAST_US_TIER) or (
            not geo_named and messages_tier(fast=fast, us=True) in priced
        )
    return messages_tier(fast=fast, us=us) or "default"


# A cache breakpoint whose writes are kept an hour (Anthropic's ``cache_control``, whose ``ttl``
# is "5m" unless told), as orjson writes it: compact, and no object inside one.
_HOUR_BREAKPOINT = re.compile(rb'"cache_control":\{[^{}]*"ttl":"1h"')


def asks_hour_cache_writes(body: dict[str, Any]) -> bool:
    """Whether a Messages request may keep cache writes an hour: a ``cache_control`` naming
    ``ttl: "1h"`` anywhere in it (at the top, on a system block, a tool, a message's block)."""
    return _HOUR_BREAKPOINT.search(orjson.dumps(body)) is not None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    # Bounds a clamp of max_tokens (``call.least_cap_accepted``). Anthropic refuses any but an
    # integer (2048.0 included), as the proxy does: one it did not read would let a clamp below.
    budget_tokens: int | None = None


@final
class MessagesBody(_Body):
    """Anthropic Messages API: ``max_tokens`` is required there."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    thinking: Thinking | None = None
    speed: str | None = None
    inference_geo: str | None = None
    system: str | list[dict[str, Any]] | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None


RequestView = ChatBody | CompletionBody | EmbeddingBody | ResponsesBody | MessagesBody

BODY_MODELS: dict[Endpoint, type[_Body]] = {
    "chat.completions": ChatBody,
    "completions": CompletionBody,
    "embeddings": EmbeddingBody,
    "responses": ResponsesBody,
    "messages": MessagesBody,
}


def _describe(err: ValidationError, model: type[_Body]) -> tuple[str, str | None]:
    first = err.errors()[0]
    field = first["loc"][0] if first["loc"] else None
    shapes = _shapes(model, field) if isinstance(field, str) and first["type"] != "missing" else []
    if isinstance(field, str) and len(shapes) > 1:
        # A field of several shapes (a prompt: text or token ids): pydantic tells each branch's
        # error under the branch's name ("prompt.str"), the first of them a client that sent a
        # list is no help with. The field, and every shape it takes, as OpenAI names them.
        return (
            f"Invalid request body: {field}: Input should be {', '.join(shapes[:-1])} or {shapes[-1]}",
            field,
        )
    param = ".".join(str(p) for p in first["loc"]) or None
    # Not pydantic's "or instance of StreamOptions": the client sent JSON, not our classes.
    message = "Input should be an object" if first["type"] == "model_type" else first["msg"]
    return f"Invalid request body: {param or 'body'}: {message}", param


def _shapes(model: type[_Body], field: str) -> list[str]:
    """The shapes a field of ``model`` takes (null aside), as an error names them: none for a
    field of one shape or not the model's."""
    info = model.model_fields.get(field)
    if info is None or get_origin(info.annotation) not in (Union, types.UnionType):
        return []
    return [_shape(member) for member in get_args(info.annotation) if member is not type(None)]


def _shape(kind: Any, plural: bool = False) -> str:
    if get_origin(kind) is list:
        (item,) = get_args(kind) or (Any,)
        return ("arrays of " if plural else "an array of ") + _shape(item, plural=True)
    names = {str: ("a string", "strings"), int: ("an integer", "integers"), dict: ("an object", "objects")}
    singular, many = names.get(get_origin(kind) or kind, ("a value", "values"))
    return many if plural else singular


def parse_body(raw: bytes, endpoint: Endpoint) -> tuple[dict[str, Any], RequestView]:
    """The body as a dict (to forward) and its validated view (to read)."""
    try:
        data = orjson.loads(raw)
    except (ValueError, RecursionError) as err:
        # Bad JSON, bad UTF-8, nesting too deep.
        raise BadRequest(f"The request body is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(data, dict):
        raise BadRequest("The request body must be a JSON object.")
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING:
        # orjson reads 1024 levels but writes MAX_NESTING: a body it could not write again is
        # refused here, not found out by the estimate or by forwarding after the reserve.
        try:
            orjson.dumps(data)
        except TypeError:
            raise BadRequest(f"The request body is nested more than {MAX_NESTING} levels deep.") from None
    try:
        view: Any = BODY_MODELS[endpoint].model_validate(data)
    except ValidationError as err:
        message, param = _describe(err, BODY_MODELS[endpoint])
        raise BadRequest(message, param=param) from None
    if raw.translate(_ONLY_DIGITS).find(_LONG_DIGITS) >= 0:
        # Digits in strings (ids, base64) are no integer; a field the proxy reads was refused
        # above, by name.
        json.loads(raw, parse_int=_exact_int)
    unsupported = _unsupported(data, view)
    if unsupported is not None:
        param, message = unsupported
        raise BadRequest(message, param=param, code="unsupported_parameter")
    return data, view


def _unsupported(data: dict[str, Any], view: Any) -> tuple[str, str] | None:
    """The field of a request the proxy cannot bill that it carries, and why, if it carries one:
    refused (``unsupported_parameter``) before anything is reserved or forwarded."""
    if type(view) is ResponsesBody and view.background:
        # Queued: answered (and billed by the provider) later, to a request this proxy never sees.
        return (
            "background",
            "Background responses are not supported through this proxy: it bills a call from its "
            "answer, and a background response's answer comes later, outside it. Send it without "
            "'background'.",
        )
    template_param = _own_chat_template(data) if type(view) is ChatBody else None
    if template_param is not None:
        # vLLM's own Jinja template for this request: what it writes is no function of the
        # request's text (a loop writes any number of tokens from a few bytes), so no reserve
        # can bound it.
        return (
            template_param,
            "A request's own chat template is not supported through this proxy: it reserves a "
            "call's input before forwarding it, and cannot bound what a template writes. Send "
            f"the request without '{template_param}' (the model's own template applies).",
        )
    if (type(view) is ChatBody or type(view) is CompletionBody) and data.get("n_predict") is not None:
        # llama.cpp's server reads its output cap from n_predict before max_tokens (-1: until the
        # context is full), so the cap the proxy reserves and writes would not be the one it
        # honours. Refused, not bounded: writing a field only one server reads into every path
        # that caps (none asked, one asked, a model's cap, a clamp) is more to get wrong, and
        # max_tokens caps llama.cpp alike.
        return (
            "n_predict",
            "'n_predict' is not supported through this proxy: it reserves a call's output before "
            "forwarding it and caps the call there, and llama.cpp's server would honour "
            "'n_predict' over that cap. Send the cap as 'max_tokens', which it reads when "
            "'n_predict' is absent.",
        )
    fallbacks = data.get("models")
    if fallbacks is not None and (not isinstance(fallbacks, list) or any(m != view.model for m in fallbacks)):
        # OpenRouter's fallback list: another model runs when the first errs (an error a caller
        # can provoke), billed at its own price; one the proxy may not serve nor price at all.
        return (
            "models",
            "A list of fallback models is not supported through this proxy: it routes, reserves and "
            "prices the one model a call names. Send the request without 'models' (name the model "
            "in 'model'; send a second request for another).",
        )
    if type(view) is MessagesBody and data.get("fallbacks") not in (None, []):
        # Anthropic's server-side fallback, the same hole: a model that declines hands the call to
        # an entry's model (or "default": the model's own chain), billed at its own price and
        # writing up to the entry's own max_tokens, where the reserve holds the call's model and
        # cap. Refused, not reserved at the worst entry: a chain the server picks names no model.
        return (
            "fallbacks",
            "Server-side fallback models are not supported through this proxy: it routes, reserves "
            "and prices the one model a call names, and a fallback runs at its own price and its "
            "own 'max_tokens'. Send the request without 'fallbacks' (retry a declined call with "
            "another 'model').",
        )
    advisor_param = _advisor_tool(view) if type(view) is MessagesBody else None
    if advisor_param is not None:
        # Anthropic's advisor tool: mid-answer the model consults another (the tool's ``model``),
        # which reads the whole transcript and writes its advice up to a cap the request may leave
        # to that model, as often as ``max_uses`` lets it, billed at that model's prices and told
        # only in ``usage.iterations``. No reserve of the call's model and cap holds it.
        return (
            advisor_param,
            "The advisor tool is not supported through this proxy: it reserves and prices the one "
            "model a call names, and the advisor is another model, consulted mid-answer at its own "
            "price. Send the request without the 'advisor_*' tool.",
        )
    if type(view) is ResponsesBody and _other_svg_author(view):
        # The image generation tool's SVG author: another model named (``svg.model``) reads the
        # prompt and writes the SVG at its own prices, told only in the call item's ``svg_usage``.
        return (
            "tools",
            "An SVG author of another model is not supported through this proxy: it prices the one "
            "model a call names, and the image generation tool's 'svg.model' writes the SVG at its "
            "own price. Send the tool without 'svg.model', or naming the call's model.",
        )
    if type(view) is CompletionBody and data.get("prompt_embeds"):
        # vLLM's prompt embeddings: each tensor one more prompt beside ``prompt``'s, answered n
        # times, its rows billed as input; no count of them can be read from base64 before the call.
        return (
            "prompt_embeds",
            "Prompt embeddings are not supported through this proxy: it reserves a call's input "
            "and the answers of every prompt before forwarding it, and cannot count the prompts "
            "or tokens of 'prompt_embeds'. Send the prompt as text or token ids.",
        )
    return None


def _advisor_tool(view: MessagesBody) -> str | None:
    """Where a Messages request enables Anthropic's advisor tool (type ``advisor_*``), if it does:
    in ``tools``, or defined in a message (a ``tool_addition`` block's ``tool_definition``, or
    one among a compaction block's ``tool_changes``)."""
    if any(_is_advisor(tool) for tool in view.tools or ()):
        return "tools"
    for message in view.messages:
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict):
                continue
            # A compaction block carries the tool additions of the range it sums up
            # (``tool_changes``), sent back with it: the tool set in force after it.
            changes = block.get("tool_changes") if block.get("type") == "compaction" else None
            for change in [block, *(changes if isinstance(changes, list) else ())]:
                if isinstance(change, dict) and change.get("type") == "tool_addition":
                    tool = change.get("tool")
                    if isinstance(tool, dict) and _is_advisor(tool.get("definition")):
                        return "messages"
    return None


def _other_svg_author(view: ResponsesBody) -> bool:
    """Whether a Responses request's image generation tool names an SVG author (``svg.model``)
    other than the call's model."""
    for tool in view.tools or ():
        svg = tool.get("svg") if tool.get("type") == "image_generation" else None
        author = svg.get("model") if isinstance(svg, dict) else None
        if author is not None and author != view.model:
            return True
    return False


def _is_advisor(tool: Any) -> bool:
    kind = tool.get("type") if isinstance(tool, dict) else None
    return isinstance(kind, str) and kind.startswith("advisor_")


def _exact_int(literal: str) -> int:
    # Longer literals are out of range (and int() refuses 4,300 digits and more).
    if len(literal) <= 20:
        value = int(literal)
        if _LEAST_EXACT_INT <= value <= _MOST_EXACT_INT:
            return value
    raise BadRequest(
        f"The request body holds the integer {literal[:40]}, past the 64 bits this proxy forwards "
        "exactly: send it as a float or a string."
    )


# The fields that cap a request's output, whichever API (chat has two: max_tokens is legacy).
OUTPUT_CAP_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def set_output_cap(body: dict[str, Any], field: str, cap: int) -> None:
    """Cap ``body``'s output at ``cap`` in ``field`` and in any other cap field it carries: an
    upstream honouring the other one must not be let past what was reserved. A cap the client
    set lower stays as it is (chat's two may differ: the reserve covers the larger)."""
    for name in OUTPUT_CAP_FIELDS:
        value = body.get(name)
        # A null one is unset (the SDK sends None as null): giving it a value would send both
        # of chat's caps, which OpenAI refuses.
        if value is None and name != field:
            continue
        lower = isinstance(value, int) and not isinstance(value, bool) and value < cap
        body[name] = value if lower else cap


def _own_chat_template(data: dict[str, Any]) -> str | None:
    """Where a chat request sends a template of its own, if it does: ``chat_template``, or one
    inside ``chat_template_kwargs``, which vLLM hands on to the tokenizer's template call (its own
    check of untrusted request templates looks at both)."""
    if data.get("chat_template") is not None:
        return "chat_template"
    kwargs = data.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("chat_template") is not None:
        return "chat_template_kwargs"
    return None
