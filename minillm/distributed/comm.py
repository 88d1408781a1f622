"""Collectives over a ``ParallelContext``: each is the identity at world size 1, so a sharded model runs unchanged
in one process (and a test at TP=1 exercises the same code).

Costs (ring algorithms, p ranks, n bytes): all-reduce moves 2 (p − 1)/p · n bytes per rank (reduce-scatter then
all-gather); all-gather moves (p − 1)/p · n of the gathered result.  ``minillm.perf.tp_cost`` prices them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.distributed.parallel_state import ParallelContext


def all_reduce(x: Tensor, ctx: ParallelContext) -> Tensor:
    """The elementwise sum of every rank's ``x`` (same shape on all ranks), returned on every rank.

    Reduces ``x`` in place (callers pass a fresh partial sum: a row-parallel layer's own output) and returns it.
    """
    if ctx.world_size == 1:
        return x
    x = x.contiguous()
    ctx.group.allreduce([x]).wait()
    return x


def all_gather(x: Tensor, ctx: ParallelContext, dim: int = -1) -> Tensor:
    """Every rank's ``x`` (same shape on all ranks) concatenated along ``dim`` in rank order."""
    if ctx.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
    ctx.group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=dim)


def broadcast(x: Tensor, ctx: ParallelContext, src: int = 0) -> Tensor:
    """Rank ``src``'s ``x`` on every rank (the others pass a tensor of the same shape and dtype to receive into)."""
    if ctx.world_size == 1:
        return x
    x = x.contiguous()
    ctx.group.broadcast(x, src).wait()
    return x


def barrier(ctx: ParallelContext) -> None:
    """Wait until every rank arrives (a one-element all-reduce: works on every backend without a device hint)."""
    all_reduce(torch.zeros(1, device=ctx.device), ctx)


def send(x: Tensor, dst: int, ctx: ParallelContext):
    """Start sending ``x`` to rank ``dst`` (pipeline stages pass activations this way); -> the pending ``Work``.

    Non-blocking: the caller keeps ``x`` alive and calls ``.wait()`` before it ends (``wait_all``).  A blocking
    send could deadlock a pipeline whose last stage sends tokens back to the first while the first is still
    sending forward.  Point to point moves n bytes once, against 2 (p − 1)/p · n per rank for an all-reduce.
    """
    x = x.contiguous()
    return ctx.group.send([x], dst, 0)


def recv(shape: tuple[int, ...], dtype: torch.dtype, src: int, ctx: ParallelContext) -> Tensor:
    """Block until rank ``src``'s next ``send`` to this rank arrives; -> that tensor (``shape``, ``dtype``).

    Messages between two ranks arrive in the order they were sent, so sender and receiver agree on each message's
    shape by running the same schedule.
    """
    x = torch.empty(shape, dtype=dtype, device=ctx.device)
    ctx.group.recv([x], src, 0).wait()
    return x


def wait_all(works: list) -> None:
    """Wait for every pending ``send`` in ``works`` and empty the list."""
    for w in works:
        w.wait()
    works.clear()
