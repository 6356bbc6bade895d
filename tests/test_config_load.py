"""Configs check-config must refuse, or load as they read: each had passed and then misbehaved at
run time (a path swallowed by a query, a key written twice, an unknown encoding, a cluster redis-py
cannot reach, an example that refused its own routes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy import config_load
from proxy.cli import main
from proxy.config_load import load_config, parse_config
from proxy.errors import ConfigError
from tests.cluster import RedisClusterProcesses
from tests.conftest import KEY_A, ProxyFactory, big_config
from tests.fake_upstream import FakeUpstream

UP = {"upstreams": {"openai": {"base_url": "https://api.example.com/v1"}}}
ROOT = Path(__file__).resolve().parent.parent
UPSTREAMS = {"openai": {"base_url": "http://127.0.0.1:1/v1"}}


def error_of(raw: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, {})
    return str(caught.value)


@pytest.mark.parametrize(
    "base_url",
    [
        "https://example.openai.azure.com/openai/deployments/d?api-version=2024-06-01",
        "https://api.example.com/v1#main",
        "https://api.example.com:99999/v1",
    ],
)
def test_a_base_url_the_endpoint_path_cannot_follow_is_a_config_error(base_url: str) -> None:
    """``base_url + "/chat/completions"`` put the path inside the query (or fragment): every
    call went upstream as ``POST /openai/deployments/d`` and came back a 404 (or, for a port
    that is none, a 502), while check-config said ok."""
    assert error_of({"upstreams": {"openai": {"base_url": base_url}}}).startswith(
        "upstreams.openai.base_url: invalid URL"
    )


def test_credentials_in_base_url_beside_a_key_header_are_a_config_error() -> None:
    """aiohttp refuses a request with both: every call was a 502 ``cannot send the request
    upstream: Cannot combine AUTHORIZATION header with ... credentials encoded in URL``."""
    upstream = {"base_url": "https://user:pw@gateway.example.com/v1", "api_key_env": "OPENAI_API_KEY"}
    assert error_of({"upstreams": {"openai": upstream}}).startswith(
        "upstreams.openai: base_url: credentials in the URL"
    )
    # Alone, they are the upstream's credentials (basic auth): taken.
    del upstream["api_key_env"]
    parse_config({"upstreams": {"openai": upstream}}, {})


async def test_a_query_in_base_url_never_reaches_the_endpoint(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """What such a config did at run time: the call went to the wrong path."""
    upstreams = {
        "openai": {
            "base_url": fake.base_url + "?api-version=1",
            "api_key_env": "TEST_UPSTREAM_KEY",
            "timeout_s": 5,
            "connect_timeout_s": 2,
        }
    }
    with pytest.raises(ConfigError, match=re.escape("upstreams.openai.base_url")):
        await make_proxy(upstreams=upstreams)


@pytest.mark.parametrize(
    "text, key",
    [
        # The second tier of the same name dropped the first's ceilings: unlimited, unseen.
        (
            "tiers:\n  standard:\n    run: {requests: 5, cost_usd: 2}\n  standard:\n    policy: {}\n",
            "standard",
        ),
        ("limits: {run_ttl_s: 0}\nlimits: {max_body_bytes: 2048}\n", "limits"),
        # A model written twice: the later entry took the earlier one's place in glob order.
        (
            "models:\n  'gpt-4o*': {upstream: openai, max_output_tokens: 5}\n  '*': {upstream: openai}\n"
            "  'gpt-4o*': {upstream: openai}\n",
            "gpt-4o*",
        ),
    ],
)
def test_a_key_written_twice_in_a_mapping_is_a_config_error(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("upstreams: {openai: {base_url: 'https://api.example.com/v1'}}\n" + text)
    with pytest.raises(ConfigError, match=re.escape(f"duplicate key {key!r}")):
        load_config(path, {})
    assert main(["check-config", str(path)]) == 2


def test_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "upstreams: {openai: {base_url: 'https://api.example.com/v1'}}\n"
        "tiers:\n"
        "  base: &base {run: {requests: 5}, on_budget_short: clamp}\n"
        "  standard:\n    <<: *base\n    run: {requests: 7}\n"
    )
    config = load_config(path, {})
    assert config.tiers["standard"].run.requests == 7
    assert config.tiers["standard"].on_budget_short == "clamp"


@pytest.mark.parametrize("encoding", ["o200k", "o200k-base", "cl100k"])
def test_an_encoding_tiktoken_does_not_know_is_a_config_error(encoding: str) -> None:
    """A typo loaded nothing at start: the model was reserved at UTF-8 bytes and counted at 4
    characters a token, with nothing but a start-up warning."""
    message = error_of({**UP, "models": {"gpt-4o": {"upstream": "openai", "encoding": encoding}}})
    assert message.startswith("models.gpt-4o.encoding: unknown tiktoken encoding")


@pytest.mark.parametrize("encoding", ["o200k_base", "cl100k_base", "p50k_base", "bytes"])
def test_known_encodings_are_taken(encoding: str) -> None:
    config = parse_config({**UP, "models": {"m": {"upstream": "openai", "encoding": encoding}}}, {})
    assert config.models["m"].encoding == encoding


async def test_every_model_the_example_config_routes_is_served_to_its_keys(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """config/example.yaml routed ``gpt-4o*`` and ``*`` without a price, under the one tier its
    keys have, which limits cost: every call to any model but gpt-4o-mini was a 400
    ``model_not_priced`` (check-config: ok)."""
    import aiohttp
    import yaml

    from tests.conftest import KEY_A

    example = yaml.safe_load((Path(__file__).resolve().parent.parent / "config" / "example.yaml").read_text())
    proxy = await make_proxy(models=example["models"], tiers=example["tiers"])
    async with aiohttp.ClientSession() as session:
        for pattern in example["models"]:
            model = pattern.replace("*", "-2024-08-06") if pattern != "*" else "some-model"
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            headers = {"Authorization": f"Bearer {KEY_A}"}
            async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, (pattern, await r.text())


@pytest.mark.parametrize(
    "redis_config, says",
    [
        ({"url": "redis://127.0.0.1:6379/3", "cluster": True}, "database 0"),
        ({"url": "redis://127.0.0.1:6379?db=2", "cluster": True}, "database 0"),
        ({"url": "unix:///run/redis.sock", "cluster": True}, "unix socket"),
    ],
)
def test_a_cluster_redis_py_cannot_reach_is_a_config_error(redis_config: dict[str, Any], says: str) -> None:
    """check-config said ok; serve, ledger and report then died with redis-py's
    RedisClusterException traceback (exit 1), the embedded default (a unix socket) included."""
    message = error_of({**UP, "redis": redis_config})
    assert message.startswith("redis: cluster: true needs") and says in message


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379", "redis://127.0.0.1:6379/0", "rediss://h:7000"])
def test_a_cluster_url_is_taken(url: str) -> None:
    assert parse_config({**UP, "redis": {"url": url, "cluster": True}}, {}).redis.cluster


def test_serve_on_a_cluster_url_with_a_database_exits_2_naming_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "config.yaml"
    path.write_text(
        "listen: {host: 127.0.0.1, port: 0}\n"
        "redis: {url: 'redis://127.0.0.1:1/3', cluster: true}\n"
        "upstreams: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n"
        f"journal_dir: {tmp_path / 'journal'}\n"
    )
    root = Path(__file__).resolve().parent.parent
    for command in (["serve", "--config", str(path)], ["ledger", "--config", str(path), "--tenant", "t"]):
        result = subprocess.run(
            [sys.executable, "-m", "proxy", *command],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=60,
            env={"PATH": "/usr/bin:/bin"},
        )
        assert result.returncode == 2, (command, result.stderr[-500:])
        assert "Traceback" not in result.stderr and "redis: cluster: true needs database 0" in result.stderr


def _password(url: str) -> str:
    return url.split("://", 1)[1].rpartition("@")[0].partition(":")[2]


# A generated password (``openssl rand -base64``) holds '/' and '+'; one typed by hand may hold
# '#' or '?'. Unescaped, each ends the URL's address early: what follows reads as the port, the
# database, an option, and the messages quoted those.
@pytest.mark.parametrize(
    "url",
    [
        "redis://:Zx9Wq/Kp+3Lm8=@redis.internal:6379/0",
        "redis://app:Zx9Wq#Kp3Lm8@redis.internal:6379/0",
        "redis://:Zx9Wq?Kp3Lm8@redis.internal:6379/0",
        "redis://:4242/Kp3Lm8@redis.internal:6379/0",
        "redis://:4242?Kp3Lm8@redis.internal:6379/0",
    ],
)
def test_a_refused_redis_url_never_quotes_any_part_of_its_password(url: str) -> None:
    raw = {"upstreams": UPSTREAMS, "redis": {"url_env": "REDIS_URL"}}
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, {"REDIS_URL": url})
    password, message = _password(url), str(caught.value)
    for piece in {password[:5], password[-6:]}:
        assert piece not in message, message


@pytest.mark.parametrize(
    "url", ["https://gwuser:Zx9Wq/Kp+3Lm8=@gw.internal/v1", "https://gwuser:4242/Kp3Lm8@gw.internal/v1"]
)
def test_a_base_url_whose_password_holds_a_slash_is_refused_without_quoting_it(url: str) -> None:
    """The first was refused quoting 'gwuser:Zx9Wq'; the second was accepted, as a call to host
    'gwuser' port 4242 (the key header, had there been one, with it)."""
    with pytest.raises(ConfigError) as caught:
        parse_config({"upstreams": {"gw": {"base_url": url}}, "models": {"*": {"upstream": "gw"}}}, {})
    password, message = _password(url), str(caught.value)
    for piece in {password[:5], password[-6:]}:
        assert piece not in message, message


def test_check_config_does_not_print_a_redis_password(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    config = {"redis": {"url": "redis://:Zx9Wq/Kp+3Lm8=@redis.internal:6379/0"}, "upstreams": UPSTREAMS}
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", str(path)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "Zx9Wq" not in done.stdout + done.stderr, done.stderr


# A price list built with anchors and merge keys: gpt-4o's flex prices are its default prices
# with input and output overridden, and the batch model's prices are those flex prices with the
# cached input overridden. Each mapping writes each of its own keys once; PyYAML (safe_load)
# reads it as intended.
PRICES_WITH_MERGES = """\
upstreams: {openai: {base_url: 'https://api.example.com/v1'}}
models:
  gpt-4o:
    upstream: openai
    price_per_million: &gpt4o {input: 2.50, cached_input: 1.25, output: 10.00}
    service_tiers:
      flex: &gpt4o_flex
        <<: *gpt4o
        input: 1.25
        output: 5.00
  gpt-4o-batch:
    upstream: openai
    price_per_million:
      <<: *gpt4o_flex
      cached_input: 0.50
