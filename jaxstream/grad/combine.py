"""One combine: the only code that knows how an estimate is formed from per-segment statistics.

Every engine hands :func:`combine` what one *slice* of the model knows — the whole params (in
memory), a pipeline stage's params, one streamed unit — as :class:`Stats`, and a ``reduce`` that
sums a rule's partial sums over the slices: the identity in memory, a ``psum`` over stages, a
host sum over streamed units. A rule is two pure functions, as an optax transformation is:

* ``partials(stats) -> dict`` — the slice's share of the cross-segment quantities (the
  control variate's scalars c_nk = Σ_s h_s·v_nk,s; projection's Gram matrices);
* ``estimate(stats, totals) -> grads`` — the slice's estimate once ``totals`` (the reduced
  partials) are known.

An engine that streams its slices calls the two phases in different sweeps (partials in the
reverse sweep, estimates in an update sweep once every unit's share is summed); one that holds
its slice calls :func:`combine`. Engines read a rule's flags (``cross``, ``along``,
``stale_ok``), never its name, so a new rule is one :func:`register` call here plus its test.

Example:
  >>> stats = Stats(spec, keys, d, params, h=h, counts=counts, rows=rows, outside=outside)
  >>> grads = combine("control_variate", stats)                      # in memory
  >>> grads = combine("control_variate", stats, lambda t: psum(t, "stage"))  # a stage
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxstream.grad import corrections as cr
from jaxstream.grad.tangents import TangentSpec, gram_parts, project
from jaxstream.grad.tangents import combine as tangent_sum


class Stats(NamedTuple):
    """What one slice of the model knows when its estimate is formed.

    Attributes:
      spec: the tangents.
      keys: (N,) micro-batch keys (a streamed unit passes its segment keys).
      d: (N, K) directional derivatives of every micro-batch (the whole model's; ``along``
        rules: (N, 1) derivatives along the direction).
      like: the slice's params (shapes and dtypes of the estimate).
      first_layer: global index of the slice's first block.
      h: the exact-gradient mean of each segment's group (shaped like ``like``).
      counts: per segment, the size of its group.
      rows: per segment, 1 for the micro-batches whose residual is still estimated by tangents.
      outside: (N,) 1 for the micro-batches outside the head's group (whose residual scalars
        measure the tangent noise).
      total_size: the whole model's parameter count (default: the slice's).
      owned: per segment, 1 where this slice owns a replicated segment (a pipeline's embed on
        its first stage, head on its last), 0 elsewhere; None: owns every segment.
      direction: unit direction of an ``along`` rule, shaped like ``like``.
      has_direction: 0.0 where no direction exists yet (a pipeline's first step): the
        ``along`` rule falls back to h.
    """

    spec: TangentSpec
    keys: jax.Array
    d: jax.Array
    like: Any
    first_layer: Any = 0
    h: Any = None
    counts: dict | None = None
    rows: dict | None = None
    outside: jax.Array | None = None
    total_size: Any = None
    owned: dict | None = None
    direction: Any = None
    has_direction: Any = 1.0


@dataclasses.dataclass(frozen=True)
class Rule:
    """A combine rule (see the module docstring).

    Attributes:
      name: what configs and estimators call it.
      estimate: ``(stats, totals) -> grads``.
      partials: ``stats -> dict`` of arrays summed over slices (default: none).
      exact: whether the rule needs exact gradients (h, counts, rows).
      cross: whether ``estimate`` needs ``totals`` (a streamed engine then forms the estimates
        in a sweep after the exact gradients of every unit are known).
      along: the forward pass runs along ``stats.direction`` (one derivative per micro-batch)
        instead of along tangents.
      stale_ok: unbiased with an exact mean from the previous step (a pipeline's delayed table).
      doc: one line for tables and errors.
      diagnostics: ``(stats, totals) -> dict`` of what the rule chose (e.g. ``weighted``'s β).
      coefficients: for a rule whose estimate is Σ_n Σ_k c_nk v_nk alone (no exact part),
        ``(stats, totals) -> c`` (N, K): an update fully described by its keys and these (a
        streamed lazy update, a data-parallel scalar exchange).
      residual: ``partials`` are the residual scalars ``{"c": c_nk = h·v_nk}`` alone, which a
        weight-perturbation forward pass can sum as it draws its tangents (given h before it)
        and hand to :func:`combine` as ``totals``, saving a pass that draws them again.
    """

    name: str
    estimate: Callable[[Stats, dict], Any]
    partials: Callable[[Stats], dict] = lambda stats: {}
    exact: bool = True
    cross: bool = False
    along: bool = False
    stale_ok: bool = False
    doc: str = ""
    diagnostics: Callable[[Stats, dict], dict] = lambda stats, totals: {}
    coefficients: Callable[[Stats, dict], jax.Array] | None = None
    residual: bool = False


RULES: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    """Adds ``rule`` to the registry every engine and config reads (a name is taken once)."""
    if rule.name in RULES and RULES[rule.name] is not rule:
        raise ValueError(f"combine rule {rule.name!r} is already registered")
    RULES[rule.name] = rule
    return rule


def get(name: str) -> Rule:
    """The rule called ``name``; a clear error naming the registered rules otherwise."""
    if name not in RULES:
        raise ValueError(f"correction: {name!r} is not a combine rule; allowed: {corrections()}")
    return RULES[name]


def corrections() -> tuple[str, ...]:
    """Names of the rules that mix forward estimates with exact gradients (a hybrid's
    ``correction``)."""
    return tuple(name for name, r in RULES.items() if r.exact)


def combine(rule: str | Rule, stats: Stats, reduce: Callable[[dict], dict] = lambda t: t,
            *, diagnostics: bool = False, totals: dict | None = None) -> Any:
    """The slice's estimate under ``rule``: ``estimate(stats, reduce(partials(stats)))``
    (with ``diagnostics``: ``(estimate, the rule's diagnostics)``; ``totals``: the reduced
    partials, already summed elsewhere — a ``residual`` rule's c from the forward pass)."""
    rule = get(rule) if isinstance(rule, str) else rule
    if totals is None:
        totals = reduce(rule.partials(stats)) if rule.cross else {}
    grads = rule.estimate(stats, totals)
    return (grads, rule.diagnostics(stats, totals)) if diagnostics else grads


def group_stats(exact: Any, masks: dict, like: Any) -> tuple[Any, dict]:
    """(h, counts) of the exact gradients (leading axis: the selected micro-batches) in each
    segment's group (:func:`jaxstream.grad.corrections.group_masks`)."""
    return cr.group_mean(exact, masks, like)


# ----------------------------------------------------------------------------- the rules
def _n_k(s: Stats) -> tuple[int, int]:
    return s.d.shape[0], s.spec.num


def _mean_coeffs(s: Stats, _totals: dict) -> jax.Array:
    n, k = _n_k(s)
    return s.d / (n * k)


def _gram_partials(s: Stats) -> dict:
    def one(key):
        parts = gram_parts(s.spec, key, s.like, s.first_layer)
        own = s.owned or {}
        return sum(v * own.get(name, 1.0) for name, v in parts.items())
    return {"gram": jax.vmap(one)(s.keys)}


def _projection_coeffs(s: Stats, totals: dict) -> jax.Array:
    n, _ = _n_k(s)
    return jax.vmap(jnp.linalg.solve)(totals["gram"], s.d) / n


def _tangent_rule(coeffs: Callable[[Stats, dict], jax.Array]) -> Callable[[Stats, dict], Any]:
    """An estimate Σ_n Σ_k coeffs[n, k] v_nk (the rule's ``coefficients`` phase)."""
    def estimate(s: Stats, totals: dict) -> Any:
        return tangent_sum(s.spec, s.keys, coeffs(s, totals), s.like, s.first_layer)
    return estimate


def _replace(s: Stats, _totals: dict) -> Any:
    n, k = _n_k(s)
    c_leaf = cr._per_leaf(s.counts, s.like)
    known = jax.tree.map(lambda h, c: cr._bcast(c, h.ndim).astype(h.dtype) * h / n, s.h, c_leaf)
    return tangent_sum(s.spec, s.keys, s.d / (n * k), s.like, s.first_layer, rows=s.rows,
                       init=known)


def _residual_partials(s: Stats) -> dict:
    return {"c": project(s.spec, s.keys, s.h, s.first_layer)}


def _control_variate(s: Stats, totals: dict, beta: dict | None = None,
                     stein: tuple | None = None) -> Any:
    return cr.control_variate(s.spec, s.keys, s.d, s.h, totals["c"], s.like, s.first_layer,
                              beta=beta, rows=s.rows, stein=stein)


def _q(s: Stats, totals: dict) -> jax.Array:
    return cr.residual_q(s.d, totals["c"], s.outside)


def _shrinkage(s: Stats, totals: dict) -> dict:
    n, k = _n_k(s)
    return {"beta": cr.shrinkage(s.counts, cr.segment_sizes(s.like), n, k,
                                 total_size=s.total_size)}


def _weighted(s: Stats, totals: dict) -> Any:
    return _control_variate(s, totals, beta=_shrinkage(s, totals)["beta"])


def _stein(s: Stats, totals: dict) -> Any:
    n, k = _n_k(s)
    b = cr.residual_variance(s.counts, cr.segment_sizes(s.like), _q(s, totals), n, k)
    return _control_variate(s, totals, stein=(b, s.counts))


def _guess(s: Stats, _totals: dict) -> Any:
    coef = jnp.mean(s.d[:, 0])
    return jax.tree.map(lambda u, h: jnp.where(s.has_direction > 0, coef * u, h).astype(h.dtype),
                        s.direction, s.h)


MEAN = register(Rule("mean", _tangent_rule(_mean_coeffs), exact=False,
                     coefficients=_mean_coeffs, doc="(1/(N K)) Σ d_nk v_nk: unbiased"))
PROJECTION = register(Rule("projection", _tangent_rule(_projection_coeffs), _gram_partials,
                           exact=False, cross=True, coefficients=_projection_coeffs,
                           doc="projection onto the tangents' span: biased, E ĝ ≈ (K/n) g"))
CONTROL_VARIATE = register(Rule("control_variate", _control_variate, _residual_partials,
                                cross=True, stale_ok=True, residual=True,
                                doc="h + tangent estimate of the residual: unbiased"))
REPLACE = register(Rule("replace", _replace,
                        doc="exact where known, forward elsewhere: unbiased"))
WEIGHTED = register(Rule("weighted", _weighted, _residual_partials, cross=True, stale_ok=True,
                         residual=True,
                         doc="control variate, residual shrunk by a fixed β: unbiased with a random "
                             "selection, biased with a fixed one",
                         diagnostics=_shrinkage))
STEIN = register(Rule("stein", _stein, _residual_partials, cross=True, stale_ok=True,
                      residual=True,
                      doc="control variate, residual shrunk by a James–Stein β: biased"))
GUESS = register(Rule("guess", _guess, along=True,
                      doc="(mean_n ∇L_n·u) u along u = h/‖h‖: biased, no tangent noise"))


def unit_direction(direction: Any, reduce: Callable[[Any], Any] = lambda t: t,
                   owned: dict | None = None) -> Any:
    """direction / ‖direction‖, the squared norm summed over slices by ``reduce`` (``owned``:
    count a replicated segment on its owner only)."""
    own = owned or {}
    if isinstance(direction, dict) and own:
        sq = sum(own.get(name, 1.0) * sum(jnp.vdot(a, a) for a in jax.tree.leaves(t))
                 for name, t in direction.items())
    else:
        sq = sum(jnp.vdot(a, a) for a in jax.tree.leaves(direction))
    scale = 1.0 / jnp.sqrt(jnp.maximum(reduce(sq), 1e-30))
    return jax.tree.map(lambda a: a * scale, direction)
