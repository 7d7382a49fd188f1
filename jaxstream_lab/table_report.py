"""Report of ``kind: forward_table``: the markdown tables (with Ren et al.'s published MNIST rows
beside them), the ordering and hybrid-vs-ingredients checks, and the memory/time frontier plot.

Everything here is computed from the rows a run wrote; nothing is typed in by hand except the
published figures of Ren et al. (2023), which are quoted as such.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from jaxstream_lab import verdicts

# Ren et al.'s published figures are data, with their source: published.json beside this file
_PUBLISHED = json.loads((Path(__file__).with_name("published.json")).read_text())["ren2023"]
REN_SETTINGS = tuple(_PUBLISHED["settings"])
REN_MNIST = _PUBLISHED["mnist_test_error_percent"]
REN = "-Ren"  # suffix of the arms that run Ren et al.'s local losses (a head per block)
FORWARD_ARMS = ("FG-W", "FG-A", "LG-FG-W", "LG-FG-A", "LG-FG-W" + REN, "LG-FG-A" + REN)
#: The arms :func:`equivalents_plot` draws where a table has them (the rest: the table).
MAIN_ARMS = ("BP", "FG-W", "FG-A", "FG-A-K16", "LG-FG-A", "LG-FG-A" + REN,
             "LG-FG-A" + REN + "-P16G4-agg", "local-guess",
             "exact-subset", "hybrid-control_variate", "hybrid-weighted", "hybrid-activity")


def ren_figures(row: dict) -> dict:
    """Ren et al.'s published figures for a row's method: by arm name, beside MLP rows only
    (their figures are of MLPs), the local-loss arms only where the row ran their design (its
    own head per block: ``local_heads == "own"``) and only in the setting whose groups it ran
    (S/1/1: one group; M/1/16: 16)."""
    name = row["arm"]
    if row.get("model", "mlp") != "mlp":
        return {}  # their figures are of MLPs
    if not name.startswith("LG-"):
        return REN_MNIST.get(name, {})
    if row.get("local_heads") != "own" or row.get("local_over", "features") != "features":
        return {}  # not their design, or patch-wise groups (their MLP rows group features)
    figures = REN_MNIST.get(name.split(REN)[0], {})
    groups = row.get("local_groups", 1)
    return {s: v for s, v in figures.items() if int(s.rsplit("/", 1)[1]) == groups}


def _pm(mean: float, sd: float, scale: float = 100.0) -> str:
    return f"{scale * mean:.2f} ± {scale * sd:.2f}"


def _fmt(x: Any, spec: str = ".0f") -> str:
    return "—" if x is None else format(x, spec)


def is_baseline(r: dict) -> bool:
    """A baseline row (:mod:`jaxstream_lab.table_baselines`): one figure, no training."""
    return r.get("kind") == "baseline"


def baseline_table(rows: list[dict], dataset: str) -> str:
    """The data set's baseline rows as a markdown table ("" when it has none)."""
    mine = [r for r in rows if r["dataset"] == dataset and is_baseline(r)]
    if not mine:
        return ""
    loss = _is_loss(mine[0])
    head = ("| baseline | test loss | train loss | test token error % | how |" if loss else
            "| baseline | test error % | train error % | test loss | how |")
    lines = [head, "|---|---|---|---|---|"]
    for r in mine:
        figs = ((f"{r['test_loss_mean']:.3f}", f"{r['train_loss_mean']:.3f}",
                 f"{100 * r['test_error_mean']:.2f}") if loss else
                (f"{100 * r['test_error_mean']:.2f}", f"{100 * r['train_error_mean']:.2f}",
                 f"{r['test_loss_mean']:.3f}"))
        lines.append(f"| {r['arm']} | {' | '.join(figs)} | {r.get('how', '')} |")
    return "\n".join(lines)


def _by(rows: list[dict], dataset: str) -> dict[str, dict]:
    return {r["arm"]: r for r in rows if r["dataset"] == dataset}


def _is_loss(r: dict) -> bool:
    return r.get("metric", "error") == "loss"


def _m(r: dict) -> tuple[float, float]:
    """The row's judged figure (test error, or test loss for ``metric: loss``): mean, sd."""
    if _is_loss(r):
        return r["test_loss_mean"], r.get("test_loss_sd", 0.0)
    return r["test_error_mean"], r["test_error_sd"]


def _d(x: float, loss: bool) -> str:
    """A difference of the judged figure: nats for losses, percentage points for errors."""
    return f"{x:+.3f}" if loss else f"{100 * x:+.2f} pp"


def _show(r: dict) -> str:
    mean, sd = _m(r)
    return f"{mean:.3f} ± {sd:.3f}" if _is_loss(r) else f"{_pm(mean, sd)} %"


ALPHA = verdicts.ALPHA  # level of every test
MIN_SEEDS = verdicts.MIN_SEEDS_TEST  # paired seeds any test needs
MIN_SEEDS_EQUIVALENT = verdicts.MIN_SEEDS_EQUIVALENT  # paired seeds an "≈" needs
MARGIN_ERROR = 0.005  # equivalence margin of test error: 0.5 percentage points
MARGIN_LOSS = 0.01  # equivalence margin of test loss: 0.01 nats per character
#: A paired comparison's words, by :func:`jaxstream_lab.verdicts.verdict` of ``a − b``.
VERDICT = {"better": "better than", "worse": "worse than", "≈": "≈",
           "inconclusive": "inconclusive against"}
