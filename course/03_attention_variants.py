# %% [markdown]
# # 03 — Attention variants: MHA, GQA, MQA (and friends)
#
# Notebook 02 ended on the cache's size: **bytes per token = 2 × layers × H_kv × head_dim × bytes per element**,
# and a decode step reads all of it. The one factor a model designer can cut without touching the depth or
# the width is **H_kv**, the number of key/value heads:
#
# - **Multi-head attention (MHA)**: every query head has its own K/V head, H_kv = H_q (Llama-2-7B: 32 and 32).
# - **Multi-query attention (MQA)** (Shazeer, 2019): all query heads share one K/V head, H_kv = 1.
# - **Grouped-query attention (GQA)** (Ainslie et al., 2023): groups of G = H_q / H_kv query heads share a K/V
#   head (Llama-2-70B: 64 query heads, 8 K/V heads; SmolLM2-135M: 9 and 3).
#
# The cache shrinks by H_q / H_kv, so more sequences fit and each decode step reads fewer bytes. The price is
# quality: fewer K/V heads can represent less. Other designs cut other factors of the product: latent K/V
# (MLA), K/V shared across layers, sliding windows.
#
# **In this notebook** you compute the cache for any H_kv (exercise 3.1), write attention that shares K/V heads
# without copying them (3.2), then turn SmolLM2 into an MHA model (H_kv = 9, identical outputs) and, with your own
# conversion of a checkpoint by mean-pooling K/V heads (3.3), into an MQA model (H_kv = 1), predict (3.0) and
# measure their cache memory and decode speed, measure what pooling costs in perplexity, size the other variants
# with calculators, see on the roofline why batching does not help attention, and finally bound a long sequence's
# cache with a sliding window and attention sinks — your eviction rule (3.4) in the engine, measured against
# perplexity. Runs in about three minutes on a 2-core CPU; on a GPU it uses the GPU.

# %%
from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import statistics
from functools import partial
from pydoc_data.topics import topics  # CPython's help texts: ~465 KB of English that ships with Python

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm import LLM, SamplingParams, kernels
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.course.predictions import predict_mqa_speedup
from minillm.engine.simple import generate
from minillm.kernels.reference import check_qkv  # grouped_attention's shape check (the exercise's first line)
from minillm.kv.contiguous import KVCache
from minillm.kv.eviction import KVEvictionPolicy  # exercise 3.4's base class
from minillm.models.attention_variants import kv_bytes_cross_layer, kv_bytes_mla, kv_bytes_sequence, pool_kv_heads
from minillm.perf import metrics, roofline
from minillm.perf.long_context import POLICIES as LC_POLICIES
from minillm.perf.long_context import format_table as format_long_context
from minillm.perf.long_context import kept_tokens, long_context_eval
from minillm.perf.metrics import decode_weight_bytes
from minillm.perf.perplexity import heldout_token_ids

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})  # readable figures: ≥ 110 dpi

device = "cuda" if torch.cuda.is_available() else "cpu"
llm = LLM(device=device)  # SmolLM2-135M-Instruct, offline, in the dtype minillm picks for this machine
model, config = llm.model, llm.model.config
dtype = roofline.dtype_name(model.dtype)
print(f"{config.num_layers} layers, H_q = {config.num_heads} query heads, H_kv = {config.num_kv_heads} K/V heads "
      f"(groups of G = {config.num_heads // config.num_kv_heads}), head_dim {config.head_dim}; {dtype} on {device}")

# %% [markdown]
# ## 1. Predict: the cache for any number of K/V heads
#
# ### Exercise 3.1 — KV bytes per token for a given H_kv
#
# Write `kv_bytes_gqa(config, num_kv_heads, bytes_per_elem)`: the bytes of K and V one token adds to the cache,
# over all layers, if the model had `num_kv_heads` K/V heads stored at `bytes_per_elem` bytes per element (a
# float, so that 4-bit formats, 0.5 bytes, work too). It is exercise 2.1 with two factors made explicit.

# %%
# exercise 3.1: minillm.models.attention_variants.kv_bytes_gqa

# %%
# NBVAL_CHECK_OUTPUT
checks.check_kv_bytes_gqa(kv_bytes_gqa)

# %% [markdown]
# What fewer K/V heads buy on a real GPU: an 80 GB H100 holding Llama-2-7B's fp16 weights (13.5 GB) has ~66 GB
# left for the cache. How many 4096-token sequences fit, for MHA, GQA with 8 K/V heads, and MQA?

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
llama = checks.LLAMA2_7B
free = roofline.get_spec("H100-SXM").memory_capacity - llama.num_parameters() * 2
print(f"Llama-2-7B shape, fp16, {free / 1e9:.1f} GB free on an H100 80 GB:")
for name, h in [("MHA", 32), ("GQA", 8), ("MQA", 1)]:
    per_token = kv_bytes_gqa(llama, h, 2)
    print(f"  {name} H_kv = {h:2d}: {per_token / 1024:4.0f} KiB/token, {4096 * per_token / 2**30:6.3f} GiB per "
          f"4096-token sequence -> {int(free // (4096 * per_token)):5d} sequences fit")

