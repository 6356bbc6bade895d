"""Quick estimates: much new text reserves at its UTF-8 bytes at once, is counted exactly on the
estimate thread while the call runs, and the reserve comes down to the count; a budget decides
only on the exact count."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
import tiktoken

import proxy.app as app_module
import proxy.billed_usage as billed_usage_module
from proxy.estimate import SPECIAL_TOKENS_PER_INPUT, counted, estimate
from proxy.payload import (
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    Endpoint,
    MessagesBody,
    RequestView,
    ResponsesBody,
)
from proxy.redis_server import RedisServerProcess
from proxy.state import STATE
from proxy.tokenizer import CACHED_TEXT_CHARS, QUICK_BOUND_CHARS, Tokenizer
from tests.conftest import (
    KEY_A,
    KEY_B,
    Proxy,
    ProxyFactory,
    busy_script,
    digest,
    until_monotonic,
    until_redis_busy,
    until_upstream_received,
    upstream_timing_out,
)
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MODEL, ledger_entries, run_headers
from tests.test_budgets import meters, tiers
from tests.test_thread_pools import until_held

TEXT = "word " * 8000  # 40,000 bytes: a quick estimate
PROMPT_OVERHEAD = 4 + 3  # one message, and the reply's priming
QUICK_INPUT = len(TEXT) + PROMPT_OVERHEAD
EXACT_INPUT = len(TEXT) // 4 + PROMPT_OVERHEAD
FAKE_PROMPT = 8000 + 3  # the fake bills words + 3 per message


class QuarterEncoding:
    """A tiktoken stand-in with fewer tokens than bytes (one per 4), so a byte-length bound and
    the exact count differ. ``gate``: long texts wait for it before they are counted."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.counted: list[int] = []
        self.entered = threading.Event()  # a long text's count began
        self.entries = 0  # long texts' counts begun
        self.fail = False

    def encode_ordinary(self, text: str) -> list[int]:
        if len(text) >= CACHED_TEXT_CHARS:
            self.entries += 1
            self.entered.set()
            if self.fail:
                raise RuntimeError("the encoder failed on purpose")
        if self.gate is not None and len(text) >= CACHED_TEXT_CHARS:
            assert self.gate.wait(10), "the count was never released"
        self.counted.append(len(text))
        return [0] * -(-len(text.encode()) // 4)


def test_much_new_text_is_bounded_by_its_bytes_and_little_is_counted() -> None:
    enc = QuarterEncoding()
    tokenizer = Tokenizer({"o200k_base": enc})
    small = ["x" * (QUICK_BOUND_CHARS // 2), "short"]
    assert tokenizer.quick_bound_of_parts(small, "o200k_base") == (
        tokenizer.upper_bound_of_parts(small, "o200k_base"),
        True,
    )
    enc.counted.clear()
    big = ["y" * QUICK_BOUND_CHARS, "short"]
    assert tokenizer.quick_bound_of_parts(big, "o200k_base") == (QUICK_BOUND_CHARS + len("short") + 1, False)
    assert enc.counted == []  # nothing counted on the caller's thread
    # Remembered counts are used as they are: the first part is known, the new one is small.
    grown = [*small, "z" * 2000]
    bound, exact = tokenizer.quick_bound_of_parts(grown, "o200k_base")
    assert exact and bound == tokenizer.upper_bound_of_parts(grown, "o200k_base")
    assert len(small[0]) not in enc.counted  # counted the first time, then remembered


def test_without_an_encoding_the_byte_bound_is_final() -> None:
    assert Tokenizer({}).quick_bound_of_parts(["a" * QUICK_BOUND_CHARS], "o200k_base") == (
        QUICK_BOUND_CHARS,
        True,
    )


def test_the_special_tokens_of_each_input_stay_reserved_once_the_inputs_are_counted() -> None:
    """A batch's quick bound holds each input's special tokens ([CLS] and [SEP], a server's BOS
    and EOS); counted, the reserve comes down to the texts' count, and must keep them."""
    inputs = ["x" * 2000] * 10  # 20,000 new characters: a quick estimate
    est = estimate(
        "embeddings",
        EmbeddingBody(model="e", input=inputs),
        encoding="o200k_base",
        tokenizer=Tokenizer({"o200k_base": QuarterEncoding()}),
        model_max_output_tokens=None,
        default_max_output_tokens=100,
    )
    specials = SPECIAL_TOKENS_PER_INPUT * len(inputs)
    assert not est.input_exact and est.input_tokens == 20000 + 9 + specials
    exact = counted(est, Tokenizer({"o200k_base": QuarterEncoding()}), "o200k_base")
    assert exact.input_tokens == 10 * 500 + 9 + specials


def quick_estimates(proxy: Proxy, result: str) -> int:
    """``llm_proxy_quick_estimates_total{result=...}``."""
    return int(proxy.app[STATE].metrics.quick_estimates.labels(result).value)


async def reserved_input(proxy: Proxy, run: str) -> int:
    state = (await meters(proxy, run))["meters"]
    return int(state["input_tokens"]["reserved"])


async def lowered_to_exact(proxy: Proxy, run: str) -> bool:
    """Wait (up to 5 s) until the run's input reserve is the exact count."""
    for _ in range(500):
        if await reserved_input(proxy, run) == EXACT_INPUT:
            return True
        await asyncio.sleep(0.01)
    return False


async def big_stream(
    proxy: Proxy, run: str, *, max_tokens: int, fake: dict[str, Any]
) -> tuple[Any, AsyncIterator[Any]]:
    """A stream of TEXT, paced by ``fake``, and its chunks after the first has come."""
    stream = await proxy.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=max_tokens,
        stream=True,
        extra_headers=run_headers(run),
        extra_body={"fake": fake},
    )
    chunks = stream.__aiter__()
    await chunks.__anext__()
    return stream, chunks


async def test_the_call_goes_out_before_the_count_and_its_reserve_comes_down_to_it(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}), tiers=tiers(run={"total_tokens": 10**6})
    )
    call = asyncio.ensure_future(big_stream(proxy, "quick", max_tokens=10, fake={"hold": True}))
    await until_upstream_received(fake, 1)
    # The call went out while the count still waits: the reserve is the byte-length bound.
    assert enc.counted == []
    assert await reserved_input(proxy, "quick") == QUICK_INPUT
    gate.set()
    # Lowered while the upstream holds the answer: a stream that ended first (a fixed pace may,
    # on a loaded machine) would settle and drop the count.
    assert await lowered_to_exact(proxy, "quick")
    fake.release()
    _stream, chunks = await call
    async for _chunk in chunks:
        pass
    [entry] = await ledger_entries(proxy, "quick")
    assert int(entry["reserved_input_tokens"]) == EXACT_INPUT
    assert int(entry["input_tokens"]) == FAKE_PROMPT and entry["usage_source"] == "provider"
    state = (await meters(proxy, "quick"))["meters"]
    assert all(m["reserved"] == 0 for m in state.values()), state
    assert state["input_tokens"]["used"] == FAKE_PROMPT
    assert len(fake.bill) == 1
    assert quick_estimates(proxy, "lowered") == 1 and quick_estimates(proxy, "dropped") == 0


