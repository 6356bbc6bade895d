"""The application factory: the typed state (``state``) filled, resources opened in ``cleanup_ctx``,
the background loops (reaper, journal replay, clock and eviction checks, config reload)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.error_answers import answer_parser_errors_as_json, bound_request_heads, error_middleware
from proxy.errors import StoreError
from proxy.exposition import Expositions
from proxy.forward import UpstreamConnector
from proxy.handlers import add_routes, metrics_handler
from proxy.journal import Journal
from proxy.logs import flush_logs
from proxy.metrics import Metrics
from proxy.reaper import known_tenants, registration_s, run_reaper
from proxy.record import record_entry, record_reaped
from proxy.redis_store import RedisStore
from proxy.reload import ConfigReloader
from proxy.state import STATE, State
from proxy.store import Eviction, Store
from proxy.thread_pools import TenantPool
from proxy.tokenizer import Tokenizer, encoding_for_model

STOP_LOOP_S = 5.0
log = logging.getLogger("proxy.app")
RELOAD_POLL_S = 2.0
# How often the store's clock is measured again (budget windows follow it: ``Store.now``).
CLOCK_SYNC_S = 30.0
# Large bodies waiting to be parsed and planned off the loop (each already read and held): a
# tenant's past its own bound is refused 503, and a tenant's first past the tenants' bound (a
# flood from as many tenants as pass-through makes keys); one tenant's never refuses another's.
PLANS_TENANTS_MOST = 256
PLANS_A_TENANT_HOLDS_MOST = 16
# Likewise reserve counts (a prompt a budget near its ceiling waits on).
RESERVE_COUNTS_TENANTS_MOST = 64
RESERVE_COUNTS_A_TENANT_HOLDS_MOST = 16

StoreFactory = Callable[[Config], Store]


def default_store_factory(config: Config) -> Store:
    assert config.redis.url is not None, "serve resolves the embedded store before building the app"
    return RedisStore.from_url(
        config.redis.url,
        cluster=config.redis.cluster,
        pool_size=config.redis.pool_size,
        socket_timeout_s=config.redis.socket_timeout_s,
        settled_marker_ttl_s=config.limits.settled_marker_ttl_s,
        ledger_retention_s=config.limits.ledger_retention_s,
    )


async def check_eviction(store: Store, metrics: Metrics, known: Eviction | None) -> Eviction | None:
    """The store's eviction settings, into the metrics; loud when it may drop the proxy's keys
    (once for each setting found), never a refusal to start: a managed Redis may be set so on
    purpose. ``known``: what was found before (None: nothing yet), kept while it cannot be read."""
    try:
        found = await store.eviction()
    except StoreError:
        return known
    except Exception:
        # A reply read wrong must not end the loop that keeps the budget windows' clock.
        log.warning("could not read the store's eviction policy", exc_info=True)
        return known
    policy = found.policy or "unknown"
    metrics.store_drops_keys.set_only((policy,), 1 if found.drops_keys else 0)
    if found.drops_keys and found != known:
        said = (
            f"its maxmemory-policy is {policy} (maxmemory {found.maxmemory} bytes)"
            if found.policy is not None
            else "its maxmemory-policy could not be read (CONFIG and INFO refused)"
        )
        log.warning(
            f"the Redis server may drop the proxy's keys when its memory is full: {said}. A budget's "
            "counter dropped starts again from zero (its ceiling then overspent), a reservation or "
            "ledger entry dropped is lost; set maxmemory-policy noeviction",
            extra={"policy": policy, "maxmemory": found.maxmemory},
        )
    return found


async def check_persistence(store: Store) -> bool:
    """Warn when the store keeps nothing on disk (the ledger lives there), never a refusal to
    start; False while it cannot be read (a store down at start: read again once it answers)."""
    try:
        warning = await store.persistence_warning()
    except StoreError:
        return False
    except Exception:
        # A reply read wrong must not end the loop that keeps the budget windows' clock.
        log.warning("could not read the store's persistence settings", exc_info=True)
        return True
    if warning:
        log.warning(warning)
    return True


def encodings_in(config: Config) -> set[str]:
    names = {encoding_for_model(pattern, model.encoding) for pattern, model in config.models.items()}
    return names | {"o200k_base", "cl100k_base"}


def server_options(config: Config) -> dict[str, Any]:
    """HTTP parser limits, set above ours so that the header limit is ours to enforce (and to
    refuse in the format of the API called); past these the parser refuses, in JSON both APIs'
    clients read (``answer_parser_errors_as_json``). A head is refused as it comes once past a
    request line and one field's limit of fields (``bound_request_heads``): 1,024 fields of
    64 KiB are 64 MiB."""
    return {"max_line_size": 64 * 1024, "max_field_size": 64 * 1024, "max_headers": 1024}


async def _stopped(task: asyncio.Task[None]) -> None:
    """Cancel a background loop and wait for it, a bounded time: a cancel delivered inside a
    store client that swallows it (redis-py may, mid-command) must not hang shutdown."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=STOP_LOOP_S)
    if not done:
        log.error("a background task did not stop when cancelled", extra={"task": task.get_name()})
    elif not task.cancelled() and task.exception() is not None:
        log.error("a background task failed", exc_info=task.exception())


