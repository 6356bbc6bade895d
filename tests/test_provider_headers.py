"""What the provider says in its response headers reaches the client (retry advice, limits, its
own request id), and what scopes a pass-through caller's own key reaches the provider."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.conftest import KEY_A, Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import assert_provider_usage, the_entry
from tests.test_bad_input import GOOD_BODY, Plan, ScriptedUpstream, dumps, scripted_upstreams

AUTH = {"Authorization": f"Bearer {KEY_A}"}
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
PROVIDER = {
    "x-request-id": "req_provider_1",
    "openai-processing-ms": "12",
    "x-ratelimit-remaining-requests": "99",
    "x-ratelimit-reset-tokens": "6ms",
    # not passed: the operator's account, the provider's cookies
    "openai-organization": "org-operator",
    "set-cookie": "__cf_bm=abc; path=/",
}
RATE_LIMITED = dumps(
    {
        "error": {
            "message": "Rate limit reached",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
)


async def post(url: str, body: Any) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, headers=AUTH) as resp:
            await resp.read()
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}


def assert_provider_headers(headers: dict[str, str]) -> None:
    assert headers["x-ratelimit-remaining-requests"] == "99", headers
    assert headers["x-ratelimit-reset-tokens"] == "6ms"
    assert headers["openai-processing-ms"] == "12"
    assert headers["x-upstream-request-id"] == "req_provider_1"
    assert headers["x-request-id"] != "req_provider_1"  # the proxy's own: the ledger's id
    assert "openai-organization" not in headers and "set-cookie" not in headers


async def test_a_json_answer_carries_the_providers_headers(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(chunks=[GOOD_BODY], extra_headers=PROVIDER)
    status, headers = await post(proxy.url + "/v1/chat/completions", CHAT)
    assert status == 200
    assert_provider_headers(headers)
    assert headers["x-billing-outcome"] == "ok"


async def test_a_stream_carries_the_providers_headers(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    proxy = await make_proxy()
    status, headers = await post(proxy.url + "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["x-upstream-request-id"].startswith("req_"), headers  # the fake's own id


async def test_a_provider_429_keeps_its_retry_advice(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(status=429, chunks=[RATE_LIMITED], extra_headers={"retry-after": "7", **PROVIDER})
    status, headers = await post(proxy.url + "/v1/chat/completions", CHAT)
    assert status == 429
    assert headers["retry-after"] == "7"
    assert_provider_headers(headers)


async def test_the_sdk_follows_the_providers_advice_not_to_retry(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    # Without the provider's x-should-retry the SDK retries a 429 twice: three calls upstream.
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(status=429, chunks=[RATE_LIMITED], extra_headers={"x-should-retry": "false"})
    client = proxy.client(max_retries=2)
    with pytest.raises(openai.RateLimitError) as raised:
        await client.chat.completions.create(**CHAT)
    assert len(script.received) == 1
    assert raised.value.response.headers["x-should-retry"] == "false"


ORG = "org-0peratorsOwnOrg42xYz1234"  # as OpenAI writes them: 24 letters and digits
ORG_LIMITED = dumps(
    {"error": {"message": f"Rate limit reached for gpt-4o-mini in organization {ORG} on tokens per min "
               "(TPM): Limit 200000, Used 199000, Requested 5000.", "type": "tokens", "param": None,
               "code": "rate_limit_exceeded"}}
)  # fmt: skip


@pytest.mark.parametrize("escaped", [False, True], ids=["as-it-reads", "a-letter-escaped"])
@pytest.mark.parametrize("header", [True, False], ids=["named-in-a-header", "no-header"])
async def test_the_operators_organization_named_in_an_error_body_does_not_reach_a_tenant(
    make_proxy: ProxyFactory, script: ScriptedUpstream, header: bool, escaped: bool
) -> None:
    """The provider's organization header is dropped (the operator's account, with the proxy's
    key); OpenAI's 429 names it in its message too, which went out as it came (the secrets
    hunt). Replaced there, and in a model list's error as well; spelled with a \\u escape (a
    gateway's encoder) too, which the client's JSON decoder reads back (the scrub hunt)."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    extra = {"openai-organization": ORG} if header else {}
    body = ORG_LIMITED.replace(b"org-0p", b"\\u006Frg-0p") if escaped else ORG_LIMITED
    assert (ORG.encode() in body) is not escaped
    script.plan = Plan(status=429, chunks=[body], extra_headers={"retry-after": "2", **extra})
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=CHAT, headers=AUTH) as resp:
            assert resp.status == 429
            told = await resp.json()
        assert ORG not in str(told) and "in organization [REDACTED] on tokens" in told["error"]["message"]
        async with session.get(proxy.url + "/v1/models", headers=AUTH) as resp:
            assert resp.status == 429
            assert ORG not in await resp.text()


