"""A user's nnx.Sequential with a repeated group of layers runs on the engines that need
identical blocks (streamed layers, streamed pipeline stages), equal to the model itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.models.seq_stack import as_stack, find_blocks
from jaxstream.models.sequential import from_sequential
from jaxstream.stream import LayerStore, StreamConfig, StreamedExecutor
from tests.trees import max_rel_err


def user_model():
    """Written as a user would: shapes change outside the repeated part (8 -> 12 -> 3)."""
    rngs = nnx.Rngs(0)
    body = [m for _ in range(4) for m in (nnx.Linear(12, 12, rngs=rngs), nnx.tanh)]
    return from_sequential(nnx.Sequential(nnx.Linear(8, 12, rngs=rngs), nnx.relu, *body,
                                          nnx.Linear(12, 3, rngs=rngs)), loss="cross_entropy")


@pytest.fixture(scope="module")
def setup():
    model = user_model()
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((4, 2, 8), dtype=np.float32),
             "y": rng.integers(0, 3, (4, 2), dtype=np.int32)}
    return model, as_stack(model), micro


def test_blocks_found_and_gradients_equal_the_model(setup):
    model, view, micro = setup
    assert (view.first, view.period, view.repeats) == (2, 2, 4)
    params = model.init(jax.random.key(0))
    flat = {k: v.reshape(8, *v.shape[2:]) for k, v in micro.items()}
    loss, g = jax.value_and_grad(model)(params, flat)
    sloss, sg = jax.value_and_grad(view.stack)(view.params(params), flat)
    assert abs(float(loss) - float(sloss)) <= 1e-6
    assert max_rel_err(view.unstack(sg), g) <= 1e-6
    assert max_rel_err(view.unstack(view.params(params)), params) == 0.0


@pytest.mark.parametrize("engine", ["stream", "composed"])
def test_streamed_engines_run_the_users_model(tmp_path, setup, engine):
    """The hybrid estimate on streamed layers (and on a 2 x 2 mesh) equals the in-memory
    estimator on the stack, which the test above ties to the model."""
    model, view, micro = setup
    est, opt = jg.hybrid(num_exact=2, num_tangents=2), optax.sgd(0.1)
    params = view.params(model.init(jax.random.key(0)))
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=opt)
    cfg = StreamConfig(compute_dtype="float32", prefetch=1)
    ex = (StreamedExecutor(view.stack, est, opt, store, cfg) if engine == "stream" else
          ComposedExecutor(view.stack, est, opt, store, cfg, mesh=make_mesh(2, 2)))
    key = jax.random.key(3)
    _, grads = ex.estimate(micro, key)
    _, ref = est(view.stack, params, jax.tree.map(jnp.asarray, micro), key)
    assert max_rel_err(grads, ref) <= 1e-5


def test_models_without_blocks_are_refused_by_name():
    rngs = nnx.Rngs(0)
    cnn = from_sequential(nnx.Sequential(
        nnx.Conv(1, 4, (3, 3), rngs=rngs), nnx.relu,
        lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2)),
        lambda x: x.reshape(x.shape[0], -1), nnx.Linear(64, 10, rngs=rngs)), name="cnn")
    with pytest.raises(ValueError, match="'cnn' has no repeated group of layers"):
        find_blocks(cnn)
    with pytest.raises(ValueError, match="as_padded_stack"):
        find_blocks(cnn)
    bn = from_sequential(nnx.Sequential(
        *[m for _ in range(2) for m in (nnx.Linear(4, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs))]))
    with pytest.raises(ValueError, match="BatchNorm statistics or dropout"):
        as_stack(bn)


def test_pipeline_stages_run_the_users_model(setup):
    """GPipe backprop over 4 stages (one block each) gives the model's own gradient."""
    from jaxstream.pipeline import gpipe_backprop
    from jaxstream.pipeline.executor import pipeline

    model, view, micro = setup
    params = model.init(jax.random.key(0))
    flat = {k: v.reshape(8, *v.shape[2:]) for k, v in micro.items()}
    _, grads, _ = pipeline(view.stack, gpipe_backprop(4, 4), jg.backprop())(
        view.params(params), micro, jax.random.key(0))
    assert max_rel_err(view.unstack(grads), jax.grad(model)(params, flat)) <= 1e-5


