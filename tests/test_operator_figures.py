"""What an operator reads of the calls: the Prometheus counters and their labels, the per-call
log line, the billing views and the ledger exports, each against the ledger it reports."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import logging
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from proxy.cli import main
from proxy.config_load import load_config, parse_config
from proxy.logs import TRUSTED_FIELDS, BufferedStderrHandler, JsonFormatter, TextFormatter
from proxy.metrics import Counter, Metrics
from proxy.outcome import TOKEN_KINDS
from proxy.record import record_entry
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy, ProxyFactory, base_config, until_upstream_received
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import GOOD_BODY, Plan, ScriptedUpstream, scripted_upstreams
from tests.test_budgets import meters
from tests.test_cli import LEDGER_ENTRY, ROOT
from tests.test_metrics import PRICED_MODELS

LEDGER = "lbp:{team-a}:ledger"
MSGS: list[Any] = [{"role": "user", "content": "hi"}]


def counted(counter: Counter, **labels: str) -> float:
    """The sum of ``counter``'s series whose labels include ``labels``."""
    return sum(
        value.value
        for names, value in counter.items()
        if all(dict(zip(counter.labelnames, names, strict=True)).get(k) == v for k, v in labels.items())
    )


def label_values(counter: Counter, label: str) -> set[str]:
    index = counter.labelnames.index(label)
    return {names[index] for names, _ in counter.items()}


async def entries(redis_client: aioredis.Redis, ledger: str = LEDGER) -> list[dict[str, str]]:
    rows: list[tuple[str, dict[str, str]]] = await redis_client.xrange(ledger)  # type: ignore[assignment]
    return [fields for _, fields in rows]


def metrics_of(proxy: Proxy) -> Metrics:
    return proxy.app[STATE].metrics


# -- the spend counters and their labels -------------------------------------------------------


async def test_a_model_the_config_does_not_name_is_counted_as_other(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Without the fold, every model string a client sends (routed by the config's ``*``) was a
    label value of its own: series without bound in the operator's Prometheus."""
    proxy = await make_proxy()
    client = proxy.client()
    for model in ("gpt-4o-mini", "gpt-4o", "made-up-model-1"):
        await client.chat.completions.create(model=model, messages=MSGS)
    await proxy.recorded()
    requests = metrics_of(proxy).requests
    assert label_values(requests, "model") == {"gpt-4o-mini", "other"}
    assert counted(requests, model="other") == 2
    assert [e["model"] for e in await entries(redis_client)] == ["gpt-4o-mini", "gpt-4o", "made-up-model-1"]


async def test_pass_through_callers_are_counted_under_one_tenant_label(
    make_proxy: ProxyFactory, fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass-through tenant is one per key a caller sends: as its own label value (spend and
    budget refusals) the series grew without bound. The call line still names the tenant."""
    proxy = await make_proxy(
        passthrough=True,
        upstreams={"openai": {"base_url": fake.base_url, "passthrough_auth": True}},
        tiers={"standard": {"run": {"requests": 1}}},
    )
    fake.api_key = None  # each caller's own key is taken upstream
    caplog.set_level(logging.INFO)
    for key in ("sk-caller-one", "sk-caller-two"):
        client = proxy.client(key=key)
        await client.chat.completions.create(
            model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Run-Id": "r"}
        )
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(
                model="gpt-4o-mini", messages=MSGS, extra_headers={"X-Run-Id": "r"}
            )
    await proxy.recorded()
    metrics = metrics_of(proxy)
    assert label_values(metrics.requests, "tenant") == {"passthrough"}
    assert counted(metrics.requests, tenant="passthrough") == 2
    assert label_values(metrics.tokens, "tenant") == {"passthrough"}
    assert label_values(metrics.budget_refusals, "tenant") == {"passthrough"}
    assert counted(metrics.budget_refusals, tenant="passthrough", scope="run", meter="requests") == 2
    lines = [r.__dict__[TRUSTED_FIELDS] for r in caplog.records if TRUSTED_FIELDS in r.__dict__]
    assert len(lines) == 2 and all(line["tenant"].startswith("pt-") for line in lines), lines


async def test_tokens_counted_by_the_proxy_are_labelled_with_their_source(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A call without provider usage is billed on the proxy's own count (``chars`` here): the
    counters said ``provider`` for every live call, so a dashboard of estimated spend read 0."""
    proxy = await make_proxy()
    client = proxy.client()
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS)
    await client.chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, extra_body={"fake": {"no_usage": True}}
    )
    await proxy.recorded()
    provided, counted_here = await entries(redis_client)
    assert provided["usage_source"] == "provider" and counted_here["usage_source"] != "provider"
    tokens = metrics_of(proxy).tokens
    for entry in (provided, counted_here):
        source = entry["usage_source"]
        for kind in ("input", "output"):
            assert counted(tokens, type=kind, source=source) == int(entry[f"{kind}_tokens"]), (kind, source)


async def test_a_clamped_call_is_counted(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """llm_proxy_clamped_total: a call whose output cap the budget lowered (the ledger's
    ``clamped``); it was never counted, so an alert on clamping never fired."""
    proxy = await make_proxy(
        tiers={"standard": {"run": {"output_tokens": 6}, "on_budget_short": "clamp", "min_output_tokens": 2}}
    )
    client = proxy.client()
    await client.chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, max_tokens=100, extra_headers={"X-Run-Id": "clamp"}
    )
    await client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=3)
    await proxy.recorded()
    clamped = metrics_of(proxy).clamped
    assert [(names, value.value) for names, value in clamped.items()] == [(["team-a"], 1)]


