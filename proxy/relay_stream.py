"""Relay an event stream as it arrives, then settle it and end it with the billing comment.

Every complete event of a read goes out in one write as soon as it came; only events the client
must not see (usage it did not ask for) are rewritten or dropped (``events.EventFilter``), every
other one is passed on byte for byte. A client that stops reading is dropped after a bounded
wait, so the lease keeps being renewed and the call is settled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import HttpVersion11, web

from proxy.body_reader import BodyReader
from proxy.contexts import keep_context
from proxy.events import EventFilter
from proxy.forward import StallGuard
from proxy.lease import LeaseRenewal
from proxy.observe import Observation, parse_json
from proxy.outcome import CLIENT_CLOSED, Outcome, classify_answer
from proxy.scrub import scrubbed
from proxy.settle import billing_comment

if TYPE_CHECKING:
    from proxy.relay import Exchange

log = logging.getLogger("proxy.relay")
# A write that leaves at most this many bytes waiting for the client, on a connection not paused
# for it, returns at once: the transports' low-water mark (asyncio's and uvloop's default). A
# paused connection is checked too: uvloop resumes one only when a whole queued write is sent, so
# it can stay paused with a few KiB left, and aiohttp's write waits for it every 64 KiB written.
_WRITE_BACKLOG = 16 * 1024
# ConnectionError: aiohttp's drain raises a bare one ("Connection lost") for a client reset
# while a write waits on it.
CLIENT_GONE = (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError)
UPSTREAM_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)
# How long the body's end is waited for after [DONE] (see relay_stream).
DONE_DRAIN_S = 0.25


class _EventStream(web.StreamResponse):
    """A stream whose headers wait in aiohttp's buffer, as ``web.Response``'s do, until the relay
    sends them: with the first events when they came with the upstream's headers (one send, not
    two), else alone before it waits on the upstream."""

    _send_headers_immediately = False


async def relay_stream(
    ex: Exchange, upstream: aiohttp.ClientResponse, renewal: LeaseRenewal
) -> web.StreamResponse:
    """``renewal``: the call's lease renewal, stopped here once the stream has ended (before
    its settle)."""
    call = ex.call
    obs = ex.obs
    response = _EventStream(
        status=200,
        headers={
            **ex.provider_headers,
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **call.dialect.id_headers(call.request_id),
        },
    )
    ex.answer_status = response.status
    if ex.request.version < HttpVersion11:
        # No chunked framing before HTTP/1.1: the stream ends with the connection, which aiohttp
        # would keep open for a client that asked to keep it alive (its body never ending).
        response.force_close()
    client_gone = False
    headers_out = False  # a write of ours went out: the client was answered 200
    writer = None
    try:
        writer = await response.prepare(ex.request)
    except CLIENT_GONE:
        # Gone before the upstream's first byte (a slow start): a disconnect like any other.
        client_gone = True
    failure: Outcome | None = None
    events = EventFilter(
        obs, dialect=call.dialect, choices=call.choices, client_wants_usage=call.client_wants_usage
    )
    guard = StallGuard(upstream, call.upstream.timeout_s)
    body = BodyReader(upstream.content)
    # Looked up once: the loop runs once per read of the upstream, often once per event.
    next_piece = body.read
    read, write, monotonic = events.read, response.write, time.monotonic
    limit = ex.services.config.limits.max_upstream_body_bytes
    secrets = ex.operator_secrets
    request = ex.request
    waited_s = 0.0
    # The answer's last event went out to the client as it came (message_stop,
    # response.completed / incomplete / failed): a client gone after it had the answer whole.
    # Never so for chat and completions, whose [DONE] waits for the tail.
    end_sent = False
    try:
        # What came with the upstream's headers goes out with ours, in one send; ours never
        # wait on the upstream: they go out (if no events took them) before any wait.
        pending = body.read_nowait()
        while True:
            if pending:
                piece, pending = pending, b""
            else:
                if writer is not None and not client_gone:
                    try:
                        writer.send_headers()  # nothing once they went out
                        headers_out = True
                    except CLIENT_GONE:
                        client_gone = True
                guard.waiting_since = waited = monotonic()
                piece = await next_piece()
                if not piece:
                    # The body's end, maybe right after an event's data, before its blank line.
                    client_gone = not await _last_event(ex, events, write, client_gone)
                    end_sent = _end_sent(ex, client_gone)
                    break
                guard.waiting_since = None
                waited_s += monotonic() - waited
            # Every complete event of this read goes out in one write, as soon as it came.
            out = read(piece, limit=limit)
            if out is None:
                failure = Outcome("upstream_error")  # one event larger than we hold
                break
            if obs.done and out:
                await keep_context(ex)  # before the client has the answer whole (its id)
            if secrets:  # whole events: a key is never cut
                out = scrubbed(out, secrets)
            if not out or client_gone:
                pass
            elif _has_room(request, len(out)):
                try:
                    await write(out)  # no wait: ``_to_client``'s first case, without its frame
                    headers_out = True
                except CLIENT_GONE:
                    client_gone = True
            else:
                client_gone = not await _to_client(ex, write, out)
                headers_out = headers_out or not client_gone
            if client_gone and call.policy.on_client_disconnect == "cancel":
                break
            if obs.done:
                # [DONE], response.completed / incomplete / failed, message_stop: the answer's
                # end. What follows is dropped, and the client's SDK has it all. The body's
                # end (its last chunk, often a read of its own) is waited for briefly, so the
                # connection goes back to the pool; an upstream slow to close it does not hold
                # the answer's end (nor the client's next call on that connection) for longer.
                end_sent = _end_sent(ex, client_gone)
                waited = monotonic()
                await _drain(body, DONE_DRAIN_S)
                waited_s += monotonic() - waited  # the upstream's time, not the proxy's
                break
    # Past the answer's end ([DONE], response.completed, message_stop) a silence or a broken
    # connection takes nothing from it: the client has it whole, and so does the ledger.
    except TimeoutError:
        failure = None if obs.done else Outcome("upstream_timeout")
    except UPSTREAM_BROKEN:
        failure = None if obs.done else Outcome("upstream_error")
    except Exception:
        # Our own fault, after the response started: still settle, still end the stream.
        log.exception("stream relay failed", extra={"request_id": call.request_id})
        failure = Outcome("upstream_error")
    finally:
        ex.upstream_s += waited_s
        guard.cancel()
        renewal.stop()
    if events.incomplete and failure is None and not client_gone and not obs.done:
        failure = Outcome("upstream_error")  # the stream ended inside an event
    if not client_gone and not end_sent and (request.transport is None or request.transport.is_closing()):
        # Gone with nothing more written to it (a usage chunk it did not ask for is dropped,
        # [DONE] waits for the tail): it never had the answer's end. One gone once it had a
        # Messages or Responses answer's last event (while the body's end was waited for) keeps
        # the answer's tag: only the billing comment is lost.
        client_gone = True
    if client_gone and not headers_out:
        ex.answer_status = CLIENT_CLOSED  # gone before any of its answer went out

    try:
        await _settle_and_end(ex, response, events, failure, client_gone=client_gone)
    except Exception:
        # The proxy's own fault once the stream had started (a settle that failed twice:
        # ``Exchange.settle``): no other answer can follow its headers, only its end.
        log.exception("stream end failed", extra={"request_id": call.request_id})
        await _end_on_error(ex, response, client_gone=client_gone)
    return response


async def _settle_and_end(
    ex: Exchange,
    response: web.StreamResponse,
    events: EventFilter,
    failure: Outcome | None,
    *,
    client_gone: bool,
) -> None:
    """Settle the stream as it ended and end it: the billing comment, then [DONE] as it came or
    an error event."""
    call, obs = ex.call, ex.obs
    # A body that ended cleanly once every choice had finished is a whole answer even without
    # [DONE]: OpenAI-compatible servers that never send it (Perplexity) are served as directly.
    whole = obs.done or (
        failure is None
        and not events.incomplete
        and bool(call.dialect.done_marker)
        and len(obs.finish_reasons) >= call.choices
    )
    if client_gone:
        cancelled = not obs.done and call.policy.on_client_disconnect == "cancel"
        # Cut by the proxy (cancel): what streamed is what was ordered, on the provider's
        # figures when they came. Drained: a failed or unfinished answer is not complete.
        healthy = not obs.error and not obs.malformed  # it had not failed first
        complete = healthy and (cancelled or whole)
        await ex.settle(Outcome("client_disconnected"), ex.usage(complete=complete))
        return
    if failure is None and (obs.malformed or obs.error or not whole):
        failure = Outcome("upstream_error")
    if failure is not None:
        settlement = await ex.settle(failure, ex.usage(complete=False))
        tail = billing_comment(call, settlement)
        # Cut short, not ended by the provider's own error event (passed on as it came: an SDK
        # reads that one as the provider's failure and its code; a second, ours, would hide it).
        broken_transport = (
            failure.tag == "upstream_error" and not obs.done and not obs.malformed and not obs.error
        )
        if (not obs.done and failure.tag != "upstream_error") or broken_transport:
            tail += call.dialect.error_event(
                f"The upstream stream failed ({failure.tag}).", "upstream_error", failure.tag
            )
        elif obs.done and call.dialect.done_marker:
            tail += call.dialect.done_marker
        await _to_client(ex, response.write_eof, tail)  # one write: the tail and the body's end
        return

    outcome = classify_answer(
        obs, call.policy, json_mode=call.json_mode, writes_nothing=call.writes_nothing, prewarm=call.prewarms
    )
    settlement = await ex.settle(outcome, ex.usage(complete=True))
    tail = billing_comment(call, settlement)
    if outcome.tag == "rejected":
        tail += call.dialect.error_event(
            ex.rejection_message(settlement), "output_rejected", "output_rejected"
        )
    elif obs.done and call.dialect.done_marker:
        tail += call.dialect.done_marker  # as it came: not when the upstream sent none
    await _to_client(ex, response.write_eof, tail)


async def _end_on_error(ex: Exchange, response: web.StreamResponse, *, client_gone: bool) -> None:
    """End a started stream the proxy failed: with an error event (the client's SDK raises it),
    or, when that cannot be written, by dropping its connection. Never left open, its client
    waiting for an end. The call is billed all the same: settled, or its reservation reaped."""
    if not client_gone and response.prepared:
        error = ex.call.dialect.error_event(
            "The proxy failed while ending the stream; the call is billed.", "server_error", "internal_error"
        )
        try:
            if await _to_client(ex, response.write_eof, error):
                return
        except Exception:
            log.exception("could not end a stream", extra={"request_id": ex.call.request_id})
    transport = ex.request.transport
    if transport is not None:
        transport.abort()


def _end_sent(ex: Exchange, client_gone: bool) -> bool:
    """The answer's last event has gone out to the client: written (the answer ended in it, no
    [DONE] to come) and handed to the socket whole. Left in the transport's buffer (a client
    that stopped reading), it may never reach a client that then leaves."""
    transport = ex.request.transport
    return (
        ex.obs.done
        and not client_gone
        and not ex.call.dialect.done_marker
        and transport is not None
        and transport.get_write_buffer_size() == 0
    )


async def _last_event(
    ex: Exchange, events: EventFilter, write: Callable[[bytes], Awaitable[None]], client_gone: bool
) -> bool:
    """Read the event the body ended in when its data came whole, its blank line not
    (``EventFilter.end``), and pass it on as the loop does; False when the client is gone."""
    out = events.end()
    if not out and events.incomplete and not ex.obs.chunks and not ex.obs.finish_reasons:
        _observe_usage_of_json(ex, events.held())  # a body that held no event at all
    if out and ex.obs.done:
        await keep_context(ex)  # before the client has the answer whole (its id)
    if not out or client_gone:
        return not client_gone
    return await _to_client(ex, write, scrubbed(out, ex.operator_secrets))


def _observe_usage_of_json(ex: Exchange, held: bytes) -> None:
    """A stream call's body that held no event but one JSON answer (a provider that ignored
    ``stream`` and labelled it neither JSON nor SSE: Flask's text/html): no stream the client's
    SDK can read (the call fails as malformed SSE does), but the provider's usage it carries
    bills it, not the reserve. Only what bills it is taken (its usage, hosted tools' calls, the
    tier that served it, output it does not show): the answer was never the client's."""
    try:
        parsed = parse_json(held)
    except ValueError:
        return
    if not isinstance(parsed, dict):
        return
    scratch = Observation()
    try:
        ex.call.dialect.observe_body(scratch, parsed)
    except Exception:  # not the answer's shape: no figures to take from it
        return
    obs = ex.obs
    if scratch.usage is not None and obs.usage is None:
        obs.usage, obs.usage_final = scratch.usage, scratch.usage_final
        obs.tool_calls, obs.tool_uses = scratch.tool_calls, scratch.tool_uses
        obs.tool_calls_told = scratch.tool_calls_told
        obs.service_tier = scratch.service_tier or obs.service_tier
        obs.tier_told = scratch.tier_told or obs.tier_told
        obs.hidden_output = obs.hidden_output or scratch.hidden_output


