"""The equal-budget table: estimator families at the same number of directions per step.

A forward arm with K directions — K jvp tangents (weights or activations, full or low rank) or
K SPSA directions (2K loss evaluations) — is compared with the other families at the same K,
and with backprop (exact; rematerialised; rematerialised with gradient accumulation at the
memory of a named forward arm). Equal K is not equal compute — a jvp's K tangents share one
primal pass, SPSA's K directions cost 2K loss evaluations — so each row states what its step
costs, counted from the compiled program (matmul FLOPs over one forward pass), and its
temporary memory.

Rows are grouped by their estimator's family (from its config, never from the arm's name) and
K; every paired comparison of the section (each pair of arms at the same K, and the best of
each K against the memory-matched exact arms, or every exact arm where none is matched) of
one K is one Holm family (:mod:`jaxstream_lab.verdicts`): each K asks its own question, "which
family wins at this budget".
"""

from __future__ import annotations

import itertools
from typing import Any

import pandas as pd
from scipy import stats

from jaxstream.experiment.config import registered_name
from jaxstream_lab import verdicts
from jaxstream_lab.table_rows import _is_loss, _m
from jaxstream_lab.table_verdicts import VERDICT, _stat, paired

EXACT = "exact"  # the family of every backprop arm (K = 0)
FLIP = {"better": "worse", "worse": "better"}  # a verdict of a − b read as b − a


def family(est: Any) -> tuple[str | None, int]:
    """``(family, K)`` of an estimator config: ``exact`` (K 0) for backprop, ``jvp weights`` /
    ``jvp activations`` / ``SPSA`` with ``rank r`` for low-rank directions; ``(None, 0)`` for
    every other estimator (local losses, hybrids, the exact subset: not a family of this
    comparison)."""
    kind = registered_name(est)
    if kind == "backprop":
        return EXACT, 0
    rank = "" if getattr(est, "rank", None) is None else f", rank {est.rank}"
    if kind == "spsa":
        return f"SPSA{rank}", est.num_directions
    fp = est.build().plan.forward_pass
    if kind == "forward" and not fp.local_losses:
        return f"jvp {fp.tangents}{rank}", est.num_tangents
    return None, 0


def _rows(rows: list[dict], dataset: str) -> list[dict]:
    return [r for r in rows if r["dataset"] == dataset and r.get("family") is not None
            and r.get("kind") != "baseline"]


def budgets(rows: list[dict], dataset: str) -> dict[int, list[dict]]:
    """The data set's forward rows by K, where at least two families ran at that K."""
    by_k: dict[int, list[dict]] = {}
    for r in _rows(rows, dataset):
        if r["family"] != EXACT:
            by_k.setdefault(r["directions"], []).append(r)
    return {k: v for k, v in sorted(by_k.items()) if len({r["family"] for r in v}) >= 2}


def _half(r: dict) -> float:
    """Half-width of the judged figure's 95 % interval over the row's seeds (Student's t)."""
    n = r["seeds"]
    return float(stats.t.ppf(0.975, n - 1) * _m(r)[1] / n**0.5) if n > 1 else float("nan")


def _interval(r: dict) -> str:
    """The judged figure's mean with its 95 % interval over seeds (Student's t)."""
    loss, mean, half = _is_loss(r), _m(r)[0], _half(r)
    if loss:
        return f"{mean:.3f} ± {half:.3f}"
    return f"{100 * mean:.2f} ± {100 * half:.2f}"


def _pair(r: dict, key: str, scale: float = 1.0, spec: str = ".3f") -> str:
    init, mid = r.get(key), r.get(f"mid_{key}")
    cell = "—" if init is None else format(scale * init, spec)
    return cell if mid is None else f"{cell} / {format(scale * mid, spec)}"


def frame(rows: list[dict], dataset: str) -> pd.DataFrame:
    """One line per arm of the section (forward arms by K, then the exact arms)."""
    mine = [r for k, rs in budgets(rows, dataset).items() for r in rs]
    mine += [r for r in _rows(rows, dataset) if r["family"] == EXACT]
    loss = any(_is_loss(r) for r in mine)
    return pd.DataFrame([{
        "K": r["directions"] or "—", "family": r["family"], "arm": r["arm"],
        ("test loss (95 % CI)" if loss else "test error % (95 % CI)"): _interval(r),
        "lr": f"{r['lr']:.0e}",
        "forward passes / step": _fmt(r.get("forward_equivalents_per_step"), ".2f"),
        "MFLOP / step": _fmt(None if r.get("flops_per_step") is None
                             else r["flops_per_step"] / 1e6, ".2f"),
        "peak temp KiB": _fmt(None if r.get("peak_temp_bytes") is None
                              else r["peak_temp_bytes"] / 2**10, ".1f"),
        "accumulate": r.get("accumulate", "—"),
        "cosine init / mid": _pair(r, "cosine_mean"),
        "bias² init / mid": _pair(r, "bias_sq_rel", spec=".3g"),
        "variance init / mid": _pair(r, "variance_rel", spec=".3g"),
    } for r in mine])


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _exact_targets(rows: list[dict], dataset: str) -> list[dict]:
    """The exact arms a K's best arm is compared with: those at a matched memory where the
    table has any, else every exact arm."""
    exact = [r for r in _rows(rows, dataset) if r["family"] == EXACT]
    return [r for r in exact if r.get("memory_target_arm")] or exact


