# %% [markdown]
# # 01 — Anatomy of generation: prefill vs decode
#
# An LLM answers in two phases that stress a machine in opposite ways:
#
# - **Prefill** runs the whole prompt through the model in one forward pass. Every weight matrix multiplies an
#   `L × hidden` block of activations: a matrix–matrix product with plenty of arithmetic per byte read, so it is
#   **compute bound**. It decides the **time to first token (TTFT)** and grows about linearly with the prompt.
# - **Decode** then produces one token per step. Each step multiplies every weight matrix by a single vector:
#   two FLOPs per weight read, so it is **memory bound**. It decides the **time per output token (TPOT)**.
#
# A request's latency is about TTFT + TPOT × (tokens − 1). Users feel the slow requests, not the average one, so
# serving systems report **percentiles**, count **goodput** (requests per second that met a latency target, an
# SLO) and convert throughput into **dollars per million tokens**.
#
# **In this notebook** you predict decode speed from the roofline (exercise 1.1) and write down your own number
# (1.0), measure TTFT and TPOT on this machine, write the pieces of a step — RMSNorm (1.3) and RoPE (1.4), run by
# the model against transformers' logits — the generation loop (1.5) and its top-k/top-p sampler (1.6), see why
# generating without a cache costs O(T²), and build the serving metrics: percentiles (1.2), goodput and cost.
# Every measurement ends up on this machine's roofline.
# Runs in about two minutes on a 2-core CPU; on a GPU it uses the GPU.

# %%
from __future__ import annotations

import math  # the percentile solution uses it
import os
import random
import statistics
import time
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch

from minillm import LLM, SamplingParams
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.course.predictions import predict_decode_tok_s
from minillm.engine.simple import _append, _right_pad, _start, generate
from minillm.perf import metrics, roofline
from minillm.sampling.sampler import sample

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})  # readable figures: ≥ 110 dpi

device = "cuda" if torch.cuda.is_available() else "cpu"
llm = LLM(device=device)  # SmolLM2-135M-Instruct, offline, in the dtype minillm picks for this machine
model, config = llm.model, llm.model.config
dtype = roofline.dtype_name(model.dtype)
print(f"{config.num_parameters() / 1e6:.0f}M parameters, {config.num_layers} layers, hidden {config.hidden_size}, "
      f"vocab {config.vocab_size}, tied embeddings: {config.tie_word_embeddings}; {dtype} on {device}")

# %% [markdown]
# ## 1. Predict with the roofline
#
# A roofline says how fast work of a given **arithmetic intensity** (FLOPs per byte moved) can run on a machine:
# attainable FLOP/s = min(peak FLOP/s, intensity × bandwidth). Below the **ridge point** (peak ÷ bandwidth) the
# memory is the limit, above it the arithmetic units. First we measure this machine's two roofs (a large
# reduction for bandwidth, a large matmul for FLOP/s) — a roofline drawn from measured peaks is an honest one.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
print(roofline.format_measurement(spec))
ridge = roofline.ridge_point(spec, dtype)
print(f"\nridge point for {dtype}: {ridge:.1f} FLOP/byte (an H100 SXM in bf16: "
      f"{roofline.ridge_point(roofline.get_spec('H100-SXM'), 'bfloat16'):.0f})")

# %% [markdown]
# Where do prefill and decode sit? Multiplying activations `x [M × K]` by a weight `W [K × N]` costs `2·M·K·N`
# FLOPs and reads about `K·N` weight elements, so its intensity is about `2M / bytes_per_element` when `M` is
# small: **M** is the number of tokens processed at once. A prefill of L tokens has M = L; a decode step has
# M = 1. The cost model in `minillm.perf.roofline` adds up every layer:

# %% tags=["slide-output"]
for name, cost in [("decode step (1 token)", roofline.decode_step_cost(config, 1, 64, dtype)),
                   ("prefill, 16 tokens", roofline.prefill_cost(config, 1, 16, dtype)),
                   ("prefill, 512 tokens", roofline.prefill_cost(config, 1, 512, dtype))]:
    side = "memory" if cost.intensity < ridge else "compute"
    print(f"{name:22} {cost.flops / 1e9:8.2f} GFLOP {cost.bytes / 1e6:8.1f} MB  "
          f"intensity {cost.intensity:7.1f} FLOP/B -> {side} bound here")

