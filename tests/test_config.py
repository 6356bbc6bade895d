"""Config validation: field-named errors, secrets from the environment, the shipped examples."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import Config
from proxy.config_load import load_config, parse_config, with_flags
from proxy.config_tiers import TierConfig
from proxy.errors import ConfigError
from proxy.reload import ConfigReloader
from tests.conftest import UPSTREAM_KEY, base_config, big_config

ROOT = Path(__file__).resolve().parent.parent
UP = {"upstreams": {"openai": {"base_url": "https://api.example.com/v1"}}}


def error_of(raw: Any, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, env or {})
    return str(caught.value)


def test_the_example_config_loads() -> None:
    config = load_config(
        ROOT / "config" / "example.yaml", {"DEV_PROXY_KEY": "sk-dev", "OPENAI_API_KEY": "sk-up"}
    )
    assert config.route("gpt-4o-mini") is not None
    assert config.route("gpt-4o-2024")[0] == "gpt-4o*"  # type: ignore[index]
    # A dated mini (the name the alias serves) was priced as gpt-4o, 16 times dearer; audio
    # models' audio tokens at text prices (found by the routing hunt).
    for model in ("gpt-4o-mini-2024-07-18", "gpt-4o-mini-search-preview"):
        assert config.route(model)[0] == "gpt-4o-mini*"  # type: ignore[index]
    assert config.route("gpt-4o-audio-preview")[0] == "gpt-4o-audio*"  # type: ignore[index]
    assert config.route("gpt-4o-mini-audio-preview")[0] == "gpt-4o-mini-audio*"  # type: ignore[index]
    assert config.tiers["standard"].run.as_meters()["cost_micros"] == 2_000_000
    dev = dict((key.name, digest) for digest, key in config.key_digests)["dev"]
    assert dev == hashlib.sha256(b"sk-dev").hexdigest()
    assert config.upstreams["openai"].api_key is not None
    assert config.upstreams["openai"].api_key.get_secret_value() == "sk-up"


def test_one_secret_for_two_keys_is_refused() -> None:
    """Which tenant and tier such a secret bills would otherwise depend on the keys' order."""
    digest = hashlib.sha256(b"sk-shared").hexdigest()
    keys = [
        {"name": "a", "sha256": digest, "tenant": "t1"},
        {"name": "b", "key_env": "B_KEY", "tenant": "t2"},
    ]
    assert "keys.b: the same secret as keys.a" in error_of({**UP, "keys": keys}, {"B_KEY": "sk-shared"})


def test_an_admin_key_that_is_a_tenants_key_is_refused() -> None:
    """The tenant holding it would read /metrics, every tenant's spend (the authorization hunt)."""
    digest = hashlib.sha256(b"sk-shared").hexdigest()
    keys = [{"name": "a", "sha256": digest, "tenant": "t1"}]
    admin = [{"name": "ops", "key_env": "OPS_KEY"}]
    raw = {**UP, "keys": keys, "admin_keys": admin}
    assert "admin_keys.ops: the same secret as keys.a" in error_of(raw, {"OPS_KEY": "sk-shared"})
    assert parse_config(raw, {"OPS_KEY": "sk-ops-own"}).admin_digests


def test_a_key_is_found_among_many() -> None:
    keys = [
        {"name": f"k{i}", "sha256": hashlib.sha256(f"sk-{i}".encode()).hexdigest(), "tenant": "t"}
        for i in range(500)
    ]
    config = parse_config({**UP, "keys": keys}, {})
    found = config.key_for_digest(hashlib.sha256(b"sk-499").hexdigest())
    assert found is not None and found.name == "k499"
    assert config.key_for_digest(hashlib.sha256(b"sk-500").hexdigest()) is None
    # A copy (a reload's) answers from its own keys, not from the original's lookup.
    copy = config.model_copy(update={"key_digests": config.key_digests[:1]})
    assert copy.key_for_digest(hashlib.sha256(b"sk-499").hexdigest()) is None


def test_a_tier_hashes_by_value_once() -> None:
    """Tiers key the scopes' cache: equal tiers hash equal, a changed copy does not keep the
    original's remembered hash."""
    tier = TierConfig(min_output_tokens=5)
    assert hash(tier) == hash(TierConfig(min_output_tokens=5))
    assert hash(tier.model_copy(update={"min_output_tokens": 6})) == hash(TierConfig(min_output_tokens=6))
    assert hash(tier) != hash(TierConfig())


def test_the_docker_config_loads() -> None:
    config = load_config(
        ROOT / "config" / "docker.yaml", {"PROXY_API_KEY": "k", "REDIS_URL": "redis://r:6379/0"}
    )
    assert config.redis.url == "redis://r:6379/0"
    assert config.listen.host == "0.0.0.0"


def test_errors_name_the_field() -> None:
    assert (
        error_of({"upstreams": {"openai": {"base_url": "not a url"}}})
        == "upstreams.openai.base_url: invalid URL"
    )
    assert "models.*.upstream: unknown upstream 'nope'" in error_of(
        {**UP, "models": {"*": {"upstream": "nope"}}}
    )
    assert "keys.0" in error_of({**UP, "keys": [{"name": "k", "tenant": "t"}]})
    assert "keys.k.key_env: environment variable K_ENV is not set" in error_of(
        {**UP, "keys": [{"name": "k", "key_env": "K_ENV", "tenant": "t"}]}
    )
    assert "policy.on_truncate" in error_of({**UP, "policy": {"on_truncate": "maybe"}})
    assert "tiers.standard: windows: one entry per period" in error_of(
        {**UP, "tiers": {"standard": {"windows": [{"period": "day", "requests": 1}, {"period": "day"}]}}}
    )
    assert "6 decimal places" in error_of(
        {
            **UP,
            "models": {"*": {"upstream": "openai", "price_per_million": {"input": "0.0000001", "output": 1}}},
        }
    )
    assert "redis.url" in error_of({**UP, "redis": {"url": "http://x"}})
    assert "unknown_field" in error_of({**UP, "unknown_field": 1})


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad, {})
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml", {})


def test_prices_are_exact_integers_per_million() -> None:
    config = parse_config(
        {
            **UP,
            "models": {
                "*": {
                    "upstream": "openai",
                    "price_per_million": {"input": "0.15", "cached_input": "0.075", "output": "0.6"},
                }
            },
        },
        {},
    )
    rates = config.models["*"].price_per_million.micros_per_million()  # type: ignore[union-attr]
    assert rates == {
        "input": 150_000,
        "cached_input": 75_000,
        "output": 600_000,
        "reasoning": 600_000,
        "cache_creation_input": 150_000,
        "cache_creation_input_1h": 150_000,  # as cache_creation_input, as text unless given
        "audio_input": 150_000,
        "audio_output": 600_000,
        "image_input": 150_000,
        "image_output": 600_000,
    }


def test_exact_model_names_win_over_globs() -> None:
    config = parse_config(
        {
            **UP,
            "models": {
                "gpt-4o*": {"upstream": "openai"},
                "gpt-4o-mini": {"upstream": "openai", "max_output_tokens": 5},
            },
        },
        {},
    )
    assert config.route("gpt-4o-mini")[0] == "gpt-4o-mini"  # type: ignore[index]
    assert config.route("gpt-4o")[0] == "gpt-4o*"  # type: ignore[index]
    assert config.route("claude") is None


