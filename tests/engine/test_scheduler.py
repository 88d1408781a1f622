"""The scheduler alone (no model): budgets, policies, preemption, and a property test of its invariants.

Sampled tokens are faked, so thousands of steps run in a second.  A shadow of the KV cache records, for every
slot the scheduler asks the runner to write, the whole prefix ending at that token; every scheduled chunk must
then find its earlier context in its block table — which catches lost copy-on-write, swap or prefix-cache bugs
at the scheduler level.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import EngineConfig, SamplingParams
from minillm.engine.scheduler import Policy, Scheduler, SchedulerOutput
from minillm.engine.sequence import Request, SequenceStatus
from minillm.kv.block_allocator import CopyKind

EOS = 0


def make_scheduler(num_blocks=64, max_model_len=64, **kw) -> Scheduler:
    config = EngineConfig(**{"block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, **kw})
    return Scheduler(config, num_blocks, max_model_len, num_host_blocks=config.resolve_host_blocks(num_blocks),
                     eos_token_ids=(EOS,))


def add(sched: Scheduler, rid: str, prompt, arrival=0.0, **params) -> Request:
    p = SamplingParams(**{"temperature": 0, "ignore_eos": True, **params})
    request = Request(rid, list(prompt), p, arrival, [None] * p.n)
    sched.add(request)
    return request


class Shadow:
    """What each KV slot would hold: the tuple of tokens up to and including the one written there."""

    def __init__(self, sched: Scheduler):
        self.sched, self.bs = sched, sched.block_manager.block_size
        self.pools = {"device": {}, "host": {}}

    def step(self, out) -> None:
        for c in out.copies:
            src, dst = {CopyKind.COPY_ON_WRITE: ("device", "device"), CopyKind.SWAP_OUT: ("device", "host"),
                        CopyKind.SWAP_IN: ("host", "device")}[c.kind]
            for i in range(self.bs):
                value = self.pools[src].get(c.src * self.bs + i)
                self.pools[dst][c.dst * self.bs + i] = value
        bm = self.sched.block_manager
        for s in out.scheduled:
            seq = s.seq
            slots = bm.slot_mapping(seq.seq_id, 0, s.start + s.num_tokens)
            for p in range(s.start):
                assert self.pools["device"].get(slots[p]) == tuple(seq.token_ids[: p + 1]), \
                    f"seq {seq.seq_id}: slot of position {p} holds another prefix's K/V"
            for p in range(s.start, s.start + s.num_tokens):
                self.pools["device"][slots[p]] = tuple(seq.token_ids[: p + 1])


def fake_tokens(out, rng, eos_rate=0.0) -> list[list[int]]:
    return [[EOS if rng.random() < eos_rate else rng.randrange(1, 50) for _ in range(s.num_samples)]
            for s in out.scheduled if s.samples]


def check_step(sched: Scheduler, out) -> None:
    c, bm = sched.config, sched.block_manager
    assert out.num_tokens <= c.max_num_batched_tokens
    assert sum(s.seq_slots for s in sched.running) <= c.max_num_seqs
    assert bm.device.num_used <= bm.device.num_blocks
    ids = [s.seq.seq_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a sequence was scheduled twice in one step"
    for s in out.scheduled:
        assert s.seq.status is SequenceStatus.RUNNING and s.num_tokens >= 1
        assert s.start == s.seq.num_computed and s.start + s.num_tokens <= s.seq.num_tokens
        assert bm.num_tokens(s.seq.seq_id) >= s.start + s.num_tokens, "tokens scheduled without KV slots"
        if sched.policy is not Policy.CONTINUOUS:
            assert s.seq.request.request_id in sched.batch
    for seq in sched.waiting:
        assert seq.seq_id not in bm, "a waiting sequence holds blocks"
    for seq in sched.swapped:
        assert bm.residence(seq.seq_id).value == "host"


# ---- examples ---------------------------------------------------------------------------------------------------
def test_decodes_go_first_then_prefill_chunks_fill_the_budget():
    sched = make_scheduler()
    add(sched, "a", range(1, 4), max_tokens=5)
    out = sched.schedule(0.0)
    sched.postprocess(out, [[7]], 0.0)
    add(sched, "b", range(1, 40), max_tokens=5)
    out = sched.schedule(0.0)
    assert [(s.seq.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 15)]


def test_a_newcomer_prefills_in_every_step_beside_a_full_decode_batch_until_its_first_token():
    # decode-first, then admission with what the budget leaves: a request arriving under a decode-heavy batch
    # starts in the very next step and gets budget - decodes tokens a step, so its first token comes after
    # ceil(prompt / (budget - decodes)) steps, never behind the decodes' whole lifetimes
    sched, rng = make_scheduler(num_blocks=256, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16), \
        random.Random(0)
    for i in range(7):
        add(sched, f"d{i}", range(1, 4), max_tokens=100)
    for _ in range(3):  # 7 × 3 prompt tokens: prefilled within two steps; then every one of them decodes
        out = sched.schedule(0.0)
        sched.postprocess(out, fake_tokens(out, rng), 0.0)
    add(sched, "new", range(1, 30), max_tokens=5)
    steps = 0
    while True:
        out = sched.schedule(0.0)
        steps += 1
        chunks = [(s.seq.request.request_id, s.num_tokens) for s in out.scheduled]
        assert chunks[:7] == [(f"d{i}", 1) for i in range(7)] and chunks[7][0] == "new"
        assert chunks[7][1] == min(16 - 7, 29 - 9 * (steps - 1))
        sampled = out.scheduled[7].samples
        sched.postprocess(out, fake_tokens(out, rng), 0.0)
        if sampled:
            break
    assert steps == 4  # ceil(29 / 9)


def test_newest_running_sequence_is_preempted_and_requeued_first_with_its_tokens():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=16)  # 16 slots in all
    add(sched, "old", range(1, 8), max_tokens=8)  # 7 + 8 tokens: 4 blocks at the end
    add(sched, "new", range(1, 5), arrival=1.0, max_tokens=8)
    rng = random.Random(0)
    preempted = []
    for _ in range(20):
        out = sched.schedule(0.0)
        preempted += [s.request.request_id for s in out.preempted]
        sched.postprocess(out, fake_tokens(out, rng), 0.0)
        if preempted:
            break
    assert preempted == ["new"]
    new = sched.requests["new"].seqs[0]
    assert new.status is SequenceStatus.WAITING and sched.waiting[0] is new and new.output  # outputs kept
    assert new.seq_id not in sched.block_manager


def test_swap_preemption_moves_blocks_to_host_and_back():
    sched = make_scheduler(num_blocks=4, preemption="swap")
    add(sched, "old", range(1, 8), max_tokens=8)
    add(sched, "new", range(1, 5), arrival=1.0, max_tokens=8)
    shadow, rng, kinds = Shadow(sched), random.Random(0), set()
    for _ in range(100):
        out = sched.schedule(0.0)
        shadow.step(out)
        kinds |= {c.kind for c in out.copies}
        sched.postprocess(out, fake_tokens(out, rng), 0.0)
        if not sched.has_unfinished():
            break
    assert {CopyKind.SWAP_OUT, CopyKind.SWAP_IN} <= kinds and sched.stats.swaps_out >= 1
    assert not sched.has_unfinished() and sched.block_manager.device.num_used == 0


def test_request_that_can_never_fit_is_rejected_naming_the_fix():
    sched = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="needs up to 5 KV blocks.*has 4.*num_kv_blocks"):
        add(sched, "big", range(1, 10), max_tokens=12)
    with pytest.raises(ValueError, match="n=5.*max_num_seqs"):
        add(sched, "wide", [1, 2], n=5)
    no_chunks = make_scheduler(chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked_prefill"):
        add(no_chunks, "long", range(1, 20))
    assert not sched.has_unfinished()


def run_short_long_short(**config) -> list[SchedulerOutput]:
    """Requests a (1 token), b (6 tokens), c (1 token) in two slots, run to the end; every step's output."""
    sched = make_scheduler(max_num_seqs=2, **config)
    add(sched, "a", [1, 2], max_tokens=1)
    add(sched, "b", [1, 3], max_tokens=6)
    add(sched, "c", [1, 4], max_tokens=1)
    outs, rng = [], random.Random(0)
    while sched.has_unfinished():
        outs.append(sched.schedule(0.0))
        sched.postprocess(outs[-1], fake_tokens(outs[-1], rng), 0.0)
    assert sched.stats.padding_rows == sum(out.num_padding for out in outs)
    return outs


