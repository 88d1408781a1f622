"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

One file a student can read top to bottom. Weight names follow Hugging Face (``model.layers.i.self_attn``,
``mlp``, ``embed_tokens``, ``lm_head``) except two stacks, as in vLLM: ``qkv_proj`` = [q_proj; k_proj; v_proj]
and ``gate_up_proj`` = [gate_proj; up_proj]. At decode every linear layer is a GEMV whose cost is the bytes
of its weight plus a fixed per-call overhead, so three GEMVs become one and two become one
(``loader.stack_hf_weights`` does the renaming).

Shapes: B batch, L query length, S key/value length, H_q / H_kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels as kernel_ops
from .attention import sdpa_attention
from .config import ModelConfig
from .kernels import cpu_gemv

# "auto": the native CPU decode kernels on CPU, Triton attention on CUDA; "torch": the PyTorch references only;
# "native": require the native CPU kernels; "triton": force the Triton attention kernels (CPU: TRITON_INTERPRET=1).
KERNEL_CHOICES = ("auto", "torch", "native", "triton")


def attention_impl(kernels: str) -> str:
    """The ``impl`` argument of ``minillm.kernels`` attention functions for a model-level ``kernels`` choice."""
    return {"auto": "auto", "native": "auto", "triton": "triton"}.get(kernels, "torch")


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
    """Rotate pairs (x_i, x_{i+D/2}) by angle pos·θ_i.  x [B, L, H, D]; cos/sin [B, L, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def window_mask(L: int, window: int, device) -> Tensor:
    """Causal sliding-window mask [L, L]: query i sees keys j with i - window < j ≤ i (itself + window - 1 before)."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    return (j <= i) & (j > i - window)


class Linear(nn.Module):
    """A bias-optional linear layer that takes the native CPU GEMV at decode when ``kernels`` allows it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernels = "auto"  # set by Transformer.set_kernels

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels in ("auto", "native") and cpu_gemv.prefers_native(x, self.weight):
            return cpu_gemv.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    """Causal self-attention with H_kv ≤ H_q key/value heads shared by broadcast (no K/V copies)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size)
        self.scale = config.head_dim**-0.5
        self.kernels = "auto"  # set by Transformer.set_kernels

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, cache=None) -> Tensor:
        """x [B, L, hidden] -> [B, L, hidden].

        ``cache`` is any KV store with ``attention(layer, q, k, v, scale) -> out [B, H_q, L, D]`` that first
        writes the new k, v [B, H_kv, L, D] (after RoPE) and then attends over all it holds for these sequences
        (``kv_cache.KVCache`` contiguous; the paged cache of the engine).  Without one: plain causal attention.
        """
        c = self.config
        B, L, _ = x.shape
        qkv = self.qkv_proj(x)  # (B, L, (H_q + 2 H_kv) D)
        # RoPE on q and k in one pass: they are adjacent in the stacked projection.
        qk = qkv[..., : c.q_size + c.kv_size].view(B, L, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = apply_rope(qk, cos, sin)
        q = qk[:, :, : c.num_heads].transpose(1, 2)  # (B, H_q, L, D)
        k = qk[:, :, c.num_heads :].transpose(1, 2)  # (B, H_kv, L, D)
        v = qkv[..., c.q_size + c.kv_size :].view(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if cache is None and c.sliding_window is not None and L > c.sliding_window:
            out = sdpa_attention(q, k, v, window_mask(L, c.sliding_window, x.device)[None, None], scale=self.scale)
        elif cache is None:  # Triton FlashAttention on CUDA ("auto"), SDPA elsewhere
            out = kernel_ops.flash_attention(q, k, v, causal=True, sm_scale=self.scale,
                                             impl=attention_impl(self.kernels))
        else:  # the cache stores the new K/V and attends over everything it holds for these sequences
            out = cache.attention(layer, q, k, v, self.scale)  # (B, H_q, L, D)
        out = out.transpose(1, 2).reshape(B, L, c.q_size)  # (B, L, H_q D)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up stacked into one projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, L, F) each
        return self.down_proj(F.silu(gate) * up)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 whatever the storage dtype (as transformers)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = "auto"  # set by Transformer.set_kernels

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels in ("auto", "native") and cpu_gemv.supports(x, self.weight):
            return cpu_gemv.rms_norm(x, self.weight, self.eps)  # decode rows: F.rms_norm costs ~35 µs here
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()  # half precision: fp32 statistics, round, then the weight multiply (as transformers)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, cache=None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """``model.*`` in Hugging Face names: embeddings, the decoder stack and the final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class Transformer(nn.Module):
    """A Llama-family causal LM.  ``model(input_ids, positions) -> logits``, [B, L] -> [B, L, V]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kernels = "auto"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def set_kernels(self, kernels: str) -> Transformer:
        """Choose the fast paths: "auto" (native where it applies), "torch" (references only), "native"."""
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        if kernels == "native" and not cpu_gemv.available():
            raise RuntimeError("kernels='native' needs the compiled CPU GEMV, which failed to build; use 'auto'")
        for m in self.modules():
            if isinstance(m, (Linear, RMSNorm, Attention)):
                m.kernels = kernels
        self.kernels = kernels
        return self

    def hidden_states(self, input_ids: Tensor, positions: Tensor, cache=None) -> Tensor:
        """input_ids, positions [B, L] -> final-normed hidden states [B, L, hidden]."""
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [B, L]; got {tuple(input_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., hidden] -> [..., V] in the model dtype. Callers pass only the rows they sample from:
        the LM head is the largest single matrix (V × hidden), computing it for every prompt token is waste."""
        return self.lm_head(hidden)

    def forward(self, input_ids: Tensor, positions: Tensor, cache=None) -> Tensor:
        """Full causal forward: [B, L] token ids and positions -> [B, L, V] logits."""
        return self.compute_logits(self.hidden_states(input_ids, positions, cache))
