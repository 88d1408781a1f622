"""Reference attention: the answer key the kernels (``minillm.kernels``) are tested against.

All functions take q [B, H_q, L, D] and k, v [B, H_kv, S, D] with H_q a multiple of H_kv, and share K/V
heads across query groups by *viewing* q as [B, H_kv, G·L, D] (G = H_q / H_kv): no K/V copies, unlike
``repeat_interleave``.  Query head h uses K/V head h // G, as in transformers' ``repeat_kv``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int, int]:
    """Check q [B, H_q, L, D] and k, v [B, H_kv, S, D] (H_q a multiple of H_kv); -> (B, H_q, H_kv, L, S, D)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"need q [B, H_q, L, D] and k, v [B, H_kv, S, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, L, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B or Dk != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D, or H_q % H_kv != 0")
    return B, Hq, Hkv, L, S, D


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, causal: bool = False,
                      scale: float | None = None) -> Tensor:
    """Softmax(q kᵀ · scale + mask) v, materialising the [L, S] scores (fp32 softmax).  -> [B, H_q, L, D].

    ``mask``: bool, True = may attend, broadcastable to [B, 1, L, S].  ``causal``: query i (the i-th of the
    last L positions) sees keys j ≤ S - L + i.  Cost: 4·B·H_q·L·S·D FLOPs and B·H_q·L·S score bytes in memory —
    fine for decode (L = 1), the reason FlashAttention exists for long prefills.
    """
    B, Hq, Hkv, L, S, D = check_qkv(q, k, v)
    scale = D**-0.5 if scale is None else scale
    ### BEGIN SOLUTION
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * L, D)  # consecutive query heads share a K/V head
    scores = (qg @ k.transpose(-1, -2)).float().view(B, Hkv, G, L, S) * scale
    if causal:
        allowed = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # (B, 1, 1, L, S)
    probs = scores.softmax(dim=-1).to(v.dtype).view(B, Hkv, G * L, S)
    return (probs @ v).view(B, Hq, L, D)
    ### END SOLUTION


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, causal: bool = False,
                   scale: float | None = None) -> Tensor:
    """The same through ``F.scaled_dot_product_attention`` (fused on CPU and CUDA).  -> [B, H_q, L, D]."""
    _, Hq, Hkv, L, S, _ = check_qkv(q, k, v)
    if causal and mask is None and L != S:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)[None, None]
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and L > 1, scale=scale,
                                          enable_gqa=Hq != Hkv)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor, *, scale: float | None = None) -> Tensor:
    """One new query per sequence over its first ``seq_lens[b]`` cached keys.

    q [B, H_q, D], k/v [B, H_kv, S_max, D], seq_lens [B] (1 ≤ len ≤ S_max) -> [B, H_q, D].
    """
    if q.dim() != 3 or seq_lens.shape != (q.shape[0],):
        raise ValueError(f"need q [B, H_q, D] and seq_lens [B]; got {tuple(q.shape)}, {tuple(seq_lens.shape)}")
    S = k.shape[2]
    mask = (torch.arange(S, device=q.device) < seq_lens[:, None].to(q.device))[:, None, None, :]  # (B, 1, 1, S)
    return grouped_attention(q[:, :, None], k, v, mask, scale=scale)[:, :, 0]


def paged_decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                               scale: float | None = None) -> Tensor:
    """Decode attention over a paged cache, by gathering each sequence's blocks into a contiguous copy.

    q [B, H_q, D]; k_cache/v_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] (logical
    block j of sequence b is physical block block_tables[b, j]); seq_lens [B] -> [B, H_q, D].  Entries past a
    sequence's last block are never read (engines pad tables with anything, even ids past the pool).  Sequence
    b's position p is row ``p % block_size`` of physical block ``block_tables[b, p // block_size]``.  The gather
    copies B·max_blocks·block_size·H_kv·D elements per tensor — the traffic a paged kernel avoids.  The output
    equals ``decode_attention`` over the same K/V stored contiguously (exercise 5.4: the engine's torch path).
    """
    ### BEGIN SOLUTION
    B, max_blocks = block_tables.shape
    block_size = k_cache.shape[1]
    n_used = (seq_lens.to(block_tables.device) + block_size - 1) // block_size
    used = torch.arange(max_blocks, device=block_tables.device) < n_used[:, None]
    ids = torch.where(used, block_tables, 0).long().to(k_cache.device)  # padding entries → block 0, masked below

    def gather(cache: Tensor) -> Tensor:  # (B, max_blocks, block_size, H_kv, D) -> (B, H_kv, S_max, D)
        x = cache[ids].flatten(1, 2)
        return x.transpose(1, 2)

    return decode_attention(q, gather(k_cache), gather(v_cache), seq_lens, scale=scale)
    ### END SOLUTION


