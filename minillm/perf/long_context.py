"""Long context in bounded memory, measured: perplexity against KV bytes per eviction policy, through the engine.

Each policy runs the same long held-out text as ONE prompt through an ``LLMEngine`` with
``SamplingParams(prompt_logprobs=0)``: every prompt token after the first is scored (teacher-forced) from the K/V
the engine really holds when it computes that token.  The prompt is prefilled in chunks of ``chunk_tokens`` (well
below the window), so blocks are evicted while the prompt is still being read and later tokens are predicted
without the evicted keys — the cache a long document or chat would run with.  Then a short greedy decode
continues from the end of the text, the decode rate at position ≈ T.

Policies (``POLICIES``):

- ``full``: no eviction (the reference: exactly the plain causal forward's perplexity while T fits one forward);
- ``window``: the last ``window_tokens`` keys only (``kv_eviction="sink"`` with ``sink_tokens=0``);
- ``sinks``: the first ``sink_tokens`` keys plus the last ``window_tokens`` (StreamingLLM);
- ``h2o``: those plus ``heavy_tokens`` more, the blocks with the most accumulated attention mass (H2O's heavy
  hitters, ``kv.eviction.H2OPolicy``; its attention runs on the reference, which also returns the mass: its
  decode rate prices that, not the kernels).

Per policy: perplexity, the blocks the sequence holds after its prompt and at the end of the decode (× bytes per
block = KV bytes held), and the KV bytes one decode step at the end reads — the kept keys
(``kept_tokens`` × K/V bytes per token; under ``h2o`` every key of its held blocks, counted from its table): it
grows with the position under ``full`` and stops at sinks + window (+ heavy hitters) under eviction.
Cost: one prefill of T tokens and ``decode_tokens`` decode steps per policy.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

POLICIES = ("full", "window", "sinks", "h2o")
WINDOW_POLICIES = POLICIES[:3]  # ``long_context_eval``'s default: the positional rules


@dataclass(frozen=True)
class LongContextRow:
    """One policy's numbers on the same ``num_tokens`` of text (KV bytes for one sequence, K and V, all layers)."""

    policy: str
    window_tokens: int | None  # None: full cache
    sink_tokens: int
    heavy_tokens: int  # 0 but under h2o
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_tokens: int  # prompt tokens (num_tokens - 1 scored)
    blocks_after_prompt: int  # blocks the sequence holds once its prompt is computed
    blocks_held: int  # ... and at the end of its decode
    kv_bytes_held: int  # blocks_held × bytes per block
    kv_bytes_read_per_token: float  # K/V a decode step at the last position reads: kept keys × bytes per token
    decode_tokens: int
    decode_tokens_per_s: float  # timing: the machine's, never asserted

    def as_dict(self) -> dict:
        return asdict(self)


def kept_tokens(position: int, window_tokens: int | None, sink_tokens: int = 0) -> int:
    """Keys the query at 0-based ``position`` attends to: position + 1 with the full cache, else at most the
    sinks plus the window (the rule ``kernels.reference.kept_keys`` masks with, counted)."""
    if window_tokens is None or position + 1 <= window_tokens:
        return position + 1
    return window_tokens + min(sink_tokens, position + 1 - window_tokens)


