"""The model and the engine on a real GPU (``gpu`` marker: skipped without CUDA): logits against transformers,
greedy tokens against the CPU engine's, and CUDA-graph decode against eager decode."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.engine.cuda_graph import CudaGraphRunner
from minillm.models.loader import build_model

pytestmark = pytest.mark.gpu


def random_config(seed: int) -> LlamaConfig:
    rng = random.Random(seed)
    heads, kv_heads = rng.choice([(9, 3), (8, 2), (4, 4), (6, 1)])  # GQA groups of 3 and 4, MHA, MQA
    return LlamaConfig(vocab_size=rng.choice([512, 1000]), hidden_size=32 * heads,  # D = 32
                       intermediate_size=rng.choice([256, 512]), num_hidden_layers=rng.choice([2, 4]),
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=rng.random() < 0.5)


def pair(seed: int, dtype: torch.dtype, device: str):
    cfg = random_config(seed)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    return hf, build_model(ModelConfig.from_hf(cfg), hf.state_dict(), dtype=dtype, device=device)


def workload(vocab: int, n: int, seed: int):
    """n greedy requests, prompts 3..200 tokens, outputs 1..24: members finish mid-batch."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 200))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def greedy(model, prompts, params, **config):
    eng = LLMEngine(model, config=EngineConfig(**{"block_size": 16, "max_num_seqs": 8, **config}))
    return [o.token_ids for o in eng.generate(prompts, params)], eng


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_model_on_cuda_matches_transformers(seed, dtype):
    hf, ours = pair(seed, dtype, "cuda")
    hf = hf.to("cuda", dtype)
    ids = torch.randint(0, hf.config.vocab_size, (2, 300), device="cuda")
    with torch.no_grad():
        got = ours(ids, torch.arange(300, device="cuda").expand(2, 300)).float()
        want = hf(ids).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # 16-bit through the layers, different op order
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_on_cuda_gives_the_cpu_engines_greedy_tokens(seed):
    """fp32 on both (Triton's fp32 dots run in IEEE precision, cuBLAS without TF32): the same tokens."""
    _, cpu = pair(seed, torch.float32, "cpu")
    _, gpu = pair(seed, torch.float32, "cuda")
    prompts, params = workload(cpu.config.vocab_size, 5, seed)
    want, _ = greedy(cpu, prompts, params)
    got, _ = greedy(gpu, prompts, params, enforce_eager=True)
    assert got == want
    got, eng = greedy(gpu, prompts, params)  # the default on CUDA: graphs
    assert isinstance(eng.runner, CudaGraphRunner) and eng.runner.graphs.graphs
    assert got == want


@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8])
def test_cuda_graph_decode_gives_the_eager_greedy_tokens(batch):
    _, model = pair(batch, torch.float32, "cuda")
    prompts, params = workload(model.config.vocab_size, batch, batch)
    want, _ = greedy(model, prompts, params, enforce_eager=True)
    got, eng = greedy(model, prompts, params, enforce_eager=False)
    graphs = eng.runner.graphs
    assert set(graphs.graphs) == {1, 2, 4, 8} and graphs.capture_report.buckets == (1, 2, 4, 8)
    assert sum(graphs.replays.values()) > 0
    assert got == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_decode_in_16_bit_follows_eager(dtype):
    """16-bit: padding to a bucket may change a GEMM's algorithm and so the last bit of a logit; the first tokens
    (before any near-tie can compound) must agree and almost all tokens overall."""
    _, model = pair(7, dtype, "cuda")
    prompts, params = workload(model.config.vocab_size, 6, 7)
    want, _ = greedy(model, prompts, params, enforce_eager=True)
    got, _ = greedy(model, prompts, params, enforce_eager=False)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 0.9 * sum(len(w) for w in want)


def test_capture_reports_its_time_and_memory():
    _, model = pair(3, torch.bfloat16, "cuda")
    eng = LLMEngine(model, config=EngineConfig(max_num_seqs=32))
    report = eng.runner.graphs.capture_report
    assert report.buckets == (1, 2, 4, 8, 16, 32) and report.seconds > 0 and report.memory_bytes >= 0
