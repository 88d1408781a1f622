"""Decode steps through static buffers in batch buckets: CUDA graphs on a GPU, the same padded path on CPU.

An eager decode step launches every layer's kernels from Python: ~10 kernels per layer at a few µs each, which at
batch 1 on a GPU costs more than reading the weights of a small model (SmolLM2-135M's ~270 MB of bf16 weights
take ~80 µs at an H100's 3.35 TB/s; 300 launches at ~3 µs take ~1 ms).  A CUDA graph records the launches once
and replays them with one call, but it replays *fixed* addresses and shapes.  So, as in nano-vllm and vLLM:

- the step's inputs live in static buffers sized for the largest bucket (token ids, positions, slot mapping,
  block tables [max_num_seqs, max_blocks], sequence lengths) and each step copies its values into them;
- batch sizes are bucketed (1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs``); a step of B decodes runs the bucket
  B' ≥ B, its B' - B padding rows writing their K/V to a scratch block no sequence owns (seq_len 1), their logits
  dropped;
- on CUDA one graph per bucket is captured at start-up (largest first, sharing one memory pool) and replayed; on
  CPU the same padded static-buffer step runs without capture, so its logic is tested where there is no GPU.

Graph-safety of the attention metadata: the tables have a fixed width (``max_blocks`` = the context in blocks, not
the step's longest sequence), the lengths are device tensors read only by the kernels, and ``decode_only`` takes
the paged-attention fast path (no boolean-mask scatter, no prefill loop, no ``.item()``).  The public Triton
kernels' one input-check sync (``kernels.validate``) is skipped while capturing.  Prefill and mixed steps stay eager.

``compile=True`` (``kernels="compiled"``, ``kernels.select``) runs the same bucketed step through ``torch.compile``
(inductor: fused C++ loops on CPU, Triton on CUDA) over the torch reference ops; fixed shapes per bucket mean one
compilation per bucket and no recompiles.

``CudaGraphRunner`` is the engine's runner on this path (``engine/runners.py`` picks it): decode-only steps through
``DecodeGraphs``, every other step through the eager ``ModelRunner``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.engine.model_runner import DecodeBatch, ModelRunner, logit_rows
from minillm.engine.scheduler import SchedulerOutput
from minillm.kernels.select import KernelOps
from minillm.kv.block_manager import BlockManager
from minillm.kv.paged_cache import AttentionMetadata, PagedAttention, PagedKVCache
from minillm.models.llama import Transformer


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself: 32 -> (1, 2, 4, 8, 16, 32); 6 -> (1, 2,
    4, 6).  A step of B decodes pads to the first bucket ≥ B: at most 2x rows, log2(max) graphs to capture."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return (*out, max_num_seqs)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``batch`` rows, or None when none does (the step runs eagerly)."""
    return next((b for b in buckets if b >= batch), None)


@dataclass(frozen=True)
class CaptureReport:
    """What start-up capture cost: the buckets captured, wall seconds, device bytes the graphs' pool took."""

    buckets: tuple[int, ...]
    seconds: float
    memory_bytes: int


