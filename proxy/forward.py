"""Send a reserved call to its upstream. Only upstreams from config; never the client's key."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit

import aiohttp
import orjson
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from multidict import CIMultiDictProxy
from yarl import URL

from proxy.auth import Identity
from proxy.call import Call
from proxy.config import UpstreamConfig
from proxy.scrub import NO_SECRETS, REDACTED, Secrets, secrets_of, spelled, spelled_scrubbed

# How often a stream call waiting for its upstream's headers looks whether its client left
# (``cancel``: ``unless_client_leaves``): aiohttp tells a handler nothing when its client goes.
CLIENT_WATCH_S = 0.1
FailureKind = Literal["connect", "timeout", "transport", "connect_timeout", "client_gone"]

log = logging.getLogger("proxy.forward")


@dataclass(frozen=True, slots=True)
class TransportFailure:
    """The upstream could not be reached or broke off before answering."""

    kind: FailureKind
    detail: str
    # The client's x-should-retry, where the proxy knows better than the SDK's default (a 407:
    # the same credentials are refused again).
    retry: bool | None = None

    @property
    def went_out(self) -> bool:
        # A connection refused or never made carried no request; anything later may have been
        # billed. A call cut as its client left is one that went out (``relay``: cut only then).
        return self.kind not in ("connect", "connect_timeout")


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamSending:
    """What every call to one upstream sends alike, worked out once per config
    (``UpstreamConfig.sending``): read on every call, a pydantic config's fields are slow reads."""

    base_url: str
    kind: Literal["openai", "anthropic"]
    passthrough_auth: bool
    # The headers of a call the caller's own key does not go with (the operator's key, or none);
    # copied per call (a call adds its own).
    operator_headers: dict[str, str]
    # ``operator_secrets`` of such a call, and of one the caller's own key goes with.
    operator_secrets: Secrets
    url_secrets: Secrets
    operator_key_unset: bool  # see ``operator_key_unset``
    whole_timeout: aiohttp.ClientTimeout
    stream_timeout: aiohttp.ClientTimeout
    headers_within_s: float  # a stream's headers, from the start of its connection
    # The egress proxy every request to the upstream goes through (None: none), and the
    # Proxy-Authorization of its credentials: in the CONNECT of an https upstream
    # (``proxy_headers``: never inside the tunnel, which the provider reads), on each request of
    # an http one, which the proxy reads (in ``operator_headers`` and ``_headers``' copies).
    proxy: URL | None
    proxy_headers: dict[str, str] | None
    # A proxy that is sent the upstream's requests themselves (an http upstream: no tunnel), and
    # may answer them itself (``proxy_answered``).
    plain_proxy: bool
    # What its TLS certificate is verified against: the context of its ``ca_file`` (built at
    # load), else True, the connector's default (the system's CAs). Also the pool's key: a
    # connection verified under one upstream's CAs is never handed to another's call.
    tls: ssl.SSLContext | Literal[True]

    @classmethod
    def of(cls, upstream: UpstreamConfig) -> UpstreamSending:
        key = upstream.api_key.get_secret_value() if upstream.api_key is not None else None
        # The proxy's credentials are the operator's whoever's key goes: a proxy that passes its
        # Proxy-Authorization on (an http upstream) to an upstream echoing it, or that quotes it
        # in an error page it answers, must not show them to a caller.
        egress = upstream.egress
        proxy_auth = proxy_authorization(upstream)
        in_url = (*url_credentials(upstream.base_url), *proxy_credentials(upstream))
        sought = (key,) if key is not None and len(key) >= _MIN_SECRET else ()
        tunnelled = upstream.base_url.startswith("https:")
        return cls(
            base_url=upstream.base_url,
            kind=upstream.kind,
            passthrough_auth=upstream.passthrough_auth,
            operator_headers=_headers(upstream, key, ()),
            operator_secrets=secrets_of((*sought, *in_url)),
            url_secrets=secrets_of(in_url),
            operator_key_unset=bool(upstream.api_key_env) and key is None,
            # A stream may legitimately run long; what must not happen is silence.
            whole_timeout=aiohttp.ClientTimeout(total=upstream.timeout_s, connect=upstream.connect_timeout_s),
            stream_timeout=aiohttp.ClientTimeout(
                total=None, connect=upstream.connect_timeout_s, sock_read=upstream.timeout_s
            ),
            headers_within_s=upstream.connect_timeout_s + upstream.timeout_s,
            proxy=None if egress is None else URL(egress.url),
            proxy_headers={PROXY_AUTHORIZATION: proxy_auth} if proxy_auth and tunnelled else None,
            plain_proxy=egress is not None and not tunnelled,
            tls=True if upstream.ca_context is None else upstream.ca_context,
        )


