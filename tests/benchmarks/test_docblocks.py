"""The benchmarks' doc writer: a block is replaced by the run's table, other scripts' blocks
and blocks the run was allowed to skip stay byte for byte, an unknown block is an error that
leaves the doc as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import docblocks

DOC = """# title
<!-- benchmark: a.py one -->
old one
<!-- end benchmark -->
text between
<!-- benchmark: a.py two -->
old two
<!-- end benchmark -->
<!-- benchmark: b.py one -->
other script
<!-- end benchmark -->
"""


def test_replaces_its_block_and_keeps_the_rest(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    names = docblocks.write_blocks(doc, "a.py", {"one": "| new |"}, "cmd --x", keep=("two",))
    text = doc.read_text()
    assert names == ["one"]
    assert "| new |" in text and "old one" not in text and "Written by `cmd --x` on" in text
    assert "old two" in text and "other script" in text and "text between" in text
    assert text.count("<!-- end benchmark -->") == 3


def test_a_block_the_run_did_not_produce_is_an_error_and_the_doc_is_unchanged(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    with pytest.raises(ValueError, match="two"):
        docblocks.write_blocks(doc, "a.py", {"one": "| new |"}, "cmd")
    assert doc.read_text() == DOC
