"""A user's own random layer (one that draws from its own ``nnx.Rngs``, neither nnx.Dropout nor
a ``dropout_rate``) is driven by the step key: every estimator sees the same draws for the same
key, equal to a plain-JAX reference written at the documented key schedule; without a bound key
a draw is refused by name, and the engines that run blocks as pure functions refuse it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream as js
from jaxstream.models.rng_streams import STREAMS
from jaxstream.models.sequential import DROPOUT, from_sequential

SCALE = 0.5


class GaussianNoise(nnx.Module):
    """An outside layer: adds Gaussian noise drawn from its own ``noise`` stream."""

    def __init__(self, scale: float, rngs: nnx.Rngs):
        self.scale, self.rngs = scale, rngs

    def __call__(self, x):
        return x + self.scale * jax.random.normal(self.rngs.noise(), x.shape)


def noisy_model():
    rngs = nnx.Rngs(0)
    return from_sequential(nnx.Sequential(
        nnx.Linear(4, 8, rngs=rngs), GaussianNoise(SCALE, nnx.Rngs(noise=3)), nnx.relu,
        nnx.Linear(8, 3, rngs=rngs)))


def batch(n=6):
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (n, 4)), "y": jax.random.randint(ky, (n,), 0, 3)}


def reference_loss(params, data, key):
    """The same network in plain JAX; its noise drawn at the documented schedule: stream 0 of
    layer 1, first draw (count 0)."""
    rng = jax.random.fold_in(key, DROPOUT)
    stream = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, 1), STREAMS), 0)
    noise = jax.random.normal(jax.random.fold_in(stream, 0), (data["x"].shape[0], 8))
    h = jax.nn.relu(data["x"] @ params[0]["kernel"] + params[0]["bias"] + SCALE * noise)
    return js.models.cross_entropy(h @ params[3]["kernel"] + params[3]["bias"], data).mean()


ESTIMATORS = {"backprop": js.grad.backprop(), "forward": js.grad.forward(3),
              "activity": js.grad.forward(3, perturb="activations")}


def losses_by_estimator(model, params, data, keys, names=tuple(ESTIMATORS)):
    """{estimator: [(loss, grads) per key]} through js.train_step (one compile each)."""
    out = {}
    for name in names:
        est = ESTIMATORS[name]
        grads_of = jax.jit(js.train_step(est, optax.sgd(0.1), model).gradients)
        out[name] = [grads_of(params, data, key) for key in keys]
    return out


def test_every_estimator_draws_the_reference_noise_of_the_step_key():
    model, data = noisy_model(), batch()
    params = model.init(None)
    keys = [jax.random.key(11), jax.random.key(12)]
    got = losses_by_estimator(model, params, data, keys)
    for i, key in enumerate(keys):
        ref, ref_grads = jax.value_and_grad(reference_loss)(params, data, key)
        for name in ESTIMATORS:
            np.testing.assert_allclose(got[name][i][0], ref, rtol=1e-6, err_msg=name)
        for g, r in zip(jax.tree.leaves(got["backprop"][i][1]), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    assert got["backprop"][0][0] != got["backprop"][1][0]  # the noise follows the key


def test_a_training_step_with_noise_runs_and_repeats_for_the_same_key():
    model, data = noisy_model(), batch()
    params = model.init(None)
    step = js.train_step(js.grad.forward(2), optax.sgd(0.1), model)
    runs = [step(params, step.init(params), data, jax.random.key(5)) for _ in range(2)]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(a, b)


def test_a_draw_without_a_step_key_is_refused_by_name():
    model, data = noisy_model(), batch()
    params = model.init(None)
    with pytest.raises(ValueError, match=r"^layer 1: GaussianNoise draws from its own RNG stream "
                                         r"'rngs/noise', but no step key is bound.*js.train_step"):
        js.grad.backprop()(model, params, data, jax.random.key(0))
    # bound by hand, the estimator runs it
    bound = model.with_rng(jax.random.fold_in(jax.random.key(11), DROPOUT))
    np.testing.assert_allclose(js.grad.backprop()(bound, params, data, jax.random.key(0))[0],
                               reference_loss(params, data, jax.random.key(11)), rtol=1e-6)


def test_evaluation_draws_the_layers_initial_stream_the_same_every_call():
    model, data = noisy_model(), batch()
    params = model.init(None)
    eager, jitted = model.apply(params, data["x"]), jax.jit(model.apply)(params, data["x"])
    np.testing.assert_array_equal(eager, model.apply(params, data["x"]))
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)


def test_a_stack_view_refuses_a_random_layer_by_name():
    rngs = nnx.Rngs(0)
    model = from_sequential(nnx.Sequential(
        nnx.Linear(4, 8, rngs=rngs), *[m for _ in range(3) for m in (
            nnx.Linear(8, 8, rngs=rngs), GaussianNoise(0.1, nnx.Rngs(noise=0)))],
        nnx.Linear(8, 3, rngs=rngs)))
    with pytest.raises(ValueError, match=r"layer 2 keeps its own nnx.Rngs streams.*in memory"):
        js.models.as_stack(model)


class KeyHolder(nnx.Module):
    """An RNG variable outside an nnx.Rngs stream: nothing could reseed it."""

    def __init__(self):
        self.key = nnx.RngKey(jax.random.key(0), tag="noise")

    def __call__(self, x):
        return x + jax.random.normal(self.key[...], x.shape)


def test_an_rng_variable_outside_a_stream_is_refused_when_built():
    with pytest.raises(ValueError, match=r"^layer 0: KeyHolder holds an RNG variable at 'key' "
                                         r"outside an nnx.Rngs stream"):
        from_sequential([KeyHolder()])


def test_attention_dropout_is_driven_by_the_step_key():
    """A module's own dropout_rate (attention) draws from its stream, driven like any other:
    the same key gives the same loss on every estimator, another key another loss; without a
    key dropout is off (the loss of the deterministic model)."""
    rngs = nnx.Rngs(0)
    att = nnx.MultiHeadAttention(num_heads=1, in_features=4, dropout_rate=0.5, decode=False,
                                 rngs=rngs)
    model = from_sequential([att, lambda h: h.mean(axis=1), nnx.Linear(4, 3, rngs=rngs)])
    params = model.init(None)
    data = {"x": jax.random.normal(jax.random.key(1), (5, 6, 4)), "y": jnp.arange(5) % 3}
    got = losses_by_estimator(model, params, data, [jax.random.key(0), jax.random.key(1)],
                              ("backprop", "activity"))
    losses = {name: [float(loss) for loss, _ in v] for name, v in got.items()}
    assert len({v[0] for v in losses.values()}) == 1 and len({v[1] for v in losses.values()}) == 1
    plain = float(js.grad.backprop()(model, params, data, jax.random.key(0))[0])
    assert len({plain, *losses["backprop"]}) == 3, losses
    np.testing.assert_allclose(plain, jnp.mean(js.models.cross_entropy(
        model.apply(params, data["x"]), data)), rtol=1e-6)


def test_dropout_rate_without_a_stream_is_refused_by_name():
    att = nnx.MultiHeadAttention(num_heads=1, in_features=4, dropout_rate=0.1, decode=False,
                                 rngs=nnx.Rngs(0), keep_rngs=False)
    with pytest.raises(ValueError, match=r"layer 0: MultiHeadAttention .* dropout_rate=0.1 but "
                                         r"keeps no RNG stream"):
        from_sequential([att, lambda h: h.mean(axis=(1, 2))])


def dropout_model(rate=0.9):
    rngs = nnx.Rngs(0)
    return from_sequential(nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.Dropout(rate, rngs=rngs),
                                          nnx.tanh, nnx.Linear(8, 3, rngs=rngs)))


@pytest.mark.parametrize("name", ["backprop", "forward", "activity"])
def test_nnx_dropout_without_a_step_key_is_refused_not_switched_off(name):
    """An estimator called directly on a dropout model without a bound key would train with
    dropout silently off: refused by name; bound, it runs; evaluation runs dropout off."""
    model, data = dropout_model(), batch()
    params = model.init(None)
    with pytest.raises(ValueError, match=r"^layer 1: nnx\.Dropout\(rate=0\.9\) needs a step key "
                                         r"in training mode.*model\.with_rng\(key\)") as err:
        ESTIMATORS[name](model, params, data, jax.random.key(0))
    assert "\n" not in str(err.value)
    bound = model.with_rng(jax.random.key(7))
    assert np.isfinite(float(ESTIMATORS[name](bound, params, data, jax.random.key(0))[0]))
    assert model.apply(params, data["x"]).shape == (6, 3)
    rate0 = dropout_model(0.0)  # a rate of 0 draws nothing: nothing to refuse
    assert np.isfinite(float(js.grad.backprop()(rate0, params, data, jax.random.key(0))[0]))