BASE_DESIGN = "LG-FG-A" + REN  # the local-loss design the others are judged against
VERDICT_RULES = (
    "Verdicts: each comparison is the paired by-seed difference a − b of the judged figure "
    "(seed i of one arm against seed i of the other: same initial key and batches), printed "
    "with its 95 % interval (Student's t, df = n − 1). **better** / **worse**: the two-sided "
    "paired t-test (scipy.stats.ttest_rel) rejects a − b = 0 at level {alpha} after Holm's "
    "adjustment over every paired comparison of the data set's table (the family; its size is "
    "stated per table). **≈**: the difference is inside the equivalence margin, ±{pp:.1f} pp of "
    "test error (±{nats:.2f} nats of test loss), by two one-sided tests (TOST: the larger "
    "one-sided p, Holm-adjusted over the same family, below {alpha}), and only with at least "
    "{five} paired seeds; a difference inside the margin is ≈ even where it is also "
    "significant. **inconclusive**: neither. Rule for fewer than {five} paired seeds: no ≈ "
    "(the verdict is inconclusive unless the Holm-adjusted test already excludes zero, then "
    "better / worse); fewer than {three}, or every seed differing by the same amount (no "
    "spread: t undefined): no test, inconclusive.")


def margin(loss: bool) -> float:
    """The equivalence margin of the judged figure (a loss, or an error rate)."""
    return MARGIN_LOSS if loss else MARGIN_ERROR


def paired(a: dict, b: dict) -> dict:
    """Paired by-seed difference of the judged figure, ``a − b``:
    :func:`jaxstream_lab.verdicts.paired_difference` of the rows' by-seed test errors
    (test losses for ``metric: loss``) against :func:`margin` (``{"n", "mean", "lo", "hi",
    "t", "df", "p", "p_tost", ...}``; only ``{"n"}`` below :data:`MIN_SEEDS` paired seeds,
    ``{"n", "mean", "constant"}`` where every seed differs by the same nonzero amount)."""
    loss = _is_loss(a)
    key = "test_loss_by_seed" if loss else "test_error_by_seed"
    return verdicts.paired_difference(a.get(key) or [], b.get(key) or [], margin(loss))


def _lg(r: dict) -> str:
    return "LG-FG-A" + REN if "LG-FG-A" + REN in r else "LG-FG-A"  # Ren's design where it ran


def _best_forward(r: dict) -> dict | None:
    fwd = [r[a] for a in FORWARD_ARMS if a in r]
    return min(fwd, key=lambda x: _m(x)[0]) if fwd else None


def _pairs(rows: list[dict], dataset: str) -> list[tuple[str, str]]:
    """Every paired comparison the report makes on one data set, as ``(a, b)`` arm names."""
    r = _by(rows, dataset)
    lg, pairs = _lg(r), []
    if all(a in r for a in ("FG-W", "FG-A", lg, "BP")):
        pairs += [("FG-W", "FG-A"), ("FG-A", lg), (lg, "BP")]
    if "LG-FG-A" in r and BASE_DESIGN in r:
        pairs.append(("LG-FG-A", BASE_DESIGN))  # shared head against heads of their own
    best = _best_forward(r)
    if "exact-subset" in r and best:
        for name in (n for n in r if n.startswith("hybrid")):
            pairs += [(name, "exact-subset"), (name, best["arm"])]
    if BASE_DESIGN in r:
        pairs += [(n, BASE_DESIGN) for n in r if n.startswith(BASE_DESIGN + "-")]
    return list(dict.fromkeys(pairs))


def comparisons(rows: list[dict], dataset: str) -> dict[tuple[str, str], dict]:
    """Every paired comparison of the data set's table (:func:`paired`), Holm-adjusted as one
    family (:func:`jaxstream_lab.verdicts.family`: ``p_holm``, ``p_tost_holm``, ``m``,
    ``verdict``), by ``(a, b)``."""
    r = _by(rows, dataset)
    pairs = _pairs(rows, dataset)
    return dict(zip(pairs, verdicts.family([paired(r[a], r[b]) for a, b in pairs])))


def family_size(rows: list[dict], dataset: str) -> int:
    """How many paired tests the data set's table makes (Holm's m)."""
    return sum("p" in t for t in comparisons(rows, dataset).values())


def _ci(test: dict, loss: bool) -> str:
    if loss:
        return f"95 % CI [{test['lo']:+.3f}, {test['hi']:+.3f}]"
    return f"95 % CI [{100 * test['lo']:+.2f}, {100 * test['hi']:+.2f}] pp"


def _stat(test: dict, loss: bool) -> str:
    if test.get("constant"):
        return (f"no test: all {test['n']} paired differences are {_d(test['mean'], loss)}, "
                "no spread, so Student's t is undefined (a discrete test set can do this)")
    if "p" not in test:
        return f"no test: {test['n']} paired seeds, {MIN_SEEDS} needed"
    few = (f" (fewer than {MIN_SEEDS_EQUIVALENT}: no ≈)"
           if test["n"] < MIN_SEEDS_EQUIVALENT else "")
    band = f"±{test['margin']:.2f} nats" if loss else f"±{100 * test['margin']:.1f} pp"
    return (f"{_d(test['mean'], loss)}, {_ci(test, loss)}; t = {test['t']:.2f}, "
            f"df = {test['df']}, p = {test['p']:.3f}, Holm p = {test['p_holm']:.3f} "
            f"(of {test['m']}); TOST at {band}: Holm p = {test['p_tost_holm']:.3f}; "
            f"{test['n']} paired seeds{few}")


