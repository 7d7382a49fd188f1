"""A model's dropout masks per micro-batch: micro-batch n of a step draws from
``fold_in(rng, n)`` in every pass (exact and forward parts alike), as its tangents do.

The model: Dropout(0.5) -> Linear (kernel ones, no bias), per-example loss ``out[:, 0]``, inputs
ones. So dL/dW[j] = 2 x (share of the rows that keep column j), and the loss is linear in W:
a forward derivative along v is exactly g·v. The reference is ``jax.grad`` of the model bound
to ``fold_in(rng, n)``, micro-batch by micro-batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream as js
import jaxstream.grad as jg
from jaxstream.models.sequential import DROPOUT
from tests.trees import assert_trees_close

N, B, D = 4, 8, 16
RNG, KEY = jax.random.key(5), jax.random.key(1)


def dropout_model():
    """The model above, with no key bound."""
    rngs = nnx.Rngs(0)
    linear = nnx.Linear(D, 1, use_bias=False, rngs=rngs)
    linear.kernel[...] = jnp.ones((D, 1))
    return js.models.from_sequential(nnx.Sequential(nnx.Dropout(0.5, rngs=rngs), linear),
                                     loss=lambda out, batch: out[:, 0])


def micro_batches(x=None):
    """N micro-batches of B rows (inputs ones unless given)."""
    return {"x": jnp.ones((N, B, D)) if x is None else x, "y": jnp.zeros((N, B))}


def reference(model, params, micro, ns):
    """Mean over the micro-batches ``ns`` of jax.grad of the model bound to fold_in(rng, n)."""
    grads = [jax.grad(model.with_rng(jax.random.fold_in(model.rng, n)))(
        params, jax.tree.map(lambda x, n=n: x[n], micro)) for n in ns]
    return jax.tree.map(lambda *g: sum(g) / len(g), *grads)


def kernel(grads):
    return np.asarray(grads[1]["kernel"][:, 0])


@pytest.mark.parametrize("est", [jg.hybrid(num_exact=N), jg.exact_subset(N)],
                         ids=["hybrid", "exact_subset"])
def test_micro_batches_draw_different_masks(est):
    """Micro-batch n alone (the others' inputs zero) gives N x its own gradient: they differ.
    One mask shared by every micro-batch made them equal, and every entry of the whole batch's
    gradient a multiple of 2/B."""
    model = dropout_model().with_rng(RNG)
    params = model.init(None)
    run = jax.jit(lambda p, b: est(model, p, b, KEY)[1])
    alone = [N * kernel(run(params, micro_batches(jnp.zeros((N, B, D)).at[n].set(1.0))))
             for n in range(N)]
    assert not all(np.array_equal(alone[0], g) for g in alone[1:])
    whole = kernel(run(params, micro_batches())) * B / 2
    assert not np.allclose(whole, np.round(whole))


@pytest.mark.parametrize("est", [jg.hybrid(num_exact=N), jg.exact_subset(N)],
                         ids=["hybrid", "exact_subset"])
def test_all_exact_equals_per_micro_batch_reference(est):
    model = dropout_model().with_rng(RNG)
    params = model.init(None)
    micro = micro_batches()
    _, g = jax.jit(lambda p: est(model, p, micro, KEY))(params)
    assert_trees_close(g, reference(model, params, micro, range(N)), rtol=1e-6)


def test_exact_subset_draws_the_masks_of_the_selected_micro_batches():
    """Selected micro-batch n draws fold_in(rng, n), not the mask of its place in the
    selection."""
    model = dropout_model().with_rng(RNG)
    params = model.init(None)
    micro = micro_batches()
    _, g, diag = jg.exact_subset(2)(model, params, micro, KEY, diagnostics=True)
    idx = [int(i) for i in diag["exact_indices"]]
    assert sorted(idx) != [0, 1]  # (this key's selection: places and indices differ)
    assert_trees_close(g, reference(model, params, micro, idx), rtol=1e-6)


@pytest.mark.parametrize("correction", ["replace", "control_variate"])
def test_forward_and_exact_parts_draw_the_same_masks(correction):
    """D orthogonal tangents recover a linear loss's gradient exactly, so the hybrid with
    micro-batches 0..2 exact and 3 forward is the mean of all N reference gradients only if
    both parts draw micro-batch n's masks from fold_in(rng, n)."""
    model = dropout_model().with_rng(RNG)
    params = model.init(None)
    micro = micro_batches()
    est = jg.hybrid(exact_indices=(0, 1, 2), correction=correction, num_tangents=D,
                    orthogonal=True)
    _, g = jax.jit(lambda p: est(model, p, micro, KEY))(params)
    assert_trees_close(g, reference(model, params, micro, range(N)), rtol=1e-5)


def test_train_step_hybrid_draws_per_micro_batch_masks():
    """js.train_step binds fold_in(key, DROPOUT); micro-batch n then draws from its fold."""
    model = dropout_model()
    params = model.init(None)
    micro = micro_batches()
    step = js.train_step(jg.hybrid(num_exact=N), optax.sgd(0.0), model)
    _, g = step.gradients(params, micro, KEY)
    bound = model.with_rng(jax.random.fold_in(KEY, DROPOUT))
    assert_trees_close(g, reference(bound, params, micro, range(N)), rtol=1e-6)


def test_backprop_remat_chunks_draw_their_own_masks():
    """Gradient accumulation: chunk a of the batch draws fold_in(rng, a)."""
    model = dropout_model().with_rng(RNG)
    params = model.init(None)
    flat = jax.tree.map(lambda x: x.reshape(N * B, *x.shape[2:]), micro_batches())
    _, g = jg.backprop_remat(accumulate=N)(model, params, flat)
    assert_trees_close(g, reference(model, params, micro_batches(), range(N)), rtol=1e-6)
