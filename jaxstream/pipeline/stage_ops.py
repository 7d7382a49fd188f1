"""What one pipeline stage computes for each op kind: jvp forward (F) and explicit vjps (B, W).

A stage holds ``{"embed", "blocks" (its slice), "head"}``; the first stage runs the embed, the
last the head and the loss. The forward ops are the core's segment kernels (``jaxstream.grad.segments``), the
same the single-device estimators scan, so both give the same directional derivatives.

Example:
  >>> ops = StageOps(stack, TangentSpec(), first_layer=0)
  >>> h, dh = ops.forward_first(params, x, key)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxstream.grad import segments as sg
from jaxstream.grad.tangents import TangentSpec
from jaxstream.models.stack import Stack, loss_dtype

if TYPE_CHECKING:
    from jaxstream.grad.passes import ForwardPass


@dataclasses.dataclass(frozen=True, eq=False)
class StageOps:
    """The F/B/W computations of one stage whose blocks start at global layer ``first_layer``."""

    stack: Stack
    spec: TangentSpec
    first_layer: Any  # int or a traced int (the stage index times layers per stage)

    # ------------------------------------------------------------------ forward with tangents
    def _blocks_jvp(self, p, h, dh, key):
        return sg.blocks_jvp(self.stack, self.spec, p["blocks"], self.first_layer, h, dh, key)

    def _head_loss_jvp(self, p, h, dh, key, batch):
        return sg.head_jvp(self.stack, self.spec, p["head"], h, dh, key, batch)

    def forward_first(self, p, x, key):
        """(h, dh): embed and the stage's blocks, with K tangents."""
        h, dh = sg.embed_jvp(self.stack, self.spec, p["embed"], x, key)
        return self._blocks_jvp(p, h, dh, key)

    def forward_mid(self, p, h, dh, key):
        """(h, dh) through the stage's blocks."""
        return self._blocks_jvp(p, h, dh, key)

    def forward_last(self, p, h, dh, key, batch):
        """(loss, d): blocks, head and loss; d (K,) the directional derivatives."""
        h, dh = self._blocks_jvp(p, h, dh, key)
        return self._head_loss_jvp(p, h, dh, key, batch)

    def forward_only(self, p, x, key, batch):
        """(loss, d) of a one-stage pipeline."""
        h, dh = self.forward_first(p, x, key)
        return self._head_loss_jvp(p, h, dh, key, batch)

    def weights_forward(self, position: str, p, inp, dh, key, batch):
        """F op with tangents on the weights at ``position``: ``(h, dh)``, or on the last stage
        ``(mean loss, d (K,))``; ``inp`` is the micro-batch's input on the first stage."""
        if position == "first":
            return self.forward_first(p, inp, key)
        if position == "mid":
            return self.forward_mid(p, inp, dh, key)
        if position == "last":
            return self.forward_last(p, inp, dh, key, batch)
        return self.forward_only(p, inp, key, batch)

    # ------------------------------------------------------------------ the F op of a pass
    def forward_op(self, fp: ForwardPass | None, direction: Any = None) -> Callable:
        """The F op of forward pass ``fp`` (None: tangents on the weights; ``direction``: the
        derivatives along it), one function of the stage's position::

            (position, params, input, input tangents, key, batch) -> (a, b, g)

        ``a``: the stage's output h (first/mid) or the micro-batch's mean loss (last/only);
        ``b``: the tangents passed on (first/mid) or the scalars d, None where the pass has
        none (local losses); ``g``: the stage's weight estimates formed by the pass itself,
        None where they come later (from d)."""
        if direction is not None:
            return lambda pos, p, inp, dh, key, batch: (
                *self.along_forward(pos, p, direction, inp, dh, batch), None)
        if fp is not None and fp.guess:
            return lambda pos, p, inp, dh, key, batch: _local(
                self.local_exact_forward(pos, p, inp, batch))
        if fp is not None and fp.local_losses:
            weights = fp.tangents == "weights"
            return lambda pos, p, inp, dh, key, batch: _local(
                self.local_forward(pos, p, inp, key, batch, weights=weights))
        if fp is not None and fp.forms_block_estimates:
            return lambda pos, p, inp, dh, key, batch: (
                *self.activity_forward(pos, p, inp, dh, key, batch), None)
        return lambda pos, p, inp, dh, key, batch: (
            *self.weights_forward(pos, p, inp, dh, key, batch), None)

    # ------------------------------------------------------------------ activity perturbation
    def activity_forward(self, position: str, p, inp, dh, key, batch):
        """F op with tangents on every segment's output: ``(h, dh)``, or on the last stage
        ``(mean loss, d (K, B))`` with d the per-example scalars of :func:`sg.head_act`."""
        st, spec = self.stack, self.spec
        if position in ("first", "only"):
            inp, dh = sg.embed_act(st, spec, p["embed"], inp, key)
        h, dh = sg.blocks_act(st, spec, p["blocks"], self.first_layer, inp, dh, key)
        if position in ("first", "mid"):
            return h, dh
        ex_loss, d = sg.head_act(st, spec, p["head"], h, dh, key, batch)
        return jnp.mean(ex_loss), d

    def activity_grads(self, p, x, h_in, key, d, is_first, is_last):
        """The stage's weight estimates for one micro-batch from its scalars ``d`` (K, B): each
        segment's forward recomputed and a vjp through it alone (:func:`sg.act_grad`). The
        embed (first stage) and head (last stage) terms are zero elsewhere."""
        st, spec, nb = self.stack, self.spec, d.shape[1]
        h0, g_embed = sg.act_grad(lambda pe: st.embed(pe, x), p["embed"], spec, key, "embed", d, nb)
        h = jnp.where(is_first, h0, h_in)

        def body(h, xs):
            pl, layer = xs
            return sg.act_grad(lambda pp: st.block(pp, h), pl, spec, key, layer, d, nb)

        n = jax.tree.leaves(p["blocks"])[0].shape[0]
        h, g_blocks = jax.lax.scan(body, h, (p["blocks"], self.first_layer + jnp.arange(n)))
        _, g_head = sg.act_grad(lambda ph: st.head(ph, h), p["head"], spec, key, "head", d, nb)
        return {"embed": jax.tree.map(lambda g: g * is_first, g_embed), "blocks": g_blocks,
                "head": jax.tree.map(lambda g: g * is_last, g_head)}

    def local_forward(self, position: str, p, inp, key, batch, weights: bool = False):
        """F op with local losses: ``(h or mean loss, weight estimates of the stage)``; every
        segment's tangent reaches only its own loss (the head applied to its output). Tangents
        on the segments' outputs (activity), or with ``weights`` on their weights (LG-FG-W)."""
        st, spec = self.stack, self.spec
        example = lambda lg: st.example_loss(lg.astype(loss_dtype(lg.dtype)), batch)

        def kernel(fn, pp, seg):
            return sg.local_grad(st, fn, pp, spec, key, seg, p["head"], example, weights)

        last = position in ("last", "only")
        out, g = sg.segment_sweep(st, p, inp, kernel, self.first_layer,
                                  embed=position in ("first", "only"), head=last)
        return (jnp.mean(example(out)) if last else out), g

    def local_exact_forward(self, position: str, p, inp, batch):
        """F op of the local guess: ``(h or mean loss, the stage's exact local-loss gradients)``
        (each segment's own loss through the shared head or its own local head; the head's:
        the global loss), the local guess's direction U (:func:`jaxstream.grad.local_targets`)."""
        from jaxstream.grad.local_guess import _guess_kernel

        st = self.stack
        example = lambda lg: st.example_loss(lg.astype(loss_dtype(lg.dtype)), batch)
        last = position in ("last", "only")
        out, g = sg.segment_sweep(st, p, inp, _guess_kernel(st, p["head"], example),
                                  self.first_layer, embed=position in ("first", "only"),
                                  head=last)
        return (jnp.mean(example(out)) if last else out), g

    # ------------------------------------------------------------------ along a given direction
    def along_forward(self, position: str, p, u, inp, dh, batch):
        """F op of the ``guess`` correction: derivatives along the direction ``u`` (params-like,
        this stage's slice) instead of drawn tangents; ``(h, dh (1, ...))`` or on the last stage
        ``(mean loss, d (1,))``."""
        st = self.stack
        if position in ("first", "only"):
            inp, dh = sg.embed_jvp_along(st, p["embed"], u["embed"], inp)
        else:
            dh = dh[0]

        def body(c, xs):
            return sg.block_jvp_along(st, xs[0], xs[1], *c), None

        (h, dh), _ = jax.lax.scan(body, (inp, dh), (p["blocks"], u["blocks"]))
        if position in ("first", "mid"):
            return h, dh[None]
        loss, dl = sg.head_jvp_along(st, p["head"], u["head"], h, dh, batch)
        return loss, dl[None]

    # ------------------------------------------------------------------ primal (for vjp)
    def primal(self, position: str, p, inp, batch):
        """The stage's output: h (first/mid) or the micro-batch's mean loss (last/only)."""
        h = self.stack.embed(p["embed"], inp) if position in ("first", "only") else inp
        h = self.stack.run_blocks(p["blocks"], h)
        if position in ("first", "mid"):
            return h
        return jnp.mean(self.stack.example_loss(self.stack.head(p["head"], h), batch))

    def backward(self, position: str, p, inp, cot, batch, want_input: bool, want_weights: bool):
        """(input cotangent, weight cotangent) by explicit vjp (recomputing the forward).

        The first stage's input is data: its input cotangent is zeros. On the last stage the
        cotangent comes from the loss (1 for the micro-batch's mean loss) and ``cot`` is ignored.
        """
        last = position in ("last", "only")
        zeros_p = jax.tree.map(jnp.zeros_like, p)

        def pull(fn, *args):
            out, vjp = jax.vjp(fn, *args)  # the loss's own dtype on the last stage (float64 too)
            return vjp(jnp.ones_like(out) if last else cot.astype(out.dtype))

        if position in ("first", "only"):
            if not want_weights:
                return jnp.zeros_like(cot) if position == "first" else None, zeros_p
            return None, pull(lambda pp: self.primal(position, pp, inp, batch), p)[0]
        if want_weights and want_input:
            gp, gi = pull(lambda pp, hh: self.primal(position, pp, hh, batch), p, inp)
            return gi, gp
        if want_input:
            return pull(lambda hh: self.primal(position, p, hh, batch), inp)[0], zeros_p
        return jnp.zeros_like(inp), pull(lambda pp: self.primal(position, pp, inp, batch), p)[0]


def _local(out: tuple) -> tuple:
    """A local-loss F op's ``(h or loss, g)`` as ``(a, b, g)``: no tangents passed on."""
    return out[0], None, out[1]
