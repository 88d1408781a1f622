"""The engine with H2O eviction (``kv_eviction="h2o"``): logits equal the full forward under the mask of the blocks
the policy had evicted when each token was computed; the attention mass the cache accumulates equals a brute-force
sum of the softmax probabilities; blocks stay bounded; bad configs name the fix."""

import pytest
import torch
from transformers import MistralConfig

from minillm import EngineConfig, ModelConfig, SamplingParams
from minillm.engine.llm_engine import LLMEngine
from minillm.kv.eviction import EVICTED, H2OPolicy, make_eviction_policy

BS, SINKS, WINDOW, HEAVY = 4, 2, 8, 8
H2O = dict(kv_eviction="h2o", sink_tokens=SINKS, window_tokens=WINDOW, heavy_tokens=HEAVY)


class ProbedAttention:
    """The ``cache`` of a plain forward over the whole sequence: attention under an explicit mask [L, L], written
    out (repeat the K/V heads, softmax, weighted sum), summing each key's probabilities over layers, heads and
    queries into ``mass`` — the brute-force H2O score."""

    def __init__(self, mask):
        self.mask = mask
        self.mass = torch.zeros(mask.shape[1])

    def attention(self, layer, q, k, v, scale):
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # (1, H_q, L, D)
        p = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~self.mask, float("-inf")).softmax(-1)  # (1, H_q, L, L)
        self.mass += p.sum((0, 1, 2))
        return p @ v


def run_recording(eng, prompt, max_tokens, probe_at):
    """Greedy decode of one request, recording before every step the blocks already evicted and where the step's
    rows start (its first uncomputed position); after step ``probe_at``, the sequence's table and its slots' mass."""
    eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), "r")
    bm, tokens, logits, history, used, probe = eng.block_manager, [], [], [], [], None
    while eng.has_unfinished_requests():
        if 0 in bm:  # the engine's first sequence has id 0; before its first step it holds no blocks
            table = bm.sequence(0)
            history.append((table.num_computed, {i for i, b in enumerate(table.block_ids) if b == EVICTED}))
        else:
            history.append((0, set()))
        for u in eng.step():
            tokens += u.token_ids
            logits.append(u.logits)
        used.append(bm.device.num_used)
        if len(history) == probe_at:
            t = bm.sequence(0)
            probe = (t.block_ids, t.num_computed, eng.kv_cache.mass[0].clone())
    eng.pop_output("r")
    return tokens, torch.stack(logits), history, used, probe


def history_mask(history, n):
    """[n, n] bool: query q sees key j ≤ q unless j's block was evicted before the step that computed q."""
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for start, evicted in history:
        for i in evicted:
            mask[start:, i * BS : (i + 1) * BS] = False
    return mask


@pytest.mark.parametrize("batched_tokens", [8, 64])  # the prompt in chunks (evicting in between) / in one chunk
def test_h2o_equals_the_full_forward_under_the_evicted_blocks_mask_and_scores_its_mass(tiny_llama, batched_tokens):
    # a pool of 10 blocks: freed blocks are reused, so a slot's mass must restart with its new token
    eng = LLMEngine(tiny_llama, config=EngineConfig(block_size=BS, num_kv_blocks=10, max_num_seqs=2, return_logits=True,
                                                    max_num_batched_tokens=batched_tokens, **H2O))
    prompt = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    total = 10 * (SINKS + WINDOW + HEAVY)  # 10 × the budget
    tokens, logits, history, used, probe = run_recording(eng, prompt, total - len(prompt), probe_at=60)
    seq = prompt + tokens[:-1]
    n = len(seq)
    pos = torch.arange(n)
    with torch.no_grad():
        want = tiny_llama.compute_logits(tiny_llama.hidden_states(torch.tensor([seq]), pos[None],
                                                                  ProbedAttention(history_mask(history, n))))[0]
        plain = tiny_llama(torch.tensor([seq]), pos[None])[0]
    torch.testing.assert_close(logits, want[len(prompt) - 1 :])
    assert tokens == want[len(prompt) - 1 :].argmax(-1).tolist()
    assert not torch.allclose(want, plain, atol=1e-3)  # blocks were evicted and it mattered
    # the evicted set is not a positional run: some kept heavy block lies past an evicted one
    _, last = history[-1]
    held_middle = [i for i in range(1, max(last)) if i not in last]
    assert held_middle, f"no heavy hitter kept between evicted blocks {sorted(last)}"
    # blocks bounded: the policy's bound, long after the budget filled
    bound = H2OPolicy(WINDOW, SINKS, HEAVY).max_blocks(BS)
    assert max(used[len(used) // 4 : -1]) <= bound == 7
    assert eng.block_manager.device.num_used == 0
    assert not eng.block_manager.device.enable_prefix_caching  # H2O turns prefix caching off

    # the mass the cache holds for the probed sequence's held slots = the brute-force sum over the same rows
    block_ids, computed, mass = probe
    probe_attention = ProbedAttention(history_mask(history[:60], computed))
    with torch.no_grad():
        tiny_llama.hidden_states(torch.tensor([seq[:computed]]), torch.arange(computed)[None], probe_attention)
    held = [p for p in range(computed) if block_ids[p // BS] != EVICTED]
    got = torch.stack([mass[block_ids[p // BS], p % BS] for p in held])
    torch.testing.assert_close(got, probe_attention.mass[held])


def test_h2o_with_an_int8_kv_cache_runs_bounded(tiny_llama):
    eng = LLMEngine(tiny_llama, config=EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2,
                                                    kv_cache_dtype="int8", **H2O))
    out = eng.generate([list(range(1, 30))], SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 80 and eng.stats.peak_used_blocks <= 8  # the 29-token prompt's


@pytest.mark.parametrize("kw,match", [
    (dict(window_tokens=8), "needs heavy_tokens"),
    (dict(window_tokens=8, heavy_tokens=0), "heavy_tokens must be a positive int"),
    (dict(window_tokens=8, heavy_tokens=True), "heavy_tokens must be a positive int"),
    (dict(window_tokens=8, sink_tokens=8, heavy_tokens=4), "sink_tokens=8 must be smaller than window_tokens=8"),
    (dict(heavy_tokens=4), "needs window_tokens"),
    (dict(window_tokens=8, heavy_tokens=4, speculative_config={"method": "ngram"}), "rejected draft tokens"),
    (dict(window_tokens=8, heavy_tokens=4, enforce_eager=False), "enforce_eager=None"),
])
def test_bad_h2o_config_names_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(kv_eviction="h2o", **kw)


def test_heavy_tokens_without_h2o_and_h2o_on_a_windowed_model_are_refused(tiny_shape):
    with pytest.raises(ValueError, match='pass kv_eviction="h2o" with it'):
        EngineConfig(kv_eviction="sink", window_tokens=8, heavy_tokens=4)
    with pytest.raises(ValueError, match='pass kv_eviction="h2o" with it'):
        EngineConfig(heavy_tokens=4)
    assert ModelConfig.from_hf(MistralConfig(**tiny_shape, sliding_window=16)).sliding_window == 16
    with pytest.raises(ValueError, match="sliding-window model"):
        make_eviction_policy(16, "h2o", 8, 2, 8)
