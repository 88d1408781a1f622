"""Logprobs as vLLM returns them: a token's log-probability, its rank, and the top-k alternatives.

Raw logprobs (vLLM V1's default, ``logprobs_mode="raw_logprobs"``): ``log_softmax`` of the model's fp32 logits,
before penalties, logit_bias, temperature, min-p, top-k and top-p.  A token's rank is 1 + the number of tokens
with a strictly larger logprob (the argmax has rank 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the ``token`` that came (sampled, or the next prompt token), its ``logprob`` and ``rank``, and
    the ``top`` k (token id, logprob) pairs, most likely first (k = what the request asked)."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row i of ``logits`` [R, V] scored at ``tokens[i]`` with its top ``ks[i]``.  Cost: one fp32 ``log_softmax``
    over the R rows (only the rows that asked: the caller picks them), one top-k at max(ks), one host copy."""
    if logits.dim() != 2 or logits.shape[0] != len(tokens) or len(tokens) != len(ks):
        raise ValueError(f"need logits [R, V] and R tokens and ks; got {tuple(logits.shape)}, {len(tokens)}, "
                         f"{len(ks)}")
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device).unsqueeze(-1))  # (R, 1)
    ranks = (lp > chosen).sum(-1) + 1  # (R,)
    k = min(max(ks), lp.shape[-1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen_l, ranks_l, top_lp_l, top_ids_l = chosen[:, 0].tolist(), ranks.tolist(), top_lp.tolist(), top_ids.tolist()
    return [TokenLogprobs(t, c, r, tuple(zip(ids[:ki], lps[:ki], strict=True)))
            for t, c, r, ids, lps, ki in zip(tokens, chosen_l, ranks_l, top_ids_l, top_lp_l, ks, strict=True)]
