"""Prometheus counters agree with the ledger after a mixed workload, streaming and not."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import Counter
from typing import Any

import aiohttp
import openai
import prometheus_client
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import check_eviction
from proxy.config_load import parse_config
from proxy.metrics import LATENCY_BUCKETS, OVERHEAD_BUCKETS, Metrics
from proxy.record import record_entry
from proxy.redis_server import free_port
from proxy.redis_store import RedisStore
from proxy.state import STATE
from tests.conftest import KEY_A, ProxyFactory, base_config, digest, loop_ticks
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import GOOD_BODY, Plan, ScriptedUpstream, dumps, scripted_upstreams, send

ADMIN = "sk-admin-ops"
PRICED_MODELS = {
    "gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "1", "output": "2"}},
    "*": {"upstream": "openai"},
}
LEDGER = "lbp:{team-a}:ledger"
MSGS: list[Any] = [{"role": "user", "content": "hello metrics"}]
REQUESTS_HELP = (
    "Calls settled in the ledger, by outcome, those that never went out among them "
    "(not_forwarded; a client gone, or the upstream's connection refused, first)."
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def scrape(proxy: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The main port's /metrics, read with the admin key."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(proxy.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as resp,
    ):
        return samples(await resp.text())


def total(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lbls), v in values.items()
        if n == name and all((k, val) in lbls for k, val in labels.items())
    )


async def workload(client: openai.AsyncOpenAI, stream: bool) -> None:
    async def chat(fake: dict[str, Any], **kw: Any) -> None:
        try:
            if stream:
                s = await client.chat.completions.create(
                    model="gpt-4o-mini", messages=MSGS, stream=True, extra_body={"fake": fake}, **kw
                )
                async for _ in s:
                    pass
            else:
                await client.chat.completions.create(
                    model="gpt-4o-mini", messages=MSGS, extra_body={"fake": fake}, **kw
                )
        except openai.APIError:
            pass

    await chat({})
    await chat({"mode": "truncate"}, max_tokens=3)
    await chat({"mode": "content_filter"})
    await chat({"content": "not json"}, response_format={"type": "json_object"})  # rejected
    await chat(
        {
            "usage": {
                "prompt_tokens_details": {"cached_tokens": 2},
                "completion_tokens_details": {"reasoning_tokens": 3},
            }
        }
    )


async def disconnect(url: str) -> None:
    body = {
        "model": "gpt-4o-mini",
        "messages": MSGS,
        "stream": True,
        "fake": {"reply_tokens": 30, "chunk_delay_s": 0.02},
    }
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        )
        await resp.content.readuntil(b"\n\n")
        resp.close()


async def test_counters_equal_the_ledger(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(
        models=PRICED_MODELS,
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}],
        policy={"on_invalid_json": "reject"},
        tiers={"standard": {"run": {"requests": 1}}},
    )
    client = proxy.client()
    for stream in (False, True):
        await workload(client, stream)
    await disconnect(proxy.url)
    tiny = {"X-Run-Id": "tiny"}  # the run allows one call; three more are refused by budget
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, extra_headers=tiny)
    for _ in range(3):
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, extra_headers=tiny)
    for _ in range(50):  # the disconnected stream settles after draining
        if len(await redis_client.xrange(LEDGER)) == len(fake.bill):
            break
        await asyncio.sleep(0.05)
    await proxy.recorded()

    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/metrics") as resp:
            assert resp.status == 401
        async with session.get(proxy.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
            assert resp.status == 200
            values = samples(await resp.text())

    entries = [fields for _, fields in await redis_client.xrange(LEDGER)]
    assert len(entries) == len(fake.bill) == 12
    outcomes = Counter(e["outcome"].split(":")[0] for e in entries)
    assert outcomes == {"ok": 5, "truncated": 2, "refused": 2, "rejected": 2, "client_disconnected": 1}
    for outcome, count in outcomes.items():
        assert total(values, "llm_proxy_requests_total", tenant="team-a", outcome=outcome) == count
    for kind, field in (
        ("input", "input_tokens"),
        ("cached_input", "cached_input_tokens"),
        ("output", "output_tokens"),
        ("reasoning", "reasoning_tokens"),
    ):
        expected = sum(int(e[field]) for e in entries)
        assert expected > 0
        assert (
            total(values, "llm_proxy_tokens_total", tenant="team-a", type=kind, source="provider") == expected
        )
    cost = sum(int(e["cost_micros"]) for e in entries)
    assert total(values, "llm_proxy_cost_total", tenant="team-a", model="gpt-4o-mini") == pytest.approx(
        cost / 1e6
    )
    assert (
        total(values, "llm_proxy_budget_refusals_total", tenant="team-a", scope="run", meter="requests") == 3
    )
    assert total(values, "llm_proxy_request_duration_seconds_count") == 12
    assert total(values, "llm_proxy_proxy_overhead_seconds_count") == 12
    assert total(values, "llm_proxy_reserve_error_ratio_count") == 12
    assert total(values, "llm_proxy_inflight_requests", tenant="team-a") == 0
    # No unbounded labels: no run id, request id or key anywhere in the exposition.
    labels = {k for (_, lbls) in values for k, _ in lbls}
    assert labels <= {
        "tenant",
        "model",
        "endpoint",
        "outcome",
        "type",
        "source",
        "scope",
        "meter",
        "le",
        "operation",
        "policy",  # the store's maxmemory-policy: one of Redis's few, or unknown
    }


async def test_metrics_on_their_own_address(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    port = free_port()
    proxy = await make_proxy(metrics={"listen": {"host": "127.0.0.1", "port": port}})
    await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=MSGS)
    await proxy.recorded()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            assert resp.status == 200
            values = samples(await resp.text())
        async with session.get(proxy.url + "/metrics") as resp:
            assert resp.status == 401  # no admin key configured: not open on the main port
    assert total(values, "llm_proxy_requests_total", outcome="ok") == 1


# -- the collector against prometheus_client's own metric classes ----------------------------


def exposition(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        k: v for k, v in samples(generate_latest(registry).decode()).items() if not k[0].endswith("_created")
    }


def test_exposition_matches_prometheus_client() -> None:
    ours, reference = CollectorRegistry(), CollectorRegistry()
    metrics = Metrics(ours)
    requests = prometheus_client.Counter(
        "llm_proxy_requests",
        REQUESTS_HELP,
        ["tenant", "model", "endpoint", "outcome"],
        registry=reference,
    )
    inflight = prometheus_client.Gauge(
        "llm_proxy_inflight_requests",
        "Calls between reserve and settle in this process.",
        ["tenant"],
        registry=reference,
    )
    overhead = prometheus_client.Histogram(
        "llm_proxy_proxy_overhead_seconds",
        "Time spent in the proxy itself, excluding the upstream.",
        buckets=OVERHEAD_BUCKETS,
        registry=reference,
    )
    duration = prometheus_client.Histogram(
        "llm_proxy_request_duration_seconds",
        "Whole call duration as the client sees it.",
        ["endpoint"],
        buckets=LATENCY_BUCKETS,
        registry=reference,
    )
    expired = prometheus_client.Counter(
        "llm_proxy_leases_expired", "Reservations settled at their reserve by a reaper.", registry=reference
    )
    names = {"llm_proxy_requests_total", "llm_proxy_inflight_requests", "llm_proxy_leases_expired_total"} | {
        f"{base}_{suffix}"
        for base in ("llm_proxy_proxy_overhead_seconds", "llm_proxy_request_duration_seconds")
        for suffix in ("bucket", "sum", "count")
    }

    def compared() -> tuple[dict[Any, float], dict[Any, float]]:
        got, want = exposition(ours), exposition(reference)
        return {k: v for k, v in got.items() if k[0] in names}, want

    # Before any update: metrics without labels are there at zero, labelled ones have no series.
    got, want = compared()
    assert got == want and total(got, "llm_proxy_proxy_overhead_seconds_count") == 0
    assert ("llm_proxy_leases_expired_total", ()) in got
    metrics.leases_expired.inc(3)
    expired.inc(3)
    for labels, amount in (
        (("a", "m", "chat", "ok"), 1),
        (("a", "m", "chat", "ok"), 3),
        (("b", "m", "e", "x"), 2),
    ):
        metrics.requests.labels(*labels).inc(amount)
        requests.labels(*labels).inc(amount)
    for tenant, delta in (("a", 1), ("a", 1), ("b", 1), ("a", -1)):
        metrics.inflight.labels(tenant).inc(delta)
        inflight.labels(tenant).inc(delta)
    # Values on a bound (``le`` includes it), between bounds, below the first and past the last.
    values = [0.0, 0.0001, 0.00011, 0.001, 0.0099, 0.5, 0.50001, 7.0, 1e9]
    for value in values:
        metrics.overhead.observe(value)
        overhead.observe(value)
        metrics.duration.labels("chat").observe(value * 100)
        duration.labels("chat").observe(value * 100)
    got, want = compared()
    assert got == want
    assert total(got, "llm_proxy_proxy_overhead_seconds_bucket", le="0.0001") == 2


def test_cost_is_summed_in_micro_units() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for _ in range(10):
        metrics.cost_micros.labels("a", "m").inc(100_001)  # 0.100001 ten times: no float drift
    assert total(exposition(registry), "llm_proxy_cost_total") == 1.00001


def test_labels_are_checked_and_names_unique() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    with pytest.raises(ValueError, match="llm_proxy_requests"):
        metrics.requests.labels("only-one")
    with pytest.raises(ValueError, match="only go up"):
        metrics.leases_expired.inc(-1)
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(registry)


def test_a_scrape_on_its_thread_survives_label_sets_the_loop_adds_meanwhile() -> None:
    """/metrics collects on a worker thread while the loop goes on adding label sets (a tenant's
    or model's first call) and clearing a gauge's: walked unlocked, a family's dict changed size
    under the scrape's iteration and the scrape failed with a RuntimeError."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for tenant in range(300):
        for model in range(10):
            metrics.requests.labels(f"tenant-{tenant}", f"model-{model}", "chat.completions", "ok").inc()
    failed: list[BaseException] = []
    scrapes = 0
    stop = threading.Event()

    def scrape() -> None:
        nonlocal scrapes
        try:
            while not stop.is_set():
                generate_latest(registry)
                scrapes += 1
        except BaseException as err:  # reported on the test's thread, below
            failed.append(err)

    # Switch threads often, so the scrape's walk is interleaved with the additions many times.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    added = 0
    try:
        scraper = threading.Thread(target=scrape)
        scraper.start()
        # Bounded: the series (and the scrapes' cost) grow with every label set added.
        while scrapes < 2 and added < 20_000 and not failed:
            metrics.requests.labels(f"new-{added}", "model", "chat.completions", "ok").inc()
            metrics.inflight.labels(f"new-{added}").inc()
            if added % 500 == 0:
                metrics.store_drops_keys.clear()
            added += 1
        stop.set()
        scraper.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failed, f"a scrape failed after {scrapes} and {added} label sets added: {failed[0]!r}"
    assert total(exposition(registry), "llm_proxy_requests_total") == 3000 + added


async def test_a_lease_the_reaper_settles_is_in_the_spend_counters(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # The reaper's ledger entry at the reserve reached only leases_expired: the README's spend
    # query (increase of llm_proxy_cost_total) under-reported what the ledger charged.
    from proxy.store import Reservation, Scope

    proxy = await make_proxy(
        models=PRICED_MODELS,
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}],
        limits={"reaper_interval_s": 0.1},
    )
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    store = proxy.app[STATE].store
    assert store is not None
    # A call of a dead instance: its lease runs out and this instance's reaper bills its reserve.
    orphan = await store.reserve(
        tenant="team-a",
        reservation_id="dead-instance",
        run_id="r-dead",
        scopes=[Scope(name="run", key="lbp:{team-a}:run:r-dead")],
        amounts={
            "requests": 1,
            "input_tokens": 5,
            "output_tokens": 700,
            "total_tokens": 705,
            "cost_micros": 2000,
            "concurrent": 1,
        },
        lease_ms=1,
        record='{"run_id": "r-dead", "model": "gpt-4o-mini", "endpoint": "chat.completions", "key": "a"}',
    )
    assert isinstance(orphan, Reservation)
    for _ in range(100):
        if len(await redis_client.xrange(LEDGER)) == 2:
            break
        await asyncio.sleep(0.05)
    entries = [fields for _, fields in await redis_client.xrange(LEDGER)]
    assert [e["outcome"] for e in entries] == ["ok", "lease_expired"]
    values = await scrape(proxy)
    assert total(values, "llm_proxy_leases_expired_total") == 1
    assert total(values, "llm_proxy_requests_total", tenant="team-a") == 2
    assert total(values, "llm_proxy_requests_total", outcome="lease_expired", model="gpt-4o-mini") == 1
    for kind in ("input", "output"):
        assert total(values, "llm_proxy_tokens_total", tenant="team-a", type=kind) == sum(
            int(e[f"{kind}_tokens"]) for e in entries
        )
    assert total(values, "llm_proxy_tokens_total", source="reserve", type="output") == 700
    assert round(total(values, "llm_proxy_cost_total", tenant="team-a") * 1e6) == sum(
        int(e["cost_micros"]) for e in entries
    )