"""


def test_a_merged_mapping_that_overrides_its_own_merge_is_not_a_duplicate(tmp_path: Path) -> None:
    """The duplicate-key check looked at a mapping's entries when it was constructed; a merge
    elsewhere (``<<: *gpt4o_flex``, one level up, constructed first) had already flattened the
    anchored mapping in place (its merged keys written in front of its own), so its own
    overrides read as keys written twice: a valid file refused, 'found duplicate key input'."""
    path = tmp_path / "config.yaml"
    path.write_text(PRICES_WITH_MERGES)
    config = load_config(path, {})
    flex = config.models["gpt-4o"].service_tiers["flex"]
    batch = config.models["gpt-4o-batch"].price_per_million
    assert batch is not None
    assert (flex.input, flex.output, flex.cached_input) == (1.25, 5, 1.25)
    assert (batch.input, batch.output, batch.cached_input) == (1.25, 5, 0.5)
    assert main(["check-config", str(path)]) == 0


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("      cached_input: 0.50\n", "      cached_input: 0.50\n      cached_input: 0.6\n", "cached_input"),
        # In the anchored mapping that a merge one level up flattens first.
        ("        output: 5.00\n", "        output: 5.00\n        output: 6.00\n", "output"),
    ],
)
def test_a_key_written_twice_beside_a_merge_is_still_refused(
    tmp_path: Path, old: str, new: str, key: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(PRICES_WITH_MERGES.replace(old, new))
    with pytest.raises(ConfigError, match=re.escape(f"duplicate key {key!r}")):
        load_config(path, {})


async def test_an_anthropic_upstream_behind_a_basic_auth_gateway_is_served(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """The credentials-in-base_url check refuses them beside any key header, for the reason
    that aiohttp refuses a request with both an ``Authorization`` header and URL credentials.
    An Anthropic upstream sends its key as ``x-api-key``, not ``Authorization``: a gateway's
    basic auth in the URL and the provider's key go together, and did before the check (now a
    config error, a deployment that worked refused)."""
    base = fake.base_url.replace("http://", "http://gw:s3cret@", 1)
    upstreams = {"claude": {"base_url": base, "kind": "anthropic", "api_key_env": "TEST_UPSTREAM_KEY"}}
    proxy = await make_proxy(upstreams=upstreams, models={"claude-*": {"upstream": "claude"}})
    body = {"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {KEY_A}", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/messages", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
    sent = fake.received[-1].headers
    assert sent["x-api-key"] and sent["Authorization"].startswith("Basic ")


def test_a_cluster_url_given_on_the_command_line_is_taken(
    cluster: RedisClusterProcesses,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``redis: {cluster: true}`` in the file, the node's URL from ``--redis-url`` (what the
    CLI's own message for a cluster without a URL tells the operator to give): the config check
    now refuses the file itself ('cluster: true needs a url'), before the flag is applied, so
    serve, ledger and report exit 2 on a cluster they reached before; and a running proxy's
    reload, which reads the file alone, refuses every change to it."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "redis: {cluster: true}\n"
        "upstreams: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n"
        f"journal_dir: {tmp_path / 'journal'}\n"
        "keys: [{name: a, sha256: '" + "0" * 64 + "', tenant: team-a}]\n"  # a tenant it knows
    )
    args = ["report", "--config", str(path), "--redis-url", cluster.url, "--tenant", "team-a"]
    assert main(args) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == "no ledger entries\n"
    load_config(path, {})  # what a reload reads: the URL stays the command line's


def test_a_cluster_without_any_url_still_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("redis: {cluster: true}\nupstreams: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n")
    assert main(["report", "--config", str(path), "--tenant", "team-a"]) == 2
    err = capsys.readouterr().err
    assert "the embedded redis-server is not a cluster" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "text",
    [
        # A new URL written above the old one, the old one not yet deleted.
        "redis:\n  url: 'redis://:Zx9WqKp3Lm8@redis-old.internal:6379/0'\n"
        "  url: 'redis://:Zx9WqKp3Lm8@redis.internal:6379/0'\n",
        "upstreams:\n  gw: {base_url: 'https://u:Zx9WqKp3Lm8@gw.internal/v1', kind: anthropic}\n"
        "  gw: {base_url: 'https://u:Zx9WqKp3Lm8@gw2.internal/v1'}\n",
    ],
)
def test_a_key_written_twice_is_refused_without_quoting_the_lines_around_it(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The duplicate-key error carried PyYAML's snippets of the lines it points at: the URL's
    password went to stderr from check-config and serve, and to the log from a reload ('config
    reload refused'), which every other refusal of a URL is careful never to quote."""
    path = tmp_path / "config.yaml"
    rest = "upstreams: {openai: {base_url: 'https://api.example.com/v1'}}\n" if "redis" in text else ""
    path.write_text(text + rest)
    with pytest.raises(ConfigError, match="duplicate key") as caught:
        load_config(path, {})
    assert "Zx9Wq" not in str(caught.value), str(caught.value)
    assert main(["check-config", str(path)]) == 2
    assert "Zx9Wq" not in capsys.readouterr().err


