"""The API dialects the proxy bills: where each is forwarded, how its answers are observed and
how errors are written in its own format.

OpenAI chat completions and legacy completions stream ``data:`` chunks ending in ``[DONE]``
and get ``stream_options.include_usage`` injected. The Responses API and Anthropic Messages
stream typed events and report usage themselves (``response.completed`` / ``message_start`` +
``message_delta``); their streams end without ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson
from aiohttp import web

from proxy.observe import Observation, ProviderUsage, parse_usage, token_count
from proxy.payload import FAST_TIER, Endpoint

UpstreamKind = Literal["openai", "anthropic"]
Observer = Callable[[Observation, dict[str, Any]], None]

DONE = b"data: [DONE]\n\n"


# -- OpenAI chat completions and legacy completions ------------------------------------------


def _chat_event(obs: Observation, obj: dict[str, Any]) -> None:
    obs.observe(obj, streaming=True)


def _chat_body(obs: Observation, obj: dict[str, Any]) -> None:
    obs.observe(obj, streaming=False)


def _embeddings_body(obs: Observation, obj: dict[str, Any]) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("prompt_tokens", usage.get("input_tokens")) is None:
        # A total alone (Voyage AI's report) is all input: an embedding writes nothing.
        obj = {**obj, "usage": {**usage, "prompt_tokens": usage.get("total_tokens")}}
    obs.observe(obj, streaming=False)


# -- OpenAI Responses API ---------------------------------------------------------------------


def _responses_output(obs: Observation, response: dict[str, Any], *, texts: bool) -> None:
    """Status, refusals, usage and (for a whole body) the text of a response object."""
    _response_id(obs, response)
    status = response.get("status")
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    if status == "incomplete":
        obs.finish_reasons[0] = str(reason or "incomplete")
    elif isinstance(status, str):
        obs.finish_reasons[0] = status
    if status == "failed":
        obs.error = True
    tier = response.get("service_tier")
    if isinstance(tier, str) and tier:
        obs.service_tier = tier
    usage = parse_usage(response.get("usage"))
    if usage is not None:
        obs.take_usage(_with_image_tokens(usage, response.get("tool_usage")))
    for item in response.get("output") or ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        final = not _side_message(item)
        if _is_call(kind):
            obs.calls.add(0)  # function_call, custom_tool_call, computer_call, ...: not text
            if texts:
                for text in _call_texts(item):
                    obs.add_text(0, text, content=False)
        if kind in _UNCOUNTED_ITEMS:
            obs.hidden_output = True
        if texts and kind == "reasoning":
            # A reasoning item's summary (and its text, where sent): output the provider bills,
            # counted as a stream's reasoning deltas are when no usage comes.
            for part in item.get("summary") or ():
                if isinstance(part, dict):
                    obs.add_text(0, part.get("text"), content=False)
        for part in item.get("content") or ():
            if not isinstance(part, dict):
                continue
            if part.get("type") == "reasoning_text" and texts:
                obs.add_text(0, part.get("text"), content=False)
            elif part.get("type") == "refusal":
                obs.refused = True
                if texts:
                    obs.add_text(0, part.get("refusal"), content=False)
            elif part.get("type") == "output_text" and texts:
                obs.add_text(0, part.get("text"), content=final)


# What the model writes for a call, output it bills: the tool's name, its arguments or input, the
# code interpreter's code, and (see _call_texts) what it writes as a structure. A stream's deltas
# carry all but the name, told whole as the item starts, and the calls that stream none (below).
_CALL_INPUTS = ("arguments", "input", "code")
_CALL_TEXTS = ("name", *_CALL_INPUTS)
# Written as structures, counted as JSON: an action (a command, a search, a click), a computer
# call's batch of actions, a file search's queries, an apply_patch operation (its path and diff).
_CALL_STRUCTURES = ("action", "actions", "queries", "operation")
# Calls told whole in their items (response.output_item.added, then .done), with no deltas; an
# apply_patch operation's diff streams, so it is not among them.
_UNSTREAMED_CALLS = frozenset(
    {"mcp_approval_request", "local_shell_call", "computer_call", "web_search_call", "file_search_call"}
)
# Items whose output tokens no text shows: reasoning (hidden, or summarized) and a generated
# image (its image tokens, and each partial image's, billed; its base64 is not their count).
_UNCOUNTED_ITEMS = frozenset({"reasoning", "image_generation_call"})


def _call_texts(item: dict[str, Any], fields: tuple[str, ...] = _CALL_TEXTS) -> list[Any]:
    """The ``fields`` of a call item, and its structures (``_CALL_STRUCTURES``) as JSON."""
    texts = [item.get(name) for name in fields]
    for name in _CALL_STRUCTURES:
        value = item.get(name)
        if name == "action" and item.get("actions"):
            continue  # a computer call's batch holds every action, a lone one told beside it too
        if isinstance(value, dict) and name == "action":
            # Not what the model wrote: a web search's sources (the tool's results, there when
            # asked for), and its deprecated ``query``, the first of its ``queries`` told again.
            drop = ("sources", "query") if "queries" in value else ("sources",)
            value = {k: v for k, v in value.items() if k not in drop}
        if isinstance(value, dict | list) and value:
            texts.append(orjson.dumps(value).decode())
    return texts


def _is_call(kind: Any) -> bool:
    return isinstance(kind, str) and (kind.endswith("_call") or kind == "mcp_approval_request")


def _with_image_tokens(usage: ProviderUsage, tool_usage: Any) -> ProviderUsage:
    """``usage`` with the image generation tool's tokens, which OpenAI reports apart from it
    (``tool_usage.image_gen``) and bills all the same; priced at the model's rates."""
    image = tool_usage.get("image_gen") if isinstance(tool_usage, dict) else None
    if not isinstance(image, dict):
        return usage
    image_in = token_count(image.get("input_tokens"))
    image_out = token_count(image.get("output_tokens"))
    return replace(
        usage,
        input_tokens=usage.input_tokens + (image_in or 0),
        output_tokens=usage.output_tokens + (image_out or 0),
    )


