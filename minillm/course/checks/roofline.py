"""Checkers of notebook 00: the roofline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from minillm.course.checks.registry import _close, _passed, exercise


def _kwargs_text(kw: dict) -> str:
    return "".join(f", {k}={v!r}" for k, v in kw.items())


def _check_specs() -> list:
    """(name, spec, dtype) for every reference GPU and dtype it lists, plus a made-up CPU-like laptop
    (200 GFLOP/s fp32, 30 GB/s, no 16-bit entry: catches a hard-coded dtype)."""
    from minillm.perf.hardware import SPECS, HardwareSpec

    laptop = HardwareSpec("made-up laptop", {"float32": 200e9}, 30e9, 0, "made up for the checks")
    return [(s.name, s, dt) for s in (*SPECS.values(), laptop) for dt in s.peak_flops]


@exercise("0.1", "minillm.perf.roofline.linear_cost", "FLOPs and bytes of a linear layer",
          "2·M·K·N FLOPs (+ M·N for a bias); weight bytes K·N (+ N for a bias) at the weight dtype's size, "
          "activation bytes M·K (x read) + M·N (y written) at dtype's size (dtype_bytes gives sizes); return "
          "Cost(flops, bytes, {'weights': …, 'activations': …}, {'linear': flops})")
def check_linear_cost(linear_cost: Callable) -> None:
    """``linear_cost(M, K, N, dtype, weight_dtype=, bias=)``: FLOPs, bytes and their split, exactly, on decode,
    batched, prefill and square shapes, with a bias and with quantized weights; then intensity ≈ M when M ≪ K, N."""
    from minillm.perf.roofline import dtype_bytes

    def reference(M, K, N, dtype, weight_dtype=None, bias=False):  # the checker's own count
        a = dtype_bytes(dtype)
        w = a if weight_dtype is None else dtype_bytes(weight_dtype)
        weights, acts = K * N * w + (N * a if bias else 0), (M * K + M * N) * a
        return SimpleNamespace(flops=2 * M * K * N + (M * N if bias else 0), bytes=weights + acts,
                               breakdown={"weights": weights, "activations": acts})

    cases = [
        ("decode GEMV (Llama-2-7B q_proj, batch 1)", (1, 4096, 4096, "bfloat16"), {}),
        ("batched decode (Llama-2-7B gate+up, batch 64)", (64, 4096, 2 * 11008, "float16"), {}),
        ("prefill (SmolLM2 gate+up, 512 tokens)", (512, 576, 3072, "float32"), {}),
        ("square matmul", (2048, 2048, 2048, "float32"), {}),
        ("with a bias (a Qwen2-style qkv projection)", (3, 576, 960, "bfloat16"), {"bias": True}),
        ("int4 weights, bf16 activations", (8, 4096, 4096, "bfloat16"), {"weight_dtype": "int4"}),
        ("weights priced in bytes per element (int4 + group scales)", (2, 1024, 256, torch.float16),
         {"weight_dtype": 0.5625}),
    ]
    for name, (M, K, N, dtype), kw in cases:
        got, expected = linear_cost(M, K, N, dtype, **kw), reference(M, K, N, dtype, **kw)
        call = f"linear_cost(M={M}, K={K}, N={N}, dtype={dtype!r}{_kwargs_text(kw)})"
        flops, nbytes = getattr(got, "flops", None), getattr(got, "bytes", None)
        assert _close(flops, expected.flops), (
            f"{name}: {call}.flops is {flops!r}, expected {expected.flops:,}: 2 FLOPs (a multiply and an add) per "
            "weight per row of x, 2·M·K·N, plus M·N adds for a bias.")
        assert _close(nbytes, expected.bytes), (
            f"{name}: {call}.bytes is {nbytes!r}, expected {expected.bytes:,.0f}: the weights once (K·N elements, "
            "+ N for a bias) at the weight dtype's size, plus x read (M·K) and y written (M·N) at dtype's size.")
        parts = getattr(got, "breakdown", None) or {}
        for part in ("weights", "activations"):
            assert _close(parts.get(part), expected.breakdown[part]), (
                f"{name}: {call}.breakdown[{part!r}] is {parts.get(part)!r}, expected "
                f"{expected.breakdown[part]:,.0f} bytes (breakdown splits bytes into 'weights' and 'activations').")
    for M in (1, 4, 16):  # the lesson of the exercise, from the student's own numbers
        c = linear_cost(M, 8192, 8192, "bfloat16")
        assert abs(c.flops / c.bytes / M - 1) < 0.01, (
            f"a bf16 linear with M={M} ≪ K = N = 8192 should have intensity ≈ M = {M} FLOP/byte, expected "
            f"within 1 %, got {c.flops / c.bytes:.3f}")
    _passed("0.1")


@exercise("0.2", "minillm.perf.roofline.attainable_flops", "the roofline: attainable FLOP/s over intensities",
          "one number in, one float out; a sequence in, one value per intensity out, in order; validate every "
          "intensity (optional hints below the exercise)")
def check_attainable_flops(attainable_flops: Callable) -> None:
    """``attainable_flops(spec, intensity, dtype)`` for every reference GPU and dtype (and a made-up laptop): one
    number below, at and above the ridge; then sequences of intensities (list, tuple, tensor, numpy array) → a
    list in order; a 0-d tensor → one float; a negative or NaN intensity, and a dtype the spec lacks → ValueError."""
    import numpy as np

    def reference(spec, intensity, dtype):
        return min(spec.peak(dtype), intensity * spec.memory_bandwidth)

    for name, spec, dtype in _check_specs():
        ridge = spec.peak(dtype) / spec.memory_bandwidth
        grid = (0.0, 0.5, 1.0, ridge / 3, ridge, 2 * ridge, 1e5)
        for intensity in grid:
            got, expected = attainable_flops(spec, intensity, dtype), reference(spec, intensity, dtype)
            side = "below the ridge: memory bound" if intensity < ridge else "at or above the ridge: compute bound"
            assert _close(got, expected, rel=1e-9), (
                f"{name} in {dtype} ({spec.peak(dtype) / 1e12:g} TFLOP/s, {spec.memory_bandwidth / 1e12:g} TB/s, "
                f"ridge {ridge:.3g} FLOP/byte): attainable_flops(intensity={intensity:.4g}) returned {got!r}, "
                f"expected {expected:.4g} FLOP/s ({side}).")
        shuffled = [grid[i] for i in (3, 0, 6, 1, 5, 2, 4)]  # out of order: the answer must keep the order
        for kind, seq in (("a list", shuffled), ("a tuple", tuple(shuffled)),
                          ("a 1-D tensor", torch.tensor(shuffled, dtype=torch.float64)),
                          ("a numpy array", np.array(shuffled))):
            got = attainable_flops(spec, seq, dtype)
            expected = [reference(spec, i, dtype) for i in shuffled]
            assert isinstance(got, list) and len(got) == len(expected), (
                f"{name} in {dtype}: attainable_flops(spec, {kind} of {len(expected)} intensities, dtype) returned "
                f"{type(got).__name__}{'' if not hasattr(got, '__len__') else f' of length {len(got)}'}, expected "
                f"a list of {len(expected)} floats, one per intensity, in order.")
            bad = [(i, g, e) for i, g, e in zip(shuffled, got, expected, strict=True) if not _close(g, e, rel=1e-9)]
            assert not bad, (
                f"{name} in {dtype}: for {kind} of intensities, the value at intensity {bad[0][0]:.4g} is "
                f"{bad[0][1]!r}, expected {bad[0][2]:.4g} FLOP/s (the roofline at that intensity, in order).")
    h100 = next(s for n, s, _ in _check_specs() if n == "H100-SXM")
    got = attainable_flops(h100, torch.tensor(2.0), "bfloat16")
    assert _close(got, 2 * 3.35e12) and not isinstance(got, list), (
        f"a 0-d tensor is one intensity: attainable_flops(H100-SXM, torch.tensor(2.0), 'bfloat16') returned {got!r}, "
        f"expected one number, {2 * 3.35e12:.4g} FLOP/s.")
    for bad_value in (-1.0, float("nan"), [1.0, -0.5, 3.0]):
        try:
            attainable_flops(h100, bad_value, "bfloat16")
        except ValueError:
            continue
        raise AssertionError(f"attainable_flops(H100-SXM, {bad_value!r}, 'bfloat16') returned without a ValueError; "
                             "expected a ValueError naming the intensity (it must be a number >= 0).")
    try:
        attainable_flops(next(s for n, s, _ in _check_specs() if n == "T4"), 1.0, "bfloat16")
    except ValueError:
        pass
    else:
        raise AssertionError("attainable_flops(T4, 1.0, 'bfloat16') returned without a ValueError; expected one: "
                             "the T4 has no bf16 peak (spec.peak raises for a dtype the spec does not list).")
    _passed("0.2")


class _TimedPasses:
    """A stand-in ``reduce`` whose calls take known times: ``seconds[i]`` for call i (the last value after that).

    It records every call's argument, so a checker can tell the number of passes and whether each read the whole
    buffer.  Sleeping makes the expected rate exact up to the scheduler's wake-up delay, on any machine."""

    def __init__(self, seconds: list[float]):
        self.seconds, self.args = seconds, []

    def __call__(self, x):
        self.args.append(x)
        time.sleep(self.seconds[min(len(self.args) - 1, len(self.seconds) - 1)])
        return 0.0