def ordering(rows: list[dict], dataset: str) -> list[str]:
    """Check FG-W < FG-A ≤ LG-FG-A ≈ BP (in test error, or test loss for ``metric: loss``) on
    one data set, plus BP best and FG-W worst of these four (by means, untested); one line
    per relation, each answered yes / no / inconclusive from the verdict of its paired
    comparison (:func:`comparisons`)."""
    r = _by(rows, dataset)
    lg = _lg(r)
    need = ("FG-W", "FG-A", lg, "BP")
    if any(a not in r for a in need):
        return [f"(ordering not checked: arms {[a for a in need if a not in r]} missing)"]
    loss = _is_loss(r["BP"])
    tests = comparisons(rows, dataset)
    # the relation's answer by the comparison's verdict (inconclusive: inconclusive)
    relations = (("FG-W", "FG-A", "FG-W worse than FG-A", {"worse"}, {"better", "≈"}),
                 ("FG-A", lg, f"FG-A no better than {lg}", {"worse", "≈"}, {"better"}),
                 (lg, "BP", f"{lg} ≈ BP (equivalent within the margin)", {"≈"},
                  {"better", "worse"}))
    out = []
    for a, b, said, yes, no in relations:
        t = tests[(a, b)]
        answer = "yes" if t["verdict"] in yes else "no" if t["verdict"] in no else "inconclusive"
        out.append(f"{said}: {answer} ({_stat(t, loss)})")
    means = {a: _m(r[a])[0] for a in need}
    best, worst = min(means, key=means.get), max(means, key=means.get)
    out.append(f"BP best and FG-W worst of these four: "
               f"{'yes' if best == 'BP' and worst == 'FG-W' else 'no'}"
               f" (best {best}, worst {worst}; means, not a test)")
    return out


def head_verdict(rows: list[dict], dataset: str) -> list[str]:
    """LG-FG-A (the model's final head shared by every block) against LG-FG-A-Ren (a head of
    its own per block, as Ren et al.), paired by seed; [] without both arms."""
    r = _by(rows, dataset)
    if "LG-FG-A" not in r or BASE_DESIGN not in r:
        return []
    loss = _is_loss(r[BASE_DESIGN])
    t = comparisons(rows, dataset)[("LG-FG-A", BASE_DESIGN)]
    return [(f"LG-FG-A (shared head) {_show(r['LG-FG-A'])} — {VERDICT[t['verdict']]} "
            f"{BASE_DESIGN} (heads of their own) {_show(r[BASE_DESIGN])} ({_stat(t, loss)})")]


HYBRID_WHY = ("Whether a hybrid can beat both its ingredients at this scale: "
              "docs/hybrid_variance.md — the hybrids' variance model, checked against Monte Carlo "
              "of these estimators, and its answer at equal compute (where the exact subset alone "
              "covers the batch, and what correlation a forward part would need below that).")


def hybrid_verdict(rows: list[dict], dataset: str) -> list[str]:
    """Each hybrid against both its ingredients, the exact subset and the best forward arm
    (by mean), from the verdicts of the paired comparisons (:func:`comparisons`): BEATS BOTH
    where better than both, does not beat both where worse than or ≈ either, else
    inconclusive."""
    r = _by(rows, dataset)
    best_fwd = _best_forward(r)
    if "exact-subset" not in r or not best_fwd:
        return ["(verdict not computed: exact-subset or forward arms missing)"]
    sub = r["exact-subset"]
    loss = _is_loss(sub)
    tests = comparisons(rows, dataset)
    out = [(f"ingredients: exact-subset {_show(sub)}, best forward arm {best_fwd['arm']} "
           f"{_show(best_fwd)}")]
    for name, h in r.items():
        if not name.startswith("hybrid"):
            continue
        said, words = [], []
        for other in (sub, best_fwd):
            t = tests[(name, other["arm"])]
            words.append(t["verdict"])
            said.append(f"{VERDICT[t['verdict']]} {other['arm']} ({_stat(t, loss)})")
        end = ("BEATS BOTH" if words == ["better", "better"] else
               "does not beat both" if {"worse", "≈"} & set(words) else "inconclusive")
        out.append(f"{name}: {_show(h)} — {'; '.join(said)} → {end}")
    return out


def design_verdicts(rows: list[dict], dataset: str) -> list[str]:
    """Each other local-loss design with activity tangents and heads of its own (an
    ``LG-FG-A-Ren-*`` arm: groups, patch groups, cells, the feature aggregator) against
    LG-FG-A-Ren (one loss per block), from the verdicts of the paired comparisons
    (:func:`comparisons`); [] where the data set has no such arm."""
    r = _by(rows, dataset)
    base = BASE_DESIGN
    others = [x for name, x in r.items() if name.startswith(base + "-")]
    if base not in r or not others:
        return []
    loss = _is_loss(r[base])
    tests = comparisons(rows, dataset)
    out = []
    for x in others:
        t = tests[(x["arm"], base)]
        out.append(f"{x['arm']}: {_show(x)} — {VERDICT[t['verdict']]} {base} {_show(r[base])} "
                   f"({_stat(t, loss)})")
    return out


