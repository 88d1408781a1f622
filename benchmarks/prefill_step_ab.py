"""The offline ``bench serve`` trace (32 chats, 64 greedy tokens each, the default model in fp32) in ONE process,
alternating three variants of the CPU prefill path: "before" (one SDPA call per chunk, ``F.linear``), "tiles"
(``kernels/cpu/prefill.py``'s query tiles) and "tiles+packed" (also ``kernels/cpu/onednn.py``'s packed linears).

    PYTHONPATH=<tree> python benchmarks/prefill_step_ab.py [THREADS] [ROUNDS] [REQUESTS] [TOKENS]

Prints each run's seconds, then each variant's median and its ratio to "before" (> 1: faster), and whether the
greedy tokens agree; ratios only, and only within one run.
"""
import statistics
import sys
import time

import torch

from minillm import LLM, SamplingParams
from minillm.kernels.cpu import onednn, prefill
from minillm.perf.bench.serve import make_prompts

args = [int(a) for a in sys.argv[1:]] + [2, 3, 32, 64][len(sys.argv) - 1 :]
threads, rounds, requests, tokens = args[:4]
torch.set_num_threads(threads)
VARIANTS = {"before": (10**9, "off"), "tiles": (prefill.PREFILL_TILE, "off"),
            "tiles+packed": (prefill.PREFILL_TILE, "auto")}
llm = LLM()
msgs = [[{"role": "user", "content": p}] for p in make_prompts(32, 2018 + 7)][:requests]
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
times, tokens_out = {n: [] for n in VARIANTS}, {}
for r in range(-1, rounds):  # round -1 warms every variant (packing included) and is not timed
    order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
    for name in order:
        prefill.PREFILL_TILE, onednn.ONEDNN_PACK = VARIANTS[name]
        t = time.perf_counter()
        outs = llm.chat(msgs if r >= 0 else msgs[:2], params if r >= 0 else SamplingParams(max_tokens=4))
        if r >= 0:
            times[name].append(time.perf_counter() - t)
            tokens_out[name] = [o.outputs[0].token_ids for o in outs]
            print(f"round {r} {name}: {times[name][-1]:.1f} s", flush=True)
base = statistics.median(times["before"])
for name in VARIANTS:
    same = sum(a == b for a, b in zip(tokens_out[name], tokens_out["before"], strict=True))
    print(f"{name}: median {statistics.median(times[name]):.1f} s, x{base / statistics.median(times[name]):.3f}, "
          f"greedy tokens as 'before' in {same}/{len(msgs)}")
