"""The scheduler: which tokens of which sequences (``sequence.py``) run in each engine step.

Each step the scheduler spends a budget of ``max_num_batched_tokens`` tokens: running decodes first (1 token
each; when blocks run out the *newest* running sequence is preempted), then prefill chunks of running sequences,
then swapped sequences come back, then waiting ones are admitted first-come-first-served.  A sequence is always
fed the tokens ``token_ids[num_computed : num_computed + k]``; it samples when that reaches its last token, so a
decode, a prefill chunk and a re-prefill after preemption are the same operation.  The scheduler moves no
tensors: K/V copies it asks for (copy-on-write, swap) are listed in ``SchedulerOutput.copies`` for the runner.

Static and dynamic batches keep their shape by default (``EngineConfig.pad_batches``): each finished member of the
batch in flight adds one pad row to every later step of that batch (``SchedulerOutput.num_padding``), which the
runner computes and discards — the bubble of a padded batch.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from torch import Tensor

from minillm.config import EngineConfig
from minillm.engine.logprobs import prompt_logit_rows, wants_prompt_rows
from minillm.engine.sequence import Request, Sequence, SequenceStatus
from minillm.kv.block_allocator import BlockCopy
from minillm.kv.block_manager import BlockManager, OutOfBlocks
from minillm.kv.eviction import EvictionPolicy
from minillm.outputs import RequestMetrics
from minillm.sampling.params import SamplingParams, finish_reason

__all__ = ["Policy", "Request", "ScheduledSeq", "Scheduler", "SchedulerOutput", "SchedulerStats", "Sequence",
           "RequestMetrics", "SequenceStatus", "prefill_chunk_len"]


class Policy(Enum):
    """When waiting requests may start (``EngineConfig.policy``)."""

    CONTINUOUS = "continuous"  # every step
    DYNAMIC = "dynamic"  # as a batch, once it is full or the window since the oldest arrival has passed
    STATIC = "static"  # as a batch, as soon as the previous batch has entirely finished


@dataclass(frozen=True)
class ScheduledSeq:
    """Feed ``seq.token_ids[start : start + num_tokens]`` at positions ``start …`` this step.

    A speculating decode also feeds ``drafts`` (a proposer's guesses, not yet the sequence's tokens) after its last
    token: ``num_tokens`` = 1 + len(drafts) rows, and the runner returns the target's logits at every one of them
    (``draft_probs`` [len(drafts), V]: the distributions the drafts were sampled from; None for a deterministic
    proposer or greedy requests)."""

    seq: Sequence
    start: int
    num_tokens: int
    drafts: tuple[int, ...] = ()
    draft_probs: Tensor | None = field(default=None, compare=False, repr=False)
    prompt_logit_rows: int = 0  # prompt_logprobs: rows before the sampling row scored too (engine/logprobs.py)

    @property
    def token_ids(self) -> list[int]:
        """The ids fed this step: the sequence's own, then the drafts."""
        end = self.start + self.num_tokens - len(self.drafts)
        return self.seq.token_ids[self.start : end] + list(self.drafts)

    @property
    def samples(self) -> bool:
        """Whether this chunk ends at the sequence's last token, so its logits give the next token."""
        return self.start + self.num_tokens - len(self.drafts) == self.seq.num_tokens

    @property
    def num_samples(self) -> int:
        """Tokens to draw from the last row: ``n`` for a parent about to fork, else 1."""
        return self.seq.request.params.n if self.samples and self.seq.request.needs_fork else 1

    @property
    def num_logit_rows(self) -> int:
        """Rows whose logits the step needs, the chunk's last: its ``prompt_logit_rows``, then when it samples the
        last (1 + the drafts, each verified)."""
        return self.prompt_logit_rows + (1 + len(self.drafts) if self.samples else 0)


@dataclass
class SchedulerOutput:
    """One step's work: the chunks to run (decodes first), K/V block copies to run before them (in order)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_padding: int = 0  # static/dynamic with pad_batches: rows of finished batch members, computed and discarded

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters over the scheduler's life (for tests, benchmarks and notebook plots)."""

    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    swaps_out: int = 0
    peak_used_blocks: int = 0
    peak_running: int = 0
    padding_rows: int = 0  # pad rows computed for finished members of fixed-shape batches


