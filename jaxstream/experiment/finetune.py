"""``kind: finetune``: pretrain in memory by backprop, fine-tune from a layer store.

The run (see :class:`~jaxstream.experiment.finetune_config.FinetuneConfig`):

1. writes the fine-tune's data to a data store (``data_store``, from ``source``) unless it
   exists; every fine-tune batch is read from that store during training;
2. pretrains the model by backprop in memory on ``pretrain.data`` (records ``arm: pretrain``);
3. writes the pretrained parameters to one layer store per streamed arm (the arm then trains on
   from it: ``continue_store``, a hand-over recorded in the store);
4. trains the in-memory arms from the pretrained parameters, drops them, then trains the
   streamed arms (so a streamed arm's process holds no copy of the model);
5. writes ``finetune.json``: per arm the loss at the start and the end, bytes read and written
   per step (of the model's parameters, and in all), the effective read bandwidth against the
   raw one ``jaxstream plan`` measures, and the peak resident memory of the arm's steps.

Peak RSS (Linux): the kernel's high-water mark (``VmHWM``), reset after the arm's step-0
evaluation (which reads the whole model: the runner's evaluator runs in memory) and read before
the first step (``rss_warm_up``: the compilation; a streamed warm-up holds one unit's gradient
at a time), then reset again (``rss_start``) and read after each step before its evaluation
(``rss_peak``: the steps alone). ``rss_constant`` is the process's resident memory once JAX has
started, before any data or model.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxstream.data.batches import batch_at
from jaxstream.data.stored import INFO, open_data_store, write_data_store
from jaxstream.experiment.compiled import engine_for, evaluator_for, model_for
from jaxstream.experiment.engine_stream import StreamEngineConfig
from jaxstream.experiment.engines import LocalEngine, LocalEngineConfig
from jaxstream.experiment.estimators import BackpropConfig, describe
from jaxstream.experiment.finetune_config import FinetuneConfig
from jaxstream.experiment.loop import TrainLoop
from jaxstream.experiment.optimizers import OptimizerConfig, build_optimizer
from jaxstream.experiment.progress import status
from jaxstream.experiment.registry import register_experiment
from jaxstream.experiment.rundir import MetricsLog, write_json
from jaxstream.experiment.train import _eval_record, train_arm
from jaxstream.stream.store import LayerStore

SUMMARY = "finetune.json"


def rss(field: str = "VmRSS") -> int | None:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``) in bytes, from
    ``/proc/self/status`` (None where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Releases freed memory to the OS and resets the peak (``VmHWM``) to the current RSS;
    False where the kernel does not allow it (the peak then covers the whole process)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def data_location(cfg: FinetuneConfig, run_dir: Path) -> Path:
    """The fine-tune's data store: ``data_store`` or ``<run>/data``."""
    return Path(cfg.data_store) if cfg.data_store is not None else run_dir / "data"


def pretrain(cfg: FinetuneConfig, stack: Any, params: Any, data: Any
             ) -> tuple[Any, list[dict]]:
    """``pretrain.steps`` backprop Adam steps in memory on ``data``; returns the parameters
    (on the host) and the records (``arm: pretrain``; the loss on both splits at the start and
    the end)."""
    p = cfg.pretrain
    engine = LocalEngine(LocalEngineConfig(), stack=stack, estimator=BackpropConfig().build(),
                         optimizer=build_optimizer(OptimizerConfig(), p.lr))
    key = jax.random.key(cfg.seed)  # backprop draws nothing
    evaluate = evaluator_for(stack)
    records = [{"arm": "pretrain", "step": 0,
                **_eval_record(evaluate, params, data.train, data.test)}]
    loop = TrainLoop(engine.step, tags={"arm": "pretrain"},
                     batch_at=lambda s: batch_at(data.train, p.batch_size, cfg.seed, s),
                     key_at=lambda s: key)
    loop.add_hook(lambda i: i.record.update(
        _eval_record(evaluate, engine.params(i.state), data.train, data.test)), every=p.steps)
    loop.add_hook(lambda i: records.append(i.record))
    status(f"pretraining: {p.steps} backprop steps in memory")
    out = loop.run(engine.init(params, key), start=0, stop=p.steps)
    return jax.device_get(engine.params(out.state)), records


