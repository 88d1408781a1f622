"""The one place that picks which implementation runs each op, for a kernel choice, a device and a dtype.

One vocabulary, used by ``load_model(kernels=...)``, ``LLM(kernels=...)``, ``Transformer.set_kernels``, the KV
caches and the public ``minillm.kernels.*_attention(impl=...)`` functions:

- ``"torch"``: the PyTorch references only (``F.linear``, fp32-statistics RMSNorm, SDPA / ``kernels.reference``).
- ``"native"``: the native CPU kernels (``kernels/cpu/native.py``, plain C compiled on first use) wherever one
  exists for the (op, device, dtype) — CPU fp32/bf16 linear, rms_norm, decode and paged decode attention, and
  causal prefill attention as ATen's flash kernel over query tiles (``kernels/cpu/prefill.py``) — and the
  references elsewhere.  RuntimeError if the C library did not build (no compiler, or ``MINILLM_DISABLE_NATIVE``).
- ``"triton"``: the Triton attention kernels (prefill, decode, paged decode; ``kernels/triton/``) and the references
  for the rest.  RuntimeError without the triton package, or on CPU tensors without ``TRITON_INTERPRET=1``.
- ``"compiled"``: the references, and the engine's decode steps run through ``torch.compile`` (inductor: fused C++
  loops on CPU, Triton on CUDA) on the static-buffer path of ``engine.cuda_graph``; a plain model forward outside
  the engine runs the references eagerly.  On CPU it was never faster than the native kernels (BENCHMARKS.md,
  "Static decode buckets and a compiled step on CPU"), so "auto" never picks it: the native GEMVs already stream
  the weights once, and inductor fuses only the small elementwise ops.
- ``"auto"`` (default): per op, the first kernel of the table that is "auto" on this device and can run here —
  CPU, fp32/bf16, native library built: the native kernels (the linear falls back to a GEMM past the row
  limits of ``native.prefers_native``: fp32 and, on AVX512-BF16 CPUs, bf16 GEMVs at every decode batch, bf16
  elsewhere at the smallest (``native.native_rows``); the GEMM runs on a oneDNN-packed copy of an fp32 weight where
  ``cpu/onednn.py``'s memory rule allows, else torch's; the elementwise fusions —
  rms_norm, add_rms_norm, rope, silu_and_mul — run natively at any row count, ``native.elementwise_supports``);
  CUDA with triton installed: the Triton attention kernels (linear and rms_norm stay on torch);
  anything else (fp16 on CPU, CUDA without triton, CPU without a compiler): the references.

``resolve(choice, op, device, dtype)`` returns the table row (``Kernel``) that runs; ``ops_for(choice, device,
dtype)`` resolves every op at once into a ``KernelOps`` that layers and caches call (``ops.linear(x, w, b)``);
``describe`` names the choices (for notes and tests).  Resolutions are cached per (choice, op, device type, dtype)
and the environment they depend on (native library built, triton installed, ``TRITON_INTERPRET``), so a forward
pass pays one dictionary lookup, not a decision per layer.

Quantized linears (``int4_linear``, ``int8_linear``: packed ``Int4Weight``/``Int8Weight``, ``quant/weight.py``):
the reference dequantizes then ``F.linear``; "native" (and "auto" on CPU) runs ``kernels/cpu/quant.py`` for decode
rows (``native_quant.supports``: ≤ 8 rows, fp32/bf16) and, past that, for block-quantized weights (GGUF's Q8_0,
Q4_0, Q4_1, Q6_K) the prefill GEMM on int8 blocks of x (``block_prefill_linear``) where ``INT8_PREFILL`` allows it,
else the reference (the rule: ``int8_prefill_through_int8_activations``); "triton" (and "auto" on CUDA)
the dequant GEMV of ``kernels/triton/dequant_gemv.py`` up to ``TRITON_GEMV_MAX_ROWS`` rows.

Activation-quantized linears (``w8a8_linear``, ``fp8_linear``: ``quant/activation.py``): the reference
dequantizes both operands then ``F.linear``; "native" (and "auto" on CPU and CUDA) is an 8-bit GEMM with the
per-token × per-channel scales applied after it — on CPU with fp32 activations ``kernels/cpu/quant.py``'s
``w8a8_linear`` (VNNI / AVX2 / plain C) up to ``W8A8_NATIVE_MAX_ROWS`` rows (``w8a8_prefers_native``, the one rule)
and ``torch._int_mm`` (oneDNN's int8 GEMM) past it or for bf16, the same bits either way; on CUDA ``torch._int_mm``
(cuBLASLt, M > 16 and K, N multiples of 8: fewer rows are padded) — and ``torch._scaled_mm`` for fp8 (CUDA only,
compute capability ≥ 8.9).

Adding a kernel for an op is one row of ``KERNELS``, e.g. ``Kernel("int4_linear", "triton", _triton_int4,
auto_on=("cuda",))``; a new op is its reference row plus one ``KernelOps`` field, where its signature is documented.
Layers call ``ops.<op>``: no model code branches on the choice.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.kernels import reference as ref
from minillm.kernels.cpu import native, onednn
from minillm.kernels.cpu import quant as native_quant
from minillm.kernels.cpu.prefill import tiled_prefill_attention
from minillm.layers.rotary import apply_rope  # imports only the config: no cycle
from minillm.quant.activation import fp8_linear_ref, fp8_linear_scaled_mm, w8a8_linear_int_mm, w8a8_linear_ref
from minillm.quant.weight import Int4Weight, Q6KWeight, int4_linear_ref, int8_linear_ref, q6k_linear_ref

CHOICES = ("auto", "torch", "native", "triton", "compiled")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # the C kernels' two element types (csrc/native.c)


@dataclass(frozen=True)
class KernelOps:
    """The implementation of every op for one (choice, device, dtype), as plain callables.

    Shapes (B batch, L queries, S keys, H_q/H_kv heads, D head dim; ``sm_scale`` defaults to D**-0.5):
    - ``linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]``
    - ``rms_norm(x [..., K], weight [K], eps) -> [..., K]`` (fp32 statistics)
    - ``prefill_attention(q [B, H_q, L, D], k, v [B, H_kv, S, D], *, causal, sm_scale) -> [B, H_q, L, D]``
      (causal: the L queries are the last L of the S positions)
    - ``decode_attention(q [B, H_q, D], k, v [B, H_kv, S_max, D], seq_lens [B], *, sm_scale) -> [B, H_q, D]``
    - ``paged_decode_attention(q [B, H_q, D], k_cache, v_cache [num_blocks, block_size, H_kv, D],
      block_tables [B, max_blocks] int32, seq_lens [B] int32, *, sm_scale, window=0, sinks=0) -> [B, H_q, D]``
      (``window`` > 0: the query at position seq_lens - 1 sees only its last ``window`` keys and the first
      ``sinks``, as ``reference.kept_keys``; blocks holding none of them are not read)
    - ``int4_linear(x [..., K], w: Int4Weight [N, K], bias [N] | None) -> [..., N]`` and
      ``int8_linear(x [..., K], w: Int8Weight | Q6KWeight [N, K], bias [N] | None) -> [..., N]``: weight-only quantized
      linears (``layers.linear.QuantLinear``); x's dtype is the one resolved for, the weight stays packed.
    - ``w8a8_linear(x [..., K], w: Int8Weight [N, K] per channel, input_scale 0-dim | None, bias [N] | None)
      -> [..., N]``: x rounded to int8 too (per token, or with the static ``input_scale``), an int8 × int8 -> int32
      GEMM and the scales after it (``quant.activation``); ``fp8_linear(x, w: Fp8Weight, bias) -> [..., N]`` the
      same in e4m3 with per-token scales.
    Fusions (one native call where the reference runs several ATen ops: at batch 1 each op's fixed cost is what a
    decode token pays beside its GEMVs; at prefill rows each op is a pass over the activations, one instead of
    several):
    - ``add_rms_norm(x [..., K], residual [..., K], weight [K], eps) -> (rms_norm(x + residual), x + residual)``
    - ``rope(x [B, L, H, D], cos [B, L, 1, D], sin [B, L, 1, D]) -> [B, L, H, D]`` (``layers.rotary.apply_rope``)
    - ``silu_and_mul(x [..., 2F]) -> [..., F]``: silu(gate) * up for x = [gate | up]
    - ``write_kv(k_cache, v_cache [num_blocks, block_size, H_kv, D], k, v [T, H_kv, D], slot_mapping [T] long)
      -> None``: stores the rows at their flat slots, in place (the caches are the KV store's own tensors)
    Inputs are not validated here (the public ``minillm.kernels`` functions do that): callers are the model's
    layers and caches, whose shapes are right by construction.
    """

    linear: Callable[..., Tensor]
    rms_norm: Callable[..., Tensor]
    prefill_attention: Callable[..., Tensor]
    decode_attention: Callable[..., Tensor]
    paged_decode_attention: Callable[..., Tensor]
    int4_linear: Callable[..., Tensor]
    int8_linear: Callable[..., Tensor]
    w8a8_linear: Callable[..., Tensor]
    fp8_linear: Callable[..., Tensor]
    add_rms_norm: Callable[..., tuple[Tensor, Tensor]]
    rope: Callable[..., Tensor]
    silu_and_mul: Callable[..., Tensor]
    write_kv: Callable[..., None]


OPS = tuple(f.name for f in dataclasses.fields(KernelOps))


@dataclass(frozen=True)
class Kernel:
    """One implementation of one op: a row of ``KERNELS``.

    ``fn`` is the callable (with the op's signature, see ``KernelOps``) or ``"module:name"``, imported when first
    resolved (the Triton modules import triton, which ``import minillm`` must not).  ``devices``/``dtypes``: where
    it can run; ``auto_on``: the device types where ``"auto"`` picks it.
    """

    op: str
    impl: str  # "torch" | "native" | "triton"
    fn: Callable[..., Tensor] | str
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    auto_on: tuple[str, ...] = ()

    def load(self) -> Callable[..., Tensor]:
        """The callable itself (imports its module on first use)."""
        return _import(self.fn) if isinstance(self.fn, str) else self.fn


# ---------------------------------------------------------------- the references and the native kernels, one signature
def _scale(q: Tensor, sm_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if sm_scale is None else sm_scale


def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each row: x / sqrt(mean(x²) + eps) * weight.  x [..., K], weight [K] -> [..., K] in x's dtype.

    Contract (as transformers' LlamaRMSNorm): the mean of squares is taken over the last axis in fp32 whatever
    x's dtype, ``eps`` is added *inside* the square root, the normalised row is rounded back to x's dtype and only
    then multiplied by ``weight``.  One read of x, one write: memory bound, like every elementwise op at decode.
    """
    ### BEGIN SOLUTION
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    ### END SOLUTION


def _torch_prefill(q, k, v, *, causal=True, sm_scale=None):
    return ref.sdpa_attention(q, k, v, causal=causal, scale=sm_scale)  # fused; same answer as grouped_attention


def _torch_decode(q, k, v, seq_lens, *, sm_scale=None):
    return ref.decode_attention(q, k, v, seq_lens, scale=sm_scale)


def _torch_paged(q, k_cache, v_cache, block_tables, seq_lens, *, sm_scale=None, window=0, sinks=0):
    if window:
        return ref.paged_window_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, window, sinks)
    return ref.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=sm_scale)


