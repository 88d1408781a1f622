"""The KV pool sized to the device (vLLM's ``gpu_memory_utilization``).

A CUDA engine of one process gives its paged KV pool what is left of its share of the device once the weights are
loaded and the largest step's activations are accounted for:

    blocks = ⌊(gpu_memory_utilization × total − in use after loading − peak activation of the largest step)
              / bytes per block⌋

``size_kv_pool`` is the one place that picks between that and ``EngineConfig.resolve_num_blocks`` (an explicit
``num_kv_blocks`` / ``kv_cache_bytes``, the CPU default, a multi-process engine).  The device is read through a
``DeviceMemory`` — ``CudaMemory`` on a GPU, a fake in tests — so the arithmetic is tested without one.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from minillm.config import EngineConfig

if TYPE_CHECKING:
    from minillm.models.llama import Transformer

logger = logging.getLogger("minillm")

GiB = 2**30


class DeviceMemory(Protocol):
    """What the sizing reads from a device, in bytes."""

    def total(self) -> int:
        """The device's whole memory."""
        ...

    def in_use(self) -> int:
        """Memory held now, by anyone (weights, runtime context, other processes)."""
        ...

    def peak_during(self, fn: Callable[[], object]) -> int:
        """Run ``fn``; the most memory it held at once above what was held before it ran."""
        ...


class CudaMemory:
    """``DeviceMemory`` of one CUDA device: the driver's totals (``torch.cuda.mem_get_info``) and torch's peak."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def in_use(self) -> int:
        """Everything on the device (this process's CUDA context, workspaces and weights, and any other process's
        memory): another engine on the same device comes out of this one's share, so the pool never over-commits.
        Unreachable tensors (a dropped engine's pool in a reference cycle) and blocks torch caches but no tensor
        holds are released first: the pool can have them."""
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def peak_during(self, fn: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before


def device_memory(device: torch.device | str) -> CudaMemory | None:
    """The probe for ``device``: ``CudaMemory`` on CUDA; None elsewhere (a CPU keeps the configured budget)."""
    device = torch.device(device)
    return CudaMemory(device) if device.type == "cuda" else None


@torch.inference_mode()
def profile_forward(model: Transformer, config: EngineConfig, max_model_len: int) -> None:
    """The engine's largest step, for its memory: ``max_num_batched_tokens`` tokens through ``hidden_states``,
    the LM head on ``max_num_seqs`` sampled rows, and the sampler's fp32 probabilities of them.

    A plain causal forward of one packed sequence, not the runner's paged step: that step needs the KV pool and
    block tables being sized.  The peak comes from what both share — the MLP's T × intermediate activations, the
    projections, the R × V logits; causal attention without a cache (FlashAttention on CUDA) holds O(T) like the
    paged prefill.  Not profiled, so left to the 1 − utilization headroom: the context K/V a late prefill chunk
    gathers (one layer at a time), CUDA graphs captured after the pool, a speculative draft model.
    """
    T, R = config.max_num_batched_tokens, min(config.max_num_batched_tokens, config.max_num_seqs)
    ids = torch.zeros(1, T, dtype=torch.long, device=model.device)  # (1, T)
    positions = (torch.arange(T, device=model.device) % max_model_len)[None]  # (1, T): RoPE stays in range
    hidden = model.hidden_states(ids, positions)  # (1, T, hidden)
    logits = model.compute_logits(hidden[0, -R:])  # (R, V)
    torch.softmax(logits.float(), dim=-1)  # (R, V) fp32, as the sampler


@dataclass(frozen=True)
class KVPoolSize:
    """How many device KV blocks the engine allocates, the bytes they take and the setting that decided it."""

    num_blocks: int
    budget_bytes: int
    source: str  # "num_kv_blocks", "kv_cache_bytes", "default" (EngineConfig.resolve_num_blocks' cap) or
    # "gpu_memory_utilization" (the device's memory, profiled)


def size_kv_pool(config: EngineConfig, block_bytes: int, max_model_len: int, memory: DeviceMemory | None = None,
                 profile: Callable[[], object] | None = None) -> KVPoolSize:
    """Device KV blocks for an engine.  ``block_bytes``: K and V of all layers for one block
    (``paged_cache.kv_bytes_per_block``); ``memory``: the device's probe (None: not a single-process CUDA engine);
    ``profile``: the largest step (``profile_forward``), run once under ``memory.peak_during``.

    An explicit ``num_kv_blocks`` / ``kv_cache_bytes``, or no ``memory``, keeps ``EngineConfig.resolve_num_blocks``
    and never touches the probe.  Otherwise the pool gets ``gpu_memory_utilization × total − in use − peak``
    bytes, at most ``max_num_seqs`` full-context sequences' blocks (more could never be in use at once);
    ValueError (naming the numbers and the fixes) when that holds less than one ``max_model_len`` sequence — the
    longest request the engine accepts must fit, as in the CPU default.
    """
    if memory is None or config.num_kv_blocks is not None or config.kv_cache_bytes is not None:
        blocks = config.resolve_num_blocks(block_bytes, max_model_len)
        source = ("num_kv_blocks" if config.num_kv_blocks is not None
                  else "kv_cache_bytes" if config.kv_cache_bytes is not None else "default")
        size = KVPoolSize(blocks, blocks * block_bytes, source)
    else:
        peak = memory.peak_during(profile or (lambda: None))
        total, used = memory.total(), memory.in_use()  # after the profile: counts what its kernels loaded
        budget = int(config.gpu_memory_utilization * total) - used - peak
        need = -(-max_model_len // config.block_size)  # blocks of one full-context sequence
        # never more than max_num_seqs full-context sequences can hold at once (the CPU default's bound too): an
        # engine of a small model leaves the rest of the device to the next engine (a notebook builds several)
        size = KVPoolSize(min(max(budget, 0) // block_bytes, config.max_num_seqs * need), budget,
                          "gpu_memory_utilization")
        if size.num_blocks < need:
            fits = size.num_blocks * config.block_size
            raise ValueError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} of {total / GiB:.2f} GiB leaves "
                f"{budget / GiB:.2f} GiB for the KV pool after {used / GiB:.2f} GiB in use (weights, runtime, other "
                f"processes) and a {peak / GiB:.2f} GiB activation peak at max_num_batched_tokens="
                f"{config.max_num_batched_tokens}: "
                f"{size.num_blocks} blocks of {block_bytes} bytes, {need} needed for one max_model_len="
                f"{max_model_len} sequence.  Raise gpu_memory_utilization, lower max_num_batched_tokens, use a "
                "smaller model" + (f", or set max_model_len <= {fits}" if fits else " (not one block fits)"))
    if memory is not None:
        logger.info("KV pool: %d blocks, %d tokens, %d full %d-token sequences; %.2f GiB from %s", size.num_blocks,
                    size.num_blocks * config.block_size, full_sequences(size.num_blocks, config.block_size,
                                                                        max_model_len),
                    max_model_len, size.budget_bytes / GiB, size.source)
    return size


def full_sequences(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """How many ``max_model_len``-token sequences ``num_blocks`` blocks hold at once (each its own blocks)."""
    return num_blocks // -(-max_model_len // block_size)
