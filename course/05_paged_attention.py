# %% [markdown]
# # 05 — Paged attention and prefix caching
#
# Notebook 02's cache gave every sequence a contiguous `[H_kv, S_max, D]` slab per layer, reserved up front. A
# server cannot know how long an answer will be, so it reserves the maximum — and most of that memory never holds
# a token. The PagedAttention paper (Kwon et al., SOSP 2023, the origin of vLLM) measured that earlier serving
# systems used only 20–38 % of their KV memory for token states: **60–80 % was wasted** by over-reservation,
# internal fragmentation (the unused tail of a reservation) and external fragmentation (gaps between
# reservations).
#
# Paging fixes it the way an operating system does for processes:
#
# - the cache is one pool of fixed-size **blocks** (16 tokens each by default);
# - each sequence has a **block table**: logical block i (its tokens 16i … 16i + 15) lives in physical block
#   `table[i]`, anywhere in the pool;
# - blocks are handed out **just in time**, one when the last one fills, so a sequence wastes at most the unused
#   tail of its last block — **under 4 %** on realistic lengths;
# - blocks carry **reference counts**, so sequences can **share** them: the samples of one prompt (n > 1),
#   and — with **prefix caching** — every request that starts with the same system prompt or document, whose
#   prefill is then skipped. A shared block that someone must write is first copied (**copy-on-write**).
#
# **In this notebook** you measure the waste of both layouts on a realistic length distribution, write the
# allocator's `free` with reference counts (exercise 5.1), a sequence's growth with copy-on-write (5.2) and the
# slot mapping that turns a block table into cache addresses (5.3); you predict (5.0) and measure how many
# sequences fit a GPU's KV budget, draw block tables shared after a fork, run paged attention through your slot
# mapping, write the engine's paged decode attention (5.4) and its Triton kernel that reads the cache through the
# block tables in place (5.5), let the engine decode through both, and measure what
# prefix hits do to the time to first token on the real engine.
# Runs in about a minute on a 2-core CPU; on a GPU it uses the GPU.

# %%
from __future__ import annotations

import os
import random
import statistics
from functools import partial

import torch

if not torch.cuda.is_available():  # before minillm's Triton kernels load: run them in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from minillm import LLM, EngineConfig, LLMEngine, SamplingParams, kernels
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.course.predictions import predict_paged_sequences
from minillm.kernels import reference
from minillm.kernels.reference import decode_attention
from minillm.kv.block_allocator import (
    BlockAllocator,
    BlockCopy,
    CopyKind,
    OutOfBlocks,
    contiguous_reservation_waste,
    paged_waste,
)
from minillm.kv.block_manager import BlockManager
from minillm.kv.contiguous import kv_bytes_per_token
from minillm.perf import roofline
from minillm.perf.metrics import measure_seconds
from minillm.perf.simulate import kv_cache_budget
from minillm.perf.workloads import corpus_token_ids, lognormal_lengths

if kernels.triton_available():
    import triton.language as tl  # the names exercise 5.5's Triton program uses

    from minillm.kernels.triton.paged_decode import kept_key_mask

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})  # readable figures: ≥ 110 dpi

device = "cuda" if torch.cuda.is_available() else "cpu"
llm = LLM(device=device)  # SmolLM2-135M-Instruct, offline, in the dtype minillm picks for this machine
model, config = llm.model, llm.model.config
llama, h100 = checks.LLAMA2_7B, roofline.get_spec("H100-SXM")  # the model and GPU of the scale-up estimates
print(f"{config.num_layers} layers, H_kv = {config.num_kv_heads}, head_dim {config.head_dim}: "
      f"{kv_bytes_per_token(config, model.dtype) / 1024:.1f} KiB of K/V per token in {model.dtype} on {device}")

# %% [markdown]
# ## 1. Why: what a contiguous reservation wastes
#
# Chat traffic has a long tail: most prompts and answers are a few hundred tokens, a few are much longer. We draw
# 1000 requests with lognormal prompt lengths (median 200 tokens) and output lengths (median 150) — the shape of
# `minillm.perf.bench.serving.chat_lengths_trace` — and give each its final length, prompt + output. A contiguous
# cache must reserve, for every request, the longest sequence it might become: here 2048 tokens (the context the
# PagedAttention paper served OPT models with). Paging holds `ceil(length / 16)` blocks.
#
# Predict first: the contiguous waste is 1 − mean length ÷ 2048. A paged sequence wastes only the empty part of
# its last block — on average about (16 − 1) / 2 = 7.5 slots — so its waste is about 7.5 ÷ (mean length + 7.5).

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
n_requests = 1000  # not shrunk when FAST: the printed (checked) numbers must not depend on it, and this is ms
RESERVE = 2048  # tokens a contiguous cache reserves per request (the maximum sequence length)
prompt_lens = lognormal_lengths(n_requests, median=200, sigma=0.8, lo=16, hi=1024, seed=0)
output_lens = lognormal_lengths(n_requests, median=150, sigma=0.9, lo=8, hi=1024, seed=1)
lengths = [p + o for p, o in zip(prompt_lens, output_lens, strict=True)]
mean_len = statistics.fmean(lengths)
print(f"{n_requests} requests: final length mean {mean_len:.0f}, median {statistics.median(lengths):.0f}, "
      f"max {max(lengths)} tokens")
