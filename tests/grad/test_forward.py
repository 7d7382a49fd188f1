"""Forward-gradient estimators against jax.grad."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad.tangents import TangentSpec, combine, project, tangents
from tests.grad.helpers import estimates, flat, tiny_problem


def test_directional_derivatives_equal_grad_dot_tangent():
    stack, params, batch, _ = tiny_problem()
    spec = TangentSpec(3, "gaussian")
    key = jax.random.key(7)
    loss, d = jax.jit(lambda p: jg.stack_directional(stack, spec, p, batch, key))(params)
    g = jax.jit(jax.grad(stack))(params, batch)
    v = jax.jit(lambda p: tangents(spec, key, p))(params)
    expected = jnp.stack([jnp.vdot(flat(g), flat(jax.tree.map(lambda a, k=k: a[k], v))) for k in range(3)])
    np.testing.assert_allclose(d, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss, stack(params, batch), rtol=1e-6)


@pytest.mark.parametrize("dist", ["rademacher", "gaussian"])
def test_layered_pass_equals_generic_pass(dist):
    """Per-layer tangent regeneration inside the scan gives the materialised tangents' result."""
    stack, params, batch, _ = tiny_problem()
    est = jg.forward(num_tangents=2, distribution=dist)
    key = jax.random.key(1)
    l1, g1 = jax.jit(lambda p: est(stack, p, batch, key))(params)
    l2, g2 = jax.jit(lambda p: est(lambda q, b: stack(q, b), p, batch, key))(params)
    chex.assert_trees_all_close(g1, g2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)


def test_combine_and_project_match_materialised_tangents():
    _, params, _, _ = tiny_problem()
    spec = TangentSpec(3, "rademacher")
    keys = jax.random.split(jax.random.key(2), 4)
    coeffs = jax.random.normal(jax.random.key(3), (4, 3))
    got = jax.jit(lambda p: combine(spec, keys, coeffs, p))(params)
    vs = jax.jit(jax.vmap(lambda k: tangents(spec, k, params)))(keys)
    vs = [jax.tree.map(lambda a, n=n: a[n], vs) for n in range(4)]
    want = sum(coeffs[n, k] * flat(jax.tree.map(lambda a, k=k: a[k], vs[n])) for n in range(4) for k in range(3))
    np.testing.assert_allclose(flat(got), want, rtol=1e-5, atol=1e-6)
    h = jax.tree.map(lambda a: jnp.ones_like(a) * 0.5, params)
    proj = jax.jit(lambda t: project(spec, keys, t))(h)
    want_p = np.array([[jnp.vdot(flat(h), flat(jax.tree.map(lambda a, k=k: a[k], vs[n]))) for k in range(3)] for n in range(4)])
    np.testing.assert_allclose(proj, want_p, rtol=1e-5)


def test_orthogonal_tangents_and_antithetic_refused():
    spec = TangentSpec(4, "gaussian", orthogonal=True)
    v = spec.sample(jax.random.key(0), (10, 3)).reshape(4, -1)
    np.testing.assert_allclose(v @ v.T, 30.0 * np.eye(4), atol=1e-3)
    # a ±v pair gives a jvp estimate (∇L·v)v twice: nothing but compute, so it is refused
    v = TangentSpec(1, "gaussian").sample(jax.random.key(7), (5,))[0]
    g = jnp.arange(5.0)
    np.testing.assert_allclose(jnp.vdot(g, -v) * -v, jnp.vdot(g, v) * v)
    with pytest.raises(ValueError, match=r"antithetic: refused for jvp estimates.*num_tangents=K/2"):
        TangentSpec(4, "rademacher", antithetic=True)
    with pytest.raises(ValueError, match="antithetic: refused"):
        jg.hybrid(num_exact=1, num_tangents=2, antithetic=True)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
@pytest.mark.parametrize("size", [5, 6, 8])
def test_orthogonal_tangents_are_unbiased_on_small_leaves(distribution, size):
    """(1/K) Σ_k E[v_k v_kᵀ] = I for K = 4 orthogonal tangents of a leaf of 5, 6 or 8 entries,
    each entry within 4.5 standard errors (over 5,000 keys). Sign vectors of a small leaf are
    often linearly dependent; a QR that completes the basis with fixed directions was off by
    about 8 standard errors at sizes 5 and 6 here."""
    spec = TangentSpec(4, distribution, orthogonal=True)
    keys = jax.random.split(jax.random.key(0), 5000)
    v = jax.jit(lambda ks: jax.lax.map(lambda k: spec.sample(k, (size,)), ks))(keys)
    v = np.asarray(v, np.float64).reshape(-1, size)
    outer = v[:, :, None] * v[:, None, :]
    err = np.abs(outer.mean(0) - np.eye(size))
    se = outer.std(0, ddof=1) / np.sqrt(len(outer))
    assert np.all((err <= 4.5 * se) | (err <= 1e-9)), (err / np.maximum(se, 1e-12)).max()
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), np.sqrt(size), rtol=1e-5)


