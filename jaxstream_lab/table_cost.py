"""The forward table's cost tables: XLA's temporary memory, step time and matrix-multiply FLOPs
of inference, backprop, rematerialised backprop, forward and hybrid steps against backprop's
(``benchmarks/memory_time.py``), the hybrid's time floor, and where its parts go."""

from __future__ import annotations


def time_floor(row: dict, mode: str = "hybrid") -> dict:
    """The least step time ``mode`` could take, as a share of backprop's: its counted FLOPs
    run at the best FLOP rate (FLOPs per ms) any mode reached in the same run. Returns
    ``{"flops_ratio", "fastest", "floor"}`` (``fastest``: the mode with that rate)."""
    f, s = row["flops"], row["step_ms"]
    fastest = max(f, key=lambda m: f[m] / s[m])
    floor = f[mode] / (f[fastest] / s[fastest]) / s["backprop"]
    return {"flops_ratio": f[mode] / f["backprop"], "fastest": fastest, "floor": floor}


def memory_table(memory: dict) -> str:
    """Temporary memory and step time relative to backprop, from ``benchmarks/memory_time.py
    --json`` (``memory["rows"]``; ``memory["command"]``/``["machine"]`` say how it was run)."""
    modes = [m for m in ("inference", "backprop_remat", "forward", "hybrid")
             if m in memory["rows"][0]["temp_bytes"]]
    lines = [f"Command: `{memory.get('command', '?')}`; machine: {memory.get('machine', '?')}.", "",
             "| depth | backprop temp MiB | backprop ms | "
             + " | ".join(f"{m} temp / bp | {m} time / bp" for m in modes) + " |",
             "|" + "---|" * (3 + 2 * len(modes))]
    for r in memory["rows"]:
        t, s = r["temp_bytes"], r["step_ms"]
        vals = [str(r["depth"]), f"{t['backprop'] / 2**20:.1f}", f"{s['backprop']:.1f}"]
        for m in modes:
            vals += [f"{t[m] / max(t['backprop'], 1):.3f}", f"{s[m] / s['backprop']:.2f}"]
        lines.append("| " + " | ".join(vals) + " |")
    rows = memory["rows"]
    if all("flops" in r for r in rows):
        lines += ["", flops_table(rows)]
    if all("parts" in r for r in rows):
        lines += ["", ("Where the hybrid's memory and time go: each part compiled alone, with "
                  "its alternatives (`benchmarks/hybrid_parts.py` says what each is):"), "",
                  memory_parts_table(rows)]
    return "\n".join(lines)


def flops_table(rows: list[dict]) -> str:
    """Markdown: matrix-multiply FLOPs of each compiled step as shares of backprop's, and the
    hybrid's time floor (:func:`time_floor`) beside its measured time."""
    modes = [m for m in ("inference", "backprop_remat", "forward", "hybrid")
             if m in rows[0]["flops"]]
    intro = ("Matrix-multiply FLOPs each compiled step runs (`jaxstream.quality.flops`, loops by "
             "their trip counts), as shares of backprop's; the hybrid's floor is its FLOPs at the "
             "best FLOP rate any mode reached in the same run:")
    lines = [intro, "",
             "| depth | backprop GFLOP | " + " | ".join(f"{m} FLOPs / bp" for m in modes)
             + " | fastest rate | hybrid floor time / bp | hybrid time / bp |",
             "|" + "---|" * (5 + len(modes))]
    for r in rows:
        f, fl = r["flops"], time_floor(r)
        vals = [str(r["depth"]), f"{f['backprop'] / 1e9:.2f}"]
        vals += [f"{f[m] / f['backprop']:.3f}" for m in modes]
        vals += [fl["fastest"], f"{fl['floor']:.2f}",
                 f"{r['step_ms']['hybrid'] / r['step_ms']['backprop']:.2f}"]
        lines.append("| " + " | ".join(vals) + " |")
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
    lines = ["| depth | part | temp MiB | temp / bp | ms | time / bp |"
             + (" FLOPs / bp |" if flops else ""),
             "|---|---|---|---|---|---|" + ("---|" if flops else "")]
    for r in rows:
        bp_t, bp_ms = r["backprop"][:2]
        for name, (t, ms, *f) in r["parts"].items():
            lines.append(f"| {r['depth']} | {name} | {t / 2**20:.2f} | {t / bp_t:.3f} | "
                         f"{ms:.1f} | {ms / bp_ms:.2f} |"
                         + (f" {f[0] / r['backprop'][2]:.3f} |" if flops and f else ""))
    return "\n".join(lines)
