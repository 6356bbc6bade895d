"""What a caller may read of its own billing (``/v1/billing/...``): a run's meters and ledger,
its key's and tenant's windows."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from proxy.auth import Identity, authenticate
from proxy.dialects import dialect_of_path
from proxy.errors import NotFound, StoreError
from proxy.ids import REQUEST_ID, SANE_ID
from proxy.scopes import run_key, scopes_for
from proxy.state import STATE, State
from proxy.store import ALL_METERS, MeterState, Store

log = logging.getLogger("proxy.billing_views")


def _caller(request: web.Request) -> tuple[State, Identity, Store]:
    """Who asks, and the store to read; a store not open raises ``StoreError``, which the error
    middleware answers with a 503 (``store_unavailable``), as a read the store fails."""
    state = request.app[STATE]
    identity = authenticate(request, state.config, passthrough=state.passthrough)
    if state.store is None:
        raise StoreError("store not opened")
    return state, identity, state.store


def _run_id(request: web.Request) -> str:
    run_id = request.match_info["run_id"]
    if not SANE_ID.fullmatch(run_id):
        raise NotFound(f"No run '{run_id[:128]}' for this tenant.")
    return run_id


async def run_meters(request: web.Request) -> web.Response:
    state, identity, store = _caller(request)
    run_id = _run_id(request)
    meters = await store.meters(run_key(identity.tenant, run_id))
    # A run the store keeps any figure of exists: what it used or holds, its peak (written by
    # every reserve: the run's scope always holds its calls) or what it refused (a run refused
    # from its first call is a run: its 429 named it).
    if not any(m.used or m.reserved or m.refused for m in meters.values()):
        raise NotFound(f"No run '{run_id}' for this tenant.")
    tier = state.config.tiers.get(identity.tier)
    out = _meter_view(meters, tier.run.meters if tier else {})
    summary = ", ".join(
        f"{m} {out[m]['used']}/{out[m]['ceiling'] if out[m]['ceiling'] is not None else 'unlimited'}"
        for m in ("requests", "input_tokens", "output_tokens", "total_tokens", "cost_micros")
    )
    return web.json_response(
        {
            "object": "billing.run",
            "run_id": run_id,
            "tenant": identity.tenant,
            "meters": out,
            "summary": summary,
        }
    )


def _meter_view(
    meters: dict[str, MeterState], ceilings: Mapping[str, int], *, peak_kept: bool = True
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for meter in ALL_METERS:
        state_ = meters[meter]
        out[meter] = {
            "used": state_.used,
            "reserved": state_.reserved,
            "ceiling": ceilings.get(meter),
            "refused": state_.refused,  # calls this scope refused on the meter (0: none)
        }
    # Kept where calls hold their reserve (Scope.holds); elsewhere nobody counted it.
    out["concurrent"]["peak"] = meters["peak_concurrent"].used if peak_kept else None
    return out


async def key_self(request: web.Request) -> web.Response:
    """The caller's key and tenant windows: used / reserved / ceiling / refused per meter."""
    state, identity, store = _caller(request)
    tier = state.config.tiers.get(identity.tier)
    windows = []
    config = state.config
    scopes = scopes_for(
        identity,
        "-",
        tier,
        datetime.fromtimestamp(await store.synced_now(), UTC),  # the windows the reserves pick
        run_ttl_s=config.limits.run_ttl_s,
        tenant_periods=config.tenant_periods(identity.tenant),
        key_scopes=config.key_scopes,
    )
    found = await store.scope_meters(tenant=identity.tenant, keys=[s.key for s in scopes[1:]])
    for scope in scopes[1:]:  # all but the run
        meters = found[scope.key]
        windows.append(
            {
                "scope": scope.name,
                "resets_at": scope.resets_at_s,
                "meters": _meter_view(meters, scope.ceilings, peak_kept=scope.holds),
            }
        )
    return web.json_response(
        {
            "object": "billing.key",
            "key": identity.key_name,
            "tenant": identity.tenant,
            "tier": identity.tier,
            "windows": windows,
        }
    )


async def _page_bodies(pages: AsyncIterator[list[dict[str, str]]]) -> AsyncGenerator[str]:
    """Each page of entries as the JSON of its items, comma-separated (pages with none left out);
    a page is dropped before the next is read."""
    async for page in pages:
        body = ", ".join(map(json.dumps, page))
        del page
        if body:
            yield body


async def run_ledger(request: web.Request) -> web.StreamResponse:
    """The run's entries, written a page at a time as they are read (``LEDGER_PAGE``): a run of
    millions of entries is never held whole in the proxy's memory. The body is the JSON
    ``web.json_response`` would write; a store failure after its first bytes cuts the connection
    (the client sees the body end early, never a list that looks whole)."""
    _state, identity, store = _caller(request)
    run_id = _run_id(request)
    bodies = _page_bodies(store.run_ledger_pages(tenant=identity.tenant, run_id=run_id))
    first = await anext(bodies, None)
    if first is None:
        raise NotFound(f"No run '{run_id}' for this tenant.")
    headers = {
        "Content-Type": "application/json; charset=utf-8",
        **dialect_of_path(request.path).id_headers(request[REQUEST_ID]),
    }
    if request.method == "HEAD":
        # A streamed body is written whatever the method: a HEAD gets the headers alone.
        return web.Response(headers=headers)
    response = web.StreamResponse(headers=headers)
    try:
        await response.prepare(request)
        head = f'{{"object": "list", "run_id": {json.dumps(run_id)}, "data": ['
        await response.write((head + first).encode())
        del first
        async for body in bodies:
            await response.write(b", " + body.encode())
            del body
        await response.write(b"]}")
        await response.write_eof()
    except StoreError as err:
        log.warning("run ledger view cut: store error", extra={"error": str(err)[:200]})
        if request.transport is not None:
            request.transport.abort()
    except ConnectionError:
        # The reader left (``curl ... | head``, its timeout): nothing more to write, no error of
        # the proxy's (aiohttp's write of a whole body ends as quietly).
        log.debug("run ledger view cut: the client left")
    finally:
        await bodies.aclose()  # no page read for nobody
    return response
