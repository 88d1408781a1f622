# %% [markdown]
# # 09 — Serving the whole thing
#
# Notebooks 01–08 made one engine step fast and kept the batch full. A **server** adds what a user actually
# meets: requests arrive when *they* decide, over HTTP, one at a time, and each wants its first words quickly.
# That makes serving its own problem:
#
# - **Online vs offline.** An offline job (summarise a million documents) has every request at t = 0 and cares
#   about throughput — cost per token. An online service has requests arriving at random and promises latency:
#   a **service-level objective** (SLO) such as "time to first token ≤ 1 s and time per output token ≤ 100 ms for
#   99 % of requests". The same engine is tuned differently for each: big batches are cheap but slow each step.
# - **Streaming.** A chat user reads the answer as it is written, so the server sends every few tokens as a
#   server-sent event (SSE) and the client clocks them: TTFT, the gaps between tokens (ITL), TPOT.
# - **Open-loop load.** Users do not wait for each other: arrivals keep coming whether or not the server keeps
#   up (a Poisson process). When it does not, queues grow without bound, and every request's TTFT with them.
# - **Backpressure.** So a server bounds its queue and answers **429 Too Many Requests** at once rather than a
#   useless answer a minute later; it **aborts** requests whose client has gone, freeing their KV blocks; and it
#   exposes **metrics** (queue depth, KV usage, TTFT percentiles) so that operators see trouble coming.
#
# **In this notebook** you predict what throughput the engine can sustain from its batch curve (notebook 06) and
# the roofline, write the load generator's arrival schedule (exercise 9.1) and its client-side clock (9.2) and the
# server's side of a stream, its SSE events (9.3), start minillm's OpenAI-compatible server, call it with the official
# `openai` client, load it at several request rates
# with the same generator you would point at vLLM or SGLang, tune the engine's options for goodput under an SLO
# (9.4), read its Prometheus metrics, overload it into
# 429s, watch a disconnect free KV blocks, compare with plain transformers `generate` on the same prompts, and
# end with a map of the production engines. About two minutes on a 2-core CPU; on a GPU it uses the GPU.

# %%
from __future__ import annotations

import json
import math
import os
import random
import statistics
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Sequence

import httpx
import matplotlib.pyplot as plt
import openai
import torch
import uvicorn
from transformers import AutoModelForCausalLM

from minillm import LLM, EngineConfig, LLMEngine, SamplingParams
from minillm.course import checks
from minillm.course.conclusions import conclude
from minillm.course.predictions import predict_server_tok_s
from minillm.entrypoints.openai.server import build_app
from minillm.entrypoints.openai.sse import StreamMeta, chunk, event
from minillm.models.loader import resolve
from minillm.outputs import StepOutput
from minillm.perf import roofline
from minillm.perf.bench import serve as loadgen
from minillm.perf.bench.serve import BenchRequest, RequestResult
from minillm.perf.bench.serving import hf_padded_generate
from minillm.perf.simulate import ServingReport, replay
from minillm.perf.workloads import RequestSpec

FAST = os.environ.get("MINILLM_COURSE_FAST") == "1"  # set by the course tests: same cells, smaller sizes
random.seed(0)
torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 110, "figure.figsize": (7, 4)})

device = "cuda" if torch.cuda.is_available() else "cpu"
MAX_SEQS = 8  # the engine's batch cap (max_num_seqs): small, so that a 2-core CPU can fill it
llm = LLM(device=device, max_num_seqs=MAX_SEQS)  # dtype: minillm's choice for the device (fp16 on a T4)
model, config = llm.model, llm.model.config
dtype = roofline.dtype_name(model.dtype)
MAX_TOKENS = 16 if FAST else 32  # every answer is this long (ignore_eos): offered load = rate × MAX_TOKENS tokens/s
print(f"SmolLM2-135M-Instruct, {dtype} on {device}; max_num_seqs {MAX_SEQS}, answers of {MAX_TOKENS} tokens")

# %% [markdown]
# ## 1. Predict: how many tokens per second can a server sustain?
#
# A server at request rate λ, each request asking for `MAX_TOKENS` tokens, is **offered** λ × `MAX_TOKENS`
# output tokens/s. It delivers that much as long as the engine keeps up; past its **capacity**, the queue grows
# and throughput stays at capacity while TTFT climbs. Capacity comes from notebook 06's batch curve: a full batch
# of B sequences produces B tokens per decode step, and each request also needs one prefill. Here are this
# machine's numbers, measured offline on the same engine (no HTTP), and the roofline bound on a batch-1 step.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
prompts = loadgen.make_prompts(64, seed=0, median_words=40, sigma=0.5, max_words=120)  # the notebook's traffic
chat_ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
prompt_len = statistics.median(len(ids) for ids in chat_ids)


def engine_times(batch: int, prompt_tokens: int, repeats: int) -> tuple[float, float]:
    """(seconds of one prefill step of ``batch`` prompts of ``prompt_tokens`` tokens, seconds of a decode step of
    that batch), each the fastest of ``repeats``: on a shared machine other jobs can only add time."""
    engine = LLMEngine(model, llm.tokenizer, EngineConfig(max_num_seqs=MAX_SEQS, enable_prefix_caching=False,
                                                          max_num_batched_tokens=2048, num_kv_blocks=256))
    engine.generate([chat_ids[0][:8]], SamplingParams(max_tokens=2))  # warm-up, untimed
    prefills, steps = [], []
    for r in range(repeats):
        for ids in chat_ids[r * batch : (r + 1) * batch]:
            engine.add_request(ids[:prompt_tokens], SamplingParams(max_tokens=repeats + 2, temperature=0,
                                                                   ignore_eos=True))
        t = time.perf_counter()
        engine.step()  # every prompt's prefill in one step (and its first token)
        prefills.append(time.perf_counter() - t)
        for _ in range(repeats):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        while engine.has_unfinished_requests():
            engine.step()
    return min(prefills), min(steps)


spec = roofline.machine_spec(device, quick=FAST, verbose=True)  # measured once per machine, cached
REPEATS = 2 if FAST else 3
prefill_1, step_1 = engine_times(1, int(prompt_len), REPEATS)  # one typical prompt; decode at batch 1
_, step_B = engine_times(MAX_SEQS, 16, REPEATS)  # decode at a full batch (short prompts: cheap to set up)
bound_1 = 1 / (roofline.decode_step_cost(config, 1, int(prompt_len), dtype).bytes / spec.memory_bandwidth)
decode_capacity = MAX_SEQS / step_B  # tokens/s of a full batch that only decodes
per_request_s = prefill_1 + MAX_TOKENS * step_B / MAX_SEQS  # engine time one request costs at a full batch
capacity_tok_s = MAX_TOKENS / per_request_s
print(f"prompts: median {prompt_len:.0f} tokens (chat template included)")
print(f"batch 1: decode step {step_1 * 1e3:5.1f} ms -> {1 / step_1:6.1f} tok/s (roofline bound {bound_1:6.1f} tok/s, "
      f"{spec.memory_bandwidth / 1e9:.0f} GB/s)")
