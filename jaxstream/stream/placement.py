"""Where the blocks of a streamed step run: the streamed executor's one seam.

The executor (:class:`~jaxstream.stream.StreamedExecutor`) streams *units* — ``"embed"``, a
block unit, ``"head"`` — reads them from the store, applies their lazy updates, and runs the
sweeps its estimator's plan asks for. A :class:`Placement` says what a block unit is and how
its kernels run: :class:`OneDevice` (one layer per unit, on one device) or, in
:mod:`jaxstream.compose`, a chunk of M layers placed one per stage of a ``data × stage`` mesh.
The embed and the head always run on the placement's main device (:meth:`Placement.to_device`).

Example::

    ex = StreamedExecutor(stack, est, optax.adam(1e-3), store, placement=OneDevice(
        stack, est.plan.spec, jnp.float32, jax.devices()[0]))
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.grad.plan import Plan
from jaxstream.grad.tangents import TangentSpec
from jaxstream.models.stack import Stack
from jaxstream.stream import kernels as K
from jaxstream.stream import residuals as R
from jaxstream.stream.prefetch import to_device
from jaxstream.stream.units import LayerKey, Unit, block
from jaxstream.stream.values import host_value


class Placement(abc.ABC):
    """What a streamed executor needs to know about where block units run.

    A block unit (:class:`~jaxstream.stream.units.Unit`) names one or more layers; the kernels
    take a unit's device parameters (:meth:`put`) and the activations of every micro-batch
    (leaves (N, B, ...)) and return what the same kernel of :mod:`jaxstream.stream.kernels`
    returns for each layer in order. Stashed block inputs are keyed by layer.
    """

    stack: Stack
    spec: TangentSpec
    dtype: Any

    # ---------------------------------------------------------------- units and values
    @abc.abstractmethod
    def chunks(self, layers: Sequence[int]) -> list[Unit]:
        """The block units of a sweep over ``layers`` (in order)."""

    @abc.abstractmethod
    def merge_micro_batches(self, plan: Plan) -> bool:
        """Whether a step computes its N micro-batches as one."""

    @abc.abstractmethod
    def to_device(self, tree: Any) -> Any:
        """A host pytree on the main device (floating leaves in the compute dtype)."""

    @abc.abstractmethod
    def cast_batch(self, batch: dict) -> dict:
        """The micro-batched batch on the device, floating leaves in the compute dtype."""

    @abc.abstractmethod
    def put(self, unit: Unit, hosts: list) -> Any:
        """Device values of a block unit from one host pytree per layer."""

    @abc.abstractmethod
    def split(self, unit: Unit, g: Any, hosts: list | None,
              fn: Callable[[LayerKey, Any, Any], None]) -> None:
        """``fn(layer, gradient, host params or None)`` for each layer of ``unit``."""

    def agree(self, store: Any) -> None:
        """Checks that every process streams from a copy of the same commit, where the
        placement spans several processes (:func:`agree_across_processes`); called when an
        executor opens its store and after every commit. One process: nothing to check."""

    def begin_step(self) -> None:
        """Called when a step (or an estimate) begins."""

    def progress(self) -> None:
        """Called each time a unit of a sweep is ready (a placement over several processes
        watches it: :class:`~jaxstream.compose.peers.PeerWatch`)."""

    def end_step(self, error: BaseException | None = None) -> None:
        """Called when a step ends: committed, or aborted by ``error`` (the store has already
        dropped what the step staged)."""

    def metrics(self) -> dict:
        """What the placement adds to a step's metrics."""
        return {}

    def keep(self, tree: Any) -> Any:
        """A block input (the head's) stashed for the reverse sweep; :meth:`bring` puts it
        back. Here host values (arrays spread over several processes are gathered); a
        placement with a device stash keeps it there."""
        return host_value(tree)

    def bring(self, tree: Any) -> Any:
        """A stashed value (:meth:`keep`) on the main device, for the reverse sweep."""
        return self.to_device(tree)

    # ---------------------------------------------------------------- kernels on a block unit
    # ``state`` is what flows between units (a tuple of activations, leaves (N, ...)); a
    # placement may return an opaque state that only it reads (a pass still in flight) and hand
    # a unit's gradient back later than the call that ran it: kernels that produce gradients
    # return ``(state, done)``, ``done`` a list of ``(unit, gradient)``, and :meth:`land`, called
    # after a sweep's last block unit, returns the final activations and what is still due.
    @abc.abstractmethod
    def jvp(self, dev, unit, keys, state, stash: dict, stash_idx):
        """``(h, dh)`` through the unit with weight tangents; stashes the selected inputs."""

    @abc.abstractmethod
    def act(self, dev, unit, keys, state):
        """``(h, dh)`` through the unit with activity tangents."""

    @abc.abstractmethod
    def act_grad(self, dev, unit, keys, state, d):
        """``((h,), done)``: the unit's weight estimate from the activity scalars ``d``."""

    @abc.abstractmethod
    def local_grad(self, dev, unit, keys, state, head_dev, x, weights: bool):
        """``((h,), done)``: the unit's weight estimate under local losses."""

    def local_exact(self, dev, unit, state, head_dev, x):
        """``((h,), done)``: the unit's exact local-loss gradient (the local guess's
        direction); a placement that does not run it leaves :attr:`runs_local_guess` False."""
        raise NotImplementedError

    runs_local_guess: bool = False

    @abc.abstractmethod
    def vjp(self, dev, unit, stash: dict, state, each: bool):
        """``((input cotangent,), done)``: weight gradient(s) from the stashed inputs."""

    def prepare_reverse(self, unit, stash: dict) -> None:
        """Readies ``unit``'s stashed inputs for :meth:`vjp` (on the reverse sweep's loading
        thread, beside the unit computing before it); here nothing to do."""

    @abc.abstractmethod
    def along(self, dev, unit, v, state):
        """``(h, dh)`` along the direction ``v`` (device values of the unit)."""

    @abc.abstractmethod
    def apply(self, dev, unit, state, stash: dict):
        """``(h,)``, the unit's output; stashes every micro-batch's input."""

    def land(self, state) -> tuple[tuple, list]:
        """``(activations, done)`` once a sweep's last block unit has been run."""
        return state, []