async def _drain(body: BodyReader, within_s: float) -> None:
    """Read the upstream's body to its end, its bytes dropped, for at most ``within_s``."""
    try:
        while body.read_nowait():
            pass
        # Nearly every stream: its last chunk came with the answer's end, and a timeout (a timer
        # armed and cancelled, some 4 us) would guard a wait that never happens.
        if body.at_eof():
            return
        async with asyncio.timeout(within_s):
            while await body.read():
                pass
    except (TimeoutError, *UPSTREAM_BROKEN):
        pass  # ended, slow (closed, not reused) or broken: the answer was whole all the same


async def _to_client(ex: Exchange, write: Callable[[bytes], Awaitable[None]], data: bytes) -> bool:
    """``write(data)``; False when the client is gone: it reset, or it stopped reading and was
    dropped (a close would wait for it to take what is buffered, holding the socket)."""
    transport = ex.request.transport
    try:
        if _has_room(ex.request, len(data)):
            await write(data)  # no wait
        else:
            # A client that stops reading must not stall renewals of the lease.
            async with asyncio.timeout(ex.write_timeout_s):
                await write(data)
    except CLIENT_GONE:
        return False
    except TimeoutError:
        if transport is not None:
            transport.abort()
        return False
    return True


def _has_room(request: web.Request, size: int) -> bool:
    """A write of ``size`` bytes to the client returns at once (see ``_WRITE_BACKLOG``)."""
    transport = request.transport
    return (
        transport is not None
        and not request.protocol.writing_paused
        and transport.get_write_buffer_size() + size <= _WRITE_BACKLOG
    )
