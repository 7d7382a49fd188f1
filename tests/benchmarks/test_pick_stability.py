"""The stability rule of the forward table's picks: a seed that ends worse than a uniform
prediction (or not finite) at the picked rate or the next larger one flags the row."""

from __future__ import annotations

import math

from jaxstream_lab.stability import flagged, stability, uniform_loss

LOG10 = math.log(10)


def _row(arm: str, lr: float, losses: list[list[float]], lrs=(1e-3, 3e-3, 1e-2)) -> dict:
    return {"dataset": "d", "arm": arm, "lr": lr, "lrs": list(lrs),
            "train_loss_by_lr_seed": losses}


def test_a_diverged_seed_above_the_pick_flags_it():
    calm = [0.3, 0.31, 0.29]
    rows = [{"dataset": "d", "arm": "chance", "kind": "baseline", "train_loss_mean": LOG10},
            _row("ok", 3e-3, [calm, calm, calm]),
            _row("near", 3e-3, [calm, calm, [0.3, 2.5, 0.3]]),      # 2.5 > log 10
            _row("nan", 1e-3, [calm, [0.3, float("nan"), 0.3], calm]),
            _row("self", 3e-3, [calm, [0.3, math.inf, 0.3], calm]),
            _row("top", 1e-2, [calm, [9.0] * 3, calm])]              # no larger rate tried
    bar = uniform_loss(rows, "d")
    assert bar == LOG10
    # a row's own log C wins over the baseline's (text has no chance row)
    assert uniform_loss([{**rows[1], "uniform_loss": 4.5}], "d") == 4.5
    assert [stability(r, bar) for r in rows[1:]] == [None, "next", "next", "picked", None]
    # a loss just under the bar is not a divergence; without a baseline only non-finite counts
    assert stability(_row("under", 3e-3, [calm, calm, [LOG10 - 1e-6] * 3]), bar) is None
    assert stability(rows[2], None) is None and stability(rows[3], None) == "next"
    said = flagged(rows, "d")
    assert "2 picks sit one rate below" in said and "near, nan" in said
    assert "at the picked rate itself**: self" in said


def test_rows_without_per_seed_losses_are_not_judged():
    assert stability({"dataset": "d", "arm": "a", "lr": 1e-3, "lrs": [1e-3]}, 1.0) is None
    assert flagged([{"dataset": "d", "arm": "a", "lr": 1e-3}], "d") == ""
    calm = [[0.1, 0.1]] * 2
    said = flagged([_row("a", 1e-3, calm, lrs=(1e-3, 1e-2))], "d")
    assert said.startswith("Stability: no seed diverged") and "not finite" in said