def upstream_headers(upstream: UpstreamConfig, identity: Identity) -> dict[str, str]:
    sending = upstream.sending
    if not sending.passthrough_auth:
        return dict(sending.operator_headers)
    key = identity.upstream_key
    if key is None and upstream.api_key is not None:
        key = upstream.api_key.get_secret_value()
    return _headers(upstream, key, identity.upstream_scope)


def _headers(upstream: UpstreamConfig, key: str | None, scope: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """A call's headers with ``key`` (None: none) and, beside a pass-through upstream's bearer
    key, the caller's ``scope``."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    proxy_auth = proxy_authorization(upstream)
    if proxy_auth is not None and not upstream.base_url.startswith("https:"):
        headers[PROXY_AUTHORIZATION] = proxy_auth  # see ``UpstreamSending.proxy_headers``
    if upstream.kind == "anthropic":
        headers["anthropic-version"] = upstream.anthropic_version
        if key:
            headers["x-api-key"] = key
    elif key:
        headers["Authorization"] = f"Bearer {key}"
        if upstream.passthrough_auth:
            headers.update(scope)
    return headers


# Request headers that switch a provider's features on, passed on as the client sent them (its
# SDK sets them: ``betas=[...]``). Usage still comes from the provider, so billing holds; what a
# beta costs per token is the operator's price list.
FEATURE_HEADERS: dict[str, tuple[str, ...]] = {"anthropic": ("anthropic-beta",), "openai": ()}


def header_list(request_headers: CIMultiDictProxy[str], name: str) -> str:
    """Every line of a header, as one: two lines are one comma-separated list (RFC 9110)."""
    return ",".join(request_headers.getall(name, []))


def feature_headers(request_headers: CIMultiDictProxy[str], upstream: UpstreamConfig) -> dict[str, str]:
    out = {}
    for name in FEATURE_HEADERS.get(upstream.sending.kind, ()):
        value = header_list(request_headers, name)  # each beta of every line counts
        if value:
            out[name] = value
    return out


def operator_key_unset(upstream: UpstreamConfig, identity: Identity) -> bool:
    """Whether the operator's key would authorize a request of ``identity`` to ``upstream`` and
    its variable (``api_key_env``) is unset or empty: such a call is not forwarded."""
    sending = upstream.sending
    if sending.passthrough_auth and identity.upstream_key is not None:  # ``caller_key_sent``
        return False
    return sending.operator_key_unset


def caller_key_sent(upstream: UpstreamConfig, identity: Identity) -> bool:
    """Whether the caller's own key goes to ``upstream`` (a pass-through caller's): the one
    case where the upstream refusing its credentials is the caller's to hear. Otherwise the
    operator's credentials went, or none did (an upstream configured without a key, a
    pass-through upstream called with a proxy key): a refusal is the operator's to mend."""
    return upstream.sending.passthrough_auth and identity.upstream_key is not None


def operator_secrets(upstream: UpstreamConfig, identity: Identity) -> Secrets:
    """Every credential of the operator's a request of ``identity`` to ``upstream`` carries, as
    an upstream echoing it would show it: its key (unless the caller's own goes instead) and the
    credentials of its ``base_url`` (sent as basic auth, beside a pass-through caller's key too).
    An upstream must never pass one on."""
    sending = upstream.sending
    if sending.passthrough_auth and identity.upstream_key is not None:  # ``caller_key_sent``
        return sending.url_secrets
    return sending.operator_secrets


# A credential shorter than this is not looked for: a key such as vLLM's placeholder "EMPTY" or
# Ollama's "ollama", or a URL's user name such as "api", is no secret, and would be replaced in
# answers that name it (a completion's text) or happen to hold it (an embedding's base64, a short
# basic auth token in an image's).
_MIN_SECRET = 8