def prefill_chunk_len(remaining: int, budget: int, max_num_batched_tokens: int, chunked_prefill: bool = True) -> int:
    """How many of a sequence's ``remaining`` uncomputed tokens to feed this step, with ``budget`` tokens of the
    step's ``max_num_batched_tokens`` left (0: none, the sequence waits for a later step).

    With ``chunked_prefill`` a prompt takes whatever the budget allows and continues next step.  Without it a
    prompt runs whole or not at all: 0 when it does not fit the budget left.  One exception: a sequence longer
    than a whole step's budget (a long re-prefill after a recompute preemption) could then never run, so it is
    split anyway — but only from a fresh, untouched budget (``budget == max_num_batched_tokens``).
    """
    if remaining < 1 or budget < 0 or not 0 <= budget <= max_num_batched_tokens:
        raise ValueError(f"need remaining >= 1 and 0 <= budget <= max_num_batched_tokens, got remaining={remaining}, "
                         f"budget={budget}, max_num_batched_tokens={max_num_batched_tokens}")
    ### BEGIN SOLUTION
    n = min(remaining, budget)
    if n < remaining and not chunked_prefill:  # it would be split, which only an over-long sequence may be
        never_whole = remaining > max_num_batched_tokens
        if not (never_whole and budget == max_num_batched_tokens):
            return 0
    return n
    ### END SOLUTION


