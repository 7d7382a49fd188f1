"""Config files as plain data: a YAML mapping read with every refusal naming the file (size,
nesting, syntax with its line, tags), and dotted ``key=value`` overrides applied to it. The
typed side (data -> frozen dataclasses) is :mod:`jaxstream.experiment.config`.

Example:
    >>> apply_overrides({"optimizer": {"lr": 0.1}}, ["optimizer.lr=0.01", "steps=5"])
    {'optimizer': {'lr': 0.01}, 'steps': 5}
"""

from __future__ import annotations

import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config key or value is not allowed; the message names the dotted field."""


MAX_CONFIG_BYTES = 1 << 20  # an experiment file is a few KiB
MAX_VALUES = 100_000  # values of a config with its YAML aliases expanded
MAX_DEPTH = 32  # nesting levels


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping gives the same key twice (YAML would keep the last one silently)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe loading that refuses a key given twice in one mapping (merge keys ``<<`` may still
    be overridden, as YAML means them to be)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in first:
                raise DuplicateKeyError(
                    None, None, f"key {key!r} is given twice in one mapping (first on line "
                    f"{first[key].line + 1}); give it once", key_node.start_mark)
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` of ``stream`` (text or a file), refusing a key given twice in one
    mapping (:class:`DuplicateKeyError`, a ``yaml.YAMLError`` with its line)."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)


def check_file(path: str | Path) -> None:
    """Refuse a config path that is not a regular file (a directory, a device such as
    ``/dev/zero``, a pipe: reading one may never end) or is larger than ``MAX_CONFIG_BYTES``,
    before it is read; and one that is not UTF-8 text."""
    st = Path(path).stat()
    if not stat.S_ISREG(st.st_mode):
        what = ("a directory" if stat.S_ISDIR(st.st_mode)
                else "not a regular file (a device, pipe or socket)")
        raise ConfigError(f"{path}: {what}; give the path of a YAML experiment file")
    size = st.st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size} bytes; an experiment file is at most "
                          f"{MAX_CONFIG_BYTES} bytes")
    try:
        Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(not_utf8(path, e)) from None


def not_utf8(path: str | Path, e: UnicodeDecodeError) -> str:
    """The one line for a config file that is not UTF-8 text: the file and the byte offset."""
    return (f"{path}: byte offset {e.start} (0x{e.object[e.start]:02x}) is not UTF-8; an "
            "experiment file is UTF-8 text")


def check_size(data: Any, where: str) -> None:
    """Refuse data that expands to more than ``MAX_VALUES`` values or nests deeper than
    ``MAX_DEPTH`` levels, before anything copies it: YAML aliases share one node, so a small
    file can stand for billions of values (each level of aliases multiplies them)."""
    sizes: dict[int, int] = {}

    def size(x: Any, depth: int) -> int:
        if not isinstance(x, (dict, list, tuple)):
            return 1
        if depth >= MAX_DEPTH:
            raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels (or a YAML alias "
                              "that contains itself)")
        if id(x) not in sizes:
            n = 1
            for v in (x.values() if isinstance(x, dict) else x):
                n += size(v, depth + 1)
                if n > MAX_VALUES:
                    raise ConfigError(f"{where}: more than {MAX_VALUES} values once its YAML "
                                      "aliases are expanded; a config holds at most that many")
            sizes[id(x)] = n
        return sizes[id(x)]

    if size(data, 0) > MAX_VALUES:
        raise ConfigError(f"{where}: more than {MAX_VALUES} values once its YAML aliases are "
                          "expanded; a config holds at most that many")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b.c=value"`` into (["a", "b", "c"], value parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.subkey=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r}: empty key component")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except DuplicateKeyError as e:
        raise ConfigError(f"override {key.strip()}: {e.problem}") from None
    except RecursionError:
        raise ConfigError(f"override {key.strip()}: nested deeper than YAML can read") from None
    except yaml.constructor.ConstructorError as e:
        if "yaml.org,2002:value" not in str(e):
            raise
        raise ConfigError(f"override {key.strip()}: {raw!r} is not a value (YAML reads a bare "
                          f"'=' as a tag); write {key.strip()}=VALUE with one '=', and quote a "
                          f"string that is '='") from None
    check_size(value, f"override {key.strip()}")
    return path, value


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a deep copy of ``data`` with dotted ``key=value`` overrides set.

    Missing intermediate sections are created; list items are addressed by index (``arms.0.lr``).
    """
    check_size(data, "config")
    out = _deepcopy(dict(data))
    for text in overrides:
        path, value = parse_override(text)
        node: Any = out
        for i, part in enumerate(path[:-1]):
            where = ".".join(path[: i + 1])
            if isinstance(node, list):
                node = node[_index(part, node, where)]
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"override {text!r}: {where} is a value, not a section")
        last = path[-1]
        if isinstance(node, list):
            node[_index(last, node, ".".join(path))] = value
        else:
            node[last] = value
    return out


def _index(part: str, node: list, where: str) -> int:
    try:
        i = int(part)
    except ValueError:
        raise ConfigError(f"{where}: a list index is needed here, got {part!r}") from None
    if not -len(node) <= i < len(node):
        raise ConfigError(f"{where}: index {i} out of range (list has {len(node)} items)")
    return i


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_deepcopy(v) for v in x]
    return x


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path``.

    An empty file (or only comments, or ``null``) is refused: it is more likely a mistake
    than a request for a default run, which ``kind: train`` asks for explicitly.

    A missing file, a YAML syntax error (with its line and column) or a tag that safe loading
    refuses (``!!python/...``) is a :class:`ConfigError` naming the file.
    """
    try:
        check_file(path)
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(not_utf8(path, e)) from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as e:
        raise ConfigError(f"{path}: cannot read the config file ({e})") from None
    try:
        data = load_yaml(text)
    except RecursionError:
        raise ConfigError(f"{path}: nested deeper than YAML can read (a config nests at most "
                          f"{MAX_DEPTH} levels)") from None
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark
        at = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise ConfigError(f"{path}:{at} {e.problem} (only plain YAML is read, no tags)") from None
    except DuplicateKeyError as e:
        mark = e.problem_mark
        raise ConfigError(f"{path}: line {mark.line + 1}, column {mark.column + 1}: "
                          f"{e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise ConfigError(f"{path}:{at} YAML syntax error: {getattr(e, 'problem', e)}") from None
    if data is None:
        raise ConfigError(f"{path} is empty: a config needs at least one key (for a default "
                          f"run write 'kind: train')")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data
