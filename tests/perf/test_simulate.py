"""Replays: the virtual clock prices steps exactly as the cost model does and drives the real scheduler; the wall-clock
replay of a tiny random model reports well-formed metrics."""

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import EngineConfig, LLMEngine, ModelConfig
from minillm.models.loader import build_model
from minillm.perf.hardware import get_spec
from minillm.perf.roofline import decode_step_cost, prefill_cost
from minillm.perf.simulate import (
    RooflineStepTime,
    StepChunk,
    format_reports,
    kv_cache_budget,
    llama2_7b_config,
    replay,
    simulate,
    step_cost,
)
from minillm.perf.workloads import RequestSpec, random_corpus, skewed_trace

LLAMA = llama2_7b_config()
H100 = get_spec("H100-SXM")
QWEN_LIKE = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                        num_kv_heads=2, head_dim=32, qkv_bias=True, tie_word_embeddings=True, model_type="qwen2")


def same_cost(a, b):
    assert a.flops == pytest.approx(b.flops, rel=1e-12) and a.bytes == pytest.approx(b.bytes, rel=1e-12)
    assert dict(a.breakdown) == pytest.approx(dict(b.breakdown), rel=1e-12)
    assert dict(a.flops_breakdown) == pytest.approx(dict(b.flops_breakdown), rel=1e-12)


def test_llama2_7b_has_its_published_parameter_count():
    assert LLAMA.num_parameters() == pytest.approx(6.74e9, rel=1e-3)
    assert kv_cache_budget(LLAMA, H100) == pytest.approx(0.9 * 80e9 - 2 * 6.738e9, rel=1e-3)


@pytest.mark.parametrize("config", [LLAMA, QWEN_LIKE], ids=["llama2-7b", "qwen-like"])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_one_chunk_costs_what_prefill_cost_says(config, kv_dtype):
    same_cost(step_cost(config, [StepChunk(300, 45)], "bfloat16", kv_dtype),
              prefill_cost(config, 1, 300, "bfloat16", kv_dtype, past_len=45))


@pytest.mark.parametrize("config", [LLAMA, QWEN_LIKE], ids=["llama2-7b", "qwen-like"])
def test_a_batch_of_decodes_costs_what_decode_step_cost_says(config):
    same_cost(step_cost(config, [StepChunk(1, 99)] * 24, "float16"), decode_step_cost(config, 24, 100, "float16"))


def test_a_mixed_step_reads_the_weights_once_and_runs_the_head_only_for_sampling_rows():
    mixed = step_cost(LLAMA, [StepChunk(1, 500), StepChunk(1, 20), StepChunk(256, 0, samples=False)], "bfloat16")
    one = decode_step_cost(LLAMA, 1, 10, "bfloat16")
    assert mixed.breakdown["weights"] == pytest.approx(one.breakdown["weights"], rel=1e-12)
    alone = [step_cost(LLAMA, [c], "bfloat16") for c in (StepChunk(1, 500), StepChunk(1, 20))]
    head = 2 * LLAMA.hidden_size * LLAMA.vocab_size  # LM-head FLOPs per sampling row
    chunk = prefill_cost(LLAMA, 1, 256, "bfloat16")  # includes one head row the mixed step does not run
    assert mixed.flops == pytest.approx(alone[0].flops + alone[1].flops + chunk.flops - head, rel=1e-12)


def test_roofline_step_time_is_the_slower_of_bytes_and_flops_plus_overhead():
    st = RooflineStepTime(LLAMA, H100, "bfloat16", overhead_s=0.003)
    decode = [StepChunk(1, 511)] * 8
    c = decode_step_cost(LLAMA, 8, 512, "bfloat16")
    assert st(decode) == pytest.approx(c.bytes / 3.35e12 + 0.003, rel=1e-12)  # memory bound
    prefill = [StepChunk(2048, 0)]
    p = prefill_cost(LLAMA, 1, 2048, "bfloat16")
    assert st(prefill) == pytest.approx(p.flops / 989e12 + 0.003, rel=1e-12)  # compute bound
    assert c.flops / 989e12 < c.bytes / 3.35e12 and p.bytes / 3.35e12 < p.flops / 989e12