def _native_linear(x, weight, bias=None):
    # per call, not per resolution: the row count decides (a decode GEMV wins, a prefill GEMM is oneDNN's on a
    # weight packed once where onednn.packs allows, else torch's)
    if native.prefers_native(x, weight):
        return native.linear(x, weight, bias)
    return onednn.linear(x, weight, bias)


def _native_rms_norm(x, weight, eps):
    if native.elementwise_supports(x, weight):  # one pass instead of the reference's five ATen ops, at any rows
        return native.rms_norm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def _native_decode(q, k, v, seq_lens, *, sm_scale=None):
    D = q.shape[-1]
    if k.stride(-1) != 1 or k.stride(-2) != D or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()  # a cache's [:, :, :S] slices fit as they are; other views copy
    # the callers are KV caches, whose lengths are right by construction (KernelOps does not validate)
    return native.decode_attention(q, k, v, seq_lens, _scale(q, sm_scale), check_lens=False)


def _native_paged(q, k_cache, v_cache, block_tables, seq_lens, *, sm_scale=None, window=0, sinks=0):
    # reads K/V through the tables in place: no gather (the reference copies every sequence's blocks)
    if seq_lens.dtype != torch.int32:  # .to() is an ATen op even when it has nothing to do
        seq_lens = seq_lens.to(torch.int32)
    return native.paged_decode_attention(q, k_cache.contiguous(), v_cache.contiguous(), block_tables, seq_lens,
                                         _scale(q, sm_scale), window, sinks)


