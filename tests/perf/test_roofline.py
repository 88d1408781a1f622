"""The roofline toolkit against hand-computed figures: specs, the cost model, MBU/MFU, measurement, plots."""

import json
import math

import matplotlib

matplotlib.use("Agg")  # headless: plot_roofline must work without a display

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import ModelConfig
from minillm.kv.contiguous import kv_bytes_per_token
from minillm.perf.hardware import SPECS, HardwareSpec, MeasuredSpec, get_spec, matmul_flops, measure_device
from minillm.perf.roofline import (
    Cost,
    RooflinePoint,
    attainable_flops,
    attention_cost,
    decode_step_cost,
    decode_tokens_per_s_bound,
    linear_cost,
    main,
    mbu,
    mfu,
    plot_roofline,
    prefill_cost,
    ridge_point,
)

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, head_dim=128)


def smol_param_count() -> int:
    """SmolLM2-135M by hand: tied embedding (read once, by the LM head), 30 layers, final norm."""
    h = 576
    per_layer = h * 960 + h * 576 + h * 3072 + 1536 * h + 2 * h  # qkv, o, gate_up, down, two RMSNorms
    return 49152 * h + 30 * per_layer + h


# ------------------------------------------------------------------------------------------- specs
def test_h100_sxm_bf16_ridge_is_about_295_flop_per_byte():
    assert ridge_point(get_spec("H100-SXM"), "bfloat16") == pytest.approx(295.22, abs=0.01)  # 989e12 / 3.35e12


def test_reference_specs_carry_dense_datasheet_figures():
    assert get_spec("h100-pcie").peak(torch.bfloat16) == 756e12
    assert get_spec("A100-80GB").memory_bandwidth == 2.039e12
    assert get_spec("A100-40GB").memory_bandwidth == 1.555e12
    assert get_spec("H200").memory_bandwidth == 4.8e12 and get_spec("H200").peak("bf16") == 989e12
    assert get_spec("L4").peak("bfloat16") == 121e12 and get_spec("L4").memory_bandwidth == 0.30e12
    assert get_spec("T4").peak("float16") == 65e12 and "bfloat16" not in get_spec("T4").peak_flops
    assert all(s.source for s in SPECS.values())


def test_unknown_spec_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown hardware 'B200'.*H100-SXM.*T4"):
        get_spec("B200")


def test_t4_has_no_bf16_ridge():
    with pytest.raises(ValueError, match="T4 lists no bfloat16 peak; it has: float32, float16, int8"):
        ridge_point(get_spec("T4"), "bfloat16")


def test_rejects_invalid_hardware_spec():
    with pytest.raises(ValueError, match="memory_bandwidth"):
        HardwareSpec("x", {"float32": 1e12}, -1.0, 0, "test")
    with pytest.raises(ValueError, match="peak_flops"):
        HardwareSpec("x", {"float99": 1e12}, 1e12, 0, "test")


def test_attainable_flops_is_the_lower_roof():
    spec = get_spec("A100-80GB")
    assert attainable_flops(spec, 1.0, "bfloat16") == 2.039e12  # memory bound: I × bandwidth
    assert attainable_flops(spec, 1000.0, "bfloat16") == 312e12  # compute bound: the peak


# ------------------------------------------------------------------------------------------- KV cache
def test_llama2_7b_fp16_kv_cache_is_512_kib_per_token():
    assert kv_bytes_per_token(LLAMA2_7B, torch.float16) == 512 * 1024
    S = 4096
    step = decode_step_cost(LLAMA2_7B, batch=1, kv_len=S, dtype="float16")
    assert step.breakdown["kv_cache"] == (S + 1) * 512 * 1024  # read S tokens' K/V, write the new one
    # the per-layer attention reads agree with kv_bytes_per_token: 32 layers × 2 × 32 heads × 128 × 2 bytes
    read = 32 * attention_cost(1, 1, S, 32, 32, 128, "float16").breakdown["kv_cache"]
    assert read == S * 512 * 1024
    assert 4096 * 512 * 1024 == 2 * 2**30  # 4096 tokens → 2 GiB per sequence (notebook 02)


