"""Declared field ranges: jaxstream's own checker against pydantic v2, on the same declarations.

The same part of a ``kind: train`` config (seed, steps, batch, targets, the optimizer with its
clip norm and warm-up, the MLP, the digits split, the arms with their learning rates) is
declared twice: with :mod:`jaxstream.ranges` (what the library uses) and as pydantic models
with ``Field`` constraints. Both validate the same bad values; the table shows each one's
message, whether it is one line naming the dotted field and the allowed values, and the time
per validation of the valid config.

    python benchmarks/config_validation.py [--json PATH]     # needs pydantic installed

pydantic is not a dependency of jaxstream; this script only measures it.
"""


import argparse
import dataclasses
import inspect
import json
import sys
import timeit
from pathlib import Path
from typing import Annotated, Any

GOOD: dict[str, Any] = {
    "seed": 0, "steps": 300, "batch_size": 64, "target_accuracy": 0.95,
    "optimizer": {"clip_norm": 1.0, "warmup_steps": 0},
    "model": {"width": 64, "depth": 2}, "data": {"test_fraction": 0.2},
    "arms": [{"name": "backprop", "lr": 0.003}, {"name": "forward", "lr": 0.0003}],
}
BAD: list[tuple[str, Any]] = [
    ("seed", -1), ("steps", 0), ("target_accuracy", 0.0), ("optimizer.clip_norm", float("inf")),
    ("optimizer.warmup_steps", -5), ("model.width", 0), ("data.test_fraction", 1.0),
    ("arms.1.lr", -0.1), ("arms.0.lr", float("nan")), ("batch_size", 2.5),
]


def _set(data: dict, dotted: str, value: Any) -> dict:
    out = json.loads(json.dumps(data))
    node: Any = out
    *head, last = dotted.split(".")
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    node[int(last) if isinstance(node, list) else last] = value
    return out


def ours() -> tuple[type, Any]:
    """The declarations with jaxstream.ranges, loaded by jaxstream's config loader."""
    from jaxstream.experiment.config import from_dict
    from jaxstream.ranges import Checked, Count, Every, Fraction, Positive, Probability, Seed

    @dataclasses.dataclass(frozen=True)
    class Opt(Checked):
        clip_norm: Positive | None = None
        warmup_steps: Every = 0

    @dataclasses.dataclass(frozen=True)
    class Model(Checked):
        width: Count = 64
        depth: Count = 2

    @dataclasses.dataclass(frozen=True)
    class Data(Checked):
        test_fraction: Fraction = 0.2

    @dataclasses.dataclass(frozen=True)
    class Arm(Checked):
        name: str = "backprop"
        lr: Positive = 1e-3

    @dataclasses.dataclass(frozen=True)
    class Train(Checked):
        seed: Seed = 0
        steps: Count = 300
        batch_size: Count = 64
        target_accuracy: Probability = 0.95
        optimizer: Opt = Opt()
        model: Model = Model()
        data: Data = Data()
        arms: tuple[Arm, ...] = (Arm(),)

    return Train, lambda d: from_dict(Train, d)


def theirs() -> tuple[type, Any]:
    """The same declarations as pydantic models (``Field`` constraints, frozen, no extras)."""
    from pydantic import BaseModel, ConfigDict, Field

    cfg = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=False)

    class Opt(BaseModel):
        model_config = cfg
        clip_norm: Annotated[float, Field(gt=0)] | None = None
        warmup_steps: Annotated[int, Field(ge=0)] = 0

    class Model(BaseModel):
        model_config = cfg
        width: Annotated[int, Field(ge=1)] = 64
        depth: Annotated[int, Field(ge=1)] = 2

    class Data(BaseModel):
        model_config = cfg
        test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2

    class Arm(BaseModel):
        model_config = cfg
        name: str = "backprop"
        lr: Annotated[float, Field(gt=0)] = 1e-3

    class Train(BaseModel):
        model_config = cfg
        seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
        steps: Annotated[int, Field(ge=1)] = 300
        batch_size: Annotated[int, Field(ge=1)] = 64
        target_accuracy: Annotated[float, Field(gt=0, le=1)] = 0.95
        optimizer: Opt = Opt()
        model: Model = Model()
        data: Data = Data()
        arms: tuple[Arm, ...] = (Arm(),)

    return Train, Train.model_validate


def _message(load: Any, data: dict) -> str:
    try:
        load(data)
    except Exception as err:  # noqa: BLE001 - both libraries' errors are compared as text
        if hasattr(err, "errors"):  # pydantic: its own error list, as a user would print it
            e = err.errors()[0]
            return f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}, got {e['input']!r}"
        return str(err)
    return "(accepted)"


def _declaration_lines(fn: Any) -> int:
    """Non-blank source lines of the declarations (the class bodies)."""
    src = inspect.getsource(fn).splitlines()
    return sum(1 for line in src if line.strip() and not line.strip().startswith(("\"\"\"", "#",
                                                                                   "from ")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args(argv)
    try:
        import pydantic
    except ImportError:
        print("pydantic is not installed: pip install pydantic (only this script uses it)")
        return 2
    (_, load_ours), (_, load_theirs) = ours(), theirs()
    rows = []
    for dotted, value in BAD:
        data = _set(GOOD, dotted, value)
        a, b = _message(load_ours, data), _message(load_theirs, data)
        rows.append({"field": dotted, "value": repr(value), "jaxstream": a, "pydantic": b})
    n = 2000
    t_ours = min(timeit.repeat(lambda: load_ours(GOOD), number=n, repeat=3)) / n
    t_theirs = min(timeit.repeat(lambda: load_theirs(GOOD), number=n, repeat=3)) / n
    result = {"pydantic_version": pydantic.VERSION, "rows": rows,
              "declaration_lines": {"jaxstream": _declaration_lines(ours),
                                    "pydantic": _declaration_lines(theirs)},
              "us_per_validation": {"jaxstream": t_ours * 1e6, "pydantic": t_theirs * 1e6}}
    print("| field = value | jaxstream | pydantic |\n|---|---|---|")
    for r in rows:
        print(f"| {r['field']} = {r['value']} | {r['jaxstream']} | {r['pydantic']} |")
    for lib in ("jaxstream", "pydantic"):
        named = sum(r[lib].startswith(r["field"] + ":") for r in rows)
        print(f"{lib}: {named}/{len(rows)} refusals start with the dotted field")
    print(f"declaration lines: {result['declaration_lines']}")
    print(f"µs per validation of the valid config: jaxstream {t_ours * 1e6:.1f}, pydantic "
          f"{t_theirs * 1e6:.1f} (ratio {t_ours / t_theirs:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
