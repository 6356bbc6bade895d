"""Serving processes: one, or N sharing the port under a supervisor (``serve --workers N``).

Signals. A worker shuts down gracefully on its first SIGTERM or SIGINT and ignores repeats:
systemd's stop and a terminal's Ctrl-C signal every process of the group, and the supervisor
passes the signal on as well; a second one used to cut the grace period short (calls cut and
billed ``shutdown``). SIGHUP is ignored until the config reloader takes it (zero-config has
nothing to reload; it used to kill the process). A worker whose supervisor died shuts down
gracefully rather than serve on as an orphan. A worker that fails or is killed makes the
supervisor stop the others and exit with its code (128 + signal), for whatever restarts it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
from collections.abc import Sequence
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.config import Config, EventLoopChoice
from proxy.logs import setup_logging

log = logging.getLogger("proxy.cli")
# Allocations (net) between collections of the youngest generation; CPython's default is 700.
GC_YOUNG_THRESHOLD = 20_000
# Exit codes besides 0: 2 config error, 3 store error (see cli.main), 4 cannot serve (listen).
EXIT_CANNOT_SERVE = 4
# A worker that ended while the supervisor was not stopping, without a failure of its own.
EXIT_WORKER_ENDED = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_HELD_SIGNALS = (signal.SIGINT, signal.SIGHUP)
# aiohttp's shutdown timeout for a grace of 0 (a timeout of 0 is none to aiohttp).
_LEAST_SHUTDOWN_TIMEOUT_S = 0.001


class EarlyStop:
    """SIGTERM and SIGINT from ``serve``'s start until the serving process takes them over,
    kept. Before, a stop while the embedded redis-server started (an AOF's load may take a
    minute) killed serve (a traceback for Ctrl-C) and left the server it started running."""

    def __init__(self) -> None:
        self.asked = False
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self._ask)

    def _ask(self, _signum: int, _frame: object) -> None:
        self.asked = True

    def __call__(self) -> bool:
        return self.asked


def run_worker(
    config: Config,
    passthrough: bool,
    config_path: Path | None,
    worker: int,
    workers: int,
    started_from: Config | None = None,
    early: EarlyStop | None = None,
) -> int:
    """One serving process. With several workers they share the port (SO_REUSEPORT); all
    state is in Redis, so any worker can serve any call. ``started_from``: the file as ``serve``
    read it, before its flags (``reload.ConfigReloader``); ``early``: the stop signals ``serve``
    took until now."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the reloader takes it
    # A stop before the app has started (imports, tokenizer tables) is kept for when it has:
    # cutting the start short half way leaves it neither serving nor shut down.
    stop = _Stop()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda _signum, _frame: setattr(stop, "asked", True))
    if hasattr(signal, "pthread_sigmask"):
        # Held by ``_supervise`` while it started the workers: one that came meanwhile is ours now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)
    stop.asked = stop.asked or (early is not None and early.asked)  # read once ours are in place
    from proxy.app import build_app, server_options

    setup_logging(config.log.level, config.log.format)
    config = worker_config(config, worker, workers)
    app = build_app(
        config, passthrough=passthrough, config_path=config_path, workers=workers, started_from=started_from
    )
    loop, loop_name = new_event_loop(config.event_loop)
    # What exists now (modules, config, tiktoken's rank tables) lives as long as the process:
    # kept out of the collector's scans. A call allocates hundreds of containers, nearly all
    # freed by reference counting: collect the youngest generation less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    listening = {
        "host": config.listen.host,
        "port": config.listen.port,
        "mode": "passthrough" if passthrough else "config",
        "worker": worker,
        "workers": workers,
        "gc_frozen_objects": gc.get_freeze_count(),
        "gc_thresholds": list(gc.get_threshold()),
        "event_loop": loop_name,
    }

    def bound(_banner: str) -> None:
        # run_app's banner, once every site is bound: a port it could not take (exit 4) was
        # logged as listening before.
        log.info("listening", extra=listening)

    async def take_signals(_app: web.Application) -> None:
        # From the running loop: uvloop takes a signal handler over at once but listens only
        # once it runs, so a stop signal in between was lost (the worker served on).
        _stop_once_on_signals(loop, stop, watch_parent=workers > 1)

    async def started(_app: web.Application) -> None:
        stop.started = True
        if stop.asked:
            loop.call_soon(stop)

    app.on_startup.insert(0, take_signals)  # before the cleanup contexts: a stop then waits
    app.on_startup.append(started)  # after the cleanup contexts' start: the app is whole
    try:
        web.run_app(
            app,
            host=config.listen.host,
            port=config.listen.port,
            print=bound,
            access_log=None,
            shutdown_timeout=aiohttp_shutdown_timeout(config.shutdown_grace_s),
            reuse_port=workers > 1,
            handle_signals=False,  # ours: see _stop_once_on_signals
            loop=loop,
            **server_options(config),
        )
    except OSError as err:
        # A port taken (the main one or the metrics one), an address not on this host: the
        # operator's to fix, not a traceback. aiohttp's message names the address.
        print(f"llm-billing-proxy: cannot serve: {err.strerror or err}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    log.info("stopped", extra={"worker": worker})
    return 0


def worker_config(config: Config, worker: int, workers: int) -> Config:
    """The config worker ``worker`` serves: with several, each exposes its own metrics on a port
    of its own, the base port + its index."""
    if workers == 1 or config.metrics.listen is None:
        return config
    listen = config.metrics.listen.model_copy(update={"port": config.metrics.listen.port + worker})
    return config.model_copy(update={"metrics": config.metrics.model_copy(update={"listen": listen})})


def aiohttp_shutdown_timeout(grace_s: float) -> float:
    """aiohttp's ``shutdown_timeout`` for a grace period of ``grace_s``. aiohttp waits it twice
    for a handler still running: for the handler to end, then again once it has failed the
    request's body, and only then cancels it. Passed the grace itself, in-flight calls ran for
    twice the grace before they were ended and settled (``shutdown``), past a supervisor's stop
    timeout sized on it. A body still coming when the first half ends can no longer arrive
    (aiohttp reads nothing more once shutdown starts): nothing of it was reserved.

    Never 0: aiohttp reads a timeout of 0 as none, and a grace of 0 waited for every in-flight
    call to end by itself; the least it takes ends them at once."""
    return max(grace_s / 2, _LEAST_SHUTDOWN_TIMEOUT_S)


def new_event_loop(choice: EventLoopChoice) -> tuple[asyncio.AbstractEventLoop, str]:
    """The serving loop and its name. uvloop by default: the same asyncio API in C, about 7% less
    CPU per call here (bench/README.md); ``asyncio`` is there to rule the loop out when
    something misbehaves. ``uvloop`` where it is not installed is refused when the config loads."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise
        else:
            return uvloop.new_event_loop(), "uvloop"
    return asyncio.new_event_loop(), "asyncio"


class _Stop:
    """Starts the graceful shutdown once: repeats (the group's signal, the supervisor's) are
    ignored, and one that comes before the app has started waits for it."""

    def __init__(self) -> None:
        self.started = False
        self.asked = False
        self.stopping = False

    def __call__(self) -> None:
        self.asked = True
        if not self.started or self.stopping:
            return
        self.stopping = True
        raise web.GracefulExit()  # as aiohttp's own handler does: run_app shuts down


def _stop_once_on_signals(loop: asyncio.AbstractEventLoop, stop: _Stop, *, watch_parent: bool) -> None:
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    parent = multiprocessing.parent_process()
    if watch_parent and parent is not None and parent.sentinel is not None:
        sentinel = parent.sentinel

        def parent_gone() -> None:
            loop.remove_reader(sentinel)
            log.error("the supervisor is gone: shutting down")
            stop()

        loop.add_reader(sentinel, parent_gone)  # readable (EOF) once the supervisor has died


def _worker_process(*args: Any) -> None:
    sys.exit(run_worker(*args))


def supervise(
    config: Config,
    passthrough: bool,
    config_path: Path | None,
    workers: int,
    started_from: Config | None = None,
    early: EarlyStop | None = None,
) -> int:
    """Start the workers, pass SIGTERM/SIGINT/SIGHUP on to them, wait for all of them; the first
    that fails stops the rest. ``early``: the stop signals ``serve`` took until now."""
    try:
        claim = _claim_port(config.listen.host, config.listen.port)
    except OSError as err:
        # The workers' listeners share the port (SO_REUSEPORT): their bind succeeds beside
        # another instance's workers, which would then take part of the calls. Asked here, once.
        print(f"llm-billing-proxy: cannot serve: {err.strerror or err}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    try:
        return _supervise(config, passthrough, config_path, workers, started_from, early)
    finally:
        for sock in claim:
            sock.close()


def _claim_port(host: str, port: int) -> list[socket.socket]:
    """Refuse a port another process serves, and claim it for this instance's workers.

    A probe without SO_REUSEPORT fails to bind where anything listens or another instance holds
    its claim; the claim (SO_REUSEPORT, bound, never listening: it gets no connections) lets
    this instance's workers bind beside it and makes a second instance's probe fail."""
    if not port:
        return []
    claims: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _name, address in dict.fromkeys(
            (family, kind, proto, "", address) for family, kind, proto, _name, address in infos
        ):
            for reuse_port in (False, True):
                sock = socket.socket(family, kind, proto)
                try:
                    if family == socket.AF_INET6:
                        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    # Both bind past the TIME_WAIT connections a previous instance left (a
                    # single process's lack SO_REUSEPORT); the claim then drops SO_REUSEADDR,
                    # so that another instance's probe does not bind beside it.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if reuse_port:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                    sock.bind(address)
                    if reuse_port:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
                except BaseException:
                    sock.close()
                    raise
                if reuse_port:
                    claims.append(sock)
                else:
                    sock.close()
    except BaseException:
        for sock in claims:
            sock.close()
        raise
    return claims


def _supervise(
    config: Config,
    passthrough: bool,
    config_path: Path | None,
    workers: int,
    started_from: Config | None,
    early: EarlyStop | None,
) -> int:
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(
            target=_worker_process,
            args=(config, passthrough, config_path, i, workers, started_from),
            name=f"worker-{i}",
        )
        for i in range(workers)
    ]
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = stopping or signum in _STOP_SIGNALS
        _signal_all(children, signum)

    signal.signal(signal.SIGTERM, forward)
    # Held (blocked) while the workers start, and so in each worker (a signal mask passes
    # through exec) until its handlers are in place: a SIGHUP before a worker's reloader would
    # kill it, a Ctrl-C in its bootstrap would end it with a traceback (exit 1). Not ignored: an
    # ignored signal is dropped, and a Ctrl-C then was lost by every process, serve serving on.
    for sig in _HELD_SIGNALS:
        signal.signal(sig, forward)
    # Started by the first worker's start otherwise, whose own mask there (SIGINT blocked for
    # its spawn, then unblocked) would have the workers spawned with SIGINT no longer held.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        if early is not None and early.asked:  # read once ours are in place
            return 0
        for child in children:
            child.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)  # one held meanwhile: forwarded now
    if stopping:
        _signal_all(children, signal.SIGTERM)  # asked while some were not started yet
    failure = 0
    running = list(children)
    while running:
        # While stopping, asked again every second: a worker still in its bootstrap may have
        # missed the first (ignored there, or before its handler); a worker already shutting
        # down ignores repeats. Never an endless wait: a signal handled during one does not end
        # it (the wait is retried), and a stop asked then would never be asked again.
        ended = multiprocessing.connection.wait([child.sentinel for child in running], timeout=1.0)
        if stopping and not ended:
            _signal_all(running, signal.SIGTERM)
        for child in [c for c in running if c.sentinel in ended]:
            child.join()
            running.remove(child)
            code = child.exitcode or 0
            if stopping and -code in _STOP_SIGNALS:
                code = 0  # stopped before it could take the signal itself: a stop, not a crash
            elif not stopping and not code:
                # Ended unasked, gracefully (a stop signal of its own): the service stops all the
                # same, and what restarts it on failure must see one.
                code = EXIT_WORKER_ENDED
            if code and not failure:
                # A worker killed by a signal (the OOM killer) has a negative exit code: a
                # failure too, reported as a shell would (128 + the signal).
                failure = code if code > 0 else 128 - code
            if not stopping:
                # Whatever ended it (a failure, a signal of its own), the service is not what
                # was started: all stop, for whatever restarts it.
                log.error("a worker ended: stopping the others", extra={"worker": child.name, "code": code})
                stopping = True
                _signal_all(running, signal.SIGTERM)
    return failure


def _signal_all(children: Sequence[multiprocessing.process.BaseProcess], signum: int) -> None:
    for child in children:
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signum)