def _own_read_rate(buffer: torch.Tensor, repeats: int) -> float:
    """The checker's own measurement: the fastest of ``repeats`` timed sums of ``buffer`` after a warm-up."""
    sync = torch.cuda.synchronize if buffer.is_cuda else (lambda: None)
    buffer.sum()
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        buffer.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return buffer.nbytes / best


@exercise("0.3", "minillm.perf.hardware.read_bandwidth", "the read-bandwidth probe",
          "the docstring's contract: a warm-up, timed passes over the whole buffer, the fastest one, bytes per "
          "second (optional hints below the exercise)")
def check_read_bandwidth(read_bandwidth: Callable) -> None:
    """``read_bandwidth(buffer, repeats=, reduce=)`` with a stand-in ``reduce`` whose passes take known times
    (sleeps: exact on any machine, however busy): one warm-up then ``repeats`` passes, each over the whole buffer,
    the fastest pass kept, bytes (not elements) counted, in bytes/s; then a real sum over a 32 MiB buffer (and a
    1 GiB one on a GPU) against the checker's own measurement in the same call, within 4× in one of three tries
    (noise, not speed, is what the factor and the tries allow for: a rate in GB/s instead of bytes/s is 1e9× off, a
    CUDA timing without a sync hundreds of times); ``repeats`` < 1 and an empty buffer → ValueError."""
    cases = [  # buffer, repeats, seconds per call (warm-up first): the fastest pass appears twice (a late wake-up)
        ("float32 [250 000]", torch.ones(250_000), 5, [0.1, 0.09, 0.02, 0.09, 0.02, 0.09]),
        ("float64 [40, 500] (8 bytes per element)", torch.ones(40, 500, dtype=torch.float64), 3,
         [0.1, 0.06, 0.02, 0.06]),
        ("bfloat16 [3000] (2 bytes per element), one repeat", torch.ones(3000, dtype=torch.bfloat16), 1, [0.1, 0.03]),
    ]
    for name, buffer, repeats, seconds in cases:
        reduce = _TimedPasses(seconds)
        got = read_bandwidth(buffer, repeats=repeats, reduce=reduce)
        call = f"read_bandwidth(<{name}, {buffer.nbytes:,} bytes>, repeats={repeats}, reduce=<passes of " \
               f"{', '.join(f'{t * 1e3:g}' for t in seconds)} ms>)"
        assert len(reduce.args) == repeats + 1, (
            f"{call} called reduce {len(reduce.args)} times, expected {repeats + 1}: one untimed warm-up call "
            "(it pays first-call costs), then one call per timed repeat.")
        whole = [isinstance(x, torch.Tensor) and x.data_ptr() == buffer.data_ptr() and x.numel() == buffer.numel()
                 for x in reduce.args]  # the buffer itself, or a view of all of it (flattened, say)
        assert all(whole), (
            f"{call}: call {whole.index(False) + 1} of reduce got something other than the whole buffer; expected "
            "every pass to read the buffer itself (its bytes are what the rate counts).")
        fastest = min(seconds[1:])
        expected = buffer.nbytes / fastest
        ok = isinstance(got, int | float) and not isinstance(got, bool) and 0.5 * expected <= got <= 1.02 * expected
        assert ok, (
            f"{call} returned {got!r}, expected about {expected:,.0f} bytes/s: the buffer's {buffer.nbytes:,} "
            f"bytes (nbytes, not elements) ÷ the fastest timed pass, {fastest * 1e3:g} ms (not the mean, the "
            "median or the warm-up: interference only slows passes down). The wake-up from a sleep may add a few "
            "ms, which the check allows for.")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:  # a real measurement, the default reduce (a sum)
        n = (32 if device == "cpu" else 1024) * 2**20 // 4
        buffer = torch.ones(n, device=device)
        for _ in range(3):  # a busy machine (a grader's parallel workers) can slow every pass of one call: retry
            before = _own_read_rate(buffer, 10)
            got = read_bandwidth(buffer, repeats=10)
            own = max(before, _own_read_rate(buffer, 10))
            if isinstance(got, int | float) and own / 4 <= got <= 4 * own:
                break
        assert isinstance(got, int | float) and own / 4 <= got <= 4 * own, (
            f"read_bandwidth(<{buffer.nbytes // 2**20} MiB of float32 on {device}>, repeats=10) with the default "
            f"reduce returned {got!r}, expected within 4× of the checker's own measurement just before and after, "
            f"{own / 1e9:.1f} GB/s (in bytes/s: {own:,.0f})" + (
                "; on CUDA a launch returns before the sum has run: synchronise before reading the clock"
                if device == "cuda" else "") + ".")
    for kwargs, what in (({"repeats": 0}, "repeats=0"), ({"repeats": -2}, "repeats=-2")):
        try:
            read_bandwidth(torch.ones(1000), **kwargs)
        except ValueError:
            continue
        raise AssertionError(f"read_bandwidth(<4000 bytes>, {what}) returned without a ValueError; expected one "
                             "(no pass timed, no rate).")
    try:
        read_bandwidth(torch.ones(0), repeats=2)
    except ValueError:
        pass
    else:
        raise AssertionError("read_bandwidth(<an empty buffer>, repeats=2) returned without a ValueError; expected "
                             "one (0 bytes read: there is no rate to report).")
    _passed("0.3")


