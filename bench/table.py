"""Aggregation and reporting for ``bench/run.py``: medians over rounds, the comparisons between
arms, and the Markdown report (main table, CPU targets, proxy vs LiteLLM, small calls under
concurrent 100 KB calls)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.run import Settings
    from bench.scenarios import Scenario

Rows = dict[tuple[str, int, str], dict[str, Any]]

# CPU ms/req, proxy / relay (issue 6).
# The non-streaming target is for budgets on (every call reserves and settles against four
# scopes); nonstream-small (run scope only) is held to it too.
TARGETS = {"nonstream-small": 2.0, "budgets-on": 2.0, "stream-20": 1.5, "stream-200": 1.3}
# req/s, proxy / LiteLLM on the same machine and work.
LITELLM_TARGET = 25.0
ARM_ORDER = {"direct": 0, "relay": 1, "relay+redis": 2, "proxy": 3, "litellm": 4}

NUMERIC = (
    "rps",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "mean_ms",
    "ttfb_p50_ms",
    "ttfb_p99_ms",
    "cpu_ms_per_req",
    "cpu_util",
    "upstream_cpu_ms_per_req",
    "redis_cpu_ms_per_req",
    "peak_rss_mib",
    "loadgen_cpu_util",
    "foreign_cpu_util",
)


def median_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(records[-1])
    for key in NUMERIC:
        values = [r[key] for r in records if r.get(key) is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    out["requests"] = sum(r["requests"] for r in records)
    out["ok"] = sum(r["ok"] for r in records)
    out["errors"] = sum(r["errors"] for r in records)
    out["rounds"] = len(records)
    return out


def _ratio(a: float | None, b: float | None, digits: int = 2) -> float | None:
    return round(a / b, digits) if a and b else None


def failed(row: Mapping[str, Any]) -> bool:
    """No call of the arm succeeded (a proxy answering every call with a fast 502, say): its CPU
    per request is an error answer's, its req/s how fast it fails, so it is compared with nothing
    and meets no target."""
    return not row.get("ok")


def _met(ratio: float | None, met: bool, *arms: Mapping[str, Any] | None) -> str:
    """A target table's "met" cell for a ratio of these arms: an arm whose calls all failed meets
    none (its ratio is not worked out), one with some errors is flagged beside the verdict."""
    present = [arm for arm in arms if arm is not None]
    if any(failed(arm) for arm in present):
        return "**no: every call failed**"
    if ratio is None:
        return "-"
    verdict = "yes" if met else "**no**"
    if any(arm.get("errors") for arm in present):
        verdict += " (**errors**)"
    return verdict


def _errors_cell(row: Mapping[str, Any]) -> str:
    """Bold and flagged when there are any: that row's figures count failed calls too."""
    errors = row.get("errors") or 0
    if failed(row):
        return f"**⚠ {errors} (all)**"
    return f"**⚠ {errors}**" if errors else "0"


def add_comparisons(rows: Rows, scenarios: Sequence[Scenario]) -> None:
    """Latency added vs direct, proxy/relay ratios, and proxy/LiteLLM ratios."""
    by_name = {s.name: s for s in scenarios}
    for (name, conc, arm), row in rows.items():
        base_name = by_name[name].baseline or name
        direct = rows.get((base_name, conc, "direct"))
        relay = rows.get((base_name, conc, "relay"))
        row["baseline_scenario"] = base_name
        # No ratio with an arm whose every call failed, on either side: it did not do the work.
        if failed(row):
            continue
        direct = None if direct is None or failed(direct) else direct
        relay = None if relay is None or failed(relay) else relay
        if direct is not None and arm != "direct":
            for key in ("p50_ms", "p99_ms"):
                if row.get(key) is not None and direct.get(key) is not None:
                    row[f"added_{key}"] = round(row[key] - direct[key], 3)
            row["rps_ratio_vs_direct"] = _ratio(row.get("rps"), direct.get("rps"))
            row["p50_ratio_vs_direct"] = _ratio(row.get("p50_ms"), direct.get("p50_ms"))
        if arm in ("proxy", "relay+redis") and relay is not None:
            row["cpu_ratio_vs_relay"] = _ratio(row.get("cpu_ms_per_req"), relay.get("cpu_ms_per_req"))
            row["rps_ratio_vs_relay"] = _ratio(row.get("rps"), relay.get("rps"))
        litellm = rows.get((name, conc, "litellm"))
        if arm == "proxy" and litellm is not None and not failed(litellm):
            # Throughput multiple (the figure) and the per-request CPU multiple.
            row["rps_ratio_vs_litellm"] = _ratio(row.get("rps"), litellm.get("rps"), 1)
            row["litellm_cpu_ratio"] = _ratio(litellm.get("cpu_ms_per_req"), row.get("cpu_ms_per_req"), 1)
        if arm == "proxy" and by_name[name].background is not None:
            alone = rows.get((base_name, conc, "proxy"))
            if alone is not None and not failed(alone):
                for key in ("p50_ms", "p99_ms"):
                    if row.get(key) is not None and alone.get(key) is not None:
                        row[f"alone_{key}"] = alone[key]
                        row[f"added_vs_alone_{key}"] = round(row[key] - alone[key], 3)


