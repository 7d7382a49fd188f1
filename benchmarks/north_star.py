"""North star: a streamed step against the same step in memory, side by side in one process.

The project trains models larger than device memory by streaming their layers from a store, at
close to in-memory speed. This measures that ratio as a new user would meet it: the model
``mlp(64, W, 8, 10)`` (depth 8), 8 micro-batches × 16, SGD, the streamed executor on a local
store (what ``engine: {type: stream}`` builds: the commit on a thread, backprop's residuals
kept) against ``jaxstream.train_step`` in memory.

Estimators: backprop, backprop with its reverse sweep recomputing each block's forward
(``residuals="recompute"``, the streamed step before residuals were kept), forward (weights,
K = 1; eager, and lazy with a layer written every 4th step: ``update="lazy",
rewrite_every=4``, one read per layer and a quarter of the writes), forward (activations,
K = 1) and the control-variate hybrid (2 exact of 8) with the eager and the lazy update;
``NAME_q2`` (named with ``--estimators``): the same with two units' host updates queued beside
the compute (``StreamConfig(updates_in_flight=2)``). Widths 256 / 1024 / 2048. Page cache warm, and cold: before each cold step every file of the store is fsynced and
dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``; not timed).

Steps are interleaved in one process (per round: each estimator's in-memory step, its warm
streamed step, its cold streamed step), so load from other work hits every column alike;
medians and min–max spread per column. Per streamed step it also records:

* ``blocking``: blocking device→host materialisations on the main thread, counted from outside
  the executor (``np.asarray``, ``float``, ``.item()``, ``device_get``, ``block_until_ready``
  of a device array: :class:`BlockingCounter`), plus the executor's own count when its metrics
  carry one;
* bytes read / written per step: what the step's reads and writes moved (parameters,
  optimizer state, scratch, carried means, manifest; the executor's ``bytes_read`` /
  ``bytes_written``, :mod:`jaxstream.stream.io_bytes`);
* idle per cause: the device's idle time by what the main thread waited for — a read
  (``stall_idle``), the host worker (``wait_update_idle``), the commit — each the part of
  the wait after the work already dispatched was computed (:mod:`jaxstream.stream.idle`), so
  the causes are disjoint; ``other_s`` = excess − their sum, where the excess is the streamed
  step's median minus the in-memory step's: what the device spent beyond the in-memory
  step's compute (per-unit dispatch, smaller kernels, host work beside it on a CPU backend).

Usage:
  python benchmarks/north_star.py --quick                      # width 256, 3 rounds (< 2 min)
  python benchmarks/north_star.py --json ns.json               # widths 256 1024 2048
  python benchmarks/north_star.py --json ns.json --doc docs/streaming.md
  python benchmarks/north_star.py --from-json ns.json --doc docs/streaming.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxstream as js
import jaxstream.grad as jg

DEPTH, IN_DIM, CLASSES, MICRO, MICRO_SIZE = 8, 64, 10, 8, 16
LR = 1e-3
WIDTHS = (256, 1024, 2048)
ESTIMATORS = ("backprop", "backprop_recompute", "forward_weights", "forward_lazy_k4",
              "forward_activations", "hybrid_eager",
              "hybrid_lazy")
# "<estimator>_q2": the same step with two units' host updates queued beside the compute
# (StreamConfig.updates_in_flight=2); only when named with --estimators
IN_FLIGHT_2 = "_q2"
# the doc blocks this script writes (--block): the north-star table, and one or two updates in
# flight side by side
BLOCKS = ("table", "in_flight")
CACHES = ("warm", "cold")
IGNORED = ("step_time_s", "host_update_s")  # the step itself; a total mostly overlapped


def estimator(name: str) -> tuple[Any, dict, bool]:
    """(estimator, its :class:`StreamConfig` options beside the common ones, whether the
    in-memory step takes micro-batches)."""
    if name == "backprop":
        return jg.backprop(), {}, False
    if name == "backprop_recompute":  # the reverse sweep before residuals were kept
        return jg.backprop(), {"residuals": "recompute"}, False
    if name == "forward_weights":
        return jg.forward(num_tangents=1), {}, False
    if name == "forward_lazy_k4":  # the I/O-optimal forward step: one read, 1/4 of the writes
        return jg.forward(num_tangents=1), {"update": "lazy", "rewrite_every": 4}, False
    if name == "forward_activations":
        return jg.forward(num_tangents=1, perturb="activations"), {}, False
    if name in ("hybrid_eager", "hybrid_lazy"):
        est = jg.hybrid(num_exact=2, correction="control_variate")
        return est, {"update": name.split("_")[1]}, True
    if name.endswith(IN_FLIGHT_2) and name[:-len(IN_FLIGHT_2)] in ESTIMATORS:
        est, options, micro = estimator(name[:-len(IN_FLIGHT_2)])
        return est, {**options, "updates_in_flight": 2}, micro
    raise ValueError(f"unknown estimator {name!r}; allowed: {', '.join(ESTIMATORS)} (each "
                     f"also as NAME{IN_FLIGHT_2})")


# ------------------------------------------------------------------------ blocking counter
class BlockingCounter:
    """Counts blocking device→host materialisations on the main thread while counting.

    Patched from outside the code under test, so it works on any executor version: every call
    on the main thread of ``np.asarray`` / ``np.array`` / ``jax.device_get`` /
    ``jax.block_until_ready`` with a device array in its arguments, and every ``float``,
    ``int``, ``bool``, ``.item()``, ``.tolist()``, ``np.asarray`` (``__array__``) and
    ``.block_until_ready()`` of a device array (nested calls count once). On the CPU backend
    the copy itself is free, but the wait for the device's queue is the same wait; worker
    threads (host optimizer, writer) are not counted."""

    METHODS = ("__array__", "__float__", "__int__", "__bool__", "__index__", "item", "tolist",
               "block_until_ready")

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        self._inside = threading.local()

    def _wrap(self, fn: Callable, check_args: bool) -> Callable:
        counter = self

        def counted(*args, **kwargs):
            nested = getattr(counter._inside, "depth", 0)
            if (counter.active and not nested
                    and threading.current_thread() is threading.main_thread()
                    and (not check_args or _has_device_array(args))):
                counter.count += 1
            counter._inside.depth = nested + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._inside.depth = nested

        counted.__wrapped__ = fn
        return counted

    @contextmanager
    def installed(self) -> Iterator[BlockingCounter]:
        from jax._src.array import ArrayImpl

        saved_methods = {m: ArrayImpl.__dict__[m] for m in self.METHODS if m in ArrayImpl.__dict__}
        saved_funcs = [(np, "asarray"), (np, "array"), (jax, "device_get"),
                       (jax, "block_until_ready")]
        originals = [(mod, name, getattr(mod, name)) for mod, name in saved_funcs]
        for m, fn in saved_methods.items():
            setattr(ArrayImpl, m, self._wrap(fn, check_args=False))
        for mod, name, fn in originals:
            setattr(mod, name, self._wrap(fn, check_args=True))
        try:
            yield self
        finally:
            for m, fn in saved_methods.items():
                setattr(ArrayImpl, m, fn)
            for mod, name, fn in originals:
                setattr(mod, name, fn)

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _has_device_array(args: tuple) -> bool:
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(args))


def evict(directory: Path) -> None:
    """fsync and drop from the page cache every file under ``directory``."""
    for root, _, files in os.walk(directory):
        for f in files:
            try:
                fd = os.open(os.path.join(root, f), os.O_RDONLY)
            except FileNotFoundError:  # a commit landing on its thread renamed it
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -------------------------------------------------------------------------------- one case
class Case:
    """One (width, estimator): an in-memory train step and a streamed executor on a store."""

    def __init__(self, name: str, width: int, workdir: Path, seed: int = 0, *,
                 micro: int = MICRO, micro_size: int = MICRO_SIZE, dtype: str = "float32",
                 depth: int = DEPTH, layers_per_unit: int = 1):
        """``dtype``: the compute dtype of both sides (the in-memory parameters are cast to
        it; the store keeps fp32 masters and casts each layer as it is read);
        ``layers_per_unit``: the streamed sweeps' units (:class:`StreamConfig`)."""
        from jaxstream.stream import LayerStore
        from jaxstream.stream.executor import StreamConfig, StreamedExecutor

        self.name, self.width, self.micro, self.micro_size = name, width, micro, micro_size
        est, options, micro_in_memory = estimator(name)
        self.stack = js.models.mlp(IN_DIM, width, depth, CLASSES)
        params = self.stack.init(jax.random.key(seed))
        opt = optax.sgd(LR)
        self.mem_step = js.train_step(est, opt, self.stack)
        self.dtype = jnp.dtype(dtype)
        mem_params = jax.tree.map(lambda a: a.astype(self.dtype), params)
        self.params, self.opt_state = mem_params, self.mem_step.init(mem_params)
        self.micro_in_memory = micro_in_memory
        self.path = workdir / f"{name}-{width}-g{layers_per_unit}"
        store = LayerStore.create(str(self.path), jax.device_get(params), optimizer=opt,
                                  model_config={"name": self.stack.name, "width": width})
        # what engine: {type: stream} builds: the commit on a thread, residuals kept
        cfg = StreamConfig(**{"prefetch": 2, "compute_dtype": dtype, "async_commit": True,
                              "layers_per_unit": layers_per_unit, **options})
        self.executor = StreamedExecutor(self.stack, est, opt, store, cfg)

    def batches(self, step: int) -> tuple[dict, dict]:
        """(in-memory batch, streamed micro-batches) of the same examples."""
        kx, ky = jax.random.split(jax.random.key(1000 + step))
        shape = (self.micro, self.micro_size)
        micro = {"x": jax.random.normal(kx, (*shape, IN_DIM), self.dtype),
                 "y": jax.random.randint(ky, shape, 0, CLASSES)}
        flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), micro)
        return (micro if self.micro_in_memory else flat), micro

    def memory(self, step: int) -> float:
        """Seconds of one in-memory step (inputs ready before the clock starts)."""
        batch, _ = self.batches(step)
        key = jax.random.key(step)
        jax.block_until_ready((batch, key))
        t0 = time.perf_counter()
        self.params, self.opt_state, loss = self.mem_step(self.params, self.opt_state, batch, key)
        jax.block_until_ready((self.params, loss))
        return time.perf_counter() - t0

    def streamed(self, step: int, cold: bool, counter: BlockingCounter) -> dict:
        """One streamed step: its wall seconds, metrics and blocking count."""
        _, micro = self.batches(step)
        key = jax.random.key(step)
        jax.block_until_ready((micro, key))
        # no flush: a lazy step applies the step before's deferred updates as it reads, and
        # that is part of its cost
        if cold:
            evict(self.path)
        before = counter.count
        with counter.counting():
            t0 = time.perf_counter()
            m = self.executor.step(micro, key)
            dt = time.perf_counter() - t0
        out = {k: float(v) for k, v in m.items() if isinstance(v, (int, float, np.number))}
        out["wall_s"] = dt
        out["blocking"] = counter.count - before
        return out

    def close(self) -> None:
        if hasattr(self.executor, "flush"):
            self.executor.flush()
        if hasattr(self.executor, "close"):
            self.executor.close()


