"""Totals of the ledger for operators: tokens, cost and outcomes, grouped by model, run or key."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from proxy.config import MICROS_PER_UNIT

GROUPS = {"model": "model", "run": "run_id", "key": "key"}
TOKEN_FIELDS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens")


@dataclass
class Totals:
    calls: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_FIELDS, 0))
    cost_micros: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, entry: Mapping[str, str]) -> None:
        self.calls += 1
        for name in TOKEN_FIELDS:
            self.tokens[name] += int(entry.get(name) or 0)
        self.cost_micros += int(entry.get("cost_micros") or 0)
        outcome = entry.get("outcome", "")
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def aggregate(entries: Iterable[Mapping[str, str]], by: str) -> dict[str, Totals]:
    field_name = GROUPS[by]
    out: dict[str, Totals] = {}
    for entry in entries:
        out.setdefault(entry.get(field_name, "") or "-", Totals()).add(entry)
    return dict(sorted(out.items()))


def money(micros: int) -> str:
    """Exact decimal rendering of integer micro-units (no float on the money path)."""
    return str((Decimal(micros) / MICROS_PER_UNIT).quantize(Decimal("0.000001")))


def rows(totals: Mapping[str, Totals], by: str, currency: str) -> list[dict[str, str]]:
    out = []
    for group, t in totals.items():
        row = {by: group, "calls": str(t.calls)}
        row.update({name: str(t.tokens[name]) for name in TOKEN_FIELDS})
        row[f"cost_{currency.lower()}"] = money(t.cost_micros)
        row["outcomes"] = " ".join(f"{k}={v}" for k, v in sorted(t.outcomes.items()))
        out.append(row)
    return out


def render(table: list[dict[str, str]], fmt: str) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in table)
    if not table:
        return "no ledger entries\n" if fmt == "table" else ""
    columns = list(table[0])
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(table)
        return buffer.getvalue()
    widths = {c: max(len(c), *(len(row[c]) for row in table)) for c in columns}
    numeric = {c for c in columns if all(row[c].replace(".", "").isdigit() for row in table)}

    def line(values: Mapping[str, str]) -> str:
        cells = [values[c].rjust(widths[c]) if c in numeric else values[c].ljust(widths[c]) for c in columns]
        return "  ".join(cells).rstrip()

    header = line({c: c for c in columns})
    return "\n".join([header, "  ".join("-" * widths[c] for c in columns), *(line(r) for r in table)]) + "\n"
