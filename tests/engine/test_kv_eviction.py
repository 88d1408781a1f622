"""The engine with KV eviction: a sliding-window (Mistral-shaped) model against transformers past its window, with
bounded blocks; prefix caching across evicted blocks; attention sinks + window against the full forward under the
same mask; bad eviction configs."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from minillm import EngineConfig, ModelConfig, SamplingParams
from minillm.engine.llm_engine import LLMEngine
from minillm.kernels.reference import kept_keys, sdpa_attention
from minillm.models.loader import build_model

WINDOW, BS = 12, 4


@pytest.fixture(scope="module")
def mistral(tiny_shape):
    """A random tiny Mistral with a 12-token window (eager attention: transformers applies the window mask)."""
    cfg = MistralConfig(**tiny_shape, sliding_window=WINDOW)
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


def test_windowed_model_is_no_longer_capped_at_its_window(mistral, tiny_shape):
    eng = LLMEngine(ours(mistral, "torch"), config=EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2))
    assert eng.max_model_len == tiny_shape["max_position_embeddings"]


# ---- attention sinks (StreamingLLM) on a full-attention model -------------------------------------------------------
SINKS, SINK_WINDOW = 3, 9


class MaskedFullAttention:
    """The ``cache`` of a plain forward over the whole sequence: attention under an explicit mask (the reference
    for eviction: every key is there, the mask drops the ones the policy evicts)."""

    def __init__(self, mask):
        self.mask = mask  # (L, L) bool

    def attention(self, layer, q, k, v, scale):
        return sdpa_attention(q, k, v, self.mask[None, None], scale=scale)


@pytest.mark.parametrize("batched_tokens", [8, 64])
def test_sinks_and_window_equal_the_full_forward_under_the_same_mask_with_constant_blocks(tiny_llama, batched_tokens):
    eng = LLMEngine(tiny_llama, config=EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2, return_logits=True,
                                                    max_num_batched_tokens=batched_tokens, kv_eviction="sink",
                                                    sink_tokens=SINKS, window_tokens=SINK_WINDOW))
    prompt = prompt_of(20, seed=4)
    total = 10 * (SINKS + SINK_WINDOW)
    tokens, logits, used = run(eng, prompt, total - len(prompt))
    seq = torch.tensor([prompt + tokens[:-1]])
    pos = torch.arange(seq.shape[1])
    mask = kept_keys(pos[:, None], pos, SINK_WINDOW, SINKS)
    with torch.no_grad():
        want = tiny_llama.compute_logits(tiny_llama.hidden_states(seq, pos[None], MaskedFullAttention(mask)))[0]
        plain = tiny_llama(seq, pos[None])[0]
    torch.testing.assert_close(logits, want[len(prompt) - 1 :])
    assert tokens == want[len(prompt) - 1 :].argmax(-1).tolist()
    assert not torch.allclose(want, plain, atol=1e-3)  # the mask matters: eviction is not full attention here
    bound = eng.block_manager.eviction.max_blocks(BS)
    steady = used[len(used) // 4 : -1]  # long after the window filled (and before the end frees all): flat
    assert max(steady) <= bound and max(steady) - min(steady) <= 1


@pytest.mark.parametrize("kw,match", [
    (dict(window_tokens=0), "window_tokens must be a positive int"),
    (dict(window_tokens=8, sink_tokens=8), "sink_tokens=8 must be smaller than window_tokens=8"),
    (dict(), "needs window_tokens"),
    (dict(window_tokens=8, speculative_config={"method": "early_exit", "num_layers": 1}), "'ngram' only"),
    (dict(window_tokens=8, enforce_eager=False), "enforce_eager=None"),
])
def test_bad_eviction_config_names_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(kv_eviction="sink", **kw)
    with pytest.raises(ValueError, match="kv_eviction must be None or one of"):
        EngineConfig(kv_eviction="lru", window_tokens=8)


def test_ngram_speculation_under_sinks_gives_the_same_greedy_tokens(tiny_llama):
    """Drafts are verified through the eviction mask and rolled back only where uncomputed (``truncate``)."""
    config = dict(block_size=BS, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16, kv_eviction="sink",
                  sink_tokens=SINKS, window_tokens=SINK_WINDOW)
    prompt = [5, 6, 7, 8, 9] * 6  # repeats: the n-gram proposer drafts, and some drafts are rejected
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = LLMEngine(tiny_llama, config=EngineConfig(**config)).generate([prompt], params)[0].outputs[0].token_ids
    eng = LLMEngine(tiny_llama, config=EngineConfig(**config, speculative_config={"method": "ngram",
                                                                                  "num_speculative_tokens": 3}))
    assert eng.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert eng.spec_stats.draft_tokens > eng.spec_stats.accepted_tokens > 0  # drafts ran, some were rolled back


def test_a_pool_smaller_than_the_sequence_admits_and_finishes_it_under_eviction(tiny_llama):
    tiny_pool = dict(block_size=BS, num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)  # 220 tokens = 55 blocks without eviction
    with pytest.raises(ValueError, match="needs up to 55 KV blocks"):
        LLMEngine(tiny_llama, config=EngineConfig(**tiny_pool)).add_request(prompt_of(20), params)
    eng = LLMEngine(tiny_llama, config=EngineConfig(**tiny_pool, kv_eviction="sink", sink_tokens=SINKS,
                                                    window_tokens=SINK_WINDOW))
    out = eng.generate([prompt_of(20)], params)[0].outputs[0]
    assert len(out.token_ids) == 200 and eng.stats.preemptions == 0