def kept_keys(query_pos: Tensor, key_pos: Tensor, window: int = 0, sinks: int = 0) -> Tensor:
    """Which keys each query attends to: bool, query_pos [..., Q, 1] against key_pos [..., 1, K] (anything that
    broadcasts).  Causal (key ≤ query); with ``window`` W > 0 only the last W keys (the query's own included) and
    the first ``sinks`` keys — the rule of ``kv.eviction.KVEvictionPolicy``; window 0: every earlier key."""
    kept = key_pos <= query_pos
    if window:
        kept = kept & ((query_pos - key_pos < window) | (key_pos < sinks))
    return kept


def paged_kept_kv(k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, window: int = 0,
                  sinks: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Each decode query's keys and values gathered from a paged cache, and which of them it attends to:
    (k, v [B, H_kv, S_max, D], kept [B, S_max] bool).  Kept: ``kept_keys`` for the query at position
    seq_lens[b] - 1 (window 0: every earlier key), and never a key of a block whose table entry is negative
    (``kv.eviction.EVICTED``: freed).  Table entries of blocks holding no kept key may be anything (padding,
    evicted blocks); they are gathered as some valid block and masked.  Cost: the gather copies
    B·max_blocks·block_size·H_kv·D elements per tensor."""
    B, max_blocks = block_tables.shape
    block_size = k_cache.shape[1]
    lens = seq_lens.to(k_cache.device).long()
    tables = block_tables.long().to(k_cache.device)
    key_pos = torch.arange(max_blocks * block_size, device=k_cache.device)
    held = (tables >= 0).repeat_interleave(block_size, 1)  # (B, S_max): False for an evicted block's keys
    kept = kept_keys(lens[:, None] - 1, key_pos, window, sinks) & held  # (B, S_max)
    ids = tables.clamp(0, k_cache.shape[0] - 1)  # padding and evicted entries: any valid id (masked)
    k = k_cache[ids].flatten(1, 2).transpose(1, 2)  # (B, H_kv, S_max, D)
    v = v_cache[ids].flatten(1, 2).transpose(1, 2)
    return k, v, kept


def paged_window_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                               seq_lens: Tensor, scale: float | None = None, window: int = 0,
                               sinks: int = 0) -> Tensor:
    """``paged_decode_attention_ref`` where the query at position seq_lens[b] - 1 sees only the keys
    ``paged_kept_kv`` keeps (a sliding window of ``window`` keys plus ``sinks`` first keys, window 0: all of them;
    never a block whose table entry is negative).  Shapes as there; the same gather cost."""
    k, v, kept = paged_kept_kv(k_cache, v_cache, block_tables, seq_lens, window, sinks)
    return grouped_attention(q[:, :, None], k, v, kept[:, None, None], scale=scale)[:, :, 0]


def attention_with_mass(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float | None = None
                        ) -> tuple[Tensor, Tensor]:
    """``grouped_attention`` under a bool ``mask`` [B, 1, L, S] that also returns each key's attention mass:
    (out [B, H_q, L, D], mass [B, S] fp32 = the softmax probabilities summed over query heads and queries — H2O's
    score of one layer).  Cost: grouped_attention's (the [L, S] probabilities are materialised anyway) plus one
    B·H_q·L·S reduction; only a mass-scored eviction policy pays it."""
    B, Hq, Hkv, L, S, D = check_qkv(q, k, v)
    scale = D**-0.5 if scale is None else scale
    G = Hq // Hkv
    scores = (q.reshape(B, Hkv, G * L, D) @ k.transpose(-1, -2)).float().view(B, Hkv, G, L, S) * scale
    probs = scores.masked_fill(~mask[:, :, None], float("-inf")).softmax(dim=-1)  # (B, H_kv, G, L, S)
    out = (probs.to(v.dtype).view(B, Hkv, G * L, S) @ v).view(B, Hq, L, D)
    return out, probs.sum((1, 2, 3))


def paged_attention_with_mass(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                              seq_lens: Tensor, scale: float | None = None, window: int = 0,
                              sinks: int = 0) -> tuple[Tensor, Tensor]:
    """``paged_window_attention_ref`` that also returns each key's mass: (out [B, H_q, D], mass [B, S_max] fp32,
    key s of row b at logical position s, 0 for keys not attended to).  The gather + softmax cost of the
    reference: the path a mass-scored eviction policy (H2O) runs instead of the paged kernels."""
    k, v, kept = paged_kept_kv(k_cache, v_cache, block_tables, seq_lens, window, sinks)
    out, mass = attention_with_mass(q[:, :, None], k, v, kept[:, None, None], scale=scale)
    return out[:, :, 0], mass


def attention_partial(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One split of flash-decoding: the softmax pieces of q over a chunk of keys, unnormalised.

    q [..., G, D], k/v [..., N, D] -> (m [..., G] running max of the scores, l [..., G] = Σ exp(s - m),
    o [..., G, D] = Σ exp(s - m) v), all fp32.  An empty chunk (N = 0) gives m = -inf, l = 0, o = 0.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale  # (..., G, N)
    m = s.amax(-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
    p = torch.exp(s - m[..., None]) if s.shape[-1] else s
    return m, p.sum(-1), p @ v.float()


def flash_tile_step(m: Tensor, den: Tensor, acc: Tensor, q: Tensor, k_tile: Tensor, v_tile: Tensor,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One step of FlashAttention's online softmax: fold a tile of N keys into the running state of M queries.

    State (fp32): m [..., M] running max of the scores seen so far, den [..., M] = Σ exp(s - m) (the paper's ℓ),
    acc [..., M, D] = Σ exp(s - m) v, unnormalised.  Start from m = -inf, den = 0, acc = 0; after the last tile
    the output is acc / den[..., None].  q [..., M, D], k_tile / v_tile [..., N, D] (leading dims broadcast, so
    GQA works on q viewed as [B, H_kv, G·M, D]) -> the new (m, den, acc).  Only an [M, N] score tile ever exists:
    this is the loop body of ``kernels/triton/flash.py`` (which works in base-2 exponentials), in
    PyTorch.  Reference for a whole sequence of tiles: ``grouped_attention``.
    """
    ### BEGIN SOLUTION
    s = (q.float() @ k_tile.float().transpose(-1, -2)) * scale  # (..., M, N): this tile's scores
    m_new = torch.maximum(m, s.amax(-1))
    alpha = torch.exp(m - m_new)  # rescales what was summed under the old max; 0 on the first tile (m = -inf)
    p = torch.exp(s - m_new[..., None])  # ≤ 1: no overflow whatever the scores
    return m_new, den * alpha + p.sum(-1), acc * alpha[..., None] + p @ v_tile.float()
    ### END SOLUTION


def merge_attention_partials(m: Tensor, den: Tensor, o: Tensor) -> Tensor:
    """Merge flash-decoding splits exactly: softmax over the union of chunks from per-chunk pieces.

    m, den (= l) [..., P] and o [..., P, D] for P splits (from ``attention_partial``) -> [..., D] fp32.  Each split is
    rescaled to the global max M: o = Σ_p e^{m_p - M} o_p / Σ_p e^{m_p - M} den_p (log-sum-exp); empty splits
    (m = -inf) get weight 0.  At least one split must be non-empty.
    """
    ### BEGIN SOLUTION
    M = m.amax(-1, keepdim=True)  # (..., 1)
    w = torch.exp(m - M)  # (..., P); exp(-inf) = 0 for empty splits
    return (w[..., None] * o).sum(-2) / (w * den).sum(-1)[..., None]
    ### END SOLUTION
