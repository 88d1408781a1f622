"""Notebook 07's SmoothQuant checkers (7.4 smoothing_factors, 7.5 fold_into_norm): the solution passes, and the
mistakes a student plausibly makes fail with an AssertionError naming the input, the expected and the received
value.  ``WRONG_07_SMOOTH`` also feeds tests/course/test_checks.py's per-exercise wrong-answer test."""

from __future__ import annotations

import pytest
import torch

from minillm.course import checks


def _swapped_exponents(act_absmax, weight, alpha):
    x = act_absmax.float().clamp_min(1e-5)
    w = weight.float().abs().amax(0).clamp_min(1e-5)
    return x.pow(1 - alpha) / w.pow(alpha)


def _per_tensor_weight(act_absmax, weight, alpha):  # one max|W| for the whole matrix, not per input channel
    return act_absmax.float().clamp_min(1e-5).pow(alpha) / weight.float().abs().max().clamp_min(1e-5).pow(1 - alpha)


def _no_floor(act_absmax, weight, alpha):  # a zero weight column gives inf
    if not 0 <= alpha <= 1:
        raise ValueError("alpha")
    return act_absmax.float().pow(alpha) / weight.float().abs().amax(0).pow(1 - alpha)


def _inverted_fold(norm_weight, linear_weight, s):  # multiplies the norm and divides the weight
    norm_weight.mul_(s.to(norm_weight.dtype))
    linear_weight.div_(s.to(linear_weight.dtype))


def _rows_scaled(norm_weight, linear_weight, s):  # scales W's rows, not its columns (only square W would fit)
    norm_weight.div_(s.to(norm_weight.dtype))
    linear_weight.mul_(s[: linear_weight.shape[0], None].to(linear_weight.dtype))


WRONG_07_SMOOTH = {"7.4": _swapped_exponents, "7.5": _inverted_fold}


@pytest.mark.parametrize("wrong", [_swapped_exponents, _per_tensor_weight, _no_floor])
def test_smoothing_factor_mistakes_fail_naming_the_expected_value(wrong):
    with pytest.raises(AssertionError, match="expected"):
        checks.check_smoothing_factors(wrong)


@pytest.mark.parametrize("wrong", [_inverted_fold, _rows_scaled])
def test_folding_mistakes_fail_naming_the_expected_value(wrong):
    with pytest.raises(AssertionError, match="expected"):
        checks.check_fold_into_norm(wrong)


def test_a_fold_that_returns_new_tensors_instead_of_changing_them_in_place_fails():
    def functional(norm_weight, linear_weight, s):
        return norm_weight / s, linear_weight * s

    with pytest.raises(AssertionError, match="expected None"):
        checks.check_fold_into_norm(functional)


def test_the_library_solutions_pass(capsys, solution_copy):
    from minillm.quant.smooth import fold_into_norm, smoothing_factors

    checks.check_smoothing_factors(solution_copy(checks.EXERCISES["7.4"]))
    checks.check_fold_into_norm(solution_copy(checks.EXERCISES["7.5"]))
    out = capsys.readouterr().out
    assert "Exercise 7.4 passed" in out and "Exercise 7.5 passed" in out
    assert torch.equal(smoothing_factors(torch.ones(2), torch.ones(1, 2), 0.5), torch.ones(2))
    assert fold_into_norm is checks.EXERCISES["7.5"].reference()
