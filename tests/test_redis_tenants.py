"""The tenant registry's commands against a single Redis and, unchanged, a 3-master Redis
Cluster (the registry is one key, outside any tenant's slot)."""

from __future__ import annotations

import pytest

from proxy.errors import StoreError
from proxy.redis_store import RedisStore
from proxy.redis_tenants import TENANTS_A_COMMAND
from proxy.store import OLD_TENANTS_KEY, TENANTS_KEY, Reservation, Scope
from tests import test_redis_store
from tests.conftest import refused_port

store = test_redis_store.store  # the fixture: one Redis, and a Cluster


async def test_a_registration_keeps_a_tenant_for_its_time_and_a_longer_one_stays(store: RedisStore) -> None:
    now_ms = int(await store.synced_now() * 1000)
    until_ms = await store.register_tenants(["team-a", "pt-1"], kept_s=60)
    assert now_ms + 55_000 < until_ms < now_ms + 65_000  # the registry's clock, near this one
    assert await store.tenants() == {"team-a": until_ms, "pt-1": until_ms}
    shorter = await store.register_tenant("team-a", kept_s=1)  # another instance's, shorter
    assert shorter < until_ms
    assert (await store.tenants())["team-a"] == until_ms


async def test_a_tenant_is_dropped_only_once_its_registration_ran_out_and_none_renewed_it(
    store: RedisStore,
) -> None:
    """The reaper read the registry, then found the tenant holding no lease: a call registering
    it again meanwhile (its lease on its way) keeps it."""
    until_ms = await store.register_tenants(["running", "renewed", "ran-out"], kept_s=60)
    await store.client.zadd(TENANTS_KEY, {"renewed": 1, "ran-out": 1}, xx=True)
    read = await store.tenants()
    assert read == {"running": until_ms, "renewed": 1, "ran-out": 1}
    await store.register_tenant("renewed", kept_s=60)  # a call, after the reaper's read
    assert await store.forget_tenants(read) == ["ran-out"]
    assert set(await store.tenants()) == {"running", "renewed"}
    assert await store.forget_tenants({"gone": 1}) == []


async def test_the_registry_written_before_is_moved_in_a_part_at_a_time(store: RedisStore) -> None:
    """A set, kept for good: a key spray may have made it large. Its tenants are registered
    from now and removed from it, a command's worth at a time."""
    old = {f"pt-{i:04d}" for i in range(TENANTS_A_COMMAND * 2 + 5)}
    await store.client.sadd(OLD_TENANTS_KEY, *old)
    await store.register_tenant("team-a", kept_s=3600)
    now_ms = int(await store.synced_now() * 1000)
    adopted = await store.adopt_old_tenants(kept_s=60)
    assert set(adopted) == old
    assert all(now_ms + 55_000 < until_ms < now_ms + 65_000 for until_ms in adopted.values())
    assert await store.client.exists(OLD_TENANTS_KEY) == 0
    assert set(await store.tenants()) == old | {"team-a"}
    assert await store.adopt_old_tenants(kept_s=60) == {}


async def test_the_leases_a_tenant_holds_are_counted_run_out_or_not(store: RedisStore) -> None:
    assert await store.leases_held(tenant="team-a") == 0
    for rid, lease_ms in (("live", 600_000), ("ran-out", 1)):
        reserved = await store.reserve(
            tenant="team-a",
            reservation_id=rid,
            run_id="r",
            scopes=[Scope(name="run", key="lbp:{team-a}:run:r")],
            amounts={"requests": 1, "input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
            lease_ms=lease_ms,
            record='{"run_id": "r"}',
        )
        assert isinstance(reserved, Reservation)
    assert await store.leases_held(tenant="team-a") == 2


async def test_a_tenant_is_known_by_its_ledger_or_either_registry(store: RedisStore) -> None:
    """``ledger`` and ``report`` tell an unknown tenant (a typo) from one that made no call."""
    await store.client.xadd("lbp:{team-ledger}:ledger", {"outcome": "ok"})
    await store.register_tenant("team-registered", kept_s=60)
    await store.client.sadd(OLD_TENANTS_KEY, "team-old")
    for tenant in ("team-ledger", "team-registered", "team-old"):
        assert await store.knows_tenant(tenant), tenant
    assert not await store.knows_tenant("team-typo")


async def test_a_large_registry_is_read_a_command_s_worth_of_tenants_a_round_trip(store: RedisStore) -> None:
    """``waited`` is told each round trip of the read (the reaper's stall check takes the longest):
    a page of about ``TENANTS_A_COMMAND`` tenants each, not ZSCAN's default of about ten (a
    registry of thousands read in hundreds of round trips, every reaper round)."""
    sprayed = [f"pt-{i:05d}" for i in range(TENANTS_A_COMMAND * 5 // 2)]
    await store.register_tenants(sprayed, kept_s=60)
    waits: list[float] = []
    assert set(await store.tenants(waited=waits.append)) == set(sprayed)
    assert 2 <= len(waits) <= 10
    assert all(wait >= 0 for wait in waits)


async def test_asking_a_store_that_cannot_be_reached_whether_it_knows_a_tenant_is_a_store_error() -> None:
    # ``ledger`` and ``report`` say a StoreError in a line; anything else is a traceback.
    store = RedisStore.from_url(f"redis://127.0.0.1:{refused_port()}/0")
    try:
        with pytest.raises(StoreError):
            await store.knows_tenant("team-a")
    finally:
        await store.close()
