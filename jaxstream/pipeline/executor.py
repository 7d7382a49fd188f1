"""The shard_map executor: runs any valid schedule table over a ``stage`` mesh axis.

Each device holds its stage's slice of the stacked blocks (embed and head are replicated; only
the first / last stage uses them). A ``lax.scan`` runs the ticks; each device reads its row of the
lowered table and runs its op under ``lax.switch``; activations + tangents move up and cotangents
move down with ``ppermute`` *outside* the switch, every tick. B/W ops use explicit ``vjp`` inside
their branch (never differentiating through the switch). Only the selected micro-batches' stage
inputs stay in the buffers after their F (the stash). At the end the N x K directional
derivatives are broadcast once (psum) and each stage forms its estimate with the core's
correction code (``jaxstream.grad.corrections``) for its own group G_s; the control-variate
scalars c = sum_s h_s.v_s take one more psum.

The result equals ``jaxstream.grad.hybrid(exact_from=exact_from(schedule, L), ...)`` for the same
key (forward-only tables: the plain forward estimate over N micro-batches).

Example:
  >>> pipe = pipeline(stack, complete(4, 8, (0, 1)), correction="control_variate")
  >>> loss, grads, aux = pipe(params, micro_batches, key)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.grad import combine as cb
from jaxstream.grad.checks import (
    check_inputs,
    check_key,
    check_labels,
    check_local_losses,
    check_stack,
    check_stack_params,
)
from jaxstream.grad.estimators import Aggregation, Perturb, forward
from jaxstream.grad.hybrid import hybrid
from jaxstream.grad.plan import Plan
from jaxstream.grad.tangents import Distribution, TangentSpec
from jaxstream.models.stack import Stack
from jaxstream.pipeline.lowering import Lowered, lower
from jaxstream.pipeline.step import AXIS, PipelineCarry, run_step
from jaxstream.pipeline.table import Schedule


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    """A compiled pipeline gradient for one stack, schedule and correction (see module doc)."""

    stack: Stack
    schedule: Schedule
    plan: Plan
    mesh: jax.sharding.Mesh
    lowered: Lowered
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def spec(self) -> TangentSpec:
        return self.plan.spec

    @property
    def along(self) -> bool:
        """Whether the forward pass runs along a given direction (a ``guess`` rule)."""
        return self.plan.rule is not None and self.plan.rule.along

    @property
    def stale(self) -> bool:
        return self.lowered.stale

    def check_batch(self, batch: dict) -> None:
        """Raises ValueError unless every leaf has the leading micro-batch axis N."""
        n = self.schedule.micro_batches
        for name, leaf in batch.items():
            if jnp.ndim(leaf) < 2 or jnp.shape(leaf)[0] != n:
                raise ValueError(f"batch[{name!r}] has shape {jnp.shape(leaf)}; expected a leading "
                                 f"micro-batch axis of micro_batches={n}, then the examples")

    def init_carry(self, params: dict, batch: dict) -> PipelineCarry | None:
        """The carry before the first step (stale tables only; None otherwise)."""
        if not self.stale:
            return None
        check_stack_params(self.stack, params, "pipeline")
        self.check_batch(batch)
        m, p = self.schedule.num_stages, len(self.lowered.prev_selected)
        x0 = jax.tree.map(lambda a: a[0], batch)["x"]
        h = jax.eval_shape(self.stack.embed, params["embed"], x0)
        stash = jnp.zeros((m * (p + 1), *h.shape), h.dtype)
        micro = jax.tree.map(lambda a: jnp.zeros((p + 1, *a.shape[1:]), a.dtype), batch)
        return PipelineCarry(params, stash, micro, jnp.zeros((), jnp.float32))

    def __call__(self, params: dict, batch: dict, key: jax.Array,
                 carry: PipelineCarry | None = None, *, guess: Any = None):
        """(loss, grads, aux): aux has "directional" (N, K) and, for stale tables, "carry".

        ``guess`` (correction "guess" only): the direction to differentiate along, known before
        the forward pass — pass the previous step's ``aux["direction"]`` (its exact-subset mean
        h). The estimate is (mean_n ∇L_n·u) u with u = guess / ‖guess‖, as the in-memory
        ``hybrid(correction="guess")(..., guess=...)``. Without it (the first step) the estimate
        is this step's exact-subset mean h.
        """
        check_stack_params(self.stack, params, "pipeline")
        check_key(key, "pipeline")
        check_labels(self.stack, batch, "pipeline")
        self.check_batch(batch)
        check_inputs(self.stack, params, batch, "pipeline", micro=True)
        if self.stale and carry is None:
            raise ValueError(f"schedule {self.schedule.name!r} corrects the previous step: pass "
                             "carry=pipe.init_carry(params, batch) (then the returned aux['carry'])")
        if guess is not None and not self.along:
            raise ValueError(f"guess= is for a rule that differentiates along a direction "
                             f"(correction='guess'), not {self.plan.combine!r}")
        return run_step(self, params, batch, key, carry, guess)


def pipeline(stack: Stack, schedule: Schedule, estimator: Any = None, *, num_tangents: int = 1,
             distribution: Distribution = "rademacher", correction: str | None = None,
             orthogonal: bool = False, antithetic: bool = False, perturb: Perturb = "weights",
             local_losses: bool = False, aggregation: Aggregation = "mean",
             devices=None) -> Pipeline:
    """Builds the pipeline gradient of ``stack`` for ``schedule``; checks everything first.

    Args:
      stack: the model; its ``num_layers`` must divide evenly into the schedule's stages.
      schedule: any table that validates (see ``jaxstream.pipeline.validate``).
      num_tangents, distribution, orthogonal, antithetic: the tangents (as ``jaxstream.grad``).
      correction: "none" (plain forward estimate) or a combine rule of
        ``jaxstream.grad.combine`` ("control_variate", "replace", "weighted", "stein", "guess",
        or one registered there); default: "control_variate" on a table with reverse chains,
        "none" on a forward-only table. A table that cannot carry it is refused by name.
      estimator: a ``jaxstream.grad`` estimator instead of the keywords: ``forward(...)`` (any
        tangents, weight or activity perturbation, local losses, mean or projection; run with
        tangents per micro-batch, ``fold_in(key, n)``), ``hybrid(correction=...)`` (its
        tangents and correction; the selection is the table's) or ``backprop()``.
      perturb, local_losses, aggregation: the forward estimate (as ``jaxstream.grad.forward``);
        activity perturbation and projection need a forward-only table and correction "none".
      devices: devices for the ``stage`` axis (default ``jax.devices()``, the first M used).

    Returns:
      A Pipeline: ``pipe(params, batch, key[, carry]) -> (loss, grads, aux)``; batch leaves
      have a leading micro-batch axis N.
    """
    check_stack(stack, "pipeline")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    if estimator is None:
        estimator = _keyword_estimator(schedule, num_tangents, distribution, correction,
                                       orthogonal, antithetic, perturb, local_losses, aggregation)
    plan = getattr(estimator, "plan", None)
    if not isinstance(plan, Plan):
        raise TypeError(f"estimator must be a jaxstream.grad estimator (one with a .plan), "
                        f"got {type(estimator).__name__}")
    m = schedule.num_stages
    given = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    if len(set(devices)) < len(devices):
        raise ValueError(f"devices: each stage needs its own device; {devices} names one "
                         "device more than once")
    if m > len(devices):
        fix = (f"pass at least {m} devices (devices=jax.devices()[:{m}])" if given else
               f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={m} before JAX "
               "starts")
        raise ValueError(f"the schedule has num_stages={m} but only {len(devices)} devices are "
                         f"{'given' if given else 'available'} (one stage per device); {fix}")
    plan.forward_pass.refuse_unless("pipeline", "pipeline", plan.describe())
    check_local_losses(stack, plan.local_target, "pipeline")
    if stack.num_layers % m:
        raise ValueError(f"num_layers={stack.num_layers} does not split into num_stages={m} "
                         f"equal stages; for stages of unequal size pad them with "
                         f"jaxstream.pipeline.unequal_stages(stack, sizes)")
    lowered = lower(schedule)  # raises ScheduleError before anything is compiled
    if plan.exact_subset:
        return _subset(stack, schedule, plan, lowered, devices)
    check_carries(plan, schedule, lowered)
    mesh = jax.sharding.Mesh(np.array(devices[:m]), (AXIS,))
    if plan.forward_pass.guess:
        return LocalGuessPipeline(stack, schedule, plan, mesh, lowered)
    return Pipeline(stack, schedule, plan, mesh, lowered)


@dataclasses.dataclass(frozen=True, eq=False)
class LocalGuessPipeline(Pipeline):
    """The local guess (Fournier et al.) on a forward-only table, in two passes of it: every
    stage's exact local-loss gradients U (one F op per micro-batch, averaged), then the
    derivatives along u = U / ‖U‖ (the ``guess`` correction's F op); the estimate is
    (mean_n ∇L_n·u) u, and own local heads get their exact gradients, as in memory."""

    def __call__(self, params: dict, batch: dict, key: jax.Array,
                 carry: PipelineCarry | None = None, *, guess: Any = None):
        from jaxstream.grad.local_guess import _join, _split

        if guess is not None:
            raise ValueError("guess=: the local guess makes its own direction (the local "
                             "losses' exact gradients); pass none")
        self.check_batch(batch)
        loss, target, _ = run_step(self, params, batch, key, None)
        u, heads = _split(self.stack, target)
        own = None if heads is None else jax.tree.map(jnp.zeros_like, heads)
        _, _, aux = run_step(self, params, batch, key, None, guess=_join(self.stack, u, own),
                         along_pass=True)
        norm2 = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(u))
        norm = jnp.sqrt(jnp.maximum(norm2, jnp.finfo(jnp.float32).tiny))
        d = jnp.mean(aux["directional"][:, 0])  # ∇L·u, u = U / ‖U‖
        est = jax.tree.map(lambda x: (d / norm * x).astype(x.dtype), u)
        return loss, _join(self.stack, est, heads), {"directional": aux["directional"] * norm,
                                                     "guess_norm2": norm2}


def _keyword_estimator(schedule, num_tangents, distribution, correction, orthogonal, antithetic,
                       perturb, local_losses, aggregation) -> Any:
    """The estimator the keyword arguments name, built by :mod:`jaxstream.grad` (so they mean
    what they mean there and are refused alike): ``correction="none"`` a forward estimate,
    another correction a hybrid over the table's chains; ``None``: the table decides (corrected
    where it has chains)."""
    low = lower(schedule)
    chains = low.prev_selected if low.stale else low.selected
    if correction is None:
        correction = "control_variate" if chains else "none"
    allowed = ("none", *cb.corrections())
    if correction not in allowed:
        raise ValueError(f"correction={correction!r}; allowed: {allowed}")
    if correction == "none":
        return forward(num_tangents, distribution, perturb, orthogonal, antithetic, aggregation,
                       local_losses)
    if perturb != "weights" or aggregation != "mean" or local_losses:
        raise ValueError(f"perturb={perturb!r} / aggregation={aggregation!r} / local_losses="
                         f"{local_losses} run with correction='none' (got {correction!r})")
    return hybrid(len(chains) or None, correction, num_tangents, distribution,
                  orthogonal=orthogonal, antithetic=antithetic)


def check_carries(plan: Plan, schedule: Schedule, lowered: Lowered) -> None:
    """Raises ValueError, naming the estimator's plan and the table, unless the table can carry
    the plan: backprop needs every micro-batch's complete chain; a hybrid needs chains (of
    this step for ``guess``, stale ones only for rules unbiased with a stale mean); a forward
    estimate other than the weights' mean needs a forward-only table."""
    name, n = schedule.name, schedule.micro_batches
    chains = lowered.prev_selected if lowered.stale else lowered.selected
    what = f"estimator {plan.describe()} on schedule {name!r}"
    if plan.exact == "all":
        full = (not lowered.stale and tuple(sorted(lowered.selected)) == tuple(range(n))
                and bool(np.all(lowered.groups)))
        if not full:
            raise ValueError(f"{what}: backprop needs every one of the N={n} micro-batches' "
                             f"complete reverse chains; the table carries {tuple(chains)}"
                             f"{' (stale)' if lowered.stale else ''}; use gpipe_backprop(M, N)")
        return
    scalars = plan.forward_pass.scalars
    if not scalars or plan.rule is None or not plan.rule.exact:
        if plan.mixes:
            raise ValueError(f"{what}: the pipeline runs hybrids with weight tangents only")
        if (not scalars or plan.combine != "mean") and lowered.backward:
            raise ValueError(f"{what}: this forward estimate must run on a forward-only table "
                             f"(gpipe_forward); the table has reverse chains")
        return
    rule = plan.rule
    if not chains:
        raise ValueError(f"{what}: correction={rule.name!r} needs exact gradients; the table "
                         f"has no reverse chain (use complete, truncated or delayed)")
    if rule.along and lowered.stale:
        raise ValueError(f"{what}: correction={rule.name!r} needs exact gradients of this step "
                         f"(the next step's direction); the table's are of the previous step")
    if lowered.stale and not rule.stale_ok:
        allowed = tuple(r.name for r in cb.RULES.values() if r.stale_ok)
        raise ValueError(f"{what}: the table has stale exact gradients (previous step): "
                         f"correction={rule.name!r} is not allowed; use one of {allowed} "
                         f"(unbiased with a stale h)")
    if plan.fixed is not None and set(plan.fixed) != set(chains):
        raise ValueError(f"{what}: the estimator fixes exact_indices={plan.fixed}, the table's "
                         f"chains are {tuple(chains)}; build the table with those micro-batches")
    if plan.num_exact is not None and plan.fixed is None and plan.num_exact != len(chains):
        raise ValueError(f"{what}: num_exact={plan.num_exact}, the table carries "
                         f"{len(chains)} chains {tuple(chains)}")


def _subset(stack: Stack, schedule: Schedule, plan: Plan, lowered: Lowered, devices) -> Any:
    """``exact_subset(k)``: GPipe backprop over k micro-batches, selected by the key."""
    from jaxstream.pipeline.subset import SubsetPipeline

    k = plan.num_exact
    if schedule.micro_batches != k:
        raise ValueError(f"schedule: exact_subset({k}) runs backprop over its {k} selected "
                         f"micro-batches; pass a backprop table of {k} micro-batches such as "
                         f"gpipe_backprop(M, {k}), got {schedule.name!r} with "
                         f"{schedule.micro_batches}")
    if not lowered.backward or lowered.stale:
        raise ValueError(f"schedule: exact_subset needs a backprop table (gpipe_backprop), got "
                         f"{schedule.name!r}")
    inner = pipeline(stack, schedule, devices=devices, correction="replace")
    return SubsetPipeline(inner, k, plan.select)
