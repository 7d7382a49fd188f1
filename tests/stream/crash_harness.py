"""Crash experiment: streamed training killed with SIGKILL at random moments, then resumed.

A test harness, not part of the library. A worker (``python crash_harness.py PATH STEPS``) trains a small MLP whose layers
live in the store at PATH, continuing from the store's committed step; its keys and batches
are pure functions of the step, so a resumed run must end with the parameters of an
uninterrupted one. :func:`run_crash_experiment` kills workers at random moments and checks
(a) every killed store opens at its last committed step with exactly the parameters the
uninterrupted run had at that step, and (b) resuming reaches the uninterrupted final params.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIDTH, DEPTH, IN_DIM, CLASSES, BATCH, MICRO = 32, 6, 16, 4, 16, 2


def _setup():
    import jax
    import optax

    import jaxstream.grad as jg
    from jaxstream.models import mlp

    stack = mlp(IN_DIM, WIDTH, DEPTH, CLASSES)
    return stack, stack.init(jax.random.key(0)), jg.forward(num_tangents=2), optax.adam(1e-2)


def _batch(step: int) -> dict:
    r = np.random.default_rng(step)
    x = r.standard_normal((MICRO, BATCH // MICRO, IN_DIM)).astype(np.float32)
    return {"x": x, "y": r.integers(0, CLASSES, (MICRO, BATCH // MICRO)).astype(np.int32)}


def train(path: str, steps: int, update: str = "lazy", snapshots: dict | None = None) -> float:
    """Trains the store at ``path`` (created if missing) up to ``steps`` committed steps.

    Returns:
      seconds per step after the first (compiling) one.
    """
    import jax

    from jaxstream.stream.errors import StoreNotFoundError
    from jaxstream.stream.executor import StreamConfig, StreamedExecutor
    from jaxstream.stream.store import LayerStore

    stack, params, est, opt = _setup()
    try:
        store = LayerStore.open(path, optimizer=opt)
    except StoreNotFoundError:
        store = LayerStore.create(path, params, optimizer=opt)
    ex = StreamedExecutor(stack, est, opt, store, StreamConfig(prefetch=2, compute_dtype="float32",
                                                               update=update))
    times = []
    while store.step < steps:
        s = store.step
        m = ex.step(_batch(s), jax.random.fold_in(jax.random.key(1), s), step=s)
        times.append(m["step_time_s"])
        if snapshots is not None:
            snapshots[store.step] = _committed_params(path)
    ex.flush()
    return float(np.mean(times[1:])) if len(times) > 1 else 0.0


def _committed_params(path: str) -> list[np.ndarray]:
    """The committed parameters with pending lazy updates applied (without writing)."""
    import jax

    from jaxstream.stream.executor import StreamConfig, StreamedExecutor
    from jaxstream.stream.store import LayerStore

    stack, _, est, opt = _setup()
    store = LayerStore.open(path, optimizer=opt)
    params = store.read_params()
    if any(store.extra.get("pending", {}).values()):
        ex = StreamedExecutor(stack, est, opt, store, StreamConfig(compute_dtype="float32", update="lazy"))
        ex._dry = True
        for l in range(store.num_layers):
            layer = ex._apply_pending(l, store.read(l).result())
            for leaf, new in zip(jax.tree.leaves(params["blocks"]), jax.tree.leaves(layer)):
                leaf[l] = new
    return [np.asarray(a) for a in jax.tree.leaves(params)]


def run_crash_experiment(kills: int = 10, steps: int = 12, seed: int = 0,
                         update: str = "lazy", workdir: str | None = None) -> dict:
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
    final = _committed_params(str(root / "reference"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    trials = []
    for i in range(kills):
        path = str(root / f"run{i}")
        cmd = [sys.executable, str(Path(__file__).resolve()), path, str(steps), update]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # wait for the second commit (start-up and both compiled paths done), then a random moment
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                if LayerStore.open(path).step >= 2:
                    break
            except Exception:  # noqa: BLE001, S110 - not created yet
                pass
            time.sleep(0.01)
        time.sleep(float(rng.uniform(0.0, run_time)))
        finished_before_kill = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        store = LayerStore.open(path)
        at = store.step
        got = _committed_params(path)
        opened_ok = at in ref and all(np.array_equal(a, b) for a, b in zip(got, ref[at]))
        train(path, steps, update)  # resume in this process
        resumed = _committed_params(path)
        equal = all(np.array_equal(a, b) for a, b in zip(resumed, final))
        trials.append({"killed_at_step": at, "finished_before_kill": finished_before_kill,
                       "opened_at_committed_step": bool(opened_ok), "resumed_equal": bool(equal)})
    return {"kills": kills, "steps": steps, "step_time_s": per_step,
            "opened_at_committed_step": all(t["opened_at_committed_step"] for t in trials),
            "resumed_equal": all(t["resumed_equal"] for t in trials), "trials": trials,
            "workdir": str(root)}


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "lazy")
