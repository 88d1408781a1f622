"""bench serving: the KV bookkeeping is exact, the transformers baseline counts only useful tokens, and the whole
benchmark runs end to end at its quick size on a tiny random checkpoint."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm.perf.bench.serving import QUICK, bench_serving, chat_lengths_trace, hf_padded_generate, kv_memory
from minillm.perf.workloads import RequestSpec, random_corpus, skewed_trace


def spec(total: int) -> RequestSpec:
    return RequestSpec(0.0, (1,) * (total - 1), 1)


def test_kv_memory_counts_partial_last_blocks_and_whole_reservations():
    kv = kv_memory([spec(17)] * 10, block_size=16, reserve_len=64, budget_tokens=320)
    assert kv["paged_waste"] == pytest.approx(15 / 32)  # 17 tokens in 2 blocks
    assert kv["contiguous_waste"] == pytest.approx(1 - 17 / 64)
    assert kv["paged_fit"] == 10 and kv["contiguous_fit"] == 5  # 20 blocks hold all 10; 320 // 64 = 5
    assert kv["concurrency_ratio"] == 2.0


def test_chat_length_trace_pages_with_little_waste_and_fits_several_times_more_sequences():
    kv = kv_memory(chat_lengths_trace(500), reserve_len=2048, budget_tokens=16384)
    assert kv["paged_waste"] < 0.04 and kv["contiguous_waste"] > 0.6
    assert kv["concurrency_ratio"] >= 3


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer Llama saved as a local checkpoint (config.json + safetensors, no tokenizer)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_transformers_baseline_generates_every_token_but_counts_each_requests_own(tiny_checkpoint):
    hf = LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval()
    trace = skewed_trace(5, random_corpus(512, n=1000), prompt_len=(3, 9), short=(2, 3), long=(7, 8),
                         long_fraction=0.4, seed=1)
    report = hf_padded_generate(hf, trace, batch_size=3, pad_token_id=0)
    assert [r.output_tokens for r in report.records] == [s.max_tokens for s in trace]
    assert report.steps == max(s.max_tokens for s in trace[:3]) + max(s.max_tokens for s in trace[3:])
    assert all(len(r.itl_s) == r.output_tokens - 1 and r.ttft_s <= r.e2e_s for r in report.records)
    assert report.records[3].queue_s >= report.records[0].e2e_s  # the second batch starts after the first


def test_bench_serving_runs_end_to_end_at_quick_size(tiny_checkpoint, tmp_path):
    result = bench_serving(str(tiny_checkpoint), device="cpu", quick=True, out_dir=tmp_path)
    saved = json.loads((tmp_path / "serving-cpu.json").read_text())
    assert saved["machine"]["threads"] == torch.get_num_threads() == result["threads"]
    assert set(saved["batching"]) == {"continuous", "static", "static, rows dropped", "dynamic",
                                       "transformers padded"}
    total = sum(r["output_tokens"] for r in saved["batching"].values())
    assert total == 5 * saved["batching_trace"]["output_tokens"]
    assert set(saved["targets_met"]) >= {"paged KV waste", "throughput continuous / static",
                                         "throughput continuous / transformers", "TTFT p50 prefix cache off / on"}
    assert saved["prefix_caching"]["hit_rate"] > 0.5
    assert saved["virtual_clock"]["poisson"]["reports"]["sim continuous"]["requests"] == QUICK.sim_requests
    assert saved["corpus"].startswith("uniform random")