def test_a_tier_policy_overrides_only_the_fields_it_sets() -> None:
    raw = {
        **UP,
        "policy": {"on_truncate": "pass", "on_invalid_json": "reject"},
        "tiers": {"strict": {"policy": {"on_truncate": "reject"}}, "plain": {}},
        "keys": [{"name": "k", "sha256": "0" * 64, "tenant": "t", "tier": "strict"}],
    }
    config = parse_config(raw, {})
    strict = config.policy_for("strict")
    assert (strict.on_truncate, strict.on_invalid_json) == ("reject", "reject")
    assert config.policy_for("plain") == config.policy_for("unknown") == config.policy
    assert config.policy_for("strict") is strict  # merged once per config
    assert config.tenants == {"t"}
    # A copy with other fields derives from its own (cached values are not carried over).
    stricter = config.model_copy(
        update={
            "policy": config.policy.model_copy(update={"on_invalid_json": "pass"}),
            "keys": (config.keys[0].model_copy(update={"tenant": "u"}),),
        }
    )
    assert stricter.policy_for("strict").on_invalid_json == "pass" and stricter.tenants == {"u"}
    reloaded = parse_config({**raw, "tiers": {"strict": {"policy": {"on_invalid_json": "pass"}}}}, {})
    assert (reloaded.policy_for("strict").on_truncate, reloaded.policy_for("strict").on_invalid_json) == (
        "pass",
        "pass",
    )


def _started_from_file(tmp_path: Path) -> tuple[dict[str, Any], Path, dict[str, str], Config]:
    """A config file, its environment, and the config a proxy started with it: for a reload."""
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:6379/0")
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {"TEST_UPSTREAM_KEY": "x"}
    return raw, path, env, load_config(path, env)


def test_a_reload_keeps_the_settled_marker_ttl_the_store_started_with(tmp_path: Path) -> None:
    raw, path, env, started = _started_from_file(tmp_path)
    applied: list[Config] = []
    raw["limits"] = {"settled_marker_ttl_s": 7200, "default_max_output_tokens": 77}
    path.write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        assert ConfigReloader(path, lambda: started, applied.append).reload("test")
    (new,) = applied
    assert new.limits.default_max_output_tokens == 77  # the rest of the reload applies
    assert new.limits.settled_marker_ttl_s == started.limits.settled_marker_ttl_s == 3600


def test_a_reload_raising_a_timeout_past_the_running_settled_markers_bound_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The marker's TTL changes only on restart, a timeout on reload: a file raising both is
    valid alone, and in force with the running marker of 3600 s a call the store lost whose
    lease (3,530 s) passes 90% of it (3,240 s) would go unbilled. Refused, naming both; a timeout
    within the running marker's bound is taken."""
    raw, path, env, started = _started_from_file(tmp_path)
    assert started.limits.settled_marker_ttl_s == 3600
    applied: list[Config] = []
    raw["upstreams"]["openai"]["timeout_s"] = 3500
    raw["limits"] = {**raw.get("limits", {}), "settled_marker_ttl_s": 7200, "lease_margin_s": 30}
    path.write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        reloader = ConfigReloader(path, lambda: started, applied.append)
        assert not reloader.reload("test")
        assert applied == []
        (refusal,) = [r for r in caplog.records if "reload refused" in r.getMessage()]
        for named in ("limits.settled_marker_ttl_s (3600)", "upstreams.openai.timeout_s", "restart"):
            assert named in refusal.error, refusal.error  # type: ignore[attr-defined]
        raw["upstreams"]["openai"]["timeout_s"] = 3210  # a lease of 3,240 s
        path.write_text(yaml.safe_dump(raw))
        assert reloader.reload("test")
    assert applied[0].upstreams["openai"].timeout_s == 3210
    assert applied[0].limits.settled_marker_ttl_s == 3600


def test_a_reload_shortening_a_lease_past_the_running_socket_timeout_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's socket timeout changes only on restart (``redis``), a timeout and the lease
    margin on reload: a file lowering both to a lease of 3 s with a socket timeout of 1.9 s is
    valid alone, and in force with the running 5 s a Redis stalled for 4 s would hold every
    renewal past the lease (the slow-Redis hunt). Refused, naming them; a lease past 7.5 s is
    taken, the running socket timeout kept."""
    raw, path, env, started = _started_from_file(tmp_path)
    assert started.redis.socket_timeout_s == 5
    applied: list[Config] = []
    raw["upstreams"]["openai"]["timeout_s"] = 2
    raw["redis"] = {**raw["redis"], "socket_timeout_s": 1.9}
    raw["limits"] = {**raw.get("limits", {}), "lease_margin_s": 1}
    path.write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        reloader = ConfigReloader(path, lambda: started, applied.append)
        assert not reloader.reload("test")
        assert applied == []
        (refusal,) = [r for r in caplog.records if "reload refused" in r.getMessage()]
        for named in (
            "redis.socket_timeout_s (5)",
            "upstreams.openai.timeout_s plus limits.lease_margin_s (3 s)",
            "the running 5 s changes only on restart",
        ):
            assert named in refusal.error, refusal.error  # type: ignore[attr-defined]
        raw["limits"]["lease_margin_s"] = 6  # a lease of 8 s: renewals wait 5 s at most
        path.write_text(yaml.safe_dump(raw))
        assert reloader.reload("test")
    assert applied[0].limits.lease_margin_s == 6
    assert applied[0].redis.socket_timeout_s == 5


def test_a_reload_that_drops_redis_url_says_the_store_does_not_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Changing redis.url is named in the 'only on restart' warning; deleting it (back to the
    embedded server) was applied with 'config reloaded' alone, while the proxy kept writing to
    the old Redis (the config hunt)."""
    raw, path, env, started = _started_from_file(tmp_path)
    applied: list[Config] = []
    caplog.set_level(logging.INFO)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        reloader = ConfigReloader(path, lambda: started, applied.append)
        raw["redis"] = {k: v for k, v in raw["redis"].items() if k != "url"}
        path.write_text(yaml.safe_dump(raw))
        assert reloader.reload("test")
    assert applied[0].redis.url == "redis://127.0.0.1:6379/0"  # kept, as it must be
    warnings = [r for r in caplog.records if "only on restart" in r.getMessage()]
    assert warnings and "redis.url" in warnings[0].settings  # type: ignore[attr-defined]


@pytest.mark.parametrize("also_a_price", [False, True], ids=["start-only-alone", "with-a-price"])
def test_a_start_only_setting_saved_while_the_proxy_starts_is_named_as_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, also_a_price: bool
) -> None:
    """The file saved between ``serve`` reading it and the worker's reloader starting: the
    reloader took the newer file for the one the proxy started from, so a start-only change in
    it (``currency`` here) was never named; alone, the file was not even reloaded (it looked like
    the config in force). ``serve`` hands the file as it read it to the reloader (the config
    hunt)."""
    raw, path, env, started = _started_from_file(tmp_path)  # what serve read
    raw["currency"] = "EUR"  # saved while the proxy starts
    if also_a_price:
        raw["models"]["*"]["price_per_million"] = {"input": 1, "output": 2}
    path.write_text(yaml.safe_dump(raw))
    applied: list[Config] = []
    caplog.set_level(logging.INFO)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        reloader = ConfigReloader(path, lambda: started, applied.append, started_from=started)
        assert reloader.changed()
        reloader.reload("file changed while starting")  # as app.reload_ctx does
    assert applied[-1].currency == "USD"  # start-only: kept
    warnings = [r for r in caplog.records if "only on restart" in r.getMessage()]
    assert warnings and "currency" in warnings[0].settings  # type: ignore[attr-defined]


def test_a_run_ttl_outlives_its_calls() -> None:
    assert "limits.run_ttl_s" in error_of({**UP, "limits": {"run_ttl_s": 60}})
    assert parse_config({**UP, "limits": {"run_ttl_s": 0}}, {}).limits.run_ttl_s == 0
    # A non-streaming call renews nothing: a run's keys must outlive the longest call's lease.
    slow = {
        "upstreams": {"openai": {"base_url": "https://api.example.com/v1", "timeout_s": 7200}},
        "limits": {"settled_marker_ttl_s": 8100},  # 90% of it outlasts the lease (7,230 s)
    }
    marker = slow["limits"]
    assert "upstreams.openai.timeout_s" in error_of({**slow, "limits": {**marker, "run_ttl_s": 3600}})
    assert parse_config({**slow, "limits": {**marker, "run_ttl_s": 7231}}, {}).limits.run_ttl_s == 7231
    assert parse_config({**slow, "limits": {**marker, "run_ttl_s": 0}}, {}).limits.run_ttl_s == 0


