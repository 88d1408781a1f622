# %% [markdown]
# # 10 — Scaling out, and other levers
#
# Everything so far ran on one device. A model outgrows one when its weights do not fit (Llama-2-70B is 140 GB in
# bf16; an H100 holds 80 GB) or when one device's bandwidth cannot give the latency you promised (notebook 00: a
# decode step reads every weight once). There are four ways to spread the work, and each moves something different
# between devices:
#
# | strategy | each device holds | what moves between devices | when |
# |---|---|---|---|
# | **replicas** (data parallel) | the whole model | nothing (a load balancer sends requests) | the model fits; you need more throughput |
# | **tensor parallel** (TP, Megatron) | 1/N of every layer | 2 all-reduces of [tokens, hidden] per layer | inside a node, fast links (NVLink) |
# | **pipeline parallel** (PP, GPipe) | 1/N of the layers | [tokens, hidden] once per stage boundary | across nodes; pays in idle "bubbles" |
# | **context / sequence parallel** | a slice of the sequence | K/V blocks passed around a ring | very long prompts |
#
# **In this notebook** you write the split of a linear layer that minillm's tensor parallelism really uses (exercise
# 10.1), check that the shards add up to the whole, then run TP=2 over two real processes (`torch.distributed`,
# gloo on CPU — NCCL on GPUs) and get the same tokens. You predict what the communication costs per layer
# (exercise 10.2), measure the all-reduce here, and ask the cost model where TP pays (Llama-2-70B on an 8-GPU H100
# node) and where it does not (this CPU). You write the micro-batch schedule of a pipeline (exercise 10.3) and
# measure its bubble against (p − 1)/(m + p − 1). Then prefill/decode disaggregation — prefill on some GPUs, decode
# on others — on the virtual clock of notebook 09. Last, three levers that shrink the model instead of spreading
# it — pruning, early exit, distillation — each with its perplexity cost measured. A few minutes on a 2-core CPU.

# %%
from __future__ import annotations

import dataclasses
import os
import random

import matplotlib.pyplot as plt
import torch
from torch import Tensor

from minillm import SamplingParams
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.distributed.executor import tp_forward, tp_generate
from minillm.distributed.pipeline import bubble_fraction, gpipe_bubble, pp_forward, pp_generate
from minillm.distributed.worker import run_workers
from minillm.engine.llm_engine import LLMEngine
from minillm.layers.parallel import padded_vocab, rank_config, valid_tp_sizes
from minillm.models.configs import llama2_70b_config
from minillm.perf import roofline
from minillm.perf.bench import disagg as disagg_bench
from minillm.perf.bench import tp as tp_bench
from minillm.perf.disagg import KV_LINKS, kv_transfer_bytes, transfer_seconds
from minillm.perf.hardware import dtype_bytes
from minillm.perf.simulate import StepChunk, llama2_7b_config
from minillm.perf.tp_cost import ALLREDUCES_PER_LAYER, LINKS, Link, fit_link, tp_estimate

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})
CORES = os.cpu_count() or 1
device = "cpu"  # the ranks are CPU processes talking gloo, even beside a GPU (NCCL wants one GPU per rank)

# SmolLM2-135M's shape with heads that 2 divides (its 9 query / 3 K/V heads do not: see section 2), random weights.
config = dataclasses.replace(tp_bench.default_like_config(), num_layers=4 if FAST else 8)
model = tp_bench.random_model(config)
print(f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} query / "
      f"{config.num_kv_heads} K/V heads, MLP {config.intermediate_size}; {CORES} CPU cores")

# %% [markdown]
# ## 1. Split a linear layer: columns, then rows
#
# A linear layer computes y = x Wᵀ, W of shape [N, K]. Two ways to give each of N ranks (tp of them) a piece:
#
# - **Column-parallel**: rank r keeps rows of W — some *output* features. Every rank needs all of x; each gets its
#   own slice of y, no communication. Attention's `qkv_proj` split this way gives each rank whole heads.
# - **Row-parallel**: rank r keeps columns of W — some *input* features — and multiplies them by *its* slice of x.
#   Its result has the full shape of y but is a **partial sum**; adding the ranks' partials (an **all-reduce**)
#   gives y.
#
# Megatron-LM (Shoeybi et al., 2019) pairs them: column-parallel `qkv_proj` → each rank attends with its heads →
# row-parallel `o_proj` → all-reduce; column-parallel `gate_up_proj` → SiLU × up on its slice → row-parallel
# `down_proj` → all-reduce. The column output is exactly the row layer's input slice, so **two all-reduces per
# layer** and nothing else moves. Two details: a stacked projection ([q; k; v] or [gate; up]) must be split part by
# part, or rank 0 would get all the queries and no keys; and a row-parallel bias must enter the sum once.
#
# ### Exercise 10.1 — `shard_linear`
#
# This function is what `ColumnParallelLinear` and `RowParallelLinear` call when minillm shards a model.

