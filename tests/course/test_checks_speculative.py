"""Notebook 08's checkers (8.1 the accept/resample rule, 8.2 n-gram lookup, 8.3 KV rollback): each passes the
library's solution, fails the stub with its NotImplementedError, and fails every plausible wrong answer below with
an AssertionError that says what went wrong — also while the library's own function is hidden (replaced by a
function that raises), which proves the checkers compute their expectations independently."""

from __future__ import annotations

import random

import pytest
import torch

from minillm.course import checks
from minillm.course.checks import EXERCISES
from minillm.kv.block_manager import BlockManager
from minillm.sampling.sampler import probabilities
from minillm.spec import ngram


# --- 8.1: wrong accept/resample rules ---------------------------------------------------------------------------
def _rule(accept_prob, residual, bonus=True, greedy_row_offset=0, bonus_row_offset=0):
    """A rejection sampler assembled from parts, so each wrong answer changes exactly one of them."""

    def rejection_sample(target_logits, draft_tokens, draft_probs, params, generator=None):
        gamma = len(draft_tokens)
        if params.greedy:
            best = target_logits.argmax(-1).tolist()
            out = []
            for i, x in enumerate(draft_tokens):
                if x != best[min(i + greedy_row_offset, gamma)]:
                    break
                out.append(x)
            return out + [best[len(out)]]
        p = probabilities(target_logits, params)
        out = []
        for i, x in enumerate(draft_tokens):
            q = torch.zeros_like(p[i]) if draft_probs is None else draft_probs[i]
            if draft_probs is None:
                q[x] = 1.0
            u = float(torch.rand(1, generator=generator))
            if u < accept_prob(float(p[i, x]), float(q[x])):
                out.append(x)
                continue
            return out + [int(torch.multinomial(residual(p[i], q), 1, generator=generator))]
        bonus_row = p[gamma + bonus_row_offset]
        return out + ([int(torch.multinomial(bonus_row, 1, generator=generator))] if bonus else [])

    return rejection_sample


def _right_accept(p, q):
    return min(1.0, p / q) if q > 0 else 1.0


def _right_residual(p, q):
    r = (p - q).clamp(min=0)
    return r if r.sum() > 0 else p


right_rule = _rule(_right_accept, _right_residual)
resample_from_p = _rule(_right_accept, lambda p, q: p)
accept_with_p_ignoring_q = _rule(lambda p, q: p, _right_residual)
inverted_ratio = _rule(lambda p, q: min(1.0, q / p) if p > 0 else 0.0, _right_residual)
no_bonus_token = _rule(_right_accept, _right_residual, bonus=False)
bonus_from_the_last_drafts_row = _rule(_right_accept, _right_residual, bonus_row_offset=-1)  # p[γ-1], not p[γ]
greedy_compares_the_next_row = _rule(_right_accept, _right_residual, greedy_row_offset=1)
resample_from_q_minus_p = _rule(_right_accept, lambda p, q: (q - p).clamp(min=0) + 1e-9)


def keep_the_drafts(target_logits, draft_tokens, draft_probs, params, generator=None):
    """Samples from the draft: every draft kept, plus a token from the last target row."""
    if params.greedy:
        return list(draft_tokens) + [int(target_logits[-1].argmax())]
    last = probabilities(target_logits[-1], params)
    return list(draft_tokens) + [int(torch.multinomial(last, 1, generator=generator))]


def unfiltered_target(target_logits, draft_tokens, draft_probs, params, generator=None):
    """The right rule on softmax(logits): temperature, top-k and top-p forgotten."""
    import dataclasses

    plain = dataclasses.replace(params, top_k=0, top_p=1.0) if not params.greedy else params
    return right_rule(target_logits, draft_tokens, draft_probs, plain, generator)


def global_rng(target_logits, draft_tokens, draft_probs, params, generator=None):
    """The right rule drawing from torch's global generator: seeded requests are no longer reproducible."""
    return right_rule(target_logits, draft_tokens, draft_probs, params, None)


def test_the_assembled_right_rule_passes_so_each_wrong_variant_differs_by_its_one_change(capsys):
    checks.check_rejection_sample(right_rule)
    assert "✓ Exercise 8.1 passed" in capsys.readouterr().out


SEED = 0  # the rejection-rule checker's seed in the message tests below


