"""Fuzzed Responses and Messages bodies (their items, blocks, tools and options, each of any JSON
shape): never a 500 nor a traceback, a refused body reaches no upstream, a forwarded one leaves
exactly one ledger entry. The chat, completions and embeddings bodies are fuzzed in
``test_bad_input``; these were added by the refusals hunt, which ran 1,500 examples of each."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.test_bad_input import FUZZ, JSON_VALUES, NOT_FAKE, SCALARS, send
from tests.test_dialects import both_with

ANY = JSON_VALUES
ITEM = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            [
                "message",
                "function_call",
                "function_call_output",
                "reasoning",
                "item_reference",
                "input_text",
                "code_interpreter_call",
                "shell_call",
                "image_generation_call",
                "compaction",
                "web_search_call",
            ]
        )
        | SCALARS
    },
    optional={
        "role": SCALARS | st.just("user"),
        "content": ANY,
        "id": SCALARS,
        "arguments": ANY,
        "output": ANY,
        "summary": ANY,
        "encrypted_content": SCALARS,
        "container_id": SCALARS,
        "action": ANY,
        "name": SCALARS,
        "environment": ANY,
    },
)
RESP_FIELDS = {
    "input": st.text(max_size=10) | st.lists(ITEM | ANY, max_size=3),
    "instructions": ANY,
    "max_output_tokens": st.integers(-2, 100) | ANY,
    "stream": st.booleans(),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(
                    [
                        "function",
                        "web_search",
                        "file_search",
                        "code_interpreter",
                        "image_generation",
                        "shell",
                        "mcp",
                    ]
                )
                | SCALARS
            },
            optional={"container": ANY, "max_uses": ANY, "name": SCALARS, "parameters": ANY},
        )
        | ANY,
        max_size=2,
    ),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": SCALARS, "summary": SCALARS}) | ANY,
    "text": st.fixed_dictionaries({}, optional={"format": ANY}) | ANY,
    "previous_response_id": SCALARS,
    "conversation": ANY,
    "prompt": ANY,
    "max_tool_calls": ANY,
    "service_tier": SCALARS,
    "store": ANY,
    "n": ANY,
    "context_management": ANY,
    "include": ANY,
}
BLOCK = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            [
                "text",
                "image",
                "document",
                "tool_use",
                "tool_result",
                "thinking",
                "redacted_thinking",
                "server_tool_use",
                "web_search_tool_result",
                "container_upload",
                "search_result",
                "compaction",
            ]
        )
        | SCALARS
    },
    optional={
        "text": ANY,
        "input": ANY,
        "content": ANY,
        "source": ANY,
        "thinking": ANY,
        "name": ANY,
        "id": SCALARS,
        "data": ANY,
    },
)
MSG = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]) | SCALARS,
        "content": st.text(max_size=10) | st.lists(BLOCK | ANY, max_size=3) | ANY,
    }
)
MESSAGES_FIELDS = {
    "messages": st.lists(MSG | ANY, max_size=3) | ANY,
    "max_tokens": st.integers(-2, 100) | ANY,
    "system": st.text(max_size=5) | st.lists(BLOCK, max_size=2) | ANY,
    "stream": st.booleans(),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(
                    [
                        "custom",
                        "web_search_20250305",
                        "bash_20250124",
                        "text_editor_20250124",
                        "computer_20250124",
                        "code_execution_20250825",
                        "web_fetch_20250910",
                    ]
                )
                | SCALARS
            },
            optional={"name": SCALARS, "input_schema": ANY, "max_uses": ANY},
        )
        | ANY,
        max_size=2,
    ),
    "thinking": st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive"]) | SCALARS},
        optional={"budget_tokens": ANY},
    )
    | ANY,
    "container": ANY,
    "context_management": ANY,
    "mcp_servers": ANY,
    "speed": SCALARS,
    "inference_geo": SCALARS,
    "output_config": ANY,
    "output_format": ANY,
    "service_tier": SCALARS,
    "tool_choice": ANY,
    "metadata": ANY,
}


@st.composite
def bodies(draw: st.DrawFn, model: str, fields: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    body.update(
        draw(st.dictionaries(NOT_FAKE.filter(lambda k: k not in fields and k != "model"), ANY, max_size=1))
    )
    for name, strategy in fields.items():
        if name in required or draw(st.integers(0, 3)) == 0:
            body[name] = draw(strategy)
    return body


@pytest.fixture
async def both(make_proxy: ProxyFactory, fake: FakeUpstream) -> Proxy:
    return await both_with(make_proxy, fake, timeout_s=2)


def _no_500(reply: Any) -> None:
    assert b"Traceback" not in reply.body, reply.describe()
    if reply.upstream_calls == 0:
        assert 400 <= reply.status < 500, reply.describe()
    else:
        assert reply.ledger_growth == 1, reply.describe()
        assert reply.status != 500 or b"server_error" not in reply.body, reply.describe()


@settings(FUZZ, max_examples=100)
@given(body=bodies("gpt-4o-mini", RESP_FIELDS, ("input",)))
async def test_fuzz_responses_bodies(
    both: Proxy, fake: FakeUpstream, redis_client: Any, body: dict[str, Any]
) -> None:
    reply = await send(both, lambda: fake.received, redis_client, "/v1/responses", json.dumps(body).encode())
    _no_500(reply)


@settings(FUZZ, max_examples=100)
@given(body=bodies("claude-sonnet-4", MESSAGES_FIELDS, ("messages", "max_tokens")))
async def test_fuzz_messages_bodies(
    both: Proxy, fake: FakeUpstream, redis_client: Any, body: dict[str, Any]
) -> None:
    reply = await send(both, lambda: fake.received, redis_client, "/v1/messages", json.dumps(body).encode())
    _no_500(reply)
