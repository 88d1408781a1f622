"""vLLM's request semantics on the live server, driven by the ``openai`` SDK: unknown fields ignored (logged once,
listed in ``X-Ignored-Fields``), OpenAI's "off" values accepted, ``continuous_usage_stats``, the context rules
(400 ``context_length_exceeded``), the tokenizer endpoints and vLLM's metric names.  The same tiny random Llama
with the default model's tokenizer as ``test_openai_server.py``."""

import logging

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from test_openai_server import CONTEXT, MODEL, LiveServer, tiny_hf_model  # noqa: E402

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
    extra = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "temprature": 0.5}
    with caplog.at_level(logging.WARNING, logger="minillm.serve"):
        for _ in range(2):
            raw = chat(live, extra_body=extra)
            assert raw.parse().usage.completion_tokens <= 2
            assert raw.headers["x-ignored-fields"] == "metadata, service_tier, store, temprature"
    warned = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert sorted(warned) == sorted(f"ignoring the unknown request field {n!r} (listed in the X-Ignored-Fields "
                                    "response header; logged once)" for n in extra)  # two requests, one each
    raw = live.client().completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=1,
                                                             extra_body={"store": True})
    assert raw.headers["x-ignored-fields"] == "store"
    assert "x-ignored-fields" not in chat(live).headers  # nothing ignored: no header


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


@pytest.mark.parametrize("on", [{"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
                                {"response_format": {"type": "json_object"}}, {"top_logprobs": 2, "logprobs": True}])
def test_values_the_engine_cannot_honour_stay_400s_naming_the_field(live, on):
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, extra_body=on)
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] in on


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
