"""Hybrid estimator: corrections, nested groups, equality with backprop when all exact."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad.tangents import micro_key
from jaxstream.models import mlp
from tests.grad.helpers import estimates, flat, tiny_problem


@pytest.mark.parametrize("correction", ["replace", "weighted", "control_variate", "stein",
                                        "guess"])
def test_every_micro_batch_exact_equals_backprop(correction):
    """With every micro-batch exact no residual is left to estimate: every correction is
    backprop (control_variate used to estimate the known residuals by tangents)."""
    stack, params, batch, micro = tiny_problem()
    _, g = jg.backprop()(stack, params, batch)
    est = jg.hybrid(exact_indices=(0, 1, 2, 3), correction=correction)
    _, gh = jax.jit(lambda p: est(stack, p, micro, jax.random.key(0)))(params)
    chex.assert_trees_all_close(gh, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("correction", ["replace", "control_variate"])
def test_unbiased_corrections(correction):
    stack, params, batch, micro = tiny_problem()
    est = jg.hybrid(num_exact=1, correction=correction)
    r = 3000
    keys = jax.random.split(jax.random.key(3), r)
    samples = estimates(est, stack, params, micro, keys)
    exact = flat(jax.grad(stack)(params, batch))
    z = (samples.mean(0) - exact) / (samples.std(0, ddof=1) / np.sqrt(r) + 1e-12)
    assert np.max(np.abs(z)) < 4.5
    assert abs(np.mean(z**2) - 1.0) < 5 * np.sqrt(2.0 / z.size)


def test_weighted_beta_does_not_move_with_the_selection():
    """``weighted``'s β is fixed by N, |G|, K and the model's size: the same for every key and
    every selection of the same size, so with a random selection E[h + β r] = ḡ (a β estimated
    from the selected gradients' spread moved with h − ḡ and biased the estimate); and the
    estimate is h + β (control variate − h) with that β, per segment."""
    stack, params, _, micro = tiny_problem(n_micro=6)
    betas = []
    # the selected micro-batches' exact mean, one program for both selections
    exact_mean = jax.jit(jax.grad(lambda p, idx: jnp.mean(jax.vmap(lambda b: stack(p, b))(
        jax.tree.map(lambda a: a[idx], micro)))))
    for sel in [(0, 1), (2, 5)]:
        weighted = jg.hybrid(exact_indices=sel, correction="weighted", num_tangents=2)
        weighted = jax.jit(lambda k, e=weighted: e(stack, params, micro, k, diagnostics=True))
        cv = jg.hybrid(exact_indices=sel, correction="control_variate", num_tangents=2)
        cv = jax.jit(lambda k, e=cv: e(stack, params, micro, k)[1])
        h = exact_mean(params, jnp.asarray(sel))
        for key in (jax.random.key(1), jax.random.key(2)):
            _, g, diag = weighted(key)
            betas.append(jax.tree.map(np.asarray, diag["beta"]))
            b = diag["beta"]
            c = cv(key)
            want = {"embed": jax.tree.map(lambda hh, c, b=b: hh + b["embed"] * (c - hh),
                                          h["embed"], c["embed"]),
                    "head": jax.tree.map(lambda hh, c, b=b: hh + b["head"] * (c - hh),
                                         h["head"], c["head"])}
            chex.assert_trees_all_close({"embed": g["embed"], "head": g["head"]}, want,
                                        rtol=2e-4, atol=1e-6)
    for other in betas[1:]:
        chex.assert_trees_all_close(other, betas[0], rtol=1e-6)
    n, k, c = 6, 2, 2.0
    size = sum(np.size(a) for a in jax.tree.leaves(params))
    a = c / (c + 1) * (1 / c - 1 / n) / size  # the docstring's formula, by hand
    np.testing.assert_allclose(betas[0]["head"], a / (a + (n - c) / (n * n * k)), rtol=1e-5)


def _correlated_problem():
    """Micro-batches that share most of their gradient: same inputs up to small noise."""
    stack = mlp(in_dim=5, width=8, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    base = jax.random.normal(jax.random.key(1), (1, 6, 5))
    x = base + 0.05 * jax.random.normal(jax.random.key(2), (8, 6, 5))
    y = jnp.broadcast_to(jnp.arange(6) % 3, (8, 6)).astype(jnp.int32)
    return stack, params, {"x": x, "y": y}


def test_control_variate_and_weighted_lower_the_error_on_correlated_micro_batches():
    """One exact micro-batch of 8: replace > control variate > weighted in squared error,
    each gap judged by the standard error of the difference of means (fixed seeds)."""
    stack, params, micro = _correlated_problem()
    exact = flat(jax.grad(lambda p: jnp.mean(jax.vmap(lambda b: stack(p, b))(micro)))(params))
    keys = jax.random.split(jax.random.key(9), 400)

    def sq_err(correction):
        s = estimates(jg.hybrid(num_exact=1, correction=correction), stack, params, micro, keys)
        return np.asarray(((s - exact) ** 2).sum(1))

    plain, cv, w = sq_err("replace"), sq_err("control_variate"), sq_err("weighted")

    def se(a, b):
        return np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)

    assert plain.mean() - cv.mean() > 4 * se(plain, cv)
    assert cv.mean() < 0.2 * plain.mean()
    assert cv.mean() - w.mean() > 4 * se(cv, w)


def test_weighted_with_one_exact_gradient_shrinks_by_the_size_formula():
    """One exact micro-batch: β = a/(a+b), a = (N−1)/(2NP) (E q = 2 S², and
    E‖h − ḡ‖² = S² (1 − 1/N); it used to overcount by (N/(N−1))²), b = (N−1)/(N²K) (the
    N − 1 residuals still estimated), in every segment."""
    stack, params, micro = _correlated_problem()
    n, k = 8, 1
    a = (n - 1) / (2 * n * flat(params).size)
    est = jg.hybrid(num_exact=1, correction="weighted")
    _, _, diag = est(stack, params, micro, jax.random.key(0), diagnostics=True)
    for b in jax.tree.leaves(diag["beta"]):
        np.testing.assert_allclose(np.asarray(b), a / (a + (n - 1) / (n * n * k)), rtol=1e-5)


def test_nested_groups_match_a_per_layer_reference():
    """exact_from: block l uses the exact gradients of micro-batches with exact_from <= l."""
    stack, params, _, micro = tiny_problem(depth=3)
    exact_from = (0, 2, 3, 4)  # L = 3: 3 = head only, 4 = none
    key = jax.random.key(5)
    est = jg.hybrid(exact_from=exact_from, correction="replace")
    _, got = jax.jit(lambda p: est(stack, p, micro, key))(params)
    fwd = jax.jit(lambda p, b, k: jg.forward(1)(stack, p, b, k)[1])
    grad = jax.jit(jax.grad(stack))
    n = 4
    per_micro = [jax.tree.map(lambda a, i=i: a[i], micro) for i in range(n)]
    g_exact = [grad(params, b) for b in per_micro]
    g_fwd = [fwd(params, b, micro_key(key, i)) for i, b in enumerate(per_micro)]

    def pick(i, segment, layer=None):
        in_group = {
            "embed": exact_from[i] <= 0,
            "head": exact_from[i] <= 3,
            "blocks": layer is not None and exact_from[i] <= layer,
        }[segment]
        src = g_exact[i] if in_group else g_fwd[i]
        part = src[segment]
        return part if layer is None else jax.tree.map(lambda a: a[layer], part)

    for seg in ("embed", "head"):
        want = jax.tree.map(lambda *xs: sum(xs) / n, *[pick(i, seg) for i in range(n)])
        chex.assert_trees_all_close(got[seg], want, rtol=1e-5, atol=1e-6)
    for layer in range(3):
        want = jax.tree.map(lambda *xs: sum(xs) / n, *[pick(i, "blocks", layer) for i in range(n)])
        chex.assert_trees_all_close(jax.tree.map(lambda a, layer=layer: a[layer], got["blocks"]), want, rtol=1e-5, atol=1e-6)


def test_groups_are_nested():
    from jaxstream.grad.corrections import group_masks

    _, params, _, _ = tiny_problem(depth=3)
    masks = group_masks(params, jnp.array([0, 2, 1, 3]))
    blocks = np.asarray(masks["blocks"])  # (k, L)
    assert np.all(np.asarray(masks["embed"]) <= blocks[:, 0])
    assert np.all(blocks[:, :-1] <= blocks[:, 1:])
    assert np.all(blocks[:, -1] <= np.asarray(masks["head"]))


def test_guess_projects_onto_the_exact_subset_mean():
    stack, params, batch, micro = tiny_problem()
    est = jg.hybrid(exact_indices=(1,), correction="guess")
    _, g = jax.jit(lambda p: est(stack, p, micro, jax.random.key(0)))(params)
    h = flat(jax.grad(stack)(params, jax.tree.map(lambda a: a[1], micro)))
    u = h / jnp.linalg.norm(h)
    full = flat(jax.grad(stack)(params, batch))
    np.testing.assert_allclose(flat(g), jnp.vdot(full, u) * u, rtol=1e-4, atol=1e-6)


def test_hybrid_bad_arguments_error_before_compute():
    stack, params, batch, micro = tiny_problem()
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="exceeds the N=4"):
        jg.hybrid(num_exact=5)(stack, params, micro, key)
    with pytest.raises(ValueError, match="out of range"):
        jg.hybrid(exact_indices=(0, 4))(stack, params, micro, key)
    with pytest.raises(ValueError, match="correction must be one of"):
        jg.hybrid(1, correction="magic")
    with pytest.raises(ValueError, match="exact_from must give"):
        jg.hybrid(exact_from=(0, 1))(stack, params, micro, key)
    bad = {"x": micro["x"], "y": batch["y"]}
    with pytest.raises(ValueError, match=r"batch\['y'\] has shape \(16,\).*micro-batch axis"):
        jg.hybrid(1)(stack, params, bad, key)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_probe_dot_of_a_large_leaf_equals_float64(dtype):
    """The control variate's scalars c_k = h·v_k of one 512×512 leaf (one matrix-vector
    product per leaf) against float64 NumPy, within an error bound from the terms' magnitudes
    that does not grow with a sequential sum's length; bf16 tangents accumulate in float32."""
    from jaxstream.grad.segments import probe_dot

    v = jax.random.rademacher(jax.random.key(0), (3, 512, 512), jnp.float32).astype(dtype)
    h = jax.random.normal(jax.random.key(1), (512, 512), jnp.float32).astype(dtype)
    c = jax.jit(probe_dot)({"w": v}, {"w": h})
    assert c.shape == (3,) and c.dtype == dtype
    vv = np.asarray(v, np.float64).reshape(3, -1)
    hh = np.asarray(h, np.float64).reshape(-1)
    want = vv @ hh
    rounding = float(jnp.finfo(dtype).eps) * np.abs(want)  # the result's own rounding
    bound = 64 * np.finfo(np.float32).eps * (np.abs(vv) @ np.abs(hh)) + rounding
    assert np.all(np.abs(np.asarray(c, np.float64) - want) <= bound), (c, want, bound)
