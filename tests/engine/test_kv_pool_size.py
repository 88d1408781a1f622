"""What the engine's KV pool holds, as ``LLMEngine.state()`` reports it, and the engine sizing its pool through a
device probe (a fake one here: the CPU engine itself never has one)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import minillm.engine.llm_engine as llm_engine
from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.kv.paged_cache import kv_bytes_per_block
from minillm.models.loader import build_model

CONTEXT = 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=CONTEXT)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


class FakeMemory:
    """A device with ``free`` bytes of the engine's share left after weights and activations; the profile runs."""

    def __init__(self, free: int):
        self.free, self.profiled = free, 0

    def total(self) -> int:
        return 10 * self.free

    def in_use(self) -> int:
        return 9 * self.free - 1000  # utilization 1.0: the pool gets free + 1000 - 1000 bytes

    def peak_during(self, fn) -> int:
        fn()
        self.profiled += 1
        return 1000


def test_state_reports_tokens_and_full_sequences_the_pool_holds(model):
    eng = LLMEngine(model, config=EngineConfig(block_size=4, num_kv_blocks=40, max_model_len=30))
    s = eng.state()
    assert (s.kv_blocks_total, s.kv_tokens_total) == (40, 160)
    assert s.kv_max_full_sequences == 5  # a 30-token sequence takes 8 blocks of 4


def test_state_of_the_cpu_default_pool_is_max_num_seqs_full_contexts(model):
    eng = LLMEngine(model, config=EngineConfig(max_num_seqs=3))  # 3 × 64 tokens, far under the 256 MiB cap
    s = eng.state()
    assert (s.kv_blocks_total, s.kv_tokens_total, s.kv_max_full_sequences) == (12, 192, 3)


def test_a_cpu_engine_never_profiles(model, monkeypatch):
    monkeypatch.setattr(llm_engine, "profile_forward", lambda *a: pytest.fail("a CPU engine profiled"))
    assert LLMEngine(model, config=EngineConfig(max_num_seqs=2)).state().kv_blocks_total == 8


def test_an_engine_with_a_device_probe_sizes_its_pool_from_it_and_still_generates(model, monkeypatch):
    block_bytes = kv_bytes_per_block(model.config, 16, model.dtype)
    memory = FakeMemory(free=7 * block_bytes + 5)  # 7 whole blocks: 112 tokens, one 64-token context
    monkeypatch.setattr(llm_engine, "device_memory", lambda device: memory)
    eng = LLMEngine(model, config=EngineConfig(gpu_memory_utilization=1.0))
    s = eng.state()
    assert memory.profiled == 1 and (s.kv_blocks_total, s.kv_tokens_total, s.kv_max_full_sequences) == (7, 112, 1)
    [out] = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_an_engine_whose_device_holds_no_full_context_refuses_to_start(model, monkeypatch):
    block_bytes = kv_bytes_per_block(model.config, 16, model.dtype)
    monkeypatch.setattr(llm_engine, "device_memory", lambda device: FakeMemory(free=3 * block_bytes))
    with pytest.raises(ValueError, match="max_model_len <= 48"):
        LLMEngine(model, config=EngineConfig(gpu_memory_utilization=1.0))
