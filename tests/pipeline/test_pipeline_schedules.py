"""Schedule tables: validation, metrics, generators, rendering (NumPy only)."""

import numpy as np
import pytest

from jaxstream.pipeline import (
    FBW,
    F,
    OpCosts,
    Schedule,
    ScheduleError,
    complete,
    coverage,
    delayed,
    fill_ratio,
    gpipe_backprop,
    gpipe_forward,
    gpipe_idle_fraction,
    groups,
    groups_nested,
    idle_fraction,
    make_schedule,
    makespan,
    one_f_one_b,
    peak_stash,
    render_png,
    render_text,
    summary,
    truncated,
    validate,
    weighted_makespan,
)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 16, 32])
def test_forward_only_idle_fraction_formula(m, n):
    s = gpipe_forward(m, n)
    validate(s)
    assert makespan(s) == n + m - 1
    assert idle_fraction(s) == pytest.approx((m - 1) / (n + m - 1))
    assert idle_fraction(s) == pytest.approx(gpipe_idle_fraction(m, n))


def _fwd_rows(m, n):
    s = gpipe_forward(m, n)
    return [[(("F", int(s.micro[t, st])) if s.kind[t, st] else None) for st in range(m)]
            for t in range(s.num_ticks)]


def test_rejects_forward_out_of_order():
    rows = _fwd_rows(2, 2)
    rows[1][1], rows[0][1] = None, ("F", 0)  # F_0 at stage 1 on the same tick as at stage 0
    with pytest.raises(ScheduleError, match=r"F_0 runs before its input exists.*stage 0"):
        validate(Schedule.from_ops(2, 2, rows))


def test_rejects_missing_and_repeated_forward():
    rows = _fwd_rows(2, 2)
    rows[2][1] = None
    with pytest.raises(ScheduleError, match="micro-batch 1 has no F"):
        validate(Schedule.from_ops(2, 2, rows))
    rows = _fwd_rows(2, 2) + [[None, ("F", 1)]]
    with pytest.raises(ScheduleError, match="F_1 runs twice"):
        validate(Schedule.from_ops(2, 2, rows))


def test_rejects_backward_before_its_cotangent():
    rows = _fwd_rows(2, 2) + [[None, None], [None, ("BW", 0)]]
    rows[3][0] = ("BW", 0)  # stage 0 runs before stage 1 sent the cotangent (tick 4)
    with pytest.raises(ScheduleError, match=r"needs the cotangent from B_0 at stage 1.*tick 4"):
        validate(Schedule.from_ops(2, 2, rows))
    rows = _fwd_rows(2, 2) + [[("BW", 1), None]]  # chain never started at stage 1
    with pytest.raises(ScheduleError, match="which never runs"):
        validate(Schedule.from_ops(2, 2, rows))


def test_rejects_last_stage_backward_before_loss():
    rows = [[("F", 0), ("BW", 0)], [None, ("F", 0)]]
    with pytest.raises(ScheduleError, match="needs the loss of F_0"):
        validate(Schedule.from_ops(2, 1, rows))


def test_rejects_weight_before_cotangent_and_fbw_off_last_stage():
    rows = _fwd_rows(2, 1) + [[("W", 0), None]]
    with pytest.raises(ScheduleError, match="W_0 needs the cotangent"):
        validate(Schedule.from_ops(2, 1, rows))
    rows = [[("FBW", 0), None], [None, ("F", 0)]]
    with pytest.raises(ScheduleError, match="FBW_0 is only allowed on the last stage"):
        validate(Schedule.from_ops(2, 1, rows))


def test_rejects_repeated_backward_bad_index_and_stale_forward():
    rows = _fwd_rows(2, 1) + [[None, ("BW", 0)], [None, ("B", 0)]]
    with pytest.raises(ScheduleError, match="repeats the input cotangent"):
        validate(Schedule.from_ops(2, 1, rows))
    rows = _fwd_rows(2, 1) + [[None, ("BW", 3)]]
    with pytest.raises(ScheduleError, match="micro-batch 3 outside 0..0"):
        validate(Schedule.from_ops(2, 1, rows))
    rows = _fwd_rows(2, 1)
    rows[0][0] = ("F", 0, True)
    with pytest.raises(ScheduleError, match="only B, W, BW may be stale"):
        validate(Schedule.from_ops(2, 1, rows))


