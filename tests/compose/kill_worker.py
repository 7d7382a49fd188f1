"""One process of a 2-process composed run that loses its peer: python kill_worker.py PORT ID DIR
MODE [POINT].

Each process has 4 CPU devices (a 2 × 4 mesh over both, ``jax.distributed`` on loopback) and
its own store copy DIR/store<ID>. ``train``: up to 40 Adam steps of backprop with
``peer_timeout_s=10``; after each commit the process writes the step to DIR/step<ID>.txt. With
POINT, process 1 dies (``os._exit(9)``, as by SIGKILL) in its second step at that point:
``before_commit`` (after the step's last collective: its peer commits the step alone),
``after_commit`` (its copy has the step, the peer's check of the copies meets no one) or
``mid_sweep`` (inside the sweeps, between two units). Without POINT the parent kills a process
at a time of its choosing. ``open``: both processes open their copies (the restart): each
writes DIR/open<ID>.txt, ``agreed STEP`` or the refusal.
"""

import faulthandler
import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a stuck process waits
port, pid, root, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
point = sys.argv[5] if len(sys.argv) > 5 else ""
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, local_device_ids=[0, 1, 2, 3])

import numpy as np
import optax

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, StoreError, StreamConfig

stack = mlp(in_dim=5, width=6, depth=4, num_classes=3)
params = jax.tree.map(np.asarray, stack.init(jax.random.key(0)))
rng = np.random.default_rng(1)
batch = {"x": rng.standard_normal((4, 2, 5), dtype=np.float32),
         "y": rng.integers(0, 3, (4, 2), dtype=np.int32)}
est, opt = jg.backprop(), optax.adam(1e-2)  # the fewest passes to compile: a forward, a reverse
cfg = StreamConfig(compute_dtype="float32", prefetch=1)
where = os.path.join(root, f"store{pid}")
if mode == "open":
    store = LayerStore.open(where, template=params, optimizer=opt)
    try:
        ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(2, 4))
        said = f"agreed {store.step}"
    except StoreError as e:
        said = str(e)
    with open(os.path.join(root, f"open{pid}.txt"), "w") as fh:
        fh.write(said)
    jax.distributed.shutdown()
    sys.exit(0)

store = LayerStore.create(where, params, optimizer=opt)
ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(2, 4), peer_timeout_s=10)


def die() -> None:
    with open(os.path.join(root, f"died{pid}.txt"), "w") as fh:
        fh.write(str(time.time()))
    os._exit(9)


if pid == 1 and point == "before_commit":
    commit = store.commit
    store.commit = lambda step, *a, **kw: die() if step == 2 else commit(step, *a, **kw)
elif pid == 1 and point == "after_commit":
    commit = store.commit

    def commit_then_die(step, *a, **kw):
        commit(step, *a, **kw)
        if step == 2:
            die()
    store.commit = commit_then_die
elif pid == 1 and point == "mid_sweep":
    progress, beats = ex.placement.progress, [0]

    def progress_then_die():
        progress()
        beats[0] += 1
        if store.step == 1 and beats[0] >= 3:
            die()
    beats_at_step = ex.placement.begin_step

    def begin():
        beats[0] = 0
        beats_at_step()
    ex.placement.progress, ex.placement.begin_step = progress_then_die, begin

for s in range(40):
    ex.step(batch, jax.random.key(s))
    with open(os.path.join(root, f"step{pid}.txt"), "w") as fh:
        fh.write(f"{store.step} {time.time()}")
jax.distributed.shutdown()