# ------------------------------------------------------------------------------ statistics
DEVICE_IDLE = ("stall_idle_s", "wait_update_idle_s", "wait_commit_s")


def causes(metrics: list[dict]) -> list[str]:
    """The idle fields present in every step: the device's idle per cause where the executor
    reports it (:data:`DEVICE_IDLE`, disjoint waits of the main thread after the dispatched
    work was computed), else every ``stall*_s`` / ``wait_*_s`` (an executor without it)."""
    keys = set.intersection(*(set(m) for m in metrics)) if metrics else set()
    if set(DEVICE_IDLE) <= keys:
        return list(DEVICE_IDLE)
    return sorted(k for k in keys if k.endswith("_s") and k not in IGNORED
                  and (k.startswith(("stall", "wait_"))))


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarise(mem: list[float], steps: list[dict]) -> dict:
    """Ratio, spread, blocking count and idle per cause of one (width, estimator, cache)."""
    wall = [s["wall_s"] for s in steps]
    m_mem, m_str = statistics.median(mem), statistics.median(wall)
    ratios = [w / m_mem for w in wall]
    excess = m_str - m_mem
    idle = {k: statistics.median(s[k] for s in steps) for k in causes(steps)}
    out = {"memory_s": spread(mem), "streamed_s": spread(wall),
           "ratio": m_str / m_mem, "ratio_min": min(ratios), "ratio_max": max(ratios),
           "excess_s": excess, "idle_s": idle, "other_s": excess - sum(idle.values()),
           "blocking": statistics.median(s["blocking"] for s in steps)}
    own = [k for k in set.intersection(*(set(s) for s in steps))
           if "block" in k and k != "blocking"]
    for k in sorted(own):
        out[f"executor_{k}"] = statistics.median(s[k] for s in steps)
    for k in ("bytes_read", "bytes_written"):
        if steps and all(k in s for s in steps):
            out[k] = statistics.median(s[k] for s in steps)
    return out


