"""The configuration's figures as the README's Configuration reference states them: every default,
every bound an operator may write up to (and the first value past it, refused), the prices each
token type falls back to, and the secrets and overrides ``config_load`` resolves."""

from __future__ import annotations

import hashlib
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy.config import Config
from proxy.config_load import parse_config, passthrough_config, with_flags
from proxy.config_models import ModelConfig
from proxy.errors import ConfigError
from proxy.plan import tools_input_tokens

UP = {"upstreams": {"openai": {"base_url": "https://api.example.com/v1"}}}
DIGEST = "ab" * 32


def error_of(raw: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, env or {})
    return str(caught.value)


def taken(raw: dict[str, Any], env: dict[str, str] | None = None) -> Config:
    return parse_config(raw, env or {})


def with_limits(**limits: Any) -> dict[str, Any]:
    return {**UP, "limits": limits}


def with_run_ceilings(**ceilings: Any) -> dict[str, Any]:
    return {**UP, "tiers": {"standard": {"run": ceilings}}}


def priced(**prices: Any) -> dict[str, Any]:
    return {**UP, "models": {"*": {"upstream": "openai", "price_per_million": prices}}}


def one_key(**fields: Any) -> dict[str, Any]:
    return {**UP, "keys": [{"name": "k", "sha256": DIGEST, "tenant": "t", **fields}]}


# --- defaults: the Configuration reference's "default" column ---------------------------------


def test_every_top_level_default_is_the_readmes() -> None:
    config = taken(UP)
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8080)
    assert config.redis.url is None and config.redis.url_env is None and config.redis.cluster is False
    assert config.redis.data_dir == Path(".llm-billing-proxy/redis")
    assert (config.redis.pool_size, config.redis.socket_timeout_s) == (64, 5)
    assert (config.log.level, config.log.format) == ("info", "json")
    assert (config.policy.on_truncate, config.policy.on_invalid_json) == ("pass", "pass")
    assert config.policy.on_client_disconnect == "drain"
    assert config.currency == "USD"
    assert config.journal_dir == Path(".llm-billing-proxy/journal")
    assert config.shutdown_grace_s == 30
    assert config.event_loop == "auto"
    assert config.metrics.listen is None
    assert config.keys == () and config.admin_keys == ()


def test_every_limit_defaults_to_the_readmes_figure() -> None:
    limits = taken(UP).limits
    assert limits.max_body_bytes == 4 * 1024 * 1024
    assert limits.body_timeout_s == 60
    assert limits.max_header_bytes == 16 * 1024
    assert limits.max_upstream_body_bytes == 64 * 1024 * 1024
    assert limits.default_max_output_tokens == 4096
    assert limits.default_max_tool_calls == 10
    assert limits.settled_marker_ttl_s == 3600
    assert limits.token_count_cache_chars == 8388608
    assert limits.prior_context_ttl_s == 3600
    assert limits.quick_estimates is True
    assert limits.run_ttl_s == 604800
    assert (limits.lease_margin_s, limits.reaper_interval_s) == (30, 5)
    assert (limits.journal_replay_s, limits.reap_grace_s) == (1, 10)


def test_an_upstreams_defaults_are_the_readmes() -> None:
    upstream = taken(UP).upstreams["openai"]
    assert upstream.kind == "openai"
    assert upstream.anthropic_version == "2023-06-01"
    assert upstream.api_key_env is None and upstream.api_key is None
    assert (upstream.timeout_s, upstream.connect_timeout_s) == (600, 10)
    assert upstream.chat_output_cap_field == "max_completion_tokens"
    assert upstream.stream_usage_option is True
    assert upstream.passthrough_auth is False


def test_a_models_defaults_are_the_readmes() -> None:
    model = taken({**UP, "models": {"*": {"upstream": "openai"}}}).models["*"]
    assert model.encoding is None and model.max_output_tokens is None
    assert (model.prompt_overhead_tokens, model.message_overhead_tokens) == (0, 0)
    assert model.media_part_input_tokens == 0
    assert model.hidden_reasoning is False
    assert model.price_per_million is None
    assert model.service_tiers == {} and model.price_per_thousand_calls == {}


@pytest.mark.parametrize(("kind", "tokens"), [("anthropic", 600), ("openai", 0)])
def test_tools_input_tokens_default_to_600_on_an_anthropic_upstream_else_0(kind: str, tokens: int) -> None:
    config = taken({"upstreams": {"u": {"base_url": "https://u.example/v1", "kind": kind}}, "models": {}})
    assert tools_input_tokens(ModelConfig(upstream="u"), config.upstreams["u"]) == tokens
    # A count given is taken as it is, 0 included.
    assert tools_input_tokens(ModelConfig(upstream="u", tools_input_tokens=0), config.upstreams["u"]) == 0


