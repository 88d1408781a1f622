"""``python -m minillm bench serve --base-url URL``: a load generator for any OpenAI-compatible server.

minillm, vLLM, SGLang, ``transformers serve`` and llama.cpp's server all speak the same streaming API, so one
generator measures them the same way: requests arrive at ``request_rate`` per second (Poisson, or burstier with
``burstiness`` < 1: gamma-distributed gaps of the same mean, as vLLM's ``benchmark_serving``), each streams its
answer, and the client clocks every chunk:

- **TTFT**: send → first chunk with text;  **ITL**: the gaps between text chunks;
- **TPOT**: (E2E − TTFT) / (output tokens − 1);  **E2E**: send → last byte;
- **throughput**: completed requests and output tokens per second of wall time;  **goodput**: requests/s that
  met the SLO on TTFT *and* TPOT (``minillm.perf.metrics.goodput``).

A refused request (429/503) is counted as rejected, not as a failure: under overload that is the answer a server
should give quickly.  A *failed* request (an error, a dropped connection, a timeout, an empty answer) is a lost
one.  Latency percentiles are over the completed (admitted and answered) requests, and each run says whether their
p99 TTFT met the SLO.

Overload, in two steps (``--overload 2`` does both): sweep rates to find the capacity — the highest rate at which
every request completed and p99 TTFT met the SLO — then send ``2 ×`` that rate.  A server that sheds load
(``minillm serve --ttft-slo-ms``) should then lose nothing and keep its admitted requests within the SLO,
refusing the excess with 429; one that queues without bound keeps every request and misses the SLO on most.

Structured output (``json_schema``): the same trace runs with ``response_format`` json_schema on every request, in
two pairs of runs, both printed and saved:

- **as served** (``runs`` / ``runs_json_schema``): unconstrained, then the schema as given.  A grammar ends its
  answer at the closing brace, also under ``ignore_eos``, so the constrained answers are shorter and the same
  prefills are spread over fewer output tokens: output tok/s then compares different amounts of work.
- **equal work** (``runs_equal_work``): unconstrained with ``ignore_eos``, then ``equal_work_schema``: an array of
  at least ``max_tokens`` items of the schema, which no answer can close within ``max_tokens``.  Both runs emit
  exactly ``max_tokens`` tokens per request on the same prefills, so their output tok/s ratio is the cost of
  decoding under the grammar (masks, matcher updates) — the row a structured-output cost target is about.

The equal-work pair runs after the as-served pair: with a server's prefix cache on, both of its runs find the
trace's prompts cached (a fair pair), while the as-served constrained run is flattered by the cache its
unconstrained run filled (compare against ``--no-enable-prefix-caching``, minillm's and vLLM's flag).

Output tokens come from the server's usage chunk (``stream_options.include_usage``), else
one per text chunk.  Prompts are real English cut from CPython's ``pydoc_data.topics`` (always installed, no
download) at lognormal lengths, wrapped in chat-like instructions, with a seed: the same trace on every run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minillm.perf.metrics import goodput, summarize
from minillm.perf.workloads import lognormal_lengths

TEMPLATES = (  # chat-like instructions around a document: what most chat traffic looks like
    "Summarize the following documentation in a few sentences.\n\n{doc}",
    "{doc}\n\nExplain the above to a beginner, with an example.",
    "Read this and list the three most important points:\n\n{doc}",
    "Here is part of the Python reference manual:\n\n{doc}\n\nWhat questions would a student ask about it?",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request of the trace: sent ``arrival_s`` after the start, asking for up to ``max_tokens`` tokens."""

    arrival_s: float
    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    """What the client measured for one request (times in seconds, from the moment it was sent)."""

    status: int  # HTTP status; 0 for a connection error
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list, repr=False)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.output_tokens > 0

    @property
    def rejected(self) -> bool:
        return self.status in (429, 503)

    @property
    def failed(self) -> bool:
        """Lost: neither answered nor refused."""
        return not self.ok and not self.rejected


