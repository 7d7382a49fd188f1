"""Engines: what runs one optimizer step. ``engine: {type: local}`` in a config picks one.

An engine owns the training state and the compiled step; the runner (``train`` kind) owns data,
evaluation, logging and checkpoints. ``local`` (one device, ``jax.jit``) is built in;
``pipeline``, ``stream`` and ``dataparallel`` are registered by the experiment layer's
``engine_*`` modules (imported by :mod:`jaxstream.experiment.builtin`), a user's engines by
their plugin modules, all with the decorator :func:`register_engine` (the shape of every
registration: ``@register_dataset(name)``, ``@register_model(name)``,
``@register_experiment(kind, ConfigClass)``, ``@register_optimizer(name)``).

An engine config's ``build`` method is called as::

    engine_cfg.build(*, stack, estimator, optimizer, optimizer_config, learning_rate,
                     total_steps, model, arm, micro_batches, example_batch) -> Engine

with ``stack`` the model (a :class:`jaxstream.models.Stack`, itself a ``loss_fn``), ``estimator``
the built estimator (``estimator(loss_fn, params, batch, key) -> (loss, grads)``), ``optimizer``
an ``optax.GradientTransformation`` built from ``optimizer_config`` (the arm's optimizer
section) at ``learning_rate`` for ``total_steps`` steps (an engine that builds its own, as
``dataparallel`` with ``exchange: moments`` does, reads these three), ``model`` the model
section (recorded in a layer store), ``arm`` the arm's name, ``micro_batches`` the number N of
micro-batches a hybrid estimator needs (1 otherwise) and ``example_batch`` one batch of the
data (for state shaped by it). An engine never sees the whole experiment config, so every kind
that trains (``train``, ``lr_sweep``, ``forward_table``) builds it the same way. Accept
``**kwargs`` to stay compatible with later additions.

Example:
    >>> @register_engine("mine")
    ... @dataclasses.dataclass(frozen=True)
    ... class MyEngineConfig(EngineConfig):
    ...     stages: int = 2
    ...
    ...     def build(self, **kw) -> Engine:
    ...         return MyEngine(self, **kw)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

from jaxstream.experiment.config import choices, register_choice
from jaxstream.ranges import Checked
from jaxstream.training import TrainStep

Metrics = dict[str, Any]


@runtime_checkable
class Engine(Protocol):
    """One optimizer step at a time over a state pytree that orbax can save.

    Optional: ``estimate(state, batch, key) -> (loss, grads)`` returns the gradient estimate the
    step would use (without updating); the runner then logs its cosine to the exact gradient. If
    it accepts ``diagnostics=True`` and then returns ``(loss, grads, diag)``, the scalar entries of
    ``diag`` are logged too (as ``diag_<name>``).

    Optional: ``warm_up(state, batch, key) -> None`` compiles what a step runs without changing
    the state or anything the engine has written (for an engine whose step is not one jitted
    function: the streamed engines); the runner times it as ``compile_time`` before the step
    clock starts. A jitted ``step`` is compiled by calling it once instead.
    """

    def init(self, params: Any, key: jax.Array) -> Any:
        """Initial state from initial params."""

    def step(self, state: Any, batch: dict, key: jax.Array) -> tuple[Any, Metrics]:
        """One optimizer step on ``batch`` (leaves (B, ...)); returns (new state, scalar metrics)."""

    def params(self, state: Any) -> Any:
        """The current params, for evaluation and diagnostics."""


class EngineConfig(Checked):
    """Base of the polymorphic ``engine:`` section; variants come from :func:`register_engine`
    and subclass it, overriding what they need (levanter's pattern: a config declares its
    capabilities and its checks, the runner asks nothing else of it).

    Attributes:
      places_blocks: the engine places or streams a stack's blocks, so a sequential model runs
        as a stack (:func:`jaxstream.models.to_stack`).
      streams_layers: the engine holds one layer at a time (the memory check counts one layer).
      micro_batches: how many micro-batches the engine cuts a batch into for an estimator of
        one (1 unless a variant declares it as a field).
    """

    places_blocks: ClassVar[bool] = False
    streams_layers: ClassVar[bool] = False
    micro_batches: int = 1

    def check_arm(self, arm: Any, field: str) -> None:
        """Raises ValueError naming ``field`` if the engine cannot run the arm's estimator."""

    def check_optimizer(self, optimizer: Any, field: str) -> None:
        """Raises ValueError naming ``field`` if the engine cannot run the optimizer."""

    def check_arms(self, names: list[str]) -> None:
        """Checks across the arms (e.g. one store path per arm)."""

    def check_model(self, model: Any) -> None:
        """Checks of the model section against the engine (e.g. depth against stages)."""

    def check_run(self, names: list[str], resume: bool) -> None:
        """Checks that need the disk, before anything is written (e.g. an existing store)."""

    def with_store(self, path: str) -> EngineConfig:
        """This section with its layer store at ``path`` (a sweep's scratch store per lane);
        unchanged for an engine without a store."""
        return self

    def build(self, **kwargs: Any) -> Engine:
        """The engine this section configures (the keywords: the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__}.build: an engine config registered "
                                  "with @register_engine(name) builds its engine here")


class EngineEntry(NamedTuple):
    """A registered engine."""

    name: str
    config_cls: type
    build: Callable[..., Engine]


_ENGINES: dict[str, EngineEntry] = {}


def register_engine(name: str, config_cls: type | None = None,
                    build: Callable[..., Engine] | None = None) -> Any:
    """Decorator: a frozen dataclass subclassing :class:`EngineConfig`, whose ``build(**kw)``
    builds the engine, becomes ``engine: {type: name, ...}``.

    Args:
      name: the ``type:`` value in YAML.
      config_cls, build: the older call form, ``register_engine(name, config_cls, build)``
        with ``build(engine_cfg, **kw)`` a function of its own (still accepted).
    Returns:
      the decorator (which returns the class unchanged); the class, in the older form.
    """

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, EngineConfig)):
            raise TypeError(f"register_engine({name!r}): the config class must subclass "
                            f"jaxstream.experiment.EngineConfig (class "
                            f"{getattr(cls, '__name__', cls)}(EngineConfig)), got {cls!r}")
        if build is None and cls.build is EngineConfig.build:
            raise TypeError(f"register_engine({name!r}): {cls.__name__} has no build method "
                            "(def build(self, **kw) -> Engine)")
        register_choice(EngineConfig, name, cls)
        _ENGINES[name] = EngineEntry(name, cls, build or (lambda cfg, **kw: cfg.build(**kw)))
        return cls

    if config_cls is None:
        if build is not None:
            raise TypeError(f"register_engine({name!r}, build=...): give the config class too")
        return deco
    return deco(config_cls)


def engine_names() -> list[str]:
    """Names of the registered engines."""
    return sorted(_ENGINES)


def build_engine(engine_cfg: Any, **kwargs: Any) -> Engine:
    """Build the engine registered for ``engine_cfg``'s class."""
    for entry in _ENGINES.values():
        if type(engine_cfg) is entry.config_cls:
            return entry.build(engine_cfg, **kwargs)
    raise ValueError(f"engine: {type(engine_cfg).__name__} is not a registered engine config; "
                     f"registered: {sorted(choices(EngineConfig))}")


