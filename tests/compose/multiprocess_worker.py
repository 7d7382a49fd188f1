"""One process of the 2-process composed-engine test: python multiprocess_worker.py PORT ID DIR
[disagree].

Each process has 4 CPU devices; the 2 × 4 mesh spans both through ``jax.distributed`` (process
0 holds data row 0, process 1 row 1). Each process streams from its own copy of the store (its
local disk) and applies the same host updates. Two hybrid steps; then process 0 writes the max
relative error of its store's parameters against a single-process run of the same steps on one
device (the streamed executor) to DIR/err.txt. With ``disagree``, process 1's copy is two steps
ahead (one step ahead is rolled back on opening): each process writes the refusal it got to
DIR/refused<ID>.txt. ``skewN``: process 1
opens its executor N s late; ``lateN``: it runs its first step N s late (compile skew: process
0 has compiled and waits for it); ``lost``: process 1 dies after step 1; ``resume``: both
restart on their copies and run the steps left.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

port, pid, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else ""
disagree = mode == "disagree"
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, local_device_ids=[0, 1, 2, 3])
if mode in ("lost", "resume"):
    # The restart after a lost peer runs the programs the lost run compiled: each process keeps
    # them in a compilation cache of its own (one writer, and the phases one after another;
    # the lost run's process 1 dies after its first step, when every program is compiled).
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, f"jit-cache{pid}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

import numpy as np
import optax

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, StoreError, StreamConfig, StreamedExecutor

assert jax.device_count() == 8 and jax.local_device_count() == 4
stack = mlp(in_dim=5, width=6, depth=4, num_classes=3)
params = jax.tree.map(np.asarray, stack.init(jax.random.key(0)))
rng = np.random.default_rng(1)  # NumPy data: the same on both processes
batch = {"x": rng.standard_normal((4, 2, 5), dtype=np.float32),
         "y": rng.integers(0, 3, (4, 2), dtype=np.int32)}
est, opt = jg.hybrid(num_exact=2, num_tangents=2, correction="weighted"), optax.adam(1e-2)
cfg = StreamConfig(compute_dtype="float32", prefetch=1)
if mode == "resume":  # a restart after a lost peer: each process opens its own copy
    store = LayerStore.open(os.path.join(root, f"store{pid}"), template=params, optimizer=opt)
else:
    store = LayerStore.create(os.path.join(root, f"store{pid}"), params, optimizer=opt)
if disagree:
    if pid == 1:  # this copy moved on alone, by two steps
        for s in (1, 2):
            store.write(0, jax.tree.map(lambda x: x + 1, store.read(0).result()))
            store.commit(s)
    try:
        ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(2, 4))
    except StoreError as e:
        with open(os.path.join(root, f"refused{pid}.txt"), "w") as fh:
            fh.write(str(e))
    jax.distributed.shutdown()
    sys.exit(0)
if mode.startswith("skew") and pid == 1:  # process 1 opens its executor late (start-up skew)
    time.sleep(float(mode[4:]))
if mode == "lost":  # process 1 dies after the first step: process 0 must stop, in one line
    ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(2, 4), peer_timeout_s=5)
    ex.step(batch, jax.random.key(0))
    if pid == 1:
        os._exit(9)  # as a SIGKILL: no clean-up, no shutdown
    with open(os.path.join(root, "lost_at.txt"), "w") as fh:
        fh.write(str(time.time()))
    ex.step(batch, jax.random.key(1))  # blocks in a collective with the lost peer
    sys.exit(0)  # not reached: the peer watch ends the process with status 2
ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(2, 4))
if mode.startswith("late") and pid == 1:  # compile skew: process 1 reaches its first program
    time.sleep(float(mode[4:]))  # (and compiles it) this much later than process 0
steps = range(store.step, 2)  # a resumed run continues from the step every copy committed
losses = [ex.step(batch, jax.random.key(s))["loss"] for s in steps]
if pid == 0:
    ref_store = LayerStore.create(os.path.join(root, "ref"), params, optimizer=opt)
    one = StreamedExecutor(stack, est, opt, ref_store, cfg, device=jax.local_devices()[0])
    ref_losses = [one.step(batch, jax.random.key(s))["loss"] for s in range(2)]
    a, b = store.read_params(), ref_store.read_params()
    err = max(float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    moved = max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                               jax.tree.leaves(params)))
    loss_err = max(abs(x - ref_losses[s]) for x, s in zip(losses, steps))
    with open(os.path.join(root, "err.txt"), "w") as fh:
        fh.write(f"{err} {loss_err} {moved}\n")
jax.distributed.shutdown()
