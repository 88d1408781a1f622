"""Input checks of the public attention kernels: the same whichever implementation runs."""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