print(f"batch {MAX_SEQS}: decode step {step_B * 1e3:5.1f} ms -> {decode_capacity:6.1f} tok/s; one prompt's prefill "
      f"{prefill_1 * 1e3:5.0f} ms")
print(f"capacity with every request's prefill: {capacity_tok_s:6.1f} output tok/s = "
      f"{capacity_tok_s / MAX_TOKENS:.2f} requests/s of {MAX_TOKENS} tokens")

# %% [markdown]
# **Your prediction (exercise 9.0).** The simplest model of what the *server* delivers at each request rate is the
# offered load, capped at the capacity above (printed below). Before you run the measurement in section 4, write
# the output tokens/s you expect at the overload rate — start from that model and say what HTTP, streaming or the
# arrival pattern will cost (the checker accepts a number within 4× of it; the measurement then judges it).

# %%
# requests/s: light, near capacity and overload — fractions of the capacity measured above, so on any machine
# the labels hold
LOADS = {"light": 0.25, "overload": 2.0} if FAST else {"light": 0.25, "near capacity": 0.8, "overload": 2.0}
RATES = [float(f"{share * capacity_tok_s / MAX_TOKENS:.2g}") for share in LOADS.values()]
print(", ".join(f"{name}: {rate:g} req/s" for name, rate in zip(LOADS, RATES, strict=True)))
simple_model = {rate: min(rate * MAX_TOKENS, capacity_tok_s) for rate in RATES}  # offered load, capped
print("the simple model, output tok/s:", {rate: round(tok_s, 1) for rate, tok_s in simple_model.items()})

# %%
# exercise 9.0: minillm.course.predictions.predict_server_tok_s

# %%
my_prediction = None  # stays None while the prediction exercise is unwritten
my_prediction = checks.check_prediction_server(predict_server_tok_s, capacity_tok_s, RATES[-1] * MAX_TOKENS)

# %% [markdown]
# ## 2. Build: the load generator
#
# A load generator must measure what a user sees, the same way for every server: minillm, vLLM, SGLang,
# `transformers serve` and llama.cpp's server all speak OpenAI's streaming API, so
# `python -m minillm bench serve --base-url URL` measures any of them. Two pieces of it are yours.
#
# ### Exercise 9.1 — `arrival_times`
#
# **Open loop**: the generator sends each request at a time fixed in advance, whatever the server is doing. (A
# *closed* loop — N users who each wait for their answer before asking again — slows down with the server
# and hides its overload.) Independent users make a **Poisson process**: exponential gaps of mean 1/λ. Real
# traffic is often burstier; vLLM's `benchmark_serving` draws gamma gaps of shape `burstiness` and the same mean.

# %%
# exercise 9.1: minillm.perf.bench.serve.arrival_times

# %%
# NBVAL_CHECK_OUTPUT
checks.check_arrival_times(arrival_times)

# %% [markdown]
# ### Plug it in: what the schedules look like
#
# Two minutes of traffic at 2 requests/s from your function: Poisson and burstiness 0.25. Same mean rate; the
# bursty one brings clumps of requests that a server must absorb (or refuse) and long quiet gaps.

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
for burstiness, color in ((1.0, "tab:blue"), (0.25, "tab:red")):
    times = arrival_times(240, 2.0, burstiness, seed=1)
    label = "Poisson (burstiness 1)" if burstiness == 1 else f"gamma, burstiness {burstiness}"
    ax1.step(times, range(1, len(times) + 1), where="post", color=color, label=label)
    per_10s = [sum(1 for t in times if k <= t < k + 10) for k in range(0, 120, 10)]
    ax2.bar([k + (0 if burstiness == 1 else 4) for k in range(0, 120, 10)], per_10s, width=4, color=color,
            label=label, align="edge")
ax1.plot([0, 120], [0, 240], "k:", label="2 requests/s exactly")
ax1.set(xlabel="time (s)", ylabel="requests sent so far", xlim=(0, 120), ylim=(0, None),
        title="Cumulative arrivals")
ax2.axhline(20, color="k", linestyle=":", label="mean: 20 per 10 s")
ax2.set(xlabel="time window (s)", ylabel="requests in the 10 s window", title="Arrivals per 10 s")
ax1.legend(fontsize="small")
ax2.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Exercise 9.2 — `parse_stream`: the client's clock
#
# The generator reads the response body line by line and notes when each line arrived. From those lines it must
# tell what a user saw. Mind the traps of a real stream: the first chat chunk carries only the role (bytes, but
# no text: not the first token), some chunks carry no text (a character whose bytes are still incomplete),
# the last text chunk may hold several tokens (the usage chunk counts them), and a server may report an error in
# the middle of a 200 response.

# %%
# exercise 9.2: minillm.perf.bench.serve.parse_stream

# %%
# NBVAL_CHECK_OUTPUT
checks.check_parse_stream(parse_stream)

# %% [markdown]
# ## 3. The server: from engine updates to a stream
#
# `build_app(llm)` is the FastAPI app that `python -m minillm serve` runs: one thread owns the engine and steps
# it; each HTTP handler hands its request over through a queue and streams back what the engine produces. What
# it streams, byte for byte, is yours to write.
#
# ### Exercise 9.3 — `sse_stream`: the server's half of streaming
#
# The engine hands the server one `StepOutput` per sample per step: the step's new token ids, the *new* text
# (empty while the bytes of a character, or the start of a possible stop string, are held back) and, on the
# sample's last update, its `finish_reason`. OpenAI clients read **server-sent events** (SSE, the
# `text/event-stream` format): plain text over one long HTTP response, each event a `data: <JSON>` line and a
# blank line.
#
# SSE is ordinary HTTP, one-way and line-based: proxies, load balancers and `curl` pass it through, a
# completion needs no second direction (a WebSocket's would buy nothing), and any client that reads lines can
# parse it. What the events carry, in order:
#
# - chat only: per choice, a **role** chunk `{"delta": {"role": "assistant", "content": ""}}` — whose message the
#   deltas that follow build;
# - per update with something to show, one chunk: `{"delta": {"content": " Paris"}}` (completions:
#   `{"text": " Paris"}`) — the *new* text only, the client appends; an update with neither text nor a finish
#   sends nothing;
# - on a choice's last chunk, its `finish_reason`: `"stop"` (EOS or a stop string) or `"length"` (`max_tokens`);
# - if the client asked (`stream_options={"include_usage": True}`), a chunk with no choices and the token
#   **usage**: the only place a streamed answer says what it cost;
# - `data: [DONE]`, the end: without it a client cannot tell a finished answer from a connection that dropped.
#
# Every chunk repeats the response's `id`, `object`, `created` and `model` (a `StreamMeta`); `chunk(meta,
# choices, usage)` writes that envelope and the JSON, `event("[DONE]")` the last event. The role chunks are
# written for you, and show how `chunk` is called; the rest is yours. The function is `async`: the server reads
# its updates with `async for`, while the same event loop serves every other connection.

# %%
# exercise 9.3: minillm.entrypoints.openai.sse.sse_stream

