"""Tangent directions, regenerated from PRNG keys instead of stored.

Every tangent is a pure function of ``(key, segment, leaf)``. The key schedule is the contract
shared by all engines (in-memory, pipelined, streamed), so that they produce identical
estimates for the same keys:

* micro-batch ``n`` of a step keyed ``key`` uses ``micro_key(key, n) = fold_in(key, n)``;
* for a model stack's params ``{"embed", "blocks", "head"}``: embed leaves use
  ``fold_in(key, 0)``, block ``l`` (global layer index) uses ``fold_in(fold_in(key, 1), l)``,
  head leaves use ``fold_in(key, 2)``; leaf ``i`` of a segment (in ``jax.tree.leaves`` order)
  folds in ``i`` once more;
* any other params pytree is a single segment keyed by ``key``.

A sample holds all ``num`` tangents of a leaf at once (shape ``(num, *leaf.shape)``) so that
orthogonalisation and antithetic pairs are local to the leaf.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.random import fold_in

from jaxstream.grad.threefry import random_normal, random_words, tied, vmap_exact
from jaxstream.models.stack import is_stack_params, loss_dtype

ANTITHETIC = ("antithetic: refused for jvp estimates: (∇L·(−v))(−v) = (∇L·v)v, so an antithetic "
              "pair is one tangent counted twice at twice the compute (K antithetic tangents "
              "give the estimate of K/2 plain ones); use num_tangents=K/2")
Distribution = Literal["rademacher", "gaussian"]
DISTRIBUTIONS = ("rademacher", "gaussian")
EMBED, BLOCKS, HEAD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TangentSpec:
    """How tangents are drawn: ``num`` per micro-batch, with E[v vᵀ] = I.

    Attributes:
      num: tangents per micro-batch (K >= 1).
      distribution: ``"rademacher"`` (±1) or ``"gaussian"``.
      orthogonal: orthogonalise the K tangents within each leaf holding at least K entries
        (Gram–Schmidt, rescaled so each stays on the sphere of radius √n; still E[v vᵀ] = I at
        every leaf size: rows a small leaf's sign vectors leave linearly dependent are redrawn,
        see :func:`_orthogonalise`).
      antithetic: refused (kept so that a caller asking for it is told why): every estimate
        here is a jvp, and (∇L·(−v))(−v) = (∇L·v)v, so a ±v pair adds only compute.
      rank: low-rank tangents (None: full ones). A 2-D leaf of shape (m, n) (a weight matrix
        of one layer) gets v = A Bᵀ / √r with A (m, r) and B (n, r) of iid entries drawn by
        ``distribution`` (zero mean, unit variance); every other leaf (biases, vectors, a
        stacked or a conv kernel) gets a full tangent. Still E[v vᵀ] = I:
        E[v_ij v_kl] = (1/r) Σ_a E[A_ia A_ka] E[B_ja B_la] = δ_ik δ_jl, so (∇L·v) v stays
        unbiased. Draws (m + n) r numbers instead of m n.
    """

    num: int = 1
    distribution: Distribution = "rademacher"
    orthogonal: bool = False
    antithetic: bool = False
    rank: int | None = None

    def __post_init__(self):
        if not isinstance(self.num, int) or self.num < 1:
            raise ValueError(f"num_tangents must be an int >= 1, got {self.num!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}"
            )
        if self.antithetic:
            raise ValueError(ANTITHETIC)
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or self.rank < 1):
            raise ValueError(f"rank must be None (full tangents) or an int >= 1, got {self.rank!r}")
        if self.rank is not None and self.orthogonal:
            raise ValueError("orthogonal=True with rank: orthogonalising a low-rank tangent's "
                             "entries breaks its low rank; allowed: orthogonal=False with rank, "
                             "or rank=None")

    def sample(self, key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
        """``num`` tangents of one leaf, shape ``(num, *shape)``."""
        draws = self.num
        size = math.prod(shape)
        if self.rank is not None and len(shape) == 2:
            return self._low_rank(key, shape).astype(dtype)
        v = self._draw(key, size)
        if self.orthogonal and draws > 1 and size >= draws:
            v = _orthogonalise(v, jax.random.fold_in(key, 1))
        return v.reshape((self.num, *shape)).astype(dtype)

    def _draw(self, key: jax.Array, size: int) -> jax.Array:
        """``(num, size)`` iid float32 entries of the distribution (zero mean, unit variance)."""
        if self.distribution == "rademacher":
            return vmap_exact(lambda k: rademacher_bits(k, self.num, size), key)
        return vmap_exact(lambda k: random_normal(k, (self.num, size)), key)

    def _low_rank(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """``num`` tangents A Bᵀ / √r of an (m, n) leaf, the factors A (m, r) and B (n, r) drawn
        as one (m + n, r) block of the distribution; the product at full float32 precision (a
        TF32 / bf16 default matmul on an accelerator would round it: other tangents there than
        on a CPU for the same key)."""
        (m, n), r = shape, self.rank
        z = self._draw(key, (m + n) * r).reshape(self.num, m + n, r)
        v = jnp.einsum("kir,kjr->kij", z[:, :m], z[:, m:], precision=jax.lax.Precision.HIGHEST)
        return v * jnp.float32(1.0 / math.sqrt(r))


def _orthogonalise(v: jax.Array, spare: jax.Array) -> jax.Array:
    """The rows of ``v`` (draws, size) Gram–Schmidt orthogonalised, each rescaled to norm
    √size, so E[v vᵀ] = I still holds.

    The draws' distribution is invariant under signed permutations of the entries (and the
    Gaussian's under every rotation), and Gram–Schmidt is equivariant under them, so the result
    keeps that invariance — unless some rows are linearly dependent (sign vectors of a small leaf
    often are: two equal rows, or ±1 patterns that add up). Those rows (distance to the span of
    the rows before them below 1e-3 √size) are redrawn as Gaussian rows from ``spare`` before a
    second pass: a Gaussian row is independent of the others almost surely and
    rotation-invariant, so the completion is invariant too. Each q_k has a positive component
    along its row (QR with r_kk > 0: Q is Haar-distributed, zero-mean rows).

    Plain ``jnp`` with a fixed number of steps, no LAPACK call: under ``jax.vmap`` over keys,
    XLA's CPU runtime ran the batched QR's two custom calls (geqrf, orgqr) at once, each
    waiting in its parallel batch loop for pool threads the other held — a deadlock of every
    thread (jaxlib 0.10.2), in about half of the runs above 12,000 keys.
    """
    size = v.shape[1]
    tol = 1e-3 * jnp.sqrt(jnp.float32(size))  # a sign row's norm is √size
    q, d = _gram_schmidt(v, tol)
    deficient = d < tol
    redrawn = jnp.where(deficient[:, None], jax.random.normal(spare, v.shape, jnp.float32), v)
    q = jnp.where(jnp.any(deficient), _gram_schmidt(redrawn, tol)[0], q)
    return q * jnp.sqrt(jnp.float32(size))


def _gram_schmidt(v: jax.Array, tol: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q, d): the orthonormal rows of ``v`` (draws, size) in order, and each row's distance
    d_k to the span of the rows before it (|r_kk| of a QR). Classical Gram–Schmidt with one
    re-orthogonalisation (CGS2: orthogonal to float32 precision); a row closer than ``tol`` to
    that span leaves a zero row in q and is not projected out of the rows after it. A rolled
    loop: unrolled, a step with orthogonal tangents compiled about a third slower."""
    draws = v.shape[0]

    def step(k, qd):
        q, d = qd
        w = jax.lax.dynamic_index_in_dim(v, k, keepdims=False)
        for _ in range(2):
            w = w - (q @ w) @ q  # q's rows from k on are still zero
        norm = jnp.sqrt(jnp.sum(w * w))
        row = jnp.where(norm >= tol, w / jnp.maximum(norm, tol), 0.0)
        return q.at[k].set(row), d.at[k].set(norm)

    start = (jnp.zeros_like(v), jnp.zeros((draws,), v.dtype))
    return jax.lax.fori_loop(0, draws, step, start)


