"""The Redis store's commands for the contexts a provider keeps: the size of each (reserved by
a later call continuing it) and the tenant it is (no other tenant's call continues it).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from proxy.errors import StoreError
from proxy.redis_failures import STORE_FAILURES
from proxy.redis_scripts import ScriptRunner
from proxy.store import KEPT_FOR_GOOD, key_prefix

# A kept context size as context.lua writes it: digits, a bound's followed by ~ and digits.
CONTEXT_SIZE = re.compile(r"([0-9]+)(?:~[0-9]*)?")
# Whose a context the provider keeps is (owner.lua): kept as long as the provider keeps it, a
# response 30 days; a conversation, and what was answered within one, for good.
CONTEXT_OWNER_TTL_S = 30 * 24 * 3600
# The owners (or sizes) read by one command (``context_owners``, ``item_tokens``).
OWNERS_A_COMMAND = 1000
# The marks sent at once (``claim_contexts``).
CLAIMS_AT_ONCE = 32


def _owner_key(context_id: str) -> str:
    # Not under a tenant's hash tag: looked up by a caller of any tenant (one key, one slot).
    return f"lbp:ctxowner:{context_id}"


def _kept_for(claimed: str) -> int:
    # Marked so by ``contexts.contexts_owned`` (and journaled so, for a mark made on replay).
    return 0 if claimed.startswith(KEPT_FOR_GOOD) else CONTEXT_OWNER_TTL_S


class ContextCommands(ScriptRunner):
    """``RedisStore``'s commands on the contexts a provider keeps (``Store.prior_context_tokens``
    to ``Store.claim_contexts``)."""

    async def prior_context_tokens(
        self, *, tenant: str, ids: Sequence[str], added: Sequence[str] = ()
    ) -> int | None:
        sizes = await self._sizes("prior context", tenant, [*ids, *added])
        largest = [size for size in sizes[: len(ids)] if size is not None]
        beside = [size for size in sizes[len(ids) :] if size is not None]
        if not largest and not beside:
            return None
        return max(largest, default=0) + sum(beside)

    async def item_tokens(self, *, tenant: str, ids: Sequence[str]) -> int:
        return sum(size for size in await self._sizes("item sizes", tenant, ids) if size is not None)

    async def _sizes(self, what: str, tenant: str, ids: Sequence[str]) -> list[int | None]:
        prefix = key_prefix(tenant)
        keys = [f"{prefix}ctx:{i}" for i in ids]
        found: list[Any] = []
        try:
            # One slot (the tenant's hash tag): one command, on Cluster too; the thousands of
            # items a call may name a thousand a command, so none holds Redis for long.
            for start in range(0, len(keys), OWNERS_A_COMMAND):
                found += await self._client.mget(keys[start : start + OWNERS_A_COMMAND])
        except STORE_FAILURES as err:
            raise StoreError(f"{what}: {err}") from err
        # A bound ('~' and the size it continued: a cut call's reserve) reserves its size.
        return [int(m[1]) if f is not None and (m := CONTEXT_SIZE.fullmatch(str(f))) else None for f in found]

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
        prefix = key_prefix(tenant)
        # One script (one slot: the tenant's hash tag): a size kept is never lowered (context.lua).
        await self._script(
            "context", [f"{prefix}ctx:{i}" for i in ids], [tokens, ttl_s, 0 if bound else 1, base_tokens]
        )

    async def context_owners(self, *, ids: Sequence[str]) -> list[str | None]:
        # A few at once, one command each few (a Cluster's: one MGET a slot, in a pipeline):
        # a call naming many stored items waits a few round trips, not one per item, and takes
        # one connection, not one per item (a body naming thousands drained the pool, and had
        # this check, and every other call's read waiting on the pool meanwhile, fail).
        keys = [_owner_key(i) for i in ids]
        found: list[Any] = []
        try:
            for start in range(0, len(keys), OWNERS_A_COMMAND):
                batch = keys[start : start + OWNERS_A_COMMAND]
                if isinstance(self._client, RedisCluster):
                    found += await self._client.mget_nonatomic(batch)
                else:
                    found += await self._client.mget(batch)
        except STORE_FAILURES as err:
            raise StoreError(f"context owners: {err}") from err
        return [None if f is None else str(f) for f in found]

    async def claim_contexts(self, *, tenant: str, ids: Sequence[str]) -> None:
        # An answer's few items are marked with it, in one round trip; the thousands a call may
        # name a batch at a time (on a Cluster each script takes a permit of the pool).
        for start in range(0, len(ids), CLAIMS_AT_ONCE):
            done = await asyncio.gather(
                *(
                    self._script("owner", [_owner_key(i.removeprefix(KEPT_FOR_GOOD))], [tenant, _kept_for(i)])
                    for i in ids[start : start + CLAIMS_AT_ONCE]
                ),
                return_exceptions=True,
            )
            for result in done:
                if isinstance(result, BaseException):
                    raise result
