"""Kernels: fast paths with a plain PyTorch reference each.

- ``cpu_gemv``: a native (C, compiled on first use) decode GEMV for CPUs; reference ``F.linear``.
- ``flash_attention``: FlashAttention-2 style prefill (tiled, online softmax, causal, GQA);
  Triton kernel in ``triton_flash_attention.py``, reference ``minillm.attention.grouped_attention``.
- ``decode_attention``: flash-decoding (KV length split across programs, partial softmaxes merged exactly);
  Triton kernel in ``triton_decode_attention.py``, reference ``minillm.attention.decode_attention``.
- ``paged_decode_attention``: the same over a paged KV cache addressed through block tables;
  Triton kernel in ``triton_paged_decode_attention.py``, reference ``minillm.attention.paged_decode_attention_ref``.
- ``bench.bench_attention``: kernel vs SDPA timings in GB/s and TFLOP/s.

The three attention functions below validate their inputs (same checks whichever ``impl`` runs) and dispatch:
``impl="auto"`` runs Triton on CUDA and the PyTorch reference elsewhere; ``"triton"`` forces the kernel (on CPU it
needs ``TRITON_INTERPRET=1`` set before the kernel modules are imported); ``"torch"`` forces the reference.
Importing ``minillm`` or this package never imports triton: the kernel modules load on first use.

Why the kernel files are named ``triton_*.py`` rather than after the functions: importing a submodule binds it as
an attribute of its package, so a module ``kernels/flash_attention.py`` would replace the function
``kernels.flash_attention`` the first time anyone imported the module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch
from torch import Tensor

from .. import attention as _ref

IMPLS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it is only in the ``gpu``/``dev`` extras)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(impl: str, device: torch.device) -> bool:
    """Resolve ``impl`` for tensors on ``device``: True to run the Triton kernel, False for the reference."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError("impl='triton' needs the triton package (pip install 'minillm[gpu]')")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"impl='triton' on {device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before minillm's Triton kernels are imported (or use impl='auto'/'torch', or CUDA tensors)")
    return True


def _kernel_module(name: str):
    return importlib.import_module(f".{name}", __name__)


# ---------------------------------------------------------------------------------------------- input validation
def _check_common(q: Tensor, *others: Tensor) -> None:
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"attention needs fp16, bf16 or fp32 tensors, got {q.dtype}")
    for t in others:
        if t.dtype != q.dtype:
            raise ValueError(f"dtype mismatch: q is {q.dtype}, k/v are {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"device mismatch: q is on {q.device}, k/v on {t.device}")


def _check_seq_lens(seq_lens: Tensor, B: int, S_max: int, device: torch.device,
                    block_tables: Tensor | None = None, block_size: int = 1, num_blocks: int = 0) -> None:
    """Shape/dtype/device of seq_lens, then its values (and the block ids it reaches) in one host sync.

    Out-of-range lengths or block ids would make a kernel read outside its tensors, so they are checked, at the
    cost of one device→host sync per call on CUDA (~10 µs); skipped while capturing a CUDA graph (syncs are
    illegal there).
    """
    if seq_lens.shape != (B,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an int32/int64 tensor [B={B}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if seq_lens.device != device:
        raise ValueError(f"seq_lens is on {seq_lens.device} but q on {device}")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    bad_len = (seq_lens < 1) | (seq_lens > S_max)
    bad = bad_len.any()
    if block_tables is not None:
        n_used = (seq_lens.clamp(1, S_max) + block_size - 1) // block_size  # blocks each sequence reads
        used = torch.arange(block_tables.shape[1], device=device) < n_used[:, None]
        bad = bad | (used & ((block_tables < 0) | (block_tables >= num_blocks))).any()
    if bool(bad):  # the one sync
        if bool(bad_len.any()):
            raise ValueError(f"seq_lens must lie in [1, {S_max}], got {seq_lens.tolist()}")
        raise ValueError(f"block_tables point outside the cache's {num_blocks} blocks")


def check_prefill(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[int, int, int, int, int, int]:
    """Validate flash_attention inputs; returns (B, H_q, H_kv, L, S, D)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"need q [B, H_q, L, D] and k, v [B, H_kv, S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, Hq, L, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"H_q = {Hq} must be a multiple of H_kv = {Hkv}")
    if min(B, L, S, D) < 1:
        raise ValueError(f"empty attention: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and L > S:
        raise ValueError(f"causal attention puts the L = {L} queries at the last positions of S = {S} keys: need L ≤ S")
    _check_common(q, k, v)
    return B, Hq, Hkv, L, S, D


def check_decode(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor) -> tuple[int, int, int, int, int]:
    """Validate decode_attention inputs; returns (B, H_q, H_kv, S_max, D)."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"need q [B, H_q, D] and k, v [B, H_kv, S_max, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, S_max, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"H_q = {Hq} must be a multiple of H_kv = {Hkv}")
    if min(B, S_max, D) < 1:
        raise ValueError(f"empty attention: q {tuple(q.shape)}, k {tuple(k.shape)}")
    _check_common(q, k, v)
    _check_seq_lens(seq_lens, B, S_max, q.device)
    return B, Hq, Hkv, S_max, D


def check_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                seq_lens: Tensor) -> tuple[int, int, int, int, int]:
    """Validate paged_decode_attention inputs; returns (B, H_q, H_kv, block_size, D)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"need q [B, H_q, D] and k_cache, v_cache [num_blocks, block_size, H_kv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has D = {D}, the cache D = {Dk}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"H_q = {Hq} must be a multiple of H_kv = {Hkv}")
    if min(B, num_blocks, block_size, D) < 1:
        raise ValueError(f"empty attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be int32 [B={B}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables is on {block_tables.device} but q on {q.device}")
    _check_common(q, k_cache, v_cache)
    _check_seq_lens(seq_lens, B, block_tables.shape[1] * block_size, q.device, block_tables, block_size, num_blocks)
    return B, Hq, Hkv, block_size, D


# ---------------------------------------------------------------------------------------------- public functions
def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, sm_scale: float | None = None,
                    impl: str = "auto") -> Tensor:
    """Prefill attention. q [B, H_q, L, D], k/v [B, H_kv, S, D] (H_q % H_kv == 0) -> [B, H_q, L, D].

    ``causal``: the L queries are the last L of the S positions (query i sees keys j ≤ S - L + i), as in
    ``grouped_attention(causal=True)``; needs L ≤ S.  ``sm_scale`` defaults to D**-0.5.
    """
    check_prefill(q, k, v, causal)
    if use_triton(impl, q.device):
        return _kernel_module("triton_flash_attention").flash_attention_triton(q, k, v, causal=causal,
                                                                               sm_scale=sm_scale)
    return _ref.sdpa_attention(q, k, v, causal=causal, scale=sm_scale)  # fused; same answer as grouped_attention


def decode_attention(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor, *, sm_scale: float | None = None,
                     impl: str = "auto") -> Tensor:
    """One query per sequence over its first ``seq_lens[b]`` cached keys (flash-decoding on GPU).

    q [B, H_q, D], k/v [B, H_kv, S_max, D], seq_lens [B] int (1 ≤ seq_lens ≤ S_max) -> [B, H_q, D].
    """
    check_decode(q, k, v, seq_lens)
    if use_triton(impl, q.device):
        return _kernel_module("triton_decode_attention").decode_attention_triton(q, k, v, seq_lens, sm_scale=sm_scale)
    return _ref.decode_attention(q, k, v, seq_lens, scale=sm_scale)


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                           sm_scale: float | None = None, impl: str = "auto") -> Tensor:
    """Decode attention over a paged KV cache: logical block j of sequence b is physical block block_tables[b, j].

    q [B, H_q, D]; k_cache/v_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int (1 ≤ seq_lens ≤ max_blocks·block_size) -> [B, H_q, D].
    """
    check_paged(q, k_cache, v_cache, block_tables, seq_lens)
    if use_triton(impl, q.device):
        mod = _kernel_module("triton_paged_decode_attention")
        return mod.paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, sm_scale=sm_scale)
    return _ref.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=sm_scale)


def bench_attention(device: str | torch.device | None = None, **kwargs) -> list[dict]:
    """Kernels vs SDPA in GB/s and TFLOP/s; see ``minillm.kernels.bench.bench_attention`` for the options."""
    from .bench import bench_attention as run

    return run(device, **kwargs)


__all__ = ["bench_attention", "decode_attention", "flash_attention", "paged_decode_attention", "triton_available",
           "use_triton"]
