"""Flash-decoding in Triton.  Reference: ``minillm.kernels.reference.decode_attention`` (merge:
``minillm.kernels.reference.merge_attention_partials``).

q [B, H_q, D] (one new token per sequence), k/v [B, H_kv, S_max, D], seq_lens [B] -> o [B, H_q, D].

Why split.  Decode has one query per sequence, so FlashAttention's parallelism over query tiles is gone: with
B·H_kv programs (8 for one sequence of an 8-KV-head model) most of a 132-SM GPU would idle while one program
streams the whole context.  Flash-decoding splits the KV length into ``num_splits`` chunks, one program per
(batch, K/V head, chunk), so long contexts at small batch still fill the machine.

Pass 1 (``_decode_partial_kernel``): the program for (b, K/V head g, split p) loads the G = H_q / H_kv query
heads that share head g as one [BLOCK_G, D] tile — K and V are read from HBM once per *group*, not once per query
head, which is GQA's bandwidth saving — and runs the online softmax over keys [p·split_size, (p+1)·split_size)
∩ [0, seq_lens[b]).  It writes the partial max m_p (log2 units), sum l_p and unnormalised output o_p (fp32).
Splits past a sequence's length read nothing and write m = -inf, l = 0, o = 0.
Pass 2 (``_merge_kernel``): per (b, query head), M = max_p m_p, o = Σ_p 2^(m_p - M) o_p / Σ_p 2^(m_p - M) l_p —
exact, the log-sum-exp identity, not an approximation.

Bytes: K/V read once, 2·B·H_kv·S·D elements (S the actual lengths), plus q, o and the partials
(B·H_q·num_splits·(D + 2) fp32 written and read back: ~1 % of K/V at S = 32k).  FLOPs: 4·B·H_q·S·D, so ~1 FLOP
per byte in bf16 at G = 4: deeply bandwidth bound; the figure of merit is GB/s of K/V read.

Splits: chunks of whole BLOCK_N = 64-key tiles, at least ``MIN_SPLIT`` = 128 keys, enough chunks that
B·H_kv·num_splits ≈ 4 programs per SM (``choose_split_size``); the number comes from S_max, not from the
per-sequence lengths, so no host sync is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minillm.kernels.triton.flash import LOG2E, last_dim_contiguous, require_runnable
from minillm.kernels.validate import check_decode

BLOCK_N = 64  # keys per tile on GPU: 64 × D=128 × 2 B = 16 KB per K or V tile
INTERPRETER_BLOCK_N = 32  # small enough that tiny tests cross tile edges, big enough to keep them quick
MIN_SPLIT = 128  # keys per split at least: below this the partials' write/merge costs more than it parallelises
PROGRAMS_PER_SM = 4  # target B·H_kv·num_splits ≈ this × SM count (enough waves to hide the last one)


def decode_partial_program(Q, K, V, SeqLens, Mp, Lp, Op, sqb, sqh, skb, skh, skn, svb, svh, svn,
                           H_kv, D, GROUP, split_size, num_splits, qk_scale,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    """Pass 1 of flash-decoding, one program per (sequence b · K/V head, split): the body of
    ``_decode_partial_kernel`` (= ``triton.jit(decode_partial_program)``; exercise 4.3).

    Given (computed before the fence): ``q`` [BLOCK_G, BLOCK_D], the G = GROUP query heads sharing K/V head
    ``h_kv`` (rows ≥ GROUP and columns ≥ D are zero padding); ``k_base`` / ``v_base`` point at key/value 0 of this
    (b, h_kv), key n's row at ``+ n * skn`` / ``+ n * svn``, its elements contiguous; this program's keys are
    ``[start, end)`` (empty when the split lies past the sequence); ``d_mask`` marks the D real columns.
    Leave for the stores after the fence, all fp32: ``m_i`` [BLOCK_G] the running max of the scores in **log2
    units** (``qk_scale`` already includes log2(e): use ``tl.exp2``), ``l_i`` [BLOCK_G] = Σ 2^(s − m_i) and
    ``acc`` [BLOCK_G, BLOCK_D] = Σ 2^(s − m_i) v.  An empty range must leave m_i = -inf, l_i = 0, acc = 0.
    Walk the keys in tiles of BLOCK_N (a tile may be ragged at ``end``: mask what lies past it), loading each
    K and V tile once for the whole group; ``tl.dot(..., input_precision=DOT_PRECISION)`` multiplies tiles.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H_kv
    h_kv = pid % H_kv
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = h_kv * GROUP + offs_g  # the query heads sharing K/V head h_kv
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * sqb + heads[:, None] * sqh + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :],
                other=0.0)  # [G, D]
    k_base = K + b64 * skb + h_kv * skh
    v_base = V + b64 * svb + h_kv * svh

    ### BEGIN SOLUTION
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):  # empty when the split lies past seq_len
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))  # the first tile has ≥ 1 valid key, so m stays finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    ### END SOLUTION

    row = (b64 * H_kv * GROUP + heads) * num_splits + split  # partials are [B, H_q, num_splits(, D)], contiguous
    tl.store(Mp + row, m_i, mask=g_mask)
    tl.store(Lp + row, l_i, mask=g_mask)
    tl.store(Op + row[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


_decode_partial_kernel = triton.jit(decode_partial_program)


@triton.jit
def _merge_kernel(Mp, Lp, Op, Out, sob, soh, H_q, D, num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (b, query head): o = Σ_p 2^(m_p - M) o_p / Σ_p 2^(m_p - M) l_p."""
    pid = tl.program_id(0)
    b = pid // H_q
    h = pid % H_q
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    row = pid.to(tl.int64) * num_splits + offs_s
    m = tl.load(Mp + row, mask=s_mask, other=float("-inf"))
    den = tl.load(Lp + row, mask=s_mask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # empty splits: exp2(-inf) = 0; split 0 is never empty (seq_len ≥ 1)
    o = tl.load(Op + row[:, None] * D + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(den * w, 0)
    tl.store(Out + b.to(tl.int64) * sob + h * soh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def _interpreted() -> bool:
    return type(_decode_partial_kernel).__name__ == "InterpretedFunction"


def choose_split_size(B: int, H_kv: int, S_max: int, device: torch.device, block_n: int) -> int:
    """Keys per split: whole tiles, ≥ MIN_SPLIT, and about PROGRAMS_PER_SM programs per SM in total."""
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    want = max(1, triton.cdiv(PROGRAMS_PER_SM * n_sm, B * H_kv))
    splits = max(1, min(want, S_max // MIN_SPLIT))
    return triton.cdiv(triton.cdiv(S_max, splits), block_n) * block_n


def merge_partials(m: Tensor, den: Tensor, o: Tensor, out: Tensor) -> Tensor:
    """Pass 2: write the merged [B, H_q, D] output into ``out`` from partials m, den [B, H_q, P], o [B, H_q, P, D]."""
    B, Hq, P, D = o.shape
    _merge_kernel[(B * Hq,)](m, den, o, out, out.stride(0), out.stride(1), Hq, D, P,
                             BLOCK_S=triton.next_power_of_2(P), BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out


def decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor, *, sm_scale: float | None = None,
                            split_size: int | None = None, block_n: int | None = None,
                            partial_kernel=None) -> Tensor:
    """Launch flash-decoding. q [B, H_q, D], k/v [B, H_kv, S_max, D], seq_lens [B] -> new [B, H_q, D].

    ``split_size`` (keys per split, any value ≥ 1) and ``block_n`` (keys per tile, power of two ≥ 16) override
    the defaults; tests use them to put split and tile edges everywhere.  ``partial_kernel`` replaces pass 1
    (``triton.jit`` of a function with ``decode_partial_program``'s signature: notebook 04 runs the student's).
    """
    B, Hq, Hkv, S_max, D = check_decode(q, k, v, seq_lens)
    require_runnable(q.device, _interpreted())
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    block_n = block_n or (INTERPRETER_BLOCK_N if _interpreted() else BLOCK_N)
    split_size = split_size or choose_split_size(B, Hkv, S_max, q.device, block_n)
    if split_size < 1:
        raise ValueError(f"split_size must be ≥ 1, got {split_size}")
    num_splits = triton.cdiv(S_max, split_size)
    G = Hq // Hkv
    scale = D**-0.5 if sm_scale is None else sm_scale
    m = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    den = torch.empty_like(m)
    o_part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    (partial_kernel or _decode_partial_kernel)[(B * Hkv, num_splits)](
        q, k, v, seq_lens, m, den, o_part, q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3],
        Hkv, D, G, split_size, num_splits, scale * LOG2E,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    return merge_partials(m, den, o_part, torch.empty(B, Hq, D, dtype=q.dtype, device=q.device))
