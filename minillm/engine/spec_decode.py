"""The speculative engine step: propose γ tokens, verify them in the step's ONE packed forward, commit.

    schedule() → for each decoding sequence: propose ≤ γ drafts, give them KV slots, feed [last, x_1..x_γ] as one
    chunk beside everything else scheduled → logits at every row of those chunks → ``rejection_sample`` →
    roll back the rejected drafts' slots (``BlockManager.truncate``) → commit the kept tokens one at a time.

Why this shape: a verification chunk is just a prefill chunk of γ + 1 tokens (causal attention over the
sequence's blocks), which the runner already packs; only the LM head must run on every row of the chunk instead of
the last.  Committing one token at a time through the scheduler's own ``postprocess`` (a one-token
``ScheduledSeq`` per token) reuses every stop rule — EOS, max_tokens, the context end, stop strings in the
detokenizer — so a run can never emit past them, and ``mark_computed`` only ever covers committed tokens, so the
prefix cache never hashes a draft.  The drafts are in ``seq.token_ids`` only while the batch is packed.

On CPU, when every other chunk of the step is a one-token decode and the rows fit, the whole step runs through the
fused native decode step (``kernels/cpu/fused.py``, ``ModelRunner.fused_rows``): a row per token, each attending to
the positions before it, so verifying γ drafts costs about one decode step (the weights are read once for all rows).

Which sequences speculate: single-sample chunks that end at the sequence's last token (decodes; not a parent about
to fork), with γ cut so that prompt + output never passes max_tokens or the context, the step's token budget
holds, and free blocks suffice without preempting anyone (else the sequence decodes plainly this step).  If the
speculative forward raises, the drafts are rolled back and the engine reruns the step plainly (its fault
isolation then finds the culprit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from minillm.config import SpeculativeConfig
from minillm.engine.model_runner import StepResult
from minillm.engine.scheduler import ScheduledSeq, SchedulerOutput
from minillm.engine.sequence import SequenceStatus
from minillm.kv.block_manager import BlockManager
from minillm.kv.paged_cache import PagedAttention
from minillm.outputs import StepOutput
from minillm.sampling.rejection import rejection_sample
from minillm.sampling.sampler import sample
from minillm.spec.build import build_proposer
from minillm.spec.proposer import Proposer, SpecStats, TargetKV


class SpecDecoder:
    """The proposer for ``config`` and the speculative step; ``stats`` counts over the engine's life.

    Its methods take the ``LLMEngine`` driving the step (``engine``: its scheduler, block manager, runner and
    detokenizers); not imported here, which would make the two modules import each other.

    The three parts are backends passed in (the course swaps its own versions in; the defaults are the library's):
    ``proposer`` (a ``Proposer``; default: the one ``config`` names), ``verify`` (``rejection_sample``'s
    signature) and ``truncate`` (``BlockManager.truncate``'s, called as ``truncate(block_manager, seq_id, n)``).
    """

    def __init__(self, config: SpeculativeConfig, model, max_model_len: int, *, proposer: Proposer | None = None,
                 verify: Callable[..., list[int]] = rejection_sample,
                 truncate: Callable[[BlockManager, Hashable, int], None] = BlockManager.truncate):
        self.config = config
        self.proposer = proposer if proposer is not None else build_proposer(config, model, max_model_len)
        self.verify, self.truncate = verify, truncate
        self.stats = SpecStats()

    def step(self, engine, out: SchedulerOutput) -> tuple[list[StepOutput], SchedulerOutput | None]:
        """Run ``out`` speculatively -> (updates, None); or ([], what the engine should run plainly) when no
        sequence has drafts (or the speculative forward failed: then the block copies have already run).

        A proposer with ``reads_target_kv`` (a self-drafter) gets the target's cache as ``TargetKV`` and copies the
        committed context's K/V from it, so the step's block copies run before it proposes."""
        start = time.perf_counter()  # the step's parts are timed into ``stats`` (a few perf_counter calls: ~1 µs)
        if getattr(self.proposer, "reads_target_kv", False):  # it reads the target's K/V: swap-ins and copy-on-write
            engine.runner.kv.copy_blocks(out.copies)         # must have landed (copies then run once, here)
            out = SchedulerOutput(list(out.scheduled), [], out.preempted, out.num_padding)
        spec, draft_s = self._draft(engine, out)
        if not spec:
            return [], out
        drafted = time.perf_counter()
        plain = [s for i, s in enumerate(out.scheduled) if i not in spec]
        try:
            logits, plain_logits = self._forward(engine, out, spec)
            verified = time.perf_counter()
            accepted = {i: self.verify(logits[i], d, q, out.scheduled[i].seq.request.params,
                                            out.scheduled[i].seq.generator) for i, (d, q) in spec.items()}
            plain_tokens = self._sample_plain(plain, plain_logits)
        except Exception:  # noqa: BLE001 — fall back to a plain step, which isolates the failing request
            self._rollback(engine.block_manager, out, spec, {})
            return [], SchedulerOutput(list(out.scheduled), [], out.preempted, out.num_padding)  # copies ran
        self._rollback(engine.block_manager, out, spec, accepted)
        return_logits = engine.config.return_logits
        updates = engine._postprocess(SchedulerOutput(plain, num_padding=0),
                                      StepResult(plain_tokens, plain_logits if return_logits else None))
        for i, tokens in accepted.items():
            updates += self._commit(engine, out.scheduled[i].seq, tokens, len(spec[i][0]),
                                    logits[i] if return_logits else None)
        st = self.stats
        st.spec_steps += 1
        st.draft_s += draft_s
        st.verify_s += verified - drafted
        st.step_s += time.perf_counter() - start
        return updates, None

    # ---- before the forward ----------------------------------------------------------------------------------
    def _draft(self, engine, out: SchedulerOutput) -> tuple[dict[int, tuple[list[int], Tensor | None]], float]:
        """Propose for the eligible chunks and give the drafts KV slots; -> ({index in out.scheduled: (drafts, q)},
        seconds in the proposer)."""
        budget = engine.config.max_num_batched_tokens - out.num_tokens
        chosen, caps = [], []
        for i, s in enumerate(out.scheduled):
            seq = s.seq
            if budget <= 0:
                break
            if s.num_tokens != 1 or not s.samples or s.num_samples != 1 or seq.request.needs_fork:
                continue
            room = min(seq.request.params.max_tokens - len(seq.output), engine.max_model_len - seq.num_tokens) - 1
            k = min(self.config.num_speculative_tokens, room, budget)
            if k >= 1:
                chosen.append(i)
                caps.append(k)
                budget -= k
        if not chosen:
            return {}, 0.0
        t = time.perf_counter()
        seqs = [out.scheduled[i].seq for i in chosen]
        if getattr(self.proposer, "reads_target_kv", False):
            proposal = self.proposer.propose(seqs, caps, TargetKV(engine.runner.kv, engine.block_manager))
        else:
            proposal = self.proposer.propose(seqs, caps)
        draft_s = time.perf_counter() - t
        bm, spec = engine.block_manager, {}
        for i, k, d, q in zip(chosen, caps, proposal.tokens, proposal.probs, strict=True):
            d = list(d[:k])
            seq = out.scheduled[i].seq
            if not d or not bm.can_append(seq.seq_id, len(d)):
                continue  # no guess, or no free blocks: decode plainly rather than preempt anyone
            out.copies += bm.append_slots(seq.seq_id, d)
            spec[i] = (d, None if q is None else q[: len(d)])
        self.stats.skipped_steps += len(chosen) - len(spec)
        return spec, draft_s

    def _forward(self, engine, out: SchedulerOutput, spec: dict) -> tuple[dict[int, Tensor], Tensor]:
        """One packed forward with each drafting sequence fed [last, x_1..x_k]; -> ({index: target logits
        [k+1, V] fp32}, plain sampling rows' logits [B_s, V] fp32)."""
        runner = engine.runner
        runner.kv.copy_blocks(out.copies)  # copy-on-write and swaps first, as ModelRunner.run
        packed = SchedulerOutput(list(out.scheduled), [], out.preempted, out.num_padding)
        for i, (d, _) in spec.items():
            s = out.scheduled[i]
            s.seq.token_ids.extend(d)  # tentative: only while the batch is packed
            packed.scheduled[i] = ScheduledSeq(s.seq, s.start, 1 + len(d))
        try:
            # every row at once through the fused native step when it can take them (CPU: the verify pass costs
            # about one decode step, not a layer-by-layer prefill-path forward); else the packed forward
            decode_like = all(s.num_tokens == 1 for i, s in enumerate(packed.scheduled) if i not in spec)
            rows = runner.fused_rows(packed) if decode_like else None
            prepared = runner.prepare(packed) if rows is None else None
        finally:
            for i, (d, _) in spec.items():
                del out.scheduled[i].seq.token_ids[-len(d):]
        keep, spans, plain_rows, row = [], {}, [], 0  # the rows whose logits are used, in the packing order
        for i, s in enumerate(packed.scheduled):
            row += s.num_tokens
            if i in spec:
                spans[i] = (len(keep), len(keep) + s.num_tokens)
                keep += range(row - s.num_tokens, row)  # every row of the chunk: p_1 .. p_{k+1}
            elif s.samples:
                plain_rows.append(row - 1)
        with torch.inference_mode():
            if rows is not None:  # every real row through the head in the same call (pad rows: never sampled)
                logits = runner.graphs.logits(rows)[keep + plain_rows].float()  # (R, V)
            else:
                input_ids, positions, meta, _ = prepared
                cache = PagedAttention(runner.kv, meta, runner.model.kernel_ops())
                hidden = runner.model.hidden_states(input_ids, positions, cache)[0]  # (T, hidden)
                logits = runner.model.compute_logits(hidden[keep + plain_rows]).float()  # (R, V)
        return {i: logits[a:b] for i, (a, b) in spans.items()}, logits[len(keep):]

    @staticmethod
    def _sample_plain(plain: list[ScheduledSeq], logits: Tensor) -> list[list[int]]:
        """The non-speculating sampling chunks, exactly as ``ModelRunner.run`` samples them (n for a fork)."""
        samplers = [s for s in plain if s.samples]
        rows, params, gens = [], [], []
        for r, s in enumerate(samplers):
            for j in range(s.num_samples):
                rows.append(r)
                params.append(s.seq.request.params)
                gens.append(s.seq.request.generators[s.seq.index + j])
        tokens = sample(logits[rows], params, gens) if rows else []
        grouped, k = [], 0
        for s in samplers:
            grouped.append(tokens[k : k + s.num_samples])
            k += s.num_samples
        return grouped

    # ---- after the forward -----------------------------------------------------------------------------------
    def _rollback(self, bm, out: SchedulerOutput, spec: dict, accepted: dict[int, list[int]]) -> None:
        """Free the slots of rejected drafts: keep the last token + the accepted drafts (their K/V is right)."""
        for i in spec:
            seq = out.scheduled[i].seq
            kept = len(accepted[i]) - 1 if i in accepted else 0
            self.truncate(bm, seq.seq_id, seq.num_tokens + kept)

    def _commit(self, engine, seq, tokens: list[int], num_drafts: int,
                logits: Tensor | None) -> list[StepOutput]:
        """Commit ``tokens`` one at a time through the scheduler's postprocess and the engine's emit (each stop
        rule applies per token; nothing after a stop is emitted); record the metrics."""
        updates, emitted = [], 0
        for j, token in enumerate(tokens):
            if seq.status is not SequenceStatus.RUNNING:
                break  # EOS, max_tokens or a stop string ended it: the rest is never emitted
            one = SchedulerOutput([ScheduledSeq(seq, seq.num_tokens - 1, 1)], num_padding=0)
            updates += engine._postprocess(one, StepResult([[token]], None if logits is None else logits[j : j + 1]))
            emitted += 1
        m, s = seq.metrics, self.stats
        m.spec_verify_steps += 1
        m.spec_draft_tokens += num_drafts
        m.spec_accepted_tokens += len(tokens) - 1
        s.verify_steps += 1
        s.draft_tokens += num_drafts
        s.accepted_tokens += len(tokens) - 1
        s.emitted_tokens += emitted
        if seq.status.finished and hasattr(self.proposer, "release"):
            self.proposer.release(seq)
        return updates

