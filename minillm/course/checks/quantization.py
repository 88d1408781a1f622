"""Checkers of notebook 07: quantization.

Each checker computes its expected values with a reference written here (never the library function the exercise
targets: a grader hides that one while the checker runs), on fresh random inputs and edge cases the stubs do not
list: outliers, all-zero and constant groups, clipping, bf16 inputs, group sizes larger than the 32-weight packing
block, and K that a group does not divide (the contracts say ValueError).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor

from minillm.course.checks.registry import _passed, exercise
from minillm.course.checks.roofline import prediction_checker
from minillm.quant.formats import Granularity, QuantSpec
from minillm.quant.weight import Int4Weight

_TINY = torch.finfo(torch.float32).tiny


def _fresh_generator() -> tuple[torch.Generator, int]:
    """A generator on a fresh seed (named in failure messages, so a failure can be replayed)."""
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _expect_value_error(call: Callable[[], object], what: str) -> None:
    try:
        call()
    except ValueError:
        return
    raise AssertionError(f"{what}: expected a ValueError (the contract), but the call returned normally")


def _near_tie(t: Tensor) -> Tensor:
    """Where t (the unrounded code) is within 1e-3 of a .5 boundary: two roundings may both be right there."""
    return ((t - torch.floor(t)) - 0.5).abs() < 1e-3


# ------------------------------------------------------------------------------------------------ exercise 7.1
def _ref_quantize(x: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(scale, zero point, unrounded zero point qmin - lo / scale, unrounded x / scale), each broadcast to x's
    shape (fp64), from the module docstring's maps with fp32 statistics, one group of elements at a time."""
    xf = x.float()
    if spec.granularity is Granularity.TENSOR:
        groups = xf.reshape(1, -1)
    elif spec.granularity is Granularity.CHANNEL:
        groups = xf.reshape(-1, xf.shape[-1])
    else:
        groups = xf.reshape(-1, spec.group_size)
    rows = []
    for row in groups:
        if spec.symmetric:
            amax = row.abs().max() * spec.clip_ratio
            s, z, zt = amax.clamp_min(_TINY) / spec.qmax, 0.0, 0.0
        else:
            lo, hi = row.min().clamp_max(0) * spec.clip_ratio, row.max().clamp_min(0) * spec.clip_ratio
            s = ((hi - lo) / (spec.qmax - spec.qmin)).clamp_min(_TINY)
            zt = spec.qmin - float(lo / s)
            z = min(max(spec.qmin - round(float(lo / s)), spec.qmin), spec.qmax)
        rows.append((float(s), z, zt))
    out = [torch.tensor([r[i] for r in rows], dtype=torch.float64)[:, None].expand(groups.shape).reshape(x.shape)
           for i in range(3)]
    return out[0], out[1], out[2], groups.double().reshape(x.shape) / out[0]


