"""The fused native decode library (``csrc/decode.c``): its build, its loader and the C structs it reads.

``decode_stack`` (fp32 activations) and ``decode_stack_bf16`` (bf16 activations, bf16 weights) run a whole decoder
stack for a batch of rows in one call — (add +) RMSNorm, qkv, RoPE, K/V to their paged slots, paged attention,
o_proj, add + RMSNorm, gate_up, SiLU·mul, down, the final norm, optionally the LM head — with the per-layer native
kernels of ``native.c`` and ``quant.c`` (``#include``d, so the library is rebuilt when any of the three changes).
``linear_stack`` and ``stack_read`` run a list of GEMVs, or only read their bytes, for benchmarks.  The engine's
runner that drives the steps is ``engine/native_runner.py``.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from minillm.kernels.cpu import native
from minillm.kernels.cpu.native import _cpu_key, cache_dir

MAX_ROWS = 32  # rows per call: native.c's GEMV tiles and the engine's decode batches (max_num_seqs default 32)
_CSRC = Path(__file__).parent / "csrc"
_SRC = _CSRC / "decode.c"
_INCLUDED = ("quant.c", "native.c")  # decode.c #includes these: part of the cache key
_KINDS = {"fp32": 0, "int8": 1, "int4": 2, "w8a8": 3, "bf16": 4, "q6k": 5}

i64, vp = ctypes.c_int64, ctypes.c_void_p


class LinearT(ctypes.Structure):
    """csrc/decode.c ``linear_t``: kind, scale_fmt (``quant.scale_format``), N, K, G, then weight, scales, mins, bias
    pointers."""

    _fields_ = [("kind", i64), ("scale_fmt", i64), ("N", i64), ("K", i64), ("G", i64),
                ("w", vp), ("scales", vp), ("mins", vp), ("bias", vp)]


class LayerT(ctypes.Structure):
    """csrc/decode.c ``layer_t``: two norm weights, four linears, the layer's K and V caches (the activation
    dtype's)."""

    _fields_ = [("input_norm", vp), ("post_norm", vp), ("qkv", LinearT), ("o", LinearT), ("gate_up", LinearT),
                ("down", LinearT), ("k_cache", vp), ("v_cache", vp)]




def _source_digest() -> str:
    """decode.c and the files it includes: a change to any of them is a new library."""
    return native.source_digest(_SRC, *(_CSRC / name for name in _INCLUDED))


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None where it cannot be built (no C compiler,
    ``MINILLM_DISABLE_NATIVE``)."""
    if os.environ.get("MINILLM_DISABLE_NATIVE"):
        return None
    path = cache_dir() / f"decode-{_source_digest()}-{_cpu_key()}.so"
    try:
        if not path.exists():
            native._compile(path, _SRC)  # native.c's compiler, flags and OpenMP fallback
        lib = ctypes.CDLL(str(path))  # after torch: its libgomp is the one torch loaded
    except (OSError, RuntimeError) as e:
        import warnings

        warnings.warn(f"minillm: fused native decode unavailable ({e}); using the per-layer path", stacklevel=2)
        return None
    p64, p32 = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
    lib.decode_scratch_floats.argtypes = [i64] * 6
    lib.decode_scratch_floats.restype = i64
    for name in ("decode_stack", "decode_stack_bf16"):
        getattr(lib, name).argtypes = [ctypes.POINTER(LayerT), i64, vp, vp, vp, vp, p64, p64, p32, p32] + [i64] * 8 \
            + [ctypes.c_float, ctypes.c_float, ctypes.POINTER(LinearT), vp, vp, vp]
        getattr(lib, name).restype = None
    lib.linear_stack.argtypes = [ctypes.POINTER(LinearT), i64, ctypes.POINTER(vp), ctypes.POINTER(vp), i64, i64]
    lib.linear_stack.restype = None
    lib.stack_read.argtypes = [ctypes.POINTER(LinearT), i64]
    lib.stack_read.restype = ctypes.c_uint64
    return lib


def available() -> bool:
    """Whether the fused decode library is built and loadable here (it needs a C compiler)."""
    return library() is not None


def weight_struct(w, bias: Tensor | None, keep: list[Tensor], *, w8a8: bool = False,
                  input_scale: Tensor | None = None) -> LinearT:
    """The ``linear_t`` of a weight: an fp32 or bf16 [N, K] tensor, an ``Int8Weight``, ``Int4Weight`` or ``Q6KWeight``
    (contiguous, on CPU), and an optional bias [N] (bf16 with a bf16 weight, else fp32); the tensors it points at are
    appended to ``keep``.  A bf16 weight is for ``decode_stack_bf16`` only (bf16 activations), every other kind for
    ``decode_stack`` and ``linear_stack`` (fp32 activations).  ``w8a8``: a per-channel
    ``Int8Weight`` whose activations are rounded to int8 too (``layers.linear.W8A8Linear``), per token, or with
    ``input_scale`` (a 0-dim fp32 tensor: the static scale), which the struct carries in its ``mins`` slot."""
    from minillm.kernels.cpu.quant import scale_format
    from minillm.quant.weight import Int4Weight, Int8Weight, Q6KWeight

    if w8a8:
        if not isinstance(w, Int8Weight) or w.group_size != w.shape[1]:
            raise ValueError("w8a8=True needs a per-channel Int8Weight (group_size = K)")
        N, K = w.shape
        scale = None if input_scale is None else input_scale.detach().float().contiguous()
        bias = None if bias is None else bias.detach().contiguous()
        keep += [t for t in (w.qweight, w.scales, scale, bias) if t is not None]
        ptr = [None if t is None else t.data_ptr() for t in (w.qweight, w.scales, scale, bias)]
        return LinearT(_KINDS["w8a8"], scale_format(w), N, K, K, *ptr)
    if isinstance(w, Tensor):
        if w.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a dense weight must be fp32 or bf16, got {w.dtype}")
        kind, (N, K) = "fp32" if w.dtype == torch.float32 else "bf16", w.shape
        tensors, G, fmt = (w.detach(), None, None), K, 0  # dense: no scales
    elif isinstance(w, Q6KWeight):  # the super-blocks hold their scales
        kind, (N, K), tensors, G, fmt = "q6k", w.shape, (w.blocks, None, None), w.group_size, 0
    else:
        kind = "int4" if isinstance(w, Int4Weight) else "int8" if isinstance(w, Int8Weight) else None
        if kind is None:
            raise ValueError(f"not an fp32/bf16 tensor, Int8Weight, Int4Weight or Q6KWeight: {type(w).__name__}")
        N, K = w.shape
        tensors = (w.packed, w.scales, w.mins) if kind == "int4" else (w.qweight, w.scales, None)
        G, fmt = w.group_size, scale_format(w)
    bias = None if bias is None else bias.detach().contiguous()
    keep += [t for t in (*tensors, bias) if t is not None]
    ptr = [None if t is None else t.data_ptr() for t in (*tensors, bias)]
    return LinearT(_KINDS[kind], fmt, N, K, G, *ptr)