# %%
# NBVAL_CHECK_OUTPUT
checks.check_sse_stream(sse_stream)

# %% [markdown]
# ### Plug it in: a real answer, as the wire carries it
#
# The engine's updates for one chat request, chunked by your function — the raw text a client receives (first and
# last events; the ones between are more text pieces). Then the client's side: each event parsed with the
# `openai` package's own `ChatCompletionChunk` type, the pieces joined, and set against the same request answered
# without streaming.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
question = [{"role": "user", "content": "What is a KV cache? One sentence."}]
greedy = SamplingParams(max_tokens=40, temperature=0)
question_ids = llm.apply_chat_template(question)


async def engine_updates(prompt_ids: list[int], params: SamplingParams):
    """The engine's ``StepOutput``s for one request, as an async stream (the server's come from its engine
    thread through a queue; here the engine runs in between)."""
    for update in llm.stream([prompt_ids], params):
        yield update


meta = StreamMeta(id="chatcmpl-demo", model="SmolLM2-135M-Instruct", created=int(time.time()), chat=True,
                  include_usage=True, prompt_tokens=len(question_ids))
events = [e async for e in sse_stream(engine_updates(question_ids, greedy), meta)]
print("".join(events[:3]) + f"... {len(events) - 6} more events ...\n\n" + "".join(events[-3:]), end="")
chunks = [openai.types.chat.ChatCompletionChunk.model_validate_json(e.removeprefix("data: "))
          for e in events[:-1]]  # all but [DONE]
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
blocking = llm.generate([question_ids], greedy)[0]
print(f"parsed back: {streamed!r}\n  usage {chunks[-1].usage.completion_tokens} tokens; finish "
      f"{chunks[-2].choices[0].finish_reason!r}; same as the non-streamed answer: {streamed == blocking.text}")

# %% [markdown]
# The server runs the same function: `server.py` merges the engine's per-request queues into one async stream of
# updates and sends what `sse_stream` yields; what stays in the handler is the I/O — an engine failure becomes an
# error event, a client that leaves aborts its request.
#
# ### Serve it and call it
#
# Here uvicorn serves the app from a background thread on a free port of 127.0.0.1. `max_queue=8` lets 8 requests
# wait beyond the 8 that run; the 17th in flight gets a 429.

# %%
class BackgroundServer:
    """uvicorn serving ``app`` on 127.0.0.1 from a daemon thread, on a port the OS picks; ``stop()`` ends it."""

    def __init__(self, app):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


server = BackgroundServer(build_app(llm, max_queue=8))
client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
print(f"serving on {server.url}: models {[m.id for m in client.models.list().data]}")

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=40,
                                       temperature=0)
print(f"chat: {reply.choices[0].message.content!r}\n  usage {reply.usage}")
t0, arrivals = time.perf_counter(), []
stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=40,
                                        temperature=0, stream=True)
pieces = []
for update in stream:  # not `chunk`: that name is the SSE writer your sse_stream (9.3) calls
    if update.choices and update.choices[0].delta.content:
        arrivals.append(time.perf_counter() - t0)
        pieces.append(update.choices[0].delta.content)
print(f"streamed: {''.join(pieces)!r}")
print(f"  {len(arrivals)} text chunks; first after {arrivals[0] * 1e3:.0f} ms (TTFT), then every "
      f"{statistics.median(b - a for a, b in zip(arrivals, arrivals[1:], strict=False)) * 1e3:.0f} ms (median ITL)")

# %% [markdown]
# The streamed text is the same as the blocking one (greedy decoding), but the first words arrived after one
# prefill instead of after the whole answer — the reason every chat interface streams.
#
# ### Plug in your clock
#
# The library's load generator takes your `parse_stream` as an explicit argument: three requests, clocked by
# your code.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
small = [BenchRequest(0.2 * i, prompts[i], MAX_TOKENS) for i in range(3)]
mine, _ = await loadgen.run_trace(server.url, small, model="SmolLM2-135M-Instruct", ignore_eos=True,
                                  progress=False, parse=parse_stream)
for i, r in enumerate(mine):
    print(f"request {i}: status {r.status}, {r.output_tokens} tokens, TTFT {r.ttft_s * 1e3:6.0f} ms, TPOT "
          f"{r.tpot_s * 1e3:5.1f} ms, E2E {r.latency_s * 1e3:6.0f} ms, error {r.error}")

# %% [markdown]
# ## 4. Measure: the server under load
#
# The same trace (prompts, answer lengths) at each rate above, arrivals Poisson, every answer
# `MAX_TOKENS` long. The engine's step counter, read before and after each run, gives the mean batch.

# %%
# NBVAL_IGNORE_OUTPUT
N_REQUESTS = 6 if FAST else 12
SLO = (2.0, 0.25) if device == "cpu" else (0.5, 0.05)  # (TTFT, TPOT) in seconds: CPU-scale and GPU-scale targets
engine_loop = server.app.state.server.loop


async def load_run(rate: float, n: int, seed: int = 0) -> dict:
    """Send ``n`` requests at ``rate`` req/s (Poisson, the library's schedule); the load generator's summary
    plus the engine steps taken while it ran."""
    trace = [BenchRequest(t, p, MAX_TOKENS) for t, p in
             zip(loadgen.arrival_times(n, rate, seed=seed), prompts[:n], strict=True)]
    steps0 = engine_loop.snapshot.steps
    results, duration = await loadgen.run_trace(server.url, trace, model="SmolLM2-135M-Instruct", ignore_eos=True,
                                                progress=False)
    summary = loadgen.summarize_run(results, duration, ttft_slo_s=SLO[0], tpot_slo_s=SLO[1])
    return {"request_rate": rate, "num_prompts": n, "steps": engine_loop.snapshot.steps - steps0, **summary}


runs = [await load_run(rate, N_REQUESTS) for rate in RATES]
for run in runs:
    loadgen.print_summary(run)

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
print(f"{'rate':>5} {'offered':>8} {'model':>10} {'measured':>9} {'ratio':>6} {'mean batch':>11} "
      f"{'TTFT p50/p99 (ms)':>19} {'goodput':>8}")
for run in runs:
    rate, measured = run["request_rate"], run["output_throughput"]
    batch = run["completed"] * MAX_TOKENS / max(run["steps"], 1)
    print(f"{rate:5.1f} {rate * MAX_TOKENS:8.1f} {simple_model[rate]:10.1f} {measured:9.1f} "
          f"{measured / simple_model[rate]:6.2f} {batch:11.1f} "
          f"{run['ttft_ms']['p50']:9.0f}/{run['ttft_ms']['p99']:<9.0f} {run['goodput']:8.2f}")
verdict = checks.judge_prediction(my_prediction, runs[-1]["output_throughput"], bound=simple_model[RATES[-1]],
                                  what=f"the server's output tokens/s at {RATES[-1]:g} req/s", unit="tok/s",
                                  bound_name="the simple model (offered load capped at capacity)", bandwidth=False,
                                  see="the reasons below")
