"""``make-model``: a checkpoint at a published shape with seeded random weights, as an HF directory and GGUFs that
encode the same weights, loadable by transformers and minillm alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from minillm.models.configs import SHAPES, hf_config_dict, shape_config
from minillm.models.synthetic import GGUF_FORMATS, make_model, synthetic_config, tensor_plan

IDS = torch.tensor([[1, 2, 3, 400, 5000, 17, 49151]])  # the last id is the vocabulary's last row
POS = torch.arange(IDS.shape[1])[None]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return make_model("tiny", out, gguf=GGUF_FORMATS, dtype="float32", seed=3), out


def _safetensors(out):
    from minillm.models.loader import read_safetensors

    return read_safetensors(out)


def test_every_shape_config_round_trips_through_config_json():
    from minillm.config import ModelConfig

    for name in SHAPES:
        c = shape_config(name)
        assert ModelConfig.from_hf(hf_config_dict(c) | {"model_type": "llama"}) == c


def test_published_shapes_keep_their_bodies_and_take_the_default_vocabulary():
    c = synthetic_config("llama-3.1-8b")
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (32, 4096, 14336, 32, 8, 128)
    assert not c.tie_word_embeddings and synthetic_config("llama-3.2-1b").tie_word_embeddings
    assert c.vocab_size == 49152 and c.rope_theta == 500000.0
    assert synthetic_config("llama-3.1-8b", vocab="shape").vocab_size == 128256  # the shape's own, on request
    with pytest.raises(ValueError, match="vocab must be one of default, shape"):
        synthetic_config("llama-3.2-1b", vocab="128k")
    assert [p.gguf for p in tensor_plan(c)][-1] == "output.weight"  # untied: the head is its own tensor
    with pytest.raises(ValueError, match="shape must be one of"):
        shape_config("llama-4")


def test_writes_an_hf_directory_and_one_gguf_per_format(tiny):
    report, out = tiny
    names = set(report["files"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {f"tiny-{f.upper()}.gguf" for f in GGUF_FORMATS} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 2 and config["torch_dtype"] == "float32"


def test_the_same_seed_gives_the_same_weights_and_another_seed_others(tiny, tmp_path):
    _, out = tiny
    make_model("tiny", tmp_path / "a", dtype="float32", seed=3)
    make_model("tiny", tmp_path / "b", dtype="float32", seed=4)
    ref, same, other = _safetensors(out), _safetensors(tmp_path / "a"), _safetensors(tmp_path / "b")
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ref[name], same[name]) and not torch.equal(ref[name], other[name])
    assert ref[name].std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(ref["model.norm.weight"], torch.ones(64))


def test_hf_directory_gives_equal_logits_in_transformers_and_minillm(tiny):
    from transformers import AutoModelForCausalLM

    from minillm.models.loader import load_model, load_tokenizer

    _, out = tiny
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out, dtype="float32", device="cpu")
    with torch.inference_mode():
        expected = hf(IDS).logits
    torch.testing.assert_close(ours(IDS, POS), expected)
    assert torch.isfinite(expected).all() and expected.std() > 0
    assert load_tokenizer(out)("Hello world").input_ids == load_tokenizer(None)("Hello world").input_ids


# the largest |dequantized - original| a format allows, as a fraction of the tensor's largest |weight|:
# Q8_0 half a step of absmax/127; Q4_1 half a step of (max - min)/15 ≤ 2·absmax/15; Q4_0 one step of absmax/8
# (its code 15 clips +absmax's side); F16 its relative rounding
FORMAT_ERROR = {"q8_0": 0.5 / 127 + 1e-3, "q4_1": 1 / 15 + 1e-3, "q4_0": 1 / 8 + 1e-3, "f16": 1e-3}


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_gguf_dequantizes_to_the_safetensors_weights_within_its_format_error(tiny, fmt):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from minillm.quant.gguf import hf_name, unpermute_index

    _, out = tiny
    ref = _safetensors(out)
    reader = GGUFReader(out / f"tiny-{fmt.upper()}.gguf")
    assert int(reader.fields["llama.block_count"].contents()) == 2
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(reader.tensors) == len(ref)
    for t in reader.tensors:
        name = hf_name(t.name)
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(ref[name].shape)
        if ".q_proj." in name or ".k_proj." in name:  # llama.cpp's row order, undone as every reader does
            w = w[unpermute_index(w.shape[0], 4 if ".q_proj." in name else 2)]
        err = (w - ref[name]).abs().max().item()
        assert err <= FORMAT_ERROR[fmt] * ref[name].abs().max().item(), (t.name, t.tensor_type.name, err)


# the logits' largest move from the float model's, as a fraction of their largest value: the weights'
# quantization error carried through two layers — 4-bit some %, Q4_0 (one step of absmax/8) more than Q4_1 (half a
# step of range/15), 8-bit about 1 %
LOGIT_ERROR = {"q4_1": 0.25, "q4_0": 0.3, "q8_0": 0.05}


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0"])
def test_minillm_runs_the_gguf_blocks_close_to_the_float_model(tiny, fmt):
    from minillm.models.loader import load_config, load_model, resolve
    from minillm.quant.apply import model_from_packed
    from minillm.quant.gguf import read_gguf_weights

    _, out = tiny
    packed = model_from_packed(load_config(resolve(out)), read_gguf_weights(out / f"tiny-{fmt.upper()}.gguf"),
                               dtype=torch.float32, device="cpu")
    full = load_model(out, dtype="float32", device="cpu")
    with torch.inference_mode():
        a, b = packed(IDS, POS), full(IDS, POS)
    assert (a - b).abs().max() < LOGIT_ERROR[fmt] * b.abs().max()


def test_a_q4_0_gguf_runs_without_mins_and_generates_the_greedy_tokens_of_m_stored_as_minus_8_d(tiny):
    """Q4_0 loads as symmetric ``Int4Weight``s (18 bytes per block, as the file): the engine's greedy tokens and the
    logits are those of the same blocks with m = −8·d stored (the Q4_1 form Q4_0 ran as before), bit for bit."""
    from minillm import EngineConfig, LLMEngine, SamplingParams
    from minillm.layers.linear import QuantLinear
    from minillm.models.loader import load_config, resolve
    from minillm.quant.apply import model_from_packed
    from minillm.quant.gguf import read_gguf_weights
    from minillm.quant.weight import Int4Weight

    _, out = tiny
    weights = read_gguf_weights(out / "tiny-Q4_0.gguf")
    stored = {n: w.with_mins() if isinstance(w, Int4Weight) else w for n, w in weights.items()}
    models = [model_from_packed(load_config(resolve(out)), ws, dtype=torch.float32, device="cpu")
              for ws in (weights, stored)]
    int4 = [[m.packed_weight for m in model.modules() if isinstance(m, QuantLinear)
             and isinstance(m.packed_weight, Int4Weight)] for model in models]
    assert int4[0] and all(w.mins is None for w in int4[0]) and all(w.mins is not None for w in int4[1])
    assert sum(w.nbytes for w in int4[0]) * 20 == sum(w.nbytes for w in int4[1]) * 18  # 18 bytes a block, not 20
    with torch.inference_mode():
        assert torch.equal(models[0](IDS, POS), models[1](IDS, POS))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 400], [5000, 17, 49151, 9, 8, 7]]
    tokens = [[o.token_ids for o in LLMEngine(m, config=EngineConfig()).generate(prompts, [params] * 2)]
              for m in models]
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 12


def test_rejects_an_unknown_format_before_writing(tmp_path):
    with pytest.raises(ValueError, match="q5_k"):
        make_model("tiny", tmp_path / "x", gguf=("q5_k",))
    assert not (tmp_path / "x").exists()


def test_a_q4_k_m_file_from_llama_cpp_s_quantizer_runs_close_to_the_float_model(tmp_path):
    """q4_k_m is written by llama.cpp's own quantizer (only where llama-cpp-python is installed); the tiny shape's
    rows are not multiples of 256, so llama.cpp stores them in its fallbacks (Q5_0, Q8_0), which load exactly."""
    pytest.importorskip("llama_cpp")
    from minillm.models.loader import load_config, load_model, resolve
    from minillm.quant.apply import model_from_packed
    from minillm.quant.gguf import read_gguf_weights

    out = tmp_path / "k"
    report = make_model("tiny", out, gguf=("q4_k_m",), dtype="float32", seed=3)
    assert {"tiny-Q4_K_M.gguf", "tiny-F16.gguf"} <= set(report["files"])  # the f16 file is its source
    packed = model_from_packed(load_config(resolve(out)), read_gguf_weights(out / "tiny-Q4_K_M.gguf"),
                               dtype=torch.float32, device="cpu")
    full = load_model(out, dtype="float32", device="cpu")
    with torch.inference_mode():
        a, b = packed(IDS, POS), full(IDS, POS)
    assert (a - b).abs().max() < LOGIT_ERROR["q8_0"] * 2 * b.abs().max()  # 5- and 8-bit blocks


def test_the_shape_s_vocabulary_pads_the_tokenizer_with_reserved_special_tokens_in_every_file(tmp_path, monkeypatch):
    """``vocab="shape"``: a vocabulary larger than the default tokenizer's (Llama-3's 128256; here the tiny shape with
    40 more) gets reserved special tokens at the new ids, in the HF tokenizer and the GGUF's alike, so transformers,
    llama.cpp and minillm still tokenize identically; ordinary text tokenizes as before; the embedding and LM head
    have a row for every id, and the GGUF's blocks give minillm the HF model's logits there too."""
    from dataclasses import replace

    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minillm.models import synthetic
    from minillm.models.loader import load_model, load_tokenizer

    tiny = synthetic.shape_config("tiny")
    monkeypatch.setattr(synthetic, "shape_config", lambda name: replace(tiny, vocab_size=49192))
    out = tmp_path / "v"
    report = make_model("tiny", out, gguf=("q8_0",), dtype="float32", seed=3, vocab="shape")
    assert report["vocab_size"] == 49192 and json.loads((out / "config.json").read_text())["vocab_size"] == 49192
    hf_tok, default = AutoTokenizer.from_pretrained(out), load_tokenizer(None)
    assert len(hf_tok) == 49192
    text = "Hello world <|reserved_special_token_3|> again"
    ids = hf_tok(text).input_ids
    assert 49155 in ids and hf_tok.decode([49191]) == "<|reserved_special_token_39|>"
    assert hf_tok("Hello world").input_ids == default("Hello world").input_ids
    reader = GGUFReader(out / "tiny-Q8_0.gguf")
    tokens, types = reader.fields["tokenizer.ggml.tokens"].contents(), reader.fields["tokenizer.ggml.token_type"]
    assert len(tokens) == 49192 and tokens[49152] == "<|reserved_special_token_0|>"
    assert list(types.contents()[49152:]) == [synthetic.GGUF_CONTROL] * 40
    gguf_tok = load_tokenizer(out / "tiny-Q8_0.gguf")
    assert gguf_tok(text).input_ids == ids  # minillm's tokenizer from the GGUF's metadata
    big = torch.tensor([[1, 400, 49151, 49152, 49191]])  # ids past the default vocabulary
    pos = torch.arange(big.shape[1])[None]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    quant = load_model(out / "tiny-Q8_0.gguf", dtype="float32", device="cpu", quantization="int8")
    with torch.inference_mode():
        expected = hf(big).logits
        got = quant(big, pos)
    assert expected.shape[-1] == got.shape[-1] == 49192
    assert (got - expected).abs().max() < LOGIT_ERROR["q8_0"] * expected.abs().max()
