"""The per-call log line: one JSON object per forwarded call, written by real processes."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from proxy.logs import (
    CALL_LOGGER,
    TRUSTED_FIELDS,
    BufferedStderrHandler,
    JsonFormatter,
    TextFormatter,
    Throttle,
    _WholeLinesWriter,
    redact,
)
from proxy.redis_server import RedisServerProcess
from tests.conftest import KEY_A, ProxyFactory, base_config
from tests.fake_upstream import FakeUpstream
from tests.procs import ProxyProcess

FIELDS = {"request_id": "r-1", "tenant": "t", "outcome": "ok", "input_tokens": 3, "settled": True}
ROOT = Path(__file__).resolve().parent.parent


def test_the_direct_line_is_what_the_formatter_writes() -> None:
    handler = BufferedStderrHandler()
    handler.stream = io.StringIO()
    handler.setFormatter(JsonFormatter())
    handler.write_call_line(dict(FIELDS))
    direct = json.loads(handler.stream.getvalue())
    record = logging.LogRecord(CALL_LOGGER, logging.INFO, __file__, 1, "call", None, None)
    record.__dict__[TRUSTED_FIELDS] = dict(FIELDS)
    formatted = json.loads(JsonFormatter().format(record))
    assert direct.pop("ts").endswith("Z") and formatted.pop("ts").endswith("Z")
    assert direct == formatted
    assert list(direct) == ["level", "logger", "msg", *FIELDS]


def test_a_line_logged_after_its_stream_closed_prints_no_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A background thread (an encoding's load) logging after the handler's stream closed (a
    replaced stderr, a test's capture, shutdown) printed logging's "--- Logging error ---"
    traceback on stderr (seen in a clean-clone CI): such a line has nowhere to go, and goes."""
    handler = BufferedStderrHandler()
    handler.stream = io.StringIO()
    handler.setFormatter(JsonFormatter())
    handler.stream.close()
    handler.handle(logging.LogRecord("proxy.tokenizer", logging.WARNING, __file__, 1, "late", None, None))
    assert capsys.readouterr().err == ""


def test_the_text_format_writes_the_call_line_flat() -> None:
    """A terminal's format names the per-call fields at the top, as the JSON format does, not
    nested under the name the formatter passes them by."""
    record = logging.LogRecord(CALL_LOGGER, logging.INFO, __file__, 1, "call", None, None)
    record.__dict__[TRUSTED_FIELDS] = {**FIELDS, "run_id": "sk-abcdefghijkl"}
    line = TextFormatter().format(record)
    head, _, fields = line.partition(" {")
    assert head == f"info    {CALL_LOGGER}: call"
    assert json.loads("{" + fields) == {**FIELDS, "run_id": "[REDACTED]"}


async def test_a_process_writes_one_line_per_call(
    fake: FakeUpstream, redis_server: RedisServerProcess, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    proc = ProxyProcess(base_config(fake.base_url, redis_server.url), tmp_path).start()
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "logged"}
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    request_ids = []
    try:
        async with aiohttp.ClientSession() as session:
            for extra in ({}, {"stream": True}, {"fake": {"mode": "error", "status": 500}}):
                async with session.post(
                    proc.url + "/v1/chat/completions", json={**body, **extra}, headers=headers
                ) as resp:
                    await resp.read()
                    request_ids.append(resp.headers["x-request-id"])
    finally:
        proc.signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait)
    lines = [json.loads(line) for line in proc.log_path.read_text().splitlines() if '"msg":"call"' in line]
    assert [line["request_id"] for line in lines] == request_ids
    assert [line["outcome"] for line in lines] == ["ok", "ok", "upstream_error"]
    assert all(line["logger"] == CALL_LOGGER and line["run_id"] == "logged" for line in lines)
    assert [line["stream"] for line in lines] == [False, True, False]
    ledger = await redis_client.xrange("lbp:{team-a}:ledger")
    assert [int(entry["input_tokens"]) for _, entry in ledger] == [line["input_tokens"] for line in lines]


def test_an_authorization_value_of_any_scheme_is_redacted() -> None:
    from proxy.logs import redact

    for line in (
        "Authorization: Basic dXNlcjpwYXNzd29yZA==",
        "authorization: Token abc123",
        "x-api-key: pk-1",
    ):
        assert redact(line) == "[REDACTED]", line


