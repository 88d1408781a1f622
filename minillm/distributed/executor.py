"""Tensor-parallel generation over spawned workers: every rank runs the same program on its shard (SPMD).

    tp_generate(model, prompts, params, tensor_parallel_size=2)   # -> list[RequestOutput], as LLM.generate

Each rank loads the model, keeps its shard (``layers.parallel.shard_model``: H_q/tp, H_kv/tp heads, F/tp MLP units)
and runs an ordinary ``LLMEngine`` on it — the paged KV cache is sized from the rank's config, so each rank holds
only its heads' K/V.  The two all-reduces per layer leave identical hidden states and logits on every rank, so
every rank samples the same token (greedy, or seeded sampling with the same generator) and its scheduler makes the
same decision next step: no step metadata has to be sent, because every rank computes it.  That is how torchrun
programs are written; vLLM instead runs the scheduler once in a driver and broadcasts each step's metadata, which
matters when scheduling is costly or depends on wall-clock time.  Here the scheduler must be deterministic, so the
"dynamic" policy (it waits on the wall clock, which differs between processes) is refused.

Cost: every rank loads the whole checkpoint before keeping its shard (simple; a large model would read only its
slices), and the embeddings and LM head are replicated (see ``layers/parallel.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from minillm.config import EngineConfig
from minillm.distributed.parallel_state import ParallelContext, default_backend
from minillm.distributed.worker import run_workers
from minillm.layers.parallel import rank_config
from minillm.models.llama import Transformer

ModelSource = Transformer | str | os.PathLike | None  # a loaded model (shared with the workers) or load_model's path


def _full_model(source: ModelSource, ctx: ParallelContext, dtype, kernels: str) -> Transformer:
    if isinstance(source, Transformer):
        return source if ctx.device.type == "cpu" else source.to(ctx.device)
    from minillm.models.loader import load_model

    return load_model(source, dtype=dtype, device=ctx.device, kernels=kernels)


def rank_model(ctx: ParallelContext, source: ModelSource, dtype=None, kernels: str = "auto") -> Transformer:
    """This rank's shard of ``source`` (``shard_model``), on ``ctx.device``."""
    from minillm.layers.parallel import shard_model

    return shard_model(_full_model(source, ctx, dtype, kernels), ctx)


def _forward_worker(ctx: ParallelContext, source, input_ids: Tensor, positions: Tensor, dtype, kernels):
    model = rank_model(ctx, source, dtype, kernels)
    with torch.inference_mode():
        logits = model(input_ids.to(ctx.device), positions.to(ctx.device)).float().cpu()
    return logits if ctx.is_driver else None  # identical on every rank: only the driver's travels back


def _generate_worker(ctx: ParallelContext, source, prompts, params, engine_config: EngineConfig, dtype, kernels,
                     tokenizer):
    from minillm.engine.llm_engine import LLMEngine

    model = rank_model(ctx, source, dtype, kernels)
    if tokenizer is None and not isinstance(source, Transformer) and any(isinstance(p, str) for p in prompts):
        from minillm.models.loader import load_tokenizer

        tokenizer = load_tokenizer(source)
    outputs = LLMEngine(model, tokenizer, engine_config).generate(prompts, params)
    return outputs if ctx.is_driver else None


def _check(source: ModelSource, tp: int) -> None:
    """Reject a size that cannot shard before any process starts (same ValueError as ``rank_config``)."""
    if isinstance(source, Transformer):
        rank_config(source.config, tp)
    else:
        from minillm.models.loader import load_config, resolve

        rank_config(load_config(resolve(source)), tp)


def tp_forward(model: ModelSource, input_ids: Tensor, positions: Tensor, tensor_parallel_size: int = 2, *,
               dtype=None, kernels: str = "auto", device: str = "cpu") -> Tensor:
    """The full causal forward of ``model`` run sharded over ``tensor_parallel_size`` processes:
    input_ids, positions [B, L] -> fp32 logits [B, L, V] (on CPU).  For tests and the notebook."""
    _check(model, tensor_parallel_size)
    return run_workers(_forward_worker, tensor_parallel_size, (model, input_ids, positions, dtype, kernels),
                       backend=default_backend(device))[0]


def tp_generate(model: ModelSource, prompts: Sequence, params=None, tensor_parallel_size: int = 2, *, dtype=None,
                kernels: str = "auto", device: str = "cpu", tokenizer=None, **engine_options):
    """``LLMEngine.generate`` on ``tensor_parallel_size`` ranks: -> list[RequestOutput] in prompt order.

    ``model``: a loaded ``Transformer`` (its weights reach the workers through shared memory) or a path / hub id /
    None for ``load_model``; string prompts need a ``tokenizer`` (pickled to each rank) or a path to load it from.
    ``engine_options``: ``EngineConfig`` fields.  ValueError for a size that does not divide the heads, or the
    wall-clock "dynamic" policy.
    """
    config = EngineConfig(**engine_options)
    if config.policy == "dynamic":
        raise ValueError("policy='dynamic' waits on the wall clock, which differs between ranks: with "
                         "tensor_parallel_size > 1 use 'continuous' or 'static'")
    _check(model, tensor_parallel_size)
    args = (model, list(prompts), params, config, dtype, kernels, tokenizer)
    return run_workers(_generate_worker, tensor_parallel_size, args, backend=default_backend(device))[0]
