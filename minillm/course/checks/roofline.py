"""Checkers of notebook 00: the roofline."""

from __future__ import annotations

import math
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


@exercise("0.2", "minillm.perf.roofline.ridge_point", "the ridge point",
          "the intensity at which the two roofs of the plot meet; the spec knows each dtype's peak")
def check_ridge_point(ridge_point: Callable) -> None:
    """``ridge_point(spec, dtype)``: H100 SXM bf16 ≈ 295 FLOP/byte, then every reference GPU and dtype."""
    from minillm.perf.hardware import get_spec

    def reference(spec, dtype):
        return spec.peak(dtype) / spec.memory_bandwidth

    got = ridge_point(get_spec("H100-SXM"), "bfloat16")
    assert _close(got, 989e12 / 3.35e12, rel=1e-9), (
        f"H100 SXM in bfloat16 (989 TFLOP/s dense, 3.35 TB/s): ridge_point returned {got!r}, expected "
        f"{989e12 / 3.35e12:.1f} FLOP/byte = peak FLOP/s ÷ bandwidth (bytes/s).")
    for name, spec, dtype in _check_specs():
        got, expected = ridge_point(spec, dtype), reference(spec, dtype)
        assert _close(got, expected), (
            f"{name} in {dtype} ({spec.peak(dtype) / 1e12:g} TFLOP/s, {spec.memory_bandwidth / 1e12:g} TB/s): "
            f"ridge_point returned {got!r}, expected {expected:.4g} FLOP/byte (use the peak of the dtype asked for).")
    _passed("0.2")


@exercise("0.3", "minillm.perf.roofline.attainable_flops", "attainable FLOP/s (the roofline)",
          "a kernel is limited by whichever roof is lower at its intensity")
def check_attainable_flops(attainable_flops: Callable) -> None:
    """``attainable_flops(spec, intensity, dtype)`` below, at and above the ridge, for every reference GPU and dtype."""
    def reference(spec, intensity, dtype):
        return min(spec.peak(dtype), intensity * spec.memory_bandwidth)

    for name, spec, dtype in _check_specs():
        ridge = spec.peak(dtype) / spec.memory_bandwidth
        for intensity in (0.0, 0.5, 1.0, ridge / 3, ridge, 2 * ridge, 1e5):
            got, expected = attainable_flops(spec, intensity, dtype), reference(spec, intensity, dtype)
            side = "below the ridge: intensity × bandwidth" if intensity < ridge else "at or above the ridge: the peak"
            assert _close(got, expected, rel=1e-9), (
                f"{name} in {dtype} (ridge {ridge:.3g} FLOP/byte): attainable_flops(intensity={intensity:.4g}) "
                f"returned {got!r}, expected {expected:.4g} FLOP/s ({side}).")
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


def _speed(x: float, lower_is_faster: bool) -> float:
    return 1 / x if lower_is_faster else x


def judge_prediction(mine: float | None, measured: float, *, bound: float | None = None, what: str,
                     unit: str = "", lower_is_faster: bool = False, bound_name: str = "the roofline bound",
                     see: str = "", upper: float = 1.25, bandwidth: bool = True) -> Verdict:
    """Compare the student's prediction ``mine`` with ``measured`` and with ``bound``, and say what the gaps mean.

    No band passes or fails the student: the verdict states how far each number is from the others (ratios
    computed here) — a prediction within 15 % "held"; a measurement at ≥ 80 % of the bound is bandwidth bound,
    50–80 % mostly so, below 50 % overhead dominates (``see`` points at where the notebook explains it).  The only
    assertion is on the model: a measurement beating a bandwidth bound by more than ``upper`` − 1 means the bound
    counts the wrong bytes.  ``lower_is_faster``: the quantities are times (ms), not rates.  ``bandwidth=False``: the
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
        assert of_bound <= upper or not bandwidth, (
            f"measured {what} {fmt(measured)} beats {bound_name} {fmt(bound)} by {of_bound - 1:.0%} (more than "
            f"{upper - 1:.0%} of noise): the bound counts more bytes than the work reads, or the bandwidth "
            "measurement is too low.")
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
                       example: tuple[float, ...] = (40.0,)) -> Callable:
    """Make and register the checker of prediction ``number`` (e.g. "1.0", the function ``target``): it calls the
    student's function with the notebook's arguments (``example`` when none are given, as a grader does),
    insists on a positive finite number, records and returns it.  The checker of a prediction grades nothing
    else: the verdict comes after the measurement (``judge_prediction``)."""

    def check(predict: Callable, *args: float) -> float:
        value = predict(*(args or example))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise AssertionError(f"your prediction of {what}: expected a positive number of {unit}, got {value!r}")
        print(f"✓ Exercise {number} passed: your prediction of {what} is recorded: {value:,.4g} {unit}")
        return float(value)

    check.__name__ = check.__qualname__ = f"check_{name}"
    check.__doc__ = f"Record the student's prediction of {what} ({unit}) from ``{target.rsplit('.', 1)[1]}``."
    return exercise(number, target, f"your prediction: {what}",
                    "write your own number (or formula from the arguments) before the measurement")(check)


check_prediction_gemv = prediction_checker("0.0", "prediction_gemv", "minillm.course.predictions.predict_gemv_gb_s",
                                           "the GB/s of a batch-1 F.linear pass", "GB/s")
