"""A user's ``nnx.Sequential`` as a :class:`~jaxstream.models.Stack`, so that the engines that
place or stream *identical blocks* (pipeline stages, the layer store, the composed engine) run it.

A sequence such as ``Linear(64, 32), relu, [Linear(32, 32), relu] × 6, Linear(32, 10)`` has a
repeated group of layers: :func:`as_stack` finds the longest run of a repeated group
(same layer types, same parameter shapes) and makes the layers before it the stack's embed,
each repetition one block (its parameters stacked over the repetitions), and the layers after
it the head. The layers outside the run may change shapes freely. A sequence without a repeated
group (the tutorial CNN) is refused here with a clear error; :func:`~jaxstream.models.
padded_stack.as_padded_stack` pads its layers into a stack instead, and its in-memory estimators
run on the :class:`~jaxstream.models.sequential.Sequential` itself.

Gradients through the view are the model's (``view.unstack``). Forward-mode estimators draw
their tangents per block of the view, not per layer of the model, so for the same key their
estimates on ``view.stack`` and on the model are different draws of the same distribution.

Example:
    >>> rngs = nnx.Rngs(0)
    >>> model = from_sequential(nnx.Sequential(
    ...     nnx.Linear(8, 16, rngs=rngs), nnx.relu,
    ...     *[m for _ in range(4) for m in (nnx.Linear(16, 16, rngs=rngs), nnx.relu)],
    ...     nnx.Linear(16, 3, rngs=rngs)))
    >>> view = as_stack(model)          # embed: 2 layers, 4 blocks of 2 layers, head: 1 layer
    >>> params = view.params(model.init(jax.random.key(0)))
    >>> loss, grads = jaxstream.grad.backprop()(view.stack, params, batch, key)
    >>> seq_grads = view.unstack(grads)  # back in the model's layout
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.models import rng_streams as rs
from jaxstream.models.sequential import Sequential
from jaxstream.models.stack import Stack


@dataclasses.dataclass(frozen=True, eq=False)
class StackView:
    """A sequential model seen as embed → ``repeats`` blocks of ``period`` layers → head.

    Attributes:
      stack: the :class:`Stack` (one object per model: jitted engines cache on it).
      first: index of the first layer of the first block.
      period: layers per block.
      repeats: number of blocks.
      model: the sequential model.
    """

    stack: Stack
    first: int
    period: int
    repeats: int
    model: Sequential

    def params(self, seq_params: tuple) -> dict:
        """The model's parameters (one dict per layer) in the stack's layout: each segment a
        dict ``{"j": params of its j-th layer}`` over the layers that have parameters (the
        layout a layer store keeps)."""
        f, g, r = self.first, self.period, self.repeats
        groups = [_segment(seq_params[f + k * g:f + (k + 1) * g]) for k in range(r)]
        return {"embed": _segment(seq_params[:f]),
                "blocks": jax.tree.map(lambda *a: jnp.stack(a), *groups),
                "head": _segment(seq_params[f + r * g:])}

    def unstack(self, params: dict) -> tuple:
        """Stack-layout parameters (or gradients) back in the model's layout."""
        f, g, r = self.first, self.period, self.repeats
        blocks = [jax.tree.map(lambda a, k=k: a[k], params["blocks"]) for k in range(r)]
        out = _unsegment(params["embed"], f)
        for b in blocks:
            out += _unsegment(b, g)
        return out + _unsegment(params["head"], self.model.num_layers - f - r * g)


def _segment(layers: tuple) -> dict:
    return {str(j): p for j, p in enumerate(layers) if jax.tree.leaves(p)}


def _unsegment(seg: dict, n: int) -> tuple:
    return tuple(seg.get(str(j), {}) for j in range(n))


def _signature(model: Sequential, l: int, statics: bool = True) -> Any:
    """What two layers must share to be one block's layer: the module (its graph definition,
    static attributes included; ``statics=False``: only its modules' types), the parameters'
    structure, shapes and dtypes; a plain callable itself."""
    layer = model.layers[l]
    if layer.fn is not None:
        return ("fn", layer.fn)
    shapes = tuple((tuple(np.shape(a)), str(jnp.result_type(a)))
                   for a in jax.tree.leaves(model.params[l]))
    kind = layer.graphdef if statics or layer.ties else tuple(
        (tuple(path), type(m)) for path, m in nnx.iter_graph(_module(model, l))
        if isinstance(m, nnx.Module))
    return ("module", kind, jax.tree.structure(model.params[l]), shapes)


