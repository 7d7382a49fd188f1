"""exact_subset(k) on the pipeline equals the in-memory estimator for the same key: the key
selects the micro-batches (as in memory), the stages run GPipe backprop over them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.pipeline import gpipe_backprop, gpipe_forward
from jaxstream.pipeline.executor import pipeline
from tests.trees import max_rel_err

STACK = mlp(in_dim=5, width=8, depth=4, num_classes=3)


def test_exact_subset_on_the_pipeline_equals_in_memory():
    params = STACK.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    micro = {"x": jnp.asarray(rng.standard_normal((6, 3, 5), dtype=np.float32)),
             "y": jnp.asarray(rng.integers(0, 3, (6, 3), dtype=np.int32))}
    est = jg.exact_subset(2)
    pipe = pipeline(STACK, gpipe_backprop(4, 2), est)
    seen = set()
    for seed in (1, 2):
        key = jax.random.key(seed)
        loss, grads, aux = pipe(params, micro, key)
        ref_loss, ref = est(STACK, params, micro, key)
        assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
        assert max_rel_err(grads, ref) <= 1e-5
        seen.add(tuple(np.asarray(aux["exact_indices"]).tolist()))
    assert len(seen) == 2  # the keys select different micro-batches: the check is not vacuous


def test_exact_subset_needs_a_backprop_table_of_its_size():
    with pytest.raises(ValueError, match=r"exact_subset\(2\) runs backprop over its 2 selected"):
        pipeline(STACK, gpipe_backprop(4, 4), jg.exact_subset(2))
    with pytest.raises(ValueError, match="exact_subset needs a backprop table"):
        pipeline(STACK, gpipe_forward(4, 2), jg.exact_subset(2))