# %% [markdown]
# ### Exercise 1.1 — predict decode speed: the bytes a decode step must read
#
# Since a decode step is memory bound, its time is at least *bytes read ÷ bandwidth*, and nearly all of those
# bytes are weights. Write `decode_weight_bytes(config, dtype)`: the bytes of weights one decode step reads.
# Think about which matrices are really read: every linear layer's weight (each is a matrix–vector product) and
# the RMSNorm weights, yes; but the **embedding table** is only looked up (one row per token), while the **LM head**
# multiplies the hidden state by its whole `vocab × hidden` matrix. With tied embeddings (as in SmolLM2) the
# two share one matrix. `config.num_parameters(include_embeddings=False)` counts the decoder layers and final norm.

# %%
# exercise 1.1: minillm.perf.metrics.decode_weight_bytes

# %%
# NBVAL_CHECK_OUTPUT
checks.check_decode_weight_bytes(decode_weight_bytes)

# %% [markdown]
# ### Your prediction
#
# The bound is bandwidth ÷ weight bytes per step. The engine will not reach it exactly: how many decode tokens
# per second do *you* expect from it at batch 1 on this machine? Write your number (or your formula from the
# bound) before section 2 measures it.

# %%
# exercise 1.0: minillm.course.predictions.predict_decode_tok_s

# %%
weight_bytes = metrics.decode_weight_bytes(config, model.dtype)  # the library's count: your 1.1 may be unfinished
bound_tok_s = spec.memory_bandwidth / weight_bytes
print(f"roofline bound: {bound_tok_s:.1f} decode tokens/s ({spec.memory_bandwidth / 1e9:.1f} GB/s ÷ "
      f"{weight_bytes / 1e6:.0f} MB per step)")
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_decode(predict_decode_tok_s, bound_tok_s)

# %% [markdown]
# ## 2. Measure: TTFT vs prompt length, TPOT vs position
#
# `LLM.generate` records, per request, when each token appeared (`RequestOutput.metrics`): TTFT is the prefill
# plus the first sample, TPOT the mean gap between later tokens. Prompts are random token ids, so their length
# is exact. Each length is measured a few times and we keep the median (this machine is shared; the median
# resists a noisy neighbour).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
prompt_lengths = [16, 64] if FAST else [16, 32, 64, 128, 256, 512]
repeats = 1 if FAST else 3
rng = random.Random(0)


def random_prompt(n: int) -> list[int]:
    """``n`` random token ids (no special tokens), a prompt of exactly ``n`` tokens."""
    return [rng.randrange(100, config.vocab_size) for _ in range(n)]


one_token = SamplingParams(max_tokens=1, temperature=0)
llm.generate([random_prompt(8)], one_token)  # warm-up: first calls pay for allocations and thread start-up
ttft = {}
for n in prompt_lengths:
    runs = [llm.generate([random_prompt(n)], one_token)[0].metrics.ttft_s for _ in range(repeats)]
    ttft[n] = statistics.median(runs)
    print(f"prompt {n:4d} tokens: TTFT {ttft[n] * 1e3:7.1f} ms  ({n / ttft[n]:7.0f} prompt tokens/s)")

# %% [markdown]
# Now one long generation: TPOT is the gap between consecutive tokens. `ignore_eos=True` keeps the model going
# to exactly `max_tokens`.

# %%
# NBVAL_IGNORE_OUTPUT
n_out = 24 if FAST else 128
out = llm.generate([random_prompt(16)], SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True))[0]
m = out.metrics
gaps = [b - a for a, b in zip(m.token_times_s, m.token_times_s[1:], strict=False)]  # inter-token latencies, seconds
measured_tok_s = 1 / statistics.median(gaps)
print(f"TTFT {m.ttft_s * 1e3:.1f} ms, TPOT {m.tpot_s * 1e3:.1f} ms (median gap {statistics.median(gaps) * 1e3:.1f} ms)"
      f" -> {measured_tok_s:.1f} tokens/s; of the {m.latency_s:.2f} s latency, decode took "
      f"{m.tpot_s * (n_out - 1) / m.latency_s:.0%}")