print(f"predicted waste: contiguous ({RESERVE} reserved) {1 - mean_len / RESERVE:.1%}, "
      f"paged (16-token blocks) {7.5 / (mean_len + 7.5):.1%}")
print(f"exact waste:     contiguous {contiguous_reservation_waste(lengths, RESERVE):.1%}, "
      f"paged {paged_waste(lengths, 16):.1%}")

# %% [markdown]
# Smaller blocks waste less but make longer block tables and smaller, less efficient memory reads in the
# attention kernel; 16 tokens (vLLM's default) already wastes only a couple of percent.

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.hist(lengths, bins=40, color="tab:blue")
ax1.axvline(RESERVE, color="tab:red", linestyle="--", label=f"contiguous reservation ({RESERVE})")
ax1.axvline(mean_len, color="k", linestyle=":", label=f"mean length ({mean_len:.0f})")
ax1.set(xlabel="tokens per request (prompt + output)", ylabel="requests", title="What requests really use")
ax1.legend()
block_sizes = [1, 4, 8, 16, 32, 64, 128, 256]
ax2.plot(block_sizes, [100 * paged_waste(lengths, b) for b in block_sizes], "o-", label="paged")
ax2.set_xscale("log", base=2)
ax2.set_xticks(block_sizes, [str(b) for b in block_sizes])
ax2.axhline(100 * contiguous_reservation_waste(lengths, RESERVE), color="tab:red", linestyle="--",
            label="contiguous reservation")
ax2.set(xlabel="block size (tokens)", ylabel="KV memory wasted (%)", title="Waste vs block size", ylim=(0, 100))
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2. Build: a block allocator with reference counts
#
# `minillm.kv.block_allocator.BlockAllocator` owns the pool's bookkeeping (the K/V tensors live in the engine). Each
# block is
# in exactly one state:
#
# - **referenced**: `ref_count > 0`, it appears in that many block tables;
# - **free**: in the free list, holding nothing useful;
# - **evictable**: unreferenced but still a **prefix-cache entry** — its K/V stays, ready for a later request with
#   the same prefix, until `allocate()` runs out of free blocks and evicts the least recently released one (LRU).
#
# `allocate()` takes from the free list first, then evicts; `fork(blocks)` adds a reference to each block (a new
# owner shares them); `incref` revives a cached block on a prefix hit.
#
# ### Exercise 5.1 — `BlockAllocator.free`
#
# Drop one reference. Only when the last one goes is the block released: to the end of the LRU pool if it is a
# cache entry, to the end of the free list otherwise. `MyBlockAllocator` is the library's allocator with your
# `free`.

# %%
# exercise 5.1: minillm.kv.block_allocator.BlockAllocator.free

# %%
# NBVAL_CHECK_OUTPUT
checks.check_block_free(MyBlockAllocator)

# %% [markdown]
# The life of two blocks: a prompt's block, shared by a fork, and a block that became a prefix-cache entry.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
alloc = MyBlockAllocator(num_blocks=4, block_size=2)
a, b = alloc.allocate(), alloc.allocate()
alloc.fork([a, b])  # a second sequence shares both blocks


def show(event: str) -> None:
    print(f"{event:42} ref counts {[alloc.ref_count(i) for i in range(4)]}, free {alloc.num_free - alloc.num_evictable}"
          f", evictable {alloc.evictable_blocks()}")


show("allocate two blocks, fork them")
alloc.register(b, b"prefix-hash", [7, 7], None)  # block b holds a full, written prefix block: cache it
alloc.free(a), alloc.free(b)
show("the first owner finishes")
alloc.free(a), alloc.free(b)
show("the second owner finishes")
alloc.incref(b)
show("a new request hits the cached prefix")

