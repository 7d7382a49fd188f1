"""Bias of the hybrid corrections with a fixed and with a random selection of exact micro-batches.

    python benchmarks/weighted_bias.py --quick --json /tmp/weighted_bias.json

For each correction and selection (fixed or random, 1 or 2 exact), R estimates with different keys on one batch (digits, a small
MLP so that R estimates resolve the bias, N = 8 micro-batches, 2 exact, K = 8); relative bias = ‖mean_r ĝ_r − g‖ / ‖g‖ with g the exact batch
gradient, next to its noise floor ‖std_r ĝ_r‖ / (√R ‖g‖) (a bias below the floor is not
measurable). ``weighted`` shrinks the tangent part that corrects h towards the batch mean, so with
a fixed selection it keeps a share of h's deviation: biased. A random selection averages it out.
``stein`` takes its weight from the residual's own size (positive-part James–Stein), which sees
a fixed selection's systematic deviation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np

import jaxstream.grad as jg
from jaxstream.data.digits import load_digits
from jaxstream.experiment.docblock import machine, write_tables
from jaxstream.models import mlp

CORRECTIONS = ("replace", "control_variate", "weighted", "stein", "guess")


def flat(tree) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def problem(name: str) -> tuple:
    """(stack, micro-batched batch, K, a phrase saying what it is)."""
    if name == "digits":
        n, per = 8, 16
        train = load_digits(seed=0).train
        micro = {"x": jnp.asarray(train["x"][: n * per]).reshape(n, per, -1),
                 "y": jnp.asarray(train["y"][: n * per], jnp.int32).reshape(n, per)}
        return (mlp(in_dim=64, width=4, depth=1, num_classes=10), micro, 8,
                "digits, MLP 64-4-10, N = 8 micro-batches, K = 8")
    n, per = 6, 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, per, 5)).astype(np.float32)
    x[0] *= 6.0  # one outlying micro-batch: whether it is selected moves h and the spread
    micro = {"x": jnp.asarray(x), "y": jnp.asarray(rng.integers(0, 3, (n, per)), jnp.int32)}
    return (mlp(in_dim=5, width=4, depth=1, num_classes=3), micro, 4,
            "Gaussian inputs with micro-batch 0 scaled by 6, MLP 5-4-3, N = 6 micro-batches, K = 4")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer keys (R = 4096 instead of 32768)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--problem", choices=("digits", "outlier"), default="digits",
                    help="digits: an MLP 64-4-10 on digits, N = 8; outlier: an MLP 5-4-3 on "
                         "Gaussian inputs, N = 6, micro-batch 0's inputs scaled by 6 (a spread "
                         "that moves with the selection)")
    ap.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=CORRECTIONS,
                    help="corrections to measure (default: all)")
    ap.add_argument("--doc", type=str, default=None,
                    help="rewrite this Markdown file's <!-- benchmark: weighted_bias.py bias --> block")
    args = ap.parse_args(argv)
    r = 4096 if args.quick else 32768
    stack, micro, k, setting = problem(args.problem)
    params = stack.init(jax.random.key(0))
    flat_batch = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), micro)
    g = flat(jax.grad(stack)(params, flat_batch))
    keys = jax.random.split(jax.random.key(1 if args.problem == "digits" else 11), r)
    rows = []
    for correction in args.corrections:
        for selection, exact, est in (
                ("fixed", 2, jg.hybrid(exact_indices=(0, 1), correction=correction, num_tangents=k)),
                ("random", 2, jg.hybrid(num_exact=2, correction=correction, num_tangents=k)),
                ("fixed", 1, jg.hybrid(exact_indices=(0,), correction=correction, num_tangents=k)),
                ("random", 1, jg.hybrid(num_exact=1, correction=correction, num_tangents=k))):
            samples = jax.jit(lambda ks, est=est: jax.lax.map(
                lambda k: flat(est(stack, params, micro, k)[1]), ks))(keys)
            mean, std = samples.mean(0), samples.std(0)
            bias = float(jnp.linalg.norm(mean - g) / jnp.linalg.norm(g))
            floor = float(jnp.linalg.norm(std) / (np.sqrt(r) * jnp.linalg.norm(g)))
            rows.append({"correction": correction, "selection": selection, "exact": exact,
                         "keys": r, "relative_bias": bias, "noise_floor": floor,
                         "bias_over_floor": bias / floor})
            print(f"{correction:>16} {selection:>7} {exact} exact  bias {bias:.4f}  (floor "
                  f"{floor:.4f}, {bias / floor:.1f}x)", flush=True)
    md = ["| correction | selection | exact | relative bias | noise floor | bias / floor |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['correction']} | {r['selection']} | {r['exact']} | {r['relative_bias']:.4f} | "
           f"{r['noise_floor']:.4f} | {r['bias_over_floor']:.1f} |" for r in rows]
    md.append(f"\nR = {rows[0]['keys']} keys per row; {setting}. The noise floor is ‖std‖ / (√R ‖g‖): a bias near it is not resolved; "
              "about 4 floors and more is.")
    if args.doc:
        cmd = "python benchmarks/weighted_bias.py" + (" --quick" if args.quick else "")
        block = "bias" if args.problem == "digits" else "bias_outlier"
        cmd += f" --problem {args.problem}"
        write_tables(args.doc, "weighted_bias.py", {block: "\n".join(md)},
                     f"{cmd} --doc {args.doc}", keep=("bias", "bias_outlier"))
    out = {"rows": rows, "machine": machine()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
