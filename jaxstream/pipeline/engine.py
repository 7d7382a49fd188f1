"""The ``pipeline`` training engine: ``engine: {type: pipeline, stages: 4, policy: complete}``.

The arm's estimator section says what the pipeline computes:
  - ``forward`` (weights, mean aggregation): jvp on every micro-batch, no exact gradient;
  - ``hybrid``: the selected micro-batches (``exact_indices``, or the first ``num_exact``: a
    pipeline schedule is static, so the selection cannot be random) get exact gradients as the
    ``policy`` allows; ``correction`` as in the estimator (``guess`` needs a second pass: not
    supported);
  - ``backprop``: every micro-batch selected, complete chains, ``replace``: the exact gradient.

Example (YAML):
  engine: {type: pipeline, stages: 4, policy: truncated}
  arms: [{name: hybrid, estimator: {type: hybrid, micro_batches: 8, num_exact: 2}, lr: 0.01}]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstream.experiment.engines import register_engine, split_micro_batches
from jaxstream.pipeline.executor import AXIS, pipeline
from jaxstream.pipeline.generators import complete, make_schedule


@dataclasses.dataclass(frozen=True)
class PipelineEngineConfig:
    """Options of the pipeline engine.

    Attributes:
      stages: M, pipeline stages (one device each; the model depth must divide by M).
      policy: how exact gradients fill the bubbles: "truncated" (no added tick, nested
        groups), "delayed" (no added tick, the previous step's micro-batches: stale by one step),
        "complete" (full chains, fewest added ticks).
      micro_batches: N for a forward estimator (a hybrid arm's own micro_batches wins).
    """

    stages: int = 4
    policy: Literal["truncated", "delayed", "complete"] = "complete"
    micro_batches: int = 8

    def __post_init__(self):
        if self.stages < 1:
            raise ValueError(f"engine.stages: must be >= 1, got {self.stages}")
        if self.policy not in ("truncated", "delayed", "complete"):
            raise ValueError(f"engine.policy: must be one of 'truncated', 'delayed', 'complete', "
                             f"got {self.policy!r}")
        if self.micro_batches < 1:
            raise ValueError(f"engine.micro_batches: must be >= 1, got {self.micro_batches}")


class PipelineState(NamedTuple):
    """Engine state: params, optimizer state and (delayed policy) the previous step's carry."""

    params: Any
    opt_state: Any
    carry: Any


def _tangent_kwargs(est: Any) -> dict:
    return {name: getattr(est, name)
            for name in ("num_tangents", "distribution", "orthogonal", "antithetic")}


def _plan(cfg: PipelineEngineConfig, estimator_cfg: Any, micro_batches: int):
    """(schedule, pipeline kwargs) from the engine and estimator sections; errors name fields."""
    kind = type(estimator_cfg).__name__
    m = cfg.stages
    if kind == "BackpropConfig":
        n = cfg.micro_batches
        return complete(m, n, range(n)), {"correction": "replace"}
    if kind == "ForwardConfig":
        if estimator_cfg.perturb != "weights" or estimator_cfg.aggregation != "mean" or \
                estimator_cfg.local_losses:
            raise ValueError("estimator: the pipeline engine runs forward gradients with "
                             "perturb='weights', aggregation='mean', local_losses=false")
        return make_schedule("forward", m, cfg.micro_batches), {
            "correction": "none", **_tangent_kwargs(estimator_cfg)}
    if kind == "HybridConfig":
        if estimator_cfg.correction == "guess":
            raise ValueError("estimator.correction: 'guess' needs a second forward pass along "
                             "the guess; the pipeline engine supports 'control_variate', "
                             "'replace', 'weighted'")
        n = micro_batches
        sel = (tuple(estimator_cfg.exact_indices) if estimator_cfg.exact_indices is not None
               else tuple(range(estimator_cfg.num_exact)))
        return make_schedule(cfg.policy, m, n, sel), {
            "correction": estimator_cfg.correction, **_tangent_kwargs(estimator_cfg)}
    raise ValueError(f"estimator: {kind} is not supported by the pipeline engine "
                     "(backprop, forward, hybrid)")


class PipelineEngine:
    """Trains a stack with the shard_map pipeline gradient and an optax optimizer."""

    def __init__(self, cfg: PipelineEngineConfig, *, stack: Any,
                 optimizer: optax.GradientTransformation, arm: Any = None,
                 micro_batches: int = 1, config: Any = None, example_batch: dict | None = None,
                 **_: Any):
        est_cfg = arm.estimator if arm is not None else None
        schedule, kw = _plan(cfg, est_cfg, micro_batches)
        self.cfg, self.stack, self.optimizer, self.schedule = cfg, stack, optimizer, schedule
        self.pipe = pipeline(stack, schedule, **kw)
        self.num_microbatches = schedule.num_microbatches
        self._example = example_batch
        if self.pipe.stale and example_batch is None:
            # the carry's shapes (stage inputs of a micro-batch) come from one batch of the data
            data = config.data.load(config.seed)
            self._example = jax.tree.map(lambda a: a[: config.batch_size], data.train)
        self.step = jax.jit(self._step)
        self.estimate = jax.jit(self._estimate)

    def init(self, params: Any, key: jax.Array) -> PipelineState:
        """Initial state; for the delayed policy the carry says "no previous step" (h = 0)."""
        del key
        mesh = self.pipe.mesh
        params = jax.device_put(params, {
            "embed": NamedSharding(mesh, P()), "blocks": NamedSharding(mesh, P(AXIS)),
            "head": NamedSharding(mesh, P())})
        carry = None
        if self.pipe.stale:
            micro = split_micro_batches(self._example, self.num_microbatches)
            carry = self.pipe.init_carry(params, micro)
            carry = carry._replace(stash=jax.device_put(carry.stash, NamedSharding(mesh, P(AXIS))))
        state = PipelineState(params, jax.jit(self.optimizer.init)(params), carry)
        # every step returns the state with these shardings: one compilation for all steps
        self._shardings = jax.tree.map(
            lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
            else NamedSharding(mesh, P()), state)
        return jax.device_put(state, self._shardings)

    def params(self, state: PipelineState) -> Any:
        return state.params

    def _grads(self, state: PipelineState, batch: dict, key: jax.Array):
        micro = split_micro_batches(batch, self.num_microbatches)
        return self.pipe(state.params, micro, key, state.carry)

    def _estimate(self, state: PipelineState, batch: dict, key: jax.Array):
        loss, grads, _ = self._grads(state, batch, key)
        return loss, grads

    def _step(self, state: PipelineState, batch: dict, key: jax.Array):
        loss, grads, aux = self._grads(state, batch, key)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        new = PipelineState(params, opt_state, aux.get("carry"))
        if getattr(self, "_shardings", None) is not None:
            new = jax.lax.with_sharding_constraint(new, self._shardings)
        return new, metrics


register_engine("pipeline", PipelineEngineConfig, lambda cfg, **kw: PipelineEngine(cfg, **kw))
