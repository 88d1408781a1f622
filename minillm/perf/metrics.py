"""Serving metrics: percentiles, goodput under a latency SLO, cost per token, and decode bytes.

What a user of an inference server feels is a distribution, not a mean: one request stuck behind a long prefill
is the one they remember.  So latencies are reported as percentiles (p50/p90/p99), requests are counted as
"good" only when they meet a service-level objective (SLO) on both time to first token (TTFT) and time per output
token (TPOT), and throughput is turned into money with the price of the machine.

Several functions here are course exercises (notebook 01): their bodies sit between ``### BEGIN SOLUTION`` and
``### END SOLUTION``; the library runs the solution, the student notebook gets a stub.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from minillm.config import ModelConfig


class HasLatencies(Protocol):
    """Anything with a request's TTFT and TPOT in seconds, e.g. ``generate.RequestMetrics``."""

    ttft_s: float
    tpot_s: float


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) of ``values``, interpolating linearly between the two nearest ranks.

    Sort the values; the percentile sits at fractional index ``q/100 × (n − 1)`` of the sorted list
    (numpy's default "linear" method): p0 is the minimum, p100 the maximum, p50 of an even count the mean of
    the middle two.  ``values`` need not be sorted and is not modified.  Cost: one O(n log n) sort.
    """
    if len(values) == 0:
        raise ValueError("percentile of an empty sequence is undefined: measure at least one value")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ### BEGIN SOLUTION
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)  # fractional position in the sorted list
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)
    ### END SOLUTION


def summarize(values: Sequence[float], *, percentile: Callable[[Sequence[float], float], float] = percentile,
              qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"mean", "p50", "p90", "p99", "max"} of ``values``.  ``percentile`` is pluggable (the course passes
    the student's own implementation here, explicitly, instead of patching this module)."""
    out = {"mean": statistics.fmean(values)}
    out.update({f"p{q:g}": percentile(values, q) for q in qs})
    out["max"] = max(values)
    return out


def goodput(requests: Sequence[HasLatencies], duration_s: float, *, ttft_slo_s: float = 0.2,
            tpot_slo_s: float = 0.1) -> float:
    """Requests per second that met the SLO: TTFT ≤ ``ttft_slo_s`` **and** TPOT ≤ ``tpot_slo_s``.

    ``duration_s`` is the wall time over which the requests were served.  A request meeting a limit exactly
    counts as good; a one-token request has TPOT 0 (no inter-token gap) and is judged on TTFT alone.
    Throughput counts every request; goodput counts only those a user would call fast enough.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if ttft_slo_s < 0 or tpot_slo_s < 0:
        raise ValueError(f"SLOs must be >= 0 seconds, got ttft_slo_s={ttft_slo_s}, tpot_slo_s={tpot_slo_s}")
    good = sum(1 for r in requests if r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s)
    return good / duration_s


def cost_per_million_tokens(dollars_per_hour: float, tokens_per_s: float) -> float:
    """Dollars per 1M generated tokens for a machine rented at ``dollars_per_hour`` producing ``tokens_per_s``.

    $/1M = $/h ÷ (tok/s × 3600 s/h) × 1e6.  E.g. $2/h at 100 tok/s ≈ $5.56 per million tokens: throughput is
    the lever on price, which is why batching (notebook 06) matters as much as latency.
    """
    if dollars_per_hour < 0 or not tokens_per_s > 0:
        raise ValueError(f"need dollars_per_hour >= 0 and tokens_per_s > 0, got {dollars_per_hour}, {tokens_per_s}")
    tokens_per_hour = tokens_per_s * 3600
    return dollars_per_hour / tokens_per_hour * 1_000_000


def decode_weight_bytes(config: ModelConfig, dtype: torch.dtype = torch.float16) -> int:
    """Bytes of weights one decode step reads from memory: the floor under its time on any machine.

    At decode every linear layer is a GEMV, so each weight matrix is read once per step, and so are the RMSNorm
    weights.  The input embedding is only looked up: a step reads one row (``hidden_size`` elements, counted as
    activations, not here), never the table.  The LM head reads its whole V × hidden matrix — the embedding's
    storage when the two are tied.  Elements are ``dtype``-sized (``dtype.itemsize`` bytes).
    """
    ### BEGIN SOLUTION
    # Equals roofline.decode_step_cost(config, 1, 1, dtype).breakdown["weights"] (tests hold the two together).
    body = config.num_parameters(include_embeddings=False)  # decoder layers (linears + norms) + final norm
    lm_head = config.vocab_size * config.hidden_size  # read in full every step, tied or not
    return (body + lm_head) * dtype.itemsize
    ### END SOLUTION


def measure_seconds(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
                    device: str | torch.device = "cpu") -> list[float]:
    """Wall-clock seconds of ``repeat`` calls of ``fn()`` after ``warmup`` untimed calls.

    On CUDA the device is synchronised before and after each call, so the time covers the GPU work and not just
    the (asynchronous) launch.  Report a percentile of the result (the median resists a noisy neighbour).
    """
    import time

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def memory_growth(make: Callable[[], object], device: str | torch.device = "cpu") -> tuple[object, int]:
    """Call ``make()`` and return (its result, bytes of memory the process gained while it ran).

    CUDA: growth of ``torch.cuda.memory_allocated`` (exact, what tensors hold).  CPU with glibc: growth of the
    bytes malloc has handed out (``mallinfo2``: heap in use + mmapped blocks), which counts an allocation even
    when it reuses memory freed earlier.  Elsewhere: growth of the resident set (RSS, via psutil), which only
    counts pages really touched and misses reused memory.  Keep allocations ≫ 10 MB so that unrelated
    allocations are noise.
    """
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        obj = make()
        torch.cuda.synchronize()
        return obj, torch.cuda.memory_allocated() - before
    probe = _malloc_in_use() or _rss
    before = probe()
    obj = make()
    return obj, probe() - before


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _malloc_in_use() -> Callable[[], int] | None:
    """A function returning glibc's bytes in use (heap + mmapped), or None where mallinfo2 is unavailable."""
    import ctypes
    import ctypes.util

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
             "keepcost")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in names]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2

    def in_use() -> int:
        info = fn()
        return info.uordblks + info.hblkhd

    return in_use
