"""Paged KV storage and the model runner: every engine step is one packed forward pass.

All tokens the scheduler picked — decode tokens of running sequences and prefill chunks of new ones — are
concatenated into a single [1, T] batch with their own positions (no padding: a 500-token prefill chunk and
twenty 1-token decodes cost T = 520 rows of every linear layer, which is where the weights are read once for all).
Attention is the only per-sequence operation; ``PagedAttention`` does it through the block tables:

- new K/V rows are scattered into their slots (``slot = block_id * block_size + offset``, from the BlockManager);
- decode tokens go together through ``minillm.kernels.paged_decode_attention`` (Triton on CUDA, gather + softmax
  reference elsewhere), or on CPU the native ``cpu_gemv.paged_decode_attention``;
- each prefill chunk gathers its sequence's blocks (earlier context + the chunk) and runs causal
  ``minillm.kernels.flash_attention`` (Triton on CUDA, SDPA elsewhere) with the queries at the end of the keys.

Only the last row of each sequence that samples goes through the LM head (V × hidden, the largest matrix).

Padding rows (``SchedulerOutput.num_padding``: finished members of a fixed-shape static/dynamic batch) are appended
after the real tokens: a pad token at position 0 through every linear layer and the LM head, as a padded batch
computes them, then discarded.  They own no KV slot and skip attention (their output there is zero); at the
context lengths of a batch that is a small part of a row's cost, so the padding is priced slightly low, not high.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import ModelConfig
from .kernels import cpu_gemv, flash_attention, paged_decode_attention
from .kv_cache import kv_bytes_per_token
from .model import Transformer
from .paged import BlockCopy, BlockManager, CopyKind
from .sampling import sample
from .scheduler import SchedulerOutput


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block: 2 × layers × block_size × H_kv × D × bytes/elem."""
    return kv_bytes_per_token(config, dtype) * block_size


class PagedKVCache:
    """K/V for all layers as [layers, num_blocks, block_size, H_kv, D] tensors, plus a host pool for swapping.

    Zero-filled, not empty: attention multiplies never-written padding slots by a zero probability, and 0 × NaN
    garbage would still be NaN.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                 device: torch.device | str, num_host_blocks: int = 0):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.host_k = self.host_v = None
        if num_host_blocks:
            host_shape = (config.num_layers, num_host_blocks, *shape[2:])
            pin = torch.device(device).type == "cuda"  # page-locked: device<->host copies run at full PCIe speed
            self.host_k = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
            self.host_v = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        """Device bytes of K and V."""
        return 2 * self.k.numel() * self.k.element_size()

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run the BlockManager's copies in order (all layers at once).  A run of same-kind copies becomes one
        gather + scatter when no copy reads a block an earlier one writes; swap copies move 2·layers·block bytes
        each over the host link, copy-on-write the same within device memory."""
        for kind, group in itertools.groupby(copies, key=lambda c: c.kind):
            group = list(group)
            src_k, src_v, dst_k, dst_v = self._pools(kind)
            srcs, dsts = [c.src for c in group], [c.dst for c in group]
            if kind is not CopyKind.COPY_ON_WRITE or set(dsts).isdisjoint(srcs):
                src = torch.tensor(srcs, device=src_k.device)
                dst = torch.tensor(dsts, device=dst_k.device)
                # host->device may overlap (the forward waits on the stream); device->host must land before the
                # host scatter reads it, so it blocks
                asynchronous = kind is CopyKind.SWAP_IN
                dst_k[:, dst] = src_k[:, src].to(dst_k.device, non_blocking=asynchronous)
                dst_v[:, dst] = src_v[:, src].to(dst_v.device, non_blocking=asynchronous)
            else:
                for c in group:
                    dst_k[:, c.dst] = src_k[:, c.src]
                    dst_v[:, c.dst] = src_v[:, c.src]

    def _pools(self, kind: CopyKind) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if kind is CopyKind.COPY_ON_WRITE:
            return self.k, self.v, self.k, self.v
        if self.host_k is None:
            raise RuntimeError("a swap was requested but the cache has no host blocks (num_host_blocks=0)")
        if kind is CopyKind.SWAP_OUT:
            return self.k, self.v, self.host_k, self.host_v
        return self.host_k, self.host_v, self.k, self.v


