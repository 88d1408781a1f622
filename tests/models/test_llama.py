"""The model against Hugging Face transformers: logits, greedy tokens, and the cached loop against the naive one."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.engine.simple import generate
from minillm.models.loader import build_model

SMALL = dict(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
             max_position_embeddings=256, rms_norm_eps=1e-5)


def hf_pair(hf_cls, cfg, dtype=torch.float32, kernels="auto"):
    torch.manual_seed(0)
    hf = hf_cls(cfg).eval().to(dtype)
    ours = build_model(ModelConfig.from_hf(cfg), hf.state_dict(), dtype=dtype, device="cpu", kernels=kernels)
    return hf, ours


CASES = {
    "llama-mha": (LlamaForCausalLM, lambda: LlamaConfig(**SMALL, num_key_value_heads=6)),
    "llama-gqa": (LlamaForCausalLM, lambda: LlamaConfig(**SMALL, num_key_value_heads=2)),
    "llama-mqa-tied": (LlamaForCausalLM, lambda: LlamaConfig(**SMALL, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3-rope-scaling": (LlamaForCausalLM, lambda: LlamaConfig(
        **{**SMALL, "max_position_embeddings": 1024}, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2-bias": (Qwen2ForCausalLM, lambda: Qwen2Config(**SMALL, num_key_value_heads=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_fp32(case):
    hf_cls, make = CASES[case]
    hf, ours = hf_pair(hf_cls, make())
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(37).expand(2, 37)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, positions), hf(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_match_transformers_half_precision(dtype):
    hf, ours = hf_pair(LlamaForCausalLM, LlamaConfig(**SMALL, num_key_value_heads=2), dtype)
    ids = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = ours(ids, torch.arange(20)[None]).float(), hf(ids).logits.float()
    # Three layers of bf16/fp16 rounding in different op orders (fused norm, stacked projections): compare at
    # the scale of the logits rather than per element.
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["llama-gqa", "llama-mqa-tied", "qwen2-bias"])
def test_64_greedy_tokens_equal_transformers(case):
    hf_cls, make = CASES[case]
    hf, ours = hf_pair(hf_cls, make())
    prompt = [5, 17, 99, 3, 250, 42, 7]
    got = generate(ours, [prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].output
    assert got == hf_greedy(hf, prompt, 64)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_cached_decoding_equals_naive_loop(kernels):
    _, ours = hf_pair(LlamaForCausalLM, LlamaConfig(**SMALL, num_key_value_heads=2), kernels=kernels)
    prompts = [[1, 2, 3, 4, 5], [9] * 12, [300, 200]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cached = [s.output for s in generate(ours, prompts, params, cached=True)]
    naive = [s.output for s in generate(ours, prompts, params, cached=False)]
    assert cached == naive


def test_mixed_length_batch_gives_each_prompt_its_solo_tokens():
    _, ours = hf_pair(LlamaForCausalLM, LlamaConfig(**SMALL, num_key_value_heads=3))
    prompts = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (20, 5, 13)]
    together = [s.output for s in generate(ours, prompts, params)]
    alone = [generate(ours, [p], [sp])[0].output for p, sp in zip(prompts, params, strict=True)]
    assert together == alone
    assert [len(t) for t in together] == [20, 5, 13]


def test_cached_logits_equal_full_recompute():
    from minillm.kv.contiguous import KVCache

    _, ours = hf_pair(LlamaForCausalLM, LlamaConfig(**SMALL, num_key_value_heads=2))
    ids = torch.randint(0, 320, (1, 30), generator=torch.Generator().manual_seed(3))
    full = ours(ids, torch.arange(30)[None])
    cache = KVCache(ours.config, 1, 30, dtype=torch.float32, device="cpu")
    steps = []
    with torch.no_grad():
        cache.begin(torch.arange(10)[None])
        steps.append(ours(ids[:, :10], torch.arange(10)[None], cache))
        for t in range(10, 30):
            cache.begin(torch.tensor([[t]]))
            steps.append(ours(ids[:, t : t + 1], torch.tensor([[t]]), cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="llama.*mistral.*qwen2"):
        ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 10})




def test_config_rejects_heads_that_do_not_group():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf({**LlamaConfig(**SMALL).to_dict(), "num_key_value_heads": 4})


def mistral_pair(window):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=window)
    cfg._attn_implementation = "eager"
    return hf_pair(MistralForCausalLM, cfg)


def test_sliding_window_logits_match_transformers_mistral():
    hf, ours = mistral_pair(window=8)
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(40)[None]), hf(ids).logits)


def test_sliding_window_longer_than_the_sequence_equals_full_attention():
    _, windowed = mistral_pair(window=64)
    ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(30).expand(2, 30)
    full = build_model(dataclasses.replace(windowed.config, sliding_window=None), windowed.state_dict(),
                       dtype=torch.float32, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(windowed(ids, pos), full(ids, pos))


def test_sliding_window_cache_keeps_only_the_window_and_decodes_like_recompute():
    from minillm.kv.contiguous import SlidingWindowKVCache

    _, ours = mistral_pair(window=6)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7], [1, 8, 2, 8, 1]]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    cached = [s.output for s in generate(ours, prompts, params, cached=True)]
    naive = [s.output for s in generate(ours, prompts, params, cached=False)]
    assert cached == naive
    cache = SlidingWindowKVCache(ours.config, 1, 6, dtype=torch.float32, device="cpu")
    assert cache.k.shape[3] == 6  # W slots per sequence, however long it grows
