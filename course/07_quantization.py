# %% [markdown]
# # 07 — Quantization
#
# A batch-1 decode step reads every weight once to produce one token (notebook 00): its time is
# **bytes ÷ bandwidth**. Store each weight in fewer bits and the same bandwidth streams the model faster. That is
# the whole promise of weight-only quantization — and its limits:
#
# - **Formats.** fp32 (1 sign / 8 exponent / 23 mantissa bits), fp16 (1/5/10, largest 65504), bf16 (1/8/7: fp32's
#   range, 3 significant digits), fp8 e4m3 / e5m2, and integers: int8, int4. Integers are evenly spaced and need a
#   **scale** (and for an asymmetric map a **zero point**) to cover a tensor's range.
# - **Granularity.** One scale per tensor, per output channel, or per **group** of 32–128 weights. One outlier
#   stretches the scale of everything that shares it, so finer groups keep the error small — for a few extra bits.
# - **Weight-only (W8A16, W4A16).** The matmul dequantizes the weights on the fly: fewer bytes for memory-bound
#   decode, nothing gained for compute-bound prefill. LLM.int8() keeps outlier features in fp16; AWQ/SmoothQuant
#   rescale channels using calibration text; GPTQ corrects the error column by column.
# - **Published anchors.** gpt-fast, Llama-2-7B batch 1 on an A100: bf16 105 tok/s, int8 156, int4 197 — int4 has
#   4× fewer bytes than bf16 but is not 4× faster. AWQ int4 g128 moves Llama-2-7B's perplexity 5.47 → 5.60.
#
# The default model already ships as **Q4_1** (llama.cpp's 4-bit format: groups of 32 weights with an fp16 scale
# and minimum): minillm runs those blocks as they are.
#
# **In this notebook** you write absmax and zero-point quantization at any granularity (exercise 7.1) and see why
# per-tensor scales fail on outliers; pack int4 groups into Q4_1 bytes (7.2) and reproduce the GGUF file byte for
# byte; write the dequantizing GEMV (7.3) and run the real model on it, then the same GEMV as a Triton kernel that
# never builds the float matrix (7.6); predict decode tok/s from bytes per token,
# then measure fp32, int8 and int4 with the native kernels; plot perplexity against bits; count KV-cache tokens
# per byte; and profile where a token's time goes once the weights are small. A few minutes on a 2-core CPU; on a
# GPU it uses the GPU.

# %%
from __future__ import annotations

import copy
import importlib.util
import os
import time
import types

import torch

if not torch.cuda.is_available():  # before minillm's Triton kernels load: run them in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import numpy as np
import torch.nn.functional as F  # noqa: F401  (used by your int4_linear_ref)
from torch import nn

from minillm import LLM, SamplingParams, kernels
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.course.predictions import predict_int4_tok_s
from minillm.engine.simple import generate
from minillm.kv.quant import dequantize_kv, kv_bytes_per_token, quantize_kv_fp8, quantize_kv_int8
from minillm.layers.linear import QuantLinear
from minillm.models.loader import default_model_path
from minillm.perf import roofline
from minillm.perf.bench.quant import bench_quant_gemv, weight_bytes_per_step
from minillm.perf.perplexity import heldout_token_ids, perplexity
from minillm.perf.profile import profile_decode
from minillm.quant.apply import model_from_packed, quantize_model
from minillm.quant.formats import (
    FORMAT_NAMES,
    Granularity,  # noqa: F401  (used by your quantize)
    Quantized,
    QuantSpec,
    cast_roundtrip,
    dequantize,
    error_stats,
    fake_quantize,
    format_info,
    group_view,
)
from minillm.quant.gguf import read_gguf_weights
from minillm.quant.weight import BLOCK, Int4Weight, Int8Weight, check_group_size, check_in_features  # noqa: F401

if kernels.triton_available():
    import triton.language as tl  # the names exercise 7.6's Triton program uses

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})

device = "cuda" if torch.cuda.is_available() else "cpu"
llm = LLM(device=device, dtype="float32")  # SmolLM2-135M-Instruct, offline; fp32 is the baseline everywhere
model, config = llm.model, llm.model.config
packed = read_gguf_weights(default_model_path())  # the same file, its Q4_1 / Q8_0 blocks as they are stored
print(f"SmolLM2-135M on {device}: {config.num_layers} layers, hidden {config.hidden_size}; GGUF tensors: "
      f"{sum(isinstance(w, Int4Weight) for w in packed.values())} Q4_1, "
      f"{sum(isinstance(w, Int8Weight) for w in packed.values())} Q8_0, "
      f"{sum(isinstance(w, torch.Tensor) for w in packed.values())} float")

# %% [markdown]
# ## 1. Formats: range, precision, bytes
#
# A float format spends its bits on **range** (exponent) or **precision** (mantissa); `eps` is the gap between 1
# and the next number, so a value's relative rounding error is at most eps/2. An integer format has a fixed step
# of 1 and a tiny range: it only works together with a scale chosen for the tensor at hand.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
print(f"{'format':9} {'bits':>4} {'bytes':>5} {'largest':>11} {'smallest normal':>16} {'eps (rel. step)':>16}")
for name in FORMAT_NAMES:
    f = format_info(name)
    print(f"{name:9} {f.bits:4d} {f.bytes:5.1f} {f.max:11.4g} {f.smallest_normal:16.3g} {f.eps:16.3g}")

# %%
# NBVAL_IGNORE_OUTPUT
w = model.model.layers[0].mlp.down_proj.weight.detach().float().cpu()  # a real weight matrix, [576, 1536]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
floats = [n for n in FORMAT_NAMES if format_info(n).is_float]
for n in floats:
    f = format_info(n)
    ax1.scatter(f.max, f.eps, s=30 * f.bits, label=f"{n} ({f.bits} bits)")
ax1.set(xscale="log", yscale="log", xlabel="largest finite value (range)", ylabel="eps (relative step)",
        title="Float formats: range vs precision")
ax1.legend(fontsize="small", markerscale=0.4)
sqnr = [error_stats(w, cast_roundtrip(w, n)).sqnr_db for n in floats[1:]]
ax2.bar(floats[1:], sqnr, color="tab:blue", label="cast of a real weight (layer 0 down_proj)")
ax2.set(ylabel="SQNR (dB, higher is better)", title="Error of one cast, no scale")
ax2.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# Each mantissa bit is worth about 6 dB of signal-to-noise: fp16 (10 bits) beats bf16 (7), e4m3 (3) beats e5m2
# (2). fp8 needs a scale anyway — e4m3's largest value is 448 and its smallest normal 2⁻⁶, so small weights fall
# into its coarse subnormals — which is why fp8 inference carries per-tensor or per-channel scales just as int8
# does.
#
# ## 2. Build: absmax and zero-point quantization
#
# Integer codes q and a scale s stand for x̂ = (q − z)·s:
#
# - **symmetric (absmax)**: s = max|x| / qmax, z = 0 — int8 uses [−127, 127] so that +x and −x get codes of
#   equal size;
# - **asymmetric (min/max)**: s = (hi − lo) / (qmax − qmin), zero point z = qmin − round(lo / s), with [lo, hi]
#   the tensor's range widened to include 0 (so 0, the most common value, is exact). It spends no codes on a
#   side of 0 where there is nothing: 4-bit unsigned codes 0..15 for a range [−0.1, 0.3] use all 16 levels.
#
# **Granularity** decides which elements share one (s, z): the whole tensor, one row (an output channel of a
# weight [N, K]), or each group of g consecutive elements along K. **Clipping** (`clip_ratio` < 1) shrinks the
# range: the largest values saturate, everything else gets a finer grid.
#
# ### Exercise 7.1 — `quantize`
#
# `group_view(x, spec)` reshapes x so that the last dimension holds one scale's elements (it raises the ValueError
# when a group does not divide K). Follow the contract in the docstring: the checker compares every scale, zero
# point and code with its own reference, on inputs you do not see.

