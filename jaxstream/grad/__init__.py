"""Gradient estimators with one signature: ``estimator(loss_fn, params, batch, key) -> (loss, grads)``.

``backprop()`` is the reference; ``forward(...)`` the forward-gradient estimators (weight or
activity perturbation); ``hybrid(...)`` mixes forward estimates of every micro-batch with exact
gradients of a subset; ``spsa(...)`` the zeroth-order two-point estimate (no jvp).
``tangents`` holds the key schedule every engine shares, ``corrections`` the per-segment
correction code a pipeline stage reuses.
"""

from jaxstream.grad import corrections, passes, tangents
from jaxstream.grad.baselines import (
    BackpropRemat,
    ExactSubset,
    LocalForwardWeights,
    backprop_remat,
    exact_subset,
    local_forward_weights,
)
from jaxstream.grad.directional import directional, generic_directional, stack_directional
from jaxstream.grad.estimators import Backprop, Forward, aggregate, backprop, forward
from jaxstream.grad.hybrid import Hybrid, hybrid, micro_batches_of
from jaxstream.grad.hybrid_activity import HybridActivity, hybrid_activity
from jaxstream.grad.local_guess import LocalGuess, local_guess, local_targets
from jaxstream.grad.tangents import TangentSpec
from jaxstream.grad.zeroth_order import SPSA, spsa

__all__ = [
    "SPSA",
    "Backprop",
    "BackpropRemat",
    "ExactSubset",
    "Forward",
    "Hybrid",
    "HybridActivity",
    "LocalForwardWeights",
    "LocalGuess",
    "TangentSpec",
    "aggregate",
    "backprop",
    "backprop_remat",
    "corrections",
    "directional",
    "exact_subset",
    "forward",
    "generic_directional",
    "hybrid",
    "hybrid_activity",
    "local_forward_weights",
    "local_guess",
    "local_targets",
    "micro_batches_of",
    "passes",
    "spsa",
    "stack_directional",
    "tangents",
]
