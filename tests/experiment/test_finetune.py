"""``kind: finetune``: the shipped config at a tiny size — pretrained in memory, fine-tuned from
layer stores on data read from a data store, bytes per step against the model's shapes, bf16
compute, and bad input refused before any compute."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxstream.data import load_text
from jaxstream.data.stored import StoredField, open_data_store
from jaxstream.data.text import FINETUNE_FILES, TEST_FILES, TRAIN_FILES, corpus, decode
from jaxstream.experiment import engine_stream, finetune
from jaxstream.experiment.compiled import evaluator_for
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.finetune_report import main as report_main
from jaxstream.experiment.registry import load_experiment
from jaxstream.experiment.runner import run_experiment
from jaxstream.models import char_transformer

CONFIG = Path(__file__).parents[2] / "experiments" / "finetune_stream.yaml"
D, HEADS, DEPTH, T, STEPS, K = 16, 2, 3, 16, 3, 2
TINY = [f"model.d_model={D}", f"model.num_heads={HEADS}", f"model.depth={DEPTH}",
        f"steps={STEPS}", f"eval_every={STEPS}", f"pretrain.data.seq_len={T}",
        f"source.seq_len={T}", "progress=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The shipped config, tiny, once; with the data store's reads counted, the pretrained
    parameters kept and the stream executors' configs recorded."""
    seen: dict = {"reads": 0, "stream": []}
    read, pretrain = StoredField.__getitem__, finetune.pretrain
    executor = engine_stream.StreamedExecutor

    def counted(self, idx):
        seen["reads"] += 1
        return read(self, idx)

    def kept(*a, **kw):
        params, records = pretrain(*a, **kw)
        seen["pretrained"] = params
        return params, records

    def recorded(stack, estimator, optimizer, store, cfg):
        seen["stream"].append(cfg)
        return executor(stack, estimator, optimizer, store, cfg)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StoredField, "__getitem__", counted)
        mp.setattr(finetune, "pretrain", kept)
        mp.setattr(engine_stream, "StreamedExecutor", recorded)
        run_dir, summary = run_experiment(CONFIG, TINY, out=tmp_path_factory.mktemp("ft") / "r")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "summary": summary, "records": records, **seen}


def _arm(run, name: str) -> list[dict]:
    return [r for r in run["records"] if r["arm"] == name]


def _sizes() -> tuple[int, int]:
    """fp32 bytes of all parameters and of embed + head, from the model's shapes."""
    shapes = jax.eval_shape(char_transformer(96, T, D, HEADS, DEPTH).init, jax.random.key(0))
    n = lambda t: 4 * sum(int(np.prod(a.shape)) for a in jax.tree.leaves(t))
    return n(shapes), n(shapes["embed"]) + n(shapes["head"])


@pytest.mark.slow
def test_fine_tune_data_is_the_second_text_read_from_its_store(run):
    store = run["dir"] / "data"
    assert (store / "info.json").is_file() and run["reads"] >= STEPS
    written = open_data_store(store)
    source = load_text(0, T, 16, 8, corpus_name="b")
    np.testing.assert_array_equal(np.asarray(written.train["x"]), source.train["x"])
    pre = load_text(0, T, 16, 8)  # the pretraining text: other windows
    assert not np.array_equal(pre.train["x"], source.train["x"])


@pytest.mark.slow
def test_every_arm_starts_from_the_pretrained_model(run):
    pre = _arm(run, "pretrain")
    assert pre[0]["train_loss"] != pre[-1]["train_loss"]  # pretraining moved the model
    data = open_data_store(run["dir"] / "data")
    stack = char_transformer(96, T, D, HEADS, DEPTH)
    loss, _ = evaluator_for(stack)(run["pretrained"], {k: np.asarray(v) for k, v in
                                                      data.train.items()})
    fresh, _ = evaluator_for(stack)(stack.init(jax.random.fold_in(jax.random.key(0), 0)),
                                    {k: np.asarray(v) for k, v in data.train.items()})
    assert abs(float(fresh) - float(loss)) > 1e-3
    for name in ("forward_stream", "forward_memory", "backprop_stream"):
        np.testing.assert_allclose(_arm(run, name)[0]["train_loss"], float(loss), rtol=1e-6)