async def test_a_call_a_reaper_billed_first_is_counted_once_and_is_no_store_error(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # Its lease ran out mid-stream (a stalled instance): the reaper bills the reserve, and the
    # stream's own settle then finds it settled. Counted twice before (the call at its end, the
    # reaper's entry), and the settle counted as a store error though the store had answered.
    from tests.conftest import slow_stream

    proxy = await make_proxy(
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}], limits={"reaper_interval_s": 0.05}
    )
    body, headers = slow_stream("stalled", chunks=40, delay_s=0.05)  # 2 s: the reaper comes first
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.content.readuntil(b"\n\n")
            (reservation,) = await redis_client.zrange("lbp:{team-a}:leases", 0, -1)
            await redis_client.zadd("lbp:{team-a}:leases", {reservation: 0})  # ran out
            for _ in range(100):
                if await redis_client.xlen(LEDGER) == 1:
                    break
                await asyncio.sleep(0.02)
            await resp.read()
    values = await scrape(proxy)
    ((_, entry),) = await redis_client.xrange(LEDGER)
    assert entry["outcome"] == "lease_expired"
    assert total(values, "llm_proxy_requests_total") == 1
    assert total(values, "llm_proxy_requests_total", outcome="lease_expired") == 1
    assert total(values, "llm_proxy_store_errors_total") == 0


