"""What an estimator asks of an engine, declared: the forward pass, the exact gradients, the
combine rule.

Engines read a :class:`Plan` and nothing else of an estimator (no engine asks an estimator its
type), so an engine that runs the pieces runs every estimator built from them, and refuses by
name what it cannot carry.

Example:
  >>> hybrid(num_exact=2, correction="weighted").plan
  Plan(forward='weights', exact='selected', combine='weighted', ...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax

from jaxstream.grad import passes
from jaxstream.grad.combine import Rule, get
from jaxstream.grad.passes import ForwardPass
from jaxstream.grad.tangents import TangentSpec

ExactPass = Literal["none", "all", "selected"]
EXACT_PASSES = ("none", "all", "selected")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The declared needs of an estimator.

    Attributes:
      forward: the forward pass: ``"none"``; ``"weights"`` (tangents on the parameters, K
        derivatives per micro-batch); ``"activity"`` (tangents on each block's outputs, weight
        estimates formed locally after); ``"local"`` (activity tangents, each block's own
        loss); ``"local_weights"`` (weight tangents, each block's own loss); ``"local_guess"``
        (one jvp along the local losses' exact gradients, :mod:`.local_guess`);
        ``"zeroth_order"`` (no jvp: two loss evaluations at θ ± εv per direction, the estimate
        formed by the pass itself, :mod:`.zeroth_order`).
      exact: reverse-mode gradients for ``"none"``, ``"all"`` micro-batches or the
        ``"selected"`` ones (:attr:`select`).
      combine: the rule of :mod:`jaxstream.grad.combine` that forms the estimate from the two
        (None: the forward pass forms it, or the exact gradients' mean is it).
      spec: the tangents.
      micro_batches: the batch carries a leading micro-batch axis N (hybrids, exact subsets).
      select: ``(n, key, num_layers) -> (indices, depth)``, the selected micro-batches and the
        first block each one's exact gradient reaches (``exact="selected"``).
      num_exact: how many micro-batches are selected (None: a per-layer ``exact_from``).
      fixed: the selected micro-batches when the estimator fixes them (``exact_indices``).
      nested: the selection gives per-layer nested groups (``exact_from``).
    """

    forward: str
    exact: ExactPass
    combine: str | None = None
    spec: TangentSpec = TangentSpec()
    micro_batches: bool = False
    # the selection follows from the estimator's fields below (num_exact, fixed, nested), so
    # two equal estimators' plans compare equal although their bound methods are distinct
    select: Callable[[int, jax.Array, int | None], tuple[Any, Any]] | None = dataclasses.field(
        default=None, compare=False)
    num_exact: int | None = None
    fixed: tuple[int, ...] | None = None
    nested: bool = False

    def __post_init__(self):
        passes.get(self.forward)  # a registered forward pass (ValueError naming them)
        if self.exact not in EXACT_PASSES:
            raise ValueError(f"plan.exact: {self.exact!r}; allowed: {EXACT_PASSES}")
        if self.combine is not None:
            get(self.combine)

    @property
    def forward_pass(self) -> ForwardPass:
        """The forward pass's declarations (:mod:`jaxstream.grad.passes`), which engines read."""
        return passes.get(self.forward)

    @property
    def exact_subset(self) -> bool:
        """Exact gradients of the selected micro-batches only (no forward pass)."""
        return not self.forward_pass.runs and self.exact == "selected"

    @property
    def rule(self) -> Rule | None:
        """The combine rule (None where the forward pass or the exact mean is the estimate)."""
        return None if self.combine is None else get(self.combine)

    @property
    def mixes(self) -> bool:
        """A hybrid: forward estimates of every micro-batch mixed with selected exact ones."""
        return self.forward_pass.runs and self.exact == "selected"

    @property
    def local_target(self) -> bool:
        """The estimate follows each segment's local loss (LG-FG-A, LG-FG-W, the local guess):
        unbiased for :func:`~jaxstream.grad.local_targets`, not for the global gradient."""
        return self.forward_pass.local_losses

    @property
    def local(self) -> bool:
        """Each block's estimate is formed by the forward pass itself (activity, local losses)."""
        return self.forward_pass.forms_block_estimates

    @property
    def family(self) -> str:
        """``backprop``, ``forward``, ``hybrid`` or ``exact_subset``: the group an arm is
        compared within."""
        if self.mixes:
            return "hybrid"
        if self.forward_pass.runs:
            return "forward"
        return "backprop" if self.exact == "all" else "exact_subset"

    def describe(self) -> str:
        """A short label for tables, e.g. ``hybrid(weighted, 2 exact, K=1)``."""
        k = f"K={self.spec.num}" + ("" if self.spec.rank is None else f", rank {self.spec.rank}")
        fp = self.forward_pass
        if fp.tangents is None and fp.runs:  # evaluations only
            return f"{fp.label}({k})"
        if self.family == "backprop":
            return "backprop"
        if self.family == "exact_subset":
            return f"exact_subset({self.num_exact})"
        if not self.mixes:
            what = fp.label
            agg = "" if self.combine in (None, "mean") else f", {self.combine}"
            return f"forward({what}{agg}, {k})"
        sel = (f"{len(self.fixed)} fixed" if self.fixed is not None
               else "nested" if self.nested else "the table's" if self.num_exact is None
               else str(self.num_exact))
        how = self.combine or f"{self.forward} mixed per layer"
        return f"hybrid({how}, {sel} exact, {k})"
