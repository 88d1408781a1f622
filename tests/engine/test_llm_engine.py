"""LLMEngine against the simple cached loop: every batching mode must give each request exactly its solo output.

A tiny random Llama (GQA, 3 layers) keeps this fast; block_size 4 makes prompts span many blocks, so chunked
prefill, copy-on-write, prefix hits and preemption all happen at small sizes.
"""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import LLM, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.engine.simple import generate
from minillm.models.loader import build_model
from minillm.sampling.sampler import sample_seed

V = 320


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


@pytest.fixture(scope="module")
def workload(model):
    """14 greedy requests of mixed prompt (3..40) and output (1..16) lengths, and each one's solo output."""
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 40))] for _ in range(14)]
    params = [SamplingParams(max_tokens=rng.randint(1, 16), temperature=0, ignore_eos=True) for _ in prompts]
    solo = [generate(model, [p], sp)[0].output for p, sp in zip(prompts, params, strict=True)]
    return prompts, params, solo


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(**{"block_size": 4, **kw}))


def assert_all_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert not eng.has_unfinished_requests()
    assert bm.device.num_used == 0 and bm.stats().logical_tokens == 0
    assert bm.host is None or bm.host.num_used == 0


# 48 blocks of 4 tokens hold ~3 of the longest requests at once: preemption is forced.
MODES = {
    "continuous": dict(max_num_seqs=16, max_num_batched_tokens=512),
    "chunked-prefill-16": dict(max_num_seqs=8, max_num_batched_tokens=16),
    "no-chunking": dict(max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill=False),
    "preempt-recompute": dict(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=20),
    "preempt-swap": dict(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=20, preemption="swap"),
    "static": dict(policy="static", max_num_seqs=5, max_num_batched_tokens=32),
    "static-rows-dropped": dict(policy="static", max_num_seqs=5, max_num_batched_tokens=32, pad_batches=False),
    "dynamic": dict(policy="dynamic", max_num_seqs=5, max_num_batched_tokens=32, dynamic_window_s=0.0),
    "no-prefix-cache": dict(max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=False),
}


@pytest.mark.parametrize("mode", MODES)
def test_batched_greedy_outputs_equal_each_request_run_alone(model, workload, mode):
    prompts, params, solo = workload
    eng = engine(model, **MODES[mode])
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == solo
    assert all(o.finish_reason == "length" for o in outs)
    if "preempt" in mode:
        assert eng.stats.preemptions > 0, "the budget was meant to force preemption"
    if mode == "preempt-swap":
        assert eng.stats.swaps_out > 0
    if mode in ("static", "static-rows-dropped", "dynamic"):
        assert eng.stats.peak_running <= 5
        assert (eng.stats.padding_rows > 0) == (mode != "static-rows-dropped")
    assert_all_free(eng)


def test_eos_ends_a_request_as_in_the_simple_loop(model, workload):
    prompts, _, _ = workload
    params = SamplingParams(max_tokens=12, temperature=0)
    eos = generate(model, [prompts[0]], dataclasses.replace(params, ignore_eos=True))[0].output[4]
    want = generate(model, prompts[:6], params, eos_ids=[eos])
    got = LLMEngine(model, config=EngineConfig(block_size=4), eos_token_ids=[eos]).generate(prompts[:6], params)
    assert [o.token_ids for o in got] == [s.output for s in want]
    assert [o.finish_reason for o in got] == [s.finish_reason for s in want] and got[0].finish_reason == "stop"


def logits_of(eng: LLMEngine, rid: str) -> list[torch.Tensor]:
    rows = []
    while eng.has_unfinished_requests():
        rows += [u.logits for u in eng.step() if u.request_id == rid]
    return rows


def test_a_requests_logits_do_not_depend_on_its_batch(model, workload):
    prompts, _, _ = workload
    target, params = prompts[5], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = engine(model, max_num_seqs=8, max_num_batched_tokens=16, return_logits=True)
    alone.add_request(target, params, request_id="x")
    want = logits_of(alone, "x")
    crowd = engine(model, max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=40, return_logits=True)
    for i, p in enumerate(prompts[:4]):
        crowd.add_request(p, dataclasses.replace(params, max_tokens=3 + 4 * i), request_id=f"o{i}")
    crowd.add_request(target, params, request_id="x")  # prefill chunks split differently, neighbours come and go
    got = logits_of(crowd, "x")
    assert len(got) == len(want) == 10
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_pad_rows_of_a_fixed_shape_batch_change_no_real_rows_logits(model, workload):
    prompts, _, _ = workload
    params = [SamplingParams(max_tokens=2 + 5 * i, temperature=0, ignore_eos=True) for i in range(3)]
    logits = {}
    for pad in (True, False):
        eng = engine(model, policy="static", max_num_seqs=3, return_logits=True, pad_batches=pad)
        for i, sp in enumerate(params):
            eng.add_request(prompts[i], sp, request_id=str(i))
        logits[pad] = logits_of(eng, "2")
        # requests 0 and 1 finish after 2 and 7 tokens: 5 steps with one pad row, then 5 with two
        assert eng.stats.padding_rows == (15 if pad else 0)
        assert_all_free(eng)
    assert len(logits[True]) == len(logits[False]) == 12
    for a, b in zip(logits[True], logits[False], strict=True):
        torch.testing.assert_close(a, b)


