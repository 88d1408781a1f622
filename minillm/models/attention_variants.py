"""Attention variants that shrink the KV cache: grouped heads (GQA/MQA), latent K/V (MLA), cross-layer sharing,
sliding windows — the converter for a loaded model and the calculators notebook 03 uses.

KV bytes per token for standard attention = 2 (K and V) × layers × H_kv × D × bytes per element
(``kv.quant.kv_bytes_per_token``); every variant here changes one factor of that product.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from minillm.config import ModelConfig
from minillm.models.llama import Transformer


def pool_kv_weight(weight: Tensor, num_heads: int, num_kv_heads: int, new_kv_heads: int,
                   head_dim: int) -> Tensor:
    """Mean-pool the K and V heads of a fused q/k/v projection from ``num_kv_heads`` to ``new_kv_heads`` heads.

    ``weight``: the projection's weight [(H_q + 2·H_kv)·D, hidden] or its bias [(H_q + 2·H_kv)·D], rows stacked as
    [q: H_q heads | k: H_kv heads | v: H_kv heads], D = ``head_dim`` rows per head, heads in order.  Returns the
    same layout with H_kv replaced by ``new_kv_heads``: [(H_q + 2·new)·D, hidden] (or [(H_q + 2·new)·D]).
    Invariants: the q rows are returned unchanged; with r = H_kv / new, new K head j is the element-wise mean of
    old K heads j·r … j·r + r − 1 (consecutive heads, so that query head h, which read K/V head h // (H_q / H_kv),
    now reads the pooled head of its old one), and likewise for V; the mean is taken in fp32 and the result has
    ``weight``'s dtype; ``new_kv_heads`` = H_kv returns equal values.  ``ValueError`` unless ``new_kv_heads`` ≥ 1
    divides H_kv, H_kv divides H_q, and ``weight`` has (H_q + 2·H_kv)·D rows.
    """
    ### BEGIN SOLUTION
    if new_kv_heads < 1 or num_kv_heads % new_kv_heads or num_heads % num_kv_heads:
        raise ValueError(f"new_kv_heads must divide H_kv = {num_kv_heads}, which must divide H_q = {num_heads}; "
                         f"got {new_kv_heads}")
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    if weight.shape[0] != q_rows + 2 * kv_rows:
        raise ValueError(f"weight has {weight.shape[0]} rows, expected (H_q + 2·H_kv)·D = {q_rows + 2 * kv_rows}")
    q, k, v = weight.split([q_rows, kv_rows, kv_rows])
    r, rest = num_kv_heads // new_kv_heads, weight.shape[1:]

    def pool(x: Tensor) -> Tensor:  # (H_kv·D, *rest) -> (new·D, *rest): groups of r consecutive heads averaged
        return x.reshape(new_kv_heads, r, head_dim, *rest).float().mean(1).reshape(-1, *rest).to(weight.dtype)

    return torch.cat([q, pool(k), pool(v)])
    ### END SOLUTION


def pool_kv_heads(model: Transformer, num_kv_heads: int, *,
                  pool: Callable[[Tensor, int, int, int, int], Tensor] = pool_kv_weight) -> Transformer:
    """A copy of ``model`` whose K/V projections are mean-pooled into ``num_kv_heads`` heads.

    Each new K/V head is the mean of the r = H_kv / num_kv_heads old heads it replaces (the GQA paper's
    starting point for "uptraining" an MHA checkpoint into GQA, ~5 % of pre-training compute to recover
    quality). Query heads keep their weights; query head h now reads pooled head h // (H_q / num_kv_heads).
    The KV cache shrinks by r. Pooling to the current H_kv returns identical weights.  ``pool`` pools one fused
    q/k/v weight or bias (``pool_kv_weight``, the default; notebook 03 passes the student's).
    """
    c = model.config
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or c.num_kv_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide the model's H_kv = {c.num_kv_heads} "
                         f"(choose from {[d for d in range(1, c.num_kv_heads + 1) if c.num_kv_heads % d == 0]})")
    new_config = dataclasses.replace(c, num_kv_heads=num_kv_heads)
    state = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:  # rows: [q (H_q·D) | k (H_kv·D) | v (H_kv·D)], weight and bias alike
            t = pool(t, c.num_heads, c.num_kv_heads, num_kv_heads, c.head_dim)
        state[name] = t
    with torch.device("meta"):
        out = Transformer(new_config)
    if new_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.load_state_dict(state, strict=False, assign=True)
    if new_config.tie_word_embeddings:
        out.lm_head.weight = out.model.embed_tokens.weight
    from minillm.layers.rotary import RotaryEmbedding

    out.model.rotary_emb = RotaryEmbedding(new_config)
    return out.to(model.device).eval().requires_grad_(False).set_kernels(model.kernels)


# --- KV-cache size calculators (bytes per token of context, all layers) ----------------------------------------
def kv_bytes_gqa(config: ModelConfig, num_kv_heads: int, bytes_per_elem: float = 2) -> float:
    """Bytes of K and V per token of context, all layers, if ``config``'s model had ``num_kv_heads`` K/V heads
    (H_kv = H_q: multi-head, 1 < H_kv < H_q: grouped-query, 1: multi-query attention) stored at
    ``bytes_per_elem`` bytes per element (a float: 0.5 prices int4).  Llama-2-7B (32 heads) fp16: 512 KiB with
    32 K/V heads, 128 KiB with 8."""
    ### BEGIN SOLUTION
    return 2 * config.num_layers * num_kv_heads * config.head_dim * bytes_per_elem
    ### END SOLUTION


def kv_bytes_mla(num_layers: int, latent_dim: int = 512, rope_dim: int = 64, bytes_per_elem: float = 2) -> float:
    """Multi-head latent attention (DeepSeek-V2): one compressed latent c_KV (latent_dim) plus a shared RoPE key
    (rope_dim) per token and layer, instead of K and V for every head.  DeepSeek-V2: 512 + 64 vs 2 × 128 heads ×
    128 = 32 768 values for MHA — about 57× smaller."""
    return num_layers * (latent_dim + rope_dim) * bytes_per_elem


def kv_bytes_cross_layer(config: ModelConfig, share: int, bytes_per_elem: float = 2) -> float:
    """Cross-layer KV sharing: every ``share`` consecutive layers read one layer's K/V (3 → 3× smaller)."""
    if share < 1:
        raise ValueError(f"share must be >= 1, got {share}")
    layers_with_kv = -(-config.num_layers // share)
    return 2 * layers_with_kv * config.num_kv_heads * config.head_dim * bytes_per_elem


def kv_bytes_sequence(config: ModelConfig, seq_len: int, *, window: int | None = None,
                      local_layers: int = 0, bytes_per_elem: float = 2) -> float:
    """Bytes of K/V for a whole sequence of ``seq_len`` tokens.  ``window``: sliding-window layers keep only the
    last ``window`` tokens (window 1000 over 10 000 tokens → 10× smaller); ``local_layers`` of the layers are
    windowed and the rest global (interleaving local and global layers)."""
    per_layer_token = 2 * config.num_kv_heads * config.head_dim * bytes_per_elem
    if window is None:
        return config.num_layers * seq_len * per_layer_token
    if not 0 <= local_layers <= config.num_layers:
        raise ValueError(f"local_layers must be in [0, {config.num_layers}]")
    local = local_layers or config.num_layers
    return (local * min(seq_len, window) + (config.num_layers - local) * seq_len) * per_layer_token
