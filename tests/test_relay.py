"""The exchange's settle (proxy/relay.py): the answer goes out before the call is recorded."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from proxy import relay
from proxy.app import STATE
from proxy.outcome import Outcome
from tests.conftest import KEY_A, ProxyFactory
from tests.fake_upstream import FakeUpstream


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_goes_out_before_the_call_is_recorded(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The metrics and the call's log line are not the client's to wait for: the settle's figures
    go out with the answer (headers, or the billing event before [DONE]) and the record follows.
    Seen from the client's socket: when the call is recorded, the whole answer is there."""
    proxy = await make_proxy()
    host, port = proxy.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    seen: list[bytes] = []
    record_call = relay.record_call

    def noting(*args: Any, **kwargs: Any) -> None:
        try:
            seen.append(sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            seen.append(b"")
        record_call(*args, **kwargs)

    monkeypatch.setattr("proxy.relay.record_call", noting)
    body = orjson.dumps(
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        for _ in range(500):
            if seen:
                break
            await asyncio.sleep(0.01)
        (answer,) = seen
    finally:
        sock.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    if stream:
        assert b": billing " in payload and payload.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    else:
        length = int(head.lower().partition(b"content-length: ")[2].split(b"\r\n")[0])
        assert len(payload) == length and orjson.loads(payload)["usage"]["completion_tokens"] > 0
    assert len(fake.bill) == 1
    registry = proxy.app[STATE].metrics.registry
    assert (
        registry.get_sample_value(
            "llm_proxy_requests_total",
            {"tenant": "team-a", "model": "gpt-4o-mini", "endpoint": "chat.completions", "outcome": "ok"},
        )
        == 1
    )  # recorded all the same


async def test_a_settle_that_fails_after_its_handler_was_cancelled_is_reported_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shutdown past its grace period cancels a handler waiting on its settle; when the settle
    then fails (neither settled nor journaled: the reaper bills it), the failure is logged once,
    not also as an exception nobody retrieved (a review)."""

    async def failing(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.05)
        raise RuntimeError("the settle failed")

    monkeypatch.setattr("proxy.relay.settle", failing)
    ex = relay.Exchange.__new__(relay.Exchange)
    ex.call = SimpleNamespace(  # type: ignore[assignment]
        first_token_at=None,
        served_tier=None,
        request_id="req-1",
        started_at=0.0,
        refining=None,
        endpoint="chat.completions",
    )
    ex.obs = SimpleNamespace(first_token_at=None, service_tier=None, finish_reasons={})  # type: ignore[assignment]
    limits = SimpleNamespace(settled_marker_ttl_s=60)
    ex.services = SimpleNamespace(  # type: ignore[assignment]
        settling=set(), store=None, journal=None, config=SimpleNamespace(limits=limits)
    )
    ex._settling = ex._settlement = ex._keeping = None
    ex.upstream_s = 0.0
    handler = asyncio.ensure_future(ex.settle(Outcome("ok"), SimpleNamespace(source="provider")))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    (task,) = ex.services.settling
    settlement = ex._settlement
    await asyncio.wait({task})
    await asyncio.sleep(0)
    assert settlement is not None and settlement.done()
    # asyncio's own flag for an exception nobody read, which it logs when the future is collected.
    assert not settlement._log_traceback  # type: ignore[attr-defined]
    assert isinstance(settlement.exception(), RuntimeError)