class Scheduler:
    """Owns the requests, their queues and the ``BlockManager``; ``schedule`` then ``postprocess`` each step.

    ``num_blocks`` device KV blocks (``num_host_blocks`` for swapping); ``max_model_len`` caps prompt + output;
    ``eos_token_ids`` end a sequence unless its params say ``ignore_eos``; ``eviction``: the block manager's
    ``kv.eviction`` policy (sliding window, sinks, H2O), None to keep every block.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, *, num_host_blocks: int = 0,
                 eos_token_ids: tuple[int, ...] = (), eviction: EvictionPolicy | None = None):
        self.config = config
        self.policy = Policy(config.policy)
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size, num_host_blocks=num_host_blocks,
                                          enable_prefix_caching=config.enable_prefix_caching, eviction=eviction)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Sequence] = deque()  # admission order (recompute-preempted ones at the front)
        self.running: list[Sequence] = []  # sorted by priority: oldest first, preemption victim last
        self.swapped: list[Sequence] = []  # sorted by priority
        self.batch: set[str] | None = None  # static/dynamic: ids of the unfinished requests of the batch in flight
        self.batch_finished_rows = 0  # ... and how many of its sequences have finished (their rows pad the batch)
        self.stats = SchedulerStats()
        self._seq_ids = itertools.count()
        self._order = itertools.count()

    # ---- requests ------------------------------------------------------------------------------------------------
    def check(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ``ValueError`` if a request could never run under this configuration, whatever else is running."""
        c, bm = self.config, self.block_manager
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use; pass a new one or let the engine pick")
        if params.n > c.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n={params.n} parallel samples exceed max_num_seqs="
                             f"{c.max_num_seqs}; lower n or raise max_num_seqs")
        if not c.chunked_prefill and num_prompt_tokens > c.max_num_batched_tokens:
            raise ValueError(f"request {request_id!r}: a {num_prompt_tokens}-token prompt exceeds "
                             f"max_num_batched_tokens={c.max_num_batched_tokens} and chunked_prefill=False never "
                             "splits a prompt; enable chunked_prefill or raise max_num_batched_tokens")
        # The last sampled token is never fed back, so a sequence needs slots for at most len - 1 tokens.
        slots = min(num_prompt_tokens + params.max_tokens, self.max_model_len) - 1
        need = bm.max_blocks(num_prompt_tokens, slots)
        if need > bm.device.num_blocks:
            raise ValueError(f"request {request_id!r}: a {num_prompt_tokens}-token prompt with max_tokens="
                             f"{params.max_tokens} needs up to {need} KV blocks of {bm.block_size} tokens but the "
                             f"whole KV cache has {bm.device.num_blocks}; lower max_tokens, shorten the prompt, or "
                             "give the engine more KV memory (EngineConfig.num_kv_blocks or kv_cache_bytes)")

    def add(self, request: Request) -> None:
        """Queue a request (after ``check``); its first sequence waits for admission."""
        self.check(request.request_id, len(request.prompt_token_ids), request.params)
        request.order = next(self._order)
        seq = Sequence(next(self._seq_ids), request, 0, list(request.prompt_token_ids), len(request.prompt_token_ids),
                       RequestMetrics(prompt_tokens=len(request.prompt_token_ids), start_s=request.arrival_time))
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        self.waiting.append(seq)

    def abort(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED) -> None:
        """Finish every sequence of a request as aborted (or ``FINISHED_ERROR``) and free its blocks (device and
        host).  A parent not yet forked ends the request: its siblings will never be made."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown or already finished request {request_id!r}")
        for seq in request.seqs:
            if not seq.status.finished:
                self.finish(seq, status)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, seq: Sequence, status: SequenceStatus, now: float | None = None) -> None:
        """End a sequence: leave its queue, free its blocks; the request ends with its last sequence."""
        if not status.finished:
            raise ValueError(f"finish() needs a FINISHED_* status, got {status}")
        if seq.status.finished:
            seq.status = status  # relabel only (a stop string found in the token that hit max_tokens)
            return
        queue = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                 SequenceStatus.SWAPPED: self.swapped}[seq.status]
        queue.remove(seq)
        if seq.seq_id in self.block_manager:
            self.block_manager.free(seq.seq_id)
        seq.status = status
        if now is not None:
            seq.metrics.finish_s = now
        request = seq.request
        if self.batch is not None and request.request_id in self.batch:
            self.batch_finished_rows += 1
        if status in (SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR) or request.finished:
            self.requests.pop(request.request_id, None)
            if self.batch is not None:
                self.batch.discard(request.request_id)

    # ---- scheduling ----------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """Choose this step's chunks within the token, sequence and block budgets (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens  # tokens left this step; each phase returns what it leaves
        self._form_batch(now)
        budget = self._schedule_decodes(out, budget)
        budget = self._schedule_prefills(out, budget)
        if not out.preempted:  # just ran out of blocks: bringing sequences back now would only thrash
            budget = self._swap_in(out, budget)
            if not self.swapped:  # swapped sequences go first: they are older than anything waiting
                self._admit(out, budget, now)
        if self.policy is not Policy.CONTINUOUS and self.config.pad_batches and out.scheduled:
            out.num_padding = self.batch_finished_rows  # a fixed-shape batch: finished rows still run
        s = self.stats
        s.steps += 1
        s.tokens += out.num_tokens
        s.padding_rows += out.num_padding
        s.peak_used_blocks = max(s.peak_used_blocks, self.block_manager.device.num_used)
        s.peak_running = max(s.peak_running, len(self.running))
        return out

    def _needs_slot(self, seq: Sequence) -> bool:
        """A decode: the last sampled token has no KV slot yet (a prefill's tokens got theirs at admission)."""
        return self.block_manager.num_tokens(seq.seq_id) < seq.num_tokens

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        """One token for each running sequence that has sampled, preempting the newest when blocks run out;
        returns the budget left."""
        bm = self.block_manager
        for seq in list(self.running):  # oldest first; victims come off the newest end, so never one scheduled
            if seq.status is not SequenceStatus.RUNNING or not self._needs_slot(seq):
                continue
            if budget == 0:
                return 0
            while not bm.can_append(seq.seq_id, 1):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.copies += bm.append_slots(seq.seq_id, seq.token_ids[bm.num_tokens(seq.seq_id):])
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed, seq.num_tokens - seq.num_computed))
                budget -= out.scheduled[-1].num_tokens
        return budget

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> int:
        """The next chunk of each running sequence still prefilling; returns the budget left."""
        scheduled = {s.seq.seq_id for s in out.scheduled}
        for seq in self.running:
            if seq.seq_id in scheduled or self._needs_slot(seq):
                continue
            if budget == 0:
                return 0
            budget -= self._schedule_chunk(seq, out, budget)
        return budget

    def _schedule_chunk(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        """Schedule as much of ``seq``'s uncomputed tokens as ``budget`` allows; returns how many (0: none)."""
        n = prefill_chunk_len(seq.num_tokens - seq.num_computed, budget, self.config.max_num_batched_tokens,
                              self.config.chunked_prefill)
        if n > 0:
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n,
                                              prompt_logit_rows=prompt_logit_rows(seq, seq.num_computed, n)))
        return n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.running.remove(seq)
        host = bm.host
        if (self.config.preemption == "swap" and host is not None
                and len(bm.sequence(seq.seq_id).block_ids) <= host.num_free):
            out.copies += bm.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.priority)
            self.stats.swaps_out += 1
        else:  # recompute (also when host memory is full): forget the K/V, keep the tokens
            bm.free(seq.seq_id)
            seq.num_computed = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        seq.metrics.num_preemptions += 1
        self.stats.preemptions += 1
        out.preempted.append(seq)

    def _num_seq_slots(self) -> int:
        return sum(s.seq_slots for s in self.running)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped sequences back, oldest first, while slots and blocks allow; returns the budget left."""
        bm = self.block_manager
        while self.swapped:
            seq = self.swapped[0]
            if self._num_seq_slots() + seq.seq_slots > self.config.max_num_seqs or not bm.can_swap_in(seq.seq_id):
                return budget
            out.copies += bm.swap_in(seq.seq_id)
            self.swapped.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.priority)
            if budget == 0:
                continue
            if not self._needs_slot(seq):
                budget -= self._schedule_chunk(seq, out, budget)
            elif bm.can_append(seq.seq_id, 1):  # else it decodes next step, preempting if it must
                out.copies += bm.append_slots(seq.seq_id, seq.token_ids[bm.num_tokens(seq.seq_id):])
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed, seq.num_tokens - seq.num_computed))
                budget -= out.scheduled[-1].num_tokens
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admit waiting sequences into the running batch while seats, KV blocks and ``budget`` allow, scheduling
        each one's first prefill chunk this step (exercise 6.3).

        ``self.waiting`` is a deque in admission order; ``budget`` is what this step's token budget has left after
        the decodes and running prefills.  The contract:
        - first come, first served: only the head of the queue may start; when it cannot, admission stops for this
          step (nothing overtakes it, or a long prompt would starve behind short ones);
        - static/dynamic policies (``self.policy``) start only members of the batch in flight (``self.batch``);
        - a sequence occupies ``seq.seq_slots`` of ``self.config.max_num_seqs`` seats (``self._num_seq_slots()``
          counts those taken) and needs KV blocks for its tokens (``self.block_manager.can_allocate``);
        - without ``chunked_prefill`` its prompt must fit the budget left whole — a prompt longer than a whole
          step's budget is split only from an untouched budget (``prefill_chunk_len``, exercise 6.2);
        - starting it: ``self.block_manager.allocate`` returns how many leading tokens the prefix cache already
          holds; leave the queue, ``self._start_running`` (given those hits), then ``self._schedule_chunk`` spends
          the budget (it returns the tokens it scheduled).
        Returns nothing: the chunks go into ``out.scheduled``.
        """
        ### BEGIN SOLUTION
        bm, c = self.block_manager, self.config
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.policy is not Policy.CONTINUOUS and seq.request.request_id not in (self.batch or ()):
                return  # static/dynamic: only the batch in flight runs, until all of it has finished
            if self._num_seq_slots() + seq.seq_slots > c.max_num_seqs or not bm.can_allocate(seq.token_ids):
                return  # first come, first served: nothing overtakes the head of the queue
            if not c.chunked_prefill and budget < min(seq.num_tokens, c.max_num_batched_tokens):
                return
            hits = bm.allocate(seq.seq_id, seq.token_ids)
            self.waiting.popleft()
            self._start_running(seq, hits, now)
            budget -= self._schedule_chunk(seq, out, budget)
        ### END SOLUTION

    def _start_running(self, seq: Sequence, hits: int, now: float) -> None:
        """``seq`` (just allocated, out of the waiting queue) joins ``running`` with its first ``hits`` tokens
        already in the prefix cache; the first admission sets its scheduling metrics."""
        if hits and wants_prompt_rows(seq):  # prompt logprobs need every prompt row: no prefix-cache hits (vLLM)
            hits = self._without_prefix_hits(seq)
        seq.num_computed = hits
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_s is None:
            seq.metrics.first_scheduled_s = now
            seq.metrics.prefix_hit_tokens = hits
        bisect.insort(self.running, seq, key=lambda s: s.priority)

    def _without_prefix_hits(self, seq: Sequence) -> int:
        """Re-allocate ``seq``'s blocks without prefix-cache hits -> 0.  When the pool cannot hold that, it keeps
        the cached blocks and recomputes them anyway (same tokens, same positions: the same K/V is written)."""
        bm = self.block_manager
        bm.free(seq.seq_id)
        try:
            return bm.allocate(seq.seq_id, seq.token_ids, use_prefix_cache=False)
        except OutOfBlocks:
            bm.allocate(seq.seq_id, seq.token_ids)  # fits: it did a moment ago
            bm.sequence(seq.seq_id).num_computed = 0  # computed again from the start, as mark_computed expects
            return 0

    def _form_batch(self, now: float) -> None:
        """Static/dynamic: when no batch is in flight, start one from the head of the waiting queue."""
        if self.policy is Policy.CONTINUOUS or self.batch or not self.waiting:
            return
        if self.policy is Policy.DYNAMIC:
            full = sum(s.seq_slots for s in self.waiting) >= self.config.max_num_seqs
            oldest = min(s.request.arrival_time for s in self.waiting)
            if not full and now - oldest < self.config.dynamic_window_s:
                return  # keep collecting arrivals
        batch, slots = set(), 0
        for seq in self.waiting:
            if batch and slots + seq.seq_slots > self.config.max_num_seqs:
                break
            batch.add(seq.request.request_id)
            slots += seq.seq_slots
        self.batch = batch
        self.batch_finished_rows = 0

    # ---- after the forward ---------------------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[list[int]], now: float) -> list[tuple[Sequence, int]]:
        """Record the step: computed tokens, sampled tokens (forking parents), finished sequences.

        ``sampled`` has one list per ``ScheduledSeq`` that ``samples`` (in order), of ``num_samples`` tokens.
        Returns (sequence, new token) pairs in order; finished sequences are already released.
        """
        bm = self.block_manager
        new: list[tuple[Sequence, int]] = []
        samplers = [s for s in out.scheduled if s.samples]
        if len(samplers) != len(sampled):
            raise ValueError(f"{len(samplers)} scheduled sequences sample but got {len(sampled)} token lists")
        for s in out.scheduled:
            s.seq.num_computed = s.start + s.num_tokens
            bm.mark_computed(s.seq.seq_id, s.seq.num_computed)
        for s, tokens in zip(samplers, sampled, strict=True):
            if len(tokens) != s.num_samples:
                raise ValueError(f"sequence {s.seq.seq_id} needs {s.num_samples} sampled tokens, got {len(tokens)}")
            seqs = [s.seq] + (self._fork(s.seq, len(tokens) - 1) if len(tokens) > 1 else [])
            new += zip(seqs, tokens, strict=True)
        for seq, token in new:
            seq.token_ids.append(token)
            seq.metrics.record_token(now)
            reason = finish_reason(seq.request.params, token, len(seq.output), seq.num_tokens, self.eos_token_ids,
                                   self.max_model_len)
            if reason is not None:
                self.finish(seq, SequenceStatus(reason), now)
        return new

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        """``count`` siblings sharing the parent's blocks (copy-on-write on their first decode)."""
        request = parent.request
        children = []
        for i in range(1, count + 1):
            m = parent.metrics
            child = Sequence(next(self._seq_ids), request, i, list(parent.token_ids), parent.num_prompt_tokens,
                             RequestMetrics(prompt_tokens=m.prompt_tokens, start_s=m.start_s,
                                             first_scheduled_s=m.first_scheduled_s,
                                             prefix_hit_tokens=m.prefix_hit_tokens),
                             SequenceStatus.RUNNING, parent.num_computed)
            self.block_manager.fork(parent.seq_id, child.seq_id)
            request.seqs.append(child)
            bisect.insort(self.running, child, key=lambda s: s.priority)
            children.append(child)
        return children
