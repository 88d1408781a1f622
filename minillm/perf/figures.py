"""Figures readable at a glance: find text labels whose boxes overlap, and move annotations apart until none do.

Labels of nearby points (a roofline's prefill lengths, decode batch sizes) land on top of each other on log axes.
``overlapping_labels(fig)`` draws the figure and returns every pair of visible texts (annotations, titles, axis
labels, legend entries) whose rendered boxes intersect; ``spread_labels(ax)`` nudges annotations (those placed
with ``textcoords="offset points"``) up or down in steps of their own height until no box overlaps another, and
returns the pairs it could not separate.  Both work on any matplotlib figure and never show it.
"""

from __future__ import annotations

from collections.abc import Iterable


def _renderer(fig):
    fig.canvas.draw()  # text extents are only known once laid out
    return fig.canvas.get_renderer()


def _texts(fig) -> list:
    """The visible, non-empty text artists of ``fig``: axes texts and annotations, titles, axis labels, legends."""
    found = []
    for ax in fig.axes:
        found += [*ax.texts, ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        legend = ax.get_legend()
        if legend is not None:
            found += legend.get_texts()
    found += fig.texts
    return [t for t in found if t.get_visible() and t.get_text().strip()]


def _overlap(a, b, pad: float) -> bool:
    return a.x0 < b.x1 + pad and b.x0 < a.x1 + pad and a.y0 < b.y1 + pad and b.y0 < a.y1 + pad


def overlapping_labels(fig, pad_px: float = 0.0) -> list[tuple[str, str]]:
    """Pairs of label texts (as shown) whose boxes overlap, or come within ``pad_px`` pixels, in ``fig``.

    Texts of one legend are not compared with each other (the legend lays them out); an empty list means every
    label can be read."""
    renderer = _renderer(fig)
    texts = _texts(fig)
    boxes = [t.get_window_extent(renderer) for t in texts]
    legend_of = {id(t): id(ax) for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    pairs = []
    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            same_legend = id(texts[i]) in legend_of and legend_of.get(id(texts[i])) == legend_of.get(id(texts[j]))
            if not same_legend and _overlap(boxes[i], boxes[j], pad_px):
                pairs.append((texts[i].get_text(), texts[j].get_text()))
    return pairs


def spread_labels(ax, annotations: Iterable | None = None, max_steps: int = 12,
                  pad_px: float = 2.0) -> list[tuple[str, str]]:
    """Move ``annotations`` (default: every annotation on ``ax`` placed in offset points) apart vertically.

    Each in turn, left to right, tries offsets 0, +1, −1, +2, −2, … label heights from where it was put until its
    box clears every label already placed and the other texts of the figure; one that finds no free place within
    ``max_steps`` stays where it was.  Returns ``overlapping_labels`` afterwards (empty when all are readable)."""
    from matplotlib.text import Annotation

    fig = ax.figure
    renderer = _renderer(fig)
    movable = [a for a in (ax.texts if annotations is None else annotations)
               if isinstance(a, Annotation) and a.get_text().strip() and a.get_anncoords() == "offset points"]
    fixed = [t for t in _texts(fig) if t not in movable]
    placed = [t.get_window_extent(renderer) for t in fixed]
    points_per_px = 72.0 / fig.dpi
    for ann in sorted(movable, key=lambda a: a.get_window_extent(renderer).x0):
        x0, y0 = ann.xyann
        height_pt = ann.get_window_extent(renderer).height * points_per_px + pad_px * points_per_px
        for step in range(2 * max_steps + 1):
            shift = (step + 1) // 2 * (1 if step % 2 else -1)  # 0, +1, -1, +2, -2, ...
            ann.xyann = (x0, y0 + shift * height_pt)
            box = ann.get_window_extent(renderer)
            if not any(_overlap(box, other, pad_px) for other in placed):
                break
        else:
            ann.xyann = (x0, y0)
            box = ann.get_window_extent(renderer)
        placed.append(box)
    return overlapping_labels(fig)
