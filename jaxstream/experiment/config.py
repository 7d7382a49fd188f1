"""Typed experiment configs: YAML + dotted overrides -> frozen dataclasses, and back to YAML.

A config is any (nested) frozen dataclass, read by pydantic v2: :func:`from_dict` checks every
value against the field's type hint and raises a ``ValueError`` naming the dotted field and
what is allowed, so a bad experiment fails before any compute starts. Scalars are read by
jaxstream's rules (``steps: true`` is refused, not read as 1;
:mod:`jaxstream.experiment.config_schema`). Polymorphic sections (an ``engine:``, a
``model:``) are chosen by a ``type:`` key among the classes registered for the field's base
class with :func:`register_choice` (pydantic's tagged union, rebuilt as plugins register).
A section given in part keeps the rest of its default instance.

Supported field types: whatever pydantic reads (``int``, ``float``, ``str``, ``bool``,
``Literal[...]``, ``X | None``, tuples, lists, ``dict[str, X]``, ``Any``, nested dataclasses),
registered polymorphic bases, and any other class, checked by ``isinstance``.

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
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml
from pydantic_core import SchemaValidator
from pydantic_core import core_schema as cs

from jaxstream.experiment import config_schema as sch
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
        _VERSION[0] += 1
        if "__get_pydantic_core_schema__" not in vars(base):
            base.__get_pydantic_core_schema__ = classmethod(_choice_schema)
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


def plugin_call(section: str, base: type, cfg: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` for a section's ``cfg``; an error a plugin's class (one defined outside
    jaxstream) raises on its values becomes one line naming the section, its type and its
    fields (a plugin that declares no range for a field fails inside its own code)."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as e:
        if type(cfg).__module__.split(".")[0] == "jaxstream":
            raise
        name = choice_name(base, cfg) if type(cfg) in _CHOICES.get(base, {}).values() else "?"
        fields = ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg))
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"{section}: the plugin's {section} type {name!r} failed on its "
                          f"values ({fields}): {type(e).__name__}: {first}; check these fields "
                          f"(a plugin declares each field's range with jaxstream.ranges)") from e


# ----------------------------------------------------------------------------- dict -> dataclass
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Any, path: str = "", default: Any = _MISSING) -> T:
    """Build dataclass ``cls`` from plain ``data``, checking every field's type (by pydantic,
    with jaxstream's scalar rules: :mod:`jaxstream.experiment.config_schema`).

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
    data = _fill(cls, data, default, path)
    try:
        return _validator(cls, _VERSION[0]).validate_python((data,))[0]
    except pydantic.ValidationError as e:
        raise ConfigError(_message(cls, e.errors(), path)) from None
    except TypeError as e:  # a section's own check that raised TypeError
        raise ConfigError(f"{sch.where(path)}: {e}") from None


_VERSION = [0]  # bumped by each registration: validators built before are rebuilt


@functools.lru_cache(maxsize=64)
def _validator(cls: type, version: int) -> SchemaValidator:
    adapter = pydantic.TypeAdapter(tuple[cls], config=sch.CONFIG)
    return SchemaValidator(sch.strict_scalars(adapter.core_schema))


def _choice_schema(base: type, source: Any, handler: Any) -> Any:
    """pydantic's schema of a registered base: the ``type:`` key picks the variant (every
    registered one, plugins' too); an instance of a variant is taken as it is."""
    if base not in _CHOICES:  # a variant that subclasses its base: a dataclass of its own
        return handler(source)
    table = _CHOICES[base]
    variants = {name: cs.no_info_before_validator_function(_drop_type,
                                                           handler.generate_schema(c))
                for name, c in table.items()}
    union = cs.tagged_union_schema(variants, discriminator="type")
    instances = tuple(table.values())

    def choose(value: Any, inner: Any) -> Any:
        if isinstance(value, instances):
            return value
        if not isinstance(value, Mapping):
            # pydantic reports a ValueError (a TypeError would escape it)
            raise ValueError(f"expected a mapping with a 'type' key, got {value!r}")  # noqa: TRY004
        name = value.get("type")
        if name is None:
            raise ValueError(f".type: missing; choose one of {sorted(table)}")
        if name not in table:
            raise ValueError(
                f".type: {name!r} is not registered; choose one of {sorted(table)} "
                "(a type of your own is registered by a plugin: jaxstream run ... --plugin "
                "MODULE)")
        return inner(value)

    return cs.no_info_wrap_validator_function(choose, union)


def _drop_type(value: Any) -> Any:
    return {k: v for k, v in value.items() if k != "type"} if isinstance(value, Mapping) \
        else value


