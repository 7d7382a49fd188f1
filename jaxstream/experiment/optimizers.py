"""Optimizers by name: ``optimizer: {name: adam, ...}`` in a config -> an optax transformation.

Built in: ``adam``, ``adamw``, ``sgd`` (``momentum``/``nesterov`` options), ``adabelief``. Other
packages add theirs with :func:`register_optimizer` (e.g. ``max_adabelief`` from
:mod:`jaxstream.optim`).

Example:
    >>> @register_optimizer("my_sgd")
    ... def my_sgd(learning_rate, momentum: float = 0.0):
    ...     return optax.sgd(learning_rate, momentum=momentum)
    >>> tx = build_optimizer(OptimizerConfig(name="my_sgd"), learning_rate=0.1)
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any, Literal

import optax

from jaxstream.experiment.config_yaml import ConfigError
from jaxstream.optim.max_adabelief import max_adabelief
from jaxstream.optim.promotion import standard_promotion
from jaxstream.ranges import Checked, Decay, Every, NonNegative, Positive, Range

OptimizerFactory = Callable[..., optax.GradientTransformation]

_OPTIMIZERS: dict[str, OptimizerFactory] = {}


def register_optimizer(name: str, factory: OptimizerFactory | None = None) -> Any:
    """Decorator: ``factory(learning_rate, **options) -> optax.GradientTransformation`` becomes
    ``optimizer: {name: NAME, options: {...}}``; ``register_optimizer(name, factory)``
    registers at once (e.g. an optax function). Returns the decorator (which returns the
    factory unchanged), or the factory."""

    def deco(fn: OptimizerFactory) -> OptimizerFactory:
        if not callable(fn):
            raise TypeError(f"register_optimizer({name!r}): the factory must be callable, "
                            f"got {fn!r}")
        _refuse_clash(name, fn)
        _OPTIMIZERS[name] = fn
        return fn

    return deco if factory is None else deco(factory)


def _same_factory(old: OptimizerFactory, new: OptimizerFactory) -> bool:
    """Whether ``new`` is ``old`` again: the same object, or the same module and name (the
    module imported twice), so re-registering is harmless."""
    if old is new:
        return True
    key = (getattr(old, "__module__", None), getattr(old, "__qualname__", None))
    return None not in key and key == (getattr(new, "__module__", None),
                                       getattr(new, "__qualname__", None))


def _refuse_clash(name: str, fn: OptimizerFactory) -> None:
    """Refuse a second, different factory under a registered name (as models are refused):
    a plugin must not silently replace a built-in optimizer."""
    old = _OPTIMIZERS.get(name)
    if old is not None and not _same_factory(old, fn):
        raise ConfigError(f"optimizer {name!r} is already registered; register yours under "
                          f"another name (registered: {', '.join(sorted(_OPTIMIZERS))})")


def optimizer_factory(name: str) -> OptimizerFactory:
    """The factory registered as ``name`` (KeyError if none)."""
    return _OPTIMIZERS[name]


def optimizer_names() -> list[str]:
    """Names of the registered optimizers."""
    return sorted(_OPTIMIZERS)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Checked):
    """Which optax optimizer to use.

    Attributes:
      name: a registered optimizer name (see :func:`optimizer_names`).
      options: extra keyword arguments for the factory (e.g. ``{b1: 0.9}``, ``{momentum: 0.9}``).
      clip_norm: if set, clip the gradient's global norm before the optimizer.
      warmup_steps: linear learning-rate warm-up from 0 over this many steps (0: none).
      schedule: ``constant`` or ``cosine`` decay to 0 at the end of training.
    """

    name: str = "adam"
    options: dict[str, bool | int | float | str] = dataclasses.field(default_factory=dict)
    clip_norm: Positive | None = None
    warmup_steps: Every = 0
    schedule: Literal["constant", "cosine"] = "constant"


def check_optimizer(cfg: OptimizerConfig, path: str = "optimizer") -> None:
    """Raise a ValueError naming ``path`` if the optimizer name or its options are unknown."""
    if cfg.name not in _OPTIMIZERS:
        raise ValueError(f"{path}.name: {cfg.name!r} is not a registered optimizer; choose one "
                         f"of {optimizer_names()}")
    factory = _OPTIMIZERS[cfg.name]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key, value in cfg.options.items():
            if key not in params or key == "learning_rate":
                allowed = [p for p in params if p != "learning_rate"]
                raise ValueError(f"{path}.options.{key}: unknown option for {cfg.name!r}; "
                                 f"allowed: {allowed}")
            _check_option_type(f"{path}.options.{key}", value, params[key].default)
    _check_builds(cfg, factory, path)


def _check_builds(cfg: OptimizerConfig, factory: OptimizerFactory, path: str) -> None:
    """Build the optimizer once (cheap: no arrays), so that a value its factory refuses
    (``mu_dtype: float99``) is a ValueError naming the option now, not a traceback mid-run."""
    try:
        factory(1e-3, **cfg.options)
        return
    except (TypeError, ValueError) as e:
        err = e
    for key, value in cfg.options.items():  # which option: the first refused on its own
        try:
            factory(1e-3, **{key: value})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}.options.{key}: {_first_line(e)} (got {value!r})") from e
    where = f"{path}.options" if cfg.options else f"{path}.name"
    raise ValueError(f"{where}: {cfg.name!r} cannot be built with these options: "
                     f"{_first_line(err)}") from err


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _check_option_type(field: str, value: Any, default: Any) -> None:
    """An option must have the type of the factory's default (a number for ``b1``, ...)."""
    if default is inspect.Parameter.empty or default is None:
        return
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return
    if not ok and want == "a number" and isinstance(value, str):
        from jaxstream.experiment.config_schema import read_float

        try:  # a number the float rule refused (out of float32's range, nan): say why
            float(value) and read_float(value)
        except ValueError as e:
            if not str(e).startswith("could not convert"):
                raise ValueError(f"{field}: {e}") from None
    if not ok:
        raise ValueError(f"{field}: expected {want} (the default is {default!r}), got {value!r}")
    rng = OPTION_RANGES.get(field.rsplit(".", 1)[-1])
    if rng is not None and not isinstance(value, bool) and value not in rng:
        raise ValueError(f"{field}: must be {rng}, got {value!r}")


