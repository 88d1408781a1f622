"""Checkers of notebook 09: serving.

9.1 and 9.2 live in the load generator (``minillm.perf.bench.serve``), 9.3 in the server
(``minillm.entrypoints.openai.sse``).  The checkers do not compare with the library's function: the arrival
schedule is random, so it is held to the statistics it must have (mean gap, coefficient of variation, determinism
per seed); the stream parser gets streams built here from known token arrival times, so the expected
TTFT/TPOT/ITL are computed from how the stream was made; the SSE chunker gets made-up ``StepOutput`` streams and
its events are compared, parsed, with chunks built here from OpenAI's documented shapes.  While a checker runs,
the library's own solution is hidden, so that a student function that merely calls it fails.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import random
import statistics
from collections.abc import Callable, Iterator

from minillm.course.checks.registry import _close, _passed, exercise
from minillm.course.checks.roofline import prediction_checker


@contextlib.contextmanager
def _hidden(module: str, name: str) -> Iterator[None]:
    """Replace ``module.name`` by a function that fails, for the duration of a check."""
    mod = importlib.import_module(module)
    solved = getattr(mod, name)

    def refuse(*args, **kwargs):
        raise AssertionError(f"your function called the library's own {module}.{name}: expected your own code")

    setattr(mod, name, refuse)
    try:
        yield
    finally:
        setattr(mod, name, solved)


# ---------------------------------------------------------------------------------------------- 9.1
@exercise("9.1", "minillm.perf.bench.serve.arrival_times", "the open-loop arrival schedule",
          "accumulate independent random gaps drawn from random.Random(seed): exponential with mean 1/rate, or "
          "gamma of shape burstiness with the same mean; rate inf: n zeros")
def check_arrival_times(arrival_times: Callable) -> None:
    """``arrival_times(n, rate, burstiness, seed)``: shape, order, determinism, then the gaps' mean and
    coefficient of variation on 20 000 draws at random rates (well within the statistical error of a correct
    schedule: 6 standard errors or more)."""
    with _hidden("minillm.perf.bench.serve", "arrival_times"):
        _check_arrival_times(arrival_times)
    _passed("9.1")


def _check_arrival_times(arrival_times: Callable) -> None:
    for n in (0, 1, 5):
        got = arrival_times(n, math.inf, 1.0, 0)
        assert list(got) == [0.0] * n, (
            f"arrival_times({n}, rate=inf) returned {got!r}, expected {[0.0] * n}: an infinite rate sends every "
            "request at t = 0 (an offline batch).")
    got = arrival_times(0, 3.0, 1.0, 0)
    assert list(got) == [], f"arrival_times(0, rate=3) returned {got!r}, expected []"
    rng = random.Random(2024)
    n = 20_000
    for burstiness in (1.0, 0.25, 4.0):
        rate = round(rng.uniform(0.5, 20.0), 3)
        seed = rng.randrange(1 << 30)
        call = f"arrival_times({n}, rate={rate}, burstiness={burstiness}, seed={seed})"
        times = list(arrival_times(n, rate, burstiness, seed))
        assert len(times) == n, f"{call} returned {len(times)} times, expected {n}"
        assert all(b >= a for a, b in zip(times, times[1:], strict=False)), (
            f"{call}: the times are not sorted; expected cumulative sums of the gaps (t += gap)")
        assert times[0] > 0, f"{call}: the first request arrives at {times[0]}, expected after one gap (> 0)"
        assert list(arrival_times(n, rate, burstiness, seed)) == times, (
            f"{call} differs between two calls: expected the same schedule for the same seed (draw from "
            "random.Random(seed), not the global random module)")
        other = list(arrival_times(n, rate, burstiness, seed + 1))
        assert other != times, f"{call}: seed {seed + 1} gives the same schedule; expected a different one"
        gaps = [b - a for a, b in zip([0.0] + times, times, strict=False)]
        mean, cv = statistics.fmean(gaps), statistics.pstdev(gaps) / statistics.fmean(gaps)
        cv_expected = 1 / math.sqrt(burstiness)
        assert _close(mean, 1 / rate, rel=0.06), (
            f"{call}: the mean gap is {mean:.5f} s, expected 1 / rate = {1 / rate:.5f} s (±6 %): {rate} requests "
            "arrive per second on average, whatever the burstiness (gamma scale = 1 / (rate × burstiness)).")
        assert _close(cv, cv_expected, rel=0.1), (
            f"{call}: the gaps' coefficient of variation (std / mean) is {cv:.3f}, expected 1 / sqrt(burstiness) "
            f"= {cv_expected:.3f} (±10 %): exponential gaps (Poisson) have CV 1; gamma gaps of shape burstiness "
            "have CV 1 / sqrt(burstiness).")


# ---------------------------------------------------------------------------------------------- 9.2
def _stream(rng: random.Random, kind: str, n_text: int, usage: bool, sent: float) -> tuple[list, float, list, int]:
    """A made-up SSE body of ``n_text`` text chunks: [(arrival time, line)], the end time, the text chunks' times and
    the output tokens the client should report."""
    t = sent + rng.uniform(0.01, 0.5)  # queueing + prefill before anything arrives
    lines, text_times = [], []

    def add(event, at):
        lines.append((at, "data: " + (event if isinstance(event, str) else json.dumps(event))))
        lines.append((at, ""))  # SSE's blank separator line

    def chat(delta, finish=None):
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    if kind == "chat":
        add(chat({"role": "assistant", "content": ""}), t)  # the role chunk: bytes arrive, but no text yet
        t += rng.uniform(0.01, 0.3)
    for i in range(n_text):
        if i and rng.random() < 0.2:  # a step that produced no visible text (bytes of a character held back)
            add(chat({"content": ""}) if kind == "chat" else {"choices": [{"index": 0, "text": ""}]}, t)
            t += rng.uniform(0.005, 0.05)
        word = rng.choice([" the", " KV", " cache", "é", " 42", "\n"])
        add(chat({"content": word}) if kind == "chat" else {"choices": [{"index": 0, "text": word,
                                                                         "finish_reason": None}]}, t)
        text_times.append(t)
        t += rng.choice([rng.uniform(0.005, 0.05), rng.uniform(0.2, 0.8)])  # an occasional stall
    add(chat({}, "length") if kind == "chat" else {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        t)
    if rng.random() < 0.5:
        lines.append((t, ": keep-alive comment"))
    n_tokens = n_text + rng.randint(0, 3)  # usage counts tokens; several can arrive in one chunk
    if usage:
        add({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": n_tokens,
                                      "total_tokens": 17 + n_tokens}}, t)
    add("[DONE]", t + 1e-4)
    lines.append((t + 2e-4, 'data: {"choices": [{"index": 0, "delta": {"content": "after DONE"}}]}'))
    return lines, t + 5e-4, text_times, (n_tokens if usage else n_text)


@exercise("9.2", "minillm.perf.bench.serve.parse_stream", "TTFT, TPOT and ITL from a streamed answer",
          "keep the arrival time of every 'data:' chunk whose choices hold text, stop at [DONE], return early on "
          "an 'error' chunk; TTFT = first − sent, E2E = end − sent, TPOT = (E2E − TTFT) / (tokens − 1), ITL = gaps")
def check_parse_stream(parse_stream: Callable) -> None:
    """``parse_stream(sent_s, lines, end_s)`` on made-up chat and completion streams (role chunks, empty deltas,
    comments, usage or not, text after ``[DONE]``), an error stream and a stream without text."""
    with _hidden("minillm.perf.bench.serve", "parse_stream"):
        _check_parse_stream(parse_stream)
    _passed("9.2")


def _check_parse_stream(parse_stream: Callable) -> None:
    rng = random.Random(9)
    cases = [("chat", 1, True), ("chat", 1, False), ("completions", 5, False)]
    cases += [(rng.choice(["chat", "completions"]), rng.randint(2, 12), rng.random() < 0.6) for _ in range(12)]
    for kind, n_text, usage in cases:
        sent = rng.uniform(100.0, 1000.0)  # perf_counter has an arbitrary origin
        lines, end, text_times, tokens = _stream(rng, kind, n_text, usage, sent)
        call = (f"a {kind} stream of {n_text} text chunks{' with a usage chunk' if usage else ''}, sent at "
                f"{sent:.3f}, first text at {text_times[0]:.3f}, ended at {end:.3f}")
        got = parse_stream(sent, list(lines), end)
        ttft, e2e = text_times[0] - sent, end - sent
        expected = {"status": 200, "error": None, "output_tokens": tokens, "ttft_s": ttft, "latency_s": e2e,
                    "tpot_s": (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0,
                    "prompt_tokens": 17 if usage else None}
        for name, value in expected.items():
            have = getattr(got, name, "<missing>")
            ok = _close(have, value, rel=1e-9, abs_=1e-9) if isinstance(value, float) else have == value
            assert ok, (
                f"{call}: {name} = {have!r}, expected {value!r}. TTFT is the first chunk *with text* (not the role "
                "chunk), E2E ends at end_s, output tokens come from usage when there is one (else one per text "
                "chunk), TPOT = (E2E − TTFT) / (tokens − 1).")
        itl = [b - a for a, b in zip(text_times, text_times[1:], strict=False)]
        have = list(getattr(got, "itl_s", []))
        assert len(have) == len(itl) and all(_close(a, b, rel=1e-9, abs_=1e-9) for a, b in zip(have, itl,
                                                                                                strict=True)), (
            f"{call}: itl_s = {[round(x, 4) for x in have]}, expected the gaps between text arrivals "
            f"{[round(x, 4) for x in itl]} (chunks without text and anything after [DONE] are not tokens)")
    sent = 5.0
    err = [(5.2, 'data: {"error": {"message": "the engine failed", "type": "server_error"}}'), (5.2, ""),
           (5.3, "data: [DONE]")]
    got = parse_stream(sent, err, 5.4)
    assert getattr(got, "error", None) and "the engine failed" in got.error and got.status == 200, (
        f"a stream whose chunk is an error: returned {got!r}, expected RequestResult(200, error=...) holding the "
        "error's text")
    empty = [(5.1, 'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'),
             (5.2, 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}'), (5.3, "data: [DONE]")]
    got = parse_stream(sent, empty, 5.5)
    assert getattr(got, "error", None) == "no text in the response" and _close(got.latency_s, 0.5), (
        f"a stream with no text: returned {got!r}, expected RequestResult(200, latency_s=0.5, "
        "error='no text in the response')")


# ---------------------------------------------------------------------------------------------- 9.3
_WORDS = [" the", " KV", " cache", " é", ' "quoted"', "\n", " 42", " tokens", "!"]


def _updates(rng: random.Random, num_choices: int, finish: str) -> tuple[list, list[str], int]:
    """Made-up ``StepOutput``s of ``num_choices`` samples, interleaved as an engine's steps interleave them: text
    steps, held-back steps (a token, no text), multi-token steps; each sample's last update finishes with
    ``finish`` and sometimes carries no text (a stop string cut off).  Returns the updates, each choice's full text
    and the number of tokens."""
    from minillm.outputs import StepOutput

    per_choice, texts, tokens = [], [], 0
    for i in range(num_choices):
        steps, text = [], ""
        for _ in range(rng.randint(2, 6)):
            held = rng.random() < 0.25
            ids = [rng.randrange(49152) for _ in range(1 if held or rng.random() < 0.7 else rng.randint(2, 3))]
            piece = "" if held else "".join(rng.choice(_WORDS) for _ in ids)
            steps.append(StepOutput("req", i, ids, piece, None))
            text += piece
        last = "" if finish == "stop" and rng.random() < 0.5 else rng.choice(_WORDS)
        steps.append(StepOutput("req", i, [rng.randrange(49152)], last, finish))
        text += last
        tokens += sum(len(s.token_ids) for s in steps)
        per_choice.append(steps)
        texts.append(text)
    updates = []
    while any(per_choice):  # one engine step: each unfinished sample's next update, in a shuffled order
        order = [i for i in range(num_choices) if per_choice[i]]
        rng.shuffle(order)
        updates += [per_choice[i].pop(0) for i in order]
    return updates, texts, tokens


def _expected_events(updates: list, meta, tokens: int) -> list:
    """What the stream must hold, built from OpenAI's documented chunk shapes (not from the library's code):
    parsed JSON objects with null fields dropped, and the string "[DONE]"."""
    env = {"id": meta.id, "object": "chat.completion.chunk" if meta.chat else "text_completion",
           "created": meta.created, "model": meta.model}
    out = []
    if meta.chat:
        out += [{**env, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]}
                for i in range(meta.num_choices)]
    for u in updates:
        if u.text or u.finish_reason is not None:
            piece = {"delta": {"content": u.text}} if meta.chat else {"text": u.text}
            choice = {"index": u.index, **piece}
            if u.finish_reason is not None:
                choice["finish_reason"] = u.finish_reason
            out.append({**env, "choices": [choice]})
    if meta.include_usage:
        out.append({**env, "choices": [], "usage": {"prompt_tokens": meta.prompt_tokens, "completion_tokens": tokens,
                                                    "total_tokens": meta.prompt_tokens + tokens}})
    return out + ["[DONE]"]


def _drop_nulls(x):
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


def _run_stream(sse_stream: Callable, updates: list, meta) -> list:
    """The student's events for ``updates``, run on an event loop of its own thread (a notebook's kernel already
    runs one in this thread); exceptions from the student's code pass through."""
    import asyncio
    import concurrent.futures
    import inspect

    async def feed():
        for u in updates:
            await asyncio.sleep(0)  # a live stream: the next update is not there yet
            yield u

    async def collect():
        out = sse_stream(feed(), meta)
        if inspect.iscoroutine(out):  # `async def` without `yield` (the stub): awaiting it raises its error
            await out
            raise AssertionError("sse_stream returned a coroutine; expected an async generator: `yield` each "
                                 "event inside `async def`")
        assert hasattr(out, "__aiter__"), (
            f"sse_stream returned {type(out).__name__}; expected an async generator (`async def` with `yield`, "
            "reading the updates with `async for`)")
        return [event async for event in out]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, collect()).result()


