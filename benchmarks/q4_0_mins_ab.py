"""Q4_0 decode GEMV A/B: symmetric ``Int4Weight``s (the file's 18 bytes per block, the kernels taking m = −8·d)
against the same weights with m = −8·d stored (Q4_1's 20 bytes per block, how Q4_0 ran before), interleaved in one
process, medians of the rounds, their ratio.

    python benchmarks/q4_0_mins_ab.py --gguf MODEL-Q4_0.gguf [--rounds 7] [--threads 2] [--layers 16]

One round runs every Q4_0 linear of the model's first ``--layers`` layers (q, k, v, o, gate, up, down: their real
shapes and blocks, beyond any L3 at 1B shapes) as a batch-1 GEMV (``native_quant.int4_linear``, int8 activations:
the decode path) once with each form, A then B, B then A on alternate rounds.  Both forms give the same bits (the
tests check it); only the bytes read differ.  Prints the bytes and times of each form and B / A.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minillm.kernels.cpu import quant as native_quant
from minillm.quant.gguf import read_gguf_weights
from minillm.quant.weight import Int4Weight

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def stack_seconds(weights: list[Int4Weight], xs: dict[int, torch.Tensor]) -> float:
    """One pass of batch-1 GEMVs over ``weights`` in order (x [1, K] per K): seconds."""
    t0 = time.perf_counter()
    for w in weights:
        native_quant.int4_linear(xs[w.shape[1]], w)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="a Llama-family Q4_0 GGUF (python -m minillm make-model writes one)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    packed = read_gguf_weights(args.gguf)
    sym = [packed[f"model.layers.{i}.{n}.weight"] for i in range(args.layers) for n in LINEARS
           if f"model.layers.{i}.{n}.weight" in packed]
    sym = [w for w in sym if isinstance(w, Int4Weight) and w.mins is None]
    if not sym:
        raise SystemExit(f"{args.gguf}: no Q4_0 linears in its first {args.layers} layers")
    stored = [w.with_mins() for w in sym]
    del packed
    g = torch.Generator().manual_seed(0)
    xs = {K: torch.randn(1, K, generator=g) for K in {w.shape[1] for w in sym}}
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(args.rounds + 1):  # round 0 warms both (first-use compilation, page faults)
        order = ((0, sym), (1, stored)) if r % 2 == 0 else ((1, stored), (0, sym))
        for side, ws in order:
            t = stack_seconds(ws, xs)
            if r:
                times[side].append(t)
    a, b = statistics.median(times[0]), statistics.median(times[1])
    na, nb = sum(w.nbytes for w in sym), sum(w.nbytes for w in stored)
    print(f"{len(sym)} Q4_0 linears, {args.threads} threads, {args.rounds} rounds (medians)")
    print(f"A symmetric (no mins): {na / 1e6:8.1f} MB  {a * 1e3:8.2f} ms  {na / a / 1e9:6.1f} GB/s")
    print(f"B m = -8 d stored:     {nb / 1e6:8.1f} MB  {b * 1e3:8.2f} ms  {nb / b / 1e9:6.1f} GB/s")
    print(f"B / A: bytes {nb / na:.3f}, time {b / a:.3f}")


if __name__ == "__main__":
    main()
