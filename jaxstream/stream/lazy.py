"""Lazy forward-gradient updates: a layer's update is (step key, scalars), applied on next read.

A forward-gradient update of a layer is fully described by the step's key and the K
coefficients of its tangents, so instead of a second sweep that re-reads every layer after
the step, the (key, coefficients) record is committed with the step and applied when the
layer is next read (then written back with that step). :func:`encode`/:func:`decode` turn
records into JSON committed in the store's manifest, so pending updates survive a crash
together with the parameters they belong to; :func:`pack` commits each step's record once,
with the layers waiting for it naming it by index (a record waits for every layer the step
did not rewrite, so repeating it per layer grew the manifest with depth × records waiting).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

Record = tuple[np.ndarray, np.ndarray]  # (raw key data uint32, coefficients (N, K) float32)


def encode(key: jax.Array, coeffs: np.ndarray, key_data: np.ndarray | None = None) -> dict:
    """JSON form of one update record (exact: float32 values round-trip through repr);
    ``key_data``: the key's raw data if already read (else read here)."""
    data = np.asarray(jax.random.key_data(key) if key_data is None else key_data, np.uint32)
    return {"key": data.tolist(), "impl": str(jax.random.key_impl(key)),
            "coeffs": np.asarray(coeffs, np.float32).tolist(), "shape": list(np.shape(coeffs))}


def decode(rec: dict) -> tuple[jax.Array, np.ndarray]:
    """Inverse of :func:`encode`: ``(typed key, coeffs)``."""
    key = jax.random.wrap_key_data(np.asarray(rec["key"], np.uint32), impl=rec["impl"])
    coeffs = np.asarray(rec["coeffs"], np.float32).reshape(rec["shape"])
    return key, coeffs


def add(pending: dict, units: list, key: jax.Array, coeffs: np.ndarray,
        key_data: np.ndarray | None = None) -> dict:
    """Appends the record to every unit in ``units`` (pending: {str(unit): [records]})."""
    out = {k: list(v) for k, v in pending.items()}
    rec = encode(key, coeffs, key_data)
    for u in units:
        out.setdefault(str(u), []).append(rec)
    return out


def take(pending: dict, unit: Any) -> list[dict]:
    """Records waiting for ``unit`` (in order)."""
    return list(pending.get(str(unit), []))


# Fields of a record that belong to one unit (a deferred combine's carry slot and its crc32c;
# "seen": applied to the unit on a read that did not write it back, so a commit's guard has
# judged its effect); the rest of the record is the step's, the same for every unit waiting.
PER_UNIT = ("slot", "crc", "seen")


def pack(pending: dict, fresh: dict | None = None, since: int | None = None) -> dict:
    """The committed form of ``pending`` ({unit: [records]}): ``{"records": [each distinct
    step's part of a record once, in first-seen order], "waiting": {unit: [entries]}}``, an
    entry the index of its record, or ``[index, {its own fields}]`` for a record with fields
    of its unit (:data:`PER_UNIT`); ``{}`` when nothing waits. Records are told apart by their
    JSON, so a record read back from an earlier commit and the same record of this step are
    one. ``fresh`` (the step's new records, among ``pending``'s) and ``since`` (the store's
    step before it) add ``"fresh": {"records": [their indices], "since": since}``: what
    :func:`drop_fresh` takes back."""
    records: list[dict] = []
    index: dict[str, int] = {}
    by_id: dict[int, int] = {}  # a record object shared by units (one step's) is read once
    waiting: dict[str, list] = {}
    for unit, recs in pending.items():
        for rec in recs:
            i = by_id.get(id(rec))
            if i is None:
                body = {k: v for k, v in rec.items() if k not in PER_UNIT}
                i = index.setdefault(json.dumps(body, sort_keys=True), len(records))
                if i == len(records):
                    records.append(body)
                by_id[id(rec)] = i
            own = {k: rec[k] for k in PER_UNIT if k in rec}
            waiting.setdefault(str(unit), []).append([i, own] if own else i)
    if not waiting:
        return {}
    out: dict = {"records": records, "waiting": waiting}
    new = sorted({by_id[id(r)] for v in (fresh or {}).values() for r in v if id(r) in by_id})
    if new and since is not None:
        out["fresh"] = {"records": new, "since": int(since)}
    return out


def drop_fresh(committed: dict) -> tuple[dict, int | None]:
    """A committed ``pending`` without the records its step made (:func:`pack`'s ``fresh``)
    and the step before them; ``(committed, None)`` when it names none. The way back from a
    diverging deferred update: those records are the update, so the store returns to the
    step before it, as an eager store would."""
    fresh = committed.get("fresh")
    if not fresh:
        return committed, None
    drop = set(fresh["records"])
    index = lambda e: e[0] if isinstance(e, list) else e
    left = {u: [e for e in es if index(e) not in drop] for u, es in committed["waiting"].items()}
    left = {u: es for u, es in left.items() if es}
    return ({"records": committed["records"], "waiting": left} if left else {}), int(fresh["since"])


def unjudged(committed: dict, units: list[str]) -> list[str]:
    """Of ``units`` (store keys: ``"embed"``, ``"head"``, ``"blocks/3"``), those for which the
    committed ``pending`` holds a record older than its own step's (:func:`pack`'s ``fresh``)
    that no guard has judged on that unit: one a depth policy's skipped layer kept waiting
    since an earlier step. A divergence found when it was applied may be that record's."""
    fresh = set((committed.get("fresh") or {}).get("records", []))
    out = []
    for key in units:
        entries = (committed.get("waiting") or {}).get(key.split("/")[-1], [])
        if any((e[0] if isinstance(e, list) else e) not in fresh
               and not (isinstance(e, list) and e[1].get("seen")) for e in entries):
            out.append(key)
    return out


def unpack(committed: dict) -> dict:
    """Inverse of :func:`pack`: {unit: [records]}. A manifest written before records were
    shared (``{unit: [records]}``) is read as it is."""
    if "records" in committed and "waiting" in committed:
        recs = committed["records"]
        entry = lambda e: {**recs[e[0]], **e[1]} if isinstance(e, list) else recs[e]
        return {unit: [entry(e) for e in es] for unit, es in committed["waiting"].items()}
    return {unit: list(v) for unit, v in committed.items()}


def waiting(extra: dict) -> dict:
    """The records waiting per unit in a store's committed ``extra`` (its ``"pending"``)."""
    return unpack(extra.get("pending", {}))
