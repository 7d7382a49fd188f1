"""The streamed engines apply the optimizer one layer at a time: refuse one that is not
element-wise, whose update of an entry depends on other entries (a global-norm clip, LAMB's
trust ratio, Adafactor's factored moments), instead of training something else than in memory.

Checked by probing, not by name. First the update's program is traced (no compute): one
without any primitive that combines entries (a reduction, a contraction, a sort, a cumulative
op) is element-wise, as sgd, adam and their kin are. One with such a primitive is run: two updates of a small tree shaped like a unit's parameters
(the unit's own leaves, each axis cut to at most 4), then the same two updates with other
values in part of every leaf's gradient (its second half; every other entry), 10^4 times
larger (other values, not a multiple, which Adam-like normalisers do not see; larger, so a
clip that the first gradient leaves idle acts on the second). An element-wise optimizer moves
the entries left alone identically in every run.

The optimizer must also run the same program (the same primitives in order) on one layer as
on layers stacked along a leading axis, as the blocks are in memory: a mask or a setting that
reads leaf shapes (``ndim > 1``) treats a layer alone otherwise.

Example:
  >>> check_elementwise(optax.adam(1e-3), {"w": jnp.zeros((3, 3))}, "stream")       # passes
  >>> check_elementwise(optax.lamb(1e-3), {"w": jnp.zeros((3, 3))}, "stream")
  Traceback (most recent call last):
  ValueError: stream: optimizer is not element-wise ...
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
import optax

_CUT = 4
# primitives whose outputs combine several entries of an input
_MIXING = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "dot_general", "conv_general_dilated", "cumsum",
    "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k", "fft", "transpose",
    "rev", "gather", "scatter", "scatter-add", "psum", "all_gather"})


def _sub_jaxprs(value: Any) -> list:
    """The jaxprs inside an equation's parameter (a ``jit``'s, a ``cond``'s branches, ...)."""
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a ClosedJaxpr
        return [value.jaxpr]
    if hasattr(value, "eqns"):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _mixes(jaxpr: Any) -> bool:
    """Whether some equation (nested jaxprs included) combines entries of a non-scalar."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MIXING and any(
                int(np.prod(getattr(v.aval, "shape", ()))) > 1 for v in eqn.invars):
            return True
        if any(_mixes(j) for value in eqn.params.values() for j in _sub_jaxprs(value)):
            return True
    return False


def _primitives(jaxpr: Any) -> list[str]:
    """The program's primitives in order, nested jaxprs included (names only: shapes differ)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for value in eqn.params.values():
            for j in _sub_jaxprs(value):
                out.extend(_primitives(j))
    return out


def _program(optimizer: Any, like: Any) -> list[str]:
    """The primitives of one init and update on a tree shaped like ``like``."""
    def step(p):
        return optimizer.update(p, optimizer.init(p), p)
    return _primitives(jax.make_jaxpr(step)(like).jaxpr)


def same_as_stacked(optimizer: Any, like: Any) -> bool:
    """Whether the optimizer runs the same program on one layer (``like``) as on layers
    stacked along a leading axis, as the blocks are in memory: a mask or a setting that reads
    leaf shapes (``mask=lambda p: tree.map(lambda a: a.ndim > 1, p)`` decays a LayerNorm's
    scale in memory, (L, d), and not alone, (d,)) runs another."""
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), like)
    return _program(optimizer, like) == _program(optimizer, stacked)


def _traced_elementwise(optimizer: Any, params: Any) -> bool:
    """The update's program holds no entry-combining primitive (traced, not run)."""
    state = jax.eval_shape(optimizer.init, params)
    return not _mixes(jax.make_jaxpr(optimizer.update)(params, state, params).jaxpr)


