"""Request traces: reproducible from a seed, with the statistics they were asked for."""

import math
import statistics
from types import SimpleNamespace

import pytest

from minillm.perf.workloads import (
    RequestSpec,
    corpus_token_ids,
    lognormal_lengths,
    make_trace,
    mixture_lengths,
    poisson_arrivals,
    random_corpus,
    shared_prefix_len,
    shared_prefix_trace,
    skewed_trace,
    trace_stats,
    uniform_lengths,
)

CORPUS = random_corpus(1000, n=20_000, seed=0)


def test_same_seed_gives_the_same_trace_and_another_seed_a_different_one():
    a = skewed_trace(50, CORPUS, rate=4.0, seed=3)
    assert a == skewed_trace(50, CORPUS, rate=4.0, seed=3)
    assert a != skewed_trace(50, CORPUS, rate=4.0, seed=4)
    assert shared_prefix_trace(5, CORPUS, seed=1) == shared_prefix_trace(5, CORPUS, seed=1)


def test_poisson_arrivals_have_the_requested_rate_and_are_sorted():
    times = poisson_arrivals(4000, rate=5.0, seed=0)
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.05)  # std of the mean: 1/sqrt(4000) ≈ 1.6 %
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.08)  # exponential: sd = mean
    trace = make_trace(times, [4] * 4000, [2] * 4000, CORPUS)
    assert trace_stats(trace)["arrival_rate"] == pytest.approx(5.0, rel=0.05)


def test_infinite_rate_puts_every_request_at_time_zero():
    assert poisson_arrivals(7, math.inf) == [0.0] * 7
    assert trace_stats(skewed_trace(7, CORPUS))["arrival_rate"] == math.inf


def test_mixture_has_the_requested_long_fraction_and_ranges():
    lens = mixture_lengths(5000, short=(8, 32), long=(128, 256), long_fraction=0.1, seed=0)
    long = [n for n in lens if n >= 128]
    assert all(8 <= n <= 32 or 128 <= n <= 256 for n in lens)
    assert len(long) / len(lens) == pytest.approx(0.1, abs=0.015)  # binomial sd ≈ 0.004
    assert statistics.fmean(lens) == pytest.approx(0.9 * 20 + 0.1 * 192, rel=0.05)


def test_lognormal_lengths_have_the_requested_median_and_stay_clipped():
    lens = lognormal_lengths(4001, median=100, sigma=0.8, lo=10, hi=1000, seed=0)
    assert statistics.median(lens) == pytest.approx(100, rel=0.08)
    assert min(lens) >= 10 and max(lens) <= 1000
    assert uniform_lengths(100, 3, 5, seed=0) != uniform_lengths(100, 3, 5, seed=1)


def test_skewed_trace_prompts_are_corpus_slices_of_the_requested_lengths():
    trace = skewed_trace(40, CORPUS, prompt_len=(16, 48), seed=0)
    text = ",".join(map(str, CORPUS))
    for r in trace:
        assert 16 <= r.prompt_len <= 48
        assert ",".join(map(str, r.prompt_token_ids)) in text


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_shared_prefix_trace_shares_the_requested_fraction_and_keeps_suffixes_distinct(fraction):
    trace = shared_prefix_trace(12, CORPUS, prompt_len=569, shared_fraction=fraction, max_tokens=3, seed=0)
    assert all(r.prompt_len == 569 and r.max_tokens == 3 for r in trace)
    assert shared_prefix_len(trace) >= round(fraction * 569)
    assert trace_stats(trace)["shared_prefix_fraction"] == pytest.approx(fraction, abs=0.01)
    assert len({r.prompt_token_ids for r in trace}) == 12


def test_default_shared_prefix_covers_whole_16_token_blocks():
    trace = shared_prefix_trace(3, CORPUS)
    assert shared_prefix_len(trace) >= 512 and trace[0].prompt_len == 569  # 32 full blocks are shareable


def test_corpus_is_real_text_through_the_tokenizer():
    chars = SimpleNamespace(input_ids=None)

    def tokenize(text, add_special_tokens=True):  # one id per character: enough to see the text
        assert not add_special_tokens
        chars.input_ids = [ord(c) for c in text]
        return chars

    ids = corpus_token_ids(tokenize, max_chars=5000)
    text = "".join(map(chr, ids))
    assert len(ids) == 5000 and "the" in text and text.isprintable() is False  # English with newlines


def test_bad_specs_and_parameters_raise_naming_the_problem():
    with pytest.raises(ValueError, match="max_tokens"):
        RequestSpec(0.0, (1, 2), 0)
    with pytest.raises(ValueError, match="arrival_s"):
        RequestSpec(-1.0, (1,), 1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0)
    with pytest.raises(ValueError, match="long_fraction"):
        mixture_lengths(3, long_fraction=1.5)
    with pytest.raises(ValueError, match="corpus"):
        skewed_trace(2, [1, 2, 3], prompt_len=(8, 8))
    with pytest.raises(ValueError, match="distinct"):
        shared_prefix_trace(5, [1] * 600, prompt_len=569)
