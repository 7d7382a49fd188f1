"""The stability rule of a learning-rate pick: a pick beside a rate that blew up on some seed
sits one step from divergence, and the report says so.

Rule (stated in the report): a seed *diverged* at a rate when its final train loss is not
finite or is above log C, the loss of a uniform prediction over the C classes (tokens, for
text): where an untrained model starts, so the seed ended worse than it began. A row is
flagged when some seed diverged at its picked rate, or at the next larger rate of its sweep (a
rate one step above the pick blows up). Flagged picks are kept, not replaced: the flag is the
warning, and the row's figures are those of the rate picked on held-out data. log C comes from
the rows (``uniform_loss``) or, for rows written before they carried it, from the data set's
``chance`` baseline row; without either only a non-finite loss counts.
"""

from __future__ import annotations

import math


def uniform_loss(rows: list[dict], dataset: str) -> float | None:
    """log C of the data set: a row's ``uniform_loss``, else its ``chance`` baseline row's loss
    (a uniform prediction), else None."""
    mine = [r for r in rows if r["dataset"] == dataset]
    for r in mine:
        if r.get("uniform_loss") is not None:
            return float(r["uniform_loss"])
    for r in mine:
        if r.get("kind") == "baseline" and r["arm"] == "chance":
            return float(r["train_loss_mean"])
    return None


def diverged(losses: list[float], bar: float | None) -> bool:
    """Whether some seed's final train loss is not finite or above ``bar`` (None: no bar)."""
    return any(not math.isfinite(v) or (bar is not None and v > bar) for v in losses)


def stability(row: dict, bar: float | None) -> str | None:
    """``"picked"`` when a seed diverged at the row's picked rate, ``"next"`` when one did at the
    next larger rate of its sweep, None when neither (or the row lacks per-seed losses)."""
    losses, lrs = row.get("train_loss_by_lr_seed"), [float(x) for x in row.get("lrs") or []]
    if not losses or len(losses) != len(lrs) or row.get("lr") not in lrs:
        return None
    i = lrs.index(row["lr"])
    if diverged(losses[i], bar):
        return "picked"
    if i + 1 < len(lrs) and diverged(losses[i + 1], bar):
        return "next"
    return None


def flagged(rows: list[dict], dataset: str) -> str:
    """The report's sentence on the data set's flagged picks (empty where the table lacks
    per-seed losses)."""
    bar = uniform_loss(rows, dataset)
    mine = [r for r in rows if r["dataset"] == dataset and r.get("kind") != "baseline"
            and r.get("train_loss_by_lr_seed")]
    if not mine:
        return ""
    flags = {r["arm"]: stability(r, bar) for r in mine}
    what = (f"a final train loss not finite or above log C = {bar:.3f}, a uniform prediction's"
            if bar is not None else "a final train loss that is not finite")
    picked = [a for a, f in flags.items() if f == "picked"]
    near = [a for a, f in flags.items() if f == "next"]
    if not picked and not near:
        return (f"Stability: no seed diverged ({what}) at any picked rate or at the next larger "
                f"rate of its sweep ({len(mine)} arms).")
    said = f"Stability (a seed diverged: {what}): "
    if near:
        said += (f"**{len(near)} picks sit one rate below a rate where some seed diverged**: "
                 f"{', '.join(near)}. ")
    if picked:
        said += f"**some seed diverged at the picked rate itself**: {', '.join(picked)}. "
    return said + "Their picks are kept (flagged, not replaced)."
