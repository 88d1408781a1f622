"""Prompt lookup (n-gram) proposals: if the last n tokens appeared earlier in the context, guess that what
followed them then follows them now.  No model, no KV, no probabilities (q is a point mass on each guess).

Copy-heavy outputs (quoting, summarising a given passage, editing code) repeat long runs of the prompt, so the
guesses are often right and cost nothing but a scan of the context: O(L·n) token comparisons per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from minillm.spec.proposer import Proposal, Proposer, TargetKV


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the most recent earlier occurrence of the context's last n
    tokens, trying n = n_max down to n_min (a longer match is more specific; n never exceeds len(tokens) - 1).

    tokens: the whole context (prompt + output so far), never modified.  An occurrence is "earlier" when it starts
    before the suffix itself (start <= len(tokens) - n - 1; it may overlap the suffix); "most recent" = the largest
    such start.  Returns tokens[start + n : start + n + k] for the first n that matches (1 .. k tokens: fewer when
    the context ends sooner); [] when k < 1 or no n in [n_min, n_max] matches.
    """
    L = len(tokens)
    if k < 1:
        return []
    ### BEGIN SOLUTION
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = list(tokens[L - n :])
        for start in range(L - n - 1, -1, -1):  # most recent first: the nearest copy is the likeliest to continue
            if tokens[start] == pattern[0] and list(tokens[start : start + n]) == pattern:
                return list(tokens[start + n : start + n + k])
    return []
    ### END SOLUTION


class NgramProposer(Proposer):
    """``Proposer`` by prompt lookup over each sequence's prompt and output (vLLM's ``method="ngram"``).

    ``lookup`` is the search itself, ``ngram_lookup``'s signature (the course passes its own version here).
    """

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                 lookup: Callable[[Sequence[int], int, int, int], list[int]] = ngram_lookup):
        self.n_min, self.n_max, self.lookup = prompt_lookup_min, prompt_lookup_max, lookup

    def propose(self, seqs: Sequence, k: Sequence[int], target_kv: TargetKV | None = None) -> Proposal:
        """At most ``k[i]`` guesses per sequence (none when the last n-gram never occurred before)."""
        tokens = [self.lookup(s.token_ids, ki, self.n_min, self.n_max) for s, ki in zip(seqs, k, strict=True)]
        return Proposal(tokens, [None] * len(tokens))
