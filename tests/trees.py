"""The one tree comparison of the test suite and the benchmarks
(:func:`jaxstream.quality.metrics.max_rel_err`: the larger of the whole-tree error ‖a − b‖ / ‖b‖
and the worst leaf's ‖a_l − b_l‖ / max(‖b_l‖, 1e-3 ‖b‖))."""

from __future__ import annotations

from typing import Any

import jax

from jaxstream.quality.metrics import max_rel_err


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5) -> None:
    """Same structure, and the whole tree and every leaf within ``rtol`` of ``b``."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a),
                                                            jax.tree.structure(b))
    err = max_rel_err(a, b)
    assert err <= rtol, f"max relative error {err:.3g} > {rtol:g}"