def _parse_events(events: list, call: str) -> list:
    """Each event as a parsed JSON object with null fields dropped, or the string "[DONE]"."""
    parsed = []
    for k, e in enumerate(events):
        assert isinstance(e, str) and e.startswith("data: ") and e.endswith("\n\n") and "\n\n" not in e[:-2], (
            f"{call}: event {k} is {e!r}; expected one server-sent event per string: 'data: <JSON>' followed by "
            "a blank line ('\\n\\n') — chunk(...) and event(...) build them")
        data = e[len("data: "):-2]
        if data == "[DONE]":
            parsed.append(data)
            continue
        try:
            parsed.append(_drop_nulls(json.loads(data)))
        except json.JSONDecodeError as err:
            raise AssertionError(f"{call}: event {k} is not JSON ({err}): {e!r}; expected chunk(meta, choices, "
                                 "usage) to write it") from None
    return parsed


def _choice_texts(parsed: list, chat: bool, num_choices: int) -> list[list[str]]:
    texts = [[] for _ in range(num_choices)]
    for e in parsed:
        for c in e.get("choices", []) if isinstance(e, dict) else ():
            piece = c.get("delta", {}).get("content") if chat else c.get("text")
            if piece and 0 <= c.get("index", -1) < num_choices:
                texts[c["index"]].append(piece)
    return texts


