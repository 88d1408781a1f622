# %% [markdown]
# # 00 — The roofline and the machine
#
# Generating one token means reading **every weight of the model** from memory, and doing only two FLOPs (a
# multiply and an add) with each one. In bf16 that is 1 FLOP per byte read. An H100 SXM can do 989 TFLOP/s but
# read only 3.35 TB/s: to keep its arithmetic units busy, every byte it reads would have to feed ~295 FLOPs. At
# 1 FLOP per byte, decoding uses about 0.3 % of the chip's arithmetic and spends the rest of the time waiting for
# memory. **Decode is memory bound**, and that one fact explains most of this course: the KV cache, GQA, paging,
# batching, quantization and speculative decoding all either read fewer bytes or do more work per byte read.
#
# The **roofline** model (Williams, Waterman & Patterson, 2009) makes this quantitative with two numbers per
# machine, its peak FLOP/s and its memory bandwidth, and one number per piece of work, its **arithmetic intensity**:
#
# - intensity I = FLOPs ÷ bytes moved (FLOP/byte);
# - attainable FLOP/s = min(peak FLOP/s, I × bandwidth);
# - the **ridge point** = peak ÷ bandwidth: work left of it is memory bound, right of it compute bound.
#
# **In this notebook** you measure this machine's roofs, write the cost model of a linear layer (exercise 0.1) and
# the roofline itself (0.2), use them to predict how long a decode step's matrix–vector products take, write the
# probe that measures this machine's read bandwidth (0.3) and check the prediction against a measurement under
# your own roof, define model bandwidth utilisation (0.4) and spot a textbook's arithmetic slip, then place every
# measurement on the roofline and explore other machines with sliders.
# Runs in about a minute on a 2-core CPU; on a GPU it uses the GPU.

# %%
from __future__ import annotations

import math
import os
import random
import re
import statistics
import time

import matplotlib.pyplot as plt
import torch

from minillm import LLM, SamplingParams
from minillm.course import checks
from minillm.course.predictions import predict_gemv_gb_s
from minillm.kernels.cpu import native
from minillm.models.loader import choose_dtype
from minillm.perf import metrics, roofline
from minillm.perf.hardware import (
    DECODE_GEMV_SHAPES,
    dtype_bytes,  # used by the exercises' code
)
from minillm.perf.roofline import Cost, check_sizes, positive_rate, ridge_point

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})  # readable figures: ≥ 110 dpi

device = "cuda" if torch.cuda.is_available() else "cpu"
choice = choose_dtype(device)  # what the engine computes in here: fp32 on CPU; bf16 on a GPU that has it, else fp16
dtype = roofline.dtype_name(choice.dtype)
print(f"device {device}, dtype {choice}; torch {torch.__version__}")

# %% [markdown]
# ## 1. Two numbers per machine
#
# The datasheet figures of the GPUs this course refers to. They are **dense** figures: datasheets also print
# "with sparsity" numbers, twice as large, which need weights pruned to a 2:4 pattern. The T4 (Colab's free GPU)
# predates bf16, so its 16-bit figure is fp16. The ridge column is peak ÷ bandwidth: how many FLOPs a kernel must
# do per byte it moves before the arithmetic, not the memory, becomes the limit.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
print(roofline.format_specs())

# %% [markdown]
# ## 2. Measure this machine
#
# Datasheets give upper limits; real kernels reach less (a large copy typically 85–95 % of the datasheet
# bandwidth), and a CPU has no datasheet figure we could trust at all. A roofline drawn from **measured** peaks is
# an honest one: a point on it is as fast as this machine goes. `measure_device()` runs four probes:
#
# - **read**: a sum over a buffer far larger than the last-level cache (bytes read ÷ time);
# - **copy**: `dst.copy_(src)`, counted as read + write;
# - **GEMV**: the matrix–vector products of one decode step of SmolLM2-135M (30 layers × 4 weight matrices),
#   through PyTorch and, on CPU, minillm's native kernel — the weight bytes streamed per second;
# - **matmul**: a large n×n @ n×n product per dtype, 2n³ FLOPs ÷ time: the compute roof.
#
# The bandwidth roof is the best of the read and GEMV probes, so no measured point can sit above it.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
print(roofline.format_measurement(spec))