def rademacher_bits(key: jax.Array, draws: int, size: int) -> jax.Array:
    """±1 float32 signs, shape ``(draws, size)``, unpacked from ``size / 32`` random words.

    One uint32 word gives 32 signs, so the generator produces 32× fewer values than
    ``jax.random.rademacher`` (which draws a float per sign) and XLA fuses the unpacking into
    the consumer: the only params-sized buffer left is the float tangent itself.
    """
    words = -(-size // 32)
    bits = random_words(key, (draws, words))
    shifts = jnp.arange(32, dtype=jnp.uint32)
    signs = ((bits[:, :, None] >> shifts) & jnp.uint32(1)).reshape(draws, words * 32)[:, :size]
    return 1.0 - 2.0 * signs.astype(jnp.float32)


def micro_key(key: jax.Array, n: int | jax.Array) -> jax.Array:
    """Key of micro-batch ``n`` within a step keyed ``key``."""
    return fold_in(key, n)


def block_key(key: jax.Array, layer: int | jax.Array) -> jax.Array:
    """Key of block ``layer`` (global index) of a stack."""
    return fold_in(fold_in(key, BLOCKS), layer)


def leaf_tangents(spec: TangentSpec, key: jax.Array, tree: Any) -> Any:
    """Tangents of every leaf of ``tree`` (one segment): leaves ``(num, *leaf.shape)``."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [spec.sample(fold_in(key, i), tuple(x.shape), x.dtype)
           for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def block_tangents(spec: TangentSpec, key: jax.Array, block_params: Any, layer) -> Any:
    """Tangents of one block (a slice of ``params["blocks"]``) at global index ``layer``."""
    return leaf_tangents(spec, block_key(key, layer), block_params)


def _blocks_map(fn, blocks: Any, first_layer: int = 0):
    """``lax.map`` of ``fn(block_params, layer)`` over the stacked blocks."""
    num_layers = jax.tree.leaves(blocks)[0].shape[0]
    layers = first_layer + jnp.arange(num_layers)
    return jax.lax.map(lambda xs: fn(*xs), (blocks, layers))


def tangents(spec: TangentSpec, key: jax.Array, params: Any) -> Any:
    """All tangents of ``params`` materialised (leaves ``(num, *shape)``); for tests and for
    generic loss functions. Engines that know the layer structure regenerate per layer instead."""
    if not is_stack_params(params):
        return leaf_tangents(spec, key, params)
    blocks = _blocks_map(lambda p, l: block_tangents(spec, key, p, l), params["blocks"])
    return {
        "embed": leaf_tangents(spec, fold_in(key, EMBED), params["embed"]),
        # lax.map stacks the layer axis first; tangents are num-leading everywhere.
        "blocks": jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), blocks),
        "head": leaf_tangents(spec, fold_in(key, HEAD), params["head"]),
    }


def _segment_apply(fn, keys: jax.Array, like: Any, first_layer: int = 0, rows: Any = None) -> Any:
    """Apply ``fn(seg_keys, seg_tree, seg_rows)`` per segment, where ``seg_keys`` (N,) are the
    segment's keys for every micro-batch and ``seg_rows`` the segment's entry of ``rows`` (a
    per-segment dict like :func:`jaxstream.grad.corrections.group_masks` returns, blocks with a
    leading layer axis; None: no rows); blocks are mapped layer by layer."""
    if not is_stack_params(like):
        return {"tree": fn(keys, like, None if rows is None else rows["tree"])}
    seg = lambda k, s: jax.vmap(lambda kk: fold_in(kk, s))(k)
    num_layers = jax.tree.leaves(like["blocks"])[0].shape[0]
    layers = first_layer + jnp.arange(num_layers)
    block_rows = None if rows is None else rows["blocks"]
    blocks = jax.lax.map(
        lambda xs: fn(jax.vmap(lambda kk: block_key(kk, xs[1]))(keys), xs[0], xs[2]),
        (like["blocks"], layers, block_rows),
    )
    return {
        "embed": fn(seg(keys, EMBED), like["embed"], None if rows is None else rows["embed"]),
        "blocks": blocks,
        "head": fn(seg(keys, HEAD), like["head"], None if rows is None else rows["head"]),
    }


def combine(
    spec: TangentSpec, keys: jax.Array, coeffs: jax.Array, like: Any, first_layer: int = 0,
    rows: Any = None, init: Any = None,
) -> Any:
    """``init`` + Σ_n Σ_k coeffs[n, k] · v_nk, tangents regenerated per segment (never all at
    once).

    Args:
      spec: the tangent distribution.
      keys: (N,) micro-batch keys.
      coeffs: (N, num) coefficients.
      like: a params pytree (shapes and dtypes of the result). For a stack's blocks,
        ``first_layer`` is the global index of ``like["blocks"]``'s first layer.
      rows: optional per-segment weights of the N micro-batches (``{"embed": (N,), "blocks":
        (L, N), "head": (N,)}`` or ``{"tree": (N,)}``), multiplying ``coeffs`` in that segment.
      init: a tree shaped like ``like`` the sum starts from (default zeros). The sum is added
        into it block by block, so XLA updates its buffer in place: a hybrid's h and its
        estimate share one params-sized buffer instead of two.
    Returns:
      A pytree shaped like ``like``, in its dtypes (the sum is accumulated in at least
      float32: bf16 leaves in float32, float64 leaves in float64).
    """

    # The keys wait for the coefficients: XLA would otherwise draw the tangents of segments
    # outside a scan (the embed) before the forward pass and keep them through it.
    keys = tied(keys, coeffs)
    start = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), _acc_dtype(x)), like) if init is None \
        else jax.tree.map(lambda a, x: a.astype(_acc_dtype(x)), init, like)

    def seg(seg_keys, acc, seg_rows):
        c_all = coeffs if seg_rows is None else coeffs * seg_rows[:, None]

        def body(acc, kc):
            k, c = kc
            v = leaf_tangents(spec, k, jax.tree.map(_f32_like, acc))
            return jax.tree.map(lambda a, vv: a + jnp.tensordot(
                c.astype(a.dtype), vv.astype(a.dtype), axes=1), acc, v), None

        return jax.lax.scan(body, acc, (seg_keys, c_all.astype(_acc_dtype(c_all))))[0]

    cast = lambda acc, tree: jax.tree.map(
        lambda a, x: a.astype(jnp.result_type(x)), acc, tree)
    if not is_stack_params(like):
        return cast(seg(keys, start, None if rows is None else rows["tree"]), like)
    seg_keys = lambda s: jax.vmap(lambda kk: fold_in(kk, s))(keys)
    get = lambda name: None if rows is None else rows[name]

    def layer(l, blocks):
        keys_l = jax.vmap(lambda kk: block_key(kk, first_layer + l))(keys)
        acc_l = seg(keys_l, jax.tree.map(lambda a: a[l], blocks),
                    None if rows is None else rows["blocks"][l])
        return jax.tree.map(lambda a, x: a.at[l].set(x), blocks, acc_l)

    num_layers = jax.tree.leaves(like["blocks"])[0].shape[0]
    out = {
        "embed": seg(seg_keys(EMBED), start["embed"], get("embed")),
        "blocks": jax.lax.fori_loop(0, num_layers, layer, start["blocks"]),
        "head": seg(seg_keys(HEAD), start["head"], get("head")),
    }
    return cast(out, like)


def _acc_dtype(x) -> Any:
    """The accumulation dtype of a leaf: its own promoted to at least float32."""
    return loss_dtype(jnp.result_type(x))


def _f32_like(x):
    """A float32 stand-in for a leaf (tangents are drawn in float32 whatever the params' dtype,
    so bf16 params get the same directions as their fp32 master)."""
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32)


def project(spec: TangentSpec, keys: jax.Array, tree: Any, first_layer: int = 0) -> jax.Array:
    """⟨tree, v_nk⟩ for every micro-batch n and tangent k: shape (N, num)."""

    def seg(seg_keys, t, _rows):
        def one(k):
            v = leaf_tangents(spec, k, t)
            dots = jax.tree.map(
                lambda a, vv: jnp.tensordot(vv.reshape(vv.shape[0], -1), a.reshape(-1), axes=1),
                t,
                v,
            )
            return sum(jax.tree.leaves(dots), jnp.zeros((spec.num,), jnp.float32))

        return jax.lax.map(one, seg_keys)

    parts = _segment_apply(seg, keys, tree, first_layer)
    if not is_stack_params(tree):
        return parts["tree"]
    return parts["embed"] + parts["blocks"].sum(axis=0) + parts["head"]


def gram_parts(spec: TangentSpec, key: jax.Array, like: Any, first_layer: int = 0) -> dict:
    """Per segment, the (num, num) Gram matrix of one micro-batch's tangents (blocks summed
    over their layers): a pipeline stage adds up the segments it holds."""

    def seg(seg_keys, t, _rows):
        v = leaf_tangents(spec, seg_keys[0], jax.tree.map(_f32_like, t))
        flat = [x.reshape(spec.num, -1) for x in jax.tree.leaves(v)]
        return sum((f @ f.T for f in flat), jnp.zeros((spec.num, spec.num), jnp.float32))

    parts = _segment_apply(seg, key[None], like, first_layer)
    if not is_stack_params(like):
        return parts
    return {**parts, "blocks": parts["blocks"].sum(axis=0)}


def gram(spec: TangentSpec, key: jax.Array, like: Any) -> jax.Array:
    """The (num, num) Gram matrix Vᵀ V of one micro-batch's tangents."""
    return sum(gram_parts(spec, key, like).values())
