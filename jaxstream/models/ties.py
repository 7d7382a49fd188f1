"""Tied parameters of a user's ``nnx.Sequential`` (the same ``nnx.Param`` in two layers: a tied
embedding and head, a module placed twice), and the nested-path helpers that find and move
them between a layer's parameter tree and its module.

Example:
  >>> find_ties([embed, block, embed])[2]   # layer 2 shares the embedding of layer 0
  [(('embedding',), 0, ('embedding',))]
"""

from __future__ import annotations

from typing import Any

from flax import nnx


def find_ties(elements: list) -> list[list[tuple[tuple, int, tuple]]]:
    """Per layer, the parameters it shares with an earlier layer (the same ``nnx.Param``
    object: tied embedding and head, a module placed twice): ``(path here, owner, path
    there)``. A parameter shared inside one layer is nnx's own business (one leaf)."""
    owner: dict[int, tuple[int, tuple]] = {}
    ties: list[list] = [[] for _ in elements]
    for i, element in enumerate(elements):
        if not isinstance(element, nnx.Module):
            continue
        for path, node in nnx.iter_graph(element):
            if isinstance(node, nnx.Param):
                first = owner.setdefault(id(node), (i, tuple(path)))
                if first[0] != i:
                    ties[i].append((tuple(path), first[0], first[1]))
    return ties


def path_str(path: tuple) -> str:
    return "/".join(map(str, path))


def has_path(tree: Any, path: tuple) -> bool:
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return False
        tree = tree[k]
    return True


def get_path(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: tuple, value: Any) -> dict:
    """A copy of the nested dict ``tree`` with ``value`` at ``path`` (levels created)."""
    out = dict(tree)
    out[path[0]] = value if len(path) == 1 else set_path(tree.get(path[0], {}), path[1:], value)
    return out


def without_path(tree: dict, path: tuple) -> dict:
    """A copy of the nested dict ``tree`` without ``path`` (emptied levels removed)."""
    out = dict(tree)
    if len(path) == 1:
        out.pop(path[0])
    else:
        out[path[0]] = without_path(tree[path[0]], path[1:])
        if not out[path[0]]:
            out.pop(path[0])
    return out


def get_attr_path(module: Any, path: tuple) -> Any:
    for k in path:
        module = module[k] if isinstance(k, int) else getattr(module, k)
    return module


def set_attr_path(module: Any, path: tuple, value: Any) -> None:
    parent = get_attr_path(module, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)