# ---- the trace ---------------------------------------------------------------------------------------------------
def make_prompts(n: int, seed: int = 0, median_words: int = 120, sigma: float = 0.8,
                 max_words: int = 1000) -> list[str]:
    """``n`` prompts: a template around a run of ``lognormal(median_words, sigma)`` words of Python's docs."""
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)).split()
    lengths = lognormal_lengths(n, median_words, sigma, lo=8, hi=max_words, seed=seed)
    rng = random.Random(seed + 1)
    prompts = []
    for length in lengths:
        start = rng.randrange(len(words) - length)
        prompts.append(rng.choice(TEMPLATES).format(doc=" ".join(words[start:start + length])))
    return prompts


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s) of ``n`` requests, sorted, the first after one gap: an open-loop arrival schedule.

    Gaps are independent, with mean ``1 / rate``: exponential for ``burstiness`` 1 (a Poisson process: users who
    do not coordinate), gamma of shape ``burstiness`` and scale ``1 / (rate × burstiness)`` otherwise (same mean,
    coefficient of variation ``1 / sqrt(burstiness)``: burstier below 1, more regular above), as vLLM's
    ``benchmark_serving``.  ``rate=math.inf`` sends all ``n`` at t = 0.  Draw from ``random.Random(seed)``: the
    same arguments give the same schedule.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"the number of requests must be an int >= 0, got {n!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1 = Poisson), got {burstiness!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf: all at t = 0), got {rate!r}")
    ### BEGIN SOLUTION
    if math.isinf(rate):
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        # gammavariate(1, 1/rate) is expovariate(rate): Poisson is the burstiness-1 case of the same loop
        t += rng.expovariate(rate) if burstiness == 1 else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    return times
    ### END SOLUTION


def make_trace(n: int, rate: float, max_tokens: int, seed: int = 0, burstiness: float = 1.0) -> list[BenchRequest]:
    return [BenchRequest(a, p, max_tokens)
            for a, p in zip(arrival_times(n, rate, burstiness, seed), make_prompts(n, seed + 7), strict=True)]


