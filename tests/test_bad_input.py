"""Bad input never hurts the proxy: whatever a client sends, and whatever an upstream answers.

The contract checked here, for POST /v1/chat/completions, /v1/completions and /v1/embeddings:

* a request the proxy refuses gets a 4xx in OpenAI's error format (JSON, ``{"error": {message,
  type, param, code}}``), nothing reaches the upstream and nothing is written to the ledger;
* a request the proxy accepts reaches the upstream exactly once and leaves exactly one ledger
  entry (a correctly billed call);
* never a 500 of the proxy's own, never a stack trace in a response.

The same holds for any answer an upstream sends (random bytes, JSON, SSE lines): one ledger
entry per call, tagged ``upstream_error`` when the answer cannot be parsed, and the proxy keeps
serving afterwards.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import logging
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDictProxy

from proxy.state import STATE
from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream

JsonDict = dict[str, Any]
MODEL = "gpt-4o-mini"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
BILLED_PATHS = (CHAT, COMPLETIONS, EMBEDDINGS)
LEDGER_A = "lbp:{team-a}:ledger"
# Generous for one local call (upstreams here answer at once, or time out after timeout_s 3 s
# at most), even on a loaded machine; a proxy that never finishes its answer fails the test
# instead of hanging it.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=15)
MSGS: list[JsonDict] = [{"role": "user", "content": "hello there"}]
VALID: dict[str, JsonDict] = {
    CHAT: {"model": MODEL, "messages": MSGS},
    COMPLETIONS: {"model": MODEL, "prompt": "hello there"},
    EMBEDDINGS: {"model": "text-embedding-3-small", "input": "hello there"},
}
FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- calling the proxy ------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    upstream_calls: int
    ledger_growth: int
    new_entries: list[JsonDict] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)

    def describe(self) -> str:
        return (
            f"status={self.status} upstream_calls={self.upstream_calls} "
            f"ledger_growth={self.ledger_growth} body={self.body[:400]!r}"
        )


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def ledger(redis_client: aioredis.Redis) -> list[JsonDict]:
    return [fields for _id, fields in await redis_client.xrange(LEDGER_A)]


async def send(
    proxy: Proxy,
    upstream_received: Any,
    redis_client: aioredis.Redis,
    path: str,
    data: bytes | None,
    *,
    headers: dict[str, str] | None = None,
    method: str = "POST",
    with_auth: bool = True,
    auto_decompress: bool = True,
    timeout: aiohttp.ClientTimeout = CLIENT_TIMEOUT,
) -> Reply:
    """One raw HTTP call; counts what reached the upstream and what the ledger gained."""
    calls_before = len(upstream_received())
    entries_before = await ledger(redis_client)
    sent = {**(auth() if with_auth else {}), "Content-Type": "application/json", **(headers or {})}
    try:
        async with (
            aiohttp.ClientSession(auto_decompress=auto_decompress, timeout=timeout) as session,
            session.request(method, proxy.url + path, data=data, headers=sent) as resp,
        ):
            body = await resp.read()
            status, resp_headers = resp.status, resp.headers
    except TimeoutError:
        raise AssertionError(f"the proxy never finished its answer to {method} {path}") from None
    entries_after = await ledger(redis_client)
    return Reply(
        status=status,
        headers=resp_headers,
        body=body,
        upstream_calls=len(upstream_received()) - calls_before,
        ledger_growth=len(entries_after) - len(entries_before),
        new_entries=entries_after[len(entries_before) :],
    )


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def assert_no_traceback(reply: Reply) -> None:
    assert b"Traceback" not in reply.body, reply.describe()
    assert b'File "' not in reply.body, reply.describe()
    assert b"Internal proxy error" not in reply.body, reply.describe()


def assert_openai_error(reply: Reply) -> JsonDict:
    """A JSON body ``{"error": {"message": str, "type": str, "param": ..., "code": ...}}``."""
    assert reply.headers.get("Content-Type", "").startswith("application/json"), reply.describe()
    body = reply.json()
    assert isinstance(body, dict) and set(body) == {"error"}, reply.describe()
    error = body["error"]
    assert isinstance(error, dict), reply.describe()
    assert isinstance(error.get("message"), str) and error["message"], reply.describe()
    assert isinstance(error.get("type"), str) and error["type"], reply.describe()
    assert "param" in error and "code" in error, reply.describe()
    return error


def assert_refused(reply: Reply, status: int | None = None) -> JsonDict:
    """The proxy's own 4xx: OpenAI format, nothing forwarded, nothing billed."""
    assert_no_traceback(reply)
    if status is not None:
        assert reply.status == status, reply.describe()
    assert 400 <= reply.status < 500, reply.describe()
    assert reply.upstream_calls == 0, reply.describe()
    assert reply.ledger_growth == 0, reply.describe()
    return assert_openai_error(reply)


def assert_contract(reply: Reply) -> None:
    """Either refused (4xx, nothing forwarded or billed) or forwarded once and billed once."""
    assert_no_traceback(reply)
    if reply.upstream_calls == 0:
        assert_refused(reply)
        return
    assert reply.upstream_calls == 1, reply.describe()
    assert reply.ledger_growth == 1, reply.describe()
    (entry,) = reply.new_entries
    if reply.headers.get("Content-Type", "").startswith("text/event-stream"):
        assert reply.status == 200, reply.describe()
        assert b": billing " in reply.body, reply.describe()
    else:
        assert reply.headers.get("x-billing-outcome") == entry["outcome"], reply.describe()
        if reply.status != 200:
            assert_openai_error(reply)
    if reply.status == 200:
        assert entry["outcome"] in ("ok", "truncated", "refused"), (entry, reply.describe())


@pytest.fixture
def post(proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis) -> Any:
    async def call(path: str, data: bytes | None, **kwargs: Any) -> Reply:
        return await send(proxy, lambda: fake.received, redis_client, path, data, **kwargs)

    return call


# -- the proxy's own refusals: malformed and mistyped bodies ----------------------------------


NOT_JSON = [
    b"",
    b"{",
    b"{'model': 'gpt-4o-mini'}",
    b'{"model": "gpt-4o-mini",}',
    b"model=gpt-4o-mini",
    b"\x00\x01\x02",
]
NOT_AN_OBJECT = [b"[]", b"null", b"5", b'"text"', b"true", b"[{}]", dumps([VALID[CHAT]])]


@pytest.mark.parametrize("path", BILLED_PATHS)
@pytest.mark.parametrize("data", NOT_JSON + NOT_AN_OBJECT, ids=repr)
async def test_body_that_is_not_a_json_object_is_a_400(post: Any, path: str, data: bytes) -> None:
    reply = await post(path, data)
    error = assert_refused(reply, 400)
    assert error["type"] == "invalid_request_error"


def _with(path: str, **changes: Any) -> JsonDict:
    body = dict(VALID[path])
    for key, value in changes.items():
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


_DROP = object()

