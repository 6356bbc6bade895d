"""How many answers a request asks for: read from ``n`` (and ``best_of``) only where the API has
them; anywhere else a field of that name passes through, whatever its type."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from proxy.errors import BadRequest
from proxy.payload import Endpoint, answers, generations, parse_body
from tests.conftest import ProxyFactory
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, send
from tests.test_budgets import tiers
from tests.test_stream_dialects import proxy_for


def view_of(endpoint: Endpoint, body: dict[str, Any]) -> object:
    return parse_body(orjson.dumps(body), endpoint)[1]


@pytest.mark.parametrize("n", [{"": None}, [1, 2], "many", 2.5, 3])
@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("embeddings", {"model": "e", "input": "hi"}),
        ("responses", {"model": "m", "input": "hi"}),
        ("messages", {"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_n_outside_chat_and_completions_is_one_answer(
    endpoint: Endpoint, body: dict[str, Any], n: Any
) -> None:
    view = view_of(endpoint, {**body, "n": n})
    assert answers(view) == 1
    assert generations(view) == 1


def test_n_and_best_of_where_the_api_has_them() -> None:
    chat = view_of("chat.completions", {"model": "m", "n": 3, "messages": [{"role": "user", "content": "x"}]})
    assert (answers(chat), generations(chat)) == (3, 3)
    legacy = view_of("completions", {"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 5})
    assert (answers(legacy), generations(legacy)) == (4, 10)


# -- prompt text: every string the provider reads is in the reserve -----------------------------

DOC = "word " * 2000  # about 2,000 tokens
IMAGE = "data:image/png;base64," + "iVBORw0KGgo" * 5000
USER = {"role": "user", "content": "hi"}

# Each case hides DOC where an estimate reading only the usual fields did not look.
UNREAD_BEFORE: dict[str, tuple[str, dict[str, Any]]] = {
    "chat refusal part": (
        "/v1/chat/completions",
        {"messages": [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": DOC}]}]},
    ),
    "responses custom tool call input": (
        "/v1/responses",
        {"input": [USER, {"type": "custom_tool_call", "call_id": "c1", "name": "code", "input": DOC}]},
    ),
    "responses function call output as parts": (
        "/v1/responses",
        {
            "input": [
                USER,
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_text", "text": DOC}],
                },
            ]
        },
    ),
    "responses refusal part": (
        "/v1/responses",
        {
            "input": [
                {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": DOC}]}
            ]
        },
    ),
    "responses code interpreter code": (
        "/v1/responses",
        {"input": [USER, {"type": "code_interpreter_call", "id": "ci", "code": DOC, "outputs": []}]},
    ),
    "responses mcp tool list": (
        "/v1/responses",
        {"input": [{"type": "mcp_list_tools", "id": "m", "tools": [{"name": "t", "description": DOC}]}]},
    ),
    "responses reasoning summary": (
        "/v1/responses",
        {"input": [{"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": DOC}]}]},
    ),
    "anthropic thinking block": (
        "/v1/messages",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": [{"type": "thinking", "thinking": DOC, "signature": "s"}]},
            ]
        },
    ),
    "anthropic plain-text document": (
        "/v1/messages",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": DOC},
                        }
                    ],
                }
            ]
        },
    ),
}


def _estimate_input_tokens(path: str, body: dict[str, Any]) -> int:
    from proxy.estimate import counted, estimate
    from proxy.tokenizer import Tokenizer

    endpoints: dict[str, Endpoint] = {
        "/v1/chat/completions": "chat.completions",
        "/v1/responses": "responses",
        "/v1/messages": "messages",
    }
    endpoint = endpoints[path]
    _, view = parse_body(orjson.dumps({"model": "m", "max_tokens": 5, **body}), endpoint)
    tokenizer = Tokenizer({})
    est = estimate(
        endpoint,
        view,
        encoding="o200k_base",
        tokenizer=tokenizer,
        model_max_output_tokens=None,
        default_max_output_tokens=16,
    )
    return counted(est, tokenizer, "o200k_base").input_tokens


@pytest.mark.parametrize("case", list(UNREAD_BEFORE))
def test_text_in_any_field_of_a_prompt_is_reserved(case: str) -> None:
    path, body = UNREAD_BEFORE[case]
    assert _estimate_input_tokens(path, body) >= 2000


def test_media_payloads_ids_and_signatures_are_not_counted_as_text() -> None:
    # Media are priced per part (media_part_input_tokens); their base64 is not prompt text.
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": IMAGE},
                    {"type": "input_text", "text": "hi"},
                ],
            },
            {"type": "image_generation_call", "id": "ig", "status": "completed", "result": IMAGE[22:]},
            {"type": "function_call_output", "call_id": "c" * 5000, "output": "ok"},
        ]
    }
    assert _estimate_input_tokens("/v1/responses", body) < 200
    anthropic = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "base64", "data": IMAGE[22:]}}],
            },
        ]
    }
    assert _estimate_input_tokens("/v1/messages", anthropic) < 200


def test_encrypted_input_the_provider_reads_again_is_reserved_at_its_bytes() -> None:
    # A reasoning item's encrypted_content, a redacted thinking block's data: read as input by the
    # provider (within a tool-use turn), by no tokenizer here (the Responses hunt).
    blob = IMAGE[22:]
    body = {"input": [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": blob}]}
    assert _estimate_input_tokens("/v1/responses", body) >= len(blob)
    redacted = {"role": "assistant", "content": [{"type": "redacted_thinking", "data": blob}]}
    assert _estimate_input_tokens("/v1/messages", {"messages": [redacted]}) >= len(blob)


def test_a_tool_calls_json_input_is_counted_with_its_keys() -> None:
    body = {
        "messages": [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {DOC: 1}}],
            }
        ]
    }
    assert _estimate_input_tokens("/v1/messages", body) >= 2000


def test_a_tool_schema_among_the_items_is_counted_with_its_property_names() -> None:
    """An MCP tool list passed back (stateless clients do): its schema's property names are
    keys, and the schema is what the model reads of the tool."""
    names = [f"customer_shipping_address_field_number_{i}" for i in range(150)]
    schema = {"type": "object", "properties": {name: {"type": "string"} for name in names}}
    listed = {
        "type": "mcp_list_tools",
        "id": "m",
        "server_label": "crm",
        "tools": [{"name": "update", "input_schema": schema}],
    }
    body = {"input": [listed, {"role": "user", "content": "go"}]}
    assert _estimate_input_tokens("/v1/responses", body) >= len(orjson.dumps(schema))


def test_an_anthropic_document_of_content_blocks_is_counted_with_its_title_and_context() -> None:
    # Only a plain-text source was read: content blocks, a title and a context went unreserved.
    from proxy.prompt_parts import prompt_texts

    document = {
        "type": "document",
        "source": {"type": "content", "content": [{"type": "text", "text": "DOC BODY"}]},
        "title": "TITLE",
        "context": "CONTEXT",
    }
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"},
    }
    texts = prompt_texts([{"role": "user", "content": [document, pdf]}])
    assert texts == ["TITLE", "CONTEXT", "DOC BODY"]


def test_anthropic_search_results_in_the_history_are_reserved_at_their_encrypted_length() -> None:
    """Their page text is billed as input again in later turns, and travels encrypted: its
    length in bytes is the bound (no tokenizer reads it)."""
    results = [
        {
            "type": "web_search_result",
            "url": f"https://e.com/{i}",
            "title": "t",
            "encrypted_content": "E" * 8000,
        }
        for i in range(5)
    ]
    assistant = [
        {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"query": "news"}},
        {"type": "web_search_tool_result", "tool_use_id": "s1", "content": results},
        {"type": "text", "text": "Here."},
    ]
    messages = [
        {"role": "user", "content": "news?"},
        {"role": "assistant", "content": assistant},
        {"role": "user", "content": "more?"},
    ]
    assert _estimate_input_tokens("/v1/messages", {"messages": messages}) >= 5 * 8000


# -- compaction: the summarizing step's own prompt, and the step itself -------------------------

# The beta's compaction request (anthropic 2.17, top-level ``compaction``, BetaCompactionConfigParam:
# ``{"type": "summarize", "instructions": ...}``): the conversation is summarized, ``instructions``
# replacing the server's summarization prompt, text the summarizing model reads as input, as a
# ``compact_*`` edit's ``instructions`` are.
SUMMARIZE_INSTRUCTIONS = "word " * 8000  # 40,000 bytes, about 8,000 tokens


async def test_a_compaction_requests_own_instructions_are_reserved(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """A run ceiling of 5,000 tokens: the request alone reads 8,000 (its instructions), so it is
    refused (its reserve does not fit) or reserved at them. It was reserved at the message and
    max_tokens (1,021), forwarded, and billed 8,521 under that ceiling (the params hunt)."""
    proxy = await proxy_for(make_proxy, script, tiers=tiers(run={"total_tokens": 5000}))
    body = {
        "model": "claude-x",
        "max_tokens": 1000,
        "messages": [{"role": "user", "content": "Summarize."}],
        "compaction": {"type": "summarize", "instructions": SUMMARIZE_INSTRUCTIONS},
    }
    # What the provider reads: the message (no tokenizer here: its bytes and 11 tokens of
    # framing) and the instructions' 8,000 tokens.
    usage = {
        "input_tokens": len("Summarize.") + 11 + 8000, "output_tokens": 500,
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
    }  # fmt: skip
    message = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
        "stop_reason": "compaction", "stop_sequence": None, "usage": usage,
        "content": [{"type": "compaction", "content": "Summary of the conversation."}],
    }  # fmt: skip
    script.plan = Plan(chunks=[dumps(message)])
    headers = {"anthropic-beta": "compact-2026-01-12", "X-Run-Id": "summarize"}
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body), headers=headers
    )
    assert (reply.status, reply.upstream_calls) == (429, 0), reply.describe()


# OpenAI's server-side compaction (openai 3.63, ResponseCreateParams.context_management:
# ``[{"type": "compaction", "compact_threshold": N}]``): "if the context size crosses the threshold,
# the server triggers a compaction pass ... and prunes context before continuing inference" (its
# guide). The pass reads the whole context again, the input and what was written before it, and
# the inference goes on from its summary.
COMPACT_TEXT = "word " * 12000


def _responses_answer(usage: dict[str, Any]) -> bytes:
    compaction = {"id": "cmp_1", "type": "compaction", "encrypted_content": "gAAAAB" + "x" * 200}
    answer = {
        "id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": "Done.", "annotations": [], "logprobs": []}],
    }  # fmt: skip
    response = {
        "id": "resp_1", "object": "response", "created_at": 1, "status": "completed",
        "model": "gpt-5-codex", "output": [compaction, answer], "usage": usage, "error": None,
        "incomplete_details": None, "tools": [], "parallel_tool_calls": True,
    }  # fmt: skip
    return dumps(response)


async def test_a_responses_call_with_server_side_compaction_reserves_the_compaction_pass(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The same request without compaction first, to read the input its reserve holds (N); then
    with ``compact_threshold`` below N: the first sampling reads N and writes 500 tokens, the pass
    reads those N + 500 and writes a 1,500-token summary, the inference goes on from it (1,500
    read) and writes 2,000: input 2N + 2,000, output 4,000. It was reserved at N, as a call
    reading its input once (the params hunt)."""
    proxy = await proxy_for(make_proxy, script)
    body = {"model": "gpt-5-codex", "input": COMPACT_TEXT, "max_output_tokens": 4000}
    script.plan = Plan(
        chunks=[_responses_answer({"input_tokens": 10, "output_tokens": 10, "total_tokens": 20})]
    )
    probe = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/responses",
        dumps(body),
        headers={"X-Run-Id": "probe"},
    )
    assert probe.status == 200, probe.describe()
    read = int(probe.new_entries[0]["reserved_input_tokens"])
    usage = {"input_tokens": 2 * read + 2000, "output_tokens": 4000, "total_tokens": 2 * read + 6000}
    script.plan = Plan(chunks=[_responses_answer(usage)])
    management = [{"type": "compaction", "compact_threshold": read // 2}]
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/responses",
        dumps({**body, "context_management": management}), headers={"X-Run-Id": "compacting"},
    )  # fmt: skip
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    billed = (int(entry["input_tokens"]), int(entry["output_tokens"]))
    reserved = (int(entry["reserved_input_tokens"]), int(entry["reserved_output_tokens"]))
    assert billed[0] <= reserved[0] and billed[1] <= reserved[1], entry
    assert entry.get("overshoot_tokens", "0") == "0", entry
    # Each sampling is held to the client's cap, as it came.
    assert json.loads(script.received[-1])["max_output_tokens"] == 4000


# -- Messages features that run another model, refused ----------------------------------------

MESSAGES_BODY: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [USER]}