def seeds_note(rows: list[dict], dataset: str) -> str:
    """A sentence naming the data set's rows with fewer than :data:`MIN_SEEDS_EQUIVALENT`
    seeds ("" where none)."""
    mine = [r for r in rows if r["dataset"] == dataset and not is_baseline(r)]
    few = [r for r in mine if r.get("seeds", 0) < MIN_SEEDS_EQUIVALENT]
    if not few:
        return ""
    counts = " or ".join(str(n) for n in sorted({r.get("seeds", 0) for r in few}))
    which = (f"every row ({len(few)} arms) has {counts}"
             if len(few) == len(mine) else
             ", ".join(f"{r['arm']} ({r.get('seeds', 0)})" for r in few) + " have")
    return (f"**Fewer than {MIN_SEEDS_EQUIVALENT} seeds**: {which} seeds, so no comparison "
            "here can be ≈; each is better / worse where its Holm-adjusted test excludes zero, "
            "else inconclusive.")


def lr_edge(row: dict) -> str | None:
    """``"largest"`` / ``"smallest"`` when the picked rate is the edge of its sweep, ``"only"``
    when the arm tried one rate (no sweep: the best rate may lie on either side), else
    None."""
    lrs = [float(x) for x in row.get("lrs") or []]
    if not lrs:
        return None
    if len(lrs) == 1:
        return "only"
    if row["lr"] >= max(lrs):
        return "largest"
    return "smallest" if row["lr"] <= min(lrs) else None


def _lr(row: dict) -> str:
    mark = {"largest": " ↑", "smallest": " ↓", "only": " ·", None: ""}[lr_edge(row)]
    return f"{row['lr']:.0e}{mark}"


def _edges(rows: list[dict], dataset: str) -> str:
    """Sentences: which sweeps were extended past an edge, and how many picks still sit at
    the edge of their sweep."""
    single = [r["arm"] for r in rows if r["dataset"] == dataset and lr_edge(r) == "only"]
    mine = [r for r in rows if r["dataset"] == dataset and len(r.get("lrs") or []) >= 2]
    grown = [f"{r['arm']} (+{', '.join(f'{x:.0e}' for x in r['lrs_added'])})" for r in mine
             if r.get("lrs_added")]
    said = ("Sweeps extended past an edge their pick sat at, one geometric step per added "
            f"rate: {'; '.join(grown)}. " if grown else "")
    if single:
        said += (f"{len(single)} arms tried one rate (· in the table: not swept, so the pick is "
                 f"at both edges): {', '.join(single)}. ")
    edge = [r["arm"] for r in mine if lr_edge(r)]
    if not edge:
        return said + f"Every swept arm's rate lies inside its sweep ({len(mine)} swept arms)."
    return (said + f"**{len(edge)} of {len(mine)} swept arms picked the edge of their sweep** "
            f"(↑ the largest rate tried, ↓ the smallest): {', '.join(edge)}. Their best rate may "
            f"lie outside the sweep, and their rows may overstate their error.")


def design(r: dict) -> str | None:
    """What a local-loss arm's local losses are, from its row (None: not local heads of its
    own)."""
    if r.get("local_heads") != "own":
        return None
    groups, patches = r.get("local_groups", 1), r.get("local_patch_groups", 1)
    if r.get("local_over") == "positions":
        groups, patches = 1, groups
    cells = [f"{patches} patch groups" if patches > 1 else "",
             f"{groups} channel groups" if groups > 1 else ""]
    what = " × ".join(c for c in cells if c)
    if not what:
        return "a head of its own per block"
    if r.get("local_aggregate"):
        return (f"{what} ({patches * groups} cells per block), Ren et al.'s feature aggregator: "
                "one head per block on its whole output, each cell's loss through its own cell")
    return f"{what}, a head and a loss per cell"


def designs(rows: list[dict], dataset: str) -> str:
    """A sentence listing the data set's local-loss designs ("" without any)."""
    mine = [(r["arm"], design(r)) for r in rows if r["dataset"] == dataset]
    said = [f"{arm}: {d}" for arm, d in mine if d]
    return ("Local losses of the -Ren arms: " + "; ".join(said) + ".") if said else ""


def loss_table(rows: list[dict], dataset: str) -> str:
    """A markdown table for a ``metric: loss`` data set (no published rows beside it)."""
    lines = [("| arm | lr | test loss | train loss | test token error % | steps to target loss "
             "(seeds) | s to target | peak temp MiB | ms / step | K | forward passes / step | "
             "cosine at init | rel. sq. error at init |"), "|" + "---|" * 13]
    for r in (x for x in rows if x["dataset"] == dataset):
        lines.append(
            f"| {_arm(r)} | {_lr(r)} | {r['test_loss_mean']:.3f} ± "
            f"{r.get('test_loss_sd', 0.0):.3f} | {r['train_loss_mean']:.3f} ± "
            f"{r.get('train_loss_sd', 0.0):.3f} | {_pm(r['test_error_mean'], r['test_error_sd'])} | "
            f"{_fmt(r['steps_to_target_mean'])} ({r['seeds_reaching_target']}/{r['seeds']}) | "
            f"{_fmt(r['seconds_to_target'], '.2f')} | {_mib(r)} | "
            f"{r['step_ms']:.2f} | {_cost(r)} | {_cos(r)} | {_fmt(r.get('relative_mse'), '.3g')} |")
    return "\n".join(lines)


