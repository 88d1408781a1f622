import platform

import pytest
import torch

from minillm.kernels.cpu import quant as native_quant
from minillm.quant.weight import Int4Weight, Int8Weight, int4_linear_ref, int8_linear_ref, quantize_int4, quantize_int8

native = pytest.mark.skipif(not native_quant.available(), reason="no C compiler: the native kernels are not built")


def _targets() -> list[str | None]:
    """None: this CPU's build (VNNI or AVX2 intrinsics where present).  On x86 also "x86-64", the portable C path
    an AVX2-less or ARM machine compiles, "x86-64-v3" (AVX2 without VNNI) and "x86-64-v4" (512-bit AVX-512BW
    without VNNI) where this CPU can run them: every variant of csrc/quant.c is tested on one machine."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [None]
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    v4 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    return [None, "x86-64"] + (["x86-64-v3"] if "avx2" in flags else []) + (["x86-64-v4"] if v4 <= flags else [])


TARGETS = _targets()


def _assert_sum_close(actual, expected, x, w):
    """assert_close with atol = 1e-6 · max Σ_k |x_k w_nk|: another fp32 summation order moves a K-term sum by
    a few eps (6e-8) times the sum of |terms|, which the fp32 defaults (atol 1e-5) do not scale with at K = 384."""
    scale = (x.float().abs().reshape(-1, x.shape[-1]) @ w.abs().T).max().item()
    torch.testing.assert_close(actual, expected, rtol=1.3e-6, atol=1e-6 * scale)


def _cases():
    # Batch 1 with groups of 32 takes 4 weight rows at a time (N = 6, 37: a remainder), K = 32 * odd and K = 576
    # (18 blocks) end in a partial 4-block chunk, M runs over the 8-row tiles' sizes.
    g = torch.Generator().manual_seed(0)
    for M, N, K, group in [(1, 37, 64, 32), (2, 64, 256, 64), (5, 19, 384, 128), (8, 70, 96, 32), (3, 9, 160, 32),
                           (1, 6, 576, 32), (1, 12, 224, 32), (4, 5, 224, 32), (6, 3, 576, 64), (7, 2, 128, 128)]:
        yield M, N, K, group, torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)


def _target_or_skip(target):
    if not native_quant.available(target):
        pytest.skip(f"the {target} build is not available here")


@native
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_exact_int4_matches_the_w4a16_reference_on_random_shapes(scale_dtype, target):
    _target_or_skip(target)
    for _, _, _, group, w, x in _cases():
        w4 = quantize_int4(w, group, scale_dtype)
        _assert_sum_close(native_quant.int4_linear(x, w4, exact=True, target=target), int4_linear_ref(x, w4), x, w)


@native
@pytest.mark.parametrize("target", TARGETS)
def test_exact_int8_matches_the_reference_per_channel_and_per_group(target):
    _target_or_skip(target)
    for *_, w, x in _cases():
        for w8 in (quantize_int8(w), quantize_int8(w, 32), Int8Half.of(quantize_int8(w, 32))):
            _assert_sum_close(native_quant.int8_linear(x, w8, exact=True, target=target), int8_linear_ref(x, w8),
                              x, w)
    w8 = quantize_int8(torch.randn(9, 100))  # K not a multiple of 32: the generic per-group loop, either way
    x = torch.randn(3, 100)
    for exact in (True, False):
        _assert_sum_close(native_quant.int8_linear(x, w8, exact=exact, target=target), int8_linear_ref(x, w8), x,
                          w8.dequantize())


class Int8Half:
    """An Int8Weight with fp16 scales (as GGUF's Q8_0 stores them)."""

    @staticmethod
    def of(w8):
        return type(w8)(w8.qweight, w8.scales.half(), w8.group_size)


@native
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_int8_activation_kernels_equal_the_reference_on_block_rounded_activations(scale_dtype, target):
    # The integer path multiplies xhat = q8_activation_ref(x) exactly (integer block sums, fp32 scales): against the
    # reference on xhat only fp32 summation order differs (same tolerance as the exact path).
    _target_or_skip(target)
    for _, _, _, group, w, x in _cases():
        xhat = native_quant.q8_activation_ref(x)
        w4 = quantize_int4(w, group, scale_dtype)
        _assert_sum_close(native_quant.int4_linear(x, w4, target=target), int4_linear_ref(xhat, w4), x, w)
        for w8 in (quantize_int8(w), quantize_int8(w, 32), Int8Half.of(quantize_int8(w, 32))):
            _assert_sum_close(native_quant.int8_linear(x, w8, target=target), int8_linear_ref(xhat, w8), x, w)


# A block whose max / 127 differs in its last bit from max · (1/127) (what -ffast-math makes of the division), and
# one of whose quotients then rounds to the other integer: found by search over random blocks.
_RECIPROCAL_BLOCK = [4.094889163970947, -4.90490198135376, 5.320767402648926, -6.078334808349609,
                     -0.038030534982681274, -1.0210531949996948, -7.7422308921813965, -0.15778574347496033,
                     -2.301698684692383, 1.5786678791046143, -2.3547494411468506, -4.770817756652832, -2.5009925365448,
                     -0.8246437907218933, -1.5005569458007812, -3.9545722007751465, 4.148826599121094,
                     -1.1672574281692505, 5.033764839172363, -0.8410863280296326, 0.9565284848213196,
                     -0.8242532014846802, 2.7938809394836426, -3.0081329345703125, 5.185276985168457,
                     3.3644447326660156, 5.334214210510254, 2.449690818786621, 1.0976537466049194, 1.901262879371643,
                     -2.1764771938323975, 5.20334005355835]


@native
@pytest.mark.parametrize("target", TARGETS)
def test_the_kernels_round_activations_bit_for_bit_as_the_reference(target):
    """An identity weight (codes 1, scale 1) returns the rounded activations themselves, d · q: every element equal to
    q8_activation_ref's, on a block where a fast-math reciprocal would change d and one q."""
    _target_or_skip(target)
    x = torch.tensor([_RECIPROCAL_BLOCK, [v * 0.37 for v in _RECIPROCAL_BLOCK]])
    eye = Int8Weight(torch.eye(32, dtype=torch.int8), torch.ones(32, 1), 32)
    assert torch.equal(native_quant.int8_linear(x, eye, target=target), native_quant.q8_activation_ref(x))


def _q4_0(w4: Int4Weight) -> Int4Weight:
    """w4's codes and scales as a symmetric (Q4_0) weight: no mins, m = −8·d in every kernel."""
    return Int4Weight(w4.packed, w4.scales, None, w4.group_size)


@native
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_symmetric_q4_0_weights_give_the_bits_of_the_same_weight_with_m_stored(scale_dtype, target):
    """Every int4 GEMV path (exact and int8 activations; 1 to 8 rows; batch-1 4-row tiles and tails; groups of 32,
    64 and 128) takes m = −8·d for a weight without mins: torch.equal to the stored m = −8·d.  A kernel that read
    the NULL mins would crash, one that took m = 0 would be off by 8·d·Σx."""
    _target_or_skip(target)
    for M, _, _, group, w, x in _cases():
        sym = _q4_0(quantize_int4(w, group, scale_dtype))
        stored = sym.with_mins()
        assert stored.mins is not None and not torch.equal(stored.mins, torch.zeros_like(stored.mins))
        for rows in {M, 1, 3, 8}:
            xr = x[:1].expand(rows, -1).contiguous() if rows > M else x[:rows]
            xr = xr + 0.01 * torch.arange(rows)[:, None]  # distinct rows
            for exact in (False, True):
                got = native_quant.int4_linear(xr, sym, exact=exact, target=target)
                assert torch.equal(got, native_quant.int4_linear(xr, stored, exact=exact, target=target))
            xb = xr.bfloat16()
            assert torch.equal(native_quant.int4_linear(xb, sym, target=target),
                               native_quant.int4_linear(xb, stored, target=target))
        _assert_sum_close(native_quant.int4_linear(x, sym, exact=True, target=target), int4_linear_ref(x, stored),
                          x, w)


@native
@pytest.mark.parametrize("target", TARGETS)
def test_k_record_weights_give_the_bits_of_the_same_weight_with_expanded_fp32_scales(target, k_record_weight):
    """Q4_K's two-level scales (K records: an fp16 super-value and 8 uint8 sub-values per row and 256 weights) read
    by every int4 GEMV path — exact and int8 activations, 1 to 8 rows, batch-1 4-row tiles and their tails, K/32 a
    multiple of 16 or not, fp32 and bf16 x — torch.equal to the expanded fp32 form (d·sc, −dmin·mn per group), which
    the kernels read as fp32 scales.  A kernel that read the records as fp16 or fp32 scales gives other numbers."""
    _target_or_skip(target)
    g = torch.Generator().manual_seed(9)
    for N, K, seed in [(37, 256, 0), (6, 768, 1), (13, 2304, 2)]:
        w = k_record_weight(N, K, seed)
        wide = w.expanded()
        assert wide.scales.dtype == torch.float32 and wide.nbytes > w.nbytes
        for rows in (1, 3, 8):
            x = torch.randn(rows, K, generator=g)
            for exact in (False, True):
                got = native_quant.int4_linear(x, w, exact=exact, target=target)
                assert torch.equal(got, native_quant.int4_linear(x, wide, exact=exact, target=target))
            assert torch.equal(native_quant.int4_linear(x.bfloat16(), w, target=target),
                               native_quant.int4_linear(x.bfloat16(), wide, target=target))
        _assert_sum_close(native_quant.int4_linear(x, w, exact=True, target=target), int4_linear_ref(x, w), x,
                          w.dequantize())


@native
@pytest.mark.parametrize("target", TARGETS)
def test_int8_weights_at_the_code_extremes_give_exact_integer_sums(target):
    # Every code from -128 to 127 against activations at +-127 steps: the VNNI kernels feed w + 128 (0..255) and
    # start each lane at -128 * sum(x), the others move w's sign onto x; either way the block sums are exact
    # integers, so with unit scales the result is the reference on xhat to the last bit of fp32 summation.
    _target_or_skip(target)
    g = torch.Generator().manual_seed(3)
    codes = torch.arange(-128, 128, dtype=torch.int8).repeat(2)[torch.randperm(512, generator=g)].view(4, 128)
    for group in (128, 32):
        w8 = Int8Weight(codes.contiguous(), torch.ones(4, 128 // group), group)
        x = torch.where(torch.rand(3, 128, generator=g) < 0.5, -1.0, 1.0) * 127  # every block's max: steps of 1
        want = codes.float() @ x.T  # exact in fp32: |sums| < 2^24
        assert torch.equal(native_quant.int8_linear(x, w8, target=target), want.T)


@native
def test_int8_activation_error_stays_within_half_a_step_per_activation():
    # |y - y_ref| <= 0.5 * sum_k dx_k |w_nk|: each activation moves by at most half its block's step dx (+ fp32 slack)
    for M, N, K, group, w, x in _cases():
        dx = (x.abs().view(M, K // 32, 32).amax(-1) / 127).repeat_interleave(32, dim=1)  # [M, K]
        for wq, kernel, ref in ((quantize_int4(w, group), native_quant.int4_linear, int4_linear_ref),
                                (quantize_int8(w), native_quant.int8_linear, int8_linear_ref)):
            bound = 0.5 * dx @ wq.dequantize().abs().T + 1e-4  # [M, N]
            err = (kernel(x, wq) - ref(x, wq)).abs()
            assert (err <= bound).all(), f"max excess {(err - bound).max():.3g} at M={M} N={N} K={K} g={group}"
            assert err.max() > 0  # it really is the rounded path (a test that can fail)


def test_q8_activation_ref_rounds_each_block_to_127_steps_of_its_max():
    x = torch.randn(3, 64)
    xhat = native_quant.q8_activation_ref(x)
    step = x.abs().view(3, 2, 32).amax(-1, keepdim=True) / 127
    assert ((xhat.view(3, 2, 32) / step).round() - xhat.view(3, 2, 32) / step).abs().max() < 1e-3
    assert ((xhat - x).view(3, 2, 32).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(native_quant.q8_activation_ref(torch.zeros(1, 32)), torch.zeros(1, 32))


@native
@pytest.mark.parametrize("exact", [True, False])
def test_native_kernels_take_bf16_activations_and_keep_leading_dims(exact):
    w = torch.randn(48, 128)
    x = torch.randn(2, 3, 128).bfloat16()
    for kernel, ref, wq in ((native_quant.int4_linear, int4_linear_ref, quantize_int4(w)),
                            (native_quant.int8_linear, int8_linear_ref, quantize_int8(w))):
        y = kernel(x, wq, exact=exact)
        assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
        # bf16 -> fp32 is exact, so the bf16 call is the fp32 call on the same values, rounded once at the end
        assert torch.equal(y, kernel(x.float(), wq, exact=exact).bfloat16())
        if exact:  # the kernel keeps the weights in fp32; the bf16 reference would round them: fp32 maths
            torch.testing.assert_close(y, ref(x.float(), wq).bfloat16())


@native
def test_native_kernels_reject_too_many_rows_and_wrong_k():
    w4 = quantize_int4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="at most"):
        native_quant.int4_linear(torch.randn(native_quant.MAX_ROWS + 1, 64), w4)
    with pytest.raises(ValueError, match="K=64"):
        native_quant.int4_linear(torch.randn(1, 32), w4)


def test_k_not_a_multiple_of_the_group_is_refused_before_any_kernel():
    with pytest.raises(ValueError, match="does not divide K=80"):
        quantize_int4(torch.randn(4, 80), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        native_quant.q8_activation_ref(torch.randn(2, 80))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dequant_gemv_matches_the_reference(dtype):
    triton_gemv = pytest.importorskip("minillm.kernels.triton.dequant_gemv")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    for M, N, K, group in [(1, 40, 64, 32), (3, 33, 192, 64), (2, 16, 256, 128)]:
        w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
        w4, w8 = quantize_int4(w, group).to(device), quantize_int8(w).to(device)
        xd = x.to(device, dtype)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}  # fp32: another summation order
        torch.testing.assert_close(triton_gemv.int4_gemv_triton(xd, w4),
                                   int4_linear_ref(xd.float(), w4).to(dtype), **tol)
        torch.testing.assert_close(triton_gemv.int8_gemv_triton(xd, w8),
                                   int8_linear_ref(xd.float(), w8).to(dtype), **tol)
        sym = _q4_0(w4)  # Q4_0: the program reads m = −8·d materialised for the call, the stored form's bits
        assert torch.equal(triton_gemv.int4_gemv_triton(xd, sym), triton_gemv.int4_gemv_triton(xd, sym.with_mins()))



def test_triton_dequant_gemv_reads_k_records_as_their_expanded_form(k_record_weight):
    """K records moved to a GPU are expanded (``Int4Weight.to``); on CPU tensors (the interpreter) the GEMV expands
    them for the call: the expanded weight's result either way."""
    triton_gemv = pytest.importorskip("minillm.kernels.triton.dequant_gemv")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = k_record_weight(24, 512, seed=3)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4), device="cpu").to(device)
    wd = w.to(device)
    assert wd.k_records == (device == "cpu")
    want = triton_gemv.int4_gemv_triton(x, w.expanded().to(device))
    assert torch.equal(triton_gemv.int4_gemv_triton(x, wd), want)
    torch.testing.assert_close(want, int4_linear_ref(x, wd), rtol=1e-4, atol=1e-4)  # fp32: another summation order


# ---------------------------------------------------------------- W8A8: the native int8 × int8 GEMM (w8a8_gemm)
def _w8a8_cases():
    # M over decode rows, a draft chunk's odd count and prefill (512: several 4-row tiles and weight blocks); K a
    # multiple of 32 (576 and 1536 end in a partial 64-byte chunk) and two that are not; N odd (4-row tile tails).
    # From 5 rows on VNNI the 16-row panels: a batch of 32 with N = 50 (a 2-panel tile, then a ragged one), 8 rows
    # with K = 31 (not whole 4-byte groups) and N < 16, 9 rows (a 1-row tile after an 8-row one); 4 rows: the last
    # few-row case.
    g = torch.Generator().manual_seed(1)
    for M, N, K in [(1, 37, 64), (3, 17, 96), (17, 101, 576), (64, 33, 1536), (512, 129, 224), (5, 7, 31),
                    (2, 3, 100), (32, 50, 100), (8, 7, 31), (9, 16, 1536), (4, 21, 96)]:
        x = torch.randn(M, K, generator=g)
        x[:, 1] *= 30  # an outlier channel: most codes of a row small
        yield M, N, K, x, torch.randn(N, K, generator=g), torch.randn(N, generator=g)


@native
@pytest.mark.parametrize("target", TARGETS)
def test_native_w8a8_gives_the_int_mm_bits_and_the_reference_within_rounding(target):
    """Exact int32 sums and the same epilogue as ``w8a8_linear_int_mm``: the same bits on every code path (VNNI,
    512-bit without VNNI, AVX2, plain C), dynamic and static scales, fp32 and fp16 weight scales, with a bias."""
    from minillm.quant.activation import w8a8_linear_int_mm, w8a8_linear_ref

    _target_or_skip(target)
    for M, N, K, x, w, b in _w8a8_cases():
        w8 = quantize_int8(w)
        for wq in (w8, Int8Weight(w8.qweight, w8.scales.half(), K)):
            for scale in (None, torch.tensor(0.04)):  # static: the outlier channel saturates at ±127
                got = native_quant.w8a8_linear(x, wq, scale, b, target=target)
                assert torch.equal(got, w8a8_linear_int_mm(x, wq, scale, b)), (target, M, N, K, scale)
                torch.testing.assert_close(got, w8a8_linear_ref(x, wq, scale, b), rtol=1e-5, atol=1e-4)


@native
@pytest.mark.parametrize("target", TARGETS)
def test_native_w8a8_rounds_activations_as_the_reference(target):
    """Per token: scale max|x| / 127 (a zero row: the tiny clamp, codes 0), codes round(x / scale) half to even —
    quotients exactly k + 1/2 included, which a reciprocal product instead of the division would round the other way
    — and the static scale's codes saturating at ±127."""
    from minillm.quant.activation import quantize_activation_int8

    _target_or_skip(target)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 160, generator=g)
    x[0, 0] = 127.0  # row 0: scale exactly 1, then exact ties
    x[0, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 126.5, -126.5])
    x[1] = 0.0
    x[2] *= 1e-3
    for scale in (None, torch.tensor(0.01)):
        codes, scales = native_quant.w8a8_quantize(x, scale, target=target)
        want_codes, want_scales = quantize_activation_int8(x, scale)
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert native_quant.w8a8_quantize(x, None, target=target)[0][0, 1:9].tolist() == [0, 2, 2, 0, -2, 4, 126, -126]


@native
def test_native_w8a8_rows_do_not_depend_on_the_rows_beside_them():
    w8 = quantize_int8(torch.randn(21, 96))
    x = torch.randn(9, 96)
    together = native_quant.w8a8_linear(x, w8)
    assert torch.equal(together, torch.cat([native_quant.w8a8_linear(x[i:i + 1], w8) for i in range(9)]))


def test_native_w8a8_refuses_a_grouped_weight_and_bf16_activations():
    w8 = quantize_int8(torch.randn(8, 64), 32)
    assert not native_quant.w8a8_supports(torch.randn(2, 64), w8)
    assert not native_quant.w8a8_supports(torch.randn(2, 64, dtype=torch.bfloat16), quantize_int8(torch.randn(8, 64)))
    with pytest.raises(ValueError, match="per-channel Int8Weight"):
        native_quant.w8a8_linear(torch.randn(2, 64), w8)
