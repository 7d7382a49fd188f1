"""Small helpers the sweeps share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def kept(hosts: dict, kernel: Callable) -> Callable:
    """A unit kernel ``kernel(u, dev, state)`` as a driver kernel that keeps the unit's host
    params in ``hosts`` until its gradient is done."""
    def run(u, loaded, state):
        hosts[u], dev = loaded
        return kernel(u, dev, state)
    return run


def copying(tree: Any) -> Any:
    """``tree`` with the copy to the host of its device arrays started (not waited for)."""
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and a.is_fully_addressable:
            a.copy_to_host_async()
    return tree


def unit_grad(u: Any, out: tuple) -> tuple:
    """``((h,), [(u, gradient)])`` from an embed / head kernel's ``(h, gradient)``."""
    h, g = out
    return (h,), [(u, g)]