# %% [markdown]
# ### Predict, then measure
#
# Your number, the measurement and the bound side by side. A bound may not be beaten (allowing 25 % for
# measurement noise on a shared machine: past that the byte count is wrong); below it, the fraction reached is
# the **model bandwidth utilisation (MBU)**, and the verdict says what it means. On a GPU this small model at
# batch 1 is limited by kernel-launch overhead (hundreds of tiny kernels per step, ~5 µs each), so its MBU is
# low: the bound is still a bound.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
verdict = checks.judge_prediction(my_prediction, measured_tok_s, bound=bound_tok_s, what="decode tokens/s",
                                  unit="tokens/s", see="per step the engine also runs Python, sampling and a few "
                                  "hundred small ops (notebook 04's launch count)")

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
bound = [max(roofline.prefill_cost(config, 1, n, dtype).flops / spec.peak(dtype),
             roofline.prefill_cost(config, 1, n, dtype).bytes / spec.memory_bandwidth) for n in prompt_lengths]
ax1.plot(prompt_lengths, [ttft[n] * 1e3 for n in prompt_lengths], "o-", label="measured TTFT")
ax1.plot(prompt_lengths, [b * 1e3 for b in bound], "k--", label="roofline bound")
ax1.set(xlabel="prompt length (tokens)", ylabel="ms", title="Prefill: TTFT grows with the prompt")
ax1.legend()
step_bound = roofline.decode_step_cost(config, 1, 16, dtype).bytes / spec.memory_bandwidth
ax2.plot(range(17, 16 + len(gaps) + 1), [g * 1e3 for g in gaps], ".", label="measured gap")
ax2.axhline(step_bound * 1e3, color="k", linestyle="--", label="roofline bound")
ax2.set(xlabel="position of the token", ylabel="ms", title="Decode: TPOT is flat", ylim=(0, None))
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Inside a step, and the loop around it
#
# Every decoder layer normalises its input with **RMSNorm** and rotates q and k with **RoPE** before attention;
# the engine then turns the last position's logits into a token with **top-k / top-p** sampling. You write these
# three pieces, and the model and the sampler run them: each check swaps your function into minillm's model (or
# its sampler) and compares against transformers' Llama.
#
# ### Exercise 1.3 — RMSNorm
#
# `torch_rms_norm(x, weight, eps)` normalises each row of `x [..., K]` by its root mean square:
# `x / sqrt(mean(x²) + eps) * weight`. The docstring gives the contract transformers' `LlamaRMSNorm` follows
# (which dtype the statistics use, where `eps` goes, when the weight multiplies); the check holds you to it on
# fp32, bf16 and fp16 rows, then runs the whole model with your norm in every layer.

# %%
# exercise 1.3: minillm.kernels.select.torch_rms_norm

# %%
# NBVAL_CHECK_OUTPUT
checks.check_rms_norm(torch_rms_norm)

# %% [markdown]
# ### Exercise 1.4 — rotary position embeddings
#
# Attention scores must depend on where tokens are *relative* to each other. RoPE rotates each pair of a head's
# coordinates by an angle proportional to the token's position, `pos · θ_i` with `θ_i = base^(−2i/D)`: the dot
# product of a rotated q and a rotated k then depends only on the difference of their positions. The model gives
# you the angles' `cos` and `sin` (`RotaryEmbedding`, computed once per forward); `apply_rope(x, cos, sin)`
# rotates `x [B, L, H, D]`. Which coordinates form a pair is a convention: the docstring states Llama's.

# %%
# exercise 1.4: minillm.layers.rotary.apply_rope

# %%
# NBVAL_CHECK_OUTPUT
checks.check_apply_rope(apply_rope)

# %% [markdown]
# ### Why a cache: the naive loop
#
# The simplest generation loop feeds the *whole* sequence back through the model for every new token
# (`generate(..., cached=False)`). Step t is a prefill of t tokens: O(t) linear FLOPs and O(t²) attention, so
# the per-token time grows with the position and the whole generation costs O(T²) (O(T³) in attention).
# The cached loop (notebook 02 builds its cache) keeps every step at one token.
#
# ### Exercise 1.5 — the generation loop
#
# Write that loop for a batch of prompts of different lengths: one forward pass per step over the unfinished
# requests, each row's next token sampled from the logits at its own last token, every token yielded as soon as
# it exists. It is a Python generator: `yield` each `StepOutput`, `return` the final states. The helpers it
# names are imported above: `_right_pad` pads the rows, `sample` draws a token per row, `_append` records it.

