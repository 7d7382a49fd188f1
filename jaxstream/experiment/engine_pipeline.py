"""The ``pipeline`` training engine: ``engine: {type: pipeline, stages: 4, policy: complete}``.

The engine schedules the arm's built estimator (``jaxstream.grad``) over the stages; what it
computes is the executor's (``jaxstream.pipeline.executor.pipeline(stack, schedule, estimator)``):
  - ``forward`` (any tangents, weight or activity perturbation, local losses, mean or
    projection): a forward-only table, tangents per micro-batch;
  - ``hybrid``: the selected micro-batches (``exact_indices``, or the first ``num_exact``: a
    pipeline schedule is static, so the selection cannot be random) get exact gradients as the
    ``policy`` allows; ``guess`` differentiates along the previous step's exact mean (kept in
    the engine state; the first direction is the exact mean of the data's first batch at the
    initial params);
  - ``backprop``: every micro-batch selected, complete chains, ``replace``: the exact gradient.

Stages of unequal size (``placement: {kind: by_speed | by_type, ...}``, see
:mod:`jaxstream.experiment.placement_config`) run padded to the largest stage
(:func:`jaxstream.pipeline.unequal_stages`): the state and the estimates keep the model's
shapes; a forward estimate draws its tangents per padded block, so it equals the in-memory
estimator of the padded model for the same key, not of the model itself.

Example (YAML):
  engine: {type: pipeline, stages: 4, policy: truncated}
  arms: [{name: hybrid, estimator: {type: hybrid, micro_batches: 8, num_exact: 2}, lr: 0.01}]
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstream.experiment.engines import EngineConfig, register_engine, split_micro_batches
from jaxstream.experiment.placement_config import PlacementConfig
from jaxstream.optim.promotion import standard_promotion
from jaxstream.pipeline.executor import AXIS, pipeline
from jaxstream.pipeline.generators import complete, make_schedule
from jaxstream.pipeline.unequal import unequal_stages
from jaxstream.ranges import Count


@register_engine("pipeline")
@dataclasses.dataclass(frozen=True)
class PipelineEngineConfig(EngineConfig):
    """Options of the pipeline engine.

    Attributes:
      stages: M, pipeline stages (one device each; with ``placement.kind: equal`` the model
        depth must divide by M).
      policy: how exact gradients fill the bubbles: "truncated" (no added tick, nested
        groups), "delayed" (no added tick, the previous step's micro-batches: stale by one step),
        "complete" (full chains, fewest added ticks), "crossstep" (full chains of the previous
        step's micro-batches across the step boundary; stale by one step).
      micro_batches: N for a forward estimator (a hybrid arm's own micro_batches wins).
      placement: blocks per stage: equal, by device speed or by layer type.
    """

    stages: Count = 4
    policy: Literal["truncated", "delayed", "complete", "crossstep"] = "complete"
    micro_batches: Count = 8
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    places_blocks: ClassVar[bool] = True  # a sequential model runs as a stack (to_stack)

    def check_model(self, model: Any) -> None:
        """The placement serves the model's depth on the stages (when the model section says
        its depth), checked when the config loads, as the composed engine does."""
        depth = getattr(model, "depth", None)
        if isinstance(depth, int):
            self.placement.sizes(depth, self.stages)

    def check_arm(self, arm: Any, field: str) -> None:
        """The pipeline runs the arm's forward pass (checked when the config loads, before the
        run directory is made; the table's own checks follow when the engine is built)."""
        plan = arm.estimator.build().plan
        plan.forward_pass.refuse_unless("pipeline", f"{field}.estimator: pipeline",
                                        plan.describe())

    def check_run(self, names: list[str], resume: bool) -> None:
        """Before anything is written: one device per stage exists (as the data-parallel and
        composed engines check theirs), not a traceback after the data is loaded."""
        available = jax.device_count()
        if self.stages > available:
            raise ValueError(
                f"engine.stages: {self.stages} requested (one device per stage) but only "
                f"{available} devices exist; allowed: 1 .. {available} (on a CPU, set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={self.stages} before JAX is imported)")

    def build(self, **kw: Any) -> Any:
        """The engine (the registry calls this; keywords: :mod:`jaxstream.experiment.engines`)."""
        return PipelineEngine(self, **kw)


class PipelineState(NamedTuple):
    """Engine state: params, optimizer state, (stale policies) the previous step's carry and
    (``guess``) the previous step's exact mean, the direction of this step."""

    params: Any
    opt_state: Any
    carry: Any
    direction: Any = None


def _schedule(cfg: PipelineEngineConfig, estimator: Any, micro_batches: int):
    """The table for the arm's estimator, read off its plan; errors name the field."""
    m, plan = cfg.stages, estimator.plan
    if plan.exact == "all":  # backprop: every micro-batch's complete chain
        n = cfg.micro_batches
        return complete(m, n, range(n))
    if plan.exact == "none":
        return make_schedule("forward", m, cfg.micro_batches)
    if plan.exact_subset:  # backprop over the k micro-batches a key selects
        return complete(m, plan.num_exact, range(plan.num_exact))
    if plan.nested:
        raise ValueError("estimator.exact_from: the pipeline's policy makes the per-layer "
                         "groups; give num_exact or exact_indices")
    sel = plan.fixed if plan.fixed is not None else tuple(range(plan.num_exact))
    return make_schedule(cfg.policy, m, micro_batches, sel)


class PipelineEngine:
    """Trains a stack with the shard_map pipeline gradient and an optax optimizer."""

    def __init__(self, cfg: PipelineEngineConfig, *, stack: Any, estimator: Any,
                 optimizer: optax.GradientTransformation, micro_batches: int = 1,
                 example_batch: dict | None = None, **_: Any):
        """``example_batch``: one batch of the data (the delayed policy's carry and the first
        guess direction take their shapes from it); required for those two."""
        schedule = _schedule(cfg, estimator, micro_batches)
        self.cfg, self.stack, self.schedule = cfg, stack, schedule
        self.optimizer = standard_promotion(optimizer)  # optax's arithmetic: optax's rules
        self.sizes = cfg.placement.sizes(stack.num_layers, cfg.stages)
        self._pad = self._unpad = None
        if len(set(self.sizes)) > 1:  # unequal stages: padded to the largest, skipped blocks
            stack, self._pad, self._unpad = unequal_stages(stack, self.sizes)
        self.pipe = pipeline(stack, schedule, estimator)
        self.guess = self.pipe.along
        plan = estimator.plan
        self.micro_batches = micro_batches if plan.exact_subset else schedule.micro_batches
        self._example = example_batch
        if (self.pipe.stale or self.guess) and example_batch is None:
            raise ValueError(f"engine.policy={cfg.policy!r}"
                             + (" with the guess correction" if self.guess else "")
                             + ": the pipeline engine needs example_batch= (one batch of the "
                             "data) to shape its carry / first direction")
        self.step = jax.jit(self._step)
        self.estimate = jax.jit(self._estimate)

    def init(self, params: Any, key: jax.Array) -> PipelineState:
        """Initial state; for the delayed policy the carry says "no previous step" (h = 0)."""
        mesh = self.pipe.mesh
        params = jax.device_put(params, {  # unequal stages: the padding happens in the step
            "embed": NamedSharding(mesh, P()),
            "blocks": NamedSharding(mesh, P() if self._pad else P(AXIS)),
            "head": NamedSharding(mesh, P())})
        carry = None
        if self.pipe.stale:
            micro = split_micro_batches(self._example, self.micro_batches)
            carry = self.pipe.init_carry(self._padded(params), micro)
            carry = carry._replace(stash=jax.device_put(carry.stash, NamedSharding(mesh, P(AXIS))))
        state = PipelineState(params, jax.jit(self.optimizer.init)(params), carry)
        if self.guess:  # the first step's direction: its own exact mean (see the executor)
            micro = split_micro_batches(self._example, self.micro_batches)
            direction = self.pipe(self._padded(params), micro, key)[2]["direction"]
            state = state._replace(direction=direction)
        # every step returns the state with these shardings: one compilation for all steps
        self._shardings = jax.tree.map(
            lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
            else NamedSharding(mesh, P()), state)
        return jax.device_put(state, self._shardings)

    def params(self, state: PipelineState) -> Any:
        return state.params

    def _padded(self, params: Any) -> Any:
        """The params the pipeline runs: padded to the largest stage where stages differ."""
        return params if self._pad is None else self._pad(params)

    def _grads(self, state: PipelineState, batch: dict, key: jax.Array):
        """(loss, grads shaped like the params, aux); the carry and the guess direction stay
        in the pipeline's (padded) shapes."""
        micro = split_micro_batches(batch, self.micro_batches)
        loss, grads, aux = self.pipe(self._padded(state.params), micro, key, state.carry,
                                     guess=state.direction)
        return loss, (grads if self._unpad is None else self._unpad(grads)), aux

    def _estimate(self, state: PipelineState, batch: dict, key: jax.Array):
        loss, grads, _ = self._grads(state, batch, key)
        return loss, grads

    def _step(self, state: PipelineState, batch: dict, key: jax.Array):
        loss, grads, aux = self._grads(state, batch, key)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        new = PipelineState(params, opt_state, aux.get("carry"), aux.get("direction"))
        if getattr(self, "_shardings", None) is not None:
            new = jax.lax.with_sharding_constraint(new, self._shardings)
        return new, metrics
