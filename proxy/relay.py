"""Forward a reserved call, observe the answer, settle it and answer the client.

The steps after ``reserve``: forward, observe, settle, record. Streams are relayed event by
event as they arrive; only chunks the client must not see (usage it did not ask for) are
rewritten or dropped, every other event is passed on byte for byte.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web

from proxy.billing import Settlement, billing_comment, billing_headers, settle
from proxy.call import Call
from proxy.config import Config
from proxy.errors import StoreError
from proxy.estimate import counted
from proxy.events import EventFilter
from proxy.forward import (
    StallGuard,
    TransportFailure,
    open_upstream,
    operator_key_sent,
    provider_headers,
    read_limited,
)
from proxy.journal import Journal
from proxy.metrics import Metrics, tenant_label
from proxy.observe import Observation, parse_json, parse_usage
from proxy.outcome import (
    ZERO_USAGE,
    BilledUsage,
    Outcome,
    OutcomeTag,
    classify_answer,
    estimated_usage,
    provider_usage,
    reserve_usage,
)
from proxy.record import record_call
from proxy.store import Store
from proxy.tokenizer import Tokenizer

log = logging.getLogger("proxy.relay")
# A write that leaves at most this many bytes waiting for the client returns at once: the
# transport's low-water mark (asyncio's default), below which it is never paused for the client.
_WRITE_BACKLOG = 16 * 1024
# ConnectionError: aiohttp's drain raises a bare one ("Connection lost") for a client reset
# while a write waits on it.
CLIENT_GONE = (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError)
UPSTREAM_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)
REDACTED = b"[REDACTED]"


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    store: Store
    session: aiohttp.ClientSession
    tokenizer: Tokenizer
    config: Config
    metrics: Metrics
    journal: Journal
    # Settle tasks still running (see ``Exchange._settle``); shutdown waits for them.
    settling: set[asyncio.Future[Settlement]]


class Exchange:
    """One call from forward to settle; settles exactly once whatever happens."""

    def __init__(self, request: web.Request, call: Call, services: Services) -> None:
        self.request = request
        self.call = call
        self.services = services
        self.obs = Observation()
        self._settling: asyncio.Future[Settlement] | None = None
        # A stream renews its lease every third of it, on a timer: reads may be far apart.
        self._renewal: asyncio.TimerHandle | None = None
        self._renewing: set[asyncio.Future[None]] = set()
        lease_s = call.reservation.lease_ms / 1000 if call.reservation else call.upstream.timeout_s
        self._write_timeout_s = min(call.upstream.timeout_s, lease_s / 3)
        # Time spent waiting on the upstream, so the proxy's own overhead can be told apart.
        self._upstream_s = 0.0
        self._provider_headers: dict[str, str] = {}  # once it answered: see forward.provider_headers

    @functools.cached_property
    def _operator_key(self) -> bytes | None:
        return operator_key_sent(self.call.upstream, self.call.identity)

    # -- usage helpers -------------------------------------------------------------------

    def _reserve_usage(self) -> BilledUsage:
        return reserve_usage(self.call.reserved_input_tokens, self.call.reserved_output_tokens)

    def _estimated_usage(self) -> BilledUsage:
        est = self.call.estimate
        return estimated_usage(
            self.obs,
            prompt_text=est.prompt_text,
            prompt_overhead_tokens=est.prompt_overhead_tokens,
            encoding=self.call.encoding,
            tokenizer=self.services.tokenizer,
        )

    def _usage(self, *, complete: bool) -> BilledUsage:
        """Provider figures first; else count a complete answer; else the reserve."""
        found = provider_usage(self.obs)
        if found is not None and not self.obs.usage_final and self.obs.all_text():
            # Input is known (message_start, a report of prompt tokens only) but the final
            # output count never came: count what was streamed, never less than what the
            # provider last said.
            counted = self._estimated_usage()
            if counted.output_tokens > found.output_tokens:
                return replace(found, output_tokens=counted.output_tokens, source=counted.source)
        if found is not None:
            return found
        return self._estimated_usage() if complete else self._reserve_usage()

    async def _settle(self, outcome: Outcome, usage: BilledUsage) -> Settlement:
        """Settle and record the call, once: the first outcome wins, later calls get its result.

        Both run in one task that a cancelled handler does not stop (shutdown past its grace
        period cancels handlers mid-settle): such a call is neither settled a second time nor
        left out of the metrics and the log, and shutdown waits for the task
        (``Services.settling``) before it closes the journal and the store.
        """
        if self._settling is None:
            self.call.first_token_at = self.obs.first_token_at
            task = asyncio.ensure_future(self._settle_and_record(outcome, usage))
            self.services.settling.add(task)
            task.add_done_callback(self._settled)
            self._settling = task
        return await asyncio.shield(self._settling)

    def _settled(self, task: asyncio.Future[Settlement]) -> None:
        self.services.settling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Neither settled nor journaled (a store failure journals): its reservation waits
            # for a reaper, which settles it at its reserve.
            log.error(
                "settle or its record failed",
                exc_info=task.exception(),
                extra={"request_id": self.call.request_id},
            )

    async def _settle_and_record(self, outcome: Outcome, usage: BilledUsage) -> Settlement:
        refining = self.call.refining
        if refining is not None and not refining.done():
            # What it has not done yet would only lower a reserve about to go; and a backlog of
            # counts not started (a fast upstream, new large prompts) would grow without bound.
            refining.cancel()
            self.services.metrics.quick_estimates.labels("dropped").inc()
        if usage.source == "reserve":
            # Billed at its reserve: at the exact count, not the quick bound (counted here if the
            # background count has not landed, not behind other calls' counts), and taken from
            # the estimate as it is now: a count that landed since the usage was worked out may
            # have lowered the reserve already.
            if not self.call.estimate.input_exact:
                try:
                    est = self.call.estimate
                    self.call.estimate = await asyncio.to_thread(
                        counted, est, self.services.tokenizer, self.call.encoding
                    )
                except Exception as err:  # the quick bound is an upper bound: billed at it
                    self.services.metrics.quick_estimates.labels("failed").inc()
                    log.warning(
                        "could not count a reserve",
                        extra={"request_id": self.call.request_id, "error": repr(err)},
                    )
            usage = self._reserve_usage()
        settlement = await settle(
            self.services.store,
            self.services.journal,
            self.call,
            outcome,
            usage,
            self.obs.finish_reasons,
            marker_ttl_s=self.services.config.limits.settled_marker_ttl_s,
        )
        overhead = time.monotonic() - self.call.started_at - self._upstream_s
        if not settlement.stored:
            self.services.metrics.store_errors.labels("settle").inc()
        record_call(self.services.metrics, self.services.config, self.call, settlement, overhead)
        return settlement

    def _error(
        self,
        status: int,
        message: str,
        error_type: str,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        return self.call.dialect.error_response(status, message, error_type, code=code, headers=headers)

    def _headers(self, settlement: Settlement) -> dict[str, str]:
        return {
            **self._provider_headers,
            "x-request-id": self.call.request_id,
            **billing_headers(self.call, settlement),
        }

    # -- the exchange ---------------------------------------------------------------------

    async def run(self) -> web.StreamResponse:
        tenant = tenant_label(self.call.identity.tenant, self.services.config)
        inflight = self.services.metrics.inflight.labels(tenant)
        inflight.inc()
        try:
            started = time.monotonic()
            upstream = await open_upstream(self.services.session, self.call)
            self._upstream_s += time.monotonic() - started
            if isinstance(upstream, TransportFailure):
                return await self._transport_failure(upstream)
            try:
                self.call.upstream_status = upstream.status
                self._provider_headers = provider_headers(upstream)
                if upstream.status >= 300:  # redirects are not followed: not an answer either
                    return await self._upstream_error(upstream)
                if self.call.stream and upstream.content_type == "text/event-stream":
                    return await self._relay_stream(upstream)
                return await self._relay_body(upstream)
            finally:
                upstream.close()
        except asyncio.CancelledError:
            # The server is shutting down past its grace period: the call went out, so it is
            # charged at its reserve unless the provider already told us its usage.
            if self._settling is None:
                await self._settle(Outcome("shutdown"), self._usage(complete=False))
            raise
        finally:
            inflight.dec()
            if self._settling is None:
                # An unexpected error after the call went out: charged, never dropped.
                await self._settle(Outcome("upstream_error"), self._usage(complete=False))

    async def _transport_failure(self, failure: TransportFailure) -> web.Response:
        timed_out = failure.kind in ("timeout", "connect_timeout")
        tag: OutcomeTag = "upstream_timeout" if timed_out else "upstream_error"
        usage = (
            self._reserve_usage()
            if failure.went_out
            else BilledUsage(
                input_tokens=0, cached_input_tokens=0, output_tokens=0, reasoning_tokens=0, source="none"
            )
        )
        settlement = await self._settle(Outcome(tag), usage)
        status = 504 if timed_out else 502
        return self._error(
            status, failure.detail, "upstream_error", code=tag, headers=self._headers(settlement)
        )

    async def _upstream_error(self, upstream: aiohttp.ClientResponse) -> web.Response:
        status = upstream.status
        tag: OutcomeTag = "upstream_4xx" if status < 500 else "upstream_error"
        parsed: Any = None
        try:
            raw = self._scrub(
                await read_limited(upstream, self.services.config.limits.max_upstream_body_bytes)
            )
        except (TimeoutError, ValueError, *UPSTREAM_BROKEN):
            raw = b""
        try:
            parsed = parse_json(raw)
        except ValueError:
            parsed = None
        explicit_error = isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
        usage = provider_usage_of(parsed)
        if usage is None:
            # The provider refused the request (4xx) or said in its own format that it failed:
            # nothing was billed. A bare 5xx (a gateway's HTML page) may hide spent tokens.
            usage = ZERO_USAGE if status < 500 or explicit_error else self._reserve_usage()
        if status < 400:
            # A redirect: the provider did no work here (a base_url to fix), nothing to bill.
            settlement = await self._settle(Outcome("upstream_error"), ZERO_USAGE)
            return self._error(
                502,
                f"The upstream redirected the call (HTTP {status}); the proxy does not follow "
                "redirects: its upstream base_url needs fixing.",
                "upstream_error",
                code="upstream_redirect",
                headers=self._headers(settlement),
            )
        settlement = await self._settle(Outcome(tag), usage)
        headers = self._headers(settlement)
        if status in (401, 403) and self._operator_key is not None:
            # The upstream refused the proxy's own credentials: not the caller's fault.
            return self._error(
                502,
                f"The upstream refused the proxy's credentials (HTTP {status}).",
                "upstream_error",
                code="upstream_auth",
                headers=headers,
            )
        if explicit_error:
            return web.Response(status=status, body=raw, content_type="application/json", headers=headers)
        snippet = raw[:200].decode("utf-8", "replace").strip() or "no body"
        error_type = "invalid_request_error" if status < 500 else "upstream_error"
        return self._error(
            status, f"Upstream returned HTTP {status}: {snippet}", error_type, code=tag, headers=headers
        )

    def _scrub(self, raw: bytes) -> bytes:
        """An upstream that echoes the proxy's key (in an error, a 200 error object, a stream's
        error event) never gets it past the proxy."""
        secret = self._operator_key
        if secret is not None and secret in raw:
            return raw.replace(secret, REDACTED)
        return raw

    async def _relay_body(self, upstream: aiohttp.ClientResponse) -> web.Response:
        call = self.call
        came: list[bytes] = []
        try:
            raw = await read_limited(upstream, self.services.config.limits.max_upstream_body_bytes, came)
            parsed = parse_json(raw)
        except TimeoutError:
            settlement = await self._settle(Outcome("upstream_timeout"), self._usage(complete=False))
            return self._error(
                504,
                "The upstream did not finish its answer in time.",
                "upstream_error",
                code="upstream_timeout",
                headers=self._headers(settlement),
            )
        except (ValueError, *UPSTREAM_BROKEN) as err:
            if not isinstance(err, ValueError):  # cut, not too large nor unparseable: read what came
                self._observe_cut_body(b"".join(came))
            settlement = await self._settle(Outcome("upstream_error"), self._usage(complete=False))
            return self._error(
                502,
                "The upstream sent a broken or non-JSON answer.",
                "upstream_error",
                code="upstream_error",
                headers=self._headers(settlement),
            )
        try:
            if not isinstance(parsed, dict):
                raise TypeError("not an object")
            self.call.dialect.observe_body(self.obs, parsed)
        except Exception:
            self.obs.malformed = True
        if self.obs.malformed:
            settlement = await self._settle(Outcome("upstream_error"), self._usage(complete=False))
            return self._error(
                502,
                "The upstream answer is not a JSON object.",
                "upstream_error",
                code="upstream_error",
                headers=self._headers(settlement),
            )
        transport = self.request.transport
        failed = self.obs.error  # an answer that says it failed (status failed, an error object)
        if transport is None or transport.is_closing():
            outcome = Outcome("client_disconnected")
        elif failed:
            outcome = Outcome("upstream_error")  # passed on as it came, billed as a stream's is
        else:
            outcome = classify_answer(self.obs, call.policy, json_mode=call.json_mode)
        settlement = await self._settle(outcome, self._usage(complete=not failed))
        headers = self._headers(settlement)
        if outcome.tag == "rejected":
            headers["x-should-retry"] = "false"
            return self._error(
                422,
                self._rejection_message(settlement),
                "output_rejected",
                code="output_rejected",
                headers=headers,
            )
        return web.Response(
            status=upstream.status, body=self._scrub(raw), content_type="application/json", headers=headers
        )

    def _observe_cut_body(self, came: bytes) -> None:
        """A body whose connection broke after its JSON was whole (before the chunked body's
        end): its usage is the provider's figure, billed before the reserve."""
        try:
            parsed = parse_json(came) if came else None
            if isinstance(parsed, dict):
                self.call.dialect.observe_body(self.obs, parsed)
        except Exception:  # cut inside its JSON: nothing to read, the reserve bills it
            pass

    def _rejection_message(self, settlement: Settlement) -> str:
        return (
            f"The answer was rejected by the proxy's policy ({settlement.outcome.reason}). "
            f"It was billed: {settlement.usage.input_tokens} input tokens, "
            f"{settlement.usage.output_tokens} output tokens. Retrying will be billed again."
        )

    # -- streaming ------------------------------------------------------------------------

    async def _relay_stream(self, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        call = self.call
        response = _EventStream(
            status=200,
            headers={
                **self._provider_headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-request-id": call.request_id,
            },
        )
        client_gone = False
        writer = None
        try:
            writer = await response.prepare(self.request)
        except CLIENT_GONE:
            # Gone before the upstream's first byte (a slow start): a disconnect like any other.
            client_gone = True
        failure: Outcome | None = None
        events = EventFilter(
            self.obs, dialect=call.dialect, choices=call.choices, client_wants_usage=call.client_wants_usage
        )
        guard = StallGuard(upstream, call.upstream.timeout_s)
        self._arm_renewal()
        # Looked up once: the loop runs once per read of the upstream, often once per event.
        next_piece = upstream.content.iter_any().__aiter__().__anext__
        read, write, monotonic = events.read, response.write, time.monotonic
        limit = self.services.config.limits.max_upstream_body_bytes
        secret = self._operator_key
        transport = self.request.transport
        waited_s = 0.0
        try:
            # What came with the upstream's headers goes out with ours, in one send; ours never
            # wait on the upstream: they go out (if no events took them) before any wait.
            pending = upstream.content.read_nowait()
            while True:
                if pending:
                    piece, pending = pending, b""
                else:
                    if writer is not None and not client_gone:
                        try:
                            writer.send_headers()  # nothing once they went out
                        except CLIENT_GONE:
                            client_gone = True
                    guard.waiting_since = waited = monotonic()
                    try:
                        piece = await next_piece()
                    except StopAsyncIteration:
                        break
                    guard.waiting_since = None
                    waited_s += monotonic() - waited
                # Every complete event of this read goes out in one write, as soon as it came.
                out = read(piece, limit=limit)
                if out is None:
                    failure = Outcome("upstream_error")  # one event larger than we hold
                    break
                if secret is not None and secret in out:  # whole events: a key is never cut
                    out = out.replace(secret, REDACTED)
                if not out or client_gone:
                    pass
                elif transport is not None and transport.get_write_buffer_size() + len(out) <= _WRITE_BACKLOG:
                    try:
                        await write(out)  # room in the buffer: no wait (``_to_client``'s first case)
                    except CLIENT_GONE:
                        client_gone = True
                else:
                    client_gone = not await self._to_client(write, out)
                if client_gone and call.policy.on_client_disconnect == "cancel":
                    break
        except TimeoutError:
            failure = Outcome("upstream_timeout")
        except UPSTREAM_BROKEN:
            failure = Outcome("upstream_error")
        except Exception:
            # Our own fault, after the response started: still settle, still end the stream.
            log.exception("stream relay failed", extra={"request_id": call.request_id})
            failure = Outcome("upstream_error")
        finally:
            self._upstream_s += waited_s
            guard.cancel()
            if self._renewal is not None:
                self._renewal.cancel()
                self._renewal = None
        if events.incomplete and failure is None and not client_gone:
            failure = Outcome("upstream_error")  # the stream ended inside an event

        if client_gone:
            cancelled = not self.obs.done and call.policy.on_client_disconnect == "cancel"
            # Cut by the proxy (cancel): what streamed is what was ordered, on the provider's
            # figures when they came. Drained: a failed or unfinished answer is not complete.
            healthy = not self.obs.error and not self.obs.malformed  # it had not failed first
            complete = healthy and (cancelled or self.obs.done)
            usage = self._usage(complete=complete)
            await self._settle(Outcome("client_disconnected"), usage)
            return response
        if failure is None and (self.obs.malformed or self.obs.error or not self.obs.done):
            failure = Outcome("upstream_error")
        if failure is not None:
            settlement = await self._settle(failure, self._usage(complete=False))
            tail = billing_comment(call, settlement)
            if (not self.obs.done and failure.tag != "upstream_error") or self._broken_transport(failure):
                tail += self.call.dialect.error_event(
                    f"The upstream stream failed ({failure.tag}).", "upstream_error", failure.tag
                )
            elif self.obs.done and call.dialect.done_marker:
                tail += call.dialect.done_marker
            await self._write_tail(response, tail)
            return response

        outcome = classify_answer(self.obs, call.policy, json_mode=call.json_mode)
        settlement = await self._settle(outcome, self._usage(complete=True))
        tail = billing_comment(call, settlement)
        if outcome.tag == "rejected":
            message = self._rejection_message(settlement)
            tail += self.call.dialect.error_event(message, "output_rejected", "output_rejected")
        elif call.dialect.done_marker:
            tail += call.dialect.done_marker
        await self._write_tail(response, tail)
        return response

    def _broken_transport(self, failure: Outcome) -> bool:
        return failure.tag == "upstream_error" and not self.obs.done and not self.obs.malformed

    async def _write_tail(self, response: web.StreamResponse, tail: bytes) -> None:
        # One write: the tail and the end of the chunked body.
        await self._to_client(response.write_eof, tail)

    async def _to_client(self, write: Callable[[bytes], Awaitable[None]], data: bytes) -> bool:
        """``write(data)``; False when the client is gone: it reset, or it stopped reading and was
        dropped (a close would wait for it to take what is buffered, holding the socket)."""
        transport = self.request.transport
        try:
            if transport is not None and transport.get_write_buffer_size() + len(data) <= _WRITE_BACKLOG:
                await write(data)  # room in the buffer: no wait
            else:
                # A client that stops reading must not stall renewals of the lease.
                async with asyncio.timeout(self._write_timeout_s):
                    await write(data)
        except CLIENT_GONE:
            return False
        except TimeoutError:
            if transport is not None:
                transport.abort()
            return False
        return True

    def _arm_renewal(self, since: float | None = None) -> None:
        """Renew every third of the lease, counted from the reserve (the lease started there)."""
        reservation = self.call.reservation
        if reservation is not None:
            due = (self.call.started_at if since is None else since) + reservation.lease_ms / 3000
            self._renewal = asyncio.get_running_loop().call_at(due, self._renew_due)

    def _renew_due(self) -> None:
        task = asyncio.ensure_future(self._renew())
        self._renewing.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._renewing.discard)
        self._arm_renewal(time.monotonic())

    async def _renew(self) -> None:
        reservation = self.call.reservation
        assert reservation is not None
        asked = time.monotonic()
        try:
            if await self.services.store.renew(
                tenant=reservation.tenant,
                reservation_id=reservation.id,
                lease_ms=reservation.lease_ms,
                scopes=reservation.scopes,  # a stream may outlive its run key's TTL
            ):
                self.call.lease_confirmed_at = asked
        except StoreError as err:
            # Not fatal: the stream goes on; the settle (or the journal) still follows.
            self.services.metrics.store_errors.labels("renew").inc()
            log.warning("lease renewal failed", extra={"request_id": self.call.request_id, "error": str(err)})


class _EventStream(web.StreamResponse):
    """A stream whose headers wait in aiohttp's buffer, as ``web.Response``'s do, until the relay
    sends them: with the first events when they came with the upstream's headers (one send, not
    two), else alone before it waits on the upstream."""

    _send_headers_immediately = False


def provider_usage_of(parsed: Any) -> BilledUsage | None:
    if not isinstance(parsed, dict):
        return None
    usage = parse_usage(parsed.get("usage"))
    if usage is None:
        return None
    obs = Observation(usage=usage)
    return provider_usage(obs)