@functools.cache
def basic_token(base_url: str) -> bytes | None:
    """The basic auth token aiohttp sends for the credentials of ``base_url`` (None: none, or
    none it can send)."""
    parts = urlsplit(base_url)
    if parts.username is None and parts.password is None:
        return None
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    try:
        return base64.b64encode(f"{user}:{password}".encode("latin1"))
    except UnicodeEncodeError:
        return None  # aiohttp cannot send it either: nothing goes out


@functools.cache
def url_credentials(base_url: str) -> tuple[str, ...]:
    """The credentials of ``base_url`` sought in answers: as aiohttp sends them (the basic auth
    token) and as they read (the password, or a user name that is a token of its own)."""
    # Not parsed by yarl: a host it cannot encode (refused when the call is sent, a 502) must
    # not fail the reserve that asks this first.
    parts = urlsplit(base_url)
    if parts.username is None and parts.password is None:
        return ()
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    out: list[str] = []
    token = basic_token(base_url)
    if token is not None and len(token) >= _MIN_SECRET:
        out.append(token.decode())
    part = password or user
    if len(part) >= _MIN_SECRET:
        out.append(part)
    return tuple(out)


PROXY_AUTHORIZATION = "Proxy-Authorization"


def proxy_authorization(upstream: UpstreamConfig) -> str | None:
    """The Proxy-Authorization of ``upstream``'s egress proxy (None: no proxy, or none without
    credentials)."""
    egress = upstream.egress
    if egress is None or (egress.user is None and egress.password is None):
        return None
    password = "" if egress.password is None else egress.password.get_secret_value()
    # latin-1, as the config checked it and as servers read basic auth.
    return aiohttp.encode_basic_auth(egress.user or "", password, encoding="latin1")


def proxy_credentials(upstream: UpstreamConfig) -> tuple[str, ...]:
    """An egress proxy's credentials sought in answers: the basic auth token it is sent, and the
    password (or a user name that is a token of its own), as ``url_credentials``."""
    authorization = proxy_authorization(upstream)
    egress = upstream.egress
    if authorization is None or egress is None:
        return ()
    password = "" if egress.password is None else egress.password.get_secret_value()
    texts = (authorization.removeprefix("Basic "), password or egress.user or "")
    return tuple(text for text in texts if len(text) >= _MIN_SECRET)


# An egress proxy's refusal, as the client is told it: never its words (its reason phrase, its
# page), which may name its address or quote what it was sent.
PROXY_AUTH_REFUSED = "the egress proxy refused the proxy's credentials (HTTP 407)"


def proxy_refusal(status: int) -> str:
    if status == 407:
        return PROXY_AUTH_REFUSED
    return f"the egress proxy could not connect to the upstream (HTTP {status} to its CONNECT)"


# RFC 9209's Proxy-Status errors that say the proxy never reached the origin (so the request went
# no further), and Squid's own X-Squid-Error names for the same.
_NEVER_REACHED = frozenset(
    {
        "dns_error",
        "dns_timeout",
        "destination_not_found",
        "destination_unavailable",
        "destination_ip_prohibited",
        "destination_ip_unroutable",
        "connection_refused",
        "connection_terminated",
        "connection_timeout",
        "http_request_denied",
    }
)
_SQUID_NEVER_REACHED = {
    "ERR_CONNECT_FAIL": "connection_refused",
    "ERR_DNS_FAIL": "dns_error",
    "ERR_ACCESS_DENIED": "http_request_denied",
    "ERR_CANNOT_FORWARD": "destination_unavailable",
}
_PROXY_STATUS_ERROR = re.compile(r";\s*error\s*=\s*\"?([A-Za-z0-9_]+)")


def proxy_answered(status: int, headers: CIMultiDictProxy[str]) -> str | None:
    """Why an http upstream's egress proxy answered its request itself, having never reached the
    provider (None: the answer may be the provider's). A 407 is a proxy's alone (RFC 9110); a
    403 or a 5xx is the proxy's when it says so: RFC 9209's ``Proxy-Status`` naming an error of
    reaching the origin, or Squid's ``X-Squid-Error``. In fixed words, never the proxy's own."""
    if status == 407:
        return PROXY_AUTH_REFUSED
    if status != 403 and status < 500:
        return None
    named = _PROXY_STATUS_ERROR.findall(",".join(headers.getall("Proxy-Status", [])).lower())
    squid = headers.get("X-Squid-Error", "").split(" ", 1)[0]
    why = next((error for error in named if error in _NEVER_REACHED), _SQUID_NEVER_REACHED.get(squid))
    if why is None:
        return None
    return f"the egress proxy could not reach the upstream (HTTP {status}, {why})"


