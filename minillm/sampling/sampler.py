"""From logits to the next token: temperature, top-k, top-p, greedy, and seeded sampling.

Meanings follow vLLM's ``SamplingParams``: temperature 0 is greedy; top_k 0 or -1 is off; top_p 1.0 is off.
Filters apply in the order temperature → min-p → top-k → top-p, each on the result of the previous one (the
history-dependent processors — penalties, logit_bias, min_tokens — run before, in ``processors.py``).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from minillm.sampling.params import MIN_TEMPERATURE, SamplingParams
from minillm.sampling.processors import min_p_mask


def top_k_top_p_mask(logits: Tensor, k: int, p: float) -> Tensor:
    """Top-k, then top-p (nucleus) filtering: the kept logits unchanged, every other one -inf.  [..., V] -> [..., V].

    Contract (vLLM's meanings): ``k`` <= 0 or >= V keeps every token; otherwise exactly the k largest logits are
    kept, ties at the k-th value broken by the lower token index.  Then, over the softmax of what top-k kept
    (renormalised), a token is kept when the probability mass strictly before it in descending order (ties again
    by lower index) is < ``p``: the token that crosses p is included, the most likely token always survives, and
    ``p`` >= 1 keeps every token top-k kept.  Logits already -inf stay -inf.  Sampling from the softmax of the result
    is sampling from the original distribution restricted to the kept set and renormalised.  One sort per row.
    """
    ### BEGIN SOLUTION
    V = logits.shape[-1]
    if not 0 < k < V and p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # stable: ties by lower index
    keep_sorted = torch.ones_like(sorted_logits, dtype=torch.bool)
    if 0 < k < V:
        keep_sorted[..., k:] = False
        sorted_logits = sorted_logits.masked_fill(~keep_sorted, float("-inf"))
    if p < 1.0:
        probs = sorted_logits.softmax(dim=-1)  # renormalised over what top-k kept
        mass_before = probs.cumsum(dim=-1) - probs
        keep_sorted &= mass_before < p
        keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
    ### END SOLUTION


def top_k_mask(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits (exactly k; ties broken by index), set the rest to -inf.  [..., V] -> [..., V]."""
    return top_k_top_p_mask(logits, k, 1.0)


def top_p_mask(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to ≥ p (the nucleus), -inf the rest.

    A token is kept when the mass strictly before it (in descending order) is < p, so the token that crosses
    p is included and the most likely token always survives.  [..., V] -> [..., V].
    """
    return top_k_top_p_mask(logits, 0, p)


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a non-greedy request samples from.  logits [V] or [B, V] -> probs, fp32.

    The logits are shifted so their maximum is 0 before dividing by the temperature (floored at
    ``MIN_TEMPERATURE``): every scaled value is then <= 0, so a tiny temperature underflows to -inf (probability 0)
    instead of overflowing to inf, and the argmax keeps probability > 0; a huge one flattens to uniform.
    """
    x = logits.float()
    masked = x == float("-inf")  # stays -inf: a huge temperature (inf in fp32) would turn -inf / inf into nan
    x = ((x - x.amax(dim=-1, keepdim=True)) / max(params.temperature, MIN_TEMPERATURE)).masked_fill(masked, -torch.inf)
    x = min_p_mask(x, params.min_p)
    x = top_k_top_p_mask(x, params.top_k, params.top_p)
    return x.softmax(dim=-1)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: ``seed`` itself for sample 0, else a hash of
    (seed, index) in [0, 2**63).  ``seed + index`` would make sample 1 of seed 0 repeat sample 0 of seed 1."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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
