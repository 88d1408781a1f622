"""Draft-model proposals: a small model with the target's vocabulary guesses γ tokens autoregressively.

Two ways to run the drafter, one rollback rule.  Before proposing, the drafter keeps the longest common prefix of
the tokens it holds K/V for and the sequence's committed tokens (rejected drafts fall off) and feeds the rest — the
catch-up, usually 1–2 tokens: the last accepted draft and the target's correction/bonus — then γ − 1 single drafts.

- ``FusedDrafter`` (CPU, a plain ``Transformer`` with fp32/int8/int4 linears under fp32 activations or bf16 ones
  under bf16: the quantized-self drafter, most draft models): a paged K/V pool of its own (``PagedKVCache`` + a
  ``BlockManager`` without prefix caching, one block table per sequence, grown when it fills) and
  ``engine.native_runner.NativeDecodeStack``: every sequence of the step drafts together, one native call per draft
  position for the whole batch.  Why: at batch 1 the per-layer Python around an int4 drafter's GEMVs cost as much as
  several fp32 target decode steps per draft, which made quantized-self drafting slower than plain decode.  A long
  catch-up (a new sequence's prompt) runs as one prefill chunk through the model's own forward over the same pool
  (GEMMs instead of 32-row GEMV calls).  Early exit runs there too, as a ``Transformer`` over the target's first
  layers (``EarlyExitModel.as_transformer``).
- the per-sequence path (anything the fused step cannot run: CUDA, quantized bf16, a swapped or parallel module): a
  contiguous ``KVCache`` per sequence, sized for its prompt + max_tokens + γ, and the model's own forward, one
  sequence at a time.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.kv.block_manager import BlockManager, OutOfBlocks
from minillm.kv.contiguous import KVCache
from minillm.kv.paged_cache import AttentionMetadata, PagedAttention, PagedKVCache, PrefillChunk
from minillm.sampling.sampler import probabilities, sample_from
from minillm.spec.proposer import Proposal, Proposer, TargetKV

# catch-up rows above which a sequence prefills through the model's forward rather than as fused rows: a fused row
# costs about a decode step, while a prefill's cost per row falls as it grows (GEMMs); 64 lies inside the crossover
# BENCHMARKS.md measures ("Figures moved out of the code")
LONG_FEED = 64


def common_prefix(held: Sequence[int], ids: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (the drafter's K/V still valid for ``ids``)."""
    n = min(len(held), len(ids))
    if list(held[:n]) == list(ids[:n]):  # the usual case (nothing rejected past the cache): one C comparison
        return n
    return next(i for i, (a, b) in enumerate(zip(held, ids, strict=False)) if a != b)


def draw(logits: Tensor, seq) -> tuple[int, Tensor | None]:
    """One draft from fp32 logits [V]: the argmax for a greedy request, else a sample from its filtered
    distribution q with the sequence's own generator -> (token, q [V] or None)."""
    params = seq.request.params
    if params.greedy:
        return int(logits.argmax()), None
    q = probabilities(logits, params)
    return sample_from(q, seq.generator), q


