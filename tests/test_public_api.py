"""``import jaxstream as js`` gives the subpackages (loaded on first use) and ``js.train_step``."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstream as js
from jaxstream._moved import _ALIASES

SUBPACKAGES = ("grad", "models", "quality", "pipeline", "stream", "comm", "optim", "placement",
               "data", "experiment", "compose")


def test_import_is_lazy_and_every_subpackage_is_an_attribute():
    code = ("import sys, jaxstream as js; assert 'jax' not in sys.modules, 'jax imported'; "
            f"[getattr(js, n) for n in {SUBPACKAGES!r}]; "
            "assert callable(js.grad.forward) and callable(js.train_step); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert set(SUBPACKAGES) <= set(dir(js))
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        js.nosuch  # noqa: B018


def test_train_step_matches_a_hand_written_update():
    stack = js.models.mlp(6, 8, 1, 3)
    params = stack.init(jax.random.key(0))
    batch = {"x": jax.random.normal(jax.random.key(1), (5, 6)), "y": jnp.arange(5) % 3}
    step = js.train_step(js.grad.backprop(), optax.sgd(0.1), stack)
    opt_state = step.init(params)
    new, opt_state, loss = step(params, opt_state, batch, jax.random.key(2))
    ref_loss, g = jax.value_and_grad(stack)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, p, gg: np.testing.assert_allclose(a, p - 0.1 * gg, rtol=1e-5,
                                                              atol=1e-7), new, params, g)
    with pytest.raises(TypeError, match="optimizer: expected an optax"):
        js.train_step(js.grad.backprop(), 0.1, stack)


def test_the_namespace_shows_only_public_names():
    assert dir(js) == sorted(js.__all__)
    assert not {"Any", "TYPE_CHECKING", "importlib", "annotations"} & set(dir(js))


def test_every_store_error_is_exported():
    import inspect

    from jaxstream.stream import errors

    classes = {n for n, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.StoreError)}
    assert len(classes) >= 9 and classes <= set(js.stream.__all__)
    assert all(getattr(js.stream, n) is getattr(errors, n) for n in classes)


def test_version_and_print_config(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    import yaml

    from jaxstream.cli import main
    from jaxstream.experiment.config import dump_yaml
    from jaxstream.experiment.registry import load_experiment

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"jaxstream {js.__version__}"
    monkeypatch.chdir(tmp_path)
    cfg = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml"
    assert main(["run", str(cfg), "steps=7", "--print-config"]) == 0
    text = capsys.readouterr().out
    data = yaml.safe_load(text)
    assert data["kind"] == "train" and data["steps"] == 7 and "optimizer" in data
    kind, loaded = load_experiment(cfg, ["steps=7"])
    assert text == dump_yaml(loaded, {"kind": kind})  # what the run would write as config.yaml
    assert list(tmp_path.iterdir()) == []  # nothing run, nothing written


@pytest.mark.parametrize("old", sorted(_ALIASES))
def test_a_moved_module_still_imports_from_its_old_path_with_a_warning(old):
    """The last release's import paths (a plugin's ``from jaxstream.plugins import ...``) give
    the module that now holds the code, and say where it went, at the user's import line."""
    new = importlib.import_module(_ALIASES[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"moved to {_ALIASES[old]}")) as caught:
        module = importlib.import_module(old)
    assert module is new
    assert caught[0].filename == __file__
