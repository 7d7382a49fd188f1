"""The zeroth-order (SPSA / MeZO) estimator against references written here: in float64 (a
process of its own, tests/grad/spsa_float64_worker.py) the estimate equals the forward gradient
(∇L·v) v of the same directions up to its O(ε²) bias, which shrinks fourfold when ε halves and
matches the third-derivative term; its mean over keys is ``jax.grad``'s. In float32 here: the
layered pass equals the generic one, the directions are never held K at once, bad options are
one clear error at construction."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from tests.grad.helpers import flat, tiny_problem

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def float64_figures() -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "grad" / "spsa_float64_worker.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(figures, indent=1))
    return figures


@pytest.mark.slow
def test_bias_is_the_third_derivative_term_of_order_eps_squared(float64_figures):
    """Same directions, float64: ‖ĝ − (1/K) Σ (∇L·v_k) v_k‖ is small, shrinks by 4 (±10 %)
    when ε halves (1e-2 → 5e-3), and ĝ's bias / ε² is (1/6K) Σ ∇³L[v_k, v_k, v_k] v_k within
    a relative error that itself shrinks like ε² (the next term is O(ε⁴))."""
    b = float64_figures["bias"]
    assert b["float64"]
    assert b["rel_0.01"] < 1e-2 and b["rel_0.005"] < b["rel_0.01"]
    assert 3.6 < b["ratio"] < 4.4, b
    assert b["pred_err_0.01"] < 0.05 and b["pred_err_0.005"] < 0.05, b
    assert 3.0 < b["pred_err_0.01"] / b["pred_err_0.005"] < 5.0, b


@pytest.mark.slow
def test_quadratic_loss_gives_the_forward_gradient_exactly(float64_figures):
    """A quadratic loss has no third derivative: the central difference is ∇L·v exactly
    (generic path, low-rank directions on the loss's matrix)."""
    assert float64_figures["quadratic"] < 1e-10


@pytest.mark.slow
def test_mean_over_keys_is_the_gradient(float64_figures):
    """3000 keys at ε = 1e-3 (the bias ~1e-6 of the gradient, far below a standard error): each
    coordinate's mean within 4.5 of its standard errors of ``jax.grad``, mean z² near 1."""
    m = float64_figures["mean"]
    assert m["max_z"] < 4.5, m
    assert abs(m["mean_z2"] - 1.0) < 5 * np.sqrt(2.0 / m["coordinates"]), m


def test_layered_pass_equals_generic_pass():
    """A stack's perturbation drawn segment by segment inside the pass gives the estimate of
    the materialised directions (any loss function's path), for the same key, up to float32's
    resolution of a difference of two losses: |Δd_k| ≤ 8 ε₃₂ L / (2ε) per direction, and ĝ
    within that times the largest direction entry. (Low-rank directions: the generic path in
    the float64 quadratic check, the layered one against data parallelism in
    tests/grad/test_new_estimators_engines.py.)"""
    stack, params, batch, _ = tiny_problem()
    eps = 1e-2
    est = jg.spsa(3, eps=eps, distribution="gaussian")
    key = jax.random.key(4)
    l1, g1, diag1 = jax.jit(lambda p: est(stack, p, batch, key, diagnostics=True))(params)
    l2, g2, diag2 = jax.jit(lambda p: est(lambda q, b: stack(q, b), p, batch, key,
                                          diagnostics=True))(params)
    tol_d = 8 * np.finfo(np.float32).eps * float(l1) / (2 * eps)
    np.testing.assert_allclose(diag1["directional"], diag2["directional"], rtol=0, atol=tol_d)
    spec = jg.TangentSpec(1, "gaussian")
    keys = jax.vmap(lambda k: jax.random.fold_in(key, k))(jnp.arange(3))
    vs = jax.jit(jax.vmap(lambda k: flat(jg.tangents.tangents(spec, k, params))))(keys)
    v_max = float(np.max(np.abs(vs)))
    np.testing.assert_allclose(flat(g1), flat(g2), rtol=0, atol=tol_d * 3 * v_max)
    assert np.max(np.abs(flat(g1))) > 100 * tol_d * v_max  # the tolerance is far below ĝ
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    # the loss is the mean of L(θ ± εv): L(θ) + O(ε²)
    np.testing.assert_allclose(l1, stack(params, batch), rtol=1e-3)


def test_directions_are_never_held_at_once():
    """XLA's temporary buffers of a step with K = 16 directions are those of K = 1 (one layer's
    direction at a time), where the forward estimator's hold K tangents of a layer."""
    stack = mlp(in_dim=8, width=96, depth=3, num_classes=3)
    params = stack.init(jax.random.key(0))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    batch = {"x": jnp.ones((4, 8)), "y": jnp.zeros((4,), jnp.int32)}

    def temp(est) -> int:
        fn = jax.jit(lambda p: est(stack, p, batch, jax.random.key(0)))
        return fn.lower(params).compile().memory_analysis().temp_size_in_bytes

    one, many = temp(jg.spsa(1)), temp(jg.spsa(16))
    print(f"params {param_bytes} B; temporaries K=1 {one} B, K=16 {many} B")
    assert many <= one + param_bytes // 8
    assert temp(jg.forward(16)) > one + param_bytes  # the check can fail: K tangents a layer


@pytest.mark.parametrize("kwargs, match", [
    ({"eps": 0.0}, r"eps must be a finite float > 0, got 0.0"),
    ({"eps": -1e-3}, r"eps must be a finite float > 0, got -0.001"),
    ({"eps": float("nan")}, r"eps must be a finite float > 0, got nan"),
    ({"rank": 0}, r"rank must be None \(full tangents\) or an int >= 1, got 0"),
    ({"distribution": "uniform"},
     r"distribution must be one of \('rademacher', 'gaussian'\), got 'uniform'"),
    ({"num_directions": 0}, r"num_directions must be an int >= 1, got 0"),
])
def test_bad_options_are_one_clear_error_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jg.spsa(**kwargs)


def test_plan_is_a_zeroth_order_pass():
    """Engines read the plan: a zeroth-order forward pass that forms its own estimate."""
    plan = jg.spsa(4, rank=2).plan
    assert (plan.forward, plan.exact, plan.combine) == ("zeroth_order", "none", None)
    assert plan.describe() == "spsa(K=4, rank 2)" and plan.family == "forward"
    assert jg.spsa(2, 1e-3) == jg.spsa(2, 1e-3) and jg.spsa(2, 1e-3) != jg.spsa(2, 1e-2)
