"""Logits processors: what a request's history does to its next-token logits before sampling, with vLLM's meanings.

In the order vLLM V1's sampler applies them (each on the previous one's result), per row that asks:

    min_tokens        EOS and ``stop_token_ids`` -> -inf while the output is shorter than ``min_tokens``
    logit_bias        logits[t] += bias[t]
    repetition        tokens of the prompt or the output: positive logits / p, negative logits * p
    frequency         logits[t] -= frequency_penalty * (times t occurs in the output)
    presence          logits[t] -= presence_penalty * (t occurs in the output)

then temperature, ``min_p``, top-k and top-p (``sampler.probabilities``).  Logprobs are taken before all of this
(raw, as vLLM V1 returns them).  Greedy requests take the argmax of the processed logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from minillm.sampling.params import SamplingParams


def process_row(logits: Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
                eos_token_ids: Sequence[int] = ()) -> Tensor:
    """One row's processed logits: [V] -> a new [V] fp32 tensor (the input is not changed).  Cost: O(V) plus the
    history's length, only for requests with ``params.processes_logits``."""
    x = logits.float().clone()
    v = x.shape[-1]
    if len(output_ids) < params.min_tokens:
        banned = [t for t in (*(() if params.ignore_eos else eos_token_ids), *params.stop_token_ids) if t < v]
        x[banned] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=x.device)
        x[ids] += torch.tensor(list(params.logit_bias.values()), dtype=x.dtype, device=x.device)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(v, dtype=torch.bool, device=x.device)
        seen[torch.tensor([*prompt_ids, *output_ids], dtype=torch.long, device=x.device)] = True
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty or params.presence_penalty:
        out = torch.tensor(list(output_ids), dtype=torch.long, device=x.device)
        counts = torch.bincount(out, minlength=v)[:v].to(x.dtype)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype)
    return x


def process(logits: Tensor, params: Sequence[SamplingParams], seqs: Sequence, eos_token_ids: Sequence[int] = ()
            ) -> Tensor:
    """The batch's logits [B, V] with every row that asks processed (``process_row``); returned as is when no
    row asks (no copy).  ``seqs[i]``: row i's history, anything with ``token_ids`` (prompt + output) and
    ``num_prompt_tokens`` (the engine's ``Sequence``)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        ids, n = seqs[i].token_ids, seqs[i].num_prompt_tokens
        logits[i] = process_row(logits[i], params[i], ids[:n], ids[n:], eos_token_ids)
    return logits


def min_p_mask(logits: Tensor, min_p: float) -> Tensor:
    """Keep tokens whose probability is at least ``min_p`` × the most likely one's, -inf the rest (the most
    likely always survives).  [..., V] -> [..., V]; 0 disables it."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))