@exercise("0.4", "minillm.perf.roofline.mbu", "model bandwidth utilisation (MBU)",
          "bytes the model reads per step × steps per second = achieved bytes/s; divide by peak_bandwidth "
          "(a fraction 0..1, not a percentage)")
def check_mbu(mbu: Callable) -> None:
    """``mbu(bytes_per_step, steps_per_s, bandwidth)``: the 7B / 100 tok/s / A100 example (70 %), then others,
    with the bandwidth given as a number and as a ``HardwareSpec``."""
    from minillm.perf.hardware import get_spec

    def reference(nbytes, steps, bandwidth):
        return nbytes * steps / getattr(bandwidth, "memory_bandwidth", bandwidth)

    got = mbu(7e9 * 2, 100, 2e12)
    assert _close(got, 0.7, rel=1e-9), (
        f"a 7B-parameter model in 16-bit weights (14 GB read per token) decoding 100 tokens/s on a 2 TB/s A100: "
        f"mbu(14e9, 100, 2e12) returned {got!r}, expected 0.70 (1.4 TB/s achieved ÷ 2 TB/s, as a fraction).")
    a100, h100 = get_spec("A100-80GB"), get_spec("H100-SXM")
    cases = [(270e6, 1000.0, a100), (270e6, 1000.0, a100.memory_bandwidth), (14e9, 200.0, h100), (1e9, 0.0, 30e9),
             (2.5e8, 55.5, 34e9)]
    for nbytes, steps, bandwidth in cases:
        got, expected = mbu(nbytes, steps, bandwidth), reference(nbytes, steps, bandwidth)
        shown = bandwidth.name if hasattr(bandwidth, "name") else f"{bandwidth:g} B/s"
        assert _close(got, expected, rel=1e-9, abs_=1e-15), (
            f"mbu(bytes_per_step={nbytes:g}, steps_per_s={steps:g}, bandwidth={shown}) returned {got!r}, "
            f"expected {expected:.4g}: bytes per step × steps per second ÷ peak bandwidth (bytes/s).")
    _passed("0.4")


