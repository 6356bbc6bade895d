"""Authenticate a caller: proxy key -> tenant, tier and key name.

Keys live in config as SHA-256 digests. The presented key is hashed and its digest looked up:
one step whatever the number of keys, and its timing tells nothing about any key's bytes (a
caller cannot choose a digest's bytes without the key that makes them).
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from proxy.config import Config
from proxy.errors import BadRequest, Forbidden, Unauthorized
from proxy.values import value_class

PASSTHROUGH_TIER = "standard"
PASSTHROUGH_ID_DIGITS = 32


@value_class(kw_only=True)
class Identity:
    tenant: str
    tier: str
    key_name: str
    # Only in pass-through mode: the caller's own key, sent upstream as is, and the headers
    # that scope it (OpenAI-Organization, OpenAI-Project: which of its organizations and
    # projects the provider bills; the SDK sends them when the client was given them).
    upstream_key: str | None = None
    upstream_scope: tuple[tuple[str, str], ...] = ()


# Meaningful only with the caller's own key: with the proxy's, they would let a caller pick
# which of the operator's organizations or projects pays.
KEY_SCOPE_HEADERS = ("OpenAI-Organization", "OpenAI-Project")


def presented_key(request: web.Request) -> str | None:
    """The caller's key: a bearer token (``Authorization``) or ``x-api-key``. Two different keys
    are refused: which one a gateway in front read is its own choice, and the key it checked may
    not be the one billed. The same key twice (a client's default header and its own, or both
    headers) is one key."""
    headers = request.headers
    keys = {key for key in map(_bearer_key, headers.getall("Authorization", ())) if key}
    keys.update(key for key in (value.strip() for value in headers.getall("x-api-key", ())) if key)
    if len(keys) > 1:
        raise Unauthorized("Two different keys (Authorization, x-api-key): send your key once.")
    return next(iter(keys), None)


def _bearer_key(header: str) -> str | None:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def one_header(request: web.Request, name: str) -> str | None:
    """The value of a header that says who pays or what is billed (a run, a project). Two
    different values are refused, as two keys are: the proxy would act on one, a gateway in
    front perhaps on the other. The same value twice is one value."""
    values = request.headers.getall(name, ())
    if len(set(values)) > 1:
        raise BadRequest(f"Two different {name} headers: send one.", param=name)
    return values[0] if values else None


def _key_scope(request: web.Request) -> tuple[tuple[str, str], ...]:
    """The organization and project the caller's own key is billed to."""
    found = ((name, one_header(request, name)) for name in KEY_SCOPE_HEADERS)
    return tuple((name, value) for name, value in found if value is not None)


def authenticate(request: web.Request, config: Config, *, passthrough: bool) -> Identity:
    key = presented_key(request)
    if key is None:
        raise Unauthorized(
            "Missing API key: send your proxy key as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
        )
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        # Bytes that are not UTF-8 (read as surrogate escapes): no key anyone was given, and in
        # pass-through not the key that would reach the upstream (the bytes do not go as they
        # came), so not one to name a tenant and its budgets by.
        raise Unauthorized("Incorrect API key provided.") from None
    digest = hashlib.sha256(encoded).hexdigest()
    if passthrough:
        scope = _key_scope(request)
        # 128 bits of the key's digest: the tenant id is shown (billing views, the ledger), and
        # 48 bits (the first 12 digits, before) let a key of the same tenant be found in hours.
        name = f"pt-{digest[:PASSTHROUGH_ID_DIGITS]}"
        return Identity(
            tenant=name,
            tier=PASSTHROUGH_TIER,
            key_name=name,
            upstream_key=key,
            upstream_scope=scope,
        )
    match = config.key_for_digest(digest)
    if match is None:
        if digest in config.admin_digests:  # right, but not for this: "incorrect" would mislead
            raise Unauthorized(
                "An admin key reads /metrics only: billed calls and the billing views take a tenant's key."
            )
        raise Unauthorized("Incorrect API key provided.")
    if match.tier not in config.tiers:
        raise Forbidden(
            f"API key '{match.name}' has tier '{match.tier}', which is not configured; refusing the call.",
            code="unknown_tier",
        )
    return Identity(tenant=match.tenant, tier=match.tier, key_name=match.name)
