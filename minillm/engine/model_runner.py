"""The model runner: every engine step is one packed forward pass, then sampling.

All tokens the scheduler picked — decode tokens of running sequences, prefill chunks of new ones, and a
speculating sequence's draft tokens — are concatenated into a single [1, T] batch with their own positions (no
padding: a 500-token prefill chunk and twenty 1-token decodes cost T = 520 rows of every linear layer, which is
where the weights are read once for all).  Attention is the only per-sequence operation; ``PagedAttention`` does it
through the block tables:

- new K/V rows are scattered into their slots (``slot = block_id * block_size + offset``, from the BlockManager);
- decode tokens go together through the model's ``paged_decode_attention`` kernel (``kernels.select``: Triton on
  CUDA, native on CPU, the gather + softmax reference elsewhere);
- each prefill chunk (a draft chunk [last, x_1..x_k] is one too) gathers its sequence's blocks (earlier context +
  the chunk) and runs causal ``prefill_attention`` with the queries at the end of the keys.

The LM head (V × hidden, the largest matrix) runs only on the rows whose logits the step needs
(``ScheduledSeq.num_logit_rows``): the last row of each chunk that samples, every row of a draft chunk.  Sampling
then draws one token per plain chunk (``n`` for a parent about to fork) and runs the rejection rule once over
every draft chunk (``verify``).

``ModelRunner`` is the eager runner; ``engine/runners.py`` picks, once per engine, the runner for the device,
dtype, kernels, KV dtype and parallel config — this class, ``CudaGraphRunner`` (static buffers, CUDA graphs) or
``NativeRunner`` (the fused native decode step), which override ``fast_forward`` for the steps their path can run —
and hands a multi-process ``executor`` (tensor / pipeline parallel) in here: the step is then packed here and every
rank runs it.

Padding rows (``SchedulerOutput.num_padding``: finished members of a fixed-shape static/dynamic batch) are appended
after the real tokens: a pad token at position 0 through every linear layer and the LM head, as a padded batch
computes them, then discarded.  They own no KV slot and skip attention (their output there is zero); at the
context lengths of a batch that is a small part of a row's cost, so the padding is priced slightly low, not high.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from minillm.config import ModelConfig
from minillm.engine.logprobs import StepLogprobs, step_logprobs
from minillm.engine.scheduler import ScheduledSeq, SchedulerOutput
from minillm.kv.block_allocator import BlockCopy
from minillm.kv.block_manager import BlockManager
from minillm.kv.paged_cache import AttentionMetadata, PagedAttention, PagedKVCache, PrefillChunk
from minillm.models.llama import Transformer
from minillm.sampling.guided import mask_logits
from minillm.sampling.processors import process
from minillm.sampling.rejection import rejection_sample
from minillm.sampling.sampler import sample

Verify = Callable[..., list[int]]  # rejection_sample's signature: (logits [k+1, V], drafts, q, params, generator)


@dataclass
class StepResult:
    """Sampled tokens, one list per sampling ``ScheduledSeq`` (n tokens for a parent about to fork; the accepted
    drafts + one for a draft chunk); the fp32 logits [R, V] they came from (each chunk's ``num_logit_rows`` rows, in
    order) when asked for; the logprobs of the sequences that asked (``engine.logprobs.step_logprobs``)."""

    tokens: list[list[int]]
    logits: Tensor | None
    logprobs: StepLogprobs = field(default_factory=dict)


@dataclass(frozen=True)
class StepInputs:
    """One packed step as every rank runs it: the block copies to run first, then (unless a copies-only step) the
    forward's input_ids, positions [1, T], its ``AttentionMetadata`` and the LM-head rows [R + pad]."""

    copies: list[BlockCopy] = field(default_factory=list)
    input_ids: Tensor | None = None
    positions: Tensor | None = None
    meta: AttentionMetadata | None = None
    sample_rows: Tensor | None = None

    @property
    def has_forward(self) -> bool:
        """Whether a forward runs after the copies (False: a step that only swaps or copies blocks)."""
        return self.input_ids is not None


@dataclass(frozen=True)
class DecodeBatch:
    """A step's tokens as rows, host side: B rows (before bucket padding).  ``block_tables[i]`` lists row i's
    blocks (up to its chunk's end); ``seq_lens[i]`` counts its keys, itself included (position + 1)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


class Executor(Protocol):
    """Runs a packed step on every rank of a multi-process group (``distributed.driver.TPDriver``, the pipeline
    driver): this process's part over ``kv`` and the other ranks' parts, which it sends them.  ``model``: this
    rank's piece of the model (a shard, a stage), which the engine sizes its K/V cache from."""

    model: Transformer

    def check(self) -> None:
        """Raise the group's failure (a worker that died or raised), if any."""
        ...

    def shutdown(self) -> None:
        """Stop the other ranks; later calls raise."""
        ...

    def attach_kv(self, kv: PagedKVCache, kv_args: dict) -> None:
        """``kv`` is this rank's new cache: have every other rank build its own to match
        (``make_paged_kv_cache(its config, **kv_args)``)."""
        ...

    def run_step(self, kv: PagedKVCache, step: StepInputs) -> Tensor | None:
        """The copies, then the forward -> logits [R + pad, V] (model dtype), None for a copies-only step."""
        ...