# %%
# exercise 1.5: minillm.engine.simple.stream_naive

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - Loop while some request is not `done`, and feed only those: finished requests leave the batch.
# - `_right_pad(rows, model.device)` returns ids, positions and `last`, each row's last real index: take
#   `hidden[torch.arange(len(active)), last]`, not `hidden[:, -1]`, which is padding for shorter rows.
# - `_append(seqs[i], token, eos, max_len, i)` returns the `StepOutput` to yield.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_generation_loop(stream_naive)

# %% [markdown]
# Your loop against the library's cached loop: the same greedy tokens, at very different costs per token.

# %%
# NBVAL_IGNORE_OUTPUT
def run_loop(loop, prompts: list[list[int]], params: SamplingParams) -> list:
    """Drive a generation loop (a generator) to its end; -> the final states it returns."""
    stream = loop(model, prompts, params)
    while True:
        try:
            next(stream)
        except StopIteration as done:
            return done.value


n_new = 12 if FAST else 48
prompt = random_prompt(8)
params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
generate(model, [prompt], SamplingParams(max_tokens=2, temperature=0))  # warm-up
runs = {"naive": run_loop(stream_naive, [prompt], params)[0], "cached": generate(model, [prompt], params)[0]}
assert runs["naive"].output == runs["cached"].output, "your loop and the cached loop must produce the same tokens"
for kind, seq in runs.items():
    t = seq.metrics.token_times_s
    plt.plot(range(len(prompt) + 2, len(prompt) + len(t) + 1),
             [(b - a) * 1e3 for a, b in zip(t, t[1:], strict=False)], ".-",
             label=f"{kind}{' (yours)' if kind == 'naive' else ''}: {seq.metrics.latency_s:.2f} s in total")
plt.gca().set(xlabel="sequence length when the token is produced", ylabel="ms per token",
              title="Naive recompute vs cached decoding", ylim=(0, None))
plt.legend()
plt.show()

# %% [markdown]
# ### Exercise 1.6 — top-k and top-p sampling
#
# Your loop samples every token with `sample`, which divides the logits by the temperature and then filters
# them: **top-k** keeps the k most likely tokens, **top-p** (the nucleus) keeps the smallest set of most likely
# tokens whose probability reaches p, measured on what top-k kept. Everything else gets logit −∞, so the softmax
# renormalises the kept set by itself. Write `top_k_top_p_mask(logits, k, p)`; the docstring fixes the details a
# sampler must agree on (ties, the token that crosses p, what turns a filter off). The check compares kept sets
# exactly, then runs the engine's sampler with your filter and tests a seeded sample of its tokens with a
# chi-square against the filtered distribution.

# %%
# exercise 1.6: minillm.sampling.sampler.top_k_top_p_mask

# %%
# NBVAL_CHECK_OUTPUT
checks.check_top_k_top_p_mask(top_k_top_p_mask)

# %% [markdown]
# Your filter on the model's real next-token distribution: how many tokens each setting leaves to sample from.

# %%
# NBVAL_IGNORE_OUTPUT
with torch.inference_mode():
    ids = torch.tensor([random_prompt(12)], device=model.device)
    last = model(ids, torch.arange(12, device=model.device)[None])[0, -1].float().cpu()
for k, p in [(0, 1.0), (50, 1.0), (0, 0.9), (50, 0.9), (0, 0.5)]:
    kept = int(top_k_top_p_mask(last.clone(), k, p).isfinite().sum())
    print(f"top_k {k:3d}, top_p {p:.1f}: {kept:6d} of {config.vocab_size} tokens can be sampled")

# %% [markdown]
# ## 4. Serving metrics: percentiles
#
# Sixteen requests arrive together and a one-at-a-time server answers them first come, first served. A user's
# TTFT includes the time spent **waiting** for the requests ahead: the queue, not the model, makes the tail.

# %%
# NBVAL_IGNORE_OUTPUT
n_requests = 4 if FAST else 16
trace = [(rng.choice([16, 32, 64, 128, 256]), rng.choice([8, 16, 24])) for _ in range(n_requests)]
t0 = time.perf_counter()
served = []
for prompt_len, max_tokens in trace:
    o = llm.generate([random_prompt(prompt_len)], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                 ignore_eos=True))[0]
    served.append(SimpleNamespace(ttft_s=o.metrics.first_token_s - t0, tpot_s=o.metrics.tpot_s,
                                  service_ttft_s=o.metrics.ttft_s, output_tokens=o.metrics.output_tokens))