def _range(tp: Any) -> Range:
    return typing.get_args(tp)[1]


#: Allowed ranges of the common optimizer options (the optax meaning of each name).
OPTION_RANGES: dict[str, Range] = {
    "b1": _range(Decay), "b2": _range(Decay), "momentum": _range(Decay),
    "eps": _range(Positive), "eps_root": _range(Decay), "weight_decay": _range(NonNegative),
}


def build_optimizer(
    cfg: OptimizerConfig, learning_rate: float, total_steps: int | None = None,
    factory: OptimizerFactory | None = None,
) -> optax.GradientTransformation:
    """The optax transformation for ``cfg`` with base ``learning_rate`` (``factory``: build it
    with this instead of the registered factory of ``cfg.name``, same options and schedule)."""
    check_optimizer(cfg)
    lr: Any = learning_rate
    if cfg.schedule == "cosine" or cfg.warmup_steps:
        decay = max(1, (total_steps or 1) - cfg.warmup_steps)
        if cfg.schedule == "cosine":
            main = optax.cosine_decay_schedule(learning_rate, decay)
        else:
            main = optax.constant_schedule(learning_rate)
        if cfg.warmup_steps:
            warm = optax.linear_schedule(0.0, learning_rate, cfg.warmup_steps)
            lr = optax.join_schedules([warm, main], [cfg.warmup_steps])
        else:
            lr = main
    tx = (factory or _OPTIMIZERS[cfg.name])(lr, **cfg.options)
    if cfg.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    return standard_promotion(tx)


register_optimizer("adam", optax.adam)
register_optimizer("adamw", optax.adamw)
register_optimizer("sgd", optax.sgd)
register_optimizer("adabelief", optax.adabelief)
register_optimizer("max_adabelief", max_adabelief)
