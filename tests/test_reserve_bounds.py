"""The reserve is the worst case the provider can bill: request shapes that had been reserved
below it (Anthropic's threshold compaction, video and audio by URL, a stored prompt's template)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import ledger_entries
from tests.test_bad_input import Plan, ScriptedUpstream, assert_refused, dumps, scripted_upstreams, send
from tests.test_budgets import meters, tiers
from tests.test_stream_dialects import proxy_for

# Anthropic's threshold compaction (context_management edit compact_20260112, beta header
# compact-2026-01-12): when the input reaches the trigger (50,000 tokens at the least), Claude
# first runs a summarizing step over the whole input, then answers from the summary. The
# summarizing step is billed on top of the answer (usage.iterations, type "compaction"; the
# documented example: 180,000 input and 3,500 output tokens beside the answer's 23,000 and 1,000).
TEXT = "word " * 12000  # 60,000 bytes: above the least trigger as the proxy counts it (bytes)
COMPACTING = {
    "model": "claude-x",
    "max_tokens": 4096,
    "messages": [{"role": "user", "content": TEXT}],
    "context_management": {
        "edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50000}}]
    },
}
# What the proxy reserves for it (no tokenizer: the UTF-8 bytes; one message: 4 * 2 + 3).
RESERVED_INPUT = len(TEXT) + 11


def compacted_answer(read: int) -> dict[str, Any]:
    """The answer as Anthropic bills it: the summarizing step read the whole request (``read``
    tokens), the answer the summary and the last turn."""
    usage = {
        "input_tokens": 3000,
        "output_tokens": 1000,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "iterations": [
            {"type": "compaction", "input_tokens": read, "output_tokens": 3500,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            {"type": "message", "input_tokens": 3000, "output_tokens": 1000,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        ],
    }  # fmt: skip
    return {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
        "stop_reason": "end_turn", "stop_sequence": None, "usage": usage,
        "content": [{"type": "compaction", "content": "Summary."}, {"type": "text", "text": "Go on."}],
    }  # fmt: skip


async def test_a_compacting_messages_call_reserves_what_its_compaction_step_bills(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """The compaction step reads the whole request again, and writes a summary: billed as input
    and output beside the answer's own. Reserved at the request's input and max_tokens once,
    the call is billed past its reserve by design of the request, not by chance."""
    proxy = await proxy_for(make_proxy, script)
    script.plan = Plan(chunks=[dumps(compacted_answer(RESERVED_INPUT))])
    headers = {"anthropic-beta": "compact-2026-01-12", "X-Run-Id": "compacting"}
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/messages", dumps(COMPACTING), headers=headers
    )
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    billed = (int(entry["input_tokens"]), int(entry["output_tokens"]))
    assert billed == (RESERVED_INPUT + 3000, 4500), entry
    reserved = (int(entry["reserved_input_tokens"]), int(entry["reserved_output_tokens"]))
    assert billed[0] <= reserved[0] and billed[1] <= reserved[1], (billed, reserved)
    assert entry["overshoot_tokens"] == "0", entry


async def test_concurrent_compacting_calls_do_not_pass_a_ceiling(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Two such calls at once, under a run ceiling that holds two of their reserves: both are
    let through, and together they pass the ceiling by what their compaction steps billed."""
    ceiling = 2 * (RESERVED_INPUT + 4096)
    proxy = await proxy_for(make_proxy, script, tiers=tiers(run={"total_tokens": ceiling}))
    script.plan = Plan(chunks=[dumps(compacted_answer(RESERVED_INPUT))], delay_s=1.0)
    headers = {"anthropic-beta": "compact-2026-01-12", "X-Run-Id": "compacting-run"}
    replies = await asyncio.gather(
        *(
            send(
                proxy,
                lambda: script.received,
                redis_client,
                "/v1/messages",
                dumps(COMPACTING),
                headers=headers,
            )
            for _ in range(2)
        )
    )
    statuses = sorted(r.status for r in replies)
    state = (await meters(proxy, "compacting-run"))["meters"]
    assert state["total_tokens"]["used"] <= ceiling, (statuses, state["total_tokens"])


# -- media parts of OpenAI-compatible servers ---------------------------------------------------

MEDIA_MODELS = {
    "gpt-4o-mini": {"upstream": "openai", "max_output_tokens": 1000, "media_part_input_tokens": 1000},
    "*": {"upstream": "openai"},
}