async def test_the_shared_port_does_not_answer_one_workers_metrics_for_all(make_proxy: ProxyFactory) -> None:
    # With --workers N a scrape of the shared port reads whichever worker took it (14, 6, 14...
    # against a ledger of 20): Prometheus takes each switch for a counter reset.
    proxy = await make_proxy(admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}])
    proxy.app[STATE].workers = 2
    async with (
        aiohttp.ClientSession() as session,
        session.get(proxy.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as resp,
    ):
        assert resp.status == 404
        assert "metrics.listen" in (await resp.json())["error"]["message"]


async def test_the_event_loop_keeps_running_while_a_scrape_of_many_series_is_built(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exposition's cost is the series', which the config bounds only as tenants x models x
    endpoints x outcomes (and x token types x usage sources): 1,000 tenants calling 20 models
    each left about 140,000 series, 1.75 s of a stopped loop and a 14 MB body every 15 s of
    Prometheus's, when ``generate_latest`` ran on the loop (the config-scale hunt). Here 4,000
    (tenant, model) pairs, 28,000 series: a 5 ms ticker keeps ticking while it is built."""
    proxy = await make_proxy(admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}])
    metrics = proxy.app[STATE].metrics
    for tenant in range(400):
        for model in range(10):
            labels = (f"tenant-{tenant}", f"model-{model}")
            for outcome in ("ok", "truncated", "upstream_4xx"):
                metrics.requests.labels(*labels, "chat.completions", outcome).inc()
            for kind in ("input", "output", "cached_input"):
                metrics.tokens.labels(*labels, kind, "provider").inc(5)
            metrics.cost_micros.labels(*labels).inc(5)
    built: list[tuple[float, float]] = []

    def timed_exposition(registry: CollectorRegistry) -> bytes:
        began = time.perf_counter()
        try:
            return generate_latest(registry)
        finally:
            built.append((began, time.perf_counter()))

    monkeypatch.setattr("proxy.exposition.generate_latest", timed_exposition)
    async with (
        loop_ticks() as ticks,
        aiohttp.ClientSession() as session,
        session.get(proxy.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"] == prometheus_client.CONTENT_TYPE_LATEST
        body = await resp.read()
    assert built, "the scrape built no exposition"
    began, ended = built[-1]
    assert ended - began > 0.05, f"the exposition took {ended - began:.3f} s: too few series to tell"
    assert body == generate_latest(metrics.registry)
    during = [t for t in ticks if began < t < ended]
    assert during, (
        f"the event loop ran nothing for the {ended - began:.2f} s the scrape's exposition took "
        f"({len(body)} bytes): every call stood still"
    )


async def test_scrapes_that_come_while_one_is_built_share_its_build_on_its_own_thread(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each scrape built its own exposition (a second of CPU at 140,000 series) on asyncio's
    default executor, beside every other scrape's (an HA pair of Prometheus, a dashboard, a curl
    loop) and ahead of aiohttp's DNS lookups and redis-py's reconnects. Scrapes of both ports
    that come while one is built get its body; one that comes after it ended, a build of its own."""
    port = free_port()
    proxy = await make_proxy(
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}],
        metrics={"listen": {"host": "127.0.0.1", "port": port}},
    )
    state = proxy.app[STATE]
    state.metrics.requests.labels("team-a", "gpt-4o-mini", "chat.completions", "ok").inc()
    release = threading.Event()
    built_on: list[str] = []

    def held_exposition(registry: CollectorRegistry) -> bytes:
        built_on.append(threading.current_thread().name)
        release.wait(30)  # held until every scrape waits on it
        return generate_latest(registry)

    monkeypatch.setattr("proxy.exposition.generate_latest", held_exposition)

    async def scraped(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> bytes:
        async with session.get(url, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()

    main = (proxy.url + "/metrics", {"Authorization": f"Bearer {ADMIN}"})
    own = (f"http://127.0.0.1:{port}/metrics", {})
    async with aiohttp.ClientSession() as session:
        try:
            scrapes = [asyncio.create_task(scraped(session, *where)) for where in [main, own] * 3]
            for _ in range(1000):
                if state.expositions is not None and state.expositions.waiting == len(scrapes):
                    break
                await asyncio.sleep(0.01)
            assert state.expositions is not None and state.expositions.waiting == len(scrapes)
        finally:
            release.set()
        bodies = await asyncio.gather(*scrapes)
        assert len(built_on) == 1, f"{len(built_on)} builds for {len(scrapes)} scrapes at once"
        assert len(set(bodies)) == 1
        assert total(samples(bodies[0].decode()), "llm_proxy_requests_total", outcome="ok") == 1
        state.metrics.requests.labels("team-a", "gpt-4o-mini", "chat.completions", "ok").inc()
        after = await scraped(session, *own)
    assert len(built_on) == 2, "a scrape after the build ended was answered its old body"
    assert total(samples(after.decode()), "llm_proxy_requests_total", outcome="ok") == 2
    assert all(name.startswith("metrics-exposition") for name in built_on), built_on


async def test_a_slow_upstream_body_is_not_proxy_overhead(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """llm_proxy_proxy_overhead_seconds is 'time spent in the proxy itself, excluding the
    upstream': an upstream that sends its headers at once and its body a second later (a gateway
    that flushes headers early) is upstream time, not the proxy's."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(chunks=[GOOD_BODY[:20], GOOD_BODY[20:]], delay_s=2.0)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body))
    assert reply.status == 200, reply.describe()
    metrics = proxy.app[STATE].metrics
    for _ in range(50):  # recorded once the answer has gone
        if metrics.overhead.labels().counts and sum(metrics.overhead.labels().counts):
            break
        await asyncio.sleep(0.02)
    overhead = metrics.overhead.labels()
    assert sum(overhead.counts) == 1
    # Counted as the proxy's, the upstream's body is 2 s at least; a second is far more than the
    # proxy's own time, even on a loaded machine.
    assert overhead.sum < 1.0, overhead.sum


def test_the_requests_counter_counts_calls_that_never_went_out_and_its_help_says_so() -> None:
    """``llm_proxy_requests_total`` counts the ledger's entries, a ``not_forwarded`` one (a
    reserve whose reply was lost, released: nothing went out) among them, where its help said
    "Forwarded calls by outcome." (the docs hunt)."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    config = parse_config(base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:1"), {}, key_secrets=False)
    entry = {
        "tenant": "team-a",
        "model": "gpt-4o-mini",
        "endpoint": "chat.completions",
        "outcome": "not_forwarded",
        "usage_source": "none",
    }
    record_entry(metrics, config, entry)
    text = generate_latest(registry).decode()
    assert total(samples(text), "llm_proxy_requests_total", outcome="not_forwarded") == 1
    assert f"# HELP llm_proxy_requests_total {REQUESTS_HELP}\n" in text