@pytest.mark.parametrize("ceiling", [EXACT_INPUT, EXACT_INPUT - 1])
async def test_a_budget_decides_on_the_exact_count_never_the_byte_bound(
    make_proxy: ProxyFactory, fake: FakeUpstream, ceiling: int
) -> None:
    enc = QuarterEncoding()
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}), tiers=tiers(run={"input_tokens": ceiling})
    )
    create: Any = proxy.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=10,
        extra_headers=run_headers("tight"),
    )
    if ceiling < EXACT_INPUT:
        with pytest.raises(openai.RateLimitError) as caught:
            await create
        message = caught.value.response.json()["error"]["message"]
        assert f"needs {EXACT_INPUT}" in message and "reserved 0" in message
        assert fake.received == []
        return
    await create
    [entry] = await ledger_entries(proxy, "tight")
    assert int(entry["reserved_input_tokens"]) == EXACT_INPUT
    assert enc.counted == [len(TEXT)]  # counted once, before the call went out
    assert quick_estimates(proxy, "counted_first") == 1 and quick_estimates(proxy, "lowered") == 0


async def failing_call(proxy: Proxy, run: str) -> Any:
    """A bare 502 after the call went out, once the test calls ``fake.release()``: billed at its
    reserve."""
    return await proxy.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=10,
        extra_headers=run_headers(run),
        # Answered once the test saw the background count under way (it starts at the reserve): a
        # fixed delay may end first on a loaded machine, and the settle then drops the count.
        extra_body={"fake": {"mode": "error", "status": 502, "error_body": "none", "hold": True}},
    )


async def until_counts_begun(enc: QuarterEncoding, count: int) -> None:
    """Until ``count`` counts of long texts have begun (each may then wait on ``enc.gate``)."""
    for _ in range(500):
        if enc.entries >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{enc.entries} counts begun, not {count}")


async def test_a_call_billed_at_its_reserve_is_billed_at_the_exact_count(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    gate = threading.Event()
    enc = TenantGated(gate)
    enc.gate = gate
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}))
    call = asyncio.ensure_future(failing_call(proxy, "lost"))
    await until_counts_begun(enc, 1)
    fake.release()
    # The background count holds the estimate thread; the settle counts for itself, not behind
    # it, nor behind other calls' reserve counts.
    await until_counts_begun(enc, 2)
    assert enc.entries == 2
    assert [thread for _, thread in enc.threads] == ["estimate_0", "settle-count_0"]
    gate.set()
    with pytest.raises(openai.InternalServerError):
        await call
    [entry] = await ledger_entries(proxy, "lost")
    assert entry["usage_source"] == "reserve"
    assert int(entry["input_tokens"]) == EXACT_INPUT  # not the byte-length bound it reserved first
    assert len(fake.received) == 1