@pytest.mark.parametrize(
    "part",
    [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + "A" * 400}},
        {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
    ],
    ids=["video_url", "audio_url"],
)
async def test_video_and_audio_url_parts_are_reserved_as_media(
    make_proxy: ProxyFactory, fake: FakeUpstream, part: dict[str, Any]
) -> None:
    """vLLM and SGLang (OpenAI-compatible servers this proxy names) take video and audio by URL in
    chat content parts, and bill their frames and samples as prompt tokens, thousands for a short
    clip. With ``media_part_input_tokens`` set, an image part reserves it; these reserved nothing,
    so the clip's tokens were all overshoot."""
    proxy = await make_proxy(models=MEDIA_MODELS)
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "clip"}
    payload = {
        "model": "gpt-4o-mini",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what happens?"}, part]}],
        # What the server bills for the text and the clip: within the model's media bound.
        "fake": {"usage": {"prompt_tokens": 900}},
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=payload, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    (entry,) = await ledger_entries(proxy, "clip")
    assert int(entry["input_tokens"]) <= int(entry["reserved_input_tokens"]), entry
    assert int(entry["reserved_input_tokens"]) > 1000, entry


# -- Responses input the provider keeps and the request only names ------------------------------


async def responses_call(proxy: Any, run: str, named: dict[str, Any], billed_input: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
    payload = {
        "model": "gpt-4o-mini",
        "max_output_tokens": 16,
        **named,
        "fake": {"usage": {"input_tokens": billed_input}},
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/responses", json=payload, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    (entry,) = await ledger_entries(proxy, run)
    return entry


async def test_a_stored_prompts_template_is_reserved_once_billed(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A stored prompt (``prompt: {id, version, variables}``) is a template the provider keeps:
    its instructions, messages and tools are input it bills on every call, and the request
    carries only the id. A previous response or a conversation billed here is reserved at its
    kept size on the next call; a stored prompt, billed here a moment ago, stays reserved at its
    variables alone, call after call: every call under a ceiling passes it by the template."""
    proxy = await make_proxy()
    named = {"prompt": {"id": "pmpt_support_agent", "version": "3", "variables": {"customer": "Ada"}}}
    first = await responses_call(proxy, "tpl-1", named, 5000)  # unknown yet: billed, overshoot
    assert first["input_tokens"] == "5000", first
    second = await responses_call(proxy, "tpl-2", named, 5000)
    assert int(second["input_tokens"]) <= int(second["reserved_input_tokens"]), second


async def test_a_stored_prompt_is_not_reserved_at_a_whole_conversation_that_named_it(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A stored prompt's size is kept "at what the last call that used it billed" (README). A
    call on a long conversation that names it bills the conversation too (20,000 tokens here);
    that figure was kept as the template's, never lowered, and every fresh call naming the
    prompt (a new conversation, "hi") was then reserved at that whole conversation: refused
    under a run ceiling of 5,000 tokens that its real cost (a few hundred) is far within."""
    proxy = await make_proxy(tiers=tiers(run={"total_tokens": 5000}))
    fake.contexts["conv_long"] = 20000  # a conversation this proxy has not billed yet
    named = {"prompt": {"id": "pmpt_support_agent", "version": "3", "variables": {"customer": "Ada"}}}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession() as session:
        on_long = {"model": "gpt-4o-mini", "max_output_tokens": 16, "conversation": "conv_long", **named}
        async with session.post(
            proxy.url + "/v1/responses", json=on_long, headers={**headers, "X-Run-Id": "long"}
        ) as resp:
            assert resp.status == 200, await resp.text()
        fresh = {"model": "gpt-4o-mini", "max_output_tokens": 16, "input": "hi", **named}
        async with session.post(
            proxy.url + "/v1/responses", json=fresh, headers={**headers, "X-Run-Id": "fresh"}
        ) as resp:
            assert resp.status == 200, await resp.text()  # was: 429, reserved at 20,000+
    [entry] = await ledger_entries(proxy, "fresh")
    assert int(entry["input_tokens"]) < 1000, entry


# -- vLLM's prompt embeddings: prompts the request does not show as text or token ids -----------


def vllm_answer(prompts: int, max_tokens: int, embed_rows: int) -> dict[str, Any]:
    """What vLLM answers a completion of ``prompts`` prompts, each written to its cap: its usage
    counts the rows of every embeddings tensor as prompt tokens."""
    choices = [
        {"index": i, "text": "word " * max_tokens, "logprobs": None, "finish_reason": "length"}
        for i in range(prompts)
    ]
    usage = {"prompt_tokens": prompts * embed_rows, "completion_tokens": prompts * max_tokens}
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices, "usage": usage}


async def test_a_completion_with_prompt_embeddings_is_refused_not_reserved_as_one_prompt(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """vLLM (``--enable-prompt-embeds``) takes ``prompt_embeds``: base64 tensors, each one more
    prompt beside ``prompt``'s, answered n times up to ``max_tokens``, its rows billed as input.
    Reserved as the one empty prompt ``prompt: null`` is (0 input, 50 output), ten tensors passed
    a 100-token run ceiling by 20,400 tokens: 500 output and 20,000 input the reserve never held."""
    proxy = await proxy_for(make_proxy, script, tiers=tiers(run={"total_tokens": 100}))
    script.plan = Plan(chunks=[dumps(vllm_answer(prompts=10, max_tokens=50, embed_rows=2000))])
    tensor = base64.b64encode(b"PK\x03\x04" + bytes(64)).decode()  # a torch.save zip, in short
    body = {"model": "m", "prompt": None, "prompt_embeds": [tensor] * 10, "max_tokens": 50}
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/completions",
        dumps(body),
        headers={"X-Run-Id": "embeds"},
    )
    error = assert_refused(reply, 400)  # was: forwarded, 20,500 tokens billed past the ceiling
    assert (error["param"], error["code"]) == ("prompt_embeds", "unsupported_parameter")


async def test_scoring_prompts_on_vllm_reserves_the_token_it_writes_for_each(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """``echo`` with ``max_tokens: 0`` scores the prompts (lm-eval-harness's loglikelihood
    requests). vLLM runs it as ``max_tokens: 1`` and bills that token for every answer
    (``completion_tokens`` counts each output's tokens) while it returns the prompt alone: reserved
    at 0 output, each such call passed its reserve by a token per prompt."""
    proxy = await proxy_for(make_proxy, script)
    prompts = ["the cat sat", "on the mat", "a dog ran", "far away"]
    choices = [
        {"index": i, "text": p, "logprobs": None, "finish_reason": "length"} for i, p in enumerate(prompts)
    ]
    usage = {"prompt_tokens": 12, "completion_tokens": len(prompts), "total_tokens": 12 + len(prompts)}
    answer = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices, "usage": usage}
    script.plan = Plan(chunks=[dumps(answer)])
    body = {"model": "m", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/completions",
        dumps(body),
        headers={"X-Run-Id": "score"},
    )
    assert reply.status == 200, reply.describe()
    (entry,) = reply.new_entries
    assert entry["output_tokens"] == "4", entry
    assert int(entry["reserved_output_tokens"]) >= 4, entry  # was 0
    assert entry["overshoot_tokens"] == "0", entry
    assert b'"max_tokens":0' in script.received[-1]  # forwarded as asked


# -- what an OpenAI-compatible server tokenizes beyond the texts the proxy counts --------------


async def billed_and_reserved(proxy: Any, path: str, run: str, body: dict[str, Any]) -> tuple[int, int]:
    """Post ``body`` (its ``fake.usage`` is what the server bills) and read its ledger entry."""
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": run}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + path, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    (entry,) = await ledger_entries(proxy, run)
    return int(entry["input_tokens"]), int(entry["reserved_input_tokens"])


async def test_a_custom_role_is_reserved_as_the_prompt_text_it_is(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """vLLM takes any string as a message's role (``CustomChatCompletionMessageParam``: "Enables
    custom roles in the Chat Completion API"), and a chat template such as Llama 3's writes it
    into the prompt (``'<|start_header_id|>' + message['role'] + '<|end_header_id|>'``), billed as
    input. The role was never counted: a 9,000-byte role, ~2,000 tokens billed, reserved at the
    9 of the message's "hi" and its overhead, past any ceiling by the role's whole length."""
    proxy = await make_proxy()
    body = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "max_tokens": 5,
        "messages": [{"role": "narrator " * 1000, "content": "hi"}],
        "fake": {"usage": {"prompt_tokens": 2010}},  # the role's ~2,000 tokens and the template's
    }
    billed, reserved = await billed_and_reserved(proxy, "/v1/chat/completions", "role", body)
    assert billed == 2010
    assert billed <= reserved, (billed, reserved)  # was reserved at 9


@pytest.mark.parametrize(
    ("path", "body", "billed"),
    [
        # A BERT embedding model on vLLM or TEI: [CLS] a [SEP], 3 tokens an input (was 4,095).
        ("/v1/embeddings", {"model": "BAAI/bge-small-en-v1.5", "input": ["a"] * 2048}, 3 * 2048),
        # e5-mistral on vLLM: <s>, SentencePiece's word-start piece, the byte of a character
        # outside its vocabulary, </s>: 4 tokens an input of one byte (was 4,095).
        ("/v1/embeddings", {"model": "intfloat/e5-mistral-7b-instruct", "input": ["\x7f"] * 2048}, 4 * 2048),
        # Llama 2 on vLLM: <s> and "▁a" for each prompt (was 199).
        (
            "/v1/completions",
            {"model": "meta-llama/Llama-2-7b-hf", "prompt": ["a"] * 100, "max_tokens": 1},
            200,
        ),
        # OpenAI: a prompt left null is "<|endoftext|>", one token (was 0).
        ("/v1/completions", {"model": "gpt-3.5-turbo-instruct", "prompt": None, "max_tokens": 1}, 1),
    ],
    ids=["bert-embeddings", "sentencepiece-embeddings", "llama-2-prompts", "null-prompt"],
)
async def test_the_special_tokens_a_server_adds_to_each_input_are_reserved(
    make_proxy: ProxyFactory, fake: FakeUpstream, path: str, body: dict[str, Any], billed: int
) -> None:
    """An embeddings input and a legacy completion's prompt are each tokenized on their own,
    with the special tokens the model's tokenizer adds (BOS or [CLS], EOS or [SEP]) and, for a
    SentencePiece model, the word-start piece in front: none of them in the text's UTF-8 bytes.
    Reserved at the bytes alone, a batch of short inputs was billed up to twice its reserve."""
    proxy = await make_proxy()
    body = {**body, "fake": {"usage": {"prompt_tokens": billed}}}
    got, reserved = await billed_and_reserved(proxy, path, "specials", body)
    assert got == billed
    assert billed <= reserved, (billed, reserved)


@pytest.mark.parametrize(
    "extra",
    [
        # vLLM's RAG documents: a template that reads them (Command R, Granite) writes them out.
        {"documents": [{"title": "Manual", "text": "Press the red button twice. " * 300}]},
        # vLLM's template arguments: a template may write any of them into the prompt.
        {"chat_template_kwargs": {"system_note": "Always answer in formal English. " * 300}},
    ],
    ids=["documents", "chat_template_kwargs"],
)
async def test_what_a_vllm_chat_template_writes_from_the_request_is_reserved(
    make_proxy: ProxyFactory, fake: FakeUpstream, extra: dict[str, Any]
) -> None:
    """vLLM's chat requests take ``documents`` and ``chat_template_kwargs``, handed to the model's
    chat template, which writes what it reads of them into the prompt, billed as input. Neither
    was counted: ~1,800 tokens billed for a call reserved at the 9 of its message."""
    proxy = await make_proxy()
    body = {
        "model": "CohereForAI/c4ai-command-r-v01",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
        "fake": {"usage": {"prompt_tokens": 1810}},
    }
    billed, reserved = await billed_and_reserved(proxy, "/v1/chat/completions", "template", body)
    assert billed == 1810
    assert billed <= reserved, (billed, reserved)


@pytest.mark.parametrize("where", ["chat_template", "chat_template_kwargs"])
async def test_a_requests_own_chat_template_is_refused_before_anything_is_reserved(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis, where: str
) -> None:
    """vLLM renders a request's own ``chat_template`` (Jinja) when it trusts request templates:
    a loop of a few bytes writes a prompt of any length, billed as input, which no count of the
    request can bound. It went out reserved at its messages. vLLM takes the template from
    ``chat_template_kwargs`` as well (handed on to the tokenizer's ``apply_chat_template``, and
    refused by vLLM's own untrusted-template check alike): that went out reserved at the JSON."""
    proxy = await proxy_for(make_proxy, script)
    template = "{% for i in range(100000) %}word {% endfor %}"
    sent = {"chat_template": template} if where == "chat_template" else {where: {"chat_template": template}}
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        **sent,
    }
    reply = await send(
        proxy,
        lambda: script.received,
        redis_client,
        "/v1/chat/completions",
        dumps(body),
        headers={"X-Run-Id": "tpl"},
    )
    error = assert_refused(reply, 400)  # was: forwarded, reserved at 9 input tokens
    assert (error["param"], error["code"]) == (where, "unsupported_parameter")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100}),
    ],
)
@pytest.mark.parametrize("n_predict", [4000, -1])
async def test_llama_cpps_n_predict_is_refused_not_let_past_the_reserved_output_cap(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    path: str,
    body: dict[str, Any],
    n_predict: int,
) -> None:
    """llama.cpp's server reads its output cap from ``n_predict`` before ``max_tokens`` (-1: until
    the context is full), on chat and legacy completions alike. A call reserved at the model's 300
    (and sent ``max_tokens: 300``) went out with ``n_predict`` as sent, and the server wrote and
    billed 4,000 tokens against a run ceiling of 300 (the caps hunt). A null one is unset, as
    llama.cpp reads it: forwarded."""
    upstreams = scripted_upstreams(script.base_url)
    upstreams["openai"]["chat_output_cap_field"] = "max_tokens"  # as the README says for llama.cpp
    proxy = await make_proxy(
        upstreams=upstreams,
        models={"*": {"upstream": "openai", "max_output_tokens": 300}},
        tiers=tiers(run={"output_tokens": 300}),
    )
    request = {"model": "m", **body, "n_predict": n_predict}
    reply = await send(proxy, lambda: script.received, redis_client, path, dumps(request))
    error = assert_refused(reply, 400)  # was: forwarded, 4,000 output tokens billed
    assert (error["param"], error["code"]) == ("n_predict", "unsupported_parameter")
    unset = {"model": "m", **body, "n_predict": None}
    reply = await send(proxy, lambda: script.received, redis_client, path, dumps(unset))
    assert reply.upstream_calls == 1, reply.describe()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