def torch_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """r = x + residual -> (rms_norm(r) * weight, r): a residual add and the norm after it.  [..., K]."""
    r = x + residual
    return torch_rms_norm(r, weight, eps), r


def torch_silu_and_mul(x: Tensor) -> Tensor:
    """x [..., 2F] = [gate | up] -> silu(gate) * up [..., F] (SwiGLU's activation)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store k, v [T, H_kv, D] at flat slots ``slot_mapping`` [T] of caches [num_blocks, block_size, H_kv, D]."""
    Hkv, D = k.shape[1:]
    k_cache.view(-1, Hkv, D)[slot_mapping] = k
    v_cache.view(-1, Hkv, D)[slot_mapping] = v


def _native_add_rms_norm(x, residual, weight, eps):
    if native.elementwise_supports(x, weight) and residual.shape == x.shape and residual.dtype == x.dtype:
        return native.add_rms_norm(x, residual, weight, eps)
    return torch_add_rms_norm(x, residual, weight, eps)


def _native_rope(x, cos, sin):
    return native.rope(x, cos, sin) if native.rope_supports(x, cos, sin) else apply_rope(x, cos, sin)


def _native_silu_and_mul(x):
    return native.silu_and_mul(x) if native.elementwise_supports(x, x) else torch_silu_and_mul(x)


