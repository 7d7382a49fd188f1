"""Layer groups of a params pytree, and per-group sums of elementwise products.

Every quality measure (cosine, norm ratio, relative error, bias, variance) is a ratio of sums
over coordinates, so it suffices to compute those sums per *group*: for a model stack
(``{"embed", "blocks", "head"}`` with a leading layer axis L on every ``"blocks"`` leaf) the groups
are ``embed``, ``block_0`` ... ``block_{L-1}`` and ``head``; for any other dict or sequence they
are its top-level entries that hold parameters (a parameter-free layer, such as an activation
of an nnx ``Sequential``, is no group: it has nothing to measure); for a bare array the single
group ``all``. The whole tree is always reported as ``all`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

WHOLE = "all"


def _is_stack(tree: Any) -> bool:
    return isinstance(tree, dict) and set(tree) == {"embed", "blocks", "head"}


def _entries(tree: Any) -> list[tuple[str, Any]]:
    """The (name, subtree) top-level groups of a dict or sequence that hold parameters."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    return [(str(k), v) for k, v in items if jax.tree.leaves(v)]


def group_names(tree: Any) -> list[str]:
    """Names of the layer groups of ``tree``, in model order, then ``"all"``.

    Args:
      tree: a params (or gradient) pytree.

    Returns:
      e.g. ``["embed", "block_0", "block_1", "head", "all"]`` for a two-block stack.

    Example:
      >>> group_names({"w": jnp.ones(3), "b": jnp.ones(1)})
      ['w', 'b', 'all']
    """
    if _is_stack(tree):
        leaves = jax.tree.leaves(tree["blocks"])
        num_layers = leaves[0].shape[0] if leaves else 0
        return ["embed", *[f"block_{l}" for l in range(num_layers)], "head", WHOLE]
    if isinstance(tree, (dict, list, tuple)):
        return [name for name, _ in _entries(tree)] + [WHOLE]
    return [WHOLE]


def order_groups(names: list[str]) -> list[str]:
    """Sort group names into model order: ``embed``, ``block_0``, ``block_1``, ..., ``head``,
    other names alphabetically, ``all`` last (jitted outputs come back with sorted keys).

    Example:
      >>> order_groups(["all", "block_10", "head", "block_2", "embed"])
      ['embed', 'block_2', 'block_10', 'head', 'all']
    """

    def rank(name: str) -> tuple:
        if name == "embed":
            return (0, 0, "")
        if name.startswith("block_") and name[6:].isdigit():
            return (1, int(name[6:]), "")
        if name == "head":
            return (2, 0, "")
        if name == WHOLE:
            return (4, 0, "")
        return (3, 0, name)

    return sorted(names, key=rank)


def accumulate(x: jax.Array) -> jax.Array:
    """``x`` in the precision its sums are taken in: float32 for narrower floats (bf16, f16),
    its own for float64 (under ``jax_enable_x64`` a float64 estimate keeps its digits)."""
    return x.astype(jnp.promote_types(jnp.result_type(x), jnp.float32))


def _sum_all(leaves: list[jax.Array]) -> jax.Array:
    return sum((jnp.sum(x) for x in leaves), jnp.zeros((), jnp.float32))


def group_sums(fn: Callable[..., jax.Array], *trees: Any) -> dict[str, jax.Array]:
    """Sum ``fn(*leaves)`` over the coordinates of each group of the trees.

    Args:
      fn: elementwise function of matching leaves, e.g. ``lambda x, y: x * y``.
      *trees: pytrees of identical structure (the first one decides the groups).

    Returns:
      ``{group_name: scalar}`` (float32, float64 for float64 trees) with the names of
      :func:`group_names`.

    Example:
      >>> group_sums(lambda x, y: x * y, g, g_exact)["all"]  # the dot product <g, g_exact>
    """
    ref = trees[0]

    def sums(*subtrees: Any) -> jax.Array:
        vals = jax.tree.map(lambda *xs: fn(*[accumulate(x) for x in xs]), *subtrees)
        return _sum_all(jax.tree.leaves(vals))

    out: dict[str, jax.Array] = {}
    if _is_stack(ref):
        out["embed"] = sums(*[t["embed"] for t in trees])
        block_vals = jax.tree.map(
            lambda *xs: fn(*[accumulate(x) for x in xs]), *[t["blocks"] for t in trees]
        )
        per_layer = [
            jnp.sum(v.reshape(v.shape[0], -1), axis=1) for v in jax.tree.leaves(block_vals)
        ]
        if per_layer:
            layers = sum(per_layer[1:], per_layer[0])
            for l in range(layers.shape[0]):
                out[f"block_{l}"] = layers[l]
        out["head"] = sums(*[t["head"] for t in trees])
        out[WHOLE] = sum((v for v in out.values()), jnp.zeros((), jnp.float32))
        return out
    if isinstance(ref, (dict, list, tuple)):
        keys = list(ref) if isinstance(ref, dict) else range(len(ref))
        for k in keys:
            if jax.tree.leaves(ref[k]):
                out[str(k)] = sums(*[t[k] for t in trees])
    out[WHOLE] = sums(*trees)
    return out


def num_parameters(tree: Any) -> dict[str, int]:
    """Number of coordinates per group (for the ``sqrt(2 / (pi n))`` baselines).

    Example:
      >>> num_parameters({"w": jnp.ones((3, 2)), "b": jnp.ones(2)})
      {'w': 6, 'b': 2, 'all': 8}
    """
    size = lambda t: sum(int(x.size) for x in jax.tree.leaves(t))
    if _is_stack(tree):
        leaves = jax.tree.leaves(tree["blocks"])
        num_layers = leaves[0].shape[0] if leaves else 0
        per_layer = size(tree["blocks"]) // max(num_layers, 1)
        out = {"embed": size(tree["embed"])}
        out.update({f"block_{l}": per_layer for l in range(num_layers)})
        out["head"] = size(tree["head"])
    elif isinstance(tree, (dict, list, tuple)):
        out = {name: size(v) for name, v in _entries(tree)}
    else:
        out = {}
    out[WHOLE] = size(tree)
    return out
