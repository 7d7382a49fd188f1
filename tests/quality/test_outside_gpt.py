"""An outside group's GPT, written here in plain flax nnx (attention with a key bias, whose
gradient is exactly zero: a softmax does not see a constant added to a row of its logits),
through ``from_sequential`` / ``as_stack`` and the engines that run in memory, compared with
nnx's own gradient by :func:`jaxstream.quality.gradient_error`: correct gradients read at most
1e-5 (the old per-leaf measure, floored at 1e-3 of the largest entry, read 1.5e-5 on the key
bias's float noise), and a wrong one is flagged.

Two blocks: the fewest that make a repeated group for ``as_stack`` and a two-stage pipeline
(compile time grows with the depth; what is compared does not depend on it). Each engine is a
test of its own, jitted, on one module-scoped model and reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import jaxstream as js
import jaxstream.grad as jg
from jaxstream.comm import data_parallel
from jaxstream.pipeline import gpipe_backprop
from jaxstream.pipeline.executor import pipeline
from jaxstream.quality import gradient_error

V, T, D, H, L = 11, 6, 16, 2, 2  # vocabulary, tokens, width, heads, blocks
TOL = 1e-5


class Embed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (T, D)))

    def __call__(self, x):
        return self.tok(x) + self.pos[...]


class Block(nnx.Module):
    """Pre-norm causal attention (q, k, v with biases) and an MLP."""

    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(D, D, rngs=rngs) for _ in range(4))
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        split = lambda a: a.reshape(b, t, H, D // H).transpose(0, 2, 1, 3)
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // H)
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        att = jax.nn.softmax(logits, axis=-1) @ v
        x = x + self.o(att.transpose(0, 2, 1, 3).reshape(b, t, D))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


def gpt() -> nnx.Sequential:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(Embed(rngs), *(Block(rngs) for _ in range(L)),
                          nnx.LayerNorm(D, rngs=rngs), nnx.Linear(D, V, rngs=rngs))


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    x = rng.integers(0, V, (4, 2, T)).astype(np.int32)
    y = np.roll(x, -1, axis=-1)
    micro = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    flat = jax.tree.map(lambda a: a.reshape(8, T), micro)
    module = gpt()

    def nnx_loss(m, b):  # nnx's own forward and loss, written here
        logits = m(b["x"])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, b["y"][..., None], axis=-1))

    model = js.models.from_sequential(module, loss="cross_entropy")
    params = model.init(jax.random.key(0))
    # nnx's gradient, in the Sequential's structure (the same leaves in the same order)
    ref = jax.tree.unflatten(jax.tree.structure(params),
                             jax.tree.leaves(nnx.jit(nnx.grad(nnx_loss))(module, flat)))
    return model, params, ref, micro, flat


def test_key_bias_gradient_is_zero(setup):
    """The test's premise: the key bias's exact gradient is 0, its float gradient noise."""
    _, _, ref, _, _ = setup
    for block in ref[1:1 + L]:
        kb, qb = np.asarray(block["k"]["bias"]), np.asarray(block["q"]["bias"])
        assert np.max(np.abs(kb)) <= 1e-5 * np.max(np.abs(qb))


def _backprop(model, params, micro, flat):
    return jax.jit(lambda p: jg.backprop()(model, p, flat))(params)[1]


def _backprop_as_stack(model, params, micro, flat):
    view = js.models.as_stack(model)
    return view.unstack(jax.jit(lambda p: jg.backprop()(view.stack, p, flat))(view.params(params))[1])


def _hybrid_all_exact(model, params, micro, flat):
    est = jg.hybrid(exact_indices=tuple(range(4)), correction="weighted", num_tangents=2)
    return jax.jit(lambda p: est(model, p, micro, jax.random.key(1)))(params)[1]


def _dataparallel_backprop(model, params, micro, flat):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    est = jax.jit(data_parallel(jg.backprop(), mesh), static_argnums=0)
    return est(model, params, flat, jax.random.key(1))[1]


def _pipeline_backprop_as_stack(model, params, micro, flat):
    view = js.models.as_stack(model)
    pipe = jax.jit(pipeline(view.stack, gpipe_backprop(L, 4), jg.backprop()))
    return view.unstack(pipe(view.params(params), micro, jax.random.key(1))[1])


ENGINES = {  # name -> gradient: every engine that runs this model in memory
    "memory backprop": _backprop,
    "memory backprop (as_stack)": _backprop_as_stack,
    "memory hybrid, all exact": _hybrid_all_exact,
    "dataparallel backprop": _dataparallel_backprop,
    "pipeline backprop (as_stack)": _pipeline_backprop_as_stack,
}


@pytest.mark.parametrize("name", list(ENGINES))
def test_correct_gradients_pass_on_every_in_memory_engine(setup, name):
    model, params, ref, micro, flat = setup
    e = gradient_error(ENGINES[name](model, params, micro, flat), ref)
    print(f"{name}: whole {e.whole:.2e}, worst leaf {e.leaf:.2e} at {e.worst}")
    assert e.whole <= TOL and e.leaf <= TOL, (name, e)


def test_a_wrong_gradient_is_flagged(setup):
    """One query bias off by 1 % (a small leaf, hidden in the whole norm), or the whole
    gradient 1 % off, fails the comparison."""
    _, _, ref, _, _ = setup
    wrong = [dict(b) for b in ref]
    wrong[2] = {**ref[2], "q": {**ref[2]["q"], "bias": ref[2]["q"]["bias"] * 1.01}}
    e = gradient_error(tuple(wrong), ref)
    assert e.leaf >= 5e-3 and e.worst == "[2]['q']['bias']", e
    assert gradient_error(jax.tree.map(lambda a: a * 1.01, ref), ref).whole >= 5e-3
