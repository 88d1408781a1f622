# %% [markdown]
# # 04 — Attention kernels
#
# Attention is softmax(q kᵀ / √D) v. Written that way it materialises an L × S matrix of scores per head: for a
# 32k-token prompt and 32 heads that is 32 × 32 768² fp16 scores, 64 GiB, written to GPU memory (HBM), read back
# for the softmax, written again as probabilities and read again for the product with V. The arithmetic is
# the same whichever way it is computed; the **bytes** are not.
#
# **FlashAttention** (Dao et al., 2022) never lets the scores leave the chip: it streams tiles of K and V
# through on-chip SRAM (~19 TB/s on an A100, against ~2 TB/s of HBM), keeps a *running* softmax for each query
# (the **online softmax**: a running max m, a running sum ℓ, a rescaled accumulator) and writes the output once.
# **Flash-decoding** applies the same algebra to decode, where there is one query per sequence: it splits the
# long K/V across many programs and **merges** their partial softmaxes exactly.
#
# **In this notebook** you predict the bytes naive and fused attention move, write the merge of two partial
# softmax results (exercise 4.1) and one tile step of FlashAttention (4.2) in PyTorch, plug both into the
# model's decode, read and run minillm's Triton kernels (on a CPU through Triton's interpreter, at tiny sizes),
# write flash-decoding's tile loop in Triton (4.3) and decode the model through it, then predict (4.0) and time
# attention on this device and place it on the roofline; last, predict (4.4) and measure what a whole decode step
# pays beyond its bytes — launch overhead — eager, compiled, with CUDA graphs and as one fused native call.
# Runs in about two minutes on a 2-core CPU; on a GPU it uses the GPU and times the Triton kernels.

# %%
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before minillm's Triton kernels load: run them in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import inspect
import math
import random

import matplotlib.pyplot as plt
from torch import Tensor

from minillm import LLM, SamplingParams, kernels
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.course.predictions import predict_attention_gb_s, predict_eager_step_ms
from minillm.engine.simple import generate
from minillm.kernels.reference import attention_partial
from minillm.kv.contiguous import KVCache
from minillm.perf import roofline
from minillm.perf.bench.attention import bench_attention
from minillm.perf.bench.decode import time_engine

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})  # readable figures: ≥ 110 dpi

device = "cuda" if torch.cuda.is_available() else "cpu"
llm = LLM(device=device)  # SmolLM2-135M-Instruct, offline, in the dtype minillm picks for this machine
model, config = llm.model, llm.model.config
dtype = roofline.dtype_name(model.dtype)
triton_ok = kernels.triton_available()
if triton_ok:
    import triton
    import triton.language as tl  # the names exercise 4.3's Triton program uses
print(f"{dtype} on {device}; Triton {'installed' if triton_ok else 'not installed'}"
      + (" (interpreter: kernels run on CPU, slowly, at tiny sizes)" if triton_ok and device == "cpu" else ""))

# %% [markdown]
# ## 1. Predict: the bytes naive and fused attention move
#
# For one layer of a prefill — q `[B, H_q, L, D]` over k, v `[B, H_kv, S, D]` — both versions read Q, K, V and
# write O. The naive one also writes the B·H_q·L·S scores, reads them for the softmax, writes the probabilities and
# reads them for P·V: 4·B·H_q·L·S extra elements. `roofline.attention_cost(..., fused=False)` prices that.
# With L = S the extra traffic grows as L² while Q, K, V, O grow as L. For a Llama-3-8B-sized layer (32 query
# heads, 8 K/V heads of 128 dims) in bf16:

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
lengths = [2**i for i in range(7, 16)]  # 128 … 32 768 tokens
Hq, Hkv, D = 32, 8, 128  # a Llama-3-8B-like layer (32 query heads, 8 K/V heads of 128), bf16
naive = [roofline.attention_cost(1, n, n, Hq, Hkv, D, "bfloat16", fused=False) for n in lengths]
fused = [roofline.attention_cost(1, n, n, Hq, Hkv, D, "bfloat16", fused=True) for n in lengths]
for n, a, b in zip(lengths, naive, fused, strict=True):
    if n in (512, 4096, 32768):
        print(f"L = S = {n:5d}: naive {a.bytes / 2**20:10.1f} MiB, fused {b.bytes / 2**20:7.1f} MiB "
              f"({a.bytes / b.bytes:5.0f}x); intensity naive {a.intensity:5.1f}, fused {b.intensity:6.0f} FLOP/B")

