"""benchmarks/config_library.py: the jaxstream column says what the loader does (written out
here by hand, so a change to the loader that the doc's table would hide fails), and the marks
say how a library's cell differs from it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import config_library as cl

R = "refused"
#: what jaxstream's loader builds from each probe, in SCALARS' order
EXPECTED = {
    "int": [2, 2, R, R, R, R],
    "float": [0.001, 1.0, 0.001, R, R, R, R],
    "bool": [True, R, R, R, R],
    "str": ["adam", R, R],
    "Literal['adam', 'sgd']": ["sgd", R, R],
    "Literal[1, 2]": [1, R, R, R],
    "tuple[int, ...]": [(1, 2), R, R, R],
    "int | None": [None, 3, R],
    "dict[str, float]": [{"a": 1.0}, R, R],
}


def test_jaxstream_column_is_the_loader_as_documented():
    doc = cl.run()
    got: dict[str, list] = {}
    for r in doc["rows"]:
        o = r["outcomes"]["jaxstream"]
        got.setdefault(r["field"], []).append(o["value"] if o["accepted"] else R)
    assert got == EXPECTED
    # exact types: 2.0 for an int is built as the int 2, 1 for a float as 1.0
    ints = [r for r in doc["rows"] if r["field"] == "int" and r["outcomes"]["jaxstream"]["accepted"]]
    assert all(type(r["outcomes"]["jaxstream"]["value"]) is int for r in ints)
    structure = {s["probe"].split(" `")[0]: s["outcomes"]["jaxstream"] for s in doc["structure"]}
    assert not structure["unknown key"]["accepted"] and structure["unknown key"]["names_field"]
    assert not structure["missing required"]["accepted"]
    assert "optim.lr" in structure["bad value two sections deep"]["message"]
    keeps = structure["a partial section keeps its default's other values"]
    assert keeps == {"accepted": True, "value": 0.5}


def test_cells_mark_how_a_library_differs():
    ref_refused = {"accepted": False, "message": "x: expected int, got True"}
    ref_two = {"accepted": True, "value": 2}
    assert cl.cell({"accepted": True, "value": 1}, ref_refused) == "**1** (silent)"
    assert cl.cell({"accepted": False, "message": "other words"}, ref_refused) == "refused"
    assert cl.cell({"accepted": False, "message": "m"}, ref_two) == "**refused** ≠"
    assert cl.cell({"accepted": True, "value": 2}, ref_two) == "2"
    assert cl.cell({"accepted": True, "value": 2.5}, ref_two) == "**2.5** ≠"


def test_table_counts_each_marked_cell():
    doc = {"loaders": ["jaxstream", "lib"], "versions": {},
           "rows": [{"field": "int", "value": v, "outcomes": {
               "jaxstream": {"accepted": False, "message": "m"},
               "lib": {"accepted": True, "value": 1} if v else {"accepted": False, "message": ""}}}
               for v in (True, False)],
           "structure": []}
    text = cl.table(doc)
    assert "| **cells that differ from jaxstream's** | | **0** (0 silent) | **1** (1 silent) |" \
        in text
