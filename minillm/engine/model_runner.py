"""Paged KV storage and the model runner: every engine step is one packed forward pass.

All tokens the scheduler picked — decode tokens of running sequences and prefill chunks of new ones — are
concatenated into a single [1, T] batch with their own positions (no padding: a 500-token prefill chunk and
twenty 1-token decodes cost T = 520 rows of every linear layer, which is where the weights are read once for all).
Attention is the only per-sequence operation; ``PagedAttention`` does it through the block tables:

- new K/V rows are scattered into their slots (``slot = block_id * block_size + offset``, from the BlockManager);
- decode tokens go together through the model's ``paged_decode_attention`` kernel (``kernels.select``: Triton on
  CUDA, native on CPU, the gather + softmax reference elsewhere);
- each prefill chunk gathers its sequence's blocks (earlier context + the chunk) and runs causal
  ``prefill_attention`` (Triton on CUDA, SDPA elsewhere) with the queries at the end of the keys.

Only the last row of each sequence that samples goes through the LM head (V × hidden, the largest matrix).

Decode-only steps (every scheduled chunk one token) go through ``graphs`` when the engine made one: a
``cuda_graph.DecodeGraphRunner`` (static buffers in batch buckets, replayed as CUDA graphs on a GPU; see that module)
or, on CPU, a ``kernels.cpu.fused.NativeDecodeRunner`` (the whole decoder stack in one native call: no per-layer
Python).  Both answer ``buckets`` and ``decode(batch, num_padding) -> logits``.  Prefill and mixed steps, and decode
batches past the largest bucket, run the packed eager forward below.

Padding rows (``SchedulerOutput.num_padding``: finished members of a fixed-shape static/dynamic batch) are appended
after the real tokens: a pad token at position 0 through every linear layer and the LM head, as a padded batch
computes them, then discarded.  They own no KV slot and skip attention (their output there is zero); at the
context lengths of a batch that is a small part of a row's cost, so the padding is priced slightly low, not high.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.engine.cuda_graph import DecodeBatch, DecodeGraphRunner
from minillm.engine.scheduler import SchedulerOutput
from minillm.kernels.cpu.fused import NativeDecodeRunner
from minillm.kv.block_manager import BlockManager
from minillm.kv.paged_cache import AttentionMetadata, PagedAttention, PagedKVCache, PrefillChunk
from minillm.models.llama import Transformer
from minillm.sampling.sampler import sample


@dataclass
class StepResult:
    """Sampled tokens, one list per sampling ``ScheduledSeq`` (n tokens for a parent about to fork); the fp32
    logits [B_s, V] they came from when asked for."""

    tokens: list[list[int]]
    logits: Tensor | None


class ModelRunner:
    """Runs a ``SchedulerOutput``: block copies, one packed forward, the LM head on sampling rows, sampling.
    Attention runs on the model's kernels (``model.kernel_ops()``), the same the layers run on.  ``graphs``: the
    decode path for decode-only steps, a ``DecodeGraphRunner`` or a ``NativeDecodeRunner`` (None: every step eager)."""

    def __init__(self, model: Transformer, kv: PagedKVCache, block_manager: BlockManager,
                 graphs: DecodeGraphRunner | NativeDecodeRunner | None = None):
        self.model, self.kv, self.block_manager, self.graphs = model, kv, block_manager, graphs

    def decode_batch(self, out: SchedulerOutput) -> DecodeBatch | None:
        """The step as a ``DecodeBatch`` when the decode path can run it (one made, every chunk one token, rows +
        padding within its largest bucket; no buckets: it is off for now); else None (the eager path runs it)."""
        if self.graphs is None or not out.scheduled or any(s.num_tokens != 1 for s in out.scheduled) \
                or len(out.scheduled) + out.num_padding > max(self.graphs.buckets, default=0):
            return None
        return self._rows(out)

    def fused_rows(self, out: SchedulerOutput) -> DecodeBatch | None:
        """Every scheduled token as one row (a chunk of n tokens of one sequence is n rows, each attending to the
        positions before it) when the fused native step can run them all in one call: it is this runner's decode
        path and the rows fit its bucket.  Speculative verification feeds [last, drafts] chunks through it, so the
        verify pass costs about one decode step.  Else None."""
        g = self.graphs
        if not isinstance(g, NativeDecodeRunner) or not out.scheduled or out.num_tokens > max(g.buckets, default=0):
            return None
        return self._rows(out)

    def _rows(self, out: SchedulerOutput) -> DecodeBatch:
        """The scheduled chunks' tokens, in packing order, as rows: id, position, slot, block table (the blocks up
        to the chunk's end) and context length (position + 1)."""
        bm, bs = self.block_manager, self.kv.block_size
        ids, positions, slots, tables, lens = [], [], [], [], []
        for s in out.scheduled:
            end = s.start + s.num_tokens
            ids += s.seq.token_ids[s.start : end]
            positions += range(s.start, end)
            slots += bm.slot_mapping(s.seq.seq_id, s.start, end)
            table = bm.block_table(s.seq.seq_id)[: -(-end // bs)]
            tables += [table] * s.num_tokens
            lens += range(s.start + 1, end + 1)
        return DecodeBatch(ids, positions, slots, tables, lens)

    def prepare(self, out: SchedulerOutput) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """Pack the scheduled chunks, then ``out.num_padding`` pad rows.
        -> input_ids [1, T], positions [1, T], metadata, LM-head rows [B_s + padding] (sampling rows first)."""
        bm, bs = self.block_manager, self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows, tables, lens, prefills, sample_rows = [], [], [], [], []
        for s in out.scheduled:
            seq, row, end = s.seq, len(ids), s.start + s.num_tokens
            ids += seq.token_ids[s.start : end]
            positions += range(s.start, end)
            slots += bm.slot_mapping(seq.seq_id, s.start, end)
            table = bm.block_table(seq.seq_id)[: -(-end // bs)]
            if s.num_tokens == 1:
                decode_rows.append(row)
                tables.append(table)
                lens.append(end)
            else:
                blocks = torch.tensor(table, device=self.kv.k.device)
                prefills.append(PrefillChunk(row, row + s.num_tokens, end, blocks))
            if s.samples:
                sample_rows.append(len(ids) - 1)
        width = max((len(t) for t in tables), default=0)
        dev = self.kv.k.device

        def tensor(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        padded = [t + [0] * (width - len(t)) for t in tables]
        meta = AttentionMetadata(tensor(slots), tensor(decode_rows),
                                 tensor(padded, torch.int32).view(len(tables), width), tensor(lens, torch.int32),
                                 prefills, out.num_padding, decode_only=len(decode_rows) == len(ids) > 0
                                 and out.num_padding == 0)
        # pad rows: token 0 at position 0, after the real rows; they go through the LM head too (sampled from: no)
        sample_rows += range(len(ids), len(ids) + out.num_padding)
        ids += [0] * out.num_padding
        positions += [0] * out.num_padding
        return tensor([ids]), tensor([positions]), meta, tensor(sample_rows)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, return_logits: bool = False) -> StepResult:
        """Execute one step and sample; returns a ``StepResult`` aligned with the sampling ``ScheduledSeq``s."""
        self.kv.copy_blocks(out.copies)  # before the forward: copy-on-write sources and swaps must land first
        if out.is_empty:
            return StepResult([], None)
        samplers = [s for s in out.scheduled if s.samples]
        batch = self.decode_batch(out)
        if batch is not None:  # static buffers, padded to a bucket (the scheduler's pad rows included)
            logits = self.graphs.decode(batch, out.num_padding)  # (B, V)
            logits = logits[[i for i, s in enumerate(out.scheduled) if s.samples]].float()  # (B_s, V)
        else:
            input_ids, positions, meta, sample_rows = self.prepare(out)
            cache = PagedAttention(self.kv, meta, self.model.kernel_ops())
            hidden = self.model.hidden_states(input_ids, positions, cache)  # (1, T, hidden)
            logits = self.model.compute_logits(hidden[0, sample_rows]).float()[: len(samplers)]  # (B_s, V)
        rows, params, generators = [], [], []
        for i, s in enumerate(samplers):  # a parent about to fork draws n tokens from one row, generator i each
            for j in range(s.num_samples):
                rows.append(i)
                params.append(s.seq.request.params)
                generators.append(s.seq.request.generators[s.seq.index + j])
        tokens = sample(logits[rows], params, generators) if rows else []
        grouped, k = [], 0
        for s in samplers:
            grouped.append(tokens[k : k + s.num_samples])
            k += s.num_samples
        return StepResult(grouped, logits if return_logits else None)
