"""Sampling: exact top-k / top-p sets, seeded reproducibility, and parameter validation."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.engine.simple import generate
from minillm.models.loader import build_model
from minillm.sampling.sampler import probabilities, sample, top_k_mask, top_p_mask


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 2.5, 0.0]])
    kept = top_k_mask(logits, 3).isfinite()[0].tolist()
    assert kept == [False, True, False, True, True, False]


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()[None]
    # sorted: 0.5, 0.3 (sum 0.8), 0.1 (0.9), ...; p=0.75 keeps {0.5, 0.3}; p=0.85 also needs 0.1
    # (exactly p=0.8 is a float-rounding coin toss, so the test stays clear of it)
    assert top_p_mask(logits, 0.75).isfinite()[0].tolist() == [False, True, False, True, False]
    assert top_p_mask(logits, 0.85).isfinite()[0].tolist() == [False, True, True, True, False]
    assert top_p_mask(logits, 0.5).isfinite()[0].tolist() == [False, True, False, False, False]
    assert top_p_mask(logits, 0.01).isfinite()[0].tolist() == [False, True, False, False, False]


def test_top_k_then_top_p_renormalise():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0]).log()
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    # top-3 of (1,2,3,4)/10 -> (2,3,4)/9; nucleus 0.6: 4/9 = .44 < .6, + 3/9 -> keep {3, 4} -> (3/7, 4/7)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(1, 4)
    params = SamplingParams(temperature=0.7, top_k=3)
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample(logits, [params], [g])[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, probabilities(logits[0], params), atol=0.03, rtol=0)
    assert freq[0] == 0  # removed by top-k


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    alone = generate(tiny, [[1, 2, 3]], seeded)[0].output
    again = generate(tiny, [[1, 2, 3]], seeded)[0].output
    in_batch = generate(tiny, [[5, 6], [1, 2, 3]], [other, seeded])[1].output
    assert alone == again == in_batch
    assert generate(tiny, [[1, 2, 3]], other)[0].output != alone


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"), ({"n": 0}, "n"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_sampling_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n").stop == ("\n",)