class DraftModelProposer(Proposer):
    """``Proposer`` running ``model`` (a ``Transformer`` or ``EarlyExitModel``) as the drafter.

    ``fused``: None runs the ``FusedDrafter`` where it supports the model (an ``EarlyExitModel`` through its
    ``as_transformer()`` view), else the per-sequence path; True
    requires it (ValueError naming why not), False always takes the per-sequence path.  Drafts are sampled from the
    request's filtered distribution q (``probabilities``) with the sequence's own generator — greedy requests take
    the argmax — and q is returned for the rejection rule.

    ``reads_target_kv`` (self-drafters: the quantized twin, early exit — their layers have the target's K/V shapes):
    the fused drafter copies a sequence's committed context K/V from the target's cache (``propose``'s
    ``target_kv``) instead of running it through the drafter, so it feeds only the last token before drafting.
    Why: a new request's whole prompt through an int4 drafter (no fast int4 GEMM) costs about as much as the
    target's own prefill, paid inside the decode, while a copy of its K/V is a memory copy.
    The drafter then attends to the target's K/V rather than its own: its guesses change (the verify keeps the output
    exact either way) — they can only move closer to the target's.
    """

    def __init__(self, model, max_len: int, *, fused: bool | None = None, reads_target_kv: bool = False):
        self.model, self.max_len = model, max_len
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> _DraftState
        self.fused: FusedDrafter | None = None
        if fused is not False:
            try:
                plain = model.as_transformer() if hasattr(model, "as_transformer") else model  # early exit
                self.fused = FusedDrafter(plain, max_len)
            except ValueError:
                if fused:
                    raise
        self.reads_target_kv = reads_target_kv and self.fused is not None  # the per-sequence path copies nothing

    def release(self, seq) -> None:
        """Drop a finished sequence's draft K/V now (it would also go when the sequence is garbage-collected)."""
        self._states.pop(seq, None)
        if self.fused is not None:
            self.fused.release(seq)

    @torch.inference_mode()
    def propose(self, seqs: Sequence, k: Sequence[int], target_kv: TargetKV | None = None) -> Proposal:
        """Up to ``k[i]`` tokens per sequence, with their draft distributions (None for greedy requests);
        ``target_kv``: where the committed context's K/V may be copied from (used when ``reads_target_kv``)."""
        if self.fused is not None:
            return self.fused.propose(seqs, k, target_kv if self.reads_target_kv else None)
        tokens, probs = [], []
        for seq, ki in zip(seqs, k, strict=True):
            t, q = self._propose_one(seq, ki) if ki > 0 else ([], None)
            tokens.append(t)
            probs.append(q)
        return Proposal(tokens, probs)

    # ---- the per-sequence path ---------------------------------------------------------------------------------
    def _state(self, seq) -> _DraftState:
        state = self._states.get(seq)
        if state is None:
            p = seq.request.params
            size = min(self.max_len, seq.num_prompt_tokens + p.max_tokens) + 1  # + the drafts past the last token
            size = min(size, self.model.config.max_position_embeddings)
            cache = KVCache(self.model.config, 1, size, dtype=self.model.dtype, device=self.model.device,
                            kernels=self.model.kernels)
            state = self._states[seq] = _DraftState(cache, [])
        return state

    def _propose_one(self, seq, k: int) -> tuple[list[int], Tensor | None]:
        state = self._state(seq)
        ids = seq.token_ids
        k = min(k, state.cache.max_len - len(ids))  # the drafts' positions must fit the drafter's cache
        if k < 1:
            return [], None
        keep = min(common_prefix(state.tokens, ids), len(ids) - 1)  # feed at least the last token
        feed, start = ids[keep:], keep
        drafts: list[int] = []
        qs: list[Tensor] = []
        for _ in range(k):
            token, q = draw(self._forward(state.cache, feed, start), seq)  # logits (V,) after the last fed token
            if q is not None:
                qs.append(q)
            start += len(feed)
            feed = [token]
            drafts.append(token)
        state.tokens = list(ids) + drafts[:-1]  # the last draft was never fed
        return drafts, torch.stack(qs) if qs else None

    def _forward(self, cache: KVCache, feed: list[int], start: int) -> Tensor:
        """Feed ``feed`` at positions start.. into the drafter; -> fp32 logits [V] after its last token."""
        dev = self.model.device
        input_ids = torch.tensor([feed], dtype=torch.long, device=dev)
        positions = torch.arange(start, start + len(feed), device=dev)[None]  # (1, L)
        cache.begin(positions)
        hidden = self.model.hidden_states(input_ids, positions, cache)  # (1, L, hidden)
        return self.model.compute_logits(hidden[0, -1]).float()


@dataclass
class _DraftState:
    cache: KVCache
    tokens: list[int]  # the tokens whose K/V the cache holds, positions 0 .. len - 1


@dataclass
class _Job:
    """One sequence drafting this step: its id in the pool, how many drafts, what it drew so far."""

    seq: object
    sid: int
    k: int
    drafts: list[int]
    qs: list[Tensor]


