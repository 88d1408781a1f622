"""One engine step as a driver sends it to the other ranks (tensor or pipeline parallel): a small header and one
int64 tensor.

The driver (rank 0) schedules, packs the step (``ModelRunner.prepare``: a ``StepInputs``) and samples; the other
ranks only need what their shard's forward reads, which is all of it — the packed forward's inputs and the step's
K/V block copies:

    header (a tuple of 10 ints, ~100 bytes pickled, over each worker's pipe)
        T, slots, B_d, width, P, prefill blocks, B_s, copies, num_padding, decode_only
    payload (one int64 tensor, broadcast over the process group), segments in this order:
        input_ids [T] | positions [T] | slot_mapping [T − pad] | decode_rows [B_d] | block_tables [B_d · width]
        | seq_lens [B_d] | prefill (start, end, context_len, blocks) [4 P] | prefill block ids [Σ blocks]
        | sample_rows [B_s]
        | copies (src, dst, kind) [3 C]

So a decode step of B sequences whose longest table has w blocks sends 8 · (B (6 + w)) bytes: 64 sequences of
1 000 tokens in 16-token blocks are 35 KB — less than one layer's two all-reduces of a 64 × 576 fp32 hidden state
(2 × 147 KB), and sent once per step, not once per layer.  Everything goes as int64 to keep it one tensor (the
int32 block tables and lengths are cast back on arrival: 4 bytes per entry of waste for one collective instead of
two).  The header travels over the pipe rather than the process group so that an idle rank waits in ``recv`` (no
collective timeout while the driver has nothing to do) and learns the payload's size before the broadcast.

``engine.model_runner.forward_step`` is the forward every rank runs on what arrived — the driver on the tensors it
packed, the workers on the unpacked copies — so both sides execute the same collectives in the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.engine.model_runner import StepInputs
from minillm.kv.block_allocator import BlockCopy, CopyKind
from minillm.kv.paged_cache import AttentionMetadata, PrefillChunk

__all__ = ["StepInputs", "pack_step", "payload_size", "unpack_step"]

COPY_KINDS = tuple(CopyKind)  # a copy's kind travels as its index here


def pack_step(step: StepInputs, device: torch.device | str) -> tuple[tuple[int, ...], Tensor]:
    """-> (header: 10 ints, payload: int64 [n] on ``device``), the layout in the module docstring."""
    copies = [x for c in step.copies for x in (c.src, c.dst, COPY_KINDS.index(c.kind))]
    copy_t = torch.tensor(copies, dtype=torch.long).to(device)
    if not step.has_forward:
        return (0, 0, 0, 0, 0, 0, 0, len(step.copies), 0, 0), copy_t
    m = step.meta
    bounds = torch.tensor([x for p in m.prefills for x in (p.start, p.end, p.context_len, p.block_ids.numel())],
                          dtype=torch.long)
    parts = [step.input_ids[0], step.positions[0], m.slot_mapping, m.decode_rows, m.block_tables.flatten(),
             m.seq_lens, bounds.to(device), *(p.block_ids for p in m.prefills), step.sample_rows, copy_t]
    header = (step.input_ids.shape[1], m.slot_mapping.numel(), m.block_tables.shape[0], m.block_tables.shape[1],
              len(m.prefills), sum(p.block_ids.numel() for p in m.prefills), step.sample_rows.numel(),
              len(step.copies), m.num_padding, int(m.decode_only))
    return header, torch.cat([p.to(device=device, dtype=torch.long) for p in parts])


def payload_size(header: tuple[int, ...]) -> int:
    """The payload's int64 count for ``header`` (what a receiving rank allocates before the broadcast)."""
    t, slots, b_d, width, p, blocks, b_s, c, _, _ = header
    return 2 * t + slots + b_d * (width + 2) + 4 * p + blocks + b_s + 3 * c


def unpack_step(header: tuple[int, ...], payload: Tensor) -> StepInputs:
    """Inverse of ``pack_step``: the payload's segments as the tensors and metadata ``run_step`` reads."""
    t, slots, b_d, width, p, _, b_s, c, num_padding, decode_only = header
    copy_ints = payload[payload.numel() - 3 * c :].tolist()
    copies = [BlockCopy(copy_ints[i], copy_ints[i + 1], COPY_KINDS[copy_ints[i + 2]]) for i in range(0, 3 * c, 3)]
    if t == 0:
        return StepInputs(copies)
    ids, pos, slot, rows, tables, lens, bounds, blocks, sample_rows, _ = payload.split(
        [t, t, slots, b_d, b_d * width, b_d, 4 * p, header[5], b_s, 3 * c])
    bounds = bounds.tolist()  # Python ints: chunk boundaries index the packed rows on the host side
    chunks = []
    for start, end, context_len, n in (bounds[i : i + 4] for i in range(0, 4 * p, 4)):
        chunks.append(PrefillChunk(start, end, context_len, blocks[:n]))
        blocks = blocks[n:]
    meta = AttentionMetadata(slot, rows, tables.view(b_d, width).to(torch.int32), lens.to(torch.int32), chunks,
                             num_padding, bool(decode_only))
    return StepInputs(copies, ids.view(1, t), pos.view(1, t), meta, sample_rows)
