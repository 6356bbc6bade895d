"""Hosted tools priced per call (``models.PATTERN.price_per_thousand_calls``): reserved at the
most a request may make, billed as the provider counts them, in the call's one round-up.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.config import Config
from proxy.config_load import parse_config
from proxy.errors import ConfigError
from tests.conftest import UPSTREAM_KEY, base_config
from tests.conftest import ProxyFactory as Factory
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, send
from tests.test_pricing_kinds import _claude_message, _claude_stream, _entry, _post, _sse
from tests.test_upstream_bodies import chat_body

# Claude's list prices per million (input 3, output 15) and web search's $10 per 1,000 searches:
# a search costs 10,000 micro-units.
PRICE = {"input": "3", "output": "15"}
SEARCH_MICROS = 10_000
TOOLS = {"web_search": "10", "web_fetch": "0"}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
MESSAGES = [{"role": "user", "content": "what is new?"}]


def _model(upstream: str, tool_prices: dict[str, str] | None, price: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"upstream": upstream, "price_per_million": price or PRICE}
    if tool_prices is not None:
        model["price_per_thousand_calls"] = tool_prices
    return model


async def _proxy(
    make_proxy: Factory,
    script: ScriptedUpstream,
    tool_prices: dict[str, str] | None = TOOLS,
    price: Any = None,
    **overrides: Any,
) -> Any:
    upstreams = {
        "anthropic": {"base_url": script.base_url, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"},
        "openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"},
    }
    models = {
        "claude-x": _model("anthropic", tool_prices, price),
        "gpt-x": _model("openai", tool_prices, price),
    }
    return await make_proxy(upstreams=upstreams, models=models, **overrides)


def _claude(**extra: Any) -> dict[str, Any]:
    return {"model": "claude-x", "max_tokens": 100, "messages": MESSAGES, **extra}


def _needs(body: bytes) -> int:
    """What a refused reserve needed, as its error says."""
    message = json.loads(body)["error"]["message"]
    found = re.search(r"this request needs (\d+)", message)
    assert found is not None, message
    return int(found.group(1))


async def _needed(
    make_proxy: Factory, script: ScriptedUpstream, path: str, body: dict[str, Any], **kw: Any
) -> int:
    """The cost the reserve of ``body`` needs: refused by a run ceiling of one micro-unit."""
    proxy = await _proxy(make_proxy, script, tiers={"standard": {"run": {"cost_usd": "0.000001"}}}, **kw)
    status, answer = await _post(proxy.url, path, body, "needs")
    assert status == 429, answer
    return _needs(answer)


# -- config -------------------------------------------------------------------------------------


def _config(model: dict[str, Any], limits: dict[str, Any] | None = None) -> Config:
    raw = base_config(
        "http://127.0.0.1:9/v1", "redis://127.0.0.1:9", models={"m": {"upstream": "openai", **model}}
    )
    if limits is not None:
        raw["limits"] = {**raw["limits"], **limits}
    return parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})


def test_tool_prices_are_read_in_micro_units_per_thousand_calls() -> None:
    config = _config(
        {"price_per_million": PRICE, "price_per_thousand_calls": {"web_search": "10", "x": 0.001}}
    )
    assert config.models["m"].tool_rates == {"web_search": 10_000_000, "x": 1_000}
    assert config.limits.default_max_tool_calls == 10
    assert _config({"price_per_million": PRICE}).models["m"].tool_rates == {}
    assert _config({}, {"default_max_tool_calls": 0}).limits.default_max_tool_calls == 0


@pytest.mark.parametrize(
    ("model", "limits", "message"),
    [
        (
            {"price_per_million": PRICE, "price_per_thousand_calls": {"web_search": True}},
            None,
            "not true or false",
        ),
        (
            {"price_per_million": PRICE, "price_per_thousand_calls": {"web_search": "0.0000001"}},
            None,
            "6 decimal",
        ),
        ({"price_per_million": PRICE, "price_per_thousand_calls": {"web_search": -1}}, None, "greater than"),
        ({"price_per_million": PRICE, "price_per_thousand_calls": {"web_search": "1e10"}}, None, "less than"),
        ({"price_per_million": PRICE, "price_per_thousand_calls": {"": 1}}, None, "non-empty"),
        ({"price_per_thousand_calls": {"web_search": 10}}, None, "price_per_million is needed"),
        ({}, {"default_max_tool_calls": True}, "not true or false"),
        ({}, {"default_max_tool_calls": -1}, "greater than"),
    ],
    ids=[
        "bool",
        "seven-places",
        "negative",
        "too-large",
        "no-name",
        "no-token-price",
        "limit-bool",
        "limit-neg",
    ],
)
def test_bad_tool_prices_are_config_errors(model: dict[str, Any], limits: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(model, limits)


# -- Anthropic ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_web_searches_are_billed_at_their_price(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    proxy = await _proxy(make_proxy, script)
    usage = {"input_tokens": 1000, "output_tokens": 100, "server_tool_use": {"web_search_requests": 3}}
    if stream:
        # message_start tells no searches yet; message_delta's usage is cumulative.
        start = {"input_tokens": 1000, "server_tool_use": {"web_search_requests": 0}}
        script.plan = _claude_stream(start, usage)
    else:
        script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, _ = await _post(proxy.url, "/v1/messages", _claude(stream=stream, tools=[WEB_SEARCH]), "s")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["usage_source"] == "provider"
    assert int(entry["cost_micros"]) == 1000 * 3 + 100 * 15 + 3 * SEARCH_MICROS
    assert entry["tool_calls"] == "web_search=3"


async def test_tool_fees_share_the_calls_one_round_up(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # 5 input tokens at 0.3 per million: 1.5 micro-units; a search at 0.0015 per 1,000: 1.5 more.
    # Rounded once: 3 (rounded apart, 2 + 2 = 4).
    proxy = await _proxy(
        make_proxy, script, tool_prices={"web_search": "0.0015"}, price={"input": "0.3", "output": "0"}
    )
    usage = {"input_tokens": 5, "output_tokens": 0, "server_tool_use": {"web_search_requests": 1}}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, _ = await _post(proxy.url, "/v1/messages", _claude(tools=[WEB_SEARCH]), "round")
    assert status == 200
    entry = await _entry(redis_client)
    assert (entry["cost_micros"], entry["tool_calls"]) == ("3", "web_search=1")


async def test_an_unpriced_tool_costs_nothing(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10"})
    tools = {"web_search_requests": 1, "web_fetch_requests": 4, "code_execution_requests": 2}
    usage = {"input_tokens": 1000, "output_tokens": 100, "server_tool_use": tools}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    fetch = {"type": "web_fetch_20250910", "name": "web_fetch"}
    status, _ = await _post(proxy.url, "/v1/messages", _claude(tools=[WEB_SEARCH, fetch]), "free")
    assert status == 200
    entry = await _entry(redis_client)
    assert int(entry["cost_micros"]) == 1000 * 3 + 100 * 15 + SEARCH_MICROS
    assert entry["tool_calls"] == "web_search=1"


async def test_a_tool_priced_at_zero_is_named_in_the_ledger(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await _proxy(make_proxy, script)  # web_fetch priced at 0
    usage = {"input_tokens": 10, "output_tokens": 1}
    delta = {"output_tokens": 1, "server_tool_use": {"web_fetch_requests": 2, "web_search_requests": 1}}
    script.plan = _claude_stream(usage, delta)
    status, _ = await _post(proxy.url, "/v1/messages", _claude(stream=True), "zero")
    assert status == 200
    entry = await _entry(redis_client)
    assert int(entry["cost_micros"]) == 10 * 3 + 1 * 15 + SEARCH_MICROS  # the config's order
    assert entry["tool_calls"] == "web_search=1,web_fetch=2"


async def test_the_reserve_holds_max_uses_searches(make_proxy: Factory, script: ScriptedUpstream) -> None:
    unbounded = {k: v for k, v in WEB_SEARCH.items() if k != "max_uses"}
    for tool, searches in ((WEB_SEARCH, 5), (unbounded, 10)):  # max_uses, else the default limit
        body = _claude(tools=[tool])
        # The same model, its searches unpriced: the tokens alone (the tool's definition is prompt).
        tokens = await _needed(make_proxy, script, "/v1/messages", body, tool_prices={"other": "1"})
        priced = await _needed(make_proxy, script, "/v1/messages", body)
        assert priced == tokens + searches * SEARCH_MICROS
    # Fewer calls by default, fewer model passes too (each reserved its output cap).
    limits = {"default_max_tool_calls": 3}
    body = _claude(tools=[unbounded])
    tokens = await _needed(
        make_proxy, script, "/v1/messages", body, tool_prices={"other": "1"}, limits=limits
    )
    three = await _needed(make_proxy, script, "/v1/messages", body, limits=limits)
    assert three == tokens + 3 * SEARCH_MICROS


async def test_a_ceiling_that_fits_the_tokens_but_not_the_searches_refuses_before_forwarding(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    body = _claude(tools=[WEB_SEARCH])
    needed = await _needed(make_proxy, script, "/v1/messages", body)
    tokens = needed - 5 * SEARCH_MICROS
    assert tokens > 0
    script.received.clear()
    ceiling = f"{(needed - 1) / 1_000_000:.6f}"
    proxy = await _proxy(make_proxy, script, tiers={"standard": {"run": {"cost_usd": ceiling}}})
    status, answer = await _post(proxy.url, "/v1/messages", body, "tight")
    assert status == 429, answer
    assert script.received == []
    assert await redis_client.xrange("lbp:{team-a}:ledger") == []
    # One micro-unit more, and it goes.
    usage = {"input_tokens": 10, "output_tokens": 1, "server_tool_use": {"web_search_requests": 5}}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    ceiling = f"{needed / 1_000_000:.6f}"
    proxy = await _proxy(make_proxy, script, tiers={"standard": {"run": {"cost_usd": ceiling}}})
    status, answer = await _post(proxy.url, "/v1/messages", body, "fits")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert int(entry["cost_micros"]) == 10 * 3 + 15 + 5 * SEARCH_MICROS


async def test_a_call_without_usage_is_billed_its_reserved_searches(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await _proxy(make_proxy, script)
    # Cut after the first text: the input is told, the output and the searches never are.
    script.plan = _claude_stream({"input_tokens": 20}, None, end=False)
    status, _ = await _post(proxy.url, "/v1/messages", _claude(stream=True, tools=[WEB_SEARCH]), "cut")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["usage_source"] == "reserve"
    assert entry["tool_calls"] == "web_search=5"
    tokens = int(entry["input_tokens"]) * 3 + int(entry["output_tokens"]) * 15
    assert int(entry["cost_micros"]) == tokens + 5 * SEARCH_MICROS


async def test_searches_past_the_reserve_are_billed(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await _proxy(make_proxy, script)
    usage = {"input_tokens": 10, "output_tokens": 1, "server_tool_use": {"web_search_requests": 7}}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, _ = await _post(proxy.url, "/v1/messages", _claude(tools=[WEB_SEARCH]), "past")  # max_uses 5
    assert status == 200
    entry = await _entry(redis_client)
    assert (int(entry["cost_micros"]), entry["tool_calls"]) == (30 + 15 + 7 * SEARCH_MICROS, "web_search=7")


async def test_a_call_without_tools_is_reserved_and_billed_as_before(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    priced = await _needed(make_proxy, script, "/v1/messages", _claude())
    unpriced = await _needed(make_proxy, script, "/v1/messages", _claude(), tool_prices=None)
    assert priced == unpriced
    for run, tool_prices in (("with", TOOLS), ("without", None)):
        proxy = await _proxy(make_proxy, script, tool_prices=tool_prices)
        script.plan = Plan(
            chunks=[json.dumps(_claude_message({"input_tokens": 9, "output_tokens": 2})).encode()]
        )
        status, _ = await _post(proxy.url, "/v1/messages", _claude(), run)
        assert status == 200
    ledger: Any = await redis_client.xrange("lbp:{team-a}:ledger")
    first, second = (dict(fields) for _, fields in ledger)
    assert first["cost_micros"] == second["cost_micros"] == str(9 * 3 + 2 * 15)
    assert "tool_calls" not in first and "tool_calls" not in second


# -- Responses ----------------------------------------------------------------------------------


def _response(output: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": status,
        "model": "gpt-x",
        "output": output,
        "usage": {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120},
    }


SEARCH_ITEM: dict[str, Any] = {
    "type": "web_search_call",
    "id": "ws_1",
    "status": "completed",
    "action": {"type": "search"},
}
FILE_ITEM: dict[str, Any] = {
    "type": "file_search_call",
    "id": "fs_1",
    "status": "completed",
    "queries": ["q"],
}
ANSWER: dict[str, Any] = {
    "type": "message",
    "id": "msg_1",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "news", "annotations": []}],
}


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_hosted_tool_calls_are_billed_once_each(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10", "file_search": "2.5"})
    output = [SEARCH_ITEM, {**SEARCH_ITEM, "id": "ws_2"}, FILE_ITEM, ANSWER]
    final = _response(output)
    if stream:
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": {**final, "status": "in_progress", "output": []}})
        ]
        for index, item in enumerate(output):
            events.append(("response.output_item.added", {"output_index": index, "item": item}))
            events.append(("response.output_item.done", {"output_index": index, "item": item}))
        events.append(("response.completed", {"response": final}))
        chunks = [_sse(kind, {"type": kind, **obj}) for kind, obj in events]
        script.plan = Plan(content_type="text/event-stream", chunks=chunks)
    else:
        script.plan = Plan(chunks=[json.dumps(final).encode()])
    body = {"model": "gpt-x", "input": "news?", "tools": [{"type": "web_search"}, {"type": "file_search"}]}
    status, _ = await _post(proxy.url, "/v1/responses", {**body, "stream": stream}, "r")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["tool_calls"] == "web_search=2,file_search=1"
    assert int(entry["cost_micros"]) == 100 * 3 + 20 * 15 + 2 * SEARCH_MICROS + 2_500


@pytest.mark.parametrize("stream", [False, True])
async def test_web_search_calls_that_open_or_read_a_page_are_not_billed_as_searches(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """OpenAI's web search guide: a ``web_search_call``'s ``action`` is ``search``, ``open_page``
    or ``find_in_page`` (reasoning models); "Search actions incur a tool call cost". A reasoning
    model that searches once, opens a result and finds a word in it made one billable search.
    Was: three, one per ``web_search_call`` item. An action the proxy does not know, or none, is
    billed as a search."""
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10"})
    output = [
        SEARCH_ITEM,
        {**SEARCH_ITEM, "id": "ws_2", "action": {"type": "open_page", "url": "https://example.com/a"}},
        {
            **SEARCH_ITEM,
            "id": "ws_3",
            "action": {"type": "find_in_page", "url": "https://example.com/a", "pattern": "price"},
        },
        # "find": the same action, as the API's spec named it before (the review of 9027be3)
        {
            **SEARCH_ITEM,
            "id": "ws_6",
            "action": {"type": "find", "url": "https://example.com/a", "pattern": "x"},
        },
        {**SEARCH_ITEM, "id": "ws_4", "action": {"type": "scroll_page"}},  # not known: a search
        {key: value for key, value in SEARCH_ITEM.items() if key != "action"} | {"id": "ws_5"},
        ANSWER,
    ]
    _responded(script, _response(output), stream=stream)
    body = {"model": "gpt-x", "input": "news?", "tools": [{"type": "web_search"}], "stream": stream}
    status, _ = await _post(proxy.url, "/v1/responses", body, "pages")
    assert status == 200
    entry = await _entry(redis_client)
    assert entry["tool_calls"] == "web_search=3", entry
    assert int(entry["cost_micros"]) == 100 * 3 + 20 * 15 + 3 * SEARCH_MICROS, entry


def _responded(script: ScriptedUpstream, final: dict[str, Any], *, stream: bool) -> None:
    """The scripted upstream answers ``final``, whole or as OpenAI streams it (each item's
    action told once the item is done)."""
    if not stream:
        script.plan = Plan(chunks=[json.dumps(final).encode()])
        return
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": {**final, "status": "in_progress", "output": []}})
    ]
    for index, item in enumerate(final["output"]):
        begun = {key: value for key, value in item.items() if key != "action"}
        events.append(("response.output_item.added", {"output_index": index, "item": begun}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    events.append(("response.completed", {"response": final}))
    chunks = [_sse(kind, {"type": kind, **obj}) for kind, obj in events]
    script.plan = Plan(content_type="text/event-stream", chunks=chunks)


@pytest.mark.parametrize("told", [3, 0], ids=["three-queries", "discounted"])
@pytest.mark.parametrize("stream", [False, True])
async def test_responses_web_searches_are_billed_as_the_provider_counts_them(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool, told: int
) -> None:
    """A Responses answer tells its billable web searches, ``tool_usage.web_search.num_requests``
    (the SDK's ``Response.tool_usage``: "counts billable searches. Discounted searches and
    actions such as opening a page are excluded"), as Anthropic's ``usage.server_tool_use`` does.
    The proxy counted ``web_search_call`` items: one item whose search issued three queries, told
    as three billable requests, was billed one search. A count above the items stands, streamed
    or not; one below them (a discounted search, or usage not recorded: "tool families with no
    recorded usage have zero counts") is no proof of none billed, and the items stand, as they
    do in an answer without the count."""
    proxy = await _proxy(make_proxy, script, tool_prices={"web_search": "10"})
    searched = {**SEARCH_ITEM, "action": {"type": "search", "queries": ["gold", "gold today", "gold news"]}}
    tool_usage = {
        "image_gen": {
            "input_tokens": 0,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
            "output_tokens": 0,
            "total_tokens": 0,
        },
        "web_search": {"num_requests": told},
    }
    _responded(script, {**_response([searched, ANSWER]), "tool_usage": tool_usage}, stream=stream)
    body = {"model": "gpt-x", "input": "gold?", "tools": [{"type": "web_search"}], "stream": stream}
    status, _ = await _post(proxy.url, "/v1/responses", body, "told")
    assert status == 200
    entry = await _entry(redis_client)
    billed = max(told, 1)
    assert entry.get("tool_calls") == f"web_search={billed}", entry
    assert int(entry["cost_micros"]) == 100 * 3 + 20 * 15 + billed * SEARCH_MICROS, entry
    # Without the provider's count (an older answer, another upstream's): one per search item.
    await redis_client.delete("lbp:{team-a}:ledger")
    _responded(script, _response([searched, ANSWER]), stream=stream)
    status, _ = await _post(proxy.url, "/v1/responses", body, "items")
    assert status == 200
    assert (await _entry(redis_client))["tool_calls"] == "web_search=1"


# gpt-5 at its list prices, its image generation tool's image tokens at gpt-image-1's: image
# input 10, image output 40 (text 5 in: the tool's text is billed at the model's text prices).
IMAGE_TOOL_PRICE = {"input": "1.25", "output": "10", "image_input": "10", "image_output": "40"}
IMAGE_ITEM = {"type": "image_generation_call", "id": "ig_1", "status": "completed", "result": "aGk="}


# gpt-5's flex prices (half of its standard ones); its long-context ones (OpenAI's past 272K:
# input twice, output one and a half times). Neither names image prices, as the README's
# service_tiers / long_context rows never say they must.
FLEX = {"input": "0.625", "output": "5"}
LONG = {"above_input_tokens": 400, "price_per_million": {"input": "2.5", "output": "15"}}
IMAGES_WRITTEN = 4160


def _image_final(tier: str | None) -> dict[str, Any]:
    final = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": "gpt-5",
        "output": [IMAGE_ITEM],
        "usage": {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120},
        "tool_usage": {
            "image_gen": {
                "input_tokens": 350,
                "input_tokens_details": {"image_tokens": 300, "text_tokens": 50},
                "output_tokens": IMAGES_WRITTEN,
                "total_tokens": 350 + IMAGES_WRITTEN,
            }
        },
    }
    if tier is not None:
        final["service_tier"] = tier
    return final


@pytest.mark.parametrize("stream", [False, True])
async def test_the_image_tool_s_images_are_billed_at_the_image_prices(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """OpenAI bills the Responses image generation tool's tokens at the image model's prices,
    its image output at 40 per million (gpt-image-1) where gpt-5 writes text at 10: billed at the
    text price, a picture cost a quarter of what the provider charged."""
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gpt-5": {"upstream": "openai", "price_per_million": IMAGE_TOOL_PRICE}},
    )
    _responded(script, _image_final(None), stream=stream)
    body = {"model": "gpt-5", "input": "a cat", "tools": [{"type": "image_generation"}], "stream": stream}
    status, answer = await _post(proxy.url, "/v1/responses", body, "image")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert (entry["input_tokens"], entry["output_tokens"]) == ("450", "4180")
    assert (entry["image_input_tokens"], entry["image_output_tokens"]) == ("300", "4160")
    # 150 text tokens in at 1.25, 300 image tokens at 10; 20 text tokens out at 10, 4,160 at 40.
    exact = 150 * 1_250_000 + 300 * 10_000_000 + 20 * 10_000_000 + 4160 * 40_000_000
    assert int(entry["cost_micros"]) == -(-exact // 1_000_000) == 169_788  # 41,788 at the text price


@pytest.mark.parametrize("case", ["flex-tier", "flex-untold", "long-context"])
async def test_the_image_tool_s_images_keep_the_image_price_on_a_tier_or_past_the_long_context_threshold(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, case: str
) -> None:
    """A tier's or a long-context table that does not repeat the image prices billed the image
    tool's pictures at that table's text prices: a flex call's at 5 per million where OpenAI
    bills 40 (the first review of the day). The model's own image prices hold there, also for
    a flex call whose answer names no tier, billed at the tier it asked (the second review)."""
    model: dict[str, Any] = {"upstream": "openai", "price_per_million": IMAGE_TOOL_PRICE}
    body: dict[str, Any] = {"model": "gpt-5", "input": "a cat", "tools": [{"type": "image_generation"}]}
    if case.startswith("flex"):
        model["service_tiers"] = {"flex": FLEX}
        body["service_tier"] = "flex"
    else:
        model["long_context"] = LONG  # the call's input (450, the tool's included) passes 400
    proxy = await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={"gpt-5": model},
    )
    _responded(script, _image_final("flex" if case == "flex-tier" else None), stream=False)
    status, answer = await _post(proxy.url, "/v1/responses", body, case)
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry["image_output_tokens"] == str(IMAGES_WRITTEN)
    # Whatever the text costs at that tier or length, the 4,160 image tokens cost what OpenAI
    # bills them: gpt-image-1's 40 per million (166,400 micro-units), not the table's 5 or 15.
    images_at_their_price = IMAGES_WRITTEN * 40
    assert int(entry["cost_micros"]) >= images_at_their_price, entry["cost_micros"]


async def test_responses_reserve_max_tool_calls_once_at_the_dearest_tool(
    make_proxy: Factory, script: ScriptedUpstream
) -> None:
    prices = {"web_search": "10", "file_search": "2.5"}
    tools = [{"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["vs"]}]
    body = {"model": "gpt-x", "input": "news?", "tools": tools, "max_output_tokens": 100}
    tokens = await _needed(make_proxy, script, "/v1/responses", body, tool_prices={"other": "1"})
    bounded = await _needed(
        make_proxy, script, "/v1/responses", {**body, "max_tool_calls": 4}, tool_prices=prices
    )
    assert bounded == tokens + 4 * SEARCH_MICROS
    each = await _needed(make_proxy, script, "/v1/responses", body, tool_prices=prices)
    assert each == tokens + 10 * SEARCH_MICROS + 10 * 2_500


async def test_a_clamp_tier_leaves_room_for_the_searches(
    make_proxy: Factory, script: ScriptedUpstream
) -> None:
    body = _claude(tools=[WEB_SEARCH])  # max_tokens 100, 5 searches
    needed = await _needed(make_proxy, script, "/v1/messages", body)
    # Room for the input, the 5 searches and 60 output tokens in each of the loop's 6 passes (one
    # after each search, and the last): the cap forwarded is 60, the one each pass is held to.
    ceiling = f"{(needed - 6 * 40 * 15) / 1_000_000:.6f}"
    tier = {"standard": {"run": {"cost_usd": ceiling}, "on_budget_short": "clamp"}}
    proxy = await _proxy(make_proxy, script, tiers=tier)
    usage = {"input_tokens": 10, "output_tokens": 1, "server_tool_use": {"web_search_requests": 5}}
    script.plan = Plan(chunks=[json.dumps(_claude_message(usage)).encode()])
    status, answer = await _post(proxy.url, "/v1/messages", body, "clamp")
    assert status == 200, answer
    assert json.loads(script.received[-1])["max_tokens"] == 60


def _iteration(output: int) -> dict[str, Any]:
    return {"type": "message", "input_tokens": 20, "output_tokens": output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip


@pytest.mark.parametrize("tool_prices", [TOOLS, None], ids=["priced", "unpriced"])
async def test_a_server_tool_loops_output_past_max_tokens_is_reserved(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, tool_prices: Any
) -> None:
    """Anthropic's max_tokens "applies to each call to the requested model": a web search with
    max_uses 3 samples the model up to four times (after each search, and the answer), each up
    to max_tokens. Reserved at one max_tokens, the loop's 3,400 output tokens passed a reserve of
    1,000 (the params hunt); each pass is reserved its cap now, whether the tool is priced or not.
    The input the loop reads again is the documented overshoot; here it stays within the reserve."""
    proxy = await _proxy(make_proxy, script, tool_prices=tool_prices)
    usage = {
        "input_tokens": 80, "output_tokens": 3400, "server_tool_use": {"web_search_requests": 3},
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
        "iterations": [_iteration(800), _iteration(800), _iteration(800), _iteration(1000)],
    }  # fmt: skip
    answer = {**_claude_message(usage), "model": "claude-x"}
    script.plan = Plan(chunks=[dumps(answer)])
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    body = {**_claude(tools=[search]), "max_tokens": 1000}
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body),
        headers={"X-Run-Id": "searching"},
    )  # fmt: skip
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    assert (entry["output_tokens"], entry["reserved_output_tokens"]) == ("3400", "4000")
    assert entry.get("overshoot_tokens", "0") == "0", entry
    # The cap forwarded is the one each pass is held to, as the client sent it.
    assert json.loads(script.received[-1])["max_tokens"] == 1000


async def test_a_lease_the_reaper_settles_names_the_searches_its_cost_holds(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A call whose instance stopped renewing its lease is settled by a reaper at its reserve,
    searches included: the entry names them, as the call's own settle at its reserve does."""
    proxy = await _proxy(make_proxy, script, limits={"reaper_interval_s": 0.1})
    usage = {"input_tokens": 10, "output_tokens": 1}
    answer = json.dumps(_claude_message(usage)).encode()
    # The answer held back in the middle, long enough for the lease to be seen and reaped.
    script.plan = Plan(chunks=[answer[:10], answer[10:]], delay_s=1.0)
    posted = asyncio.ensure_future(_post(proxy.url, "/v1/messages", _claude(tools=[WEB_SEARCH]), "reaped"))
    leases = "lbp:{team-a}:leases"
    while not await redis_client.zcard(leases):
        await asyncio.sleep(0.01)
    (reservation,) = await redis_client.zrange(leases, 0, -1)
    await redis_client.zadd(leases, {reservation: 0})  # its lease ran out
    while not await redis_client.xlen("lbp:{team-a}:ledger"):
        await asyncio.sleep(0.01)
    entry = await _entry(redis_client)
    assert entry["outcome"] == "lease_expired"
    assert entry["tool_calls"] == "web_search=5"
    tokens = int(entry["input_tokens"]) * 3 + int(entry["output_tokens"]) * 15
    assert int(entry["cost_micros"]) == tokens + 5 * SEARCH_MICROS
    status, _ = await posted
    assert status == 200
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 1  # billed once, by the reaper


CODE_ITEM: dict[str, Any] = {
    "type": "code_interpreter_call",
    "id": "ci_1",
    "status": "completed",
    "code": "print(1)",
    "container_id": "cntr_1",
    "outputs": None,
}
CODE_TOOL = {"type": "code_interpreter", "container": {"type": "auto"}}


@pytest.mark.parametrize(
    ("tool", "priced_as"),
    [
        (CODE_TOOL, "code_interpreter"),
        ({"type": "image_generation"}, "image_generation"),
        ({"type": "mcp", "server_label": "x", "server_url": "https://mcp.example.com"}, "mcp"),
        ({"type": "computer_use_preview", "display_width": 1024, "display_height": 768}, "computer"),
    ],
)
async def test_every_priced_responses_hosted_tool_is_reserved_as_it_is_billed(
    make_proxy: Factory, script: ScriptedUpstream, tool: dict[str, Any], priced_as: str
) -> None:
    """A price's name is the tool's as the answers count it (``code_interpreter_call``:
    code_interpreter; ``computer_call``: computer): the settle billed each such call, but the
    reserve knew only the search tools' types, so a call enabling another priced tool held none
    of its fee and a cost ceiling was passed (the pricing hunt)."""
    body = {"model": "gpt-x", "input": "compute", "tools": [tool]}
    unpriced = await _needed(make_proxy, script, "/v1/responses", body, tool_prices={"other": "1"})
    priced = await _needed(make_proxy, script, "/v1/responses", body, tool_prices={priced_as: "30"})
    assert priced == unpriced + 10 * 30_000  # limits.default_max_tool_calls, at 30,000 micro-units
    bounded = {**body, "tools": [tool, {"type": "web_search"}], "max_tool_calls": 2}
    prices = {priced_as: "30", "web_search": "10"}
    # Every call may go to the dearest of the priced tools it enables.
    assert (
        await _needed(make_proxy, script, "/v1/responses", bounded, tool_prices=prices) >= unpriced + 60_000
    )


async def test_a_cost_ceiling_holds_a_priced_code_interpreter_call(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A run of 1,000 micro-units: the call's tokens fit, its one code interpreter call ($30 per
    1,000) does not; it was forwarded and billed 30,090."""
    proxy = await _proxy(
        make_proxy,
        script,
        tool_prices={"code_interpreter": "30"},
        tiers={"standard": {"run": {"cost_usd": "0.001"}}},
    )
    answer = _response([CODE_ITEM, ANSWER])
    answer["usage"] = {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10}
    script.plan = Plan(chunks=[json.dumps(answer).encode()])
    body = {"model": "gpt-x", "input": "compute", "max_output_tokens": 16, "tools": [CODE_TOOL]}
    status, _ = await _post(proxy.url, "/v1/responses", body, "ceiling")
    assert status == 429
    assert script.received == []
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 0


SHELL_ITEM: dict[str, Any] = {
    "type": "shell_call",
    "id": "sh_1",
    "call_id": "call_1",
    "status": "completed",
    "action": {"commands": ["ls"]},
}


@pytest.mark.parametrize(
    ("tool", "item", "name"),
    [
        ({"type": "code_interpreter", "container": {"type": "auto", "memory_limit": "64g"}}, CODE_ITEM,
         "code_interpreter"),
        ({"type": "shell", "environment": {"type": "container_auto", "memory_limit": "64g"}}, SHELL_ITEM,
         "shell"),
    ],
)  # fmt: skip
async def test_a_container_larger_than_the_least_is_billed_at_its_size_s_price_or_refused(
    make_proxy: Factory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    tool: dict[str, Any],
    item: dict[str, Any],
    name: str,
) -> None:
    """OpenAI prices a code interpreter's (or hosted shell's) container by its memory
    (``memory_limit``: 1g, 4g, 16g, 64g at $0.03, $0.12, $0.48, $1.92): a request asking 64g was
    reserved and billed at the tool's one price, 1g's, a 64th of the provider's bill (the usage
    hunt). Refused as an unpriced service tier is, unless the operator prices that size
    (``<tool>_64g``): then reserved and billed at it."""
    body = {"model": "gpt-x", "input": "compute", "max_output_tokens": 100, "tools": [tool]}
    proxy = await _proxy(make_proxy, script, tool_prices={name: "30"})
    status, answer = await _post(proxy.url, "/v1/responses", body, "unpriced")
    assert status == 400, answer
    assert json.loads(answer)["error"]["param"] == "tools"
    assert f"'{name}_64g'".encode() in answer
    assert script.received == []
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 0
    prices = {name: "30", f"{name}_64g": "1920"}
    unpriced = await _needed(make_proxy, script, "/v1/responses", body, tool_prices={"other": "1"})
    reserved = await _needed(make_proxy, script, "/v1/responses", body, tool_prices=prices)
    assert reserved == unpriced + 10 * 1_920_000  # limits.default_max_tool_calls at 64g's price
    proxy = await _proxy(make_proxy, script, tool_prices=prices)
    script.plan = Plan(chunks=[json.dumps(_response([item, ANSWER])).encode()])
    status, answer = await _post(proxy.url, "/v1/responses", body, "priced")
    assert status == 200, answer
    entry = await _entry(redis_client)
    assert entry.get("tool_calls") == f"{name}_64g=1", entry
    assert int(entry["cost_micros"]) == 100 * 3 + 20 * 15 + 1_920_000, entry
    # The least size, named, is the tool's own price.
    least = {**tool}
    for key in ("container", "environment"):
        if key in least:
            least[key] = {**least[key], "memory_limit": "1g"}
    body = {**body, "tools": [least]}
    unpriced = await _needed(make_proxy, script, "/v1/responses", body, tool_prices={"other": "1"})
    reserved = await _needed(make_proxy, script, "/v1/responses", body, tool_prices=prices)
    assert reserved == unpriced + 10 * 30_000


@pytest.mark.parametrize(
    ("tool", "counted"), [("computer_use_preview", "computer"), ("custom", "custom_tool")]
)
def test_a_tool_type_whose_calls_are_counted_under_another_name_is_refused_naming_it(
    tool: str, counted: str
) -> None:
    """``computer_use_preview``'s calls are ``computer_call`` items: priced under the type's name,
    nothing was reserved or billed, and check-config said ok (the README audit)."""
    with pytest.raises(ConfigError, match=f"price the tool as '{counted}'"):
        _config({"price_per_million": PRICE, "price_per_thousand_calls": {tool: "10"}})
    assert _config({"price_per_million": PRICE, "price_per_thousand_calls": {counted: "10"}})


# OpenAI's chat search models search the web before every answer ("the model always retrieves
# information from the web before responding"), billed per call beside the tokens.
SEARCH_MODEL = "gpt-4o-search-preview"
SEARCH_FEE_MICROS = 30_000  # $30 per 1,000 calls: $0.03 a call


def _chat_answer(model: str) -> Plan:
    usage = {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}
    return Plan(chunks=[json.dumps({**chat_body("It is sunny.", usage), "model": model}).encode()])


async def _chat_search_proxy(make_proxy: Factory, script: ScriptedUpstream, **extra: Any) -> Any:
    priced = {
        "upstream": "openai",
        "price_per_million": {"input": "2.5", "output": "10"},
        "price_per_thousand_calls": {"web_search": "30"},
    }
    return await make_proxy(
        upstreams={"openai": {"base_url": script.base_url, "api_key_env": "TEST_UPSTREAM_KEY"}},
        models={SEARCH_MODEL: priced, "gpt-4o": priced, "o3-deep-research": priced},
        **extra,
    )


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_completion_tokens": 100, **extra}


@pytest.mark.parametrize(
    ("body", "searches"),
    [
        (_chat(SEARCH_MODEL), True),
        (_chat("gpt-4o", web_search_options={"search_context_size": "medium"}), True),
        (_chat("gpt-4o"), False),  # the same price list, no search asked: no fee
        (_chat("o3-deep-research"), False),  # "search" inside a word is no search model
    ],
    ids=["search-model", "web_search_options", "no-search", "research"],
)
async def test_a_chat_search_call_is_reserved_and_billed_its_search(
    make_proxy: Factory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    body: dict[str, Any],
    searches: bool,
) -> None:
    """A chat call to a search model, or asking to search (``web_search_options``), was neither
    reserved nor billed its search fee though the operator priced ``web_search`` for the model:
    "chat completions have no hosted tools" is false for OpenAI (found by the reserve hunt)."""
    proxy = await _chat_search_proxy(make_proxy, script)
    script.plan = _chat_answer(body["model"])
    status, _ = await _post(proxy.url, "/v1/chat/completions", body, "chat-search")
    assert status == 200
    entry = await _entry(redis_client)
    tokens_micros = -(-(20 * 2_500_000 + 10 * 10_000_000) // 1_000_000)
    fee = SEARCH_FEE_MICROS if searches else 0
    assert (entry.get("tool_calls"), int(entry["cost_micros"])) == (
        "web_search=1" if searches else None,
        tokens_micros + fee,
    ), entry


async def test_a_chat_search_call_whose_fee_passes_a_cost_ceiling_is_not_forwarded(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A $0.02 run ceiling: the tokens fit, the $0.03 search does not. It was forwarded, and the
    provider billed the search past the ceiling."""
    proxy = await _chat_search_proxy(make_proxy, script, tiers={"standard": {"run": {"cost_usd": "0.02"}}})
    script.plan = _chat_answer(SEARCH_MODEL)
    status, _ = await _post(proxy.url, "/v1/chat/completions", _chat(SEARCH_MODEL), "chat-search-ceiling")
    assert status == 429
    assert script.received == []


