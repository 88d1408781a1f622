"""Pipeline parallelism: layers split over real gloo processes give the one-process logits, and the one engine
over the pipeline executor (``PPDriver``) the one-process tokens under every policy, sampling, stop strings,
prefix caching and preemption; the micro-batch schedule's bubble matches GPipe's formula, bad sizes are refused
before any process starts, a stage that dies is reported naming its rank, and no process outlives a call."""

import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import time

import pp_workers
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import LLM, EngineConfig, ModelConfig, SamplingParams
from minillm.distributed.parallel_state import ParallelContext
from minillm.distributed.pipeline import (
    PipelineStage,
    bubble_fraction,
    gpipe_bubble,
    gpipe_schedule,
    pp_generate,
    split_microbatches,
    stage_layers,
)
from minillm.distributed.pp_driver import PPDriver, stage_step
from minillm.distributed.worker import WorkerError, run_workers
from minillm.engine.llm_engine import LLMEngine
from minillm.models.loader import build_model, load_tokenizer

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
    stages = run_workers(pp_workers.logits_and_layers, 2, (model, ids, pos, 2), threads_per_worker=1)
    outputs = pp_generate(model, PROMPTS, params, 2, eos_token_ids=(eos,), threads_per_worker=1)
    got = [(logits, outputs if rank == 1 else None, layers, kv_layers)  # per stage, as the assertions read it
           for rank, (logits, layers, kv_layers) in enumerate(stages)]
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


class OneStage:
    """The pipeline executor's step with a single stage, in this process (no worker, no message)."""

    def __init__(self, model):
        self.model = PipelineStage(model, 0, 1)

    def check(self):
        pass

    def shutdown(self):
        pass

    def attach_kv(self, kv, kv_args):
        pass

    def run_step(self, kv, step):
        return stage_step(self.model, kv, step, ParallelContext())


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_one_stage_step_gives_the_engine_tokens_under_every_policy(policy):
    model = tiny()
    config = EngineConfig(policy=policy, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    engine = LLMEngine(model, config=config, executor=OneStage(model))
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] == engine_tokens(model)


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
        run_workers(pp_workers.last_stage_dies, 2, (tiny(), torch.ones(4, 3, dtype=torch.long),
                                                     torch.arange(3).expand(4, 3)), threads_per_worker=1, timeout_s=60)
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


# ------------------------------------------------------------------------------------------- the engine over PPDriver
def random_model(seed: int):
    """A random tiny Llama over the default tokenizer's vocabulary (so stop strings and string prompts work):
    2 or 4 layers, 1..4 K/V heads, tied or not.  Weights N(0, 0.3) (norms 1): peaked logits, so a K/V row a stage
    got wrong changes tokens."""
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    cfg = LlamaConfig(vocab_size=49152, hidden_size=8 * heads * rng.choice([1, 2]), num_attention_heads=heads,
                      num_key_value_heads=rng.choice([h for h in (1, 2, 4) if heads % h == 0]),
                      intermediate_size=rng.choice([48, 80]), num_hidden_layers=rng.choice([2, 4]),
                      max_position_embeddings=96, tie_word_embeddings=rng.random() < 0.5)
    torch.manual_seed(seed)
    model = build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                        device="cpu")
    for name, p in model.named_parameters():
        torch.nn.init.ones_(p) if "norm" in name else torch.nn.init.normal_(p, std=0.3)
    return model


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda s: f"config{s}")
def pp_driver(request):
    """One persistent PP=2 driver per random config, shared by the engine tests below (each engine re-attaches
    its K/V cache to the stages)."""
    model = random_model(request.param)
    driver = PPDriver(model, 2, threads_per_worker=1)
    yield driver, model
    driver.shutdown()


