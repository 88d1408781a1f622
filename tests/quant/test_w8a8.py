"""Activation quantization: W8A8 (dynamic, static), SmoothQuant, FP8 — formats, kernels, folding, the swap."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_apply import TINY, ids_and_positions, tiny_model  # tests/quant is on sys.path

from minillm.kernels.select import ops_for, resolve
from minillm.layers.linear import Fp8Linear, QuantEmbedding, QuantLinear, W8A8Linear
from minillm.quant.activation import (
    FP8_MAX,
    fp8_linear_ref,
    fp8_linear_scaled_mm,
    fp8_supported,
    quantize_activation_int8,
    quantize_fp8,
    w8a8_linear_int_mm,
    w8a8_linear_ref,
)
from minillm.quant.smooth import (
    activation_absmax,
    fold_into_norm,
    outlier_ratios,
    quantize_model_w8a8,
    smooth_model,
    smoothing_factors,
)
from minillm.quant.weight import quantize_int8


def rel_err(a, b):
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


# ----------------------------------------------------------------------------------------------- formats and refs
def test_per_token_and_static_activation_rounding():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [100.0, 1.0, -3.0]])
    q, s = quantize_activation_int8(x)
    assert q.dtype == torch.int8 and s.shape == (3, 1)
    torch.testing.assert_close(s[:, 0], torch.tensor([2 / 127, torch.finfo(torch.float32).tiny, 100 / 127]))
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0] and q[2, 0] == 127
    q, s = quantize_activation_int8(x, torch.tensor(2 / 127))  # static: 100 saturates at 127
    assert (s == 2 / 127).all() and q[2].tolist() == [127, 64, -127]


def test_w8a8_reference_is_the_dequantized_product():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    w8 = quantize_int8(w)
    xq, sx = quantize_activation_int8(x)
    want = (xq.float() * sx) @ (w8.qweight.float() * w8.scales).T + b
    torch.testing.assert_close(w8a8_linear_ref(x, w8, None, b), want)
    assert rel_err(w8a8_linear_ref(x, w8), x @ w.T) < 0.02  # int8 on both sides of a Gaussian product
    with pytest.raises(ValueError, match="one scale per output channel"):
        W8A8Linear(quantize_int8(w, 32))


@pytest.mark.parametrize("rows", [1, 3, 17, 40])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_gemm_equals_the_reference(rows, static, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=g).to(dtype)
    w8 = quantize_int8(torch.randn(40, 96, generator=g))
    b = torch.randn(40, generator=g).to(dtype)
    scale = x.float().abs().amax() / 127 * 0.7 if static else None  # some values saturate
    got, want = w8a8_linear_int_mm(x, w8, scale, b), w8a8_linear_ref(x, w8, scale, b)
    assert got.shape == (2, rows, 40) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_select_routes_w8a8_to_the_int8_gemm_on_cpu_and_the_reference_under_torch():
    assert resolve("torch", "w8a8_linear", "cpu", torch.float32).fn is w8a8_linear_ref
    assert resolve("torch", "fp8_linear", "cpu", torch.float32).fn is fp8_linear_ref
    from minillm.kernels.cpu import native

    if native.available():
        assert ops_for("auto", "cpu", torch.float16).w8a8_linear is w8a8_linear_ref
        assert resolve("auto", "fp8_linear", "cpu", torch.float32).impl == "torch"  # fp8 GEMMs are GPU-only
    assert resolve("auto", "w8a8_linear", "cpu", torch.float16).impl == "torch"


def test_fp8_reference_and_the_guarded_kernel_off_gpu():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
    w[0, 0] = 1000.0  # the row's scale follows its max: 1000 -> 448
    fw = quantize_fp8(w)
    assert fw.qweight.dtype == torch.float8_e4m3fn and float(fw.qweight[0, 0].float()) == FP8_MAX
    assert rel_err(fw.dequantize(), w) < 0.04  # 3 mantissa bits: ≤ 1/16 relative per element
    y = fp8_linear_ref(x, fw)
    assert rel_err(y, F.linear(x, w)) < 0.06
    torch.testing.assert_close(fp8_linear_scaled_mm(x, fw), y)  # a CPU tensor: the reference runs
    lin = Fp8Linear(fw)
    torch.testing.assert_close(lin(x, ops_for("torch", "cpu", torch.float32)), y)
    assert lin.to(torch.bfloat16).qweight.dtype == torch.float8_e4m3fn  # codes keep their format
    assert "w8a8" in fp8_supported("cpu")


# ----------------------------------------------------------------------------------------------- SmoothQuant
def test_smoothing_factors_follow_the_formula_and_alpha_is_checked():
    a = torch.tensor([8.0, 1.0, 0.0])
    w = torch.tensor([[2.0, -0.5, 1.0], [-4.0, 0.25, 0.0]])
    s = smoothing_factors(a, w, 0.5)
    torch.testing.assert_close(s, torch.tensor([(8 / 4) ** 0.5, (1 / 0.5) ** 0.5, (1e-5 / 1.0) ** 0.5]))
    torch.testing.assert_close(smoothing_factors(a, w, 1.0), torch.tensor([8.0, 1.0, 1e-5]))
    # after smoothing, activations and weights share each channel's range: max|x/s| = max|W·s| at alpha 0.5
    torch.testing.assert_close((a / s)[:2], (w.abs().amax(0) * s)[:2])
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\]"):
            smoothing_factors(a, w, bad)


def outlier_model(scale=80.0, n=4):
    """A tiny random model whose norms inject activation outliers: ``n`` channels × ``scale`` in every layer."""
    model = tiny_model()
    chans = torch.randperm(TINY["hidden_size"], generator=torch.Generator().manual_seed(3))[:n]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[chans] *= scale
            layer.post_attention_layernorm.weight[chans] *= scale
    return model


def calibration_ids():
    return torch.randint(0, TINY["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(5))


def test_folding_the_smoothing_factors_leaves_the_float_model_unchanged():
    model = outlier_model()
    ids, pos = ids_and_positions(L=16)
    before = model(ids, pos)
    stats = activation_absmax(model, calibration_ids())
    smoothed = copy.deepcopy(model)
    after_stats = smooth_model(smoothed, stats, 0.5)
    torch.testing.assert_close(smoothed(ids, pos), before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))
    # the folded model's linears see x / s: exactly the statistics smooth_model predicted
    measured = activation_absmax(smoothed, calibration_ids())
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                 "model.layers.1.mlp.down_proj"):
        torch.testing.assert_close(measured[name], after_stats[name], rtol=1e-4, atol=1e-6)
        assert not torch.allclose(measured[name], stats[name])
    torch.testing.assert_close(measured["model.layers.0.self_attn.o_proj"], stats["model.layers.0.self_attn.o_proj"],
                               rtol=1e-4, atol=1e-6)  # o_proj is left unsmoothed
    ratios, smoothed_ratios = outlier_ratios(stats), outlier_ratios(after_stats)
    assert ratios["model.layers.0.self_attn.qkv_proj"] > 20 > smoothed_ratios["model.layers.0.self_attn.qkv_proj"]


def test_fold_into_norm_is_the_unfolded_smoothed_computation():
    g = torch.Generator().manual_seed(0)
    x, gamma, w = torch.randn(6, 32, generator=g), torch.rand(32, generator=g) + 0.5, torch.randn(16, 32, generator=g)
    s = torch.rand(32, generator=g) * 4 + 0.1
    want = F.linear(F.rms_norm(x, (32,), gamma) / s, w * s)  # the smoothed computation, written out
    gamma2, w2 = gamma.clone(), w.clone()
    fold_into_norm(gamma2, w2, s)
    torch.testing.assert_close(F.linear(F.rms_norm(x, (32,), gamma2), w2), want)
    torch.testing.assert_close(want, F.linear(F.rms_norm(x, (32,), gamma), w), rtol=1e-5, atol=1e-5)


def test_smoothing_beats_plain_w8a8_on_a_model_with_activation_outliers():
    base = outlier_model()
    ids, pos = ids_and_positions(L=32)
    want = base(ids, pos)
    errs = {}
    for scheme, alpha in [("w8a8", None), ("w8a8-smooth", 0.5)]:
        model = quantize_model_w8a8(copy.deepcopy(base), scheme, calibration_ids(), alpha)
        errs[scheme] = rel_err(model(ids, pos), want)
    assert errs["w8a8-smooth"] < 0.5 * errs["w8a8"], errs


# ----------------------------------------------------------------------------------------------- the swap
@pytest.mark.parametrize("scheme", ["w8a8", "w8a8-static", "w8a8-smooth"])
def test_quantize_model_w8a8_swaps_the_decoder_linears_and_stays_close_to_fp32(scheme):
    base = tiny_model()
    ids, pos = ids_and_positions()
    want = base(ids, pos)
    model = quantize_model_w8a8(copy.deepcopy(base), scheme, calibration_ids())
    lins = [m for n, m in model.named_modules() if n.startswith("model.layers.") and isinstance(m, QuantLinear)]
    assert len(lins) == 4 * TINY["num_hidden_layers"] and all(type(m) is W8A8Linear for m in lins)
    assert all((m.input_scale is not None) == (scheme == "w8a8-static") for m in lins)
    assert type(model.lm_head) is QuantLinear and isinstance(model.model.embed_tokens, QuantEmbedding)
    got = {k: model.set_kernels(k)(ids, pos) for k in ("torch", "auto")}
    torch.testing.assert_close(got["auto"], got["torch"], rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    assert rel_err(got["auto"], want) < 0.05
    model.to(torch.bfloat16)
    assert lins[0].qweight.dtype == torch.int8
    assert scheme != "w8a8-static" or lins[0].input_scale.dtype == torch.float32


def test_bad_w8a8_input_is_a_value_error_naming_the_fix():
    with pytest.raises(ValueError, match="calibration_ids"):
        quantize_model_w8a8(tiny_model(), "w8a8-static")
    with pytest.raises(ValueError, match="alpha applies to quantization='w8a8-smooth' only"):
        quantize_model_w8a8(tiny_model(), "w8a8", alpha=0.5)
    with pytest.raises(ValueError, match=r"must be one of \('w8a8', 'w8a8-static', 'w8a8-smooth', 'fp8'\)"):
        quantize_model_w8a8(tiny_model(), "w4a4")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="compute capability ≥ 8.9.*use quantization='w8a8'"):
            quantize_model_w8a8(tiny_model(), "fp8")


# ----------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cuda_int8_gemm_equals_the_reference(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to("cuda", dtype)
    w8 = quantize_int8(torch.randn(960, 576, generator=g)).to("cuda")
    assert ops_for("auto", "cuda", dtype).w8a8_linear is w8a8_linear_int_mm
    for scale in (None, x.float().abs().amax() / 127):
        got, want = w8a8_linear_int_mm(x, w8, scale), w8a8_linear_ref(x, w8, scale)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 17, 300])
def test_the_cuda_fp8_gemm_equals_the_reference_where_the_gpu_has_one(rows):
    if fp8_supported("cuda") is not None:
        pytest.skip(fp8_supported("cuda"))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to("cuda", torch.bfloat16)
    fw = quantize_fp8(torch.randn(960, 576, generator=g).cuda())
    b = torch.randn(960, generator=g).to("cuda", torch.bfloat16)
    assert ops_for("auto", "cuda", torch.bfloat16).fp8_linear is fp8_linear_scaled_mm
    got, want = fp8_linear_scaled_mm(x, fw, b), fp8_linear_ref(x, fw, b)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_auto_on_cpu_runs_the_native_w8a8_gemm_for_decode_rows_and_int_mm_past_the_rule(monkeypatch):
    """Both give the same bits; the rule (kernels.select.w8a8_prefers_native) only picks which runs."""
    from minillm.kernels import select
    from minillm.kernels.cpu import quant as native_quant

    if not native_quant.available():
        pytest.skip("no C compiler: the native kernels are not built")
    calls = []
    real = native_quant.w8a8_linear
    monkeypatch.setattr(native_quant, "w8a8_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    op = ops_for("auto", "cpu", torch.float32).w8a8_linear
    g = torch.Generator().manual_seed(3)
    w8, b = quantize_int8(torch.randn(24, 64, generator=g)), torch.randn(24, generator=g)
    big = select.W8A8_NATIVE_MAX_ROWS + 1
    for rows in (1, select.W8A8_NATIVE_MAX_ROWS, big):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(op(x, w8, None, b), w8a8_linear_int_mm(x, w8, None, b))
    assert calls == [1, select.W8A8_NATIVE_MAX_ROWS]  # past the rule: torch._int_mm
    assert torch.equal(op(torch.ones(2, 64, dtype=torch.bfloat16), w8, None, None),
                       w8a8_linear_int_mm(torch.ones(2, 64, dtype=torch.bfloat16), w8))  # bf16: ATen's
    assert len(calls) == 2


def test_block_quantized_prefill_rows_take_the_int8_block_gemm_by_the_one_rule(monkeypatch):
    """kernels.select.INT8_PREFILL: "exact" keeps the W8A16/W4A16 prefill (dequantize + GEMM); "int8" makes GGUF's
    Q8_0 (groups of 32) and Q4_x blocks prefill through block_prefill_linear (x rounded to int8 blocks, llama.cpp's
    scheme); "auto" (default) is "int8" where that GEMM has its VNNI tiles; per-channel int8 stays exact always."""
    from minillm.kernels import select
    from minillm.kernels.cpu import quant as native_quant
    from minillm.quant.weight import int4_linear_ref, int8_linear_ref, quantize_int4

    if not native_quant.available():
        pytest.skip("no C compiler: the native kernels are not built")
    ops = ops_for("auto", "cpu", torch.float32)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(40, 96, generator=g), torch.randn(11, 96, generator=g)
    q8_0, per_channel, q4 = quantize_int8(w, 32), quantize_int8(w), quantize_int4(w, 32)
    assert select.INT8_PREFILL == "auto"
    assert select.int8_prefill_through_int8_activations(q4) == native_quant.prefill_tiled()
    monkeypatch.setattr(select, "INT8_PREFILL", "exact")
    assert torch.equal(ops.int8_linear(x, q8_0), int8_linear_ref(x, q8_0))
    assert torch.equal(ops.int4_linear(x, q4), int4_linear_ref(x, q4))
    monkeypatch.setattr(select, "INT8_PREFILL", "int8")
    for op, wq, ref in ((ops.int8_linear, q8_0, int8_linear_ref), (ops.int4_linear, q4, int4_linear_ref)):
        assert torch.equal(op(x, wq), native_quant.block_prefill_linear(x, wq))
        assert not torch.equal(op(x, wq), ref(x, wq))  # the activations were rounded
    assert torch.equal(ops.int8_linear(x, per_channel), int8_linear_ref(x, per_channel))
    assert torch.equal(ops.int8_linear(x[:2], q8_0), native_quant.int8_linear(x[:2], q8_0))  # decode rows: the GEMV