duration_s = time.perf_counter() - t0
user_ttft = [r.ttft_s for r in served]
print(f"{n_requests} requests in {duration_s:.1f} s; user TTFT from {min(user_ttft) * 1e3:.0f} ms to "
      f"{max(user_ttft) * 1e3:.0f} ms (the model's own prefill: at most "
      f"{max(r.service_ttft_s for r in served) * 1e3:.0f} ms)")

# %% [markdown]
# ### Exercise 1.2 — percentiles
#
# Write `percentile(values, q)`: sort the values, then read the value at fractional index `q/100 × (n − 1)`,
# interpolating linearly between its two neighbours (numpy's default). p0 is the minimum, p100 the maximum.

# %%
# exercise 1.2: minillm.perf.metrics.percentile

# %%
# NBVAL_CHECK_OUTPUT
checks.check_percentile(percentile)

# %% [markdown]
# Plugged into the library through an explicit argument — `metrics.summarize(values, percentile=...)` uses
# *your* function — first on the classic example: nine requests at 100 ms and one 3 s outlier.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
example = [0.1] * 9 + [3.0]
summary = metrics.summarize(example, percentile=percentile)
print({k: round(v, 3) for k, v in summary.items()})
print(f"the median says {summary['p50'] * 1e3:.0f} ms, the mean {summary['mean'] * 1e3:.0f} ms: "
      "one outlier moves the mean, percentiles show it for what it is")

# %%
# NBVAL_IGNORE_OUTPUT
for name, values in [("user TTFT", user_ttft), ("TPOT", [r.tpot_s for r in served])]:
    s = metrics.summarize(values, percentile=percentile)
    print(f"{name:9}  " + "  ".join(f"{k} {v * 1e3:7.1f} ms" for k, v in s.items()))

# %% [markdown]
# ### Goodput under an SLO
#
# Throughput counts every request; **goodput** counts only those that met the service-level objective on *both*
# TTFT and TPOT (meeting a limit exactly counts), per second of wall time: `metrics.goodput(requests, duration_s,
# ttft_slo_s=, tpot_slo_s=)`.

# %%
# NBVAL_IGNORE_OUTPUT
slos = [0.2, 0.5, 1, 2, 5, 10, 20]
throughput = len(served) / duration_s
good = [metrics.goodput(served, duration_s, ttft_slo_s=s, tpot_slo_s=0.1) for s in slos]
plt.semilogx(slos, good, "o-", label="goodput (TPOT ≤ 100 ms)")
plt.axhline(throughput, color="k", linestyle="--", label=f"throughput {throughput:.2f} req/s")
plt.gca().set(xlabel="TTFT SLO (s)", ylabel="requests / s", title="Goodput of a one-at-a-time server",
              ylim=(0, None))
plt.legend()
plt.show()

# %% [markdown]
# ### Dollars per million tokens
#
# A machine rented at `$ per hour` that produces `tokens per second` costs
# `$/h ÷ (tok/s × 3600) × 10⁶` per million tokens (`metrics.cost_per_million_tokens`): $2/h at 100 tokens/s is
# $5.56 per million.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
# Prices are assumptions for illustration; put in your own. The point is the ratio: throughput sets the price.
PRICE_PER_HOUR = {"cpu": 0.10, "cuda": 2.00}[device]  # assumed: a small cloud VM / one rented data-center GPU
served_tok_s = sum(r.output_tokens for r in served) / duration_s
for label, tok_s in [("this server, one request at a time", served_tok_s),
                     ("decode alone, measured", measured_tok_s),
                     ("decode at the roofline bound", roofline.decode_tokens_per_s_bound(config, dtype, spec))]:
    dollars = metrics.cost_per_million_tokens(PRICE_PER_HOUR, tok_s)
    print(f"{label:36} {tok_s:8.1f} tok/s -> ${dollars:8.2f} per 1M tokens")

