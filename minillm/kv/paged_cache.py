"""Paged KV storage and attention over it: K/V tensors [layers, num_blocks, block_size, H_kv, D] addressed
through block tables (the bookkeeping is ``kv.block_manager``), and ``PagedAttention``, the ``cache`` argument of
one packed engine step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.config import ModelConfig
from minillm.kernels.select import KernelOps
from minillm.kv.block_allocator import BlockCopy, CopyKind
from minillm.kv.contiguous import kv_bytes_per_token


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
        # per-layer views made once: indexing self.k[layer] in every layer of every step is 2 ATen ops each
        self.layer_k, self.layer_v = self.k.unbind(0), self.v.unbind(0)
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
    decode_only: bool = False  # every packed row is a decode, in order (decode_rows = 0..T-1): the fast path


class PagedAttention:
    """The ``cache`` argument of ``Transformer.hidden_states`` for one packed step (batch dimension B = 1).

    ``ops``: the kernels it attends with (``kernels.select.ops_for``; the engine passes the model's own), their
    ``paged_decode_attention`` for the decode rows and ``prefill_attention`` for each prefill chunk.
    """

    def __init__(self, kv: PagedKVCache, meta: AttentionMetadata, ops: KernelOps):
        self.kv, self.meta, self.ops = kv, meta, ops

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Write k, v [1, H_kv, T, D] into their slots, then attend q [1, H_q, T, D] per sequence -> [1, H_q, T, D]."""
        _, Hq, T, D = q.shape
        m = self.meta
        kc, vc = self.kv.layer_k[layer], self.kv.layer_v[layer]  # (num_blocks, block_size, H_kv, D)
        real = T - m.num_padding
        # real rows (T - pads, H_kv, D) to their slots (native on CPU: one call, no index_put)
        self.ops.write_kv(kc, vc, k[0, :, :real].transpose(0, 1), v[0, :, :real].transpose(0, 1), m.slot_mapping)
        if m.decode_only:  # a pure decode step (steady state): no scatter of rows, no prefill loop
            out = self.ops.paged_decode_attention(q[0].transpose(0, 1), kc, vc, m.block_tables, m.seq_lens,
                                                  sm_scale=scale)  # (T, H_q, D)
            return out.transpose(0, 1)[None]
        out = q.new_empty(T, Hq, D)
        out[real:] = 0
        qt = q[0].transpose(0, 1)  # (T, H_q, D)
        if m.decode_rows.numel():  # the block manager built the tables: no per-layer input checks (no syncs)
            out[m.decode_rows] = self.ops.paged_decode_attention(qt[m.decode_rows], kc, vc, m.block_tables,
                                                                 m.seq_lens, sm_scale=scale)
        for p in m.prefills:
            if p.fresh:
                kk, vv = k[:, :, p.start : p.end], v[:, :, p.start : p.end]  # (1, H_kv, L, D)
            else:  # gather whole blocks, keep the first context_len rows: (1, H_kv, S, D)
                kk = kc[p.block_ids].flatten(0, 1)[: p.context_len].transpose(0, 1)[None]
                vv = vc[p.block_ids].flatten(0, 1)[: p.context_len].transpose(0, 1)[None]
            # causal with the L queries at the last L of the S keys (Triton on CUDA, SDPA elsewhere)
            o = self.ops.prefill_attention(q[:, :, p.start : p.end], kk, vv, causal=True, sm_scale=scale)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out.transpose(0, 1)[None]  # (1, H_q, T, D)