def _arm(r: dict) -> str:
    """The arm's name, with the engine and optimizer that ran it where they are not the
    defaults (local, Adam)."""
    ran = [x for x in (r.get("engine", "local"), r.get("optimizer", "adam"))
           if x not in ("local", "adam")]
    return f"{r['arm']} ({', '.join(ran)})" if ran else r["arm"]


def _mib(r: dict) -> str:
    """The peak temporary memory cell (— where the engine's step is not one compiled program)."""
    b = r.get("peak_temp_bytes")
    return _fmt(None if b is None else b / 2**20, ".2f")


def _cos(r: dict) -> str:
    """The cosine cell (— where the engine gives no estimate to compare)."""
    if r.get("cosine_mean") is None:
        return "—"
    return f"{r['cosine_mean']:.3f} ± {r.get('cosine_sd', 0.0):.3f}"


def _cost(r: dict) -> str:
    """The K and forward-passes-per-step cells (— where a row predates them)."""
    return f"{_fmt(r.get('tangents'), 'd')} | {_fmt(r.get('forward_equivalents_per_step'), '.2f')}"


def table(rows: list[dict], dataset: str) -> str:
    """A markdown table for one data set, Ren et al.'s MNIST rows beside it."""
    if any(_is_loss(r) for r in rows if r["dataset"] == dataset):
        return loss_table(rows, dataset)
    head = ("| arm | lr | test error % | train error % | test loss | steps to target (seeds) | "
            "s to target | peak temp MiB | ms / step | K | forward passes / step | cosine at init "
            "| rel. sq. error at init | " + " | ".join(f"Ren MNIST {s}" for s in REN_SETTINGS)
            + " |")
    lines = [head, "|" + "---|" * 15]
    for r in (x for x in rows if x["dataset"] == dataset):
        ren = ren_figures(r)
        lines.append(
            f"| {_arm(r)} | {_lr(r)} | {_pm(r['test_error_mean'], r['test_error_sd'])} | "
            f"{_pm(r['train_error_mean'], r.get('train_error_sd', 0.0))} | "
            f"{r.get('test_loss_mean', float('nan')):.3f} | "
            f"{_fmt(r['steps_to_target_mean'])} ({r['seeds_reaching_target']}/{r['seeds']}) | "
            f"{_fmt(r['seconds_to_target'], '.2f')} | {_mib(r)} | "
            f"{r['step_ms']:.2f} | {_cost(r)} | {_cos(r)} | {_fmt(r.get('relative_mse'), '.3g')} | "
            + " | ".join(_fmt(ren.get(s), ".2f") for s in REN_SETTINGS) + " |")
    return "\n".join(lines)


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


PREDATES_LANES = (
    "  - its rows predate lanes equal to `kind: train`: their batches were drawn with "
    "replacement and their keys and initial params derived by the table itself, with Adam. "
    "Run again, the same command draws the batches, keys and params of `kind: train` with "
    "seeds `seed`, `seed + 1`, ... (other draws, the same config)")