# %% [markdown]
# ### What one request costs, prefill included
#
# A request pays for its prompt's prefill and then one decode step per output token. Per token, prefill is cheap:
# it reuses every weight across the whole prompt (compute bound), while each output token reads all the weights
# again (memory bound). The roofline predicts the ratio of an output token's cost to an input token's — the reason
# price lists charge several times more for output tokens — and the measurements above give it on this machine.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
P, ANSWER = prompt_lengths[-1], 128  # a request: the longest prompt measured, a 128-token answer


def roofline_time(cost: roofline.Cost) -> float:
    """The roofline's lower bound on the time of ``cost`` on this machine (seconds)."""
    return max(cost.flops / spec.peak(dtype), cost.bytes / spec.memory_bandwidth)


per_input = {"measured": ttft[P] / P, "roofline": roofline_time(roofline.prefill_cost(config, 1, P, dtype)) / P}
per_output = {"measured": 1 / measured_tok_s,
              "roofline": roofline_time(roofline.decode_step_cost(config, 1, P + ANSWER // 2, dtype))}
dollars_per_s = PRICE_PER_HOUR / 3600
for kind in ("measured", "roofline"):
    request_s = P * per_input[kind] + ANSWER * per_output[kind]
    print(f"{kind:9}: input token {per_input[kind] * 1e3:7.2f} ms, output token {per_output[kind] * 1e3:7.2f} ms "
          f"(ratio {per_output[kind] / per_input[kind]:5.1f}×); one request ({P} in, {ANSWER} out) "
          f"{request_s:6.2f} s = ${request_s * dollars_per_s * 1e3:.4f} per thousand requests "
          f"at ${PRICE_PER_HOUR:.2f}/h, {P * per_input[kind] / request_s:.0%} of it prefill")
conclude("output token ÷ input token, measured", per_output["measured"] / per_input["measured"], 1, expect=">",
         unit="×", held="an output token costs more than an input token here, as the roofline predicts",
         missed="an input token cost as much as an output token here: prefill did not reach the compute roof")
conclude("that ratio, measured ÷ roofline", (per_output["measured"] / per_input["measured"])
         / (per_output["roofline"] / per_input["roofline"]), 1, expect="≈", tolerance=0.5, unit="×",
         held="the roofline predicts the output/input cost ratio within a factor of about two",
         missed="the measured ratio is off the roofline's by more than half: one of the two phases runs far from "
                "its roof on this machine (section 5 shows which)")

# %% [markdown]
# ## 5. Place the measurements on the roofline
#
# Each prefill and the decode step become a point: x = the cost model's intensity, y = its FLOPs ÷ measured
# time. Points on the slanted roof are memory bound, points under the flat roof compute bound; the gap to the
# roof is what an optimisation can still win.

# %%
# NBVAL_IGNORE_OUTPUT
ends = (prompt_lengths[0], prompt_lengths[-1])  # label the shortest and longest prefill; the rest lie between
points = [roofline.RooflinePoint.from_cost(f"prefill {n}" if n in ends else "",
                                           roofline.prefill_cost(config, 1, n, dtype), ttft[n])
          for n in prompt_lengths]
points.append(roofline.RooflinePoint.from_cost("decode", roofline.decode_step_cost(config, 1, 16 + n_out // 2, dtype),
                                               1 / measured_tok_s))
roofline.plot_roofline(spec, points, dtype=dtype)
plt.show()

# %% [markdown]
# ## Takeaways
#
# - **Prefill** is a matrix–matrix product: intensity ≈ prompt length, compute bound; it sets TTFT, which grows
#   with the prompt.
# - **Decode** reads every weight for one token: intensity ≈ 1 FLOP/byte at 2 bytes per weight, memory bound;
#   it sets TPOT, and *bandwidth ÷ weight bytes* predicts it (the embedding table is not read, the LM head is).
# - Without a cache every step re-runs a growing prefill: O(T²) work for T tokens. Notebook 02 fixes that.
# - Report **percentiles**, not means; judge a server by **goodput** under an SLO; **$/1M tokens** =
#   $/h ÷ (tok/s × 3600) × 10⁶, so throughput is the lever on cost — batching (notebook 06) moves decode up the
#   slanted roof.
# - A request's cost is its prefill plus one decode step per output token; per token, an output token costs
#   several input tokens (memory bound vs compute bound), which is why providers price output tokens higher.