@dataclass(frozen=True)
class PrefillChunk:
    """A chunk of ``end - start`` packed rows of one sequence whose keys are its first ``context_len`` positions."""

    start: int
    end: int
    context_len: int
    block_ids: Tensor  # [ceil(context_len / block_size)] long: the blocks holding those positions

    @property
    def fresh(self) -> bool:
        """No earlier context: the chunk's own new K/V are all the keys (no gather needed)."""
        return self.context_len == self.end - self.start


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each packed token's K/V goes and what each query attends to.  T packed tokens, B_d decodes."""

    slot_mapping: Tensor  # [T] long: cache slot of each token
    decode_rows: Tensor  # [B_d] long: packed rows that are single-token decodes
    block_tables: Tensor  # [B_d, max_blocks] int32, padded with 0
    seq_lens: Tensor  # [B_d] int32: keys each decode query sees (itself included)
    prefills: list[PrefillChunk]
    num_padding: int = 0  # pad rows at the end of the T packed rows: no KV slot, no attention (output 0)


class PagedAttention:
    """The ``cache`` argument of ``Transformer.hidden_states`` for one packed step (batch dimension B = 1)."""

    def __init__(self, kv: PagedKVCache, meta: AttentionMetadata, impl: str = "auto"):
        self.kv, self.meta, self.impl = kv, meta, impl

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Write k, v [1, H_kv, T, D] into their slots, then attend q [1, H_q, T, D] per sequence -> [1, H_q, T, D]."""
        _, Hq, T, D = q.shape
        Hkv, m = k.shape[1], self.meta
        kc, vc = self.kv.k[layer], self.kv.v[layer]  # (num_blocks, block_size, H_kv, D)
        real = T - m.num_padding
        kc.view(-1, Hkv, D)[m.slot_mapping] = k[0, :, :real].transpose(0, 1)  # real rows (T - pads, H_kv, D) to slots
        vc.view(-1, Hkv, D)[m.slot_mapping] = v[0, :, :real].transpose(0, 1)
        out = q.new_empty(T, Hq, D)
        out[real:] = 0
        qt = q[0].transpose(0, 1)  # (T, H_q, D)
        if m.decode_rows.numel() and self.impl == "auto" and q.device.type == "cpu" and cpu_gemv.available() \
                and q.dtype in (torch.float32, torch.bfloat16):
            # CPU: the native kernel reads K/V through the tables in place (no gather, no per-call checks)
            out[m.decode_rows] = cpu_gemv.paged_decode_attention(qt[m.decode_rows], kc, vc, m.block_tables,
                                                                 m.seq_lens, scale)
        elif m.decode_rows.numel():
            out[m.decode_rows] = paged_decode_attention(qt[m.decode_rows], kc, vc, m.block_tables, m.seq_lens,
                                                        sm_scale=scale, impl=self.impl)
        for p in m.prefills:
            if p.fresh:
                kk, vv = k[:, :, p.start : p.end], v[:, :, p.start : p.end]  # (1, H_kv, L, D)
            else:  # gather whole blocks, keep the first context_len rows: (1, H_kv, S, D)
                kk = kc[p.block_ids].flatten(0, 1)[: p.context_len].transpose(0, 1)[None]
                vv = vc[p.block_ids].flatten(0, 1)[: p.context_len].transpose(0, 1)[None]
            # causal with the L queries at the last L of the S keys (Triton on CUDA, SDPA elsewhere)
            o = flash_attention(q[:, :, p.start : p.end], kk, vv, causal=True, sm_scale=scale, impl=self.impl)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out.transpose(0, 1)[None]  # (1, H_q, T, D)


@dataclass
class StepResult:
    """Sampled tokens, one list per sampling ``ScheduledSeq`` (n tokens for a parent about to fork); the fp32
    logits [B_s, V] they came from when asked for."""

    tokens: list[list[int]]
    logits: Tensor | None


class ModelRunner:
    """Runs a ``SchedulerOutput``: block copies, one packed forward, the LM head on sampling rows, sampling."""

    def __init__(self, model: Transformer, kv: PagedKVCache, block_manager: BlockManager, attention_impl: str = "auto"):
        self.model, self.kv, self.block_manager, self.attention_impl = model, kv, block_manager, attention_impl

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
                                 prefills, out.num_padding)
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
        input_ids, positions, meta, sample_rows = self.prepare(out)
        cache = PagedAttention(self.kv, meta, self.attention_impl)
        hidden = self.model.hidden_states(input_ids, positions, cache)  # (1, T, hidden)
        samplers = [s for s in out.scheduled if s.samples]
        logits = self.model.compute_logits(hidden[0, sample_rows]).float()[: len(samplers)]  # (B_s, V), pads cut
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
