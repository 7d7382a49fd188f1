"""Summaries of a train run's metrics: per-arm figures, steps/seconds to a target accuracy,
the best arm of each estimator family, and a printable comparison table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def arm_records(records: Sequence[dict], arm: str) -> list[dict]:
    """Records of ``arm`` in step order."""
    return sorted((r for r in records if r.get("arm") == arm), key=lambda r: r["step"])


def first_crossing(records: Sequence[dict], key: str, target: float) -> dict | None:
    """The first record whose ``key`` reaches ``target`` (>=), or None."""
    for r in records:
        if r.get(key) is not None and r[key] >= target:
            return r
    return None


def summarize_arm(records: Sequence[dict], target: float) -> dict[str, Any]:
    """Figures of one arm's records (in step order)."""
    steps = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("test_accuracy") is not None]
    cos = [r["cosine"] for r in records if r.get("cosine") is not None]
    times = [r["step_time"] for r in steps if r.get("step_time") is not None]
    hit = first_crossing(evals, "test_accuracy", target)
    last_losses = [r["loss"] for r in steps[-10:]]
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "final_loss": statistics.fmean(last_losses) if last_losses else None,
        "final_test_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "final_test_loss": evals[-1].get("test_loss") if evals else None,
        "final_train_accuracy": evals[-1].get("train_accuracy") if evals else None,
        "best_test_accuracy": max(r["test_accuracy"] for r in evals) if evals else None,
        "steps_to_target": hit["step"] if hit else None,
        "seconds_to_target": hit.get("train_time") if hit else None,
        "train_time": steps[-1].get("train_time") if steps else None,
        "ms_per_step": 1e3 * statistics.median(times) if times else None,
        "mean_cosine": statistics.fmean(cos) if cos else None,
        "lost_steps": [r["step"] for r in records if r.get("lost")],
    }


def best_of(arms: dict[str, dict], names: Sequence[str]) -> str | None:
    """The arm that reaches the target in the fewest steps (ties: fewer seconds); if none
    reaches it, the one with the highest final test accuracy."""
    if not names:
        return None
    reached = [n for n in names if arms[n]["steps_to_target"] is not None]
    if reached:
        return min(reached, key=lambda n: (arms[n]["steps_to_target"],
                                           arms[n]["seconds_to_target"] or 0.0))
    return max(names, key=lambda n: arms[n]["final_test_accuracy"] or 0.0)


def compare_families(arms: dict[str, dict], families: dict[str, str]) -> dict[str, Any]:
    """``{"backprop": ..., "best_forward": ..., "best_hybrid": ...}``: arm name and its figures."""
    out: dict[str, Any] = {}
    for fam, key in (("backprop", "backprop"), ("forward", "best_forward"),
                     ("hybrid", "best_hybrid")):
        name = best_of(arms, [n for n in arms if families[n] == fam])
        if name is not None:
            a = arms[name]
            out[key] = {"arm": name, "reached_target": a["steps_to_target"] is not None,
                        "steps_to_target": a["steps_to_target"],
                        "seconds_to_target": a["seconds_to_target"],
                        "final_test_accuracy": a["final_test_accuracy"]}
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(arms: dict[str, dict], target: float) -> str:
    """A fixed-width comparison table of the arms."""
    head = (f"{'arm':<18} {'estimator':<30} {'lr':>8} {'loss10':>7} {'test acc':>8} "
            f"{'steps>=' + format(target, '.0%'):>10} {'s>=' + format(target, '.0%'):>8} "
            f"{'ms/step':>8} {'cosine':>7}")
    lines = [head, "-" * len(head)]
    for name, a in arms.items():
        lines.append(
            f"{name:<18} {a.get('estimator', ''):<30} {_fmt(a.get('lr'), '.2g'):>8} "
            f"{_fmt(a['final_loss'], '.3f'):>7} {_fmt(a['final_test_accuracy'], '.3f'):>8} "
            f"{_fmt(a['steps_to_target'], 'd'):>10} {_fmt(a['seconds_to_target'], '.2f'):>8} "
            f"{_fmt(a['ms_per_step'], '.2f'):>8} {_fmt(a['mean_cosine'], '.3f'):>7}"
        )
    lines.append("loss10: mean batch loss of the last 10 steps; test acc: the last evaluation")
    return "\n".join(lines)
