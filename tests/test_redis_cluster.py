"""redis-py's Cluster client as the store runs it (``redis_cluster.QueuedCluster``): a command
whose first try went out (its reply lost) and whose retry found no connection (the master gone:
"connecting to ... refused"; the node's pool full: MaxConnectionsError) was sent, and its
StoreError says it may have been applied; the billing views' pipelines wait for a connection
rather than close the whole client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import ClusterNode
from redis.exceptions import BusyLoadingError, ClusterDownError, NoScriptError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.errors import StoreError
from proxy.redis_store import RedisStore
from proxy.store import Scope
from tests.cluster import RedisClusterProcesses

AMOUNTS = {"requests": 1, "input_tokens": 10, "output_tokens": 20, "total_tokens": 30}


@pytest.fixture
async def own_cluster(tmp_path: Path) -> Any:
    cluster = await asyncio.to_thread(RedisClusterProcesses(tmp_path / "cluster", masters=3).start)
    try:
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def lose_first_script_reply(monkeypatch: pytest.MonkeyPatch, after: Any) -> list[Any]:
    """The first EVALSHA runs on its master (its reply is read), then the reply is taken for
    lost (a socket timeout), after ``after(node)`` ran."""
    parse = ClusterNode.parse_response
    lost: list[Any] = []

    async def reply_lost(self: ClusterNode, connection: Any, command: str, **kwargs: Any) -> Any:
        reply = await parse(self, connection, command, **kwargs)
        if command == "EVALSHA" and not lost:
            lost.append(reply)
            await after(self)
            raise RedisTimeoutError("Timeout reading from socket")
        return reply

    monkeypatch.setattr(ClusterNode, "parse_response", reply_lost)
    return lost


async def reserve(store: RedisStore) -> Any:
    return await store.reserve(
        tenant="team-a",
        reservation_id="r1",
        run_id="run1",
        scopes=[Scope(name="run", key="lbp:{team-a}:run:run1")],
        amounts=AMOUNTS,
        lease_ms=60_000,
        record="{}",
    )


async def test_a_reserve_sent_whose_retry_found_its_master_gone_maybe_applied(
    own_cluster: RedisClusterProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken for never sent, the reserve that ran was not released: its reservation stayed held
    until a reaper billed it at its reserve, for a call that never went out."""
    victim = await asyncio.to_thread(own_cluster.master_of, "team-a")
    entry = next(n for n in own_cluster.nodes if n is not victim)
    store = RedisStore.from_url(entry.url, cluster=True, socket_timeout_s=1)
    try:
        await store.load_scripts()

        async def crash(node: ClusterNode) -> None:
            await asyncio.to_thread(victim.kill)

        lost = lose_first_script_reply(monkeypatch, crash)
        with pytest.raises(StoreError) as failed:
            await reserve(store)
        assert lost and int(lost[0][0]) == 1  # the reserve ran: a reservation is held
        # redis-py's retries ended on "Error 111 connecting to ... Connection refused."
        assert "connecting to" in str(failed.value), failed.value
        assert failed.value.maybe_applied, "a reserve that ran is taken for one never sent"
    finally:
        await store.close()


