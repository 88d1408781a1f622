"""fp32 vs bf16 of the default model in one process, interleaved: batch-1 decode, batch-32 decode, prefill 512 (tok/s).

python benchmarks/dtype_ab.py ROUNDS (medians printed).
"""

import statistics
import sys

import torch

from minillm.models.loader import load_model
from minillm.perf.bench.quant import decode_rate

torch.set_num_threads(2)
models = {d: load_model(None, dtype=d, device="cpu") for d in ("float32", "bfloat16")}
p1 = [list(range(200, 328))]
p32 = [list(range(200 + i, 264 + i)) for i in range(32)]
p512 = [list(range(100, 612))]
res = {d: {"b1": [], "b32": [], "pf512": []} for d in models}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for d, m in models.items():
        res[d]["b1"].append(decode_rate(m, p1, 32)[1])
        res[d]["b32"].append(decode_rate(m, p32, 16)[1])
        res[d]["pf512"].append(512 / decode_rate(m, p512, 1)[0])
for d in res:
    print(d, {k: round(statistics.median(v), 1) for k, v in res[d].items()})
