"""Seed 001's placement by layer type: each layer type to the device group of its kind.

Where :func:`~jaxstream.placement.place_by_type` cuts the model into consecutive blocks (one
per stage, whatever the layers' types), the seed sends every layer of a type to the devices
of one kind (dense layers to the kind that multiplies fastest, activations to another): a
group of devices of kind k receives exactly the layers whose type maps to k, and its devices
take consecutive runs of those layers, in model order.

Cost model (the one of :mod:`jaxstream.placement.stages`): layer l of type t on a device of
kind k takes ``work[l] / throughput[(k, t)]``; a device's time is the sum over its layers; a
pipeline tick lasts as long as the slowest device, so the cost is the slowest device time.
Each group's split is exact (the dynamic programme of ``place_stages`` over the group's
layers); the groups do not interact, so the whole assignment is the exact optimum over
assignments of this form (checked against exhaustive enumeration in
``tests/pipeline/test_placement_config.py``).

A micro-batch visits the layers in model order, so the assignment runs on the linear pipeline
(``jaxstream.pipeline.pipeline``) only when every device's layers are consecutive in the model
and the devices follow in stage order (``TypeAssignment.sizes`` is then set); otherwise the
layers alternate between devices and it needs a schedule that visits a stage more than once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxstream.placement.stages import _split, min_time

__all__ = ["TypeAssignment", "assign_by_type", "measure_kind_speeds"]


class TypeAssignment(NamedTuple):
    """Which device runs each layer, and the device times.

    Attributes:
      stage_of: ``stage_of[l]``, the device (stage index) that runs layer l.
      stage_times: each device's time (sum of its layers' work over its rates).
      slowest: the largest device time (the cost).
      sizes: layers per stage when each stage's layers are consecutive and in stage order
        (what the linear pipeline runs), else None.
    """

    stage_of: tuple[int, ...]
    stage_times: tuple[float, ...]
    slowest: float
    sizes: tuple[int, ...] | None


def assign_by_type(layer_types: Sequence[str], layer_work: Sequence[float],
                   device_kinds: Sequence[str], type_kind: Mapping[str, str],
                   throughput: Mapping[tuple[str, str], float]) -> TypeAssignment:
    """The seed's assignment: layers of type t on the devices of kind ``type_kind[t]``.

    Args:
      layer_types: each layer's type, e.g. ``"dense"``, ``"activation"``.
      layer_work: each layer's work (the unit the throughputs are in).
      device_kinds: stage s's device kind.
      type_kind: the device kind of each layer type (the seed's map).
      throughput: ``{(kind, type): work per second}``; only the pairs ``(type_kind[t], t)``
        are read (a per-kind speed: the same rate for every type of the kind).

    Returns:
      The :class:`TypeAssignment` whose slowest device is least (exact).

    Raises:
      ValueError: naming the type or kind: a type without a kind, a kind without a device,
        a device without a layer, a missing or non-positive rate, bad work.

    Example:
      >>> assign_by_type(["dense", "act"] * 2, [1, 2] * 2, ["gpu", "cpu"],
      ...                {"dense": "gpu", "act": "cpu"},
      ...                {("gpu", "dense"): 2.0, ("cpu", "act"): 2.0}).stage_of
      (0, 1, 0, 1)
    """
    work = np.asarray(layer_work, np.float64)
    if len(layer_types) != work.size or work.size == 0 or not np.all(np.isfinite(work)) \
            or np.any(work < 0):
        raise ValueError(f"layer_work: {len(layer_types)} finite values >= 0, one per layer; "
                         f"got {work.size}")
    kinds = [str(k) for k in device_kinds]
    stage_of = np.full(work.size, -1, np.int64)
    times = np.zeros(len(kinds))
    for t in dict.fromkeys(layer_types):
        if t not in type_kind:
            raise ValueError(f"type_kind[{t!r}]: layer type {t!r} has no device kind; "
                             f"give one of {sorted(set(kinds))}")
        if type_kind[t] not in kinds:
            raise ValueError(f"type_kind[{t!r}]: {type_kind[t]!r} is not among the device "
                             f"kinds {sorted(set(kinds))}")
        rate = throughput.get((type_kind[t], t))
        if rate is None or not np.isfinite(rate) or rate <= 0:
            raise ValueError(f"throughput[({type_kind[t]!r}, {t!r})]: a positive rate is "
                             f"needed for each type on its kind, got {rate!r}")
    for kind in dict.fromkeys(kinds):
        devices = [s for s, k in enumerate(kinds) if k == kind]
        layers = [l for l, t in enumerate(layer_types) if type_kind[t] == kind]
        if len(layers) < len(devices):
            raise ValueError(f"device kind {kind!r}: {len(devices)} devices but {len(layers)} "
                             f"layers of its types; every device needs at least one layer")
        cost = np.array([work[l] / throughput[(kind, layer_types[l])] for l in layers])
        sizes = _split(np.tile(cost, (len(devices), 1)))
        start = 0
        for s, n in zip(devices, sizes):
            stage_of[layers[start:start + n]] = s
            times[s] = cost[start:start + n].sum()
            start += n
    ordered = bool(np.all(np.diff(stage_of) >= 0))
    sizes = tuple(int(n) for n in np.bincount(stage_of, minlength=len(kinds))) if ordered \
        else None
    return TypeAssignment(tuple(int(s) for s in stage_of), tuple(float(x) for x in times),
                          float(times.max()), sizes)


def measure_kind_speeds(fn: Callable[..., Any], args: tuple, device_kinds: Sequence[str],
                        devices: Sequence[Any] | None = None, *,
                        repeats: int = 5) -> dict[str, float]:
    """Each device kind's speed: 1 / the fastest wall time (s) of jitted ``fn(*args)`` on the
    first device of that kind (stage s's device is ``devices[s]``, default ``jax.devices()``).

    The speeds go into ``assign_by_type``'s throughputs (or a config's ``speeds``, written
    down so that a run's placement does not move with timing noise). One warm-up (compile)
    call per kind, then ``repeats`` timed calls; the fastest is the least disturbed by load.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < len(device_kinds):
        raise ValueError(f"devices: {len(devices)} for {len(device_kinds)} stages; one device "
                         f"per stage")
    jitted, out = jax.jit(fn), {}
    for kind in dict.fromkeys(device_kinds):
        on = jax.device_put(args, devices[list(device_kinds).index(kind)])
        out[kind] = 1.0 / max(min_time(jitted, on, repeats), 1e-9)
    return out
