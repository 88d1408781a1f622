"""Published models' shapes, for cost models, checks and benchmarks that never load their weights.

Each function returns the ``ModelConfig`` of one model's ``config.json`` on the Hugging Face hub.  This is the
only place those shapes are written down; ``minillm.perf`` (roofline, simulation, disaggregation, TP cost),
``minillm.course.checks`` and the benchmarks import them from here.
"""

from __future__ import annotations

from minillm.config import ModelConfig


def smollm2_135m_config() -> ModelConfig:
    """SmolLM2-135M's shape, from HuggingFaceTB/SmolLM2-135M ``config.json`` (the course's default model): 30 layers,
    hidden 576, 9 query and 3 K/V heads of 64 (GQA), SwiGLU 1536, vocab 49152, 8192 context, RoPE θ 100000, tied
    LM head: 1.35e8 parameters.  Token ids are left unset: shapes only."""
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=100000.0, tie_word_embeddings=True)


def llama2_7b_config() -> ModelConfig:
    """Llama-2-7B's shape, from meta-llama/Llama-2-7b-hf ``config.json`` (32 layers, hidden 4096, MHA with 32 heads
    of 128, SwiGLU 11008, vocab 32000, 4096 context, untied LM head): 6.74e9 parameters."""
    return ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                       num_kv_heads=32, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


def llama3_8b_config() -> ModelConfig:
    """Llama-3-8B's shape, from meta-llama/Meta-Llama-3-8B ``config.json``: 32 layers, hidden 4096, 32 query and
    8 K/V heads of 128 (GQA: 128 KiB of bf16 K/V per token, a quarter of Llama-2-7B's), SwiGLU 14336, vocab 128256,
    8192 context, untied LM head: 8.0e9 parameters."""
    return ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
                       eos_token_ids=(128001,))


def llama2_70b_config() -> ModelConfig:
    """Llama-2-70B's shape, from meta-llama/Llama-2-70b-hf ``config.json``: 80 layers, hidden 8192, 64 query heads
    and 8 K/V heads of 128 (GQA), SwiGLU 28672, vocab 32000, 4096 context: 6.9e10 parameters."""
    return ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_ids=(2,))


def decoder_linear_shapes(config: ModelConfig) -> tuple[tuple[int, int], ...]:
    """The weight shapes [N, K] of one decoder layer's linears, as ``models.llama`` stacks them: fused q/k/v,
    o_proj, fused gate/up, down_proj.  A decode step reads each of them once per layer."""
    c = config
    return ((c.q_size + 2 * c.kv_size, c.hidden_size), (c.hidden_size, c.q_size),
            (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size))