def _check_one_stream(sse_stream: Callable, updates: list, meta, texts: list[str], tokens: int) -> None:
    kind = "chat" if meta.chat else "completion"
    call = (f"a {kind} stream of {meta.num_choices} choice(s), {len(updates)} updates, finish "
            f"{sorted({u.finish_reason for u in updates if u.finish_reason})}, include_usage={meta.include_usage}")
    parsed = _parse_events(_run_stream(sse_stream, updates, meta), call)
    expected = _expected_events(updates, meta, tokens)
    assert parsed and parsed[-1] == "[DONE]" and parsed.count("[DONE]") == 1, (
        f"{call}: the last event is {parsed[-1] if parsed else None!r}; expected exactly one 'data: [DONE]', last "
        "(event('[DONE]')): without it a client cannot tell the end of the answer from a dropped connection")
    with_usage = [e for e in parsed if isinstance(e, dict) and "usage" in e]
    if not meta.include_usage:
        assert not with_usage, (
            f"{call}: the stream holds a usage chunk {with_usage[0]}; expected none: the client did not ask for "
            "it (meta.include_usage is False), and OpenAI sends usage in a stream only when asked")
    else:
        want = expected[-2]["usage"]
        assert with_usage and with_usage[-1].get("usage") == want and parsed[-2] is with_usage[-1], (
            f"{call}: the usage chunk is {with_usage[-1] if with_usage else 'missing'}; expected just before "
            f"[DONE] a chunk with no choices and usage {want} (prompt tokens from meta, completion tokens = every "
            "update's token_ids counted, held-back ones and multi-token steps included)")
    if meta.chat:
        got_roles = parsed[: meta.num_choices]
        assert got_roles == expected[: meta.num_choices], (
            f"{call}: the stream starts with {got_roles}; expected first one role chunk per choice, "
            f"{expected[: meta.num_choices]}: the delta {{'role': 'assistant', 'content': ''}} tells the client "
            "whose message the following deltas build")
    got_texts = ["".join(t) for t in _choice_texts(parsed, meta.chat, meta.num_choices)]
    if got_texts != texts:
        i = next(i for i, (a, b) in enumerate(zip(got_texts, texts, strict=True)) if a != b)
        hint = (" — it repeats earlier text: StepOutput.text is already the *new* text of that step, send it as "
                "it is (the client appends)" if len(got_texts[i]) > len(texts[i]) else "")
        raise AssertionError(f"{call}: choice {i}'s pieces join to {got_texts[i]!r}; expected its text "
                             f"{texts[i]!r}{hint}")
    for i in range(meta.num_choices):
        mine = [c for e in parsed if isinstance(e, dict) for c in e.get("choices", []) if c.get("index") == i]
        finish = next(u.finish_reason for u in updates if u.index == i and u.finish_reason)
        reasons = [c.get("finish_reason") for c in mine]
        assert reasons and reasons[-1] == finish and all(r is None for r in reasons[:-1]), (
            f"{call}: choice {i}'s chunks carry finish_reason {reasons}; expected None on each but the last and "
            f"{finish!r} on the last: the client learns from it why the answer ended (stop string or EOS: 'stop', "
            "max_tokens: 'length')")
    for k, e in enumerate(parsed):
        for c in e.get("choices", []) if isinstance(e, dict) else ():
            piece = c.get("delta", {}).get("content") if meta.chat else c.get("text")
            assert piece or c.get("finish_reason") or c.get("delta", {}).get("role"), (
                f"{call}: event {k} is a chunk with no text and no finish_reason ({c}); expected nothing for an "
                "update with neither (a character's bytes or a possible stop string held back): such a chunk "
                "sends bytes and costs every client a JSON parse for nothing")
    for k, (got, want) in enumerate(zip(parsed, expected, strict=False)):
        assert got == want, (
            f"{call}: event {k} is {got}; expected {want} (null fields left out). An update with no text that does "
            "not finish sends nothing; every other update sends exactly one chunk, in order")
    assert len(parsed) == len(expected), (
        f"{call}: {len(parsed)} events; expected {len(expected)}: {expected}")


