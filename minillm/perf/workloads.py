"""Request traces: when requests arrive, how long their prompts are, how many tokens they ask for.

A serving benchmark is only as honest as its trace.  Three properties decide what batching and caching can win:

- **Arrivals.**  Independent users make a Poisson process: exponential gaps with mean 1 / rate.  ``rate=inf``
  puts every request at t = 0 (an offline batch job: throughput is then the machine's capacity).
- **Output lengths.**  Chat traffic has a long tail: most answers are short, a few are long.  Static batching
  makes every request in a batch wait for the longest one (the "bubble"), so the tail is what continuous
  batching wins back.  ``mixture_lengths`` (e.g. 90 % short, 10 % long) makes the tail explicit;
  ``lognormal_lengths`` is the smooth version.
- **Shared prefixes.**  System prompts and documents repeat across requests; ``shared_prefix_trace`` builds
  prompts whose first ``shared_fraction`` of tokens is common, which the prefix cache turns into skipped prefill.

Prompts are token ids cut from a corpus: real text (``corpus_token_ids``: CPython's ``pydoc_data.topics``, ~465 KB
of English that is always installed, through the model's tokenizer) or uniform random ids
(``random_corpus``) when there is no tokenizer.  Every generator takes a ``seed``: the same seed gives the same
trace on every machine (``random.Random``, whose algorithms Python keeps stable across versions).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace: it arrives ``arrival_s`` seconds after the trace starts, sends
    ``prompt_token_ids`` and wants exactly ``max_tokens`` output tokens (replays ignore EOS, so lengths are the
    trace's, not the model's)."""

    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    def __post_init__(self):
        if not (self.arrival_s >= 0 and math.isfinite(self.arrival_s)):
            raise ValueError(f"RequestSpec.arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError("RequestSpec.prompt_token_ids must hold at least one token")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"RequestSpec.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        """Tokens the request occupies in the KV cache when it finishes: prompt + output."""
        return self.prompt_len + self.max_tokens


Trace = list[RequestSpec]


# ---------------------------------------------------------------------------------------------- arrivals
def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of ``n`` requests from a Poisson process of ``rate`` requests/s, sorted.

    Gaps are exponential with mean 1 / rate; the first request arrives after one gap.  ``rate=math.inf``
    gives n zeros (everything waiting at t = 0).
    """
    _check_count(n)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (math.inf for all at t=0), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


# ---------------------------------------------------------------------------------------------- lengths
def uniform_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """``n`` lengths drawn uniformly from the integers ``lo..hi`` (both included)."""
    _check_count(n)
    _check_range(lo, hi)
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def mixture_lengths(n: int, short: tuple[int, int] = (8, 32), long: tuple[int, int] = (128, 256),
                    long_fraction: float = 0.1, seed: int = 0) -> list[int]:
    """A long-tailed mix: each length is long (uniform in ``long``) with probability ``long_fraction``, else short
    (uniform in ``short``).

    The default 90 / 10 mix of 8–32 and 128–256 tokens has mean ≈ 37 and max/mean ≈ 7: in a static batch of 32,
    the chance that some request is long is 1 − 0.9³² ≈ 97 %, so nearly every batch runs ~200 steps to produce
    ~1 200 tokens — the bubble continuous batching removes.  Draws are independent, so the long ones land at
    random positions in the trace.
    """
    _check_count(n)
    _check_range(*short)
    _check_range(*long)
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction!r}")
    rng = random.Random(seed)
    return [rng.randint(*(long if rng.random() < long_fraction else short)) for _ in range(n)]


def lognormal_lengths(n: int, median: float, sigma: float, lo: int = 1, hi: int = 4096, seed: int = 0) -> list[int]:
    """Lengths ``exp(N(ln median, sigma²))`` rounded and clipped to ``lo..hi``.

    Mean = median · e^(σ²/2) (before clipping); σ = 1 puts the p99 near 10× the median — a smooth long tail.
    """
    _check_count(n)
    _check_range(lo, hi)
    if not (median > 0 and sigma >= 0):
        raise ValueError(f"need median > 0 and sigma >= 0, got median={median!r}, sigma={sigma!r}")
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- prompt text
def corpus_token_ids(tokenizer, max_chars: int = 200_000) -> list[int]:
    """Real English as token ids: the first ``max_chars`` characters of CPython's ``pydoc_data.topics`` (the help
    texts of the language reference, always installed), tokenized without special tokens."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:max_chars]
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def random_corpus(vocab_size: int, n: int = 65_536, seed: int = 0, low: int = 0) -> list[int]:
    """``n`` token ids uniform in ``low..vocab_size - 1``: a stand-in corpus for tests and tokenizer-less models."""
    _check_count(n)
    _check_range(low, vocab_size - 1)
    rng = random.Random(seed)
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def _slice(corpus: Sequence[int], length: int, rng: random.Random) -> tuple[int, ...]:
    if length > len(corpus):
        raise ValueError(f"a {length}-token prompt needs a corpus of at least {length} tokens, got {len(corpus)}")
    start = rng.randrange(len(corpus) - length + 1)
    return tuple(corpus[start : start + length])


