"""KV-cache quantization inside the caches (kv/contiguous.py QuantizedKVCache, kv/paged_cache.py
QuantizedPagedKVCache): what they store, what attention reads back, and the engine running on them.

The tiny random Llama (GQA, 3 layers) has nearly flat logits: two candidates are often within 1e-4 of each
other, while int8 K/V move a logit by up to ~4e-3 on it (measured: teacher-forced max |Δ| 3.5e-3, logit std 0.2).
So "greedy tokens equal" is asserted up to the first step whose fp32 top-two margin is below ``NEAR_TIE`` — at a
near-tie either choice is a faithful greedy decode of the quantized model — and never across a clear margin.
"""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import LLM, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.kv import quant as kv_quant
from minillm.kv.contiguous import KVCache, QuantizedKVCache, make_kv_cache
from minillm.kv.paged_cache import PagedKVCache, QuantizedPagedKVCache, kv_bytes_per_block, make_paged_kv_cache
from minillm.models.loader import build_model

V = 320
NEAR_TIE = 0.02  # 5× the largest int8 logit error measured on this model (3.5e-3): below it a flip is a tie
LOGIT_TOL = {"int8": 0.01, "fp8": 0.05}  # max |Δ logit| vs fp32 K/V; fp8 e4m3 keeps 3 mantissa bits (~6 % per elem)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(V) for _ in range(rng.randint(3, 30))] for _ in range(6)]


def run_engine(model, prompts, kv_cache_dtype, max_tokens=8, **kw):
    """Greedy outputs and, per request, the [steps, V] fp32 logits each token was sampled from."""
    options = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8, "return_logits": True, **kw}
    eng = LLMEngine(model, config=EngineConfig(kv_cache_dtype=kv_cache_dtype, **options))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    logits: dict[str, list] = {}
    tokens: dict[str, list] = {}
    for u in eng.stream(prompts, params):
        logits.setdefault(u.request_id, []).append(u.logits)
        tokens.setdefault(u.request_id, []).extend(u.token_ids)
    order = sorted(tokens, key=lambda r: int(r.rsplit("-", 1)[-1]))
    return [tokens[r] for r in order], [torch.stack(logits[r]) for r in order], eng


def contiguous_logits(model, prompt, continuation, kv_cache_dtype):
    """Teacher-forced: prefill ``prompt`` into a contiguous cache, then feed ``continuation`` one token at a time;
    -> [len(continuation), V] logits that predicted each continuation token (the first from the prefill)."""
    ids = prompt + continuation
    cache = make_kv_cache(model.config, 1, len(ids), dtype=torch.float32, device="cpu", kv_cache_dtype=kv_cache_dtype)
    rows = []
    with torch.inference_mode():
        pos = torch.arange(len(prompt))[None]
        cache.begin(pos)
        rows.append(model(torch.tensor([prompt]), pos, cache)[0, -1])
        for t in range(len(prompt), len(ids) - 1):
            pos = torch.tensor([[t]])
            cache.begin(pos)
            rows.append(model(torch.tensor([[ids[t]]]), pos, cache)[0, -1])
    return torch.stack(rows).float()


# ---- storage -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_contiguous_cache_stores_one_byte_codes_and_reads_back_each_row_within_its_step(model, kv_cache_dtype):
    cache = make_kv_cache(model.config, 2, 16, dtype=torch.float32, device="cpu", kv_cache_dtype=kv_cache_dtype)
    assert isinstance(cache, QuantizedKVCache) and cache.k.element_size() == 1
    k = torch.randn(2, 2, 5, 16) * torch.tensor([0.01, 10.0]).view(1, 2, 1, 1)  # heads of very different scale
    v = torch.randn(2, 2, 5, 16)
    cache.begin(torch.arange(5).expand(2, 5))
    k_read, v_read, _ = cache.update(1, k, v)
    for x, got in ((k, k_read), (v, v_read)):
        scale = x.abs().amax(-1, keepdim=True)  # per (token, head) row
        bound = scale / 254 if kv_cache_dtype == "int8" else x.abs() * 2**-4 + scale / 448 * 2**-9
        assert got.dtype == torch.float32 and ((got - x).abs() <= bound + 1e-7).all()
    assert cache.k[0].float().abs().sum() == 0 and cache.k[1].float().abs().sum() > 0, "only the given layer"