def test_a_tiers_defaults_are_unlimited_refuse_one_token_and_the_global_policy() -> None:
    config = taken({**UP, "policy": {"on_truncate": "reject"}, "tiers": {"gold": {}}})
    gold = config.tiers["gold"]
    assert gold.run.meters == {} and gold.key.meters == {}
    assert gold.windows == () and gold.tenant == ()
    assert gold.on_budget_short == "refuse"
    assert gold.min_output_tokens == 1
    assert config.policy_for("gold") == config.policy


def test_a_key_without_a_tier_belongs_to_the_tier_a_config_without_tiers_has() -> None:
    # Else every call of such a key would be refused with 403 (its tier unknown).
    config = taken(one_key())
    assert config.keys[0].tier in config.tiers


# --- ceilings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("meter", ["requests", "input_tokens", "output_tokens", "total_tokens", "concurrent"])
def test_a_count_ceiling_is_taken_from_0_to_10_15_minus_1_and_refused_past(meter: str) -> None:
    assert taken(with_run_ceilings(**{meter: 0})).tiers["standard"].run.meters == {meter: 0}
    top = taken(with_run_ceilings(**{meter: 10**15 - 1})).tiers["standard"].run.meters
    assert top == {meter: 10**15 - 1}
    assert f"tiers.standard.run.{meter}" in error_of(with_run_ceilings(**{meter: 10**15}))
    assert f"tiers.standard.run.{meter}" in error_of(with_run_ceilings(**{meter: -1}))
    assert f"tiers.standard.run.{meter}" in error_of(with_run_ceilings(**{meter: True}))


@pytest.mark.parametrize(
    ("cost", "micros"), [("0", 0), ("0.000001", 1), ("12.5", 12_500_000), ("999999999.999999", 10**15 - 1)]
)
def test_a_cost_ceiling_is_read_as_exact_micro_units(cost: str, micros: int) -> None:
    config = taken(with_run_ceilings(cost_usd=cost))
    assert config.tiers["standard"].run.meters == {"cost_micros": micros}


@pytest.mark.parametrize("cost", ["-0.000001", "1000000000", "0.0000001", "1.0000005"])
def test_a_cost_ceiling_past_the_store_or_six_places_is_refused(cost: str) -> None:
    assert "tiers.standard.run.cost_usd" in error_of(with_run_ceilings(cost_usd=cost))


def test_a_window_may_not_limit_concurrency_but_a_key_may() -> None:
    windows = [{"period": "day", "concurrent": 2}]
    assert "concurrent is not a windowed meter" in error_of({**UP, "tiers": {"s": {"windows": windows}}})
    assert "concurrent is not a windowed meter" in error_of({**UP, "tiers": {"s": {"tenant": windows}}})
    assert taken({**UP, "tiers": {"s": {"key": {"concurrent": 2}}}}).tiers["s"].key.meters == {
        "concurrent": 2
    }


def test_a_tenant_window_is_one_per_period_too() -> None:
    tenant = [{"period": "hour", "requests": 1}, {"period": "hour", "total_tokens": 5}]
    assert "tiers.s: tenant: one entry per period" in error_of({**UP, "tiers": {"s": {"tenant": tenant}}})


def test_min_output_tokens_is_a_positive_count() -> None:
    # 0 would let a clamp forward a call with no room for a single output token.
    assert "min_output_tokens" in error_of({**UP, "tiers": {"s": {"min_output_tokens": 0}}})
    assert "min_output_tokens" in error_of({**UP, "tiers": {"s": {"min_output_tokens": True}}})
    assert taken({**UP, "tiers": {"s": {"min_output_tokens": 1}}}).tiers["s"].min_output_tokens == 1


def test_only_a_tenant_window_with_a_ceiling_holds_its_keys_reserves() -> None:
    tiers = {"standard": {"tenant": [{"period": "day"}, {"period": "month", "cost_usd": 5}]}}
    config = taken({**one_key(), "tiers": tiers})
    assert config.tenant_periods("t") == (frozenset({"day", "month"}), frozenset({"month"}))


# --- prices ---------------------------------------------------------------------------------------


def test_each_price_falls_back_to_the_one_the_readme_names() -> None:
    config = taken(priced(input="1", output="2", cache_creation_input="3"))
    assert config.models["*"].price_per_million.rates == {  # type: ignore[union-attr]
        "input": 1_000_000,
        "cached_input": 1_000_000,  # = input
        "cache_creation_input": 3_000_000,
        "cache_creation_input_1h": 3_000_000,  # = cache_creation_input, not input
        "audio_input": 1_000_000,  # = input
        "output": 2_000_000,
        "reasoning": 2_000_000,  # = output
        "audio_output": 2_000_000,  # = output
        "image_input": 1_000_000,  # = input
        "image_output": 2_000_000,  # = output
    }


