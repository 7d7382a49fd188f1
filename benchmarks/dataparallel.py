"""Data parallel on 8 simulated CPU devices: ring vs psum, forward vs backprop bytes, codecs, placement.

  python benchmarks/dataparallel.py --quick --json dp.json
  python benchmarks/dataparallel.py --quick --doc docs/dataparallel.md   # rewrite its tables

Prints one table per part and writes the headline figures to JSON:
psum_max_rel_err / ring_max_rel_err (data-parallel backprop gradients vs single-device
whole-batch gradients), codec_bytes_ratio (packed vs dense all-reduce, bytes on the wire),
cholesky_max_rel_err (rebuilt L L^T vs the matrix sent), balance_before / balance_after
(slowest / mean stage time, count-even split vs optimal placement of a widening MLP on
devices of speeds 1, 1, 2, 0.5; slowest / ideal and the equal-speed case are reported too),
exchange_* (the dataparallel engine's steps, Max-AdaBelief with the gradient all-reduced vs
``exchange: moments``, the m̂ / s_max exchange of jaxstream.optim.max_adabelief_exchange: bytes
per step, final loss and test accuracy on digits).
Bytes are read from the compiled HLO (jaxstream.comm.traffic), times are medians.
``--doc`` rewrites the ``<!-- benchmark: dataparallel.py NAME -->`` blocks of a Markdown file
with the tables of this run (see jaxstream/experiment/docblock.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

from jaxstream.comm import (
    collectives,
    ring_all_reduce,
    send_symmetric,
    symmetric_traffic,
    traffic_summary,
)
from jaxstream.comm.dataparallel import data_parallel
from jaxstream.data.digits import load_digits as load_digits_split
from jaxstream.experiment.docblock import write_tables
from jaxstream.experiment.engine_dataparallel import DataParallelEngine, MomentExchangeEngine
from jaxstream.experiment.engines import LocalEngineConfig
from jaxstream.grad import backprop, forward
from jaxstream.models import mlp
from jaxstream.optim import max_adabelief, max_adabelief_exchange
from jaxstream.placement import measure_layer_costs, place_stages, uniform_placement
from jaxstream.quality.metrics import max_rel_err

N = 8
TABLES: dict[str, str] = {}  # name -> Markdown table of this run (for --doc)


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _table(name: str, title: str, header: list[str], rows: list[list]) -> None:
    """Print a Markdown table and keep it in ``TABLES[name]`` (with its title) for --doc."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(
            "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r) + " |"
        )
    TABLES[name] = f"{title}:\n\n" + "\n".join(lines)
    print(f"\n## {title}\n" + "\n".join(lines))