# ------------------------------------------------------------------------------ the student's predictions
@dataclass(frozen=True)
class Verdict:
    """A prediction set against a measurement and a model's value (the roofline bound, usually).

    ``of_bound``: how much of the bound's speed was reached (1 = at the bound); ``of_prediction``: measured ÷
    predicted speed (1 = exact; < 1: the prediction was optimistic).  ``text``: what the notebook prints.
    """

    mine: float
    measured: float
    bound: float | None
    of_bound: float | None
    of_prediction: float
    text: str


def gap_verdict(of_bound: float) -> str:
    """What reaching ``of_bound`` of a bandwidth bound means: ≥ 80 % bandwidth bound, 50–80 % mostly so (the rest
    is fixed per-step cost), below 50 % overhead dominates."""
    if of_bound >= 0.8:
        return "bandwidth bound: the roofline explains the time"
    if of_bound >= 0.5:
        return f"mostly bandwidth bound; the other {1 - of_bound:.0%} is fixed per-step cost"
    return "overhead dominates, not bandwidth"


def beyond_bound_note(what: str, measured: str, bound: str, excess: float) -> str:
    """The line printed when a measurement beats a bandwidth bound by more than noise allows.  Not an error: a
    cached roof measured while the machine was busy is the usual cause, and a notebook must not fail on noise."""
    return (f"  ⚠ measured {what} {measured} beats {bound} by {excess:.0%}: the cached roof was probably measured "
            "while this machine was busy (`python -m minillm roofline --remeasure` measures it again), or the bound "
            "counts bytes the work does not read")


