"""Kernels: fast paths with a plain PyTorch reference each.

- ``cpu/native``: native CPU kernels (C, compiled on first use): decode GEMV (reference ``F.linear``), RMSNorm,
  decode and paged decode attention.
- ``flash_attention``: FlashAttention-2 style prefill (tiled, online softmax, causal, GQA);
  Triton kernel in ``triton/flash.py``, reference ``minillm.kernels.reference.grouped_attention``.
- ``decode_attention``: flash-decoding (KV length split across programs, partial softmaxes merged exactly);
  Triton kernel in ``triton/decode.py``, reference ``minillm.kernels.reference.decode_attention``.
- ``paged_decode_attention``: the same over a paged KV cache addressed through block tables;
  Triton kernel in ``triton/paged_decode.py``, reference ``minillm.kernels.reference.paged_decode_attention_ref``.

The three attention functions below validate their inputs (same checks whichever ``impl`` runs) and dispatch:
``impl="auto"`` runs Triton on CUDA and the PyTorch reference elsewhere; ``"triton"`` forces the kernel (on CPU it
needs ``TRITON_INTERPRET=1`` set before the kernel modules are imported); ``"torch"`` forces the reference.
Importing ``minillm`` or this package never imports triton: the kernel modules load on first use.

Why the kernel files are ``triton/flash.py`` and not ``flash_attention.py``: importing a submodule binds it as an
attribute of its package, so a module ``kernels/flash_attention.py`` would replace the function
``kernels.flash_attention`` the first time anyone imported the module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch
from torch import Tensor

from minillm.kernels import reference as _ref
from minillm.kernels.validate import check_decode, check_paged, check_prefill

IMPLS = ("auto", "triton", "torch")


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


# ---------------------------------------------------------------------------------------------- public functions
def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, sm_scale: float | None = None,
                    impl: str = "auto") -> Tensor:
    """Prefill attention. q [B, H_q, L, D], k/v [B, H_kv, S, D] (H_q % H_kv == 0) -> [B, H_q, L, D].

    ``causal``: the L queries are the last L of the S positions (query i sees keys j ≤ S - L + i), as in
    ``grouped_attention(causal=True)``; needs L ≤ S.  ``sm_scale`` defaults to D**-0.5.
    """
    check_prefill(q, k, v, causal)
    if use_triton(impl, q.device):
        return _kernel_module("triton.flash").flash_attention_triton(q, k, v, causal=causal,
                                                                               sm_scale=sm_scale)
    return _ref.sdpa_attention(q, k, v, causal=causal, scale=sm_scale)  # fused; same answer as grouped_attention


def decode_attention(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor, *, sm_scale: float | None = None,
                     impl: str = "auto") -> Tensor:
    """One query per sequence over its first ``seq_lens[b]`` cached keys (flash-decoding on GPU).

    q [B, H_q, D], k/v [B, H_kv, S_max, D], seq_lens [B] int (1 ≤ seq_lens ≤ S_max) -> [B, H_q, D].
    """
    check_decode(q, k, v, seq_lens)
    if use_triton(impl, q.device):
        return _kernel_module("triton.decode").decode_attention_triton(q, k, v, seq_lens, sm_scale=sm_scale)
    return _ref.decode_attention(q, k, v, seq_lens, scale=sm_scale)


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                           sm_scale: float | None = None, impl: str = "auto") -> Tensor:
    """Decode attention over a paged KV cache: logical block j of sequence b is physical block block_tables[b, j].

    q [B, H_q, D]; k_cache/v_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int (1 ≤ seq_lens ≤ max_blocks·block_size) -> [B, H_q, D].
    """
    check_paged(q, k_cache, v_cache, block_tables, seq_lens)
    if use_triton(impl, q.device):
        mod = _kernel_module("triton.paged_decode")
        return mod.paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, sm_scale=sm_scale)
    return _ref.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=sm_scale)


__all__ = ["decode_attention", "flash_attention", "paged_decode_attention", "triton_available",
           "use_triton"]
