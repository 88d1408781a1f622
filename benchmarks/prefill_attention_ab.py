"""Interleaved A/B of causal prefill attention at SmolLM2-135M's heads (9 query, 3 K/V, D 64), fp32, at the chunk
shapes of the ``bench serve`` trace run offline (L queries after a cached prefix P): SDPA as the reference path
calls it (one call, an explicit [L, S] mask when P > 0) against ``kernels/cpu/prefill.py``'s query tiles.

    python benchmarks/prefill_attention_ab.py [THREADS] [ROUNDS]

Prints each shape's median times and the ratio (SDPA / tiles: > 1 means the tiles are faster); ratios only, and
only within one run.
"""
import sys

import torch
from ab_timing import alternate  # benchmarks/ab_timing.py: the script's folder is on sys.path

from minillm.kernels.cpu.prefill import tiled_prefill_attention
from minillm.kernels.reference import sdpa_attention

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 15
SHAPES = ((100, 32), (200, 32), (300, 32), (505, 32), (300, 0), (505, 1044), (12, 272))
for L, P in SHAPES:
    g = torch.Generator().manual_seed(L + P)
    q = torch.randn(1, L, 9, 64, generator=g).transpose(1, 2)  # the model's layout: a view of the packed rows
    k, v = (torch.randn(1, 3, P + L, 64, generator=g) for _ in range(2))
    fns = {"sdpa": lambda q=q, k=k, v=v: sdpa_attention(q, k, v, causal=True),
           "tiles": lambda q=q, k=k, v=v: tiled_prefill_attention(q, k, v, causal=True)}
    a, b = alternate(fns, ROUNDS).values()
    print(f"L={L} P={P}: sdpa {a * 1e3:.2f} ms, tiles {b * 1e3:.2f} ms, ratio {a / b:.2f}", flush=True)
