"""from_sequential: an nnx.Sequential as a layered loss; activity perturbation unbiased against
jax.grad (tolerance from the sample variance, fixed seeds); the flax tutorial CNN trains."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream as js
from jaxstream.grad.layered import layered_activity
from jaxstream.grad.tangents import TangentSpec
from jaxstream.models.sequential import from_sequential

R = 256  # estimates per unbiasedness check


def flatten(x):
    return x.reshape(x.shape[0], -1)


def pool(x):
    return nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))


def small_cnn(batch_norm=False, dropout=0.0):
    """conv -> [BN] -> relu -> pool -> flatten -> [dropout] -> dense -> relu -> dense, 6x6 input."""
    rngs = nnx.Rngs(0)
    layers = [lambda x: x.reshape(x.shape[0], 6, 6, 1), nnx.Conv(1, 3, (3, 3), rngs=rngs)]
    if batch_norm:
        layers.append(nnx.BatchNorm(3, rngs=rngs))
    layers += [nnx.relu, pool, flatten]
    if dropout:
        layers.append(nnx.Dropout(dropout, rngs=rngs))
    layers += [nnx.Linear(27, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 4, rngs=rngs)]
    return from_sequential(nnx.Sequential(*layers), loss="cross_entropy")


def tiny_batch(n=6):
    kx, ky = jax.random.split(jax.random.key(42))
    return {"x": jax.random.normal(kx, (n, 36)), "y": jax.random.randint(ky, (n,), 0, 4)}


def z_scores(estimates, exact):
    """Per-coordinate (mean - exact) / standard error of the mean, all leaves concatenated."""
    est = jnp.concatenate([e.reshape(R, -1) for e in jax.tree.leaves(estimates)], axis=1)
    ref = jnp.concatenate([g.reshape(-1) for g in jax.tree.leaves(exact)])
    se = est.std(axis=0, ddof=1) / np.sqrt(R)
    return np.asarray((est.mean(axis=0) - ref) / jnp.maximum(se, 1e-12)), np.asarray(ref / se)


# With batch statistics every example's tangents reach every loss (noisier): more tangents.
@pytest.mark.parametrize("batch_norm,dropout,k", [(False, 0.0, 2), (True, 0.3, 16)],
                         ids=["plain", "batchnorm+dropout"])
@pytest.mark.standard_promotion  # a user's flax model (nnx.avg_pool divides by an int) or plain nnx + optax
def test_activity_unbiased(batch_norm, dropout, k):
    model = small_cnn(batch_norm, dropout).with_rng(jax.random.key(7))
    params, batch = model.init(jax.random.key(0)), tiny_batch()
    spec = TangentSpec(num=k)
    exact = jax.jit(jax.grad(model))(params, batch)
    keys = jax.random.split(jax.random.key(1), R)
    losses, est = jax.jit(lambda ks: jax.lax.map(
        lambda k: layered_activity(model, spec, params, batch, k), ks))(keys)
    np.testing.assert_allclose(losses, jax.jit(model)(params, batch), rtol=1e-5)  # same mask
    z, snr = z_scores(est, exact)
    # About 300 coordinates, each z ~ N(0, 1) by the CLT: max |z| above 5 has probability < 1e-4.
    assert np.abs(z).max() < 5.0, np.abs(z).max()
    # The check has power: an estimate missing (zero) where the gradient is would give
    # |z| = |g| / standard error, far above the threshold for many coordinates.
    assert (np.abs(snr) > 10.0).sum() >= 5, np.sort(np.abs(snr))[-5:]


@pytest.mark.standard_promotion  # a user's flax model (nnx.avg_pool divides by an int) or plain nnx + optax
def test_weight_perturbation_and_backprop_accept_sequential():
    model = small_cnn()
    params, batch, key = model.init(None), tiny_batch(), jax.random.key(3)
    loss, g = jax.jit(lambda p, k: js.grad.backprop()(model, p, batch, k))(params, key)
    ref = jax.jit(jax.grad(model))(params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, ref)
    loss_f, gf = jax.jit(lambda p, k: js.grad.forward(num_tangents=2)(model, p, batch, k))(
        params, key)
    assert np.isclose(loss_f, loss) and jax.tree.structure(gf) == jax.tree.structure(g)


@pytest.mark.standard_promotion  # a user's flax model (nnx.avg_pool divides by an int) or plain nnx + optax
def test_batch_statistics_are_state():
    model = small_cnn(batch_norm=True)
    params, batch = model.init(None), tiny_batch()
    assert model.has_state and all(not jax.tree.leaves(s) for s in model.state[:2])
    new = model.update_state(params, model.state, batch["x"])
    h = model.layer(1, params[1], model.layer(0, params[0], batch["x"])[0])[0]
    mean = np.asarray(h).mean(axis=(0, 1, 2))
    # flax's default momentum 0.99: new = 0.99 * old + 0.01 * batch mean.
    np.testing.assert_allclose(new[2]["mean"], 0.99 * np.asarray(model.state[2]["mean"])
                               + 0.01 * mean, rtol=1e-5, atol=1e-7)
    # Batch statistics get no gradient entry: only parameters are differentiated.
    assert set(jax.grad(model)(params, batch)[2]) == {"bias", "scale"}


def test_errors_name_the_argument():
    model = small_cnn()
    params, batch = model.init(None), tiny_batch()
    with pytest.raises(TypeError, match=r"batch\['y'\].*integer"):
        model(params, {"x": batch["x"], "y": batch["y"].astype(jnp.float32)})
    with pytest.raises(ValueError, match="'x' has 6 examples, 'y' has 5"):
        model(params, {"x": batch["x"], "y": batch["y"][:5]})
    with pytest.raises(ValueError, match="loss: 'hinge'"):
        from_sequential([nnx.relu], loss="hinge")
    step = js.train_step(js.grad.backprop(), optax.sgd(0.1), model)
    with pytest.raises(TypeError, match=r"^train_step: key must be a PRNG key such as "
                                        r"jax.random.key\(0\); got int$"):
        step(params, step.init(params), batch, 0)


def tutorial_cnn(rngs):
    """The flax nnx MNIST-tutorial CNN (narrower), for 8x8 digits."""
    return nnx.Sequential(
        nnx.Conv(1, 8, (3, 3), rngs=rngs), nnx.relu, pool,
        nnx.Conv(8, 16, (3, 3), rngs=rngs), nnx.relu, pool,
        flatten, nnx.Linear(16 * 2 * 2, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 10, rngs=rngs))


# 60 steps of batch 64 (chance is 0.1): backprop is close to done, forward well on its way.
@pytest.mark.parametrize("estimator,lr,floor", [
    (js.grad.backprop(), 1e-2, 0.8),
    (js.grad.forward(num_tangents=4, perturb="activations"), 1e-2, 0.3)],
    ids=["backprop", "forward-activity"])
@pytest.mark.standard_promotion  # a user's flax model (nnx.avg_pool divides by an int) or plain nnx + optax
def test_tutorial_cnn_trains_on_digits(estimator, lr, floor):
    from jaxstream.data.digits import load_digits

    data = load_digits(seed=0, images=True)
    model = from_sequential(tutorial_cnn(nnx.Rngs(0)), loss="cross_entropy")
    params = model.init(None)
    step = js.train_step(estimator, optax.adam(lr), model)
    opt_state = step.init(params)
    test = {k: jnp.asarray(v) for k, v in data.test.items()}
    accuracy = jax.jit(model.accuracy)
    before = float(accuracy(params, test))
    rng = np.random.default_rng(0)
    for s in range(60):
        idx = rng.choice(len(data.train["y"]), 64, replace=False)
        batch = {k: jnp.asarray(v[idx]) for k, v in data.train.items()}
        params, opt_state, loss = step(params, opt_state, batch, jax.random.key(s))
    after = float(accuracy(params, test))
    assert np.isfinite(float(loss))
    assert before < 0.2 and after > floor, (before, after)


class _TiedHead(nnx.Module):
    """An output head that reuses an embedding table (a tied GPT's head)."""

    def __init__(self, embed: nnx.Embed):
        self.embed = embed

    def __call__(self, h):
        return h @ self.embed.embedding[...].T


def _tied_model(rngs):
    emb = nnx.Embed(10, 4, rngs=rngs)
    return nnx.Sequential(emb, lambda h: h.mean(axis=1), nnx.Linear(4, 4, rngs=rngs), nnx.tanh,
                          _TiedHead(emb))


def _token_batches(n):
    rng = np.random.default_rng(0)
    return [{"x": jnp.asarray(rng.integers(0, 10, (8, 5)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, 10, (8,)), jnp.int32)} for _ in range(n)]


@pytest.mark.standard_promotion  # a user's flax model (nnx.avg_pool divides by an int) or plain nnx + optax
def test_tied_weights_stay_one_parameter_trained_as_plain_nnx_trains_them():
    """A head that reuses the embedding table: one parameter, as nnx counts it; its gradient
    summed over both uses; three Adam steps equal to plain nnx training of the same model, and
    the trained model handed back with the tie in place."""
    plain = _tied_model(nnx.Rngs(0))
    model = from_sequential(_tied_model(nnx.Rngs(0)), loss="cross_entropy")
    params = model.init(None)
    count = lambda tree: sum(np.size(x) for x in jax.tree.leaves(tree))
    assert count(params) == count(nnx.state(plain, nnx.Param)) == 10 * 4 + 4 * 4 + 4

    def plain_loss(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean()

    batches = _token_batches(3)
    g_plain = nnx.grad(plain_loss)(plain, batches[0])
    g = jax.grad(model)(params, batches[0])
    np.testing.assert_allclose(g[0]["embedding"], g_plain["layers"][0]["embedding"][...],
                               rtol=1e-5, atol=1e-7)

    opt = nnx.Optimizer(plain, optax.adam(1e-2), wrt=nnx.Param)
    step = js.train_step(js.grad.backprop(), optax.adam(1e-2), model)
    opt_state = step.init(params)
    for i, b in enumerate(batches):
        opt.update(plain, nnx.grad(plain_loss)(plain, b))
        params, opt_state, _ = step(params, opt_state, b, jax.random.key(i))
    trained = model.to_nnx(params)
    assert trained.layers[4].embed.embedding is trained.layers[0].embedding  # still tied
    np.testing.assert_allclose(trained.layers[0].embedding[...], plain.layers[0].embedding[...],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained.layers[2].kernel[...], plain.layers[2].kernel[...],
                               rtol=1e-5, atol=1e-6)


def test_a_module_placed_twice_gets_the_sum_of_both_uses_gradients():
    rngs = nnx.Rngs(0)
    lin = nnx.Linear(4, 4, rngs=rngs)
    model = from_sequential([lin, nnx.tanh, lin], loss="mse")
    params = model.init(None)
    assert params[2] == {} and len(jax.tree.leaves(params)) == 2
    x = jax.random.normal(jax.random.key(1), (6, 4))
    batch = {"x": x, "y": jnp.zeros((6, 4))}
    w, b = lin.kernel[...], lin.bias[...]
    ref = jax.grad(lambda w, b: jnp.mean(jnp.mean((jnp.tanh(x @ w + b) @ w + b) ** 2, axis=1)),
                   argnums=(0, 1))(w, b)
    g = jax.grad(model)(params, batch)
    np.testing.assert_allclose(g[0]["kernel"], ref[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g[0]["bias"], ref[1], rtol=1e-5, atol=1e-7)
    # every micro-batch exact: the hybrid's exact part runs the tied model as a whole
    micro = {"x": x.reshape(2, 3, 4), "y": jnp.zeros((2, 3, 4))}
    _, gh = js.grad.hybrid(num_exact=2, correction="replace")(model, params, micro,
                                                             jax.random.key(0))
    np.testing.assert_allclose(gh[0]["kernel"], ref[0], rtol=1e-5, atol=1e-6)


def test_a_tie_is_refused_by_name_where_layers_run_alone():
    """Stack views and layer-by-layer estimators give each layer its own parameters, so a tie
    would be undone: refused, naming the layers and the parameter."""
    from jaxstream.models.seq_stack import as_stack

    model = from_sequential(_tied_model(nnx.Rngs(0)), loss="cross_entropy")
    with pytest.raises(ValueError, match=r"layer 4 shares its parameter 'embed/embedding' with "
                                         r"layer 0 \('embedding', tied weights\)"):
        as_stack(model)
    with pytest.raises(ValueError, match=r"layer 4 shares its parameter 'embed/embedding'"):
        js.grad.forward(perturb="activations")(model, model.init(None), _token_batches(1)[0],
                                               jax.random.key(0))
    untied = from_sequential([nnx.Embed(10, 4, rngs=nnx.Rngs(0)), lambda h: h.mean(axis=1),
                              nnx.Linear(4, 4, rngs=nnx.Rngs(1)),
                              _TiedHead(nnx.Embed(10, 4, rngs=nnx.Rngs(2)))])
    assert len(jax.tree.leaves(untied.init(jax.random.key(0)))) == 4


def test_trained_params_go_back_into_an_nnx_model():
    """to_nnx is the inverse of from_sequential: the rebuilt nnx model, holding changed
    parameters and statistics, computes what the Sequential computes with them."""
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(5, 7, rngs=rngs), nnx.BatchNorm(7, rngs=rngs), nnx.relu,
                           nnx.Linear(7, 3, rngs=rngs))
    seq = from_sequential(model)
    params = jax.tree.map(lambda a: a * 1.5 + 0.1, seq.init(jax.random.key(0)))  # "trained"
    x = jax.random.normal(jax.random.key(1), (4, 5))
    state = seq.update_state(params, seq.state, x)  # running statistics moved
    back = seq.to_nnx(params, state)
    assert isinstance(back, nnx.Sequential) and back.layers[2] is nnx.relu
    back.eval()  # running averages, as Sequential.apply's evaluation mode
    np.testing.assert_allclose(back(x), seq.apply(params, x, state), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(back.layers[0].kernel.value, params[0]["kernel"])
    assert not np.allclose(back.layers[0].kernel.value, model.layers[0].kernel.value)
    with pytest.raises(ValueError, match="one entry per layer"):
        seq.to_nnx(params[:2])


@pytest.mark.standard_promotion  # a user's flax model (nnx.avg_pool divides by an int) or plain nnx + optax
def test_evaluating_a_batchnorm_model_needs_its_statistics():
    """Evaluation of a model with batch statistics without them is refused (it would use the
    initial running averages); the runner refuses such a model before any compute."""
    from jaxstream.experiment import compiled
    from jaxstream.experiment.config import ConfigError

    model = small_cnn(batch_norm=True)
    params, x = model.init(None), tiny_batch()["x"]
    with pytest.raises(ValueError, match="state: this model keeps batch statistics"):
        model.apply(params, x)
    model.apply(params, x, model.state)  # the initial statistics, on purpose
    model.apply(params, x, train=True)  # training mode uses the batch's own statistics

    class BN:
        def build(self, info):
            return model

    cfg = type("Cfg", (), {"model": BN(), "engine": type("E", (), {"places_blocks": False})()})
    with pytest.raises(ConfigError, match="model: BN builds a model with batch statistics"):
        compiled.model_for(cfg, {"in_dim": 36})