async def test_a_list_of_fallback_models_is_refused_not_routed_as_its_first(
    make_proxy: ProxyFactory,
    script: ScriptedUpstream,
    redis_client: aioredis.Redis,
    path: str,
    body: dict[str, Any],
) -> None:
    """OpenRouter's ``models``: when the first model errs (a rate limit, a context too long, which
    a caller can provoke) the next one runs, billed at its own price. Routed, reserved and priced
    as ``model`` alone, it reached a model the proxy does not serve (a 404 named in ``model``),
    billed at the cheap model's prices (the request fuzzing hunt). A list of ``model`` alone
    changes nothing and goes as it came."""
    proxy = await proxy_for(make_proxy, script)
    for models in (["m", "o1-pro"], ["o1-pro"], "o1-pro", {"m": 1}, []):
        request = {"model": "m", "models": models, **body}
        reply = await send(proxy, lambda: script.received, redis_client, path, dumps(request))
        if models == []:
            assert reply.upstream_calls == 1, models  # no fallback named: forwarded as it came
            continue
        error = assert_refused(reply, 400)
        assert (error["param"], error["code"]) == ("models", "unsupported_parameter"), models
    same = {"model": "m", "models": ["m"], **body}
    await send(proxy, lambda: script.received, redis_client, path, dumps(same))
    assert json.loads(script.received[-1])["models"] == ["m"]


