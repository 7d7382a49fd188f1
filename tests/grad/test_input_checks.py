"""Wrong calls fail at once with the argument's name; dtypes other than float32 work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from tests.grad.helpers import flat, tiny_problem


def test_a_flat_batch_given_to_hybrid_names_the_missing_micro_batch_axis():
    stack, params, batch, _ = tiny_problem()
    with pytest.raises(ValueError, match=r"batch\['y'\] has shape \(16,\).*micro-batch axis"):
        jg.hybrid(1)(stack, params, batch, jax.random.key(0))


@pytest.mark.parametrize("est", [jg.forward(), jg.hybrid(1), jg.backprop()],
                         ids=["forward", "hybrid", "backprop"])
def test_wrong_key_labels_and_lengths_are_named(est):
    stack, params, batch, micro = tiny_problem()
    data = batch if not isinstance(est, jg.Hybrid) else micro
    key = jax.random.key(0)
    with pytest.raises(TypeError, match="key must be a PRNG key"):
        est(stack, params, data, 0)
    with pytest.raises(TypeError, match=r"batch\['y'\] holds float32.*integer class labels"):
        est(stack, params, {**data, "y": data["y"].astype(jnp.float32)}, key)
    if not isinstance(est, jg.Backprop):
        with pytest.raises(TypeError, match="key is required"):
            est(stack, params, data, None)
        short = {**data, "y": data["y"][..., :-1]}
        with pytest.raises(ValueError, match=r"disagree in their number of examples"):
            est(stack, params, short, key)
    # a raw uint32 key is a key too
    assert np.isfinite(float(est(stack, params, data, jax.random.PRNGKey(0))[0]))


@pytest.mark.parametrize("est", [jg.forward(), jg.hybrid(1), jg.backprop(), jg.spsa()],
                         ids=["forward", "hybrid", "backprop", "spsa"])
def test_an_empty_batch_is_refused_by_name(est):
    stack, params, batch, micro = tiny_problem()
    data = micro if isinstance(est, jg.Hybrid) else batch
    empty = jax.tree.map(lambda a: a[..., :0, :] if a.ndim > data["y"].ndim else a[..., :0],
                         data)
    with pytest.raises(ValueError, match=r"the batch holds no examples \(batch\['y'\] has "
                                         r"shape \((\d+, )?0,?\)\)"):
        est(stack, params, empty, jax.random.key(0))


@pytest.mark.parametrize("est", [jg.forward(), jg.hybrid(1), jg.backprop(), jg.spsa()],
                         ids=["forward", "hybrid", "backprop", "spsa"])
def test_a_wrong_feature_count_is_named_before_the_trace(est):
    stack, params, batch, micro = tiny_problem()
    data = micro if isinstance(est, jg.Hybrid) else batch
    wide = {**data, "x": jnp.concatenate([data["x"], data["x"][..., :1]], axis=-1)}
    with pytest.raises(ValueError, match=r"batch\['x'\] \(float32, shape .* does not fit the model's "
                                         r"input \(dot_general"):
        est(stack, params, wide, jax.random.key(0))


def test_antithetic_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"antithetic: .*\(∇L·\(−v\)\)\(−v\) = \(∇L·v\)v"):
        jg.forward(num_tangents=2, antithetic=True, aggregation="projection")


@pytest.mark.parametrize("perturb", ["weights", "activations"])
def test_bf16_params_and_activations_give_the_fp32_estimate(perturb):
    """Rademacher tangents are the same ±1 in bf16: the bf16 estimate is the fp32 one up to
    bf16 rounding (the carries used to change dtype and crash)."""
    stack, params, batch, _ = tiny_problem()
    est = jg.forward(num_tangents=2, perturb=perturb)
    key = jax.random.key(3)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    b16 = {**batch, "x": batch["x"].astype(jnp.bfloat16)}
    loss16, g16 = jax.jit(lambda p: est(stack, p, b16, key))(p16)
    loss32, g32 = jax.jit(lambda p: est(stack, p, batch, key))(params)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(g16))
    f16, f32 = flat(g16).astype(jnp.float32), flat(g32)
    rel = float(jnp.linalg.norm(f16 - f32) / jnp.linalg.norm(f32))
    assert rel < 0.05, rel
    assert abs(float(loss16) - float(loss32)) < 0.05 * abs(float(loss32))


def test_float64_activations_work_for_activity_perturbation():
    stack, params, batch, _ = tiny_problem()
    est = jg.forward(num_tangents=2, perturb="activations")
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        b64 = {**batch, "x": jnp.asarray(batch["x"], jnp.float64)}
        _, g64 = est(stack, p64, b64, jax.random.key(3))
        assert all(a.dtype == jnp.float64 for a in jax.tree.leaves(g64))
    _, g32 = est(stack, params, batch, jax.random.key(3))
    np.testing.assert_allclose(np.asarray(flat(g64)), np.asarray(flat(g32)), rtol=1e-4, atol=1e-6)
