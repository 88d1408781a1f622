"""Rotary position embeddings (RoPE), with the Llama 3 and linear frequency scalings."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies theta^(-2i/D), i < D/2, after the configured scaling. -> [D/2] fp32.

    Computed exactly as transformers does (fp32 powers) so logits match it bit for bit where they can.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between.
        old_len = s.original_max_position_embeddings
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > old_len / s.low_freq_factor, inv / s.factor, inv)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= old_len / s.high_freq_factor) & (wavelen <= old_len / s.low_freq_factor)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, computed on the fly for the given positions (no max-length table)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, L] -> cos, sin [B, L, 1, D] in ``dtype`` (fp32 angles, as transformers)."""
        freqs = positions[..., None].float() * self.inv_freq  # (B, L, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # (B, L, 1, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each head's pairs (x_i, x_{i+D/2}), i < D/2, by the angle pos·θ_i.  x [B, L, H, D]; cos/sin
    [B, L, 1, D] (``RotaryEmbedding``: the angles of a position, its D/2 values written twice) -> [B, L, H, D].

    Contract (the Hugging Face "rotate half" layout, not interleaved pairs (x_0, x_1)): for i < D/2,
    out_i = x_i·cos_i − x_{i+D/2}·sin_i and out_{i+D/2} = x_{i+D/2}·cos_i + x_i·sin_i.  Applied to q and k only,
    so that q·k depends on the positions' difference alone.  Elementwise: one read of x, one write.
    """
    ### BEGIN SOLUTION
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
    ### END SOLUTION
