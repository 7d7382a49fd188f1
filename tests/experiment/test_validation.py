"""Every config field's range is checked when the config loads (or, for the machine's memory
and existing stores, before the run directory is made): nothing is written for a bad config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaxstream.cli import main as cli_main
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
STREAM = ROOT / "experiments" / "stream_mlp.yaml"
LR_SWEEP = ROOT / "experiments" / "lr_sweep_digits.yaml"
PIPELINE = ROOT / "experiments" / "pipeline_mlp.yaml"

CASES = [
    (QUICKSTART, ["optimizer.clip_norm=-1"], r"optimizer.clip_norm: must be > 0"),
    (QUICKSTART, ["optimizer.clip_norm=0"], r"optimizer.clip_norm: must be > 0"),
    (QUICKSTART, ["model.width=0"], r"model.width: must be >= 1, got 0"),
    (QUICKSTART, ["model.depth=-2"], r"model.depth: must be >= 1, got -2"),
    (QUICKSTART, ["seed=-1"], r"seed: must be in \[0, 4294967295\], got -1"),
    (QUICKSTART, ["seed=4294967296"], r"seed: must be in \[0, 4294967295\], got 4294967296"),
    (LR_SWEEP, ["seed=-1"], r"seed: must be in \[0, 4294967295\], got -1"),
    (LR_SWEEP, ["data.split_seed=-3"], r"data.split_seed: must be in \[0, 4294967295\] or null, got -"),
    (QUICKSTART, ["batch_size=0"], r"batch_size: must be >= 1"),
    (QUICKSTART, ["optimizer.options={b1: hello}"], r"optimizer.options.b1: expected a number"),
    (QUICKSTART, ["optimizer.options={nesterov: 1}", "optimizer.name=sgd"],
     r"optimizer.options.nesterov: expected true or false"),
    (QUICKSTART, ["model.width=1000000000"], r"model: needs about .* GiB .* this machine has"),
    (STREAM, ["arms.1.estimator={type: hybrid_activity}"],
     (r"arms.1.estimator: stream: estimator must be one that mixes exact gradients with weight "
      r"tangents; got HybridActivity")),
    (STREAM, ["engine.update=lazy", "arms.1.estimator={type: forward, perturb: activations}"],
     r"arms.1.estimator: stream: update='lazy' needs the forward"),
    (PIPELINE, ["engine.stages=3"], r"engine.stages: 3 must divide model.depth = 8"),
    (QUICKSTART, ["model={type: nosuch}"], r"model.type: 'nosuch' is not registered; .*--plugin"),
    (STREAM, ["engine.store=/tmp/one"], r"engine.store: .* shared by the arms"),
    (QUICKSTART, ["arms.0.lr=.inf"], r"arms.0.lr: expected a finite number"),
    (STREAM, ["engine.micro_batches=7"], r"engine.micro_batches: batch_size=64 is not divisible"),
    (STREAM, ["engine.prefetch=6"], (r"engine.prefetch: 6 reads past the model's 6 units "
                                     r"\(embed, 4 blocks, head\); allowed: 0..5")),
    (STREAM, ["engine.updates_in_flight=7"], (r"engine.updates_in_flight: 7 host updates "
                                              r"queued, a step has 6 units .*allowed: 1\.\.6")),
    (STREAM, ["engine.layers_per_unit=5", "arms=[{name: fw, estimator: {type: forward}}]"],
     r"engine.layers_per_unit: 5 layers per unit, the model has 4 blocks; allowed: 1\.\.4"),
    (QUICKSTART, ["engine={type: dataparallel, devices: 1000}"],
     (r"engine.devices: 1000 requested but only \d+ devices exist.*"
      r"xla_force_host_platform_device_count=1000")),
    (QUICKSTART, ["optimizer.options={b1: 1.5}"], r"optimizer.options.b1: must be in \[0, 1\)"),
    (QUICKSTART, ["optimizer.options={eps: -1e-8}"], r"optimizer.options.eps: must be > 0"),
    (QUICKSTART, ["target_accuracy=0"], r"target_accuracy: must be in \(0, 1\]"),
    (QUICKSTART, ["data.split_seed=-1"], r"data.split_seed: must be in \[0, 4294967295\] or null, got -"),
    (QUICKSTART, ["arms.0.estimator={type: forward, num_tangents: 2, antithetic: true}"],
     r"arms.0.estimator.antithetic: refused for jvp estimates"),
]


@pytest.mark.parametrize("config, overrides, match", CASES)
def test_bad_config_is_refused_before_anything_is_written(tmp_path, config, overrides, match):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=match):
        run_experiment(config, overrides, out=out)
    assert not out.exists()


def test_out_at_a_file_is_a_config_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run_experiment(QUICKSTART, ["steps=1"], out=f)


@pytest.mark.parametrize("text, match", [
    (None, r"no such config file"),
    ("kind: train\nsteps: [1,\n", r"line 3, column 1: YAML syntax error"),
    ("kind: train\nseed: !!python/object/apply:os.getcwd []\n", r"line 2, column 7: .*no tags"),
    # a key given twice: YAML would keep the last one silently
    ("kind: train\nsteps: 5\nseed: 1\nsteps: 7\n",
     r"line 4, column 1: key 'steps' is given twice in one mapping \(first on line 2\)"),
    ("kind: train\noptimizer: {name: adam, lr: 0.1, lr: 0.2}\n",
     r"line 2, column 34: key 'lr' is given twice"),
])
def test_config_file_errors_name_the_file_and_line(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}:? .*{match}|{path}: {match}"):
        run_experiment(path, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _laughs(levels: int) -> str:
    """A billion-laughs file: each level an alias list of 9 copies of the level below."""
    lines = ["kind: train", "x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _laughs_override(levels: int) -> str:
    """The same bomb in one command-line override (flow style)."""
    items = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    for i in range(1, levels):
        items.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "seed=[" + ", ".join(items) + "]"


@pytest.mark.parametrize("text, overrides, match", [
    (_laughs(9), [], r"more than 100000 values once its YAML aliases are expanded"),
    ("kind: train\nseed: " + "[" * 5000 + "]" * 5000 + "\n", [], r"nested deeper than YAML"),
    ("kind: train\nseed: " + "[" * 40 + "]" * 40 + "\n", [], r"nested deeper than 32 levels"),
    ("kind: train\na: &a [1, *a]\n", [], r"nested deeper than 32 levels .* contains itself"),
    ("# padding\n" * 200_000, [], r"bytes; an experiment file is at most 1048576 bytes"),
    ("kind: train\n", ["seed=" + "[" * 40 + "]" * 40], r"override seed: nested deeper than 32"),
    ("kind: train\n", [_laughs_override(8)], r"override seed: more than 100000 values"),
])
def test_hostile_config_files_are_refused_with_one_line(tmp_path, capsys, text, overrides, match):
    """Alias bombs, deep nesting and huge files: refused by name before any copy or compute,
    through the library and through the command line, and nothing is written."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=match):
        run_experiment(path, overrides, out=out)
    assert cli_main(["run", str(path), *overrides, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert not out.exists()


def test_switching_a_sections_type_says_how():
    """The documented way to switch a section's type is the whole section; the dotted override
    keeps the file's keys for the old type, and its error says what to write instead."""
    from jaxstream.experiment.registry import load_experiment

    with pytest.raises(ConfigError, match=r"data.test_fraction: unknown key for "
                                          r"CharsDataConfig.*to switch data to type 'chars', "
                                          r"give the whole section, e.g. data=\{type: chars\}"):
        load_experiment(QUICKSTART, ["data.type=chars"])
    _, cfg = load_experiment(QUICKSTART, ["data={type: chars}"])
    assert type(cfg.data).__name__ == "CharsDataConfig"


@pytest.mark.parametrize("kind", ["device", "pipe"])
def test_a_config_that_is_a_device_or_a_pipe_is_not_a_regular_file(tmp_path, kind):
    """/dev/zero or a named pipe would be read forever: refused as not a regular file (not as
    missing), before anything is read or written."""
    if kind == "device":
        path = Path("/dev/zero")
    else:
        path = tmp_path / "c.yaml"
        os.mkfifo(path)
    with pytest.raises(ConfigError, match=rf"^{path}: not a regular file \(a device, pipe or "
                                          r"socket\); give the path of a YAML experiment file$"):
        run_experiment(path, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_merge_key_may_be_overridden_but_an_override_may_not_repeat_a_key(tmp_path):
    """YAML's merge key ``<<`` is meant to be overridden: that is not a repeated key."""
    from jaxstream.experiment.config_yaml import apply_overrides, read_yaml

    path = tmp_path / "c.yaml"
    path.write_text("base: &b {lr: 0.1, name: adam}\noptimizer:\n  <<: *b\n  lr: 0.3\n")
    assert read_yaml(path)["optimizer"] == {"lr": 0.3, "name": "adam"}
    with pytest.raises(ConfigError, match="override arms: key 'name' is given twice"):
        apply_overrides({}, ["arms=[{name: a, name: b}]"])
