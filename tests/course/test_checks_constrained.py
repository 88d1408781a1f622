"""Notebook 09's constrained-decoding exercise (9.5, the token mask of a DFA state): the library's solution passes
its checker, the stub fails with its own NotImplementedError, and the mistakes a student plausibly makes fail with a
message that names them.  ``WRONG_09_CD`` also feeds ``test_checks.WRONG``."""

from __future__ import annotations

import pytest
import torch

from minillm.course import checks
from minillm.course.checks import EXERCISES
from minillm.sampling.regex import DEAD


def _first_byte_only(table, state, token_bytes, lengths):
    """Allows a token whose first byte keeps the automaton alive, whatever its other bytes do."""
    return (table[state, token_bytes[:, 0].long()] != DEAD) & (lengths > 0)


def _walks_the_padding(table, state, token_bytes, lengths):
    """Walks every column, the zero padding after a short token included."""
    states = torch.full(lengths.shape, state, dtype=table.dtype)
    for i in range(token_bytes.shape[1]):
        states = table[states, token_bytes[:, i].long()]
    return (states != DEAD) & (lengths > 0)


def _allows_empty_tokens(table, state, token_bytes, lengths):
    """Right walk, but a token with no bytes (a special token) counts as allowed."""
    states = torch.full(lengths.shape, state, dtype=table.dtype)
    for i in range(token_bytes.shape[1]):
        states = torch.where(lengths > i, table[states, token_bytes[:, i].long()], states)
    return states != DEAD


WRONG_09_CD = {"9.5": _first_byte_only}


@pytest.mark.parametrize("wrong, message", [
    (_first_byte_only, "not only the first ones"),
    (_walks_the_padding, "zero padding after them"),
    (_allows_empty_tokens, "length 0 spells nothing"),
    (lambda table, state, token_bytes, lengths: (lengths > 0).tolist(), "expected a bool tensor of shape"),
])
def test_plausible_mistakes_fail_with_a_message_naming_them(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_token_mask(wrong)


def test_a_correct_answer_written_differently_passes(capsys):
    """A token-by-token Python loop is slow but right: the checker judges the masks, not the method."""

    def per_token(table, state, token_bytes, lengths):
        out = torch.zeros(lengths.shape, dtype=torch.bool)
        for t in range(len(lengths)):
            s = state
            for b in token_bytes[t, : int(lengths[t])].tolist():
                s = int(table[s, b])
            out[t] = s != DEAD and int(lengths[t]) > 0
        return out

    checks.check_token_mask(per_token)
    assert "✓ Exercise 9.5 passed" in capsys.readouterr().out


def test_stub_fails_with_its_exercise_message():
    with pytest.raises(NotImplementedError, match=r"^Exercise 9\.5: the token mask of a DFA state"):
        checks.check_token_mask(EXERCISES["9.5"].stub())