def datasheet_for(name: str) -> roofline.HardwareSpec | None:
    """The reference spec a GPU's name points to ("NVIDIA A100-SXM4-80GB" → A100-80GB), or None (e.g. a CPU)."""
    words = set(re.split(r"[^A-Z0-9]+", name.upper()))
    if "H100" in words:
        return roofline.get_spec("H100-PCIe" if "PCIE" in words else "H100-SXM")
    if "A100" in words:
        return roofline.get_spec("A100-80GB" if "80GB" in words else "A100-40GB")
    return next((roofline.get_spec(k) for k in ("H200", "L4", "T4") if k in words), None)


datasheet = datasheet_for(spec.name) if device == "cuda" else None
if datasheet is None:
    print("\nno datasheet to compare with: the measured figures are this machine's roofs")
else:
    print(f"\n{datasheet.name} datasheet: read reached {spec.read_bandwidth / datasheet.memory_bandwidth:.0%} of "
          f"{datasheet.memory_bandwidth / 1e12:.3g} TB/s" + "".join(
              f"; {dt} matmul {spec.peak(dt) / datasheet.peak(dt):.0%} of {datasheet.peak(dt) / 1e12:.4g} TFLOP/s"
              for dt in spec.peak_flops if dt in datasheet.peak_flops))

# %%
# NBVAL_IGNORE_OUTPUT
short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "tf32": "tf32"}
bandwidths = {f"read ({impl})": v for impl, v in spec.read_by_impl.items()}
bandwidths["copy (read + write)"] = spec.copy_bandwidth
bandwidths.update({f"GEMV {short[dt]} ({impl})": v for impl, per_dtype in spec.gemv_bandwidth.items()
                   for dt, v in per_dtype.items()})
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
ax1.barh(list(bandwidths), [v / 1e9 for v in bandwidths.values()], color="tab:blue")
ax1.axvline(spec.memory_bandwidth / 1e9, color="black", linestyle="--", label="the roof used below")
if datasheet is not None:
    ax1.axvline(datasheet.memory_bandwidth / 1e9, color="tab:red", linestyle=":", label=f"{datasheet.name} datasheet")
ax1.invert_yaxis()
ax1.set(xlabel="GB/s", title="Memory bandwidth")
ax1.legend(loc="lower right", fontsize="small")
ax2.bar([short[dt] for dt in spec.peak_flops], [v / 1e9 for v in spec.peak_flops.values()], color="tab:orange")
ax2.set(ylabel="GFLOP/s", title=f"matmul {spec.method['matmul_n']}³")
fig.suptitle(spec.name)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Predict: what a linear layer costs
#
# Almost all of a transformer's FLOPs are linear layers: activations `x [M × K]` times a weight `W [K × N]`.
# Each of the M·N outputs is a dot product of length K: a multiply and an add per term, so **2·M·K·N FLOPs**. The
# bytes moved are at least the weight (K·N elements), the input (M·K) and the output (M·N), once each. So
#
# intensity = 2·M·K·N ÷ (b · (K·N + M·K + M·N)) → 2M ÷ b when M ≪ K, N,
#
# with b bytes per element: **about M FLOP/byte in a 16-bit dtype**. M is the number of tokens pushed through the
# layer together: the batch size in decode, the prompt length (× batch) in prefill.
#
# ### Exercise 0.1 — FLOPs and bytes of a linear layer
#
# Write `linear_cost(M, K, N, dtype, weight_dtype=None, bias=False)`. It returns a `Cost(flops, bytes, breakdown,
# flops_breakdown)`: `breakdown` splits the bytes into `"weights"` (W, and the bias if any) and `"activations"`
# (x read, y written); `flops_breakdown` is `{"linear": flops}`. `dtype_bytes(d)` gives a dtype's size in bytes
# (and passes a number through: quantized weights may cost 0.5625 bytes per element). A bias adds N weights and
# M·N additions.

# %%
# exercise 0.1: minillm.perf.roofline.linear_cost

# %%
# NBVAL_CHECK_OUTPUT
checks.check_linear_cost(linear_cost)

# %% [markdown]
# A 4096 × 4096 projection of a 7B model, in bf16, for growing M. The weights dominate the bytes until M reaches
# the hundreds; the intensity tracks M until then, and crosses an H100's ridge (295) between 256 and 512 tokens.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
h100 = roofline.get_spec("H100-SXM")
for M in (1, 8, 64, 256, 512, 4096):
    c = linear_cost(M, 4096, 4096, "bfloat16")
    side = "memory" if c.intensity < roofline.ridge_point(h100, "bfloat16") else "compute"
    print(f"M = {M:4d}: {c.flops / 1e9:7.2f} GFLOP {c.bytes / 1e6:6.1f} MB ({c.breakdown['weights'] / c.bytes:4.0%} "
          f"weights), intensity {c.intensity:6.1f} FLOP/B -> {side} bound on an H100")