# ------------------------------------------------------------------------------------- run
def run(widths: list[int], estimators: list[str], caches: list[str], rounds: int,
        warmup: int = 1, log: Callable[[str], None] = print, **options: Any) -> dict:
    """Every (width, estimator, cache): in-memory and streamed steps interleaved by round.
    ``options``: :class:`Case` options (micro-batches, their size, compute dtype, depth)."""
    results: dict[str, Any] = {}
    counter = BlockingCounter()
    with counter.installed():
        for width in widths:
            work = Path(tempfile.mkdtemp(prefix=f"north_star_{width}_"))
            try:
                cases = [Case(name, width, work, **options) for name in estimators]
                for case in cases:  # compile both sides, fill the store's slots
                    for w in range(warmup):
                        case.memory(10_000 + w)
                        case.streamed(10_000 + w, False, counter)
                mem = {c.name: [] for c in cases}
                streamed = {(c.name, cache): [] for c in cases for cache in caches}
                for r in range(rounds):
                    for case in cases:
                        mem[case.name].append(case.memory(r))
                        for cache in caches:
                            streamed[(case.name, cache)].append(
                                case.streamed(r, cache == "cold", counter))
                    log(f"width {width} round {r + 1}/{rounds} done")
                for case in cases:
                    for cache in caches:
                        row = summarise(mem[case.name], streamed[(case.name, cache)])
                        results[f"{width}/{case.name}/{cache}"] = {
                            "width": width, "estimator": case.name, "cache": cache, **row}
                    case.close()
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return results