async def test_a_pass_through_callers_own_organization_is_its_own_to_read(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(passthrough=True, upstreams=passthrough_upstreams(script.base_url))
    script.plan = Plan(status=429, chunks=[ORG_LIMITED], extra_headers={"openai-organization": ORG})
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-callers-own", max_retries=0)
    with pytest.raises(openai.RateLimitError) as raised:
        await client.chat.completions.create(**CHAT)
    assert ORG in str(raised.value)


ORG_NAME = "acme-robotics"
FT_MODEL = f"ft:gpt-4o-mini-2024-07-18:{ORG_NAME}::9xYzAbCd"
MODELS = dumps(
    {
        "object": "list",
        "data": [
            {"id": "gpt-4o-mini", "object": "model", "created": 1, "owned_by": "system"},
            {"id": FT_MODEL, "object": "model", "created": 2, "owned_by": ORG_NAME},
        ],
    }
)


async def test_a_fine_tuned_models_id_reaches_the_client_as_listed(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    """The organization's name (what openai-organization may say) is the middle of its fine-tuned
    models' ids: replaced in a model list, those were not the ids a client must send (the second
    review of 1dbccb7). A model list, as any answer, goes out as it came."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(chunks=[MODELS], extra_headers={"openai-organization": ORG_NAME})
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/v1/models", headers=AUTH) as resp:
            assert resp.status == 200
            ids = [m["id"] for m in (await resp.json())["data"]]
    assert FT_MODEL in ids, ids


# -- GET /v1/models --------------------------------------------------------------------------

BAD_KEY = dumps(
    {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "param": None,
               "code": "invalid_api_key"}}
)  # fmt: skip


def passthrough_upstreams(base_url: str) -> dict[str, Any]:
    return {"openai": {"base_url": base_url, "passthrough_auth": True}}


async def test_models_passes_on_the_providers_refusal_of_a_callers_own_key(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(passthrough=True, upstreams=passthrough_upstreams(script.base_url))
    script.plan = Plan(status=401, chunks=[BAD_KEY])
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # was a 502, which the SDK retries
        await client.models.list()


async def test_models_passes_on_a_rate_limit_with_its_retry_advice(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(status=429, chunks=[RATE_LIMITED], extra_headers={"retry-after": "3"})
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/v1/models", headers=AUTH) as resp:
            assert resp.status == 429
            assert resp.headers["retry-after"] == "3"
            assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"


async def test_models_refused_with_the_proxys_own_key_is_the_proxys_fault(
    make_proxy: ProxyFactory, script: ScriptedUpstream
) -> None:
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    script.plan = Plan(status=401, chunks=[BAD_KEY])
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/v1/models", headers=AUTH) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "upstream_auth"


async def test_models_with_no_model_routed_is_an_empty_list(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """A config that routes no model (``models: {}``, which loads) has nothing to list: an
    empty list, not a 500, and no upstream asked."""
    proxy = await make_proxy(models={})
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/v1/models", headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.json() == {"object": "list", "data": []}
    assert fake.received == []


# -- pass-through: what scopes the caller's own key ---------------------------------------------


async def test_passthrough_sends_the_callers_organization_and_project(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    proxy = await make_proxy(passthrough=True, upstreams=passthrough_upstreams(fake.base_url))
    fake.api_key = None  # any key: the caller's own
    client = openai.AsyncOpenAI(
        base_url=proxy.url + "/v1",
        api_key="sk-own",
        organization="org-abc",
        project="proj_xyz",
        max_retries=0,
    )
    await client.chat.completions.create(**CHAT)
    sent = {k.lower(): v for k, v in fake.received[-1].headers.items()}
    assert sent["authorization"] == "Bearer sk-own"
    assert (sent.get("openai-organization"), sent.get("openai-project")) == ("org-abc", "proj_xyz"), sent


@pytest.mark.parametrize("name", ["OpenAI-Organization", "OpenAI-Project"])
async def test_passthrough_refuses_two_different_organizations_or_projects(
    make_proxy: ProxyFactory, fake: FakeUpstream, name: str
) -> None:
    """The provider bills the one it reads, a gateway in front may have checked the other: as
    two keys, refused before anything is reserved or sent. The same value twice is one value."""
    proxy = await make_proxy(passthrough=True, upstreams=passthrough_upstreams(fake.base_url))
    fake.api_key = None  # any key: the caller's own
    own = [("Authorization", "Bearer sk-own")]
    async with aiohttp.ClientSession() as session:
        two = [*own, (name, "first"), (name, "second")]
        async with session.post(proxy.url + "/v1/chat/completions", json=CHAT, headers=two) as resp:
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
            assert error["param"] == name and error["message"].startswith(f"Two different {name}"), error
        # The model list and the billing views too, whose refusals the error middleware answers:
        # it dropped the field the error names.
        for path in ("/v1/models", "/v1/billing/keys/self"):
            async with session.get(proxy.url + path, headers=two) as resp:
                assert resp.status == 400, await resp.text()
                assert (await resp.json())["error"]["param"] == name, path
        assert fake.received == []
        alike = [*own, (name, "same"), (name, "same")]
        async with session.post(proxy.url + "/v1/chat/completions", json=CHAT, headers=alike) as resp:
            assert resp.status == 200, await resp.text()
    [sent] = fake.received
    assert [v for k, v in sent.headers.items() if k.lower() == name.lower()] == ["same"]


async def test_with_the_proxys_key_the_callers_organization_is_not_sent(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    # The operator's key: a caller must not pick which of its organizations or projects pays.
    proxy = await make_proxy()
    client = proxy.client(organization="org-other", project="proj_other")
    await client.chat.completions.create(**CHAT)
    sent = {k.lower() for k in fake.received[-1].headers}
    assert "openai-organization" not in sent and "openai-project" not in sent


async def test_one_callers_upstream_cookies_never_go_with_another_callers_key(
    make_proxy: ProxyFactory,
) -> None:
    """The upstream session kept the provider's cookies (a gateway's session, Cloudflare's) and
    sent those set on caller A's call with caller B's key."""
    seen: list[dict[str, str]] = []
    answer = {
        "id": "c", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }  # fmt: skip

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        seen.append({k.lower(): v for k, v in request.headers.items()})
        response = web.json_response(answer)
        response.set_cookie("session", "of-" + request.headers.get("Authorization", "")[-5:], path="/")
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    # A host name, as a real upstream's (aiohttp's jar keeps no cookies of bare IP addresses).
    base_url = f"http://localhost:{runner.addresses[0][1]}/v1"
    try:
        proxy = await make_proxy(
            passthrough=True, upstreams={"openai": {"base_url": base_url, "passthrough_auth": True}}
        )
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        async with aiohttp.ClientSession() as session:
            for key in ("sk-caller-alice", "sk-caller-bob"):
                headers = {"Authorization": f"Bearer {key}"}
                async with session.post(
                    proxy.url + "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert "set-cookie" not in resp.headers
    finally:
        await runner.cleanup()
    assert seen[1]["authorization"] == "Bearer sk-caller-bob"
    assert "cookie" not in seen[1], seen[1]["cookie"]


# -- headers past the HTTP parser's defaults ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    "extra",
    [
        {"content-security-policy": "default-src 'self'" + " https://cdn.example" * 1000},
        {f"x-gateway-hop-{i}": "edge" for i in range(200)},
    ],
    ids=["a-20-kb-header", "200-headers"],
)
async def test_an_answer_with_long_or_many_headers_is_relayed_and_billed(
    proxy: Proxy, fake: FakeUpstream, stream: bool, extra: dict[str, str]
) -> None:
    """aiohttp's client refuses a response header past 8,190 bytes, or past 128 headers: an
    answer the provider sent (and billed) with a gateway's long CSP was a 502 billed at the
    reserve."""
    async with proxy.client() as client:
        answer = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "hi"}],
            stream=stream,
            extra_body={"fake": {"headers": extra}},
            extra_headers={"X-Run-Id": "long"},
        )
        if isinstance(answer, openai.AsyncStream):
            assert [chunk async for chunk in answer]
        else:
            assert answer.choices[0].message.content
    entry = await the_entry(proxy, "long", wait_s=5.0)
    assert entry["outcome"] == "ok"
    (bill,) = fake.bill
    assert_provider_usage(entry, bill)


async def test_models_goes_with_the_client_s_query_as_a_billed_call_does(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """An Azure-style gateway wants its api-version on every path: the SDK's default_query went
    with every billed call, and not with the model list (the gateway's 4xx)."""
    proxy = await make_proxy()
    client = openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key=KEY_A, default_query={"api-version": "2024-06-01"}, max_retries=0
    )
    await client.models.list()
    assert (fake.received[-1].path, fake.received[-1].query) == ("/v1/models", "api-version=2024-06-01")


def test_only_openais_own_account_ids_are_sought_in_an_error_body() -> None:
    """Its organization and project ids, 24 letters and digits after the prefix, on their own:
    not a model name that holds such a run (a served vLLM model, an id of another length)."""
    from proxy.forward import ACCOUNT_IDS

    found = ACCOUNT_IDS.findall(
        b"in organization org-0peratorsOwnOrg42xYz1234 (project proj_AbCdEfGhIjKlMnOpQrStUvWx): "
        b"model my-org-Llama3FineTunedInstructV2Abc or org-TooShort or org-0peratorsOwnOrg42xYz12345"
    )
    assert found == [b"org-0peratorsOwnOrg42xYz1234", b"proj_AbCdEfGhIjKlMnOpQrStUvWx"]


@pytest.mark.parametrize("before", ["\n", "\t", "\u00a0"], ids=["line-break", "tab", "nbsp"])
async def test_an_organization_after_an_escaped_character_in_an_error_body_does_not_reach_a_tenant(
    make_proxy: ProxyFactory, script: ScriptedUpstream, before: str
) -> None:
    """The id after a line break, a tab, a non-breaking space, no header naming it: the ids were
    sought after a character no id holds, read on the raw bytes, where an escape's last byte
    (``\\n``'s "n", ``\\u00a0``'s "0") reads as a letter or a digit (a review)."""
    proxy = await make_proxy(upstreams=scripted_upstreams(script.base_url))
    message = f"Rate limit reached for gpt-4o-mini in organization:{before}{ORG} on tokens per min"
    error = {"message": message, "type": "tokens", "param": None, "code": "rate_limit_exceeded"}
    script.plan = Plan(status=429, chunks=[dumps({"error": error})], extra_headers={"retry-after": "2"})
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=CHAT, headers=AUTH) as resp:
            assert resp.status == 429
            told = await resp.json()
    assert ORG not in told["error"]["message"], told