# %%
# exercise 7.1: minillm.quant.formats.quantize

# %%
# NBVAL_CHECK_OUTPUT
checks.check_quantize(quantize)

# %% [markdown]
# ### Predict, then measure: one outlier against per-tensor, per-channel and per-group scales
#
# Take the real weight above and plant **one** outlier of 50× its largest value, as trained LLMs have in a few
# channels. With 4-bit per-tensor absmax the step becomes max/7: how many of the 885k weights still round to a
# code other than 0? Write your guess, then measure the error statistics with your `quantize`.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
w_out = w.clone()
w_out[7, 100] = 50 * w.abs().max()  # one outlier in row 7
my_guess_nonzero_fraction = 0.5  # your prediction for 4-bit per-tensor absmax: replace it before running
others = torch.ones_like(w_out, dtype=torch.bool)
others[7, 100] = False  # error statistics over the other weights: the outlier's own energy would flatter SQNR
specs = {"tensor": QuantSpec(4, True, "tensor"), "channel": QuantSpec(4, True, "channel"),
         "group 32": QuantSpec(4, True, "group", 32), "group 32 asym": QuantSpec(4, False, "group", 32)}
print(f"{'4-bit scheme':14} {'SQNR clean':>11} {'SQNR with outlier':>18} {'codes ≠ 0 with outlier':>23}")
outlier_sqnr = {}
for name, spec in specs.items():
    q_clean, q_out = quantize(w, spec), quantize(w_out, spec)
    clean, out = error_stats(w, dequantize(q_clean)), error_stats(w_out[others], dequantize(q_out)[others])
    nonzero = float((dequantize(q_out)[others] != 0).float().mean())  # codes other than the zero point
    outlier_sqnr[name] = (clean.sqnr_db, out.sqnr_db)
    print(f"{name:14} {clean.sqnr_db:8.1f} dB {out.sqnr_db:15.1f} dB {nonzero:22.2%}")
print(f"your guess for 4-bit per tensor: {my_guess_nonzero_fraction:.2%} of the codes ≠ 0")

# %% [markdown]
# Per tensor, the outlier sets a step so large that almost every other weight rounds to 0: their SQNR collapses to
# about 0 dB (the error is as large as the signal). The outlier only hurts its own row
# per channel, its own 32 weights per group — the rest of the matrix does not notice. That is the reason
# 4-bit formats use groups of 32–128 (llama.cpp: 32; GPTQ/AWQ: 128) and why LLM.int8() pulls outlier *activation*
# features out of the int8 matmul altogether.

# %%
# NBVAL_IGNORE_OUTPUT
names = list(outlier_sqnr)
xs = np.arange(len(names))
plt.bar(xs - 0.2, [outlier_sqnr[n][0] for n in names], 0.4, label="real weight")
plt.bar(xs + 0.2, [outlier_sqnr[n][1] for n in names], 0.4, label="with one outlier of 50× max (other weights)")
plt.xticks(xs, names)
plt.ylabel("SQNR (dB)")
plt.title("4-bit absmax: granularity against one outlier")
plt.legend()
plt.show()

# %% [markdown]
# ## 3. Build: int4 groups, packed as Q4_1
#
# Q4_1, llama.cpp's format, stores per group of 32 weights an fp16 scale d, an fp16 minimum m and 32 unsigned
# 4-bit codes with w ≈ d·q + m: asymmetric quantization where the minimum plays the zero point's role. Two codes
# share a byte — but not neighbours: in each 32-weight block, **byte j holds weight j in its low nibble and
# weight j + 16 in its high nibble** (so that a SIMD kernel unpacks 16 weights with one AND and 16 with one shift).
# Per weight: 4 bits + (16 + 16) / 32 = **5 bits**, 6.4× fewer bytes than fp32.
#
# ### Exercise 7.2 — `quantize_int4`
#
# Compute each group's d and m, round them to `scale_dtype`, compute the codes from the rounded values, and pack
# them. Groups of 64 or 128 share one (d, m) over two or four packing blocks: the nibble pairing stays per 32.

# %%
# exercise 7.2: minillm.quant.weight.quantize_int4

# %%
# NBVAL_CHECK_OUTPUT
checks.check_quantize_int4(quantize_int4)

# %% [markdown]
# ### Your packer against the GGUF file
#
# The GGUF's Q4_1 blocks were written by llama.cpp's quantizer. Dequantize a stored tensor, quantize it again with
# your function, and compare the bytes: the same format means the same bytes.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
stored = {n: w4 for n, w4 in packed.items() if isinstance(w4, Int4Weight)}
names_checked = [n for n in stored if ".layers.0." in n] if FAST else list(stored)
same_bytes = total_bytes = 0
for n in names_checked:
    mine = quantize_int4(stored[n].dequantize(), 32)
    same_bytes += int((mine.packed == stored[n].packed).sum()) + 2 * int((mine.scales == stored[n].scales).sum()) \
        + 2 * int((mine.mins == stored[n].mins).sum())
    total_bytes += stored[n].nbytes
print(f"d, m and packed codes of the Q4_1 tensors checked: your bytes equal the file's: "
      f"{same_bytes == total_bytes}")

# %% [markdown]
# ## 4. Build: the dequantizing GEMV the model runs
#
# At decode a linear layer is a GEMV: y = x·Wᵀ for one token. A W4A16 GEMV reads the packed weight, unpacks and
# dequantizes it, and multiplies. Your reference version dequantizes the whole weight into a float matrix and calls
# `F.linear` — exact, and easy to test every fast kernel against. (The native C and Triton kernels do the same
# arithmetic in registers, so the float matrix never reaches memory.)
#
# ### Exercise 7.3 — `int4_linear_ref`
#
# Unpack `w4.packed` yourself (the checker's weights refuse `dequantize()`), apply d and m per group in fp32, and
# cast to x's dtype.

# %%
# exercise 7.3: minillm.quant.weight.int4_linear_ref

# %%
# NBVAL_CHECK_OUTPUT
checks.check_int4_linear_ref(int4_linear_ref)

