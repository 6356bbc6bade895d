"""What an operator reads of the command line, the app factory and the serving processes: the
report's table and exports as printed, the command line's defaults and refusals (their exit codes
and messages), the supervisor's claim on its port, and what the app does at its start and its
exit. Found by a mutation hunt of proxy/app.py, proxy/cli.py, proxy/report.py, proxy/workers.py:
each test fails on a small change of one of them that the suite let through."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web

import proxy.app as app_module
from proxy.app import build_app, server_options
from proxy.cli import _config_for, _parser, main
from proxy.config_load import parse_config
from proxy.redis_server import RedisServerProcess, free_port
from proxy.report import TOKEN_FIELDS
from proxy.state import STATE
from proxy.store import TENANTS_KEY
from proxy.tokenizer import Tokenizer
from proxy.workers import _claim_port
from tests.conftest import UPSTREAM_KEY, ProxyFactory, base_config, refused_port
from tests.fake_upstream import FakeUpstream
from tests.procs import ROOT, ProxyProcess
from tests.test_bad_input import GOOD_BODY, Plan, ScriptedUpstream, scripted_upstreams
from tests.test_budgets import _proxy_from_file
from tests.test_cli import BAD_FLAG_CONFIG, run_cli
from tests.test_fault_matrix import drops_keys, eviction_warnings
from tests.test_store_faults import LEDGER, leased_stream

# -- the report and the exports, as printed -----------------------------------------------------

REPORT_LEDGER = "lbp:{team-t}:ledger"
# Two calls of a run, one without a run (its group is "-"), outcomes met out of their sorted order.
REPORT_ENTRIES = (
    {
        "run_id": "run-with-a-long-name",
        "model": "gpt-4o",
        "outcome": "upstream_4xx",
        "input_tokens": "1234",
        "output_tokens": "5",
        "cost_micros": "12345678",
    },
    {"model": "gpt-4o", "outcome": "ok", "input_tokens": "3", "output_tokens": "40", "cost_micros": "7"},
    {
        "run_id": "run-with-a-long-name",
        "model": "gpt-4o-mini",
        "outcome": "ok",
        "input_tokens": "2",
        "output_tokens": "1",
        "cost_micros": "3",
    },
)


async def _report_ledger(client: aioredis.Redis) -> None:
    for entry in REPORT_ENTRIES:
        await client.xadd(REPORT_LEDGER, dict(entry))  # type: ignore[arg-type]


async def _ledger(client: aioredis.Redis, key: str) -> list[tuple[str, dict[str, str]]]:
    return await client.xrange(key)  # type: ignore[return-value]


async def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert await asyncio.to_thread(main, list(args)) == 0
    return capsys.readouterr().out


def _table_line(cells: list[tuple[str, int, bool]]) -> str:
    """A line of the table: each cell padded to its width, a figure to the right, a name to the
    left, two spaces apart, nothing after the last character."""
    return "  ".join(
        text.rjust(width) if figure else text.ljust(width) for text, width, figure in cells
    ).rstrip()


async def test_the_report_table_lines_up_figures_to_the_right_and_names_a_call_without_a_run(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table an operator reads at a terminal: each column as wide as its widest cell or its
    name, counts and costs right-aligned (their digits line up), names left-aligned, a rule of
    dashes under each name, no trailing spaces; a call without a run under ``-``; the outcomes
    of a group in name order."""
    await _report_ledger(redis_client)
    out = await _cli(capsys, "report", "--redis-url", redis_server.url, "--tenant", "team-t", "--by", "run")
    zeros = {name: "0" for name in TOKEN_FIELDS}
    rows = [
        {
            "run": "-",
            "calls": "1",
            **zeros,
            "input_tokens": "3",
            "output_tokens": "40",
            "cost_usd": "0.000007",
            "outcomes": "ok=1",
        },
        {
            "run": "run-with-a-long-name",
            "calls": "2",
            **zeros,
            "input_tokens": "1236",
            "output_tokens": "6",
            "cost_usd": "12.345681",
            "outcomes": "ok=1 upstream_4xx=1",
        },
    ]
    columns = ["run", "calls", *TOKEN_FIELDS, "cost_usd", "outcomes"]
    widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in columns}
    figures = {c: c not in ("run", "outcomes") for c in columns}
    header = _table_line([(c, widths[c], figures[c]) for c in columns])
    rule = "  ".join("-" * widths[c] for c in columns)
    lines = [_table_line([(row[c], widths[c], figures[c]) for c in columns]) for row in rows]
    assert out.splitlines() == [header, rule, *lines]
    # The same by hand, for the cells the widths above could hide.
    assert out.splitlines()[2].startswith("-" + " " * 25 + "1" + " " * 13 + "3  ")
    assert out.splitlines()[3].endswith("  12.345681  ok=1 upstream_4xx=1")
    assert out.splitlines()[2].endswith("   0.000007  ok=1")


