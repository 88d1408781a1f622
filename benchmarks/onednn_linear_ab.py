"""Interleaved A/B of SmolLM2-135M's fp32 linears at mixed-step rows (64..512): ``F.linear`` against
``kernels/cpu/onednn.py`` (oneDNN on a weight packed once).

    PYTHONPATH=<tree> python benchmarks/onednn_linear_ab.py [THREADS] [ROUNDS]

Prints each shape's medians and the ratio (F.linear / packed: > 1 means packing is faster) and the ratio of the
summed medians; ratios only, and only within one run.
"""
import sys

import torch
import torch.nn.functional as F
from ab_timing import alternate  # benchmarks/ab_timing.py: the script's folder is on sys.path

from minillm.kernels.cpu import onednn

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 15
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [N, K]
totals = {"F.linear": 0.0, "packed": 0.0}
for name, (N, K) in SHAPES.items():
    w = 0.05 * torch.randn(N, K)
    for M in (64, 128, 256, 512):
        x = torch.randn(1, M, K)
        fns = {"F.linear": lambda x=x, w=w: F.linear(x, w), "packed": lambda x=x, w=w: onednn.linear(x, w)}
        fns["packed"]()  # pack once, outside the timing
        with torch.inference_mode():
            a, b = alternate(fns, ROUNDS).values()
        totals["F.linear"] += a
        totals["packed"] += b
        print(f"{name} [{N}x{K}] M={M}: F.linear {a * 1e3:.3f} ms, packed {b * 1e3:.3f} ms, ratio {a / b:.2f}",
              flush=True)
print(f"sum of medians: ratio {totals['F.linear'] / totals['packed']:.2f}")
