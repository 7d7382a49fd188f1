"""Command-line manners: flags and overrides in any order; user errors exit 2 with one line
and touch nothing; compare prints the arms of runs and writes a plot; doc tables are written
from run directories; TensorBoard events hold the logged scalars."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import pytest

from jaxstream.cli import build_parser, main, parse

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def test_overrides_and_flags_in_any_order():
    parser = build_parser()
    a = parse(parser, ["run", "cfg.yaml", "--out", "d", "model.width=64", "--resume", "steps=3",
                       "--plugin", "p1", "--plugin", "p2"])
    b = parse(parser, ["run", "--out", "d", "cfg.yaml", "model.width=64", "steps=3", "--resume",
                       "--plugin", "p1", "--plugin", "p2"])
    for args in (a, b):
        assert (args.config, args.overrides, args.out, args.resume, args.plugin) == (
            "cfg.yaml", ["model.width=64", "steps=3"], "d", True, ["p1", "p2"])


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: ")
    return err[-1]


def test_user_errors_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.yaml").write_text("kind: train\nsteps: 3\narms: [1, 2\n")
    (tmp_path / "unsafe.yaml").write_text("kind: train\nseed: !!python/object/apply:os.system "
                                          "['echo hi']\n")
    (tmp_path / "afile").write_text("")
    assert "missing CONFIG" in _error(capsys, ["run"])
    assert "usage: jaxstream run CONFIG" in _error(capsys, ["run", "steps=3"])
    assert _error(capsys, ["run", "nosuch.yaml"]) == "error: config file nosuch.yaml does not exist"
    line = _error(capsys, ["run", "broken.yaml"])
    assert line.startswith("error: broken.yaml:4: YAML syntax error")
    line = _error(capsys, ["run", "unsafe.yaml"])
    assert "unsafe.yaml:2: !!python/object/apply:os.system" in line and "not allowed" in line
    (tmp_path / "twice.yaml").write_text("kind: train\nsteps: 3\nsteps: 30\n")
    assert _error(capsys, ["run", "twice.yaml"]) == (
        "error: twice.yaml:3: YAML syntax error: key 'steps' is given twice in one mapping "
        "(first on line 2); give it once")
    line = _error(capsys, ["run", str(QUICKSTART), "--out", "afile"])
    assert "--out afile is a file" in line
    assert "model.widht: unknown key" in _error(capsys, ["run", str(QUICKSTART), "model.widht=8"])
    assert "--plugin nosuch_plugin_mod: no module" in _error(
        capsys, ["run", str(QUICKSTART), "--plugin", "nosuch_plugin_mod"])
    assert "choose a command" in _error(capsys, [])
    assert "--read-bandwidth must be > 0" in _error(capsys, ["plan", "--read-bandwidth", "0"])
    assert "--probe-dir /nonexistent" in _error(capsys, ["plan", "--probe-dir", "/nonexistent"])
    # Absurd sizes: one line before anything compiles (a billion-wide layer aborted inside XLA),
    # and a layer the device cannot hold says so without blaming a prefetch of 0.
    assert "one layer would hold" in _error(capsys, ["plan", "--width", "1000000000"])
    line = _error(capsys, ["plan", "--width", "100000", "--prefetch", "0", "--device-flops",
                           "1e12", "--read-bandwidth", "1e9"])
    assert "cannot hold prefetch+1=1 layers" in line and "lower prefetch" not in line
    assert "not a run directory" in _error(capsys, ["compare", str(tmp_path)])
    real = importlib.util.find_spec  # an optional dependency missing is named before the run
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    assert "--tensorboard needs the tensorboardX package" in _error(
        capsys, ["run", str(QUICKSTART), "--tensorboard", "--out", "tb"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "broken.yaml", "twice.yaml",
                                                          "unsafe.yaml"]


def test_a_config_that_is_a_device_or_a_pipe_is_named_as_such(tmp_path, capsys):
    """/dev/zero and a named pipe exist: one line saying they are not regular files, exit 2."""
    os.mkfifo(tmp_path / "pipe.yaml")
    for path in ("/dev/zero", str(tmp_path / "pipe.yaml")):
        assert _error(capsys, ["run", path, "--out", str(tmp_path / "run")]) == (
            f"error: config file {path} is not a regular file (a device, pipe or socket): give a "
            "YAML file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.yaml"]


def fake_run(d: Path, arm_acc: dict[str, list[float]], config: str = "experiments/x.yaml") -> Path:
    """A run directory as a train run writes it (summary, env, metrics), without training."""
    d.mkdir(parents=True)
    records, arms = [], {}
    for arm, accs in arm_acc.items():
        t = 0.0
        for s, acc in enumerate(accs):
            t += 0.01
            records.append({"arm": arm, "step": s, "loss": 1.0 - acc, "test_accuracy": acc,
                            "train_time": t, "step_time": 0.01})
        hit = next((s for s, a in enumerate(accs) if a >= 0.95), None)
        arms[arm] = {"estimator": arm, "lr": 0.01, "final_loss": 1.0 - accs[-1],
                     "final_test_accuracy": accs[-1], "steps_to_target": hit,
                     "seconds_to_target": None if hit is None else 0.01 * (hit + 1),
                     "ms_per_step": 10.0, "mean_cosine": None}
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "summary.json").write_text(json.dumps({"target_accuracy": 0.95, "arms": arms}))
    (d / "env.json").write_text(json.dumps({"platform": "TestOS", "backend": "cpu",
                                            "device_count": 1, "device": "cpu",
                                            "versions": {"jax": "0.0"}, "config": config,
                                            "overrides": ["steps=12"]}))
    return d


def test_compare_and_doc_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accs = [0.1 * i for i in range(10)] + [0.96, 0.97]
    fake_run(tmp_path / "runs" / "a", {"bp": accs, "fwd": accs[::-1]})
    fake_run(tmp_path / "runs" / "b", {"bp": accs})
    assert main(["compare", "runs/a", "runs/b", "--plot", "cmp.png"]) == 0
    out = capsys.readouterr().out
    assert "a/bp" in out and "a/fwd" in out and "b/bp" in out and (tmp_path / "cmp.png").is_file()
    row = next(line for line in out.splitlines() if line.startswith("a/bp"))
    assert " 10 " in row and "0.970" in row  # steps to 95 % and final accuracy from summary.json

    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- generated: compare runs/a -->\nstale 0.123\n<!-- end generated "
                   "-->\nend\n")
    from jaxstream.experiment.doctable import update_doc

    assert update_doc(doc) == 1
    text = doc.read_text()
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("end\n")
    assert "| bp | bp | 0.01 | 0.030 | 0.970 | 10 |" in text
    assert "python -m jaxstream.experiment.doctable compare runs/a" in text
    assert "TestOS" in text and "experiments/x.yaml steps=12" in text


def _tfrecords(path: Path) -> list[bytes]:
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        out.append(data[i + 12:i + 12 + n])
        i += 12 + n + 4
    return out


def test_tensorboard_events_hold_the_metrics(tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto.event_pb2 import Event

    from jaxstream.experiment.tensorboard import write_events

    run = fake_run(tmp_path / "run", {"bp": [0.5, 0.75]})
    out = write_events(run)
    (events,) = list((out / "bp").glob("events.out.tfevents.*"))
    got = {}
    for rec in _tfrecords(events):
        ev = Event.FromString(rec)
        for v in ev.summary.value:
            got[(v.tag, ev.step)] = v.simple_value
    assert got[("test_accuracy", 1)] == pytest.approx(0.75)
    assert got[("loss", 0)] == pytest.approx(0.5)


def test_store_errors_are_one_line_user_errors():
    """A store a run is pointed at (locked by another writer, corrupt, missing) ends the run
    with one line and status 2, not a traceback."""
    from jaxstream.cli import user_error_line
    from jaxstream.stream.errors import StoreCorruptError, StoreLockedError

    assert user_error_line(StoreLockedError("held by pid 7")) == "StoreLockedError: held by pid 7"
    assert user_error_line(StoreCorruptError("w layer 2")).startswith("StoreCorruptError")
    assert user_error_line(RuntimeError("a bug")) is None


def _scalars(out: Path) -> dict:
    from tensorboardX.proto.event_pb2 import Event

    got = {}
    for events in sorted(out.rglob("events.out.tfevents.*")):
        for rec in _tfrecords(events):
            ev = Event.FromString(rec)
            for v in ev.summary.value:
                got[(events.parent.name, v.tag, ev.step)] = v.simple_value
    return got


def test_tensorboard_events_are_written_while_the_run_trains(tmp_path):
    """Records appear as events before the run ends (a crashed run keeps its curves); a log
    rewritten by --resume is followed from its start again; an unfinished line waits."""
    pytest.importorskip("tensorboardX")
    import time

    from jaxstream.experiment.rundir import MetricsLog
    from jaxstream.experiment.tensorboard import LiveEvents

    run = tmp_path / "run"
    run.mkdir()
    log = MetricsLog(run / "metrics.jsonl")
    live = LiveEvents(run, interval=0.05).start()
    for s in range(3):
        log.append({"arm": "fwd", "step": s, "loss": 1.0 / (s + 1)})
    deadline = time.monotonic() + 60
    while len(_scalars(live.out)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _scalars(live.out) == {("fwd", "loss", s): pytest.approx(1.0 / (s + 1))
                                  for s in range(3)}  # before close: written live
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"arm": "fwd", "step": 3, "lo')  # a record being written
    assert live.poll() == 0
    log.rewrite([{"arm": "fwd", "step": 0, "loss": 1.0}, {"arm": "fwd", "step": 1, "loss": 0.25}])
    assert live.poll() == 2
    out = live.close()
    assert _scalars(out)[("fwd", "loss", 1)] == pytest.approx(0.25)  # the rewritten value


def test_run_with_tensorboard_prints_where_and_writes_events(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboardX")
    monkeypatch.chdir(tmp_path)
    args = ["run", str(QUICKSTART), "steps=2", "eval_every=1", "diag_every=0", "model.width=8",
            "model.depth=1", "batch_size=16", "plots=false", "progress=false",
            "arms=[{name: bp, estimator: {type: backprop}, lr: 0.01}]", "--out", "r",
            "--tensorboard"]
    assert main(args) == 0
    assert "tensorboard: tensorboard --logdir" in capsys.readouterr().out
    got = _scalars(tmp_path / "r" / "tensorboard")
    assert {("bp", "test_accuracy", s) for s in range(3)} <= set(got)


def test_profile_writes_a_trace_of_the_run(tmp_path, capsys):
    """``--profile DIR``: a jax.profiler trace of the run (the streamed step's annotations in it)."""
    trace = tmp_path / "trace"
    assert main(["run", str(QUICKSTART), "steps=2", "eval_every=1", "diag_every=0",
                 "checkpoint_every=0", "model.width=8", "arms=[{name: bp, estimator: {type: backprop}}]",
                 "--out", str(tmp_path / "run"), "--profile", str(trace)]) == 0
    assert list(trace.rglob("*.xplane.pb")), "no trace written"
    assert f"profile: {trace}" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    assert main(["run", str(QUICKSTART), "--profile", str(tmp_path / "file")]) == 2
    assert "--profile" in capsys.readouterr().err
