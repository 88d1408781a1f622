"""Pipeline parallelism: the decoder's layers split over p processes, activations passed rank to rank.

    pp_generate(model, prompts, params, pipeline_parallel_size=2, num_microbatches=4)  # -> list[RequestOutput]

Stage s holds layers [s·n/p, (s+1)·n/p) and *their* KV cache; stage 0 also the embedding, the last stage the final
norm and the LM head.  A forward is a relay: stage 0 embeds and runs its layers, sends the [2, B, L, hidden]
activations (the layer output and the residual stream, see ``DecoderLayer``) to stage 1, and so on; the last stage
samples and sends the tokens back to stage 0 for the next step.  Per hop only B × L × hidden × 2 values move — far
less than tensor parallelism's two all-reduces per layer — which is why pipelines span nodes and TP stays inside one.

The price is idle time.  With one batch in flight, stage s waits for stages 0..s−1 and then the others wait for it:
p − 1 of every p stage-slots are empty.  GPipe (Huang et al. 2019) cuts the batch into m **micro-batches** that
follow each other down the pipe; with equal stage times t the run takes (m + p − 1) t, of which each stage works
m t, so the **bubble** — the idle share of the stages' time — is (p − 1) / (m + p − 1).  At decode the tokens of a
micro-batch come back to stage 0 only after a full trip, so m ≥ p micro-batches keep every stage busy.
``gpipe_schedule`` (exercise 10.3) computes the schedule for any stage times; ``pp_forward`` measures the real one.

Every rank runs the same program on the same prompts (SPMD, as ``executor.py``): the micro-batch split, the prompt
lengths and so each message's shape are known everywhere; the only thing decided on one rank that the others must
learn is that a micro-batch has finished (EOS), which travels as a one-element header before each activation.
Static batching inside a micro-batch (finished rows ride along until their micro-batch ends): simple, and what
continuous batching would remove.  Sampling happens on the last stage only, so seeded sampling needs no agreement.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from minillm.config import ModelConfig
from minillm.distributed import comm
from minillm.distributed.parallel_state import ParallelContext, default_backend
from minillm.distributed.worker import run_workers
from minillm.kernels.select import ops_for
from minillm.layers.parallel import stage_layers, valid_pp_sizes  # noqa: F401 — the sizes' home, re-exported
from minillm.models.llama import Transformer

ModelSource = Transformer | str | os.PathLike | None


# ------------------------------------------------------------------------------------------- sizes and stages
class PipelineStage(nn.Module):
    """Stage ``rank`` of ``pp``: its decoder layers (shared with ``model``, not copied), the embedding on the first
    stage, the final norm and LM head on the last.  ``config`` is the stage's own (``num_layers`` = its layers):
    a ``KVCache`` built from it holds only this stage's layers."""

    def __init__(self, model: Transformer, rank: int, pp: int):
        super().__init__()
        layers = stage_layers(model.config, pp, rank)
        self.rank, self.pp = rank, pp
        self.config = dataclasses.replace(model.config, num_layers=len(layers))
        self.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        self.embed_tokens = model.model.embed_tokens if self.is_first else None
        self.norm = model.model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.rotary_emb = model.model.rotary_emb
        self.kernels, self.dtype, self.device = model.kernels, model.dtype, model.device

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.pp - 1

    def forward(self, inputs: Tensor, positions: Tensor, cache=None) -> Tensor:
        """First stage: ids [B, L]; others: the previous stage's [2, B, L, hidden] (output, residual).
        -> [2, B, L, hidden] for the next stage, or on the last stage the final-normed hidden [B, L, hidden]."""
        ops = ops_for(self.kernels, self.device, self.dtype)
        if self.is_first:
            x, residual = self.embed_tokens(inputs), None
        else:
            x, residual = inputs[0], inputs[1]
        cos, sin = self.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.layers):  # i: the layer's index in this stage's cache
            x, residual = layer(x, residual, cos, sin, i, ops, cache)
        if self.is_last:
            return self.norm.add(x, residual, ops)[0]
        return torch.stack([x, residual])  # (2, B, L, hidden): one message per hop

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., hidden] -> [..., V] (last stage only)."""
        return self.lm_head(hidden, ops_for(self.kernels, self.device, self.dtype))


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
    """The messages a stage exchanges: forward to the next stage, tokens from the last stage back to the first.

    With one stage the loop-back is a local list, so the same schedule runs in one process (and is tested so).
    Sends are non-blocking; ``flush`` waits for them (once per step)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx, self.pending, self.local = ctx, [], []
        self.prev, self.next, self.last = ctx.rank - 1, ctx.rank + 1, ctx.world_size - 1

    def send_next(self, x: Tensor) -> None:
        self.pending.append((comm.send(x, self.next, self.ctx), x))

    def recv_prev(self, shape, dtype) -> Tensor:
        return comm.recv(shape, dtype, self.prev, self.ctx)

    def send_first(self, x: Tensor) -> None:
        if self.ctx.world_size == 1:
            self.local.append(x)
        else:
            self.pending.append((comm.send(x, 0, self.ctx), x))

    def recv_last(self, shape, dtype) -> Tensor:
        if self.ctx.world_size == 1:
            return self.local.pop(0)
        return comm.recv(shape, dtype, self.last, self.ctx)

    def flush(self) -> None:
        comm.wait_all([w for w, _ in self.pending])
        self.pending.clear()