async def test_the_ledger_shows_the_reserve_redis_held_when_the_count_came_after_it(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """Billed at its reserve before its count lowered it: billed at the exact count, but the
    reserve it held until its settle (and released then) was the byte bound, which is what its
    ledger entry's reserved figure says, not the count its settle made."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}))
    call = asyncio.ensure_future(failing_call(proxy, "held"))
    await until_counts_begun(enc, 1)
    fake.release()
    await until_counts_begun(enc, 2)  # the background count, dropped; the settle's own
    assert enc.entries == 2
    assert await reserved_input(proxy, "held") == QUICK_INPUT  # never lowered
    gate.set()
    with pytest.raises(openai.InternalServerError):
        await call
    [entry] = await ledger_entries(proxy, "held")
    assert entry["usage_source"] == "reserve" and int(entry["input_tokens"]) == EXACT_INPUT
    assert int(entry["reserved_input_tokens"]) == QUICK_INPUT
    assert quick_estimates(proxy, "lowered") == 0
    state = (await meters(proxy, "held"))["meters"]
    assert all(m["reserved"] == 0 for m in state.values()), state


REAP_MARGIN_S = 0.1
# A call of a quick estimate's size (TEXT) the fake upstream holds until released.
HELD_QUICK_CALL = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": TEXT}],
    "max_tokens": 10,
    "fake": {"hold": True},
}


async def reaped_quick_proxy(
    make_proxy: ProxyFactory, fake: FakeUpstream, enc: QuarterEncoding, timeout_s: float, **overrides: Any
) -> Proxy:
    """A proxy whose reaper bills a lease at once it runs out, counting with ``enc``, pricing
    gpt-4o-mini at 1 and 10 micro-units a token, its upstream timing out after ``timeout_s``."""
    return await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}),
        upstreams=upstream_timing_out(fake.base_url, timeout_s),
        limits={"reaper_interval_s": 0.05, "reap_grace_s": 0, "lease_margin_s": REAP_MARGIN_S},
        models={"gpt-4o-mini": {"upstream": "openai", "price_per_million": {"input": "1", "output": "10"}}},
        **overrides,
    )


async def until_quick(proxy: Proxy, result: str, count: int = 1) -> None:
    for _ in range(500):
        if quick_estimates(proxy, result) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no quick estimate {result}")


async def slow_call(proxy: Proxy, run: str) -> Any:
    """A call answered once the test calls ``fake.release()``."""
    return await proxy.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=10,
        extra_headers=run_headers(run),
        extra_body={"fake": {"hold": True}},
    )


async def test_a_shrink_the_store_refused_leaves_the_bound_in_the_ledger_as_in_redis(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """Counted while the store refused writes (out of memory): the bound stays reserved until
    the settle releases it, and the ledger's reserved figure is that bound."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    proxy = await make_proxy(redis={"url": own_redis.url}, tokenizer=Tokenizer({"o200k_base": enc}))
    call = asyncio.ensure_future(slow_call(proxy, "refused"))
    await until_upstream_received(fake, 1)
    await own_client.config_set("maxmemory", "1")  # over its limit: writes get -OOM
    try:
        gate.set()
        await until_quick(proxy, "failed")
    finally:
        await own_client.config_set("maxmemory", "0")
    assert await reserved_input(proxy, "refused") == QUICK_INPUT
    fake.release()  # only now: an answer before the shrink was refused would drop the count
    await call
    [entry] = await ledger_entries(proxy, "refused")
    assert entry["usage_source"] == "provider"
    assert int(entry["reserved_input_tokens"]) == QUICK_INPUT
    state = (await meters(proxy, "refused"))["meters"]
    assert all(m["reserved"] == 0 for m in state.values()), state


async def until_script_parked(client: aioredis.Redis) -> None:
    """Until a script waits in Redis behind a ``CLIENT PAUSE ... WRITE`` (flag ``b``)."""
    for _ in range(1000):
        clients = await client.client_list()
        if any("b" in c["flags"] and c["cmd"] == "evalsha" for c in clients):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no script waited behind the pause")


async def test_a_settle_waits_for_a_shrink_on_its_way_and_shows_what_it_left(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """The call ends while its shrink waits on the store (writes paused): the shrink lands before
    the settle, which releases the count; the call's entry and headers say the same."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    proxy = await make_proxy(
        redis={"url": own_redis.url},
        tokenizer=Tokenizer({"o200k_base": enc}),
        tiers=tiers(run={"total_tokens": 10**6}),
    )
    call = asyncio.ensure_future(
        proxy.client().chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=10,
            extra_headers=run_headers("paused"),
            extra_body={"fake": {"hold": True}},
        )
    )
    await until_upstream_received(fake, 1)
    await own_client.execute_command("CLIENT", "PAUSE", "10000", "WRITE")  # the shrink waits
    gate.set()
    # The answer comes once the shrink is on its way: a fixed delay may end before the count
    # does on a loaded machine, and the settle then drops the count (a different path).
    await until_script_parked(own_client)
    fake.release()
    # The settle waits behind the shrink, and the settle is a write too. Should a loaded machine
    # read the answer only after the unpause, the shrink lands first: the same figures.
    await asyncio.sleep(0.3)
    await own_client.execute_command("CLIENT", "UNPAUSE")
    reply = await call
    [entry] = await ledger_entries(proxy, "paused")
    assert int(entry["reserved_input_tokens"]) == EXACT_INPUT  # what Redis held: lowered
    assert quick_estimates(proxy, "lowered") == 1 and quick_estimates(proxy, "dropped") == 0
    state = (await meters(proxy, "paused"))["meters"]
    assert all(m["reserved"] == 0 for m in state.values()), state
    room = 10**6 - int(entry["input_tokens"]) - int(entry["output_tokens"])
    assert reply.headers["x-budget-remaining-total-tokens"] == str(room)


async def test_a_count_that_fails_bills_the_quick_bound_and_never_fails_the_call(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    enc = QuarterEncoding()
    enc.fail = True
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}))
    call = asyncio.ensure_future(failing_call(proxy, "failing"))
    await until_quick(proxy, "failed")  # the background count's; an answer before it drops it
    fake.release()
    with pytest.raises(openai.InternalServerError) as caught:
        await call
    assert caught.value.status_code == 502
    [entry] = await ledger_entries(proxy, "failing")
    assert entry["usage_source"] == "reserve" and int(entry["input_tokens"]) == QUICK_INPUT
    assert quick_estimates(proxy, "failed") == 2  # the background count, then the settle's
    state = (await meters(proxy, "failing"))["meters"]
    assert all(m["reserved"] == 0 for m in state.values()), state


async def test_a_count_not_started_when_its_call_settles_never_runs(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Counts wait their turn on one thread; a call settled on the provider's usage first drops
    its count, so a fast upstream and many new large prompts cannot pile up counts (and the
    prompts they hold) without bound."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}))
    client = proxy.client()
    other = "other " * 7000
    first = asyncio.ensure_future(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=10,
            extra_headers=run_headers("a"),
            extra_body={"fake": {"hold": True}},
        )
    )
    assert await asyncio.to_thread(enc.entered.wait, 10)  # the first count holds the thread
    fake.release()  # a settles while its count is under way
    await first
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": other}],
        max_tokens=10,
        extra_headers=run_headers("b"),
    )
    gate.set()
    # The thread runs its queue in order: once this has run, so has anything queued before it.
    estimator = proxy.app[STATE].estimator
    assert estimator is not None
    await estimator.run("another", lambda: None)
    assert enc.counted == [len(TEXT)]
    assert quick_estimates(proxy, "dropped") == 2  # a's count had begun, b's had not
    [entry] = await ledger_entries(proxy, "b")
    assert int(entry["reserved_input_tokens"]) == len(other) + PROMPT_OVERHEAD  # the bound it had
    state = (await meters(proxy, "b"))["meters"]
    assert all(m["reserved"] == 0 for m in state.values()), state


async def test_a_clamp_is_sized_on_the_exact_count_never_the_byte_bound(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A quick reserve that does not fit is never clamped: the exact count is reserved instead,
    and only it decides how far the output is lowered."""
    room = EXACT_INPUT + 50  # 50 output tokens left after the exact input; none after the bound
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": QuarterEncoding()}),
        tiers=tiers(run={"total_tokens": room}, on_budget_short="clamp", min_output_tokens=10),
    )
    await proxy.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=500,
        extra_headers=run_headers("clamped"),
    )
    assert fake.received[0].body["max_tokens"] == 50
    [entry] = await ledger_entries(proxy, "clamped")
    assert entry["clamped"] == "1" and int(entry["reserved_output_tokens"]) == 50
    assert int(entry["reserved_input_tokens"]) == EXACT_INPUT


