"""The store interface: what the billing path needs from a backend, and the shapes it trades.

One backend exists (``redis_store.RedisStore``, single node or Cluster); the handlers and the
billing path only see this interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.values import value_class

# How long a settled reservation's marker is kept (see settle.bill_if_lost_until_ms).
DEFAULT_SETTLED_MARKER_TTL_S = 3600
# The longest a settled marker is kept (config bounds the setting by it; Redis takes far more).
MAX_SETTLED_MARKER_TTL_S = 10 * 366 * 24 * 3600
# The part of the settled marker's life the proxy counts on (clocks and delays differ).
MARKER_TRUST = 0.9

# Meters a reservation holds, in the order the Lua scripts expect them.
RESERVED_METERS = ("requests", "input_tokens", "output_tokens", "total_tokens", "cost_micros", "concurrent")
# Meters a settlement adds, in the order the Lua scripts expect them.
ACTUAL_METERS = (
    "requests",
    "input_tokens",
    "output_tokens",
    "total_tokens",
    "cost_micros",
    "cached_input_tokens",
    "reasoning_tokens",
    "cache_creation_input_tokens",
)
ALL_METERS = (*ACTUAL_METERS, "concurrent")


# The one key outside any tenant's slot: the tenants the lease reapers read, each until when (ms,
# by that key's server's clock) its latest registration keeps it there (``register.lua``).
TENANTS_KEY = "lbp:tenants:until"
# The registry as written before 2026-12-05: a set, its tenants kept for good (a pass-through key
# sprayed at the proxy, each refused upstream, one more tenant every reaper round read, for ever).
# The reapers move its tenants into ``TENANTS_KEY`` (``Store.adopt_old_tenants``).
OLD_TENANTS_KEY = "lbp:tenants"
# How long a registration keeps a tenant where no config says (``reaper.registration_s`` of the
# default config: two leases of its 600 s timeout and 30 s margin).
REGISTRATION_S = 1260.0
# Ledger entries read per command (exports, reports, a run's entries).
LEDGER_PAGE = 1000
# Before an id given to ``Store.claim_contexts``: its mark kept for good, as the provider keeps a
# conversation and what was answered within one. No id holds it (``call.context_key``), and a
# journaled settle's ids keep it (``PendingSettlement.owned_contexts``).
KEPT_FOR_GOOD = "+"


def key_prefix(tenant: str) -> str:
    """Every key of a tenant shares this hash tag, so a Redis Cluster keeps them in one slot."""
    return f"lbp:{{{tenant}}}:"


@dataclass(frozen=True, slots=True, kw_only=True)
class Scope:
    """One budget scope: a meters hash, its ceilings (absent = unlimited) and its key's TTL."""

    name: str  # "run", "key:minute", "tenant:month"...
    key: str
    ceilings: Mapping[str, int] = field(default_factory=dict)
    ttl_s: int = 0
    resets_at_s: int | None = None
    begins_at_s: int | None = None  # a window's start (seconds since 1970); None: not a window
    # A tenant window another tier limits: this call holds its reserve there (see ``holds``).
    shared_limit: bool = False
    # What ``reserve.lua`` is given of it: its TTL, whether it holds, a ceiling per reserved
    # meter (-1: none). Built once: a key's window scopes serve its calls for a minute.
    reserve_args: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # A store's own encoding of the scope, made by its first reserve and kept as long as the scope
    # (``RedisStore.reserve``: its key and ``reserve_args`` packed for Redis once).
    packed: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ceilings = tuple(self.ceilings.get(m, -1) for m in RESERVED_METERS)
        object.__setattr__(self, "reserve_args", (self.ttl_s, 1 if self.holds else 0, *ceilings))

    @property
    def holds(self) -> bool:
        """Whether a call holds its reserve on this scope. Elsewhere it is only counted when it
        settles: holding it on every window was most of what Redis spent on a call. The run and
        the key's lifetime always hold (their in-flight count and its peak are the concurrency a
        run and a key reach; a window's is not, ``concurrent`` being refused there); a tenant
        window another tier limits holds, so that tier's ceiling sees this call in flight."""
        return self.name in ("run", "key") or bool(self.ceilings) or self.shared_limit


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    scope: Scope
    meter: str
    ceiling: int
    used: int
    reserved: int
    amount: int
    # Every limited meter would fit once the calls in flight end (their reserves gone; requests
    # in flight all count): the same request may fit soon.
    clears: bool = False
    # The scopes that would still refuse it then (the refused one, or others).
    waits_on: tuple[Scope, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Clamp:
    """Lower the output reserve to what the budget affords instead of refusing."""

    min_output_tokens: int  # per choice
    choices: int
    # input tokens * micro-units per million input tokens, and the hosted tool calls reserved
    # (``Estimate.tool_fees_exact``): the cost a clamp leaves as it is
    input_cost_exact: int
    output_rate: int  # micro-units per million output tokens


@value_class(kw_only=True)
class Reservation:
    id: str
    tenant: str
    run_id: str
    scopes: tuple[Scope, ...]
    amounts: Mapping[str, int]
    lease_ms: int
    clamped_output_per_choice: int = 0
    # Each limited meter's room in each scope, this call's reserve aside, and its ceiling:
    # (meter, room, ceiling), in scope order (``settle.budget_headers`` names the tightest).
    rooms: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Tentative:
    """A tentative reserve that did not fit as asked: nothing was written; count exactly and
    reserve again (the refusal, if any, is the final reserve's)."""


@dataclass(frozen=True, slots=True)
class WindowEnded:
    """The reserve ran after one of its windows had ended by the store's clock (a store slow to
    run it: a stall, a pause), or before one had begun (the measure of that clock ahead of it: the
    store's clock stepped back, a failover to a replica whose clock is behind): nothing was
    written; pick the windows again at ``now_s``, the store's clock as it ran, and reserve again."""

    now_s: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpiredLease:
    id: str
    tenant: str
    scope_keys: tuple[str, ...]
    amounts: Mapping[str, int]
    record: str
    scope_ttls_s: tuple[int, ...] = ()  # as reserved (records written before they were kept: none)
    clamped: bool = False  # the reserve lowered the call's output cap (its ledger entry says so)
    readable: bool = True  # False: a damaged record, not to be settled (its amounts unknown)


@dataclass(frozen=True, slots=True)
class MeterState:
    used: int
    reserved: int
    refused: int = 0  # the calls this scope refused on the meter (reserve.lua's refused:<meter>)


# The one maxmemory-policy under which a full Redis drops no key (it refuses writes: an OOM
# reply, a transient store error). Every other drops keys, the volatile-* ones those with a TTL:
# a budget window's counter (its ceiling starts again from zero, overspent), a call's lease.
NO_EVICTION = "noeviction"


@dataclass(frozen=True, slots=True)
class Eviction:
    """What the store does when its memory is full: its ``maxmemory-policy`` (None: it would not
    say, CONFIG and INFO refused or renamed) and ``maxmemory`` in bytes (0: no limit)."""

    policy: str | None
    maxmemory: int = 0

    @property
    def drops_keys(self) -> bool:
        """Whether the proxy's keys may go (a policy not read cannot rule it out)."""
        return self.policy is None or (self.policy != NO_EVICTION and self.maxmemory > 0)


class Store(Protocol):
    @property
    def spans_masters(self) -> bool:
        """Whether its keys live on several masters (a Cluster): one of them down says nothing
        of the others', the tenant registry's (one key) among them."""
        ...

    async def ping(self) -> None: ...

    def now(self) -> float:
        """Seconds since 1970 by the store's clock (the one every instance shares, and the
        scripts' leases use): this process's clock corrected by the offset ``sync_clock`` last
        measured. Budget windows are picked by it, so that instances on hosts whose clocks differ
        count a call in the same window."""
        ...

    async def synced_now(self) -> float:
        """``now``, measured first if it never was."""
        ...

    async def sync_clock(self) -> None: ...

    async def clock_doubted(self) -> None:
        """Return once a reserve found this process's measure of the store's clock off (it ran
        before one of its windows began, or after one ended, by the store's clock): the clock
        loop takes the measure again then, not on its next turn, or every reserve until then
        would be sent twice."""
        ...

    async def load_scripts(self) -> None: ...

    async def persistence_warning(self) -> str | None: ...

    async def eviction(self) -> Eviction:
        """The store's eviction settings (on a Cluster, a primary's that drops keys, if any);
        StoreError when it cannot be reached."""
        ...

    async def reserve(
        self,
        *,
        tenant: str,
        reservation_id: str,
        run_id: str,
        scopes: Sequence[Scope],
        amounts: Mapping[str, int],
        lease_ms: int,
        record: str,
        clamp: Clamp | None = None,
        tentative: bool = False,
    ) -> Reservation | Refusal | Tentative | WindowEnded: ...

    async def shrink(
        self, *, tenant: str, reservation_id: str, scope_keys: Sequence[str], amounts: Mapping[str, int]
    ) -> bool: ...

    async def uncount_refusal(self, refusal: Refusal) -> None:
        """Take back the refusal ``reserve`` counted on its scope (``refused:<meter>``): it ran
        under a config a reload replaced, and the call is judged again under the new one."""
        ...

    async def settle(
        self,
        *,
        tenant: str,
        reservation_id: str,
        run_id: str,
        scope_keys: Sequence[str],
        actual: Mapping[str, int],
        entry: Mapping[str, str],
        bill_if_lost: bool = False,
        scope_ttls_s: Sequence[int] = (),
        runlog_ttl_s: int = 0,
        ledger_ttl_s: int | None = None,
        lifetime_key: str | None = None,
        own: bool = False,
        on_sent: Callable[[], None] | None = None,
        reaper_try: str | None = None,
        marker_ttl_s: int = 0,
    ) -> str | None:
        """The ledger entry's id, None when settled before. ``on_sent``: called once the settle
        is on its way, ahead of any later command on the connection the reserve and settle
        scripts share (a store that cannot tell never calls it: a Cluster, TLS, a connection
        that has not run the script yet). ``reaper_try``: a reaper's token for this try (``r``
        and hex digits); the same try sent again after its reply was lost gets its entry, as the
        call's own settle does (``own``), where any other settle finds it settled before.
        ``marker_ttl_s``: the settled marker lives at least this long (a reaper's settle: what
        the instance that served the call counted on), and at least the store's own setting.
        ``ledger_ttl_s``: the tenant ledger expires that long after this settle, or later (0:
        kept for ever; None: left as it is), and so does ``lifetime_key``, one of ``scope_keys``
        (its own TTL in ``scope_ttls_s`` unused), even where kept for ever: only a settle writes
        the ledger, and a lifetime a version before made persistent would stay so. The entry's
        XADD trims the tenant ledger of entries older than the store's ledger retention (its
        config's ``limits.ledger_retention_s`` at start; 0: none), whoever settles: an entry id
        given before (``own``, ``reaper_try``) may name an entry trimmed since."""
        ...

    async def renew(
        self, *, tenant: str, reservation_id: str, lease_ms: int, scopes: Sequence[Scope] = ()
    ) -> bool: ...

    async def expired_leases(
        self, *, tenant: str, limit: int, grace_ms: int = 0, skip: int = 0
    ) -> list[ExpiredLease]:
        """Up to ``limit`` leases of ``tenant`` that ran out ``grace_ms`` ago or more, oldest
        first, past the first ``skip`` of them."""
        ...

    async def meters(self, key: str) -> dict[str, MeterState]: ...

    async def scope_meters(self, *, tenant: str, keys: Sequence[str]) -> dict[str, dict[str, MeterState]]: ...

    async def run_ledger(self, *, tenant: str, run_id: str) -> list[dict[str, str]]: ...

    def run_ledger_pages(
        self, *, tenant: str, run_id: str, page: int = LEDGER_PAGE
    ) -> AsyncIterator[list[dict[str, str]]]: ...

    def ledger_pages(
        self, *, tenant: str, start: str = "-", end: str = "+", page: int = LEDGER_PAGE
    ) -> AsyncIterator[list[tuple[str, dict[str, str]]]]:
        """The tenant ledger from ``start`` to ``end`` (ids, inclusive), ``page`` entries a
        command: one read of a ledger of millions would hold Redis for seconds."""
        ...

    async def prior_context_tokens(
        self, *, tenant: str, ids: Sequence[str], added: Sequence[str] = ()
    ) -> int | None:
        """The largest size remembered for any of ``ids`` (one context the provider reads: a
        previous response or a conversation), plus each of ``added`` (a stored prompt's
        template, read beside it); see ``remember_context``. None when none is known."""
        ...

    async def item_tokens(self, *, tenant: str, ids: Sequence[str]) -> int:
        """The sum of the sizes remembered for ``ids``, stored items a call names (each kept at
        its answer's output, see ``remember_context``); 0 when none is known."""
        ...

    async def remember_context(
        self,
        *,
        tenant: str,
        ids: Sequence[str],
        tokens: int,
        ttl_s: int,
        bound: bool = False,
        base_tokens: int = 0,
    ) -> None:
        """Keep ``tokens``, the size of the context the provider keeps under each of ``ids``,
        for ``ttl_s`` seconds; a larger size kept already stays (a later call's, on the same
        conversation), its life extended. A ``bound`` (a cut call's reserve; ``base_tokens``, the
        size of the context it continued) gives way to a real size above that base."""
        ...

    async def context_owners(self, *, ids: Sequence[str]) -> list[str | None]:
        """The tenant each of ``ids`` (contexts the provider keeps) belongs to; None: no call of
        any tenant used it through the proxy (made with the provider directly, or older)."""
        ...

    async def claim_contexts(self, *, tenant: str, ids: Sequence[str]) -> None:
        """Mark ``ids`` as ``tenant``'s, unless another tenant's already: for the provider's
        retention of a response, for good an id written after ``KEPT_FOR_GOOD``."""
        ...

    async def register_tenant(self, tenant: str, *, kept_s: float = REGISTRATION_S) -> int:
        """``register_tenants`` of one tenant."""
        ...

    async def register_tenants(self, tenants: Collection[str], *, kept_s: float = REGISTRATION_S) -> int:
        """Keep ``tenants`` in the registry the reapers read for ``kept_s`` from now at least (a
        registration for longer, another instance's, stays); returns until when, in ms by the
        registry's clock."""
        ...

    async def tenants(self, *, waited: Callable[[float], None] | None = None) -> dict[str, int]:
        """Each tenant of the registry and until when (ms, the registry's clock) it is kept;
        ``waited`` is told how long each of its round trips took (a reaper's stall check)."""
        ...

    async def adopt_old_tenants(self, *, kept_s: float = REGISTRATION_S) -> dict[str, int]:
        """Move the tenants of the registry as written before (``OLD_TENANTS_KEY``) into it,
        registered for ``kept_s``; returns them, each until when it is kept."""
        ...

    async def forget_tenants(self, registered: Mapping[str, int]) -> list[str]:
        """Drop each of ``registered`` (a tenant, until when it was kept as read) from the registry
        if that has passed and no registration renewed it since; returns those dropped. The
        caller has found each holding no lease since it read the registry."""
        ...

    async def leases_held(self, *, tenant: str) -> int:
        """How many leases ``tenant`` holds, run out or not (settled ones gone)."""
        ...

    async def knows_tenant(self, tenant: str) -> bool:
        """Whether the store keeps a ledger of ``tenant`` or its tenant registry names it (either
        registry: the one written before too)."""
        ...

    async def close(self) -> None: ...