# %% [markdown]
# ## 3. Build: growing a sequence, sharing after a fork
#
# `minillm.kv.block_manager.BlockManager` keeps a `BlockTable` per sequence (its block ids and its tokens) on top of
# the allocator. `allocate(seq, prompt)` gives a prompt its blocks (reusing cached ones on a prefix hit);
# `fork(parent, child)` lets a child share all the parent's blocks (parallel sampling, n > 1);
# `append_slots(seq, tokens)` gives each decoded token a slot before the forward pass writes its K/V.
#
# ### Exercise 5.2 — `BlockManager.append_slots`
#
# Two rules. **Just in time**: a new block only when the last one is full. **Copy-on-write**: if the partial last
# block is shared (after a fork, every sample shares it), the sequence must not write into it — the others would
# see its tokens. It takes a fresh block in its place, drops its reference to the shared one, and returns the copy
# the engine must run (the shared block's K/V into the new block) before the forward pass. The docstring names
# the helpers. `MyBlockManager` is the library's block manager with your `append_slots`; passing
# `allocator=MyBlockAllocator` makes it use your `free` too.

# %%
# exercise 5.2: minillm.kv.block_manager.BlockManager.append_slots

# %%
# NBVAL_CHECK_OUTPUT
checks.check_append_slots(MyBlockManager)

# %% [markdown]
# ### Plug it in: measure the waste
#
# Your block manager now serves the 1000 requests the way an engine does: each prompt is allocated, then every
# output token is appended one at a time. `stats()` counts the slots of the used blocks that hold no token.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
def lay_out(manager: BlockManager, prompts: list[int], outputs: list[int]) -> int:
    """Serve requests in order (prompt, then one token at a time) until the pool is full; returns how many fit."""
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        try:
            manager.allocate(i, [1] * p)
            for _ in range(o):
                manager.append_slots(i, [1])
        except OutOfBlocks:
            if i in manager:
                manager.free(i)  # the request that did not fit leaves the pool as it found it
            return i
    return len(prompts)


