"""Median time of ``kernels.paged_decode_attention`` at SmolLM2-135M's heads (9 query, 3 K/V, D 64), fp32, 16-token
blocks in a random order, for a few (batch, context) points.  To compare two trees, run it under each in turn:

    PYTHONPATH=/path/to/tree python benchmarks/paged_attention_times.py LABEL

and alternate the runs (ratios within one sitting only).
"""
import statistics
import sys
import time

import torch

from minillm import kernels

torch.set_num_threads(2)
H_Q, H_KV, D, BS = 9, 3, 64, 16
for B, S in ((1, 8192), (8, 8192), (32, 128), (1, 512)):
    g = torch.Generator().manual_seed(0)
    per = S // BS
    q = torch.randn(B, H_Q, D, generator=g)
    k_pool, v_pool = (torch.randn(B * per, BS, H_KV, D, generator=g) for _ in range(2))
    tables = torch.randperm(B * per, generator=g).view(B, per).to(torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32)
    for _ in range(3):
        kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    times = []
    for _ in range(30):
        t = time.perf_counter()
        kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens)
        times.append(time.perf_counter() - t)
    print(sys.argv[1] if len(sys.argv) > 1 else "", f"B={B} S={S}: {statistics.median(times) * 1e6:.0f} us", flush=True)
