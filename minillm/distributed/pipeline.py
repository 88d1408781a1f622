"""Pipeline parallelism: the decoder's layers split over p processes, activations passed rank to rank.

    LLM(path, pipeline_parallel_size=2).generate(...)        # the usual way: stages start once, reused
    pp_generate(model, prompts, params, pipeline_parallel_size=2)   # one call: start, generate, shut down
    pp_forward(model, input_ids, positions, pipeline_parallel_size=2, num_microbatches=4)   # timed, for the bubble

Stage s holds layers [s·n/p, (s+1)·n/p) and *their* KV cache; stage 0 also the embedding, the last stage the final
norm and the LM head (``pp_driver.PipelineStage``).  A forward is a relay: stage 0 embeds and runs its layers,
sends the [2, B, L, hidden] activations (the layer output and the residual stream, see ``DecoderLayer``) to stage
1, and so on; the last stage runs the LM head.  Per hop only B × L × hidden × 2 values move — far less than tensor
parallelism's two all-reduces per layer — which is why pipelines span nodes and TP stays inside one.  Generation
runs the one ``LLMEngine`` on stage 0 over that relay (``pp_driver.PPDriver``: the last stage sends the logits
back, the engine samples), so it has every engine feature.

The price is idle time.  With one batch in flight, stage s waits for stages 0..s−1 and then the others wait for it:
p − 1 of every p stage-slots are empty.  GPipe (Huang et al. 2019) cuts the batch into m **micro-batches** that
follow each other down the pipe; with equal stage times t the run takes (m + p − 1) t, of which each stage works
m t, so the **bubble** — the idle share of the stages' time — is (p − 1) / (m + p − 1).  At decode the tokens of a
micro-batch come back to stage 0 only after a full trip, so m ≥ p micro-batches keep every stage busy.
``gpipe_schedule`` (exercise 10.3) computes the schedule for any stage times; ``pp_forward`` measures the real one
(every rank runs the same program, SPMD, so each message's shape is known everywhere).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from minillm.config import ModelConfig, ParallelConfig
from minillm.distributed import comm
from minillm.distributed.parallel_state import ParallelContext, default_backend
from minillm.distributed.pp_driver import PipelineStage
from minillm.distributed.worker import run_workers
from minillm.layers.parallel import stage_layers, valid_pp_sizes  # the sizes' home, re-exported
from minillm.models.llama import Transformer

__all__ = ["PipelineStage", "StageTiming", "bubble_fraction", "gpipe_bubble", "gpipe_schedule", "pp_forward",
           "pp_generate", "split_microbatches", "stage_forward", "stage_layers", "valid_pp_sizes"]

ModelSource = Transformer | str | os.PathLike | None


# ------------------------------------------------------------------------------------------- micro-batches
def split_microbatches(n: int, m: int) -> list[range]:
    """Rows 0..n−1 cut into ``min(m, n)`` contiguous micro-batches whose sizes differ by at most one."""
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    m = min(m, n)
    sizes = [n // m + (i < n % m) for i in range(m)]
    starts = [sum(sizes[:i]) for i in range(m)]
    return [range(s, s + k) for s, k in zip(starts, sizes, strict=True)]


# ------------------------------------------------------------------------------------------- the schedule on paper
def gpipe_schedule(stage_times: Sequence[Sequence[float]]) -> list[list[tuple[float, float]]]:
    """When each stage runs each micro-batch in a GPipe forward: ``stage_times[s][j]`` is stage s's compute time
    for micro-batch j (p stages × m micro-batches, seconds).  -> ``[s][j] = (start, end)``.

    Stage s handles micro-batches in order 0..m−1, one at a time, and cannot start micro-batch j before stage s−1
    has finished it (its activations are the input); stage 0 starts micro-batch 0 at t = 0.  Transfers are free.
    """
    ### BEGIN SOLUTION
    out: list[list[tuple[float, float]]] = []
    for s, times in enumerate(stage_times):
        row, free = [], 0.0  # free: when this stage finishes its previous micro-batch
        for j, t in enumerate(times):
            ready = out[s - 1][j][1] if s else 0.0  # the previous stage has produced micro-batch j
            start = max(free, ready)
            row.append((start, start + t))
            free = start + t
        out.append(row)
    return out
    ### END SOLUTION


def bubble_fraction(schedule: Sequence[Sequence[tuple[float, float]]]) -> float:
    """The idle share of the stages' time: 1 − Σ busy / (p × makespan), makespan = the last end."""
    p = len(schedule)
    busy = sum(end - start for row in schedule for start, end in row)
    makespan = max(end for row in schedule for _, end in row)
    return 1.0 - busy / (p * makespan)


def gpipe_bubble(p: int, m: int) -> float:
    """GPipe's bubble with equal stage times: (p − 1) / (m + p − 1)."""
    return (p - 1) / (m + p - 1)


# ------------------------------------------------------------------------------------------- messages
class _Links:
    """The activations a stage exchanges with its neighbours.  Sends are non-blocking; ``flush`` waits for them."""

    def __init__(self, ctx: ParallelContext):
        self.ctx, self.pending = ctx, []
        self.prev, self.next = ctx.rank - 1, ctx.rank + 1

    def send_next(self, x: Tensor) -> None:
        self.pending.append((comm.send(x, self.next, self.ctx), x))

    def recv_prev(self, shape, dtype) -> Tensor:
        return comm.recv(shape, dtype, self.prev, self.ctx)

    def flush(self) -> None:
        comm.wait_all([w for w, _ in self.pending])
        self.pending.clear()