CHAT_BAD: list[tuple[str, JsonDict]] = [
    ("model", _with(CHAT, model=_DROP)),
    ("model", _with(CHAT, model=5)),
    ("model", _with(CHAT, model=None)),
    ("model", _with(CHAT, model="")),
    ("model", _with(CHAT, model=["gpt-4o-mini"])),
    ("model", _with(CHAT, model="m" * 10_000)),
    ("messages", _with(CHAT, messages=_DROP)),
    ("messages", _with(CHAT, messages="x")),
    ("messages", _with(CHAT, messages=[])),
    ("messages", _with(CHAT, messages=["hello"])),
    ("messages", _with(CHAT, messages={"role": "user", "content": "hi"})),
    ("stream", _with(CHAT, stream="yes")),
    ("stream", _with(CHAT, stream=1)),
    ("stream", _with(CHAT, stream="true")),
    ("stream_options", _with(CHAT, stream=True, stream_options="include_usage")),
    ("stream_options", _with(CHAT, stream=True, stream_options={"include_usage": "no"})),
    ("stream_options", _with(CHAT, stream=True, stream_options={"include_usage": 0})),
    ("max_tokens", _with(CHAT, max_tokens="10")),
    ("max_tokens", _with(CHAT, max_tokens=1e30)),
    ("max_tokens", _with(CHAT, max_tokens=10.0)),
    ("max_tokens", _with(CHAT, max_tokens=-1)),
    ("max_tokens", _with(CHAT, max_tokens=0)),
    ("max_tokens", _with(CHAT, max_tokens=True)),
    ("max_tokens", _with(CHAT, max_tokens=10**30)),
    ("max_completion_tokens", _with(CHAT, max_completion_tokens=-5)),
    ("max_completion_tokens", _with(CHAT, max_completion_tokens="5")),
    ("n", _with(CHAT, n=-1)),
    ("n", _with(CHAT, n=0)),
    ("n", _with(CHAT, n=10**9)),
    ("n", _with(CHAT, n="2")),
    ("n", _with(CHAT, n=2.0)),
    ("response_format", _with(CHAT, response_format="json")),
    ("tools", _with(CHAT, tools={"type": "function"})),
]
COMPLETION_BAD: list[tuple[str, JsonDict]] = [
    ("model", _with(COMPLETIONS, model=_DROP)),
    ("model", _with(COMPLETIONS, model=5)),
    ("prompt", _with(COMPLETIONS, prompt=_DROP)),
    ("prompt", _with(COMPLETIONS, prompt=5)),
    ("prompt", _with(COMPLETIONS, prompt=[1.5])),
    ("prompt", _with(COMPLETIONS, prompt={"text": "hi"})),
    ("stream", _with(COMPLETIONS, stream="yes")),
    ("stream_options", _with(COMPLETIONS, stream=True, stream_options={"include_usage": "false"})),
    ("max_tokens", _with(COMPLETIONS, max_tokens="10")),
    ("max_tokens", _with(COMPLETIONS, max_tokens=1e30)),
    ("max_tokens", _with(COMPLETIONS, max_tokens=-1)),
    ("n", _with(COMPLETIONS, n=0)),
    ("n", _with(COMPLETIONS, n=10**9)),
]
EMBEDDING_BAD: list[tuple[str, JsonDict]] = [
    ("model", _with(EMBEDDINGS, model=_DROP)),
    ("model", _with(EMBEDDINGS, model=5)),
    ("input", _with(EMBEDDINGS, input=_DROP)),
    ("input", _with(EMBEDDINGS, input=5)),
    ("input", _with(EMBEDDINGS, input={"text": "hi"})),
    ("input", _with(EMBEDDINGS, input=[None])),
    ("input", _with(EMBEDDINGS, input=[1.5])),
]
TYPED_CASES = (
    [(CHAT, p, b) for p, b in CHAT_BAD]
    + [(COMPLETIONS, p, b) for p, b in COMPLETION_BAD]
    + [(EMBEDDINGS, p, b) for p, b in EMBEDDING_BAD]
)


@pytest.mark.parametrize(
    ("path", "param", "body"),
    TYPED_CASES,
    ids=[f"{path.rsplit('/', 1)[1]}-{param}-{i}" for i, (path, param, _b) in enumerate(TYPED_CASES)],
)
async def test_missing_or_mistyped_field_is_a_400_naming_it(
    post: Any, path: str, param: str, body: JsonDict
) -> None:
    reply = await post(path, dumps(body))
    error = assert_refused(reply, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].split(".")[0] == param, error


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("value", ["no", "false", "true", 0, 1, [], {}], ids=repr)
async def test_a_non_boolean_include_usage_is_refused_as_openai_refuses_it(
    post: Any, redis_client: aioredis.Redis, path: str, value: Any
) -> None:
    # Was forced to true and forwarded: a 200 stream, where OpenAI answers 400 invalid_type (and
    # a truthy one the client may have meant as "yes" lost its usage chunk to the stripping).
    body = _with(path, stream=True, stream_options={"include_usage": value})
    reply = await post(path, dumps(body), headers={"X-Run-Id": "usage-typed"})
    error = assert_refused(reply, 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", "stream_options.include_usage")
    assert await redis_client.hgetall("lbp:{team-a}:run:usage-typed") == {}  # nothing reserved


@pytest.mark.parametrize(
    "literal",
    [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"10.5", b'"NaN"'],
)
async def test_non_integer_number_literals_for_max_tokens_are_a_400(post: Any, literal: bytes) -> None:
    data = (
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_tokens":' + literal + b"}"
    )
    error = assert_refused(await post(CHAT, data), 400)
    assert error["param"] in (None, "max_tokens")  # not JSON at all, or not an integer


async def test_huge_integer_literal_is_a_400_not_a_500(post: Any) -> None:
    # 5000 digits: Python's int parser refuses it with a ValueError that is not a JSONDecodeError.
    data = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"n":' + b"9" * 5000 + b"}"
    assert_refused(await post(CHAT, data), 400)


async def test_huge_integer_literal_in_a_passthrough_field_is_refused_or_billed(post: Any) -> None:
    data = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"seed":' + b"7" * 5000 + b"}"
    assert_contract(await post(CHAT, data))


@pytest.mark.parametrize("depth", [100_000, 5_000])
async def test_deeply_nested_body_is_a_400_not_a_500(post: Any, depth: int) -> None:
    data = b"[" * depth + b"]" * depth
    assert_refused(await post(CHAT, data), 400)


async def test_deeply_nested_passthrough_field_is_refused_or_billed(post: Any) -> None:
    nested = b"[" * 5_000 + b"]" * 5_000
    data = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"metadata":' + nested + b"}"
    assert_contract(await post(CHAT, data))


# -- encodings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"\xff\xfe"}]}',
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"caf\xc3"}]}',
        b'{"model":"gpt-\xc3\x28","messages":[{"role":"user","content":"hi"}]}',
        b"\xef\xbb\xbf" + dumps(VALID[CHAT]),  # UTF-8 byte order mark
        dumps(VALID[CHAT]).decode().encode("utf-16"),
    ],
    ids=["ff-fe", "truncated-sequence", "bad-in-model", "utf8-bom", "utf16"],
)
async def test_invalid_utf8_is_refused_or_billed(post: Any, data: bytes) -> None:
    reply = await post(CHAT, data)
    assert_contract(reply)


async def test_invalid_utf8_in_content_is_a_400(post: Any) -> None:
    data = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"\xff\xfe"}]}'
    error = assert_refused(await post(CHAT, data), 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "data"),
    [
        (CHAT, b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi \\ud800"}]}'),
        (CHAT, b'{"model":"gpt-4o-\\udfff","messages":[{"role":"user","content":"hi"}]}'),
        (CHAT, b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"user":"\\ud83d"}'),
        (COMPLETIONS, b'{"model":"gpt-4o-mini","prompt":"\\ud800\\ud800"}'),
        (EMBEDDINGS, b'{"model":"text-embedding-3-small","input":["ok","\\udc00"]}'),
    ],
    ids=["chat-content", "model", "passthrough-field", "completions-prompt", "embeddings-input"],
)
async def test_lone_surrogate_escape_is_refused_or_billed_never_a_500(
    post: Any, path: str, data: bytes
) -> None:
    """``"\\ud800"`` is valid JSON text but no valid Unicode string: it cannot be UTF-8 encoded."""
    reply = await post(path, data)
    assert_contract(reply)