def split_micro_batches(batch: dict, n: int) -> dict:
    """Reshape every leaf (B, ...) -> (n, B // n, ...) (consecutive examples per micro-batch)."""
    if n == 1:
        return batch

    def cut(a):
        if a.shape[0] % n:
            raise ValueError(f"batch_size: {a.shape[0]} is not divisible by micro_batches={n}")
        return a.reshape((n, a.shape[0] // n) + a.shape[1:])

    return jax.tree.map(cut, batch)


# ----------------------------------------------------------------------------- local engine
@register_engine("local")
@dataclasses.dataclass(frozen=True)
class LocalEngineConfig(EngineConfig):
    """One device, one jit-compiled step (no options)."""

    def build(self, **kw: Any) -> LocalEngine:
        return LocalEngine(self, **kw)


class LocalState(NamedTuple):
    """State of the local engine."""

    params: Any
    opt_state: Any


class LocalEngine:
    """Single-device engine: the library's one local step (:class:`jaxstream.training.TrainStep`)
    with the run's state and metrics around it.

    For a hybrid estimator the batch is cut into ``micro_batches`` micro-batches inside the step.
    """

    def __init__(self, cfg: LocalEngineConfig, *, stack: Any, estimator: Callable,
                 optimizer: optax.GradientTransformation, micro_batches: int = 1, **_: Any):
        self.cfg = cfg
        self.stack = stack
        self.estimator = estimator
        self.micro_batches = micro_batches
        self.train = TrainStep(estimator, optimizer, stack,
                               prepare=lambda b: split_micro_batches(b, micro_batches))
        self.optimizer = self.train.optimizer  # optax's arithmetic: optax's rules
        self.step = jax.jit(self._step)
        self.estimate = jax.jit(self._estimate, static_argnames="diagnostics")

    def init(self, params: Any, key: jax.Array) -> LocalState:
        del key
        return LocalState(params, self.optimizer.init(params))

    def params(self, state: LocalState) -> Any:
        return state.params

    def _estimate(self, state: LocalState, batch: dict, key: jax.Array, diagnostics: bool = False):
        """The step's ``(loss, grads)`` (``+ diag dict`` with ``diagnostics=True``)."""
        batch = split_micro_batches(batch, self.micro_batches)
        if diagnostics:
            return self.estimator(self.stack, state.params, batch, key, diagnostics=True)
        return self.estimator(self.stack, state.params, batch, key)

    def _step(self, state: LocalState, batch: dict, key: jax.Array):
        params, opt_state, loss, grads = self.train.update(state.params, state.opt_state, batch,
                                                           key)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return LocalState(params, opt_state), metrics


def tree_cosine(a: Any, b: Any) -> jax.Array:
    """Cosine similarity of two pytrees seen as flat vectors."""
    dot = sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return dot / (optax.tree.norm(a) * optax.tree.norm(b) + 1e-30)
