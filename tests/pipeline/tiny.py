"""The tiny pipeline problem shared by the executor tests: an MLP with one Stack object per
depth (jitted references take it as a static argument) and NumPy data (no eager compiles)."""

import functools

import jax
import numpy as np

from jaxstream.models import mlp


@functools.cache
def tiny_stack(depth: int):
    return mlp(in_dim=6, width=5, depth=depth, num_classes=3)


def tiny_setup(m: int, n: int, layers_per_stage: int = 1, seed: int = 0):
    """(stack, params, batch) for m stages, n micro-batches of 2 examples."""
    stack = tiny_stack(m * layers_per_stage)
    params = stack.init(jax.random.key(seed))
    rng = np.random.default_rng(seed)
    batch = {"x": rng.standard_normal((n, 2, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (n, 2), dtype=np.int32)}
    return stack, params, batch