# %% [markdown]
# ## 4. The roofline
#
# A piece of work of intensity I (FLOP per byte moved) gets its bytes at the memory's rate, and each byte feeds
# I FLOPs; the arithmetic units have a ceiling of their own, per dtype (`spec.peak(dtype)`, in FLOP/s;
# `spec.memory_bandwidth` in bytes/s). The intensity where the two limits meet is the **ridge point**
# (`ridge_point(spec, dtype)`, imported from the library).
#
# ### Exercise 0.2 — the roofline
#
# Write `attainable_flops(spec, intensity, dtype)`: the most FLOP/s that work of that intensity can reach on
# `spec`. It takes one intensity (and returns a float) or a whole sequence of them — a list, a tuple, a numpy array
# or a tensor — and returns a list, one value per intensity, in order: the plots below draw every machine's roof
# through it, and so does the library's `plot_roofline`. Reject an intensity that is negative or not a number
# with a `ValueError`.

# %%
# exercise 0.2: minillm.perf.roofline.attainable_flops

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - Try to iterate over `intensity` and catch the `TypeError` that a plain number (or a 0-d tensor) raises:
#   that tells the two calling forms apart without listing every sequence type.
# - `float(x)` turns a numpy scalar or a one-element tensor into a Python number; `not x >= 0` is true for a
#   negative number and for NaN alike.
# - Below the ridge memory is the limit, above it the arithmetic: which of the two products is smaller?
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_attainable_flops(attainable_flops)

# %% [markdown]
# What a batch-1 decode step (intensity ≈ 1 FLOP/byte in 16-bit weights) can get out of each GPU: the faster the
# chip's arithmetic relative to its memory, the smaller the fraction.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
print(f"{'':12}{'ridge':>8}   at intensity 1 (batch-1 decode)")
for name, s in roofline.SPECS.items():
    half = "bfloat16" if "bfloat16" in s.peak_flops else "float16"
    at_1 = attainable_flops(s, 1.0, half)
    print(f"{name:12}{ridge_point(s, half):8.0f}   {at_1 / 1e12:5.2f} TFLOP/s = {at_1 / s.peak(half):6.2%} of the "
          f"{short[half]} peak")

# %% [markdown]
# The reference GPUs and this machine on one chart (log–log, so both roofs are straight lines). Every roof rises
# along its bandwidth until its ridge (the dot), then stays flat at its peak. Batch-1 decode sits at the left
# line, a 512-token prefill at the right one.

# %%
# NBVAL_IGNORE_OUTPUT
machines = [(roofline.get_spec(n), "float16" if n == "T4" else "bfloat16")  # the T4 has no bf16
            for n in ("H100-SXM", "A100-80GB", "L4", "T4")] + [(spec, dtype)]
intensities = [2 ** (k / 4) for k in range(-16, 57)]  # 1/16 … 16 384 FLOP/byte
fig, ax = plt.subplots(figsize=(8, 5))
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="attainable FLOP/s",
       title="Rooflines: reference GPUs and this machine")
for s, dt in machines:
    mine = s is spec
    line, = ax.plot(intensities, attainable_flops(s, intensities, dt), linewidth=2.5 if mine else 1.5,
                    linestyle="--" if mine else "-",
                    label=f"{'this machine' if mine else s.name} ({short[dt]}): ridge {ridge_point(s, dt):.3g} FLOP/B")
    ax.plot(ridge_point(s, dt), s.peak(dt), "o", color=line.get_color())
for x, text in ((1, "batch-1 decode"), (512, "prefill, 512 tokens")):
    ax.axvline(x, color="grey", linestyle=":")
    ax.annotate(text, (x, ax.get_ylim()[0]), textcoords="offset points", xytext=(4, 6), color="grey")
ax.legend(fontsize="small", loc="upper left")
plt.show()