def _side_message(item: dict[str, Any]) -> bool:
    """A message that is not the answer: commentary before it (``phase``, gpt-5.3-codex on).
    With a structured output only the final answer is JSON (the SDK parses only it)."""
    phase = item.get("phase")
    return item.get("type") == "message" and phase is not None and phase != "final_answer"


def _response_id(obs: Observation, response: dict[str, Any]) -> None:
    found = response.get("id")
    if isinstance(found, str) and found:
        obs.response_id = found


# Deltas that are not text: base64 audio (its tokens are not its characters').
_UNCOUNTED_DELTAS = frozenset({"response.audio.delta", "response.image_generation_call.partial_image"})


def _responses_event(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    kind = obj.get("type")
    if kind == "response.output_text.delta":
        side = obs.side_messages and (
            obj.get("output_index") in obs.side_messages or obj.get("item_id") in obs.side_messages
        )
        obs.add_text(0, obj.get("delta"), content=not side)
    elif kind == "response.output_item.added":
        item = obj.get("item")
        if isinstance(item, dict) and item.get("type") in _UNCOUNTED_ITEMS:
            obs.hidden_output = True  # it thinks, or draws: tokens billed, never streamed as text
        if isinstance(item, dict) and _is_call(item.get("type")):
            obs.add_text(0, item.get("name"), content=False)  # never streamed as a delta
        if isinstance(item, dict) and _side_message(item):
            for key in (obj.get("output_index"), item.get("id")):
                if isinstance(key, int | str) and not isinstance(key, bool):
                    obs.side_messages.add(key)
        elif isinstance(item, dict) and item.get("type") == "message" and item.get("phase") is None:
            # Its phase may be told only once it is done: where its text starts, to take it
            # back out of the answer then (items stream one after another).
            obs.message_starts[obj.get("output_index")] = len(obs.contents.get(0, ()))
    elif kind == "response.output_item.done":
        start = obs.message_starts.pop(obj.get("output_index"), None) if obs.message_starts else None
        item = obj.get("item")
        if isinstance(item, dict) and item.get("type") in _UNSTREAMED_CALLS:
            for text in _call_texts(item, _CALL_INPUTS):  # whole now; its name was counted
                obs.add_text(0, text, content=False)
        if start is not None and isinstance(item, dict) and _side_message(item):
            pieces = obs.contents.get(0, [])
            moved = [p.decode() if isinstance(p, bytes) else p for p in pieces[start:]]
            del pieces[start:]
            obs.extras.setdefault(0, []).extend(moved)
    elif isinstance(kind, str) and kind.endswith(".delta") and kind not in _UNCOUNTED_DELTAS:
        # Refusals, call arguments and inputs, reasoning text and summaries: output tokens too,
        # counted when no usage comes (a cancelled stream, say).
        if kind == "response.refusal.delta":
            obs.refused = True
        elif kind.startswith("response.reasoning_summary"):
            obs.hidden_output = True  # a summary of reasoning that is itself not streamed
        elif "call" in kind:
            obs.calls.add(0)
        obs.add_text(0, obj.get("delta"), content=False)
    elif kind == "response.created":
        response = obj.get("response")
        if isinstance(response, dict):
            _response_id(obs, response)  # a stream cut after it leaves a response a call can continue
    elif kind in ("response.completed", "response.incomplete", "response.failed"):
        response = obj.get("response")
        if isinstance(response, dict):
            _responses_output(obs, response, texts=False)
        if kind == "response.failed":
            obs.error = True
        obs.done = True
    elif kind == "error":
        obs.error = True


# A whole response body in these states is not the answer yet (OpenAI's background mode).
_NOT_DONE = frozenset({"queued", "in_progress"})


def _responses_body(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    _responses_output(obs, obj, texts=True)
    if isinstance(obj.get("error"), dict):  # a 200 that says it failed (a response has "error": null)
        obs.error = True
    if obj.get("status") in _NOT_DONE:
        # Queued (background mode: refused up front, but an upstream may queue on its own): the
        # answer is written, and billed, later, outside this call. Nothing to count: its reserve.
        obs.error = True


# -- Anthropic Messages -----------------------------------------------------------------------


def anthropic_usage(raw: Any) -> ProviderUsage | None:
    """Anthropic's ``input_tokens`` leaves out cache reads and writes; ours includes them. Any
    count that is not one makes the whole unusable (None), as OpenAI usage is: the text is then
    counted, never billed as 0."""
    if not isinstance(raw, dict):
        return None
    counts = _anthropic_counts(raw)
    iterations = raw.get("iterations")
    if counts is None or (iterations is not None and not isinstance(iterations, list)):
        return None
    input_tokens, output_tokens, cache_read, cache_creation, hour = counts
    # Context compaction (a beta the client turns on): the summarizing step is billed too, and
    # is left out of the top-level figures; every other iteration is in them.
    for iteration in iterations or ():
        if isinstance(iteration, dict) and iteration.get("type") == "compaction":
            more = _anthropic_counts(iteration)
            if more is None or more[1] is None:
                return None
            input_tokens += more[0]
            if output_tokens is not None:  # else the final figures are still to come
                output_tokens += more[1]
            cache_read += more[2]
            cache_creation += more[3]
            hour += more[4]
    return ProviderUsage(
        input_tokens=input_tokens + cache_read + cache_creation,
        output_tokens=output_tokens or 0,
        cached_input_tokens=cache_read,
        reasoning_tokens=0,
        cache_creation_input_tokens=cache_creation,
        cache_creation_1h_input_tokens=min(hour, cache_creation),
        output_known=output_tokens is not None,
    )


def _anthropic_counts(raw: dict[str, Any]) -> tuple[int, int | None, int, int, int] | None:
    """Input, output (None: not given yet), cache reads, cache writes, and the writes kept an
    hour; None when a count is not one."""
    input_tokens = token_count(raw.get("input_tokens"))
    given = raw.get("output_tokens")
    output_tokens = None if given is None else token_count(given)
    # Cache fields may be absent or null: none of that kind.
    cache_read = token_count(raw.get("cache_read_input_tokens") or 0)
    cache_creation = token_count(raw.get("cache_creation_input_tokens") or 0)
    # Writes kept an hour cost more than those kept five minutes: their share of the writes.
    split = raw.get("cache_creation")
    hour = token_count((split.get("ephemeral_1h_input_tokens") if isinstance(split, dict) else None) or 0)
    if input_tokens is None or cache_read is None or cache_creation is None or hour is None:
        return None
    if given is not None and output_tokens is None:
        return None
    return input_tokens, output_tokens, cache_read, cache_creation, hour


# Blocks that are calls of a tool (the client's, or one Anthropic runs), not text.
_ANTHROPIC_CALLS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})


