"""Reloading the config file: a model a reload adds is counted with its encoding, as one present
at start is."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import redis.asyncio as aioredis
import tiktoken
import yaml
from aiohttp import web

import proxy.app as app_module
import proxy.handlers as handlers
import proxy.reload
from proxy import config_load
from proxy.app import build_app
from proxy.config import Config
from proxy.config_load import load_config
from proxy.redis_server import RedisServerProcess
from proxy.scopes import run_key
from proxy.state import STATE
from proxy.tokenizer import Tokenizer
from tests.conftest import (
    KEY_A,
    UPSTREAM_KEY,
    Proxy,
    base_config,
    big_config,
    loop_ticks,
    refused_port,
    serving,
    until_upstream_received,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries
from tests.test_budgets import _proxy_from_file, _reload_to, call, tiers
from tests.test_estimate import TEXT, QuarterEncoding


class WordEncoding:
    """A stand-in for any tiktoken encoding (no download here): one token per word."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [0] * len(text.split())


async def test_a_model_a_reload_adds_is_counted_with_its_encoding(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Encodings were loaded once, at start, for the models of the file then: a model a reload
    added with another encoding (p50k_base; a gpt-oss model's o200k_harmony) was reserved at its
    prompt's UTF-8 bytes and counted at 4 characters a token for as long as the process ran."""
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: WordEncoding())
    raw: dict[str, Any] = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    raw["models"] = {"gpt-4o-mini": {"upstream": "openai"}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    app = build_app(load_config(path), config_path=path)  # the tokenizer loaded as serve loads it
    proxy = await serving(app)
    runner = proxy.runner
    try:
        raw["models"]["legacy-model"] = {"upstream": "openai", "encoding": "p50k_base"}
        path.write_text(yaml.safe_dump(raw))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(250):
            if "legacy-model" in app[STATE].config.models:
                break
            await asyncio.sleep(0.02)
        assert "legacy-model" in app[STATE].config.models

        prompt = "word " * 400  # 400 tokens, 2,000 bytes
        body = {"model": "legacy-model", "messages": [{"role": "user", "content": prompt}], "max_tokens": 5}
        reserved = []
        for attempt in range(100):  # an encoding loaded off the event loop may take a moment
            run = f"reload-enc-{attempt}"
            headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
            async with aiohttp.ClientSession() as session:
                async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
            reserved.append(int((await ledger_entries(proxy, run))[0]["reserved_input_tokens"]))
            if reserved[-1] < 1000:
                break
            await asyncio.sleep(0.05)
        # 400 words and the message's own few tokens: not the prompt's 2,000 bytes.
        assert reserved[-1] < 1000, reserved[:3]
    finally:
        await runner.cleanup()


async def test_a_refused_reload_is_counted_and_leaves_the_old_config_in_force(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file that did not validate was refused in the log alone: whatever watches the metrics
    (and alerts on them) saw nothing, and the next restart failed on the file."""
    raw: dict[str, Any] = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    app = build_app(load_config(path), tokenizer=Tokenizer({}), config_path=path)
    runner = web.AppRunner(app)
    await runner.setup()
    state = app[STATE]

    def reloads() -> dict[str, float]:
        return {labels[0]: value.value for labels, value in state.metrics.config_reloads.items()}

    async def sighup_until(result: str) -> None:
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(250):  # the file check may take it first: counted all the same
            if reloads()[result]:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(reloads())

    try:
        assert reloads() == {"applied": 0, "refused": 0}  # exported from the start
        in_force = state.config
        path.write_text("tiers: [this is not valid")
        await sighup_until("refused")
        assert state.config is in_force and reloads()["applied"] == 0
        raw["tiers"] = {"standard": {"run": {"requests": 2}}}
        path.write_text(yaml.safe_dump(raw))
        await sighup_until("applied")
        assert state.config.tiers["standard"].run.requests == 2
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("next_ceiling", "next_status"), [(10, 200), (1, 429)])
async def test_a_reload_shortening_run_ttl_keeps_a_run_alive_under_a_call_in_flight(
    next_ceiling: int,
    next_status: int,
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-streaming call does not renew its run's keys: they must outlive its lease (the
    config refuses a ``run_ttl_s`` that does not). A reload may shorten both the timeouts and
    ``run_ttl_s`` while a call with the old, longer lease is in flight: the next call of the run
    set the new TTL on the run's keys (served, or refused by the run's ceiling), which then expired
    under the first call (its reserve and the run's past spend gone: the run ceiling spent
    again)."""
    raw: dict[str, Any] = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    raw["upstreams"]["openai"]["timeout_s"] = 5000
    raw["limits"]["run_ttl_s"] = 7200
    raw["limits"]["settled_marker_ttl_s"] = 6000  # 90% of it outlasts the lease (5,030 s)
    raw["tiers"] = {"standard": {"run": {"requests": 10}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    app = build_app(load_config(path), tokenizer=Tokenizer({}), config_path=path)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    state = app[STATE]
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "long-lease"}
    run_keys = ("lbp:{team-a}:run:long-lease", "lbp:{team-a}:runlog:long-lease")

    async def post(fake_control: dict[str, Any]) -> int:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "fake": fake_control}
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.read()
                return resp.status

    try:
        slow = asyncio.ensure_future(post({"hold": True}))  # in flight until the checks are done
        await until_upstream_received(fake, 1)
        # The call's lease, as the reserve set it (under the old setting: 5,000 s and the margin).
        [(held, lease_ends_ms)] = cast(
            list[tuple[str, float]], await redis_client.zrange("lbp:{team-a}:leases", 0, -1, withscores=True)
        )
        raw["upstreams"]["openai"]["timeout_s"] = 5
        raw["limits"]["run_ttl_s"] = 3600
        raw["tiers"]["standard"]["run"]["requests"] = next_ceiling
        before = state.config
        path.write_text(yaml.safe_dump(raw))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(250):
            if state.config is not before:
                break
            await asyncio.sleep(0.02)
        assert state.config.limits.run_ttl_s == 3600
        assert await post({}) == next_status  # the run's next call, under the new setting
        assert await redis_client.zscore("lbp:{team-a}:leases", held) is not None, "still in flight"
        clock: tuple[int, int] = await redis_client.time()
        now_ms = clock[0] * 1000 + clock[1] // 1000
        for key in run_keys:
            left_ms = await redis_client.pttl(key)
            if key.endswith(":runlog:long-lease") and left_ms == -2:
                continue  # no entry yet: the refused call writes none, the first has not settled
            # Expired before the call's lease ends, its reserve and the run's spend went with it.
            assert now_ms + left_ms > lease_ends_ms, key
        fake.release()
        assert await slow == 200
    finally:
        await runner.cleanup()


class WaitingCall:
    """A proxy served from ``path`` (its config ``raw``, its counts held by ``enc``'s gate) and a
    call to it that waits on its prompt's exact count; ``reload`` saves ``raw`` again and
    SIGHUPs, then lets the count go."""

    def __init__(self, raw: dict[str, Any], path: Path, enc: QuarterEncoding, runner: web.AppRunner) -> None:
        self.raw, self.path, self.enc, self.runner = raw, path, enc, runner
        self.state = runner.app[STATE]
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self.pending: asyncio.Future[int] | None = None

    @classmethod
    async def serve(
        cls, raw: dict[str, Any], path: Path, enc: QuarterEncoding, monkeypatch: pytest.MonkeyPatch
    ) -> WaitingCall:
        path.write_text(yaml.safe_dump(raw))
        monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
        app = build_app(load_config(path), tokenizer=Tokenizer({"o200k_base": enc}), config_path=path)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return cls(raw, path, enc, runner)

    async def start(self, endpoint: str, body: dict[str, Any], run: str) -> None:
        async def post() -> int:
            headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
            async with aiohttp.ClientSession() as session:
                async with session.post(self.url + endpoint, json=body, headers=headers) as resp:
                    await resp.read()
                    return resp.status

        self.pending = asyncio.ensure_future(post())
        for _ in range(500):
            if self.enc.entries:
                break
            await asyncio.sleep(0.01)
        assert self.enc.entries == 1, "the reserve never waited on the count"

    async def reload(self) -> int:
        """The call's status, once the reload is in and its count let go."""
        assert self.pending is not None and self.enc.gate is not None
        before = self.state.config
        self.path.write_text(yaml.safe_dump(self.raw))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(250):
            if self.state.config is not before:
                break
            await asyncio.sleep(0.02)
        assert self.state.config is not before, "not reloaded"
        self.enc.gate.set()
        return await asyncio.wait_for(self.pending, 20)

    async def close(self) -> None:
        if self.enc.gate is not None:
            self.enc.gate.set()
        await self.runner.cleanup()


@pytest.mark.parametrize("change", ["key revoked", "ceiling lowered", "price raised"])
@pytest.mark.parametrize("waits", ["quick estimates off", "bound does not fit"])
async def test_a_reload_while_a_call_waits_on_its_count_judges_it_by_the_new_config(
    change: str,
    waits: str,
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The body came whole before the reload, but the reserve waited on the prompt's exact count
    (quick estimates off; or its byte bound did not fit a ceiling the count does): the call was
    reserved and forwarded under the config the reload replaced, so a key it revoked got that
    call out, a ceiling it lowered let it through, and a price it raised was not charged. Now
    planned again under the new config (route, price) once the count is in."""
    enc = QuarterEncoding(threading.Event())
    raw: dict[str, Any] = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    raw["limits"] = {**raw["limits"], "quick_estimates": waits == "bound does not fit"}
    # The exact count (10,007 input tokens) fits; the byte bound (40,007) does not.
    raw["tiers"] = {"standard": {"run": {"input_tokens": 20_000}}}
    raw["models"]["gpt-4o-mini"]["price_per_million"] = {"input": "1", "output": "1"}
    waiting = await WaitingCall.serve(raw, tmp_path / "config.yaml", enc, monkeypatch)
    run = "waits-" + waits.replace(" ", "-")
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 5}
    try:
        await waiting.start("/v1/chat/completions", body, run)
        if change == "key revoked":
            raw["keys"] = [k for k in raw["keys"] if k["name"] != "a-ci"]
        elif change == "ceiling lowered":
            raw["tiers"]["standard"]["run"]["input_tokens"] = 5_000  # below the exact count
        else:
            raw["models"]["gpt-4o-mini"]["price_per_million"] = {"input": "100", "output": "100"}
        status = await waiting.reload()
        if change == "price raised":
            assert status == 200
            ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
            tokens = int(entry["input_tokens"]) + int(entry["output_tokens"])
            assert int(entry["cost_micros"]) == 100 * tokens  # 100 per million: micro-units a token
            return
        assert status == {"key revoked": 401, "ceiling lowered": 429}[change]
        assert fake.received == []
        assert await redis_client.zcard("lbp:{team-a}:leases") == 0
        store = waiting.state.store
        assert store is not None
        meters = await store.meters(run_key("team-a", run))
        assert all(m.reserved == 0 and m.used == 0 for m in meters.values()), meters
    finally:
        await waiting.close()


@pytest.mark.parametrize("waits", ["quick estimates off", "bound does not fit"])
async def test_a_call_planned_again_after_a_reload_is_counted_once_in_the_metrics(
    waits: str,
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reload while a call waits on its count plans it again, nothing reserved: what its
    first plan had counted (``prior_contexts``: the context it continues; ``quick_estimates``:
    its bound counted first) was counted again by the second, one call told twice (found by
    the reload hunt)."""
    enc = QuarterEncoding(threading.Event())
    raw: dict[str, Any] = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    raw["limits"] = {**raw["limits"], "quick_estimates": waits == "bound does not fit"}
    raw["tiers"] = {"standard": {"run": {"input_tokens": 20_000}}}  # the count fits, the bound does not
    waiting = await WaitingCall.serve(raw, tmp_path / "config.yaml", enc, monkeypatch)
    fake.contexts["resp_elsewhere"] = 3000  # made with the provider directly: unknown here
    body = {"model": "gpt-4o-mini", "input": TEXT, "previous_response_id": "resp_elsewhere"}
    try:
        await waiting.start("/v1/responses", body, "planned-twice")
        raw["tiers"]["standard"]["run"]["requests"] = 10
        assert await waiting.reload() == 200
        assert len(fake.received) == 1
        metrics = waiting.state.metrics
        assert {labels[0]: c.value for labels, c in metrics.prior_contexts.items()} == {"unknown": 1}
        quick = {labels[0]: c.value for labels, c in metrics.quick_estimates.items()}
        assert quick.get("counted_first", 0) == (1 if waits == "bound does not fit" else 0), quick
    finally:
        await waiting.close()


async def _call_while_the_store_reconnects(
    proxy: Proxy,
    raw: dict[str, Any],
    path: Path,
    redis_client: aioredis.Redis,
    run: str,
    max_tokens: int = 5,
) -> tuple[int, str]:
    """A call whose reserve waits for the store's connection to be made again (Redis restarted,
    then slow to answer the new connection's SELECT: loading, a failover), and a reload of
    ``raw`` (changed by the caller) while it waits. Its status and body. The call asks for
    ``max_tokens``, the warm-up call before it for 5."""
    warm_body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    body = {**warm_body, "max_tokens": max_tokens}
    async with aiohttp.ClientSession() as session:
        warm = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "warm"}
        async with session.post(proxy.url + "/v1/chat/completions", json=warm_body, headers=warm) as r:
            assert r.status == 200, await r.text()
        pipe = proxy.app[STATE].store._pipe  # type: ignore[union-attr]
        assert pipe is not None and pipe._protocol is not None
        assert pipe._protocol.transport is not None
        pipe._protocol.transport.close()  # the connection lost
        for _ in range(100):
            if pipe._protocol is None or pipe._protocol.closed:
                break
            await asyncio.sleep(0.01)
        await redis_client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
        calling = asyncio.ensure_future(
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        )
        await asyncio.sleep(0.3)
        assert not calling.done()
        assert pipe._attempt is not None  # its reserve waits for the connection: not sent yet
        await _reload_to(proxy, raw, path)
        r = await calling
        status, text = r.status, await r.text()
        r.release()
    return status, text


def _on_db_1(url: str) -> str:
    """The store's URL with database 1: its connection then sends SELECT as it is made."""
    return url[:-2] + "/1" if url.endswith("/0") else url.replace("db=0", "db=1")


async def test_a_key_revoked_while_its_call_waits_on_the_store_connection_is_refused(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call is judged by the config in force when its reserve script is sent. One whose script
    waited for the store's connection to be made again had passed the config check, and its
    script, sent after a reload, ran under the config it replaced: a revoked key's call was
    reserved, forwarded and answered (the reload hunt). Released and planned again: a 401."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    raw = base_config(fake.base_url, _on_db_1(redis_server.url), journal_dir=str(tmp_path / "j"))
    path = tmp_path / "c.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        raw["keys"] = [k for k in raw["keys"] if k["name"] != "a-ci"]  # revoked
        status, text = await _call_while_the_store_reconnects(proxy, raw, path, redis_client, "revoked")
        assert status == 401, (status, text[:300])
        assert fake.calls == 1, fake.calls  # the revoked key's call never went out
    finally:
        await proxy.runner.cleanup()


async def test_a_price_raised_while_a_call_waits_on_the_store_connection_bills_it(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same wait, a price raised: the call was billed at the price it replaced. Its reserve
    under the old config is released (a not_forwarded entry at zero), the call billed at the new."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    raw = base_config(fake.base_url, _on_db_1(redis_server.url), journal_dir=str(tmp_path / "j"))
    raw["models"] = {
        "gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "1", "output": "1"}}
    }
    path = tmp_path / "c.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        raw["models"]["gpt-4o-mini"]["price_per_million"] = {"input": "100", "output": "100"}
        status, text = await _call_while_the_store_reconnects(proxy, raw, path, redis_client, "repriced")
        assert status == 200, text[:300]
        entries = await ledger_entries(proxy, "repriced")
        released = [e for e in entries if e["outcome"] == "not_forwarded"]
        (entry,) = [e for e in entries if e["outcome"] != "not_forwarded"]
        assert [(e["input_tokens"], e["cost_micros"]) for e in released] == [("0", "0")], entries
        tokens = int(entry["input_tokens"]) + int(entry["output_tokens"])
        assert int(entry["cost_micros"]) == 100 * tokens, entry
        assert fake.calls == 2  # the warm call and this one, once
    finally:
        await proxy.runner.cleanup()


async def test_a_reserve_released_after_a_reload_is_counted_as_the_ledger_entry_it_wrote(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same wait: the release's not_forwarded entry, written at once, was never counted
    (llm_proxy_requests_total), where the same release journaled is counted when its replay
    lands: the ledger held two entries for the call, the metrics one (the store faults hunt)."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    raw = base_config(fake.base_url, _on_db_1(redis_server.url), journal_dir=str(tmp_path / "j"))
    path = tmp_path / "c.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        raw["tiers"] = {"standard": {"run": {"requests": 10}}}
        status, text = await _call_while_the_store_reconnects(proxy, raw, path, redis_client, "released")
        assert status == 200, text[:300]
        await proxy.recorded()
        entries = await ledger_entries(proxy, "released")
        assert sorted(e["outcome"] for e in entries) == ["not_forwarded", "truncated"], entries
        metrics = proxy.app[STATE].metrics
        counted = {
            dict(zip(metrics.requests.labelnames, names, strict=True))["outcome"]: value.value
            for names, value in metrics.requests.items()
        }
        assert counted == {"truncated": 2, "not_forwarded": 1}, counted  # the warm call, this one's two
    finally:
        await proxy.runner.cleanup()


async def test_a_handler_cancelled_while_a_reloaded_reserve_is_released_leaves_no_reserve_held(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reserve that ran under a replaced config is released; a handler cancelled while the
    store takes that release (shutdown past its grace) left the reservation held, no release
    journaled, for a reaper to bill a call that never went out (the fourth review of ad04bbd)."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "j"))
    path = tmp_path / "c.yaml"
    proxy = await _proxy_from_file(raw, path)
    state = proxy.app[STATE]
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    try:
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "warm"}
            async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
            store = state.store
            assert store is not None
            real_reserve = store.reserve

            async def reserve_then_reload(**kw: Any) -> Any:
                result = await real_reserve(**kw)
                state.config = load_config(path)  # a reload while the script ran
                return result

            settling = asyncio.Event()

            async def settle_slowly(**kw: Any) -> Any:  # the store slow to take the release
                settling.set()
                await asyncio.Event().wait()

            real_settle = store.settle
            monkeypatch.setattr(store, "reserve", reserve_then_reload)
            monkeypatch.setattr(store, "settle", settle_slowly)
            tasks: list[asyncio.Task[Any]] = []
            real = handlers.reserve

            async def tracked(*a: Any, **kw: Any) -> Any:
                task = asyncio.ensure_future(real(*a, **kw))
                tasks.append(task)
                return await task

            monkeypatch.setattr(handlers, "reserve", tracked)
            headers["X-Run-Id"] = "cut"
            calling = asyncio.ensure_future(
                session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
            )
            await asyncio.wait_for(settling.wait(), 5)
            held = await redis_client.zcard("lbp:{team-a}:leases")
            tasks[0].cancel()  # shutdown past its grace, while the release waits on the store
            await asyncio.sleep(0.2)
            calling.cancel()
            monkeypatch.setattr(store, "settle", real_settle)  # the store answers again
        assert held == 1
        assert await redis_client.zcard("lbp:{team-a}:leases") == 0 or state.journal.pending_lines >= 1, (
            "reservation held, no release journaled"
        )
    finally:
        await proxy.runner.cleanup()


async def _reload_watched(
    served: Proxy, raw: dict[str, Any], path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> tuple[tuple[float, float], list[float]]:
    """Reload ``served`` (SIGHUP, or the file watch) to ``raw`` saved at ``path``, with a task
    ticking every 5 ms: (when the reload's load of the file began and ended, the ticks)."""
    state = served.app[STATE]
    loads: list[tuple[float, float]] = []

    def timed_load(*args: Any, **kwargs: Any) -> Config:
        began = time.perf_counter()
        try:
            return config_load.load_config(*args, **kwargs)
        finally:
            loads.append((began, time.perf_counter()))

    # Wherever the reloader runs it (the loop's thread, or another): the times are the clock's.
    monkeypatch.setattr(proxy.reload, "load_config", timed_load)
    async with loop_ticks() as ticks:
        before = state.config
        path.write_text(yaml.safe_dump(raw))
        if how == "SIGHUP":
            os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.perf_counter() + 60
        while state.config is before:
            assert time.perf_counter() < deadline, "not reloaded"
            await asyncio.sleep(0.01)
    assert loads, "the reload did not load the file"
    return loads[-1], ticks


@pytest.mark.parametrize("how", ["SIGHUP", "file changed"])
async def test_a_reload_of_a_big_config_leaves_the_event_loop_running_while_it_loads(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """A reload read and validated the whole file on the event loop, so every call in flight
    stood still for as long as the load took: about 0.3 ms a key, 1.2 to 2.7 s of a stopped loop
    for 5,000 keys and 300 models, once per worker, on every SIGHUP (the config-scale hunt).
    Asserted by counts, not by times: a 5 ms ticker ticks while the file is loaded."""
    raw = big_config(fake.base_url, redis_server.url, keys=3000, tenants=600)
    raw["journal_dir"] = str(tmp_path / "journal")
    path = tmp_path / "config.yaml"
    served = await _proxy_from_file(raw, path)
    try:
        raw["tiers"]["tier0"]["run"]["requests"] = 999
        (began, ended), ticks = await _reload_watched(served, raw, path, monkeypatch, how)
        during = [t for t in ticks if began < t < ended]
        assert ended - began > 0.05, f"the load took {ended - began:.3f} s: too small a config to tell"
        assert during, (
            f"the event loop ran nothing for the {ended - began:.2f} s the reload's load of the file "
            f"took ({len(ticks)} ticks, none inside it): every call stood still"
        )
        assert served.app[STATE].config.tiers["tier0"].run is not None
        assert served.app[STATE].config.tiers["tier0"].run.requests == 999
    finally:
        await served.runner.cleanup()


class HeldLoads:
    """``load_config`` for the reloader, a load of the file whose run ceiling is ``held`` kept
    from returning (on its thread) until ``go_on``."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.loaded = threading.Event()
        self.go_on = threading.Event()
        self.returned = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Config:
        config = config_load.load_config(*args, **kwargs)
        run = config.tiers["standard"].run
        if run is not None and run.requests == self.held:
            self.loaded.set()
            self.go_on.wait(10)
            self.returned.set()
        return config


async def _proxy_reloaded_by_sighup_only(
    fake: FakeUpstream, redis_server: RedisServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Proxy, dict[str, Any], Path]:
    monkeypatch.setattr(app_module, "RELOAD_POLL_S", 600.0)  # no reload of the watch's besides
    raw: dict[str, Any] = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    raw["tiers"] = {"standard": {"run": {"requests": 3}}}
    path = tmp_path / "config.yaml"
    return await _proxy_from_file(raw, path), raw, path


async def _sighup_with_run_ceiling(raw: dict[str, Any], path: Path, requests: int) -> None:
    raw["tiers"]["standard"]["run"]["requests"] = requests
    path.write_text(yaml.safe_dump(raw))
    os.kill(os.getpid(), signal.SIGHUP)


async def test_two_reloads_in_quick_succession_apply_in_order_the_later_file_winning(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file is loaded off the event loop: a second SIGHUP's load, of the newer file, must not
    be applied before the first's, which would then put the older file in force for good."""
    served, raw, path = await _proxy_reloaded_by_sighup_only(fake, redis_server, tmp_path, monkeypatch)
    state = served.app[STATE]
    loads = HeldLoads(held=2)
    monkeypatch.setattr(proxy.reload, "load_config", loads)

    def applied() -> float:
        return {labels[0]: value.value for labels, value in state.metrics.config_reloads.items()}["applied"]

    try:
        await _sighup_with_run_ceiling(raw, path, 2)
        assert await asyncio.to_thread(loads.loaded.wait, 10), "the first reload did not load"
        await _sighup_with_run_ceiling(raw, path, 1)
        await asyncio.sleep(0.3)  # the second's load, were it not behind the first's, ends here
        loads.go_on.set()
        deadline = time.monotonic() + 10
        while applied() < 2:
            assert time.monotonic() < deadline, f"{applied()} reloads applied, not 2"
            await asyncio.sleep(0.01)
        run = state.config.tiers["standard"].run
        assert run is not None and run.requests == 1, "the older file applied after the newer"
    finally:
        loads.go_on.set()
        await served.runner.cleanup()


async def test_a_reload_still_loading_when_the_proxy_shuts_down_is_not_applied(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reload's load ends on its thread whenever it ends: once shutdown is under way, the
    config it loaded is not put in force (nor the reload counted)."""
    served, raw, path = await _proxy_reloaded_by_sighup_only(fake, redis_server, tmp_path, monkeypatch)
    state = served.app[STATE]
    in_force = state.config
    loads = HeldLoads(held=2)
    monkeypatch.setattr(proxy.reload, "load_config", loads)
    try:
        await _sighup_with_run_ceiling(raw, path, 2)
        assert await asyncio.to_thread(loads.loaded.wait, 10), "the reload did not load"
        await served.runner.cleanup()
        loads.go_on.set()
        assert await asyncio.to_thread(loads.returned.wait, 10)
        for _ in range(20):  # whatever the load's end set going on the loop, let it run
            await asyncio.sleep(0.01)
        assert state.config is in_force
        assert {labels[0]: value.value for labels, value in state.metrics.config_reloads.items()} == {
            "applied": 0,
            "refused": 0,
        }
    finally:
        loads.go_on.set()


async def test_the_config_served_from_start_is_not_kept_with_its_key_scopes_after_a_reload(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each config carries its own key-scope cache (``Config.key_scopes``, room for
    every key: about 18 MB at 5,000 keys). The config ``build_app`` was given stays referenced
    for the life of the process (the cleanup contexts' closures over ``config``: store_ctx,
    journal_ctx, settling_ctx, reaper_ctx; and ``ConfigReloader._started_from`` when serve passes
    the same object, one worker and no flags): after the first reload its full cache is pinned
    beside the new config's. The module-level cache it replaced was one for all, its old entries
    pushed out by the new config's."""
    raw = base_config(fake.base_url, redis_server.url)
    raw["models"] = {
        "gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "1", "output": "1"}}
    }
    raw["tiers"] = tiers(run={"requests": 10})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    read = load_config(path)  # as serve's _config_for: the file's config, its flags none
    app = build_app(read, tokenizer=Tokenizer({}), config_path=path, started_from=read)
    proxy = await serving(app)
    runner = proxy.runner
    try:
        await call(proxy, "scopes")
        first = app[STATE].config.key_scopes
        assert first.held >= 1, "the call kept no key scopes"
        kept = weakref.ref(first)
        url = proxy.url
        del first, read, proxy
        raw["tiers"] = tiers(run={"requests": 9})
        before = app[STATE].config
        path.write_text(yaml.safe_dump(raw))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(500):
            if app[STATE].config is not before:
                break
            await asyncio.sleep(0.01)
        assert app[STATE].config is not before, "not reloaded"
        del before
        await call(Proxy(url=url, app=app, config=app[STATE].config, runner=runner), "after")
        gc.collect()
        assert kept() is None, (
            f"the config served from start is still alive after a reload and a call under the new "
            f"one, its {kept().held} key scopes with it (build_app's closures over config)"
        )
    finally:
        await runner.cleanup()


async def _run_view(proxy: Proxy, run: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.url}/v1/billing/runs/{run}", headers={"Authorization": f"Bearer {KEY_A}"}) as r,
    ):
        assert r.status == 200, await r.text()
        view: dict[str, Any] = await r.json()
        return view


@pytest.mark.parametrize(
    ("raised_to", "status", "refused"),
    [(1000, 200, 0), (200, 429, 1)],
    ids=["then-served", "refused-again"],
)
async def test_a_refusal_under_a_config_a_reload_replaced_is_counted_once_if_at_all(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    raised_to: int,
    status: int,
    refused: int,
) -> None:
    """A run's output ceiling of 100 raised while the call's reserve script waits for the
    store's connection: the script runs under the old config and refuses (counting
    refused:output_tokens in the run's hash), and the call is planned again under the new one.
    Served (a ceiling of 1,000), the run view said its ceiling refused a call no 429 was ever
    answered for; refused again (200, still below the call's 500), it said two refusals for the
    one 429 the client got (the day-2 hunt): the old config's count is taken back."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    raw = base_config(fake.base_url, _on_db_1(redis_server.url), journal_dir=str(tmp_path / "j"))
    raw["tiers"] = {"standard": {"run": {"output_tokens": 100}}}
    path = tmp_path / "c.yaml"
    proxy = await _proxy_from_file(raw, path)
    try:
        raw["tiers"] = {"standard": {"run": {"output_tokens": raised_to}}}
        calling = _call_while_the_store_reconnects(proxy, raw, path, redis_client, "r", max_tokens=500)
        got, text = await calling
        assert got == status, text[:300]
        view = await _run_view(proxy, "r")
        assert view["meters"]["output_tokens"]["refused"] == refused, view["meters"]["output_tokens"]
    finally:
        await proxy.runner.cleanup()


def _unit_reloader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted: Callable[[str], None] = lambda result: None
) -> tuple[proxy.reload.ConfigReloader, dict[str, Any], Path, list[Config]]:
    """A ``ConfigReloader`` of a file, no proxy around it: (it, the file's raw config, the file,
    the configs it applied); ``counted`` told each reload's result."""
    raw = base_config("http://127.0.0.1:9/v1", f"redis://127.0.0.1:{refused_port()}/0")
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "x")
    started = load_config(path)
    applied: list[Config] = []
    return (
        proxy.reload.ConfigReloader(path, lambda: started, applied.append, counted=counted),
        raw,
        path,
        applied,
    )


async def test_a_closed_reloader_applies_no_reload_the_one_loading_as_it_closed_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` (shutdown): a reload whose load was under way is dropped when the load ends,
    and one asked after it does not even load the file."""
    reloader, raw, path, applied = _unit_reloader(tmp_path, monkeypatch)
    loading, go_on = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Config:
        loading.set()
        go_on.wait(10)
        return config_load.load_config(*args, **kwargs)

    monkeypatch.setattr(proxy.reload, "load_config", held)
    raw["limits"] = {"default_max_output_tokens": 77}
    path.write_text(yaml.safe_dump(raw))
    reloading = asyncio.ensure_future(reloader.reload_off_loop("test"))
    try:
        assert await asyncio.to_thread(loading.wait, 10), "the reload did not load"
        reloader.close()
    finally:
        go_on.set()
    assert await reloading is False
    loading.clear()
    assert await reloader.reload_off_loop("test") is False
    assert not loading.is_set(), "a reload asked once closed loaded the file"
    assert applied == []


async def test_reloads_asked_while_one_loads_are_merged_into_the_last_which_loads_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of SIGHUPs (or saves) loaded the file once each, one after the other, seconds
    apiece at thousands of keys. Those asked while one loads are merged into the last of them,
    which still loads after it (the file may have changed during that load): two loads, the
    later file in force, and only the two counted (a merged reload is neither applied nor
    refused)."""
    counted: list[str] = []
    reloader, raw, path, applied = _unit_reloader(tmp_path, monkeypatch, counted.append)
    loads: list[int] = []
    loading, go_on = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Config:
        config = config_load.load_config(*args, **kwargs)
        loads.append(config.limits.default_max_output_tokens)
        if len(loads) == 1:
            loading.set()
            go_on.wait(10)
        return config

    def saved(tokens: int) -> None:
        raw["limits"] = {"default_max_output_tokens": tokens}
        path.write_text(yaml.safe_dump(raw))

    monkeypatch.setattr(proxy.reload, "load_config", held)
    saved(11)
    first = asyncio.ensure_future(reloader.reload_off_loop("test"))
    later: list[asyncio.Future[bool]] = []
    try:
        assert await asyncio.to_thread(loading.wait, 10), "the first reload did not load"
        for tokens in (12, 13, 14):
            saved(tokens)
            later.append(asyncio.ensure_future(reloader.reload_off_loop("test")))
            await asyncio.sleep(0)  # asked in turn, as signals come
    finally:
        go_on.set()
    assert await first is True
    assert [await reload for reload in later] == [False, False, True]
    assert loads == [11, 14]
    assert [new.limits.default_max_output_tokens for new in applied] == [11, 14]
    assert counted == ["applied", "applied"]


async def test_a_reloads_warnings_are_logged_as_it_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The file is loaded on a thread, its warnings kept and said by the loop as the reload is
    applied: an upstream's key variable unset since start is told, not applied unseen."""
    reloader, raw, path, applied = _unit_reloader(tmp_path, monkeypatch)
    monkeypatch.delenv("TEST_UPSTREAM_KEY")
    raw["limits"] = {"default_max_output_tokens": 77}
    path.write_text(yaml.safe_dump(raw))
    caplog.set_level("WARNING")
    assert await reloader.reload_off_loop("test")
    assert [new.limits.default_max_output_tokens for new in applied] == [77]
    assert any("TEST_UPSTREAM_KEY is not set" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_file_saved_while_the_proxy_started_is_in_force_once_it_has_started(
    fake: FakeUpstream,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file serve read, saved again before the app started: the reload it calls for is done
    as the app starts, not a watch's poll later (its SIGHUP, were one sent, was ignored then)."""
    monkeypatch.setattr(app_module, "RELOAD_POLL_S", 600.0)
    raw = base_config(fake.base_url, redis_server.url, journal_dir=str(tmp_path / "journal"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    read = load_config(path)
    raw["limits"] = {"default_max_output_tokens": 77}
    path.write_text(yaml.safe_dump(raw))
    app = build_app(read, tokenizer=Tokenizer({}), config_path=path, started_from=read)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        assert app[STATE].config.limits.default_max_output_tokens == 77
    finally:
        await runner.cleanup()


async def test_a_reload_that_sends_an_upstream_through_an_egress_proxy_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The environment's proxy, read at each reload: an upstream it sends through one from now is
    told as the reload is applied (an http upstream's key would go to it in clear)."""
    reloader, _, _, applied = _unit_reloader(tmp_path, monkeypatch)
    for name in ("http_proxy", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://gw:pw@corp-proxy:3128")
    caplog.set_level("INFO", logger="proxy.config")
    assert await reloader.reload_off_loop("test")
    said = [r for r in caplog.records if r.getMessage() == "upstream goes through an egress proxy"]
    assert [(r.__dict__["upstream"], r.__dict__["egress_proxy"], r.__dict__["named_by"]) for r in said] == [
        ("openai", "corp-proxy:3128", "HTTP_PROXY")
    ], caplog.text
    assert applied[-1].upstreams["openai"].egress is not None
