"""The slot model of batching: the scheduler with tokens and KV blocks abstracted away (notebook 06).

A batch has ``num_slots`` slots; each step every occupied slot produces one token, and a request leaves once it
has produced all of its tokens.  ``batch_slots`` is one step (which request occupies which slot); ``slot_timeline``
runs it over a whole trace.  When every prompt fits one step's token budget and KV blocks are plentiful, the real
``Scheduler`` runs exactly these requests at each step — with ``pad_batches`` a static batch still *computes* its
finished slots (pad rows), but they produce nothing, as here.
"""

from __future__ import annotations

__all__ = ["batch_slots", "slot_timeline"]


def batch_slots(slots: list[int | None], remaining: list[int], waiting: list[int],
                policy: str = "continuous") -> tuple[list[int | None], list[int]]:
    """One step of the slot model of batching: which request runs in each of ``len(slots)`` batch slots.

    ``slots[i]``: the request id that ran in slot i last step (None: empty); ``remaining[r]``: tokens request r
    still has to produce (0: it produced its last one); ``waiting``: ids not started yet, in arrival order.
    **Retire**: empty every slot whose request has nothing remaining.  **Admit**, first come first served, into
    the empty slots, lowest index first: "continuous" does it every step; "static" only once every slot is empty
    (the whole previous batch has finished).  Returns (the slots for this step, the requests still waiting);
    the arguments are not modified.  Each request in a slot then produces one token this step.

    This is ``Scheduler`` at the level of slots: when every prompt fits one step's token budget and KV blocks
    are plentiful, the real scheduler runs exactly these requests at each step (notebook 06 checks it).
    """
    if policy not in ("continuous", "static"):
        raise ValueError(f"the slot model knows 'continuous' and 'static' (dynamic needs a clock), got {policy!r}")
    ### BEGIN SOLUTION
    slots = [r if r is not None and remaining[r] > 0 else None for r in slots]  # retire the finished
    waiting = list(waiting)
    if policy == "continuous" or all(r is None for r in slots):  # static: only an empty batch takes new requests
        for i, r in enumerate(slots):
            if r is None and waiting:
                slots[i] = waiting.pop(0)
    return slots, waiting
    ### END SOLUTION


def slot_timeline(output_lens: list[int], num_slots: int, policy: str = "continuous", *,
                  step=batch_slots) -> list[list[int | None]]:
    """Run the slot model until every request has produced its ``output_lens[r]`` tokens (all waiting at step 0).

    Returns one row per step: the request id in each slot (None: an idle slot, the "bubble").  Each occupied slot
    produces one token per step, the prefill's first token included.  ``step`` is the step function
    (``batch_slots``, or your own).  Slot-steps wasted = len(rows) × num_slots − sum(output_lens).
    """
    if num_slots < 1 or any(n < 1 for n in output_lens):
        raise ValueError(f"need num_slots >= 1 and every output length >= 1, got {num_slots}, {output_lens}")
    remaining = list(output_lens)
    slots: list[int | None] = [None] * num_slots
    waiting = list(range(len(output_lens)))
    rows = []
    while waiting or any(r is not None and remaining[r] > 0 for r in slots):
        slots, waiting = step(slots, list(remaining), waiting, policy)
        if all(r is None for r in slots):
            raise RuntimeError(f"step {len(rows)}: requests {waiting} wait but no slot runs anything")
        rows.append(list(slots))
        for r in slots:
            if r is not None:
                remaining[r] -= 1
    return rows