def build_app(
    config: Config,
    *,
    passthrough: bool = False,
    tokenizer: Tokenizer | None = None,
    store_factory: StoreFactory = default_store_factory,
    config_path: Path | None = None,
    run_reaper_task: bool = True,
    registry: CollectorRegistry | None = None,
    workers: int = 1,
    started_from: Config | None = None,
) -> web.Application:
    answer_parser_errors_as_json()
    bound_request_heads()
    app = web.Application(middlewares=[error_middleware], client_max_size=config.limits.max_body_bytes)
    state = State(
        config=config,
        passthrough=passthrough,
        tokenizer=(
            tokenizer
            if tokenizer is not None
            else Tokenizer.load(encodings_in(config), cache_chars=config.limits.token_count_cache_chars)
        ),
        metrics=Metrics(registry if registry is not None else CollectorRegistry(), currency=config.currency),
        journal=Journal(config.journal_dir, store_url=config.redis.url),
        workers=workers,
    )
    app[STATE] = state

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        store = store_factory(config)
        state.store = store
        eviction: Eviction | None = None
        persistence_read = False
        try:
            await store.ping()
            await store.load_scripts()
            with contextlib.suppress(StoreError):  # measured again by the loop below
                await store.sync_clock()
            persistence_read = await check_persistence(store)
            eviction = await check_eviction(store, state.metrics, None)
        except StoreError as err:  # the readiness probe reports it; calls get 503
            log.error("store unreachable at start", extra={"error": str(err)})

        async def clock() -> None:
            nonlocal eviction, persistence_read
            loop = asyncio.get_running_loop()
            due = loop.time() + CLOCK_SYNC_S
            # Budget windows follow the store's clock; a host's clock is stepped or drifts, and so
            # may the store's (measured again at once when a reserve finds it off).
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(store.clock_doubted(), max(0.0, due - loop.time()))
                with contextlib.suppress(StoreError):
                    await store.sync_clock()
                if loop.time() >= due:
                    due = loop.time() + CLOCK_SYNC_S
                    # Read again: a store down at start, a policy changed on a live server.
                    eviction = await check_eviction(store, state.metrics, eviction)
                    if not persistence_read:  # a store down at start; once read, warned of once
                        persistence_read = await check_persistence(store)
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    return  # a cancel a store client swallowed

        syncing = asyncio.create_task(clock())
        yield
        await _stopped(syncing)
        await store.close()

    async def journal_ctx(app: web.Application) -> AsyncIterator[None]:
        """Replay journaled settlements (ours and orphaned ones) whenever the store answers."""
        assert state.store is not None
        store = state.store

        def on_applied(entry: Mapping[str, str]) -> None:
            # A reaper's settle journaled when its reply was lost (``reaper_line``): a lease
            # reaped, as its reaper would have counted it. No call's own settle writes that tag.
            record = record_reaped if entry.get("outcome") == "lease_expired" else record_entry
            record(state.metrics, state.config, entry)

        async def loop() -> None:
            pending = state.metrics.journal_pending.labels()
            while True:
                try:
                    await state.journal.replay(store, on_applied, state.metrics.journal_parked.inc)
                except Exception:
                    log.exception("journal replay failed")
                pending.set(state.journal.pending_lines)
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    return  # a cancel a store client swallowed
                await asyncio.sleep(config.limits.journal_replay_s)

        task = asyncio.create_task(loop())
        yield
        await _stopped(task)
        try:  # a last try before the process goes
            await state.journal.replay(store, on_applied, state.metrics.journal_parked.inc)
        except StoreError:
            pass
        except OSError:
            # A full disk refused the file's rewrite: its lines stay for the next process. The
            # journal is closed all the same (its queued syncs done, a removed file written again).
            log.exception("the last journal replay failed")
        state.journal.close()

    async def settling_ctx(app: web.Application) -> AsyncIterator[None]:
        """Calls cut by shutdown past its grace period may still be settling: they finish (or
        journal) before the journal and the store close, within the store's own time bound."""
        yield
        # A handler cancelled before its settle starts it on its next turn: let those run first.
        await asyncio.sleep(0)
        # A settle makes one script call: a pool wait, a connect and a read at most, then a
        # second call when the script had to be loaded (NOSCRIPT); each is bounded by the timeout.
        # The timeout in force: on a Cluster or over TLS redis-py takes the URL's over the field.
        bound_s = 4 * config.redis.effective_socket_timeout_s + 1
        deadline = asyncio.get_running_loop().time() + bound_s
        while state.settling and asyncio.get_running_loop().time() < deadline:
            await asyncio.wait(set(state.settling), timeout=deadline - asyncio.get_running_loop().time())
        if state.settling:
            # Their reservations stay until a reaper settles them at their reserve.
            log.error("settlements still under way at exit", extra={"count": len(state.settling)})

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        # Before serving, off the loop: else each upstream's first call would build its
        # ca_file's context on it (``Config.build_ca_contexts``), in each worker (a pickled
        # config comes without).
        await asyncio.to_thread(state.config.build_ca_contexts)
        connector = UpstreamConnector(limit=0, ttl_dns_cache=300)
        # No cookie jar: a provider's (or its gateway's) cookies set on one caller's call would go
        # upstream with every later caller's, their own keys beside them.
        state.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=True,
            cookie_jar=aiohttp.DummyCookieJar(),
            # The provider's headers parsed with room, as the server's (``server_options``): past
            # aiohttp's defaults (8,190 bytes a header, 128 headers) a gateway's long set-cookie or
            # CSP would fail every call the provider answered and billed (a 502, at the reserve).
            max_line_size=64 * 1024,
            max_field_size=64 * 1024,
            max_headers=1024,
        )
        yield
        await state.session.close()

    async def estimator_ctx(app: web.Application) -> AsyncIterator[None]:
        # Never refused: a count there only lowers a reserve.
        state.estimator = TenantPool("estimate", threads=1, per_tenant=1)
        # One thread: the walks are Python's, holding the GIL, and the loop takes it back every
        # switch interval (5 ms) from one thread, not from several.
        state.planner = TenantPool(
            "plan",
            threads=1,
            per_tenant=1,
            tenants_most=PLANS_TENANTS_MOST,
            a_tenant_holds_most=PLANS_A_TENANT_HOLDS_MOST,
        )
        # tiktoken counts without the GIL: two at once take both cores of a small machine.
        state.reserve_counts = TenantPool(
            "reserve-count",
            threads=2,
            per_tenant=1,
            tenants_most=RESERVE_COUNTS_TENANTS_MOST,
            a_tenant_holds_most=RESERVE_COUNTS_A_TENANT_HOLDS_MOST,
        )
        state.settle_counts = TenantPool("settle-count", threads=2, per_tenant=1)  # never refused
        yield
        for pool in (state.estimator, state.planner, state.reserve_counts, state.settle_counts):
            pool.shutdown()

    async def log_flush_ctx(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(0.25)
                flush_logs()

        task = asyncio.create_task(loop())
        yield
        await _stopped(task)
        flush_logs()

    async def reaper_ctx(app: web.Application) -> AsyncIterator[None]:
        store = state.store
        assert store is not None

        def count(entry: Mapping[str, str]) -> None:
            record_reaped(state.metrics, state.config, entry)

        task = asyncio.create_task(
            run_reaper(
                store,
                config.limits.reaper_interval_s,
                count,
                known=lambda: known_tenants(state.registered_tenants, state.config, store.now()),
                grace_s=config.limits.reap_grace_s,
                kept_s=registration_s(config),
                journal=state.journal,
                stall_s=config.limits.journal_replay_s / 2,
            )
        )
        yield
        await _stopped(task)

    async def reload_ctx(app: web.Application) -> AsyncIterator[None]:
        assert config_path is not None

        def apply(new: Config) -> None:
            # Encodings are loaded at start for the models of the file then: a model the reload
            # adds with another one would be reserved at its prompt's bytes for good.
            added = encodings_in(new) - encodings_in(state.config)
            # The config replaced may live on (this factory's cleanups, the reloader's start
            # config hold the first one): its key scopes, room for every key, need not.
            vars(state.config).pop("key_scopes", None)
            state.config = new
            if added:
                state.tokenizer.load_more(added)

        def counted(result: str) -> None:
            state.metrics.config_reloads.labels(result).inc()

        for result in ("applied", "refused"):  # at 0 from the start: a first refusal is an increase
            state.metrics.config_reloads.labels(result)

        reloader = ConfigReloader(
            config_path, lambda: state.config, apply, counted=counted, started_from=started_from
        )
        if reloader.changed():
            await reloader.reload_off_loop("file changed while starting")
        reloads: set[asyncio.Task[None]] = set()

        def hung_up() -> None:
            # The load runs on a thread, the signal handler returns at once: held here until
            # it ends (the loop keeps only a weak reference to a task).
            asked = asyncio.create_task(reloader.asked("SIGHUP"))
            reloads.add(asked)
            asked.add_done_callback(reloads.discard)

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, hung_up)
        task = asyncio.create_task(reloader.watch(RELOAD_POLL_S))
        yield
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # removed means the default: terminate
        reloader.close()
        for reload in list(reloads):
            await _stopped(reload)
        await _stopped(task)

    async def expositions_ctx(app: web.Application) -> AsyncIterator[None]:
        state.expositions = Expositions(state.metrics.registry)
        yield
        state.expositions.shutdown()

    async def metrics_site_ctx(app: web.Application) -> AsyncIterator[None]:
        listen = config.metrics.listen
        assert listen is not None
        # Its errors in the proxy's format too (a build that failed), not aiohttp's text page.
        metrics_app = web.Application(middlewares=[error_middleware])
        metrics_app[STATE] = state
        metrics_app.router.add_get("/metrics", metrics_handler(state))
        runner = web.AppRunner(metrics_app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, listen.host, listen.port).start()
        log.info("metrics listening", extra={"host": listen.host, "port": listen.port})
        yield
        await runner.cleanup()

    app.cleanup_ctx.append(log_flush_ctx)
    app.cleanup_ctx.append(store_ctx)
    app.cleanup_ctx.append(journal_ctx)
    app.cleanup_ctx.append(estimator_ctx)
    app.cleanup_ctx.append(settling_ctx)  # cleaned up before the estimate thread, journal, store
    app.cleanup_ctx.append(session_ctx)
    app.cleanup_ctx.append(expositions_ctx)  # before the metrics site: its thread outlives it
    if run_reaper_task:
        app.cleanup_ctx.append(reaper_ctx)
    if config_path is not None:
        app.cleanup_ctx.append(reload_ctx)
    if config.metrics.listen is not None:
        app.cleanup_ctx.append(metrics_site_ctx)
    add_routes(app)
    return app
