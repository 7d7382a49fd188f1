"""Refusals an outside user found missing: each is one line, exit 2, before any compute and
before the run directory is written."""

from __future__ import annotations

from pathlib import Path

import optax
import pytest

from jaxstream.cli import main
from jaxstream.experiment import progress, quality_study
from jaxstream.experiment.config_yaml import ConfigError
from jaxstream.experiment.optimizers import optimizer_factory, register_optimizer
from jaxstream.experiment.registry import load_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
PIPELINE = ROOT / "experiments" / "pipeline_mlp.yaml"


def _refused(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; it must exit 2 with one ``error:`` line, which is returned."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")
    return err[-1]


def test_builtin_optimizer_cannot_be_replaced():
    with pytest.raises(ConfigError, match="optimizer 'adam' is already registered"):
        register_optimizer("adam", optax.sgd)
    assert optimizer_factory("adam") is optax.adam
    register_optimizer("adam", optax.adam)  # the same factory again (a re-import) is fine


def test_plugin_replacing_an_optimizer_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "defects_dup_opt.py").write_text(
        "import optax\nfrom jaxstream.experiment.plugins import register_optimizer\n"
        "register_optimizer('adam', optax.sgd)\n")
    line = _refused(capsys, ["run", str(QUICKSTART), "steps=1", "--plugin", "defects_dup_opt",
                             "--out", "o"])
    assert "optimizer 'adam' is already registered" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("defects_raises", "raise RuntimeError('boom in plugin')\n",
     "--plugin defects_raises: failed to import: RuntimeError: boom in plugin"),
    ("defects_syntax", "def f(:\n",
     "--plugin defects_syntax: failed to import: SyntaxError:"),
    ("defects_dep", "import defects_no_such_dependency\n",
     "--plugin defects_dep: failed to import: ModuleNotFoundError:"),
])
def test_broken_plugin_is_one_line(tmp_path, capsys, monkeypatch, module, source, expected):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / f"{module}.py").write_text(source)
    line = _refused(capsys, ["run", str(QUICKSTART), "--plugin", module, "--out", "o"])
    assert expected in line
    assert not (tmp_path / "o").exists()


def test_plugin_path_is_not_a_module_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, ["run", str(QUICKSTART), "--plugin", "../x", "--out", "o"])
    assert "--plugin ../x: not a module name" in line
    assert not (tmp_path / "o").exists()


def test_pipeline_stages_beyond_devices_refused_up_front(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tests have 8 devices; 16 stages need 16
    line = _refused(capsys, ["run", str(PIPELINE), "steps=1", "model.depth=16",
                             "engine.stages=16", "--out", "o"])
    assert "engine.stages: 16 requested" in line and "devices exist" in line
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in line
    assert not (tmp_path / "o").exists()


def test_pipeline_stages_within_devices_pass():
    _, cfg = load_experiment(PIPELINE, ["engine.stages=8"])
    cfg.engine.check_run(["a"], resume=False)


@pytest.mark.parametrize("field", ["arms.0.lr", "data.test_fraction", "target_accuracy"])
def test_a_float_infinite_in_float32_is_refused(tmp_path, capsys, monkeypatch, field):
    """Every float field: finite in float64 (the YAML's) but inf in the float32 step."""
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, ["run", str(QUICKSTART), "steps=1", f"{field}=1e308",
                             "--out", "o"])
    assert f"{field}: 1e+308 is inf in float32" in line
    line = _refused(capsys, ["run", str(QUICKSTART), "steps=1", f"{field}=1e-50",
                             "--out", "o"])  # 0 in float32: a learning rate training nothing
    assert f"{field}: 1e-50 underflows float32" in line
    assert not (tmp_path / "o").exists()
    _, cfg = load_experiment(QUICKSTART, ["arms.0.lr=3e38"])  # finite in float32: accepted
    assert cfg.arms[0].lr == 3e38


@pytest.mark.parametrize("text", ["", "# only a comment\n", "null\n"])
def test_empty_config_file_refused(tmp_path, capsys, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text(text)
    line = _refused(capsys, ["run", "empty.yaml", "--out", "o"])
    assert "empty.yaml is empty" in line
    assert not (tmp_path / "o").exists()


def test_grad_quality_bar_follows_the_terminal_rule(capsys):
    assert quality_study.work_bar is progress.work_bar
    bar = progress.work_bar([1, 2], "grad_quality")  # stderr is captured: not a terminal
    assert bar.disable and list(bar) == [1, 2]
    bar.close()
    assert "grad_quality" not in capsys.readouterr().err


@pytest.mark.parametrize("value, says", [
    ("1.0e308", "optimizer.options.b1: 1e+308 is inf in float32"),
    (".inf", "optimizer.options.b1: expected a finite number, got inf"),
    ("nan", "optimizer.options.b1: expected a finite number, got 'nan'"),
    ("abc", "optimizer.options.b1: expected a number (the default is 0.9), got 'abc'"),
])
def test_an_optimizer_options_number_gets_the_float_rule(tmp_path, capsys, monkeypatch, value,
                                                        says):
    """An option's number is read as every float field is (YAML 1.1 leaves ``1.0e308`` a
    string): out of float32's range or not finite is said as such, not as a wrong type."""
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, ["run", str(QUICKSTART), "steps=1",
                             f"optimizer.options={{b1: {value}}}", "--out", "o"])
    assert says in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("override", "expected"), [
    ("theory_seeds=1", "theory_seeds: 0 (skip the check) or at least 2"),
    ("corrections=[]", "corrections: list one or more of 'control_variate', 'replace'"),
    ("corrections=[replace, replace]", "corrections: 'replace' is listed twice"),
])
def test_grad_quality_fields_that_failed_after_the_study_are_refused_first(
        tmp_path, capsys, override, expected):
    """Accepted before, these ran the whole study, then failed in its report and the run
    directory was removed: now one line, exit 2, before anything is computed or written."""
    line = _refused(capsys, ["run", str(ROOT / "experiments" / "grad_quality_mlp.yaml"), override,
                             "--out", str(tmp_path / "o")])
    assert expected in line, line
    assert not (tmp_path / "o").exists()
