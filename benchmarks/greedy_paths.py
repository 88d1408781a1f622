"""Greedy tokens of every engine path, as JSON: run it on two commits and diff the files.

    python benchmarks/greedy_paths.py OUT.json [--quick]

Paths: the eager runner, static decode buffers (the CUDA-graph path run uncaptured on CPU), the fused native step,
int4 weights through it, each speculative proposer (ngram, early exit, quantized self, a draft model), tensor
parallel over 2 (random model) or 3 (default model: 9 heads) processes, pipeline parallel over 2 — on the default
model and on two random tiny Llama configs.  Nothing is downloaded; the default model comes from its wheel.
Greedy decoding is deterministic on one machine, so two commits that run the same paths must print the same ids.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import LLM, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.distributed.executor import tp_generate
from minillm.distributed.pipeline import pp_generate
from minillm.models.loader import build_model, load_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
         "early_exit": {"method": "early_exit", "num_speculative_tokens": 3, "num_layers": 1},
         "quantized": {"method": "quantized", "num_speculative_tokens": 3}}


def prompts_for(vocab: int) -> list[list[int]]:
    """Three prompts, two with repeats (n-gram drafts find matches), one without."""
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [motif * 4, torch.randint(3, vocab, (11,), generator=g).tolist(), (motif + [7, 8]) * 3]


def tiny(layers: int, heads: int, kv_heads: int, seed: int):
    cfg = LlamaConfig(vocab_size=128, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128)
    torch.manual_seed(seed)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


def engine_paths(model, prompts, quick: bool) -> dict[str, list[list[int]]]:
    """Single-process paths on ``model`` (a Transformer), each a fresh engine."""
    def run(**kw):
        eng = LLMEngine(model, None, EngineConfig(max_num_seqs=4, **kw), eos_token_ids=())
        return [o.token_ids for o in eng.generate(prompts, GREEDY)]

    out = {"eager": run(enforce_eager=True), "static-buffers": run(enforce_eager=False), "fused": run()}
    for name, spec in SPECS.items():
        if not (quick and name == "quantized"):
            out[f"spec-{name}"] = run(speculative_config=spec)
    out["spec-draft"] = run(speculative_config={"model": model, "num_speculative_tokens": 3})
    return out


def main(argv: list[str]) -> int:
    path, quick = argv[0], "--quick" in argv
    results = {}
    for name, (layers, heads, kv, seed) in {"tiny-gqa": (4, 4, 2, 1), "tiny-mha": (2, 2, 2, 2)}.items():
        model = tiny(layers, heads, kv, seed)
        prompts = prompts_for(128)
        results[name] = engine_paths(model, prompts, quick)
        results[name]["tp2"] = [o.token_ids for o in tp_generate(model, prompts, GREEDY, tensor_parallel_size=2)]
        results[name]["pp2"] = [o.token_ids for o in pp_generate(model, prompts, GREEDY, pipeline_parallel_size=2)]
        print(f"{name}: {len(results[name])} paths", file=sys.stderr)
    model = load_model(None, dtype="float32")
    prompts = prompts_for(model.config.vocab_size)
    default = engine_paths(model, prompts, quick)
    default["int4-fused"] = engine_paths(load_model(None, dtype="float32", quantization="int4"), prompts,
                                         quick=True)["fused"]
    if not quick:
        with LLM(None, dtype="float32", tensor_parallel_size=3) as llm:
            default["tp3"] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        with LLM(None, dtype="float32", pipeline_parallel_size=2) as llm:
            default["pp2"] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    results["default"] = default
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}: " + ", ".join(f"{k} {len(v)} paths" for k, v in results.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
