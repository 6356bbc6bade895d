"""Counting for reservations: part by part, long parts remembered, the byte fallback exact."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.tokenizer import CACHED_TEXT_CHARS, Tokenizer
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MODEL, byte_encoding, ledger_entries, run_headers


class CountingEncoding:
    """The byte-level stand-in, counting what it was asked to encode."""

    def __init__(self) -> None:
        self.inner = byte_encoding()
        self.encoded: list[str] = []

    def encode_ordinary(self, text: str) -> list[int]:
        self.encoded.append(text)
        return self.inner.encode_ordinary(text)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.text(max_size=40), max_size=8))
def test_without_an_encoding_parts_count_as_their_joined_bytes(parts: list[str]) -> None:
    joined = "\n".join(parts)
    assert Tokenizer({}).upper_bound_of_parts(parts, "o200k_base") == len(
        joined.encode("utf-8", "surrogatepass")
    )


def test_long_parts_are_counted_once_and_the_cache_stays_bounded() -> None:
    enc = CountingEncoding()
    tokenizer = Tokenizer({"o200k_base": enc}, cache_chars=4 * CACHED_TEXT_CHARS)
    history = ["a" * CACHED_TEXT_CHARS, "b" * CACHED_TEXT_CHARS, "short"]
    first = tokenizer.upper_bound_of_parts(history, "o200k_base")
    assert first == 2 * CACHED_TEXT_CHARS + len("short") + 2  # one token per byte, one per break
    enc.encoded.clear()
    grown = [*history, "c" * CACHED_TEXT_CHARS]
    assert tokenizer.upper_bound_of_parts(grown, "o200k_base") == first + 1 + CACHED_TEXT_CHARS
    assert enc.encoded == ["short", "c" * CACHED_TEXT_CHARS]  # the long history was not encoded again
    for fill in "defgh":
        tokenizer.upper_bound_of_parts([fill * CACHED_TEXT_CHARS], "o200k_base")
        assert tokenizer.cache.chars <= 4 * CACHED_TEXT_CHARS
    enc.encoded.clear()
    tokenizer.upper_bound_of_parts(history, "o200k_base")
    assert "a" * CACHED_TEXT_CHARS in enc.encoded  # evicted, least recently used first


def test_a_zero_sized_cache_remembers_nothing() -> None:
    enc = CountingEncoding()
    tokenizer = Tokenizer({"o200k_base": enc}, cache_chars=0)
    for _ in range(2):
        tokenizer.upper_bound_of_parts(["x" * 5000], "o200k_base")
    assert len(enc.encoded) == 2 and tokenizer.cache.chars == 0


async def test_an_agent_resending_its_conversation_is_counted_only_where_it_grew(
    make_proxy: ProxyFactory,
) -> None:
    enc = CountingEncoding()
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}))
    history: list[Any] = [{"role": "system", "content": "You are terse. " * 400}]
    async with proxy.client() as client:
        for turn in range(3):
            history.append({"role": "user", "content": f"question {turn} " * 200})
            await client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=5, extra_headers=run_headers("agent")
            )
            history.append({"role": "assistant", "content": "ok"})
    long_texts = [t for t in enc.encoded if len(t) >= CACHED_TEXT_CHARS]
    assert long_texts == [
        history[0]["content"],
        history[1]["content"],
        history[3]["content"],
        history[5]["content"],
    ]
    entries = await ledger_entries(proxy, "agent")
    # Each turn reserves its whole conversation: one token per byte, 4 per message, 3 for the reply.
    for entry, messages in zip(entries, (history[:2], history[:4], history[:6]), strict=True):
        texts = [m["content"] for m in messages]
        assert int(entry["reserved_input_tokens"]) == len("\n".join(texts)) + 4 * len(texts) + 3


class ThreadRecordingEncoding(CountingEncoding):
    """Records which thread counted each long text, and how many counted at once."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self.active = 0
        self.most_at_once = 0

    def encode_ordinary(self, text: str) -> list[int]:
        if len(text) >= 32 * 1024:
            self.threads.add(threading.current_thread().name)
            self.active += 1
            self.most_at_once = max(self.most_at_once, self.active)
            time.sleep(0.05)
            self.active -= 1
        return super().encode_ordinary(text)


async def test_large_prompts_are_counted_off_the_loop_one_at_a_time(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    enc = ThreadRecordingEncoding()
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": enc}, cache_chars=0))
    async with proxy.client() as client:

        async def one(i: int) -> None:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"{i} " + "many words " * 4000}],
                max_tokens=5,
                extra_headers=run_headers(f"big-{i}"),
                extra_body={"fake": {"hold": True}},
            )

        calls = asyncio.gather(*(one(i) for i in range(4)))
        # Answered once all four were counted: a call settled first drops its count, and a fixed
        # delay may end before the counts even began on a loaded machine.
        for _ in range(1000):
            if sum(len(text) >= 32 * 1024 for text in enc.encoded) == 4:
                break
            await asyncio.sleep(0.01)
        fake.release()
        await calls
    assert sum(len(text) >= 32 * 1024 for text in enc.encoded) == 4
    assert enc.threads and all(name.startswith("estimate") for name in enc.threads)
    assert enc.most_at_once == 1