def test_a_yaml_error_names_its_line_without_quoting_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PyYAML's message for a syntax error quotes the line it is on: a password in a URL there
    went to the terminal (check-config, serve) or to the log (a refused reload)."""
    path = tmp_path / "config.yaml"
    path.write_text("redis:\n  url: 'redis://:Zx9WqKp3Lm8@redis.internal:6379/0' x: [\n")
    with pytest.raises(ConfigError, match="invalid YAML") as caught:
        load_config(path, {})
    assert "line 2" in str(caught.value) and "Zx9Wq" not in str(caught.value), str(caught.value)
    assert main(["check-config", str(path)]) == 2
    assert "Zx9Wq" not in capsys.readouterr().err


HEAD = "upstreams:\n  openai: {base_url: 'https://api.example.com/v1'}\n"


@pytest.mark.parametrize(
    ("text", "figure"),
    [
        ("tiers:\n  standard:\n    run: {requests: 010}\n", "010"),  # YAML 1.1: 8
        ("tiers:\n  standard:\n    key: {concurrent: 1:30}\n", "1:30"),  # base 60: 90
        ("models:\n  '*': {upstream: openai, price_per_million: {input: 010, output: 1}}\n", "010"),
        ("models:\n  '*': {upstream: openai, price_per_million: {input: 2:50, output: 1}}\n", "2:50"),
        ("limits: {default_max_output_tokens: 0100}\n", "0100"),  # 64
        ("models:\n  '*': {upstream: openai, max_output_tokens: 0100}\n", "0100"),
    ],
)
def test_a_yaml_11_octal_or_base_60_number_is_refused_not_read_as_another_figure(
    tmp_path: Path, text: str, figure: str
) -> None:
    """``requests: 010`` was a ceiling of 8 and ``input: 2:50`` a price of 170 per million: PyYAML
    reads YAML 1.1's octal and base-60 numbers, and check-config said ok (the config hunt)."""
    path = tmp_path / "proxy.yaml"
    path.write_text(HEAD + text)
    with pytest.raises(ConfigError, match=re.escape(figure)):
        load_config(path, {})
    # Written as meant, or quoted, they load.
    plain = text.replace(figure, figure.lstrip("0").replace(":", "") or "0")
    path.write_text(HEAD + plain)
    load_config(path, {})


