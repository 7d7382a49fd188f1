"""Typed experiment configs: YAML + dotted overrides -> frozen dataclasses, and back to YAML.

A config is any (nested) frozen dataclass. :func:`from_dict` checks every value against the
field's type hint and raises a ``ValueError`` naming the dotted field and what is allowed, so a
bad experiment fails before any compute starts. Polymorphic sections (an ``engine:``, a
``model:``) are chosen by a ``type:`` key among the classes registered for the field's base
class with :func:`register_choice` (as levanter does with draccus' ChoiceRegistry).

Supported field types: ``int``, ``float``, ``str``, ``bool``, ``Literal[...]``, ``X | None``,
``tuple[X, ...]``, ``tuple[X, Y]``, ``list[X]``, ``dict[str, X]``, ``Any``, nested dataclasses and
registered polymorphic bases.

Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class Opt:
    ...     name: Literal["adam", "sgd"] = "adam"
    ...     lr: float = 1e-3
    >>> load_config(Opt, {"name": "sgd"}, ["lr=0.1"])
    Opt(name='sgd', lr=0.1)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from jaxstream.experiment.config_yaml import ConfigError, apply_overrides, read_yaml
from jaxstream.ranges import Seed, declared

T = TypeVar("T")

_CHOICES: dict[type, dict[str, type]] = {}


_MISSING = object()


# ----------------------------------------------------------------------------- choice registry
def register_choice(base: type, name: str, cls: type | None = None):
    """Register ``cls`` as the ``type: name`` variant of fields annotated with ``base``.

    ``cls`` must be a dataclass; it need not subclass ``base``. Usable as a decorator.

    Example:
        >>> @register_choice(EngineConfig, "local")
        ... @dataclasses.dataclass(frozen=True)
        ... class LocalEngineConfig: ...
    """

    def deco(c: type) -> type:
        if not dataclasses.is_dataclass(c):
            raise TypeError(f"register_choice: {c!r} is not a dataclass")
        table = _CHOICES.setdefault(base, {})
        if name in table and table[name] is not c:
            raise ConfigError(f"{base.__name__} choice {name!r} is already registered")
        table[name] = c
        return c

    return deco(cls) if cls is not None else deco


def choices(base: type) -> dict[str, type]:
    """The registered ``type:`` variants of a polymorphic base (name -> class)."""
    return dict(_CHOICES.get(base, {}))


def choice_name(base: type, value: Any) -> str:
    """The ``type:`` name under which ``value``'s class is registered for ``base``."""
    for name, cls in _CHOICES.get(base, {}).items():
        if type(value) is cls:
            return name
    raise ConfigError(f"{type(value).__name__} is not a registered {base.__name__} choice")


# ----------------------------------------------------------------------------- dict -> dataclass
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fmt(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _where(path: str) -> str:
    return path or "<config>"


def from_dict(cls: type[T], data: Any, path: str = "", default: Any = _MISSING) -> T:
    """Build dataclass ``cls`` from plain ``data``, checking every field's type.

    Args:
      cls: a dataclass or a base registered with :func:`register_choice`.
      data: a mapping (or an instance of ``cls``, returned as is).
      path: dotted prefix used in error messages.
      default: a default instance; keys absent from ``data`` keep its values.
    Returns:
      an instance of ``cls`` (or of the chosen registered variant).
    Raises:
      ValueError: naming the dotted field and the allowed keys / values / types.
    """
    return _convert(cls, data, path, default)


def _convert(tp: Any, value: Any, path: str, default: Any = _MISSING) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in args or type(value) is not type(_match(args, value)):
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{_where(path)}: {value!r} is not allowed; choose one of {allowed}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value, path, default)
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, path, default)
            except ValueError as e:
                errors.append(str(e))
        allowed = " or ".join(_fmt(a) for a in args)
        raise ConfigError(f"{_where(path)}: expected {allowed}, got {value!r} ({'; '.join(errors)})")
    if tp in _CHOICES:
        return _convert_choice(tp, value, path, default)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _convert_dataclass(tp, value, path, default)
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(path)}: expected a list ({_fmt(tp)}), got {value!r}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise ConfigError(f"{_where(path)}: expected {len(args)} items, got {len(value)}")
            items = [_convert(a, v, f"{path}.{i}") for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, f"{path}.{i}") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{_where(path)}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_convert(kt, k, f"{path}.{k}"): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{_where(path)}: expected float, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{_where(path)}: expected float, got {value!r}")
        if not math.isfinite(number):  # no field of a run means anything at NaN or ±inf
            raise ConfigError(f"{_where(path)}: expected a finite number, got {value!r}")
        return number
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{_where(path)}: expected int, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{_where(path)}: expected bool (true/false), got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{_where(path)}: expected str, got {value!r}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{_where(path)}: expected {_fmt(tp)}, got {value!r}")
    raise TypeError(f"{_where(path)}: unsupported annotation {tp!r}")


def _match(args: tuple, value: Any) -> Any:
    for a in args:
        if a == value and type(a) is type(value):
            return a
    return object()


