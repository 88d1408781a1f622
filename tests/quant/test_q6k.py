"""GGUF Q6_K super-blocks kept as they are (``Q6KWeight``): dequantized bit for bit as gguf's own numpy code does,
expanded to an ``Int8Weight`` of group 16 with the same bits, 210 bytes per 256 weights, and the native GEMV with
int8 activations against the reference on the rounded activations, on every build of ``csrc/quant.c``."""

import numpy as np
import pytest
import torch

# Every build of csrc/quant.c this CPU runs (VNNI / AVX2 / AVX-512BW / portable C), and the tolerance for another
# fp32 summation order, as the other native quantized kernels are tested (pytest puts this directory on sys.path).
from test_kernels_quant import TARGETS, _assert_sum_close, _target_or_skip

from minillm.kernels.cpu import quant as native_quant
from minillm.quant.gguf import q6_k_blocks
from minillm.quant.weight import Int8Weight, Q6KWeight, int8_linear_ref, q6k_linear_ref, quantize_int8

gguf = pytest.importorskip("gguf")
native = pytest.mark.skipif(not native_quant.available(), reason="no C compiler: the native kernels are not built")

# fp16 d values the random blocks must cover besides random finite ones: the largest finite, the smallest subnormal,
# a mid subnormal, zero, negative zero, one.
EDGE_D = [65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -20), 0.0, -0.0, 1.0]


