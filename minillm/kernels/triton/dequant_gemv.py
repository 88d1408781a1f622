"""Dequantizing GEMV in Triton for CUDA: y[M, N] = x[M, K] @ dequant(W)[N, K]^T for small M (decode).
References: ``minillm.quant.weight.int4_linear_ref`` / ``int8_linear_ref``.

One program per (BLOCK_N output rows, input row m).  It walks K in tiles of BLOCK_K weights, loads the packed
codes of a [BLOCK_N, BLOCK_K] tile, unpacks them in registers (Q4_1: weight k of a 32-block is the low nibble of
byte k mod 16 when k mod 32 < 16, else the high nibble), applies the group's scale (and min), and accumulates
Σ_k w·x in fp32.  Dequantized weights never touch memory, so the bytes moved are the packed ones: N·K/2 + 4·N·K/G
for int4 with fp16 scales and mins (5 bits per weight at G = 32), N·K + N·(bytes per scale)·K/G for int8.
Bandwidth bound: ~2 FLOPs per 0.625 byte at M = 1; the figure of merit is GB/s of packed weights read.
Each program re-reads its weight tile once per input row m, fine for decode (M ≤ 8; the tile hits L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minillm.kernels.triton.flash import _interpreted, require_runnable
from minillm.quant.weight import Int4Weight, Int8Weight

BLOCK_N = 32  # output rows per program
BLOCK_K = 128  # weights along K per step: a multiple of the 32-weight packing block; 4 KB of int4 codes per tile


def int4_gemv_program(X, P, S, Mn, Y, N, K, G, NG, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program of the int4 GEMV: output rows ``rows`` (BLOCK_N of them) for input row ``m``; the body of
    ``_int4_gemv_kernel`` (= ``triton.jit(int4_gemv_program)``; exercise 7.6).

    Inputs: ``X`` [M, K] activations (row m at ``X + m * K``); ``P`` uint8 [N, K/2] the packed Q4_1 codes (row n at
    ``P + n * (K // 2)``): in each block of 32 weights, byte j (0 ≤ j < 16) holds weight j in its low nibble and
    weight j + 16 in its high nibble, so weight k is in byte (k // 32) · 16 + k % 16, shifted right by 4 when
    k % 32 ≥ 16; ``S`` / ``Mn`` [N, NG] the scale d and minimum m of each group of ``G`` weights (NG = K / G),
    w = d · q + m; K is a multiple of 32 and of G.  Leave ``acc`` [BLOCK_N] fp32 = Σ_k w[row, k] · x[m, k] for the
    store after the fence (masked to ``rmask``).  Walk K in tiles of BLOCK_K (a multiple of 32; mask k ≥ K):
    load the tile's codes, unpack and dequantize them in registers, multiply by x and reduce over the tile — the
    float weight is never written anywhere, so the bytes read are the packed ones (4 bits + the group's d and m
    per weight).
    """
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ### BEGIN SOLUTION
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        byte = (ks // 32) * 16 + (ks % 16)  # Q4_1 packing: byte j of a block holds weights j and j + 16
        shift = ((ks % 32) // 16) * 4
        mask = rmask[:, None] & kmask[None, :]
        packed = tl.load(P + rows64[:, None] * (K // 2) + byte[None, :], mask=mask, other=0).to(tl.int32)
        q = ((packed >> shift[None, :]) & 0xF).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        gidx = rows64[:, None] * NG + (ks // G)[None, :]
        d = tl.load(S + gidx, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(Mn + gidx, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + m * K + ks, mask=kmask, other=0.0).to(tl.float32)
        acc += tl.sum((q * d + mn) * x[None, :], axis=1)
    ### END SOLUTION
    tl.store(Y + m * N + rows64, acc.to(Y.dtype.element_ty), mask=rmask)


_int4_gemv_kernel = triton.jit(int4_gemv_program)


@triton.jit
def _int8_gemv_kernel(X, W, S, Y, N, K, G, NG, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        mask = rmask[:, None] & kmask[None, :]
        q = tl.load(W + rows64[:, None] * K + ks[None, :], mask=mask, other=0).to(tl.float32)
        s = tl.load(S + rows64[:, None] * NG + (ks // G)[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + m * K + ks, mask=kmask, other=0.0).to(tl.float32)
        acc += tl.sum(q * s * x[None, :], axis=1)
    tl.store(Y + m * N + rows64, acc.to(Y.dtype.element_ty), mask=rmask)


def _launch_args(x: Tensor, K: int, N: int, tensors: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, tuple[int, int]]:
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K={K}")
    if any(t.device != x.device for t in tensors):
        raise ValueError("x and the packed weight must be on the same device")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32/fp16/bf16, got {x.dtype}")
    require_runnable(x.device, _interpreted())
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    return x2, y, (triton.cdiv(N, BLOCK_N), x2.shape[0])


def int4_gemv_triton(x: Tensor, w4: Int4Weight, *, program=None) -> Tensor:
    """x [..., K] @ dequant(w4).T -> [..., N] in x's dtype (fp32 accumulation); Q4_1-layout ``Int4Weight``.
    ``program`` replaces the kernel (``triton.jit`` of a function with ``int4_gemv_program``'s signature:
    notebook 07 runs the student's)."""
    N, K = w4.shape
    w4 = w4.expanded()  # K records (Q4_K's two levels, CPU tensors under TRITON_INTERPRET): fp32 d and m, same values
    x2, y, grid = _launch_args(x, K, N, (w4.packed, w4.scales))
    # a symmetric (Q4_0) weight: its m = −8·d materialised for the call (fp32 [N, K/G], the same values), as the
    # program takes Mn in every case — K/G more fp32 reads per row than Q4_1 itself, not the 18-byte Q4_0 block
    mins = w4.mins if w4.mins is not None else w4.mins_f32()
    (program or _int4_gemv_kernel)[grid](x2, w4.packed.contiguous(), w4.scales.contiguous(), mins.contiguous(),
                                         y, N, K, w4.group_size, K // w4.group_size, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.view(*x.shape[:-1], N)


def int8_gemv_triton(x: Tensor, w8: Int8Weight) -> Tensor:
    """x [..., K] @ dequant(w8).T -> [..., N] in x's dtype (fp32 accumulation)."""
    N, K = w8.shape
    x2, y, grid = _launch_args(x, K, N, (w8.qweight, w8.scales))
    _int8_gemv_kernel[grid](x2, w8.qweight.contiguous(), w8.scales.contiguous(), y, N, K, w8.group_size,
                            K // w8.group_size, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.view(*x.shape[:-1], N)
