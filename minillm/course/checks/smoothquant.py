"""Checkers of notebook 07's activation-quantization section: SmoothQuant's factors (7.4) and their folding (7.5).

Each checker computes its expectation with a reference written here in fp64 (never the library function the
exercise targets: a grader hides it while the checker runs), on fresh random inputs with outlier channels, a
channel that never fired (max|x| = 0) and a weight column of zeros, at α = 0, 0.5, 0.8 and 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor

from minillm.course.checks.registry import _passed, exercise

_FLOOR = 1e-5  # both maxima are floored here (SmoothQuant's clamp), as the docstring says


def _generator() -> tuple[torch.Generator, int]:
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _outlier_stats(g: torch.Generator, K: int, N: int) -> tuple[Tensor, Tensor]:
    """(act_absmax [K] with a few channels ×50–100 and one zero channel, weight [N, K] with a zero column)."""
    a = torch.rand(K, generator=g) * 2 + 0.1
    hot = torch.randperm(K, generator=g)[:3]
    a[hot] *= 50 + 50 * torch.rand(3, generator=g)
    a[int(torch.randint(0, K, (1,), generator=g))] = 0.0
    w = torch.randn(N, K, generator=g) * 0.05
    w[:, int(torch.randint(0, K, (1,), generator=g))] = 0.0
    return a, w


def _ref_factors(a: Tensor, w: Tensor, alpha: float) -> Tensor:
    x_max = a.double().clamp_min(_FLOOR)
    w_max = w.double().abs().amax(0).clamp_min(_FLOOR)
    return x_max**alpha / w_max ** (1 - alpha)


@exercise("7.4", "minillm.quant.smooth.smoothing_factors", "SmoothQuant's per-channel smoothing factors",
          "x_max = act_absmax floored at 1e-5; w_max = max over the N rows of |weight|, floored at 1e-5; "
          "return x_max ** alpha / w_max ** (1 - alpha)")
def check_smoothing_factors(smoothing_factors: Callable) -> None:
    """``smoothing_factors(act_absmax [K], weight [N, K], alpha)`` at α ∈ {0, 0.5, 0.8, 1} against an fp64
    reference, with outlier channels, a zero activation channel and a zero weight column; at α = 0.5 the smoothed
    activation and weight ranges must agree channel by channel; α outside [0, 1] must raise ValueError."""
    g, seed = _generator()
    K, N = 48, 20
    a, w = _outlier_stats(g, K, N)
    for alpha in (0.0, 0.5, 0.8, 1.0):
        call = f"seed {seed}: smoothing_factors(act_absmax [{K}], weight [{N}, {K}], alpha={alpha})"
        s = smoothing_factors(a, w, alpha)
        assert isinstance(s, Tensor) and tuple(s.shape) == (K,), (
            f"{call} returned {type(s).__name__} {tuple(getattr(s, 'shape', ()))}, expected a tensor of shape ({K},)"
            " — one factor per input channel (reduce |weight| over its rows, dim 0)")
        ref = _ref_factors(a, w, alpha)
        err = (s.double() - ref).abs() / ref
        if float(err.max()) > 1e-4:
            j = int(err.argmax())
            raise AssertionError(f"{call}: s[{j}] is {float(s[j]):.6g}, expected {float(ref[j]):.6g} "
                                 f"(max|x_j| = {float(a[j]):.4g}, max|W_j| = {float(w[:, j].abs().max()):.4g})")
    s = smoothing_factors(a, w, 0.5).double()
    live = (a > _FLOOR) & (w.abs().amax(0) > _FLOOR)
    x_range, w_range = (a.double() / s)[live], (w.double().abs().amax(0) * s)[live]
    assert torch.allclose(x_range, w_range, rtol=1e-4), (
        f"seed {seed}: at alpha 0.5, max|x_j| / s_j and max|W_j| · s_j differ (max ratio "
        f"{float((x_range / w_range).max()):.4g}); expected them equal — the point of α = 0.5")
    for bad in (-0.25, 1.5):
        try:
            smoothing_factors(a, w, bad)
        except ValueError:
            continue
        raise AssertionError(f"smoothing_factors(..., alpha={bad}): expected a ValueError (α must be in [0, 1])")
    _passed("7.4")


@exercise("7.5", "minillm.quant.smooth.fold_into_norm", "folding 1/s into the RMSNorm and s into the linear",
          "in place, computing in fp32 and storing back in each tensor's dtype: norm_weight ← norm_weight / s, "
          "linear_weight ← linear_weight · s (s scales the columns: broadcast over the N rows)")
def check_fold_into_norm(fold_into_norm: Callable) -> None:
    """``fold_into_norm(norm_weight [K], linear_weight [N, K], s [K])`` in place, in fp32 and bf16: the new
    tensors against fp64 references, the dtypes kept, and linear(rms_norm(x) · g') equal to the unfolded
    linear(rms_norm(x) · g) (the folded model computes the same function)."""
    g, seed = _generator()
    K, N = 40, 24
    for dtype in (torch.float32, torch.bfloat16):
        gamma = (torch.rand(K, generator=g) + 0.5).to(dtype)
        w = torch.randn(N, K, generator=g).to(dtype)
        s = torch.rand(K, generator=g) * 8 + 0.05
        gamma0, w0 = gamma.clone(), w.clone()
        out = fold_into_norm(gamma, w, s)
        call = f"seed {seed}: fold_into_norm(norm_weight [{K}] {str(dtype)[6:]}, linear_weight [{N}, {K}], s [{K}])"
        assert out is None, f"{call} returned {type(out).__name__}, expected None (the tensors change in place)"
        assert gamma.dtype == dtype and w.dtype == dtype, (
            f"{call}: dtypes became {gamma.dtype}, {w.dtype}, expected {dtype} (store back in each tensor's dtype)")
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for name, got, want in (("norm_weight", gamma, gamma0.double() / s.double()),
                                ("linear_weight", w, w0.double() * s.double())):
            err = (got.double() - want).abs() / want.abs().clamp_min(1e-12)
            if float(err.max()) > tol:
                i = tuple(int(j) for j in (err == err.max()).nonzero()[0])
                raise AssertionError(f"{call}: {name}{list(i)} is {float(got[i]):.6g}, expected {float(want[i]):.6g}"
                                     " (norm_weight / s and linear_weight · s, column j scaled by s[j])")
    x = torch.randn(5, K, generator=g, dtype=torch.float64)
    gamma, w = torch.rand(K, generator=g) + 0.5, torch.randn(N, K, generator=g)
    s = torch.rand(K, generator=g) * 8 + 0.05
    rms = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    want = (rms * gamma.double()) @ w.double().T
    fold_into_norm(gamma, w, s)
    got = (rms * gamma.double()) @ w.double().T
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (
        f"seed {seed}: after folding, linear(rms_norm(x) · g) differs from before by up to "
        f"{float((got - want).abs().max()):.3g}; expected equal (the 1/s in the norm and the s in W cancel)")
    _passed("7.5")
