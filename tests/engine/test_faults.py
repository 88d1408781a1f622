"""Faults never corrupt the engine: a failing request fails alone, tiny temperatures are safe, threads
never mix outputs, ids are unambiguous, odd inputs get clear errors.

Every test ends with ``assert_healthy``: no live requests, no used KV blocks, and the same greedy output as a fresh
engine.  A tiny random Llama keeps this fast.
"""

import dataclasses
import random
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.engine.inputs import validate_messages
from minillm.engine.llm_engine import AUTO_ID_PREFIX
from minillm.engine.simple import generate
from minillm.kv.paged_cache import kv_bytes_per_block
from minillm.models.loader import build_model
from minillm.sampling.params import MIN_TEMPERATURE
from minillm.sampling.sampler import probabilities, sample, sample_seed

V = 128
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROBE = [[3, 1, 4, 1, 5], [9, 2, 6]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


@pytest.fixture(scope="module")
def fresh_probe(model):
    return [o.token_ids for o in new_engine(model).generate(PROBE, GREEDY)]


def new_engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(**{"block_size": 4, "max_num_seqs": 8,
                                                   "max_num_batched_tokens": 32, **kw}))


def assert_healthy(eng: LLMEngine, fresh_probe) -> None:
    assert eng.num_live_requests == 0 and not eng.has_unfinished_requests()
    assert eng.block_manager.device.num_used == 0
    assert [o.token_ids for o in eng.generate(PROBE, GREEDY)] == fresh_probe
    assert eng.block_manager.device.num_used == 0


def prompts_of(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(rng.randint(2, 16))] for _ in range(count)]


def poison(eng: LLMEngine, bad: str, after_tokens: int = 0, after_sampling: bool = False) -> None:
    """Make every step that includes request ``bad`` raise, once it has ``after_tokens`` output tokens: before the
    forward, or (``after_sampling``) once every row has been sampled — the seeded generators have then advanced."""
    real = eng.runner.run

    def run(out, return_logits=False):
        hit = any(s.seq.request.request_id == bad and len(s.seq.output) >= after_tokens for s in out.scheduled)
        if hit and not after_sampling:
            raise RuntimeError("injected fault")
        result = real(out, return_logits)
        if hit:
            raise RuntimeError("injected fault")
        return result

    eng.runner.run = run


# ---- 1. a failing request fails alone ------------------------------------------------------------------------------
@pytest.mark.parametrize("after_sampling", [False, True])
@pytest.mark.parametrize("after_tokens", [0, 3])
def test_a_request_whose_forward_raises_ends_with_error_and_the_others_finish(model, fresh_probe, after_tokens,
                                                                                after_sampling):
    prompts = prompts_of(0, 4)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    params = [GREEDY, seeded, GREEDY, seeded]
    want = new_engine(model).generate(prompts[:3], params[:3])
    eng = new_engine(model)
    rids = [eng.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    poison(eng, "r3", after_tokens, after_sampling)
    while eng.has_unfinished_requests():
        eng.step()
    outs = [eng.pop_output(r) for r in rids]
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in want]  # seeded RNGs rewound: unchanged
    bad = outs[3]
    assert bad.finish_reason == "error" and "injected fault" in bad.error and len(bad.token_ids) == after_tokens
    eng.runner.run = type(eng.runner).run.__get__(eng.runner)
    assert_healthy(eng, fresh_probe)


