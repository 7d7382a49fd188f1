"""The hybrid variance model (:mod:`jaxstream_lab.hybrid_variance`) against Monte Carlo of
the library's own estimators: each correction's E‖ĝ − g‖² over R keys on a fixed small MLP and
batch, within 4 standard errors of the Monte-Carlo mean (the model's own Monte-Carlo error added
for ``stein``), at two settings of (N, S, K); and a wrong formula fails the same check."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.quality.baselines import MicrobatchForward
from jaxstream_lab import hybrid_variance as hv

KEYS = 4096  # running them is cheap; compiling is not
Z = 4.0  # standard errors allowed
SETTINGS = [(8, 2, 1), (8, 4, 2)]  # (N, S, K)


def _flat(tree):
    return ravel_pytree(tree)[0]


@functools.cache
def problem(n: int):
    """A fixed MLP (P = 1028), a fixed batch of N micro-batches of 4 examples, the per-micro-batch
    gradients (float64) and each coordinate's segment (embed, each block, head)."""
    stack = mlp(8, 16, 3, 4)
    params = stack.init(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(kx, (n, 4, 8)), "y": jax.random.randint(ky, (n, 4), 0, 4)}
    grads = np.asarray(jax.vmap(lambda b: _flat(jax.grad(stack)(params, b)))(batch), np.float64)
    return stack, params, batch, grads, hv.segment_ids(params)


def estimator(name: str, s: int, k: int):
    """The library's estimator called ``name`` at S exact micro-batches and K tangents."""
    if name == "exact_subset":
        return jg.exact_subset(s)
    if name == "forward_micro":
        return MicrobatchForward(jg.forward(k))
    return jg.hybrid(s, name, k)