async def test_the_report_groups_by_model_in_a_table_unless_told_otherwise(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: ``report --tenant T [--by model|run|key] [--format table|csv|jsonl]``: by model, as a
    table, by default."""
    await _report_ledger(redis_client)
    lines = (await _cli(capsys, "report", "--redis-url", redis_server.url, "--tenant", "team-t")).splitlines()
    assert lines[0].split()[:2] == ["model", "calls"]
    assert set(lines[1]) == {"-", " "}
    assert [line.split()[:2] for line in lines[2:]] == [["gpt-4o", "2"], ["gpt-4o-mini", "1"]]


async def test_the_ledger_exports_json_lines_by_default(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: ``ledger --tenant T [--format jsonl|csv]``: JSON lines by default, compact (one
    entry a line, no spaces the file would carry millions of times), each with its ledger id."""
    await _report_ledger(redis_client)
    ids = [i for i, _ in await _ledger(redis_client, REPORT_LEDGER)]
    out = await _cli(capsys, "ledger", "--redis-url", redis_server.url, "--tenant", "team-t")
    expected = [
        json.dumps({"id": i, **e}, separators=(",", ":")) for i, e in zip(ids, REPORT_ENTRIES, strict=True)
    ]
    assert out.splitlines() == expected


async def test_the_report_in_json_lines_is_compact(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    await _report_ledger(redis_client)
    args = [
        "report",
        "--redis-url",
        redis_server.url,
        "--tenant",
        "team-t",
        "--by",
        "run",
        "--format",
        "jsonl",
    ]
    out = await _cli(capsys, *args)
    first = out.splitlines()[0]
    assert first.startswith('{"run":"-","calls":"1","input_tokens":"3","cached_input_tokens":"0",')
    assert first.endswith(',"cost_usd":"0.000007","outcomes":"ok=1"}')


@pytest.mark.parametrize(("fmt", "printed"), [("csv", ""), ("jsonl", ""), ("table", "no ledger entries\n")])
async def test_a_report_of_no_calls_says_so_only_in_the_table(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    capsys: pytest.CaptureFixture[str],
    fmt: str,
    printed: str,
) -> None:
    """A CSV or JSON lines read by a program holds no row for no calls: a sentence there would be
    read as a row (or fail the JSON parser)."""
    # A tenant the store knows (registered by a reaper) that made no call: one it does not know
    # is an error (test_cli's test_a_tenant_neither_configured_nor_in_the_store_is_an_error...).
    await redis_client.zadd(TENANTS_KEY, {"team-none": 1})
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-none", "--format", fmt]
    assert await _cli(capsys, *args) == printed


@pytest.fixture
def local_time_tokyo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


async def test_a_since_without_a_zone_is_utc_whatever_the_hosts_zone(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    capsys: pytest.CaptureFixture[str],
    local_time_tokyo: None,
) -> None:
    """README: ``--since DATE``, "UTC date or time": on a host set to another zone, a date without
    one was read in the host's, and the report counted hours of calls before the date."""
    midnight_ms = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp() * 1000)
    for ms in (midnight_ms - 3_600_000, midnight_ms):  # an hour before, the first millisecond of
        await redis_client.xadd("lbp:{team-z}:ledger", {"model": "m", "outcome": "ok"}, id=f"{ms}-0")
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-z", "--since", "2026-11-01"]
    (row,) = map(json.loads, (await _cli(capsys, *args, "--format", "jsonl")).splitlines())
    assert row["calls"] == "1"


async def test_a_since_that_is_not_a_date_is_a_config_error_naming_it(
    redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-a", "--since", "last week"]
    assert await asyncio.to_thread(main, args) == 2
    assert capsys.readouterr().err == "llm-billing-proxy: --since: not a date or time: 'last week'\n"


async def test_a_store_that_does_not_answer_is_a_store_error_exit_3(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README: exit 3, the store unreachable (``ledger``, ``report``): the message says it is the
    store, not the config, that failed."""
    for command in ("ledger", "report"):
        args = [command, "--redis-url", f"redis://127.0.0.1:{refused_port()}/0", "--tenant", "team-a"]
        assert await asyncio.to_thread(main, args) == 3
        assert capsys.readouterr().err.startswith("llm-billing-proxy: store error: ")


async def test_the_report_names_its_cost_column_after_the_configs_currency(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    config = tmp_path / "eur.yaml"
    config.write_text(BAD_FLAG_CONFIG.replace("redis://127.0.0.1:1", redis_server.url) + "currency: EUR\n")
    await _report_ledger(redis_client)
    args = ["report", "--config", str(config), "--tenant", "team-t", "--format", "jsonl"]
    rows = [json.loads(line) for line in (await _cli(capsys, *args)).splitlines()]
    assert [(r["model"], r["cost_eur"]) for r in rows] == [
        ("gpt-4o", "12.345685"),
        ("gpt-4o-mini", "0.000003"),
    ]
    assert not any("cost_usd" in r for r in rows)


# -- serve's command line ------------------------------------------------------------------------


def test_a_zero_config_start_listens_where_the_readme_says() -> None:
    """README: ``listen.host``, ``listen.port``: ``127.0.0.1``, ``8080``; the zero-config start
    (``serve --upstream URL``) too: a default on every address would open the pass-through to
    the network."""
    args = _parser().parse_args(["serve", "--upstream", "http://127.0.0.1:9"])
    listen = _config_for(args)[0].listen
    assert (listen.host, listen.port) == ("127.0.0.1", 8080)
    assert args.workers == 1


def test_host_port_and_redis_url_on_the_command_line_override_the_files(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(BAD_FLAG_CONFIG + "listen: {host: 127.0.0.1, port: 8081}\n")
    argv = ["serve", "--config", str(config), "--host", "0.0.0.0", "--port", "9999", "--redis-url"]
    loaded, _ = _config_for(_parser().parse_args([*argv, "redis://127.0.0.1:7/0"]))
    assert (loaded.listen.host, loaded.listen.port, loaded.redis.url) == (
        "0.0.0.0",
        9999,
        "redis://127.0.0.1:7/0",
    )
    kept, _ = _config_for(_parser().parse_args(["serve", "--config", str(config)]))
    assert (kept.listen.host, kept.listen.port, kept.redis.url) == ("127.0.0.1", 8081, "redis://127.0.0.1:1")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["serve", "--config", "{config}", "--upstream", "http://127.0.0.1:9"],
            "give either --config or --upstream, not both",
        ),
        (["serve", "--config", "{config}", "--workers", "0"], "--workers must be at least 1"),
        (
            # A typo (1000 for 10) took a 2-CPU host's memory and every process on it down.
            ["serve", "--config", "{config}", "--workers", str(4 * len(os.sched_getaffinity(0)) + 1)],
            f"--workers {4 * len(os.sched_getaffinity(0)) + 1}: at most {4 * len(os.sched_getaffinity(0))} "
            "(4 per CPU this process may use)",
        ),
        (
            ["serve", "--config", "{metrics_0}", "--workers", "2"],
            "metrics.listen.port 0 with --workers 2: worker i uses port + i, so the port must be 1 to 65534",
        ),
    ],
)
def test_serve_refuses_what_it_cannot_serve_as_asked_with_exit_2(
    tmp_path: Path, args: list[str], says: str
) -> None:
    """A metrics port of 0 with workers would give each worker a port of its own choosing: none a
    scrape config could name."""
    config = tmp_path / "c.yaml"
    config.write_text(BAD_FLAG_CONFIG)
    metrics_0 = tmp_path / "m.yaml"
    metrics_0.write_text(BAD_FLAG_CONFIG + "metrics: {listen: {host: 127.0.0.1, port: 0}}\n")
    result = run_cli(*(a.format(config=config, metrics_0=metrics_0) for a in args))
    assert (result.returncode, result.stderr) == (2, f"llm-billing-proxy: {says}\n")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on: serve gets past its command line and stops at once,
    exit 4, before any worker starts."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield int(busy.getsockname()[1])


def test_the_last_metrics_port_that_leaves_room_for_every_worker_is_taken(
    tmp_path: Path, busy_port: int
) -> None:
    """README: with ``--workers N``, the metrics port must be 1 to 65536 - N: 65534 for two
    workers is taken (serve goes on, and stops at the main port, in use)."""
    config = tmp_path / "m.yaml"
    config.write_text(BAD_FLAG_CONFIG + "metrics: {listen: {host: 127.0.0.1, port: 65534}}\n")
    result = run_cli("serve", "--config", str(config), "--port", str(busy_port), "--workers", "2")
    assert result.returncode == 4, result.stderr[-500:]
    assert "cannot serve" in result.stderr and "metrics.listen.port" not in result.stderr


def test_workers_without_a_metrics_address_warn_that_metrics_are_per_worker(
    tmp_path: Path, busy_port: int
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(BAD_FLAG_CONFIG)
    result = run_cli("serve", "--config", str(config), "--port", str(busy_port), "--workers", "2")
    assert result.returncode == 4, result.stderr[-500:]
    assert "with --workers, metrics are per worker: set metrics.listen to scrape them" in result.stderr


# -- the supervisor's claim on its port ----------------------------------------------------------


def test_a_claimed_port_refuses_a_second_claim_until_it_is_let_go() -> None:
    """A second ``serve --workers`` instance started while the first's workers are still starting
    (its claim bound, nothing listening yet) must not claim the port beside it: both would
    serve it, each taking part of the calls."""
    port = free_port()
    first = _claim_port("127.0.0.1", port)
    try:
        assert len(first) == 1
        with pytest.raises(OSError):
            _claim_port("127.0.0.1", port)
    finally:
        for sock in first:
            sock.close()
    again = _claim_port("127.0.0.1", port)
    for sock in again:
        sock.close()


def test_a_port_another_process_serves_with_reuse_port_is_refused() -> None:
    """Another instance's workers listen with SO_REUSEPORT (as they must, to share it): a claim
    with SO_REUSEPORT alone binds beside them; the probe without it must find them."""
    port = free_port()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(OSError):
            _claim_port("127.0.0.1", port)


def test_every_address_of_the_host_is_claimed_ipv4_and_ipv6_apart() -> None:
    """``listen.host: ""`` (every address) names 0.0.0.0 and ::. A socket on :: also takes
    IPv4 unless told not to: the claim on :: then collided with the one on 0.0.0.0, and serve
    exited 4 on a port nothing served."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    port = free_port()
    families = {
        info[0] for info in socket.getaddrinfo(None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    }
    if families != {socket.AF_INET, socket.AF_INET6}:
        pytest.skip(f"the host's passive addresses: {families}")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::", 0))
    except OSError:
        pytest.skip("IPv6 cannot be bound on this host")
    claims = _claim_port("", port)
    try:
        assert {sock.family for sock in claims} == families
    finally:
        for sock in claims:
            sock.close()


# -- the app: what it does at its start, while it serves and at its exit ---------------------------


async def test_a_store_that_may_evict_is_warned_of_once_even_across_an_outage(
    make_proxy: ProxyFactory,
    own_redis: RedisServerProcess,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once for each setting found (``check_eviction``): a Redis restarted with the same policy,
    a network blip, must not repeat the warning at every outage (an alert on it would page again
    for nothing changed)."""
    monkeypatch.setattr(app_module, "CLOCK_SYNC_S", 0.05)  # rounds of the check, not every 30 s
    own_redis.stop()
    own_redis.extra_args = ("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    own_redis.start()
    with caplog.at_level("WARNING", logger="proxy.app"):
        proxy = await make_proxy(redis={"url": own_redis.url, "socket_timeout_s": 0.5})
        assert drops_keys(proxy, "allkeys-lru") == 1
        await asyncio.to_thread(own_redis.stop)
        await asyncio.sleep(0.5)  # rounds that find no store
        await asyncio.to_thread(own_redis.start)
        await asyncio.sleep(0.5)  # rounds that find it again, as it was
        assert drops_keys(proxy, "allkeys-lru") == 1
    assert len(eviction_warnings(caplog)) == 1


async def test_a_settle_journaled_during_an_outage_is_applied_at_exit_once_the_store_answers(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    own_redis: RedisServerProcess,
    own_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """A last replay before the process goes: a proxy stopped (a deploy) right after an outage
    leaves nothing pending for a next process that may never start on this journal directory."""
    journal_dir = tmp_path / "journal"
    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 1},
        journal_dir=str(journal_dir),
        limits={"journal_replay_s": 600},  # no replay round between the outage and the exit
    )
    async with aiohttp.ClientSession() as session:
        pending = await leased_stream(session, proxy, fake, own_client, "exit", chunks=5)
        await asyncio.to_thread(own_redis.stop)
        fake.release()
        assert (await (await pending).read()).endswith(b"data: [DONE]\n\n")
    (journal_file,) = journal_dir.glob("journal-*.jsonl")
    assert len(journal_file.read_text().splitlines()) == 1
    await asyncio.to_thread(own_redis.start)
    await proxy.runner.cleanup()
    ((_, entry),) = await _ledger(own_client, LEDGER)
    assert (entry["outcome"], entry["output_tokens"]) == ("ok", "5")
    assert not any(path.read_text() for path in journal_dir.glob("journal-*.jsonl"))


async def test_the_metrics_address_is_let_go_at_exit(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A proxy restarted in the same process (tests, an embedding) or a next one on the same
    host binds the metrics port again: left listening, it could not."""
    port = free_port()
    raw = base_config(
        fake.base_url,
        redis_server.url,
        journal_dir=str(tmp_path / "journal"),
        metrics={"listen": {"host": "127.0.0.1", "port": port}},
    )
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    runner = web.AppRunner(build_app(config, tokenizer=Tokenizer({})), **server_options(config))
    await runner.setup()
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
    await runner.cleanup()
    with socket.socket() as again:
        # Past a connection of the scrape's left in TIME_WAIT; never beside a listener.
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


# -- a serving process, as the operator reads it -------------------------------------------------


async def test_a_zero_config_process_says_how_it_serves_and_that_it_stopped_and_logs_no_more(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """The ``listening`` line names the mode (pass-through here) and the worker; aiohttp's own
    banner (``======== Running on ...``) and access log lines stay out of the log, which carries
    one line per call of the proxy's own; ``stopped`` once it has shut down."""
    args = ("--upstream", fake.base_url, "--redis-url", redis_server.url)
    proc = ProxyProcess(None, tmp_path, args=args).start()
    try:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                proc.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {UPSTREAM_KEY}"},
            ) as resp,
        ):
            assert resp.status == 200
        proc.signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait) == 0
    finally:
        proc.stop()
    log = proc.log()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    (listening,) = [line for line in lines if line["msg"] == "listening"]
    assert (listening["mode"], listening["worker"], listening["workers"]) == ("passthrough", 0, 1)
    assert [line["msg"] for line in lines][-1] == "stopped"
    assert "Running on" not in log and "POST /v1/chat/completions HTTP/1.1" not in log


async def test_the_settled_marker_lives_as_long_as_the_config_says(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    """``limits.settled_marker_ttl_s``: how long a second settle of a call (a journal replayed
    late) still finds it settled; the store's default in its place bills such a replay twice."""
    proxy = await make_proxy(limits={"settled_marker_ttl_s": 7200})
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    await proxy.recorded()
    markers = [key async for key in redis_client.scan_iter("lbp:{team-a}:resv:*")]
    assert len(markers) == 1
    assert 3600 < await redis_client.ttl(markers[0]) <= 7200


async def test_a_request_with_headers_the_proxys_own_limit_allows_is_served(make_proxy: ProxyFactory) -> None:
    """``limits.max_header_bytes`` (16 KB by default) is the proxy's to enforce: aiohttp's own
    limits (8,190 bytes a header, 128 headers) refused a long cookie or a gateway's many headers
    first."""
    proxy = await make_proxy()
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    auth = {"Authorization": "Bearer sk-proxy-team-a"}
    many = {f"x-trace-{i}": "1" for i in range(200)}
    async with aiohttp.ClientSession() as session:
        for headers in ({**auth, "X-Padding": "p" * 10_000}, {**auth, **many}):
            async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()


_SIGHUP_WHILE_SERVE_STARTS = """
import os, signal, sys
from proxy import cli

def hangup_before_the_worker_takes_it(*args):
    os.kill(os.getpid(), signal.SIGHUP)  # a reload asked while serve loads its config, its store
    return 0

cli.run_worker = hangup_before_the_worker_takes_it
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as systemd or a shell starts it (not nohup's SIG_IGN)
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_sighup_while_serve_starts_does_not_kill_it() -> None:
    """SIGHUP's default action ends the process: serve ignores it from its first step (loading
    the config, starting the embedded store: seconds) until a worker's reloader takes it."""
    argv = ["serve", "--upstream", "http://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:1", "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-c", _SIGHUP_WHILE_SERVE_STARTS, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-1000:])


_ONE_OF_TWO_WORKERS = """
import os, sys
from pathlib import Path
from proxy import workers
from proxy.config_load import load_config

sys.exit(workers.run_worker(load_config(Path(sys.argv[1]), dict(os.environ)), False, None, 1, 2))
"""


async def test_worker_i_serves_its_metrics_on_the_base_port_plus_i(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """README: with ``--workers N``, worker i uses the metrics port + i: a scrape config names
    base, base + 1, ... (worker 1 of 2 here, started as the supervisor starts it)."""
    base = refused_port()
    while True:  # base + 1 free too
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                base = refused_port()
    proc = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path)
    raw = yaml.safe_load(proc.config_path.read_text())
    raw["metrics"] = {"listen": {"host": "127.0.0.1", "port": base}}
    proc.config_path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "TEST_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ONE_OF_TWO_WORKERS, str(proc.config_path), cwd=ROOT, env=env
    )
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(f"http://127.0.0.1:{base + 1}/metrics") as resp:
                        assert resp.status == 200
                        break
                except aiohttp.ClientConnectionError:
                    assert worker.returncode is None and time.monotonic() < deadline, "no metrics on base + 1"
                    await asyncio.sleep(0.05)
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.get(f"http://127.0.0.1:{base}/metrics")
        worker.send_signal(signal.SIGTERM)
        assert await worker.wait() == 0
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()


async def test_a_provider_answer_sent_gzipped_is_read_and_billed_at_its_usage(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The upstream session asks for compressed answers (aiohttp's ``Accept-Encoding``) and a
    provider or its gateway may send one: read as sent, its usage was not found and the call
    was billed at the proxy's own count, not the provider's."""
    script.plan = Plan(chunks=[gzip.compress(GOOD_BODY)], extra_headers={"Content-Encoding": "gzip"})
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    answer = await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "fine"
    await proxy.recorded()
    ((_, entry),) = await _ledger(redis_client, LEDGER)
    assert (entry["usage_source"], entry["input_tokens"], entry["output_tokens"]) == ("provider", "3", "1")


async def test_a_pass_through_tenant_the_store_forgot_is_registered_again_for_its_reaper(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A pass-through tenant is in no config: only this process knows it. Should the store's
    tenant set lose it (evicted, deleted), its leases, a dead instance's among them, would go
    unreaped for good (``run_reaper``'s ``known``)."""
    proxy = await make_proxy(
        passthrough=True,
        upstreams={"openai": {"base_url": fake.base_url, "passthrough_auth": True}},
        limits={"reaper_interval_s": 0.05},
    )
    caller = proxy.client(UPSTREAM_KEY)
    await caller.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    tenant = "pt-" + hashlib.sha256(UPSTREAM_KEY.encode()).hexdigest()[:32]
    assert await redis_client.zscore(TENANTS_KEY, tenant) is not None
    await redis_client.delete(TENANTS_KEY)
    deadline = time.monotonic() + 10
    while await redis_client.zscore(TENANTS_KEY, tenant) is None:
        assert time.monotonic() < deadline, await redis_client.zrange(TENANTS_KEY, 0, -1)
        await asyncio.sleep(0.05)


async def test_sighup_reloads_the_config_file_at_once(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: SIGHUP reloads the config file. The file's watch (every 2 s) reloads a saved file
    as well, and hid a signal that reloaded nothing: it is kept out of the way here."""
    monkeypatch.setattr(app_module, "RELOAD_POLL_S", 600.0)
    raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    raw["tiers"] = {"standard": {"run": {"requests": 3}}}
    path = tmp_path / "config.yaml"
    # Ignored until the app takes it: a signal the app does not take must not end the test run.
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    proxy = await _proxy_from_file(raw, path)
    try:
        raw["tiers"] = {"standard": {"run": {"requests": 2}}}
        path.write_text(yaml.safe_dump(raw))
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 10
        while proxy.app[STATE].config.tiers["standard"].run.requests != 2:
            assert time.monotonic() < deadline, "SIGHUP reloaded nothing"
            await asyncio.sleep(0.02)
    finally:
        await proxy.runner.cleanup()
        signal.signal(signal.SIGHUP, before)