# %% [markdown]
# The same arithmetic predicts decode speed. A decode step of B sequences with S cached tokens each reads every
# weight once plus the whole cache, **bytes = weight bytes + B × S × bytes per token**, so on a memory-bound
# machine tokens/s ≤ B × bandwidth ÷ bytes. For SmolLM2 the cache is small next to its weights at short
# contexts; at B × S in the thousands it is not. We measure this machine's bandwidth first.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
print(roofline.format_measurement(spec))
# On a GPU this small model at small batch is bound by kernel launches, so a big batch makes the cache visible.
B, S = (16, 4096) if device == "cuda" else ((1, 2048) if FAST else (2, 4096))  # GPU: 3 caches ≈ 6.5 GB in bf16
elt = model.dtype.itemsize
print(f"\nprediction for B = {B} sequences of S = {S} cached tokens, {dtype}:")
for h in (9, 3, 1):
    cfg = dataclasses.replace(config, num_kv_heads=h)  # q/k/v projection sizes change with H_kv too
    step = decode_weight_bytes(cfg, model.dtype) + B * S * kv_bytes_gqa(config, h, elt)
    print(f"  H_kv = {h}: {step / 1e6:7.1f} MB per step ({B * S * kv_bytes_gqa(config, h, elt) / step:4.0%} of it "
          f"cache) -> at most {B * spec.memory_bandwidth / step:7.1f} tokens/s")

# %% [markdown]
# ## 2. Build: attention that shares K/V heads without copying them
#
# Query head h reads K/V head h // G: consecutive query heads form a group (the convention of transformers'
# `repeat_kv`). The easy implementation copies each K/V head G times (`repeat_interleave`) and runs ordinary
# attention — which writes and then reads G copies of the cache, exactly the bytes GQA was meant to save.
# Instead, *view* the queries so that each group becomes extra rows: q `[B, H_q, L, D]` is `[B, H_kv, G·L, D]`
# in the same memory, and `q_grouped @ kᵀ` multiplies every row of a group by the same K/V head.
#
# ### Exercise 3.2 — grouped attention by broadcasting
#
# Write the body of `grouped_attention(q, k, v, mask, causal=, scale=)`: q `[B, H_q, L, D]`, k, v
# `[B, H_kv, S, D]` → `[B, H_q, L, D]`. Compute the scores in fp32, view them as `[B, H_kv, G, L, S]` to apply
# the masks (`causal`: the L queries are the *last* L of the S positions, so query i sees keys j ≤ S − L + i;
# `mask` `[B, 1, L, S]`, True = may attend, gets a group axis as `mask[:, :, None]`), softmax, cast to v's
# dtype, multiply by v, view back. The check also watches every tensor your function allocates: nothing may be
# as large as K repeated for all query heads. (Beware: `torch.matmul` broadcasting over an extra group axis
# materialises that copy.)

# %%
# exercise 3.2: minillm.kernels.reference.grouped_attention

# %%
# NBVAL_CHECK_OUTPUT
checks.check_grouped_attention(grouped_attention)


# %% [markdown]
# ### Plug it in
#
# The model's layers call `cache.attention(layer, q, k, v, scale)` on whatever cache object they are given
# (notebook 02). This one is the library's `KVCache` with the attention function passed in explicitly, so the
# whole model below runs on *your* `grouped_attention`.

# %% tags=["slide"]
class CacheWithAttention(KVCache):
    """The library's contiguous KV cache, attending with the function ``attention`` (same signature as
    ``grouped_attention``) instead of the library's kernels."""

    def __init__(self, *args, attention, **kwargs):
        super().__init__(*args, **kwargs)
        self.attention_fn = attention

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        k_all, v_all, mask = self.update(layer, k, v)  # store the new K/V, get everything cached so far
        return self.attention_fn(q, k_all, v_all, mask, scale=scale)


@torch.inference_mode()
def forward_logits(m, ids: list[int], attention) -> Tensor:
    """Logits [L, V] (fp32) of one sequence through model ``m`` with ``attention`` in every layer."""
    x = torch.tensor([ids], device=m.device)  # (1, L)
    positions = torch.arange(len(ids), device=m.device)[None]  # (1, L)
    cache = CacheWithAttention(m.config, 1, len(ids), dtype=m.dtype, device=m.device, attention=attention)
    cache.begin(positions)
    return m(x, positions, cache)[0].float()


# %% [markdown]
# ## 3. Build: convert a checkpoint by mean-pooling K/V heads
#
# The GQA paper turns a trained multi-head checkpoint into a grouped one without training from scratch: each
# group of r = H_kv / H_kv' consecutive K/V heads is replaced by their **mean** (its key and value projections
# averaged, weight and bias), and the model is then "uptrained" for ~5 % of its pre-training compute to recover.
# Consecutive, because query head h reads K/V head h // G: a group of query heads then reads the mean of exactly
# the heads it read before.
#
# In minillm each layer stores q, k and v as one fused projection `qkv_proj`: weight rows
# `[q: H_q·D | k: H_kv·D | v: H_kv·D]` (D rows per head, heads in order), and a bias with the same rows where the
# model has one.
#
# ### Exercise 3.3 — mean-pool K/V heads
#
# Write `pool_kv_weight(weight, num_heads, num_kv_heads, new_kv_heads, head_dim)` for one fused weight (2-D) or
# bias (1-D): the q rows unchanged, the k and v rows pooled to `new_kv_heads` heads, in the weight's dtype (average
# in fp32). `pool_kv_heads(model, h, pool=...)` does the rest of the conversion (a new config, every layer's
# projection through `pool`, the tied embeddings) and calls **your** function for every layer.