def _module(model: Sequential, l: int) -> nnx.Module:
    """Layer ``l`` as an nnx module holding its initial parameters."""
    layer = model.layers[l]
    return nnx.merge(layer.graphdef, model.params[l], model.state[l], rs.fresh(layer.other))


def _longest_run(model: Sequential, sig: list) -> tuple[int, int, int] | None:
    """``(first, period, repeats)`` of the longest run of a group of ``sig`` repeated at least
    twice in a row with some parameters (most layers covered; then the shortest period)."""
    n, best = len(sig), None
    for g in range(1, n // 2 + 1):
        for f in range(n - 2 * g + 1):
            r = 1
            while f + (r + 1) * g <= n and sig[f + r * g:f + (r + 1) * g] == sig[f:f + g]:
                r += 1
            if r >= 2 and any(model.layers[f + j].has_params for j in range(g)):
                key = (r * g, -g)
                if best is None or key > best[0]:
                    best = (key, (f, g, r))
    return None if best is None else best[1]


def _statics(module: nnx.Module) -> dict[str, Any]:
    """The module's static attributes (not parameters, statistics or submodules) by path."""
    return {"/".join(map(str, path)): node for path, node in nnx.iter_graph(module)
            if path and isinstance(path[-1], str) and not path[-1].startswith("_")
            and not isinstance(node, (nnx.Module, nnx.Variable, nnx.Pytree, jax.Array))}


def _static_difference(model: Sequential, run: tuple[int, int, int]) -> str:
    """``"layers 1, 2, 3 (Res) differ in alpha: 0.5, 1.0, 2.0"`` for the first layer of a
    run's group whose repetitions differ only in static attributes."""
    f, g, r = run
    for j in range(g):
        layers = [f + k * g + j for k in range(r)]
        if any(model.layers[l].fn is not None or model.layers[l].ties for l in layers):
            continue
        statics = [_statics(_module(model, l)) for l in layers]
        names = [k for k in statics[0] if any(_differ(s.get(k), statics[0][k])
                                               for s in statics[1:])]
        if names:
            values = ", ".join(repr(s.get(names[0])) for s in statics)
            kind = type(_module(model, layers[0])).__name__
            return (f"layers {', '.join(map(str, layers))} ({kind}) differ in {names[0]!r}: "
                    f"{values}")
    return f"layers {f}..{f + r * g - 1} differ in a static attribute"


def _differ(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except (TypeError, ValueError):  # a comparison that is not one bool (an array)
        return a is not b


def find_blocks(model: Sequential) -> tuple[int, int, int]:
    """``(first, period, repeats)`` of the longest run of a repeated group of layers (most
    layers covered; then the shortest period), repeats ≥ 2; raises ValueError if none, naming
    the static attribute (e.g. ``alpha=0.5`` vs ``1.0``) where only such attributes differ."""
    run = _longest_run(model, [_signature(model, l) for l in range(model.num_layers)])
    if run is not None:
        return run
    loose = _longest_run(model, [_signature(model, l, statics=False)
                                 for l in range(model.num_layers)])
    if loose is not None:
        raise ValueError(
            f"model: {model.name!r} repeats a group of layers with the same types and parameter "
            f"shapes, but their static attributes differ ({_static_difference(model, loose)}), "
            "so one compiled block cannot serve them all: make the attribute a parameter or an "
            "input, or use jaxstream.models.as_padded_stack(model, x), which runs every block's "
            "own layers")
    raise ValueError(
        f"model: {model.name!r} has no repeated group of layers (the same layer types and "
        "parameter shapes at least twice in a row), so it has no identical blocks to place "
        "over pipeline stages or stream from a layer store: use "
        "jaxstream.models.as_padded_stack(model, x), which pads its layers to one shape; "
        "its in-memory estimators run on the model itself")


def check_pure(model: Sequential) -> None:
    """Raises ValueError if the model keeps batch statistics, uses dropout or its own RNG streams,
    or shares a parameter between layers: a stack's blocks are pure functions of their own parameters and inputs."""
    for l, layer in enumerate(model.layers):
        for here, owner, there in layer.ties:
            raise ValueError(
                f"model: {model.name!r} layer {l} shares its parameter {'/'.join(map(str, here))!r}"
                f" with layer {owner} ({'/'.join(map(str, there))!r}, tied weights); a stack's "
                "segments hold their own parameters, so the tie cannot be kept on the pipeline, "
                "streamed or composed engines: train the tied model in memory (backprop, weight "
                "perturbation, the hybrids), or untie the layers")
    if model.has_state or any(layer.has_dropout for layer in model.layers):
        raise ValueError(f"model: {model.name!r} has BatchNorm statistics or dropout; as a stack "
                         "(pipeline stages, streamed layers) its blocks must be pure functions of "
                         "parameters and inputs: remove them or train it in memory")
    for l, layer in enumerate(model.layers):
        if layer.has_rngs:
            raise ValueError(
                f"model: {model.name!r} layer {l} keeps its own nnx.Rngs streams (random draws); "
                "as a stack (pipeline stages, streamed layers) its blocks must be pure functions "
                "of parameters and inputs: train it in memory (js.train_step drives the streams "
                "with the step key), or pass the randomness in explicitly")


def run_layers(model: Sequential, layers: tuple[int, ...], params: dict, h: jax.Array):
    """The model's ``layers`` applied to ``h``; ``params`` a segment ``{"j": params of its j-th
    layer}`` (layers without parameters absent)."""
    for j, l in enumerate(layers):
        h = model.layer_fn(l)(params.get(str(j), {}), h)
    return h


def check_shared_buffers(model: Sequential, f: int, g: int, r: int) -> None:
    """ValueError unless every block's layers hold the first block's non-trainable variables
    (an ``nnx.Variable`` that is neither a parameter nor RNG state, e.g. a fixed scale): the
    stack's blocks all run the first block's layers, so another block's own values would be
    replaced by the first's, silently."""
    def buffers(l: int) -> dict:
        other = model.layers[l].other  # None: a plain function
        return {} if other is None else {path: np.asarray(v.get_value()) for path, v in
                                         nnx.to_flat_state(other)
                                         if not isinstance(v, nnx.RngState)}
    for k in range(1, r):
        for j in range(g):
            first, here = buffers(f + j), buffers(f + k * g + j)
            for path, a in first.items():
                b = here.get(path)
                if b is None or a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
                    raise ValueError(
                        f"as_stack: layer {f + k * g + j} holds its own value of the "
                        f"non-trainable variable {'.'.join(map(str, path))!r} (layer {f + j}, "
                        f"the same layer of the first block, holds another); a stack's blocks "
                        f"all run the first block's layers, so it would be replaced: make it an "
                        f"nnx.Param, or use as_padded_stack (each layer keeps its own)")


def as_stack(model: Sequential) -> StackView:
    """The model as a :class:`Stack` (see the module docstring).

    Raises:
      ValueError: no repeated group of layers; or the model keeps batch statistics, uses
        dropout, ties parameters of two layers or holds non-trainable variables that differ
        between blocks (a stack's blocks are pure functions of their own parameters and
        inputs).
    """
    check_pure(model)
    f, g, r = find_blocks(model)
    check_shared_buffers(model, f, g, r)
    run = functools.partial(run_layers, model)

    embed_l, head_l = tuple(range(f)), tuple(range(f + r * g, model.num_layers))
    block_l = tuple(range(f, f + g))  # every repetition runs the first group's layers
    stack = Stack(
        embed=lambda p, x: run(embed_l, p, x),
        block=lambda p, h: run(block_l, p, h),
        head=lambda p, h: run(head_l, p, h),
        example_loss=model.example_loss,
        init=lambda key: None,
        num_layers=r, name=model.name, num_classes=model.num_classes)
    view = StackView(stack, f, g, r, model)
    return dataclasses.replace(view, stack=dataclasses.replace(
        stack, init=lambda key: view.params(model.init(key))))
