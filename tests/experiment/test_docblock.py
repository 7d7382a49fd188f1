"""The one doc-block writer: a block is replaced by the run's table, other scripts' blocks,
run-table blocks and blocks the run was allowed to skip stay byte for byte, an unknown block is
an error that leaves the doc as it was; every shipped doc uses the one marker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jaxstream.experiment import docblock

ROOT = Path(__file__).resolve().parents[2]

DOC = """# title
<!-- generated: a.py one -->
old one
<!-- end generated -->
text between
<!-- generated: a.py two -->
old two
<!-- end generated -->
<!-- generated: b.py one -->
other script
<!-- end generated -->
<!-- generated: compare runs/a -->
a run table
<!-- end generated -->
"""


def test_replaces_its_block_and_keeps_the_rest(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    names = docblock.write_tables(doc, "a.py", {"one": "| new |"}, "cmd --x", keep=("two",))
    text = doc.read_text()
    assert names == ["one"]
    assert "| new |" in text and "old one" not in text and "Written by `cmd --x` on" in text
    assert "old two" in text and "other script" in text and "text between" in text
    assert "a run table" in text and text.count("<!-- end generated -->") == 4
    assert text.count("Written by") == 1


def test_a_block_the_run_did_not_produce_is_an_error_and_the_doc_is_unchanged(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    with pytest.raises(ValueError, match="two"):
        docblock.write_tables(doc, "a.py", {"one": "| new |"}, "cmd")
    assert doc.read_text() == DOC


def test_a_table_from_another_machine_names_that_machine(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    docblock.write_tables(doc, "b.py", {"one": "| b |"}, "cmd --json r.json", where="box (8 x H100)")
    assert "Written by `cmd --json r.json` on box (8 x H100).\n" in doc.read_text()  # no day


def test_machine_names_cores_jax_and_devices():
    import jax

    here = docblock.machine()
    assert f"JAX {jax.__version__}" in here and "CPU cores" in here and "cpu" in here
    old_run = {"platform": "TestOS", "versions": {"jax": "0.1"}, "backend": "gpu",
               "device_count": 2, "device": "H100"}
    assert docblock.machine(old_run) == "TestOS, JAX 0.1 on gpu (2 x H100)"


def test_every_doc_uses_the_one_marker():
    for doc in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        text = doc.read_text()
        marks = re.findall(r"<!-- ([^>]*?) -->", text)
        starts = [m for m in marks if m.startswith("generated: ")]
        assert len(starts) == marks.count("end generated"), doc
        assert not [m for m in marks if "benchmark" in m or "written" in m or "table:" in m], doc
        assert len(docblock.BLOCK.findall(text)) == len(starts), doc


def test_a_footer_names_no_place_outside_the_repository(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    docblock.write_tables(doc, "b.py", {"one": "| b |"},
                          f"b.py --json {tmp_path}/wip/r.json --doc docs/x.md", where="box")
    assert "Written by `b.py --json r.json --doc docs/x.md` on box.\n" in doc.read_text()


def test_no_generated_table_names_an_absolute_path():
    for doc in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        for line in doc.read_text().splitlines():
            if line.startswith("Written by `"):
                command = line.split("`")[1]
                assert not [w for w in command.split() if w.startswith("/")], (doc, line)
