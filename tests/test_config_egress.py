"""The egress proxy's config: the file's ``proxy`` and ``proxy_auth_env``, the environment's
HTTPS_PROXY / HTTP_PROXY and NO_PROXY as Python's urllib reads them, and what is refused at load
(in words that never quote a password)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config_egress import bypassed, from_environment
from proxy.config_load import log_egress, parse_config
from proxy.errors import ConfigError
from tests.conftest import base_config

SECRET = "hunter2-proxy-pw"


def loaded(upstream: dict[str, Any], environ: dict[str, str] | None = None) -> Any:
    raw = base_config("https://api.example.com/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["openai"] |= upstream
    return parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-k", **(environ or {})}).upstreams["openai"]


def refusal(upstream: dict[str, Any], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        loaded(upstream, environ)
    assert SECRET not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize(
    ("proxy", "said"),
    [
        (f"socks5://u:{SECRET}@squid:1080", "only http:// proxies are supported, not socks5://"),
        ("https://squid:3128", "only http:// proxies are supported, not https://"),
        ("squid:3128", "write it as http://HOST:PORT"),
        (f"http://u:{SECRET}@squid:3128/path", "with no path, query or fragment"),
        ("http://squid:99999", "is not a port"),
        (f"http://u:a/{SECRET}@squid:3128", "percent-encode them"),
        ("http://u%3Ax:pw@squid:3128", "its user name holds ':'"),
        ("http://u:p\u0101ss@squid:3128", "outside latin-1"),
    ],
)
def test_a_proxy_url_that_cannot_be_used_is_refused_at_load(proxy: str, said: str) -> None:
    message = refusal({"proxy": proxy})
    assert message.startswith("upstreams.openai.proxy: ") and said in message, message


def test_proxy_credentials_come_from_the_url_or_proxy_auth_env_not_both() -> None:
    egress = loaded({"proxy": "http://squid:3128", "proxy_auth_env": "P"}, {"P": f" gw:{SECRET}\n"}).egress
    assert (egress.url, egress.user, egress.password.get_secret_value()) == (
        "http://squid:3128",
        "gw",
        SECRET,
    )
    assert "credentials in the URL and proxy_auth_env" in refusal(
        {"proxy": f"http://gw:{SECRET}@squid:3128", "proxy_auth_env": "P"}
    )
    assert "give proxy too" in refusal({"proxy_auth_env": "P"})
    assert "must hold USER:PASSWORD" in refusal(
        {"proxy": "http://squid:3128", "proxy_auth_env": "P"}, {"P": SECRET}
    )


def test_an_unset_proxy_auth_env_is_a_warning_and_no_credentials() -> None:
    raw = base_config("https://api.example.com/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["openai"] |= {"proxy": "http://squid:3128", "proxy_auth_env": "P"}
    warnings: list[str] = []
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-k"}, warnings=warnings)
    assert warnings == [
        "upstreams.openai.proxy_auth_env: P is not set: calls go to the proxy without credentials"
    ]
    egress = config.upstreams["openai"].egress
    assert egress is not None and egress.user is None and egress.password is None


def test_the_environments_proxy_is_checked_as_the_files_naming_its_variable() -> None:
    message = refusal({}, {"HTTPS_PROXY": f"socks5h://u:{SECRET}@corp:1080"})
    assert message.startswith("upstreams.openai: the egress proxy HTTPS_PROXY names: invalid proxy URL"), (
        message
    )
    assert 'proxy: ""' in message
    # Not for an upstream that goes direct: its own ``proxy: ""``, or NO_PROXY.
    assert loaded({"proxy": ""}, {"HTTPS_PROXY": "socks5://corp:1080"}).egress is None
    assert loaded({}, {"HTTPS_PROXY": "socks5://corp:1080", "NO_PROXY": ".example.com"}).egress is None


def test_the_environments_proxy_as_curl_and_requests_read_it() -> None:
    # Lower case first; no scheme is http://; credentials in the URL.
    egress = loaded({}, {"https_proxy": f"gw:{SECRET}@squid:3128", "HTTPS_PROXY": "http://other:1"}).egress
    assert (egress.url, egress.user, egress.source) == ("http://squid:3128", "gw", "https_proxy")
    assert loaded({}, {"HTTPS_PROXY": " http://other:1 "}).egress.url == "http://other:1"
    assert loaded({}, {"HTTPS_PROXY": " "}).egress is None  # a blank value is none
    # An https upstream reads HTTPS_PROXY alone (not HTTP_PROXY), an http one HTTP_PROXY alone.
    assert loaded({}, {"HTTP_PROXY": "http://squid:3128"}).egress is None
    assert from_environment("http://10.0.0.5:8000/v1", {"HTTP_PROXY": "squid:3128"}) == (
        "HTTP_PROXY",
        "http://squid:3128",
    )
    assert from_environment("http://10.0.0.5:8000/v1", {"HTTPS_PROXY": "squid:3128"}) is None


@pytest.mark.parametrize(
    ("no_proxy", "host", "port", "bypass"),
    [
        ("*", "api.openai.com", 443, True),
        ("openai.com", "api.openai.com", 443, True),
        ("openai.com", "openai.com", 443, True),
        (".openai.com", "openai.com", 443, True),
        ("*.openai.com", "api.openai.com", 443, True),
        ("openai.com", "notopenai.com", 443, False),
        ("OPENAI.COM", "Api.OpenAI.com.", 443, True),
        ("a.com,  openai.com", "api.openai.com", 443, True),
        ("a.com openai.com", "api.openai.com", 443, True),
        ("api.openai.com:443", "api.openai.com", 443, True),
        ("api.openai.com:8443", "api.openai.com", 443, False),
        ("10.0.0.0/8", "10.1.2.3", 80, True),
        ("10.0.0.0/8", "11.1.2.3", 80, False),
        ("10.0.0.0/33", "10.1.2.3", 80, False),  # no block: skipped
        ("127.0.0.1", "127.0.0.1", 80, True),
        ("::1", "::1", 80, True),
        ("[::1]:8000", "[::1]", 8000, True),
        ("[::1]:8000", "::1", 80, False),
        ("fd00::/8", "fd12::1", 443, True),
        ("[fd00::]/8", "fd12::1", 443, True),  # the block, not fd00:: alone
        ("[fd00::]/8", "fe80::1", 443, False),
        ("", "localhost", 80, False),  # loopback is proxied unless named, as curl and requests do
        ("localhost", "127.0.0.1", 80, False),  # a name is not its address
        ("*", "", 80, True),
        # A Unicode name and its punycode are one host, in either place.
        ("xn--bcher-kva.de", "api.bücher.de", 443, True),
        ("Bücher.de", "api.xn--bcher-kva.de", 443, True),
        (".bücher.de", "bücher.de", 443, True),
        ("bücher.de", "xn--bcher-kva.com", 443, False),
    ],
)
def test_no_proxy(no_proxy: str, host: str, port: int, bypass: bool) -> None:
    assert bypassed(no_proxy, host, port) is bypass


def test_a_lower_case_variable_set_blank_decides_as_pythons_urllib_reads_it() -> None:
    # urllib.request.getproxies_environment (requests' and aiohttp's): the lower-case variable,
    # once set, even blank, is the one read; curl would take the upper-case one.
    for blank in ("", " "):
        assert loaded({}, {"https_proxy": blank, "HTTPS_PROXY": "http://squid:3128"}).egress is None
        environ = {"HTTPS_PROXY": "http://squid:3128", "no_proxy": blank, "NO_PROXY": "api.example.com"}
        assert loaded({}, environ).egress.url == "http://squid:3128"


def test_each_upstream_through_an_egress_proxy_is_logged_at_load_and_at_a_reload_changing_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An upgrade reads the environment's proxy where a version before went direct: each upstream
    it sends through one is said (its host:port and the variable or field, no credentials)."""
    raw = base_config("http://vllm.internal:8000/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["local"] = {"base_url": "http://127.0.0.1:8001/v1", "proxy": "http://squid:3128"}
    environ = {"TEST_UPSTREAM_KEY": "sk-k", "HTTP_PROXY": f"gw:{SECRET}@corp-proxy", "NO_PROXY": "127.0.0.1"}
    first = parse_config(raw, environ)
    caplog.set_level("INFO", logger="proxy.config")

    def said(config: Any, before: Any = None) -> list[dict[str, Any]]:
        caplog.clear()
        log_egress(config, before)
        assert SECRET not in caplog.text and "gw" not in caplog.text
        keys = ("upstream", "egress_proxy", "named_by")
        return [{k: getattr(r, k, None) for k in keys} | {"message": r.getMessage()} for r in caplog.records]

    through = "upstream goes through an egress proxy"
    assert said(first) == [
        {"upstream": "openai", "egress_proxy": "corp-proxy:80", "named_by": "HTTP_PROXY", "message": through},
        {
            "upstream": "local",
            "egress_proxy": "squid:3128",
            "named_by": "upstreams.local.proxy",
            "message": through,
        },
    ]
    # A reload: only what changed (the environment's proxy gone from openai; local's unchanged).
    second = parse_config(raw, {**environ, "http_proxy": ""})
    assert said(second, first) == [
        {
            "upstream": "openai",
            "egress_proxy": None,
            "named_by": None,
            "message": "upstream goes direct, through no egress proxy now",
        }
    ]
    assert said(second, second) == []
