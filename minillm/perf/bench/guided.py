"""Structured output's cost per step: the grammar mask (``sampling.guided.mask_logits``) against the decode step
it rides on, at several batch sizes, on the default model and tokenizer.

For each batch B: B matchers of one JSON schema walk a random valid path (each step: mask random logits [B, V],
take the argmax, advance the matchers — restarted when a grammar completes), timing ``mask_logits`` alone (one
batched bitmask fill + one apply) and the plain per-row fill it replaces (one ``fill_next_token_bitmask`` per
matcher); then the engine decodes B unconstrained requests (``ignore_eos``) and the step's time is wall time per
step.  ``mask / step`` is the fraction a guided batch adds to every step (the request-level cost is in
``bench serve --json-schema``).

Not a test: it times, it asserts nothing; compare ratios within one run.
"""

from __future__ import annotations

import time

import torch

from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.perf.bench.decode import save_results
from minillm.sampling.guided import GrammarCompiler, GuidedDecodingParams, mask_logits
from minillm.sampling.params import SamplingParams

# A schema with the usual parts of a structured answer: strings, a bounded integer, an enum, an array.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 4}},
    "required": ["name", "age", "color", "tags"]}


def time_masks(compiler: GrammarCompiler, batch: int, steps: int, seed: int = 0) -> dict:
    """ms per step of the batched mask and of the per-row fill, over ``steps`` steps of ``batch`` matchers."""
    import xgrammar as xgr

    guided = GuidedDecodingParams(json=SCHEMA)
    matchers = compiler.matchers(guided, batch)
    g = torch.Generator().manual_seed(seed)
    batched = per_row = 0.0
    for _ in range(steps):
        logits = torch.randn(batch, compiler.vocab_size, generator=g)
        t = time.perf_counter()
        masked = mask_logits(logits, matchers)
        batched += time.perf_counter() - t
        bitmask = xgr.allocate_token_bitmask(batch, compiler.vocab_size)
        t = time.perf_counter()
        for i, m in enumerate(matchers):  # the plain twin: one fill per row
            m.fill_next_token_bitmask(bitmask, i)
        per_row += time.perf_counter() - t
        for i, token in enumerate(masked.argmax(dim=-1).tolist()):
            matchers[i].accept_token(token)
            if matchers[i].is_terminated():
                matchers[i] = compiler.matchers(guided, 1)[0]
    return {"mask_ms": batched / steps * 1e3, "per_row_fill_ms": per_row / steps * 1e3}


def time_decode_step(engine: LLMEngine, batch: int, tokens: int) -> float:
    """ms per engine step while ``batch`` unconstrained requests decode ``tokens`` tokens each (prefill included:
    a short prompt, so decode steps dominate)."""
    before = engine.stats.steps
    t = time.perf_counter()
    engine.generate(["Write a long story about the sea."] * batch,
                    SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return (time.perf_counter() - t) / max(engine.stats.steps - before, 1) * 1e3


def bench_guided(batch_sizes=(1, 8, 32), steps: int = 64, tokens: int = 32, save: bool = True) -> dict:
    """Print and return (and save as JSON) the mask's and the decode step's ms per step at each batch size."""
    from minillm.llm import LLM

    llm = LLM()
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=max(batch_sizes)))
    compiler = engine.grammar_compiler
    time_masks(compiler, 1, 4)  # warm-up: compile the schema, build the caches
    rows = []
    print(f"{'batch':>5} {'mask ms':>9} {'per-row fill ms':>16} {'step ms':>9} {'mask/step':>10}")
    for b in batch_sizes:
        row = {"batch": b, **time_masks(compiler, b, steps), "step_ms": time_decode_step(engine, b, tokens)}
        row["mask_over_step"] = row["mask_ms"] / row["step_ms"]
        rows.append(row)
        print(f"{b:5d} {row['mask_ms']:9.2f} {row['per_row_fill_ms']:16.2f} {row['step_ms']:9.1f} "
              f"{row['mask_over_step']:10.1%}")
    payload = {"benchmark": "guided", "schema": SCHEMA, "steps": steps, "rows": rows}
    if save:
        payload["path"] = str(save_results("guided", payload))
        print(f"saved {payload['path']}")
    return payload
