"""Tensor parallelism: shards add up to the whole layer, TP=2 over two real gloo processes equals TP=1, bad sizes
are refused before any process starts, and a worker's exception reaches the parent with its traceback."""

import pytest
import torch
import tp_workers
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.distributed import comm
from minillm.distributed.executor import tp_generate
from minillm.distributed.parallel_state import ParallelContext
from minillm.distributed.worker import WorkerError, run_workers
from minillm.engine.llm_engine import LLMEngine
from minillm.kernels.select import ops_for
from minillm.layers.linear import Linear
from minillm.layers.parallel import ColumnParallelLinear, RowParallelLinear, rank_config, shard_model
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


def test_llm_with_tensor_parallel_size_two_generates_the_single_process_tokens(tmp_path, default_model_dir):
    import shutil

    from minillm import LLM

    torch.manual_seed(0)  # random weights over the default model's vocabulary, so its tokenizer fits
    LlamaForCausalLM(LlamaConfig(**{**CFG.to_dict(), "vocab_size": 49152})).save_pretrained(tmp_path)
    for f in default_model_dir.glob("*token*"):
        shutil.copy(f, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
        [o.outputs[0].token_ids for o in LLMEngine(llm.model).generate(PROMPTS, GREEDY)]
    with pytest.raises(ValueError, match=r"use one of \[1, 2\]"):
        LLM(str(tmp_path), dtype="float32", device="cpu", tensor_parallel_size=3)