# What of the provider's response headers reaches the client: what its SDK acts on (when and
# whether to retry), the provider's limits, timing and version. Not its cookies, its framing
# (the proxy re-frames) nor its organization or project (the operator's, with the proxy's key).
PASSED_HEADERS = frozenset(
    {"retry-after", "retry-after-ms", "x-should-retry", "openai-processing-ms", "openai-version"}
)
PASSED_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")
# The provider's id of the call, for a support ticket; x-request-id is the proxy's (the ledger's).
UPSTREAM_ID_HEADERS = frozenset({"x-request-id", "request-id"})
# What a query may hold unescaped (RFC 3986), and the escapes themselves: kept as they came.
QUERY_SAFE = "!$&'()*+,;=:@/?%"


def provider_headers(upstream: aiohttp.ClientResponse, secrets: Secrets = NO_SECRETS) -> dict[str, str]:
    """The provider's headers the client gets; the operator's ``secrets`` (``operator_secrets``)
    echoed in one of them are replaced, as in a body."""
    out: dict[str, str] = {}
    for name, value in upstream.headers.items():
        low = name.lower()
        if low in PASSED_HEADERS or low.startswith(PASSED_PREFIXES):
            # By its lowercase name: the proxy's own x-should-retry (a refusal no retry mends)
            # replaces the provider's, whatever its case, instead of going out beside it.
            out[low] = value
        elif low in UPSTREAM_ID_HEADERS:
            out["x-upstream-request-id"] = value
    for secret in secrets.forms if out else ():
        # aiohttp reads header values as UTF-8, other bytes as surrogate escapes.
        text = secret.decode("utf-8", "surrogateescape")
        for name, value in out.items():
            if text in value:
                out[name] = value.replace(text, "[REDACTED]")
    return out


# The provider's account a response names when the operator's credentials went: dropped from the
# headers passed on (``PASSED_HEADERS``), and so replaced in the error bodies the proxy relays
# (OpenAI's 429 reads "Rate limit reached for gpt-4o-mini in organization org-... on tokens per
# min"). OpenAI's ids (24 letters and digits after the prefix) also where it sends no header.
# Never in an answer: the organization's name is part of its fine-tuned models' ids.
ACCOUNT_HEADERS = ("openai-organization", "openai-project", "anthropic-organization-id")
# Sought wherever they start, not only after a character no id holds: the raw bytes before an
# id may end an escape (the ``n`` of ``\n``, a ``\u00a0``), which reads as a letter or a digit.
# Its cost, an id-shaped tail of some longer word replaced in an error body, is none.
ACCOUNT_IDS = re.compile(rb"(?:org-|proj_)[A-Za-z0-9]{24}(?![A-Za-z0-9])")
# The same ids however a JSON string spells them (a letter as \u0061), sought in a body holding a
# \u escape: its client's JSON decoder reads the id back.
_ALNUM = rb"(?:[A-Za-z0-9]|\\u00(?:3[0-9]|[46][1-9a-fA-F]|[57][0-9aA]))"
_PREFIXES = spelled("org-") + b"|" + spelled("proj_")
ACCOUNT_IDS_SPELLED = re.compile(rb"(?:%s)%s{24}(?!%s)" % (_PREFIXES, _ALNUM, _ALNUM))


def account_scrubbed(
    raw: bytes, upstream: aiohttp.ClientResponse, upstream_config: UpstreamConfig, identity: Identity
) -> bytes:
    """``raw`` (an error body) without the operator's account at the provider, named in
    ``upstream``'s headers or as OpenAI writes its ids; as it came when the caller's own key went
    (its own account)."""
    if caller_key_sent(upstream_config, identity):
        return raw
    escaped = raw.find(b"\\u") >= 0
    for name in ACCOUNT_HEADERS:
        value = upstream.headers.get(name, "").strip()
        if len(value) >= 4 and raw.find(named := value.encode("utf-8", "surrogateescape")) >= 0:
            raw = raw.replace(named, REDACTED)
        if len(value) >= 4 and escaped:  # an error body: compiled (and cached by ``re``) seldom
            with contextlib.suppress(UnicodeEncodeError):
                raw = spelled_scrubbed(raw, re.compile(spelled(value)))
    return spelled_scrubbed(raw, ACCOUNT_IDS_SPELLED) if escaped else ACCOUNT_IDS.sub(REDACTED, raw)


