"""Estimators that select exact micro-batches take a NumPy batch (as ``load_digits`` gives)
under ``jax.jit`` and ``jax.vmap`` over the key, as they take a jnp one: the selection is
traced there, and indexing a NumPy array with it failed."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxstream.grad as jg
from tests.grad.helpers import tiny_problem

ESTIMATORS = {"hybrid": lambda: jg.hybrid(num_exact=1),
              "exact_subset": lambda: jg.exact_subset(1),
              "hybrid_activity": lambda: jg.hybrid_activity(num_exact=2)}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_numpy_batch_under_jit_and_vmap_over_the_key(name):
    stack, params, _, micro = tiny_problem()
    numpy_batch = jax.tree.map(np.asarray, micro)
    est = ESTIMATORS[name]()
    keys = jax.random.split(jax.random.key(3), 3)
    eager = [est(stack, params, micro, k) for k in keys]  # the jnp batch, one key at a time
    jitted = jax.jit(lambda k: est(stack, params, numpy_batch, k))(keys[1])
    mapped = jax.vmap(lambda k: est(stack, params, numpy_batch, k)[:2])(keys)
    for got, want in ((jitted[:2], eager[1][:2]),
                      *(((jax.tree.map(lambda a, i=i: a[i], mapped), e[:2])
                         for i, e in enumerate(eager)))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
