"""Tensor-parallel generation: one scheduler in the driver, persistent worker ranks (``driver.TPDriver``), and the
one-call generation both multi-process drivers share (``driver_generate``).

    LLM(path, tensor_parallel_size=2).generate(...)            # the usual way: workers start once, reused
    tp_generate(model, prompts, params, tensor_parallel_size=2)  # one call: start, generate, shut down
    tp_forward(model, input_ids, positions, tensor_parallel_size=2)   # the sharded full forward, for tests

Each rank holds its shard (``layers.parallel.shard_model``: H_q/tp and H_kv/tp heads, F/tp MLP units, V/tp
vocabulary rows of the embedding and LM head) and a paged KV cache sized from its own config, so it holds only its
heads' K/V.  The driver — rank 0, the calling process — runs the one ``LLMEngine`` (scheduler, block manager,
detokenizer, sampling); each step it sends the packed inputs once (``step.py``: a small header, one broadcast)
and every rank runs the forward with its collectives.  That is vLLM's shape; the alternative, every rank running
its own scheduler on identical logits (SPMD, as ``torchrun`` programs and ``pipeline.py`` do), needs no step
messages but breaks as soon as scheduling is not deterministic (the "dynamic" policy waits on each process's clock).

Cost: the workers start once per ``LLM`` (seconds: a fresh interpreter each, importing torch), not per call; every
rank keeps the loaded model's memory mapped while it cuts its shard (a large model would read only its slices).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from torch import Tensor

from minillm.config import EngineConfig, ParallelConfig
from minillm.distributed.parallel_state import ParallelContext
from minillm.layers.parallel import check_shardable, rank_config
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


def _driver_model(source: ModelSource, dtype, kernels: str, device: str) -> Transformer:
    """The whole model in the driver process (rank 0's device: CPU, or the first GPU under NCCL)."""
    if isinstance(source, Transformer):
        return source
    from minillm.models.loader import load_model

    return load_model(source, dtype=dtype, device=device, kernels=kernels)


def _check(source: ModelSource, tp: int) -> None:
    """Reject a size that cannot shard before anything loads or starts (same ValueError as ``rank_config``)."""
    if isinstance(source, Transformer):
        check_shardable(source, tp)
    else:
        from minillm.models.loader import load_config, resolve

        rank_config(load_config(resolve(source)), tp)


def tp_forward(model: ModelSource, input_ids: Tensor, positions: Tensor, tensor_parallel_size: int = 2, *,
               dtype=None, kernels: str = "auto", device: str = "cpu") -> Tensor:
    """The full causal forward of ``model`` run sharded over ``tensor_parallel_size`` processes (this one is rank
    0): input_ids, positions [B, L] -> fp32 logits [B, L, V] on CPU.  For tests and the notebook."""
    from minillm.distributed.driver import TPDriver

    _check(model, tensor_parallel_size)
    driver = TPDriver(_driver_model(model, dtype, kernels, device), tensor_parallel_size)
    try:
        return driver.forward(input_ids, positions).float().cpu()
    finally:
        driver.shutdown()


def tp_generate(model: ModelSource, prompts: Sequence, params=None, tensor_parallel_size: int = 2, *, dtype=None,
                kernels: str = "auto", device: str = "cpu", tokenizer=None, **engine_options):
    """``LLMEngine.generate`` over ``tensor_parallel_size`` ranks, workers started for this call and stopped after
    it: -> list[RequestOutput] in prompt order.  (``LLM(..., tensor_parallel_size=N)`` keeps them between calls.)

    ``model``: a loaded ``Transformer`` (its weights reach the workers through shared memory) or a path / hub id /
    None for ``load_model``; string prompts need a ``tokenizer`` or a path to load it from.  ``engine_options``:
    ``EngineConfig`` fields (any policy, "dynamic" included).  ValueError for a size that does not divide the
    heads (naming the valid ones) or a speculative config; ``WorkerError`` (a RuntimeError) when a worker dies.
    """
    from minillm.distributed.driver import TPDriver

    _check(model, tensor_parallel_size)
    return driver_generate(lambda whole: TPDriver(whole, tensor_parallel_size), ParallelConfig(tensor_parallel_size),
                           model, prompts, params, dtype=dtype, kernels=kernels, device=device, tokenizer=tokenizer,
                           **engine_options)


def driver_generate(start: Callable, parallel: ParallelConfig, model: ModelSource, prompts, params=None, *,
                    dtype=None, kernels: str = "auto", device: str = "cpu", tokenizer=None,
                    eos_token_ids: Sequence[int] | None = None, **engine_options) -> list:
    """One ``LLMEngine.generate`` call over the driver ``start(whole model)`` returns (a ``driver.StepDriver`` for
    ``parallel``), stopped after it; ``engine_options``: ``EngineConfig`` fields.  ValueError for what a
    multi-process engine cannot run (``check_engine_config``), before any process starts; the driver's
    ``WorkerError`` if a worker died mid-call (the engine ends the requests with errors, this raises it)."""
    from minillm.distributed.driver import check_engine_config
    from minillm.engine.inputs import prompt_list
    from minillm.engine.llm_engine import LLMEngine

    config = check_engine_config(EngineConfig(parallel_config=parallel, **engine_options))
    prompts = prompt_list(prompts)
    if tokenizer is None and not isinstance(model, Transformer) and any(isinstance(p, str) for p in prompts):
        from minillm.models.loader import load_tokenizer

        tokenizer = load_tokenizer(model)
    driver = start(_driver_model(model, dtype, kernels, device))
    try:
        engine = LLMEngine(driver.model, tokenizer, config, eos_token_ids=eos_token_ids, executor=driver)
        outputs = engine.generate(prompts, params)
        driver.check()  # a worker lost mid-call fails its requests in the engine: raise it here
        return outputs
    finally:
        driver.shutdown()
