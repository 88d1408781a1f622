"""``bench decode``'s plumbing at a tiny shape on CPU: every implementation gets a row with finite figures."""

import json
import math

from minillm.perf.bench.decode import SHAPES, bench_decode, copy_bandwidth

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def test_bench_decode_reports_every_implementation_side_by_side(tmp_path):
    result = bench_decode(shapes=(TINY,), batches=(2,), n_tokens=5, prompt_len=6, device="cpu", out_dir=tmp_path)
    impls = [r["impl"] for r in result["rows"]]
    assert impls == ["minillm eager", "minillm graphs", "hf eager"]  # hf_compile is off by default on CPU
    for r in result["rows"]:
        assert r["error"] is None, r
        assert r["batch"] == 2 and r["dtype"] == "float32"
        assert r["tok_s"] > 0 and math.isclose(r["tok_s"], 2e3 / r["ms_per_step"])
        assert math.isclose(r["us_per_layer"], r["ms_per_step"] * 1e3 / 2)
        assert r["kernels_per_step"] > 0 and 0 < r["pct_copy_bandwidth"]
    saved = json.loads((tmp_path / "decode-cpu.json").read_text())
    assert saved["rows"] == result["rows"] and "machine" in saved and saved["copy_bandwidth_gb_s"] > 0


def test_a_failing_peer_is_recorded_in_its_row_not_raised(tmp_path, monkeypatch):
    import minillm.perf.bench.decode as bench

    def broken(*a, **k):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(bench, "time_hf", broken)
    result = bench_decode(shapes=(TINY,), batches=(1,), n_tokens=2, prompt_len=4, device="cpu", save=False,
                          modes=("eager",))
    assert [r["impl"] for r in result["rows"]] == ["minillm eager", "hf eager"]
    assert result["rows"][1]["error"] == "RuntimeError: no GPU here" and math.isnan(result["rows"][1]["tok_s"])


def test_the_benchmark_shapes_are_the_published_configs():
    assert SHAPES["default"]["num_hidden_layers"] == 30 and SHAPES["default"]["hidden_size"] == 576
    assert SHAPES["llama-3.2-1b"]["num_hidden_layers"] == 16 and SHAPES["llama-3.2-1b"]["hidden_size"] == 2048
    assert copy_bandwidth(__import__("torch").device("cpu"), nbytes=1 << 20, repeats=1) > 0


def test_time_engine_auto_runs_the_engines_own_pick_with_fewer_python_ops_on_cpu(capfd):
    """Mode "auto" (enforce_eager=None) is the fused native step on CPU fp32: one native call per step in place of
    every layer's ATen ops, so the profiler sees fewer ops than in "eager"; no profiler log reaches stderr."""
    import pytest
    import torch

    from minillm.kernels.cpu import native
    from minillm.perf.bench.decode import random_pair, time_engine

    model, _ = random_pair(TINY, torch.float32, torch.device("cpu"), with_hf=False)
    prompts = [[5, 6, 7, 8]]
    eager_s, eager_ops = time_engine(model, prompts, 6, "eager")
    auto_s, auto_ops = time_engine(model, prompts, 6, "auto")
    assert eager_s > 0 and auto_s > 0 and eager_ops > 0
    if native.available():
        assert auto_ops < eager_ops / 2
    assert "profiler_start" not in capfd.readouterr().err
    with pytest.raises(ValueError, match="mode must be one of eager, graphs, compiled, auto, got 'fused'"):
        time_engine(model, prompts, 6, "fused")
