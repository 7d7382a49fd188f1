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

Activity perturbation puts a tangent on every example's activations. With
``tangents="shared"`` each replica draws a segment's tangents for the *whole* batch (from the
step key, as the in-memory estimator does) and keeps its own shard's rows, so the replicas'
tangents together are the whole batch's draw and the estimate equals the in-memory one.

``exchange="moments"`` runs the optimizer inside the map as well (:meth:`DataParallel.step`):
each replica feeds its own estimate to its own optimizer state (stacked over the axis) and an
optimizer such as :func:`jaxstream.optim.max_adabelief_exchange` all-reduces its moments.

A model's own randomness (dropout, a layer's ``nnx.Rngs`` streams, bound by
``model.with_rng(rng)``) is drawn on shard s from ``fold_in(rng, s)``
(:func:`jaxstream.models.sequential.fold_rng`), so shards draw independent masks, whatever
``tangents`` says. A model whose training loss mixes examples (``cross_example``: BatchNorm's
batch statistics) is refused: each shard would normalise by its own statistics.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax import shard_map
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstream.comm.ring import ring_all_reduce_tree
from jaxstream.grad import directional
from jaxstream.grad.checks import check_key, check_labels
from jaxstream.grad.estimators import coefficients
from jaxstream.grad.tangents import TangentSpec, combine, gram
from jaxstream.models.sequential import fold_rng

__all__ = [
    "ALLREDUCE",
    "EXCHANGE",
    "TANGENTS",
    "DataParallel",
    "ShardRows",
    "data_parallel",
    "device_keys",
]

AllReduce = Literal["psum", "ring"]
Exchange = Literal["gradients", "scalars", "moments"]
Tangents = Literal["independent", "shared"]
ALLREDUCE, EXCHANGE, TANGENTS = (typing.get_args(t) for t in (AllReduce, Exchange, Tangents))


