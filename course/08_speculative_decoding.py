# %% [markdown]
# # 08 — Speculative decoding
#
# A batch-1 decode step reads every weight to produce **one** token (notebook 01): the arithmetic units idle while
# the bytes stream in. If we knew the next few tokens, we could feed all of them in *one* forward — it reads the
# same weights, so it costs about the same — and get the model's verdict on each. **Speculative decoding**
# (Leviathan et al., Chen et al., 2023) does exactly that:
#
# 1. a cheap **proposer** guesses γ tokens x₁..x_γ: a small model with the same tokenizer, the target itself
#    quantized, its first layers (early exit), or no model at all — the n-gram that followed the same words
#    earlier in the prompt;
# 2. **one target forward** over [last token, x₁..x_γ] gives the target's distributions p₁..p_{γ+1};
# 3. a **rejection rule** keeps a prefix of the guesses and adds one token of its own, so that the output is
#    distributed *exactly* as if the target had sampled token by token (greedy: exactly the same tokens);
# 4. the **KV cache** entries the forward wrote for rejected guesses are rolled back.
#
# Each target forward now yields between 1 and γ + 1 tokens. If each guess is accepted with probability α, the
# expected number is 1 + α + … + α^γ = **(1 − α^(γ+1)) / (1 − α)**. Reported gains: 2–3× on T5-XXL with a
# T5-small draft (γ = 7, α ≈ 0.75: 3.4× fewer target calls), 2–2.5× for Chinchilla-70B with a 4B draft, about 2×
# for Medusa's extra heads and 3× for EAGLE; prompt lookup (n-grams) about 2× on copy-heavy tasks.
#
# **In this notebook** you measure on the roofline why verifying γ + 1 tokens costs about one decode step; write
# the accept/resample rule (exercise 8.1) and prove with a chi-square test that its tokens follow the target while
# the draft's own samples do not; write the n-gram proposer (8.2) and the rollback of rejected tokens' KV blocks
# (8.3); run your three pieces inside the real engine; predict the speedup from α, γ and the proposer's cost
# before measuring α and tokens/s against γ per proposer on copy-heavy and open-ended prompts; and see where
# speculation loses: open-ended text and compute-bound batches. A few minutes on a 2-core CPU; on a GPU it uses
# the GPU.

# %%
from __future__ import annotations

import dataclasses
import math
import os
import random
import statistics
import time
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from torch import Tensor

from minillm import LLM, EngineConfig, LLMEngine, SamplingParams
from minillm.config import SpeculativeConfig
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.engine.spec_decode import SpecDecoder
from minillm.kv.block_manager import BlockManager
from minillm.kv.contiguous import KVCache
from minillm.perf import roofline
from minillm.perf.bench.spec import PROMPTS, predicted_tokens_per_call
from minillm.perf.simulate import llama2_7b_config
from minillm.sampling.rejection import check_verify_inputs
from minillm.sampling.sampler import probabilities
from minillm.spec.ngram import NgramProposer

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})

device = "cuda" if torch.cuda.is_available() else "cpu"
llm = LLM(device=device)  # minillm picks the dtype: fp32 on this CPU, bf16 on a GPU that has it, fp16 on a T4
model, config, tok = llm.model, llm.model.config, llm.tokenizer
dtype = roofline.dtype_name(model.dtype)
llama, h100 = llama2_7b_config(), roofline.get_spec("H100-SXM")  # the modelled large-scale counterpart
machine = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
copy_prompt = llm.apply_chat_template([{"role": "user", "content": PROMPTS["copy: repeat"]}])
N_TOKENS = 12 if FAST else 32  # tokens generated per measured request
print(f"SmolLM2-135M-Instruct, {dtype} on {device}; modelled: Llama-2-7B bf16 on {h100.name}")

# %% [markdown]
# ## 1. Why checking γ + 1 tokens costs about one step
#
# Feeding L tokens through the model instead of one reads the same weights and does L times the arithmetic. As
# long as L × (FLOPs per byte of one token) stays below the machine's **ridge point**, the forward is memory bound
# and its time barely grows. The cost model prices exactly the verification forward: L = γ + 1 new tokens after a
# 128-token context, logits for every row (`prefill_cost(..., all_logits=True)`), against one decode step.
# **Predict** before running: on an H100 (ridge ≈ 295 FLOP/byte in bf16), how much slower than a decode step is a
# forward of 8 tokens? And on this CPU, whose ridge is a few FLOP/byte?

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
CTX = 128
LENGTHS = [1, 2, 3, 5, 8] if FAST else [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32]


def roofline_s(cost: roofline.Cost, spec, dt: str) -> float:
    """Roofline time of a step: the slower of moving its bytes and doing its FLOPs."""
    return max(cost.bytes / spec.memory_bandwidth, cost.flops / spec.peak(dt))


