"""The ledger against the provider's own bill: a seeded random mix of calls through the openai SDK
(streams and not, usage asked or not, n, truncation, refusals, bad JSON, upstream errors and cuts,
streams without usage, clients that leave, a shared run with a tight ceiling), then every call the
fake upstream answered is in the ledger once, on the provider's figures where it sent them, and
the meters are the ledger's sums with nothing left reserved.

LEDGER_SEEDS (comma-separated), LEDGER_CALLS and LEDGER_CONCURRENCY widen a run by hand (the
default: 3 seeds of 80 calls, 8 at a time); a failing seed replays the same mix."""

from __future__ import annotations

import asyncio
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from tests.conftest import KEY_A, KEY_B, Proxy, ProxyFactory, digest
from tests.fake_upstream import BillEntry, FakeUpstream
from tests.outcome_helpers import upstream_override

MODEL = "gpt-4o-mini"
SHARED_RUN = "shared"
SHARED_TOTAL_TOKENS = 200  # a few calls' worth: a burst on the shared run is partly refused
SHARED_COST_MICROS = 300
SHARED_CONCURRENT = 3
SHARED_CEILINGS = {
    "total_tokens": SHARED_TOTAL_TOKENS,
    "cost_usd": f"0.{SHARED_COST_MICROS:06d}",
    "concurrent": SHARED_CONCURRENT,
}
KEY_C = "sk-proxy-team-a-clamped"
TENANTS = {KEY_A: ("team-a", "a-ci"), KEY_B: ("team-b", "b-dev"), KEY_C: ("team-a", "a-clamp")}
METERS = ("input_tokens", "output_tokens", "total_tokens", "cost_micros")
KINDS = (
    "ok",
    "truncate",
    "content_filter",
    "refusal",
    "json_bad",
    "json_good",
    "error",
    "cut",
    "no_usage",
    "malformed_sse",
    "abandon",
    "leave_whole",
    "stall",
)
STREAM_SHAPES = ({}, {"usage_early": True}, {"two_usage": True}, {"keepalive": True}, {"mode": "no_done"})
JsonDict = dict[str, Any]
SEEDS = [int(s) for s in os.environ.get("LEDGER_SEEDS", "1,2,3").split(",")]


@dataclass
class Plan:
    tag: str
    key: str
    run: str
    kind: str
    stream: bool
    include_usage: bool
    n: int
    max_tokens: int
    ctl: JsonDict
    json_mode: bool = False
    leave_after: int = 0
    legacy: bool = False  # a legacy completion (/v1/completions) rather than a chat one
    status: int = 0  # the error status the upstream answers with (kind error)
    error_body: str = "json"


@dataclass
class Result:
    status: int = 200
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    usage_chunks: int = 0
    errored_mid_stream: bool = False


