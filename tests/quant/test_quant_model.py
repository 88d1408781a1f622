"""Quantized models end to end: load_model/LLM(quantization=...), the default model's own GGUF blocks, the engine."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import LLM, SamplingParams, load_model
from minillm.engine.simple import generate
from minillm.layers.linear import Linear, QuantEmbedding, QuantLinear
from minillm.models.loader import QUANTIZATIONS, build_model, default_model_path, load_config, resolve
from minillm.quant.weight import Int4Weight, Int8Weight

TINY = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as config.json + model.safetensors (no tokenizer)."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY))
    hf.config.to_json_file(path / "config.json")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              path / "model.safetensors")
    return path


@pytest.mark.parametrize("scheme,kind", [("int8", Int8Weight), ("int4", Int4Weight)])
def test_load_model_quantizes_a_float_checkpoint_on_load(tiny_dir, scheme, kind):
    model = load_model(str(tiny_dir), device="cpu", quantization=scheme)
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert isinstance(model.model.layers[0].mlp.down_proj.packed_weight, kind)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    ids = torch.randint(0, 320, (1, 8), generator=torch.Generator().manual_seed(0))
    out = generate(model, [ids[0].tolist()], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].output) == 5


@pytest.mark.parametrize("bad", ["int3", "fp4", "INT4", ""])
def test_an_unknown_quantization_is_a_value_error_listing_the_choices(tiny_dir, bad):
    with pytest.raises(ValueError, match=r"quantization must be None or one of \('int8', 'int4', 'awq', 'gptq', "
                                         r"'w8a8', 'w8a8-static', 'w8a8-smooth', 'fp8'\)"):
        load_model(str(tiny_dir), quantization=bad)
    with pytest.raises(ValueError, match="quantization must be"):
        LLM(str(tiny_dir), quantization=bad)
    assert "int3" not in QUANTIZATIONS


def test_the_engine_generates_with_a_quantized_model_as_the_cached_loop_does(tiny_dir):
    from minillm.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine

    model = load_model(str(tiny_dir), device="cpu", quantization="int4")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    engine = LLMEngine(model, None, EngineConfig())
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    want = [s.output for s in generate(model, prompts, params)]
    assert [list(g) for g in got] == want


# ------------------------------------------------------------------------------------- the default model (GGUF)
@pytest.fixture(scope="module")
def gguf_pair():
    """(the default model with quantization="int4", the fp32 model built from the dequantized GGUF weights)."""
    from minillm.quant.gguf import read_gguf_weights

    q = load_model(None, device="cpu", dtype="float32", quantization="int4", kernels="torch")
    weights = read_gguf_weights(default_model_path())
    dense = {k: v if isinstance(v, torch.Tensor) else v.dequantize() for k, v in weights.items()}
    f = build_model(load_config(resolve(None)), dense, dtype=torch.float32, device="cpu", kernels="torch")
    return q, f, weights


@pytest.mark.slow
def test_the_int4_default_model_holds_the_ggufs_own_q4_1_blocks_and_q8_0_head(gguf_pair):
    q, _, weights = gguf_pair
    attn = q.model.layers[3].self_attn.qkv_proj.packed_weight
    qkv = [weights[f"model.layers.3.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert isinstance(attn, Int4Weight) and attn.group_size == 32 and attn.scales.dtype == torch.float16
    assert torch.equal(attn.packed, torch.cat([w.packed for w in qkv]))
    assert torch.equal(attn.mins, torch.cat([w.mins for w in qkv]))
    head = q.lm_head.packed_weight
    assert isinstance(head, Int8Weight) and torch.equal(head.qweight, weights["model.embed_tokens.weight"].qweight)
    assert q.model.embed_tokens.qweight is q.lm_head.qweight
    shapes = {tuple(w.shape) for w in weights.values() if not isinstance(w, torch.Tensor)}
    shapes |= {tuple(m.packed_weight.shape) for m in q.modules() if isinstance(m, QuantLinear)}  # stacked ones
    assert not [t for t in [*q.parameters(), *q.buffers()] if t.is_floating_point() and tuple(t.shape) in shapes]


@pytest.mark.slow
def test_the_int4_default_models_logits_equal_the_dequantized_gguf_float_model(gguf_pair):
    q, f, _ = gguf_pair
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        torch.testing.assert_close(q(ids, pos), f(ids, pos))


@pytest.mark.slow
def test_the_int4_default_model_answers_greedily_with_sensible_text():
    llm = LLM(quantization="int4", device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = llm.generate(["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"], params)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[1].outputs[0].text.startswith(" 5, 6")
    assert "return" in outs[2].outputs[0].text or "if" in outs[2].outputs[0].text
    assert isinstance(llm.model.model.layers[0].mlp.gate_up_proj, QuantLinear)


# ------------------------------------------------------------------------------------------------------- CLI
def test_the_cli_refuses_an_unknown_quantization_with_exit_status_2(capsys):
    from minillm.entrypoints.cli import main

    assert main(["eval", "perplexity", "--quantization", "int3", "--max-tokens", "10"]) == 2
    assert "quantization must be None or one of" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_evaluates_the_int4_default_models_perplexity(capsys):
    from minillm.entrypoints.cli import main

    assert main(["eval", "perplexity", "--quantization", "int4", "--max-tokens", "200", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    ppl = float(out.split()[1])
    assert 1 < ppl < 100 and "199 held-out tokens" in out and "int4 quantization" in out


def test_w8a8_loads_and_the_engine_generates_as_the_cached_loop_does(tiny_dir):
    from minillm.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine
    from minillm.layers.linear import W8A8Linear

    model = load_model(str(tiny_dir), device="cpu", quantization="w8a8")
    assert type(model.model.layers[1].self_attn.qkv_proj) is W8A8Linear
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    got = [o.outputs[0].token_ids for o in LLMEngine(model, None, EngineConfig()).generate(prompts, params)]
    assert [list(g) for g in got] == [s.output for s in generate(model, prompts, params)]


@pytest.mark.parametrize("quantization,config,match", [
    ("w8a8-smooth", {"alpha": 1.2}, r"alpha must be a number in \[0, 1\]"),
    ("w8a8-smooth", {"alpha": -0.5}, r"alpha must be a number in \[0, 1\]"),
    ("w8a8", {"alpha": 0.5}, "applies to quantization='w8a8-smooth' only"),
    ("int8", {"alpha": 0.5}, "applies to quantization='w8a8-smooth' only"),
    ("w8a8-smooth", {"beta": 0.5}, "one key 'alpha'"),
])
def test_a_bad_quantization_config_is_a_value_error_before_loading(tiny_dir, quantization, config, match):
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_dir), quantization=quantization, quantization_config=config)
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_dir), quantization=quantization, quantization_config=config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without an fp8 GPU")
def test_fp8_on_a_cpu_is_a_value_error_saying_why_and_what_to_use():
    with pytest.raises(ValueError, match=r"needs a CUDA GPU with compute capability ≥ 8.9.*use quantization='w8a8'"):
        LLM(device="cpu", quantization="fp8")


def test_the_cli_passes_alpha_to_w8a8_smooth_and_refuses_one_out_of_range(capsys):
    from minillm.entrypoints.cli import build_parser, main

    a = build_parser().parse_args(["eval", "perplexity", "--quantization", "w8a8-smooth", "--alpha", "0.8"])
    assert (a.quantization, a.alpha) == ("w8a8-smooth", 0.8)
    assert main(["eval", "perplexity", "--quantization", "w8a8-smooth", "--alpha", "1.5", "--max-tokens", "10"]) == 2
    assert "alpha must be a number in [0, 1]" in capsys.readouterr().err
    b = build_parser().parse_args(["bench", "quant", "--prefill-len", "512", "--batch", "32"])
    assert (b.prefill_len, b.batch) == (512, 32)


def test_bench_quant_loads_each_w8a8_row_with_its_scheme_and_alpha(monkeypatch):
    from minillm.models import loader
    from minillm.perf.bench import quant as bench

    calls = []
    monkeypatch.setattr(loader, "load_model", lambda name, **kw: calls.append(kw) or kw)
    for scheme in ("w8a8", "w8a8-static", "w8a8-smooth", "w8a8-smooth-a0.8", "fp8"):
        assert scheme in bench.SCHEMES
        bench._load(scheme, None, torch.device("cpu"))
    assert [c["quantization"] for c in calls] == ["w8a8", "w8a8-static", "w8a8-smooth", "w8a8-smooth", "fp8"]
    assert calls[3]["quantization_config"] == {"alpha": 0.8} and "quantization_config" not in calls[2]


@pytest.mark.slow
def test_the_cli_reports_outlier_ratios_before_and_after_smoothing(capsys):
    from minillm.entrypoints.cli import main

    assert main(["eval", "outliers", "--device", "cpu", "--alpha", "0.5"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("layers.")]
    assert len(rows) == 4 * 30  # SmolLM2-135M: 30 layers × 4 linears
    before = {r[0]: float(r[1]) for r in rows}
    after = {r[0]: float(r[2]) for r in rows}
    assert all(after[n] == before[n] for n in before if n.endswith("o_proj"))  # left unsmoothed
    qkv = [n for n in before if n.endswith("qkv_proj")]
    assert sum(after[n] for n in qkv) < 0.8 * sum(before[n] for n in qkv)  # the norms' outlier channels flatten