def test_prefix_cache_hits_skip_prefill_and_keep_outputs_exact(model):
    rng = random.Random(1)
    prefix = [rng.randrange(V) for _ in range(40)]  # 10 full blocks of 4
    a, b = prefix + [5, 6, 7], prefix + [8, 9]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng = engine(model)
    first = eng.generate([a], params)[0]
    second = eng.generate([b], params)[0]
    assert first.metrics.prefix_hit_tokens == 0 and second.metrics.prefix_hit_tokens == 40
    assert second.token_ids == generate(model, [b], params)[0].output
    assert eng.generate([a], params)[0].token_ids == first.token_ids  # a full repeat: all but the last block
    assert eng.block_manager.prefix_stats.hit_tokens >= 80
    assert_all_free(eng)


def test_parallel_samples_share_prompt_blocks_and_match_seeded_solo_runs(model, workload):
    prompt = workload[0][3] + workload[0][4]  # not a multiple of the block size: the shared last block is copied
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    solo_eng = engine(model, enable_prefix_caching=False)
    solo_eng.generate([prompt], dataclasses.replace(params, n=1))
    eng = engine(model, enable_prefix_caching=False)
    out = eng.generate([prompt], params)[0]
    assert len(out.outputs) == 4 and out.token_ids == out.outputs[0].token_ids
    for i, sample in enumerate(out.outputs):
        want = generate(model, [prompt], dataclasses.replace(params, n=1, seed=sample_seed(7, i)))[0].output
        assert sample.index == i and sample.token_ids == want
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1
    assert eng.stats.peak_used_blocks < 4 * solo_eng.stats.peak_used_blocks
    assert_all_free(eng)


