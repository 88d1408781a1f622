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


def _cpu_seconds() -> tuple[float, float]:
    """(CPU-seconds every CPU of the host has spent running anything since boot, this process's CPU-seconds):
    /proc/stat's first line (user, nice, system, irq, softirq — not idle, iowait or a hypervisor's steal) and
    ``os.times()`` (every thread of ours).  Both count in clock ticks (10 ms)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    if fields[0] != "cpu":
        raise ValueError("/proc/stat does not start with the all-CPU line")
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    ours = os.times()
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), ours.user + ours.system


class OtherCpuUse:
    """Each call: how many CPUs other processes kept busy, on average, since the previous call — the host's
    CPU-seconds less this process's over the wall time between the two, rounded (a neighbour that ran half the
    time or more is a CPU).  The first call (no interval yet) and a host without /proc say 0.

    An average, not a snapshot: a thread count chosen from the processes running at one instant follows whatever
    runs at that instant, and the instant a decode step starts is when a streaming client reads the tokens the
    previous step sent — a benchmark client idle 95 % of the time took a thread from half of a served run's decode
    steps when the count was read then.  Our own threads (OpenMP workers, a server's event loop) are ours whenever
    they run.  ``read`` and ``clock`` are injectable for tests."""

    def __init__(self, read=_cpu_seconds, clock=None):
        import time

        self.read, self.clock = read, clock or time.monotonic
        self._last: tuple[float, float, float] | None = None

    def __call__(self) -> int:
        try:
            host, own = self.read()
        except (OSError, ValueError, IndexError):
            return 0
        now = self.clock()
        last, self._last = self._last, (now, host, own)
        if last is None or now <= last[0]:
            return 0
        share = ((host - last[1]) - (own - last[2])) / (now - last[0])
        return max(0, int(share + 0.5))


class DecodeThreads:
    """How many threads a decode step should use beside what else is running: the CPUs this process may use less
    the ones other work keeps busy, at least 1, at most the configured count.

    Why: a decode step is hundreds of short parallel regions, each ending at a barrier.  When another process holds a
    core, the thread sharing it is descheduled for whole time slices and every barrier waits for it; with one busy
    neighbour on two cores one thread on the free core decodes faster than two threads, and with two neighbours, one
    thread still beats two.  ``busy`` (default: an ``OtherCpuUse``, the CPUs others used on average since its last
    call) is sampled at most every ``interval_s`` and the smallest of the last ``window`` samples counts, so a process
    that runs for a moment does not take a thread away.  Decode results do not depend
    on the thread count (every row and head is computed by one thread, whatever the split)."""

    def __init__(self, interval_s: float = 0.25, window: int = 4, busy=None, clock=None, cpus: int | None = None):
        import collections
        import time

        self.interval_s, self.clock = interval_s, clock or time.monotonic
        self.busy = busy if busy is not None else OtherCpuUse()
        self.samples = collections.deque(maxlen=window)
        online = os.cpu_count() or 1
        mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else online
        # the host's CPU time covers every CPU: it says how busy ours are only when ours are all of them (a
        # process pinned to some cores, or a cpuset container, keeps its configured count)
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
