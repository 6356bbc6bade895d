"""Responses API and Anthropic Messages wire formats of ``tests.fake_upstream.FakeUpstream``.

Steered like the rest of the fake by the body field ``"fake": {...}``; shared keys are
content, chunk_chars, reply_tokens, finish_reasons, usage (deep-merged into the usage
object sent and billed), no_usage (usage not sent, still billed), chunk_delay_s, keepalive,
after_chunks (default 2), stall_s (default 30), status and error_body (json | text | none).

POST /v1/responses  (auth ``Authorization: Bearer <key>``; OpenAI error bodies)
  prompt = words of ``input`` (string, or items whose ``content`` is a string or text parts;
  +3 per item with a ``role``) + words of ``instructions``; output is capped by
  ``max_output_tokens``.  delay_s and hold (until ``FakeUpstream.release()``) as for chat.
  modes: ok | truncate (incomplete, max_output_tokens) | content_filter (half the reply,
  incomplete, content_filter) | refusal (a ``refusal`` content part) | failed | error |
  stall_before_headers | stall_mid_stream | cut | malformed_sse | no_done | non_json
  failed: after ``after_chunks`` deltas the stream ends with ``response.failed`` (status
  failed, error server_error, output [] and usage null unless the ``usage`` key is given);
  without streaming it is an HTTP 200 body with status "failed" built the same way. Billed:
  prompt + the deltas sent.  no_done: the terminal response.* event is left out.
  Stream: response.created, response.in_progress, response.output_item.added,
  response.content_part.added, response.output_text.delta (response.refusal.delta) per
  piece, response.output_text.done (response.refusal.done), response.content_part.done,
  response.output_item.done, response.completed | response.incomplete; no [DONE].

POST /v1/messages  (auth ``x-api-key: <key>`` or ``Authorization: Bearer <key>``, which the
  anthropic 2.x SDK sends for api_key; otherwise 401 authentication_error; a missing
  ``anthropic-version`` header is a 400 invalid_request_error as on the real API)
  max_tokens is required (400 invalid_request_error).  input_tokens = words of ``system``
  + words of each message's content + 3 per message; cache tokens only via ``usage``
  (cache_creation_input_tokens / cache_read_input_tokens; not part of input_tokens).
  modes: ok (end_turn) | truncate (max_tokens) | refusal (stop_reason refusal) |
  error_mid_stream | error | stall_before_headers | stall_mid_stream | cut |
  malformed_sse | no_done | non_json.  ``stop_reason`` overrides the stop reason.
  error_mid_stream: after ``after_chunks`` deltas ``event: error`` (overloaded_error) and the
  stream ends; billed input + the deltas sent.  Without streaming it is a 529
  overloaded_error, billed like mode=error (only when ``usage`` is given).
  full_delta_usage: message_delta usage also carries input and cache token counts.
  no_done: message_stop is left out.  keepalive: an extra ``ping`` between deltas.
  Stream: message_start, content_block_start, ping, content_block_delta per piece,
  content_block_stop, message_delta, message_stop.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tests.fake_upstream import BillEntry, JsonDict, _dumps, _merge, _Plan, _words, error_response

if TYPE_CHECKING:
    from tests.fake_upstream import FakeUpstream

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
FAILED_MESSAGE = "The model failed to generate a response (fake)."
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
Ops = list[tuple[str, str]]  # (kind, wire text); kind "trigger" marks the stall/cut/malformed point


def _sse(event: str, obj: JsonDict) -> str:
    return f"event: {event}\ndata: {_dumps(obj)}\n\n"


def _control(body: JsonDict) -> JsonDict:
    return body["fake"] if isinstance(body.get("fake"), dict) else {}


def _merged_usage(usage: JsonDict, ctl: JsonDict, total: tuple[str, str] | None) -> JsonDict:
    extra = ctl.get("usage")
    if isinstance(extra, dict):
        usage = _merge(usage, extra)
        if total is not None and "total_tokens" not in extra:
            usage["total_tokens"] = int(usage.get(total[0]) or 0) + int(usage.get(total[1]) or 0)
    return usage


def _num(usage: JsonDict | None, key: str, sub: str | None = None) -> int:
    value: Any = usage.get(key) if isinstance(usage, dict) else None
    if sub is not None:
        value = value.get(sub) if isinstance(value, dict) else None
    return int(value or 0)


async def answer(host: FakeUpstream, request: web.Request, body: Any) -> web.StreamResponse:
    if request.path == MESSAGES_PATH:
        return await _messages(host, request, body)
    return await _responses(host, request, body)


async def _reply_json(
    host: FakeUpstream, request: web.Request, payload: JsonDict, headers: dict[str, str], mode: str
) -> web.StreamResponse:
    raw = _dumps(payload).encode()
    if mode != "cut":
        return web.Response(body=raw, content_type="application/json", headers=headers)
    resp = web.StreamResponse(headers={"Content-Type": "application/json", **headers})
    resp.content_length = len(raw)
    await resp.prepare(request)
    await resp.write(raw[: len(raw) // 2])
    host._cut(request)
    return resp


def _trigger(ops: Ops, mode: str, deltas_before: int, malformed: str) -> None:
    """Mark where stall_mid_stream / cut / malformed_sse strike: after that many deltas."""
    if mode not in ("stall_mid_stream", "cut", "malformed_sse"):
        return
    at = [k for k, op in enumerate(ops) if op[0] == "delta"]
    k = min(deltas_before, len(at))
    pos = at[k - 1] + 1 if k else next(i for i, op in enumerate(ops) if op[0] == "delta_start")
    ops.insert(pos, ("trigger", malformed))


async def _play(
    host: FakeUpstream, request: web.Request, headers: dict[str, str], ops: Ops, ctl: JsonDict
) -> web.StreamResponse:
    mode = str(ctl.get("mode", "ok"))
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    delay = float(ctl.get("chunk_delay_s", 0))
    try:
        for idx, (kind, data) in enumerate(ops):
            if kind == "trigger":
                if mode == "cut":
                    host._cut(request)
                    return resp
                if mode == "stall_mid_stream":
                    await asyncio.sleep(float(ctl.get("stall_s", 30)))
                else:
                    await resp.write(data.encode())
                continue
            if idx and delay:
                await asyncio.sleep(delay)
            await resp.write(data.encode())
        if ctl.get("tail_delay_s"):
            await asyncio.sleep(float(ctl["tail_delay_s"]))  # slow to close after its last event
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


def _plan(host: FakeUpstream, cap: Any, ctl: JsonDict) -> _Plan:
    return host._plan({"max_tokens": cap}, ctl, True)


def _bill(host: FakeUpstream, no: int, path: str, model: str, stream: bool, mode: str, **toks: int) -> None:
    host.bill.append(
        BillEntry(
            no,
            path,
            model,
            stream,
            toks.get("prompt", 0),
            toks.get("completion", 0),
            toks.get("cached", 0),
            toks.get("reasoning", 0),
            mode,
            toks.get("cache_creation", 0),
            toks.get("cache_read", 0),
        )
    )


def _error_mode(
    ctl: JsonDict, headers: dict[str, str], json_error: Any, default_status: int = 500
) -> web.Response:
    status = int(ctl.get("status", default_status))
    kind = ctl.get("error_body", "json")
    if kind == "text":
        return web.Response(status=status, text="upstream exploded", headers=headers)
    if kind == "none":
        return web.Response(status=status, headers=headers)
    resp: web.Response = json_error(status)
    return resp


# -- OpenAI Responses API ----------------------------------------------------------------------


def _responses_prompt(body: JsonDict) -> int:
    total = _words(body.get("instructions"))
    inp = body.get("input")
    if isinstance(inp, str):
        return total + _words(inp)
    for item in inp if isinstance(inp, list) else []:
        if isinstance(item, dict):
            total += _words(item.get("content")) + (3 if "role" in item else 0)
    return total


def _code_container(host: FakeUpstream, body: JsonDict, no: int) -> tuple[str, str] | web.Response | None:
    """The container a Responses call's code runs in, and the tool's type: the one its tool names
    (a code interpreter's ``container`` id, a shell tool's ``container_reference``; an error for
    one not kept), a new one for ``{"type": "auto"}`` (``container_auto``), or None without
    either tool."""
    for tool in body.get("tools") if isinstance(body.get("tools"), list) else []:
        if not isinstance(tool, dict) or tool.get("type") not in ("code_interpreter", "shell"):
            continue
        if tool["type"] == "shell":
            env = tool.get("environment")
            if not isinstance(env, dict) or env.get("type") not in ("container_auto", "container_reference"):
                continue  # a local shell: the client runs it
            named = env.get("container_id") if env.get("type") == "container_reference" else None
        else:
            named = tool.get("container")
        if isinstance(named, str):
            if named not in host.containers:
                return error_response(404, f"Container with id '{named}' not found.")
            return named, tool["type"]
        return f"cntr_{no}", tool["type"]
    return None


def _item_references(body: JsonDict) -> list[str]:
    """The stored items an input names by id, as OpenAI reads them: an ``item_reference`` (its
    type may be left out), a reasoning item without its encrypted content, an image of the
    image generation tool without its result, a typed item of its id alone."""
    found = []
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        kind = item.get("type")
        if (
            kind == "item_reference"
            or (kind is None and "role" not in item and "content" not in item)
            or (kind == "reasoning" and not item.get("encrypted_content"))
            or (kind == "image_generation_call" and not item.get("result"))
            or (kind is not None and item.keys() <= {"type", "id", "status"})
        ):
            found.append(item["id"])
    return found


def _response_id(body: JsonDict, no: int) -> str:
    """``resp_<n>``; ``fake.id_prefix`` another prefix (a gateway's ids: long, base64)."""
    return f"{_control(body).get('id_prefix', 'resp_')}{no}"


def _response_object(
    body: JsonDict, no: int, created: int, status: str, output: list[JsonDict], usage: JsonDict | None
) -> JsonDict:
    return {
        "id": _response_id(body, no),
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": str(body.get("model", "")),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": None,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": None,
        # As OpenAI answers: the tier that served the call (the one asked for, here).
        "service_tier": body.get("service_tier")
        if body.get("service_tier") in ("priority", "flex")
        else "default",
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": 0,
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": body.get("metadata") or {},
    }


def _part(refusal: bool, text: str) -> JsonDict:
    if refusal:
        return {"type": "refusal", "refusal": text}
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


async def _responses(host: FakeUpstream, request: web.Request, body: Any) -> web.StreamResponse:
    if host.api_key is not None and request.headers.get("Authorization") != f"Bearer {host.api_key}":
        return error_response(401, "Incorrect API key provided.", code="invalid_api_key")
    if not isinstance(body, dict):
        return error_response(400, "We could not parse the JSON body of your request.")
    ctl = _control(body)
    mode = str(ctl.get("mode", "ok"))
    host._counter += 1
    no = host._counter
    model, stream = str(body.get("model", "")), bool(body.get("stream"))
    headers = {"x-request-id": f"req_{no}"}
    plan = _plan(host, body.get("max_output_tokens"), ctl)
    pieces = plan.pieces
    if mode == "failed":
        pieces = pieces[: max(0, int(ctl.get("after_chunks", 2)))]
    previous, conversation = body.get("previous_response_id"), body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    # As OpenAI refuses an id it keeps nothing under: a previous response with a 400 of its own
    # code, a conversation with a 404.
    if previous is not None and previous not in host.contexts:
        return error_response(
            400,
            f"Previous response with id '{previous}' not found.",
            code="previous_response_not_found",
            headers=headers,
            param="previous_response_id",
        )
    if conversation is not None and conversation not in host.contexts:
        return error_response(
            404, f"Conversation with id '{conversation}' not found.", headers=headers, param="conversation"
        )
    ran_in = _code_container(host, body, no)
    if isinstance(ran_in, web.Response):
        return ran_in
    container, tool_type = ran_in if ran_in is not None else (None, None)
    named = _item_references(body)
    for ref in named:
        if ref not in host.items:
            return error_response(404, f"Item with id '{ref}' not found.", headers=headers, param="input")
    # The context it continues, and the stored items it names, are input again, as OpenAI bills them.
    prompt = _responses_prompt(body) + sum(host.contexts[k] for k in (previous, conversation) if k)
    prompt += sum(host.items[ref] for ref in named)
    usage: JsonDict = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": len(pieces),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + len(pieces),
    }
    usage = _merged_usage(usage, ctl, ("input_tokens", "output_tokens"))
    if mode != "error" or isinstance(ctl.get("usage"), dict):
        toks = {
            "prompt": _num(usage, "input_tokens"),
            "completion": _num(usage, "output_tokens"),
            "cached": _num(usage, "input_tokens_details", "cached_tokens"),
            "reasoning": _num(usage, "output_tokens_details", "reasoning_tokens"),
            "cache_creation": _num(usage, "input_tokens_details", "cache_write_tokens"),
        }
        _bill(host, no, request.path, model, stream, mode, **toks)
    if ctl.get("delay_s"):
        await asyncio.sleep(float(ctl["delay_s"]))
    if ctl.get("hold"):
        await host._released.wait()  # FakeUpstream.release()
    if mode == "stall_before_headers":
        await asyncio.sleep(float(ctl.get("stall_s", 30)))
    if mode == "error":
        message = "The fake upstream failed on purpose."
        return _error_mode(ctl, headers, lambda s: error_response(s, message, headers=headers))
    if mode == "non_json":
        return web.Response(body=b"<html>oops</html>", content_type="application/json", headers=headers)
    if mode not in ("failed", "error"):
        context = _num(usage, "input_tokens") + _num(usage, "output_tokens")
        if body.get("store") is not False:
            host.contexts[_response_id(body, no)] = context
            host.items[f"msg_{no}"] = len(pieces)
        if conversation:
            host.contexts[str(conversation)] = context
    sent_usage = None if ctl.get("no_usage") else usage
    finish = plan.finish[0]
    status, reason = "completed", None
    if mode == "failed":
        status, sent_usage = "failed", usage if isinstance(ctl.get("usage"), dict) else None
    elif finish in ("length", "content_filter"):
        status, reason = "incomplete", "max_output_tokens" if finish == "length" else "content_filter"
    created = int(time.time())
    text = "".join(pieces)
    item: JsonDict = {
        "id": f"msg_{no}",
        "type": "message",
        "status": "completed" if status == "completed" else "incomplete",
        "content": [_part(plan.refusal, text)],
        "role": "assistant",
    }
    # A code interpreter's call first (its container told), then the message.
    ran: JsonDict | None = None
    if container is not None:
        host.containers.add(container)
        ran = {
            "id": f"ci_{no}",
            "type": "code_interpreter_call",
            "status": "completed",
            "code": "print(1)",
            "container_id": container,
            "outputs": None,
        }
        if tool_type == "shell":  # OpenAI's shell_call: its container in its environment
            ran = {
                "id": f"sh_{no}",
                "type": "shell_call",
                "call_id": f"call_sh_{no}",
                "status": "completed",
                "action": {"commands": ["ls"], "max_output_length": None, "timeout_ms": None},
                "environment": {"type": "container_reference", "container_id": container},
            }
    output = ([ran] if ran else []) + [item]
    final = _response_object(body, no, created, status, [] if mode == "failed" else output, sent_usage)
    if reason is not None:
        final["incomplete_details"] = {"reason": reason}
    if mode == "failed":
        final["error"] = {"code": "server_error", "message": FAILED_MESSAGE}
    if not stream:
        return await _reply_json(host, request, final, headers, mode)

    ops: Ops = []
    seq = iter(range(1 << 30))

    def emit(kind: str, etype: str, **fields: Any) -> None:
        ops.append((kind, _sse(etype, {"type": etype, "sequence_number": next(seq), **fields})))

    started = _response_object(body, no, created, "in_progress", [], None)
    emit("event", "response.created", response=started)
    emit("event", "response.in_progress", response=started)
    if ran is not None:
        emit("event", "response.output_item.added", output_index=0, item={**ran, "status": "in_progress"})
        emit("event", "response.output_item.done", output_index=0, item=ran)
    at = len(output) - 1
    emit(
        "event",
        "response.output_item.added",
        output_index=at,
        item={**item, "status": "in_progress", "content": []},
    )
    where = {"item_id": item["id"], "output_index": at, "content_index": 0}
    emit("delta_start", "response.content_part.added", **where, part=_part(plan.refusal, ""))
    kind = "refusal" if plan.refusal else "output_text"
    extra: JsonDict = {} if plan.refusal else {"logprobs": []}
    for k, piece in enumerate(pieces):
        if k and ctl.get("keepalive"):
            ops.append(("keepalive", ": keep-alive\n\n"))
        emit("delta", f"response.{kind}.delta", **where, delta=piece, **extra)
    if mode != "failed":
        emit(
            "event",
            f"response.{kind}.done",
            **where,
            **{"refusal" if plan.refusal else "text": text},
            **extra,
        )
        emit("event", "response.content_part.done", **where, part=item["content"][0])
        emit("event", "response.output_item.done", output_index=at, item=item)
    if mode != "no_done":
        emit("event", f"response.{status}", response=final)
    malformed = f"event: response.{kind}.delta\ndata: {{not json\n\n"
    _trigger(ops, mode, int(ctl.get("after_chunks", 2)), malformed)
    return await _play(host, request, headers, ops, ctl)