def environment() -> dict:
    """Machine, load and which jaxstream ran (a before/after comparison names its tree)."""
    from jaxstream.experiment.docblock import machine

    return {"machine": machine(), "loadavg": list(os.getloadavg()),
            "jaxstream": str(Path(js.__file__).parent.parent),
            "backend": jax.default_backend(), "depth": DEPTH,
            "micro_batches": f"{MICRO} x {MICRO_SIZE}", "optimizer": f"sgd({LR})",
            "compute_dtype": "float32", "prefetch": 2, "commit": "async"}


# ----------------------------------------------------------------------------------- output
def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if abs(s) >= 0.0995 else f"{s * 1e3:.1f}"


def _bytes(r: dict) -> str:
    """``read / written`` per step in KiB or MiB (``–`` for results from before bytes)."""
    if "bytes_read" not in r:
        return "–"
    unit = lambda n: f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
    return f"{unit(r['bytes_read'])} / {unit(r['bytes_written'])}"


def table(results: dict) -> str:
    """Markdown: one row per (width, estimator, cache)."""
    lines = [("| width | estimator | cache | in memory ms | streamed ms | streamed / in memory "
             "(min–max) | blocking / step | read / written per step | idle per cause ms | "
             "other ms |"),
             "|---:|---|---|---:|---:|---|---:|---:|---|---:|"]
    for r in results.values():
        idle = ", ".join(f"{k.removesuffix('_s')} {_ms(v)}" for k, v in r["idle_s"].items())
        own = [f"{k.removeprefix('executor_')} {v:.0f}" for k, v in r.items()
               if k.startswith("executor_")]
        blocking = f"{r['blocking']:.0f}" + (f" ({', '.join(own)})" if own else "")
        lines.append(
            f"| {r['width']} | {_label(r['estimator'])} | {r['cache']} | "
            f"{_ms(r['memory_s']['median'])} | {_ms(r['streamed_s']['median'])} | "
            f"**{r['ratio']:.2f}** ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | {blocking} | "
            f"{_bytes(r)} | {idle or '–'} | {_ms(r['other_s'])} |")
    return "\n".join(lines)


def _label(name: str) -> str:
    """An estimator's row label: ``hybrid_eager_q2`` -> "hybrid eager, 2 updates in flight"."""
    two = name.endswith(IN_FLIGHT_2)
    base = name[:-len(IN_FLIGHT_2)] if two else name
    return base.replace("_", " ") + (", 2 updates in flight" if two else "")


