"""Attention kernel benchmark: Triton kernels next to SDPA, in roofline units.  ``python -m minillm bench attention``.

Decode is bandwidth bound (≈ 1 FLOP per byte of K/V at GQA group 4), so it reports GB/s of K/V read:
bytes = 2 (K and V) · B · H_kv · S · D · element size, over the measured time — compare with the GPU's HBM
bandwidth (H100 SXM: 3.35 TB/s).  Prefill is compute bound, so it reports TFLOP/s: 4 · B · H_q · D · (number of
(query, key) pairs, about L·S/2 causal) — compare with the dense bf16 tensor-core peak (H100 SXM: 989 TFLOP/s).
On CUDA timings come from ``triton.testing.do_bench`` (median, L2 flushed between runs); on CPU only the PyTorch
paths run (time.perf_counter, median), because Triton on CPU is an interpreter whose timings mean nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm.kernels import decode_attention, flash_attention, paged_decode_attention
from minillm.kernels.reference import grouped_attention


def _time_ms(device: torch.device, fn: Callable[..., object], *args, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(lambda: fn(*args, **kwargs), return_mode="median")
    fn(*args, **kwargs)  # warm-up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _paged(k: torch.Tensor, block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, H_kv, S, D] -> (cache [num_blocks, block_size, H_kv, D], block_tables [B, S / block_size]), shuffled."""
    B, Hkv, S, D = k.shape
    n = S // block_size
    perm = torch.randperm(B * n, device=k.device)
    cache = torch.empty(B * n, block_size, Hkv, D, dtype=k.dtype, device=k.device)
    cache[perm] = k.view(B, Hkv, n, block_size, D).permute(0, 2, 3, 1, 4).reshape(B * n, block_size, Hkv, D)
    return cache, perm.view(B, n).to(torch.int32)


def _row(op, impl, device, dtype, B, L, S, Hq, Hkv, D, ms, sdpa_ms=None) -> dict:
    elt = torch.finfo(dtype).bits // 8
    pairs = L * S if op != "prefill" else L * (S - L) + L * (L + 1) // 2  # causal (query, key) pairs
    return {"op": op, "impl": impl, "device": device.type, "dtype": str(dtype).removeprefix("torch."), "B": B,
            "L": L, "S": S, "H_q": Hq, "H_kv": Hkv, "D": D, "ms": _sig(ms),
            "GB/s": _sig(2 * B * Hkv * S * D * elt / ms / 1e6),  # K/V bytes read / time
            "TFLOP/s": _sig(4 * B * Hq * D * pairs / ms / 1e9),
            "speedup_vs_sdpa": _sig(sdpa_ms / ms) if sdpa_ms else None}


def _sig(x: float) -> float:
    return float(f"{x:.3g}")  # 3 significant digits: timings are not more precise than that


def bench_attention(device: str | torch.device | None = None, *, batch_sizes: tuple[int, ...] | None = None,
                    seq_lens: tuple[int, ...] | None = None, H_q: int = 32, H_kv: int = 8, D: int = 128,
                    dtype: torch.dtype | None = None, verbose: bool = True) -> list[dict]:
    """Time decode (contiguous and paged) and causal prefill attention; return one dict per measurement.

    Defaults: CUDA — bf16, B ∈ {1, 8}, S ∈ {1k, 8k, 32k} (prefill with B = 1, L = S); CPU — fp32,
    B ∈ {1, 8}, S ∈ {256, 1024}, the PyTorch paths only.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
    batch_sizes = batch_sizes or (1, 8)
    seq_lens = seq_lens or ((1024, 8192, 32768) if gpu else (256, 1024))
    impl = "auto" if gpu else "torch"  # "auto" = Triton on CUDA
    name = "triton" if gpu else "torch-ref"
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for B in batch_sizes:
        for S in seq_lens:
            q = torch.randn(B, H_q, D, generator=g, device=device, dtype=dtype)
            k, v = (torch.randn(B, H_kv, S, D, generator=g, device=device, dtype=dtype) for _ in range(2))
            lens = torch.full((B,), S, dtype=torch.int32, device=device)
            sdpa_ms = _time_ms(device, F.scaled_dot_product_attention, q[:, :, None], k, v, enable_gqa=True)
            rows.append(_row("decode", "sdpa", device, dtype, B, 1, S, H_q, H_kv, D, sdpa_ms))
            ms = _time_ms(device, decode_attention, q, k, v, lens, impl=impl)
            rows.append(_row("decode", name, device, dtype, B, 1, S, H_q, H_kv, D, ms, sdpa_ms))
            kc, tables = _paged(k)
            vc, _ = _paged(v)
            ms = _time_ms(device, paged_decode_attention, q, kc, vc, tables, lens, impl=impl)
            rows.append(_row("paged_decode", name, device, dtype, B, 1, S, H_q, H_kv, D, ms, sdpa_ms))
    for S in seq_lens:
        q = torch.randn(1, H_q, S, D, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(1, H_kv, S, D, generator=g, device=device, dtype=dtype) for _ in range(2))
        sdpa_ms = _time_ms(device, F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
        rows.append(_row("prefill", "sdpa", device, dtype, 1, S, S, H_q, H_kv, D, sdpa_ms))
        ms = _time_ms(device, flash_attention, q, k, v, causal=True, impl=impl)
        rows.append(_row("prefill", "triton" if gpu else "torch-sdpa", device, dtype, 1, S, S, H_q, H_kv, D, ms,
                         sdpa_ms))
        if not gpu:  # the naive reference materialises the [L, S] scores: the cost FlashAttention removes
            ms = _time_ms(device, grouped_attention, q, k, v, causal=True)
            rows.append(_row("prefill", "torch-naive", device, dtype, 1, S, S, H_q, H_kv, D, ms, sdpa_ms))
    if verbose:
        print_table(rows)
        if not gpu:
            print("CPU: only the PyTorch paths were timed; Triton kernel timings need a CUDA GPU.")
    return rows


def print_table(rows: list[dict]) -> None:
    """Print rows as an aligned text table."""
    cols = ["op", "impl", "dtype", "B", "L", "S", "ms", "GB/s", "TFLOP/s", "speedup_vs_sdpa"]
    cells = [[str(r[c]) if r[c] is not None else "" for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for x in cells:
        print("  ".join(s.rjust(w) for s, w in zip(x, widths, strict=True)))