def make_plan(rng: random.Random, i: int) -> Plan:
    key = rng.choice((KEY_A, KEY_B, KEY_C))
    kind = rng.choice(KINDS)
    stream = (rng.random() < 0.6 or kind in ("malformed_sse", "abandon")) and kind != "leave_whole"
    run = SHARED_RUN if key != KEY_B and rng.random() < 0.5 else f"r{i}"
    ctl: JsonDict = {"reply_tokens": rng.randint(1, 15), "tag": f"c{i}"}
    if rng.random() < 0.3:
        ctl["usage"] = {
            "prompt_tokens_details": {"cached_tokens": rng.randint(0, 3)},
            "completion_tokens_details": {"reasoning_tokens": rng.randint(0, 1)},
        }
        # A part within its whole: content_filter halves the reply, and a reasoning count above
        # the output is raised to it (the proxy's reading of incoherent usage, not the bill's).
        ctl["reply_tokens"] = max(2, ctl["reply_tokens"])
    plan = Plan(
        tag=f"c{i}",
        key=key,
        run=run,
        kind=kind,
        stream=stream,
        include_usage=stream and rng.random() < 0.5,
        n=rng.choice((1, 1, 2)),
        max_tokens=rng.randint(6, 12),
        ctl=ctl,
    )
    if kind in ("truncate", "content_filter", "refusal", "cut", "malformed_sse"):
        ctl["mode"] = kind
        if kind in ("cut", "malformed_sse") and stream:  # the usage came before the break, or none
            ctl.update(rng.choice(({}, {"usage_early": True, "after_chunks": 99}, {"no_usage": True})))
    elif kind in ("json_bad", "json_good"):
        plan.json_mode = True
        ctl["content"] = "not json at all" if kind == "json_bad" else '{"a": 1}'
    elif kind == "error":
        plan.status = rng.choice((400, 404, 429, 500, 503))
        plan.error_body = rng.choice(("json", "text", "none"))
        ctl.pop("usage", None)  # the fake bills an error's usage it never sends
        ctl.update(mode="error", status=plan.status, error_body=plan.error_body)
    elif kind == "no_usage":
        ctl["no_usage"] = True
    elif kind == "abandon":
        ctl["reply_tokens"] = rng.randint(8, 15)
        ctl["chunk_delay_s"] = 0.02  # the client leaves while the provider still writes
        ctl.update(rng.choice(({}, {"mode": "truncate"}, {"mode": "content_filter"}, {"no_usage": True})))
        ctl.update(rng.choice((*STREAM_SHAPES, {"mode": "cut", "after_chunks": 7})))
        plan.leave_after = rng.randint(0, 6)
    elif kind == "stall":  # past the upstream's timeout_s
        stalls = ("stall_mid_stream", "stall_before_headers") if stream else ("stall_before_headers",)
        ctl.update(mode=rng.choice(stalls), stall_s=5)
        if stream and rng.random() < 0.5:
            ctl.update(usage_early=True, after_chunks=99)
    elif kind == "leave_whole":
        ctl["delay_s"] = 0.2  # the client leaves before a whole answer comes
    plan.legacy = kind not in ("refusal", "json_bad", "json_good", "leave_whole") and rng.random() < 0.25
    if kind == "ok" and rng.random() < 0.4:  # one choice of n ends otherwise
        other = rng.choice(("length", "content_filter", *(() if plan.legacy else ("error",))))
        ctl["finish_reasons"] = rng.choice(([other, "stop"], ["stop", other]))[: plan.n]
    if kind == "ok" and stream:
        ctl.update(rng.choice(STREAM_SHAPES))
    return plan


async def leave_whole(proxy: Proxy, plan: Plan, kwargs: JsonDict, fake: FakeUpstream) -> Result:
    """Send a whole-answer call and leave once the upstream has it, before its answer."""
    async with proxy.client(plan.key) as client:
        task = asyncio.ensure_future(client.chat.completions.create(**kwargs))
        while not any(isinstance(r.body, dict) and r.body["fake"]["tag"] == plan.tag for r in fake.received):
            if task.done():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return Result(status=0)
        except openai.APIStatusError as err:  # refused before it went out
            body = err.body if isinstance(err.body, dict) else {}
            return Result(status=err.status_code, code=body.get("code"))
    return Result()


async def run_plan(proxy: Proxy, plan: Plan, fake: FakeUpstream) -> Result:
    text = f"call {plan.tag} says hi"
    kwargs: JsonDict = {
        "model": MODEL,
        **({"prompt": text} if plan.legacy else {"messages": [{"role": "user", "content": text}]}),
        "max_tokens": plan.max_tokens,
        "n": plan.n,
        "extra_body": {"fake": plan.ctl},
        "extra_headers": {"X-Run-Id": plan.run, "X-Request-Id": plan.tag},
    }
    if plan.json_mode:
        kwargs["response_format"] = {"type": "json_object"}
    if plan.include_usage:
        kwargs["stream_options"] = {"include_usage": True}
    if plan.kind == "leave_whole":
        return await leave_whole(proxy, plan, kwargs, fake)
    result = Result()
    async with proxy.client(plan.key) as client:
        api: Any = client.completions if plan.legacy else client.chat.completions
        try:
            if not plan.stream:
                raw = await api.with_raw_response.create(**kwargs)
                result.headers = {k.lower(): v for k, v in raw.headers.items()}
                raw.parse()
                return result
            stream = await api.create(stream=True, **kwargs)
            seen = 0
            try:
                if plan.kind == "abandon" and not plan.leave_after:
                    return result  # gone as soon as the stream's headers came
                async for chunk in stream:
                    seen += 1
                    result.usage_chunks += chunk.usage is not None
                    if plan.leave_after and seen >= plan.leave_after:
                        break
            finally:
                await stream.close()
        except openai.APIStatusError as err:
            result.status = err.status_code
            result.headers = {k.lower(): v for k, v in err.response.headers.items()}
            body = err.body if isinstance(err.body, dict) else {}
            result.code = str(body.get("code")) if body.get("code") is not None else None
        except (openai.APIError, ValueError):  # a malformed event reaches the SDK as it came
            result.errored_mid_stream = True
    return result