# ---- one request -------------------------------------------------------------------------------------------------
def request_body(endpoint: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool,
                 json_schema: dict | None = None, sampling: dict | None = None) -> dict:
    """One streamed request; ``json_schema``: constrain the answer (OpenAI's ``response_format`` json_schema);
    ``sampling``: fields that replace greedy decoding (``{"temperature": 1.0, "top_p": 0.9}``)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **(sampling or {})}
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": json_schema}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:  # a vLLM extension (minillm and SGLang have it too): fixed output lengths
        body["ignore_eos"] = True
    return body


def parse_stream(sent_s: float, lines: Sequence[tuple[float, str]], end_s: float) -> RequestResult:
    """What the client measured for one streamed (SSE) answer of status 200.

    ``lines``: the response body's lines in order, each with the ``time.perf_counter()`` at which it arrived;
    ``sent_s``: when the request was sent; ``end_s``: when the stream ended (after ``data: [DONE]``).
    An SSE line ``data: <json>`` carries one chunk; ``data: [DONE]`` ends the stream (ignore anything after it);
    other lines (blank separators, ``: comments``) carry nothing.  A chunk with an ``"error"`` key ends the
    request: ``RequestResult(200, error=<its text, ≤ 300 chars>)``.  A chunk whose choices hold text (chat:
    ``choices[i]["delta"]["content"]``; completions: ``choices[i]["text"]``; role-only and finish-only chunks
    hold none) is a token arrival; the last ``"usage"`` seen gives ``completion_tokens``/``prompt_tokens``.

    Returns ``RequestResult(200, ttft_s, tpot_s, latency_s, output_tokens, prompt_tokens, itl_s)`` with
    ttft = first text arrival − sent;  latency (E2E) = end − sent;  output_tokens = usage's completion_tokens,
    else the number of text chunks;  tpot = (E2E − TTFT) / (output_tokens − 1), 0 for one token;  itl = the
    gaps between consecutive text arrivals;  prompt_tokens from usage, else None.  No text at all:
    ``RequestResult(200, latency_s=E2E, error="no text in the response")``.
    """
    ### BEGIN SOLUTION
    times: list[float] = []
    usage = None
    for t, line in lines:
        if not line.startswith("data:"):
            continue  # blank separator or comment
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            return RequestResult(200, error=str(event["error"])[:300])
        text = "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in event.get("choices") or ())
        if text:
            times.append(t)  # a text chunk: its arrival is what the user sees
        usage = event.get("usage") or usage
    if not times:
        return RequestResult(200, latency_s=end_s - sent_s, error="no text in the response")
    tokens = usage["completion_tokens"] if usage else len(times)
    ttft = times[0] - sent_s
    return RequestResult(200, ttft_s=ttft, latency_s=end_s - sent_s, output_tokens=tokens,
                         tpot_s=(end_s - sent_s - ttft) / (tokens - 1) if tokens > 1 else 0.0,
                         prompt_tokens=usage["prompt_tokens"] if usage else None,
                         itl_s=[b - a for a, b in zip(times, times[1:], strict=False)])
    ### END SOLUTION


async def send_request(client, url: str, body: dict, headers: dict, *,
                       parse: Callable[..., RequestResult] = parse_stream) -> RequestResult:
    """POST one streaming request, clock each line of its body as it arrives, and ``parse`` them
    (``parse_stream``, or a drop-in replacement with its signature: the course passes the student's)."""
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(r.status_code, latency_s=time.perf_counter() - t0, error=text[:300])
            async for line in r.aiter_lines():
                lines.append((time.perf_counter(), line))
                if line.startswith("data:") and line[5:].strip() == "[DONE]":
                    break
    except Exception as e:  # connection refused, reset, timeout: a failed request, the run goes on
        return RequestResult(0, latency_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    return parse(t0, lines, time.perf_counter())


# ---- a run -------------------------------------------------------------------------------------------------------
async def run_trace(base_url: str, trace: Sequence[BenchRequest], *, model: str, endpoint: str = "chat",
                    api_key: str | None = None, ignore_eos: bool = False, max_concurrency: int | None = None,
                    timeout_s: float = 600.0, progress: bool = True, json_schema: dict | None = None,
                    sampling: dict | None = None,
                    parse: Callable[..., RequestResult] = parse_stream) -> tuple[list[RequestResult], float]:
    """Send ``trace`` on its schedule; returns each request's result (trace order) and the wall time.
    ``parse`` turns a response's timed lines into its result (see ``parse_stream``); ``json_schema``: every
    request's answer is constrained to it; ``sampling``: every request's sampling fields (``request_body``)."""
    import httpx
    from tqdm.auto import tqdm

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency or len(trace) or 1)
    bar = tqdm(total=len(trace), desc="bench serve", disable=not progress, file=sys.stderr)
    limits = httpx.Limits(max_connections=max_concurrency or max(len(trace), 1), max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            async with gate:
                body = request_body(endpoint, model, req.prompt, req.max_tokens, ignore_eos, json_schema, sampling)
                result = await send_request(client, path, body, headers, parse=parse)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r) for r in trace))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def summarize_run(results: Sequence[RequestResult], duration_s: float, *, ttft_slo_s: float,
                  tpot_slo_s: float) -> dict:
    """Counts (completed, rejected with 429 or 503, failed = lost), throughputs, goodput and latency percentiles
    (ms) of the completed requests; ``ttft_p99_within_slo``: whether their p99 TTFT met ``ttft_slo_s``."""
    done = [r for r in results if r.ok]
    out = {"completed": len(done), "rejected": sum(r.rejected for r in results),
           "rejected_429": sum(r.status == 429 for r in results), "rejected_503": sum(r.status == 503 for r in results),
           "failed": sum(r.failed for r in results), "duration_s": duration_s,
           "request_throughput": len(done) / duration_s,
           "output_throughput": sum(r.output_tokens for r in done) / duration_s,
           "goodput": goodput(done, duration_s, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s) if done else 0.0,
           "slo": {"ttft_ms": ttft_slo_s * 1e3, "tpot_ms": tpot_slo_s * 1e3}}
    series = {"ttft_ms": [r.ttft_s for r in done], "tpot_ms": [r.tpot_s for r in done if r.output_tokens > 1],
              "itl_ms": [g for r in done for g in r.itl_s], "e2e_ms": [r.latency_s for r in done]}
    for name, values in series.items():
        out[name] = {k: v * 1e3 for k, v in summarize(values).items()} if values else None
    out["ttft_p99_within_slo"] = out["ttft_ms"] is not None and out["ttft_ms"]["p99"] <= ttft_slo_s * 1e3
    errors = [r.error for r in results if r.error and not r.rejected]
    if errors:
        out["first_error"] = errors[0]
    return out