@pytest.mark.parametrize(
    "number", [b"99999999999999999999", b"18446744073709551616", b"-9223372036854775809", b"9" * 300]
)
async def test_an_integer_past_64_bits_is_refused_not_changed(post: Any, number: bytes) -> None:
    """orjson reads it as a float: the upstream got 1e+20 for 99999999999999999999."""
    data = (
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
        b'"function":{"name":"f","parameters":{"type":"object","maximum":%s}}}]}' % number
    )
    error = assert_refused(await post(CHAT, data), 400)
    assert "64 bits" in error["message"]


async def test_integers_at_the_64_bit_edges_and_long_digit_strings_go_as_they_came(
    post: Any, fake: FakeUpstream
) -> None:
    data = (
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"call 123456789012345678901234"}],'
        b'"metadata":{"a":"99999999999999999999"},"seed":18446744073709551615,"logit_bias":{"1":-9223372036854775808}}'
    )
    reply = await post(CHAT, data)
    assert reply.status == 200, reply.describe()
    raw = fake.received[-1].raw
    assert b'"seed":18446744073709551615' in raw and b'"1":-9223372036854775808' in raw, raw


async def test_duplicate_keys_last_one_is_validated_and_refused(post: Any) -> None:
    data = b'{"model":"gpt-4o-mini","model":5,"messages":[{"role":"user","content":"hi"}]}'
    error = assert_refused(await post(CHAT, data), 400)
    assert error["param"] == "model"


@pytest.mark.parametrize(("first", "last"), [(1, 100_000), (100_000, 1), (5, 7)])
async def test_duplicate_keys_forward_exactly_what_was_validated_and_reserved(
    post: Any, fake: FakeUpstream, first: int, last: int
) -> None:
    """No smuggling: the value reserved for is the value the upstream sees, and only once."""
    data = (
        b'{"model":"gpt-4o-mini","max_tokens":%d,"messages":[{"role":"user","content":"hi"}],'
        b'"max_tokens":%d}' % (first, last)
    )
    reply = await post(CHAT, data, headers={"X-Run-Id": "dup-keys"})
    assert_contract(reply)
    assert reply.status == 200, reply.describe()
    sent = fake.received[-1]
    assert sent.raw.count(b'"max_tokens"') == 1, sent.raw
    # the upstream is never allowed more than the reserve: above the model's cap it is lowered
    assert sent.body["max_tokens"] == min(last, 1000)
    (entry,) = reply.new_entries
    assert int(entry["reserved_output_tokens"]) == min(last, 1000)  # model max_output_tokens 1000


async def test_duplicate_stream_key_streams_as_validated(post: Any, fake: FakeUpstream) -> None:
    data = b'{"model":"gpt-4o-mini","stream":false,"messages":[{"role":"user","content":"hi"}],"stream":true}'
    reply = await post(CHAT, data)
    assert_contract(reply)
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    assert fake.received[-1].body["stream"] is True
    assert reply.new_entries[0]["stream"] == "1"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "text-embedding-3-small", "input": "hi", "stream": True, "stream_options": [1]},
        {"model": "text-embedding-3-small", "input": "hi", "stream": True, "stream_options": "x"},
        {"model": "text-embedding-3-small", "input": "hi", "stream": "yes", "n": "many"},
        {"model": "text-embedding-3-small", "input": "hi", "n": [1, 2]},
        {"model": "text-embedding-3-small", "input": "", "n": {"": None}},
        {"model": "text-embedding-3-small", "input": "hi", "n": 2.5},
    ],
    ids=["stream-options-list", "stream-options-str", "stream-str", "n-list", "n-object", "n-float"],
)
async def test_embeddings_with_chat_only_fields_is_refused_or_billed(post: Any, body: JsonDict) -> None:
    """``stream``/``n`` are not embeddings fields; the proxy must not trip over them."""
    assert_contract(await post(EMBEDDINGS, dumps(body)))


@pytest.mark.parametrize("stream", [True, "yes", "false", [1]], ids=repr)
async def test_a_stream_field_on_embeddings_does_not_make_the_call_a_stream(post: Any, stream: Any) -> None:
    """Embeddings have no ``stream``: one sent is passed through unread. It was read all the same
    (pydantic hands an unvalidated extra to ``getattr``, and ``bool("false")`` is true): the call
    was run as a stream (its time bounded only by the upstream's silences, its lease renewed)
    and its ledger entry said ``stream: 1`` for a JSON answer."""
    body = {"model": "text-embedding-3-small", "input": "hi", "stream": stream}
    reply = await post(EMBEDDINGS, dumps(body))
    assert_contract(reply)
    assert reply.new_entries[0]["stream"] == "0", reply.new_entries  # was "1"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "x", "tool_calls": 5}],
        [{"role": "assistant", "content": "x", "tool_calls": True}],
        [{"role": "assistant", "content": "x", "tool_calls": 1.5}],
        [{"role": "assistant", "content": "x", "tool_calls": "call"}],
        [{"role": "assistant", "content": "x", "tool_calls": [5, None, {"function": 3}]}],
        [{"role": "user", "content": [5, None, {"text": 7}, {"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": {"text": "hi"}}],
        [{"role": "user", "content": None, "name": 5, "refusal": []}],
        [{}],
    ],
    ids=[
        "tool-calls-int",
        "tool-calls-bool",
        "tool-calls-float",
        "tool-calls-str",
        "tool-calls-odd-items",
        "content-parts-odd",
        "content-dict",
        "odd-name-refusal",
        "empty-message",
    ],
)
async def test_odd_message_shapes_are_refused_or_billed(post: Any, messages: list[Any]) -> None:
    assert_contract(await post(CHAT, dumps({"model": MODEL, "messages": messages})))


# -- size limits ------------------------------------------------------------------------------


async def test_body_over_the_default_limit_is_a_413(post: Any, proxy: Proxy) -> None:
    limit = proxy.config.limits.max_body_bytes
    assert limit == 4 * 1024 * 1024
    content = "word " * ((limit // 5) + 10)
    data = dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert len(data) > limit
    error = assert_refused(await post(CHAT, data), 413)
    assert (error["type"], error["code"]) == ("invalid_request_error", "body_too_large")


async def test_body_size_limit_boundary(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    proxy = await make_proxy(limits={"max_body_bytes": 4096})
    base = dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}]})
    pad = 4096 - len(base)

    def body(extra: int) -> bytes:
        return dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * (pad + extra)}]})

    at_limit = await send(proxy, lambda: fake.received, redis_client, CHAT, body(0))
    assert len(body(0)) == 4096
    assert at_limit.status == 200, at_limit.describe()
    assert_contract(at_limit)
    over = await send(proxy, lambda: fake.received, redis_client, CHAT, body(1))
    assert_refused(over, 413)