@pytest.mark.parametrize(
    "fallbacks",
    [
        [{"model": "claude-opus-4-6", "max_tokens": 64000}],
        [{"model": "claude-sonnet-4-5", "max_tokens": 64000}],  # its own model, another cap
        "default",  # the model's own chain, which no request names
        {"model": "claude-opus-4-6"},
    ],
)
def test_anthropic_server_side_fallbacks_are_refused(fallbacks: Any) -> None:
    """A declined call is run by a fallback at its own price and its own ``max_tokens``: reserved
    at the call's model and cap, a run's ceiling was passed by what the fallback wrote (the
    Anthropic SDK hunt), as OpenRouter's ``models`` list was."""
    with pytest.raises(BadRequest) as refused:
        parse_body(orjson.dumps({**MESSAGES_BODY, "fallbacks": fallbacks}), "messages")
    assert (refused.value.param, refused.value.code) == ("fallbacks", "unsupported_parameter")


@pytest.mark.parametrize("fallbacks", [None, []])
def test_anthropic_fallbacks_naming_none_are_forwarded_as_they_came(fallbacks: Any) -> None:
    data, _view = parse_body(orjson.dumps({**MESSAGES_BODY, "fallbacks": fallbacks}), "messages")
    assert data["fallbacks"] == fallbacks


