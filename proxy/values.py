"""Value classes built on every call: frozen to the type checker, plain slots at run time.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (a call, an
argument tuple and a type check per field), where a plain one stores it in its slot directly:
the settlement, usage, estimate, identity and reservation a billed call builds set some 90
fields, 3-5% of a call's instructions (``bench/instr_cost.py``). Declared with ``value_class``,
a class is frozen to mypy (an assignment to a field is refused, as before), and hashed and
compared by its fields as a frozen dataclass is; only the run-time check of an assignment goes,
which mypy makes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

_Class = TypeVar("_Class")


@dataclass_transform(frozen_default=True)
def value_class(*, kw_only: bool = False) -> Callable[[type[_Class]], type[_Class]]:
    """``@dataclass(frozen=True, slots=True, kw_only=kw_only)`` to mypy; at run time the same
    without the per-field ``object.__setattr__`` (``unsafe_hash``: the hash frozen makes)."""

    def make(cls: type[_Class]) -> type[_Class]:
        return dataclass(slots=True, unsafe_hash=True, kw_only=kw_only)(cls)

    return make