def timeout_for(call: Call) -> aiohttp.ClientTimeout:
    sending = call.upstream.sending
    return sending.stream_timeout if call.stream else sending.whole_timeout


def upstream_url(upstream: UpstreamConfig, path: str, query: str) -> str | URL:
    """``path`` at ``upstream`` with the client's ``query`` (``raw_query_string``)."""
    url = upstream.sending.base_url + path
    if not query:
        return url
    # Its escapes as they came: a parse of the whole URL would decode some (%2F, %3F, %7E),
    # which a signed query's signature covers. Only bytes a URL may not hold are escaped.
    return URL(f"{URL(url)}?{quote(query, safe=QUERY_SAFE)}", encoded=True)


class _Sending:
    """The call whose request the running task is sending, until it is sent."""

    __slots__ = ("call",)

    def __init__(self, call: Call) -> None:
        self.call: Call | None = call


# The call whose request the running task is sending (``open_upstream``): its connector tells
# it when its connection is made (``UpstreamConnector``). Held in a box emptied once the call is
# sent: a connection made in this context keeps a copy of it (its transport, its keep-alive
# timer) for as long as it is pooled, and the call (its body, its prompt) must not live as long.
_SENDING: ContextVar[_Sending | None] = ContextVar("sending", default=None)


class UpstreamConnector(aiohttp.TCPConnector):
    """The upstream session's connector: a call stays ``connecting`` from the start of its
    connection (a name to resolve, a TCP or TLS handshake, the pool) until it is made, the last
    step before its request is written. A call cut (shutdown) while still connecting never went
    out: nothing is billed (``relay.Exchange.run``)."""

    async def connect(
        self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> Connection:
        sending = _SENDING.get()
        call = None if sending is None else sending.call
        if call is not None:
            call.connecting = True
        # aiohttp hands out a pooled connection that is open and within its keep-alive, whatever
        # came in on it while it sat idle: an answer the upstream sent unasked (a duplicate, a
        # gateway's answer to bytes it took for a request) is parsed and queued, and the next
        # call sent on it reads that as its own, its real answer going to the call after it.
        # Checked on the public ``connect`` every connection comes through, not in the private
        # ``_get`` that takes one from the pool (its signature has changed between releases): the
        # connection handed out has its request written at once.
        while True:
            connection = await super().connect(req, traces, timeout)
            protocol = connection.protocol
            if protocol is None or not protocol.should_close:  # nothing came in on it unasked
                break
            log.warning(
                "an idle upstream connection was sent bytes unasked: closed", extra={"host": req.host}
            )
            connection.close()
        if call is not None:
            call.connecting = False  # not on a failure: a cancel then reaches the call's handler with it set
        return connection


async def open_upstream(
    session: aiohttp.ClientSession, call: Call, query: str = ""
) -> aiohttp.ClientResponse | TransportFailure:
    sending = _Sending(call)
    _SENDING.set(sending)  # the handler's task's own context: no other call's
    try:
        return await _post(session, call, query)
    finally:
        sending.call = None


async def _post(
    session: aiohttp.ClientSession, call: Call, query: str
) -> aiohttp.ClientResponse | TransportFailure:
    # Always the parsed body: raw bytes with duplicate keys could mean one thing to our parser
    # (what was validated and reserved) and another to the upstream's.
    data = orjson.dumps(call.body)
    try:
        # The client's query as it came (still percent-encoded): an Azure-style api-version, a
        # server's options, the anthropic SDK's ?beta=true. OpenAI, Anthropic, vLLM and SGLang
        # read no body field from it; an upstream that did could run what was not reserved.
        url = upstream_url(call.upstream, call.dialect.path, query)
        headers = upstream_headers(call.upstream, call.identity)
        headers.update(call.feature_headers)
        # A stream's headers within timeout_s of its connection, as a whole answer's: sock_read
        # alone starts again at every byte, so headers that trickled in held the call for as
        # long as they came. Never first in the connect: that is connect_timeout_s's, and a call
        # never connected is billed nothing.
        sending = call.upstream.sending
        posting = session.post(
            url,
            data=data,
            headers=headers,
            timeout=timeout_for(call),
            allow_redirects=False,
            proxy=sending.proxy,
            proxy_headers=sending.proxy_headers,
            ssl=sending.tls,
        )
        if not call.stream:  # bounded by its own ClientTimeout; a timeout of None costs 2 us
            response = await posting
        else:
            async with asyncio.timeout(sending.headers_within_s):
                response = await posting
    except aiohttp.ClientProxyConnectionError as err:
        # The proxy itself not reached (refused, its name not resolved): nothing went out.
        return TransportFailure(
            "connect", f"cannot connect to the egress proxy: {_connect_refusal(err.os_error)}"
        )
    except aiohttp.ClientConnectorError as err:
        if isinstance(err.os_error, ssl.SSLCertVerificationError):
            # The operator's to mend (the upstream's CA, or an intercepting proxy's, not trusted):
            # said where they look, the field to set named. The request was never written.
            log.warning(
                "the upstream's TLS certificate is not trusted: its CA goes in ca_file",
                extra={"upstream": call.upstream_name, "reason": _untrusted(err.os_error)},
            )
        return TransportFailure("connect", f"cannot connect to upstream: {_connect_refusal(err.os_error)}")
    except aiohttp.ClientHttpProxyError as err:
        # The proxy refused the CONNECT of an https upstream (407: its credentials; 403: its
        # rules; 502, 503: it could not reach the upstream). The tunnel never opened: no byte of
        # the request left the proxy's side, so nothing is billed, as for a connection refused.
        return TransportFailure(
            "connect", proxy_refusal(err.status), retry=False if err.status in (403, 407) else None
        )
    except ValueError as err:
        # aiohttp (or yarl, for a query's URL) refused to build the request (a header value it
        # cannot send, a host with no IDNA form, a base_url password outside latin-1): nothing
        # went out. Its words are not the client's: they quote the URL, the operator's password
        # in it, or a character of that password and where it stands.
        log.error(
            "the upstream request could not be built",
            extra={"upstream": call.upstream_name, "error": type(err).__name__},
        )
        return TransportFailure(
            "connect",
            "cannot send the request upstream: the proxy could not build it "
            f"(upstreams.{call.upstream_name}: its base_url, the query or a header it cannot send)",
        )
    except aiohttp.ConnectionTimeoutError:
        return TransportFailure("connect_timeout", "cannot connect to upstream: connect timed out")
    except TimeoutError:
        if call.connecting:
            # A total timeout below connect_timeout_s ran out before the connection was made
            # (aiohttp raises it bare): the request never left.
            return TransportFailure("connect_timeout", "cannot connect to upstream: timed out connecting")
        return TransportFailure("timeout", "upstream did not answer in time")
    except aiohttp.ClientError as err:
        if call.connecting:
            # Failed before its connection was made (a tunnel the proxy closed during the TLS
            # handshake, say): the request was never written.
            return TransportFailure("connect", f"cannot connect to upstream: {type(err).__name__}")
        return TransportFailure("transport", f"upstream connection failed: {type(err).__name__}")
    if sending.plain_proxy and (refused := proxy_answered(response.status, response.headers)):
        # An http upstream's request, sent to the proxy, answered by the proxy itself: the
        # request went no further. (Inside an https upstream's tunnel only the provider answers.)
        response.close()
        return TransportFailure("connect", refused, retry=False if response.status in (403, 407) else None)
    return response


def _connect_refusal(err: OSError) -> str:
    """What the client is told of a connection its upstream did not take: the system's words for
    it, never asyncio's or aiohttp's, which name the upstream's address (the operator's network;
    "Connect call failed ('10.0.3.7', 8000)")."""
    if isinstance(err, ssl.SSLCertVerificationError):
        return f"its TLS certificate is not trusted ({_untrusted(err)})"
    if isinstance(err, ssl.SSLError):  # its number is OpenSSL's, not the system's
        return f"the TLS handshake failed ({getattr(err, 'reason', None) or type(err).__name__})"
    if isinstance(err, socket.gaierror):
        return err.strerror or "its host name did not resolve"
    return os.strerror(err.errno) if err.errno else "the connection failed"


# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH: Python's words for
# them quote the host or address, the operator's network.
_NAMES_THE_HOST = frozenset({62, 64})


def _untrusted(err: ssl.SSLCertVerificationError) -> str:
    """Why a certificate was refused, in OpenSSL's fixed words for it ("self-signed certificate in
    certificate chain", "unable to get local issuer certificate", "certificate has expired")."""
    # Set by OpenSSL's handshake; an error raised otherwise (a library's own) has neither.
    if getattr(err, "verify_code", None) in _NAMES_THE_HOST:
        return "it does not name the upstream's host"
    return str(getattr(err, "verify_message", None) or "certificate verify failed")


class BodyTooLarge(ValueError):
    """An upstream body over ``limits.max_upstream_body_bytes``: the same call makes it again."""


async def read_limited(
    response: aiohttp.ClientResponse, limit: int, chunks: list[bytes] | None = None
) -> bytes:
    """The whole body, refusing one larger than ``limit`` bytes. ``chunks`` keeps what came
    should the read fail (a body cut after its last byte still carries its usage); emptied once
    the body is whole."""
    chunks = [] if chunks is None else chunks
    size = 0
    async for piece in response.content.iter_any():
        size += len(piece)
        if size > limit:
            raise BodyTooLarge(f"upstream body exceeds {limit} bytes")
        chunks.append(piece)
    body = b"".join(chunks)
    # Kept, the pieces would hold the body a second time for as long as the caller's frame
    # (through the parse and the settle of an answer of up to 64 MiB).
    chunks.clear()
    return body


class StallGuard:
    """Fails a stream's pending read once the relay has waited ``timeout_s`` on a silent upstream.

    aiohttp's ``sock_read`` re-arms a timer on every socket read; this one is re-armed only when
    it fires. The relay sets ``waiting_since`` while it waits for the next piece (and clears it
    while it writes to the client, as aiohttp stops its timer while reading is paused: only the
    upstream's silence counts). It takes over from ``sock_read`` once the response has started
    (that still bounds the wait for headers)."""

    __slots__ = ("_handle", "_response", "_timeout_s", "waiting_since")

    def __init__(self, response: aiohttp.ClientResponse, timeout_s: float) -> None:
        self._response = response
        self._timeout_s = timeout_s
        self.waiting_since: float | None = None
        connection = response.connection
        if connection is not None and connection.protocol is not None:
            connection.protocol.read_timeout = None  # set again for the connection's next request
            connection.protocol.start_timeout()  # with no timeout: cancels the one armed last read
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            timeout_s, self._check
        )

    def _check(self) -> None:
        since = self.waiting_since
        due = (time.monotonic() if since is None else since) + self._timeout_s
        now = time.monotonic()
        if since is None or now < due:
            # A delay, not call_at(due): the loop's clock need not be time.monotonic's (uvloop's is
            # libuv's).
            self._handle = asyncio.get_running_loop().call_later(due - now, self._check)
            return
        self._handle = None
        self._response.content.set_exception(aiohttp.SocketTimeoutError("upstream silent mid-stream"))

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def unless_client_leaves(
    opening: Coroutine[Any, Any, aiohttp.ClientResponse | TransportFailure],
    call: Call,
    client: asyncio.BaseTransport | None,
) -> aiohttp.ClientResponse | TransportFailure:
    """The upstream's answer (``opening``), or, its client gone first (``cancel``), the call cut
    before its headers: a stream closed early stops the provider writing it (a reasoning
    model's long silence, a client's short timeout), as a stream cut mid-answer does."""
    sending = asyncio.ensure_future(opening)
    try:
        while not (await asyncio.wait((sending,), timeout=CLIENT_WATCH_S))[0]:
            if client is None or client.is_closing():
                sending.cancel()
                await asyncio.wait((sending,))
                if not sending.cancelled():  # answered meanwhile: read as any answer
                    return sending.result()
                if call.connecting:  # nothing went out: billed nothing
                    return TransportFailure("connect", "the client left before the call was sent")
                return TransportFailure("client_gone", "the client left before the upstream answered")
    except asyncio.CancelledError:  # shutdown past its grace: the request goes with the handler
        sending.cancel()
        raise
    return sending.result()
