"""A request and its sequences: token ids, state, metrics — what the scheduler moves between its queues.

A request (one prompt, one ``SamplingParams``) owns ``n`` sequences: one until its prompt is prefilled, then ``n``
that share the prompt's KV blocks (``BlockManager.fork``).  Every sequence is in one ``SequenceStatus``:

    WAITING ──admit──▶ RUNNING ──EOS / stop / max_tokens──▶ FINISHED_*   (abort / error: from any state)
       ▲                  │  ▲
       └──preempt (recompute): blocks freed, outputs kept, prefilled again later
                          └──preempt (swap)──▶ SWAPPED ──swap in──┘

A sequence is always fed ``token_ids[num_computed : num_computed + k]``: a decode (k = 1), a prefill chunk and a
re-prefill after preemption are the same operation, and the sequence samples when the chunk reaches its last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from minillm.outputs import RequestMetrics
from minillm.sampling.params import SamplingParams


class SequenceStatus(Enum):
    """Where a sequence is in its life; the three FINISHED_* values are final."""

    WAITING = "waiting"  # queued: never run, or preempted by recompute (its output tokens are kept)
    RUNNING = "running"  # holds device KV blocks
    SWAPPED = "swapped"  # preempted by swap: its KV blocks wait in host memory
    FINISHED_STOPPED = "stop"  # EOS or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context end
    FINISHED_ABORTED = "abort"  # LLMEngine.abort
    FINISHED_ERROR = "error"  # running, sampling or detokenizing this request raised: it ends alone

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR)


@dataclass(eq=False)
class Request:
    """One prompt and its parameters; ``seqs`` grows from 1 to ``params.n`` when the prompt is prefilled."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    generators: list[torch.Generator | None]  # one per sample (sample_seed(seed, i)) when seeded
    order: int = 0  # arrival counter: breaks arrival-time ties first-come-first-served
    prompt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    # SamplingParams(prompt_logprobs=k): [None] + {token_id: Logprob} per prompt token scored so far; else None
    prompt_logprobs: list | None = None
    matchers: list | None = None  # guided decoding: one xgrammar GrammarMatcher per sample, advanced per token

    @property
    def needs_fork(self) -> bool:
        """Still one sequence but ``n`` samples wanted: the next sample after the prompt is taken ``n`` times."""
        return len(self.seqs) < self.params.n

    @property
    def finished(self) -> bool:
        return not self.needs_fork and all(s.status.finished for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt + output token ids, and how many of them have K/V written."""

    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    metrics: RequestMetrics
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # leading tokens whose K/V is in the cache
    logprobs: list | None = None  # SamplingParams(logprobs=k): {token_id: Logprob} per output token

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generators[self.index]

    @property
    def matcher(self):
        """This sample's grammar matcher (guided decoding), or None."""
        return None if self.request.matchers is None else self.request.matchers[self.index]

    @property
    def priority(self) -> tuple[float, int, int]:
        """Smaller runs first: first come, first served; the newest is the preemption victim."""
        return (self.request.arrival_time, self.request.order, self.index)

    @property
    def seq_slots(self) -> int:
        """Slots of ``max_num_seqs`` this sequence holds: an unforked parent reserves its future siblings'."""
        return self.request.params.n if self.request.needs_fork else 1

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
