"""Crash experiment: streamed training killed with SIGKILL at random moments, then resumed.

A test harness, not part of the library. A worker (``python crash_harness.py PATH STEPS``) trains a small MLP whose layers
live in the store at PATH, continuing from the store's committed step; its keys and batches
are pure functions of the step, so a resumed run must end with the parameters of an
uninterrupted one. :func:`run_crash_experiment` kills workers at random moments and checks
(a) every killed store opens at its last committed step with exactly the parameters the
uninterrupted run had at that step, and (b) resuming reaches the uninterrupted final params.
Some kills land inside the manifest write (the worker kills itself while ``manifest.json``
is being written). :func:`run_disk_scan` fills a small tmpfs so that a write fails at a
different point of creation and training each time, then frees the space, reopens, resumes
and compares. The full scans are run by hand (not by the test suite)::

    python tests/stream/crash_harness.py scan --kills 30 --disk 60 --out crash.json

:func:`run_corruption_scan` damages every chunk file of a store in turn (a flipped bit,
truncation, deletion) and counts the damages detected on read.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIDTH, DEPTH, IN_DIM, CLASSES, BATCH, MICRO = 32, 6, 16, 4, 16, 2
# the workers commit asynchronously (the manifest lands while the next step computes)
ASYNC = os.environ.get("CRASH_ASYNC_COMMIT", "0") == "1"


@functools.cache
def _setup(mode: str = "lazy"):
    """The model, initial params, estimator and optimizer (one object each per process, so
    the streamed kernels, jitted with them as static arguments, compile once)."""
    import jax
    import optax

    import jaxstream.grad as jg
    from jaxstream.models import mlp

    stack = mlp(IN_DIM, WIDTH, DEPTH, CLASSES)
    est = (jg.hybrid(num_exact=1, num_tangents=2) if mode in ("hybrid", "hybrid_lazy")
           else jg.forward(num_tangents=2))
    return stack, stack.init(jax.random.key(0)), est, optax.adam(1e-2)


def _batch(step: int) -> dict:
    r = np.random.default_rng(step)
    x = r.standard_normal((MICRO, BATCH // MICRO, IN_DIM)).astype(np.float32)
    return {"x": x, "y": r.integers(0, CLASSES, (MICRO, BATCH // MICRO)).astype(np.int32)}


def train(path: str, steps: int, update: str = "lazy", snapshots: dict | None = None) -> float:
    """Trains the store at ``path`` (created if missing) up to ``steps`` committed steps;
    ``update`` is the mode: "lazy" (forward, lazy), "lazy_k3" (forward, lazy, a layer written
    back every 3 records: ``rewrite_every=3``), "eager" (forward), "hybrid" (eager) or
    "hybrid_lazy" (the hybrid's update deferred to the next read).

    Returns:
      seconds per step after the first (compiling) one.
    """
    import jax

    from jaxstream.stream.errors import StoreNotFoundError
    from jaxstream.stream.executor import StreamConfig, StreamedExecutor
    from jaxstream.stream.store import LayerStore

    stack, params, est, opt = _setup(update)
    try:
        store = LayerStore.open(path, optimizer=opt)
    except StoreNotFoundError:
        store = LayerStore.create(path, params, optimizer=opt)
    ex = StreamedExecutor(stack, est, opt, store, StreamConfig(
        prefetch=2, compute_dtype="float32", async_commit=ASYNC,
        update="lazy" if update in ("lazy", "lazy_k3", "hybrid_lazy") else "eager",
        rewrite_every=3 if update == "lazy_k3" else 1))
    times = []
    if snapshots is not None:
        snapshots[store.step] = _committed_params(path, update)
    while store.step < steps:
        s = store.step
        m = ex.step(_batch(s), jax.random.fold_in(jax.random.key(1), s), step=s)
        times.append(m["step_time_s"])
        if snapshots is not None:
            store.settle()  # the snapshot reads the store from disk: the commit has landed
            snapshots[store.step] = _committed_params(path, update)
    ex.flush()
    store.settle()
    return float(np.mean(times[1:])) if len(times) > 1 else 0.0


def _committed_params(path: str, mode: str = "lazy") -> list[np.ndarray]:
    """The committed parameters with pending lazy updates applied (without writing)."""
    import jax

    from jaxstream.stream import lazy
    from jaxstream.stream.executor import StreamConfig, StreamedExecutor
    from jaxstream.stream.store import LayerStore

    stack, _, est, opt = _setup(mode)
    store = LayerStore.open(path, optimizer=opt)  # adam: only the pending records
    params = store.read_params()
    if any(lazy.waiting(store.extra).values()):
        ex = StreamedExecutor(stack, est, opt, store, StreamConfig(compute_dtype="float32", update="lazy"))
        for l in range(store.num_layers):
            layer = ex.pending.apply(l, store.read(l).result())
            for leaf, new in zip(jax.tree.leaves(params["blocks"]), jax.tree.leaves(layer)):
                leaf[l] = new
        for end in ("embed", "head"):  # a hybrid's records reach them too
            params[end] = ex.pending.apply(end, store.read(end).result())
        store.abort()  # the applied records stay staged only: nothing is written
    return [np.asarray(a) for a in jax.tree.leaves(params)]


def run_crash_experiment(kills: int = 10, steps: int = 12, seed: int = 0,
                         update: str = "lazy", workdir: str | None = None,
                         manifest_kills: int = 0) -> dict:
    """Kills ``kills`` workers at random moments; returns per-trial facts and a verdict.

    Returns:
      ``{"kills", "opened_at_committed_step", "resumed_equal", "trials": [...]}``.
    """
    from jaxstream.stream.store import LayerStore

    rng = np.random.default_rng(seed)
    root = Path(tempfile.mkdtemp(prefix="jaxstream-crash-", dir=workdir))
    ref: dict = {}
    per_step = train(str(root / "reference"), steps, update, snapshots=ref)
    run_time = per_step * (steps - 2)
    final = _committed_params(str(root / "reference"), update)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    trials = []
    for i in range(kills):
        path = str(root / f"run{i}")
        cmd = [sys.executable, str(Path(__file__).resolve()), path, str(steps), update]
        in_manifest = i < manifest_kills
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=dict(env, CRASH_IN_MANIFEST=str(int(rng.integers(3, steps)))
                                         ) if in_manifest else env)
        # wait for the second commit (start-up and both compiled paths done), then a random moment
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                if LayerStore.open(path).step >= 2:
                    break
            except Exception:  # noqa: BLE001, S110 - not created yet
                pass
            time.sleep(0.01)
        if in_manifest:
            proc.wait(timeout=600)  # it kills itself inside a manifest write
        else:
            time.sleep(float(rng.uniform(0.0, run_time)))
        finished_before_kill = proc.poll() is not None and not in_manifest
        proc.send_signal(signal.SIGKILL) if proc.poll() is None else None
        proc.wait()
        store = LayerStore.open(path)
        at = store.step
        got = _committed_params(path, update)
        opened_ok = at in ref and all(np.array_equal(a, b) for a, b in zip(got, ref[at]))
        train(path, steps, update)  # resume in this process
        resumed = _committed_params(path, update)
        equal = all(np.array_equal(a, b) for a, b in zip(resumed, final))
        trials.append({"killed_at_step": at, "finished_before_kill": finished_before_kill,
                       "in_manifest_write": in_manifest, "returncode": proc.returncode,
                       "opened_at_committed_step": bool(opened_ok), "resumed_equal": bool(equal)})
    return {"kills": kills, "steps": steps, "step_time_s": per_step,
            "opened_at_committed_step": all(t["opened_at_committed_step"] for t in trials),
            "resumed_equal": all(t["resumed_equal"] for t in trials), "trials": trials,
            "workdir": str(root)}


def _die_in_manifest_write(commit: int) -> None:
    """Worker: SIGKILL itself while the ``commit``-th manifest write is in flight."""
    import threading

    from jaxstream.stream import store_commit as store_mod

    real, count = store_mod.write_manifest, [0]

    def write(root, manifest, where):
        count[0] += 1
        if count[0] == commit:
            t = threading.Thread(target=real, args=(root, manifest, where))
            t.start()
            time.sleep(float(np.random.default_rng(commit).uniform(0, 0.002)))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(root, manifest, where)

    store_mod.write_manifest = write


def run_disk_scan(points: int = 60, steps: int = 6, modes: tuple = ("lazy", "hybrid"),
                  size_mib: int = 4) -> dict:
    """Out-of-space failures at ``points`` moments: a tmpfs of ``size_mib`` is filled so that
    ``free`` bytes remain (stepping through the growth of the store), training runs until a
    write fails, the space is freed, the store is reopened and training resumed.

    Returns counts: failures seen, raised as StoreError, reopened at a committed step equal to
    the uninterrupted run's, resumed bitwise equal. Needs root (mounts a tmpfs).
    """
    from jaxstream.stream.errors import StoreError, StoreNotFoundError
    from jaxstream.stream.store import LayerStore

    mnt = Path(tempfile.mkdtemp(prefix="jaxstream-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)], check=True)
    trials = []
    try:
        per_mode = max(1, points // len(modes))
        for mode in modes:
            ref: dict = {}
            train(str(mnt / "ref"), steps, mode, snapshots=ref)
            final = _committed_params(str(mnt / "ref"), mode)
            used = 4096 + sum(f.stat().st_blocks * 512 for f in (mnt / "ref").rglob("*"))
            subprocess.run(["rm", "-rf", str(mnt / "ref")], check=True)
            for k in range(per_mode):
                free = int(used * 1.2 * k / per_mode)
                filler = mnt / "filler"
                total = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
                with open(filler, "wb") as f:
                    f.truncate(0)
                    f.write(b"\0" * max(0, total - free))
                path = str(mnt / f"run{k}")
                error = None
                try:
                    train(path, steps, mode)
                except Exception as err:  # noqa: BLE001 - classified below
                    error = err
                filler.unlink()
                try:
                    at = LayerStore.open(path).step
                    got = _committed_params(path, mode)
                    opened_ok = at in ref and all(np.array_equal(a, b) for a, b in zip(got, ref[at]))
                except StoreNotFoundError:  # failed during creation: nothing committed
                    at, opened_ok = None, True
                train(path, steps, mode)
                equal = all(np.array_equal(a, b) for a, b in zip(_committed_params(path, mode), final))
                trials.append({"mode": mode, "free_bytes": free, "failed": error is not None,
                               "error": type(error).__name__ if error else None,
                               "store_error": isinstance(error, StoreError) if error else None,
                               "reopened_at": at, "opened_at_committed_step": bool(opened_ok),
                               "resumed_equal": bool(equal)})
                subprocess.run(["rm", "-rf", path], check=True)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        os.rmdir(mnt)
    failed = [t for t in trials if t["failed"]]
    return {"points": len(trials), "failures": len(failed),
            "failures_as_store_error": sum(bool(t["store_error"]) for t in failed),
            "distinct_failure_steps": len({(t["mode"], t["reopened_at"]) for t in failed}),
            "opened_at_committed_step": sum(t["opened_at_committed_step"] for t in trials),
            "resumed_equal": sum(t["resumed_equal"] for t in trials), "trials": trials}


def run_corruption_scan(seed: int = 0) -> dict:
    """Damages every chunk file of a fresh store in turn (one flipped bit, truncation,
    deletion) and reads the whole store back: counts the damages that raised
    StoreCorruptError (detected) against those read silently."""
    import shutil

    from jaxstream.stream.errors import StoreCorruptError
    from jaxstream.stream.store import LayerStore

    rng = np.random.default_rng(seed)
    _, params, _, opt = _setup("eager")
    root = Path(tempfile.mkdtemp(prefix="jaxstream-corrupt-"))
    clean = root / "clean"
    LayerStore.create(str(clean), params, optimizer=opt)
    chunks = sorted(f.relative_to(clean) for f in clean.rglob("*") if f.is_file()
                    and f.name not in ("zarr.json", "manifest.json", "writer.lock"))
    counts = {"flip": [0, 0], "truncate": [0, 0], "delete": [0, 0]}
    try:
        for rel in chunks:
            for how in ("flip", "truncate", "delete"):
                work = root / "work"
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(clean, work)
                f = work / rel
                data = bytearray(f.read_bytes())
                if how == "flip":
                    bit = int(rng.integers(0, 8 * len(data)))
                    data[bit // 8] ^= 1 << (bit % 8)
                    f.write_bytes(data)
                elif how == "truncate":
                    f.write_bytes(data[: int(rng.integers(0, len(data)))])
                else:
                    f.unlink()
                store = LayerStore.open(str(work), optimizer=opt)
                try:
                    store.read_params()
                    for u in ["embed", *range(store.num_layers), "head"]:
                        store.read_opt(u).result()
                except StoreCorruptError:
                    counts[how][0] += 1
                counts[how][1] += 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {how: {"detected": d, "total": t} for how, (d, t) in counts.items()}


def _main(argv: list[str]) -> None:
    if argv and argv[0] == "scan":
        import argparse
        import json

        ap = argparse.ArgumentParser()
        ap.add_argument("--kills", type=int, default=30)
        ap.add_argument("--manifest-kills", type=int, default=10)
        ap.add_argument("--disk", type=int, default=60)
        ap.add_argument("--out", default="crash_scan.json")
        ap.add_argument("--mode", default="lazy",
                        choices=["lazy", "lazy_k3", "eager", "hybrid", "hybrid_lazy"],
                        help="the kill scan's training mode (see train)")
        a = ap.parse_args(argv[1:])
        out: dict = {"corruption": run_corruption_scan()}
        print(out["corruption"], flush=True)
        if a.disk:
            out["disk"] = run_disk_scan(a.disk, modes=(a.mode, "hybrid"))
            print({k: v for k, v in out["disk"].items() if k != "trials"}, flush=True)
        if a.kills:
            out["kill"] = run_crash_experiment(kills=a.kills, steps=12, update=a.mode,
                                               manifest_kills=a.manifest_kills)
            k = out["kill"]
            subprocess.run(["rm", "-rf", k["workdir"]], check=False)
            print({"kills": k["kills"], "resumed_equal": sum(t["resumed_equal"] for t in k["trials"]),
                   "opened_at_committed_step": sum(t["opened_at_committed_step"] for t in k["trials"]),
                   "in_manifest_write": sum(t["in_manifest_write"] for t in k["trials"])}, flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
        return
    if os.environ.get("CRASH_IN_MANIFEST"):
        _die_in_manifest_write(int(os.environ["CRASH_IN_MANIFEST"]))
    train(argv[0], int(argv[1]), argv[2] if len(argv) > 2 else "lazy")


if __name__ == "__main__":
    _main(sys.argv[1:])