# %% [markdown]
# ### Run the model on your GEMV
#
# Features enter by **module swap**: every int4 `QuantLinear` of the quantized model (its weights are the GGUF's
# Q4_1 blocks) is replaced by a module that calls *your* function on the same packed weight. The LM head stays
# the file's Q8_0 int8. Greedy decoding must give the tokens of the library's reference path.

# %%
class StudentInt4Linear(nn.Module):
    """A ``QuantLinear``'s packed int4 weight, computed by the function given (the student's GEMV)."""

    def __init__(self, layer: QuantLinear, gemv):
        super().__init__()
        self.layer, self.gemv = layer, gemv

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        """x [..., K] -> [..., N]; ``ops`` (the library's kernels) is not used."""
        return self.gemv(x, self.layer.packed_weight, self.layer.bias)


def swap_int4_linears(net: nn.Module, gemv) -> int:
    """Replace every int4 ``QuantLinear`` of ``net`` by a ``StudentInt4Linear`` running ``gemv``; -> how many."""
    swapped = 0
    for name, module in list(net.named_modules()):
        if isinstance(module, QuantLinear) and isinstance(module.packed_weight, Int4Weight):
            parent, _, child = name.rpartition(".")
            setattr(net.get_submodule(parent), child, StudentInt4Linear(module, gemv))
            swapped += 1
    return swapped


prompt = llm.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
greedy = SamplingParams(max_tokens=4 if FAST else 8, temperature=0.0, ignore_eos=True)
m4_ref = model_from_packed(config, packed, dtype=torch.float32, device=device, kernels="torch")
library_tokens = generate(m4_ref, [prompt], greedy)[0].output
print(f"swapped {swap_int4_linears(m4_ref, int4_linear_ref)} int4 linears for yours")
student_tokens = generate(m4_ref, [prompt], greedy)[0].output
assert student_tokens == library_tokens, f"your GEMV generated {student_tokens}, the library's {library_tokens}"
print(f"library path: {library_tokens} {llm.tokenizer.decode(library_tokens)!r}")
print(f"your GEMV:    {student_tokens} — the same tokens")

# %% [markdown]
# ### Exercise 7.6 — the dequantizing GEMV in Triton, never building the float matrix
#
# Your 7.3 writes the whole float weight to memory and reads it back: 32 bits per weight moved twice more, where
# the packed weight is 5. A real W4A16 kernel unpacks **in registers**: one program owns BLOCK_N output rows, walks
# K in tiles of BLOCK_K weights, loads the tile's packed bytes and its groups' d and m, unpacks and dequantizes
# them, multiplies by x and accumulates — the only bytes read are the packed ones. Write that program body (the
# docstring states the layout and what the store after your code expects). It is checked against
# `int4_linear_ref` (the library's 7.3) on ragged shapes; on CPU it runs in Triton's interpreter (set in the first
# cell).

# %%
# exercise 7.6: minillm.kernels.triton.dequant_gemv.int4_gemv_program

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - the tile's weight indices are `k0` plus `tl.arange` over `BLOCK_K`; `byte` and `shift` follow from the docstring's
#   formula, elementwise on `ks`; load `P + rows64[:, None] * (K // 2) + byte[None, :]` with a [BLOCK_N, BLOCK_K]
#   mask, then `(packed >> shift) & 0xF`.
# - The group of weight k is column `k // G` of `S` and `Mn`: the same [BLOCK_N, BLOCK_K] index for both.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_int4_gemv_program(int4_gemv_program)

# %% [markdown]
# How fast is it? Count the bytes one call must read (packed codes, d and m, x and y) and divide by the time. On a
# GPU that is a real measurement against the roof. On a CPU the kernel runs in Triton's **interpreter**, which
# executes each program's tile operations one after another in numpy: **the interpreter is not a speed**, so the
# number below says nothing about the kernel — the roof says what the same bytes would take.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
import triton  # noqa: E402  (after TRITON_INTERPRET is set in the first cell)

from minillm.kernels.triton.dequant_gemv import int4_gemv_triton  # noqa: E402
from minillm.perf.metrics import measure_seconds  # noqa: E402
from minillm.quant import weight as quant_weight  # noqa: E402  (the library's packing, whatever your 7.2 does)

N_gemv, K_gemv = (256, 512) if FAST or device == "cpu" else (config.intermediate_size, config.hidden_size)
w_gemv = quant_weight.quantize_int4(torch.randn(N_gemv, K_gemv, device=device))
x_gemv = torch.randn(1, K_gemv, device=device)
your_kernel = triton.jit(int4_gemv_program)
gemv_bytes = w_gemv.nbytes + x_gemv.nbytes + N_gemv * x_gemv.element_size()
gemv_s = min(measure_seconds(lambda: int4_gemv_triton(x_gemv, w_gemv, program=your_kernel), repeat=3, warmup=1,
                             device=device))
roof = roofline.machine_spec(device, quick=FAST)  # this machine's cached roof (measured once)
h100_roof = roofline.get_spec("H100-SXM")
print(f"one GEMV [{N_gemv} × {K_gemv}] in Q4_1 reads {gemv_bytes / 1e3:.1f} kB "
      f"({8 * w_gemv.nbytes / (N_gemv * K_gemv):.2f} bits per weight with d and m)")
print(f"your kernel: {gemv_s * 1e3:.2f} ms = {gemv_bytes / gemv_s / 1e9:.4f} GB/s"
      + (" — in the interpreter, which is not a speed" if device == "cpu" else
         f", {gemv_bytes / gemv_s / roof.memory_bandwidth:.0%} of this GPU's {roof.memory_bandwidth / 1e9:.0f} GB/s"))
print(f"the roof: {gemv_bytes / roof.memory_bandwidth * 1e6:.2f} µs at this machine's "
      f"{roof.memory_bandwidth / 1e9:.1f} GB/s, {gemv_bytes / h100_roof.memory_bandwidth * 1e6:.3f} µs at an "
      f"H100's {h100_roof.memory_bandwidth / 1e12:.2f} TB/s (a kernel launch costs ~5 µs there: fuse or batch)")

# %% [markdown]
# ## 5. Predict, then measure: decode tok/s from bytes per token
#
# Batch-1 decode streams every linear weight once per token (the embedding lookup reads one row; the KV cache is
# small at short context). So the roofline bound is **tok/s ≤ bandwidth ÷ weight bytes per token**. Here are the
# weight bytes of each scheme, counted from the models (int8: per-channel scales; int4: the file's Q4_1 blocks with
# its Q8_0 head) and this machine's roof (the cached one every notebook uses). **Exercise 7.0: write your
# prediction** of the int4 model's decode tok/s — start from its bound and say what costs extra (the checker
# accepts a number up to the bound, within 10× of it; the measurement then judges it).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
bandwidth = spec.memory_bandwidth
models = {"fp32": model,
          "int8": quantize_model(copy.deepcopy(model), "int8"),
          "int4 (Q4_1)": model_from_packed(config, packed, dtype=torch.float32, device=device)}
