"""Speculative decoding in the engine: draft tokens are scheduled tokens.

    schedule() → ``SpecDecoder.propose``: for each decoding sequence, ≤ γ drafts, KV slots for them, the chunk
    becomes [last, x_1..x_γ] → ``ModelRunner.run``: the step's ONE packed forward with logits at every row of those
    chunks, then the rejection rule over every draft chunk → ``SpecDecoder.rollback``: free the rejected drafts'
    slots (``BlockManager.truncate``) → the engine commits the kept tokens one at a time → ``SpecDecoder.record``.

Why this shape (vLLM v1's): a draft chunk is just a prefill chunk of γ + 1 tokens (causal attention over the
sequence's blocks), which the runner already packs beside everything else scheduled; only the LM head must run on
every row of the chunk instead of the last (``ScheduledSeq.num_logit_rows``).  Committing one token at a time
through the scheduler's own ``postprocess`` reuses every stop rule — EOS, max_tokens, the context end, stop strings
in the detokenizer — so a run can never emit past them, and ``mark_computed`` only ever covers committed tokens, so
the prefix cache never hashes a draft.  The drafts are never in ``seq.token_ids``: they travel in the
``ScheduledSeq``.  On CPU the fused native step runs draft chunks as rows (``NativeRunner``), so verifying γ drafts
costs about one decode step.

Which sequences speculate: single-sample chunks that end at the sequence's last token (decodes; not a parent about
to fork), with γ cut so that prompt + output never passes max_tokens or the context, the step's token budget
holds, and free blocks suffice without preempting anyone (else the sequence decodes plainly this step).  If the
speculative forward raises, the drafts are rolled back and the engine reruns the step plainly (its fault
isolation then finds the culprit).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable

from minillm.config import SpeculativeConfig
from minillm.engine.scheduler import ScheduledSeq, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.kv.block_manager import BlockManager
from minillm.kv.paged_cache import PagedKVCache
from minillm.sampling.rejection import rejection_sample
from minillm.spec.build import build_proposer
from minillm.spec.proposer import Proposer, SpecStats, TargetKV


class SpecDecoder:
    """The proposer for ``config``, the steps around the engine's forward, and ``stats`` over the engine's life.

    The three parts are backends passed in (the course swaps its own versions in; the defaults are the library's):
    ``proposer`` (a ``Proposer``; default: the one ``config`` names), ``verify`` (``rejection_sample``'s
    signature: the runner applies it to every draft chunk) and ``truncate`` (``BlockManager.truncate``'s, called as
    ``truncate(block_manager, seq_id, n)``).
    """

    def __init__(self, config: SpeculativeConfig, model, max_model_len: int, *, proposer: Proposer | None = None,
                 verify: Callable[..., list[int]] = rejection_sample,
                 truncate: Callable[[BlockManager, Hashable, int], None] = BlockManager.truncate):
        self.config, self.max_model_len = config, max_model_len
        self.proposer = proposer if proposer is not None else build_proposer(config, model, max_model_len)
        self.verify, self.truncate = verify, truncate
        self.stats = SpecStats()

    # ---- before the forward ----------------------------------------------------------------------------------
    def propose(self, out: SchedulerOutput, kv: PagedKVCache, block_manager: BlockManager,
                token_budget: int) -> tuple[SchedulerOutput, float]:
        """-> (``out`` with drafts scheduled, seconds spent in the proposer): each eligible decode becomes a draft chunk
        [last, x_1..x_k] whose drafts have KV slots (their copy-on-write copies appended to the step's copies).
        ``token_budget``: tokens the step may still add. A proposer that ``reads_target_kv`` (a self-drafter) copies the
        committed context's K/V from ``kv``, so the step's block copies run first (then the returned output carries none
        of them)."""
        if self.proposer.reads_target_kv:  # swap-ins and copy-on-write must have landed before it reads
            kv.copy_blocks(out.copies)
            out = dataclasses.replace(out, scheduled=list(out.scheduled), copies=[])
        chosen, caps = self._eligible(out, token_budget)
        if not chosen:
            return out, 0.0
        start = time.perf_counter()
        target = TargetKV(kv, block_manager) if self.proposer.reads_target_kv else None
        proposal = self.proposer.propose([out.scheduled[i].seq for i in chosen], caps, target)
        draft_s = time.perf_counter() - start
        scheduled, copies, drafted = list(out.scheduled), list(out.copies), 0
        for i, k, d, q in zip(chosen, caps, proposal.tokens, proposal.probs, strict=True):
            d, s = list(d[:k]), out.scheduled[i]
            if not d or not block_manager.can_append(s.seq.seq_id, len(d)):
                continue  # no guess, or no free blocks: decode plainly rather than preempt anyone
            copies += block_manager.append_slots(s.seq.seq_id, d)
            scheduled[i] = ScheduledSeq(s.seq, s.start, 1 + len(d), tuple(d), None if q is None else q[: len(d)])
            drafted += 1
        self.stats.skipped_steps += len(chosen) - drafted
        return dataclasses.replace(out, scheduled=scheduled, copies=copies), draft_s

    def _eligible(self, out: SchedulerOutput, budget: int) -> tuple[list[int], list[int]]:
        """-> (indices in ``out.scheduled`` of the chunks that may speculate, the most drafts each may take)."""
        chosen, caps = [], []
        for i, s in enumerate(out.scheduled):
            seq = s.seq
            if budget <= 0:
                break
            if s.num_tokens != 1 or not s.samples or s.num_samples != 1 or seq.request.needs_fork \
                    or seq.request.params.processes_logits:  # penalties etc.: decoded plainly, without drafts
                continue
            if seq.matcher is not None:  # guided: the drafts' rows would need masks of states not reached yet
                continue
            room = min(seq.request.params.max_tokens - len(seq.output), self.max_model_len - seq.num_tokens) - 1
            k = min(self.config.num_speculative_tokens, room, budget)
            if k >= 1:
                chosen.append(i)
                caps.append(k)
                budget -= k
        return chosen, caps

    # ---- after the forward -----------------------------------------------------------------------------------
    def rollback(self, block_manager: BlockManager, chunk: ScheduledSeq, tokens: list[int] | None) -> None:
        """Free the slots of a draft chunk's rejected drafts: keep the last token + the accepted drafts (their K/V is
        right).  ``tokens``: the verified tokens (accepted drafts + one); None when the step failed (all go)."""
        kept = len(tokens) - 1 if tokens is not None else 0
        self.truncate(block_manager, chunk.seq.seq_id, chunk.seq.num_tokens + kept)

    def without_drafts(self, out: SchedulerOutput, block_manager: BlockManager) -> SchedulerOutput:
        """After a failed speculative forward: every draft rolled back, the step as it was scheduled, its block
        copies dropped (they ran before the forward and must not run twice)."""
        scheduled = []
        for s in out.scheduled:
            if s.drafts:
                self.rollback(block_manager, s, None)
                s = ScheduledSeq(s.seq, s.start, s.num_tokens - len(s.drafts))
            scheduled.append(s)
        return dataclasses.replace(out, scheduled=scheduled, copies=[])

    def record(self, seq: Sequence, num_drafts: int, tokens: list[int], emitted: int) -> None:
        """Count one verification of ``seq``: ``num_drafts`` proposed, ``tokens`` verified (accepted + one),
        ``emitted`` of them committed (fewer when a stop rule ended the run); release a finished sequence."""
        m, s = seq.metrics, self.stats
        m.spec_verify_steps += 1
        m.spec_draft_tokens += num_drafts
        m.spec_accepted_tokens += len(tokens) - 1
        s.verify_steps += 1
        s.draft_tokens += num_drafts
        s.accepted_tokens += len(tokens) - 1
        s.emitted_tokens += emitted
        if seq.status.finished:
            self.proposer.release(seq)

    def record_step(self, draft_s: float, verify_s: float, step_s: float) -> None:
        """Time one engine step that verified drafts: ``draft_s`` in the proposer, ``verify_s`` in the target's
        forward and the rejection rule, ``step_s`` the whole step."""
        st = self.stats
        st.spec_steps += 1
        st.draft_s += draft_s
        st.verify_s += verify_s
        st.step_s += step_s
