"""Alternating A/B timing for the scripts in this folder: each round times every candidate once, in turn, so a
neighbour's load falls on all of them alike; the medians are compared, never one run."""

import statistics
import time
from collections.abc import Callable


def alternate(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``rounds`` rounds, the candidates timed in turn within a round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}