def test_every_price_given_is_read_as_exact_micro_units() -> None:
    prices = {
        "input": "0.000001",
        "output": "999999999.999999",
        "cached_input": "0.5",
        "reasoning": "7",
        "cache_creation_input": "1.25",
        "cache_creation_input_1h": "2.5",
        "audio_input": "40",
        "audio_output": "80.000001",
        "image_input": "10",
        "image_output": "40.5",
    }
    rates = taken(priced(**prices)).models["*"].price_per_million.rates  # type: ignore[union-attr]
    assert rates == {name: int(Decimal(price) * 1_000_000) for name, price in prices.items()}


@pytest.mark.parametrize(
    "field",
    [
        "input",
        "output",
        "cached_input",
        "reasoning",
        "cache_creation_input",
        "cache_creation_input_1h",
        "audio_input",
        "audio_output",
        "image_input",
        "image_output",
    ],
)
@pytest.mark.parametrize("price", ["-0.000001", "1000000000", "0.0000001"])
def test_a_price_past_the_store_six_places_or_below_0_is_refused(field: str, price: str) -> None:
    prices = {"input": "1", "output": "1", field: price}
    assert f"models.*.price_per_million.{field}" in error_of(priced(**prices)) or "6 decimal places" in (
        error_of(priced(**prices))
    )


def test_a_price_of_0_is_taken() -> None:
    rates = taken(priced(input=0, output=0)).models["*"].price_per_million.rates  # type: ignore[union-attr]
    assert set(rates.values()) == {0}


def test_a_service_tiers_prices_are_checked_as_the_defaults_are() -> None:
    raw = priced(input=1, output=1)
    raw["models"]["*"]["service_tiers"] = {"flex": {"input": "0.0000001", "output": 1}}
    assert "6 decimal places" in error_of(raw)
    raw["models"]["*"]["service_tiers"] = {"default": {"input": 1, "output": 1}}
    assert "service_tiers.default" in error_of(raw)
    raw["models"]["*"]["service_tiers"] = {"auto": {"input": 1, "output": 1}}
    assert "service_tiers.auto" in error_of(raw)


@pytest.mark.parametrize("price", ["-1", "1000000000", "0.0000001", True])
def test_a_tool_price_past_the_bounds_or_six_places_is_refused(price: Any) -> None:
    raw = priced(input=1, output=1)
    raw["models"]["*"]["price_per_thousand_calls"] = {"web_search": price}
    assert "price_per_thousand_calls" in error_of(raw)


@pytest.mark.parametrize(
    "tool", ["web_search_requests", "web_search_call", "web_search_20250305", "web_search_2025_03_05", ""]
)
def test_a_tool_name_no_answer_counts_is_refused(tool: str) -> None:
    raw = priced(input=1, output=1)
    raw["models"]["*"]["price_per_thousand_calls"] = {tool: 10}
    assert "price_per_thousand_calls" in error_of(raw)


def test_a_tool_priced_by_its_bare_name_is_read_per_thousand_calls() -> None:
    raw = priced(input=1, output=1)
    raw["models"]["*"]["price_per_thousand_calls"] = {"web_search": 10, "file_search": "2.5", "web_fetch": 0}
    rates = taken(raw).models["*"].tool_rates
    assert rates == {"web_search": 10_000_000, "file_search": 2_500_000, "web_fetch": 0}


def test_tool_prices_need_a_price_per_million() -> None:
    raw = {**UP, "models": {"*": {"upstream": "openai", "price_per_thousand_calls": {"web_search": 10}}}}
    assert "price_per_million is needed" in error_of(raw)


# --- models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_output_tokens", 0),
        ("media_part_input_tokens", -1),
        ("tools_input_tokens", -1),
        ("prompt_overhead_tokens", -1),
        ("message_overhead_tokens", -1),
        ("tools_input_tokens", False),
        ("media_part_input_tokens", True),
    ],
)
def test_a_models_token_count_below_its_bound_is_refused(field: str, value: Any) -> None:
    assert f"models.*.{field}" in error_of({**UP, "models": {"*": {"upstream": "openai", field: value}}})