async def test_a_chat_search_call_the_provider_refused_is_billed_no_search(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await _chat_search_proxy(make_proxy, script)
    refusal = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
    script.plan = Plan(status=400, chunks=[json.dumps(refusal).encode()])
    status, _ = await _post(proxy.url, "/v1/chat/completions", _chat(SEARCH_MODEL), "chat-search-refused")
    assert status == 400
    entry = await _entry(redis_client)
    assert (entry.get("tool_calls"), entry["cost_micros"]) == (None, "0"), entry


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return _sse(kind, {"type": kind, **obj})


ONE_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}


def _use(n: int) -> dict[str, Any]:
    return {"type": "server_tool_use", "id": f"srvtoolu_{n}", "name": "web_search", "input": {"query": "q"}}


def _result(n: int, *, error: str | None = None) -> dict[str, Any]:
    content: Any = [{"type": "web_search_result", "url": "https://example.com", "title": "x"}]
    if error is not None:
        content = {"type": "web_search_tool_result_error", "error_code": error}
    return {"type": "web_search_tool_result", "tool_use_id": f"srvtoolu_{n}", "content": content}


# One search ran; the model asked for two more, refused by max_uses (not billed by Anthropic).
BLOCKS = [
    _use(1), _result(1),
    _use(2), _result(2, error="max_uses_exceeded"),
    _use(3), _result(3, error="max_uses_exceeded"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_searches_refused_past_max_uses_are_not_billed_without_a_final_count(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis, stream: bool
) -> None:
    """max_uses 1: Anthropic runs (and bills) one search at most in the call; the model's further
    calls get ``max_uses_exceeded`` error results, unbilled, as a search that fails is. Without
    a final count (a stream that ends in an ``error`` event; a gateway's usage without
    ``server_tool_use``) every server_tool_use block shown was billed: 3 searches (the server
    tools hunt)."""
    proxy = await _proxy(make_proxy, script)
    if stream:
        start = {**_claude_message({}), "content": [], "stop_reason": None}
        told = {"web_search_requests": 0}
        start["usage"] = {"input_tokens": 20, "output_tokens": 1, "server_tool_use": told}
        parts = [_event("message_start", {"message": start})]
        for index, block in enumerate(BLOCKS):
            parts.append(_event("content_block_start", {"index": index, "content_block": block}))
            parts.append(_event("content_block_stop", {"index": index}))
        parts.append(_event("error", {"error": {"type": "overloaded_error", "message": "Overloaded"}}))
        script.plan = Plan(content_type="text/event-stream", chunks=parts)
    else:
        answer = _claude_message({"input_tokens": 10, "output_tokens": 5})  # no server_tool_use
        answer["content"] = [*BLOCKS, {"type": "text", "text": "Found it."}]
        script.plan = Plan(chunks=[json.dumps(answer).encode()])
    status, _ = await _post(proxy.url, "/v1/messages", _claude(stream=stream, tools=[ONE_SEARCH]), "maxuses")
    assert status == 200
    entry = await _entry(redis_client)
    tokens = int(entry["input_tokens"]) * 3 + int(entry["output_tokens"]) * 15
    assert entry.get("tool_calls") == "web_search=1", entry
    assert int(entry["cost_micros"]) == tokens + SEARCH_MICROS, entry


async def test_a_huge_max_uses_of_an_unpriced_server_tool_is_refused_naming_max_uses(
    make_proxy: Factory, script: ScriptedUpstream
) -> None:
    """Unpriced (no price_per_thousand_calls), its max_uses multiplies the output reserve (a pass
    each): the 400 named only 'max_tokens, n, best_of or the number of prompts' (the third
    review)."""
    proxy = await _proxy(make_proxy, script, tool_prices=None)
    tool = {"type": "code_execution_20250825", "name": "code_execution", "max_uses": 10**15}
    status, answer = await _post(proxy.url, "/v1/messages", _claude(tools=[tool]), "huge")
    assert status == 400, answer
    assert script.received == []
    assert b"max_uses" in answer, answer


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": 5, "name": "x"}]},
        {"tools": [{"type": ["web_search_20250305"], "name": "x"}]},
        {"tools": [{"type": "web_search_20250305", "name": "w", "max_uses": "3"}]},
        {"tools": [{"type": "web_search_20250305", "name": "w", "max_uses": 3.5}]},
        {"tools": [{"type": "web_search_20250305", "name": "w", "max_uses": -1}]},
        {"tools": [{"type": "web_search_20250305", "name": "w", "max_uses": None}]},
        {"tools": [{"type": "_", "name": "w"}]},
        {"mcp_servers": "x"},
        {"mcp_servers": {"a": 1}},
        {"mcp_servers": [1, None, "x"]},
        {"compaction": []},
        {"compaction": {"type": "summarize", "instructions": 5}},
        {"compaction": {"type": "summarize", "instructions": ["x"]}},
        {"context_management": {"edits": [{"type": None}, 3, {"type": "compact_1", "instructions": {}}]}},
    ],
)
async def test_odd_json_in_server_tools_and_compaction_is_no_500(
    make_proxy: Factory, script: ScriptedUpstream, extra: dict[str, Any]
) -> None:
    proxy = await _proxy(make_proxy, script)
    status, answer = await _post(proxy.url, "/v1/messages", _claude(**extra), "odd")
    assert status != 500, answer
    if status >= 400:
        assert json.loads(answer)["error"]["message"], answer


async def test_a_whole_server_tool_answer_with_no_usage_is_counted_past_one_passes_cap(
    make_proxy: Factory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """An Anthropic-format answer with no usage (a gateway's) after a search loop: its text,
    written over several passes (each up to max_tokens 100, the reserve 4 x 100), was counted and
    held to one pass's cap, 300 tokens written billed 100 (the third review): held to all of them."""
    proxy = await _proxy(make_proxy, script)
    text = " ".join(f"w{i}" for i in range(300))
    answer = {
        "id": "m", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "a"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "text", "text": text},
        ],
        "stop_reason": "end_turn", "stop_sequence": None,
    }  # fmt: skip
    script.plan = Plan(chunks=[json.dumps(answer).encode()])
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    status, body = await _post(proxy.url, "/v1/messages", _claude(tools=[search]), "nousage")
    assert status == 200, body
    entry = await _entry(redis_client)
    assert int(entry["reserved_output_tokens"]) == 400, entry
    assert int(entry["output_tokens"]) > 100, entry
