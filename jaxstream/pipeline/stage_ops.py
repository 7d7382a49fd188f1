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
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad import segments as sg
from jaxstream.grad.tangents import TangentSpec
from jaxstream.models.stack import Stack


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
        if position in ("last", "only"):
            cot = jnp.ones((), jnp.float32)
        zeros_p = jax.tree.map(jnp.zeros_like, p)
        if position in ("first", "only"):
            if not want_weights:
                return jnp.zeros_like(cot) if position == "first" else None, zeros_p
            _, pull = jax.vjp(lambda pp: self.primal(position, pp, inp, batch), p)
            return None, pull(cot)[0]
        if want_weights and want_input:
            _, pull = jax.vjp(lambda pp, hh: self.primal(position, pp, hh, batch), p, inp)
            gp, gi = pull(cot)
            return gi, gp
        if want_input:
            _, pull = jax.vjp(lambda hh: self.primal(position, p, hh, batch), inp)
            return pull(cot)[0], zeros_p
        _, pull = jax.vjp(lambda pp: self.primal(position, pp, inp, batch), p)
        return jnp.zeros_like(inp), pull(cot)[0]
