"""The command line: check-config, ledger export and report, run as a user would."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.redis_server import RedisServerProcess
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream

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
