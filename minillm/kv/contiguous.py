"""The contiguous KV cache: every sequence gets a preallocated [S_max] slab per layer.

K and V are stored after RoPE, so a decode step computes K/V only for the new token and reads the rest:
the step costs O(S) attention instead of recomputing O(S²).  Slot s of sequence b holds position s.
Bytes per token = 2 (K and V) × layers × H_kv × D × bytes per element — see ``kv_bytes_per_token``.
``QuantizedKVCache`` stores int8/fp8 codes and per-(token, head) scales instead (``make_kv_cache`` picks by
``kv_cache_dtype``), and hands attention the dequantized rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.config import ModelConfig
from minillm.kernels.reference import sdpa_attention
from minillm.kernels.select import ops_for
from minillm.kv.quant import KVQuantizer, kv_quantizer


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.float16) -> int:
    """Bytes of K and V that one token adds to the cache, over all layers, in ``dtype``.

    Llama-2-7B (32 layers, 32 K/V heads of 128 dims) in fp16: 512 KiB per token.
    """
    ### BEGIN SOLUTION
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    ### END SOLUTION


def cached_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, *, scale: float) -> Tensor:
    """The attention of one step over the cache: L new queries per sequence against every filled slot.

    q [B, H_q, L, D]: the queries of the new tokens, which sit at ``positions`` [B, L] (int64) of their sequences;
    k, v [B, H_kv, S, D]: the cache's first S slots, the new tokens' K/V already written (slot s holds position s).
    Returns [B, H_q, L, D] in q's dtype.  Invariants: the query at position p attends to slots s ≤ p only — its
    own past and itself; slots beyond p are its future in a prefill chunk, or stale data past a shorter row's end
    in a batch of different lengths.  Query head h reads K/V head h // (H_q / H_kv) (H_q a multiple of H_kv; more
    in notebook 03).  Scores are scaled by ``scale`` and softmaxed in fp32.  Every position p ≥ 0 sees slot 0, so
    no row is empty.  Cost: B·H_q·L·S scores in memory — a plain reference; the kernels avoid that.
    """
    B, Hq, L, D = q.shape
    _, Hkv, S, _ = k.shape
    if positions.shape != (B, L) or k.shape != v.shape or k.shape[0] != B or Hq % Hkv:
        raise ValueError(f"need q [B, H_q, L, D], k, v [B, H_kv, S, D] and positions [B, L]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(positions.shape)}")
    ### BEGIN SOLUTION
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * L, D)  # the G query heads of a K/V head become extra rows: K/V are not copied
    scores = (qg @ k.transpose(-1, -2)).float().view(B, Hkv, G, L, S) * scale
    slots = torch.arange(S, device=q.device)
    visible = slots <= positions.to(q.device)[:, None, None, :, None]  # (B, 1, 1, L, S): slot s ≤ position p
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype).view(B, Hkv, G * L, S)
    return (probs @ v).view(B, Hq, L, D)
    ### END SOLUTION


class KVCache:
    """Preallocated K/V for ``batch_size`` sequences of up to ``max_len`` tokens.

    Call ``begin(positions)`` before each forward with the positions [B, L] of the tokens it feeds; each
    attention layer then calls ``attention(layer, q, k, v, scale)``, which writes the new K/V at those
    positions (``update``) and attends over the filled slots.  The mask lets query position p see slots s ≤ p,
    which also hides stale slots beyond a short sequence's end in a mixed-length batch.

    ``kernels`` ("auto" | "torch" | "native" | "triton", see ``kernels.select``) is resolved here, once, for the
    cache's device and dtype into the decode and prefill attention it calls (``self.ops``).
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernels: str = "auto"):
        if max_len > config.max_position_embeddings:
            raise ValueError(f"KV cache length {max_len} exceeds the model's context "
                             f"({config.max_position_embeddings} tokens)")
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self._allocate(shape, dtype, device)
        self.max_len = max_len
        self.ops = ops_for(kernels, self.k.device, dtype)
        self._positions: Tensor | None = None
        self._mask: Tensor | None = None
        self._causal = False
        self._used = 0
        self._start: int | None = None
        self._seq_lens: Tensor | None = None

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (layers, B, H_kv, S_max, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def begin(self, positions: Tensor, valid: Tensor | None = None) -> None:
        """positions [B, L] (int64) of the tokens about to be fed; all must be < max_len.  ``valid`` (padding
        marks) is accepted for interface parity and not needed: padding sits past a row's end and is masked."""
        B = self.k.shape[1]
        if positions.dim() != 2 or positions.shape[0] != B:
            raise ValueError(f"positions must be [B={B}, L], got {tuple(positions.shape)}")
        top = int(positions.max()) + 1
        if top > self.max_len:
            raise ValueError(f"position {top - 1} does not fit a KV cache of {self.max_len} tokens")
        self._positions = positions
        self._used = top
        # per step, not per layer: each is an ATen op (and .item() a sync) that 30 layers would repeat
        self._start = int(positions[0, 0]) if B == 1 else None
        self._seq_lens = positions[:, 0] + 1 if positions.shape[1] == 1 else None
        L = positions.shape[1]
        slots = torch.arange(top, device=positions.device)
        # one query at the newest position sees every slot up to it: no mask needed
        self._mask = None if B == 1 and L == 1 else (slots <= positions[:, None, :, None])  # (B, 1, L, S)
        # every row's queries are the last L filled slots: prefill_attention's causal rule is the mask (one sync
        # here per forward instead of one per layer)
        self._causal = L > 1 and bool((positions == slots[top - L :]).all())

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store k, v [B, H_kv, L, D] at the current positions, then attend q [B, H_q, L, D] -> [B, H_q, L, D]."""
        k_all, v_all, _ = self.update(layer, k, v)  # the mask is cached_attention's positions rule
        if q.shape[2] == 1:  # decode: one query per sequence over its first position + 1 slots
            # native on CPU (SDPA's fixed cost per call is several times the work here), flash-decoding on CUDA
            return self.ops.decode_attention(q[:, :, 0], k_all, v_all, self._seq_lens, sm_scale=scale)[:, :, None]
        if self._causal:  # Triton FlashAttention on CUDA, SDPA elsewhere
            return self.ops.prefill_attention(q, k_all, v_all, causal=True, sm_scale=scale)
        # rows at different positions (a chunk after rows of different lengths): each query sees slots ≤ its own
        return cached_attention(q, k_all, v_all, self._positions, scale=scale)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write k, v [B, H_kv, L, D] at the current positions; return K, V [B, H_kv, S, D] and the mask."""
        pos = self._positions
        if pos is None:
            raise RuntimeError("KVCache.begin(positions) must be called before the forward pass")
        ### BEGIN SOLUTION
        kc, vc = self.k[layer], self.v[layer]
        if pos.shape[0] == 1:  # one sequence: its positions are a contiguous run, a slice write suffices
            start = self._start
            kc[:, :, start : start + k.shape[2]] = k
            vc[:, :, start : start + v.shape[2]] = v
        else:
            b = torch.arange(pos.shape[0], device=pos.device)[:, None]  # (B, 1)
            kc[b, :, pos] = k.transpose(1, 2)  # indexed view is (B, L, H_kv, D)
            vc[b, :, pos] = v.transpose(1, 2)
        return kc[:, :, : self._used], vc[:, :, : self._used], self._mask
        ### END SOLUTION


class QuantizedKVCache(KVCache):
    """A ``KVCache`` that stores K and V as int8 or fp8 codes with one fp32 scale per (token, KV head)
    (``kv.quant.KVQuantizer``): ``k``, ``v`` are the codes (layers, B, H_kv, S_max, D) and ``k_scale``, ``v_scale``
    (layers, B, H_kv, S_max, 1) their scales — 1 + 4/D bytes per element instead of 2 or 4.

    ``update`` quantizes the new rows, stores them, and returns the filled slots *dequantized* to the activation
    dtype, so every query (the new tokens' own included) attends to exactly the K/V a later step will read back,
    and the decode/prefill kernels are the float cache's.  Cost: the dequantized copy is extra memory traffic —
    per layer and step, B · H_kv · S · D float writes and reads beside the 1-byte code reads, so on a CPU a
    quantized cache saves memory (capacity) but not decode time; a fused kernel would dequantize in registers.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernels: str = "auto", quantizer: KVQuantizer):
        self.quantizer, self.dtype = quantizer, dtype
        super().__init__(config, batch_size, max_len, dtype=dtype, device=device, kernels=kernels)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        code = self.quantizer.code_dtype
        self.k = torch.zeros(shape, dtype=code, device=device)  # (layers, B, H_kv, S_max, D) codes
        self.v = torch.zeros(shape, dtype=code, device=device)
        self.k_scale = torch.zeros(*shape[:-1], 1, device=device)  # (layers, B, H_kv, S_max, 1) fp32
        self.v_scale = torch.zeros(*shape[:-1], 1, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales, K and V."""
        return 2 * (self.k.nbytes + self.k_scale.nbytes)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Quantize and store k, v [B, H_kv, L, D] at the current positions; return the dequantized K, V
        [B, H_kv, S, D] (S = slots used) in the activation dtype, and the mask."""
        if self._positions is None:
            raise RuntimeError("KVCache.begin(positions) must be called before the forward pass")
        out = []
        for x, codes, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            q, s = self.quantizer.quantize(x)  # (B, H_kv, L, D) codes, (B, H_kv, L, 1) scales
            self._store(codes, q)
            self._store(scales, s)
            out.append(self.quantizer.dequantize(codes[:, :, : self._used], scales[:, :, : self._used], self.dtype))
        return out[0], out[1], self._mask

    def _store(self, dst: Tensor, src: Tensor) -> None:
        """dst (B, H_kv, S_max, X) <- src (B, H_kv, L, X) at the current positions (as ``KVCache.update``)."""
        pos = self._positions
        if pos.shape[0] == 1:  # one sequence: a contiguous run of positions
            dst[:, :, self._start : self._start + src.shape[2]] = src
        else:
            b = torch.arange(pos.shape[0], device=pos.device)[:, None]  # (B, 1)
            dst[b, :, pos] = src.transpose(1, 2)  # indexed view is (B, L, H_kv, X)


def make_kv_cache(config: ModelConfig, batch_size: int, max_len: int, *, dtype: torch.dtype,
                  device: torch.device | str, kernels: str = "auto", kv_cache_dtype: str = "auto") -> KVCache:
    """A contiguous cache storing K/V as ``kv_cache_dtype``: "auto" a float ``KVCache`` in ``dtype``, "int8"/"fp8" a
    ``QuantizedKVCache`` (attention still runs in ``dtype``).  ValueError for an unknown name or fp8 where torch
    cannot run it."""
    quantizer = kv_quantizer(kv_cache_dtype, device)
    if quantizer is None:
        return KVCache(config, batch_size, max_len, dtype=dtype, device=device, kernels=kernels)
    return QuantizedKVCache(config, batch_size, max_len, dtype=dtype, device=device, kernels=kernels,
                            quantizer=quantizer)


class SlidingWindowKVCache:
    """A KV cache that keeps only the last ``window`` tokens of each sequence, as a ring buffer.

    Position p lives in slot p % W, so memory is W tokens per sequence whatever the length: a 10 000-token
    sequence with W = 1 000 needs 10× less than the contiguous cache.  A query at position p sees keys at
    positions p - W < j ≤ p (Mistral's rule).  Same interface as ``KVCache``: ``begin`` then ``attention``.
    """

    def __init__(self, config: ModelConfig, batch_size: int, window: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernels: str = "auto"):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        shape = (config.num_layers, batch_size, config.num_kv_heads, window, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (layers, B, H_kv, W, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.window = window  # ``kernels`` is accepted for parity with KVCache: the ring's masked attention is SDPA
        self.slot_pos = torch.full((batch_size, window), -1, dtype=torch.long, device=device)  # -1: empty slot
        self._positions: Tensor | None = None
        self._old_slot_pos: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def begin(self, positions: Tensor, valid: Tensor | None = None) -> None:
        """positions [B, L] of the tokens about to be fed; ``valid`` [B, L] marks real tokens (False = padding,
        which must not evict real tokens from the ring)."""
        B, L = positions.shape if positions.dim() == 2 else (None, None)
        if B != self.k.shape[1]:
            raise ValueError(f"positions must be [B={self.k.shape[1]}, L], got {tuple(positions.shape)}")
        valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        self._positions = positions
        self._key_pos = torch.cat([self.slot_pos, positions.masked_fill(~valid, -1)], dim=1)  # (B, W + L)
        # which new tokens survive in the ring: each row's last W real ones, at slot position % W
        self._keep = []
        for b in range(B):
            idx = valid[b].nonzero()[:, 0][-self.window :]
            self._keep.append((idx, positions[b, idx] % self.window))
            self.slot_pos[b, positions[b, idx] % self.window] = positions[b, idx]

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Attend q [B, H_q, L, D] over the ring's old tokens and the L new ones, then store the newest W."""
        pos = self._positions
        if pos is None:
            raise RuntimeError("SlidingWindowKVCache.begin(positions) must be called before the forward pass")
        kc, vc = self.k[layer], self.v[layer]
        k_all = torch.cat([kc, k], dim=2)  # (B, H_kv, W + L, D): the ring as it was + the new tokens
        v_all = torch.cat([vc, v], dim=2)
        qp, kp = pos[:, None, :, None], self._key_pos[:, None, None, :]
        mask = (kp >= 0) & (kp <= qp) & (kp > qp - self.window)  # (B, 1, L, W + L); -1 = empty or padding
        out = sdpa_attention(q, k_all, v_all, mask, scale=scale)
        for b, (idx, slots) in enumerate(self._keep):
            kc[b][:, slots] = k[b][:, idx]
            vc[b][:, slots] = v[b][:, idx]
        return out
