"""Generation loops: the naive one (recompute everything each step) and the cached one (prefill, then decode).

Both take a batch of token-id prompts of different lengths and per-request ``SamplingParams`` and yield each
token as it is produced (a ``StepOutput`` whose ``request_id`` is the prompt's index as a string, no text: these
loops have no tokenizer), so callers can stream; when a loop ends it *returns* the final ``SequenceState``s
(``states = yield from stream_cached(...)``, or ``generate()`` below).  The naive loop is the reference the cached
loop is tested against; it costs O(T²) attention per token, the cached loop O(T).  ``LLM`` and ``LLMEngine`` do not
run on these loops: they are the plain references of notebooks 01–02 that the engine is tested against.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minillm.engine.inputs import params_list, validate_prompts
from minillm.kv.contiguous import KVCache, SlidingWindowKVCache
from minillm.models.llama import Transformer
from minillm.outputs import RequestMetrics, StepOutput
from minillm.sampling.params import SamplingParams, finish_reason
from minillm.sampling.sampler import make_generator, sample


@dataclass
class SequenceState:
    """One request's state inside a generation loop."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


# What a loop yields per token, and what it returns when every request has finished.
Stream = Generator[StepOutput, None, list["SequenceState"]]


def _start(model: Transformer, prompts, params) -> list[SequenceState]:
    params = params_list(params, len(prompts))
    validate_prompts(prompts, model.config.max_position_embeddings, model.config.vocab_size)
    now = time.perf_counter()
    return [SequenceState(list(p), sp, make_generator(sp, model.device),
                          metrics=RequestMetrics(prompt_tokens=len(p), start_s=now))
            for p, sp in zip(prompts, params, strict=True)]


def _append(seq: SequenceState, token: int, eos_ids: frozenset[int], max_len: int, index: int) -> StepOutput:
    """Record a sampled token and whether it ends the request; returns the update to yield."""
    now = time.perf_counter()
    seq.output.append(token)
    m = seq.metrics
    m.record_token(now)
    seq.finish_reason = finish_reason(seq.params, token, len(seq.output), seq.length, eos_ids, max_len)
    if seq.done:
        m.finish_s = now
    return StepOutput(str(index), 0, [token], "", seq.finish_reason, metrics=m if seq.done else None)


def _right_pad(rows: list[list[int]], device) -> tuple[Tensor, Tensor, Tensor]:
    """Pad to the longest row. -> ids [B, L], positions [B, L], index of each row's last real token [B]."""
    L = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (L - len(r)) for r in rows], dtype=torch.long, device=device)
    positions = torch.arange(L, device=device).expand(len(rows), L)
    last = torch.tensor([len(r) - 1 for r in rows], device=device)
    return ids, positions, last


@torch.inference_mode()
def stream_naive(model: Transformer, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams], eos_ids: Sequence[int] = ()) -> Stream:
    """Recompute the whole sequence every step (no cache): the reference.  Yields tokens as produced and
    returns the final ``SequenceState``s (exercise 1.5).

    Every step runs one forward pass over the unfinished requests only, each fed its whole sequence so far
    (prompt + output; rows of different lengths right-padded by ``_right_pad``, which also gives each row's
    last real position).  The first step is the prefill, every later one recomputes it all: O(T²).  The next
    token of a row comes from the logits at its *last real* token (``model.hidden_states`` [B, L, hidden] then
    ``model.compute_logits`` [B, V], in fp32), drawn by ``sample`` with the request's params and generator.
    ``_append`` records a token (and decides whether the request has finished: EOS, ``max_tokens``, context);
    yield its ``StepOutput`` as soon as the token exists, in request order; stop when every request is done.
    """
    seqs = _start(model, prompts, params)
    eos, max_len = frozenset(eos_ids), model.config.max_position_embeddings
    ### BEGIN SOLUTION
    while active := [i for i, s in enumerate(seqs) if not s.done]:
        ids, positions, last = _right_pad([seqs[i].prompt + seqs[i].output for i in active], model.device)
        hidden = model.hidden_states(ids, positions)  # (B, L, hidden): every token, every step
        logits = model.compute_logits(hidden[torch.arange(len(active)), last]).float()  # (B, V)
        tokens = sample(logits, [seqs[i].params for i in active], [seqs[i].generator for i in active])
        for i, t in zip(active, tokens, strict=True):
            yield _append(seqs[i], t, eos, max_len, i)
    return seqs
    ### END SOLUTION


@torch.inference_mode()
def stream_cached(model: Transformer, prompts: Sequence[Sequence[int]],
                  params: SamplingParams | Sequence[SamplingParams], eos_ids: Sequence[int] = ()) -> Stream:
    """Prefill all prompts in one right-padded forward, then decode one token per sequence per step.

    The cache holds max(prompt + max_tokens) slots per sequence (capped by the context).  Finished rows
    stay in the batch with a frozen position until all are done: simple, and the wasted work is what
    continuous batching (the engine) removes.  Returns the final ``SequenceState``s.
    """
    seqs = _start(model, prompts, params)
    eos, max_len = frozenset(eos_ids), model.config.max_position_embeddings
    cache_len = min(max_len, max(len(s.prompt) + s.params.max_tokens for s in seqs))
    window = model.config.sliding_window
    if window is not None and window < cache_len and model.config.sliding_layers is not None:
        raise ValueError(f"the cached loop keeps one cache for every layer; this model's layers alternate a "
                         f"{window}-token window and full attention, which it cannot mask past the window "
                         f"({cache_len} slots): run it with the engine (LLM / LLMEngine)")
    if window is not None and window < cache_len:  # keep only the window: memory W, not the whole sequence
        cache = SlidingWindowKVCache(model.config, len(seqs), window, dtype=model.dtype, device=model.device,
                                     kernels=model.kernels)
    else:
        cache = KVCache(model.config, len(seqs), cache_len, dtype=model.dtype, device=model.device,
                        kernels=model.kernels)
    B = len(seqs)

    ids, positions, last = _right_pad([s.prompt for s in seqs], model.device)
    cache.begin(positions, valid=positions <= last[:, None])
    hidden = model.hidden_states(ids, positions, cache)  # prefill: (B, L, hidden)
    logits = model.compute_logits(hidden[torch.arange(B), last]).float()  # (B, V)
    pos = last.clone()  # position of each row's newest token
    while True:
        active = [i for i, s in enumerate(seqs) if not s.done]
        tokens = sample(logits[active], [seqs[i].params for i in active], [seqs[i].generator for i in active])
        step_ids = torch.zeros(B, 1, dtype=torch.long, device=model.device)
        for i, t in zip(active, tokens, strict=True):
            yield _append(seqs[i], t, eos, cache_len, i)
        still = [i for i in active if not seqs[i].done]
        if not still:
            return seqs
        idx = torch.tensor(still, device=model.device)
        pos[idx] += 1  # finished rows keep rewriting their last slot, harmlessly
        step_ids[idx, 0] = torch.tensor([seqs[i].output[-1] for i in still], device=model.device)
        positions = pos[:, None]
        cache.begin(positions)
        logits = model.compute_logits(model.hidden_states(step_ids, positions, cache)[:, -1]).float()


def generate(model: Transformer, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
             *, eos_ids: Sequence[int] = (), cached: bool = True) -> list[SequenceState]:
    """Run a loop to completion and return each request's ``SequenceState`` (output ids, finish reason, metrics)."""
    loop = (stream_cached if cached else stream_naive)(model, prompts, params, eos_ids)
    while True:
        try:
            next(loop)
        except StopIteration as done:  # a generator's return value travels in StopIteration
            return done.value
