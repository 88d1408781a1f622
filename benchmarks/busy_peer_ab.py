"""minillm vs llama.cpp batch-1 decode on the same GGUF, alternated in rounds.

python benchmarks/busy_peer_ab.py F.gguf ROUNDS

T (environment, default 2) threads each.  An OpenMP wait policy in the environment (OMP_WAIT_POLICY, GOMP_SPINCOUNT)
applies to minillm only: it is dropped before llama.cpp's process starts.  Run it beside a neighbour to compare how
both degrade.
"""

import os
import statistics
import sys
from pathlib import Path

import torch

from minillm.models.loader import load_config, resolve
from minillm.perf.bench.llamacpp import LlamaCppPeer
from minillm.perf.bench.quant import decode_rate
from minillm.quant.apply import model_from_packed
from minillm.quant.gguf import read_gguf_weights

path = Path(sys.argv[1])
rounds = int(sys.argv[2])
threads = int(os.environ.get("T", 2))
torch.set_num_threads(threads)
POLICY = (
    os.environ.pop("OMP_WAIT_POLICY", "")
    + ("spin=" + os.environ.pop("GOMP_SPINCOUNT") if "GOMP_SPINCOUNT" in os.environ else "")
    or "default"
)  # read by libgomp at load; llama.cpp's process runs with the default
model = model_from_packed(load_config(resolve(path.parent)), read_gguf_weights(path), dtype=torch.float32, device="cpu")
peer = LlamaCppPeer(path, threads=threads, n_ctx=512)
peer.load()
prompt = list(range(100, 164))
a, b = [], []
for _ in range(rounds):
    a.append(decode_rate(model, [prompt], 16)[1])
    b.append(peer.decode(prompt, 16))
peer.close()
ma, mb = statistics.median(a), statistics.median(b)
print(f"T={threads} wait={POLICY} minillm {ma:.2f} llama.cpp {mb:.2f} ratio {ma / mb:.2f}")
print("  rounds:", [round(x, 1) for x in a], "/", [round(x, 1) for x in b])
