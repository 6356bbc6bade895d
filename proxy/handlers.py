"""HTTP handlers. Thin: each billed call reads as authenticate, estimate, reserve, then the
exchange (forward, observe, settle, record)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import HttpVersion11, hdrs, web, web_urldispatcher
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.auth import Identity, authenticate, presented_key
from proxy.billing_views import key_self, run_ledger, run_meters
from proxy.config import Config
from proxy.dialects import DIALECTS, Dialect, dialect_of_request
from proxy.error_answers import body_refusal, undecoded_after
from proxy.errors import (
    ApiError,
    BadRequest,
    BodyTimedOut,
    BodyTooLarge,
    BudgetExceeded,
    NotFound,
    StoreError,
    StoreRejected,
    StoreUnavailable,
    Unauthorized,
    UpstreamKeyUnset,
)
from proxy.forward import (
    account_scrubbed,
    caller_key_sent,
    operator_key_unset,
    operator_secrets,
    provider_headers,
    proxy_answered,
    proxy_refusal,
    read_limited,
    upstream_headers,
    upstream_url,
)
from proxy.ids import REQUEST_ID, request_id_for, run_id_for
from proxy.payload import Endpoint
from proxy.planning import count_later, count_now, planned
from proxy.reaper import registration_s
from proxy.record import record_refusal
from proxy.relay import Exchange
from proxy.reserve import Reloaded, Told, reserve
from proxy.scrub import scrubbed
from proxy.state import STATE, State
from proxy.store import Store

log = logging.getLogger("proxy.handlers")

MODELS_LIST_LIMIT_BYTES = 4 * 1024 * 1024


async def billed_call(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    config = state.config
    request_id = request[REQUEST_ID]
    try:
        identity = authenticate(request, config, passthrough=state.passthrough)
        run_id = run_id_for(request, state.ids)
        limits = config.limits
        raw = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
        told = Told()  # one call's metrics, whatever number of plans it takes
        while True:
            if state.config is not config:
                # Reloaded while the call waited (its body, which a client decides how long takes;
                # its count or the store, in ``reserve``): it is reserved, so judged, under the
                # config in force now (a key it revoked, a ceiling, a price or a route it changed).
                config = state.config
                identity = authenticate_again(request, config, raw, passthrough=state.passthrough)
            try:
                call = await planned(request, endpoint, raw, identity, run_id, config, state)
            except ApiError:
                if state.config is config:
                    raise
                # Reloaded while it was planned off the loop: judged under the config in force.
                continue
            try:
                await reserve(
                    await registered(state, identity),
                    state.journal,
                    call,
                    config,
                    metrics=state.metrics,
                    count_now=functools.partial(count_now, state=state),
                    count_later=functools.partial(count_later, state),
                    in_force=lambda: state.config,
                    told=told,
                )
                break
            except Reloaded:
                continue  # nothing reserved: planned again, from the body as it came
    except ApiError as err:
        if isinstance(err, BudgetExceeded):
            record_refusal(state.metrics, config, identity.tenant, err)
        return _refused(DIALECTS[endpoint], request_id, err)
    except StoreError as err:
        state.metrics.store_errors.labels("reserve").inc()
        refused_reserve(state, err)
        return _refused(DIALECTS[endpoint], request_id, StoreUnavailable())
    return await Exchange(request, call, state.services_for(config)).run()


def refused_reserve(state: State, err: StoreError) -> None:
    """Say why calls are answered 503: the store's own words (an OOM, a connection refused), at
    once and then every few seconds with how many were refused since; a script that refused its
    input (a bug of ours or a store not ours) at error level."""
    rejected = isinstance(err, StoreRejected)
    refused = (state.reserve_rejections if rejected else state.reserve_failures).tell()
    if refused:
        log.log(
            logging.ERROR if rejected else logging.WARNING,
            "the store refused a reserve: calls answered 503",
            extra={"operation": "reserve", "error": str(err)[:500], "refused": refused},
        )


def authenticate_again(request: web.Request, config: Config, raw: bytes, *, passthrough: bool) -> Identity:
    """The caller under a config reloaded since the call began."""
    identity = authenticate(request, config, passthrough=passthrough)
    if len(raw) > config.limits.max_body_bytes:
        # Read under the limit of its start: one it lowered refuses it as aiohttp would.
        raise BodyTooLarge()
    return identity


async def registered(state: State, identity: Identity) -> Store:
    """The store, with the caller's tenant in the registry the reapers read: registered by its
    first call in this process, and again by the first once half its registration is gone (a
    tenant no registration keeps, and that holds no lease, is dropped from it: ``run_reaper``)."""
    store = state.store
    if store is None:
        raise StoreError("store not opened")
    tenant = identity.tenant
    kept_s = registration_s(state.config)
    until_ms = state.registered_tenants.get(tenant)
    if until_ms is None or until_ms - store.now() * 1000 < kept_s * 500:
        try:
            until_ms = await store.register_tenant(tenant, kept_s=kept_s)
        except StoreError as err:
            # The registry is one key, on one master of a Cluster: down, it says nothing of the
            # tenant's own, where the call's keys are (one Redis down refuses the reserve next).
            # A tenant of the config goes on: every instance's reaper knows and registers it. A
            # pass-through caller's is known to this process alone, which may die before the
            # registry answers, its leases then reaped by no one: refused.
            if tenant not in state.config.tenants:
                raise
            log.warning(
                "tenant not registered yet; the reaper registers it",
                extra={"tenant": tenant, "error": str(err)},
            )
            until_ms = int((store.now() + kept_s) * 1000)
        state.registered_tenants[tenant] = until_ms
    return store


async def read_body(request: web.Request, limit_bytes: int, timeout_s: float) -> bytes:
    if request.client_max_size != limit_bytes:
        # The limit was reloaded after the app was built with the limit of its start.
        request = request.clone(client_max_size=limit_bytes)
    try:
        if request.content.is_eof():  # nearly every call: its body came with its headers
            return await request.read()
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise BodyTimedOut(timeout_s) from None
    except (RequestPayloadError, BadHttpMessage) as err:
        # A body that does not decode (bad gzip, broken chunking) is the client's error, said as
        # the parser's refusals are: aiohttp's own text is its exception's repr ("400, message:\n
        # Can not decode content-encoding: gzip").
        raise BadRequest(
            f"The request is not valid HTTP: {body_refusal(err)}.", code="bad_http_request"
        ) from None
    except ConnectionError:
        # The client left while its body was still coming (aiohttp fails the read with
        # ConnectionResetError): an ordinary disconnect, nothing reserved nor forwarded; no
        # "unhandled error" for the log. The answer reaches nobody.
        raise BadRequest("The connection was lost before the request body arrived whole.") from None


def _refused(dialect: Dialect, request_id: str, err: ApiError) -> web.Response:
    """An error before forwarding, in the format of the API the client speaks."""
    response = dialect.error_response(
        err.status,
        err.message,
        err.error_type,
        code=err.code,
        param=err.param,
        headers={**err.headers, **dialect.id_headers(request_id)},
    )
    if err.closes_connection:
        response.force_close()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await billed_call(request, "chat.completions")


async def completions(request: web.Request) -> web.StreamResponse:
    return await billed_call(request, "completions")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await billed_call(request, "embeddings")


async def responses(request: web.Request) -> web.StreamResponse:
    return await billed_call(request, "responses")


async def messages(request: web.Request) -> web.StreamResponse:
    return await billed_call(request, "messages")


async def list_models(request: web.Request) -> web.StreamResponse:
    """Forwarded, not billed: listing models costs no tokens. An Anthropic caller's list is of
    the upstream its Messages calls reach, in Anthropic's shape; an OpenAI caller's, of what any
    model name reaches."""
    state = request.app[STATE]
    config = state.config
    identity = authenticate(request, config, passthrough=state.passthrough)
    dialect = dialect_of_request(request)
    if dialect.anthropic_errors:
        routed = next(
            (
                item
                for item in config.models.items()
                if config.upstreams[item[1].upstream].kind == "anthropic"
            ),
            None,
        )
        if routed is None:  # no model the Messages API serves here: none to offer
            return web.json_response({"data": [], "has_more": False, "first_id": None, "last_id": None})
    else:
        routed = config.route("*") or next(iter(config.models.items()), None)
        if routed is None:  # no model routed (``models: {}``): nothing to list, nobody to ask
            return web.json_response({"object": "list", "data": []})
    upstream = config.upstreams[routed[1].upstream]
    if operator_key_unset(upstream, identity):
        raise UpstreamKeyUnset()
    assert state.session is not None
    sending = upstream.sending
    try:
        async with state.session.get(
            upstream_url(upstream, "/models", request.rel_url.raw_query_string),
            headers=upstream_headers(upstream, identity),
            timeout=aiohttp.ClientTimeout(total=upstream.timeout_s, connect=upstream.connect_timeout_s),
            # Never followed: the upstream's key would go to whatever host a redirect names
            # (aiohttp drops Authorization on another origin, not Anthropic's x-api-key).
            allow_redirects=False,
            proxy=sending.proxy,
            proxy_headers=sending.proxy_headers,
            ssl=sending.tls,
        ) as resp:
            body = await read_limited(resp, MODELS_LIST_LIMIT_BYTES)
    except aiohttp.ClientHttpProxyError as err:  # the egress proxy refused the CONNECT
        return _proxy_refused(dialect, proxy_refusal(err.status), err.status)
    except (TimeoutError, ValueError, aiohttp.ClientError):
        return dialect.error_response(
            502, "The upstream could not list models.", "upstream_error", code="upstream_error"
        )
    if sending.plain_proxy and (refused := proxy_answered(resp.status, resp.headers)):
        return _proxy_refused(dialect, refused, resp.status)
    secrets = operator_secrets(upstream, identity)
    body = scrubbed(body, secrets)
    passed = provider_headers(resp, secrets)
    if 300 <= resp.status < 400:
        return dialect.error_response(
            502,
            f"The upstream redirected the model list (HTTP {resp.status}); the proxy does not follow "
            "redirects: its upstream base_url needs fixing.",
            "upstream_error",
            code="upstream_redirect",
            headers={"x-should-retry": "false"},
        )
    if resp.status in (401, 403) and not caller_key_sent(upstream, identity):
        # The upstream refused the proxy's own credentials (or none: an upstream configured
        # without a key): not the caller's fault, whatever the body (a gateway in front of the
        # provider refuses its basic auth with a page of HTML).
        return dialect.error_response(
            502,
            f"The upstream refused the proxy's credentials (HTTP {resp.status}).",
            "upstream_error",
            code="upstream_auth",
            headers={"x-should-retry": "false"},
        )
    if 400 <= resp.status < 500 and _is_error_object(body):
        # The caller's own key refused, a rate limit: the provider's answer, as for a billed call.
        body = account_scrubbed(body, resp, upstream, identity)
        return web.Response(status=resp.status, body=body, content_type="application/json", headers=passed)
    if resp.status != 200 or not body.lstrip().startswith(b"{"):
        # With the provider's retry advice (a 503's retry-after, its x-should-retry), as a billed
        # call's error answer: the SDK retries a 502 when and whether the provider said to.
        return dialect.error_response(
            502,
            f"The upstream could not list models (HTTP {resp.status}).",
            "upstream_error",
            code="upstream_error",
            headers=passed,
        )
    return web.Response(status=200, body=body, content_type="application/json", headers=passed)


def _proxy_refused(dialect: Dialect, why: str, status: int) -> web.Response:
    # In the proxy's words for it, never the egress proxy's (its page may quote what it was sent).
    return dialect.error_response(
        502,
        f"The upstream could not list models: {why}.",
        "upstream_error",
        code="upstream_error",
        headers={"x-should-retry": "false"} if status in (403, 407) else None,
    )


def _is_error_object(body: bytes) -> bool:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)


def metrics_handler(state: State) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        # Off the loop: its cost is the series' (tenants x models x endpoints x outcomes...), a
        # second and more at a thousand tenants, which every call and stream would stand still for.
        assert state.expositions is not None, "opened with the app (app.expositions_ctx)"
        body = await state.expositions.latest()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler


async def metrics(request: web.Request) -> web.StreamResponse:
    """Prometheus on the main port: operators only, since it names every tenant's spend."""
    state = request.app[STATE]
    key = presented_key(request)
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest() if key else ""
    allowed = False
    for known in state.config.admin_digests:
        allowed |= hmac.compare_digest(known, digest)
    if not allowed:
        raise Unauthorized("/metrics needs an admin key (admin_keys in the config), or use metrics.listen.")
    if state.workers > 1:
        # The port is shared: each scrape would read whichever worker took it, and Prometheus
        # would take every switch between them for a counter reset.
        raise NotFound(
            f"With {state.workers} workers each keeps its own metrics: scrape each worker on "
            "metrics.listen (its port + the worker's index), not the shared port."
        )
    return await metrics_handler(state)(request)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.store is None:
        return web.json_response({"status": "unavailable"}, status=503)
    try:
        await state.store.ping()
    except StoreError as err:
        # The reason names the store's address: for the log, not for anyone who can reach here.
        log.warning("not ready: store unreachable", extra={"error": str(err)[:200]})
        return web.json_response({"status": "unavailable", "store": "unreachable"}, status=503)
    return web.json_response({"status": "ready"})


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """aiohttp's own, except that an expectation it cannot meet is refused in OpenAI's format:
    this runs before any middleware."""
    if request.version != HttpVersion11:
        return None
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        dialect = dialect_of_request(request)
        refused = dialect.error_response(
            417,
            f"Unknown Expect: {expect[:100]}",
            "invalid_request_error",
            code="expectation_failed",
            headers=dialect.id_headers(request_id_for(request, request.app[STATE].ids)),
        )
        return undecoded_after(request, refused)  # answered before any middleware
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the response proper has not started
    return None


