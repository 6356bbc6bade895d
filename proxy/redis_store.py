"""The Redis backend of the store: Lua scripts by SHA, one hash tag per tenant.

Works unchanged against a single server or a Redis Cluster, because every script touches only
keys of one tenant (see ``store.key_prefix``), or the tenant registry's one key. ``RedisStore``
holds the writes (reserve, settle, shrink, renew, leases), its clock and its checks of the
server; how a script runs, the reads, the kept contexts' and the tenant registry's commands are
mixins (``redis_scripts``, ``redis_reads``, ``redis_contexts``, ``redis_tenants``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from proxy.errors import StoreError
from proxy.redis_cluster import QueuedCluster
from proxy.redis_contexts import ContextCommands
from proxy.redis_failures import STORE_FAILURES, refused
from proxy.redis_reads import ReadCommands
from proxy.redis_scripts import ScriptRunner, read_scripts
from proxy.redis_tenants import TenantCommands
from proxy.resp import Packed, PipelinedConnection, pack
from proxy.store import (
    ACTUAL_METERS,
    DEFAULT_SETTLED_MARKER_TTL_S,
    RESERVED_METERS,
    Clamp,
    Eviction,
    ExpiredLease,
    Refusal,
    Reservation,
    Scope,
    Tentative,
    WindowEnded,
    key_prefix,
)

log = logging.getLogger("proxy.store")


def clamped_amounts(amounts: Mapping[str, int], per_choice: int, clamp: Clamp) -> dict[str, int]:
    """The amounts reserve.lua reserved after clamping (the same arithmetic, in integers)."""
    out = dict(amounts)
    out["output_tokens"] = per_choice * clamp.choices
    out["total_tokens"] = out["input_tokens"] + out["output_tokens"]
    if amounts.get("cost_micros", 0) > 0 or clamp.output_rate > 0:
        exact = clamp.input_cost_exact + out["output_tokens"] * clamp.output_rate
        out["cost_micros"] = -(-exact // 1_000_000)
    return out


def _run_scope(prefix: str, run_id: str, scope_keys: Sequence[str]) -> int:
    """Which of ``scope_keys`` is the run's (1-based; 0: none): the scripts keep the run's ledger
    index alive exactly as long as it."""
    run_key = f"{prefix}run:{run_id}"
    return list(scope_keys).index(run_key) + 1 if run_key in scope_keys else 0


# Which scope is the run's, packed once (0: none; the run's scope comes first): the last of a
# reserve's arguments, after the scopes' packed ones, would otherwise be a packing of its own.
_RUN_SCOPE_INDEXES = tuple(pack(index) for index in range(4))


def _pack_scope(scope: Scope) -> tuple[Packed, Packed]:
    """A scope's key and ``reserve_args``, packed once: a key's window scopes serve its calls for
    a minute, and those arguments are most of a reserve's (54 of 74 with six scopes)."""
    packed = (pack(scope.key), pack(*scope.reserve_args))
    object.__setattr__(scope, "packed", packed)
    return packed


# A clock read at most this many times a measure, the first whose round trip is at most this
# short taken at once (a store that answers at once answers in well under a millisecond).
_CLOCK_READS = 3
_CLOCK_TRIP_S = 0.005