# %%
# exercise 3.3: minillm.models.attention_variants.pool_kv_weight

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - `weight.split([H_q·D, H_kv·D, H_kv·D])` gives the three blocks (along dim 0, whatever the trailing dims).
# - A block of H_kv·D rows viewed as `[new, r, D, *rest]` (`*weight.shape[1:]` is `hidden` or nothing) puts
#   the r heads of each group on one axis: `.float().mean(1)`, then view it back to `[new·D, *rest]`.
# - Validate first: `new_kv_heads` must divide H_kv (H_kv = 4 → 3 heads is not a grouping), and the weight must
#   have (H_q + 2·H_kv)·D rows.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_pool_kv_weight(pool_kv_weight)

# %% [markdown]
# Now three models from one checkpoint. **MHA** (H_kv = 9): copy each of SmolLM2's 3 K/V heads to the 3 query
# heads of its group — the same function, so the same logits, with a 3× larger cache. Pooling that MHA model back
# to 3 heads with your function must give the checkpoint's weights again (to the last bit's rounding): the mean of
# three copies of a head is that head. **MQA** (H_kv = 1): your function averages the 3 K/V heads into one — the
# starting point of the
# conversion (the paper then uptrains; we do not, and section 5 measures what that costs).

# %%
@torch.inference_mode()
def repeat_kv_heads(m, times: int):
    """A copy of ``m`` whose every K/V head is duplicated ``times`` times (H_kv × times heads): MHA from GQA.

    Query head h read K/V head h // G; it now reads a copy of that head, so the outputs do not change."""
    c = m.config
    assert not c.qkv_bias, "this sketch copies the projection weights only"
    out = copy.deepcopy(m)
    out.config = dataclasses.replace(c, num_kv_heads=c.num_kv_heads * times)
    for layer in out.model.layers:
        w = layer.self_attn.qkv_proj.weight  # ((H_q + 2 H_kv) D, hidden): rows [q | k | v]
        q_w, k_w, v_w = w.split([c.q_size, c.kv_size, c.kv_size])

        def rep(x):
            return x.view(c.num_kv_heads, c.head_dim, -1).repeat_interleave(times, 0).flatten(0, 1)

        layer.self_attn.qkv_proj.weight = nn.Parameter(torch.cat([q_w, rep(k_w), rep(v_w)]), requires_grad=False)
        layer.self_attn.config = out.config
    return out


models = {9: repeat_kv_heads(model, 3), 3: model}
try:
    models[1] = pool_kv_heads(model, 1, pool=pool_kv_weight)  # MQA: your pool_kv_weight, in every layer
except NotImplementedError:
    models[1] = pool_kv_heads(model, 1)  # the library's, only so that the sections below run until you write 3.3
    raise

# %%
for mha, original in zip(models[9].model.layers, model.model.layers, strict=True):  # MHA copies pooled back to 3
    pooled = pool_kv_weight(mha.self_attn.qkv_proj.weight, config.num_heads, 9, 3, config.head_dim)
    # (x + x + x) / 3 in fp32 can differ from x in the last bit: equal within rounding, not bit for bit
    torch.testing.assert_close(pooled, original.self_attn.qkv_proj.weight, msg=lambda m: (
        f"pooling the MHA copies back to 3 heads must return the checkpoint's weights: {m}"))
print("✓ pooling the H_kv = 9 copy back to 3 heads with your pool_kv_weight returns the checkpoint's weights")

# %%
prompt = llm.encode("Grouped-query attention lets several query heads share one key/value head, so")
with torch.inference_mode():  # the library's own forward (its kernels, no cache) as the reference
    library = model(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)[None])[0].float()
logits = {h: forward_logits(m, prompt, grouped_attention) for h, m in models.items()}
# fp32: 30 layers of summation-order differences (as notebook 02); bf16 (GPU): rounding of 3 significant digits
tol = {"rtol": 1.3e-5, "atol": 1e-4} if model.dtype == torch.float32 else {"rtol": 0.1, "atol": 1.0}
torch.testing.assert_close(logits[3], library, **tol, msg=lambda m: f"your attention vs the library's: {m}")
torch.testing.assert_close(logits[9], logits[3], **tol, msg=lambda m: f"MHA copies vs GQA: {m}")
print("✓ the model on your grouped_attention matches the library's forward; the H_kv = 9 copy gives the same logits")
for h, m in models.items():
    print(f"H_kv = {h}: {m.config.num_kv_heads} K/V heads, {kv_bytes_gqa(config, h, elt) / 1024:5.1f} KiB/token, "
          f"greedy next token after the prompt: {llm.tokenizer.decode([int(logits[h][-1].argmax())])!r}")

# %% [markdown]
# ## 4. Measure: cache memory and decode speed for H_kv = 9, 3, 1
#
# ### Predict, then measure
#
# For each model: predict the cache of B sequences of S + 1 tokens from `kv_bytes_gqa`, allocate it and measure
# the memory the process gained (5 % tolerance); then predict decode tokens/s from bytes ÷ bandwidth and time one
# decode step with S tokens cached (the bound may not be beaten by more than 25 %; below it, each line says what
# the fraction reached means). The cache is filled with zeros: a step's cost depends on how much it reads, not on
# the values.