@pytest.mark.parametrize(
    ("text", "figure"),
    [
        (
            "models:\n  '*': {upstream: openai, price_per_million: {input: 2.5000000000000001, output: 1}}\n",
            "2.5000000000000001",
        ),
        (
            "models:\n  '*': {upstream: openai, price_per_million: {input: 1.0000000000000001, output: 1}}\n",
            "1.0000000000000001",
        ),
        ("tiers: {standard: {run: {cost_usd: 100.00000000000000001}}}\n", "100.00000000000000001"),
    ],
)
def test_a_yaml_float_with_more_digits_than_it_keeps_is_refused_not_rounded(
    tmp_path: Path, text: str, figure: str
) -> None:
    """Unquoted, YAML reads a float, which rounds the 7th+ decimal places away before the six
    places check: ``input: 2.5000000000000001`` was taken as a price of 2.5 (the config hunt)."""
    path = tmp_path / "proxy.yaml"
    path.write_text(HEAD + text)
    with pytest.raises(ConfigError, match=re.escape(figure) + " has more digits"):
        load_config(path, {})
    # Quoted, it is a decimal the six places check refuses; with the digits a float keeps, taken.
    path.write_text(HEAD + text.replace(figure, f"'{figure}'"))
    with pytest.raises(ConfigError):
        load_config(path, {})
    path.write_text(HEAD + text.replace(figure, "2.500001"))
    load_config(path, {})


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("listen: {port: off}\n", "listen.port"),  # 0: a random free port
        ("redis: {pool_size: yes}\n", "redis.pool_size"),  # one connection for every call
        ("limits: {lease_margin_s: yes}\n", "limits.lease_margin_s"),
        ("upstreams:\n  openai: {base_url: 'https://api.example.com/v1', timeout_s: on}\n", "timeout_s"),
    ],
)
def test_a_yaml_boolean_is_not_a_port_a_pool_size_or_a_timeout(tmp_path: Path, text: str, field: str) -> None:
    """true/false/yes/no/on/off are 1 and 0 to a number: refused for counts already, they were
    taken as a port (off: any free one), a pool of one connection, a timeout of a second (the
    config hunt). Every number of the config refuses them now."""
    path = tmp_path / "proxy.yaml"
    path.write_text(text if text.startswith("upstreams") else HEAD + text)
    with pytest.raises(ConfigError, match=re.escape(field) + ".*not true or false"):
        load_config(path, {})