def test_a_ledger_retention_is_0_or_at_least_a_day_in_whole_seconds() -> None:
    assert parse_config(UP, {}).limits.ledger_retention_s == 0  # every entry kept, as before
    for kept in (0, 86400, 30 * 86400):
        limits = parse_config({**UP, "limits": {"ledger_retention_s": kept}}, {}).limits
        assert limits.ledger_retention_s == kept
    for refused in (3600, -1, 86400.5, True):
        error = error_of({**UP, "limits": {"ledger_retention_s": refused}})
        assert "limits.ledger_retention_s" in error, error
    said = error_of({**UP, "limits": {"ledger_retention_s": 3600}})
    assert "0 (every ledger entry kept for ever) or a whole number of seconds from 86400" in said
    assert said == error_of({**UP, "limits": {"ledger_retention_s": -1}})


def test_secrets_from_the_environment_lose_their_trailing_line_break() -> None:
    # A Kubernetes secret or an .env file often ends in "\n": as given, the upstream key could
    # not be sent (no header holds it: every call failed, billed at its reserve) and a proxy key
    # could never match (a presented key arrives stripped).
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:6379/0")
    raw["keys"] = [{"name": "k", "key_env": "PROXY_KEY", "tenant": "t"}]
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-up\n", "PROXY_KEY": " sk-team\r\n"})
    key = config.upstreams["openai"].api_key
    assert key is not None and key.get_secret_value() == "sk-up"
    assert config.key_for_digest(hashlib.sha256(b"sk-team").hexdigest()) is not None


def test_a_secret_with_a_control_character_inside_is_a_config_error() -> None:
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigError, match="TEST_UPSTREAM_KEY holds a control character"):
        parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-one\nsk-two"})


@pytest.mark.parametrize("section", ["upstreams", "keys", "admin_keys"])
def test_a_secret_that_is_not_utf8_is_a_config_error_naming_it(section: str) -> None:
    """A variable holding a Latin-1 byte, as os.environ gives it (a surrogate escape): an upstream
    key was taken, and each call's settle raised encoding it (a false 500, the lease left for the
    reaper to bill the reserve); a proxy or admin key's digest raised UnicodeEncodeError out of
    parse_config, a traceback."""
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:6379/0")
    environ = {"TEST_UPSTREAM_KEY": "sk-up", "SECRET": "sk-caf\udce9"}
    if section == "upstreams":
        raw["upstreams"]["openai"]["api_key_env"] = "SECRET"
        field = "upstreams.openai.api_key_env"
    else:
        entry: dict[str, Any] = {"name": "a", "key_env": "SECRET"}
        if section == "keys":
            entry["tenant"] = "t"
        raw[section] = [entry]
        field = f"{section}.a.key_env"
    with pytest.raises(ConfigError, match=f"^{field}: environment variable SECRET is not UTF-8 text$"):
        parse_config(raw, environ)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"upstreams: {}\n# caf\xe9\n", "not UTF-8 text"), (b"a: " + b"[" * 5000, "nested too deeply")],
    ids=["latin-1", "deep-yaml"],
)
def test_a_file_that_cannot_be_read_as_yaml_is_a_config_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):  # was UnicodeDecodeError, RecursionError
        load_config(path, {})


def test_a_reload_keeps_and_names_every_setting_used_only_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw, path, env, started = _started_from_file(tmp_path)
    applied: list[Config] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        reloader = ConfigReloader(path, lambda: started, applied.append)  # at start
        raw["redis"] = {"url": "redis://10.9.9.9:6379/0"}
        raw["currency"] = "EUR"
        raw["journal_dir"] = str(tmp_path / "elsewhere")
        raw["event_loop"] = "asyncio"
        raw["limits"] = {**raw["limits"], "reaper_interval_s": 1, "max_body_bytes": 2048}
        path.write_text(yaml.safe_dump(raw))
        assert reloader.reload("test")
    (new,) = applied
    assert new.limits.max_body_bytes == 2048  # read at each call: applies
    assert (new.redis, new.currency, new.journal_dir, new.event_loop) == (
        started.redis,
        started.currency,
        started.journal_dir,
        "auto",
    )
    assert new.limits.reaper_interval_s == started.limits.reaper_interval_s
    (warning,) = [r for r in caplog.records if "only on restart" in r.getMessage()]
    assert warning.settings == [  # type: ignore[attr-defined]
        "currency",
        "event_loop",
        "journal_dir",
        "limits.reaper_interval_s",
        "redis.url",
    ]


def test_a_reload_of_an_unchanged_file_names_nothing_the_command_line_or_a_worker_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Compared with the config in force, --port, --redis-url and a worker's own metrics port
    # (base + its index) were named as changed at every reload.
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:6379/0")
    raw["metrics"] = {"listen": {"host": "127.0.0.1", "port": 9100}}
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {"TEST_UPSTREAM_KEY": "x"}
    from_file = load_config(path, env)
    running = from_file.model_copy(
        update={
            "listen": from_file.listen.model_copy(update={"port": 18080}),
            "redis": from_file.redis.model_copy(update={"url": "redis://10.0.0.5:6379/0"}),
            "metrics": from_file.metrics.model_copy(
                update={"listen": from_file.metrics.listen.model_copy(update={"port": 9101})}  # type: ignore[union-attr]
            ),
        }
    )
    applied: list[Config] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        assert ConfigReloader(path, lambda: running, applied.append).reload("SIGHUP")
    assert not [r for r in caplog.records if "only on restart" in r.getMessage()]
    assert applied[0].listen.port == 18080 and applied[0].redis.url == "redis://10.0.0.5:6379/0"


@pytest.mark.parametrize(
    ("ceilings", "named"),
    [
        # Past the store's 15 digits: every call a 500 (decimal overflow), or a segfault in the
        # Redis client packing a 4,300-digit integer; a remaining-budget header of -9.2e18.
        ({"cost_usd": "1e4300"}, "cost_usd"),
        ({"cost_usd": "1e1000000"}, "cost_usd"),
        ({"cost_usd": 10**13}, "cost_usd"),
        ({"total_tokens": 10**20}, "total_tokens"),
        # Silently rounded: 1e-7 became a ceiling of 0, refusing every priced call.
        ({"cost_usd": "1e-7"}, "cost_usd"),
        ({"cost_usd": "0.30000000000000004"}, "cost_usd"),
        # YAML's true / false / no: a ceiling of 1 or 0.
        ({"requests": True}, "requests"),
        ({"concurrent": False}, "concurrent"),
    ],
)
def test_a_ceiling_the_store_cannot_hold_exactly_is_a_config_error(
    ceilings: dict[str, Any], named: str
) -> None:
    raw = base_config("http://upstream.invalid/v1", "redis://unused", tiers={"standard": {"run": ceilings}})
    assert named in error_of(raw)


@pytest.mark.parametrize("price", ["1e1000000", "1e999999", "1000000000"])
def test_an_absurd_price_is_a_config_error_naming_it(price: str) -> None:
    # Was a decimal.Overflow traceback out of check-config.
    raw = base_config("http://upstream.invalid/v1", "redis://unused")
    raw["models"] = {"*": {"upstream": "openai", "price_per_million": {"input": price, "output": "1"}}}
    assert "input" in error_of(raw)


def test_the_largest_ceilings_and_prices_the_store_holds_are_taken() -> None:
    raw = base_config(
        "http://upstream.invalid/v1",
        "redis://unused",
        tiers={"standard": {"run": {"cost_usd": "999999999.999999", "total_tokens": 10**15 - 1}}},
    )
    raw["models"] = {
        "*": {"upstream": "openai", "price_per_million": {"input": "999999999.999999", "output": 1}}
    }
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "k"})
    assert config.tiers["standard"].run.meters == {"total_tokens": 10**15 - 1, "cost_micros": 10**15 - 1}


