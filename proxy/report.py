"""Totals of the ledger for operators: tokens, cost and outcomes, grouped by model, run or key."""

from __future__ import annotations

import csv
import io
import json
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TextIO

from proxy.config_base import MICROS_PER_UNIT
from proxy.outcome import TOKEN_KINDS

GROUPS = {"model": "model", "run": "run_id", "key": "key"}
TOKEN_FIELDS = tuple(f"{kind}_tokens" for kind in TOKEN_KINDS)


@dataclass
class Totals:
    """``calls``: those that went out, as the ``requests`` meter counts them; ``outcomes``: every
    entry, as ``llm_proxy_requests_total`` does, those that never went out among them."""

    calls: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_FIELDS, 0))
    cost_micros: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, entry: Mapping[str, str]) -> None:
        # Billed nothing because nothing went out (``not_forwarded``, a connection refused, a
        # client gone first): the meters count no request (settle's ``requests``), nor does this.
        if entry.get("usage_source") != "none":
            self.calls += 1
        for name in TOKEN_FIELDS:
            self.tokens[name] += int(entry.get(name) or 0)
        self.cost_micros += int(entry.get("cost_micros") or 0)
        # ``rejected:parse-json: <the parser's message>``: counted by its kind, not by each message
        # (whose spaces would also break the ``outcome=count`` list apart).
        outcome = entry.get("outcome", "").split(": ", 1)[0]
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def add_up(entries: Iterable[Mapping[str, str]], by: str, totals: dict[str, Totals]) -> None:
    """Add ``entries`` to ``totals``, per group: a ledger is read a page at a time, and only
    the totals are kept."""
    field_name = GROUPS[by]
    for entry in entries:
        totals.setdefault(entry.get(field_name, "") or "-", Totals()).add(entry)


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


# A spreadsheet runs a cell that starts with one of these as a formula (OWASP "CSV injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _inert(value: object) -> object:
    # Models, run ids and request ids are the client's choice: in a CSV they stay text.
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def csv_text(table: Iterable[Mapping[str, object]]) -> str:
    """``table`` as CSV, columns in order of first appearance; nothing for no rows."""
    table = list(table)
    if not table:
        return ""
    buffer = io.StringIO()
    writer = csv_writer(buffer, columns_of(table))
    writer.writerows(csv_rows(table))
    return buffer.getvalue()


def columns_of(
    table: Iterable[Mapping[str, object]], columns: dict[str, None] | None = None
) -> dict[str, None]:
    """The columns of ``table`` (added to ``columns``), in order of first appearance."""
    columns = {} if columns is None else columns
    for row in table:
        columns.update(dict.fromkeys(row))
    return columns


def csv_writer(stream: TextIO, columns: Iterable[str]) -> csv.DictWriter[str]:
    """A writer of ``columns`` to ``stream``, its header written."""
    # RFC 4180's terminator: the writer then quotes a cell holding a lone CR as well as an LF (a
    # bare CR ends a row for every reader, and a row of the client's choosing could start with a
    # formula past the guard).
    writer = csv.DictWriter(stream, fieldnames=list(columns), lineterminator="\r\n")
    writer.writeheader()
    return writer


def csv_rows(table: Iterable[Mapping[str, object]]) -> Iterator[dict[str, object]]:
    return ({k: _inert(v) for k, v in row.items()} for row in table)


def _printable(value: str) -> str:
    # A line break in a model name would draw a row of its own in the table.
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)


def _columns(text: str) -> int:
    """The columns a terminal draws ``text`` in: East Asian wide and fullwidth characters take
    two (a model name a client chose: 通义千问), combining marks none."""
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text
    )


def render(table: list[dict[str, str]], fmt: str) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in table)
    if not table:
        return "no ledger entries\n" if fmt == "table" else ""
    if fmt == "csv":
        return csv_text(table)
    table = [{c: _printable(v) for c, v in row.items()} for row in table]
    columns = list(table[0])
    widths = {c: max(_columns(c), *(_columns(row[c]) for row in table)) for c in columns}
    numeric = {c for c in columns if all(row[c].replace(".", "").isdigit() for row in table)}

    def line(values: Mapping[str, str]) -> str:
        cells = []
        for c in columns:
            pad = " " * (widths[c] - _columns(values[c]))
            cells.append(pad + values[c] if c in numeric else values[c] + pad)
        return "  ".join(cells).rstrip()

    header = line({c: c for c in columns})
    return "\n".join([header, "  ".join("-" * widths[c] for c in columns), *(line(r) for r in table)]) + "\n"
