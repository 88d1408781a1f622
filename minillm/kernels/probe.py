"""A quick probe of this machine's matmul rate, for questions such as "is bf16 emulated here?".

The loader asks it once per process before warning that bf16 is slow on this CPU; ``minillm.perf.hardware``
builds its sustained per-dtype peaks from it.  Lives in the core because the loader needs it, and the core never
imports ``minillm.perf``.
"""

from __future__ import annotations

import math
import time

import torch

from minillm.dtypes import dtype_name, torch_dtype


def matmul_flops(dtype: str | torch.dtype, n: int = 256, device: str | torch.device = "cpu",
                 repeats: int = 3) -> float:
    """FLOP/s of one n×n @ n×n matmul in ``dtype`` on ``device``: the fastest of ``repeats`` calls after a warm-up.

    A small probe (n=256 is 34 MFLOP, quick even where bf16 is emulated) for questions such as "is bf16 slow
    here?"; ``minillm.perf.hardware.measure_device`` reports the sustained peaks. "tf32" is fp32 storage with
    tensor-core matmuls."""
    if n < 1 or repeats < 1:
        raise ValueError(f"n and repeats must be >= 1, got n={n}, repeats={repeats}")
    device = str(torch.device(device))
    name = dtype_name(dtype)
    a, b = (torch.randn(n, n, device=device).to(torch_dtype(name)) for _ in range(2))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")  # tf32 = fp32 on tensor cores
    try:
        torch.matmul(a, b)  # warm-up: kernel selection, first-touch of the output
        best = math.inf
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            torch.matmul(a, b)
            sync()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_float32_matmul_precision(before)
    return 2 * n**3 / max(best, 1e-9)
