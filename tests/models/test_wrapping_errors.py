"""A user's nnx model handed over the wrong way is refused in one line naming the fix; a legacy
``jax.random.PRNGKey`` is the same key to ``js.train_step`` as to the estimators."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream as js
from jaxstream.models.sequential import from_sequential


def nnx_mlp():
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 3, rngs=rngs))


def data(n=6):
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (n, 4)), "y": jax.random.randint(ky, (n,), 0, 3)}


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


@pytest.mark.parametrize("est", [js.grad.backprop(), js.grad.forward(2)],
                         ids=["backprop", "forward"])
def test_a_raw_nnx_sequential_given_to_an_estimator_names_from_sequential(est):
    seq = nnx_mlp()
    message = (r"^(backprop|forward): loss_fn is an nnx module \(Sequential\), not a loss "
               r"function .* js\.models\.from_sequential\(seq, loss='cross_entropy'\)")
    with pytest.raises(TypeError, match=message) as err:
        est(seq, nnx.state(seq, nnx.Param), data(), jax.random.key(0))
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match=r"^train_step: loss_fn is an nnx module"):
        js.train_step(est, optax.sgd(0.1), seq)


def test_from_sequential_of_a_module_or_a_number_names_what_it_accepts():
    with pytest.raises(TypeError, match=r"^model: expected an nnx.Sequential or a list of layers, "
                                        r"got MLP \(an nnx.Module\): .*\[MLP\(\.\.\.\)\]") as err:
        from_sequential(MLP(nnx.Rngs(0)))
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match=r"^model: expected an nnx.Sequential or a list of layers, "
                                        r"got int \(not a sequence\)"):
        from_sequential(3)
    # the fix it names works: the module as a one-layer model
    model = from_sequential([MLP(nnx.Rngs(0))])
    assert model.num_layers == 1 and np.isfinite(float(model(model.init(None), data())))


def test_train_step_takes_a_legacy_prng_key_as_the_same_key():
    """PRNGKey(s) and key(s) give the same step, bit for bit (dropout and tangents)."""
    model = from_sequential(nnx.Sequential(*nnx_mlp().layers, nnx.Dropout(0.5, rngs=nnx.Rngs(1))))
    params, batch = model.init(None), data()
    step = js.train_step(js.grad.forward(2), optax.sgd(0.1), model)
    typed = step(params, step.init(params), batch, jax.random.key(3))
    legacy = step(params, step.init(params), batch, jax.random.PRNGKey(3))
    other = step(params, step.init(params), batch, jax.random.key(4))
    for a, b in zip(jax.tree.leaves(typed), jax.tree.leaves(legacy)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(typed[2], other[2])
    with pytest.raises(TypeError, match=r"^train_step: key must be a PRNG key such as "
                                        r"jax\.random\.key\(0\); got ndarray of dtype int32"):
        step(params, step.init(params), batch, np.zeros(2, np.int32))
    assert jnp.isfinite(typed[2])


def model_with_blocks():
    rngs = nnx.Rngs(0)
    return from_sequential(nnx.Sequential(
        nnx.Linear(4, 8, rngs=rngs), nnx.relu,
        *[m for _ in range(3) for m in (nnx.Linear(8, 8, rngs=rngs), nnx.tanh)],
        nnx.Linear(8, 3, rngs=rngs)))


@pytest.mark.parametrize("padded", [False, True], ids=["as_stack", "as_padded_stack"])
@pytest.mark.parametrize("est", [js.grad.backprop(), js.grad.forward(2)],
                         ids=["backprop", "forward"])
def test_a_view_given_as_loss_fn_names_view_stack(est, padded):
    model = model_with_blocks()
    view = (js.models.as_padded_stack(model, data()["x"]) if padded
            else js.models.as_stack(model))
    sp = view.params(model.init(None))
    with pytest.raises(TypeError, match=r"^(backprop|forward): loss_fn is a (StackView|PaddedView)"
                                        r" .*pass view\.stack with view\.params\(params\)") as err:
        est(view, sp, data(), jax.random.key(0))
    assert "\n" not in str(err.value)
    assert np.isfinite(float(est(view.stack, sp, data(), jax.random.key(0))[0]))


class _Count(nnx.Variable):
    """A call counter a user's layer keeps."""


class _Counting(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.n = _Count(jnp.array(0, jnp.int32))

    def __call__(self, x):
        self.n[...] = self.n[...] + 1
        return self.lin(x)


@pytest.mark.parametrize("est", [js.grad.backprop(), js.grad.forward(2)])
def test_a_layer_that_changes_its_own_variable_is_named(est):
    """Before, flax's TraceContextError named neither the layer nor the variable."""
    rngs = nnx.Rngs(0)
    model = from_sequential(nnx.Sequential(nnx.Linear(4, 6, rngs=rngs), _Counting(6, rngs),
                                           nnx.Linear(6, 3, rngs=rngs)), loss="cross_entropy")
    batch = {"x": np.ones((4, 4), np.float32), "y": np.zeros(4, np.int32)}
    with pytest.raises(ValueError, match="layer 1: _Counting changes one of its own variables "
                                         "when called .*_Count"):
        est(model, model.init(None), batch, jax.random.key(0))