# %% [markdown]
# ## 5. Predict, then measure: a decode step's GEMVs
#
# One decode step of SmolLM2-135M (the course's default model) at batch B multiplies B activation rows by the four
# weight matrices of each of its 30 layers: q/k/v (576 → 960), o (576 → 576), gate/up (576 → 3072) and down
# (1536 → 576). **Predict** the time of one pass over that stack on this machine with your functions: its FLOPs
# divided by the FLOP/s attainable at its intensity — the same as max(FLOPs ÷ peak, bytes ÷ bandwidth).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
layers = 8 if FAST else 30
batches = [1, 8, 64] if FAST else [1, 2, 4, 8, 16, 32, 64]


def gemv_stack_cost(batch: int) -> Cost:
    """FLOPs and bytes of one pass over ``layers`` layers of the stack at ``batch`` rows, from your linear_cost."""
    per_layer = [linear_cost(batch, K, N, dtype) for N, K in DECODE_GEMV_SHAPES]  # weights are stored [N, K]
    return layers * sum(per_layer[1:], per_layer[0])


def predicted_seconds(batch: int) -> float:
    """The roofline's lower bound on one pass: FLOPs ÷ the FLOP/s attainable at the stack's intensity."""
    cost = gemv_stack_cost(batch)
    return cost.flops / attainable_flops(spec, cost.intensity, dtype)


for B in batches:
    c = gemv_stack_cost(B)
    side = "memory" if c.intensity < ridge_point(spec, dtype) else "compute"
    print(f"batch {B:3d}: {c.bytes / 1e6:6.1f} MB, {c.flops / 1e9:6.2f} GFLOP, intensity {c.intensity:6.2f} FLOP/B "
          f"-> predicted ≥ {predicted_seconds(B) * 1e3:7.2f} ms ({side} bound)")

# %% [markdown]
# ### Your prediction
#
# The roofline says how fast the stack *could* stream its weights. Plain PyTorch at batch 1 calls `F.linear`
# 120 times in a row: how many GB/s of weights do you expect it to reach on this machine? Write your number (or
# a formula from the roof) before the next cell measures it.

# %%
# exercise 0.0: minillm.course.predictions.predict_gemv_gb_s

# %%
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_gemv(predict_gemv_gb_s, spec.memory_bandwidth / 1e9)

# %% [markdown]
# ### Exercise 0.3 — the read-bandwidth probe
#
# The bound above used the cached roof that `machine_spec` measured once for this machine. Build the probe behind
# that number yourself: write `read_bandwidth(buffer, repeats=, reduce=)`, which returns how many **bytes per
# second** `reduce(buffer)` (a sum by default) reads. The docstring states the contract: one untimed warm-up call,
# then `repeats` timed calls, each a whole pass over the buffer; the fastest pass counts (a busy neighbour only
# ever slows a pass down); on CUDA the clock may be read only once the GPU has finished (`torch.cuda.synchronize`);
# a bad argument is a `ValueError`. The library's `measure_device` runs this very function as its read probe.

# %%
# exercise 0.3: minillm.perf.hardware.read_bandwidth

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - `time.perf_counter()` is the clock to use: monotonic, sub-microsecond.
# - Keep the best time, not a list of rates: bytes ÷ the fastest pass is the highest rate.
# - `buffer.nbytes` is its size in bytes (`numel()` counts elements: 4 bytes each in fp32, 2 in bf16).
# - `buffer.is_cuda` says whether there is anything to synchronise.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_read_bandwidth(read_bandwidth)

# %% [markdown]
# Your probe on a buffer far larger than any last-level cache (256 MiB; 1 GiB on a GPU), next to the figure
# `machine_spec` cached for this machine (its read probe is this function too, best of several runs, and the roof
# is the best of the read and GEMV probes). A figure from one run on a shared machine may come out lower than the
# cached best: that spread is why the library measures once, keeps the best, and reuses it everywhere.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
print(f"machine_spec's cached read probe: {spec.read_bandwidth / 1e9:.1f} GB/s, its roof "
      f"{spec.memory_bandwidth / 1e9:.1f} GB/s (measured {spec.measured_at or 'at an unknown time'})")