def finish_is_length(plan: Plan, cap: int) -> bool:
    """Whether a choice of the fake's answer ends with ``length`` under the cap it got."""
    if plan.ctl.get("mode") == "truncate":
        return True
    if (
        plan.kind in ("refusal", "content_filter", "json_bad", "json_good")
        or plan.ctl.get("mode") == "content_filter"
    ):
        return False
    if "finish_reasons" in plan.ctl:  # the fake's finish reasons, whatever the cap
        return "length" in plan.ctl["finish_reasons"]
    return int(plan.ctl["reply_tokens"]) > cap


def expected_outcome(plan: Plan, cap: int) -> str:
    strict = plan.key == KEY_A  # only team-a's strict tier rejects
    if plan.kind == "error":
        return "upstream_4xx" if plan.status < 500 else "upstream_error"
    if plan.kind in ("cut", "malformed_sse"):
        return "upstream_error"
    if plan.kind == "stall":
        return "upstream_timeout"
    if "error" in plan.ctl.get("finish_reasons", []):  # OpenRouter's failure on a 200
        return "upstream_error"
    if "content_filter" in plan.ctl.get("finish_reasons", []):
        return "refused"
    if plan.kind == "refusal" or plan.ctl.get("mode") == "content_filter":
        return "refused"
    if finish_is_length(plan, cap):
        return "rejected:output-truncated" if strict else "truncated"
    if plan.kind == "json_bad" and strict:
        return "rejected:parse-json"
    return "ok"


def usage_chunks_sent(plan: Plan) -> int:
    if not plan.include_usage or plan.ctl.get("no_usage"):
        return 0
    return 2 if plan.ctl.get("two_usage") else 1