def capacity_rate(runs: Sequence[dict]) -> float | None:
    """The highest swept rate at which every request completed (none rejected or failed) and the p99 TTFT met
    the SLO: the rate the server sustains.  None if no run did."""
    good = [r["request_rate"] for r in runs if r["completed"] == r["num_prompts"] and r["ttft_p99_within_slo"]]
    return max(good, default=None)


def discover_model(base_url: str, api_key: str | None = None) -> str:
    """The first model ``GET /v1/models`` lists."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def sweep_seed(seed: int, index: int) -> int:
    """The trace seed of the ``index``-th rate of a sweep (0: ``seed`` itself): distinct prompts per rate."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"index is a rate's place in the sweep, an int >= 0; got {index!r}")
    return seed + 1009 * index


def bench_serve(base_url: str = "http://127.0.0.1:8000", request_rates: Sequence[float] = (4.0,),
                num_prompts: int = 200, *, model: str | None = None, seed: int = 0, max_tokens: int = 64,
                endpoint: str = "chat", burstiness: float = 1.0, ignore_eos: bool = False,
                ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.2, api_key: str | None = None,
                max_concurrency: int | None = None, overload: float | None = None, progress: bool = True,
                save: bool = True, out_dir: Path | None = None, json_schema: dict | None = None,
                temperature: float = 0.0, top_p: float | None = None) -> dict:
    """Run the trace once per rate against ``base_url``; print a table, save JSON (with the machine) and return
    ``{"runs": [summary per rate], ...}``.  The trace (prompts, lengths, arrival pattern) depends only on
    ``seed``, ``num_prompts``, the rate and its place in the sweep, so two servers are measured on the same
    requests.  Each swept rate draws its own prompts (``sweep_seed``): a server that caches prefixes would
    otherwise answer the second rate's prompts from the first rate's KV blocks, and a sweep would measure its
    cache, not its rate.  Requests decode greedily unless ``temperature`` > 0 (then sampled, with ``top_p`` when
    given): a sampled step pays for its sampler as well as its model.

    ``overload`` (e.g. 2.0): after the sweep, run once more at ``overload ×`` the capacity (``capacity_rate``:
    the highest swept rate that completed everything within the TTFT SLO) and report it as
    ``payload["overload"]``; skipped, with a message, if no swept rate qualifies.

    ``json_schema`` (a JSON schema): each rate runs its trace four more ways, on the same prompts (compare them
    on a server without prefix caching, or the later runs read the earlier runs' KV blocks), and prints the
    structured-output cost (``print_structured_cost``): as served, unconstrained then constrained to the schema
    (``payload["runs_json_schema"]`` beside ``payload["runs"]``); and on equal work, unconstrained with
    ``ignore_eos`` then constrained to ``equal_work_schema(json_schema, max_tokens)``
    (``payload["runs_equal_work"]``: ``{"unconstrained": [...], "json_schema": [...], "schema": ...}``)."""
    from minillm.perf.bench.decode import save_results

    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be an int >= 1, got {num_prompts!r}")
    if overload is not None and not overload > 0:
        raise ValueError(f"overload must be a factor > 0 (e.g. 2 for twice the capacity), got {overload!r}")
    if json_schema is not None and not isinstance(json_schema, dict):
        raise ValueError(f"json_schema must be a JSON schema object, got {json_schema!r}")
    if not (isinstance(temperature, int | float) and 0 <= temperature <= 2):
        raise ValueError(f"temperature must be a number in [0, 2] (OpenAI's range; 0 = greedy), got {temperature!r}")
    if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] (or None: not sent), got {top_p!r}")
    sampling = {"temperature": float(temperature)} | ({} if top_p is None else {"top_p": float(top_p)})
    model = model or discover_model(base_url, api_key)

    def measure(rate: float, index: int, schema: dict | None = None, fixed_lengths: bool = ignore_eos) -> dict:
        trace_seed = sweep_seed(seed, index)
        trace = make_trace(num_prompts, rate, max_tokens, trace_seed, burstiness)
        results, duration = asyncio.run(run_trace(base_url, trace, model=model, endpoint=endpoint, api_key=api_key,
                                                  ignore_eos=fixed_lengths, max_concurrency=max_concurrency,
                                                  progress=progress, json_schema=schema, sampling=sampling))
        summary = summarize_run(results, duration, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)
        run = {"request_rate": rate, "num_prompts": num_prompts, "seed": trace_seed, **summary,
               "requests": [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in results]}
        print_summary(run)
        return run

    runs = [measure(rate, i) for i, rate in enumerate(request_rates)]
    payload = {"benchmark": "serve", "base_url": base_url, "model": model, "endpoint": endpoint, "seed": seed,
               "max_tokens": max_tokens, "burstiness": burstiness, "ignore_eos": ignore_eos, **sampling,
               "runs": runs}
    if json_schema is not None:
        print("\nas served: the same trace, every answer constrained to the JSON schema:")
        payload["json_schema"] = json_schema
        payload["runs_json_schema"] = [measure(rate, i, json_schema) for i, rate in enumerate(request_rates)]
        long_schema = equal_work_schema(json_schema, max_tokens)
        print(f"\nequal work: the same trace with ignore_eos, unconstrained then constrained to an array of "
              f">= {max_tokens} items of the schema (every answer runs to max_tokens):")
        payload["runs_equal_work"] = {
            "schema": long_schema,
            "unconstrained": [measure(rate, i, None, fixed_lengths=True) for i, rate in enumerate(request_rates)],
            "json_schema": [measure(rate, i, long_schema, fixed_lengths=True) for i, rate in enumerate(request_rates)]}
        print_structured_cost(runs, payload["runs_json_schema"], payload["runs_equal_work"])
    if overload is not None:
        capacity = capacity_rate(runs)
        if capacity is None or math.isinf(capacity):
            print(f"\noverload: skipped — no finite swept rate completed every request with p99 TTFT <= "
                  f"{ttft_slo_s * 1e3:g} ms; sweep lower rates")
        else:
            print(f"\noverload: capacity {capacity:g} req/s (the highest rate that met the SLO); now {overload:g}x "
                  f"= {capacity * overload:g} req/s")
            payload["overload"] = {"factor": overload, "capacity_rate": capacity,
                                   **measure(capacity * overload, len(request_rates))}
            print_overload(payload["overload"])
    if save:
        rates = "-".join(f"{r:g}" for r in request_rates) + (f"-overload{overload:g}" if overload else "")
        path = save_results(f"serve-{_slug(model)}-rate{rates}", payload, out_dir)
        payload["path"] = str(path)
        print(f"saved {path}")
    return payload


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text.rsplit("/", 1)[-1])[:60]


