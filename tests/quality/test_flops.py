"""Matrix-multiply FLOPs counted from compiled steps against counts worked out by hand."""

import jax
import jax.numpy as jnp
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.quality.flops import matmul_flops

B, D, L = 16, 32, 5
MM = 2 * B * D * D  # one (B, D) @ (D, D) product


def flops(fn, *args):
    return matmul_flops(jax.jit(fn).lower(*args).compile())


def blocks(ws, x):
    """L tanh layers as a scan (the loop XLA's own cost analysis counts once)."""
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


def args():
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (L, D, D)) / D**0.5, jax.random.normal(k2, (B, D))


def test_scan_counts_every_trip():
    ws, x = args()
    assert flops(lambda ws, x: blocks(ws, x).sum(), ws, x) == L * MM
    # XLA's own analysis counts the body once: the reason this counter exists
    ca = jax.jit(lambda ws, x: blocks(ws, x).sum()).lower(ws, x).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    assert ca["flops"] < 2 * MM


def test_fori_loop_and_map_are_counted_by_trip_count():
    ws, x = args()

    def loop(ws, x):
        return jax.lax.fori_loop(0, L, lambda i, h: jnp.tanh(h @ ws[i]), x).sum()

    assert flops(loop, ws, x) == L * MM
    per_row = lambda w, x: jax.lax.map(lambda r: r @ w, x, batch_size=4)
    assert flops(per_row, ws[0], x) == MM


def test_backprop_and_remat():
    ws, x = args()
    loss = lambda ws, x: blocks(ws, x).sum()
    # forward, weight cotangent and input cotangent per trip (a scan runs one body each trip)
    assert flops(jax.grad(loss), ws, x) == 3 * L * MM

    def remat_loss(ws, x):
        step = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
        return jax.lax.scan(step, x, ws)[0].sum()

    # and each block's forward once more inside the backward sweep
    assert flops(jax.grad(remat_loss), ws, x) == 4 * L * MM


def test_cond_counts_its_largest_branch_and_vmap_its_batch():
    ws, x = args()
    f = lambda p, ws, x: jax.lax.cond(p, lambda: (x @ ws[0] @ ws[1]).sum(),
                                      lambda: (x @ ws[0]).sum())
    assert flops(f, True, ws, x) == 2 * MM
    assert flops(jax.vmap(lambda w, x: x @ w, in_axes=(0, None)), ws, x) == L * MM


def test_a_loop_without_a_known_trip_count_is_refused():
    ws, x = args()

    def until(ws, x):
        return jax.lax.while_loop(lambda h: h.sum() < 1e3, lambda h: h @ ws[0] + 1.0, x)

    with pytest.raises(ValueError, match="trip count"):
        flops(until, ws, x)


def test_hybrid_costs_backprop_plus_its_exact_share():
    """The hybrid's jvp of every example along its own tangent is backprop's count (three
    products per layer, the first layer's input tangent zero); its exact part adds the selected
    share's rematerialised backprop, and its control variate one dot h·v per micro-batch and
    leaf, nothing more."""
    stack = mlp(in_dim=D, width=D, depth=L, num_classes=D)
    params = stack.init(jax.random.key(1))
    n, k = 8, 2
    batch = {"x": jax.random.normal(jax.random.key(2), (n, B, D)),
             "y": jnp.zeros((n, B), jnp.int32)}
    full = jax.tree.map(lambda a: a.reshape((n * B,) + a.shape[2:]), batch)
    key = jax.random.key(3)
    mm = n * MM  # one product over the whole batch
    layers = L + 2  # embed, blocks, head (all D x D here)
    bp = flops(lambda p, b, k_: jg.backprop()(stack, p, b, k_), params, full, key)
    assert bp == (3 * layers - 1) * mm
    fwd = flops(lambda p, b, k_: jg.forward()(stack, p, b, k_), params, full, key)
    assert fwd == bp
    hyb = flops(lambda p, b, k_: jg.hybrid(num_exact=k, correction="control_variate")(
        stack, p, b, k_), params, batch, key)
    # exact part on the selected share: forward (L + 2), the blocks again (L), weight
    # cotangents (L + 2), input cotangents (L + 1: none for the embed's input)
    exact = (4 * L + 5) * mm * k / n
    # the control variate's scalars c = h·v: one dot per micro-batch (one tangent) and leaf,
    # 2 FLOPs per parameter (weights D x D and biases D, every layer)
    dots = 2 * n * layers * (D * D + D)
    assert hyb == pytest.approx(bp + exact + dots, rel=1e-4)  # + the loss's small products
    subset = flops(lambda p, b, k_: jg.exact_subset(num_exact=k)(stack, p, b, k_),
                   params, batch, key)
    assert subset == exact