async def expect_continue_once_known(request: web.Request) -> web.StreamResponse | None:
    """``expect_continue`` for a billed call: a caller the proxy does not know, a run id it
    refuses, or a body announced past the limit, is refused before the body is sent (it may be
    megabytes), not after."""
    state = request.app[STATE]
    try:
        authenticate(request, state.config, passthrough=state.passthrough)
        run_id_for(request, state.ids)  # its id, when the header names none, is made again later
        # A compressed body is judged by its decoded size, which its length does not tell.
        length = None if hdrs.CONTENT_ENCODING in request.headers else request.content_length
        if length is not None and length > state.config.limits.max_body_bytes:
            raise BodyTooLarge()
    except ApiError as err:
        refused = _refused(dialect_of_request(request), request_id_for(request, state.ids), err)
        # The body was never asked for: a client that leaves it unsent and reuses the connection
        # would have its next request read as that body. The connection ends with this answer.
        refused.force_close()
        # A client may send its body without waiting: a compressed one is not decoded either.
        return undecoded_after(request, refused)
    return await expect_continue(request)


def add_routes(app: web.Application) -> None:
    post = functools.partial(app.router.add_post, expect_handler=expect_continue_once_known)
    post("/v1/chat/completions", chat_completions)
    post("/v1/completions", completions)
    post("/v1/embeddings", embeddings)
    post("/v1/responses", responses)
    post("/v1/messages", messages)
    get = functools.partial(app.router.add_get, expect_handler=expect_continue)
    get("/v1/models", list_models)
    get("/v1/billing/runs/{run_id}", run_meters)
    get("/v1/billing/runs/{run_id}/ledger", run_ledger)
    get("/v1/billing/keys/self", key_self)
    get("/metrics", metrics)
    get("/healthz", healthz)
    get("/readyz", readyz)
    # A 404 or 405 (aiohttp's SystemRoute) has aiohttp's own expect handler: an unknown
    # expectation on an unknown path or a wrong method would be refused in text/plain.
    resolve = app.router.resolve

    async def resolve_with_our_expect(request: web.Request) -> web_urldispatcher.UrlMappingMatchInfo:
        match_info = await resolve(request)
        if isinstance(match_info.route, web_urldispatcher.SystemRoute):
            match_info.route._expect_handler = expect_continue
        return match_info

    app.router.resolve = resolve_with_our_expect  # type: ignore[method-assign]