def test_the_paged_cache_reads_back_the_rows_it_wrote_through_its_block_tables(model):
    cache = make_paged_kv_cache(model.config, 8, 4, dtype=torch.float32, device="cpu", kv_cache_dtype="int8")
    assert isinstance(cache, QuantizedPagedKVCache)
    k, v = torch.randn(6, 2, 16) * 3, torch.randn(6, 2, 16)
    slots = torch.tensor([20, 21, 22, 23, 8, 9])  # block 5 (all 4 slots), then block 2 (2 slots)
    cache.write(2, k, v, slots, model.kernel_ops())
    blocks, tables = cache.decode_plan(torch.tensor([[5, 2]], dtype=torch.int32))
    kd, vd, tables = cache.decode_kv(2, (blocks, tables))
    read_k = kd[tables[0].long()].flatten(0, 1)[:6]  # (6, H_kv, D) in sequence order
    read_v = vd[tables[0].long()].flatten(0, 1)[:6]
    torch.testing.assert_close(read_k, k, atol=float(k.abs().max()) / 254, rtol=0)
    torch.testing.assert_close(read_v, v, atol=float(v.abs().max()) / 254, rtol=0)


def test_a_quantized_block_budget_holds_about_twice_the_tokens_of_bf16_and_four_times_fp32(model):
    budget = 2**20
    blocks = {d: LLMEngine(model, config=EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=d)).block_manager
              .device.num_blocks for d in ("auto", "int8", "fp8")}
    bf16 = budget // kv_bytes_per_block(model.config, 16, torch.bfloat16)
    # D = 16 here: (16 + 4) bytes per (token, head) row instead of 64 (fp32) or 32 (bf16)
    assert blocks["int8"] == blocks["fp8"] == budget // kv_bytes_per_block(model.config, 16, torch.float32, "int8")
    assert blocks["int8"] >= 3.1 * blocks["auto"] and blocks["int8"] >= 1.55 * bf16
    cfg = ModelConfig(vocab_size=10, hidden_size=576, intermediate_size=8, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)  # SmolLM2-135M's KV shape: D = 64
    int8 = kv_bytes_per_block(cfg, 16, torch.float32, "int8")
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) / int8 > 1.85
    assert kv_bytes_per_block(cfg, 16, torch.float32) / int8 > 3.7
    eng = LLMEngine(model, config=EngineConfig(kv_cache_bytes=budget, kv_cache_dtype="int8"))
    assert eng.kv_cache.nbytes <= budget, "the codes and their scales fit the byte budget"


KV_SHAPE = ModelConfig(vocab_size=10, hidden_size=96, intermediate_size=8, num_layers=3, num_heads=6,
                       num_kv_heads=2, head_dim=16)  # 2 · layers · H_kv = 12 rows of D per token


@pytest.mark.parametrize("dtype, kv_cache_dtype, row_bytes", [
    (torch.float32, "auto", 16 * 4), (torch.bfloat16, "auto", 16 * 2),
    (torch.float32, "int8", 16 + 4), (torch.bfloat16, "int8", 16 + 4), (torch.float32, "fp8", 16 + 4)])
def test_block_bytes_are_an_exact_int_equal_to_what_the_paged_cache_allocates(dtype, kv_cache_dtype, row_bytes):
    if kv_cache_dtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    got = kv_bytes_per_block(KV_SHAPE, 16, dtype, kv_cache_dtype)
    assert type(got) is int and got == 16 * 12 * row_bytes
    cache = make_paged_kv_cache(KV_SHAPE, 4, 16, dtype=dtype, device="cpu", kv_cache_dtype=kv_cache_dtype)
    assert cache.nbytes == 4 * got


def test_a_sub_byte_width_gives_whole_bytes_rounding_a_fractional_block_up():
    assert kv_bytes_per_block(KV_SHAPE, 16, "int4") == 16 * 12 * 16 // 2  # 0.5 bytes a value: whole already
    one_row = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                          num_kv_heads=1, head_dim=2)  # K and V: 4 values per token
    per_token = 4 * 0.5625  # int4 + scales: 2.25 bytes a token
    got = [kv_bytes_per_block(one_row, n, 0.5625) for n in (1, 2, 4)]
    assert got == [3, 5, 9] and all(type(b) is int for b in got)
    assert all(b >= n * per_token for b, n in zip(got, (1, 2, 4), strict=True))