weight_bytes = {name: weight_bytes_per_step(m) for name, m in models.items()}
weight_bytes["bf16"] = weight_bytes["fp32"] / 2  # for the prediction only: bf16 halves every float weight
print(f"this machine's roof (every notebook's): {bandwidth / 1e9:.1f} GB/s")
for name in ("fp32", "bf16", "int8", "int4 (Q4_1)"):
    print(f"{name:12} {weight_bytes[name] / 1e6:7.1f} MB per token -> bound {bandwidth / weight_bytes[name]:6.0f} "
          f"tok/s")

# %%
# exercise 7.0: minillm.course.predictions.predict_int4_tok_s

# %%
int4_bound = bandwidth / weight_bytes["int4 (Q4_1)"]
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_int4(predict_int4_tok_s, int4_bound)

# %% [markdown]
# Now measure: batch-1 greedy decode on the cached loop with the default kernels (native C GEMVs on CPU — int8 and
# int4 dequantize in registers and round the activations to int8 blocks, as llama.cpp does; Triton on CUDA).
# `profile_decode` times the decode tokens (best of its repeats) and counts the ATen ops per token.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
profiles = {name: profile_decode(types.SimpleNamespace(model=m), "cached", n_tokens=3 if FAST else 8,
                                 repeats=1 if FAST else 2)
            for name, m in models.items()}
print(f"{'scheme':12} {'MB/token':>8} {'bound':>8} {'measured':>9} {'x fp32':>7} {'GB/s':>6} {'MBU':>5}")
for name, p in profiles.items():
    gbs = weight_bytes[name] * p.tokens_per_s / 1e9
    print(f"{name:12} {weight_bytes[name] / 1e6:8.1f} {bandwidth / weight_bytes[name]:8.1f} {p.tokens_per_s:9.1f} "
          f"{p.tokens_per_s / profiles['fp32'].tokens_per_s:7.2f} {gbs:6.1f} {gbs * 1e9 / bandwidth:5.0%}")
verdict = checks.judge_prediction(my_prediction, profiles["int4 (Q4_1)"].tokens_per_s, bound=int4_bound,
                                  what="int4 (Q4_1) decode tokens/s", unit="tok/s",
                                  see="the verdict below and section 8 say where the rest goes")
for name in ("int8", "int4 (Q4_1)"):
    speedup = profiles[name].tokens_per_s / profiles["fp32"].tokens_per_s
    conclude(f"{name} decode tok/s ÷ fp32", speedup, 1, expect=">", unit="×",
             held=f"{name} is faster than fp32: fewer bytes per token",
             missed=f"{name} is not faster than fp32 here: unpacking and converting its weights costs more than the "
                    "bytes it saves on this machine")
    conclude(f"{name} speedup ÷ its byte ratio", speedup / (weight_bytes["fp32"] / weight_bytes[name]), 0.8,
             expect="<", unit="×",
             held=f"{name} falls well short of what its smaller byte count allows: unpacking and the fixed "
                  "per-token cost do not shrink with the weights (section 8)",
             missed=f"{name} comes within 20 % of its byte ratio: this machine hides the unpacking behind memory")

# %%
# NBVAL_IGNORE_OUTPUT
xs = np.arange(len(profiles))
plt.bar(xs - 0.2, [bandwidth / weight_bytes[n] for n in profiles], 0.4, color="tab:gray", label="roofline bound")
if my_prediction is not None:
    plt.plot([list(profiles).index("int4 (Q4_1)") + 0.2], [my_prediction], "r*", markersize=14,
             label="your int4 prediction")
plt.bar(xs + 0.2, [p.tokens_per_s for p in profiles.values()], 0.4, color="tab:blue", label="measured")
plt.xticks(xs, list(profiles))
plt.ylabel("batch-1 decode tok/s")
plt.title(f"Fewer bytes per token, on {device}")
plt.legend()
plt.show()

# %% [markdown]
# **The verdict** (the ▸ lines state this run's). fp32's GEMVs stream 0.5 GB per token and little else matters, so
# it has the least to lose to overheads. int8 and int4 read 4× and 5.6× fewer bytes, but their speedups need not
# follow: (1) the kernel must *unpack and convert* every weight, work a 2-core CPU only partly hides behind memory,
# and (2) every token also pays a fixed cost — thousands of small operator calls — that does not shrink with the
# weights (section 8). On a shared machine all numbers move with the neighbours' load: compare the ratios in one
# run. The GEMVs alone, over the layer stack, in GB/s of *packed* bytes against the read bandwidth measured in the
# same run — called one by one from Python ("native"), as one native loop ("stack", the engine's fused step), and,
# as the roof of that loop's own access pattern, the same bytes read in the same order with no arithmetic
# ("read-only"): 120 weights of 0.2–1 MB, each split across the cores, restart the hardware prefetchers 240 times
# where one long read starts them once. Where "stack" is close to "read-only", the arithmetic is hidden and what is
# left is how the bytes are laid out and walked:

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
if device == "cpu":
    for r in bench_quant_gemv(rows=1, layers=4 if FAST else 30, repeats=2 if FAST else 3):  # 30: ≫ the caches
        print(f"{r['scheme']:20} {r['ms']:7.2f} ms {r['MB']:7.1f} MB {r['GB/s']:6.1f} GB/s "
              f"{r['speedup_vs_fp32']:5.2f}x fp32  {r.get('pct_of_read', float('nan')):4.0f} % of read")
else:
    print("the native GEMV bench is CPU-only; on CUDA, `python -m minillm bench quant --device cuda` reports the "
          "Triton dequant GEMV")

# %% [markdown]
# ## 6. Perplexity against bits
#
# Fewer bits must not cost quality. Perplexity, exp(mean negative log-likelihood), on held-out text
# (`pydoc_data.topics`, the evaluation half) measures it. Bits per weight count the scales: int8 per channel
# ≈ 8.06, Q4_1 g32 = 5, int4 g64 = 4.5. One caveat specific to this model: its "fp32" weights *are* the
# dequantized Q4_1 blocks (the offline checkpoint is the GGUF), so int4 g32 re-quantization reproduces them
# almost exactly, and the other schemes measure the error of re-quantizing those.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
ppl_ids = heldout_token_ids(llm.tokenizer, "evaluation", 128 if FAST else 512)
window = 128 if FAST else 256


