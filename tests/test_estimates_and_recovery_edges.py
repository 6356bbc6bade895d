"""Tests that kill mutants of the estimate, the call plan, the contexts and the store's scripts
which the rest of the suite let live: each pins what is reserved, refused, or whose a context is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from proxy.estimate import estimate, tools_overhead
from proxy.journal_lines import DEAD_LETTERS, apply_lines, nothing
from proxy.lease import LeaseRenewal
from proxy.metrics import Metrics
from proxy.payload import ChatBody, CompletionBody, MessagesBody
from proxy.reaper import run_reaper
from proxy.redis_server import RedisServerProcess
from proxy.redis_store import RedisStore
from proxy.store import Reservation, Scope
from tests.conftest import KEY_B, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MSGS, ledger_entries
from tests.test_bad_input import Plan, ScriptedUpstream, dumps, send
from tests.test_billed_usage import chat, planned
from tests.test_budgets import _post
from tests.test_contract_edges import _claude_answer, _claude_proxy
from tests.test_estimate import _character_estimate_kwargs
from tests.test_journal import _line
from tests.test_pricing_kinds import _chat_answer, _gpt5_proxy
from tests.test_pricing_kinds import _post as priced_post
from tests.test_prior_context import CODE_TOOL, assert_not_found, containers_of
from tests.test_redis_store import reserve
from tests.test_reserve_bounds import COMPACTING, responses_call


@pytest.fixture
async def one_store(redis_server: RedisServerProcess, redis_client: object) -> AsyncIterator[RedisStore]:
    """A store on the session's Redis, flushed (no Cluster: what is pinned here is the scripts')."""
    store = RedisStore.from_url(redis_server.url)
    yield store
    await store.close()


# -- the estimate -------------------------------------------------------------------------------


def test_a_compacting_call_reserves_its_fixed_input_twice_with_its_text() -> None:
    """The summarizing step reads the whole input, the framing of each message and the tool-use
    system prompt as much as the text: a compacting call reserves twice what the same call
    without compaction does, not its text twice and its fixed part once."""
    plain_body = {k: v for k, v in COMPACTING.items() if k != "context_management"}
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    kwargs: dict[str, Any] = {**_character_estimate_kwargs(), "tools_input_tokens": 600}
    plain = estimate("messages", MessagesBody.model_validate({**plain_body, "tools": tools}), **kwargs)
    compacting = estimate("messages", MessagesBody.model_validate({**COMPACTING, "tools": tools}), **kwargs)
    assert plain.prompt_overhead_tokens > 600
    assert compacting.input_tokens == 2 * plain.input_tokens


def test_each_token_id_of_a_list_of_prompts_is_reserved() -> None:
    """Prompts given as token ids are input as text is: each id of each prompt is one token (the
    server tokenizes nothing: no special tokens beside them)."""
    kwargs = _character_estimate_kwargs()
    one = estimate("completions", CompletionBody(model="m", prompt=[[1, 2, 3]]), **kwargs)
    many = estimate("completions", CompletionBody(model="m", prompt=[[1, 2, 3], list(range(500))]), **kwargs)
    assert many.input_tokens - one.input_tokens == 500


def test_a_messages_name_is_reserved() -> None:
    """A chat message's ``name``: text the model reads (the README's "names"), reserved as
    text (4 characters a token here)."""
    kwargs = _character_estimate_kwargs()
    named = ChatBody(model="m", messages=[{"role": "user", "content": "hi", "name": "word " * 400}])
    plain = ChatBody(model="m", messages=[{"role": "user", "content": "hi"}])
    added = estimate("chat.completions", named, **kwargs).input_tokens
    assert added - estimate("chat.completions", plain, **kwargs).input_tokens >= 500


def test_anthropics_own_tools_are_reserved_by_their_versioned_type() -> None:
    """Anthropic's own tools are named by a dated type (``bash_20250124``): each adds its
    published definition to the input, found by the type's prefix."""
    tools = [{"type": "bash_20250124", "name": "bash"}, {"type": "text_editor_20250728", "name": "edit"}]
    view = MessagesBody(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert tools_overhead(view, 0) == 245 + 700


# -- the call plan ------------------------------------------------------------------------------


async def test_a_model_cap_just_above_the_thinking_budget_passes_and_one_equal_to_it_is_refused(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Anthropic takes max_tokens above thinking.budget_tokens, by one token too: a request the
    model's cap (4096) lowers to one above its budget goes out; at its budget it is a 400 here."""
    proxy = await _claude_proxy(make_proxy, script, max_output_tokens=4096)
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 16000,
        "thinking": {"type": "enabled", "budget_tokens": 4096},
        "messages": [{"role": "user", "content": "hi"}],
    }
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body))
    assert (reply.status, reply.upstream_calls) == (400, 0), reply.describe()
    script.plan = Plan(chunks=[_claude_answer(10)])
    body["thinking"]["budget_tokens"] = 4095
    reply = await send(proxy, lambda: script.received, redis_client, "/v1/messages", dumps(body))
    assert reply.status == 200, reply.describe()
    assert json.loads(script.received[-1])["max_tokens"] == 4096


