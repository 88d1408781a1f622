"""Prefill GEMM A/B: the exact path (dequantize + float GEMM) against ``block_prefill_linear`` (x rounded to int8
blocks, the VNNI register tiles), interleaved in one process, medians of the rounds, GFLOP/s and their ratio.

    python benchmarks/block_prefill_ab.py [--rounds 5] [--formats q8_0,q4_0,q4_1] [--rows 128,512] [--threads 2]

Shapes: Llama-3.2-1B's matrices (hidden 2048, intermediate 8192): [N, K] = 2048 x 2048 (q/o_proj), 8192 x 2048
(gate/up_proj), 2048 x 8192 (down_proj), seeded random weights (speed does not depend on their values).  2 · M · N · K
flops per call; both sides include what a call pays (the exact path its float copy of the weight, the int8 path its
activation rounding and panel copy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minillm.kernels.cpu import quant as native_quant
from minillm.kernels.select import int4_ref
from minillm.quant.weight import Int4Weight, int8_linear_ref, quantize_int4, quantize_int8

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]  # [N, K] of Llama-3.2-1B's linears


def weight(fmt: str, w: torch.Tensor):
    """Q8_0 (int8, groups of 32, fp16 scales), Q4_1 (fp16 d and m) or Q4_0 (symmetric: Q4_1's codes and d, no m)."""
    if fmt == "q8_0":
        w8 = quantize_int8(w, 32)
        return type(w8)(w8.qweight, w8.scales.half(), 32)
    w4 = quantize_int4(w, 32)
    return w4 if fmt == "q4_1" else Int4Weight(w4.packed, w4.scales, None, 32)


def medians(ref, x: torch.Tensor, wq, rounds: int) -> tuple[float, float]:
    """(exact s, int8 blocks s): medians over ``rounds`` alternations, A, B, A, B ... (both see the same neighbours),
    after one warm call of each (first-use compilation, page faults)."""
    calls = (lambda: ref(x, wq), lambda: native_quant.block_prefill_linear(x, wq))
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds + 1):
        for fn, t in zip(calls, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if r:
                t.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--formats", default="q8_0,q4_0,q4_1")
    ap.add_argument("--rows", default="128,512")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not native_quant.prefill_tiled():
        raise SystemExit("this build has no AVX-512 VNNI prefill tiles: nothing to compare")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for fmt in args.formats.split(","):
        ref = int8_linear_ref if fmt == "q8_0" else int4_ref
        for N, K in SHAPES:
            wq = weight(fmt, torch.randn(N, K, generator=g) * 0.02)
            for M in (int(m) for m in args.rows.split(",")):
                (a, b), gflop = medians(ref, torch.randn(M, K, generator=g), wq, args.rounds), 2 * M * N * K / 1e9
                print(f"{fmt:5} M={M:<5} N={N:<5} K={K:<5} exact {gflop / a:7.1f} GFLOP/s   int8 blocks "
                      f"{gflop / b:7.1f} GFLOP/s   int8 / exact {a / b:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