def write_layer_store(cfg: FinetuneConfig, i: int, stack: Any, params: Any, run_dir: Path,
                      data_path: Path, example: dict) -> str:
    """The pretrained ``params`` as arm ``i``'s layer store (with its optimizer's initial
    state), where its engine looks for it; returns the location."""
    tc = cfg.train_config(i, data_path)
    engine = engine_for(tc, tc.arms[0], stack, example_batch=example)
    where = tc.engine.location(tc.arms[0].name, run_dir)
    store = LayerStore.create(where, params, optimizer=engine.optimizer,
                              model_config=engine.model_config,
                              file_io_concurrency=tc.engine.file_io_concurrency)
    store.close()
    return where


def model_bytes(stack: Any) -> dict[str, int]:
    """fp32 bytes of the model's parameters, of its largest unit and of embed + head, and
    the parameter count and unit count, from the shapes alone."""
    shapes = jax.eval_shape(stack.init, jax.random.key(0))
    size = lambda t: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(t))
    count = size(shapes)
    blocks = size(shapes["blocks"]) // stack.num_layers
    ends = size(shapes["embed"]) + size(shapes["head"])
    return {"params": count, "fp32_bytes": 4 * count, "num_blocks": stack.num_layers,
            "unit_bytes": 4 * max(blocks, size(shapes["embed"]), size(shapes["head"])),
            "block_bytes": 4 * blocks, "ends_bytes": 4 * ends}


def budget(engine: Any, sizes: dict[str, int]) -> int:
    """Bytes a streamed arm holds resident on the device: ``prefetch + 2`` units (the computing
    one, those read ahead, the previous one until its arrays go: ``benchmarks/composed.py``'s
    ``device_copies``) of the largest unit, in the compute dtype."""
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[engine.compute_dtype]
    return (engine.prefetch + 2) * sizes["unit_bytes"] // 4 * item


def arm_summary(records: list[dict], sizes: dict[str, int], engine: Any) -> dict[str, Any]:
    """An arm's figures from its records: losses, and the bytes per step, step time and
    effective read bandwidth (bytes read / step time) as means over the steps after the first
    (a streamed arm's first step reads more: its figures are kept as ``first_step_*``)."""
    steps = [r for r in records if r.get("step", 0) > 0 and "loss" in r]
    first, last = records[0], records[-1]
    steady = steps[1:] or steps
    mean = lambda k: float(np.mean([r[k] for r in steady]))
    out = {"engine": type(engine).__name__, "steps": len(steps),
           "loss_start": first.get("train_loss"), "test_loss_start": first.get("test_loss"),
           "loss_end": last.get("train_loss"), "test_loss_end": last.get("test_loss"),
           "step_losses": [r["loss"] for r in steps],
           "step_time": float(np.mean([r["step_time"] for r in steady])) if steady else None}
    if steps and "bytes_read" in steps[0]:
        read = sum(r["bytes_read"] for r in steady)
        out.update({k: mean(k) for k in ("bytes_read", "bytes_written", "bytes_read_params",
                                          "bytes_written_params")})
        out["first_step_bytes_read"] = steps[0]["bytes_read"]
        out["model_reads_per_step"] = out["bytes_read_params"] / sizes["fp32_bytes"]
        # every unit (embed and head too) is written back on the same steps as the blocks
        out["block_writes_per_step"] = out["bytes_written_params"] / sizes["fp32_bytes"]
        out["read_bandwidth"] = read / sum(r["step_time"] for r in steady)
        out["budget_bytes"] = budget(engine, sizes)
    return out


@register_experiment("finetune", FinetuneConfig)
def run_finetune(cfg: FinetuneConfig, run_dir: Path) -> dict[str, Any]:
    """Pretrain, write the stores, fine-tune every arm; write ``metrics.jsonl`` and
    ``finetune.json`` (see the module docstring) and return the summary."""
    from jaxstream.experiment.finetune_report import format_tables

    t_run = time.perf_counter()
    run_dir = Path(run_dir)
    jax.devices()
    constant = rss()
    where, data, stack, params, records = _pretrained(cfg, run_dir)
    log = MetricsLog(run_dir / "metrics.jsonl")
    log.rewrite(records)
    streamed = [i for i, a in enumerate(cfg.arms) if isinstance(a.engine, StreamEngineConfig)]
    example = batch_at(data.train, cfg.batch_size, cfg.seed, 0)
    for i in streamed:
        status(f"{cfg.arms[i].name}: writing the pretrained model to a layer store")
        write_layer_store(cfg, i, stack, params, run_dir, where, example)
    abstract = jax.eval_shape(lambda: params)
    results: dict[str, dict] = {}
    for i in [i for i in range(len(cfg.arms)) if i not in streamed] + streamed:
        if streamed and i == streamed[0]:
            params = None  # the streamed arms hold no copy of the model
        done = records + [r for a in results.values() for r in a["records"]]
        results[cfg.arms[i].name] = _finetune_arm(cfg, i, i in streamed, stack, data, where,
                                                  abstract if i in streamed else params,
                                                  run_dir, log, done)
    log.rewrite(records + [r for a in cfg.arms for r in results[a.name]["records"]])
    summary = _summary(cfg, run_dir, model_bytes(stack), constant, where, records, results)
    summary["run_time"] = time.perf_counter() - t_run
    write_json(run_dir / SUMMARY, summary)
    print(format_tables(summary))
    return summary


