"""How pydantic reads a config: jaxstream's scalar rules in its schema, its errors in one line.

pydantic v2 builds a config's dataclasses, nested sections, lists, tuples, mappings, unions,
literals, defaults, unknown and missing keys (``extra="forbid"``). Two things it does not do as
a config needs (``benchmarks/config_library.py`` measures each loader):

* **scalars**: its lax mode reads ``steps: true`` as 1 and ``shuffle: "yes"`` as true; its
  strict mode refuses ``2.0`` for an int and YAML 1.1's ``1e-3`` (a string) for a float.
  :func:`strict_scalars` puts jaxstream's rule for each scalar into the generated schema;
* **messages**: :func:`message` turns its first error into one line naming the dotted field
  and what is allowed (``optim.lr: expected float, got 'abc'``).

Example:
    >>> adapter = pydantic.TypeAdapter(tuple[Opt], config=CONFIG)
    >>> schema = strict_scalars(adapter.core_schema)
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import pydantic
from pydantic_core import core_schema as cs

#: every section refuses an unknown key; a type pydantic has no schema for is checked by
#: ``isinstance``
CONFIG = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False,
                             arbitrary_types_allowed=True)


# ------------------------------------------------------------------------- scalar rules
def read_int(v: Any) -> int:
    """An int: an integer, or a float with no fraction (``2.0``); never a bool or a string."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise ValueError(f"expected int, got {v!r}")


def read_float(v: Any) -> float:
    """A finite float: a number, or a string YAML 1.1 left unparsed (``1e-3``); not a bool."""
    number = None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        number = float(v)
    elif isinstance(v, str):
        try:
            number = float(v)
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"expected float, got {v!r}")
    if not math.isfinite(number):  # no field of a run means anything at NaN or ±inf
        raise ValueError(f"expected a finite number, got {v!r}")
    if abs(number) > FLOAT32_MAX:  # runs compute in float32, where it would be ±inf
        raise ValueError(f"{number!r} is inf in float32 (training's precision); allowed: "
                         f"magnitudes up to {FLOAT32_MAX:.4g}")
    if 0 < abs(number) < FLOAT32_TINY:  # ... or 0 (a learning rate that trains nothing)
        raise ValueError(f"{number!r} underflows float32 (training's precision: it is 0 or "
                         f"subnormal there); allowed: 0 or magnitudes from {FLOAT32_TINY:.4g}")
    return number


#: The largest finite float32: every float field's bound (a run computes in float32).
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest normal float32: a nonzero float field's lower bound.
FLOAT32_TINY = 1.1754943508222875e-38
#: How :func:`read_float` starts refusing a number (not a non-number): a union says only this.
NUMBER_REFUSALS = ("expected a finite number", "inf in float32", "underflows float32")


def read_bool(v: Any) -> bool:
    """A YAML boolean only (not ``1``, not ``"yes"``)."""
    if isinstance(v, bool):
        return v
    raise ValueError(f"expected bool (true/false), got {v!r}")


def read_str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise ValueError(f"expected str, got {v!r}")


def read_literal(expected: list) -> Callable[[Any], Any]:
    """One of ``expected``, of the same type (``true`` is not the literal ``1``)."""
    allowed = ", ".join(repr(a) for a in expected)

    def read(v: Any) -> Any:
        for a in expected:
            if a == v and type(a) is type(v):
                return a
        raise ValueError(f"{v!r} is not allowed; choose one of {allowed}")

    return read


_READERS = {"int": read_int, "float": read_float, "bool": read_bool, "str": read_str}
_CHILDREN = ("schema", "items_schema", "keys_schema", "values_schema", "choices", "fields",
             "definitions", "steps")


def strict_scalars(schema: Any) -> Any:
    """``schema`` (a pydantic core schema) with every plain scalar and literal read by
    jaxstream's rules; a union's members are labelled by their scalar's name."""
    if isinstance(schema, list):
        return [strict_scalars(s) for s in schema]
    if isinstance(schema, tuple):  # (schema, label) of a union's choice
        return (strict_scalars(schema[0]), *schema[1:])
    if not isinstance(schema, dict) or "type" not in schema:
        return schema
    kind = schema["type"]
    if kind in _READERS:
        rule = cs.no_info_plain_validator_function(_READERS[kind])
        if set(schema) <= {"type", "metadata"}:
            return rule
        return cs.chain_schema([rule, {**schema, "strict": True}])  # then its constraints
    if kind == "literal":
        return cs.no_info_plain_validator_function(read_literal(list(schema["expected"])))
    out = dict(schema)
    for key in _CHILDREN:
        if key not in out:
            continue
        value = out[key]
        if kind == "union" and key == "choices":
            out[key] = [_labelled(c) for c in value]
        elif isinstance(value, dict) and "type" not in value:  # a tagged union's choices
            out[key] = {k: strict_scalars(v) for k, v in value.items()}
        else:
            out[key] = strict_scalars(value)
    return out


