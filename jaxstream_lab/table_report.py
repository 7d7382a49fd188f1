"""Report of ``kind: forward_table``: the markdown tables (with Ren et al.'s published MNIST rows
beside them) and the report that puts them together with the verdicts
(:mod:`.table_verdicts`), the cost tables (:mod:`.table_cost`) and the plots
(:mod:`.table_plots`).

Everything here is computed from the rows a run wrote; nothing is typed in by hand except the
published figures of Ren et al. (2023), which are quoted as such (:mod:`.table_rows`).
"""

from __future__ import annotations

import os
import re

from jaxstream_lab import budget_report
from jaxstream_lab.stability import flagged
from jaxstream_lab.table_config import TableReport
from jaxstream_lab.table_cost import memory_table
from jaxstream_lab.table_rows import (
    REN_COLUMNS,
    REN_ORDERING,
    REN_SETTINGS,
    _fmt,
    _is_loss,
    _pm,
    is_baseline,
    markdown_table,
    ren_figures,
    report_roles,
)
from jaxstream_lab.table_verdicts import (
    ALPHA,
    HYBRID_WHY,
    MARGIN_ERROR,
    MARGIN_LOSS,
    MIN_SEEDS,
    MIN_SEEDS_EQUIVALENT,
    VERDICT_RULES,
    design_verdicts,
    family_size,
    head_verdict,
    hybrid_verdict,
    ordering,
    seeds_note,
)


def baseline_table(rows: list[dict], dataset: str) -> str:
    """The data set's baseline rows as a markdown table ("" when it has none)."""
    mine = [r for r in rows if r["dataset"] == dataset and is_baseline(r)]
    if not mine:
        return ""
    loss = _is_loss(mine[0])
    heads = (("test loss", "train loss", "test token error %") if loss else
             ("test error %", "train error %", "test loss"))
    lines = []
    for r in mine:
        figs = ((f"{r['test_loss_mean']:.3f}", f"{r['train_loss_mean']:.3f}",
                 f"{100 * r['test_error_mean']:.2f}") if loss else
                (f"{100 * r['test_error_mean']:.2f}", f"{100 * r['train_error_mean']:.2f}",
                 f"{r['test_loss_mean']:.3f}"))
        lines.append({"baseline": r["arm"], **dict(zip(heads, figs)), "how": r.get("how", "")})
    return markdown_table(lines)


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
    return ("Local losses of the arms with heads of their own: " + "; ".join(said) + ".") if said else ""


def loss_table(rows: list[dict], dataset: str) -> str:
    """A markdown table for a ``metric: loss`` data set (no published rows beside it)."""
    return markdown_table([{
        "arm": _arm(r), "lr": _lr(r),
        "test loss": f"{r['test_loss_mean']:.3f} ± {r.get('test_loss_sd', 0.0):.3f}",
        "train loss": f"{r['train_loss_mean']:.3f} ± {r.get('train_loss_sd', 0.0):.3f}",
        "test token error %": _pm(r["test_error_mean"], r["test_error_sd"]),
        "steps to target loss (seeds)": _steps(r), **_common(r),
    } for r in rows if r["dataset"] == dataset])


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


def _steps(r: dict) -> str:
    """Mean steps to the target, and how many seeds reached it."""
    return f"{_fmt(r['steps_to_target_mean'])} ({r['seeds_reaching_target']}/{r['seeds']})"


def _common(r: dict) -> dict[str, str]:
    """The cells every arm's line has after its figures: time to target, memory, step time,
    K and forward passes per step (— where a row predates them), cosine and error at init."""
    return {"s to target": _fmt(r["seconds_to_target"], ".2f"), "peak temp MiB": _mib(r),
            "ms / step": f"{r['step_ms']:.2f}", "K": _fmt(r.get("tangents"), "d"),
            "forward passes / step": _fmt(r.get("forward_equivalents_per_step"), ".2f"),
            "cosine at init": _cos(r),
            "rel. sq. error at init": _fmt(r.get("relative_mse"), ".3g")}


