"""minillm on a GGUF's blocks (``quantization="int4"``'s path) against transformers on the same file dequantized to
fp32: the logits of one random prompt.

python benchmarks/gguf_vs_transformers.py FILE.gguf

The GGUF's directory must hold the model's config.json (``make-model`` writes both).  Prints max |Δlogit| over
max |logit| and how often the two argmaxes agree.  Not a test: it loads the model twice (the fp32 copy is 4× the
file).
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from minillm.models.loader import load_config, resolve
from minillm.quant.apply import model_from_packed
from minillm.quant.gguf import read_gguf_weights

path = Path(sys.argv[1])
ids = torch.randint(100, 40000, (1, 48), generator=torch.Generator().manual_seed(0))
ours = model_from_packed(load_config(resolve(path.parent)), read_gguf_weights(path), dtype=torch.float32, device="cpu")
with torch.inference_mode():
    a = ours(ids, torch.arange(ids.shape[1])[None])[0]
del ours
hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
with torch.inference_mode():
    b = hf(ids).logits[0]
print(f"{path.name}: max |Δlogit| / max |logit| = {float((a - b).abs().max() / b.abs().max()):.4f}; "
      f"argmax agreement {float((a.argmax(-1) == b.argmax(-1)).float().mean()):.3f}")