def check_entry(plan: Plan, result: Result, entry: JsonDict, bill: BillEntry | None, cap: int) -> None:
    tokens = (int(entry["input_tokens"]), int(entry["output_tokens"]))
    reserved = (int(entry["reserved_input_tokens"]), int(entry["reserved_output_tokens"]))
    assert int(entry["total_tokens"]) == sum(tokens), entry
    assert entry["endpoint"] == ("completions" if plan.legacy else "chat.completions"), entry
    assert entry["clamped"] == ("1" if cap < plan.max_tokens else "0"), (entry, cap)
    # 1 micro-unit an input token, 2 an output token (cached and reasoning at the same prices).
    assert int(entry["cost_micros"]) == tokens[0] + 2 * tokens[1], entry
    provider = bill is not None and (bill.prompt_tokens, bill.completion_tokens)
    if bill is not None and entry["usage_source"] == "provider":
        assert int(entry["cached_input_tokens"]) == bill.cached_tokens, (entry, bill)
        assert int(entry["reasoning_tokens"]) == bill.reasoning_tokens, (entry, bill)
    if plan.kind in ("abandon", "leave_whole"):
        # Read to its end before the proxy saw the client go, or cut before: as when connected.
        finished = ("upstream_error",) if plan.ctl.get("mode") == "cut" else (expected_outcome(plan, cap),)
        assert entry["outcome"] in ("client_disconnected", *finished), f"{entry} {plan}"
        if plan.ctl.get("mode") == "cut" and plan.key != KEY_B:  # drained, then it failed
            assert (entry["usage_source"], tokens) == ("reserve", reserved), entry
        elif plan.ctl.get("mode") == "cut" and entry["usage_source"] == "reserve":
            assert tokens == reserved, entry  # the stream failed: its reserve, left or not
        elif entry["usage_source"] == "provider":
            assert tokens == provider, (entry, bill)
        elif plan.key == KEY_B or plan.ctl.get("no_usage"):  # cancel, or no usage: counted
            assert entry["usage_source"] == "chars", (entry, plan)
            assert tokens[1] <= reserved[1], (entry, bill)
        else:
            raise AssertionError(f"drained without the provider's usage: {entry} {plan}")
        return
    assert entry["outcome"].startswith(expected_outcome(plan, cap)), (entry, plan)
    if plan.kind == "error":
        if plan.status >= 500 and plan.error_body != "json":
            assert (entry["usage_source"], tokens) == ("reserve", reserved), entry
        else:
            assert tokens == (0, 0), entry
    elif plan.kind in ("cut", "stall", "malformed_sse"):
        # The proxy always asks for usage: the fake sends it whatever the client asked.
        mid_stream = plan.ctl["mode"] != "stall_before_headers"
        came = (plan.ctl.get("usage_early") and mid_stream) or plan.kind == "malformed_sse"
        if came and not plan.ctl.get("no_usage"):
            assert (entry["usage_source"], tokens) == ("provider", provider), f"{entry} {bill} {plan}"
        else:
            assert (entry["usage_source"], tokens) == ("reserve", reserved), f"{entry} {plan}"
    elif plan.kind == "no_usage":
        assert entry["usage_source"] == "chars", entry
        assert 0 < tokens[1] <= reserved[1], entry
    else:
        assert (entry["usage_source"], tokens) == ("provider", provider), (entry, bill, plan)
    if "x-billing-outcome" in result.headers or (not plan.stream and result.status == 200):
        headers = result.headers
        assert headers["x-billing-outcome"] == entry["outcome"], (headers, entry)
        assert (headers["x-billing-input-tokens"], headers["x-billing-output-tokens"]) == (
            entry["input_tokens"],
            entry["output_tokens"],
        )
    if plan.stream and result.status == 200 and not result.errored_mid_stream:
        # The usage chunks reach a client that asked for them as the provider sent them, no other.
        assert result.usage_chunks == usage_chunks_sent(plan), (result, plan)


async def meters(client: aioredis.Redis, key: str) -> dict[str, int]:
    return {k: int(v) for k, v in (await client.hgetall(key)).items() if k != "born"}


