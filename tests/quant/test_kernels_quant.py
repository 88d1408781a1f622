import pytest
import torch

from minillm.kernels.cpu import quant as native_quant
from minillm.quant.weight import int4_linear_ref, int8_linear_ref, quantize_int4, quantize_int8

native = pytest.mark.skipif(not native_quant.available(), reason="no C compiler: the native kernels are not built")
# The kernels sum d·Σq·x + m·Σx per group (the reference sums dequantized w·x): same maths, another fp32 order.
F32_TOL = dict(rtol=1e-4, atol=1e-4)


def _cases():
    g = torch.Generator().manual_seed(0)
    for M, N, K, group in [(1, 37, 64, 32), (2, 64, 256, 64), (5, 19, 384, 128), (8, 70, 96, 32)]:
        yield M, N, K, group, torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)


@native
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_native_int4_matches_the_w4a16_reference_on_random_shapes(scale_dtype):
    for _, _, _, group, w, x in _cases():
        w4 = quantize_int4(w, group, scale_dtype)
        torch.testing.assert_close(native_quant.int4_linear(x, w4), int4_linear_ref(x, w4), **F32_TOL)


@native
def test_native_int8_matches_the_reference_per_channel_and_per_group():
    for *_, w, x in _cases():
        for w8 in (quantize_int8(w), quantize_int8(w, 32), quantize_int8(w.half().float(), 32)):
            torch.testing.assert_close(native_quant.int8_linear(x, w8), int8_linear_ref(x, w8), **F32_TOL)
    w8 = quantize_int8(torch.randn(9, 100))  # K not a multiple of 32: the generic per-group loop
    x = torch.randn(3, 100)
    torch.testing.assert_close(native_quant.int8_linear(x, w8), int8_linear_ref(x, w8), **F32_TOL)


@native
def test_native_kernels_take_bf16_activations_and_keep_leading_dims():
    w = torch.randn(48, 128)
    x = torch.randn(2, 3, 128).bfloat16()
    for kernel, ref, wq in ((native_quant.int4_linear, int4_linear_ref, quantize_int4(w)),
                            (native_quant.int8_linear, int8_linear_ref, quantize_int8(w))):
        y = kernel(x, wq)
        assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
        # the kernel keeps the weights in fp32; the bf16 reference would round them: compare with fp32 maths
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dequant_gemv_matches_the_reference(dtype):
    triton_gemv = pytest.importorskip("minillm.kernels.triton.dequant_gemv")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    for M, N, K, group in [(1, 40, 64, 32), (3, 33, 192, 64), (2, 16, 256, 128)]:
        w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
        w4, w8 = quantize_int4(w, group).to(device), quantize_int8(w).to(device)
        xd = x.to(device, dtype)
        tol = F32_TOL if dtype == torch.float32 else {}  # fp16: the default fp16 tolerance on the fp16 output
        torch.testing.assert_close(triton_gemv.int4_gemv_triton(xd, w4),
                                   int4_linear_ref(xd.float(), w4).to(dtype), **tol)
        torch.testing.assert_close(triton_gemv.int8_gemv_triton(xd, w8),
                                   int8_linear_ref(xd.float(), w8).to(dtype), **tol)