def agree_across_processes(store: Any) -> None:
    """All-gathers every process's store step and :meth:`~LayerStore.fingerprint` and raises
    :class:`~jaxstream.stream.StoreError` on every process, naming each copy's step, unless
    all are equal. Every process of the run must call it (it is a collective)."""
    from jax.experimental import multihost_utils

    from jaxstream.stream.errors import StoreError

    mine = np.array([store.step, store.fingerprint()], np.int64).astype(np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine.view(np.int32))).view(np.uint32)
    every = every.reshape(jax.process_count(), 2)
    if (every == every[0]).all():
        return
    copies = ", ".join(f"process {i} at step {int(s)} (commit {int(f):08x})"
                       for i, (s, f) in enumerate(every))
    raise StoreError(
        f"the processes' layer store copies disagree: {copies}; every process must stream "
        f"from a copy of the same commit (this is process {jax.process_index()}, store "
        f"{store.location}): copy one process's store to the others, then restart")


class OneDevice(Placement):
    """One layer per unit, on one device (the streamed executor's default).

    Nothing here waits for the device: block inputs stashed for the reverse sweep stay on the
    device while they fit ``stash_bytes`` (None: no limit); beyond it they spill to host
    memory by an asynchronous copy and come back the same way when the reverse sweep needs
    them."""

    def __init__(self, stack: Stack, spec: TangentSpec, dtype: Any, device: Any,
                 stash_bytes: int | None = None, residuals: str = "keep"):
        self.stack, self.spec, self.dtype, self.device = stack, spec, jnp.dtype(dtype), device
        self.stash_bytes, self.residuals = stash_bytes, residuals
        self.host = jax.local_devices(backend="cpu")[0]
        self._stashed = 0  # device bytes stashed this step
        self.spilled = 0  # bytes spilled to the host this step

    def begin_step(self) -> None:
        self._stashed = self.spilled = 0

    def keep(self, tree: Any) -> Any:
        size = sum(a.nbytes for a in jax.tree.leaves(tree))
        if self.stash_bytes is None or self._stashed + size <= self.stash_bytes:
            self._stashed += size
            return tree
        self.spilled += size
        return jax.device_put(tree, self.host)  # asynchronous: the main thread moves on

    def bring(self, tree: Any) -> Any:
        return jax.device_put(tree, self.device)

    def chunks(self, layers: Sequence[int]) -> list[Unit]:
        return [block(l) for l in layers]

    def merge_micro_batches(self, plan: Plan) -> bool:
        # one shared tangent / exact gradient of the mean over all samples: the N
        # micro-batches are computed as one (same device memory, same sums as in memory)
        return not plan.mixes

    def to_device(self, tree: Any) -> Any:
        return to_device(tree, self.dtype, self.device)

    def cast_batch(self, batch: dict) -> dict:
        def c(a):
            a = jnp.asarray(a)
            return a.astype(self.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
        return jax.device_put({k: c(v) for k, v in batch.items()}, self.device)

    def put(self, unit: Unit, hosts: list) -> Any:
        return self.to_device(hosts[0])

    def split(self, unit: Unit, g: Any, hosts: list | None, fn: Callable) -> None:
        fn(unit.key, g, None if hosts is None else hosts[0])

    def jvp(self, dev, unit, keys, state, stash: dict, stash_idx):
        h, dh = state
        if stash_idx is not None:
            stash[unit.key] = self.keep(K.take(h, stash_idx))
        return K.block_jvp(self.stack, self.spec, dev, np.int32(unit.key), keys, h, dh)

    def act(self, dev, unit, keys, state):
        return K.block_act(self.stack, self.spec, dev, np.int32(unit.key), keys, *state)

    def act_grad(self, dev, unit, keys, state, d):
        h, g = K.unit_act_grad(self.stack, self.spec, "block", dev, np.int32(unit.key), keys,
                               state[0], d)
        return (h,), [(unit, g)]

    def local_grad(self, dev, unit, keys, state, head_dev, x, weights: bool):
        h, g = K.unit_local_grad(self.stack, self.spec, "block", dev, np.int32(unit.key),
                                 keys, state[0], head_dev, x, weights)
        return (h,), [(unit, g)]

    runs_local_guess = True

    def local_exact(self, dev, unit, state, head_dev, x):
        h, g = K.unit_local_exact(self.stack, "block", dev, np.int32(unit.key), state[0],
                                  head_dev, x)
        return (h,), [(unit, g)]

    def vjp(self, dev, unit, stash: dict, state, each: bool):
        stashed = self.bring(stash[unit.key])
        if isinstance(stashed, R.Kept):  # the input and the forward's residuals
            g, ct = R.vjp_kept(self.stack, stashed.layout, dev, stashed.h, stashed.res,
                               state[0])
        else:
            vjp = K.block_vjp_each if each else K.block_vjp
            g, ct = vjp(self.stack, dev, stashed, state[0])
        return (ct,), [(unit, g)]

    def along(self, dev, unit, v, state):
        return K.block_along(self.stack, dev, v, *state)

    def apply(self, dev, unit, state, stash: dict):
        (h,) = state
        lay = R.layout(self.stack, dev, h) if self.residuals == "keep" else None
        if lay is None:
            stash[unit.key] = self.keep(h)
            return (K.block_apply(self.stack, dev, h),)
        out, res = R.apply_keep(self.stack, lay, dev, h)
        stash[unit.key] = self.keep(R.Kept(h, res, lay))
        return (out,)


class Grouped(OneDevice):
    """G consecutive layers per unit on one device: each unit's parameters go to the device
    together and its blocks run as one scanned program (at small widths a step is dispatches
    and waits, one per unit). Runs the forward estimator with weight tangents and backprop
    (a unit's reverse recomputes its blocks' inputs from the unit's stashed input); other
    plans are refused by :func:`check_grouped`."""

    def __init__(self, stack: Stack, spec: TangentSpec, dtype: Any, device: Any,
                 stash_bytes: int | None = None, group: int = 2):
        super().__init__(stack, spec, dtype, device, stash_bytes)
        self.group = group

    runs_local_guess = False

    def chunks(self, layers: Sequence[int]) -> list[Unit]:
        g = self.group
        return [block(*layers[i:i + g]) for i in range(0, len(layers), g)]

    def put(self, unit: Unit, hosts: list) -> Any:
        return self.to_device(jax.tree.map(lambda *a: np.stack(a), *hosts))

    def split(self, unit: Unit, g: Any, hosts: list | None, fn: Callable) -> None:
        for i, l in enumerate(unit.layers):
            fn(l, jax.tree.map(lambda a, i=i: a[i], g), None if hosts is None else hosts[i])

    def jvp(self, dev, unit, keys, state, stash: dict, stash_idx):
        if stash_idx is not None:
            raise ValueError("layers_per_unit: a grouped unit stashes no per-block inputs for a "
                             "hybrid's reverse sweep; allowed with a hybrid: 1")
        return K.blocks_unit_jvp(self.stack, self.spec, dev, np.int32(unit.layers[0]), keys,
                                 *state)

    def apply(self, dev, unit, state, stash: dict):
        (h,) = state
        stash[unit] = self.keep(h)
        return (K.blocks_unit_apply(self.stack, dev, h),)

    def vjp(self, dev, unit, stash: dict, state, each: bool):
        if each:
            raise ValueError("layers_per_unit: per-micro-batch exact gradients (a hybrid) run "
                             "one layer per unit; allowed with a hybrid: 1")
        g, ct = K.blocks_unit_vjp(self.stack, dev, self.bring(stash[unit]), state[0])
        return (ct,), [(unit, g)]


def check_grouped(plan: Plan, group: int, who: str) -> None:
    """Refuses, naming ``layers_per_unit``, a plan a grouped unit does not run: it runs the
    forward estimator with weight tangents and backprop."""
    fp = plan.forward_pass
    if group > 1 and not ((fp.scalars and plan.exact == "none")
                          or (not fp.runs and plan.exact == "all")):
        raise ValueError(f"{who}: layers_per_unit={group} runs the forward estimator with "
                         f"weight tangents and backprop, not {plan.describe()}; allowed for it: 1")


def placement_for(plan: Plan, stack: Any, dtype: Any, config: Any, who: str,
                  placement: Placement | None = None, device: Any = None) -> Placement:
    """The placement a streamed executor runs ``plan`` on: ``placement`` if given, else
    :class:`Grouped` units of ``config.layers_per_unit`` layers or :class:`OneDevice` on
    ``device`` (default: the first). Refuses, by field, grouping a plan it does not run,
    grouping another placement's units, and the local guess off one device."""
    group = config.layers_per_unit
    check_grouped(plan, group, who)
    if placement is not None and group > 1:
        raise ValueError(f"{who}: layers_per_unit={group} groups a one-device sweep's layers; "
                         f"{type(placement).__name__} makes its own units; allowed with it: 1")
    device = device or jax.local_devices()[0]
    if placement is None:
        placement = (Grouped(stack, plan.spec, dtype, device, config.stash_bytes, group)
                     if group > 1 else OneDevice(stack, plan.spec, dtype, device,
                                                 config.stash_bytes, config.residuals))
    if plan.forward_pass.guess and not placement.runs_local_guess:
        raise ValueError(f"{type(placement).__name__}: the local guess's sweeps (exact local "
                         "gradients, then one jvp along them) run on one device (the stream "
                         "engine), not on this placement; run it there or in memory")
    return placement