@pytest.mark.parametrize("metrics_host", ["127.0.0.1", "0.0.0.0", "localhost"])
def test_a_metrics_listener_on_the_main_port_is_refused_by_check_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], metrics_host: str
) -> None:
    """check-config said ok; serve bound the metrics listener first, then failed its own port
    with 'address already in use', as though another process held it (the config hunt)."""
    path = tmp_path / "proxy.yaml"
    path.write_text(
        HEAD
        + "listen: {host: 127.0.0.1, port: 18555}\n"
        + f"metrics: {{listen: {{host: '{metrics_host}', port: 18555}}}}\n"
    )
    assert main(["check-config", str(path)]) == 2
    assert "metrics.listen" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--upstream", "ftp://api.example.com/v1"),
        ("--upstream", "https://user:secret@api.example.com/v1"),
        ("--port", "70000"),
        ("--redis-url", "notaurl"),
    ],
)
def test_a_bad_zero_config_flag_is_named_as_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Zero-config has no file: its errors named fields nobody wrote ('upstreams.default.base_url:
    invalid URL', 'listen.port: ...', 'redis.url: ...'), where the flag is what to mend (the
    config hunt)."""
    args = {"--upstream": "https://api.example.com/v1", "--port": "0", "--redis-url": "redis://127.0.0.1:1"}
    args[flag] = value
    assert main(["serve", *[x for pair in args.items() for x in pair]]) == 2
    err = capsys.readouterr().err
    assert f"{flag}:" in err and "upstreams.default" not in err and "secret" not in err, err


def test_an_upstream_key_variable_not_set_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every call to the upstream is refused a 502 upstream_auth: a typo in the variable's name
    was told nowhere (the config hunt). Warned, not refused: a reload may follow."""
    path = tmp_path / "proxy.yaml"
    path.write_text(HEAD.replace("'}", "', api_key_env: OPENAI_KEY_TYPO}"))
    load_config(path, {})
    said = "upstreams.openai.api_key_env: OPENAI_KEY_TYPO is not set"
    assert any(said in record.getMessage() for record in caplog.records)
    caplog.clear()
    assert load_config(path, {"OPENAI_KEY_TYPO": "sk-up"}).upstreams["openai"].api_key is not None
    assert not caplog.records