def _fill(tp: Any, value: Any, default: Any = _MISSING, path: str = "") -> Any:
    """``value`` with a default's values for the keys it leaves out: a section given in part
    keeps the rest of its default instance (its type too, for a section chosen by ``type:``);
    without one, its class's defaults. Also refuses an old spelling and a plugin's undeclared
    seed out of range, as the keys are read."""
    tp = sch.strip(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        items = args[:len(value)] if origin is tuple and Ellipsis not in args else \
            [args[0] if args else Any] * len(value)
        return [_fill(t, v, _MISSING, f"{path}.{i}") for i, (t, v) in enumerate(zip(items, value))
                ] + list(value[len(items):])
    if origin is dict and isinstance(value, Mapping) and args:
        return {k: _fill(args[1], v, _MISSING, f"{path}.{k}") for k, v in value.items()}
    if not isinstance(value, Mapping):
        return value
    keep = default if dataclasses.is_dataclass(default) and not isinstance(default, type) \
        else None
    if tp in _CHOICES:
        table = _CHOICES[tp]
        name = value.get("type")
        if name is None and keep is not None and type(keep) in table.values():
            name = choice_name(tp, keep)
        cls = table.get(name)
        if cls is None:
            return value  # the choice's own check names what is allowed
        return {"type": name, **_fill_fields(cls, _drop_type(value),
                                             keep if type(keep) is cls else None, path)}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _fill_fields(tp, value, keep if isinstance(keep, tp) else None, path)
    return value


def _fill_fields(cls: type, value: Mapping, default: Any, path: str) -> dict:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _check_renamed(value, fields, path)
    _check_seeds(cls, value, fields, path)
    out = dict(value)
    for name, f in fields.items():
        if default is not None:
            d = getattr(default, name)
        elif f.default is not dataclasses.MISSING:
            d = f.default
        elif f.default_factory is not dataclasses.MISSING:
            d = f.default_factory()
        else:
            d = _MISSING
        if name in out:
            out[name] = _fill(_hints(cls)[name], out[name], d, f"{path}.{name}" if path else name)
        elif default is not None:
            out[name] = d
    return out


def _check_renamed(value: Mapping, fields: Mapping, path: str) -> None:
    """An old spelling of a key, the first key the section does not have, is refused by its
    new name (other unknown keys: pydantic's ``extra="forbid"``)."""
    unknown = [k for k in value if k not in fields]
    new = RENAMED.get(unknown[0]) if unknown else None
    if new in fields:
        prefix = f"{path}." if path else ""
        raise ConfigError(f"{prefix}{unknown[0]}: renamed {new} (one spelling of the "
                          f"micro-batch count everywhere); write {prefix}{new}: "
                          f"{value[unknown[0]]!r}")


def _message(cls: type, errors: list[dict], path: str) -> str:
    """One line for pydantic's errors: the first a user would meet, at its dotted field."""
    return _line(cls, sch.first_error(errors), errors, path)


def _line(cls: type, err: dict, errors: list[dict], path: str, member: bool = False) -> str:
    """``err`` as one line (``member``: one union member's reason, not the union's)."""
    loc = tuple(err["loc"][1:])  # past the tuple the config is validated in
    at = sch.locate(cls, loc, path, _CHOICES, _hints)
    if at.union is not None and not member:  # every member refused it: each one's reason
        head = err["loc"][:at.union + 1]
        members = [e for e in errors if e["loc"][:at.union + 1] == head
                   and len(e["loc"]) > at.union + 1]
        numeric = [e for e in members if e["type"] == "value_error" and any(
            r in str(e["ctx"]["error"]) for r in sch.NUMBER_REFUSALS)]
        if numeric and isinstance(numeric[0].get("input"), float):  # a number out of range:
            return _line(cls, numeric[0], errors, path, member=True)  # the float rule's reason
        union = sch.locate(cls, loc[:at.union], path, _CHOICES, _hints)
        allowed = " or ".join(sch.fmt(a) for a in typing.get_args(union.hint))
        each = "; ".join(_line(cls, e, errors, path, member=True) for e in members)
        given = next((e for e in members if len(e["loc"]) == at.union + 2), members[0])
        return f"{union.path}: expected {allowed}, got {given.get('input')!r} ({each})"
    parent = sch.locate(cls, loc[:-1], path, _CHOICES, _hints) if loc else at
    sized = [e for e in errors if e["loc"][:len(err["loc"]) - 1] == err["loc"][:-1]
             and e["type"] == "missing"] if loc and isinstance(loc[-1], int) else []
    if err["type"] == "too_long" or (sized and typing.get_origin(parent.tp) is tuple):
        tup = at if err["type"] == "too_long" else parent
        return (f"{tup.path}: expected {len(typing.get_args(tup.tp))} items, "
                f"got {len((sized or [err])[0]['input'])}")
    section = at.tp if err["type"] == "value_error" else at.owner
    fields = [f.name for f in dataclasses.fields(section) if f.init] \
        if dataclasses.is_dataclass(section) else []
    out = sch.message(err, at, dict.fromkeys(fields))
    if err["type"] in sch.UNKNOWN and _other_types_key(at.owner, loc[-1] if loc else None):
        # a key written for another type of a section chosen by its type: how to switch
        for where, tag in reversed(at.choices):
            out += (f"; to switch {sch.where(where)} to type {tag!r}, give the whole section, "
                    f"e.g. {sch.where(where)}={{type: {tag}}} (the keys written for another "
                    "type do not carry over)")
    return out


def _other_types_key(section: type | None, key: Any) -> bool:
    """Whether ``key``, unknown to ``section``, is a key of another type of its section (the
    type was switched, so a switch hint fits; a typo gets none)."""
    table = next((t for t in _CHOICES.values() if section in t.values()), {})
    return any(key in {f.name for f in dataclasses.fields(c)} for c in table.values()
               if c is not section and dataclasses.is_dataclass(c))


#: Old spellings of config keys: refused with one line naming the new one.
RENAMED = {"num_microbatches": "micro_batches", "num_micro_batches": "micro_batches"}

SEED_RANGE = typing.get_args(Seed)[1]  # what both JAX keys and NumPy generators take


def _check_seeds(cls: type, value: Mapping, fields: Mapping, path: str = "") -> None:
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
