"""The forward table's verdicts: paired by-seed comparisons of the judged figure with their 95 %
intervals, Holm-adjusted tests and equivalence tests (:mod:`jaxstream_lab.verdicts`), and the
sentences the report prints from them (ordering, shared head, hybrids, local-loss designs)."""

from __future__ import annotations

from jaxstream_lab import verdicts
from jaxstream_lab.table_config import TableReport
from jaxstream_lab.table_rows import REN_ORDERING, _by, _d, _is_loss, _m, _show, is_baseline

ALPHA = verdicts.ALPHA  # level of every test
MIN_SEEDS = verdicts.MIN_SEEDS_TEST  # paired seeds any test needs
MIN_SEEDS_EQUIVALENT = verdicts.MIN_SEEDS_EQUIVALENT  # paired seeds an "≈" needs
MARGIN_ERROR = 0.005  # equivalence margin of test error: 0.5 percentage points
MARGIN_LOSS = 0.01  # equivalence margin of test loss: 0.01 nats per character
#: A paired comparison's words, by :func:`jaxstream_lab.verdicts.verdict` of ``a − b``.
VERDICT = {"better": "better than", "worse": "worse than", "≈": "≈",
           "inconclusive": "inconclusive against"}
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


def _playing(r: dict, report: TableReport) -> dict[str, str]:
    """Published method -> the arm that plays it on this data set: the first of
    ``report.methods[method]`` that ran (the first listed where none ran)."""
    return {m: next((a for a in arms if a in r), arms[0])
            for m, arms in report.methods.items() if arms}


def _ordering_arms(r: dict, report: TableReport) -> tuple[dict[str, str], str]:
    """Each method of the published ordering -> the arm that plays it (the method's own name
    where none does), in the claim's order, and what is missing ("" if nothing): the methods
    no arm plays (``report.methods``), the arms that play one and did not run here."""
    plays = _playing(r, report)
    methods = list(dict.fromkeys(m for rel in REN_ORDERING["relations"]
                                 for m in (rel["a"], rel["b"])))
    unplayed = [m for m in methods if m not in plays]
    absent = [plays[m] for m in methods if m in plays and plays[m] not in r]
    said = ([f"no arm plays {unplayed} (the table's report.methods)"] if unplayed else []) + (
        [f"arms {absent} missing"] if absent else [])
    return {m: plays.get(m, m) for m in methods}, "; ".join(said)


def _best_forward(r: dict, report: TableReport) -> dict | None:
    fwd = [r[a] for a in report.forward if a in r]
    return min(fwd, key=lambda x: _m(x)[0]) if fwd else None


def _hybrids(r: dict, report: TableReport) -> list[str]:
    return [n for n in r if n in report.hybrids]


def _designs(r: dict, report: TableReport) -> list[str]:
    return [n for n in r if n in report.designs]


def _pairs(rows: list[dict], dataset: str, report: TableReport) -> list[tuple[str, str]]:
    """Every paired comparison the report makes on one data set, as ``(a, b)`` arm names."""
    r = _by(rows, dataset)
    pairs = []
    plays, missing = _ordering_arms(r, report)
    if not missing:
        pairs += [(plays[x["a"]], plays[x["b"]]) for x in REN_ORDERING["relations"]]
    if report.shared_head and all(a in r for a in report.shared_head):
        pairs.append(tuple(report.shared_head))  # shared head against heads of their own
    best, sub = _best_forward(r, report), report.exact_subset
    if sub in r and best:
        for name in _hybrids(r, report):
            pairs += [(name, sub), (name, best["arm"])]
    if report.base_design in r:
        pairs += [(n, report.base_design) for n in _designs(r, report)]
    return list(dict.fromkeys(pairs))


def comparisons(rows: list[dict], dataset: str,
                report: TableReport) -> dict[tuple[str, str], dict]:
    """Every paired comparison of the data set's table (:func:`paired`), Holm-adjusted as one
    family (:func:`jaxstream_lab.verdicts.family`: ``p_holm``, ``p_tost_holm``, ``m``,
    ``verdict``), by ``(a, b)``."""
    r = _by(rows, dataset)
    pairs = _pairs(rows, dataset, report)
    return dict(zip(pairs, verdicts.family([paired(r[a], r[b]) for a, b in pairs])))


def family_size(rows: list[dict], dataset: str, report: TableReport) -> int:
    """How many paired tests the data set's table makes (Holm's m)."""
    return sum("p" in t for t in comparisons(rows, dataset, report).values())


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


