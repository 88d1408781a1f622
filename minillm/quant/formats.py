"""Number formats and the quantize / dequantize maps between them, with their error.

A format is a finite set of representable numbers.  Floating formats (fp32, fp16, bf16, fp8 e4m3/e5m2) trade
range (exponent bits) for precision (mantissa bits); their limits come from ``torch.finfo``.  Integer formats
(int8, int4) are evenly spaced and need a *scale* (and for asymmetric maps a *zero point*) to cover a tensor's
range: ``q = clamp(round(x / scale) + zero_point, qmin, qmax)``, ``x̂ = (q - zero_point) · scale``.

- symmetric (absmax): ``scale = max|x| / qmax``, zero point 0; int8 uses [-127, 127] so the grid is symmetric.
- asymmetric (min/max): ``scale = (max - min) / (qmax - qmin)``, ``zero_point = qmin - round(min / scale)``;
  int8 maps to [-128, 127], int4 (unsigned) to [0, 15].
- granularity: one scale per tensor, per output channel (row of a weight [N, K]) or per group of ``group_size``
  consecutive elements along the last dim.  Finer granularity isolates outliers at the cost of more scales.
- clipping: ``clip_ratio < 1`` shrinks the range before computing the scale (outliers saturate, the rest gets a
  finer grid).

Error statistics (``error_stats``): max abs error, RMSE and SQNR in dB (10·log10(Σx² / Σ(x - x̂)²)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from minillm.dtypes import torch_dtype


@dataclass(frozen=True)
class FormatInfo:
    """One number format: its name, storage bits, largest finite value, smallest positive normal (floats) or step
    (ints), and relative precision ``eps`` (gap between 1 and the next representable number; 1 for ints)."""

    name: str
    bits: int
    max: float
    min: float  # most negative representable value
    smallest_normal: float
    eps: float
    is_float: bool

    @property
    def bytes(self) -> float:
        """Bytes per element (0.5 for int4)."""
        return self.bits / 8


_FLOATS = {**{name: torch_dtype(name) for name in ("fp32", "fp16", "bf16")},
           "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # fp8's two layouts have no alias
_INTS = {"int8": torch.int8, "uint8": torch.uint8}
FORMAT_NAMES = (*_FLOATS, "int8", "int4", "uint4")


def format_info(name: str) -> FormatInfo:
    """Range, precision and size of ``name`` (one of ``FORMAT_NAMES``), from ``torch.finfo``/``iinfo``; int4 by
    hand (torch has no 4-bit integer dtype: two values share a byte)."""
    if name in _FLOATS:
        fi = torch.finfo(_FLOATS[name])
        return FormatInfo(name, fi.bits, float(fi.max), float(fi.min), float(fi.smallest_normal), float(fi.eps), True)
    if name in _INTS:
        ii = torch.iinfo(_INTS[name])
        return FormatInfo(name, ii.bits, float(ii.max), float(ii.min), 1.0, 1.0, False)
    if name == "int4":
        return FormatInfo(name, 4, 7.0, -8.0, 1.0, 1.0, False)
    if name == "uint4":
        return FormatInfo(name, 4, 15.0, 0.0, 1.0, 1.0, False)
    raise ValueError(f"unknown format {name!r}; choose one of {FORMAT_NAMES}")


class Granularity(str, Enum):
    """Which elements share one scale."""

    TENSOR = "tensor"  # one scale for the whole tensor
    CHANNEL = "channel"  # one per row (output channel of a weight [N, K])
    GROUP = "group"  # one per group of group_size consecutive elements along the last dim


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize: integer ``bits`` (8 or 4), ``symmetric`` (absmax) or asymmetric (min/max + zero point),
    ``granularity``, ``group_size`` (GROUP only) and ``clip_ratio`` in (0, 1] applied to the range."""

    bits: int = 8
    symmetric: bool = True
    granularity: Granularity = Granularity.CHANNEL
    group_size: int | None = None
    clip_ratio: float = 1.0

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {self.bits}")
        object.__setattr__(self, "granularity", Granularity(self.granularity))
        if self.granularity is Granularity.GROUP:
            if not isinstance(self.group_size, int) or self.group_size < 1:
                raise ValueError(f"granularity 'group' needs a positive integer group_size, got {self.group_size}")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only meaningful with granularity 'group' (got {self.granularity.value})")
        if not 0 < self.clip_ratio <= 1:
            raise ValueError(f"clip_ratio must be in (0, 1], got {self.clip_ratio}")

    @property
    def qmin(self) -> int:
        """Smallest integer code: symmetric keeps the grid symmetric (-127 for int8, -7 for int4)."""
        if self.symmetric:
            return -(2 ** (self.bits - 1) - 1)
        return -(2 ** (self.bits - 1)) if self.bits == 8 else 0  # int8 [-128, 127]; int4 unsigned [0, 15]

    @property
    def qmax(self) -> int:
        """Largest integer code."""
        return 2 ** (self.bits - 1) - 1 if self.symmetric or self.bits == 8 else 2**self.bits - 1


