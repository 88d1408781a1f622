"""The KV pool sized to the device (``kv.memory.size_kv_pool``), on CPU through a fake ``DeviceMemory``.

The fake reports a device of chosen size, use and activation peak, and records what was asked of it, so the
arithmetic, the error and the bypasses are checked exactly without a GPU.
"""

import logging
from fractions import Fraction

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import EngineConfig, ModelConfig
from minillm.kv.memory import CudaMemory, device_memory, full_sequences, profile_forward, size_kv_pool
from minillm.kv.paged_cache import kv_bytes_per_block
from minillm.models.loader import build_model

GiB = 2**30
# A 7B-like block: 32 layers × 16 tokens × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes (bf16) = 2 MiB
LLAMA = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
BLOCK_BYTES = kv_bytes_per_block(LLAMA, 16, torch.bfloat16)


class FakeMemory:
    """A device of ``total`` bytes with ``used`` in use, where the profile peaks at ``peak`` bytes."""

    def __init__(self, total: int, used: int, peak: int):
        self._total, self._used, self._peak = total, used, peak
        self.calls: list[str] = []

    def total(self) -> int:
        self.calls.append("total")
        return self._total

    def in_use(self) -> int:
        self.calls.append("in_use")
        return self._used

    def peak_during(self, fn) -> int:
        self.calls.append("peak_during")
        fn()
        return self._peak


class UntouchableMemory:
    """A probe that fails the test if the sizing reads it."""

    def __getattr__(self, name):
        raise AssertionError(f"the probe was read ({name}) although the budget was explicit")


def test_block_bytes_of_the_7b_like_model_are_2_mib():
    assert BLOCK_BYTES == 2 * 2**20


def test_pool_gets_utilization_times_total_minus_in_use_minus_peak():
    memory, profiled = FakeMemory(16 * GiB, 2 * GiB, 1 * GiB), []
    size = size_kv_pool(EngineConfig(), BLOCK_BYTES, 8192, memory, lambda: profiled.append(True))
    expected = int((Fraction(9, 10) * 16 - 2 - 1) * GiB) // BLOCK_BYTES
    assert size.num_blocks == expected == 5836  # 11.4 GiB / 2 MiB
    assert size.source == "gpu_memory_utilization" and size.budget_bytes // BLOCK_BYTES == expected
    assert profiled == [True] and memory.calls.count("peak_during") == 1


