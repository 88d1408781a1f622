"""Pipeline parallelism: layers split over real gloo processes give the one-process logits and greedy tokens,
the micro-batch schedule's bubble matches GPipe's formula, bad sizes are refused before any process starts, a stage
that dies is reported, and no process outlives a call."""

import multiprocessing
import os
import random

import pp_workers
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.distributed.parallel_state import ParallelContext
from minillm.distributed.pipeline import (
    PipelineStage,
    bubble_fraction,
    gpipe_bubble,
    gpipe_schedule,
    pp_generate,
    split_microbatches,
    stage_generate,
    stage_layers,
)
from minillm.distributed.worker import WorkerError, run_workers
from minillm.engine.llm_engine import LLMEngine
from minillm.models.loader import build_model

CFG = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7], [3], [4, 5, 6, 7]]


def tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(CFG), LlamaForCausalLM(CFG).state_dict(), dtype=torch.float32,
                       device="cpu")


def engine_tokens(model, params=GREEDY, eos=None):
    engine = LLMEngine(model, eos_token_ids=eos) if eos is not None else LLMEngine(model)
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def pp2_vs_pp1():
    model = tiny()
    ids = torch.randint(0, 100, (5, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9).expand(5, 9)
    eos = engine_tokens(model)[0][2]  # a token the first prompt really produces: EOS ends requests early
    params = [SamplingParams(max_tokens=8, temperature=0)] * len(PROMPTS)
    got = run_workers(pp_workers.logits_and_tokens, 2, (model, ids, pos, PROMPTS, params, (eos,), 2),
                      threads_per_worker=1)
    with torch.inference_mode():
        logits = model(ids, pos)
    return got, logits, engine_tokens(model, params[0], eos=(eos,)), eos


def test_pp2_over_two_gloo_processes_gives_the_single_process_logits(pp2_vs_pp1):
    got, logits, _, _ = pp2_vs_pp1
    assert got[0][0] is None  # only the last stage holds the LM head
    torch.testing.assert_close(got[1][0], logits)


def test_pp2_greedy_tokens_and_eos_stops_equal_one_process(pp2_vs_pp1):
    got, _, tokens, eos = pp2_vs_pp1
    outputs = got[1][1]
    assert [o.token_ids for o in outputs] == tokens
    assert outputs[0].finish_reason == "stop" and outputs[0].token_ids[-1] == eos
    assert any(o.finish_reason == "length" for o in outputs)  # both ways of ending occur


def test_each_stage_holds_half_the_layers_and_their_kv_cache_only(pp2_vs_pp1):
    got, _, _, _ = pp2_vs_pp1
    assert [(g[2], g[3]) for g in got] == [(2, 2), (2, 2)]


@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_one_stage_schedule_gives_the_engine_tokens_for_any_microbatch_count(m):
    model = tiny()
    outs = stage_generate(ParallelContext(), PipelineStage(model, 0, 1), PROMPTS, [GREEDY] * len(PROMPTS), m)
    assert [o.token_ids for o in outs] == engine_tokens(model)


def test_stages_share_the_models_layers_and_split_embedding_from_head():
    model = tiny()
    first, last = PipelineStage(model, 0, 2), PipelineStage(model, 1, 2)
    assert first.layers[0] is model.model.layers[0] and last.layers[0] is model.model.layers[2]
    assert first.lm_head is None and last.embed_tokens is None and first.embed_tokens is not None


@pytest.mark.parametrize("pp", [3, 0, 5, 2.0])
def test_sizes_that_do_not_divide_the_layers_are_refused_naming_valid_sizes(pp):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        stage_layers(ModelConfig.from_hf(CFG), pp, 0)
    with pytest.raises(ValueError, match=r"use one of \[1, 2, 4\]"):
        pp_generate(tiny(), PROMPTS, GREEDY, pipeline_parallel_size=3)


def test_a_stage_that_dies_is_reported_and_no_process_is_left():
    with pytest.raises(WorkerError, match="rank 1 died with exit code 7"):
        run_workers(pp_workers.last_stage_dies, 2, (tiny(), PROMPTS, [GREEDY] * len(PROMPTS)),
                    threads_per_worker=1, timeout_s=60)
    assert multiprocessing.active_children() == []


def test_shutdown_frees_the_processes():
    pids = [pid for pid, _ in run_workers(pp_workers.child_pids, 2, threads_per_worker=1)]
    assert multiprocessing.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_microbatches_cover_every_row_once_in_order_with_sizes_within_one():
    for n, m in [(5, 2), (4, 4), (3, 8), (10, 3)]:
        mbs = split_microbatches(n, m)
        assert [i for mb in mbs for i in mb] == list(range(n)) and len(mbs) == min(n, m)
        assert max(map(len, mbs)) - min(map(len, mbs)) <= 1


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (2, 4), (4, 4), (4, 16), (8, 3)])
def test_equal_stage_times_give_gpipes_bubble(p, m):
    schedule = gpipe_schedule([[0.5] * m for _ in range(p)])
    assert bubble_fraction(schedule) == pytest.approx(gpipe_bubble(p, m))
    assert schedule[-1][-1][1] == pytest.approx((m + p - 1) * 0.5)


def test_schedule_respects_both_dependencies_and_never_waits_needlessly():
    rng = random.Random(3)
    times = [[rng.uniform(0.1, 2.0) for _ in range(5)] for _ in range(3)]
    s = gpipe_schedule(times)
    for i in range(3):
        for j in range(5):
            start, end = s[i][j]
            assert end == pytest.approx(start + times[i][j])
            ready = max(s[i - 1][j][1] if i else 0.0, s[i][j - 1][1] if j else 0.0)
            assert start == pytest.approx(ready)  # starts as soon as its input and its stage are free


def test_llm_with_pipeline_parallel_size_two_generates_the_single_process_tokens(tmp_path, default_model_dir):
    import shutil

    from minillm import LLM

    torch.manual_seed(0)  # random weights over the default model's vocabulary, so its tokenizer fits
    LlamaForCausalLM(LlamaConfig(**{**CFG.to_dict(), "vocab_size": 49152})).save_pretrained(tmp_path)
    for f in default_model_dir.glob("*token*"):
        shutil.copy(f, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", pipeline_parallel_size=2)
    got = llm.generate(["Hello there", [1, 2, 3]], GREEDY)
    want = LLMEngine(llm.model, llm.tokenizer).generate(["Hello there", [1, 2, 3]], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].text == want[0].text
    with pytest.raises(ValueError, match=r"use one of \[1, 2, 4\]"):
        LLM(str(tmp_path), dtype="float32", device="cpu", pipeline_parallel_size=3)
