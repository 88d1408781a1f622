"""``bench quant``'s decode timing runs through the engine a user runs (and so through the fused step on CPU)."""

import math

import pytest
import torch

from minillm import ModelConfig
from minillm.models.llama import Transformer
from minillm.perf.bench import quant as bench


def tiny_model() -> Transformer:
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return Transformer(cfg).requires_grad_(False)


def test_decode_rate_times_every_sequence_through_the_engine(monkeypatch):
    from minillm.engine import llm_engine

    steps = []
    real_step = llm_engine.LLMEngine.step

    def counting_step(self):
        updates = real_step(self)
        steps.append(sum(len(u.token_ids) for u in updates))
        return updates

    monkeypatch.setattr(llm_engine.LLMEngine, "step", counting_step)
    ttft, rate = bench.decode_rate(tiny_model(), [[1, 2, 3], [4, 5, 6, 7, 8]], 6)
    assert sum(steps) == 2 * 6  # every token of both sequences came from engine steps
    assert ttft > 0 and math.isfinite(rate) and rate > 0


def test_decode_rate_of_one_token_has_a_first_token_time_and_no_rate():
    ttft, rate = bench.decode_rate(tiny_model(), [[1, 2, 3, 4]], 1)
    assert ttft > 0 and math.isnan(rate)


def test_gemv_bench_times_each_scheme_per_call_as_one_native_stack_and_read_only():
    from minillm.kernels.cpu import decode
    from minillm.kernels.cpu import quant as native_quant

    if not (native_quant.available() and decode.available()):
        import pytest

        pytest.skip("the native libraries did not build here")
    rows = {r["scheme"]: r for r in bench.bench_quant_gemv(rows=2, layers=1, repeats=1, read_bandwidth=False)}
    for name in ("fp32", "int8", "int4 g32"):
        for variant in ("stack", "stack 1 region", "read-only"):
            r = rows[f"{name} {variant}"]
            assert r["rows"] == 2 and math.isfinite(r["ms"]) and r["ms"] > 0
    assert rows["int4 g32 stack"]["MB"] == rows["int4 g32 native"]["MB"]  # the same weights, both ways
    assert rows["int8 stack 1 region"]["MB"] == rows["int8 native"]["MB"]
    assert "read bandwidth" not in rows and all("pct_of_read" not in r for r in rows.values())


@pytest.mark.parametrize("bad", ["int4", "w8a8-smooth-a1.5", "w8a8-smooth-ax", "fp16"])
def test_an_unknown_scheme_is_a_value_error_naming_the_known_ones(bad):
    from minillm.perf.bench.quant import SCHEMES, bench_quant

    with pytest.raises(ValueError, match="unknown scheme") as e:
        bench_quant(schemes=[bad], save=False)
    assert SCHEMES[0] in str(e.value)