@pytest.mark.parametrize("wrong, says", [
    (resample_from_p, "norm\\(max\\(0, p - q\\)\\)"),
    (accept_with_p_ignoring_q, "min\\(1, p\\(x\\)/q\\(x\\)\\)"),
    (inverted_ratio, "min\\(1, p\\(x\\)/q\\(x\\)\\)"),
    (no_bonus_token, "bonus token"),
    (greedy_compares_the_next_row, "longest prefix"),
    (resample_from_q_minus_p, "expected"),
    (keep_the_drafts, "expected"),
    (unfiltered_target, "expected"),
    (global_rng, "generator"),
])
def test_rejection_sample_checker_catches_a_wrong_rule(wrong, says, monkeypatch):
    """The checker draws its seed from the OS (each grading run sees new rows); here it is pinned, so that the
    message asserted is the one this wrong rule meets first.  Unpinned, a draw whose draft happens to give the wrong
    rule's acceptance ≈ the right one (sum p·q ≈ sum min(p, q)) lets a later check catch it instead: still caught,
    with another message."""
    from minillm.course.checks import speculative

    monkeypatch.setattr(speculative.random, "SystemRandom", lambda: random.Random(SEED))
    with pytest.raises(AssertionError, match=says):
        checks.check_rejection_sample(wrong)


# --- 8.2: wrong n-gram lookups ----------------------------------------------------------------------------------
def first_occurrence(tokens, k, n_min, n_max):
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(0, L - n):  # earliest copy instead of the most recent
            if list(tokens[start : start + n]) == list(tokens[L - n :]):
                return list(tokens[start + n : start + n + k]) if k > 0 else []
    return []


def shortest_n_first(tokens, k, n_min, n_max):
    L = len(tokens)
    for n in range(n_min, min(n_max, L - 1) + 1):  # a 1-gram match is the least specific guess
        for start in range(L - n - 1, -1, -1):
            if list(tokens[start : start + n]) == list(tokens[L - n :]):
                return list(tokens[start + n : start + n + k]) if k > 0 else []
    return []


def matches_itself(tokens, k, n_min, n_max):
    L = len(tokens)
    for n in range(min(n_max, L), n_min - 1, -1):
        for start in range(L - n, -1, -1):  # off by one: the suffix matches itself and proposes nothing
            if list(tokens[start : start + n]) == list(tokens[L - n :]):
                return list(tokens[start + n : start + n + k])
    return []


def skips_the_adjacent_copy(tokens, k, n_min, n_max):
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - n - 2, -1, -1):  # off by one the other way: misses a copy right before the suffix
            if list(tokens[start : start + n]) == list(tokens[L - n :]):
                return list(tokens[start + n : start + n + k]) if k > 0 else []
    return []


def no_overlap(tokens, k, n_min, n_max):
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - 2 * n, -1, -1):  # demands the copy end before the suffix starts
            if list(tokens[start : start + n]) == list(tokens[L - n :]):
                return list(tokens[start + n : start + n + k]) if k > 0 else []
    return []


@pytest.mark.parametrize("wrong", [first_occurrence, shortest_n_first, matches_itself, skips_the_adjacent_copy,
                                   no_overlap])
def test_ngram_checker_catches_a_wrong_lookup(wrong):
    with pytest.raises(AssertionError, match="expected"):
        checks.check_ngram_lookup(wrong)


def test_ngram_checker_names_the_occurrence_taken():
    with pytest.raises(AssertionError, match="you took the occurrence at"):
        checks.check_ngram_lookup(first_occurrence)