def k_table(rows: list[dict], dataset: str) -> str:
    """Markdown: K (tangents per step) as an axis, one line per estimator run at several K
    (arms named ``NAME`` and ``NAME-K<k>``): test error (or loss) and forward passes per step
    at each K; empty where no estimator ran at two K."""
    families: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["dataset"] != dataset or is_baseline(r) or not r.get("tangents"):
            continue
        base = re.sub(r"-K\d+$", "", r["arm"])
        families.setdefault(base, {})[int(r["tangents"])] = r
    families = {b: ks for b, ks in families.items() if len(ks) >= 2}
    if not families:
        return ""
    ks = sorted({k for f in families.values() for k in f})
    loss = any(_is_loss(r) for f in families.values() for r in f.values())
    cell = (lambda r: f"{r['test_loss_mean']:.3f} ± {r.get('test_loss_sd', 0.0):.3f}") if loss else (
        lambda r: _pm(r["test_error_mean"], r["test_error_sd"]))
    lines = ["| estimator | " + " | ".join(f"K = {k}" for k in ks) + " |",
             "|---|" + "---|" * len(ks)]
    for base, f in families.items():
        cells = [("—" if k not in f else f"{cell(f[k])} ({_fmt(f[k].get('forward_equivalents_per_step'), '.1f')})")
                 for k in ks]
        lines.append(f"| {base} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layer_table(rows: list[dict], dataset: str) -> str:
    """Markdown: per arm, the cosine of its estimate at initialisation to the exact gradient
    segment by segment (embed, each block, head; means over the cosine keys) and, for an arm
    that follows local losses, to its local target (in brackets); empty where no row has
    them (rows from before they were recorded)."""
    have = [r for r in rows if r["dataset"] == dataset and r.get("cosine_layers")]
    if not have:
        return ""
    n = max(len(r["cosine_layers"]) for r in have)
    names = ["embed", *(f"block {i}" for i in range(n - 2)), "head"]
    lines = ["| arm | " + " | ".join(names) + " |", "|---|" + "---|" * n]
    for r in have:
        local = r.get("local_cosine_layers") or [None] * len(r["cosine_layers"])
        cells = [f"{c:+.3f}" + ("" if t is None else f" ({t:+.3f})")
                 for c, t in zip(r["cosine_layers"], local)]
        lines.append(f"| {_arm(r)} | " + " | ".join(cells + ["—"] * (n - len(cells))) + " |")
    return "\n".join(lines)


LAYERS = ("Cosine at initialisation segment by segment: each arm's estimate against the exact "
          "gradient of the same batch, per embed, block and head (mean over the cosine keys), "
          "and for an arm that follows local losses against its local target "
          "(`jaxstream.grad.local_targets`) in brackets: noise and the local losses' bias, "
          "told apart layer by layer.")


K_AXIS = ("Tangents per step K as an axis: test {what} at each K (forward passes per step, "
          "counted from the compiled step, in brackets).")


EQUAL_COMPUTE = (
    "Backprop at each arm's compute: BP's own run read at the step where it had spent what the "
    "arm spent in its whole run (steps × forward passes per step, counted from the compiled "
    "steps), its last evaluation at or before that step (mean over seeds); an arm that costs "
    "more than BP's whole run is compared with BP's end (≥: BP would have had more).")


def equal_compute_table(rows: list[dict], dataset: str) -> str:
    """Markdown: for every arm with a counted cost, BP's test figure at the same compute
    (from BP's evaluations during its run); empty without a BP row with a curve."""
    mine = [r for r in rows if r["dataset"] == dataset and not is_baseline(r)]
    bp = next((r for r in mine if r["arm"] == "BP" and r.get("curve_test_error_mean")), None)
    if bp is None or not bp.get("forward_equivalents_per_step"):
        return ""
    loss = _is_loss(bp)
    curve = bp["curve_test_loss_mean" if loss else "curve_test_error_mean"]
    every = bp["eval_every"]
    unit, fmt = ("test loss", lambda v: f"{v:.3f}") if loss else (
        "test error %", lambda v: f"{100 * v:.2f}")
    lines = [(f"| arm | forward passes / step | BP steps at its compute | BP {unit} there | "
             f"arm's {unit} |"), "|---|---|---|---|---|"]
    for r in mine:
        fe = r.get("forward_equivalents_per_step")
        if r is bp or not fe:
            continue
        steps = r["steps"] * fe / bp["forward_equivalents_per_step"]
        k = min(int(steps // every), len(curve))
        at = "before its first evaluation" if k == 0 else fmt(curve[k - 1])
        more = "≥ " if steps > bp["steps"] else ""
        mean = r["test_loss_mean"] if loss else r["test_error_mean"]
        lines.append(f"| {_arm(r)} | {fe:.2f} | {more}{min(steps, bp['steps']):.0f} | {at} | "
                     f"{fmt(mean)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _run_lines(payload: dict, rows: list[dict]) -> list[str]:
    """The report's list of runs: command, machine, wall time, and whether its rows predate
    the lanes of ``kind: train``."""
    parts = []
    for run in payload.get("runs") or [payload]:  # several runs (e.g. one per data set)
        parts += [
            (f"- run: `{run.get('command', '?')}` (config `{run.get('config', '?')}`), "
            f"data sets {sorted({r['dataset'] for r in run.get('rows', rows)})}"),
            f"  - machine: {run.get('machine', '?')}",
            f"  - wall time of the run: {run.get('seconds', float('nan')):.0f} s",
        ]
        trained = [r for r in run.get("rows", rows) if not is_baseline(r)]
        if trained and all("engine" not in r for r in trained):
            parts.append(PREDATES_LANES)
    return parts


def markdown(payload: dict, plot: str | None = None, memory: dict | None = None,
             cost_plot: str | None = None) -> str:
    """The whole report as markdown (``memory``: optional memory_time rows, see
    :func:`memory_table`; ``cost_plot``: an :func:`equivalents_plot` to show)."""
    every = payload["rows"]
    rows = [r for r in every if not is_baseline(r)]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    parts = [
        "# Forward-gradient table, reproduced",
        "",
        "Written by a command from run outputs; do not edit by hand.",
        "",
        f"- report written by: `{payload.get('report_command', payload.get('command', '?'))}`",
    ]
    parts += _run_lines(payload, rows)
    parts += [
        "",
        ("Test and train error are at the end of training, mean ± sd over seeds, at the learning "
        "rate with the lowest mean final train error among the arm's sweep. Steps to target: "
        "mean over the seeds that reached the data set's target test accuracy (first evaluation "
        "at or above it). Seconds to target: those steps times the median step time of one lane "
        "alone. Peak temp: XLA's temporary buffers of one compiled training step. Cosine: "
        "estimate vs exact gradient of one batch at initialisation, mean ± sd over keys. "
        "LG-FG-W and LG-FG-A apply the model's final head, held fixed, to every block's output "
        "(a shared head); the -Ren arms give every block a head of its own, learned by the "
        "exact gradient of its local loss, as Ren et al. do. The last two columns are Ren et "
        "al.'s (ICLR 2023) published supervised MNIST test errors (%) of their MLPs in their "
        "settings S/1/1 and M/1/16 (size/patches/groups, patches per side of the image, as their "
        "released configuration names L/32/64 the run with 32 patches per side and 64 groups; "
        "in S/1/1 their LG-FG-W and LG-FG-A figures equal FG-W's and FG-A's), beside the arms "
        "that run their method only, and for the "
        "local-loss arms only in the setting whose number of groups the arm ran (an arm with "
        "16 groups: M/1/16, Ren et al.'s grouped losses; one group: S/1/1); for comparison "
        "only: different data set and models. Baselines: chance, logistic regression, and for "
        "text unigram and bigram tables, one deterministic fit each. Data sets judged by loss (the "
        "character transformer on the standard-library text corpus) report test and train "
        "cross-entropy (nats per character, mean ± sd over seeds) at the learning rate with "
        "the lowest mean final train loss, steps to a target test loss, and the token error; "
        "their ordering and hybrid checks compare test losses."),
        "",
        VERDICT_RULES.format(alpha=ALPHA, pp=100 * MARGIN_ERROR, nats=MARGIN_LOSS,
                             five=MIN_SEEDS_EQUIVALENT, three=MIN_SEEDS),
        "",
        HYBRID_WHY,
    ]
    for ds in datasets:
        r0 = next(r for r in rows if r["dataset"] == ds)
        loss = _is_loss(r0)
        target = (f"target test loss {r0['target_loss']:.2f}" if loss
                  else f"target test accuracy {100 * r0['target_accuracy']:.0f} %")
        parts += ["", f"## {ds}", "",
                  f"{r0['steps']} steps, {r0['seeds']} seeds, {target}.", ""]
        if seeds_note(rows, ds):
            parts += [seeds_note(rows, ds), ""]
        parts += [table(rows, ds), "", _edges(rows, ds), ""]
        said = designs(rows, ds)
        if said:
            parts += [said, ""]
        if baseline_table(every, ds):
            parts += ["Baselines (no training by the library; one deterministic fit):", "",
                      baseline_table(every, ds), ""]
        if k_table(rows, ds):
            parts += [K_AXIS.format(what="loss" if loss else "error %"), "", k_table(rows, ds),
                      ""]
        if equal_compute_table(rows, ds):
            parts += [EQUAL_COMPUTE, "", equal_compute_table(rows, ds), ""]
        if layer_table(rows, ds):
            parts += [LAYERS, "", layer_table(rows, ds), ""]
        judged = "test loss" if loss else "test error"
        m = family_size(rows, ds)
        parts += [(f"Paired comparisons of this table ({judged}): {m} tests, Holm-adjusted as "
                   "one family (the verdict rules above)."), "",
                  "Ordering FG-W < FG-A ≤ LG-FG-A ≈ BP:", ""]
        parts += [f"- {line}" for line in ordering(rows, ds)]
        if head_verdict(rows, ds):
            parts += ["", "Shared head against heads of their own:", ""]
            parts += [f"- {line}" for line in head_verdict(rows, ds)]
        parts += ["", "Hybrids against their ingredients:", ""]
        parts += [f"- {line}" for line in hybrid_verdict(rows, ds)]
        judgements = design_verdicts(rows, ds)
        if judgements:
            parts += ["", "Local-loss designs against one loss per block:", ""]
            parts += [f"- {line}" for line in judgements]
    if memory:
        parts += ["", "## Memory and time against backprop (deep MLP)", "", memory_table(memory)]
    if plot:
        parts += ["", f"![frontier]({os.path.basename(plot)})",
                  "", ("Final test accuracy (test loss for data sets judged by loss) against peak "
                  "temporary memory and against training time (steps × step time), one point "
                  "per arm.")]
    if cost_plot:
        parts += ["", f"![cost]({os.path.basename(cost_plot)})", "",
                  ("Test error (log scale; test loss for data sets judged by loss) during "
                   "training against its cost in forward passes: steps × the matmul FLOPs of "
                   "one compiled step over those of one forward pass of the batch (the "
                   "'forward passes / step' column, counted from what XLA runs), mean over "
                   "seeds at the picked rate; the main arms (the others: the tables).")]
    return "\n".join(parts) + "\n"


def equivalents_plot(rows: list[dict], path: str, arms: tuple[str, ...] = MAIN_ARMS) -> bool:
    """Test error (log scale; test loss for data sets judged by loss) against training cost
    in forward passes (steps × the step's matmul FLOPs over one forward pass's), mean over
    seeds at the picked rate, one line per arm of ``arms`` (every arm where the rows have
    none of them); baselines as grey lines. Rows without a counted cost are left out (said
    in the legend title). False where no row has one (nothing written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = [r for r in rows if is_baseline(r)]
    rows = [r for r in rows if not is_baseline(r)]
    if any(r["arm"] in arms for r in rows):
        rows = [r for r in rows if r["arm"] in arms]
    counted = [r for r in rows if r.get("forward_equivalents_per_step")]
    if not counted:
        return False
    styles = arm_styles(list(dict.fromkeys(r["arm"] for r in rows)))
    datasets = list(dict.fromkeys(r["dataset"] for r in counted))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for r in (x for x in counted if x["dataset"] == ds):
            loss = _is_loss(r)
            y = [v if loss else 100 * v for v in
                 (r["curve_test_loss_mean"] if loss else r["curve_test_error_mean"])]
            x = [(i + 1) * r["eval_every"] * r["forward_equivalents_per_step"]
                 for i in range(len(y))]
            ax.plot(x, y, color=styles[r["arm"]]["color"], marker=styles[r["arm"]]["marker"],
                    markevery=max(1, len(x) // 6), ms=4, lw=1.2, label=r["arm"])
        for b in (x for x in base if x["dataset"] == ds):
            ax.axhline(b["test_loss_mean"] if _is_loss(b) else 100 * b["test_error_mean"],
                       color="0.5", lw=0.8, ls=":")
            ax.annotate(b["arm"], (1.0, b["test_loss_mean"] if _is_loss(b)
                                   else 100 * b["test_error_mean"]),
                        xycoords=("axes fraction", "data"), fontsize="x-small", color="0.4",
                        ha="right", va="bottom")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # short spans: crowded
        if not any(_is_loss(r) for r in counted if r["dataset"] == ds):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("training cost (forward-pass equivalents, matmul FLOPs)")
        ax.set_ylabel("test loss (nats / char)" if any(_is_loss(r) for r in counted
                                                        if r["dataset"] == ds)
                      else "test error (%)")
        ax.set_title(ds)
        ax.grid(alpha=0.3)
    left = sorted({r["arm"] for r in rows} - {r["arm"] for r in counted})
    handles, labels = axes[0][0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    for ax in axes[0][1:]:
        seen.update(dict(zip(*reversed(ax.get_legend_handles_labels()))))
    fig.legend(list(seen.values()), list(seen.keys()), loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize="small", frameon=False,
               title="arm" + (f" (no cost counted: {', '.join(left)})" if left else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def arm_styles(arms: list[str]) -> dict[str, dict]:
    """One colour and marker per arm, the same in every panel: matplotlib's ten default
    colours for up to ten arms, else tab20's twenty; beyond those, the next marker (o, s, D,
    ^)."""
    import matplotlib

    if len(arms) <= 10:
        colours = [f"C{i}" for i in range(10)]
    else:
        colours = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab20"].colors]
    n = len(colours)
    return {a: {"color": colours[i % n], "marker": "osD^"[(i // n) % 4]}
            for i, a in enumerate(arms)}



def frontier_plot(rows: list[dict], path: str) -> None:
    """Test accuracy (or loss) vs peak temporary memory and vs training time, one point per arm
    and data set. Each arm keeps one colour and marker in every panel, named once in a legend
    beside the panels (nothing is written over the data); log axes label their decades only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    base = [r for r in rows if is_baseline(r)]
    rows = [r for r in rows if not is_baseline(r)]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    styles = arm_styles(arms)
    styles_b = ("--", ":", "-.", (0, (5, 2, 1, 2, 1, 2)))
    lines = {b: styles_b[i % len(styles_b)]
             for i, b in enumerate(dict.fromkeys(r["arm"] for r in base))}
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 3.6 * len(datasets)), squeeze=False)
    for i, ds in enumerate(datasets):
        rs = [r for r in rows if r["dataset"] == ds]
        for j, (xkey, label) in enumerate((("mem", "peak temporary memory (MiB)"),
                                           ("time", "training time (s, steps × step time)"))):
            ax = axes[i, j]
            for r in rs:
                if xkey == "mem" and r.get("peak_temp_bytes") is None:
                    continue  # not one compiled program: no figure to place
                x = (r["peak_temp_bytes"] / 2**20 if xkey == "mem"
                     else r["steps"] * r["step_ms"] / 1e3)
                mean, sd = _m(r)
                y, err = (mean, sd) if _is_loss(r) else (100 * (1 - mean), 100 * sd)
                ax.errorbar(x, y, yerr=err, fmt=styles[r["arm"]]["marker"], capsize=3,
                            color=styles[r["arm"]]["color"], label=r["arm"], alpha=0.85)
            y0, y1 = ax.get_ylim()  # baselines inside the arms' range (the rest: the table)
            for b in (r for r in base if r["dataset"] == ds):
                mean = b["test_loss_mean"] if _is_loss(b) else 100 * (1 - b["test_error_mean"])
                if y0 <= mean <= y1:
                    ax.axhline(mean, color="0.4", lw=1, ls=lines[b["arm"]])
            ax.set_ylim(y0, y1)
            ax.set_xscale("log")
            lo, hi = ax.get_xlim()  # 1-2-5 ticks where they fit, decades on wider axes
            wide = math.log10(hi / lo) > 2
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(label)
            ax.set_ylabel("test loss (nats / char, lower is better)" if any(map(_is_loss, rs))
                          else "test accuracy (%)")
            ax.set_title(ds)
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], ls="", marker=styles[a]["marker"], color=styles[a]["color"],
                          label=a) for a in arms]
    handles += [plt.Line2D([], [], color="0.4", lw=1, ls=ls, label=f"{b} (baseline)")
                for b, ls in lines.items()]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small",
               title="arm", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
