"""Gradient estimators with one signature: ``estimator(loss_fn, params, batch, key) -> (loss, grads)``.

``backprop()`` is the reference; ``forward(...)`` the forward-gradient estimators (weight or
activity perturbation); ``hybrid(...)`` mixes forward estimates of every micro-batch with exact
gradients of a subset. ``tangents`` holds the key schedule every engine shares, ``corrections``
the per-segment correction code a pipeline stage reuses.
"""

from jaxstream.grad import corrections, tangents
from jaxstream.grad.directional import directional, generic_directional, stack_directional
from jaxstream.grad.estimators import Backprop, Forward, aggregate, backprop, forward
from jaxstream.grad.hybrid import Hybrid, hybrid, num_micro_batches
from jaxstream.grad.tangents import TangentSpec

__all__ = [
    "Backprop",
    "Forward",
    "Hybrid",
    "TangentSpec",
    "aggregate",
    "backprop",
    "corrections",
    "directional",
    "forward",
    "generic_directional",
    "hybrid",
    "num_micro_batches",
    "stack_directional",
    "tangents",
]
