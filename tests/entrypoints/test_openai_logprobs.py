"""Logprobs, echo and the sampling extras through the OpenAI server, live on 127.0.0.1 with the default model,
driven by the ``openai`` SDK (streaming and not) and by lm-eval's ``local-completions`` client.

The numbers must be the engine's (checked against transformers in tests/engine/test_logprobs.py): a reference
``LLMEngine`` on the same model answers the same requests in this process."""

import json
import os

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_openai_server import LiveServer  # noqa: E402  (pytest puts this directory on sys.path)

from minillm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minillm.engine.inputs import chat_prompt_ids  # noqa: E402
from minillm.entrypoints.openai.server import build_app  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
TOL = 1e-4  # the server and the reference engine run the same kernels on the same rows


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.tokenizer


@pytest.fixture(scope="module")
def live(default_model, tokenizer):
    server = LiveServer(build_app(LLMEngine(default_model, tokenizer, EngineConfig(num_kv_blocks=256))))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ref(default_model, tokenizer):
    return LLMEngine(default_model, tokenizer, EngineConfig(num_kv_blocks=256))


def client(live):
    return live.client()


def test_completions_logprobs_in_openai_legacy_shape(live, ref, tokenizer):
    r = client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    want = ref.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want.text
    assert lp.tokens == [tokenizer.decode([t]) for t in want.token_ids]
    want_lps = [d[t].logprob for d, t in zip(want.logprobs, want.token_ids, strict=True)]
    assert lp.token_logprobs == pytest.approx(want_lps, abs=TOL)
    for top, d in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert 3 <= len(top) <= 4  # the top 3, and the sampled token when it is not among them
        assert top == pytest.approx({lp_.decoded_token: lp_.logprob for lp_ in d.values()}, abs=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_returns_the_prompt_and_its_logprobs_first_null(live, ref, tokenizer):
    ids = tokenizer.encode(PROMPT)
    for max_tokens in (1, 0):  # lm-eval's loglikelihood requests: max_tokens 1 (and 0 in some versions)
        r = client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                            logprobs=1, echo=True)
        want = ref.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1))[0]
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        prompt_lps = [d[t].logprob for d, t in zip(want.prompt_logprobs[1:], ids[1:], strict=True)]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(prompt_lps, abs=TOL)
        assert r.choices[0].text == PROMPT + (want.text if max_tokens else "")
        assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(ids)
    # echo without logprobs: the text only; token-id prompts echo their decoded text
    r = client(live).completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(tokenizer.decode(ids)) and r.choices[0].logprobs is None


def test_streamed_completion_chunks_carry_their_tokens_logprobs(live):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    whole = client(live).completions.create(**kw).choices[0].logprobs
    chunks = [c for c in client(live).completions.create(stream=True, **kw) if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert values == pytest.approx(whole.token_logprobs, abs=TOL)
    echoed = "".join(c.choices[0].text for c in client(live).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert echoed.startswith(PROMPT) and len(echoed) > len(PROMPT)


def test_chat_logprobs_and_top_logprobs_streamed_and_not(live, ref, tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    r = client(live).chat.completions.create(**kw)
    want = ref.generate([chat_prompt_ids(tokenizer, messages)],
                        SamplingParams(max_tokens=5, temperature=0, logprobs=2))[0]
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in want.token_ids]
    want_lps = [d[t].logprob for d, t in zip(want.logprobs, want.token_ids, strict=True)]
    assert [c.logprob for c in content] == pytest.approx(want_lps, abs=TOL)
    for c in content:  # greedy: the sampled token is the most likely, then the runner-up
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and c.top_logprobs[1].logprob <= c.logprob
        assert c.bytes == list(c.token.encode())
    streamed = [e for chunk in client(live).chat.completions.create(stream=True, **kw) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)
    plain = client(live).chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=False,
                                                 top_logprobs=0)  # the "off" values are accepted
    assert plain.choices[0].logprobs is None
    bare = client(live).chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True)
    assert all(c.top_logprobs == [] for c in bare.choices[0].logprobs.content)


@pytest.mark.parametrize("endpoint, kw, param", [
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(top_logprobs=3), "top_logprobs"),
    ("completions", dict(logprobs=6), "logprobs"),
    ("completions", dict(presence_penalty=3.0), "presence_penalty"),
    ("completions", dict(extra_body={"min_p": 2}), "min_p"),
    ("completions", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    ("completions", dict(logit_bias={"99999999": 1}), "logit_bias"),
    ("completions", dict(extra_body={"stop_token_ids": [10**9]}), "stop_token_ids"),
])
def test_out_of_range_values_are_400s_naming_the_field(live, endpoint, kw, param):
    c = client(live)
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kw)
        else:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param
    assert client(live).completions.create(model=MODEL, prompt="hi", max_tokens=1).choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kw", [
    dict(presence_penalty=1.5, frequency_penalty=1.0),
    dict(extra_body={"repetition_penalty": 1.8}),
    dict(extra_body={"min_p": 0.3}, temperature=1.0, seed=7),
    dict(extra_body={"min_tokens": 6}),
], ids=["presence+frequency", "repetition", "min_p", "min_tokens"])
def test_sampling_extras_give_the_engines_tokens(live, ref, tokenizer, kw, stream):
    kw = {"temperature": 0, **kw}
    extra = kw.pop("extra_body", {})
    params = SamplingParams(max_tokens=8, **kw, **extra)
    want = ref.generate([PROMPT], params)[0].text
    r = client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=stream, extra_body=extra,
                                        **kw)
    got = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert got == want
    if "penalty" in str(kw) + str(extra):  # the penalties change the greedy text (so the field was not ignored)
        assert got != ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_stop_token_ids_and_include_stop_str(live, ref, tokenizer, stream):
    forced = tokenizer.encode(" banana")[0]
    r = client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=stream,
                                        logit_bias={str(forced): 100})
    text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert text == tokenizer.decode([forced] * 3)
    greedy = ref.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    stop = greedy.token_ids[1]
    for include in (False, True):
        r = client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=stream,
                                            extra_body={"stop_token_ids": [stop],
                                                        "include_stop_str_in_output": include})
        if stream:
            chunks = [c for c in r if c.choices]
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            assert r.choices[0].model_extra["stop_reason"] == stop
        first = greedy.token_ids.index(stop)
        assert reason == "stop"
        assert text == tokenizer.decode(greedy.token_ids[: first + (1 if include else 0)])