# --- 8.3: wrong rollbacks ---------------------------------------------------------------------------------------
class FloorBlocks(BlockManager):
    """Off by one: keeps num_tokens // block_size blocks, freeing the partly filled last one still in use."""

    def truncate(self, seq_id, num_tokens):
        table, keep = self._table(seq_id), num_tokens // self.block_size
        for b in reversed(table.block_ids[keep:]):
            self.device.free(b)
        del table.block_ids[keep:], table.token_ids[num_tokens:], table.block_hashes[num_tokens // self.block_size:]
        table.num_computed = min(table.num_computed, num_tokens)


class ForgetsToFree(BlockManager):
    """Cuts the table but never releases the blocks: they leak (reference counts stay at 1)."""

    def truncate(self, seq_id, num_tokens):
        table, keep = self._table(seq_id), self._blocks_for(num_tokens)
        del table.block_ids[keep:], table.token_ids[num_tokens:], table.block_hashes[num_tokens // self.block_size:]
        table.num_computed = min(table.num_computed, num_tokens)


class KeepsHashes(BlockManager):
    """Leaves the prefix-cache hashes of rolled-back blocks in the table."""

    def truncate(self, seq_id, num_tokens):
        table, keep = self._table(seq_id), self._blocks_for(num_tokens)
        for b in reversed(table.block_ids[keep:]):
            self.device.free(b)
        del table.block_ids[keep:], table.token_ids[num_tokens:]
        table.num_computed = min(table.num_computed, num_tokens)


class HashesPerKeptBlock(BlockManager):
    """Keeps a hash for every kept block, the partial last one included: a hash over rolled-back tokens."""

    def truncate(self, seq_id, num_tokens):
        table, keep = self._table(seq_id), self._blocks_for(num_tokens)
        for b in reversed(table.block_ids[keep:]):
            self.device.free(b)
        del table.block_ids[keep:], table.token_ids[num_tokens:], table.block_hashes[keep:]
        table.num_computed = min(table.num_computed, num_tokens)


class KeepsNumComputed(BlockManager):
    """Leaves num_computed above the kept tokens."""

    def truncate(self, seq_id, num_tokens):
        table, keep = self._table(seq_id), self._blocks_for(num_tokens)
        for b in reversed(table.block_ids[keep:]):
            self.device.free(b)
        del table.block_ids[keep:], table.token_ids[num_tokens:], table.block_hashes[num_tokens // self.block_size:]


class HeadFirst(BlockManager):
    """Frees the dropped blocks head first: a cached chain's head would be evicted before its tail."""

    def truncate(self, seq_id, num_tokens):
        table, keep = self._table(seq_id), self._blocks_for(num_tokens)
        for b in table.block_ids[keep:]:
            self.device.free(b)
        del table.block_ids[keep:], table.token_ids[num_tokens:], table.block_hashes[num_tokens // self.block_size:]
        table.num_computed = min(table.num_computed, num_tokens)


class OneTooMany(BlockManager):
    """Off by one in tokens: keeps num_tokens + 1 (the first rejected draft survives)."""

    def truncate(self, seq_id, num_tokens):
        n = min(num_tokens + 1, len(self._table(seq_id).token_ids))
        table, keep = self._table(seq_id), self._blocks_for(n)
        for b in reversed(table.block_ids[keep:]):
            self.device.free(b)
        del table.block_ids[keep:], table.token_ids[n:], table.block_hashes[n // self.block_size:]
        table.num_computed = min(table.num_computed, n)


@pytest.mark.parametrize("wrong, says", [
    (FloorBlocks, "ceil"), (ForgetsToFree, "self.device.free"), (KeepsHashes, "never cover a rolled-back token"),
    (HashesPerKeptBlock, "never cover a rolled-back token"), (KeepsNumComputed, "num_computed"),
    (HeadFirst, "tail first"), (OneTooMany, "first num_tokens tokens"),
])
def test_truncate_checker_catches_a_wrong_rollback(wrong, says):
    with pytest.raises(AssertionError, match=says):
        checks.check_truncate(wrong)


# --- independence from the library's solution -------------------------------------------------------------------
def _hidden(*args, **kwargs):
    raise RuntimeError("the library's solved function is hidden while a checker runs")


@pytest.mark.parametrize("number", ["8.1", "8.2", "8.3"])
def test_checker_passes_the_solution_while_the_librarys_function_is_hidden(number, monkeypatch, capsys,
                                                                          solution_copy):
    ex = EXERCISES[number]
    solution = solution_copy(ex)
    if number == "8.3":  # the student's class is a subclass; hide the base class's method
        solution = type("Solved", (BlockManager,), {"truncate": BlockManager.truncate})
        monkeypatch.setattr(BlockManager, "truncate", _hidden)
    elif number == "8.1":
        import minillm.sampling.rejection as module

        monkeypatch.setattr(module, "rejection_sample", _hidden)
    else:
        monkeypatch.setattr(ngram, "ngram_lookup", _hidden)
    ex.check(solution)
    assert f"✓ Exercise {number} passed" in capsys.readouterr().out


# wrong answers for tests/course/test_checks.py's every-exercise test (one per exercise, "expected" in the message)
WRONG_08 = {"8.1": resample_from_p, "8.2": first_occurrence, "8.3": FloorBlocks}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sample_checker_fails_a_bonus_token_from_the_wrong_row(seed, monkeypatch):
    """A rule that draws the bonus token from p[γ-1] (the last draft's row) instead of p[γ] fails, whatever the
    checker's seed, with a message that names the row."""
    from minillm.course.checks import speculative

    monkeypatch.setattr(speculative.random, "SystemRandom", lambda: random.Random(seed))
    with pytest.raises(AssertionError, match="p_γ = p_1.*you drew from the last draft's row"):
        checks.check_rejection_sample(bonus_from_the_last_drafts_row)
