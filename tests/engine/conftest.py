"""Fixtures shared by the engine tests: one tiny transformer shape (transformers config keywords, for the Llama-,
Mistral- and Qwen2-shaped random models the eviction and window tests build) and the random tiny Llama on
minillm's native kernels that the KV-eviction tests run."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig
from minillm.models.loader import build_model

_TINY = dict(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def tiny_shape() -> dict:
    """3 layers, 6 query heads over 2 KV heads of 16 dims, vocabulary 320, 512 positions: a copy per session."""
    return dict(_TINY)


@pytest.fixture(scope="module")
def tiny_llama(tiny_shape):
    """A random Llama of ``tiny_shape`` (seed 0), fp32 on CPU with the native kernels; built once per module."""
    cfg = LlamaConfig(**tiny_shape)
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).eval().state_dict(), dtype=torch.float32,
                       device="cpu", kernels="native")
