"""SLO-aware admission (load shedding): refuse a request at once when it could not get its first token in time.

A count-bounded queue (``max_queue``) bounds memory, not latency: ten waiting 2,000-token prompts hold a newcomer
a hundred times longer than ten 20-token ones.  What a newcomer waits for is the prefill work queued ahead of it —
and, once all ``max_num_seqs`` seats are taken, for running sequences to finish — and the engine clears both at
rates the loop can watch step by step:

    estimated TTFT = waited + step_s × (1 + steps until a seat frees)
                     + (prompt tokens queued ahead + its own prompt tokens) / prefill tokens per second

The seat term matters because continuous batching with chunked prefill keeps TTFT low under load by slowing every
decode (TPOT) instead — until the batch is full; from then on a newcomer waits for whole answers to end, which the
prefill queue alone does not show.  Each running sequence is assumed to run to its ``max_tokens`` (an upper bound:
EOS may come sooner), one token per step.  The two waits are added, though they partly overlap: the estimate errs
towards shedding.

``waited`` is the time since the request arrived: the loop thread decides between steps, so a request that came
during a long prefill step has already spent part of its budget waiting for it.  ``step_s`` stands for the fixed
cost of the step that carries its last prefill chunk (every running sequence decodes in it too).  Both rates are
exponentially weighted moving averages (EWMA) of recent steps, so the estimate follows the machine: a busier host,
longer decode batches or a slower model lower the measured rate and the server sheds sooner.  Under a TTFT budget
the server answers 429 ("overloaded", with ``Retry-After``) at once instead of letting the request wait past the
SLO — and, since refused requests add no work, the ones it admits keep their TTFT: shedding protects goodput,
where an unbounded queue lets every request miss.

The model is a mean, and an SLO is a tail (p99): host noise, decode batches that grow while a request waits and
steps slowed by other work all make some requests slower than modelled.  So the loop also watches its own error:
when a request's first token comes it compares the TTFT with the model's value at admission, keeps an EWMA of the
ratio and of its deviation (Jacobson's smoothed round-trip time and variance, as TCP sets its retransmission
timeout, RFC 6298: gains 1/8 and 1/4), and scales the model by ``mean + 3 × deviation`` (at least 1): a normal
tail's p99 is its mean + 2.33 σ, about + 2.9 mean absolute deviations.  A steady machine keeps the margin near 1;
a noisy one sheds earlier.

Two deliberate blind spots, both in the request's favour: before any prefill step has been measured everything is
admitted (there is no rate to divide by yet), and a request with nothing queued ahead of it is always admitted,
however long its prompt (refusing it helps no one: it would be refused again forever on an idle server).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TTFTEstimator:
    """Estimates a new request's TTFT from the engine's recent steps and the prefill work queued ahead of it.

    Immutable: ``observe`` returns an updated estimator, so the loop thread can publish each one by rebinding an
    attribute and request handlers on another thread read a consistent value without a lock.

    ``alpha``: the EWMA weight of the newest step (0.2: the last ~5 steps dominate, so a change of load shows up
    within about a second of CPU steps, while one odd step moves the estimate by a fifth only).
    The prefill rate is the ratio of two EWMAs — prefill tokens per step over seconds per step, of the steps that
    prefilled — rather than an average of per-step rates: a step that prefills the 3-token tail of a prompt beside
    thirty decodes says little about throughput and weighs little in the ratio.
    """

    alpha: float = 0.2
    prefill_tokens: float = 0.0  # EWMA of prompt tokens prefilled, over steps that prefilled any
    prefill_s: float = 0.0  # EWMA of those steps' durations
    step_s: float = 0.0  # EWMA of every step's duration
    prefill_steps: int = 0  # steps that prefilled (0: no rate measured yet)
    steps: int = 0
    error: float = 1.0  # EWMA of actual / modelled TTFT
    error_dev: float = 0.0  # EWMA of |ratio - error|
    calibrations: int = 0

    def __post_init__(self):
        if not isinstance(self.alpha, (int, float)) or not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be a number in (0, 1], got {self.alpha!r}")

    def observe(self, prefill_tokens: int, duration_s: float) -> TTFTEstimator:
        """The estimator after one engine step that took ``duration_s`` seconds and prefilled ``prefill_tokens``
        prompt tokens (0 for a decode-only step: then only the step time moves)."""
        if prefill_tokens < 0 or not duration_s >= 0:
            raise ValueError(f"need prefill_tokens >= 0 and duration_s >= 0, got {prefill_tokens}, {duration_s}")
        step_s = _ewma(self.step_s, duration_s, self.alpha, first=self.steps == 0)
        if prefill_tokens == 0:
            return replace(self, step_s=step_s, steps=self.steps + 1)
        first = self.prefill_steps == 0
        return replace(self, step_s=step_s, steps=self.steps + 1, prefill_steps=self.prefill_steps + 1,
                        prefill_tokens=_ewma(self.prefill_tokens, prefill_tokens, self.alpha, first),
                        prefill_s=_ewma(self.prefill_s, duration_s, self.alpha, first))

    @property
    def tokens_per_s(self) -> float | None:
        """Measured prefill throughput (prompt tokens per second); None before any prefill step."""
        if self.prefill_steps == 0 or self.prefill_s <= 0.0:
            return None
        return self.prefill_tokens / self.prefill_s

    def calibrate(self, modelled_s: float, actual_s: float) -> TTFTEstimator:
        """The estimator after a request whose TTFT was modelled as ``modelled_s`` (``model_s`` at admission) got
        its first token after ``actual_s``: the error's mean and deviation move (RFC 6298's gains)."""
        if not modelled_s > 0 or not actual_s >= 0:
            return self  # nothing to learn from a zero model
        ratio = actual_s / modelled_s
        if self.calibrations == 0:  # RFC 6298 2.2: SRTT = R, RTTVAR = R / 2
            return replace(self, error=ratio, error_dev=ratio / 2, calibrations=1)
        dev = 0.75 * self.error_dev + 0.25 * abs(ratio - self.error)
        return replace(self, error=0.875 * self.error + 0.125 * ratio, error_dev=dev,
                       calibrations=self.calibrations + 1)

    @property
    def margin(self) -> float:
        """What the model is multiplied by to cover the tail: ``error + 3 × error_dev``, at least 1."""
        return max(1.0, self.error + 3.0 * self.error_dev) if self.calibrations else 1.0

    def model_s(self, tokens_ahead: int, prompt_tokens: int, waited_s: float = 0.0,
                steps_to_seat: int = 0) -> float | None:
        """The model's TTFT (s), before the margin, of a request with ``prompt_tokens`` prompt tokens behind
        ``tokens_ahead`` queued prefill tokens, that arrived ``waited_s`` seconds ago and gets a seat in the batch
        after ``steps_to_seat`` steps; None before any prefill step has been measured."""
        rate = self.tokens_per_s
        if rate is None:
            return None
        return waited_s + self.step_s * (1 + steps_to_seat) + (tokens_ahead + prompt_tokens) / rate

    def estimate_s(self, tokens_ahead: int, prompt_tokens: int, waited_s: float = 0.0,
                   steps_to_seat: int = 0) -> float | None:
        """The TTFT (s) the request should meet with high probability: ``model_s × margin`` (None: no model)."""
        model = self.model_s(tokens_ahead, prompt_tokens, waited_s, steps_to_seat)
        return None if model is None else model * self.margin

    def admits(self, budget_s: float, tokens_ahead: int, prompt_tokens: int, waited_s: float = 0.0,
               steps_to_seat: int = 0) -> bool:
        """Whether the request fits the TTFT budget — always when nothing is queued ahead (no prefill, a free
        seat) or nothing is measured yet (the module docstring says why)."""
        if tokens_ahead == 0 and steps_to_seat == 0:
            return True
        estimate = self.estimate_s(tokens_ahead, prompt_tokens, waited_s, steps_to_seat)
        return estimate is None or estimate <= budget_s

    def retry_after_s(self, budget_s: float, tokens_ahead: int, prompt_tokens: int, steps_to_seat: int = 0) -> int:
        """Whole seconds until the queue ahead has drained enough for a new request of this size to fit (>= 1):
        the ``Retry-After`` a refused client is told."""
        estimate = self.estimate_s(tokens_ahead, prompt_tokens, 0.0, steps_to_seat)
        excess = 0.0 if estimate is None else estimate - budget_s
        return max(1, math.ceil(excess))


def _ewma(old: float, new: float, alpha: float, first: bool) -> float:
    return float(new) if first else (1.0 - alpha) * old + alpha * new  # the first sample is the start, not 0


def queued_prefill_tokens(scheduler) -> int:
    """Prompt tokens the scheduler still has to prefill: every uncomputed token of waiting sequences (a sequence
    preempted by recompute counts its outputs too: they are prefilled again) and the rest of the prompts of
    running sequences still in prefill.  A decoding sequence's one uncomputed token (its newest sample) is decode
    work, not queued prefill; swapped sequences keep their K/V and need none.

    Reads ``scheduler.waiting`` and ``scheduler.running``: call it on the thread that steps the engine.
    """
    waiting = sum(seq.num_tokens - seq.num_computed for seq in scheduler.waiting)
    running = sum(left for seq in scheduler.running if (left := seq.num_tokens - seq.num_computed) > 1)
    return waiting + running


def steps_to_seat(scheduler, max_num_seqs: int, max_model_len: int) -> int:
    """Engine steps until a newcomer (one sequence) gets one of the ``max_num_seqs`` seats of the running batch:
    0 while seats are free for it and everything queued ahead of it; else the steps until enough running sequences
    have finished, each assumed to run to its ``max_tokens`` (or the ``max_model_len`` context end) at one token
    per step — an upper bound.  When more seats are needed than sequences run, later waves are assumed as long as
    the longest.

    Reads ``scheduler.running``, ``.waiting`` and ``.swapped``: call it on the thread that steps the engine.
    """
    taken = sum(seq.seq_slots for seq in scheduler.running)
    queued = sum(seq.seq_slots for seq in scheduler.waiting) + sum(seq.seq_slots for seq in scheduler.swapped)
    need = queued + 1 - (max_num_seqs - taken)  # sequences that must finish before the newcomer's turn
    if need <= 0 or not scheduler.running:
        return 0
    left = sorted(max(1, min(seq.request.params.max_tokens - len(seq.output), max_model_len - seq.num_tokens))
                  for seq in scheduler.running)
    waves, k = divmod(need - 1, len(left))
    return left[k] + waves * left[-1]


@dataclass(frozen=True)
class AdmissionState:
    """What the loop thread publishes after each iteration: the estimator, the prefill tokens queued then and the
    steps until a newcomer would get a seat."""

    estimator: TTFTEstimator = TTFTEstimator()
    tokens_ahead: int = 0
    steps_to_seat: int = 0