def policy_settings(policy: str, window_tokens: int, sink_tokens: int, heavy_tokens: int | None = None
                    ) -> dict[str, int | None]:
    """``run_policy``'s window_tokens, sink_tokens and heavy_tokens for ``policy``: full -> (None, 0, None),
    window -> (W, 0, None), sinks -> (W, k, None), h2o -> (W, k, heavy_tokens)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    window, sinks = {"full": (None, 0), "window": (window_tokens, 0)}.get(policy, (window_tokens, sink_tokens))
    return {"window_tokens": window, "sink_tokens": sinks, "heavy_tokens": heavy_tokens if policy == "h2o" else None}


def run_policy(model, token_ids: Tensor, *, window_tokens: int | None, sink_tokens: int = 0, block_size: int = 16,
               chunk_tokens: int | None = None, decode_tokens: int = 16, policy: str | None = None,
               engine_config: dict | None = None, policy_class: type | None = None,
               heavy_tokens: int | None = None) -> LongContextRow:
    """Score ``token_ids`` [T] through a fresh engine on ``model`` with the given window / sinks (``window_tokens``
    None: full cache; ``heavy_tokens``: H2O with that heavy-hitter budget), prefilling ``chunk_tokens`` per step
    (default: a quarter of the window, at least the block size), then decode ``decode_tokens`` greedily, every
    policy on the eager runner (eviction has no CUDA graphs, so the full cache gets none either: the rates compare
    the caches, not the runners).
    ``engine_config``: more ``EngineConfig`` fields (they win over these);
    ``policy_class``: a ``KVEvictionPolicy`` subclass whose ``freeable_blocks`` the block manager calls instead of
    the library's (the course's exercise: the engine runs on the student's rule; not under H2O)."""
    from minillm.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine
    from minillm.kv.eviction import EVICTED
    from minillm.kv.paged_cache import kv_bytes_per_block
    from minillm.sampling.params import SamplingParams

    ids = [int(t) for t in token_ids.reshape(-1)]
    T = len(ids)
    if T < 2:
        raise ValueError(f"token_ids must hold at least 2 tokens (one scored), got {T}")
    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be >= 2 (a rate needs two tokens), got {decode_tokens}")
    window = window_tokens
    chunk = chunk_tokens or max(block_size, (window or T) // 4)
    evict = {} if window is None else {"kv_eviction": "sink", "window_tokens": window, "sink_tokens": sink_tokens}
    if heavy_tokens is not None:
        evict.update(kv_eviction="h2o", heavy_tokens=heavy_tokens)
    blocks = -(-(T + decode_tokens) // block_size) + 1  # the prompt is allocated whole at admission
    config = EngineConfig(block_size=block_size, num_kv_blocks=blocks, max_num_seqs=1,
                          max_num_batched_tokens=chunk, enable_prefix_caching=False,
                          max_model_len=T + decode_tokens, **{"enforce_eager": True, **evict, **(engine_config or {})})
    eng = LLMEngine(model, config=config)
    if policy_class is not None and window is not None and heavy_tokens is None:
        own = eng.block_manager.eviction
        eng.block_manager.eviction = policy_class(own.window_tokens, own.sink_tokens)
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    eng.add_request(ids, params, "long")
    after_prompt = held = held_keys = None
    decode_start = None
    while eng.has_unfinished_requests():
        updates = eng.step()
        if updates and after_prompt is None:  # the step that computed the prompt's last chunk sampled token 1
            after_prompt = eng.block_manager.device.num_used
            decode_start = time.perf_counter()
        if eng.has_unfinished_requests():
            held = eng.block_manager.device.num_used
            table = eng.block_manager.sequence(eng.scheduler.running[0].seq_id)
            held_keys = sum(min(block_size, len(table.token_ids) - i * block_size)
                            for i, b in enumerate(table.block_ids) if b != EVICTED)
    decode_end = time.perf_counter()
    out = eng.pop_output("long")
    eng.shutdown()
    if out.finish_reason == "error":  # e.g. a policy class whose rule raised inside the engine's step
        raise RuntimeError(f"the long-context request failed in the engine: {out.error}")
    decode_s = decode_end - decode_start
    nll = -sum(entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if i) / (T - 1)
    block_bytes = kv_bytes_per_block(model.config, block_size, model.dtype, config.kv_cache_dtype)
    last = T + decode_tokens - 2  # the last decode step's query position (its sampled token is not fed)
    read = held_keys if heavy_tokens is not None else kept_tokens(last, window, sink_tokens)  # H2O: held blocks
    return LongContextRow(
        policy=policy or ("full" if window is None else "h2o" if heavy_tokens is not None
                          else "sinks" if sink_tokens else "window"),
        window_tokens=window, sink_tokens=sink_tokens if window is not None else 0, heavy_tokens=heavy_tokens or 0,
        ppl=math.exp(nll), nll=nll,
        num_tokens=T, blocks_after_prompt=after_prompt, blocks_held=held, kv_bytes_held=held * block_bytes,
        kv_bytes_read_per_token=read * block_bytes / block_size,
        decode_tokens=decode_tokens, decode_tokens_per_s=(decode_tokens - 1) / decode_s)


@torch.inference_mode()
def long_context_eval(model, token_ids: Tensor, *, window_tokens: int, sink_tokens: int = 4,
                      policies: tuple[str, ...] = WINDOW_POLICIES, heavy_tokens: int | None = None,
                      **kw) -> list[LongContextRow]:
    """``run_policy`` for each of ``policies`` on the same tokens (``kw``: its keyword arguments); "h2o" keeps
    ``heavy_tokens`` heavy hitters (default: ``window_tokens``)."""
    from minillm.kv.eviction import H2OPolicy, KVEvictionPolicy

    KVEvictionPolicy(window_tokens, sink_tokens)  # bad window / sinks -> ValueError before any engine is built
    heavy = window_tokens if heavy_tokens is None else heavy_tokens
    if "h2o" in policies:
        H2OPolicy(window_tokens, sink_tokens, heavy)
    return [run_policy(model, token_ids, policy=p, **kw, **policy_settings(p, window_tokens, sink_tokens, heavy))
            for p in policies]


def format_table(rows: list[LongContextRow]) -> str:
    """The rows as a fixed-width text table (KV in KiB; blocks held once the prompt is computed / at the end)."""
    head = (f"{'policy':<8}{'window':>8}{'sinks':>7}{'heavy':>7}{'ppl':>10}{'blocks prompt/end':>19}{'KV held KiB':>13}"
            f"{'KV read/token KiB':>19}{'decode tok/s':>14}")
    lines = [head]
    for r in rows:
        blocks = f"{r.blocks_after_prompt}/{r.blocks_held}"
        lines.append(f"{r.policy:<8}{r.window_tokens or '-':>8}{r.sink_tokens:>7}{r.heavy_tokens or '-':>7}"
                     f"{r.ppl:>10.3f}{blocks:>19}"
                     f"{r.kv_bytes_held / 1024:>13.1f}{r.kv_bytes_read_per_token / 1024:>19.1f}"
                     f"{r.decode_tokens_per_s:>14.1f}")
    return "\n".join(lines)
