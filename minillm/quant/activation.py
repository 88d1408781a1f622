"""Activation quantization (W8A8, FP8): the weights *and* the inputs of a linear are rounded, so the matmul itself
runs on 8-bit numbers — int8 × int8 → int32 (VNNI / AMX on CPUs, int8 tensor cores on GPUs) or fp8 × fp8 (Hopper,
Ada).  Weight-only schemes (``quant.weight``) save bytes, which is what a batch-1 decode is bound by; W8A8 saves
*arithmetic*, which is what prefill and large decode batches are bound by.

Formats and their plain references (``*_ref``: dequantize both operands, then a float matmul — the answer every
kernel is tested against):

- W8A8 int8: the weight is an ``Int8Weight`` per output channel (one fp32 scale per row, ``quantize_int8``); the
  activations x [M, K] are rounded per token (one scale per row, max|x_m| / 127: *dynamic*, computed each call) or
  with one *static* per-tensor scale calibrated once (``input_scale``; values past it saturate at ±127).
  y[m, n] = sx[m] · sw[n] · Σ_k xq[m, k] · wq[n, k]: the integer sum is exact in int32 (|sum| ≤ 127² · K), and the
  two scales are applied once per output element after it (the GEMM's epilogue).
- FP8 (e4m3: 4 exponent bits, 3 mantissa bits, max 448): ``Fp8Weight`` per output channel, activations per token;
  the relative rounding error is the same for large and small values (a float), so outliers cost less than with
  int8 — but only GPUs with compute capability ≥ 8.9 multiply fp8 natively (``torch._scaled_mm``).

SmoothQuant's smoothing factors and their folding into the model live in ``quant.smooth``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.quant.weight import CodesAndScales, Int8Weight, check_in_features

INT8_MAX = 127  # symmetric grid [-127, 127], as quant.weight's int8 weights
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_TINY = torch.finfo(torch.float32).tiny


def quantize_activation_int8(x: Tensor, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] float -> (codes int8 [M, K], scales fp32 [M, 1]) with x ≈ codes · scales.

    ``input_scale`` None: dynamic, per token (scale = max|x_m| / 127, computed here: one extra read of x);
    a 0-dim fp32 tensor: static, that one scale for every row (codes clamped to ±127)."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(-1, keepdim=True) / INT8_MAX).clamp_min(_TINY)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = torch.clamp(torch.round(xf / scale), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def check_w8a8_weight(w8: Int8Weight) -> None:
    """ValueError unless ``w8`` has one scale per output channel (a W8A8 GEMM applies the weight's scale after the
    integer sum over all of K, so a group's scale cannot change along K)."""
    if w8.group_size != w8.shape[1]:
        raise ValueError(f"a W8A8 weight needs one scale per output channel (group_size = K = {w8.shape[1]}), "
                         f"got group_size {w8.group_size}: quantize it with quantize_int8(w) (group_size None)")


def w8a8_linear_ref(x: Tensor, w8: Int8Weight, input_scale: Tensor | None = None,
                    bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ w8.T (+ bias) -> [..., N] in x's dtype, with x rounded to int8 per token (``input_scale``
    None) or with the static scale: dequantize x's codes and the weight to fp32, then ``F.linear`` — the W8A8
    reference.  Cost: an [M, K] and an [N, K] fp32 copy per call, and a float GEMM."""
    check_in_features(x, w8.shape[1])
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_activation_int8(x2, input_scale)
    y = F.linear(xq.float() * sx, w8.dequantize(torch.float32), None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], w8.shape[0])


def w8a8_linear_int_mm(x: Tensor, w8: Int8Weight, input_scale: Tensor | None = None,
                       bias: Tensor | None = None) -> Tensor:
    """``w8a8_linear_ref``'s result through an integer GEMM: int8 codes × int8 codes -> int32 with
    ``torch._int_mm`` (oneDNN on CPU, using VNNI / AMX where the CPU has them; cuBLASLt on CUDA), then the
    epilogue y = acc · sx · swᵀ (+ bias) in one broadcast multiply.  Equals the reference up to fp32 rounding
    (the integer sum is exact; the reference sums rounded fp32 products).

    CUDA's ``_int_mm`` needs M > 16 and K, N multiples of 8: fewer rows are zero-padded to 17, other K/N run
    the reference."""
    check_in_features(x, w8.shape[1])
    N, K = w8.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if x.device.type == "cuda" and (K % 8 or N % 8):
        return w8a8_linear_ref(x, w8, input_scale, bias)
    xq, sx = quantize_activation_int8(x2, input_scale)
    if x.device.type == "cuda" and M <= 16:
        xq = F.pad(xq, (0, 0, 0, 17 - M))
    acc = torch._int_mm(xq, w8.qweight.t())[:M]  # [M, N] int32; the [N, K] codes read as a column-major [K, N]
    y = acc * (sx * w8.scales.float().view(1, N))  # int32 × fp32 -> fp32, the scales applied once per element
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], N)


# --------------------------------------------------------------------------------------------------------- fp8
@dataclass(frozen=True)
class Fp8Weight(CodesAndScales):
    """FP8 weight: ``qweight`` float8_e4m3fn [N, K] and fp32 ``scales`` [N, 1] (per output channel), w = scales · q.
    ``group_size`` is K (one scale over each whole row): the field the packed-module buffers expect."""

    qweight: Tensor
    scales: Tensor
    group_size: int

    def __post_init__(self):
        if self.qweight.dtype != FP8_DTYPE or self.qweight.dim() != 2:
            raise ValueError(f"qweight must be float8_e4m3fn [N, K], got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)}")
        N, K = self.qweight.shape
        if self.group_size != K or self.scales.shape != (N, 1) or self.scales.dtype != torch.float32:
            raise ValueError(f"need group_size = K = {K} and fp32 scales [{N}, 1], got group_size {self.group_size}"
                             f", {self.scales.dtype} {tuple(self.scales.shape)}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[N, K] in ``dtype`` (q · scale in fp32)."""
        return (self.qweight.float() * self.scales).to(dtype)


def _to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(w: Tensor) -> Fp8Weight:
    """w [N, K] float -> ``Fp8Weight``: scale = max|w_n| / 448 per row, codes rounded to e4m3 (nearest)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8 needs a float [N, K] weight, got {w.dtype} {tuple(w.shape)}")
    scale = (w.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    return Fp8Weight(_to_fp8(w, scale), scale, w.shape[1])


def quantize_activation_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 per-token scales [M, 1]), x ≈ codes · scales."""
    scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    return _to_fp8(x, scale), scale


def fp8_linear_ref(x: Tensor, w: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N] in x's dtype, x rounded to e4m3 per token: both operands dequantized
    to fp32, then ``F.linear`` — the FP8 reference (runs anywhere; only the kernel needs an fp8 GPU)."""
    check_in_features(x, w.shape[1])
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_activation_fp8(x2)
    y = F.linear(xq.float() * sx, w.dequantize(torch.float32), None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def fp8_linear_scaled_mm(x: Tensor, w: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """``fp8_linear_ref``'s result with ``torch._scaled_mm`` (CUDA, compute capability ≥ 8.9): e4m3 × e4m3 with
    fp32 accumulation, per-token (row-wise) and per-channel scales applied in the epilogue, output in bf16 (what
    row-wise scaling produces), then x's dtype.  K and N must be multiples of 16, else the reference runs."""
    check_in_features(x, w.shape[1])
    N, K = w.shape
    if x.device.type != "cuda" or K % 16 or N % 16:
        return fp8_linear_ref(x, w, bias)
    x2 = x.reshape(-1, K)
    xq, sx = quantize_activation_fp8(x2)
    y = torch._scaled_mm(xq, w.qweight.t(), scale_a=sx, scale_b=w.scales.view(1, N), out_dtype=torch.bfloat16)
    y = y.float() if bias is None else y.float() + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], N)


def fp8_supported(device: torch.device | str) -> str | None:
    """None if ``device`` multiplies fp8 natively (CUDA, compute capability ≥ 8.9); else why not, with what to use
    instead (the message of the ValueError ``quantization="fp8"`` raises)."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"quantization='fp8' needs a CUDA GPU with compute capability ≥ 8.9 (Ada, Hopper: fp8 tensor cores "
                f"through torch._scaled_mm), but the model is on {device.type}; use quantization='w8a8' (int8 "
                "weights and activations, integer GEMMs) or 'int8' (weight-only) instead")
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        return (f"quantization='fp8' needs compute capability ≥ 8.9 (Ada, Hopper) for fp8 tensor cores; this GPU "
                f"is {cc[0]}.{cc[1]}; use quantization='w8a8' (int8 tensor cores) or 'int8' instead")
    return None
