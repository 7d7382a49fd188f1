"""Attacks on a run's files, counted: each case is refused with one line, restored exactly, or
silently wrong (the goal: none). Prints a table and writes JSON.

    python benchmarks/attacks.py --json attacks.json

- ``checkpoint bit flips``: one bit flipped at five offsets of every file of an orbax
  checkpoint, then restored by a fresh checkpointer (as ``--resume`` does).
- ``hostile configs``: alias bombs, deep nesting, a huge file, bombs in overrides, a key given
  twice (in a file, in an override), seeds out of range for each kind, run through ``jaxstream run`` (exit 2, one line, nothing written).
- ``foreign stores``: a ``--resume`` onto a store another run trained on since, and onto a store
  copied in from another run.
- ``run directory``: a second ``--resume`` while the run holds its lock; a refused ``--resume``
  (its config.yaml must stay byte for byte).
- ``store chunk files``: every committed chunk of a trained layer store (parameters and
  optimizer state) replaced by a sound chunk of other content: its own older slot (a rollback),
  another layer's committed chunk (a swap), the same chunk of another store (a copy); then the
  whole store read by a fresh handle.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.cli import main as cli
from jaxstream.experiment.checkpoints import ArmCheckpointer, CheckpointError
from jaxstream.experiment.rundir import run_lock
from jaxstream.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
COLS = ("attack", "cases", "refused_one_line", "restored_exactly", "silently_wrong",
        "raw_error", "data_lost")


def _row(attack: str, outcomes: list[str]) -> dict:
    keys = {"refused": "refused_one_line", "exact": "restored_exactly", "wrong": "silently_wrong",
            "raw": "raw_error", "lost": "data_lost"}
    row = {"attack": attack, "cases": len(outcomes)}
    row.update({v: outcomes.count(k) for k, v in keys.items()})
    return row


def checkpoint_flips(tmp: Path) -> list[str]:
    k = jax.random.key(0)
    state = {"w": jax.random.normal(k, (32, 48)), "b": jnp.linspace(-1.0, 1.0, 48),
             "count": jnp.int32(7), "key": jax.random.fold_in(k, 1)}
    ckpt = ArmCheckpointer(tmp / "ck")
    ckpt.save(1, state)
    ckpt.save(2, state)
    ckpt.close()
    same = lambda a: all(np.array_equal(np.asarray(jax.random.key_data(x) if
                                                   jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                                                   else x), np.asarray(
        jax.random.key_data(y) if jnp.issubdtype(y.dtype, jax.dtypes.prng_key) else y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(state)))
    out = []
    for f in sorted(p for p in (tmp / "ck" / "2").rglob("*") if p.is_file()):
        data = f.read_bytes()
        for i, off in enumerate(sorted({0, len(data) // 3, len(data) // 2,
                                        2 * len(data) // 3, len(data) - 1})):
            bad = bytearray(data)
            bad[off] ^= 1 << (i % 8)
            f.write_bytes(bytes(bad))
            try:
                reader = ArmCheckpointer(tmp / "ck")
                try:
                    _, got, _ = reader.restore_latest(state)
                finally:
                    reader.close()
                out.append("exact" if same(got) else "wrong")
            except CheckpointError as e:
                out.append("refused" if "\n" not in str(e) else "raw")
            except Exception:  # noqa: BLE001 - a traceback where one line is promised
                out.append("raw")
            f.write_bytes(data)
    return out


def _cli_refused(args: list[str], out: Path) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli(args)
        except Exception:  # noqa: BLE001
            return "raw"
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("error")]
    if code != 2 or len(lines) != 1:
        return "raw"
    return "lost" if out.exists() else "refused"


def hostile_configs(tmp: Path) -> list[str]:
    laughs = ["kind: train", "x0: &x0 [" + ", ".join(["lol"] * 9) + "]"]
    laughs += [f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]" for i in range(1, 9)]
    flow = ["&a0 [" + ", ".join(["1"] * 9) + "]"]
    flow += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 8)]
    files = {
        "alias bomb": ("\n".join(laughs) + "\n", []),
        "5000-deep": ("kind: train\nseed: " + "[" * 5000 + "]" * 5000 + "\n", []),
        "self alias": ("kind: train\na: &a [1, *a]\n", []),
        "2 MB": ("# pad\n" * 350_000, []),
        "override bomb": ("kind: train\n", ["seed=[" + ", ".join(flow) + "]"]),
        "override deep": ("kind: train\n", ["seed=" + "[" * 60 + "]" * 60]),
        "key given twice": ("kind: train\nsteps: 5\nsteps: 7\n", []),
        "override key twice": ("kind: train\n", ["optimizer={lr: 0.1, lr: 0.2}"]),
    }
    out = []
    for i, (text, over) in enumerate(files.values()):
        path = tmp / f"c{i}.yaml"
        path.write_text(text)
        out.append(_cli_refused(["run", str(path), *over, "--out", str(tmp / f"r{i}")],
                                tmp / f"r{i}"))
    for j, (cfg, field) in enumerate([("quickstart", "seed"), ("lr_sweep_digits", "seed"),
                                      ("forward_table_quick", "seed"),
                                      ("grad_quality_mlp", "seed"),
                                      ("quickstart", "data.split_seed")]):
        for value in (-1, 2**40):
            target = tmp / f"s{j}_{value}"
            out.append(_cli_refused(["run", str(EXP / f"{cfg}.yaml"), f"{field}={value}",
                                     "--out", str(target)], target))
    return out


TINY = ["steps=4", "eval_every=2", "diag_every=0", "checkpoint_every=1", "model.width=8",
        "model.depth=2", "batch_size=16", "plots=false", "progress=false",
        "arms=[{name: bp, estimator: {type: backprop}, lr: 0.003}]"]


def _refused_resume(run_dir: Path, over: list[str]) -> str:
    before = (run_dir / "config.yaml").read_bytes()
    try:
        run_experiment(EXP / "stream_mlp.yaml", over, out=run_dir, resume=True)
    except Exception as e:  # noqa: BLE001
        from jaxstream.cli import user_error_line

        line = user_error_line(e)
        if line is None or "\n" in line:
            return "raw"
        return "refused" if (run_dir / "config.yaml").read_bytes() == before else "lost"
    return "wrong"


def foreign_stores(tmp: Path) -> list[str]:
    store = tmp / "stores" / "{arm}"
    a, _ = run_experiment(EXP / "stream_mlp.yaml", [*TINY, f"engine.store={store}",
                                                    "max_steps=2"], out=tmp / "a")
    run_experiment(EXP / "stream_mlp.yaml", [*TINY, f"engine.store={store}", "arms.0.lr=0.1",
                                             "engine.continue_store=true"], out=tmp / "b")
    advanced = _refused_resume(a, [*TINY, f"engine.store={store}"])
    c, _ = run_experiment(EXP / "stream_mlp.yaml", [*TINY, "max_steps=2"], out=tmp / "c")
    shutil.rmtree(c / "stores" / "bp")
    shutil.copytree(tmp / "stores" / "bp", c / "stores" / "bp")  # another run's store copied in
    copied = _refused_resume(c, TINY)
    return [advanced, copied]


def run_directory(tmp: Path) -> list[str]:
    d, _ = run_experiment(EXP / "stream_mlp.yaml", [*TINY, "max_steps=1"], out=tmp / "d")
    with run_lock(d):
        locked = _refused_resume(d, TINY)
    differs = _refused_resume(d, [*TINY, "steps=9"])
    return [locked, differs]


def store_chunks(tmp: Path) -> list[str]:
    import optax

    from jaxstream.stream import LayerStore, StoreError

    r = np.random.default_rng(0)
    params = {"embed": {"w": r.standard_normal((5, 4), dtype=np.float32)},
              "blocks": {"w": r.standard_normal((3, 4, 4), dtype=np.float32),
                         "b": r.standard_normal((3, 4), dtype=np.float32)},
              "head": {"w": r.standard_normal((4, 2), dtype=np.float32)}}
    opt = optax.adam(1e-3)

    def train(path: Path, sign: float) -> None:
        LayerStore.create(str(path), params, optimizer=opt)
        for step in (1, 2):  # every layer written twice: both slots hold different values
            s = LayerStore.open(str(path), optimizer=opt)
            for l in range(3):
                moved = jax.tree.map(lambda x, l=l, step=step: x + sign * step * (l + 1) if x.dtype.kind == "f" else x,
                                     s.read_opt(l).result())
                s.write(l, jax.tree.map(lambda x, step=step: x + sign * step, s.read(l).result()), moved)
            s.commit(step)
            s.close()

    train(tmp / "a", 1.0)
    train(tmp / "b", -1.0)

    def everything(path: Path) -> list:
        s = LayerStore.open(str(path), optimizer=opt)
        return jax.tree.leaves([s.read_params()] + [s.read_opt(l).result() for l in range(3)])

    truth = everything(tmp / "a")
    m = json.loads((tmp / "a" / "manifest.json").read_text())
    out = []
    for kind in ("params", "opt"):
        for leaf in range(len(m["leaves"][kind]["blocks"])):
            if m["leaves"][kind]["blocks"][leaf]["shape"] == []:  # the step count: equal everywhere
                continue
            for l in range(3):
                slot = m["slots"]["blocks"][l]

                def chunk(root: Path, layer: int, sl: int, kind=kind, leaf=leaf) -> Path:
                    return root / kind / "blocks" / str(leaf) / "c" / str(layer) / str(sl) / "0"

                target = chunk(tmp / "a", l, slot)
                while not target.is_file():
                    target = target / "0"
                tail = target.relative_to(chunk(tmp / "a", l, slot))
                data = target.read_bytes()
                for source in (chunk(tmp / "a", l, 1 - slot) / tail,
                               chunk(tmp / "a", (l + 1) % 3, m["slots"]["blocks"][(l + 1) % 3]) / tail,
                               chunk(tmp / "b", l, slot) / tail):
                    target.write_bytes(source.read_bytes())
                    try:
                        got = everything(tmp / "a")
                        same = all(np.array_equal(x, y) for x, y in zip(got, truth))
                        out.append("exact" if same else "wrong")
                    except StoreError as e:
                        out.append("refused" if "\n" not in str(e) else "raw")
                    except Exception:  # noqa: BLE001
                        out.append("raw")
                    target.write_bytes(data)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name, fn in (("checkpoint bit flips", checkpoint_flips),
                         ("hostile configs", hostile_configs),
                         ("foreign stores", foreign_stores), ("run directory", run_directory),
                         ("store chunk files", store_chunks)):
            work = tmp / name.replace(" ", "_")
            work.mkdir()
            rows.append(_row(name, fn(work)))
            print(f"{name}: done", file=sys.stderr, flush=True)
    print("| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in COLS) + " |")
    if args.json:
        from jaxstream.experiment.docblock import machine

        args.json.write_text(json.dumps({"rows": rows, "machine": machine(),
                                         "command": "python benchmarks/attacks.py"}, indent=1))
    return rows


if __name__ == "__main__":
    main()
