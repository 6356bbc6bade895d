"""The command line: serve, check-config, ledger, report."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.config import Config
from proxy.config_load import (
    cross_checked,
    load_config,
    log_egress,
    log_warnings,
    passthrough_config,
    with_flags,
)
from proxy.errors import ConfigError, StoreError
from proxy.logs import setup_logging
from proxy.redis_server import EmbeddedKeeper, RedisServerProcess, StartCancelled
from proxy.store import Store
from proxy.workers import EarlyStop, run_worker, supervise, worker_config

if TYPE_CHECKING:
    from proxy.report import Totals

log = logging.getLogger("proxy.cli")
# More serving processes than this per CPU only share the same cores, each its own memory.
WORKERS_PER_CPU = 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-billing-proxy",
        description="An OpenAI-compatible proxy that bills every call it forwards: "
        "serve it, check a config file, export its ledger or report its totals.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", type=Path, help="YAML config file")
    serve.add_argument(
        "--upstream",
        help="zero-config: serve every model from this upstream URL, passing the caller's key through",
    )
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--redis-url", default=None, help="use this Redis instead of the embedded one")
    serve.add_argument("--workers", type=int, default=1, help="serving processes sharing the port")

    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file", type=Path)

    ledger = sub.add_parser("ledger", help="export ledger entries")
    ledger.add_argument("--config", type=Path)
    ledger.add_argument("--redis-url", default=None)
    ledger.add_argument("--tenant", required=True)
    ledger.add_argument("--run", default=None)
    ledger.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    report = sub.add_parser("report", help="totals of the ledger: tokens, cost, outcomes")
    report.add_argument("--config", type=Path)
    report.add_argument("--redis-url", default=None)
    report.add_argument("--tenant", required=True)
    report.add_argument(
        "--since",
        default=None,
        help="only the calls made since this UTC date or time, e.g. 2026-11-01 (when a call "
        "started, not when its entry was written)",
    )
    report.add_argument("--by", choices=("model", "run", "key"), default="model")
    report.add_argument("--format", choices=("table", "csv", "jsonl"), default="table")
    return parser


def _config_for(args: argparse.Namespace, warnings: list[str] | None = None) -> tuple[Config, Config | None]:
    """The config to serve, and the file as read (None: zero-config), before its flags: the
    reloader compares start-only settings with that file, not with a save made while the proxy
    started. The file's warnings go to ``warnings`` when given (``parse_config``)."""
    if getattr(args, "upstream", None):
        if args.config:
            raise ConfigError("give either --config or --upstream, not both")
        zero = passthrough_config(
            args.upstream,
            host=args.host or "127.0.0.1",
            port=8080 if args.port is None else args.port,
            redis_url=args.redis_url,
        )
        return zero, None
    if not args.config:
        raise ConfigError("give --config FILE (or --upstream URL for a zero-config start)")
    read = load_config(args.config, warnings=warnings)
    flagged = with_flags(
        read,
        host=getattr(args, "host", None) or None,
        port=getattr(args, "port", None),
        redis_url=args.redis_url or None,
    )
    return flagged, read