blocks_needed = sum(-(-n // 16) for n in lengths)
paged = MyBlockManager(blocks_needed, 16, enable_prefix_caching=False, allocator=MyBlockAllocator)
lay_out(paged, prompt_lens, output_lens)
stats = paged.stats()
print(f"{stats.logical_tokens:,} tokens in {stats.used_blocks:,} blocks of 16: paged waste {stats.waste:.2%} "
      f"(paged_waste formula: {paged_waste(lengths, 16):.2%})")
print(f"a contiguous cache would reserve {n_requests * RESERVE:,} slots for them: waste "
      f"{contiguous_reservation_waste(lengths, RESERVE):.1%}")

# %% [markdown]
# ### Predict, then measure: how many sequences fit a GPU?
#
# Llama-2-7B in fp16 on an 80 GB H100: the weights take 13.5 GB, and with 90 % of the memory usable (vLLM's
# default) about 58 GB is left for K/V at 512 KiB per token. Predict how many of our requests can be in flight at
# their final lengths: a contiguous cache fits `budget ÷ 2048` of them (whatever their length); a paged one about
# `budget ÷ (mean length + 7.5)`. Then measure: your block manager admits the requests in order until the pool is
# full.

# %%
# NBVAL_CHECK_OUTPUT
budget_bytes = kv_cache_budget(llama, h100, "float16")
budget_tokens = budget_bytes // kv_bytes_per_token(llama, torch.float16)
print(f"KV budget {budget_bytes / 1e9:.1f} GB = {budget_tokens:,} tokens of Llama-2-7B (fp16); the requests' final "
      f"lengths average {mean_len:.1f} tokens")

# %% [markdown]
# Your prediction first: how many paged sequences fit, in blocks of 16 tokens?

# %%
# exercise 5.0: minillm.course.predictions.predict_paged_sequences

# %%
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_paged(predict_paged_sequences, budget_tokens, mean_len, 16)

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
predicted = {"contiguous, 2048 reserved": budget_tokens // RESERVE,
             "contiguous, 4096 (full context)": budget_tokens // 4096,
             "paged, 16-token blocks": budget_tokens / (mean_len + 7.5)}
pool = MyBlockManager(budget_tokens // 16, 16, enable_prefix_caching=False, allocator=MyBlockAllocator)
measured = lay_out(pool, prompt_lens * 2, output_lens * 2)  # the trace twice: more requests than fit
for name, n in predicted.items():
    print(f"  {name:32} predicted {n:6.0f} sequences")
print(f"  {'paged, measured':32}           {measured:6d} sequences "
      f"({measured / predicted['contiguous, 2048 reserved']:.1f}× the 2048-token reservation)")
checks.check_prediction(predicted["paged, 16-token blocks"], measured, what="paged sequences that fit")
verdict = checks.judge_prediction(my_prediction, measured, bound=budget_tokens / mean_len,
                                  what="paged sequences that fit", unit="sequences",
                                  bound_name="the no-waste limit (budget ÷ mean length)", bandwidth=False,
                                  see="only each sequence's last, partial block is wasted (section 1)")

# %% [markdown]
# More sequences in flight means a bigger decode batch, and a decode step's weight reads are shared by the whole
# batch (notebook 06): this is where vLLM's 2–4× throughput over earlier systems at equal latency came from.
#
# ## 4. A picture: block tables after a fork and a prefix hit
#
# A request asks for three samples of one prompt (n = 3): after its prefill the prompt's blocks are shared by
# three sequences. Each sample then decodes its own tokens; the first write into the shared, partial last block
# copies it. Later, a second request with the same system prompt arrives: its first full blocks are prefix-cache
# hits. Small blocks of 4 tokens keep the picture readable.

# %%
# NBVAL_IGNORE_OUTPUT
def snapshot(manager: BlockManager, seqs: list[str]) -> dict:
    """Block tables and owners of every physical block, for drawing."""
    tables = {s: manager.block_table(s) for s in seqs if s in manager}
    owners: dict[int, list[str]] = {}
    for s, table in tables.items():
        for block in table:
            owners.setdefault(block, []).append(s)
    return {"tables": tables, "owners": owners, "cached": set(manager.device.cached_blocks()),
            "num_blocks": manager.device.num_blocks}


def draw(ax, snap: dict, title: str, colors: dict) -> None:
    """Physical pool on the bottom row (a shared block is split into its owners' colours), block tables above."""
    tables, owners = snap["tables"], snap["owners"]
    for row, (seq, table) in enumerate(tables.items()):
        y = len(tables) - row + 0.6
        ax.text(-0.3, y + 0.4, seq, ha="right", va="center")
        for i, block in enumerate(table):
            ax.add_patch(Rectangle((i, y), 0.9, 0.8, color=colors[seq], alpha=0.85))
            ax.text(i + 0.45, y + 0.4, str(block), ha="center", va="center", color="white", fontsize=9)
    ax.text(-0.3, 0.4, "pool", ha="right", va="center")
    for block in range(snap["num_blocks"]):
        who = owners.get(block, [])
        for k, seq in enumerate(who):
            ax.add_patch(Rectangle((block + 0.9 * k / len(who), 0), 0.9 / len(who), 0.8, color=colors[seq]))
        edge = "k" if block in snap["cached"] else "0.7"
        width = 2 if block in snap["cached"] else 1
        ax.add_patch(Rectangle((block, 0), 0.9, 0.8, fill=False, edgecolor=edge, lw=width))
        ax.text(block + 0.45, -0.3, str(block), ha="center", va="center", fontsize=8)
    ax.set(xlim=(-1.5, snap["num_blocks"]), ylim=(-0.7, len(tables) + 1.6), title=title)
    ax.axis("off")


bm = MyBlockManager(14, 4, allocator=MyBlockAllocator)
system = [11, 12, 13, 14, 15, 16, 17, 18]  # an 8-token "system prompt": two full blocks
prompt = system + [21, 22, 23, 24, 25, 26]  # + the user's question: 14 tokens, the last block half full
bm.allocate("A", prompt)
bm.mark_computed("A", len(prompt))  # prefill wrote the prompt's K/V; its full blocks become cache entries
for child in ("A.1", "A.2"):
    bm.fork("A", child)  # n = 3 parallel samples share every block
seqs = ["A", "A.1", "A.2", "B"]
colors = dict(zip(seqs, ["tab:blue", "tab:orange", "tab:green", "tab:purple"], strict=True))
before = snapshot(bm, seqs)
copies = []
for step in range(3):  # three decode steps: each sample appends its own token
    for k, s in enumerate(["A", "A.1", "A.2"]):
        copies += bm.append_slots(s, [100 * k + step])
        bm.mark_computed(s, bm.num_tokens(s))
hit = bm.allocate("B", system + [31, 32, 33, 34, 35])  # a second request with the same system prompt
after = snapshot(bm, seqs)
print(f"copy-on-write copies: {[(c.src, c.dst) for c in copies]}; request B found {hit} prompt tokens cached")
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.5))
draw(ax1, before, "after the prefill and fork (n = 3): every block shared by 3 (split colours)", colors)
draw(ax2, after, "after 3 decode steps (copy-on-write) and request B's prefix hit; thick edge = cache entry",
     colors)
plt.tight_layout()
plt.show()

# %% [markdown]
# Two copies, not three: the first two samples to write copy the shared block; the last one is then its only
# owner and writes in place. Request B's first two blocks are the same physical blocks as A's: their K/V is
# computed once, stored once, and B's prefill starts at token 8.
#
# ## 5. Build: from a block table to cache slots
#
# The engine's K/V pool for one layer is a tensor `[num_blocks, block_size, H_kv, D]`; flattened, it is
# `num_blocks × block_size` **slots**. Before each forward, the engine computes every new token's slot, scatters
# the token's K and V there, and gives the attention kernel each sequence's block table to read them back.
#
# ### Exercise 5.3 — slot mapping
#
# Write `slot_mapping(block_ids, start, end, block_size)`: the slot of each position in `[start, end)`.

# %%
# exercise 5.3: minillm.kv.block_allocator.slot_mapping

# %%
# NBVAL_CHECK_OUTPUT
checks.check_slot_mapping(slot_mapping)

# %% [markdown]
# ### Plug it in: paged attention through your slots
#
# Two sequences grow in turns inside one pool, so their blocks interleave. Their keys and values are written at
# the slots *your* `slot_mapping` gives; then `minillm.kernels.paged_decode_attention` reads them back through
# the block tables (Triton on a GPU, a gather reference elsewhere) and must agree with plain attention over the
# same K/V stored contiguously.

# %% tags=["slide-output"]
H_kv, H_q, D, bs = config.num_kv_heads, config.num_heads, config.head_dim, 16
seq_lens = [37, 70]
pool_bm = MyBlockManager(16, bs, enable_prefix_caching=False, allocator=MyBlockAllocator)
for s in range(2):
    pool_bm.allocate(s, [1])
for p in range(1, max(seq_lens)):  # the two sequences take turns: their blocks interleave in the pool
    for s in range(2):
        if p < seq_lens[s]:
            pool_bm.append_slots(s, [1])
tables = [pool_bm.block_table(s) for s in range(2)]
print("block tables:", tables)
gen = torch.Generator().manual_seed(0)
k_dense = torch.randn(2, H_kv, max(seq_lens), D, generator=gen)  # (B, H_kv, S_max, D), contiguous
v_dense = torch.randn(2, H_kv, max(seq_lens), D, generator=gen)
q = torch.randn(2, H_q, D, generator=gen)  # (B, H_q, D): one decode query per sequence
k_pool = torch.zeros(16 * bs, H_kv, D)  # (num_blocks · block_size, H_kv, D): the flat slots
v_pool = torch.zeros(16 * bs, H_kv, D)
for s, n in enumerate(seq_lens):
    slots = torch.tensor(slot_mapping(tables[s], 0, n, bs))
    k_pool[slots] = k_dense[s, :, :n].transpose(0, 1)  # (n, H_kv, D) scattered to their slots
    v_pool[slots] = v_dense[s, :, :n].transpose(0, 1)
width = max(len(t) for t in tables)
block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
lens = torch.tensor(seq_lens, dtype=torch.int32)
paged_out = kernels.paged_decode_attention(q.to(device), k_pool.view(16, bs, H_kv, D).to(device),
                                           v_pool.view(16, bs, H_kv, D).to(device), block_tables.to(device),
                                           lens.to(device)).cpu()
dense_out = kernels.decode_attention(q, k_dense, v_dense, lens, impl="torch")
# fp32 defaults on CPU; a GPU's Triton kernel may multiply in TF32 (10-bit mantissa), hence the looser bound there
tolerance = {} if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}
torch.testing.assert_close(paged_out, dense_out, **tolerance)
print(f"paged attention through your slot mapping = dense attention (max |Δ| = "
      f"{(paged_out - dense_out).abs().max().item():.1e})")

