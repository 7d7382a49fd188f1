"""A user's CNN without repeated layers, padded into a stack, runs on the engines that need
identical blocks (pipeline stages, streamed layers, streamed stages): its gradients are the
model's own (jax.grad), a padded directional derivative is the model's, and every engine equals
the in-memory estimator on the padded stack for the same keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.models.padded_stack import as_padded_stack
from jaxstream.models.sequential import from_sequential
from jaxstream.stream import LayerStore, StreamConfig, StreamedExecutor
from tests.trees import max_rel_err

R = 256  # estimates in the unbiasedness check


def cnn():
    """The flax tutorial's CNN shape, as a user writes it (8×8 inputs, small channels)."""
    rngs = nnx.Rngs(0)
    pool = lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2))
    return from_sequential(nnx.Sequential(
        lambda x: x.reshape(x.shape[0], 8, 8, 1),
        nnx.Conv(1, 4, (3, 3), rngs=rngs), nnx.relu, pool,
        nnx.Conv(4, 8, (3, 3), rngs=rngs), nnx.relu, pool,
        lambda x: x.reshape(x.shape[0], -1),
        nnx.Linear(32, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 10, rngs=rngs)), name="cnn")


@pytest.fixture(scope="module")
def setup():
    model = cnn()
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((4, 2, 64), dtype=np.float32),
             "y": rng.integers(0, 10, (4, 2), dtype=np.int32)}
    flat = {k: jnp.asarray(v.reshape(8, *v.shape[2:])) for k, v in micro.items()}
    return model, as_padded_stack(model, flat["x"]), micro, flat


@pytest.mark.standard_promotion  # the user's flax CNN: nnx.avg_pool divides by an int
def test_layout_and_gradients_equal_the_model(setup):
    model, view, _, flat = setup
    assert view.embed_layers == (0, 1, 2, 3) and view.head_layers == (10,)
    assert [b.layers for b in view.blocks] == [(4, 5, 6, 7), (8, 9)]
    assert view.param_width == 32 * 16 + 16 and view.act_width == 4 * 4 * 4  # dense 1; 4×4×4 in
    params = model.init(None)
    loss, g = jax.value_and_grad(model)(params, flat)
    sloss, sg = jax.value_and_grad(view.stack)(view.params(params), flat)
    assert abs(float(loss) - float(sloss)) <= 1e-6
    assert max_rel_err(view.unstack(sg), g) <= 1e-6
    assert max_rel_err(view.unstack(view.params(params)), params) == 0.0
    pad = np.asarray(sg["blocks"]["w"])[0, 4 * 8 * 9 + 8:]  # conv 2 holds 296 of 528
    assert pad.size and not pad.any()  # the padding never reaches the loss


@pytest.mark.standard_promotion  # the user's flax CNN: nnx.avg_pool divides by an int
def test_a_padded_direction_is_the_models_direction(setup):
    """Weight perturbation on the stack estimates the model's gradient: along any tangent V of
    the model, the stack's derivative along the padded V is the model's."""
    model, view, _, flat = setup
    params = model.init(None)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    v = jax.tree.unflatten(treedef, [jax.random.normal(k, a.shape) for k, a in zip(keys, leaves)])
    _, d = jax.jvp(lambda p: model(p, flat), (params,), (v,))
    _, ds = jax.jvp(lambda p: view.stack(p, flat), (view.params(params),), (view.params(v),))
    assert abs(float(d) - float(ds)) <= 1e-5 * abs(float(d)) and abs(float(d)) > 1e-3


@pytest.mark.standard_promotion  # the user's flax CNN: nnx.avg_pool divides by an int
def test_activity_on_the_padded_stack_is_unbiased(setup):
    """Tangents land on the padded activations (padding and index column included): the real
    coordinates' estimate is unbiased (z-scores from the sample variance, fixed keys)."""
    model, view, _, flat = setup
    params = view.params(model.init(None))
    est = jg.forward(num_tangents=4, perturb="activations")
    exact = jax.grad(view.stack)(params, flat)
    keys = jax.random.split(jax.random.key(1), R)
    _, g = jax.jit(lambda ks: jax.lax.map(lambda k: est(view.stack, params, flat, k), ks))(keys)
    real = jax.vmap(view.unstack)(g)
    e = jnp.concatenate([a.reshape(R, -1) for a in jax.tree.leaves(real)], axis=1)
    ref = jnp.concatenate([a.reshape(-1) for a in jax.tree.leaves(view.unstack(exact))])
    se = e.std(axis=0, ddof=1) / np.sqrt(R)
    z = np.asarray((e.mean(axis=0) - ref) / jnp.maximum(se, 1e-12))
    # ~700 coordinates, each z ~ N(0, 1) by the CLT: max |z| above 5 has probability < 1e-3.
    assert np.abs(z).max() < 5.0, np.abs(z).max()
    assert (np.abs(np.asarray(ref / jnp.maximum(se, 1e-12))) > 10).sum() >= 5  # the check has power


