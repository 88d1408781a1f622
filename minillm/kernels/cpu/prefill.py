"""Causal prefill attention on CPU: ATen's flash kernel over query tiles, each against only the keys it can see.

ATen's CPU flash-attention kernel (what ``F.scaled_dot_product_attention`` runs on CPU, with a mask or
``is_causal``, GQA included) computes every query block against whole key blocks of up to 512 keys: its causal
skip works at that granularity, and an explicit mask (a chunk after a cached prefix, L < S) skips nothing.  So a
chunk of L ≤ 512 queries pays for all L·S scores although causality leaves about half of them.  Splitting the
queries into tiles of ``PREFILL_TILE`` rows and giving each tile only the keys up to its own last position costs
L·(S - L) + L²/2 + L·tile/2 score FLOPs instead of L·S (for a 300-token chunk after a 32-token cached prefix,
about two thirds), for one SDPA call per tile.  Reference: ``kernels.reference.grouped_attention(causal=True)``.
"""

from __future__ import annotations

from torch import Tensor

from minillm.kernels.reference import sdpa_attention

PREFILL_TILE = 64  # query rows per SDPA call: smaller tiles skip more masked scores, each call has a fixed cost


def tiled_prefill_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, sm_scale: float | None = None,
                            tile: int | None = None) -> Tensor:
    """q [B, H_q, L, D], k/v [B, H_kv, S, D] (L ≤ S when causal: the queries are the last L positions)
    -> [B, H_q, L, D], as ``sdpa_attention``; causal chunks longer than ``tile`` run one SDPA call per ``tile``
    queries over the first S - L + (tile end) keys; ``tile`` defaults to ``PREFILL_TILE``."""
    tile = PREFILL_TILE if tile is None else tile
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile must be an int >= 1 (query rows per SDPA call), got {tile!r}; omit it for "
                         f"PREFILL_TILE = {PREFILL_TILE}")
    L, S = q.shape[2], k.shape[2]
    if causal and L > S:
        raise ValueError(f"causal attention needs at least as many keys as queries (the queries are the last L "
                         f"positions), got L={L} queries and S={S} keys; pass the whole context's K/V")
    if not causal or L <= tile:
        return sdpa_attention(q, k, v, causal=causal, scale=sm_scale)
    out = q.new_empty(q.shape)
    prefix = S - L
    for i0 in range(0, L, tile):
        i1 = min(L, i0 + tile)  # this tile's queries are the last i1 - i0 of the first prefix + i1 keys
        out[:, :, i0:i1] = sdpa_attention(q[:, :, i0:i1], k[:, :, : prefix + i1], v[:, :, : prefix + i1],
                                          causal=True, scale=sm_scale)
    return out