def test_rejects_stash_over_capacity():
    s = gpipe_backprop(2, 4)
    validate(s)
    with pytest.raises(ScheduleError, match="stash holds 4 stage inputs; stash_capacity=2"):
        validate(s.with_capacity(2))


def test_from_ops_names_bad_op():
    with pytest.raises(ValueError, match="op 'X'"):
        Schedule.from_ops(1, 1, [[("X", 0)]])


@pytest.mark.parametrize("m,n", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (8, 32)])
def test_generators_validate_and_policies_keep_forward_ticks(m, n):
    sel = tuple(range(0, n, max(1, n // 3)))
    for s in (truncated(m, n, sel), delayed(m, n, sel)):
        validate(s)
        assert makespan(s) == n + m - 1  # no added ticks
        assert groups_nested(groups(s, stale=s.is_stale))
        # same forward ops as GPipe
        fwd = gpipe_forward(m, n)
        is_f = np.isin(s.kind, (F, FBW))
        assert np.array_equal(is_f, fwd.kind == F)
        assert np.array_equal(s.micro[is_f], fwd.micro[fwd.kind == F])
    c = complete(m, n, sel)
    validate(c)
    assert all(g == sel for g in groups(c))  # full chains on every stage
    assert makespan(c) >= n + m - 1 + (1 if m > 1 else 0)
    for s in (gpipe_backprop(m, n), one_f_one_b(m, n)):
        validate(s)
        assert makespan(s) == 2 * (n + m - 1)
        assert all(g == tuple(range(n)) for g in groups(s))


def test_delayed_is_labelled_stale_and_truncated_chains_start_at_last_stage():
    d = delayed(4, 16, (0, 1))
    assert d.is_stale and "stale" in d.name and "stale" in render_text(d).splitlines()[0]
    assert groups(d) == ((),) * 4 and groups(d, stale=True)[3] == (0, 1)
    t = truncated(4, 16, (0, 1))
    assert not t.is_stale and groups(t)[3] == (0, 1)
    assert t.kind[3, 3] == FBW


def test_peak_stash_counts_selected_in_flight_not_n():
    for k in (1, 2, 4):
        c = complete(4, 16, tuple(range(k)))
        assert peak_stash(c).max() <= k
    assert peak_stash(gpipe_backprop(4, 16)).max() == 16
    assert peak_stash(one_f_one_b(4, 16)).max() == 4
    assert peak_stash(gpipe_forward(4, 16)).max() == 0


def test_complete_added_ticks_small_and_below_gpipe_backprop():
    m, n = 4, 16
    base = makespan(gpipe_forward(m, n))
    extra_gpipe = makespan(gpipe_backprop(m, n)) - base
    for k in (1, 2, 4):
        added = makespan(complete(m, n, tuple(range(k)))) - base
        assert k <= added < extra_gpipe


def test_metrics_against_hand_counts():
    s = delayed(2, 2, (0,))
    # forward ticks 0..2; stage 1 idles at tick 0 (BW_0' there); stage 0 idles at tick 2 (BW_0').
    assert render_text(s).splitlines()[1:] == ["s0 |   F0   F1 BW0'", "s1 | BW0'   F0   F1"]
    assert fill_ratio(s) == 1.0 and coverage(s) == 0.5
    costs = OpCosts(f=1.0, b=2.0, w=3.0)
    assert weighted_makespan(s, costs) == 5.0 + 1.0 + 5.0
    row = summary(s, costs)
    assert row["added_ticks"] == 0 and row["peak_stash"] == 2 and row["stale"]


def test_generator_argument_errors():
    with pytest.raises(ValueError, match="micro_batches=0"):
        gpipe_forward(2, 0)
    with pytest.raises(ValueError, match="selected micro-batch 4 outside 0..3"):
        truncated(2, 4, (1, 4))
    with pytest.raises(ValueError, match="policy='bogus'"):
        make_schedule("bogus", 2, 4)


def test_render_png(tmp_path):
    path = tmp_path / "s.png"
    render_png(delayed(4, 8, (0, 1)), path)
    assert path.stat().st_size > 1000
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
