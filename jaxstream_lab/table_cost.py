"""The forward table's cost tables: XLA's temporary memory, step time and matrix-multiply FLOPs
of inference, backprop, rematerialised backprop, forward and hybrid steps against backprop's
(``benchmarks/memory_time.py``), the hybrid's time floor, and where its parts go."""

from __future__ import annotations

from jaxstream_lab.table_rows import markdown_table


def time_floor(row: dict, mode: str = "hybrid") -> dict:
    """The least step time ``mode`` could take, as a share of backprop's: its counted FLOPs
    run at the best FLOP rate (FLOPs per ms) any mode reached in the same run. Returns
    ``{"flops_ratio", "fastest", "floor"}`` (``fastest``: the mode with that rate)."""
    f, s = row["flops"], row["step_ms"]
    fastest = max(f, key=lambda m: f[m] / s[m])
    floor = f[mode] / (f[fastest] / s[fastest]) / s["backprop"]
    return {"flops_ratio": f[mode] / f["backprop"], "fastest": fastest, "floor": floor}


#: ``memory_time.py --parts`` parts that each draw every micro-batch's tangents once.
DRAW_PARTS = ("draws", "c own pass", "sum then + h", "sum into h")


def redraw_floor(row: dict) -> dict | None:
    """The least time of a hybrid step that draws every micro-batch's tangents twice (once in
    the forward pass, again for the sum, as :func:`jaxstream.grad.hybrid` does): its counted
    matrix-multiply FLOPs at the bare GEMM chain's rate, plus two rounds of draws at the
    fastest any part drew all N micro-batches' tangents (``draws`` alone, or with the c pass or
    the sum), each timed alone (``memory_time.py --parts`` rows; None without those parts). On
    a backend that runs one program's ops one after another (XLA's CPU client) the two do not
    overlap. Returns ``{"matmul_ms", "draws_ms", "floor_ms", "remat_ms"}``."""
    parts = row.get("parts", {})
    if "GEMM chain" not in parts or "draws" not in parts:
        return None
    _, gemm_ms, gemm_flops = parts["GEMM chain"][:3]
    matmul = row["flops"]["hybrid"] / (gemm_flops / gemm_ms)
    draws = 2 * min(parts[n][1] for n in DRAW_PARTS if n in parts)
    return {"matmul_ms": matmul, "draws_ms": draws, "floor_ms": matmul + draws,
            "remat_ms": row["step_ms"]["backprop_remat"]}


def redraw_floor_text(rows: list[dict]) -> str:
    """One sentence per depth: the hybrid's redraw floor (:func:`redraw_floor`) against
    backprop+remat's measured time."""
    out = []
    for r in rows:
        fl = redraw_floor(r)
        if fl is None:
            continue
        verdict = "above" if fl["floor_ms"] > fl["remat_ms"] else "below"
        out.append(f"- depth {r['depth']}: a hybrid that draws its tangents twice takes at least "
                   f"{fl['matmul_ms']:.0f} ms of matrix products (its FLOPs at the GEMM chain's "
                   f"rate) + {fl['draws_ms']:.0f} ms of draws = {fl['floor_ms']:.0f} ms, "
                   f"{verdict} backprop+remat's {fl['remat_ms']:.0f} ms.")
    if not out:
        return ""
    lead = ("The floor of a hybrid step that draws every tangent twice (in the forward pass and "
            "again for the sum), from the parts above:")
    return "\n".join([lead, "", *out])


def memory_table(memory: dict) -> str:
    """Temporary memory and step time relative to backprop, from ``benchmarks/memory_time.py
    --json`` (``memory["rows"]``; ``memory["command"]``/``["machine"]`` say how it was run)."""
    modes = [m for m in ("inference", "backprop_remat", "forward", "hybrid")
             if m in memory["rows"][0]["temp_bytes"]]
    table = []
    for r in memory["rows"]:
        t, s = r["temp_bytes"], r["step_ms"]
        line = {"depth": str(r["depth"]), "backprop temp MiB": f"{t['backprop'] / 2**20:.1f}",
                "backprop ms": f"{s['backprop']:.1f}"}
        for m in modes:
            line[f"{m} temp / bp"] = f"{t[m] / max(t['backprop'], 1):.3f}"
            line[f"{m} time / bp"] = f"{s[m] / s['backprop']:.2f}"
        table.append(line)
    lines = [f"Command: `{memory.get('command', '?')}`; machine: {memory.get('machine', '?')}.", "",
             markdown_table(table)]
    rows = memory["rows"]
    if all("flops" in r for r in rows):
        lines += ["", flops_table(rows)]
    if all("parts" in r for r in rows):
        lines += ["", ("Where the hybrid's memory and time go: each part compiled alone, with "
                  "its alternatives (`benchmarks/hybrid_parts.py` says what each is):"), "",
                  memory_parts_table(rows)]
        floor = redraw_floor_text(rows)
        if floor:
            lines += ["", floor]
    return "\n".join(lines)


def flops_table(rows: list[dict]) -> str:
    """Markdown: matrix-multiply FLOPs of each compiled step as shares of backprop's, and the
    hybrid's time floor (:func:`time_floor`) beside its measured time."""
    modes = [m for m in ("inference", "backprop_remat", "forward", "hybrid")
             if m in rows[0]["flops"]]
    intro = ("Matrix-multiply FLOPs each compiled step runs (`jaxstream.quality.flops`, loops by "
             "their trip counts), as shares of backprop's; the hybrid's floor is its FLOPs at the "
             "best FLOP rate any mode reached in the same run:")
    table = []
    for r in rows:
        f, fl = r["flops"], time_floor(r)
        table.append({"depth": str(r["depth"]), "backprop GFLOP": f"{f['backprop'] / 1e9:.2f}",
                      **{f"{m} FLOPs / bp": f"{f[m] / f['backprop']:.3f}" for m in modes},
                      "fastest rate": fl["fastest"], "hybrid floor time / bp": f"{fl['floor']:.2f}",
                      "hybrid time / bp": f"{r['step_ms']['hybrid'] / r['step_ms']['backprop']:.2f}"})
    lines = [intro, "", markdown_table(table)]
    floors = ", ".join(f"{time_floor(r)['floor']:.2f} at depth {r['depth']}" for r in rows)
    lines += ["", (f"The weight-perturbed jvp of every example is three matrix products per dense "
              f"layer, as many as backprop's (forward FLOPs / bp = 1), and the exact part adds "
              f"its share's rematerialised backprop, so the hybrid runs more FLOPs than "
              f"backprop. Run at the best FLOP rate of any mode here, they would still take "
              f"{floors} of backprop's time: a step below that would need matrix products "
              f"faster than any step in this run ran them.")]
    return "\n".join(lines)


def memory_parts_table(rows: list[dict]) -> str:
    """Markdown: per depth and hybrid part, temp MiB and ms, and both as shares of
    backprop's (``memory_time.py --parts`` rows)."""
    flops = len(rows[0]["backprop"]) > 2
    lines = []
    for r in rows:
        bp_t, bp_ms = r["backprop"][:2]
        for name, (t, ms, *f) in r["parts"].items():
            lines.append({"depth": str(r["depth"]), "part": name, "temp MiB": f"{t / 2**20:.2f}",
                          "temp / bp": f"{t / bp_t:.3f}", "ms": f"{ms:.1f}",
                          "time / bp": f"{ms / bp_ms:.2f}"}
                         | ({"FLOPs / bp": f"{f[0] / r['backprop'][2]:.3f}" if f else "—"}
                            if flops else {}))
    return markdown_table(lines)
