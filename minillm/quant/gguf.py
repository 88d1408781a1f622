"""GGUF blocks straight into packed weights: Q4_1 and Q4_0 -> ``Int4Weight`` (group 32), Q8_0 -> ``Int8Weight``
(group 32), F32/F16 -> plain tensors — no float round trip, so the model runs exactly the weights llama.cpp runs
(K-quants are re-blocked into the same forms, below).

A Q4_1 row of K weights is K/32 blocks of 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles (the ``Int4Weight``
packing).  A Q4_0 row is K/32 blocks of 18 bytes: fp16 d, the same 16 bytes of nibbles, w = d · (q − 8) — a
symmetric ``Int4Weight`` (no mins: every kernel takes m = −8·d in fp32, exact), so Q4_0 runs on the int4 kernels
from its own 18 bytes per block, dequantizing bit for bit as gguf does.  A Q8_0
row is K/32 blocks of 34 bytes: fp16 d, 32 int8 codes.  Tensor names are mapped to Hugging
Face's (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

llama.cpp's converter permutes the rows of q_proj and k_proj (per head, it interleaves the two rotary halves:
``w.reshape(H, 2, D/2, K).swapaxes(1, 2)``) for its RoPE kernel.  transformers undoes that when it loads a GGUF;
``_unpermute_rows`` applies the same inverse to whole packed rows (codes, scales and any mins move together, as a row
permutation of W is a row permutation of every per-row quantity).

**K-quants and 5-bit blocks** (what most downloaded files hold: ``Q4_K_M`` is Q4_K with Q6_K for the LM head and
some ``attn_v``/``ffn_down``; tensors whose rows are not a multiple of 256 fall back to Q5_0/Q8_0) are re-blocked
into the same two forms at load, so they run on the int4/int8 kernels instead of as fp32:
- Q4_K (super-blocks of 256: fp16 d and dmin, eight 6-bit scales and mins, 4-bit codes) -> ``Int4Weight`` group 32
  in K records (``quant.weight``'s module docstring): each 32-weight sub-block's codes as they are (re-paired as
  Q4_1's), the two levels kept — per row and super-block (d, sc[0..7]) and (−dmin, mn[0..7]), a byte per sub-value
  — so every reader computes d · sc and −dmin · mn in fp32 as gguf does: exact, 4.625 bits a weight against the
  file's 4.5.
- Q5_0 (fp16 d, 5-bit codes, w = d · (q − 16)) -> ``Int8Weight`` group 32 with codes q − 16: exact.
- Q6_K -> ``Q6KWeight``: the super-blocks as the file has them (6.5625 bits a weight), read by their own kernels
  (``kernels/cpu/quant.py``'s ``q6k_linear``; elsewhere its expanded ``Int8Weight`` of group 16): exact.  Stacked
  beside another type (a Q4_K_M layer's Q6_K attn_v beside Q4_K q/k) it becomes Q8_0 blocks, as below.
- Q5_K, Q5_1 -> ``Int8Weight`` group 32 (Q8_0's blocks) re-quantized from gguf's exact fp32 dequantization:
  d = max|w| / 127 in fp16, codes rounded against that d, so each weight moves by at most half an 8-bit step
  (1/254 of its block's largest) — a quarter or less of the file's own 5-bit step.
Lower-bit K-quants (Q2_K, Q3_K) and the IQ types are refused with the fix (convert, or load the original).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from minillm.quant.weight import K_RECORD, Q6K_BYTES, QK_K, Int4Weight, Int8Weight, Q6KWeight, quantize_q8_0

GGUF_BLOCK = 32  # QK4_1 = QK4_0 = QK8_0 = 32 weights per block
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` (and the embedding, norm, head)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"no Hugging Face name known for GGUF tensor {gguf_name!r} (Llama-family names only)")


def unpermute_index(rows: int, n_head: int) -> Tensor:
    """Row order that undoes llama.cpp's q/k permutation: ``w_hf = w_gguf[index]`` for a [rows, K] weight with
    ``n_head`` heads (transformers' ``_reverse_permute_weights`` applied to the row numbers)."""
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    idx = torch.arange(rows).reshape(n_head, rows // n_head // 2, 2)
    return idx.transpose(1, 2).reshape(rows)


def _rows(t) -> tuple[np.ndarray, int, int]:
    K, N = (int(s) for s in t.shape[:2])  # GGUF lists ne0 (the contiguous dim, K) first
    return np.array(t.data).reshape(N, -1), N, K  # a copy: the reader's arrays are read-only memory maps


def q4_1_to_int4(raw: np.ndarray, N: int, K: int) -> Int4Weight:
    """Q4_1 bytes (writable, C-contiguous) [N, K/32 · 20] -> ``Int4Weight`` (fp16 d and m, group 32): the bytes
    reinterpreted, no arithmetic."""
    b = torch.from_numpy(raw).view(N, K // GGUF_BLOCK, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).view(N, K // GGUF_BLOCK)
    m = b[..., 2:4].contiguous().view(torch.float16).view(N, K // GGUF_BLOCK)
    return Int4Weight(b[..., 4:].reshape(N, K // 2).contiguous(), d, m, GGUF_BLOCK)


def q4_0_to_int4(raw: np.ndarray, N: int, K: int) -> Int4Weight:
    """Q4_0 bytes (writable, C-contiguous) [N, K/32 · 18] -> symmetric ``Int4Weight`` (fp16 d, no mins, group 32):
    the codes and d as they are, m = −8·d taken in fp32 by whatever reads the weight (d · q + m = d · (q − 8)
    exactly, for every code and every finite fp16 d).  Cost: one copy of the bytes, no arithmetic."""
    b = torch.from_numpy(raw).view(N, K // GGUF_BLOCK, 18)
    d = b[..., 0:2].contiguous().view(torch.float16).view(N, K // GGUF_BLOCK)
    return Int4Weight(b[..., 2:].reshape(N, K // 2).contiguous(), d, None, GGUF_BLOCK)


def q8_0_to_int8(raw: np.ndarray, N: int, K: int) -> Int8Weight:
    """Q8_0 bytes (writable, C-contiguous) [N, K/32 · 34] -> ``Int8Weight`` (fp16 scales, group 32): the bytes
    reinterpreted, no arithmetic."""
    b = torch.from_numpy(raw).view(N, K // GGUF_BLOCK, 34)
    d = b[..., 0:2].contiguous().view(torch.float16).view(N, K // GGUF_BLOCK)
    q = b[..., 2:].contiguous().view(torch.int8).reshape(N, K)
    return Int8Weight(q, d, GGUF_BLOCK)


def _blocks(raw: np.ndarray, N: int, K: int, qk: int, size: int, kind: str) -> np.ndarray:
    """``raw`` as [N · K / qk, size] blocks of ``kind``, or ValueError when K or the byte count does not fit."""
    if K % qk:
        raise ValueError(f"a {kind} row has a multiple of {qk} weights, got K={K}")
    if raw.size != N * (K // qk) * size:
        raise ValueError(f"{kind} has {size} bytes per {qk} weights: {N} rows of K={K} need "
                         f"{N * (K // qk) * size} bytes, got {raw.size}")
    return raw.reshape(N * (K // qk), size)


def q4_k_to_int4(raw: np.ndarray, N: int, K: int) -> Int4Weight:
    """Q4_K bytes [N, K/256 · 144] -> ``Int4Weight`` in K records (group 32; see the module docstring): exact.

    A super-block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins mn for its eight 32-weight sub-blocks,
    128 bytes of codes — byte l of its j-th 32 holds sub-block 2j's weight l (low nibble) and sub-block 2j+1's weight
    l (high nibble); w = d · sc · q − dmin · mn.  Its records: scales (d, sc[0..7]), mins (−dmin, mn[0..7]) — the
    fp16 sign flipped, exact.  Cost: one pass over the bytes (nibbles re-paired as Q4_1's weight l / l + 16, the
    6-bit values unpacked to a byte each), no arithmetic on the scales."""
    from gguf.quants import Q4_K

    b = _blocks(raw, N, K, QK_K, 144, "Q4_K")
    nb = b.shape[0]
    sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())  # [nb, 8] each, 0..63
    qs = b[:, 16:].reshape(nb, 4, 2, 16)  # [super-block, j, first/second 16 bytes, 16]
    lo, hi = qs[:, :, 0], qs[:, :, 1]  # bytes 0..15 and 16..31 of each 32
    even = (lo & 0x0F) | ((hi & 0x0F) << 4)  # sub-block 2j: weight l low, l + 16 high (Q4_1's pairing)
    odd = (lo >> 4) | (hi & 0xF0)  # sub-block 2j + 1
    packed = np.stack([even, odd], axis=2).reshape(N, K // 2)
    neg_dmin = b[:, 2:4] ^ np.array([0, 0x80], np.uint8)  # −dmin: the fp16 sign bit (little-endian high byte)
    scales = np.concatenate([b[:, 0:2], sc.astype(np.uint8)], axis=1).reshape(N, K // QK_K, K_RECORD)
    mins = np.concatenate([neg_dmin, mn.astype(np.uint8)], axis=1).reshape(N, K // QK_K, K_RECORD)
    return Int4Weight(torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(scales),
                      torch.from_numpy(mins), GGUF_BLOCK)


def q6_k_blocks(raw: np.ndarray, N: int, K: int) -> Q6KWeight:
    """Q6_K bytes [N, K/256 · 210] (any uint8 array, a reader's read-only memory map too) -> ``Q6KWeight``: the
    super-blocks as the file has them, 6.5625 bits a weight.  ValueError unless K is a multiple of 256 and the byte
    count fits.  Cost: one copy of the bytes, no arithmetic."""
    b = _blocks(raw, N, K, QK_K, Q6K_BYTES, "Q6_K")
    return Q6KWeight(torch.from_numpy(np.array(b).reshape(N, K // QK_K, Q6K_BYTES)))  # a copy: raw may be read-only


def q5_0_to_int8(raw: np.ndarray, N: int, K: int) -> Int8Weight:
    """Q5_0 bytes [N, K/32 · 22] -> ``Int8Weight`` (fp16 d, group 32, codes q − 16 in −16..15): exact.

    A block: fp16 d, 4 bytes qh (bit l = weight l's fifth bit), 16 bytes of nibbles (weight l low, l + 16 high)."""
    b = _blocks(raw, N, K, GGUF_BLOCK, 22, "Q5_0")
    d = torch.from_numpy(b[:, 0:2].copy().view(np.float16)).reshape(N, K // GGUF_BLOCK)
    qh = b[:, 2:6].copy().view(np.uint32)  # [nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [nb, 32]
    qs = b[:, 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [nb, 32] in weight order
    q = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8)
    return Int8Weight(torch.from_numpy(q.reshape(N, K)), d, GGUF_BLOCK)


def _requantized(raw: np.ndarray, N: int, K: int, kind) -> Int8Weight:
    """Q5_K / Q5_1 bytes -> gguf's exact fp32 dequantization -> Q8_0 blocks (``quantize_q8_0``)."""
    from gguf.quants import dequantize

    return quantize_q8_0(torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32)).reshape(N, K))


def _permute_rows(w: Tensor | Int4Weight | Int8Weight | Q6KWeight, index: Tensor):
    if isinstance(w, Q6KWeight):
        return Q6KWeight(w.blocks[index].contiguous())
    if isinstance(w, Int4Weight):
        mins = None if w.mins is None else w.mins[index].contiguous()
        return Int4Weight(w.packed[index].contiguous(), w.scales[index].contiguous(), mins, w.group_size)
    if isinstance(w, Int8Weight):
        return Int8Weight(w.qweight[index].contiguous(), w.scales[index].contiguous(), w.group_size)
    return w[index].contiguous()


def read_gguf_weights(path: str | os.PathLike,
                      unpermute: bool = True) -> dict[str, Tensor | Int4Weight | Int8Weight | Q6KWeight]:
    """Every tensor of a Llama-family GGUF under its Hugging Face name: Q4_1, Q4_0 (symmetric, no mins) and Q4_K as
    ``Int4Weight``, Q6_K as ``Q6KWeight``, Q8_0, Q5_0 and (re-quantized) Q5_K/Q5_1 as ``Int8Weight``, F32/F16/BF16 as
    tensors.  With ``unpermute`` q_proj/k_proj rows are in Hugging Face order."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    reader = GGUFReader(Path(path))
    n_head = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv_field = reader.fields.get("llama.attention.head_count_kv")
    n_kv = int(kv_field.parts[-1][0]) if kv_field is not None else n_head
    out: dict[str, Tensor | Int4Weight | Int8Weight | Q6KWeight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        kind = t.tensor_type
        if kind == T.Q4_1:
            w = q4_1_to_int4(*_rows(t))
        elif kind == T.Q4_0:
            w = q4_0_to_int4(*_rows(t))
        elif kind == T.Q8_0:
            w = q8_0_to_int8(*_rows(t))
        elif kind == T.Q4_K:
            w = q4_k_to_int4(*_rows(t))
        elif kind == T.Q5_0:
            w = q5_0_to_int8(*_rows(t))
        elif kind == T.Q6_K:
            w = q6_k_blocks(*_rows(t))
        elif kind in (T.Q5_K, T.Q5_1):
            w = _requantized(*_rows(t), kind)
        elif kind in (T.F32, T.F16):
            w = torch.from_numpy(np.array(t.data)).reshape([int(s) for s in reversed(t.shape)])
        elif kind == T.BF16:
            w = torch.from_numpy(np.array(t.data)).view(torch.bfloat16).reshape([int(s) for s in reversed(t.shape)])
        else:
            raise ValueError(f"{t.name}: GGUF type {kind.name} is not supported (Q4_1, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, "
                             "Q5_0, Q5_1, F32, F16, BF16 are); convert the file with llama.cpp's llama-quantize (e.g. "
                             "to Q4_K_M) or load the original checkpoint")
        if unpermute and (".q_proj." in name or ".k_proj." in name):
            heads = n_head if ".q_proj." in name else n_kv
            w = _permute_rows(w, unpermute_index(w.shape[0], heads))
        out[name] = w
    return out