async def test_the_reserve_error_ratio_is_the_estimate_over_the_providers_count(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Its help says estimated / provider input tokens: an estimate 1,000 times short must land in
    the lowest bucket, not past the last one (the ratio inverted reads as a 1,000-fold over-reserve)."""
    proxy = await make_proxy()
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, extra_body={"fake": {"usage": {"prompt_tokens": 5000}}}
    )
    await proxy.recorded()
    (entry,) = await entries(redis_client)
    ratio = metrics_of(proxy).reserve_error.labels()
    assert ratio.counts[0] == 1  # le 0.5
    assert ratio.sum == pytest.approx(int(entry["reserved_input_tokens"]) / 5000)


async def test_the_time_to_first_token_is_not_the_duration_which_is_labelled_by_endpoint(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy()
    stream = await proxy.client().chat.completions.create(
        model="gpt-4o-mini",
        messages=MSGS,
        stream=True,
        extra_body={"fake": {"reply_tokens": 4, "chunk_delay_s": 0.02}},
    )
    async for _ in stream:
        pass
    await proxy.recorded()
    metrics = metrics_of(proxy)
    ttft = metrics.ttft.labels("gpt-4o-mini")
    duration = metrics.duration.labels("chat.completions")
    assert sum(ttft.counts) == sum(duration.counts) == 1
    assert 0 < ttft.sum < duration.sum
    await proxy.client().embeddings.create(model="text-embedding-3-small", input="hi")
    await proxy.recorded()
    assert [names for names, _ in metrics.duration.items()] == [["chat.completions"], ["embeddings"]]


async def test_a_whole_answer_has_no_time_to_first_token(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """A non-streaming answer's text is read all at once, with its body: its "first token" was
    its whole duration, mixed into the per-model time to first token of the streams (a 30 s
    answer read as a 30 s first token)."""
    proxy = await make_proxy()
    await proxy.client().chat.completions.create(
        model="gpt-4o-mini", messages=MSGS, extra_body={"fake": {"reply_tokens": 4}}
    )
    await proxy.recorded()
    assert metrics_of(proxy).ttft.items() == []
    (entry,) = await entries(redis_client)
    assert entry["ttft_ms"] == ""
    assert sum(metrics_of(proxy).duration.labels("chat.completions").counts) == 1


def test_a_replayed_or_reaped_entry_is_counted_as_the_call_itself_would_be() -> None:
    """``record_entry`` (a journaled settle replayed, a lease reaped) fed the counters from the
    entry's strings: a JSON rejection's outcome with its parser message as a label value (one
    series per message), and clamped calls, overshoot and rarer token kinds left out."""
    config = parse_config(
        base_config("http://127.0.0.1:9", "redis://127.0.0.1:1", models=PRICED_MODELS),
        {"TEST_UPSTREAM_KEY": UPSTREAM_KEY},
    )
    metrics = Metrics(CollectorRegistry())
    entry = {
        **LEDGER_ENTRY,
        "tenant": "team-a",
        "outcome": "rejected:parse-json: Expecting value: line 1 column 1 (char 0)",
        "usage_source": "tokenizer",
        "clamped": "1",
        "overshoot_tokens": "5",
        **{f"{kind}_tokens": str(10 + i) for i, kind in enumerate(TOKEN_KINDS)},
    }
    record_entry(metrics, config, entry)
    assert [names for names, _ in metrics.requests.items()] == [
        ["team-a", "gpt-4o-mini", "chat.completions", "rejected"]
    ]
    for i, kind in enumerate(TOKEN_KINDS):
        assert counted(metrics.tokens, type=kind, source="tokenizer") == 10 + i, kind
    assert counted(metrics.cost_micros, tenant="team-a") == 20
    assert counted(metrics.overshoot, tenant="team-a") == 5
    assert counted(metrics.clamped, tenant="team-a") == 1


# -- the billing views -------------------------------------------------------------------------


async def test_a_run_whose_only_call_is_in_flight_shows_its_reserve(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A run is found by what it used, holds or refused: its first call, still running, is a run with a
    reserve (a 404 would tell an agent its run does not exist while it is being billed). Once
    settled, the summary is the used figures against the ceilings."""
    proxy = await make_proxy(models=PRICED_MODELS, tiers={"standard": {"run": {"requests": 5}}})
    call = asyncio.create_task(
        proxy.client().chat.completions.create(
            model="gpt-4o-mini",
            messages=MSGS,
            max_tokens=10,
            extra_headers={"X-Run-Id": "held-run-1"},
            extra_body={"fake": {"hold": True}},
        )
    )
    await until_upstream_received(fake, 1)
    view = (await meters(proxy, "held-run-1"))["meters"]
    assert view["requests"] == {"used": 0, "reserved": 1, "ceiling": 5, "refused": 0}
    assert view["concurrent"] == {"used": 0, "reserved": 1, "ceiling": None, "refused": 0, "peak": 1}
    assert view["output_tokens"]["reserved"] == 10
    fake.release()
    await call
    await proxy.recorded()
    body = await meters(proxy, "held-run-1")
    assert (body["run_id"], body["tenant"]) == ("held-run-1", "team-a")
    used = {
        m: body["meters"][m]["used"] for m in ("input_tokens", "output_tokens", "total_tokens", "cost_micros")
    }
    assert all(body["meters"][m]["reserved"] == 0 for m in used) and used["cost_micros"] > 0
    assert body["summary"] == (
        f"requests 1/5, input_tokens {used['input_tokens']}/unlimited, output_tokens "
        f"{used['output_tokens']}/unlimited, total_tokens {used['total_tokens']}/unlimited, "
        f"cost_micros {used['cost_micros']}/unlimited"
    )


async def test_the_keys_view_says_when_each_window_resets(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """``resets_at``: the end of the window (UTC), when its meters start again from 0; the key's
    lifetime never resets."""
    proxy = await make_proxy()
    await proxy.client().chat.completions.create(model="gpt-4o-mini", messages=MSGS)
    await proxy.recorded()
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.url}/v1/billing/keys/self", headers={"Authorization": f"Bearer {KEY_A}"}) as r,
    ):
        view = await r.json()
    now = time.time()
    windows = {w["scope"]: w for w in view["windows"]}
    assert list(windows) == ["key", "key:day", "key:month", "tenant:day", "tenant:month"]
    assert windows["key"]["resets_at"] is None
    for owner in ("key", "tenant"):
        day, month = windows[f"{owner}:day"], windows[f"{owner}:month"]
        assert day["resets_at"] % 86400 == 0 and now < day["resets_at"] <= now + 86400
        assert datetime.fromtimestamp(month["resets_at"], UTC).strftime("%d %H:%M:%S") == "01 00:00:00"
        assert now < month["resets_at"] <= now + 31 * 86400
        assert day["meters"]["requests"]["used"] == month["meters"]["requests"]["used"] == 1


