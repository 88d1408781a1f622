"""The prefill GEMM for block-quantized weights (``native_quant.block_prefill_linear``: x rounded to int8 blocks of 32,
Q8_0 / Q4_0 / Q4_1 weights, int32 block sums) against its reference: the activations rounded as
``q8_activation_ref`` rounds them, both operands dequantized, the product in fp64."""

import platform

import pytest
import torch

from minillm.kernels.cpu import quant as native_quant
from minillm.kernels.cpu.quant import q8_activation_ref
from minillm.quant.weight import Int4Weight, Int8Weight, int8_linear_ref, pack_int4, quantize_int4, quantize_int8

native = pytest.mark.skipif(not native_quant.available(), reason="no C compiler: the native kernels are not built")
# None: this CPU's build (the AVX-512 VNNI tiles where it has them); "x86-64": the plain C twin every other CPU runs.
TARGETS = [None, "x86-64"] if platform.machine() in ("x86_64", "AMD64") else [None]
U = 2.0 ** -24  # fp32 unit roundoff


def _target_or_skip(target):
    if not native_quant.available(target):
        pytest.skip(f"the {target} build is not available here")


def _q4_0(N: int, K: int, g: torch.Generator, scale_dtype=torch.float16) -> Int4Weight:
    """GGUF Q4_0 as minillm loads it: codes 0..15, d per block, no mins (m = -8 d: w = d (q - 8))."""
    d = (torch.rand(N, K // 32, generator=g) * 0.1 + 0.01).to(scale_dtype)
    return Int4Weight(pack_int4(torch.randint(0, 16, (N, K), generator=g)), d, None, 32)


def _parts(w: Int8Weight | Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(w exactly, in fp64; |d q| + |m| per weight, fp64: the magnitudes of the terms the kernel adds), [N, K]."""
    N, K = w.shape
    if isinstance(w, Int8Weight):
        s = w.scales.double().repeat_interleave(w.group_size, dim=1)
        exact = w.qweight.double() * s
        return exact, exact.abs()
    d = w.scales.double().repeat_interleave(w.group_size, dim=1)
    m = w.mins_f32().double().repeat_interleave(w.group_size, dim=1)
    q = w.codes().double()
    return d * q + m, (d * q).abs() + m.abs()


def _assert_within_rounding(got: torch.Tensor, x: torch.Tensor, w: Int8Weight | Int4Weight):
    """got against xhat @ w.T in fp64, xhat = q8_activation_ref(x).  Per block the kernel's integer sum is exact; its
    product with d · dx (two fp32 roundings), the min's term m · (dx · Σ xq) (two) and the fp32 accumulation of
    2 · K/32 such terms each move the result by at most (2 · K/32 + 4) · u · Σ|terms|,
    Σ|terms| ≤ |xhat| @ (|d q| + |m|)."""
    exact_w, mag = _parts(w)
    xhat = q8_activation_ref(x).double()
    want, bound = xhat @ exact_w.T, xhat.abs() @ mag.T
    tol = (2 * w.shape[1] // 32 + 4) * U * bound
    err = (got.double() - want).abs()
    assert (err <= tol).all(), (err / tol).max()
    return want, tol


@native
@pytest.mark.parametrize("target", TARGETS)
def test_prefill_rounding_is_the_references_bit_for_bit(target):
    """Codes · dx equal q8_activation_ref's xhat exactly (fp32 and bf16 x); a zero block has dx 0 and codes 0; a
    quotient at k + 1/2 rounds half to even, as torch.round does."""
    _target_or_skip(target)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g) * 3
    x[1, 32:64] = 0
    x[2, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26)  # dx = 1: the ties themselves
    for xi in (x, x.bfloat16()):
        codes, dx = native_quant.block_prefill_round(xi, target=target)
        xhat = (codes.float().view(5, 3, 32) * dx.unsqueeze(-1)).view(5, 96)
        assert torch.equal(xhat, q8_activation_ref(xi))
    assert codes[2, :6].tolist() == [127, 0, 2, 2, 0, -2] and dx[1, 1] == 0 and not codes[1, 32:64].any()


@native
@pytest.mark.parametrize("target", TARGETS)
def test_integer_block_sums_are_exact_where_every_scale_is_one(target):
    """Scales d = 1 and activation blocks whose max is 127 (dx = 1: codes = x) leave nothing to round: Q8_0 and
    Q4_0 (w = q - 8) give the integer matmul exactly, over odd M, N past and below the 32-column panels and
    K = 32·odd."""
    _target_or_skip(target)
    g = torch.Generator().manual_seed(2)
    for M, N, K in [(1, 1, 32), (3, 33, 96), (6, 31, 160), (9, 70, 224)]:
        x = torch.randint(-127, 128, (M, K), generator=g).float()
        x.view(M, K // 32, 32)[:, :, 0] = 127
        q8 = Int8Weight(torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8), torch.ones(N, K // 32), 32)
        codes = torch.randint(0, 16, (N, K), generator=g)
        ones = torch.ones(N, K // 32, dtype=torch.float16)
        q4 = Int4Weight(pack_int4(codes), ones, -8 * ones, 32)
        for w, exact in ((q8, q8.qweight.double()), (q4, codes.double() - 8)):
            want = (x.double() @ exact.T).float()
            assert torch.equal(native_quant.block_prefill_linear(x, w, target=target), want), (target, M, N, K)


@native
@pytest.mark.parametrize("target", TARGETS)
def test_prefill_equals_the_reference_on_block_rounded_activations(target):
    """Q8_0, Q4_0 and Q4_1 (groups of 32 and 64, fp16 and fp32 scales), M over the 4-row tiles' tails, N over the
    32-column panels' tails: within the fp32 rounding of the block terms — which the activation rounding itself
    exceeds (the tolerance could tell a kernel that skipped it)."""
    _target_or_skip(target)
    g = torch.Generator().manual_seed(3)
    for M, N, K, G in [(1, 37, 64, 32), (5, 17, 96, 32), (130, 45, 576, 32), (7, 64, 256, 64), (12, 95, 2048, 32)]:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05
        for wq in (quantize_int8(w, G), quantize_int4(w, G), quantize_int4(w, G, torch.float32), _q4_0(N, K, g)):
            got = native_quant.block_prefill_linear(x, wq, target=target)
            want, tol = _assert_within_rounding(got, x, wq)
            unrounded = x.double() @ _parts(wq)[0].T
            assert ((unrounded - want).abs() > tol).any()


@native
@pytest.mark.parametrize("target", TARGETS)
def test_q4_0_without_mins_gives_the_bits_of_m_stored_as_minus_8_d(target):
    """The panel copy takes m = −8·d for a symmetric weight: torch.equal to the same weight with m stored, over the
    4-row tiles' and the 32-column panels' tails, fp16 and fp32 scales, fp32 and bf16 x."""
    _target_or_skip(target)
    g = torch.Generator().manual_seed(6)
    for M, N, K, dtype in [(1, 37, 64, torch.float16), (7, 70, 256, torch.float32), (130, 45, 576, torch.float16)]:
        x, sym = torch.randn(M, K, generator=g), _q4_0(N, K, g, dtype)
        stored = sym.with_mins()
        assert sym.mins is None and stored.mins is not None
        for xi in (x, x.bfloat16()):
            assert torch.equal(native_quant.block_prefill_linear(xi, sym, target=target),
                               native_quant.block_prefill_linear(xi, stored, target=target))


@native
@pytest.mark.parametrize("target", TARGETS)
def test_k_record_weights_give_the_bits_of_their_expanded_fp32_form(target, k_record_weight):
    """The panel copy reads Q4_K's K records (scale_at): torch.equal to the same weight with fp32 d and m, over the
    tiles' and panels' tails, fp32 and bf16 x."""
    _target_or_skip(target)
    g = torch.Generator().manual_seed(7)
    for M, N, K in [(1, 37, 256), (7, 70, 512), (130, 45, 768)]:
        w, x = k_record_weight(N, K, seed=M), torch.randn(M, K, generator=g)
        for xi in (x, x.bfloat16()):
            assert torch.equal(native_quant.block_prefill_linear(xi, w, target=target),
                               native_quant.block_prefill_linear(xi, w.expanded(), target=target))


@native
def test_prefill_rows_do_not_depend_on_the_rows_beside_them_and_bf16_rounds_the_fp32_result():
    """Each row alone (a 1-row tile) is the bits it gets among 4-row tiles; bf16 x gives the fp32 result on
    x.float(), rounded to bf16 once."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(11, 128, generator=g), torch.randn(40, 128, generator=g)
    for wq in (quantize_int8(w, 32), quantize_int4(w, 32)):
        together = native_quant.block_prefill_linear(x, wq)
        assert torch.equal(together, torch.cat([native_quant.block_prefill_linear(x[i:i + 1], wq) for i in range(11)]))
        xb = x.bfloat16()
        got = native_quant.block_prefill_linear(xb, wq)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, native_quant.block_prefill_linear(xb.float(), wq).bfloat16())


def test_prefill_refuses_k_off_the_blocks_naming_the_shapes():
    with pytest.raises(ValueError, match=r"multiples of 32, got x torch.float32 \(2, 80\).*group_size=80"):
        native_quant.block_prefill_linear(torch.randn(2, 80), quantize_int8(torch.randn(4, 80)))
    assert not native_quant.block_prefill_supports(torch.randn(2, 80), quantize_int8(torch.randn(4, 80)))
    assert native_quant.block_prefill_supports(torch.randn(600, 64), quantize_int8(torch.randn(4, 64), 32)) \
        == native_quant.available()
    with pytest.raises(ValueError, match="multiple of 32"):
        native_quant.block_prefill_round(torch.randn(2, 80))


def test_reference_helper_is_int8_linear_ref_on_rounded_activations():
    """The fp64 reference the tests use agrees with minillm's own int8_linear_ref on xhat (fp32, summation order)."""
    g = torch.Generator().manual_seed(5)
    x, w8 = torch.randn(3, 64, generator=g), quantize_int8(torch.randn(8, 64, generator=g), 32)
    ref = int8_linear_ref(q8_activation_ref(x), w8)
    torch.testing.assert_close(ref, (q8_activation_ref(x).double() @ _parts(w8)[0].T).float())