def _fmt(value: Any, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int):
        return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"
    return str(value)


def _main_table(rows: Rows, order: Mapping[str, int]) -> list[str]:
    lines = [
        "| scenario | conc | arm | req/s | p50 ms | p99 ms | +p50 vs direct | +p99 vs direct "
        "| TTFB p50 ms | CPU ms/req | redis ms/req | peak RSS MiB | errors "
        "| req/s x direct | p50 x direct | CPU/req x relay | req/s x relay |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in sorted(rows, key=lambda k: (k[1], order[k[0]], ARM_ORDER[k[2]])):
        r = rows[key]
        cells = [
            r["scenario"],
            str(r["concurrency"]),
            r["arm"],
            _fmt(r["rps"], 0),
            _fmt(r["p50_ms"]),
            _fmt(r["p99_ms"]),
            _fmt(r.get("added_p50_ms"), signed=True),
            _fmt(r.get("added_p99_ms"), signed=True),
            _fmt(r.get("ttfb_p50_ms")),
            _fmt(r["cpu_ms_per_req"], 3),
            _fmt(r.get("redis_cpu_ms_per_req"), 3),
            _fmt(r["peak_rss_mib"], 1),
            _errors_cell(r),
            _fmt(r.get("rps_ratio_vs_direct")),
            _fmt(r.get("p50_ratio_vs_direct")),
            _fmt(r.get("cpu_ratio_vs_relay")),
            _fmt(r.get("rps_ratio_vs_relay")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _targets_table(rows: Rows, order: Mapping[str, int]) -> list[str]:
    lines = ["", "## CPU per request, proxy / relay, against the targets", ""]
    lines += [
        "| scenario | conc | proxy CPU ms/req | relay CPU ms/req | ratio | per-round ratios | target | met "
        "| relay+2 Redis scripts ÷ relay (the floor) |"
    ]
    lines += ["|---|---:|---:|---:|---:|---|---:|---|---:|"]
    for (name, conc, arm), r in sorted(rows.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        if arm != "proxy" or name not in TARGETS:
            continue
        relay = rows.get((r.get("baseline_scenario") or name, conc, "relay"))
        floor = rows.get((r.get("baseline_scenario") or name, conc, "relay+redis")) or {}
        floor_rounds = floor.get("cpu_ratio_rounds") or []
        floor_spread = ""
        if len(floor_rounds) > 1:
            floor_spread = f" ({min(floor_rounds):.2f} to {max(floor_rounds):.2f})"
        ratio = r.get("cpu_ratio_vs_relay")
        met = _met(ratio, ratio is not None and ratio <= TARGETS[name], r, relay)
        rounds = r.get("cpu_ratio_rounds") or []
        spread = f"{min(rounds):.2f} to {max(rounds):.2f}" if len(rounds) > 1 else "-"
        lines.append(
            f"| {name} | {conc} | {_fmt(r['cpu_ms_per_req'], 3)} | "
            f"{_fmt(relay['cpu_ms_per_req'] if relay else None, 3)} | {_fmt(ratio)} | {spread} | "
            f"≤{TARGETS[name]} | {met} | {_fmt(floor.get('cpu_ratio_vs_relay'))}{floor_spread} |"
        )
    return lines


def add_round_ratios(rows: Rows, raw: Mapping[tuple[str, int, str], list[dict[str, Any]]]) -> None:
    """Proxy / relay CPU per round (the arms of a round ran back to back): the spread shows how
    much of a difference between runs is the machine's noise."""
    for (name, conc, arm), row in rows.items():
        if arm not in ("proxy", "relay+redis"):
            continue
        relay = raw.get((row.get("baseline_scenario") or name, conc, "relay"), [])
        proxy = raw[(name, conc, arm)]
        row["cpu_ratio_rounds"] = [
            round(p["cpu_ms_per_req"] / q["cpu_ms_per_req"], 2)
            for p, q in zip(proxy, relay, strict=False)
            if p.get("cpu_ms_per_req") and q.get("cpu_ms_per_req") and not failed(p) and not failed(q)
        ]


def _litellm_table(rows: Rows, order: Mapping[str, int]) -> list[str]:
    pairs = [
        (key, r, rows[(key[0], key[1], "proxy")])
        for key, r in rows.items()
        if key[2] == "litellm" and (key[0], key[1], "proxy") in rows
    ]
    if not pairs:
        return []
    lines = ["", "## Throughput, proxy / LiteLLM (same upstream, load and machine)", ""]
    lines += [
        "| scenario | conc | proxy req/s | litellm req/s | req/s proxy ÷ litellm | target | met "
        "| proxy CPU ms/req | litellm CPU ms/req | CPU/req litellm ÷ proxy | litellm p50 ms "
        "| litellm p99 ms | litellm peak RSS MiB | litellm errors |"
    ]
    lines += ["|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, conc, _arm), lite, proxy in sorted(pairs, key=lambda p: (p[0][1], order[p[0][0]])):
        ratio = proxy.get("rps_ratio_vs_litellm")
        met = _met(ratio, ratio is not None and ratio >= LITELLM_TARGET, proxy, lite)
        lines.append(
            f"| {name} | {conc} | {_fmt(proxy['rps'], 0)} | {_fmt(lite['rps'], 0)} | {_fmt(ratio, 1)} "
            f"| ≥{LITELLM_TARGET:.0f} | {met} | {_fmt(proxy['cpu_ms_per_req'], 3)} "
            f"| {_fmt(lite['cpu_ms_per_req'], 3)} | {_fmt(proxy.get('litellm_cpu_ratio'), 1)} "
            f"| {_fmt(lite['p50_ms'])} | {_fmt(lite['p99_ms'])} | {_fmt(lite['peak_rss_mib'], 1)} "
            f"| {_errors_cell(lite)} |"
        )
    return lines


def _interference_table(rows: Rows, order: Mapping[str, int]) -> list[str]:
    mixed = [(k, r) for k, r in rows.items() if r.get("background")]
    if not mixed:
        return []
    lines = ["", "## Small calls with concurrent 100 KB calls (proxy)", ""]
    lines += [
        "| scenario | conc | background | bg req/s | bg p50 ms | bg errors | small req/s "
        "| p50 ms alone | p99 ms alone | p50 ms | p99 ms | +p50 | +p99 |"
    ]
    lines += ["|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, conc, _arm), r in sorted(mixed, key=lambda kv: (kv[0][1], order[kv[0][0]])):
        bg = r["background"]
        lines.append(
            f"| {name} | {conc} | {bg['label']} | {_fmt(bg.get('rps'), 1)} | {_fmt(bg.get('p50_ms'))} "
            f"| {bg.get('errors', '-')} | {_fmt(r['rps'], 0)} | {_fmt(r.get('alone_p50_ms'))} "
            f"| {_fmt(r.get('alone_p99_ms'))} | {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} "
            f"| {_fmt(r.get('added_vs_alone_p50_ms'), signed=True)} "
            f"| {_fmt(r.get('added_vs_alone_p99_ms'), signed=True)} |"
        )
    return lines


def markdown(rows: Rows, settings: Settings, notes: list[str]) -> str:
    lines = [
        f"# Proxy benchmark ({settings.mode})",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M:%S')}, git {settings.extra.get('git', '?')}, "
        f"{os.cpu_count()} cores, Python {sys.version.split()[0]}",
        f"- warm-up {settings.warmup_s}s + {settings.duration_s}s measured per arm, "
        f"{settings.rounds} round(s) (medians), proxy workers: {settings.workers or 'default (1 process)'}",
        "- CPU ms/req: utime+stime of the server process tree over the measured phase / requests. "
        "Proxy and relay+redis rows also show Redis CPU ms/req. Ratios are arm / relay (same "
        "scenario's relay, or "
        "the baseline scenario's for the proxy-only scenarios).",
        "- Errors in bold (⚠): that row's req/s and CPU ms/req count its failed calls too, its "
        "latencies only the calls that succeeded; a row whose every call failed (all) gets no ratio "
        "and meets no target.",
        *[f"- {note}" for note in notes],
        "",
    ]
    order = {s.name: i for i, s in enumerate(settings.scenarios)}
    lines += _main_table(rows, order)
    lines += _targets_table(rows, order)
    lines += _litellm_table(rows, order)
    lines += _interference_table(rows, order)
    lines += ["", "Scenarios:", ""]
    lines += [f"- `{s.name}`: {s.description}" for s in settings.scenarios]
    return "\n".join(lines) + "\n"
