"""What the forward table measures of one arm's estimator beside its training: agreement with
the exact gradient over keys (cosine, relative squared error, its split into bias² and variance,
per segment), the parameters of a mid-training point, and a compiled step's cost (matmul FLOPs
in forward passes, temporary memory).

Bias and variance at fixed parameters and batch, over n keys with estimates ĝ_k, exact gradient
g and mean ḡ: variance = Σ‖ĝ_k − ḡ‖² / (n − 1), bias² = ‖ḡ − g‖² − variance / n (unbiased; it can
be negative where the bias is below the noise), both over ‖g‖²; their sum is the keys' mean
relative squared error, mean ‖ĝ_k − g‖² / ‖g‖², exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstream.data.batches import batch_indices
from jaxstream.experiment.compiled import segment_cosines
from jaxstream.optim.promotion import standard_promotion


def _per_segment(c: dict) -> np.ndarray:
    """[embed, block 0, …, block L − 1, head] from :func:`segment_cosines`' values."""
    return np.concatenate([[float(c["c_embed"])], np.ravel(np.asarray(c["c_blocks"])),
                           [float(c["c_head"])]])


def _flat(tree: Any) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


@jax.jit
def _agreement(tree: Any, exact_tree: Any, target: Any) -> tuple:
    """An estimate against the exact gradient in one compiled program (not op by op): cosine,
    relative squared error, per-segment cosines, per-segment cosines to ``target`` (an
    estimator's local targets; None: none), and the flat estimate."""
    g, exact = _flat(tree), _flat(exact_tree)
    cos = g @ exact / (jnp.linalg.norm(g) * jnp.linalg.norm(exact) + 1e-30)
    rel = jnp.sum((g - exact) ** 2) / jnp.sum(exact**2)
    local = None if target is None else segment_cosines("c", tree, target)
    return cos, rel, segment_cosines("c", tree, exact_tree), local, g


def bias_variance(estimates: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """``(bias², variance)`` of estimates (n, P) of ``exact`` (P,), relative to ‖exact‖², in
    float64 (the module docstring's formulas)."""
    est, g = np.asarray(estimates, np.float64), np.asarray(exact, np.float64)
    k, norm = len(est), float(g @ g)
    mean = est.mean(axis=0)
    variance = float(((est - mean) ** 2).sum()) / (k - 1) if k > 1 else float("nan")
    bias_sq = float(((mean - g) ** 2).sum()) - (variance / k if k > 1 else 0.0)
    return bias_sq / norm, variance / norm


def agreement(estimate: Callable, state: Any, batch: dict, exact_tree: Any, target: Any,
              keys: jax.Array) -> dict:
    """An estimator's gradient (``estimate(state, batch, key)[1]``) against the exact one over
    ``keys``: cosine (mean, sd), relative squared error, bias² and variance (relative), per
    segment cosines (``cosine_layers``: embed, each block, head; means over keys) and, where
    ``target`` holds local targets, per segment cosines to them."""
    cos, rel, layers, local_layers, flats = [], [], [], [], []
    for k in keys:
        c, r, seg, local_seg, flat = jax.device_get(
            _agreement(estimate(state, batch, k)[1], exact_tree, target))
        cos.append(float(c))
        rel.append(float(r))
        layers.append(_per_segment(seg))
        flats.append(flat)
        if target is not None:
            local_layers.append(_per_segment(local_seg))
    bias_sq, variance = bias_variance(np.stack(flats), jax.device_get(_flat(exact_tree)))
    mean = lambda xs: np.mean(xs, axis=0).round(4).tolist()
    return {"cosine_mean": float(np.mean(cos)),
            "cosine_sd": float(np.std(cos, ddof=1)) if len(cos) > 1 else 0.0,
            "relative_mse": float(np.mean(rel)), "bias_sq_rel": bias_sq,
            "variance_rel": variance, "cosine_layers": mean(layers),
            "local_cosine_layers": mean(local_layers) if target is not None else None}


def backprop_params(stack: Any, params: Any, train: dict, batch_size: int, seed: int,
                    steps: int, lr: float) -> Any:
    """``params`` after ``steps`` steps of backprop with Adam at rate ``lr`` on the batches of
    ``kind: train`` with seed ``seed`` (one compiled scan): a mid-training point at which every
    arm's estimator is measured against the exact gradient, the same for every arm of a
    model."""
    n = len(next(iter(train.values())))
    idx = jnp.asarray(np.stack([batch_indices(n, batch_size, seed, t) for t in range(steps)]))
    data = {k: jnp.asarray(v) for k, v in train.items()}
    opt = standard_promotion(optax.adam(lr))

    @jax.jit
    def run(p):
        def body(carry, i):
            q, s = carry
            g = jax.grad(stack)(q, {k: v[i] for k, v in data.items()})
            u, s = opt.update(g, s, q)
            return (optax.apply_updates(q, u), s), None

        return jax.lax.scan(body, (p, opt.init(p)), idx)[0][0]

    return run(params)


def forward_equivalents(step: Any, stack: Any, params: Any, batch: dict):
    """``(matmul FLOPs of one compiled training step, the same over one primal forward pass of
    the batch)``: a step's cost in forward passes, counted from what XLA runs
    (:func:`jaxstream.quality.flops.matmul_flops`); ``(None, None)`` where the counter refuses
    the program (a convolution)."""
    from jaxstream.quality.flops import matmul_flops

    try:
        forward = matmul_flops(jax.jit(stack).lower(params, batch).compile())
        total = matmul_flops(step)
    except ValueError:
        return None, None
    return total, (total / forward if forward else None)
