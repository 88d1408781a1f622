"""The speculative accept/resample rule against the exact target distribution.

A toy bigram "model": the target's and the draft's next-token logits depend on the previous token (tables T, D).
Generating two tokens speculatively (γ = 2, repeated verification calls until two tokens exist) must give the
joint distribution p(t1 | start) · p(t2 | t1) of plain sampling — checked with a chi-square test (hand-written: no
scipy needed) — and the same test must reject an implementation that keeps the draft's tokens.
"""

import math

import pytest
import torch

from minillm.sampling.params import SamplingParams
from minillm.sampling.rejection import greedy_accept, rejection_sample
from minillm.sampling.sampler import probabilities

V, GAMMA, START, N = 6, 2, 0, 4000
PARAMS = SamplingParams(temperature=0.9, top_k=5, top_p=0.95)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Thousands of tiny tensor ops: thread wake-ups would cost more than the work (and the machine is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tables():
    g = torch.Generator().manual_seed(1)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = target + torch.randn(V, V, generator=g) * 1.5  # disagrees: about half the drafts are accepted
    return target, draft


def draft_sample(draft, prev, params, g):
    """γ tokens from the draft, each from its filtered distribution given the previous token."""
    tokens, qs = [], []
    for _ in range(GAMMA):
        q = probabilities(draft[prev], params)
        prev = int(torch.multinomial(q, 1, generator=g))
        tokens.append(prev)
        qs.append(q)
    return tokens, torch.stack(qs)


def speculative_pairs(tables, verify, params=PARAMS, point_mass=False, seed=0):
    """N samples of the first two generated tokens; returns (counts [V, V], acceptance rate)."""
    target, draft = tables
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    proposed = accepted = 0
    for _ in range(N):
        ctx = [START]
        while len(ctx) < 3:
            if point_mass:  # an n-gram-like deterministic proposer: q = δ
                tokens, qs = [(ctx[-1] + 1 + i) % V for i in range(GAMMA)], None
            else:
                tokens, qs = draft_sample(draft, ctx[-1], params, g)
            rows = target[[ctx[-1], *tokens]]  # (γ+1, V): the target given each prefix
            out = verify(rows, tokens, qs, params, g)
            proposed += GAMMA
            accepted += len(out) - 1
            ctx += out
        counts[ctx[1], ctx[2]] += 1
    return counts, accepted / proposed


def exact_pairs(tables, params=PARAMS):
    target = tables[0]
    p1 = probabilities(target[START], params)
    return p1[:, None] * probabilities(target, params)  # (V, V): p(t1) p(t2 | t1)


def chi_square_rejects(counts, expected_probs) -> bool:
    """Pearson's chi-square at significance 1e-3 (Wilson–Hilferty quantile); a count where the exact
    probability is 0 (filtered by top-k/top-p) rejects outright."""
    expected = expected_probs.flatten() * counts.sum()
    observed = counts.flatten()
    if (observed[expected == 0] > 0).any():
        return True
    live = expected > 0
    stat = float(((observed[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    z = 3.09  # standard normal 0.999 quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


def keep_the_drafts(rows, tokens, qs, params, g):
    """A broken verifier: accepts every draft token (the output follows the draft, not the target)."""
    return tokens + [int(torch.multinomial(probabilities(rows[-1], params), 1, generator=g))]


def test_speculated_tokens_follow_the_target_distribution_and_a_draft_sampler_is_caught(tables):
    counts, alpha = speculative_pairs(tables, rejection_sample)
    assert 0.3 < alpha < 0.7, f"the draft should disagree about half the time, acceptance {alpha:.2f}"
    exact = exact_pairs(tables)
    assert not chi_square_rejects(counts, exact)
    assert not chi_square_rejects(counts.sum(1, keepdim=True), exact.sum(1, keepdim=True))  # first position
    assert not chi_square_rejects(counts.sum(0, keepdim=True), exact.sum(0, keepdim=True))  # second position
    wrong, _ = speculative_pairs(tables, keep_the_drafts)
    assert chi_square_rejects(wrong, exact)


def test_point_mass_proposals_follow_the_target_distribution(tables):
    counts, alpha = speculative_pairs(tables, rejection_sample, point_mass=True)
    assert 0 < alpha < 1
    assert not chi_square_rejects(counts, exact_pairs(tables))


def test_greedy_accepts_the_longest_agreeing_prefix_then_the_targets_argmax():
    logits = torch.full((4, 5), -1.0)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = logits[3, 4] = 1.0  # argmaxes 2, 3, 1, 4
    assert greedy_accept(logits, [2, 3, 0]) == [2, 3, 1]  # third draft disagrees: the target's 1 replaces it
    assert greedy_accept(logits, [2, 3, 1]) == [2, 3, 1, 4]  # all agree: the bonus argmax
    assert greedy_accept(logits, [0, 3, 1]) == [2]
    assert rejection_sample(logits, [2, 3, 1], None, SamplingParams(temperature=0)) == [2, 3, 1, 4]


def test_a_seeded_generator_makes_verification_reproducible(tables):
    target, draft = tables
    rows, tokens = target[[0, 1, 2]], [1, 2]
    qs = probabilities(draft[[0, 1]], PARAMS)
    runs = [[rejection_sample(rows, tokens, qs, PARAMS, torch.Generator().manual_seed(7)) for _ in range(20)]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_rejects_logits_that_do_not_match_the_draft_count():
    with pytest.raises(ValueError, match="γ"):
        rejection_sample(torch.zeros(2, 5), [1, 2], None, PARAMS)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, 5), [1, 2], torch.zeros(2, 4), PARAMS)
