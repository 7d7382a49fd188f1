"""One process of the 2-process pipeline test: python multiprocess_worker.py PORT PROCESS_ID OUT.

Each process has 2 CPU devices; the 4-stage pipeline spans both processes through
``jax.distributed``. Process 0 writes the max relative error against the single-process
hybrid estimator (computed on its own host) to OUT.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

port, pid, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, local_device_ids=[0, 1])

import numpy as np
from jax.experimental import multihost_utils

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.pipeline import truncated
from jaxstream.pipeline.executor import pipeline
from jaxstream.pipeline.lowering import exact_from

assert jax.device_count() == 4 and jax.local_device_count() == 2
m, n = 4, 4
stack = mlp(in_dim=6, width=5, depth=4, num_classes=3)
params = jax.tree.map(np.asarray, stack.init(jax.random.key(0)))
rng = np.random.default_rng(1)  # NumPy data: the same on both processes, no eager compilation
batch = {"x": rng.standard_normal((n, 2, 6), dtype=np.float32),
         "y": rng.integers(0, 3, (n, 2), dtype=np.int32)}
sched = truncated(m, n, (0, 1))
key = jax.random.key(3)
# replace over nested partial groups (exact_from = (2, 3, 5, 5)); the cross-process psums and
# ppermutes are those of every correction
loss, grads, _ = pipeline(stack, sched, num_tangents=2, correction="replace")(
    params, batch, key)
grads = multihost_utils.process_allgather(grads, tiled=True)
loss = float(multihost_utils.process_allgather(loss, tiled=True))
if pid == 0:
    est = jg.hybrid(exact_from=exact_from(sched, stack.num_layers), correction="replace",
                    num_tangents=2)
    local = jax.local_devices()[0]
    with jax.default_device(local):  # jitted: one compilation, not op-by-op dispatch
        ref_loss, ref = jax.jit(lambda p, b, k: est(stack, p, b, k))(params, batch, key)
    fa = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads)])
    fb = np.concatenate([np.ravel(x) for x in jax.tree.leaves(ref)])
    err = float(np.max(np.abs(fa - fb)) / np.max(np.abs(fb)))
    with open(out, "w") as fh:
        fh.write(f"{err} {abs(loss - float(ref_loss))}\n")
jax.distributed.shutdown()
