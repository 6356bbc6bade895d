"""What a request may hold, at the edges of each bound, and how a request the proxy will not take is
refused: the key's scheme, the caller's tier, the order of the checks, the admin keys, and the
status, type, code and headers a client's SDK acts on.

Each test pins one edge that the rest of the suite crossed only from far off (a field at 10**9
rather than one past its limit) or never looked at (a header a client's retry logic reads)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from proxy.config_tiers import TierConfig
from proxy.errors import BadRequest
from proxy.payload import MAX_TOKENS_LIMIT, Endpoint, parse_body, set_output_cap
from proxy.state import STATE
from tests.conftest import KEY_A, KEY_B, Proxy, ProxyFactory, digest, refused_port
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import auth, run_headers, the_entry
from tests.test_bad_input import _raw, assert_refused, dumps, send

JsonDict = dict[str, Any]
CHAT = "/v1/chat/completions"
MSGS: list[JsonDict] = [{"role": "user", "content": "hi"}]
CHAT_BODY: JsonDict = {"model": "gpt-4o-mini", "messages": MSGS}
BASE: dict[Endpoint, JsonDict] = {
    "chat.completions": CHAT_BODY,
    "completions": {"model": "gpt-4o-mini", "prompt": "hi"},
    "responses": {"model": "gpt-4o-mini", "input": "hi"},
    "messages": {"model": "claude-sonnet-4", "max_tokens": 5, "messages": MSGS},
}


# -- the bounds of the fields the proxy reads, at their edges ---------------------------------

# (endpoint, field, the largest or smallest value taken, the first one refused next to it)
EDGES: list[tuple[Endpoint, str, Any, Any]] = [
    # n and best_of multiply the reserve; past 128 OpenAI refuses them. n=10**9 (tested in
    # test_bad_input) caught a bound removed only by a test that hung for minutes.
    ("chat.completions", "n", 128, 129),
    ("completions", "n", 128, 129),
    ("completions", "best_of", 128, 129),
    ("completions", "best_of", 1, 0),
    ("chat.completions", "max_tokens", MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1),
    ("chat.completions", "max_completion_tokens", MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1),
    ("completions", "max_tokens", MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1),
    ("responses", "max_output_tokens", MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1),
    ("messages", "max_tokens", MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1),
    # Anthropic requires max_tokens >= 1: a 0 reserved nothing and went out to be refused.
    ("messages", "max_tokens", 1, 0),
    ("chat.completions", "model", "m" * 256, "m" * 257),
    ("messages", "messages", MSGS, []),
]


@pytest.mark.parametrize(
    ("endpoint", "field", "taken", "refused"),
    EDGES,
    ids=[f"{endpoint}-{field}-{str(refused)[:12]}" for endpoint, field, _t, refused in EDGES],
)
def test_each_bound_takes_its_last_value_and_refuses_the_next_naming_the_field(
    endpoint: Endpoint, field: str, taken: Any, refused: Any
) -> None:
    """One past a bound was taken (the bound moved or dropped), or the bound itself refused: the
    reserve is figured from these, and a value past the provider's own limit went out, reserved,
    for the provider to refuse."""
    _, view = parse_body(dumps({**BASE[endpoint], field: taken}), endpoint)
    assert getattr(view, field) == taken
    with pytest.raises(BadRequest) as refusal:
        parse_body(dumps({**BASE[endpoint], field: refused}), endpoint)
    assert refusal.value.status == 400 and refusal.value.param == field


async def test_an_n_past_its_bound_is_refused_before_anything_is_reserved_or_forwarded(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The same edge end to end, without the provider answering a hundred-odd choices: refused
    as OpenAI refuses it, nothing reserved for the run, nothing sent upstream."""
    headers = {"X-Run-Id": "n-past"}
    body = dumps({**CHAT_BODY, "n": 129})
    reply = await send(proxy, lambda: fake.received, redis_client, CHAT, body, headers=headers)
    error = assert_refused(reply, 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", "n"), error
    assert await redis_client.hgetall("lbp:{team-a}:run:n-past") == {}


# -- the output cap the proxy writes into a body ----------------------------------------------


def test_a_lower_cap_the_client_set_in_the_other_field_is_kept() -> None:
    """Chat's two caps may differ: the reserve covers the larger, and the smaller the client set
    must still bound the answer. Raised to the cap, the client got (and paid for) more output
    than it asked for."""
    body: JsonDict = {"max_tokens": 5, "max_completion_tokens": 50}
    set_output_cap(body, "max_completion_tokens", 50)
    assert body == {"max_tokens": 5, "max_completion_tokens": 50}
    body = {"max_tokens": 500, "max_completion_tokens": 50}
    set_output_cap(body, "max_completion_tokens", 50)
    assert body == {"max_tokens": 50, "max_completion_tokens": 50}


def test_a_boolean_in_a_cap_field_is_no_cap_and_is_replaced() -> None:
    """``true`` is an int to Python (and 1 < the cap): kept, the provider got a cap that is not a
    number instead of the one reserved."""
    body: JsonDict = {"max_output_tokens": 40, "max_tokens": True}
    set_output_cap(body, "max_output_tokens", 40)
    assert body == {"max_output_tokens": 40, "max_tokens": 40}


async def test_an_upstream_reading_only_max_tokens_is_sent_and_reserved_the_lower_of_the_two_caps(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Moved to the one field such an upstream reads, the cap is the lower of the client's two,
    whichever field held it: with max_tokens the lower, the call was reserved at
    max_completion_tokens' larger figure (a budget refusing a call that fits)."""
    upstream = {
        "base_url": fake.base_url,
        "api_key_env": "TEST_UPSTREAM_KEY",
        "chat_output_cap_field": "max_tokens",
    }
    proxy = await make_proxy(upstreams={"openai": upstream})
    cases = [
        ({"max_completion_tokens": 500, "max_tokens": 10}, "mt-lower"),
        ({"max_completion_tokens": 10}, "mct"),
    ]
    for caps, run in cases:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                proxy.url + CHAT, json={**CHAT_BODY, **caps}, headers={**auth(), **run_headers(run)}
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
        sent = fake.received[-1].body
        assert sent["max_tokens"] == 10 and "max_completion_tokens" not in sent, (caps, sent)
        assert (await the_entry(proxy, run, wait_s=5))["reserved_output_tokens"] == "10", caps


@pytest.mark.parametrize(("model_cap", "status"), [(15, 400), (16, 200)])
async def test_a_responses_model_capped_below_16_output_tokens_is_refused_here(
    make_proxy: ProxyFactory, fake: FakeUpstream, model_cap: int, status: int
) -> None:
    """The Responses API refuses a max_output_tokens below 16: a model capped lower in the config
    makes every call one the provider refuses, told here before anything is reserved; 16 itself
    goes out."""
    proxy = await make_proxy(models={"*": {"upstream": "openai", "max_output_tokens": model_cap}})
    body = {"model": "gpt-4o-mini", "input": "hi"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as resp,
    ):
        assert resp.status == status, await resp.text()
        answer = await resp.json()
    if status == 400:
        assert answer["error"]["code"] == "output_cap_too_low", answer
        assert fake.received == []
    else:
        assert fake.received[-1].body["max_output_tokens"] == 16


async def test_a_model_no_route_serves_is_a_404_naming_the_model(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """OpenAI's answer to an unknown model (``param: model``, ``code: model_not_found``), which
    an SDK's caller tells from a missing run or response by its code."""
    proxy = await make_proxy(models={"gpt-4o-mini": {"upstream": "openai"}})
    body = {**CHAT_BODY, "model": "gpt-nobody"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + CHAT, json=body, headers={"Authorization": f"Bearer {KEY_A}"}) as resp,
    ):
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found"), error
    assert fake.received == []


# -- who is asking ----------------------------------------------------------------------------


@pytest.mark.parametrize("credentials", [f"bearer {KEY_A}", f"BEARER {KEY_A}", f"Bearer   {KEY_A}"])
async def test_the_bearer_scheme_is_read_whatever_its_case_and_spacing(
    proxy: Proxy, fake: FakeUpstream, credentials: str
) -> None:
    """HTTP's auth schemes are case-insensitive and may be followed by several spaces (RFC 9110,
    11.4): a client or gateway writing ``bearer``, or two spaces, was refused a 401 for a key
    that is valid."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + CHAT, json=CHAT_BODY, headers={"Authorization": credentials}) as resp,
    ):
        assert resp.status == 200, await resp.text()
    assert len(fake.received) == 1


async def test_a_key_of_a_tier_not_configured_is_a_403_permission_denied_unknown_tier(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The operator's mistake, not the caller's: told apart from a wrong key (401) by its type and
    code, which an SDK maps to PermissionDeniedError and an operator greps for. No file gives
    such a config now (refused at load: test_config); one that skipped the load's checks still
    refuses the key's calls rather than serve them with no tier's ceilings."""
    proxy = await make_proxy()
    state = proxy.app[STATE]
    state.config = state.config.model_copy(update={"tiers": {"gold": TierConfig()}})
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + CHAT, json=CHAT_BODY, headers={"Authorization": f"Bearer {KEY_A}"}) as resp,
    ):
        assert resp.status == 403
        error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("permission_denied", "unknown_tier"), error
    assert fake.received == []


