"""Kernels: fast paths with a plain PyTorch reference each, chosen in one place (``select.py``).

- ``cpu/native``: native CPU kernels (C, compiled on first use): decode GEMV (reference ``F.linear``), RMSNorm,
  decode and paged decode attention.
- ``flash_attention``: FlashAttention-2 style prefill (tiled, online softmax, causal, GQA);
  Triton kernel in ``triton/flash.py``, reference ``minillm.kernels.reference.grouped_attention``.
- ``decode_attention``: flash-decoding (KV length split across programs, partial softmaxes merged exactly);
  Triton kernel in ``triton/decode.py``, reference ``minillm.kernels.reference.decode_attention``.
- ``paged_decode_attention``: the same over a paged KV cache addressed through block tables;
  Triton kernel in ``triton/paged_decode.py``, reference ``minillm.kernels.reference.paged_decode_attention_ref``.

The three attention functions below validate their inputs (same checks whichever ``impl`` runs) and run what
``select.resolve`` picks for ``impl`` (the vocabulary of ``select.CHOICES``): ``"auto"`` runs Triton on CUDA, the
native kernel on CPU (fp32/bf16 decode, when the C library built) and the PyTorch reference elsewhere;
``"triton"`` forces the kernel (on CPU it needs ``TRITON_INTERPRET=1`` set before the kernel modules are imported);
``"native"`` the native CPU kernel where one exists (prefill: SDPA over query tiles, ``cpu/prefill.py``);
``"torch"`` the reference.
Importing ``minillm`` or this package never imports triton: the kernel modules load on first use.

Why the kernel files are ``triton/flash.py`` and not ``flash_attention.py``: importing a submodule binds it as an
attribute of its package, so a module ``kernels/flash_attention.py`` would replace the function
``kernels.flash_attention`` the first time anyone imported the module.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.kernels.select import check_choice, implementation, resolve, triton_available
from minillm.kernels.validate import check_decode, check_paged, check_prefill


def use_triton(impl: str, device: torch.device) -> bool:
    """Whether ``impl`` runs the Triton attention kernels for tensors on ``device`` (else native or reference)."""
    check_choice(impl, "impl")
    return resolve(impl, "prefill_attention", device, torch.float32).impl == "triton"


# ---------------------------------------------------------------------------------------------- public functions
def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, sm_scale: float | None = None,
                    impl: str = "auto") -> Tensor:
    """Prefill attention. q [B, H_q, L, D], k/v [B, H_kv, S, D] (H_q % H_kv == 0) -> [B, H_q, L, D].

    ``causal``: the L queries are the last L of the S positions (query i sees keys j ≤ S - L + i), as in
    ``grouped_attention(causal=True)``; needs L ≤ S.  ``sm_scale`` defaults to D**-0.5.
    """
    check_choice(impl, "impl")
    check_prefill(q, k, v, causal)
    fn = implementation(impl, "prefill_attention", q.device, q.dtype)
    return fn(q, k, v, causal=causal, sm_scale=sm_scale)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor, *, sm_scale: float | None = None,
                     impl: str = "auto") -> Tensor:
    """One query per sequence over its first ``seq_lens[b]`` cached keys (flash-decoding on GPU).

    q [B, H_q, D], k/v [B, H_kv, S_max, D], seq_lens [B] int (1 ≤ seq_lens ≤ S_max) -> [B, H_q, D].
    """
    check_choice(impl, "impl")
    check_decode(q, k, v, seq_lens)
    return implementation(impl, "decode_attention", q.device, q.dtype)(q, k, v, seq_lens, sm_scale=sm_scale)


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                           sm_scale: float | None = None, impl: str = "auto") -> Tensor:
    """Decode attention over a paged KV cache: logical block j of sequence b is physical block block_tables[b, j].

    q [B, H_q, D]; k_cache/v_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int (1 ≤ seq_lens ≤ max_blocks·block_size) -> [B, H_q, D].
    """
    check_choice(impl, "impl")
    check_paged(q, k_cache, v_cache, block_tables, seq_lens)
    fn = implementation(impl, "paged_decode_attention", q.device, q.dtype)
    return fn(q, k_cache, v_cache, block_tables, seq_lens, sm_scale=sm_scale)


__all__ = ["decode_attention", "flash_attention", "paged_decode_attention", "triton_available", "use_triton"]