async def _the_call_record(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    """The one per-call log record, once the call's settle has written it."""
    for _ in range(100):
        calls = [r for r in caplog.records if TRUSTED_FIELDS in r.__dict__]
        if calls:
            break
        await asyncio.sleep(0.02)
    (record,) = calls
    return record


async def test_a_key_in_an_id_the_client_chose_is_redacted_in_the_call_line(
    make_proxy: ProxyFactory, fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    # X-Run-Id and X-Request-Id are the client's: one holding its key was logged as it came.
    proxy = await make_proxy()
    secret = "sk-proj-AbCdEf0123456789"
    caplog.set_level(logging.INFO)
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": secret, "X-Request-Id": secret}
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status == 200
    record = await _the_call_record(caplog)
    line = JsonFormatter().format(record)
    assert secret not in line and json.loads(line)["run_id"] == "[REDACTED]", line


async def test_an_id_with_task_in_it_is_logged_as_the_ledger_holds_it(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The per-call line is how an operator finds a call of the ledger (its run id, request id).
    ``redact`` took "sk-" plus 6 characters anywhere, mid-word too: a run id such as
    "nightly-task-000123" ("...ta" + "sk-000123") was logged "nightly-ta[REDACTED]", and so was
    a request id "task-4f2a9c", though neither holds a key (a key the client put in an id starts
    it or follows a separator, as in the test above). The ledger holds the ids as sent."""
    caplog.set_level(logging.INFO)
    proxy = await make_proxy()
    run_id, request_id = "nightly-task-000123", "task-4f2a9c"
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run_id, "X-Request-Id": request_id}
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status == 200 and resp.headers["x-request-id"] == request_id
    record = await _the_call_record(caplog)
    line = json.loads(JsonFormatter().format(record))
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert (entry["run_id"], entry["request_id"]) == (run_id, request_id)
    assert (line["run_id"], line["request_id"]) == (run_id, request_id)


def test_a_key_is_redacted_where_a_word_starts_not_inside_one() -> None:
    from proxy.logs import redact

    for kept in ("risk-analytics", "nightly-task-000123", "mask-abcdefgh", "DISK-000123"):
        assert redact(kept) == kept
    for text, redacted in (
        ("sk-proj-AbCdEf0123456789", "[REDACTED]"),
        ("run-sk-abcdef12", "run-[REDACTED]"),
        ("run_sk-abcdef12", "run_[REDACTED]"),
        ("key=sk-abcdef12", "key=[REDACTED]"),
        ("(sk-abcdef12)", "([REDACTED])"),
        ("SK-ABCDEF12", "[REDACTED]"),
    ):
        assert redact(text) == redacted, text


def test_redacting_skips_the_scan_only_for_a_text_the_pattern_cannot_match() -> None:
    from proxy.logs import _SECRET, redact

    rng = random.Random(6)
    pieces = [
        "sk-",
        "SK-",
        "\u017fk-",
        "sK-",
        "Key",
        "KEY",
        "\u212aey",
        "api_",
        "x-api-",
        "Bearer ",
        "BEARER\t",
        "auth",
        "Authorization",
        "AUTHOR\u0130ZATION",
        "=",
        ": ",
        '"',
        "'",
        "abcdef0123",
        "-",
        "_",
        " ",
        "é",
        "k",
    ]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))) for _ in range(5000)]
    texts += ["req_0123456789abcdef", "gpt-4o-mini", "ok", "sk-proj-AbCdEf0123456789", "\u017fk-abcdefgh"]
    for text in texts:
        assert redact(text) == _SECRET.sub("[REDACTED]", text), text
    # Non-ASCII letters the pattern matches case-insensitively are still scanned.
    assert redact("\u017fk-abcdefgh") == "[REDACTED]"
    assert redact("api_\u212aey=abc") == "[REDACTED]"


# What each worker of ``serve --workers N`` does with its log: ``run_worker`` calls
# ``setup_logging`` (a BufferedStderrHandler on the stderr every worker inherits), and
# ``record_call`` writes each call's line with ``log_call``.
_WORKER = r"""
import sys
from proxy.logs import flush_logs, log_call, setup_logging

setup_logging("info", "json")
worker = sys.argv[1]
for i in range(3000):
    log_call({
        "request_id": f"req_{worker}_{i}", "tenant": "team-a", "key_name": "a-ci",
        "run_id": "run_" + "0" * 32, "endpoint": "chat.completions", "model": "gpt-4o-mini",
        "stream": False, "outcome": "ok", "input_tokens": i, "output_tokens": 8, "settled": True,
    })
flush_logs()
"""


def test_workers_sharing_a_stderr_pipe_write_whole_lines() -> None:
    """Under Docker, Kubernetes or systemd a process's stderr is a pipe (or a stream socket) that
    every worker of ``--workers N`` inherits. A write of more than PIPE_BUF (4 KiB) bytes to a
    pipe is not atomic: when the pipe is full (its reader a moment behind), another writer's
    bytes land in the middle. The buffered handler wrote up to 64 KiB at a time, so lines of
    two workers interleaved mid-line: JSON lines a log shipper cannot parse."""
    read_end, write_end = os.pipe()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(n)],
            stderr=write_end,
            stdin=subprocess.DEVNULL,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for n in range(4)
    ]
    os.close(write_end)
    data = bytearray()
    while chunk := os.read(read_end, 4096):  # a reader a little behind, as a log shipper may be
        data += chunk
        time.sleep(0.0005)
    os.close(read_end)
    assert [w.wait() for w in workers] == [0] * 4
    lines = bytes(data).splitlines()
    broken = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            broken.append(line)
    assert broken == [], f"{len(broken)} of {len(lines)} lines are not JSON, e.g. {broken[0][:300]!r}"
    assert len(lines) == 4 * 3000


def test_a_pipe_is_written_whole_lines_of_at_most_pipe_buf_bytes_a_longer_line_alone() -> None:
    """Each write as the reader sees it (a packet socket keeps their bounds): whole lines, as
    many as fit in PIPE_BUF; a line longer than that alone, whole; a flush's worth in all."""
    lines = [b"a" * 1000 + b"\n"] * 5 + [b"b" * (select.PIPE_BUF + 10) + b"\n"] + [b"c" * 100 + b"\n"] * 3
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        writer = _WholeLinesWriter(ours.fileno())
        assert writer.write(memoryview(b"".join(lines))) == sum(map(len, lines))
        theirs.setblocking(False)
        writes = []
        with contextlib.suppress(BlockingIOError):
            while True:
                writes.append(theirs.recv(1 << 16))
    assert writes == [b"".join(lines[:4]), lines[4], lines[5], b"".join(lines[6:])]


def test_a_failure_that_repeats_is_told_at_once_then_every_few_seconds_with_the_count() -> None:
    now = [100.0]
    throttle = Throttle(every_s=10.0, clock=lambda: now[0])
    told = []
    for step_s in (0, 1, 1, 3, 5, 0.5, 30):  # at 100, 101, 102, 105, 110, 110.5, 140.5
        now[0] += step_s
        told.append(throttle.tell())
    assert told == [1, 0, 0, 0, 4, 0, 2]


ESCAPED_KEY = "sk-proj-AbCdEf0123456789xyz"


@pytest.mark.parametrize(
    "text",
    [
        repr(ValueError("upstream said:\n" + ESCAPED_KEY)),  # refine/relay log "error": repr(err)
        str(KeyError("bad\t" + ESCAPED_KEY)),  # a KeyError's str is a repr
        str(("line\n" + ESCAPED_KEY).encode()),  # bytes as str
        "POST /v1/x?token%3D" + ESCAPED_KEY,  # a percent-encoded query
        "Authorization%3A%20Bearer%20" + ESCAPED_KEY,  # a percent-encoded header line
    ],
)
def test_a_key_after_an_escape_is_redacted(text: str) -> None:
    """A key after an escape's letter or digits (a repr's "\\n", a URL's "%20") starts a word all
    the same: left whole by the lookbehind that keeps "task-" ids (the third review)."""
    assert ESCAPED_KEY not in redact(text), redact(text)


def test_a_key_in_a_repr_error_field_is_redacted_in_both_formats() -> None:
    record = logging.LogRecord("proxy.refine", logging.WARNING, __file__, 1, "could not count", None, None)
    record.error = repr(RuntimeError("tokenizer failed on:\n" + ESCAPED_KEY))
    line = JsonFormatter().format(record)
    assert ESCAPED_KEY not in json.loads(line)["error"], line
    assert ESCAPED_KEY not in TextFormatter().format(record)