def table(rows: list[dict], dataset: str, report: TableReport) -> str:
    """A markdown table for one data set, Ren et al.'s MNIST figures beside the arms that run
    their methods (``report.methods``)."""
    if any(_is_loss(r) for r in rows if r["dataset"] == dataset):
        return loss_table(rows, dataset)
    return markdown_table([{
        "arm": _arm(r), "lr": _lr(r),
        "test error %": _pm(r["test_error_mean"], r["test_error_sd"]),
        "train error %": _pm(r["train_error_mean"], r.get("train_error_sd", 0.0)),
        "test loss": f"{r.get('test_loss_mean', float('nan')):.3f}",
        "steps to target (seeds)": _steps(r), **_common(r),
        **{f"Ren MNIST {s}": _fmt(ren_figures(r, report).get(s), ".2f") for s in REN_SETTINGS},
    } for r in rows if r["dataset"] == dataset])


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
    at = lambda r: f"{cell(r)} ({_fmt(r.get('forward_equivalents_per_step'), '.1f')})"
    return markdown_table([{"estimator": base,
                            **{f"K = {k}": at(f[k]) if k in f else "—" for k in ks}}
                           for base, f in families.items()])


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
    lines = []
    for r in have:
        local = r.get("local_cosine_layers") or [None] * len(r["cosine_layers"])
        cells = [f"{c:+.3f}" + ("" if t is None else f" ({t:+.3f})")
                 for c, t in zip(r["cosine_layers"], local)]
        lines.append({"arm": _arm(r), **dict(zip(names, cells + ["—"] * (n - len(cells))))})
    return markdown_table(lines)


LAYERS = ("Cosine at initialisation segment by segment: each arm's estimate against the exact "
          "gradient of the same batch, per embed, block and head (mean over the cosine keys), "
          "and for an arm that follows local losses against its local target "
          "(`jaxstream.grad.local_targets`) in brackets: noise and the local losses' bias, "
          "told apart layer by layer.")


K_AXIS = ("Tangents per step K as an axis: test {what} at each K (forward passes per step, "
          "counted from the compiled step, in brackets).")


EQUAL_COMPUTE = (
    "Backprop at each arm's compute: {ref}'s own run read at the step where it had spent what "
    "the arm spent in its whole run (steps × forward passes per step, counted from the compiled "
    "steps), its last evaluation at or before that step (mean over seeds); an arm that costs "
    "more than {ref}'s whole run is compared with {ref}'s end (≥: {ref} would have had more).")


