"""Lanes: several (learning rate, seed) runs of one arm, each exactly ``kind: train``.

A lane at rate ``lr`` and seed ``seed`` is the ``kind: train`` run of the same arm with that
``lr`` and ``seed`` on the same data: the same initial params (``init(fold_in(key(seed), 0))``),
batches (:func:`jaxstream.data.batches.batch_at` of ``(seed, step)``), tangent keys
(``fold_in(fold_in(key(seed), 1), step)``) and optimizer section, schedule, warm-up and
clipping included, built at the lane's rate. The sweep kinds (``lr_sweep``, ``forward_table``)
train through it, so their lanes and ``kind: train`` cannot drift apart.

On the ``local`` engine every lane trains in one ``vmap``-ed program: the rate lives in the
optimizer state (``optax.inject_hyperparams`` over the whole optimizer, rebuilt at the lane's
rate each step, so a lane is exact for any optimizer), and ``every`` steps run as one ``scan``
between evaluations. On any other engine (pipeline, stream, dataparallel, composed, a plugin's)
the lanes run one after another through that engine's own step; an engine that keeps a layer
store gets a fresh scratch store per lane (removed after the lane).

Example:
    >>> lanes = Lanes(stack, ForwardConfig(), OptimizerConfig(), LocalEngineConfig(),
    ...               train=data.train, batch_size=64, steps=300)
    >>> out = lanes.run([Lane(1e-3, 0), Lane(3e-3, 0)], every=50,
    ...                 evaluate=lambda params: metrics(params))  # params: a lane axis first
    >>> out.curve.shape   # (lanes, evaluations, metrics)
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstream.data.batches import batch_at, batch_indices
from jaxstream.experiment.engines import EngineConfig, LocalEngine, LocalEngineConfig, build_engine
from jaxstream.experiment.loop import TrainLoop
from jaxstream.experiment.optimizers import OptimizerConfig, build_optimizer, check_optimizer


class Lane(NamedTuple):
    """One run of a sweep: its learning rate and its seed (the ``seed`` of ``kind: train``)."""

    lr: float
    seed: int


class LaneResult(NamedTuple):
    """What :meth:`Lanes.run` returns.

    Attributes:
      curve: ``(lanes, evaluations, k)``, ``evaluate``'s figures after every ``every`` steps.
      loss: ``(lanes, evaluations)``, the training loss of the step before each evaluation.
      step_ms: median milliseconds per step of each lane (the engines that run lanes one
        after another; None on the local engine, whose lanes share each step).
    """

    curve: np.ndarray
    loss: np.ndarray
    step_ms: list[float] | None


def lane_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """The optimizer of ``cfg`` with its learning rate in its state
    (``state.hyperparams["learning_rate"]``, set with :func:`with_rate`), so lanes at several
    rates share one program; the whole optimizer (schedule, warm-up, clipping) is rebuilt at
    that rate each step, so a lane equals ``build_optimizer(cfg, lr, total_steps)``."""
    check_optimizer(cfg)
    return optax.inject_hyperparams(
        lambda learning_rate: build_optimizer(cfg, learning_rate, total_steps))(learning_rate=1.0)


def with_rate(opt_state: Any, lr: Any) -> Any:
    """``opt_state`` of :func:`lane_optimizer` with learning rate ``lr``."""
    rates = dict(opt_state.hyperparams)
    rates["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return opt_state._replace(hyperparams=rates)


def init_key(seed: int) -> jax.Array:
    """The key ``kind: train`` initialises params (and the engine) with."""
    return jax.random.fold_in(jax.random.key(seed), 0)


def step_root(seed: int) -> jax.Array:
    """The key whose ``fold_in(., step)`` is step ``step``'s tangent key in ``kind: train``."""
    return jax.random.fold_in(jax.random.key(seed), 1)