# %% [markdown]
# ### Exercise 5.4 — decode attention through the block tables
#
# That kernel is the engine's decode attention. Its plain PyTorch version — what the engine runs with
# `kernels="torch"`, and what every fast kernel is tested against — gathers each sequence's blocks into a
# contiguous copy, then attends. Write it: the shapes are in the docstring; `decode_attention` (contiguous K/V,
# one query per sequence) is there to finish with.

# %%
# exercise 5.4: minillm.kernels.reference.paged_decode_attention_ref

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - Sequence b uses only its first ⌈seq_lens[b] / block_size⌉ table entries; replace the others by a valid id
#   (any block: its keys are masked) before indexing the cache — padding may point past the pool.
# - `k_cache[ids]` with ids [B, max_blocks] gives [B, max_blocks, block_size, H_kv, D]; flatten the two block
#   axes into positions, then move H_kv before them.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_paged_decode_attention(paged_decode_attention_ref)

# %% [markdown]
# ### Plug it in: the engine decodes through your gather
#
# The engine generates for three prompts with the PyTorch kernels, once as shipped and once with your function in
# the library's place: every decode step of every layer then reads the paged cache through your code. Same tokens.

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
gen_prompts = [torch.randint(100, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 23, 40)]
gen_params = SamplingParams(max_tokens=8 if FAST else 24, temperature=0, ignore_eos=True)


