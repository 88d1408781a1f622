"""GGUF blocks straight into packed weights: Q4_1 and Q4_0 -> ``Int4Weight`` (group 32), Q8_0 -> ``Int8Weight``
(group 32), F32/F16 -> plain tensors — no float round trip, so the model runs exactly the weights llama.cpp runs.

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
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from minillm.quant.weight import Int4Weight, Int8Weight

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


def _permute_rows(w: Tensor | Int4Weight | Int8Weight, index: Tensor):
    if isinstance(w, Int4Weight):
        mins = None if w.mins is None else w.mins[index].contiguous()
        return Int4Weight(w.packed[index].contiguous(), w.scales[index].contiguous(), mins, w.group_size)
    if isinstance(w, Int8Weight):
        return Int8Weight(w.qweight[index].contiguous(), w.scales[index].contiguous(), w.group_size)
    return w[index].contiguous()


def read_gguf_weights(path: str | os.PathLike, unpermute: bool = True) -> dict[str, Tensor | Int4Weight | Int8Weight]:
    """Every tensor of a Llama-family GGUF under its Hugging Face name: Q4_1 and Q4_0 (symmetric, no mins) as
    ``Int4Weight``, Q8_0 as ``Int8Weight``, F32/F16/BF16 as tensors.  With ``unpermute`` q_proj/k_proj rows are in
    Hugging Face order."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    reader = GGUFReader(Path(path))
    n_head = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv_field = reader.fields.get("llama.attention.head_count_kv")
    n_kv = int(kv_field.parts[-1][0]) if kv_field is not None else n_head
    out: dict[str, Tensor | Int4Weight | Int8Weight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        kind = t.tensor_type
        if kind == T.Q4_1:
            w = q4_1_to_int4(*_rows(t))
        elif kind == T.Q4_0:
            w = q4_0_to_int4(*_rows(t))
        elif kind == T.Q8_0:
            w = q8_0_to_int8(*_rows(t))
        elif kind in (T.F32, T.F16):
            w = torch.from_numpy(np.array(t.data)).reshape([int(s) for s in reversed(t.shape)])
        elif kind == T.BF16:
            w = torch.from_numpy(np.array(t.data)).view(torch.bfloat16).reshape([int(s) for s in reversed(t.shape)])
        else:
            raise ValueError(f"{t.name}: GGUF type {kind.name} is not supported (Q4_1, Q4_0, Q8_0, F32, F16, BF16 "
                             "are); convert the file with llama.cpp's llama-quantize or load the original checkpoint")
        if unpermute and (".q_proj." in name or ".k_proj." in name):
            heads = n_head if ".q_proj." in name else n_kv
            w = _permute_rows(w, unpermute_index(w.shape[0], heads))
        out[name] = w
    return out