def _pretrained(cfg: FinetuneConfig, run_dir: Path) -> tuple[Path, Any, Any, Any, list[dict]]:
    """The fine-tune data's store (written if absent), the model, its pretrained params and
    the pretraining's records."""
    where = data_location(cfg, run_dir)
    pre = cfg.pretrain.data.dataset(cfg.seed)
    if (where / INFO).is_file():
        status(f"fine-tune data: the data store at {where}")
    else:
        status(f"writing the fine-tune data to a data store at {where}")
        write_data_store(cfg.source.dataset(cfg.seed), where)
    data = open_data_store(where)
    stream_tc = dataclasses.replace(cfg.train_config(0, where), engine=StreamEngineConfig())
    stack = model_for(stream_tc, data.info, np.asarray(data.train["x"][:2]))  # a stack
    params = stack.init(jax.random.fold_in(jax.random.key(cfg.seed), 0))
    params, records = pretrain(cfg, stack, params, pre)
    return where, data, stack, params, records


def _finetune_arm(cfg: FinetuneConfig, i: int, streamed: bool, stack: Any, data: Any,
                  where: Path, init: Any, run_dir: Path, log: MetricsLog,
                  done: list[dict]) -> dict:
    """Fine-tunes arm ``i`` (a streamed arm continues its layer store; ``init``: its params, or
    their shapes for a streamed arm), with its resident memory at the start, after the
    warm-up and at the peak."""
    tc = cfg.train_config(i, where)
    if streamed:
        tc = dataclasses.replace(tc, engine=dataclasses.replace(tc.engine, continue_store=True))
    peak: dict[str, Any] = {}

    def on_start(recs: list[dict]) -> None:
        log.rewrite(done + recs)
        reset_peak()  # after the step-0 evaluation

    def before_step(info: Any) -> None:
        if "start" not in peak:  # the first step, after the compilation (warm-up)
            peak["warm_up"] = rss("VmHWM")
            peak["reset"] = reset_peak()
            peak["start"] = rss()

    def after_step(info: Any) -> None:
        peak["peak"] = rss("VmHWM")

    out = train_arm(tc, tc.arms[0], stack=stack, data=data, init_params=init, run_dir=run_dir,
                    log=log, kept=[], resume=False, on_start=on_start,
                    hooks=((before_step, {"before": True}), (after_step, {})))
    return {"records": out["records"], "diverged": out["diverged"],
            "compile_time": out["compile_time"], "rss_start": peak.get("start"),
            "rss_warm_up": peak.get("warm_up") if peak.get("reset") else None,
            "rss_peak": peak.get("peak") if peak.get("reset") else None}


def _summary(cfg: FinetuneConfig, run_dir: Path, sizes: dict, constant: Any, where: Path,
             records: list[dict], results: dict[str, dict]) -> dict[str, Any]:
    """``finetune.json``: the model's sizes, the host's constant memory and raw read
    bandwidth, the pretraining, and each arm's figures."""
    from jaxstream.experiment.plan_cli import measure_read_bandwidth

    raw = measure_read_bandwidth(str(run_dir))
    arms = {}
    for arm in cfg.arms:
        res = results[arm.name]
        arms[arm.name] = {**arm_summary(res["records"], sizes, arm.engine),
                          "estimator": describe(arm.estimator), "lr": arm.lr,
                          "diverged": res["diverged"], "compile_time": res["compile_time"],
                          "rss_start": res["rss_start"], "rss_peak": res["rss_peak"],
                          "rss_warm_up": res["rss_warm_up"],
                          "engine_config": dataclasses.asdict(arm.engine)}
    return {"model": sizes, "rss_constant": constant, "raw_read_bandwidth": raw,
            "data_store": str(where), "pretrain": {
                "steps": cfg.pretrain.steps, "loss_start": records[0]["train_loss"],
                "loss_end": records[-1]["train_loss"],
                "test_loss_end": records[-1]["test_loss"]},
            "arms": arms}
