"""The Redis store's tenant registry: which tenants the lease reapers read, each until when its
latest registration keeps it there (one key, outside any tenant's slot).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from proxy.errors import StoreError
from proxy.redis_failures import STORE_FAILURES
from proxy.redis_scripts import ScriptRunner
from proxy.store import OLD_TENANTS_KEY, REGISTRATION_S, TENANTS_KEY, key_prefix

# Tenants a command reads, registers or drops at once: a registry a key spray filled must not
# hold Redis for seconds in one command.
TENANTS_A_COMMAND = 1000


class TenantCommands(ScriptRunner):
    """``RedisStore``'s commands on the tenant registry (``Store.register_tenants`` to
    ``Store.leases_held``)."""

    async def register_tenant(self, tenant: str, *, kept_s: float = REGISTRATION_S) -> int:
        return await self.register_tenants([tenant], kept_s=kept_s)

    async def register_tenants(self, tenants: Collection[str], *, kept_s: float = REGISTRATION_S) -> int:
        ordered = sorted(tenants)
        kept_ms = max(int(kept_s * 1000), 1)
        until_ms = 0
        for at in range(0, max(len(ordered), 1), TENANTS_A_COMMAND):
            chunk = ordered[at : at + TENANTS_A_COMMAND]
            until_ms = int(await self._script("register", [TENANTS_KEY], [kept_ms, *chunk]))
        return until_ms

    async def tenants(self, *, waited: Callable[[float], None] | None = None) -> dict[str, int]:
        try:
            found: dict[str, int] = {}
            cursor: Any = 0
            while True:
                asked_at = time.monotonic()
                cursor, page = await self._client.zscan(TENANTS_KEY, cursor, count=TENANTS_A_COMMAND)
                if waited is not None:
                    waited(time.monotonic() - asked_at)
                for member, score in page:
                    found[str(member)] = int(score)
                if not int(cursor):
                    return found
        except STORE_FAILURES as err:
            raise StoreError(f"tenants: {err}") from err

    async def adopt_old_tenants(self, *, kept_s: float = REGISTRATION_S) -> dict[str, int]:
        """Move the tenants of the registry as written before (a set, ``OLD_TENANTS_KEY``) into
        this one, each registered from now: they are then dropped as any other, once their
        registration ran out and they hold no lease. An instance not upgraded yet still adds its
        tenants there (a reaper's every round): they are moved again, and stay while it serves
        them. Registered first, removed from the set after: a failure between leaves them in
        both, moved again next time."""
        adopted: dict[str, int] = {}
        while True:
            try:
                members: Any = await self._client.srandmember(OLD_TENANTS_KEY, TENANTS_A_COMMAND)
            except STORE_FAILURES as err:
                raise StoreError(f"old tenants: {err}") from err
            if not members:
                return adopted
            moved = [str(m) for m in members]
            adopted.update(dict.fromkeys(moved, await self.register_tenants(moved, kept_s=kept_s)))
            try:
                await self._client.srem(OLD_TENANTS_KEY, *moved)
            except STORE_FAILURES as err:
                raise StoreError(f"old tenants: {err}") from err
            if len(moved) < TENANTS_A_COMMAND:
                return adopted

    async def forget_tenants(self, registered: Mapping[str, int]) -> list[str]:
        ordered = sorted(registered.items())
        dropped: list[str] = []
        for at in range(0, len(ordered), TENANTS_A_COMMAND):
            pairs = [part for pair in ordered[at : at + TENANTS_A_COMMAND] for part in pair]
            found: Any = await self._script("forget", [TENANTS_KEY], pairs)
            dropped.extend(str(tenant) for tenant in found)
        return dropped

    async def leases_held(self, *, tenant: str) -> int:
        try:
            held: Any = await self._client.zcard(f"{key_prefix(tenant)}leases")
        except STORE_FAILURES as err:
            raise StoreError(f"leases held: {err}") from err
        return int(held)

    async def knows_tenant(self, tenant: str) -> bool:
        # One key each, read apart: on a Cluster the ledger is in the tenant's slot, the
        # registries outside any.
        try:
            if await self._client.exists(f"{key_prefix(tenant)}ledger"):
                return True
            if await self._client.zscore(TENANTS_KEY, tenant) is not None:
                return True
            found: Any = await self._client.sismember(OLD_TENANTS_KEY, tenant)
        except STORE_FAILURES as err:
            raise StoreError(f"tenant: {err}") from err
        return bool(found)