async def test_without_quick_estimates_the_call_waits_for_its_count_on_a_reserve_count_thread(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    gate = threading.Event()
    threads: list[str] = []

    class Recording(QuarterEncoding):
        def encode_ordinary(self, text: str) -> list[int]:
            threads.append(threading.current_thread().name)
            return super().encode_ordinary(text)

    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": Recording(gate)}), limits={"quick_estimates": False}
    )
    call = asyncio.ensure_future(
        proxy.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=10,
            extra_headers=run_headers("counted"),
        )
    )
    for _ in range(500):
        if threads:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert threads and fake.received == []  # counting, and nothing went out before the count
    gate.set()
    await call
    [entry] = await ledger_entries(proxy, "counted")
    assert int(entry["reserved_input_tokens"]) == EXACT_INPUT
    assert threads == ["reserve-count_0"]
    assert quick_estimates(proxy, "lowered") == 0 and quick_estimates(proxy, "counted_first") == 0


class TenantGated(QuarterEncoding):
    """``QuarterEncoding`` whose long texts of tenant A's (``"A ..."``) wait for ``a_gate``; the
    thread of each long count is recorded, with the tenant whose text it is."""

    def __init__(self, a_gate: threading.Event) -> None:
        super().__init__()
        self.a_gate = a_gate
        self.threads: list[tuple[str, str]] = []

    def encode_ordinary(self, text: str) -> list[int]:
        if len(text) >= CACHED_TEXT_CHARS:
            self.threads.append((text[0], threading.current_thread().name))
            if text.startswith("A "):
                assert self.a_gate.wait(10), "the count was never released"
        return super().encode_ordinary(text)


def tenants_call(proxy: Proxy, tenant: str, run: str, **extra: Any) -> Any:
    """A call of TEXT by tenant A's key or B's, its text starting with the tenant's letter (and
    its run's name: a text of its own, counted, not remembered)."""
    return asyncio.ensure_future(
        proxy.client(KEY_A if tenant == "A" else KEY_B).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{tenant} {run} {TEXT}"}],
            max_tokens=10,
            extra_headers=run_headers(run),
            **extra,
        )
    )


async def test_without_quick_estimates_a_tenants_counts_hold_another_tenants_behind_one_of_theirs_at_most(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """With ``limits.quick_estimates: false`` every new long prompt is counted before its
    reserve: on the one estimate thread, first come first served, tenant B's call waited behind
    every one of tenant A's counts (2 s apiece for 4 MB). It is counted as a reserve that waits
    on a count is: beside A's one count under way, while A's others wait A's turn."""
    gate = threading.Event()
    enc = TenantGated(gate)
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}), limits={"quick_estimates": False})
    a_calls = [tenants_call(proxy, "A", f"a-{i}") for i in range(3)]
    try:
        await until_held(proxy.app[STATE].reserve_counts, 3)  # one counting, held; two waiting
        await tenants_call(proxy, "B", "b")
        assert enc.threads == [("A", "reserve-count_0"), ("B", "reserve-count_1")]
    finally:
        gate.set()
    await asyncio.gather(*a_calls)
    assert [tenant for tenant, _ in enc.threads] == ["A", "B", "A", "A"]
    assert len(fake.received) == 4


async def test_a_tenants_background_counts_hold_another_tenants_behind_one_of_theirs_at_most(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The counts that lower quick reserves while their calls run share the one estimate thread,
    one of a tenant's at a time: tenant B's reserve comes down to its count after tenant A's one
    count under way, not after all of A's (until then B's byte bound holds its budget's room)."""
    gate = threading.Event()
    enc = TenantGated(gate)
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}))
    held = {"fake": {"hold": True}}  # each call runs until its count is done: none dropped
    calls = [tenants_call(proxy, "A", f"a-{i}", extra_body=held) for i in range(3)]
    try:
        for _ in range(500):
            if enc.threads:  # A's first count under way, held by the gate
                break
            await asyncio.sleep(0.01)
        calls.append(tenants_call(proxy, "B", "b", extra_body=held))
        await until_upstream_received(fake, 4)  # every count queued, as each call went out
    finally:
        gate.set()
    await until_counts_begun(enc, 4)
    assert enc.threads == [("A", "estimate_0"), ("B", "estimate_0"), ("A", "estimate_0"), ("A", "estimate_0")]
    for _ in range(500):
        if quick_estimates(proxy, "lowered") == 4:
            break
        await asyncio.sleep(0.01)
    assert quick_estimates(proxy, "lowered") == 4  # each lowered, its call still running
    fake.release()
    await asyncio.gather(*calls)


async def test_a_tenants_reserve_counts_hold_neither_another_tenants_count_nor_a_settle(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reserve whose bound does not fit counts first; a settle without usage counts its call:
    both went to asyncio's default executor, one queue for every tenant (the DoS hunt: tenant A's
    4 MB prompts under a tight ceiling, each refused after 2 s of counting, costing A nothing,
    held tenant B's settle 17.9 s). Reserve counts run on threads of their own, one of a tenant's
    at a time (its next waits its turn, behind no other tenant's); settle counts on others."""
    gate = threading.Event()
    enc = TenantGated(gate)
    settled_on: list[str] = []
    billed_usage = billed_usage_module.billed_usage

    def recording(*args: Any, **kwargs: Any) -> Any:
        settled_on.append(threading.current_thread().name)
        return billed_usage(*args, **kwargs)

    monkeypatch.setattr(billed_usage_module, "billed_usage", recording)
    # The exact count (about 10,000) fits, the byte bound (40,000) does not: each counts first.
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}), tiers=tiers(run={"input_tokens": 20_000})
    )
    state = proxy.app[STATE]
    a_calls = [tenants_call(proxy, "A", f"a-{i}") for i in range(3)]
    try:
        await until_held(state.reserve_counts, 3)  # one counting, held by the gate; two waiting
        # Counted beside A's, and its settle (no usage: its call counted) not behind them.
        await tenants_call(proxy, "B", "b", extra_body={"fake": {"no_usage": True}})
        assert enc.threads == [("A", "reserve-count_0"), ("B", "reserve-count_1")]
        assert "settle-count_0" in settled_on
        await until_held(state.reserve_counts, 3)
    finally:
        gate.set()
    await asyncio.gather(*a_calls)
    assert [tenant for tenant, _ in enc.threads] == ["A", "B", "A", "A"]
    assert all(thread.startswith("reserve-count_") for _, thread in enc.threads)
    await proxy.recorded()
    [entry] = await ledger_entries(proxy, "b", KEY_B)
    assert entry["usage_source"] == "tokenizer"
    await until_held(state.reserve_counts, 0)


