"""Count the bytes a compiled function passes between devices, read from its optimised HLO.

The count is taken from what XLA will actually run (after fusion and combining of
collectives), not from a formula: every ``all-reduce``, ``all-gather``, ``reduce-scatter``,
``all-to-all`` and ``collective-permute`` in the compiled module is listed with its payload.
Collectives inside loops are counted once per appearance in the text, so unroll loops (as
:func:`~jaxstream.comm.ring.ring_all_reduce` does) when counting.  Asynchronous
``*-start`` ops (GPU) print a tuple that may include buffers besides the payload, so counts
there are upper bounds; on CPU every collective is synchronous and the count is exact.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

__all__ = ["Collective", "collectives", "traffic_summary"]

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")


class Collective(NamedTuple):
    """One collective op of a compiled module.

    ``result_bytes``: bytes of the op's result on one device.  ``sent_bytes``: bytes one
    device puts on the wire for it, if the collective runs as a ring (all-reduce:
    2(n-1)/n x payload; all-gather: (n-1)/n x result; reduce-scatter: (n-1) x result;
    collective-permute: the payload).
    """

    kind: str
    result_bytes: int
    group_size: int
    sent_bytes: float


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * _DTYPE_BYTES.get(dtype, 4)
    return total


def _group_size(line: str, default: int) -> int:
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    explicit = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if explicit:
        return len(explicit.group(1).split(","))
    return default


def _sent(kind: str, nbytes: int, n: int) -> float:
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "all-gather":
        return (n - 1) / n * nbytes
    if kind == "reduce-scatter":
        return (n - 1) * nbytes
    if kind == "all-to-all":
        return (n - 1) / n * nbytes
    return float(nbytes)


def collectives(
    fn: Callable[..., Any], *args: Any, num_devices: int | None = None
) -> list[Collective]:
    """List the collectives of ``jax.jit(fn)`` compiled for ``args``.

    Args:
      fn: a function (typically wrapping ``shard_map``); it is jitted if it is not already.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      num_devices: group size to assume when the HLO does not name replica groups.

    Returns:
      One :class:`Collective` per collective op in the optimised HLO.

    Example:
      >>> ops = collectives(sharded_sum, x)
      >>> sum(op.result_bytes for op in ops if op.kind == "all-reduce")
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    text = jitted.lower(*args).compile().as_text()
    default = num_devices or jax.device_count()
    ops = []
    for line in text.splitlines():
        match = _LINE.search(line)
        if match is None or "-done" in line.split("=")[0]:
            continue
        nbytes = _bytes(match.group("shape"))
        n = _group_size(line, default)
        kind = match.group("kind")
        ops.append(Collective(kind, nbytes, n, _sent(kind, nbytes, n)))
    return ops


def traffic_summary(ops: list[Collective]) -> dict[str, float]:
    """Totals per kind of ``result_bytes`` plus ``"sent_bytes"`` (all kinds together)."""
    out: dict[str, float] = {kind: 0 for kind in _KINDS}
    for op in ops:
        out[op.kind] += op.result_bytes
    out["sent_bytes"] = float(sum(op.sent_bytes for op in ops))
    out["num_ops"] = len(ops)
    return out
