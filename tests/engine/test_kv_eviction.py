"""The engine with KV eviction: a sliding-window (Mistral-shaped) model against transformers past its window, with
bounded blocks; prefix caching across evicted blocks."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from minillm import EngineConfig, ModelConfig, SamplingParams
from minillm.engine.llm_engine import LLMEngine
from minillm.models.loader import build_model

WINDOW, BS = 12, 4
TINY = dict(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def mistral():
    """A random tiny Mistral with a 12-token window (eager attention: transformers applies the window mask)."""
    cfg = MistralConfig(**TINY, sliding_window=WINDOW)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return MistralForCausalLM(cfg).eval()


def ours(hf, kernels):
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.float32, device="cpu",
                       kernels=kernels)


def run(eng, prompt, max_tokens):
    """Greedy tokens, the logits each was sampled from, and the blocks in use after each decode step."""
    eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), "r")
    tokens, logits, used = [], [], []
    while eng.has_unfinished_requests():
        for u in eng.step():
            tokens += u.token_ids
            logits.append(u.logits)
        used.append(eng.block_manager.device.num_used)
    eng.pop_output("r")
    return tokens, torch.stack(logits) if eng.config.return_logits else None, used


def prompt_of(n, seed=1):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("batched_tokens", [8, 64])  # prefill in chunks shorter than the window / one 30-token chunk
def test_sliding_window_matches_transformers_past_the_window_with_bounded_blocks(mistral, kernels, batched_tokens):
    eng = LLMEngine(ours(mistral, kernels), config=EngineConfig(
        block_size=BS, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=batched_tokens, return_logits=True))
    prompt = prompt_of(30)
    n = 10 * WINDOW - len(prompt)  # the sequence reaches 10 × the window
    tokens, logits, used = run(eng, prompt, n)
    with torch.no_grad():
        want = mistral(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    assert tokens == want.argmax(-1).tolist()
    torch.testing.assert_close(logits, want)
    bound = eng.block_manager.eviction.max_blocks(BS)
    assert bound == 4 and max(used[-n // 2 :]) <= bound  # decoding holds the window's blocks, not the sequence's
    assert eng.block_manager.device.num_used == 0  # all returned at the end


def test_prefix_cache_hits_past_evicted_blocks_give_the_same_tokens(mistral):
    eng = LLMEngine(ours(mistral, "torch"), config=EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2,
                                                                max_num_batched_tokens=16, return_logits=True))
    prompt = prompt_of(40, seed=3)
    first, _, _ = run(eng, prompt, 20)  # its prompt blocks are cached as they are computed, then evicted
    hits = eng.block_manager.prefix_stats.hit_tokens
    second, _, _ = run(eng, prompt, 20)
    assert eng.block_manager.prefix_stats.hit_tokens - hits == 36  # every full block before the last token's
    assert second == first
    cold = LLMEngine(ours(mistral, "torch"), config=EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2,
                                                                 enable_prefix_caching=False))
    assert run(cold, prompt, 20)[0] == first


def test_windowed_model_is_no_longer_capped_at_its_window(mistral):
    eng = LLMEngine(ours(mistral, "torch"), config=EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2))
    assert eng.max_model_len == TINY["max_position_embeddings"]