async def test_a_reloaded_body_limit_applies_to_the_next_calls(
    make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # Was: the limit the app was built with, whatever a reload said.
    proxy = await make_proxy(limits={"max_body_bytes": 4096})
    state = proxy.app[STATE]
    data = dumps({"model": MODEL, "messages": [{"role": "user", "content": "x " * 5000}]})
    assert_refused(await send(proxy, lambda: fake.received, redis_client, CHAT, data), 413)
    state.config = state.config.model_copy(
        update={"limits": state.config.limits.model_copy(update={"max_body_bytes": 1024 * 1024})}
    )
    raised = await send(proxy, lambda: fake.received, redis_client, CHAT, data)
    assert raised.status == 200, raised.describe()
    state.config = state.config.model_copy(
        update={"limits": state.config.limits.model_copy(update={"max_body_bytes": 2048})}
    )
    small = dumps({"model": MODEL, "messages": [{"role": "user", "content": "x " * 1500}]})
    assert_refused(await send(proxy, lambda: fake.received, redis_client, CHAT, small), 413)


async def test_an_unknown_expectation_is_refused_in_openais_format(proxy: Proxy) -> None:
    body = dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {KEY_A}\r\n"
    port = int(proxy.url.rsplit(":", 1)[1])

    async def exchange(expect: str) -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"{head}Expect: {expect}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        out = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return out.partition(b"\r\n\r\n")[0], out

    status_line, whole = await exchange("foo")
    assert status_line.startswith(b"HTTP/1.1 417") and b"application/json" in status_line, whole
    assert json.loads(whole.rsplit(b"\r\n\r\n", 1)[1])["error"]["code"] == "expectation_failed"
    # On /v1/messages, as every error there, in Anthropic's format.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"{head.replace(CHAT, '/v1/messages')}Expect: foo\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    anthropic = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert json.loads(anthropic.rsplit(b"\r\n\r\n", 1)[1])["type"] == "error", anthropic
    status_line, whole = await exchange("100-continue")  # the expected kind still works
    assert status_line.startswith(b"HTTP/1.1 100 Continue"), whole
    assert b"HTTP/1.1 200" in whole and b'"chat.completion"' in whole


async def test_a_caller_it_does_not_know_is_refused_before_it_sends_its_body(proxy: Proxy) -> None:
    """With ``Expect: 100-continue`` a client waits for the go-ahead before it uploads its body
    (curl does for large ones): a wrong key (or a run id the proxy refuses) is refused then, in the
    API's format, the body never asked for. A known key still gets its 100 Continue (the test above)."""
    port = int(proxy.url.rsplit(":", 1)[1])
    asks = [
        (CHAT, "Authorization: Bearer sk-proxy-nobody", 401),
        ("/v1/messages", "Authorization: Bearer sk-proxy-nobody", 401),
        ("/v1/messages", "x-api-key: sk-proxy-nobody", 401),  # the anthropic SDK's header
        (CHAT, f"Authorization: Bearer {KEY_A}\r\nX-Run-Id: not a run id", 400),
    ]
    for path, auth, status in asks:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Type: application/json\r\n"
            "Expect: 100-continue\r\nContent-Length: 50000000\r\n\r\n".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(f"HTTP/1.1 {status}".encode()), head
        # A keep-alive client that leaves the body unsent must not have its next request read as
        # that body: the connection ends with the answer.
        assert b"\r\nconnection: close\r\n" in head.lower(), head
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:]
        )
        error = json.loads(await asyncio.wait_for(reader.readexactly(length), 5))
        writer.close()
        if status == 400:
            assert error["error"]["param"] == "X-Run-Id", error
        elif path == CHAT:
            assert error["error"]["code"] == "invalid_api_key", error
        else:
            assert error["type"] == "error" and error["error"]["type"] == "authentication_error", error


async def test_gzip_body_is_limited_by_its_decoded_size(post: Any) -> None:
    content = "word " * (1024 * 1024)  # 5 MiB decoded, a few KiB on the wire
    data = gzip.compress(dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}))
    assert len(data) < 100_000
    assert_refused(await post(CHAT, data, headers={"Content-Encoding": "gzip"}), 413)


def _compressed(raw: bytes, encoding: str) -> bytes:
    if encoding == "br":
        import brotli

        return bytes(brotli.compress(raw))
    if encoding == "zstd":
        from backports import zstd

        return zstd.compress(raw)
    return gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_body_that_fails_to_decompress_is_a_400(post: Any, encoding: str) -> None:
    """Said as the parser's refusals are, in words of the proxy's own: aiohttp's own text is its
    exception's repr ("400, message:\n  Can not decode content-encoding: gzip")."""
    reply = await post(CHAT, b"this is not compressed", headers={"Content-Encoding": encoding})
    error = assert_refused(reply, 400)
    assert error == {
        "message": "The request is not valid HTTP: the body does not decode as its Content-Encoding says.",
        "type": "invalid_request_error",
        "param": None,
        "code": "bad_http_request",
    }, error


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_compressed_valid_body_is_billed(post: Any, encoding: str) -> None:
    """Every encoding aiohttp's parser knows is decoded (br and zstd were a plain-text 400
    naming a missing package, from the parser, before any handler)."""
    data = _compressed(dumps(VALID[CHAT]), encoding)
    reply = await post(CHAT, data, headers={"Content-Encoding": encoding})
    assert_contract(reply)
    assert reply.status == 200, reply.describe()


# -- headers ----------------------------------------------------------------------------------


async def test_large_header_below_the_server_limit_is_a_normal_call(post: Any) -> None:
    reply = await post(CHAT, dumps(VALID[CHAT]), headers={"X-Padding": "p" * 7000})
    assert_contract(reply)
    assert reply.status == 200, reply.describe()


HUGE_HEADERS: dict[str, dict[str, str]] = {
    "custom": {"X-Padding": "p" * 20_000},
    "authorization": {"Authorization": "Bearer " + "k" * 20_000},
    "run-id": {"X-Run-Id": "r" * 20_000},
    "many": {f"X-H{i}": "v" * 100 for i in range(400)},
}


@pytest.mark.parametrize("name", list(HUGE_HEADERS))
async def test_huge_headers_are_refused_without_forwarding_or_stack_trace(post: Any, name: str) -> None:
    reply = await post(CHAT, dumps(VALID[CHAT]), headers=HUGE_HEADERS[name])
    assert_no_traceback(reply)
    assert 400 <= reply.status < 500, reply.describe()
    assert reply.upstream_calls == 0 and reply.ledger_growth == 0, reply.describe()


@pytest.mark.parametrize("name", ["custom", "authorization"])
async def test_huge_header_refusal_is_in_openai_format(post: Any, name: str) -> None:
    """The contract: every 4xx the proxy answers is an OpenAI error object, even those the
    HTTP server layer produces before any handler or middleware runs."""
    reply = await post(CHAT, dumps(VALID[CHAT]), headers=HUGE_HEADERS[name])
    assert_refused(reply)


@pytest.mark.parametrize(
    "run_id",
    [
        "r" * 129,
        "r" * 5000,
        "a b",
        "a/b",
        "../other",
        "{team-b}",
        "run*",
        "caf\u00e9",
        "",
        "x\ty",
        "id;DEL lbp",
    ],
    ids=lambda v: repr(v)[:20],
)
async def test_invalid_run_id_is_a_400(post: Any, run_id: str) -> None:
    headers = {"X-Run-Id": run_id}
    try:
        reply = await post(CHAT, dumps(VALID[CHAT]), headers=headers)
    except ValueError:  # aiohttp refuses to send some values (control characters)
        pytest.skip("client cannot send this header value")
    error = assert_refused(reply, 400)
    assert error["param"] == "X-Run-Id"


async def test_run_id_at_the_length_limit_is_accepted(post: Any, redis_client: aioredis.Redis) -> None:
    run_id = "R" * 128
    reply = await post(CHAT, dumps(VALID[CHAT]), headers={"X-Run-Id": run_id})
    assert_contract(reply)
    assert reply.status == 200
    assert reply.new_entries[0]["run_id"] == run_id
    assert await redis_client.exists(f"lbp:{{team-a}}:run:{run_id}")


async def test_invalid_request_id_is_replaced_not_echoed(post: Any) -> None:
    reply = await post(CHAT, dumps(VALID[CHAT]), headers={"X-Request-Id": "bad id <script>"})
    assert_contract(reply)
    assert reply.status == 200
    assert reply.headers["x-request-id"] != "bad id <script>"
    assert "<script>" not in reply.new_entries[0]["request_id"]


