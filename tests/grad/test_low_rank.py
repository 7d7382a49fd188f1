"""Low-rank tangents (``TangentSpec(rank=r)``, ``forward(rank=r)``): v = A Bᵀ / √r on each
matrix leaf. Checked against the identity E[v vᵀ] = I (a float64 Monte Carlo whose tolerance is
each entry's standard error), against ``jax.grad`` for the forward gradient's mean, and against
a matrix rank computed by NumPy."""

import jax
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad.tangents import TangentSpec
from tests.grad.helpers import estimates, flat, tiny_problem

Z = 5.0  # standard errors allowed per entry (the largest of 144 entries of a 12 x 12 moment)


def second_moment(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean of vec(v) vec(v)ᵀ over the R draws, each entry's standard error), float64."""
    v = np.asarray(v, np.float64).reshape(v.shape[0], -1)
    outer = v[:, :, None] * v[:, None, :]
    return outer.mean(0), outer.std(0, ddof=1) / np.sqrt(v.shape[0])


def draws(spec: TangentSpec, shape: tuple[int, ...], r: int, seed: int = 0) -> np.ndarray:
    keys = jax.random.split(jax.random.key(seed), r)
    return np.asarray(jax.jit(jax.vmap(lambda k: spec.sample(k, shape)[0]))(keys))


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_second_moment_is_the_identity(distribution, rank):
    """E[vec(v) vec(v)ᵀ] = I for v = A Bᵀ / √r of a (4, 3) leaf: over 20,000 keys every one of
    the 144 entries within Z standard errors of the identity's (a Rademacher rank-1 tangent's
    squares are exactly 1: standard error 0, the entry must be exact). Scaled by √2 (the
    moment 2I) the same check fails."""
    v = draws(TangentSpec(1, distribution, rank=rank), (4, 3), 20_000)
    mean, se = second_moment(v)
    tol = Z * se + 1e-12
    dev = np.abs(mean - np.eye(12))
    print(f"{distribution} rank {rank}: max |E vvᵀ − I| {dev.max():.4f}, tolerance there "
          f"{tol.flat[dev.argmax()]:.4f}, worst ratio {np.max(dev / tol):.2f}")
    assert np.all(dev <= tol), np.max(dev / tol)
    wrong, wrong_se = second_moment(np.sqrt(2.0) * v)
    assert np.any(np.abs(wrong - np.eye(12)) > Z * wrong_se + 1e-12)


@pytest.mark.parametrize("rank", [1, 2])
def test_matrix_leaves_have_rank_r_and_the_others_full_tangents(rank):
    spec = TangentSpec(3, "gaussian", rank=rank)
    key = jax.random.key(1)
    v = np.asarray(spec.sample(key, (6, 5)))
    assert v.shape == (3, 6, 5)
    assert [np.linalg.matrix_rank(m) for m in v] == [rank] * 3
    full = np.asarray(TangentSpec(3, "gaussian").sample(key, (6, 5)))
    assert np.linalg.matrix_rank(full[0]) == 5  # a full tangent is not low-rank
    # vectors and 3-D leaves (biases; a stacked or a conv kernel) get the full tangents' draws
    for shape in ((7,), (2, 3, 4)):
        np.testing.assert_array_equal(spec.sample(key, shape),
                                      TangentSpec(3, "gaussian").sample(key, shape))


def test_forward_gradient_with_low_rank_tangents_is_unbiased():
    """Mean of 3000 estimates forward(rank=2) vs ``jax.grad``: each coordinate within 4.5 of its
    standard errors, mean z² near 1 (sd √(2/n) for n coordinates)."""
    stack, params, batch, _ = tiny_problem()
    est = jg.forward(1, "gaussian", rank=2)
    r = 3000
    samples = np.asarray(estimates(est, stack, params, batch,
                                   jax.random.split(jax.random.key(11), r)), np.float64)
    exact = np.asarray(flat(jax.grad(stack)(params, batch)), np.float64)
    z = (samples.mean(0) - exact) / (samples.std(0, ddof=1) / np.sqrt(r))
    print(f"max |z| {np.max(np.abs(z)):.2f} over {z.size}, mean z² {np.mean(z**2):.3f}")
    assert np.max(np.abs(z)) < 4.5
    assert abs(np.mean(z**2) - 1.0) < 5 * np.sqrt(2.0 / z.size)


def test_layered_pass_equals_generic_pass():
    """Low-rank tangents drawn per layer inside the scan give the materialised ones' estimate."""
    stack, params, batch, _ = tiny_problem()
    est = jg.forward(2, "gaussian", rank=2)
    key = jax.random.key(3)
    _, g1 = jax.jit(lambda p: est(stack, p, batch, key))(params)
    _, g2 = jax.jit(lambda p: est(lambda q, b: stack(q, b), p, batch, key))(params)
    np.testing.assert_allclose(flat(g1), flat(g2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build, match", [
    (lambda: jg.forward(rank=0), r"rank must be None \(full tangents\) or an int >= 1, got 0"),
    (lambda: TangentSpec(2, rank=-1), r"rank must be None .* or an int >= 1, got -1"),
    (lambda: jg.forward(rank=2, perturb="activations"),
     r"rank=2: low-rank tangents are for weight matrices; allowed: perturb='weights'"),
    (lambda: jg.forward(2, rank=2, orthogonal=True),
     r"orthogonal=True with rank: .* allowed: orthogonal=False with rank, or rank=None"),
    (lambda: jg.spsa(rank=0), r"rank must be None \(full tangents\) or an int >= 1, got 0"),
])
def test_bad_rank_is_one_clear_error_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()
