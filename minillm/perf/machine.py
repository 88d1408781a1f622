"""One roofline per machine: measured once (best of several runs), cached on disk, reused everywhere.

A measurement wobbles from run to run on a shared machine (another job, a cold cache, turbo states): measured per
notebook, the roof one decode is priced against can move a long way between two notebooks, and its MBU moves
with it though the decode did not change.
``machine_spec(device)`` measures ``runs`` times with ``measure_device`` and keeps each probe's best (the most a
machine did is what it can do; interference only slows it), stores the result under the cache directory, and
returns it from there on every later call, in every process: every notebook and benchmark prices its points
against the same roof, which says when it was measured (``MeasuredSpec.measured_at``).

- Cache directory: ``$MINILLM_CACHE_DIR`` (or ``$MINILLM_CACHE``) or ``~/.cache/minillm``; one JSON file per
  machine key under ``roofline/``.  The key is what changes the result: the device ("cpu", "cuda:0"), its name
  (CPU model and thread count, or GPU name) and torch's version.
- ``force=True`` (or ``python -m minillm roofline --remeasure``) measures again and replaces the file.
- A ``quick`` request is answered by any cached measurement; a full one only by a full one (it replaces a quick).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from minillm.perf.hardware import MeasuredSpec, _device_name_and_memory, _measure

CACHE_ENV = "MINILLM_CACHE_DIR"  # where the cache lives; tests point it at a temporary directory
FORMAT = 1  # bump when the stored fields change: older files are then measured again


def cache_dir() -> Path:
    """``$MINILLM_CACHE_DIR``, else ``$MINILLM_CACHE`` (the name the kernel and model caches read), else
    ``~/.cache/minillm``."""
    return Path(os.environ.get(CACHE_ENV) or os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm")


def machine_key(device: str | torch.device = "cpu") -> dict[str, str]:
    """What identifies a roofline: normalised device, its name (CPU model + threads, or GPU name), torch version."""
    device = str(torch.device(device))
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    name, _ = _device_name_and_memory(device)
    return {"device": device, "name": name, "torch": torch.__version__, "format": str(FORMAT)}


def cache_path(device: str | torch.device = "cpu") -> Path:
    """The file holding ``device``'s roofline: ``<cache_dir>/roofline/<readable name>-<hash of the key>.json``."""
    key = machine_key(device)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{key['device']} {key['name']}").strip("-")[:60]
    return cache_dir() / "roofline" / f"{slug}-{digest}.json"


def best_of(specs: list[MeasuredSpec]) -> MeasuredSpec:
    """Probe by probe, the highest rate any of ``specs`` (runs on one machine) reached."""
    if not specs:
        raise ValueError("best_of needs at least one measurement")

    def top(values: list) -> Any:
        if isinstance(values[0], Mapping):
            return {k: top([v[k] for v in values if k in v]) for k in values[0]}
        return max(values)

    first = specs[0]
    rates = {name: top([getattr(s, name) for s in specs])
             for name in ("peak_flops", "memory_bandwidth", "read_bandwidth", "read_by_impl", "copy_bandwidth",
                          "gemv_bandwidth")}
    method = {**first.method, "runs": len(specs),
              "statistic": f"best of {len(specs)} runs, each the median of its repeats"}
    return MeasuredSpec(**{**first.to_dict(), **rates, "method": method})


def _load(path: Path, quick: bool) -> MeasuredSpec | None:
    """The cached spec at ``path`` if it answers a ``quick`` (or full) request, else None."""
    try:
        stored = json.loads(path.read_text())
        spec = MeasuredSpec.from_dict(stored["spec"])
    except (OSError, ValueError, KeyError, TypeError):  # absent, torn or from an older format: measure again
        return None
    return spec if quick or not spec.method.get("quick", False) else None


def machine_spec(device: str | torch.device = "cpu", *, quick: bool = False, force: bool = False, runs: int = 3,
                 verbose: bool = False) -> MeasuredSpec:
    """This machine's measured roofline on ``device``, from the cache when there is one (module docstring).

    Otherwise (or with ``force``) ``runs`` measurements (``measure_device(device, quick)``, ~10 s each on a CPU,
    ~1 s quick) are combined by ``best_of``, stamped with ``measured_at`` (UTC) and stored.  ``verbose`` prints
    one line saying which machine, when it was measured, and how to measure again.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    path = cache_path(device)
    spec = None if force else _load(path, quick)
    if spec is None:
        device_name = machine_key(device)["device"]
        measured = best_of([_measure.__wrapped__(device_name, bool(quick)) for _ in range(runs)])
        when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        stored = {"key": machine_key(device), "spec": {**measured.to_dict(), "measured_at": when}}
        text = json.dumps(stored, indent=1) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # write then rename: a concurrent reader never sees half
        tmp.write_text(text)
        os.replace(tmp, path)
        spec = MeasuredSpec.from_dict(json.loads(text)["spec"])  # as later calls will read it back
    if verbose:
        print(describe(spec, path))
    return spec


def describe(spec: MeasuredSpec, path: Path | None = None) -> str:
    """One line: the machine, its roof, when it was measured and how to measure it again."""
    where = f" (cached in {path})" if path else ""
    kind = "quick " if spec.method.get("quick") else ""
    return (f"roofline of {spec.name} [{spec.device}]: {spec.memory_bandwidth / 1e9:.1f} GB/s, "
            f"{kind}measured {spec.measured_at or 'at an unknown time'}{where}; "
            "`python -m minillm roofline --remeasure` measures again")
