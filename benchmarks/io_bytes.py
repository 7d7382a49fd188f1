"""Bytes read and written per streamed step and per layer, by kind, for each estimator.

DESIGN §10 counts a step's I/O in bytes, not layers: parameters, optimizer state, scratch,
carried means, the manifest and the deferred updates' records in it. This runs a few steps of
``mlp(64, W, L, 10)`` on a local store for backprop, forward (eager and lazy: replayed at the
next read; and lazy with each layer written back only every k records, ``rewrite_every``) and
the control-variate hybrid (eager and lazy) and prints the steady steps' mean bytes (every step
after the first, which applies no deferred update) as the executor counted them
(:mod:`jaxstream.stream.io_bytes`), per layer the step ran.

Usage:
  python benchmarks/io_bytes.py                              # width 256, depth 8, SGD, k = 8
  python benchmarks/io_bytes.py --width 1024 --optimizer adam --json io.json
  python benchmarks/io_bytes.py --doc docs/streaming.md      # rewrites its marked table
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

CASES = {  # name: (estimator, update, written back every k records: "k" is --rewrite-every)
    "backprop": (jg.backprop, "eager", 1),
    "forward eager": (lambda: jg.forward(num_tangents=1), "eager", 1),
    "forward lazy": (lambda: jg.forward(num_tangents=1), "lazy", 1),
    "forward lazy, rewrite every k": (lambda: jg.forward(num_tangents=1), "lazy", "k"),
    "hybrid eager": (lambda: jg.hybrid(num_exact=2, correction="control_variate"), "eager", 1),
    "hybrid lazy": (lambda: jg.hybrid(num_exact=2, correction="control_variate"), "lazy", 1),
}
KINDS = ("params", "opt", "scratch", "carry", "manifest")


def run_case(name: str, width: int, depth: int, optimizer: str, steps: int, work: Path,
             k: int = 4) -> dict:
    """The mean byte metrics of ``steps`` steps but the first (which applies no deferred
    update)."""
    make, update, every = CASES[name]
    stack = mlp(64, width, depth, 10)
    opt = optax.adam(1e-3) if optimizer == "adam" else optax.sgd(1e-3)
    store = LayerStore.create(str(work / name.replace(" ", "_")),
                              jax.device_get(stack.init(jax.random.key(0))), optimizer=opt)
    ex = StreamedExecutor(stack, make(), opt, store,
                          StreamConfig(compute_dtype="float32", update=update,
                                       rewrite_every=k if every == "k" else every))
    rng = np.random.default_rng(0)
    ms = []
    for t in range(steps):
        batch = {"x": rng.standard_normal((8, 16, 64)).astype(np.float32),
                 "y": rng.integers(0, 10, (8, 16)).astype(np.int32)}
        ms.append(ex.step(batch, jax.random.key(t)))
    keys = [n for n in ms[-1] if n.startswith("bytes") or n == "layers_read"]
    return {"estimator": name.replace("every k", f"every {k}"), "layer_bytes": store.layer_bytes,
            **{n: float(np.mean([m[n] for m in ms[1:]])) for n in keys}}


def _kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def table(rows: list[dict]) -> str:
    """Markdown: per step and per layer (KiB), and each kind read / written per step."""
    head = ("| estimator | layers read | KiB read / layer | KiB written / layer | "
            + " | ".join(f"{k} r / w KiB" for k in KINDS) + " | pending KiB |")
    lines = [head, "|---|---:|---:|---:|" + "---:|" * (len(KINDS) + 1)]
    for r in rows:
        kinds = " | ".join(f"{_kib(r[f'bytes_read_{k}'])} / {_kib(r[f'bytes_written_{k}'])}"
                           for k in KINDS)
        lines.append(f"| {r['estimator']} | {r['layers_read']:.0f} | "
                     f"{_kib(r['bytes_read_per_layer'])} | {_kib(r['bytes_written_per_layer'])} | "
                     f"{kinds} | {_kib(r['bytes_written_pending'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--steps", type=int, default=9,
                   help="steps per case; the mean of all but the first is reported")
    p.add_argument("--rewrite-every", type=int, default=8,
                   help="k of the forward case written back every k records")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--doc", default=None,
                   help="rewrite the <!-- generated: io_bytes.py table --> block of this doc")
    args = p.parse_args(argv)
    if args.width < 1 or args.depth < 1 or args.steps < 2 or args.rewrite_every < 1:
        p.error("--width, --depth and --rewrite-every must be positive, --steps at least 2")
    with tempfile.TemporaryDirectory(prefix="io_bytes_") as tmp:
        rows = [run_case(n, args.width, args.depth, args.optimizer, args.steps, Path(tmp),
                         args.rewrite_every) for n in CASES]
    cmd = "python benchmarks/io_bytes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    what = (f"mlp(64, {args.width}, {args.depth}, 10), 8 x 16 micro-batches, {args.optimizer}, "
            f"layer {rows[0]['layer_bytes']} bytes; mean of steps 2-{args.steps}")
    print(table(rows))
    print(f"\n{what} ({cmd.strip()})")
    if args.doc:
        from jaxstream.experiment.docblock import write_tables

        if not write_tables(args.doc, "io_bytes.py", {"table": f"{table(rows)}\n\n{what}."},
                            cmd.strip()):
            raise SystemExit(f"error: {args.doc} has no <!-- generated: io_bytes.py table --> "
                             "block")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