def fake_quantized(spec: QuantSpec) -> nn.Module:
    """A float copy of the model whose every linear weight went through the library's quantize and dequantize."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(getattr(mod, "weight", None), torch.Tensor) and mod.weight.dim() == 2:
            mod.weight.data = fake_quantize(mod.weight.data, spec)  # a tied head and embedding share one table
    return m


variants = {  # name: (bits per weight, model)
    "fp32": (32, model),
    "int8 per channel": (8 + 32 / config.hidden_size, models["int8"]),
    "int4 Q4_1 g32 (file)": (5.0, models["int4 (Q4_1)"]),
    "int4 g64": (4.5, quantize_model(copy.deepcopy(model), "int4", 64)),
    "int4 sym per channel": (4 + 32 / config.hidden_size, fake_quantized(QuantSpec(4, True, "channel"))),
}
ppl = {}
for name, (bits, m) in variants.items():
    ppl[name] = perplexity(m, ppl_ids, window=window, stride=window // 2).ppl
    print(f"{name:22} {bits:5.2f} bits/weight  perplexity {ppl[name]:7.3f}  ({ppl[name] / ppl['fp32'] - 1:+.2%})")

# %%
# NBVAL_IGNORE_OUTPUT
for name, (bits, _) in variants.items():
    plt.scatter(bits, ppl[name], s=60, label=f"{name}: {ppl[name]:.2f}")
plt.xscale("log", base=2)
plt.xlabel("bits per weight (scales included)")
plt.ylabel("perplexity on held-out text (lower is better)")
plt.title("Perplexity vs bits: groups keep 4 bits usable")
plt.legend(fontsize="small")
plt.show()

# %% [markdown]
# int8 per channel costs under a percent (the published result for LLM.int8() and W8A16 alike). Re-quantizing to
# Q4_1 g32 moves no weight here, because these weights already sit on that grid (the file's): whatever that row
# costs is the kernels', which on a CPU with int8 dot products round each prompt row's activations to int8 blocks
# of 32 (one scale each) before the integer dot products, as llama.cpp does. Groups of 64 do not
# contain that grid and lose visibly, and one symmetric scale per row loses far more — the outlier lesson of
# section 2 at the scale of a whole model. On an original float checkpoint g64–g128 cost a few percent (AWQ's
# Llama-2-7B g128: 5.47 → 5.60 with its calibrated scales); AWQ and GPTQ earn that by choosing scales and codes
# with calibration text.
#
# ## 7. KV capacity: quantizing the cache
#
# Weights are read once per step; the KV cache grows with every token of every sequence and sets how many fit
# (notebooks 02, 05). int8 and fp8 caches store one byte per element and one fp32 scale per (token, head):
# 2·layers·H_kv·(D + 4) bytes per token.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
budget = 1 << 30  # 1 GiB of cache
kv_formats = {"fp32": ("auto", torch.float32), "bf16": ("auto", torch.bfloat16), "int8": ("int8", torch.float32),
              "fp8 e4m3": ("fp8", torch.float32)}
print(f"SmolLM2-135M ({config.num_layers} layers, {config.num_kv_heads} KV heads of {config.head_dim}), 1 GiB:")
kv_tokens = {}
for name, (kv_dtype, model_dtype) in kv_formats.items():
    per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype, model_dtype)
    kv_tokens[name] = budget // per_token
    print(f"  {name:9} {per_token:6d} B/token -> {kv_tokens[name]:9,d} tokens")
llama_free = 80e9 - 13.5e9  # an 80 GB H100 minus Llama-2-7B's bf16 weights
for name, (kv_dtype, model_dtype) in (("bf16", ("auto", torch.bfloat16)), ("int8", ("int8", torch.bfloat16))):
    per_token = kv_bytes_per_token(32, 32, 128, kv_dtype, model_dtype)  # Llama-2-7B: 32 layers, 32 KV heads, 128
    print(f"Llama-2-7B on an H100, {name:4} cache: {per_token / 1e6:.3f} MB/token -> {llama_free / per_token:,.0f} "
          f"tokens (= {llama_free / per_token / 4096:.0f} sequences of 4096)")

# %%
# NBVAL_IGNORE_OUTPUT
k = torch.randn(256, config.num_kv_heads, config.head_dim)
k[..., :4] *= 8  # a few outlier channels, as real keys have
int8_codes, int8_scales = quantize_kv_int8(k)
errs = {"int8": error_stats(k, dequantize_kv(int8_codes, int8_scales))}
if hasattr(torch, "float8_e4m3fn"):
    errs["fp8 e4m3"] = error_stats(k, dequantize_kv(*quantize_kv_fp8(k)))
print(", ".join(f"{name} KV: SQNR {e.sqnr_db:.1f} dB" for name, e in errs.items()))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
ax1.bar(list(kv_tokens), [v / 1e6 for v in kv_tokens.values()], color="tab:green", label="SmolLM2-135M, 1 GiB")
ax1.set(ylabel="million tokens in the budget", title="KV tokens per GiB")
ax1.legend()
ax2.bar(list(errs), [e.sqnr_db for e in errs.values()], color="tab:purple", label="keys with outlier channels")
ax2.set(ylabel="SQNR (dB)", title="Per-(token, head) scales")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# int8 keeps ≈ 4× the tokens of fp32 (≈ 2× bf16) at close to 40 dB SQNR — as accurate as int8 weights; fp8 e4m3
# (3 mantissa bits, but a floating grid that follows each value's magnitude) gives up a few dB for a format GPUs
# multiply natively (H100, MI300). For a 7B model serving long contexts the cache, not the
# weights, is most of the memory: halving it doubles the batch that fits, and with it the throughput (notebook 06).
#
# ## 8. Where the time goes once the weights are small
#
# Section 5's profiles also counted operators. Subtract the time the bytes need at the measured bandwidth from each
# token's time: what is left is the fixed cost of running a token — Python, ATen dispatch, small tensors, sampling.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
print(f"{'scheme':12} {'ms/token':>9} {'bytes at roof':>14} {'the rest':>9} {'ATen ops/token':>15}")
split = {}
for name, p in profiles.items():
    bytes_ms = weight_bytes[name] / bandwidth * 1e3
    split[name] = (bytes_ms, max(p.ms_per_token - bytes_ms, 0.0))
    print(f"{name:12} {p.ms_per_token:9.2f} {bytes_ms:11.2f} ms {split[name][1]:6.2f} ms {p.aten_ops_per_token:15.0f}")
print("most frequent ops per int4 token:",
      ", ".join(f"{n.removeprefix('aten::')} {c:.0f}" for n, c in profiles["int4 (Q4_1)"].top_ops[:6]))
names = list(split)
plt.barh(names, [split[n][0] for n in names], color="tab:blue", label="weight bytes at the measured bandwidth")
plt.barh(names, [split[n][1] for n in names], left=[split[n][0] for n in names], color="tab:orange",
         label="everything else (kernels' arithmetic, ops, Python)")
plt.xlabel("ms per decode token")
plt.title("Once the weights are small, the rest is the roof")
plt.legend(fontsize="small")
plt.show()

# %% [markdown]
# And one decode step of the int4 model under `torch.profiler`, by self time: the native GEMVs run inside the
# `QuantLinear` calls, everything else is the per-token overhead a fused decode layer or a compiled step removes.

# %%
# NBVAL_IGNORE_OUTPUT
m4 = models["int4 (Q4_1)"]
generate(m4, [prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    generate(m4, [prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40))

# %% [markdown]
# The profile is the new roof: at int4 a token moves ~100 MB, and the table above shows the rest of the token
# costing several times what those bytes need — more operators per token than fp32, not fewer (each quantized
# linear adds its own views and allocations around the native call). That is why llama.cpp, written as one C loop per
# layer with no dispatcher,
# gets so much more out of the same bytes, and why GPU engines capture the decode step in a CUDA graph.
#
# minillm's engine does the same on a CPU: for a decode step it runs every layer and the LM head in **one native
# call** (`minillm/engine/native_runner.py` driving `csrc/decode.c`: the same GEMV, norm, RoPE and paged-attention
# kernels as above, in the same order, so the logits are bit for bit those of the per-layer path). `LLM(...,
# quantization="int4")` loads the GGUF's own Q4_1 blocks, and `LLM.stream` takes the engine's path — paged KV, the
# scheduler, the fused step. Same profile, through the engine:

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
engines = {"fp32": llm, "int4 (Q4_1)": LLM(device=device, dtype="float32", quantization="int4")}
engine_profiles = {name: profile_decode(e, "engine", n_tokens=4 if FAST else 32, repeats=1 if FAST else 3)
                   for name, e in engines.items()}
print(f"{'scheme':12} {'path':22} {'ms/token':>9} {'tok/s':>7} {'bytes at roof':>14} {'ATen ops/token':>15}")
for name, p in engine_profiles.items():
    for label, q in (("per layer (section 5)", profiles[name]), ("engine, fused step", p)):
        print(f"{name:12} {label:22} {q.ms_per_token:9.2f} {q.tokens_per_s:7.1f} "
              f"{weight_bytes[name] / bandwidth * 1e3:11.2f} ms {q.aten_ops_per_token:15.0f}")

# %% [markdown]
# On a CPU the ATen ops per token drop from thousands to a few dozen (the sampler's), and the int4 token moves
# toward its bytes: what is left above the roof is the kernels' own work — unpacking nibbles and applying a scale
# and a minimum per 32 weights, and walking 120 separate weights in short streams (the section 5 table's "stack"
# against its "read-only" row) — plus attention, norms and the sampler.
# (On a GPU the engine's path is the CUDA-graph decode step instead.)
#
# ## 9. llama.cpp on the same file
#
# llama.cpp runs this very GGUF (it also rounds the activations to 8 bits and uses integer dot products). When
# `llama-cpp-python` is installed (`pip install "minillm[bench]"`, built from source) this cell measures it next to
# minillm; otherwise it prints the figure recorded for this course.

# %%
# NBVAL_IGNORE_OUTPUT
if importlib.util.find_spec("llama_cpp") is not None:
    from llama_cpp import Llama

    peer = Llama(model_path=str(default_model_path()), n_ctx=512, n_threads=torch.get_num_threads(), verbose=False)
    stamps = [time.perf_counter() for _ in peer.create_completion(prompt, max_tokens=16 if FAST else 64,
                                                                  temperature=0.0, stream=True)]
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    ours = engine_profiles["int4 (Q4_1)"].tokens_per_s
    print(f"llama.cpp on the same Q4_1 file: {rate:.1f} tok/s; minillm int4 through its engine here: {ours:.1f} "
          f"tok/s ({ours / rate:.2f}×)")
else:
    print("llama_cpp is not installed here. Recorded figures (BENCHMARKS.md, 2-core AMD EPYC with AVX-512 VNNI, "
          "2 threads, the same GGUF, batch 1, one run): llama-cpp-python 0.3.36 built from source 111 tok/s; "
          "minillm int4 through its engine 203 tok/s (1.83×), fp32 52.7 tok/s. Before the fused decode step "
          "(an earlier AVX2 host): llama.cpp 136 tok/s, 5.4× minillm fp32 (25.1 tok/s).")

# %% [markdown]
# ## Takeaways
#
# - **A format is range × precision × bytes.** Integers need scales; the scale's granularity decides what an
#   outlier costs — per tensor, one outlier zeroes almost every 4-bit code; per group of 32 it touches 32 weights.
# - **Q4_1** is asymmetric int4 in groups of 32 (fp16 d and m, 5 bits per weight, nibbles paired j / j + 16): your
#   packer reproduced llama.cpp's bytes, and your GEMV ran the model to the same tokens.
# - **Weight-only quantization speeds up memory-bound decode**, by less than the byte ratio: unpacking costs
#   arithmetic, and the per-token overhead does not shrink. gpt-fast's A100 numbers (bf16 105 → int8 156 → int4
#   197 tok/s) show the same sub-linear gain; prefill, compute bound, gains nothing.
# - **Quality**: int8 per channel is free; int4 needs groups (and AWQ/GPTQ at g128) — measure perplexity on
#   held-out text, never on the calibration text.
# - **KV cache**: int8/fp8 hold ≈ 2× the tokens of bf16 (the scales cost 4 bytes per token and head) — more
#   sequences per GPU.
# - Once the weights are small, **the overhead is the roof**: profile it, then fuse or compile the decode step
#   (minillm's fused CPU step: from ~2,000 ATen ops per int4 token to a few dozen).

# %% [markdown]
# ## 10. Quantizing the activations too: W8A8, SmoothQuant, FP8
#
# Every scheme so far rounds the **weights** only: the matmul still multiplies floats (W8A16, W4A16), so it saves
# bytes — what a batch-1 decode is bound by — and no arithmetic. Prefill and large decode batches are bound by
# arithmetic instead (notebook 00: a linear's intensity grows with its rows M). There the win is an **integer
# matmul**: round the activations to int8 as well, multiply int8 × int8 into int32 sums (AVX-512 VNNI and AMX on
# CPUs, int8 tensor cores on GPUs, 2× the bf16 rate on an H100), and apply the two scales once per output:
#
# $$y_{mn} = s^x_m \, s^w_n \sum_k q^x_{mk} \, q^w_{nk}$$
#
# with one scale per **token** $m$ for the activations (computed at each call: *dynamic*, or calibrated once per
# tensor: *static*) and one per **output channel** $n$ for the weights.
#
# The catch is the activations' **outlier channels**: in LLMs a few hidden dimensions carry values far above the
# rest in almost every token, so one per-token scale spends its 255 levels on them and rounds the other channels
# to a few levels. **SmoothQuant** moves that difficulty into the weights, which have no such channels: for any
# $s_j > 0$, $x W^\top = (x / s)(W \operatorname{diag}(s))^\top$, with
#
# $$s_j = \frac{\max|X_j|^{\alpha}}{\max|W_j|^{1-\alpha}}$$
#
# measured on calibration text ($\alpha = 0.5$ splits the range evenly). The $1/s$ costs nothing at run time: it
# is folded into the RMSNorm weight that produces $x$.
#
# First the statistics: per decoder linear, how far the largest input channel stands above the median one.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.perf.bench.quant import decode_rate
from minillm.perf.hardware import get_spec
from minillm.quant.activation import fp8_supported
from minillm.quant.calibrate import calibration_token_ids
from minillm.quant.smooth import (
    SMOOTH_FLOOR,  # noqa: F401  (used by your smoothing_factors)
    activation_absmax,
    check_alpha,  # noqa: F401  (used by your smoothing_factors)
    outlier_ratios,
    quantize_model_w8a8,
    smooth_model,
)

calib_ids = calibration_token_ids(llm.tokenizer, *((2, 64) if FAST else (8, 256))).to(device)
stats = activation_absmax(model, calib_ids)  # {linear: max |x_j| over the calibration tokens, per channel [K]}
before = outlier_ratios(stats)
alpha = 0.5  # SmoothQuant's default migration strength
library = quantize_model_w8a8(copy.deepcopy(model), "w8a8-smooth", alpha=alpha, act_absmax=stats)  # the reference
kinds = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
for kind in kinds:
    r = [before[f"model.layers.{i}.{kind}"] for i in range(config.num_layers)]
    print(f"{kind:20} max/median over channels: median layer {np.median(r):6.1f}, worst {max(r):6.1f} "
          f"(layer {int(np.argmax(r))})")

# %% [markdown]
# ### Exercise 7.4 — `smoothing_factors`
#
# Per input channel $j$: $\max|X_j|$ is given (`act_absmax`, over the calibration tokens), $\max|W_j|$ is the
# largest $|W_{nj}|$ over the weight's rows. Floor both at 1e-5 (a channel that never fired must not divide by
# zero), then return $s_j$. After smoothing at $\alpha = 0.5$ the activation's range $\max|X_j| / s_j$ and the
# weight's $\max|W_j| \cdot s_j$ are equal, channel by channel.

# %%
# exercise 7.4: minillm.quant.smooth.smoothing_factors

# %%
checks.check_smoothing_factors(smoothing_factors)

# %% [markdown]
# ### Exercise 7.5 — `fold_into_norm`
#
# The layer computes `linear(rms_norm(h) · g)`. Divide the norm's weight $g$ by $s$ and multiply the linear's
# columns by $s$, in place: the product is unchanged, and the linear now receives $x / s$. (The library does the
# same for `down_proj`, whose input is $\mathrm{silu}(gate) \cdot up$: it divides the *up* rows by $s$. It leaves
# `o_proj` alone, as SmoothQuant does for Llama: with grouped K/V heads one V channel feeds several query heads.)

# %%
# exercise 7.5: minillm.quant.smooth.fold_into_norm

# %%
checks.check_fold_into_norm(fold_into_norm)

# %% [markdown]
# ### The engine runs your smoothed model
#
# Your two functions smooth a copy of the model (`smooth_model` calls them for every layer), then its linears
# become `W8A8Linear`s: int8 weights per channel, int8 activations per token, `torch._int_mm` integer GEMMs.
# The library's own `quantization="w8a8-smooth"` path must give the same tokens.

# %%
yours = copy.deepcopy(model)
smoothed_stats = smooth_model(yours, stats, alpha, factors=smoothing_factors, fold=fold_into_norm)
yours = quantize_model_w8a8(yours, "w8a8")  # already smoothed: dynamic per-token int8 from here
greedy = SamplingParams(max_tokens=4 if FAST else 12, temperature=0.0, ignore_eos=True)
prompt_ids = llm.tokenizer("The three laws of thermodynamics are")["input_ids"]
outs = [LLMEngine(m, llm.tokenizer, EngineConfig()).generate([prompt_ids], greedy)[0].outputs[0].text
        for m in (yours, library)]
print(f"your smoothed W8A8 model: {outs[0]!r}\nthe library's:            {outs[1]!r}")
assert outs[0] == outs[1], "your smoothing differs from the library's: recheck 7.4 / 7.5"
after = outlier_ratios(smoothed_stats)
qkv_names = [f"model.layers.{i}.self_attn.qkv_proj" for i in range(config.num_layers)]
print(f"qkv_proj inputs, max/median over channels, median layer: {np.median([before[n] for n in qkv_names]):.1f} "
      f"before smoothing, {np.median([after[n] for n in qkv_names]):.1f} after")

# %% [markdown]
# ### Predict from the roofline: where does W8A8 beat weight-only int8?
#
# Both store the same int8 weights, so at small M (decode at batch 1) both read the same bytes and take the same
# time. W8A8 wins only where the matmul is **compute bound**: its integer units (twice bf16's rate on an H100;
# on a CPU, VNNI's int8 dot products against fp32 FMAs) then finish sooner. The model below is the roofline —
# time = max(FLOPs / peak, bytes / bandwidth) — for SmolLM2's gate_up projection (K 576, N 3072), with this
# machine's measured fp32 peak and an int8 GEMM rate measured now, and with the H100's datasheet numbers.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
n = 256 if FAST else 1024
a8, b8 = (torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device) for _ in range(2))
torch._int_mm(a8, b8)
t0 = time.perf_counter()
for _ in range(3):
    torch._int_mm(a8, b8)
if device == "cuda":
    torch.cuda.synchronize()
int8_rate_here = 3 * 2 * n**3 / (time.perf_counter() - t0)
float_name = "float32" if device == "cpu" else "bfloat16"
machines = {"this machine": (spec.peak(float_name), int8_rate_here, bandwidth, 4 if device == "cpu" else 2),
            "H100-SXM": (get_spec("H100-SXM").peak("bfloat16"), get_spec("H100-SXM").peak("int8"),
                         get_spec("H100-SXM").memory_bandwidth, 2)}
K_, N_ = config.hidden_size, 2 * config.intermediate_size
Ms = np.unique(np.logspace(0, 12, 49, base=2).astype(int))
first_win = {}
for name, (peak_float, peak_int8, bw, act_bytes) in machines.items():
    w8a16 = [max(2 * M * K_ * N_ / peak_float, (K_ * N_ + (M * K_ + M * N_) * act_bytes) / bw) for M in Ms]
    w8a8 = [max(2 * M * K_ * N_ / peak_int8, (K_ * N_ + M * K_ + M * N_ * act_bytes) / bw) for M in Ms]
    speedup = np.array(w8a16) / np.array(w8a8)
    first_win[name] = next((int(M) for M, s in zip(Ms, speedup, strict=True) if s >= 1.2), None)
    versus = float_name if name == "this machine" else "bfloat16"
    plt.plot(Ms, speedup, marker=".", label=f"{name}: int8 {peak_int8 / 1e12:.2f} vs {versus} "
                                             f"{peak_float / 1e12:.2f} T/s")
    print(f"{name}: W8A8 predicted ≥ 1.2× weight-only int8 from M = {first_win[name]} rows (int8 / "
          f"{versus} peak {peak_int8 / peak_float:.2f}×, ridge {peak_float / bw:.0f} FLOP/byte)")
plt.xscale("log", base=2)
plt.xlabel("rows M (tokens in the step: batch × new tokens)")
plt.ylabel("predicted W8A16 time / W8A8 time")
plt.title("W8A8 pays where the linear is compute bound")
plt.legend(fontsize="small")
plt.show()

# %% [markdown]
# ### Measure: prefill and batch-32 decode
#
# Now the engine itself on this machine: prefill throughput on a long prompt (M = its length) and decode at
# batch 32 (M = 32), for fp32, weight-only int8 and W8A8 (dynamic, and smoothed). On a CPU whose int8 dot
# products are fast the W8A8 prefill should beat fp32; at batch 1 W8A8 is no better than weight-only (the same
# bytes, plus the cost of rounding each activation row).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
prefill_len, batch, steps = (64, 4, 2) if FAST else (512, 32, 8)
gen = torch.Generator().manual_seed(0)
long_prompt = torch.randint(100, config.vocab_size, (prefill_len,), generator=gen).tolist()
batch_prompts = [torch.randint(100, config.vocab_size, (16,), generator=gen).tolist() for _ in range(batch)]
contenders = {"fp32": model, "int8 weight-only": models["int8"],
              "w8a8": quantize_model_w8a8(copy.deepcopy(model), "w8a8"), "w8a8-smooth": library}
speed = {}
for name, m in contenders.items():
    decode_rate(m, batch_prompts[:1], 2)  # warm-up
    ttft = min(decode_rate(m, [long_prompt], 1)[0] for _ in range(1 if FAST else 2))
    rate = max(decode_rate(m, batch_prompts, steps)[1] for _ in range(1 if FAST else 2))
    speed[name] = (prefill_len / ttft, rate)
    print(f"{name:17} prefill {prefill_len} tokens: {prefill_len / ttft:7.0f} tok/s   decode at batch {batch}: "
          f"{rate:7.1f} tok/s")
base_prefill, base_decode = speed["fp32"]
print(f"w8a8 vs fp32: prefill {speed['w8a8'][0] / base_prefill:.2f}×, batch-{batch} decode "
      f"{speed['w8a8'][1] / base_decode:.2f}×; vs weight-only int8: prefill "
      f"{speed['w8a8'][0] / speed['int8 weight-only'][0]:.2f}×, decode "
      f"{speed['w8a8'][1] / speed['int8 weight-only'][1]:.2f}×")

# %% [markdown]
# ### Perplexity against α
#
# Smoothing trades activation error for weight error: α = 0 leaves the activations as they are (and scales the
# weights by $1/\max|W_j|$), α = 1 moves the whole activation range into the weights. The curve below is measured
# on the same held-out tokens as section 6; the horizontal lines are fp32, weight-only int8 and plain W8A8
# (dynamic and static).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
alphas = (0.0, 0.5, 1.0) if FAST else (0.0, 0.25, 0.5, 0.8, 1.0)
ppl_alpha = {}
for a in alphas:
    m = quantize_model_w8a8(copy.deepcopy(model), "w8a8-smooth", alpha=a, act_absmax=stats)
    ppl_alpha[a] = perplexity(m, ppl_ids, window=window, stride=window // 2).ppl
for name in ("w8a8", "w8a8-static"):
    m = quantize_model_w8a8(copy.deepcopy(model), name, act_absmax=stats)
    ppl[name] = perplexity(m, ppl_ids, window=window, stride=window // 2).ppl
plt.plot(list(ppl_alpha), list(ppl_alpha.values()), marker="o", label="w8a8-smooth")
for name, style in (("fp32", "-"), ("int8 per channel", "--"), ("w8a8", ":"), ("w8a8-static", "-.")):
    plt.axhline(ppl[name], linestyle=style, color="gray", label=f"{name}: {ppl[name]:.2f}")
plt.xlabel("SmoothQuant α")
plt.ylabel("perplexity on held-out text")
plt.title("Perplexity vs α")
plt.legend(fontsize="small")
plt.show()
best = min(ppl_alpha, key=ppl_alpha.get)
print(f"best α here: {best} (perplexity {ppl_alpha[best]:.3f}, {ppl_alpha[best] / ppl['fp32'] - 1:+.2%} vs fp32); "
      f"plain w8a8 {ppl['w8a8'] / ppl['fp32'] - 1:+.2%}, static {ppl['w8a8-static'] / ppl['fp32'] - 1:+.2%}, "
      f"weight-only int8 {ppl['int8 per channel'] / ppl['fp32'] - 1:+.2%}")
worst = max(before, key=before.get)
print(f"smoothing at α {best} {'beats' if ppl_alpha[best] < ppl['w8a8'] else 'does not beat'} plain w8a8 on this "
      f"model; its largest outlier ratio, {before[worst]:.0f}, is at {worst.removeprefix('model.')}'s input, "
      f"{before[worst] / np.median(list(before.values())):.0f}× the median linear's")

# %% [markdown]
# ### FP8
#
# FP8 (e4m3: 4 exponent bits, 3 mantissa bits, largest 448) is a *float*: its relative error is the same for large
# and small values, so an outlier channel costs far less than with int8's evenly spaced levels — often no
# smoothing is needed. Only GPUs of compute capability ≥ 8.9 (Ada, Hopper) multiply it natively
# (`torch._scaled_mm`); `LLM(quantization="fp8")` refuses anything else and says what to use instead.

# %%
# NBVAL_IGNORE_OUTPUT
why_not = fp8_supported(device)
if why_not is None:
    fp8_model = quantize_model_w8a8(copy.deepcopy(model), "fp8")
    ppl["fp8"] = perplexity(fp8_model, ppl_ids, window=window, stride=window // 2).ppl
    ttft = decode_rate(fp8_model, [long_prompt], 1)[0]
    print(f"fp8: perplexity {ppl['fp8']:.3f} ({ppl['fp8'] / ppl['fp32'] - 1:+.2%} vs fp32), prefill "
          f"{prefill_len / ttft:.0f} tok/s ({prefill_len / ttft / speed['fp32'][0]:.2f}× the {float_name} model)")
else:
    h100 = get_spec("H100-SXM")
    print(f"No fp8 here: {why_not}.\nOn an H100 the datasheet gives fp8 {h100.peak('float8') / 1e12:.0f} TFLOP/s "
          f"against bf16 {h100.peak('bfloat16') / 1e12:.0f}: {h100.peak('float8') / h100.peak('bfloat16'):.0f}× "
          "for compute-bound prefill, and half of bf16's weight bytes for decode.")

# %% [markdown]
# ### Takeaways: activation quantization
#
# - **W8A8 buys arithmetic, weight-only buys bytes.** With the same int8 weights they tie at batch 1; W8A8 pulls
#   ahead only where the linear is compute bound (long prefills, large batches), by up to the int8 / float peak
#   ratio of the machine.
# - **Activations have outlier channels, weights don't.** SmoothQuant's $s_j$ moves range from one to the other,
#   folded into the norm at no run-time cost; α sets the split and is tuned on calibration text.
# - **Dynamic per-token scales** adapt to every token (one extra pass over x); **static** ones are free at run time
#   but clip whatever the calibration text never showed.
# - **FP8** sidesteps much of the outlier problem with a float grid, on GPUs that have it.