conclude(f"measured throughput at {runs[-1]['request_rate']:g} req/s ÷ capacity", runs[-1]["output_throughput"]
         / capacity_tok_s, 1, expect="≈", tolerance=0.2, unit="×",
         held="past capacity the server delivers about what the offline probe said the engine can sustain",
         missed="past capacity the server is off the offline capacity by more than 20 %: the reasons below (a "
                "batch rarely full, prefill, the serving path's CPU; the prefix cache the other way)")
conclude(f"TTFT p50 at {runs[-1]['request_rate']:g} ÷ at {runs[0]['request_rate']:g} req/s",
         runs[-1]["ttft_ms"]["p50"] / runs[0]["ttft_ms"]["p50"], 2, expect=">", unit="×",
         held="past capacity TTFT is what grows: requests wait in the queue",
         missed="TTFT barely grew with the load in this run: the queue stayed short (too few requests to build one)")

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
rates = [r["request_rate"] for r in runs]
ax1.plot(rates, [r["output_throughput"] for r in runs], "o-", color="tab:blue", label="measured (server)")
ax1.plot(rates, [simple_model[r] for r in rates], "s--", color="tab:orange", label="the simple model")
if my_prediction is not None:
    ax1.plot([rates[-1]], [my_prediction], "r*", markersize=14, label="your prediction")
ax1.plot(rates, [r * MAX_TOKENS for r in rates], "k:", label="offered load")
ax1.axhline(capacity_tok_s, color="tab:green", linestyle="-.", label=f"capacity (offline), {capacity_tok_s:.0f}")
ax1.set(xlabel="request rate (requests/s)", ylabel="output tokens/s", title="Throughput vs offered load",
        ylim=(0, None))
ax1.legend(fontsize="small")
for key, color in (("ttft_ms", "tab:red"), ("tpot_ms", "tab:purple")):
    name = key[:4].upper()
    ax2.plot(rates, [r[key]["p50"] for r in runs], "o-", color=color, label=f"{name} p50")
    ax2.plot(rates, [r[key]["p99"] for r in runs], "^--", color=color, label=f"{name} p99")
ax2.axhline(SLO[0] * 1e3, color="tab:red", linestyle=":", label=f"TTFT SLO {SLO[0] * 1e3:.0f} ms")
ax2.axhline(SLO[1] * 1e3, color="tab:purple", linestyle=":", label=f"TPOT SLO {SLO[1] * 1e3:.0f} ms")
ax2.set(xlabel="request rate (requests/s)", ylabel="latency (ms, log)", yscale="log",
        title="Latency percentiles vs load")
ax2.legend(fontsize="small", ncol=2)
plt.tight_layout()
plt.show()

# %% [markdown]
# **Reading the gap.** At light load the server delivers about what is offered: each request runs almost alone,
# TTFT is one prefill and TPOT one batch-1 step. Throughput is measured over the whole run, which ends only when
# the last request's answer is complete, so it stays a little under rate × tokens even then. Near and past the
# capacity it falls short of the simple model for reasons the model leaves out, each visible above:
#
# - the **batch is rarely full**: the mean batch (tokens ÷ engine steps) stays below `max_num_seqs` because
#   Poisson arrivals come in clumps and gaps, and the run's start and end drain with a few requests only;
# - **prefill steals decode steps**: every arrival's prompt runs in some step that all running decodes share
#   (chunked prefill bounds the stall, notebook 06), which is also why TPOT rises with load;
# - **the serving path costs CPU**: HTTP parsing, JSON encoding of every chunk, detokenization and the load
#   generator itself share the same two cores with the model. On a GPU that work overlaps with the kernels; on
#   this CPU it competes with them.
#
# - and one effect works the other way: the server's **prefix cache** (notebook 05) serves the tokens every
#   prompt shares — the chat template's system prompt and the instruction templates — so its prefills are
#   cheaper than the probe's above, which ran with the cache off (`minillm_prefix_cache_hit_rate` in section 5
#   shows how much). That is how the measurement can beat the prediction.
#
# Past capacity, requests wait in the queue, so TTFT is what should grow, while TPOT barely moves — the batch is
# full either way (the ▸ lines say what this run measured). That is why an operator watches the queue and TTFT p99,
# not only throughput.
#
# ### Place it on the roofline
#
# The offline decode steps of section 1 (batch 1 and a full batch) and the server's average step at the highest
# rate (its mean batch; prefill work included in its time, so it sits lower).

# %%
# NBVAL_IGNORE_OUTPUT
busy = runs[-1]
mean_batch = max(1, round(busy["completed"] * MAX_TOKENS / max(busy["steps"], 1)))
ctx = int(prompt_len + MAX_TOKENS / 2)  # mean cached positions of a sequence while it decodes
points = [roofline.RooflinePoint.from_cost("batch 1 (offline)", roofline.decode_step_cost(config, 1, ctx, dtype),
                                           step_1),
          roofline.RooflinePoint.from_cost(f"batch {MAX_SEQS} (offline)",
                                           roofline.decode_step_cost(config, MAX_SEQS, ctx, dtype), step_B),
          roofline.RooflinePoint.from_cost(f"server, mean batch {mean_batch}",
                                           roofline.decode_step_cost(config, mean_batch, ctx, dtype),
                                           busy["duration_s"] / max(busy["steps"], 1))]
ax = roofline.plot_roofline(spec, points, dtype=dtype)
ax.set_title(f"Decode steps on this {device}'s roofline ({dtype})")
plt.show()

# %% [markdown]
# ### Challenge: goodput under the SLO (exercise 9.4)
#
# Throughput is what the machine does; **goodput** is what users get: requests per second that met *both* SLO
# targets (TTFT and TPOT above). The engine's options decide it: how many sequences share a step
# (`max_num_seqs`: more raises throughput, and each step's time, so TPOT), how many tokens a step may carry
# (`max_num_batched_tokens`: a long prefill in one step stalls every running decode), whether a prompt may be
# split over steps (`chunked_prefill`), the batching `policy`, the prefix cache, the KV budget (`num_kv_blocks`).
# `minillm.course.challenges.CHALLENGE_KNOBS` lists what you may set.
#
# Below, the same seeded trace — Poisson arrivals at about the capacity measured in section 1 — is replayed on the
# engine in this process (no HTTP, so it measures the engine's choices alone), once with the engine's defaults and
# once with your options. Return your options from `serving_knobs`; the check fails only an invalid configuration
# (an unknown option, one `EngineConfig` refuses, or one that cannot serve the trace). How much goodput you gained
# is the result: read the percentiles to see which target the misses hit, change one option at a time, run again.

# %%
# exercise 9.4: minillm.course.challenges.serving_knobs

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
challenge_rate = float(f"{capacity_tok_s / MAX_TOKENS:.2g}")  # requests/s at about the engine's capacity
challenge_trace = [RequestSpec(t, tuple(ids), MAX_TOKENS) for t, ids in
                   zip(loadgen.arrival_times(N_REQUESTS, challenge_rate, seed=1), chat_ids[:N_REQUESTS],
                       strict=True)]
