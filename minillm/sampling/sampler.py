"""From logits to the next token: temperature, top-k, top-p, greedy, and seeded sampling.

Meanings follow vLLM's ``SamplingParams``: temperature 0 is greedy; top_k 0 or -1 is off; top_p 1.0 is off.
Filters apply in the order temperature → min-p → top-k → top-p, each on the result of the previous one (the
history-dependent processors — penalties, logit_bias, min_tokens — run before, in ``processors.py``).
Rows that only scale by a temperature (what an OpenAI client sends by default) are drawn on CPU by a native kernel
(``kernels.cpu.native.sample_temperature``) from the same distribution with the same uniform; ``probabilities`` and
``sample_from`` here are the reference every other row takes.
"""

from __future__ import annotations

import hashlib
import math

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


# How many of a row's most likely tokens ``filter_top_k_top_p`` tries, in turn, when only top-p is on: the nucleus of
# an LLM's next-token distribution at p ≤ 0.95 and temperature ≤ 1 is mostly a few to a few hundred tokens; a row
# whose candidates hold less than p tries the next size, and past the last is sorted whole.  A top-C selection costs
# about the same for any C here; sorting the C candidates grows with C.
TOP_P_CANDIDATES = (1024, 8192)


def filter_top_k_top_p(logits: Tensor, k: int, p: float) -> Tensor:
    """``top_k_top_p_mask``'s kept set, found among a row's most likely tokens instead of by sorting the whole
    vocabulary (what ``probabilities`` runs).  [V] or [B, V] -> the same shape, kept logits unchanged, others -inf.

    Every token top-k / top-p can keep is among the C largest logits — taken with every logit that ties the C-th, in
    index order, so ties still go to the lower index — when top-k is on with C = k, or when top-k is off and those C
    (each size of ``TOP_P_CANDIDATES`` in turn) hold at least p of the probability mass.  ``top_k_top_p_mask`` then
    runs on that sub-row; with top-k off its p is rescaled by the candidates' share of the mass (a token's mass
    before it over the whole row is its mass before it over the candidates times their share).  A row no candidate
    size covers, a vocabulary under 4·C, or logits off the CPU, is filtered whole by ``top_k_top_p_mask``.  Same
    kept set as ``top_k_top_p_mask`` on the whole row, up to the last bit of the mass compared with p.  Cost per
    row: top-C selections and logsumexps, O(V), and a sort of C entries, instead of a sort of V — the sort is most
    of a sampled decode step's sampling time at a 49k-128k vocabulary.
    """
    V = logits.shape[-1]
    top_k_on = 0 < k < V
    if not top_k_on and p >= 1.0:
        return logits
    sizes = [C for C in ((k,) if top_k_on else TOP_P_CANDIDATES) if 4 * C <= V]
    if not sizes or logits.device.type != "cpu":  # a GPU sorts a row in microseconds; the candidates' syncs cost more
        return top_k_top_p_mask(logits, k, p)
    rows = logits.reshape(-1, V)
    out = torch.full_like(rows, float("-inf"))
    for r, row in enumerate(rows):
        total = None if top_k_on else torch.logsumexp(row, 0)
        for C in sizes:
            t = row.topk(C, sorted=False).values.amin()
            idx = ((row >= t) & (row > float("-inf"))).nonzero().squeeze(1)  # ascending token index
            sub = row[idx]
            if top_k_on:
                out[r, idx] = top_k_top_p_mask(sub, k, p)
                break
            share = float(torch.exp(torch.logsumexp(sub, 0) - total)) if idx.numel() else 0.0
            if share >= p:
                out[r, idx] = top_k_top_p_mask(sub, 0, min(p / share, 1.0))
                break
        else:  # the nucleus reaches past every candidate size
            out[r] = top_k_top_p_mask(row, k, p)
    return out.reshape(logits.shape)


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
    x = filter_top_k_top_p(x, params.top_k, params.top_p)
    return x.softmax(dim=-1)


def sample_from(weights: Tensor, generator: torch.Generator | None = None) -> int:
    """One index drawn with probability weights[i] / sum(weights): where a uniform point of [0, sum) falls in the
    cumulative sum (float64).  weights [V], non-negative with a positive sum; an index of weight 0 is never drawn.
    One uniform variate from ``generator`` per draw, where ``torch.multinomial(weights, 1)`` draws V exponential
    variates (its exponential race) — on CPU most of a sampled row's time at a 49k vocabulary."""
    c = _cumulative(weights)
    return _draw(weights, c, torch.rand((), generator=generator, dtype=torch.float64, device=weights.device))


def _cumulative(weights: Tensor) -> Tensor:
    """weights [V] -> their float64 cumulative sum; ValueError unless non-negative with a positive sum."""
    c = weights.double().reshape(-1).cumsum(0)
    if weights.dim() != 1 or not c.numel() or not c[-1] > 0 or bool((weights < 0).any()):
        raise ValueError(f"sample_from needs a 1-D tensor of non-negative weights with a positive sum, got shape "
                         f"{tuple(weights.shape)} summing to {float(c[-1]) if c.numel() else 0.0}; pass one row's "
                         "probabilities (softmax of its filtered logits)")
    return c


def _draw(weights: Tensor, c: Tensor, u: Tensor) -> int:
    """The index where ``u`` (uniform in [0, 1), float64) times the total falls in ``c``, weights' cumulative sum."""
    i = int(torch.searchsorted(c, u * c[-1], right=True))
    if i >= c.numel():  # u rounded up to the total: the last index that has weight
        i = int(weights.nonzero()[-1, 0])
    return i


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
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    # the greedy rows' argmax: one device sync for the whole batch (none when every row samples)
    out = logits.argmax(dim=-1).tolist() if len(drawn) < len(params) else [0] * len(params)
    # one uniform per sampled row, in row order, from its own generator (the global one when unseeded): the draws a
    # row-by-row loop makes, so a seeded request's tokens do not depend on what it is batched with
    u = {i: torch.rand((), generator=generators[i], dtype=torch.float64, device=logits.device) for i in drawn}
    taken = _native_plain_rows(logits, params, drawn, u)
    for i in drawn:
        if i in taken:
            out[i] = taken[i]
        else:
            q = probabilities(logits[i], params[i])
            out[i] = _draw(q, _cumulative(q), u[i])
    return out


def plain_temperature(params: SamplingParams, vocab_size: int) -> bool:
    """Whether a sampled request's distribution is softmax(logits / T) alone: no min-p, top-k or top-p filter."""
    return params.min_p <= 0 and not 0 < params.top_k < vocab_size and params.top_p >= 1.0 \
        and math.isfinite(params.temperature)


def _native_plain_rows(logits: Tensor, params: list[SamplingParams], drawn: list[int], u: dict) -> dict[int, int]:
    """{row: token} for the plain-temperature rows the native sampler takes (CPU logits, the library built;
    ``kernels.cpu.native.sample_temperature``: two passes over the row, no row-sized temporaries), drawn with the
    same uniforms; rows with a non-finite logit, or any row when it cannot run, are left to the reference."""
    from minillm.kernels.cpu import native

    V = logits.shape[-1]
    rows = [i for i in drawn if plain_temperature(params[i], V)]
    if not rows or logits.device.type != "cpu" or not native.available():
        return {}
    x = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.float().contiguous()
    tokens = native.sample_temperature(x, rows, [max(params[i].temperature, MIN_TEMPERATURE) for i in rows],
                                       torch.stack([u[i] for i in rows]))
    return {i: t for i, t in zip(rows, tokens, strict=True) if t >= 0}
