"""The zero-config start (``serve --upstream URL`` with the embedded Redis), what pass-through
callers leave in Redis, and the container recipe. No Docker engine runs on these machines, so
the Dockerfile is checked as text."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import redis.asyncio as aioredis

from proxy.config import Config
from proxy.config_load import load_config
from proxy.redis_server import free_port
from tests.conftest import KEY_A, UPSTREAM_KEY, ProxyFactory
from tests.fake_upstream import FakeUpstream

ROOT = Path(__file__).resolve().parent.parent


async def test_zero_config_start_with_the_embedded_redis(fake: FakeUpstream, tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", fake.base_url, "--port", str(port)],
        cwd=tmp_path,
        stdout=log,
        stderr=log,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 30  # a start on a loaded machine takes its time
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the proxy never became ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                await asyncio.sleep(0.05)
        # The caller's own key is the upstream key in this mode.
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-upstream-secret", max_retries=0
        )
        reply = await client.chat.completions.with_raw_response.create(
            model="any-model", messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Run-Id": "zc"}
        )
        assert reply.headers["x-billing-outcome"] == "ok"
        assert fake.received[-1].headers["Authorization"] == "Bearer sk-upstream-secret"
        async with aiohttp.ClientSession() as session:
            async with session.get(
                f"http://127.0.0.1:{port}/v1/billing/runs/zc",
                headers={"Authorization": "Bearer sk-upstream-secret"},
            ) as resp:
                assert (await resp.json())["meters"]["requests"]["used"] == 1
            async with session.get(
                f"http://127.0.0.1:{port}/v1/billing/runs/zc",
                headers={"Authorization": "Bearer sk-someone-else"},
            ) as resp:
                assert resp.status == 404  # another caller is another tenant
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        log.close()
    text = (tmp_path / "proxy.log").read_text()
    assert "started embedded redis-server" in text and "stopped embedded redis-server" in text
    assert (tmp_path / ".llm-billing-proxy" / "redis" / "appendonlydir").is_dir()  # AOF on disk
    time.sleep(0.2)
    assert (
        subprocess.run(["pgrep", "-f", str(tmp_path / ".llm-billing-proxy")], capture_output=True).stdout
        == b""
    )


def test_serve_without_a_redis_binary_exits_with_an_install_hint(tmp_path: Path) -> None:
    """Zero-config has no file: the hint named only redis.url "in the config" (the docs hunt);
    it names the flag too."""
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2
    assert "apt-get install redis-server" in result.stderr and "Traceback" not in result.stderr
    assert "--redis-url" in result.stderr, result.stderr


def test_the_dockerfile_recipe() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", text, re.M)
    assert "redis-server" in text  # docker run alone works on the embedded default
    user = re.search(r"^USER (\S+)", text, re.M)
    assert user and user.group(1) not in ("root", "0")
    assert re.search(r"^EXPOSE 8080", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", text, re.M)
    assert "--config" in text and "/etc/llm-billing-proxy/config.yaml" in text
    docker_config = (ROOT / "config" / "docker.yaml").read_text()
    assert "url_env: REDIS_URL" in docker_config and "0.0.0.0" in docker_config


async def test_a_pass_through_tenant_is_named_by_128_bits_of_its_keys_digest(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # The tenant id is shown (billing views, the ledger); at 48 bits a key of the same tenant,
    # with its runs and ledger, could be found in hours.
    proxy = await make_proxy(
        passthrough=True, upstreams={"openai": {"base_url": fake.base_url, "passthrough_auth": True}}
    )
    key = "sk-caller-own-key"
    async with (
        aiohttp.ClientSession() as session,
        session.get(proxy.url + "/v1/billing/keys/self", headers={"Authorization": f"Bearer {key}"}) as resp,
    ):
        view = await resp.json()
    assert view["tenant"] == _passthrough_tenant(key), view


BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _passthrough_tenant(key: str) -> str:
    return "pt-" + hashlib.sha256(key.encode()).hexdigest()[:32]


async def _post_many(url: str, headers_of: list[dict[str, str]], status: int) -> None:
    """One chat call per headers, 32 at a time, each answered ``status``."""
    limit = asyncio.Semaphore(32)
    async with aiohttp.ClientSession() as session:

        async def one(headers: dict[str, str]) -> None:
            async with limit, session.post(url + "/v1/chat/completions", json=BODY, headers=headers) as resp:
                assert resp.status == status, await resp.text()
                await resp.read()

        await asyncio.gather(*(one(h) for h in headers_of))


async def _passthrough_proxy(make_proxy: ProxyFactory, fake: FakeUpstream, **limits: int) -> str:
    proxy = await make_proxy(
        passthrough=True,
        upstreams={"openai": {"base_url": fake.base_url, "passthrough_auth": True}},
        limits=limits,
    )
    return proxy.url


async def test_keys_a_sprayer_made_up_leave_no_redis_key_kept_for_ever(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Zero config is pass-through: any bearer token is a tenant of its own, and a call with a
    token the provider refuses (401) is forwarded and settled at 0. Each such call left two keys
    with no TTL in Redis: the tenant's ledger stream (one entry, about 4.7 KB: a stream's first
    node is allocated at ``stream-node-max-bytes``) and its key's lifetime meters
    (``key:pt-...:all``, about 330 bytes, with no ceiling to keep). Whoever reaches the proxy
    grew its Redis by about 5 KB a request, for good: a million made-up tokens is 5 GB that
    nothing gives back, and under ``noeviction`` (the embedded server's) a full Redis refuses
    every reserve. Both now expire with the tenant's runs (``limits.run_ttl_s``)."""
    url = await _passthrough_proxy(make_proxy, fake)
    sprayed = [f"sk-made-up-{i}" for i in range(40)]
    await _post_many(url, [{"Authorization": f"Bearer {key}"} for key in sprayed], 401)
    tenants = {_passthrough_tenant(key) for key in sprayed}
    kept_for_ever: dict[str, int] = {}
    async for key in redis_client.scan_iter(match="lbp:{pt-*", count=1000):
        tenant = key.split("{", 1)[1].split("}", 1)[0]
        if tenant in tenants and await redis_client.ttl(key) == -1:
            kept_for_ever[key] = await redis_client.memory_usage(key) or 0
    kinds = sorted({key.split("}:", 1)[1].split(":", 1)[0] for key in kept_for_ever})
    assert not kept_for_ever, (
        f"{len(kept_for_ever)} keys with no TTL ({kinds}) for {len(sprayed)} made-up tokens, "
        f"{sum(kept_for_ever.values())} bytes"
    )