def test_tier_prices_need_the_default_tiers_price() -> None:
    # Tier prices on an unpriced model were ignored: a priority call was billed 0.
    tiers = {"priority": {"input": "2.5", "output": "20"}}
    models = {"gpt-5": {"upstream": "openai", "service_tiers": tiers}}
    assert "price_per_million" in error_of({**UP, "models": models})
    priced = {"upstream": "openai", "price_per_million": {"input": "1", "output": "1"}}
    assert "service_tiers.auto" in error_of(
        {**UP, "models": {"m": {**priced, "service_tiers": {"auto": tiers["priority"]}}}}
    )


@pytest.mark.parametrize(
    "value", ["2001-02-30", "!!int 0x", "!!float x", "!!timestamp x", "!!bool maybe", "!!int ''", "!!int '-'"]
)
def test_a_yaml_value_that_cannot_be_built_is_a_config_error(tmp_path: Path, value: str) -> None:
    """A date that does not exist, a tag on what it does not fit: named, not a traceback, and a
    reload of such a file is refused (the old config stays) instead of raising."""
    from proxy.cli import main

    path = tmp_path / "config.yaml"
    raw = base_config("http://127.0.0.1:9", "redis://127.0.0.1:1")
    path.write_text(yaml.safe_dump(raw))
    running = load_config(path, {"TEST_UPSTREAM_KEY": "k"})
    applied: list[Config] = []
    reloader = ConfigReloader(path, lambda: running, applied.append)
    path.write_text(yaml.safe_dump(raw) + f"currency: {value}\n")
    with pytest.raises(ConfigError, match="invalid YAML value"):
        load_config(path, {})
    assert main(["check-config", str(path)]) == 2
    assert reloader.reload("SIGHUP") is False
    assert applied == []


def test_a_file_saved_after_the_config_in_force_was_read_is_seen_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved while the proxy started (the store, the tokenizer, the workers: seconds; a SIGHUP
    then is ignored): the reloader's first look says the file changed."""
    path = tmp_path / "config.yaml"
    raw = base_config("http://127.0.0.1:9", "redis://127.0.0.1:1")
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "k")
    loaded = load_config(path)
    # As serve's command line and a worker set them: not a change of the file.
    running = loaded.model_copy(update={"listen": loaded.listen.model_copy(update={"port": 1234})})
    assert not ConfigReloader(path, lambda: running, lambda _: None).changed()
    raw["tiers"] = {"standard": {"key": {"requests": 1}}}
    path.write_text(yaml.safe_dump(raw))
    assert ConfigReloader(path, lambda: running, lambda _: None).changed()


@pytest.mark.parametrize("deployed", ["symlink switched", "copied keeping its times", "saved in place"])
def test_the_watch_sees_a_new_file_of_the_old_ones_size_and_modification_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deployed: str
) -> None:
    """A config deployed as a symlink into a content-addressed store (Nix: every file's mtime
    is 1), copied with its times kept (``cp -p``, ``rsync -a``) and renamed into place, or saved
    twice within one tick of the file system's clock, has new content and neither a new size nor
    a new modification time: the watch looked at those alone, and a ceiling lowered from 9 to 2
    (the same bytes' count) never came into force (found by the reload hunt)."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "k")
    raw = base_config("http://127.0.0.1:9", "redis://127.0.0.1:1")
    raw["tiers"] = {"standard": {"run": {"requests": 9}}}
    store = tmp_path / "store"
    store.mkdir()
    first, second = store / "a.yaml", store / "b.yaml"
    first.write_text(yaml.safe_dump(raw))
    raw["tiers"] = {"standard": {"run": {"requests": 2}}}
    second.write_text(yaml.safe_dump(raw))
    for made in (first, second):
        os.utime(made, ns=(1, 1))
    assert first.stat().st_size == second.stat().st_size
    path = tmp_path / "config.yaml"
    if deployed == "symlink switched":
        path.symlink_to(first)
    else:
        path.write_bytes(first.read_bytes())
        os.utime(path, ns=(1, 1))
    running = load_config(path)
    reloader = ConfigReloader(path, lambda: running, lambda _: None)
    assert not reloader.changed()
    staged = tmp_path / "config.yaml.new"
    if deployed == "symlink switched":
        staged.symlink_to(second)
        os.replace(staged, path)
    elif deployed == "copied keeping its times":
        staged.write_bytes(second.read_bytes())
        os.utime(staged, ns=(1, 1))
        os.replace(staged, path)
    else:
        path.write_bytes(second.read_bytes())
        os.utime(path, ns=(1, 1))
    assert reloader.changed()
    assert reloader.reload("test")
    assert not reloader.changed()


async def test_the_watch_reloads_a_file_once_per_save_and_goes_on_after_a_failed_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is polled: a reload for each save, none while it stays as it is (each would log
    and count a reload), and one that raised does not end the watching."""
    path = tmp_path / "config.yaml"
    raw = base_config("http://127.0.0.1:9", "redis://127.0.0.1:1")
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "k")
    running = load_config(path)
    applied: list[Config] = []

    def apply(new: Config) -> None:
        applied.append(new)
        if len(applied) == 1:
            raise RuntimeError("the first reload's apply fails")

    reloader = ConfigReloader(path, lambda: running, apply)
    looks = 0
    changed = reloader.changed

    def counted_look() -> bool:
        nonlocal looks
        looks += 1
        return changed()

    monkeypatch.setattr(reloader, "changed", counted_look)

    async def looks_past(count: int) -> None:
        for _ in range(2000):
            if looks >= count:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"the watch looked {looks} times, not {count}")

    task = asyncio.create_task(reloader.watch(0.001))
    try:
        await looks_past(20)
        assert applied == []  # unchanged: never reloaded
        raw["tiers"] = {"standard": {"key": {"requests": 1}}}
        path.write_text(yaml.safe_dump(raw))
        await looks_past(looks + 20)
        assert len(applied) == 1  # one save, one reload (its apply raised)
        raw["tiers"] = {"standard": {"key": {"requests": 22}}}
        path.write_text(yaml.safe_dump(raw))
        await looks_past(looks + 20)
        assert len(applied) == 2 and not task.done()
        assert applied[1].tiers["standard"].key is not None
        assert applied[1].tiers["standard"].key.requests == 22
    finally:
        task.cancel()


@pytest.mark.parametrize("name", ["ci\nbot", "ci bot", "a:day", "{x}", "", "k" * 129])
def test_a_key_name_that_cannot_be_part_of_a_redis_key_is_refused(name: str) -> None:
    """A line break split the lease record's scope keys (one a line): the reaper released a
    reserve from keys that were not its own and left the key's for good."""
    assert "keys.0.name" in error_of({**UP, "keys": [{"name": name, "sha256": "0" * 64, "tenant": "t"}]})
    ok = {**UP, "keys": [{"name": "ci-bot@team.example/2+x_y", "sha256": "0" * 64, "tenant": "t"}]}
    assert parse_config(ok, {}).keys[0].name == "ci-bot@team.example/2+x_y"


@pytest.mark.parametrize(
    "field",
    [
        "max_output_tokens",
        "media_part_input_tokens",
        "tools_input_tokens",
        "prompt_overhead_tokens",
        "message_overhead_tokens",
    ],
)
@pytest.mark.parametrize("value", [True, False])
def test_a_model_token_count_is_not_true_or_false(field: str, value: bool) -> None:
    """YAML's no/off/false became 0: the 600 tokens of Anthropic's tool prompt left unreserved."""
    models = {"*": {"upstream": "openai", field: value}}
    assert f"models.*.{field}" in error_of({**UP, "models": models})


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"reap_grace_s": 1, "journal_replay_s": 1}, "reap_grace_s must be longer than journal_replay_s"),
        ({"reap_grace_s": 0.5}, "reap_grace_s must be longer than journal_replay_s"),
        (
            {"reap_grace_s": float("inf")},
            "reap_grace_s",
        ),  # reaped never: a dead process's reserves held for good
        ({"reap_grace_s": -1}, "reap_grace_s"),
        # A reaper sleeping through an outage shorter than its interval bills journaled calls
        # at their reserve on its first round after it (the lease hunt): 60 > 10 - 1.
        ({"reaper_interval_s": 60}, "reaper_interval_s must be at most reap_grace_s - journal_replay_s"),
        ({"reaper_interval_s": 9.5}, "reaper_interval_s must be at most"),
        # settle.lua's EXPIRE failed past what Redis takes, after the settle's writes.
        ({"settled_marker_ttl_s": 10**17}, "settled_marker_ttl_s"),
    ],
)
def test_a_reap_grace_a_journal_cannot_beat_is_refused(limits: dict[str, Any], message: str) -> None:
    assert message in error_of({**UP, "limits": limits})


