"""Spawned worker processes: ``run_workers(fn, world_size, args)`` runs ``fn(ctx, *args)`` on every rank, once.

``run_workers`` is for one-shot SPMD runs (tests, benchmarks, the timed pipelined forward).  ``serve_steps`` is the
other kind: the loop of a persistent worker, which a driver (``driver.TPDriver``, ``pp_driver.PPDriver``) starts
once and sends each engine step to (``LLM(tensor_parallel_size=N)``, ``LLM(pipeline_parallel_size=N)``).

The launcher does what ``torchrun`` does, in-process: pick a free port on 127.0.0.1, spawn ``world_size`` processes
(``torch.multiprocessing``, the "spawn" start method: a fresh interpreter per rank, as CUDA requires), and let each
join the group (``init_parallel``: gloo on CPU, NCCL on CUDA).  The parent is not a rank; it collects the results.

Failure handling, so that nothing hangs:
- a worker that raises sends its traceback; the parent stops the other ranks (which would wait forever in their
  next collective) and raises ``WorkerError`` carrying that traceback;
- a worker that dies without a word (killed, segfault) is noticed by its exit code, with the same outcome;
- ``timeout_s`` bounds the whole run.
Each worker stays alive until the parent has read every result: tensors travel through shared memory, which the
sender must keep open until the receiver has them.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from minillm.distributed.parallel_state import BACKENDS, ParallelContext, init_parallel


class WorkerError(RuntimeError):
    """A worker process raised or died; the message holds its rank and traceback (or exit code)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; a tiny race with other processes remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, backend: str, threads: int, fn: Callable, args: tuple,
                 results, done) -> None:
    """One rank: join the group, run ``fn(ctx, *args)``, send ("ok", rank, value) or ("error", rank, traceback)."""
    import torch

    try:
        torch.set_num_threads(threads)
        ctx = init_parallel(rank, world_size, port=port, backend=backend)
        results.put(("ok", rank, fn(ctx, *args)))
    except BaseException:  # noqa: BLE001 — everything must reach the parent, KeyboardInterrupt included
        results.put(("error", rank, traceback.format_exc()))
    done.wait(timeout=600)  # keep shared-memory tensors alive until the parent has read them


def run_workers(fn: Callable[..., Any], world_size: int, args: tuple = (), *, backend: str = "gloo",
                threads_per_worker: int | None = None, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(ctx, *args)`` in ``world_size`` fresh processes, one per rank; -> their return values, by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).  ``threads_per_worker``: torch intra-op
    threads per rank (default: the CPU cores divided among the ranks, at least 1 — oversubscribing cores makes
    every collective wait on the slowest rank).  Raises ``WorkerError`` if any rank raises or dies,
    ``TimeoutError`` after ``timeout_s``; every process is stopped before this returns or raises.
    """
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // world_size)
    mpc = mp.get_context("spawn")
    results, done, port = mpc.Queue(), mpc.Event(), free_port()
    procs = [mpc.Process(target=_worker_main, args=(r, world_size, port, backend, threads, fn, args, results, done),
                         daemon=True, name=f"minillm-tp-rank{r}") for r in range(world_size)]
    for p in procs:
        p.start()
    ok = False
    try:
        out = _collect(procs, results, timeout_s)
        ok = True
        return out
    finally:  # after a failure the other ranks are stuck in a collective: stop them at once
        done.set()
        _stop(procs, grace_s=5.0 if ok else 0.0)


def _collect(procs: list, results, timeout_s: float) -> list[Any]:
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(procs):
        try:
            status, rank, value = results.get(timeout=0.2)
        except queue.Empty:
            status, rank, value = "waiting", None, None
        if status == "error":  # often a peer's death seen as a broken connection: name the dead rank first
            raise WorkerError(_dead_ranks(procs, rank) + f"worker rank {rank} raised:\n{value}")
        if status == "ok":
            out[rank] = value
            continue
        for r, p in enumerate(procs):  # a rank that died without a word (killed, segfault) never sends one
            if r not in out and not p.is_alive():
                raise WorkerError(f"worker rank {r} died with exit code {p.exitcode} before returning a result")
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not finish within {timeout_s:.0f} s (ranks done: {sorted(out)})")
    return [out[r] for r in range(len(procs))]


def _dead_ranks(procs: list, reporter: int, wait_s: float = 1.0) -> str:
    """'worker rank r died with exit code c; ' for every other rank that exits within ``wait_s`` with an error."""
    deadline = time.monotonic() + wait_s
    for r, p in enumerate(procs):
        if r != reporter:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    return "".join(f"worker rank {r} died with exit code {p.exitcode}; " for r, p in enumerate(procs)
                   if r != reporter and p.exitcode not in (None, 0))


def _stop(procs: list, grace_s: float = 5.0) -> None:
    """Join each process; terminate (then kill) the ones still running after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()


def serve_steps(rank: int, world_size: int, port: int, backend: str, threads: int, model, conn, timeout_s: float,
                piece: Callable, run: Callable) -> None:
    """A persistent worker (``driver.StepDriver`` spawns it): join the group, keep its part of ``model``
    (``piece(model, ctx)``: a shard, a stage), say ("ready", pid) on ``conn``, then serve the driver's messages
    until "stop".

    Messages (kind, value): "step" (header) -> receive the broadcast, run it (``run(part, kv, step, ctx)``);
    "kv" (kwargs) -> build the K/V cache from the part's config, answer "ok"; "forward" (shape) -> receive ids and
    positions, run the part's whole forward (tensor parallel); "ping" -> "pong".
    Any exception is sent back as ("error", traceback) and ends the process with exit code 1; a closed pipe (the
    driver is gone) ends it quietly.
    """
    import torch

    from minillm.distributed.comm import broadcast
    from minillm.distributed.step import payload_size, unpack_step
    from minillm.kv.paged_cache import make_paged_kv_cache

    try:
        torch.set_num_threads(threads)
        ctx = init_parallel(rank, world_size, port=port, backend=backend, timeout_s=timeout_s)
        part = piece(model if ctx.device.type == "cpu" else model.to(ctx.device), ctx)
        del model  # the whole model's shared memory stays the driver's; this process keeps only its part
        conn.send(("ready", os.getpid()))
        kv = None
        with torch.inference_mode():
            while True:
                kind, value = conn.recv()
                if kind == "stop":  # leave at once: tearing down the gloo group and torch at exit takes seconds
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)
                if kind == "step":
                    payload = torch.empty(payload_size(value), dtype=torch.long, device=ctx.device)
                    run(part, kv, unpack_step(value, broadcast(payload, ctx)), ctx)
                elif kind == "kv":
                    kv = None  # free the old cache before the new one is allocated
                    kv = make_paged_kv_cache(part.config, device=ctx.device, **value)
                    conn.send(("ok", None))
                elif kind == "forward":
                    ids = broadcast(torch.empty(value, dtype=torch.long, device=ctx.device), ctx)
                    part(ids[0], ids[1])
                elif kind == "ping":
                    conn.send(("pong", None))
    except (EOFError, BrokenPipeError):
        return  # the driver is gone: nobody to report to
    except BaseException:  # noqa: BLE001 — everything must reach the driver, KeyboardInterrupt included
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)  # skip interpreter teardown: a half-finished collective can block it


def local_context() -> ParallelContext:
    """World size 1: the context of a model that is not sharded (every collective is the identity)."""
    return ParallelContext()