def test_a_models_output_cap_is_at_most_a_count_an_answer_may_tell() -> None:
    """At 10^15 check-config passed it, and every call without a cap of its own was then
    refused (400) for a reserve past what the store holds."""
    most = taken({**UP, "models": {"*": {"upstream": "openai", "max_output_tokens": 10**12}}})
    assert most.models["*"].max_output_tokens == 10**12
    past = {**UP, "models": {"*": {"upstream": "openai", "max_output_tokens": 10**12 + 1}}}
    assert "models.*.max_output_tokens" in error_of(past)


def test_a_model_with_bytes_for_an_encoding_is_taken() -> None:
    raw = {**UP, "models": {"*": {"upstream": "openai", "encoding": "bytes"}}}
    assert taken(raw).models["*"].encoding == "bytes"


def test_an_exact_model_name_wins_over_a_glob_written_before_it() -> None:
    raw = {
        **UP,
        "models": {"gpt-*": {"upstream": "openai"}, "gpt-4o": {"upstream": "openai", "encoding": "bytes"}},
    }
    assert taken(raw).route("gpt-4o")[0] == "gpt-4o"  # type: ignore[index]
    assert taken(raw).route("gpt-4o-mini")[0] == "gpt-*"  # type: ignore[index]


# --- keys -----------------------------------------------------------------------------------------


def test_a_key_name_of_128_characters_is_taken_and_of_129_refused() -> None:
    assert taken(one_key(name="k" * 128)).keys[0].name == "k" * 128
    assert "keys.0.name" in error_of(one_key(name="k" * 129))
    assert taken(one_key(name="a.b_c@d/e+f-g")).keys[0].name == "a.b_c@d/e+f-g"


@pytest.mark.parametrize(
    "tenant", ["t" * 65, "team:a", "team a", "", "pt-" + "a" * 12, "pt-" + "a" * 32, "passthrough"]
)
def test_a_tenant_name_past_64_characters_or_the_readmes_letters_is_refused(tenant: str) -> None:
    assert "keys.0.tenant" in error_of(one_key(tenant=tenant))


@pytest.mark.parametrize("tenant", ["t" * 64, "a.b_c-d", "pt-" + "a" * 13, "pt-" + "a" * 31, "Passthrough"])
def test_a_tenant_name_within_the_readmes_rules_is_taken(tenant: str) -> None:
    assert taken(one_key(tenant=tenant)).tenants == {tenant}


@pytest.mark.parametrize("section", ["keys", "admin_keys"])
@pytest.mark.parametrize("sha256", ["ab" * 31 + "a", "ab" * 32 + "a", "g" * 64])
def test_a_digest_that_is_not_64_hex_digits_is_refused(section: str, sha256: str) -> None:
    entry = {"name": "k", "sha256": sha256, **({"tenant": "t"} if section == "keys" else {})}
    assert f"{section}.0.sha256" in error_of({**UP, section: [entry]})


@pytest.mark.parametrize("section", ["keys", "admin_keys"])
def test_a_digest_in_capitals_matches_the_key_it_digests(section: str) -> None:
    digest = hashlib.sha256(b"sk-caps").hexdigest()
    entry = {"name": "k", "sha256": digest.upper(), **({"tenant": "t"} if section == "keys" else {})}
    config = taken({**UP, section: [entry]})
    if section == "keys":
        found = config.key_for_digest(digest)
        assert found is not None and found.name == "k"
    else:
        assert config.admin_digests == (digest,)


@pytest.mark.parametrize("section", ["keys", "admin_keys"])
def test_a_key_with_both_a_digest_and_an_environment_variable_is_refused(section: str) -> None:
    entry = {"name": "k", "sha256": DIGEST, "key_env": "K", **({"tenant": "t"} if section == "keys" else {})}
    assert "give exactly one of sha256 or key_env" in error_of({**UP, section: [entry]}, {"K": "sk-k"})


def test_two_keys_of_one_name_are_refused() -> None:
    keys = [{"name": "k", "sha256": DIGEST, "tenant": "t"}, {"name": "k", "sha256": "cd" * 32, "tenant": "t"}]
    assert "keys: names must be unique" in error_of({**UP, "keys": keys})


def test_an_admin_key_from_the_environment_is_its_secrets_digest() -> None:
    config = taken({**UP, "admin_keys": [{"name": "ops", "key_env": "OPS_KEY"}]}, {"OPS_KEY": " sk-ops\n"})
    assert config.admin_digests == (hashlib.sha256(b"sk-ops").hexdigest(),)


@pytest.mark.parametrize("value", ["  sk-pad  ", "\tsk-pad\n", "sk-pad\r\n"])
def test_a_key_from_the_environment_loses_the_blanks_around_it(value: str) -> None:
    # The presented key arrives without them: kept, the key could never match.
    config = taken({**UP, "keys": [{"name": "k", "key_env": "K", "tenant": "t"}]}, {"K": value})
    assert config.key_for_digest(hashlib.sha256(b"sk-pad").hexdigest()) is not None


