"""Walk every numeric field of every shipped config with hostile values; count what is refused.

For each ``experiments/*.yaml`` and each numeric field of its resolved config (every section,
every arm, optional fields left at null, the optimizer options the optimizer takes), the walk
sets the field to NaN, ±inf, -1, 0, 0.5, 1e12 and 10**12 by a dotted override and runs every
check ``jaxstream run`` runs before it writes anything (the config's ranges and cross-field
checks, then ``check_run``: the batch against the data set, the memory estimate, the stores).
A case is *refused* (a ``ValueError`` naming the field, one line) or *accepted*. Every accepted
value is printed beside the field's declared range, so a reader can judge whether the range
says what the field means.

    python benchmarks/config_walk.py [--json PATH] [--configs quickstart.yaml ...]

The test ``tests/experiment/test_ranges.py`` runs the same walk on two configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VALUES: tuple[Any, ...] = (math.nan, math.inf, -math.inf, -1, 0, 0.5, 1e12, 10**12)


def _yaml(v: Any) -> str:
    if isinstance(v, float) and math.isnan(v):
        return ".nan"
    if isinstance(v, float) and math.isinf(v):
        return ".inf" if v > 0 else "-.inf"
    return repr(v)


def numeric_paths(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted path: its declared Range (None: none declared)}`` of every numeric field under
    ``cfg``."""
    from jaxstream.experiment.optimizers import OPTION_RANGES, OptimizerConfig, optimizer_factory
    from jaxstream.ranges import declared, numeric

    out: dict[str, str] = {}
    if not dataclasses.is_dataclass(cfg):
        return out
    for name, (tp, rng) in declared(type(cfg)).items():
        value, path = getattr(cfg, name), f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            out.update(numeric_paths(value, path + "."))
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                out.update(numeric_paths(item, f"{path}.{i}."))
        elif numeric(tp) and name != "options":
            if isinstance(value, (tuple, list)):
                out.update({f"{path}.{i}": rng for i in range(len(value))})
            elif isinstance(value, Mapping):
                out.update({f"{path}.{k}.0": rng for k in value})
            else:
                out[path] = rng
    if isinstance(cfg, OptimizerConfig):
        params = inspect.signature(optimizer_factory(cfg.name)).parameters
        out.update({f"{prefix}options.{k}": r for k, r in OPTION_RANGES.items()
                    if k in params})
    return out


def try_case(path: Path, overrides: list[str]) -> str | None:
    """None if every pre-write check accepts the config, else the refusal's one line."""
    from jaxstream.experiment.data_configs import forget_datasets
    from jaxstream.experiment.registry import load_experiment

    try:
        _, cfg = load_experiment(path, overrides)
        check_run = getattr(cfg, "check_run", None)
        if check_run is not None:
            check_run(resume=False)
    except ValueError as err:
        return str(err)
    finally:
        forget_datasets()
    return None


def walk(configs: list[Path], values: tuple[Any, ...] = VALUES) -> dict[str, Any]:
    """Every (config, field, value) case: refused or accepted, with the refusals' lines."""
    from jaxstream.experiment.registry import load_experiment

    cases, accepted, unnamed = 0, defaultdict(list), []
    ranges: dict[str, str] = {}
    for path in configs:
        _, cfg = load_experiment(path)
        for field, rng in numeric_paths(cfg).items():
            ranges[f"{path.name}:{field}"] = str(rng)
            for v in values:
                cases += 1
                err = try_case(path, [f"{field}={_yaml(v)}"])
                if err is None:
                    accepted[f"{path.name}:{field}"].append(v)
                elif "\n" in err or not (field.split(".")[-1] in err or
                                          field.startswith(err.split(":", 1)[0])):
                    unnamed.append({"config": path.name, "field": field, "value": _yaml(v),
                                    "error": err})
    n_acc = sum(len(v) for v in accepted.values())
    return {"cases": cases, "refused": cases - n_acc, "accepted": n_acc,
            "refused_without_naming_the_field": unnamed,
            "accepted_by_field": {k: {"range": ranges[k], "values": [_yaml(x) for x in v]}
                                  for k, v in accepted.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", help="file names under experiments/ (default: all)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # meshes
    names = args.configs or sorted(p.name for p in (ROOT / "experiments").glob("*.yaml"))
    result = walk([ROOT / "experiments" / n for n in names])
    print(f"{result['cases']} cases: {result['refused']} refused, {result['accepted']} accepted, "
          f"{len(result['refused_without_naming_the_field'])} refused without naming the field")
    print("\n| config:field | declared range | accepted values |\n|---|---|---|")
    for k, v in result["accepted_by_field"].items():
        print(f"| {k} | {v['range']} | {', '.join(v['values'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
