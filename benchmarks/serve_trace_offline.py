"""`bench serve`'s trace, offline through `LLM.chat`: the engine's time for the work a saturated server does.

python benchmarks/serve_trace_offline.py SEED [--max_num_batched_tokens=N ...]: 32 chat requests of
make_prompts(32, SEED + 7) (SEED 2018: the third rate of a sweep with --seed 0), 64 greedy tokens each, ignore_eos.
"""

import sys
import time

import torch

from minillm import LLM, SamplingParams
from minillm.perf.bench.serve import make_prompts

torch.set_num_threads(2)
seed = int(sys.argv[1]) if len(sys.argv) > 1 else 2018
kw = {a.split("=")[0][2:]: int(a.split("=")[1]) for a in sys.argv[2:] if "=" in a}
llm = LLM(**kw)
msgs = [[{"role": "user", "content": p}] for p in make_prompts(32, seed + 7)]
sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
llm.chat(msgs[:2], SamplingParams(max_tokens=4))
t = time.perf_counter()
outs = llm.chat(msgs, sp)
dt = time.perf_counter() - t
n_in = sum(len(o.prompt_token_ids) for o in outs)
n_out = sum(len(o.outputs[0].token_ids) for o in outs)
rate = n_out / dt
print(f"seed {seed}: {n_in} prompt + {n_out} output tokens in {dt:.1f} s: {rate:.1f} out tok/s")