def markdown(doc: dict) -> str:
    """The table with a line on how it was measured (rounds, load)."""
    env = doc["environment"]
    load = ", ".join(f"{x:.1f}" for x in env["loadavg"])
    return (f"{table(doc['results'])}\n\n"
            f"Depth {env['depth']}, {env['micro_batches']} micro-batches, {env['optimizer']}, "
            f"{env['compute_dtype']}, prefetch {env['prefetch']}"
            f"{', commit on a thread' if env.get('commit') == 'async' else ''}; "
            f"{doc['rounds']} interleaved "
            f"rounds, medians (min–max of the per-step ratios); cold: every store file fsynced "
            f"and dropped from the page cache before the step; load average at the start "
            f"{load}.{overlap_note(doc['results'])}")


def overlap_note(results: dict) -> str:
    """What "other" is, and why it can be negative."""
    note = (" Idle per cause: the device's idle time while the main thread waited for a read "
            "(stall_idle), the host worker (wait_update_idle) or the commit; \"other\" is the "
            "excess they leave: the device's time beyond the in-memory step's compute.")
    if all(r["other_s"] >= 0 for r in results.values()):
        return note
    return note + (" A negative \"other\": the streamed step's compute took less than the "
                   "in-memory step's median (a step's medians differ by the load's noise).")


def write_doc(doc_path: str, doc: dict, command: str, where: str | None = None,
              block: str = "table") -> None:
    """Writes the ``north_star.py <block>`` block of ``doc_path``."""
    from jaxstream.experiment.docblock import write_tables

    others = tuple(b for b in BLOCKS if b != block)  # another run's tables stay as they are
    written = write_tables(doc_path, "north_star.py", {block: markdown(doc)}, command,
                           keep=others, where=where)
    if not written:
        raise SystemExit(f"error: {doc_path} has no <!-- generated: north_star.py {block} --> "
                         "block; add the marker pair where the table belongs")


def merge(docs: list[dict]) -> dict:
    """One document from several runs' JSON (e.g. one run per width): their results in
    order, the first run's environment, every command joined by ``;``."""
    if len(docs) == 1:
        return docs[0]
    out = dict(docs[0])
    out["results"] = {k: v for d in docs for k, v in d["results"].items()}
    out["command"] = "; ".join(dict.fromkeys(d["command"] for d in docs))
    rounds = sorted({d["rounds"] for d in docs})
    out["rounds"] = rounds[0] if len(rounds) == 1 else f"{rounds[0]}–{rounds[-1]}"
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=None)
    p.add_argument("--estimators", nargs="+", default=None,
                   choices=ESTIMATORS + tuple(e + IN_FLIGHT_2 for e in ESTIMATORS),
                   help="default: every estimator; NAME_q2: with two host updates in flight")
    p.add_argument("--block", default="table", choices=BLOCKS,
                   help="the doc block --doc writes (<!-- generated: north_star.py BLOCK -->)")
    p.add_argument("--caches", nargs="+", default=None, choices=CACHES)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (timed steps)")
    p.add_argument("--quick", action="store_true", help="width 256, 3 rounds")
    p.add_argument("--json", default=None, help="write the results to this path")
    p.add_argument("--doc", default=None, help="write the table into this doc's block")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="render --doc / the table from earlier runs' JSON, merged in order "
                        "(no measuring)")
    args = p.parse_args(argv)
    if args.from_json is None:
        if args.widths is None:
            args.widths = [256] if args.quick else list(WIDTHS)
        if args.rounds is None:
            args.rounds = 3 if args.quick else 7
        if any(w < 1 for w in args.widths) or args.rounds < 1:
            p.error("--widths and --rounds must be positive")
    args.estimators = args.estimators or list(ESTIMATORS)
    args.caches = args.caches or list(CACHES)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    command = "python benchmarks/north_star.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        doc = merge([json.loads(Path(p).read_text()) for p in args.from_json])
        print(markdown(doc))
        if args.doc:
            write_doc(args.doc, doc, doc["command"], where=doc["environment"]["machine"],
                      block=args.block)
        return doc
    env = environment()
    print(f"jaxstream from {env['jaxstream']}; {env['machine']}; loadavg {env['loadavg']}",
          flush=True)
    results = run(args.widths, args.estimators, args.caches, args.rounds,
                  log=lambda s: print(s, flush=True))
    doc = {"command": command, "environment": env, "rounds": args.rounds, "results": results}
    print(markdown(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.doc:
        write_doc(args.doc, doc, command, block=args.block)
    return doc


if __name__ == "__main__":
    main()
