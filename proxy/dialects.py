"""The API dialects the proxy bills: where each is forwarded, how its answers are observed and
how errors are written in its own format.

OpenAI chat completions and legacy completions stream ``data:`` chunks ending in ``[DONE]``
and get ``stream_options.include_usage`` injected (unless their upstream refuses it). The
Responses API and Anthropic Messages stream typed events and report usage themselves
(``response.completed`` / ``message_start`` + ``message_delta``); their streams end without
``[DONE]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import web

from proxy.errors import error_object
from proxy.observe import Observation
from proxy.observe_anthropic import anthropic_body, anthropic_event
from proxy.observe_responses import responses_body, responses_event
from proxy.payload import Endpoint

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
            kind = (
                _ANTHROPIC_BY_STATUS.get(status or 0)
                or _ANTHROPIC_BY_CODE.get(code or "")
                or _ANTHROPIC_TYPES.get(error_type, error_type)
            )
            error: dict[str, Any] = {"type": kind, "message": message}
            if code in _ANTHROPIC_ERROR_CODES:  # Anthropic's own (the SDK's ``error_code``)
                error["details"] = {"error_code": code}
            return orjson.dumps({"type": "error", "error": error})
        return orjson.dumps({"error": error_object(message, error_type, param=param, code=code)})

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
    504: "timeout_error",
    529: "overloaded_error",
}
# The proxy's codes that are Anthropic's too, told as its ``error.details.error_code`` (the
# others are OpenAI's, which an Anthropic client would not know).
_ANTHROPIC_ERROR_CODES = frozenset({"thread_not_found"})
# A stream's error event has no status of its own: what failed names the type.
_ANTHROPIC_BY_CODE = {"upstream_timeout": "timeout_error"}
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
        "responses", "openai", "/responses", responses_event, responses_body, False, None, False
    ),
    "messages": Dialect(
        "messages", "anthropic", "/messages", anthropic_event, anthropic_body, False, None, True
    ),
}


def dialect_of_path(path: str) -> Dialect:
    """The dialect an error on ``path`` is written in: Anthropic's for its Messages API and the
    calls under it (count_tokens, batches: the Anthropic SDK's), else OpenAI's."""
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    return DIALECTS["messages" if anthropic else "chat.completions"]


def dialect_of_request(request: web.Request) -> Dialect:
    """``dialect_of_path``, but for ``GET /v1/models``, which both APIs have: the Anthropic
    SDK's calls carry ``anthropic-version`` (OpenAI's never do), its own the only way to tell."""
    if request.path == "/v1/models" and "anthropic-version" in request.headers:
        return DIALECTS["messages"]
    return dialect_of_path(request.path)
