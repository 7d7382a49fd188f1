"""Data parallelism over a ``data`` mesh axis for any jaxstream estimator.

The batch is split along ``batch_axis`` into one shard per device; every device runs the
estimator on its shard (params replicated); the per-device estimates are averaged across the
axis with XLA's ``psum`` or the explicit ring of :mod:`jaxstream.comm.ring`.  Shards are of
equal size, so the mean of per-device mean losses is the whole-batch mean loss and, for
backprop, the averaged gradient is the whole-batch gradient.

A weight-perturbation forward estimate is fully described by its keys and scalars, so
``exchange="scalars"`` all-reduces neither gradients nor tangents: each device computes its
K coefficients (d_k/K for mean aggregation), the n x K coefficients are all-gathered (or, with
``tangents="shared"``, averaged: K numbers), and every device regenerates the tangents from
the keys and forms the same estimate.  Bytes on the wire: n*K floats instead of the
parameter count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import shard_map
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstream.comm.ring import ring_all_reduce_tree
from jaxstream.grad import Forward, Hybrid, directional
from jaxstream.grad.estimators import coefficients
from jaxstream.grad.tangents import combine, gram

__all__ = ["ALLREDUCE", "EXCHANGE", "TANGENTS", "DataParallel", "data_parallel", "device_keys"]

ALLREDUCE = ("psum", "ring")
EXCHANGE = ("gradients", "scalars")
TANGENTS = ("independent", "shared")


def device_keys(key: jax.Array, num_devices: int) -> jax.Array:
    """Keys of the n devices of a step keyed ``key``: ``fold_in(key, i)``."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_devices))


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """An estimator that splits the batch over ``mesh[axis]`` (see :func:`data_parallel`)."""

    estimator: Callable
    mesh: Mesh
    axis: str = "data"
    allreduce: Literal["psum", "ring"] = "psum"
    exchange: Literal["gradients", "scalars"] = "gradients"
    tangents: Literal["independent", "shared"] = "independent"
    batch_axis: int = 0

    def __post_init__(self):
        if self.axis not in self.mesh.axis_names:
            raise ValueError(
                f"axis: {self.axis!r} is not a mesh axis; mesh axes are {self.mesh.axis_names}"
            )
        for name, value, allowed in (
            ("allreduce", self.allreduce, ALLREDUCE),
            ("exchange", self.exchange, EXCHANGE),
            ("tangents", self.tangents, TANGENTS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}: {value!r} is not allowed; choose one of {allowed}")
        if self.exchange == "scalars":
            est = self.estimator
            if not (isinstance(est, Forward) and est.perturb == "weights"):
                raise ValueError(
                    "exchange: 'scalars' needs a weight-perturbation forward estimator "
                    "(jaxstream.grad.forward(perturb='weights')); got "
                    f"{type(est).__name__}; use exchange='gradients'"
                )
        if self.batch_axis < 0:
            raise ValueError(f"batch_axis: must be >= 0, got {self.batch_axis}")

    @property
    def num_devices(self) -> int:
        return self.mesh.shape[self.axis]

    def _check_batch(self, batch: Any) -> None:
        n = self.num_devices
        for leaf in jax.tree.leaves(batch):
            if leaf.ndim <= self.batch_axis or leaf.shape[self.batch_axis] % n:
                raise ValueError(
                    f"batch: every leaf needs axis {self.batch_axis} divisible by the {n} "
                    f"devices of mesh axis {self.axis!r}; got a leaf of shape {leaf.shape}"
                )

    def _key(self, key: jax.Array) -> jax.Array:
        if self.tangents == "shared":
            return key
        return jax.random.fold_in(key, jax.lax.axis_index(self.axis))

    def _mean(self, tree: Any) -> Any:
        if self.allreduce == "ring":
            return ring_all_reduce_tree(tree, self.axis, mean=True)
        return jax.tree.map(lambda x: jax.lax.pmean(x, self.axis), tree)

    def _body(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array):
        if self.exchange == "scalars":
            return self._scalar_body(loss_fn, params, batch, key)
        if isinstance(self.estimator, Hybrid) and self.tangents == "shared":
            # reduce the per-micro-batch scalars and exact gradients, then correct once: equal
            # to the whole-batch hybrid for every correction (weighted and guess included)
            return self.estimator(loss_fn, params, batch, key, reduce=self._mean)[:2]
        loss, grads = self.estimator(loss_fn, params, batch, self._key(key))[:2]
        return self._mean(loss), self._mean(grads)

    def _scalar_body(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array):
        est: Forward = self.estimator
        spec, k = est.spec, self._key(key)
        loss, d = directional(loss_fn, spec, params, batch, k)
        coeffs = coefficients(spec, est.aggregation, d, lambda: gram(spec, k, params))
        loss = self._mean(loss)
        if self.tangents == "shared":
            coeffs = self._mean(coeffs)  # K numbers; one set of tangents
            return loss, combine(spec, key[None], coeffs[None], params)
        n = self.num_devices
        every = jax.lax.all_gather(coeffs, self.axis)  # (n, K)
        return loss, combine(spec, device_keys(key, n), every / n, params)

    def __call__(
        self,
        loss_fn: Callable,
        params: Any,
        batch: Any,
        key: jax.Array,
        *,
        diagnostics: bool = False,
    ):
        self._check_batch(batch)
        batch_spec = P(*([None] * self.batch_axis), self.axis)
        fn = shard_map(
            lambda p, b, k: self._body(loss_fn, p, b, k),
            mesh=self.mesh,
            in_specs=(P(), batch_spec, P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
        if any(t == AxisType.Explicit for t in self.mesh.axis_types):
            # Explicit-sharding meshes (jax.make_mesh's default) need inputs laid out as specced.
            params, batch, key = (
                jax.reshard(x, NamedSharding(self.mesh, spec))
                for x, spec in ((params, P()), (batch, batch_spec), (key, P()))
            )
        loss, grads = fn(params, batch, key)
        return (loss, grads, {}) if diagnostics else (loss, grads)


def data_parallel(
    estimator: Callable,
    mesh: Mesh,
    *,
    axis: str = "data",
    allreduce: str = "psum",
    exchange: str = "gradients",
    tangents: str = "independent",
    batch_axis: int = 0,
) -> DataParallel:
    """Wrap ``estimator`` so that it runs data-parallel over ``mesh[axis]``.

    Args:
      estimator: any jaxstream estimator (backprop, forward, hybrid).
      mesh: a mesh with an axis named ``axis``; other axes (e.g. ``stage``) see replicated data.
      axis: the data axis.
      allreduce: ``"psum"`` (XLA) or ``"ring"`` (reduce-scatter + all-gather by ppermute).
      exchange: ``"gradients"`` (average the per-device estimates) or ``"scalars"`` (forward
        weight perturbation only: all-gather n x K coefficients, regenerate tangents).
      tangents: ``"independent"`` (device i uses ``fold_in(key, i)``: n x K tangents in all) or
        ``"shared"`` (every device uses ``key``: the estimate equals the single-device estimate
        of the whole batch with that key).
      batch_axis: the batch axis to split (1 for a hybrid's (N, B, ...) micro-batched batch).

    Returns:
      An estimator ``(loss_fn, params, batch, key) -> (loss, grads)``; jit it as usual.

    Example:
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> est = data_parallel(jg.backprop(), mesh, allreduce="ring")
      >>> loss, grads = jax.jit(est, static_argnums=0)(stack, params, batch, key)
    """
    return DataParallel(estimator, mesh, axis, allreduce, exchange, tangents, batch_axis)