def test_a_stack_without_embed_parameters_runs_on_the_pipeline():
    """A repeated group from the first layer on leaves the embed without parameters; weight
    perturbation and the pipeline's first stage used to fail on it (vmap over no tangents)."""
    from jaxstream.pipeline import gpipe_backprop
    from jaxstream.pipeline.executor import pipeline

    rngs = nnx.Rngs(1)
    model = from_sequential(nnx.Sequential(
        *[m for _ in range(4) for m in (nnx.Linear(6, 6, rngs=rngs), nnx.tanh)]))
    view = as_stack(model)
    assert view.first == 0 and view.params(model.init(None))["embed"] == {}
    rng = np.random.default_rng(1)
    micro = {"x": rng.standard_normal((4, 2, 6), dtype=np.float32),
             "y": rng.integers(0, 6, (4, 2), dtype=np.int32)}
    flat = {k: v.reshape(8, *v.shape[2:]) for k, v in micro.items()}
    params = model.init(None)
    _, grads, _ = pipeline(view.stack, gpipe_backprop(4, 4), jg.backprop())(
        view.params(params), micro, jax.random.key(0))
    assert max_rel_err(view.unstack(grads), jax.grad(model)(params, flat)) <= 1e-5
    loss, _ = jg.forward(num_tangents=2)(view.stack, view.params(params), flat, jax.random.key(1))
    assert abs(float(loss) - float(model(params, flat))) <= 1e-6


class _Scaled(nnx.Module):
    """A residual block whose scale is a static (non-parameter) attribute."""

    def __init__(self, d, alpha, rngs):
        self.fc, self.alpha = nnx.Linear(d, d, rngs=rngs), alpha

    def __call__(self, h):
        return h + self.alpha * nnx.tanh(self.fc(h))


def test_blocks_differing_only_in_a_static_attribute_name_it():
    rngs = nnx.Rngs(0)
    model = from_sequential(nnx.Sequential(
        nnx.Linear(8, 8, rngs=rngs), *[_Scaled(8, a, rngs) for a in (0.5, 1.0, 2.0)],
        nnx.Linear(8, 3, rngs=rngs)), name="scaled")
    with pytest.raises(ValueError, match=r"^model: 'scaled' repeats a group of layers with the "
                                         r"same types and parameter shapes, but their static "
                                         r"attributes differ \(layers 1, 2, 3 \(_Scaled\) differ "
                                         r"in 'alpha': 0\.5, 1\.0, 2\.0\).*as_padded_stack") as err:
        as_stack(model)
    assert "\n" not in str(err.value) and "no repeated group" not in str(err.value)
    same = from_sequential(nnx.Sequential(
        nnx.Linear(8, 8, rngs=rngs), *[_Scaled(8, 0.5, rngs) for _ in range(3)],
        nnx.Linear(8, 3, rngs=rngs)))
    assert (as_stack(same).first, as_stack(same).repeats) == (1, 3)


class _Buffer(nnx.Variable):
    """A fixed, non-trainable value a user's block keeps."""


class _ScaledBlock(nnx.Module):
    def __init__(self, d: int, scale: float, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.scale = _Buffer(jnp.full((d,), scale, jnp.float32))

    def __call__(self, x):
        return x + self.scale[...] * jnp.tanh(self.lin(x))


def _scaled(scales):
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(8, 6, rngs=rngs), *[_ScaledBlock(6, s, rngs) for s in scales],
                          nnx.Linear(6, 3, rngs=rngs))


def test_blocks_with_their_own_buffers_are_refused_and_padded_by_to_stack():
    """Blocks holding different fixed scales: the view ran the first block's scale in every
    block (loss 1.84 against the model's 2.26, silently). Refused by name; ``to_stack`` pads
    such a model instead, equal to ``jax.grad`` through the nnx model; blocks holding the same
    values stay a stack view, also equal to it."""
    from jaxstream.models.padded_stack import to_stack

    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 8), dtype=np.float32)
    y = rng.integers(0, 3, 6, dtype=np.int32)

    def reference(nm):  # the user's own loss through their own module
        def loss(m):
            logits = m(x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
        return nnx.value_and_grad(loss)(nm)[0]

    for scales, stacked in (((0.1, 1.0, 3.0), False), ((0.5, 0.5, 0.5), True)):
        nm = _scaled(scales)
        model = from_sequential(nm, loss="cross_entropy")
        if not stacked:
            with pytest.raises(ValueError, match="layer 2 holds its own value of the "
                                                 "non-trainable variable 'scale'"):
                as_stack(model)
        stack = to_stack(model, x)
        params = stack.init(jax.random.key(0))
        loss, _ = jg.backprop()(stack, params, {"x": x, "y": y}, jax.random.key(0))
        np.testing.assert_allclose(loss, reference(nm), rtol=1e-5)
        if stacked:  # the same values in every block: the stack view, equal to the model
            view = as_stack(model)
            vloss, _ = jg.backprop()(view.stack, view.params(model.init(None)), {"x": x, "y": y},
                                     jax.random.key(0))
            np.testing.assert_allclose(vloss, reference(nm), rtol=1e-5)
