"""Checkers of notebook 09: serving.

Both exercises live in the load generator (``minillm.perf.bench.serve``).  The checkers do not compare with the
library's function: the arrival schedule is random, so it is held to the statistics it must have (mean gap,
coefficient of variation, determinism per seed); the stream parser gets streams built here from known token
arrival times, so the expected TTFT/TPOT/ITL are computed from how the stream was made.  While a checker runs,
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