@torch.inference_mode()
def forward_step(model: Transformer, kv: PagedKVCache, step: StepInputs) -> Tensor | None:
    """Run the copies, then the packed forward and the LM head on the sample rows -> logits [R + pad, V] in the
    model dtype, or None for a copies-only step.  Every rank of a tensor-parallel group runs exactly this."""
    kv.copy_blocks(step.copies)  # before the forward: copy-on-write sources and swaps must land first
    if not step.has_forward:
        return None
    cache = PagedAttention(kv, step.meta, model.kernel_ops())
    hidden = model.hidden_states(step.input_ids, step.positions, cache)  # (1, T, hidden)
    return model.compute_logits(hidden[0, step.sample_rows])  # (R + pad, V)


def sampling_chunks(out: SchedulerOutput) -> list[tuple[ScheduledSeq, int]]:
    """(chunk, its first sampling row in the step's logits) for every chunk that samples, in order: each chunk owns
    ``num_logit_rows`` consecutive rows of the [R, V] logits ``ModelRunner.forward`` returns, its sampling rows
    after its ``prompt_logit_rows``."""
    chunks, row = [], 0
    for s in out.scheduled:
        if s.samples:
            chunks.append((s, row + s.prompt_logit_rows))
        row += s.num_logit_rows
    return chunks


def eviction_window(block_manager: BlockManager, model: ModelConfig) -> dict[str, int | bool | tuple[int, ...]]:
    """``AttentionMetadata``'s window, sinks and mass tracking from the block manager's eviction policy, or a
    local:global model's per-layer windows ({} for neither: the default path's metadata)."""
    policy = block_manager.eviction
    if model.sliding_layers is not None:
        return {"layer_windows": tuple(model.layer_window(i) or 0 for i in range(model.num_layers))}
    if policy is None:
        return {}
    window, sinks = policy.attention_window()
    return {"window": window, "sinks": sinks, "track_mass": policy.needs_mass}


def logit_rows(out: SchedulerOutput) -> list[int]:
    """Indices into the packed rows of the rows whose logits the step needs (``num_logit_rows`` of each chunk, its
    last rows), in order."""
    rows, end = [], 0
    for s in out.scheduled:
        end += s.num_tokens
        rows += range(end - s.num_logit_rows, end)
    return rows