def _anthropic_event(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict):
            if delta.get("type") == "text_delta":
                obs.add_text(0, delta.get("text"), content=True)
            elif delta.get("type") == "compaction_delta":  # the context's summary: output too
                obs.add_text(0, delta.get("content"), content=False)
            else:  # tool input, thinking: output tokens too (a citation's cited text is not)
                for key in ("partial_json", "thinking"):
                    obs.add_text(0, delta.get(key), content=False)
    elif kind == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict) and block.get("type") in _ANTHROPIC_CALLS:
            obs.calls.add(0)  # an answer that is a call: not text held to JSON
            obs.add_text(0, block.get("name"), content=False)  # written, not streamed as a delta
        elif isinstance(block, dict) and block.get("type") == "compaction":
            obs.add_text(0, block.get("content"), content=False)  # a summary may come whole here
    elif kind == "message_start":
        message = obj.get("message")
        if isinstance(message, dict) and isinstance(message.get("usage"), dict):
            obs.partial_usage.update(message["usage"])
            _anthropic_tier(obs, message["usage"])
            obs.usage = anthropic_usage(obs.partial_usage)
            obs.usage_final = False  # output_tokens arrives with message_delta
    elif kind == "message_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
            obs.finish_reasons[0] = delta["stop_reason"]
            if delta["stop_reason"] == "refusal":
                obs.refused = True
        if isinstance(obj.get("usage"), dict):
            _take_delta_usage(obs.partial_usage, obj["usage"])
            _anthropic_tier(obs, obj["usage"])
            obs.usage = anthropic_usage(obs.partial_usage)
            # Final only with an output count of its own (message_start's is a placeholder), and
            # once the answer has stopped: a message_delta before the one with the stop reason
            # (a turn with server tools may send several) tells the output so far.
            told = token_count(obj["usage"].get("output_tokens")) is not None
            obs.output_told = obs.output_told or told
            obs.usage_final = told and 0 in obs.finish_reasons
    elif kind == "message_stop":
        obs.done = True
        # The answer is whole: the last output count told is final, its stop reason sent with
        # it, in a later message_delta, or never (gateways that translate another API's stream).
        obs.usage_final = obs.usage_final or obs.output_told
    elif kind == "error":
        obs.error = True


