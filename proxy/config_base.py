"""The shared base of the configuration's sections: the frozen pydantic model they derive from,
and the constants (limits, units, reserved names) more than one of them reads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from decimal import Decimal
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Self, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MICROS_PER_UNIT = 1_000_000
# The largest figure the store holds exactly (15 digits; pricing.MAX_AMOUNT), and in whole units
# of money: a ceiling or a price per million past it could be neither reserved against nor settled.
MAX_COUNT = 10**15 - 1
MAX_UNITS = Decimal("999999999.999999")
Period = Literal["minute", "hour", "day", "month"]
# Metric label values that stand for many (see metrics): every pass-through caller's tenant
# (``auth``: ``pt-`` and 32 hex digits of its key's digest; 12 before), and every model the config
# does not name exactly. A configured tenant or model named so would merge into them.
PASSTHROUGH_TENANT = "passthrough"
PASSTHROUGH_TENANT_ID = re.compile(r"pt-[0-9a-f]{12}(?:[0-9a-f]{20})?")
OTHER_MODEL = "other"
USERINFO_CUT = (
    "its user name or password holds '/', '?', '#' or '@' (percent-encode them: %2F, %3F, %23, %40)"
)


def userinfo_cut(url: str) -> bool:
    """Whether a '@' after the address's start is not where the address ends: a password with an
    unescaped '/', '?' or '#' ends it early, and what follows reads as port, path or query."""
    return "@" in url.partition("://")[2] and "@" not in urlsplit(url).netloc


def past_six_places(value: Decimal) -> bool:
    """Whether a price or a cost ceiling has a 7th decimal place, however many digits it has.
    Not by scaling it to micro-units: the decimal context (28 digits) rounds a longer figure
    first, and 12.00000000000000000000000000001 passed as 12. Exact here: the fields' bounds
    (``MAX_UNITS``) are checked first, so the quantized figure has at most 15 digits."""
    return value != value.quantize(Decimal("0.000001"))


def whole_micros(value: Decimal, refusal: str) -> int:
    """``value`` in micro-units; ValueError(``refusal``) past 6 decimal places."""
    if past_six_places(value):
        raise ValueError(refusal)
    return int(value * MICROS_PER_UNIT)


def not_a_bool(value: Any, what: str = "a token count") -> Any:
    """A count given as YAML's true/false/yes/no/on/off (read as 1 or 0): refused, for a
    ``mode="before"`` field validator."""
    if isinstance(value, bool):
        raise ValueError(f"{what}, not true or false")
    return value


def a_path_the_system_takes(value: Path) -> Path:
    """``value``, if the system can name a file by it; ValueError if not. A NUL byte (or a
    character no file name encodes) passed check-config, then the start raised a traceback."""
    try:
        named = os.fsencode(value)
    except UnicodeEncodeError:
        raise ValueError("a path no file name can hold (a character the file system cannot encode)") from None
    if b"\0" in named:
        raise ValueError("a path holds no NUL byte")
    return value


_NUMBERS = (int, float, Decimal)


def _takes_a_number_not_a_bool(annotation: Any) -> bool:
    """Whether a field of type ``annotation`` holds a number and never a bool."""
    kinds: list[Any] = [annotation]
    found: set[Any] = set()
    while kinds:
        kind = kinds.pop()
        found.add(kind)
        kinds.extend(get_args(kind))
    return bool not in found and any(kind in found for kind in _NUMBERS)


class Frozen(BaseModel):
    # No YAML .inf or .nan for a number: a timeout or a margin of .inf passed its bounds, and a
    # lease of infinite milliseconds then failed every call.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _number_not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML's true/false/yes/no/on/off are 1 and 0 to a number: a port of 0 (any free one), a
        # pool of one connection, a timeout of a second. A field's own check may say more (first).
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _takes_a_number_not_a_bool(field.annotation):
                raise ValueError("a number, not true or false")
        return value

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled (``serve --workers N`` sends each worker its config) without the values
        derived from fields: computed again where it is read, as ``model_copy``'s are, and some
        cannot be pickled (an upstream's TLS context)."""
        state = super().__getstate__()
        state["__dict__"] = {
            name: value
            for name, value in state["__dict__"].items()
            if not isinstance(getattr(type(self), name, None), cached_property)
        }
        return state

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy whose values derived from fields (the ``cached_property``s, kept in the
        instance's ``__dict__``, which pydantic copies) are computed again from its own."""
        copy = super().model_copy(update=update, deep=deep)
        for klass in type(copy).__mro__:
            for name, attr in vars(klass).items():
                if isinstance(attr, cached_property):
                    copy.__dict__.pop(name, None)
        return copy
