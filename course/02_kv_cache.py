# %% [markdown]
# # 02 — The KV cache
#
# In notebook 01 the naive loop re-ran the whole sequence for every new token. Almost all of that work repeats:
# in a causal model, the keys and values of position p depend only on tokens ≤ p, so they never change once
# computed. The **KV cache** stores K and V (after RoPE) for every layer and position; a decode step then
# computes K, V and Q for the new token only and attends over what is stored. Per token the work drops from
# O(T) linear FLOPs plus O(T²) attention to O(1) plus O(T).
#
# The price is memory: **bytes per token = 2 (K and V) × layers × KV heads × head_dim × bytes per element**.
# For Llama-2-7B in fp16 that is 512 KiB per token, 2 GiB for one 4096-token sequence — the KV cache, not the
# weights, decides how many requests fit on a GPU.
#
# **In this notebook** you compute the cache's size (exercise 2.1) and check the prediction against the memory
# really allocated, write the cache's update (2.2) and the attention of a step over the cache (2.3), run the
# model's cached decode loop on them and prove it exact, then measure the speedup
# over recomputation and — after writing down your own prediction (2.0) — the cost of reading a long cache, and
# place decode steps on the roofline.
# Runs in about two minutes on a 2-core CPU; on a GPU it uses the GPU.

# %%
from __future__ import annotations

import copy
import os
import random
import statistics

import matplotlib.pyplot as plt
import torch
from torch import Tensor

from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.course.predictions import predict_decode_step_ms
from minillm.engine.simple import generate
from minillm.kv.contiguous import KVCache
from minillm.perf import metrics, roofline

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})  # readable figures: ≥ 110 dpi

device = "cuda" if torch.cuda.is_available() else "cpu"
llm = LLM(device=device)  # SmolLM2-135M-Instruct, offline, in the dtype minillm picks for this machine
model, config = llm.model, llm.model.config
dtype = roofline.dtype_name(model.dtype)
print(f"{config.num_layers} layers, {config.num_heads} query heads, {config.num_kv_heads} KV heads of "
      f"{config.head_dim} dims; {dtype} on {device}")

# %% [markdown]
# ## 1. Predict: how big is the cache?
#
# Each layer stores, for every token, one key and one value vector per **KV head** (`H_kv` of them, `head_dim`
# elements each). With grouped-query attention (notebook 03) several query heads share a KV head: SmolLM2 has
# 9 query heads but only 3 KV heads, so its cache is 3× smaller than multi-head attention's would be.
#
# ### Exercise 2.1 — KV-cache bytes per token
#
# Write `kv_bytes_per_token(config, dtype)`: the bytes one token adds to the cache, over all layers. Count what is
# stored per layer and per token (the paragraph above), and check yourself against the docstring's Llama-2-7B
# figure. The fields you need: `config.num_layers`, `config.num_kv_heads`, `config.head_dim`; bytes per element:
# `dtype.itemsize`.

# %%
# exercise 2.1: minillm.kv.contiguous.kv_bytes_per_token

# %%
# NBVAL_CHECK_OUTPUT
checks.check_kv_bytes_per_token(kv_bytes_per_token)

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
LLAMA2_13B = ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40,
                         num_kv_heads=40, head_dim=128, max_position_embeddings=4096)  # its config.json on the hub
models = {"SmolLM2-135M": checks.SMOLLM2_135M, "Llama-2-7B": checks.LLAMA2_7B, "Llama-2-13B": LLAMA2_13B}
for name, cfg in models.items():
    per_token = kv_bytes_per_token(cfg, torch.float16)
    print(f"{name:13} fp16: {per_token / 1024:6.0f} KiB/token, {4096 * per_token / 2**30:5.2f} GiB per "
          f"4096-token sequence, weights {cfg.num_parameters() * 2 / 1e9:5.1f} GB")

# %% [markdown]
# A 13B model on a 40 GB GPU: the weights take ~26 GB (65 %), which leaves ~14 GB — about 17 000 tokens of
# cache, four 4096-token sequences. The figure shows how fast batch × length eats a GPU.