@pytest.mark.parametrize("value", ["", "  \n"])
def test_a_key_variable_set_to_nothing_is_refused_as_not_set(value: str) -> None:
    # Else the digest of the empty key would be a key of the config.
    raw = {**UP, "keys": [{"name": "k", "key_env": "K", "tenant": "t"}]}
    assert "keys.k.key_env: environment variable K is not set" in error_of(raw, {"K": value})


@pytest.mark.parametrize("char", ["\x7f", "\x00", "\x1f"])
def test_a_key_holding_a_control_character_inside_is_refused(char: str) -> None:
    raw = {**UP, "keys": [{"name": "k", "key_env": "K", "tenant": "t"}]}
    assert "control character" in error_of(raw, {"K": f"sk-{char}x"})


# --- limits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "ok"), [(1024, True), (61440, True), (1023, False), (61441, False)])
def test_max_header_bytes_is_taken_from_1_kib_to_60_kib(value: int, ok: bool) -> None:
    if ok:
        assert taken(with_limits(max_header_bytes=value)).limits.max_header_bytes == value
    else:
        assert "limits.max_header_bytes" in error_of(with_limits(max_header_bytes=value))


@pytest.mark.parametrize(("value", "ok"), [(0.1, True), (3600, True), (0, False), (3601, False)])
def test_body_timeout_is_above_0_and_at_most_an_hour(value: float, ok: bool) -> None:
    if ok:
        assert taken(with_limits(body_timeout_s=value)).limits.body_timeout_s == value
    else:
        assert "limits.body_timeout_s" in error_of(with_limits(body_timeout_s=value))


@pytest.mark.parametrize(("value", "ok"), [(0, True), (3600, True), (1, False), (3599, False)])
def test_run_ttl_is_0_or_at_least_an_hour(value: int, ok: bool) -> None:
    raw = {"upstreams": {"openai": {"base_url": "https://api.example.com/v1", "timeout_s": 60}}, **{}}
    raw["limits"] = {"run_ttl_s": value}
    if ok:
        assert taken(raw).limits.run_ttl_s == value
    else:
        assert "limits.run_ttl_s" in error_of(raw)


def test_run_ttl_must_outlast_every_upstreams_timeout_plus_the_lease_margin() -> None:
    def raw(run_ttl_s: int) -> dict[str, Any]:
        upstreams = {
            "fast": {"base_url": "https://a.example/v1", "timeout_s": 60},
            "slow": {"base_url": "https://b.example/v1", "timeout_s": 3600, "connect_timeout_s": 3000},
        }
        return {
            "upstreams": upstreams,
            "models": {},
            # A settled marker 90% of which outlasts the slowest lease (3,630 s).
            "limits": {"run_ttl_s": run_ttl_s, "lease_margin_s": 30, "settled_marker_ttl_s": 4034},
        }

    assert "upstreams.slow.timeout_s" in error_of(raw(3630))  # equal to the lease: refused
    assert taken(raw(3631)).limits.run_ttl_s == 3631


def test_reap_grace_must_be_0_or_longer_than_a_journal_replay() -> None:
    assert "reap_grace_s must be longer" in error_of(with_limits(reap_grace_s=2, journal_replay_s=2))
    # A store timeout of 0.4 s: the grace must outlast a replay and a settle stuck that long.
    taken_limits = {
        **with_limits(reap_grace_s="2.5", journal_replay_s=2, reaper_interval_s=0.5),
        "redis": {"socket_timeout_s": 0.4},
    }
    assert taken(taken_limits).limits.reap_grace_s == 2.5
    assert taken(with_limits(reap_grace_s=0)).limits.reap_grace_s == 0


def test_prior_context_ttl_is_at_most_30_days() -> None:
    assert taken(with_limits(prior_context_ttl_s=30 * 86400)).limits.prior_context_ttl_s == 30 * 86400
    assert "limits.prior_context_ttl_s" in error_of(with_limits(prior_context_ttl_s=30 * 86400 + 1))


@pytest.mark.parametrize("value", [True, False])
def test_a_count_of_tool_calls_or_output_tokens_is_not_true_or_false(value: bool) -> None:
    assert "limits.default_max_tool_calls" in error_of(with_limits(default_max_tool_calls=value))
    assert "limits.default_max_output_tokens" in error_of(with_limits(default_max_output_tokens=value))


