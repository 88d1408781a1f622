"""Checkers of notebook 06: batching."""

from __future__ import annotations

import random
from collections.abc import Callable

from minillm.course.checks.registry import _passed, exercise
from minillm.course.checks.roofline import prediction_checker


def _reference_batch_slots(slots, remaining, waiting, policy="continuous"):
    """The checker's own slot-model step (independent of the fenced solution)."""
    kept = [None if r is None or remaining[r] == 0 else r for r in slots]
    queue = list(waiting)
    if policy == "static" and any(r is not None for r in kept):
        return kept, queue
    for i in range(len(kept)):
        if kept[i] is None and queue:
            kept[i] = queue.pop(0)
    return kept, queue


@exercise("6.1", "minillm.course.slot_model.batch_slots", "one step of static or continuous batching",
          "retire: slots whose request has remaining 0 become None; admit: pop waiting requests into the empty "
          "slots, lowest index first — every step if continuous, only when all slots are empty if static")
def check_batch_slots(batch_slots: Callable) -> None:
    """``batch_slots(slots, remaining, waiting, policy)`` on hand-made steps (retire, admit order, a static batch
    still running, an empty queue), then whole timelines of ``slot_timeline`` with the student's step."""
    from minillm.course.slot_model import slot_timeline

    reference = _reference_batch_slots

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
            got = slot_timeline(lens, k, policy, step=batch_slots)
            expected = slot_timeline(lens, k, policy, step=_reference_batch_slots)
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
    def reference(remaining: int, budget: int, max_tokens: int, chunked: bool) -> int:
        if chunked or remaining <= budget:
            return min(remaining, budget)
        return budget if remaining > max_tokens and budget == max_tokens else 0

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


# ------------------------------------------------------------------------------------------ 6.3: admission
def _reference_admit(self, out, budget: int, now: float) -> None:
    """The checker's own admission step (written here, independent of the fenced ``Scheduler._admit``)."""
    from minillm.engine.scheduler import Policy

    c = self.config
    while budget > 0 and self.waiting:
        head = self.waiting[0]
        in_batch = self.policy is Policy.CONTINUOUS or head.request.request_id in (self.batch or set())
        seats = sum(s.seq_slots for s in self.running) + head.seq_slots <= c.max_num_seqs
        if not (in_batch and seats and self.block_manager.can_allocate(head.token_ids)):
            break
        if not c.chunked_prefill and head.num_tokens > budget and not (
                head.num_tokens > c.max_num_batched_tokens and budget == c.max_num_batched_tokens):
            break
        hits = self.block_manager.allocate(head.seq_id, head.token_ids)
        self.waiting.popleft()
        self._start_running(head, hits, now)
        budget -= self._schedule_chunk(head, out, budget)


def _drive_scheduler(cls: type, config, num_blocks: int, requests: list, steps: int = 40) -> list:
    """Run a model-less ``cls`` scheduler over ``requests`` [(id, prompt, max_tokens, arrival step)], sampling
    token 1 for everyone; per step: the scheduled chunks (request, sample, start, tokens), the preempted, the
    waiting and running requests and their computed tokens."""
    from minillm.engine.sequence import Request
    from minillm.sampling.params import SamplingParams

    sched = cls(config, num_blocks=num_blocks, max_model_len=512)
    pending = sorted(requests, key=lambda r: r[3])
    rows = []
    for step in range(steps):
        while pending and pending[0][3] <= step:
            rid, prompt, max_tokens, arrival = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            sched.add(Request(rid, list(prompt), params, float(arrival), [None]))
        out = sched.schedule(now=float(step))
        rows.append({
            "scheduled (request, start, tokens)": [(s.seq.request.request_id, s.start, s.num_tokens)
                                                  for s in out.scheduled],
            "waiting": [s.request.request_id for s in sched.waiting],
            "running (request, computed tokens)": [(s.request.request_id, s.num_computed) for s in sched.running],
        })
        sched.postprocess(out, [[1] * s.num_samples for s in out.scheduled if s.samples], now=float(step))
        if not pending and not sched.has_unfinished():
            break
    return rows


@exercise("6.3", "minillm.engine.scheduler.Scheduler._admit", "admit waiting requests under the step's budgets",
          "walk the waiting queue from its head; stop at the first sequence that may not start (batch, seats, "
          "blocks, or — unchunked — a prompt that does not fit the budget left)")