# %%
# NBVAL_IGNORE_OUTPUT
h100 = roofline.get_spec("H100-SXM")
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.loglog(lengths, [c.bytes / 1e9 for c in naive], "o-", color="tab:red", label="naive: scores through HBM")
ax1.loglog(lengths, [c.bytes / 1e9 for c in fused], "o-", color="tab:blue", label="fused: Q, K, V read, O written")
ax1.set(xlabel="sequence length L = S", ylabel="GB moved per layer", title="Bytes moved by one attention layer")
ax1.legend()
for costs, color, name in ((naive, "tab:red", "naive"), (fused, "tab:blue", "fused")):
    bound = [max(c.flops / h100.peak("bfloat16"), c.bytes / h100.memory_bandwidth) * 1e3 for c in costs]
    ax2.loglog(lengths, bound, "o-", color=color, label=name)
ax2.set(xlabel="sequence length L = S", ylabel="ms (roofline bound)", title="H100 SXM, bf16: time bound per layer")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Naive attention's intensity stays near a constant (each score is computed with ~2·D FLOPs and moved 4 times),
# far below an H100's ridge of ~295 FLOP/byte: it is memory bound at every length. Fused attention's intensity
# grows with L: for long prompts it becomes compute bound, which is where a prefill belongs.

# %% [markdown]
# ## 2. The online softmax: merging partial results
#
# Split the keys into chunks. For each chunk p, compute with its own max m_p = max_j s_j:
# den_p = Σ_j exp(s_j − m_p) and o_p = Σ_j exp(s_j − m_p) v_j (unnormalised). Neither alone is the answer,
# but together they hold everything: with M = max_p m_p,
#
# softmax(s) · v = Σ_p exp(m_p − M) · o_p ÷ Σ_p exp(m_p − M) · den_p
#
# exactly (the log-sum-exp identity), and every exponent is ≤ 0, so nothing overflows. `attention_partial(q, k, v)`
# computes (m, den, o) for one chunk.
#
# ### Exercise 4.1 — merge partial softmax results
#
# Write `merge_attention_partials(m, den, o)`: m, den `[..., P]`, o `[..., P, D]` for P chunks → `[..., D]`.
# An empty chunk has m = −∞, den = 0, o = 0 and must count for nothing.

# %%
# exercise 4.1: minillm.kernels.reference.merge_attention_partials

# %%
# NBVAL_CHECK_OUTPUT
checks.check_merge_attention_partials(merge_attention_partials)

# %% [markdown]
# Two halves of the keys, computed separately (as two GPU programs would), merged:

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
g = torch.Generator().manual_seed(0)
q1, k1, v1 = torch.randn(3, 16, generator=g), torch.randn(100, 16, generator=g), torch.randn(100, 16, generator=g)
(ma, da, oa), (mb, db, ob) = attention_partial(q1, k1[:60], v1[:60]), attention_partial(q1, k1[60:], v1[60:])
merged = merge_attention_partials(torch.stack([ma, mb], -1), torch.stack([da, db], -1), torch.stack([oa, ob], -2))
full = torch.softmax(q1 @ k1.T / 4, dim=-1) @ v1  # all 100 keys at once; scale 1/√16
torch.testing.assert_close(merged, full)
print(f"merged halves (60 + 40 keys) == softmax over all 100 keys for {q1.shape[0]} queries")

