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
from torch import Tensor, nn

from minillm.config import ModelConfig
from minillm.kernels.select import KernelOps, ops_for
from minillm.layers.attention import Attention
from minillm.layers.linear import Linear
from minillm.layers.norm import RMSNorm
from minillm.layers.rotary import RotaryEmbedding


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up stacked into one projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [B, L, hidden] -> [B, L, hidden]."""
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x, ops)), ops)  # (B, L, 2F) -> (B, L, F)


class DecoderLayer(nn.Module):
    """Pre-norm block: residual += attn(norm(residual)); residual += mlp(norm(residual)).

    As in vLLM, the residual stream travels beside the block's output and each residual add is fused into the norm
    that follows it (``ops.add_rms_norm``): the layer takes (x, residual) and returns (its output, the residual
    before adding it); the next layer's first norm, or the final one, adds them.  Same sums, same order.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, layer: int, ops: KernelOps,
                cache=None) -> tuple[Tensor, Tensor]:
        """x, residual [B, L, hidden] (residual None: x is the embedding) -> (mlp output, residual)."""
        if residual is None:
            h, residual = self.input_layernorm(x, ops), x
        else:
            h, residual = self.input_layernorm.add(x, residual, ops)
        h = self.self_attn(h, cos, sin, layer, ops, cache)
        h, residual = self.post_attention_layernorm.add(h, residual, ops)
        return self.mlp(h, ops), residual


class Body(nn.Module):
    """``model.*`` in Hugging Face names: embeddings, the decoder stack and the final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class Transformer(nn.Module):
    """A Llama-family causal LM.  ``model(input_ids, positions) -> logits``, [B, L] -> [B, L, V].

    ``kernels`` ("auto" | "torch" | "native" | "triton", see ``kernels.select``) is the model's one kernel choice:
    each forward resolves it for the model's device and dtype into a ``KernelOps`` and passes that down to every
    layer (``kernel_ops``), so a ``.to(dtype)`` or ``set_kernels`` takes effect on the next call.
    """

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
        return self.model.norm.weight.device  # the norms stay float when the linears are quantized

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def set_kernels(self, kernels: str) -> Transformer:
        """Choose the fast paths: "auto" (native on CPU, Triton attention on CUDA, where they apply), "torch"
        (references only), "native", "triton".  Resolved now, so a choice that cannot run here raises at once
        (ValueError for an unknown name, RuntimeError for a kernel library that is missing).  Returns the model."""
        ops_for(kernels, self.device, self.dtype)
        self.kernels = kernels
        return self

    def kernel_ops(self) -> KernelOps:
        """The implementations the layers call: ``kernels`` resolved for this device and dtype (cached)."""
        return ops_for(self.kernels, self.device, self.dtype)

    def hidden_states(self, input_ids: Tensor, positions: Tensor, cache=None, num_layers: int | None = None) -> Tensor:
        """input_ids, positions [B, L] -> final-normed hidden states [B, L, hidden].  ``num_layers``: run only the
        first k decoder layers, then the final norm (early exit: the self-drafting model of speculative decoding)."""
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [B, L]; got {tuple(input_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        ops = self.kernel_ops()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # once per forward, shared by every layer
        residual = None
        for i, layer in enumerate(self.model.layers[:num_layers]):
            x, residual = layer(x, residual, cos, sin, i, ops, cache)
        if residual is None:  # no layers
            return self.model.norm(x, ops)
        return self.model.norm.add(x, residual, ops)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., hidden] -> [..., V] in the model dtype. Callers pass only the rows they sample from:
        the LM head is the largest single matrix (V × hidden), computing it for every prompt token is waste."""
        return self.lm_head(hidden, self.kernel_ops())

    def forward(self, input_ids: Tensor, positions: Tensor, cache=None) -> Tensor:
        """Full causal forward: [B, L] token ids and positions -> [B, L, V] logits."""
        return self.compute_logits(self.hidden_states(input_ids, positions, cache))