def test_a_lower_utilization_gives_a_smaller_pool():
    sizes = [size_kv_pool(EngineConfig(gpu_memory_utilization=u), BLOCK_BYTES, 8192,
                          FakeMemory(16 * GiB, 2 * GiB, 1 * GiB)).num_blocks for u in (0.5, 0.9, 1.0)]
    assert sizes == [(8 * GiB - 3 * GiB) // BLOCK_BYTES, 5836, (13 * GiB) // BLOCK_BYTES]


def test_too_little_memory_for_one_full_context_raises_with_the_numbers_and_the_fixes():
    # 0.9 × 16 − 12 − 2 = 0.4 GiB = 204 blocks = 3264 tokens < one 8192-token sequence (512 blocks)
    with pytest.raises(ValueError) as e:
        size_kv_pool(EngineConfig(), BLOCK_BYTES, 8192, FakeMemory(16 * GiB, 12 * GiB, 2 * GiB))
    msg = str(e.value)
    for part in ("gpu_memory_utilization=0.9", "16.00 GiB", "12.00 GiB in use", "2.00 GiB activation peak",
                 "max_num_batched_tokens=512", "204 blocks", "512 needed", "max_model_len=8192",
                 "max_model_len <= 3264", "lower max_num_batched_tokens", "smaller model"):
        assert part in msg, f"{part!r} not in {msg!r}"


def test_no_room_for_one_block_says_so():
    with pytest.raises(ValueError, match="not one block fits"):
        size_kv_pool(EngineConfig(), BLOCK_BYTES, 8192, FakeMemory(16 * GiB, 15 * GiB, 1 * GiB))


def test_exactly_one_full_context_is_enough():
    need = 8192 // 16 * BLOCK_BYTES
    size = size_kv_pool(EngineConfig(gpu_memory_utilization=1.0), BLOCK_BYTES, 8192,
                        FakeMemory(10 * GiB + need, 9 * GiB, 1 * GiB))
    assert size.num_blocks == 512 and full_sequences(size.num_blocks, 16, 8192) == 1


@pytest.mark.parametrize("budget, blocks", [(dict(num_kv_blocks=100), 100), (dict(kv_cache_bytes=300 * 2**20), 150)])
def test_an_explicit_budget_never_reads_the_probe(budget, blocks):
    config = EngineConfig(**budget)
    size = size_kv_pool(config, BLOCK_BYTES, 8192, UntouchableMemory(), lambda: pytest.fail("profiled"))
    assert size.num_blocks == config.resolve_num_blocks(BLOCK_BYTES, 8192) == blocks
    assert size.source == next(iter(budget))


def test_without_a_probe_the_default_is_unchanged():
    config = EngineConfig(max_num_seqs=4)
    size = size_kv_pool(config, BLOCK_BYTES, 8192, None, lambda: pytest.fail("profiled"))
    assert size.num_blocks == config.resolve_num_blocks(BLOCK_BYTES, 8192) == 512  # one 1 GiB context > 256 MiB
    assert size.source == "default"


def test_a_cpu_has_no_probe_and_a_cuda_device_reads_the_driver():
    assert device_memory("cpu") is None and device_memory(torch.device("cpu")) is None
    probe = device_memory("cuda:0")  # built without touching CUDA: nothing is read until the sizing asks
    assert isinstance(probe, CudaMemory) and probe.device == torch.device("cuda:0")


def test_the_device_sizing_logs_one_line_with_blocks_tokens_and_the_source(caplog):
    with caplog.at_level(logging.INFO, logger="minillm"):
        size_kv_pool(EngineConfig(), BLOCK_BYTES, 8192, FakeMemory(16 * GiB, 2 * GiB, 1 * GiB))
    [record] = [r for r in caplog.records if r.name == "minillm"]
    line = record.getMessage()
    assert "5836 blocks" in line and f"{5836 * 16} tokens" in line and "11 full 8192-token" in line
    assert "gpu_memory_utilization" in line


def test_without_a_probe_nothing_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="minillm"):
        size_kv_pool(EngineConfig(), BLOCK_BYTES, 8192)
    assert not [r for r in caplog.records if r.name == "minillm"]


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, True, "0.9", None])
def test_utilization_outside_0_to_1_is_rejected_naming_the_field_and_range(bad):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=bad)


def test_utilization_of_one_and_a_small_fraction_are_accepted():
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert EngineConfig(gpu_memory_utilization=0.05).gpu_memory_utilization == 0.05


def test_full_sequences_rounds_a_partial_block_up():
    assert full_sequences(10, 4, 8) == 5 and full_sequences(10, 4, 9) == 3 and full_sequences(2, 4, 9) == 0


def test_profile_forward_runs_more_tokens_than_the_context_on_a_tiny_model():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                        device="cpu")
    assert profile_forward(model, EngineConfig(max_num_batched_tokens=40, max_num_seqs=4), 16) is None


def test_pool_stops_at_max_num_seqs_full_context_sequences():
    """An 80 GiB device and 4 sequences of 8192 tokens: 4 × 512 blocks, not the ~60 GiB the fraction allows —
    the rest is left to the next engine in the process."""
    size = size_kv_pool(EngineConfig(max_num_seqs=4), BLOCK_BYTES, 8192, FakeMemory(80 * GiB, 2 * GiB, 1 * GiB))
    assert size.num_blocks == 4 * 8192 // 16
    assert size.budget_bytes > size.num_blocks * BLOCK_BYTES  # the budget itself is reported uncapped