def ordering(rows: list[dict], dataset: str, report: TableReport) -> list[str]:
    """Check Ren et al.'s claimed ordering of their methods (``published.json``: FG-W < FG-A ≤
    LG-FG-A ≈ BP, in test error, or test loss for ``metric: loss``) on the arms that play them
    (``report.methods``) on one data set, plus the claimed best and worst of them (by means,
    untested); one line per relation, each answered yes / no / inconclusive from the verdict
    of its paired comparison (:func:`comparisons`)."""
    r = _by(rows, dataset)
    plays, missing = _ordering_arms(r, report)
    if missing:
        return [f"(ordering not checked: {missing})"]
    need = list(plays.values())
    loss = _is_loss(r[need[-1]])
    tests = comparisons(rows, dataset, report)
    out = []
    for rel in REN_ORDERING["relations"]:  # answered by the verdict (inconclusive: inconclusive)
        a, b = plays[rel["a"]], plays[rel["b"]]
        t = tests[(a, b)]
        answer = ("yes" if t["verdict"] in rel["yes"] else
                  "no" if t["verdict"] in rel["no"] else "inconclusive")
        out.append(f"{rel['said'].format(a=a, b=b)}: {answer} ({_stat(t, loss)})")
    means = {a: _m(r[a])[0] for a in need}
    best, worst = min(means, key=means.get), max(means, key=means.get)
    said_best, said_worst = plays[REN_ORDERING["best"]], plays[REN_ORDERING["worst"]]
    these = {2: "two", 3: "three", 4: "four", 5: "five"}.get(len(need), str(len(need)))
    out.append(f"{said_best} best and {said_worst} worst of these {these}: "
               f"{'yes' if best == said_best and worst == said_worst else 'no'}"
               f" (best {best}, worst {worst}; means, not a test)")
    return out


def head_verdict(rows: list[dict], dataset: str, report: TableReport) -> list[str]:
    """An arm with the model's final head shared by every block against the same design with a
    head of its own per block, as Ren et al. (``report.shared_head``), paired by seed; []
    without both arms."""
    r = _by(rows, dataset)
    if not report.shared_head or any(a not in r for a in report.shared_head):
        return []
    shared, own = report.shared_head
    loss = _is_loss(r[own])
    t = comparisons(rows, dataset, report)[(shared, own)]
    return [(f"{shared} (shared head) {_show(r[shared])} — {VERDICT[t['verdict']]} "
            f"{own} (heads of their own) {_show(r[own])} ({_stat(t, loss)})")]


HYBRID_WHY = ("Whether a hybrid can beat both its ingredients at this scale: "
              "docs/hybrid_variance.md — the hybrids' variance model, checked against Monte Carlo "
              "of these estimators, and its answer at equal compute (where the exact subset alone "
              "covers the batch, and what correlation a forward part would need below that).")


def hybrid_verdict(rows: list[dict], dataset: str, report: TableReport) -> list[str]:
    """Each hybrid (``report.hybrids``) against both its ingredients, the exact subset
    (``report.exact_subset``) and the best forward arm (of ``report.forward``, by mean), from
    the verdicts of the paired comparisons (:func:`comparisons`): BEATS BOTH where better than
    both, does not beat both where worse than or ≈ either, else inconclusive; [] where no
    hybrid ran."""
    r = _by(rows, dataset)
    best_fwd = _best_forward(r, report)
    if not _hybrids(r, report):
        return []
    if report.exact_subset not in r or not best_fwd:
        return [(f"(verdict not computed: the exact subset ({report.exact_subset or 'none'}) "
                f"or the forward arms ({', '.join(report.forward) or 'none'}) did not run)")]
    sub = r[report.exact_subset]
    loss = _is_loss(sub)
    tests = comparisons(rows, dataset, report)
    out = [(f"ingredients: {sub['arm']} {_show(sub)}, best forward arm {best_fwd['arm']} "
           f"{_show(best_fwd)}")]
    for name in _hybrids(r, report):
        h = r[name]
        said, words = [], []
        for other in (sub, best_fwd):
            t = tests[(name, other["arm"])]
            words.append(t["verdict"])
            said.append(f"{VERDICT[t['verdict']]} {other['arm']} ({_stat(t, loss)})")
        end = ("BEATS BOTH" if words == ["better", "better"] else
               "does not beat both" if {"worse", "≈"} & set(words) else "inconclusive")
        out.append(f"{name}: {_show(h)} — {'; '.join(said)} → {end}")
    return out


def design_verdicts(rows: list[dict], dataset: str, report: TableReport) -> list[str]:
    """Each other local-loss design (``report.designs``: groups, patch groups, cells, the
    feature aggregator) against ``report.base_design`` (one loss per block), from the
    verdicts of the paired comparisons (:func:`comparisons`); [] where the data set has no
    such arm."""
    r = _by(rows, dataset)
    base = report.base_design
    others = [r[name] for name in _designs(r, report)]
    if base not in r or not others:
        return []
    loss = _is_loss(r[base])
    tests = comparisons(rows, dataset, report)
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