# ------------------------------------------------------------------------------------------- one rank's loops
@torch.inference_mode()
def stage_generate(ctx: ParallelContext, stage: PipelineStage, prompts: list[list[int]], params: list,
                   num_microbatches: int, eos_ids: Sequence[int] = (), tokenizer=None) -> list | None:
    """This rank's part of pipelined generation (every rank calls it with the same arguments).

    Each step sends every live micro-batch down the pipe in order — step 0 its right-padded prompts (prefill),
    later steps the tokens the last stage sent back — so while the last stage samples micro-batch j, stage 0
    already runs micro-batch j + 1.  -> the ``RequestOutput``s on the last stage, None elsewhere.
    """
    from minillm.engine.simple import _append, _right_pad, _start
    from minillm.kv.contiguous import KVCache

    mbs = split_microbatches(len(prompts), num_microbatches)
    max_len = stage.config.max_position_embeddings
    caches, lasts = [], []
    for mb in mbs:
        cache_len = min(max_len, max(len(prompts[i]) + params[i].max_tokens for i in mb))
        caches.append(KVCache(stage.config, len(mb), cache_len, dtype=stage.dtype, device=stage.device,
                              kernels=stage.kernels))
        lasts.append(torch.tensor([len(prompts[i]) - 1 for i in mb], device=stage.device))
    seqs = _start(stage, prompts, params) if stage.is_last else None
    links, hidden_size, eos = _Links(ctx), stage.config.hidden_size, frozenset(eos_ids)
    live, step = list(range(len(mbs))), 0
    while live:
        for j in list(live):
            mb, cache = mbs[j], caches[j]
            if step == 0:
                ids, positions, last = _right_pad([prompts[i] for i in mb], stage.device)
            else:  # finished rows keep advancing (clamped): positions every rank can compute without a message
                positions = (lasts[j] + step).clamp(max=cache.max_len - 1)[:, None]
            B, L = positions.shape
            if stage.is_first:
                if step:
                    back = links.recv_last((B + 1,), torch.long)  # [tokens..., micro-batch still running]
                    alive, ids = bool(back[-1]), back[:B, None].to(stage.device)
                else:
                    alive = True
                if not stage.is_last:
                    links.send_next(torch.tensor([int(alive)], device=stage.device))
                inputs = ids
            else:
                alive = bool(links.recv_prev((1,), torch.long)[0])
                if alive:
                    inputs = links.recv_prev((2, B, L, hidden_size), stage.dtype)
                if not stage.is_last:
                    links.send_next(torch.tensor([int(alive)], device=stage.device))
            if not alive:
                live.remove(j)
                continue
            cache.begin(positions)
            out = stage(inputs, positions, cache)
            if not stage.is_last:
                links.send_next(out)
                continue
            rows = out[torch.arange(B), last] if step == 0 else out[:, -1]  # (B, hidden): the sampled positions
            logits = stage.compute_logits(rows).float()
            active = [k for k, i in enumerate(mb) if not seqs[i].done]
            tokens = _sample([seqs[mb[k]] for k in active], logits[active])
            back = torch.zeros(B + 1, dtype=torch.long, device=stage.device)
            for k, t in zip(active, tokens, strict=True):
                _append(seqs[mb[k]], t, eos, max_len, mb[k])
                back[k] = t
            back[-1] = int(any(not seqs[i].done for i in mb))
            links.send_first(back)
        links.flush()
        step += 1
    return _outputs(seqs, prompts, tokenizer) if stage.is_last else None


def _sample(seqs: list, logits: Tensor) -> list[int]:
    from minillm.sampling.sampler import sample

    return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])


def _outputs(seqs: list, prompts: list[list[int]], tokenizer) -> list:
    from minillm.outputs import CompletionOutput, RequestOutput

    out = []
    for s, p in zip(seqs, prompts, strict=True):
        text = tokenizer.decode(s.output, skip_special_tokens=True) if tokenizer is not None else ""
        sample = CompletionOutput(0, text, s.output, s.finish_reason, s.metrics)
        out.append(RequestOutput(None, list(p), text, s.output, s.finish_reason, s.metrics, [sample]))
    return out


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


def _generate_worker(ctx, source, prompts, params, num_microbatches, eos_ids, dtype, kernels, tokenizer):
    stage = _stage(ctx, source, dtype, kernels)
    return stage_generate(ctx, stage, prompts, params, num_microbatches, eos_ids, tokenizer)


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
                tokenizer=None, eos_token_ids: Sequence[int] | None = None,
                threads_per_worker: int | None = None) -> list:
    """Generate for ``prompts`` (strings need a ``tokenizer``) with the layers split over ``pipeline_parallel_size``
    processes; -> list[RequestOutput] in prompt order.  ``num_microbatches``: default p (one per stage in flight).

    Supports what a static batch can: max_tokens, EOS / ignore_eos, temperature, top-k/p and seeds; ``n`` > 1 and
    stop strings are refused (ValueError), as is a size that does not divide the layers (naming the valid ones).
    """
    from minillm.engine.inputs import merge_eos_token_ids, params_list, prompt_list, to_token_ids, validate_prompts

    config = _config(model)
    stage_layers(config, pipeline_parallel_size, 0)
    prompts = [to_token_ids(p, tokenizer) for p in prompt_list(prompts)]
    params = params_list(params, len(prompts))
    validate_prompts(prompts, config.max_position_embeddings, config.vocab_size)
    if any(p.n != 1 or p.stop for p in params):
        raise ValueError("pipeline parallel generation supports n=1 and no stop strings (a static batch per "
                         "micro-batch); use the single-process engine for those")
    eos = merge_eos_token_ids(config.eos_token_ids, tokenizer) if eos_token_ids is None else tuple(eos_token_ids)
    m = num_microbatches or pipeline_parallel_size
    args = (model, prompts, params, m, eos, dtype, kernels, tokenizer)
    return run_workers(_generate_worker, pipeline_parallel_size, args, backend=default_backend(device),
                       threads_per_worker=threads_per_worker)[-1]