def test_a_rare_reaper_stays_possible_with_a_grace_that_outlasts_its_interval() -> None:
    limits = {"reaper_interval_s": 60, "reap_grace_s": 61, "journal_replay_s": 1}
    assert parse_config({**UP, "limits": limits}, {}).limits.reaper_interval_s == 60
    limits = {"reaper_interval_s": 600, "reap_grace_s": 0}  # reaped at once: no journal waited for
    assert parse_config({**UP, "limits": limits}, {}).limits.reaper_interval_s == 600
    assert parse_config({**UP, "limits": {"reaper_interval_s": 9}}, {}).limits.reaper_interval_s == 9


def test_reaping_at_once_stays_possible() -> None:
    assert (
        parse_config({**UP, "limits": {"reap_grace_s": 0, "journal_replay_s": 0.1}}, {}).limits.reap_grace_s
        == 0
    )


def _stalled(timeout_s: float = 2, redis: dict[str, Any] | None = None, **limits: Any) -> dict[str, Any]:
    """The slow-Redis hunt's config (tests/test_hunt_slow_redis.py, 506b14d): an upstream timing
    out after ``timeout_s``, a lease margin of 1 s, a short grace and quick loops."""
    upstream = {"base_url": "https://api.example.com/v1", "timeout_s": timeout_s}
    hunt = {"lease_margin_s": 1, "reap_grace_s": 1, "reaper_interval_s": 0.2, "journal_replay_s": 0.1}
    return {
        "upstreams": {"openai": upstream},
        "redis": {"url": "redis://127.0.0.1:6379/0", **(redis or {})},
        "limits": {**hunt, **limits},
    }


def test_a_socket_timeout_a_lease_renewal_can_wait_past_the_lease_is_refused() -> None:
    """A stream renews its lease (timeout_s 2 + lease_margin_s 1: 3 s) every second. Redis
    stalled for 4 s (DEBUG SLEEP: a fork, a slow disk) within the default socket timeout (5 s):
    no command failed, so the proxy saw no outage (nothing journaled, no reaper's grace started
    again), and every renewal sent in the stall landed after the lease ran out, which renew.lua
    refuses. A reaper billed the live stream ``lease_expired`` at its reserve (1,000 output
    tokens) while the provider billed 30, for a call that went out and finished normally. Refused
    now, naming the settings, what they give and what would do."""
    error = error_of(_stalled())
    for said in (
        "redis.socket_timeout_s (5) must be below two thirds of the shortest lease",
        "upstreams.openai.timeout_s plus limits.lease_margin_s (3 s) gives 2 s",
        "lower redis.socket_timeout_s below 2 s",
        "or raise those to more than 7.5 s",
    ):
        assert said in error, error
    # Two thirds of the lease exactly: a renewal a third in may land as it runs out.
    assert "redis.socket_timeout_s (2)" in error_of(_stalled(redis={"socket_timeout_s": 2}, reap_grace_s=0))
    # What the message says would do: a shorter socket timeout (the grace past it and a replay),
    # or a longer lease.
    taken = parse_config(_stalled(redis={"socket_timeout_s": 1.9}, reap_grace_s=2.5), {})
    assert taken.redis.socket_timeout_s == 1.9
    assert parse_config(_stalled(lease_margin_s=5.6, reap_grace_s=6), {}).limits.lease_margin_s == 5.6


def test_the_socket_timeout_is_checked_against_the_shortest_lease() -> None:
    raw = _stalled(reap_grace_s=0)
    raw["upstreams"]["slow"] = {"base_url": "https://slow.example/v1", "timeout_s": 600}
    assert "upstreams.openai.timeout_s plus limits.lease_margin_s (3 s)" in error_of(raw)
    raw["upstreams"]["openai"]["timeout_s"] = 7  # a lease of 8 s: renewals wait 5 s at most
    assert parse_config(raw, {}).upstreams["openai"].timeout_s == 7


@pytest.mark.parametrize(
    ("redis", "limits", "taken"),
    [
        ({}, {"reap_grace_s": 6, "journal_replay_s": 1}, False),  # a replay and 5 s: 6 s
        ({}, {"reap_grace_s": 6.5, "journal_replay_s": 1}, True),
        ({"socket_timeout_s": 1}, {"reap_grace_s": 2, "journal_replay_s": 1}, False),
        ({"socket_timeout_s": 1}, {"reap_grace_s": 2.5, "journal_replay_s": 1}, True),
        ({"socket_timeout_s": 30}, {"reap_grace_s": 0}, True),  # reaped at once: nothing waited for
    ],
)
def test_a_reap_grace_a_settle_stuck_for_a_socket_timeout_outlasts_is_refused(
    redis: dict[str, Any], limits: dict[str, Any], taken: bool
) -> None:
    """A settle sent as the store went away (a host gone, a partition) fails only after the
    socket timeout, is journaled then and applied at the journal's next replay, while a reaper's
    grace may start at the store's first answer: the grace must outlast both (README), else the
    reaper bills at its reserve a call the journal holds."""
    raw = {**UP, "redis": redis, "limits": {**limits, "reaper_interval_s": 0.5}}
    if taken:
        assert parse_config(raw, {}).limits.reap_grace_s == limits["reap_grace_s"]
    else:
        error = error_of(raw)
        grace, worst = limits["reap_grace_s"], limits["journal_replay_s"] + redis.get("socket_timeout_s", 5)
        said = (
            f"limits.reap_grace_s ({grace:g}) must be longer than limits.journal_replay_s plus "
            f"redis.socket_timeout_s ({worst:g} s), or 0"
        )
        assert said in error, error


# redis-py takes a Redis URL's socket_timeout over the socket_timeout_s the proxy gives it: over
# rediss:// and on a Cluster every command, lease renewals included, waits the URL's 30 s.
TLS_URL = "rediss://cache.example:6380/0?socket_timeout=30"
CLUSTER_URL = "redis://node.example:7000/0?socket_timeout=30"


@pytest.mark.parametrize(("url", "cluster"), [(TLS_URL, False), (CLUSTER_URL, True)])
def test_a_socket_timeout_in_the_url_past_two_thirds_of_the_lease_is_refused(url: str, cluster: bool) -> None:
    """A lease of 3 s with redis.socket_timeout_s 1 passed, the URL's 30 s unread (26f30f1)."""
    error = error_of(_stalled(redis={"url": url, "cluster": cluster, "socket_timeout_s": 1}, reap_grace_s=0))
    said = "the Redis URL's socket_timeout (30) must be below two thirds of the shortest lease"
    assert said in error, error


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0?socket_timeout=1", "unix:///run/redis/redis.sock?db=0&socket_timeout=1"],
)
def test_a_shorter_socket_timeout_in_a_plain_url_leaves_the_proxys_own_in_force(url: str) -> None:
    """Over redis:// and unix:// the proxy's own pipelined client runs the scripts (reserves,
    renewals, settles, the reaper's reads) and waits redis.socket_timeout_s whatever the URL
    says; redis-py, the URL's timeout, only the other commands. The URL's 1 s was the one
    checked: a lease of 3 s passed beside renewals that wait 5 s, and a grace of 2.5 s beside
    settles journaled after 5 s."""
    error = error_of(_stalled(redis={"url": url}, reap_grace_s=0))
    assert "redis.socket_timeout_s (5) must be below two thirds of the shortest lease" in error, error
    error = error_of(_stalled(600, redis={"url": url}, reap_grace_s=2.5, journal_replay_s=1))
    assert "limits.journal_replay_s plus redis.socket_timeout_s (6 s)" in error, error
    # The longer of the two is the one in force: the URL's, past the proxy's own.
    longer = url.replace("socket_timeout=1", "socket_timeout=30")
    error = error_of(_stalled(redis={"url": longer, "socket_timeout_s": 1}, reap_grace_s=0))
    assert "the Redis URL's socket_timeout (30) must be below two thirds" in error, error
    taken = parse_config(_stalled(redis={"url": url, "socket_timeout_s": 1.5}, reap_grace_s=2.6), {})
    assert taken.redis.effective_socket_timeout_s == 1.5
    # Over TLS every command goes through redis-py: the URL's 1 s is the one in force.
    tls = parse_config(_stalled(redis={"url": TLS_URL.replace("=30", "=1")}, reap_grace_s=1.2), {})
    assert tls.redis.effective_socket_timeout_s == 1