# %%
# exercise 10.1: minillm.layers.parallel.shard_linear

# %%
# NBVAL_CHECK_OUTPUT
checks.check_shard_linear(shard_linear)

# %% [markdown]
# ### The shards add up — and what happens without the all-reduce
#
# Your function on one MLP of the model, two ranks, done by hand in one process: each rank's gate/up shard, its
# SiLU × up, its down shard. The all-reduce is a sum of the two partials. Predict first: how wrong is one rank's
# partial alone, relative to the whole output — 1 %, 50 %, 100 %?

# %%
# NBVAL_IGNORE_OUTPUT
mlp, tp = model.model.layers[0].mlp, 2
F = config.intermediate_size
x = torch.randn(3, config.hidden_size)
with torch.no_grad():
    gate, up = (x @ mlp.gate_up_proj.weight.T).split(F, dim=-1)
    whole = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
    partials = []
    for rank in range(tp):
        w_gu, _ = shard_linear(mlp.gate_up_proj.weight, None, "column", rank, tp, (F, F))  # (2F/tp, hidden)
        w_down, _ = shard_linear(mlp.down_proj.weight, None, "row", rank, tp)  # (hidden, F/tp)
        g, u = (x @ w_gu.T).split(F // tp, dim=-1)  # this rank's F/tp hidden units, no communication
        partials.append((torch.nn.functional.silu(g) * u) @ w_down.T)  # (3, hidden): a partial sum
    reduced = sum(partials)  # the all-reduce
rel = lambda a: float((a - whole).norm() / whole.norm())  # noqa: E731
print(f"all-reduced: max |error| {float((reduced - whole).abs().max()):.1e} (fp32 sums in another order)")
print(f"rank 0's partial alone (all-reduce forgotten): relative error {rel(partials[0]):.0%}")

# %% [markdown]
# About 70 %: each partial is half of a sum of many random terms, so it is neither the whole nor half of it. Without
# the all-reduce every rank runs on with a wrong residual stream — garbage tokens, no error raised.
#
# ## 2. Tensor parallelism over two real processes
#
# `tp_forward` and `tp_generate` start two processes (`torch.multiprocessing`, a TCP rendezvous on 127.0.0.1, a
# gloo process group: what `torchrun` does) and give each its shard — half the heads, half the MLP, half the KV
# cache. The calling process is rank 0, the driver: as in vLLM it alone runs the scheduler and sends each step's
# inputs once (a small header and one int64 tensor of ids, positions, slots and block tables); the two all-reduces
# per layer leave the full hidden state on every rank, and rank 0 samples. A size that does not divide the heads is
# refused before any process starts, naming the sizes that work:

# %%
smol_like = dataclasses.replace(config, num_heads=9, num_kv_heads=3)
print("valid tensor-parallel sizes of SmolLM2-135M's heads:", valid_tp_sizes(smol_like))
try:
    tp_generate(tp_bench.random_model(dataclasses.replace(smol_like, num_layers=1)), [[1, 2, 3]],
                tensor_parallel_size=2)
except ValueError as e:
    print("ValueError:", e)

# %%
# NBVAL_IGNORE_OUTPUT
prompts = [[random.randrange(1, config.vocab_size) for _ in range(n)] for n in (12, 5, 9)]
greedy = SamplingParams(max_tokens=8 if FAST else 16, temperature=0, ignore_eos=True)
ids = torch.tensor([prompts[0]])
pos = torch.arange(ids.shape[1])[None]
with torch.inference_mode():
    logits_1 = model(ids, pos)
    tokens_1 = [o.token_ids for o in LLMEngine(model).generate(prompts, greedy)]
logits_2 = tp_forward(model, ids, pos, tensor_parallel_size=2)
tokens_2 = [o.token_ids for o in tp_generate(model, prompts, greedy, tensor_parallel_size=2)]
print(f"TP=2 logits vs one process: max |difference| {float((logits_2 - logits_1).abs().max()):.1e}")
print(f"TP=2 greedy tokens identical to one process: {tokens_2 == tokens_1}")

# %%
# NBVAL_CHECK_OUTPUT
torch.testing.assert_close(logits_2, logits_1)
assert tokens_2 == tokens_1
print("TP=2 matches one process: logits within fp32 tolerance, identical greedy tokens")

# %% [markdown]
# ## 3. What the communication costs
#
# A **ring all-reduce** over tp ranks cuts the n-byte tensor into tp chunks and passes them around the ring twice:
# a *reduce-scatter* (tp − 1 steps; afterwards each rank holds the full sum of one chunk) and an *all-gather*
# (tp − 1 steps; everyone gets every summed chunk). Each step sends n/tp bytes, so each rank sends
# **2 (tp − 1)/tp × n** bytes — almost 2n for large tp, whatever the number of ranks: that is why the ring is
# bandwidth-optimal. Each collective also pays a fixed **latency** α (launch, synchronisation, the first byte's
# trip). So one all-reduce takes α + 2 (tp − 1)/tp × n / β on a link of β bytes/s.
#
# ### Exercise 10.2 — `layer_comm_time`
#
# The seconds a decoder layer spends communicating at tensor-parallel size tp, for `tokens` rows of the hidden
# state. It is the heart of `perf/tp_cost.py`, which `tp_estimate` uses below.

# %%
# exercise 10.2: minillm.perf.tp_cost.layer_comm_time

# %%
# NBVAL_CHECK_OUTPUT
checks.check_layer_comm_time(layer_comm_time)

# %% [markdown]
# **Predict before measuring.** On this machine the "link" is the loopback TCP socket between two processes that
# gloo uses. One decode token's all-reduce carries 576 fp32 values = 2.3 KB. Write your guess for one all-reduce's
# time (microseconds), and compare a layer's two all-reduces with the layer's compute: one decode token through a
# 576-wide layer reads ~4.7 MB of fp32 weights — at a few GB/s, about a millisecond.

# %%
my_allreduce_us = 50.0  # ← your guess for one all-reduce of 576 fp32 values between two processes here

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
numels = [576, 4096, 65536, 262144, 1 << 20] if not FAST else [576, 4096, 262144]
times = run_workers(tp_bench.allreduce_worker, 2, (numels, 100 if FAST else 300), threads_per_worker=1)[0]
# Fit t = α + bytes / β on the measured points, robustly (median of pairwise slopes): a busy host's stalled run
# moves neither, and a fit that noise makes unphysical is clamped, with a note saying so.
xs = [2 * (2 - 1) / 2 * n * 4 for n in numels]  # bytes one rank sends, tp = 2, fp32
gloo_here, fit_note = fit_link("gloo loopback", xs, [times[n] for n in numels], "fitted in this notebook")
alpha = gloo_here.latency_s
if fit_note:
    print(f"note: {fit_note}")
for n in numels:
    print(f"all-reduce of {n:8d} fp32 ({n * 4 / 1e3:8.1f} KB): {times[n] * 1e6:8.1f} µs measured")
print(f"fit: α ≈ {alpha * 1e6:.0f} µs, β ≈ {gloo_here.bandwidth / 1e9:.2f} GB/s; your guess was "
      f"{my_allreduce_us:.0f} µs")
per_layer_pred = layer_comm_time(2, 1, config.hidden_size, "float32", gloo_here)
print(f"per decode layer: your layer_comm_time predicts {per_layer_pred * 1e6:.0f} µs; measured "
      f"{ALLREDUCES_PER_LAYER * times[576] * 1e6:.0f} µs (2 × one all-reduce)")

# %% [markdown]
# A small all-reduce costs its latency, whatever it carries: bytes only start to count at hundreds of KB (on a
# loaded shared machine the latency itself can grow to hundreds of µs — the other rank must be scheduled to answer).
# Now a whole decode step. Three runs, each one request: TP=1 on one core, TP=1 with two threads on the two cores,
# and TP=2 — two processes of one thread each.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
n_tokens = 8 if FAST else 24
runs = {"TP=1, 1 thread": (1, 1), f"TP=1, {CORES} threads": (1, CORES), "TP=2, 1 thread each": (2, 1)}
tok_s = {name: run_workers(tp_bench.decode_tok_s, tp, (model, n_tokens, 1 if FAST else 2),
                           threads_per_worker=threads)[0] for name, (tp, threads) in runs.items()}
for name, v in tok_s.items():
    print(f"decode, 1 request, {name:22s}: {v:6.1f} tok/s")
print(f"communication alone: {config.num_layers} layers × 2 all-reduces × {times[576] * 1e6:.0f} µs = "
      f"{config.num_layers * 2 * times[576] * 1e3:.1f} ms per token")
conclude(f"decode tok/s, TP=2 ÷ TP=1 with {CORES} threads", tok_s["TP=2, 1 thread each"]
         / tok_s[f"TP=1, {CORES} threads"], 1, expect=">", unit="×",
         held="TP=2 beats one process with as many threads here — from the threads' synchronisation, not from "
              "splitting the model (next paragraph)",
         missed="TP=2 does not beat one process with as many threads: the same cores and bandwidth, plus two "
                "all-reduces per layer")

# %% [markdown]
# The same runs on this machine's roofline, per rank. Each rank reads 1/tp of every layer's weights and of the
# vocabulary (its heads, its MLP units, its rows of the embedding): x = that share's intensity from the cost model,
# y = its FLOPs ÷ the measured time per token. Splitting the weights leaves the intensity where it was (both
# the bytes and the FLOPs are halved), so TP can only move a rank's point up, toward its own bandwidth roof; the
# all-reduces are time in which the rank reads nothing, and pull it down.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
machine = roofline.machine_spec(device, quick=FAST, verbose=True)  # the cached roof: measured once per machine
tp_context = len(tp_bench.PROMPT) + n_tokens // 2  # the average number of cached tokens while decoding


def rank_step_cost(tp: int) -> roofline.Cost:
    """One rank's share of a batch-1 decode step: its heads, MLP units and vocabulary rows."""
    shard = dataclasses.replace(rank_config(config, tp), vocab_size=padded_vocab(config.vocab_size, tp) // tp)
    return roofline.decode_step_cost(shard, 1, tp_context, "float32")


comm_s = config.num_layers * ALLREDUCES_PER_LAYER * times[576]  # a token's all-reduces, from the measurement above
tp_points = []
for name, (tp, _) in runs.items():
    cost, step_s = rank_step_cost(tp), 1 / tok_s[name]
    tp_points.append(roofline.RooflinePoint.from_cost(f"decode {name}", cost, step_s))
    print(f"{name:22s}: {cost.bytes / 1e6:6.1f} MB per rank per token, {step_s * 1e3:6.2f} ms per token "
          f"({cost.bytes / machine.memory_bandwidth / step_s:6.1%} of one rank's bytes bound)"
          + (f", of which all-reduces {comm_s * 1e3:.2f} ms" if tp > 1 else ""))
roofline.plot_roofline(machine, tp_points, dtype="float32")
plt.show()
conclude("all-reduce time ÷ TP=2 decode time per token", comm_s * tok_s["TP=2, 1 thread each"] * 100, 50.0,
         expect="<", unit="%",
         held="most of a TP=2 token is each rank's own compute and weight reads here, not communication",
         missed="communication takes most of a TP=2 token here: latency-bound all-reduces outweigh the halved reads")

# %% [markdown]
# Read these numbers with the machine in mind. On two cores, TP=2 can at best use what TP=1 with two threads
# already uses: the same two cores and the same memory bandwidth — a decode step is memory bound (notebook 00) —
# plus two all-reduces per layer and a wait for the slower rank at each. If TP=2 beats TP=1 with two threads here,
# it is because two *threads* of one process synchronise inside every matmul and suffer more when other jobs
# share the cores, not because splitting the model helped; against TP=1 on one core TP=2 has twice the cores. TP
# pays when each rank brings its own memory bandwidth — a GPU each — and the link is fast. The cost model, on
# paper, for bf16 decode of one request with 1024 tokens of context:

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
llama70 = llama2_70b_config()
fig, ax = plt.subplots(figsize=(7, 4))
for link, style in (("H100-NVLink", "-o"), ("H100-PCIe", "--s")):
    for batch, color in ((1, "tab:blue"), (64, "tab:red")):
        est = [tp_estimate(llama70, tp, batch=batch, link=link) for tp in (1, 2, 4, 8)]
        ax.plot([1, 2, 4, 8], [e.speedup for e in est], style, color=color, label=f"{link}, batch {batch}")
ax.plot([1, 8], [1, 8], "k:", label="ideal (no communication)")
ax.set(xlabel="tensor-parallel size (GPUs)", ylabel="decode layer speedup over 1 GPU", xscale="log", yscale="log",
       title="Llama-2-70B decode layer on H100s (cost model)")
ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()
for link in ("H100-NVLink", "H100-PCIe"):
    e = tp_estimate(llama70, 8, batch=1, link=link)
    print(f"Llama-2-70B, TP=8 over {link}: layer compute {e.compute_s * 1e6:.0f} µs, all-reduces "
          f"{e.comm_s * 1e6:.0f} µs ({e.comm_fraction:.0%}), speedup {e.speedup:.1f}× — "
          f"≤ {1 / (llama70.num_layers * (e.compute_s + e.comm_s)):.0f} tok/s")

# %% [markdown]
# One all-reduce side by side: what two gloo processes took here for the same number of bytes (measured above) and
# what the cost model charges on paper over an H100 node's NVLink (900 GB/s counts both directions: 450 GB/s each
# way) and over PCIe 5.0 (64 GB/s each way) — one decode token of this model, Llama-2-70B's at batch 1 and 64.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
print(f"{'one all-reduce, tp = 2':<38} {'here (gloo)':>12} {'H100 NVLink':>12} {'H100 PCIe':>12}")
for what, tokens, hidden, dt in (("this model, 1 token, fp32", 1, config.hidden_size, "float32"),
                                 ("Llama-2-70B, 1 token, bf16", 1, llama70.hidden_size, "bfloat16"),
                                 ("Llama-2-70B, 64 tokens, bf16", 64, llama70.hidden_size, "bfloat16")):
    nbytes = tokens * hidden * dtype_bytes(dt)
    here = times[int(nbytes) // 4]  # measured above: the same bytes as fp32 elements
    paper = [layer_comm_time(2, tokens, hidden, dt, LINKS[k]) / ALLREDUCES_PER_LAYER
             for k in ("H100-NVLink", "H100-PCIe")]
    print(f"{what + f' ({nbytes / 1e3:.0f} KB)':<38} " + " ".join(f"{t * 1e6:>9.1f} µs" for t in (here, *paper)))

# %% [markdown]
# Latency dominates every row but the last: two processes here pay tens to hundreds of µs per call, NVLink ~10 µs.
# At batch 1 a 70B layer reads ~1.7 GB of bf16 weights: ~520 µs on one H100, ~65 µs on each of 8. Against that,
# two all-reduces of 16 KB cost ~20 µs on NVLink — latency, not bandwidth — so TP=8 is ~6× faster. Over PCIe the
# latency is larger and the bandwidth 7× lower; batch 64's 1 MB all-reduces then take a real share. And for a 135M
# model on 2 CPU cores the "layer" is microseconds of compute per rank against tens of microseconds of messages:
# TP can only lose. (Notebook 00's roofline is the reason: decode is memory bound, and TP only helps by adding
# memory bandwidth.)
#
# ## 4. Pipeline parallelism and its bubble
#
# A pipeline gives stage s the layers [s·n/p, (s+1)·n/p) — and their KV cache — and passes the activations on:
# one [tokens, hidden] message per stage boundary, far less than TP's two all-reduces per layer. The catch: stage
# 1 waits while stage 0 works. **GPipe** cuts the batch into m micro-batches that follow each other down the pipe.
#
# ### Exercise 10.3 — `gpipe_schedule`
#
# Given each stage's time for each micro-batch, when does each run? (The library uses your function to predict the
# bubble it then measures.)

# %%
# exercise 10.3: minillm.distributed.pipeline.gpipe_schedule

# %%
# NBVAL_CHECK_OUTPUT
checks.check_gpipe_schedule(gpipe_schedule)

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
for ax, m in zip(axes, (1, 4), strict=True):
    sched = gpipe_schedule([[1.0 / m] * m for _ in range(4)])  # the same batch cut into m pieces
    for s, row in enumerate(sched):
        for j, (a, b) in enumerate(row):
            ax.barh(s, b - a, left=a, color=plt.cm.tab10(j), edgecolor="k",
                    label=f"micro-batch {j}" if s == 0 else None)
    ax.set(title=f"p = 4 stages, m = {m}: bubble {bubble_fraction(sched):.0%} (formula {gpipe_bubble(4, m):.0%})",
           xlabel="time (one stage's whole-batch time = 1)", ylabel="stage")
    ax.invert_yaxis()
    ax.legend(fontsize="x-small", loc="lower left")
plt.tight_layout()
plt.show()

# %% [markdown]
# **Predict**: two stages, a batch of 8 prompts. What idle share do you expect at m = 1, 2, 4, 8 micro-batches?
# GPipe's formula says (p − 1)/(m + p − 1): 50 %, 33 %, 20 %, 11 %. Measured over two real processes (each stage's
# compute time against the run's wall time), with the schedule your function predicts from the *measured* stage
# times beside it — it knows about unequal stages, not about the messages or a neighbour stealing a core:

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
MS = (1, 2, 4) if FAST else (1, 2, 4, 8)
rows = tp_bench.measure_bubble(model, pp=2, microbatches=MS, batch=8, seq_len=8 if FAST else 16,
                               repeats=2 if FAST else 3)
for r in rows:
    print(f"p=2, m={r['m']}: measured {r['measured']:5.1%} | formula {r['formula']:5.1%} | your schedule on the "
          f"measured stage times {r['schedule']:5.1%} | wall {r['wall_ms']:.0f} ms")
conclude(f"bubble at m = {rows[-1]['m']} ÷ at m = {rows[0]['m']}", rows[-1]["measured"] / rows[0]["measured"], 1,
         expect="<", unit="×", held="the bubble shrinks with m, as the formula says",
         missed="the bubble did not shrink with m in this run: the per-micro-batch message and smaller matmuls, or "
                "a neighbour taking a core, cost more than the overlap gained")
conclude(f"bubble at m = {rows[-1]['m']}, measured ÷ formula", rows[-1]["measured"] / rows[-1]["formula"], 1,
         expect="≈", tolerance=0.25, unit="×", held="the formula (p − 1)/(m + p − 1) predicts the measured bubble",
         missed="the measured bubble is off the formula by more than 25 %: it ignores the messages, the smaller "
                "matmuls and unequal stages (your schedule on the measured stage times accounts for the last)")
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([r["m"] for r in rows], [r["measured"] for r in rows], "o-", label="measured (2 gloo processes)")
ax.plot([r["m"] for r in rows], [r["schedule"] for r in rows], "s--", label="gpipe_schedule(measured stage times)")
ms = list(range(1, max(MS) + 1))
ax.plot(ms, [gpipe_bubble(2, m) for m in ms], "k:", label="(p − 1)/(m + p − 1)")
ax.set(xlabel="micro-batches m", ylabel="bubble (idle share of the stages' time)", ylim=(0, 0.7),
       title="Pipeline bubble, p = 2 stages")
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# The formula's bubble shrinks with m, but a measured one never reaches it exactly: each micro-batch also pays a
# message and a smaller, less efficient matmul, and on a shared 2-core machine a stage sometimes waits for a core
# (the ▸ lines say how this run compared). Real pipelines
# use m ≥ 4p. At decode the pipeline has a second constraint: micro-batch j's next token exists only after its
# trip through every stage, so at least p micro-batches must be in flight to keep every stage busy.
#
# minillm's pipelined generation: `pp_generate` (or `LLM(path, pipeline_parallel_size=2)`) — every stage holds its
# layers' paged KV cache; the last stage sends the logits back to the first process, where the one engine samples
# (the scheduler, sampling and stop rules of a single process).

# %%
# NBVAL_IGNORE_OUTPUT
pp_tokens = [o.token_ids for o in pp_generate(model, prompts, greedy, pipeline_parallel_size=2,
                                              num_microbatches=3)]
pp_logits, _ = pp_forward(model, ids, pos, pipeline_parallel_size=2)
print(f"PP=2 greedy tokens identical to one process: {pp_tokens == tokens_1}; logits max |difference| "
      f"{float((pp_logits - logits_1).abs().max()):.1e}")

# %%
# NBVAL_CHECK_OUTPUT
assert pp_tokens == tokens_1
torch.testing.assert_close(pp_logits, logits_1)
print("PP=2 matches one process")

# %% [markdown]
# ## 5. Prefill/decode disaggregation
#
# Tensor and pipeline parallelism split the *model*; disaggregation splits the *work*. A prefill is compute bound
# (thousands of tokens per step), a decode step memory bound (one token per sequence), and a colocated instance
# mixes them: every decode batched with a 2048-token prefill chunk waits for that chunk — *prefill interference*.
# DistServe (Zhong et al., 2024) and Splitwise (Patel et al., 2024) give the phases different GPUs: P prefill
# instances compute prompts and hand each request's K/V cache over a link to one of D decode instances. The price:
# those bytes cross the link once per request — prompt tokens × 2 × layers × H_kv × D × 2 bytes in bf16 — and a
# fixed P:D split fits one workload's balance of prefill and decode, not every workload's.
#
# `minillm.perf.disagg` runs this on notebook 09's virtual clock: every instance is the real `Scheduler` with its
# own queue and KV blocks, each step priced by the roofline of an H100 running Llama-3-8B (GQA, 8 K/V heads). The
# first token reaches the user when the K/V has reached the decode instance, so TTFT includes the transfer.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
llama3, engine_cfg, h100_step = disagg_bench.setup()
print(f"{'one 4096-token prompt':<28} {'K/V':>8} " + " ".join(f"{name:>13}" for name in KV_LINKS))
for name, cfg in (("Llama-2-7B (MHA)", llama2_7b_config()), ("Llama-3-8B (GQA 32:8)", llama3)):
    nbytes = kv_transfer_bytes(cfg, 4096)
    print(f"{name:<28} {nbytes / 1e9:5.2f} GB " +
          " ".join(f"{transfer_seconds(nbytes, link) * 1e3:10.1f} ms" for link in KV_LINKS.values()))
prefill_s = sum(h100_step([StepChunk(2048, past, past + 2048 == 4096)]) for past in (0, 2048))
print(f"its prefill on one H100 (Llama-3-8B, two 2048-token chunks): {prefill_s * 1e3:.0f} ms")

# %% [markdown]
# **Predict**: four GPUs serve (a) long prompts (2–8 k tokens) with short answers and (b) chat (short prompts, longer
# answers), each under a latency SLO (TTFT and TPOT). Which P:D split serves the most requests per second within the
# SLO — and does it beat four colocated instances? Below, each deployment serves the same Poisson traces at rising
# rates; its *goodput* is the highest rate at which ≥ 90 % of requests meet the SLO (DistServe's definition; 0: not
# even the lowest rate tried).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
size = (disagg_bench.DisaggBenchSize((4,), 30, (5, 10), 60, (50, 90), duration_s=0.0) if FAST else
        disagg_bench.DisaggBenchSize((4,), 120, (5, 6, 8), 400, (50, 90), duration_s=3.0))  # rates per GPU, req/s
links = [KV_LINKS["NVLink"], KV_LINKS["Ethernet-25G"]]  # the fastest and the slowest link
pd_rows = disagg_bench.run_sweeps(size, links=links)
for row in disagg_bench.summary(pd_rows):
    print(f"{row['workload']:>12}, {row['link']:>12}: colocated {row['colocated']:5.0f} req/s, best split "
          f"{row['best_split']} {row['best']:5.0f} req/s ({row['ratio']:.2f}×)")
disagg_bench.plot(pd_rows)
plt.show()

# %% [markdown]
# Long prompts: colocated instances meet TTFT easily but miss TPOT as the rate grows, because almost every step
# carries someone's prefill chunk; dedicated decode instances keep their steps short, so a split with enough prefill
# GPUs serves more requests within the SLO — here about a third more over NVLink. Over 25 Gb/s Ethernet an 8 k-token
# prompt's 1 GB of K/V takes ~0.3 s of the 1 s TTFT budget, and the splits that leave prefill little slack lose their
# advantage. Chat is the opposite case: prompts are a small share of the work and interference is mild, so whole GPUs
# given to prefill are wasted — one prefill GPU cannot keep up with four GPUs' traffic, two leave too few decoders —
# and colocated serving wins whatever the link. Disaggregation is capacity planning: P:D must follow the workload's
# balance of prefill and decode work.
#
# ## 6. Other levers: make the model smaller instead
#
# Spreading a model buys memory and bandwidth with money and communication. Three ways to need less, each measured
# by the perplexity of the real SmolLM2-135M on held-out text (CPython's `pydoc_data.topics`, the evaluation half;
# lower is better):
#
# - **Pruning** zeroes weights. *Unstructured* magnitude pruning drops the smallest |w| of each row — any pattern,
#   which dense hardware cannot skip. **2:4** keeps the 2 largest of every 4 consecutive weights: exactly 50 %,
#   the pattern NVIDIA's sparse tensor cores run up to 2× faster.
# - **Early exit** stops after k of the 30 layers (speculative decoding's self-drafter in notebook 08).
# - **Distillation** trains a smaller *student* to match a *teacher*'s whole next-token distribution (KL divergence
#   to its logits) — here a student made by dropping 4 late layers, healed for under a minute.
#
# **Predict**: rank these by how much perplexity they cost — 25 % magnitude pruning, 2:4 pruning, exiting after 20
# layers, dropping 4 layers.

# %%
# NBVAL_IGNORE_OUTPUT
from minillm.compress.distill import distill, drop_layers  # noqa: E402
from minillm.compress.early_exit import exit_perplexities  # noqa: E402
from minillm.compress.prune import prune_model, sparsity_of  # noqa: E402
from minillm.models.loader import load_model, load_tokenizer  # noqa: E402
from minillm.perf.perplexity import heldout_token_ids, perplexity  # noqa: E402

smol, tokenizer = load_model(None, device="cpu", dtype="float32"), load_tokenizer(None)
eval_ids = heldout_token_ids(tokenizer, "evaluation", 256 if FAST else 512)
PPL = dict(window=128, stride=64) if FAST else dict(window=256, stride=128)
base_ppl = perplexity(smol, eval_ids, **PPL).ppl
print(f"SmolLM2-135M, {eval_ids.numel()} held-out tokens: perplexity {base_ppl:.1f}")

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
pruned = {}
for name, method, sparsity in (("magnitude 25 %", "magnitude", 0.25), ("magnitude 50 %", "magnitude", 0.5),
                               ("2:4 (50 %)", "2:4", 0.5)):
    p = prune_model(smol, method, sparsity)
    pruned[name] = perplexity(p, eval_ids, **PPL).ppl
    print(f"{name:15s}: {sparsity_of(p):4.0%} zeros, perplexity {pruned[name]:9.1f} ({pruned[name] / base_ppl:5.1f}×)")
    del p
EXITS = [10, 20, 26, 28, 30]
exits = {k: r.ppl for k, r in exit_perplexities(smol, eval_ids, EXITS, **PPL).items()}
for k, v in exits.items():
    print(f"exit after {k:2d} of 30 layers: perplexity {v:12.1f}")

# %% [markdown]
# Early exit without training is brutal: the intermediate hidden states are not in the space the final norm and
# LM head read, so even 26 of 30 layers give nonsense (models trained with an exit loss — LayerSkip, CALM — keep
# far more). A small model has little redundancy to prune, and the 2:4 pattern forces half of *every* group of four
# to go, important or not. Now the distillation: drop 4 late layers, measure, heal with KL to the teacher's logits
# on the *calibration* half (never the text we evaluate on), measure again.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
DROP = [20, 22, 24, 26]
student = drop_layers(smol, DROP)
dropped_ppl = perplexity(student, eval_ids, **PPL).ppl
calib_ids = heldout_token_ids(tokenizer, "calibration", 20_000)
losses = distill(student, smol, calib_ids, steps=2 if FAST else 200, batch=2, seq_len=64 if FAST else 128,
                 lr=5e-5, max_seconds=None if FAST else 45)
healed_ppl = perplexity(student, eval_ids, **PPL).ppl
print(f"dropped layers {DROP}: perplexity {dropped_ppl:.1f}; after {len(losses)} distillation steps "
      f"(KL {losses[0]:.2f} -> {losses[-1]:.2f}): {healed_ppl:.1f}; teacher {base_ppl:.1f}")

fig, ax = plt.subplots(figsize=(8, 4))
bars = {"teacher": base_ppl, **pruned, "exit at 28": exits[28], "drop 4 layers": dropped_ppl,
        "drop 4 + distill": healed_ppl}
ax.bar(range(len(bars)), list(bars.values()), color=["k"] + ["tab:blue"] * len(pruned) + ["tab:orange"] +
       ["tab:red", "tab:green"], label=None)
ax.axhline(base_ppl, color="k", linestyle=":", label=f"teacher: {base_ppl:.1f}")
ax.set_xticks(range(len(bars)), list(bars), rotation=25, ha="right")
ax.set(yscale="log", ylabel="perplexity (log scale; lower is better)", title="What shrinking SmolLM2-135M costs")
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# A short distillation recovers part of what dropping layers cost, and every further minute recovers more; the
# published recipes heal for hours on billions of tokens. The pattern holds at scale: pruning and layer dropping
# are cheap to apply and costly in quality unless you retrain; distillation costs training compute and gives the
# best small models (most small open models today are distilled from larger ones).
#
# ## Takeaways
#
# - **Tensor parallelism** splits each layer: column-parallel then row-parallel, one all-reduce per pair — two per
#   layer. Each rank holds 1/N of the weights and of the KV heads; the result is bit-for-bit the same computation
#   up to the order of a sum. It pays when each rank adds memory bandwidth and the link's latency is small against
#   a layer's compute: 8 H100s on NVLink for a 70B model, not two processes on one CPU.
# - **A ring all-reduce** sends 2 (N − 1)/N × n bytes per rank, plus a latency per call; at decode the latency
#   dominates, so the count of collectives matters more than their size.
# - **Pipeline parallelism** splits the layers: little traffic (one activation per stage boundary), but idle
#   bubbles of (p − 1)/(m + p − 1) that micro-batches shrink, and at decode at least p micro-batches in flight.
# - **Replicas** need no communication at all: the first thing to try when the model fits.
# - **Prefill/decode disaggregation** removes prefill interference at the price of one K/V transfer per request and
#   a fixed P:D split: it pays for long prompts over a fast link, and not for short-prompt chat.
# - **Shrinking** is the other lever: pruning and early exit are cheap and cost quality unless the model is trained
#   for them; distillation spends training compute to buy a small model that keeps more of the teacher.