# ---- the engine ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_greedy_tokens_with_quantized_kv_equal_fp32_kv_until_a_near_tie(model, prompts, kv_cache_dtype):
    ref_tokens, ref_logits, _ = run_engine(model, prompts, "auto")
    tokens, logits, eng = run_engine(model, prompts, kv_cache_dtype)
    assert isinstance(eng.kv_cache, QuantizedPagedKVCache)
    identical = 0
    for want, got, ref in zip(ref_tokens, tokens, ref_logits, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        if first is None:
            identical += 1
            continue
        margin = float(ref[first, want[first]] - ref[first, got[first]])
        assert margin < NEAR_TIE, f"quantized KV flipped a clear choice (fp32 margin {margin:.4f}) at step {first}"
    assert identical >= len(prompts) // 2
    # teacher-forced on the fp32 tokens, the logits stay close
    for prompt, want, ref in zip(prompts, ref_tokens, ref_logits, strict=True):
        got = contiguous_logits(model, prompt, want, kv_cache_dtype)
        assert (got - ref).abs().max() <= LOGIT_TOL[kv_cache_dtype]


def test_the_paged_int8_cache_gives_the_contiguous_int8_caches_logits_and_tokens(model, prompts):
    tokens, logits, _ = run_engine(model, prompts, "int8")
    for prompt, toks, lg in zip(prompts, tokens, logits, strict=True):
        contiguous = contiguous_logits(model, prompt, toks, "int8")
        # both quantize the same K/V rows; only the packed vs per-sequence float sums differ (a code may round
        # the other way at a boundary: one step of one element)
        torch.testing.assert_close(lg, contiguous, atol=1e-3, rtol=0)
        chosen = contiguous[torch.arange(len(toks)), toks]  # the contiguous logit of the token the engine picked
        assert (contiguous.max(-1).values - chosen).max() <= 2e-3, "the engine's greedy token is the contiguous one"


def test_chunked_prefill_preemption_by_swap_and_prefix_hits_keep_int8_outputs_unchanged(model, prompts):
    shared = (prompts[0] * 3)[:24]  # a 6-block common prefix: later requests hit the prefix cache
    requests = [shared + p[:8] for p in prompts[1:4]]
    alone = [run_engine(model, [r], "int8", max_num_batched_tokens=512, enable_prefix_caching=False)[0][0]
             for r in requests]
    tokens, _, eng = run_engine(model, requests, "int8", max_num_batched_tokens=8, max_num_seqs=4,
                                num_kv_blocks=14, preemption="swap")
    assert tokens == alone
    assert eng.block_manager.prefix_stats.hit_tokens > 0, "the shared prefix was meant to be served from cache"
    assert eng.stats.swaps_out > 0, "the budget was meant to force swapping (codes and scales both move)"


def test_perplexity_through_an_int8_cache_is_within_a_percent_of_fp32(model):
    from minillm.perf.perplexity import perplexity

    ids = torch.randint(0, V, (200,), generator=torch.Generator().manual_seed(1))
    fp32 = perplexity(model, ids, window=64, stride=32)
    int8 = perplexity(model, ids, window=64, stride=32, kv_cache_dtype="int8")
    assert int8.num_tokens == fp32.num_tokens and int8.ppl != fp32.ppl  # it really ran through the cache
    assert abs(int8.ppl / fp32.ppl - 1) < 0.01


# ---- bad input -----------------------------------------------------------------------------------------------------
def test_an_unknown_kv_cache_dtype_is_a_value_error_listing_the_choices(model):
    choices = r"\('auto', 'int8', 'fp8'\)"
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of {choices}, got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of {choices}"):
        make_kv_cache(model.config, 1, 8, dtype=torch.float32, device="cpu", kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of {choices}"):
        LLM(kv_cache_dtype="e4m3")  # refused before the model loads


def test_fp8_where_torch_cannot_convert_is_a_value_error_naming_int8(model, monkeypatch):
    monkeypatch.setattr(kv_quant, "_fp8_runs_on", lambda device: False)
    with pytest.raises(ValueError, match="use kv_cache_dtype='int8'"):
        make_paged_kv_cache(model.config, 4, 4, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="use kv_cache_dtype='int8'"):
        LLMEngine(model, config=EngineConfig(kv_cache_dtype="fp8"))


def test_auto_keeps_the_float_caches(model):
    assert type(make_kv_cache(model.config, 1, 8, dtype=torch.float32, device="cpu")) is KVCache
    assert type(make_paged_kv_cache(model.config, 4, 4, dtype=torch.float32, device="cpu")) is PagedKVCache
