"""The model runs on the Triton attention kernels when asked (CPU: interpreter) and agrees with the references."""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.engine.simple import generate
from minillm.models.loader import build_model

interpreted = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton needs CUDA or TRITON_INTERPRET=1")
CFG = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def tiny(kernels, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(CFG), LlamaForCausalLM(CFG).state_dict(), dtype=dtype, device=device,
                       kernels=kernels)


@interpreted
def test_model_forward_on_triton_flash_attention_matches_reference():
    ids = torch.randint(0, 100, (2, 21), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(21).expand(2, 21)
    with torch.no_grad():
        torch.testing.assert_close(tiny("triton")(ids, pos), tiny("torch")(ids, pos))


@interpreted
def test_cached_generation_on_triton_kernels_gives_the_reference_tokens():
    prompts, params = [[1, 2, 3, 4, 5, 6, 7], [9, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = [s.output for s in generate(tiny("triton"), prompts, params)]
    assert got == [s.output for s in generate(tiny("torch"), prompts, params)]


@pytest.mark.gpu
def test_bf16_model_on_cuda_matches_transformers():
    cfg = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ours = build_model(ModelConfig.from_hf(cfg), hf.state_dict(), dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    with torch.no_grad():
        got, want = ours(ids, torch.arange(300, device="cuda").expand(2, 300)).float(), hf(ids).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # bf16 through 4 layers, different op order
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
