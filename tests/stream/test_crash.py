"""A writer killed with SIGKILL mid-step leaves a store that opens at its last commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from jaxstream.stream import LayerStore

WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from jaxstream.stream import LayerStore
    store = LayerStore.open(sys.argv[1])
    step = store.step
    while True:
        step += 1
        for l in range(store.num_layers):
            v = np.float32(step)
            store.write(l, {"b": np.full((64,), v, np.float32), "w": np.full((64, 64), v, np.float32)})
        store.write("head", {"w": np.full((64, 2), step, np.float32)})
        store.commit(step)
    """
)


def test_killed_writer_leaves_last_commit(tmp_path):
    rng = np.random.default_rng(0)
    layers = 6
    # ones, not zeros: the store's divergence guard refuses a commit whose norm exceeds 10x
    # the last sane one's, and any norm exceeds 10x zero
    params = {
        "embed": {"w": np.ones((3, 64), np.float32)},
        "blocks": {"w": np.ones((layers, 64, 64), np.float32), "b": np.ones((layers, 64), np.float32)},
        "head": {"w": np.ones((64, 2), np.float32)},
    }
    path = tmp_path / "s"
    LayerStore.create(path, params)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for trial in range(3):
        before = LayerStore.open(path).step
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env)
        deadline = time.time() + 60
        while LayerStore.open(path).step < before + 2 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(float(rng.uniform(0.0, 0.15)))  # a random moment mid-stream
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        store = LayerStore.open(path)
        assert store.step >= before + 2, f"trial {trial}: the writer never committed"
        got = store.read_params()
        for leaf in (got["blocks"]["w"], got["blocks"]["b"], got["head"]["w"]):
            np.testing.assert_array_equal(leaf, np.full_like(leaf, store.step))
