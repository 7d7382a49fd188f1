"""Baseline estimators (rematerialised backprop, exact subset, LG-FG-W) and the activity hybrid,
each against a reference built from jax.grad and the shared key schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad import tangents as tg
from jaxstream.grad.baselines import select_exact
from jaxstream.grad.hybrid_activity import mixing_weights
from tests.grad.helpers import flat, tiny_problem


def test_backprop_remat_is_exact_and_saves_memory():
    from jaxstream.models import mlp

    stack = mlp(in_dim=8, width=32, depth=6, num_classes=3)
    params = stack.init(jax.random.key(0))
    batch = {"x": jax.random.normal(jax.random.key(1), (64, 8)), "y": jnp.arange(64) % 3}
    remat = jax.jit(lambda p: jg.backprop_remat()(stack, p, batch)).lower(params).compile()
    plain = jax.jit(jax.value_and_grad(stack)).lower(params, batch).compile()
    loss, grads = remat(params)
    ref_loss, ref = plain(params, batch)
    # Only block inputs are kept for the backward pass: less temporary memory than backprop.
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(remat) < 0.8 * temp(plain), (temp(remat), temp(plain))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(flat(grads), flat(ref), rtol=1e-5, atol=1e-7)
    quad = lambda p, b: jnp.sum((p["w"] * b) ** 2)
    g = jg.backprop_remat()(quad, {"w": jnp.arange(3.0)}, jnp.ones(3))[1]
    np.testing.assert_allclose(g["w"], 2 * jnp.arange(3.0))


def test_accumulated_remat_backprop_is_exact_and_holds_one_chunk():
    """Gradient accumulation: the batch's mean gradient from A chunks in turn equals jax.grad's
    (a Stack and a plain loss), and the compiled step's temporary memory falls with A."""
    from jaxstream.models import mlp

    stack = mlp(in_dim=8, width=64, depth=4, num_classes=3)
    params = stack.init(jax.random.key(0))
    batch = {"x": jax.random.normal(jax.random.key(1), (256, 8)), "y": jnp.arange(256) % 3}
    ref_loss, ref = jax.value_and_grad(stack)(params, batch)
    temps = {}
    for a in (1, 4, 16):
        step = jax.jit(lambda p, a=a: jg.backprop_remat(accumulate=a)(stack, p, batch))
        compiled = step.lower(params).compile()
        temps[a] = compiled.memory_analysis().temp_size_in_bytes
        loss, grads = compiled(params)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        np.testing.assert_allclose(flat(grads), flat(ref), rtol=2e-5, atol=1e-7)
    assert temps[16] < temps[4] < temps[1], temps
    # a plain loss function, chunks of unequal content
    quad = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
    w, b = {"w": jnp.arange(3.0)}, jax.random.normal(jax.random.key(2), (6, 3))
    np.testing.assert_allclose(jg.backprop_remat(accumulate=3)(quad, w, b)[1]["w"],
                               jax.grad(quad)(w, b)["w"], rtol=1e-6)
    with pytest.raises(ValueError, match="accumulate: 4 chunks must divide"):
        jg.backprop_remat(accumulate=4)(quad, w, b)
    with pytest.raises(ValueError, match="accumulate must be an int >= 1"):
        jg.backprop_remat(accumulate=0)


def test_exact_subset_matches_hybrid_selection():
    stack, params, _, micro = tiny_problem(n_micro=4)
    est = jg.exact_subset(2)
    key = jax.random.key(1)

    @jax.jit
    def run(p):
        _, grads, diag = est(stack, p, micro, key, diagnostics=True)
        hyb = jg.hybrid(2)(stack, p, micro, key, diagnostics=True)[2]["exact_indices"]
        every = jax.vmap(lambda b: flat(jax.grad(stack)(p, b)))(micro)
        return flat(grads), diag["exact_indices"], hyb, every

    grads, idx, hyb_idx, every = run(params)
    np.testing.assert_array_equal(idx, hyb_idx)
    assert len(set(np.asarray(idx).tolist())) == 2
    np.testing.assert_allclose(grads, np.mean(np.asarray(every)[np.asarray(idx)], axis=0),
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="num_exact"):
        est_bad = jg.exact_subset(5)
        est_bad(stack, params, micro, jax.random.key(0))
    with pytest.raises(ValueError, match="num_exact"):
        jg.exact_subset(0)


def test_local_forward_weights_matches_local_gradients():
    stack, params, batch, _ = tiny_problem(depth=2)
    spec = tg.TangentSpec(num=3)
    key = jax.random.key(4)
    grads, ref = jax.jit(lambda p: (jg.local_forward_weights(3)(stack, p, batch, key)[1],
                                    _local_reference(stack, p, batch, key, spec)))(params)
    np.testing.assert_allclose(flat(grads), flat(ref), rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="Stack"):
        jg.local_forward_weights()(lambda p, b: jnp.sum(p), jnp.ones(2), None, key)