def _native_write_kv(k_cache, v_cache, k, v, slot_mapping):
    if native.write_kv_supports(k_cache, k, v) and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64:
        return native.write_kv(k_cache, v_cache, k, v, slot_mapping)
    return torch_write_kv(k_cache, v_cache, k, v, slot_mapping)


def _add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias


# Prefill rows (past decode) of block-quantized weight-only linears — GGUF's Q8_0 (int8 in groups of 32), Q4_0 and
# Q4_1 (Int4Weight) — "int8": x rounded to int8 blocks of 32 and the register-tiled int8 GEMM
# (native_quant.block_prefill_linear: llama.cpp's Q8_0 x Q8_0 scheme, the rounding the decode rows already apply), so
# prefill outputs differ from the exact path by that rounding (≤ 0.5 · Σ_k dx_k · |w_nk| per output); "exact":
# dequantize + float GEMM, the W8A16 / W4A16 result; "auto" (default): "int8" where that GEMM runs on its AVX-512
# VNNI tiles (measured several times faster than the exact path at prefill sizes), "exact" elsewhere (its plain C
# twin is slower than a float GEMM).  Per-channel int8 keeps the exact prefill.  Set MINILLM_INT8_PREFILL before
# import, or assign this.
INT8_PREFILL = os.environ.get("MINILLM_INT8_PREFILL", "auto")
if INT8_PREFILL not in ("auto", "exact", "int8"):
    raise ValueError(f"MINILLM_INT8_PREFILL must be 'auto', 'exact' or 'int8', got {INT8_PREFILL!r}")