def _speed(x: float, lower_is_faster: bool) -> float:
    return 1 / x if lower_is_faster else x


def judge_prediction(mine: float | None, measured: float, *, bound: float | None = None, what: str,
                     unit: str = "", lower_is_faster: bool = False, bound_name: str = "the roofline bound",
                     see: str = "", upper: float = 1.25, bandwidth: bool = True) -> Verdict:
    """Compare the student's prediction ``mine`` with ``measured`` and with ``bound``, and say what the gaps mean.

    No band passes or fails the student: the verdict states how far each number is from the others (ratios
    computed here) — a prediction within 15 % "held"; a measurement at ≥ 80 % of the bound is bandwidth bound,
    50–80 % mostly so, below 50 % overhead dominates (``see`` points at where the notebook explains it).  A
    measurement beating a bandwidth bound by more than ``upper`` − 1 gets a ⚠ line (a roof measured on a busy
    machine, or a bound counting the wrong bytes), not an error: noise must not fail a notebook.
    ``lower_is_faster``: the quantities are times (ms), not rates.  ``bandwidth=False``: the
    bound is another model's limit (a ratio of step counts, a no-waste capacity), so the verdict says how close
    the measurement came without calling it bandwidth bound.  ``mine`` None (the prediction exercise is not written
    yet): the measurement is still placed against the bound, with a reminder.  Raises ``ValueError`` for anything
    else that is not a positive number.
    """
    if mine is not None and (isinstance(mine, bool) or not isinstance(mine, int | float) or not mine > 0):
        raise ValueError(f"write your prediction of {what} first (a positive number, in {unit or 'the unit asked'}), "
                         f"then run this cell; got {mine!r}")
    assert measured > 0, f"the measurement of {what} must be positive, got {measured}"
    def fmt(x: float) -> str:
        return f"{x:,.4g}×" if unit == "×" else f"{x:,.4g} {unit}".rstrip()

    of_prediction = None if mine is None else _speed(measured, lower_is_faster) / _speed(mine, lower_is_faster)
    lines = [f"{what}: you predicted {fmt(mine)}, measured {fmt(measured)}" if mine is not None else
             f"{what}: measured {fmt(measured)}; you have not written a prediction yet — write the prediction "
             "exercise above first, then run this cell again"]
    if of_prediction is None:
        pass
    elif 1 / 1.15 <= of_prediction <= 1.15:
        lines.append(f"  your prediction held: within {abs(of_prediction - 1):.0%} of the measurement")
    elif of_prediction < 1:
        lines.append(f"  your prediction was {1 / of_prediction:.1f}× too optimistic")
    else:
        lines.append(f"  your prediction was {of_prediction:.1f}× too pessimistic")
    of_bound = None
    if bound is not None:
        assert bound > 0, f"the bound must be positive, got {bound}"
        of_bound = _speed(measured, lower_is_faster) / _speed(bound, lower_is_faster)
        if bandwidth and of_bound > upper:
            lines.append(beyond_bound_note(what, fmt(measured), f"{bound_name} {fmt(bound)}", of_bound - 1))
        if mine is not None and _speed(mine, lower_is_faster) > _speed(bound, lower_is_faster) * 1.05:
            lines.append(f"  your prediction is beyond {bound_name} ({fmt(bound)}): nothing on this machine can "
                         "reach it — recheck the bytes and the bandwidth behind it")
        if bandwidth:
            gap = gap_verdict(of_bound)
        else:
            gap = ("beyond it: the model behind it misses something here" if of_bound > 1.1 else "close to it"
                   if of_bound >= 0.8 else "part of the way" if of_bound >= 0.5 else "far below it")
        lines.append(f"  measured at {of_bound:.0%} of {bound_name} ({fmt(bound)}): {gap}" + (f" — {see}" if see
                                                                                              else ""))
    text = "\n".join(lines)
    print(text)
    return Verdict(mine, measured, bound, of_bound, of_prediction, text)