# ---------------------------------------------------------------------------------------------- traces
def make_trace(arrivals: Sequence[float], prompt_lens: Sequence[int], output_lens: Sequence[int],
               corpus: Sequence[int], seed: int = 0) -> Trace:
    """Zip arrival times and lengths into a trace; each prompt is a slice of ``corpus`` at a random offset."""
    if not len(arrivals) == len(prompt_lens) == len(output_lens):
        raise ValueError(f"need as many arrivals ({len(arrivals)}), prompt lengths ({len(prompt_lens)}) and output "
                         f"lengths ({len(output_lens)})")
    rng = random.Random(seed)
    return sorted((RequestSpec(a, _slice(corpus, p, rng), o)
                   for a, p, o in zip(arrivals, prompt_lens, output_lens, strict=True)),
                  key=lambda r: r.arrival_s)


def skewed_trace(n: int, corpus: Sequence[int], *, rate: float = math.inf, prompt_len: tuple[int, int] = (16, 48),
                 short: tuple[int, int] = (8, 32), long: tuple[int, int] = (128, 256), long_fraction: float = 0.1,
                 seed: int = 0) -> Trace:
    """The batching trace: Poisson arrivals at ``rate`` (default: all at t = 0), uniform prompt lengths, and the
    long-tailed ``mixture_lengths`` outputs.  Sub-seeds keep arrivals, lengths and text independent."""
    return make_trace(poisson_arrivals(n, rate, seed), uniform_lengths(n, *prompt_len, seed=seed + 1),
                      mixture_lengths(n, short, long, long_fraction, seed=seed + 2), corpus, seed=seed + 3)


def shared_prefix_trace(n: int, corpus: Sequence[int], *, prompt_len: int = 569, shared_fraction: float = 0.9,
                        max_tokens: int = 4, rate: float = math.inf, seed: int = 0) -> Trace:
    """``n`` prompts of ``prompt_len`` tokens whose first ``round(shared_fraction · prompt_len)`` tokens are one
    common prefix (a system prompt or a document) and whose suffixes are distinct slices of the corpus.

    The defaults (512 shared of 569 tokens — 32 whole 16-token blocks — and 4 output tokens) make TTFT mostly
    prefill: a prefix-cache hit skips the 512 shared tokens' prefill and computes the 57 distinct ones.
    """
    _check_count(n)
    if not 0 <= shared_fraction < 1:
        raise ValueError(f"shared_fraction must be in [0, 1) (each prompt needs a distinct suffix), "
                         f"got {shared_fraction!r}")
    prefix_len = round(shared_fraction * prompt_len)
    rng = random.Random(seed)
    prefix = _slice(corpus, prefix_len, rng)
    suffixes: dict[tuple[int, ...], None] = {}  # insertion-ordered set
    for _ in range(100 * n):  # distinct, so no request is another's exact copy
        if len(suffixes) == n:
            break
        suffixes[_slice(corpus, prompt_len - prefix_len, rng)] = None
    if len(suffixes) < n:
        raise ValueError(f"could not cut {n} distinct {prompt_len - prefix_len}-token suffixes from a "
                         f"{len(corpus)}-token corpus; use a larger corpus or a longer suffix")
    arrivals = poisson_arrivals(n, rate, seed + 1)
    return [RequestSpec(a, prefix + s, max_tokens) for a, s in zip(arrivals, suffixes, strict=True)]


# ---------------------------------------------------------------------------------------------- statistics
def shared_prefix_len(trace: Sequence[RequestSpec]) -> int:
    """Length of the longest prefix common to every prompt of the trace."""
    prompts = [r.prompt_token_ids for r in trace]
    if not prompts:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def trace_stats(trace: Sequence[RequestSpec]) -> dict[str, float]:
    """Summary of a trace: counts, arrival rate (requests/s over the arrival span), length means and maxima,
    and the shared prefix as a fraction of the mean prompt length."""
    if not trace:
        raise ValueError("trace_stats of an empty trace is undefined")
    arrivals = [r.arrival_s for r in trace]
    span = max(arrivals) - min(arrivals)
    prompts, outputs = [r.prompt_len for r in trace], [r.max_tokens for r in trace]
    return {"requests": len(trace), "arrival_span_s": span,
            "arrival_rate": (len(trace) - 1) / span if span > 0 else math.inf,
            "prompt_mean": statistics.fmean(prompts), "prompt_max": max(prompts),
            "output_mean": statistics.fmean(outputs), "output_max": max(outputs),
            "output_tokens": sum(outputs), "prompt_tokens": sum(prompts),
            "shared_prefix_fraction": shared_prefix_len(trace) / statistics.fmean(prompts)}


def _check_count(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"the number of requests must be an int >= 0, got {n!r}")


def _check_range(lo: int, hi: int) -> None:
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
        raise ValueError(f"need ints 0 <= lo <= hi, got lo={lo!r}, hi={hi!r}")
