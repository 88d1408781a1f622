"""Q6_K decode GEMV A/B: GGUF Q6_K blocks read as they are (``Q6KWeight``, 210 bytes per 256 weights, the native
``q6k_linear``) against the same weights re-quantized to Q8_0 blocks (``Int8Weight`` group 32, fp16 scales: 272
bytes per 256, how ``read_gguf_weights`` loads Q6_K, through ``int8_linear``'s int8-activation path), interleaved
in one process, medians of the rounds, their ratio.

    python benchmarks/q6k_ab.py --gguf MODEL-Q4_K_M.gguf [--rounds 7] [--threads 2] [--prefill [--rows 512]]

A Q4_K_M file stores the embedding (the tied LM head: [V, hidden]) and some ``attn_v`` / ``ffn_down`` as Q6_K.  One
round runs, per group (the head; every Q6_K ``ffn_down``; every Q6_K ``attn_v``), a batch-1 GEMV over each of the
group's tensors once with each form — the ``ffn_down`` group together is beyond any L3 at 1B shapes, so it streams
from memory as decode does.  The Q8_0 form is ``quantize_q8_0`` of gguf's exact dequantization: not the same values
(each weight moves by at most half an 8-bit step), so only the times and bytes are compared.  Prints each group's
bytes, times and GB/s of each form (from its own bytes) and the ratio.

``--prefill``: x [rows, K] through the file's first Q6_K ``ffn_down`` instead (``blk.0`` in Llama 3.2 1B's Q4_K_M:
[2048, 8192]), ``q6k_linear`` (past 8 rows: the register-tiled prefill GEMM on AVX-512 VNNI, else weight rows
unpacked per L2 block) against the same Q8_0 re-quantization through ``block_prefill_linear`` (the register-tiled
Q8_0 prefill GEMM), interleaved; prints the times, the integer operation rate of each and the ratio.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from ab_timing import alternate  # benchmarks/ab_timing.py: the script's folder is on sys.path

from minillm.kernels.cpu import quant as native_quant
from minillm.quant.gguf import q6_k_blocks
from minillm.quant.weight import Q6KWeight, quantize_q8_0


def q6_k_groups(path: str) -> dict[str, list[tuple[str, Q6KWeight]]]:
    """The file's Q6_K tensors as (tensor name, ``Q6KWeight``) in file order, by group: "lm_head" (token_embd /
    output), "ffn_down", "attn_v"."""
    from gguf import GGMLQuantizationType, GGUFReader

    groups: dict[str, list[tuple[str, Q6KWeight]]] = {}
    for t in GGUFReader(path).tensors:
        if t.tensor_type != GGMLQuantizationType.Q6_K:
            continue
        K, N = (int(s) for s in t.shape[:2])
        name = "lm_head" if t.name.split(".")[0] in ("token_embd", "output") else t.name.split(".")[2]
        groups.setdefault(name, []).append((t.name, q6_k_blocks(np.asarray(t.data).reshape(N, -1), N, K)))
    return groups


def prefill(path: str, rows: int, rounds: int) -> None:
    """The ``--prefill`` A/B (see the module doc) on the file's first Q6_K ``ffn_down``."""
    name, q6 = q6_k_groups(path)["ffn_down"][0]
    q8 = quantize_q8_0(q6.dequantize())
    N, K = q6.shape
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(0))
    fns = {"Q6_K q6k_linear": lambda: native_quant.q6k_linear(x, q6),
           "Q8_0 block_prefill_linear": lambda: native_quant.block_prefill_linear(x, q8)}
    alternate(fns, 1)  # warm-up: first-use compilation, page faults, the per-thread buffers
    med = alternate(fns, rounds)
    print(f"prefill: x [{rows}, {K}] @ {name} [{N}, {K}]^T; Q8_0 tiled: {native_quant.prefill_tiled()}")
    for form, t in med.items():
        print(f"  {form:26s} {t * 1e3:9.2f} ms  {2 * rows * N * K / t / 1e9:7.1f} G int-ops/s")
    a, b = med["Q6_K q6k_linear"], med["Q8_0 block_prefill_linear"]
    print(f"  Q6_K time / Q8_0 time: {a / b:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="a Llama-family GGUF with Q6_K tensors (e.g. Q4_K_M)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", action="store_true", help="many rows through one ffn_down (see the module doc)")
    ap.add_argument("--rows", type=int, default=512, help="--prefill: rows of x")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, {args.rounds} rounds (medians); {native_quant.simd_name()}")
    if args.prefill:
        prefill(args.gguf, args.rows, args.rounds)
        return
    for name, pairs in q6_k_groups(args.gguf).items():
        q6 = [w for _, w in pairs]
        q8 = [quantize_q8_0(w.dequantize()) for w in q6]
        xs = {K: torch.randn(1, K, generator=g) for K in {w.shape[1] for w in q6}}

        def run_q6k(ws=q6, xs=xs):
            for w in ws:
                native_quant.q6k_linear(xs[w.shape[1]], w)

        def run_q8_0(ws=q8, xs=xs):
            for w in ws:
                native_quant.int8_linear(xs[w.shape[1]], w)

        fns = {"Q6_K as stored": run_q6k, "Q8_0 re-quantized": run_q8_0}
        alternate(fns, 1)  # warm-up: first-use compilation, page faults
        med = alternate(fns, args.rounds)
        nbytes = {"Q6_K as stored": sum(w.nbytes for w in q6), "Q8_0 re-quantized": sum(w.nbytes for w in q8)}
        print(f"{name}: {len(q6)} x {list(q6[0].shape)}")
        for form, t in med.items():
            print(f"  {form:18s} {nbytes[form] / 1e6:8.1f} MB  {t * 1e3:8.2f} ms  {nbytes[form] / t / 1e9:6.1f} GB/s")
        a, b = med["Q6_K as stored"], med["Q8_0 re-quantized"]
        print(f"  Q8_0 / Q6_K: bytes {nbytes['Q8_0 re-quantized'] / nbytes['Q6_K as stored']:.3f}, time {b / a:.3f}")
        del q8


if __name__ == "__main__":
    main()