ENCRYPTED = "gAAAAB" + "Qk" * 4000  # 8,006 bytes of context no tokenizer reads
SENT_BACK: dict[str, list[dict[str, Any]]] = {
    # Server-side compaction's item, sent back by a stateless client: the earlier conversation.
    "compaction": [{"id": "cmp_1", "type": "compaction", "encrypted_content": ENCRYPTED}],
    # A function-calling turn of a reasoning model, store false: reasoning, call, its output.
    "reasoning": [
        {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": ENCRYPTED},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ],
}


@pytest.mark.parametrize("kind", sorted(SENT_BACK))
async def test_encrypted_context_sent_back_is_reserved_at_its_bytes(
    make_proxy: ProxyFactory, fake: FakeUpstream, kind: str
) -> None:
    """What a Responses input sends back encrypted (a compaction item, a reasoning item's
    encrypted_content) the provider reads, and bills, as input; reserved as no text, a call
    fitted a run's input ceiling of 1,500 and was billed 2,000 (the Responses hunt). Reserved at
    its bytes, as Anthropic's encrypted search results are: refused, nothing forwarded."""
    import openai

    proxy = await make_proxy(tiers={"standard": {"run": {"input_tokens": 1500}}})
    client = proxy.client(default_headers={"X-Run-Id": f"enc-{kind}"})
    with pytest.raises(openai.RateLimitError) as refused:
        await client.responses.create(
            model="gpt-4o-mini",
            input=[*SENT_BACK[kind], {"role": "user", "content": "go on"}],  # type: ignore[arg-type]
            store=False,
            include=["reasoning.encrypted_content"],
            max_output_tokens=16,
            extra_body={"fake": {"usage": {"input_tokens": 2000}}},
        )
    assert "input_tokens" in str(refused.value)
    assert fake.received == []
