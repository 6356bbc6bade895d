"""What the Redis store shows without changing it: a scope's meters (with what calls in flight
reserved there) and the ledger, page by page.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from proxy.errors import StoreError
from proxy.redis_failures import STORE_FAILURES
from proxy.store import ALL_METERS, LEDGER_PAGE, RESERVED_METERS, MeterState, key_prefix


def _meter_states(raw: Mapping[str, Any], unheld: Mapping[str, int]) -> dict[str, MeterState]:
    out = {}
    for meter in ALL_METERS:
        reserved = int(raw.get(f"resv:{meter}", 0)) + unheld.get(meter, 0)
        out[meter] = MeterState(
            int(raw.get(f"used:{meter}", 0)), reserved, int(raw.get(f"refused:{meter}", 0))
        )
    out["peak_concurrent"] = MeterState(int(raw.get("peak:concurrent", 0)), 0)
    return out


class ReadCommands:
    """``RedisStore``'s reads (``meters``, ``scope_meters`` and the ledger's pages),
    on its redis-py client (set by ``RedisStore``)."""

    _client: aioredis.Redis | RedisCluster

    async def meters(self, key: str) -> dict[str, MeterState]:
        try:
            raw: Any = await self._client.hgetall(key)
        except STORE_FAILURES as err:
            raise StoreError(f"meters: {err}") from err
        return _meter_states(raw, {})

    async def scope_meters(self, *, tenant: str, keys: Sequence[str]) -> dict[str, dict[str, MeterState]]:
        """``meters`` of several scopes of a tenant, their reserved figures with what the calls in
        flight reserved there without holding it (no ceiling named the scope when they were
        reserved: reserve.lua), from their records.

        The hashes are read first, then the lease index, then the records, so a call is never
        counted twice: one settled after its scope was read and before its record was is missed
        by this view (as one reserved after the index was read), never shown used and reserved.
        Plain pipelined reads, not one script: a tenant's thousands of calls in flight must not
        hold Redis while a view reads them."""
        prefix = key_prefix(tenant)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            hashes: Any = await pipe.execute()
            ids: Any = await self._client.zrange(f"{prefix}leases", 0, -1)
            records: Any = []
            if ids:
                pipe = self._client.pipeline(transaction=False)
                for res_id in ids:
                    pipe.hmget(f"{prefix}resv:{res_id}", "scopes", "amounts", "born")
                records = await pipe.execute()
        except STORE_FAILURES as err:
            raise StoreError(f"meters: {err}") from err
        unheld = {key: dict.fromkeys(RESERVED_METERS, 0) for key in keys}
        for scopes, amounts, born in records:
            if not scopes or not amounts or not born:
                continue  # settled since, or written before a scope could hold nothing
            try:
                values = [int(v) for v in str(amounts).split()]
            except ValueError:
                continue
            for key, life in zip(str(scopes).split("\n"), str(born).split(" "), strict=False):
                if life == "-" and key in unheld:
                    for meter, value in zip(RESERVED_METERS, values, strict=False):
                        unheld[key][meter] += value
        return {key: _meter_states(raw, unheld[key]) for key, raw in zip(keys, hashes, strict=True)}

    async def run_ledger(self, *, tenant: str, run_id: str) -> list[dict[str, str]]:
        return [entry async for page in self.run_ledger_pages(tenant=tenant, run_id=run_id) for entry in page]

    async def run_ledger_pages(
        self, *, tenant: str, run_id: str, page: int = LEDGER_PAGE
    ) -> AsyncIterator[list[dict[str, str]]]:
        prefix = key_prefix(tenant)
        at = 0
        while True:
            try:
                ids: Any = await self._client.lrange(f"{prefix}runlog:{run_id}", at, at + page - 1)
                if not ids:
                    return
                pipe = self._client.pipeline(transaction=False)
                for entry_id in ids:
                    pipe.xrange(f"{prefix}ledger", entry_id, entry_id)
                found = await pipe.execute()
            except STORE_FAILURES as err:
                raise StoreError(f"run ledger: {err}") from err
            yield [{"id": rows[0][0], **rows[0][1]} for rows in found if rows]
            if len(ids) < page:
                return
            at += page

    async def ledger_pages(
        self, *, tenant: str, start: str = "-", end: str = "+", page: int = LEDGER_PAGE
    ) -> AsyncIterator[list[tuple[str, dict[str, str]]]]:
        key = f"{key_prefix(tenant)}ledger"
        while True:
            try:
                rows: Any = await self._client.xrange(key, start, end, count=page)
            except STORE_FAILURES as err:
                raise StoreError(f"ledger: {err}") from err
            if not rows:
                return
            yield [(str(i), dict(fields)) for i, fields in rows]
            if len(rows) < page:
                return
            start = f"({rows[-1][0]}"  # after the last one read
