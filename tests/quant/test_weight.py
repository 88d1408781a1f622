import pytest
import torch

from minillm.quant.weight import (
    Int4Weight,
    Int8Weight,
    int4_linear_ref,
    int8_linear_ref,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def test_int4_packing_puts_weight_j_low_and_weight_j_plus_16_high_per_block():
    q = torch.arange(64).remainder(16).view(1, 64).to(torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (1, 32)
    assert int(packed[0, 0]) == q[0, 0] | (q[0, 16] << 4)
    assert int(packed[0, 16]) == q[0, 32] | (q[0, 48] << 4)
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step_of_each_group(group):
    w = torch.randn(12, 256)
    w4 = quantize_int4(w, group)
    step = w4.scales.float().repeat_interleave(group, 1)
    # half a step, plus fp16 rounding of the stored minimum
    assert ((w4.dequantize() - w).abs() <= step / 2 + w.abs().max() * 2 ** -10).all()
    assert w4.nbytes == 12 * 128 + 2 * 2 * 12 * (256 // group)


def test_int4_holds_a_dequantized_q4_1_weight_exactly():
    w4 = quantize_int4(torch.randn(8, 64))
    again = quantize_int4(w4.dequantize())
    assert torch.equal(again.dequantize(), w4.dequantize())


def test_int8_per_channel_scales_make_each_row_hit_127():
    w = torch.randn(5, 40) * torch.arange(1, 6)[:, None]
    w8 = quantize_int8(w)
    assert w8.scales.shape == (5, 1) and (w8.qweight.abs().amax(1) == 127).all()
    assert ((w8.dequantize() - w).abs() <= w8.scales / 2 + 1e-6).all()
    assert w8.nbytes == 5 * 40 + 5 * 4


def test_reference_linears_are_f_linear_on_the_dequantized_weight():
    x, w = torch.randn(3, 64), torch.randn(16, 64)
    w4, w8 = quantize_int4(w), quantize_int8(w, group_size=32)
    torch.testing.assert_close(int4_linear_ref(x, w4), x @ w4.dequantize().T)
    torch.testing.assert_close(int8_linear_ref(x, w8), x @ w8.dequantize().T)


def test_packed_formats_reject_bad_shapes_with_the_fix():
    with pytest.raises(ValueError, match="pad K"):
        quantize_int4(torch.randn(4, 96), group_size=64)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 96), group_size=48)
    with pytest.raises(ValueError, match="pad K"):
        quantize_int8(torch.randn(4, 100), group_size=32)
    with pytest.raises(ValueError, match="scales"):
        Int4Weight(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="int8"):
        Int8Weight(torch.zeros(4, 16), torch.zeros(4, 1), 16)
    with pytest.raises(ValueError, match="K=64"):
        int4_linear_ref(torch.randn(2, 32), quantize_int4(torch.randn(4, 64)))


# ------------------------------------------------------------------------------ symmetric (Q4_0) Int4Weight
def _symmetric(N: int, K: int, group: int = 32, scale_dtype=torch.float16, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.randn(N, K // group, generator=g) * 0.05).to(scale_dtype)
    return Int4Weight(pack_int4(torch.randint(0, 16, (N, K), generator=g)), d, None, group)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("group", [32, 128])
def test_a_symmetric_int4_weight_is_w_equals_d_times_q_minus_8_and_stores_no_mins(group, scale_dtype):
    w4 = _symmetric(6, 256, group, scale_dtype)
    stored = w4.with_mins()
    assert w4.mins is None and torch.equal(stored.mins, (-8 * w4.scales.float()).to(scale_dtype))
    assert stored.scales is w4.scales and stored.packed is w4.packed and stored.with_mins() is stored
    d = w4.scales.float().repeat_interleave(group, 1)
    if scale_dtype == torch.float16:  # fp16 d: d·q and d·q − 8·d are exact in fp32, so this is d·(q − 8) exactly
        assert torch.equal(w4.dequantize(), d * (w4.codes().float() - 8))
    else:  # fp32 d: d·q rounds once
        torch.testing.assert_close(w4.dequantize(), d * (w4.codes().float() - 8))
    assert torch.equal(w4.dequantize(), stored.dequantize())  # bit for bit the stored-mins form
    assert torch.equal(w4.dequantize(torch.bfloat16), stored.dequantize(torch.bfloat16))
    assert torch.equal(w4.mins_f32(), stored.mins_f32())
    assert w4.nbytes == 6 * 256 // 2 + w4.scales.nbytes == stored.nbytes - stored.mins.nbytes
    assert w4.to("cpu").mins is None


def test_a_symmetric_fp16_scale_past_8188_gets_fp32_mins_when_they_are_stored():
    w4 = _symmetric(2, 64)
    scales = w4.scales.clone()
    scales[1, 0] = 3e4  # −8·d = −2.4e5: beyond fp16, fine in fp32
    big = Int4Weight(w4.packed, scales, None, 32)
    stored = big.with_mins()
    assert stored.scales.dtype == stored.mins.dtype == torch.float32 and torch.isfinite(stored.mins).all()
    assert torch.equal(big.dequantize(), stored.dequantize())
    assert torch.equal(big.dequantize()[1, :32], 3e4 * (big.codes()[1, :32].float() - 8))


def test_a_symmetric_weight_is_refused_with_scales_of_the_wrong_shape():
    with pytest.raises(ValueError, match="mins may be None"):
        Int4Weight(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2), None)


def test_weights_built_from_views_store_contiguous_tensors_the_kernels_can_point_at():
    """A strided view (a column slice of a wider buffer) is copied once at construction: the native kernels take raw
    pointers, and a contiguous copy made at the call would be freed before they read it."""
    from minillm.kernels.cpu import quant as native_quant

    g = torch.Generator().manual_seed(0)
    wide = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    scales = (torch.rand(64, 4, generator=g) * 0.01 + 1e-3).half()
    w4 = Int4Weight(wide[:, :64], scales, -8 * scales, 32)  # packed [64, 64] as every other 64-byte run: strided
    codes = torch.randint(-127, 128, (128, 64), dtype=torch.int8, generator=g)
    w8 = Int8Weight(codes.t(), torch.rand(64, 4, generator=g) * 0.01, 32)  # qweight [64, 128] as a transpose
    for w in (w4, w8):
        fields = (w.packed, w.scales, w.mins) if isinstance(w, Int4Weight) else (w.qweight, w.scales)
        assert all(t.is_contiguous() for t in fields)
    x = torch.randn(3, 128, generator=g)
    if native_quant.available():
        torch.testing.assert_close(native_quant.int4_linear(x, w4, exact=True), int4_linear_ref(x, w4))
        torch.testing.assert_close(native_quant.int8_linear(x, w8, exact=True), int8_linear_ref(x, w8))
