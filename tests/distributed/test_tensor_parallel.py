"""Tensor parallelism: shards add up to the whole layer (vocabulary included), TP=2 over real gloo processes equals
TP=1, the driver's one scheduler runs every policy over persistent workers, bad sizes are refused before any process
starts, and a worker's exception or death reaches the driver as an error naming its rank — never a hang."""

import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import threading
import time

import pytest
import torch
import tp_workers
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import LLM, EngineConfig, ModelConfig, SamplingParams
from minillm.distributed import comm
from minillm.distributed.driver import TPDriver
from minillm.distributed.executor import tp_generate
from minillm.distributed.parallel_state import ParallelContext
from minillm.distributed.step import StepInputs, pack_step, payload_size, unpack_step
from minillm.distributed.worker import WorkerError, run_workers
from minillm.engine.llm_engine import LLMEngine
from minillm.kernels.select import ops_for
from minillm.kv.block_allocator import BlockCopy, CopyKind
from minillm.kv.paged_cache import AttentionMetadata, PrefillChunk
from minillm.layers.linear import Linear
from minillm.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    rank_config,
    shard_model,
)
from minillm.models.llama import Transformer
from minillm.models.loader import build_model

CFG = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8]]
OPS = ops_for("torch", "cpu", torch.float32)


def tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(CFG), LlamaForCausalLM(CFG).state_dict(), dtype=torch.float32,
                       device="cpu")


def fake_rank(rank, world_size=2):
    """A rank's context without processes: enough to cut shards (no collective is called)."""
    return ParallelContext(rank, world_size, group=object())


def test_column_shards_of_a_stacked_projection_hold_whole_parts_in_rank_order():
    lin = Linear(8, 4 + 2 + 2)
    lin.weight.data = torch.arange(8.0)[:, None].expand(8, 8).clone()  # row i is all i: rows identify themselves
    rows = [ColumnParallelLinear.from_linear(lin, fake_rank(r), (4, 2, 2)).weight[:, 0].tolist() for r in range(2)]
    assert rows == [[0, 1, 4, 6], [2, 3, 5, 7]]  # q rows 0-1 | 2-3, k row 4 | 5, v row 6 | 7


def test_row_shards_partial_sums_add_up_to_the_whole_layer():
    lin, x = Linear(12, 5, bias=True), torch.randn(3, 12)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    parts = [RowParallelLinear.from_linear(lin, fake_rank(r, 3)) for r in range(3)]
    partial = sum(OPS.linear(xs, p.weight, p.bias) for xs, p in zip(x.chunk(3, dim=-1), parts, strict=True))
    torch.testing.assert_close(partial, lin(x, OPS))  # the all-reduce's sum: rank 0's bias counted once
    assert [p.bias is None for p in parts] == [False, True, True]