# -- unknown paths, wrong methods -------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/images/generations"),
        ("POST", "/v1/audio/speech"),
        ("POST", "/v1/fine_tuning/jobs"),
        ("POST", "/v2/x"),
        ("POST", "/"),
        ("GET", "/"),
        ("POST", "/v1/chat/completions/extra"),
        ("POST", "/v1/chat//completions"),
        ("POST", "/V1/CHAT/COMPLETIONS"),
        ("GET", "/v1/billing/nothing"),
        ("POST", "/v1/../v1/images/generations"),
    ],
)
@pytest.mark.parametrize("with_auth", [True, False], ids=["key", "no-key"])
async def test_unknown_path_is_a_404_in_openai_format(
    post: Any, method: str, path: str, with_auth: bool
) -> None:
    reply = await post(path, dumps(VALID[CHAT]), method=method, with_auth=with_auth)
    error = assert_refused(reply, 404)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", CHAT),
        ("PUT", CHAT),
        ("DELETE", CHAT),
        ("PATCH", COMPLETIONS),
        ("GET", EMBEDDINGS),
        ("POST", "/healthz"),
        ("POST", "/v1/models"),
    ],
)
@pytest.mark.parametrize("with_auth", [True, False], ids=["key", "no-key"])
async def test_wrong_method_is_a_405_in_openai_format(
    post: Any, method: str, path: str, with_auth: bool
) -> None:
    reply = await post(path, None, method=method, with_auth=with_auth)
    error = assert_refused(reply, 405)
    assert error["type"] == "invalid_request_error"
    # RFC 9110 asks a 405 for the methods the path takes.
    allowed = {m.strip() for m in reply.headers["Allow"].split(",")}
    assert allowed and method not in allowed, reply.describe()


# -- property-based: request bodies -----------------------------------------------------------

NOT_FAKE = st.text(max_size=10).filter(lambda k: k != "fake")
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63, 10**20])
    | st.floats()
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(NOT_FAKE, kids, max_size=4),
    max_leaves=12,
)