def int8_prefill_through_int8_activations(w) -> bool:
    """Whether a weight-only linear's rows past decode (prefill) take the int8-activation GEMM
    (``native_quant.block_prefill_linear``; GGUF Q6_K blocks: ``native_quant.q6k_linear``, the same tiles) instead
    of the exact dequantize + GEMM: Q4_x ``Int4Weight``, Q8_0 ``Int8Weight`` (groups of 32) and ``Q6KWeight`` under
    ``INT8_PREFILL`` (see there).  The one rule."""
    if INT8_PREFILL == "exact" or not (isinstance(w, (Int4Weight, Q6KWeight)) or w.group_size == 32):
        return False
    return INT8_PREFILL == "int8" or native_quant.prefill_tiled()


def int4_ref(x, w, bias=None):
    """The int4_linear reference for any ``Int4Weight``: ``int4_linear_ref`` (which reads stored mins) on the
    weight with its mins stored — a symmetric (Q4_0) weight's m = −8·d materialised for the call (the same values,
    so the same result; the reference writes a float [N, K] weight per call anyway)."""
    return int4_linear_ref(x, w.with_mins(), bias)


def _native_int4(x, w, bias=None):
    # decode rows (≤ native_quant.MAX_ROWS): dequantize in registers; prefill: the int8 block GEMM where the rule
    # takes it, else the reference's dequantize + GEMM (a transient float weight per call)
    if native_quant.supports(x, w):
        return _add_bias(native_quant.int4_linear(x, w), bias)
    if int8_prefill_through_int8_activations(w) and native_quant.block_prefill_supports(x, w):
        return _add_bias(native_quant.block_prefill_linear(x, w), bias)
    return int4_ref(x, w, bias)


def int8_ref(x, w, bias=None):
    """The int8_linear reference for any int8-coded weight: ``int8_linear_ref``, or for GGUF Q6_K blocks
    (``Q6KWeight``: 6-bit codes, an int8 sub-scale per 16) ``q6k_linear_ref`` (the same on its expanded form)."""
    return (q6k_linear_ref if isinstance(w, Q6KWeight) else int8_linear_ref)(x, w, bias)


def _native_int8(x, w, bias=None):
    if isinstance(w, Q6KWeight):  # the blocks as stored: decode rows in registers, prefill rows where the rule says
        rows = x.numel() // max(x.shape[-1], 1)
        if native_quant.supports(x, w) and (rows <= native_quant.MAX_ROWS or int8_prefill_through_int8_activations(w)):
            return _add_bias(native_quant.q6k_linear(x, w), bias)
        return q6k_linear_ref(x, w, bias)
    if native_quant.supports(x, w):
        return _add_bias(native_quant.int8_linear(x, w), bias)
    if int8_prefill_through_int8_activations(w) and native_quant.block_prefill_supports(x, w):
        return _add_bias(native_quant.block_prefill_linear(x, w), bias)
    return int8_linear_ref(x, w, bias)


# W8A8 on CPU: minillm's int8 × int8 GEMM (csrc/quant.c w8a8_gemm: VNNI / AVX2 / plain C, cache-blocked) for up to
# this many rows, oneDNN's (torch._int_mm) past it.  Both give the same bits (exact int32 sums, the same epilogue),
# so the rule decides speed only; decode batches must stay on the native kernel, which the fused decode step runs.
# Checked by an interleaved sweep over SmolLM2's linears (AMD EPYC, AVX-512 VNNI) after the native kernel gained its
# 16-row panels: the native GEMM well ahead at 8 rows, level with oneDNN's at 32, behind at 64 and 128.
W8A8_NATIVE_MAX_ROWS = 32