def prediction_checker(number: str, name: str, target: str, what: str, unit: str,
                       example: tuple[float, ...] = (40.0,), *, bound: Callable[..., float] = lambda b, *_: b,
                       kind: str = "ceiling", factor: float = 10.0) -> Callable:
    """Make and register the checker of prediction ``number`` (e.g. "1.0", the function ``target``): it calls the
    student's function with the notebook's arguments (``example`` when none are given, as a grader does) and
    accepts only a number within ``factor``× of the bound those arguments give (``bound(*args)``, by default the
    first argument).  ``kind`` says what the bound is: "ceiling" (a rate nothing can beat: the prediction must not
    exceed it by more than 5 %), "floor" (a time nothing can undercut: not more than 5 % below it) or "estimate"
    (another model's value, e.g. a ratio of step counts: within ``factor``× either way).  The verdict on the
    measurement comes after it (``judge_prediction``)."""
    if kind not in ("ceiling", "floor", "estimate"):
        raise ValueError(f"kind must be 'ceiling', 'floor' or 'estimate', got {kind!r}")

    def check(predict: Callable, *args: float) -> float:
        args = args or example
        value = predict(*args)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise AssertionError(f"your prediction of {what}: expected a positive number of {unit}, got {value!r}")
        limit = bound(*args)
        lo, hi = limit / factor, limit * factor
        if kind == "ceiling":
            hi = limit * 1.05
        elif kind == "floor":
            lo = limit * 0.95
        assert lo <= value <= hi, (
            f"your prediction of {what} is {value:,.4g} {unit}; the bound from this notebook's numbers is "
            f"{limit:,.4g} {unit}" + (
                " and nothing can beat it (it counts only the bytes that must move)" if kind == "ceiling" and
                value > hi else " and nothing can undercut it (it counts only the bytes that must move)"
                if kind == "floor" and value < lo else f", and a prediction must be within {factor:g}× of it")
            + f": expected between {lo:,.4g} and {hi:,.4g} {unit}. Start from the bound and say what costs extra.")
        print(f"✓ Exercise {number} passed: your prediction of {what} is recorded: {value:,.4g} {unit} "
              f"({value / limit:.2f}× the bound {limit:,.4g} {unit})")
        return float(value)

    check.bound = lambda *args: bound(*(args or example))  # for tests and graders: the bound the checker uses
    check.kind, check.factor = kind, factor
    check.__name__ = check.__qualname__ = f"check_{name}"
    check.__doc__ = (f"Record the student's prediction of {what} ({unit}) from ``{target.rsplit('.', 1)[1]}``, "
                     f"within {factor:g}× of its bound ({kind}).")
    return exercise(number, target, f"your prediction: {what}",
                    "start from the bound the arguments give; scale it by what you expect to cost extra")(check)


check_prediction_gemv = prediction_checker("0.0", "prediction_gemv", "minillm.course.predictions.predict_gemv_gb_s",
                                           "the GB/s of a batch-1 F.linear pass", "GB/s")
