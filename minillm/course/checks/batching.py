"""Checkers of notebook 06: batching."""

from __future__ import annotations

import random
from collections.abc import Callable

from minillm.course.checks.registry import _passed, exercise


@exercise("6.1", "minillm.course.slot_model.batch_slots", "one step of static or continuous batching",
          "retire: slots whose request has remaining 0 become None; admit: pop waiting requests into the empty "
          "slots, lowest index first — every step if continuous, only when all slots are empty if static")
def check_batch_slots(batch_slots: Callable) -> None:
    """``batch_slots(slots, remaining, waiting, policy)`` on hand-made steps (retire, admit order, a static batch
    still running, an empty queue), then whole timelines of ``slot_timeline`` with the student's step."""
    from minillm.course.slot_model import batch_slots as reference
    from minillm.course.slot_model import slot_timeline

    cases = [
        ("two requests finished, two waiting", [0, 1, 2], [0, 3, 0, 5, 2], [3, 4], "continuous"),
        ("more empty slots than waiting requests", [None, None, None], [4], [0], "continuous"),
        ("nothing finished: nobody joins", [0, 1], [2, 1, 7], [2], "continuous"),
        ("empty queue", [0, None, 1], [0, 0], [], "continuous"),
        ("the earliest waiting request takes the lowest free slot", [None, 0, None, 1], [5, 0, 3, 3, 3], [4, 2, 3],
         "continuous"),
        ("static: one request of the batch still runs", [0, 1, 2], [0, 4, 0, 6], [3], "static"),
        ("static: the whole batch finished", [0, 1], [0, 0, 3, 3, 3], [2, 3, 4], "static"),
        ("static: the first step", [None, None], [3, 1, 2], [0, 1, 2], "static"),
    ]
    for name, slots, remaining, waiting, policy in cases:
        args = (list(slots), list(remaining), list(waiting))
        got, expected = batch_slots(*args, policy), reference(list(slots), list(remaining), list(waiting), policy)
        call = f"{name}: batch_slots(slots={slots}, remaining={remaining}, waiting={waiting}, policy={policy!r})"
        assert isinstance(got, tuple) and len(got) == 2, f"{call} must return (slots, waiting), got {got!r}"
        assert list(got[0]) == expected[0] and list(got[1]) == expected[1], (
            f"{call} returned {got!r}, expected {expected!r}. Retire first (remaining 0 -> None), then admit "
            "from the front of the queue into empty slots in index order; static admits only into an all-empty "
            "batch.")
        assert args == (slots, remaining, waiting), f"{call} modified its arguments: {args}"
    rng = random.Random(0)
    for _ in range(10):
        lens = [rng.choice([rng.randint(1, 4), rng.randint(10, 20)]) for _ in range(rng.randint(1, 14))]
        for policy in ("continuous", "static"):
            k = rng.randint(1, 4)
            got, expected = slot_timeline(lens, k, policy, step=batch_slots), slot_timeline(lens, k, policy)
            if got != expected:
                i = next(i for i in range(len(got) + 1) if got[i : i + 1] != expected[i : i + 1])
                raise AssertionError(
                    f"slot_timeline({lens}, num_slots={k}, policy={policy!r}) with your step ran {len(got)} steps, "
                    f"expected {len(expected)}; first difference at step {i}: your slots {got[i : i + 1]}, expected "
                    f"{expected[i : i + 1]}.")
    _passed("6.1")


@exercise("6.2", "minillm.engine.scheduler.prefill_chunk_len", "the chunked-prefill budget",
          "as many tokens as the budget leaves; without chunked_prefill a prompt that does not fit whole gets 0 — "
          "unless it is longer than max_num_batched_tokens and the budget is untouched (== max_num_batched_tokens)")
def check_prefill_chunk_len(prefill_chunk_len: Callable) -> None:
    """``prefill_chunk_len(remaining, budget, max_num_batched_tokens, chunked_prefill)`` on every combination of
    small sizes, chunked and not."""
    from minillm.engine.scheduler import prefill_chunk_len as reference

    for max_tokens in (1, 8, 16):
        for chunked in (True, False):
            for budget in range(max_tokens + 1):
                for remaining in range(1, 2 * max_tokens + 3):
                    got = prefill_chunk_len(remaining, budget, max_tokens, chunked)
                    expected = reference(remaining, budget, max_tokens, chunked)
                    if got == expected:
                        continue
                    if chunked:
                        why = "with chunked prefill a sequence takes as many tokens as the budget leaves"
                    elif remaining <= budget:
                        why = "it fits the budget left, so it runs whole"
                    elif remaining <= max_tokens:
                        why = ("without chunked prefill a prompt runs whole or waits; it fits a whole step, so it "
                               "waits for a step with enough budget")
                    elif budget == max_tokens:
                        why = ("it is longer than a whole step's budget, so unsplit it could never run: from a "
                               "fresh budget it is split anyway")
                    else:
                        why = "an over-long sequence is split only from a fresh budget; this one is partly spent"
                    raise AssertionError(
                        f"prefill_chunk_len(remaining={remaining}, budget={budget}, max_num_batched_tokens="
                        f"{max_tokens}, chunked_prefill={chunked}) returned {got!r}, expected {expected}: {why}.")
    _passed("6.2")