@dataclasses.dataclass
class Lanes:
    """The lanes of one arm: its model, estimator section, optimizer and engine sections, the
    training split and the run length (see the module docstring).

    ``model``: the model section (recorded in a layer store); ``name``: the arm's name;
    ``engine_kwargs``: more keyword arguments for the engine's build."""

    stack: Any
    estimator: Any  # the estimator section (EstimatorConfig)
    optimizer: OptimizerConfig
    engine: EngineConfig
    train: Mapping[str, Any]
    batch_size: int
    steps: int
    model: Any = None
    name: str = "arm"

    @property
    def micro_batches(self) -> int:
        return self.estimator.micro_batches

    def run(self, lanes: Sequence[Lane], every: int, evaluate: Callable[[Any], Any],
            on_eval: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> LaneResult:
        """Train every lane for ``steps`` steps, calling ``evaluate(params)`` (params with a
        leading lane axis -> ``(lanes, k)``) after every ``every`` steps and after the last;
        ``on_eval(step, figures, loss)`` sees each evaluation as it comes (every lane's row on
        the local engine; on the others, lanes one after another, the running lane's row)."""
        if type(self.engine) is LocalEngineConfig:
            return self._together(list(lanes), every, evaluate, on_eval)
        return self._one_by_one(list(lanes), every, evaluate, on_eval)

    # -- the local engine: every lane in one program ---------------------------------------
    def local_engine(self) -> LocalEngine:
        """The local engine of a lane (its optimizer takes the rate from its state)."""
        return LocalEngine(LocalEngineConfig(), stack=self.stack,
                           estimator=self.estimator.build(),
                           optimizer=lane_optimizer(self.optimizer, self.steps),
                           micro_batches=self.micro_batches)

    def init_state(self, engine: LocalEngine, lane: Lane) -> Any:
        """Lane ``lane``'s initial state on the local engine (as ``kind: train`` starts)."""
        state = engine.init(self.stack.init(init_key(lane.seed)), init_key(lane.seed))
        return state._replace(opt_state=with_rate(state.opt_state, lane.lr))

    def _together(self, lanes, every, evaluate, on_eval) -> LaneResult:
        engine = self.local_engine()
        train = {k: jnp.asarray(v) for k, v in self.train.items()}
        n = len(next(iter(self.train.values())))

        def chunk(state, root, idx, t0):
            def body(st, xs):
                i, t = xs
                st, m = engine._step(st, jax.tree.map(lambda a: a[i], train),
                                     jax.random.fold_in(root, t))
                return st, m["loss"]

            return jax.lax.scan(body, state, (idx, t0 + jnp.arange(idx.shape[0])))

        run = jax.jit(jax.vmap(chunk, in_axes=(0, 0, 0, None)))
        state = jax.tree.map(lambda *x: jnp.stack(x),
                             *[self.init_state(engine, lane) for lane in lanes])
        roots = jnp.stack([step_root(lane.seed) for lane in lanes])
        seeds = sorted({lane.seed for lane in lanes})

        ends = [*range(every, self.steps + 1, every)]
        ends += [self.steps] if self.steps % every else []  # a last, shorter chunk
        starts = [0, *ends[:-1]]

        def indices(c: int) -> np.ndarray:  # (lanes, steps of chunk c, B): each lane's batches
            by_seed = {s: np.stack([batch_indices(n, self.batch_size, s, t)
                                    for t in range(starts[c], ends[c])]) for s in seeds}
            return np.stack([by_seed[lane.seed] for lane in lanes]).astype(np.int32)

        curve, loss = [], []

        def chunk_step(st, c, _):
            st, losses = run(st, roots, indices(c), starts[c])
            return st, {"loss": losses[:, -1]}

        loop = TrainLoop(chunk_step, batch_at=lambda c: c, key_at=lambda c: None, timed=False)

        def hook(info):
            figures = np.asarray(evaluate(info.state.params))
            curve.append(figures)
            loss.append(np.asarray(info.record["loss"]))
            if on_eval is not None:
                on_eval(ends[info.step - 1], figures, loss[-1])

        loop.add_hook(hook)
        loop.run(state, start=0, stop=len(ends))
        return LaneResult(np.stack(curve, axis=1), np.stack(loss, axis=1), None)

    # -- any other engine: lane after lane --------------------------------------------------
    def build(self, lane: Lane, store: str | None = None) -> Any:
        """The engine of ``lane`` (its optimizer built at the lane's rate); ``store``: where an
        engine that keeps a layer store keeps it."""
        cfg = self.engine.with_store(store) if store is not None else self.engine
        return build_engine(cfg, stack=self.stack, estimator=self.estimator.build(),
                            optimizer=build_optimizer(self.optimizer, lane.lr, self.steps),
                            optimizer_config=self.optimizer, learning_rate=lane.lr,
                            total_steps=self.steps, model=self.model, arm=self.name,
                            micro_batches=self.micro_batches,
                            example_batch=batch_at(self.train, self.batch_size, lane.seed, 0))

    def _one_by_one(self, lanes, every, evaluate, on_eval) -> LaneResult:
        curves, losses, times = [], [], []
        for lane in lanes:
            scratch = tempfile.mkdtemp(prefix="jaxstream-lane-")
            try:
                curve, loss, ms = self._lane(lane, every, evaluate, on_eval,
                                             str(Path(scratch) / "store"))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            curves.append(curve), losses.append(loss), times.append(ms)
        return LaneResult(np.stack(curves), np.stack(losses), times)

    def _lane(self, lane: Lane, every: int, evaluate, on_eval, store: str):
        engine = self.build(lane, store)
        state = engine.init(self.stack.init(init_key(lane.seed)), init_key(lane.seed))
        root = step_root(lane.seed)
        loop = TrainLoop(engine.step,
                         batch_at=lambda s: batch_at(self.train, self.batch_size, lane.seed, s),
                         key_at=lambda s: jax.random.fold_in(root, s))
        curve, loss, step_s = [], [], []
        loop.add_hook(lambda i: step_s.append(i.record["step_time"]))

        def hook(info):
            params = jax.tree.map(lambda a: jnp.asarray(a)[None], engine.params(info.state))
            figures = np.asarray(evaluate(params))[0]
            curve.append(figures)
            loss.append(float(info.record["loss"]))
            if on_eval is not None:
                on_eval(info.step, figures[None], np.asarray([loss[-1]]))

        loop.add_hook(hook, every=every, at=(self.steps,))
        loop.run(state, start=0, stop=self.steps)
        # the first step compiles: the median of the rest
        ms = float(np.median(step_s[1:] or step_s) * 1e3)
        return np.stack(curve), np.asarray(loss), ms
