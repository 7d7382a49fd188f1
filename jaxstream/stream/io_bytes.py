"""Bytes a layer store moved, read and written, by kind (DESIGN §10: bytes, not layers).

A :class:`~jaxstream.stream.store.LayerStore` counts what its executed reads and writes moved:
the array bytes of each leaf read (when the read's result is taken, on whichever thread takes
it: a prefetch worker, the host-update worker) or staged for writing, and the bytes of the
manifest read (the writer's check at a step's first write) and written (each commit). The
chunk's 4-byte crc32c and a direct read's block padding are not counted.

Kinds: ``params``, ``opt`` (optimizer state), ``scratch`` (values within a step, e.g. a hybrid's
group means for its update sweep), ``carry`` (the group means a deferred update carries to the
layer's next read), ``manifest``; and ``pending``: the JSON of the deferred updates' records
(``extra["pending"]``) inside the manifest written, reported on its own but already counted in
``manifest`` (not added twice to the total written).

Example::

    store.io.reset()
    ...                                   # a step
    store.io.metrics(layers=8)["bytes_read_per_layer"]
"""

from __future__ import annotations

import threading

KINDS = ("params", "opt", "scratch", "carry", "manifest")
PART_OF_MANIFEST = "pending"


class IOBytes:
    """Thread-safe byte counters of one store handle, read and written per kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zeroes every counter (the executor does at the start of each step)."""
        with self._lock:
            self._read = dict.fromkeys(KINDS, 0)
            self._written = dict.fromkeys((*KINDS, PART_OF_MANIFEST), 0)

    def read(self, kind: str, nbytes: int) -> None:
        """Counts ``nbytes`` read of ``kind``."""
        with self._lock:
            self._read[kind] += int(nbytes)

    def wrote(self, kind: str, nbytes: int) -> None:
        """Counts ``nbytes`` written (staged) of ``kind``."""
        with self._lock:
            self._written[kind] += int(nbytes)

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(read, written)`` bytes per kind since the last :meth:`reset`."""
        with self._lock:
            return dict(self._read), dict(self._written)

    def metrics(self, layers: int) -> dict[str, float]:
        """Flat step metrics: ``bytes_read`` / ``bytes_written`` (every kind; ``pending`` is
        inside ``manifest``), ``bytes_read_<kind>`` / ``bytes_written_<kind>``, and
        ``bytes_read_per_layer`` / ``bytes_written_per_layer``: the totals over the ``layers``
        the step ran (embed and head included in the totals)."""
        read, written = self.snapshot()
        total_r, total_w = sum(read.values()), sum(written[k] for k in KINDS)
        per = max(int(layers), 1)
        return {"bytes_read": float(total_r), "bytes_written": float(total_w),
                **{f"bytes_read_{k}": float(v) for k, v in read.items()},
                **{f"bytes_written_{k}": float(v) for k, v in written.items()},
                "bytes_read_per_layer": total_r / per, "bytes_written_per_layer": total_w / per}
