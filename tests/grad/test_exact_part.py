"""The hybrid's exact part and forward scalars: group means against per-micro-batch
``jax.grad``, the forward pass's c = h·v against materialised tangents in float64, the in-place
tangent sum, and the step's compiled memory against backprop with rematerialisation."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad import corrections as cr
from jaxstream.grad import tangents as tg
from jaxstream.grad.directional import directional
from jaxstream.grad.exact import group_exact_mean
from jaxstream.models.stack import Stack, cross_entropy
from tests.trees import max_rel_err


def _residual_tanh_stack(width: int = 6, depth: int = 4, classes: int = 3) -> Stack:
    """A residual tanh MLP written here (not from jaxstream.models), with biases and a
    parameter-free embed-free head path, to check the sweep on a model it was not built for."""

    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "embed": {"w": jax.random.normal(k1, (5, width)) * 0.4},
            "blocks": {"w": jax.random.normal(k2, (depth, width, width)) * 0.3,
                       "b": jnp.full((depth, width), 0.1)},
            "head": {"w": jax.random.normal(k3, (width, classes)) * 0.4},
        }

    return Stack(
        embed=lambda p, x: x @ p["w"],
        block=lambda p, h: h + jnp.tanh(h @ p["w"] + p["b"]),
        head=lambda p, h: h @ p["w"],
        example_loss=cross_entropy,
        init=init,
        num_layers=depth,
        name="residual_tanh",
    )


def _micro(n: int, per: int, seed: int = 0) -> dict:
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (n, per, 5)), "y": jax.random.randint(ky, (n, per), 0, 3)}


@pytest.mark.parametrize("depth", [(0, 0, 0), (0, 2, 4), (3, 1, 5)])
def test_group_exact_mean_is_the_masked_mean_of_per_micro_batch_grads(depth):
    """Nested groups (depth[i] = first block with micro-batch i's exact gradient; 5 = L + 1:
    the head only) against jax.grad of each micro-batch, averaged per segment in NumPy."""
    stack = _residual_tanh_stack()
    params = stack.init(jax.random.key(1))
    sel = _micro(3, 4)
    depth = jnp.array(depth, jnp.int32)
    masks = cr.group_masks(params, depth)
    h, counts, losses = jax.jit(lambda p: group_exact_mean(stack, p, sel, masks))(params)
    all_grads = jax.jit(jax.vmap(lambda b: jax.grad(stack)(params, b)))(sel)
    grads = [jax.tree.map(lambda a, i=i: a[i], all_grads) for i in range(3)]
    m = {k: np.asarray(v, np.float64) for k, v in masks.items()}

    def want(seg, leaf, weight):  # weight (3,) or (3, L)
        g = np.stack([np.asarray(gi[seg][leaf], np.float64) for gi in grads])
        w = weight / np.maximum(weight.sum(0), 1.0)
        return np.tensordot(w, g, axes=((0,), (0,))) if w.ndim == 1 else np.einsum("il,il...->l...", w, g)

    np.testing.assert_allclose(h["embed"]["w"], want("embed", "w", m["embed"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h["head"]["w"], want("head", "w", m["head"]), rtol=1e-5, atol=1e-6)
    for leaf in ("w", "b"):
        np.testing.assert_allclose(h["blocks"][leaf], want("blocks", leaf, m["blocks"]),
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(counts["blocks"], m["blocks"].sum(0))
    want_losses = jax.vmap(lambda b: stack(params, b))(sel)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


def test_group_exact_mean_of_a_plain_loss_function():
    """Any loss_fn: the selected micro-batches one after another, their mean gradient."""
    def loss_fn(p, b):
        return jnp.mean((jnp.sin(b["x"] @ p["a"]) @ p["c"] - b["y"]) ** 2)

    params = {"a": jax.random.normal(jax.random.key(0), (5, 4)), "c": jnp.ones((4,))}
    kx, ky = jax.random.split(jax.random.key(1))
    sel = {"x": jax.random.normal(kx, (3, 6, 5)), "y": jax.random.normal(ky, (3, 6))}
    masks = cr.group_masks(params, jnp.zeros((3,), jnp.int32))
    h, _, losses = group_exact_mean(loss_fn, params, sel, masks)
    want = jax.grad(lambda p: jnp.mean(jax.vmap(lambda b: loss_fn(p, b))(sel)))(params)
    assert max_rel_err(h, want) < 1e-5
    np.testing.assert_allclose(losses, jax.vmap(lambda b: loss_fn(params, b))(sel), rtol=1e-6)


def test_forward_scalars_equal_float64_dot_with_materialised_tangents():
    """c_nk = h·v_nk summed in the forward pass as its tangents are drawn, against the
    tangents drawn whole and dotted in float64 NumPy; d unchanged by the probe."""
    stack = _residual_tanh_stack(width=64, depth=3)
    params = stack.init(jax.random.key(2))
    batch = jax.tree.map(lambda a: a[0], _micro(1, 8))
    spec = tg.TangentSpec(num=3)
    probe = jax.tree.map(lambda a: jax.random.normal(jax.random.key(3), a.shape), params)
    key = jax.random.key(4)
    loss, d, c = jax.jit(lambda p, q: directional(stack, spec, p, batch, key, q))(params, probe)
    loss0, d0 = jax.jit(lambda p: directional(stack, spec, p, batch, key))(params)
    np.testing.assert_allclose(d, d0, rtol=1e-6)
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    v = jax.jit(lambda p: tg.tangents(spec, key, p))(params)
    pairs = [(np.asarray(vv, np.float64).reshape(3, -1), np.asarray(pp, np.float64).reshape(-1))
             for vv, pp in zip(jax.tree.leaves(v), jax.tree.leaves(probe))]
    want = sum(np.tensordot(vv, pp, axes=1) for vv, pp in pairs)
    # fp32 sums of ~12k products: an error bound from the terms' magnitudes (an entry near
    # zero cancels terms of size ~1; a wrong tangent is off by O(1) or more)
    bound = 8 * np.finfo(np.float32).eps * sum(np.abs(vv) @ np.abs(pp) for vv, pp in pairs)
    assert np.all(np.abs(np.asarray(c, np.float64) - want) <= bound), (c, want, bound)


def test_tangent_sum_from_init_equals_init_plus_sum():
    stack = _residual_tanh_stack()
    params = stack.init(jax.random.key(5))
    spec = tg.TangentSpec(num=2)
    keys = jax.random.split(jax.random.key(6), 4)
    coeffs = jax.random.normal(jax.random.key(7), (4, 2))
    masks = cr.group_masks(params, jnp.array([0, 3], jnp.int32))
    rows = cr.outside_rows(masks, jnp.array([1, 2]), 4)
    init = jax.tree.map(lambda a: a * 3.0, params)
    got = tg.combine(spec, keys, coeffs, params, rows=rows, init=init)
    plain = tg.combine(spec, keys, coeffs, params, rows=rows)
    assert max_rel_err(got, jax.tree.map(jnp.add, init, plain)) < 1e-6


@pytest.mark.parametrize("correction", ["control_variate", "replace", "weighted"])
def test_hybrid_equals_the_formula_with_materialised_tangents(correction):
    """h + β (1/(N K)) Σ_{n∉G} Σ_k (d_nk − h·v_nk) v_nk (control variate, weighted) and
    Σ_{n∉G} forward + Σ_{n∈G} exact (replace), in float64 NumPy from jax.grad, jax.jvp and
    the tangents drawn whole."""
    stack = _residual_tanh_stack()
    params = stack.init(jax.random.key(8))
    n, k = 5, 2
    micro = _micro(n, 4, seed=9)
    key = jax.random.key(10)
    est = jg.hybrid(exact_indices=(1, 3), correction=correction, num_tangents=k)
    _, got, diag = jax.jit(lambda p: est(stack, p, micro, key, diagnostics=True))(params)
    f64 = lambda t: [np.asarray(a, np.float64) for a in jax.tree.leaves(t)]
    all_grads = jax.jit(jax.vmap(lambda b: jax.grad(stack)(params, b)))(micro)
    grads = [f64(jax.tree.map(lambda a, i=i: a[i], all_grads)) for i in range(n)]
    all_v = jax.jit(jax.vmap(lambda i: tg.tangents(est.spec, tg.micro_key(key, i), params)))(
        jnp.arange(n))
    h = [(grads[1][j] + grads[3][j]) / 2 for j in range(len(grads[0]))]
    out = [np.zeros_like(x) for x in h] if correction == "replace" else [x.copy() for x in h]
    for i in range(n):
        vs = f64(jax.tree.map(lambda a, i=i: a[i], all_v))
        if i in (1, 3):
            if correction == "replace":
                out = [o + g / n for o, g in zip(out, grads[i])]
            continue
        for kk in range(k):
            v = [a[kk] for a in vs]
            d = sum(np.sum(g * vv) for g, vv in zip(grads[i], v))
            c = 0.0 if correction == "replace" else sum(np.sum(a * vv) for a, vv in zip(h, v))
            beta = [1.0] * len(v)
            if correction == "weighted":
                b = diag["beta"]
                beta = [float(b["blocks"][0])] * len(v)  # equal groups: one β everywhere
                assert np.allclose(np.asarray(b["blocks"]), float(b["blocks"][0]))
                assert np.isclose(float(b["embed"]), float(b["blocks"][0]))
            out = [o + bb * (d - c) * vv / (n * k) for o, bb, vv in zip(out, beta, v)]
    err = max(np.abs(g - w).max() / np.abs(w).max() for g, w in zip(f64(got), out))
    assert err < 1e-5


def test_hybrid_step_compiles_below_backprop_remat_memory():
    """XLA's temporary buffer of the hybrid step (exact part rematerialised, c in the forward
    pass, the estimate summed into h) below half of backprop with per-block remat on a 16-block
    MLP (compile only; benchmarks/memory_time.py measures the full-size figures)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import memory_time as mt

    stack, params, data = mt.make_problem(16, 128, 256)
    fns = mt.step_functions(stack)
    temp = {name: jax.jit(fns[name]).lower(params, data, jax.random.key(0)).compile()
            .memory_analysis().temp_size_in_bytes for name in ("backprop_remat", "hybrid")}
    assert temp["hybrid"] < 0.5 * temp["backprop_remat"], temp


def test_exact_subset_and_hybrid_activity_compile_without_per_micro_batch_copies():
    """exact_subset runs the sweep (below a tenth of backprop's temporary memory) and
    hybrid_activity accumulates its forward estimates micro-batch by micro-batch and folds its
    exact gradients into h and the mixing statistics one at a time (below 0.8 of backprop's;
    all N gradient trees at once were above 5x, the k selected ones together 0.99x)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import memory_time as mt

    stack, params, data = mt.make_problem(16, 128, 256)
    micro = jax.tree.map(lambda a: a.reshape((16, -1) + a.shape[1:]), data)

    def temp(f, *args):
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    bp = temp(lambda p, b: jg.backprop()(stack, p, b), params, data)
    key = jax.random.key(0)
    subset, activity = jg.exact_subset(2), jg.hybrid_activity(2)
    assert temp(lambda p, b: subset(stack, p, b, key), params, micro) < 0.1 * bp
    assert temp(lambda p, b: activity(stack, p, b, key), params, micro) < 0.8 * bp