print(f"the trace: {N_REQUESTS} requests at {challenge_rate:g} req/s (Poisson, seed 1), {MAX_TOKENS} tokens each; "
      f"SLO: TTFT ≤ {SLO[0] * 1e3:.0f} ms and TPOT ≤ {SLO[1] * 1e3:.0f} ms")


def replay_with(options: dict) -> ServingReport:
    """The challenge trace replayed on a fresh engine with ``options`` (EngineConfig fields; the rest defaults)."""
    engine = LLMEngine(model, llm.tokenizer, EngineConfig(**options))
    return replay(engine, challenge_trace, ttft_slo_s=SLO[0], tpot_slo_s=SLO[1], warmup=True,
                  label=str(options or "defaults"))


challenge = checks.check_serving_knobs(serving_knobs, measure=replay_with)

# %% [markdown]
# ## 5. Operating the server
#
# ### Metrics
#
# `GET /metrics` answers in Prometheus' text format: counters (requests by status, tokens), histograms
# (TTFT, TPOT, ITL, end-to-end, queue time: a scraper computes any percentile over any window from the bucket
# counts) and gauges read from the engine loop at scrape time (running and waiting sequences, KV blocks).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
def scrape(url: str) -> dict[str, float]:
    """The server's metrics as {name{labels}: value}, comments dropped."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


metrics = scrape(server.url)
watch = ["minillm_num_requests_in_flight", "minillm_num_sequences_running", "minillm_num_sequences_waiting",
         "minillm_kv_blocks_used", "minillm_kv_blocks_total", "minillm_prefix_cache_hit_rate",
         "minillm_generation_tokens_total", "minillm_time_to_first_token_seconds_count"]
for name in watch:
    print(f"{name:45} {metrics.get(name, float('nan')):10.3f}")
ttft_mean = (metrics["minillm_time_to_first_token_seconds_sum"]
             / metrics["minillm_time_to_first_token_seconds_count"])
print(f"mean TTFT since start (server side): {ttft_mean * 1e3:.0f} ms")
print("responses by path and status:", {k.split("{", 1)[1].rstrip("}"): int(v) for k, v in metrics.items()
                                        if k.startswith("minillm_http_requests_total")})

# %% [markdown]
# ### Backpressure: 429 instead of an unbounded queue
#
# A burst of 24 requests at once (rate = ∞) against a server that admits `max_num_seqs + max_queue` = 16:
# the last 8 are refused within milliseconds; of the 16 admitted, 8 run at once and 8 wait for a slot, so the
# bound also caps how long anyone waits (one batch's worth). Without it, all 24 would be accepted, and the queue
# would keep growing as long as requests come faster than the capacity — every TTFT with it.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
burst = [BenchRequest(0.0, prompts[i % len(prompts)], 8) for i in range(24)]
results, duration = await loadgen.run_trace(server.url, burst, model="SmolLM2-135M-Instruct", ignore_eos=True,
                                            progress=False)
refused = [r for r in results if r.status == 429]
served = [r for r in results if r.ok]
print(f"{len(served)} served, {len(refused)} refused with 429 in {duration:.1f} s")
print(f"  a refusal took {statistics.median(r.latency_s for r in refused) * 1e3:.0f} ms (median); "
      f"a served request's TTFT p50 {statistics.median(r.ttft_s for r in served) * 1e3:.0f} ms")
print(f"  the 429's body: {refused[0].error[:160]}")
refused_key = 'minillm_http_requests_total{path="/v1/chat/completions",status="429"}'
print(f"  /metrics counts 429s since start: {scrape(server.url).get(refused_key, 0):.0f}")

# %% [markdown]
# A client that gets 429 retries later with backoff (the `openai` client does so by default). Which limit to
# pick is the operator's call: the queue a client can wait in without breaking the TTFT SLO, here about
# `max_queue` ≈ SLO ÷ (time to drain one batch) × `max_num_seqs`.
#
# ### A client that leaves frees its KV blocks
#
# A user closes the tab in the middle of a long answer. The server notices the closed connection, aborts the
# request in the engine, and its KV blocks return to the pool at once — capacity for the next request instead of
# tokens nobody reads.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 400,
        "ignore_eos": True, "stream": True}
before = scrape(server.url)["minillm_kv_blocks_used"]
with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/chat/completions",
                                                                         json=body) as response:
    seen = 0
    for line in response.iter_lines():
        seen += line.startswith("data:")
        if seen == 10:
            break
    during = scrape(server.url)["minillm_kv_blocks_used"]
    print(f"KV blocks in use: {before:.0f} before, {during:.0f} after 10 chunks of a 400-token answer; "
          "now the client disconnects")
deadline, after = time.monotonic() + 10, during
while time.monotonic() < deadline and after > before:
    time.sleep(0.05)
    after = scrape(server.url)["minillm_kv_blocks_used"]
print(f"KV blocks in use {time.monotonic() - deadline + 10:.2f} s after the disconnect: {after:.0f}")

# %% [markdown]
# ## 6. Side by side: plain transformers `generate`
#
# The baseline most people start from: Hugging Face transformers, same weights, same prompts (chat template
# applied), the same `MAX_TOKENS` per answer, greedy. Its most favourable use is offline — every prompt at t = 0,
# left-padded into batches of `max_num_seqs` — so we give minillm's engine the same offline job (with everything
# on, prefix caching included, as the server runs it), and put the server's best online run next to them.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
specs = [RequestSpec(0.0, ids, MAX_TOKENS) for ids in chat_ids[:MAX_SEQS]]  # one full batch
hf = AutoModelForCausalLM.from_pretrained(resolve(None).directory, dtype=model.dtype).to(model.device).eval()
pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
hf_padded_generate(hf, specs[:2], 2, pad)  # warm-up
offline = LLMEngine(model, llm.tokenizer, EngineConfig(max_num_seqs=MAX_SEQS))  # everything on, as the server
offline.generate([chat_ids[0][:8]], SamplingParams(max_tokens=2))  # warm-up
hf_tok_s, engine_tok_s = 0.0, 0.0
for _ in range(REPEATS - 1):  # alternate the two and keep each one's fastest run (a shared machine only slows)
    hf_report = hf_padded_generate(hf, specs, MAX_SEQS, pad, ttft_slo_s=SLO[0], tpot_slo_s=SLO[1])
    hf_tok_s = max(hf_tok_s, hf_report.output_tok_s)
    t = time.perf_counter()
    outs = offline.generate([s.prompt_token_ids for s in specs],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    engine_tok_s = max(engine_tok_s, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
del hf, offline
best_online = max(runs, key=lambda r: r["output_throughput"])
side = {"transformers generate\n(offline, padded)": hf_tok_s,
        "minillm engine\n(offline, continuous)": engine_tok_s,
        f"minillm server\n(online, {best_online['request_rate']:g} req/s)": best_online["output_throughput"]}
for name, tok_s in side.items():
    print(f"{name.replace(chr(10), ' '):45} {tok_s:7.1f} output tok/s  ({tok_s / hf_tok_s:.2f}×)")
conclude("engine ÷ transformers generate, offline", engine_tok_s / hf_tok_s, 1, expect=">", unit="×",
         held="the engine outruns padded generate on the same prompts",
         missed="padded generate kept up with the engine here: equal answer lengths leave continuous batching "
                "no bubble to remove")
conclude("server at its best rate ÷ offline engine", best_online["output_throughput"] / engine_tok_s, 1,
         expect="≈", tolerance=0.2, unit="×",
         held="at overload the online server matches the offline engine: enough queued work to batch",
         missed="the online server stays short of the offline engine here: HTTP, streaming, arrivals spread in "
                "time and the load generator sharing the CPU cost more than the extra batching wins back")
fig, ax = plt.subplots(figsize=(7, 3.5))
bars = ax.barh(list(side), list(side.values()), color=["tab:gray", "tab:blue", "tab:green"])
ax.bar_label(bars, fmt="%.0f tok/s", padding=3)
ax.set(xlabel="output tokens/s (higher is better)", xlim=(0, 1.25 * max(side.values())),
       title=f"{len(specs)} chat prompts, {MAX_TOKENS} tokens each, on this {device}")
ax.invert_yaxis()
plt.tight_layout()
plt.show()

# %% [markdown]
# Padded `generate` computes every row of a batch on pad tokens up to its longest prompt, keeps a contiguous
# cache per batch and recomputes the shared chat-template prefix for every prompt; the engine packs prompts
# without padding, reuses cached prefix blocks and lets a new request in at every step (notebooks 05–06). With
# every answer the same length here, continuous batching has no bubble to remove: on a skewed trace
# (notebook 06) the gap widens. The online server pays for HTTP, streaming and arrivals that do not all come at
# once, and makes up for it with more requests to batch at overload (the ▸ line sets its best run against the
# offline engine). Below capacity it cannot keep up with an offline batch — there is not enough work — which is the
# price of latency for users who are waiting, and what an offline batch API (cheaper per token at every major
# provider) avoids.
#
# The same load generator measures other servers on the same machine, by URL only:
#
# ```bash
# python -m minillm serve --port 8000 &                                    # this notebook's server
# transformers serve --continuous-batching --port 8001 &                  # Hugging Face's own server
# python -m llama_cpp.server --model SmolLM2-135M-Instruct.Q4_1.gguf --port 8002 &   # llama.cpp (same weights)
# vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8003 &            # on a GPU: vLLM (or sglang)
# python -m minillm bench serve --base-url http://127.0.0.1:8001 --request-rate 0.5,1.5,4 --num-prompts 50
# ```
#
# ## 7. The landscape
#
# What the production engines implement, and where this course builds each technique (as of 2025, from each
# project's documentation — the field moves monthly; check before relying on a cell). ✓ supported,
# ~ partial or limited, — absent.
#
# | engine | [paged KV](05_paged_attention.ipynb) | [prefix / radix cache](05_paged_attention.ipynb) | [continuous batching](06_batching.ipynb) | [quantization](07_quantization.ipynb) | [speculation](08_speculative_decoding.ipynb) | [TP / PP](10_scaling_out.ipynb) | multi-LoRA | structured output |
# |---|---|---|---|---|---|---|---|---|
# | **vLLM** | ✓ PagedAttention (origin) | ✓ hashed blocks | ✓ | ✓ GPTQ, AWQ, FP8, INT8, GGUF, bitsandbytes | ✓ draft, n-gram, EAGLE, Medusa | ✓ / ✓ | ✓ | ✓ (xgrammar, outlines) |
# | **SGLang** | ✓ (token-granular pages) | ✓ RadixAttention (origin) | ✓ | ✓ FP8, AWQ, GPTQ, INT4 | ✓ EAGLE | ✓ / ✓ | ✓ | ✓ (compressed FSM, xgrammar) |
# | **TensorRT-LLM** | ✓ | ✓ KV reuse | ✓ in-flight batching | ✓ FP8, INT8 SmoothQuant, INT4 AWQ, FP4 | ✓ draft, Medusa, EAGLE, lookahead | ✓ / ✓ | ✓ | ✓ |
# | **TGI** | ✓ | ✓ | ✓ | ✓ GPTQ, AWQ, bitsandbytes, EETQ, FP8 | ✓ Medusa, n-gram | ✓ / — | ✓ | ✓ grammars |
# | **LMDeploy** | ✓ blocked KV | ✓ | ✓ persistent batching | ✓ AWQ W4A16, W8A8, KV INT4/INT8 | ~ | ✓ / ~ | ~ | ✓ |
# | **DeepSpeed-MII** | ✓ blocked KV | — | ✓ Dynamic SplitFuse | ~ FP6 | — | ✓ / — | — | — |
# | **CTranslate2** | — | — | ~ batch reordering | ✓ INT8, INT16, INT4 AWQ | — | ✓ / — | — | — |
# | **MLC-LLM** | ✓ | ✓ | ✓ | ✓ q4f16 and others | ✓ | ✓ / ~ | — | ✓ (xgrammar) |
# | **llama.cpp / Ollama** | — (one KV buffer, per-sequence cells) | ~ per-slot prompt cache | ✓ (llama-server) | ✓ GGUF Q2–Q8, K-quants, i-quants | ✓ draft model, lookup | ~ row split / layer split | ✓ adapters | ✓ GBNF, JSON schema |
# | **minillm** (this course) | ✓ 05 | ✓ 05 (hashed blocks) | ✓ 06, chunked prefill, preemption | ✓ 07: int8, int4 (Q4_1), AWQ, GPTQ; KV int8/fp8 | ✓ 08: n-gram, draft, early exit | ✓ / — 10 | — | ✓ 09 (xgrammar; a regex DFA of your own) |
#
# The techniques are the same few ideas everywhere; engines differ in kernels (FlashInfer, CUTLASS, Triton,
# hand-written CPU/Metal code), in scheduling policy, and in how far they go on each axis.

# %% [markdown]
# ## 8. Constrained decoding: masking the logits to a grammar
#
# An application often needs the answer in a shape a program can read: a date, a label from a fixed list, JSON
# that validates. Asking politely in the prompt works most of the time; a server must make it work every time.
# The trick needs no change to the model: at every step, before sampling, set the logit of every token that
# would take the output *out of the language* to −∞. The model still picks what it likes best, among the tokens
# that keep a valid answer possible.
#
# For a regular expression the recipe is classical:
#
# 1. **Compile the regex to a DFA over bytes** (Thompson's NFA, then subset construction): `table[s, b]` is the
#    state after byte `b` from state `s`; state 0 is **dead** (no match can follow — and every state that can no
#    longer reach an accepting one is merged into it).
# 2. **A token is its byte string**, not a character: `"12-"` is one token that spans two pieces of the pattern
#    `[0-9]{3}-[0-9]{4}`, so a token is allowed in state `s` iff walking *all* its bytes from `s` never reaches the
#    dead state. The end-of-sequence token is allowed exactly where `s` accepts.
# 3. **Cache the mask per DFA state.** A regex has a handful of states and the vocabulary is fixed, so each
#    state's mask [V] is computed once, the first time any request reaches it; every later step is a lookup.
#
# Production engines do the same at scale: Outlines precomputes the token index of every DFA state up front;
# xgrammar (vLLM's, SGLang's and TensorRT-LLM's default) handles context-free grammars such as JSON with a
# pushdown automaton, precomputing the tokens whose fate does not depend on the stack and checking only the rest
# at run time. minillm runs xgrammar for JSON schemas, choices and grammars
# (`GuidedDecodingParams(json=...)`), and for regexes also its own byte DFA, `backend="minillm"` — whose mask
# is yours to write. The DFA of a date:

# %%
import dataclasses
import re

from minillm import GuidedDecodingParams
from minillm.perf.perplexity import heldout_token_ids, perplexity
from minillm.sampling.guided import mask_logits
from minillm.sampling.regex import DEAD, compile_regex  # noqa: F401  (DEAD: your token_mask reads it)

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
dfa = compile_regex(DATE)
print(f"{DATE}\n  {dfa.num_states} states (0 dead, {dfa.start} the start), accepting: "
      f"{dfa.accepting.nonzero().flatten().tolist()}")
state = dfa.start
for piece in (b"20", b"24", b"-1", b"2-", b"31"):
    state = dfa.walk(state, piece)
    print(f"  after {piece!r:7}: state {state}")
print(f"  '2024-13' leads to state {dfa.walk(dfa.start, b'2024-13')} (dead: no month 13)")

# %% [markdown]
# ### Exercise 9.5 — `token_mask`: which tokens keep the automaton alive
#
# The vocabulary arrives as a table: `token_bytes[t]` holds token t's bytes, zero-padded to the longest token,
# and `lengths[t]` how many there are (0 for special tokens, which spell nothing). Return the bool mask [V] of the
# tokens whose walk from `state` never reaches `DEAD`. Walking 49 152 tokens one by one in Python takes a good
# fraction of a second per state; walk them **all at once**, one byte column at a time, keeping a vector of
# current states (a gather `table[states, column]` per column), and advance only the tokens that still have a byte
# in that column. (The end-of-sequence token is handled by the caller: allowed where the state accepts.)

# %%
# exercise 9.5: minillm.sampling.regex.token_mask

# %%
# NBVAL_CHECK_OUTPUT
checks.check_token_mask(token_mask)

# %% [markdown]
# ### Plug it in: the engine decodes through your mask
#
# A fresh engine whose regex backend computes every state's mask with your `token_mask`: questions whose answers
# must be a date, a yes/no/maybe or a phone-like code, greedy and at temperature 1, in one continuous batch with
# unconstrained requests. Every constrained answer must match its regex in full; the greedy ones are also run
# with xgrammar's masks, which must give the same tokens (same masks, same argmax).

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
ANSWERS = {DATE: "On what date did Apollo 11 land on the Moon?", r"(yes|no|maybe)": "Is the Moon made of cheese?",
           r"[A-Z]{2}-[0-9]{3}": "Invent a product code."}
your_engine = LLMEngine(model, llm.tokenizer, EngineConfig(max_num_seqs=MAX_SEQS))
your_engine.regex_compiler.mask_fn = token_mask  # your function computes every state's mask in this engine
asks, params, kinds = [], [], []
for temperature in (0.0, 1.0):
    for pattern, question in ANSWERS.items():
        asks.append(llm.apply_chat_template([{"role": "user", "content": question}]))
        params.append(SamplingParams(max_tokens=24, temperature=temperature, seed=1, guided_decoding=(
            GuidedDecodingParams(regex=pattern, backend="minillm"))))
        kinds.append((pattern, temperature))
    asks.append(llm.apply_chat_template([{"role": "user", "content": "Name a planet."}]))  # unconstrained
    params.append(SamplingParams(max_tokens=12, temperature=temperature, seed=1))
    kinds.append((None, temperature))
constrained = your_engine.generate(asks, params)
for (pattern, temperature), out in zip(kinds, constrained, strict=True):
    ok = "free" if pattern is None else ("✓" if re.fullmatch(pattern, out.text) else "✗")
    print(f"T={temperature:g} {ok:4} {pattern or '(unconstrained)':56.56} -> {out.text!r}")
assert all(re.fullmatch(p, o.text) for (p, _), o in zip(kinds, constrained, strict=True) if p), \
    "an answer left its regex"
greedy = [i for i, (p, t) in enumerate(kinds) if p and t == 0]
with_xgrammar = llm.generate([asks[i] for i in greedy], [dataclasses.replace(params[i], guided_decoding=(
    GuidedDecodingParams(regex=kinds[i][0]))) for i in greedy])
same = all(constrained[i].token_ids == o.token_ids for i, o in zip(greedy, with_xgrammar, strict=True))
print(f"every constrained answer matches its regex; greedy tokens identical with xgrammar's masks: {same}")

# %% [markdown]
# ### Measure: what the mask costs per step, yours against xgrammar's
#
# First every state's mask is computed with your `token_mask` (the one-off cost a state's first visit pays,
# timed per state). Then a batch of `MAX_SEQS` rows constrained by the same regex walks random valid outputs
# (restarting when one completes), and each step's masking of the logits [B, V] is timed with both backends on
# the same tokens: yours (the cached bool mask of each row's state, stacked and written in one pass) and
# xgrammar's (a bitmask filled per row by its C++ matcher, unpacked and written). Set against the decode step of
# section 1.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
regexes = your_engine.regex_compiler  # your token_mask computes its masks
grammars = llm.engine.grammar_compiler  # xgrammar's, as the server uses it
MASK_STEPS = 24 if FAST else 96
walk_rng = torch.Generator().manual_seed(0)


def timed_mask_steps(pattern: str, batch: int, steps: int) -> dict:
    """Median seconds of one step's mask_logits over [batch, V] logits, per backend, on the same token walks
    (every state's mask already cached), and the mean seconds of one state's mask from scratch."""
    compiled = regexes.compile(pattern)
    states = list(range(1, compiled.dfa.num_states))
    t0 = time.perf_counter()
    for s in states:  # the one-off cost: each state's mask from scratch (what a first visit pays)
        token_mask(compiled.dfa.table, s, compiled.token_bytes, compiled.lengths)
    cold = (time.perf_counter() - t0) / len(states)
    for s in states:  # then every state's mask cached, as after a state's first visit
        compiled.mask(s)
    ours, theirs = regexes.matchers(pattern, batch), grammars.matchers(GuidedDecodingParams(regex=pattern), batch)
    logits = torch.randn(batch, config.vocab_size)
    times = {"minillm": [], "xgrammar": []}
    for _ in range(steps):
        for name, matchers in (("minillm", ours), ("xgrammar", theirs)):
            x = logits.clone()
            t0 = time.perf_counter()
            mask_logits(x, matchers)
            times[name].append(time.perf_counter() - t0)
        for i in range(batch):  # a random allowed token per row, fed to both matchers
            allowed = ours[i].allowed_tokens().nonzero().flatten()
            token = int(allowed[torch.randint(len(allowed), (1,), generator=walk_rng)])
            assert ours[i].accept_token(token) and theirs[i].accept_token(token)
            if ours[i].is_terminated():
                ours[i].reset()
                theirs[i].reset()
    return {"minillm": statistics.median(times["minillm"]), "xgrammar": statistics.median(times["xgrammar"]),
            "cold": cold, "states": compiled.dfa.num_states}


mask_costs = {pattern: timed_mask_steps(pattern, MAX_SEQS, MASK_STEPS) for pattern in ANSWERS}
print(f"mask per step at batch {MAX_SEQS} (median of {MASK_STEPS} steps, masks cached); decode step at batch "
      f"{MAX_SEQS}: {step_B * 1e3:.1f} ms")
print(f"{'regex':56} {'states':>6} {'yours':>8} {'xgrammar':>9} {'a state from scratch':>21}")
for pattern, c in mask_costs.items():
    print(f"{pattern:56.56} {c['states']:6d} {c['minillm'] * 1e3:6.2f}ms {c['xgrammar'] * 1e3:7.2f}ms "
          f"{c['cold'] * 1e3:19.1f}ms")
date_cost = mask_costs[DATE]
verdicts = [
    conclude("your cached mask per step ÷ xgrammar's, date regex", date_cost["minillm"] / date_cost["xgrammar"], 1,
             expect="<", unit="×",
             held="a cached mask per state is cheaper per step than filling a bitmask per row: a regex's DFA is "
                  "small, so every state's mask fits in memory",
             missed="xgrammar's per-row bitmask fill is as cheap as (or cheaper than) stacking cached bool masks "
                    "here: its matcher is C++ and its bitmask 8× smaller than a bool mask"),
    conclude("a state's first visit ÷ a cached step, date regex", date_cost["cold"] / date_cost["minillm"], 1,
             expect=">", unit="×",
             held="computing a state's mask walks the whole vocabulary, so caching it per state is what makes the "
                  "per-step cost small",
             missed="computing a state's mask from scratch is as cheap as the cached step here"),
    conclude(f"xgrammar's mask ÷ a batch-{MAX_SEQS} decode step", date_cost["xgrammar"] / step_B, 0.1, expect="<",
             unit="×", held="the mask adds less than 10 % to a decode step (the serving target for structured output)",
             missed="the mask adds more than 10 % to a decode step on this machine"),
]

# %% [markdown]
# Both masks are CPU work in the step's critical path: the logits of a step must be masked before sampling, and
# the next step cannot start before its token is known. A regex's DFA is small enough to cache every state's
# mask (V bits each); a JSON schema's pushdown automaton has unboundedly many stack states, which is why xgrammar
# caches per grammar *position* only the context-independent tokens and checks the few others against the stack
# at run time — and why vLLM overlaps the mask's computation with the GPU's forward pass of the same step.
#
# ## 9. Logprobs: the same numbers through the API
#
# Evaluation harnesses (lm-eval's `local-completions`) score text through a server: they send it as the prompt
# with `echo=True, logprobs=…, max_tokens=0` and read each prompt token's log-probability given the tokens before
# it (the first has none: `null`). Summed, that is the text's log-likelihood, and exp(−mean) its perplexity — the
# number `python -m minillm eval perplexity` computes offline from the model's logits (`minillm.perf.perplexity`).
# Through the server, the same text must give the same perplexity.

# %% tags=["slide-output"]
# NBVAL_IGNORE_OUTPUT
text_ids = heldout_token_ids(llm.tokenizer, "evaluation", 64 if FAST else 256)  # held-out text, one window
scored = client.completions.create(model="SmolLM2-135M-Instruct", prompt=text_ids.tolist(), max_tokens=0,
                                   echo=True, logprobs=0, temperature=0)
token_logprobs = scored.choices[0].logprobs.token_logprobs
served_ppl = math.exp(-statistics.fmean(token_logprobs[1:]))
offline_ppl = perplexity(model, text_ids, window=len(text_ids), stride=len(text_ids))
print(f"{len(text_ids)} held-out tokens; first logprob {token_logprobs[0]} (no context), then e.g. "
      f"{[round(x, 3) for x in token_logprobs[1:5]]}")
print(f"perplexity through the server (echo + logprobs): {served_ppl:.4f}")
print(f"perplexity offline (minillm.perf.perplexity):   {offline_ppl.ppl:.4f} over {offline_ppl.num_tokens} tokens")
same_ppl = conclude("perplexity through the server vs offline", served_ppl, offline_ppl.ppl, expect="≈",
                    tolerance=0.001, digits=6,
                    held="the server's prompt logprobs are the model's own: the same perplexity",
                    missed="the server's logprobs disagree with the model's logits: a bug in the logprobs path")

# %%
# NBVAL_IGNORE_OUTPUT
server.stop()
print(f"server stopped: thread alive = {server.thread.is_alive()}")

# %% [markdown]
# ## Takeaways
#
# - **Serving is a queueing problem on top of an engine.** Throughput follows the offered load until the
#   engine's capacity (a full batch's tokens per step, minus the prefills), then stays flat while TTFT grows
#   with the queue. Your roofline-and-batch-curve prediction gives the ceiling; the measured gap is the batch
#   not being full, prefills sharing decode steps, and the serving path's own CPU cost.
# - **Measure like a user, open loop.** Poisson (or burstier) arrivals fixed in advance, streaming responses
#   clocked per chunk: TTFT at the first chunk *with text*, TPOT from the usage count, percentiles not means,
#   goodput under an SLO. One load generator for every OpenAI-compatible server makes the numbers comparable.
# - **A stream is a protocol.** SSE events in a fixed order — the role, new-text deltas, a `finish_reason`, usage
#   if asked, `[DONE]` — written by one pure function over the engine's updates. Every OpenAI-compatible server
#   sends the same events, which is why one client and one load generator work with all of them.
# - **Operate with bounds.** A bounded admission queue answers 429 in milliseconds instead of a timeout later;
#   a disconnect aborts the request and frees its KV blocks; `/metrics` shows queue depth, KV usage and latency
#   histograms — watch TTFT p99 and the waiting queue, they move first.
# - **Versus plain `generate`**, the engine wins on the same weights and prompts by keeping the batch full and
#   the KV cache compact; the online server trades some of that throughput for latency.
# - **The landscape** — vLLM, SGLang, TensorRT-LLM, TGI, LMDeploy, llama.cpp and the rest — is built from the
#   same parts as minillm: paged KV and prefix caching, continuous batching, quantization, speculation and
#   parallelism. Switching is a URL (the same OpenAI API) or an import (`LLM`, `SamplingParams`) away.
# - **Constrained decoding is a mask, not a model change.** Compile the constraint to an automaton, allow only the
#   tokens whose bytes keep it alive (end-of-sequence only where it accepts), cache the mask per state: every
#   answer then matches, at a per-step cost small next to a decode step. **Logprobs** through the API are the
#   model's own: a text's perplexity through the server's `echo` equals the offline one.
