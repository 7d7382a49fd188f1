"""The streamed executor's deferred updates: store address -> records not yet applied (a
forward estimator's (key, coefficients), a hybrid's :class:`~jaxstream.stream.deferred.Combine`),
committed with each step as the manifest's ``extra["pending"]`` and applied when the layer is
next read (DESIGN §9, ``update="lazy"``)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxstream.stream import deferred, lazy
from jaxstream.stream import kernels as K
from jaxstream.stream.guard import GROWTH, tree_sq
from jaxstream.stream.host_queue import to_host
from jaxstream.stream.sweeps.combine import combined, record
from jaxstream.stream.units import LayerKey, parse_key
from jaxstream.stream.values import on_host


class Pending:
    """The records of ``ex`` (the driver: its store, optimizer, host device, plan), applied
    on read and staged; a step's commit makes the result visible.

    Example::

        params = ex.pending.apply(3, store.read(3).result())   # layer 3 as it is now
    """

    def __init__(self, ex: Any, records: dict):
        self.ex, self.records, self.applied = ex, dict(records), set()

    def snapshot(self) -> dict:
        """A copy to restore after a failed step (which leaves no trace)."""
        return {k: list(v) for k, v in self.records.items()}

    def apply(self, unit: LayerKey, params: Any, force: bool = False) -> Any:
        """Applies the records of store address ``unit`` to its host params (fp32); stages the
        result (:meth:`StreamedExecutor.estimate` and ``forward`` drop it) and drops the
        records when they are ``rewrite_every`` or more, one is a deferred combine, or
        ``force``; otherwise the records stay for the next read (nothing written)."""
        ex = self.ex
        recs = lazy.take(self.records, unit)
        if not recs:
            return params
        opt = ex.store.read_opt(unit).result()
        with on_host(ex.host):
            for rec in recs:
                if deferred.is_combine(rec):
                    h = ex.store.read_carry(unit, rec["slot"], rec["crc"]).result()
                    g = to_host(combined(ex, unit, params, h, record(ex, rec)), ex.host)
                else:
                    key, coeffs = lazy.decode(rec)
                    g = K.unit_estimate(ex.spec, K.step_seg_keys(key, unit), coeffs, params)
                params, opt = K.optax_step(ex.optimizer, g, opt, params)
            params, opt = jax.tree.map(np.asarray, (params, opt))
        sq = tree_sq(params)
        bound = ex.store.growth_bound()
        if not math.sqrt(sq) <= bound:  # the commit holds a diverging update: say so now
            size = f"norm {math.sqrt(sq):.3g}" if math.isfinite(sq) else "values non-finite"
            ex.store.fail_commit(f"the deferred updates waiting for {_name(unit)} make its "
                                 f"parameter {size}, over {bound:.3g}, {GROWTH:g}x the last sane "
                                 "commit's whole norm", applied=[unit])
            ex.store.check_sane()  # raises StoreDivergedError: why, and the way back
        if force or len(recs) >= ex.cfg.rewrite_every or any(map(deferred.is_combine, recs)):
            ex.store.write(unit, params, opt)
            self.applied.add(str(unit))
        else:  # the guard judges the params the step used (the records stay for later)
            ex.store.note_norm(unit, sq)
            self.records[str(unit)] = [{**r, "seen": True} for r in recs]
        return params

    def merge(self, new: dict) -> dict:
        """After a step: records applied in it are gone, skipped layers keep theirs, ``new``
        ones are appended. Returns the records to commit (:func:`lazy.pack` them with
        ``fresh=new``)."""
        # new lists: the dict committed with the step before may still be written (async)
        self.records = {k: list(v) for k, v in self.records.items()
                        if k not in self.applied and v}
        for k, v in new.items():
            self.records[k] = [*self.records.get(k, []), *v]
        return self.records

    def apply_all(self) -> bool:
        """Applies and writes (stages) every record; False when there was none."""
        if not any(self.records.values()):
            return False
        self.applied = set()
        for unit in [parse_key(u) for u, r in self.records.items() if r]:
            self.apply(unit, self.ex.store.read(unit).result(), force=True)
        self.records = {}
        return True


def _name(unit: LayerKey) -> str:
    return unit if isinstance(unit, str) and not unit.isdigit() else f"layer {unit}"
