"""The forward table's report knows no arm by name: which arm plays which part (the exact
reference, the published methods, the hybrids' ingredients, the designs) is the table's
``report:`` section, recorded beside the rows and read back from them."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.markdown import compact

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import forward_table as ft


def _shipped_arms() -> set[str]:
    """Every arm name of a shipped forward table, less the estimator types' names."""
    from jaxstream.experiment.config import choices
    from jaxstream.experiment.estimators import EstimatorConfig

    names = set()
    for path in (ROOT / "experiments").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        if data.get("kind") == "forward_table":
            names |= {a["name"] for a in data.get("arms", [])}
    return names - set(choices(EstimatorConfig))


def _keyed_strings(tree: ast.AST):
    """String constants code selects by: compared (``==``, ``in``), listed in a literal
    tuple / list / set (``__all__``'s exported names aside), used as a subscript, or a
    ``startswith`` / ``endswith`` / ``split`` piece."""
    exported = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)}
    for node in ast.walk(tree):
        if id(node) in exported:
            continue
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            parts = node.elts
        elif isinstance(node, ast.Subscript):
            parts = [node.slice]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith", "split")):
            parts = node.args
        else:
            continue
        partial = isinstance(node, ast.Call)  # a prefix, suffix or piece of a name
        for p in parts:
            if isinstance(p, ast.Constant) and isinstance(p.value, str):
                yield p.lineno, p.value, partial


def test_no_library_code_selects_a_shipped_arm_by_name():
    arms = _shipped_arms()
    assert {"BP", "FG-W", "exact-subset", "LG-FG-A-Ren"} <= arms  # the scan sees the tables
    found = []
    for path in [*ROOT.glob("jaxstream/**/*.py"), *ROOT.glob("jaxstream_lab/**/*.py")]:
        for line, s, partial in _keyed_strings(ast.parse(path.read_text())):
            if s in arms or (partial and len(s) >= 3 and any(s in a for a in arms)):
                found.append(f"{path.relative_to(ROOT)}:{line}: {s!r}")
    assert not found, found


def _row(arm, err, ds="d"):
    z = np.random.default_rng(sum(map(ord, arm))).standard_normal(5)  # the arm's own noise
    return {"dataset": ds, "arm": arm, "lr": 1e-3, "test_error_mean": err, "test_error_sd": 0.01,
            "train_error_mean": err, "seeds": 5, "steps": 10, "peak_temp_bytes": 2**20,
            "step_ms": 1.0, "cosine_mean": 0.5, "target_accuracy": 0.9,
            "seeds_reaching_target": 0, "steps_to_target_mean": None, "seconds_to_target": None,
            "test_error_by_seed": list(err + 0.001 * (z - z.mean()))}


def test_the_report_reads_each_runs_roles_from_its_meta_or_its_config(tmp_path):
    """Arms under names of the user's own play the published methods as the section says; a
    run recorded before runs kept their section gets it from the config its command names;
    without either, the ordering says what is missing instead of guessing by name."""
    section = {"reference": "ref", "methods": {"BP": ["ref"], "FG-W": ["w"], "FG-A": ["a"],
                                               "LG-FG-A": ["local"]},
               "forward": ["w", "a", "local"], "exact_subset": "sub", "hybrids": ["mix"]}
    rows = [_row("ref", 0.03), _row("w", 0.20), _row("a", 0.05), _row("local", 0.031),
            _row("sub", 0.04), _row("mix", 0.025)]
    src = tmp_path / "mine.json"
    src.write_text(json.dumps(rows))
    (tmp_path / "mine.json.meta").write_text(json.dumps({"command": "c", "report": section}))
    ft.main(["--from-json", str(src), "--docs", str(tmp_path / "r.md")])
    text = compact((tmp_path / "r.md").read_text())
    assert "- w worse than a: yes (" in text and "- local ≈ ref (equivalent within the margin)" in text
    assert "- ref best and w worst of these four: yes" in text
    assert "ingredients: sub 4.00 ± 1.00 %, best forward arm local" in text
    assert "| ref | 1e-03 |" in text and "| 2.66 | 2.41 |" in text  # BP's published figures
    from jaxstream.experiment.config import from_dict
    from jaxstream_lab.table_config import TableReport
    from jaxstream_lab.table_verdicts import ordering

    roles = from_dict(TableReport, section)
    assert ordering([r for r in rows if r["arm"] != "w"], "d", roles) == [
        "(ordering not checked: arms ['w'] missing)"]  # plays FG-W, did not run here

    # an older run: no section in its meta, the config its command names has one
    old = [_row("BP", 0.03, "q"), _row("FG-W", 0.2, "q"), _row("FG-A", 0.05, "q"),
           _row("LG-FG-A", 0.031, "q")]
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "old.json.meta").write_text(json.dumps(
        {"command": f"python benchmarks/forward_table.py --config {ft.QUICK} --json old.json"}))
    (tmp_path / "bare.json").write_text(json.dumps([_row("BP", 0.03, "z")]))
    (tmp_path / "bare.json.meta").write_text(json.dumps({"command": "c"}))
    ft.main(["--from-json", str(tmp_path / "old.json"), str(tmp_path / "bare.json"),
             "--docs", str(tmp_path / "r2.md")])
    text = compact((tmp_path / "r2.md").read_text())
    q, z = text.split("## q")[1].split("## z")
    assert "- FG-W worse than FG-A: yes (" in q and "| 2.66 | 2.41 |" in q
    assert ("(ordering not checked: no arm plays ['FG-W', 'FG-A', 'LG-FG-A', 'BP'] (the "
            "table's report.methods))") in z
    assert "| 2.66 | 2.41 |" not in z  # no section: no published figures beside a namesake
    # a config named but not found from here: said, not read as "no roles"
    (tmp_path / "old.json.meta").write_text(json.dumps(
        {"command": "python benchmarks/forward_table.py --config nowhere/t.yaml"}))
    with pytest.raises(FileNotFoundError, match=r"report: the run .* config nowhere/t\.yaml is "
                                                r"not found from"):
        ft.main(["--from-json", str(tmp_path / "old.json"), "--docs", str(tmp_path / "r3.md")])


def test_a_run_records_its_section_beside_its_rows(tmp_path):
    over = ["seeds=1", "cosine_keys=1", "timing_steps=1", "baselines=false", "extend_sweeps=0",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 8, depth: 1}, "
             "steps: 2, batch_size: 8, eval_every: 2, train_eval_size: 32}]"),
            "report={reference: mine, methods: {BP: [mine]}}",
            "arms=[{name: mine, estimator: {type: backprop}, lrs: [0.01]}]"]
    out = tmp_path / "rows.json"
    ft.main(["--quick", "--set", *over, "--json", str(out)])
    meta = json.loads((tmp_path / "rows.json.meta").read_text())
    assert meta["report"]["reference"] == "mine" and meta["report"]["methods"] == {"BP": ["mine"]}