@exercise("9.3", "minillm.entrypoints.openai.sse.sse_stream", "SSE chunking of a StepOutput stream",
          "one chunk(meta, [choice]) per update with text or a finish_reason (async for over updates), the usage "
          "chunk only if meta.include_usage, event('[DONE]') last")
def check_sse_stream(sse_stream: Callable) -> None:
    """``sse_stream(updates, meta)`` on made-up ``StepOutput`` streams: chat and completions, one choice and
    several (interleaved), stop and length finishes (a last update with and without text), held-back and
    multi-token steps, usage on and off; each event parsed and compared with OpenAI's chunk shapes."""
    from minillm.entrypoints.openai.sse import StreamMeta

    rng = random.Random(93)
    cases = [(True, 1, True, "stop"), (False, 1, False, "length"), (True, 2, False, "length"),
             (False, 3, True, "stop")]
    cases += [(rng.random() < 0.5, rng.randint(1, 3), rng.random() < 0.5, rng.choice(["stop", "length"]))
              for _ in range(8)]
    for chat, num_choices, include_usage, finish in cases:
        updates, texts, tokens = _updates(rng, num_choices, finish)
        meta = StreamMeta(id=f"{'chatcmpl' if chat else 'cmpl'}-{rng.getrandbits(64):016x}",
                          model=rng.choice(["SmolLM2-135M-Instruct", "tiny"]), created=rng.randrange(1, 2 ** 31),
                          chat=chat, num_choices=num_choices, include_usage=include_usage,
                          prompt_tokens=rng.randint(1, 300))
        _check_one_stream(sse_stream, updates, meta, texts, tokens)
    _passed("9.3")


