"""The configuration of tiers (``tiers:``): the ceilings of each scope a key's calls count in
(run, key, its windows, its tenant's windows) and the policy a tier overrides.
"""

from __future__ import annotations

from decimal import Decimal
from functools import cached_property
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from proxy.config_base import (
    MAX_COUNT,
    MAX_UNITS,
    MICROS_PER_UNIT,
    Frozen,
    Period,
    not_a_bool,
    past_six_places,
)


class PolicyOverride(Frozen):
    on_truncate: Literal["pass", "reject"] | None = None
    on_invalid_json: Literal["pass", "reject"] | None = None
    on_client_disconnect: Literal["drain", "cancel"] | None = None


class Ceilings(Frozen):
    """Ceilings of one scope; an absent field is unlimited (the meter still accumulates)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    requests: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    input_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    output_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    total_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    cost: Decimal | None = Field(default=None, ge=0, le=MAX_UNITS, alias="cost_usd")
    concurrent: int | None = Field(default=None, ge=0, le=MAX_COUNT)

    @field_validator("requests", "input_tokens", "output_tokens", "total_tokens", "concurrent", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        # YAML's true/false/yes/no/on/off would be a ceiling of 1 or 0 (0 refuses every call).
        return not_a_bool(value, "a ceiling is a count")

    @field_validator("cost")
    @classmethod
    def _whole_micro_units(cls, value: Decimal | None) -> Decimal | None:
        # Silently rounded before: 1e-7 became a ceiling of 0, refusing every priced call.
        if value is not None and past_six_places(value):
            raise ValueError("cost ceilings are limited to 6 decimal places")
        return value

    @cached_property
    def meters(self) -> dict[str, int]:
        """``as_meters`` computed once per config (read on every reservation)."""
        return self.as_meters()

    def as_meters(self) -> dict[str, int]:
        """Ceilings keyed by meter name, integers only (cost in micro-units)."""
        out: dict[str, int] = {}
        for meter in ("requests", "input_tokens", "output_tokens", "total_tokens", "concurrent"):
            value = getattr(self, meter)
            if value is not None:
                out[meter] = int(value)
        if self.cost is not None:
            out["cost_micros"] = int(self.cost * MICROS_PER_UNIT)
        return out


class WindowCeilings(Ceilings):
    period: Period

    @model_validator(mode="after")
    def _no_concurrency(self) -> WindowCeilings:
        if self.concurrent is not None:
            raise ValueError("concurrent is not a windowed meter: limit it under run or key")
        return self


class TierConfig(Frozen):
    run: Ceilings = Ceilings()
    # Per API key over its whole life (not windowed): e.g. concurrent calls per key.
    key: Ceilings = Ceilings()
    windows: tuple[WindowCeilings, ...] = ()
    tenant: tuple[WindowCeilings, ...] = ()
    policy: PolicyOverride = PolicyOverride()
    on_budget_short: Literal["refuse", "clamp"] = "refuse"
    min_output_tokens: int = Field(default=1, ge=1)

    @field_validator("min_output_tokens", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        return not_a_bool(value)  # yes would be 1: a clamp that may leave one output token

    @model_validator(mode="after")
    def _one_window_per_period(self) -> TierConfig:
        for name in ("windows", "tenant"):
            periods = [w.period for w in getattr(self, name)]
            if len(periods) != len(set(periods)):
                raise ValueError(f"{name}: one entry per period (merge the ceilings of a period into one)")
        return self

    def __hash__(self) -> int:
        # Hashed on every call (the key scopes' cache): pydantic's hash walks every field, each time.
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, name) for name in type(self).model_fields))