def test_static_batch_runs_to_completion_before_the_next_starts():
    seen = [{s.seq.request.request_id for s in out.scheduled} for out in run_short_long_short(policy="static")]
    assert seen[0] == {"a", "b"} and seen[1] == {"b"}  # "a" is done but "c" waits for the longest, "b"
    assert seen.index({"c"}) == 6


@pytest.mark.parametrize("policy,pad,want", [("static", True, [0, 1, 1, 1, 1, 1, 0]),
                                              ("static", False, [0] * 7), ("continuous", True, [0] * 6)])
def test_finished_members_of_a_fixed_shape_batch_pad_it_until_it_ends(policy, pad, want):
    padding = [out.num_padding for out in run_short_long_short(policy=policy, pad_batches=pad)]
    assert padding == want  # "a"'s row runs beside "b" for 5 steps; "c" starts a new batch, unpadded


def test_dynamic_batch_waits_for_a_full_batch_or_the_window():
    sched = make_scheduler(policy="dynamic", max_num_seqs=3, dynamic_window_s=0.1)
    add(sched, "a", [1, 2], arrival=0.0, max_tokens=2)
    assert sched.schedule(0.05).is_empty  # one waiting, window open: keep collecting
    add(sched, "b", [1, 3], arrival=0.06, max_tokens=2)
    assert {s.seq.request.request_id for s in sched.schedule(0.11).scheduled} == {"a", "b"}
    full = make_scheduler(policy="dynamic", max_num_seqs=2, dynamic_window_s=10.0)
    add(full, "a", [1, 2])
    add(full, "b", [1, 3])
    assert len(full.schedule(0.0).scheduled) == 2  # full batch: no need to wait


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(num_blocks=8)
    add(sched, "a", range(1, 10), max_tokens=8)
    add(sched, "b", range(1, 30), max_tokens=2)  # waits: 8 blocks cannot hold both
    out = sched.schedule(0.0)
    sched.postprocess(out, fake_tokens(out, random.Random(0)), 0.0)
    assert sched.block_manager.device.num_used > 0
    sched.abort("a")
    sched.abort("b")
    assert not sched.has_unfinished() and sched.block_manager.device.num_used == 0
    with pytest.raises(KeyError, match="unknown or already finished"):
        sched.abort("a")


