"""Paged flash-decoding in Triton.  Reference: ``minillm.kernels.reference.paged_decode_attention_ref`` (gather, then
``decode_attention``).

q [B, H_q, D]; k_cache/v_cache [num_blocks, block_size, H_kv, D] (vLLM's layout: a block holds block_size tokens
of every K/V head); block_tables [B, max_blocks] int32; seq_lens [B] -> o [B, H_q, D].

The kernel is ``triton_decode_attention``'s two passes with one change: keys are not at ``base + n·stride`` but
wherever the block table says.  For key n of sequence b the program loads the physical block
``block_tables[b, n // block_size]`` and the slot ``n % block_size``, so a tile of BLOCK_N keys may span several
scattered blocks (each token's D-vector of one head is still contiguous: a D·2-byte row, 256 B at D = 128 bf16,
so loads stay coalesced).  Nothing is gathered into a contiguous copy, unlike the reference, which moves every
block twice more (read + write of the copy) before attention reads it again.

Splits cover whole tiles of BLOCK_N keys (= BLOCK_N / block_size blocks when block_size divides BLOCK_N) and are
sized from max_blocks·block_size exactly as in ``triton_decode_attention.choose_split_size``; the merge kernel is
shared.  Bytes: the K/V of the used blocks once, plus 4 bytes of block table per key tile (BLOCK_N / block_size
entries, cached), plus the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minillm.kernels.triton.decode import BLOCK_N, INTERPRETER_BLOCK_N, choose_split_size, merge_partials
from minillm.kernels.triton.flash import LOG2E, last_dim_contiguous, require_runnable
from minillm.kernels.validate import check_paged


@triton.jit
def kept_key_mask(offs_n, end, seq_len, WINDOW, SINKS):
    """Which keys ``offs_n`` [N] of a tile this query reads: those before ``end`` and, with a window (WINDOW > 0),
    only the last WINDOW keys and the first SINKS (``reference.kept_keys``; the rest were evicted: never loaded)."""
    n_mask = offs_n < end
    if WINDOW > 0:
        n_mask = n_mask & ((offs_n >= seq_len - WINDOW) | (offs_n < SINKS))
    return n_mask


def paged_partial_program(Q, KC, VC, BlockTables, SeqLens, Mp, Lp, Op, sqb, sqh, skc0, skc1, skc2, svc0, svc1,
                          svc2, sbt, H_kv, D, GROUP, split_size, num_splits, qk_scale, WINDOW, SINKS,
                          BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Pass 1 of paged flash-decoding, one program per (sequence b · K/V head, split): the body of
    ``_paged_partial_kernel`` (= ``triton.jit(paged_partial_program)``; exercise 5.5).

    Given (computed before the fence): ``q`` [BLOCK_G, BLOCK_D], the G = GROUP query heads sharing K/V head
    ``h_kv`` (rows ≥ GROUP and columns ≥ D are zero padding); ``table``, a pointer to this sequence's row of the
    block table (entry j = the physical block of logical block j, int32); the caches hold key n of this sequence
    in physical block p = table[n // BLOCK_SIZE] at slot n % BLOCK_SIZE, so the D elements of head ``h_kv`` start
    at ``KC + p * skc0 + slot * skc1 + h_kv * skc2`` (likewise ``VC`` with ``svc*``; p is int32 in the table:
    widen it to int64 before multiplying, a pool can exceed 2³¹ elements); this program's keys are
    ``[start, end)`` (empty when the split lies past the sequence), and of those only the ones
    ``kept_key_mask(offs_n, end, seq_len, WINDOW, SINKS)`` keeps (a sliding window evicts keys: a whole tile may be
    masked, so never compute -inf - -inf); ``d_mask`` marks the D real columns.
    Leave for the stores after the fence, all fp32: ``m_i`` [BLOCK_G] the running max of the scores in **log2
    units** (``qk_scale`` already includes log2(e): use ``tl.exp2``), ``l_i`` [BLOCK_G] = Σ 2^(s − m_i) and
    ``acc`` [BLOCK_G, BLOCK_D] = Σ 2^(s − m_i) v.  An empty range must leave m_i = -inf, l_i = 0, acc = 0.
    Walk the keys in tiles of BLOCK_N (a tile may span several scattered blocks, and be ragged at ``end``: mask
    what lies past it, and never read a table entry past the sequence's last block), loading each K and V tile
    once for the whole group; ``tl.dot(..., input_precision=DOT_PRECISION)`` multiplies tiles.
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
    table = BlockTables + b64 * sbt

    ### BEGIN SOLUTION
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = kept_key_mask(offs_n, end, seq_len, WINDOW, SINKS)  # [N]: inside [start, end) and not evicted
        kv_mask = n_mask[:, None] & d_mask[None, :]
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)  # physical block per key
        slot = offs_n % BLOCK_SIZE
        k = tl.load(KC + (block * skc0 + slot * skc1 + h_kv * skc2)[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of evicted keys only: no -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + (block * svc0 + slot * svc1 + h_kv * svc2)[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    ### END SOLUTION

    row = (b64 * H_kv * GROUP + heads) * num_splits + split  # partials are [B, H_q, num_splits(, D)], contiguous
    tl.store(Mp + row, m_i, mask=g_mask)
    tl.store(Lp + row, l_i, mask=g_mask)
    tl.store(Op + row[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


_paged_partial_kernel = triton.jit(paged_partial_program)


def _interpreted() -> bool:
    return type(_paged_partial_kernel).__name__ == "InterpretedFunction"


def paged_decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                  seq_lens: Tensor, *, sm_scale: float | None = None, split_size: int | None = None,
                                  block_n: int | None = None, window: int = 0, sinks: int = 0,
                                  partial_kernel=None) -> Tensor:
    """Launch paged flash-decoding -> new [B, H_q, D].  Shapes as in the module docstring.

    ``window`` > 0: each query sees only its last ``window`` keys and the first ``sinks``
    (``reference.paged_window_attention_ref``); the other keys are masked out of their tiles and never loaded.

    ``split_size`` (keys per split, ≥ 1) and ``block_n`` (keys per tile, power of two ≥ 16) override the defaults.
    ``partial_kernel`` replaces pass 1 (``triton.jit`` of a function with ``paged_partial_program``'s signature:
    notebook 05 runs the student's).
    """
    B, Hq, Hkv, block_size, D = check_paged(q, k_cache, v_cache, block_tables, seq_lens)
    require_runnable(q.device, _interpreted())
    q, k_cache, v_cache = last_dim_contiguous(q), last_dim_contiguous(k_cache), last_dim_contiguous(v_cache)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()  # tiny; the kernel indexes a row as table + j
    S_max = block_tables.shape[1] * block_size
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
    (partial_kernel or _paged_partial_kernel)[(B * Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, m, den, o_part, q.stride(0), q.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], block_tables.stride(0), Hkv, D, G, split_size, num_splits, scale * LOG2E, window, sinks,
        BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    return merge_partials(m, den, o_part, torch.empty(B, Hq, D, dtype=q.dtype, device=q.device))
