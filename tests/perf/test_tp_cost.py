"""``fit_link``: the latency/bandwidth fit of timed all-reduces is robust to a busy host and never returns an
unphysical link (notebook 10 fits the loopback link from its own timings)."""

from __future__ import annotations

import pytest

from minillm.perf.tp_cost import Link, fit_link

SIZES = [2304.0, 16384.0, 262144.0, 1048576.0, 4194304.0]


def test_fit_link_recovers_latency_and_bandwidth_from_exact_times():
    link, note = fit_link("test", SIZES, [20e-6 + b / 2e9 for b in SIZES])
    assert isinstance(link, Link) and note == ""
    assert link.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert link.bandwidth == pytest.approx(2e9, rel=1e-6)


def test_fit_link_ignores_one_stalled_run():
    times = [20e-6 + b / 2e9 for b in SIZES]
    times[1] *= 50  # a neighbour took the core during one size
    link, note = fit_link("test", SIZES, times)
    assert note == ""
    assert link.bandwidth == pytest.approx(2e9, rel=0.05)


def test_fit_link_falls_back_with_a_note_when_times_shrink_with_size():
    # the busy-host case that made notebook 10 raise: times that fall as the size grows give a negative slope
    times = [900e-6, 700e-6, 650e-6, 500e-6, 480e-6]
    link, note = fit_link("gloo loopback", SIZES, times)
    assert link.bandwidth > 0 and link.latency_s >= 0
    assert "lower bound" in note
    assert link.bandwidth == pytest.approx(SIZES[-1] / times[-1])


def test_fit_link_clamps_a_negative_latency_with_a_note():
    link, note = fit_link("test", SIZES, [b / 1e9 - 1e-6 for b in SIZES])  # t = bytes / β − 1 µs
    assert link.latency_s == 0.0 and "clamped" in note and link.bandwidth > 0


@pytest.mark.parametrize("sizes, times", [([1.0], [1.0]), ([1.0, 2.0], [1.0]), ([1.0, 1.0], [1.0, 2.0]),
                                          ([0.0, 2.0], [1.0, 2.0]), ([1.0, 2.0], [0.0, 1.0])])
def test_fit_link_rejects_data_it_cannot_fit(sizes, times):
    with pytest.raises(ValueError, match="fit_link"):
        fit_link("test", sizes, times)