async def test_a_caller_without_a_key_is_a_401_whatever_its_run_id(
    proxy: Proxy, fake: FakeUpstream, redis_client: aioredis.Redis
) -> None:
    """The key is checked first: checked the other way round, a caller with no key was told
    whether its run id would do (a 400) before being told who it is."""
    headers = {"X-Run-Id": "not a run id"}
    reply = await send(
        proxy, lambda: fake.received, redis_client, CHAT, dumps(CHAT_BODY), headers=headers, with_auth=False
    )
    error = assert_refused(reply, 401)
    assert error["code"] == "invalid_api_key", error


async def test_every_admin_key_opens_the_metrics(make_proxy: ProxyFactory) -> None:
    """Each admin key is compared (in constant time, all of them): only the last one was
    honoured, and an operator's first key locked out of /metrics."""
    admins = [{"name": f"ops-{i}", "sha256": digest(f"sk-admin-{i}")} for i in range(2)]
    proxy = await make_proxy(admin_keys=admins)
    async with aiohttp.ClientSession() as session:
        for key, status in (("sk-admin-0", 200), ("sk-admin-1", 200), (KEY_A, 401)):
            async with session.get(proxy.url + "/metrics", headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == status, (key, await r.text())


async def test_an_expectation_of_100_continue_is_read_whatever_its_case(proxy: Proxy) -> None:
    """Expect's value is case-insensitive (RFC 9110, 10.1.1): ``100-Continue`` was a 417."""
    body = dumps(CHAT_BODY)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Expect: 100-Continue\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    whole = await _raw(proxy.url, head.encode() + body)
    assert whole.startswith(b"HTTP/1.1 100 Continue"), whole
    assert b"HTTP/1.1 200" in whole, whole


@pytest.mark.parametrize("spare_bytes", [-1, 0], ids=["one-byte-over", "at-the-limit"])
async def test_a_body_limit_lowered_while_the_body_came_judges_the_call(
    proxy: Proxy, fake: FakeUpstream, spare_bytes: int
) -> None:
    """A call judged under a config reloaded while it waited is judged by its body limit too:
    a body read under the old limit passed the new one unchecked, and was reserved and sent. The
    limit is inclusive, as aiohttp's own: a body of exactly the new limit is taken."""
    state = proxy.app[STATE]
    body = dumps({**CHAT_BODY, "messages": [{"role": "user", "content": "x " * 2000}]})

    async def uploaded() -> AsyncIterator[bytes]:
        # The 100 Continue came: the call has begun under the config of its start (the proxy
        # runs on this loop, and went on to read the body before this runs).
        limit = len(body) + spare_bytes
        limits = state.config.limits.model_copy(update={"max_body_bytes": limit})
        state.config = state.config.model_copy(update={"limits": limits})
        yield body

    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url + CHAT,
            data=uploaded(),
            expect100=True,
            headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"},
        ) as resp,
    ):
        if spare_bytes < 0:
            assert resp.status == 413, await resp.text()
            assert (await resp.json())["error"]["code"] == "body_too_large"
        else:
            assert resp.status == 200, await resp.text()
    assert len(fake.received) == (0 if spare_bytes < 0 else 1)


