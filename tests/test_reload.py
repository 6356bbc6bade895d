"""Reloading the config file: a model a reload adds is counted with its encoding, as one present
at start is."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import tiktoken
import yaml
from aiohttp import web

from proxy.app import STATE, build_app
from proxy.config_load import load_config
from proxy.redis_server import RedisServerProcess
from proxy.tokenizer import Tokenizer
from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries


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
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    proxy = Proxy(
        url=f"http://127.0.0.1:{runner.addresses[0][1]}", app=app, config=app[STATE].config, runner=runner
    )
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
