"""LLM.int8()-style outlier decomposition (quant/outliers.py) against the full-precision product."""

import torch

from minillm.quant.outliers import int8_matmul, int8_matmul_with_outliers, outlier_columns


def activations_with_outlier_features(seed=0):
    """[2, 16, 256] hidden states whose features 7 and 100 are ~60× the rest, in every token (LLM.int8()'s finding)."""
    x = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(seed))
    x[..., [7, 100]] *= 60
    return x


def rel_error(y, ref) -> float:
    return float((y - ref).norm() / ref.norm())


def test_keeping_the_outlier_features_in_full_precision_recovers_the_product():
    x = activations_with_outlier_features()
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    ref = x @ w.T
    mixed, cols = int8_matmul_with_outliers(x, w)
    plain = int8_matmul(x.reshape(-1, 256), w).view_as(ref)
    assert cols.nonzero().flatten().tolist() == [7, 100]
    assert rel_error(mixed, ref) < 0.01  # int8 on well-scaled rows: ~0.5 % error
    assert rel_error(plain, ref) > 3 * rel_error(mixed, ref)  # one scale per row wasted on the outliers


def test_no_outliers_is_plain_int8_and_threshold_zero_is_exact():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    y, cols = int8_matmul_with_outliers(x, w, threshold=float("inf"))
    assert not cols.any() and torch.equal(y, int8_matmul(x, w))
    y, cols = int8_matmul_with_outliers(x, w, threshold=0.0)
    assert cols.all()
    torch.testing.assert_close(y, x @ w.T)


def test_outlier_columns_flags_a_column_if_any_token_exceeds_the_threshold():
    x = torch.zeros(3, 4, 5)
    x[2, 1, 3] = -7.0
    assert outlier_columns(x).tolist() == [False, False, False, True, False]