class _Words:
    """A tokenizer that counts words: far below the bytes, as tiktoken may be below Claude's."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [0] * len(text.split())


def test_the_bytes_encoding_is_never_loaded(monkeypatch: Any, caplog: Any) -> None:
    import tiktoken

    asked: list[str] = []
    monkeypatch.setattr(tiktoken, "get_encoding", asked.append)
    tokenizer = Tokenizer.load(["bytes"], timeout_s=1)
    assert asked == [] and not caplog.records  # no attempt, no "unavailable" warning
    assert not tokenizer.available("bytes")
    assert tokenizer.upper_bound("ünïcode words here", "bytes") == len("ünïcode words here".encode())


async def test_a_model_with_the_bytes_encoding_is_reserved_at_its_prompts_bytes(
    make_proxy: ProxyFactory,
) -> None:
    # For a model tiktoken may undercount (Claude's tokenizer writes more tokens): a reserve
    # never below the provider's count, whatever its tokenizer.
    prompt = "word " * 300
    models = {
        "gpt-4o-mini": {"upstream": "openai", "encoding": "o200k_base"},
        "bounded": {"upstream": "openai", "encoding": "bytes"},
    }
    proxy = await make_proxy(models=models, tokenizer=Tokenizer({"o200k_base": _Words()}))
    client = proxy.client()
    for model in ("gpt-4o-mini", "bounded"):
        await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=5,
            extra_headers=run_headers(model),
        )
    (counted,) = await ledger_entries(proxy, "gpt-4o-mini")
    (bounded,) = await ledger_entries(proxy, "bounded")
    assert int(counted["reserved_input_tokens"]) < 400 < len(prompt) < int(bounded["reserved_input_tokens"])


async def test_a_model_a_glob_routes_is_counted_with_its_family_s_encoding(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A model that reaches its entry by a glob (``gpt-oss-120b`` by ``*``, as zero-config
    routes every model) names an encoding no pattern of the config does (o200k_harmony), which
    was never loaded: its calls were reserved at their bytes and, answered without usage, billed
    at 4 characters a token (found by the routing hunt). o200k_harmony counts ordinary text as
    o200k_base, which is loaded."""
    proxy = await make_proxy(tokenizer=Tokenizer({"o200k_base": _Words()}))
    text = "word " * 300
    for model in ("gpt-4o", "gpt-oss-120b"):  # both by "*"
        await proxy.client().chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=500,
            extra_headers=run_headers(model),
            extra_body={"fake": {"no_usage": True, "content": text}},
        )
    entries = {model: (await ledger_entries(proxy, model))[0] for model in ("gpt-4o", "gpt-oss-120b")}
    counted = {
        m: (e["usage_source"], e["reserved_input_tokens"], e["output_tokens"]) for m, e in entries.items()
    }
    assert counted["gpt-oss-120b"] == counted["gpt-4o"], counted
    assert counted["gpt-4o"][0] == "tokenizer"


def test_an_encoding_never_tried_is_loaded_once_a_model_names_it(monkeypatch: Any) -> None:
    """An encoding with no same-counting one loaded (a glob routing ``davinci-002``: p50k_base)
    is loaded off the event loop once a call names it: until it lands its calls are counted as
    without it, after it by it."""
    import proxy.tokenizer as tokenizer_module

    loads: list[str] = []

    def load(name: str, timeout_s: float) -> Any:
        loads.append(name)
        return _Words()

    monkeypatch.setattr(tokenizer_module, "_load_one", load)
    tokenizer = Tokenizer({"o200k_base": _Words()}, loads_missing=True)  # as Tokenizer.load makes it
    assert tokenizer.resolve("o200k_harmony") == "o200k_base"
    assert tokenizer.resolve("p50k_base") == "p50k_base"
    for _ in range(200):
        if tokenizer.available("p50k_base"):
            break
        time.sleep(0.01)
    assert tokenizer.available("p50k_base")
    tokenizer.resolve("p50k_base")
    assert loads == ["p50k_base"]  # once
    given = Tokenizer({})  # its encodings given (tests, tools): nothing more is loaded
    assert given.resolve("r50k_base") == "r50k_base" and loads == ["p50k_base"]


async def test_an_encoding_a_call_names_is_fetched_off_the_loop_once_its_calls_answered_meanwhile(
    make_proxy: ProxyFactory, fake: FakeUpstream, monkeypatch: Any
) -> None:
    """README (Usage sources): an encoding only a call's model implies (``text-davinci-003`` by
    ``*``: p50k_base) is loaded, downloaded where TIKTOKEN_CACHE_DIR does not hold it, when the
    first such call comes: off the event loop, the calls answered meanwhile, and a fetch that
    fails is not tried again call after call (the README said encodings were never downloaded
    at request time: the docs hunt)."""
    import tiktoken

    asked: list[str] = []
    held = threading.Event()

    def get_encoding(name: str) -> Any:
        asked.append(name)
        if name == "p50k_base":
            held.wait(30)  # a download that hangs, past the load's time bound
        raise OSError("no network here")

    monkeypatch.setattr(tiktoken, "get_encoding", get_encoding)
    tokenizer = Tokenizer.load(["o200k_base"], timeout_s=1.0)
    proxy = await make_proxy(tokenizer=tokenizer)
    try:
        for run in ("first", "second"):
            call = proxy.client().chat.completions.create(
                model="text-davinci-003",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers=run_headers(run),
            )
            # Loaded on the loop, the call would wait out the load's bound (5 s).
            await asyncio.wait_for(call, 4.0)
        for _ in range(200):
            if "p50k_base" in asked:
                break
            await asyncio.sleep(0.01)
    finally:
        held.set()
    assert asked == ["o200k_base", "p50k_base"]
    tokenizer.resolve("p50k_base")
    assert asked == ["o200k_base", "p50k_base"]
