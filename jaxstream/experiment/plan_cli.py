"""``jaxstream plan``: print the streaming planner's batch, memory and step-time prediction.

Example::

    jaxstream plan --width 4096 --depth 32 --in-dim 4096 --device-flops 2e14 \
        --read-bandwidth 3e9 --device-memory 8e10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``plan`` sub-command to a CLI's sub-parsers."""
    p = subparsers.add_parser("plan", help="plan a streamed run: batch hiding I/O, memory, step time")
    p.add_argument("--model", default="mlp", choices=["mlp"], help="model family (mlp)")
    p.add_argument("--width", type=int, default=1024, help="hidden width")
    p.add_argument("--depth", type=int, default=8, help="number of streamed layers L")
    p.add_argument("--in-dim", type=int, default=64, help="input features")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--tangents", type=int, default=1, help="K jvp tangents per step")
    p.add_argument("--device-flops", type=float, default=None,
                   help="device FLOP/s (default: measured with a matmul on the default device)")
    p.add_argument("--read-bandwidth", type=float, default=None,
                   help="store read bandwidth in bytes/s (default: measured with --probe-dir)")
    p.add_argument("--probe-dir", default=None, help="directory to measure read bandwidth in")
    p.add_argument("--device-memory", type=float, default=16e9, help="device memory in bytes")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--compute-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    p.set_defaults(func=main_plan)
    return p


MAX_LAYER_BYTES = 2**44  # 16 TiB: a layer beyond any device, yet far below XLA's size limits


def check_plan_args(args: argparse.Namespace) -> None:
    """Every flag checked before anything is measured; errors name the flag."""
    from jaxstream.experiment.config import ConfigError

    for name in ("width", "depth", "in_dim", "num_classes", "tangents"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("device_flops", "read_bandwidth", "device_memory"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.prefetch < 0:
        raise ConfigError(f"--prefetch must be >= 0, got {args.prefetch}")
    layer_bytes = 4 * (args.width * (args.width + 1) + args.in_dim * args.width
                       + args.width * args.num_classes)
    if layer_bytes > MAX_LAYER_BYTES:
        raise ConfigError(f"--width {args.width} --in-dim {args.in_dim}: one layer would hold "
                          f"{layer_bytes / 2**40:.3g} TiB of fp32 parameters; the planner "
                          f"analyses layers up to {MAX_LAYER_BYTES / 2**40:.0f} TiB")
    if args.probe_dir is not None:
        if not os.path.isdir(args.probe_dir):
            raise ConfigError(f"--probe-dir {args.probe_dir} is not a directory")
        if not os.access(args.probe_dir, os.W_OK):
            raise ConfigError(f"--probe-dir {args.probe_dir} is not writable")
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(parent):
            raise ConfigError(f"--json {args.json}: needs a file path in an existing directory")


def _status(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def measure_device_flops(n: int = 1024, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n×n fp32 matmul on the default device."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        f(a).block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def measure_read_bandwidth(directory: str | None, size: int = 64 << 20) -> float:
    """Cold sequential read bandwidth (bytes/s) of a file written in ``directory``."""
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as fh:
        fh.write(os.urandom(size))
        fh.flush()
        os.fsync(fh.fileno())
        path = fh.name
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.read(fd, 8 << 20):
            pass
        dt = time.perf_counter() - t0
        os.close(fd)
    finally:
        os.unlink(path)
    return size / dt


def main_plan(args: argparse.Namespace) -> int:
    """Runs the ``plan`` sub-command; returns the exit status."""
    check_plan_args(args)
    import jax

    from jaxstream.models import mlp
    from jaxstream.stream.planner import format_plan, layer_cost, plan

    stack = mlp(args.in_dim, args.width, args.depth, args.num_classes)
    params = jax.eval_shape(stack.init, jax.random.key(0))
    sample = {"x": jax.ShapeDtypeStruct((8, args.in_dim), np.float32)}
    cost = layer_cost(stack, params, sample, tangents=args.tangents)
    flops = args.device_flops
    if flops is None:
        _status("measuring device FLOP/s (a 1024x1024 matmul; pass --device-flops to skip) ...")
        flops = measure_device_flops()
    bw = args.read_bandwidth
    if bw is None:
        _status(f"measuring read bandwidth in {args.probe_dir or tempfile.gettempdir()} (a 64 MiB "
                "file; pass --read-bandwidth to skip) ...")
        bw = measure_read_bandwidth(args.probe_dir)
    from jaxstream.experiment.config import ConfigError

    try:
        result = plan(cost, device_flops=flops, read_bandwidth=bw,
                      device_memory=args.device_memory, prefetch=args.prefetch,
                      compute_bytes=2 if args.compute_dtype == "bfloat16" else 4)
    except ValueError as e:  # the model does not fit the machine described: one line
        raise ConfigError(f"plan --width {args.width} --device-memory "
                          f"{args.device_memory:.3g}: {e}") from None
    print(f"device {flops / 1e9:.1f} GFLOP/s, read bandwidth {bw / 1e9:.2f} GB/s")
    print(format_plan(cost, result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cost": cost._asdict(), "plan": result._asdict(),
                       "device_flops": flops, "read_bandwidth": bw}, fh, indent=2)
    return 0
