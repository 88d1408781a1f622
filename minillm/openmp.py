"""How the OpenMP threads of torch and of minillm's native kernels wait between parallel regions.

A decode step is a few hundred short parallel regions (a GEMV, a norm, an attention call each). Between two of
them libgomp's idle threads spin by default — up to ``GOMP_SPINCOUNT`` polls — betting that the next region starts
within microseconds. On cores nothing else wants that bet is free. On a busy machine (a laptop with a browser open,
the test suite beside the engine, two processes on two cores) it is not: a spinning thread holds a core while the
thread that still has work waits for one, so each region's barrier can cost a scheduler time slice instead of
microseconds, and the whole step slows by far more than the CPU share the neighbours take.

So minillm caps the spin: ``GOMP_SPINCOUNT`` = ``SPIN_COUNT`` polls, then the thread sleeps on a futex. libgomp
reads the setting once, when torch loads it, so this module must run before the first ``import torch``: minillm's
``__init__`` imports it first, and importing it applies the setting. It changes nothing when the user chose a policy
(``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set), when ``MINILLM_OMP_SPIN=default``, or when torch is already
imported (too late: the runtime has read its environment). It removes the variable again once the runtime has
loaded, so child processes — a llama.cpp or vLLM peer measured beside minillm — keep their own defaults.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = 10_000
"""Polls before an idle thread sleeps: a few microseconds of spinning (enough to catch the next region of a decode
step on an idle machine), against libgomp's default of 300,000 polls."""



def _apply() -> dict[str, str] | None:
    """Cap libgomp's spin for this process if nothing chose otherwise; returns what was set.  Imports torch (the
    runtime must load while the variable is set)."""
    chosen = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys()
    if chosen or "torch" in sys.modules or os.environ.get("MINILLM_OMP_SPIN", "") == "default":
        import torch  # noqa: F401  (the same import, with the environment as it is)

        return None
    setting = {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    os.environ.update(setting)
    try:
        import torch  # noqa: F401  (loads libgomp, which reads GOMP_SPINCOUNT now)
    finally:
        for key in setting:
            os.environ.pop(key, None)
    return setting


applied: dict[str, str] | None = _apply()
"""What was set in the environment while torch loaded (None: nothing — the user's choice, or too late)."""


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool: ``omp_pause_resource_all(omp_pause_soft)`` on the runtime torch
    loaded (its workers exit; a later parallel region in this thread starts a new pool).  Returns whether a runtime
    did so (False: none found that has the call, e.g. without /proc, or called inside a parallel region).

    Why: libgomp keeps a pool of workers for each thread that has run a parallel region, and once its threads
    outnumber the CPUs it cuts every idle worker's spin to 100 polls (its "throttled" spin) whatever
    ``GOMP_SPINCOUNT`` says.  A server builds its model in one thread (loading runs parallel regions) and steps it
    in another, its engine loop: on a 2-core host those are two pools, three workers, and every parallel region of
    every step then wakes its worker from a futex instead of finding it spinning.  The thread that built the engine
    calls this when it hands the engine over (``EngineLoop.start``), leaving the loop thread's pool alone."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return False
    names = ("libgomp", "libiomp5", "libomp")
    paths = {line.split()[-1] for line in maps.splitlines()
             if any(os.path.basename(line.split()[-1]).startswith(n) for n in names)}
    for path in sorted(paths):
        try:
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            pause = runtime.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(1) == 0:  # omp_pause_soft
            return True
    return False
