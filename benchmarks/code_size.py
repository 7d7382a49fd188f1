"""Library size per package (non-blank, non-comment lines), the largest functions, and the
places outside ``jaxstream/grad`` that ask an estimator what it is — for two git revisions side
by side.

    python benchmarks/code_size.py --base 9b28453 [--head HEAD] [--json PATH]

The switch count uses one regular expression (printed with the table): ``isinstance`` on an
estimator class, or a comparison of an estimator's ``correction`` / stream ``kind`` /
``perturb`` / ``local_losses`` (a forward pass's declarations, ``fp.local_losses``, are what
engines are meant to read and do not count). The forward-pass count is of comparisons of a
plan's ``forward`` name outside ``jaxstream/grad``. The lab (``jaxstream_lab``, at older
revisions the forward table's files under ``jaxstream/experiment``) is counted apart from the
core.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import tokenize
from collections import defaultdict

SWITCH = re.compile(
    r"isinstance\([^)]*\b(Hybrid|Forward|Backprop|BackpropRemat|ExactSubset|HybridActivity|"
    r"LocalForwardWeights)\b[^)]*\)|\.correction\s*(==|!=|in\b|not in\b)|self\.kind\s*(==|!=|in\b)"
    r"(?!.*KINDS)|\b_kind\(|\.perturb\s*(==|!=)|(?<!fp)(?<!forward_pass)\.local_losses\b|"
    r"\.aggregation\b")
FORWARD_NAME = re.compile(r"\.forward\s*(==|!=|in\b|not in\b)")
# the lab's files where they lived before it moved out of the core
LAB_BEFORE = ("jaxstream/experiment/forward_table.py", "jaxstream/experiment/table_baselines.py",
              "jaxstream/experiment/table_report.py", "jaxstream/lab/")
# policies with a ``kind`` of their own (a depth policy, a placement), not an estimator's
NOT_ESTIMATORS = ("stream/depth.py", "experiment/placement_config.py")


def _files(rev: str) -> list[str]:
    out = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "jaxstream",
                          "jaxstream_lab"],
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if f.endswith(".py")]


def _show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def code_lines(src: str) -> int:
    """Lines holding a token other than a comment, newline or indentation (docstrings count)."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def functions(src: str, path: str) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.end_lineno - node.lineno + 1, f"{path}::{node.name}"))
    return out


def measure(rev: str) -> dict:
    per_pkg: dict = defaultdict(int)
    funcs, switches, names, lab, files = [], [], [], 0, []
    for path in _files(rev):
        src = _show(rev, path)
        parts = path.split("/")
        lines = code_lines(src)
        in_lab = path.startswith("jaxstream_lab/") or path.startswith(LAB_BEFORE)
        pkg = "lab" if in_lab else parts[1] if len(parts) > 2 else "(top)"
        per_pkg[pkg] += lines
        lab += lines if in_lab else 0
        files.append((lines, path))
        funcs += functions(src, path)
        if not path.startswith("jaxstream/grad/"):
            numbered = list(enumerate(src.splitlines(), 1))
            switches += [f"{path}:{i}" for i, line in numbered
                         if SWITCH.search(line) and not path.endswith(NOT_ESTIMATORS)]
            names += [f"{path}:{i}" for i, line in numbered if FORWARD_NAME.search(line)]
    funcs.sort(reverse=True)
    files.sort(reverse=True)
    total = sum(per_pkg.values())
    return {"packages": dict(sorted(per_pkg.items())), "total": total, "core": total - lab,
            "lab": lab, "largest_functions": funcs[:5], "switches": switches,
            "forward_names": names, "largest_files": files[:8],
            "files_over_400": [f"{p} ({n})" for n, p in files if n > 400]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--json")
    args = ap.parse_args()
    base, head = measure(args.base), measure(args.head)
    print(f"{'package':<12} {args.base:>10} {args.head:>10}")
    for pkg in sorted(set(base["packages"]) | set(head["packages"])):
        print(f"{pkg:<12} {base['packages'].get(pkg, 0):>10} {head['packages'].get(pkg, 0):>10}")
    print(f"{'total':<12} {base['total']:>10} {head['total']:>10}")
    print(f"{'core':<12} {base['core']:>10} {head['core']:>10}")
    print(f"{'lab':<12} {base['lab']:>10} {head['lab']:>10}")
    for name, m in (("base", base), ("head", head)):
        print(f"largest functions ({name}):",
              ", ".join(f"{f} ({n})" for n, f in m["largest_functions"][:3]))
        print(f"estimator switches outside jaxstream/grad ({name}): {len(m['switches'])}")
        print(f"forward-pass name comparisons outside jaxstream/grad ({name}): "
              f"{len(m['forward_names'])}")
        print(f"files over 400 lines ({name}): {len(m['files_over_400'])}: "
              + ", ".join(m["files_over_400"]))
    print("switch pattern:", SWITCH.pattern)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"base": {"rev": args.base, **base}, "head": {"rev": args.head, **head},
                       "pattern": SWITCH.pattern}, fh, indent=1)


if __name__ == "__main__":
    main()