def test_a_metrics_listener_beside_the_main_one_on_another_address_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(
        HEAD + "listen: {host: 127.0.0.1, port: 18555}\nmetrics: {listen: {host: '::1', port: 18555}}\n"
    )
    assert load_config(path, {}).metrics.listen is not None


def _read_by(loader: Any, text: str) -> Any:
    """What ``loader`` reads of ``text``, or the error it refuses it with (said as
    ``load_config`` says it: marks only, no snippet)."""
    try:
        return yaml.load(text, Loader=loader)
    except yaml.MarkedYAMLError as err:
        return (
            f"{type(err).__name__}: {err.context} {err.problem} {err.problem_mark and err.problem_mark.line}"
        )


@pytest.mark.parametrize(
    "text",
    [
        PRICES_WITH_MERGES,
        PRICES_WITH_MERGES.replace(
            "      cached_input: 0.50\n", "      cached_input: 0.50\n      cached_input: 0.6\n"
        ),
        PRICES_WITH_MERGES.replace("        output: 5.00\n", "        output: 5.00\n        output: 6.00\n"),
        "a: 1\nb: {c: 2, c: 3}\n",
        "? [1, 2]\n: x\n? [1, 2]\n: y\n",  # an unhashable key: PyYAML's own refusal
        HEAD + "tiers:\n  standard:\n    run: {requests: 010}\n",
        HEAD + "tiers:\n  standard:\n    key: {concurrent: 1:30}\n",
        HEAD + "tiers: {standard: {run: {cost_usd: 100.00000000000000001}}}\n",
        "figures: [1_000, 0x1F, 0b101, -7, +3, 1.5e3, .inf, -.inf, 2.500001, 0, 0.0, 10, '010']\n",
        "flags: [yes, no, on, off, ~, null, 2001-02-03]\n",
    ],
)
def test_libyamls_parser_reads_a_file_as_the_pure_python_one_did(text: str) -> None:
    """The config is read by libyaml's parser where PyYAML has it (a file of 5,000 keys loaded
    in about 0.2 s, not 1.1 s, on a reload or at start): the duplicate-key check, the figures'
    checks and merges behave as under the pure-Python parser, which is kept where it lacks it."""
    assert yaml.__with_libyaml__, "PyYAML without libyaml here: nothing to compare"
    assert issubclass(config_load._UniqueKeyLoader, yaml.CSafeLoader)
    assert issubclass(config_load._PyUniqueKeyLoader, yaml.SafeLoader)
    read = _read_by(config_load._UniqueKeyLoader, text)
    assert read == _read_by(config_load._PyUniqueKeyLoader, text)
    if not isinstance(read, str):  # not refused: as PyYAML's own safe loaders read it
        assert read == _read_by(yaml.SafeLoader, text) == _read_by(yaml.CSafeLoader, text)


def test_a_big_config_reads_alike_under_either_parser() -> None:
    text = yaml.safe_dump(big_config("http://127.0.0.1:1/v1", "redis://127.0.0.1:1/0", keys=500))
    read = yaml.load(text, Loader=config_load._UniqueKeyLoader)
    assert read == yaml.load(text, Loader=config_load._PyUniqueKeyLoader) == yaml.safe_load(text)
