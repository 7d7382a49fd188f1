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
from typing import Annotated, Literal

from jaxstream.experiment.config import register_choice
from jaxstream.grad.estimators import Aggregation, Perturb
from jaxstream.grad.tangents import Distribution
from jaxstream.ranges import Checked, Count, Positive, Range

Estimator = Callable  # estimator(loss_fn, params, batch, key) -> (loss, grads)


class EstimatorConfig(Checked):
    """Base of the polymorphic ``estimator:`` section (variants are registered below).

    ``micro_batches`` (N) and ``num_tangents`` (K per micro-batch) are 1 unless a variant
    declares them as fields: every section answers both, a plugin's included."""

    micro_batches: int = 1
    num_tangents: int = 1

    def build(self) -> Estimator:  # pragma: no cover - interface
        raise NotImplementedError

    def batch_divisor(self) -> tuple[str, int]:
        """``(field, n)``: the field whose count must divide the batch size (micro-batches)."""
        return "micro_batches", self.micro_batches

    def describe(self) -> str:
        """A short label for tables (default: the estimator plan's)."""
        return self.build().plan.describe()


def register_estimator(name: str) -> Callable[[type], type]:
    """Decorator: a frozen dataclass subclassing :class:`EstimatorConfig`, whose ``build()``
    returns the estimator, becomes ``estimator: {type: name, ...}``; another class, or one
    without ``build``, is refused by name (the runner asks every section for its counts,
    batch divisor and label)."""

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, EstimatorConfig)):
            raise TypeError(f"register_estimator({name!r}): the config class must subclass "
                            f"jaxstream.experiment.EstimatorConfig (class "
                            f"{getattr(cls, '__name__', cls)}(EstimatorConfig)), got {cls!r}")
        if cls.build is EstimatorConfig.build:
            raise TypeError(f"register_estimator({name!r}): {cls.__name__} has no build method "
                            "(def build(self) -> estimator)")
        return register_choice(EstimatorConfig, name, cls)

    return deco


@register_estimator("backprop")
@dataclasses.dataclass(frozen=True)
class BackpropConfig(EstimatorConfig):
    """Exact reverse-mode gradient (the reference); ``remat: true`` rematerialises each block,
    ``accumulate: A`` (with remat) runs the batch as A chunks one after another."""

    remat: bool = False
    accumulate: Count = 1

    def check(self) -> None:
        if self.accumulate > 1 and not self.remat:
            raise ValueError(f"accumulate: {self.accumulate} chunks need remat: true "
                             "(gradient accumulation is a schedule of rematerialised backprop)")

    def batch_divisor(self) -> tuple[str, int]:
        return ("accumulate", self.accumulate) if self.accumulate > 1 else super().batch_divisor()

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.backprop_remat(self.accumulate) if self.remat else jg.backprop()

    def describe(self) -> str:
        acc = f", accumulate {self.accumulate}" if self.accumulate > 1 else ""
        return f"backprop(remat{acc})" if self.remat else "backprop"


@register_estimator("forward")
@dataclasses.dataclass(frozen=True)
class ForwardConfig(EstimatorConfig):
    """Forward gradient: K jvp tangents on the weights or on each block's activations."""

    num_tangents: Count = 1
    distribution: Distribution = "rademacher"
    perturb: Perturb = "weights"
    orthogonal: bool = False
    antithetic: bool = False
    aggregation: Aggregation = "mean"
    local_losses: bool = False
    rank: Count | None = None  # low-rank weight tangents A Bᵀ / √r (None: full ones)

    def check(self) -> None:
        if self.antithetic:
            from jaxstream.grad.tangents import ANTITHETIC

            raise ValueError(ANTITHETIC)
        if self.rank is not None:
            self.build()  # the estimator's own one-line refusal (perturb, orthogonal)

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return jg.forward(**kwargs)

    def describe(self) -> str:
        rank = "" if self.rank is None else f", rank {self.rank}"
        return f"forward({self.perturb}, K={self.num_tangents}{rank})"


@register_estimator("spsa")
@dataclasses.dataclass(frozen=True)
class SPSAConfig(EstimatorConfig):
    """Zeroth-order two-point estimate (SPSA / MeZO): 2K loss evaluations at θ ± εv_k, no jvp;
    bias O(ε²)."""

    num_directions: Count = 1
    eps: Positive = 1e-3
    distribution: Distribution = "rademacher"
    rank: Count | None = None  # low-rank directions A Bᵀ / √r on matrices (None: full ones)

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.spsa(self.num_directions, self.eps, self.distribution, self.rank)

    def describe(self) -> str:
        rank = "" if self.rank is None else f", rank {self.rank}"
        return f"spsa(K={self.num_directions}, eps={self.eps:g}{rank})"