def _convert_choice(base: type, value: Any, path: str, default: Any) -> Any:
    table = _CHOICES[base]
    if isinstance(value, tuple(table.values())):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_where(path)}: expected a mapping with a 'type' key, got {value!r}")
    value = dict(value)
    name = value.pop("type", None)
    if name is None:
        if default is _MISSING or default is None:
            raise ConfigError(f"{_where(path)}.type: missing; choose one of {sorted(table)}")
        name = choice_name(base, default)
    if name not in table:
        raise ConfigError(
            f"{_where(path)}.type: {name!r} is not registered; choose one of {sorted(table)} "
            "(a type of your own is registered by a plugin: jaxstream run ... --plugin MODULE)"
        )
    cls = table[name]
    keep = default if type(default) is cls else _MISSING
    try:
        return _convert_dataclass(cls, value, path, keep)
    except ConfigError as e:
        if "unknown key" not in str(e) or not dataclasses.is_dataclass(cls):
            raise
        # Typically ``section.type=NEW`` given as an override: the file's other keys of the
        # section were written for its old type and still apply. Say how to switch types.
        raise ConfigError(f"{e}; to switch {_where(path)} to type {name!r}, give the whole "
                          f"section, e.g. {_where(path)}={{type: {name}}} (the keys written "
                          "for another type do not carry over)") from None


#: Old spellings of config keys: refused with one line naming the new one.
RENAMED = {"num_microbatches": "micro_batches", "num_micro_batches": "micro_batches"}


def _convert_dataclass(cls: type, value: Any, path: str, default: Any) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_where(path)}: expected a mapping for {cls.__name__}, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in value if k not in fields]
    if unknown:
        prefix = f"{path}." if path else ""
        new = RENAMED.get(unknown[0])
        if new in fields:
            raise ConfigError(f"{prefix}{unknown[0]}: renamed {new} (one spelling of the "
                              f"micro-batch count everywhere); write {prefix}{new}: "
                              f"{value[unknown[0]]!r}")
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key for {cls.__name__}; allowed keys: "
            f"{', '.join(fields)}"
        )
    hints = _hints(cls)
    kwargs = {}
    _check_seeds(cls, value, fields, path)
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        fdefault = _MISSING
        if default is not _MISSING and default is not None:
            fdefault = getattr(default, name)
        elif f.default is not dataclasses.MISSING:
            fdefault = f.default
        elif f.default_factory is not dataclasses.MISSING:
            fdefault = f.default_factory()
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], sub, fdefault)
        elif fdefault is not _MISSING:
            kwargs[name] = fdefault
        else:
            raise ConfigError(f"{sub}: required field is missing ({_fmt(hints[name])})")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e)
        head = msg.split(":", 1)[0].split(".", 1)[0]
        if path and head in fields:
            msg = f"{path}.{msg}"  # "num_tangents: ..." -> "arms.0.estimator.num_tangents: ..."
        elif not (path and msg.startswith(path)) and head not in fields:
            msg = f"{_where(path)}: {msg}"
        raise ConfigError(msg) from e


SEED_RANGE = typing.get_args(Seed)[1]  # what both JAX keys and NumPy generators take


def _check_seeds(cls: type, value: Mapping, fields: Mapping, path: str) -> None:
    """A field named ``seed`` or ``*_seed`` that declares no range (a plugin's section) is a
    seed all the same: an integer in ``SEED_RANGE``, checked before any run directory or
    compute (declared fields are checked by :func:`jaxstream.ranges.check_fields`)."""
    ranges = declared(cls)
    for name in fields:
        v = value.get(name)
        if (name == "seed" or name.endswith("_seed")) and ranges[name][1] is None \
                and isinstance(v, int) and not isinstance(v, bool) and v not in SEED_RANGE:
            sub = f"{path}.{name}" if path else name
            raise ConfigError(f"{sub}: must be {SEED_RANGE}, got {v}")


# ----------------------------------------------------------------------------- dataclass -> dict
def to_dict(cfg: Any) -> Any:
    """Plain YAML-friendly data of a config (polymorphic sections get their ``type:`` key)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        out: dict[str, Any] = {}
        name = registered_name(cfg)
        if name is not None:
            out["type"] = name
        for f in dataclasses.fields(cfg):
            if f.init:
                out[f.name] = to_dict(getattr(cfg, f.name))
        return out
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def registered_name(cfg: Any) -> str | None:
    """The ``type:`` name a polymorphic section was registered under (None if none)."""
    for table in _CHOICES.values():
        for name, cls in table.items():
            if type(cfg) is cls:
                return name
    return None


def dump_yaml(cfg: Any, extra: Mapping[str, Any] | None = None) -> str:
    """The resolved config as YAML text (``extra`` keys, e.g. ``kind``, come first)."""
    data = dict(extra or {})
    data.update(to_dict(cfg))
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def load_config(
    cls: type[T],
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Iterable[str] = (),
) -> T:
    """Load a typed config from a YAML file (or mapping) plus dotted ``key=value`` overrides.

    Args:
      cls: the config dataclass.
      source: a YAML path, an already-parsed mapping, or None for the defaults.
      overrides: strings like ``"optimizer.lr=0.01"``; values are parsed as YAML scalars.
    Returns:
      a validated instance of ``cls``.
    Raises:
      ValueError: an unknown key or a bad value, naming the dotted field.

    Example:
        >>> cfg = load_config(TrainConfig, "experiments/quickstart.yaml", ["steps=10"])
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_yaml(source)
    data = apply_overrides(data, overrides)
    return from_dict(cls, data)


def diff_configs(a: Any, b: Any, ignore: Iterable[str] = ()) -> list[str]:
    """Dotted names of the fields where two configs differ (for checking a resumed run)."""
    skip = set(ignore)
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if path in skip:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in list(x) + [k for k in y if k not in x]:
                walk(x.get(k, _MISSING), y.get(k, _MISSING), f"{path}.{k}" if path else str(k))
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}.{i}")
        elif x != y:
            out.append(path or "<config>")

    walk(to_dict(a), to_dict(b), "")
    return out