def test_an_output_cap_whose_reserve_the_store_cannot_hold_is_refused_at_load() -> None:
    """10^12 tokens at 1,000 per million (a dear model priced in yen) is 10^15 micro-units, one
    past what the store holds: every call sending no cap of its own was refused 400 and told to
    lower a max_tokens it never sent (the second review of the day). Refused at load, naming the
    cap; a tier's dearer price counts too, and a cap within it loads."""
    dear = {"upstream": "openai", "price_per_million": {"input": "1", "output": "1000"}}
    raw = {**UP, "limits": {"default_max_output_tokens": 10**12}, "models": {"*": dear}}
    assert "limits.default_max_output_tokens (1000000000000)" in error_of(raw)
    capped = {**dear, "max_output_tokens": 10**12}
    assert "models.*.max_output_tokens" in error_of({**UP, "models": {"*": capped}})
    tiered = {
        "upstream": "openai",
        "price_per_million": {"input": "1", "output": "1"},
        "service_tiers": {"priority": {"input": "1", "output": "1000"}},
    }
    assert "limits.default_max_output_tokens" in error_of({**raw, "models": {"*": tiered}})
    assert taken({**raw, "limits": {"default_max_output_tokens": 10**12 - 1}}).limits


def test_no_tool_calls_reserved_is_a_choice_the_readme_offers() -> None:
    assert taken(with_limits(default_max_tool_calls=0)).limits.default_max_tool_calls == 0


def test_default_max_tool_calls_is_at_most_a_million() -> None:
    assert taken(with_limits(default_max_tool_calls=1_000_000)).limits.default_max_tool_calls == 1_000_000
    assert "limits.default_max_tool_calls" in error_of(with_limits(default_max_tool_calls=1_000_001))


def test_the_settled_marker_lives_at_least_a_minute() -> None:
    # Shorter, a second settle of one call (a replayed journal line) could find no marker and bill it twice.
    quick = {"upstreams": {"openai": {"base_url": "https://api.example.com/v1", "timeout_s": 24}}}
    assert taken({**quick, "limits": {"settled_marker_ttl_s": 60}}).limits.settled_marker_ttl_s == 60
    assert "limits.settled_marker_ttl_s" in error_of({**quick, "limits": {"settled_marker_ttl_s": 59}})


def test_90_percent_of_the_settled_marker_outlasts_every_whole_answers_lease() -> None:
    """A settle bills a call whose reservation the store lost (a failover) only within 90% of the
    marker's life after Redis last confirmed its lease, which a whole answer's call does once, at
    its reserve: a marker of 60 s beside the default 600 s timeout left such a call unbilled once
    it ran past 54 s. The slowest upstream's timeout plus the margin (630 s here): at least 700 s."""
    upstreams = {
        "fast": {"base_url": "https://a.example/v1", "timeout_s": 60},
        "slow": {"base_url": "https://b.example/v1", "timeout_s": 600},
    }

    def raw(settled_marker_ttl_s: int) -> dict[str, Any]:
        limits = {"settled_marker_ttl_s": settled_marker_ttl_s, "lease_margin_s": 30}
        return {"upstreams": upstreams, "models": {}, "limits": limits}

    refusal = error_of(raw(699))
    for named in ("limits.settled_marker_ttl_s (699)", "upstreams.slow.timeout_s", "limits.lease_margin_s"):
        assert named in refusal
    assert "at least 700" in refusal
    assert taken(raw(700)).limits.settled_marker_ttl_s == 700
    # Beside the default timeout (600 s).
    assert "limits.settled_marker_ttl_s" in error_of(with_limits(settled_marker_ttl_s=60))


@pytest.mark.parametrize(
    ("field", "least", "most"),
    [
        ("max_body_bytes", 1024, None),
        ("max_upstream_body_bytes", 1024, None),
        # A provider's count past 10^12 is no count (``observe.MAX_SANE_TOKENS``): a default
        # past it refused every call without a cap of its own (400, blaming its max_tokens or n).
        ("default_max_output_tokens", 1, 10**12),
        ("reap_grace_s", 0, 3600),
        ("run_ttl_s", 0, 10 * 366 * 24 * 3600),
        ("reaper_interval_s", None, None),
        ("journal_replay_s", None, None),
        ("lease_margin_s", None, None),
    ],
)
def test_a_limit_is_taken_at_its_bounds_and_refused_past_them(
    field: str, least: float | None, most: float | None
) -> None:
    # None: a duration that must be above 0 (0 itself refused).
    if least is None:
        assert f"limits.{field}" in error_of(with_limits(**{field: 0}))
    else:
        assert getattr(taken(with_limits(**{field: least})).limits, field) == least
        assert f"limits.{field}" in error_of(with_limits(**{field: least - 1}))
    if most is not None:
        assert getattr(taken(with_limits(**{field: most})).limits, field) == most
        assert f"limits.{field}" in error_of(with_limits(**{field: most + 1}))


