"""Quick probes of this machine: its matmul rate, for questions such as "is bf16 emulated here?", and the memory
available now.

The loader asks ``matmul_flops`` once per process before warning that bf16 is slow on this CPU;
``minillm.perf.hardware`` builds its sustained per-dtype peaks from it.  ``available_memory`` bounds the oneDNN
packed weights (``kernels.cpu.onednn``) and decides which CPU peers a benchmark loads together
(``perf.bench.cpu_peers``).  Both live in the core because the core needs them, and the core never imports
``minillm.perf``.
"""

from __future__ import annotations

import math
import os
import time

import torch

from minillm.dtypes import dtype_name, torch_dtype

MEMINFO = "/proc/meminfo"  # Linux's memory counters, in kB ("MemAvailable:   12345678 kB")


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


def available_memory() -> int:
    """Bytes a new allocation can take now without swapping: Linux's ``MemAvailable`` (free pages plus the page
    cache the kernel can reclaim).  Where the kernel does not report it (not Linux, or the line is missing or
    unreadable), the free physical pages (``SC_AVPHYS_PAGES``) — less than ``MemAvailable``, since reclaimable cache
    is not counted — and 0 where the OS reports neither (no ``sysconf``, as on Windows).

    Always an under- rather than an over-estimate, which suits its callers: too low costs a weight left unpacked or
    a benchmark peer skipped (with the figure in its reason); too high could load more than fits and end in the
    OOM killer.  Reads one small file: cheap enough to call per decision."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # no /proc (not Linux), or a line this parser does not know
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # the name is unknown here (macOS), or no sysconf (Windows)
        return 0