@pytest.mark.parametrize("dtype, nbytes", [("float32", 4), (torch.bfloat16, 2)])
def test_default_model_decode_bytes_are_parameters_plus_kv(dtype, nbytes):
    kv_len, batch = 100, 1
    step = decode_step_cost(SMOL, batch=batch, kv_len=kv_len, dtype=dtype)
    weights = smol_param_count() * nbytes
    kv = (kv_len + 1) * (2 * 30 * 3 * 64 * nbytes)  # reads kv_len tokens' K/V, writes the new token's
    assert step.breakdown["weights"] == weights
    assert smol_param_count() == SMOL.num_parameters()  # the hand count agrees with the config's own
    assert step.breakdown["kv_cache"] == kv
    assert step.bytes == pytest.approx(weights + kv + step.breakdown["activations"], rel=1e-12)
    assert step.breakdown["activations"] < 0.01 * step.bytes  # batch 1: activations are noise next to weights


def test_untied_lm_head_reads_its_matrix_but_embedding_lookup_only_its_rows():
    untied = ModelConfig(**{**SMOL.__dict__, "tie_word_embeddings": False})
    tied_w = decode_step_cost(SMOL, 4, 10, "bfloat16").breakdown["weights"]
    untied_w = decode_step_cost(untied, 4, 10, "bfloat16").breakdown["weights"]
    assert untied_w == tied_w  # the V×h input embedding is not streamed, only B rows (counted as activations)


def test_gqa_shrinks_kv_bytes_by_the_group_size():
    mha = attention_cost(8, 1, 1000, 32, 32, 128, "bfloat16")
    gqa = attention_cost(8, 1, 1000, 32, 8, 128, "bfloat16")
    assert mha.breakdown["kv_cache"] == 4 * gqa.breakdown["kv_cache"]
    smol_mha = ModelConfig(**{**SMOL.__dict__, "num_kv_heads": 9})
    kv_gqa = decode_step_cost(SMOL, 2, 500, "bfloat16").breakdown["kv_cache"]
    kv_mha = decode_step_cost(smol_mha, 2, 500, "bfloat16").breakdown["kv_cache"]
    assert kv_mha == 3 * kv_gqa  # H_q / H_kv = 9 / 3


def test_quantized_kv_and_weights_scale_their_bytes():
    fp16 = decode_step_cost(LLAMA2_7B, 1, 4096, "float16")
    int8_kv = decode_step_cost(LLAMA2_7B, 1, 4096, "float16", kv_dtype="int8")
    assert int8_kv.breakdown["kv_cache"] * 2 == fp16.breakdown["kv_cache"]  # 256 KiB per token
    w4 = decode_step_cost(LLAMA2_7B, 1, 4096, "float16", weight_dtype="int4").breakdown["weights"]
    norms = (32 * 2 + 1) * 4096 * 2  # RMSNorm weights stay fp16; every linear (and the LM head) drops to 4 bits
    assert w4 - norms == (fp16.breakdown["weights"] - norms) / 4


# ------------------------------------------------------------------------------------------- intensity
def test_linear_intensity_is_about_m_when_m_is_small():
    M, K, N = 4, 4096, 11008
    cost = linear_cost(M, K, N, "bfloat16")
    assert cost.flops == 2 * M * K * N
    assert cost.intensity == pytest.approx(M * K * N / (K * N + M * K + M * N), rel=1e-12)  # 2MKN / 2(KN+MK+MN)
    assert cost.intensity == pytest.approx(M, rel=2e-3)
    assert linear_cost(M, K, N, "float32").intensity == pytest.approx(M / 2, rel=2e-3)  # 4-byte weights


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 256), S=st.integers(1, 100_000), h_kv=st.integers(1, 16), group=st.integers(1, 8))
def test_decode_attention_intensity_ignores_batch(batch, S, h_kv, group):
    # fp16 q/K/V: FLOPs 4·B·H_q·S·D; bytes 2·B·H_kv·S·D·2 (K, V) + 2·B·H_q·D·2 (q, out) → g·S / (S + g), g = H_q/H_kv.
    cost = attention_cost(batch, 1, S, h_kv * group, h_kv, 64, "float16")
    assert cost.intensity == pytest.approx(group * S / (S + group), rel=1e-12)


