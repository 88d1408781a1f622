"""Published models' shapes, for cost models, checks and benchmarks that never load their weights.

Each function returns the ``ModelConfig`` of one model's ``config.json`` on the Hugging Face hub.  This is the
only place those shapes are written down; ``minillm.perf`` (roofline, simulation, disaggregation, TP cost),
``minillm.course.checks`` and the benchmarks import them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from minillm.config import ModelConfig, RopeScaling


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


def llama32_1b_config() -> ModelConfig:
    """Llama-3.2-1B's shape, from meta-llama/Llama-3.2-1B ``config.json``: 16 layers, hidden 2048, 32 query and 8
    K/V heads of 64, SwiGLU 8192, vocab 128256, 131072 context with llama3 RoPE scaling (factor 32), RoPE θ 500000,
    tied LM head: 1.24e9 parameters."""
    return ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_32, tie_word_embeddings=True,
                       bos_token_id=128000, eos_token_ids=(128001,))


def llama32_3b_config() -> ModelConfig:
    """Llama-3.2-3B's shape, from meta-llama/Llama-3.2-3B ``config.json``: 28 layers, hidden 3072, 24 query and 8
    K/V heads of 128, SwiGLU 8192, vocab 128256, 131072 context with llama3 RoPE scaling (factor 32), RoPE θ
    500000, tied LM head: 3.21e9 parameters."""
    return replace(llama32_1b_config(), hidden_size=3072, num_layers=28, num_heads=24, head_dim=128)


def llama31_8b_config() -> ModelConfig:
    """Llama-3.1-8B's shape, from meta-llama/Llama-3.1-8B ``config.json``: Llama-3-8B's body (32 layers, hidden
    4096, 32/8 heads of 128, SwiGLU 14336, untied LM head over 128256 tokens) with 131072 context and llama3 RoPE
    scaling (factor 8): 8.03e9 parameters."""
    return replace(llama3_8b_config(), max_position_embeddings=131072,
                   rope_scaling=replace(_LLAMA3_ROPE_32, factor=8.0))


def tiny_config() -> ModelConfig:
    """A made-up Llama shape small enough for a test to build in seconds (2 layers, hidden 64, 4 query and 2 K/V
    heads of 16, SwiGLU 128, SmolLM2's vocabulary and RoPE θ, tied): every K is a multiple of GGUF's 32-weight
    blocks."""
    return replace(smollm2_135m_config(), hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)


# llama3 RoPE scaling as Llama-3.1/3.2 ship it (factor 8 for 3.1, 32 for 3.2; 8192 original context)
_LLAMA3_ROPE_32 = RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

# The shapes ``python -m minillm make-model --shape NAME`` writes and ``bench cpu-peers`` measures.
SHAPES: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny_config, "smollm2-135m": smollm2_135m_config, "llama-3.2-1b": llama32_1b_config,
    "llama-3.2-3b": llama32_3b_config, "llama-3.1-8b": llama31_8b_config,
}


def shape_config(name: str) -> ModelConfig:
    """The ``ModelConfig`` of the shape called ``name`` (a key of ``SHAPES``); ValueError naming them otherwise."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {name!r}")
    return SHAPES[name]()


def hf_config_dict(config: ModelConfig) -> dict:
    """``config`` as a transformers ``LlamaConfig`` keyword dict (what a ``config.json`` holds): the inverse of
    ``ModelConfig.from_hf`` for the Llama fields."""
    c = config
    d = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
             num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
             head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
             rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.qkv_bias)
    if c.rope_scaling.kind != "default":
        r = c.rope_scaling
        d["rope_scaling"] = {"rope_type": r.kind, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                             "high_freq_factor": r.high_freq_factor,
                             "original_max_position_embeddings": r.original_max_position_embeddings}
    if c.bos_token_id is not None:
        d["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        d["eos_token_id"] = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
    return d


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
