"""FlashAttention-2 style prefill attention in Triton.  Reference: ``minillm.kernels.reference.grouped_attention``.

q [B, H_q, L, D], k/v [B, H_kv, S, D] -> o [B, H_q, L, D], optionally causal with the L queries at the last L of
the S positions (query i sees keys j ≤ S - L + i, so chunked prefill against a cached prefix works unchanged).

Algorithm.  One program per (tile of BLOCK_M queries, batch, query head).  It loads its Q tile once, then streams
K/V tiles of BLOCK_N keys from HBM, computing scores s = q kᵀ · scale [BLOCK_M, BLOCK_N] in registers and folding
them into an *online softmax*: a running row max m, running denominator l and an unnormalised fp32 accumulator
acc; when a tile raises the max from m to m', the old l and acc are rescaled by exp(m - m').  The output
acc / l is written once.  Scores never reach HBM.  Exponentials use exp2 with log2(e) folded into the scale.
- GQA: query head h reads K/V head h // (H_q / H_kv) in place (no repeat_interleave copies).
- Causal: K tiles entirely above the diagonal are never visited; tiles entirely below it skip the mask work
  (the loop is split into an unmasked and a masked part).  Ragged L, S and D are handled by masks.

Bytes and FLOPs.  Naive attention writes and reads the B·H_q·L·S score (and probability) matrix; this kernel
reads q and writes o once (2·B·H_q·L·D elements) and reads K and V once per query tile
(2·B·H_q·S·D·ceil(L / BLOCK_M) elements, halved by causal skipping) — these re-reads mostly hit L2.
FLOPs: 4·B·H_q·D·(number of (query, key) pairs visited); causal visits about half of L·S.

Block sizes: on GPU BLOCK_M = 128, BLOCK_N = 64 (smaller when the GPU lacks shared memory, see ``_CONFIGS``);
in the interpreter 32 × 32 (fewer, bigger numpy steps; tests still cross ragged tiles, and a test runs 16 × 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from minillm.kernels.validate import check_prefill

LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log2 e); exp2 is the GPU's native exponential


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, S, D, causal_shift,
                  qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Fold key tiles [lo, hi) into the running (acc, l, m).  MASKED tiles check k < S and the causal diagonal."""
    offs_n0 = tl.arange(0, BLOCK_N)
    d_mask = offs_d[None, :] < D
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = d_mask
        if MASKED:
            kv_mask = kv_mask & (offs_n[:, None] < S)
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N] fp32, log2 units
        if MASKED:
            allowed = offs_n[None, :] < S
            if CAUSAL:
                allowed = allowed & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max (0 on the first tile)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(Q, K, V, Out, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                      H_q, L, S, D, GROUP, qk_scale,
                      CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H_q).to(tl.int64)  # int64: batch offsets of big tensors overflow int32
    h = bh % H_q
    h_kv = h // GROUP  # GQA: consecutive query heads share a K/V head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (offs_m[:, None] < L) & (offs_d[None, :] < D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=io_mask, other=0.0)
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    causal_shift = S - L  # query i sits at absolute position S - L + i
    if CAUSAL:
        hi = tl.minimum(S, causal_shift + start_m + BLOCK_M)  # keys past the tile's last row: never visited
        full = tl.minimum(S, causal_shift + start_m + 1)  # keys every row of the tile may see
    else:
        hi = S
        full = S
    full = (full // BLOCK_N) * BLOCK_N  # whole tiles needing no mask
    # Key 0 is visible to every row, and it is in the first tile visited, so m is finite after that tile
    # and fully-masked later tiles contribute exp2(-inf) = 0 without NaNs.
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, skn, svn, offs_m, offs_d, 0, full, S, D,
                                  causal_shift, qk_scale, BLOCK_N, False, CAUSAL, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, skn, svn, offs_m, offs_d, full, hi, S, D,
                                  causal_shift, qk_scale, BLOCK_N, True, CAUSAL, DOT_PRECISION)
    o = acc / l_i[:, None]
    o_ptrs = Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :]
    tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=io_mask)


# (BLOCK_M, BLOCK_N, num_warps, num_stages), largest first; a config that needs more shared memory than the GPU has
# raises OutOfResources at launch and the next is tried.  128×64 with 8 warps is the Triton tutorial's choice for
# D = 128 on A100/H100 (~128 KB of shared memory at 3 stages); 64×32 fits 64 KB GPUs such as the T4.
_CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 1)]
_INTERPRETER_CONFIG = (32, 32, 1, 1)
_chosen: dict[tuple, int] = {}  # (device index, D block, dtype) -> index into _CONFIGS that launched


def _interpreted() -> bool:
    return type(_flash_fwd_kernel).__name__ == "InterpretedFunction"


def require_runnable(device: torch.device, interpreted: bool) -> None:
    """Raise RuntimeError when Triton kernels defined in this process cannot run on ``device``."""
    if device.type != "cuda" and not interpreted:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before minillm's Triton "
                           "kernel modules are first imported")


def last_dim_contiguous(x: Tensor) -> Tensor:
    """The kernels take any strides except along D, which must be 1 for vector loads; copy only if it is not."""
    return x if x.stride(-1) == 1 else x.contiguous()


def flash_attention_triton(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, sm_scale: float | None = None,
                           block_m: int | None = None, block_n: int | None = None) -> Tensor:
    """Launch the prefill kernel. q [B, H_q, L, D], k/v [B, H_kv, S, D] -> new [B, H_q, L, D] in q's dtype.

    ``block_m``/``block_n`` override the tile sizes (powers of two ≥ 16; tests use them to cross tile edges).
    """
    B, Hq, Hkv, L, S, D = check_prefill(q, k, v, causal)
    require_runnable(q.device, _interpreted())
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    o = torch.empty(B, Hq, L, D, dtype=q.dtype, device=q.device)
    scale = D**-0.5 if sm_scale is None else sm_scale
    BLOCK_D = max(16, triton.next_power_of_2(D))  # tl.dot needs every dimension ≥ 16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (no TF32); 16-bit ignores this

    def launch(bm: int, bn: int, warps: int, stages: int) -> None:
        grid = (triton.cdiv(L, bm), B * Hq)
        _flash_fwd_kernel[grid](q, k, v, o, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                                Hq, L, S, D, Hq // Hkv, scale * LOG2E, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
                                BLOCK_D=BLOCK_D, DOT_PRECISION=precision, num_warps=warps, num_stages=stages)

    if block_m or block_n or _interpreted():
        bm, bn, warps, stages = _INTERPRETER_CONFIG if _interpreted() else _CONFIGS[0]
        launch(block_m or bm, block_n or bn, warps, stages)
        return o
    key = (q.device.index, BLOCK_D, q.dtype)
    for i in range(_chosen.get(key, 0), len(_CONFIGS)):
        try:
            launch(*_CONFIGS[i])
        except OutOfResources:
            continue
        _chosen[key] = i
        return o
    raise RuntimeError(f"no flash-attention tile configuration fits this GPU's shared memory for D = {D}")