# -- the per-call log line ---------------------------------------------------------------------


async def test_the_call_line_tells_the_ledgers_figures_and_no_key_in_the_model(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The model is the client's string, as its run and request ids are: one holding a key was
    logged as it came. The line's outcome, tokens and cost are the ledger entry's."""
    proxy = await make_proxy(models=PRICED_MODELS, policy={"on_invalid_json": "reject"})
    caplog.set_level(logging.INFO)
    client = proxy.client()
    with pytest.raises(openai.UnprocessableEntityError):
        await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MSGS,
            response_format={"type": "json_object"},
            extra_body={"fake": {"content": "not json"}},
        )
    secret = "sk-proj-AbCdEf0123456789"
    await client.chat.completions.create(model=f"ft:{secret}", messages=MSGS)
    await proxy.recorded()
    lines = [r.__dict__[TRUSTED_FIELDS] for r in caplog.records if TRUSTED_FIELDS in r.__dict__]
    ledger = await entries(redis_client)
    assert len(lines) == len(ledger) == 2
    for line, entry in zip(lines, ledger, strict=True):
        assert line["settled"] is True
        for field in ("input_tokens", "output_tokens", "cost_micros"):
            assert line[field] == int(entry[field]), field
        assert (line["outcome"], line["usage_source"]) == (entry["outcome"], entry["usage_source"])
    assert lines[0]["outcome"].startswith("rejected:parse-json") and lines[0]["cost_micros"] > 0
    assert secret not in str(lines[1]) and lines[1]["model"] == "ft:[REDACTED]"


# -- the ledger export and the report ----------------------------------------------------------


async def _ledger_of_two_runs(client: aioredis.Redis) -> list[str]:
    """team-e's ledger, as settle.lua writes it: three calls of run r1 (the first with a column of
    its own) and two of r2, interleaved, on keys k2 (the first) and k1, one reaped, one refused by
    the provider, one failed; their entry ids."""
    ids = []
    for i, (run, key) in enumerate((("r1", "k2"), ("r2", "k1"), ("r1", "k1"), ("r2", "k1"), ("r1", "k2"))):
        fields: dict[Any, Any] = {
            **LEDGER_ENTRY,
            "run_id": run,
            "key": key,
            "request_id": f"req-{i}",
            "cost_micros": str(i),
        }
        if i == 0:
            fields["clamped_by"] = "run"  # a column only the first entry has
        if i == 1:
            fields["outcome"] = "lease_expired"
        if i == 2:
            fields["outcome"] = "upstream_4xx"
        if i == 3:
            fields.update(
                outcome="upstream_error", cache_creation_1h_input_tokens="7", audio_output_tokens="5"
            )
        entry_id = await client.xadd("lbp:{team-e}:ledger", fields)
        await client.rpush(f"lbp:{{team-e}}:runlog:{run}", entry_id)
        ids.append(str(entry_id))
    return ids


async def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert await asyncio.to_thread(main, list(args)) == 0
    return capsys.readouterr().out


async def test_a_runs_csv_export_holds_that_runs_entries_with_their_ids(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ledger --run R --format csv``: each row is one of the run's entries, with its ledger id;
    the JSON lines of the whole tenant carry the ids too (the key to find an entry again)."""
    ids = await _ledger_of_two_runs(redis_client)
    base = ["ledger", "--redis-url", redis_server.url, "--tenant", "team-e"]
    rows = list(csv.DictReader(io.StringIO(await _cli(capsys, *base, "--run", "r1", "--format", "csv"))))
    assert [(r["id"], r["request_id"], r["run_id"]) for r in rows] == [
        (ids[0], "req-0", "r1"),
        (ids[2], "req-2", "r1"),
        (ids[4], "req-4", "r1"),
    ]
    assert [r["clamped_by"] for r in rows] == ["run", "", ""]
    rows = list(csv.DictReader(io.StringIO(await _cli(capsys, *base, "--run", "r2", "--format", "csv"))))
    assert [r["request_id"] for r in rows] == ["req-1", "req-3"] and "clamped_by" not in rows[0]
    lines = [json.loads(line) for line in (await _cli(capsys, *base)).splitlines()]
    assert [(e["id"], e["request_id"]) for e in lines] == [(i, f"req-{n}") for n, i in enumerate(ids)]


