"""The pipeline-parallel executor: one engine in this process, the model's layers split over persistent ranks.

    driver = PPDriver(model, pipeline_parallel_size=2)     # spawns stages 1..p−1 once; this process is stage 0
    engine = LLMEngine(driver.model, tokenizer, EngineConfig(...), executor=driver)   # sized from stage 0's layers
    engine.generate(...)                                   # or LLM(path, pipeline_parallel_size=2).generate(...)

Stage s holds layers [s·n/p, (s+1)·n/p) (``PipelineStage``) and a paged K/V cache of *its* layers only, with the
same blocks as every other stage's: the engine's one block manager decides slots and copies for all of them.
Stage 0 also holds the embedding, the last stage the final norm and the LM head.  Per step (``stage_step``):

    rank 0 -> every stage   the packed step (``step.py``: a header down each pipe, one broadcast): ids, positions,
                            slots, block tables, sample rows, block copies — each stage copies its own layers' blocks
    stage s -> stage s + 1  the activations [2, 1, T, hidden] (layer output and residual stream), point to point
    last stage -> rank 0    the logits [R + pad, V] of the step's sample rows (the LM head runs there only)

so the engine on rank 0 samples, applies the stop rules, detokenizes and streams exactly as with one process: any
policy, ``n`` > 1, stop strings, prefix caching, preemption.  Process start-up, health checks and failure
reporting (``WorkerError`` naming the rank) are ``driver.StepDriver``'s, shared with tensor parallelism.

One batch is in flight, so at any moment one stage computes and p − 1 wait: the pipeline buys memory (each rank
holds 1/p of the layers and their K/V), not speed.  Overlapping the stages within a step (GPipe's micro-batches)
would take splitting the step's sequences into m groups, each packed with its own metadata and sample rows, and
rank 0 sending group j + 1 while stage 1 runs group j: the idle share drops to (p − 1)/(m + p − 1), but never to
zero, since the next step needs this one's tokens.  Removing it takes p steps in flight — p independent batches
(vLLM's "virtual engines"), each scheduled while the others are in the pipe.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from minillm.distributed import comm
from minillm.distributed.driver import StepDriver
from minillm.distributed.parallel_state import ParallelContext
from minillm.engine.model_runner import StepInputs
from minillm.kernels.select import ops_for
from minillm.kv.paged_cache import PagedAttention, PagedKVCache
from minillm.layers.parallel import stage_layers
from minillm.models.llama import Transformer


class PipelineStage(nn.Module):
    """Stage ``rank`` of ``pp``: its decoder layers (shared with ``model``, not copied), the embedding on the first
    stage, the final norm and LM head on the last.  ``config`` is the stage's own (``num_layers`` = its layers):
    a K/V cache built from it holds only this stage's layers."""

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
        """Whether this stage embeds the token ids (rank 0)."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the final norm and the LM head (rank p − 1)."""
        return self.rank == self.pp - 1

    def kernel_ops(self):
        """The kernels the layers call (``kernels.select``), as ``Transformer.kernel_ops``."""
        return ops_for(self.kernels, self.device, self.dtype)

    def forward(self, inputs: Tensor, positions: Tensor, cache=None) -> Tensor:
        """First stage: ids [B, L]; others: the previous stage's [2, B, L, hidden] (output, residual).
        -> [2, B, L, hidden] for the next stage, or on the last stage the final-normed hidden [B, L, hidden]."""
        ops = self.kernel_ops()
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
        return self.lm_head(hidden, self.kernel_ops())


def make_stage(model: Transformer, ctx: ParallelContext) -> PipelineStage:
    """This rank's stage of ``model`` (``ctx.rank`` of ``ctx.world_size``)."""
    return PipelineStage(model, ctx.rank, ctx.world_size)


@torch.inference_mode()
def stage_step(stage: PipelineStage, kv: PagedKVCache, step: StepInputs, ctx: ParallelContext) -> Tensor | None:
    """A stage's part of an engine step: its layers' block copies, then its layers over its paged cache on the
    packed rows [1, T] (the previous stage's activations, or the ids on stage 0), the result sent on; the last stage
    runs the LM head on ``step.sample_rows`` and sends the logits to rank 0.  -> logits [R + pad, V] (model dtype)
    on rank 0, None elsewhere and for a copies-only step."""
    kv.copy_blocks(step.copies)  # before the forward: copy-on-write sources and swaps must land first
    if not step.has_forward:
        return None
    t = step.input_ids.shape[1]
    inputs = step.input_ids
    if not stage.is_first:
        inputs = comm.recv((2, 1, t, stage.config.hidden_size), stage.dtype, stage.rank - 1, ctx)
    out = stage(inputs, step.positions, PagedAttention(kv, step.meta, stage.kernel_ops()))
    if not stage.is_last:
        comm.send(out, stage.rank + 1, ctx).wait()  # (2, 1, T, hidden)
        if not stage.is_first:
            return None
        rows = (step.sample_rows.numel(), stage.config.vocab_size)
        return comm.recv(rows, stage.dtype, stage.pp - 1, ctx)  # (R + pad, V) from the last stage
    logits = stage.compute_logits(out[0, step.sample_rows])  # (R + pad, V)
    if stage.is_first:  # one stage: nothing to send
        return logits
    comm.send(logits, 0, ctx).wait()
    return None


class PPDriver(StepDriver):
    """Stage 0 of a pipeline (this process, ``self.model``) and the worker processes of stages 1..p−1, started
    once (``StepDriver``); an ``engine.model_runner.Executor``.  ``model``: the loaded whole model (its weights
    reach the workers through shared memory, each keeps its stage's layers).  ValueError (before any process
    starts) for a size that does not divide the layers, naming the valid sizes."""

    kind, prefix = "pipeline-parallel", "minillm-pp"

    def __init__(self, model: Transformer, pipeline_parallel_size: int, *, threads_per_worker: int | None = None,
                 timeout_s: float = 60.0, start_timeout_s: float = 300.0):
        stage_layers(model.config, pipeline_parallel_size, 0)  # before any process starts
        super().__init__(model, pipeline_parallel_size, make_stage, stage_step,
                         threads_per_worker=threads_per_worker, timeout_s=timeout_s, start_timeout_s=start_timeout_s)