# %% [markdown]
# Your prediction first. The bandwidth bounds say how much faster the multi-query model's decode step should be
# than the multi-head one's (the cell prints their ratio); how much faster will it really be here?

# %%
# exercise 3.0: minillm.course.predictions.predict_mqa_speedup

# %%
from minillm.models import attention_variants as library_variants  # noqa: E402


def bound_tok_s(h: int) -> float:
    """The bandwidth bound on decode tokens/s with ``h`` K/V heads: B tokens per (weights + B·S cached K/V) read."""
    m = models[h]
    kv = library_variants.kv_bytes_gqa(config, h, elt)  # the library's count: your 3.1 may be unfinished
    return B * spec.memory_bandwidth / (decode_weight_bytes(m.config, m.dtype) + B * S * kv)


h_mha, h_mqa = max(models), min(models)
bound_ratio = bound_tok_s(h_mqa) / bound_tok_s(h_mha)
print(f"bounds: H_kv = {h_mha}: {bound_tok_s(h_mha):.1f} tok/s, H_kv = {h_mqa}: {bound_tok_s(h_mqa):.1f} tok/s "
      f"-> {bound_ratio:.2f}×")
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_mqa(predict_mqa_speedup, bound_ratio)

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
def decode_step(m, cache):
    """A function running one decode step of model ``m`` for every sequence in ``cache`` (each at position S)."""
    n = cache.k.shape[1]
    ids = torch.zeros(n, 1, dtype=torch.long, device=device)
    pos = torch.full((n, 1), cache.max_len - 1, device=device)

    @torch.inference_mode()
    def step():
        cache.begin(pos)
        m.compute_logits(m.hidden_states(ids, pos, cache)[:, -1])

    return step


caches, results = {}, {}
for h, m in models.items():
    predicted_bytes = B * (S + 1) * kv_bytes_gqa(config, h, elt)
    caches[h], measured_bytes = metrics.memory_growth(
        lambda m=m: KVCache(m.config, B, S + 1, dtype=m.dtype, device=device), device)
    print(f"H_kv = {h}: cache predicted {predicted_bytes / 2**20:7.1f} MiB, measured {measured_bytes / 2**20:7.1f} MiB")
    checks.check_prediction_bytes(predicted_bytes, measured_bytes, what=f"H_kv = {h} cache")
    results[h] = {"cache_mb": measured_bytes / 2**20}

# The three models take turns, one step each per round: a busy neighbour slows them all alike.
steps = {h: decode_step(models[h], caches[h]) for h in caches}
step_seconds = {h: [] for h in steps}
for _ in range(1 + (3 if FAST else 7)):  # the first round is a warm-up
    for h, step in steps.items():
        step_seconds[h] += metrics.measure_seconds(step, repeat=1, warmup=0, device=device)
for h, m in models.items():
    step_bytes = decode_weight_bytes(m.config, m.dtype) + B * S * kv_bytes_gqa(config, h, elt)
    predicted_tok_s = B * spec.memory_bandwidth / step_bytes
    measured_tok_s = B / statistics.median(step_seconds[h][1:])
    results[h].update(predicted_tok_s=predicted_tok_s, tok_s=measured_tok_s)
    print(f"H_kv = {h}: decode predicted ≤ {predicted_tok_s:6.1f} tok/s, measured {measured_tok_s:6.1f} tok/s")
    checks.check_roofline_prediction(predicted_tok_s, measured_tok_s, device=device)
del caches, steps
verdict = checks.judge_prediction(my_prediction, results[h_mqa]["tok_s"] / results[h_mha]["tok_s"], unit="×",
                                  bound=bound_ratio, bound_name="the ratio of the bounds", upper=1.5, bandwidth=False,
                                  what=f"decode speedup of H_kv = {h_mqa} over H_kv = {h_mha}",
                                  see="the weights' fixed costs, and attention turning compute bound on a CPU "
                                      "(the next paragraph)")
speedup = results[h_mqa]["tok_s"] / results[h_mha]["tok_s"]
conclude(f"decode tok/s, H_kv = {h_mqa} ÷ H_kv = {h_mha}", speedup, 1, expect=">", unit="×",
         held="fewer K/V heads make decode steps faster: fewer cache bytes per step",
         missed="fewer K/V heads did not make decode faster in this run: the weights dominate the bytes at this "
                "context, or attention turned compute bound (next paragraph)")
conclude("that speedup ÷ the ratio of the bounds", speedup / bound_ratio, 1, expect="<", unit="×",
         held="the measured speedup is smaller than the bounds' ratio: the step is not purely bandwidth bound",
         missed="the measured speedup reaches the bounds' ratio: this machine streams both models at the roof")

# %%
# NBVAL_IGNORE_OUTPUT
heads = list(results)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.bar([str(h) for h in heads], [results[h]["cache_mb"] for h in heads], color="tab:blue")
ax1.set(xlabel="K/V heads (H_kv)", ylabel="MiB", title=f"KV cache, {B} × {S} tokens")
x = range(len(heads))
ax2.bar([i - 0.2 for i in x], [results[h]["predicted_tok_s"] for h in heads], 0.4, color="lightgrey",
        label="roofline bound")