class RedisStore(ContextCommands, TenantCommands, ReadCommands, ScriptRunner):
    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        pool: aioredis.ConnectionPool | None = None,
        pipe: PipelinedConnection | None = None,
        settled_marker_ttl_s: int = DEFAULT_SETTLED_MARKER_TTL_S,
        ledger_retention_s: int = 0,
    ) -> None:
        self._client = client
        self._settled_marker_ttl_s = settled_marker_ttl_s
        # Every settle trims its tenant's ledger of entries older than this (0: none), whoever
        # makes it (the call, a journal's replay, a reaper): one setting, the process's at start.
        self._ledger_retention_s = ledger_retention_s
        self._untrimmed_told = False
        self._pool = pool
        # Single-node only: the hot-path scripts share one pipelined connection.
        self._pipe = pipe
        self._scripts = read_scripts()
        # The store's clock minus this process's monotonic clock (seconds), None until first
        # measured: see ``now``. Monotonic: a step of the host's wall clock between two measures
        # must not move the windows.
        self._clock_offset_s: float | None = None
        self._clock_doubted = asyncio.Event()  # see ``clock_doubted``

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        pool_size: int = 64,
        socket_timeout_s: float = 5.0,
        settled_marker_ttl_s: int = DEFAULT_SETTLED_MARKER_TTL_S,
        ledger_retention_s: int = 0,
    ) -> RedisStore:
        client: aioredis.Redis | RedisCluster
        if cluster:
            client = QueuedCluster.queued_from_url(
                url, pool_size=pool_size, socket_timeout_s=socket_timeout_s
            )
        else:
            # A blocking pool: a burst waits for a free connection instead of failing a settle.
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                decode_responses=True,
                max_connections=pool_size,
                timeout=socket_timeout_s,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
            )
            # TLS (rediss://) stays on redis-py: the pipelined connection speaks plain TCP/unix.
            pipe = (
                None if url.startswith("rediss://") else PipelinedConnection(url, timeout_s=socket_timeout_s)
            )
            return cls(
                aioredis.Redis(connection_pool=pool),
                pool=pool,
                pipe=pipe,
                settled_marker_ttl_s=settled_marker_ttl_s,
                ledger_retention_s=ledger_retention_s,
            )
        return cls(client, settled_marker_ttl_s=settled_marker_ttl_s, ledger_retention_s=ledger_retention_s)

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        return self._client

    @property
    def spans_masters(self) -> bool:
        return isinstance(self._client, RedisCluster)

    async def close(self) -> None:
        if self._pipe is not None:
            await self._pipe.close()
        await self._client.aclose()
        if self._pool is not None:
            await self._pool.disconnect()

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except STORE_FAILURES as err:
            raise StoreError(f"ping: {err}") from err

    def now(self) -> float:
        if self._clock_offset_s is None:  # never measured (the store has not answered yet)
            return time.time()
        return time.monotonic() + self._clock_offset_s

    async def synced_now(self) -> float:
        """``now``, measuring the store's clock first if it never was (a store that was down
        at start: the clock loop's next turn is up to 30 s away)."""
        if self._clock_offset_s is None:
            with contextlib.suppress(StoreError):
                await self.sync_clock()
        return self.now()

    async def sync_clock(self) -> None:
        """Measure how far the store's clock (TIME) is from this process's, to half a round trip:
        the shortest of a few. One read that waited behind a slow script (a stalled disk) put the
        clock ahead by half the wait until the next measure, 30 s on: calls at a minute's (a
        day's) end charged to the next window."""
        best: tuple[float, float] | None = None  # (round trip, offset)
        for _ in range(_CLOCK_READS):
            try:
                before = time.monotonic()
                found: Any = await self._client.time()
                after = time.monotonic()
            except STORE_FAILURES as err:
                raise StoreError(f"time: {err}") from err
            if isinstance(found, dict):  # a cluster client may answer per node
                found = next(iter(found.values()))
            secs, micros = found
            trip = after - before
            if best is None or trip < best[0]:
                best = (trip, int(secs) + int(micros) / 1e6 - (before + after) / 2)
            if trip <= _CLOCK_TRIP_S:
                break
        assert best is not None
        self._clock_offset_s = best[1]

    async def clock_doubted(self) -> None:
        await self._clock_doubted.wait()
        self._clock_doubted.clear()

    async def load_scripts(self) -> None:
        try:
            for source, _sha in self._scripts.values():
                await self._client.script_load(source)
        except STORE_FAILURES as err:
            raise StoreError(f"script load: {err}") from err

    async def persistence_warning(self) -> str | None:
        """Say so when the server keeps nothing on disk: the ledger lives there. On a Cluster,
        any primary that keeps nothing (each holds some tenants' ledgers), named. StoreError
        when it cannot be read now (read again later); a server that refuses CONFIG is said so."""
        cluster = isinstance(self._client, RedisCluster)
        nodes: dict[str, Any] = {"target_nodes": RedisCluster.PRIMARIES} if cluster else {}
        try:
            # One setting a command: CONFIG GET takes several only from Redis 7.
            aof: Any = await self._client.execute_command("CONFIG GET", "appendonly", **nodes)
            rdb: Any = await self._client.execute_command("CONFIG GET", "save", **nodes)
        except ResponseError as err:
            if not refused(err):  # a Cluster down, LOADING: read again later
                raise StoreError(f"persistence settings: {err}") from err
            return f"could not read the persistence settings ({err})"
        except STORE_FAILURES as err:
            raise StoreError(f"persistence settings: {err}") from err
        # A Cluster's answer is one per node (unless only one node answered).
        aofs = aof if cluster and "appendonly" not in aof else {"": aof}
        rdbs = rdb if cluster and "save" not in rdb else {"": rdb}
        bare = sorted(
            node
            for node, a in aofs.items()
            if a.get("appendonly") != "yes" and not rdbs.get(node, {}).get("save")
        )
        if not bare:
            return None
        where = f" ({', '.join(bare)})" if cluster else ""
        return f"the Redis server{where} keeps nothing on disk (no AOF, no RDB): a restart loses the ledger"

    async def eviction(self) -> Eviction:
        """Read with CONFIG GET, else from INFO (a managed Redis often refuses CONFIG), from
        every primary of a Cluster: each holds some tenants' keys."""
        cluster = isinstance(self._client, RedisCluster)
        nodes: dict[str, Any] = {"target_nodes": RedisCluster.PRIMARIES} if cluster else {}
        try:
            try:
                found: Any = await self._client.execute_command(
                    "CONFIG GET", "maxmemory-policy", "maxmemory", **nodes
                )
                policy_key = "maxmemory-policy"
            except ResponseError as err:
                if not refused(err):
                    raise
                found = await self._client.info("memory", **nodes)
                policy_key = "maxmemory_policy"
        except ResponseError as err:
            if not refused(err):  # a Cluster down, TRYAGAIN: read again later
                raise StoreError(f"eviction policy: {err}") from err
            return Eviction(None)
        except STORE_FAILURES as err:
            raise StoreError(f"eviction policy: {err}") from err
        # A Cluster's answer is one per node (unless only one node answered).
        answers = list(found.values()) if cluster and policy_key not in found else [found]
        settings = [
            Eviction(str(a[policy_key]), int(a.get("maxmemory") or 0)) if policy_key in a else Eviction(None)
            for a in answers
        ]
        return next((e for e in settings if e.drops_keys), settings[0])

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
    ) -> Reservation | Refusal | Tentative | WindowEnded:
        prefix = key_prefix(tenant)
        run_scope = _run_scope(prefix, run_id, [s.key for s in scopes])
        # reserve.lua's keys (the record, the leases, the scopes, the run's ledger index) and
        # arguments (the call's, each scope's, which is the run's); a scope's own parts packed once.
        packed = [s.packed or _pack_scope(s) for s in scopes]
        middle: list[Any] = [f"{prefix}runlog:{run_id}"] if run_scope else []
        middle += [reservation_id, lease_ms, record]
        middle += [amounts.get(m, 0) for m in RESERVED_METERS]
        if clamp is None:
            middle += [0, 1, 0, 0]
        else:
            middle += [clamp.min_output_tokens, clamp.choices, clamp.input_cost_exact, clamp.output_rate]
        middle.append(1 if tentative else 0)
        # The windows were picked by this process's measure of the store's clock: the script
        # writes nothing should it run after the first of them has ended, or before the last of
        # them has begun (the measure ahead of the store's clock: a step back, a failover).
        middle.append(min((s.resets_at_s for s in scopes if s.resets_at_s is not None), default=0))
        middle.append(max((s.begins_at_s for s in scopes if s.begins_at_s is not None), default=0))
        result = await self._script_parts(
            "reserve",
            2 + len(scopes) + (1 if run_scope else 0),
            [
                (f"{prefix}resv:{reservation_id}", f"{prefix}leases"),
                *(key for key, _ in packed),
                tuple(middle),
                *(args for _, args in packed),
                _RUN_SCOPE_INDEXES[run_scope] if run_scope < len(_RUN_SCOPE_INDEXES) else (run_scope,),
            ],
        )
        if int(result[0]) == 2:
            return Tentative()
        if int(result[0]) == 3:
            self._clock_doubted.set()
            return WindowEnded(now_s=int(result[1]))
        if int(result[0]) == 1:
            _, per_choice, flat = result
            rooms = tuple(
                (RESERVED_METERS[int(flat[i]) - 1], int(flat[i + 1]), int(flat[i + 2]))
                for i in range(0, len(flat), 3)
            )
            reserved = dict(amounts)
            if int(per_choice) and clamp is not None:
                reserved = clamped_amounts(amounts, int(per_choice), clamp)
            return Reservation(
                id=reservation_id,
                tenant=tenant,
                run_id=run_id,
                scopes=tuple(scopes),
                amounts=reserved,
                lease_ms=lease_ms,
                clamped_output_per_choice=int(per_choice),
                rooms=rooms,
            )
        _, index, meter, ceiling, used, reserved, amount, *after = result
        waits_on = tuple(scopes[int(i) - 1] for i in str(after[1]).split()) if len(after) > 1 else ()
        return Refusal(
            scope=scopes[int(index) - 1],
            meter=str(meter),
            ceiling=int(ceiling),
            used=int(used),
            reserved=int(reserved),
            amount=int(amount),
            clears=bool(after and int(after[0])),
            waits_on=waits_on,
        )

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
        prefix = key_prefix(tenant)
        keys = [
            f"{prefix}resv:{reservation_id}",
            f"{prefix}leases",
            f"{prefix}ledger",
            f"{prefix}runlog:{run_id}",
            *scope_keys,
        ]
        # One JSON argument rather than 2 x 26: packing arguments is the client's main cost.
        args: list[Any] = [
            reservation_id,
            *(actual.get(m, 0) for m in ACTUAL_METERS),
            orjson.dumps(entry),
            1 if bill_if_lost else 0,
            max(self._settled_marker_ttl_s, marker_ttl_s),
            runlog_ttl_s,
            _run_scope(prefix, run_id, scope_keys),
            # The call's own settle (not a reaper's): sent again (the cluster client retries a
            # timeout; a journal replays a settle whose reply was lost), it gets the first one's
            # entry (settle.lua). A reaper's try with a token gets its entry the same way.
            1 if own else (reaper_try or 0),
            -1 if ledger_ttl_s is None else ledger_ttl_s,
            0
            if lifetime_key is None or lifetime_key not in scope_keys
            else scope_keys.index(lifetime_key) + 1,
            self._ledger_retention_s,
            *scope_ttls_s,
        ]
        result = await self._script("settle", keys, args, on_sent=on_sent)
        if len(result) > 2 and not self._untrimmed_told:
            # The entry is in; only the trim failed (a Redis before 6.2 knows no XADD MINID).
            self._untrimmed_told = True
            log.warning(
                "the store refused to trim the ledger: limits.ledger_retention_s keeps every entry",
                extra={"error": str(result[2])[:200]},
            )
        return str(result[1]) if int(result[0]) == 1 else None

    async def shrink(
        self, *, tenant: str, reservation_id: str, scope_keys: Sequence[str], amounts: Mapping[str, int]
    ) -> bool:
        prefix = key_prefix(tenant)
        keys = [f"{prefix}resv:{reservation_id}", f"{prefix}leases", *scope_keys]
        args: list[Any] = [amounts.get(m, 0) for m in RESERVED_METERS]
        args.append(reservation_id)
        return int(await self._script("shrink", keys, args)) == 1

    async def uncount_refusal(self, refusal: Refusal) -> None:
        try:
            await self._client.hincrby(refusal.scope.key, f"refused:{refusal.meter}", -1)
        except STORE_FAILURES as err:
            raise StoreError(f"uncount refusal: {err}") from err

    async def renew(
        self, *, tenant: str, reservation_id: str, lease_ms: int, scopes: Sequence[Scope] = ()
    ) -> bool:
        prefix = key_prefix(tenant)
        keys = [f"{prefix}resv:{reservation_id}", f"{prefix}leases", *(s.key for s in scopes)]
        run_id = next((s.key.removeprefix(f"{prefix}run:") for s in scopes if s.name == "run"), None)
        run_scope = _run_scope(prefix, run_id, keys[2:]) if run_id is not None else 0
        if run_scope:
            keys.append(f"{prefix}runlog:{run_id}")
        args: list[Any] = [reservation_id, lease_ms, run_scope, *(s.ttl_s for s in scopes)]
        return int(await self._script("renew", keys, args)) == 1

    async def expired_leases(
        self, *, tenant: str, limit: int, grace_ms: int = 0, skip: int = 0
    ) -> list[ExpiredLease]:
        prefix = key_prefix(tenant)
        ids = await self._script("expired", [f"{prefix}leases"], [limit, grace_ms, skip])
        # Read at once: the reads share round trips (one each, a dead instance's leases held
        # their budgets' room longer).
        leases = f"{prefix}leases"
        records = await asyncio.gather(
            *(self._script("lease", [f"{prefix}resv:{res_id}", leases], [res_id]) for res_id in ids)
        )
        out = []
        for res_id, found in zip(ids, records, strict=True):
            if not found:
                continue
            scopes, amounts, record, ttls, clamped = (*found, None, None)[:5]
            try:
                values = [int(v) for v in str(amounts).split()]
                scope_ttls_s = tuple(int(v) for v in str(ttls or "").split())
            except ValueError:
                # A damaged record: the reaper leaves it for an operator rather than dying on it.
                out.append(
                    ExpiredLease(
                        id=str(res_id), tenant=tenant, scope_keys=(), amounts={}, record="", readable=False
                    )
                )
                continue
            out.append(
                ExpiredLease(
                    id=str(res_id),
                    tenant=tenant,
                    scope_keys=tuple(str(scopes).split("\n")),
                    amounts=dict(zip(RESERVED_METERS, values, strict=False)),
                    record=str(record or ""),
                    scope_ttls_s=scope_ttls_s,
                    clamped=str(clamped or "0") not in ("", "0"),
                )
            )
        return out