# -- how a refusal looks ----------------------------------------------------------------------


async def test_a_store_down_503_tells_the_sdk_to_retry_after_a_second(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The OpenAI SDKs read ``x-should-retry`` before the status, and ``retry-after`` for the
    wait: without them a store outage of a second was a failure the client never retried (or a
    retry at once)."""
    proxy = await make_proxy(redis={"url": f"redis://127.0.0.1:{refused_port()}/0", "socket_timeout_s": 0.5})
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + CHAT, json=CHAT_BODY, headers={"Authorization": f"Bearer {KEY_A}"}) as resp,
    ):
        assert resp.status == 503
        assert (resp.headers.get("x-should-retry"), resp.headers.get("retry-after")) == ("true", "1")
        error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "store_unavailable"), error
    assert fake.received == []


async def test_another_tenants_run_is_a_404_with_the_not_found_code(proxy: Proxy) -> None:
    """The code an SDK or a script tells a missing run by (the same as for a run never made)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(
            proxy.url + CHAT, json=CHAT_BODY, headers={"Authorization": f"Bearer {KEY_A}", "X-Run-Id": "mine"}
        ) as made:
            assert made.status == 200
        async with session.get(
            proxy.url + "/v1/billing/runs/mine", headers={"Authorization": f"Bearer {KEY_B}"}
        ) as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "not_found"), error


async def test_a_request_the_http_parser_refuses_gets_every_field_of_openais_error(proxy: Proxy) -> None:
    """OpenAI's error object always has its four fields (``param`` and ``code`` null or not): an
    SDK reads ``error.param``, and one left out is a KeyError in a client that indexes it."""
    whole = await _raw(
        proxy.url,
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\nContent-Length: 0\r\n\r\n",
    )
    assert whole.split(b" ", 2)[1] == b"400", whole
    error = json.loads(whole.partition(b"\r\n\r\n")[2])["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] is None and error["code"] == "bad_http_request", error