def verify_cost(cfg, batch: int, L: int, dt: str) -> roofline.Cost:
    """One target forward over L tokens per sequence (the last token + γ = L − 1 guesses) after CTX cached ones."""
    return roofline.prefill_cost(cfg, batch, L, dt, past_len=CTX - 1, all_logits=True)


def forward_timer(L: int):
    """A function timing one forward of L tokens after a CTX-token context (contiguous KV cache, built here once)."""
    ids = torch.randint(0, config.vocab_size, (1, CTX + L), device=device)
    cache = KVCache(config, 1, CTX + L, dtype=model.dtype, device=model.device, kernels=model.kernels)
    with torch.inference_mode():
        pos = torch.arange(CTX, device=device)[None]
        cache.begin(pos)
        model.hidden_states(ids[:, :CTX], pos, cache)  # the context's K/V, once

    @torch.inference_mode()
    def once() -> float:
        pos = torch.arange(CTX, CTX + L, device=device)[None]  # the same slots every time: overwritten
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        cache.begin(pos)
        model.compute_logits(model.hidden_states(ids[:, CTX:], pos, cache)[0])
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    return once


timers = {L: forward_timer(L) for L in LENGTHS}
timers[1]()  # warm-up (first-call kernel compilation)
samples = {L: [] for L in LENGTHS}
for _ in range(3 if FAST else 7):  # rounds over all lengths: a burst of load on a shared machine hits them alike
    for L in LENGTHS:
        samples[L].append(timers[L]())
measured_fwd = {L: min(ts) for L, ts in samples.items()}  # other jobs only add time: keep the fastest
step_1 = measured_fwd[1]
print(f"this {device}: ridge {roofline.ridge_point(machine, dtype):.1f} FLOP/byte ({dtype}); H100: "
      f"{roofline.ridge_point(h100, 'bfloat16'):.0f} (bf16)")
print(f"{'L':>3} {'this machine, measured':>23} {'this machine, roofline':>23} {'Llama-2-7B H100, roofline':>26}")
for L in LENGTHS:
    here = roofline_s(verify_cost(config, 1, L, dtype), machine, dtype) / roofline_s(
        verify_cost(config, 1, 1, dtype), machine, dtype)
    big = roofline_s(verify_cost(llama, 1, L, "bfloat16"), h100, "bfloat16") / roofline_s(
        verify_cost(llama, 1, 1, "bfloat16"), h100, "bfloat16")
    print(f"{L:3d} {measured_fwd[L] * 1e3:12.1f} ms = {measured_fwd[L] / step_1:4.2f}× {here:22.2f}× {big:25.2f}×")

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(LENGTHS, [measured_fwd[L] / step_1 for L in LENGTHS], "o-", color="tab:green",
        label=f"SmolLM2-135M on this {device}, measured")
ax.plot(LENGTHS, [roofline_s(verify_cost(config, 1, L, dtype), machine, dtype)
                  / roofline_s(verify_cost(config, 1, 1, dtype), machine, dtype) for L in LENGTHS], "--",
        color="tab:green", label=f"SmolLM2-135M on this {device}, roofline")
ax.plot(LENGTHS, [roofline_s(verify_cost(llama, 1, L, "bfloat16"), h100, "bfloat16")
                  / roofline_s(verify_cost(llama, 1, 1, "bfloat16"), h100, "bfloat16") for L in LENGTHS], "-",
        color="tab:blue", label="Llama-2-7B on an H100, roofline")
