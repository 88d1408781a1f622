"""KV-cache quantization helpers (kv/quant.py): int8 and fp8 per (token, head)."""

import pytest
import torch

from minillm.kv.quant import (
    check_kv_cache_dtype,
    dequantize_kv,
    kv_bytes_per_token,
    quantize_kv_fp8,
    quantize_kv_int8,
)


def test_int8_kv_round_trip_is_within_half_a_step_of_each_token_and_head():
    x = torch.randn(5, 7, 3, 64) * torch.tensor([0.1, 1.0, 30.0]).view(3, 1)  # heads of very different scale
    codes, scales = quantize_kv_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == (5, 7, 3, 1)
    assert ((dequantize_kv(codes, scales) - x).abs() <= scales / 2 + 1e-7).all()
    assert codes.abs().amax(-1).eq(127).all()  # each row's absmax uses the full range


def test_a_zero_row_quantizes_to_zero_without_dividing_by_zero():
    codes, scales = quantize_kv_int8(torch.zeros(2, 1, 8))
    assert torch.equal(dequantize_kv(codes, scales), torch.zeros(2, 1, 8))


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8")
def test_fp8_kv_round_trip_keeps_three_mantissa_bits_of_each_row():
    x = torch.randn(4, 3, 64) * 5
    codes, scales = quantize_kv_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn
    err = (dequantize_kv(codes, scales) - x).abs()
    # e4m3 normals round to 2^-4 relative; near zero the subnormal step (2^-9 of the scale) dominates
    assert (err <= x.abs() * 2 ** -4 + scales * 2 ** -9).all()


def test_kv_bytes_per_token_are_about_half_of_bf16_and_a_quarter_of_fp32():
    fp32 = kv_bytes_per_token(30, 3, 64, "auto", torch.float32)
    bf16 = kv_bytes_per_token(30, 3, 64, "auto", torch.bfloat16)
    int8 = kv_bytes_per_token(30, 3, 64, "int8")
    assert fp32 == 2 * 30 * 3 * 64 * 4 and int8 == 2 * 30 * 3 * (64 + 4)
    assert 0.5 < int8 / bf16 < 0.55 and 0.25 < int8 / fp32 < 0.28


def test_an_unknown_kv_cache_dtype_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8'\), got 'int4'"):
        check_kv_cache_dtype("int4")


def test_scales_that_do_not_match_the_codes_are_refused():
    codes, scales = quantize_kv_int8(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_kv(codes, scales[:1])