async def test_a_report_by_key_adds_up_each_keys_calls_in_the_keys_order(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each key's calls, every kind of token, exact cost and every outcome; keys sorted (not in
    the order the ledger first names them)."""
    await _ledger_of_two_runs(redis_client)
    args = [
        "report",
        "--redis-url",
        redis_server.url,
        "--tenant",
        "team-e",
        "--by",
        "key",
        "--format",
        "jsonl",
    ]
    report = [json.loads(line) for line in (await _cli(capsys, *args)).splitlines()]
    assert [(r["key"], r["calls"], r["input_tokens"], r["cost_usd"], r["outcomes"]) for r in report] == [
        ("k1", "3", "12", "0.000006", "lease_expired=1 upstream_4xx=1 upstream_error=1"),
        ("k2", "2", "8", "0.000004", "ok=2"),
    ]
    k1 = report[0]
    assert [c for c in k1 if c.endswith("_tokens")] == [f"{kind}_tokens" for kind in TOKEN_KINDS]
    assert (k1["cache_creation_1h_input_tokens"], k1["audio_output_tokens"]) == ("7", "5")


async def test_a_report_since_a_moment_counts_the_calls_from_that_millisecond(
    redis_server: RedisServerProcess, redis_client: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """An entry's ``time_ms`` is its call's millisecond: ``--since`` with milliseconds starts there,
    not at a whole second."""
    first_ms = 1_796_193_352_174
    for ms in (first_ms, first_ms + 1, first_ms + 2):
        fields: dict[Any, Any] = {**LEDGER_ENTRY, "time_ms": str(ms)}
        await redis_client.xadd("lbp:{team-s}:ledger", fields, id=f"{ms}-0")
    since = datetime.fromtimestamp((first_ms + 1) / 1000, UTC).isoformat(timespec="milliseconds")
    args = ["report", "--redis-url", redis_server.url, "--tenant", "team-s", "--since", since]
    (row,) = map(json.loads, (await _cli(capsys, *args, "--format", "jsonl")).splitlines())
    assert row["calls"] == "2"


@pytest.mark.parametrize("command", ["ledger", "report"])
async def test_every_cell_a_spreadsheet_would_run_as_a_formula_is_kept_text(
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """OWASP's list: ``=``, ``+``, ``-``, ``@``, a tab and a carriage return. A model starting
    with ``@`` (``@SUM(...)``) or a tab went out as it came, and ran in the operator's sheet."""
    starts = ("=", "+", "-", "@", "\t", "\r")
    for start in starts:
        fields: dict[Any, Any] = {**LEDGER_ENTRY, "model": f"{start}SUM(1+1)*cmd"}
        await redis_client.xadd("lbp:{team-f}:ledger", fields)
    out = await _cli(
        capsys, command, "--redis-url", redis_server.url, "--tenant", "team-f", "--format", "csv"
    )
    models = sorted(row["model"] for row in csv.DictReader(io.StringIO(out, newline="")))
    assert models == sorted(f"'{start}SUM(1+1)*cmd" for start in starts)