def print_summary(run: dict) -> None:
    def ms(key: str) -> str:
        s = run[key]
        return f"{s['p50']:8.1f} {s['p90']:8.1f} {s['p99']:8.1f}" if s else "       -        -        -"

    print(f"\nrate {run['request_rate']:g} req/s, {run['num_prompts']} requests: {run['completed']} completed, "
          f"{run['rejected']} rejected (429/503), {run['failed']} failed in {run['duration_s']:.1f} s")
    if run["ttft_ms"] is not None:
        verdict = "within" if run["ttft_p99_within_slo"] else "OVER"
        print(f"  p99 TTFT of the completed requests {run['ttft_ms']['p99']:.0f} ms: {verdict} the "
              f"{run['slo']['ttft_ms']:g} ms SLO")
    print(f"  throughput {run['request_throughput']:.2f} req/s, {run['output_throughput']:.1f} output tok/s; "
          f"goodput {run['goodput']:.2f} req/s (TTFT <= {run['slo']['ttft_ms']:g} ms, "
          f"TPOT <= {run['slo']['tpot_ms']:g} ms)")
    print("                 p50      p90      p99   (ms)")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        print(f"  {key[:-3].upper():6s}  {ms(key)}")


def mean_output_tokens(run: dict) -> float:
    """The mean answer length (output tokens) of a run's completed requests; nan if none completed."""
    done = [r["output_tokens"] for r in run["requests"]
            if r["status"] == 200 and r["error"] is None and r["output_tokens"] > 0]
    return sum(done) / len(done) if done else float("nan")