ADVISOR = {"type": "advisor_20260301", "name": "advisor", "model": "claude-opus-4-6", "max_uses": 1}


def _added(tool: dict[str, Any]) -> dict[str, Any]:
    """A user message whose ``tool_addition`` block defines ``tool`` inline (the beta's way to
    offer a tool from that point of the conversation on)."""
    addition = {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": tool}}
    return {"role": "user", "content": [addition, {"type": "text", "text": "go"}]}


def _compacted(tool: dict[str, Any]) -> dict[str, Any]:
    """A compaction block whose range added ``tool`` (its ``tool_changes``)."""
    addition = {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": tool}}
    return {"type": "compaction", "content": "Earlier turns, summed up.", "tool_changes": [addition]}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}, ADVISOR]}, "tools"),
        ({"messages": [USER, {"role": "assistant", "content": "ok"}, _added(ADVISOR)]}, "messages"),
        # Among a compaction block's tool changes, sent back with it (the second review).
        (
            {"messages": [USER, {"role": "assistant", "content": [_compacted(ADVISOR)]}, USER]},
            "messages",
        ),
    ],
)
def test_anthropic_s_advisor_tool_is_refused(extra: dict[str, Any], param: str) -> None:
    """The advisor is another model (the tool's ``model``) that reads the whole transcript and
    writes its advice mid-answer, at its own prices, told only in ``usage.iterations``: forwarded,
    its tokens went unbilled and unreserved (the Anthropic SDK hunt)."""
    with pytest.raises(BadRequest) as refused:
        parse_body(orjson.dumps({**MESSAGES_BODY, **extra}), "messages")
    assert (refused.value.param, refused.value.code) == (param, "unsupported_parameter")


