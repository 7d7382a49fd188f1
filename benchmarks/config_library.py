"""What a config library would change: the same values through jaxstream's loader, pydantic v2
(lax and strict) and draccus, side by side.

jaxstream's configs are frozen dataclasses read by ``jaxstream.experiment.config.from_dict``
(pydantic, with jaxstream's rule for each scalar). What would pydantic's own modes, or draccus,
make of the same values: would every config load the same, would every refusal still name the
field? This runs each probe value
of each field type, and each structural probe (an unknown key, a misspelt one, a missing one,
a bad value two sections deep, a section that keeps its default's type), through every loader
and prints what each one makes of it: the value it builds, or "refused". A cell that differs
from jaxstream's is marked; "silent" marks a value jaxstream refuses and a library turns into
a value of the field's type (a ``true`` read as ``steps: 1``).

    pip install draccus   # not a dependency of jaxstream (pydantic is)
    python benchmarks/config_library.py [--json PATH] [--doc docs/experiments.md]

A library that is not installed gets no column.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import operator
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from jaxstream.experiment.config import from_dict

#: (annotation as written in a config class, the annotation, the values a YAML file can give)
SCALARS: list[tuple[str, Any, list[Any]]] = [
    ("int", int, [2, 2.0, 2.5, "2", True, None]),
    ("float", float, [0.001, 1, "1e-3", "abc", True, math.nan, math.inf]),
    ("bool", bool, [True, "yes", "true", 1, 0]),
    ("str", str, ["adam", 3, True]),
    ("Literal['adam', 'sgd']", Literal["adam", "sgd"], ["sgd", "SGD", 1]),
    ("Literal[1, 2]", Literal[1, 2], [1, True, 1.0, "1"]),
    ("tuple[int, ...]", tuple[int, ...], [[1, 2], [1, "2"], [True], "12"]),
    ("int | None", int | None, [None, 3, "null"]),
    ("dict[str, float]", dict[str, float], [{"a": 1}, {"a": "x"}, [1]]),
]


# ------------------------------------------------------------------------------- loaders
def _field_class(tp: Any, frozen: bool = True) -> type:
    return dataclasses.make_dataclass("Section", [("x", tp)], frozen=frozen)


def ours(cls: type, data: dict) -> Any:
    return from_dict(cls, data)


def _pydantic(strict: bool) -> Callable[[type, dict], Any] | None:
    try:
        import pydantic
    except ImportError:
        return None

    def load(cls: type, data: dict) -> Any:
        # a plain dataclass ignores unknown keys unless told; finite numbers as jaxstream.
        # Strict: every scalar field strict (StrictInt, ...): a config-wide strict=True
        # refuses every mapping given for a dataclass section.
        cls = _strict_class(cls) if strict else cls
        config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
        for c in _classes(cls):
            c.__pydantic_config__ = config
        return pydantic.TypeAdapter(cls).validate_python(data)

    return load


def _strict(tp: Any) -> Any:
    """``tp`` with int, float, bool and str replaced by pydantic's strict types."""
    import pydantic

    scalars = {int: pydantic.StrictInt, float: pydantic.StrictFloat,
               bool: pydantic.StrictBool, str: pydantic.StrictStr}
    if tp in scalars:
        return scalars[tp]
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _strict_class(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is None or origin is Literal or not args:
        return tp
    new = tuple(a if a is Ellipsis else _strict(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, new)
    return origin[new]


def _strict_class(cls: type) -> type:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _strict(hints[f.name]), dataclasses.field(default=f.default))
              if f.default is not dataclasses.MISSING else (f.name, _strict(hints[f.name]))
              for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, fields)


def _draccus() -> Callable[[type, dict], Any] | None:
    try:
        from draccus.parsers.decoding import decode
    except ImportError:
        return None
    return lambda cls, data: decode(cls, data)


def _classes(cls: type) -> list[type]:
    out = [cls]
    for tp in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out += _classes(tp)
    return out


def loaders() -> dict[str, Callable[[type, dict], Any]]:
    """The loaders this machine has: jaxstream's, pydantic lax and strict, draccus."""
    found = {"jaxstream": ours, "pydantic (lax)": _pydantic(False),
             "pydantic (strict)": _pydantic(True), "draccus": _draccus()}
    return {k: v for k, v in found.items() if v is not None}


# -------------------------------------------------------------------------------- probes
def outcome(load: Callable, cls: type, data: dict, field: str = "x") -> dict:
    """What ``load`` makes of ``data``: the built field's value, or the refusal's message."""
    try:
        built = load(cls, data)
    except Exception as e:  # noqa: BLE001 - a library's refusal is of its own type
        return {"accepted": False, "message": " ".join(str(e).split())}
    value = built
    for name in field.split("."):
        value = getattr(value, name)
    return {"accepted": True, "value": value}