def test_generate_returns_the_failed_request_as_error_and_its_neighbours_whole(model, fresh_probe):
    eng = new_engine(model)
    real = eng.runner.run

    def run(out, return_logits=False):  # the request with prompt [7, 7, 7] cannot run
        if any(s.seq.request.prompt_token_ids == [7, 7, 7] for s in out.scheduled):
            raise ValueError("bad row")
        return real(out, return_logits)

    eng.runner.run = run
    outs = eng.generate([PROBE[0], [7, 7, 7], PROBE[1]], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert [outs[0].token_ids, outs[2].token_ids] == fresh_probe and "bad row" in outs[1].error
    assert_healthy(eng, fresh_probe)


def test_a_token_the_tokenizer_cannot_decode_fails_only_its_request(model, fresh_probe):
    probe_tokens = {t for ids in fresh_probe for t in ids}
    victim = next(p for p in prompts_of(3, 20) if generate(model, [p], GREEDY)[0].output[0] not in probe_tokens)
    bad = generate(model, [victim], GREEDY)[0].output[0]

    class Picky:
        eos_token_id = None

        def __call__(self, text, add_special_tokens=True):
            return type("E", (), {"input_ids": [ord(c) % V for c in text]})()

        def decode(self, ids, skip_special_tokens=True):
            if bad in ids:
                raise UnicodeDecodeError("utf-8", b"", 0, 1, "injected")
            return "x" * len(ids)

    eng = LLMEngine(model, Picky(), EngineConfig(block_size=4))
    outs = eng.generate([PROBE[0], victim, PROBE[1]], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"] and "injected" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == fresh_probe
    assert_healthy(eng, fresh_probe)


def test_an_interrupt_inside_generate_aborts_its_requests_and_frees_their_blocks(model, fresh_probe):
    eng = new_engine(model)
    real, calls = eng.runner.run, [0]

    def run(out, return_logits=False):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(out, return_logits)

    eng.runner.run = run
    with pytest.raises(KeyboardInterrupt):
        eng.generate(prompts_of(1, 3), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert eng.num_live_requests == 0 and eng.block_manager.device.num_used == 0
    assert_healthy(eng, fresh_probe)


def test_a_stream_whose_consumer_raises_aborts_its_requests(model, fresh_probe):
    eng = new_engine(model)
    with pytest.raises(RuntimeError, match="consumer"):
        for i, _ in enumerate(eng.stream(prompts_of(2, 3), SamplingParams(max_tokens=30, temperature=0))):
            if i == 4:
                raise RuntimeError("consumer gave up")
    assert_healthy(eng, fresh_probe)


# ---- 2. numerically unsafe sampling ----------------------------------------------------------------------------------
TINY_TEMPERATURES = [sys.float_info.min * sys.float_info.epsilon, sys.float_info.min, 1e-300, 1e-45, 1e-38, 1e-10,
                     MIN_TEMPERATURE / 2]


@pytest.mark.parametrize("t", TINY_TEMPERATURES + [MIN_TEMPERATURE, 1e-4, 0.01, 1.0, 100.0, 1e300])
def test_any_valid_temperature_gives_a_finite_distribution(t):
    logits = torch.tensor([[1e4, -1e4, 3.0, 2.9, float("-inf")], [0.0, 0.0, 0.0, 1e-3, -1.0]])
    params = SamplingParams(temperature=t)
    probs = probabilities(logits, params)
    assert probs.isfinite().all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert probs[0, 4] == 0
    g = torch.Generator().manual_seed(0)
    tokens = sample(logits, [params, params], [g, g])
    if t < MIN_TEMPERATURE:
        assert params.greedy and tokens == [0, 3]


def test_tiny_temperatures_generate_the_greedy_tokens(model, fresh_probe):
    eng = new_engine(model)
    for t in TINY_TEMPERATURES:
        params = dataclasses.replace(GREEDY, temperature=t, seed=5)
        assert [o.token_ids for o in eng.generate(PROBE, params)] == fresh_probe
    assert_healthy(eng, fresh_probe)


# ---- 3. concurrency ------------------------------------------------------------------------------------------------
def test_two_threads_generating_on_one_engine_each_get_their_own_outputs(model, fresh_probe):
    eng = new_engine(model)
    work = {k: prompts_of(10 + k, 4) for k in range(3)}
    want = {k: [o.token_ids for o in new_engine(model).generate(ps, GREEDY)] for k, ps in work.items()}
    got, errors = {}, []

    def worker(k):
        try:
            got[k] = [(o.prompt_token_ids, o.token_ids) for o in eng.generate(work[k], GREEDY)]
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for k in work:
        assert [p for p, _ in got[k]] == work[k] and [t for _, t in got[k]] == want[k]
    assert_healthy(eng, fresh_probe)


def test_add_and_abort_from_other_threads_while_one_thread_steps(model, fresh_probe):
    eng = new_engine(model)
    prompts = prompts_of(20, 24)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, new_engine(model).generate(prompts, GREEDY), strict=True)}
    stop, added, aborted, errors = threading.Event(), {}, set(), []

    def stepper():
        while not stop.is_set() or eng.has_unfinished_requests():
            eng.step()

    def client(k):
        rng = random.Random(k)
        try:
            for i, p in enumerate(prompts[k::4]):
                rid = eng.add_request(p, GREEDY, request_id=f"c{k}-{i}")
                added[rid] = p
                if rng.random() < 0.3:
                    try:
                        eng.abort(rid)
                        aborted.add(rid)
                    except KeyError:
                        pass  # already finished: fine
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    loop = threading.Thread(target=stepper)
    loop.start()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(60)
    stop.set()
    loop.join(60)
    assert not errors and len(added) == 24
    for rid, p in added.items():
        out = eng.pop_output(rid)
        assert out.prompt_token_ids == p
        if rid in aborted:
            assert out.finish_reason in ("abort", "length") and out.token_ids == want[tuple(p)][: len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == want[tuple(p)]
    assert_healthy(eng, fresh_probe)


# ---- 4. ids --------------------------------------------------------------------------------------------------------
def test_ids_are_strings_user_and_automatic_ids_never_collide_and_stay_busy_until_popped(model, fresh_probe):
    eng = new_engine(model)
    assert eng.add_request(PROBE[0], GREEDY, request_id=5) == "5"
    auto = eng.add_request(PROBE[1], GREEDY)
    assert auto.startswith(AUTO_ID_PREFIX)
    with pytest.raises(ValueError, match="engine's own"):
        eng.add_request(PROBE[1], GREEDY, request_id=auto)
    with pytest.raises(ValueError, match="request_id must be a string or an int"):
        eng.add_request(PROBE[1], GREEDY, request_id=1.5)
    while eng.has_unfinished_requests():
        eng.step()
    with pytest.raises(ValueError, match="already in use .* until its output is popped"):
        eng.add_request(PROBE[1], GREEDY, request_id="5")  # finished, not yet popped
    assert eng.pop_output(5).token_ids == fresh_probe[0]
    assert eng.pop_output(auto).token_ids == fresh_probe[1]
    eng.add_request(PROBE[0], GREEDY, request_id="5")  # free again
    eng.abort(5)
    assert eng.pop_output("5").finish_reason == "abort"
    assert_healthy(eng, fresh_probe)


# ---- 5. inputs -----------------------------------------------------------------------------------------------------
def test_numpy_and_tensor_prompts_are_accepted_where_a_list_of_ints_is(model, fresh_probe):
    eng = new_engine(model)
    forms = [np.array(PROBE[0]), torch.tensor(PROBE[0]), [np.int64(t) for t in PROBE[0]], tuple(PROBE[0])]
    for form in forms:
        assert eng.generate(form, GREEDY)[0].token_ids == fresh_probe[0]
    batch = np.array([PROBE[0][:3], PROBE[1]])  # a 2-d array is a batch of prompts
    assert len(eng.generate(batch, GREEDY)) == 2
    assert_healthy(eng, fresh_probe)


@pytest.mark.parametrize("prompt, match", [
    (torch.tensor(5), "0-d"), (np.array(5), "0-d"), (b"hello", "bytes"), (None, "prompt must be"),
    ([1.5, 2.0], "int token ids"), (torch.tensor([1.0, 2.0]), "int token ids"), ([True, 2], "int token ids"),
    ("hello", "tokenizer"), ([], "no prompts"), ([[1, 2], []], "empty")])
def test_bad_prompts_raise_value_error_naming_the_problem(model, fresh_probe, prompt, match):
    eng = new_engine(model)
    with pytest.raises(ValueError, match=match):
        eng.generate(prompt, GREEDY)
    with pytest.raises(ValueError, match=match):
        list(eng.stream(prompt, GREEDY))
    assert_healthy(eng, fresh_probe)


def test_sampling_params_accept_none_stop_generators_and_numpy_numbers():
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=(s for s in ["a", "bc"])).stop == ("a", "bc")
    p = SamplingParams(top_p=np.float32(0.5), temperature=np.float64(0.7), max_tokens=np.int32(3), seed=np.int64(4))
    assert (p.top_p, p.temperature, p.max_tokens, p.seed) == (0.5, pytest.approx(0.7), 3, 4)
    assert type(p.max_tokens) is int and type(p.top_p) is float
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=["ok", 3])


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string"),
    ([{"role": "user", "content": 5}], "must be a string, got int"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "got list"),
    ([{"role": 1, "content": "hi"}], r"\['role'\] must be a string"),
    ([], "empty"), ("hello", "list of"), ([{"content": "hi"}], r"messages\[0\] must be")])