async def test_a_tenants_reserve_counts_past_its_bound_are_refused_as_busy_not_by_their_bound(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's reserve counts waiting or running are bounded: past
    ``RESERVE_COUNTS_A_TENANT_HOLDS_MOST``, its call is refused 503 with retry advice, before
    anything is reserved; not 429 on its byte bound, which its budget may well hold once counted.
    Another tenant's count is not: the pool's one bound counted the first tenant's waiting count
    with the rest, and refused the other's beside an idle count thread (each of the first
    tenant's prompts, refused after its count, costs it nothing)."""
    monkeypatch.setattr(app_module, "RESERVE_COUNTS_A_TENANT_HOLDS_MOST", 2)
    gate = threading.Event()
    enc = TenantGated(gate)
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}), tiers=tiers(run={"input_tokens": 20_000})
    )
    a_calls = [tenants_call(proxy, "A", f"a-{i}") for i in range(2)]
    try:
        await until_held(proxy.app[STATE].reserve_counts, 2)  # one counting, one waiting A's turn
        with pytest.raises(openai.InternalServerError) as caught:
            await tenants_call(proxy, "A", "a-2")
        assert caught.value.status_code == 503
        assert caught.value.response.json()["error"]["code"] == "proxy_busy"
        assert caught.value.response.headers["retry-after"] == "1"
        await tenants_call(proxy, "B", "b")
        assert ("B", "reserve-count_1") in enc.threads
    finally:
        gate.set()
    await asyncio.gather(*a_calls)
    assert len(fake.received) == 3  # A's two and B's, nothing of A's refused one
    assert quick_estimates(proxy, "counted_first") == 3  # nor its count, which never came


async def test_a_quick_reserve_is_lowered_for_the_ceilings_of_other_tiers_on_shared_counters(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A tenant's window is one counter for all its keys, each checked against its own tier's
    ceilings: a key with no input ceiling must not leave its byte bound for a key that has one."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    other_key = "sk-proxy-team-a-limited"
    small_call = 9 + 10  # "hi": 2 bytes + 4 + 3 reserved as input, 10 as output
    window = {"period": "day", "total_tokens": EXACT_INPUT + 200 + small_call}
    proxy = await make_proxy(
        tokenizer=Tokenizer({"o200k_base": enc}),
        # The same day window for both tiers, a token ceiling in one only.
        tiers={
            "standard": {"tenant": [{"period": "day", "requests": 1000}]},
            "limited": {"tenant": [window]},
        },
        keys=[
            {"name": "a-ci", "sha256": digest(KEY_A), "tenant": "team-a", "tier": "standard"},
            {"name": "a-limited", "sha256": digest(other_key), "tenant": "team-a", "tier": "limited"},
        ],
    )
    stream, _chunks = await big_stream(
        proxy, "big", max_tokens=200, fake={"chunk_delay_s": 0.05, "reply_tokens": 60}
    )
    gate.set()
    assert await lowered_to_exact(proxy, "big")  # 3 s of stream left
    # The big call is still running, its reserve lowered on the tenant's window too.
    await proxy.client(key=other_key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        extra_headers=run_headers("small"),
    )
    await stream.close()
    assert len(fake.bill) == 2


# -- image, audio and file parts: a per-model reserve ---------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400}}
MEDIA_MODELS = {
    "gpt-4o-mini": {"upstream": "openai", "max_output_tokens": 1000, "media_part_input_tokens": 1000},
    "*": {"upstream": "openai"},
}


async def test_media_parts_are_reserved_at_the_models_bound(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # Two images at 1,000 tokens each do not fit an input ceiling of 1,500; without the bound
    # they were reserved as nothing and the call went out.
    proxy = await make_proxy(models=MEDIA_MODELS, tiers=tiers(run={"input_tokens": 1500}))
    client = proxy.client(max_retries=0)
    two = [{"role": "user", "content": [{"type": "text", "text": "what differs?"}, IMAGE, IMAGE]}]
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(
            model=MODEL, messages=two, max_tokens=5, extra_headers=run_headers("media")
        )
    assert fake.received == []
    one = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, IMAGE]}]
    await client.chat.completions.create(
        model=MODEL, messages=one, max_tokens=5, extra_headers=run_headers("media")
    )
    (entry,) = await ledger_entries(proxy, "media")
    assert 1000 < int(entry["reserved_input_tokens"]) < 1100, entry


