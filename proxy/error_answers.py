"""Errors answered in the format of the API called (OpenAI's, or Anthropic's): the middleware's,
and those of requests aiohttp's HTTP parser refuses before any middleware."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, http_exceptions, http_parser, web, web_protocol
from aiohttp.base_protocol import BaseProtocol
from aiohttp.streams import StreamReader

from proxy.dialects import Dialect, dialect_of_request
from proxy.errors import ApiError, BodyTooLarge, StoreError, StoreUnavailable, error_object
from proxy.ids import REQUEST_ID, request_id_for
from proxy.state import STATE

log = logging.getLogger("proxy.app")


_PLAIN_HANDLE_ERROR = web_protocol.RequestHandler.handle_error


class HeadTooLarge(http_exceptions.BadHttpMessage):
    """A request head past what the parser may hold of one (``_HeadBoundParser``)."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"The request line and headers exceed {limit_bytes} bytes.")


class TrailersTooLarge(http_exceptions.BadHttpMessage):
    """A chunked body's trailer section past what the parser may hold of a head
    (``_HeadBoundParser``)."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"A chunked body's trailer fields exceed {limit_bytes} bytes.")


# What the parser refused, in words of our own: its messages quote the raw bytes (a header
# value: a key), on their first line too. Most specific first.
_BROKEN_FRAMING = "the body's framing is not valid"
_DOES_NOT_DECODE = "the body does not decode as its Content-Encoding says"
_PARSER_REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (TrailersTooLarge, "a chunked body's trailer fields are too large"),
    (http_exceptions.LineTooLong, "a request line or header is too long"),
    (http_exceptions.InvalidHeader, "a header is not valid"),
    (http_exceptions.BadHttpMethod, "the method is not valid"),
    (http_exceptions.BadStatusLine, "the request line is not valid"),
    (http_exceptions.TransferEncodingError, _BROKEN_FRAMING),
    (http_exceptions.ContentLengthError, "the body's length is not valid"),
    (http_exceptions.ContentEncodingError, _DOES_NOT_DECODE),
)


# What a head holds beside its request line and fields: the method, version and line ends
# (a generous bound), and each field's ": " and line end.
_HEAD_LINE_FRAMING_BYTES = 1024
_FIELD_FRAMING_BYTES = len(b": \r\n")


class _HeadBoundParser(http_parser.HttpRequestParser):
    """aiohttp's request parser (its C one, else Python's), refusing a head whose bytes pass what
    one the proxy takes may hold: a request line and one field's limit of names and values
    (``app.server_options``: 64 KiB each, above the 60 KiB the most ``limits.max_header_bytes``
    takes, which the middleware counts exactly once the head has ended), with their framing.
    aiohttp's own limits are per field, 1,024 of them: a head of 64 MiB, no key needed, was held
    (as bytes and as strings) until it ended, or for the keep-alive timeout when it never did.
    Counted: the reads that end no head while no body is pending, so that what is held of a head
    is at most this bound and one read. It does not follow the setting (a reload may change
    that): it lies above all the setting takes.

    A chunked body's trailer section is header fields too, held alike (C: by the same callbacks,
    up to the same 1,024 fields; Python: as lines), and it comes while the body is pending. No
    data follows it: counted while a chunked body is pending are the reads that bring the body
    no data, a run of them ended by one that does. Between two chunks' data lies a chunk size
    line (a client's chunks of 1 byte are 5 bytes of framing each, all between data); after the
    last one, the trailers: past the bound the body fails as it comes (``TrailersTooLarge``, its
    handler's read refused, 400) and the parser is fed no more. What is held of trailers is the
    bound and two reads (the one that brought the body's last data brought trailers too)."""

    def __init__(
        self,
        protocol: BaseProtocol,
        loop: asyncio.AbstractEventLoop,
        limit: int,
        *,
        max_line_size: int,
        max_field_size: int,
        max_headers: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            protocol,
            loop,
            limit,
            max_line_size=max_line_size,
            max_field_size=max_field_size,
            max_headers=max_headers,
            **kwargs,
        )
        self.head_limit_bytes = (
            _HEAD_LINE_FRAMING_BYTES + max_line_size + max_field_size + max_headers * _FIELD_FRAMING_BYTES
        )
        # What is read of a head; while a chunked body is pending, since it last received data.
        self.head_bytes = 0
        # What a count past the bound is refused as, at each read after it.
        self.refusal: type[HeadTooLarge | TrailersTooLarge] = HeadTooLarge
        # The body of the last head, while it has not ended: what is read meanwhile is its.
        self.pending_body: StreamReader | None = None
        self.pending_chunked = False
        # What the pending chunked body had received at the last read: its data's bytes, and
        # its coded bytes too when it is decoded (a decoder's output may wait for more input).
        self.body_received_bytes = 0

    def feed_data(
        self, data: bytes, *args: Any
    ) -> tuple[list[tuple[http_parser.RawRequestMessage, StreamReader]], bool, bytes]:
        if self.head_bytes > self.head_limit_bytes:
            raise self.refusal(self.head_limit_bytes)  # refused: the head is not fed on
        if self.pending_body is not None and self.pending_body.is_eof():
            self.pending_body = None
        in_head = self.pending_body is None
        fed = super().feed_data(data, *args)
        messages = fed[0]
        if messages:
            last_message, self.pending_body = messages[-1]
            self.head_bytes, self.pending_chunked = 0, last_message.chunked
            if last_message.chunked:
                self.body_received_bytes = _received_bytes(self.pending_body)
            # Nearly every read holds one head, of a body with a length: nothing to walk.
            for at, (message, body) in enumerate(
                messages if len(messages) > 1 or last_message.chunked else ()
            ):
                if message.chunked and not message.should_close:
                    # The C parser (3.14.5, ``_http_parser.pyx``: ``cb_on_message_begin`` resets
                    # the headers, not the field still pending) files a chunked body's last
                    # trailer field among the NEXT request's headers on the connection: a
                    # trailer's ``Authorization`` paid for the next caller's call, its
                    # ``X-Run-Id`` picked that call's run. Its answer ends the connection
                    # (``Connection: close``), a request pipelined behind it unanswered. SDKs
                    # send their bodies with a length: their connections stay.
                    messages[at] = (message._replace(should_close=True), body)
        elif in_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.head_limit_bytes:
                raise HeadTooLarge(self.head_limit_bytes)
        elif self.pending_chunked:
            self._count_past_data(len(data))
        return fed

    def _count_past_data(self, read_bytes: int) -> None:
        """Count a read that brought the pending chunked body no data (the count starts again at
        one that did); past the bound, refuse the body."""
        body = self.pending_body
        assert body is not None
        received_bytes = _received_bytes(body)
        if received_bytes != self.body_received_bytes:
            self.body_received_bytes, self.head_bytes = received_bytes, 0
            return
        self.head_bytes += read_bytes
        if self.head_bytes > self.head_limit_bytes:
            self.refusal = TrailersTooLarge
            refused = TrailersTooLarge(self.head_limit_bytes)
            handler = self.protocol
            if isinstance(handler, web_protocol.RequestHandler) and handler._current_request is not None:
                body.set_exception(refused)  # its read, waiting for the body's end, is refused
            else:  # answered already: none reads the refusal
                reason = parser_refusal(refused)
                log.info("request body refused", extra={"reason": reason, "error": type(refused).__name__})
            # Ended too: aiohttp reads a body's rest after the answer (its lingering), where a
            # failure is an "Unhandled exception", a traceback in the log for a client to cause.
            body.feed_eof()
            raise refused


def _received_bytes(body: StreamReader) -> int:
    return body.total_bytes + body.total_raw_bytes


def parser_refusal(exc: BaseException | None) -> str:
    """Why aiohttp's parser refused a request (``exc``), in words of our own."""
    return next((words for kind, words in _PARSER_REFUSALS if isinstance(exc, kind)), "it is malformed")


def body_refusal(err: Exception) -> str:
    """Why a request body's read failed (``web.RequestPayloadError``, or the parser's own error),
    in the parser refusals' words. aiohttp attaches the parser's error as the cause only when a
    read was waiting for the bytes; without it, its text (the cause's) still names a body that
    does not decode ("Can not decode content-encoding: gzip"); what else fails a body is its
    framing (chunks, length)."""
    cause = err.__cause__ if isinstance(err, web_protocol.RequestPayloadError) else err
    if isinstance(cause, http_exceptions.BadHttpMessage):
        reason = parser_refusal(cause)
    elif "content-encoding" in str(err).lower():
        reason = _DOES_NOT_DECODE
    else:
        reason = _BROKEN_FRAMING
    log.info("request body refused", extra={"reason": reason, "error": type(cause or err).__name__})
    return reason


def _handle_parser_error(
    self: web_protocol.RequestHandler,
    request: web.BaseRequest,
    status: int = 500,
    exc: BaseException | None = None,
    message: str | None = None,
) -> web.StreamResponse:
    """aiohttp's answer to a request its parser refused (before any middleware: a control
    character in a header, Content-Length beside chunked, a bad chunk size, past the parser's
    limits), as JSON rather than its own text/plain page. The path is not known here (aiohttp
    hands over a request of its own, path /): the answer is read by both APIs' clients, OpenAI's
    error object with Anthropic's ``"type": "error"`` beside it (an ``invalid_request_error`` in
    both). Neither the answer nor the log line quotes the request's bytes (a key in them): a
    reason of our own words."""
    if status >= 500:
        return _PLAIN_HANDLE_ERROR(self, request, status, exc, message)  # not the parser's
    if request.writer.output_size > 0:  # as aiohttp's: a response started cannot be replaced
        raise ConnectionError("Response is sent already, cannot send another response with the error message")
    if isinstance(exc, HeadTooLarge):  # aiohttp says 400 for every refusal of its parser
        status, reason = 431, "the request line and headers are too large"
        error = error_object(exc.message, "invalid_request_error", code="headers_too_large")
    else:
        reason = parser_refusal(exc)
        error = error_object(
            f"The request is not valid HTTP: {reason}.", "invalid_request_error", code="bad_http_request"
        )
    log.info(
        "request refused by the HTTP parser",
        extra={"status": status, "reason": reason, "error": type(exc).__name__, "remote": request.remote},
    )
    response = web.Response(
        status=status,
        body=json.dumps({"type": "error", "error": error}).encode(),
        content_type="application/json",
        # On every answer (README). No app state reaches here; rare enough for a system call (a
        # source made at import would repeat its ids in every worker forked after it).
        headers={"x-request-id": f"req_{os.urandom(16).hex()}"},
    )
    response.force_close()  # as aiohttp's: the connection's framing is not to be trusted
    return response


def answer_parser_errors_as_json() -> None:
    """Make aiohttp answer requests its HTTP parser refuses in the APIs' error format. aiohttp
    builds its ``RequestHandler`` itself and offers no hook for its error page, so its method is
    replaced, for the process (every server in it, as it must: the runner is aiohttp's).
    Idempotent; ``app.build_app`` calls it."""
    web_protocol.RequestHandler.handle_error = _handle_parser_error  # type: ignore[method-assign]


def bound_request_heads() -> None:
    """Make aiohttp's servers parse requests with ``_HeadBoundParser``, for the process (as
    ``answer_parser_errors_as_json``: aiohttp builds its parser itself, naming the class from its
    module). Idempotent; ``app.build_app`` calls it."""
    web_protocol.HttpRequestParser = _HeadBoundParser  # type: ignore[attr-defined,assignment]


def undecoded_after(request: web.BaseRequest, response: web.StreamResponse) -> web.StreamResponse:
    """``response``, after which what is left of a compressed request body not read to its end
    is not decoded. aiohttp reads an unread body's rest after the answer (for up to 10 s, its
    lingering, so that a client still sending reads the answer rather than a reset), and a
    compressed rest is decoded as it is read: while its decoder has output the read never
    yields, so a few KiB of Brotli that decode to GiBs froze the worker's loop for seconds,
    every call on it waiting, no key needed. Such a connection is closed after the answer
    ("Connection: close"): from now on what the client sends is read and dropped undecoded (a
    closing protocol's ``data_received`` takes nothing, nor does the parser's resume) while
    aiohttp lingers. The protocol's ``force_close`` instead (the response's does not stop the
    lingering) closed the transport at once, with bytes unread: a client still sending got a
    reset in place of its answer. An uncompressed rest is read as ever, bounded by what the
    client sends."""
    coding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if coding not in ("", "identity") and not request.content.is_eof():
        response.force_close()
        request.protocol.close()
    return response


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], object]
) -> web.StreamResponse:
    """Every error leaves in the format of the API called (OpenAI's, or Anthropic's on
    ``/v1/messages``); no stack trace ever reaches a client. A compressed body left unread is
    not decoded after the answer (``undecoded_after``): a refusal's, the router's 404 and 405
    too."""
    state = request.app[STATE]
    request[REQUEST_ID] = request_id_for(request, state.ids)
    limit = state.config.limits.max_header_bytes
    if sum(map(len, itertools.chain.from_iterable(request.raw_headers))) > limit:
        answer = _error(request, 431, f"The request headers exceed {limit} bytes.", code="headers_too_large")
        return undecoded_after(request, answer)
    try:
        response = await handler(request)  # type: ignore[misc]
        assert isinstance(response, web.StreamResponse)
        if not response.prepared:  # a stream's went out with its headers
            for name, value in _dialect(request).id_headers(request[REQUEST_ID]).items():
                response.headers.setdefault(name, value)
    except Exception as err:
        if request.writer.output_size > 0:
            # An answer had started (a stream's headers, its events): no other can follow it.
            # Raised on, aiohttp drops the connection ("Response is sent already"): the client's
            # read fails, where a 500 written into the stream left it waiting for an end.
            raise
        return undecoded_after(request, _answer_to(request, err))
    return undecoded_after(request, response)