# ------------------------------------------------------------------------------------------- the timed forward
@dataclasses.dataclass(frozen=True)
class StageTiming:
    """One stage's view of a timed pipelined forward: its compute time per micro-batch, the time it spent
    computing (``busy_s``) and from the common start to its last send (``wall_s``)."""

    rank: int
    compute_s: list[float]
    busy_s: float
    wall_s: float


@torch.inference_mode()
def stage_forward(ctx: ParallelContext, stage: PipelineStage, input_ids: Tensor, positions: Tensor,
                  num_microbatches: int, all_logits: bool = True) -> tuple[Tensor | None, StageTiming]:
    """One pipelined full causal forward (no cache) of input_ids, positions [B, L], the batch cut into micro-batches
    (GPipe's forward).  -> (fp32 logits [B, L, V] on the last stage, else None; this stage's timing).
    ``all_logits=False``: logits of the last position only, [B, 1, V], as a prefill needs — the LM head over every
    position (V × hidden per token) would make the last stage the slowest."""
    links, hidden_size = _Links(ctx), stage.config.hidden_size
    outs, compute = [], []
    comm.barrier(ctx)  # a common start: otherwise a stage's wall time includes the others' start-up
    t0 = time.perf_counter()
    for mb in split_microbatches(input_ids.shape[0], num_microbatches):
        ids, pos = input_ids[mb.start : mb.stop].to(stage.device), positions[mb.start : mb.stop].to(stage.device)
        inputs = ids if stage.is_first else links.recv_prev((2, *ids.shape, hidden_size), stage.dtype)
        t = time.perf_counter()
        out = stage(inputs, pos)
        if stage.is_last:
            out = stage.compute_logits(out if all_logits else out[:, -1:]).float()
        compute.append(time.perf_counter() - t)
        if stage.is_last:
            outs.append(out.cpu())
        else:
            links.send_next(out)
    links.flush()
    timing = StageTiming(ctx.rank, compute, sum(compute), time.perf_counter() - t0)
    return (torch.cat(outs) if stage.is_last else None), timing


# ------------------------------------------------------------------------------------------- spawning
def _stage(ctx: ParallelContext, source: ModelSource, dtype, kernels: str) -> PipelineStage:
    from minillm.distributed.executor import _full_model

    return PipelineStage(_full_model(source, ctx, dtype, kernels), ctx.rank, ctx.world_size)


def _forward_worker(ctx, source, input_ids, positions, num_microbatches, dtype, kernels):
    return stage_forward(ctx, _stage(ctx, source, dtype, kernels), input_ids, positions, num_microbatches)


def _config(source: ModelSource) -> ModelConfig:
    if isinstance(source, Transformer):
        return source.config
    from minillm.models.loader import load_config, resolve

    return load_config(resolve(source))


def pp_forward(model: ModelSource, input_ids: Tensor, positions: Tensor, pipeline_parallel_size: int = 2, *,
               num_microbatches: int = 1, dtype=None, kernels: str = "auto", device: str = "cpu",
               threads_per_worker: int | None = None) -> tuple[Tensor, list[StageTiming]]:
    """The full causal forward of ``model`` over ``pipeline_parallel_size`` processes: input_ids, positions [B, L]
    -> (fp32 logits [B, L, V] on CPU, each stage's ``StageTiming``).  ValueError for a size that does not divide
    the layers, before any process starts."""
    stage_layers(_config(model), pipeline_parallel_size, 0)
    results = run_workers(_forward_worker, pipeline_parallel_size,
                          (model, input_ids, positions, num_microbatches, dtype, kernels),
                          backend=default_backend(device), threads_per_worker=threads_per_worker)
    return results[-1][0], [t for _, t in results]


def pp_generate(model: ModelSource, prompts: Sequence, params=None, pipeline_parallel_size: int = 2, *,
                num_microbatches: int | None = None, dtype=None, kernels: str = "auto", device: str = "cpu",
                tokenizer=None, eos_token_ids: Sequence[int] | None = None, threads_per_worker: int | None = None,
                **engine_options) -> list:
    """``LLMEngine.generate`` with the layers split over ``pipeline_parallel_size`` processes (``PPDriver``), the
    stages started for this call and stopped after it; -> list[RequestOutput] in prompt order.
    (``LLM(..., pipeline_parallel_size=p)`` keeps them between calls.)

    Everything the engine supports: any policy (``engine_options``: ``EngineConfig`` fields), ``n`` > 1, stop
    strings (with a ``tokenizer``), seeds.  ``num_microbatches`` is accepted and has no effect: every engine step
    runs as one batch down the pipe (``pp_driver``'s docstring says what micro-batches within a step would take).
    ValueError for a size that does not divide the layers (naming the valid ones), before any process starts;
    ``WorkerError`` (a RuntimeError) when a stage dies.
    """
    from minillm.distributed.executor import driver_generate
    from minillm.distributed.pp_driver import PPDriver

    stage_layers(_config(model), pipeline_parallel_size, 0)

    def start(whole: Transformer) -> PPDriver:
        return PPDriver(whole, pipeline_parallel_size, threads_per_worker=threads_per_worker)

    return driver_generate(start, ParallelConfig(pipeline_parallel_size=pipeline_parallel_size), model, prompts,
                           params, dtype=dtype, kernels=kernels, device=device, tokenizer=tokenizer,
                           eos_token_ids=eos_token_ids, **engine_options)
