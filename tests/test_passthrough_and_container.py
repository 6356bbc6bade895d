"""The zero-config start (``serve --upstream URL`` with the embedded Redis) and the container
recipe. No Docker engine runs on these machines, so the Dockerfile is checked as text."""

from __future__ import annotations

import asyncio
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

from proxy.config import Config
from proxy.config_load import load_config
from proxy.redis_server import free_port
from tests.conftest import ProxyFactory
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
    import hashlib

    proxy = await make_proxy(
        passthrough=True, upstreams={"openai": {"base_url": fake.base_url, "passthrough_auth": True}}
    )
    key = "sk-caller-own-key"
    async with (
        aiohttp.ClientSession() as session,
        session.get(proxy.url + "/v1/billing/keys/self", headers={"Authorization": f"Bearer {key}"}) as resp,
    ):
        view = await resp.json()
    assert view["tenant"] == "pt-" + hashlib.sha256(key.encode()).hexdigest()[:32], view


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
