"""Causal self-attention with grouped K/V heads; the KV store (contiguous, paged) is passed in by the caller."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.config import ModelConfig
from minillm.kernels.reference import sdpa_attention
from minillm.kernels.select import KernelOps
from minillm.layers.linear import Linear


def window_mask(L: int, window: int, device) -> Tensor:
    """Causal sliding-window mask [L, L]: query i sees keys j with i - window < j ≤ i (itself + window - 1 before)."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    return (j <= i) & (j > i - window)


class Attention(nn.Module):
    """Causal self-attention with H_kv ≤ H_q key/value heads shared by broadcast (no K/V copies)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size)
        self.scale = config.head_dim**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, ops: KernelOps, cache=None) -> Tensor:
        """x [B, L, hidden] -> [B, L, hidden]; ``ops``: the projections' and the cache-less attention's kernels.

        ``cache`` is any KV store with ``attention(layer, q, k, v, scale) -> out [B, H_q, L, D]`` that first
        writes the new k, v [B, H_kv, L, D] (after RoPE) and then attends over all it holds for these sequences
        (``kv_cache.KVCache`` contiguous; the paged cache of the engine).  Without one: plain causal attention.
        """
        c = self.config
        B, L, _ = x.shape
        qkv = self.qkv_proj(x, ops)  # (B, L, (H_q + 2 H_kv) D)
        # RoPE on q and k in one pass: they are adjacent in the stacked projection.
        qk = qkv[..., : c.q_size + c.kv_size].view(B, L, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = ops.rope(qk, cos, sin)  # native on CPU: one pass, no rotate-half copies
        q = qk[:, :, : c.num_heads].transpose(1, 2)  # (B, H_q, L, D)
        k = qk[:, :, c.num_heads :].transpose(1, 2)  # (B, H_kv, L, D)
        v = qkv[..., c.q_size + c.kv_size :].view(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
        window = c.layer_window(layer)  # None for a global layer of a local:global model
        if cache is None and window is not None and L > window:
            out = sdpa_attention(q, k, v, window_mask(L, window, x.device)[None, None], scale=self.scale)
        elif cache is None:  # Triton FlashAttention on CUDA ("auto"), SDPA elsewhere
            out = ops.prefill_attention(q, k, v, causal=True, sm_scale=self.scale)
        else:  # the cache stores the new K/V and attends over everything it holds for these sequences
            out = cache.attention(layer, q, k, v, self.scale)  # (B, H_q, L, D)
        out = out.transpose(1, 2).reshape(B, L, c.q_size)  # (B, L, H_q D)
        return self.o_proj(out, ops)
