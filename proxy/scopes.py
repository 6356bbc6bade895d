"""Which budget scopes a call reserves against: its run, its key's windows, its tenant's windows.

Window counters are keyed by the window's start (UTC), so a new window needs no reset step and
a config change never resets usage: a reload only changes the ceilings passed to the scripts.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta

from proxy.auth import Identity
from proxy.config_base import PASSTHROUGH_TENANT_ID, Period
from proxy.config_tiers import TierConfig, WindowCeilings
from proxy.ids import MADE_RUN_PREFIX
from proxy.store import Scope, key_prefix

# Window keys outlive their window so reports can still read them.
WINDOW_RETENTION_S = 7 * 24 * 3600


def window_bounds(period: str, now: datetime) -> tuple[datetime, datetime]:
    now = now.astimezone(UTC)
    if period == "minute":
        start = now.replace(second=0, microsecond=0)
        return start, start + timedelta(minutes=1)
    if period == "hour":
        start = now.replace(minute=0, second=0, microsecond=0)
        return start, start + timedelta(hours=1)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=1)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + timedelta(days=32)).replace(day=1)
    return start, end


def run_key(tenant: str, run_id: str) -> str:
    return f"{key_prefix(tenant)}run:{run_id}"


def window_key(tenant: str, owner: str, period: str, start: datetime) -> str:
    return f"{key_prefix(tenant)}{owner}:{period}:{start:%Y%m%dT%H%M}"


def lifetime_key(tenant: str, key_name: str) -> str:
    return f"{key_prefix(tenant)}key:{key_name}:all"


def passthrough_tenant(tenant: str) -> bool:
    """A pass-through caller's tenant (``auth``: any bearer token is one); no configured tenant
    is named so (``config_keys``)."""
    # The prefix first: a settle of every call asks, nearly all a configured tenant's.
    return tenant.startswith("pt-") and PASSTHROUGH_TENANT_ID.fullmatch(tenant) is not None


def kept_with_runs(tenant: str, run_ttl_s: int) -> tuple[int | None, str | None]:
    """How long a settle of ``tenant``'s call keeps its ledger (None: left as it is, for ever),
    and the scope key kept alike (its key's lifetime meters; None: none). A pass-through caller's
    tenant's live as long as its runs (``run_ttl_s``, the call's run's): every made-up token
    sprayed at the proxy is such a tenant, and kept for ever they grew Redis with each. Chosen
    by every settle from the tenant, not from the line or the lease's record: those written
    before gave the lifetime 0 (persistent). A configured tenant's are kept for ever."""
    if not passthrough_tenant(tenant):
        return None, None
    return run_ttl_s, lifetime_key(tenant, tenant)  # its key is named as the tenant


def _window_scope(
    tenant: str, owner: str, name: str, window: WindowCeilings, now: datetime, *, shared_limit: bool = False
) -> Scope:
    start, end = window_bounds(window.period, now)
    ttl = int((end - now).total_seconds()) + WINDOW_RETENTION_S
    return Scope(
        name=f"{name}:{window.period}",
        key=window_key(tenant, owner, window.period, start),
        ceilings=window.meters,
        ttl_s=ttl,
        resets_at_s=int(end.timestamp()),
        begins_at_s=int(start.timestamp()),
        shared_limit=shared_limit,
    )


def _key_scopes(
    tenant: str,
    key_name: str,
    tier: TierConfig,
    tenant_periods: tuple[frozenset[Period], frozenset[Period]],
    minute_start_s: int,
    lifetime_ttl_s: int,
) -> tuple[Scope, ...]:
    """The key and tenant scopes, the same for every call of a key within one minute: computed
    once per minute (window keys and TTLs are whole minutes apart at the finest: ``KeyScopes``)."""
    now = datetime.fromtimestamp(minute_start_s, UTC)
    lifetime = lifetime_key(tenant, key_name)
    scopes = [Scope(name="key", key=lifetime, ceilings=tier.key.meters, ttl_s=lifetime_ttl_s)]
    scopes += [_window_scope(tenant, f"key:{key_name}", "key", w, now) for w in _windows(tier.windows)]
    # A tenant window counts every key of the tenant: one whose tier does not limit that period
    # still counts in it (unlimited for that key), or the others' ceiling would not see its spend.
    # Held where a tier of the tenant limits the period, so that its ceiling sees this key's calls.
    named, limited = tenant_periods
    scopes += [
        _window_scope(tenant, "tenant", "tenant", w, now, shared_limit=w.period in limited)
        for w in _windows(tier.tenant, named)
    ]
    return tuple(scopes)


# Pass-through callers whose key scopes are kept: each new bearer token is a caller of its own,
# so they are bounded whatever the config (and each kept is a few kilobytes).
PASSTHROUGH_CALLERS_KEPT = 4096


class KeyScopes:
    """The key and tenant scopes of one config's callers (``_key_scopes``), each built once a
    minute: room for every key the config names, the least recently used dropped past that.
    One cache of 4,096 for every config never hit when 5,000 keys called in turn, and each call
    built its scopes again (about 55 µs). A caller is a configured key, whose count the file
    bounds, or a pass-through caller, bounded by ``PASSTHROUGH_CALLERS_KEPT``."""

    def __init__(self, keys: int) -> None:
        # Past a minute a key's entry is never asked for again: the least recently used, it is
        # the first dropped, so one entry a key is enough.
        self.most = max(keys, PASSTHROUGH_CALLERS_KEPT)
        self._built = functools.lru_cache(maxsize=self.most)(_key_scopes)

    def of(
        self,
        tenant: str,
        key_name: str,
        tier: TierConfig,
        tenant_periods: tuple[frozenset[Period], frozenset[Period]],
        minute_start_s: int,
        lifetime_ttl_s: int,
    ) -> tuple[Scope, ...]:
        return self._built(tenant, key_name, tier, tenant_periods, minute_start_s, lifetime_ttl_s)

    @property
    def hits(self) -> int:
        return self._built.cache_info().hits

    @property
    def held(self) -> int:
        return self._built.cache_info().currsize


# Counted whether or not a ceiling names them, so that a ceiling a reload adds for the day or
# the month sees what was spent in it before (the usual periods of spend ceilings). A minute or
# an hour window a reload adds counts from the reload: at most one short window goes unseen.
ALWAYS_COUNTED: frozenset[Period] = frozenset({"day", "month"})
PERIODS: tuple[Period, ...] = ("minute", "hour", "day", "month")


def _windows(
    limited: tuple[WindowCeilings, ...], others: frozenset[Period] = frozenset()
) -> list[WindowCeilings]:
    own = {w.period: w for w in limited}
    periods = own.keys() | others | ALWAYS_COUNTED
    return [own.get(p) or WindowCeilings(period=p) for p in PERIODS if p in periods]


@functools.lru_cache(maxsize=4096)
def _run_scope(tenant: str, run_id: str, tier: TierConfig | None, run_ttl_s: int) -> Scope:
    """The run's scope, the same for every call of a run: built once, not per call, and so
    packed for the store once (``Scope.packed``: two of a call's seven packings were this
    scope's, every call)."""
    ceilings = tier.run.meters if tier else {}
    return Scope(name="run", key=run_key(tenant, run_id), ceilings=ceilings, ttl_s=run_ttl_s)


def scopes_for(
    identity: Identity,
    run_id: str,
    tier: TierConfig | None,
    now: datetime,
    *,
    run_ttl_s: int,
    tenant_periods: tuple[frozenset[Period], frozenset[Period]] = (frozenset(), frozenset()),
    key_scopes: KeyScopes | None = None,
) -> list[Scope]:
    """``tenant_periods``: the tenant's window periods its keys' tiers name, and those they
    limit (``Config.tenant_periods``); ``key_scopes``: where the config's key scopes are kept
    (``Config.key_scopes``), None: built for this call alone."""
    tenant = identity.tenant
    # A run the proxy named (the call sent no X-Run-Id) is one call: its scope is not asked for
    # again, and kept it would push out those of the runs that are (4 MB of them, each call
    # slower by the eviction).
    build = _run_scope.__wrapped__ if run_id.startswith(MADE_RUN_PREFIX) else _run_scope
    run = build(tenant, run_id, tier, run_ttl_s)
    if tier is None:
        return [run]
    minute = int(now.timestamp()) // 60 * 60
    lifetime_ttl_s = run_ttl_s if passthrough_tenant(tenant) else 0  # as ``kept_with_runs``
    scopes = _key_scopes if key_scopes is None else key_scopes.of
    return [run, *scopes(tenant, identity.key_name, tier, tenant_periods, minute, lifetime_ttl_s)]