def _labelled(choice: Any) -> tuple:
    """A union's choice with its label (:func:`label` finds the member by it)."""
    schema = choice[0] if isinstance(choice, tuple) else choice
    if isinstance(choice, tuple):
        name = choice[1]
    elif schema.get("type") == "dataclass":
        name = schema["cls"].__name__
    else:
        name = schema.get("type", "?")
    return strict_scalars(schema), name


# ------------------------------------------------------------------------------- messages
def fmt(tp: Any) -> str:
    """An annotation as a message names it (``int``, ``tuple[int, ...]``, ``null``)."""
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def where(path: str) -> str:
    return path or "<config>"


@dataclasses.dataclass
class Located:
    """What an error's ``loc`` points at: the dotted path, the annotation there, and the
    dataclass the last key belongs to (for an unknown or missing key)."""

    path: str
    tp: Any
    owner: type | None = None
    hint: Any = None  # the annotation as written (``int | None``)
    union: int | None = None  # index in ``loc`` of the first union member's label
    choices: list = dataclasses.field(default_factory=list)  # (path, tag) of each choice


def label(tp: Any) -> str:
    """The label :func:`strict_scalars` gives union member ``tp`` (its scalar's, container's
    or dataclass's name; ``literal``)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "literal"
    return origin.__name__ if isinstance(origin, type) else fmt(tp)


def locate(tp: Any, loc: tuple, path: str, choices: Mapping[type, Mapping[str, type]],
           hints: Callable[[type], dict]) -> Located:
    """Walk ``loc`` from annotation ``tp``: a dataclass's field, a choice's tag (dropped from
    the path), a union member's label (dropped), a list index or a mapping key."""
    owner, union, passed = None, None, []
    for i, part in enumerate(loc):
        tp = strip(tp)
        if tp in choices and isinstance(part, str) and part in choices[tp]:
            tp = choices[tp][part]
            passed.append((path, part))
            continue
        if _is_union(tp):
            named = {label(m): m for m in typing.get_args(tp) if m is not type(None)}
            if part in named:
                tp = named[part]
                union = i if union is None else union
                continue
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            owner = tp
            tp = hints(tp).get(part, Any)
        else:
            tp = _step(tp, part)
        path = f"{path}.{part}" if path else str(part)
    return Located(path, strip(tp), owner, tp, union, passed)


def strip(tp: Any) -> Any:
    """``X`` of ``Annotated[X, ...]`` and of ``X | None``."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _step(tp: Any, part: Any) -> Any:
    """The annotation of item ``part`` of container annotation ``tp``."""
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = members[0] if len(members) == 1 else tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (tuple, list):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return args[part] if isinstance(part, int) and part < len(args) else Any
        return args[0] if args else Any
    if origin is dict:
        return args[1] if args else Any
    return Any


UNKNOWN = ("unexpected_keyword_argument", "extra_forbidden")


def first_error(errors: list[dict]) -> dict:
    """The error a user sees first: a section's unknown key before any error inside the same
    section (the keys are checked before the values), else the first in field order."""
    first = errors[0]
    for e in errors:
        if e["type"] in UNKNOWN and tuple(first["loc"][:len(e["loc"]) - 1]) == e["loc"][:-1]:
            return e
    return first


def message(err: dict, at: Located, fields: Mapping[str, Any]) -> str:
    """One line for pydantic error ``err`` located at ``at``; ``fields``: the init fields of
    the section the error is in (``at.owner``, or the section at ``at`` for its own checks)."""
    kind, value, path = err["type"], err.get("input"), at.path
    if kind in UNKNOWN:
        return (f"{path}: unknown key for {at.owner.__name__ if at.owner else '?'}; allowed "
                f"keys: {', '.join(fields)}")
    if kind in ("missing_argument", "missing"):
        return f"{path}: required field is missing ({fmt(at.hint)})"
    if kind == "value_error":
        msg = str(err["ctx"]["error"])
        if msg.startswith("."):  # a choice's ".type: ..." (the tag is the section's key)
            return f"{where(path)}{msg}"
        head = msg.split(":", 1)[0].split(".", 1)[0]
        if path and head in fields:
            return f"{path}.{msg}"  # "num_tangents: ..." -> "arms.0.estimator.num_tangents: ..."
        if (path and msg.startswith(path)) or head in fields:
            return msg
        return f"{where(path)}: {msg}"
    if kind == "dataclass_type":
        return f"{where(path)}: expected a mapping for {fmt(at.tp)}, got {value!r}"
    if kind in ("tuple_type", "list_type", "iterable_type"):
        return f"{where(path)}: expected a list ({fmt(at.tp)}), got {value!r}"
    if kind in ("too_short", "too_long"):
        return f"{where(path)}: expected {len(typing.get_args(at.tp))} items, got {len(value)}"
    if kind in ("dict_type", "mapping_type"):
        return f"{where(path)}: expected a mapping, got {value!r}"
    if kind == "is_instance_of":
        return f"{where(path)}: expected {fmt(at.tp)}, got {value!r}"
    return f"{where(path)}: {err['msg']}, got {value!r}"
