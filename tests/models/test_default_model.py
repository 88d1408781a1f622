"""The embedded default model (SmolLM2-135M-Instruct, dequantized Q4_1) against transformers on the same weights."""

import pytest
import torch

from minillm import SamplingParams
from minillm.engine.simple import generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_default(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def test_default_model_is_smollm2_135m(default_model):
    c = default_model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings
    assert 134e6 < c.num_parameters() < 136e6


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_default_model_logits_match_transformers(default_model, hf_default, llm, kernels):
    ids = torch.tensor([llm.encode("The roofline model says that decoding one token at a time is")])
    default_model.set_kernels(kernels)
    try:
        with torch.no_grad():
            got = default_model(ids, torch.arange(ids.shape[1])[None])
    finally:
        default_model.set_kernels("auto")
    want = hf_default(ids).logits
    if kernels == "torch":  # the same ATen ops as transformers: fp32's default tolerance
        torch.testing.assert_close(got, want)
    else:  # the native kernels (these 13 rows go through them) sum each K-long dot product in another order:
        # ~sqrt(K)·eps relative per layer, compounded over 30 layers — ~1e-5 of the logits' scale (|logit| ~ 20)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-5)


def test_default_model_64_greedy_tokens_equal_transformers(default_model, hf_default, llm):
    prompt = llm.apply_chat_template([{"role": "user", "content": "Write a haiku about memory bandwidth."}])
    got = generate(default_model, [prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].output
    # transformers' greedy choice after every prefix of ours, from one forward pass (teacher forcing): equal to
    # ours at all 64 steps exactly when its greedy loop would produce our 64 tokens, at 1/64 of its decode time
    with torch.no_grad():
        logits = hf_default(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == got


def test_chat_answers_and_reports_metrics(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    m = out.metrics
    assert m.prompt_tokens == len(out.prompt_token_ids) and m.output_tokens == len(out.token_ids)
    assert 0 < m.ttft_s < m.latency_s and m.tpot_s > 0


def test_strings_and_token_ids_give_the_same_output(llm):
    params = SamplingParams(max_tokens=8, temperature=0)
    ids = llm.encode("Once upon a time")
    a, b = llm.generate(["Once upon a time", ids], params)
    assert a.token_ids == b.token_ids and a.prompt_token_ids == ids
