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
from jaxstream.grad.estimators import Aggregation, Perturb
from jaxstream.grad.tangents import Distribution

Estimator = Callable  # estimator(loss_fn, params, batch, key) -> (loss, grads)


class EstimatorConfig:
    """Base of the polymorphic ``estimator:`` section (variants are registered below)."""

    micro_batches: int = 1

    def build(self) -> Estimator:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:
        """A short label for tables (default: the estimator plan's)."""
        return self.build().plan.describe()


@register_choice(EstimatorConfig, "backprop")
@dataclasses.dataclass(frozen=True)
class BackpropConfig(EstimatorConfig):
    """Exact reverse-mode gradient (the reference); ``remat: true`` rematerialises each block."""

    remat: bool = False

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.backprop_remat() if self.remat else jg.backprop()

    def describe(self) -> str:
        return "backprop(remat)" if self.remat else "backprop"


@register_choice(EstimatorConfig, "forward")
@dataclasses.dataclass(frozen=True)
class ForwardConfig(EstimatorConfig):
    """Forward gradient: K jvp tangents on the weights or on each block's activations."""

    num_tangents: int = 1
    distribution: Distribution = "rademacher"
    perturb: Perturb = "weights"
    orthogonal: bool = False
    antithetic: bool = False
    aggregation: Aggregation = "mean"
    local_losses: bool = False

    def __post_init__(self):
        if self.num_tangents < 1:
            raise ValueError(f"num_tangents: must be >= 1, got {self.num_tangents}")
        if self.antithetic:
            from jaxstream.grad.tangents import ANTITHETIC

            raise ValueError(ANTITHETIC)

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return jg.forward(**kwargs)

    def describe(self) -> str:
        return f"forward({self.perturb}, K={self.num_tangents})"


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
    correction: str = "control_variate"  # a rule of jaxstream.grad.combine (checked below)
    num_tangents: int = 1
    distribution: Distribution = "rademacher"
    orthogonal: bool = False
    antithetic: bool = False

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches: must be >= 1, got {self.micro_batches}")
        if self.num_tangents < 1:
            raise ValueError(f"num_tangents: must be >= 1, got {self.num_tangents}")
        if self.antithetic:
            from jaxstream.grad.tangents import ANTITHETIC

            raise ValueError(ANTITHETIC)
        check_correction(self.correction)
        if self.exact_indices is None:
            if not 1 <= self.num_exact <= self.micro_batches:
                raise ValueError(f"num_exact: must be in [1, micro_batches={self.micro_batches}]"
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

    def describe(self) -> str:
        n_exact = len(self.exact_indices) if self.exact_indices is not None else self.num_exact
        return f"hybrid({self.correction}, {n_exact}/{self.micro_batches})"


def check_correction(correction: str) -> None:
    """Raises ValueError naming the field unless ``correction`` is a registered combine rule
    that mixes exact gradients in (the library's registry: a new rule is selectable at once)."""
    from jaxstream.grad import combine

    allowed = combine.corrections()
    if correction not in allowed:
        raise ValueError(f"correction: {correction!r} is not allowed; choose one of "
                         f"{', '.join(repr(c) for c in allowed)}")


def _check_subset(micro_batches: int, num_exact: int, least: int = 1) -> None:
    if micro_batches < 1:
        raise ValueError(f"micro_batches: must be >= 1, got {micro_batches}")
    if not least <= num_exact <= micro_batches:
        raise ValueError(f"num_exact: must be in [{least}, micro_batches={micro_batches}], "
                         f"got {num_exact}")


@register_choice(EstimatorConfig, "exact_subset")
@dataclasses.dataclass(frozen=True)
class ExactSubsetConfig(EstimatorConfig):
    """Exact gradients of ``num_exact`` random micro-batches only: a hybrid without its forward
    part (same selection for the same key)."""

    micro_batches: int = 8
    num_exact: int = 2

    def __post_init__(self):
        _check_subset(self.micro_batches, self.num_exact)

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.exact_subset(self.num_exact)

    def describe(self) -> str:
        return f"exact_subset({self.num_exact}/{self.micro_batches})"


@register_choice(EstimatorConfig, "local_forward_weights")
@dataclasses.dataclass(frozen=True)
class LocalForwardWeightsConfig(EstimatorConfig):
    """LG-FG-W: weight-perturbed forward gradients of per-block local losses."""

    num_tangents: int = 1
    distribution: Distribution = "rademacher"

    def __post_init__(self):
        if self.num_tangents < 1:
            raise ValueError(f"num_tangents: must be >= 1, got {self.num_tangents}")

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.local_forward_weights(self.num_tangents, self.distribution)

    def describe(self) -> str:
        return f"forward(local weights, K={self.num_tangents})"


@register_choice(EstimatorConfig, "local_guess")
@dataclasses.dataclass(frozen=True)
class LocalGuessConfig(EstimatorConfig):
    """Local guess (Fournier et al., 2023): the gradient projected on the local losses' exact
    gradients, with one jvp (no options)."""

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.local_guess()


@register_choice(EstimatorConfig, "hybrid_activity")
@dataclasses.dataclass(frozen=True)
class HybridActivityConfig(EstimatorConfig):
    """Exact subset + activity-perturbed forward estimates, mixed per layer by inverse variance."""

    micro_batches: int = 8
    num_exact: int = 2
    num_tangents: int = 1
    shrinkage: Literal["per_layer", "global", "none"] = "per_layer"

    def __post_init__(self):
        _check_subset(self.micro_batches - 1, self.num_exact, least=2)
        if self.num_tangents < 1:
            raise ValueError(f"num_tangents: must be >= 1, got {self.num_tangents}")

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.hybrid_activity(self.num_exact, self.num_tangents, self.shrinkage)

    def describe(self) -> str:
        return f"hybrid_activity({self.shrinkage}, {self.num_exact}/{self.micro_batches})"


def describe(cfg: EstimatorConfig) -> str:
    """A short label such as ``forward(weights, K=1)`` for tables (the variant's own)."""
    return cfg.describe()


def family(cfg: EstimatorConfig) -> str:
    """``backprop``, ``forward``, ``hybrid`` or ``exact_subset``: the group an arm is compared
    within, read off the estimator's plan."""
    return cfg.build().plan.family