ax.plot(LENGTHS, LENGTHS, ":", color="gray", label="L× (compute bound: no gain possible)")
ax.set(xlabel="tokens in one forward, L = γ + 1", ylabel="time ÷ one decode step",
       title="What a verification forward costs", ylim=(0, max(LENGTHS) / 2))
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The same forwards on this machine's roofline. A forward of L = γ + 1 rows reads every weight once and does L rows
# of arithmetic with it, so its intensity grows about L-fold (x, from the cost model), while y is its FLOPs ÷ the
# time measured above. As long as the points climb along the sloped bandwidth roof, the extra rows ride on the same
# weight read and verification is nearly free; once they reach the ridge they flatten against the compute roof and
# every extra guess costs its full arithmetic. **Predict** first: at which γ does this machine's ridge fall?

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
ridge_here = roofline.ridge_point(machine, dtype)
shown = {LENGTHS[0], LENGTHS[len(LENGTHS) // 2], LENGTHS[-1]}  # labelled points (the others sit between them)
verify_points = [roofline.RooflinePoint.from_cost(f"verify γ={L - 1}" if L in shown else "",
                                                  verify_cost(config, 1, L, dtype), measured_fwd[L], phase="decode")
                 for L in LENGTHS]
for L in LENGTHS:
    cost = verify_cost(config, 1, L, dtype)
    print(f"γ = {L - 1:2d}: {cost.intensity:6.2f} FLOP/byte, {cost.flops / measured_fwd[L] / 1e9:7.2f} GFLOP/s "
          f"measured, {cost.flops / measured_fwd[L] / roofline.attainable_flops(machine, cost.intensity, dtype):6.1%}"
          " of the roofline")
print(f"this machine's ridge: {ridge_here:.2f} FLOP/byte in {dtype}")
roofline.plot_roofline(machine, verify_points, dtype=dtype)
plt.show()
conclude(f"one forward of L = {LENGTHS[-1]} rows ÷ one decode step", measured_fwd[LENGTHS[-1]] / step_1,
         float(LENGTHS[-1]), expect="<", unit="×",
         held=f"checking {LENGTHS[-1]} tokens at once costs less than {LENGTHS[-1]} decode steps here: the rows share "
              "one weight read",
         missed=f"checking {LENGTHS[-1]} tokens at once costs as much as {LENGTHS[-1]} decode steps here: the forward "
                "is compute bound, and verification saves nothing")

# %% [markdown]
# On an H100 a forward of 16 tokens costs about what a single token does: the step is a weight read either way.
# That is the room speculative decoding uses. On a CPU the ridge is an order of magnitude or two lower, so the
# forward turns compute bound after a handful of tokens and every extra guess costs real time: a CPU wants a small
# γ. (On a shared machine the measured line is noisy; it is the fastest of several rounds.) Call **v(γ)** the cost of
# verifying γ guesses in units of one decode step (the table above at L = γ + 1).
#
# ## 2. Build: the accept/resample rule
#
# Given the target's distributions p₁..p_{γ+1} (row i: the next-token distribution after the guesses before it)
# and the draft's q₁..q_γ, walk the guesses in order:
#
# - accept xᵢ with probability **min(1, pᵢ(xᵢ) / qᵢ(xᵢ))** — a guess the target likes at least as much as the draft
#   is always kept;
# - at the first rejection, emit one token drawn from **norm(max(0, pᵢ − qᵢ))** — the probability mass the draft
#   under-proposed — and stop;
# - if every guess was accepted, emit a **bonus** token from p_{γ+1}: the forward computed it anyway.
#
# Why exact: a token y comes out at step i either as an accepted guess, q(y)·min(1, p(y)/q(y)) = min(p, q)(y), or
# from the residual after a rejection, (1 − Σ min(p, q)) · (p − min(p, q))(y) / Σ(p − min(p, q)) = p(y) − min(p,
# q)(y); the sum is p(y). An n-gram guess has no distribution: q is a point mass on xᵢ, so accept with probability
# pᵢ(xᵢ), and the residual is pᵢ with xᵢ removed. Temperature, top-k and top-p are applied to both sides first
# (`probabilities(logits, params)`). **Greedy** (temperature 0) is the limit: keep the longest prefix of guesses
# equal to the target's argmax, then the target's argmax — exactly the tokens plain greedy decoding produces.
#
# ### Exercise 8.1 — `rejection_sample`

# %%
# exercise 8.1: minillm.sampling.rejection.rejection_sample

# %%
# NBVAL_CHECK_OUTPUT
checks.check_rejection_sample(rejection_sample)

# %% [markdown]
# ### Test it like vLLM does: the histogram of many samples
#
# A toy "model": the next token's logits depend only on the previous token (tables for a target and a draft over
# 6 tokens, with the draft disagreeing enough that about half its guesses are rejected). Generate the first two
# tokens many times with your rule, at γ = 1 (the second token is then often the bonus token, drawn from the row
# after the last draft) and at γ = 2, and compare the frequency of every pair (t₁, t₂) with the exact target
# probability p(t₁)·p(t₂ | t₁) by Pearson's chi-square test. Then do the same with a "verifier" that keeps every
# guess — sampling from the draft.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
V_TOY, N_TOY = 6, 2000 if FAST else 10000
toy_params = SamplingParams(temperature=0.9, top_k=5)
g = torch.Generator().manual_seed(1)
target_table = torch.randn(V_TOY, V_TOY, generator=g) * 1.5
draft_table = target_table + torch.randn(V_TOY, V_TOY, generator=g) * 1.5


def keep_every_guess(rows, guesses, q, params, generator):
    """Not a verifier: the draft's guesses, plus a token from the target's last row."""
    return list(guesses) + [int(torch.multinomial(probabilities(rows[-1], params), 1, generator=generator))]


def first_two_tokens(verify, n: int, gamma: int = 2) -> tuple[Tensor, float]:
    """n runs of two generated tokens from token 0 (``gamma`` guesses per verification, repeated until two
    exist); -> (pair counts [V, V], acceptance rate)."""
    counts, gen, proposed, accepted = torch.zeros(V_TOY, V_TOY), torch.Generator().manual_seed(0), 0, 0
    for _ in range(n):
        ctx = [0]
        while len(ctx) < 3:
            guesses, qs, prev = [], [], ctx[-1]
            for _ in range(gamma):
                q = probabilities(draft_table[prev], toy_params)
                prev = int(torch.multinomial(q, 1, generator=gen))
                guesses.append(prev)
                qs.append(q)
            out = verify(target_table[[ctx[-1], *guesses]], guesses, torch.stack(qs), toy_params, gen)
            proposed, accepted = proposed + gamma, accepted + len(out) - 1
            ctx += out
        counts[ctx[1], ctx[2]] += 1
    return counts, accepted / proposed


def chi_square(counts: Tensor, probs: Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with probability > 0 and its degrees of freedom (a sample in a cell of
    probability 0 makes the statistic infinite)."""
    expected, observed = probs.flatten() * counts.sum(), counts.flatten()
    live = expected > 0
    if (observed[~live] > 0).any():
        return math.inf, int(live.sum()) - 1
    return float(((observed[live] - expected[live]) ** 2 / expected[live]).sum()), int(live.sum()) - 1


def critical_value(df: int, z: float = 3.09) -> float:
    """Chi-square quantile by the Wilson–Hilferty approximation; z = 3.09: significance 0.001."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


p_first = probabilities(target_table[0], toy_params)
exact = p_first[:, None] * probabilities(target_table, toy_params)  # (V, V): p(t1) p(t2 | t1)
threads = torch.get_num_threads()
torch.set_num_threads(1)  # thousands of tiny ops: thread wake-ups would cost more than the work
try:
    yours_1, _ = first_two_tokens(rejection_sample, N_TOY, gamma=1)  # the bonus token's row is tested here
    yours, alpha_toy = first_two_tokens(rejection_sample, N_TOY)
    drafts_only, _ = first_two_tokens(keep_every_guess, N_TOY)
finally:
    torch.set_num_threads(threads)
for name, counts in (("your rule, γ = 1", yours_1), ("your rule, γ = 2", yours),
                     ("keep every guess", drafts_only)):
    stat, df = chi_square(counts, exact)
    print(f"{name:17}: chi-square {stat:8.1f} (df {df}, critical {critical_value(df):.1f} at 0.001) -> "
          f"{'consistent with the target' if stat <= critical_value(df) else 'NOT the target distribution'}")
print(f"acceptance rate of the toy draft: {alpha_toy:.2f}")
fig, ax = plt.subplots(figsize=(9, 3.5))
order = exact.flatten().argsort(descending=True)[:18]
xs = torch.arange(len(order)).float()
ax.bar(xs - 0.27, exact.flatten()[order], 0.27, label="exact target p(t₁)·p(t₂|t₁)", color="black")
ax.bar(xs, yours.flatten()[order] / N_TOY, 0.27, label="your rejection_sample", color="tab:blue")
ax.bar(xs + 0.27, drafts_only.flatten()[order] / N_TOY, 0.27, label="keep every guess (the draft)",
       color="tab:red")
ax.set_xticks(xs, [f"{int(i) // V_TOY},{int(i) % V_TOY}" for i in order], fontsize=7)
ax.set(xlabel="pair (t₁, t₂), most likely under the target first", ylabel="frequency",
       title=f"{N_TOY} samples of the first two tokens, γ = 2")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The rule's samples fall within chance of the target; keeping the guesses gives the *draft's* distribution, far
# outside it. The test is also how this library's suite checks the engine (tests/sampling/test_rejection.py), and
# how vLLM tests its rejection sampler.
#
# ## 3. Predict the speedup
#
# Per target call, speculation gains E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens, and pays γ draft steps plus one
# verification. In units of one target decode step, a draft step costs **c**, and since both are memory bound, **c
# is the ratio of the bytes they read**; verification costs v(γ) (section 1). So
#
# $$\text{speedup} = \frac{E(\alpha, \gamma)}{\gamma\,c + v(\gamma)}.$$
#
# The cost model gives each proposer's c from its bytes on the roofline:

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
target_bytes = roofline.decode_step_cost(config, 1, CTX, dtype).bytes
cost_ratio = {
    "ngram (prompt lookup)": 0.0,  # a scan of the context: no weights at all
    "early exit, 8 of 30 layers": roofline.decode_step_cost(dataclasses.replace(config, num_layers=8), 1, CTX,
                                                             dtype).bytes / target_bytes,
    "quantized self (int4 weights)": roofline.decode_step_cost(config, 1, CTX, dtype,
                                                                weight_dtype="int4").bytes / target_bytes,
    "Llama-2-7B target, 135M-class draft": 135e6 / 6.7e9,  # parameters ≈ bytes ratio at the same dtype
}
for name, c in cost_ratio.items():
    print(f"{name:38} c = {c:.3f}")
verify_ratio = {g: roofline_s(verify_cost(config, 1, g + 1, dtype), machine, dtype)
                   / roofline_s(verify_cost(config, 1, 1, dtype), machine, dtype) for g in (1, 2, 4)}
print("verification cost v(γ) on this machine, roofline:", ", ".join(f"v({g}) = {v:.2f}" for g, v in
                                                                     verify_ratio.items()),
      "; measured (section 1):", ", ".join(f"v({g}) = {measured_fwd[g + 1] / step_1:.2f}" for g in verify_ratio))

# %% [markdown]
# SmolLM2's embedding table is tied and large (49152 × 576): the LM head is ~21 % of its bytes, which every
# early-exit draft step still reads, so even 8 of 30 layers costs almost half a target step. The int4 copy reads
# an eighth of the fp32 bytes — if its kernels reach the bandwidth on this machine.
#
# **Your prediction.** Guess α for each case before the measurement in section 7, then read off the speedup your
# formula gives at γ = 2 and 4 on this machine. It uses the roofline's v(γ): on a machine shared with other jobs
# the measured forward times of section 1 are too noisy to divide by; section 7 measures v(γ) inside the engine.
# Copy-heavy prompts ask the model to
# repeat a passage; open-ended ones to write something new.

# %%
my_alpha = {  # ← your guesses of the acceptance rate α
    ("ngram (prompt lookup)", "copy-heavy"): 0.6,
    ("ngram (prompt lookup)", "open-ended"): 0.1,
    ("quantized self (int4 weights)", "copy-heavy"): 0.9,
    ("quantized self (int4 weights)", "open-ended"): 0.9,
}


def predicted_speedup(alpha: float, gamma: int, c: float, v: float) -> float:
    """E(α, γ) / (γ·c + v): tokens per target call over the step's cost in target decode steps."""
    return predicted_tokens_per_call(alpha, gamma) / (gamma * c + v)


for (name, kind), a in my_alpha.items():
    print(f"{name:30} {kind:10}: α = {a:.2f} -> " + ", ".join(
        f"γ = {g}: {predicted_tokens_per_call(a, g):.2f} tokens/call, speedup "
        f"{predicted_speedup(a, g, cost_ratio[name], verify_ratio[g]):.2f}×" for g in (2, 4)))

# %% [markdown]
# ## 4. Build: the n-gram proposer (prompt lookup)
#
# When the answer quotes its prompt — repeat a passage, summarise it, edit code — the next tokens very often
# already appeared: after "the lazy", the prompt continued with "dog.". **Prompt lookup** (Saxena 2023; "inference
# with reference", Yang et al. 2023) finds the most recent earlier occurrence of the context's last n tokens and
# proposes what followed it. Longer matches are more specific, so try n = n_max first; the most recent copy is the
# likeliest to continue the same way. No model, no KV cache, no probabilities: it costs a scan of the context.
#
# ### Exercise 8.2 — `ngram_lookup`

# %%
# exercise 8.2: minillm.spec.ngram.ngram_lookup

# %%
# NBVAL_CHECK_OUTPUT
checks.check_ngram_lookup(ngram_lookup)

# %% [markdown]
# What it proposes while the model repeats a passage: the prompt, plus the first 12 tokens of the answer.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
answer = llm.generate([copy_prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
for i in range(0, 12, 3):
    context = copy_prompt + answer[:i]
    guess = ngram_lookup(context, 4, 1, 4)
    print(f"after {tok.decode(context[-3:])!r:>24}: guess {tok.decode(guess)!r:>26}, the model then wrote "
          f"{tok.decode(answer[i : i + 4])!r}")

# %% [markdown]
# ## 5. Build: roll back the rejected tokens' KV
#
# The verification forward wrote K/V for every guess into the sequence's paged blocks (notebook 05): the engine
# gave the guesses slots with `append_slots` before the forward. After the rule, only the accepted prefix is part
# of the sequence; the rest must go, or the next step would attend to tokens that were never generated.
# `BlockManager.truncate(seq_id, num_tokens)` shrinks the sequence's block table to its first `num_tokens` tokens:
# blocks left empty are released (`self.device.free`, tail first: a released prefix-cache block enters the LRU pool,
# and a chain's tail should be evicted before its head); a partly filled last block stays (its stale slots are
# overwritten by the next tokens); and the **prefix-cache hashes** may only cover full blocks of kept tokens —
# a hash names a block's tokens, and a rolled-back token is no longer there. The engine never marks a guess as
# computed, so no hash of a guess is ever registered in the cache.
#
# ### Exercise 8.3 — `BlockManager.truncate`

# %%
# exercise 8.3: minillm.kv.block_manager.BlockManager.truncate

# %%
# NBVAL_CHECK_OUTPUT
checks.check_truncate(MyBlockManager)

# %% [markdown]
# One speculative step on a 6-token sequence in blocks of 4 with γ = 4 guesses, of which one is accepted:

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
bm = MyBlockManager(8, 4)
bm.allocate("s", [11, 12, 13, 14, 15, 16])
bm.mark_computed("s", 6)
print(f"committed 6 tokens:   blocks {bm.block_table('s')}, free {bm.device.num_free}")
bm.append_slots("s", [91, 92, 93, 94])  # the guesses get slots; the forward writes their K/V there
print(f"+ 4 guesses:          blocks {bm.block_table('s')}, free {bm.device.num_free}, "
      f"tokens {bm.sequence('s').token_ids}")
bm.truncate("s", 7)  # the first guess accepted: 6 + 1 tokens stay (the correction token is appended next step)
print(f"1 accepted, truncate: blocks {bm.block_table('s')}, free {bm.device.num_free}, "
      f"tokens {bm.sequence('s').token_ids}")

# %% [markdown]
# ## 6. Your three pieces inside the engine
#
# The engine's speculative step (`minillm/engine/spec_decode.py`) takes its proposer, its verification rule and
# its rollback as backends: `SpecDecoder(config, model, max_len, proposer=..., verify=..., truncate=...)`. Swap
# yours in and generate greedily from the copy prompt: the tokens must be exactly plain decoding's, every block
# must be free when the request ends, and a sampled run must finish too.

# %%
def engine_with(spec: dict | None, *, student: bool = False, max_num_seqs: int = 1) -> LLMEngine:
    """An engine on the notebook's model; ``student``: your ngram_lookup, rejection_sample and truncate inside."""
    engine = LLMEngine(model, tok, EngineConfig(speculative_config=spec, max_num_seqs=max_num_seqs))
    if student:
        cfg = SpeculativeConfig(**spec)
        engine.speculator = SpecDecoder(cfg, model, engine.max_model_len,
                                        proposer=NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                                                               lookup=ngram_lookup),
                                        verify=rejection_sample, truncate=MyBlockManager.truncate)
    return engine


greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
plain_out = engine_with(None).generate([copy_prompt], greedy)[0]
mine = engine_with({"method": "ngram", "num_speculative_tokens": 4}, student=True)
mine_out = mine.generate([copy_prompt], greedy)[0]
stats = mine.spec_stats
assert stats.verify_steps > 0, ("no verification ran: the engine fell back to plain decoding, which it does when "
                                "the speculative step raises — run your rejection_sample by itself to see why")
assert mine_out.token_ids == plain_out.token_ids, "greedy speculative decoding must reproduce plain decoding"
assert mine.block_manager.device.num_used == 0, "the finished request left blocks allocated: a rollback leak"
print(f"greedy, your pieces: same {len(mine_out.token_ids)} tokens as plain decoding; α = "
      f"{stats.acceptance_rate:.2f}, {stats.mean_accepted_length:.2f} tokens per target call, "
      f"{stats.verify_steps} verification steps; all KV blocks free at the end")
sampled = mine.generate([copy_prompt], SamplingParams(max_tokens=N_TOKENS, temperature=0.8, top_p=0.95,
                                                      seed=3))[0]
print(f"sampled (T = 0.8, top-p 0.95, seed 3): {tok.decode(sampled.token_ids)!r}")

# %% [markdown]
# ## 7. Measure: α and tokens/s against γ, per proposer
#
# Now the library's proposers (the same code as yours), on three copy-heavy prompts — repeat a passage, summarise
# it, reprint a code snippet with one default changed — and an open-ended one, greedy, batch 1, next to plain
# decoding in the same run (the prompts of `python -m minillm bench spec`: ones this small model answers by copying).
# Each configuration runs twice, interleaved, and keeps its faster run (a shared machine only adds time).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
GAMMAS = [2, 4] if FAST else [1, 2, 4]
configs = [("plain", 0, None)]
configs += [("ngram (prompt lookup)", g, {"method": "ngram", "num_speculative_tokens": g}) for g in GAMMAS]
configs += [("quantized self (int4 weights)", g, {"method": "quantized", "num_speculative_tokens": g})
            for g in ([2] if FAST else [2, 4])]
prompt_ids = {kind: llm.apply_chat_template([{"role": "user", "content": m}]) for kind, m in PROMPTS.items()
              if not FAST or kind in ("copy: repeat", "open-ended")}
engines = {i: engine_with(spec) for i, (_, _, spec) in enumerate(configs)}  # built once: the int4 copy too


def decode_rate(engine: LLMEngine, prompt: list[int]) -> dict:
    """Generate N_TOKENS greedily; -> tokens, decode tokens/s (after the first token), α, tokens per call."""
    out = engine.generate([prompt], greedy)[0]
    m = out.metrics
    return {"tokens": out.token_ids, "tok_s": (m.output_tokens - 1) / (m.finish_s - m.first_token_s),
            "alpha": m.acceptance_rate, "per_call": m.mean_accepted_length}


results = {}
for kind, prompt in prompt_ids.items():
    for i in engines:
        engines[i].generate([prompt[:8]], SamplingParams(max_tokens=2))  # warm-up
    for _ in range(1 if FAST else 2):
        for i in engines:
            r = decode_rate(engines[i], prompt)
            if (kind, i) not in results or r["tok_s"] > results[(kind, i)]["tok_s"]:
                results[(kind, i)] = r
print(f"{'prompt':16} {'proposer':30} {'γ':>2} {'α':>5} {'tok/call':>8} {'(1-α^(γ+1))/(1-α)':>18} {'tok/s':>6} "
      f"{'speedup':>7} {'step cost':>9}  same tokens")
for kind in prompt_ids:
    base = results[(kind, 0)]
    for i, (name, g, _) in enumerate(configs):
        r = results[(kind, i)]
        formula = "" if r["alpha"] is None else f"{predicted_tokens_per_call(r['alpha'], g):18.2f}"
        step_cost = (r["per_call"] or 1) * base["tok_s"] / r["tok_s"]  # a speculative step, in plain decode steps
        print(f"{kind:16} {name:30} {g:2d} {r['alpha'] or 0:5.2f} {r['per_call'] or 1:8.2f} {formula:>18} "
              f"{r['tok_s']:6.1f} {r['tok_s'] / base['tok_s']:6.2f}× {step_cost:8.2f}×  "
              f"{r['tokens'] == base['tokens']}")
for name in ("ngram (prompt lookup)", "quantized self (int4 weights)"):
    pairs = [(results[(k, i)]["per_call"], predicted_tokens_per_call(results[(k, i)]["alpha"], g)) for k in prompt_ids
             for i, (n, g, _) in enumerate(configs) if n == name and results[(k, i)]["alpha"] is not None]
    if pairs:
        conclude(f"{name}: tokens per target call, measured ÷ formula (mean of {len(pairs)} rows)",
                 statistics.mean(m / f for m, f in pairs), 1, expect="≈", unit="×",
                 held="the formula (1 − α^(γ+1)) / (1 − α) predicts the tokens per call from the measured α",
                 missed="the formula misses here: acceptances are not independent — right guesses come in runs "
                        "(more tokens per call) and a wrong one ends the step (fewer)")

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
styles = {"copy: repeat": "o-", "copy: summarise": "d-.", "copy: edit code": "s--", "open-ended": "^:"}  # per prompt
colors = {"ngram (prompt lookup)": "tab:blue", "quantized self (int4 weights)": "tab:purple"}
for kind in prompt_ids:
    for name in colors:
        idx = [i for i, (n, _, _) in enumerate(configs) if n == name]
        gs = [configs[i][1] for i in idx]
        ax1.plot(gs, [results[(kind, i)]["alpha"] for i in idx], styles[kind], color=colors[name],
                 label=f"{name}, {kind}")
        ax2.plot(gs, [results[(kind, i)]["tok_s"] / results[(kind, 0)]["tok_s"] for i in idx], styles[kind],
                 color=colors[name], label=f"{name}, {kind}")
ax1.set(xlabel="γ (guesses per step)", ylabel="acceptance rate α", ylim=(0, 1.05),
        title="How often the guesses are right")
ax2.axhline(1.0, color="gray", linewidth=1, label="plain decoding")
ax2.set(xlabel="γ (guesses per step)", ylabel="decode tokens/s ÷ plain", ylim=(0, None),
        title=f"Speedup over plain decoding, this {device}")
ax1.legend(fontsize="x-small")
ax2.legend(fontsize="x-small")
plt.tight_layout()
plt.show()
for (name, kind), a in my_alpha.items():
    rows = [(g, results[(k, i)]) for k in prompt_ids if k.startswith(kind.split("-")[0])
            for i, (n, g, _) in enumerate(configs) if n == name]
    measured_alpha = statistics.mean(r["alpha"] for _, r in rows)
    print(f"{name:30} {kind:10}: you guessed α = {a:.2f}, measured {measured_alpha:.2f}")

# %% [markdown]
# The **step cost** column is what one speculative step cost in plain decode steps, tokens per call × plain tok/s ÷
# its tok/s: for the n-gram proposer (c = 0) it is v(γ) measured inside the engine; for a model drafter it is
# γ·c + v(γ). Three things to read off. **The formula against the measurement**: the ▸ lines set the measured
# tokens per target call against (1 − α^(γ+1)) / (1 − α) at the measured α — it assumes independent acceptances,
# while real guesses come in runs, so how close it comes depends on the text. **The n-gram proposer is free and wins
# only where the text is in the prompt**: on the repeated
# passage many guesses are right, on the story almost none are — and then every step pays v(γ) for nothing.
# **A model drafter is right far more often** — the int4 copy agrees with its fp32 original on most tokens — but it
# pays γ·c per step, and on a CPU the int4 kernels may not run at the bandwidth the roofline assumes; compare its
# measured speedup with your prediction at its measured α. Greedy output is identical to plain decoding in every row.
#
# ## 8. When speculation loses: compute-bound batches
#
# Speculation turns spare arithmetic into tokens. A batch of B sequences already uses B× the arithmetic per weight
# byte; with γ guesses each, a step feeds B·(γ + 1) tokens. Once that passes the ridge, verification costs
# (γ + 1)× a decode step and the rejected guesses are pure waste. Here are 8 copy-prompts under continuous
# batching, plain and with n-gram speculation, on this machine:

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
batch_prompts = [llm.apply_chat_template([{"role": "user", "content": f"Repeat the following text exactly, word "
                                           f"for word:\n\n{PROMPTS['copy: repeat'].split(chr(10))[-1][i * 9:]}"}])
                 for i in range(8)]
batch_rate = {}
for name, spec in (("plain", None), ("ngram, γ = 4", {"method": "ngram", "num_speculative_tokens": 4})):
    for B in (1, 8):
        engine = engine_with(spec, max_num_seqs=8)
        engine.generate([batch_prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
        t = time.perf_counter()
        outs = engine.generate(batch_prompts[:B], greedy)
        wall = time.perf_counter() - t
        batch_rate[(name, B)] = sum(len(o.token_ids) for o in outs) / wall
        alpha = engine.spec_stats.acceptance_rate if engine.spec_stats else None
        print(f"{name:13} batch {B}: {batch_rate[(name, B)]:6.1f} output tok/s (prefill included)"
              + ("" if alpha is None else f", α = {alpha:.2f}"))
for B in (1, 8):
    print(f"batch {B}: speculation ÷ plain = {batch_rate[('ngram, γ = 4', B)] / batch_rate[('plain', B)]:.2f}×")
gain = {B: batch_rate[("ngram, γ = 4", B)] / batch_rate[("plain", B)] for B in (1, 8)}
conclude("speculation's speedup, batch 8 ÷ batch 1", gain[8] / gain[1], 1, expect="<", unit="×",
         held="speculation gains less in a batch: verifying 8 × 5 tokens per step is closer to compute bound",
         missed="speculation gained as much in the batch of 8 here: the verify steps stayed memory bound at this "
                "batch, or the machine's noise hides the loss")

# %% [markdown]
# The roofline predicts the same crossover on any machine: the speedup E(α, γ) · t(decode step of B) / t(verify of
# B sequences × (γ + 1) tokens), here for an n-gram proposer (c = 0) at α = 0.6 and γ = 4.

# %%
# NBVAL_IGNORE_OUTPUT
alpha_demo, gamma_demo = 0.6, 4
Bs = [2**i for i in range(12)]  # 1 .. 2048 sequences
fig, ax = plt.subplots(figsize=(7, 4))
for cfg, spec, dt, name, color in ((llama, h100, "bfloat16", "Llama-2-7B on an H100", "tab:blue"),
                                   (config, machine, dtype, f"SmolLM2-135M on this {device}", "tab:green")):
    gain = [predicted_tokens_per_call(alpha_demo, gamma_demo)
            * roofline_s(roofline.decode_step_cost(cfg, B, CTX, dt), spec, dt)
            / roofline_s(verify_cost(cfg, B, gamma_demo + 1, dt), spec, dt) for B in Bs]
    ax.semilogx(Bs, gain, "o-", color=color, label=name, base=2)
ax.axhline(1.0, color="gray", linestyle=":", label="no gain")
ax.set(xlabel="batch size B", ylabel="speedup over plain decoding (roofline)",
       title=f"n-gram speculation, α = {alpha_demo}, γ = {gamma_demo}")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# On the H100 the speedup holds until the batch is large enough that B·(γ + 1) tokens reach the ridge (≈ 295
# FLOP/byte), then falls toward E(α, γ)/(γ + 1) < 1 (a KV cache that long would not fit, but the trend is the point):
# serving engines turn speculation down under heavy load (vLLM's and SGLang's
# schedulers cap γ or disable it as the batch grows). On this CPU the ridge is so low that even batch 1 is close to
# the edge.
#
# ## Takeaways
#
# - Decode is memory bound, so a forward of γ + 1 tokens costs about one step (on a GPU); the rejection rule —
#   accept with min(1, p/q), else draw from norm(max(0, p − q)), plus a bonus token — makes the output
#   **exactly** the target's distribution (your chi-square test) and greedy output identical.
# - Expected tokens per target call (1 − α^(γ+1)) / (1 − α); speedup = that ÷ (γ·c + v(γ)), with c the draft's
#   bytes over the target's. Published: T5-XXL 2–3× (γ = 7, α ≈ 0.75), Chinchilla-70B with a 4B draft 2–2.5×,
#   Medusa ~2×, EAGLE ~3×, prompt lookup ~2× on copy-heavy tasks.
# - Proposers trade α against c: an n-gram costs nothing but is right only on copies; a small model or the
#   target's int4 copy is right often but costs bytes; an untrained early exit is cheap-ish and rarely right
#   (LayerSkip and EAGLE train for it).
# - Rejected guesses' KV must be rolled back — blocks freed, prefix-cache hashes only over committed tokens.
# - Speculation loses on open-ended text (α small) and in compute-bound batches (B·(γ + 1) past the ridge): it is
#   a latency tool for small batches.