async def test_a_reserve_sent_whose_retry_found_the_pool_full_maybe_applied(
    own_cluster: RedisClusterProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's connections beyond the permits are the billing views' pipelines': in use by
    them when the retry comes, the retry fails MaxConnectionsError."""
    victim = await asyncio.to_thread(own_cluster.master_of, "team-a")
    store = RedisStore.from_url(victim.url, cluster=True, pool_size=1, socket_timeout_s=1)
    held: list[Any] = []
    taking: list[asyncio.Task[None]] = []
    try:
        await store.load_scripts()

        async def take(node: ClusterNode) -> None:
            # What pipelines in flight hold: every connection, the lost try's too once it is
            # released (the retry refreshes the topology first).
            for _ in range(1000):
                while len(node._connections) < node.max_connections or node._free:
                    held.append(node.acquire_connection())
                await asyncio.sleep(0)

        async def views_take_the_rest(node: ClusterNode) -> None:
            taking.append(asyncio.create_task(take(node)))

        lost = lose_first_script_reply(monkeypatch, views_take_the_rest)
        with pytest.raises(StoreError) as failed:
            await reserve(store)
        assert lost and int(lost[0][0]) == 1
        assert "MaxConnectionsError" in repr(failed.value.__cause__), repr(failed.value.__cause__)
        assert failed.value.maybe_applied, f"a reserve that ran is taken for one never sent: {failed.value!r}"
    finally:
        for task in taking:
            task.cancel()
        await store.close()


async def test_more_billing_view_pipelines_than_the_spare_connections_tear_nothing_down(
    own_cluster: RedisClusterProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The nodes' pools hold pool_size + 8: the permits bound the commands, nothing bounds the
    views' pipelines. A pipeline that finds its node's pool full fails MaxConnectionsError, a
    ConnectionError, which ClusterPipeline.execute retries after closing the whole client
    (``cluster_client.aclose()``): every connection, those of the calls' scripts in flight too."""
    store = RedisStore.from_url(own_cluster.url, cluster=True, pool_size=1, socket_timeout_s=2)
    closed: list[bool] = []
    aclose = type(store.client).aclose

    async def counted(self: Any) -> None:
        closed.append(True)
        await aclose(self)

    try:
        await store.load_scripts()
        monkeypatch.setattr(type(store.client), "aclose", counted)
        keys = [f"lbp:{{team-a}}:run:v{i}" for i in range(3)]
        await asyncio.gather(*(store.scope_meters(tenant="team-a", keys=keys) for _ in range(12)))
        assert closed == [], "a burst of 12 views closed every connection of the client"
    finally:
        monkeypatch.undo()
        await store.close()


async def test_calls_reserving_beside_a_burst_of_views_fail_only_as_the_store(
    own_cluster: RedisClusterProcesses,
) -> None:
    """Calls' reserves beside bursts of billing views: no view's pipeline closes the whole
    client (every connection, the reserves' in flight too), no view fails."""
    store = RedisStore.from_url(own_cluster.url, cluster=True, pool_size=4, socket_timeout_s=2)
    try:
        await store.load_scripts()
        keys = [f"lbp:{{team-a}}:run:v{i}" for i in range(3)]
        scope = Scope(name="run", key="lbp:{team-a}:run:burst")

        async def one(i: int) -> Any:
            return await store.reserve(
                tenant="team-a",
                reservation_id=f"b{i}",
                run_id="burst",
                scopes=[scope],
                amounts=AMOUNTS,
                lease_ms=60_000,
                record="{}",
            )

        closes: list[bool] = []
        aclose = store.client.aclose

        async def counted() -> None:
            closes.append(True)
            await aclose()

        store.client.aclose = counted  # type: ignore[method-assign]
        for _ in range(5):
            views = [store.scope_meters(tenant="team-a", keys=keys) for _ in range(40)]
            results = await asyncio.gather(*views, *(one(i) for i in range(24)), return_exceptions=True)
            if any(isinstance(r, BaseException) for r in results):
                break
        odd = [r for r in results if isinstance(r, BaseException) and not isinstance(r, StoreError)]
        store_errors = [r for r in results if isinstance(r, StoreError)]
        assert odd == [], odd
        assert closes == [] and store_errors == [], "views' pipelines closed the whole client"
    finally:
        await store.close()


def lose_first_script_reply_then_answer(monkeypatch: pytest.MonkeyPatch, answer: Any) -> list[Any]:
    """The first EVALSHA runs (its reply read, then taken for lost); every later EVALSHA runs
    too (reserve.lua: the same reservation id again, a retry that changes nothing) and its reply
    is replaced by ``answer()``, an error reply."""
    parse = ClusterNode.parse_response
    lost: list[Any] = []

    async def replied(self: ClusterNode, connection: Any, command: str, **kwargs: Any) -> Any:
        reply = await parse(self, connection, command, **kwargs)
        if command == "EVALSHA":
            if not lost:
                lost.append(reply)
                raise RedisTimeoutError("Timeout reading from socket")
            raise answer()
        return reply

    monkeypatch.setattr(ClusterNode, "parse_response", replied)
    return lost


@pytest.mark.parametrize(
    "answer",
    [
        lambda: BusyLoadingError("Redis is loading the dataset in memory"),  # the master restarted
        lambda: ClusterDownError("The cluster is down"),  # a failover under way
        lambda: ReadOnlyError("You can't write against a read only replica."),
    ],
    ids=["LOADING", "CLUSTERDOWN", "READONLY"],
)
async def test_a_reserve_sent_whose_retry_got_a_not_now_reply_maybe_applied(
    own_cluster: RedisClusterProcesses, monkeypatch: pytest.MonkeyPatch, answer: Any
) -> None:
    """The retry got an error reply ("not now": likely in the failover that lost the first
    reply). An earlier try went out all the same: the reserve may have run (the mark was read
    only for the errors handed to ``never_sent``, not for replies)."""
    store = RedisStore.from_url(own_cluster.url, cluster=True, socket_timeout_s=1)
    try:
        await store.load_scripts()
        lost = lose_first_script_reply_then_answer(monkeypatch, answer)
        with pytest.raises(StoreError) as failed:
            await reserve(store)
        assert lost and int(lost[0][0]) == 1  # the reserve ran: a reservation is held
        assert failed.value.maybe_applied, f"a reserve that ran is taken for one not run: {failed.value!r}"
    finally:
        monkeypatch.undo()
        await store.close()


async def test_a_reserve_sent_whose_retry_found_no_script_then_no_permit_maybe_applied(
    own_cluster: RedisClusterProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first try ran (its reply lost) and the node then lost its scripts (a restart, a
    failover to a node that never loaded them): the retry is refused NOSCRIPT (marked sent
    before), and the store sends EVAL, a command of its own whose tries know nothing of the
    first. That EVAL waiting in vain for a permit (the other calls' commands hold them all, as
    in a failover) passed for a reserve never sent."""
    store = RedisStore.from_url(own_cluster.url, cluster=True, pool_size=1, socket_timeout_s=1)
    parse = ClusterNode.parse_response
    lost: list[Any] = []
    noscript: list[Any] = []
    holders: list[Any] = []
    try:
        await store.load_scripts()
        client: Any = store.client

        async def replied(self: ClusterNode, connection: Any, command: str, **kwargs: Any) -> Any:
            try:
                reply = await parse(self, connection, command, **kwargs)
            except NoScriptError as err:
                noscript.append(err)
                # Another call's command waits for the permit this one holds (pool_size 1), and
                # takes it (FIFO) before the store's EVAL can.
                holders.append(asyncio.ensure_future(client._permits.acquire()))
                await asyncio.sleep(0)
                raise
            if command == "EVALSHA" and not lost:
                lost.append(reply)
                await connection.send_command("SCRIPT", "FLUSH")
                await connection.read_response()
                raise RedisTimeoutError("Timeout reading from socket")
            return reply

        monkeypatch.setattr(ClusterNode, "parse_response", replied)
        with pytest.raises(StoreError) as failed:
            await reserve(store)
        assert lost and int(lost[0][0]) == 1  # the reserve ran: a reservation is held
        assert noscript and getattr(noscript[0], "lbp_sent_before", False)
        assert failed.value.maybe_applied, f"a reserve that ran is taken for one never sent: {failed.value!r}"
    finally:
        monkeypatch.undo()
        await store.close()


async def test_the_owners_of_many_contexts_are_read_across_slots_in_order(
    own_cluster: RedisClusterProcesses,
) -> None:
    """``context_owners`` reads keys of every slot (an owner's key has no tenant's hash tag), as
    many as a call names, in the order asked, with one connection a node's pool."""
    store = RedisStore.from_url(own_cluster.url, cluster=True, pool_size=1, socket_timeout_s=2)
    try:
        await store.claim_contexts(tenant="team-a", ids=["resp_a", "msg_a"])
        await store.claim_contexts(tenant="team-b", ids=["msg_b"])
        ids = [f"msg_x{i}" for i in range(3000)]
        ids[10], ids[1500], ids[2999] = "msg_a", "msg_b", "resp_a"
        owners = await store.context_owners(ids=ids)
        assert len(owners) == len(ids)
        assert {i: o for i, o in zip(ids, owners, strict=True) if o is not None} == {
            "msg_a": "team-a",
            "msg_b": "team-b",
            "resp_a": "team-a",
        }
    finally:
        await store.close()


async def test_a_cluster_master_that_keeps_nothing_on_disk_is_warned_of(
    cluster: RedisClusterProcesses,
) -> None:
    """Each master of a Cluster holds some tenants' ledgers; the warning read one node's answer
    alone, and a master with neither AOF nor RDB went unwarned unless it was that one (found by
    the cluster hunt). Every primary is asked, as for the eviction policy, and named."""
    from tests.test_cluster_resharding import cli

    masters = [n for n in cluster.nodes if cli(n, "role").startswith("master")]
    store = RedisStore.from_url(cluster.url, cluster=True, socket_timeout_s=2)
    warned: dict[int, str | None] = {}
    try:
        assert await store.persistence_warning() is None
        for node in masters:
            aof = cli(node, "config", "get", "appendonly").split()[1]
            save = " ".join(cli(node, "config", "get", "save").split("\n")[1:])
            cli(node, "config", "set", "appendonly", "no")
            cli(node, "config", "set", "save", "")
            try:
                warned[node.port] = await store.persistence_warning()
            finally:
                cli(node, "config", "set", "appendonly", aof)
                cli(node, "config", "set", "save", save)
    finally:
        await store.close()
    assert all(w is not None and f":{port}" in w for port, w in warned.items()), warned
