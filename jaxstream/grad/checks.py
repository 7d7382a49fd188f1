"""Checks of an estimator call's arguments, run before anything is traced.

Each raises an error that names the argument (``key``, ``batch['y']``, ...) and what is
allowed, so a wrong call fails at once instead of deep inside a loss after seconds of tracing.

Example:
  >>> check_key(0, "forward")
  Traceback (most recent call last):
  TypeError: forward: key must be a PRNG key such as jax.random.key(0); got int
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.models.padded_stack import PaddedView
from jaxstream.models.seq_stack import StackView
from jaxstream.models.sequential import Sequential
from jaxstream.models.stack import Stack, cross_entropy


def check_key(key: Any, who: str) -> None:
    """A typed key (``jax.random.key``) or a raw uint32 key (``jax.random.PRNGKey``)."""
    if key is None:
        raise TypeError(f"{who}: key is required (its tangents are random): pass "
                        "jax.random.key(seed)")
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if jnp.ndim(key) != 0:
            raise TypeError(f"{who}: key must be a single key (shape ()), got shape "
                            f"{jnp.shape(key)}; vmap the estimator over a batch of keys")
        return
    if dtype == jnp.uint32 and jnp.shape(key) == (2,):
        return
    raise TypeError(f"{who}: key must be a PRNG key such as jax.random.key(0); got "
                    f"{type(key).__name__}" + (f" of dtype {dtype} and shape {jnp.shape(key)}"
                                               if dtype is not None else ""))


#: The callers built on local losses alone (no ``local_losses`` argument to turn them off).
ALWAYS_LOCAL = ("local_forward_weights", "local_guess", "local_targets")


def check_local_losses(stack: Any, local_losses: bool, who: str) -> None:
    """Local losses apply the head to every block's output: refused for a stack without a shared
    head (:func:`jaxstream.models.as_padded_stack`), naming what ``who`` can do instead."""
    if local_losses and isinstance(stack, Stack) and not stack.shared_head:
        always = who in ALWAYS_LOCAL  # no local_losses switch to turn off
        what = "its local losses (always on) apply" if always else "local_losses=True applies"
        fix = ("allowed: local_losses=False" if who == "forward" else
               "allowed: an estimator without local losses (backprop, the hybrids, forward(...) "
               "with local_losses=False)" + (", e.g. on the model itself" if always else ""))
        raise ValueError(f"{who}: {what} the head to every block's output, but {stack.name!r} has "
                         f"no shared head (a padded stack: its blocks' outputs differ); {fix}")


def _leaves(batch: Any) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    return [(f"batch{jax.tree_util.keystr(path)}", leaf) for path, leaf in flat]


def check_examples(batch: Any, who: str, axis: int = 0) -> None:
    """Every leaf has the same number of examples along ``axis``."""
    leaves = _leaves(batch)
    if not leaves:
        raise ValueError(f"{who}: batch has no arrays")
    sizes = {}
    for name, leaf in leaves:
        if jnp.ndim(leaf) <= axis:
            raise ValueError(f"{who}: {name} has shape {jnp.shape(leaf)}; every batch leaf needs "
                             f"an examples axis {axis}")
        sizes[name] = jnp.shape(leaf)[axis]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{who}: batch leaves disagree in their number of examples (axis "
                         f"{axis}): " + ", ".join(f"{k}: {v}" for k, v in sizes.items()))


def check_micro_batches(batch: Any, who: str) -> int:
    """Leaves (N, B, ...): a leading micro-batch axis, then the examples. Returns N."""
    leaves = _leaves(batch)
    for name, leaf in leaves:
        if jnp.ndim(leaf) < 2:
            raise ValueError(
                f"{who}: {name} has shape {jnp.shape(leaf)}, but needs a leading micro-batch "
                "axis N and then the examples (N, B, ...); split a flat batch with "
                "jax.tree.map(lambda a: a.reshape(N, -1, *a.shape[1:]), batch)")
    check_examples(batch, who, 0)
    check_examples(batch, who, 1)
    return int(jnp.shape(leaves[0][1])[0])


def check_loss_fn(loss_fn: Any, who: str) -> None:
    """A loss function, not a raw nnx module (a user's ``nnx.Sequential`` is wrapped first)."""
    from flax import nnx

    if isinstance(loss_fn, (StackView, PaddedView)):
        kind = "as_stack" if isinstance(loss_fn, StackView) else "as_padded_stack"
        raise TypeError(
            f"{who}: loss_fn is a {type(loss_fn).__name__} (js.models.{kind}(model)), not a loss "
            f"function (params, batch) -> scalar: pass view.stack with view.params(params), or "
            f"the model itself with params = model.init(key)")
    if isinstance(loss_fn, nnx.Module):
        name = type(loss_fn).__name__
        arg = "seq" if isinstance(loss_fn, nnx.Sequential) else f"[{name.lower()}]"
        raise TypeError(
            f"{who}: loss_fn is an nnx module ({name}), not a loss function (params, batch) -> "
            f"scalar: wrap it with model = js.models.from_sequential({arg}, loss='cross_entropy') "
            f"and pass model with params = model.init(key)")


def check_stack(stack: Any, who: str) -> None:
    """A model :class:`Stack` (what an engine built on blocks runs), named with its fix when
    it is a stack view, a sequential model or an nnx module."""
    from flax import nnx

    if isinstance(stack, Stack):
        return
    if isinstance(stack, (StackView, PaddedView)):
        kind = "as_stack" if isinstance(stack, StackView) else "as_padded_stack"
        raise TypeError(
            f"{who}: got a {type(stack).__name__} (js.models.{kind}(model)); it runs view.stack, "
            f"with the model's parameters as view.params(params)")
    fix = ("js.models.as_stack(model) (or as_padded_stack(model, x)) and pass view.stack, "
           "with view.params(params)")
    kind = type(stack).__name__
    if isinstance(stack, nnx.Module):
        fix, kind = "js.models.from_sequential(...), then " + fix, f"an nnx module ({kind})"
    elif not isinstance(stack, Sequential):
        fix = "js.models.mlp(...) or a user's model through " + fix
    raise TypeError(f"{who}: needs a model Stack, got {kind}: make one with {fix}")


def check_stack_params(stack: Stack, params: Any, who: str) -> None:
    """Parameters in the stack's layout ``{"embed", "blocks", "head"}``; a sequential model's
    (one entry per layer) are named with the view that converts them."""
    if isinstance(params, dict) and {"embed", "blocks", "head"} <= set(params):
        return
    kind = type(params).__name__
    hint = (" (a sequential model's, one per layer: convert them with view.params(params) of "
            "the view whose view.stack this is)" if isinstance(params, (tuple, list)) else "")
    raise TypeError(f"{who}: params must be the stack's layout, a dict with 'embed', 'blocks' "
                    f"and 'head', as stack.init(key) makes; got a {kind}{hint}")


def check_labels(loss_fn: Callable, batch: Any, who: str, read: bool = True) -> None:
    """A loss function (:func:`check_loss_fn`) and, for a stack or a sequential model trained
    with cross-entropy, integer labels ``batch['y']``; concrete (untraced) labels also in
    ``[0, num_classes)`` (:func:`check_label_range`). ``read=False``: labels held by a device
    are not read back for it (a streamed step reads nothing back on its main thread); NumPy
    labels still are."""
    check_loss_fn(loss_fn, who)
    if not (isinstance(loss_fn, (Stack, Sequential)) and loss_fn.example_loss is cross_entropy):
        return
    if not isinstance(batch, dict) or "x" not in batch or "y" not in batch:
        if isinstance(loss_fn, Sequential):
            return  # the model's own check names what is missing
        raise ValueError(f"{who}: a model Stack needs batch = {{'x': inputs, 'y': labels}}; got "
                         f"{type(batch).__name__} with keys {sorted(batch) if isinstance(batch, dict) else '-'}")
    y = batch["y"]
    if jnp.size(y) == 0:  # a mean over no examples: nan, or an index error deep in a trace
        raise ValueError(f"{who}: the batch holds no examples (batch['y'] has shape "
                         f"{tuple(jnp.shape(y))}); give at least one")
    if not jnp.issubdtype(jnp.result_type(y), jnp.integer):
        raise TypeError(f"{who}: batch['y'] holds {jnp.result_type(y)} values; cross-entropy needs "
                        "integer class labels (e.g. y.astype(jnp.int32))")
    if read or not isinstance(y, jax.Array):
        check_label_range(y, loss_fn.num_classes, who)


def check_inputs(loss_fn: Any, params: Any, batch: Any, who: str, micro: bool = False) -> None:
    """For a model :class:`Stack`: ``batch['x']`` (one micro-batch of it with ``micro``) fits
    the model's input, checked on shapes alone (``jax.eval_shape`` of its embed), so a wrong
    feature count is named here rather than by a matrix product deep in the trace."""
    if not (isinstance(loss_fn, Stack) and isinstance(batch, dict) and "x" in batch
            and isinstance(params, dict) and "embed" in params):
        return
    x = batch["x"]
    shape = tuple(jnp.shape(x))[1:] if micro else tuple(jnp.shape(x))
    try:
        jax.eval_shape(loss_fn.embed, params["embed"],
                       jax.ShapeDtypeStruct(shape, jnp.result_type(x)))
    except (TypeError, ValueError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{who}: batch['x'] ({jnp.result_type(x)}, shape "
                         f"{tuple(jnp.shape(x))}) does not fit the model's input ({why}); check "
                         "its shape and dtype against the model's input") from None


def check_label_range(y: Any, num_classes: int | None, who: str) -> None:
    """Concrete integer labels lie in ``[0, num_classes)`` (only ``>= 0`` where the model's
    number of classes is not known): out of range, cross-entropy would silently read another
    class (-1: the last) or give nan. Traced labels (inside jit or vmap) are not checked."""
    if isinstance(y, jax.core.Tracer) or jnp.size(y) == 0:
        return
    if isinstance(y, jax.Array) and not y.is_fully_addressable:
        return  # spread over processes: not readable by one (not checked here)
    y = np.asarray(y)  # on the host: a jnp reduction inside a trace would be staged
    lo, hi = int(y.min()), int(y.max())
    bad = lo if lo < 0 else hi if num_classes is not None and hi >= num_classes else None
    if bad is not None:
        allowed = (f"[0, {num_classes}) (the model's {num_classes} classes)"
                   if num_classes is not None else "0 and above")
        raise ValueError(f"{who}: batch['y'] holds the label {bad}; cross-entropy needs class "
                         f"labels in {allowed}")
