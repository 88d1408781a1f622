"""Replica processes: N ordinary ``python -m minillm serve`` processes on loopback ports, for the router.

Each replica is the single-process server, unchanged, started with ``subprocess`` on ``127.0.0.1`` and a free port,
its own copy of the model and ``cores // N`` torch threads (``OMP_NUM_THREADS``; a replica's matmuls then do not
fight the others' for cores).  The front process owns them: it waits until every ``/health`` answers, forwards
SIGTERM to them when it stops (each drains its in-flight requests as a lone server does), and kills what has not
exited by a deadline.  On Linux a replica also gets SIGTERM if the front dies without stopping it
(``PR_SET_PDEATHSIG``), so a ``kill -9`` of the front leaves no orphaned model in memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class ReplicaProcess:
    """One replica: its position, the process and where it listens."""

    index: int
    proc: subprocess.Popen
    url: str

    @property
    def pid(self) -> int:
        return self.proc.pid


def cpu_budget() -> int:
    """The cores the front may hand out: ``OMP_NUM_THREADS`` when set (the user's cap), else the cores this process
    may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_replica(replicas: int, cores: int | None = None) -> int:
    """``cores // replicas``, at least one: N replicas share the cores rather than oversubscribe them."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return max(1, (cpu_budget() if cores is None else cores) // replicas)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now.  (The replica binds it a moment later; another process could take it in
    between — the replica then fails to start and the front says so.)"""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


API_KEY_ENV = "MINILLM_API_KEY"  # where a server finds its key when no --api-key / --api-key-file is given


def start_replicas(serve_args: Sequence[str], replicas: int, *, threads: int | None = None,
                   api_key: str | None = None) -> list[ReplicaProcess]:
    """Start ``replicas`` processes of ``python -m minillm serve *serve_args --host 127.0.0.1 --port P``.

    ``serve_args``: the model and engine options, as the single server takes them (no ``--host``/``--port``);
    ``threads``: torch threads per replica (default ``threads_per_replica``).  Replicas log warnings only (the
    router logs the requests) to the front's stdout/stderr; ``api_key`` is passed in ``MINILLM_API_KEY`` (not in
    argv, which any user may read).  Returns at once: see ``wait_ready``.
    """
    threads = threads or threads_per_replica(replicas)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.pop(API_KEY_ENV, None)
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    out: list[ReplicaProcess] = []
    try:
        for i in range(replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "minillm", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning"]
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            out.append(ReplicaProcess(i, proc, f"http://127.0.0.1:{port}"))
    except BaseException:
        stop_replicas(out, timeout_s=5)
        raise
    return out


def wait_ready(replicas: Sequence[ReplicaProcess], timeout_s: float = 600.0) -> None:
    """Block until every replica's ``/health`` is 200.  A replica that exits first, or a deadline passed, raises
    ``RuntimeError`` (the caller stops the rest)."""
    import httpx

    waiting = list(replicas)
    deadline = time.monotonic() + timeout_s
    while waiting:
        for r in list(waiting):
            if r.proc.poll() is not None:
                raise RuntimeError(f"replica {r.index} (pid {r.pid}) exited with code {r.proc.returncode} before "
                                   f"it was ready; its output is above")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(r.url + "/health", timeout=2).status_code == 200:
                    waiting.remove(r)
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"replicas {[r.index for r in waiting]} were not ready after {timeout_s:.0f} s")
        if waiting:
            time.sleep(0.2)


def stop_replicas(replicas: Sequence[ReplicaProcess], timeout_s: float) -> None:
    """SIGTERM every replica still running, wait up to ``timeout_s`` in all, then SIGKILL (and reap) the rest."""
    for r in replicas:
        if r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"[replica {r.index} (pid {r.pid}) did not exit in {timeout_s:.0f} s: killed]", file=sys.stderr)
            r.proc.kill()
            r.proc.wait()
