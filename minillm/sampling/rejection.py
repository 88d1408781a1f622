"""Speculative decoding's accept/resample rule: draft tokens in, target-distributed tokens out.

A cheap proposer guesses γ tokens x_1..x_γ; ONE target forward over [last, x_1, .., x_γ] gives the target's
distributions p_1..p_{γ+1} (p_i is the next-token distribution after x_{i-1}).  The rule (Leviathan et al. 2023,
Chen et al. 2023; spelled out as in gpt-fast's ``speculative_decode``) turns them into tokens distributed
*exactly* as if the target had sampled one token at a time:

    for i = 1..γ:
        accept x_i with probability min(1, p_i(x_i) / q_i(x_i))        # q_i: the draft's distribution
        on the first rejection: emit one token from norm(max(0, p_i - q_i)) and stop
    all γ accepted: emit a bonus token from p_{γ+1}                       # the forward computed it anyway

Why it is exact: P(emit y at i) = q(y)·min(1, p(y)/q(y)) + P(reject)·residual(y) = min(q, p)(y) + (p - min(p, q))(y)
= p(y).  Temperature, top-k and top-p are applied to BOTH distributions (``sampler.probabilities``) before the
rule: the target's filtered p is what the user asked to sample from, and q must be the distribution the draft
actually sampled from.

- n-gram proposals have no draft distribution: the proposal is deterministic given the context, so q is a point
  mass on x_i (q(x_i) = 1): accept with probability p(x_i); the residual is p with x_i removed, renormalised.
- greedy (temperature 0): accept the longest prefix where x_i == argmax p_i, then emit the target's argmax at the
  first disagreement (or the bonus argmax) — exactly the tokens plain greedy decoding would produce.

Each call emits between 1 and γ + 1 tokens.  Seeded requests draw every uniform and every resample from their own
``torch.Generator``, so a seeded speculative run is reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import probabilities


def greedy_accept(target_logits: Tensor, draft_tokens: list[int]) -> list[int]:
    """Longest prefix of drafts equal to the target's argmaxes, then the target's next argmax.

    target_logits [γ+1, V] (row i: the distribution after draft i-1), draft_tokens γ ids -> 1..γ+1 token ids.
    (``rejection_sample`` with temperature 0.)
    """
    return rejection_sample(target_logits, draft_tokens, None, SamplingParams(temperature=0.0))


def rejection_sample(target_logits: Tensor, draft_tokens: list[int], draft_probs: Tensor | None,
                     params: SamplingParams, generator: torch.Generator | None = None) -> list[int]:
    """Accept/resample γ draft tokens against the target; returns the accepted drafts + one more token.

    target_logits [γ+1, V] raw target logits (row i: the target's next-token logits after draft i-1; filter
    them with ``probabilities(target_logits, params)``); draft_tokens γ ids; draft_probs [γ, V] the draft's
    distributions *after* the same filtering, or None for a deterministic proposer (n-gram: q is a point mass on
    each draft token, q(x_i) = 1).  -> between 1 and γ + 1 token ids, distributed as the target would sample them:

    - greedy params (``params.greedy``): the longest prefix of drafts equal to the target's argmax rows, then the
      argmax of the row after it (the correction, or the bonus token when every draft agrees).
    - otherwise, for i = 0..γ-1: accept x_i when u_i < p_i(x_i) / q_i(x_i), u_i uniform in [0, 1) drawn from
      ``generator`` (i.e. with probability min(1, p/q)); at the first rejection append ONE token drawn from
      norm(max(0, p_i − q_i)) and stop (for q = δ(x_i): p_i with x_i zeroed); all accepted: append a bonus token
      drawn from p_γ.  Draw every random number from ``generator`` (seeded requests must be reproducible).
    """
    check_verify_inputs(target_logits, draft_tokens, draft_probs)
    gamma = len(draft_tokens)
    ### BEGIN SOLUTION
    if params.greedy:
        best = target_logits.argmax(dim=-1).tolist()  # one device sync for all γ+1 rows
        m = next((i for i, (x, b) in enumerate(zip(draft_tokens, best, strict=False)) if x != b), gamma)
        return list(draft_tokens[:m]) + [best[m]]  # the correction at the first disagreement, or the bonus
    p = probabilities(target_logits, params)  # (γ+1, V): temperature → top-k → top-p, as plain sampling
    idx = torch.arange(gamma, device=p.device)
    x = torch.tensor(draft_tokens, dtype=torch.long, device=p.device)
    p_x = p[idx, x]  # (γ,) target probability of each draft token
    # q(x) = 1 for a point-mass proposer; otherwise the draft's own probability of what it sampled
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[idx, x].to(p.dtype)
    u = torch.rand(gamma, generator=generator, device=p.device, dtype=p.dtype)
    # accept x_i  <=>  u_i < p(x_i) / q(x_i); written as u·q < p so q(x) = 0 (never sampled) cannot divide by 0
    accepted = (u * q_x < p_x).tolist()
    m = accepted.index(False) if False in accepted else gamma  # first rejection (γ: none)
    out = list(draft_tokens[:m])
    if m == gamma:  # every draft accepted: the bonus token comes from the last target row
        return out + [int(torch.multinomial(p[gamma], 1, generator=generator))]
    if draft_probs is None:  # q = δ(x_m): max(0, p - q) is p with x_m removed
        residual = p[m].clone()
        residual[draft_tokens[m]] = 0
    else:
        residual = (p[m] - draft_probs[m].to(p.dtype)).clamp_(min=0)
    if not residual.sum() > 0:  # p == q up to rounding: rejection had ~0 probability; p is the exact answer
        residual = p[m]
    return out + [int(torch.multinomial(residual, 1, generator=generator))]  # multinomial normalises the weights
    ### END SOLUTION


def check_verify_inputs(target_logits: Tensor, draft_tokens: list[int], draft_probs: Tensor | None) -> None:
    """Raise ``ValueError`` unless target_logits is [γ+1, V] and draft_probs (when given) is [γ, V]."""
    gamma = len(draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != gamma + 1:
        raise ValueError(f"target_logits must be [γ+1, V] for γ={gamma} drafts, got {tuple(target_logits.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (gamma, target_logits.shape[-1]):
        raise ValueError(f"draft_probs must be [γ={gamma}, V={target_logits.shape[-1]}], got "
                         f"{tuple(draft_probs.shape)}")
