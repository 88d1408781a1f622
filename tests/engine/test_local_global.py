"""A local:global model (transformers' Qwen2 with ``use_sliding_window`` and ``max_window_layers``: the first layers
attend to everything, the later ones to a sliding window) in the engine and the plain forward, against transformers
past the window: each layer masks by its own window, and no block is freed while a global layer reads it."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from minillm import EngineConfig, ModelConfig, SamplingParams
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.simple import generate
from minillm.models.loader import build_model

WINDOW, BS = 8, 4


@pytest.fixture(scope="module")
def qwen2(tiny_shape):
    """Layer 0 global, layers 1-2 with an 8-token window (eager attention: transformers applies the masks)."""
    cfg = Qwen2Config(**tiny_shape, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    cfg._attn_implementation = "eager"
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def ours(hf, kernels):
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.float32, device="cpu",
                       kernels=kernels)


def test_config_reads_the_per_layer_pattern(qwen2, tiny_shape):
    mc = ModelConfig.from_hf(qwen2.config)
    assert mc.sliding_window == WINDOW and mc.sliding_layers == (False, True, True)
    assert [mc.layer_window(i) for i in range(3)] == [None, WINDOW, WINDOW] and not mc.evicts_by_window
    every = Qwen2Config(**tiny_shape, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    assert ModelConfig.from_hf(every).sliding_layers is None and ModelConfig.from_hf(every).evicts_by_window
    assert ModelConfig.from_hf(Qwen2Config(**tiny_shape)).sliding_window is None  # use_sliding_window off: all global


def test_plain_forward_matches_transformers_past_the_window(qwen2, tiny_shape):
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = qwen2(ids).logits
        got = ours(qwen2, "torch")(ids, torch.arange(40)[None])
    torch.testing.assert_close(got, want)
    plain = Qwen2ForCausalLM(Qwen2Config(**tiny_shape)).eval()
    plain.load_state_dict(qwen2.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits, want, atol=1e-3)  # the windows matter at 40 tokens


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("batched_tokens", [8, 64])
def test_engine_matches_transformers_past_the_window_and_frees_nothing(qwen2, kernels, batched_tokens):
    eng = LLMEngine(ours(qwen2, kernels), config=EngineConfig(
        block_size=BS, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=batched_tokens, return_logits=True))
    assert eng.block_manager.eviction is None  # layer 0 reads every key: no block can go
    prompt = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.add_request(prompt, SamplingParams(max_tokens=5 * WINDOW, temperature=0, ignore_eos=True), "r")
    tokens, logits = [], []
    while eng.has_unfinished_requests():
        for u in eng.step():
            tokens += u.token_ids
            logits.append(u.logits)
        if eng.has_unfinished_requests():
            assert eng.block_manager.device.num_used == -(-eng.block_manager.num_tokens(0) // BS)  # every block held
    eng.pop_output("r")
    with torch.no_grad():
        want = qwen2(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    assert tokens == want.argmax(-1).tolist()
    torch.testing.assert_close(torch.stack(logits), want)


def test_eviction_on_a_local_global_model_and_the_cached_loop_past_its_window_are_refused(qwen2):
    model = ours(qwen2, "torch")
    with pytest.raises(ValueError, match="alternate sliding-window and full attention"):
        LLMEngine(model, config=EngineConfig(block_size=BS, num_kv_blocks=64, kv_eviction="sink", window_tokens=16))
    with pytest.raises(ValueError, match="run it with the engine"):
        generate(model, [[1, 2, 3]], SamplingParams(max_tokens=2 * WINDOW, temperature=0))