# %% [markdown]
# ## 3. FlashAttention: one tile at a time
#
# Merging is associative, so the chunks can also be folded in **one at a time** into a running state — this is
# FlashAttention's inner loop. A program holds a tile of M queries and the state m `[M]`, den `[M]`, acc `[M, D]`
# in registers, streams K/V tiles of N keys, and for each tile:
#
# 1. s = q · k_tileᵀ · scale (an M × N tile of scores — the only scores that ever exist),
# 2. m_new = max(m, rowmax(s)); α = exp(m − m_new) rescales what was accumulated under the old max,
# 3. p = exp(s − m_new); den ← α·den + Σ p; acc ← α·acc + p · v_tile; m ← m_new.
#
# After the last tile, the output is acc / den. HBM traffic: Q read once, K and V read once per query tile, O
# written once.
#
# ### Exercise 4.2 — one tile step of FlashAttention
#
# Write `flash_tile_step(m, den, acc, q, k_tile, v_tile, scale)` returning the new `(m, den, acc)`. Leading
# dimensions broadcast, so GQA works by viewing q as `[B, H_kv, G·L, D]` (notebook 03).

# %%
# exercise 4.2: minillm.kernels.reference.flash_tile_step

# %%
# NBVAL_CHECK_OUTPUT
checks.check_flash_tile_step(flash_tile_step)


# %% [markdown]
# ### Plug them in: your kernels decode with the model
#
# Two decode attentions built on your functions — a FlashAttention-style loop over key tiles (4.2) and a
# flash-decoding split of the keys into chunks merged at the end (4.1) — each passed explicitly to a KV cache
# that uses it for every decode step. Greedy decoding with either must pick the library's tokens.

# %% tags=["slide"]
def tiled_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, block_n: int = 32,
                    step=flash_tile_step) -> Tensor:
    """q [B, H_q, L, D] over all of k, v [B, H_kv, S, D] (no mask), folding key tiles of ``block_n`` with ``step``."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv * L, D)  # GQA: a group's query heads are rows against one K/V head
    m = torch.full(qg.shape[:-1], float("-inf"), device=q.device)  # (B, H_kv, G·L)
    den = torch.zeros(qg.shape[:-1], device=q.device)
    acc = torch.zeros(qg.shape, device=q.device)  # (B, H_kv, G·L, D) fp32
    for start in range(0, S, block_n):
        m, den, acc = step(m, den, acc, qg, k[:, :, start : start + block_n], v[:, :, start : start + block_n], scale)
    return (acc / den[..., None]).to(q.dtype).view(B, Hq, L, D)


def split_kv_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, num_splits: int = 4,
                       merge=merge_attention_partials) -> Tensor:
    """Flash-decoding's plan in PyTorch: partial softmaxes over ``num_splits`` chunks of keys, merged with ``merge``."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv * L, D)
    size = math.ceil(S / num_splits)
    parts = [attention_partial(qg, k[:, :, a : a + size], v[:, :, a : a + size], scale=scale)
             for a in range(0, num_splits * size, size)]  # the last chunks may be empty: m = -inf, weight 0
    m, den = torch.stack([p[0] for p in parts], -1), torch.stack([p[1] for p in parts], -1)  # (B, H_kv, G·L, P)
    o = torch.stack([p[2] for p in parts], -2)  # (B, H_kv, G·L, P, D)
    return merge(m, den, o).to(q.dtype).view(B, Hq, L, D)


class CacheWithDecode(KVCache):
    """The library's KV cache for one sequence; decode steps attend with ``decode`` (prefill: library kernels)."""

    def __init__(self, *args, decode, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode = decode

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        if q.shape[2] > 1:  # prefill
            return super().attention(layer, q, k, v, scale)
        k_all, v_all, _ = self.update(layer, k, v)  # one sequence: every filled slot is visible, no mask
        return self.decode(q, k_all, v_all, scale=scale)


@torch.inference_mode()
def greedy_tokens(m, prompt: list[int], n_new: int, decode) -> list[int]:
    """Greedy decoding of ``n_new`` tokens after ``prompt`` with ``decode`` as the decode attention."""
    cache = CacheWithDecode(m.config, 1, len(prompt) + n_new, dtype=m.dtype, device=m.device, decode=decode)
    ids = torch.tensor([prompt], device=m.device)
    positions = torch.arange(len(prompt), device=m.device)[None]
    tokens = []
    for _ in range(n_new):
        cache.begin(positions)
        tokens.append(int(m.compute_logits(m.hidden_states(ids, positions, cache)[:, -1]).argmax(-1)))
        ids, positions = torch.tensor([[tokens[-1]]], device=m.device), positions[:, -1:] + 1
    return tokens


# %% tags=["slide-output"]
# Exactness is judged in fp32 on the reference kernels (on a GPU the model runs in bf16 with Triton kernels).
exact = model if model.dtype == torch.float32 else copy.deepcopy(model).float().set_kernels("torch")
prompt = llm.encode("FlashAttention computes exact attention without writing the scores to memory because")
n_new = 8 if FAST else 16
library = generate(exact, [prompt], SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))[0].output
for name, decode in (("tiled (your flash_tile_step)", tiled_attention),
                     ("split-KV (your merge_attention_partials)", split_kv_attention)):
    mine = greedy_tokens(exact, prompt, n_new, decode)
    assert mine == library, f"{name}: {mine} != the library's {library}"
    print(f"✓ {name}: the same {n_new} greedy tokens as the library")
