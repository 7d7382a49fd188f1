"""Backprop's reverse sweep from residuals kept by the forward sweep: the pullback equals
``jax.vjp``'s, the streamed gradient equals ``jax.grad`` of the model, the compiled reverse
kernel runs a third fewer FLOPs per dense block, and a block whose residuals cannot be kept
(a parameter-sized matmul output) is recomputed — checked on blocks written here, not the
library's model zoo."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstream.grad as jg
from jaxstream.models.nnx_stack import from_nnx
from jaxstream.stream import LayerStore
from jaxstream.stream import residuals as R
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

N, B, D, W, C = 3, 4, 5, 8, 3


class Gated(nnx.Module):
    """h + sigmoid(h Wg) * tanh(h Wv): four activation-sized residuals."""

    def __init__(self, rngs):
        self.g, self.v = nnx.Linear(W, W, rngs=rngs), nnx.Linear(W, W, rngs=rngs)

    def __call__(self, h):
        return h + jax.nn.sigmoid(self.g(h)) * jnp.tanh(self.v(h))


class Normed(nnx.Module):
    """h + gelu(LayerNorm(h) W): the norm's statistics are per-example residuals."""

    def __init__(self, rngs):
        self.norm, self.lin = nnx.LayerNorm(W, rngs=rngs), nnx.Linear(W, W, rngs=rngs)

    def __call__(self, h):
        return h + jax.nn.gelu(self.lin(self.norm(h)))


class Factored(nnx.Module):
    """tanh(h (A B)): the product A B is a matmul output the remat policy saves, but it is
    parameter-sized, not per example: the reverse sweep must not keep it for the step (the
    block is recomputed)."""

    def __init__(self, rngs):
        self.a = nnx.Param(jax.random.normal(rngs.params(), (W, 2)) / np.sqrt(W))
        self.b = nnx.Param(jax.random.normal(rngs.params(), (2, W)) / np.sqrt(2))

    def __call__(self, h):
        return jnp.tanh(h @ (self.a[...] @ self.b[...]))


BLOCKS = {"gated": Gated, "normed": Normed, "factored": Factored}


def model(name: str):
    rngs = nnx.Rngs(0)
    return from_nnx(nnx.Linear(D, W, rngs=rngs), lambda l: BLOCKS[name](rngs),
                    nnx.Linear(W, C, rngs=rngs), 3, name=f"residuals_{name}")


def _pullback(stack, p, h, ct):
    """The reference: jax.vjp of the block mapped over micro-batches, run as it is."""
    out, pull = jax.vjp(lambda pp, hh: jax.vmap(lambda x: stack.block(pp, x))(hh), p, h)
    return out, pull(ct)


def _close(a, b, tol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_kept_pullback_equals_jax_vjp(name):
    stack, params = model(name)
    p = jax.tree.map(lambda a: a[1], params["blocks"])
    h = jax.random.normal(jax.random.key(1), (N, B, W))
    ct = jax.random.normal(jax.random.key(2), (N, B, W))
    lay = R.layout(stack, p, h)
    if name == "factored":
        assert lay is None  # recomputed, never a parameter-sized copy kept for the step
        return
    assert lay is not None and any(s[0] == "p" for s in lay.sources)
    assert ("h", 0) in lay.sources  # the input is the stash itself, not kept twice
    out, res = R.apply_keep(stack, lay, p, h)
    ref_out, ref = _pullback(stack, p, h, ct)
    _close(out, ref_out)
    assert all(r.shape[:2] == (N, B) for r in res)
    _close(R.vjp_kept(stack, lay, p, h, res, ct), ref)


def test_the_reverse_kernel_runs_two_matmuls_of_three():
    """A dense tanh block: jax.vjp from the input runs x W again (3 matmuls); from the kept
    residuals, 2. Counted by XLA in the compiled programs."""

    class Dense(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, h):
            return jnp.tanh(self.lin(h))

    rngs = nnx.Rngs(0)
    stack, params = from_nnx(nnx.Linear(D, 64, rngs=rngs), lambda l: Dense(rngs),
                             nnx.Linear(64, C, rngs=rngs), 2, name="residuals_dense")
    p = jax.tree.map(lambda a: a[0], params["blocks"])
    h = jnp.ones((2, 32, 64))
    lay = R.layout(stack, p, h)
    _, res = R.apply_keep(stack, lay, p, h)

    def recompute(p, h, ct):
        return _pullback(stack, p, h, ct)[1]

    flops = lambda f, *a: f.lower(*a).compile().cost_analysis()["flops"]
    kept = flops(R.vjp_kept, stack, lay, p, h, res, h)
    full = flops(jax.jit(recompute), p, h, h)
    matmul = 2 * 2 * 32 * 64 * 64  # one (64 x 64) matmul over the 2 x 32 rows
    assert full - kept >= matmul  # the forward matmul is gone
    assert kept < 2 * matmul + 0.2 * matmul  # two matmuls and element-wise work


@pytest.mark.parametrize("stash_bytes", [None, 0])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_streamed_backprop_equals_jax_grad(tmp_path, name, stash_bytes):
    """Keep (and spilled to the host with stash_bytes=0) and recompute: jax.grad's gradient."""
    stack, params = model(name)
    x = jax.random.normal(jax.random.key(3), (N, B, D))
    y = jax.random.randint(jax.random.key(4), (N, B), 0, C)
    flat = {"x": x.reshape(N * B, D), "y": y.reshape(N * B)}
    ref = jax.grad(lambda p: jnp.mean(stack.example_loss(stack.apply(p, flat["x"]), flat)))(
        params)
    for mode in ("keep", "recompute"):
        store = LayerStore.create(tmp_path / mode, params, optimizer=optax.sgd(0.1))
        cfg = StreamConfig(compute_dtype="float32", stash_bytes=stash_bytes, residuals=mode)
        ex = StreamedExecutor(stack, jg.backprop(), optax.sgd(0.1), store, cfg)
        try:
            _, grads = ex.estimate({"x": x, "y": y}, jax.random.key(5))
            spilled = ex.placement.spilled
        finally:
            ex.close()
        _close(grads, ref, tol=2e-6)
        if stash_bytes == 0:
            assert spilled > 0


def test_a_bad_residuals_choice_is_refused():
    with pytest.raises(ValueError, match=r"residuals must be one of \('keep', 'recompute'\)"):
        StreamConfig(residuals="cache")
