"""Hosted tools priced per call and Anthropic's price tiers, past the simple cases: searches seen
before a cut, without usage or beside final figures that count none of them, web_search_preview
priced apart, tool names no answer counts, fast mode with no geography named, a geography other
than the US."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.errors import ConfigError
from tests.conftest import ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream
from tests.test_contract_edges import only_entry, read_until_then_leave
from tests.test_pricing_kinds import _claude_message, _entry, _post
from tests.test_stream_dialects import ev
from tests.test_tool_fees import (
    ANSWER,
    FILE_ITEM,
    SEARCH_ITEM,
    SEARCH_MICROS,
    WEB_SEARCH,
    _claude,
    _config,
    _needed,
    _needs,
    _proxy,
    _response,
)

# -- hosted tools: a pool of calls (max_tool_calls) billed at its reserve ----------------------


async def test_a_pooled_reserve_cut_after_its_calls_bills_no_more_than_the_pool(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """web_search ($10 / 1,000) and file_search ($2.50) with max_tool_calls 2 ("the maximum
    number of total calls to built-in tools"): reserved as 2 web searches. The stream shows two
    file searches, then breaks: billed at the reserve, the 2 file searches are the pool's 2 calls.
    Was web_search=2,file_search=2: 25,000 of fees, past the reserve's 20,000 and past anything
    the provider could bill."""
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10", "file_search": "2.5"})
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "gpt-x", "output": []}
    items = [{**FILE_ITEM, "id": f"fs_{n}"} for n in (1, 2)]
    events = [ev("response.created", {"response": created})]
    for index, item in enumerate(items):
        begun = {"output_index": index, "item": {**item, "status": "in_progress"}}
        events.append(ev("response.output_item.added", begun))
        events.append(ev("response.output_item.done", {"output_index": index, "item": item}))
    # No response.completed: a broken stream, billed at its reserve.
    script.plan = Plan(content_type="text/event-stream", chunks=[b"".join(events)])
    body: dict[str, Any] = {
        "model": "gpt-x",
        "input": "search my files",
        "stream": True,
        "max_output_tokens": 100,
        "max_tool_calls": 2,
        "tools": [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}],
    }
    status, _ = await _post(proxy.url, "/v1/responses", body, "pooled")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["usage_source"] == "reserve", entry
    assert entry["tool_calls"] == "file_search=2", entry
    tokens = int(entry["reserved_input_tokens"]) * 3 + int(entry["reserved_output_tokens"]) * 15
    assert int(entry["cost_micros"]) == tokens + 2 * 2_500, entry


# -- hosted tools: a search the answer showed is billed when no usage told it -----------------

SEARCH_USE = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}
SEARCH_RESULT = {
    "type": "web_search_tool_result",
    "tool_use_id": "srvtoolu_1",
    "content": [{"type": "web_search_result", "url": "https://example.com", "title": "x"}],
}


def searched(start: dict[str, Any]) -> list[bytes]:
    """A Messages stream's events up to a web search's result (``start``: message_start's)."""
    return [
        ev("message_start", {"message": start}),
        ev("content_block_start", {"index": 0, "content_block": SEARCH_USE}),
        ev("content_block_stop", {"index": 0}),
        ev("content_block_start", {"index": 1, "content_block": SEARCH_RESULT}),
        ev("content_block_stop", {"index": 1}),
    ]


def _claude_searching_stream() -> Plan:
    """A search, its result, then text that streams slowly (the client leaves in it)."""
    start = {**_claude_message({}), "content": [], "stop_reason": None}
    start["usage"] = {"input_tokens": 20, "output_tokens": 1, "server_tool_use": {"web_search_requests": 0}}
    query = {"type": "input_json_delta", "partial_json": '{"query": "news"}'}
    first = b"".join(
        [
            ev("message_start", {"message": start}),
            ev("content_block_start", {"index": 0, "content_block": SEARCH_USE}),
            ev("content_block_delta", {"index": 0, "delta": query}),
            ev("content_block_stop", {"index": 0}),
            ev("content_block_start", {"index": 1, "content_block": SEARCH_RESULT}),
            ev("content_block_stop", {"index": 1}),
            ev("content_block_start", {"index": 2, "content_block": {"type": "text", "text": ""}}),
            ev("content_block_delta", {"index": 2, "delta": {"type": "text_delta", "text": "Found it"}}),
        ]
    )
    more = ev("content_block_delta", {"index": 2, "delta": {"type": "text_delta", "text": " and more"}})
    return Plan(content_type="text/event-stream", chunks=[first, more, more], delay_s=0.5)


async def test_a_search_streamed_before_a_cancel_is_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Cut under ``cancel`` after a web search ran: Anthropic bills the search (its usage would
    have said web_search_requests: 1). The proxy counted the text and billed no search."""
    proxy = await _proxy(make_proxy, script, policy={"on_client_disconnect": "cancel"})
    script.plan = _claude_searching_stream()
    await read_until_then_leave(proxy, "/v1/messages", _claude(stream=True, tools=[WEB_SEARCH]), b"Found it")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected", entry
    assert entry.get("tool_calls") == "web_search=1", entry  # was: absent
    tokens = int(entry["input_tokens"]) * 3 + int(entry["output_tokens"]) * 15
    assert int(entry["cost_micros"]) >= tokens + SEARCH_MICROS, entry


async def test_a_search_in_an_answer_without_usage_is_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A whole Messages body without usage (a gateway's) is counted: its searches were not."""
    proxy = await _proxy(make_proxy, script)
    answer = _claude_message({})
    del answer["usage"]
    answer["content"] = [SEARCH_USE, SEARCH_RESULT, {"type": "text", "text": "Found it."}]
    script.plan = Plan(chunks=[json.dumps(answer).encode()])
    status, body = await _post(proxy.url, "/v1/messages", _claude(tools=[WEB_SEARCH]), "nousage")
    assert status == 200, body
    entry = await _entry(redis_client)
    assert entry["usage_source"] != "provider", entry
    assert entry.get("tool_calls") == "web_search=1", entry  # was: absent, the search free


async def test_a_search_the_final_usage_does_not_bill_is_not_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The provider's final count stands over the blocks seen (a search that failed is free)."""
    proxy = await _proxy(make_proxy, script)
    usage = {"input_tokens": 10, "output_tokens": 5, "server_tool_use": {"web_search_requests": 0}}
    answer = _claude_message(usage)
    error = {"type": "web_search_tool_result_error", "error_code": "unavailable"}
    failed = {**SEARCH_RESULT, "content": error}
    answer["content"] = [SEARCH_USE, failed, {"type": "text", "text": "Sorry."}]
    script.plan = Plan(chunks=[json.dumps(answer).encode()])
    status, body = await _post(proxy.url, "/v1/messages", _claude(tools=[WEB_SEARCH]), "failed")
    assert status == 200, body
    entry = await _entry(redis_client)
    assert entry["usage_source"] == "provider"
    assert "tool_calls" not in entry, entry
    assert int(entry["cost_micros"]) == 10 * 3 + 5 * 15


async def test_a_responses_search_streamed_before_a_cancel_is_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A Responses stream cut under ``cancel`` after its web_search_call item: OpenAI bills the
    call; the proxy counted only the final response's items, which never came."""
    proxy = await _proxy(
        make_proxy, script, tool_prices={"web_search": "10"}, policy={"on_client_disconnect": "cancel"}
    )
    searching = {**SEARCH_ITEM, "status": "in_progress"}
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "gpt-x", "output": []}
    message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
    first = b"".join(
        [
            ev("response.created", {"response": created}),
            ev("response.output_item.added", {"output_index": 0, "item": searching}),
            ev("response.output_item.done", {"output_index": 0, "item": SEARCH_ITEM}),
            ev("response.output_item.added", {"output_index": 1, "item": message}),
            ev("response.output_text.delta", {"output_index": 1, "item_id": "msg_1", "delta": "Found it"}),
        ]
    )
    more = ev("response.output_text.delta", {"output_index": 1, "item_id": "msg_1", "delta": " and more"})
    script.plan = Plan(content_type="text/event-stream", chunks=[first, more, more], delay_s=0.5)
    body = {"model": "gpt-x", "input": "news?", "stream": True, "tools": [{"type": "web_search"}]}
    await read_until_then_leave(proxy, "/v1/responses", body, b"Found it")
    entry = await only_entry(redis_client)
    assert entry["outcome"] == "client_disconnected", entry
    assert entry.get("tool_calls") == "web_search=1", entry  # was: absent


async def test_a_failed_response_that_lists_no_search_is_billed_the_search_it_streamed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A Responses stream runs a web search, then ends in response.failed, whose output is empty
    (as OpenAI's documented one) and whose usage is told. A Responses usage never counts tool
    calls, but the proxy took it for their final count, and the final output's none for the
    count: the tokens were billed, the search (billed without usage) was not."""
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10"})
    failed = {**_response([], status="failed"), "error": {"code": "server_error", "message": "x"}}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": {**failed, "status": "in_progress", "usage": None}}),
        ("response.output_item.added", {"output_index": 0, "item": {**SEARCH_ITEM, "status": "in_progress"}}),
        ("response.web_search_call.completed", {"output_index": 0, "item_id": "ws_1"}),
        ("response.output_item.done", {"output_index": 0, "item": SEARCH_ITEM}),
        ("response.failed", {"response": failed}),
    ]
    script.plan = Plan(content_type="text/event-stream", chunks=[ev(kind, obj) for kind, obj in events])
    body = {"model": "gpt-x", "input": "news?", "stream": True, "tools": [{"type": "web_search"}]}
    status, _ = await _post(proxy.url, "/v1/responses", body, "failed")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["outcome"] == "upstream_error", entry
    billed = (entry["usage_source"], entry["input_tokens"], entry["output_tokens"])
    assert billed == ("provider", "100", "20"), entry
    assert entry.get("tool_calls") == "web_search=1", entry  # was: absent
    assert int(entry["cost_micros"]) == 100 * 3 + 20 * 15 + SEARCH_MICROS, entry


@pytest.mark.parametrize("stream", [False, True])
async def test_an_anthropic_search_the_final_usage_does_not_count_is_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """A search block, then usage without ``server_tool_use`` (a gateway's translation drops
    it): no count of the searches came, yet the usage was taken for one, and the search shown
    was not billed (without usage it was). Anthropic's own count, 0 for a failed search, still
    stands where it is told (above)."""
    proxy = await _proxy(make_proxy, script)
    usage = {"input_tokens": 10, "output_tokens": 5}
    if stream:
        start = {**_claude_message({}), "content": [], "stop_reason": None}
        start["usage"] = {"input_tokens": 10, "output_tokens": 1}
        text = {"type": "text", "text": ""}
        parts = [
            *searched(start),
            ev("content_block_start", {"index": 2, "content_block": text}),
            ev("content_block_delta", {"index": 2, "delta": {"type": "text_delta", "text": "Found it."}}),
            ev("content_block_stop", {"index": 2}),
            ev(
                "message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": usage}
            ),
            ev("message_stop", {}),
        ]
        script.plan = Plan(content_type="text/event-stream", chunks=parts)
    else:
        answer = _claude_message(usage)
        answer["content"] = [SEARCH_USE, SEARCH_RESULT, {"type": "text", "text": "Found it."}]
        script.plan = Plan(chunks=[json.dumps(answer).encode()])
    body = _claude(tools=[WEB_SEARCH], stream=stream)
    status, answered = await _post(proxy.url, "/v1/messages", body, "untold")
    assert status == 200, answered
    entry = await _entry(redis_client)
    assert (entry["outcome"], entry["usage_source"]) == ("ok", "provider"), entry
    assert entry.get("tool_calls") == "web_search=1", entry  # was: absent, the search free
    assert int(entry["cost_micros"]) == 10 * 3 + 5 * 15 + SEARCH_MICROS, entry


# -- US-only inference: a fast call naming no geography may run in the US ----------------------

STANDARD = {"input": "3", "output": "15"}
FAST = {"input": "30", "output": "150"}
FAST_US = {"input": "33", "output": "165"}
TIERS = {"fast": FAST, "fast-us": FAST_US}
TIERS_US = {"fast": FAST, "us": {"input": "3.3", "output": "16.5"}}


async def _tiered(
    make_proxy: ProxyFactory, script: ScriptedUpstream, service_tiers: Any = None, **overrides: Any
) -> Any:
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    model = {"upstream": "anthropic", "price_per_million": STANDARD, "service_tiers": service_tiers or TIERS}
    return await make_proxy(upstreams={"anthropic": upstream}, models={"claude-x": model}, **overrides)


async def _reserve_needs(
    make_proxy: ProxyFactory, script: ScriptedUpstream, body: dict[str, Any], tiers: Any = None
) -> int:
    ceiling = {"standard": {"run": {"cost_usd": "0.000001"}}}
    proxy = await _tiered(make_proxy, script, tiers, tiers=ceiling)
    status, answer = await _post(proxy.url, "/v1/messages", body, "needs")
    assert status == 429, answer
    return _needs(answer)


async def test_a_fast_call_naming_no_geography_is_reserved_at_fast_us(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A workspace's default_inference_geo makes a call naming no geography run in the US (its
    answer says inference_geo "us", billed at ``fast-us``): a call naming no service tier is
    reserved at the dearest tier for that reason, but a fast one was reserved at ``fast`` and
    billed past it (a cost ceiling passed by the race the reserve is there to stop)."""
    body = _claude(speed="fast")
    unnamed = await _reserve_needs(make_proxy, script, body)
    in_us = await _reserve_needs(make_proxy, script, {**body, "inference_geo": "us"})
    assert unnamed >= in_us  # was: reserved at fast's prices, below what fast-us bills
    # Such a call, as the answer says it ran, is billed at fast-us.
    proxy = await _tiered(make_proxy, script)
    usage = {"input_tokens": 10, "output_tokens": 2, "speed": "fast", "inference_geo": "us"}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, answer = await _post(proxy.url, "/v1/messages", body, "bill")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert (entry["service_tier"], entry["cost_micros"]) == ("fast-us", str(10 * 33 + 2 * 165))


@pytest.mark.parametrize(
    ("told", "tier", "cost"),
    [
        ({}, "fast", 10 * 30 + 2 * 150),
        ({"speed": "standard", "inference_geo": "global"}, None, 10 * 3 + 2 * 15),
    ],
)
async def test_a_fast_call_whose_answer_tells_its_capacity_and_not_its_speed_is_billed_fast(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    told: dict[str, str],
    tier: str | None,
    cost: int,
) -> None:
    """``usage.service_tier`` tells the capacity that served a call (standard, priority), not its
    speed: a fast call whose answer said "standard" and no ``speed`` (a gateway's) was billed at
    the standard prices, a tenth of what it asked for and was reserved at (the usage hunt). The
    asked tier stands; an answer that tells the speed and the geography is billed as it says."""
    proxy = await _tiered(make_proxy, script, TIERS_US)
    usage = {"input_tokens": 10, "output_tokens": 2, "service_tier": "standard", **told}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, answer = await _post(
        proxy.url, "/v1/messages", _claude(speed="fast", inference_geo="global"), "f"
    )
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert (entry.get("service_tier"), int(entry["cost_micros"])) == (tier, cost), entry  # was: 60, no tier


# -- hosted tools: web_search_preview is priced apart from web_search ---------------------------

PREVIEW_MICROS = 25_000  # $25 per 1,000 calls: web_search_preview on gpt-4o, gpt-4.1


async def test_web_search_preview_calls_are_billed_at_its_own_price(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """OpenAI prices a call of web_search_preview (on a model that does not reason) at $25 per
    1,000, web_search at $10; both answer with web_search_call items. Priced apart in the config,
    the preview's calls were reserved and billed at web_search's price (the preview's unread)."""
    prices = {"web_search": "10", "web_search_preview": "25"}
    body = {"model": "gpt-x", "input": "news?", "max_output_tokens": 100}
    preview = {**body, "tools": [{"type": "web_search_preview_2025_03_11"}]}
    tokens = await _needed(make_proxy, script, "/v1/responses", preview, tool_prices={"other": "1"})
    reserved = await _needed(make_proxy, script, "/v1/responses", preview, tool_prices=prices)
    assert reserved == tokens + 10 * PREVIEW_MICROS  # was: 10 * 10,000
    proxy = await _proxy(make_proxy, script, tool_prices=prices)
    script.plan = Plan(chunks=[json.dumps(_response([SEARCH_ITEM, ANSWER])).encode()])
    status, answer = await _post(proxy.url, "/v1/responses", preview, "preview")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry.get("tool_calls") == "web_search_preview=1", entry  # was: web_search=1
    assert int(entry["cost_micros"]) == 100 * 3 + 20 * 15 + PREVIEW_MICROS


async def test_web_search_is_billed_as_before_beside_a_priced_preview(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    prices = {"web_search": "10", "web_search_preview": "25"}
    proxy = await _proxy(make_proxy, script, tool_prices=prices)
    script.plan = Plan(chunks=[json.dumps(_response([SEARCH_ITEM, ANSWER])).encode()])
    body = {"model": "gpt-x", "input": "news?", "tools": [{"type": "web_search"}]}
    status, answer = await _post(proxy.url, "/v1/responses", body, "ga")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry.get("tool_calls") == "web_search=1", entry
    assert int(entry["cost_micros"]) == 100 * 3 + 20 * 15 + SEARCH_MICROS


async def test_a_preview_priced_only_as_web_search_is_billed_as_before(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10"})
    script.plan = Plan(chunks=[json.dumps(_response([SEARCH_ITEM, ANSWER])).encode()])
    body = {"model": "gpt-x", "input": "news?", "tools": [{"type": "web_search_preview"}]}
    status, answer = await _post(proxy.url, "/v1/responses", body, "old")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry.get("tool_calls") == "web_search=1", entry


# -- hosted tools: a price under a name no answer counts is a config error ----------------------


@pytest.mark.parametrize(
    "name", ["web_search_requests", "web_search_call", "web_search_20250305", "web_search_preview_2025_03_11"]
)
def test_a_tool_priced_under_a_name_no_answer_counts_is_a_config_error(name: str) -> None:
    """Anthropic's count field (web_search_requests), the Responses item type (web_search_call),
    a dated tool type: accepted, and its calls never billed, the operator never told."""
    with pytest.raises(ConfigError, match="bare name"):
        _config({"price_per_million": STANDARD, "price_per_thousand_calls": {name: "10"}})


def test_bare_tool_names_are_taken() -> None:
    prices = {"web_search": "10", "web_search_preview": "25", "file_search": "2.5", "web_fetch": "0"}
    config = _config({"price_per_million": STANDARD, "price_per_thousand_calls": prices})
    assert set(config.models["m"].tool_rates) == set(prices)


@pytest.mark.parametrize(
    "name", ["web-search", "Web_Search", "WebSearch", "web search", "1web", "web_searché"]
)
def test_a_tool_price_under_a_name_no_answer_can_spell_is_a_config_error(name: str) -> None:
    """Answers count tools by lowercase snake_case names (``web_search_requests``,
    ``web_search_call``): a price under any other spelling loaded, and was never billed."""
    with pytest.raises(ConfigError, match="price_per_thousand_calls"):
        _config({"price_per_million": STANDARD, "price_per_thousand_calls": {name: "10"}})


async def test_searches_priced_under_a_misspelled_tool_name_are_refused_at_load_then_billed(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Web search priced at $10 per 1,000 as ``web-search``: the config loaded, check-config said
    ok, and three searches were billed 0 (only the tokens). It is refused; spelt as the answers
    count it, the searches are billed."""
    upstream = {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}
    model: dict[str, Any] = {
        "upstream": "anthropic",
        "price_per_million": {"input": "3", "output": "15"},
        "price_per_thousand_calls": {"web-search": "10"},
    }
    with pytest.raises(ConfigError, match="price_per_thousand_calls"):
        await make_proxy(upstreams={"anthropic": upstream}, models={"claude-x": model})
    model["price_per_thousand_calls"] = {"web_search": "10"}
    proxy = await make_proxy(upstreams={"anthropic": upstream}, models={"claude-x": model})
    usage = {"input_tokens": 1000, "output_tokens": 100, "server_tool_use": {"web_search_requests": 3}}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    body = {
        "model": "claude-x",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "what is new?"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
    }
    status, _ = await _post(proxy.url, "/v1/messages", body, "search-run")
    assert status == 200
    entry = await _entry(redis_client)
    # 1000 * 3 + 100 * 15 micro-units of tokens, plus 3 searches at 10,000 micro-units each.
    assert int(entry["cost_micros"]) == 1000 * 3 + 100 * 15 + 3 * 10_000, entry


async def test_a_call_naming_a_geography_other_than_the_us_is_not_reserved_at_us_prices(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """``inference_geo: "global"`` is never served (nor billed) as US-only inference: reserved
    at the US prices, it was refused where its own prices fit."""
    body = _claude()
    standard = await _reserve_needs(make_proxy, script, body, {"fast": FAST})
    named = await _reserve_needs(make_proxy, script, {**body, "inference_geo": "global"}, TIERS_US)
    unnamed = await _reserve_needs(make_proxy, script, body, TIERS_US)
    assert named == standard  # was: the US prices' reserve
    assert unnamed > standard  # naming none, the workspace's default may be the US: as before


async def test_a_worst_case_past_the_store_by_its_searches_names_them(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """A max_uses the proxy cannot account for: the 400 told the client to lower max_tokens,
    n, best_of or its prompts, none of which it could lower to pass."""
    proxy = await _proxy(make_proxy, script)
    tool = {**WEB_SEARCH, "max_uses": 10**15}
    status, answer = await _post(proxy.url, "/v1/messages", _claude(tools=[tool]), "huge")
    assert status == 400, answer
    assert b"max_uses" in answer, answer
    assert script.received == []


@pytest.mark.parametrize(
    "told",
    [{"service_tier": "standard", "speed": "standard"}, {"speed": "standard"}],
    ids=["capacity-and-speed", "speed-alone"],
)
async def test_a_fast_call_whose_answer_says_it_ran_at_standard_speed_is_billed_standard(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, told: dict[str, str]
) -> None:
    """The call asked fast mode, its geography named ("global"); its answer says it ran at
    ``speed: "standard"`` and tells no ``inference_geo``: the standard prices, not fast (billed
    fast, ten times over, once "standard" needed a geography beside it: the second review)."""
    proxy = await _tiered(make_proxy, script, TIERS_US)
    usage = {"input_tokens": 10, "output_tokens": 2, **told}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    asked = _claude(speed="fast", inference_geo="global")
    status, answer = await _post(proxy.url, "/v1/messages", asked, "f")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert (entry.get("service_tier"), int(entry["cost_micros"])) == (None, 10 * 3 + 2 * 15), entry


@pytest.mark.parametrize(
    ("asked", "told", "billed"),
    [
        ({"inference_geo": "us"}, {"speed": "standard"}, "us"),
        ({"speed": "fast", "inference_geo": "us"}, {"speed": "standard"}, "us"),
        ({"speed": "fast", "inference_geo": "global"}, {"inference_geo": "us"}, "fast-us"),
    ],
    ids=["us-told-its-speed", "fast-us-told-its-speed", "fast-told-its-geography"],
)
async def test_an_answer_telling_its_speed_or_its_geography_alone_keeps_the_asked_other(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    asked: dict[str, str],
    told: dict[str, str],
    billed: str,
) -> None:
    """An answer telling one of speed and geography (a gateway passing some on) is the asked
    tier with it: a US call told its standard speed stays ``us`` (was the default, under-billed:
    the third review), a fast call told the US is ``fast-us`` (was ``us``, fast mode dropped)."""
    proxy = await _tiered(make_proxy, script, {**TIERS_US, "fast-us": {"input": "33", "output": "165"}})
    usage = {"input_tokens": 10, "output_tokens": 2, "service_tier": "standard", **told}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, answer = await _post(proxy.url, "/v1/messages", _claude(**asked), "u")
    assert status == 200, answer
    assert (await _entry(redis_client)).get("service_tier") == billed


_COSTS = {"us": 10 * 3.3 + 2 * 16.5, "fast-us": 10 * 33 + 2 * 165}  # 10 input, 2 output


@pytest.mark.parametrize(
    ("asked", "told", "tiers", "least"),
    [
        ({}, {"speed": "standard"}, TIERS_US, "us"),
        ({"speed": "fast"}, {"speed": "fast"}, TIERS, "fast-us"),
        ({"speed": "fast"}, {"speed": "standard"}, TIERS_US, "us"),
    ],
    ids=["no-tier-told-standard-speed", "fast-told-fast-speed", "fast-told-standard-speed"],
)
async def test_a_call_naming_no_geography_told_its_speed_alone_is_not_billed_below_the_us(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    asked: dict[str, str],
    told: dict[str, str],
    tiers: Any,
    least: str,
) -> None:
    """A call naming no inference_geo may run in the US (a workspace's default_inference_geo),
    as its reserve took it; an answer telling its speed and not its geography does not say: the
    US's tier where priced, as an unsure reading bills the more (billed outside it: the fourth
    review)."""
    proxy = await _tiered(make_proxy, script, tiers)
    usage = {"input_tokens": 10, "output_tokens": 2, "service_tier": "standard", **told}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, answer = await _post(proxy.url, "/v1/messages", _claude(**asked), "u")
    assert status == 200, answer
    assert int((await _entry(redis_client))["cost_micros"]) >= _COSTS[least]