def allreduce_part(mesh: Mesh, lengths: list[int], repeats: int) -> None:
    rows = []
    for length in lengths:
        x = jax.device_put(
            np.random.default_rng(length).normal(size=(N, length)).astype(np.float32),
            jax.sharding.NamedSharding(mesh, P("data")),
        )
        ref = np.asarray(x, np.float64).sum(0)
        fns = {
            "psum": lambda v: jax.lax.psum(v[0], "data")[None],
            "ring": lambda v: ring_all_reduce(v[0], "data")[None],
        }
        out = {}
        for name, body in fns.items():
            fn = jax.jit(shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
            res = np.asarray(fn(x))
            err = float(np.max(np.abs(res - ref[None])) / np.max(np.abs(ref)))
            sent = traffic_summary(collectives(fn, x, num_devices=N))["sent_bytes"]
            out[name] = (_time(fn, x, repeats=repeats), sent, err)
        rows.append(
            [
                length,
                out["psum"][0] * 1e3,
                out["ring"][0] * 1e3,
                out["ring"][0] / out["psum"][0],
                int(out["psum"][1]),
                int(out["ring"][1]),
                out["psum"][2],
                out["ring"][2],
            ]
        )
    _table(
        "allreduce",
        "all-reduce of one float32 vector, 8 devices (sent bytes per device, ring model)",
        [
            "length",
            "psum ms",
            "ring ms",
            "ring/psum",
            "psum sent B",
            "ring sent B",
            "psum rel err",
            "ring rel err",
        ],
        rows,
    )


def gradient_part(mesh: Mesh, width: int, repeats: int) -> dict:
    digits = load_digits()
    x = (digits.data[:512] / 16.0).astype(np.float32)
    y = digits.target[:512].astype(np.int32)
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    stack = mlp(in_dim=64, width=width, depth=2, num_classes=10)
    params = stack.init(jax.random.key(0))
    num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    key = jax.random.key(1)
    _ref_loss, ref_grads = jax.jit(jax.value_and_grad(stack))(params, batch)
    single = jax.jit(lambda p, b, k: backprop()(stack, p, b, k))
    fw = forward(num_tangents=4)
    single_fw = jax.jit(lambda p, b, k: fw(stack, p, b, k))
    arms = {
        "backprop 1 device": (single, None),
        "backprop psum": (data_parallel(backprop(), mesh), ref_grads),
        "backprop ring": (data_parallel(backprop(), mesh, allreduce="ring"), ref_grads),
        "forward K=4 1 device": (single_fw, None),
        "forward psum grads": (data_parallel(fw, mesh, tangents="shared"), "fw"),
        "forward scalars shared": (
            data_parallel(fw, mesh, exchange="scalars", tangents="shared"),
            "fw",
        ),
        "forward scalars indep.": (data_parallel(fw, mesh, exchange="scalars"), None),
    }
    fw_ref = single_fw(params, batch, key)[1]
    rows, errs = [], {}
    for name, (est, ref) in arms.items():
        fn = est if hasattr(est, "lower") else jax.jit(lambda p, b, k, est=est: est(stack, p, b, k))
        _loss, grads = fn(params, batch, key)
        traffic = traffic_summary(collectives(fn, params, batch, key, num_devices=N))
        payload = traffic["all-reduce"] + traffic["all-gather"] / N + traffic["collective-permute"]
        err = "-" if ref is None else max_rel_err(grads, fw_ref if ref == "fw" else ref)
        errs[name] = err
        rows.append(
            [
                name,
                _time(fn, params, batch, key, repeats=repeats) * 1e3,
                int(payload),
                int(traffic["sent_bytes"]),
                err,
            ]
        )
    _table(
        "gradients",
        f"one gradient estimate, MLP 64-{width}-{width}-10 ({num_params} params, "
        f"{4 * num_params} B), batch 512 over 8 devices",
        ["estimator", "ms", "payload B / device", "sent B / device", "max rel err vs 1 device"],
        rows,
    )
    return {
        "psum_max_rel_err": errs["backprop psum"],
        "ring_max_rel_err": errs["backprop ring"],
        "forward_scalar_bytes": rows[5][3],
        "backprop_bytes": rows[1][3],
        "num_params": num_params,
    }


def codec_part(mesh: Mesh, dims: list[int]) -> dict:
    rows, ratio, chol_err = [], 0.0, 0.0
    for d in dims:
        rng = np.random.default_rng(d)
        a = rng.normal(size=(N, d, 2 * d)).astype(np.float32)
        mats = a @ np.swapaxes(a, 1, 2) / (2 * d) + 0.05 * np.eye(d, dtype=np.float32)
        mats = (mats + np.swapaxes(mats, 1, 2)) / 2
        sent = {
            c: symmetric_traffic(mats, mesh, codec=c)["sent_bytes"]
            for c in ("dense", "packed", "cholesky")
        }
        sent_p2p = {
            c: symmetric_traffic(mats, mesh, codec=c, op="send")["sent_bytes"]
            for c in ("dense", "packed", "cholesky")
        }
        moved = {c: np.asarray(send_symmetric(mats, mesh, codec=c)) for c in ("packed", "cholesky")}
        truth = np.roll(mats, 1, axis=0)
        err_p = float(np.max(np.abs(moved["packed"] - truth)))
        err_c = float(np.max(np.abs(moved["cholesky"] - truth) / np.max(np.abs(truth))))
        ratio = max(ratio, sent["packed"] / sent["dense"])
        chol_err = max(chol_err, err_c)
        rows.append(
            [
                d,
                int(sent["dense"]),
                int(sent["packed"]),
                sent["packed"] / sent["dense"],
                int(sent["cholesky"]),
                int(sent_p2p["dense"]),
                int(sent_p2p["cholesky"]),
                sent_p2p["cholesky"] / sent_p2p["dense"],
                err_p,
                err_c,
            ]
        )
    _table(
        "codecs",
        "symmetric codecs, 8 devices (bytes sent per device, from HLO)",
        [
            "d",
            "all-reduce dense B",
            "packed B",
            "packed/dense",
            "cholesky (all-gather) B",
            "send dense B",
            "send cholesky B",
            "cholesky/dense",
            "packed abs err",
            "cholesky rel err",
        ],
        rows,
    )
    return {"codec_bytes_ratio": ratio, "cholesky_max_rel_err": chol_err}


def placement_part(repeats: int) -> dict:
    widths = [64 * (i + 1) for i in range(12)]  # a widening MLP: costs grow ~ quadratically
    batch = 256
    layers, args = [], []
    for i, w_in in enumerate(widths):
        w_out = widths[(i + 1) % len(widths)]
        w = jnp.ones((w_in, w_out), jnp.float32) / w_in
        layers.append(lambda x, w: jnp.tanh(x @ w))
        args.append((jnp.ones((batch, w_in), jnp.float32), w))
    costs = measure_layer_costs(layers, args, repeats=repeats)
    rows, out = [], {}
    for label, speeds in (
        ("same devices", [1.0, 1.0, 1.0, 1.0]),
        ("mixed devices", [1.0, 1.0, 2.0, 0.5]),
    ):
        before, after = uniform_placement(costs, speeds), place_stages(costs, speeds)
        for name, p in (("even split", before), ("optimal", after)):
            rows.append(
                [
                    label,
                    str(speeds),
                    name,
                    str(p.sizes),
                    " ".join(f"{t * 1e3:.3f}" for t in p.stage_times),
                    p.slowest * 1e3,
                    p.balance,
                    p.slowest / p.ideal,
                ]
            )
        out[label] = (before, after)
    _table(
        "placement",
        f"stage placement: {len(widths)} uneven layers (measured ms: "
        f"{' '.join(f'{c * 1e3:.3f}' for c in costs)})",
        [
            "devices",
            "speeds",
            "placement",
            "layers/stage",
            "stage ms",
            "slowest ms",
            "slowest/mean",
            "slowest/ideal",
        ],
        rows,
    )
    same, mixed = out["same devices"], out["mixed devices"]
    return {
        "balance_before": mixed[0].balance,
        "balance_after": mixed[1].balance,
        "slowest_over_ideal_before": mixed[0].slowest / mixed[0].ideal,
        "slowest_over_ideal_after": mixed[1].slowest / mixed[1].ideal,
        "placement_speedup": mixed[0].slowest / mixed[1].slowest,
        "same_devices_balance_before": same[0].balance,
        "same_devices_balance_after": same[1].balance,
    }


def _engine(stack, mesh: Mesh, exchange: str, allreduce: str, kw: dict):
    """The ``dataparallel`` engine as the runner builds it (backprop arm, lr 3e-3)."""
    dp = data_parallel(backprop(), mesh, allreduce=allreduce, exchange=exchange)
    if exchange == "moments":
        opt = max_adabelief_exchange(3e-3, **kw, allreduce=allreduce)
        return MomentExchangeEngine(LocalEngineConfig(), dp=dp, stack=stack, optimizer=opt)
    return DataParallelEngine(LocalEngineConfig(), dp=dp, stack=stack,
                              optimizer=max_adabelief(3e-3, **kw))


def exchange_part(mesh: Mesh, width: int, steps: int, repeats: int) -> dict:
    """Max-AdaBelief after a gradient all-reduce vs the m̂ / s_max exchange, on digits."""
    ds = load_digits_split(seed=0)
    stack = mlp(in_dim=64, width=width, depth=2, num_classes=10)
    params0 = stack.init(jax.random.key(0))
    num_params = sum(leaf.size for leaf in jax.tree.leaves(params0))
    batch_size = 64 * N
    idx = np.random.default_rng(0).integers(0, len(ds.train["y"]), size=(steps, batch_size))
    test = {k: jnp.asarray(v) for k, v in ds.test.items()}
    kw = {"eps": 1e-8, "eps_root": 1e-12, "max_of": "corrected"}
    arms = {
        "gradients psum, max_adabelief": ("gradients", "psum"),
        "gradients ring, max_adabelief": ("gradients", "ring"),
        "moments psum (m̂, s_max)": ("moments", "psum"),
        "moments ring (m̂, s_max)": ("moments", "ring"),
    }
    accuracy = jax.jit(stack.accuracy)
    rows, finals = [], {}
    key = jax.random.key(0)
    for name, (exchange, allreduce) in arms.items():
        engine = _engine(stack, mesh, exchange, allreduce, kw)
        state = engine.init(params0, None)
        first = {k: jnp.asarray(v[idx[0]]) for k, v in ds.train.items()}
        traffic = traffic_summary(collectives(engine.step, state, first, key, num_devices=N))
        payload = traffic["all-reduce"] + traffic["all-gather"] / N + traffic["collective-permute"]
        ms = _time(engine.step, state, first, key, repeats=repeats) * 1e3
        losses = []
        for t in range(steps):
            batch = {k: jnp.asarray(v[idx[t]]) for k, v in ds.train.items()}
            state, metrics = engine.step(state, batch, key)
            losses.append(float(metrics["loss"]))
        params = engine.params(state)
        finals[name] = params
        rows.append(
            [
                name,
                int(payload),
                int(traffic["sent_bytes"]),
                traffic["sent_bytes"] / (4 * num_params),
                ms,
                float(np.mean(losses[-10:])),
                float(accuracy(params, test)),
            ]
        )
    gap = max_rel_err(finals["moments psum (m̂, s_max)"], finals["gradients psum, max_adabelief"])
    ring_gap = max_rel_err(finals["moments ring (m̂, s_max)"], finals["moments psum (m̂, s_max)"])
    _table(
        "exchange",
        f"data-parallel Max-AdaBelief (max_of corrected, lr 3e-3), MLP 64-{width}-{width}-10 "
        f"({num_params} params), digits, batch {batch_size} over {N} devices, {steps} steps; "
        f"final params, moments vs gradients (psum): max rel diff {gap:.3g}; "
        f"moments ring vs psum: {ring_gap:.3g}",
        [
            "exchange",
            "payload B / device",
            "sent B / device",
            "sent / params B",
            "ms / step",
            "train loss (last 10)",
            "test acc",
        ],
        rows,
    )
    return {
        "exchange_gradients_bytes": rows[0][1],
        "exchange_moments_bytes": rows[2][1],
        "exchange_moments_ring_sent_bytes": rows[3][2],
        "exchange_final_params_rel_diff": gap,
        "exchange_ring_vs_psum_rel_diff": ring_gap,
        "exchange_test_acc": {r[0]: r[6] for r in rows},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (< 2 minutes)")
    parser.add_argument("--json", type=str, default=None, help="write the figures here")
    parser.add_argument(
        "--doc", type=str, default=None, help="rewrite this Markdown file's benchmark blocks"
    )
    args = parser.parse_args()
    if jax.device_count() < N:
        raise SystemExit(
            f"needs {N} devices; got {jax.device_count()} (XLA_FLAGS is set "
            "before jax is imported; do not import jax first)"
        )
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",))
    repeats = 5 if args.quick else 20
    t0 = time.perf_counter()
    allreduce_part(
        mesh,
        [1_001, 100_003, 1_000_000] if args.quick else [1_001, 100_003, 1_000_000, 10_000_003],
        repeats,
    )
    out = gradient_part(mesh, 128 if args.quick else 512, repeats)
    out |= codec_part(mesh, [16, 64] if args.quick else [16, 64, 256])
    out |= placement_part(repeats)
    out |= exchange_part(mesh, 64 if args.quick else 128, 200 if args.quick else 400, repeats)
    out["devices"] = N
    out["backend"] = jax.default_backend()
    out["seconds"] = time.perf_counter() - t0
    print("\n" + json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out | {"tables": TABLES}, f, indent=1)
    if args.doc:
        command = "python benchmarks/dataparallel.py " + " ".join(sys.argv[1:])
        names = write_tables(args.doc, "dataparallel.py", TABLES, command)
        print(f"{args.doc}: {len(names)} tables written ({', '.join(names)})", file=sys.stderr)


if __name__ == "__main__":
    main()
