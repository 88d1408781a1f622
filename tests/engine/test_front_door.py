"""One front door: the engine, the simple cached loop and the naive loop agree; ``stream`` is ``generate`` in pieces.

A tiny random Llama keeps this fast; ``LetterTokenizer`` (token i is a letter) gives text without a download.
"""

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.engine.simple import generate, stream_cached, stream_naive
from minillm.models.loader import build_model
from minillm.outputs import StepOutput

V = 128


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


class LetterTokenizer:
    """Token i is the letter chr(97 + i % 26)."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[ord(c) - 97 for c in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def workload(seed=0, count=6):
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(2, 20))] for _ in range(count)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def test_engine_cached_loop_and_naive_loop_give_the_same_greedy_tokens(model):
    prompts, params = workload()
    naive = [s.output for s in generate(model, prompts, params, cached=False)]
    cached = [s.output for s in generate(model, prompts, params, cached=True)]
    engine = LLMEngine(model, config=EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=16))
    assert [o.token_ids for o in engine.generate(prompts, params)] == cached == naive
    assert all(len(t) == p.max_tokens for t, p in zip(naive, params, strict=True))


@pytest.mark.parametrize("loop", [stream_cached, stream_naive])
def test_simple_loops_yield_step_outputs_and_return_their_final_states(model, loop):
    prompts, params = workload(seed=2, count=3)
    updates = []
    gen = loop(model, prompts, params)
    while True:
        try:
            updates.append(next(gen))
        except StopIteration as done:
            states = done.value
            break
    assert all(isinstance(u, StepOutput) for u in updates)
    for i, state in enumerate(states):
        mine = [u for u in updates if u.request_id == str(i)]
        assert [t for u in mine for t in u.token_ids] == state.output
        assert mine[-1].finish_reason == state.finish_reason == "length"
        assert mine[-1].metrics is state.metrics and not any(u.finished for u in mine[:-1])


def test_stream_deltas_concatenate_to_generate_text_and_leave_nothing_behind(model):
    eng = LLMEngine(model, LetterTokenizer(), EngineConfig(block_size=4))
    prompts = ["hello", "abc", [1, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    texts, tokens, order = {}, {}, []
    for u in eng.stream(prompts, params):
        if u.request_id not in texts:
            order.append(u.request_id)
        texts[u.request_id] = texts.get(u.request_id, "") + u.text
        tokens[u.request_id] = tokens.get(u.request_id, []) + u.token_ids
    outs = eng.generate(prompts, params)
    assert sorted(order) == sorted(texts) and len(order) == 3
    by_tokens = {tuple(v): texts[k] for k, v in tokens.items()}
    assert [by_tokens[tuple(o.token_ids)] for o in outs] == [o.text for o in outs]
    assert all(len(o.text) == 10 for o in outs)
    assert eng.num_live_requests == 0 and eng.block_manager.device.num_used == 0


def test_closing_a_stream_early_aborts_its_requests_and_frees_their_blocks(model):
    eng = LLMEngine(model, config=EngineConfig(block_size=4))
    prompts, _ = workload(seed=3, count=4)
    stream = eng.stream(prompts, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    first = [next(stream) for _ in range(5)]
    assert eng.num_live_requests == 4 and eng.block_manager.device.num_used > 0
    stream.close()
    assert eng.num_live_requests == 0 and eng.block_manager.device.num_used == 0
    assert not eng.has_unfinished_requests()
    with pytest.raises(KeyError):
        eng.pop_output(first[0].request_id)  # the stream's outputs were dropped: the ids are free again


def test_stream_limits_equal_generate_limits(model):
    eng = LLMEngine(model, config=EngineConfig(block_size=4, max_model_len=32))
    too_long = list(range(40))
    for call in (eng.generate, lambda p: list(eng.stream(p))):
        with pytest.raises(ValueError, match="context is 32 tokens"):
            call([too_long])
    assert eng.num_live_requests == 0


def test_prompt_plus_max_tokens_over_the_context_is_cut_at_the_context_as_in_vllms_offline_llm(model):
    # (the OpenAI server refuses such a request up front with a 400; the Python API runs it to the context)
    eng = LLMEngine(model, config=EngineConfig(block_size=4, max_model_len=32))
    out = eng.generate([list(range(28))], SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
