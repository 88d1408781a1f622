"""Draft-model proposals: a small model with the target's vocabulary guesses γ tokens autoregressively.

Each sequence gets its own contiguous K/V in the drafter (``kv.contiguous.KVCache``, batch 1, sized for the
sequence's prompt + max_tokens + γ), remembered with the tokens it holds.  Rollback is implicit: before proposing,
the drafter keeps the longest common prefix of what it cached and the sequence's committed tokens (rejected drafts
fall off; stale slots beyond it are masked, then overwritten) and feeds the rest as one chunk.  A step costs
one catch-up forward (usually 1–2 tokens: the last accepted draft and the target's correction/bonus) plus γ − 1
single-token forwards.  Sequences run one at a time (no batching across sequences in the drafter): simple, and at
batch 1 — where speculation pays — nothing is lost.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.kv.contiguous import KVCache
from minillm.sampling.sampler import probabilities
from minillm.spec.proposer import Proposal


@dataclass
class _DraftState:
    cache: KVCache
    tokens: list[int]  # the tokens whose K/V the cache holds, positions 0 .. len - 1


class DraftModelProposer:
    """``Proposer`` running ``model`` (a ``Transformer`` or ``EarlyExitModel``) with a K/V cache per sequence.

    Drafts are sampled from the request's filtered distribution q (``probabilities``) with the sequence's own
    generator — greedy requests take the argmax — and q is returned for the rejection rule.
    """

    def __init__(self, model, max_len: int):
        self.model, self.max_len = model, max_len
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> _DraftState

    def release(self, seq) -> None:
        """Drop a finished sequence's draft K/V now (it would also go when the sequence is garbage-collected)."""
        self._states.pop(seq, None)

    def _state(self, seq) -> _DraftState:
        state = self._states.get(seq)
        if state is None:
            p = seq.request.params
            size = min(self.max_len, seq.num_prompt_tokens + p.max_tokens) + 1  # + the drafts past the last token
            size = min(size, self.model.config.max_position_embeddings)
            cache = KVCache(self.model.config, 1, size, dtype=self.model.dtype, device=self.model.device,
                            kernels=self.model.kernels)
            state = self._states[seq] = _DraftState(cache, [])
        return state

    @torch.inference_mode()
    def propose(self, seqs: Sequence, k: Sequence[int]) -> Proposal:
        """Up to ``k[i]`` tokens per sequence, with their draft distributions (None for greedy requests)."""
        tokens, probs = [], []
        for seq, ki in zip(seqs, k, strict=True):
            t, q = self._propose_one(seq, ki) if ki > 0 else ([], None)
            tokens.append(t)
            probs.append(q)
        return Proposal(tokens, probs)

    def _propose_one(self, seq, k: int) -> tuple[list[int], Tensor | None]:
        state = self._state(seq)
        ids = seq.token_ids
        k = min(k, state.cache.max_len - len(ids))  # the drafts' positions must fit the drafter's cache
        if k < 1:
            return [], None
        keep = 0
        for a, b in zip(state.tokens, ids, strict=False):  # rollback: the longest prefix still valid
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # feed at least the last token: its logits give the first draft
        feed, start = ids[keep:], keep
        params, gen = seq.request.params, seq.generator
        drafts: list[int] = []
        qs: list[Tensor] = []
        for _ in range(k):
            logits = self._forward(state.cache, feed, start)  # (V,) after the last fed token
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = probabilities(logits, params)
                token = int(torch.multinomial(q, 1, generator=gen))
                qs.append(q)
            start += len(feed)
            feed = [token]
            drafts.append(token)
        state.tokens = list(ids) + drafts[:-1]  # the last draft was never fed
        return drafts, torch.stack(qs) if qs else None

    def _forward(self, cache: KVCache, feed: list[int], start: int) -> Tensor:
        """Feed ``feed`` at positions start.. into the drafter; -> fp32 logits [V] after its last token."""
        dev = self.model.device
        input_ids = torch.tensor([feed], dtype=torch.long, device=dev)
        positions = torch.arange(start, start + len(feed), device=dev)[None]  # (1, L)
        cache.begin(positions)
        hidden = self.model.hidden_states(input_ids, positions, cache)  # (1, L, hidden)
        return self.model.compute_logits(hidden[0, -1]).float()
