"""The quality plot helpers put their legends beside the axes, where they cover no data."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from jaxstream.quality.plots import (
    legend_beside,
    plot_per_layer,
    plot_settings_bars,
    plot_sweep,
)

GROUPS = ("embed", "block_0", "block_1", "head", "all")
NAMES = ("backprop", "forward K=1", "forward K=16", "hybrid weighted", "hybrid control variate")


def rows() -> list[dict]:
    """Rows whose curves fill the whole panel (high and low values in every corner)."""
    out = []
    for i, name in enumerate(NAMES):
        for j, g in enumerate(GROUPS):
            for k in (1, 4, 16):
                y = ((i + j + k) % 5) / 4  # 0 .. 1 everywhere
                out.append({"estimator": name, "group": g, "setting": f"N={k}",
                            "num_tangents": k, "cosine_mean": y, "cosine_std": 0.05})
    return out


def legend_outside(fig) -> None:
    """Every legend of ``fig`` lies outside every axes box (in display coordinates)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legends = [a.get_legend() for a in fig.axes if a.get_legend() is not None]
    assert legends, "no legend drawn"
    for leg in legends:
        box = leg.get_window_extent(r)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(r)), (box, ax.get_window_extent(r))


@pytest.mark.parametrize("draw", [
    lambda rs: plot_per_layer([r for r in rs if r["num_tangents"] == 1]),
    lambda rs: plot_sweep([r for r in rs if r["group"] == "all"], x="num_tangents"),
    lambda rs: plot_settings_bars([r for r in rs if r["group"] == "all"]),
])
def test_legends_beside_the_data(draw):
    fig = draw(rows())
    legend_outside(fig)
    plt.close(fig)


def test_legend_beside_after_adding_a_line():
    # A notebook adds a reference line to a helper's figure, then places the legend again.
    fig = plot_per_layer([r for r in rows() if r["num_tangents"] == 1])
    ax = fig.axes[0]
    ax.axhline(0.5, ls=":", label="theory")
    legend_beside(ax)
    fig.tight_layout()
    legend_outside(fig)
    assert "theory" in [t.get_text() for t in ax.get_legend().get_texts()]
    # The test can fail: a legend left at matplotlib's default place lies inside the axes.
    ax.legend()
    with pytest.raises(AssertionError):
        legend_outside(fig)
    plt.close(fig)