async def test_a_pass_through_tenant_s_ledger_and_lifetime_meters_expire_with_its_runs_each_call_anew(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    url = await _passthrough_proxy(make_proxy, fake, run_ttl_s=3600)
    tenant = _passthrough_tenant(UPSTREAM_KEY)  # the fake upstream's key: answered 200
    ledger, lifetime = f"lbp:{{{tenant}}}:ledger", f"lbp:{{{tenant}}}:key:{tenant}:all"
    caller = [{"Authorization": f"Bearer {UPSTREAM_KEY}", "X-Run-Id": "r1"}]
    await _post_many(url, caller, 200)
    for key in (ledger, lifetime):
        assert 3000 < await redis_client.ttl(key) <= 3600, key
        await redis_client.expire(key, 100)  # most of the hour gone, as Redis counts it
    await _post_many(url, caller, 200)
    for key in (ledger, lifetime):
        assert 3000 < await redis_client.ttl(key) <= 3600, key  # from the later call on
    assert await redis_client.xlen(ledger) == 2


async def test_a_configured_tenant_s_ledger_and_lifetime_meters_are_kept_for_ever(
    make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(limits={"run_ttl_s": 3600})
    await _post_many(proxy.url, [{"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "r1"}], 200)
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 1
    assert await redis_client.ttl("lbp:{team-a}:ledger") == -1
    assert await redis_client.ttl("lbp:{team-a}:key:a-ci:all") == -1
    assert 3000 < await redis_client.ttl("lbp:{team-a}:run:r1") <= 3600  # its runs do expire


def test_the_container_keeps_its_journal_on_the_volume_its_user_owns() -> None:
    """The image runs as a non-root user in a WORKDIR root owns: a relative journal_dir (the
    default) cannot be made there, so during a Redis outage no settle could be journaled (every
    call reaped at its reserve, every unforwarded reserve billed in full), and the journal would
    not outlive the container anyway."""
    text = (ROOT / "Dockerfile").read_text()
    workdir = Path(re.findall(r"^WORKDIR (\S+)", text, re.M)[-1])
    volumes = [Path(v) for v in re.findall(r'"(/[^"]+)"', re.search(r"^VOLUME (.+)$", text, re.M).group(1))]
    owned = [Path(p) for p in re.findall(r"chown \S+ (\S+)", text)]
    config = load_config(ROOT / "config" / "docker.yaml", {"PROXY_API_KEY": "k"})
    # The operator's own config mounted over it, the defaults left as they are, as well.
    defaults = Config.model_validate({"upstreams": {"openai": {"base_url": "http://x"}}})
    for name, path in (
        ("journal_dir", config.journal_dir),
        ("redis.data_dir", config.redis.data_dir),
        ("default journal_dir", defaults.journal_dir),
        ("default redis.data_dir", defaults.redis.data_dir),
    ):
        where = path if path.is_absolute() else workdir / path
        assert any(where.is_relative_to(v) for v in volumes), f"{name} {where} is not on a volume"
        assert any(where.is_relative_to(o) for o in owned), f"{name} {where} is not where the user can write"