def test_a_socket_timeout_in_the_url_from_url_env_is_refused() -> None:
    """redis.url_env's URL is put in after the Config's own checks ran (``parse_config``)."""
    raw = _stalled(redis={"socket_timeout_s": 1, "url_env": "REDIS_URL"}, reap_grace_s=0)
    del raw["redis"]["url"]
    error = error_of(raw, {"REDIS_URL": TLS_URL})
    assert error.startswith("redis.url_env (REDIS_URL): the Redis URL's socket_timeout (30)"), error
    taken = parse_config(raw, {"REDIS_URL": TLS_URL.replace("30", "1.5")})
    assert taken.redis.effective_socket_timeout_s == 1.5


def test_a_socket_timeout_in_the_redis_url_flag_is_refused() -> None:
    """serve --redis-url URL (``with_flags``) over a file that is coherent alone."""
    config = parse_config(_stalled(redis={"socket_timeout_s": 1}, reap_grace_s=0), {})
    with pytest.raises(ConfigError, match="command line: the Redis URL's socket_timeout \\(30\\)"):
        with_flags(config, redis_url=TLS_URL)


def test_a_reap_grace_a_url_socket_timeout_outlasts_is_refused() -> None:
    """A long lease, so only the grace check is in play: a settle over TLS waits the URL's 30 s
    before it is journaled, and the grace of 10 s runs out first."""
    raw = _stalled(600, redis={"url": TLS_URL, "socket_timeout_s": 1}, reap_grace_s=10, journal_replay_s=1)
    error = error_of(raw)
    assert "limits.journal_replay_s plus the Redis URL's socket_timeout (31 s)" in error, error