print(repr(llm.tokenizer.decode(library)))

# %% [markdown]
# ## 4. The Triton kernel
#
# `minillm/kernels/triton/flash.py` is that loop on a GPU. One program per (tile of BLOCK_M queries,
# batch, query head) loads its Q tile once and calls `_attend_tiles` over the key tiles; the scores live in
# registers. Compare it line by line with your `flash_tile_step`: the kernel works in base 2 (`exp2`, with
# log₂e folded into the scale, because exp2 is the GPU's native exponential), and `tl.dot(p, v, acc * alpha)`
# fuses the rescale into the matrix multiply. `MASKED` tiles apply the causal diagonal and ragged edges.

# %% tags=["slide-output"]
if triton_ok:
    from minillm.kernels.triton import flash as triton_flash_attention

    print(inspect.getsource(triton_flash_attention._attend_tiles.fn))  # .fn: the Python function under @triton.jit
else:
    print("triton is not installed here (pip install 'minillm[gpu]'); the source is in "
          "minillm/kernels/triton/flash.py")

# %% [markdown]
# Run it and compare with the reference. On a CPU, Triton's interpreter executes the kernel with NumPy, one
# program at a time: correct, far too slow to time, so the sizes are tiny (still crossing tile edges: 32 × 32
# tiles in the interpreter). On a GPU it runs at a real size in bf16, where "correct" means as accurate as the
# 16-bit reference: no further from the fp32 answer than twice the reference's own error (the rule of
# FlashAttention's tests; `assert_close`'s 16-bit defaults would reject any implementation's final rounding).

# %%
def assert_accurate(out: Tensor, reference, *args, **kwargs) -> float:
    """``out`` against ``reference(*args, **kwargs)``: fp32 by ``assert_close``; 16-bit by comparing both errors
    against the reference run in fp32. Returns the max |error| of ``out``."""
    expected = reference(*args, **kwargs)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected)
        return (out - expected).abs().max().item()
    exact = reference(*(a.float() if a.is_floating_point() else a for a in args), **kwargs)
    err, ref_err = ((x.float() - exact).abs().max().item() for x in (out, expected))
    assert err <= 2 * ref_err + 1e-5, f"max error {err:.3g}, the 16-bit reference's {ref_err:.3g}"
    return err


# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
if triton_ok:
    B_, Hq_, Hkv_, D_ = (1, 32, 8, 128) if device == "cuda" else (1, 4, 2, 32)
    kv_dtype = model.dtype  # the engine's dtype here: fp32 on CPU (the interpreter's), bf16 or fp16 on a GPU
    for L_, S_ in ([(4096, 4096), (1000, 3000)] if device == "cuda" else [(64, 64), (40, 72)]):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B_, Hq_, L_, D_, generator=g, device=device, dtype=kv_dtype)
        k, v = (torch.randn(B_, Hkv_, S_, D_, generator=g, device=device, dtype=kv_dtype) for _ in range(2))
        out = kernels.flash_attention(q, k, v, causal=True, impl="triton")
        err = assert_accurate(out, kernels.flash_attention, q, k, v, causal=True, impl="torch")  # SDPA
        print(f"✓ Triton flash_attention, causal, q {tuple(q.shape)}, k/v {tuple(k.shape)} {kv_dtype}: as accurate "
              f"as the reference (max |Δ| = {err:.1e})")
    q, k, v = q.float(), k.float(), v.float()  # in fp32 (no-op on CPU): your loop and the kernel, digit for digit
    err = assert_accurate(kernels.flash_attention(q, k, v, causal=False, impl="triton"), tiled_attention, q, k, v,
                          scale=D_**-0.5)
    print(f"✓ non-causal, fp32: the Triton kernel and your tiled_attention agree (max |Δ| = {err:.1e})")

