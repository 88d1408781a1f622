"""Paged KV storage and attention over it: K/V tensors [layers, num_blocks, block_size, H_kv, D] addressed
through block tables (the bookkeeping is ``kv.block_manager``), and ``PagedAttention``, the ``cache`` argument of
one packed engine step.  ``QuantizedPagedKVCache`` stores int8/fp8 codes + per-(token, head) scales instead
(``make_paged_kv_cache`` picks by ``kv_cache_dtype``)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.config import ModelConfig
from minillm.dtypes import DType
from minillm.kernels.reference import attention_with_mass, kept_keys, paged_attention_with_mass, sdpa_attention
from minillm.kernels.select import KernelOps
from minillm.kv.block_allocator import BlockCopy, CopyKind
from minillm.kv.quant import KVQuantizer, kv_bytes_per_token, kv_quantizer


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: DType, kv_cache_dtype: str = "auto") -> int:
    """K and V of every layer for one block, in whole bytes: 2 × layers × block_size × H_kv × D × bytes/elem, or
    with a quantized ``kv_cache_dtype`` ("int8"/"fp8") 2 × layers × block_size × H_kv × (D + 4): 1-byte codes + an
    fp32 scale per (token, head).  The engine divides its byte budget by this, so a quantized cache gets more
    blocks.  ``dtype``: a torch dtype, or a name or byte width (``minillm.dtypes``) when a cost model prices a cache
    it never allocates; a sub-byte or scaled width ("int4": 0.5, or 0.5625 for int4 + scales) whose block comes to
    a fraction of a byte rounds up — a block is stored in whole bytes, and rounding up never lets a budget hold more
    blocks than fit.  Always an int; exact for every named width (each is a binary fraction, so the float product
    carries no rounding error)."""
    per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, kv_cache_dtype, dtype)
    return math.ceil(block_size * per_token)


class PagedKVCache:
    """K/V for all layers as [layers, num_blocks, block_size, H_kv, D] tensors, plus a host pool for swapping.

    Zero-filled, not empty: attention multiplies never-written padding slots by a zero probability, and 0 × NaN
    garbage would still be NaN.

    ``PagedAttention`` reaches the storage through three methods — ``write`` (new rows to their slots),
    ``decode_kv`` (the pools and block tables the paged decode kernel reads) and ``context_kv`` (one prefill chunk's
    keys and values) — so ``QuantizedPagedKVCache`` swaps the storage without touching attention or the model.

    ``track_mass``: also keep ``mass`` [1, num_blocks, block_size] fp32, each cached token's attention mass (H2O's
    score, ``kv.eviction.H2OPolicy``): ``PagedAttention`` zeroes a slot when its token is written and adds what
    every layer's queries put on it; block copies (copy-on-write, swap) move it with the K/V.  4 bytes per slot.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                 device: torch.device | str, num_host_blocks: int = 0, track_mass: bool = False):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.dtype, self.block_size = dtype, block_size
        self.k, self.v = self._zeros(shape, device), self._zeros(shape, device)
        # per-layer views made once: indexing self.k[layer] in every layer of every step is 2 ATen ops each
        self.layer_k, self.layer_v = self.k.unbind(0), self.v.unbind(0)
        self.host_k = self.host_v = None
        if num_host_blocks:
            host_shape = (config.num_layers, num_host_blocks, *shape[2:])
            pin = torch.device(device).type == "cuda"  # page-locked: device<->host copies run at full PCIe speed
            self.host_k, self.host_v = self._zeros(host_shape, "cpu", pin), self._zeros(host_shape, "cpu", pin)
        self.mass = self.host_mass = None
        if track_mass:  # [1, blocks, block_size]: a leading dim so block copies index it like K/V
            self.mass = torch.zeros(1, num_blocks, block_size, device=device)
            self.host_mass = torch.zeros(1, num_host_blocks, block_size) if num_host_blocks else None

    def _zeros(self, shape: tuple[int, ...], device: torch.device | str, pin: bool = False) -> Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)

    def _stores(self) -> list[tuple[Tensor, Tensor | None]]:
        """Every (device tensor, host tensor or None) pair indexed [layers, block, ...]: what a block copy moves."""
        mass = [] if self.mass is None else [(self.mass, self.host_mass)]
        return [(self.k, self.host_k), (self.v, self.host_v), *mass]

    @property
    def nbytes(self) -> int:
        """Device bytes of K and V (with their scales, when quantized)."""
        return sum(t.nbytes for t, _ in self._stores())

    def block_mass(self, block_ids: list[int]) -> list[float]:
        """The attention mass each physical block's tokens hold (``track_mass``), summed over its slots: one
        device read (H2O's eviction reads it only when a sequence is over its budget)."""
        return self.mass[0, block_ids].sum(1).tolist()

    def add_mass(self, block_tables: Tensor, mass: Tensor) -> None:
        """Add mass [B, max_blocks · block_size] (logical key positions of each row) to the slots the tables
        [B, max_blocks] map them to; negative (evicted) entries are skipped."""
        bs = self.block_size
        tables = block_tables.long()
        slots = (tables[:, :, None] * bs + torch.arange(bs, device=tables.device)).flatten(1)  # (B, S_max)
        held = (tables >= 0).repeat_interleave(bs, 1)
        self.mass.view(-1).index_add_(0, slots[held], mass[held])

    # ---- what PagedAttention calls ---------------------------------------------------------------------------
    def write(self, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor, ops: KernelOps) -> None:
        """Store rows k, v [T, H_kv, D] at their flat slots [T] (native on CPU: one call, no index_put)."""
        ops.write_kv(self.layer_k[layer], self.layer_v[layer], k, v, slot_mapping)

    def decode_plan(self, block_tables: Tensor) -> object:
        """Per-step work shared by every layer's decode (none here: the block tables as they are)."""
        return block_tables

    def decode_kv(self, layer: int, plan: object) -> tuple[Tensor, Tensor, Tensor]:
        """(k_cache, v_cache [blocks, block_size, H_kv, D] in the activation dtype, block_tables [B_d, max_blocks])
        for ``ops.paged_decode_attention``; ``plan`` is this step's ``decode_plan``."""
        return self.layer_k[layer], self.layer_v[layer], plan

    def context_kv(self, layer: int, chunk: PrefillChunk, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [1, H_kv, S, D] a prefill chunk attends to: its own new rows k, v [1, H_kv, L, D] when it
        has no earlier context, else its blocks gathered (whole blocks, the first ``context_len`` rows kept)."""
        if chunk.fresh:
            return k, v
        kc, vc = self.layer_k[layer], self.layer_v[layer]
        return (kc[chunk.block_ids].flatten(0, 1)[: chunk.context_len].transpose(0, 1)[None],
                vc[chunk.block_ids].flatten(0, 1)[: chunk.context_len].transpose(0, 1)[None])

    # ---- block copies ----------------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run the BlockManager's copies in order (all layers at once).  A run of same-kind copies becomes one
        gather + scatter when no copy reads a block an earlier one writes; swap copies move 2·layers·block bytes
        each over the host link, copy-on-write the same within device memory."""
        for kind, group in itertools.groupby(copies, key=lambda c: c.kind):
            group = list(group)
            pools = [self._pool_pair(kind, device, host) for device, host in self._stores()]
            srcs, dsts = [c.src for c in group], [c.dst for c in group]
            if kind is not CopyKind.COPY_ON_WRITE or set(dsts).isdisjoint(srcs):
                # host->device may overlap (the forward waits on the stream); device->host must land before the
                # host scatter reads it, so it blocks
                asynchronous = kind is CopyKind.SWAP_IN
                for src_pool, dst_pool in pools:
                    src = torch.tensor(srcs, device=src_pool.device)
                    dst = torch.tensor(dsts, device=dst_pool.device)
                    dst_pool[:, dst] = src_pool[:, src].to(dst_pool.device, non_blocking=asynchronous)
            else:
                for c in group:
                    for src_pool, dst_pool in pools:
                        dst_pool[:, c.dst] = src_pool[:, c.src]

    @staticmethod
    def _pool_pair(kind: CopyKind, device: Tensor, host: Tensor | None) -> tuple[Tensor, Tensor]:
        """(source, destination) of one stored tensor for a copy of ``kind``."""
        if kind is CopyKind.COPY_ON_WRITE:
            return device, device
        if host is None:
            raise RuntimeError("a swap was requested but the cache has no host blocks (num_host_blocks=0)")
        return (device, host) if kind is CopyKind.SWAP_OUT else (host, device)


class QuantizedPagedKVCache(PagedKVCache):
    """A ``PagedKVCache`` storing int8/fp8 codes (``k``, ``v``: [layers, num_blocks, block_size, H_kv, D], 1 byte
    each) and fp32 scales (``k_scale``, ``v_scale``: [..., H_kv, 1]), one per (token, KV head) (``kv.quant``).

    Attention reads dequantized rows in the activation dtype, so the kernels are the float cache's:
    - decode: the blocks this step's tables reference are dequantized once per layer into a compact float pool
      and the tables renumbered into it (``decode_plan`` does the renumbering once per step); the paged decode
      kernel ``kernels.select`` chose (native C on CPU, Triton on CUDA) then runs unchanged.  Cost: the touched
      blocks are read as codes and written + read again as floats — on a CPU more traffic than a float cache,
      so this buys capacity (~2× tokens vs bf16, ~4× vs fp32), not decode speed; a kernel that dequantizes in
      registers would buy both.
    - prefill: the chunk's blocks, its own new rows included, gathered and dequantized — every query sees exactly
      the K/V a later decode step reads back, so chunked and whole prefills, and prefix-cache hits, agree.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                 device: torch.device | str, num_host_blocks: int = 0, quantizer: KVQuantizer,
                 track_mass: bool = False):
        self.quantizer = quantizer
        super().__init__(config, num_blocks, block_size, dtype=dtype, device=device, num_host_blocks=num_host_blocks,
                         track_mass=track_mass)
        scale_shape = (*self.k.shape[:-1], 1)
        self.k_scale = torch.zeros(scale_shape, device=device)  # [layers, num_blocks, block_size, H_kv, 1] fp32
        self.v_scale = torch.zeros(scale_shape, device=device)
        self.layer_k_scale, self.layer_v_scale = self.k_scale.unbind(0), self.v_scale.unbind(0)
        self.host_k_scale = self.host_v_scale = None
        if num_host_blocks:
            host_shape = (self.k.shape[0], num_host_blocks, *scale_shape[2:])
            pin = torch.device(device).type == "cuda"
            self.host_k_scale = torch.zeros(host_shape, pin_memory=pin)
            self.host_v_scale = torch.zeros(host_shape, pin_memory=pin)

    def _zeros(self, shape: tuple[int, ...], device: torch.device | str, pin: bool = False) -> Tensor:
        return torch.zeros(shape, dtype=self.quantizer.code_dtype, device=device, pin_memory=pin)

    def _stores(self) -> list[tuple[Tensor, Tensor | None]]:
        return [*super()._stores(), (self.k_scale, self.host_k_scale), (self.v_scale, self.host_v_scale)]

    def _layer(self, layer: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        return ((self.layer_k[layer], self.layer_k_scale[layer]), (self.layer_v[layer], self.layer_v_scale[layer]))

    def write(self, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor, ops: KernelOps) -> None:
        """Quantize rows k, v [T, H_kv, D] and store codes and scales at their flat slots [T]."""
        for x, (codes, scales) in zip((k, v), self._layer(layer), strict=True):
            q, s = self.quantizer.quantize(x)  # (T, H_kv, D), (T, H_kv, 1)
            codes.view(-1, *codes.shape[2:])[slot_mapping] = q  # (blocks · block_size, H_kv, D) flat slots
            scales.view(-1, *scales.shape[2:])[slot_mapping] = s

    def decode_plan(self, block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """(the distinct blocks the tables reference [U] long, the tables renumbered into 0..U-1 [B_d, max_blocks]
        int32): computed once per step, used by every layer."""
        blocks, inverse = torch.unique(block_tables.long(), return_inverse=True)
        return blocks, torch.where(block_tables < 0, -1, inverse).to(torch.int32)  # evicted entries stay negative

    def decode_kv(self, layer: int, plan: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The referenced blocks dequantized: (k, v [U, block_size, H_kv, D] in the activation dtype, tables)."""
        blocks, tables = plan
        k, v = (self.quantizer.dequantize(codes[blocks], scales[blocks], self.dtype)
                for codes, scales in self._layer(layer))
        return k, v, tables

    def context_kv(self, layer: int, chunk: PrefillChunk, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The chunk's first ``context_len`` positions, read back from the cache (its own rows included) and
        dequantized: [1, H_kv, S, D] each."""
        n = chunk.context_len
        return tuple(self.quantizer.dequantize(codes[chunk.block_ids].flatten(0, 1)[:n],
                                               scales[chunk.block_ids].flatten(0, 1)[:n], self.dtype)
                     .transpose(0, 1)[None] for codes, scales in self._layer(layer))


def make_paged_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                        device: torch.device | str, num_host_blocks: int = 0,
                        kv_cache_dtype: str = "auto", track_mass: bool = False) -> PagedKVCache:
    """The paged cache for ``kv_cache_dtype``: "auto" stores K/V in ``dtype``, "int8"/"fp8" a
    ``QuantizedPagedKVCache``; ``track_mass`` for a mass-scored eviction policy (H2O).  ValueError for an unknown
    name or fp8 where torch cannot run it."""
    quantizer = kv_quantizer(kv_cache_dtype, device)
    kw = {"dtype": dtype, "device": device, "num_host_blocks": num_host_blocks, "track_mass": track_mass}
    if quantizer is None:
        return PagedKVCache(config, num_blocks, block_size, **kw)
    return QuantizedPagedKVCache(config, num_blocks, block_size, **kw, quantizer=quantizer)


@dataclass(frozen=True)
class PrefillChunk:
    """A chunk of ``end - start`` packed rows of one sequence whose keys are its first ``context_len`` positions."""

    start: int
    end: int
    context_len: int
    block_ids: Tensor  # [ceil(context_len / block_size)] long: the blocks holding those positions (-1: evicted)

    @property
    def fresh(self) -> bool:
        """No earlier context: the chunk's own new K/V are all the keys (no gather needed)."""
        return self.context_len == self.end - self.start


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each packed token's K/V goes and what each query attends to.  T packed tokens, B_d decodes."""

    slot_mapping: Tensor  # [T] long: cache slot of each token
    decode_rows: Tensor  # [B_d] long: packed rows that are single-token decodes
    block_tables: Tensor  # [B_d, max_blocks] int32, padded with 0; -1 (kv.eviction.EVICTED): a freed block
    seq_lens: Tensor  # [B_d] int32: keys each decode query sees (itself included)
    prefills: list[PrefillChunk]
    num_padding: int = 0  # pad rows at the end of the T packed rows: no KV slot, no attention (output 0)
    decode_only: bool = False  # every packed row is a decode, in order (decode_rows = 0..T-1): the fast path
    window: int = 0  # > 0: each query sees only its last ``window`` keys and the first ``sinks`` (kv.eviction)
    sinks: int = 0
    track_mass: bool = False  # accumulate each key's attention mass into the cache (H2O; window > 0 with it)
    layer_windows: tuple[int, ...] = ()  # local:global models: each layer's window (0: global), over ``window``

    def layer_window(self, layer: int) -> tuple[int, int]:
        """(window, sinks) layer ``layer`` masks by: its own window in a local:global model, else the step's."""
        return (self.layer_windows[layer], 0) if self.layer_windows else (self.window, self.sinks)


class PagedAttention:
    """The ``cache`` argument of ``Transformer.hidden_states`` for one packed step (batch dimension B = 1).

    ``ops``: the kernels it attends with (``kernels.select.ops_for``; the engine passes the model's own), their
    ``paged_decode_attention`` for the decode rows and ``prefill_attention`` for each prefill chunk.
    With ``meta.window`` (a ``kv.eviction.KVEvictionPolicy``'s window and sinks) every query sees only the keys
    ``kernels.reference.kept_keys`` keeps: the decode kernel gets them as arguments, each prefill chunk runs SDPA
    under that mask over its gathered blocks (whole tables, evicted entries included as block 0: O(context) gather
    per chunk, O(kept keys) attention weights that are not zero).  A block whose table entry is negative (evicted)
    is never attended to, whatever the window says.
    With ``meta.track_mass`` (H2O) every query runs the gather + softmax reference, which also returns the
    probabilities it put on each key; their sum over heads and queries is added to ``kv.mass`` for every layer
    (the new tokens' slots are zeroed once, when the step starts).  That costs the reference's gather per decode
    row and the [H_q, L, S] probabilities per prefill chunk instead of the kernels: the price of H2O's score.
    """

    def __init__(self, kv: PagedKVCache, meta: AttentionMetadata, ops: KernelOps):
        self.kv, self.meta, self.ops = kv, meta, ops
        self.decode_plan = kv.decode_plan(meta.block_tables)  # once per step, read by every layer
        if meta.track_mass:  # a slot's mass restarts with the token written there (before any layer adds to it)
            kv.mass.view(-1)[meta.slot_mapping] = 0

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Write k, v [1, H_kv, T, D] into their slots, then attend q [1, H_q, T, D] per sequence -> [1, H_q, T, D]."""
        _, Hq, T, D = q.shape
        m = self.meta
        real = T - m.num_padding
        # real rows (T - pads, H_kv, D) to their slots
        self.kv.write(layer, k[0, :, :real].transpose(0, 1), v[0, :, :real].transpose(0, 1), m.slot_mapping, self.ops)
        if m.track_mass:
            return self._attention_with_mass(layer, q, k, v, scale)
        if m.decode_rows.numel():
            kc, vc, tables = self.kv.decode_kv(layer, self.decode_plan)  # (blocks, block_size, H_kv, D)
        w, sinks = m.layer_window(layer)
        window = {"window": w, "sinks": sinks} if w else {}  # no new kwargs on the default path
        if m.decode_only:  # a pure decode step (steady state): no scatter of rows, no prefill loop
            out = self.ops.paged_decode_attention(q[0].transpose(0, 1), kc, vc, tables, m.seq_lens,
                                                  sm_scale=scale, **window)  # (T, H_q, D)
            return out.transpose(0, 1)[None]
        out = q.new_empty(T, Hq, D)
        out[real:] = 0
        qt = q[0].transpose(0, 1)  # (T, H_q, D)
        if m.decode_rows.numel():  # the block manager built the tables: no per-layer input checks (no syncs)
            out[m.decode_rows] = self.ops.paged_decode_attention(qt[m.decode_rows], kc, vc, tables, m.seq_lens,
                                                                 sm_scale=scale, **window)
        for p in m.prefills:
            kk, vv = self.kv.context_kv(layer, p, k[:, :, p.start : p.end], v[:, :, p.start : p.end])
            qc = q[:, :, p.start : p.end]
            if w:  # SDPA under the eviction mask (evicted blocks gathered as some block: masked, never used)
                mask = self._chunk_mask(p, kk.shape[2], qc.shape[2], w, sinks)
                o = sdpa_attention(qc, kk, vv, mask[None, None], scale=scale)
            else:  # causal with the L queries at the last L of the S keys (Triton on CUDA, SDPA elsewhere)
                o = self.ops.prefill_attention(qc, kk, vv, causal=True, sm_scale=scale)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out.transpose(0, 1)[None]  # (1, H_q, T, D)

    def _chunk_mask(self, p: PrefillChunk, S: int, L: int, window: int, sinks: int) -> Tensor:
        """Which of a prefill chunk's S keys each of its L queries (the last L positions) attends to: [L, S] bool,
        ``kept_keys`` under ``window`` and ``sinks`` and never a key of an evicted block."""
        positions = torch.arange(S, device=p.block_ids.device)
        held = (p.block_ids >= 0).repeat_interleave(self.kv.block_size)[:S]  # (S,)
        return kept_keys(positions[S - L :, None], positions, window, sinks) & held

    def _attention_with_mass(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """``attention`` (K/V already written) by the reference, adding each key's mass to ``kv.mass``."""
        _, Hq, T, D = q.shape
        m = self.meta
        out = q.new_zeros(T, Hq, D)  # pad rows stay 0
        qt = q[0].transpose(0, 1)  # (T, H_q, D)
        if m.decode_rows.numel():
            kc, vc, tables = self.kv.decode_kv(layer, self.decode_plan)
            o, mass = paged_attention_with_mass(qt[m.decode_rows], kc, vc, tables, m.seq_lens, scale, m.window,
                                                m.sinks)  # (B_d, H_q, D), (B_d, S_max)
            out[m.decode_rows] = o
            self.kv.add_mass(m.block_tables, mass)  # the physical tables (a quantized cache renumbers its own)
        bs = self.kv.block_size
        for p in m.prefills:
            kk, vv = self.kv.context_kv(layer, p, k[:, :, p.start : p.end], v[:, :, p.start : p.end])
            qc = q[:, :, p.start : p.end]
            S = kk.shape[2]
            mask = self._chunk_mask(p, S, qc.shape[2], m.window, m.sinks)
            o, mass = attention_with_mass(qc, kk, vv, mask[None, None], scale=scale)
            out[p.start : p.end] = o[0].transpose(0, 1)
            padded = mass.new_zeros(1, p.block_ids.numel() * bs)
            padded[:, :S] = mass
            self.kv.add_mass(p.block_ids[None], padded)  # (1, blocks · block_size)
        return out.transpose(0, 1)[None]  # (1, H_q, T, D)
