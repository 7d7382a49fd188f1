"""Plugins: a user's module adds a dataset that ``jaxstream run`` loads (``--plugin MODULE``,
or an installed package's ``jaxstream.plugins`` entry point), without editing the library."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from jaxstream.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
TINY = ["steps=4", "eval_every=2", "diag_every=0", "checkpoint_every=0", "model.width=8",
        "model.depth=1", "batch_size=16", "plots=false",
        "arms=[{name: backprop, estimator: {type: backprop}, lr: 0.01}]"]

PLUGIN = textwrap.dedent('''
    import dataclasses
    import numpy as np
    from jaxstream.experiment.plugins import DataConfig, Dataset, register_dataset

    LOADED = []

    @register_dataset("{name}")
    @dataclasses.dataclass(frozen=True)
    class Blobs(DataConfig):
        n: int = 64

        def load(self, seed: int) -> Dataset:
            LOADED.append(seed)
            rng = np.random.default_rng(seed)
            y = rng.integers(0, 3, self.n).astype(np.int32)
            x = (rng.normal(size=(self.n, 5)) + 2.0 * y[:, None]).astype(np.float32)
            h = self.n // 2
            return Dataset({{"x": x[:h], "y": y[:h]}}, {{"x": x[h:], "y": y[h:]}},
                           {{"in_dim": 5, "num_classes": 3}})
''')


def test_plugin_module_adds_a_dataset(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_blobs.py").write_text(PLUGIN.format(name="blobs"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    # Before the plugin is named, the type is unknown and the error lists the known ones.
    assert main(["run", str(QUICKSTART), "data={type: blobs}", *TINY]) == 2
    assert "data.type: 'blobs' is not registered" in capsys.readouterr().err
    # Flags before, between and after the overrides.
    assert main(["run", "--plugin", "my_blobs", str(QUICKSTART), "data={type: blobs, n: 80}",
                 *TINY, "--out", "run"]) == 0
    import my_blobs

    assert my_blobs.LOADED == [0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["arms"]["backprop"]["steps"] == 4
    assert "type: blobs" in (tmp_path / "run" / "config.yaml").read_text()


def test_entry_point_plugin(tmp_path, monkeypatch):
    from jaxstream.experiment import registry
    from jaxstream.experiment.config import choices
    from jaxstream.experiment.plugins import DataConfig

    (tmp_path / "ep_blobs.py").write_text(PLUGIN.format(name="ep_blobs"))
    dist = tmp_path / "ep_blobs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-blobs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[jaxstream.plugins]\nblobs = ep_blobs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "ep_blobs" not in choices(DataConfig)
    registry._load_entry_points()
    assert "ep_blobs" in choices(DataConfig)


CNN_PLUGIN = textwrap.dedent('''
    import dataclasses
    from flax import nnx
    from jaxstream.experiment.plugins import ModelConfig, register_model
    from jaxstream.models import from_sequential

    @register_model("tutorial_cnn")
    @dataclasses.dataclass(frozen=True)
    class TutorialCNN(ModelConfig):
        channels: int = 4

        def build(self, info):
            rngs, c = nnx.Rngs(0), self.channels
            pool = lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2))
            return from_sequential(nnx.Sequential(
                lambda x: x.reshape(x.shape[0], 8, 8, 1),
                nnx.Conv(1, c, (3, 3), rngs=rngs), nnx.relu, pool,
                nnx.Conv(c, 2 * c, (3, 3), rngs=rngs), nnx.relu, pool,
                lambda x: x.reshape(x.shape[0], -1),
                nnx.Linear(8 * c, 16, rngs=rngs), nnx.relu,
                nnx.Linear(16, info["num_classes"], rngs=rngs)), name="tutorial_cnn")
''')


@pytest.mark.standard_promotion  # the user's flax CNN: nnx.avg_pool divides by an int
def test_a_users_sequential_cnn_trains_on_the_stream_engine(tmp_path, monkeypatch):
    """A plugin's nnx.Sequential CNN (no repeated layers) on the stream engine: padded into a
    stack and streamed from a layer store, its backprop run equals the same config trained in
    memory on the model itself, step for step."""
    (tmp_path / "my_cnn.py").write_text(CNN_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    common = ["--plugin", "my_cnn", str(QUICKSTART), "model={type: tutorial_cnn}", "steps=3",
              "eval_every=3", "diag_every=0", "checkpoint_every=0", "batch_size=16",
              "plots=false", "arms=[{name: backprop, estimator: {type: backprop}, lr: 0.01}]"]
    assert main(["run", *common, "--out", "mem"]) == 0
    assert main(["run", *common, "engine={type: stream, prefetch: 1}", "--out", "stream"]) == 0

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "test_loss" in r]

    mem, streamed = records("mem"), records("stream")
    assert [r["step"] for r in mem] == [r["step"] for r in streamed] and len(mem) >= 2
    for a, b in zip(mem, streamed):
        assert abs(a["test_loss"] - b["test_loss"]) <= 1e-5 * abs(a["test_loss"]), (a, b)
    assert mem[-1]["test_loss"] != mem[0]["test_loss"]  # it trained


@pytest.mark.standard_promotion  # the user's flax CNN: nnx.avg_pool divides by an int
def test_an_arm_the_model_cannot_run_is_refused_before_any_arm_trains(tmp_path, monkeypatch,
                                                                        capsys):
    """Local losses need a stack; on the user's own sequential CNN the third arm is refused
    when the run starts (one line naming the arm, exit 2), before the first arm trains, and
    nothing is left written."""
    (tmp_path / "my_cnn.py").write_text(CNN_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    arms = ("arms=[{name: bp, estimator: {type: backprop}, lr: 0.01}, "
            "{name: fga, estimator: {type: forward, perturb: activations}, lr: 0.01}, "
            "{name: lgfga, estimator: {type: forward, perturb: activations, local_losses: true},"
            " lr: 0.01}]")
    assert main(["run", "--plugin", "my_cnn", str(QUICKSTART), "model={type: tutorial_cnn}",
                 "steps=3", "batch_size=16", "plots=false", arms, "--out", "run"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and err[0].startswith("error: arms.2.estimator (lgfga): "), err
    assert "as_stack(model)" in err[0] and not (tmp_path / "run").exists()


def _broken_entry_point(tmp_path, monkeypatch):
    """An installed package whose jaxstream.plugins entry point fails to import."""
    (tmp_path / "broken_plugin.py").write_text("import numpy\nimport no_such_dependency_xyz\n")
    dist = tmp_path / "broken_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[jaxstream.plugins]\nbroken = broken_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_an_entry_point_that_fails_to_import_is_named_with_the_fix(tmp_path, monkeypatch,
                                                                   capsys):
    from jaxstream.experiment import registry

    _broken_entry_point(tmp_path, monkeypatch)
    with pytest.raises(registry.ConfigError) as err:
        registry._load_entry_points()
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("plugin entry point broken = broken_plugin (group jaxstream.plugins, "
                           "package broken-pkg) failed to load: ModuleNotFoundError: No module "
                           "named 'no_such_dependency_xyz'"), line
    assert "pip uninstall broken-pkg" in line and "JAXSTREAM_SKIP_PLUGINS=broken" in line
    # jaxstream run: one line, exit 2 (entry points load once per process: reset for the test)
    monkeypatch.setattr(registry, "_LOADED", False)
    assert main(["run", str(QUICKSTART), "--print-config"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines == [f"error: {line}"]
    # skipped by name, the run goes on
    monkeypatch.setenv("JAXSTREAM_SKIP_PLUGINS", "other, broken")
    assert main(["run", str(QUICKSTART), "--print-config"]) == 0
    assert "kind: train" in capsys.readouterr().out


NOISE_PLUGIN = textwrap.dedent('''
    import dataclasses
    import jax
    from flax import nnx
    from jaxstream.experiment.plugins import ModelConfig, register_model
    from jaxstream.models import from_sequential

    class GaussianNoise(nnx.Module):
        def __init__(self, scale, rngs):
            self.scale, self.rngs = scale, rngs

        def __call__(self, x):
            return x + self.scale * jax.random.normal(self.rngs.noise(), x.shape)

    @register_model("noisy_mlp")
    @dataclasses.dataclass(frozen=True)
    class NoisyMLP(ModelConfig):
        width: int = 8
        depth: int = 1

        def build(self, info):
            r, w = nnx.Rngs(0), self.width
            return from_sequential(nnx.Sequential(
                nnx.Linear(info["in_dim"], w, rngs=r), GaussianNoise(0.1, nnx.Rngs(noise=1)),
                nnx.relu, nnx.Linear(w, info["num_classes"], rngs=r)))
''')


@pytest.mark.parametrize("engine", ["local", "stream"])
def test_a_plugin_models_own_random_layer_is_refused_by_the_runner_in_one_line(
        tmp_path, monkeypatch, capsys, engine):
    """The runner's engines bind no step key to a model: a layer drawing from its own nnx.Rngs
    is refused by name when the model is built (one line, exit 2), and nothing is written."""
    (tmp_path / "my_noise.py").write_text(NOISE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--plugin", "my_noise", str(QUICKSTART), "model={type: noisy_mlp}",
                 f"engine={{type: {engine}}}", *TINY, "--out", "run"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and err[0].startswith(
        "error: model: layer 1: GaussianNoise draws from its own RNG stream 'rngs/noise', but no "
        "step key is bound"), err
    assert not (tmp_path / "run").exists()


DROPOUT_PLUGIN = textwrap.dedent('''
    import dataclasses
    from flax import nnx
    from jaxstream.experiment.plugins import ModelConfig, register_model
    from jaxstream.models import from_sequential

    @register_model("dropout_mlp")
    @dataclasses.dataclass(frozen=True)
    class DropoutMLP(ModelConfig):
        width: int = 8
        depth: int = 1

        def build(self, info):
            r = nnx.Rngs(0)
            return from_sequential(nnx.Sequential(
                nnx.Linear(info["in_dim"], 8, rngs=r), nnx.relu, nnx.Dropout(0.5, rngs=r),
                nnx.Linear(8, info["num_classes"], rngs=r)))
''')


def test_a_plugin_models_dropout_is_refused_by_the_runner_not_switched_off(
        tmp_path, monkeypatch, capsys):
    """The runner binds no step key, so a Dropout would train switched off: refused by name."""
    (tmp_path / "my_dropout.py").write_text(DROPOUT_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--plugin", "my_dropout", str(QUICKSTART), "model={type: dropout_mlp}",
                 *TINY, "--out", "run"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and err[0].startswith(
        "error: model: layer 2 holds nnx.Dropout, which the runner's engines do not drive"), err
    assert not (tmp_path / "run").exists()


def test_a_plugin_that_fails_on_its_own_values_is_named_in_one_line(tmp_path, monkeypatch,
                                                                     capsys):
    """A plugin field without a declared range (``n: int``) given -5 fails inside the plugin's
    own code (NumPy: negative dimensions): the line names the section, the plugin's type and its
    values, exit 2, nothing written."""
    (tmp_path / "my_blobs2.py").write_text(PLUGIN.format(name="blobs2"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--plugin", "my_blobs2", str(QUICKSTART), "data={type: blobs2, n: -5}",
                 *TINY, "--out", "run"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and err[0].startswith(
        "error: data: the plugin's data type 'blobs2' failed on its values (n=-5): ValueError: "
        "negative dimensions"), err
    assert not (tmp_path / "run").exists()