class FusedDrafter:
    """Drafts for all sequences of a step together on ``NativeDecodeStack`` over a paged K/V pool of its own.

    The pool starts at ``num_blocks`` blocks of ``block_size`` and doubles when a sequence needs more (live block
    tables are copied over; a sequence's blocks go on ``release`` or once the sequence is garbage-collected).
    ``held[sid]`` lists the tokens that have slots in the pool, positions 0..n-1 (the block manager's own token
    list, kept here to compare without copying).  Raises ``ValueError`` naming the reason when the fused step
    cannot run ``model`` (``engine.native_runner.unsupported_reason``).
    """

    def __init__(self, model, max_len: int, *, block_size: int = 16, num_blocks: int = 64):
        from minillm.engine.native_runner import NativeDecodeStack, unsupported_reason

        self.model, self.max_len = model, max_len
        kv = PagedKVCache(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device)
        reason = unsupported_reason(model, kv)
        if reason is not None:
            raise ValueError(f"the fused drafter cannot run this draft model: {reason}")
        self._make_runner = NativeDecodeStack
        self.runner = NativeDecodeStack(model, kv)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> sid
        self._next_id = itertools.count()
        self.held: dict[int, list[int]] = {}

    @property
    def kv(self) -> PagedKVCache:
        """The drafter's K/V pool [layers, num_blocks, block_size, H_kv, D]."""
        return self.runner.kv

    def release(self, seq) -> None:
        """Free ``seq``'s blocks in the drafter's pool now."""
        sid = self._ids.pop(seq, None)
        if sid is not None:
            self._drop(sid)

    def _drop(self, sid: int) -> None:
        if sid in self.blocks:
            self.blocks.free(sid)
        self.held.pop(sid, None)

    def sweep(self) -> None:
        """Free the blocks of sequences that finished or were garbage-collected without a ``release`` (a request
        that ended in a plain step, an abort); ``propose`` runs it first."""
        for seq in list(self._ids.keys()):
            status = getattr(seq, "status", None)
            if status is not None and status.finished:
                del self._ids[seq]
        live = set(self._ids.values())
        for sid in [s for s in self.held if s not in live]:
            self._drop(sid)

    @torch.inference_mode()
    def propose(self, seqs: Sequence, k: Sequence[int], target_kv: TargetKV | None = None) -> Proposal:
        """Up to ``k[i]`` tokens per sequence (as ``DraftModelProposer.propose``): one catch-up for every
        drafting sequence, then one fused call per further draft position for all of them.  With ``target_kv``
        (a cache whose layers match this drafter's first layers) the catch-up copies every committed position but
        the last from it and feeds only the last token."""
        if target_kv is not None and not self._can_copy(target_kv):
            target_kv = None
        self.sweep()
        cap = min(self.max_len + 1, self.model.config.max_position_embeddings)  # positions the drafts may take
        jobs, out = [], [None] * len(seqs)
        for i, (seq, ki) in enumerate(zip(seqs, k, strict=True)):
            ki = min(ki, cap - len(seq.token_ids))
            if ki >= 1:
                jobs.append((i, _Job(seq, self._sid(seq), ki, [], [])))
        try:
            self._draft([j for _, j in jobs], target_kv)
        except BaseException:
            for _, j in jobs:  # slots were reserved for K/V that may not be written: forget these sequences
                self._drop(j.sid)
            raise
        for i, j in jobs:
            out[i] = j
        return Proposal([[] if j is None else j.drafts for j in out],
                        [torch.stack(j.qs) if j is not None and j.qs else None for j in out])

    def _sid(self, seq) -> int:
        sid = self._ids.get(seq)
        if sid is None:
            sid = self._ids[seq] = next(self._next_id)
        return sid

    def _draft(self, jobs: list[_Job], target_kv: TargetKV | None = None) -> None:
        """Catch every job up, then draw drafts position by position; fills ``job.drafts`` / ``job.qs``."""
        if not jobs:
            return
        feeds = [self._rollback(j.sid, j.seq.token_ids) for j in jobs]  # (sid, tokens to feed, first position)
        if target_kv is not None:
            feeds = [self._copy_context(f, j.seq.seq_id, target_kv) for f, j in zip(feeds, jobs, strict=True)]
        logits = self._feed(feeds)  # (J, V) after each sequence's last token
        active = jobs
        while True:
            fed = []
            for job, row in zip(active, logits, strict=True):
                token, q = draw(row, job.seq)
                job.drafts.append(token)
                if q is not None:
                    job.qs.append(q)
                if len(job.drafts) < job.k:
                    fed.append(job)
            if not fed:
                return
            for job in fed:  # the draft just drawn is fed to draw the next one
                self._reserve(job.sid, [job.drafts[-1]])
            logits = self._fused([(j.sid, [j.drafts[-1]], len(self.held[j.sid]) - 1) for j in fed])
            active = fed

    def _rollback(self, sid: int, ids: Sequence[int]) -> tuple[int, list[int], int]:
        """Keep the longest valid prefix of the pool's tokens, reserve slots for the rest of ``ids`` ->
        (sid, the tokens to feed, the position of the first)."""
        held = self.held.get(sid, [])
        keep = min(common_prefix(held, ids), len(ids) - 1)  # feed at least the last token: its logits draw draft 1
        if sid in self.blocks and keep < len(held):
            if keep == 0:
                self._drop(sid)
            else:
                self.blocks.truncate(sid, keep)  # whole tail blocks freed
                del held[keep:]
        feed = list(ids[keep:])
        self._reserve(sid, feed)
        return sid, feed, keep

    def _can_copy(self, target: TargetKV) -> bool:
        """Whether ``target``'s cache holds K/V this drafter's layers can use as they are: a plain ``PagedKVCache``
        of the same dtype and head shapes with at least as many layers (early exit takes the first ones)."""
        t, mine = target.kv, self.kv
        return type(t) is PagedKVCache and t.dtype == mine.dtype and t.k.device == mine.k.device \
            and t.k.shape[0] >= mine.k.shape[0] and t.k.shape[3:] == mine.k.shape[3:]

    def _copy_context(self, feed: tuple[int, list[int], int], seq_id, target: TargetKV) -> tuple[int, list[int], int]:
        """Copy the K/V of every fed position but the last from the target's slots into the slots ``_rollback``
        reserved -> the feed reduced to the last token.  Bytes: 2 × layers × H_kv × D × 4 per position (SmolLM2:
        46 KB; a 124-token prompt 5.7 MB), against a drafter forward per position."""
        sid, tokens, start = feed
        if len(tokens) < 2 or seq_id not in target.block_manager:
            return feed
        end = start + len(tokens) - 1
        src = torch.tensor(target.block_manager.slot_mapping(seq_id, start, end))
        dst = torch.tensor(self.blocks.slot_mapping(sid, start, end))
        n = self.kv.k.shape[0]
        for mine, theirs in ((self.kv.k, target.kv.k), (self.kv.v, target.kv.v)):
            # [layers, blocks, block_size, H_kv, D] -> [layers, slots, H_kv, D] views; copy the slots of every layer
            mine.flatten(1, 2).index_copy_(1, dst, theirs[:n].flatten(1, 2).index_select(1, src))
        return sid, tokens[-1:], end

    def _reserve(self, sid: int, tokens: list[int]) -> None:
        """Slots for ``tokens`` after the sequence's held ones (a new table for a new sequence), growing the pool
        when it is full."""
        while True:
            try:
                if sid in self.blocks:
                    self.blocks.append_slots(sid, tokens)  # no copies: no forks or prefix cache in this pool
                else:
                    self.blocks.allocate(sid, tokens)
                break
            except OutOfBlocks:
                self._grow(-(-len(tokens) // self.blocks.block_size) + 1)
        self.held.setdefault(sid, []).extend(tokens)

    def _grow(self, at_least: int) -> None:
        """Double the pool (or add ``at_least`` blocks, if more): new K/V tensors and block manager, every live
        table re-allocated and its blocks copied over, a runner for the new pool."""
        old_kv, old = self.kv, self.blocks
        n = max(2 * old.device.num_blocks, old.device.num_blocks + at_least)
        kv = PagedKVCache(self.model.config, n, old.block_size, dtype=old_kv.dtype, device=old_kv.k.device)
        blocks = BlockManager(n, old.block_size, enable_prefix_caching=False)
        for sid in self.held:
            if sid in old:
                blocks.allocate(sid, old.sequence(sid).token_ids)
                src, dst = old.block_table(sid), blocks.block_table(sid)
                kv.k[:, dst], kv.v[:, dst] = old_kv.k[:, src], old_kv.v[:, src]
        self.runner = self._make_runner(self.model, kv)
        self.blocks = blocks

    # ---- forwards ----------------------------------------------------------------------------------------------
    def _logits(self, hidden: Tensor) -> Tensor:
        """[R, hidden] -> fp32 logits [R, V] through the drafter's LM head."""
        return self.model.compute_logits(hidden).float()

    def _feed(self, feeds: list[tuple[int, list[int], int]]) -> Tensor:
        """Run each (sid, tokens, start) into the pool -> fp32 logits [len(feeds), V] after each last token.
        Short feeds share fused calls; long ones (new prompts) prefill together through the model's forward."""
        short = [i for i, f in enumerate(feeds) if len(f[1]) <= LONG_FEED]
        long = [i for i, f in enumerate(feeds) if len(f[1]) > LONG_FEED]
        logits = torch.empty(len(feeds), self.model.config.vocab_size)
        if short:
            rows = self._fused([feeds[i] for i in short])  # every row's logits: a catch-up is 1-2 rows each
            ends = list(itertools.accumulate(len(feeds[i][1]) for i in short))
            logits[short] = rows[[e - 1 for e in ends]]
        if long:
            logits[long] = self._logits(self._prefill([feeds[i] for i in long]))
        return logits

    def _fused(self, feeds: list[tuple[int, list[int], int]]) -> Tensor:
        """Feeds as decode rows (row r of a sequence at position start + r attends to start + r + 1 keys), in calls
        of at most ``runner.max_rows`` rows, the LM head in the same call -> fp32 logits [rows, V]."""
        from minillm.engine.model_runner import DecodeBatch

        rows = []
        for sid, tokens, start in feeds:
            table = self.blocks.block_table(sid)
            slots = self.blocks.slot_mapping(sid, start, start + len(tokens))
            rows += [(t, start + r, s, table) for r, (t, s) in enumerate(zip(tokens, slots, strict=True))]
        out = []
        for a in range(0, len(rows), self.runner.max_rows):
            chunk = rows[a : a + self.runner.max_rows]
            out.append(self.runner.logits(DecodeBatch([r[0] for r in chunk], [r[1] for r in chunk],
                                                      [r[2] for r in chunk], [r[3] for r in chunk],
                                                      [r[1] + 1 for r in chunk])))
        return torch.cat(out).float()

    def _prefill(self, feeds: list[tuple[int, list[int], int]]) -> Tensor:
        """Feeds as prefill chunks of one packed forward of the model over the pool -> hidden [len(feeds), hidden]
        after each chunk's last token."""
        bs = self.blocks.block_size
        ids, positions, slots, chunks, last = [], [], [], [], []
        for sid, tokens, start in feeds:
            row, end = len(ids), start + len(tokens)
            ids += tokens
            positions += range(start, end)
            slots += self.blocks.slot_mapping(sid, start, end)
            chunks.append(PrefillChunk(row, len(ids), end, torch.tensor(self.blocks.block_table(sid)[: -(-end // bs)])))
            last.append(len(ids) - 1)
        meta = AttentionMetadata(torch.tensor(slots), torch.zeros(0, dtype=torch.long),
                                 torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), chunks)
        cache = PagedAttention(self.kv, meta, self.model.kernel_ops())
        hidden = self.model.hidden_states(torch.tensor([ids]), torch.tensor([positions]), cache)  # (1, T, hidden)
        return hidden[0, last]
