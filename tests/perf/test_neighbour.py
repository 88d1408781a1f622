"""The noisy neighbour beside a benchmark: it starts, works, stops and reports what it did.  No timings asserted."""

from __future__ import annotations

import os

import pytest

from minillm.perf.bench.neighbour import Neighbour, describe_neighbour


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("kind", ["copy", "compute"])
def test_a_neighbour_runs_during_the_block_and_is_gone_after(kind):
    with Neighbour(kind, nbytes=1 << 20) as n:
        pid = n.proc.pid
        assert n.running and _alive(pid)
        assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)  # the benchmark's cores
    assert not n.running and not _alive(pid)
    assert n.record["kind"] == kind and n.record["pid"] == pid
    assert n.record["passes"] >= 0 and n.record["seconds"] > 0
    assert ("gb_s" in n.record) == (kind == "copy") and n.record["bytes"] == (2 << 20 if kind == "copy" else 0)
    assert describe_neighbour(n.record).startswith(kind)


def test_no_neighbour_starts_nothing():
    with Neighbour("none") as n:
        assert n.proc is None and not n.running
    assert n.record == {"kind": "none"} and describe_neighbour(n.record) == "none"


def test_a_neighbour_is_stopped_when_the_measurement_raises():
    with pytest.raises(KeyError), Neighbour("compute") as n:
        pid = n.proc.pid
        raise KeyError("the benchmark failed")
    assert not _alive(pid)


def test_rejects_an_unknown_kind_and_a_tiny_copy():
    with pytest.raises(ValueError, match="--neighbour must be one of none, copy, compute, got 'stream'"):
        Neighbour("stream")
    with pytest.raises(ValueError, match="bytes must be >= 8"):
        Neighbour("copy", nbytes=4)
