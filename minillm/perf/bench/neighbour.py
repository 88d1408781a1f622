"""A noisy neighbour: a separate process that loads the same cores while a benchmark measures, so a result can be
read as "on a quiet host" or "beside a memory-heavy / compute-heavy process" (a laptop is never quiet).

Kinds (``NEIGHBOURS``):

- ``"none"``: nothing is started;
- ``"copy"``: a STREAM-like copy loop, ``np.copyto(b, a)`` over two arrays of ``nbytes`` each (default 256 MB:
  far beyond any L3, so every pass streams from DRAM and competes for its bandwidth);
- ``"compute"``: a busy loop on scalars (one core's cycles, no memory traffic).

The process is one single-threaded Python (numpy only, no torch: it starts in well under a second); it inherits the
benchmark's CPU affinity, so it runs on the same cores.  It writes ``ready`` once its arrays are touched; on SIGTERM
it writes ``{"passes": n, "seconds": s}`` and exits, and ``Neighbour.stop`` turns that into the record a benchmark
keeps in its JSON (for a copy, the GB/s it moved: 2 · nbytes per pass, read and written).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys

NEIGHBOURS = ("none", "copy", "compute")
COPY_BYTES = 256 << 20  # per array: two of them, far beyond any L3

_WORKER = r"""
import json, signal, sys, time
import numpy as np
kind, nbytes = sys.argv[1], int(sys.argv[2])
stop = False
def _stop(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, _stop)
if kind == "copy":
    a = np.ones(nbytes // 8)
    b = np.zeros_like(a)  # written by the first pass: every page mapped before "ready"
    np.copyto(b, a)
print("ready", flush=True)
passes, start = 0, time.perf_counter()
x = 1.0
while not stop:
    if kind == "copy":
        np.copyto(b, a)
    else:
        for _ in range(10000):
            x = x * 1.0000001 + 1e-9
    passes += 1
print(json.dumps({"passes": passes, "seconds": time.perf_counter() - start}), flush=True)
"""


def check_neighbour(kind: str) -> None:
    """ValueError naming ``kind`` and the known ones unless it is one of ``NEIGHBOURS``."""
    if kind not in NEIGHBOURS:
        raise ValueError(f"--neighbour must be one of {', '.join(NEIGHBOURS)}, got {kind!r}")


def describe_neighbour(record: dict) -> str:
    """``Neighbour.record`` in words for a table's heading: "none", "copy (2 × 256 MB, <its rate> GB/s)", "compute"."""
    if record["kind"] == "copy":
        moved = f", {record['gb_s']:.1f} GB/s" if "gb_s" in record else ""
        return f"copy (2 × {record['bytes'] // 2 >> 20} MB{moved})"
    return record["kind"]


class Neighbour:
    """The neighbour process as a context manager: ``with Neighbour("copy") as n: ...measure...``; ``n.record``
    is then ``{"kind", "bytes", "passes", "seconds", "gb_s"}`` (``{"kind": "none"}`` for none)."""

    def __init__(self, kind: str = "none", nbytes: int = COPY_BYTES, start_timeout: float = 60.0):
        check_neighbour(kind)
        if nbytes < 8:
            raise ValueError(f"neighbour bytes must be >= 8, got {nbytes}")
        self.kind, self.nbytes, self.start_timeout = kind, nbytes, start_timeout
        self.proc: subprocess.Popen | None = None
        self.record: dict = {"kind": kind}

    def start(self) -> Neighbour:
        """Start the process and wait for its ``ready`` (its arrays allocated and touched); RuntimeError with its
        last words if it ends first or takes longer than ``start_timeout`` seconds."""
        if self.kind == "none":
            return self
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, self.kind, str(self.nbytes)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        readable, _, _ = select.select([self.proc.stdout], [], [], self.start_timeout)
        if readable and self.proc.stdout.readline().strip() == "ready":
            self.record |= {"pid": self.proc.pid, "bytes": 2 * self.nbytes if self.kind == "copy" else 0}
            return self
        err = self._kill()
        raise RuntimeError(f"the {self.kind} neighbour did not start: {err or 'timed out'}")

    def stop(self) -> dict:
        """SIGTERM, then the neighbour's own count of passes and seconds into ``record`` (with GB/s for a copy)."""
        if self.proc is None:
            return self.record
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=30)
            stats = json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            self._kill()
            stats = {}
        self.proc = None
        self.record |= stats
        if self.kind == "copy" and stats.get("seconds"):
            self.record["gb_s"] = 2 * self.nbytes * stats["passes"] / stats["seconds"] / 1e9
        return self.record

    def _kill(self) -> str:
        """Kill the process; its stderr's last line."""
        proc, self.proc = self.proc, None
        if proc is None:
            return ""
        proc.kill()
        _, err = proc.communicate()
        return (err or "").strip().splitlines()[-1] if (err or "").strip() else ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Neighbour:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