# %% [markdown]
# ## 5. Flash-decoding: split the keys, merge the partials
#
# At decode there is one query per sequence, so FlashAttention's parallelism over query tiles vanishes: one
# program per (sequence, K/V head) would leave most of a GPU idle while each streams a long cache. Flash-decoding
# launches one program per (sequence, K/V head, **chunk of keys**); each writes its partial (m, den, o), and a
# second small kernel merges them — your exercise 4.1, in `_merge_kernel`. minillm picks chunks of ≥ 128 keys,
# aiming for about 4 programs per streaming multiprocessor (SM):

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
SMS, PER_SM, MIN_SPLIT = 132, 4, 128  # H100 SXM: 132 SMs; the targets of kernels/triton/decode.py
for b, h_kv, s in [(1, 8, 32768), (1, 8, 4096), (8, 8, 32768), (64, 8, 4096)]:
    splits = max(1, min(math.ceil(PER_SM * SMS / (b * h_kv)), s // MIN_SPLIT))
    print(f"B = {b:2d}, H_kv = {h_kv}, S = {s:5d}: {b * h_kv:4d} programs without splitting "
          f"({b * h_kv / SMS:4.2f} per SM), {b * h_kv * splits:5d} with {splits:2d} splits of "
          f"{math.ceil(s / splits):4d} keys ({b * h_kv * splits / SMS:4.1f} per SM)")

# %% [markdown]
# The kernel against the reference, with the split size forced small so that several chunks (and empty ones,
# past the shorter sequence's end) are merged:

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
if triton_ok:
    from minillm.kernels.triton import decode as triton_decode_attention

    B_, Hq_, Hkv_, S_, D_, split = (8, 32, 8, 32768, 128, 2048) if device == "cuda" else (2, 4, 2, 64, 32, 16)
    kv_dtype = model.dtype  # the engine's dtype here: fp32 on CPU (the interpreter's), bf16 or fp16 on a GPU
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B_, Hq_, D_, generator=g, device=device, dtype=kv_dtype)
    k, v = (torch.randn(B_, Hkv_, S_, D_, generator=g, device=device, dtype=kv_dtype) for _ in range(2))
    lens = torch.tensor([S_] + [S_ * 3 // 5] * (B_ - 1), dtype=torch.int32, device=device)
    out = triton_decode_attention.decode_attention_triton(q, k, v, lens, split_size=split)
    err = assert_accurate(out, kernels.decode_attention, q, k, v, lens, impl="torch")
    print(f"✓ Triton flash-decoding, {math.ceil(S_ / split)} splits of {split} keys, lengths {lens.tolist()[:2]}…: "
          f"as accurate as the reference (max |Δ| = {err:.1e})")

# %% [markdown]
# ### Exercise 4.3 — the flash-decoding tile loop, in Triton
#
# Now write pass 1 yourself: the loop over key tiles inside one program of `decode_partial_program` — your
# `flash_tile_step` (4.2) again, but on a `[BLOCK_G, D]` tile of the query heads that share one K/V head, one
# `[BLOCK_N, D]` tile of K and V at a time, with masked loads for the ragged end and base-2 exponentials. The code
# before the fence (program ids, offsets, the query tile) and the stores after it are given. The checker compiles
# it with `triton.jit` and launches it through the library's flash-decoding (split sizes and tiles that cut the
# keys anywhere); on a CPU it runs in Triton's interpreter, set up in this notebook's first cell.

# %%
# exercise 4.3: minillm.kernels.triton.decode.decode_partial_program

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - Initialise `m_i` to -inf, `l_i` and `acc` to zeros (fp32), then `for start_n in range(start, end, BLOCK_N):`.
# - A tile's key indices are `start_n` plus `tl.arange(0, BLOCK_N)`; load with a mask that is false past `end`
#   (and past D), `other=0.0`; set masked scores to -inf with `tl.where` so they weigh nothing.
# - `tl.trans(k)` for Kᵀ; `tl.max(s, 1)`, `tl.sum(p, 1)`; `tl.dot(p.to(v.dtype), v, acc * alpha[:, None])` adds
#   into the rescaled accumulator.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
if triton_ok:
    checks.check_decode_partial_program(decode_partial_program)
else:
    print("triton is not installed here (pip install 'minillm[gpu]'): exercise 4.3 cannot run")

# %% [markdown]
# ### Plug it in: the model decodes through your Triton loop
#
# Your program, compiled, becomes the decode attention of every layer at every decode step (prefill stays on the
# library's kernels). Greedy decoding must pick the library's tokens. On a CPU every kernel call is interpreted,
# so only a few tokens.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
if triton_ok:
    your_kernel = triton.jit(decode_partial_program)

    def your_triton_decode(q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
        """q [B, H_q, 1, D] over every key of k, v [B, H_kv, S, D] through your pass 1 and the library's merge."""
        lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
        return triton_decode_attention.decode_attention_triton(q[:, :, 0], k, v, lens, sm_scale=scale,
                                                               partial_kernel=your_kernel)[:, :, None]

    n_triton = 3 if device == "cpu" else n_new
    mine = greedy_tokens(exact, prompt, n_triton, your_triton_decode)
    assert mine == library[:n_triton], f"your Triton decode: {mine} != the library's {library[:n_triton]}"
    print(f"✓ your Triton flash-decoding loop: the same {n_triton} greedy tokens as the library, through all "
          f"{config.num_layers} layers")

# %% [markdown]
# ## 6. Measure: attention on this device, on the roofline
#
# `minillm.perf.bench.attention.bench_attention` times decode (contiguous and paged) and causal prefill attention next
# to PyTorch's fused `scaled_dot_product_attention` (SDPA), in GB/s of K/V read (decode) and TFLOP/s (prefill).
# On a GPU it times the Triton kernels; on a CPU it times the PyTorch paths only (the interpreter's timings mean
# nothing), including the naive `grouped_attention` prefill that materialises the scores.

# %%
# NBVAL_IGNORE_OUTPUT
spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
print(roofline.format_measurement(spec))

# %% [markdown]
# Your prediction first: what fraction of this machine's bandwidth roof will decode attention reach, at the biggest
# batch and longest context benchmarked? Give it in GB/s of K/V read.

# %%
# exercise 4.0: minillm.course.predictions.predict_attention_gb_s

# %%
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_attention(predict_attention_gb_s, spec.memory_bandwidth / 1e9)

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
if device == "cuda":
    rows = bench_attention(device, seq_lens=(1024, 8192) if FAST else (1024, 8192, 32768))
else:
    rows = bench_attention(device, seq_lens=(128, 256) if FAST else (256, 1024), batch_sizes=(1, 8))
decode_rows = [r for r in rows if r["op"] == "decode" and r["impl"] != "sdpa"]
top = max(decode_rows, key=lambda r: (r["B"], r["S"]))  # the engine's decode kernel at its biggest workload
verdict = checks.judge_prediction(my_prediction, top["GB/s"], bound=spec.memory_bandwidth / 1e9,
                                  what=f"decode attention ({top['impl']}, B = {top['B']}, S = {top['S']})",
                                  unit="GB/s", bound_name="the bandwidth roof",
                                  see="per (sequence, head) a decode reads only S × D elements, and every kernel "
                                      "call has a fixed cost (section 5)")

# %% [markdown]
# Each row becomes a point: x = the cost model's intensity (fused, or naive for the row that materialises the
# scores), y = its FLOPs ÷ the measured time. Decode sits at ≈ 2·G ÷ bytes per element whatever the batch
# (notebook 03), deep in the memory-bound region; prefill moves right as the sequence grows — unless it writes the
# scores out, which keeps it left.

# %%
# NBVAL_IGNORE_OUTPUT
longest, biggest = max(r["S"] for r in rows), max(r["B"] for r in rows)


def point_label(r: dict) -> str:
    """Label the longest sequence's points (decode at the biggest batch; the others sit at the same intensity)."""
    if r["S"] != longest or r["impl"] == "sdpa" or (r["op"] != "prefill" and r["B"] != biggest):
        return ""
    return f"{r['op']} {r['impl']} " + (f"L=S={r['S']}" if r["op"] == "prefill" else f"B={r['B']}, S={r['S']}")


points = []
for r in rows:
    cost = roofline.attention_cost(r["B"], r["L"], r["S"], r["H_q"], r["H_kv"], r["D"], r["dtype"],
                                   fused=r["impl"] != "torch-naive")
    points.append(roofline.RooflinePoint.from_cost(point_label(r), cost, r["ms"] / 1e3))
roofline.plot_roofline(spec, points, dtype=rows[0]["dtype"])
plt.show()

# %% [markdown]
# ## 7. Launch overhead: what a decode step costs beyond its bytes
#
# The roofline prices a decode step by its bytes: every weight read once, ÷ the bandwidth. But the engine does not
# run "a step": it runs a few dozen small ops per layer — views, norms, GEMVs, RoPE, attention, adds — and each is
# one trip through Python, PyTorch's dispatcher and, on a GPU, one kernel launch (a few µs of CPU time while the GPU
# may sit idle). At batch 1 of a small model each GEMV moves little, so that fixed cost per op adds up to a large
# share of the step. Three ways to pay it less often:
#
# - **`torch.compile`** traces the step and fuses its elementwise ops into fewer, bigger kernels (inductor: C++
#   loops on CPU, Triton on CUDA); the engine runs it with `kernels="compiled"`.
# - **CUDA graphs** record a whole step's kernel launches once and replay them with one launch
#   (`enforce_eager=False`, the engine's default on CUDA): the ops stay, their launch cost goes.
# - **A fused native step** (`engine/native_runner.py`, the engine's default on CPU in fp32 and bf16): every layer in
#   one call of C code, so Python and the dispatcher are paid once per step instead of once per op.
#
# First the floor the bytes set, at batch 1 on this machine's roof:

# %% tags=["slide-output"]
launch_prompt_len, launch_tokens = 16, (8 if FAST else 32)
launch_context = launch_prompt_len + launch_tokens // 2  # the average number of cached tokens while decoding
step_cost = roofline.decode_step_cost(config, 1, launch_context, dtype)
floor_ms = step_cost.bytes / spec.memory_bandwidth * 1e3
print(f"one batch-1 decode step of {config.num_layers} layers reads {step_cost.bytes / 1e6:.1f} MB "
      f"({step_cost.intensity:.2f} FLOP/byte): at {spec.memory_bandwidth / 1e9:.1f} GB/s the floor is "
      f"{floor_ms:.2f} ms")

# %% [markdown]
# Your prediction: how long will one eager decode step take (ms), where every op is dispatched from Python? Start
# from the floor and add what you think each layer's ops cost.

# %%
# exercise 4.4: minillm.course.predictions.predict_eager_step_ms

# %%
my_launch_prediction = None  # stays None while the prediction exercise is unwritten
my_launch_prediction = checks.check_prediction_launch(predict_eager_step_ms, floor_ms, config.num_layers)

# %% [markdown]
# Now the engine's decode steps at batch 1, one way of running them after another (`time_engine`: a fresh engine per
# mode, the median step after the prefill), with the ATen ops of one step counted by `torch.profiler` — on a GPU the
# CUDA kernels instead. Native code called through ctypes does not show in the profiler, so the fused step's count
# is the few ops left around it.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
launch_prompt = [[random.randrange(100, config.vocab_size) for _ in range(launch_prompt_len)]]
modes = {"eager": "eager (every op from Python)"}
if device == "cuda":
    modes |= {"compiled": "torch.compile", "graphs": "CUDA graphs"}
else:
    print("torch.compile: skipped on CPU — inductor builds C++ for every batch bucket, minutes on a small CPU, and "
          "on CPU it only fuses the small elementwise ops around GEMVs the native kernels already stream")
    print("CUDA graphs: they replay a step's kernel launches on a GPU; run this notebook on CUDA to measure them")
if device == "cpu" and model.dtype in (torch.float32, torch.bfloat16):
    modes["auto"] = "fused native step"
else:
    print("fused native step: minillm's native decode stack runs on CPU in fp32 and bf16 only")
launch = {}
for mode, name in modes.items():
    seconds, ops = time_engine(model, launch_prompt, launch_tokens, mode)
    launch[name] = (seconds * 1e3, ops)
    print(f"{name:30} {seconds * 1e3:8.2f} ms per step, {ops:5d} {'kernels' if device == 'cuda' else 'ATen ops'}, "
          f"{floor_ms / (seconds * 1e3):6.1%} of the bytes bound")

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
eager_ms, eager_ops = launch["eager (every op from Python)"]
launch_verdict = checks.judge_prediction(my_launch_prediction, eager_ms, bound=floor_ms, what="an eager decode step",
                                         unit="ms", lower_is_faster=True, bound_name="the bytes floor",
                                         see="the rest is the fixed cost of its ops")
per_op_us = max(eager_ms - floor_ms, 0.0) / eager_ops * 1e3
print(f"time beyond the bytes floor per op of the eager step: ({eager_ms:.2f} − {floor_ms:.2f}) ms ÷ {eager_ops} "
      f"ops = {per_op_us:.1f} µs per op" + (" (the step did not exceed the floor: no overhead to share out)"
                                            if eager_ms <= floor_ms else ""))
for name, (ms, ops) in launch.items():
    if name.startswith("eager"):
        continue
    conclude(f"{name} ÷ eager step time", ms / eager_ms, 1.0, expect="<", unit="×",
             held=f"{name} saves {eager_ms - ms:.2f} ms per step by running {eager_ops - ops} fewer ops from Python "
                  f"({(eager_ms - ms) / max(eager_ops - ops, 1) * 1e3:.1f} µs per op removed)",
             missed=f"{name} is no faster than eager here: the ops it removes cost less than the work it adds "
                    "(or a busy machine hid the gain; rerun)")

# %% [markdown]
# On the roofline all of them sit at the same intensity — the same bytes and FLOPs per step — so the only thing that
# moves is the height: how close each way of running the step gets to the bandwidth roof.

# %%
# NBVAL_IGNORE_OUTPUT
launch_points = [roofline.RooflinePoint.from_cost(f"decode B=1, {name}", step_cost, ms / 1e3)
                 for name, (ms, _) in launch.items()]
roofline.plot_roofline(spec, launch_points, dtype=dtype)
plt.show()

# %% [markdown]
# ## Takeaways
#
# - Naive attention moves 4·B·H_q·L·S extra elements (scores and probabilities through memory): quadratic in
#   length and memory bound at any length. Fused attention reads Q, K, V once and writes O once.
# - The **online softmax** makes fusion exact: keep a running max m, a running sum ℓ and an accumulator rescaled
#   by exp(m_old − m_new) whenever the max grows. The same identity **merges** partial results computed anywhere.
# - **FlashAttention** = tiles of K/V streamed through on-chip memory + online softmax: O(L) memory instead of
#   O(L²), and prefill becomes compute bound. **Flash-decoding** = split the keys across programs + merge, so a
#   single long sequence fills the GPU.
# - Kernel techniques at work: tiling (SRAM-sized blocks), fusion (one kernel instead of five), parallelisation
#   over (batch, head, query tile or key chunk), vectorisation (`tl.dot` on tensor cores). `torch.compile` and
#   SDPA's backends apply the same ideas automatically.
# - Decode attention stays memory bound whatever the kernel: its ceiling is bandwidth × 2·G ÷ bytes per element
#   (notebook 03). The next levers are reading fewer bytes: paging without waste (05), quantized KV (07).
# - At batch 1 a decode step also pays a fixed cost per op (Python, the dispatcher, a kernel launch) on top of its
#   bytes. Fewer ops (`torch.compile`, a fused native step) or cheaper launches (CUDA graphs) close that gap; the
#   bytes floor stays — section 7 printed how far each way of running the step got from it here.