def comparisons(rows: list[dict], dataset: str) -> dict[int, list[tuple[dict, dict, dict]]]:
    """By K, ``(a, b, test)`` for each pair of arms at that K and for the K's best arm (by
    mean) against each exact arm of :func:`_exact_targets`; each K's tests are one Holm family
    (the question "which family wins at this K")."""
    out = {}
    for k, rs in budgets(rows, dataset).items():
        best = min(rs, key=lambda r: _m(r)[0])
        pairs = list(itertools.combinations(rs, 2))
        pairs += [(best, e) for e in _exact_targets(rows, dataset)]
        tests = verdicts.family([paired(a, b) for a, b in pairs])
        out[k] = [(a, b, t) for (a, b), t in zip(pairs, tests)]
    return out


def winners(rows: list[dict], dataset: str, tests: dict | None = None) -> list[str]:
    """Per K: which family wins (better than every other family at that K, after Holm), or
    which lead the others could not be told apart from (``tests``: :func:`comparisons`'
    result, computed here when not given)."""
    tests = comparisons(rows, dataset) if tests is None else tests
    out = []
    for k, rs in budgets(rows, dataset).items():
        best = min(rs, key=lambda r: _m(r)[0])
        beaten, open_ = [], []
        here = {r["arm"] for r in rs}
        for a, b, t in tests[k]:
            if not {a["arm"], b["arm"]} <= here or best["arm"] not in (a["arm"], b["arm"]):
                continue
            first = a["arm"] == best["arm"]  # the verdict is of a − b
            word = t["verdict"] if first else FLIP.get(t["verdict"], t["verdict"])
            (beaten if word == "better" else open_).append(b if first else a)
        said = f"K = {k}: lowest mean {best['family']} ({best['arm']}, {_interval(best)})"
        names = lambda rs: "; ".join(f"{o['family']} ({o['arm']})" for o in rs)
        if not open_:
            out.append(f"{said}: **wins** — better than every other family at this K, after "
                       f"Holm: {names(beaten)}.")
        else:
            out.append(f"{said}: **no single winner** — not separated from {names(open_)}"
                       + (f"; better than {names(beaten)}" if beaten else "") + ".")
    return out


def lines(rows: list[dict], dataset: str, tests: dict | None = None) -> list[str]:
    """Every comparison of the section as a sentence (a − b, interval, tests)."""
    tests = comparisons(rows, dataset) if tests is None else tests
    out = []
    for a, b, t in (x for per_k in tests.values() for x in per_k):
        loss = _is_loss(a)
        out.append(f"{a['arm']} ({a['family']}) {VERDICT[t['verdict']]} {b['arm']} "
                   f"({b['family']}): {_stat(t, loss)}")
    return out


def memory_lines(rows: list[dict], dataset: str) -> list[str]:
    """What each memory-matched arm chose, from its row."""
    out = []
    for r in _rows(rows, dataset):
        if r.get("memory_target_arm") is None:
            continue
        kib = r["memory_target_bytes"] / 2**10
        how = ("at most" if r["memory_matched"] else "**not reached**: the least is")
        chunks = ("the whole batch at once (1 chunk)" if r["accumulate"] == 1
                  else f"{r['accumulate']} chunks of the batch one after another")
        out.append(f"{r['arm']}: {chunks}; its "
                   f"step needs {r['peak_temp_bytes'] / 2**10:.1f} KiB, {how} {kib:.1f} KiB of "
                   f"{r['memory_target_arm']}'s step (by chunks: "
                   + ", ".join(f"{c}: {b / 2**10:.1f}" for c, b in
                               r["temp_bytes_by_accumulate"].items()) + " KiB).")
    return out