def equal_work_schema(schema: dict, max_tokens: int) -> dict:
    """A JSON schema whose every valid answer is longer than ``max_tokens`` tokens: an array of at least
    ``max_tokens`` items of ``schema``.  Each item takes at least one token of its own (its text and the ", "
    separator), so the grammar cannot allow the closing ``]`` (nor EOS) before the length limit: a constrained
    answer then costs exactly the ``max_tokens`` decode steps an unconstrained ``ignore_eos`` answer does, under
    a grammar of the same shape as ``schema``'s (its masks, repeated).  The schema's ``$defs`` / ``definitions``
    move to the new root, so its ``#/$defs/...`` references still resolve (a ``#`` self-reference would not)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    defs = ("$defs", "definitions")
    return {"type": "array", "items": {k: v for k, v in schema.items() if k not in defs}, "minItems": max_tokens,
            **{k: schema[k] for k in defs if k in schema}}


def _ratio(a: float, b: float) -> float:
    return b / a if a else float("nan")


def print_structured_cost(plain: Sequence[dict], constrained: Sequence[dict], equal: dict | None = None) -> None:
    """Per rate, one row per pair of runs on the same trace: output tok/s and mean answer length (output tokens)
    unconstrained and with the JSON schema, and the constrained / unconstrained ratios of output tok/s, req/s and
    TPOT p50.  "as served": the schema as given (constrained answers end at the closing brace: shorter answers,
    more of the run in prefill, output tok/s compares different work); "equal work" (``equal``, the
    ``runs_equal_work`` of ``bench_serve``): every answer of both runs is ``max_tokens`` long, so the tok/s
    ratio is the grammar's decode cost.  A row whose mean lengths differ is marked: not equal work."""
    pairs = [("as served", plain, constrained)]
    if equal is not None:
        pairs.append(("equal work", equal["unconstrained"], equal["json_schema"]))
    print("\nstructured output on the same trace: output tok/s (mean output tokens per answer); json_schema / "
          "unconstrained ratios")
    print(f"  {'rate':>5}  {'row':10}  {'unconstrained':>20}  {'json_schema':>20}  {'out tok/s':>9}  {'req/s':>6}  "
          f"{'TPOT p50':>8}")
    for name, a_runs, b_runs in pairs:
        for a, b in zip(a_runs, b_runs, strict=True):
            la, lb = mean_output_tokens(a), mean_output_tokens(b)
            tpot = _ratio(a["tpot_ms"]["p50"], b["tpot_ms"]["p50"]) if a["tpot_ms"] and b["tpot_ms"] else float("nan")
            note = "" if name == "as served" or abs(la - lb) < 0.5 else "  (lengths differ: not equal work)"
            cells = [f"{r['output_throughput']:.1f} ({n:.1f} tok)" for r, n in ((a, la), (b, lb))]
            print(f"  {a['request_rate']:>5g}  {name:10}  {cells[0]:>20}  {cells[1]:>20}  "
                  f"{_ratio(a['output_throughput'], b['output_throughput']):8.2f}x  "
                  f"{_ratio(a['request_throughput'], b['request_throughput']):5.2f}x  {tpot:7.2f}x{note}")


def print_overload(run: dict) -> None:
    """The overload verdict: nothing lost, and the admitted requests within the TTFT SLO."""
    lost = run["failed"]
    p99 = run["ttft_ms"]["p99"] if run["ttft_ms"] else float("nan")
    ok = lost == 0 and run["ttft_p99_within_slo"]
    print(f"overload {run['factor']:g}x capacity ({run['request_rate']:g} req/s): {run['completed']} completed, "
          f"{run['rejected_429']} x 429, {run['rejected_503']} x 503, {lost} lost; p99 TTFT of the admitted "
          f"{p99:.0f} ms vs SLO {run['slo']['ttft_ms']:g} ms -> {'PASS' if ok else 'FAIL'}")