@pytest.mark.parametrize(
    ("path", "body", "parts"),
    [
        ("/v1/responses", {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "read"}, {"type": "input_image", "image_url": "https://x/y.png"},
            {"type": "input_file", "file_id": "file-1"}]}]}, 2),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, 1),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "c", "content": [
            {"type": "text", "text": "the chart"}, IMAGE]}]}, 1),
    ],
    ids=["responses-image-and-file", "chat-audio", "tool-result-image"],
)  # fmt: skip
async def test_every_kind_of_media_part_is_reserved(
    make_proxy: ProxyFactory, fake: FakeUpstream, path: str, body: dict[str, Any], parts: int
) -> None:
    proxy = await make_proxy(models=MEDIA_MODELS)
    headers = {"Authorization": f"Bearer {KEY_A}", **run_headers(f"m-{parts}")}
    async with aiohttp.ClientSession() as session:
        payload = {"model": MODEL, "max_tokens" if "chat" in path else "max_output_tokens": 5, **body}
        async with session.post(proxy.url + path, json=payload, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    (entry,) = await ledger_entries(proxy, f"m-{parts}")
    reserved = int(entry["reserved_input_tokens"])
    assert parts * 1000 < reserved < parts * 1000 + 100, entry


def _character_estimate_kwargs() -> dict[str, Any]:
    """An estimate at 4 characters a token (no encoding installed), 10 output tokens."""
    return {
        "encoding": "o200k_base",
        "tokenizer": Tokenizer({}),
        "model_max_output_tokens": 10,
        "default_max_output_tokens": 10,
    }


def media_reserve(endpoint: Endpoint, view: Any, per_part: int) -> int:
    """What ``media_part_input_tokens`` of ``per_part`` adds to the estimate of ``view``."""
    kwargs = _character_estimate_kwargs()
    plain = estimate(endpoint, view, **kwargs)
    return (
        estimate(endpoint, view, media_part_input_tokens=per_part, **kwargs).input_tokens - plain.input_tokens
    )


def test_without_a_bound_media_parts_add_nothing() -> None:
    view = ChatBody.model_validate({"model": MODEL, "messages": [{"role": "user", "content": [IMAGE]}]})
    tokenizer = Tokenizer({})
    kwargs: dict[str, Any] = {"encoding": "o200k_base", "tokenizer": tokenizer, "model_max_output_tokens": 10}
    plain = estimate("chat.completions", view, default_max_output_tokens=10, **kwargs)
    bounded = estimate(
        "chat.completions", view, default_max_output_tokens=10, media_part_input_tokens=700, **kwargs
    )
    assert bounded.input_tokens == plain.input_tokens + 700
    assert bounded.prompt_overhead_tokens == plain.prompt_overhead_tokens + 700  # kept by counted()


def test_an_earlier_audio_answer_sent_back_by_id_is_a_media_part() -> None:
    # The provider reads that audio again as input; it was reserved at nothing.
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "say something"},
            {"role": "assistant", "audio": {"id": "audio_abc123"}},
            {"role": "user", "content": "and?"},
        ],
    }
    assert media_reserve("chat.completions", ChatBody.model_validate(body), 700) == 700


def test_a_tool_calls_own_arguments_are_not_media_whatever_types_they_name() -> None:
    # A render tool's arguments from an earlier turn ({"type": "image", ...}): the model's JSON,
    # not an image. It was reserved at the bound, and billed at it without usage.
    body = {
        "model": "claude-x",
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": "draw a cat"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "render",
                                               "input": {"type": "image", "subject": "cat"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "here"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A"}}]}]},
        ],
    }  # fmt: skip
    # The tool result's image only.
    assert media_reserve("messages", MessagesBody.model_validate(body), 1500) == 1500


def test_responses_screenshots_and_variables_are_media() -> None:
    body = {
        "model": MODEL,
        "input": [{"type": "computer_call_output", "call_id": "c1",
                   "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,AAAA"}}],
        "prompt": {"id": "pmpt_1", "variables": {"photo": {"type": "input_image", "image_url": "https://x/y.png"},
                                                 "city": "Paris"}},
    }  # fmt: skip
    assert media_reserve("responses", ResponsesBody.model_validate(body), 100) == 200


