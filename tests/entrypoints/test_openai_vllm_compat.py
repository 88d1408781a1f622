"""vLLM's request semantics on the live server, driven by the ``openai`` SDK: unknown fields ignored (logged once,
listed in ``X-Ignored-Fields``), OpenAI's "off" values accepted, ``continuous_usage_stats``, the context rules
(400 ``context_length_exceeded``), the tokenizer endpoints and vLLM's metric names.  The same tiny random Llama
with the default model's tokenizer as ``test_openai_server.py``."""

import logging
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from test_openai_server import CONTEXT, MODEL, LiveServer, metric, tiny_hf_model  # noqa: E402

from minillm import EngineConfig, LLMEngine, ModelConfig  # noqa: E402
from minillm.engine.inputs import chat_prompt_ids  # noqa: E402
from minillm.entrypoints.openai.server import build_app  # noqa: E402
from minillm.models.loader import build_model, load_tokenizer  # noqa: E402

CHAT = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def live(tokenizer):
    import torch

    hf = tiny_hf_model()
    model = build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.float32, device="cpu")
    server = LiveServer(build_app(LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4)), max_queue=16))
    yield server
    server.stop()


def chat(live, **kw):
    return live.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=kw.pop("max_tokens", 2), temperature=0, **kw)


# ---- unknown fields -------------------------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_listed_in_a_header_and_logged_once_per_name(live, caplog):
    from minillm.entrypoints.openai.compat import FieldWarnings

    live.app.state.server.field_warnings = FieldWarnings()  # test hook: forget what earlier tests sent
    # the current SDK's own parameters, and a typo sent as an extra field
    sdk = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low"}
    names = [*sdk, "temprature"]
    with caplog.at_level(logging.WARNING, logger="minillm.serve"):
        for _ in range(2):
            raw = chat(live, **sdk, extra_body={"temprature": 0.5})
            assert raw.parse().usage.completion_tokens <= 2
            assert raw.headers["x-ignored-fields"] == ", ".join(sorted(names))
    warned = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert sorted(warned) == sorted(f"ignoring the unknown request field '{n}' (listed in the X-Ignored-Fields "
                                    "response header; logged once)" for n in names)  # two requests, one each
    raw = live.client().completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=1,
                                                             extra_body={"store": True})
    assert raw.headers["x-ignored-fields"] == "store"
    assert "x-ignored-fields" not in chat(live).headers  # nothing ignored: no header


def test_unknown_field_names_no_header_can_carry_are_escaped_cut_and_counted(live):
    raw = chat(live, extra_body={"\U00034117": 1, "a\r\nSet-Cookie: x": 1, "k" * 500: 1})
    assert raw.parse().choices and "set-cookie" not in raw.headers
    assert set(raw.headers["x-ignored-fields"].split(", ")) == {"\\U00034117", "a\\r\\nSet-Cookie: x",
                                                                "k" * 61 + "..."}  # escaped; 500 chars cut to 64
    raw = chat(live, extra_body={f"f{i:02d}": i for i in range(20)})
    assert raw.headers["x-ignored-fields"] == ", ".join(f"f{i:02d}" for i in range(16)) + ", +4 more"


def test_unknown_fields_of_a_streamed_request_and_inside_stream_options_are_listed(live):
    with live.client().chat.completions.with_streaming_response.create(
            model=MODEL, messages=CHAT, max_tokens=2, stream=True,
            stream_options={"include_usage": True, "shiny": 1}, extra_body={"store": True}) as r:
        assert r.headers["x-ignored-fields"] == "store, stream_options.shiny"
        assert "data: [DONE]" in list(r.iter_lines())


@pytest.mark.parametrize("off", [
    {"logprobs": False}, {"top_logprobs": 0}, {"tools": []}, {"tool_choice": "none"},
    {"parallel_tool_calls": False}, {"response_format": {"type": "text"}}, {"n": 2, "best_of": 2},
    {"presence_penalty": 0}, {"logit_bias": {}}, {"logprobs": False, "top_logprobs": 0}])
def test_openai_off_values_are_accepted(live, off):
    r = chat(live, extra_body=off).parse()
    assert len(r.choices) == off.get("n", 1) and r.usage.completion_tokens <= 2 * off.get("n", 1)


def test_best_of_one_on_completions_is_accepted_and_over_n_is_a_400(live):
    r = live.client().completions.create(model=MODEL, prompt="hi", max_tokens=1, best_of=1)
    assert len(r.choices) == 1
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt="hi", max_tokens=1, best_of=3)
    assert e.value.body["param"] == "best_of"