def test_virtual_clock_advances_by_exactly_the_modelled_step_times():
    st = RooflineStepTime(LLAMA, H100, "bfloat16", overhead_s=0.001)
    trace = [RequestSpec(0.25, tuple(range(100)), 4)]
    report = simulate(trace, LLAMA, EngineConfig(max_num_batched_tokens=512, num_kv_blocks=64), st)
    r = report.records[0]
    prefill = st([StepChunk(100, 0)])
    decodes = [st([StepChunk(1, 100 + k)]) for k in range(3)]  # the token sampled last is never fed back
    assert r.arrival_s == 0.25 and r.queue_s == 0.0
    assert r.ttft_s == pytest.approx(prefill, rel=1e-12)
    assert r.itl_s == pytest.approx(tuple(decodes), rel=1e-12)
    assert r.e2e_s == pytest.approx(prefill + sum(decodes), rel=1e-12)
    assert report.steps == 4 and report.output_tokens == 4


def test_step_log_records_what_each_step_ran_on_the_virtual_clock():
    st = RooflineStepTime(LLAMA, H100, "bfloat16", overhead_s=0.001)
    trace = [RequestSpec(0.0, tuple(range(100)), 3), RequestSpec(0.0, tuple(range(500, 540)), 2)]
    report = simulate(trace, LLAMA, EngineConfig(max_num_batched_tokens=64, num_kv_blocks=64), st)
    log = report.step_log
    assert len(log) == report.steps
    # 140 prompt tokens in chunks of the 64-token budget, then the decodes (each answer's first token comes from
    # its prefill): budget 64 = 64 | 36 + 28 | 1 decode + 12 | 2 decodes (both answers end)
    assert [(s.prefill_tokens, s.prefill_chunks, s.decode_rows) for s in log] == [
        (64, 1, 0), (64, 2, 0), (12, 1, 1), (0, 0, 2)]
    assert [s.waiting for s in log] == [1, 0, 0, 0] and log[0].running == 1 and log[1].running == 2
    assert log[0].start_s == 0.0 and all(a.start_s + a.duration_s == pytest.approx(b.start_s)
                                         for a, b in zip(log, log[1:], strict=False))
    assert sum(s.prefill_tokens for s in log) == report.prefill_tokens
    assert sum(s.decode_rows for s in log) == report.output_tokens - len(trace)


def test_continuous_beats_static_batching_on_a_skewed_trace():
    st = RooflineStepTime(LLAMA, H100, "bfloat16", overhead_s=0.002)
    trace = skewed_trace(200, random_corpus(32000, n=4096), prompt_len=(32, 256), short=(16, 64), long=(256, 512),
                         long_fraction=0.1, seed=0)
    runs = {p: simulate(trace, LLAMA, EngineConfig(policy=p, max_num_seqs=32, max_num_batched_tokens=2048,
                                                   kv_cache_bytes=kv_cache_budget(LLAMA, H100)), st)
            for p in ("static", "dynamic", "continuous")}
    assert all(r.output_tokens == sum(s.max_tokens for s in trace) for r in runs.values())
    assert runs["continuous"].output_tok_s >= 1.5 * runs["static"].output_tok_s
    assert runs["continuous"].latency("ttft")["p50"] < runs["static"].latency("ttft")["p50"]
    assert "continuous" in format_reports(list(runs.values()))


