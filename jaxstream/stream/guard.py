"""The divergence guard of a layer store: which commit is the last *sane* one.

A commit is sane when

* every parameter is finite (the store never stages non-finite values at all),
* the loss the step computed is finite (where the committer reports it: the stream engine
  commits ``loss_finite`` in the commit's metadata), and
* the parameters' global L2 norm is at most ``GROWTH`` (10) times ``max(1, norm of the last
  sane commit)``: no healthy optimizer step multiplies the norm of a whole model by ten (the
  floor of 1 lets a model initialised near zero grow), while a diverging one does at once
  (sgd at lr 2e38 takes an MLP's norm from ~10 to ~1e37 in one step). A store allocated with
  zeros (``LayerStore.create`` with ``jax.ShapeDtypeStruct`` leaves) has no bound on its first
  written commit.

The norm costs no read: each unit's squared norm is summed while its write is staged, and the
manifest keeps every unit's (``norms``). A store from before norms were kept reads the units it
does not know once. The manifest's ``sane`` record names the last sane commit; when a commit
fails the guard, that record keeps the sane commit's slots, digests and metadata, and the store
refuses to stage any further write (:class:`StoreDivergedError`): the next step would write
into the sane commit's slots. :meth:`LayerStore.rollback_to_sane` makes it current again.

A guard on the norm's growth cannot see a slow drift (a norm that grows 9× a step, or 1 % a
step for a thousand steps): only a jump, and non-finite values.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

GROWTH = 10.0


def _keys(m: dict) -> list[str]:
    return ["embed", "head", *[f"blocks/{l}" for l in range(int(m["num_layers"]))]]


def _unit(key: str) -> str | int:
    return int(key.split("/")[1]) if key.startswith("blocks/") else key


def leaf_sq(x: np.ndarray) -> float:
    """A host array's squared L2 norm (what the guard adds up per unit): one BLAS dot in
    float32 (float64 for float64 arrays), relative error about 1e-5 at 4 M entries against
    the guard's factor of 10, and 20x cheaper than squaring into a float64 copy (the write
    path runs it on every leaf of every update). Not finite iff some entry is not finite or
    float64's range is exceeded (an overflow in float32 is summed again in float64)."""
    v = np.ravel(x)
    if v.dtype != np.float64:
        v32 = v.astype(np.float32, copy=False)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow goes to float64
            s = float(np.dot(v32, v32))
        if not math.isinf(s):
            return s
        v = v.astype(np.float64)
    return float(np.dot(v, v))


def tree_sq(tree: Any) -> float:
    """The squared L2 norm of a pytree's float leaves (:func:`leaf_sq` summed)."""
    import jax

    leaves = (np.asarray(x) for x in jax.tree_util.tree_leaves(tree))
    return sum(leaf_sq(x) for x in leaves if np.issubdtype(x.dtype, np.inexact))


def guard_commit(store: Any, m: dict, staged: dict[str, float]) -> None:
    """Sets ``m["norms"]`` and ``m["sane"]`` for the commit ``m`` that ``store`` is about to
    make (``staged``: squared norms of the units this step wrote)."""
    old = store._m
    old_sane = old.get("sane")
    if old_sane is not None and "slots" in old_sane:  # a commit with no writes past a failed
        m["sane"] = old_sane                        # one (writes are refused): keep the target
        return
    known = dict(old.get("norms") or {})

    def committed(key: str) -> float:  # the unit's squared norm in the commit before this one
        if key not in known:
            known[key] = tree_sq(store.read(_unit(key)).result())
        return known[key]

    new = {}
    for key in _keys(m):
        if key in staged:
            new[key] = staged[key]
        elif key in store._staged:  # staged but its norm was not taken: read what was staged
            new[key] = tree_sq(store.read(_unit(key), staged=True).result())
        else:
            new[key] = committed(key)
    base = old_sane["norm"] if old_sane else math.sqrt(sum(committed(k) for k in _keys(m)))
    norm = math.sqrt(sum(new.values()))
    bound = GROWTH * max(1.0, base) if base > 0 else math.inf  # allocated, not yet written
    loss_ok = bool((m.get("extra") or {}).get("loss_finite", True))
    m["norms"] = new
    if "previous" in m:
        m["previous"]["norms"] = known if len(known) == len(new) else None
    if math.isfinite(norm) and norm <= bound and loss_ok:
        m["sane"] = {"step": int(m["step"]), "norm": norm}
        return
    m["sane"] = {"step": int(old["step"]), "norm": base,
                 **{k: old[k] for k in ("slots", "digests", "extra") if k in old},
                 "norms": known if len(known) == len(new) else None,
                 "failed": {"step": int(m["step"]), "norm": norm if math.isfinite(norm) else None,
                            "bound": bound, "loss_finite": loss_ok,
                            "applied": sorted(staged)}}  # units whose updates it judged


def target_step(sane: dict) -> int:
    """The step a rollback to the ``sane`` record returns to: its commit's, or the step before
    the deferred updates its own step made (they are the diverging ones, see
    :meth:`LayerStore.rollback_to_sane`)."""
    from jaxstream.stream.lazy import drop_fresh

    since = drop_fresh(((sane.get("extra") or {}).get("pending")) or {})[1]
    return int(sane["step"]) if since is None else since


def guard_message(where: str, sane: dict) -> str:
    """Why the store refuses to go on past a commit that failed the guard, and the way back."""
    f = sane["failed"]
    why = (f["why"] if "why" in f else "the step's loss was not finite" if not f["loss_finite"]
           else f"its parameter norm {f['norm']:.3g} exceeds {GROWTH:g}x the last sane commit's "
           f"({sane['norm']:.3g})" if f["norm"] is not None else "its parameter norm overflowed")
    return (f"the store at {where}: the commit of step {f['step']} failed the divergence guard "
            f"({why}); the last sane state, step {target_step(sane)}, is kept: roll back to it "
            "(jaxstream run CONFIG --out RUN --rollback, or LayerStore.rollback_to_sane()) "
            "and train on with a smaller learning rate")


def sane_after_rollback(prev: dict) -> dict | None:
    """The ``sane`` record of a store rolled back to ``prev`` (None: recomputed next commit)."""
    norms = prev.get("norms")
    if not norms:
        return None
    return {"step": int(prev["step"]), "norm": math.sqrt(sum(norms.values()))}