async def test_a_call_a_reaper_billed_at_its_quick_bound_is_told_that_bound(
    make_proxy: ProxyFactory,
    fake: FakeUpstream,
    redis_server: RedisServerProcess,
    redis_client: aioredis.Redis,
) -> None:
    """Its lease ran out while its quick estimate was being counted: the reaper billed the bound
    the record held (shrink.lua lowers nothing once the lease has run out). The count landed
    after, and the client was told the figures and cost of the exact count, not the ledger's. A
    whole answer waits for its settle's reply once half its lease is gone; before that it goes
    out with the settle on its way."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    timeout_s, margin_s = 4, REAP_MARGIN_S
    # A store timeout below two thirds of the lease (4.1 s).
    proxy = await reaped_quick_proxy(make_proxy, fake, enc, timeout_s, redis={"socket_timeout_s": 2})
    leases = "lbp:{team-a}:leases"
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "quick-reaped"}
    # Answered once the count landed and past half the lease, well within the upstream's
    # timeout: a fixed delay raced both on a loaded machine.
    body = HELD_QUICK_CALL
    async with aiohttp.ClientSession() as session:
        answer = asyncio.ensure_future(
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        )
        assert await asyncio.to_thread(enc.entered.wait, 5)  # reserved at the bound, being counted
        leased_at = time.monotonic()  # the reserve was asked before
        (reservation,) = await redis_client.zrange(leases, 0, -1)
        await redis_client.zadd(leases, {reservation: 0})  # its lease ran out
        for _ in range(200):
            if await redis_client.xlen("lbp:{team-a}:ledger"):
                break
            await asyncio.sleep(0.02)
        gate.set()  # the count lands now, while the call still runs
        # Answered past half the lease (2.05 s), while Redis holds the settle's reply: an answer
        # that went out with its settle on its way would be told the count every time.
        half_lease_s = (timeout_s + margin_s) / 2
        await until_monotonic(leased_at + half_lease_s - 0.6)
        blocker = aioredis.Redis.from_url(redis_server.url)
        busy = asyncio.ensure_future(blocker.eval(busy_script(2), 0))
        try:
            assert redis_server.port is not None
            await until_redis_busy(redis_server.port)
            await until_monotonic(leased_at + half_lease_s + 0.2)
            assert max(enc.counted, default=0) >= CACHED_TEXT_CHARS, "the count never landed"
            fake.release()
            resp = await answer
            assert resp.status == 200
            await resp.read()
        finally:
            await busy
            await blocker.aclose()
    ((_, entry),) = await redis_client.xrange("lbp:{team-a}:ledger")
    assert entry["outcome"] == "lease_expired"
    assert resp.headers["x-billing-outcome"] == "lease_expired"
    assert resp.headers["x-billing-input-tokens"] == entry["input_tokens"]
    assert resp.headers["x-billing-cost-micros"] == entry["cost_micros"]


async def test_a_message_naming_a_media_type_still_has_its_text_reserved(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # A chat message that also says "type": "image_url" (an OpenAI-compatible server such as
    # vLLM or Ollama ignores the extra key and reads, and bills, the content) is skipped whole
    # by the estimate as if it were an image part: its 2,000 words are reserved as 0 tokens,
    # so a run limited to 1,000 tokens lets the call through and is overrun.
    proxy = await make_proxy(tiers={"standard": {"run": {"total_tokens": 1000}}})
    body = {
        "model": "gpt-4o-mini",
        "max_tokens": 5,
        "messages": [{"role": "user", "type": "image_url", "content": "word " * 2000}],
    }
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "media-typed-message"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        status = resp.status
        answer = await resp.read()
    assert status == 429, answer[:300]
    assert fake.received == []
    assert await redis_client.xlen("lbp:{team-a}:ledger") == 0


def test_a_tools_enum_is_reserved_as_openai_counts_it() -> None:
    """OpenAI's cookbook counts a tool's enum as 3 tokens an item beside the item's own (the
    function 7, its name and description, its properties 3 and 3 each, an enum -3, the tools 12),
    checked there against gpt-4o's usage. The tools' JSON holds about 1 per item beside it: a
    1,000-item enum was reserved some 2,000 tokens below what the provider bills."""
    # A tokenizer that writes JSON's '","' as one token, as cl100k and o200k do.
    ranks = {bytes([i]): i for i in range(256)} | {b'",': 256, b'","': 257}
    enc = tiktoken.Encoding(name="o200k_base", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    items = [f"v{i}" for i in range(1000)]
    prop = {"type": "string", "description": "", "enum": items}
    fn = {
        "name": "pick",
        "description": "Pick one.",
        "parameters": {"type": "object", "properties": {"x": prop}},
    }
    body = ChatBody(
        model="gpt-4o",
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": fn}],
    )
    est = estimate(
        "chat.completions",
        body,
        encoding="o200k_base",
        tokenizer=Tokenizer({"o200k_base": enc}),
        model_max_output_tokens=None,
        default_max_output_tokens=100,
    )

    def count(text: str) -> int:
        return len(enc.encode_ordinary(text))

    enum = -3 + sum(3 + count(item) for item in items)
    tools = 7 + count("pick:Pick one") + 3 + 3 + enum + count("x:string:") + 12
    billed = 4 + count("hi") + 3 + tools  # the message, the reply's priming, the tools
    assert est.input_tokens >= billed, (est.input_tokens, billed)


# -- a served model's chat template: a per-model reserve beyond OpenAI's chat format ---------

# Llama 3.1 on vLLM: a system block of about 25 tokens a call, about 5 a message beyond the 4.
TEMPLATE = {"prompt_overhead_tokens": 25, "message_overhead_tokens": 5}
TEMPLATE_MODELS = {MODEL: {"upstream": "openai", **TEMPLATE}, "*": {"upstream": "openai"}}
TWO_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "how are you?"},
]


@pytest.mark.parametrize(
    ("endpoint", "view", "added"),
    [
        ("chat.completions", ChatBody(model="m", messages=TWO_TURNS), 25 + 5 * 3),
        # Items and one for the instructions, as the per-message tokens count them.
        ("responses", ResponsesBody(model="m", input=TWO_TURNS, instructions="be brief"), 25 + 5 * 4),
        ("responses", ResponsesBody(model="m", input="hi"), 25 + 5 * 2),
        ("messages", MessagesBody(model="m", messages=TWO_TURNS, max_tokens=5), 25 + 5 * 4),
        # Plain text: no chat template frames it (a server's own tokens: SPECIAL_TOKENS_PER_INPUT).
        ("completions", CompletionBody(model="m", prompt=["a", "b"]), 0),
        ("embeddings", EmbeddingBody(model="m", input=["a", "b"]), 0),
    ],
    ids=["chat", "responses-items", "responses-text", "messages", "completions", "embeddings"],
)
def test_a_chat_template_adds_its_tokens_per_call_and_per_message(
    endpoint: Endpoint, view: RequestView, added: int
) -> None:
    kwargs = _character_estimate_kwargs()
    plain = estimate(endpoint, view, **kwargs)
    framed = estimate(endpoint, view, template_call_tokens=25, template_message_tokens=5, **kwargs)
    assert framed.input_tokens == plain.input_tokens + added
    # As overhead: billed as input by a count of the proxy's own, as the per-message tokens are.
    assert framed.prompt_overhead_tokens == plain.prompt_overhead_tokens + added


def test_a_chat_templates_tokens_stay_reserved_once_a_quick_estimate_is_counted() -> None:
    """Counted, a quick reserve comes down to the text's count plus the fixed overhead: the
    template's tokens must be part of that overhead, or the count drops them."""
    view = ChatBody(model="m", messages=[{"role": "user", "content": TEXT}])
    tokenizer = Tokenizer({"o200k_base": QuarterEncoding()})
    est = estimate(
        "chat.completions",
        view,
        encoding="o200k_base",
        tokenizer=tokenizer,
        model_max_output_tokens=None,
        default_max_output_tokens=10,
        template_call_tokens=25,
        template_message_tokens=5,
    )
    assert not est.input_exact and est.input_tokens == QUICK_INPUT + 30
    assert counted(est, tokenizer, "o200k_base").input_tokens == EXACT_INPUT + 30