def joined_logprobs(chunks) -> tuple[list, list, list]:
    """The streamed completion logprobs, concatenated: tokens, token_logprobs, text_offset."""
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    return ([t for lp in lps for t in lp.tokens], [v for lp in lps for v in lp.token_logprobs],
            [o for lp in lps for o in lp.text_offset])


@pytest.mark.parametrize("max_tokens", [3, 0])
def test_echo_with_logprobs_streams_the_prompt_and_its_logprobs_first_as_the_whole_response_has_them(
        live, tokenizer, max_tokens):
    """vLLM streams the echoed prompt (and, with logprobs, the prompt's, first null) in the first chunk, then the
    generated tokens; ``max_tokens=0``: the prompt alone, ``finish_reason "length"``, no completion tokens."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True)
    whole = client(live).completions.create(**kw).choices[0]
    chunks = list(client(live).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = [c for c in chunks if c.choices]
    assert texts[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in texts) == whole.text
    assert texts[-1].choices[0].finish_reason == whole.finish_reason == ("length" if max_tokens == 0 else "length")
    tokens, values, offsets = joined_logprobs(chunks)
    n_prompt = len(tokenizer.encode(PROMPT))
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert len(tokens) == n_prompt + max_tokens and values[0] is None
    assert values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOL)
    assert chunks[-1].usage.completion_tokens == max_tokens and chunks[-1].usage.prompt_tokens == n_prompt


def test_max_tokens_0_with_echo_streams_the_prompt_alone(live):
    chunks = [c for c in client(live).completions.create(model=MODEL, prompt=[PROMPT, "Hi"], max_tokens=0,
                                                         echo=True, stream=True) if c.choices]
    by_choice = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)}
    assert by_choice == {0: PROMPT, 1: "Hi"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length", "length"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_is_the_stop_string_that_ended_the_text_and_null_at_the_length_limit(live, ref, stream):
    greedy = ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop = greedy.text[3:5]
    want = greedy.text[: greedy.text.find(stop)]
    for kw, reason, text in ((dict(stop=[stop, "\x00never"]), stop, want), ({}, None, None)):
        r = client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=stream, extra_body={"ignore_eos": True}, **kw)
        last = [c for c in r if c.choices][-1].choices[0] if stream else r.choices[0]
        assert last.model_extra["stop_reason"] == reason and last.finish_reason == ("stop" if reason else "length")
        if text is not None and not stream:
            assert r.choices[0].text == text
    messages = [{"role": "user", "content": "Count to ten."}]
    plain = client(live).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].message.content
    stop = plain[2:4]
    r = client(live).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                             stop=[stop], stream=stream, extra_body={"ignore_eos": True})
    last = [c for c in r if c.choices][-1].choices[0] if stream else r.choices[0]
    assert last.model_extra["stop_reason"] == stop and last.finish_reason == "stop"


def test_no_stop_string_counts_before_min_tokens(live, ref):
    """The stop string occurs in the first tokens: with ``min_tokens`` past it the text runs on (vLLM skips every
    stop condition before ``min_tokens``), as the engine's own answer to the same parameters."""
    greedy = ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop = greedy.text[1:3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop], min_tokens=5)
    want = ref.generate([PROMPT], params)[0]
    r = client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True, "min_tokens": 5})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids) >= 5
    assert len(want.text) > greedy.text.find(stop)


# ---- lm-eval: local-completions against this server == the hf backend on the same weights ----------------------
DOCS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "100 degrees Celsius", "50 degrees", "-40"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Two plus two equals", ["three", "five", "four", "twenty-two"], 2),
    ("The opposite of hot is", ["cold", "warm", "blue", "fast"], 0),
    ("A baby cat is called a", ["puppy", "calf", "kitten", "foal"], 2),
    ("The sun rises in the", ["west", "east", "north", "basement"], 1),
    ("Bees make", ["milk", "honey", "silk", "bread"], 1),
    ("The first letter of the English alphabet is", ["Z", "M", "A", "Q"], 2),
    ("Ice is the solid form of", ["water", "air", "iron", "sand"], 0),
]
TASK = """task: minillm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_local_completions_equals_the_hf_backend(live, default_model_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (the dev extra installs it)")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (the dev extra installs it)")
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # local files only
        monkeypatch.setenv(var, "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path))

    def scores(model: str, args: str) -> dict:
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["minillm_tiny_mc"], task_manager=tasks,
                                      batch_size=1, limit=None, log_samples=False, bootstrap_iters=0)
        return {k: v for k, v in out["results"]["minillm_tiny_mc"].items() if k in ("acc,none", "acc_norm,none")}

    served = scores("local-completions", f"base_url={live.url}/v1/completions,model={MODEL},"
                    f"tokenizer={default_model_dir},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    hf = scores("hf", f"pretrained={default_model_dir},dtype=float32,device=cpu")
    assert set(served) == {"acc,none", "acc_norm,none"}
    assert served == hf, (served, hf)
    assert 0.5 <= served["acc,none"] <= 1.0  # the model knows most of these: the scores are not a constant
    assert os.environ["HF_HUB_OFFLINE"] == "1"
