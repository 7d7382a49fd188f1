"""The layer store's ``manifest.json``: encoding with a checksum, schema validation.

The manifest is the store's commit record (step, slot table, leaf specs). It carries the
SHA-256 of its own canonical JSON, so a truncated, bit-flipped or hand-edited manifest is
refused (:class:`StoreCorruptError` naming the file and the field) instead of being trusted.

Example::

    data = encode(manifest)           # bytes, with "checksum"
    m = decode(data, "/nvme/run/manifest.json")
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from jaxstream.stream.errors import StoreCorruptError, StoreMismatchError, StoreNonFiniteError

MANIFEST = "manifest.json"
FORMAT = "jaxstream.layerstore/2"
PARTS = ("embed", "blocks", "head")


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def encode(manifest: dict) -> bytes:
    """Canonical JSON of ``manifest`` with its checksum; non-finite numbers are refused."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    try:
        digest = _digest(body)
    except ValueError as err:  # NaN / inf in the committed metadata (e.g. lazy coefficients)
        raise StoreNonFiniteError(f"{MANIFEST}: refusing to commit non-finite values ({err})") from err
    return json.dumps({**body, "checksum": digest}, sort_keys=True).encode()


def decode(data: bytes, file: str) -> dict:
    """Parses and validates manifest bytes read from ``file``."""
    try:
        m = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        where = f" (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
        raise StoreCorruptError(f"{file}: not valid JSON{where}: {err}; the store's commit record "
                                "is damaged") from err
    validate(m, file)
    return m


def _fail(file: str, field: str, msg: str) -> StoreCorruptError:
    return StoreCorruptError(f"{file}: field {field!r} {msg}")


def _int(m: dict, field: str, file: str, low: int) -> int:
    v = m.get(field)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise _fail(file, field, f"must be an integer >= {low}, got {v!r}")
    return v


def validate(m: Any, file: str) -> None:
    """Checks the manifest schema: format, checksum, step >= 0, slots in {0, 1}, leaf specs."""
    if not isinstance(m, dict):
        raise StoreCorruptError(f"{file}: must hold a JSON object, got {type(m).__name__}")
    if m.get("format") != FORMAT:
        hint = " (written by an older jaxstream: recreate the store)" if str(
            m.get("format", "")).startswith("jaxstream.layerstore/") else ""
        raise StoreMismatchError(f"{file}: field 'format' is {m.get('format')!r}, expected "
                                 f"{FORMAT!r}{hint}")
    body = {k: v for k, v in m.items() if k != "checksum"}
    try:
        digest = _digest(body)
    except ValueError:
        digest = None
    if m.get("checksum") != digest:
        raise _fail(file, "checksum", "does not match the content: the manifest was edited or "
                    "damaged")
    _int(m, "step", file, 0)
    _int(m, "generation", file, 0)
    n = _int(m, "num_layers", file, 1)
    for field in ("model_config", "extra", "leaves", "slots"):
        if not isinstance(m.get(field), dict):
            raise _fail(file, field, f"must be an object, got {type(m.get(field)).__name__}")
    slots = m["slots"]
    for part in ("embed", "head"):
        if slots.get(part) not in (0, 1) or isinstance(slots.get(part), bool):
            raise _fail(file, f"slots.{part}", f"must be 0 or 1, got {slots.get(part)!r}")
    blocks = slots.get("blocks")
    if not isinstance(blocks, list) or len(blocks) != n:
        raise _fail(file, "slots.blocks", f"must be a list of num_layers={n} slots, got {blocks!r}")
    for l, s in enumerate(blocks):
        if s not in (0, 1) or isinstance(s, bool):
            raise _fail(file, f"slots.blocks[{l}]", f"must be 0 or 1, got {s!r}")
    for kind in ("params", "opt"):
        table = m["leaves"].get(kind)
        if not isinstance(table, dict):
            raise _fail(file, f"leaves.{kind}", "must be an object")
        for part in PARTS:
            leaves = table.get(part)
            if not isinstance(leaves, list):
                raise _fail(file, f"leaves.{kind}.{part}", "must be a list of leaf specs")
            for i, e in enumerate(leaves):
                f = f"leaves.{kind}.{part}[{i}]"
                if not isinstance(e, dict) or not isinstance(e.get("name"), str):
                    raise _fail(file, f, "must be an object with a 'name'")
                shape = e.get("shape")
                if not isinstance(shape, list) or not all(
                        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                    raise _fail(file, f + ".shape", f"must be a list of sizes >= 0, got {shape!r}")
                try:
                    np.dtype(e.get("dtype"))
                except TypeError as err:
                    raise _fail(file, f + ".dtype", f"is not a dtype: {e.get('dtype')!r}") from err


def check_array(file: str, field: str, arr: Any, shape: tuple, dtype: str) -> None:
    """The array opened for a leaf must have the shape and dtype the manifest says."""
    if tuple(arr.shape) != tuple(shape) or np.dtype(arr.dtype.numpy_dtype) != np.dtype(dtype):
        raise _fail(file, field, f"says shape {list(shape)} {dtype}, the stored array has "
                    f"{list(arr.shape)} {arr.dtype.numpy_dtype}")