def valid_or_any(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the valid value, sometimes any JSON value."""
    return st.one_of(valid, valid, JSON_VALUES)


SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
TEXT_PARTS = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}) | JSON_VALUES, max_size=3
)
# A message is a free-form object to the proxy: any extra field passes through, but the fields
# it reads to estimate the prompt (content, name, refusal, tool_calls) may hold anything.
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.text(max_size=30) | TEXT_PARTS | SCALARS,
    },
    optional={
        "name": SCALARS,
        "refusal": SCALARS,
        "tool_calls": SCALARS
        | st.lists(
            st.fixed_dictionaries({}, optional={"function": SCALARS | st.dictionaries(NOT_FAKE, SCALARS)})
            | SCALARS,
            max_size=2,
        ),
    },
)
SMALL_COUNT = st.integers(min_value=1, max_value=40)
TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=100_000), max_size=5)
PROMPTS = (
    st.text(max_size=30)
    | st.lists(st.text(max_size=10), max_size=3)
    | TOKEN_IDS
    | st.lists(TOKEN_IDS, max_size=2)
)
STREAM_FIELDS = {
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | SCALARS}),
    "max_tokens": SMALL_COUNT,
    "n": st.integers(min_value=1, max_value=3),
    "temperature": JSON_VALUES,
    "user": JSON_VALUES,
}
# Valid values per endpoint; the bodies below corrupt up to two of them.
FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    CHAT: {
        "model": st.just(MODEL),
        "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        **STREAM_FIELDS,
        "max_completion_tokens": SMALL_COUNT,
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}) | JSON_VALUES, max_size=2),
    },
    COMPLETIONS: {"model": st.just(MODEL), "prompt": PROMPTS, **STREAM_FIELDS},
    EMBEDDINGS: {
        "model": st.just("text-embedding-3-small"),
        "input": PROMPTS,
        "encoding_format": st.just("float"),
        "dimensions": JSON_VALUES,
        # not embeddings fields, but clients send them anyway
        **STREAM_FIELDS,
    },
}
REQUIRED = {CHAT: ("model", "messages"), COMPLETIONS: ("model", "prompt"), EMBEDDINGS: ("model", "input")}


@st.composite
def mixed_bodies(draw: st.DrawFn, path: str) -> JsonDict:
    """A valid body for ``path`` with up to two fields replaced by any JSON value or dropped,
    plus a few unknown fields."""
    fields = FIELDS[path]
    extras = draw(st.dictionaries(NOT_FAKE.filter(lambda k: k not in fields), JSON_VALUES, max_size=2))
    body: JsonDict = dict(extras)
    for name, strategy in fields.items():
        if name in REQUIRED[path] or draw(st.booleans()):
            body[name] = draw(strategy)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        if draw(st.integers(min_value=0, max_value=4)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(JSON_VALUES)
    return body


BODIES = {path: mixed_bodies(path) for path in BILLED_PATHS}


def encode_body(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@FUZZ
@given(value=JSON_VALUES, path=st.sampled_from(BILLED_PATHS))
async def test_fuzz_any_json_value_as_body(post: Any, value: Any, path: str) -> None:
    assert_contract(await post(path, encode_body(value)))


@settings(FUZZ, max_examples=60)
@given(body=BODIES[CHAT])
async def test_fuzz_chat_bodies(post: Any, body: JsonDict) -> None:
    assert_contract(await post(CHAT, encode_body(body)))


@FUZZ
@given(body=BODIES[COMPLETIONS])
async def test_fuzz_completion_bodies(post: Any, body: JsonDict) -> None:
    assert_contract(await post(COMPLETIONS, encode_body(body)))


@FUZZ
@given(body=BODIES[EMBEDDINGS])
async def test_fuzz_embedding_bodies(post: Any, body: JsonDict) -> None:
    assert_contract(await post(EMBEDDINGS, encode_body(body)))


@settings(FUZZ, max_examples=30)
@given(data=st.binary(max_size=300), path=st.sampled_from(BILLED_PATHS))
async def test_fuzz_random_bytes_as_body(post: Any, data: bytes, path: str) -> None:
    assert_contract(await post(path, data))


# -- property-based: upstream answers ---------------------------------------------------------


@dataclass
class Plan:
    """What the scripted upstream answers next."""

    status: int = 200
    content_type: str = "application/json"
    chunks: list[bytes] = field(default_factory=list)
    extra_headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


GOOD_BODY = dumps(
    {
        "id": "chatcmpl-good",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
)


class ScriptedUpstream:
    """An upstream that answers whatever ``plan`` says, byte for byte."""

    def __init__(self) -> None:
        self.plan = Plan(chunks=[GOOD_BODY])
        self.received: list[bytes] = []
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.read())
        plan = self.plan
        resp = web.StreamResponse(
            status=plan.status, headers={"Content-Type": plan.content_type, **plan.extra_headers}
        )
        await resp.prepare(request)
        try:
            for i, chunk in enumerate(plan.chunks):
                if i and plan.delay_s:
                    await asyncio.sleep(plan.delay_s)
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedUpstream]:
    upstream = ScriptedUpstream()
    await upstream.start()
    yield upstream
    await upstream.close()


def scripted_upstreams(base_url: str) -> JsonDict:
    return {
        "openai": {
            "base_url": base_url,
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": 5,
            "connect_timeout_s": 2,
        }
    }


# The scripted upstream answers at once: a proxy still silent after this never finishes (with
# room for a loaded machine: a hang fails all the same).
SCRIPTED_TIMEOUT = aiohttp.ClientTimeout(total=10)


@pytest.fixture
async def fuzz_proxy(make_proxy: ProxyFactory, scripted: ScriptedUpstream) -> Proxy:
    return await make_proxy(upstreams=scripted_upstreams(scripted.base_url))


@pytest.fixture
def post_scripted(fuzz_proxy: Proxy, scripted: ScriptedUpstream, redis_client: aioredis.Redis) -> Any:
    async def call(path: str, data: bytes | None, **kwargs: Any) -> Reply:
        kwargs.setdefault("timeout", SCRIPTED_TIMEOUT)
        return await send(fuzz_proxy, lambda: scripted.received, redis_client, path, data, **kwargs)

    return call


COUNTS = st.one_of(
    st.integers(min_value=0, max_value=1000),
    st.sampled_from([-1, 2**53 + 1, 10**17, 10**20, 2**63, 2**64]),
    JSON_VALUES,
)
USAGE = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": COUNTS,
        "completion_tokens": COUNTS,
        "total_tokens": COUNTS,
        "prompt_tokens_details": valid_or_any(st.fixed_dictionaries({"cached_tokens": COUNTS})),
        "completion_tokens_details": valid_or_any(st.fixed_dictionaries({"reasoning_tokens": COUNTS})),
    },
)
PART = st.fixed_dictionaries(
    {},
    optional={
        "role": valid_or_any(st.just("assistant")),
        "content": valid_or_any(st.text(max_size=20)),
        "refusal": JSON_VALUES,
        "tool_calls": JSON_VALUES,
    },
)
FINISH = st.sampled_from(["stop", "length", "content_filter", "tool_calls", None]) | JSON_VALUES


def choice(part_key: str) -> st.SearchStrategy[JsonDict]:
    return st.fixed_dictionaries(
        {},
        optional={
            "index": valid_or_any(st.integers(min_value=0, max_value=3)),
            part_key: valid_or_any(PART),
            "finish_reason": FINISH,
            "text": JSON_VALUES,
        },
    )


def answer(part_key: str) -> st.SearchStrategy[JsonDict]:
    return st.fixed_dictionaries(
        {},
        optional={
            "id": JSON_VALUES,
            "object": JSON_VALUES,
            "choices": valid_or_any(st.lists(choice(part_key), max_size=3)),
            "usage": valid_or_any(USAGE),
            "error": JSON_VALUES,
        },
    )


STATUSES = st.sampled_from([200, 200, 200, 200, 201, 400, 401, 404, 422, 429, 500, 502, 503])
CONTENT_TYPES = st.sampled_from(
    ["application/json", "application/json", "text/event-stream", "text/html", "application/octet-stream"]
)


@st.composite
def body_plans(draw: st.DrawFn) -> tuple[Plan, bool]:
    """A whole-body answer, and whether it is unparsable (not a JSON object)."""
    kind = draw(st.sampled_from(["answer", "json", "bytes"]))
    if kind == "answer":
        raw = dumps(draw(answer("message")))
    elif kind == "json":
        raw = json.dumps(draw(JSON_VALUES)).encode()
    else:
        raw = draw(st.binary(max_size=200))
    try:
        unparsable = not isinstance(json.loads(raw), dict)
    except ValueError:
        unparsable = True
    cut = draw(st.integers(min_value=0, max_value=len(raw)))
    plan = Plan(
        status=draw(STATUSES),
        content_type=draw(CONTENT_TYPES),
        chunks=[raw[:cut], raw[cut:]],
        extra_headers=draw(st.sampled_from([{}, {}, {"Content-Encoding": "gzip"}])),
    )
    return plan, unparsable


def assert_billed_once(reply: Reply, plan: Plan) -> JsonDict:
    assert_no_traceback(reply)
    assert reply.upstream_calls == 1, reply.describe()
    assert reply.ledger_growth == 1, reply.describe()
    assert reply.status != 500 or plan.status == 500, reply.describe()
    return reply.new_entries[0]


async def assert_still_serving(post_scripted: Any, scripted: ScriptedUpstream) -> None:
    scripted.plan = Plan(chunks=[GOOD_BODY])
    reply = await post_scripted(CHAT, dumps(VALID[CHAT]))
    assert reply.status == 200, reply.describe()
    assert reply.ledger_growth == 1, reply.describe()
    assert reply.new_entries[0]["outcome"] == "ok"


@settings(FUZZ, max_examples=100)
@given(plan_and_flag=body_plans(), stream=st.booleans())
async def test_fuzz_upstream_whole_body_answers(
    post_scripted: Any, scripted: ScriptedUpstream, plan_and_flag: tuple[Plan, bool], stream: bool
) -> None:
    plan, unparsable = plan_and_flag
    scripted.plan = plan
    reply = await post_scripted(CHAT, dumps({**VALID[CHAT], "stream": stream}))
    entry = assert_billed_once(reply, plan)
    # A stream call's success is read as a stream whatever its type, but for JSON (a provider
    # that ignored ``stream``): these bodies hold no event, so it ends as malformed SSE does.
    streamed = stream and plan.content_type != "application/json" and plan.status < 400
    if streamed:
        assert (reply.status, entry["outcome"]) == (200, "upstream_error"), reply.describe()
    else:
        assert reply.headers.get("x-billing-outcome") == entry["outcome"], reply.describe()
        if reply.status >= 400:
            body = reply.json()
            assert isinstance(body, dict) and "error" in body, reply.describe()
    if plan.status >= 500:
        assert entry["outcome"] == "upstream_error", entry
    elif plan.status >= 400:
        assert entry["outcome"] == "upstream_4xx", entry
    elif unparsable and not streamed and not plan.extra_headers:
        assert entry["outcome"] == "upstream_error", entry
        assert reply.status == 502, reply.describe()
    await assert_still_serving(post_scripted, scripted)


def chunk_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode()


WELL_FORMED_CHUNK = st.fixed_dictionaries(
    {
        "id": st.just("chatcmpl-x"),
        "object": st.just("chat.completion.chunk"),
        "choices": st.lists(
            st.fixed_dictionaries(
                {
                    "index": st.integers(min_value=0, max_value=2),
                    "delta": st.fixed_dictionaries({}, optional={"content": st.text(max_size=10)}),
                    "finish_reason": st.sampled_from([None, "stop", "length"]),
                }
            ),
            max_size=2,
        ),
    },
    optional={
        "usage": st.fixed_dictionaries({"prompt_tokens": SMALL_COUNT, "completion_tokens": SMALL_COUNT})
    },
).map(chunk_event)
ODD_EVENTS = st.one_of(
    answer("delta").map(chunk_event),
    JSON_VALUES.map(chunk_event),
    st.just(b": keep-alive"),
    st.just(b"event: ping"),
    st.just(b'event: error\ndata: {"error": {"message": "overloaded"}}'),
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda t: b"data: " + t.encode()),
)
GARBAGE_EVENT = b"data: {not json"


@st.composite
def stream_plans(draw: st.DrawFn) -> tuple[Plan, str]:
    """An SSE answer and what kind it is: well_formed, garbage (a data line that is not JSON) or
    odd (anything at all)."""
    kind = draw(st.sampled_from(["well_formed", "garbage", "odd"]))
    events = draw(st.lists(WELL_FORMED_CHUNK, max_size=5))
    if kind == "odd":
        events += draw(st.lists(ODD_EVENTS, min_size=1, max_size=4))
        events = draw(st.permutations(events))
    elif kind == "garbage":
        events.insert(draw(st.integers(min_value=0, max_value=len(events))), GARBAGE_EVENT)
    if kind != "odd" or draw(st.booleans()):
        events.append(b"data: [DONE]")
    newline = draw(st.sampled_from([b"\n", b"\r\n"]))
    raw = b"".join(e.replace(b"\n", newline) + newline + newline for e in events)
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(raw)), max_size=6)))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    plan = Plan(
        status=200,
        content_type="text/event-stream",
        chunks=[c for c in chunks if c],
        delay_s=0.002 if len(cuts) else 0.0,
    )
    return plan, kind


@settings(FUZZ, max_examples=100)
@given(plan_and_kind=stream_plans())
async def test_fuzz_upstream_streams(
    post_scripted: Any, scripted: ScriptedUpstream, plan_and_kind: tuple[Plan, str]
) -> None:
    plan, kind = plan_and_kind
    scripted.plan = plan
    reply = await post_scripted(CHAT, dumps({**VALID[CHAT], "stream": True}))
    entry = assert_billed_once(reply, plan)
    assert reply.status == 200, reply.describe()
    assert b": billing " in reply.body, reply.describe()
    comment = next(line for line in reply.body.split(b"\n") if line.startswith(b": billing "))
    assert json.loads(comment.removeprefix(b": billing "))["outcome"] == entry["outcome"]
    if kind == "garbage":
        assert entry["outcome"] == "upstream_error", entry
    elif kind == "well_formed":
        assert entry["outcome"] in ("ok", "truncated"), (entry, plan)
        assert reply.body.endswith(b"data: [DONE]\n\n"), reply.describe()
    await assert_still_serving(post_scripted, scripted)


async def test_crlf_stream_split_between_cr_and_lf_is_not_an_upstream_error(
    post_scripted: Any, scripted: ScriptedUpstream
) -> None:
    """SSE allows CRLF line ends, and TCP may cut anywhere: a split "\\r|\\n" must not turn a
    well-formed stream into a broken one."""
    content = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "hi"}}],
    }
    finish = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    chunks = [
        chunk_event(content) + b"\r",
        b"\n\r\n" + chunk_event(finish) + b"\r\n\r",
        b"\ndata: [DONE]\r",
        b"\n\r\n",
    ]
    scripted.plan = Plan(content_type="text/event-stream", chunks=chunks, delay_s=0.02)
    reply = await post_scripted(CHAT, dumps({**VALID[CHAT], "stream": True}))
    entry = assert_billed_once(reply, scripted.plan)
    assert entry["outcome"] == "ok", entry
    assert (entry["input_tokens"], entry["output_tokens"]) == ("3", "1"), entry
    assert reply.body.endswith(b"data: [DONE]\n\n"), reply.describe()


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 10**17, "completion_tokens": 1},
        {"prompt_tokens": 10**20, "completion_tokens": 1},
        {"prompt_tokens": 3, "completion_tokens": 2**63},
        {"prompt_tokens": 2**53 + 1, "completion_tokens": 0},
    ],
    ids=["1e17", "1e20", "2^63", "2^53+1"],
)
async def test_absurd_provider_usage_still_leaves_one_ledger_entry(
    post_scripted: Any,
    scripted: ScriptedUpstream,
    redis_client: aioredis.Redis,
    stream: bool,
    usage: JsonDict,
) -> None:
    """A provider's usage figures are untrusted input too: a huge count must not make the
    settle script fail and leave the call without its ledger entry."""
    done = {"index": 0, "finish_reason": "stop"}
    if stream:
        events = [
            chunk_event({"choices": [{**done, "delta": {"content": "hi"}}]}),
            chunk_event({"choices": [], "usage": usage}),
            b"data: [DONE]",
        ]
        plan = Plan(content_type="text/event-stream", chunks=[e + b"\n\n" for e in events])
    else:
        plan = Plan(chunks=[dumps({"choices": [{**done, "message": {"content": "hi"}}], "usage": usage})])
    scripted.plan = plan
    reply = await post_scripted(CHAT, dumps({**VALID[CHAT], "stream": stream}))
    assert_billed_once(reply, plan)
    leases = await redis_client.zcard("lbp:{team-a}:leases")
    assert leases == 0, "the reservation was left open"


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("tool_calls", [5, True, 1.5], ids=["int", "bool", "float"])
async def test_upstream_tool_calls_of_odd_type_are_billed_not_a_500(
    post_scripted: Any, scripted: ScriptedUpstream, stream: bool, tool_calls: Any
) -> None:
    part = {"role": "assistant", "content": "hi", "tool_calls": tool_calls}
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    if stream:
        events = [
            chunk_event({"choices": [{"index": 0, "delta": part, "finish_reason": "stop"}]}),
            chunk_event({"choices": [], "usage": usage}),
            b"data: [DONE]",
        ]
        plan = Plan(content_type="text/event-stream", chunks=[e + b"\n\n" for e in events])
    else:
        plan = Plan(
            chunks=[
                dumps({"choices": [{"index": 0, "message": part, "finish_reason": "stop"}], "usage": usage})
            ]
        )
    scripted.plan = plan
    reply = await post_scripted(CHAT, dumps({**VALID[CHAT], "stream": stream}))
    entry = assert_billed_once(reply, plan)
    assert reply.status in (200, 502), reply.describe()
    assert entry["outcome"] in ("ok", "upstream_error"), entry
    await assert_still_serving(post_scripted, scripted)


async def test_a_settle_the_store_refuses_never_corrupts_the_meters_on_retry(
    make_proxy: ProxyFactory, scripted: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    """Retrying a settlement that fails (here: a provider count Redis cannot take) must not apply
    it partly, again and again: reserved meters must never go negative, requests never grow."""
    proxy = await make_proxy(
        upstreams=scripted_upstreams(scripted.base_url), limits={"journal_replay_s": 0.1}
    )
    usage = {"prompt_tokens": 10**17, "completion_tokens": 1}
    answer = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "hi"}}]}
    scripted.plan = Plan(chunks=[dumps({**answer, "usage": usage})])
    reply = await send(
        proxy,
        lambda: scripted.received,
        redis_client,
        CHAT,
        dumps(VALID[CHAT]),
        headers={"X-Run-Id": "drift"},
    )
    assert reply.status == 200, reply.describe()
    await asyncio.sleep(1.0)  # ~10 replay rounds
    meters = await redis_client.hgetall("lbp:{team-a}:run:drift")
    negative = {k: v for k, v in meters.items() if k.startswith("resv:") and int(v) < 0}
    assert negative == {}, meters
    assert int(meters.get("used:requests", 0)) <= 1, meters


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": ["image_url"], "text": "hi"}]}]},
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": {}, "text": "hi"}]}]}),
        ("/v1/responses", {"input": [{"type": [], "role": "user", "content": "hi"}]}),
    ],
)
async def test_a_part_type_that_is_not_a_string_is_no_500_when_media_parts_are_priced(
    path: str, body: JsonDict, make_proxy: ProxyFactory, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    # Was a 500 (TypeError: unhashable type) while looking up the part type among media types.
    proxy = await make_proxy(models={"*": {"upstream": "openai", "media_part_input_tokens": 1000}})
    reply = await send(
        proxy, lambda: fake.received, redis_client, path, dumps({"model": "gpt-4o-mini", **body})
    )
    assert reply.status != 500, reply.describe()
    assert_contract(reply)


async def test_a_refusal_part_in_history_counts_against_a_run_ceiling(
    make_proxy: ProxyFactory, script: ScriptedUpstream, redis_client: aioredis.Redis
) -> None:
    # 2,000 tokens of an earlier refusal went out on a 5-token reserve past a 1,000-token ceiling.
    proxy = await make_proxy(
        upstreams=scripted_upstreams(script.base_url), tiers={"standard": {"run": {"total_tokens": 1000}}}
    )
    body = {
        "model": "gpt-4o-mini",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "word " * 2000}]},
        ],
    }
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "skip"}
    reply = await send(
        proxy, lambda: script.received, redis_client, "/v1/chat/completions", dumps(body), headers=headers
    )
    assert (reply.status, reply.upstream_calls) == (429, 0), reply.describe()


async def test_a_legacy_completion_scoring_its_prompt_with_max_tokens_0_is_billed_not_refused(
    make_proxy: ProxyFactory, fake: Any, redis_client: aioredis.Redis
) -> None:
    """OpenAI's legacy completions take max_tokens from 0 (its API spec: minimum 0): with echo and
    logprobs, a prompt's log-likelihood is read without generating anything (evaluation harnesses
    do this through OpenAI-compatible servers such as vLLM). Such a call writes no output: it is
    reserved and billed at its prompt, not refused."""
    proxy = await make_proxy()
    body = {"model": "gpt-4o-mini", "prompt": "the cat sat", "max_tokens": 0, "echo": True, "logprobs": 1}
    reply = await send(proxy, lambda: fake.received, redis_client, "/v1/completions", dumps(body))
    # now: 400 "Invalid request body: max_tokens: Input should be greater than or equal to 1"
    assert reply.status == 200, reply.describe()
    assert (reply.upstream_calls, reply.ledger_growth) == (1, 1), reply.describe()
    (entry,) = reply.new_entries
    assert entry["reserved_output_tokens"] == "1", entry  # the token vLLM writes to score it
    assert entry["output_tokens"] == "0", entry
    assert fake.received[-1].body["max_tokens"] == 0  # forwarded as asked


_CHAT_BODY = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}'
MALFORMED_HTTP = {
    "control-character-in-a-header": f"X-Trace: a\x01b\r\nContent-Length: {len(_CHAT_BODY)}\r\n\r\n".encode()
    + _CHAT_BODY,
    "length-and-chunked": f"Content-Length: {len(_CHAT_BODY)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    + _CHAT_BODY,
    "bad-chunk-size": b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + _CHAT_BODY + b"\r\n0\r\n\r\n",
    "negative-length": b"Content-Length: -5\r\n\r\n" + _CHAT_BODY,
    "space-in-a-header-name": f"X Trace: a\r\nContent-Length: {len(_CHAT_BODY)}\r\n\r\n".encode()
    + _CHAT_BODY,
}


@pytest.mark.parametrize("name", list(MALFORMED_HTTP))
async def test_a_request_the_http_parser_refuses_is_answered_in_openais_format(
    make_proxy: ProxyFactory, fake: Any, name: str
) -> None:
    """The contract: bad input gets OpenAI's error JSON, whatever layer refuses it. A request
    aiohttp's parser refuses (a control character in a header, Content-Length beside chunked, a
    chunk size that is not one) got aiohttp's own text/plain 400, quoting the raw header line
    back."""
    proxy = await make_proxy()
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY_A.encode()
        + b"\r\nConnection: close\r\n"
        + MALFORMED_HTTP[name]
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", raw
    assert b"application/json" in head.lower(), raw  # now: text/plain; charset=utf-8
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert "\n" not in error["message"] and b"X-Trace" not in body, error  # the reason, not the line
    assert not fake.received


async def _raw(proxy_url: str, request: bytes) -> bytes:
    host, port = proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return raw


@pytest.mark.parametrize("header", ["x-api-key: ", "authorization: Bearer "])
@pytest.mark.parametrize("bad", ["\x00", "x" * 70_000])
async def test_the_parser_error_answer_does_not_quote_the_callers_key(
    make_proxy: ProxyFactory, header: str, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer is 'the reason, not the line' (answer_parser_errors_as_json): a NUL in
    a header value, or a value past the parser's limit, quoted the raw value (the key) on the
    message's first line, which went back in the error JSON."""
    caplog.set_level(logging.DEBUG)
    key = "pk-live-7f3a9c2e41d84b6f"
    keys = [{"name": "c-key", "sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": "team-c"}]
    proxy = await make_proxy(keys=keys)
    body = b'{"model":"claude-x","messages":[],"max_tokens":1}'
    raw = await _raw(
        proxy.url,
        (
            f"POST /v1/messages HTTP/1.1\r\nHost: x\r\n{header}{key}{bad}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        + body,
    )
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] in (b"400", b"431"), raw[:300]
    assert b"application/json" in head.lower(), raw[:300]
    assert key.encode() not in answer, answer
    # Nor the log: aiohttp's own line carried the exception, which quotes the raw header.
    logged = [r.getMessage() + str(r.exc_info) + str(r.__dict__) for r in caplog.records]
    assert caplog.records and not any(key in line for line in logged), logged