def test_mha_decode_attention_intensity_is_s_over_s_plus_1():
    for batch in (1, 8, 64):
        assert attention_cost(batch, 1, 1023, 32, 32, 128, "float16").intensity == pytest.approx(1023 / 1024)


def test_causal_prefill_attention_counts_the_lower_triangle():
    L, D, H = 128, 64, 4
    causal = attention_cost(1, L, L, H, H, D, "bfloat16")
    full = attention_cost(1, L, L, H, H, D, "bfloat16", causal=False)
    assert causal.flops == 4 * H * D * L * (L + 1) // 2 and full.flops == 4 * H * D * L * L
    naive = attention_cost(1, L, L, H, H, D, "bfloat16", fused=False)
    assert naive.bytes - causal.bytes == 4 * H * L * L * 2  # scores and probabilities, written and read


def test_prefill_flops_are_two_per_parameter_per_token_plus_attention():
    B, L = 2, 64
    cost = prefill_cost(SMOL, B, L, "bfloat16")
    linear_params = 30 * 576 * (960 + 576 + 3072 + 1536)
    assert cost.flops_breakdown["linear"] == 2 * B * L * linear_params + 2 * B * 576 * 49152  # last-token logits
    assert cost.flops_breakdown["attention"] == 30 * 4 * B * 9 * 64 * L * (L + 1) // 2
    assert cost.breakdown["weights"] == smol_param_count() * 2  # weights read once for all B·L tokens
    # B·L = 128 tokens share one weight read (decode: B = 2), minus the activations prefill moves
    assert cost.intensity > 30 * decode_step_cost(SMOL, B, L, "bfloat16").intensity


# ------------------------------------------------------------------------------------------- utilisation
def test_mbu_of_a_7b_fp16_model_at_100_tok_s_on_2_tb_s_is_70_percent():
    assert mbu(7e9 * 2, 100, 2e12) == pytest.approx(0.70)  # 1.4 TB/s of 2 TB/s (not 700 GB/s)
    assert mfu(2 * 7e9, 100, 312e12) == pytest.approx(1.4e12 / 312e12)


def test_decode_bound_is_bandwidth_over_bytes_per_token():
    bound = decode_tokens_per_s_bound(SMOL, "bfloat16", get_spec("H100-SXM"), kv_len=1)
    assert bound == pytest.approx(3.35e12 / (2 * smol_param_count()), rel=0.01)
    batched = decode_tokens_per_s_bound(SMOL, "bfloat16", 3.35e12, batch=8, kv_len=1)
    assert 7.5 * bound < batched < 8 * bound  # batching reuses the weight read, KV grows per sequence


# ------------------------------------------------------------------------------------------- bad input
def test_rejects_bad_sizes_and_groupings():
    with pytest.raises(ValueError, match="M must be a positive int, got -1"):
        linear_cost(-1, 4, 4, "float32")
    with pytest.raises(ValueError, match="num_heads \\(9\\) must be a multiple of num_kv_heads \\(4\\)"):
        attention_cost(1, 1, 10, 9, 4, 64, "float16")
    with pytest.raises(ValueError, match="kv_len must be a positive int"):
        decode_step_cost(SMOL, 1, 0, "float16")
    with pytest.raises(ValueError, match="q_len ≤ kv_len"):
        attention_cost(1, 8, 4, 4, 4, 64, "float16")
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        linear_cost(1, 4, 4, "float13")
    with pytest.raises(ValueError, match="does not sum"):
        Cost(1.0, 10.0, {"weights": 3.0})
    with pytest.raises(ValueError, match="bandwidth / peak must be > 0, got 0"):
        mbu(1e9, 100, 0)