def equal_compute_table(rows: list[dict], dataset: str, report: TableReport) -> str:
    """Markdown: for every arm with a counted cost, the exact reference's (``report.reference``,
    backprop) test figure at the same compute (from its evaluations during its run); empty
    without a reference row with a curve."""
    mine = [r for r in rows if r["dataset"] == dataset and not is_baseline(r)]
    bp = next((r for r in mine if r["arm"] == report.reference
               and r.get("curve_test_error_mean")), None)
    if bp is None or not bp.get("forward_equivalents_per_step"):
        return ""
    loss = _is_loss(bp)
    curve = bp["curve_test_loss_mean" if loss else "curve_test_error_mean"]
    every = bp["eval_every"]
    unit, fmt = ("test loss", lambda v: f"{v:.3f}") if loss else (
        "test error %", lambda v: f"{100 * v:.2f}")
    lines = []
    for r in mine:
        fe = r.get("forward_equivalents_per_step")
        if r is bp or not fe:
            continue
        steps = r["steps"] * fe / bp["forward_equivalents_per_step"]
        k = min(int(steps // every), len(curve))
        at = "before its first evaluation" if k == 0 else fmt(curve[k - 1])
        more = "≥ " if steps > bp["steps"] else ""
        mean = r["test_loss_mean"] if loss else r["test_error_mean"]
        lines.append({"arm": _arm(r), "forward passes / step": f"{fe:.2f}",
                      f"{bp['arm']} steps at its compute": f"{more}{min(steps, bp['steps']):.0f}",
                      f"{bp['arm']} {unit} there": at, f"arm's {unit}": fmt(mean)})
    return markdown_table(lines) if lines else ""


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


HOW_READ = (
    "Test and train error are at the end of training, mean ± sd over seeds, at the learning "
    "rate with the lowest mean final train error among the arm's sweep{validation}. Steps to "
    "target: mean over the seeds that reached the data set's target test accuracy (first "
    "evaluation at or above it). Seconds to target: those steps times the median step time of "
    "one lane alone. Peak temp: XLA's temporary buffers of one compiled training step. Cosine: "
    "estimate vs exact gradient of one batch at initialisation, mean ± sd over keys. {about}"
    "{published} Baselines: chance, logistic regression, and for text unigram and bigram "
    "tables, one deterministic fit each. Data sets judged by loss (the character transformer "
    "on the standard-library text corpus) report test and train cross-entropy (nats per "
    "character, mean ± sd over seeds) at the learning rate with the lowest mean final train "
    "loss, steps to a target test loss, and the token error; their ordering and hybrid checks "
    "compare test losses.")
VALIDATION = (" (on the data sets that hold out a validation split, the lowest mean final "
              "validation error: the arms train on the rest of the training set)")


def _preamble(payload: dict, rows: list[dict], roles: dict[str, TableReport]) -> list[str]:
    """The report's head: its command and runs, how to read the tables, the verdict rules."""
    about = " ".join(dict.fromkeys(t.about for t in roles.values() if t.about))
    picked = any(r.get("picked_on") == "validation" for r in rows)
    return [
        "# Forward-gradient table, reproduced", "",
        "Written by a command from run outputs; do not edit by hand.", "",
        f"- report written by: `{payload.get('report_command', payload.get('command', '?'))}`",
        *_run_lines(payload, rows), "",
        HOW_READ.format(validation=VALIDATION if picked else "",
                        about=about + " " if about else "", published=REN_COLUMNS), "",
        VERDICT_RULES.format(alpha=ALPHA, pp=100 * MARGIN_ERROR, nats=MARGIN_LOSS,
                             five=MIN_SEEDS_EQUIVALENT, three=MIN_SEEDS), "",
        HYBRID_WHY,
    ]


def _tables(every: list[dict], rows: list[dict], ds: str, report: TableReport) -> list[str]:
    """A data set's tables: the arms, their sweeps and stability, baselines, K, equal compute
    and the layer-by-layer cosines."""
    r0 = next(r for r in rows if r["dataset"] == ds)
    loss = _is_loss(r0)
    target = (f"target test loss {r0['target_loss']:.2f}" if loss
              else f"target test accuracy {100 * r0['target_accuracy']:.0f} %")
    parts = ["", f"## {ds}", "", f"{r0['steps']} steps, {r0['seeds']} seeds, {target}.", ""]
    if seeds_note(rows, ds):
        parts += [seeds_note(rows, ds), ""]
    parts += [table(rows, ds, report), "", _edges(rows, ds), ""]
    for said in (flagged(every, ds), designs(rows, ds)):
        if said:
            parts += [said, ""]
    optional = (("Baselines (no training by the library; one deterministic fit):",
                 baseline_table(every, ds)),
                (K_AXIS.format(what="loss" if loss else "error %"), k_table(rows, ds)),
                (EQUAL_COMPUTE.format(ref=report.reference), equal_compute_table(rows, ds, report)),
                (LAYERS, layer_table(rows, ds)))
    for head, body in optional:
        if body:
            parts += [head, "", body, ""]
    return parts


def _verdicts(rows: list[dict], ds: str, report: TableReport) -> list[str]:
    """A data set's paired comparisons: the published ordering, the shared head, the hybrids,
    the local-loss designs, and the equal-budget comparison."""
    judged = "test loss" if _is_loss(next(r for r in rows if r["dataset"] == ds)) else "test error"
    parts = [(f"Paired comparisons of this table ({judged}): {family_size(rows, ds, report)} "
              "tests, Holm-adjusted as one family (the verdict rules above)."), "",
             f"Ordering {REN_ORDERING['claim']}:", ""]
    parts += [f"- {line}" for line in ordering(rows, ds, report)]
    for head, lines in (("Shared head against heads of their own:", head_verdict(rows, ds, report)),
                        ("Hybrids against their ingredients:", hybrid_verdict(rows, ds, report)),
                        ("Local-loss designs against one loss per block:",
                         design_verdicts(rows, ds, report))):
        if lines:
            parts += ["", head, ""] + [f"- {line}" for line in lines]
    budget = budget_report.markdown(rows, ds)
    return parts + (["", budget] if budget else [])


def markdown(payload: dict, plot: str | None = None, memory: dict | None = None,
             cost_plot: str | None = None) -> str:
    """The whole report as markdown (``memory``: optional memory_time rows, see
    :func:`memory_table`; ``cost_plot``: an :func:`equivalents_plot` to show)."""
    every = payload["rows"]
    rows = [r for r in every if not is_baseline(r)]
    roles = report_roles(payload)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    parts = _preamble(payload, rows, {ds: roles[ds] for ds in datasets})
    for ds in datasets:
        parts += _tables(every, rows, ds, roles[ds]) + _verdicts(rows, ds, roles[ds])
    if memory:
        parts += ["", "## Memory and time against backprop (deep MLP)", "", memory_table(memory)]
    if plot:
        parts += ["", f"![frontier]({os.path.basename(plot)})", "", FRONTIER]
    if cost_plot:
        parts += ["", f"![cost]({os.path.basename(cost_plot)})", "", COST]
    return "\n".join(parts) + "\n"


FRONTIER = ("Final test accuracy (test loss for data sets judged by loss) against peak temporary "
            "memory and against training time (steps × step time), one point per arm.")
COST = ("Test error (log scale; test loss for data sets judged by loss) during training against "
        "its cost in forward passes: steps × the matmul FLOPs of one compiled step over those of "
        "one forward pass of the batch (the 'forward passes / step' column, counted from what "
        "XLA runs), mean over seeds at the picked rate; the main arms (the others: the tables).")
