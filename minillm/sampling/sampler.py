"""From logits to the next token: temperature, top-k, top-p, greedy, and seeded sampling.

Meanings follow vLLM's ``SamplingParams``: temperature 0 is greedy; top_k 0 or -1 is off; top_p 1.0 is off.
Filters apply in the order temperature → top-k → top-p, each on the result of the previous one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.sampling.params import SamplingParams


def top_k_mask(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits (exactly k; ties broken by index), set the rest to -inf.  [..., V] -> [..., V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_mask(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to ≥ p (the nucleus), -inf the rest.

    A token is kept when the mass strictly before it (in descending order) is < p, so the token that crosses
    p is included and the most likely token always survives.  [..., V] -> [..., V].
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted = mass_before < p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a non-greedy request samples from.  logits [V] or [B, V] -> probs, fp32."""
    x = logits.float() / params.temperature
    x = top_k_mask(x, params.top_k)
    x = top_p_mask(x, params.top_p)
    return x.softmax(dim=-1)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private RNG for a seeded request, so its samples do not depend on what else runs beside it."""
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row.  logits [B, V] -> B token ids.  Greedy rows take the argmax (first index on ties)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"need logits [B, V] and B params/generators; got {tuple(logits.shape)}, "
                         f"{len(params)}, {len(generators)}")
    out = logits.argmax(dim=-1).tolist()  # one device sync for the whole batch
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            out[i] = int(torch.multinomial(probabilities(logits[i], p), 1, generator=g))
    return out