def test_packed_rademacher_signs_are_balanced_and_uncorrelated():
    """Signs unpacked from 32-bit words: ±1, mean 0 and E[v vᵀ] = I (incl. within a word)."""
    from jaxstream.grad.tangents import rademacher_bits

    v = np.asarray(rademacher_bits(jax.random.key(3), 20000, 40), np.float64)  # 40: a partial word
    assert set(np.unique(v)) == {-1.0, 1.0}
    se = 1.0 / np.sqrt(v.shape[0])  # std of a mean of ±1 products
    np.testing.assert_array_less(np.abs(v.mean(0)), 5 * se)
    cov = v.T @ v / v.shape[0]
    np.testing.assert_array_less(np.abs(cov - np.eye(40)), 5 * se)


ESTIMATORS = {
    "gaussian": jg.forward(1, "gaussian"),
    "rademacher_k2": jg.forward(2, "rademacher"),
    "orthogonal": jg.forward(2, "gaussian", orthogonal=True),
    "activations": jg.forward(1, "rademacher", perturb="activations"),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_forward_estimators_are_unbiased(name):
    """Mean of R estimates vs the exact gradient, each coordinate judged by its own standard
    error (fixed seeds): max |z| < 4.5 over ~100 coordinates, and mean z² near 1."""
    stack, params, batch, _ = tiny_problem()
    est = ESTIMATORS[name]
    r = 3000
    keys = jax.random.split(jax.random.key(11), r)
    samples = estimates(est, stack, params, batch, keys)
    exact = flat(jax.grad(stack)(params, batch))
    stderr = samples.std(0, ddof=1) / np.sqrt(r)
    z = (samples.mean(0) - exact) / stderr
    assert np.max(np.abs(z)) < 4.5, name
    # mean of n chi²(1) variables: sd √(2/n).
    assert abs(np.mean(z**2) - 1.0) < 5 * np.sqrt(2.0 / z.size), name


def test_projection_aggregation_is_the_projection_onto_the_tangent_span():
    stack, params, batch, _ = tiny_problem()
    spec = TangentSpec(3, "gaussian")
    key = jax.random.key(4)
    est = jg.forward(3, "gaussian", aggregation="projection")
    _, g_hat = jax.jit(lambda p: est(stack, p, batch, key))(params)
    v = jax.jit(lambda p: tangents(spec, key, p))(params)
    V = np.stack([np.asarray(flat(jax.tree.map(lambda a, k=k: a[k], v)), np.float64) for k in range(3)], 1)
    g = np.asarray(flat(jax.grad(stack)(params, batch)), np.float64)
    want = V @ np.linalg.solve(V.T @ V, V.T @ g)
    np.testing.assert_allclose(flat(g_hat), want, rtol=1e-4, atol=1e-6)


def test_local_losses_follow_each_blocks_local_gradient_in_expectation():
    stack, params, batch, _ = tiny_problem(depth=2)
    est = jg.forward(1, "gaussian", perturb="activations", local_losses=True)
    r = 3000
    keys = jax.random.split(jax.random.key(2), r)
    samples = jax.jit(jax.vmap(lambda k: flat(est(stack, params, batch, k)[1]["blocks"])))(keys)

    def local_loss(blocks, l):
        h = stack.embed(params["embed"], batch["x"])
        for i in range(l):
            h = jax.lax.stop_gradient(stack.block(jax.tree.map(lambda a, i=i: a[i], params["blocks"]), h))
        h = stack.block(jax.tree.map(lambda a: a[l], blocks), h)
        return jnp.mean(stack.example_loss(stack.head(params["head"], h), batch))

    grads = [jax.grad(local_loss)(params["blocks"], l) for l in range(2)]
    exact = jax.tree.map(jnp.add, *grads)
    z = (samples.mean(0) - flat(exact)) / (samples.std(0, ddof=1) / np.sqrt(r) + 1e-12)
    assert np.max(np.abs(z)) < 4.5


def test_estimators_jit_vmap_without_retracing():
    stack, params, batch, _ = tiny_problem()
    est = jg.forward(2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def many(keys):
        return jax.vmap(lambda k: est(stack, params, batch, k)[1])(keys)

    a = many(jax.random.split(jax.random.key(0), 3))
    b = many(jax.random.split(jax.random.key(1), 3))
    assert jax.tree.leaves(a)[0].shape[0] == 3 and jax.tree.leaves(b)[0].shape[0] == 3


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="distribution must be one of"):
        jg.forward(distribution="uniform")
    with pytest.raises(ValueError, match="num_tangents"):
        jg.forward(num_tangents=0)
    with pytest.raises(ValueError, match="perturb"):
        jg.forward(perturb="both")
    with pytest.raises(ValueError, match="antithetic: refused"):
        jg.forward(2, antithetic=True)
    stack, params, batch, _ = tiny_problem()
    with pytest.raises(TypeError, match="needs a model Stack"):
        jg.forward(perturb="activations")(lambda p, b: stack(p, b), params, batch, jax.random.key(0))