check_prediction_server = prediction_checker(
    "9.0", "prediction_server", "minillm.course.predictions.predict_server_tok_s",
    "the server's output tokens/s at overload", "tokens/s", example=(100.0, 200.0),
    bound=lambda capacity, offered: min(capacity, offered), kind="estimate", factor=4.0)


# ---------------------------------------------------------------------------------------------- 9.4
def challenge_config(knobs: dict):
    """The ``EngineConfig`` of the goodput challenge's ``knobs`` (the engine's defaults for the rest).  Raises
    ``AssertionError`` naming the problem for anything but a dict of ``CHALLENGE_KNOBS`` that ``EngineConfig``
    accepts (its own ``ValueError`` message included)."""
    from minillm.config import EngineConfig
    from minillm.course.challenges import CHALLENGE_KNOBS

    assert isinstance(knobs, dict), f"serving_knobs() returned {knobs!r}: expected a dict of engine options"
    unknown = sorted(set(knobs) - set(CHALLENGE_KNOBS))
    assert not unknown, (f"unknown engine option(s) {unknown}: expected options among {', '.join(CHALLENGE_KNOBS)} "
                         "(EngineConfig's fields for batching, scheduling, the KV budget and the runner)")
    try:
        return EngineConfig(**knobs)
    except (ValueError, TypeError) as e:
        raise AssertionError(f"EngineConfig refuses your options {knobs}: {e} (expected values it accepts)") from None


