"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official ``openai`` client and httpx.

A tiny random Llama (hidden 64, 2 layers) with the default model's real tokenizer keeps each request in the
milliseconds; the text is gibberish but the server's behaviour — routing, streaming, errors, aborts — is the same.
Every server runs in a thread on a free port and is stopped at the end of the module.
"""

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from minillm import EngineConfig, LLMEngine, ModelConfig  # noqa: E402
from minillm.engine.inputs import chat_prompt_ids  # noqa: E402
from minillm.entrypoints.openai.server import build_app  # noqa: E402
from minillm.models.loader import build_model, load_tokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 2048  # long enough that a max-length request is still running when the test looks


def tiny_hf_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def model():
    hf = tiny_hf_model()
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.float32, device="cpu")


class LiveServer:
    """uvicorn in a thread; ``url`` is its base URL, ``app`` the FastAPI app; ``uvicorn_options`` go to its
    ``Config`` (connection limits)."""

    def __init__(self, app, **uvicorn_options):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=2, **uvicorn_options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        assert host == "127.0.0.1"
        self.url = f"http://127.0.0.1:{port}"

    def client(self, api_key: str = "unused") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def live(model, tokenizer):
    server = LiveServer(build_app(LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=8)), max_queue=32))
    yield server
    server.stop()
    assert not server.app.state.server.loop.is_alive()


@pytest.fixture(scope="module")
def strict(model, tokenizer):
    """One running sequence, no queue, an API key, a 64 KiB body limit: the second concurrent request is refused."""
    server = LiveServer(build_app(LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1)), max_queue=0,
                                  api_key="sesame", served_model_name="tiny", max_body_bytes=64 << 10))
    yield server
    server.stop()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def assert_still_serves(server: LiveServer, api_key: str = "unused", model: str = MODEL) -> None:
    r = server.client(api_key).completions.create(model=model, prompt="Still there?", max_tokens=3,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def wait_until_idle(server: LiveServer, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(server.url + "/metrics").text
        if metric(text, "minillm_kv_blocks_used") == 0 and metric(text, "minillm_num_requests_in_flight") == 0:
            return text
        assert time.monotonic() < deadline, "KV blocks or requests were never released"
        time.sleep(0.05)


# ---- what a client gets -------------------------------------------------------------------------------------------
def test_completion_returns_max_tokens_of_text_and_usage(live):
    r = live.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_accepts_token_ids_and_counts_them(live):
    r = live.client().completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=2, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 2


def test_chat_completion_answers_as_the_assistant(live, tokenizer):
    messages = [{"role": "user", "content": "Hi!"}]
    r = live.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.usage.completion_tokens == 4
    # the prompt went through the chat template
    assert r.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, messages)) > len(tokenizer("Hi!").input_ids)


def test_streamed_chat_joins_to_the_non_streamed_text_at_temperature_0_and_reports_usage(live):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True})
    whole = live.client().chat.completions.create(**kw).choices[0].message.content
    chunks = list(live.client().chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_without_include_usage_has_no_usage_chunk(live):
    chunks = list(live.client().completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2_returns_two_choices_and_counts_both(live):
    r = live.client().completions.create(model=MODEL, prompt="Pick a number", max_tokens=3, n=2, temperature=1.0,
                                         seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 6


def test_a_batch_of_prompts_answers_each_prompt_at_its_own_choice_indices(live):
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    prompts = ["The sky is", "One, two,", "def main():"]
    alone = [live.client().completions.create(prompt=q, **kw).choices[0].text for q in prompts]
    r = live.client().completions.create(prompt=prompts, n=2, **kw)
    by_index = {c.index: c.text for c in r.choices}
    assert sorted(by_index) == list(range(6))  # choice k * n + j is prompt k's sample j
    assert [by_index[2 * k] for k in range(3)] == alone and [by_index[2 * k + 1] for k in range(3)] == alone
    prompt_tokens = sum(live.client().completions.create(prompt=q, **kw).usage.prompt_tokens for q in prompts)
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 6 * 4


def test_a_streamed_batch_of_token_id_prompts_joins_to_the_non_streamed_choices(live):
    kw = dict(model=MODEL, prompt=[[1, 2, 3], [4, 5, 6, 7]], max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})
    full = {c.index: c.text for c in live.client().completions.create(**kw).choices}
    joined: dict[int, str] = {}
    finish = {}
    for chunk in live.client().completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            joined[c.index] = joined.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    assert joined == full and finish == {0: "length", 1: "length"}
    assert usage.prompt_tokens == 7 and usage.completion_tokens == 10


def test_a_batch_with_one_bad_prompt_is_a_400_naming_it_and_leaves_nothing_running(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt=[[1, 2, 3], []], max_tokens=50,
                                         extra_body={"ignore_eos": True})
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt[1]"
    wait_until_idle(live)
    assert_still_serves(live)


def test_stop_string_ends_the_text_before_it(live):
    kw = dict(model=MODEL, prompt="Count with me:", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = live.client().completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    r = live.client().completions.create(**kw, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_models_health_and_metrics(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    text = httpx.get(live.url + "/metrics").text
    for name in ("minillm_http_requests_total", "minillm_time_to_first_token_seconds_bucket",
                 "minillm_time_per_output_token_seconds_bucket", "minillm_inter_token_latency_seconds_bucket",
                 "minillm_e2e_request_latency_seconds_count", "minillm_num_sequences_running",
                 "minillm_num_sequences_waiting", "minillm_kv_blocks_used", "minillm_prefix_cache_hit_rate"):
        assert name in text
    assert metric(text, "minillm_kv_blocks_total") > 0
    assert 'minillm_http_requests_total{path="/v1/completions",status="200"}' in text


def test_metrics_report_what_the_kv_pool_holds(live):
    text = httpx.get(live.url + "/metrics").text
    # max_num_seqs=8: the CPU default pool is 8 full 2048-token contexts of 16-token blocks
    assert metric(text, "minillm_kv_blocks_total") == 8 * CONTEXT // 16
    assert metric(text, "minillm_kv_tokens_total") == 8 * CONTEXT
    assert metric(text, "minillm_kv_max_full_sequences") == 8


def test_metrics_report_speculative_acceptance_of_an_early_exit_engine(model, tokenizer):
    spec = {"method": "early_exit", "num_speculative_tokens": 3, "num_layers": 1}  # drafts at every step
    server = LiveServer(build_app(LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2, speculative_config=spec))))
    try:
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "minillm_spec_decode_num_draft_tokens") == 0  # exported before any request too
        server.client().completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 10  # the loop thread publishes its state just after answering
        while metric(text := httpx.get(server.url + "/metrics").text, "minillm_spec_decode_num_draft_tokens") == 0:
            assert time.monotonic() < deadline, "no draft tokens were reported"
            time.sleep(0.02)
        drafted = metric(text, "minillm_spec_decode_num_draft_tokens")
        accepted = metric(text, "minillm_spec_decode_num_accepted_tokens")
        assert drafted > 0 and metric(text, "minillm_spec_decode_num_verify_steps") > 0
        assert metric(text, "minillm_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
    finally:
        server.stop()


def test_sixteen_concurrent_streams_all_finish_with_their_own_lengths(live):
    async def run():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(i):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Request {i}"}], max_tokens=2 + i % 5,
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            return [c async for c in stream][-1].usage.completion_tokens

        async with client:
            return await asyncio.gather(*(one(i) for i in range(16)))

    assert asyncio.run(run()) == [2 + i % 5 for i in range(16)]
    wait_until_idle(live)


# ---- errors: OpenAI's body, and the server keeps serving ---------------------------------------------------------
def test_bad_temperature_is_a_400_naming_it(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt="hi", temperature=-1)
    error = e.value.body  # the openai client unwraps {"error": ...}
    assert error["param"] == "temperature" and "temperature must be" in error["message"]
    assert error["type"] == "invalid_request_error" and "code" in error
    assert_still_serves(live)


def test_unsupported_field_is_a_400_naming_it(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt="hi", suffix="!")
    assert e.value.body["param"] == "suffix"
    assert_still_serves(live)


def test_malformed_json_and_wrong_types_are_400s_with_openai_bodies(live):
    r = httpx.post(live.url + "/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                       "temprature": 0})  # a typo is ignored, as in vLLM
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "temprature"
    assert_still_serves(live)


def test_unknown_model_is_a_404(live):
    with pytest.raises(openai.NotFoundError) as e:
        live.client().completions.create(model="gpt-5", prompt="hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert_still_serves(live)


def test_prompt_over_the_context_is_a_400(live):
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": list(range(5, 5 + CONTEXT))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(live.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "word " * CONTEXT}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert_still_serves(live)


def test_wrong_api_key_is_a_401_and_the_right_one_works(strict):
    with pytest.raises(openai.AuthenticationError) as e:
        strict.client("wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    assert httpx.get(strict.url + "/health").status_code == 200  # outside /v1: no key needed
    assert_still_serves(strict, "sesame", "tiny")


def test_body_over_the_size_limit_is_a_413_before_it_is_parsed(strict):
    r = httpx.post(strict.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * (100 << 10)},
                   headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_still_serves(strict, "sesame", "tiny")


def test_full_queue_is_answered_with_429_at_once(strict):
    body = {"model": "tiny", "prompt": "Go on", "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer sesame"}
    with httpx.Client(base_url=strict.url, headers=headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep it: a dropped iterator closes the connection, which aborts
            next(lines)  # admitted and running: the single slot is taken
            t0 = time.monotonic()
            second = client.post("/v1/completions", json={**body, "stream": False})
            assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
            assert time.monotonic() - t0 < 5
    wait_until_idle(strict)
    assert_still_serves(strict, "sesame", "tiny")


@pytest.fixture(scope="module")
def shedding(model, tokenizer):
    """Load shedding on: a 0.5 s TTFT budget, 64-token steps (a long prompt takes several), a roomy count limit —
    so under a burst it is the TTFT estimate, not the count, that refuses."""
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    server = LiveServer(build_app(engine, max_queue=200, ttft_slo_s=0.5))
    yield server
    server.stop()


def test_under_overload_each_request_finishes_or_is_shed_with_429_none_lost_none_hangs(shedding):
    long_prompt = "Tell me everything about the history of the Roman Empire. " * 40  # ~440 tokens: 7 steps
    assert_still_serves(shedding)  # a measured step first: before one, nothing can be estimated (all admitted)

    async def one(client: httpx.AsyncClient, k: int):
        body = {"model": MODEL, "prompt": f"{k} {long_prompt}", "max_tokens": 4, "ignore_eos": True,
                "stream": k % 2 == 0}
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.headers, r.text

    async def burst():
        async with httpx.AsyncClient(base_url=shedding.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, k) for k in range(40))), 120)

    results = asyncio.run(burst())  # a hang would raise TimeoutError here
    ok = shed = 0
    for status, headers, text in results:
        if status == 200:  # finished: 4 tokens, streamed ([DONE]) or whole
            ok += 1
            assert text.rstrip().endswith("data: [DONE]") or json.loads(text)["usage"]["completion_tokens"] == 4
        else:
            assert status == 429, (status, text)
            error = json.loads(text)["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "overloaded", error
            assert int(headers["retry-after"]) >= 1
            shed += 1
    assert ok + shed == 40 and ok >= 1 and shed >= 1  # none lost; the estimate both admitted and refused
    text = wait_until_idle(shedding)
    assert metric(text, 'minillm_requests_shed_total{reason="overloaded"}') == shed
    assert metric(text, "minillm_prefill_tokens_per_second") > 0
    assert_still_serves(shedding)


def test_a_shed_request_reaches_the_openai_client_as_a_rate_limit_error(shedding):
    loop = shedding.app.state.server.loop  # test hook: make the published queue look long (the next step resets it)
    from minillm.entrypoints.openai.admission import AdmissionState

    assert_still_serves(shedding)  # a prefill rate is measured
    wait_until_idle(shedding)
    time.sleep(0.1)  # the loop publishes right after its last step, then sleeps until a command comes
    loop.admission = AdmissionState(loop.admission.estimator, tokens_ahead=10**9)
    with pytest.raises(openai.RateLimitError) as info:
        shedding.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert info.value.code == "overloaded" and int(info.value.response.headers["retry-after"]) >= 1
    assert "overloaded" in info.value.message
    loop.abort("no-such-request")  # any command wakes the idle loop, which republishes the real (empty) queue
    deadline = time.monotonic() + 10
    while loop.admission.tokens_ahead:
        assert time.monotonic() < deadline, "the loop never republished its queue"
        time.sleep(0.01)
    assert_still_serves(shedding)  # admitted again


def test_a_client_that_disconnects_mid_stream_aborts_and_frees_its_kv_blocks(live):
    loop = live.app.state.server.loop  # test hook: the engine loop's published snapshot
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": CONTEXT - 10, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=live.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            events = (line for line in r.iter_lines() if line.startswith("data:"))
            for _ in range(3):
                next(events)
            assert metric(httpx.get(live.url + "/metrics").text, "minillm_kv_blocks_used") > 0
            steps_at_hangup = loop.snapshot.steps
    # leaving the block hangs up mid-stream: the server aborts the request and frees its blocks
    text = wait_until_idle(live)
    assert metric(text, "minillm_num_sequences_running") == 0
    assert loop.snapshot.steps - steps_at_hangup < 100, "the request ran on to its ~2000 tokens after the hang-up"
    assert_still_serves(live)


def test_a_non_streaming_client_that_hangs_up_aborts_its_request(live):
    loop = live.app.state.server.loop
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": CONTEXT - 10, "ignore_eos": True}
    steps_before = loop.snapshot.steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    wait_until_idle(live)
    assert loop.snapshot.steps - steps_before < CONTEXT - 100, "the request ran to the end after the hang-up"
    assert_still_serves(live)


def test_importing_minillm_and_its_cli_does_not_import_the_server_stack():
    code = ("import sys, minillm, minillm.entrypoints.cli as cli; cli.build_parser().parse_args(['serve']); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'prometheus_client', 'httpx') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ---- the command line and the load generator ---------------------------------------------------------------------
def test_load_generator_measures_a_live_server_and_saves_json(live, tmp_path):
    from minillm.perf.bench.serve import bench_serve

    result = bench_serve(live.url, [20.0, 30.0], 6, seed=1, max_tokens=4, ignore_eos=True, progress=False,
                         out_dir=tmp_path)
    run, second = result["runs"]
    # each swept rate draws its own prompts: a prefix cache must not answer the second rate from the first's blocks
    assert (run["seed"], second["seed"]) == (1, 1 + 1009)
    assert [r["prompt_tokens"] for r in run["requests"]] != [r["prompt_tokens"] for r in second["requests"]]
    assert result["model"] == MODEL  # discovered from /v1/models
    assert run["completed"] == 6 and run["rejected"] == 0 and run["failed"] == 0
    assert all(r["output_tokens"] == 4 for r in run["requests"])
    assert run["output_throughput"] > 0 and 0 < run["goodput"] <= run["request_throughput"]
    assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2e_ms"]["max"]
    saved = json.loads((tmp_path / result["path"].rsplit("/", 1)[-1]).read_text())
    assert "machine" in saved and saved["runs"][0]["completed"] == 6


def test_load_generator_samples_when_asked_and_refuses_bad_sampling_values(live):
    from minillm.perf.bench.serve import bench_serve, request_body

    greedy = request_body("chat", "m", "hi", 4, False)
    sampled = request_body("chat", "m", "hi", 4, False, sampling={"temperature": 1.0, "top_p": 0.9})
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy
    assert sampled["temperature"] == 1.0 and sampled["top_p"] == 0.9 and sampled["stream"] is True
    result = bench_serve(live.url, [float("inf")], 3, seed=1, max_tokens=4, ignore_eos=True, temperature=1.0,
                         top_p=0.9, progress=False, save=False)
    assert (result["temperature"], result["top_p"]) == (1.0, 0.9) and result["runs"][0]["completed"] == 3
    for bad, match in (({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")):
        with pytest.raises(ValueError, match=match):
            bench_serve(live.url, [1.0], 1, progress=False, save=False, **bad)
    wait_until_idle(live)


def test_each_swept_rate_has_its_own_trace_seed_and_a_bad_index_is_refused():
    from minillm.perf.bench.serve import sweep_seed

    assert [sweep_seed(3, i) for i in range(3)] == [3, 3 + 1009, 3 + 2018]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="place in the sweep"):
            sweep_seed(0, bad)


def test_load_generator_counts_refusals_as_rejected_not_failed(strict, tmp_path):
    from minillm.perf.bench.serve import bench_serve

    result = bench_serve(strict.url, [float("inf")], 4, model="tiny", max_tokens=64, ignore_eos=True,
                         api_key="sesame", progress=False, save=False)
    run = result["runs"][0]
    assert run["completed"] >= 1 and run["rejected"] >= 1 and run["failed"] == 0
    assert run["completed"] + run["rejected"] == 4
    wait_until_idle(strict)


def test_load_generator_overload_runs_at_a_multiple_of_the_measured_capacity(live):
    from minillm.perf.bench.serve import bench_serve

    result = bench_serve(live.url, [4.0], 6, seed=2, max_tokens=3, ignore_eos=True, ttft_slo_s=5.0,
                         overload=2.0, progress=False, save=False)
    assert result["runs"][0]["completed"] == 6  # the tiny model meets a 5 s SLO at 4 req/s: capacity 4
    over = result["overload"]
    assert over["capacity_rate"] == 4.0 and over["request_rate"] == 8.0 and over["factor"] == 2.0
    assert over["completed"] + over["rejected"] + over["failed"] == 6 and over["failed"] == 0
    wait_until_idle(live)


def test_serve_command_takes_the_engine_and_shedding_options(monkeypatch):
    from minillm.entrypoints import cli

    seen = {}

    class FakeLLM:  # records what the CLI builds instead of loading a model
        model = type("Model", (), {"dtype": "float32", "device": "cpu"})()

        def __init__(self, model, **options):
            seen["llm"] = options

    monkeypatch.setattr("minillm.llm.LLM", FakeLLM)
    monkeypatch.setattr("minillm.entrypoints.openai.server.run_server", lambda llm, **kw: seen.update(run=kw))
    assert cli.main(["serve", "--enforce-eager", "--kv-cache-dtype", "fp8", "--ttft-slo-ms", "1500"]) == 0
    assert seen["llm"]["enforce_eager"] is True and seen["llm"]["kv_cache_dtype"] == "fp8"
    assert seen["run"]["ttft_slo_s"] == 1.5
    seen.clear()
    assert cli.main(["serve"]) == 0  # defaults: the engine's own, no shedding
    assert "enforce_eager" not in seen["llm"] and "kv_cache_dtype" not in seen["llm"]
    assert seen["run"]["ttft_slo_s"] is None


def test_serve_command_answers_then_exits_on_sigterm(tmp_path, tokenizer):
    tiny_hf_model().save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", str(tmp_path / "tiny"), "--port", "0",
                             "--dtype", "float32", "--device", "cpu", "--shutdown-timeout", "0.5",
                             "--enforce-eager", "--kv-cache-dtype", "int8", "--ttft-slo-ms", "60000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # uvicorn prints the bound address
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
            assert time.monotonic() < deadline
        assert url, "the server never said where it listens"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == str(tmp_path / "tiny")
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": str(tmp_path / "tiny"), "prompt": "Go", "max_tokens": CONTEXT - 8,
                                "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()  # keep it: a dropped iterator closes the connection, which aborts
            next(lines)
            proc.send_signal(signal.SIGTERM)  # with a stream in flight: it is aborted after 0.5 s
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn may re-raise the signal once done
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
