"""The small problem the local-guess engine tests share: an MLP (with a head per block when
``own``) and a micro-batched batch with its flat copy."""

from __future__ import annotations

import jax
import numpy as np

from jaxstream.models import mlp, with_local_heads


def local_problem(own: bool, depth: int, micro_batches: int):
    """``(stack, params, micro (N, 4, ...), flat (N * 4, ...))``."""
    stack = mlp(in_dim=6, width=8, depth=depth, num_classes=3)
    stack = with_local_heads(stack) if own else stack
    rng = np.random.default_rng(0)
    n = micro_batches
    micro = {"x": rng.standard_normal((n, 4, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (n, 4), dtype=np.int32)}
    flat = {k: v.reshape(n * 4, *v.shape[2:]) for k, v in micro.items()}
    return stack, stack.init(jax.random.key(0)), micro, flat