INTRO = (
    "Equal budget: every forward family at the same number K of directions per step (K jvp "
    "tangents share one primal pass; K SPSA directions cost 2K loss evaluations), against "
    "backprop — exact, rematerialised, and rematerialised with gradient accumulation at the "
    "temporary memory of a forward arm's step (the fewest chunks of the batch whose compiled "
    "step needs no more, measured). Test error: mean ± the half-width of its 95 % interval "
    "over seeds. Forward passes / step and MFLOP / step: matmul FLOPs of the compiled step "
    "(over one forward pass of the batch). Peak temp: XLA's temporary buffers of the step. "
    "Cosine, bias² and variance of the estimate against the exact gradient of one batch over "
    "the table's n keys (bias² and variance relative to ‖g‖²; bias² is the unbiased estimate "
    "‖ḡ − g‖² − variance/n, negative where the bias is below the noise), at initialisation / "
    "at mid-training (after half the steps of backprop with Adam; the same point for every "
    "arm).")


def section(rows: list[dict], dataset: str) -> str:
    """The data set's table, memory matches, winners per K and every comparison (empty where
    no two families ran at the same K)."""
    if not budgets(rows, dataset):
        return ""
    judged = "test loss" if any(_is_loss(r) for r in _rows(rows, dataset)) else "test error"
    tests = comparisons(rows, dataset)
    sizes = ", ".join(f"K = {k}: {sum('p' in t for _, _, t in per_k)}"
                      for k, per_k in tests.items())
    parts = [frame(rows, dataset).to_markdown(index=False, disable_numparse=True), ""]
    parts += [f"- {line}" for line in memory_lines(rows, dataset)]
    said = (f"Which family wins per K ({judged}; the paired tests of each K are one family, "
            f"Holm-adjusted: {sizes}):")
    parts += ["", said, ""]
    parts += [f"- {line}" for line in winners(rows, dataset, tests)]
    parts += ["", "Every comparison of the section:", ""]
    parts += [f"- {line}" for line in lines(rows, dataset, tests)]
    return "\n".join(parts)


def markdown(rows: list[dict], dataset: str) -> str:
    """The section under its heading and :data:`INTRO` (empty where :func:`section` is)."""
    body = section(rows, dataset)
    return f"### Equal budget\n\n{INTRO}\n\n{body}" if body else ""


PLOT_CAPTION = ("Test error (95 % interval over seeds) against the step's cost in forward passes "
                "(matmul FLOPs of the compiled step over one forward pass), one line per family "
                "through its K (labelled), one panel per data set; the exact arms as dotted "
                "horizontal lines.")


def plot(rows: list[dict], path: str) -> bool:
    """:data:`PLOT_CAPTION`'s plot; False where no data set has a budget section (nothing
    written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxstream.quality.plots import legend_beside

    datasets = [d for d in dict.fromkeys(r["dataset"] for r in rows) if budgets(rows, d)]
    if not datasets:
        return False
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets) + 2.5, 4),
                             squeeze=False)
    for i, (ax, ds) in enumerate(zip(axes[0], datasets)):
        forward = [r for rs in budgets(rows, ds).values() for r in rs]
        loss = _is_loss(forward[0])
        scale = 1.0 if loss else 100.0
        for fam in dict.fromkeys(r["family"] for r in forward):
            mine = sorted((r for r in forward if r["family"] == fam
                           and r.get("forward_equivalents_per_step")),
                          key=lambda r: r["directions"])
            x = [r["forward_equivalents_per_step"] for r in mine]
            y = [scale * _m(r)[0] for r in mine]
            half = [scale * _half(r) for r in mine]
            ax.errorbar(x, y, yerr=half, marker="o", ms=4, capsize=3, label=fam)
        for k in sorted({r["directions"] for r in forward}):  # one K label per column
            at = [r for r in forward if r["directions"] == k
                  and r.get("forward_equivalents_per_step")]
            if at:  # above the highest error bar of the column
                upper = lambda r, s=scale: s * (_m(r)[0] + _half(r))
                top = max(at, key=upper)
                ax.annotate(f"K = {k}", (top["forward_equivalents_per_step"], upper(top)),
                            fontsize=7, xytext=(0, 4), textcoords="offset points",
                            ha="center")
        for r in (r for r in _rows(rows, ds) if r["family"] == EXACT):
            ax.axhline(scale * _m(r)[0], color="grey", lw=0.8, ls=":")
        ax.plot([], [], color="grey", lw=0.8, ls=":", label="exact arms (backprop)")
        ax.set_xscale("log")
        ticks = [2, 4, 8, 16, 32]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("forward passes per step (compiled matmul FLOPs)")
        ax.set_ylabel("test loss" if loss else "test error %")
        ax.set_title(ds)
        if i == len(datasets) - 1:
            legend_beside(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True
