"""Naming and TensorStore specs of a store: one zarr3 array per pytree leaf.

Why: a leaf maps to one array whose layer axis is chunked one layer per chunk, with a
large uncompressed chunk per layer tensor (tiny or compressed chunks read slowly), and a
context with raised ``file_io_concurrency`` and no cache pool (weights are read once per
step, so caching them only costs memory).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np
import tensorstore as ts

KvSpec = str | os.PathLike | dict

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def leaf_names(tree: Any) -> list[str]:
    """Returns a stable, file-safe name per leaf of ``tree`` (in flatten order).

    Example: ``leaf_names({"w": 1, "b": {"x": 2}}) == ["b.x", "w"]``.
    """
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for p in path:
            if isinstance(p, jax.tree_util.DictKey):
                parts.append(str(p.key))
            elif isinstance(p, jax.tree_util.SequenceKey):
                parts.append(str(p.idx))
            elif isinstance(p, jax.tree_util.GetAttrKey):
                parts.append(p.name)
            else:
                parts.append(str(getattr(p, "key", p)))
        names.append(_SAFE.sub("_", ".".join(parts)) or "leaf")
    if len(set(names)) != len(names):
        names = [f"{i:04d}.{n}" for i, n in enumerate(names)]
    return names


def make_context(file_io_concurrency: int = 64, file_io_sync: bool = True) -> ts.Context:
    """Returns the store's TensorStore context: raised I/O concurrency, no cache pool.

    Args:
      file_io_concurrency: concurrent file reads/writes (TensorStore's default is low).
      file_io_sync: fsync every chunk write (needed for durability across power loss).
    """
    return ts.Context(
        {
            "file_io_concurrency": {"limit": int(file_io_concurrency)},
            "file_io_sync": bool(file_io_sync),
            "cache_pool": {"total_bytes_limit": 0},
            "data_copy_concurrency": {"limit": max(4, os.cpu_count() or 1)},
        }
    )


def kvstore_spec(location: KvSpec) -> Any:
    """Turns a path, a TensorStore kvstore URL or a kvstore JSON spec into a kvstore spec.

    A plain path is a local ``file`` kvstore (the default); ``"memory://"``, ``"file:///x/"``
    and dicts such as ``{"driver": "file", "path": "/nvme/run"}`` are passed through.
    """
    if isinstance(location, dict):
        spec = dict(location)
        if "path" in spec and spec["path"] and not str(spec["path"]).endswith("/"):
            spec["path"] = str(spec["path"]) + "/"
        return spec
    s = os.fspath(location)
    if "://" in s:
        return s if s.endswith("/") else s + "/"
    return {"driver": "file", "path": os.path.abspath(s) + "/"}


def open_kvstore(location: KvSpec, context: ts.Context) -> ts.KvStore:
    """Opens the root kvstore of a store."""
    return ts.KvStore.open(kvstore_spec(location), context=context).result()


def array_spec(shape: tuple[int, ...], chunk: tuple[int, ...], dtype: str,
               attributes: dict | None = None) -> dict:
    """Zarr3 metadata: regular chunks, raw little-endian bytes, no compression, and a crc32c
    checksum per chunk (a damaged chunk is an error on read, never wrong numbers); the
    ``attributes`` say what the array is (readable by plain zarr or tensorstore)."""
    return {**({"attributes": attributes} if attributes else {}),
        "shape": list(shape),
        "data_type": str(np.dtype(dtype)),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "fill_value": False if np.dtype(dtype) == np.bool_ else 0,  # zarr3: a bool's is a bool
    }


def open_array(
    root: ts.KvStore,
    key: str,
    context: ts.Context,
    *,
    create: bool = False,
    shape: tuple[int, ...] = (),
    chunk: tuple[int, ...] = (),
    dtype: str = "float32",
    attributes: dict | None = None,
) -> ts.TensorStore:
    """Opens (or creates) the zarr3 array stored under ``key`` of ``root``.

    A missing chunk is an error on read (``fill_missing_data_reads: false``), not zeros;
    chunks equal to the fill value are written too, so a written chunk is never missing.
    """
    spec: dict = {"driver": "zarr3", "kvstore": (root / (key.rstrip("/") + "/")).spec().to_json(),
                  "fill_missing_data_reads": False, "store_data_equal_to_fill_value": True}
    if create:
        spec["metadata"] = array_spec(shape, chunk, dtype, attributes)
        return ts.open(spec, create=True, delete_existing=True, context=context).result()
    return ts.open(spec, open=True, context=context).result()


def write_group(root: ts.KvStore, key: str, attributes: dict | None = None) -> None:
    """A zarr3 group node (``KEY/zarr.json``), so ``zarr.open_group`` walks the store."""
    meta = {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    name = f"{key.strip('/')}/zarr.json" if key.strip("/") else "zarr.json"
    root.write(name, json.dumps(meta).encode()).result()