async def test_a_scrape_on_its_thread_never_sees_the_store_drops_keys_gauge_without_its_series(
    store: RedisStore,
) -> None:
    """``check_eviction`` (every 30 s) cleared ``llm_proxy_store_drops_keys`` and added its one
    series back in two steps, each taking the family's lock apart: a scrape on its thread
    that copies the label sets in between exports the family with no series at all, which an
    ``absent()`` or ``== 0`` alert reads as the gauge gone. On the loop, as before, no scrape
    could come in between."""
    metrics = Metrics(CollectorRegistry())
    known = await check_eviction(store, metrics, None)
    empty: list[int] = []
    scrapes = 0
    stop = threading.Event()

    def scrape() -> None:
        nonlocal scrapes
        while not stop.is_set():
            family = metrics.store_drops_keys.family()
            if not family.samples:
                empty.append(scrapes)
            scrapes += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    scraper = threading.Thread(target=scrape)
    try:
        scraper.start()
        for _ in range(3000):
            known = await check_eviction(store, metrics, known)
            if empty:
                break
    finally:
        stop.set()
        scraper.join()
        sys.setswitchinterval(interval)
    assert not empty, (
        f"{len(empty)} of {scrapes} scrapes exported llm_proxy_store_drops_keys with no series "
        "(taken between check_eviction's clear and its labels)"
    )


