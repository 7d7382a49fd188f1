"""The one tree comparison of the test suite: relative to each leaf's largest entry."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def max_rel_err(a: Any, b: Any) -> float:
    """max over leaves of ‖a − b‖∞ / ‖b‖∞ (float64), the error measure of every engine test."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), f"trees differ: {len(la)} vs {len(lb)} leaves"
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64)))
                     / (np.max(np.abs(np.asarray(v, np.float64))) + 1e-30))
               for u, v in zip(la, lb))


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5) -> None:
    """Same structure, and every leaf within ``rtol`` of ``b`` relative to its largest entry."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a),
                                                            jax.tree.structure(b))
    err = max_rel_err(a, b)
    assert err <= rtol, f"max relative error {err:.3g} > {rtol:g}"
