"""The fused native decode step (engine/native_runner.py, csrc/decode.c): the whole decoder stack in one call must
give the per-layer path's hidden states, K/V and greedy tokens, and refuse what it cannot run."""

import random

import pytest
import torch

from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.engine import native_runner as fused
from minillm.engine.model_runner import DecodeBatch, ModelRunner
from minillm.engine.native_runner import NativeRunner
from minillm.kernels.cpu import decode, native
from minillm.kv.paged_cache import AttentionMetadata, PagedAttention, PagedKVCache, make_paged_kv_cache
from minillm.layers.linear import QuantLinear
from minillm.models.llama import Transformer
from minillm.quant.apply import quantize_model
from minillm.quant.weight import Int4Weight

pytestmark = pytest.mark.skipif(not decode.available(), reason="the native decode library did not build here")

# (hidden, H_q, H_kv, D, F, layers, qkv_bias, tied): GQA, MQA and MHA; head_dim 64 and 32; Qwen2's qkv bias.
# Every K is a multiple of 32 so int4 (Q4_1, groups of 32) quantizes every linear.
CONFIGS = {
    "gqa-d64": (128, 4, 2, 64, 96, 3, False, False),
    "mqa-d32-bias": (96, 6, 1, 32, 64, 2, True, True),
    "mha-d32": (64, 2, 2, 32, 128, 2, False, False),
}
BLOCK = 4  # small blocks: every context below crosses block boundaries


def make_model(name: str, scheme: str = "fp32", seed: int = 0) -> Transformer:
    hidden, hq, hkv, d, f, layers, bias, tied = CONFIGS[name]
    cfg = ModelConfig(vocab_size=97, hidden_size=hidden, intermediate_size=f, num_layers=layers, num_heads=hq,
                      num_kv_heads=hkv, head_dim=d, max_position_embeddings=64, rms_norm_eps=1e-5,
                      qkv_bias=bias, tie_word_embeddings=tied, model_type="qwen2" if bias else "llama")
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():  # norms near 1, the rest small: logits of a trained model's size
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.2 * torch.randn_like(p))
    model.requires_grad_(False)
    if scheme == "bf16":  # bf16 weights, activations and (filled_caches) K/V
        return model.to(torch.bfloat16)
    if scheme.startswith("w8a8"):  # int8 × int8 linears; "w8a8-static" with scales calibrated on random tokens
        from minillm.quant.smooth import activation_absmax, quantize_model_w8a8

        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))
        stats = activation_absmax(model, ids) if scheme == "w8a8-static" else None
        return quantize_model_w8a8(model, scheme, act_absmax=stats)
    if scheme in ("q4_0", "q4_0-stored"):  # int4's codes and scales as Q4_0 blocks, m = −8·d (none stored, or stored)
        model = quantize_model(model, "int4")
        for name, m in list(model.named_modules()):
            if isinstance(m, QuantLinear) and isinstance(m.packed_weight, Int4Weight):
                w = Int4Weight(m.packed_weight.packed, m.packed_weight.scales, None, m.packed_weight.group_size)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child,
                        QuantLinear(w if scheme == "q4_0" else w.with_mins(), m.bias))
        return model
    return model if scheme == "fp32" else quantize_model(model, scheme)