# -- Anthropic Messages API ----------------------------------------------------------------------


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    etype = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": etype, "message": message}}
    return web.Response(
        status=status, body=_dumps(body).encode(), content_type="application/json", headers=headers
    )


def _messages_prompt(body: JsonDict) -> int:
    msgs: list[Any] = body["messages"]
    return _words(body.get("system")) + sum(_words(m.get("content")) + 3 for m in msgs if isinstance(m, dict))


async def _messages(host: FakeUpstream, request: web.Request, body: Any) -> web.StreamResponse:
    given = (request.headers.get("x-api-key"), request.headers.get("Authorization"))
    if host.api_key is not None and given[0] != host.api_key and given[1] != f"Bearer {host.api_key}":
        return anthropic_error(401, "invalid x-api-key")
    if "anthropic-version" not in request.headers:
        return anthropic_error(400, "anthropic-version: header is required")
    if not isinstance(body, dict):
        return anthropic_error(400, "There was an issue with the format of your request: invalid JSON")
    if not isinstance(body.get("max_tokens"), int):
        return anthropic_error(400, "max_tokens: Field required")
    if not isinstance(body.get("messages"), list):
        return anthropic_error(400, "messages: Field required")
    ctl = _control(body)
    mode = str(ctl.get("mode", "ok"))
    host._counter += 1
    no = host._counter
    model, stream = str(body.get("model", "")), bool(body.get("stream"))
    headers = {"x-request-id": f"req_{no}", "request-id": f"req_{no}"}
    plan = _plan(host, body["max_tokens"], {**ctl, "mode": "ok"} if mode == "content_filter" else ctl)
    pieces = plan.pieces
    broken = mode == "error_mid_stream" and stream
    if broken:
        pieces = pieces[: max(0, int(ctl.get("after_chunks", 2)))]
    named = body.get("container")
    named = named.get("id") if isinstance(named, dict) else named
    if isinstance(named, str) and named not in host.containers:
        return anthropic_error(404, f"Container with id '{named}' not found.", headers)
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    runs_code = any(
        isinstance(t, dict) and str(t.get("type", "")).startswith("code_execution") for t in tools
    )
    # The container its code runs in: the one named, or a new one (kept for later calls).
    container = named if isinstance(named, str) else f"container_{no}" if runs_code else None
    prompt = _messages_prompt(body)
    usage: JsonDict = {
        "input_tokens": prompt,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": len(pieces),
    }
    usage = _merged_usage(usage, ctl, None)
    if mode not in ("error", "error_mid_stream") or broken or isinstance(ctl.get("usage"), dict):
        toks = {
            "prompt": _num(usage, "input_tokens"),
            "completion": len(pieces) if broken else _num(usage, "output_tokens"),
            "cache_creation": _num(usage, "cache_creation_input_tokens"),
            "cache_read": _num(usage, "cache_read_input_tokens"),
        }
        _bill(host, no, request.path, model, stream, mode, **toks)
    if mode == "stall_before_headers":
        await asyncio.sleep(float(ctl.get("stall_s", 30)))
    if mode == "error" or (mode == "error_mid_stream" and not stream):
        default = 529 if mode == "error_mid_stream" else 500
        why = "Overloaded" if mode == "error_mid_stream" else "The fake upstream failed on purpose."
        return _error_mode(ctl, headers, lambda s: anthropic_error(s, why, headers), default)
    if mode == "non_json":
        return web.Response(body=b"<html>oops</html>", content_type="application/json", headers=headers)
    stop_reason = "refusal" if plan.refusal else STOP_REASONS.get(plan.finish[0], "end_turn")
    stop_reason = str(ctl.get("stop_reason", stop_reason))
    text = "".join(pieces)
    message: JsonDict = {
        "id": f"msg_{no}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }
    if container is not None:
        host.containers.add(container)
        message["container"] = {"id": container, "expires_at": "2026-12-03T20:00:00Z"}
    if ctl.get("no_usage"):
        del message["usage"]
    if not stream:
        return await _reply_json(host, request, message, headers, mode)

    start: JsonDict = {**message, "content": [], "stop_reason": None}
    start.pop("container", None)  # told with the stop
    if "usage" in start:
        start["usage"] = {**usage, "output_tokens": 1}
    ops: Ops = [
        ("event", _sse("message_start", {"type": "message_start", "message": start})),
        (
            "event",
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            ),
        ),
        ("delta_start", _sse("ping", {"type": "ping"})),
    ]
    for k, piece in enumerate(pieces):
        if k and ctl.get("keepalive"):
            ops.append(("keepalive", _sse("ping", {"type": "ping"})))
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
        ops.append(("delta", _sse("content_block_delta", delta)))
    if broken:
        error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        ops.append(("event", _sse("error", error)))
    else:
        ops.append(("event", _sse("content_block_stop", {"type": "content_block_stop", "index": 0})))
        end: JsonDict = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        }
        if container is not None:  # told with the stop, as Anthropic streams it
            end["delta"]["container"] = message["container"]
        if not ctl.get("no_usage"):
            end["usage"] = (
                dict(usage) if ctl.get("full_delta_usage") else {"output_tokens": usage["output_tokens"]}
            )
        ops.append(("event", _sse("message_delta", end)))
        if mode != "no_done":
            ops.append(("event", _sse("message_stop", {"type": "message_stop"})))
    _trigger(ops, mode, int(ctl.get("after_chunks", 2)), "event: content_block_delta\ndata: {not json\n\n")
    return await _play(host, request, headers, ops, ctl)