@exercise("9.4", "minillm.course.challenges.serving_knobs", "your engine options for goodput under the SLO",
          "return a dict of EngineConfig fields (see CHALLENGE_KNOBS): max_num_seqs, max_num_batched_tokens, "
          "chunked_prefill, policy, …; any valid choice passes, the notebook measures its goodput")
def check_serving_knobs(serving_knobs: Callable, measure: Callable | None = None) -> dict:
    """Check that ``serving_knobs()`` is a valid engine configuration; with ``measure`` (options dict → the
    ``ServingReport`` of the notebook's trace replayed under them), replay the trace with the engine's defaults
    and with the student's options and report the goodput each reached.  A low goodput does not fail (it is a
    result, stated by a conclusion line); a configuration that ``EngineConfig`` refuses, or under which the
    trace cannot be served, does.  Returns {"knobs", "default", "tuned"} (the reports None without ``measure``)."""
    knobs = serving_knobs()
    challenge_config(knobs)
    result = {"knobs": dict(knobs), "default": None, "tuned": None}
    if measure is not None:
        from minillm.course.conclusions import conclude

        result["default"] = measure({})
        try:
            result["tuned"] = tuned = measure(dict(knobs))
        except (ValueError, RuntimeError) as e:
            raise AssertionError(f"the trace could not be served with your options {knobs}: {e} (expected options "
                                 "under which every request of the trace fits)") from None
        base = result["default"]
        for name, r in (("engine defaults", base), ("your options", tuned)):
            print(f"{name:16}: goodput {r.goodput_req_s:5.2f} req/s ({r.slo_attainment:4.0%} of requests within "
                  f"the SLO), TTFT p99 {r.latency('ttft')['p99'] * 1e3:6.0f} ms, TPOT p99 "
                  f"{r.latency('tpot')['p99'] * 1e3:5.0f} ms, {r.output_tok_s:6.1f} output tok/s")
        conclude("goodput, your options vs the engine defaults", tuned.goodput_req_s, base.goodput_req_s,
                 expect=">", unit="req/s", held="your options serve more requests within the SLO than the defaults",
                 missed="your options serve no more requests within the SLO than the defaults: read the TTFT and "
                        "TPOT percentiles above to see which limit the misses hit, and tune again")
    _passed("9.4")
    return result


