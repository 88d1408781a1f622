"""minillm.perf.metrics: percentiles, goodput, cost, decode bytes and the measuring helpers."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from minillm.course.checks import CONFIGS, LLAMA2_7B, SMOLLM2_135M
from minillm.perf import metrics, roofline


def test_percentile_matches_torch_quantile_linear_interpolation():
    rng = random.Random(1)
    for n in (1, 2, 5, 101):
        values = [rng.uniform(0, 10) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            expected = torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100).item()
            assert metrics.percentile(values, q) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_percentile_rejects_empty_input_and_out_of_range_q():
    with pytest.raises(ValueError, match="empty"):
        metrics.percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        metrics.percentile([1.0], 101)


def test_one_outlier_moves_the_mean_not_the_median():
    s = metrics.summarize([0.1] * 9 + [3.0])
    assert s["p50"] == pytest.approx(0.1)
    assert s["mean"] == pytest.approx(0.39)
    assert s["max"] == 3.0


def test_summarize_uses_the_percentile_it_is_given():
    s = metrics.summarize([1.0, 2.0], percentile=lambda values, q: -q)
    assert s["p50"] == -50 and s["p99"] == -99


def test_goodput_counts_requests_meeting_both_limits_inclusive():
    reqs = [SimpleNamespace(ttft_s=0.2, tpot_s=0.1), SimpleNamespace(ttft_s=0.21, tpot_s=0.01),
            SimpleNamespace(ttft_s=0.01, tpot_s=0.11), SimpleNamespace(ttft_s=0.0, tpot_s=0.0)]
    assert metrics.goodput(reqs, 2.0) == pytest.approx(1.0)
    assert metrics.goodput(reqs, 1.0, ttft_slo_s=1, tpot_slo_s=1) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="duration_s"):
        metrics.goodput(reqs, 0.0)


def test_cost_per_million_tokens_worked_example():
    assert metrics.cost_per_million_tokens(2.0, 100.0) == pytest.approx(5.5556, rel=1e-4)
    with pytest.raises(ValueError):
        metrics.cost_per_million_tokens(1.0, 0.0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_weight_bytes_agrees_with_the_roofline_cost_model(name, dtype):
    config = CONFIGS[name]
    expected = roofline.decode_step_cost(config, 1, 1, dtype).breakdown["weights"]
    assert metrics.decode_weight_bytes(config, dtype) == expected


def test_decode_weight_bytes_reads_the_lm_head_not_the_embedding_table():
    # Llama-2-7B (untied): 6.74e9 parameters, of which the 32000 × 4096 input embedding is not read at decode.
    assert metrics.decode_weight_bytes(LLAMA2_7B, torch.float16) == (LLAMA2_7B.num_parameters() - 32000 * 4096) * 2
    # SmolLM2 (tied): the one matrix is read once, as the LM head.
    assert metrics.decode_weight_bytes(SMOLLM2_135M, torch.float32) == SMOLLM2_135M.num_parameters() * 4


def test_measure_seconds_runs_warmup_then_repeats():
    calls = []
    times = metrics.measure_seconds(lambda: calls.append(1), repeat=4, warmup=2)
    assert len(calls) == 6 and len(times) == 4 and all(t >= 0 for t in times)


def test_memory_growth_sees_a_touched_allocation():
    nbytes = 64 * 2**20
    tensor, grown = metrics.memory_growth(lambda: torch.ones(nbytes // 4))
    assert tensor.numel() == nbytes // 4
    assert grown == pytest.approx(nbytes, rel=0.1)
