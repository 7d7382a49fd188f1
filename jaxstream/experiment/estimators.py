"""Estimator sections of a config: ``estimator: {type: forward, num_tangents: 4, ...}``.

Each variant mirrors the keyword arguments of its :mod:`jaxstream.grad` factory and builds the
estimator with :meth:`build`. ``micro_batches`` says how many micro-batches the engine must cut
a batch into (the hybrid estimator expects a leading micro-batch axis).

Example:
    >>> cfg = from_dict(EstimatorConfig, {"type": "forward", "num_tangents": 4})
    >>> est = cfg.build()          # est(loss_fn, params, batch, key) -> (loss, grads)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from jaxstream.experiment.config import register_choice

Estimator = Callable  # estimator(loss_fn, params, batch, key) -> (loss, grads)


class EstimatorConfig:
    """Base of the polymorphic ``estimator:`` section (variants are registered below)."""

    micro_batches: int = 1

    def build(self) -> Estimator:  # pragma: no cover - interface
        raise NotImplementedError


@register_choice(EstimatorConfig, "backprop")
@dataclasses.dataclass(frozen=True)
class BackpropConfig(EstimatorConfig):
    """Exact reverse-mode gradient (the reference)."""

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.backprop()


@register_choice(EstimatorConfig, "forward")
@dataclasses.dataclass(frozen=True)
class ForwardConfig(EstimatorConfig):
    """Forward gradient: K jvp tangents on the weights or on each block's activations."""

    num_tangents: int = 1
    distribution: Literal["rademacher", "gaussian"] = "rademacher"
    perturb: Literal["weights", "activations"] = "weights"
    orthogonal: bool = False
    antithetic: bool = False
    aggregation: Literal["mean", "projection"] = "mean"
    local_losses: bool = False

    def __post_init__(self):
        if self.num_tangents < 1:
            raise ValueError(f"num_tangents: must be >= 1, got {self.num_tangents}")

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return jg.forward(**kwargs)


@register_choice(EstimatorConfig, "hybrid")
@dataclasses.dataclass(frozen=True)
class HybridConfig(EstimatorConfig):
    """Forward estimates on every micro-batch, corrected by exact gradients of a subset.

    Attributes:
      micro_batches: N, the number of micro-batches a batch is cut into (batch size % N == 0).
      num_exact: how many micro-batches get an exact gradient (ignored if exact_indices is set).
      exact_indices: explicit micro-batch indices with exact gradients.
    """

    micro_batches: int = 8
    num_exact: int = 2
    exact_indices: tuple[int, ...] | None = None
    correction: Literal["control_variate", "replace", "guess", "weighted"] = "control_variate"
    num_tangents: int = 1
    distribution: Literal["rademacher", "gaussian"] = "rademacher"
    orthogonal: bool = False
    antithetic: bool = False

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches: must be >= 1, got {self.micro_batches}")
        if self.num_tangents < 1:
            raise ValueError(f"num_tangents: must be >= 1, got {self.num_tangents}")
        if self.exact_indices is None:
            if not 0 <= self.num_exact <= self.micro_batches:
                raise ValueError(f"num_exact: must be in [0, micro_batches={self.micro_batches}]"
                                 f", got {self.num_exact}")
        elif any(not 0 <= i < self.micro_batches for i in self.exact_indices):
            raise ValueError(f"exact_indices: each index must be in [0, {self.micro_batches}), "
                             f"got {self.exact_indices}")

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        exact = ({"exact_indices": tuple(self.exact_indices)} if self.exact_indices is not None
                 else {"num_exact": self.num_exact})
        return jg.hybrid(**exact, correction=self.correction, num_tangents=self.num_tangents,
                         distribution=self.distribution, orthogonal=self.orthogonal,
                         antithetic=self.antithetic)


def describe(cfg: EstimatorConfig) -> str:
    """A short label such as ``forward(weights, K=1)`` for tables."""
    if isinstance(cfg, ForwardConfig):
        return f"forward({cfg.perturb}, K={cfg.num_tangents})"
    if isinstance(cfg, HybridConfig):
        n_exact = len(cfg.exact_indices) if cfg.exact_indices is not None else cfg.num_exact
        return f"hybrid({cfg.correction}, {n_exact}/{cfg.micro_batches})"
    return "backprop"


def family(cfg: EstimatorConfig) -> str:
    """``backprop``, ``forward`` or ``hybrid``: the group an arm is compared within."""
    if isinstance(cfg, ForwardConfig):
        return "forward"
    if isinstance(cfg, HybridConfig):
        return "hybrid"
    return "backprop"