def workload(seed: int, sampled: bool, shared_prefix: bool = False):
    """10 requests of mixed prompt (3..30 tokens, or a shared 12-token prefix + a tail) and output (1..12)
    lengths, plus a string prompt: greedy, or two seeded samples each (forks share their prompt's last block until
    copy-on-write splits it)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(49152) for _ in range(12)] if shared_prefix else []
    prompts = [prefix + [rng.randrange(49152) for _ in range(rng.randint(3, 30 - len(prefix)))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True) for _ in prompts]
    if sampled:
        params = [dataclasses.replace(p, n=2, temperature=1.0, seed=i) for i, p in enumerate(params)]
    return prompts + ["Hello there"], params + [params[0]]


ENGINES = {  # block_size 4: prompts span many blocks, so chunking, prefix hits and preemption happen at small sizes
    "continuous": dict(max_num_seqs=8, max_num_batched_tokens=32),
    "static": dict(policy="static", max_num_seqs=3, max_num_batched_tokens=64),
    "prefix-caching": dict(max_num_seqs=2, max_num_batched_tokens=32, enable_prefix_caching=True),
    "preempt-swap": dict(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=16, preemption="swap"),
    "preempt-recompute": dict(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=16),
    "fork-copy-on-write": dict(max_num_seqs=8, max_num_batched_tokens=32),
}


def samples(outputs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("mode", ENGINES)
def test_pp2_engine_gives_the_single_process_outputs(pp_driver, tokenizer, mode):
    driver, model = pp_driver
    sampled = mode in ("preempt-swap", "fork-copy-on-write")
    prompts, params = workload(len(mode), sampled, shared_prefix=mode == "prefix-caching")
    config = EngineConfig(block_size=4, **ENGINES[mode])
    want = LLMEngine(model, tokenizer, config).generate(prompts, params)
    engine = LLMEngine(driver.model, tokenizer, config, executor=driver)
    assert samples(engine.generate(prompts, params)) == samples(want)
    assert engine.kv_cache.k.shape[0] == model.config.num_layers // 2  # stage 0's layers only
    if mode == "prefix-caching":
        assert engine.block_manager.prefix_stats.hit_rate > 0, "the shared prefix was meant to hit the cache"
    if mode.startswith("preempt"):
        assert engine.stats.preemptions > 0, "the budget was meant to force preemption"
    if mode == "preempt-swap":
        assert engine.stats.swaps_out > 0, "the budget was meant to force swapping"


def test_pp2_stop_strings_end_requests_where_one_process_does(pp_driver, tokenizer):
    """(Stop strings were refused by the old pipelined loop; the engine applies them on rank 0.)"""
    driver, model = pp_driver
    prompts, params = workload(7, sampled=False)
    free = LLMEngine(model, tokenizer).generate(prompts, params)
    text = next(o.text for o in free if len(o.text) > 6)
    stop = [dataclasses.replace(p, stop=[text[3:6]], ignore_eos=False) for p in params]
    want = LLMEngine(model, tokenizer).generate(prompts, stop)
    got = LLMEngine(driver.model, tokenizer, executor=driver).generate(prompts, stop)
    assert samples(got) == samples(want)
    assert any(o.finish_reason == "stop" and text[3:6] not in o.text for o in got)  # a stop string ended one


def test_pp2_n2_seeded_sampling_equals_one_process(pp_driver, tokenizer):
    """(``n`` > 1 was refused by the old pipelined loop; the engine forks on rank 0, every stage copies blocks.)"""
    driver, model = pp_driver
    prompts, params = workload(3, sampled=True)
    want = LLMEngine(model, tokenizer).generate(prompts, params)
    got = LLMEngine(driver.model, tokenizer, executor=driver).generate(prompts, params)
    assert samples(got) == samples(want)
    assert all(len(o.outputs) == 2 for o in got)


def pp_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("minillm-pp-rank")]


def test_a_stage_killed_mid_generation_raises_naming_it_and_leaves_no_process(tmp_path, default_model_dir):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**CFG.to_dict(), "vocab_size": 49152})).save_pretrained(tmp_path)
    for f in default_model_dir.glob("*token*"):
        shutil.copy(f, tmp_path)
    before = pp_children()
    with LLM(str(tmp_path), dtype="float32", device="cpu", pipeline_parallel_size=2) as llm:
        stream = llm.stream(PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        next(stream)  # the prefill ran on both stages
        (stage,) = [p for p in pp_children() if p not in before]
        os.kill(stage.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1 died with exit code -9"):
            list(stream)
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerError, match="rank 1"):  # refused from then on, with the same message
            llm.generate(PROMPTS, GREEDY)
    assert [p for p in pp_children() if p not in before] == []


def test_options_the_stages_cannot_run_are_refused_before_any_process_starts():
    from minillm.config import ParallelConfig
    from minillm.engine.runners import check_parallel

    pp2, before = ParallelConfig(pipeline_parallel_size=2), pp_children()
    with pytest.raises(ValueError, match="speculative_config is not supported with pipeline_parallel_size"):
        check_parallel(tiny(), EngineConfig(parallel_config=pp2, speculative_config={"method": "ngram"}))
    with pytest.raises(ValueError, match="enforce_eager=False"):
        check_parallel(tiny(), EngineConfig(parallel_config=pp2, enforce_eager=False))
    assert pp_children() == before  # (an earlier test's LLM may still be waiting for garbage collection)
