"""The proposer protocol, the engine-wide counters, and the one function that builds a proposer from config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from minillm.engine.sequence import Sequence as Seq


@dataclass
class Proposal:
    """Draft tokens per sequence (0 .. k_i each: an empty list means "no guess, decode plainly") and, for a
    model that sampled them, the distributions they were drawn from (``probs[i]``: [len(tokens[i]), V] after the
    request's temperature/top-k/top-p; None for a deterministic proposer such as n-gram, or greedy requests)."""

    tokens: list[list[int]]
    probs: list[Tensor | None]


class Proposer(Protocol):
    """Guesses the next tokens of running sequences; the target verifies them in one forward."""

    def propose(self, seqs: Sequence[Seq], k: Sequence[int]) -> Proposal:
        """At most ``k[i]`` draft tokens following ``seqs[i].token_ids`` (which it must not modify)."""
        ...


@dataclass
class SpecStats:
    """Engine-wide speculation counters (``LLMEngine.spec_stats``).

    ``verify_steps``: sequence-steps that ran a verification; ``draft_tokens``: tokens proposed;
    ``accepted_tokens``: drafts accepted; ``emitted_tokens``: tokens committed by those steps (accepted + the
    correction/bonus token, fewer when EOS, a stop string or max_tokens cut the run short).
    """

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """α estimate: accepted / proposed drafts (0 before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying target forward, 1 + accepted / steps (the bonus included; 1.0 = no gain)."""
        return 1 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


