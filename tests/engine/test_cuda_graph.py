"""The static-buffer decode path (engine/cuda_graph.py) run uncaptured on CPU: bucketing, padding rows, and greedy
tokens equal to the eager engine's on random configs — the logic CUDA graphs replay on a GPU."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.engine.cuda_graph import CudaGraphRunner, batch_buckets, bucket_for
from minillm.engine.runners import use_static_decode
from minillm.models.loader import build_model


def random_model(seed: int, layers: int = 2, kernels: str = "auto", **overrides):
    rng = random.Random(seed)
    heads = rng.choice([2, 4, 6])
    kv_heads = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
    cfg = LlamaConfig(vocab_size=rng.choice([128, 257]), hidden_size=16 * heads,
                      intermediate_size=rng.choice([48, 96]), num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-5, **overrides)
    torch.manual_seed(seed)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu", kernels=kernels)


def requests(model, n: int, seed: int):
    """n greedy requests with different prompt (2..20) and output (1..10) lengths: members finish mid-batch."""
    rng = random.Random(seed)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(rng.randint(2, 20))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 10), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def tokens(model, prompts, params, **config):
    eng = LLMEngine(model, config=EngineConfig(**{"block_size": 4, **config}))
    return [o.token_ids for o in eng.generate(prompts, params)], eng


def test_buckets_are_powers_of_two_up_to_the_maximum():
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(1) == (1,)
    assert [bucket_for(b, (1, 2, 4, 6)) for b in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]


def test_enforce_eager_decides_and_the_default_is_eager_on_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not use_static_decode(None, cpu, compiled=False)
    assert use_static_decode(None, cuda, compiled=False)
    assert use_static_decode(None, cpu, compiled=True)
    assert use_static_decode(False, cpu, compiled=False) and not use_static_decode(True, cuda, compiled=False)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8])
def test_static_decode_gives_the_eager_greedy_tokens(seed, batch):
    model = random_model(seed)
    prompts, params = requests(model, batch, seed)
    want, _ = tokens(model, prompts, params, enforce_eager=True, max_num_seqs=8)
    got, eng = tokens(model, prompts, params, enforce_eager=False, max_num_seqs=8)
    assert got == want
    replays = eng.runner.graphs.replays
    assert sum(replays.values()) > 0  # the static path ran (this is not the eager path twice)
    assert set(replays) <= {1, 2, 4, 8}


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_static_decode_matches_eager_on_each_kernel_set(kernels):
    from minillm.kernels.cpu import native

    if kernels == "native" and not native.available():
        pytest.skip("the native CPU kernels did not build here (no C compiler)")
    model = random_model(3, kernels=kernels)
    prompts, params = requests(model, 5, 3)
    want, _ = tokens(model, prompts, params, enforce_eager=True, max_num_seqs=8)
    got, _ = tokens(model, prompts, params, enforce_eager=False, max_num_seqs=8)
    assert got == want


def test_padding_rows_write_only_the_scratch_block():
    """Three decodes padded to a bucket of four: the pool's KV equals the eager engine's, block for block."""
    model = random_model(4)
    prompts, params = requests(model, 3, 4)
    _, eager = tokens(model, prompts, params, enforce_eager=True, max_num_seqs=4, num_kv_blocks=40)
    _, static = tokens(model, prompts, params, enforce_eager=False, max_num_seqs=4, num_kv_blocks=40)
    assert static.runner.graphs.replays[4] > 0
    assert static.kv_cache.k.shape[1] == eager.kv_cache.k.shape[1] + 1  # the scratch block past the pool
    torch.testing.assert_close(static.kv_cache.k[:, :40], eager.kv_cache.k)
    torch.testing.assert_close(static.kv_cache.v[:, :40], eager.kv_cache.v)
    assert static.kv_cache.k[:, 40].abs().sum() > 0  # the padding rows' K went to the scratch block


def test_a_quantized_kv_cache_decodes_eagerly_and_refuses_forced_static_buffers():
    """The int8 cache dequantizes a step's blocks into a pool sized per step: not graph-safe, so the default runs it
    eagerly and asking for static buffers explicitly is a ValueError naming both options."""
    model = random_model(6)
    eng = LLMEngine(model, config=EngineConfig(kv_cache_dtype="int8"))
    assert not isinstance(eng.runner, CudaGraphRunner)
    with pytest.raises(ValueError, match="enforce_eager=False.*kv_cache_dtype='auto'"):
        LLMEngine(model, config=EngineConfig(kv_cache_dtype="int8", enforce_eager=False))


def test_static_batches_with_pad_rows_and_big_batches_fall_back_correctly():
    """pad_batches' finished rows ride in the bucket; a batch past the largest bucket runs eagerly."""
    model = random_model(5)
    prompts, params = requests(model, 6, 5)
    want, _ = tokens(model, prompts, params, enforce_eager=True, max_num_seqs=6, policy="static")
    got, eng = tokens(model, prompts, params, enforce_eager=False, max_num_seqs=6, policy="static")
    assert got == want and eng.runner.graphs.replays[6] > 0
    # buckets up to 6, but a prefill-free step of 6 + pads never exceeds it; a continuous batch of 6 decodes does fit
    got, _ = tokens(model, prompts, params, enforce_eager=False, max_num_seqs=6)
    assert got == want


def _inductor_cpp_available() -> bool:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:  # noqa: BLE001 — no compiler, or an inductor without this helper
        return False


@pytest.mark.skipif(not _inductor_cpp_available(), reason="inductor's C++ backend needs a C++ compiler")
def test_compiled_decode_step_gives_the_eager_greedy_tokens():
    """kernels="compiled": the bucketed decode step through torch.compile (inductor C++ on CPU).  One bucket and
    one layer keep the compilation to a few seconds."""
    torch._dynamo.reset()
    ref = random_model(6, layers=1, kernels="torch")
    prompts, params = requests(ref, 1, 6)
    want, _ = tokens(ref, prompts, params, enforce_eager=True, max_num_seqs=1)
    got, eng = tokens(ref.set_kernels("compiled"), prompts, params, max_num_seqs=1)  # None: on for "compiled"
    assert got == want and eng.runner.graphs.replays[1] > 0
