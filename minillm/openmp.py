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

    for runtime in _runtimes():
        try:
            pause = runtime.omp_pause_resource_all
        except AttributeError:
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(1) == 0:  # omp_pause_soft
            return True
    return False


def _runtimes() -> list:
    """The OpenMP runtimes loaded in this process (libgomp, libiomp5, libomp), found in /proc/self/maps and opened
    without loading anything new (RTLD_NOLOAD); [] without /proc."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return []
    names = ("libgomp", "libiomp5", "libomp")
    paths = {line.split()[-1] for line in maps.splitlines()
             if any(os.path.basename(line.split()[-1]).startswith(n) for n in names)}
    out = []
    for path in sorted(paths):
        try:
            out.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            continue
    return out


class num_threads:
    """``with num_threads(n):`` parallel regions the calling thread opens use ``n`` threads, then the previous
    setting again (``omp_set_num_threads`` on every loaded OpenMP runtime: torch's and the native kernels' share
    libgomp).  A no-op when ``n`` is already the setting or no runtime is found."""

    def __init__(self, n: int):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_threads needs an int >= 1 (the threads a parallel region uses), got {n!r}")
        self.n, self._restore = n, []

    def __enter__(self):
        import ctypes

        for rt in _omp_setters():
            before = rt.omp_get_max_threads()
            if before != self.n:
                rt.omp_set_num_threads(ctypes.c_int(self.n))
                self._restore.append((rt, before))
        return self

    def __exit__(self, *exc):
        import ctypes

        for rt, before in self._restore:
            rt.omp_set_num_threads(ctypes.c_int(before))
        self._restore = []
        return False


_SETTERS: list | None = None


def _omp_setters() -> list:
    global _SETTERS
    if _SETTERS is None:
        _SETTERS = [rt for rt in _runtimes()
                    if hasattr(rt, "omp_set_num_threads") and hasattr(rt, "omp_get_max_threads")]
    return _SETTERS


def _own_running() -> int:
    """This process's runnable threads now (/proc/self/task/*/stat state R)."""
    own = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                own += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:
            continue
    return own


def _procs_running() -> int:
    """The kernel's count of runnable threads on every CPU now (/proc/stat procs_running)."""
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("procs_running"))


def busy_cpus(running=_procs_running, own_running=_own_running) -> int:
    """CPUs that other work is running on now: the kernel's count of runnable threads less this process's own
    runnable threads (its OpenMP workers spin between regions).  Ours are counted just before and just after the
    kernel's count and the larger taken: a worker that stops spinning (or wakes) while the files are read would
    otherwise be counted as another process's, and a quiet host's decode would drop a thread.  0 without /proc."""
    try:
        before = own_running()
        total = running()
        own = max(before, own_running())
    except (OSError, StopIteration, ValueError):
        return 0
    return max(0, total - own)


class DecodeThreads:
    """How many threads a decode step should use beside what else is running: the CPUs this process may use less
    the ones other work keeps busy, at least 1, at most the configured count.

    Why: a decode step is hundreds of short parallel regions, each ending at a barrier.  When another process holds a
    core, the thread sharing it is descheduled for whole time slices and every barrier waits for it; with one busy
    neighbour on two cores one thread on the free core decodes faster than two threads, and with two neighbours, one
    thread still beats two.  ``busy`` is sampled at most every ``interval_s`` and the smallest of the last ``window``
    samples counts, so a process that runs for a moment does not take a thread away.  Decode results do not depend
    on the thread count (every row and head is computed by one thread, whatever the split)."""

    def __init__(self, interval_s: float = 0.25, window: int = 4, busy=busy_cpus, clock=None, cpus: int | None = None):
        import collections
        import time

        self.interval_s, self.busy, self.clock = interval_s, busy, clock or time.monotonic
        self.samples = collections.deque(maxlen=window)
        online = os.cpu_count() or 1
        mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else online
        # the kernel's count of running threads covers every CPU: it says how busy ours are only when ours are all
        # of them (a process pinned to some cores, or a cpuset container, keeps its configured count)
        self.active = cpus is not None or mine == online
        self.cpus = cpus or mine
        self._last = None

    def threads(self, configured: int) -> int:
        """The thread count for the next step, given the configured one (``torch.get_num_threads()``)."""
        if not self.active:
            return configured
        now = self.clock()
        if self._last is None or now - self._last >= self.interval_s:
            self.samples.append(self.busy())
            self._last = now
        busy = min(self.samples) if self.samples else 0
        return max(1, min(configured, self.cpus - busy))