async def test_an_upstream_reading_only_max_tokens_is_reserved_the_output_of_every_choice(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """``chat_output_cap_field: max_tokens`` moves the cap to the field the upstream reads; each
    of the ``n`` answers may still write up to it, and all are reserved."""
    upstream = {
        "base_url": fake.base_url,
        "api_key_env": "TEST_UPSTREAM_KEY",
        "chat_output_cap_field": "max_tokens",
    }
    proxy = await make_proxy(upstreams={"openai": upstream})
    body = {"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 10, "n": 3}
    assert await _post(proxy, "/v1/chat/completions", body, "three") == 200
    (entry,) = await ledger_entries(proxy, "three")
    assert entry["reserved_output_tokens"] == "30", entry


async def test_a_call_asking_the_auto_tier_is_reserved_at_the_dearest_priced_tier(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """``service_tier: auto`` is served by whatever tier the project defaults to (priority,
    say), as a call naming none is: a cost ceiling must hold at the dearest tier's prices."""
    proxy = await _gpt5_proxy(make_proxy, script, cost_usd="0.03")  # 30,000 micro-units
    spent = {"prompt_tokens": 0, "completion_tokens": 1_500, "total_tokens": 1_500}
    script.plan = _chat_answer("gpt-5", spent, "default")  # 15,000 spent
    request = {"model": "gpt-5", "messages": MSGS, "max_tokens": 1500, "service_tier": "default"}
    assert (await priced_post(proxy.url, "/v1/chat/completions", request, "auto"))[0] == 200
    # 1,000 output tokens more: 10,000 at the default's prices (it fits), 20,000 at priority's.
    auto = {**request, "max_tokens": 1000, "service_tier": "auto"}
    assert (await priced_post(proxy.url, "/v1/chat/completions", auto, "auto"))[0] == 429


async def test_a_stored_prompts_size_is_kept_per_version(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A stored prompt is kept "per version": a new version's template is not the old one's,
    and a call naming it is reserved at its request alone, not at what the old version billed."""
    proxy = await make_proxy()
    old = {"prompt": {"id": "pmpt_support_agent", "version": "3", "variables": {"customer": "Ada"}}}
    await responses_call(proxy, "v3", old, 5000)
    new = {"prompt": {"id": "pmpt_support_agent", "version": "4", "variables": {"customer": "Ada"}}}
    entry = await responses_call(proxy, "v4", new, 100)
    assert int(entry["reserved_input_tokens"]) < 1000, entry


async def test_a_shell_call_sent_back_cannot_name_another_tenants_container(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A hosted shell's call names its container in ``environment``, not in a ``container_id`` of
    its own: tenant B sending back a shell call in tenant A's container is refused as naming it
    in its tool is, nothing going upstream."""
    proxy = await make_proxy()
    async with proxy.client() as a:
        (mine,) = await containers_of(
            a,
            input="save my secret to a file",
            tools=[{"type": "shell", "environment": {"type": "container_auto"}}],
        )
    await proxy.recorded()
    sent = len(fake.received)
    call = {
        "type": "shell_call",
        "id": "sh_x",
        "call_id": "call_x",
        "status": "completed",
        "action": {"commands": ["ls"]},
        "environment": {"type": "container_reference", "container_id": mine},
    }
    async with proxy.client(KEY_B) as b:
        with pytest.raises(openai.NotFoundError) as refused:
            await b.responses.create(
                model="gpt-4o-mini",
                input=[call, {"role": "user", "content": "cat every file"}],  # type: ignore[list-item]
                tools=[CODE_TOOL],  # type: ignore[list-item]
            )
    assert len(fake.received) == sent, "another tenant's container went upstream with the operator's key"
    assert_not_found(refused.value, f"Container with id '{mine}' not found.", "input")


# -- whose a context is --------------------------------------------------------------------------


async def test_the_first_tenant_to_mark_a_context_keeps_it(one_store: RedisStore) -> None:
    """Two tenants' calls naming one unmarked id at once (a container made with the provider
    directly) both pass the check before their reserve; the first mark stands, the second
    takes nothing from it (owner.lua)."""
    await one_store.claim_contexts(tenant="team-a", ids=["cntr_1"])
    await one_store.claim_contexts(tenant="team-b", ids=["cntr_1"])
    assert await one_store.context_owners(ids=["cntr_1"]) == ["team-a"]


# -- leases ---------------------------------------------------------------------------------------


async def test_a_renewal_never_shortens_a_scope_keys_life(one_store: RedisStore) -> None:
    """renew.lua gives a scope key its TTL again only where that lengthens it: a key kept
    longer (its meters' window, a TTL a reload lengthened) keeps its life and the used figures
    it holds."""
    scope = Scope(name="run", key="lbp:{team-a}:run:long-lived", ceilings={"total_tokens": 90}, ttl_s=60)
    assert isinstance(await reserve(one_store, "live", [scope], run_id="long-lived"), Reservation)
    await one_store.client.expire(scope.key, 3600)
    assert await one_store.renew(tenant="team-a", reservation_id="live", lease_ms=60_000, scopes=[scope])
    assert await one_store.client.ttl(scope.key) > 3000


async def test_a_lease_within_its_grace_is_not_listed_for_the_reapers(one_store: RedisStore) -> None:
    """A reaper lists a lease only ``reap_grace_s`` after it ran out (expired.lua): time for the
    call's journaled settle to land with its real figures before the reserve is billed."""
    scope = Scope(name="run", key="lbp:{team-a}:run:graced")
    assert isinstance(await reserve(one_store, "graced", [scope], lease_ms=1), Reservation)
    await asyncio.sleep(0.01)
    assert await one_store.expired_leases(tenant="team-a", limit=10, grace_ms=60_000) == []
    assert [lease.id for lease in await one_store.expired_leases(tenant="team-a", limit=10)] == ["graced"]


async def test_a_renewal_confirms_the_lease_it_extended(one_store: RedisStore) -> None:
    """Each renewal Redis confirms is the lease's new start for the settle: a reservation the
    store then lost is still billed within the marker's life after it (``bill_if_lost``), and a
    whole answer's settle need not wait for Redis. Left at the reserve, a long stream's settle
    counted from its reserve, as though no renewal had come."""
    call = planned(chat())
    scope = Scope(name="run", key="lbp:{team-a}:run:run-1")
    reserved = await reserve(one_store, call.reservation_id, [scope], run_id="run-1")
    assert isinstance(reserved, Reservation)
    call.reservation, call.lease_confirmed_at = reserved, 0.0
    renewal = LeaseRenewal(call, one_store, Metrics(CollectorRegistry()))
    renewal.stop()
    before = time.monotonic()
    await renewal._renew()
    assert call.lease_confirmed_at >= before


async def test_a_reaper_waits_its_grace_after_the_store_answers_again(one_store: RedisStore) -> None:
    """After an outage every lease that ran out during it is past its own grace: the reaper
    first waits ``reap_grace_s`` of the store answering, time for the journals of the processes
    that served those calls to bill their real figures."""
    scope = Scope(name="run", key="lbp:{team-a}:run:outage")
    assert isinstance(await reserve(one_store, "out", [scope], lease_ms=1), Reservation)
    await one_store.client.zadd("lbp:{team-a}:leases", {"out": 0})  # ran out long ago
    reaper = asyncio.ensure_future(run_reaper(one_store, 0.05, nothing, lambda: ["team-a"], grace_s=5))
    await asyncio.sleep(0.5)
    reaper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reaper
    assert await one_store.client.zcard("lbp:{team-a}:leases") == 1


# -- the journal ----------------------------------------------------------------------------------


async def test_a_replayed_line_whose_call_a_reaper_billed_is_not_counted(
    one_store: RedisStore, tmp_path: Path
) -> None:
    """A journaled settle that finds its reservation gone (a reaper billed it at its reserve,
    past the line's bill-if-lost window) changes nothing, and its entry is not counted in the
    metrics beside the reaper's: the call was charged once."""
    pending = replace(_line("reaped"), bill_if_lost_until_ms=0)
    counted: list[Mapping[str, str]] = []
    line = json.dumps(asdict(pending))
    assert await apply_lines(one_store, [line], tmp_path / DEAD_LETTERS, counted.append) == (1, [])
    assert counted == []


async def test_a_replayed_line_marks_its_contexts_as_its_own_tenants(
    one_store: RedisStore, tmp_path: Path
) -> None:
    """The mark lost with the store is made by the replay, as the call's tenant's: marked as
    anyone else's, the tenant's own next call continuing its answer is refused."""
    pending = replace(_line("marked"), owned_contexts=["resp_mine"])
    line = json.dumps(asdict(pending))
    assert await apply_lines(one_store, [line], tmp_path / DEAD_LETTERS, nothing) == (1, [])
    assert await one_store.context_owners(ids=["resp_mine"]) == [pending.tenant]
