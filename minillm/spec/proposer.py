"""The proposer protocol (everything the engine calls on a proposer), what a proposal is, and the engine-wide
speculation counters.  ``build.py`` builds the proposer a config names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from minillm.engine.sequence import Sequence as Seq
    from minillm.kv.block_manager import BlockManager
    from minillm.kv.paged_cache import PagedKVCache


@dataclass(frozen=True)
class TargetKV:
    """The target's paged K/V and the block manager that maps a sequence's positions to its slots: what a
    self-drafter (quantized-self, early exit: the target's own layer shapes) copies its committed context from
    instead of recomputing it (``DraftModelProposer(reads_target_kv=True)``).  At propose time every position of a
    speculating sequence but its last token has its K/V there (the last one is fed in this step)."""

    kv: PagedKVCache
    block_manager: BlockManager


@dataclass
class Proposal:
    """Draft tokens per sequence (0 .. k_i each: an empty list means "no guess, decode plainly") and, for a
    model that sampled them, the distributions they were drawn from (``probs[i]``: [len(tokens[i]), V] after the
    request's temperature/top-k/top-p; None for a deterministic proposer such as n-gram, or greedy requests)."""

    tokens: list[list[int]]
    probs: list[Tensor | None]


class Proposer(Protocol):
    """Guesses the next tokens of running sequences; the target verifies them in one forward.  Everything the
    engine calls is declared here; a proposer that subclasses this class inherits the defaults."""

    reads_target_kv: bool = False  # True: propose() gets the target's K/V (TargetKV) to copy its context from

    def propose(self, seqs: Sequence[Seq], k: Sequence[int], target_kv: TargetKV | None = None) -> Proposal:
        """At most ``k[i]`` draft tokens following ``seqs[i].token_ids`` (which it must not modify).
        ``target_kv``: the target's cache, given when ``reads_target_kv`` (else None)."""
        ...

    def release(self, seq: Seq) -> None:
        """Drop what the proposer keeps for a finished sequence (called once it finishes; default: nothing)."""


@dataclass
class SpecStats:
    """Engine-wide speculation counters (``LLMEngine.spec_stats``).

    ``verify_steps``: sequence-steps that ran a verification; ``draft_tokens``: tokens proposed;
    ``accepted_tokens``: drafts accepted; ``emitted_tokens``: tokens committed by those steps (accepted + the
    correction/bonus token, fewer when EOS, a stop string or max_tokens cut the run short); ``skipped_steps``:
    sequence-steps that could have speculated but the proposer had no guess (they decode plainly: one token for one
    target call — e.g. an n-gram with no earlier occurrence).

    Time, engine-wide (seconds, ``time.perf_counter``), over the engine steps that verified (``spec_steps``):
    ``draft_s`` in the proposer, ``verify_s`` in the target's forward over
    every row (the LM head included), ``step_s`` for the whole speculative step (the rest — slots, rejection rule,
    rollback, committing through the scheduler and detokenizer — is ``step_s - draft_s - verify_s``).
    """

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    skipped_steps: int = 0
    spec_steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    step_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """α estimate: accepted / proposed drafts, per proposed token (0 before any).  Steps with no proposal do not
        enter it (see ``tokens_per_call``)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying target forward, 1 + accepted / steps (the bonus included; 1.0 = no gain)."""
        return 1 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Tokens a sequence gains per target forward over every step it could speculate in, the steps without a
        proposal included (each 1 token): (emitted + skipped) / (verify_steps + skipped_steps); at batch 1 this is
        decode tokens per target call, what the speedup is made of (0 before any step)."""
        calls = self.verify_steps + self.skipped_steps
        return (self.emitted_tokens + self.skipped_steps) / calls if calls else 0.0

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per speculative engine step: draft, verify, the rest (overhead) and the whole step."""
        n = max(self.spec_steps, 1)
        return {"draft_ms": 1e3 * self.draft_s / n, "verify_ms": 1e3 * self.verify_s / n,
                "overhead_ms": 1e3 * (self.step_s - self.draft_s - self.verify_s) / n, "step_ms": 1e3 * self.step_s / n}
