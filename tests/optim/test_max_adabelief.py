"""Max-AdaBelief against a float64 NumPy reference and against optax.adabelief."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxstream.optim import max_adabelief

STEPS = 100


def _grads(seed: int = 0) -> np.ndarray:
    """Noisy gradients whose noise shrinks over time, so the running maximum matters."""
    rng = np.random.default_rng(seed)
    scale = np.linspace(3.0, 0.1, STEPS)[:, None, None]
    return rng.normal(size=(STEPS, 3, 4)) * scale + 0.2


def _reference(grads, lr, b1, b2, eps, eps_root, use_max, max_of="raw"):
    """The formulas, in float64 NumPy."""
    params = np.zeros(grads.shape[1:])
    m = np.zeros_like(params)
    s = np.zeros_like(params)
    s_max = np.zeros_like(params)
    out = []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * (g - m) ** 2 + eps_root
        m_hat = m / (1 - b1**t)
        if use_max and max_of == "corrected":
            s_max = np.maximum(s_max, s / (1 - b2**t))
            s_hat = s_max
        else:
            s_max = np.maximum(s_max, s) if use_max else s
            s_hat = s_max / (1 - b2**t)
        params = params - lr * m_hat / (np.sqrt(s_hat) + eps)
        out.append(params.copy())
    return np.stack(out)


def _run(opt, grads, dtype):
    params = {"w": jnp.zeros(grads.shape[1:], dtype)}
    state = opt.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = opt.update({"w": g}, state, params)
        return optax.apply_updates(params, updates), state

    out = []
    for g in grads:
        params, state = step(params, state, jnp.asarray(g, dtype))
        out.append(np.asarray(params["w"]))
    return np.stack(out)


@pytest.mark.parametrize("use_max", [True, False])
@pytest.mark.parametrize("eps,eps_root", [(1e-16, 1e-16), (1e-3, 1e-4)])
def test_matches_float64_numpy_reference(use_max, eps, eps_root):
    grads = _grads()
    kw = {"b1": 0.9, "b2": 0.99, "eps": eps, "eps_root": eps_root}
    expected = _reference(grads, 1e-2, use_max=use_max, **kw)
    with jax.enable_x64(True):
        got = _run(max_adabelief(1e-2, use_max=use_max, **kw), grads, jnp.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("b2", [0.99, 0.999])
def test_corrected_maximum_matches_reference(b2):
    grads = _grads(4)
    kw = {"b1": 0.9, "b2": b2, "eps": 1e-16, "eps_root": 1e-16}
    expected = _reference(grads, 1e-2, use_max=True, max_of="corrected", **kw)
    with jax.enable_x64(True):
        got = _run(max_adabelief(1e-2, max_of="corrected", **kw), grads, jnp.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    raw = _reference(grads, 1e-2, use_max=True, **kw)
    assert np.max(np.abs(expected - raw)) > 1e-3


def test_bad_max_of_is_an_error():
    with pytest.raises(ValueError, match="max_of: 'mean' is not allowed"):
        max_adabelief(1e-3, max_of="mean")


@pytest.mark.parametrize("kw, says", [
    ({"b2": 1.0}, "b2 must be in [0, 1), got 1.0"),  # the belief never leaves 0
    ({"b1": 1.5}, "b1 must be in [0, 1), got 1.5"),
    ({"b1": -0.1}, "b1 must be in [0, 1)"),
    ({"eps": -1e-8}, "eps must be >= 0"),
    ({"eps_root": float("nan")}, "eps_root must be >= 0"),
])
def test_hyperparameters_out_of_range_are_refused_by_name(kw, says):
    with pytest.raises(ValueError, match=re.escape(f"max_adabelief: {says}")):
        max_adabelief(1e-3, **kw)
    max_adabelief(1e-3, b1=0.0, b2=0.0, eps=0.0, eps_root=0.0)  # the ends that are allowed


def test_maximum_changes_the_trajectory():
    grads = _grads()
    kw = {"b1": 0.9, "b2": 0.99, "eps": 1e-16, "eps_root": 1e-16}
    with_max = _reference(grads, 1e-2, use_max=True, **kw)
    without = _reference(grads, 1e-2, use_max=False, **kw)
    assert np.max(np.abs(with_max - without)) > 1e-3


@pytest.mark.standard_promotion  # steps optax.adabelief itself
@pytest.mark.parametrize("nesterov", [False, True])
def test_without_maximum_equals_optax_adabelief_exactly(nesterov):
    grads = _grads(1)
    kw = {"b1": 0.8, "b2": 0.95, "eps": 1e-8, "eps_root": 1e-10, "nesterov": nesterov}
    ours = _run(max_adabelief(3e-2, use_max=False, **kw), grads, jnp.float32)
    theirs = _run(optax.adabelief(3e-2, **kw), grads, jnp.float32)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.standard_promotion  # steps optax.adabelief itself
def test_schedule_and_defaults_match_optax_signature():
    sched = optax.linear_schedule(1e-2, 1e-3, 50)
    grads = _grads(2)[:20]
    ours = _run(max_adabelief(sched, use_max=False), grads, jnp.float32)
    theirs = _run(optax.adabelief(sched), grads, jnp.float32)
    np.testing.assert_array_equal(ours, theirs)


def test_layer_by_layer_equals_whole_stack():
    """A streaming engine updates one layer's slice at a time on the host; elementwise
    state makes that equal to updating the stacked params at once."""
    rng = np.random.default_rng(3)
    layers, steps = 3, 5
    grads = rng.normal(size=(steps, layers, 4, 2)).astype(np.float32)
    opt = max_adabelief(1e-2)
    whole = _run(opt, grads, jnp.float32)
    for layer in range(layers):
        sliced = _run(opt, grads[:, layer], jnp.float32)
        np.testing.assert_array_equal(sliced, whole[:, layer])
