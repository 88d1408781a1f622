"""Sampling's cost: top-k / top-p filtering by the whole-row sort (``top_k_top_p_mask``) against the candidate filter
(``filter_top_k_top_p``), and the draw, in one process, interleaved.

1. Per row, on the default model's own logits (400 positions of README.md at temperature 1.0) and on rows of a
   128,256-token vocabulary (those logits' distribution tiled), top_p 0.9 / 0.95 and top_k 40: ms per row.
2. The draw: ``sampler.sample`` of 32 rows at temperature 1 with ``torch.multinomial`` against ``sample_from``.
3. End to end: ``LLM.generate`` of 32 prompts × 64 sampled tokens (temperature 1, then top_p 0.9; seeded), before
   (whole-row sort + multinomial) against after (candidates + sample_from), output tok/s.

python benchmarks/sampling_filter_ab.py [ROUNDS]   (medians printed; ratios = sort / candidates)
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from minillm import LLM, SamplingParams
from minillm.sampling import sampler

torch.set_num_threads(2)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
llm = LLM()
tok = llm.tokenizer
ids = torch.tensor([tok.encode(Path("README.md").read_text())[:400]])
with torch.inference_mode():
    logits = llm.engine.model(ids, torch.arange(ids.shape[1])[None])[0].float()
rows = {"49k": logits, "128k": logits.repeat(1, 3)[:, :128256]}
cases = {"top_p 0.9": (0, 0.9), "top_p 0.95": (0, 0.95), "top_k 40": (40, 1.0)}
filters = {"sort": sampler.top_k_top_p_mask, "candidates": sampler.filter_top_k_top_p}
per_row = {(v, c, f): [] for v in rows for c in cases for f in filters}
for _ in range(rounds):
    for v, x in rows.items():
        for c, (k, p) in cases.items():
            for f, fn in filters.items():
                t = time.perf_counter()
                for r in x[:100]:
                    fn(r, k, p)
                per_row[v, c, f].append((time.perf_counter() - t) / 100 * 1e3)
for v in rows:
    for c in cases:
        a, b = (statistics.median(per_row[v, c, f]) for f in filters)
        print(f"{v:>5} {c:<11} sort {a:6.2f} ms/row  candidates {b:6.2f} ms/row  {a / b:5.1f}x")


def multinomial(weights, generator=None):  # the draw before sample_from: torch's exponential race over V
    return int(torch.multinomial(weights, 1, generator=generator))


draws = {"multinomial": multinomial, "inverse cdf": sampler.sample_from}
x = logits[:32].contiguous()
per_step = {d: [] for d in draws}
library_draw = sampler.sample_from
for _ in range(rounds):
    for d, fn in draws.items():
        sampler.sample_from = fn
        t = time.perf_counter()
        sampler.sample(x, [SamplingParams(temperature=1.0)] * 32, [None] * 32)
        per_step[d].append((time.perf_counter() - t) * 1e3)
sampler.sample_from = library_draw
a, b = (statistics.median(per_step[d]) for d in draws)
print(f"sample() of 32 rows, temperature 1: multinomial {a:.1f} ms, inverse cdf {b:.1f} ms, {a / b:.1f}x")

prompts = [f"Write a short story about the number {i}." for i in range(32)]
library = sampler.filter_top_k_top_p
variants = {"before (sort + multinomial)": (sampler.top_k_top_p_mask, multinomial),
            "after (candidates + inverse cdf)": (library, library_draw)}
for label, params in (("temperature 1", SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=7)),
                      ("top_p 0.9", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64, ignore_eos=True,
                                                   seed=7))):
    rates = {v: [] for v in variants}
    for _ in range(max(2, rounds // 2)):
        for v, (filt, draw) in variants.items():
            sampler.filter_top_k_top_p, sampler.sample_from = filt, draw
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[v].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    sampler.filter_top_k_top_p, sampler.sample_from = library, library_draw
    a, b = (statistics.median(rates[v]) for v in variants)
    print(f"generate 32 x 64 sampled ({label}): before {a:.1f} tok/s, after {b:.1f} tok/s, {b / a:.2f}x")