@dataclass(frozen=True)
class Quantized:
    """Integer codes ``q`` (int8 storage, same shape as the input [..., K]) with ``scale`` and ``zero_point``
    broadcastable as [..., K // group] per group (tensor: [1, ..., 1]; channel: [..., 1])."""

    q: Tensor
    scale: Tensor
    zero_point: Tensor
    spec: QuantSpec


def group_view(x: Tensor, spec: QuantSpec) -> Tensor:
    """View ``x`` [..., K] so that the last dim holds the elements of one scale: TENSOR [1, numel], CHANNEL
    [..., K], GROUP [..., K // g, g].  ValueError (naming the fix) when ``spec.group_size`` does not divide K."""
    if spec.granularity is Granularity.TENSOR:
        return x.reshape(1, -1)
    if spec.granularity is Granularity.CHANNEL:
        return x
    K, g = x.shape[-1], spec.group_size
    if K % g:
        divisors = [d for d in (32, 64, 128, 256) if K % d == 0] or [d for d in range(2, K + 1) if K % d == 0][:4]
        raise ValueError(f"group_size {g} does not divide the last dimension K={K}: pad K to a multiple of {g} "
                         f"(zero columns) or choose a group size that divides it (e.g. {divisors})")
    return x.reshape(*x.shape[:-1], K // g, g)


_grouped = group_view  # its former private name, kept for code written against it on other branches


def quantize(x: Tensor, spec: QuantSpec) -> Quantized:
    """x [..., K] float -> ``Quantized``: integer codes plus per-tensor/channel/group scale and zero point.

    Contract (the module docstring gives the two maps):
    - the statistics are taken in fp32 over the elements that share a scale: the whole tensor (TENSOR), one row
      along the last dim (CHANNEL), or each run of ``spec.group_size`` consecutive elements along it (GROUP; a
      group that does not divide K -> ValueError naming the fix);
    - symmetric: ``scale = clip_ratio · max|x| / qmax``, zero point 0.  Asymmetric: the range [lo, hi] is
      [min(x), max(x)] widened to include 0 (so 0 is exact) and multiplied by ``clip_ratio``;
      ``scale = (hi - lo) / (qmax - qmin)``, ``zero_point = qmin - round(lo / scale)`` clamped to [qmin, qmax];
    - scales are clamped below at ``torch.finfo(torch.float32).tiny`` (an all-zero group must not divide by 0);
    - ``q = clamp(round(x / scale) + zero_point, qmin, qmax)`` (round half to even, as ``torch.round``), stored as
      int8 — uint8 for asymmetric 4-bit (codes 0..15) — with x's shape;
    - ``scale``/``zero_point`` fp32: TENSOR [1, ..., 1] (x.dim() ones), CHANNEL [..., 1], GROUP [..., K // g].
    ``dequantize`` inverts it: x̂ = (q - zero_point) · scale.  Non-float or 0-d x -> ValueError.
    """
    if not x.is_floating_point():
        raise ValueError(f"quantize needs a floating tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dimension")
    ### BEGIN SOLUTION
    xg = group_view(x.float(), spec)  # the last dim is one scale's elements: [1, numel], [..., K] or [..., G, g]
    if spec.symmetric:
        amax = xg.abs().amax(-1, keepdim=True) * spec.clip_ratio
        scale = amax.clamp_min(torch.finfo(torch.float32).tiny) / spec.qmax
        zero = torch.zeros_like(scale)
    else:
        lo = xg.amin(-1, keepdim=True).clamp_max(0) * spec.clip_ratio  # the range includes 0 so 0 is exact
        hi = xg.amax(-1, keepdim=True).clamp_min(0) * spec.clip_ratio
        scale = ((hi - lo) / (spec.qmax - spec.qmin)).clamp_min(torch.finfo(torch.float32).tiny)
        zero = (spec.qmin - torch.round(lo / scale)).clamp(spec.qmin, spec.qmax)
    q = torch.clamp(torch.round(xg / scale) + zero, spec.qmin, spec.qmax).to(torch.int8 if spec.bits == 8 or
                                                                             spec.symmetric else torch.uint8)
    if spec.granularity is Granularity.TENSOR:
        q = q.reshape(x.shape)
        scale, zero = scale.reshape([1] * x.dim()), zero.reshape([1] * x.dim())
    elif spec.granularity is Granularity.GROUP:
        q = q.reshape(x.shape)
        scale, zero = scale.squeeze(-1), zero.squeeze(-1)
    return Quantized(q, scale, zero, spec)
    ### END SOLUTION


def dequantize(qt: Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
    """x̂ = (q - zero_point) · scale, same shape as the quantized input, in ``dtype``."""
    q = qt.q.float()
    if qt.spec.granularity is Granularity.GROUP:
        g = qt.spec.group_size
        qg = q.reshape(*q.shape[:-1], q.shape[-1] // g, g)
        x = (qg - qt.zero_point.unsqueeze(-1)) * qt.scale.unsqueeze(-1)
        return x.reshape(q.shape).to(dtype)
    return ((q - qt.zero_point) * qt.scale).to(dtype)


def fake_quantize(x: Tensor, spec: QuantSpec) -> Tensor:
    """Quantize then dequantize (the error a format adds), in x's dtype."""
    return dequantize(quantize(x, spec), x.dtype)


def cast_roundtrip(x: Tensor, name: str) -> Tensor:
    """x cast to the float format ``name`` (saturating to its range, as fp8 has no inf in e4m3) and back."""
    if name not in _FLOATS:
        raise ValueError(f"cast_roundtrip takes a float format {tuple(_FLOATS)}, got {name!r}")
    info = format_info(name)
    return x.float().clamp(info.min, info.max).to(_FLOATS[name]).to(x.dtype)


@dataclass(frozen=True)
class ErrorStats:
    """How far x̂ is from x: max absolute error, root mean square error and signal-to-quantization-noise (dB)."""

    max_abs: float
    rmse: float
    sqnr_db: float


def error_stats(x: Tensor, x_hat: Tensor) -> ErrorStats:
    """Error of the approximation ``x_hat`` of ``x`` (same shape), computed in fp64."""
    if x.shape != x_hat.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(x_hat.shape)}")
    x, e = x.double(), x.double() - x_hat.double()
    noise, signal = float(e.pow(2).sum()), float(x.pow(2).sum())
    sqnr = math.inf if noise == 0 else (-math.inf if signal == 0 else 10 * math.log10(signal / noise))
    return ErrorStats(float(e.abs().max()) if e.numel() else 0.0, math.sqrt(noise / max(e.numel(), 1)), sqnr)
