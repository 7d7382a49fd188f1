"""Unequal pipeline stages placed from device speeds and by layer type, on modelled devices.

Simulated CPU devices are equally fast, so device speeds are modelled: each layer's time is
measured once on this machine (``measure_layer_costs``), and stage s's time is the sum of its
layers' times over its modelled speed (1, 1, 2, 4), or, for the layer-type policy, over its
device kind's rate for each layer's type. For each policy the table gives the layers per stage
and the slowest stage over the mean (1.0 = balanced); then the placed split runs as a pipeline
(``unequal_stages``) and its backprop gradient is compared with ``jax.grad`` of the sequential
model (max relative error).

Usage:
  python benchmarks/unequal_stages.py --json unequal.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np

import jaxstream.grad as jg
from jaxstream.experiment.docblock import machine
from jaxstream.models import mlp
from jaxstream.pipeline import gpipe_backprop, unequal_stages
from jaxstream.pipeline.executor import pipeline
from jaxstream.placement import (
    evaluate_split,
    measure_layer_costs,
    place_by_type,
    place_stages,
    type_times,
    uniform_placement,
)
from jaxstream.quality.metrics import max_rel_err

SPEEDS = (1.0, 1.0, 2.0, 4.0)
# two device kinds, each faster at one layer type (work per second, relative)
KINDS = ("matmul", "matmul", "vector", "vector")
RATES = {("matmul", "dense"): 4.0, ("matmul", "activation"): 0.5,
         ("vector", "dense"): 1.0, ("vector", "activation"): 4.0}


def measured_layers(width: int, batch: int) -> tuple[list[str], np.ndarray]:
    """Sixteen layers alternating dense (width × width) and a heavy elementwise activation
    (ten transcendental passes): their types and measured times (s)."""
    w = jnp.ones((width, width), jnp.float32) / width
    x = jnp.ones((batch, width), jnp.float32)

    def dense(x):
        return x @ w

    def activation(x):
        for _ in range(10):
            x = jnp.tanh(x) + jnp.sin(x)
        return x

    types = ["dense", "activation"] * 8
    fns = [dense if t == "dense" else activation for t in types]
    return types, measure_layer_costs(fns, [(x,)] * len(fns), repeats=20)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    types, t = measured_layers(args.width, args.batch)
    rows = []
    even = uniform_placement(t, SPEEDS)
    placed = place_stages(t, SPEEDS)
    rows += [{"policy": "even split, speeds 1,1,2,4", **_row(even)},
             {"policy": "place_stages, speeds 1,1,2,4", **_row(placed)}]
    times = type_times(types, t, KINDS, RATES)
    rows += [{"policy": "even split, kinds by type", **_row(evaluate_split(times, even.sizes))},
             {"policy": "place_stages (speeds 1,1,2,4), kinds by type",
              **_row(evaluate_split(times, placed.sizes))},
             {"policy": "place_by_type, kinds by type", **_row(place_by_type(types, t, KINDS,
                                                                           RATES))}]
    # the placed split as a pipeline: its gradient against the sequential model's
    stack = mlp(in_dim=8, width=16, depth=16, num_classes=4)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    micro = {"x": jnp.asarray(rng.standard_normal((4, 8, 8)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 4, (4, 8)), jnp.int32)}
    padded, pad, unpad = unequal_stages(stack, placed.sizes)
    _, g = pipeline(padded, gpipe_backprop(4, 4), jg.backprop())(pad(params), micro,
                                                                 jax.random.key(0))[:2]
    want = jax.grad(lambda p: jnp.mean(jax.vmap(lambda b: stack(p, b))(micro)))(params)
    err = float(max_rel_err(unpad(g), want))
    out = {"command": "python benchmarks/unequal_stages.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": machine(),
        "layer_times_ms": [1e3 * x for x in t], "layer_types": types, "speeds": SPEEDS,
        "kinds": KINDS, "rates": {f"{k}/{t}": v for (k, t), v in RATES.items()},
        "rows": rows, "pipeline_sizes": list(placed.sizes),
        "pipeline_grad_max_rel_err": err}
    print(f"{'policy':48s} {'sizes':16s} {'slowest/mean':>12s} {'slowest ms':>10s}")
    for r in rows:
        print(f"{r['policy']:48s} {r['sizes']!s:16s} {r['balance']:12.3f} "
              f"{r['slowest_ms']:10.3f}")
    print(f"pipeline over {placed.sizes}: backprop max rel err vs sequential {err:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _row(p) -> dict:
    return {"sizes": list(p.sizes), "balance": p.balance, "slowest_ms": 1e3 * p.slowest,
            "stage_ms": [1e3 * x for x in p.stage_times]}


if __name__ == "__main__":
    main()
