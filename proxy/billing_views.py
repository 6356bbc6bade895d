"""What a caller may read of its own billing (``/v1/billing/...``): a run's meters and ledger,
its key's and tenant's windows."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from proxy.auth import Identity, authenticate
from proxy.errors import NotFound, StoreError
from proxy.ids import SANE_ID
from proxy.scopes import run_key, scopes_for
from proxy.state import STATE, State
from proxy.store import ALL_METERS, MeterState, Store


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
    if all(m.used == 0 and m.reserved == 0 for m in meters.values()):
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
        out[meter] = {"used": state_.used, "reserved": state_.reserved, "ceiling": ceilings.get(meter)}
    # Kept where calls hold their reserve (Scope.holds); elsewhere nobody counted it.
    out["concurrent"]["peak"] = meters["peak_concurrent"].used if peak_kept else None
    return out


async def key_self(request: web.Request) -> web.Response:
    """The caller's key and tenant windows: used / reserved / ceiling per meter."""
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


async def run_ledger(request: web.Request) -> web.Response:
    _state, identity, store = _caller(request)
    run_id = _run_id(request)
    entries = await store.run_ledger(tenant=identity.tenant, run_id=run_id)
    if not entries:
        raise NotFound(f"No run '{run_id}' for this tenant.")
    return web.json_response({"object": "list", "run_id": run_id, "data": entries})