def test_check_config_counts_what_the_file_holds_and_refuses_a_key_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``check-config`` is the README's check before ``serve``: a key whose secret the
    environment does not hold is a config ``serve`` refuses, so the check must refuse it too."""
    path = ROOT / "config" / "example.yaml"
    monkeypatch.setenv("DEV_PROXY_KEY", "sk-dev")
    config = load_config(path)
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out == (
        f"{path}: ok ({len(config.upstreams)} upstreams, {len(config.models)} models, "
        f"{len(config.keys)} keys, {len(config.tiers)} tiers)\n"
    )
    assert len(config.keys) != len(config.tiers)
    monkeypatch.delenv("DEV_PROXY_KEY")
    assert main(["check-config", str(path)]) == 2
    assert "DEV_PROXY_KEY is not set" in capsys.readouterr().err


SECRETS = ("tok-9f8e7d6c5b4a", "dXNlcjpwYXNz", "pk-live-11aa22bb", "sk-proj-AbCdEf012345", "pk-exc-33cc44dd")


def _record_with_secrets() -> logging.LogRecord:
    """A line any code path might log: a key in the message, in extra fields of any shape, and in
    an exception's message."""
    try:
        raise RuntimeError(f"upstream answered x-api-key: {SECRETS[4]}")
    except RuntimeError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "proxy.somewhere", logging.ERROR, __file__, 1, "retried with bearer %s", (SECRETS[0],), exc_info
    )
    record.headers = {"Authorization": f"Basic {SECRETS[1]}"}
    record.upstream_key = SECRETS[2]
    record.tried = (f"{SECRETS[3]}",)
    return record


