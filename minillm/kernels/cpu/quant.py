"""Native int8 / int4 (Q4_1 layout; Q4_0 without mins) / GGUF Q6_K GEMV and small-batch GEMM on CPU, compiled on
first use, called by ctypes.

Two paths per weight format (``csrc/quant.c`` explains both):

- ``exact=True``: fp32 activations.  Equals ``minillm.quant.weight.int8_linear_ref`` / ``int4_linear_ref``
  (dequantize, then ``F.linear``) up to fp32 summation order.
- ``exact=False`` (the default, llama.cpp's scheme for Q4_1 / Q8_0): each row of x is first rounded to int8 per
  block of 32 (``q8_activation_ref`` is its PyTorch twin) and the block dot products run on integers — 2-4× less
  arithmetic per weight, which is what keeps a 4-bit GEMV bandwidth bound.  It equals the reference applied to
  ``q8_activation_ref(x)`` up to fp32 summation order, so it differs from the W4A16/W8A16 result by at most
  ``0.5 * sum_k dx_k * |w_nk|`` (every activation moves by at most half its block's step dx = max|x| / 127).

``block_prefill_linear`` is the prefill GEMM for Q8_0 / Q4_0 / Q4_1 weights: the same activation
rounding, register-tiled over 32-column panels of the weights (AVX-512 VNNI; a plain C twin elsewhere).
``w8a8_linear`` is W8A8's integer GEMM (``quant.activation``: per-channel int8 weights, int8 activations per token
or with a static scale, exact int32 sums, the scales in the epilogue): the bits of ``w8a8_linear_int_mm``, any rows.

x [..., K] has 1..``MAX_ROWS`` rows (``q6k_linear``: any number) in fp32 or bf16 (the output has x's dtype).  The
packed weights are read as stored — no float copy is made; scales and mins in fp32, fp16 or K records
(``scale_format``).  The library is cached beside ``native.c``'s (same directory and CPU key).
``target`` (None: ``-march=native`` / ``-mcpu=native``) compiles for another ``-march``, e.g. ``"x86-64"`` builds
the portable C path (no AVX2): how the tests check the code an AVX2-only or ARM machine runs.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from minillm.kernels.cpu import native
from minillm.kernels.cpu.native import _cpu_key, cache_dir, source_digest
from minillm.quant.weight import BLOCK, Int4Weight, Int8Weight, Q6KWeight

MAX_ROWS = 8  # decode batches; csrc/quant.c tiles any M in 8s, the weight row staying in L1 between tiles
_SRC = Path(__file__).parent / "csrc" / "quant.c"
_DTYPES = (torch.float32, torch.bfloat16)
SIMD_NAMES = {4: "int8 dot: AVX-512 VNNI", 3: "int8 dot: AVX VNNI (256-bit)",
              2: "int8 dot: AVX2 / AVX-512BW vpmaddubsw", 0: "int8 dot: portable C"}


def _compile(src: Path, out: Path, target: str | None) -> None:
    """native.py's build (same compiler, flags and OpenMP fallback); an explicit ``target`` (``-march=...``, for the
    portability tests) is tried with and without OpenMP, never silently replaced by the compiler's default."""
    flags = None if target is None else [[f"-march={target}", "-fopenmp"], [f"-march={target}"]]
    native._compile(out, src, flags)