def random_q6_k(N: int, K: int, seed: int = 0) -> np.ndarray:
    """Raw Q6_K bytes uint8 [N, K/256 · 210]: random ql, qh and int8 sub-scale bytes (every bit pattern), d a random
    finite fp16 (exponent field < 31: no inf/nan), the first blocks' d taken from ``EDGE_D``."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(N * K // 256, 210), dtype=np.uint8)
    d_bits = rng.integers(0, 1 << 16, size=len(b), dtype=np.uint16)
    d_bits = np.where((d_bits & 0x7C00) == 0x7C00, d_bits ^ 0x4000, d_bits)  # inf/nan exponent -> a finite one
    d = d_bits.view(np.float16)
    d[: len(EDGE_D)] = np.array(EDGE_D[: len(d)], np.float16)
    b[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(N, K // 256 * 210)


def gguf_dequantize(raw: np.ndarray, N: int, K: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))).reshape(N, K)


@pytest.mark.parametrize("N,K", [(3, 256), (5, 1024), (1, 2048)])
def test_q6_k_blocks_dequantize_bit_for_bit_like_gguf_and_so_does_their_expanded_int8_form(N, K):
    raw = random_q6_k(N, K, seed=N)
    w = q6_k_blocks(raw, N, K)
    want = gguf_dequantize(raw, N, K)
    assert w.shape == (N, K) and torch.isfinite(want).all()
    assert torch.equal(w.dequantize(), want)
    wide = w.expanded()
    assert isinstance(wide, Int8Weight) and wide.group_size == 16 and wide.scales.shape == (N, K // 16)
    assert int(wide.qweight.min()) >= -32 and int(wide.qweight.max()) <= 31
    assert torch.equal(wide.dequantize(), want)
    assert torch.equal(w.dequantize(torch.bfloat16), want.bfloat16())


def test_q6_k_reads_each_weights_bits_from_ggufs_bytes():
    """One weight at a time set to q = 31 (all 6 bits) in a block of q = −32: exactly that weight moves — weight i of
    half h from ql byte 64h + i % 64 (low nibble below 64) and qh byte 32h + i % 32, bits 2·(i // 32)."""
    for h in (0, 1):
        for i in (0, 5, 31, 32, 63, 64, 90, 127):
            raw = np.zeros((1, 210), np.uint8)
            raw[0, 192:208] = 1  # every sub-scale 1
            raw[0, 208:210] = np.array([1.0], np.float16).view(np.uint8)
            raw[0, 64 * h + i % 64] |= 0x0F if i < 64 else 0xF0
            raw[0, 128 + 32 * h + i % 32] |= 0x03 << (2 * (i // 32))
            want = torch.full((256,), -32.0)
            want[128 * h + i] = 31.0
            assert torch.equal(q6_k_blocks(raw, 1, 256).dequantize()[0], want), (h, i)
            assert torch.equal(gguf_dequantize(raw, 1, 256)[0], want), (h, i)  # the layout is gguf's


def test_q6_k_sub_scales_are_signed_and_multiply_their_16_weights():
    raw = np.zeros((1, 210), np.uint8)
    raw[0, :128] = 0x11  # low bits 1 everywhere, high bits 0: q = 1 − 32 = −31
    raw[0, 192:208] = np.arange(-8, 8, dtype=np.int8).view(np.uint8)
    raw[0, 208:210] = np.array([0.5], np.float16).view(np.uint8)
    w = q6_k_blocks(raw, 1, 256)
    assert torch.equal(w.dequantize()[0], (torch.arange(-8, 8).float() * 0.5 * -31).repeat_interleave(16))


def test_q6_k_weight_stores_the_files_210_bytes_per_256_weights():
    w = q6_k_blocks(random_q6_k(4, 512), 4, 512)
    assert w.nbytes == 4 * 2 * 210 and w.blocks.shape == (4, 2, 210)
    assert w.nbytes * 8 / (4 * 512) == 6.5625


def test_q6_k_builder_and_weight_refuse_shapes_that_do_not_fit_naming_them():
    with pytest.raises(ValueError, match="multiple of 256.*K=128"):
        q6_k_blocks(np.zeros((2, 105), np.uint8), 2, 128)
    with pytest.raises(ValueError, match="Q6_K has 210 bytes"):
        q6_k_blocks(np.zeros((2, 200), np.uint8), 2, 256)
    with pytest.raises(ValueError, match=r"uint8 \[N, K/256, 210\].*\(2, 1, 200\)"):
        Q6KWeight(torch.zeros(2, 1, 200, dtype=torch.uint8))
    with pytest.raises(ValueError, match="got torch.int8"):
        Q6KWeight(torch.zeros(2, 1, 210, dtype=torch.int8))


def test_q6_k_builder_takes_a_read_only_memory_map_and_copies_it(tmp_path):
    raw = random_q6_k(2, 256)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, np.uint8, "r", shape=raw.shape)
    w = q6_k_blocks(mapped, 2, 256)
    assert torch.equal(w.dequantize(), gguf_dequantize(raw, 2, 256))
    w.blocks.zero_()  # writable: its own copy, the file untouched
    assert np.array_equal(np.fromfile(path, np.uint8).reshape(raw.shape), raw)


def test_q6_k_reference_is_the_dequantized_matmul_and_moves_off_the_cpu_expanded():
    raw = random_q6_k(6, 512, seed=3)
    w = q6_k_blocks(raw, 6, 512)
    x = torch.randn(3, 512, dtype=torch.float64).float()
    bias = torch.randn(6)
    torch.testing.assert_close(q6k_linear_ref(x, w, bias), x @ gguf_dequantize(raw, 6, 512).T + bias)
    with pytest.raises(ValueError, match="K=512"):
        q6k_linear_ref(torch.randn(1, 256), w)
    assert w.to("cpu") is w
    moved = w.to("meta")
    assert isinstance(moved, Int8Weight) and moved.group_size == 16 and moved.qweight.device.type == "meta"


def test_int8_weights_of_group_16_run_the_int8_reference():
    w8 = q6_k_blocks(random_q6_k(2, 256, seed=4), 2, 256).expanded()
    x = torch.randn(1, 256)
    want = x @ (w8.qweight.float().view(2, 16, 16) * w8.scales.unsqueeze(-1)).view(2, 256).T
    torch.testing.assert_close(int8_linear_ref(x, w8), want)


# ------------------------------------------------------------------ the native GEMV (csrc/quant.c q6k_gemm_q8)


def q6_k_weight(N: int, K: int, seed: int) -> Q6KWeight:
    """Random Q6_K blocks whose d are random fp16 in ±[0.5, 1) · 2⁻⁸, the magnitudes of a real model's: every row's
    sum then matters to the tolerance (``random_q6_k``'s d span fp16's whole range, up to 65504)."""
    raw = random_q6_k(N, K, seed)
    rng = np.random.default_rng(seed)
    d = ((rng.random(N * K // 256) * 0.5 + 0.5) * rng.choice([-1, 1], N * K // 256) / 256).astype(np.float16)
    raw.reshape(-1, 210)[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return q6_k_blocks(raw, N, K)


@native
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("M,N,K", [(1, 37, 256), (1, 6, 2048), (3, 70, 512), (8, 5, 1024), (2, 9, 256), (5, 4, 768),
                                   (1, 259, 1024)])
def test_q6k_gemv_equals_the_reference_on_block_rounded_activations(M, N, K, target):
    """N not a multiple of the 4-row split, M over the 8-row tile's sizes, N · K ≥ 2¹⁸ (rows split over the OpenMP
    team where it has more than one thread): the integer path multiplies
    xhat = q8_activation_ref(x) exactly, so against the reference on xhat only fp32 summation order differs."""
    _target_or_skip(target)
    w = q6_k_weight(N, K, seed=M * N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    got = native_quant.q6k_linear(x, w, target=target)
    _assert_sum_close(got, q6k_linear_ref(native_quant.q8_activation_ref(x), w), x, w.dequantize())


@native
@pytest.mark.parametrize("target", TARGETS)
def test_q6k_gemv_is_exact_per_row_for_extreme_and_subnormal_scales(target):
    """``random_q6_k``'s d: fp16's largest (±65504), subnormals, zeros and random finite ones — each row against the
    reference within its own summation tolerance."""
    _target_or_skip(target)
    N, K = 12, 512
    raw = random_q6_k(N, K, seed=7)
    w = q6_k_blocks(raw, N, K)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1))
    got = native_quant.q6k_linear(x, w, target=target)
    want = q6k_linear_ref(native_quant.q8_activation_ref(x), w)
    deq = w.dequantize()
    for n in range(N):
        _assert_sum_close(got[:, n:n + 1], want[:, n:n + 1], x, deq[n:n + 1])


@native
@pytest.mark.parametrize("target", TARGETS)
def test_q6k_gemv_rows_do_not_depend_on_the_rows_beside_them(target):
    """A row's result is the same bits alone and in a batch of up to 8 (speculative verification runs γ + 1 rows
    where plain decode runs one, and greedy output must be identical)."""
    _target_or_skip(target)
    w = q6_k_weight(9, 1024, seed=2)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(3))
    batch = native_quant.q6k_linear(x, w, target=target)
    for m in range(8):
        assert torch.equal(native_quant.q6k_linear(x[m:m + 1], w, target=target), batch[m:m + 1]), m


@native
def test_q6k_gemv_takes_bf16_activations_and_keeps_leading_dims():
    w = q6_k_weight(7, 512, seed=4)
    x = torch.randn(2, 3, 512).bfloat16()
    got = native_quant.q6k_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 7)
    assert torch.equal(got, native_quant.q6k_linear(x.float(), w).bfloat16())  # same codes, one rounding at the end


@native
def test_q6k_gemv_refuses_a_wrong_k_and_a_wrong_dtype_naming_them():
    w = q6_k_weight(3, 256, seed=5)
    with pytest.raises(ValueError, match="K=256"):
        native_quant.q6k_linear(torch.randn(1, 512), w)
    with pytest.raises(ValueError, match=r"fp32/bf16 x and .*torch.float64 \(9, 256\)"):
        native_quant.q6k_linear(torch.randn(9, 256, dtype=torch.float64), w)


# Past 8 rows (prefill) csrc/quant.c runs the AVX-512 VNNI builds' register tiles (pf_tile_q6: panels of 32 weight
# rows, 4 input rows a tile; N off both) and elsewhere q6k_q8_rows, which takes the weight rows in blocks of
# L2_BLOCK / Q6U_BYTES(K) rows (K = 256: 614, K = 2048: 76), unpacked once per call.  N · K < 2¹⁸ keeps every row
# in one thread's range whatever the OpenMP team, so these N span 2 blocks (K = 256: 614 + 87, K = 2048: 76 + 25): a
# block that starts, ends or is unpacked at the wrong row moves rows of the second block.
PREFILL_N = {256: 701, 2048: 101}


@native
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("K", [256, 2048])
@pytest.mark.parametrize("M", [9, 33, 300])
def test_q6k_gemm_past_one_tile_equals_the_reference_and_each_rows_own_result(M, K, target):
    """Many rows (M not a multiple of the 8-row tile, N across weight-row blocks and off the 4-row split): against the
    reference on the rounded activations; where no register tiles are built, each row the same bits as that row
    alone (the decode kernel's); bf16 x the same codes, so its result is the fp32 result of x.float() rounded once."""
    _target_or_skip(target)
    N = PREFILL_N[K]
    w = q6_k_weight(N, K, seed=M + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    got = native_quant.q6k_linear(x, w, target=target)
    _assert_sum_close(got, q6k_linear_ref(native_quant.q8_activation_ref(x), w), x, w.dequantize())
    for m in sorted({0, 7, 8, M // 2, M - 1}):
        alone = native_quant.q6k_linear(x[m:m + 1], w, target=target)
        if native_quant.prefill_tiled(target):  # another summation order than the decode kernel's
            _assert_sum_close(alone, got[m:m + 1], x[m:m + 1], w.dequantize())
        else:
            assert torch.equal(alone, got[m:m + 1]), m
    xb = x.bfloat16()
    got_b = native_quant.q6k_linear(xb, w, target=target)
    assert got_b.dtype == torch.bfloat16
    assert torch.equal(got_b, native_quant.q6k_linear(xb.float(), w, target=target).bfloat16())


@native
def test_q6k_gemm_past_one_tile_splits_rows_over_the_threads_like_one_thread():
    """N · K ≥ 2¹⁸: the rows (panels) split over the OpenMP team (where it has more than one thread) in ranges that
    end mid-block; every row the reference's value, and the same bits as in a call of the same path alone."""
    N, K, M = 1301, 256, 20
    w = q6_k_weight(N, K, seed=11)
    x = torch.randn(2, M // 2, K, generator=torch.Generator().manual_seed(12))
    got = native_quant.q6k_linear(x, w)
    assert got.shape == (2, M // 2, N)
    want = q6k_linear_ref(native_quant.q8_activation_ref(x.view(M, K)), w)
    _assert_sum_close(got.view(M, N), want, x, w.dequantize())
    nine = slice(5, 14)  # 9 rows: the same path, its tiles of input rows starting elsewhere
    assert torch.equal(native_quant.q6k_linear(x.view(M, K)[nine], w), got.view(M, N)[nine])


@native
def test_native_supports_names_q6_k_weights_on_the_cpu_and_refuses_them_elsewhere():
    w = q6_k_weight(4, 256, seed=6)
    assert native_quant.supports(torch.randn(1, 256), w)
    assert native_quant.supports(torch.randn(300, 256), w)  # Q6_K takes any rows (past MAX_ROWS: blocked)
    assert not native_quant.supports(torch.randn(9, 256), quantize_int8(torch.randn(4, 256)))  # others: MAX_ROWS
    assert not native_quant.supports(torch.randn(1, 256), Q6KWeight(w.blocks.to("meta")))
