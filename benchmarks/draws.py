"""Tangent draws: the library's one-pass hash against ``jax.random``'s, in the same rounds.

    python benchmarks/draws.py --json draws.json
    python benchmarks/draws.py --doc docs/quality.md    # writes its table there

A round draws ``--draws`` tangents of a ``--size``-entry leaf (default 512 x 512, a width-512
kernel), each from its own key in a ``lax.scan`` and summed (the least any use of a draw costs),
for Rademacher signs (:func:`jaxstream.grad.tangents.rademacher_bits`, 32 signs per word) and
Gaussian entries (one word each). Each is drawn twice: by the library
(:func:`jaxstream.grad.threefry.random_words` / :func:`~jaxstream.grad.threefry.random_normal`,
Threefry's 20 rounds in one pass over the words) and by ``jax.random.bits`` /
``jax.random.normal`` (on CPU a loop of five passes). The two draw the same values (checked
here on the first draw); the four steps are timed in interleaved rounds and their medians
printed as a table, with each library step's time over its ``jax.random`` baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.experiment.docblock import machine
from jaxstream.grad.tangents import rademacher_bits
from jaxstream.grad.threefry import random_normal


def jax_signs(key: jax.Array, size: int) -> jax.Array:
    """``rademacher_bits(key, 1, size)`` unpacked from ``jax.random.bits`` words."""
    words = jax.random.bits(key, (1, -(-size // 32)), jnp.uint32)
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    return 1.0 - 2.0 * bits.reshape(1, -1)[:, :size].astype(jnp.float32)


DRAWS: dict[str, Callable[[jax.Array, int], jax.Array]] = {
    "rademacher": lambda k, n: rademacher_bits(k, 1, n),
    "rademacher, jax.random.bits": jax_signs,
    "gaussian": lambda k, n: random_normal(k, (1, n)),
    "gaussian, jax.random.normal": lambda k, n: jax.random.normal(k, (1, n), jnp.float32),
}
BASELINE = {"rademacher": "rademacher, jax.random.bits", "gaussian": "gaussian, jax.random.normal"}


def round_of(draw: Callable, size: int, draws: int) -> Callable[[jax.Array], jax.Array]:
    """``key -> Σ`` of ``draws`` tangents, each from ``fold_in(key, i)``."""
    def run(key):
        body = lambda acc, i: (acc + draw(jax.random.fold_in(key, i), size).sum(), None)
        return jax.lax.scan(body, jnp.float32(0), jnp.arange(draws))[0]
    return jax.jit(run)


def measure(size: int, draws: int, rounds: int) -> dict:
    """Median ms per round of each draw, timed in interleaved rounds."""
    key = jax.random.key(0)
    for ours, base in BASELINE.items():
        a, b = (np.asarray(DRAWS[n](jax.random.fold_in(key, 1), size)) for n in (ours, base))
        if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            raise AssertionError(f"{ours}: the library's draw differs from {base}'s")
    steps = {name: round_of(fn, size, draws) for name, fn in DRAWS.items()}
    for f in steps.values():
        jax.block_until_ready(f(key))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, f in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(key))
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def table(ms: dict) -> str:
    """Markdown: ms per round, and the library's time over ``jax.random``'s."""
    lines = ["| draw | ms per round | / jax.random |", "|---|---:|---:|"]
    for name, t in ms.items():
        ratio = f"{t / ms[BASELINE[name]]:.2f}" if name in BASELINE else "1"
        lines.append(f"| {name} | {t:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512 * 512)
    ap.add_argument("--draws", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--doc", help="write the table into this doc's draws.py block")
    args = ap.parse_args(argv)
    ms = measure(args.size, args.draws, args.rounds)
    print(f"{args.draws} draws of {args.size} entries per round, {args.rounds} rounds; {machine()}")
    print(table(ms))
    out = {"size": args.size, "draws": args.draws, "rounds": args.rounds, "ms": ms,
           "machine": machine()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if args.doc:
        from jaxstream.experiment.docblock import write_tables

        what = f"{args.draws} draws of {args.size} entries per round, medians of {args.rounds} rounds."
        cmd = "python benchmarks/draws.py " + " ".join(sys.argv[1:] if argv is None else argv)
        if not write_tables(args.doc, "draws.py", {"table": f"{table(ms)}\n\n{what}"},
                            cmd.strip()):
            raise SystemExit(f"error: {args.doc} has no <!-- generated: draws.py table --> block")
    return out


if __name__ == "__main__":
    main()
