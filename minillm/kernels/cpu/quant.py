"""Native int8 / int4 (Q4_1 layout) GEMV and small-batch GEMM on CPU, compiled on first use, called by ctypes.

``int8_linear(x, w8)`` and ``int4_linear(x, w4)`` have the meaning of ``minillm.quant.weight.int8_linear_ref`` /
``int4_linear_ref`` (dequantize, then ``F.linear``) for x [..., K] with 1..``MAX_ROWS`` rows in fp32 or bf16, and
equal them up to fp32 summation order.  The packed weights are read as stored — no float copy is made.  The C
source is ``csrc/quant.c``; the library is cached beside ``native.c``'s (same directory and CPU key).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from minillm.kernels.cpu.native import _cpu_key, cache_dir
from minillm.quant.weight import Int4Weight, Int8Weight

MAX_ROWS = 8  # csrc/quant.c's QMAX_ROWS: decode batches; larger batches dequantize once and use a GEMM
_SRC = Path(__file__).parent / "csrc" / "quant.c"
_DTYPES = (torch.float32, torch.bfloat16)


def _compile(src: Path, out: Path) -> None:
    # Same compiler and flags as native.py's build (which is hard-wired to native.c); OpenMP when available.
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    march = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else ["-mcpu=native"]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    errors = []
    for extra in (march + ["-fopenmp"], march, []):
        r = subprocess.run([cc, "-O3", "-ffast-math", "-shared", "-fPIC", str(src), *extra, "-o", tmp, "-lm"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            os.replace(tmp, out)  # atomic: a concurrent process sees the old file or the new one
            return
        errors.append(r.stderr.strip()[-500:])
    os.unlink(tmp)
    raise RuntimeError(f"could not compile {src.name}:\n" + "\n".join(errors))


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("MINILLM_DISABLE_NATIVE"):
        return None
    digest = hashlib.sha256(_SRC.read_bytes()).hexdigest()[:12]
    path = cache_dir() / f"quant-{digest}-{_cpu_key()}.so"
    try:
        if not path.exists():
            _compile(_SRC, path)
        lib = ctypes.CDLL(str(path))  # after torch: its libgomp is the one torch already loaded
    except (OSError, RuntimeError) as e:
        import warnings

        warnings.warn(f"minillm: native quantized GEMV unavailable ({e}); use the dequantizing reference",
                      stacklevel=2)
        return None
    i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.q4_gemm.argtypes = [vp, vp, vp, c_int, vp, c_int, vp, i64, i64, i64, i64]
    lib.q4_gemm.restype = None
    lib.q8_gemm.argtypes = [vp, vp, c_int, vp, c_int, vp, i64, i64, i64, i64]
    lib.q8_gemm.restype = None
    lib.quant_built_with_openmp.restype = c_int
    return lib


def available() -> bool:
    """True when the native quantized kernels are built and loadable here."""
    return _lib() is not None


def supports(x: Tensor, w: Int8Weight | Int4Weight) -> bool:
    """Whether ``x @ w.T`` can take the native path: CPU, fp32/bf16 x with ≤ MAX_ROWS rows, library built."""
    tensors = (w.qweight, w.scales) if isinstance(w, Int8Weight) else (w.packed, w.scales, w.mins)
    return (x.device.type == "cpu" and all(t.device.type == "cpu" for t in tensors) and x.dtype in _DTYPES
            and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and not (torch.is_grad_enabled() and x.requires_grad)
            and available())


def _prepare(x: Tensor, w, N: int, K: int) -> tuple[Tensor, Tensor]:
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K={K}")
    if not supports(x, w):
        raise ValueError(f"the native quantized GEMV needs CPU fp32/bf16 x with at most {MAX_ROWS} rows and a "
                         "compiled library; use minillm.quant.weight's *_linear_ref instead")
    x2 = x.reshape(-1, K).contiguous()
    return x2, torch.empty(x2.shape[0], N, dtype=x.dtype)


def int8_linear(x: Tensor, w8: Int8Weight) -> Tensor:
    """x [..., K] (≤ MAX_ROWS rows, fp32/bf16) @ dequant(w8).T -> [..., N] in x's dtype."""
    N, K = w8.shape
    x2, y = _prepare(x, w8, N, K)
    _lib().q8_gemm(w8.qweight.contiguous().data_ptr(), w8.scales.contiguous().data_ptr(),
                   int(w8.scales.dtype == torch.float16), x2.data_ptr(), int(x.dtype == torch.bfloat16),
                   y.data_ptr(), x2.shape[0], N, K, w8.group_size)
    return y.view(*x.shape[:-1], N)


def int4_linear(x: Tensor, w4: Int4Weight) -> Tensor:
    """x [..., K] (≤ MAX_ROWS rows, fp32/bf16) @ dequant(w4).T -> [..., N] in x's dtype (Q4_1 blocks)."""
    N, K = w4.shape
    x2, y = _prepare(x, w4, N, K)
    _lib().q4_gemm(w4.packed.contiguous().data_ptr(), w4.scales.contiguous().data_ptr(),
                   w4.mins.contiguous().data_ptr(), int(w4.scales.dtype == torch.float16), x2.data_ptr(),
                   int(x.dtype == torch.bfloat16), y.data_ptr(), x2.shape[0], N, K, w4.group_size)
    return y.view(*x.shape[:-1], N)
