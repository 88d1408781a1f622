"""The load generator's bookkeeping: completed / rejected / failed (lost), the SLO verdict and the capacity."""

import pytest

from minillm.perf.bench.serve import RequestResult, capacity_rate, summarize_run


def done(ttft_s: float) -> RequestResult:
    return RequestResult(200, ttft_s=ttft_s, tpot_s=0.05, latency_s=ttft_s + 1.0, output_tokens=10)


def test_refusals_are_rejected_by_status_and_errors_are_lost():
    results = [done(0.1), done(0.2), RequestResult(429, error="overloaded"), RequestResult(503, error="bye"),
               RequestResult(0, error="ConnectError"), RequestResult(200, error="no text in the response")]
    s = summarize_run(results, 10.0, ttft_slo_s=1.0, tpot_slo_s=0.2)
    assert (s["completed"], s["rejected"], s["rejected_429"], s["rejected_503"], s["failed"]) == (2, 2, 1, 1, 2)


def test_the_p99_ttft_verdict_is_over_the_completed_requests_only():
    fast = [done(0.1)] * 99 + [RequestResult(429, latency_s=30.0)] * 50  # the refused ones' waits do not count
    assert summarize_run(fast, 10.0, ttft_slo_s=0.5, tpot_slo_s=0.2)["ttft_p99_within_slo"]
    slow = [done(0.1)] * 90 + [done(2.0)] * 10
    s = summarize_run(slow, 10.0, ttft_slo_s=0.5, tpot_slo_s=0.2)
    assert s["ttft_ms"]["p99"] == pytest.approx(2000) and not s["ttft_p99_within_slo"]
    assert not summarize_run([RequestResult(429)], 1.0, ttft_slo_s=0.5, tpot_slo_s=0.2)["ttft_p99_within_slo"]


def run(rate: float, completed: int, within: bool, n: int = 10) -> dict:
    return {"request_rate": rate, "num_prompts": n, "completed": completed, "ttft_p99_within_slo": within}


def test_capacity_is_the_highest_rate_that_completed_everything_within_the_slo():
    runs = [run(0.5, 10, True), run(1.0, 10, True), run(2.0, 10, False), run(4.0, 7, True)]
    assert capacity_rate(runs) == 1.0  # 2.0 missed the SLO; 4.0 met it only by refusing three
    assert capacity_rate([run(1.0, 10, False)]) is None