@pytest.mark.parametrize("on", [{"functions": [{"name": "f", "parameters": {"type": "object"}}]},
                                {"function_call": "auto"}])
def test_values_the_engine_cannot_honour_stay_400s_naming_the_field(live, on):
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, extra_body=on)
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] in on


@pytest.mark.parametrize("extra", [{"use_beam_search": True}, {"allowed_token_ids": [1, 2]},
                                   {"bad_words": ["x"]}, {"length_penalty": 0.5}])
def test_vllm_extensions_not_implemented_yet_are_400s_not_ignored(live, extra):
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, extra_body=extra)
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] in extra


def test_vllm_extensions_at_their_off_values_are_accepted_and_not_listed_as_ignored(live):
    raw = chat(live, extra_body={"min_p": 0, "repetition_penalty": 1.0, "guided_json": None, "stop_token_ids": []})
    assert raw.parse().choices and "x-ignored-fields" not in raw.headers


# ---- streaming usage ------------------------------------------------------------------------------------------------
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(live):
    chunks = list(live.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[0].usage.prompt_tokens
    assert prompt > 0 and all(c.usage.prompt_tokens == prompt for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 5  # the role chunk, then growing
    assert chunks[-1].choices == [] and all(c.usage.total_tokens == prompt + c.usage.completion_tokens
                                            for c in chunks)
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert with_text and with_text[-1].usage.completion_tokens >= 1


def test_continuous_usage_stats_counts_each_choice_on_its_own_with_n_and_several_prompts(live, tokenizer):
    """vLLM's per-choice usage: a chunk of choice i carries the prompt tokens of i's prompt and the tokens i has
    generated so far; the last usage chunk counts every choice.  Every choice gets its finishing chunk, also when
    samples of one request finish in the same step."""
    prompts = ["Once upon a time", "Hi"]
    chunks = list(live.client().completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=1, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for i in range(4):
        mine = [c.usage for c in chunks if c.choices and c.choices[0].index == i]
        counts = [u.completion_tokens for u in mine]
        assert mine and counts == sorted(counts) and counts[-1] == 4
        assert all(u.prompt_tokens == len(tokenizer.encode(prompts[i // 2])) for u in mine)
    assert chunks[-1].usage.completion_tokens == 16


def test_continuous_usage_stats_without_include_usage_adds_nothing_as_in_vllm(live):
    chunks = list(live.client().completions.create(
        model=MODEL, prompt="Once", max_tokens=3, stream=True, extra_body={"ignore_eos": True},
        stream_options={"continuous_usage_stats": True}))
    assert chunks and all(c.usage is None for c in chunks)


# ---- the context ---------------------------------------------------------------------------------------------------
def test_a_prompt_over_the_context_is_a_bad_request_with_code_context_length_exceeded(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt=list(range(5, 5 + CONTEXT)), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    assert f"maximum context length is {CONTEXT} tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # max_tokens omitted: only the prompt is checked
        live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * CONTEXT}])
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"


@pytest.mark.parametrize("max_tokens", [CONTEXT, 10**12])
def test_prompt_plus_max_tokens_over_the_context_is_a_bad_request_with_vllms_message(live, tokenizer, max_tokens):
    n = len(chat_prompt_ids(tokenizer, CHAT))
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=max_tokens)
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["message"].startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested {n + max_tokens} tokens "
        f"({n} in the messages, {max_tokens} in the completion).")
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=max_tokens, stream=True)
    assert e.value.body["code"] == "context_length_exceeded"


def test_max_tokens_exactly_filling_the_context_runs_to_it(live):
    r = live.client().completions.create(model=MODEL, prompt=list(range(5, 5 + CONTEXT - 3)), max_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_max_tokens_omitted_or_null_runs_to_the_end_of_the_context(live):
    prompt = list(range(5, 5 + CONTEXT - 4))
    r = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=None, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    r = live.client().completions.create(model=MODEL, prompt=[1, 2], extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16  # completions' default, OpenAI's and vLLM's
    long = [{"role": "user", "content": "word " * (CONTEXT - 40)}]
    r = live.client().chat.completions.create(model=MODEL, messages=long, extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == CONTEXT and r.choices[0].finish_reason == "length"


# ---- tokenizer endpoints, /version ----------------------------------------------------------------------------------
def test_tokenize_a_prompt_counts_what_the_completions_endpoint_counts(live, tokenizer):
    prompt = "The capital of France is"
    r = httpx.post(live.url + "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer(prompt).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONTEXT and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    used = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert used == body["count"]


def test_tokenize_messages_counts_what_the_chat_endpoint_counts(live, tokenizer):
    r = httpx.post(live.url + "/tokenize", json={"messages": CHAT}).json()
    assert r["tokens"] == chat_prompt_ids(tokenizer, CHAT) and r.get("token_strs") is None
    assert r["count"] == live.client().chat.completions.create(model=MODEL, messages=CHAT,
                                                               max_tokens=1).usage.prompt_tokens
    bare = httpx.post(live.url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat_prompt_ids(tokenizer, CHAT, add_generation_prompt=False)
    assert bare["count"] < r["count"] and r["tokens"][:bare["count"]] == bare["tokens"]


def test_detokenize_round_trips_tokenize(live):
    text = "Hello, world! Ünïcode too."
    ids = httpx.post(live.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert httpx.post(live.url + "/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 49152, -3]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "prompt": "b"}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"messages": "hi"}, "messages"),
])
def test_bad_tokenizer_requests_are_400s_with_openai_bodies(live, path, body, param):
    r = httpx.post(live.url + path, json=body)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == param
    if param == "tokens" and isinstance(body["tokens"], list):
        assert "[49152, -3]" in r.json()["error"]["message"]


def test_tokenize_with_an_unknown_model_is_a_404(live):
    r = httpx.post(live.url + "/tokenize", json={"model": "gpt-5", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_without_a_tokenizer_the_tokenizer_endpoints_are_400s(live):
    engine = live.app.state.server.loop.engine
    server = LiveServer(build_app(LLMEngine(engine.model, None, EngineConfig(max_num_seqs=1))))
    try:
        for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
            r = httpx.post(server.url + path, json=body)
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/tokenizer_info").status_code == 400
    finally:
        server.stop()


def test_version_and_tokenizer_info(live, tokenizer):
    from minillm import __version__

    assert httpx.get(live.url + "/version").json() == {"version": __version__}
    info = httpx.get(live.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["model_max_length"] == CONTEXT
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert not any(k.endswith("_file") for k in info)


# ---- vLLM's metric names --------------------------------------------------------------------------------------------
VLLM_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
               "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
               "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
               "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
               "vllm:request_queue_time_seconds_count", "vllm:spec_decode_num_draft_tokens_total")


def vllm_metric(text: str, name: str) -> float:
    return metric(text, rf'{name}\{{model_name="{MODEL}"\}}')


def test_metrics_are_exported_under_vllms_names_and_move_with_minillms(live):
    before = httpx.get(live.url + "/metrics").text
    r = live.client().completions.create(model=MODEL, prompt="Count: one two", max_tokens=4,
                                         extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10  # the loop thread publishes its state just after answering
    while vllm_metric(after := httpx.get(live.url + "/metrics").text, "vllm:prefix_cache_queries_total") == \
            vllm_metric(before, "vllm:prefix_cache_queries_total"):
        assert time.monotonic() < deadline, "the prefix-cache lookups never showed"
        time.sleep(0.02)
    for name in VLLM_SERIES:
        vllm_metric(after, name)  # present, with the model_name label
    grew = {name: vllm_metric(after, name) - vllm_metric(before, name) for name in VLLM_SERIES}
    assert grew["vllm:prompt_tokens_total"] == r.usage.prompt_tokens
    assert grew["vllm:generation_tokens_total"] == 4 and grew["vllm:e2e_request_latency_seconds_count"] == 1
    assert grew["vllm:time_to_first_token_seconds_count"] == 1 and grew["vllm:inter_token_latency_seconds_count"] == 3
    assert grew["vllm:prefix_cache_queries_total"] >= r.usage.prompt_tokens - 1
    for vllm_name, own in [("vllm:prompt_tokens_total", "minillm_prompt_tokens_total"),
                           ("vllm:e2e_request_latency_seconds_sum", "minillm_e2e_request_latency_seconds_sum"),
                           ("vllm:num_requests_running", "minillm_num_sequences_running")]:
        assert vllm_metric(after, vllm_name) == metric(after, own)  # one source
    assert 'vllm:request_success_total{finished_reason="length",model_name="SmolLM2-135M-Instruct"}' in after
    used, total = metric(after, "minillm_kv_blocks_used"), metric(after, "minillm_kv_blocks_total")
    assert vllm_metric(after, "vllm:kv_cache_usage_perc") == pytest.approx(used / total)


def test_kv_cache_usage_is_above_zero_while_a_request_runs(live):
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            next(lines)
            text = httpx.get(live.url + "/metrics").text
            assert 0 < vllm_metric(text, "vllm:kv_cache_usage_perc") <= 1
            assert vllm_metric(text, "vllm:num_requests_running") == 1