# ---------------------------------------------------------------------------------------------- 9.5
@exercise("9.5", "minillm.sampling.regex.token_mask", "the token mask of a DFA state",
          "walk every token's bytes through table at once, one column at a time, only for the tokens that still "
          "have a byte there (lengths); a token is allowed iff its walk never reaches DEAD and it has bytes")
def check_token_mask(token_mask: Callable) -> None:
    """``token_mask(table, state, token_bytes, lengths)`` on made-up vocabularies (random byte strings, empty
    tokens, tokens past which a walk dies late) for several regexes, in every DFA state, dead one included: each
    mask equals the token-by-token walk (``reference_token_mask``), and a mismatch is explained on its token."""
    import torch

    from minillm.sampling.regex import DEAD, compile_regex, pad_vocabulary, reference_token_mask

    rng = random.Random(94)
    patterns = [r"[0-9]{3}-[0-9]{2}", r"(yes|no|maybe)", r"[a-z]+@[a-z]+\.(com|org)", r"-?[0-9]+(\.[0-9]+)?",
                r"(ab)*c", r"héllo|wörld"]
    pieces = ["1", "12", "123", "-", "-1", "12-", "1-2", "yes", "y", "es", "no", "may", "maybe", "b@", "x.co",
              ".com", "m", "ab", "abab", "abc", "c", "ba", "h", "é", "hé", "llo", "wö", "rld", " ", "3.", ".5"]
    for pattern in patterns:
        dfa = compile_regex(pattern)
        alphabet = sorted({ch for ch in pattern if ch.isalnum() or ch in "-.@ "}) + list("0123456789")
        vocab = [p.encode() for p in pieces] + [b"", None]
        vocab += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))).encode() for _ in range(200)]
        rng.shuffle(vocab)
        token_bytes, lengths = pad_vocabulary(vocab)
        table = dfa.table.clone()
        for state in range(dfa.num_states):
            got = token_mask(table, state, token_bytes, lengths)
            call = f"token_mask(table of {pattern!r}, state {state}, ...)"
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bool and got.shape == (len(vocab),), (
                f"{call} returned {type(got).__name__} {getattr(got, 'dtype', '')} "
                f"{tuple(getattr(got, 'shape', ()))}; expected a bool tensor of shape ({len(vocab)},): one entry "
                "per token")
            assert torch.equal(table, dfa.table), f"{call} changed the transition table: read it, do not write it"
            expected = reference_token_mask(dfa, state, vocab)
            wrong = (got != expected).nonzero().flatten().tolist()
            if wrong:
                t = wrong[0]
                data = vocab[t] or b""
                walk, s = [], state
                for b in data:
                    s = int(dfa.table[s, b])
                    walk.append(s)
                where = (f"token {t} = {data!r} (length {int(lengths[t])}) from state {state}: its bytes lead "
                         f"through states {walk}")
                if not data:
                    raise AssertionError(f"{call}: {where} — a token of length 0 spells nothing and is never "
                                         "allowed, but your mask allows it (expected: refused)")
                if got[t]:
                    raise AssertionError(
                        f"{call}: {where}, reaching DEAD ({DEAD}) at byte {walk.index(DEAD)}, yet your mask allows "
                        "it (expected: refused). Every byte of the token must keep the automaton alive, not only "
                        "the first ones.")
                raise AssertionError(
                    f"{call}: {where} and never reach DEAD ({DEAD}), yet your mask refuses it (expected: allowed). "
                    f"Walk only the token's own {int(lengths[t])} bytes: the zero padding after them in token_bytes "
                    "is not part of the token.")
    _passed("9.5")
