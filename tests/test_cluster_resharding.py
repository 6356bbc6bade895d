"""The store on a real Redis Cluster while a tenant's slot is being resharded (``CLUSTER SETSLOT
MIGRATING / IMPORTING``, then ``MIGRATE``, as ``redis-cli --cluster reshard`` does it) and while
one master is down."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp

from proxy.reaper import run_reaper
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.state import STATE
from proxy.store import TENANTS_KEY, Reservation, Scope
from tests.cluster import RedisClusterProcesses
from tests.conftest import KEY_A, ProxyFactory, slow_stream
from tests.fake_upstream import FakeUpstream

AMOUNTS = {"requests": 1, "input_tokens": 10, "output_tokens": 20, "total_tokens": 30}
ACTUAL = {"requests": 1, "input_tokens": 3, "output_tokens": 4, "total_tokens": 7}


def cli(node: RedisServerProcess, *args: str) -> str:
    found = shutil.which("redis-cli")
    assert found
    done = subprocess.run([found, "-p", str(node.port), *args], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0 and not done.stdout.startswith("ERR"), (args, done.stdout, done.stderr)
    return done.stdout.strip()


def slot_of(cluster: RedisClusterProcesses, tag: str) -> int:
    return int(cli(cluster.nodes[0], "cluster", "keyslot", tag))


def start_migration(source: RedisServerProcess, target: RedisServerProcess, slot: int) -> None:
    cli(target, "cluster", "setslot", str(slot), "importing", cli(source, "cluster", "myid"))
    cli(source, "cluster", "setslot", str(slot), "migrating", cli(target, "cluster", "myid"))


def finish_migration(source: RedisServerProcess, target: RedisServerProcess, slot: int) -> None:
    while keys := cli(source, "cluster", "getkeysinslot", str(slot), "100").split():
        cli(source, "migrate", "127.0.0.1", str(target.port), "", "0", "5000", "keys", *keys)
    target_id = cli(target, "cluster", "myid")
    for node in (target, source):
        cli(node, "cluster", "setslot", str(slot), "node", target_id)


@contextlib.contextmanager
def resharding(cluster: RedisClusterProcesses, tag: str) -> Iterator[None]:
    """The slot of ``{tag}`` marked for moving to another master (none of its keys moved yet),
    then moved whole when the block ends."""
    slot = slot_of(cluster, tag)
    source = cluster.master_of(tag)
    target = next(n for n in cluster.nodes if n is not source and cli(n, "role").startswith("master"))
    start_migration(source, target, slot)
    try:
        yield
    finally:
        finish_migration(source, target, slot)


async def reserved(store: RedisStore, tenant: str, rid: str, run: str, *, lease_ms: int = 60_000) -> Scope:
    """``rid`` reserved on the run ``run`` of ``tenant`` alone; its scope."""
    scope = Scope(name="run", key=f"lbp:{{{tenant}}}:run:{run}")
    record = "{}" if lease_ms == 60_000 else f'{{"run_id": "{run}"}}'
    held = await store.reserve(
        tenant=tenant,
        reservation_id=rid,
        run_id=run,
        scopes=[scope],
        amounts=AMOUNTS,
        lease_ms=lease_ms,
        record=record,
    )
    assert isinstance(held, Reservation)
    return scope


async def settled_once_before(store: RedisStore, tenant: str, run: str) -> Scope:
    """A first call of the run reserved and settled: the tenant's ledger and the run's index
    exist (a settle whose keys all exist is run by the slot's source node mid-migration)."""
    scope = await reserved(store, tenant, f"{run}-first", run)
    await store.settle(
        tenant=tenant,
        reservation_id=f"{run}-first",
        run_id=run,
        scope_keys=[scope.key],
        actual=ACTUAL,
        entry={"reservation_id": f"{run}-first"},
        own=True,
        bill_if_lost=True,
    )
    return scope


async def test_a_settle_during_a_resharding_of_the_tenants_slot_is_applied_once(
    cluster: RedisClusterProcesses,
) -> None:
    """settle.lua deleted the reservation record (DEL) and then wrote its settled marker in its
    place (HSET). While the tenant's slot is migrating, the source node refuses a command on a
    key it no longer holds ("Script attempted to access a non local key"): the HSET failed after
    the ledger entry, the used meters and the record's DEL were written (a script is not rolled
    back), with no marker and the lease left in the index. The call's settle, refused, was
    journaled and replayed: with neither record nor marker left it billed the call again (a
    second ledger entry, ``reservation: lost``, and the meters counted twice)."""
    tenant, run = "reshard-a", "resharded"
    store = RedisStore.from_url(cluster.url, cluster=True, socket_timeout_s=2)
    try:
        await store.load_scripts()
        scope = await settled_once_before(store, tenant, run)
        await reserved(store, tenant, "mid-reshard", run)
        settle: dict[str, Any] = {
            "tenant": tenant,
            "reservation_id": "mid-reshard",
            "run_id": run,
            "scope_keys": [scope.key],
            "actual": ACTUAL,
            "entry": {"reservation_id": "mid-reshard"},
            "own": True,
            "bill_if_lost": True,  # the call's live settle (and its journal's replay, in its window)
        }
        tries: list[str | BaseException] = []
        with resharding(cluster, tenant):
            try:
                tries.append(str(await store.settle(**settle)))
            except Exception as err:  # the proxy journals a refused settle and replays it
                tries.append(err)
        # The journal's replay, once the slot has moved.
        tries.append(str(await store.settle(**settle)))
        entries = [f async for page in store.ledger_pages(tenant=tenant) for _, f in page]
        billed = [f for f in entries if f["reservation_id"] == "mid-reshard"]
        assert len(billed) == 1, f"billed {len(billed)} times: {billed}, tries {tries}"
        meters = await store.meters(scope.key)
        assert meters["requests"].used == 2 and meters["output_tokens"].used == 8, meters
        assert await store.client.zcard(f"lbp:{{{tenant}}}:leases") == 0
    finally:
        await store.close()


def tenant_on(
    cluster: RedisClusterProcesses, prefix: str, wanted: RedisServerProcess | None, avoid: set[int | None]
) -> str:
    """A tenant name starting with ``prefix`` whose slot ``wanted`` serves (any master but those
    whose ports are in ``avoid`` when None)."""
    for i in range(500):
        name = f"{prefix}{i}"
        port = cluster.master_of(name).port
        if (wanted is None and port not in avoid) or (wanted is not None and port == wanted.port):
            return name
    raise AssertionError("no tenant name found for that node")


async def reaped_while_down(
    cluster: RedisClusterProcesses, down: RedisServerProcess, tenants: list[str]
) -> None:
    """A dead instance's lease of the last of ``tenants`` (all registered and known to the
    reaper) is reaped, once, while master ``down`` does not answer (the Cluster serving the slots
    it still covers: ``cluster-require-full-coverage no``)."""
    masters = [n for n in cluster.nodes if cli(n, "role").startswith("master")]
    store = RedisStore.from_url(cluster.url, cluster=True, socket_timeout_s=0.3)
    counted: list[str] = []

    def count(entry: Mapping[str, str]) -> None:
        counted.append(entry["reservation_id"])

    reaper: asyncio.Task[None] | None = None
    try:
        await store.load_scripts()
        for tenant in tenants:
            await store.register_tenant(tenant)
        await reserved(store, tenants[-1], "dead-instance", "orphan", lease_ms=1)
        for node in masters:
            cli(node, "config", "set", "cluster-require-full-coverage", "no")
        assert down.process is not None
        down.process.send_signal(signal.SIGSTOP)  # the master stops answering
        try:
            reaper = asyncio.create_task(run_reaper(store, 0.05, count, known=lambda: tenants))
            for _ in range(400):
                if counted:
                    break
                await asyncio.sleep(0.05)
            leases = await store.client.zcard(f"lbp:{{{tenants[-1]}}}:leases")
        finally:
            down.process.send_signal(signal.SIGCONT)
        assert counted == ["dead-instance"] and leases == 0, (counted, leases)
    finally:
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await store.close()
        for node in masters:
            cli(node, "config", "set", "cluster-require-full-coverage", "yes")
        await asyncio.to_thread(cluster.wait_ok, 30)


async def test_a_master_down_does_not_stop_the_reaping_of_tenants_on_the_others(
    cluster: RedisClusterProcesses,
) -> None:
    """A reaper round stopped at the first tenant whose master did not answer, and every tenant
    sorted after it went unreaped (and the next rounds waited out the grace again, reaped up to
    it and stopped there): on a Cluster that keeps serving the slots it still covers
    (``cluster-require-full-coverage no``), a dead instance's leases on the healthy masters held
    their budgets' room (concurrency among them) for as long as the other master was down."""
    registry = cluster.master_of(TENANTS_KEY)
    down = next(n for n in cluster.nodes if n is not registry and cli(n, "role").startswith("master"))
    first = tenant_on(cluster, "aa-down-", down, set())
    later = tenant_on(cluster, "zz-up-", None, {down.port})
    assert first < later  # the round reaches the tenant of the master down first
    await reaped_while_down(cluster, down, [first, later])


async def test_the_registrys_master_down_does_not_stop_the_reaping_of_tenants_on_the_others(
    cluster: RedisClusterProcesses,
) -> None:
    """The master that holds the tenant registry (one key, ``lbp:tenants:until``) down: each round
    began by reading it, failed, and reaped no tenant at all, though each tenant's keys answer
    on its own master: a dead instance's leases held their budgets' room for as long as that one
    master was down (found by the cluster hunt). The round goes on with the tenants it knows."""
    registry = cluster.master_of(TENANTS_KEY)
    await reaped_while_down(cluster, registry, [tenant_on(cluster, "up-", None, {registry.port})])


async def test_a_tenants_call_is_served_while_only_the_registrys_master_is_down(
    cluster: RedisClusterProcesses, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A tenant's first call in a process adds it to the registry (one key, on one master)
    before its reserve: with that master down, a tenant whose keys' master answers was refused
    503 though nothing of its call needed the registry (found by the cluster hunt). The reaper
    registers it once the registry answers."""
    registry = cluster.master_of(TENANTS_KEY)
    assert cluster.master_of("team-a") is not registry
    entry = next(n for n in cluster.nodes if n is not registry)
    proxy = await make_proxy(redis={"url": entry.url, "cluster": True, "socket_timeout_s": 0.3})
    masters = [n for n in cluster.nodes if cli(n, "role").startswith("master")]
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "registry-down"}
    try:
        for node in masters:
            cli(node, "config", "set", "cluster-require-full-coverage", "no")
        assert registry.process is not None
        registry.process.send_signal(signal.SIGSTOP)
        try:
            async with aiohttp.ClientSession() as session:
                url = proxy.url + "/v1/chat/completions"
                async with session.post(url, json=body, headers=headers) as resp:
                    status, raw = resp.status, await resp.read()
        finally:
            registry.process.send_signal(signal.SIGCONT)
        assert status == 200, (status, raw[:200])
        assert "team-a" in proxy.app[STATE].registered_tenants  # the reaper's known() names it
    finally:
        for node in masters:
            cli(node, "config", "set", "cluster-require-full-coverage", "yes")
        await asyncio.to_thread(cluster.wait_ok, 30)


async def test_a_tenants_grace_runs_from_its_own_masters_return(cluster: RedisClusterProcesses) -> None:
    """The grace (``reap_grace_s``: a process that lost the store journals its calls' settles and
    applies them once it answers again) ran from the first answer of the tenant registry's
    master, which the rounds of the grace never asked the tenant's master: back just before the
    grace ended, its leases that ran out while it was down were reaped at once, ahead of the
    journals' real figures (the late settle then finds the call billed at its reserve)."""
    grace_s = 1.5
    registry = cluster.master_of(TENANTS_KEY)
    down = next(n for n in cluster.nodes if n is not registry and cli(n, "role").startswith("master"))
    tenant = tenant_on(cluster, "grace-", down, set())
    store = RedisStore.from_url(cluster.url, cluster=True, socket_timeout_s=0.3)
    reaped_at: list[float] = []
    loop = asyncio.get_running_loop()
    reaper: asyncio.Task[None] | None = None
    try:
        await store.load_scripts()
        await store.register_tenant(tenant)
        await reserved(store, tenant, "ran-out-while-down", "grace", lease_ms=1)
        await asyncio.sleep(grace_s + 0.1)  # the lease ran out past its own grace
        assert down.process is not None
        down.process.send_signal(signal.SIGSTOP)  # for less than the cluster node timeout
        try:
            reaper = asyncio.create_task(
                run_reaper(store, 0.05, lambda e: reaped_at.append(loop.time()), grace_s=grace_s)
            )
            await asyncio.sleep(1.0)
        finally:
            down.process.send_signal(signal.SIGCONT)
        back_at = loop.time()
        for _ in range(100):
            if reaped_at:
                break
            await asyncio.sleep(0.05)
        assert reaped_at, "never reaped"
        assert reaped_at[0] - back_at >= grace_s - 0.1, (
            f"reaped {reaped_at[0] - back_at:.2f} s after the tenant's master came back, grace {grace_s} s"
        )
    finally:
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await store.close()
        await asyncio.to_thread(cluster.wait_ok, 30)


async def test_a_stream_settled_while_its_tenants_slot_migrates_is_billed_once(
    cluster: RedisClusterProcesses, make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Through the proxy: a stream of a run that billed a call before ends while an operator
    reshards its tenant's slot. Its settle, refused half-way, was journaled and its replay (once
    the slot had moved) billed it a second time: two ledger entries for one call the provider
    billed once, and its tokens twice on every meter."""
    proxy = await make_proxy(
        redis={"url": cluster.url, "cluster": True, "socket_timeout_s": 2}, limits={"journal_replay_s": 0.2}
    )
    async with aiohttp.ClientSession() as session:
        body, headers = slow_stream("migrating", chunks=5, delay_s=0.01)
        async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as first:
            await first.read()  # the run's keys and the tenant's ledger exist
        await proxy.recorded()
        body, headers = slow_stream("migrating", chunks=10, delay_s=0.1)
        stream = await session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        await stream.content.readuntil(b"\n\n")
        with resharding(cluster, "team-a"):
            assert (await stream.read()).endswith(b"data: [DONE]\n\n")
            await proxy.recorded()
    store = RedisStore.from_url(cluster.url, cluster=True)
    try:
        for _ in range(100):  # the journal's replays
            if proxy.app[STATE].journal.pending_lines == 0:
                break
            await asyncio.sleep(0.1)
        entries = [f async for page in store.ledger_pages(tenant="team-a") for _, f in page]
        entries = [f for f in entries if f["run_id"] == "migrating"]
        assert len(fake.bill) == 2
        assert len(entries) == 2, [(e["outcome"], e.get("reservation")) for e in entries]
        meters = await store.meters("lbp:{team-a}:run:migrating")
        assert meters["output_tokens"].used == fake.billed_completion_tokens == 15
    finally:
        await store.close()
