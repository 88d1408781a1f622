"""Speculative decoding: proposers that guess the next tokens cheaply, behind one protocol.

``proposer.Proposer.propose(seqs, k) -> Proposal``; ``ngram.NgramProposer`` (prompt lookup),
``draft.DraftModelProposer`` (a separate draft model, or any model-like drafter with its own KV),
``early_exit.EarlyExitModel`` (the target's first layers as that drafter).  ``build_proposer`` turns a
``SpeculativeConfig`` into one; verification is ``sampling.rejection``, the engine step ``engine.spec_decode``.
"""

from minillm.spec.build import build_proposer
from minillm.spec.proposer import Proposal, Proposer, SpecStats

__all__ = ["Proposal", "Proposer", "SpecStats", "build_proposer"]