def test_a_reload_shortening_a_lease_past_the_running_urls_socket_timeout_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The running store waits its URL's 5 s (the URL changes only on restart): a file dropping
    it and shortening the lease to 3 s is valid alone, not with the store in force."""
    raw, path, env, _ = _started_from_file(tmp_path)
    raw["redis"] = {**raw["redis"], "url": "redis://127.0.0.1:6379/0?socket_timeout=5", "socket_timeout_s": 1}
    path.write_text(yaml.safe_dump(raw))
    started = load_config(path, env)
    raw["redis"]["url"] = "redis://127.0.0.1:6379/0"
    raw["upstreams"]["openai"]["timeout_s"] = 2
    raw["limits"] = {**raw.get("limits", {}), "lease_margin_s": 1}
    path.write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        assert not ConfigReloader(path, lambda: started, lambda _: None).reload("test")
    (refusal,) = [r for r in caplog.records if "reload refused" in r.getMessage()]
    for named in ("the Redis URL's socket_timeout (5)", "the running 5 s changes only on restart"):
        assert named in refusal.error, refusal.error  # type: ignore[attr-defined]


def test_the_event_loop_is_auto_uvloop_or_asyncio() -> None:
    assert parse_config(UP, {}).event_loop == "auto"
    assert parse_config({**UP, "event_loop": "asyncio"}, {}).event_loop == "asyncio"
    assert parse_config({**UP, "event_loop": "uvloop"}, {}).event_loop == "uvloop"
    with pytest.raises(ConfigError, match="event_loop"):
        parse_config({**UP, "event_loop": "trio"}, {})


def test_uvloop_asked_where_it_is_not_installed_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    # Refused when the config loads (exit 2, the setting named), not when a worker starts.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        "proxy.config.importlib.util.find_spec",
        lambda name, *a: None if name == "uvloop" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"event_loop: .*uvloop is not installed"):
        parse_config({**UP, "event_loop": "uvloop"}, {})
    assert parse_config(UP, {}).event_loop == "auto"  # auto: asyncio's loop then


@pytest.mark.parametrize(
    "url",
    [
        "rediss://:pw@redis.example:6380/0?ssl_cert_reqs=none",  # a self-signed server's
        "rediss://redis.example:6380/0?ssl_ca_certs=/etc/ssl/private-ca.pem",
        "redis://[::1]:6379/2?socket_timeout=5",
        "unix:///run/redis.sock?db=3",
        "rediss://redis.example:6380/0?ssl_cert_reqs=optional&ssl_check_hostname=no&ssl_min_version=771",
        "rediss://redis.example:6380/0?ssl_ciphers=HIGH:!aNULL&ssl_password=pw&ssl_ca_path=/etc/ssl/certs",
        "redis://127.0.0.1:6379/0?socket_keepalive=Yes&retry_on_timeout=off",
    ],
)
def test_a_redis_url_with_options_redis_py_reads_is_accepted(url: str) -> None:
    # A TLS Redis is reached through redis-py, which reads its ssl_* options from the URL: the
    # URL check must not refuse them (no redis.* field sets them).
    raw = {"redis": {"url": url}, "upstreams": {"openai": {"base_url": "http://127.0.0.1:1/v1"}}}
    assert parse_config(raw, {}).redis.url == url


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "ssl_cert_reqs"),  # TLS on a plain URL
        ("unix:///run/redis.sock?ssl_check_hostname=false", "ssl_check_hostname"),
        ("rediss://redis.example:6380/0?ssl_bogus=1", "ssl_bogus"),
        # redis-py's synchronous client reads it; the proxy's (asyncio) TLS connection does not.
        ("rediss://redis.example:6380/0?ssl_validate_ocsp=true", "ssl_validate_ocsp"),
        ("rediss://redis.example:6380/0?ssl_cert_reqs=bogus", "ssl_cert_reqs"),
        ("rediss://redis.example:6380/0?ssl_cert_reqs=None", "ssl_cert_reqs"),
        ("rediss://redis.example:6380/0?ssl_check_hostname=maybe", "ssl_check_hostname"),
        ("rediss://redis.example:6380/0?ssl_min_version=5", "ssl_min_version"),
        ("rediss://redis.example:6380/0?ssl_ciphers=NO-SUCH-CIPHER", "ssl_ciphers"),
        ("redis://127.0.0.1:6379/0?socket_keepalive=maybe", "socket_keepalive"),
        ("unix:///run/redis.sock?retry_on_timeout=sometimes", "retry_on_timeout"),
        # Numbers no pool can use: none to take, a wait of -1 s, a health check before every
        # command (the config fixer's leads).
        ("redis://127.0.0.1:6379/0?max_connections=0", "max_connections"),
        ("redis://127.0.0.1:6379/0?timeout=-1", "timeout"),
        ("redis://127.0.0.1:6379/0?health_check_interval=-5", "health_check_interval"),
        ("redis://127.0.0.1:6379/0?health_check_interval=nan", "health_check_interval"),
    ],
)
def test_a_redis_url_option_redis_py_would_refuse_or_misread_is_a_config_error(url: str, name: str) -> None:
    """README: TLS's ssl_* for rediss://; 'an unknown option, a bad value ... is a config error
    (exit 2)'. Any name starting with ssl_ passed, on any scheme, its value unread: check-config
    said ok, then redis-py refused every connection ('unexpected keyword argument
    'ssl_cert_reqs''), every call and /readyz a 503 store_unavailable against a Redis that was
    up. A boolean redis-py does not know as one (maybe) it reads as true."""
    error = error_of({**UP, "redis": {"url": url}})
    assert "redis.url" in error and name in error, error


@pytest.mark.parametrize("url", ["redis://:s3cretpw@redis:63x79/0", "redis://admin:s3cretpw@redis:99999/0"])
def test_a_redis_url_refused_for_its_port_does_not_print_its_password(url: str) -> None:
    """The message (stderr at start, the log of a refused reload) quoted the URL's whole netloc,
    password included: REDIS_URL from a secret store ended up in the logs."""
    raw = {"upstreams": {"openai": {"base_url": "http://x"}}, "redis": {"url_env": "REDIS_URL"}}
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, {"REDIS_URL": url})
    assert "not a port" in str(caught.value) and "s3cretpw" not in str(caught.value)


def test_an_infinite_duration_is_refused_by_the_config_not_by_every_call() -> None:
    """YAML's ``.inf`` passed every ``gt=0`` bound: check-config said ok, a reload took it, and
    then every call to that upstream was a 500 (its lease, in whole milliseconds, cannot be
    infinite)."""
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:6399/0")
    raw["upstreams"]["openai"]["timeout_s"] = float("inf")
    with pytest.raises(ConfigError, match=r"timeout_s.*finite"):
        parse_config(raw, {"TEST_UPSTREAM_KEY": "k"})


def test_the_configuration_reference_names_every_limit() -> None:
    """README's Configuration reference says it lists every field: an operator hitting a 431
    must find the setting that decides it."""
    from pathlib import Path

    from proxy.config import LimitsConfig

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    reference = readme[readme.index("## Configuration reference") : readme.index("## Metrics")]
    missing = [name for name in LimitsConfig.model_fields if name not in reference]
    assert missing == [], missing


@pytest.mark.parametrize("tenant", ["passthrough", "pt-0123456789ab", "pt-" + "a" * 32])
def test_a_tenant_named_like_pass_through_callers_is_a_config_error(tenant: str) -> None:
    # Its metrics would merge into the pass-through callers' label (or fall into it on a reload).
    keys = [{"name": "k", "sha256": "a" * 64, "tenant": tenant}]
    assert "keys.0.tenant" in error_of({**UP, "keys": keys})
    assert "reserved" in error_of({**UP, "keys": keys})
    assert parse_config({**UP, "keys": [{**keys[0], "tenant": "pt-team"}]}, {}).tenants == {"pt-team"}


@pytest.mark.parametrize(
    ("main_host", "metrics_host"),
    [
        ("127.0.0.1", "LOCALHOST"),  # localhost: host names are read in any case
        ("127.0.0.1", "Localhost"),
        ("::1", "localHost"),
        ("127.0.0.1", "0"),  # the IPv4 wildcard, as the resolver reads it
        ("127.0.0.1", "127.1"),  # 127.0.0.1, as the resolver reads it
        ("0x7f.0.0.1", "localhost"),
        ("0:0::0", "::1"),  # the IPv6 wildcard
        ("::0001", "::1"),
        ("Proxy.Example", "proxy.example"),
    ],
)
def test_metrics_on_the_main_port_under_another_spelling_of_its_host_is_a_config_error(
    main_host: str, metrics_host: str
) -> None:
    """README: a metrics.listen on the main port, 'localhost beside 127.0.0.1 or a wildcard
    included', is a config error. The hosts were compared as written: serve bound the metrics,
    then failed its own port (exit 4, address in use) instead of exit 2 naming metrics.listen."""
    listen = {"listen": {"host": main_host, "port": 8080}}
    raw = {**UP, **listen, "metrics": {"listen": {"host": metrics_host, "port": 8080}}}
    assert "metrics.listen: port 8080 is the main listen port" in error_of(raw)


@pytest.mark.parametrize(
    ("main_host", "metrics_host"),
    [("127.0.0.1", "127.0.0.2"), ("127.0.0.1", "::1"), ("127.1", "10.0.0.1"), ("a.example", "b.example")],
)
def test_metrics_on_the_main_port_of_another_address_is_taken(main_host: str, metrics_host: str) -> None:
    listen = {"listen": {"host": main_host, "port": 8080}}
    raw = {**UP, **listen, "metrics": {"listen": {"host": metrics_host, "port": 8080}}}
    assert parse_config(raw, {}).metrics.listen is not None


def test_a_model_named_like_the_unknown_models_label_is_a_config_error() -> None:
    # Its metrics would merge with every model the config does not name.
    error = error_of({**UP, "models": {"other": {"upstream": "openai"}}})
    assert "models.other" in error and "reserved" in error
    assert parse_config({**UP, "models": {"other-*": {"upstream": "openai"}}}, {}).route("other-1")


def test_a_models_chat_template_overhead_is_read_and_defaults_to_none() -> None:
    """What a served model's chat template adds beyond OpenAI's chat format (Llama 3.1 on vLLM:
    a system block of about 25 tokens, about 5 a message): reserved, it kept calls from passing
    a ceiling by that much each."""
    models = {
        "llama-3.1-*": {"upstream": "openai", "prompt_overhead_tokens": 25, "message_overhead_tokens": 5},
        "*": {"upstream": "openai"},
    }
    config = parse_config({**UP, "models": models}, {})
    llama = config.models["llama-3.1-*"]
    assert (llama.prompt_overhead_tokens, llama.message_overhead_tokens) == (25, 5)
    other = config.models["*"]
    assert (other.prompt_overhead_tokens, other.message_overhead_tokens) == (0, 0)


@pytest.mark.parametrize("field", ["prompt_overhead_tokens", "message_overhead_tokens"])
def test_a_negative_chat_template_overhead_is_refused(field: str) -> None:
    """A negative figure would lower the reserve below the input counted, under the worst case."""
    error = error_of({**UP, "models": {"*": {"upstream": "openai", field: -5}}})
    assert f"models.*.{field}" in error and "greater than or equal to 0" in error, error


@pytest.mark.parametrize(
    "query",
    [
        "socket_timeout=-1",
        "socket_timeout=0",
        "socket_timeout=nan",
        "socket_connect_timeout=0",
        "db=-1",
        "db=9223372036854775808",
        "protocol=7",
        "socket_read_size=0",
    ],
)
def test_a_redis_url_option_no_connection_can_use_is_a_config_error(query: str) -> None:
    """README: 'an unknown option, a bad value or a database that is not a number is a config
    error (exit 2)'. These parse as numbers, so check-config said ok; redis-py takes the URL's
    options over the proxy's own, and then every command it sends failed: the billing views a
    503, the reaper 'could not reach the store' for ever (a dead instance's leases never billed),
    ``ledger`` and ``report`` a store error (exit 3)."""
    name = query.partition("=")[0]
    for url in (f"redis://127.0.0.1:6379/0?{query}", f"unix:///run/redis.sock?{query}"):
        assert name in error_of({**UP, "redis": {"url": url}})
    assert name in error_of({**UP, "redis": {"url_env": "REDIS_URL"}}, {"REDIS_URL": f"redis://h/0?{query}"})


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:7000/0?timeout=3",
        "redis://127.0.0.1:7000/0?retry_on_timeout=yes",
        "rediss://redis.example:7000/0?ssl_password=pw",
        "rediss://redis.example:7000/0?ssl_ca_path=/etc/ssl/certs",
    ],
)
def test_a_redis_url_option_the_cluster_client_does_not_take_is_a_config_error(url: str) -> None:
    """redis-py's cluster client takes its options by name, and not these (its single-server
    client does): serve, ledger and report raised out with a traceback (unexpected keyword
    argument 'timeout'), exit 1, after check-config said ok."""
    name = url.rpartition("?")[2].partition("=")[0]
    error = error_of({**UP, "redis": {"url": url, "cluster": True}})
    assert "redis" in error and "cluster" in error and name in error, error
    assert parse_config({**UP, "redis": {"url": url}}, {}).redis.url == url


@pytest.mark.parametrize(
    ("db", "said"),
    [("2147483647", "db must be"), ("9223372036854775808", "db must be"), ("\u00b2", "not a number")],
)
def test_a_redis_database_no_redis_has_is_a_config_error(db: str, said: str) -> None:
    """Past 2^31 - 2, Redis refuses SELECT (its databases are counted in a C int): every
    connection failed, the calls 503 store_unavailable, after check-config said ok. A
    superscript two is a digit to str.isdigit but no number to int: redis-py left it out (the
    database 0 used) and the proxy's own client raised out of serve (a traceback, exit 1)."""
    error = error_of({**UP, "redis": {"url": f"redis://127.0.0.1:6379/{db}"}})
    assert "redis.url" in error and said in error, error


@pytest.mark.parametrize(
    "raw",
    [
        {**UP, "limits": {"default_max_output_tokens": True}},
        {**UP, "tiers": {"standard": {"on_budget_short": "clamp", "min_output_tokens": True}}},
    ],
    ids=["limits.default_max_output_tokens", "tiers.min_output_tokens"],
)
def test_an_output_token_count_is_not_true_or_false(raw: dict[str, Any]) -> None:
    """As a model's token counts and the ceilings (README: true/false are not counts): YAML's
    yes/on/true read as 1, and ``default_max_output_tokens: yes`` capped every call that sets no
    cap of its own at one output token upstream, check-config saying ok."""
    assert "not true or false" in error_of(raw)


START_ONLY_LIMITS = {
    "settled_marker_ttl_s": 7200,
    # The store trims every settle's ledger by the one it started with (a reaper's, a replay's).
    "ledger_retention_s": 86400,
    "token_count_cache_chars": 1234,
    "reaper_interval_s": 1.5,
    "journal_replay_s": 0.5,
    "reap_grace_s": 6.0,  # past the replay and the socket timeout (5 s) it starts with
}


def test_a_reload_keeps_and_names_every_start_only_limit_and_then_sees_the_file_unchanged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reap grace taken from a reload, its journal replay interval kept from the start, can
    fall below it: leases reaped at their reserve before the journal bills their real figures.
    Once reloaded, the file is the one in force (else the watcher reloads it at every look)."""
    raw, path, env, started = _started_from_file(tmp_path)
    applied: list[Config] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        reloader = ConfigReloader(path, lambda: started, applied.append)
        raw["limits"] = {**raw["limits"], **START_ONLY_LIMITS}
        path.write_text(yaml.safe_dump(raw))
        assert reloader.changed()
        assert reloader.reload("test")
        assert not reloader.changed()
    (new,) = applied
    assert {name: getattr(new.limits, name) for name in START_ONLY_LIMITS} == {
        name: getattr(started.limits, name) for name in START_ONLY_LIMITS
    }
    (warning,) = [r for r in caplog.records if "only on restart" in r.getMessage()]
    assert warning.settings == sorted(f"limits.{name}" for name in START_ONLY_LIMITS)  # type: ignore[attr-defined]


def test_a_reload_puts_in_force_every_setting_read_at_each_call(tmp_path: Path) -> None:
    """Keys (a tier changed, a tenant added), admin keys, prices, ceilings and the policy: each
    is as the new file says, the keys' tenants and windows too, not the config's at start."""
    raw = base_config("http://127.0.0.1:9/v1", "redis://127.0.0.1:6379/0")
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {"TEST_UPSTREAM_KEY": "x", "ADMIN_KEY": "sk-admin"}
    started = load_config(path, env)
    raw["keys"][0]["tier"] = "gold"
    raw["keys"].append({"name": "c", "sha256": hashlib.sha256(b"sk-c").hexdigest(), "tenant": "team-c"})
    raw["admin_keys"] = [{"name": "ops", "key_env": "ADMIN_KEY"}]
    raw["models"]["gpt-4o-mini"]["price_per_million"] = {"input": "1", "output": "2"}
    raw["tiers"] = {
        "standard": {"run": {"requests": 7}},
        "gold": {"tenant": [{"period": "hour", "requests": 9}]},
    }
    raw["policy"] = {"on_truncate": "reject"}
    raw["limits"] = {**raw["limits"], "default_max_output_tokens": 77}
    path.write_text(yaml.safe_dump(raw))
    applied: list[Config] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("proxy.reload.os.environ", env)
        assert ConfigReloader(path, lambda: started, applied.append).reload("test")
    (new,) = applied
    want = load_config(path, env)
    start_only = {
        "listen",
        "redis",
        "log",
        "metrics",
        "journal_dir",
        "shutdown_grace_s",
        "event_loop",
        "currency",
    }
    for name in Config.model_fields.keys() - start_only - {"limits"}:
        assert getattr(new, name) == getattr(want, name), name
    assert new.limits.default_max_output_tokens == 77
    assert new.tenants == {"team-a", "team-b", "team-c"}
    assert new.tenant_periods("team-a") == want.tenant_periods("team-a") != started.tenant_periods("team-a")


def test_an_upstream_may_be_sent_no_stream_options() -> None:
    """A server that refuses stream_options (Mistral's API: 422 extra_forbidden) is not asked
    its streams' usage with them when ``stream_usage_option`` is off; anything but a yes or no
    is a config error naming it."""
    upstreams = {"mistral": {"base_url": "https://api.mistral.ai/v1", "stream_usage_option": False}}
    config = parse_config({"upstreams": {**UP["upstreams"], **upstreams}}, {})
    assert config.upstreams["mistral"].stream_usage_option is False
    assert config.upstreams["openai"].stream_usage_option is True
    unsure = {"base_url": "https://api.mistral.ai/v1", "stream_usage_option": "sometimes"}
    error = error_of({"upstreams": {"openai": unsure}})
    assert "upstreams.openai.stream_usage_option" in error, error


def test_a_key_naming_a_tier_the_file_does_not_define_is_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tiers`` defaults to ``{standard: {}}`` and a key's ``tier`` to ``standard``: a file that
    defines tiers of its own and a key without ``tier`` passed check-config, and its key was
    then refused on every call (403 unknown_tier) (the docs hunt)."""
    from proxy.cli import main

    key = {"name": "k", "sha256": "0" * 64, "tenant": "t"}
    said = "keys.k.tier: no tier 'standard' in tiers (gold): name one of them, or define it"
    assert said in error_of({**UP, "tiers": {"gold": {}}, "keys": [key]})
    assert "keys.k.tier: no tier 'silver'" in error_of({**UP, "keys": [{**key, "tier": "silver"}]})
    parse_config({**UP, "tiers": {"gold": {}}, "keys": [{**key, "tier": "gold"}]}, {})
    parse_config({**UP, "keys": [key]}, {})  # the default tier
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**UP, "tiers": {"gold": {}}, "keys": [key]}))
    assert main(["check-config", str(path)]) == 2
    assert said in capsys.readouterr().err