def test_tp_one_shard_is_the_whole_model():
    model, ids = tiny(), torch.randint(0, 100, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    with torch.inference_mode():
        torch.testing.assert_close(shard_model(model, ParallelContext())(ids, pos), model(ids, pos))


@pytest.mark.parametrize("tp", [0, -1, 3, 2.0])
def test_sizes_that_do_not_divide_the_heads_or_are_below_one_are_refused(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        rank_config(ModelConfig.from_hf(CFG), tp)


def test_refusal_names_the_valid_sizes_before_any_process_starts():
    smol_like = ModelConfig.from_hf(dict(model_type="llama", vocab_size=100, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"use one of \[1, 3\]"):
        rank_config(smol_like, 2)
    with pytest.raises(ValueError, match="does not divide"):
        tp_generate(tiny(), PROMPTS, GREEDY, tensor_parallel_size=4)


@pytest.fixture(scope="module")
def tp2_vs_tp1():
    model, ids = tiny(), torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9).expand(2, 9)
    got = run_workers(tp_workers.logits_and_tokens, 2, (model, ids, pos, PROMPTS, GREEDY), threads_per_worker=1)
    with torch.inference_mode():
        want = model(ids, pos), [o.outputs[0].token_ids for o in LLMEngine(model).generate(PROMPTS, GREEDY)]
    return got, want


def test_tp2_over_two_gloo_processes_gives_the_tp1_logits(tp2_vs_tp1):
    got, (logits, _) = tp2_vs_tp1
    for rank_logits, _, _ in got:  # every rank holds the full logits (replicated LM head after the all-reduce)
        torch.testing.assert_close(rank_logits, logits)


def test_tp2_greedy_tokens_equal_tp1_with_half_the_kv_heads_per_rank(tp2_vs_tp1):
    got, (_, tokens) = tp2_vs_tp1
    assert [g[1] for g in got] == [tokens, tokens]
    assert [g[2] for g in got] == [CFG.num_key_value_heads // 2] * 2


def test_a_worker_exception_reaches_the_parent_with_its_traceback():
    with pytest.raises(WorkerError, match=r"(?s)rank 1 raised.*fails_on_rank_one.*rank one's own message"):
        run_workers(tp_workers.fails_on_rank_one, 2, threads_per_worker=1, timeout_s=60)


def test_collectives_are_the_identity_at_world_size_one():
    x = torch.randn(3, 4)
    ctx = ParallelContext()
    assert comm.all_reduce(x, ctx) is x and comm.all_gather(x, ctx) is x and comm.broadcast(x, ctx) is x


def test_a_packed_step_unpacks_to_the_same_inputs_and_its_header_gives_the_payload_size():
    t = lambda *x: torch.tensor(x)  # noqa: E731
    meta = AttentionMetadata(t(8, 9, 12, 13, 14, 20, 21), t(0, 1), torch.tensor([[2, 0], [3, 5]], dtype=torch.int32),
                             torch.tensor([1, 6], dtype=torch.int32),
                             [PrefillChunk(2, 5, 3, t(3)), PrefillChunk(5, 7, 6, t(5, 4))], 1, False)
    step = StepInputs([BlockCopy(4, 6, CopyKind.SWAP_IN), BlockCopy(1, 2, CopyKind.COPY_ON_WRITE)],
                      t(list(range(10, 18))).view(1, 8), t(list(range(8))).view(1, 8), meta, t(0, 1, 4, 6, 7))
    header, payload = pack_step(step, "cpu")
    assert payload_size(header) == payload.numel()
    got = unpack_step(header, payload)
    assert got.copies == step.copies
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(got, name), getattr(step, name))
    for name in ("slot_mapping", "decode_rows", "block_tables", "seq_lens"):
        want = getattr(meta, name)
        assert torch.equal(getattr(got.meta, name), want) and getattr(got.meta, name).dtype == want.dtype
    assert [(c.start, c.end, c.context_len, c.block_ids.tolist()) for c in got.meta.prefills] == \
        [(2, 5, 3, [3]), (5, 7, 6, [5, 4])]
    assert (got.meta.num_padding, got.meta.decode_only) == (1, False)
    copies_only = unpack_step(*pack_step(StepInputs(step.copies), "cpu"))
    assert copies_only.copies == step.copies and not copies_only.has_forward


def tp_children(besides: list | None = None) -> list:
    """This process's live tensor-parallel worker processes, except those in ``besides`` (other tests' drivers)."""
    return [p for p in multiprocessing.active_children()
            if p.name.startswith("minillm-tp-rank") and p not in (besides or [])]


def finishes_within(seconds: float, fn) -> dict:
    """Run ``fn`` in a thread; fail the test if it still runs after ``seconds`` (a hang) -> {"value" | "error"}."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 — handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    return box


def test_vocab_shards_hold_their_rows_of_the_padded_table_and_tied_heads_share_the_shard():
    cfg = LlamaConfig(**{**CFG.to_dict(), "vocab_size": 101, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                        device="cpu")
    table = model.model.embed_tokens.weight
    shards = [shard_model(model, fake_rank(r)) for r in range(2)]
    for s in shards:
        assert isinstance(s.model.embed_tokens, VocabParallelEmbedding) and isinstance(s.lm_head, VocabParallelLMHead)
        assert s.lm_head.weight is s.model.embed_tokens.weight  # tied: one shard, two uses
    rows = torch.cat([s.model.embed_tokens.weight for s in shards])  # (102, hidden): 101 padded to 2 × 51
    torch.testing.assert_close(rows[:101], table)
    assert rows[101].abs().sum() == 0 and shards[1].model.embed_tokens.start == 51


def test_vocab_parallel_logits_over_two_processes_equal_the_full_head_with_a_padded_vocabulary(driver):
    tp, model = driver
    ids = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(3))
    ids[0, :3] = torch.tensor([0, 50, 100])  # the first id of each shard and the last of the vocabulary
    pos = torch.arange(6).expand(2, 6)
    with torch.inference_mode():
        want = model(ids, pos)
    got = tp.forward(ids, pos)
    assert got.shape == want.shape == (2, 6, 101)  # the padding column is cut off
    torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def driver():
    """One persistent TP=2 driver over a tied, odd-vocabulary (101 = 2 × 51 − 1) model, shared by the tests below.
    Weights N(0, 0.3), not Hugging Face's 0.02: peaked logits, so a K/V row a worker got wrong changes tokens."""
    cfg = ModelConfig.from_hf(LlamaConfig(**{**CFG.to_dict(), "vocab_size": 101, "tie_word_embeddings": True}))
    torch.manual_seed(2)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        torch.nn.init.ones_(p) if "norm" in name else torch.nn.init.normal_(p, std=0.3)
    model.requires_grad_(False).eval()
    tp = TPDriver(model, 2, threads_per_worker=1)
    yield tp, model
    tp.shutdown()


def workload(sampled: bool):
    """10 requests of mixed prompt (3..30) and output (1..12) lengths: greedy, or two seeded samples each (forks
    share their prompt's last block until copy-on-write splits it, and sampled tokens follow the K/V closely: a
    worker that skipped a copy-on-write or swap copy changes them)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(101) for _ in range(rng.randint(3, 30))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True) for _ in prompts]
    if sampled:
        params = [dataclasses.replace(p, n=2, temperature=1.0, seed=i) for i, p in enumerate(params)]
    return prompts, params


ENGINES = {  # block_size 4: prompts span many blocks, so chunking, prefix hits and preemption happen at small sizes
    "dynamic": dict(policy="dynamic", max_num_seqs=4, max_num_batched_tokens=32, dynamic_window_s=0.01),
    "preempt-swap": dict(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=16, preemption="swap"),
    "static": dict(policy="static", max_num_seqs=3, max_num_batched_tokens=32),
    "fork-copy-on-write": dict(max_num_seqs=8, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("mode", ENGINES)
def test_the_driver_schedules_once_and_gives_the_single_process_tokens(driver, mode):
    tp, model = driver
    prompts, params = workload(sampled=mode in ("preempt-swap", "fork-copy-on-write"))
    config = EngineConfig(block_size=4, **ENGINES[mode])
    tokens = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    want = tokens(LLMEngine(model, config=config).generate(prompts, params))
    engine = LLMEngine(tp.model, None, config, executor=tp)
    assert tokens(engine.generate(prompts, params)) == want
    if mode == "preempt-swap":
        assert engine.stats.swaps_out > 0, "the budget was meant to force swapping"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    """Random weights over the default model's vocabulary (so its tokenizer fits), saved with that tokenizer."""
    path = tmp_path_factory.mktemp("tp-model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**CFG.to_dict(), "vocab_size": 49152})).save_pretrained(path)
    for f in default_model_dir.glob("*token*"):
        shutil.copy(f, path)
    return path


def test_llm_workers_persist_across_calls_and_shutdown_leaves_no_child_processes(model_dir):
    others = tp_children()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=2, policy="dynamic")
    assert tp_children(others) == []  # nothing starts before the first call
    want = [o.outputs[0].token_ids for o in LLMEngine(llm.model).generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    pids = [p.pid for p in tp_children(others)]
    assert len(pids) == 1
    assert [o.text for o in llm.generate(["Hello"], GREEDY)][0]  # a string prompt: the driver's tokenizer
    assert [p.pid for p in tp_children(others)] == pids  # the same worker served both calls
    llm.shutdown()
    assert tp_children(others) == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY)


def test_a_killed_worker_raises_a_runtime_error_naming_its_rank_instead_of_hanging(model_dir):
    others = tp_children()
    with LLM(str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        llm.generate([[1, 2, 3]], GREEDY)
        (worker,) = tp_children(others)
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        box = finishes_within(60, lambda: llm.generate(PROMPTS, GREEDY))
        assert isinstance(box.get("error"), RuntimeError), box
        assert "rank 1" in str(box["error"]) and "exit code" in str(box["error"])
        assert time.monotonic() - started < 60
        with pytest.raises(RuntimeError, match="rank 1"):  # refused from then on, with the same message
            llm.generate(PROMPTS, GREEDY)
    assert tp_children(others) == []


def test_sizes_and_options_the_workers_cannot_run_are_refused_before_any_process_starts(model_dir):
    others = tp_children()
    with pytest.raises(ValueError, match=r"use one of \[1, 2\]"):
        LLM(str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="quantiz"):
        LLM(str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=2, quantization="int8")
    assert tp_children(others) == []
