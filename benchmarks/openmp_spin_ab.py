"""One process, one OpenMP wait policy (from the caller's environment): tok/s of the default model in fp32 at batch 1
and 32 and a 512-token prefill, and of a GGUF model at batch 1.  Alternate policies across processes, e.g.

    for i in 1 2; do MINILLM_OMP_SPIN=default python benchmarks/openmp_spin_ab.py F.gguf
                     OMP_WAIT_POLICY=passive python benchmarks/openmp_spin_ab.py F.gguf
                     GOMP_SPINCOUNT=10000 python benchmarks/openmp_spin_ab.py F.gguf; done

and again beside a neighbour (two `python3 -c "while True: pass"` processes).
"""

import os
import statistics
import sys
from pathlib import Path

import torch

from minillm.models.loader import load_config, load_model, resolve
from minillm.perf.bench.quant import decode_rate
from minillm.quant.apply import model_from_packed
from minillm.quant.gguf import read_gguf_weights

torch.set_num_threads(2)
small = load_model(None, dtype="float32", device="cpu")
g = Path(sys.argv[1])  # a GGUF beside its config.json (make-model --gguf)
big = model_from_packed(load_config(resolve(g.parent)), read_gguf_weights(g), dtype=torch.float32, device="cpu")
p1 = [list(range(200, 328))]
p32 = [list(range(200 + i, 264 + i)) for i in range(32)]
p512 = [list(range(100, 612))]
r = {"b1": [], "b32": [], "pf512": [], "1B b1": []}
for _ in range(3):
    r["b1"].append(decode_rate(small, p1, 32)[1])
    r["b32"].append(decode_rate(small, p32, 16)[1])
    r["pf512"].append(512 / decode_rate(small, p512, 1)[0])
    r["1B b1"].append(decode_rate(big, p1, 16)[1])
tag = os.environ.get("OMP_WAIT_POLICY") or (
    "spin=" + os.environ["GOMP_SPINCOUNT"] if "GOMP_SPINCOUNT" in os.environ else "default"
)
print(f"{tag:12s} " + "  ".join(f"{k} {statistics.median(v):7.1f}" for k, v in r.items()), flush=True)