class DecodeGraphs:
    """Static buffers for ``max(buckets)`` decode rows and one step per bucket: captured CUDA graphs when
    ``capture`` (CUDA only), otherwise the same padded step run as is (optionally ``compile``d).

    ``scratch_block``: a KV block the block manager never hands out (the engine allocates one past its pool);
    padding rows write there.  ``max_blocks``: table width, the model context in blocks.  ``decode(batch)`` returns
    the logits [B, V] of the batch's rows (a fresh tensor, safe to keep across steps).
    """

    def __init__(self, model: Transformer, kv: PagedKVCache, *, buckets: tuple[int, ...], max_blocks: int,
                 scratch_block: int, capture: bool = False, compile: bool = False):
        dev = kv.k.device
        if capture and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the KV cache is on {dev}")
        if not 0 <= scratch_block < kv.k.shape[1]:
            raise ValueError(f"scratch_block {scratch_block} is outside the cache's {kv.k.shape[1]} blocks")
        self.model, self.kv, self.buckets, self.max_blocks = model, kv, tuple(buckets), max_blocks
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * kv.block_size
        n = max(self.buckets)
        # the static buffers; graphs read these addresses on every replay.  Initial values are padding rows, so the
        # warm-up and capture runs write only the scratch block.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._rows = torch.arange(n, device=dev)
        step = self._step
        if compile:  # one graph per bucket: B is a Python int, so each bucket specialises (no dynamic shapes)
            step = torch.compile(self._step, dynamic=False, fullgraph=False)
        self._run = step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_out: dict[int, Tensor] = {}
        self.replays: Counter[int] = Counter()  # steps run per bucket (graph replays, or padded steps on CPU)
        self.capture_report = self.capture() if capture else None

    def _step(self, B: int, ops: KernelOps) -> Tensor:
        """The bucketed decode forward on the static buffers -> logits [B, V] (padding rows included)."""
        meta = AttentionMetadata(self.slot_mapping[:B], self._rows[:B], self.block_tables[:B], self.seq_lens[:B],
                                 prefills=[], num_padding=0, decode_only=True)
        cache = PagedAttention(self.kv, meta, ops)
        hidden = self.model.hidden_states(self.input_ids[None, :B], self.positions[None, :B], cache)  # (1, B, h)
        return self.model.compute_logits(hidden[0])  # (B, V)

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture one CUDA graph per bucket, largest first (the smaller ones reuse its pool); a progress bar."""
        from tqdm.auto import tqdm

        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        pool = None
        for B in tqdm(sorted(self.buckets, reverse=True), desc="capturing decode graphs"):
            self._run(B, self.model.kernel_ops())  # warm-up outside the graph: Triton JIT, lazy allocations
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._graph_out[B] = self._run(B, self.model.kernel_ops())
            pool = g.pool()
            self.graphs[B] = g
        torch.cuda.synchronize()
        report = CaptureReport(tuple(sorted(self.graphs)), time.perf_counter() - t0,
                               free_before - torch.cuda.mem_get_info()[0])
        print(f"[minillm] captured {len(self.graphs)} decode graphs (batch {', '.join(map(str, report.buckets))}) "
              f"in {report.seconds:.1f} s, {report.memory_bytes / 2**20:.0f} MiB")
        return report

    def fill(self, batch: DecodeBatch, bucket: int) -> None:
        """Copy the batch into the static buffers; rows B..bucket-1 become padding (scratch slot, length 1).
        One host->device copy per buffer, issued before the step so no read inside it waits on the host."""
        B, W = len(batch), self.max_blocks
        dev = self.input_ids.device
        pad = bucket - B
        tables = torch.full((bucket, W), self.scratch_block, dtype=torch.int32)
        for i, t in enumerate(batch.block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)

        def put(buf: Tensor, values: list[int], pad_value: int) -> None:
            host = torch.tensor(values + [pad_value] * pad, dtype=buf.dtype)
            buf[:bucket].copy_(host.to(dev, non_blocking=True))

        put(self.input_ids, batch.input_ids, 0)
        put(self.positions, batch.positions, 0)
        put(self.slot_mapping, batch.slot_mapping, self.scratch_slot)
        put(self.seq_lens, batch.seq_lens, 1)
        self.block_tables[:bucket].copy_(tables.to(dev, non_blocking=True))

    def decode(self, batch: DecodeBatch, num_padding: int = 0) -> Tensor:
        """Run one decode step of B = ``len(batch)`` rows -> logits [B, V] (a copy: the static output is
        overwritten by the next replay).  ``num_padding``: rows the caller wants computed and dropped on top (a
        static batch's finished members): the bucket holds B + num_padding rows."""
        B = len(batch)
        bucket = bucket_for(B + num_padding, self.buckets)
        if bucket is None:
            raise ValueError(f"a decode batch of {B} + {num_padding} padding rows exceeds the largest bucket "
                             f"({max(self.buckets)})")
        self.fill(batch, bucket)
        self.replays[bucket] += 1
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self._graph_out[bucket][:B].clone()
        return self._run(bucket, self.model.kernel_ops())[:B].clone()


class CudaGraphRunner(ModelRunner):
    """The engine's runner when decode steps go through static buffers: decode-only steps whose rows (padding
    included) fit the largest bucket replay ``graphs`` (``DecodeGraphs``: captured CUDA graphs on a GPU, the same
    padded step, optionally compiled, elsewhere); prefill, mixed and draft steps run the eager packed forward.

    ``kv`` must hold one block past the block manager's pool: the scratch block padding rows write to."""

    def __init__(self, model: Transformer, kv: PagedKVCache, block_manager: BlockManager, *, buckets: tuple[int, ...],
                 max_blocks: int, capture: bool, compile: bool):
        super().__init__(model, kv, block_manager)
        self.graphs = DecodeGraphs(model, kv, buckets=buckets, max_blocks=max_blocks,
                                   scratch_block=block_manager.device.num_blocks, capture=capture, compile=compile)

    def fast_forward(self, out: SchedulerOutput) -> Tensor | None:
        """Every chunk one token (no drafts), rows + padding within the largest bucket -> the sampling rows'
        logits [R, V] from the bucketed step; else None."""
        if any(s.num_tokens != 1 for s in out.scheduled) \
                or len(out.scheduled) + out.num_padding > max(self.graphs.buckets):
            return None
        logits = self.graphs.decode(self.rows(out), out.num_padding)  # (B, V)
        return logits[logit_rows(out)]  # (R, V)