def cell(got: dict, ref: dict) -> str:
    """A probe's cell: the value built (or "refused"); ≠ where it differs from jaxstream's,
    "silent" where jaxstream refuses and this loader builds a value."""
    text = repr(got["value"]) if got["accepted"] else "refused"
    if got == ref or (got["accepted"] == ref["accepted"] is False):
        return text
    if got["accepted"] and not ref["accepted"]:
        return f"**{text}** (silent)"
    return f"**{text}** ≠"


@dataclasses.dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    b1: float = 0.9


@dataclasses.dataclass(frozen=True)
class Arm:
    optim: Optim = Optim(b1=0.5)  # a default section whose values are not the class's
    steps: int = 10


@dataclasses.dataclass(frozen=True)
class Needs:
    steps: int


#: (what is probed, class, data, field read back, whether a refusal must name a field)
STRUCTURE: list[tuple[str, type, dict, str, str | None]] = [
    ("unknown key `stpes: 5`", Arm, {"stpes": 5}, "steps", "stpes"),
    ("missing required `steps`", Needs, {}, "steps", "steps"),
    ("bad value two sections deep `optim.lr: abc`", Arm, {"optim": {"lr": "abc"}}, "optim.lr",
     "optim.lr"),
    ("a partial section keeps its default's other values `optim: {lr: 0.1}` (b1: 0.5)",
     Arm, {"optim": {"lr": 0.1}}, "optim.b1", None),
]


def names(message: str, dotted: str) -> bool:
    """Whether a refusal names the dotted field (as ``optim.lr``, draccus' `` `optim.lr` `` or
    pydantic's ``optim.lr`` line)."""
    return dotted in message


def run() -> dict:
    """Every probe through every loader on this machine."""
    found = loaders()
    rows = []
    for label, tp, values in SCALARS:
        classes = {k: _field_class(tp, frozen=(k == "jaxstream")) for k in found}
        for v in values:
            got = {k: outcome(load, classes[k], {"x": v}) for k, load in found.items()}
            rows.append({"field": label, "value": v, "outcomes": got})
    structure = []
    for label, cls, data, field, dotted in STRUCTURE:
        got = {k: outcome(load, cls, data, field) for k, load in found.items()}
        for o in got.values():
            if dotted is not None and not o["accepted"]:
                o["names_field"] = names(o["message"], dotted)
        structure.append({"probe": label, "outcomes": got})
    return {"loaders": list(found), "rows": rows, "structure": structure,
            "versions": versions()}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for mod in ("pydantic", "draccus"):
        try:
            out[mod] = version(mod)
        except PackageNotFoundError:
            pass
    return out


def _value(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return ".nan" if math.isnan(v) else ".inf"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def table(doc: dict) -> str:
    """Markdown: one row per probe value, one column per loader; a count of differences."""
    names_ = doc["loaders"]
    out = ["| field | YAML value | " + " | ".join(names_) + " |",
           "|---|---|" + "---|" * len(names_)]
    differ = {k: 0 for k in names_}
    silent = {k: 0 for k in names_}
    for r in doc["rows"]:
        ref = r["outcomes"]["jaxstream"]
        cells = []
        for k in names_:
            c = cell(r["outcomes"][k], ref)
            differ[k] += "**" in c
            silent[k] += "(silent)" in c
            cells.append(c)
        out.append(f"| `{r['field']}` | `{_value(r['value'])}` | " + " | ".join(cells) + " |")
    for s in doc["structure"]:
        ref = s["outcomes"]["jaxstream"]
        cells = []
        for k in names_:
            o = s["outcomes"][k]
            if o["accepted"]:
                c = cell(o, ref)
            else:
                c = "refused" + ("" if o.get("names_field", True) else ", **field not named**")
            differ[k] += "**" in c
            silent[k] += "(silent)" in c
            cells.append(c)
        out.append(f"| {s['probe']} | | " + " | ".join(cells) + " |")
    out.append("| **cells that differ from jaxstream's** | | "
               + " | ".join(f"**{differ[k]}** ({silent[k]} silent)" for k in names_) + " |")
    libs = ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) or "none installed"
    out += ["", f"Libraries: {libs}; pydantic with `extra='forbid', allow_inf_nan=False`."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write every outcome (with messages) here")
    p.add_argument("--doc", help="write the table into this doc's generated block")
    args = p.parse_args(argv)
    doc = run()
    text = table(doc)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=repr)
    if args.doc:
        from jaxstream.experiment.docblock import write_tables

        command = "python benchmarks/config_library.py " + " ".join(argv or sys.argv[1:])
        write_tables(args.doc, "config_library.py", {"coercion": text}, command)
    return doc


if __name__ == "__main__":
    main()
