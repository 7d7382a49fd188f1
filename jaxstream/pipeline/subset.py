"""``exact_subset(k)`` on the pipeline: exact gradients of k of the N micro-batches, no forward
part. The selection is drawn from the step key outside the stages (``select_exact``, as the
in-memory estimator draws it), so the pipeline equals the in-memory estimator for the same key
(no stated variant); the stages then run GPipe backprop over the k selected micro-batches.

Example:
    >>> pipe = pipeline(stack, gpipe_backprop(4, 2), jaxstream.grad.exact_subset(2))
    >>> loss, grads, aux = pipe(params, micro, key)   # micro: (N, B, ...), any N >= 2
    >>> aux["exact_indices"]                          # the 2 micro-batches it used
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxstream.grad.checks import check_micro_batches


@dataclasses.dataclass(frozen=True, eq=False)
class SubsetPipeline:
    """A backprop pipeline over the ``num_exact`` micro-batches a key selects (see module doc).

    Attributes:
      inner: the GPipe backprop pipeline over ``num_exact`` micro-batches.
      num_exact: k.
      select: the estimator's selection ``(n, key, num_layers) -> (indices, depth)``.
    """

    inner: Any
    num_exact: int
    select: Callable

    @property
    def stale(self) -> bool:
        return False

    @property
    def along(self) -> bool:
        return False

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.inner.mesh

    def __call__(self, params: dict, batch: dict, key: jax.Array, carry: Any = None, *,
                 guess: Any = None):
        """``(loss, grads, aux)``: the mean loss and gradient of the selected micro-batches;
        ``aux["exact_indices"]`` says which."""
        if carry is not None or guess is not None:
            raise ValueError("exact_subset on the pipeline takes no carry and no guess")
        n = check_micro_batches(batch, "exact_subset")
        idx = self.select(n, key, None)[0]
        loss, grads, aux = self.inner(params, jax.tree.map(lambda a: a[idx], batch), key)
        return loss, grads, {**aux, "exact_indices": idx}