@register_estimator("hybrid")
@dataclasses.dataclass(frozen=True)
class HybridConfig(EstimatorConfig):
    """Forward estimates on every micro-batch, corrected by exact gradients of a subset.

    Attributes:
      micro_batches: N, the number of micro-batches a batch is cut into (batch size % N == 0).
      num_exact: how many micro-batches get an exact gradient (ignored if exact_indices or
        exact_from is set).
      exact_indices: explicit micro-batch indices with exact gradients.
      exact_from: per micro-batch, the first block whose gradient is exact (0: all of it,
        L + 1: none; nested per-layer groups, as a truncated pipeline table makes them).
    """

    micro_batches: Count = 8
    num_exact: Count = 2
    exact_indices: tuple[Annotated[int, Range(0)], ...] | None = None
    exact_from: tuple[Annotated[int, Range(0)], ...] | None = None
    correction: str = "control_variate"  # a rule of jaxstream.grad.combine (checked below)
    num_tangents: Count = 1
    distribution: Distribution = "rademacher"
    orthogonal: bool = False
    antithetic: bool = False

    def check(self) -> None:
        if self.antithetic:
            from jaxstream.grad.tangents import ANTITHETIC

            raise ValueError(ANTITHETIC)
        check_correction(self.correction)
        if self.exact_indices is not None and self.exact_from is not None:
            raise ValueError("exact_from: give exact_indices or exact_from, not both")
        if self.exact_from is not None:
            if len(self.exact_from) != self.micro_batches:
                raise ValueError(f"exact_from: one first exact block per micro-batch, "
                                 f"{self.micro_batches} entries; got {len(self.exact_from)}")
        elif self.exact_indices is None:
            _check_subset(self.micro_batches, self.num_exact)
        elif any(i >= self.micro_batches for i in self.exact_indices):
            raise ValueError(f"exact_indices: each index must be in [0, {self.micro_batches}), "
                             f"got {self.exact_indices}")

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        exact = ({"exact_indices": tuple(self.exact_indices)} if self.exact_indices is not None
                 else {"exact_from": tuple(self.exact_from)} if self.exact_from is not None
                 else {"num_exact": self.num_exact})
        return jg.hybrid(**exact, correction=self.correction, num_tangents=self.num_tangents,
                         distribution=self.distribution, orthogonal=self.orthogonal,
                         antithetic=self.antithetic)

    def describe(self) -> str:
        if self.exact_from is not None:
            return f"hybrid({self.correction}, exact from {list(self.exact_from)})"
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


def _check_subset(micro_batches: int, num_exact: int, spare: int = 0) -> None:
    if num_exact > micro_batches - spare:
        most = f"micro_batches - {spare}" if spare else "micro_batches"
        raise ValueError(f"num_exact: must be at most {most} = {micro_batches - spare}, "
                         f"got {num_exact}")


@register_estimator("exact_subset")
@dataclasses.dataclass(frozen=True)
class ExactSubsetConfig(EstimatorConfig):
    """Exact gradients of ``num_exact`` random micro-batches only: a hybrid without its forward
    part (same selection for the same key)."""

    micro_batches: Count = 8
    num_exact: Count = 2

    def check(self) -> None:
        _check_subset(self.micro_batches, self.num_exact)

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.exact_subset(self.num_exact)

    def describe(self) -> str:
        return f"exact_subset({self.num_exact}/{self.micro_batches})"


@register_estimator("local_forward_weights")
@dataclasses.dataclass(frozen=True)
class LocalForwardWeightsConfig(EstimatorConfig):
    """LG-FG-W: weight-perturbed forward gradients of per-block local losses."""

    num_tangents: Count = 1
    distribution: Distribution = "rademacher"

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.local_forward_weights(self.num_tangents, self.distribution)

    def describe(self) -> str:
        return f"forward(local weights, K={self.num_tangents})"


@register_estimator("local_guess")
@dataclasses.dataclass(frozen=True)
class LocalGuessConfig(EstimatorConfig):
    """Local guess (Fournier et al., 2023): the gradient projected on the local losses' exact
    gradients, with one jvp (no options)."""

    def build(self) -> Estimator:
        import jaxstream.grad as jg

        return jg.local_guess()


@register_estimator("hybrid_activity")
@dataclasses.dataclass(frozen=True)
class HybridActivityConfig(EstimatorConfig):
    """Exact subset + activity-perturbed forward estimates, mixed per layer by inverse variance."""

    micro_batches: Annotated[int, Range(3)] = 8  # num_exact exact ones and a spare
    num_exact: Annotated[int, Range(2)] = 2  # two give a variance
    num_tangents: Count = 1
    shrinkage: Literal["per_layer", "global", "none"] = "per_layer"

    def check(self) -> None:
        _check_subset(self.micro_batches, self.num_exact, spare=1)

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