def _answer_to(request: web.Request, err: Exception) -> web.StreamResponse:
    """The answer to what a handler raised (called while it is handled: its traceback logged)."""
    if isinstance(err, ApiError):
        return _error(
            request,
            err.status,
            err.message,
            err.error_type,
            param=err.param,
            code=err.code,
            headers=err.headers,
        )
    if isinstance(err, StoreError):
        # Not a billed call's (their handlers answer their own): a view's read, where "not
        # forwarded" would say nothing true.
        down = StoreUnavailable("The billing store is unavailable; nothing could be read from it.")
        return _error(
            request, down.status, down.message, down.error_type, code=down.code, headers=down.headers
        )
    if isinstance(err, web.HTTPException):
        if err.status == 404:
            message = (
                f"Unknown endpoint {request.method} {request.path}: this proxy forwards only calls "
                "it can bill."
            )
            return _error(request, 404, message, code="unknown_url")
        if isinstance(err, web.HTTPMethodNotAllowed):
            message = f"Method {request.method} is not allowed on {request.path}."
            allowed = {"Allow": ", ".join(sorted(err.allowed_methods))}  # RFC 9110 asks for it
            return _error(request, 405, message, code="method_not_allowed", headers=allowed)
        if err.status == 413:
            too_large = BodyTooLarge()
            return _error(request, too_large.status, too_large.message, code=too_large.code)
        return _error(request, err.status, err.reason)
    log.exception("unhandled error", extra={"path": request.path})
    message = "Internal proxy error; the call was not forwarded or was settled."
    return _error(request, 500, message, "server_error")


def _error(
    request: web.Request,
    status: int,
    message: str,
    error_type: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    dialect = _dialect(request)
    ids = dialect.id_headers(request[REQUEST_ID])
    return dialect.error_response(
        status, message, error_type, param=param, code=code, headers={**(headers or {}), **ids}
    )


def _dialect(request: web.Request) -> Dialect:
    return dialect_of_request(request)