def _local_reference(stack, params, batch, key, spec):
    """jax.grad of each module's local loss, projected on the regenerated tangents."""
    v = tg.tangents(spec, key, params)  # the same key schedule, materialised
    head = lambda h: jnp.mean(stack.example_loss(stack.head(params["head"], h), batch))

    def proj(g, vv):  # (1/K) Σ_k (g·v_k) v_k
        d = sum(jnp.tensordot(t.reshape(3, -1), a.ravel(), 1)
                for a, t in zip(jax.tree.leaves(g), jax.tree.leaves(vv)))
        return jax.tree.map(lambda t: jnp.tensordot(d, t, 1) / 3, vv)

    h = stack.embed(params["embed"], batch["x"])
    ref_embed = proj(jax.grad(lambda p: head(stack.embed(p, batch["x"])))(params["embed"]), v["embed"])
    ref_blocks = []
    for l in range(2):
        p_l = jax.tree.map(lambda a, l=l: a[l], params["blocks"])
        g_l = jax.grad(lambda p, h=h: head(stack.block(p, h)))(p_l)
        ref_blocks.append(proj(g_l, jax.tree.map(lambda a, l=l: a[:, l], v["blocks"])))
        h = stack.block(p_l, h)
    g_head = jax.grad(lambda p: jnp.mean(stack.example_loss(stack.head(p, h), batch)))(params["head"])
    return {"embed": ref_embed, "blocks": jax.tree.map(lambda *a: jnp.stack(a), *ref_blocks),
            "head": proj(g_head, v["head"])}


def _np_sq(tree, seg):
    """Squared norm per micro-batch row (leading axis) of a segment (blocks: per layer)."""
    if seg == "blocks":
        return sum(np.sum(np.asarray(x, np.float64).reshape(x.shape[0], x.shape[1], -1) ** 2, -1)
                   for x in jax.tree.leaves(tree["blocks"]))
    return sum(np.sum(np.asarray(x, np.float64).reshape(x.shape[0], -1) ** 2, -1)
               for x in jax.tree.leaves(tree[seg]))


def test_hybrid_activity_matches_float64_reference():
    n, k = 5, 2
    stack, params, _, micro = tiny_problem(n_micro=n, depth=2)
    key = jax.random.key(7)
    fwd = jg.forward(2, perturb="activations")

    @jax.jit
    def run(p):
        outs = {s: jg.hybrid_activity(k, 2, s)(stack, p, micro, key, diagnostics=True)
                for s in ("per_layer", "none")}
        # Reference pieces: the public estimators, one micro-batch each (micro_key schedule).
        a = jax.vmap(lambda b, i: fwd(stack, p, b, tg.micro_key(key, i))[1])(micro, jnp.arange(n))
        g = jax.vmap(lambda b: jax.grad(stack)(p, b))(micro)
        return outs, a, g

    outs, a, g = run(params)
    idx = [int(i) for i in outs["none"][2]["exact_indices"]]
    assert idx == [int(i) for i in select_exact(key, n, k)]
    A = jax.tree.map(lambda x: np.asarray(x, np.float64), a)
    G = jax.tree.map(lambda x: np.asarray(x, np.float64)[idx], g)
    for shrinkage in ("per_layer", "none"):
        _check_against(outs[shrinkage], A, G, idx, n, k, shrinkage)


def _check_against(out, A, G, idx, n, k, shrinkage):
    _, grads, diag = out
    h = jax.tree.map(lambda x: x.mean(0), G)
    rest = [i for i in range(n) if i not in idx]
    a_u = jax.tree.map(lambda x: x[rest].mean(0), A)
    alpha = {}
    for seg in ("embed", "blocks", "head"):
        spread = _np_sq(jax.tree.map(lambda x: x - x.mean(0), G), seg).sum(0) / (k - 1)
        noise = _np_sq(jax.tree.map(lambda x, y: x[idx] - y, A, G), seg).mean(0)
        v_h, v_a = spread * (1 / k + 1 / (n - k)), noise / (n - k)
        alpha[seg] = np.ones_like(v_h) if shrinkage == "none" else v_h / (v_h + v_a)
    ref = {}
    for seg in ("embed", "blocks", "head"):
        al = alpha[seg]
        ref[seg] = jax.tree.map(
            lambda hh, au, al=al, seg=seg: (k * hh + (n - k) * (hh + (al.reshape((-1,) + (1,) * (hh.ndim - 1))
                                                      if seg == "blocks" else al) * (au - hh))) / n,
            h[seg], a_u[seg])
    np.testing.assert_allclose(flat(grads), flat(ref), rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(diag["alpha"]["blocks"], alpha["blocks"], rtol=1e-4)
    if shrinkage == "per_layer":
        assert all(0 < float(np.min(v)) and float(np.max(v)) < 1 for v in alpha.values())


def test_hybrid_activity_errors():
    stack, params, _, micro = tiny_problem(n_micro=4)
    with pytest.raises(ValueError, match="num_exact"):
        jg.hybrid_activity(1)
    with pytest.raises(ValueError, match="shrinkage"):
        jg.hybrid_activity(2, shrinkage="layer")
    with pytest.raises(ValueError, match="num_exact=4"):
        jg.hybrid_activity(4)(stack, params, micro, jax.random.key(0))
    with pytest.raises(TypeError, match="Stack"):
        jg.hybrid_activity(2)(lambda p, b: jnp.sum(p), jnp.ones(2), micro, jax.random.key(0))
    assert callable(mixing_weights)