@pytest.mark.parametrize("formatter", [JsonFormatter, TextFormatter])
def test_a_key_logged_by_any_path_is_redacted(formatter: type[logging.Formatter]) -> None:
    """The module's promise: whatever path logs a credential, the line holds ``[REDACTED]``
    (a bearer token without a header name, a header named in capitals, a field that holds the
    upstream key, a key in a tuple, an exception's message), and the traceback is kept."""
    line = formatter().format(_record_with_secrets())
    assert not [secret for secret in SECRETS if secret in line], line
    assert "RuntimeError" in line and "[REDACTED]" in line
    if formatter is JsonFormatter:
        fields = json.loads(line)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fields["ts"]), fields["ts"]
        assert fields["headers"] == {"Authorization": "[REDACTED]"} and fields["upstream_key"] == "[REDACTED]"


class _Flushes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1


def test_only_the_per_call_lines_wait_in_the_log_buffer() -> None:
    """A reload's or a start's line (any line but the per-call one) goes out at once: held in the
    buffer, it would reach the operator only with a later flush."""
    handler = BufferedStderrHandler(interval_s=3600)
    handler.stream = stream = _Flushes()
    handler.setFormatter(JsonFormatter())
    handler.write_call_line({"request_id": "r-1"})
    call = logging.LogRecord("proxy.call", logging.INFO, __file__, 1, "call", None, None)
    call.__dict__[TRUSTED_FIELDS] = {"request_id": "r-2"}  # as ``log_call`` logs it
    handler.emit(call)
    assert stream.flushes == 0
    handler.emit(logging.LogRecord("proxy.reload", logging.INFO, __file__, 1, "config reloaded", None, None))
    assert stream.flushes == 1
    assert len(stream.getvalue().splitlines()) == 3


async def test_a_stream_the_provider_answered_whole_has_no_time_to_first_token(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A provider that ignores ``stream`` answers a whole JSON body, relayed whole: its "first
    token" was again its whole duration (the review of the first mend, which asked whether the
    client wanted a stream, not whether the answer was one)."""
    script.plan = Plan(chunks=[GOOD_BODY])  # a whole chat.completion, application/json
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "gpt-4o-mini", "messages": MSGS, "stream": True},
            headers={"Authorization": f"Bearer {KEY_A}"},
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/json"  # relayed whole, as it came
        await resp.read()
    await proxy.recorded()
    (entry,) = await entries(redis_client)
    assert entry["stream"] == "1" and entry["usage_source"] == "provider", entry
    assert entry["ttft_ms"] == "", entry
    assert metrics_of(proxy).ttft.items() == []