@lru_cache(maxsize=4)
def _lib(target: str | None = None) -> ctypes.CDLL | None:
    if os.environ.get("MINILLM_DISABLE_NATIVE"):
        return None
    path = cache_dir() / f"quant-{source_digest(_SRC)}-{_cpu_key()}{'' if target is None else '-' + target}.so"
    try:
        if not path.exists():
            _compile(_SRC, path, target)
        lib = ctypes.CDLL(str(path))  # after torch: its libgomp is the one torch already loaded
    except (OSError, RuntimeError) as e:
        import warnings

        warnings.warn(f"minillm: native quantized GEMV unavailable ({e}); use the dequantizing reference",
                      stacklevel=2)
        return None
    i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for name in ("q4_gemm", "q4_gemm_q8", "q4_gemm_prefill"):
        getattr(lib, name).argtypes = [vp, vp, vp, c_int, vp, c_int, vp, i64, i64, i64, i64]
        getattr(lib, name).restype = None
    for name in ("q8_gemm", "q8_gemm_q8", "q8_gemm_prefill"):
        getattr(lib, name).argtypes = [vp, vp, c_int, vp, c_int, vp, i64, i64, i64, i64]
        getattr(lib, name).restype = None
    lib.q6k_gemm_q8.argtypes = [vp, vp, c_int, vp, i64, i64, i64]
    lib.q6k_gemm_q8.restype = None
    lib.q8_prefill_round.argtypes = [vp, c_int, i64, i64, vp, vp]
    lib.q8_prefill_round.restype = None
    lib.quant_prefill_tiled.restype = c_int
    lib.w8a8_gemm.argtypes = [vp, vp, c_int, vp, vp, vp, i64, i64, i64]
    lib.w8a8_gemm.restype = None
    lib.w8a8_quantize.argtypes = [vp, vp, i64, i64, vp, vp]
    lib.w8a8_quantize.restype = None
    lib.quant_built_with_openmp.restype = c_int
    lib.quant_simd_level.restype = c_int
    return lib


def available(target: str | None = None) -> bool:
    """True when the native quantized kernels are built and loadable here (for ``target``, see the module doc)."""
    return _lib(target) is not None


def simd_name(target: str | None = None) -> str:
    """Which integer dot product the int8-activation path uses in this build (for benchmark reports)."""
    return SIMD_NAMES[_lib(target).quant_simd_level()] if available(target) else "not built"


