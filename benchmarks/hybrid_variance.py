"""The hybrid variance model (:mod:`jaxstream_lab.hybrid_variance`) on the lab's digits MLP:
model against measured E‖ĝ − g‖², the regime where a hybrid would beat both its ingredients at
equal compute, and a paired training comparison there.

Usage:
  python benchmarks/hybrid_variance.py                         # digits, N = 8, S = 2, K = 1
  python benchmarks/hybrid_variance.py --json hv.json --doc docs/hybrid_variance.md

(a) On the forward table's digits model (mlp 64-64x2-10, tanh) at initialisation and one batch
of 64 split into N micro-batches, each estimator's E‖ĝ − g‖² over ``--keys`` keys (one compiled
program) against the model, with the difference in Monte-Carlo standard errors.
(b) The costs, in forward passes of the batch, counted by
:func:`jaxstream.quality.flops.matmul_flops`; then for N in 2..64 (the same 64 examples) and S,
each hybrid's model MSE against the exact subset and the forward-only estimate bought with the
same compute, and ρ*, the correlation a forward part would need for the best fixed-β hybrid to
beat that subset.
(c) ``--seeds`` seeds of training in the point of (b) closest to a win: the hybrid against the
exact subset at equal compute and at its own S, paired by seed (same init, batches and keys),
test error at the end, Student's paired t (:mod:`jaxstream_lab.verdicts`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import jaxstream.grad as jg
from jaxstream.data.digits import load_digits
from jaxstream.models import mlp
from jaxstream.quality.baselines import MicrobatchForward
from jaxstream.quality.flops import matmul_flops
from jaxstream_lab import hybrid_variance as hv

BATCH = 64
CORRECTIONS = ("replace", "control_variate", "weighted", "stein", "guess")
NS = (2, 4, 8, 16, 32, 64)


def flat(tree) -> jax.Array:
    return ravel_pytree(tree)[0]


def setup(seed: int = 0):
    """The forward table's digits model at init and the first batch of 64 train examples."""
    ds = load_digits(seed=0)
    stack = mlp(64, 64, 2, 10, "tanh")
    params = stack.init(jax.random.key(seed))
    batch = {k: jnp.asarray(v[:BATCH]) for k, v in ds.train.items()}
    return ds, stack, params, batch


def micro(batch: dict, n: int) -> dict:
    return jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)


def example_grads(stack, params, batch) -> np.ndarray:
    """(64, P) per-example gradients, float64: any N's micro-batch gradients are group means."""
    one = jax.vmap(lambda x, y: flat(jax.grad(stack)(params, {"x": x[None], "y": y[None]})))
    return np.asarray(one(batch["x"], batch["y"]), np.float64)


def group(per_example: np.ndarray, n: int) -> np.ndarray:
    return per_example.reshape(n, -1, per_example.shape[1]).mean(1)


# ----------------------------------------------------------------------------- (a) the lab's
def model_rows(grads: np.ndarray, seg: np.ndarray, s: int, k: int) -> dict[str, float]:
    m = hv.moments(grads)
    nu = hv.noise_ratio(m.size, k)
    return {"exact_subset": hv.exact_subset(m, s), "forward": hv.forward_batch(m, nu),
            "forward_micro": hv.forward_micro(m, nu), "replace": hv.replace(m, s, nu),
            "control_variate": hv.control_variate(m, s, nu),
            "weighted": hv.weighted(m, s, nu, hv.weighted_beta(m.num, s, k, m.size)),
            "guess": hv.guess_mse(grads, s), "stein": hv.stein_mse(grads, seg, s, k)[0]}