def engine_tokens() -> list[list[int]]:
    """Greedy tokens of the three prompts from a fresh engine (paged cache, 16-token blocks)."""
    engine = LLMEngine(model, llm.tokenizer, EngineConfig(num_kv_blocks=32, enable_prefix_caching=False))
    outs = engine.generate(gen_prompts, gen_params)
    failed = [out.error for out in outs if out.finish_reason == "error"]
    if failed:  # the engine ends a failing request alone and runs on: surface what your code raised
        if "NotImplementedError" in failed[0] and "Exercise " in failed[0]:
            raise NotImplementedError(failed[0][failed[0].index("Exercise ") :])
        raise RuntimeError(failed[0])
    return [out.token_ids for out in outs]


shipped_kernels = model.kernels
model.set_kernels("torch")  # the references: paged decode goes through reference.paged_decode_attention_ref
try:
    library_tokens = engine_tokens()
    original = reference.paged_decode_attention_ref
    reference.paged_decode_attention_ref = paged_decode_attention_ref  # yours, for these runs only
    try:
        your_tokens = engine_tokens()
    finally:
        reference.paged_decode_attention_ref = original
finally:
    model.set_kernels(shipped_kernels)
assert your_tokens == library_tokens, "the engine produced different tokens through your paged attention"
print(f"{len(gen_prompts)} prompts through your gather: every greedy token identical to the library's")

# %% [markdown]
# ### Exercise 5.5 — the same walk as a Triton kernel
#
# The gather of 5.4 copies every block a sequence uses before attention reads it again: three passes over K/V
# where one would do. On a GPU the engine runs a kernel that reads K and V **through the block table, in place**:
# notebook 04's flash-decoding (exercise 4.3), with one change — key n is no longer at `base + n · stride` but in
# physical block `table[n // BLOCK_SIZE]`, slot `n % BLOCK_SIZE`. A tile of keys may span several scattered
# blocks; each key's D-vector is still contiguous, so the loads stay coalesced.
#
# Write the program body: one program per (sequence, K/V head group, split), the group's query heads as one tile,
# the online softmax over the split's keys. The docstring says what is computed before your code and what the
# stores after it expect. On CPU it runs in Triton's interpreter (set in the first cell): slow, so the check uses
# small shapes: it compares your kernel with `paged_decode_attention_ref` (the library's 5.4) at several shapes,
# then lets the engine decode through your kernel (a small random model, greedy tokens equal to the PyTorch path's).

# %%
# exercise 5.5: minillm.kernels.triton.paged_decode.paged_partial_program

# %% [markdown]
# <details><summary>Hints (optional)</summary>
#
# - Start from exercise 4.3's loop; only the two loads change. `offs_n // BLOCK_SIZE` indexes the table (load it
#   with `mask=n_mask`: entries past the sequence's last block may be padding), `.to(tl.int64)` the block ids.
# - The K rows of a tile: `KC + (block * skc0 + slot * skc1 + h_kv * skc2)[:, None] + offs_d[None, :]`.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
checks.check_paged_partial_program(paged_partial_program)

# %% [markdown]
# ## 6. Prefix caching: what a hit saves
#
# A full block whose K/V is written is registered under a hash of its tokens **chained with its parent block's
# hash**, so the hash names the whole prefix up to that block, not just 16 tokens (the same 16 tokens after a
# different beginning have different K/V). A new prompt walks its blocks from the start, looking each hash up;
# every hit skips that block's prefill. (SGLang keeps the same information in a radix tree of token sequences.)
# Released cached blocks stay in the LRU pool — exercise 5.1 — so a popular system prompt survives between
# requests.
#
# ### Predict, then measure: TTFT vs the shared fraction
#
# The real engine serves prompts of equal length whose first `f` of tokens are a shared "document" (real
# text, CPython's help pages); each request is sent alone, so its TTFT is its prefill. One request first puts the
# document in the cache. Prediction: a hit skips the shared tokens' prefill, so TTFT ≈ TTFT without a hit × (1 −
# hit tokens ÷ prompt length) — a little more, since the new tokens still attend to the cached ones.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
corpus = corpus_token_ids(llm.tokenizer)
prompt_len = 192 if FAST else 512
fractions = [0.0, 0.5, 0.875] if FAST else [0.0, 0.25, 0.5, 0.75, 0.875, 0.97]
document = corpus[:prompt_len]
rng = random.Random(0)


def prompt_sharing(fraction: float) -> list[int]:
    """``prompt_len`` tokens: the document's first ``fraction`` of tokens, then a fresh slice of the corpus."""
    shared = round(fraction * prompt_len)
    start = rng.randrange(prompt_len, len(corpus) - prompt_len)
    return document[:shared] + corpus[start : start + prompt_len - shared]


