"""A pipeline step accepts keys of any PRNG implementation (the key crosses shard_map as raw
data) and equals the in-memory estimator for that same key.

The reference loops over the micro-batches, as the pipeline does (``rbg`` bits vmapped over
keys depend on the row; the tangents are made row-invariant by
:func:`jaxstream.grad.threefry.vmap_exact`, tested in tests/grad/test_threefry.py)."""

import functools

import jax

import jaxstream.grad as jg
from jaxstream.grad.tangents import micro_key
from jaxstream.pipeline import gpipe_forward
from jaxstream.pipeline.executor import pipeline
from tests.pipeline.tiny import tiny_setup
from tests.trees import max_rel_err

K = 2


@functools.partial(jax.jit, static_argnums=0)
def _reference(stack, params, batch, key):
    """The in-memory forward estimator per micro-batch n (key ``fold_in(key, n)``), averaged."""
    n = jax.tree.leaves(batch)[0].shape[0]
    est = jg.forward(K)
    outs = [est(stack, params, jax.tree.map(lambda a, i=i: a[i], batch), micro_key(key, i))
            for i in range(n)]
    mean = lambda *xs: sum(xs) / n
    return mean(*(o[0] for o in outs)), jax.tree.map(mean, *(o[1] for o in outs))


def test_rbg_key_equals_in_memory_estimator():
    m, n = 2, 2
    stack, params, batch = tiny_setup(m, n)
    key = jax.random.key(7, impl="rbg")
    loss, grads, _ = pipeline(stack, gpipe_forward(m, n), num_tangents=K,
                              correction="none")(params, batch, key)
    ref_loss, ref = _reference(stack, params, batch, key)
    assert abs(float(loss - ref_loss)) <= 1e-6
    assert max_rel_err(grads, ref) <= 1e-5
    # a different key gives different directions (the key is used, not a default one)
    other = _reference(stack, params, batch, jax.random.key(8, impl="rbg"))[1]
    assert max_rel_err(other, ref) > 1e-2