class WatchedLock:
    """A family's lock noting, each time it is released, how many series the family holds: a
    scrape on its thread may copy the family at any of those moments, and at no other."""

    def __init__(self, family: Any) -> None:
        self.family = family
        self.lock = threading.Lock()
        self.series_at_release: list[int] = []

    def __enter__(self) -> WatchedLock:
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.series_at_release.append(len(self.family._values))
        self.lock.release()


async def test_no_moment_of_check_eviction_leaves_the_store_drops_keys_gauge_without_its_series(
    store: RedisStore,
) -> None:
    """The deterministic side of the test above: every release of the gauge's lock during a
    check (the only moments a scrape on its thread can copy it) finds its one series there; a
    ``clear`` then a ``labels(...).set`` released it once with none."""
    metrics = Metrics(CollectorRegistry())
    known = await check_eviction(store, metrics, None)
    watched = WatchedLock(metrics.store_drops_keys)
    setattr(metrics.store_drops_keys, "_lock", watched)  # noqa: B010  # its type is threading.Lock's
    await check_eviction(store, metrics, known)
    assert watched.series_at_release, "the check did not change the gauge under its lock"
    assert set(watched.series_at_release) == {1}, watched.series_at_release


def test_a_gauge_set_only_keeps_the_one_series_at_its_value_and_checks_its_labels() -> None:
    metrics = Metrics(CollectorRegistry())
    gauge = metrics.store_drops_keys
    gauge.labels("allkeys-lru").set(1)
    gauge.set_only(("noeviction",), 0)
    assert [(labels, value.value) for labels, value in gauge.items()] == [(["noeviction"], 0)]
    gauge.set_only(("volatile-lru",), 1)
    assert [(labels, value.value) for labels, value in gauge.items()] == [(["volatile-lru"], 1)]
    with pytest.raises(ValueError, match="llm_proxy_store_drops_keys"):
        gauge.set_only(("a", "b"), 1)
    assert [labels for labels, _ in gauge.items()] == [["volatile-lru"]]


