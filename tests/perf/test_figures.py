"""Readable figures: overlapping labels are found and spread apart; roofline points are coloured by phase."""

import matplotlib

matplotlib.use("Agg")  # headless

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_rgba

from minillm.perf.figures import overlapping_labels, spread_labels
from minillm.perf.hardware import get_spec
from minillm.perf.roofline import PHASE_COLORS, RooflinePoint, plot_roofline


@pytest.fixture
def ax():
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    yield ax
    plt.close(fig)


def _crowd(ax, n=6):
    ax.set(xlim=(0, 10), ylim=(0, 10))
    return [ax.annotate(f"label number {i}", (5 + 0.01 * i, 5), textcoords="offset points", xytext=(5, 4))
            for i in range(n)]


def test_overlapping_labels_finds_labels_drawn_on_top_of_each_other(ax):
    _crowd(ax, 2)
    assert overlapping_labels(ax.figure) == [("label number 0", "label number 1")]


def test_labels_far_apart_do_not_overlap(ax):
    ax.set(xlim=(0, 10), ylim=(0, 10), title="a title", xlabel="x")
    ax.annotate("left", (1, 1), textcoords="offset points", xytext=(5, 4))
    ax.annotate("right", (8, 8), textcoords="offset points", xytext=(5, 4))
    assert overlapping_labels(ax.figure) == []


def test_spread_labels_separates_a_crowd_moving_labels_only_vertically(ax):
    labels = _crowd(ax)
    assert len(overlapping_labels(ax.figure)) == 15  # every pair of six
    assert spread_labels(ax) == []
    assert overlapping_labels(ax.figure) == []
    assert {a.xyann[0] for a in labels} == {5}  # x offsets untouched: each label stays beside its point


def test_legend_entries_are_not_counted_as_overlapping_each_other(ax):
    for i in range(4):
        ax.plot([0, 1], [i, i], label=f"series {i}")
    ax.legend()
    assert overlapping_labels(ax.figure) == []


def test_roofline_points_are_coloured_by_phase_and_their_labels_do_not_overlap():
    spec = get_spec("A100-80GB")
    points = [RooflinePoint(f"prefill {n}", n * 0.9, n * 3e11) for n in (16, 17, 18, 19)]
    points += [RooflinePoint(f"decode B={b}", b * 0.95, b * 1.5e12) for b in (1, 1.05, 1.1)]
    points.append(RooflinePoint("matmul", 900.0, 250e12))
    ax = plot_roofline(spec, points, dtype="bfloat16")
    try:
        assert overlapping_labels(ax.figure) == []
        colors = {c.get_label(): tuple(c.get_facecolor()[0]) for c in ax.collections}
        assert colors == {phase: to_rgba(PHASE_COLORS[phase]) for phase in ("prefill", "decode", "other")}
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert {"prefill", "decode", "other"} <= set(legend)
    finally:
        plt.close(ax.figure)


def test_phase_comes_from_the_argument_or_the_label():
    assert RooflinePoint("prefill, 512 tokens", 1, 1).phase == "prefill"
    assert RooflinePoint("Decode step", 1, 1).phase == "decode"
    assert RooflinePoint("gemv", 1, 1).phase == "other"
    assert RooflinePoint("naive step", 1, 1, phase="prefill").phase == "prefill"
    with pytest.raises(ValueError, match="phase must be one of prefill, decode, other, got 'train'"):
        RooflinePoint("x", 1, 1, phase="train")