def test_a_key_name_written_twice_among_thousands_is_named_in_the_refusal() -> None:
    """Among 5,000 keys, two named alike were refused with ``keys: names must be unique`` and no
    name: the operator was left to search the file for which, while two keys of one secret, or
    a key of an unknown tier, are named (the config-scale hunt). Its secret is not said."""
    raw = big_config("http://127.0.0.1:1/v1", "redis://127.0.0.1:1/0", keys=5000)
    raw["keys"][4321]["name"] = "key-17"  # the same name as keys[17], another tenant's
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    message = str(caught.value)
    assert "names must be unique" in message
    assert "key-17" in message and "tenant-17" in message and "tenant-321" in message, message
    assert raw["keys"][4321]["sha256"] not in message and raw["keys"][17]["sha256"] not in message
    assert "key-4321" not in message and "key-170" not in message, message  # only the one repeated


def test_a_key_name_reused_across_many_tenants_names_a_few_of_them() -> None:
    """One name written in a thousand tenants' keys was refused with all thousand tenants in one
    line (the third review): the first five are named, and how many more."""
    raw = big_config("http://127.0.0.1:1/v1", "redis://127.0.0.1:1/0", keys=1000, tenants=1000)
    for key in raw["keys"]:
        key["name"] = "ci"
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, {"TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    message = str(caught.value)
    assert "ci names 1000 keys" in message and "and 995 more" in message, message
    assert len(message) < 400, message