@pytest.mark.slow
def test_forward_arm_reads_each_layer_once_and_writes_blocks_every_k_steps(run):
    p_all, _ = _sizes()
    steps = [r for r in _arm(run, "forward_stream") if r["step"] > 0]
    for r in steps[1:]:  # steady steps
        assert r["bytes_read_params"] == p_all
        rewrite = (r["step"] - 1) % K == 0  # the read of zero-based step t % k == 0 finds k
        assert r["bytes_written_params"] == (p_all if rewrite else 0)  # embed, head with them
    for r in _arm(run, "backprop_stream")[1:]:
        assert r["bytes_written_params"] == p_all  # backprop writes every layer every step
    arm = run["summary"]["arms"]["forward_stream"]
    assert arm["block_writes_per_step"] == pytest.approx(1 / K)
    assert arm["model_reads_per_step"] == pytest.approx(1.0)


@pytest.mark.slow
def test_streamed_arms_compute_in_bfloat16(run):
    assert [c.compute_dtype for c in run["stream"]] == ["bfloat16", "bfloat16"]
    assert [c.rewrite_every for c in run["stream"]] == [K, 1]
    # The first step's loss at the same parameters and batch: bf16 against fp32 in memory
    streamed, memory = (_arm(run, n)[1]["loss"] for n in ("forward_stream", "forward_memory"))
    assert streamed != memory
    assert streamed == pytest.approx(memory, rel=1e-2)


@pytest.mark.slow
def test_report_writes_its_doc_blocks(run, tmp_path, capsys):
    doc = tmp_path / "doc.md"
    blocks = "".join(f"<!-- generated: finetune_report {k} -->\nPLACEHOLDER\n<!-- end generated -->\n"
                     for k in ("model", "table", "losses"))
    doc.write_text(blocks)
    assert report_main([str(run["dir"]), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "PLACEHOLDER" not in text and "| forward_stream |" in text and "Written by" in text
    (tmp_path / "empty.md").write_text("nothing\n")
    assert report_main([str(run["dir"]), "--doc", str(tmp_path / "empty.md")]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("override, field", [
    (["pretrain.steps=0"], "pretrain.steps"),
    (["arms.0.engine.update=eager"], "arms.0.engine.rewrite_every"),
    (["arms.1.engine.type=pipeline"], "arms.1.engine"),
    (["data_store="], "data_store")])
def test_bad_config_is_refused_by_name(override, field):
    with pytest.raises(ConfigError, match=field):
        load_experiment(CONFIG, override)


@pytest.mark.parametrize("override, field", [
    (["source=null"], "source"),
    (["pretrain.data.seq_len=8"], "pretrain.data")])
def test_bad_data_is_refused_before_anything_is_written(tmp_path, override, field):
    out = tmp_path / "r"
    with pytest.raises(ValueError, match=field):
        run_experiment(CONFIG, [*TINY, *override], out=out)
    assert not out.exists() or not any(out.iterdir())


def test_data_store_that_is_not_one_is_refused(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file").write_text("x")
    _, cfg = load_experiment(CONFIG, [*TINY, f"data_store={tmp_path / 'junk'}"])
    with pytest.raises(ValueError, match="data_store"):
        cfg.check_run(resume=False)


def test_second_text_is_other_files_and_the_default_is_unchanged():
    assert not set(FINETUNE_FILES) & (set(TRAIN_FILES) | set(TEST_FILES))
    b = load_text(seed=1, seq_len=16, num_train=8, num_test=4, corpus_name="b")
    text_b = decode(corpus(FINETUNE_FILES))
    assert all(decode(x) in text_b for x in b.train["x"])
    a, default = load_text(1, 16, 8, 4, corpus_name="a"), load_text(1, 16, 8, 4)
    for split in ("train", "test"):
        for k in ("x", "y"):
            np.testing.assert_array_equal(getattr(a, split)[k], getattr(default, split)[k])
    with pytest.raises(ValueError, match="corpus"):
        load_text(seq_len=8, num_train=2, num_test=2, corpus_name="c")
