"""Is a decode GEMV at the memory roof?  Pass by pass, interleaved: the 256 MiB streaming read (``native.read_sum``,
the probe "% of read" divides by), a Llama-3.2-1B-shaped stack of int4 (8 layers) and int8 (4 layers) weights run as
the fused decode step runs its GEMVs (``LinearStack.run``, batch 1), and the same bytes read in the same order with
no arithmetic (``LinearStack.read_only``).  GB/s per pass, then min / median / max of each column.

On a host whose memory serves some passes much faster than most, a probe that keeps its fastest pass overstates the
roof the kernels meet on every pass: compare the medians.

python benchmarks/stack_vs_read.py [PASSES]
"""

import statistics
import sys
import time

import torch

from minillm.kernels.cpu import native
from minillm.perf.bench.linear_stack import LinearStack
from minillm.quant.weight import quantize_int4, quantize_int8

torch.set_num_threads(2)
passes = int(sys.argv[1]) if len(sys.argv) > 1 else 40
g = torch.Generator().manual_seed(0)
shapes = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # qkv, o, gate_up, down of Llama-3.2-1B
w4 = [quantize_int4(torch.randn(n, k, generator=g) * 0.02, 32) for _ in range(8) for n, k in shapes]
w8 = [quantize_int8(torch.randn(n, k, generator=g) * 0.02) for _ in range(4) for n, k in shapes]
n4, n8 = sum(w.nbytes for w in w4), sum(w.nbytes for w in w8)
s4, s8 = LinearStack(w4, 1), LinearStack(w8, 1)
buf = torch.ones(256 << 18)  # 256 MiB fp32, ≫ L3
columns = {"read": (lambda: native.read_sum(buf), buf.nbytes), "int4 run": (s4.run, n4),
           "int4 read-only": (s4.read_only, n4), "int8 run": (s8.run, n8), "int8 read-only": (s8.read_only, n8)}
print(f"int4 stack {n4 / 1e6:.0f} MB, int8 stack {n8 / 1e6:.0f} MB, read {buf.nbytes / 1e6:.0f} MB; GB/s per pass")
rates = {c: [] for c in columns}
for fn, _ in columns.values():
    fn()  # warm-up
for _ in range(passes):
    for c, (fn, nbytes) in columns.items():
        t = time.perf_counter()
        fn()
        rates[c].append(nbytes / (time.perf_counter() - t) / 1e9)
    print("  ".join(f"{c} {rates[c][-1]:5.1f}" for c in columns), flush=True)
for c, v in rates.items():
    print(f"{c:15} min {min(v):5.1f}  median {statistics.median(v):5.1f}  max {max(v):5.1f}")
