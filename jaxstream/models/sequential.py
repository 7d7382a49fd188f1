"""Models as users write them: an ``nnx.Sequential`` as a layered loss function.

Each element of the sequence is a *layer*: an nnx module (with parameters, batch statistics or
dropout) or a plain callable (``nnx.relu``, a pooling lambda, a reshape). Layers may change the
shape of the activations. The model is a ``loss_fn(params, batch) -> scalar`` that every
estimator accepts (backprop, forward weight perturbation, hybrid); activity perturbation runs on
its own layered pass (:func:`jaxstream.grad.layered.layered_activity`), which puts a tangent on
the output of every layer that has parameters. A stack of identical blocks (:class:`~jaxstream.models.Stack`) stays
the fast path (one compiled block, ``lax.scan``); a sequential model unrolls its layers.

Parameters are a tuple with one ``nnx.Param`` pure dict per layer (``{}`` for a layer without
parameters). A parameter shared by several layers (a tied embedding and output head, a module
placed twice) is kept once, in the first layer that uses it, and every later use reads it
there, so its gradient is the sum over its uses and the tie survives training, as in nnx.
Such a model runs as a whole (backprop, weight perturbation, the hybrids); what runs its layers
one by one with their own parameters (activity perturbation, stack views) refuses it by name.
Non-differentiated state -- BatchNorm's running averages -- lives in a tuple of the
same layout (:attr:`Sequential.state`): the loss uses the statistics of the batch (training
mode), :meth:`Sequential.update_state` computes the new running averages after a step, and
:meth:`Sequential.apply` uses them for evaluation. Under a micro-batched estimator (the hybrids,
``exact_subset``) the loss sees one micro-batch at a time, so BatchNorm normalises each
micro-batch by its own statistics (with every micro-batch exact such an estimator is therefore
not backprop on the whole batch), and ``update_state(..., micro_batched=True)`` averages the
micro-batches' updates.

Key schedule (on top of :mod:`jaxstream.grad.tangents`):

* activity tangents of layer ``l``: ``block_key(fold_in(key, 3), l)``;
* dropout ``j`` of layer ``l``: ``fold_in(fold_in(rng, l), j)`` with
  ``rng = fold_in(step_key, DROPOUT)``, bound with :meth:`Sequential.with_rng`
  (``jaxstream.train_step`` does it for every step). The same mask serves every tangent, the
  exact gradient and both passes of activity perturbation. Without a bound key a training-mode
  pass through an ``nnx.Dropout`` with a rate above 0 is refused by name (it would train with
  dropout silently off); evaluation (:meth:`Sequential.apply`) runs dropout off. A module's own
  ``dropout_rate`` (attention) without a bound key runs deterministic (off), as flax's
  ``deterministic=True``.
* a layer's own ``nnx.Rngs`` streams (a noise layer's ``self.rngs.noise()``, an attention
  module's ``dropout_rate``, a recurrent cell's carry): stream ``j`` of layer ``l`` reseeded to
  ``fold_in(fold_in(fold_in(rng, l), STREAMS), j)`` with count 0 at every call
  (:mod:`jaxstream.models.rng_streams`), so the same draws serve every pass of a step. A draw in
  training mode without a bound key is refused by name; evaluation draws from the layer's
  initial streams (the same every call).

Example:
    >>> rngs = nnx.Rngs(0)
    >>> model = from_sequential(nnx.Sequential(
    ...     nnx.Linear(64, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 10, rngs=rngs)),
    ...     loss="cross_entropy")
    >>> params = model.init(jax.random.key(0))
    >>> loss, grads = jaxstream.grad.backprop()(model, params, batch, key)
    >>> loss, grads = jaxstream.grad.forward(4, perturb="activations")(model, params, batch, key)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.errors import TraceContextError

from jaxstream.models import rng_streams as rs
from jaxstream.models.stack import Batch, cross_entropy, loss_dtype
from jaxstream.models.ties import (
    find_ties,
    get_attr_path,
    get_path,
    has_path,
    path_str,
    set_attr_path,
    set_path,
    without_path,
)

DROPOUT = 5  # key segment of a step's random layers (dropout masks, a layer's own RNG streams)

LOSSES: dict[str, Callable[[jax.Array, Batch], jax.Array]] = {"cross_entropy": cross_entropy}


def mean_squared_error(out: jax.Array, batch: Batch) -> jax.Array:
    """Per-example mean squared error against float targets ``batch["y"]``."""
    err = (out - batch["y"].reshape(out.shape)).astype(loss_dtype(out.dtype)) ** 2
    return err.reshape(err.shape[0], -1).mean(axis=1)


LOSSES["mse"] = mean_squared_error


@dataclasses.dataclass(frozen=True, eq=False)
class _Layer:
    """One element: an nnx graph definition (``fn`` None) or a plain callable."""

    graphdef: Any = None
    other: Any = None  # constant non-param, non-statistic variables (e.g. RNG streams)
    fn: Callable | None = None
    has_params: bool = False
    has_stats: bool = False
    has_dropout: bool = False
    has_rngs: bool = False  # holds nnx.Rngs streams (driven by the step key, rng_streams.py)
    dropout_rate: float = 0.0  # the largest rate of its nnx.Dropout modules (0: none)
    out_size: int | None = None  # its output's last axis where cheaply known (nnx.Linear, Conv)
    # parameters this layer shares with an earlier one: (path here, owner layer, path there)
    ties: tuple[tuple[tuple, int, tuple], ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Sequential:
    """A sequence of layers with a per-example loss; itself a ``loss_fn(params, batch)``.

    Build it with :func:`from_sequential`. Attributes: ``params`` and ``state`` (initial
    values), ``example_loss``, ``rng`` (dropout key bound by :meth:`with_rng`), ``name``.
    """

    layers: tuple[_Layer, ...]
    params: tuple
    state: tuple
    example_loss: Callable[[jax.Array, Batch], jax.Array]
    rng: jax.Array | None = None
    name: str = "sequential"

    # ------------------------------------------------------------------ structure
    @property
    def num_layers(self) -> int:
        """Number of elements of the sequence."""
        return len(self.layers)

    @property
    def has_state(self) -> bool:
        """True if some layer keeps batch statistics (BatchNorm)."""
        return any(layer.has_stats for layer in self.layers)

    @property
    def num_classes(self) -> int | None:
        """The size of the output's last axis (the classes of a cross-entropy model) where the
        last layer states it (an ``nnx.Linear`` or ``nnx.Conv``); None otherwise."""
        return self.layers[-1].out_size

    @property
    def cross_example(self) -> bool:
        """True if a layer mixes examples in training mode (batch statistics)."""
        return self.has_state

    def init(self, key: jax.Array) -> tuple:
        """The initial parameters (nnx modules are initialised when built; ``key`` unused)."""
        del key
        return self.params

    def with_rng(self, key: jax.Array | None) -> Sequential:
        """The same model with its random layers (dropout, a layer's own RNG streams) driven by
        ``key`` (None: in training mode an ``nnx.Dropout`` and a layer drawing from its own
        streams are refused; a module's own ``dropout_rate`` runs deterministic)."""
        return dataclasses.replace(self, rng=key)

    # ------------------------------------------------------------------ layers
    def layer(self, l: int, p: Any, h: jax.Array, *, train: bool = True,
              state: Any = None) -> tuple[jax.Array, Any]:
        """Apply layer ``l`` to ``h``; returns ``(output, new batch statistics)``."""
        layer = self.layers[l]
        if layer.fn is not None:
            return layer.fn(h), {}
        if layer.ties and not all(has_path(p, here) for here, _, _ in layer.ties):
            here, owner, there = layer.ties[0]
            raise ValueError(
                f"model: layer {l} shares its parameter {path_str(here)!r} with layer {owner} "
                f"({path_str(there)!r}, tied weights); it runs only inside the whole model "
                f"(backprop, weight perturbation, the hybrids), not layer by layer (activity "
                f"perturbation, local losses, stack views): use one of those estimators, or untie "
                f"the layers")
        if train and self.rng is None and layer.dropout_rate > 0:
            raise ValueError(
                f"layer {l}: nnx.Dropout(rate={layer.dropout_rate}) needs a step key in training "
                f"mode, but none is bound (it would train with dropout silently off): train it "
                f"with js.train_step, which binds the step key, or call the estimator on "
                f"model.with_rng(key); evaluation (model.apply) runs it off")
        stats = state if state is not None else self.state[l]
        other = rs.fresh(layer.other) if layer.has_rngs else layer.other
        module = nnx.merge(layer.graphdef, p, stats, other)
        dropout_on = train and self.rng is not None
        module.set_attributes(deterministic=not dropout_on, use_running_average=not train,
                              raise_if_not_found=False)
        streams = rs.own_streams(module) if layer.has_rngs else []
        if dropout_on and streams:
            rs.seed_streams(streams, jax.random.fold_in(jax.random.fold_in(self.rng, l),
                                                        rs.STREAMS))
        if dropout_on and layer.has_dropout:
            _bind_dropout(module, jax.random.fold_in(self.rng, l))
        before = rs.counts(streams)
        try:
            out = module(h)
        except TraceContextError as err:  # flax's words name neither the layer nor the way out
            raise ValueError(
                f"layer {l}: {type(module).__name__} changes one of its own variables when "
                f"called ({str(err).splitlines()[0]}); the estimators trace each layer as a pure "
                f"function of its parameters and input, and carry only parameters and BatchNorm "
                f"statistics between steps: keep such a value outside the model, or compute it "
                f"from the layer's input") from err
        where = rs.drawn(streams, before) if train and self.rng is None else None
        if where is not None:
            raise ValueError(
                f"layer {l}: {type(module).__name__} draws from its own RNG stream "
                f"{path_str(where)!r}, but no step key is bound to drive it (jaxstream run's "
                f"engines bind none; it would repeat one draw every step): train it with "
                f"js.train_step, which binds the step key, or call the estimator on "
                f"model.with_rng(key); or pass the randomness in explicitly")
        new = nnx.to_pure_dict(nnx.state(module, nnx.BatchStat)) if layer.has_stats else stats
        return out, new

    @property
    def has_ties(self) -> bool:
        """True if some parameter is shared by several layers (tied weights)."""
        return any(layer.ties for layer in self.layers)

    def tied(self, params: tuple, l: int) -> Any:
        """Layer ``l``'s parameters with the ones it shares read from their owner layers."""
        p = params[l]
        for here, owner, there in self.layers[l].ties:
            p = set_path(p, here, get_path(params[owner], there))
        return p

    def to_nnx(self, params: tuple, state: tuple | None = None) -> nnx.Sequential:
        """The user's model back as an ``nnx.Sequential`` holding ``params`` (e.g. trained
        ones) and the batch statistics ``state`` (default: the initial ones); plain callables
        are kept as they were. The inverse of :func:`from_sequential`.

        Example:
          >>> trained = seq.to_nnx(params)      # then trained(x), nnx.state(trained), ...
        """
        state = self.state if state is None else state
        if len(params) != self.num_layers or len(state) != self.num_layers:
            raise ValueError(f"params: expected one entry per layer ({self.num_layers}), got "
                             f"{len(params)} params and {len(state)} statistics")
        modules = [layer.fn if layer.fn is not None else
                   nnx.merge(layer.graphdef, self.tied(params, l), s, rs.fresh(layer.other))
                   for l, (layer, s) in enumerate(zip(self.layers, state))]
        for l, layer in enumerate(self.layers):  # one Param object per tie again, as built
            for here, owner, there in layer.ties:
                set_attr_path(modules[l], here, get_attr_path(modules[owner], there))
        return nnx.Sequential(*modules)

    def layer_fn(self, l: int, train: bool = True) -> Callable[[Any, jax.Array], jax.Array]:
        """``(params_l, h) -> output`` of layer ``l`` (training mode by default)."""
        return lambda p, h: self.layer(l, p, h, train=train)[0]

    # ------------------------------------------------------------------ whole model
    def apply(self, params: tuple, x: jax.Array, state: tuple | None = None,
              train: bool = False) -> jax.Array:
        """Outputs of inputs ``x``; evaluation mode (running averages of ``state``) by default.

        A model with batch statistics (BatchNorm) needs its ``state`` in evaluation mode: the
        trained running averages (``js.train_step`` keeps them in ``opt_state.model``), or
        ``model.state`` for the initial ones on purpose. Without it the call is refused rather
        than evaluated with the initial statistics.
        """
        if state is None and self.has_state and not train:
            raise ValueError("state: this model keeps batch statistics (BatchNorm); evaluation "
                             "needs the trained running averages: apply(params, x, state) "
                             "(js.train_step keeps them in opt_state.model), or "
                             "state=model.state for the initial ones")
        state = self.state if state is None else state
        h = x
        for l in range(self.num_layers):
            h, _ = self.layer(l, self.tied(params, l), h, train=train, state=state[l])
        return h

    def update_state(self, params: tuple, state: tuple, x: jax.Array, *,
                     micro_batched: bool = False) -> tuple:
        """New running averages after a training-mode pass over ``x`` (not differentiated).

        ``micro_batched``: ``x`` is (N, B, ...), micro-batches a micro-batched estimator (the
        hybrids, ``exact_subset``) fed to the loss one at a time, each normalised by its own
        batch statistics. The result is then the mean over the micro-batches of the update each
        one alone gives from ``state`` (nnx.BatchNorm's ``m·old + (1 − m)·stat_n``, averaged:
        ``m·old + (1 − m)·mean_n stat_n``): the statistics the gradient normalised with, one
        momentum step per training step whatever N. Micro-batch n's pass draws its dropout from
        ``fold_in(rng, n)``, as the estimators' micro-batch passes do.
        """
        params = jax.lax.stop_gradient(params)
        if not micro_batched:
            return self._state_after(params, state, x)
        news = jax.vmap(lambda n, xb: fold_rng(self, n)._state_after(params, state, xb))(
            jnp.arange(jnp.shape(x)[0]), x)
        return jax.tree.map(lambda a, old: jnp.mean(a, axis=0).astype(old.dtype), news, state)

    def _state_after(self, params: tuple, state: tuple, x: jax.Array) -> tuple:
        """The batch statistics after one training-mode pass over the batch ``x``."""
        h, new = x, []
        for l in range(self.num_layers):
            h, s = self.layer(l, self.tied(params, l), h, train=True, state=state[l])
            new.append(s)
        return tuple(new)

    def example_losses(self, params: tuple, batch: Batch) -> jax.Array:
        """Per-example losses in training mode, shape (B,)."""
        return self.example_loss(self.apply(params, batch["x"], train=True), batch)

    def __call__(self, params: tuple, batch: Batch) -> jax.Array:
        """Mean training loss of ``batch``."""
        _check_batch(self, params, batch)
        return jnp.mean(self.example_losses(params, batch))

    def accuracy(self, params: tuple, batch: Batch, state: tuple | None = None) -> jax.Array:
        """Share of correct argmax predictions (evaluation mode)."""
        out = self.apply(params, batch["x"], state)
        return jnp.mean(jnp.argmax(out, axis=-1) == batch["y"])

    def check_layers(self, x: Any) -> None:
        """One training-mode pass over inputs ``x`` traced abstractly (``jax.eval_shape``, no
        compute), so that what a layer refuses -- an ``nnx.Dropout`` or a draw from its own RNG
        streams without a bound key -- is raised before a run starts rather than inside its
        first step."""
        jax.eval_shape(lambda p, h: self.apply(p, h, train=True), self.params, x)

    def check_batch(self, params: tuple, batch: Batch) -> None:
        """Clear errors for the common mistakes, before any layer is traced."""
        _check_batch(self, params, batch)


def fold_rng(loss_fn: Any, index: int | jax.Array) -> Any:
    """``loss_fn`` with ``index`` folded into its model's bound key: micro-batch ``n`` of an
    estimator looping over micro-batches runs ``fold_rng(model, n)`` in every pass, shard ``s``
    of a data-parallel step ``fold_rng(model, s)``, the rule of the tangents (``fold_in(key,
    n)``). So micro-batches and shards draw independent masks, and one micro-batch the same
    masks in its jvp, its exact vjp and a correction's re-evaluation. A loss function without a
    bound key (not a Sequential, or none bound) comes back as it is; ``index`` may be traced."""
    if not isinstance(loss_fn, Sequential) or loss_fn.rng is None:
        return loss_fn
    return loss_fn.with_rng(jax.random.fold_in(loss_fn.rng, index))


def _bind_dropout(module: nnx.Module, key: jax.Array) -> None:
    """Give dropout ``j`` of a freshly merged layer the key ``fold_in(key, j)`` (a plain key, so
    no RNG counter is mutated inside a trace)."""
    dropouts = [m for _, m in nnx.iter_graph(module) if isinstance(m, nnx.Dropout)]
    for j, m in enumerate(dropouts):
        object.__setattr__(m, "rngs", jax.random.fold_in(key, j))


def _check_batch(model: Sequential, params: Any, batch: Any) -> None:
    """Clear errors (before tracing the layers) for the common mistakes."""
    if not isinstance(params, tuple) or len(params) != model.num_layers:
        raise TypeError(f"params: expected the tuple of {model.num_layers} per-layer dicts from "
                        f"model.init(key), got {type(params).__name__}")
    if not isinstance(batch, dict) or "x" not in batch or "y" not in batch:
        raise TypeError("batch: expected a dict with 'x' and 'y'")
    nx, ny = jnp.shape(batch["x"])[:1], jnp.shape(batch["y"])[:1]
    if nx != ny:
        raise ValueError(f"batch: 'x' has {nx[0] if nx else 0} examples, 'y' has "
                         f"{ny[0] if ny else 0}")
    if model.example_loss is cross_entropy and not jnp.issubdtype(
            jnp.result_type(batch["y"]), jnp.integer):
        raise TypeError(f"batch['y']: cross_entropy needs integer class labels, got "
                        f"{jnp.result_type(batch['y'])}")


def _split_layer(element: Any, i: int, ties: list = ()) -> tuple[_Layer, Any, Any]:
    if not isinstance(element, nnx.Module):
        if not callable(element):
            raise TypeError(f"layer {i}: expected an nnx module or a callable, got "
                            f"{type(element).__name__}")
        return _Layer(fn=element), {}, {}
    _check_randomness(element, i)
    graphdef, params, stats, other = nnx.split(element, nnx.Param, nnx.BatchStat, ...)
    rates = [float(m.rate) for _, m in nnx.iter_graph(element) if isinstance(m, nnx.Dropout)]
    own = nnx.to_pure_dict(params)
    for here, _, _ in ties:
        own = without_path(own, here)
    layer = _Layer(graphdef=graphdef, other=other, has_params=bool(jax.tree.leaves(params)),
                   has_stats=bool(jax.tree.leaves(stats)), has_dropout=bool(rates),
                   has_rngs=bool(rs.own_streams(element)), dropout_rate=max(rates, default=0.0),
                   out_size=_out_size(element), ties=tuple(ties))
    return layer, own, nnx.to_pure_dict(stats)


def _out_size(element: nnx.Module) -> int | None:
    """The size of the module's output's last axis where flax states it (``out_features`` of
    an ``nnx.Linear`` or ``nnx.Conv``); None otherwise."""
    size = getattr(element, "out_features", None)
    return size if isinstance(element, (nnx.Linear, nnx.Conv)) and isinstance(size, int) else None


def _check_randomness(element: nnx.Module, i: int) -> None:
    """Refuse randomness that no step key can drive: an RNG variable outside an ``nnx.Rngs``
    stream, a ``dropout_rate`` without a stream to draw the masks from."""
    stray = rs.stray_rng_state(element)
    if stray is not None:
        raise ValueError(
            f"layer {i}: {type(element).__name__} holds an RNG variable at {path_str(stray)!r} "
            f"outside an nnx.Rngs stream, which the step key cannot drive: keep it in an "
            f"nnx.Rngs (self.rngs = rngs), use nnx.Dropout, or pass the randomness in explicitly")
    if rs.own_streams(element):
        return  # a dropout_rate draws from the layer's streams, which the step key drives
    for path, m in nnx.iter_graph(element):
        rate = getattr(m, "dropout_rate", 0.0) if isinstance(m, nnx.Module) else 0.0
        if not isinstance(m, nnx.Dropout) and isinstance(rate, (int, float)) and rate > 0:
            raise ValueError(
                f"layer {i}: {type(m).__name__} at {path_str(path) or 'the layer'!r} has "
                f"dropout_rate={rate} but keeps no RNG stream to draw its masks from (built "
                f"without rngs, or keep_rngs=False): build it with rngs=nnx.Rngs(...), or set "
                f"dropout_rate=0 and put an nnx.Dropout layer in the sequence")


def from_sequential(
    model: nnx.Sequential | Sequence[Any],
    loss: str | Callable[[jax.Array, Batch], jax.Array] = "cross_entropy",
    name: str = "sequential",
) -> Sequential:
    """A :class:`Sequential` loss function from an ``nnx.Sequential`` (or a list of layers).

    Args:
      model: the sequence; each element is a layer (nnx module or plain callable).
      loss: ``"cross_entropy"`` (integer labels), ``"mse"`` (float targets), or a function
        ``(outputs, batch) -> (B,)`` per-example losses.
      name: a label for tables and plots.

    Returns:
      the model; ``model.init(key)`` gives its parameters (a parameter that several layers
      share, such as a tied embedding and head, once, in the first layer using it).

    Example:
      >>> rngs = nnx.Rngs(0)
      >>> cnn = from_sequential(nnx.Sequential(
      ...     nnx.Conv(1, 8, (3, 3), rngs=rngs), nnx.relu,
      ...     lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2)),
      ...     lambda x: x.reshape(x.shape[0], -1), nnx.Linear(128, 10, rngs=rngs)))
    """
    if isinstance(model, nnx.Sequential):
        elements = list(model.layers)
    elif isinstance(model, (list, tuple)):
        elements = list(model)
    else:
        what = "an nnx.Module" if isinstance(model, nnx.Module) else "not a sequence"
        raise TypeError(
            f"model: expected an nnx.Sequential or a list of layers, got "
            f"{type(model).__name__} ({what}): pass nnx.Sequential(...) or a list such as "
            f"[{type(model).__name__ if isinstance(model, nnx.Module) else 'layer'}(...)] "
            f"(a single module is a one-layer model)")
    if not elements:
        raise ValueError("model: the sequence has no layers")
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(f"loss: {loss!r} is not known; choose one of {sorted(LOSSES)} or "
                             "pass a function (outputs, batch) -> per-example losses")
        loss = LOSSES[loss]
    ties = find_ties(elements)
    layers, params, stats = zip(*(_split_layer(e, i, t)
                                  for i, (e, t) in enumerate(zip(elements, ties))))
    return Sequential(tuple(layers), tuple(params), tuple(stats), loss, None, name)