ax2.bar([i + 0.2 for i in x], [results[h]["tok_s"] for h in heads], 0.4, color="tab:red", label="measured")
ax2.set(xticks=list(x), xticklabels=[str(h) for h in heads], xlabel="K/V heads (H_kv)", ylabel="tokens/s",
        title=f"Decode, batch {B}, {S} cached tokens")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Fewer K/V heads: a smaller cache, exactly as predicted; the ▸ lines above say how decode speed followed here.
# The measured speedup falls short of the bounds' ratio wherever a step is not purely bandwidth bound: the weights'
# GEMVs have fixed costs, and on a
# CPU — whose ridge is a few FLOP/byte — attention with G = 9 query heads per K/V head does 2·9 FLOPs per K/V
# element, 4.5 FLOP/byte in fp32: MQA's attention becomes compute bound there (section 7 shows it). On a GPU,
# with its ridge near 300 FLOP/byte, every variant stays bandwidth bound.

# %% [markdown]
# ## 5. The price: what pooling K/V heads costs in quality
#
# MHA → GQA by copying is free and exact; GQA → MQA by averaging is not: the three K/V heads of a group learned
# different things, and their mean is none of them. Perplexity (exp of the mean negative log-likelihood of each
# next token) on held-out English — CPython's help texts, cut into independent 512-token windows — measures the
# damage. Both models run on your `grouped_attention`.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
text = "\n\n".join(topics[k] for k in sorted(topics))
n_tokens = 1024 if FAST else 4096
eval_ids = llm.encode(text[:40_000])[:n_tokens]