async def test_a_failed_build_answers_each_waiting_scrape_a_500_in_the_proxys_format_on_both_ports(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that raised: both ports' waiters get a 500 and the next scrape builds again, each
    500 in the proxy's JSON format: metrics.listen's was aiohttp's own text/plain "Server got
    itself in trouble", its app without the proxy's error middleware (the fifth review)."""
    port = free_port()
    proxy = await make_proxy(
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}],
        metrics={"listen": {"host": "127.0.0.1", "port": port}},
    )
    state = proxy.app[STATE]
    release = threading.Event()
    builds: list[int] = []

    def failing(registry: CollectorRegistry) -> bytes:
        builds.append(1)
        release.wait(30)
        raise RuntimeError("a collector broke")

    monkeypatch.setattr("proxy.exposition.generate_latest", failing)

    async def scraped(
        session: aiohttp.ClientSession, url: str, headers: dict[str, str]
    ) -> tuple[int, str, str]:
        async with session.get(url, headers=headers) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), await resp.text()

    main = (proxy.url + "/metrics", {"Authorization": f"Bearer {ADMIN}"})
    own = (f"http://127.0.0.1:{port}/metrics", {})
    async with aiohttp.ClientSession() as session:
        try:
            scrapes = [asyncio.create_task(scraped(session, *where)) for where in [main, own]]
            for _ in range(1000):
                if state.expositions is not None and state.expositions.waiting == len(scrapes):
                    break
                await asyncio.sleep(0.01)
        finally:
            release.set()
        answers = await asyncio.gather(*scrapes)
        assert len(builds) == 1
        for status, _, _ in answers:
            assert status == 500
        again = await scraped(session, *own)
    assert len(builds) == 2, "the next scrape did not build again"
    assert again[0] == 500
    assert [a[1].split(";")[0] for a in answers] == ["application/json"] * 2, answers