def device_keys(key: jax.Array, num_devices: int) -> jax.Array:
    """Keys of the n devices of a step keyed ``key``: ``fold_in(key, i)``."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_devices))


@dataclasses.dataclass(frozen=True)
class ShardRows(TangentSpec):
    """A tangent spec that draws a per-example tangent for the whole batch and keeps the rows
    of this replica's shard (inside ``shard_map`` over ``axis``, ``shards`` equal shards).

    ``sample(key, (b, ...))`` draws ``(num, b * shards, ...)`` exactly as the base spec draws a
    whole-batch tangent and returns rows ``[i*b, (i+1)*b)`` of replica i: the replicas' union
    is the whole batch's draw (orthogonal tangents included). The price: each
    replica draws ``shards`` times the random numbers of its own rows.

    Example:
      >>> spec = ShardRows.of(TangentSpec(2), "data", 4)   # inside shard_map over "data"
    """

    axis: str = "data"
    shards: int = 1

    @classmethod
    def of(cls, spec: TangentSpec, axis: str, shards: int) -> ShardRows:
        """``spec``'s distribution, drawn for ``shards`` shards over ``axis``."""
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(TangentSpec)}
        return cls(**fields, axis=axis, shards=shards)

    def sample(self, key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
        rows = shape[0]
        whole = super().sample(key, (rows * self.shards, *shape[1:]), dtype)
        start = jax.lax.axis_index(self.axis) * rows
        return jax.lax.dynamic_slice_in_dim(whole, start, rows, axis=1)


def _check_per_example(loss_fn: Any) -> None:
    """Raises ValueError naming the layers whose batch statistics mix examples (BatchNorm):
    on a shard they see that shard's statistics only, so the estimate is not the whole
    batch's."""
    if not getattr(loss_fn, "cross_example", False):
        return
    raise ValueError(
        f"data_parallel: {_cross_example_layers(loss_fn)} mixes the examples of a batch "
        "(batch statistics), so each shard would normalise by its own shard's statistics and "
        "the gradient would not be the whole batch's: run this model on one device (the "
        "estimator without data_parallel), or use a per-example norm such as nnx.LayerNorm")


def _cross_example_layers(loss_fn: Any) -> str:
    """``"model 'name' (layer 1: BatchNorm)"`` for a Sequential's layers with batch
    statistics; the loss function's type otherwise."""
    layers = getattr(loss_fn, "layers", None)
    if not hasattr(loss_fn, "to_nnx") or layers is None:
        return f"the loss function ({type(loss_fn).__name__})"
    modules = loss_fn.to_nnx(loss_fn.params).layers
    names = [f"{l}: {type(modules[l]).__name__}" for l, layer in enumerate(layers)
             if getattr(layer, "has_stats", False)]
    return f"model {loss_fn.name!r} (layer {', '.join(names)})"


def _is_activity(estimator: Any) -> bool:
    plan = getattr(estimator, "plan", None)
    return plan is not None and plan.forward_pass.tangents == "activations"


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
            plan = getattr(est, "plan", None)
            if plan is None or not (plan.forward_pass.scalars and plan.exact == "none"):
                raise ValueError(
                    "exchange: 'scalars' needs a weight-perturbation forward estimator "
                    "(jaxstream.grad.forward(perturb='weights')); got "
                    f"{type(est).__name__}; use exchange='gradients'"
                )
        if self.batch_axis < 0:
            raise ValueError(f"batch_axis: must be >= 0, got {self.batch_axis}")
        plan = getattr(self.estimator, "plan", None)
        if plan is not None and plan.exact == "selected" and self.batch_axis == 0:
            raise ValueError(
                f"batch_axis: 0 would split {type(self.estimator).__name__}'s micro-batches "
                "(axis 0 of its (N, B, ...) batch) over the devices, each then selecting its "
                "own exact ones from its share (another estimator); use batch_axis=1 to split "
                "every micro-batch's examples")
        if plan is not None and plan.forward_pass.guess and self.tangents == "shared":
            raise ValueError("tangents: 'shared' promises the in-memory estimator of the whole "
                             "batch, but local_guess's guess is each shard's own local "
                             "gradients; use tangents='independent' (each shard's estimate, "
                             "averaged)")
        if _is_activity(self.estimator) and self.tangents == "shared" and self.batch_axis:
            raise ValueError(
                "batch_axis: activity perturbation splits the examples' axis 0; "
                f"got {self.batch_axis}"
            )

    @property
    def num_devices(self) -> int:
        return self.mesh.shape[self.axis]

    def _check_batch(self, batch: Any) -> None:
        n = self.num_devices
        for leaf in jax.tree.leaves(batch):
            if leaf.ndim <= self.batch_axis:
                raise ValueError(
                    f"batch_axis: {self.batch_axis} is not an axis of the batch's leaf of "
                    f"shape {leaf.shape}; a flat batch splits axis 0, a micro-batched "
                    "(N, B, ...) one axis 1")
            if leaf.shape[self.batch_axis] % n:
                raise ValueError(
                    f"batch: every leaf needs axis {self.batch_axis} divisible by the {n} "
                    f"devices of mesh axis {self.axis!r}; got a leaf of shape {leaf.shape}"
                )

    def _shard_model(self, loss_fn: Callable) -> Callable:
        """This replica's loss function: the model's randomness keyed by its shard's index."""
        return fold_rng(loss_fn, jax.lax.axis_index(self.axis))

    def _key(self, key: jax.Array) -> jax.Array:
        if self.tangents == "shared":
            return key
        return jax.random.fold_in(key, jax.lax.axis_index(self.axis))

    def _mean(self, tree: Any) -> Any:
        if self.allreduce == "ring":
            return ring_all_reduce_tree(tree, self.axis, mean=True)
        return jax.tree.map(lambda x: jax.lax.pmean(x, self.axis), tree)

    def _local_estimator(self) -> Callable:
        """The estimator each replica runs on its shard."""
        est = self.estimator
        if _is_activity(est) and self.tangents == "shared":
            # per-example tangents: draw the whole batch's, keep this shard's rows
            return dataclasses.replace(est, spec=ShardRows.of(est.spec, self.axis, self.num_devices))
        return est

    def _replica(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array):
        """This replica's own ``(loss, estimate)`` of its shard (nothing all-reduced)."""
        return self._local_estimator()(loss_fn, params, batch, self._key(key))[:2]

    def _body(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array):
        if self.exchange == "scalars":
            return self._scalar_body(loss_fn, params, batch, key)
        if self.exchange == "moments":  # the estimate: the mean of the replicas' own
            loss, grads = self._replica(loss_fn, params, batch, key)
            return self._mean(loss), self._mean(grads)
        rule = self.estimator.plan.rule if hasattr(self.estimator, "plan") else None
        if rule is not None and rule.exact and self.tangents == "shared":
            # reduce the per-micro-batch scalars and exact gradients, then correct once: equal
            # to the whole-batch hybrid for every correction (weighted and guess included)
            return self.estimator(loss_fn, params, batch, key, reduce=self._mean)[:2]
        loss, grads = self._replica(loss_fn, params, batch, key)
        return self._mean(loss), self._mean(grads)

    def _scalar_body(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array):
        plan = self.estimator.plan
        spec, k = plan.spec, self._key(key)
        loss, d = directional(loss_fn, spec, params, batch, k)
        coeffs = coefficients(spec, plan.combine, d, lambda: gram(spec, k, params))
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
        _check_per_example(loss_fn)
        check_key(key, "data_parallel")
        check_labels(loss_fn, batch, "data_parallel")  # inside shard_map the labels are traced
        self._check_batch(batch)
        batch_spec = P(*([None] * self.batch_axis), self.axis)
        fn = shard_map(
            lambda p, b, k: self._body(self._shard_model(loss_fn), p, b, k),
            mesh=self.mesh,
            in_specs=(P(), batch_spec, P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
        # Explicit-sharding meshes (jax.make_mesh's default) need inputs laid out as specced.
        params, batch, key = (
            self._layout(x, spec) for x, spec in ((params, P()), (batch, batch_spec), (key, P()))
        )
        loss, grads = fn(params, batch, key)
        return (loss, grads, {}) if diagnostics else (loss, grads)

    def _layout(self, tree: Any, spec: P) -> Any:
        if any(t == AxisType.Explicit for t in self.mesh.axis_types):
            return jax.reshard(tree, NamedSharding(self.mesh, spec))
        return tree

    def replicate_state(self, state: Any) -> Any:
        """One copy of an optimizer ``state`` per replica: leaves stacked on a leading axis of
        size n, sharded over ``axis`` (the per-replica state :meth:`step` takes)."""
        n = self.num_devices
        stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), state)
        return jax.device_put(stacked, NamedSharding(self.mesh, P(self.axis)))

    def step(
        self,
        loss_fn: Callable,
        optimizer: optax.GradientTransformation,
        params: Any,
        opt_states: Any,
        batch: Any,
        key: jax.Array,
    ) -> tuple[Any, Any, jax.Array, jax.Array]:
        """One optimizer step with per-replica optimizer states (``exchange="moments"``).

        Every replica estimates the gradient of its shard (not all-reduced) and runs
        ``optimizer.update`` on it with its own state, inside the map; an optimizer that
        exchanges over ``axis`` (:func:`jaxstream.optim.max_adabelief_exchange` with
        ``axis_name=axis``) makes the updates, hence the params, the same on every replica.

        Args:
          loss_fn, params, batch, key: as for ``__call__`` (params replicated).
          optimizer: an optax transformation whose update runs inside ``shard_map``.
          opt_states: the replicas' states, leaves with a leading axis of size n
            (:meth:`replicate_state`).

        Returns:
          ``(params, opt_states, loss, grad_rms)``: the new params (replica 0's), the new
          states, the whole-batch mean loss and the root mean square of the replicas' gradient
          norms (a scalar all-reduce; the norm of the mean gradient would cost a params-sized
          one).

        Example:
          >>> dp = data_parallel(jg.backprop(), mesh, exchange="moments")
          >>> opt = max_adabelief_exchange(1e-3, axis_name="data")
          >>> states = dp.replicate_state(opt.init(params))
          >>> params, states, loss, _ = jax.jit(dp.step, static_argnums=(0, 1))(
          ...     stack, opt, params, states, batch, key)
        """
        if self.exchange != "moments":
            raise ValueError(
                f"exchange: step() needs 'moments' (per-replica optimizer states); got "
                f"{self.exchange!r}; with {EXCHANGE[:2]} call the estimator and update once"
            )
        _check_per_example(loss_fn)
        check_key(key, "data_parallel")
        check_labels(loss_fn, batch, "data_parallel")  # inside shard_map the labels are traced
        self._check_batch(batch)
        batch_spec = P(*([None] * self.batch_axis), self.axis)

        def body(p, states, b, k):
            state = jax.tree.map(lambda x: x[0], states)
            loss, grads = self._replica(self._shard_model(loss_fn), p, b, k)
            updates, state = optimizer.update(grads, state, p)
            sq = jax.lax.pmean(optax.tree.norm(grads, squared=True), self.axis)
            p = optax.apply_updates(p, updates)
            state = jax.tree.map(lambda x: x[None], state)
            return p, state, self._mean(loss), jnp.sqrt(sq)

        fn = shard_map(
            body,
            mesh=self.mesh,
            in_specs=(P(), P(self.axis), batch_spec, P()),
            out_specs=(P(), P(self.axis), P(), P()),
            check_vma=False,
        )
        params, batch, key = (
            self._layout(x, spec) for x, spec in ((params, P()), (batch, batch_spec), (key, P()))
        )
        opt_states = self._layout(opt_states, P(self.axis))
        return fn(params, opt_states, batch, key)


def data_parallel(
    estimator: Callable,
    mesh: Mesh,
    *,
    axis: str = "data",
    allreduce: str = "psum",
    exchange: str = "gradients",
    tangents: Literal["independent", "shared"] = "independent",
    batch_axis: int = 0,
) -> DataParallel:
    """Wrap ``estimator`` so that it runs data-parallel over ``mesh[axis]``.

    Args:
      estimator: any jaxstream estimator (backprop, forward, hybrid).
      mesh: a mesh with an axis named ``axis``; other axes (e.g. ``stage``) see replicated data.
      axis: the data axis.
      allreduce: ``"psum"`` (XLA) or ``"ring"`` (reduce-scatter + all-gather by ppermute).
      exchange: ``"gradients"`` (average the per-device estimates), ``"scalars"`` (forward
        weight perturbation only: all-gather n x K coefficients, regenerate tangents) or
        ``"moments"`` (no gradient all-reduce: :meth:`DataParallel.step` runs a per-replica
        optimizer such as :func:`jaxstream.optim.max_adabelief_exchange` inside the map;
        calling the estimator returns the mean of the replicas' own estimates).
      tangents: ``"independent"`` (device i uses ``fold_in(key, i)``: n x K tangents in all) or
        ``"shared"`` (every device uses ``key``: the estimate equals the single-device estimate
        of the whole batch with that key; activity tangents are drawn for the whole batch and
        sliced, see :class:`ShardRows`).
      batch_axis: the batch axis to split (1 for a hybrid's (N, B, ...) micro-batched batch).

    Returns:
      An estimator ``(loss_fn, params, batch, key) -> (loss, grads)``; jit it as usual. A
      model with a bound key (dropout) draws shard s's randomness from ``fold_in(rng, s)``; a
      model with batch statistics (BatchNorm) is refused by name.

    Example:
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> est = data_parallel(jg.backprop(), mesh, allreduce="ring")
      >>> loss, grads = jax.jit(est, static_argnums=0)(stack, params, batch, key)
    """
    return DataParallel(estimator, mesh, axis, allreduce, exchange, tangents, batch_axis)