def test_shutdown_grace_may_be_0() -> None:
    assert taken({**UP, "shutdown_grace_s": 0}).shutdown_grace_s == 0


@pytest.mark.parametrize(("port", "ok"), [(0, True), (65535, True), (65536, False), (-1, False)])
def test_a_listen_port_is_0_to_65535(port: int, ok: bool) -> None:
    if ok:
        assert taken({**UP, "listen": {"port": port}}).listen.port == port
    else:
        assert "listen.port" in error_of({**UP, "listen": {"port": port}})


# --- upstreams and redis ----------------------------------------------------------------------------


def test_a_plain_http_base_url_is_taken_without_its_trailing_slash() -> None:
    raw = {"upstreams": {"openai": {"base_url": "http://vllm.internal:8000/v1/"}}}
    assert taken(raw).upstreams["openai"].base_url == "http://vllm.internal:8000/v1"


@pytest.mark.parametrize("timeout", ["timeout_s", "connect_timeout_s"])
def test_an_upstream_timeout_of_0_is_refused(timeout: str) -> None:
    raw = {"upstreams": {"openai": {"base_url": "https://api.example.com/v1", timeout: 0}}}
    assert f"upstreams.openai.{timeout}" in error_of(raw)


def test_a_unix_socket_redis_url_is_taken() -> None:
    assert taken({**UP, "redis": {"url": "unix:///run/redis.sock"}}).redis.url == "unix:///run/redis.sock"


@pytest.mark.parametrize(
    "query",
    [
        "db=-1",
        "db=2147483647",  # a Redis has at most 2^31 - 1 databases: SELECT refused every connection
        "protocol=4",
        "protocol=1",
        "socket_read_size=0",
        "socket_timeout=0",
        "socket_connect_timeout=0",
    ],
)
def test_a_redis_url_option_just_past_what_a_connection_takes_is_refused(query: str) -> None:
    assert "redis.url" in error_of({**UP, "redis": {"url": f"redis://localhost:6379/0?{query}"}})


@pytest.mark.parametrize("url", ["redis://localhost:6379/2147483646", "unix:///run/redis.sock?db=2147483646"])
def test_the_last_database_a_redis_can_have_is_taken(url: str) -> None:
    assert taken({**UP, "redis": {"url": url}}).redis.url == url


@pytest.mark.parametrize(
    "url", ["unix:///run/redis.sock", "redis://localhost:6379/1", "redis://localhost:6379?db=2"]
)
def test_a_cluster_on_a_socket_or_another_database_is_refused(url: str) -> None:
    assert "cluster: true needs" in error_of({**UP, "redis": {"url": url, "cluster": True}})


def test_an_empty_redis_url_variable_leaves_the_files_url() -> None:
    # "read the URL from this environment variable when it is set": set to nothing, it says nothing.
    raw = {**UP, "redis": {"url": "redis://file:6379/0", "url_env": "REDIS_URL"}}
    assert taken(raw, {"REDIS_URL": ""}).redis.url == "redis://file:6379/0"
    assert taken(raw, {"REDIS_URL": "redis://env:6379/1"}).redis.url == "redis://env:6379/1"


def test_the_ledger_and_report_commands_read_the_redis_url_variable_too() -> None:
    # They read only the store (no key secrets): the URL from the environment is the store's.
    raw = {
        **UP,
        "redis": {"url_env": "REDIS_URL"},
        "keys": [{"name": "k", "key_env": "UNSET", "tenant": "t"}],
    }
    config = parse_config(raw, {"REDIS_URL": "redis://env:6379/3"}, key_secrets=False)
    assert config.redis.url == "redis://env:6379/3"


def test_the_command_lines_host_and_port_override_the_files() -> None:
    config = taken({**UP, "listen": {"host": "10.0.0.1", "port": 9000}})
    assert with_flags(config, port=9100).listen.port == 9100
    assert with_flags(config, port=9100).listen.host == "10.0.0.1"
    assert with_flags(config, host="0.0.0.0").listen.host == "0.0.0.0"


def test_zero_config_passes_the_callers_key_and_uses_the_store_given() -> None:
    config = passthrough_config("https://api.example.com/v1", host="h", port=1, redis_url="redis://r:6379/0")
    assert config.upstreams["default"].passthrough_auth is True
    assert config.redis.url == "redis://r:6379/0"
    assert config.route("any-model") is not None


def test_a_top_level_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        parse_config([UP], {})