# Input counts message_delta repeats from message_start (or grows: a server tool's results read).
_CUMULATIVE_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def _take_delta_usage(held: dict[str, Any], usage: dict[str, Any]) -> None:
    """message_delta's usage over what message_start told. Its counts are cumulative: a 0 below
    the count held is a placeholder (upstreams that tell the input in message_start alone:
    SGLang's Anthropic API, gateways), not the input shrinking; the held one stands. Any other
    count is the final one, lower too (message_start's may be an estimate: NVIDIA Dynamo's, the
    whole prompt, its cache reads among it). Not beside compaction's ``iterations``, where the
    top-level counts are a part of the whole."""
    given = {k: v for k, v in usage.items() if v is not None}
    if "iterations" not in given:
        for key in _CUMULATIVE_INPUT:
            if key in given:
                given[key] = _cumulative(held.get(key), given[key])
        split, held_split = given.get("cache_creation"), held.get("cache_creation")
        if isinstance(split, dict) and isinstance(held_split, dict):
            given["cache_creation"] = {
                **held_split,
                **{k: _cumulative(held_split.get(k), v) for k, v in split.items()},
            }
    held.update(given)


def _cumulative(held: Any, given: Any) -> Any:
    return held if token_count(given) == 0 and token_count(held) else given


def _anthropic_tier(obs: Observation, usage: Any) -> None:
    """The tier Anthropic says served the call (its "standard" is the default's prices); fast
    mode (``usage.speed``) is priced as a tier of its own, ``fast``."""
    if not isinstance(usage, dict):
        return
    tier = usage.get("service_tier")
    if usage.get("speed") == "fast":
        obs.service_tier = FAST_TIER
    elif isinstance(tier, str) and tier:
        obs.service_tier = "default" if tier == "standard" else tier