def random_rows(lens: list[int], seed: int, vocab: int = 97) -> DecodeBatch:
    """One decode row per context length: sequence i owns blocks [8i, 8i + 8), its new token at position L - 1."""
    rng = random.Random(seed)
    tables = [[8 * i + j for j in range(-(-L // BLOCK))] for i, L in enumerate(lens)]
    slots = [t[(L - 1) // BLOCK] * BLOCK + (L - 1) % BLOCK for t, L in zip(tables, lens, strict=True)]
    return DecodeBatch([rng.randrange(vocab) for _ in lens], [L - 1 for L in lens], slots, tables, list(lens))


def filled_caches(model: Transformer, seed: int) -> tuple[PagedKVCache, PagedKVCache]:
    """Two equal paged caches of the model's dtype holding random K/V (the earlier context every row attends to)."""
    a, b = (PagedKVCache(model.config, 8 * 32, BLOCK, dtype=model.dtype, device="cpu") for _ in range(2))
    g = torch.Generator().manual_seed(seed)
    a.k.copy_(torch.randn(a.k.shape, generator=g))
    a.v.copy_(torch.randn(a.v.shape, generator=g))
    b.k.copy_(a.k)
    b.v.copy_(a.v)
    return a, b


def per_layer_hidden(model: Transformer, kv: PagedKVCache, batch: DecodeBatch) -> torch.Tensor:
    """The reference: ``model.hidden_states`` through ``PagedAttention`` on the model's kernels -> [B, hidden]."""
    W = max(len(t) for t in batch.block_tables)
    tables = torch.tensor([t + [0] * (W - len(t)) for t in batch.block_tables], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(batch.slot_mapping), torch.arange(len(batch)), tables,
                             torch.tensor(batch.seq_lens, dtype=torch.int32), [], 0, decode_only=True)
    with torch.inference_mode():
        cache = PagedAttention(kv, meta, model.kernel_ops())
        return model.hidden_states(torch.tensor([batch.input_ids]), torch.tensor([batch.positions]), cache)[0]


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4", "q4_0", "w8a8", "w8a8-static"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("lens", [[7], [1, 4, 5, 9, 17]], ids=["b1", "b5"])
def test_one_fused_call_equals_the_per_layer_native_path_bit_for_bit(name, scheme, lens):
    """Same kernels, same order, same inputs: the hidden states and the K/V written are identical."""
    model = make_model(name, scheme)
    kv_ref, kv_fused = filled_caches(model, 1)
    batch = random_rows(lens, 2)
    want = per_layer_hidden(model, kv_ref, batch)
    got = fused.NativeDecodeStack(model, kv_fused).hidden(batch)
    assert torch.equal(got, want)
    assert torch.equal(kv_fused.k, kv_ref.k) and torch.equal(kv_fused.v, kv_ref.v)
    assert not torch.equal(kv_fused.k, filled_caches(model, 1)[0].k)  # the step did write its rows


@pytest.mark.parametrize("scheme", ["fp32", "int4", "q4_0", "w8a8"])
def test_the_fused_step_gives_the_same_bits_on_one_thread_as_on_several(scheme):
    """The step's thread count follows the neighbours (``openmp.DecodeThreads``): the result must not."""
    from minillm import openmp

    model = make_model(list(CONFIGS)[-1], scheme)
    batch = random_rows([1, 4, 5, 9, 17], 3)
    kv_one, kv_many = filled_caches(model, 2)
    with openmp.num_threads(1):
        one = fused.NativeDecodeStack(model, kv_one).hidden(batch)
    with openmp.num_threads(3):  # more threads than rows of some splits, on any host
        many = fused.NativeDecodeStack(model, kv_many).hidden(batch)
    assert torch.equal(one, many) and torch.equal(kv_one.k, kv_many.k)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_hidden_states_match_the_torch_reference_in_fp32(name):
    model = make_model(name)
    kv_ref, kv_fused = filled_caches(model, 3)
    batch = random_rows([2, 5, 8, 13, 4], 4)
    got = fused.NativeDecodeStack(model, kv_fused).hidden(batch)
    torch.testing.assert_close(got, per_layer_hidden(model.set_kernels("torch"), kv_ref, batch))
    torch.testing.assert_close(kv_fused.k, kv_ref.k)


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_a_quantized_rows_result_does_not_depend_on_the_rows_beside_it(scheme):
    """Quantized linears take the int8-activation kernels at every row count (each row rounded and summed on its
    own), LM head included: 12 rows in one call give each row's logits exactly as 12 one-row calls do — what keeps
    speculative verification's γ + 1 rows equal to plain decode steps."""
    model = make_model("gqa-d64", scheme)
    kv_all, kv_one = filled_caches(model, 5)
    batch = random_rows([3 + i for i in range(12)], 6)
    together = fused.NativeDecodeStack(model, kv_all).logits(batch)
    runner = fused.NativeDecodeStack(model, kv_one)
    alone = torch.cat([runner.logits(DecodeBatch(*([f[i]] for f in (batch.input_ids, batch.positions,
                                                                      batch.slot_mapping, batch.block_tables,
                                                                      batch.seq_lens))))
                       for i in range(len(batch))])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_q4_0_linears_without_mins_give_the_fused_bits_of_m_stored_as_minus_8_d(name):
    """decode.c's linear_t carries a NULL mins pointer for a symmetric weight, and the step reads no mins for it: its
    hidden states, K/V and logits equal those of the same weights with m = −8·d stored, bit for bit."""
    sym, stored = make_model(name, "q4_0"), make_model(name, "q4_0-stored")
    assert {type(m.packed_weight.mins) for m in sym.modules() if isinstance(m, QuantLinear)
            and isinstance(m.packed_weight, Int4Weight)} == {type(None)}
    batch = random_rows([1, 4, 5, 9, 17], 12)
    (kv_sym, _), (kv_stored, _) = filled_caches(sym, 1), filled_caches(stored, 1)
    got = fused.NativeDecodeStack(sym, kv_sym).logits(batch)
    want = fused.NativeDecodeStack(stored, kv_stored).logits(batch)
    assert torch.equal(got, want) and torch.equal(kv_sym.k, kv_stored.k) and torch.equal(kv_sym.v, kv_stored.v)


def test_k_record_linears_give_the_fused_bits_of_their_expanded_fp32_form(k_record_weight):
    """decode.c's linear_t carries the scale format: GGUF Q4_K's K records (every linear and the head, K = 256 and
    512) give the hidden states, K/V and logits of the same weights with fp32 d and m, bit for bit, and the logits
    of the per-layer path."""
    cfg = ModelConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=64, rms_norm_eps=1e-5)
    models = []
    for _ in range(2):  # the same norms and embedding in both
        torch.manual_seed(0)
        models.append(quantize_model(Transformer(cfg).requires_grad_(False), "int4"))
    for i, (name, m) in enumerate(list(models[0].named_modules())):
        if isinstance(m, QuantLinear):
            w = k_record_weight(*m.packed_weight.shape, seed=i, scale=1e-3)
            parent, _, child = name.rpartition(".")
            for model, wi in zip(models, (w, w.expanded()), strict=True):
                setattr(model.get_submodule(parent), child, QuantLinear(wi, m.bias))
    assert models[0].lm_head.packed_weight.k_records and not models[1].lm_head.packed_weight.k_records
    batch = random_rows([1, 4, 5, 9, 17], 12)
    (kv_rec, kv_ref), (kv_wide, _) = filled_caches(models[0], 1), filled_caches(models[1], 1)
    got = fused.NativeDecodeStack(models[0], kv_rec).logits(batch)
    want = fused.NativeDecodeStack(models[1], kv_wide).logits(batch)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert torch.equal(kv_rec.k, kv_wide.k) and torch.equal(kv_rec.v, kv_wide.v)
    with torch.inference_mode():
        assert torch.equal(got, models[0].compute_logits(per_layer_hidden(models[0], kv_ref, batch)))


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4"])
def test_the_lm_head_in_the_same_call_gives_the_models_logits(scheme):
    model = make_model("mqa-d32-bias", scheme)
    kv_ref, kv_fused = filled_caches(model, 8)
    batch = random_rows([2, 6, 11], 9)
    with torch.inference_mode():
        want = model.compute_logits(per_layer_hidden(model, kv_ref, batch))
    assert torch.equal(fused.NativeDecodeStack(model, kv_fused).logits(batch), want)


def test_rows_of_one_sequence_attend_causally_as_a_prefill_chunk_does():
    """The general form (speculative verification): rows t..t+3 of one sequence, each attending to the positions
    before it, give what the packed forward gives for a 4-token chunk after the same context."""
    model = make_model("gqa-d64")
    kv_ref, kv_fused = filled_caches(model, 7)
    table, start = list(range(8)), 9  # context 0..8 already cached, 4 new tokens at positions 9..12
    ids = [5, 17, 33, 2]
    pos = list(range(start, start + 4))
    batch = DecodeBatch(ids, pos, [table[p // BLOCK] * BLOCK + p % BLOCK for p in pos], [table] * 4,
                        [p + 1 for p in pos])
    got = fused.NativeDecodeStack(model, kv_fused).hidden(batch)
    from minillm.kv.paged_cache import PrefillChunk

    meta = AttentionMetadata(torch.tensor(batch.slot_mapping), torch.zeros(0, dtype=torch.long),
                             torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                             [PrefillChunk(0, 4, start + 4, torch.tensor(table[: -(-(start + 4) // BLOCK)]))])
    with torch.inference_mode():
        want = model.hidden_states(torch.tensor([ids]), torch.tensor([pos]),
                                   PagedAttention(kv_ref, meta, model.kernel_ops()))[0]
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------------ through the engine
def greedy(model, prompts, max_tokens, **config):
    eng = LLMEngine(model, config=EngineConfig(**{"block_size": BLOCK, **config}))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    return [o.token_ids for o in eng.generate(prompts, params)], eng


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4", "q4_0", "w8a8", "w8a8-static"])
@pytest.mark.parametrize("name", ["gqa-d64", "mqa-d32-bias"])
@pytest.mark.parametrize("batch", [1, 5])
def test_the_engine_decodes_through_the_fused_step_with_the_per_layer_greedy_tokens(name, scheme, batch):
    model = make_model(name, scheme)
    rng = random.Random(batch)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(2, 11))] for _ in range(batch)]
    lengths = [24 - 3 * i for i in range(batch)]  # members finish at different steps
    want, eager = greedy(model, prompts, lengths, enforce_eager=True)
    got, eng = greedy(model, prompts, lengths)
    assert type(eager.runner) is ModelRunner and isinstance(eng.runner, NativeRunner)
    assert eng.runner.stack.calls >= 20  # decode steps ran fused (not the per-layer path twice)
    assert got == want


def test_static_batches_skip_their_padding_rows_and_keep_the_tokens():
    model = make_model("gqa-d64")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    want, _ = greedy(model, prompts, [20, 4, 9], enforce_eager=True, policy="static", max_num_seqs=3)
    got, eng = greedy(model, prompts, [20, 4, 9], policy="static", max_num_seqs=3)
    assert got == want and eng.runner.stack.calls >= 19


@pytest.mark.parametrize("load", [{"quantization": "int4"}, {"dtype": "bfloat16"}], ids=["int4", "bf16"])
def test_the_default_model_gives_the_same_greedy_text_fused_and_per_layer(load):
    from minillm.models.loader import load_model

    model = load_model(None, **load)
    prompt = [[1, 504, 3458, 282, 4649, 314]]
    want, _ = greedy(model, prompt, [24], enforce_eager=True, block_size=16)
    got, eng = greedy(model, prompt, [24], block_size=16)
    assert got == want and eng.runner.stack.calls == 23


# ------------------------------------------------------------------------------------------------ bf16 activations
@pytest.fixture
def native_bf16_rows(monkeypatch):
    """The per-layer path's bf16 linears take the native GEMV up to ``native.native_rows(bfloat16)`` rows (every
    decode batch where the CPU multiplies bf16 pairs, 4 rows elsewhere, then oneDNN's GEMM) and the fused step runs
    only as many.  Pinned to ``MAX_ROWS``, as on AVX512-BF16 CPUs, so 8-row steps compare the same native kernels
    on every CPU (the bf16 kernels' two builds round differently, but each path calls the same one)."""
    monkeypatch.setattr(native, "native_rows", lambda dtype: native.MAX_ROWS)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("lens", [[7], [3, 9, 5], [1, 4, 5, 9, 17, 2, 8, 12]], ids=["b1", "b3", "b8"])
def test_the_bf16_step_equals_the_per_layer_native_bf16_path_bit_for_bit(name, lens, native_bf16_rows):
    """bf16 weights, activations and cache: every intermediate rounded to bf16 where the per-layer kernels round it,
    so hidden states, K/V written and the LM head's logits are identical (qkv bias included: mqa-d32-bias)."""
    model = make_model(name, "bf16")
    kv_ref, kv_fused = filled_caches(model, 1)
    batch = random_rows(lens, 2)
    want = per_layer_hidden(model, kv_ref, batch)
    with torch.inference_mode():
        want_logits = model.compute_logits(want)
    hidden, logits = fused.NativeDecodeStack(model, kv_fused).run_rows(batch, with_head=True)
    assert hidden.dtype == logits.dtype == torch.bfloat16
    assert torch.equal(hidden, want) and torch.equal(logits, want_logits)
    assert torch.equal(kv_fused.k, kv_ref.k) and torch.equal(kv_fused.v, kv_ref.v)
    assert not torch.equal(kv_fused.k, filled_caches(model, 1)[0].k)  # the step did write its rows


def test_bf16_rows_of_one_sequence_equal_the_per_layer_path_bit_for_bit(native_bf16_rows):
    """A speculative chunk (4 consecutive positions of one sequence) as rows of one bf16 call: each row attends up to
    its own position, as the per-layer path's decode rows do after the same K/V writes."""
    model = make_model("gqa-d64", "bf16")
    kv_ref, kv_fused = filled_caches(model, 7)
    table, pos = list(range(8)), [9, 10, 11, 12]
    batch = DecodeBatch([5, 17, 33, 2], pos, [table[p // BLOCK] * BLOCK + p % BLOCK for p in pos], [table] * 4,
                        [p + 1 for p in pos])
    assert torch.equal(fused.NativeDecodeStack(model, kv_fused).hidden(batch), per_layer_hidden(model, kv_ref, batch))
    assert torch.equal(kv_fused.k, kv_ref.k)


def test_bf16_steps_stay_within_the_native_bf16_rows(monkeypatch):
    """Past ``native.native_rows(bfloat16)`` the per-layer path's linears are a GEMM the fused step does not run:
    the stack takes no more rows, and the engine runs larger steps per layer, with the same greedy tokens."""
    monkeypatch.setattr(native, "native_rows", lambda dtype: 2 if dtype == torch.bfloat16 else native.MAX_ROWS)
    model = make_model("gqa-d64", "bf16")
    assert fused.NativeDecodeStack(model, filled_caches(model, 1)[0]).max_rows == 2
    assert fused.NativeDecodeStack(make_model("gqa-d64"), filled_caches(make_model("gqa-d64"), 1)[0]).max_rows \
        == decode.MAX_ROWS
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    want, _ = greedy(model, prompts, [20, 4, 9], enforce_eager=True)
    got, eng = greedy(model, prompts, [20, 4, 9])
    assert got == want and isinstance(eng.runner, NativeRunner)
    # after the prefill's first tokens: 3 steps of 3 rows (tokens 2-4) per layer, then 5 of 2 rows and 11 of 1 fused
    assert eng.runner.stack.calls == 5 + 11


@pytest.mark.parametrize("name", ["gqa-d64", "mqa-d32-bias"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_engine_decodes_bf16_through_the_fused_step_with_the_per_layer_greedy_tokens(name, batch,
                                                                                       native_bf16_rows):
    model = make_model(name, "bf16")
    rng = random.Random(batch)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(2, 11))] for _ in range(batch)]
    lengths = [24 - 3 * i for i in range(batch)]
    want, eager = greedy(model, prompts, lengths, enforce_eager=True)
    got, eng = greedy(model, prompts, lengths)
    assert type(eager.runner) is ModelRunner and isinstance(eng.runner, NativeRunner)
    assert eng.runner.stack.calls >= 20
    assert got == want


def test_a_bf16_model_with_a_quantized_linear_keeps_the_per_layer_path():
    model = make_model("gqa-d64", "bf16")
    kv = PagedKVCache(model.config, 8, BLOCK, dtype=torch.bfloat16, device="cpu")
    assert fused.supports(model, kv)
    quantize_model(model, "int8")
    reason = fused.unsupported_reason(model, kv)
    assert "layer 0's qkv_proj has int8 weights" in reason and "per-layer path" in reason
    assert type(LLMEngine(model, config=EngineConfig(block_size=BLOCK)).runner) is ModelRunner


# ------------------------------------------------------------------------------------------------ what it refuses
def test_it_refuses_what_it_cannot_run_and_the_engine_keeps_the_per_layer_path():
    model = make_model("gqa-d64")
    kv = PagedKVCache(model.config, 8, BLOCK, dtype=torch.float32, device="cpu")
    assert fused.supports(model, kv)
    q8kv = make_paged_kv_cache(model.config, 8, BLOCK, dtype=torch.float32, device="cpu", kv_cache_dtype="int8")
    assert "PagedKVCache" in fused.unsupported_reason(model, q8kv)
    assert "torch" in fused.unsupported_reason(make_model("gqa-d64").set_kernels("torch"), kv)
    assert "fp32 or bf16" in fused.unsupported_reason(make_model("gqa-d64").to(torch.float16), kv)
    assert "model's dtype" in fused.unsupported_reason(make_model("gqa-d64", "bf16"), kv)  # an fp32 cache
    assert "CPU" in fused.unsupported_reason(make_model("gqa-d64").to("meta"), kv)  # CUDA, or any other device
    with pytest.raises(ValueError, match="cannot run"):
        fused.NativeDecodeStack(model, q8kv)
    for config in ({"kv_cache_dtype": "int8"}, {"enforce_eager": True}):
        assert type(LLMEngine(model, config=EngineConfig(**config)).runner) is ModelRunner
    assert type(LLMEngine(make_model("gqa-d64").set_kernels("torch")).runner) is ModelRunner


def test_a_sliding_window_or_a_swapped_layer_is_refused():
    import dataclasses

    model = make_model("gqa-d64")
    kv = PagedKVCache(model.config, 8, BLOCK, dtype=torch.float32, device="cpu")
    model.config = dataclasses.replace(model.config, sliding_window=8)
    assert "sliding" in fused.unsupported_reason(model, kv)
    model = make_model("gqa-d64")
    model.model.layers[1].mlp.down_proj = torch.nn.Identity()
    assert "layer 1" in fused.unsupported_reason(model, kv)


def test_replaced_weights_rebuild_the_table_and_an_unrunnable_change_raises():
    model = make_model("gqa-d64")
    kv_a, kv_b = filled_caches(model, 8)
    runner = fused.NativeDecodeStack(model, kv_a)
    batch = random_rows([6, 11], 9)
    quantize_model(model, "int8")  # swaps every Linear for a QuantLinear after the table was built
    got = runner.hidden(batch)
    assert torch.equal(got, per_layer_hidden(model, kv_b, batch))
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="changed"):
        runner.hidden(batch)


def test_a_swapped_middle_layer_is_seen_and_the_table_rebuilt():
    """Layer 1 of 3 gets a new down_proj after the table was built: the next call runs the new weights."""
    from minillm.layers.linear import Linear

    model = make_model("gqa-d64")
    kv_a, kv_b = filled_caches(model, 8)
    runner = fused.NativeDecodeStack(model, kv_a)
    batch = random_rows([6, 11], 9)
    old = model.model.layers[1].mlp.down_proj
    new = Linear(old.weight.shape[1], old.weight.shape[0]).requires_grad_(False)
    new.weight.copy_(0.2 * torch.randn_like(old.weight))
    model.model.layers[1].mlp.down_proj = new
    got = runner.hidden(batch)
    assert torch.equal(got, per_layer_hidden(model, kv_b, batch))


def test_set_kernels_torch_after_the_engine_is_built_turns_the_fused_step_off():
    model = make_model("gqa-d64")
    eng = LLMEngine(model, config=EngineConfig(block_size=BLOCK))
    model.set_kernels("torch")
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))
    assert eng.runner.stack.calls == 0 and not eng.runner.active


def test_the_library_is_rebuilt_when_an_included_source_changes(tmp_path, monkeypatch):
    for name in ("decode.c", "split.h", *decode._INCLUDED):
        (tmp_path / name).write_text((decode._CSRC / name).read_text())
    monkeypatch.setattr(decode, "_CSRC", tmp_path)
    monkeypatch.setattr(decode, "_SRC", tmp_path / "decode.c")
    before = decode._source_digest()
    (tmp_path / "quant.c").write_text((tmp_path / "quant.c").read_text() + "\n/* a faster GEMV */\n")
    after_c = decode._source_digest()
    (tmp_path / "split.h").write_text((tmp_path / "split.h").read_text() + "\n/* another split */\n")
    assert len({before, after_c, decode._source_digest()}) == 3


# ------------------------------------------------------------------------------------------ speculative verification
@pytest.mark.parametrize("scheme", ["fp32", "int4", "bf16"])
def test_speculative_verification_runs_fused_and_keeps_the_greedy_tokens(scheme, monkeypatch, native_bf16_rows):
    """ngram drafts verified as γ + 1 rows of one sequence in one fused call: output equal to plain decoding."""
    model = make_model("gqa-d64", scheme)
    rng = random.Random(3)
    pattern = [rng.randrange(97) for _ in range(4)]
    prompts = [(pattern * 6)[:19], [rng.randrange(97) for _ in range(9)], (pattern * 5)[:13]]
    want, _ = greedy(model, prompts, [22, 20, 24])
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    seen = []
    run = fused.NativeDecodeStack.run_rows
    monkeypatch.setattr(fused.NativeDecodeStack, "run_rows", lambda self, b, **k: seen.append(b) or run(self, b, **k))
    got, eng = greedy(model, prompts, [22, 20, 24], speculative_config=spec)
    assert got == want and eng.spec_stats.draft_tokens > 0
    # some call verified drafts: consecutive positions of one sequence (same table) as rows of one call
    assert any(b.block_tables[i] == b.block_tables[i + 1] and b.positions[i + 1] == b.positions[i] + 1
               for b in seen for i in range(len(b) - 1))
