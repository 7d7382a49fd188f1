"""Matrix-multiply FLOPs of a compiled step, loops counted by their trip counts.

XLA's ``compiled.cost_analysis()`` counts the body of a ``while`` loop once, whatever its trip
count, so a step written as a scan over blocks (every stack in jaxstream) reports the FLOPs of
one block. This counter reads the optimized HLO the step runs instead: every ``dot`` counts
2·(output size)·(contracted size), and a ``while`` body is multiplied by the trip count XLA
proved for it (``known_trip_count``: every ``scan``, ``lax.map`` and ``fori_loop`` with static
bounds); a conditional counts its largest branch. A loop with matrix products whose trip
count XLA does not know, or a convolution, is refused by name rather than guessed.

It counts what XLA runs after its simplifications (a primal computed twice in the source and
merged by XLA counts once), so it compares estimators independently of the machine.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = lambda w, x: jnp.tanh(x @ w).sum()
  >>> w, x = jnp.ones((64, 32)), jnp.ones((8, 64))
  >>> matmul_flops(jax.jit(f).lower(w, x).compile())              # 2 * 8 * 32 * 64
  32768
  >>> matmul_flops(jax.jit(jax.grad(f)).lower(w, x).compile())   # + the weight cotangent
  65536
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* (\S+?)\(")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_OPERANDS = re.compile(r" dot\((?:[\w\[\],{}]+ )?(%[\w.\-]+), ")


def matmul_flops(compiled: Any) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of every matrix product a compiled step
    (``jax.jit(f).lower(*args).compile()``) runs, loops counted by their trip counts."""
    computations, entry = _parse(compiled.as_text())

    @functools.cache
    def total(name: str) -> int:
        count = 0
        shapes: dict[str, list[int]] = {}
        for line in computations[name]:
            d = _DEF.match(line)
            if d:
                shapes[d.group(1)] = [int(s) for s in d.group(2).split(",") if s]
                op = d.group(3)
                if op == "dot":
                    lhs = shapes[_OPERANDS.search(line).group(1)[1:]]
                    dims = [int(i) for i in _CONTRACT.search(line).group(1).split(",") if i]
                    count += 2 * math.prod(shapes[d.group(1)]) * math.prod(lhs[i] for i in dims)
                elif op == "convolution":
                    raise ValueError(f"matmul_flops: {op} in {name} is not counted "
                                     "(matrix products only)")
            callees = dict(_CALLEE.findall(line))
            if "body" in callees:
                inner = total(callees["body"]) + total(callees["condition"])
                trip = _TRIP.search(line)
                if inner and not trip:
                    raise ValueError(
                        f"matmul_flops: a while loop with matrix products in {name} has no "
                        "trip count XLA could prove; write it as a scan")
                count += int(trip.group(1)) * inner if trip else 0
            else:
                count += sum(total(c) for c in callees.values())
            branches = _BRANCHES.search(line)
            if branches:
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                count += max(total(b) for b in names)
        return count

    return total(entry)


def _parse(text: str) -> tuple[dict[str, list[str]], str]:
    """``{computation name: its instruction lines}`` and the entry computation's name."""
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    if not entry:
        raise ValueError("matmul_flops: no ENTRY computation in the compiled module")
    return computations, entry
