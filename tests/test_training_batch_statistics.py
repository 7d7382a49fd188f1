"""``js.train_step`` updates BatchNorm's running averages from the batch as the estimator's loss
saw it: a micro-batched estimator (a hybrid, ``exact_subset``) normalises every micro-batch by
its own statistics, and the step's new running averages are the mean of the update
flax's own ``nnx.BatchNorm`` makes on each micro-batch alone; a flat estimator's are nnx's
update on the whole batch. A view of a model (``as_stack``, ``as_padded_stack``) is refused when
the step is built, naming what to pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream as js
import jaxstream.grad as jg

N, B = 4, 8


def conv_bn() -> nnx.Sequential:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Conv(2, 8, (3,), rngs=rngs), nnx.BatchNorm(8, rngs=rngs), nnx.relu,
                          lambda h: h.reshape(h.shape[0], -1), nnx.Linear(16 * 8, 3, rngs=rngs))


def mlp_bn() -> nnx.Sequential:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(16 * 2, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs),
                          nnx.tanh, nnx.Linear(8, 3, rngs=rngs))


def data(flat_inputs: bool) -> dict:
    x = jax.random.normal(jax.random.key(0), (N * B, 16, 2)) * 2.0 + 0.5
    if flat_inputs:
        x = x.reshape(N * B, -1)
    return {"x": x, "y": jax.random.randint(jax.random.key(1), (N * B,), 0, 3)}


def nnx_statistics(build, x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """nnx.BatchNorm's own running averages after one training-mode call on ``x``."""
    net = build()
    net.train()
    net(x)
    bn = net.layers[1]
    return np.asarray(bn.mean[...]), np.asarray(bn.var[...])


@pytest.mark.parametrize("build,flat_inputs", [(conv_bn, False), (mlp_bn, True)],
                         ids=["conv", "mlp"])
@pytest.mark.parametrize("est", [jg.hybrid(num_exact=2), jg.exact_subset(2)],
                         ids=["hybrid", "exact_subset"])
def test_a_micro_batched_step_averages_nnx_batchnorm_updates_of_each_micro_batch(
        build, flat_inputs, est):
    model = js.models.from_sequential(build(), loss="cross_entropy")
    batch = data(flat_inputs)
    micro = jax.tree.map(lambda a: a.reshape(N, B, *a.shape[1:]), batch)
    params = model.init(None)
    step = js.train_step(est, optax.sgd(0.1), model)
    _, opt_state, loss = step(params, step.init(params), micro, jax.random.key(0))
    refs = [nnx_statistics(build, micro["x"][n]) for n in range(N)]
    mean, var = (np.mean([r[i] for r in refs], axis=0) for i in range(2))
    got = opt_state.model[1]
    np.testing.assert_allclose(got["mean"], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["var"], var, rtol=1e-5, atol=1e-7)
    # not the whole batch's statistics (those have the spread between micro-batches too):
    # at momentum 0.99 a hundredth of that spread, yet far beyond the agreement with nnx
    whole_var = nnx_statistics(build, batch["x"])[1]
    gap, err = np.abs(got["var"] - whole_var).max(), np.abs(got["var"] - var).max()
    assert gap > 10 * max(err, 1e-6), (gap, err)
    assert np.isfinite(float(loss))


def test_a_flat_step_takes_nnx_batchnorm_update_of_the_whole_batch():
    model = js.models.from_sequential(conv_bn(), loss="cross_entropy")
    batch, params = data(False), model.init(None)
    step = js.train_step(jg.backprop(), optax.sgd(0.1), model)
    _, opt_state, _ = step(params, step.init(params), batch, jax.random.key(0))
    mean, var = nnx_statistics(conv_bn, batch["x"])
    np.testing.assert_allclose(opt_state.model[1]["mean"], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(opt_state.model[1]["var"], var, rtol=1e-5, atol=1e-7)


def test_every_micro_batch_exact_is_the_mean_of_per_micro_batch_gradients_with_batchnorm():
    """What the README says: with BatchNorm every micro-batch is normalised by its own
    statistics, so a hybrid with every micro-batch exact is the mean of the micro-batches'
    own gradients, not backprop on the whole batch."""
    model = js.models.from_sequential(mlp_bn(), loss="cross_entropy")
    batch, params, key = data(True), model.init(None), jax.random.key(2)
    micro = jax.tree.map(lambda a: a.reshape(N, B, *a.shape[1:]), batch)
    _, g = jg.hybrid(num_exact=N)(model, params, micro, key)
    per_micro = [jax.grad(model)(params, jax.tree.map(lambda a, n=n: a[n], micro))
                 for n in range(N)]
    mean = jax.tree.map(lambda *a: sum(a) / N, *per_micro)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(mean)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    whole = jax.grad(model)(params, batch)
    assert not all(np.allclose(a, b, rtol=1e-2) for a, b in
                   zip(jax.tree.leaves(g), jax.tree.leaves(whole)))


def sequential_with_blocks():
    rngs = nnx.Rngs(0)
    return js.models.from_sequential(nnx.Sequential(
        nnx.Linear(8, 16, rngs=rngs), nnx.relu,
        *[m for _ in range(3) for m in (nnx.Linear(16, 16, rngs=rngs), nnx.tanh)],
        nnx.Linear(16, 3, rngs=rngs)))


@pytest.mark.parametrize("padded", [False, True], ids=["as_stack", "as_padded_stack"])
def test_train_step_refuses_a_view_when_built_naming_view_stack(padded):
    model = sequential_with_blocks()
    view = (js.models.as_padded_stack(model, jnp.zeros((2, 8))) if padded
            else js.models.as_stack(model))
    name = "PaddedView" if padded else "StackView"
    with pytest.raises(TypeError, match=rf"^train_step: loss_fn is a {name} .*pass view\.stack "
                                        r"with view\.params\(params\)") as err:
        js.train_step(jg.backprop(), optax.sgd(0.1), view)
    assert "\n" not in str(err.value)
    # the fix it names works
    step = js.train_step(jg.backprop(), optax.sgd(0.1), view.stack)
    sp = view.params(model.init(None))
    batch = {"x": jnp.ones((4, 8)), "y": jnp.arange(4) % 3}
    assert np.isfinite(float(step(sp, step.init(sp), batch, jax.random.key(0))[2]))