def test_parallel_samples_survive_preemption(model, workload):
    prompt = workload[0][0]
    params = SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
    want = [generate(model, [prompt], dataclasses.replace(params, n=1, seed=sample_seed(3, i)))[0].output
            for i in range(3)]
    need = -(-(len(prompt) + 11) // 4)
    for preemption in ("recompute", "swap"):
        eng = engine(model, num_kv_blocks=need + 1, preemption=preemption)
        out = eng.generate([prompt], params)[0]
        assert [s.token_ids for s in out.outputs] == want and eng.stats.preemptions > 0
        assert_all_free(eng)


def test_request_that_never_fits_is_rejected_while_others_finish(model, workload):
    prompts, params, solo = workload
    eng = engine(model, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=4)  # 48 slots
    ok = [eng.add_request(prompts[i], params[i]) for i in (0, 1)]
    with pytest.raises(ValueError, match="needs up to 13 KV blocks .* whole KV cache has 12"):
        eng.add_request(list(range(40)), SamplingParams(max_tokens=12))
    ok.append(eng.add_request(prompts[2], params[2]))
    while eng.has_unfinished_requests():
        eng.step()
    assert [eng.pop_output(r).token_ids for r in ok] == solo[:3]
    with pytest.raises(ValueError, match="empty"):
        eng.generate([prompts[0], []], params[0])  # checked before anything is queued
    assert_all_free(eng)


def test_abort_frees_blocks_and_keeps_partial_output(model, workload):
    prompts, params, solo = workload
    eng = engine(model)
    long = eng.add_request(prompts[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    short = eng.add_request(prompts[1], params[1])
    for _ in range(3):
        eng.step()
    used = eng.block_manager.device.num_used
    eng.abort(long)
    assert eng.block_manager.device.num_used < used
    aborted = eng.pop_output(long)
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 3
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.pop_output(short).token_ids == solo[1]
    assert_all_free(eng)


def test_state_reports_the_batch_the_queue_and_kv_use_as_they_change(model, workload):
    prompts, _, _ = workload
    eng = engine(model, max_num_seqs=2)
    idle = eng.state()
    assert (idle.running, idle.waiting, idle.kv_blocks_used, idle.steps) == (0, 0, 0, 0)
    assert idle.kv_blocks_total == eng.block_manager.device.num_blocks and idle.spec_acceptance_rate is None
    for p in prompts[:3]:
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert (eng.state().running, eng.state().waiting) == (0, 3)
    eng.step()
    busy = eng.state()
    assert (busy.running, busy.waiting, busy.steps) == (2, 1, 1) and busy.kv_blocks_used > 0
    while eng.has_unfinished_requests():
        eng.step()
    done = eng.state()
    assert (done.running, done.waiting, done.kv_blocks_used) == (0, 0, 0) and done.steps > busy.steps


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_budget_for_a_single_sequence_completes_without_deadlock(model, workload, preemption):
    prompts, params, solo = workload
    need = max(-(-(len(p) + sp.max_tokens - 1) // 4) for p, sp in zip(prompts[:8], params[:8], strict=True))
    eng = engine(model, num_kv_blocks=need, max_num_batched_tokens=16, max_num_seqs=8, preemption=preemption)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts[:8], params[:8], strict=True)]
    steps, bound = 0, 20 * sum(len(p) + sp.max_tokens for p, sp in zip(prompts[:8], params[:8], strict=True))
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        assert steps < bound, "the engine stopped making progress"
    assert [eng.pop_output(r).token_ids for r in rids] == solo[:8]
    assert_all_free(eng)


def test_metrics_record_queueing_first_token_and_inter_token_times(model, workload):
    prompts, _, _ = workload
    eng = engine(model, max_num_seqs=2, max_num_batched_tokens=16)
    outs = eng.generate(prompts[:4], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    for o in outs:
        m = o.metrics
        assert m.prompt_tokens == len(o.prompt_token_ids) and m.output_tokens == 5 == len(m.token_times_s)
        assert m.start_s <= m.first_scheduled_s <= m.first_token_s <= m.finish_s
        assert len(m.itl_s) == 4 and all(t >= 0 for t in m.itl_s) and m.tpot_s > 0
    assert outs[3].metrics.queue_s > outs[0].metrics.queue_s  # max_num_seqs=2: the last two waited


class LetterTokenizer:
    """Token i is the letter chr(97 + i % 26): enough for text deltas and stop strings without a download."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[ord(c) - 97 for c in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_streamed_deltas_add_up_and_stop_strings_end_the_request(model):
    tok = LetterTokenizer()
    eng = LLMEngine(model, tok, EngineConfig(block_size=4))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = eng.generate("hello", params)[0]
    assert full.text == tok.decode(full.token_ids)
    stop = full.text[6:8]
    at = full.text.find(stop)
    rid = eng.add_request("hello", dataclasses.replace(params, stop=(stop,)))
    deltas, updates = [], []
    while eng.has_unfinished_requests():
        for u in eng.step():
            updates.append(u)
            deltas.append(u.text)
    out = eng.pop_output(rid)
    assert out.text == "".join(deltas) == full.text[:at] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: at + len(stop)]  # stopped on the token completing the stop string
    assert updates[-1].finished and not any(u.finished for u in updates[:-1])
    assert_all_free(eng)


def test_bad_engine_options_name_the_option():
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="fastest")
    with pytest.raises(ValueError, match="max_num_batched_tokens .* max_num_seqs"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="either num_kv_blocks or kv_cache_bytes"):
        EngineConfig(num_kv_blocks=4, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="pad_batches must be True or False"):
        EngineConfig(policy="static", pad_batches="yes")
    with pytest.raises(ValueError, match="preemption"):
        LLM(preemption="drop")  # checked before the model loads


@pytest.mark.slow
def test_llm_forwards_engine_options_and_generate_matches_stream():
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=4, block_size=8, kv_cache_bytes=64 << 20)
    assert llm.engine.config.max_num_seqs == 4 and llm.engine.kv_cache.k.shape[2] == 8
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Memory bandwidth"]
    streamed, order = {}, []
    for u in llm.stream(prompts, params):
        if u.request_id not in streamed:
            order.append(u.request_id)
        streamed[u.request_id] = streamed.get(u.request_id, "") + u.text
    outs = llm.generate(prompts, params)
    assert [o.text for o in outs] == [streamed[r] for r in order] and all(o.text for o in outs)
    assert llm.engine.num_live_requests == 0 and llm.engine.block_manager.device.num_used == 0