def _anthropic_body(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    if obj.get("type") == "error" or isinstance(obj.get("error"), dict):  # a gateway's OpenAI shape
        obs.error = True
        return
    reason = obj.get("stop_reason")
    if isinstance(reason, str):
        obs.finish_reasons[0] = reason
        if reason == "refusal":
            obs.refused = True
    for block in obj.get("content") or ():
        if isinstance(block, dict):
            if block.get("type") == "text":
                obs.add_text(0, block.get("text"), content=True)
            elif block.get("type") in _ANTHROPIC_CALLS:
                obs.calls.add(0)
                obs.add_text(0, block.get("name"), content=False)
                obs.add_text(0, orjson.dumps(block.get("input")).decode(), content=False)
            elif block.get("type") == "thinking":
                obs.add_text(0, block.get("thinking"), content=False)
            elif block.get("type") == "compaction":  # the summary compaction wrote: billed output
                obs.add_text(0, block.get("content"), content=False)
    _anthropic_tier(obs, obj.get("usage"))
    obs.usage = anthropic_usage(obj.get("usage"))
    obs.usage_final = obs.usage is None or obs.usage.output_known


# -- the table --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dialect:
    endpoint: Endpoint
    upstream_kind: UpstreamKind
    path: str
    observe_event: Observer
    observe_body: Observer
    injects_usage: bool  # stream_options.include_usage is set on its streams
    done_marker: bytes | None  # written after the billing comment
    anthropic_errors: bool

    def id_headers(self, request_id: str) -> dict[str, str]:
        """The proxy's id of the call, where the client's SDK reads it (OpenAI's x-request-id;
        Anthropic's SDK reads request-id)."""
        if self.anthropic_errors:
            return {"x-request-id": request_id, "request-id": request_id}
        return {"x-request-id": request_id}

    def error_body(
        self,
        message: str,
        error_type: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
    ) -> bytes:
        if self.anthropic_errors:
            kind = _ANTHROPIC_BY_STATUS.get(status or 0) or _ANTHROPIC_TYPES.get(error_type, error_type)
            return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
        return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})

    def error_response(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> web.Response:
        body = self.error_body(message, error_type, code=code, param=param, status=status)
        return web.Response(status=status, body=body, content_type="application/json", headers=headers)

    def error_event(self, message: str, error_type: str, code: str) -> bytes:
        if self.endpoint == "responses":
            payload = orjson.dumps(
                {
                    "type": "error",
                    "code": code,
                    "message": message,
                    "param": None,
                    "error": {"type": error_type, "code": code, "message": message},
                }
            )
        else:
            payload = self.error_body(message, error_type, code=code)
        return b"event: error\ndata: " + payload + b"\n\n"


_ANTHROPIC_BY_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}
_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "insufficient_quota": "rate_limit_error",
    "permission_denied": "permission_error",
    "upstream_error": "api_error",
    "service_unavailable": "overloaded_error",
    "server_error": "api_error",
}

DIALECTS: dict[Endpoint, Dialect] = {
    "chat.completions": Dialect(
        "chat.completions", "openai", "/chat/completions", _chat_event, _chat_body, True, DONE, False
    ),
    "completions": Dialect(
        "completions", "openai", "/completions", _chat_event, _chat_body, True, DONE, False
    ),
    "embeddings": Dialect(
        "embeddings", "openai", "/embeddings", _chat_event, _embeddings_body, False, None, False
    ),
    "responses": Dialect(
        "responses", "openai", "/responses", _responses_event, _responses_body, False, None, False
    ),
    "messages": Dialect(
        "messages", "anthropic", "/messages", _anthropic_event, _anthropic_body, False, None, True
    ),
}


def dialect_of_path(path: str) -> Dialect:
    """The dialect an error on ``path`` is written in: Anthropic's for its Messages API and the
    calls under it (count_tokens, batches: the Anthropic SDK's), else OpenAI's."""
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    return DIALECTS["messages" if anthropic else "chat.completions"]
