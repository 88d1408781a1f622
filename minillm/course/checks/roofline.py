"""Checkers of notebook 00: the roofline."""

from __future__ import annotations

from collections.abc import Callable
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
