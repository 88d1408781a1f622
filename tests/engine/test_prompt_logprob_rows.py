"""Which rows of a step carry prompt logprobs (``engine/logprobs.py``), at the scheduler: every prompt position of
a ``prompt_logprobs`` request gets one LM-head row, across prefill chunks, and none is skipped by a prefix hit."""

from test_scheduler import make_scheduler  # pytest puts this directory on sys.path

from minillm.engine.model_runner import logit_rows, sampling_chunks
from minillm.engine.sequence import Request
from minillm.sampling.params import SamplingParams

PROMPT = list(range(1, 11))  # 10 tokens: 2 full blocks of 4 and a partial one


def add(sched, rid: str, prompt, **params) -> Request:
    p = SamplingParams(temperature=0, ignore_eos=True, **params)
    request = Request(rid, list(prompt), p, 0.0, [None] * p.n,
                      prompt_logprobs=None if p.prompt_logprobs is None else [None])
    sched.add(request)
    return request


def step(sched, now: float = 0.0):
    """Schedule, then commit as the engine does: one scored entry per prompt row, one token per sampling chunk.
    -> (the output, (request id, start, tokens, prompt rows, all logit rows, first sampling row) per chunk)."""
    out = sched.schedule(now)
    sampling_row = {id(s): row for s, row in sampling_chunks(out)}
    seen = [(s.seq.request.request_id, s.start, s.num_tokens, s.prompt_logit_rows, s.num_logit_rows,
             sampling_row.get(id(s))) for s in out.scheduled]
    assert len(logit_rows(out)) == sum(s.num_logit_rows for s in out.scheduled)
    for s in out.scheduled:
        if s.seq.request.prompt_logprobs is not None:
            s.seq.request.prompt_logprobs += [{}] * s.prompt_logit_rows
    sched.postprocess(out, [[7] * s.num_samples for s in out.scheduled if s.samples], now)
    return out, seen


def test_prompt_rows_cover_each_prompt_position_once_across_chunks():
    sched = make_scheduler(max_num_batched_tokens=4)
    request = add(sched, "a", PROMPT, prompt_logprobs=1, max_tokens=3)
    plain = add(sched, "b", [5, 6, 7], max_tokens=3)
    seen = []
    while len(request.seqs[0].output) < 1:
        seen += step(sched)[1]
    # positions 0-8 scored once each (rows of 4, 4, 1), position 9 samples on the row after them; b has no prompt
    # rows (it did not ask)
    assert [c for c in seen if c[0] == "a"] == [("a", 0, 4, 4, 4, None), ("a", 4, 4, 4, 4, None),
                                                ("a", 8, 2, 1, 2, 1)]
    assert [c for c in seen if c[0] == "b"][0][3:] == (0, 0, None)  # its first chunk does not reach its end
    assert len(request.prompt_logprobs) == len(PROMPT)  # [None] + one per later prompt token
    assert plain.prompt_logprobs is None
    _, seen = step(sched)  # decoding: no prompt rows any more
    assert [c[3:5] for c in seen if c[0] == "a"] == [(0, 1)]


def test_a_prompt_logprobs_request_skips_prefix_cache_hits():
    sched = make_scheduler()
    first = add(sched, "warm", PROMPT, max_tokens=1)
    step(sched)
    assert first.seqs[0].status.finished  # its two full blocks stay in the prefix cache
    add(sched, "hit", PROMPT, max_tokens=1)
    scored = add(sched, "scored", PROMPT, prompt_logprobs=0, max_tokens=1)
    out = sched.schedule(0.0)
    starts = {s.seq.request.request_id: (s.start, s.prompt_logit_rows) for s in out.scheduled}
    assert starts == {"hit": (8, 0), "scored": (0, 9)}
    assert scored.seqs[0].metrics.prefix_hit_tokens == 0


def test_without_room_to_skip_the_hits_it_recomputes_the_cached_blocks():
    """The pool holds the shared blocks but not a private copy: the request keeps the cached blocks and computes
    them again (same tokens, same positions), so every prompt position is still scored."""
    sched = make_scheduler(num_blocks=5, max_model_len=16)
    running = add(sched, "running", PROMPT, max_tokens=2)
    step(sched)
    assert not running.seqs[0].status.finished  # it holds 3 blocks, its 2 full ones cached: 2 free
    scored = add(sched, "scored", PROMPT, prompt_logprobs=0, max_tokens=1)
    out = sched.schedule(0.0)
    bm = sched.block_manager
    shared = bm.block_table(scored.seqs[0].seq_id)[:2]
    assert shared == bm.block_table(running.seqs[0].seq_id)[:2]  # it kept the cached blocks ...
    chunk = next(s for s in out.scheduled if s.seq.request is scored)
    assert (chunk.start, chunk.num_tokens, chunk.prompt_logit_rows) == (0, len(PROMPT), len(PROMPT) - 1)  # ... all rows
    sched.postprocess(out, [[7] for s in out.scheduled if s.samples], 0.0)  # mark_computed accepts the recompute
    assert scored.seqs[0].status.finished