# ---- the property test ------------------------------------------------------------------------------------------
@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    max_num_seqs = draw(st.integers(1, 5))
    config = dict(policy=draw(st.sampled_from(["continuous", "dynamic", "static"])), block_size=bs,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=draw(st.integers(max_num_seqs, 24)),
                  preemption=draw(st.sampled_from(["recompute", "swap"])), chunked_prefill=draw(st.booleans()),
                  enable_prefix_caching=draw(st.booleans()), dynamic_window_s=0.03)
    # prompts from a 3-token alphabet with a shared head, so prefix-cache hits happen
    head = draw(st.lists(st.integers(1, 3), max_size=12))
    request = st.tuples(st.integers(0, 30), st.lists(st.integers(1, 3), max_size=14), st.integers(1, 10),
                        st.integers(1, min(3, max_num_seqs)))  # arrival step, prompt tail, max_tokens, n
    requests = draw(st.lists(request, min_size=1, max_size=8))
    requests = [(t, (head + tail) or [1], max_tokens, n) for t, tail, max_tokens, n in requests]
    if not config["chunked_prefill"]:
        config["max_num_batched_tokens"] = max(config["max_num_batched_tokens"], *(len(p) for _, p, _, _ in requests))
    need = max(-(-(len(p) + m - 1) // bs) for _, p, m, _ in requests)
    num_blocks = draw(st.integers(need, need + 12))
    return config, num_blocks, requests, draw(st.integers(0, 2**32)), draw(st.sampled_from([0.0, 0.1]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_invariants_hold_and_every_request_finishes(workload):
    config, num_blocks, requests, seed, eos_rate = workload
    sched = make_scheduler(num_blocks=num_blocks, max_model_len=64, **config)
    shadow, rng = Shadow(sched), random.Random(seed)
    arrivals = sorted(enumerate(requests), key=lambda x: x[1][0])
    total = sum(len(p) + m * n for _, p, m, n in requests)
    step = 0
    while arrivals or sched.has_unfinished():
        now = step * 0.01
        while arrivals and arrivals[0][1][0] <= step:
            i, (_, prompt, max_tokens, n) = arrivals.pop(0)
            add(sched, str(i), prompt, arrival=now, max_tokens=max_tokens, n=n, ignore_eos=eos_rate == 0)
        if step % 17 == 5 and sched.requests and rng.random() < 0.3:
            sched.abort(rng.choice(sorted(sched.requests)))
        out = sched.schedule(now)
        check_step(sched, out)
        shadow.step(out)
        sched.postprocess(out, fake_tokens(out, rng, eos_rate), now)
        step += 1
        assert step <= 100 + 20 * total, "no progress: the scheduler livelocked or deadlocked"
    bm = sched.block_manager
    assert bm.device.num_used == 0 and (bm.host is None or bm.host.num_used == 0)
    assert not sched.running and not sched.waiting and not sched.swapped