def assert_sums(scope: str, held: dict[str, int], entries: list[JsonDict]) -> None:
    assert held.get("used:requests", 0) == len(entries), (scope, held)
    for meter in METERS:
        assert held.get(f"used:{meter}", 0) == sum(int(e[meter]) for e in entries), (scope, meter, held)
    leftovers = {k: v for k, v in held.items() if k.startswith("resv:") and v != 0}
    assert leftovers == {}, (scope, held)


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_ledger_matches_the_providers_bill_under_random_calls(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis, seed: int
) -> None:
    keys = [
        {"name": "a-ci", "sha256": digest(KEY_A), "tenant": "team-a", "tier": "strict"},
        {"name": "b-dev", "sha256": digest(KEY_B), "tenant": "team-b", "tier": "lenient"},
        {"name": "a-clamp", "sha256": digest(KEY_C), "tenant": "team-a", "tier": "clamp"},
    ]
    prices = {"input": "1", "output": "2"}
    models = {MODEL: {"upstream": "openai", "max_output_tokens": 1000, "price_per_million": prices}}
    tiers = {
        "strict": {
            "run": SHARED_CEILINGS,
            "policy": {"on_truncate": "reject", "on_invalid_json": "reject"},
        },
        "lenient": {"policy": {"on_client_disconnect": "cancel"}},
        # At least the refusal's 5 tokens a choice: the fake writes them whatever the cap.
        "clamp": {
            "run": SHARED_CEILINGS,
            "on_budget_short": "clamp",
            "min_output_tokens": 5,
        },
    }
    upstreams = upstream_override(fake.base_url, timeout_s=2)  # the stalls time out soon
    proxy = await make_proxy(keys=keys, tiers=tiers, models=models, upstreams=upstreams)
    rng = random.Random(seed)
    plans = [make_plan(rng, i) for i in range(int(os.environ.get("LEDGER_CALLS", "80")))]
    gate = asyncio.Semaphore(int(os.environ.get("LEDGER_CONCURRENCY", "8")))  # the shared run is raced

    async def one(plan: Plan) -> Result:
        async with gate:
            return await run_plan(proxy, plan, fake)

    results = await asyncio.gather(*(one(p) for p in plans))
    for _ in range(200):  # the drained streams settle after their clients left
        if all([await redis_client.zcard(f"lbp:{{{t}}}:leases") == 0 for t in ("team-a", "team-b")]):
            break
        await asyncio.sleep(0.05)

    received = {r.body["fake"]["tag"]: r for r in fake.received if isinstance(r.body, dict)}
    bill_of = {fake.received[b.request_no - 1].body["fake"]["tag"]: b for b in fake.bill}
    for tenant in {t for t, _ in TENANTS.values()}:
        assert await redis_client.zcard(f"lbp:{{{tenant}}}:leases") == 0, tenant
        entries = [e for _, e in await redis_client.xrange(f"lbp:{{{tenant}}}:ledger")]
        by_tag: dict[str, list[JsonDict]] = defaultdict(list)
        for entry in entries:
            by_tag[entry["request_id"]].append(entry)
        mine = [(p, r) for p, r in zip(plans, results, strict=True) if TENANTS[p.key][0] == tenant]
        for plan, result in mine:
            if plan.tag not in received:  # refused before forwarding: the shared run's ceiling
                assert (result.status, result.code, plan.run) == (429, "budget_exceeded", SHARED_RUN), (
                    plan,
                    result,
                )
                assert plan.tag not in by_tag, by_tag[plan.tag]
                continue
            assert len(by_tag[plan.tag]) == 1, (plan, by_tag[plan.tag])
            cap = int(received[plan.tag].body["max_tokens"])
            assert cap == plan.max_tokens or plan.key == KEY_C, (plan, cap)  # only a clamp lowers it
            check_entry(plan, result, by_tag[plan.tag][0], bill_of.get(plan.tag), cap)
        assert set(by_tag) == {p.tag for p, _ in mine if p.tag in received}, tenant
        by_run: dict[str, list[JsonDict]] = defaultdict(list)
        for entry in entries:
            by_run[entry["run_id"]].append(entry)
        for run, run_entries in by_run.items():
            assert_sums(run, await meters(redis_client, f"lbp:{{{tenant}}}:run:{run}"), run_entries)
        for key_name in {k for t, k in TENANTS.values() if t == tenant}:
            of_key = [e for e in entries if e["key"] == key_name]
            assert_sums(key_name, await meters(redis_client, f"lbp:{{{tenant}}}:key:{key_name}:all"), of_key)
            windows = await redis_client.keys(f"lbp:{{{tenant}}}:key:{key_name}:day:*")
            assert len(windows) == 1, (key_name, windows)
            assert_sums(windows[0], await meters(redis_client, windows[0]), of_key)
        windows = await redis_client.keys(f"lbp:{{{tenant}}}:tenant:day:*")
        assert len(windows) == 1, (tenant, windows)
        assert_sums(windows[0], await meters(redis_client, windows[0]), entries)
    shared = await meters(redis_client, "lbp:{team-a}:run:shared")
    assert shared.get("used:total_tokens", 0) <= SHARED_TOTAL_TOKENS, shared
    assert shared.get("used:cost_micros", 0) <= SHARED_COST_MICROS, shared
    assert shared.get("peak:concurrent", 0) <= SHARED_CONCURRENT, shared
    refused = sum(1 for p in plans if p.tag not in received)
    assert refused > 0, "the shared run's ceiling never refused a call: the mix does not test it"
