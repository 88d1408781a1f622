import pytest
import torch

from minillm.quant.formats import (
    FORMAT_NAMES,
    QuantSpec,
    cast_roundtrip,
    dequantize,
    error_stats,
    fake_quantize,
    format_info,
    quantize,
)


def test_format_table_matches_torch_finfo_and_int4_by_hand():
    assert format_info("fp16").max == 65504.0 and format_info("bf16").bytes == 2
    assert format_info("fp8_e4m3").max == 448.0 and format_info("fp8_e5m2").max == 57344.0
    assert (format_info("int8").min, format_info("int8").max) == (-128, 127)
    assert (format_info("int4").min, format_info("int4").max, format_info("int4").bytes) == (-8, 7, 0.5)
    assert all(format_info(n).bits in (4, 8, 16, 32) for n in FORMAT_NAMES)
    with pytest.raises(ValueError, match="unknown format"):
        format_info("int3")


@pytest.mark.parametrize("spec", [QuantSpec(8, True, "tensor"), QuantSpec(8, True, "channel"),
                                  QuantSpec(8, False, "channel"), QuantSpec(4, False, "group", 16),
                                  QuantSpec(4, True, "group", 32)])
def test_round_trip_error_is_at_most_half_a_step(spec):
    x = torch.randn(6, 64) * torch.linspace(0.1, 10, 64)
    qt = quantize(x, spec)
    assert int(qt.q.min()) >= spec.qmin and int(qt.q.max()) <= spec.qmax
    step = qt.scale.repeat_interleave(spec.group_size, -1) if spec.granularity.value == "group" else qt.scale
    assert ((dequantize(qt) - x).abs() <= step / 2 + 1e-6).all()


def test_asymmetric_int8_uses_the_full_signed_range_with_a_zero_point():
    x = torch.rand(4, 100) * 6 - 1  # mostly positive: a symmetric grid would waste most of its negative half
    x[:, 0], x[:, 1] = -1.0, 5.0
    qt = quantize(x, QuantSpec(8, symmetric=False))
    # the zero point is rounded to an integer, so the top code may land one short of 127
    assert int(qt.q.min()) == -128 and int(qt.q.max()) >= 126 and (qt.zero_point != 0).all()
    assert error_stats(x, dequantize(qt)).sqnr_db > error_stats(x, fake_quantize(x, QuantSpec(8, True))).sqnr_db


def test_zero_is_exact_in_asymmetric_quantization():
    x = torch.tensor([[0.0, 0.3, 1.7, 2.9]])
    assert dequantize(quantize(x, QuantSpec(8, False)))[0, 0] == 0


def test_per_tensor_scales_fail_on_outliers_where_per_channel_scales_do_not():
    x = torch.randn(8, 64)
    x[0, 0] = 1000.0
    per_tensor = error_stats(x[1:], fake_quantize(x, QuantSpec(8, True, "tensor"))[1:])
    per_channel = error_stats(x[1:], fake_quantize(x, QuantSpec(8, True, "channel"))[1:])
    assert per_channel.sqnr_db > per_tensor.sqnr_db + 20


def test_clipping_saturates_outliers_and_refines_the_rest():
    x = torch.randn(1, 1000)
    x[0, 0] = 50.0
    clipped = fake_quantize(x, QuantSpec(4, True, "tensor", clip_ratio=0.1))
    plain = fake_quantize(x, QuantSpec(4, True, "tensor"))
    assert clipped[0, 0] < 6
    assert error_stats(x[:, 1:], clipped[:, 1:]).rmse < error_stats(x[:, 1:], plain[:, 1:]).rmse


def test_more_bits_give_more_sqnr_about_six_db_per_bit():
    x = torch.randn(64, 128)
    s8 = error_stats(x, fake_quantize(x, QuantSpec(8, False, "group", 32))).sqnr_db
    s4 = error_stats(x, fake_quantize(x, QuantSpec(4, False, "group", 32))).sqnr_db
    assert 20 < s8 - s4 < 28


def test_error_stats_are_exact_on_a_known_example():
    e = error_stats(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0]))
    assert e.max_abs == 1 and e.rmse == pytest.approx(0.5 ** 0.5)
    assert e.sqnr_db == pytest.approx(10 * torch.log10(torch.tensor(25.0)).item())
    assert error_stats(torch.ones(3), torch.ones(3)).sqnr_db == float("inf")


def test_fp8_cast_saturates_instead_of_overflowing():
    y = cast_roundtrip(torch.tensor([1000.0, 1.0]), "fp8_e4m3")
    assert y.tolist() == [448.0, 1.0]


def test_group_size_not_dividing_k_names_the_fix():
    with pytest.raises(ValueError, match="pad K .* or choose a group size"):
        quantize(torch.randn(2, 100), QuantSpec(4, False, "group", 32))
    with pytest.raises(ValueError, match="clip_ratio"):
        QuantSpec(clip_ratio=0)
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=3)
