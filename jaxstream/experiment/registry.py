"""Experiment kinds: the top-level ``kind:`` of a YAML file picks what runs.

A kind pairs a frozen config dataclass with a ``run(config, run_dir) -> summary`` function.
``train`` is built in (:mod:`jaxstream.experiment.train`); other packages register theirs from
the experiment layer's modules, which :mod:`jaxstream.experiment.builtin` imports
explicitly (the library packages never import the experiment layer). A user's own modules register the same way: named
with ``jaxstream run CONFIG --plugin MODULE`` or, for an installed package, as an entry point of
the group ``jaxstream.plugins`` (the entry point names a module, or a function called once).

Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class StudyConfig:
    ...     seed: int = 0
    >>> @register_experiment("study", StudyConfig)
    ... def run_study(cfg: StudyConfig, run_dir: Path) -> dict:
    ...     return {"seed": cfg.seed}
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from jaxstream.experiment.config import ConfigError, apply_overrides, from_dict, read_yaml

DEFAULT_KIND = "train"


class Experiment(NamedTuple):
    """A registered experiment kind."""

    kind: str
    config_cls: type
    run: Callable[[Any, Path], dict]


_EXPERIMENTS: dict[str, Experiment] = {}


def register_experiment(kind: str, config_cls: type,
                        run: Callable[[Any, Path], dict] | None = None) -> Any:
    """Decorator: ``run`` becomes experiment ``kind`` (the YAML's top-level ``kind:``), its
    config class ``config_cls``.

    Args:
      kind: the name used in YAML files.
      config_cls: a frozen dataclass holding every other top-level key of the YAML.
      run: given here, ``register_experiment(kind, config_cls, run)`` registers at once (the
        older form, still accepted). ``run(config, run_dir) -> summary dict`` writes its results
        under ``run_dir`` (a directory that exists and already holds ``config.yaml`` and
        ``env.json``); it may accept the keyword ``resume: bool`` to continue from checkpoints
        in ``run_dir``.
    Returns:
      the decorator (which returns ``run`` unchanged); ``run``, in the older form.

    Example:
        >>> @register_experiment("study", StudyConfig)
        ... def run_study(cfg: StudyConfig, run_dir: Path) -> dict:
        ...     return {"seed": cfg.seed}
    """
    if not (dataclasses.is_dataclass(config_cls) and isinstance(config_cls, type)):
        raise TypeError(f"register_experiment({kind!r}): config_cls must be a dataclass class")

    def deco(fn: Callable[[Any, Path], dict]) -> Callable[[Any, Path], dict]:
        if not callable(fn):
            raise TypeError(f"register_experiment({kind!r}): run must be callable, got {fn!r}")
        old = _EXPERIMENTS.get(kind)
        # Re-registering the same objects (module re-import) is fine; a clash is not.
        if old is not None and old.config_cls.__qualname__ != config_cls.__qualname__:
            raise ConfigError(f"experiment kind {kind!r} is already registered")
        _EXPERIMENTS[kind] = Experiment(kind, config_cls, fn)
        return fn

    return deco if run is None else deco(run)


def experiment_kinds() -> list[str]:
    """Names of the registered kinds (after :func:`load_plugins`)."""
    load_plugins()
    return sorted(_EXPERIMENTS)


def get_experiment(kind: str) -> Experiment:
    """The registered kind ``kind``; a ValueError lists the known kinds otherwise."""
    load_plugins()
    if kind not in _EXPERIMENTS:
        raise ConfigError(f"kind: {kind!r} is not a registered experiment kind; choose one of "
                         f"{sorted(_EXPERIMENTS)}")
    return _EXPERIMENTS[kind]


#: Entry-point group of installed packages that register datasets, models, optimizers,
#: engines or experiment kinds (``[project.entry-points."jaxstream.plugins"]``).
ENTRY_POINT_GROUP = "jaxstream.plugins"

_LOADED = False
_IMPORTED: set[str] = set()


def load_plugins(extra: Iterable[str] = (), entry_points: bool = True) -> None:
    """Register the library's kinds and engines (:mod:`jaxstream.experiment.builtin`) and a
    user's plugins.

    Args:
      extra: a user's modules (``jaxstream run --plugin MODULE``); each must import.
      entry_points: also load every entry point of the group ``jaxstream.plugins`` (except
        those named in ``JAXSTREAM_SKIP_PLUGINS``); one that fails to load is refused naming
        it, its package and the import error.

    Example (a plugin module ``my_data.py`` adding a dataset)::

        import dataclasses
        from jaxstream.experiment.plugins import DataConfig, Dataset, register_dataset

        @register_dataset("my_data")
        @dataclasses.dataclass(frozen=True)
        class MyData(DataConfig):
            test_fraction: float = 0.2

            def load(self, seed: int) -> Dataset:
                ...  # train / test dicts of numpy arrays and info (in_dim, num_classes)

        # jaxstream run cfg.yaml --plugin my_data data.type=my_data
    """
    global _LOADED
    if not _LOADED:
        from jaxstream.experiment import builtin  # noqa: F401  (registers on import)

        if entry_points:
            _load_entry_points()  # a broken one is refused again on the next call
        _LOADED = True
    for name in extra:
        if name in _IMPORTED:
            continue
        _import_plugin(name)
        _IMPORTED.add(name)


def _import_plugin(name: str) -> None:
    """Import a ``--plugin`` module; a bad name or a module that fails to import is refused in
    one line naming it and the error (the plugin's bug, not ours: no traceback)."""
    if not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"--plugin {name}: not a module name; allowed: a dotted Python module "
                          "name (e.g. my_plugin or my_pkg.plugin) whose folder is on PYTHONPATH")
    try:
        importlib.import_module(name)
    except ConfigError:  # a refused registration already names what clashed
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(f"--plugin {name}: no module named {e.name!r} (is it installed "
                              "or on PYTHONPATH?)") from e
        raise ConfigError(f"--plugin {name}: failed to import: {_one_line(e)}") from e
    except Exception as e:
        raise ConfigError(f"--plugin {name}: failed to import: {_one_line(e)} (python -c "
                          f"'import {name}' shows the traceback)") from e


def _one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (with file and line of a SyntaxError)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


#: Environment variable: entry points (names, comma-separated) that ``load_plugins`` skips.
SKIP_ENV = "JAXSTREAM_SKIP_PLUGINS"


def _load_entry_points() -> None:
    import os
    from importlib.metadata import entry_points

    skip = {n.strip() for n in os.environ.get(SKIP_ENV, "").split(",") if n.strip()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.value in _IMPORTED or ep.name in skip:
            continue
        try:
            obj = ep.load()  # importing the module registers; a callable is called once
            if callable(obj) and not isinstance(obj, type):
                obj()
        except Exception as e:  # a broken installed package must not look like our bug
            dist = getattr(getattr(ep, "dist", None), "name", None)
            lines = str(e).strip().splitlines()
            why = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
            raise ConfigError(
                f"plugin entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP}"
                + (f", package {dist}" if dist else "") + f") failed to load: {why}; fix or "
                f"uninstall it" + (f" (pip uninstall {dist})" if dist else "")
                + f", or skip it: {SKIP_ENV}={ep.name}") from e
        _IMPORTED.add(ep.value)


def load_experiment(
    source: str | Path | Mapping[str, Any], overrides: Iterable[str] = ()
) -> tuple[str, Any]:
    """Parse an experiment YAML (or mapping) + dotted overrides into ``(kind, config)``.

    ``kind`` defaults to ``train``; it can itself be overridden (``kind=grad_quality``).
    Raises ValueError naming the field on unknown keys or bad values, before any compute.
    """
    data = dict(source) if isinstance(source, Mapping) else read_yaml(source)
    data = apply_overrides(data, overrides)
    kind = data.pop("kind", DEFAULT_KIND)
    if not isinstance(kind, str):
        raise ConfigError(f"kind: expected a string, got {kind!r}")
    exp = get_experiment(kind)
    return kind, from_dict(exp.config_cls, data)
