"""The proposer protocol, the engine-wide counters, and the one function that builds a proposer from config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from minillm.config import SpeculativeConfig

if TYPE_CHECKING:
    from minillm.engine.sequence import Sequence as Seq
    from minillm.models.llama import Transformer


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


def build_proposer(config: SpeculativeConfig, target: Transformer, max_len: int) -> Proposer:
    """The proposer ``config`` names, for ``target``; ``max_len`` caps a sequence (draft KV sizes).

    Raises ``ValueError`` for an early-exit depth out of range, a draft with another vocabulary, or the quantized
    method without quantization support in this tree.
    """
    from minillm.spec.draft import DraftModelProposer
    from minillm.spec.early_exit import EarlyExitModel
    from minillm.spec.ngram import NgramProposer

    config.validate_for(target.config)
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "early_exit":
        return DraftModelProposer(EarlyExitModel(target, config.num_layers), max_len)
    if config.method == "quantized":
        import copy

        from minillm.quant.apply import quantize_model  # the target's int4 twin: its own packed weights

        return DraftModelProposer(quantize_model(copy.deepcopy(target), "int4"), max_len)
    draft = config.model
    if not hasattr(draft, "hidden_states"):  # a path or hub id
        from minillm.models.loader import load_model

        draft = load_model(draft, dtype=target.dtype, device=target.device, kernels=target.kernels)
    config.validate_for(target.config, draft.config)
    return DraftModelProposer(draft, max_len)