@contextmanager
def store_url(
    config: Config,
    *,
    purpose: str,
    create: bool = True,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[Config]:
    """The config with a Redis URL: the configured one, or an embedded child server. Without
    ``create`` (reading the ledger) a data directory holding no store is an error: a relative
    ``data_dir`` read from another directory would otherwise start an empty store there and
    report an empty ledger. ``StartCancelled`` once ``cancelled()`` says so while the embedded
    server starts, the server stopped."""
    if config.redis.url is not None:
        yield config
        return
    if config.redis.cluster:
        raise ConfigError(
            f"redis.cluster: true needs redis.url (redis.url_env {config.redis.url_env} is not set, or "
            "--redis-url): the embedded redis-server is not a cluster"
        )
    server = RedisServerProcess(config.redis.data_dir.resolve())
    if not create and not server.answers_ping() and not server.holds_data():
        raise StoreError(
            f"no ledger store in {server.data_dir} (no server running there, no data): run from "
            "the directory the proxy serves from, or give --redis-url"
        )
    keeper = EmbeddedKeeper(server, take_over=purpose == "serve")
    try:
        if keeper.ensure(cancelled):
            log.info(
                "started embedded redis-server",
                extra={
                    "binary": server.binary,
                    "socket": str(server.socket_path),
                    "data_dir": str(server.data_dir),
                    "for": purpose,
                },
            )
        if purpose == "serve":
            keeper.watch()
        yield config.model_copy(update={"redis": config.redis.model_copy(update={"url": server.url})})
    finally:
        keeper.close()
        if server.process is not None:
            log.info("stopped embedded redis-server")


def _cpus() -> int:
    """The CPUs this process may run on (a cpuset's or a taskset's; a CFS quota, ``docker
    --cpus``, leaves them the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until a worker's reloader takes it
    early = EarlyStop()  # until the serving process (or the supervisor) takes the stop signals
    # Logged once the file has said how: before, Python's last resort wrote them as bare text,
    # not the JSON lines ``log.format: json`` promises.
    warnings: list[str] = []
    config, started_from = _config_for(args, warnings)
    setup_logging(config.log.level, config.log.format)
    log_warnings(warnings)
    log_egress(config)
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    if args.workers > (most := WORKERS_PER_CPU * _cpus()):
        # Each is a process of ~110 MiB serving on the same cores: a typo (1000 for 10) took a
        # small host's memory and its other processes down with it.
        raise ConfigError(
            f"--workers {args.workers}: at most {most} ({WORKERS_PER_CPU} per CPU this process may use)"
        )
    metrics = config.metrics.listen
    if args.workers > 1 and metrics is not None and not 0 < metrics.port <= 65536 - args.workers:
        # Worker i listens on port + i: each must be a port of its own (0 would make it i).
        raise ConfigError(
            f"metrics.listen.port {metrics.port} with --workers {args.workers}: worker i uses port + i, "
            f"so the port must be 1 to {65536 - args.workers}"
        )
    if metrics is not None and 0 < config.listen.port - metrics.port < args.workers:
        # The worker whose metrics port would be the main one: bound first, the main port then
        # failed as if another process held it (exit 4).
        worker = config.listen.port - metrics.port
        cross_checked(
            worker_config(config, worker, args.workers),
            f"--workers {args.workers}: worker {worker} serves its metrics on metrics.listen.port + {worker}",
        )
    if args.workers > 1 and metrics is None:
        log.warning("with --workers, metrics are per worker: set metrics.listen to scrape them")
    _journal_writable(config.journal_dir)
    try:
        with store_url(config, purpose="serve", cancelled=early) as config:
            if early.asked:
                log.info("stopped before serving")
                return 0
            if args.workers == 1:
                return run_worker(config, bool(args.upstream), args.config, 0, 1, started_from, early)
            return supervise(config, bool(args.upstream), args.config, args.workers, started_from, early)
    except StartCancelled:
        log.info("stopped while the embedded redis-server started")
        return 0


def _journal_writable(directory: Path) -> None:
    """The journal is written only when Redis fails a settle: a directory that cannot be made or
    written there would show then, each such call left to a reaper at its reserve. Made and
    written once at start instead (check-config may run on another host: not there)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise ConfigError(
            f"journal_dir {str(directory)[:200]!r}: the journal cannot be written there "
            f"({err.strerror or err})"
        ) from None


def check_config(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    print(
        f"{args.file}: ok ({len(config.upstreams)} upstreams, {len(config.models)} models, "
        f"{len(config.keys)} keys, {len(config.tiers)} tiers)"
    )
    return 0


async def _ledger_pages(
    store: Store, tenant: str, run: str | None, start: str = "-"
) -> AsyncIterator[list[dict[str, str]]]:
    if run is not None:
        async for entries in store.run_ledger_pages(tenant=tenant, run_id=run):
            yield entries
        return
    async for page in store.ledger_pages(tenant=tenant, start=start):
        yield [{"id": i, **fields} for i, fields in page]


def _open_store(config: Config) -> Store:
    from proxy.redis_store import RedisStore

    assert config.redis.url is not None
    return RedisStore.from_url(config.redis.url, cluster=config.redis.cluster)


async def _known(config: Config, store: Store, tenant: str) -> None:
    """A tenant the config's keys name, or the store knows (a ledger, a registration: a tenant a
    reload removed whose ledger Redis keeps, a pass-through caller's): else a ``ConfigError``
    (exit 2), an operator's typo read as a tenant that made no call otherwise."""
    if tenant in config.tenants or await store.knows_tenant(tenant):
        return
    raise ConfigError(
        f"no tenant {tenant[:200]!r}: neither the config's keys nor the store's ledgers and tenant "
        "registry name it"
    )


async def _export(config: Config, tenant: str, run: str | None, fmt: str) -> None:
    """Written page by page as it is read (a ledger may hold millions of entries). A CSV's
    columns, which entries differ in, are read first: the entries then, and only those."""
    from proxy.report import columns_of, csv_rows, csv_writer

    store = _open_store(config)
    try:
        await _known(config, store, tenant)
        if fmt == "jsonl":
            async for entries in _ledger_pages(store, tenant, run):
                sys.stdout.write("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in entries))
            return
        columns: dict[str, None] = {}
        last: tuple[int, ...] | None = None
        async for entries in _ledger_pages(store, tenant, run):
            columns_of(entries, columns)
            if entries:
                last = _entry_order(entries[-1]["id"])
        if last is None:
            return
        writer = csv_writer(sys.stdout, columns)
        # Up to the last entry read above, by id, not by count: a settle meanwhile may have
        # trimmed the oldest (limits.ledger_retention_s), and an entry past them, its columns
        # not read, would fail the writer. Both grow only at the end, in id order.
        async for entries in _ledger_pages(store, tenant, run):
            rows = [entry for entry in entries if _entry_order(entry["id"]) <= last]
            writer.writerows(csv_rows(rows))
            if len(rows) < len(entries):
                break
    finally:
        await store.close()


def _entry_order(entry_id: str) -> tuple[int, ...]:
    """A ledger id (``<ms>-<seq>``) as the stream orders it."""
    return tuple(int(part) for part in entry_id.split("-"))


def _store_config(args: argparse.Namespace) -> Config:
    if args.config:
        config = load_config(args.config, key_secrets=False)  # the store's settings only
    else:
        # --redis-url, or the embedded default of this directory: where ``serve --upstream``
        # (zero config) keeps its ledger. No store there is an error (``store_url``).
        config = passthrough_config(
            "http://unused.invalid", host="127.0.0.1", port=0, redis_url=None, environ={}
        )
    config = with_flags(config, redis_url=args.redis_url or None)
    setup_logging("warning", "text")
    return config


def ledger(args: argparse.Namespace) -> int:
    with store_url(_store_config(args), purpose="ledger", create=False) as config:
        asyncio.run(_export(config, args.tenant, args.run, args.format))
    return 0


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# An entry is written once its call ended, by Redis's clock; ``time_ms``, when it started, is the
# proxy host's. A call made since a moment is read from this long before it: a host's clock
# ahead of Redis's by more would hide its calls of the first moments.
READ_BACK_MS = 3_600_000


def _since_ms(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--since: not a date or time: {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    # A ledger id is milliseconds since 1970: nothing is older. In whole milliseconds: a float's
    # product lands below the whole number for some moments (2038-08-29T17:04:47.186), and the
    # millisecond before would be counted.
    return max(0, (moment - _EPOCH) // timedelta(milliseconds=1))


def _made_ms(entry: dict[str, str]) -> int:
    """When the entry's call was made: its ``time_ms``, else (an entry without one) when it was
    written, its id's time."""
    made = entry.get("time_ms", "")
    return int(made) if made.isdigit() else int(entry["id"].partition("-")[0])


async def _totals(config: Config, tenant: str, since_ms: int | None, by: str) -> dict[str, Totals]:
    """The ledger's totals per group, of the calls made since ``since_ms`` (all: None), sorted:
    added up page by page, never every entry in memory at once."""
    from proxy.report import add_up

    store = _open_store(config)
    totals: dict[str, Totals] = {}
    start = "-" if since_ms is None else str(max(0, since_ms - READ_BACK_MS))
    try:
        await _known(config, store, tenant)
        async for page in _ledger_pages(store, tenant, None, start):
            if since_ms is not None:
                # A call made before, written after (a long stream, a journal replayed days on)
                # is the earlier period's, as its meters counted it in its reserve's window.
                page = [entry for entry in page if _made_ms(entry) >= since_ms]
            add_up(page, by, totals)
    finally:
        await store.close()
    return dict(sorted(totals.items()))


def report_command(args: argparse.Namespace) -> int:
    from proxy.report import render, rows

    since_ms = _since_ms(args.since)
    with store_url(_store_config(args), purpose="report", create=False) as config:
        totals = asyncio.run(_totals(config, args.tenant, since_ms, args.by))
        table = rows(totals, args.by, config.currency)
    sys.stdout.write(render(table, args.format))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"serve": serve, "check-config": check_config, "ledger": ledger, "report": report_command}
    try:
        return commands[args.command](args)
    except ConfigError as err:
        print(f"llm-billing-proxy: {err}", file=sys.stderr)
        return 2
    except StoreError as err:
        print(f"llm-billing-proxy: store error: {err}", file=sys.stderr)
        return 3
    except BrokenPipeError:
        # The reader left (``ledger ... | head``): nothing more to write, and nothing to report.
        # What is still buffered goes nowhere: the interpreter's flush at exit would raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE  # as a shell reports a writer that SIGPIPE ended


if __name__ == "__main__":
    sys.exit(main())
