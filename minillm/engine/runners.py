"""The one place that decides how an engine's steps run: ``make_executor`` (which processes) and ``make_runner``
(which runner), called once, at engine start.

    ParallelConfig tensor_parallel_size > 1                -> TPDriver: the other ranks hold their shards
    ParallelConfig pipeline_parallel_size > 1              -> PPDriver: the other ranks hold their stages' layers

    a multi-process executor (tensor / pipeline parallel)  -> ModelRunner(executor): eager packed steps on every rank
    enforce_eager=True                                     -> ModelRunner: eager, every layer from Python
    static decode (``use_static_decode``)                  -> CudaGraphRunner: decode steps replay CUDA graphs
                                                              (compiled, or the padded path uncaptured, on CPU)
    KV eviction (sliding window, attention sinks)          -> ModelRunner: the per-layer kernels take the window
    CPU, fp32/bf16, plain Llama modules, native kernels    -> NativeRunner: decode and draft steps in one native call
    anything else                                          -> ModelRunner

The runner owns the paged K/V cache, so it is allocated here too: the static decode path needs one scratch block
past the block manager's pool (its padding rows write there), and a multi-process executor allocates each
worker's cache to match this one.
"""

from __future__ import annotations

import torch

from minillm.config import EngineConfig, ParallelConfig
from minillm.engine.cuda_graph import CudaGraphRunner, batch_buckets
from minillm.engine.model_runner import Executor, ModelRunner
from minillm.engine.native_runner import NativeRunner, supports
from minillm.kernels.cpu.decode import MAX_ROWS
from minillm.kernels.select import compiles
from minillm.kv.block_manager import BlockManager
from minillm.kv.paged_cache import make_paged_kv_cache
from minillm.layers.parallel import is_sharded, stage_layers
from minillm.models.llama import Transformer


def check_parallel(model: Transformer, config: EngineConfig) -> None:
    """ValueError, before any process starts, for a parallel config the model or the engine options cannot run:
    a tensor-parallel size that does not divide the heads (naming those that do), a pipeline size that does not
    divide the layers (same), a speculative config or ``enforce_eager=False`` with either, KV eviction with
    either."""
    parallel = config.parallel_config
    if parallel.tensor_parallel_size > 1:
        from minillm.layers.parallel import check_shardable

        check_shardable(model, parallel.tensor_parallel_size)
    if parallel.pipeline_parallel_size > 1:
        stage_layers(model.config, parallel.pipeline_parallel_size, 0)
    if parallel.world_size > 1 and (model.config.sliding_window is not None or config.kv_eviction is not None):
        raise ValueError("KV eviction (kv_eviction, or a sliding-window model) is not supported over several "
                         "processes (tensor / pipeline parallel): their steps do not carry the window; run it in "
                         "one process")
    if parallel.world_size > 1:
        from minillm.distributed.driver import check_engine_config

        check_engine_config(config)


def make_executor(model: Transformer, parallel: ParallelConfig) -> Executor | None:
    """The processes an engine spans: None (this one alone) or a driver that starts the other ranks now and
    holds this rank's piece of ``model`` (``executor.model``)."""
    if parallel.tensor_parallel_size > 1:
        from minillm.distributed.driver import TPDriver

        return TPDriver(model, parallel.tensor_parallel_size)
    if parallel.pipeline_parallel_size > 1:
        from minillm.distributed.pp_driver import PPDriver

        return PPDriver(model, parallel.pipeline_parallel_size)
    return None


def use_static_decode(enforce_eager: bool | None, device: torch.device, compiled: bool,
                      distributed: bool = False) -> bool:
    """Whether decode steps go through static buffers (``CudaGraphRunner``).  ``enforce_eager`` True: never (vLLM's
    name); False: always (CUDA graphs on a GPU, the uncaptured padded path on CPU); None: where it pays — CUDA
    (launch-bound decode), or a compiled step (fixed shapes per bucket), unless ``distributed`` (a sharded model's
    collectives are not captured here).  On CPU the padded path alone is not faster than the packed eager step (it
    computes the padding rows, and a CPU step has no launch cost to save), so it is off there."""
    if enforce_eager is not None:
        return not enforce_eager
    return (device.type == "cuda" or compiled) and not distributed


def make_runner(model: Transformer, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                executor: Executor | None = None) -> ModelRunner:
    """The runner for this model, config and executor, with its paged K/V cache (sized to ``block_manager``'s
    pools).  ValueError for ``enforce_eager=False`` with a quantized KV cache or with an executor."""
    distributed = executor is not None or is_sharded(model)
    if config.enforce_eager is False and config.kv_cache_dtype != "auto":
        raise ValueError("enforce_eager=False (static decode buffers / CUDA graphs) needs kv_cache_dtype='auto': "
                         "a quantized KV cache dequantizes the step's blocks into a pool sized per step; "
                         "pass enforce_eager=None or True with a quantized KV cache")
    if config.enforce_eager is False and executor is not None:
        raise ValueError("enforce_eager=False is not supported over several processes (tensor / pipeline "
                         "parallel): their steps run eagerly (pass enforce_eager=None or True)")
    evicting = block_manager.eviction is not None or model.config.sliding_window is not None  # windows: eager
    if evicting and config.enforce_eager is False:
        raise ValueError("enforce_eager=False (static decode buffers / CUDA graphs) cannot run KV eviction (a "
                         "sliding-window model or kv_eviction): its buffers hold whole block tables without the "
                         "window; pass enforce_eager=None or True")
    static = config.kv_cache_dtype == "auto" and not evicting and use_static_decode(
        config.enforce_eager, model.device, compiles(model.kernels), distributed)
    num_blocks, host = block_manager.device.num_blocks, block_manager.host
    track_mass = block_manager.eviction is not None and block_manager.eviction.needs_mass  # H2O: attention mass
    kv_args = {"num_blocks": num_blocks + static, "block_size": config.block_size, "dtype": model.dtype,
               "num_host_blocks": host.num_blocks if host else 0, "kv_cache_dtype": config.kv_cache_dtype,
               "track_mass": track_mass}
    kv = make_paged_kv_cache(model.config, device=model.device, **kv_args)
    if track_mass:
        block_manager.attach_mass(kv.block_mass)
    if executor is not None:
        executor.attach_kv(kv, kv_args)  # every rank's cache holds the same blocks (of its own heads or layers)
        return ModelRunner(model, kv, block_manager, executor)
    if static:
        return CudaGraphRunner(model, kv, block_manager, buckets=batch_buckets(config.max_num_seqs),
                               max_blocks=-(-max_model_len // config.block_size),
                               capture=model.device.type == "cuda", compile=compiles(model.kernels))
    if config.enforce_eager is None and not evicting and supports(model, kv):  # True keeps the per-layer path
        gamma = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        rows = config.max_num_seqs * (1 + gamma)  # a verify step feeds γ + 1 rows per sequence
        return NativeRunner(model, kv, block_manager, max_rows=min(MAX_ROWS, rows), max_positions=max_model_len)
    return ModelRunner(model, kv, block_manager)
