"""An https upstream served with a private CA's certificate (an in-house vLLM behind TLS): its
calls and its model list trusted by its ``ca_file``, refused without it before the request is
written (a 502 in the proxy's words, billed nothing), each upstream's connections verified and
pooled under its own CAs, and a reload reading the file again."""

from __future__ import annotations

import ssl
import threading
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

import proxy.config
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from tests.conftest import PrivateCA, Proxy, ProxyFactory, base_config
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import assert_zero_usage, raw_post, run_headers, the_entry, upstream_override
from tests.test_budgets import _proxy_from_file, _reload_to

MODEL = "gpt-4o-mini"
MSGS: list[Any] = [{"role": "user", "content": "hi"}]
UNTRUSTED = "cannot connect to upstream: its TLS certificate is not trusted ("


async def test_an_upstream_with_a_private_ca_is_trusted_by_its_ca_file(
    make_proxy: ProxyFactory, fake: FakeUpstream, https_upstream: str, private_ca: PrivateCA
) -> None:
    proxy = await make_proxy(upstreams=upstream_override(https_upstream, ca_file=str(private_ca.ca)))
    async with proxy.client() as client:
        answer = await client.chat.completions.create(
            model=MODEL, messages=MSGS, extra_headers=run_headers("r1")
        )
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSGS, stream=True, extra_headers=run_headers("r2")
        )
        assert "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert (await client.models.list()).data
    await proxy.recorded()
    for run in ("r1", "r2"):
        entry = await the_entry(proxy, run)
        assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry
    assert len(fake.received) == 3


@pytest.mark.parametrize("trusted", ["the system's CAs", "another CA"])
async def test_a_certificate_not_trusted_is_refused_before_the_call_goes_out_billed_nothing(
    make_proxy: ProxyFactory, fake: FakeUpstream, https_upstream: str, private_ca: PrivateCA, trusted: str
) -> None:
    extra = {"ca_file": str(private_ca.other_ca)} if trusted == "another CA" else {}
    proxy = await make_proxy(upstreams=upstream_override(https_upstream, **extra))
    result = await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")
    assert result.status == 502
    error = result.json()["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_error"), error
    # OpenSSL's fixed words for the refusal, never the upstream's address.
    assert error["message"].startswith(UNTRUSTED) and error["message"].endswith("certificate)"), error
    assert b"127.0.0.1" not in result.body
    entry = await the_entry(proxy, "r1", requests=0)  # never went out: not counted
    assert (entry["outcome"], entry["usage_source"]) == ("upstream_error", "none"), entry
    assert_zero_usage(entry)
    async with proxy.client() as client:
        with pytest.raises(openai.InternalServerError) as listed:
            await client.models.list()
    assert listed.value.response.json()["error"]["code"] == "upstream_error"
    assert fake.received == []


async def test_a_certificate_for_another_host_is_refused_without_naming_the_host(
    make_proxy: ProxyFactory, fake: FakeUpstream, https_upstream: str, private_ca: PrivateCA
) -> None:
    # Its certificate names 127.0.0.1, not localhost: Python's words for that quote the host.
    named_otherwise = https_upstream.replace("127.0.0.1", "localhost")
    proxy = await make_proxy(upstreams=upstream_override(named_otherwise, ca_file=str(private_ca.ca)))
    result = await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")
    assert result.status == 502
    message = result.json()["error"]["message"]
    assert message == UNTRUSTED + "it does not name the upstream's host)", message
    assert_zero_usage(await the_entry(proxy, "r1", requests=0))
    assert fake.received == []


async def test_two_upstreams_on_one_host_never_share_a_connection_verified_under_the_others_cas(
    make_proxy: ProxyFactory, fake: FakeUpstream, https_upstream: str, private_ca: PrivateCA
) -> None:
    # The connector is every upstream's: a connection pooled after a call to the trusting
    # upstream must not carry a call of the one whose CAs refuse the certificate.
    settings = {"base_url": https_upstream, "api_key_env": "TEST_UPSTREAM_KEY", "timeout_s": 5}
    proxy = await make_proxy(
        upstreams={
            "trusting": {**settings, "ca_file": str(private_ca.ca)},
            "refusing": {**settings, "ca_file": str(private_ca.other_ca)},
        },
        models={MODEL: {"upstream": "trusting"}, "*": {"upstream": "refusing"}},
    )
    assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")).status == 200
    refused = await raw_post(proxy, {"model": "gpt-4.1", "messages": MSGS}, "r2")
    assert refused.status == 502 and refused.json()["error"]["message"].startswith(UNTRUSTED)
    assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r3")).status == 200
    assert len(fake.received) == 2
    assert_zero_usage(await the_entry(proxy, "r2", requests=0))


async def served_trusting(
    https_upstream: str, redis_url: str, tmp_path: Path, ca_file: Path
) -> tuple[Proxy, dict[str, Any], Path]:
    """A proxy served from a config file (reloadable) whose upstream trusts ``ca_file``; the
    file's config and path, for a reload."""
    raw = base_config(https_upstream, redis_url)
    raw["journal_dir"] = str(tmp_path / "journal")
    raw["upstreams"]["openai"]["ca_file"] = str(ca_file)
    path = tmp_path / "config.yaml"
    return await _proxy_from_file(raw, path), raw, path


async def test_a_reload_reads_the_ca_file_again_under_the_same_path(
    fake: FakeUpstream,
    https_upstream: str,
    private_ca: PrivateCA,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
) -> None:
    ca_file = tmp_path / "upstream-ca.pem"
    ca_file.write_bytes(private_ca.other_ca.read_bytes())
    proxy, raw, path = await served_trusting(https_upstream, redis_server.url, tmp_path, ca_file)
    try:
        assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r1")).status == 502
        # The upstream's CA replaced in the file (a renewed bundle), the config unchanged.
        ca_file.write_bytes(private_ca.ca.read_bytes())
        await _reload_to(proxy, raw, path)
        assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r2")).status == 200
        # And back: a connection pooled under the CA now gone is not handed out again.
        ca_file.write_bytes(private_ca.other_ca.read_bytes())
        await _reload_to(proxy, raw, path)
        assert (await raw_post(proxy, {"model": MODEL, "messages": MSGS}, "r3")).status == 502
        assert len(fake.received) == 1
    finally:
        await proxy.runner.cleanup()


async def test_each_ca_context_is_built_off_the_event_loop_at_start_and_at_a_reload(
    fake: FakeUpstream,
    https_upstream: str,
    private_ca: PrivateCA,
    tmp_path: Path,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ca_file's context was built on the event loop at the upstream's first call after each
    start and each reload, every call in flight standing still meanwhile (about 17 ms for the
    system's bundle, per such upstream): now on a thread, before it is served."""
    built: list[threading.Thread] = []
    trust_context = proxy.config.trust_context

    def recorded(cadata: str) -> ssl.SSLContext:
        built.append(threading.current_thread())
        return trust_context(cadata)

    monkeypatch.setattr(proxy.config, "trust_context", recorded)
    served, raw, path = await served_trusting(https_upstream, redis_server.url, tmp_path, private_ca.ca)
    try:
        state = served.app[STATE]
        assert "ca_context" in vars(state.config.upstreams["openai"]), "not built at start"
        await _reload_to(served, raw, path)
        assert "ca_context" in vars(state.config.upstreams["openai"]), "not built by the reload"
        assert len(built) == 2 and threading.main_thread() not in built, built
        assert (await raw_post(served, {"model": MODEL, "messages": MSGS}, "r1")).status == 200
        assert len(built) == 2, "built again at the call"
    finally:
        await served.runner.cleanup()
