"""Packed weight-only formats (the weights are what is stored; activations stay fp32/bf16/fp16).

``Int8Weight`` (W8A16): int8 codes [N, K] and symmetric scales [N, K // group_size], w = scale · q.  Per output
channel by default (group_size = K, scales [N, 1]); group_size 32 holds GGUF's Q8_0 blocks exactly.
Bytes: N·K + 4·N (fp32 per-channel scales) — ~4× fewer than fp32.

``Int4Weight`` (W4A16): 4-bit codes q ∈ 0..15 with per-group (group 32 by default) scale d and minimum m,
w = d · q + m — exactly llama.cpp's Q4_1 block (per 32 weights: fp16 d, fp16 m, 16 bytes of codes).  Packing, per
32-weight block: byte j (0..15) holds weight j in its low nibble and weight j + 16 in its high nibble, so
``packed`` [N, K / 2] uint8 is byte for byte the ``qs`` of the GGUF blocks.  Groups of 64/128 share one (d, m)
over two/four such blocks.  Bytes (fp16 d, m, group 32): N·K/2 + 4·N·K/32 = 5 bits per weight (~6.4× < fp32).
``mins=None`` is the symmetric form, llama.cpp's Q4_0 block (fp16 d, 16 bytes of codes, w = d · (q − 8)): no m is
stored and every reader takes m = −8·d in fp32 (``symmetric_mins``), exact for any fp16/fp32 d, so it computes the
bits the same weight with m = −8·d stored gives.  Bytes (fp16 d, group 32): N·K/2 + 2·N·K/32 = 4.5 bits a weight.
A third scale format keeps GGUF's Q4_K two-level scales (group 32 only, K a multiple of 256): **K records**,
``scales`` and ``mins`` uint8 [N, K/256, 10], per row and 256 weights one record of an fp16 super-value (2 bytes,
little-endian) then 8 uint8 sub-values — (d, sc[0..7]) for the scales, (−dmin, mn[0..7]) for the mins.  Group i of
the row-major [N, K/32] grid (record i // 8, sub-value i % 8) has d_i = float(fp16) · float(sub) in fp32: exactly
gguf's product (an 11-bit mantissa times a 6-bit integer fits fp32's 24 bits, for any finite fp16 including
subnormals), and m_i = (−dmin) · mn = −(dmin · mn) exactly, so readers need no sign logic.  Bytes: N·K/2 + 20·N·K/256
= 4.625 bits a weight (Q4_K's own file is 4.5: its 6-bit sub-values are packed, ours are a byte each for the kernels).

``Q6KWeight`` keeps GGUF's Q6_K super-blocks as the file has them: per row and 256 weights 210 bytes — ``ql`` 128
(low 4 bits), ``qh`` 64 (high 2 bits), 16 int8 sub-scales sc (one per 16 weights), fp16 d — w = (d · sc) · q with
q = (low | high << 4) − 32 ∈ [−32, 31], both products in fp32 as gguf computes them (d · sc is exact: an 11-bit
mantissa times an 8-bit integer).  6.5625 bits a weight; ``expanded()`` is the same weight as an ``Int8Weight`` with
group 16 (codes q, fp32 scales d · sc: 10 bits a weight), for readers that do not unpack the blocks.

The reference matmuls (``int8_linear_ref``, ``int4_linear_ref``, ``q6k_linear_ref``) dequantize then call
``F.linear``: the exact W8A16/W4A16 result every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.quant.formats import Granularity, QuantSpec, group_view

BLOCK = 32  # weights per packing block (Q4_1's QK4_1): one byte pairs weight j with weight j + 16
QK_K = 256  # weights per K-quant super-block (ggml's QK_K): one K record per row and super-block
K_RECORD = 10  # bytes per K record: an fp16 super-value, then 8 uint8 sub-values (one per group of 32)
Q6K_BYTES = 210  # bytes per Q6_K super-block of 256 weights (ggml's block_q6_K): ql 128, qh 64, scales 16, d 2
Q6K_GROUP = 16  # weights per Q6_K sub-scale
INT4_GROUP_SIZES = (32, 64, 128)


def check_group_size(K: int, group_size: int, multiple: int = 1) -> None:
    """ValueError naming the fix unless ``group_size`` is a positive multiple of ``multiple`` that divides K."""
    if group_size < 1 or group_size % multiple:
        raise ValueError(f"group_size must be a positive multiple of {multiple}, got {group_size}")
    if K % group_size:
        fits = [g for g in INT4_GROUP_SIZES if K % g == 0]
        raise ValueError(f"group_size {group_size} does not divide K={K}: pad K with zero columns to a multiple of "
                         f"{group_size}, or choose a group size that divides K" + (f" ({fits})" if fits else ""))


_check_group = check_group_size  # former private name, kept for code written against it on other branches


def _store_contiguous(weight, *names: str) -> None:
    """Replace each named tensor field of a frozen weight by a contiguous copy where it is not contiguous: the native
    kernels take raw pointers to these tensors, and a ``.contiguous()`` made at the call would be a temporary freed
    before the kernel reads it.  Cost: a copy, once, of a field built as a view (a transpose, a strided slice)."""
    for name in names:
        t = getattr(weight, name)
        if t is not None and not t.is_contiguous():
            object.__setattr__(weight, name, t.contiguous())


class CodesAndScales:
    """What a weight stored as ``qweight`` codes [N, K] (one byte each) and ``scales`` reports (``Int8Weight``,
    ``quant.activation.Fp8Weight``)."""

    qweight: Tensor
    scales: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight it stands for."""
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored (codes + scales): what a GEMV streams from memory."""
        return self.qweight.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class Int8Weight(CodesAndScales):
    """W8A16 weight: ``qweight`` int8 [N, K], ``scales`` [N, K // group_size] (fp32 or fp16), w = scales · q."""

    qweight: Tensor
    scales: Tensor
    group_size: int

    def __post_init__(self):
        if self.qweight.dtype != torch.int8 or self.qweight.dim() != 2:
            raise ValueError(f"qweight must be int8 [N, K], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        N, K = self.qweight.shape
        check_group_size(K, self.group_size)
        if self.scales.shape != (N, K // self.group_size) or self.scales.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"scales must be fp32/fp16 [{N}, {K // self.group_size}], got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")
        _store_contiguous(self, "qweight", "scales")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[N, K] in ``dtype``, computed in fp32 (q · scale, as gguf's Q8_0 dequantization)."""
        N, K = self.shape
        q = self.qweight.float().view(N, K // self.group_size, self.group_size)
        return (q * self.scales.float().unsqueeze(-1)).view(N, K).to(dtype)

    def to(self, device: torch.device | str) -> Int8Weight:
        """The same weight on ``device``."""
        return Int8Weight(self.qweight.to(device), self.scales.to(device), self.group_size)


SYMMETRIC_ZERO = 8  # the zero code of a symmetric (Q4_0) Int4Weight: m = −8·d (in C: quant.c's Q4_0_MIN)


def symmetric_mins(scales: Tensor) -> Tensor:
    """m = −8·d in fp32, the shape of ``scales`` [N, K // g]: a symmetric (Q4_0) ``Int4Weight``'s minima.  Exact: a
    power-of-two multiple of an fp16 or fp32 d, finite for every finite fp16 d."""
    return scales.float() * -SYMMETRIC_ZERO


def expand_k_records(records: Tensor) -> Tensor:
    """K records uint8 [N, K/256, 10] -> the per-group values fp32 [N, K/32]: fp16 super-value · uint8 sub-value,
    one fp32 product each (exact; see the module docstring).  Cost: one pass over 10 bytes per 256 weights."""
    N, S, _ = records.shape
    sup = records[..., :2].contiguous().view(torch.float16).float()  # [N, S, 1]
    return (sup * records[..., 2:].float()).reshape(N, S * (K_RECORD - 2))  # [N, S, 8] -> [N, K/32]


@dataclass(frozen=True)
class Int4Weight:
    """W4A16 weight in Q4_1 layout: ``packed`` uint8 [N, K/2], ``scales`` d and ``mins`` m [N, K // group_size]
    (fp16 or fp32, same dtype), w = d · q + m with q ∈ 0..15 (see the module docstring for the nibble order).
    ``mins=None``: symmetric Q4_0 blocks, m = −8·d computed in fp32 wherever it is read (``symmetric_mins``).
    K records (Q4_K's two levels, group 32): ``scales`` and ``mins`` both uint8 [N, K/256, 10] (module docstring);
    read them as fp32 [N, K/32] through ``scales_f32`` / ``mins_f32``."""

    packed: Tensor
    scales: Tensor
    mins: Tensor | None
    group_size: int = 32

    def __post_init__(self):
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise ValueError(f"packed must be uint8 [N, K/2], got {self.packed.dtype} {tuple(self.packed.shape)}")
        N, K = self.shape
        check_group_size(K, self.group_size, BLOCK)
        if self.k_records:
            self._check_k_records(N, K)
        else:
            want = (N, K // self.group_size)
            for name, t in (("scales", self.scales), ("mins", self.mins)):
                if t is None and name == "mins":
                    continue  # symmetric
                if t.shape != want or t.dtype not in (torch.float16, torch.float32) or t.dtype != self.scales.dtype:
                    raise ValueError(f"{name} must be fp16/fp32 {list(want)} (both the same dtype; mins may be None "
                                     f"for symmetric Q4_0 blocks), or uint8 K records, got {t.dtype} "
                                     f"{tuple(t.shape)}")
        _store_contiguous(self, "packed", "scales", "mins")

    def _check_k_records(self, N: int, K: int) -> None:
        want = [N, K // QK_K, K_RECORD]
        if self.group_size != BLOCK or K % QK_K:
            raise ValueError(f"K records need group_size={BLOCK} and K a multiple of {QK_K}, got group_size="
                             f"{self.group_size}, K={K}: expand them (scales_f32(), mins_f32()) for other shapes")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is None or t.dtype != torch.uint8 or list(t.shape) != want:
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"K-record {name} must be uint8 {want} (mins are stored in this form), got {got}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight it stands for."""
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def k_records(self) -> bool:
        """Whether d and m are stored as K records (uint8 [N, K/256, 10]) rather than fp16/fp32 [N, K // g]."""
        return self.scales.dtype == torch.uint8

    @property
    def nbytes(self) -> int:
        """Bytes stored (codes + scales + mins, no mins when symmetric): what a GEMV streams from memory."""
        return self.packed.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def scales_f32(self) -> Tensor:
        """d [N, K // group_size] fp32: the stored scales, or the K records' products."""
        return expand_k_records(self.scales) if self.k_records else self.scales.float()

    def mins_f32(self) -> Tensor:
        """m [N, K // group_size] fp32: the stored mins (or the K records' products), or −8·d for a symmetric
        weight."""
        if self.mins is None:
            return symmetric_mins(self.scales)
        return expand_k_records(self.mins) if self.k_records else self.mins.float()

    def expanded(self) -> Int4Weight:
        """This weight with fp32 d and m [N, K/32] where it holds K records (itself otherwise): the same values, for
        readers that take only fp16/fp32 scales (GPU kernels).  Cost: 8 bytes per 32 weights instead of 20 per 256."""
        return Int4Weight(self.packed, self.scales_f32(), self.mins_f32(), self.group_size) if self.k_records else self

    def with_mins(self) -> Int4Weight:
        """This weight with its m stored (itself when it has mins): a symmetric weight's Q4_1 form, m = −8·d in the
        scales' dtype — exact, except that −8·d overflows fp16 when |d| > 8188, and then d and m are fp32 for the
        whole weight.  Same dequantized values and kernel results, 2 more bytes per fp16 group.  Cost: one pass over
        the scales (for the dequantizing reference and tests; the kernels take the symmetric form as it is)."""
        if self.mins is None:
            m = symmetric_mins(self.scales)
            fits = torch.isfinite(m.to(self.scales.dtype)[torch.isfinite(m)]).all()  # no finite m overflows
            d = self.scales if fits else self.scales.float()
            return Int4Weight(self.packed, d, m.to(d.dtype), self.group_size)
        return self

    def codes(self) -> Tensor:
        """The unpacked codes q [N, K] uint8 in 0..15, in weight order."""
        return unpack_int4(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[N, K] in ``dtype``: d · q + m in fp32 (bit for bit gguf's Q4_1, Q4_0 and Q4_K dequantization), then
        cast."""
        N, K = self.shape
        q = self.codes().float().view(N, K // self.group_size, self.group_size)
        w = q * self.scales_f32().unsqueeze(-1) + self.mins_f32().unsqueeze(-1)
        return w.view(N, K).to(dtype)

    def to(self, device: torch.device | str) -> Int4Weight:
        """The same weight on ``device``; K records moved off the CPU are expanded to fp32 d and m (``expanded``:
        only the CPU kernels read records)."""
        w = self.expanded() if torch.device(device).type != "cpu" else self
        return Int4Weight(w.packed.to(device), w.scales.to(device),
                          None if w.mins is None else w.mins.to(device), w.group_size)


def pack_int4(q: Tensor) -> Tensor:
    """Codes [N, K] (0..15, K a multiple of 32) -> [N, K/2] uint8, per 32-block: byte j = q[j] | q[j + 16] << 4."""
    N, K = q.shape
    if K % BLOCK:
        raise ValueError(f"K={K} must be a multiple of {BLOCK} to pack int4 blocks; pad with zero columns")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 codes must lie in 0..15")
    qb = q.to(torch.uint8).view(N, K // BLOCK, 2, BLOCK // 2)  # [N, blocks, low/high half, 16]
    return (qb[:, :, 0] | (qb[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_int4(packed: Tensor) -> Tensor:
    """[N, K/2] uint8 -> codes [N, K] uint8 (inverse of ``pack_int4``)."""
    N, half = packed.shape
    pb = packed.view(N, half // (BLOCK // 2), BLOCK // 2)
    return torch.stack([pb & 0x0F, pb >> 4], dim=2).reshape(N, half * 2)


def quantize_int8(w: Tensor, group_size: int | None = None) -> Int8Weight:
    """w [N, K] float -> symmetric int8 codes in [-127, 127]; one fp32 scale per output channel (group_size None)
    or per group of ``group_size`` along K."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int8 needs a float [N, K] weight, got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    g = K if group_size is None else group_size
    check_group_size(K, g)
    spec = QuantSpec(bits=8, symmetric=True, granularity=Granularity.GROUP, group_size=g)
    wg = group_view(w.float(), spec)  # [N, K/g, g]
    scale = (wg.abs().amax(-1) / spec.qmax).clamp_min(torch.finfo(torch.float32).tiny)  # [N, K/g]
    q = torch.clamp(torch.round(wg / scale.unsqueeze(-1)), spec.qmin, spec.qmax).to(torch.int8)
    return Int8Weight(q.reshape(N, K), scale, g)


def quantize_q8_0(w: Tensor) -> Int8Weight:
    """w [N, K] float (K a multiple of 32) -> ``Int8Weight`` in GGUF's Q8_0 blocks: per 32 weights d = max|w| / 127
    rounded to fp16, codes round(w / d) against that stored d, clamped to ±127, so |w − d·q| ≤ d / 2."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_q8_0 needs a float [N, K] weight, got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    check_group_size(K, BLOCK)
    wb = w.float().view(N, K // BLOCK, BLOCK)
    d = (wb.abs().amax(-1) / 127).half()  # [N, K/32]
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.clamp(torch.round(wb * inv.unsqueeze(-1)), -127, 127).to(torch.int8)
    return Int8Weight(q.view(N, K), d, BLOCK)


def quantize_int4(w: Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.float16) -> Int4Weight:
    """w [N, K] float -> ``Int4Weight``: asymmetric 4-bit groups in llama.cpp's Q4_1 layout.

    Contract, per row and group of ``group_size`` consecutive weights (a multiple of 32 that divides K, else
    ValueError naming the fix; w must be a float [N, K] tensor, ``scale_dtype`` fp16 or fp32, else ValueError):
    - ``d = (max - min) / 15`` and ``m = min``, computed in fp32 then rounded to ``scale_dtype``; ``scales`` and
      ``mins`` are those rounded values, [N, K // group_size];
    - codes ``q = clamp(round((w - m) / d), 0, 15)`` with the *rounded* d and m (the best codes for the scales
      actually stored); a constant group (d == 0) gets every code 0, so it dequantizes to m;
    - ``packed`` [N, K / 2] uint8: per block of 32 weights (whatever the group size), byte j (0..15) holds weight
      j in its low nibble and weight j + 16 in its high nibble — byte for byte the ``qs`` of a GGUF Q4_1 block.
    Dequantized: w ≈ d · q + m, within d / 2 of w.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int4 needs a float [N, K] weight, got {w.dtype} {tuple(w.shape)}")
    if scale_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"scale_dtype must be torch.float16 or torch.float32, got {scale_dtype}")
    N, K = w.shape
    check_group_size(K, group_size, BLOCK)
    ### BEGIN SOLUTION
    wg = w.float().view(N, K // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d = ((hi - lo) / 15).to(scale_dtype)
    m = lo.to(scale_dtype)
    df, mf = d.float().unsqueeze(-1), m.float().unsqueeze(-1)
    inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))  # a constant group: every code 0, w = m
    q = torch.clamp(torch.round((wg - mf) * inv), 0, 15).to(torch.uint8)
    qb = q.view(N, K // BLOCK, 2, BLOCK // 2)  # [N, blocks, low/high half of the block, 16]
    packed = (qb[:, :, 0] | (qb[:, :, 1] << 4)).reshape(N, K // 2)  # byte j = q[j] | q[j + 16] << 4
    return Int4Weight(packed, d, m, group_size)
    ### END SOLUTION


def check_in_features(x: Tensor, K: int) -> None:
    """ValueError unless x's last dimension is the weight's K."""
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K={K}")


def int8_linear_ref(x: Tensor, w8: Int8Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ dequantized(w8).T (+ bias) -> [..., N] in x's dtype: the exact W8A16 reference."""
    check_in_features(x, w8.shape[1])
    return F.linear(x, w8.dequantize(x.dtype), bias)


def int4_linear_ref(x: Tensor, w4: Int4Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ dequantized(w4).T (+ bias) -> [..., N] in x's dtype: the exact W4A16 reference.

    Contract: unpack the nibbles of ``w4.packed`` [N, K/2] (per 32-weight block, byte j holds weight j low and
    j + 16 high), dequantize per group in fp32 (w = d · q + m with d, m = ``w4.scales_f32()``, ``w4.mins_f32()``),
    then y = x · wᵀ (+ bias) with w cast to x's dtype.  x's last dim must be K (else ValueError).  Bytes: the
    packed weight (K/2 + 4·K/g per row) is read, an [N, K] float weight is written and read back per call — what
    the native and Triton kernels avoid by dequantizing in registers.
    """
    check_in_features(x, w4.shape[1])
    ### BEGIN SOLUTION
    N, K = w4.shape
    g = w4.group_size
    blocks = w4.packed.view(N, K // BLOCK, BLOCK // 2)  # [N, blocks, 16]
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [N, blocks, 32] in weight order: low nibbles first
    q = q.view(N, K // g, g).float()
    w = q * w4.scales_f32().unsqueeze(-1) + w4.mins_f32().unsqueeze(-1)  # [N, K/g, g] fp32, as gguf computes
    return F.linear(x, w.view(N, K).to(x.dtype), bias)
    ### END SOLUTION


@dataclass(frozen=True)
class Q6KWeight:
    """GGUF Q6_K weight as stored: ``blocks`` uint8 [N, K/256, 210], per row and 256 weights ``ql`` (bytes 0..127),
    ``qh`` (128..191), 16 int8 sub-scales (192..207), fp16 d (208..209, little-endian); see the module docstring.

    Bit layout (gguf's ``Q6_K.dequantize_blocks``): a super-block is two halves of 128 weights, half h owning
    ``ql[64h : 64h + 64]`` and ``qh[32h : 32h + 32]``; weight i of a half takes its low 4 bits from ``ql`` byte
    i % 64 (low nibble for i < 64, high nibble after) and its high 2 bits from ``qh`` byte i % 32, bits 2·(i // 32)
    and up.  Bytes: 210 per 256 weights (``nbytes``), what a GEMV over it streams."""

    blocks: Tensor

    def __post_init__(self):
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 3 or b.shape[2] != Q6K_BYTES:
            raise ValueError(f"blocks must be uint8 [N, K/{QK_K}, {Q6K_BYTES}] (Q6_K super-blocks), got {b.dtype} "
                             f"{tuple(b.shape)}: build them from a GGUF tensor's bytes with quant.gguf.q6_k_blocks")
        _store_contiguous(self, "blocks")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight it stands for."""
        return self.blocks.shape[0], self.blocks.shape[1] * QK_K

    @property
    def nbytes(self) -> int:
        """Bytes stored (210 per 256 weights): what a GEMV streams from memory."""
        return self.blocks.nbytes

    @property
    def group_size(self) -> int:
        """Weights per scale (d · sc per 16): the format's, not a choice."""
        return Q6K_GROUP

    def codes(self) -> Tensor:
        """q int8 [N, K] in −32..31, in weight order.  Cost: one pass over the 192 code bytes per 256 weights."""
        N, K = self.shape
        S = K // QK_K
        ql = self.blocks[..., :128].reshape(N, S, 2, 64)  # [N, S, half, 64]
        qh = self.blocks[..., 128:192].reshape(N, S, 2, 32)  # [N, S, half, 32]
        low = torch.stack([ql & 0x0F, ql >> 4], dim=3).reshape(N, S, 2, 128)  # weight i of a half: ql byte i % 64
        high = torch.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=3).reshape(N, S, 2, 128)  # qh byte i % 32
        return ((low | (high << 4)).view(torch.int8) - 32).reshape(N, K)  # 0..63 fits int8: no wrap

    def scales_f32(self) -> Tensor:
        """d · sc fp32 [N, K/16], one per 16 weights: the fp16 d times each int8 sub-scale, exact in fp32."""
        N, K = self.shape
        d = self.blocks[..., 208:210].contiguous().view(torch.float16).float()  # [N, S, 1]
        sc = self.blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
        return (d * sc).reshape(N, K // Q6K_GROUP)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[N, K] in ``dtype``: (d · sc) · q in fp32 (bit for bit gguf's Q6_K dequantization), then cast."""
        return self.expanded().dequantize(dtype)

    def expanded(self) -> Int8Weight:
        """The same weight as an ``Int8Weight`` with group 16: codes q, fp32 scales d · sc [N, K/16] — the same
        dequantized bits, for readers that take only int8 codes (GPU kernels).  Cost: 10 bits a weight (vs 6.56)."""
        return Int8Weight(self.codes(), self.scales_f32(), Q6K_GROUP)

    def to(self, device: torch.device | str) -> Q6KWeight | Int8Weight:
        """The same weight on ``device``: itself on the CPU (whose kernel reads the blocks), elsewhere the expanded
        ``Int8Weight`` moved there."""
        return self if torch.device(device).type == "cpu" else self.expanded().to(device)


def q6k_linear_ref(x: Tensor, w: Q6KWeight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ dequantized(w).T (+ bias) -> [..., N] in x's dtype: the exact Q6_K reference (the expanded
    ``Int8Weight`` through ``int8_linear_ref``).  Cost: an [N, K] float weight written and read back per call."""
    return int8_linear_ref(x, w.expanded(), bias)


def fit_group_size(K: int, group_size: int) -> int:
    """The largest int4 group in ``INT4_GROUP_SIZES`` that is ≤ ``group_size`` and divides K (SmolLM2's K = 576 is
    a multiple of 64 but not of 128: "g128" there means 128 for down_proj's K = 1536 and 64 elsewhere)."""
    fits = [g for g in INT4_GROUP_SIZES if g <= group_size and K % g == 0]
    if not fits:
        raise ValueError(f"no int4 group size ≤ {group_size} in {INT4_GROUP_SIZES} divides K={K}: pad K to a "
                         f"multiple of {INT4_GROUP_SIZES[0]}")
    return max(fits)