# ------------------------------------------------------------------------------------------- measurement
def _positive_finite(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_quick_cpu_measurement_is_positive_and_cached():
    # Behaviour only: machines differ by 100x (bf16 matmul is ~1 GFLOP/s where it is emulated, e.g. Zen 3).
    m = measure_device("cpu", quick=True)
    assert isinstance(m, MeasuredSpec) and m.device == "cpu"
    assert _positive_finite(m.read_bandwidth) and _positive_finite(m.copy_bandwidth)
    assert m.memory_bandwidth >= m.read_bandwidth
    assert _positive_finite(m.peak("float32")) and _positive_finite(m.peak("bfloat16"))
    assert all(_positive_finite(v) for per_dtype in m.gemv_bandwidth.values() for v in per_dtype.values())
    assert set(m.method["matmul_n_timed"]) == {"float32", "bfloat16"}
    assert measure_device(torch.device("cpu"), True) is m  # one measurement per process
    saved = json.loads(json.dumps(m.to_dict()))
    assert MeasuredSpec.from_dict(saved).to_dict() == saved
    assert math.isfinite(ridge_point(m, "bfloat16"))


def test_matmul_flops_is_positive_and_rejects_bad_sizes():
    assert _positive_finite(matmul_flops("float32", 64)) and _positive_finite(matmul_flops(torch.bfloat16, 64))
    with pytest.raises(ValueError, match="n and repeats must be >= 1, got n=0"):
        matmul_flops("float32", 0)


def test_matmul_probe_shrinks_n_only_for_a_dtype_too_slow_for_the_budget(monkeypatch):
    import minillm.perf.hardware as hardware

    # fp32 as a fast CPU runs it, bf16 as an AVX2-only CPU emulates it (0.9 GFLOP/s measured on a Zen 3)
    rates = {"float32": 100e9, "bfloat16": 0.9e9}
    monkeypatch.setattr(hardware, "matmul_flops", lambda name, n, device, repeats: rates[name])
    plan = {**hardware._plan("cpu", quick=True), "matmul_n": 512, "budget_s": 0.1, "repeats": 1, "warmup": 0}
    peaks, sizes = hardware._probe_matmul("cpu", plan)
    # one 512 call: fp32 2.7 ms, within budget; bf16 0.3 s, past it, so bf16 is timed at the floor n = 256
    assert sizes == {"float32": 512, "bfloat16": 256}
    assert all(_positive_finite(v) for v in peaks.values())


def test_main_prints_tables_and_saves_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "cache"))  # never the user's ~/.cache
    assert main(["--device", "cpu", "--quick", "--runs", "1", "--json", str(tmp_path / "peaks.json")]) == 0
    out = capsys.readouterr().out
    assert "read (sum over" in out and "H100-SXM" in out and "GFLOP/s" in out
    assert "measured 20" in out and str(tmp_path / "cache") in out  # when, and where it is cached
    saved = json.loads((tmp_path / "peaks.json").read_text())
    assert saved["measured"]["device"] == "cpu" and "T4" in saved["reference"]


# ------------------------------------------------------------------------------------------- plot
def test_plot_roofline_draws_roofs_ridge_and_labelled_points():
    import matplotlib.pyplot as plt

    spec = get_spec("A100-80GB")
    points = [RooflinePoint("decode", 1.0, 1.5e12), RooflinePoint("prefill", 500.0, 250e12),
              RooflinePoint.from_cost("gemv", linear_cost(1, 4096, 4096, "bfloat16"), 1e-5)]
    ax = plot_roofline(spec, points, dtype="bfloat16")
    try:
        assert sum(len(c.get_offsets()) for c in ax.collections) == 3
        texts = [t.get_text() for t in ax.texts]
        assert {"decode", "prefill", "gemv"} <= set(texts) and any("ridge" in t for t in texts)
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        roof = ax.lines[0]
        assert max(roof.get_ydata()) == 312e12  # the compute roof is the bf16 peak
        assert ax.lines[1].get_xdata()[0] == pytest.approx(312e12 / 2.039e12)  # ridge marker
    finally:
        plt.close(ax.figure)
