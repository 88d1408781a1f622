"""AWQ (quant/awq.py): activation-aware scales beat round-to-nearest where a few input channels are large; folding
the scales leaves the float layer's function unchanged; the calibrated model runs (AWQ and GPTQ, via
quant/apply.py and load_model)."""

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig
from minillm.layers.linear import QuantEmbedding, QuantLinear
from minillm.models.loader import build_model
from minillm.quant.apply import fit_group_size, quantize_model, quantize_model_calibrated
from minillm.quant.awq import fold_scales, search_scales
from minillm.quant.weight import Int4Weight, quantize_int4

TINY = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def tiny_model(seed=0):
    cfg = LlamaConfig(**TINY, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


def outlier_inputs(n: int, K: int, seed: int) -> torch.Tensor:
    """[n, K] activations whose channels 3, 50 and 200 are ~30× the rest (the outlier features of real LLMs)."""
    x = torch.randn(n, K, generator=torch.Generator().manual_seed(seed))
    x[:, [3, 50, 200]] *= 30
    return x


def test_awq_output_error_is_lower_than_round_to_nearest_when_a_few_channels_are_large():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    x, held_out = outlier_inputs(512, 256, seed=2), outlier_inputs(512, 256, seed=3)
    s, alpha = search_scales(w, x, 128)
    awq = quantize_int4(w * s, 128).dequantize() / s
    rtn = quantize_int4(w, 128).dequantize()
    assert alpha > 0 and s[[3, 50, 200]].min() > s.median()  # the outlier channels are the ones scaled up
    err = {name: float((held_out @ (w - wq).T).pow(2).mean()) for name, wq in (("awq", awq), ("rtn", rtn))}
    assert err["awq"] < 0.8 * err["rtn"], err


def test_folding_the_scales_leaves_the_float_layer_unchanged():
    model = tiny_model()
    layer, cfg = model.model.layers[0], model.config
    g = torch.Generator().manual_seed(4)
    hkv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    o = torch.rand(hkv, 1, cfg.head_dim, generator=g).add(0.5).expand(hkv, group, cfg.head_dim).reshape(-1)
    scales = {"self_attn.qkv_proj": torch.rand(cfg.hidden_size, generator=g) + 0.5, "self_attn.o_proj": o,
              "mlp.gate_up_proj": torch.rand(cfg.hidden_size, generator=g) + 0.5,
              "mlp.down_proj": torch.rand(cfg.intermediate_size, generator=g) + 0.5}
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=g)
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        before = model(ids, positions)
        fold_scales(layer, cfg, scales)
        after = model(ids, positions)
    torch.testing.assert_close(after, before)
    with pytest.raises(ValueError, match="equal across the query heads"):
        fold_scales(layer, cfg, {**scales, "self_attn.o_proj": torch.rand(cfg.q_size) + 0.5})


@pytest.mark.parametrize("scheme", ["awq", "gptq"])
def test_a_calibrated_model_is_all_packed_int4_runs_in_seconds_and_gives_finite_logits(scheme):
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(5))
    t0 = time.perf_counter()
    quantize_model_calibrated(model, scheme, ids)
    assert time.perf_counter() - t0 < 60  # seconds on a quiet CPU; generous for a shared one
    body = [m for n, m in model.named_modules() if isinstance(m, QuantLinear) and n != "lm_head"]
    assert len(body) == 4 * TINY["num_hidden_layers"]
    assert all(isinstance(m.packed_weight, Int4Weight) and m.group_size == 128 for m in body)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)  # tied: reads the int8 head's rows
    logits = model(ids[:, :10], torch.arange(10).expand(4, 10))
    assert logits.shape == (4, 10, TINY["vocab_size"]) and torch.isfinite(logits).all()


def test_calibrated_quantization_beats_round_to_nearest_on_the_models_own_activations():
    """On a model whose hidden states have outlier channels (scaled embedding columns, as real LLMs have), both
    AWQ and GPTQ track the float logits more closely than plain int4 at the same groups."""
    torch.manual_seed(0)
    ref = tiny_model()
    with torch.no_grad():
        ref.model.embed_tokens.weight[:, [5, 77]] *= 40
    calib = torch.randint(0, TINY["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(6))
    test_ids = torch.randint(0, TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(32).expand(4, 32)

    def error(quantize) -> float:
        model = tiny_model()
        model.load_state_dict(ref.state_dict())
        quantize(model)
        with torch.no_grad():
            return float((model(test_ids, positions) - ref(test_ids, positions)).pow(2).mean())

    rtn = error(lambda m: quantize_model(m, "int4", 128, fit_group=True))
    assert error(lambda m: quantize_model_calibrated(m, "gptq", calib)) < rtn
    assert error(lambda m: quantize_model_calibrated(m, "awq", calib)) < rtn


def test_the_group_falls_back_to_the_largest_that_divides_k():
    assert fit_group_size(1536, 128) == 128 and fit_group_size(576, 128) == 64 and fit_group_size(96, 128) == 32
    with pytest.raises(ValueError, match="divides K=40"):
        fit_group_size(40, 128)


@pytest.mark.parametrize("scheme", ["awq", "gptq"])
def test_load_model_quantizes_on_load_with_the_checkpoints_tokenizer(scheme, tmp_path, default_model_dir):
    """``load_model(path, quantization=...)`` calibrates on the calibration split, tokenized by the checkpoint's own
    tokenizer (here the default model's, beside a tiny random 1-layer model of the same vocabulary)."""
    from transformers import AutoTokenizer

    from minillm.models.loader import load_model

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32", device="cpu", quantization=scheme)
    packed = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(packed) == 5 and all(isinstance(m.packed_weight, Int4Weight) for m in packed[:4])
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])).all()