async def test_a_client_leaving_mid_upload_is_no_unhandled_error(
    proxy: Proxy, fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that closes its connection while its request body is still coming (a cancelled
    upload, a killed process) is an ordinary disconnect: nothing forwarded, and no "unhandled
    error" with a stack trace in the operator's log for each one."""
    host, port = proxy.url.split("//")[1].split(":")
    caplog.set_level(logging.INFO)
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n".encode()
        + b"Content-Length: 100000\r\n\r\n"
        + b'{"model": "gpt-4o-mini", "messages": ['
    )
    await writer.drain()
    await asyncio.sleep(0.3)  # the handler is waiting on the body
    writer.close()
    await writer.wait_closed()
    deadline = asyncio.get_running_loop().time() + 5
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        if any(r.name == "aiohttp.access" or r.levelno >= logging.ERROR for r in caplog.records):
            break  # the request is over
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage(), r.exc_info and r.exc_info[0]) for r in errors]
    assert fake.calls == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/unknown"), ("GET", "/v1/chat/completions"), ("POST", "/v1/chat/completions/")],
)
async def test_an_unknown_expectation_off_the_routes_is_refused_in_openais_format(
    proxy: Proxy, fake: FakeUpstream, method: str, path: str
) -> None:
    """An unknown path or a wrong method with an unknown ``Expect`` is refused in OpenAI's error
    format, as on the billed paths (test_bad_input), not in aiohttp's text/plain page."""
    body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}'
    host, port = proxy.url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Expect: foo\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    out = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 417"), out
    assert b"application/json" in head.lower() and b"x-request-id" in head.lower(), out
    assert json.loads(payload)["error"]["code"] == "expectation_failed"
    assert fake.calls == 0


