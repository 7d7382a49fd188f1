"""Where a hybrid step's temporary memory and time go: each part compiled alone, with the
alternatives for it side by side (used by ``memory_time.py --parts``).

The step (``hybrid(num_exact=2, correction="control_variate")``, N micro-batches) is

* **exact**: h, the mean exact gradient of the selected micro-batches —
  ``vmap(grad)`` (every selected micro-batch's gradient tree and activations at once),
  ``scan(grad)`` (one after another, each tree added to h), or ``sweep``
  (:func:`jaxstream.grad.exact.group_exact_mean`: one forward keeping block inputs, a
  rematerialised reverse sweep adding each block's gradient straight into h);
* **forward**: the N jvps with their directional derivatives d — all ``vmap``-ed at once,
  in chunks of ``FORWARD_CHUNK`` (``lax.map(batch_size=...)``), or one at a time — each also
  summing c = h·v as it draws its tangents (``+c``) or not;
* **c**: the residual scalars in a pass of their own (:func:`jaxstream.grad.tangents.project`,
  every tangent drawn again);
* **sum**: Σ (d − c) v / (N K) over the N micro-batches' tangents, from zeros and then added to
  h (two params-sized trees), or added into h's buffer (``init=h``).

Two more parts are not pieces of the step but its floor (:func:`jaxstream_lab.table_cost.redraw_floor`):

* **GEMM chain**: the forward pass's matrix products alone (the full batch through every block's
  kernel, nothing else): the best FLOP rate this machine gives the step's widest product;
* **draws**: the N micro-batches' tangents of every block, drawn with the step's keys and each
  only summed (the least any use of a draw costs);
* **draws by jax.random.bits**: the same tangents, their words hashed by ``jax.random.bits``
  (on CPU a loop of five passes over the words) instead of
  :func:`jaxstream.grad.threefry.random_words` (one pass): the baseline of the hash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad import corrections as cr
from jaxstream.grad import tangents as tg
from jaxstream.grad.directional import directional
from jaxstream.grad.exact import group_exact_mean
from jaxstream.grad.hybrid import FORWARD_CHUNK

SELECTED = (3, 11)  # two of the N micro-batches


def part_functions(stack: Any, num_micro: int) -> dict[str, Callable]:
    """``name -> f(params, micro_batches, key)`` for every part and alternative."""
    spec = tg.TangentSpec()
    idx = jnp.array(SELECTED)
    masks = lambda p: cr.group_masks(p, jnp.zeros((len(SELECTED),), jnp.int32))
    keys = lambda key: jax.vmap(lambda i: tg.micro_key(key, i))(jnp.arange(num_micro))
    sel = lambda b: jax.tree.map(lambda x: x[idx], b)

    def exact_vmap(p, b, k):
        return jax.tree.map(lambda g: g.mean(0), jax.vmap(lambda bb: jax.grad(stack)(p, bb))(sel(b)))

    def exact_scan(p, b, k):
        def body(acc, bb):
            return jax.tree.map(lambda a, g: a + g / len(SELECTED), acc, jax.grad(stack)(p, bb)), None
        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), sel(b))[0]

    def exact_sweep(p, b, k):
        return group_exact_mean(stack, p, sel(b), masks(p))[0]

    def forward(batch_size: int | None, probe: bool) -> Callable:
        def f(p, b, k):
            fn = lambda bk: directional(stack, spec, p, bk[0], bk[1], p if probe else None)
            if batch_size == num_micro:
                return jax.vmap(lambda bb, kk: fn((bb, kk)))(b, keys(k))
            return jax.lax.map(fn, (b, keys(k)), batch_size=batch_size)
        return f

    def c_pass(p, b, k):
        return tg.project(spec, keys(k), p)

    coeffs = jnp.ones((num_micro, 1)) / num_micro

    def sum_then_add(p, b, k):
        return jax.tree.map(jnp.add, p, tg.combine(spec, keys(k), coeffs, p))

    def sum_into(p, b, k):
        return tg.combine(spec, keys(k), coeffs, p, init=p)

    def gemm_chain(p, b, k):
        x = b["x"].reshape(-1, b["x"].shape[-1])
        kernels = [w for w in jax.tree.leaves(p) if w.ndim == 3 and w.shape[1:] == (x.shape[1],) * 2]
        if len(kernels) != 1:
            raise ValueError("gemm chain: expected one stacked (L, W, W) kernel leaf")
        return jax.lax.scan(lambda h, w: (h @ w, None), x, kernels[0])[0].sum()

    def draws(p, b, k):
        total = lambda tree: sum(v.sum() for v in jax.tree.leaves(tree))

        def one(kk):  # every block's tangents drawn and summed in the scan (fused, no buffer)
            def layer(acc, pl):
                return acc + total(tg.block_tangents(spec, kk, *pl)), None
            layers = jnp.arange(jax.tree.leaves(p["blocks"])[0].shape[0])
            blocks = jax.lax.scan(layer, jnp.float32(0), (p["blocks"], layers))[0]
            ends = [tg.leaf_tangents(spec, jax.random.fold_in(kk, seg), p[name])
                    for seg, name in ((tg.EMBED, "embed"), (tg.HEAD, "head"))]
            return blocks + total(ends)
        return jax.lax.map(one, keys(k)).sum()

    def draws_jax_random(p, b, k):
        """``draws``, every leaf's ±1 signs unpacked from ``jax.random.bits`` words
        (``draws.py``'s baseline draw, with the key schedule of
        :func:`jaxstream.grad.tangents.leaf_tangents`)."""
        from draws import jax_signs

        def leaf_total(key, tree):
            return sum((jax_signs(jax.random.fold_in(key, i), x.size).sum()
                        for i, x in enumerate(jax.tree.leaves(tree))), jnp.float32(0))

        def one(kk):
            def layer(acc, pl):
                return acc + leaf_total(tg.block_key(kk, pl[1]), pl[0]), None
            layers = jnp.arange(jax.tree.leaves(p["blocks"])[0].shape[0])
            blocks = jax.lax.scan(layer, jnp.float32(0), (p["blocks"], layers))[0]
            return blocks + sum(leaf_total(jax.random.fold_in(kk, seg), p[name])
                                for seg, name in ((tg.EMBED, "embed"), (tg.HEAD, "head")))
        return jax.lax.map(one, keys(k)).sum()

    return {
        "GEMM chain": gemm_chain,
        "draws": draws,
        "draws by jax.random.bits": draws_jax_random,
        "exact vmap(grad)": exact_vmap,
        "exact scan(grad)": exact_scan,
        "exact sweep": exact_sweep,
        "forward vmap": forward(num_micro, False),
        "forward vmap +c": forward(num_micro, True),
        f"forward chunks of {FORWARD_CHUNK} +c": forward(FORWARD_CHUNK, True),
        "forward one by one +c": forward(None, True),
        "c own pass": c_pass,
        "sum then + h": sum_then_add,
        "sum into h": sum_into,
    }
