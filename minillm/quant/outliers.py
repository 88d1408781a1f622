"""LLM.int8()-style mixed-precision decomposition (Dettmers et al., 2022) — a teaching reference, not a fast path.

Past ~6.7B parameters a few hidden-state *feature dimensions* (< 1 % of them) carry values 20-100× the rest, in
almost every token.  One int8 scale per token row then spends its 255 levels on the outlier and rounds every other
feature of the row to a few levels.  LLM.int8() splits the product by input column:

    x W^T = x[:, O] W[:, O]^T            (O: the columns where some |x| > threshold, kept in full precision)
          + x[:, ~O] W[:, ~O]^T          (the rest: int8 with one absmax scale per token row of x and per
                                          output row of W — "vector-wise" — integer products, int32 sums)

The result is close to the full-precision product (perplexity unchanged in the paper) but not faster: the split,
the gathers and two matmuls cost more than one fp16 GEMM at the sizes where it matters.  Weight-only int8/int4
(``quant/apply.py``) is what speeds up a memory-bound decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

THRESHOLD = 6.0  # the paper's outlier threshold on |x|
INT8_MAX = 127


def outlier_columns(x: Tensor, threshold: float = THRESHOLD) -> Tensor:
    """x [..., K] -> [K] bool: the feature columns where any |x| exceeds ``threshold``."""
    return (x.abs() > threshold).reshape(-1, x.shape[-1]).any(0)


def _rowwise_int8(a: Tensor) -> tuple[Tensor, Tensor]:
    """a [R, C] -> (int8 codes [R, C], fp32 scales [R, 1]): symmetric absmax per row."""
    scale = (a.float().abs().amax(-1, keepdim=True) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.clamp(torch.round(a.float() / scale), -INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [R, K] @ w [N, K]^T with both vector-wise int8 (one scale per row of each), int32 sums -> [R, N] fp32."""
    xq, sx = _rowwise_int8(x)
    wq, sw = _rowwise_int8(w)
    acc = xq.to(torch.int32) @ wq.to(torch.int32).T  # exact: |sum| ≤ 127² · K < 2³¹ for K < 133 000
    return acc.float() * sx * sw.T


def int8_matmul_with_outliers(x: Tensor, w: Tensor, threshold: float = THRESHOLD) -> tuple[Tensor, Tensor]:
    """x [..., K] @ w [N, K]^T -> (y [..., N] fp32, the outlier column mask [K]): the columns of ``outlier_columns``
    in fp32, the rest through ``int8_matmul``."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but w is {tuple(w.shape)} (N, K)")
    cols = outlier_columns(x, threshold)
    rows = x.reshape(-1, x.shape[-1]).float()
    y = rows[:, cols] @ w[:, cols].float().T  # (R, N): the few outlier features, full precision
    if (~cols).any():
        y = y + int8_matmul(rows[:, ~cols], w[:, ~cols])
    return y.view(*x.shape[:-1], w.shape[0]), cols
