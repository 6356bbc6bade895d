"""Shared helpers of the outcome tests: ledger look-ups, raw HTTP calls and SSE parsing."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import tiktoken
from multidict import CIMultiDictProxy

from tests.conftest import KEY_A, UPSTREAM_KEY, Proxy
from tests.fake_upstream import BillEntry

JsonDict = dict[str, Any]
MODEL = "gpt-4o-mini"
PROMPT = "hello there big world"  # 21 characters, 4 words
MSGS: list[Any] = [{"role": "user", "content": PROMPT}]
# fake: 4 words + 3 per message
FAKE_PROMPT_TOKENS = 7
# proxy's estimate without an encoding: ceil(21 / 4) + 4 per message + 3
CHARS_PROMPT_TOKENS = 6 + 4 + 3
DETAILS: JsonDict = {
    "prompt_tokens_details": {"cached_tokens": 3},
    "completion_tokens_details": {"reasoning_tokens": 4},
}
CHAT_PATH = "/v1/chat/completions"


def run_headers(run: str) -> dict[str, str]:
    return {"X-Run-Id": run}


def chars_tokens(text: str) -> int:
    """The proxy's 4-characters-per-token fallback (at least 1 for non-empty text)."""
    return max(1, -(-len(text) // 4)) if text else 0


def reply_text(words: int) -> str:
    """The fake's default reply of ``words`` tokens: "tok0 tok1 ..."."""
    return " ".join(f"tok{i}" for i in range(words))


def byte_encoding() -> tiktoken.Encoding:
    """An o200k_base stand-in built in-process: one token per byte (no download)."""
    return tiktoken.Encoding(
        name="o200k_base",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={},
    )


def upstream_override(base_url: str, **extra: Any) -> dict[str, Any]:
    """An ``upstreams`` config for ``make_proxy``, as conftest's with some fields changed."""
    config = {
        "base_url": base_url,
        "api_key_env": "TEST_UPSTREAM_KEY",
        "timeout_s": 5,
        "connect_timeout_s": 2,
    }
    return {"openai": {**config, **extra}}


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def get_json(proxy: Proxy, path: str, key: str = KEY_A) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(proxy.url + path, headers=auth(key)) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def ledger_entries(proxy: Proxy, run: str, key: str = KEY_A) -> list[JsonDict]:
    status, body = await get_json(proxy, f"/v1/billing/runs/{run}/ledger", key)
    if status == 404:
        return []
    assert status == 200, body
    data = body["data"]
    assert isinstance(data, list)
    return data


async def run_meters(proxy: Proxy, run: str, key: str = KEY_A) -> JsonDict:
    status, body = await get_json(proxy, f"/v1/billing/runs/{run}", key)
    assert status == 200, body
    meters = body["meters"]
    assert isinstance(meters, dict)
    return meters


async def the_entry(proxy: Proxy, run: str, *, wait_s: float = 0.0, requests: int = 1) -> JsonDict:
    """The one ledger entry of ``run`` (polling up to ``wait_s``), after checking that the run's
    meters hold nothing reserved and count ``requests`` requests (one: the call went out)."""
    deadline = time.monotonic() + wait_s
    entries = await ledger_entries(proxy, run)
    while not entries and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        entries = await ledger_entries(proxy, run)
    assert len(entries) == 1, entries
    meters = await run_meters(proxy, run)
    leftovers = {name: m["reserved"] for name, m in meters.items() if m["reserved"] != 0}
    assert leftovers == {}, meters
    assert meters["requests"]["used"] == requests, meters
    return entries[0]


def assert_provider_usage(entry: JsonDict, bill: BillEntry) -> None:
    assert entry["usage_source"] == "provider", entry
    assert int(entry["input_tokens"]) == bill.prompt_tokens, entry
    assert int(entry["output_tokens"]) == bill.completion_tokens, entry
    assert int(entry["cached_input_tokens"]) == bill.cached_tokens, entry
    assert int(entry["reasoning_tokens"]) == bill.reasoning_tokens, entry
    assert int(entry["total_tokens"]) == bill.prompt_tokens + bill.completion_tokens, entry


def assert_reserve_usage(entry: JsonDict) -> None:
    assert entry["usage_source"] == "reserve", entry
    assert entry["input_tokens"] == entry["reserved_input_tokens"], entry
    assert entry["output_tokens"] == entry["reserved_output_tokens"], entry
    assert int(entry["input_tokens"]) > 0, entry


def assert_zero_usage(entry: JsonDict) -> None:
    assert (entry["input_tokens"], entry["output_tokens"], entry["total_tokens"]) == ("0", "0", "0"), entry


def assert_no_secret(headers: Any, body: bytes) -> None:
    """Nothing the proxy answers carries the upstream key."""
    assert UPSTREAM_KEY.encode() not in body
    assert all(UPSTREAM_KEY not in str(v) for v in dict(headers).values())


@dataclass
class RawResult:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def raw_post(
    proxy: Proxy, body: JsonDict, run: str, path: str = CHAT_PATH, key: str = KEY_A
) -> RawResult:
    headers = {**auth(key), **run_headers(run)}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + path, json=body, headers=headers) as resp,
    ):
        data = await resp.read()
        result = RawResult(resp.status, resp.headers, data)
    assert_no_secret(result.headers, result.body)
    return result


@dataclass(frozen=True)
class SseEvent:
    """One SSE block: its comment lines, event name and data (joined)."""

    comments: tuple[str, ...]
    event: str | None
    data: str | None

    def json(self) -> Any:
        assert self.data is not None
        return json.loads(self.data)


def parse_sse(body: bytes) -> list[SseEvent]:
    events: list[SseEvent] = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        comments: list[str] = []
        event: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line[1:].strip())
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        events.append(SseEvent(tuple(comments), event, "\n".join(data) if data else None))
    return events


def billing_comment(events: list[SseEvent]) -> JsonDict:
    """The payload of the one ``: billing {json}`` comment of a stream."""
    found = [c for e in events for c in e.comments if c.startswith("billing ")]
    assert len(found) == 1, events
    payload = json.loads(found[0].removeprefix("billing "))
    assert isinstance(payload, dict)
    return payload


def data_chunks(events: list[SseEvent]) -> list[JsonDict]:
    """The JSON chunks of a stream (neither [DONE] nor error events)."""
    return [e.json() for e in events if e.data is not None and e.data != "[DONE]" and e.event is None]
