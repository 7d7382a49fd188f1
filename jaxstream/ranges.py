"""Declared ranges of numeric fields: one declaration per field, checked in one place.

A field's allowed values are part of its type, ``Annotated[float, Range(...)]``, so the range
is written once, where the field is declared, and :func:`check_fields` (run by every config's
``__post_init__`` through :class:`Checked`) refuses a value outside it with one line naming the
field, the allowed values and the value given. Non-finite floats are refused everywhere. The
aliases below name the ranges the configs share.

Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class Opt(Checked):
    ...     lr: Positive = 1e-3
    ...     b1: Decay = 0.9
    >>> Opt(lr=-1.0)
    Traceback (most recent call last):
    ValueError: lr: must be > 0, got -1.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed values ``lo .. hi`` (either end may be absent, open or closed)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def __str__(self) -> str:
        lo, hi = _num(self.lo), _num(self.hi)
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {hi}"
        return "finite"


def _num(x: float | None) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


#: The ranges the configs share.
Positive = Annotated[float, Range(0.0, lo_open=True)]  # a learning rate, a norm bound, eps
NonNegative = Annotated[float, Range(0.0)]  # a decay weight
Fraction = Annotated[float, Range(0.0, 1.0, lo_open=True, hi_open=True)]  # a split share
Probability = Annotated[float, Range(0.0, 1.0, lo_open=True)]  # an accuracy target, keep prob
Decay = Annotated[float, Range(0.0, 1.0, hi_open=True)]  # b1, b2, momentum
Count = Annotated[int, Range(1)]  # steps, sizes, micro-batches
Every = Annotated[int, Range(0)]  # a period, 0: never
Seed = Annotated[int, Range(0, 2**32 - 1)]  # what JAX keys and NumPy generators take


class FrozenMap(Mapping):
    """A config's mapping field: read-only and hashable (so that a config keys a
    ``functools.lru_cache``), equal to the dict it holds and printed as it."""

    def __init__(self, items: Mapping | None = None):
        self._items = dict(items or {})

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


class Checked:
    """Base of a config dataclass: ``__post_init__`` makes every dict field a
    :class:`FrozenMap` (a frozen config is then hashable), checks every declared range
    (:func:`check_fields`), then the class's own checks across fields (:meth:`check`)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                object.__setattr__(self, f.name, FrozenMap(value))
        check_fields(self)
        self.check()

    def check(self) -> None:
        """Checks across fields (override; raise ValueError naming the field)."""


@functools.cache
def declared(cls: type) -> dict[str, tuple[Any, Range | None]]:
    """``{field: (annotation without ranges, its Range or None)}`` for a dataclass's fields;
    a range inside ``X | None``, ``tuple[X, ...]`` or ``dict[str, X]`` applies to each X."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: _split(hints[f.name]) for f in dataclasses.fields(cls)}


def _split(tp: Any) -> tuple[Any, Range | None]:
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        found = [m for m in meta if isinstance(m, Range)]
        return base, (found[0] if found else None)
    for arg in typing.get_args(tp):
        if arg is not type(None) and arg is not Ellipsis:
            _, found = _split(arg)
            if found is not None:
                return tp, found
    return tp, None


def numeric(tp: Any) -> bool:
    """Whether an annotation holds ints or floats (directly, optionally, or as items)."""
    tp = _split(tp)[0]
    if tp in (int, float):
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType, tuple, list, dict):
        return any(numeric(a) for a in typing.get_args(tp) if a is not Ellipsis)
    return False


def check_fields(obj: Any) -> None:
    """Raise ``ValueError("field: must be RANGE, got VALUE")`` for the first field of dataclass
    ``obj`` outside its declared range (items of tuples and dicts named ``field.i``), not
    finite, or not among its ``Literal`` choices."""
    for name, (tp, rng) in declared(type(obj)).items():
        value = getattr(obj, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
        if typing.get_origin(tp) is Literal and value not in typing.get_args(tp):
            allowed = ", ".join(repr(a) for a in typing.get_args(tp))
            raise ValueError(f"{name}: {value!r} is not allowed; choose one of {allowed}")
        if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}: must be an integer {rng or ''}, got {value!r}")
        if rng is not None:
            _check(name, value, rng, " or null" if type(None) in typing.get_args(tp) else "")


def _check(name: str, value: Any, rng: Range, null: str = "") -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _check(f"{name}.{i}", v, rng)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check(f"{name}.{k}", v, rng)
    elif isinstance(value, (int, float)) and value not in rng:
        raise ValueError(f"{name}: must be {rng}{null}, got {value!r}")