def test_pad_rows_of_fixed_shape_batches_are_priced_like_real_rows():
    st = RooflineStepTime(LLAMA, H100, "bfloat16")
    trace = [RequestSpec(0.0, (1, 2, 3), 1), RequestSpec(0.0, (4, 5, 6), 3)]
    runs = {pad: simulate(trace, LLAMA, EngineConfig(policy="static", max_num_seqs=2, num_kv_blocks=16,
                                                     pad_batches=pad), st) for pad in (True, False)}
    prefill = st([StepChunk(3, 0), StepChunk(3, 0)])
    solo = [st([StepChunk(1, 3 + k)]) for k in range(2)]
    padded = [st([StepChunk(1, 3 + k), StepChunk(1, 0)]) for k in range(2)]  # the finished row: one pad token
    assert runs[False].duration_s == pytest.approx(prefill + sum(solo), rel=1e-12)
    assert runs[True].duration_s == pytest.approx(prefill + sum(padded), rel=1e-12)
    assert runs[True].duration_s > runs[False].duration_s and runs[True].steps == runs[False].steps == 3


def test_dynamic_batching_waits_for_its_window_when_the_batch_is_not_full():
    st = RooflineStepTime(LLAMA, H100, "bfloat16")
    trace = [RequestSpec(0.0, (1, 2, 3), 2), RequestSpec(0.01, (4, 5, 6), 2)]
    cfg = EngineConfig(policy="dynamic", max_num_seqs=4, dynamic_window_s=0.5, num_kv_blocks=16)
    report = simulate(trace, LLAMA, cfg, st)
    assert report.records[0].queue_s == pytest.approx(0.5) and report.records[1].queue_s == pytest.approx(0.49)


def test_virtual_clock_preempts_when_blocks_run_out_and_still_finishes_everything():
    st = RooflineStepTime(LLAMA, H100, "bfloat16")
    trace = [RequestSpec(0.0, tuple(range(40)), 60) for _ in range(6)]
    for mode in ("recompute", "swap"):
        report = simulate(trace, LLAMA, EngineConfig(block_size=16, num_kv_blocks=20, preemption=mode), st)
        assert report.preemptions > 0 and report.output_tokens == 360


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32, device="cpu")


def test_real_replay_of_a_tiny_model_reports_well_formed_metrics(tiny_model):
    trace = skewed_trace(6, random_corpus(320, n=2000), rate=200.0, prompt_len=(4, 20), short=(2, 5), long=(9, 12),
                         long_fraction=0.3, seed=0)
    engine = LLMEngine(tiny_model, config=EngineConfig(block_size=4, max_num_seqs=3, max_num_batched_tokens=32))
    report = replay(engine, trace, label="tiny", warmup=True, ttft_slo_s=10.0, tpot_slo_s=10.0)
    assert [r.request_id for r in report.records] == [str(i) for i in range(6)]
    for spec, r in zip(trace, report.records, strict=True):
        assert r.output_tokens == spec.max_tokens and r.prompt_tokens == spec.prompt_len
        assert r.arrival_s == pytest.approx(spec.arrival_s, abs=1e-9)
        assert 0 <= r.queue_s <= r.ttft_s <= r.e2e_s and len(r.itl_s) == spec.max_tokens - 1
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = report.latency(name)
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert report.output_tokens == sum(s.max_tokens for s in trace)
    assert report.output_tok_s > 0 and report.prefill_tok_s > 0 and report.slo_attainment == 1.0
    assert report.goodput_req_s == pytest.approx(report.request_s)
    assert report.duration_s >= max(r.e2e_s for r in report.records)
    json.dumps(report.as_dict(with_records=True))
    assert not engine.has_unfinished_requests()


def test_real_replay_with_one_client_sends_each_request_after_the_previous_finished(tiny_model):
    trace = [RequestSpec(0.0, tuple(range(1, 9)), 3) for _ in range(4)]
    engine = LLMEngine(tiny_model, config=EngineConfig(block_size=4))
    report = replay(engine, trace, max_concurrency=1)
    recs = report.records
    assert all(b.arrival_s >= a.finish_s for a, b in zip(recs, recs[1:], strict=False))
    assert all(r.prefix_hit_tokens == 4 for r in recs[1:])  # same prompt: all but the last block hit
    assert math.isfinite(report.latency("tpot")["p50"])