@pytest.mark.parametrize("engine,est", [
    ("stream", "hybrid"), ("stream", "activity"), ("composed", "forward")])
@pytest.mark.standard_promotion  # the user's flax CNN: nnx.avg_pool divides by an int
def test_streamed_engines_run_the_padded_model(tmp_path, setup, engine, est):
    model, view, micro, flat = setup
    est_fn = {"hybrid": jg.hybrid(num_exact=2, num_tangents=2),
              "activity": jg.forward(num_tangents=2, perturb="activations"),
              "forward": jg.forward(num_tangents=2)}[est]
    opt = optax.sgd(0.1)
    params = view.params(model.init(None))
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=opt)
    cfg = StreamConfig(compute_dtype="float32", prefetch=1)
    ex = (StreamedExecutor(view.stack, est_fn, opt, store, cfg) if engine == "stream" else
          ComposedExecutor(view.stack, est_fn, opt, store, cfg, mesh=make_mesh(2, 2)))
    key = jax.random.key(3)
    _, grads = ex.estimate(micro, key)
    ref_batch = jax.tree.map(jnp.asarray, micro) if est == "hybrid" else flat
    _, ref = est_fn(view.stack, params, ref_batch, key)
    assert max_rel_err(grads, ref) <= 1e-5


@pytest.mark.standard_promotion  # the user's flax CNN: nnx.avg_pool divides by an int
def test_pipeline_stages_run_the_padded_model(setup):
    """GPipe backprop over 2 stages (one block each) gives the model's own gradient."""
    from jaxstream.pipeline import gpipe_backprop
    from jaxstream.pipeline.executor import pipeline

    model, view, micro, flat = setup
    params = model.init(None)
    _, grads, _ = pipeline(view.stack, gpipe_backprop(2, 4), jg.backprop())(
        view.params(params), micro, jax.random.key(0))
    assert max_rel_err(view.unstack(grads), jax.grad(model)(params, flat)) <= 1e-5


def test_refusals_name_the_reason():
    rngs = nnx.Rngs(0)
    two = from_sequential(nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.relu,
                                         nnx.Linear(4, 3, rngs=rngs)), name="two")
    with pytest.raises(ValueError, match="'two' has 2 layers with parameters; .* at least 3"):
        as_padded_stack(two, jnp.zeros((2, 4)))
    bn = from_sequential(nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs),
                                        nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 3, rngs=rngs)))
    with pytest.raises(ValueError, match="BatchNorm statistics or dropout"):
        as_padded_stack(bn, jnp.zeros((2, 4)))
    squash = from_sequential(nnx.Sequential(
        nnx.Linear(4, 4, rngs=rngs), lambda h: h.sum(axis=0), nnx.Linear(4, 4, rngs=rngs),
        nnx.Linear(4, 3, rngs=rngs)), name="squash")
    with pytest.raises(ValueError, match="layer 1 turns a batch of 2 into shape"):
        as_padded_stack(squash, jnp.zeros((2, 4)))


def test_local_losses_are_refused_on_a_padded_stack(tmp_path, setup):
    """The head reads only the last block's output: every engine refuses local losses by name."""
    from jaxstream.pipeline import gpipe_forward
    from jaxstream.pipeline.executor import pipeline

    model, view, _, flat = setup
    est = jg.forward(num_tangents=2, perturb="activations", local_losses=True)
    params = view.params(model.init(None))
    with pytest.raises(ValueError, match="forward: local_losses=True .* 'cnn' has no shared head"):
        est(view.stack, params, flat, jax.random.key(0))
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="stream: local_losses=True"):
        StreamedExecutor(view.stack, est, optax.sgd(0.1), store)
    with pytest.raises(ValueError, match="pipeline: local_losses=True"):
        pipeline(view.stack, gpipe_forward(2, 4), est)


@pytest.mark.parametrize("name", ["local_forward_weights", "local_guess"])
def test_estimators_that_always_use_local_losses_name_what_to_use_instead(setup, name):
    """They take no local_losses switch: the message names estimators without local losses."""
    model, view, _, flat = setup
    est = getattr(jg, name)()
    with pytest.raises(ValueError, match=rf"^{name}: its local losses \(always on\) apply the "
                                         r"head .* 'cnn' has no shared head .*allowed: an "
                                         r"estimator without local losses") as err:
        est(view.stack, view.params(model.init(None)), flat, jax.random.key(0))
    assert "allowed: local_losses=False" not in str(err.value) and "\n" not in str(err.value)