@functools.cache
def squared_errors(n: int, s: int, k: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """‖ĝ − g‖² of each named estimator for KEYS keys, all in one compiled program (compiling
    dominates: one program per setting), in float64 on the host."""
    stack, params, batch, grads, _ = problem(n)
    g = grads.mean(0)
    ests = [estimator(name, s, k) for name in names]
    run = jax.jit(jax.vmap(lambda key: [_flat(e(stack, params, batch, key)[1]) for e in ests]))
    out = run(jax.random.split(jax.random.key(7), KEYS))
    return {name: ((np.asarray(e, np.float64) - g) ** 2).sum(1) for name, e in zip(names, out)}


def check(sq: np.ndarray, predicted: float, model_se: float = 0.0) -> tuple[float, float]:
    """(|measured − predicted|, tolerance = Z · combined standard error)."""
    se = math.sqrt(sq.var(ddof=1) / len(sq) + model_se ** 2)
    return abs(sq.mean() - predicted), Z * se


FAST = ("exact_subset", "control_variate", "weighted")  # one program
REST = ("replace", "stein", "guess")


def predictions(n: int, s: int, k: int) -> dict[str, tuple[float, float]]:
    """The model's MSE (and its own standard error) of each estimator at (N, S, K)."""
    *_, grads, segments = problem(n)
    m = hv.moments(grads)
    nu = hv.noise_ratio(m.size, k)
    beta = hv.weighted_beta(n, s, k, m.size)
    return {
        "exact_subset": (hv.exact_subset(m, s), 0.0),
        "replace": (hv.replace(m, s, nu), 0.0),
        "control_variate": (hv.control_variate(m, s, nu), 0.0),
        "weighted": (hv.weighted(m, s, nu, beta), 0.0),
        "weighted_gain": ((beta ** 2 - 2 * beta) * hv.exact_subset(m, s)
                          + beta ** 2 * hv.control_variate(m, s, nu), 0.0),
        "guess": (hv.guess_mse(grads, s), 0.0),
        "forward_micro": (hv.forward_micro(m, nu), 0.0),
        "stein": hv.stein_mse(grads, segments, s, k),
    }


def assert_matches(n: int, s: int, k: int, names: tuple[str, ...]) -> None:
    sq = squared_errors(n, s, k, names)
    if "weighted" in sq and "exact_subset" in sq:
        # paired by key (the same selection): resolved far more finely than either MSE
        sq = {**sq, "weighted_gain": sq["weighted"] - sq["exact_subset"]}
    pred = predictions(n, s, k)
    for name, errors in sq.items():
        value, model_se = pred[name]
        err, tol = check(errors, value, model_se)
        assert err <= tol, (f"{name} N={n} S={s} K={k}: measured {errors.mean():.5g}, model "
                            f"{value:.5g}: |difference| {err:.3g} > {tol:.3g}")


def test_linear_corrections_match_the_model():
    assert_matches(*SETTINGS[0], FAST)


@pytest.mark.slow
def test_every_correction_matches_the_model_at_two_settings():
    """The rest at the first setting, the linear ones and ``stein`` at the second (``stein``
    against its large-P model, its own Monte-Carlo error in the tolerance)."""
    assert_matches(*SETTINGS[0], REST)
    assert_matches(*SETTINGS[1], FAST + ("stein",))


def test_a_wrong_formula_fails_the_check():
    """The same check rejects the control variate's MSE without the (1 + 1/S) of h's own noise
    (E‖g_n − h‖² taken as σ²: 2/3 of the right value at S = 2) and weighted's gain over the
    subset without β² B (the tangent noise its β lets in)."""
    n, s, k = SETTINGS[0]
    *_, grads, _ = problem(n)
    m = hv.moments(grads)
    nu, beta = hv.noise_ratio(m.size, k), hv.weighted_beta(n, s, k, m.size)
    sq = squared_errors(n, s, k, FAST)
    wrong = {
        "control_variate": (sq["control_variate"], nu * (n - s) * m.spread / n ** 2),
        "weighted_gain": (sq["weighted"] - sq["exact_subset"],
                          (beta ** 2 - 2 * beta) * hv.exact_subset(m, s)),
    }
    for name, (errors, value) in wrong.items():
        err, tol = check(errors, value)
        assert err > tol, f"{name}: a wrong formula passed ({err:.4g} <= {tol:.4g})"


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="grads"):
        hv.moments(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="distribution"):
        hv.kappa(10, "uniform")
    with pytest.raises(ValueError, match="num_exact"):
        hv.exact_subset(hv.Moments(4, 10, 1.0, 1.0, 1.0), 5)


def test_critical_nu_is_where_the_best_hybrid_meets_the_subset_at_equal_cost():
    """Just below ν* the best fixed-β hybrid beats the exact subset bought with its compute,
    just above it does not; where that subset is the whole batch ν* = 0."""
    m = hv.Moments(num=64, size=1000, spread=40.0, second=41.0, full=2.0)
    costs = hv.Costs(0.75, 1.94, 3.32, 2.68)
    nu = hv.critical_nu(m, 1, costs, costs.forward(1))
    s_eq = costs.subset_at(costs.hybrid(1, 64, 1), 64)
    assert 1.0 < s_eq < 64 and nu > 0
    subset = hv.exact_subset(m, s_eq)
    assert hv.best_weighted(m, 1, nu * 0.999) < subset < hv.best_weighted(m, 1, nu * 1.001)
    assert hv.critical_nu(m, 32, costs, costs.forward(1)) == 0.0  # S' = N: backprop
    assert hv.rho(hv.nu_of_rho(0.3)) == pytest.approx(0.3)


def test_segment_ids_follow_the_stack_layout():
    """Each segment's count is its parameter count (embed, each block, head), in the order
    ravel_pytree flattens them."""
    _, params, *_ = problem(8)
    size = lambda t: sum(x.size for x in jax.tree.leaves(t))
    layers = jax.tree.leaves(params["blocks"])[0].shape[0]
    want = [size(params["embed"])] + [size(params["blocks"]) // layers] * layers + [
        size(params["head"])]
    assert np.bincount(hv.segment_ids(params)).tolist() == want
