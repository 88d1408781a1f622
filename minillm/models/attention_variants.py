"""Attention variants that shrink the KV cache: grouped heads (GQA/MQA), latent K/V (MLA), cross-layer sharing,
sliding windows — the converter for a loaded model and the calculators notebook 03 uses.

KV bytes per token for standard attention = 2 (K and V) × layers × H_kv × D × bytes per element
(``kv_cache.kv_bytes_per_token``); every variant here changes one factor of that product.
"""

from __future__ import annotations

import dataclasses

import torch

from minillm.config import ModelConfig
from minillm.models.llama import Transformer


def pool_kv_heads(model: Transformer, num_kv_heads: int) -> Transformer:
    """A copy of ``model`` whose K/V projections are mean-pooled into ``num_kv_heads`` heads.

    Each new K/V head is the mean of the r = H_kv / num_kv_heads old heads it replaces (the GQA paper's
    starting point for "uptraining" an MHA checkpoint into GQA, ~5 % of pre-training compute to recover
    quality). Query heads keep their weights; query head h now reads pooled head h // (H_q / num_kv_heads).
    The KV cache shrinks by r. Pooling to the current H_kv returns identical weights.
    """
    c = model.config
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or c.num_kv_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide the model's H_kv = {c.num_kv_heads} "
                         f"(choose from {[d for d in range(1, c.num_kv_heads + 1) if c.num_kv_heads % d == 0]})")
    r, D = c.num_kv_heads // num_kv_heads, c.head_dim
    new_config = dataclasses.replace(c, num_kv_heads=num_kv_heads)
    state = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:  # rows: [q (H_q·D) | k (H_kv·D) | v (H_kv·D)]
            q, k, v = t.split([c.q_size, c.kv_size, c.kv_size])
            pool = lambda x: x.reshape(num_kv_heads, r, D, *x.shape[1:]).float().mean(1)  # noqa: E731
            t = torch.cat([q, pool(k).reshape(-1, *t.shape[1:]).to(t.dtype),
                           pool(v).reshape(-1, *t.shape[1:]).to(t.dtype)])
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