def w8a8_prefers_native(rows: int, N: int, K: int) -> bool:
    """Whether the native W8A8 GEMM, not ``torch._int_mm``, runs [rows, K] @ [N, K]ᵀ on CPU: the one rule."""
    return rows <= W8A8_NATIVE_MAX_ROWS


def _native_w8a8(x, w, input_scale=None, bias=None):
    if x.device.type == "cpu" and native_quant.w8a8_supports(x, w, input_scale) \
            and w8a8_prefers_native(x.numel() // max(x.shape[-1], 1), *w.shape):
        return native_quant.w8a8_linear(x, w, input_scale, bias)
    return w8a8_linear_int_mm(x, w, input_scale, bias)


TRITON_GEMV_MAX_ROWS = 16  # the dequant GEMV re-reads each weight tile per row: past decode batches a GEMM wins


def _triton_int4(x, w, bias=None):
    if x.numel() // max(x.shape[-1], 1) > TRITON_GEMV_MAX_ROWS:
        return int4_ref(x, w, bias)
    return _add_bias(_import("minillm.kernels.triton.dequant_gemv:int4_gemv_triton")(x, w), bias)


def _triton_int8(x, w, bias=None):
    if x.numel() // max(x.shape[-1], 1) > TRITON_GEMV_MAX_ROWS or isinstance(w, Q6KWeight):
        return int8_ref(x, w, bias)
    return _add_bias(_import("minillm.kernels.triton.dequant_gemv:int8_gemv_triton")(x, w), bias)


_NATIVE = dict(devices=("cpu",), dtypes=NATIVE_DTYPES, auto_on=("cpu",))
_TRITON = dict(auto_on=("cuda",))  # runs on CPU tensors too, in the interpreter: for tests, never chosen by "auto"

# For each op, its torch reference and then the fast kernels in the order "auto" prefers them.
KERNELS: tuple[Kernel, ...] = (
    Kernel("linear", "torch", F.linear),
    Kernel("linear", "native", _native_linear, **_NATIVE),
    Kernel("rms_norm", "torch", torch_rms_norm),
    Kernel("rms_norm", "native", _native_rms_norm, **_NATIVE),
    Kernel("prefill_attention", "torch", _torch_prefill),
    Kernel("prefill_attention", "native", tiled_prefill_attention, **_NATIVE),
    Kernel("prefill_attention", "triton", "minillm.kernels.triton.flash:flash_attention_triton", **_TRITON),
    Kernel("decode_attention", "torch", _torch_decode),
    Kernel("decode_attention", "native", _native_decode, **_NATIVE),
    Kernel("decode_attention", "triton", "minillm.kernels.triton.decode:decode_attention_triton", **_TRITON),
    Kernel("paged_decode_attention", "torch", _torch_paged),
    Kernel("paged_decode_attention", "native", _native_paged, **_NATIVE),
    Kernel("paged_decode_attention", "triton",
           "minillm.kernels.triton.paged_decode:paged_decode_attention_triton", **_TRITON),
    Kernel("int4_linear", "torch", int4_ref),
    Kernel("int4_linear", "native", _native_int4, **_NATIVE),
    Kernel("int4_linear", "triton", _triton_int4, **_TRITON),
    Kernel("int8_linear", "torch", int8_ref),
    Kernel("int8_linear", "native", _native_int8, **_NATIVE),
    Kernel("int8_linear", "triton", _triton_int8, **_TRITON),
    # W8A8 / FP8: the reference dequantizes both operands; the fast rows are integer / fp8 GEMMs: on CPU minillm's
    # own int8 × int8 GEMM or ATen's (w8a8_prefers_native decides), on CUDA ATen's (torch._int_mm: cuBLASLt;
    # torch._scaled_mm on fp8 GPUs), under the "native" name as the machine's own integer/fp8 units
    Kernel("w8a8_linear", "torch", w8a8_linear_ref),
    Kernel("w8a8_linear", "native", _native_w8a8, **_NATIVE),
    Kernel("w8a8_linear", "native", w8a8_linear_int_mm, devices=("cuda",), auto_on=("cuda",)),
    Kernel("fp8_linear", "torch", fp8_linear_ref),
    Kernel("fp8_linear", "native", fp8_linear_scaled_mm, devices=("cuda",), auto_on=("cuda",)),
    Kernel("add_rms_norm", "torch", torch_add_rms_norm),
    Kernel("add_rms_norm", "native", _native_add_rms_norm, **_NATIVE),
    Kernel("rope", "torch", apply_rope),
    Kernel("rope", "native", _native_rope, **_NATIVE),
    Kernel("silu_and_mul", "torch", torch_silu_and_mul),
    Kernel("silu_and_mul", "native", _native_silu_and_mul, **_NATIVE),
    Kernel("write_kv", "torch", torch_write_kv),
    Kernel("write_kv", "native", _native_write_kv, **_NATIVE),
)


# ---------------------------------------------------------------------------------------------------- resolution
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it is only in the ``gpu``/``dev`` extras).  Its answer is part
    of every resolution's cache key, so a test may replace this function: no decision made under the stand-in is
    reused once the real answer differs, and ``clear_cache`` still works meanwhile (``_triton_found`` caches)."""
    return _triton_found()


@lru_cache(maxsize=1)
def _triton_found() -> bool:
    return importlib.util.find_spec("triton") is not None


# Triton's supported NVIDIA GPUs are compute capability 8.0+ (Ampere on); below it (a T4 is sm_75, a V100 sm_70)
# its compiler may reject what these kernels use — bf16, and tl.dot on the tile shapes of flash/decode/paged
# attention and the int4/int8 GEMVs — so "auto" runs the torch references there and says why, once.
TRITON_MIN_CAPABILITY = (8, 0)


@lru_cache(maxsize=8)
def triton_unsupported_reason(device_index: int | None = None) -> str:
    """"" when the CUDA device (default: the current one) can run minillm's Triton kernels, else one line saying
    which device, its generation, what the kernels need and what runs instead.  Cached per device."""
    if not torch.cuda.is_available():
        return ""  # no device to judge (a resolution for "cuda" asked on a CPU-only machine)
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) >= TRITON_MIN_CAPABILITY:
        return ""
    need = ".".join(map(str, TRITON_MIN_CAPABILITY))
    return (f"{torch.cuda.get_device_name(device_index)} is sm_{major}{minor}: minillm's Triton kernels (flash, "
            f"decode and paged attention; int4/int8 GEMV) need compute capability {need}+ (Triton's supported "
            "GPUs; bf16 and their tl.dot tiles), so the torch references run instead")


@lru_cache(maxsize=8)
def _warn_triton_fallback(reason: str) -> None:
    warnings.warn(reason, RuntimeWarning, stacklevel=3)  # once per reason: the first op resolved says it


def check_choice(choice: str, name: str = "kernels") -> str:
    """``choice`` if it is one of ``CHOICES``; else ValueError naming the parameter and the allowed values."""
    if choice not in CHOICES:
        raise ValueError(f"{name} must be one of {CHOICES}, got {choice!r}")
    return choice


def resolve(choice: str, op: str, device: torch.device | str, dtype: torch.dtype) -> Kernel:
    """The ``KERNELS`` row that runs ``op`` for tensors of ``dtype`` on ``device`` under ``choice`` (cached)."""
    check_choice(choice)
    return _resolve(choice, op, _device_type(device), dtype, _environment(choice))


def implementation(choice: str, op: str, device: torch.device | str, dtype: torch.dtype) -> Callable[..., Tensor]:
    """The callable ``resolve`` picks (its module imported)."""
    return resolve(choice, op, device, dtype).load()


def ops_for(choice: str, device: torch.device | str, dtype: torch.dtype) -> KernelOps:
    """Every op resolved for (``choice``, ``device``, ``dtype``): what a model or cache passes to its layers.
    Cached: one call per forward pass costs a dictionary lookup."""
    check_choice(choice)
    return _ops(choice, _device_type(device), dtype, _environment(choice))


def describe(choice: str, device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """{op: "torch" | "native" | "triton"}: which implementation each op runs (imports nothing)."""
    return {op: resolve(choice, op, device, dtype).impl for op in OPS}


def clear_cache() -> None:
    """Forget cached resolutions and probes: for tests that change what the key does not hold (the CUDA device's
    generation), or that install or remove triton.  Works while ``triton_available`` is replaced by a stand-in."""
    for cached in (_resolve, _ops, _triton_found, triton_unsupported_reason, _warn_triton_fallback):
        cached.cache_clear()


def compiles(choice: str) -> bool:
    """Whether ``choice`` asks the engine to ``torch.compile`` its decode step (the ops are the references)."""
    return choice == "compiled"


def _device_type(device: torch.device | str) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _environment(choice: str) -> tuple[bool, bool, bool]:
    """(native library built, triton installed, TRITON_INTERPRET=1): part of every cache key."""
    if choice in ("torch", "compiled"):
        return False, False, False  # the references need neither (and "torch" must not compile the C library)
    return native.available(), triton_available(), os.environ.get("TRITON_INTERPRET") == "1"


def _require(choice: str, device_type: str, env: tuple[bool, bool, bool]) -> None:
    native_ok, triton_ok, interpret = env
    if choice == "native" and not native_ok:
        raise RuntimeError("kernels='native' needs the native CPU kernels (minillm/kernels/cpu), which failed to "
                           "build here (no C compiler, or MINILLM_DISABLE_NATIVE is set); use 'auto' or 'torch'")
    if choice == "triton" and not triton_ok:
        raise RuntimeError("'triton' kernels need the triton package (pip install 'minillm[gpu]')")
    if choice == "triton" and device_type == "cuda" and triton_ok and triton_unsupported_reason():
        raise RuntimeError(f"kernels='triton': {triton_unsupported_reason()}; use 'auto' or 'torch'")
    if choice == "triton" and device_type != "cuda" and not interpret:
        raise RuntimeError(f"'triton' kernels on {device_type} tensors need Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before minillm's Triton kernels are imported (or use 'auto'/'torch', "
                           "or CUDA tensors)")


def _runs_here(kernel: Kernel, device_type: str, dtype: torch.dtype, env: tuple[bool, bool, bool]) -> bool:
    native_ok, triton_ok, interpret = env
    if device_type not in kernel.devices or dtype not in kernel.dtypes:
        return False
    if kernel.impl == "native":
        return native_ok
    if kernel.impl == "triton":
        if triton_ok and device_type == "cuda" and triton_unsupported_reason():
            _warn_triton_fallback(triton_unsupported_reason())
            return False
        return triton_ok and (device_type == "cuda" or interpret)
    return True


@lru_cache(maxsize=256)
def _resolve(choice: str, op: str, device_type: str, dtype: torch.dtype, env: tuple[bool, bool, bool]) -> Kernel:
    rows = [k for k in KERNELS if k.op == op]
    if not rows:
        raise ValueError(f"unknown op {op!r}; the ops are {OPS}")
    _require(choice, device_type, env)
    for k in rows:
        if k.impl != "torch" and _runs_here(k, device_type, dtype, env) \
                and (k.impl == choice or (choice == "auto" and device_type in k.auto_on)):
            return k
    return next(k for k in rows if k.impl == "torch")


@lru_cache(maxsize=64)
def _ops(choice: str, device_type: str, dtype: torch.dtype, env: tuple[bool, bool, bool]) -> KernelOps:
    return KernelOps(**{op: _resolve(choice, op, device_type, dtype, env).load() for op in OPS})


@cache
def _import(target: str) -> Callable[..., Tensor]:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
