"""Relay an answer that comes as one JSON body: a non-streaming answer, or an upstream's error.

The body is read whole (bounded), observed, classified by the policy, settled, and passed on as
it came (the operator's key scrubbed); an answer the policy rejects is replaced by a 422 that
says what was billed.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from proxy.events import EventFilter
from proxy.forward import BodyTooLarge, account_scrubbed, caller_key_sent, read_limited
from proxy.observe import Observation, parse_json, parse_usage
from proxy.outcome import (
    ZERO_USAGE,
    BilledUsage,
    Outcome,
    OutcomeTag,
    classify_answer,
    provider_usage,
)

if TYPE_CHECKING:
    from proxy.relay import Exchange

UPSTREAM_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)


async def relay_body(ex: Exchange, upstream: aiohttp.ClientResponse) -> web.Response:
    call = ex.call
    came: list[bytes] = []
    raw = b""
    started = time.monotonic()
    try:
        try:
            raw = await read_limited(upstream, ex.services.config.limits.max_upstream_body_bytes, came)
        finally:
            ex.upstream_s += time.monotonic() - started  # the upstream's time, not the proxy's
        parsed = parse_json(raw)
    except TimeoutError:
        _observe_cut_body(ex, b"".join(came))  # whole but for the body's end: its usage came
        return await ex.failed("upstream_timeout", 504, "The upstream did not finish its answer in time.")
    except BodyTooLarge:
        # The provider answered (and billed) it; the same request makes the same body again:
        # each of an SDK's retries would be billed and fail the same way.
        return await ex.failed(
            "upstream_error",
            502,
            f"The upstream answer is larger than the proxy relays "
            f"({ex.services.config.limits.max_upstream_body_bytes} bytes).",
            retry=False,
        )
    except (ValueError, *UPSTREAM_BROKEN) as err:
        if isinstance(err, ValueError):
            # Not JSON, yet maybe the events of a server that streams whatever ``stream`` says:
            # not the answer asked for, but the provider's usage when its last chunk carried it.
            _observe_events(ex, raw)
        else:  # cut, not too large nor unparseable: read what came
            _observe_cut_body(ex, b"".join(came))
        # A whole answer that is no JSON is what the same request gets again (a server that
        # streams whatever ``stream`` says): an SDK does not retry a 200 it cannot read, nor
        # should it retry ours, each retry run and billed. A cut answer may come whole next time,
        # and a body ended by its connection's close (no length, not chunked) may have been cut.
        framed = (
            upstream.content_length is not None
            or "chunked" in upstream.headers.get("Transfer-Encoding", "").lower()
        )
        return await ex.failed(
            "upstream_error",
            502,
            "The upstream sent a broken or non-JSON answer.",
            retry=False if isinstance(err, ValueError) and framed else None,
        )
    try:
        if not isinstance(parsed, dict):
            raise TypeError("not an object")
        call.dialect.observe_body(ex.obs, parsed)
    except Exception:
        ex.obs.malformed = True
    if ex.obs.malformed:
        return await ex.failed(
            "upstream_error", 502, "The upstream answer is not a JSON object.", retry=False
        )
    transport = ex.request.transport
    failed = ex.obs.error  # an answer that says it failed (status failed, an error object)
    if transport is None or transport.is_closing():
        outcome = Outcome("client_disconnected")
    elif failed:
        outcome = Outcome("upstream_error")  # passed on as it came, billed as a stream's is
    else:
        outcome = classify_answer(
            ex.obs,
            call.policy,
            json_mode=call.json_mode,
            writes_nothing=call.writes_nothing,
            prewarm=call.prewarms,
        )
    ex.answering(422 if outcome.tag == "rejected" else upstream.status)
    settlement = await ex.settle_early(outcome, ex.usage(complete=not failed))
    headers = ex.headers(settlement)
    if outcome.tag == "rejected":
        headers["x-should-retry"] = "false"
        return ex.error(
            422,
            ex.rejection_message(settlement),
            "output_rejected",
            code="output_rejected",
            headers=headers,
        )
    return WholeAnswer(ex, upstream.status, ex.scrub(raw), headers)


# asyncio's and uvloop's default high-water mark of a transport's buffer.
UNWATCHED_BYTES = 64 * 1024


class WholeAnswer(web.Response):
    """A JSON answer whose client is dropped once it has taken none of it for the exchange's
    ``write_timeout_s``, as a stream's client that stops reading is (``relay_stream._to_client``).
    aiohttp hands the whole body to the transport at once and waits without bound for it to be
    taken: a client that kept its connection and never read held the answer twice (the
    transport's buffer and this body) for as long as it liked. The call was settled before the
    write (its headers carry the settlement): a client dropped so leaves its bill as it was."""

    def __init__(self, ex: Exchange, status: int, body: bytes, headers: dict[str, str]) -> None:
        super().__init__(status=status, body=body, content_type="application/json", headers=headers)
        # A body the transport takes without waiting (below its high-water mark) is never
        # waited on: nearly every answer goes out unwatched, with no timer.
        self._client = ex.request.transport if len(body) > UNWATCHED_BYTES else None
        self._write_timeout_s = ex.write_timeout_s

    async def write_eof(self, data: bytes = b"") -> None:
        client = self._client
        if client is None:
            await super().write_eof(data)
            return
        watch = _TakenWatch(client, self._write_timeout_s)
        try:
            # Aborted, the client's connection fails the wait (a ConnectionError, which aiohttp
            # takes for a client gone).
            await super().write_eof(data)
        finally:
            watch.cancel()


class _TakenWatch:
    """Aborts ``client``'s connection once it has taken nothing of what waits for it (the
    transport's buffer has not shrunk) for ``timeout_s``, looked at every quarter of it."""

    __slots__ = ("_client", "_handle", "_left", "_since", "_timeout_s")

    def __init__(self, client: asyncio.Transport, timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s
        # First looked at once the write has handed the body to the transport.
        self._left: int | None = None
        self._since = time.monotonic()
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            timeout_s / 4, self._check
        )

    def _check(self) -> None:
        client = self._client
        left = client.get_write_buffer_size()
        now = time.monotonic()
        if self._left is not None and (left < self._left or not left):
            self._since = now  # it took some, or has it all
        self._left = left
        if now - self._since >= self._timeout_s:
            self._handle = None
            client.abort()
            return
        self._handle = asyncio.get_running_loop().call_later(self._timeout_s / 4, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _observe_cut_body(ex: Exchange, came: bytes) -> None:
    """A body whose connection broke after its JSON was whole (before the chunked body's end):
    its usage is the provider's figure, billed before the reserve. Not JSON, it may be a
    stream's events whose usage came before the cut (``_observe_events``, without the end)."""
    if not came:
        return
    try:
        parsed = parse_json(came)
    except ValueError:
        _observe_events(ex, came, whole=False)
        return
    try:
        if isinstance(parsed, dict):
            ex.call.dialect.observe_body(ex.obs, parsed)
    except Exception:  # cut inside its JSON: nothing to read, the reserve bills it
        pass


def _observe_events(ex: Exchange, body: bytes, *, whole: bool = True) -> None:
    """Observe ``body`` (not JSON) as a stream's events, for its usage: bytes that are no events
    leave the observation as it was, or malformed (the call failed either way). ``whole``: the
    body ended cleanly, so an event without its blank line is its last (else cut short)."""
    call = ex.call
    events = EventFilter(
        ex.obs, dialect=call.dialect, choices=call.choices, client_wants_usage=True, runs=False
    )
    try:
        if events.read(body, limit=ex.services.config.limits.max_upstream_body_bytes) is not None and whole:
            events.end()  # the body's clean end: an event without its blank line counts too
    except Exception:  # bytes no stream ever held: the failed call is told all the same
        ex.obs.malformed = True


async def relay_upstream_error(ex: Exchange, upstream: aiohttp.ClientResponse) -> web.Response:
    """An answer with a status of 300 or more: a refusal, a failure or a redirect."""
    status = upstream.status
    tag: OutcomeTag = "upstream_4xx" if status < 500 else "upstream_error"
    parsed: Any = None
    came: list[bytes] = []
    cut = False
    started = time.monotonic()
    try:
        raw = await read_limited(upstream, ex.services.config.limits.max_upstream_body_bytes, came)
    except ValueError:  # too large
        raw = b""
    except (TimeoutError, *UPSTREAM_BROKEN):
        raw, cut = b"".join(came), True
    ex.upstream_s += time.monotonic() - started  # the upstream's time, not the proxy's
    try:
        parsed = parse_json(raw)
    except ValueError:
        parsed = None
    explicit_error = isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
    if cut and not explicit_error:
        # Cut or stalled: what came is passed on only as a whole error object (a page cut short
        # could end inside the operator's key, which the scrub, matching it whole, would miss).
        raw, parsed = b"", None
    raw = account_scrubbed(ex.scrub(raw), upstream, ex.call.upstream, ex.call.identity)
    usage = provider_usage_of(parsed)
    if usage is None:
        # The provider refused the request (4xx) or said in its own format that it failed:
        # nothing was billed. A bare 5xx (a gateway's HTML page) may hide spent tokens.
        usage = ZERO_USAGE if status < 500 or explicit_error else ex.reserve_usage()
    if status < 400:
        # A redirect: the provider did no work here (a base_url to fix), nothing to bill.
        ex.answering(502)
        settlement = await ex.settle(Outcome("upstream_error"), ZERO_USAGE)
        return ex.error(
            502,
            f"The upstream redirected the call (HTTP {status}); the proxy does not follow "
            "redirects: its upstream base_url needs fixing.",
            "upstream_error",
            code="upstream_redirect",
            headers={**ex.headers(settlement), "x-should-retry": "false"},
        )
    operator_refused = status in (401, 403) and not caller_key_sent(ex.call.upstream, ex.call.identity)
    ex.answering(502 if operator_refused else status)
    settlement = await ex.settle(Outcome(tag), usage)
    headers = ex.headers(settlement)
    if operator_refused:
        # The upstream refused the proxy's own credentials, or the call it sent with none (an
        # upstream configured without a key): not the caller's fault, and not one a retry mends
        # (the SDK retries a 502 unless told not to: each retry a billed call).
        headers["x-should-retry"] = "false"
        return ex.error(
            502,
            f"The upstream refused the proxy's credentials (HTTP {status}).",
            "upstream_error",
            code="upstream_auth",
            headers=headers,
        )
    if explicit_error:
        return WholeAnswer(ex, status, raw, headers)
    snippet = raw[:200].decode("utf-8", "replace").strip() or "no body"
    error_type = "invalid_request_error" if status < 500 else "upstream_error"
    return ex.error(
        status, f"Upstream returned HTTP {status}: {snippet}", error_type, code=tag, headers=headers
    )


def provider_usage_of(parsed: Any) -> BilledUsage | None:
    if not isinstance(parsed, dict):
        return None
    usage = parse_usage(parsed.get("usage"))
    if usage is None:
        return None
    return provider_usage(Observation(usage=usage))