def measured(stack, params, batch, n: int, s: int, k: int, keys: int) -> dict[str, tuple]:
    """(mean, standard error) of ‖ĝ − g‖² of each estimator over ``keys`` keys."""
    mb = micro(batch, n)
    g = flat(jax.grad(stack)(params, batch))
    ests = {"exact_subset": jg.exact_subset(s), "forward": jg.forward(k),
            "forward_micro": MicrobatchForward(jg.forward(k)),
            **{c: jg.hybrid(s, c, k) for c in CORRECTIONS}}

    def one(key):
        out = {}
        for name, e in ests.items():
            b = batch if name == "forward" else mb
            out[name] = jnp.sum((flat(e(stack, params, b, key)[1]) - g) ** 2)
        return out

    sq = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(7), keys))
    return {name: (float(np.mean(v)), float(np.std(np.asarray(v, np.float64), ddof=1)
                                            / math.sqrt(keys))) for name, v in sq.items()}


# ----------------------------------------------------------------------------- (b) the costs
def costs(stack, params, batch, n: int) -> hv.Costs:
    """The cost model's constants from the compiled programs' matmul FLOPs, in forward passes
    of the batch: the forward part at K = 1 and 2 (base and per tangent), the exact part of all
    N micro-batches (a rematerialised sweep), backprop."""
    mb = micro(batch, n)
    key = jax.random.key(0)

    def flops(fn, *args):
        return matmul_flops(jax.jit(fn).lower(*args).compile())

    fwd = flops(stack, params, batch)
    f1 = flops(lambda p, k: MicrobatchForward(jg.forward(1))(stack, p, mb, k)[1], params, key)
    f2 = flops(lambda p, k: MicrobatchForward(jg.forward(2))(stack, p, mb, k)[1], params, key)
    ex = flops(lambda p, k: jg.exact_subset(n)(stack, p, mb, k)[1], params, key)
    bp = flops(lambda p: jax.grad(stack)(p, batch), params)
    return hv.Costs((2 * f1 - f2) / fwd, (f2 - f1) / fwd, ex / fwd, bp / fwd)