def perplexity(m, ids: list[int], window: int = 512) -> float:
    """exp(mean NLL of each next token) over ``ids`` cut into independent windows, on your grouped_attention."""
    nll, count = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        logits = forward_logits(m, chunk, grouped_attention)  # (L, V) fp32
        target = torch.tensor(chunk[1:], device=device)
        nll += F.cross_entropy(logits[:-1], target, reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


ppl = {h: perplexity(models[h], eval_ids) for h in (3, 1)}
ppl[9] = ppl[3]  # identical logits (checked above): the same perplexity, no need to spend the time
for h in (9, 3, 1):
    note = {9: "MHA by copying heads (exact)", 3: "the checkpoint (GQA)", 1: "MQA by mean-pooling, no uptraining"}[h]
    print(f"H_kv = {h}: perplexity {ppl[h]:10.2f}   {note}")

params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
for h in (3, 1):
    out = generate(models[h], [prompt], params)[0].output
    print(f"H_kv = {h} continues the prompt with: {llm.tokenizer.decode(out)!r}")

# %% [markdown]
# Mean-pooled without any further training, the single K/V head breaks the model: that is why the GQA paper
# *uptrains* (continues pre-training the pooled checkpoint for ~5 % of the original compute), and why production
# models are trained with their final H_kv from the start. GQA with a few K/V heads keeps almost all of MHA's
# quality (the paper's result, on T5-XXL); MQA loses more and trains less stably.

# %% [markdown]
# ## 6. Friends: other ways to shrink the cache
#
# Every variant cuts one factor of layers × (K/V values per token per layer) × tokens kept × bytes:
#
# - **Multi-head latent attention (MLA)**, DeepSeek-V2: cache one compressed latent c_KV of 512 values plus a
#   64-dim shared RoPE key per token and layer, and reconstruct every head's K and V from it with learned
#   up-projections (which fold into the query and output projections). DeepSeek-V2's MHA equivalent caches
#   K and V for 128 heads of 128 dims: 16 384 values each.
# - **Cross-layer KV sharing**: consecutive layers reuse one layer's K/V (sharing across 3 layers: ~3× smaller).
# - **Sliding-window attention** (Mistral-7B: window 4096): each layer attends to the last W tokens only, so the
#   cache keeps W tokens whatever the length (window 1000 over 10 000 tokens: 10× smaller);
#   **interleaving** local and global layers (e.g. 5 local : 1 global) keeps some layers' full view.
# - Orthogonal to all of these: fewer bytes per element (notebook 07: int8/fp8 KV) and paging without waste (05).

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
mha_values = 2 * 128 * 128  # DeepSeek-V2: K and V, 128 heads × 128 dims, per token and layer
mla_values = kv_bytes_mla(1, 512, 64, bytes_per_elem=1)  # elements per token and layer
print(f"DeepSeek-V2 per token and layer: MHA {mha_values} values (K: 16384, V: 16384), MLA {mla_values:.0f} "
      f"(512 latent + 64 RoPE) -> {mha_values / mla_values:.1f}x smaller")
T = 10_000  # tokens in the sequence
with_heads = {h: dataclasses.replace(llama, num_kv_heads=h) for h in (32, 8, 1)}
variants = {  # bytes of K/V for one 10 000-token sequence, Llama-2-7B's shape in fp16
    "MHA (32 K/V heads)": kv_bytes_sequence(with_heads[32], T, bytes_per_elem=2),
    "GQA (8 K/V heads)": kv_bytes_sequence(with_heads[8], T, bytes_per_elem=2),
    "MQA (1 K/V head)": kv_bytes_sequence(with_heads[1], T, bytes_per_elem=2),
    "MLA (512 + 64)": T * kv_bytes_mla(llama.num_layers, 512, 64, 2),
    "cross-layer, 3 share": T * kv_bytes_cross_layer(llama, 3, 2),
    "sliding window 1000": kv_bytes_sequence(llama, T, window=1000, bytes_per_elem=2),
    "5 local : 1 global": kv_bytes_sequence(llama, T, window=1000, local_layers=llama.num_layers * 5 // 6,
                                            bytes_per_elem=2),
}
base = variants["MHA (32 K/V heads)"]
print(f"\none {T}-token sequence, Llama-2-7B shape ({llama.num_layers} layers, 32 heads × 128), fp16:")
for name, nbytes in variants.items():
    print(f"  {name:22} {nbytes / 2**30:6.3f} GiB  {base / nbytes:5.1f}x smaller than MHA")

# %% [markdown]
# (Cross-layer sharing gives 2.9×, not 3×: 32 layers make 11 groups of up to 3. The local/global mix has 26 windowed
# and 6 global layers.)

# %%
# NBVAL_IGNORE_OUTPUT
names = list(variants)[::-1]
bars = plt.barh(names, [variants[n] / 2**30 for n in names], color="tab:blue")
plt.bar_label(bars, [f"{base / variants[n]:.1f}×" for n in names], padding=3)
plt.gca().set(xlabel="GiB of K/V for one 10 000-token sequence", xlim=(0, base / 2**30 * 1.15),
              title="KV-cache size by attention variant (Llama-2-7B shape, fp16)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 7. On the roofline: batching does not help attention
#
# A decode step's linear layers read each weight once for the whole batch: B tokens × 2 FLOPs per weight, so
# their intensity grows with B (notebook 01). Attention is different: every sequence has **its own** cache, so
# each byte of K/V read serves only that sequence's G query heads — 2 FLOPs per K/V element per query head, i.e.
# intensity ≈ 2·G ÷ bytes per element **whatever B**. MHA in 16-bit: ≈ 1 FLOP/byte. GQA raises it G-fold;
# batching does not move it. `roofline.attention_cost` and `roofline.linear_cost` give the exact figures:

# %%
# NBVAL_IGNORE_OUTPUT
batches = [1, 2, 4, 8, 16, 32, 64, 128]
for h, style in ((9, "o-"), (3, "s-"), (1, "^-")):
    plt.plot(batches, [roofline.attention_cost(b, 1, 4096, config.num_heads, h, config.head_dim, "bfloat16").intensity
                       for b in batches], style, label=f"decode attention, H_kv = {h} (G = {config.num_heads // h})")
plt.plot(batches, [roofline.linear_cost(b, config.hidden_size, 2 * config.intermediate_size, "bfloat16").intensity
                   for b in batches], "k--", label="MLP gate/up projection")
plt.gca().set(xscale="log", yscale="log", xlabel="batch size B", ylabel="FLOP / byte (bf16)",
              title="Decode intensity: the linear layers grow with B, attention does not")
plt.legend(fontsize="small")
plt.show()

# %% [markdown]
# Now measure decode attention alone — the engine's kernel (`minillm.kernels.decode_attention`: Triton on a GPU,
# the PyTorch reference elsewhere) — at batch 1 and 8 for each H_kv, and place the points on this machine's
# roofline. Moving right takes fewer K/V heads, not a bigger batch.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
S_att = 32768 if device == "cuda" else (1024 if FAST else 4096)
points = []
for h in (9, 3, 1):
    for b in (1, 8):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, config.num_heads, config.head_dim, generator=g, device=device, dtype=model.dtype)
        k, v = (torch.randn(b, h, S_att, config.head_dim, generator=g, device=device, dtype=model.dtype)
                for _ in range(2))
        lens = torch.full((b,), S_att, dtype=torch.int32, device=device)
        seconds = statistics.median(metrics.measure_seconds(partial(kernels.decode_attention, q, k, v, lens),
                                                            repeat=5, device=device))
        cost = roofline.attention_cost(b, 1, S_att, config.num_heads, h, config.head_dim, dtype)
        label = f"H_kv={h} (B=1 and 8)" if b == 8 else ""  # same intensity at both batches: one label
        points.append(roofline.RooflinePoint.from_cost(label, cost, seconds))
        print(f"H_kv = {h}, B = {b}: {seconds * 1e3:7.2f} ms, intensity {cost.intensity:5.2f} FLOP/B, "
              f"{cost.bytes / seconds / 1e9:6.1f} GB/s of K/V")
roofline.plot_roofline(spec, points, dtype=dtype)
plt.show()

# %% [markdown]
# ## 8. Long context in bounded memory: sliding windows, attention sinks and heavy hitters
#
# Every variant above shrinks the bytes per token; the cache still grows with the sequence. A long document or a
# long chat fills it whatever H_kv is. The other lever is **which tokens to keep**:
#
# - A **sliding window** of W tokens (Mistral): the query at position q attends to keys (q − W, q] only, so a
#   sequence never holds more than W tokens of K/V — the paged engine frees a block as soon as no later query can
#   read it, and a decode step reads W tokens of K/V at any position.
# - A model *trained* with full attention does not take a window well. StreamingLLM (Xiao et al., 2023) found why:
#   softmax must put its attention mass somewhere, and trained models dump it on the **first few tokens**, whatever
#   they say ("attention sinks"). Evict those and the distribution of every later query shifts; perplexity jumps.
#   Keeping the first k = 4 tokens beside the window restores most of the full cache's quality at constant memory.
# - **H2O** (Zhang et al., 2023, "Heavy-Hitter Oracle") keeps, beside the sinks and the window, a budget of
#   `heavy_tokens` more: the cached tokens that have received the most attention mass so far (summed over layers,
#   heads and every query that read them), since a few tokens take most of the attention all along. minillm decides
#   per block, for all layers at once (the paged cache frees whole blocks), and ranks blocks by their summed mass.
#
# minillm's engine runs both: `EngineConfig(kv_eviction="sink", sink_tokens=k, window_tokens=W)`, with k = 0 for
# the plain window. Keys keep the rotary position they were written at (no re-rotation), so attention with eviction
# is exactly full attention under a mask; the sequence length stays capped at the model's trained context.
#
# ### Exercise 3.4 — the eviction rule
#
# After each step writes its K/V, the block manager asks the policy which **logical blocks** of a sequence it may
# free: `freeable_blocks(num_computed, block_size)` on a `KVEvictionPolicy(window_tokens, sink_tokens)`. Block i
# holds positions [i·block_size, (i + 1)·block_size). Every later query sits at a position ≥ `num_computed`, so a
# key at position j is still needed if it is a sink (j < `sink_tokens`) or inside the window of the next query
# (j > `num_computed` − `window_tokens`). Free exactly the blocks with no such key, as a `range` (blocks holding a
# sink never go; the run of freeable blocks starts right after them). Mind the off-by-one: freeing one block too
# many silently removes a key the model should still see.

# %%
# exercise 3.4: minillm.kv.eviction.KVEvictionPolicy.freeable_blocks

# %%
# NBVAL_CHECK_OUTPUT
checks.check_freeable_blocks(MyKVEvictionPolicy)

# %% [markdown]
# ### Measure: perplexity against KV bytes, per policy
#
# The engine now runs on **your** rule: one long prompt of held-out text (the evaluation half of CPython's help
# texts), prefilled in chunks well below the window so blocks are freed while the text is read, with every prompt
# token scored from the K/V the engine really holds (`SamplingParams(prompt_logprobs=0)`), then a short decode.
# Four policies on the same tokens: the full cache, the window alone, 4 sinks + the window, and H2O (sinks + window
# + as many heavy-hitter tokens as the window). H2O's score needs the softmax weights every layer computes, which
# the fused decode kernels do not return, so its steps run the reference attention: its decode rate below prices
# that path, not the policy's bookkeeping.

# %%
# ~8k tokens: the full cache's reads then rival the weights'
lc_tokens, lc_window = (768, 128) if FAST else (8192, 1024)
lc_sinks = 4
lc_heavy = lc_window  # H2O's heavy-hitter budget, in tokens
lc_rule = None  # the library's rule, only so that the cells below run until you write 3.4
MyKVEvictionPolicy(lc_window, lc_sinks).freeable_blocks(lc_window, 16)  # your rule (or its stub's error)
lc_rule = MyKVEvictionPolicy  # the engine's block manager frees blocks with your freeable_blocks

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
lc_ids = heldout_token_ids(llm.tokenizer, "evaluation", min(lc_tokens, config.max_position_embeddings - 16))
lc_rows = {r.policy: r for r in long_context_eval(model, lc_ids, window_tokens=lc_window, sink_tokens=lc_sinks,
                                                   policies=LC_POLICIES, heavy_tokens=lc_heavy, decode_tokens=8,
                                                   policy_class=lc_rule)}
print(f"{lc_ids.numel()} held-out tokens, window {lc_window}, {lc_sinks} sinks, {lc_heavy} heavy, block 16, "
      f"{dtype} on {device}")
print(format_long_context(list(lc_rows.values())))
lc_full, lc_window_only, lc_sink, lc_h2o = lc_rows["full"], lc_rows["window"], lc_rows["sinks"], lc_rows["h2o"]
lc_held = conclude("KV held per sequence, sinks + window ÷ full cache",
                   lc_sink.kv_bytes_held / lc_full.kv_bytes_held, 1, expect="<", unit="×",
                   held="eviction bounds the cache: the blocks the window and sinks need, not the text's",
                   missed="eviction did not shrink the cache: the text is shorter than the window")
lc_sinks_help = conclude("perplexity, window only ÷ sinks + window", lc_window_only.ppl / lc_sink.ppl, 1,
                         expect=">", unit="×",
                         held="dropping the first tokens hurts more than keeping 4 sinks: they are attention "
                              "sinks, as StreamingLLM found",
                         missed="the window alone does as well as sinks + window on this text")
lc_quality = conclude("perplexity, sinks + window ÷ full cache", lc_sink.ppl / lc_full.ppl, 1, expect="≈", unit="×",
                      held=f"4 sinks and a {lc_window}-token window keep the full cache's quality within 15%",
                      missed=f"a {lc_window}-token window loses context this text needs, sinks or not")
lc_h2o_bytes = conclude("KV held per sequence, H2O ÷ sinks + window", lc_h2o.kv_bytes_held / lc_sink.kv_bytes_held,
                        1, expect=">", unit="×",
                        held="the heavy hitters cost blocks beyond the sinks and the window",
                        missed="H2O held no more than sinks + window: the text is too short to fill its budget")
lc_h2o_ppl = conclude("perplexity, sinks + window ÷ H2O", lc_sink.ppl / lc_h2o.ppl, 1, expect=">", unit="×",
                      held="the blocks that drew the most attention are worth keeping: those extra bytes buy "
                           "perplexity",
                      missed="the heavy hitters' extra blocks bought no perplexity on this text")

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for r in lc_rows.values():
    per_token = r.kv_bytes_read_per_token / 2**20
    ax1.scatter(per_token, r.ppl, s=40)
    ax1.annotate(f"{r.policy}", (per_token, r.ppl), textcoords="offset points", xytext=(6, 4))
ax1.set(xlabel="MiB of K/V read per decode token (at the text's end)", ylabel="perplexity",
        title=f"Quality vs cache, {lc_ids.numel()} held-out tokens")
positions = range(0, lc_ids.numel(), max(1, lc_ids.numel() // 256))
lc_token_bytes = library_variants.kv_bytes_gqa(config, config.num_kv_heads, elt)  # K/V bytes per token
for label, window, sinks, heavy in (("full cache", None, 0, 0),
                                    (f"{lc_sinks} sinks + window {lc_window}", lc_window, lc_sinks, 0),
                                    (f"H2O: those + {lc_heavy} heavy", lc_window, lc_sinks, lc_heavy)):
    ax2.plot(positions, [min(p + 1, kept_tokens(p, window, sinks) + heavy) * lc_token_bytes / 2**20
                         for p in positions], label=label)
ax2.set(xlabel="decode position", ylabel="MiB of K/V read per decode step",
        title="Decode reads: growing vs bounded")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# On the roofline: the two decodes at the text's end, from the rates just measured and the bytes a step reads
# (weights + the kept K/V), against this machine's roof measured at the top of the notebook. Under eviction the
# point stays where it is however long the text grows; the full cache's drifts as its K/V grows (a 135M model's
# weights dominate at these lengths, so the gap is small here — it is the cache of a long chat on a big model).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
lc_points = []
for r in (lc_full, lc_sink):
    kv_len = kept_tokens(r.num_tokens + r.decode_tokens - 2, r.window_tokens, r.sink_tokens)
    cost = roofline.decode_step_cost(config, batch=1, kv_len=kv_len, dtype=dtype)
    lc_points.append(roofline.RooflinePoint.from_cost(f"decode at {r.num_tokens}, {r.policy}", cost,
                                                      1 / r.decode_tokens_per_s))
    print(f"{r.policy:>5}: {kv_len} keys read, {cost.bytes / 1e6:6.1f} MB per step, {r.decode_tokens_per_s:6.1f} tok/s")
roofline.plot_roofline(spec, lc_points, dtype=dtype)
plt.show()
lc_faster = conclude("decode tok/s at the text's end, sinks + window ÷ full cache",
                     lc_sink.decode_tokens_per_s / lc_full.decode_tokens_per_s, 1, expect=">", unit="×",
                     held="reading fewer K/V bytes per step made decode faster here",
                     missed="at this length the weights dominate each step's bytes, so the K/V saved is within "
                            "this machine's noise and the eviction's bookkeeping")
print(f"H2O: {lc_h2o.kv_bytes_read_per_token / 2**20:.2f} MiB of K/V read per step, "
      f"{lc_h2o.decode_tokens_per_s:.1f} tok/s (reference attention)")
lc_h2o_rate = conclude("decode tok/s at the text's end, H2O ÷ sinks + window",
                       lc_h2o.decode_tokens_per_s / lc_sink.decode_tokens_per_s, 1, expect="<", unit="×",
                       held="H2O's steps run the reference attention (it must see the softmax weights to score "
                            "tokens), slower than the fused kernel the positional policies decode with",
                       missed="the reference attention H2O decodes with kept up with the fused kernel here")

# %% [markdown]
# ## Takeaways
#
# - **KV bytes per token = 2 × layers × H_kv × head_dim × bytes**: H_kv is the lever. GQA with H_q / H_kv = G
#   shrinks the cache G-fold, so G× more sequences fit and long-context decode steps read G× fewer cache bytes.
# - Share K/V heads by **viewing** q as `[B, H_kv, G·L, D]`, never by copying K/V: a copy spends the bytes GQA
#   saves (and `torch.matmul` broadcasting copies silently).
# - MHA → GQA/MQA by **mean-pooling** heads is a starting point, not a finished model: without uptraining,
#   SmolLM2 pooled to one K/V head loses most of its quality.
# - MLA (57× for DeepSeek-V2), cross-layer sharing (~3×), sliding windows (10× for 1000 of 10 000 tokens) cut other
#   factors of the same product; they need models trained that way.
# - Decode attention's intensity is ≈ 2·G ÷ bytes per element **whatever the batch**: batching lifts the linear
#   layers toward the ridge, never attention. Fewer K/V heads (and fewer bytes per element) are what move it.
# - **Which tokens to keep** bounds the cache whatever the length: a window of W keys frees every older block, and
#   a few attention **sinks** (the first tokens) beside it keep a full-attention model's perplexity close to the
#   full cache's, at a constant number of blocks and constant bytes read per decode step.
# - **H2O** spends a further budget on the tokens attention has used most: whether those bytes buy perplexity is
#   the measured comparison above; scoring needs the attention weights, which is why its decode runs the
#   reference attention here.