class ModelRunner:
    """Runs a ``SchedulerOutput``: block copies, one packed forward (the LM head on the rows asked for), sampling.
    Attention runs on the model's kernels (``model.kernel_ops()``), the same the layers run on.  ``executor``: a
    multi-process group that runs every step on all its ranks (None: this process alone)."""

    eos_token_ids: tuple[int, ...] = ()  # what min_tokens masks (the engine sets its own)

    def __init__(self, model: Transformer, kv: PagedKVCache, block_manager: BlockManager,
                 executor: Executor | None = None):
        self.model, self.kv, self.block_manager, self.executor = model, kv, block_manager, executor

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, return_logits: bool = False, verify: Verify = rejection_sample) -> StepResult:
        """Execute one step and sample; returns a ``StepResult`` aligned with the sampling ``ScheduledSeq``s.
        ``verify``: the rejection rule applied to each draft chunk (``rejection_sample``'s signature)."""
        logits = self.forward(out)
        if logits is None:
            return StepResult([], None)
        logits = logits.float()  # (R, V)
        tokens = self.sample(out, logits, verify)
        return StepResult(tokens, logits if return_logits else None, step_logprobs(out, logits, tokens))

    def forward(self, out: SchedulerOutput) -> Tensor | None:
        """Block copies, then the forward -> logits [R, V] at ``logit_rows(out)``; None for a copies-only step."""
        if out.is_empty and not out.copies:
            return None
        if self.executor is not None:  # every rank runs the copies and the forward: the executor sends them
            logits = self.executor.run_step(self.kv, self.prepare(out))
            return None if logits is None else logits[: len(logit_rows(out))]
        self.kv.copy_blocks(out.copies)  # before the forward: copy-on-write sources and swaps must land first
        if out.is_empty:
            return None
        fast = self.fast_forward(out)
        if fast is not None:
            return fast
        step = dataclasses.replace(self.prepare(out), copies=[])  # the copies ran above
        return forward_step(self.model, self.kv, step)[: len(logit_rows(out))]

    def fast_forward(self, out: SchedulerOutput) -> Tensor | None:
        """The logits [R, V] by a faster path than the packed eager forward when this runner has one that can run
        ``out`` (copies already done); None: the eager forward runs it."""
        return None

    def sample(self, out: SchedulerOutput, logits: Tensor, verify: Verify = rejection_sample) -> list[list[int]]:
        """One token list per sampling chunk: ``num_samples`` draws from its last row (generator i each), or for a
        draft chunk the rejection rule over its 1 + k rows (the accepted drafts + a correction or bonus token).
        Rows of guided samples are masked first by their grammar matchers (``sampling.guided.mask_logits``)."""
        chunks = sampling_chunks(out)
        rows, params, generators, seqs, matchers = [], [], [], [], []
        for s, row in chunks:
            for j in range(0 if s.drafts else s.num_samples):  # a parent about to fork draws n from one row
                rows.append(row)
                params.append(s.seq.request.params)
                generators.append(s.seq.request.generators[s.seq.index + j])
                seqs.append(s.seq)
                matchers.append(None if s.seq.request.matchers is None else s.seq.request.matchers[s.seq.index + j])
        picked = process(logits[rows], params, seqs, self.eos_token_ids)  # penalties, logit_bias, min_tokens: a copy
        if any(m is not None for m in matchers):  # then the structured-output mask, on that copy (never ``logits``)
            picked = mask_logits(picked, matchers)
        drawn = iter(sample(picked, params, generators) if rows else [])
        tokens = []
        for s, row in chunks:
            if s.drafts:  # the rejection rule over every draft chunk, each on its own rows and generator
                tokens.append(verify(logits[row : row + s.num_logit_rows], list(s.drafts), s.draft_probs,
                                     s.seq.request.params, s.seq.generator))
            else:
                tokens.append([next(drawn) for _ in range(s.num_samples)])
        return tokens

    def rows(self, out: SchedulerOutput) -> DecodeBatch:
        """The scheduled chunks' tokens, in packing order, as rows: id, position, slot, block table (the blocks up
        to the chunk's end) and context length (position + 1).  The fast paths run steps in this form."""
        bm, bs = self.block_manager, self.kv.block_size
        ids, positions, slots, tables, lens = [], [], [], [], []
        for s in out.scheduled:
            end = s.start + s.num_tokens
            ids += s.token_ids
            positions += range(s.start, end)
            slots += bm.slot_mapping(s.seq.seq_id, s.start, end)
            table = bm.block_table(s.seq.seq_id)[: -(-end // bs)]
            tables += [table] * s.num_tokens
            lens += range(s.start + 1, end + 1)
        return DecodeBatch(ids, positions, slots, tables, lens)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Pack the scheduled chunks, then ``out.num_padding`` pad rows -> ``StepInputs``: the block copies,
        input_ids [1, T], positions [1, T], metadata, LM-head rows [R + padding]."""
        if out.is_empty:
            return StepInputs(out.copies)
        bm, bs = self.block_manager, self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows, tables, lens, prefills = [], [], [], []
        for s in out.scheduled:
            seq, row, end = s.seq, len(ids), s.start + s.num_tokens
            ids += s.token_ids
            positions += range(s.start, end)
            slots += bm.slot_mapping(seq.seq_id, s.start, end)
            table = bm.block_table(seq.seq_id)[: -(-end // bs)]
            if s.num_tokens == 1:
                decode_rows.append(row)
                tables.append(table)
                lens.append(end)
            else:
                blocks = torch.tensor(table, device=self.kv.k.device)
                prefills.append(PrefillChunk(row, row + s.num_tokens, end, blocks))
        sample_rows = logit_rows(out)
        width = max((len(t) for t in tables), default=0)
        dev = self.kv.k.device

        def tensor(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        padded = [t + [0] * (width - len(t)) for t in tables]
        meta = AttentionMetadata(tensor(slots), tensor(decode_rows),
                                 tensor(padded, torch.int32).view(len(tables), width), tensor(lens, torch.int32),
                                 prefills, out.num_padding, decode_only=len(decode_rows) == len(ids) > 0
                                 and out.num_padding == 0, **eviction_window(bm, self.model.config))
        # pad rows: token 0 at position 0, after the real rows; they go through the LM head too (sampled from: no)
        sample_rows += range(len(ids), len(ids) + out.num_padding)
        ids += [0] * out.num_padding
        positions += [0] * out.num_padding
        return StepInputs(out.copies, tensor([ids]), tensor([positions]), meta, tensor(sample_rows))