one_token = SamplingParams(max_tokens=1, temperature=0)
engines = {on: LLMEngine(model, llm.tokenizer, EngineConfig(enable_prefix_caching=on, max_num_batched_tokens=1024))
           for on in (True, False)}
for engine in engines.values():
    engine.generate([prompt_sharing(0.0)[:64]], one_token)  # warm-up: first calls pay for allocations
engines[True].generate([document], one_token)  # the document's blocks enter the prefix cache
ttft = {True: [], False: []}
hits = []
for f in fractions:
    prompt = prompt_sharing(f)
    for on, engine in engines.items():
        out = engine.generate([prompt], one_token)[0]
        ttft[on].append(out.metrics.ttft_s)
        if on:
            hits.append(out.metrics.prefix_hit_tokens)
    print(f"shared {f:5.1%}: {hits[-1]:4d} of {prompt_len} tokens hit the cache; TTFT {ttft[True][-1] * 1e3:6.0f} ms "
          f"with prefix caching, {ttft[False][-1] * 1e3:6.0f} ms without")
miss = statistics.median(ttft[False])
predicted_ttft = [miss * (1 - h / prompt_len) for h in hits]
print(f"prefill without hits: {prompt_len / miss:.0f} tokens/s; at the largest shared fraction TTFT drops "
      f"{1 - ttft[True][-1] / ttft[False][-1]:.0%} (predicted {1 - predicted_ttft[-1] / miss:.0%})")
half = fractions.index(0.5)
conclude("TTFT at 50% shared, measured ÷ predicted", ttft[True][half] / predicted_ttft[half], 1,
         expect="≈", tolerance=0.3, unit="×",
         held="TTFT falls about in proportion to the cached fraction, as the prediction says",
         missed="TTFT is off the proportional prediction by more than half: at a high hit fraction the fixed "
                "cost of a step (and the new tokens attending to the cached ones) weighs more than the model says")

# %%
# NBVAL_IGNORE_OUTPUT
shared_pct = [100 * h / prompt_len for h in hits]
plt.plot(shared_pct, [t * 1e3 for t in ttft[False]], "o-", color="tab:red", label="prefix caching off")
plt.plot(shared_pct, [t * 1e3 for t in ttft[True]], "o-", color="tab:blue", label="prefix caching on")
plt.plot(shared_pct, [t * 1e3 for t in predicted_ttft], "k--", label="prediction: miss × (1 − hit fraction)")
plt.gca().set(xlabel="prompt tokens served from the cache (%)", ylabel="TTFT (ms)",
              title=f"{prompt_len}-token prompts, sent one at a time", ylim=(0, None))
plt.legend()
plt.show()

# %% [markdown]
# ### At a provider's scale
#
# A 1000-token system prompt in front of 1 million calls a day is a billion repeated prompt tokens a day. For a
# Llama-2-7B-sized model, from the roofline's cost model:

# %% tags=["slide-output"]
# NBVAL_CHECK_OUTPUT
calls_per_day, system_tokens = 1_000_000, 1000
repeated = calls_per_day * system_tokens
prefill = roofline.prefill_cost(llama, 1, system_tokens, "bfloat16")
gpu_s = prefill.flops * calls_per_day / (h100.peak("bfloat16") * 0.5)  # assumed: prefill at 50 % MFU
kv_prefix = system_tokens * kv_bytes_per_token(llama, torch.float16)
print(f"{repeated:.1e} repeated prompt tokens per day")
print(f"their prefill: {prefill.flops:.2e} FLOPs per call, {prefill.flops * calls_per_day:.2e} per day "
      f"= {gpu_s / 3600:.1f} H100-hours a day at 50 % MFU, all of it recomputing the same K/V")
print(f"the prefix's K/V: {kv_prefix / 2**20:.0f} MiB, computed once and shared by every request that hits it; "
      f"per call it is {prefill.flops / (h100.peak('bfloat16') * 0.5) * 1e3:.0f} ms of H100 time off the TTFT")

# %% [markdown]
# This is why hosted APIs bill cached input tokens at a fraction of the price: providers announcing prompt
# caching in 2024 reported up to ~80 % lower latency and up to 90 % lower input cost for long, repeated prefixes.

