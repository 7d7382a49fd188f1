"""Second moments of orthogonal tangents: (1/K) Σ_k E[v_k v_kᵀ] against I, per leaf size.

    python benchmarks/tangent_moments.py --json /tmp/tangent_moments.json

For K = 4 orthogonal tangents (Rademacher and Gaussian) of a leaf of 4, 5, 6, 8 and 16
entries, R keys each: the largest |E[v vᵀ] − I| entry and the largest in units of its standard
error (over the R·K tangents). An unbiased forward estimate needs E[v vᵀ] = I; under no bias
the largest of the n(n + 1)/2 entries is about 3 standard errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from jaxstream.experiment.docblock import machine
from jaxstream.grad.tangents import TangentSpec


def moments(distribution: str, size: int, keys: int, num: int = 4) -> dict:
    spec = TangentSpec(num, distribution, orthogonal=True)
    ks = jax.random.split(jax.random.key(0), keys)
    v = jax.jit(lambda k: jax.lax.map(lambda x: spec.sample(x, (size,)), k))(ks)
    v = np.asarray(v, np.float64).reshape(-1, size)
    outer = v[:, :, None] * v[:, None, :]
    err = np.abs(outer.mean(0) - np.eye(size))
    se = outer.std(0, ddof=1) / np.sqrt(len(outer))
    z = np.where(se > 1e-9, err / np.maximum(se, 1e-12), 0.0)  # exact entries: no noise
    return {"distribution": distribution, "leaf_size": size, "tangents": num, "keys": keys,
            "max_abs_error": float(err.max()), "max_error_in_se": float(z.max())}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = [moments(d, n, args.keys) for d in ("rademacher", "gaussian")
            for n in (4, 5, 6, 8, 16)]
    print("| distribution | leaf size | max abs error | max error / SE |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['distribution']} | {r['leaf_size']} | {r['max_abs_error']:.4f} | "
              f"{r['max_error_in_se']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "machine": machine()},
                                        indent=1))
    return rows


if __name__ == "__main__":
    main()