# %%
# NBVAL_IGNORE_OUTPUT
lengths = [512, 1024, 2048, 4096]
per_token = kv_bytes_per_token(checks.LLAMA2_7B, torch.float16)
for batch in (1, 8, 32):
    plt.plot(lengths, [batch * n * per_token / 1e9 for n in lengths], "o-", label=f"batch {batch}")
free = roofline.get_spec("H100-SXM").memory_capacity - checks.LLAMA2_7B.num_parameters() * 2
plt.axhline(free / 1e9, color="k", linestyle="--", label="H100 80 GB minus the fp16 weights")
plt.gca().set(xlabel="tokens per sequence", ylabel="KV cache (GB)", title="Llama-2-7B fp16: KV cache size",
              yscale="log", ylim=(0.1, 1000))
plt.legend(loc="upper left", ncol=2, fontsize="small")
plt.show()

# %% [markdown]
# ### Predict, then measure
#
# Predict the bytes of a cache for `batch` sequences of `length` tokens for *this* model and dtype, then let the
# engine allocate it (`minillm.kv.contiguous.KVCache`) and measure how much memory the process gained (RSS on CPU,
# the CUDA allocator on a GPU). The check allows 5 % for unrelated allocations.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
batch, length = (2, 1024) if FAST else (4, 1024)
predicted = batch * length * kv_bytes_per_token(config, model.dtype)
cache, measured = metrics.memory_growth(lambda: KVCache(config, batch, length, dtype=model.dtype, device=device),
                                        device)
