"""KV-cache quantization helpers: int8 (symmetric absmax) and fp8 e4m3, one fp32 scale per (token, head).

A cache stores ``codes`` [..., H_kv, D] (1 byte each) and ``scales`` [..., H_kv, 1] fp32 in place of K or V, and
dequantizes the rows attention reads.  Per token and head, because K/V magnitudes vary across heads (some keys
carry large outlier channels) and each token is written once, so its scale never has to change afterwards.
Bytes per token and layer: 2 · H_kv · (D + 4) — for D = 64, 0.53× bf16 and 0.27× fp32 (vLLM's
``kv_cache_dtype="int8"|"fp8"``).

``KVQuantizer`` is the backend object the quantized caches hold (``kv.contiguous.QuantizedKVCache``,
``kv.paged_cache.QuantizedPagedKVCache``): its code dtype, quantize and dequantize.  The model never sees it —
attention receives the dequantized rows it would have read from a float cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.config import KV_CACHE_DTYPES  # ("auto", "int8", "fp8"); "auto": the model's dtype
from minillm.dtypes import DType, dtype_bytes

INT8_MAX = 127
SCALE_BYTES = 4  # one fp32 scale per (token, head)


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device | str = "cpu") -> str:
    """``kv_cache_dtype`` if it is one of ``KV_CACHE_DTYPES`` and can run on ``device``; else ValueError."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"kv_cache_dtype='fp8' needs torch.float8_e4m3fn (torch {torch.__version__} lacks it): "
                         "upgrade torch or use kv_cache_dtype='int8'")
    if kv_cache_dtype == "fp8" and not _fp8_runs_on(str(torch.device(device))):
        raise ValueError(f"kv_cache_dtype='fp8': torch {torch.__version__} cannot convert to float8_e4m3fn on "
                         f"{device}: use kv_cache_dtype='int8' (or upgrade torch)")
    return kv_cache_dtype


def _fp8_runs_on(device: str) -> bool:
    """Whether a float -> e4m3 -> float round trip runs on ``device`` (one tiny conversion, tried per call)."""
    try:
        x = torch.ones(2, device=device)
        return bool((x.to(torch.float8_e4m3fn).float() == x).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _scales(x: Tensor, qmax: float) -> Tensor:
    return (x.float().abs().amax(-1, keepdim=True) / qmax).clamp_min(torch.finfo(torch.float32).tiny)


def quantize_kv_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., H, D] float -> (codes int8 [..., H, D], scales fp32 [..., H, 1]), x ≈ codes · scales."""
    scale = _scales(x, INT8_MAX)
    codes = torch.clamp(torch.round(x.float() / scale), -INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def quantize_kv_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., H, D] float -> (codes float8_e4m3fn [..., H, D], scales fp32 [..., H, 1]): each (token, head) row is
    scaled so its absmax lands on e4m3's largest finite value (448), then rounded to 3 mantissa bits."""
    check_kv_cache_dtype("fp8")
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = _scales(x, fmax)
    return (x.float() / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn), scale


def dequantize_kv(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(codes [..., H, D] int8 or fp8, scales [..., H, 1]) -> [..., H, D] in ``dtype``."""
    if codes.shape[:-1] != scales.shape[:-1] or scales.shape[-1] != 1:
        raise ValueError(f"scales must be [..., H, 1] matching codes {tuple(codes.shape)}, got {tuple(scales.shape)}")
    return (codes.float() * scales.float()).to(dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                       model_dtype: DType = torch.float32) -> float:
    """Bytes of K and V for one token over all layers: 2 · layers · H_kv · D · bytes per element of
    ``model_dtype`` (a torch dtype, a name such as "bfloat16" or "int4", or a number of bytes), plus the scales
    when quantized (``kv_cache_dtype`` "int8"/"fp8": 1 byte per element + 4 per (token, head)).

    The one place this formula lives: the paged cache's block size, the roofline's K/V traffic and the
    disaggregated K/V transfer all call it (notebook 02's exercise ``kv.contiguous.kv_bytes_per_token`` is the
    students' own copy)."""
    check_kv_cache_dtype(kv_cache_dtype)
    per_head = head_dim * dtype_bytes(model_dtype) if kv_cache_dtype == "auto" else head_dim + SCALE_BYTES
    return 2 * num_layers * num_kv_heads * per_head


@dataclass(frozen=True)
class KVQuantizer:
    """How a quantized cache stores K/V: ``kv_cache_dtype`` "int8" or "fp8", codes of ``code_dtype`` [..., D] and
    one fp32 scale per row [..., 1] (a row = one token of one KV head)."""

    kv_cache_dtype: str

    def __post_init__(self):
        if self.kv_cache_dtype not in ("int8", "fp8"):
            raise ValueError(f"KVQuantizer stores 'int8' or 'fp8', got {self.kv_cache_dtype!r} (use the float cache "
                             "for 'auto')")

    @property
    def code_dtype(self) -> torch.dtype:
        """torch.int8 or torch.float8_e4m3fn: 1 byte per element."""
        return torch.int8 if self.kv_cache_dtype == "int8" else torch.float8_e4m3fn

    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., D] float -> (codes [..., D], scales fp32 [..., 1])."""
        return quantize_kv_int8(x) if self.kv_cache_dtype == "int8" else quantize_kv_fp8(x)

    def dequantize(self, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        """(codes [..., D], scales [..., 1]) -> [..., D] in ``dtype``."""
        return dequantize_kv(codes, scales, dtype)


def kv_quantizer(kv_cache_dtype: str, device: torch.device | str = "cpu") -> KVQuantizer | None:
    """The backend for ``kv_cache_dtype`` on ``device``: None for "auto" (a float cache), else a ``KVQuantizer``;
    ValueError for an unknown name or fp8 where torch cannot run it (the message names the fix)."""
    check_kv_cache_dtype(kv_cache_dtype, device)
    return None if kv_cache_dtype == "auto" else KVQuantizer(kv_cache_dtype)