def _probe(like: Any, seed: int, scale: float = 100.0) -> Any:
    """Random fp32 values (about ``scale``) in ``like``'s structure, every axis cut to at most
    ``_CUT``."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: np.asarray(scale * rng.standard_normal(
        tuple(min(d, _CUT) for d in x.shape)), np.float32), like)


def _masks(like: Any) -> list[Any]:
    """Which entries a probe changes: the second half of each leaf (flat order), then every
    other entry (so a reduction along any one axis sees a change too)."""
    def half(x):
        return np.arange(np.size(x)).reshape(np.shape(x)) >= np.size(x) // 2

    def odd(x):
        return np.arange(np.size(x)).reshape(np.shape(x)) % 2 == 1
    return [jax.tree.map(half, like), jax.tree.map(odd, like)]


def _mix(mask: Any, a: Any, b: Any) -> Any:
    """``a`` where ``mask``, else ``b``, leaf by leaf."""
    return jax.tree.map(lambda m, x, y: np.asarray(np.where(m, x, y)), mask, a, b)


def _two_steps(optimizer: Any, params: Any, grads: list) -> Any:
    state = optimizer.init(params)
    for g in grads:
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def check_elementwise(optimizer: Any, like: Any, who: str) -> None:
    """ValueError naming ``who`` unless ``optimizer`` updates each entry of a tree shaped like
    ``like`` (a unit's parameters) from that entry's own gradient, value and state alone."""
    params = _probe(like, 0)
    traced = None
    with contextlib.suppress(Exception):  # not traceable alone: the run below says why
        traced = (same_as_stacked(optimizer, like), _traced_elementwise(optimizer, params))
    if traced is not None and not traced[0]:
        raise ValueError(
            f"{who}: optimizer treats a block layer alone differently than the stacked blocks "
            f"in memory (a mask or a setting that reads leaf shapes, e.g. mask=lambda p: "
            f"jax.tree.map(lambda a: a.ndim > 1, p): a LayerNorm scale is (L, d) in memory, "
            f"(d,) alone), and the streamed engines apply it layer by layer; decide by leaf "
            f"name or path instead of shape, or train in memory")
    if traced is not None and traced[1]:
        return
    grads = [_probe(like, 1), _probe(like, 2)]
    other = [_probe(like, 3, 1e6), _probe(like, 4, 1e6)]
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        try:
            base = _two_steps(optimizer, params, grads)
            runs = [(mask, _two_steps(optimizer, params, [_mix(mask, o, g)
                                                          for g, o in zip(grads, other)]))
                    for mask in _masks(params)]
        except Exception as err:  # a tree of one layer's own: the message says so
            raise ValueError(f"{who}: the optimizer cannot update one layer's parameters on "
                             f"their own ({type(err).__name__}: {err}); the streamed engines "
                             f"apply it layer by layer") from err
    if not all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(base)):
        raise ValueError(  # inf or nan everywhere would compare equal and prove nothing
            f"{who}: the optimizer's update is not finite on a probe layer (gradients of about "
            f"100, two steps: a learning rate that overflows float32?), so whether it is "
            f"element-wise, as the streamed engines need, cannot be checked; give a finite "
            f"learning rate")
    kept = [np.allclose(np.asarray(a)[~m], np.asarray(b)[~m], rtol=1e-6, atol=0.0,
                        equal_nan=True)
            for mask, moved in runs
            for a, b, m in zip(jax.tree.leaves(base), jax.tree.leaves(moved),
                               jax.tree.leaves(mask))]
    if not all(kept):
        raise ValueError(
            f"{who}: optimizer is not element-wise: its update of one entry depends on other "
            f"entries (e.g. clip_by_global_norm, lamb, adafactor), and the streamed engines "
            f"apply it layer by layer, which would train something else than in memory; use "
            f"an element-wise one (sgd, adam, adamw, max_adabelief, ...) or train in memory")


def check_units(optimizer: Any, shapes: dict, who: str) -> None:
    """ValueError naming ``who`` unless ``optimizer`` updates each unit (the embed, a block
    layer, the head) alone as it updates that unit within the whole model's tree, as in memory
    (``shapes``: ``{"embed", "blocks" (stacked), "head"}``). A mask or labels function that
    reads the top-level keys sees them in memory and not in a unit's own tree, so it would
    freeze or decay other parameters. Probed on trees cut as :func:`_probe` cuts them."""
    params, grads = _probe(shapes, 5), [_probe(shapes, 6), _probe(shapes, 7)]
    host = jax.local_devices(backend="cpu")[0]
    with jax.default_device(host):
        try:
            whole = _two_steps(optimizer, params, grads)
        except Exception:  # noqa: BLE001 - no whole-tree program: the unit checks stand
            return
        units = [("embed", lambda t: t["embed"]), ("head", lambda t: t["head"])] + [
            (f"block layer {l}", lambda t, l=l: jax.tree.map(lambda a: a[l], t["blocks"]))
            for l in range(jax.tree.leaves(params["blocks"])[0].shape[0])]
        for name, part in units:
            alone = _two_steps(optimizer, part(params), [part(g) for g in grads])
            same = jax.tree.structure(alone) == jax.tree.structure(part(whole)) and all(
                np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0.0, equal_nan=True)
                for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(part(whole))))
            if not same:
                raise ValueError(
                    f"{who}: the optimizer updates the {name} alone otherwise than within the "
                    f"whole model's tree (as in memory), and the streamed engines apply it "
                    f"unit by unit, each unit's own tree (a mask or labels function that "
                    f"reads the top-level keys 'embed' / 'blocks' / 'head'?); decide by leaf "
                    f"name within a unit, or train in memory")