async def test_a_quick_reserve_lowered_to_the_count_keeps_the_chat_templates_tokens(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    proxy = await make_proxy(
        models=TEMPLATE_MODELS,
        tokenizer=Tokenizer({"o200k_base": enc}),
        tiers=tiers(run={"total_tokens": 10**6}),
    )
    call = asyncio.ensure_future(big_stream(proxy, "template", max_tokens=10, fake={"hold": True}))
    await until_upstream_received(fake, 1)
    assert await reserved_input(proxy, "template") == QUICK_INPUT + 30
    gate.set()
    # Lowered while the upstream holds the answer, not raced against a fixed pace of events.
    await until_quick(proxy, "lowered")
    assert await reserved_input(proxy, "template") == EXACT_INPUT + 30
    fake.release()
    _stream, chunks = await call
    async for _chunk in chunks:
        pass
    [entry] = await ledger_entries(proxy, "template")
    assert int(entry["reserved_input_tokens"]) == EXACT_INPUT + 30
    # The provider's figures are the bill: the template's tokens are in them, not added again.
    assert int(entry["input_tokens"]) == FAKE_PROMPT and entry["usage_source"] == "provider"


async def test_a_call_without_usage_is_billed_its_chat_templates_tokens_as_input(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Without the provider's usage the proxy counts what it sent; the provider bills the
    template's tokens as input too, as it does OpenAI's per-message tokens, which the count holds."""
    proxy = await make_proxy(models=TEMPLATE_MODELS)
    client = proxy.client()
    for model, run in ((MODEL, "framed"), ("other-model", "plain")):
        await client.chat.completions.create(
            model=model,
            messages=TWO_TURNS,
            max_tokens=5,
            extra_headers=run_headers(run),
            extra_body={"fake": {"no_usage": True}},
        )
    [framed] = await ledger_entries(proxy, "framed")
    [plain] = await ledger_entries(proxy, "plain")
    # Counted at 4 characters a token (no tokenizer here): neither the provider's nor the reserve.
    assert framed["usage_source"] == plain["usage_source"] == "chars", framed
    assert int(framed["input_tokens"]) == int(plain["input_tokens"]) + 25 + 5 * 3
    assert int(framed["reserved_input_tokens"]) == int(plain["reserved_input_tokens"]) + 25 + 5 * 3


async def test_a_shrink_whose_reply_was_lost_but_landed_is_the_reserve_the_ledger_names(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """The ledger's ``reserved_input_tokens`` is the reserve as it stood at the settle. A shrink
    whose reply timed out (Redis busy past the socket timeout) ran once Redis was free: Redis held
    the exact count until the settle, the ledger said the byte bound (the refine hunt). Its reply
    lost, the shrink is sent again (the same amounts: lowered now, or found so)."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    proxy = await make_proxy(
        redis={"url": own_redis.url, "socket_timeout_s": 0.5}, tokenizer=Tokenizer({"o200k_base": enc})
    )
    call = asyncio.ensure_future(slow_call(proxy, "lost-reply"))
    await until_upstream_received(fake, 1)
    blocker = aioredis.Redis.from_url(own_redis.url)
    busy = asyncio.ensure_future(blocker.eval(busy_script(1.5), 0))
    try:
        assert own_redis.port is not None
        await until_redis_busy(own_redis.port)
        gate.set()  # the count lands; its shrink waits behind the busy script, its reply times out
        await until_quick(proxy, "lowered")  # sent again until Redis answers
    finally:
        await busy
        await blocker.aclose()
    # Redis ran the shrink once free: it holds the exact count.
    for _ in range(200):
        if await reserved_input(proxy, "lost-reply") == EXACT_INPUT:
            break
        await asyncio.sleep(0.02)
    assert await reserved_input(proxy, "lost-reply") == EXACT_INPUT
    fake.release()
    await call
    [entry] = await ledger_entries(proxy, "lost-reply")
    assert entry["usage_source"] == "provider"
    # What Redis held (and released) at the settle: the exact count, not the bound.
    assert int(entry["reserved_input_tokens"]) == EXACT_INPUT, (entry["reserved_input_tokens"], QUICK_INPUT)


async def test_a_reaped_call_whose_shrink_reply_was_lost_is_told_what_the_reaper_billed(
    make_proxy: ProxyFactory, fake: FakeUpstream, own_redis: RedisServerProcess, own_client: aioredis.Redis
) -> None:
    """The shrink landed (its reply lost), then the lease ran out and a reaper billed the record:
    the exact count. The call's settle finds it billed and tells the client what the ledger
    holds: it told the byte bound and its cost, figures no ledger entry held (the refine hunt)."""
    gate = threading.Event()
    enc = QuarterEncoding(gate)
    timeout_s, margin_s = 5, REAP_MARGIN_S
    proxy = await reaped_quick_proxy(
        make_proxy, fake, enc, timeout_s, redis={"url": own_redis.url, "socket_timeout_s": 0.5}
    )
    leases = "lbp:{team-a}:leases"
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "lost-reaped"}
    body = HELD_QUICK_CALL
    async with aiohttp.ClientSession() as session:
        answer = asyncio.ensure_future(
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        )
        assert await asyncio.to_thread(enc.entered.wait, 5)  # reserved at the bound, being counted
        leased_at = time.monotonic()
        blocker = aioredis.Redis.from_url(own_redis.url)
        busy = asyncio.ensure_future(blocker.eval(busy_script(1.5), 0))
        try:
            assert own_redis.port is not None
            await until_redis_busy(own_redis.port)
            gate.set()
            await until_quick(proxy, "lowered")  # its first reply timed out: sent again
        finally:
            await busy
            await blocker.aclose()
        for _ in range(200):
            if await reserved_input(proxy, "lost-reaped") == EXACT_INPUT:
                break
            await asyncio.sleep(0.02)
        assert await reserved_input(proxy, "lost-reaped") == EXACT_INPUT  # the shrink landed
        (reservation,) = await own_client.zrange(leases, 0, -1)
        await own_client.zadd(leases, {reservation: 0})  # its lease ran out
        for _ in range(200):
            if await own_client.xlen("lbp:{team-a}:ledger"):
                break
            await asyncio.sleep(0.02)
        # Past half the lease: the answer waits for the settle's reply (not told early).
        await until_monotonic(leased_at + (timeout_s + margin_s) / 2 + 0.2)
        fake.release()
        resp = await answer
        assert resp.status == 200
        await resp.read()
    ((_, raw),) = await own_client.xrange("lbp:{team-a}:ledger")
    entry: dict[str, str] = dict(raw)
    assert entry["outcome"] == "lease_expired" and int(entry["input_tokens"]) == EXACT_INPUT, entry
    assert resp.headers["x-billing-outcome"] == "lease_expired"
    assert (quick_estimates(proxy, "failed"), quick_estimates(proxy, "lowered")) == (0, 1)
    assert (resp.headers["x-billing-input-tokens"], resp.headers["x-billing-cost-micros"]) == (
        entry["input_tokens"],
        entry["cost_micros"],
    )