print(f"predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
checks.check_prediction_bytes(predicted, measured)
del cache

# %% [markdown]
# ## 2. Build: writing into the cache
#
# `KVCache` holds `k` and `v` tensors of shape `[layers, B, H_kv, S_max, D]`. Before each forward the engine
# calls `begin(positions)` with the positions `[B, L]` of the tokens it feeds. Each attention layer then calls
# `update(layer, k, v)` with the new keys and values `[B, H_kv, L, D]`: they must land in the slots given by
# each row's positions, and `update` returns what attention reads — the filled slots `[:, :, :self._used]` of
# that layer — and the mask `begin` prepared (rows of a batch can have different lengths).
#
# ### Exercise 2.2 — `KVCache.update`
#
# Fill in `update` below. `MyKVCache` is the library's `KVCache` with your `update`; nothing else changes.
# Hints: `self.k[layer]` is `[B, H_kv, S_max, D]`; with one sequence the positions are a contiguous run
# (a slice assignment works); with several, index with a `[B, 1]` batch index and the `[B, L]` positions.

# %%
# exercise 2.2: minillm.kv.contiguous.KVCache.update

# %%
# NBVAL_CHECK_OUTPUT
checks.check_kv_cache_update(MyKVCache)

# %% [markdown]
# ### Exercise 2.3 — attention over the cache
#
# Each layer's attention now has the new tokens' queries q `[B, H_q, L, D]` and, from `update`, every filled slot
# of the cache, k and v `[B, H_kv, S, D]` (the new tokens' own K/V included, at their positions). Write
# `cached_attention(q, k, v, positions, scale=)`: softmax(q·kᵀ × scale) · v over the slots **each query may
# see**. A decode step has L = 1; a prompt fed in chunks has L > 1 queries that sit *after* the chunks already
# cached — the causal mask is offset by their positions, not anchored at slot 0. In a batch, rows end at
# different slots, and what lies past a row's end is stale. SmolLM2 has fewer K/V heads than query heads
# (notebook 03 explains why): query head h reads K/V head h // (H_q / H_kv); copying K/V heads to match
# (`repeat_interleave`) is fine here.

# %%
# exercise 2.3: minillm.kv.contiguous.cached_attention

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - `torch.arange(S)` compared with `positions[:, None, None, :, None]` (or a shape that suits your layout)
#   gives a boolean "slot s may be seen from position p" for every row, head and query at once.
# - `scores.masked_fill(~visible, float("-inf"))` before the softmax gives those slots exactly zero weight;
#   every query sees at least slot 0, so no row is all `-inf`.
# - Compute the scores in fp32 (`.float()`) and cast the probabilities back to v's dtype before multiplying.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_cached_attention(cached_attention)

# %% [markdown]
# ### Plug it in: cached decoding on your cache and your attention is exact
#
# The model takes any cache object as an explicit argument: `model.hidden_states(ids, positions, cache)`.
# Below, `MyCache` stores K/V with your `update` (2.2) and attends with your `cached_attention` (2.3) in every
# layer. The whole cached greedy loop runs on it: the prompt goes in as chunks of 4 tokens (each chunk attends to
# the chunks before it: the offset causal mask), then one token per step. Then the same tokens go through a full
# forward without any cache: the logits that picked each token must agree (within the dtype's tolerance), the
# greedy tokens must be the same, and so must the tokens the library's own cached loop generates.

# %%
class MyCache(MyKVCache):
    """The library's KVCache with your ``update`` (exercise 2.2) and your ``cached_attention`` (2.3)."""

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        k_all, v_all, _ = self.update(layer, k, v)  # (B, H_kv, S, D): every filled slot, the new tokens' included
        return cached_attention(q, k_all, v_all, self._positions, scale=scale)  # (B, H_q, L, D)


@torch.inference_mode()
def greedy_decode(model, prompt: list[int], n_new: int, cache, chunk: int = 4) -> tuple[list[int], Tensor]:
    """Prefill ``prompt`` into ``cache`` in chunks of ``chunk`` tokens, then decode ``n_new`` greedy tokens one at
    a time.  Returns the new tokens and the logits that chose them, [n_new, V] in fp32.
    """
    for start in range(0, len(prompt), chunk):  # each chunk attends to the chunks cached before it
        ids = torch.tensor([prompt[start : start + chunk]], device=model.device)  # (1, L)
        positions = torch.arange(start, start + ids.shape[1], device=model.device)[None]  # (1, L)
        cache.begin(positions)
        hidden = model.hidden_states(ids, positions, cache)  # (1, L, hidden)
    logits = model.compute_logits(hidden[:, -1])  # (1, V): the prompt's last token only
    tokens, chosen = [], []
    for step in range(n_new):
        chosen.append(logits[0].float())
        tokens.append(int(logits.argmax(-1)))
        position = torch.tensor([[len(prompt) + step]], device=model.device)  # (1, 1)
        cache.begin(position)
        token = torch.tensor([[tokens[-1]]], device=model.device)  # (1, 1): only the new token goes in
        logits = model.compute_logits(model.hidden_states(token, position, cache)[:, -1])
    return tokens, torch.stack(chosen)


# %% tags=["slide-output"]
# Exactness is judged in fp32, where the only differences are rounding noise. On a GPU the model runs in bf16 with
# Triton kernels (which may use TF32), so the check uses an fp32 copy on the PyTorch reference kernels instead.
exact = model if model.dtype == torch.float32 else copy.deepcopy(model).float().set_kernels("torch")
n_new = 8 if FAST else 24
prompt = llm.encode("The key-value cache of a transformer stores")
cache = MyCache(config, 1, len(prompt) + n_new, dtype=exact.dtype, device=device, kernels=exact.kernels)
tokens, cached_logits = greedy_decode(exact, prompt, n_new, cache)
with torch.inference_mode():
    full = torch.tensor([prompt + tokens], device=device)  # (1, T): everything, recomputed from scratch
    recomputed = exact(full, torch.arange(full.shape[1], device=device)[None])[0, len(prompt) - 1 : -1].float()
checks.check_cached_logits(cached_logits, recomputed)
assert recomputed.argmax(-1).tolist() == tokens, "the uncached forward picks different greedy tokens"
library = generate(exact, [prompt], SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))[0]
assert library.output == tokens, "the library's cached loop picks different greedy tokens than yours"
print(repr(llm.tokenizer.decode(tokens)))