def test_chat_messages_with_non_string_parts_are_rejected(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


# ---- 6. defaults ---------------------------------------------------------------------------------------------------
def test_the_default_kv_budget_always_holds_one_full_context_request(monkeypatch, model, fresh_probe):
    import minillm.config as config

    block = kv_bytes_per_block(model.config, 4, model.dtype)
    monkeypatch.setattr(config, "DEFAULT_KV_CACHE_BYTES", 8 * block)  # a cap of 8 blocks of 4 tokens = 32 tokens
    eng = new_engine(model)
    assert eng.block_manager.device.num_blocks * 4 >= eng.max_model_len == 128
    out = eng.generate([[1] * 100], SamplingParams(max_tokens=27, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 27 and out.finish_reason == "length"
    assert_healthy(eng, fresh_probe)


def test_per_sample_seeds_never_repeat_another_requests_seed(model, fresh_probe):
    seeds = {sample_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500
    assert all(sample_seed(s, 0) == s for s in range(50))
    eng = new_engine(model)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    three = eng.generate([PROBE[0]], dataclasses.replace(params, n=3, seed=0))[0]
    next_seed = eng.generate([PROBE[0]], dataclasses.replace(params, seed=1))[0]
    assert three.outputs[1].token_ids != next_seed.token_ids
    assert three.outputs[0].token_ids == generate(model, [PROBE[0]], dataclasses.replace(params, seed=0))[0].output
    assert_healthy(eng, fresh_probe)


# ---- property: threads interleaving add / abort / failing requests while one thread steps ---------------------------
OP = st.tuples(st.sampled_from(["add", "bad", "abort"]), st.integers(0, 5), st.integers(1, 8))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scripts=st.lists(st.lists(OP, min_size=1, max_size=6), min_size=1, max_size=3))
def test_interleaved_adds_aborts_and_failures_from_threads_keep_the_engine_whole(model, fresh_probe, scripts):
    eng = new_engine(model, num_kv_blocks=24)  # small: preemption happens too
    real = eng.runner.run

    def run(out, return_logits=False):  # every forward that includes a request whose id starts with "bad" fails
        if any(s.seq.request.request_id.startswith("bad") for s in out.scheduled):
            raise RuntimeError("injected fault")
        return real(out, return_logits)

    eng.runner.run = run
    prompts = prompts_of(30, 6)
    added: dict[str, tuple[list[int], int]] = {}
    errors, stop = [], threading.Event()

    def client(k, script):
        try:
            for i, (op, which, max_tokens) in enumerate(script):
                rid = f"{'bad' if op == 'bad' else 'ok'}-{k}-{i}"
                eng.add_request(prompts[which], dataclasses.replace(GREEDY, max_tokens=max_tokens), request_id=rid)
                added[rid] = (prompts[which], max_tokens)
                if op == "abort":
                    try:
                        eng.abort(rid)
                    except KeyError:
                        pass  # finished first
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def stepper():
        while not stop.is_set() or eng.has_unfinished_requests():
            eng.step()

    loop = threading.Thread(target=stepper)
    loop.start()
    clients = [threading.Thread(target=client, args=(k, s)) for k, s in enumerate(scripts)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(60)
    stop.set()
    loop.join(120)
    assert not errors and not loop.is_alive()
    for rid, (prompt, max_tokens) in added.items():
        out = eng.pop_output(rid)  # every request ended exactly once ...
        with pytest.raises(KeyError):
            eng.pop_output(rid)  # ... and is handed over once
        want = generate(model, [prompt], dataclasses.replace(GREEDY, max_tokens=max_tokens))[0].output
        assert out.prompt_token_ids == prompt
        if rid.startswith("bad"):
            assert out.finish_reason in ("error", "abort") and out.token_ids == []
        else:
            assert out.token_ids == want[: len(out.token_ids)]
            assert out.finish_reason in ("length", "abort") and (out.finish_reason == "abort" or out.token_ids == want)
    eng.runner.run = real
    assert_healthy(eng, fresh_probe)


@pytest.mark.slow
def test_the_default_llm_applies_the_same_limits_to_stream_generate_and_chat():
    from minillm import LLM

    llm = LLM(dtype="float32", device="cpu", max_model_len=256, kv_cache_bytes=64 << 20)
    long = list(range(1000, 1300))
    for call in (llm.generate, lambda p: list(llm.stream(p))):
        with pytest.raises(ValueError, match="300 tokens but the model's context is 256"):
            call([long])
    for content in (None, 5, [{"type": "text", "text": "hi"}]):
        with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] must be a string"):
            llm.chat([{"role": "user", "content": content}])
    text = "".join(u.text for u in llm.stream(np.array(llm.encode("The capital of France is")), GREEDY))
    assert text == llm.generate("The capital of France is", GREEDY)[0].text and text
    assert llm.engine.num_live_requests == 0 and llm.engine.block_manager.device.num_used == 0