def test_an_empty_file_is_refused_for_the_upstreams_it_lacks() -> None:
    # An empty YAML document reads as nothing: the error names what is missing, not the document.
    with pytest.raises(ConfigError, match=r"^upstreams: Field required"):
        parse_config(None, {})


# --- a 7th decimal place however many digits a figure has ---------------------------------------

# 12 and a 29th decimal place: 31 significant digits, past the decimal context's 28. Scaled to
# micro-units in that context, it was rounded first, then taken as whole micro-units (12).
LONG_FIGURE = "12.00000000000000000000000000001"


def test_a_price_with_a_29th_decimal_place_is_refused() -> None:
    assert "6 decimal places" in error_of(priced(input=LONG_FIGURE, output=1))


def test_a_tool_price_with_a_29th_decimal_place_is_refused() -> None:
    raw = priced(input=1, output=1)
    raw["models"]["*"]["price_per_thousand_calls"] = {"web_search": LONG_FIGURE}
    assert "6 decimal places" in error_of(raw)


def test_a_cost_ceiling_with_a_29th_decimal_place_is_refused() -> None:
    assert "6 decimal places" in error_of(with_run_ceilings(cost_usd=LONG_FIGURE))


def test_figures_of_six_places_with_trailing_zeros_or_an_exponent_are_still_taken() -> None:
    config = taken(
        {**priced(input="999999999.999999", output="1E+2"), **with_run_ceilings(cost_usd="12.500000000")}
    )
    rates = config.models["*"].price_per_million.rates  # type: ignore[union-attr]
    assert (rates["input"], rates["output"]) == (10**15 - 1, 100_000_000)
    assert config.tiers["standard"].run.meters == {"cost_micros": 12_500_000}


def _keys_named(tenants_by_name: dict[str, list[str]]) -> list[dict[str, str]]:
    """A key for each (name, tenant), each of its own digest."""
    pairs = [(name, tenant) for name, tenants in tenants_by_name.items() for tenant in tenants]
    return [
        {"name": name, "sha256": hashlib.sha256(f"{i}".encode()).hexdigest(), "tenant": tenant}
        for i, (name, tenant) in enumerate(pairs)
    ]


def test_a_repeated_key_names_its_tenants_once_each_and_the_first_five_at_most() -> None:
    def said(tenants_by_name: dict[str, list[str]]) -> str:
        return error_of({**UP, "keys": _keys_named(tenants_by_name)}).partition("names must be unique: ")[2]

    assert said({"k": ["t", "t"]}) == "k names 2 keys (tenant t)"
    assert said({"k": ["t", "u", "t"]}) == "k names 3 keys (tenants t, u)"
    five = [f"t{i}" for i in range(5)]
    assert said({"k": five}) == "k names 5 keys (tenants t0, t1, t2, t3, t4)"
    assert said({"k": [*five, "t5"]}) == "k names 6 keys (tenants t0, t1, t2, t3, t4 and 1 more)"


def test_repeated_key_names_are_named_five_at_most_and_how_many_more() -> None:
    def said(names: int) -> str:
        return error_of({**UP, "keys": _keys_named({f"k{i}": ["t", "t"] for i in range(names)})})

    assert said(5).endswith("k4 names 2 keys (tenant t)")
    assert said(6).endswith("k4 names 2 keys (tenant t); and 1 names more")
    assert "k5" not in said(6)


def test_a_model_entry_with_a_bracket_set_is_a_glob() -> None:
    raw = {**UP, "models": {"gpt-[45]o": {"upstream": "openai"}}}
    assert taken(raw).route("gpt-4o")[0] == "gpt-[45]o"  # type: ignore[index]
    assert taken(raw).route("gpt-3o") is None


def test_the_socket_timeout_in_force_is_named_where_it_comes_from() -> None:
    def named(url: str, **redis: Any) -> tuple[float, str]:
        config = taken({**UP, "redis": {"url": url, "socket_timeout_s": 5, **redis}})
        return config.redis.effective_socket_timeout_s, config.redis.socket_timeout_named

    field, in_url = "redis.socket_timeout_s", "the Redis URL's socket_timeout"
    # The proxy's own client runs the scripts over redis:// and waits the field's: a tie is its.
    assert named("redis://127.0.0.1:1/0?socket_timeout=5") == (5, field)
    assert named("redis://127.0.0.1:1/0?socket_timeout=3") == (5, field)
    assert named("redis://127.0.0.1:1/0?socket_timeout=7") == (7, in_url)
    assert named("rediss://127.0.0.1:1/0?socket_timeout=3") == (3, in_url)
    assert named("rediss://127.0.0.1:1/0?socket_timeout=5") == (5, in_url)
