"""What the engine returns, one family used by every path: per-token ``StepOutput`` updates (what ``LLM.stream``
yields, a server streams and the simple loops yield), per-sample ``CompletionOutput``, per-request ``RequestOutput``,
and ``RequestMetrics``."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class RequestMetrics:
    """Per-request timings, measured around the real work (device synchronised by each sampled token)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    start_s: float = 0.0  # perf_counter when the request started running
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list, repr=False)
    # the engine's scheduler fills these (the simple loops leave them at their defaults)
    first_scheduled_s: float | None = None
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    # speculative decoding (EngineConfig.speculative_config): verification steps, drafts proposed and accepted
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def record_token(self, now: float) -> None:
        """Count one output token produced at ``now`` (``time.perf_counter`` seconds)."""
        self.output_tokens += 1
        self.token_times_s.append(now)
        if self.first_token_s is None:
            self.first_token_s = now

    @property
    def ttft_s(self) -> float:
        """Time to first token: the prefill plus the first sample."""
        return (self.first_token_s or self.start_s) - self.start_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (mean inter-token latency); 0 with fewer than 2 tokens."""
        if self.output_tokens < 2 or self.finish_s is None or self.first_token_s is None:
            return 0.0
        return (self.token_times_s[-1] - self.first_token_s) / (self.output_tokens - 1)

    @property
    def queue_s(self) -> float:
        """Arrival to first scheduled step (0 outside the engine)."""
        return (self.first_scheduled_s or self.start_s) - self.start_s

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def latency_s(self) -> float:
        """Arrival (or loop start) to the last token."""
        return (self.finish_s or self.start_s) - self.start_s

    @property
    def decode_tokens_per_s(self) -> float:
        """1 / TPOT: the decode rate after the first token (0 with fewer than 2 tokens)."""
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Speculative decoding: accepted / proposed draft tokens (None when nothing was proposed)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Speculative decoding: tokens per verifying target forward, 1 + accepted / steps (None without any)."""
        return 1 + self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else None

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "latency_s": self.latency_s, "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``): raw (``log_softmax`` of the model's
    logits, before penalties and temperature), its ``rank`` in the vocabulary (1: the most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestOutput:
    """One finished request: the generated ``text`` and ``token_ids``, why it stopped, and its metrics.

    With ``SamplingParams(n > 1)`` the fields describe sample 0 and ``outputs`` holds all n samples
    (``engine.CompletionOutput``: index, text, token_ids, finish_reason, metrics).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens or the context) | "abort" | "error"
    metrics: RequestMetrics = field(repr=False)
    outputs: list = field(default_factory=list, repr=False)
    error: str | None = None  # with finish_reason "error": what failed (the request ended alone, others ran on)
    # SamplingParams(prompt_logprobs=k): per prompt token {token_id: Logprob} (None for the first); else None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)
    logprobs: list[dict[int, Logprob]] | None = field(default=None, repr=False)  # sample 0's (CompletionOutput)


@dataclass
class StepOutput:
    """One new token of sample ``index`` of request ``request_id``, its text delta, and whether it was the last.

    This is what ``LLMEngine.step`` returns, ``LLM.stream`` yields and a server streams.  The last update of a
    sample carries its ``metrics``; a request that fails gets one update per unfinished sample with no token,
    ``finish_reason="error"`` and the message in ``error``.
    """

    request_id: str
    index: int
    token_ids: list[int]  # new this step
    text: str  # text delta ("" without a tokenizer, or while bytes of a character or a stop string are held back)
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    logits: Tensor | None = field(default=None, repr=False)  # [V] fp32, with EngineConfig(return_logits=True)
    metrics: RequestMetrics | None = field(default=None, repr=False)  # on the sample's last update only
    error: str | None = None  # with finish_reason "error"
    logprobs: list[dict[int, Logprob]] | None = field(default=None, repr=False)  # one per token_ids, when asked
    stop_reason: int | str | None = None  # on the last update: the stop token id or stop string that ended it
    # SamplingParams(prompt_logprobs=k): on a sample's first update, the request's prompt logprobs (for echo)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics = field(repr=False)
    error: str | None = None  # with finish_reason "error"
    # SamplingParams(logprobs=k): per output token {token_id: Logprob}, the sampled token first, then the top k
    logprobs: list[dict[int, Logprob]] | None = field(default=None, repr=False)
    stop_reason: int | str | None = None  # the stop_token_ids entry or stop string that ended it (None: EOS, length)


@dataclass(frozen=True)
class EngineState:
    """The engine's load at one moment (``LLMEngine.state()``): what a server exports as gauges and an operator
    watches — the batch, the queue, KV-block use, prefix-cache hits and speculation, since the engine started."""

    running: int = 0  # sequences in the running batch
    waiting: int = 0  # sequences waiting for admission (incl. recompute-preempted ones)
    swapped: int = 0  # sequences swapped out to host memory
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_tokens_total: int = 0  # tokens the device pool holds: blocks × block_size
    kv_max_full_sequences: int = 0  # max_model_len-token sequences that fit the pool at once
    prefix_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / prompt tokens looked up
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, served from it
    steps: int = 0
    preemptions: int = 0
    spec_verify_steps: int = 0  # speculative decoding: sequence-steps that verified drafts
    spec_draft_tokens: int = 0  # drafts proposed
    spec_accepted_tokens: int = 0  # drafts the target accepted

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts (None before any, or without speculation)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None