probe_mib = (1024 if device == "cuda" else 256) // (4 if FAST else 1)
probe_buffer = torch.full((probe_mib * 2**20 // 4,), 1.0, device=device)  # written: every page mapped
my_roof = None  # stays None while exercise 0.3 is unwritten
try:
    my_roof = read_bandwidth(probe_buffer, repeats=3 if FAST else 10)
finally:
    del probe_buffer  # 256 MiB to 1 GiB: not kept for the rest of the notebook
print(f"your read_bandwidth over {probe_mib} MiB: {my_roof / 1e9:.1f} GB/s, "
      f"{my_roof / spec.read_bandwidth:.0%} of the cached read figure")

# %% [markdown]
# Now **measure**: the same stack, weights filled with a constant (a GEMV's time depends on how much it reads, not
# on the values), timed with PyTorch's `F.linear` and, on CPU, minillm's native GEMV — the kernel the engine uses
# for decode batches up to 8 rows. Same bytes, two implementations.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
torch_dtype = getattr(torch, dtype)
weights = [torch.full((N, K), 0.01, dtype=torch_dtype, device=device)
           for _ in range(layers) for N, K in DECODE_GEMV_SHAPES]
impls = {"torch": torch.nn.functional.linear}
if device == "cpu" and native.available():
    impls["native"] = native.linear


@torch.inference_mode()
def stack_seconds(linear, batch: int) -> float:
    """Median seconds of one pass of ``linear`` over every weight of the stack, ``batch`` rows of input."""
    xs = {K: torch.full((batch, K), 1.0, dtype=torch_dtype, device=device) for K in {K for _, K in DECODE_GEMV_SHAPES}}

    def one_pass():
        for w in weights:
            linear(xs[w.shape[1]], w)

    return statistics.median(metrics.measure_seconds(one_pass, repeat=3 if FAST else 5, device=device))


gemv_s = {impl: {B: stack_seconds(fn, B) for B in batches if impl == "torch" or B <= native.MAX_ROWS}
          for impl, fn in impls.items()}
weight_bytes = sum(w.nbytes for w in weights)
for B in batches:
    print(f"batch {B:3d}: " + ", ".join(f"{impl} {times[B] * 1e3:7.2f} ms ({weight_bytes / times[B] / 1e9:5.1f} GB/s)"
                                        for impl, times in gemv_s.items() if B in times))

# %% [markdown]
# Your number, the measurement and the roof, on the decode case (batch 1) with plain PyTorch, which runs
# everywhere: a roofline time is a **lower bound**, so the measurement may not beat it (by more than 25 %, for
# noise: the roofs were measured at another moment, on a machine that may be shared — rerun the two cells above
# if a busy neighbour tripped it); below it, the verdict says what the fraction reached means. The native kernel,
# where there is one, comes closer to the
# roof: same bytes, better code. On a GPU, a pass of 120 small kernels launched one by one from Python pays ~5 µs of
# launch overhead each, more than the reads themselves take at batch 1: the measurement lands well under the roof
# (`measure_device` captures its GEMV stack in a CUDA graph to remove that overhead; serving engines do the same).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
for B in (batches[0], batches[-1]):
    print(f"batch {B}: predicted ≥ {predicted_seconds(B) * 1e3:.2f} ms; measured " + ", ".join(
        f"{impl} {times[B] * 1e3:.2f} ms ({predicted_seconds(B) / times[B]:.0%} of the roofline's speed)"
        for impl, times in gemv_s.items() if B in times))
if my_roof is not None:  # exercise 0.3 written: the same stream under the roof you measured
    print(f"batch 1 under your own roof ({my_roof / 1e9:.1f} GB/s from your probe): " + ", ".join(
        f"{impl} streams {weight_bytes / times[1] / 1e9:.1f} GB/s = {weight_bytes / times[1] / my_roof:.0%} of it"
        for impl, times in gemv_s.items() if 1 in times))
verdict = checks.judge_prediction(my_prediction, weight_bytes / gemv_s["torch"][1] / 1e9,
                                  bound=weight_bytes / predicted_seconds(1) / 1e9, unit="GB/s",
                                  what="weights streamed by a batch-1 F.linear pass",
                                  see="each of the 120 calls pays a fixed cost (on a GPU a ~5 µs launch)")

# %% [markdown]
# ## 6. MBU and MFU: how much of the machine a model uses
#
# Two utilisation figures, one per roof:
#
# - **MBU** (model bandwidth utilisation) = bytes the model must read per step × steps per second ÷ peak bandwidth.
#   The figure of merit for memory-bound work: decode.
# - **MFU** (model FLOP/s utilisation) = FLOPs per step × steps per second ÷ peak FLOP/s. The figure of merit for
#   compute-bound work: prefill and training.
#
# ### Spot the bug
#
# A widely read textbook works this example: *"a 7B-parameter model in 16-bit precision generating 100 tokens per
# second reads 7B × 2 bytes × 100 /s = 700 GB/s, so on an A100 with 2 TB/s of bandwidth its MBU is 70 %."*
# Two steps in that sentence are wrong, and their errors cancel. Find both before you write the exercise (its
# docstring gives the answer away).
#
# ### Exercise 0.4 — MBU
#
# Write `mbu(bytes_per_step, steps_per_s, bandwidth)`, a fraction between 0 and 1. The function's first lines
# already turn `bandwidth` (bytes/s, or a `HardwareSpec`) into the number `peak_bandwidth`.

# %%
# exercise 0.4: minillm.perf.roofline.mbu

# %%
# NBVAL_CHECK_OUTPUT
checks.check_mbu(mbu)

# %% [markdown]
# The textbook's example, recomputed:

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
params, bytes_per_param, tokens_per_s, a100_bandwidth = 7e9, 2, 100, 2e12
print(f"7e9 × {bytes_per_param} bytes × {tokens_per_s} per second = "
      f"{params * bytes_per_param * tokens_per_s / 1e12:.1f} TB per second, not 0.7")
print(f"MBU = {mbu(params * bytes_per_param, tokens_per_s, a100_bandwidth):.0%}: the textbook's 70 % is right, "
      f"but not from its own 700 GB/s, which would give {mbu(7e11, 1, a100_bandwidth):.0%} — the first slip drops "
      "the 2 bytes per parameter, the second doubles the quotient back")

# %% [markdown]
# ### Plug it in: the engine's MBU on this machine
#
# Now the real engine: SmolLM2-135M decoding batches of requests. A decode step advances every running sequence
# by one token, so a request's time per output token (TPOT) is the step time; the cost model gives the step's
# bytes (weights + KV cache) and FLOPs.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
llm = LLM(device=device, dtype=dtype)  # SmolLM2-135M-Instruct, offline
config, model_dtype = llm.model.config, roofline.dtype_name(llm.model.dtype)
rng = random.Random(0)
prompt_len, n_out = 16, (16 if FAST else 48)
engine_batches = [1, 8] if FAST else [1, 4, 16]
llm.generate([[rng.randrange(100, config.vocab_size) for _ in range(8)]], SamplingParams(max_tokens=2, temperature=0))
decode_s = {}
for B in engine_batches:
    prompts = [[rng.randrange(100, config.vocab_size) for _ in range(prompt_len)] for _ in range(B)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True))
    decode_s[B] = statistics.median(o.metrics.tpot_s for o in outs)
    print(f"batch {B:2d}: {decode_s[B] * 1e3:6.1f} ms per decode step, {B / decode_s[B]:7.1f} tokens/s")

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
context = prompt_len + n_out // 2  # the average number of cached tokens during decode
print(f"ridge of this machine in {model_dtype}: {ridge_point(spec, model_dtype):.3g} FLOP/B")
for B, step_s in decode_s.items():
    cost = roofline.decode_step_cost(config, B, context, model_dtype)
    print(f"batch {B:2d}: {cost.bytes / 1e6:6.1f} MB and {cost.flops / 1e9:5.2f} GFLOP per step "
          f"(intensity {cost.intensity:5.2f} FLOP/B) -> MBU {mbu(cost.bytes, 1 / step_s, spec):5.1%}, "
          f"MFU {roofline.mfu(cost.flops, 1 / step_s, spec.peak(model_dtype)):6.2%}")

# %% [markdown]
# The bytes per step hardly grow with the batch (the weights are read once for all sequences) while the FLOPs grow
# with B, and so does the intensity. On a GPU, whose ridge is in the hundreds, a decode step stays memory bound up to
# large batches: the step time barely moves, MBU stays put and MFU grows about linearly with B — batching is how
# decode gets more out of the same bytes (notebook 06). A CPU's ridge is only a few FLOP/byte: a batch of a few
# sequences already reaches it, the step becomes compute bound, and MBU falls while MFU rises. Read the two figures
# together, next to the ridge.
#
# **`nvidia-smi` "utilization" is neither.** Its "GPU-Util" is the fraction of the last sampling period during
# which *at least one kernel* was running — time busy, not work done. A batch-1 decode loop that keeps one small
# kernel in flight at all times shows 100 % while its MBU is 30 % and its MFU 0.3 %. Judge a GPU by MBU and MFU
# computed from your own bytes, FLOPs and timings, as above.

# %% [markdown]
# ## 7. Place the measurements on this machine's roofline
#
# The GEMV stack at every batch (per implementation), the matmul that set the compute roof, and the engine's
# decode steps. x = the cost model's intensity, y = FLOPs ÷ measured time. As the batch grows the GEMV points
# march right along the bandwidth roof toward the ridge; decode steps of the engine sit below it by what the
# engine loses to everything that is not a weight read (attention, norms, sampling, Python).

# %%
# NBVAL_IGNORE_OUTPUT
n = spec.method["matmul_n"]
groups = {  # label -> (marker style, points)
    f"GEMV stack, {impl}, batch {min(times)}…{max(times)}": ("o-", [
        roofline.RooflinePoint.from_cost(f"B={B}", gemv_stack_cost(B), t) for B, t in times.items()])
    for impl, times in gemv_s.items()
}
groups.update({
    "engine decode steps": ("s", [
        roofline.RooflinePoint.from_cost(f"B={B}", roofline.decode_step_cost(config, B, context, model_dtype), t)
        for B, t in decode_s.items()]),
    f"matmul {n}³ (sets the flat roof)": ("*", [
        roofline.RooflinePoint("", linear_cost(n, n, n, dtype).intensity, spec.peak(dtype))]),
})
everything = [roofline.RooflinePoint("", p.intensity, p.flops_per_s) for _, ps in groups.values() for p in ps]
ax = roofline.plot_roofline(spec, everything, dtype=dtype)  # the roofs, sized to fit every point
for label, (style, ps) in groups.items():
    ax.plot([p.intensity for p in ps], [p.flops_per_s for p in ps], style, markersize=8, zorder=4, label=label)
    engine = label.startswith("engine")
    for p in ps if engine else (ps[0], ps[-1]) if "torch" in label else ():  # batch labels, where they fit
        ax.annotate(p.label, (p.intensity, p.flops_per_s), textcoords="offset points", fontsize="small",
                    xytext=(6, -12) if engine else (-8, 8))
ax.legend(loc="lower right", fontsize="small")
plt.show()

# %% [markdown]
# ## 8. Explore other machines
#
# `roofline_explorer(batch, dtype, hardware)` places a decode step of a model (its linears and its attention
# separately) and a 512-token prefill on a machine's roofline, where the roofline *predicts* them, and says what
# bounds them, how many tokens/s that allows and whether the weights and KV cache fit in memory. Below, checked
# calls: Llama-2-7B at batch 1 and 64 on an H100 (the linears move right with the batch, attention stays at 1);
# after them, sliders that call the same function (they need a live kernel, ipywidgets 7 or 8).

# %%
EXPLORER_MODELS = {"SmolLM2-135M": checks.SMOLLM2_135M, "Llama-2-7B": checks.LLAMA2_7B}


def roofline_explorer(batch: int = 1, dtype: str = "bfloat16", hardware: str = "H100-SXM",
                      model: str = "Llama-2-7B", context: int = 1024) -> dict:
    """Decode step of ``model`` (``batch`` sequences of ``context`` cached tokens) and a 512-token prefill on the
    roofline of ``hardware`` (a name in ``roofline.SPECS`` or "this machine") in ``dtype``: prints the verdict,
    draws the chart, returns the numbers (intensity, bound, tokens_per_s, fits)."""
    s = spec if hardware == "this machine" else roofline.get_spec(hardware)
    peak_dtype = next(d for d in (dtype, "float16", "bfloat16", "float32") if d in s.peak_flops)
    cfg = EXPLORER_MODELS[model]
    step = roofline.decode_step_cost(cfg, batch, context, dtype)
    prefill = roofline.prefill_cost(cfg, 1, 512, dtype)
    linears = step.flops_breakdown["linear"] / step.breakdown["weights"]  # FLOPs per weight byte
    attention = step.flops_breakdown["attention"] / step.breakdown["kv_cache"]  # FLOPs per KV-cache byte
    work = {f"decode B={batch}": step.intensity, "its linears": linears, "its attention": attention,
            "prefill 512": prefill.intensity}
    points = [roofline.RooflinePoint(label, i, roofline.attainable_flops(s, i, peak_dtype))
              for label, i in work.items()]  # where the roofline puts them: predictions, not measurements
    ridge = roofline.ridge_point(s, peak_dtype)
    step_s = step.flops / roofline.attainable_flops(s, step.intensity, peak_dtype)
    bound = "memory" if step.intensity < ridge else "compute"
    kv = batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * roofline.dtype_bytes(dtype)
    weights = cfg.num_parameters() * roofline.dtype_bytes(dtype)
    fits = s.memory_capacity == 0 or weights + kv <= s.memory_capacity
    note = "" if peak_dtype == dtype else f" (no {dtype} peak listed: {peak_dtype}'s used)"
    print(f"{model}, batch {batch}, context {context}, {dtype} on {s.name}{note}; ridge {ridge:.3g} FLOP/B")
    print(f"  decode step: {step.bytes / 1e9:.3g} GB, intensity {step.intensity:.3g} FLOP/B -> {bound} bound: "
          f"≥ {step_s * 1e3:.3g} ms per step, ≤ {batch / step_s:,.0f} tokens/s, "
          f"{roofline.attainable_flops(s, step.intensity, peak_dtype) / s.peak(peak_dtype):.1%} of peak FLOP/s")
    print(f"  linears {linears:.3g} FLOP/B, attention {attention:.3g} FLOP/B (does not grow "
          f"with the batch); prefill of 512 tokens {prefill.intensity:.3g} FLOP/B")
    capacity = f"{s.memory_capacity / 1e9:.0f} GB" if s.memory_capacity else "unknown"
    print(f"  memory: weights {weights / 1e9:.3g} GB + KV cache {kv / 1e9:.3g} GB of {capacity}"
          f"{'' if fits else ' -> does NOT fit'}")
    ax = roofline.plot_roofline(s, [roofline.RooflinePoint("", p.intensity, p.flops_per_s) for p in points],
                                dtype=peak_dtype)
    for p, marker in zip(points, "oDvs", strict=True):
        ax.plot(p.intensity, p.flops_per_s, marker, markersize=9, alpha=0.8, zorder=4, label=p.label)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(f"{model}, batch {batch}, context {context}, {dtype} on {s.name}")
    plt.show()
    return {"intensity": step.intensity, "bound": bound, "tokens_per_s": batch / step_s, "fits": fits}


# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
one = roofline_explorer(batch=1, dtype="bfloat16", hardware="H100-SXM")
many = roofline_explorer(batch=64, dtype="bfloat16", hardware="H100-SXM")
assert one["bound"] == many["bound"] == "memory" and many["tokens_per_s"] > 10 * one["tokens_per_s"]

# %% tags=["slide-skip"]
# NBVAL_IGNORE_OUTPUT
# Sliders: each change calls roofline_explorer(...) again. Try: which batch reaches the ridge on an H100? Why does
# attention not move? When does Llama-2-7B's KV cache stop fitting? What does a T4 allow?
import ipywidgets as widgets
from IPython.display import display

display(widgets.interactive(
    roofline_explorer,
    batch=widgets.SelectionSlider(options=[2**k for k in range(11)], value=1, description="batch",
                                  continuous_update=False),
    dtype=widgets.Dropdown(options=["bfloat16", "float16", "float32", "float8"], value="bfloat16",
                           description="dtype"),
    hardware=widgets.Dropdown(options=[*roofline.SPECS, "this machine"], value="H100-SXM", description="hardware"),
    model=widgets.Dropdown(options=list(EXPLORER_MODELS), value="Llama-2-7B", description="model"),
    context=widgets.SelectionSlider(options=[2**k for k in range(7, 16)], value=1024, description="context",
                                    continuous_update=False),
))

# %% [markdown]
# ## Takeaways
#
# - **Intensity** = FLOPs ÷ bytes; **attainable FLOP/s** = min(peak, intensity × bandwidth); the **ridge** =
#   peak ÷ bandwidth: 295 FLOP/byte for an H100 SXM in bf16, a few to a dozen on this CPU.
# - A linear layer's intensity ≈ **M**, the tokens it processes at once (in a 16-bit dtype). Decode has M = batch:
#   far left of any GPU's ridge, **memory bound**, so its time is bytes ÷ bandwidth. Prefill has M = prompt length:
#   compute bound. Batching moves decode's linears right; attention stays at ≈ 1 whatever the batch.
# - Measure the machine: roofs from measured peaks are honest (a read probe keeps the fastest of repeated passes
#   over a buffer far beyond the cache), and the same bytes streamed by two implementations can differ by 2× — a
#   roofline tells you how much is left to win.
# - Judge decode by **MBU** (7B × 2 bytes × 100 tok/s = 1.4 TB/s = 70 % of an A100's 2 TB/s — check the
#   arithmetic), prefill and training by **MFU**; `nvidia-smi`'s utilisation is time busy, not either.
