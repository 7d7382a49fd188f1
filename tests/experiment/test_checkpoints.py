"""Checkpoints are restored as saved or refused with one line: one flipped bit anywhere in a
checkpoint's files (array data, orbax metadata, our JSON metadata) never comes back as other
numbers; the refusal names the checkpoint and the earlier one to resume from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.cli import main as cli_main
from jaxstream.experiment.checkpoints import ArmCheckpointer, CheckpointError, checksums
from jaxstream.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _state(seed: int) -> dict:
    k = jax.random.key(seed)
    return {"params": {"w": jax.random.normal(k, (16, 24)), "b": jnp.linspace(-1.0, 1.0, 24)},
            "opt": {"mu": jax.random.uniform(jax.random.fold_in(k, 1), (16, 24)),
                    "count": jnp.int32(7)},
            "key": jax.random.fold_in(k, 2)}


def _equal(a, b) -> bool:
    return checksums(a) == checksums(b)


def _flip(path: Path, offset: int, bit: int) -> bytes:
    data = path.read_bytes()
    damaged = bytearray(data)
    damaged[offset] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    return data


def test_every_flipped_bit_is_refused_or_harmless(tmp_path):
    """A bit flipped at spread offsets of every file of the latest checkpoint; each restore
    (by a fresh checkpointer, as a resumed run opens it) must raise CheckpointError with one
    line, or return exactly the saved state (a flip in bytes nothing reads)."""
    saved = _state(0)
    ckpt = ArmCheckpointer(tmp_path / "ck")
    ckpt.save(2, _state(1))
    ckpt.save(4, saved)
    ckpt.close()
    files = sorted(p for p in (tmp_path / "ck" / "4").rglob("*") if p.is_file())
    refused, harmless, wrong = 0, 0, []
    for f in files:
        size = f.stat().st_size
        for i, offset in enumerate(sorted({0, size // 3, size // 2, (2 * size) // 3, size - 1})):
            original = _flip(f, offset, i % 8)
            try:
                reader = ArmCheckpointer(tmp_path / "ck")
                try:
                    step, state, _ = reader.restore_latest(saved)
                finally:
                    reader.close()
            except CheckpointError as e:
                msg = str(e)
                assert "\n" not in msg and "checkpoint" in msg, msg
                assert "resume from step 2" in msg, msg
                refused += 1
            else:
                if step == 4 and _equal(state, saved):
                    harmless += 1
                else:
                    wrong.append((f.relative_to(tmp_path), offset))
            finally:
                f.write_bytes(original)
    assert wrong == [], f"restored as other numbers: {wrong}"
    assert refused >= len(files)  # most flips land in bytes that are read
    # The undamaged checkpoint still restores exactly.
    reader = ArmCheckpointer(tmp_path / "ck")
    assert _equal(reader.restore_latest(saved)[1], saved)
    reader.close()


def test_the_array_data_itself_is_checked(tmp_path):
    """Rewrite one saved value with a valid file (same encoding, other number): only the
    checksum can tell, and it does."""
    saved = _state(0)
    ckpt = ArmCheckpointer(tmp_path / "ck")
    ckpt.save(3, saved)
    meta_file = tmp_path / "ck" / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["checksums"]["['params']['b']"] = checksums({"x": jnp.zeros(24)})["['x']"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"array \['params'\]\['b'\] differs from the "
                                              r"checksum .* start the run again"):
        ArmCheckpointer(tmp_path / "ck").restore_latest(saved)


def test_a_damaged_checkpoint_stops_resume_with_one_line(tmp_path, capsys, monkeypatch):
    """End to end: a run's last checkpoint damaged, then ``jaxstream run --resume``: exit 2,
    one line naming the checkpoint; removing it as the line says resumes from the earlier one."""
    monkeypatch.chdir(tmp_path)
    cfg = ["steps=6", "eval_every=2", "diag_every=0", "checkpoint_every=2", "model.width=8",
           "model.depth=1", "batch_size=16", "plots=false",
           "arms=[{name: backprop, estimator: {type: backprop}, lr: 0.01}]"]
    out = tmp_path / "run"
    run_experiment(QUICKSTART, [*cfg, "max_steps=4"], out=out)
    last = out / "checkpoints" / "backprop" / "4"
    for data in (last / "state").rglob("d/*"):  # every data file: some array is surely read
        raw = bytearray(data.read_bytes())
        for offset in range(len(raw) // 3, 2 * len(raw) // 3):
            raw[offset] ^= 1 << (offset % 8)
        data.write_bytes(bytes(raw))
    before = {n: (out / n).read_bytes() for n in ("config.yaml", "env.json")}
    assert cli_main(["run", str(QUICKSTART), *cfg, "--out", str(out), "--resume"]) == 2
    # The refused resume (its config differs in max_steps) left the run directory as it was.
    assert {n: (out / n).read_bytes() for n in ("config.yaml", "env.json")} == before
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, errors
    err = errors[0]
    assert err.startswith("error: CheckpointError: checkpoint "), err
    assert str(last) in err and "resume from step 2" in err
    shutil.rmtree(last)
    assert cli_main(["run", str(QUICKSTART), *cfg, "--out", str(out), "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"]


def test_checksums_name_every_array_and_see_one_ulp():
    s = _state(0)
    c = checksums(s)
    assert set(c) == {"['key']", "['opt']['count']", "['opt']['mu']", "['params']['b']",
                      "['params']['w']"}
    w = np.asarray(s["params"]["w"]).copy()
    w[3, 5] = np.nextafter(w[3, 5], np.float32(np.inf))
    assert checksums({**s, "params": {**s["params"], "w": jnp.asarray(w)}}) != c