def supports(x: Tensor, w: Int8Weight | Int4Weight | Q6KWeight) -> bool:
    """Whether ``x @ w.T`` can take the native path: CPU, fp32/bf16 x with ≤ MAX_ROWS rows (a ``Q6KWeight``: any
    number, ``q6k_linear`` blocks many rows), library built."""
    if isinstance(w, Q6KWeight):
        tensors = (w.blocks,)
    else:
        tensors = (w.qweight, w.scales) if isinstance(w, Int8Weight) else (w.packed, w.scales, w.mins)
    return (x.device.type == "cpu" and all(t is None or t.device.type == "cpu" for t in tensors) and x.dtype in _DTYPES
            and (isinstance(w, Q6KWeight) or x.numel() // max(x.shape[-1], 1) <= MAX_ROWS)
            and not (torch.is_grad_enabled() and x.requires_grad) and available())


def q8_activation_ref(x: Tensor) -> Tensor:
    """x [..., K] (K a multiple of 32) -> xhat [..., K] fp32: each block of 32 rounded to dx · int8 with
    dx = max|x| / 127, q = round(x / dx) — the activations the ``exact=False`` kernels multiply (PyTorch twin)."""
    K = x.shape[-1]
    if K % BLOCK:
        raise ValueError(f"K={K} must be a multiple of {BLOCK} for int8 activation blocks")
    xb = x.float().reshape(-1, K // BLOCK, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))  # 1/d then a product, as the C code (x * id)
    return (torch.round(xb * inv) * d).view(x.shape)


def _prepare(x: Tensor, N: int, K: int, tensors: tuple[Tensor, ...], target: str | None,
             max_rows: int | None = MAX_ROWS) -> tuple[ctypes.CDLL, Tensor, Tensor]:
    """(library, x as a contiguous [M, K] with M ≤ ``max_rows`` (None: any), y [M, N] for the kernel to fill), or
    ValueError naming what is missing.
    Plain attribute tests only: at decode a SmolLM2 layer stack makes 120 of these calls per token, and each
    microsecond here is a visible share of an int4 decode stack (``supports`` is the same test for callers)."""
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K={K}")
    lib = _lib(target)
    if (lib is None or x.device.type != "cpu" or x.dtype not in _DTYPES
            or (max_rows is not None and x.numel() > max_rows * K)
            or (x.requires_grad and torch.is_grad_enabled())
            or any(t is not None and t.device.type != "cpu" for t in tensors)):
        rows = "" if max_rows is None else f" with at most {max_rows} rows"
        raise ValueError(f"the native quantized GEMV needs CPU fp32/bf16 x{rows} and a compiled library, got x "
                         f"{x.dtype} {tuple(x.shape)} on {x.device.type}; use minillm.quant.weight's *_linear_ref "
                         "instead")
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return lib, x2, x2.new_empty((x2.shape[0], N))


SCALE_F32, SCALE_F16, SCALE_K_RECORDS = 0, 1, 2  # csrc/quant.c's SF_*: the kernels' scale_fmt argument


def scale_format(w: Int8Weight | Int4Weight) -> int:
    """The C kernels' scale-format flag for a packed weight's scales and mins: fp32, fp16, or K records
    (``Int4Weight.k_records``: GGUF Q4_K's fp16 super-value and 8 uint8 sub-values per row and 256 weights)."""
    if isinstance(w, Int4Weight) and w.k_records:
        return SCALE_K_RECORDS
    return SCALE_F16 if w.scales.dtype == torch.float16 else SCALE_F32


def _mins_ptr(mins: Tensor | None) -> int | None:
    """The C kernels' mins argument: the address of the contiguous m [N, K / G], or NULL for a symmetric (Q4_0)
    weight, whose m = −8·d the kernels compute (csrc/quant.c ``q4_min``).  The caller keeps ``mins`` alive."""
    return None if mins is None else mins.contiguous().data_ptr()


def int8_linear(x: Tensor, w8: Int8Weight, exact: bool = False, target: str | None = None) -> Tensor:
    """x [..., K] (≤ MAX_ROWS rows, fp32/bf16) @ dequant(w8).T -> [..., N] in x's dtype.  ``exact=False`` rounds
    x to int8 blocks first (see the module doc); weights whose K or group is not a multiple of 32 always run exact."""
    q, s, G = w8.qweight, w8.scales, w8.group_size
    N, K = q.shape
    lib, x2, y = _prepare(x, N, K, (q, s), target)
    fn = lib.q8_gemm if exact or K % BLOCK or G % BLOCK else lib.q8_gemm_q8
    fn(q.contiguous().data_ptr(), s.contiguous().data_ptr(), scale_format(w8), x2.data_ptr(),
       x.dtype == torch.bfloat16, y.data_ptr(), x2.shape[0], N, K, G)
    return y.view(*x.shape[:-1], N)


def int4_linear(x: Tensor, w4: Int4Weight, exact: bool = False, target: str | None = None) -> Tensor:
    """x [..., K] (≤ MAX_ROWS rows, fp32/bf16) @ dequant(w4).T -> [..., N] in x's dtype (Q4_1 blocks).
    ``exact=False`` rounds x to int8 blocks first (see the module doc)."""
    p, s, mn = w4.packed, w4.scales, w4.mins
    N, K = w4.shape
    lib, x2, y = _prepare(x, N, K, (p, s, mn), target)
    fn = lib.q4_gemm if exact else lib.q4_gemm_q8
    fn(p.contiguous().data_ptr(), s.contiguous().data_ptr(), _mins_ptr(mn), scale_format(w4),
       x2.data_ptr(), x.dtype == torch.bfloat16, y.data_ptr(), x2.shape[0], N, K, w4.group_size)
    return y.view(*x.shape[:-1], N)


def q6k_linear(x: Tensor, w: Q6KWeight, target: str | None = None) -> Tensor:
    """x [..., K] (any number of rows, fp32/bf16) @ dequant(w).T -> [..., N] in x's dtype, from GGUF Q6_K blocks as
    they are (210 bytes per 256 weights streamed, nothing expanded).  x is rounded to int8 blocks of 32 first, as
    ``int8_linear``'s default path rounds it: the result is ``q6k_linear_ref(q8_activation_ref(x), w)`` up to fp32
    summation order (``csrc/quant.c`` q6k_gemm_q8 says how the 6-bit codes meet the int8 activations).
    Up to 8 rows (decode) each weight row streams past every input row, and a row's result is the same bits whatever
    rows share the call.  Past 8 (prefill), on AVX-512 VNNI builds (``prefill_tiled()``), ``block_prefill_linear``'s
    register-tiled GEMM: 32-row weight panels unpacked once per call, 4 × 32 outputs in registers, one fp32 term per
    16 weights — another summation order, so not the ≤ 8-row bits.  Elsewhere the weight rows in L2-sized blocks, each
    row unpacked once per call into a per-thread buffer and every tile of 8 input rows run over the block with the
    decode row kernel: the same bits as the ≤ 8-row kernel.  Cost: 2·M·N·K integer multiply-adds, N·K·210/256 weight
    bytes read once; past 8 rows the unpacked copy (N·K·5/4 bytes) read from L2 once per tile of input rows."""
    N, K = w.shape
    lib, x2, y = _prepare(x, N, K, (w.blocks,), target, max_rows=None)
    lib.q6k_gemm_q8(w.blocks.data_ptr(), x2.data_ptr(), x.dtype == torch.bfloat16, y.data_ptr(), x2.shape[0], N, K)
    return y.view(*x.shape[:-1], N)


# ------------------------------------------------------- prefill (csrc/quant.c q8_gemm_prefill, q4_gemm_prefill)
def prefill_tiled(target: str | None = None) -> bool:
    """Whether ``block_prefill_linear`` runs on its AVX-512 VNNI register tiles in this build (else its plain C twin,
    correct but slower than the dequantize + GEMM reference: callers pick it only where this is True)."""
    return available(target) and bool(_lib(target).quant_prefill_tiled())


def block_prefill_supports(x: Tensor, w: Int8Weight | Int4Weight) -> bool:
    """Whether ``block_prefill_linear(x, w)`` can run: CPU fp32/bf16 x, any number of rows, a Q4_x ``Int4Weight`` or
    an ``Int8Weight`` whose K and group are multiples of 32 (GGUF's Q8_0: 32), on CPU, no autograd, library built."""
    if isinstance(w, Int8Weight):
        tensors, G = (w.qweight, w.scales), w.group_size
    else:
        tensors, G = (w.packed, w.scales, w.mins), w.group_size
    K = w.shape[1]
    return (x.device.type == "cpu" and all(t is None or t.device.type == "cpu" for t in tensors)
            and x.dtype in _DTYPES and K % BLOCK == 0 and G % BLOCK == 0 and x.shape[-1] == K
            and not (torch.is_grad_enabled() and x.requires_grad) and available())


def block_prefill_linear(x: Tensor, w: Int8Weight | Int4Weight, target: str | None = None) -> Tensor:
    """x [..., K] (any rows, fp32/bf16) @ dequant(w).T -> [..., N] in x's dtype, for prefill: llama.cpp's Q8_0 × Q8_0
    (Q4_x × Q8_0) scheme as a register-tiled GEMM.  x is rounded per row and block of 32 exactly as
    ``q8_activation_ref`` rounds it (``block_prefill_round`` returns the codes), each block's 32 products summed in
    int32 (exact), scaled by the weight's and the activation's block scales and accumulated in fp32 — so the result
    is ``*_linear_ref(q8_activation_ref(x), w)`` up to one fp32 rounding per block term, and differs from the exact
    W8A16/W4A16 result by the activation rounding (≤ 0.5 · Σ_k dx_k · |w_nk|).  Not the decode kernels' bits: those
    sum the blocks in another order.  Cost: N·K weight bytes read and copied once per call into 32-column panels,
    2·M·N·K integer multiply-adds (``csrc/quant.c`` says how they are tiled)."""
    if not block_prefill_supports(x, w) or _lib(target) is None:
        raise ValueError(f"block_prefill_linear needs CPU fp32/bf16 x [..., K] and an Int4Weight or an Int8Weight "
                         f"with K and group_size multiples of {BLOCK}, got x {x.dtype} {tuple(x.shape)} on "
                         f"{x.device.type}, {type(w).__name__} {tuple(w.shape)} group_size={w.group_size}; "
                         "use minillm.quant.weight's *_linear_ref instead")
    N, K = w.shape
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = x2.new_empty((x2.shape[0], N))
    lib, bf16, s = _lib(target), x.dtype == torch.bfloat16, w.scales.contiguous()
    if isinstance(w, Int8Weight):
        lib.q8_gemm_prefill(w.qweight.contiguous().data_ptr(), s.data_ptr(), scale_format(w), x2.data_ptr(),
                            bf16, y.data_ptr(), x2.shape[0], N, K, w.group_size)
    else:
        lib.q4_gemm_prefill(w.packed.contiguous().data_ptr(), s.data_ptr(), _mins_ptr(w.mins),
                            scale_format(w), x2.data_ptr(), bf16, y.data_ptr(), x2.shape[0], N, K,
                            w.group_size)
    return y.view(*x.shape[:-1], N)


def block_prefill_round(x: Tensor, target: str | None = None) -> tuple[Tensor, Tensor]:
    """``block_prefill_linear``'s rounding of x alone: x [M, K] fp32/bf16 (K a multiple of 32) -> (codes int8 [M, K],
    steps dx fp32 [M, K / 32]), to compare with ``q8_activation_ref`` (xhat = codes · dx, bit for bit)."""
    M, K = x.shape
    if K % BLOCK or x.dtype not in _DTYPES:
        raise ValueError(f"x must be fp32/bf16 [M, K] with K a multiple of {BLOCK}, got {x.dtype} {tuple(x.shape)}")
    x2 = x.contiguous()
    codes, dx = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // BLOCK)
    _lib(target).q8_prefill_round(x2.data_ptr(), x.dtype == torch.bfloat16, M, K, codes.data_ptr(), dx.data_ptr())
    return codes, dx


# ---------------------------------------------------------------- W8A8 (csrc/quant.c w8a8_gemm)
def w8a8_supports(x: Tensor, w8: Int8Weight, input_scale: Tensor | None = None) -> bool:
    """Whether ``w8a8_linear(x, w8, input_scale)`` can run natively: CPU fp32 x (any number of rows), a per-channel
    ``Int8Weight`` on CPU, an fp32 CPU ``input_scale`` or None, no autograd, library built."""
    q, s = w8.qweight, w8.scales
    return (x.device.type == "cpu" and x.dtype == torch.float32 and q.device.type == "cpu"
            and s.device.type == "cpu" and w8.group_size == q.shape[1] and x.shape[-1] == q.shape[1]
            and (input_scale is None or (input_scale.device.type == "cpu" and input_scale.dtype == torch.float32))
            and not (torch.is_grad_enabled() and x.requires_grad) and available())


def w8a8_linear(x: Tensor, w8: Int8Weight, input_scale: Tensor | None = None, bias: Tensor | None = None,
                target: str | None = None) -> Tensor:
    """x [..., K] fp32 @ w8.T (+ bias) -> [..., N] fp32, W8A8: x rounded to int8 per token (``input_scale`` None)
    or with the static per-tensor scale, an int8 × int8 -> int32 GEMM (VNNI / AVX2 / plain C, cache-blocked for
    many rows) and the scales in its epilogue.  The same bits as ``quant.activation.w8a8_linear_int_mm`` (the
    integer sums are exact, the epilogue is its acc · (sx · sw) then + bias); reference ``w8a8_linear_ref``.
    Cost: N·K weight bytes read once per call, M·K activation bytes once per block of weight rows."""
    q, s = w8.qweight, w8.scales
    N, K = q.shape
    if not w8a8_supports(x, w8, input_scale) or _lib(target) is None:
        raise ValueError("the native W8A8 GEMM needs CPU fp32 x [..., K], a per-channel Int8Weight [N, K] on CPU "
                         "and an fp32 input_scale or None; use quant.activation.w8a8_linear_int_mm instead")
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = x2.new_empty((x2.shape[0], N))
    sc = None if input_scale is None else input_scale.contiguous()
    _lib(target).w8a8_gemm(q.contiguous().data_ptr(), s.contiguous().data_ptr(), scale_format(w8),
                           None if sc is None else sc.data_ptr(), x2.data_ptr(), y.data_ptr(), x2.shape[0], N, K)
    if bias is not None:
        y = y + bias.float()
    return y.view(*x.shape[:-1], N)


def w8a8_quantize(x: Tensor, input_scale: Tensor | None = None, target: str | None = None) -> tuple[Tensor, Tensor]:
    """The native kernel's activation rounding alone: x [M, K] fp32 -> (codes int8 [M, K], scales fp32 [M, 1]),
    to compare with ``quant.activation.quantize_activation_int8`` (its reference)."""
    x2 = x.float().contiguous()
    M, K = x2.shape
    codes, scales = torch.empty(M, K, dtype=torch.int8), torch.empty(M, 1)
    sc = None if input_scale is None else input_scale.float().contiguous()
    _lib(target).w8a8_quantize(x2.data_ptr(), None if sc is None else sc.data_ptr(), M, K, codes.data_ptr(),
                               scales.data_ptr())
    return codes, scales