def _spread(v: Tensor, x: Tensor, spec: QuantSpec, what: str, call: str) -> Tensor:
    """A returned scale / zero point of the contract's shape, broadcast to x's shape (AssertionError otherwise)."""
    if spec.granularity is Granularity.TENSOR:
        want = (1,) * x.dim()
    elif spec.granularity is Granularity.CHANNEL:
        want = (*x.shape[:-1], 1)
    else:
        want = (*x.shape[:-1], x.shape[-1] // spec.group_size)
    got = tuple(getattr(v, "shape", ()))
    assert got == want, f"{call}: {what} has shape {got}, expected {want} for granularity {spec.granularity.value!r}"
    v = v.double()
    if spec.granularity is Granularity.GROUP:
        v = v.repeat_interleave(spec.group_size, dim=-1)
    return v.expand(x.shape)


def _check_one_quantize(quantize: Callable, x: Tensor, spec: QuantSpec, name: str) -> None:
    call = (f"{name}: quantize(x {list(x.shape)} {str(x.dtype).removeprefix('torch.')}, QuantSpec(bits={spec.bits}, "
            f"symmetric={spec.symmetric}, granularity={spec.granularity.value!r}, group_size={spec.group_size}, "
            f"clip_ratio={spec.clip_ratio}))")
    before = x.clone()
    got = quantize(x, spec)
    assert torch.equal(x, before), f"{call} modified its input x"
    for attr in ("q", "scale", "zero_point"):
        assert hasattr(got, attr), f"{call} must return a Quantized (q, scale, zero_point, spec), got {type(got)}"
    s_ref, z_ref, z_exact, t = _ref_quantize(x, spec)
    want_dtype = torch.uint8 if spec.bits == 4 and not spec.symmetric else torch.int8
    assert got.q.dtype == want_dtype and tuple(got.q.shape) == tuple(x.shape), (
        f"{call}: codes are {got.q.dtype} {tuple(got.q.shape)}, expected {want_dtype} {tuple(x.shape)}")
    s_got = _spread(got.scale, x, spec, "scale", call)
    z_got = _spread(got.zero_point, x, spec, "zero_point", call)
    # an all-zero symmetric group's scale is tiny / qmax, an fp32 subnormal (0 where the CPU flushes subnormals,
    # as torch.set_flush_denormal(True) makes it): there only x̂ = 0 is checked, below
    normal = s_ref >= _TINY
    bad = ~torch.isclose(s_got, s_ref, rtol=1e-5, atol=0) & normal | ~(s_got >= 0)
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise AssertionError(f"{call}: scale at element {i} is {float(s_got[i]):.6g}, expected {float(s_ref[i]):.6g} "
                             "(symmetric: clip_ratio·max|x| / qmax; asymmetric: (hi - lo) / (qmax - qmin) over the "
                             "range widened to include 0, per scale's elements)")
    bad = (z_got != z_ref) & ~(((z_got - z_ref).abs() == 1) & _near_tie(z_exact))  # lo / scale may sit on a tie
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise AssertionError(f"{call}: zero_point at element {i} is {float(z_got[i])}, expected {float(z_ref[i])} "
                             "(qmin - round(lo / scale), clamped; 0 when symmetric)")
    q = got.q.double()
    q_ref = torch.clamp(torch.round(t) + z_got, spec.qmin, spec.qmax)
    bad = (q != q_ref) & ~_near_tie(t) & normal
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise AssertionError(f"{call}: code at element {i} (x = {float(x[i]):.6g}) is {int(q[i])}, expected "
                             f"{int(q_ref[i])} = clamp(round(x / scale) + zero_point, qmin={spec.qmin}, "
                             f"qmax={spec.qmax}); {int(bad.sum())} of {x.numel()} codes differ")
    x_hat = (q - z_got) * s_got
    assert torch.isfinite(x_hat).all(), f"{call}: (q - zero_point) · scale is not finite, expected finite values"
    assert (x_hat[~normal] == 0).all(), f"{call}: an all-zero group dequantizes to nonzero values, expected 0"


@exercise("7.1", "minillm.quant.formats.quantize", "absmax and zero-point quantization at any granularity",
          "view x so each scale's elements share the last dim (tensor, row, or groups of group_size — check that "
          "it divides K); symmetric: scale = clip·amax/qmax, zero 0; asymmetric: widen [min, max] to include 0, "
          "scale = (hi-lo)/(qmax-qmin), zero = qmin - round(lo/scale); q = clamp(round(x/scale)+zero); reshape back")
def check_quantize(quantize: Callable) -> None:
    """``quantize(x, spec)`` against an element-by-element reference: int8/int4 × symmetric/asymmetric × tensor/
    channel/group, clipping, outliers, 1-D/3-D and bf16 inputs, all-zero and constant groups, all-positive
    tensors; a group that does not divide K must raise ValueError."""
    g, seed = _fresh_generator()
    rand = random.Random(seed)
    N, K = rand.randint(3, 6), rand.choice([64, 96])
    x = torch.randn(N, K, generator=g)
    x[rand.randrange(N), rand.randrange(K)] = 40.0  # one outlier: per-tensor scales suffer, per-group barely
    specs = [QuantSpec(bits, sym, gran, 32 if gran == "group" else None, clip)
             for bits in (8, 4) for sym in (True, False) for gran in ("tensor", "channel", "group")
             for clip in (1.0, 0.8)]
    for spec in specs:
        _check_one_quantize(quantize, x, spec, f"seed {seed}, an outlier of 40")
    edge = torch.randn(4, 64, generator=g)
    edge[0] = 0.0  # an all-zero row: scale must stay positive, codes = zero point
    edge[1, :32] = 0.5  # a constant group (max == min)
    edge[2] = edge[2].abs() + 0.1  # all positive: the asymmetric range still includes 0
    cases = [(edge, "all-zero, constant and all-positive rows"),
             (torch.randn(2, 3, 48, generator=g), "a 3-D input"),
             (torch.randn(48, generator=g), "a 1-D input"),
             (torch.randn(3, 64, generator=g).to(torch.bfloat16), "a bf16 input (statistics in fp32)")]
    for t, name in cases:
        for spec in (QuantSpec(8, True, "channel"), QuantSpec(8, False, "tensor"), QuantSpec(4, True, "group", 16),
                     QuantSpec(4, False, "group", 16), QuantSpec(4, False, "channel", None, 0.9)):
            _check_one_quantize(quantize, t, spec, f"seed {seed}, {name}")
    _expect_value_error(lambda: quantize(torch.randn(2, 40, generator=g), QuantSpec(4, False, "group", 32)),
                        "quantize(x [2, 40], group_size=32) (32 does not divide K = 40)")
    _check_ties(quantize)
    _passed("7.1")


def _check_ties(quantize: Callable) -> None:
    """Codes exactly halfway between two integers round half to even (the contract; ``torch.round``): symmetric
    int8 per tensor with max|x| = 127 makes the scale exactly 1, so x / scale is x itself."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5]])
    expected = [127, 0, 2, 2, 0, -2, -2, 4]
    got = quantize(x, QuantSpec(8, True, "tensor"))
    codes = [int(c) for c in got.q.reshape(-1).tolist()]
    assert codes == expected, (
        f"ties: quantize(x = {x.reshape(-1).tolist()}, QuantSpec(bits=8, symmetric=True, granularity='tensor')) — "
        f"the scale is exactly 1, so the codes are round(x) — returned codes {codes}, expected {expected}: round "
        "half to even, as the contract says (torch.round does; floor(x + 0.5) or rounding half away from zero "
        "do not).")


# ------------------------------------------------------------------------------------------------ exercise 7.2
def _nibbles(packed: Tensor) -> Tensor:
    """[N, K/2] uint8 -> codes [N, K] int64 in weight order, by arithmetic (// 16, % 16) per 32-weight block."""
    N, half = packed.shape
    p = packed.long().reshape(N, half // 16, 16)
    return torch.cat([p % 16, p // 16], dim=-1).reshape(N, 2 * half)


def _check_one_int4(quantize_int4: Callable, w: Tensor, group_size: int, scale_dtype: torch.dtype, name: str):
    N, K = w.shape
    call = (f"{name}: quantize_int4(w [{N}, {K}] {str(w.dtype).removeprefix('torch.')}, group_size={group_size}, "
            f"scale_dtype={scale_dtype})")
    got = quantize_int4(w, group_size, scale_dtype)
    assert isinstance(got, Int4Weight), f"{call} must return an Int4Weight, got {type(got).__name__}"
    assert got.group_size == group_size, f"{call}: group_size {got.group_size}, expected {group_size}"
    want = (N, K // group_size)
    for what, t in (("scales", got.scales), ("mins", got.mins)):
        assert tuple(t.shape) == want and t.dtype == scale_dtype, (
            f"{call}: {what} is {t.dtype} {tuple(t.shape)}, expected {scale_dtype} {want}")
    wg = w.float().reshape(N, K // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d_ref, m_ref = ((hi - lo) / 15).to(scale_dtype), lo.to(scale_dtype)
    for what, t, ref in (("scales d", got.scales, d_ref), ("mins m", got.mins, m_ref)):
        bad = ~torch.isclose(t.double(), ref.double(), rtol=2e-3, atol=0)
        if bad.any():
            r, c = (int(j) for j in bad.nonzero()[0])
            raise AssertionError(f"{call}: {what}[{r}, {c}] is {float(t[r, c]):.6g}, expected {float(ref[r, c]):.6g} "
                                 "(d = (max - min) / 15, m = min of the group, rounded to scale_dtype)")
    d = got.scales.double().repeat_interleave(group_size, 1)
    m = got.mins.double().repeat_interleave(group_size, 1)
    t = torch.where(d > 0, (w.double() - m) / d, torch.zeros_like(d))
    q_ref = torch.clamp(torch.round(t), 0, 15)
    q = _nibbles(got.packed).double()
    assert got.packed.dtype == torch.uint8 and tuple(got.packed.shape) == (N, K // 2), (
        f"{call}: packed is {got.packed.dtype} {tuple(got.packed.shape)}, expected torch.uint8 {(N, K // 2)}")
    bad = (q != q_ref) & ~_near_tie(t)
    if bad.any():
        r, c = (int(j) for j in bad.nonzero()[0])
        byte = c // 32 * 16 + c % 16
        raise AssertionError(
            f"{call}: weight [{r}, {c}] = {float(w[r, c]):.5g} decodes to code {int(q[r, c])} from byte "
            f"[{r}, {byte}] ({'high' if c % 32 >= 16 else 'low'} nibble), expected {int(q_ref[r, c])}: codes are "
            f"round((w - m) / d) with the stored d and m; per 32-weight block, byte j holds weight j in its low "
            f"nibble and weight j + 16 in its high nibble; {int(bad.sum())} of {N * K} codes differ")
    w_hat = got.dequantize(torch.float64)  # the library's decoder of the format (Q4_1: d · q + m in fp32)
    err = (w_hat - w.double()).abs() - got.scales.double().repeat_interleave(group_size, 1) / 2
    assert float(err.max()) <= 1e-3 * float(w.abs().max()) + 1e-6, (
        f"{call}: the library's Int4Weight.dequantize of your packed weight is off by up to "
        f"{float(err.max()):.3g} more than d/2, expected within d/2")


@exercise("7.2", "minillm.quant.weight.quantize_int4", "Q4_1 groups: scales, minimums and nibble packing",
          "view w as [N, K/g, g]; d = (max-min)/15 and m = min rounded to scale_dtype; q = round((w-m)/d) with the "
          "rounded d, m (0 where d == 0); pack per 32-block: view q as [N, K/32, 2, 16] and OR the low half with "
          "the high half << 4")
def check_quantize_int4(quantize_int4: Callable) -> None:
    """``quantize_int4(w, group_size, scale_dtype)`` on random weights with an outlier, group sizes 32/64/128,
    fp16 and fp32 scales, constant and all-zero groups, a bf16 weight; bad group sizes must raise ValueError."""
    g, seed = _fresh_generator()
    rand = random.Random(seed)
    for group_size, K in ((32, 96), (64, 128), (128, 256)):
        w = torch.randn(rand.randint(2, 5), K, generator=g) * 0.05
        w[0, rand.randrange(K)] = 1.5  # an outlier: it stretches only its own group
        for scale_dtype in (torch.float16, torch.float32):
            _check_one_int4(quantize_int4, w, group_size, scale_dtype, f"seed {seed}")
    edge = torch.randn(3, 64, generator=g) * 0.02
    edge[0, :32] = 0.25  # a constant group: d = 0, every code 0, dequantizes to m exactly
    edge[1] = 0.0
    _check_one_int4(quantize_int4, edge, 32, torch.float16, f"seed {seed}, constant and all-zero groups")
    _check_one_int4(quantize_int4, (torch.randn(2, 64, generator=g) * 0.1).to(torch.bfloat16), 32, torch.float16,
                    f"seed {seed}, a bf16 weight")
    for K, group_size in ((48, 32), (96, 64), (64, 16)):
        _expect_value_error(lambda K=K, gs=group_size: quantize_int4(torch.randn(2, K, generator=g), gs),
                            f"quantize_int4(w [2, {K}], group_size={group_size})")
    _passed("7.2")


# ------------------------------------------------------------------------------------------------ exercise 7.3
class _PackedOnly(Int4Weight):
    """An Int4Weight whose own decoders are off limits: the exercise is to unpack the bytes yourself."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        raise AssertionError("exercise 7.3: expected your own unpacking of w4.packed, not w4.dequantize()")

    def codes(self) -> Tensor:
        raise AssertionError("exercise 7.3: expected your own unpacking of w4.packed, not w4.codes()")


def _random_int4(g: torch.Generator, N: int, K: int, group_size: int, scale_dtype: torch.dtype) -> _PackedOnly:
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, K // group_size, generator=g) * 0.02 + 0.001).to(scale_dtype)
    mins = (-torch.rand(N, K // group_size, generator=g) * 0.15).to(scale_dtype)
    return _PackedOnly(packed, scales, mins, group_size)


def _ref_int4_linear(x: Tensor, w4: Int4Weight, bias: Tensor | None) -> Tensor:
    """fp64: unpack by arithmetic, w = d · q + m (rounded to x's dtype as the contract casts it), x · wᵀ + bias."""
    N, K = w4.shape
    q = _nibbles(w4.packed).double()
    w = q * w4.scales.double().repeat_interleave(w4.group_size, 1) + w4.mins.double().repeat_interleave(
        w4.group_size, 1)
    w = w.float().to(x.dtype).double()
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


@exercise("7.3", "minillm.quant.weight.int4_linear_ref", "the dequantizing int4 GEMV",
          "view packed as [N, K/32, 16]; low nibbles (& 0x0F) are weights 0..15 of each block, high (>> 4) "
          "16..31; view the codes as [N, K/g, g], w = q·d + m in fp32, then F.linear(x, w.to(x.dtype), bias)")
def check_int4_linear_ref(int4_linear: Callable) -> None:
    """``int4_linear_ref(x, w4, bias)`` on random packed weights (group 32/64/128, fp16 and fp32 scales), x of
    shapes [K], [1, K], [3, K], [2, 2, K] in fp32 and bf16, with and without bias, against an fp64 reference.
    The weights refuse ``dequantize()``/``codes()``: the bytes must be unpacked here."""
    g, seed = _fresh_generator()
    rand = random.Random(seed)
    for group_size, K in ((32, 96), (64, 128), (128, 256)):
        for scale_dtype in (torch.float16, torch.float32):
            N = rand.randint(3, 9)
            w4 = _random_int4(g, N, K, group_size, scale_dtype)
            for lead in ((), (1,), (3,), (2, 2)):
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(*lead, K, generator=g).to(dtype)
                    bias = torch.randn(N, generator=g).to(dtype) if lead == (3,) else None
                    call = (f"seed {seed}: int4_linear_ref(x {[*lead, K]} {str(dtype).removeprefix('torch.')}, "
                            f"w4 [{N}, {K}] group {group_size} {str(scale_dtype).removeprefix('torch.')} scales, "
                            f"bias {'[N]' if bias is not None else None})")
                    got = int4_linear(x, w4, bias)
                    assert isinstance(got, Tensor) and tuple(got.shape) == (*lead, N) and got.dtype == dtype, (
                        f"{call} returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))} "
                        f"{getattr(got, 'dtype', '')}, expected a {str(dtype).removeprefix('torch.')} tensor of "
                        f"shape {(*lead, N)}")
                    ref = _ref_int4_linear(x, w4, bias)
                    # fp32: the fp64 reference and an fp32 GEMV may sum K products in different orders;
                    # bf16: the output is rounded to 8 mantissa bits (and the bf16 matmul accumulates in fp32)
                    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
                    err = (got.double() - ref).abs() - rtol * ref.abs()
                    if float(err.max()) > atol:
                        i = tuple(int(j) for j in (err == err.max()).nonzero()[0])
                        raise AssertionError(
                            f"{call}: output {i} is {float(got[i]):.6g}, expected {float(ref[i]):.6g} (max error "
                            f"{float((got.double() - ref).abs().max()):.3g}). Per 32-weight block byte j holds weight "
                            "j (low nibble) and j + 16 (high); w = d · q + m per group of group_size weights")
    w4 = _random_int4(g, 4, 64, 32, torch.float16)
    _expect_value_error(lambda: int4_linear(torch.randn(2, 32, generator=g), w4, None),
                        "int4_linear_ref(x [2, 32], w4 [4, 64]) (x's last dim is not K)")
    _passed("7.3")


@exercise("7.6", "minillm.kernels.triton.dequant_gemv.int4_gemv_program", "the dequantizing int4 GEMV in Triton",
          "per BLOCK_K tile: byte (k // 32)·16 + k % 16, shift 4 when k % 32 ≥ 16, & 0xF; d and m of group "
          "k // G; acc += Σ (q·d + m)·x over the tile, masked at K")
def check_int4_gemv_program(int4_gemv_program: Callable) -> None:
    """Your program, compiled with ``triton.jit`` and launched by the library's ``int4_gemv_triton``, against
    ``int4_linear_ref`` (the unpack-then-``F.linear`` reference of exercise 7.3) on random Q4_1 weights: groups of
    32, 64 and 128, fp16 and fp32 scales, K not a multiple of the tile (a ragged last tile), N past one program's
    BLOCK_N rows (a ragged last row block), one and several input rows.  On CPU it runs in Triton's interpreter
    (TRITON_INTERPRET=1 before the kernels are defined)."""
    from minillm.course.checks.paged import _triton_program, _unwrap_interpreter
    from minillm.kernels.triton.dequant_gemv import int4_gemv_triton
    from minillm.quant.weight import int4_linear_ref

    kernel = _triton_program("7.6", int4_gemv_program)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g, seed = _fresh_generator()
    cases = [  # N, K, group size, scale dtype, input rows M
        (5, 96, 32, torch.float16, 1),
        (37, 256, 64, torch.float32, 3),
        (8, 384, 128, torch.float16, 2),
    ]
    for N, K, group_size, scale_dtype, M in cases:
        w4 = _random_int4(g, N, K, group_size, scale_dtype)
        x = torch.randn(M, K, generator=g)
        expected = int4_linear_ref(x, w4, None)
        call = (f"seed {seed}: x [{M}, {K}] fp32, w4 [{N}, {K}] group {group_size} "
                f"{str(scale_dtype).removeprefix('torch.')} scales (tiles of 128 weights, 32 output rows per program)")
        on = Int4Weight(w4.packed.to(device), w4.scales.to(device), w4.mins.to(device), group_size)
        try:
            got = int4_gemv_triton(x.to(device), on, program=kernel).cpu()
        except Exception as e:
            _unwrap_interpreter(e)
            raise
        tol = {"rtol": 1e-4, "atol": 1e-4} if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}
        torch.testing.assert_close(got, expected, **tol, msg=lambda m, call=call: (
            f"{call}: the output differs from int4_linear_ref's. Weight k of a row is in byte (k // 32)·16 + k % 16, "
            f"the low nibble when k % 32 < 16, else the high one; w = d·q + m with the group k // G; mask k ≥ K. {m}"))
    _passed("7.6")


check_prediction_int4 = prediction_checker(
    "7.0", "prediction_int4", "minillm.course.predictions.predict_int4_tok_s",
    "int4 (Q4_1) decode tokens/s at batch 1", "tokens/s")