# %% [markdown]
# ## 7. Paged vs dense decode attention on the roofline
#
# Paging changes where K/V live, not how many bytes a decode step reads: per sequence and KV head, S × D keys and as
# many values, whether they sit in one contiguous run or in S / 16 blocks found through the table. So both kernels
# share one point's intensity, and the bandwidth roof bounds both. The price of paging is the indirection: a
# table lookup per block and shorter contiguous runs. **Predict before you run:** at the model's shape, what
# fraction of the dense kernel's speed will the paged one keep?
#
# Both are timed here at this model's heads (`impl="auto"`: the engine's own kernels on this device), with the
# blocks of each sequence scattered through the pool in a random order, as a long-running server leaves them.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # the cached roof: measured once per machine
att_batch, att_lens = 8, ((256, 1024) if FAST else (512, 2048, 8192))
H_q, H_kv, D, bs = config.num_heads, config.num_kv_heads, config.head_dim, 16  # this model's heads, 16-token blocks
att_tolerance = {} if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}  # a GPU kernel may multiply in TF32
att_rows = []
for S in att_lens:
    g = torch.Generator().manual_seed(S)
    qa = torch.randn(att_batch, H_q, D, generator=g).to(device, model.dtype)
    ka, va = (torch.randn(att_batch, H_kv, S, D, generator=g).to(device, model.dtype) for _ in range(2))
    la = torch.full((att_batch,), S, dtype=torch.int32, device=device)
    per_seq = S // bs
    order = torch.randperm(att_batch * per_seq, generator=g)  # physical block of each logical block, shuffled
    att_tables = order.view(att_batch, per_seq).to(torch.int32).to(device)
    pools = []
    for dense in (ka, va):  # [B, H_kv, S, D] -> blocks [B·S/bs, bs, H_kv, D] placed at their shuffled ids
        blocks = dense.transpose(1, 2).reshape(att_batch * per_seq, bs, H_kv, D)
        pool = torch.empty_like(blocks)
        pool[order.to(device)] = blocks
        pools.append(pool)
    torch.testing.assert_close(kernels.paged_decode_attention(qa, *pools, att_tables, la),
                               kernels.decode_attention(qa, ka, va, la), **att_tolerance)
    cost = roofline.attention_cost(att_batch, 1, S, H_q, H_kv, D, model.dtype)
    for name, fn in (("dense", partial(kernels.decode_attention, qa, ka, va, la)),
                     ("paged", partial(kernels.paged_decode_attention, qa, *pools, att_tables, la))):
        s = statistics.median(measure_seconds(fn, repeat=5 if FAST else 20, device=device))
        att_rows.append({"kernel": name, "S": S, "s": s, "cost": cost})
        print(f"{name:5} B={att_batch} S={S:5d}: {s * 1e6:8.1f} µs, {cost.bytes / s / 1e9:6.2f} GB/s of K/V, "
              f"{cost.bytes / spec.memory_bandwidth / s:6.1%} of the bytes bound")

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
timed = {(r["kernel"], r["S"]): r["s"] for r in att_rows}
longest_att = max(att_lens)
conclude(f"paged ÷ dense decode attention speed, B={att_batch} S={longest_att}",
         timed["dense", longest_att] / timed["paged", longest_att] * 100, 100.0, expect="≈", unit="%",
         tolerance=0.2, held="reading through the block table keeps the dense kernel's speed: the same bytes, "
                             "found block by block",
         missed="the indirection costs (or gains) here: the table lookups and short contiguous runs of 16 tokens "
                "change how well the kernel streams on this device")
roofline.plot_roofline(spec, [roofline.RooflinePoint.from_cost(f"decode {r['kernel']} S={r['S']}", r["cost"], r["s"])
                              for r in att_rows], dtype=roofline.dtype_name(model.dtype))
plt.show()

# %% [markdown]
# Both kernels sit at the same intensity — about 2·G ÷ bytes per element, G = H_q / H_kv query heads per K/V head
# (notebook 03) — far left of any ridge: paging leaves decode attention memory bound, and what it buys is capacity
# (sections 1 and 3), not speed.

# %% [markdown]
# ## Takeaways
#
# - A contiguous cache reserves the maximum length per request: on chat-like lengths **~80 %** of its memory
#   holds nothing. **Paging** in 16-token blocks allocated just in time wastes **~2 %** (half a block per
#   sequence), so several times more sequences fit the same GPU — a bigger decode batch (notebook 06).
# - A **block table** maps logical to physical blocks; the slot of position p is
#   `table[p // block_size] · block_size + p % block_size`; attention reads K/V through the table.
# - **Reference counts** let sequences share blocks: forks (n > 1) share the prompt, and the first write into a
#   shared partial block **copies it** (copy-on-write). Only the last owner's `free` releases a block.
# - **Prefix caching**: full blocks are named by a chained hash of their prefix; a hit skips that block's prefill,
#   so TTFT should fall about in proportion to the cached fraction (the ▸ line in section 6 says how closely it
#   did here). Released cached blocks wait in an LRU pool.
#   A 1000-token system prompt × 1M calls a day = 10⁹ tokens a day whose prefill need never be repeated.
# - Paging moves no extra bytes: paged and dense decode attention share one intensity on the roofline, and
#   paging buys capacity, not speed (section 7's ▸ line says how close the paged kernel came to the dense one here).