# -- a field of several shapes: its error names the field and every shape

PROMPT_KINDS = "a string, an array of strings, an array of integers or an array of arrays of integers"


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (COMPLETIONS, "prompt", {"text": "hi"}),
        (COMPLETIONS, "prompt", 5),
        (COMPLETIONS, "prompt", [1, "a"]),
        (COMPLETIONS, "prompt", [[1, 2], [3, None]]),
        (COMPLETIONS, "prompt", [1.5]),
        (EMBEDDINGS, "input", True),
        (EMBEDDINGS, "input", ["ok", None]),
        (EMBEDDINGS, "input", [1, [2]]),
    ],
    ids=repr,
)
async def test_a_prompt_or_input_of_no_accepted_shape_names_its_field_and_the_shapes_it_takes(
    post: Any, path: str, field: str, value: Any
) -> None:
    """A union field's error named a parameter no request has ("prompt.str", "input.str": the
    first of pydantic's union branches) and told a client that sent a list of token ids with one
    null in it that the field "should be a valid string"."""
    model = "gpt-4o-mini" if path == COMPLETIONS else "text-embedding-3-small"
    error = assert_refused(await post(path, dumps({"model": model, field: value})), 400)
    assert error["param"] == field, error  # was "prompt.str" / "input.str"
    assert PROMPT_KINDS in error["message"], error  # was "Input should be a valid string"


async def test_a_missing_prompt_is_still_told_as_required(post: Any) -> None:
    error = assert_refused(await post(COMPLETIONS, dumps({"model": "gpt-4o-mini"})), 400)
    assert error["param"] == "prompt", error
    assert "Field required" in error["message"], error