def check_admit(scheduler_class: type) -> None:
    """A ``Scheduler`` subclass with the student's ``_admit`` against the checker's own admission rule, on named
    scenarios (first come first served behind a blocked head, seats, blocks, chunked and unchunked budgets, prefix
    hits, static batches, preemption) and random traces: the scheduled chunks and queues must match at every step."""
    from minillm.config import EngineConfig
    from minillm.engine.scheduler import Scheduler

    class Reference(Scheduler):
        _admit = _reference_admit

    def cfg(**kw):
        base = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 4, "enable_prefix_caching": False}
        return EngineConfig(**{**base, **kw})

    def toks(n, start=1):
        return list(range(start, start + n))

    scenarios = [
        ("continuous, plenty of room: everyone starts at once", cfg(), 64,
         [("a", toks(6), 3, 0), ("b", toks(5, 50), 3, 0), ("c", toks(7, 90), 2, 0)]),
        ("seats: max_num_seqs=2, the third waits for a seat", cfg(max_num_seqs=2), 64,
         [("a", toks(4), 3, 0), ("b", toks(4, 50), 5, 0), ("c", toks(4, 90), 2, 0)]),
        ("blocks: the head needs more blocks than are free; a small request behind it must not overtake",
         cfg(), 8, [("a", toks(12), 8, 0), ("big", toks(20, 50), 2, 1), ("small", toks(2, 90), 2, 1)]),
        ("unchunked: a prompt that does not fit the budget left waits a step", cfg(chunked_prefill=False), 64,
         [("a", toks(20), 3, 0), ("b", toks(20, 50), 3, 0), ("c", toks(4, 90), 3, 0)]),
        ("chunked: the budget left is spent on the next prompt's first chunk", cfg(), 64,
         [("a", toks(20), 3, 0), ("b", toks(20, 50), 3, 0), ("c", toks(30, 90), 3, 0)]),
        ("decodes spend the budget first: a newcomer gets what is left", cfg(max_num_seqs=4, max_num_batched_tokens=4),
         64, [("a", toks(1), 6, 0), ("b", toks(1, 50), 6, 0), ("c", toks(1, 90), 6, 0), ("d", toks(3, 130), 2, 2)]),
        ("decodes spend the budget, unchunked: the newcomer waits",
         cfg(max_num_seqs=4, max_num_batched_tokens=4, chunked_prefill=False), 64,
         [("a", toks(1), 6, 0), ("b", toks(1, 50), 6, 0), ("c", toks(1, 90), 6, 0), ("d", toks(3, 130), 2, 2)]),
        ("prefix caching: a hit starts the sequence at the cached tokens", cfg(enable_prefix_caching=True), 64,
         [("a", toks(9), 2, 0), ("b", toks(9) + [70, 71], 2, 3)]),
        ("static: requests outside the batch in flight wait for all of it", cfg(policy="static", max_num_seqs=2), 64,
         [("a", toks(4), 2, 0), ("b", toks(4, 50), 6, 0), ("c", toks(4, 90), 2, 0)]),
        ("preemption: re-admitted sequences go first", cfg(max_num_batched_tokens=16), 7,
         [("a", toks(6), 10, 0), ("b", toks(6, 50), 10, 0), ("c", toks(5, 90), 4, 1)]),
    ]
    rng = random.Random()  # fresh traces every run
    for trial in range(12):
        chunked = rng.random() < 0.6
        budget = rng.choice([8, 16, 32])
        reqs = [(f"r{i}", [rng.randrange(1, 9) for _ in range(rng.randint(1, budget if not chunked else 24))],
                 rng.randint(1, 8), rng.randint(0, 6)) for i in range(rng.randint(2, 7))]
        config = cfg(max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=budget, chunked_prefill=chunked,
                     enable_prefix_caching=rng.random() < 0.5, policy=rng.choice(["continuous"] * 3 + ["static"]))
        scenarios.append((f"random trace {trial} ({config.policy}, chunked_prefill={chunked}, budget {budget}, "
                          f"{config.max_num_seqs} seats)", config, rng.randint(10, 40), reqs))
    for name, config, num_blocks, reqs in scenarios:
        got, expected = _drive_scheduler(scheduler_class, config, num_blocks, reqs), \
            _drive_scheduler(Reference, config, num_blocks, reqs)
        for step, (g, e) in enumerate(zip(got, expected, strict=False)):  # lengths compared below
            for key in e:
                assert g[key] == e[key], (
                    f"{name}: requests {[(r[0], len(r[1]), r[3]) for r in reqs]} as (id, prompt tokens, arrival "
                    f"step); at step {step} {key} is {g[key]}, expected {e[key]}. Admit from the head of the "
                    "waiting queue only; stop at the first one that may not start.")
        assert len(got) == len(expected), f"{name}: ran {len(got)} steps, expected {len(expected)}"
    _passed("6.3")


check_prediction_batching = prediction_checker(
    "6.0", "prediction_batching", "minillm.course.predictions.predict_continuous_speedup",
    "the continuous ÷ static throughput", "×", example=(2.0,), kind="estimate", factor=4.0)