@pytest.mark.parametrize(("author", "refused"), [("gpt-5.6", True), ("gpt-5.5", False), (None, False)])
def test_an_svg_author_of_another_model_is_refused(author: str | None, refused: bool) -> None:
    """The image generation tool's ``svg.model`` names the model that writes an SVG, at its own
    prices, told in the call item's ``svg_usage`` (billed at the call's model's, as the image's
    tokens are): another model's would be billed at the wrong prices (the usage hunt)."""
    svg = {} if author is None else {"model": author}
    tool = {"type": "image_generation", "output_format": "svg", "svg": svg}
    raw = orjson.dumps({"model": "gpt-5.5", "input": "draw a cat", "tools": [tool]})
    if not refused:
        assert parse_body(raw, "responses")[0]["tools"] == [tool]
        return
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, "responses")
    assert (caught.value.param, caught.value.code) == ("tools", "unsupported_parameter")


def test_tools_that_run_no_other_model_are_forwarded_as_they_came() -> None:
    """An earlier advisor's result in the history is text the call reads, the tool not enabled;
    a server tool of another type, an inline definition of one, go as they came."""
    history = [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "advisor", "input": {}},
        {"type": "advisor_tool_result", "tool_use_id": "srvtoolu_1",
         "content": {"type": "advisor_result", "text": "Plan: do it."}},
    ]  # fmt: skip
    messages = [USER, {"role": "assistant", "content": history}, _added({"type": "web_fetch_20250910"})]
    tools = [{"type": "web_search_20250305", "name": "web_search"}, {"name": "get", "input_schema": {}}]
    data, _view = parse_body(
        orjson.dumps({**MESSAGES_BODY, "messages": messages, "tools": tools}), "messages"
    )
    assert data["tools"] == tools