def regime(per_example: np.ndarray, c: hv.Costs, k: int = 1) -> list[dict]:
    """Each (N, S): the best hybrid's model MSE against the exact subset and forward-only at the
    hybrid's compute, and ρ* (the correlation a forward part costing ``forward(1)`` would need
    for the best fixed-β hybrid to beat that subset; 1: none can)."""
    rows = []
    p = per_example.shape[1]
    for n in NS:
        grads = group(per_example, n)
        m = hv.moments(grads)
        nu = hv.noise_ratio(p, k)
        for s in sorted({1, 2, 4, n // 4, n // 2} & set(range(1, n))):
            cost = c.hybrid(s, n, k)
            s_eq = c.subset_at(cost, n)
            k_eq = c.tangents_at(cost)
            subset_eq = hv.exact_subset(m, s_eq)
            fwd_eq = min(hv.forward_batch(m, hv.noise_ratio(p, 1) / k_eq),
                         hv.forward_micro(m, hv.noise_ratio(p, 1) / k_eq))
            hyb = {"replace": hv.replace(m, s, nu), "control_variate": hv.control_variate(m, s, nu),
                   "weighted": hv.weighted(m, s, nu, hv.weighted_beta(n, s, k, p)),
                   "best_fixed_beta": hv.best_weighted(m, s, nu),
                   "guess": hv.guess_mse(grads, s, limit=300)}
            best = min(hyb, key=hyb.get)
            nu_star = hv.critical_nu(m, s, c, c.forward(1))
            rows.append({"N": n, "S": s, "K": k, "cost": cost, "S_eq": s_eq, "K_eq": k_eq,
                         "exact_subset": hv.exact_subset(m, s), "exact_subset_eq": subset_eq,
                         "forward_eq": fwd_eq, **hyb, "best": best,
                         "ratio": (hyb[best] / min(subset_eq, fwd_eq)
                                   if min(subset_eq, fwd_eq) > 0 else math.inf),
                         "rho_weights": hv.rho(nu),
                         "rho_star": hv.rho(nu_star) if nu_star > 0 else 1.0,
                         "full": m.full, "spread": m.spread})
    return rows


# ----------------------------------------------------------------------------- (c) training
def train(stack, est, ds, n: int, seeds: int, steps: int, lr: float) -> np.ndarray:
    """Final test error (%) of each seed: params from ``key(seed)``, batches of 64 drawn by
    ``default_rng(seed)``, estimator key ``fold_in(key(1000 + seed), step)``: the same for
    every arm."""
    x, y = np.asarray(ds.train["x"]), np.asarray(ds.train["y"])
    idx = np.stack([np.random.default_rng(sd).integers(0, len(y), (steps, BATCH))
                    for sd in range(seeds)])
    opt = optax.adam(lr)

    def run(seed, order):
        params = stack.init(jax.random.key(seed))
        key = jax.random.key(1000 + seed)

        def step(carry, t):
            p, o = carry
            b = {"x": jnp.asarray(x)[order[t]], "y": jnp.asarray(y)[order[t]]}
            _, g = est(stack, p, micro(b, n), jax.random.fold_in(key, t))
            upd, o = opt.update(g, o, p)
            return (optax.apply_updates(p, upd), o), None

        (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), jnp.arange(steps))
        return 100.0 * (1.0 - stack.accuracy(params, test))

    test = {"x": jnp.asarray(ds.test["x"]), "y": jnp.asarray(ds.test["y"])}
    return np.asarray(jax.jit(jax.vmap(run))(jnp.arange(seeds), jnp.asarray(idx)), np.float64)


# ----------------------------------------------------------------------------- tables
def lab_table(model: dict, meas: dict, full: float) -> str:
    lines = [("| estimator | model E‖ĝ − g‖² | measured (± s.e.) | (measured − model) / s.e. "
             "| model / ‖g‖² |"), "|---|---|---|---|---|"]
    for name, value in model.items():
        mean, se = meas[name]
        lines.append(f"| {name} | {value:.4g} | {mean:.4g} ± {se:.2g} | {(mean - value) / se:+.2f} "
                     f"| {value / full:.3g} |")
    return "\n".join(lines)


def ratio(x: float) -> str:
    return "∞ (S' = N: backprop)" if math.isinf(x) else f"{x:.3g}"


def regime_table(rows: list[dict]) -> str:
    lines = [("| N | S | cost (fwd passes) | subset at S | S' at equal cost | subset at S' "
             "| forward-only at equal cost | weighted (model) | best hybrid (model) "
             "| hybrid / best ingredient | ρ of K=1 weight tangents | ρ* needed |"),
             "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['N']} | {r['S']} | {r['cost']:.2f} | {r['exact_subset']:.3g} | {r['S_eq']:.1f} "
            f"| {r['exact_subset_eq']:.3g} | {r['forward_eq']:.3g} | {r['weighted']:.3g} "
            f"| {r['best']} "
            f"{r[r['best']]:.3g} | {ratio(r['ratio'])} | {r['rho_weights']:.4f} "
            f"| {r['rho_star']:.3f} |")
    return "\n".join(lines)


def paired_table(arms: dict, tests: dict) -> str:
    lines = ["| arm | test error % (mean ± sd over seeds) | per seed |", "|---|---|---|"]
    for name, errs in arms.items():
        lines.append(f"| {name} | {errs.mean():.2f} ± {errs.std(ddof=1):.2f} | "
                     + ", ".join(f"{e:.2f}" for e in errs) + " |")
    lines += ["", "| pair (a − b) | mean pp | 95 % CI pp | t | p (paired t) |",
              "|---|---|---|---|---|"]
    for pair, t in tests.items():
        if "p" in t:
            lines.append(f"| {pair} | {t['mean']:+.2f} | [{t['lo']:+.2f}, {t['hi']:+.2f}] "
                         f"| {t['t']:.2f} | {t['p']:.3g} |")
        else:
            lines.append(f"| {pair} | {t.get('mean', float('nan')):+.2f} | — | — | — |")
    return "\n".join(lines)


def finite(x):
    """``x`` with every infinite float as None (strict JSON has no Infinity)."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return None if isinstance(x, float) and math.isinf(x) else x


def pick(rows: list[dict]) -> dict:
    """The (N, S) whose best hybrid comes closest to beating both ingredients."""
    return min(rows, key=lambda r: r["ratio"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8, help="micro-batches of the lab's hybrid arms")
    ap.add_argument("--s", type=int, default=2, help="exact micro-batches")
    ap.add_argument("--k", type=int, default=1, help="tangents per micro-batch")
    ap.add_argument("--keys", type=int, default=2048, help="Monte-Carlo keys for (a)")
    ap.add_argument("--seeds", type=int, default=5, help="paired training seeds for (c)")
    ap.add_argument("--steps", type=int, default=300, help="training steps for (c)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's rate (the lab's digits pick)")
    ap.add_argument("--no-train", action="store_true", help="skip (c)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--doc", type=Path, default=None, help="write the tables into this doc")
    args = ap.parse_args(argv)
    if BATCH % args.n or not 1 <= args.s < args.n or args.k < 1:
        ap.error(f"--n must divide {BATCH}, 1 <= --s < --n and --k >= 1; got n={args.n}, "
                 f"s={args.s}, k={args.k}")
    if args.seeds < 5 and not args.no_train:
        ap.error(f"--seeds {args.seeds}: a paired comparison here needs at least 5")
    if args.doc is not None and not args.doc.exists():
        ap.error(f"--doc {args.doc}: no such file (create it with the marked blocks)")

    ds, stack, params, batch = setup()
    per_example = example_grads(stack, params, batch)
    grads = group(per_example, args.n)
    full = float((per_example.mean(0) ** 2).sum())
    model = model_rows(grads, hv.segment_ids(params), args.s, args.k)
    meas = measured(stack, params, batch, args.n, args.s, args.k, args.keys)
    tables = {"lab": lab_table(model, meas, full)}
    print(tables["lab"], "\n")
    c = costs(stack, params, batch, args.n)
    cost_line = (f"Costs in forward passes of the batch (matmul FLOPs): forward part "
                 f"{c.forward_base:.2f} + {c.forward_per_tangent:.2f}·K, exact part "
                 f"{c.exact:.2f}·S/N, backprop {c.backprop:.2f}.")
    rows = regime(per_example, c, 1)
    tables["regime"] = (regime_table(rows) + "\n\n" + cost_line
                        + f" The zero estimate's error, ‖g‖², is {full:.3g}.")
    print(tables["regime"], "\n")
    out = {"setting": vars(args) | {"json": None, "doc": None}, "model": model,
           "measured": meas, "costs": c._asdict(), "regime": rows}
    if not args.no_train:
        from jaxstream_lab.verdicts import paired_difference

        r = pick(rows)
        n, s = r["N"], r["S"]
        corr = "weighted" if r["best"] == "best_fixed_beta" else r["best"]
        s_eq = max(1, math.floor(r["S_eq"] + 1e-9))
        specs = {f"hybrid({corr}, N={n}, S={s}, K=1)": jg.hybrid(s, corr, 1),
                 f"exact-subset(S'={s_eq}, equal compute)": jg.exact_subset(s_eq),
                 f"exact-subset(S={s})": jg.exact_subset(s)}
        arms = {name: train(stack, est, ds, n, args.seeds, args.steps, args.lr)
                for name, est in specs.items()}
        names = list(arms)
        tests = {f"{names[0]} − {b}": paired_difference(list(arms[names[0]]), list(arms[b]), 0.5)
                 for b in names[1:]}
        tables["paired"] = paired_table(arms, tests) + (
            f"\n\n{args.seeds} seeds, {args.steps} steps of Adam ({args.lr:g}), batch {BATCH}, "
            "test error at the end; seed i: the same init, batches and estimator keys in every arm.")
        print(tables["paired"])
        out["paired"] = {"arms": {k: v.tolist() for k, v in arms.items()}, "tests": tests}
    if args.json:
        args.json.write_text(json.dumps(finite(out), indent=1, default=float))
    if args.doc:
        from jaxstream.experiment.docblock import write_tables

        cmd = "python benchmarks/hybrid_variance.py " + " ".join(argv or sys.argv[1:])
        write_tables(args.doc, "hybrid_variance.py", tables, cmd.strip(),
                     keep=("paired",) if args.no_train else ())
    return out


if __name__ == "__main__":
    main()