# %% [markdown]
# ## 3. Measure: cached vs naive
#
# Both loops of `minillm.engine.simple` produce the same tokens; the naive one re-runs the growing sequence every step.
# The dashed lines are the roofline's estimate of each (every forward at max(FLOPs ÷ peak, bytes ÷ bandwidth),
# from this machine's measured peaks): the naive loop's total grows quadratically, the cached one's linearly.

# %%
# NBVAL_IGNORE_OUTPUT
spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
print(roofline.format_measurement(spec))


def time_bound(cost: roofline.Cost) -> float:
    """The roofline's lower bound on the time of work ``cost`` on this machine (seconds)."""
    return max(cost.flops / spec.peak(dtype), cost.bytes / spec.memory_bandwidth)


# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
rng = random.Random(0)
prompt = [rng.randrange(100, config.vocab_size) for _ in range(8)]
ns = [8, 16] if FAST else [16, 32, 64]
seconds = {"naive": [], "cached": []}
generate(model, [prompt], SamplingParams(max_tokens=2, temperature=0))  # warm-up
for n in ns:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for kind in seconds:
        seconds[kind].append(generate(model, [prompt], params, cached=kind == "cached")[0].metrics.latency_s)
    print(f"{n:3d} tokens: naive {seconds['naive'][-1]:6.2f} s, cached {seconds['cached'][-1]:6.2f} s, "
          f"speedup {seconds['naive'][-1] / seconds['cached'][-1]:4.1f}×")
speedups = [naive / cached for naive, cached in zip(seconds["naive"], seconds["cached"], strict=True)]
conclude(f"cache speedup at {ns[-1]} tokens ÷ at {ns[0]}", speedups[-1] / speedups[0], 1, expect=">", unit="×",
         held="the cache's speedup grows with the length, as O(T²) recomputation against O(T) predicts",
         missed="the speedup did not grow over these lengths in this run: at so few tokens fixed per-token costs "
                "dominate both loops, or the machine's noise hid the trend")
P = len(prompt)
estimate = {
    "naive": [sum(time_bound(roofline.prefill_cost(config, 1, P + t, dtype)) for t in range(n)) for n in ns],
    "cached": [time_bound(roofline.prefill_cost(config, 1, P, dtype))
               + sum(time_bound(roofline.decode_step_cost(config, 1, P + t, dtype)) for t in range(1, n)) for n in ns],
}
for kind, color in (("naive", "tab:red"), ("cached", "tab:blue")):
    plt.plot(ns, seconds[kind], "o-", color=color, label=f"{kind}, measured")
    plt.plot(ns, estimate[kind], "--", color=color, label=f"{kind}, roofline estimate")
plt.gca().set(xlabel="tokens generated (after an 8-token prompt)", ylabel="seconds",
              title="Recompute vs KV cache", ylim=(0, None))
plt.legend()
plt.show()

# %% [markdown]
# ## 4. Measure: a decode step reads the whole cache
#
# With a cache, each decode step reads the weights **plus the K/V of every earlier token**:
# bytes = weight bytes + S × `kv_bytes_per_token`. For this small model the weights dominate until S reaches
# thousands of tokens; for a big batch of long sequences the cache dominates (that is what notebooks 03, 05
# and 07 shrink). The cache is filled with random numbers: a step's cost depends on how much it reads, not on
# what the values are.

# %% [markdown]
# Your prediction first: how long will one decode step over the longest cache take on this machine? The cell
# below prints the roofline's bound for it.

# %%
# exercise 2.0: minillm.course.predictions.predict_decode_step_ms

# %%
contexts = [1, 2048] if FAST else [1, 1024, 2048, 4096, 8191]
step_bound_ms = roofline.decode_step_cost(config, 1, contexts[-1] + 1, dtype).bytes / spec.memory_bandwidth * 1e3
print(f"S = {contexts[-1]}: the step reads at least "
      f"{roofline.decode_step_cost(config, 1, contexts[-1] + 1, dtype).bytes / 1e6:.0f} MB: ≥ {step_bound_ms:.1f} ms")
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_step(predict_decode_step_ms, step_bound_ms)

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT


@torch.inference_mode()
def decode_step_seconds(S: int) -> float:
    """Median time of one batch-1 decode step attending over S cached positions (random contents)."""
    cache = KVCache(config, 1, S + 1, dtype=model.dtype, device=device)
    cache.k.normal_()
    cache.v.normal_()
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.full((1, 1), S, device=device)

    def step():
        cache.begin(pos)
        model.compute_logits(model.hidden_states(ids, pos, cache)[:, -1])

    return statistics.median(metrics.measure_seconds(step, repeat=5, device=device))


step_s = {S: decode_step_seconds(S) for S in contexts}
costs = {S: roofline.decode_step_cost(config, 1, S + 1, dtype) for S in contexts}
for S in contexts:
    kv = costs[S].breakdown["kv_cache"]
    print(f"S = {S:5d}: {step_s[S] * 1e3:6.1f} ms per step; reads {costs[S].bytes / 1e6:6.1f} MB "
          f"({kv / costs[S].bytes:4.0%} of it KV cache) -> {costs[S].bytes / step_s[S] / 1e9:5.1f} GB/s")
verdict = checks.judge_prediction(my_prediction, step_s[contexts[-1]] * 1e3, bound=step_bound_ms, unit="ms",
                                  lower_is_faster=True, what=f"the decode step over S = {contexts[-1]} cached tokens",
                                  see="a step also pays fixed costs per op, whatever S (notebook 01, section 2)")
plt.plot(contexts, [step_s[S] * 1e3 for S in contexts], "o-", label="measured")
plt.plot(contexts, [costs[S].bytes / spec.memory_bandwidth * 1e3 for S in contexts], "k--",
         label="roofline bound: bytes ÷ bandwidth")
plt.gca().set(xlabel="cached positions S", ylabel="ms per decode step", title="Decode step vs context length",
              ylim=(0, None))
plt.legend()
plt.show()

# %% [markdown]
# ## 5. Place it on the roofline
#
# Cached decode steps stay far left of the ridge whatever S: the weights give 2 FLOPs per weight read, and attention
# reads each cached K/V element once for 2 × H_q/H_kv FLOPs — intensity 2·H_q/H_kv ÷ bytes per element (GQA's
# sharing is the lever there; batching does not help attention). The naive loop's steps are prefills whose intensity
# grows with
# the sequence — it looks "efficient" on the roofline by redoing work that was already done.

# %%
# NBVAL_IGNORE_OUTPUT
ends = (contexts[0], contexts[-1])  # label the shortest and longest context; the rest lie between
points = [roofline.RooflinePoint.from_cost(f"decode S={S}" if S in ends else "", costs[S], step_s[S])
          for S in contexts]
n_last = ns[-1]
naive_step = seconds["naive"][-1] / n_last  # average step of the longest naive run
points.append(roofline.RooflinePoint.from_cost(
    f"naive step, T≈{P + n_last // 2}", roofline.prefill_cost(config, 1, P + n_last // 2, dtype), naive_step))
roofline.plot_roofline(spec, points, dtype=dtype)
plt.show()

# %% [markdown]
# ## Takeaways
#
# - The KV cache trades memory for compute: each decode step computes K/V for one token and reads the rest.
#   Cached decoding is **exact** — the same logits as recomputation, within floating-point tolerance.
# - **Bytes per token = 2 × layers × H_kv × head_dim × bytes/element**: 512 KiB for Llama-2-7B in fp16, 2 GiB
#   per 4096-token sequence. Batch × length × that is what must fit next to the weights.
# - Recompute costs O(T²) for T tokens, the cache O(T): the speedup should grow with the length (the ▸ line in
#   section 3 says whether it did in this run).
# - A decode step reads weights + S × bytes/token: long contexts and big batches make the **cache** the dominant
#   read. Shrinking it — fewer KV heads (03), paging without waste (05), quantized KV (07) — is the next lever.
