"""Paged KV bookkeeping: allocator, block tables, prefix cache, copy-on-write, swap (minillm.kv.block_allocator).

The stateful test keeps a shadow of the KV cache in which each slot holds the *whole prefix* ending at its token
(a token's K/V depends on every token before it), so serving a block cached under a different prefix is caught
even when the block's own tokens match.
"""

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.kv.block_allocator import (
    BlockAllocator,
    BlockCopy,
    CopyKind,
    OutOfBlocks,
    Residence,
    contiguous_reservation_waste,
    hash_block_tokens,
    paged_waste,
)
from minillm.kv.block_manager import BlockManager
from minillm.kv.eviction import EVICTED, H2OPolicy, KVEvictionPolicy


def observable_state(mgr: BlockManager, seq_ids) -> tuple:
    """Everything a failed call must leave untouched."""
    pools = [p for p in (mgr.device, mgr.host) if p is not None]
    return (
        [[p.ref_count(b) for b in range(p.num_blocks)] for p in pools],
        [p.evictable_blocks() for p in pools],
        [sorted(p.cached_blocks().items()) for p in pools],
        [p.num_free for p in pools],
        {s: mgr.sequence(s) for s in seq_ids},
        (mgr.prefix_stats.requests, mgr.prefix_stats.query_tokens, mgr.prefix_stats.hit_tokens),
    )


def computed_manager(prompt, bs=4, **kwargs) -> tuple[BlockManager, list[int]]:
    mgr = BlockManager(kwargs.pop("num_blocks", 16), bs, **kwargs)
    mgr.allocate("a", prompt)
    mgr.mark_computed("a", len(prompt))
    return mgr, mgr.block_table("a")


# ---- example tests ------------------------------------------------------------------------------------------------
def test_paged_pool_reuses_freed_blocks():
    alloc = BlockAllocator(4, block_size=4)
    ids = [alloc.allocate() for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3] and alloc.num_free == 0
    with pytest.raises(OutOfBlocks):
        alloc.allocate()
    alloc.free(ids[2])
    assert alloc.allocate() == ids[2]

    mgr = BlockManager(4, 4)
    mgr.allocate("a", list(range(8)))
    mgr.allocate("b", list(range(100, 108)))
    freed = set(mgr.block_table("a"))
    mgr.free("a")
    mgr.allocate("c", list(range(200, 208)))
    assert set(mgr.block_table("c")) == freed


def test_double_free_raises():
    alloc = BlockAllocator(2, block_size=4)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="out of range"):
        alloc.free(7)


def test_prefix_hit_returns_cached_block_ids_for_shared_prefix():
    prompt = list(range(10))
    mgr, a_blocks = computed_manager(prompt)
    num_cached = mgr.allocate("b", prompt[:8] + [77, 78, 79])
    b_blocks = mgr.block_table("b")
    assert num_cached == 8
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] not in a_blocks
    assert [mgr.device.ref_count(b) for b in b_blocks] == [2, 2, 1]
    assert mgr.prefix_stats.hit_tokens == 8 and mgr.prefix_stats.query_tokens == 21


def test_partial_block_is_never_cached():
    mgr, a_blocks = computed_manager(list(range(6)))  # block 0 full, block 1 holds 2 of 4 tokens
    assert mgr.device.cached_blocks() == {a_blocks[0]: (0, 1, 2, 3)}
    assert mgr.allocate("b", list(range(6)) + [9, 9]) == 4  # block 1 of "b" matches "a"'s tokens but is not reused
    assert mgr.block_table("b")[1] != a_blocks[1]


def test_fully_cached_prompt_still_recomputes_its_last_block():
    prompt = list(range(8))
    mgr, a_blocks = computed_manager(prompt)
    assert len(mgr.device.cached_blocks()) == 2
    assert mgr.allocate("b", prompt) == 4  # the block holding the last token is computed to get its logits


def test_prefix_cache_waits_until_kv_is_written():
    mgr = BlockManager(16, 4)
    prompt = list(range(12))
    mgr.allocate("a", prompt)
    mgr.mark_computed("a", 4)  # chunked prefill: only the first chunk's K/V exists
    assert mgr.allocate("b", prompt) == 4
    mgr.mark_computed("a", 12)
    assert mgr.allocate("c", prompt) == 8


def test_lru_evicts_least_recently_used_cached_block():
    alloc = BlockAllocator(3, block_size=2)
    blocks = {name: alloc.allocate() for name in "xyz"}
    hashes = {name: hash_block_tokens(None, [i, i]) for i, name in enumerate("xyz")}
    for i, name in enumerate("xyz"):
        assert alloc.register(blocks[name], hashes[name], [i, i], None)
    for name in "xyz":
        alloc.free(blocks[name])
    assert alloc.evictable_blocks() == [blocks["x"], blocks["y"], blocks["z"]] and alloc.num_free == 3
    alloc.incref(alloc.lookup(hashes["x"], [0, 0], None))  # a cache hit makes x the most recently used
    alloc.free(blocks["x"])

    assert alloc.allocate() == blocks["y"]
    assert alloc.lookup(hashes["y"], [1, 1], None) is None
    assert alloc.lookup(hashes["x"], [0, 0], None) == blocks["x"]
    assert alloc.lookup(hashes["z"], [2, 2], None) == blocks["z"]


def test_out_of_blocks_raises_and_leaves_state_unchanged():
    mgr = BlockManager(4, 4)
    mgr.allocate("a", list(range(9)))  # 3 blocks
    mgr.mark_computed("a", 9)
    before = observable_state(mgr, ["a"])
    assert not mgr.can_allocate(list(range(50, 58)))
    with pytest.raises(OutOfBlocks, match="needs 2 new blocks but 1 are free"):
        mgr.allocate("b", list(range(50, 58)))
    assert observable_state(mgr, ["a"]) == before and "b" not in mgr
    with pytest.raises(OutOfBlocks):
        mgr.append_slots("a", list(range(8)))  # 7 tokens would fit, the 8th needs a 5th block: none is added
    assert observable_state(mgr, ["a"]) == before
    mgr.append_slots("a", list(range(7)))

    mgr.free("a")  # its cached blocks become evictable, and still count as free
    assert mgr.device.num_free == 4 and mgr.allocate("b", list(range(50, 58))) == 0


def test_prefix_hit_on_evictable_block_is_reserved_before_eviction():
    mgr = BlockManager(6, 4)
    for name, first in (("a", [0, 1, 2, 3]), ("e", [10, 11, 12, 13])):
        mgr.allocate(name, first + [9])
        mgr.mark_computed(name, 5)
    a0, e0 = mgr.block_table("a")[0], mgr.block_table("e")[0]
    mgr.free("a")
    mgr.free("e")
    mgr.allocate("b", list(range(100, 116)))  # takes the 4 truly free blocks
    assert mgr.device.evictable_blocks() == [a0, e0]  # a0 is next in line for eviction

    before = observable_state(mgr, ["b"])
    assert not mgr.can_allocate([0, 1, 2, 3, 51, 52, 53, 54, 55])  # reviving a0 uses one of the 2 free blocks
    with pytest.raises(OutOfBlocks):
        mgr.allocate("g", [0, 1, 2, 3, 51, 52, 53, 54, 55])
    assert observable_state(mgr, ["b"]) == before

    assert mgr.allocate("c", [0, 1, 2, 3, 50]) == 4  # a0 is revived first, so the fresh block evicts e0
    assert mgr.block_table("c") == [a0, e0]
    assert mgr.device.cached_blocks() == {a0: (0, 1, 2, 3)} and mgr.device.ref_count(a0) == 1


def test_freed_sequence_evicts_its_tail_before_its_head():
    mgr, (b0, b1, _) = computed_manager(list(range(9)))
    mgr.free("a")
    assert mgr.device.evictable_blocks() == [b1, b0]  # a shorter prefix keeps hitting as long as possible


def test_truncate_rolls_back_and_recomputed_blocks_are_cached_again():
    mgr, (b0, b1, b2) = computed_manager(list(range(9)))
    mgr.truncate("a", 6)  # reject 3 speculative tokens
    assert mgr.block_table("a") == [b0, b1] and mgr.num_tokens("a") == 6
    copies = mgr.append_slots("a", [60, 70, 80])  # b1 is a cache entry: never written in place
    new_b1 = mgr.block_table("a")[1]
    assert copies == [BlockCopy(b1, new_b1, CopyKind.COPY_ON_WRITE)]
    mgr.mark_computed("a", 9)
    assert mgr.device.cached_blocks()[new_b1] == (4, 5, 60, 70)
    assert mgr.allocate("b", [0, 1, 2, 3, 4, 5, 60, 70, 1]) == 8


def test_swapped_in_sequence_is_cached_again():
    mgr = BlockManager(4, 4, num_host_blocks=4)
    mgr.allocate("a", list(range(9)))
    mgr.mark_computed("a", 9)
    mgr.swap_out("a")
    mgr.allocate("x", [7] * 16)  # evicts every cached block
    mgr.free("x")
    assert mgr.device.cached_blocks() == {}
    mgr.swap_in("a")
    assert mgr.allocate("b", list(range(8)) + [1]) == 8


def test_fork_then_append_copies_on_write():
    mgr, a_blocks = computed_manager(list(range(6)))
    mgr.fork("a", "b")
    assert mgr.block_table("b") == a_blocks and [mgr.device.ref_count(b) for b in a_blocks] == [2, 2]

    copies = mgr.append_slot("b", 99)
    b_blocks = mgr.block_table("b")
    assert copies == [BlockCopy(a_blocks[1], b_blocks[1], CopyKind.COPY_ON_WRITE)]
    assert b_blocks[0] == a_blocks[0] and b_blocks[1] != a_blocks[1]
    assert mgr.device.ref_count(a_blocks[1]) == 1 and mgr.device.ref_count(a_blocks[0]) == 2
    assert mgr.append_slot("a", 7) == []  # "a" is now the sole owner: writes in place
    assert mgr.block_table("a") == a_blocks


def test_fork_with_full_last_block_needs_no_copy():
    mgr, a_blocks = computed_manager(list(range(8)))
    mgr.fork("a", "b")
    assert mgr.append_slot("b", 5) == []
    assert mgr.block_table("b")[:2] == a_blocks and len(mgr.block_table("b")) == 3


def test_fork_before_kv_is_written_raises():
    mgr = BlockManager(8, 4)
    mgr.allocate("a", [1, 2, 3])
    with pytest.raises(RuntimeError, match="mark_computed"):
        mgr.fork("a", "b")


def test_slot_mapping_matches_block_table():
    mgr = BlockManager(64, 16)
    mgr.allocate("x", list(range(30)))
    mgr.allocate("a", list(range(37)))
    mgr.free("x")  # so "a"'s blocks are not simply 0, 1, 2
    mgr.append_slots("a", list(range(40)))
    table, slots = mgr.block_table("a"), mgr.slot_mapping("a")
    assert slots == [table[p // 16] * 16 + p % 16 for p in range(77)]
    assert len(set(slots)) == 77 and mgr.slot_mapping("a", 37, 40) == slots[37:40]
    with pytest.raises(ValueError, match="outside"):
        mgr.slot_mapping("a", 70, 78)


def test_hash_collision_never_serves_another_prefix():
    ignores_parent = lambda parent, tokens: bytes(tokens)  # noqa: E731 - same block, any prefix: same hash
    mgr, _ = computed_manager([1, 2, 3, 4, 5, 6, 7, 8, 0], hash_fn=ignores_parent)
    mgr.allocate("d", [9, 9, 9, 9, 0])
    mgr.mark_computed("d", 5)
    # block 0 hits "d"'s block, block 1's tokens match "a"'s block 1 but its K/V was computed after [1, 2, 3, 4]
    assert mgr.allocate("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 4

    first_two = lambda parent, tokens: bytes(tokens[:2])  # noqa: E731 - [1, 2, 3, 4] and [1, 2, 0, 0] collide
    mgr, _ = computed_manager([1, 2, 3, 4, 5], hash_fn=first_two)
    assert mgr.allocate("b", [1, 2, 0, 0, 5]) == 0


def test_disabled_prefix_caching_never_hits():
    mgr, _ = computed_manager(list(range(9)), enable_prefix_caching=False)
    assert mgr.allocate("b", list(range(9))) == 0 and mgr.device.cached_blocks() == {}


def test_swap_out_and_in_report_block_copies():
    mgr = BlockManager(4, 4, num_host_blocks=4)
    mgr.allocate("a", list(range(6)))
    mgr.mark_computed("a", 6)
    device_blocks = mgr.block_table("a")
    out = mgr.swap_out("a")
    host_blocks = mgr.sequence("a").block_ids
    assert out == [BlockCopy(d, h, CopyKind.SWAP_OUT) for d, h in zip(device_blocks, host_blocks, strict=True)]
    assert mgr.residence("a") is Residence.HOST and mgr.device.num_used == 0
    with pytest.raises(RuntimeError, match="swap_in"):
        mgr.append_slot("a", 1)
    back = mgr.swap_in("a")
    assert [(c.src, c.kind) for c in back] == [(h, CopyKind.SWAP_IN) for h in host_blocks]
    assert mgr.block_table("a") == [c.dst for c in back] and mgr.host.num_free == 4


def test_swap_without_host_blocks_names_the_fix():
    mgr, _ = computed_manager([1, 2])
    with pytest.raises(RuntimeError, match="num_host_blocks"):
        mgr.swap_out("a")


def test_paged_waste_under_4_percent_vs_contiguous_reservation_60_to_80_percent():
    rng = random.Random(0)
    max_len = 2048  # the context a contiguous cache must reserve per request
    mgr = BlockManager(4096, 16, enable_prefix_caching=False)
    lens = []
    for i in range(64):  # chat-like: a few hundred prompt tokens, a few hundred generated
        prompt, output = rng.randint(50, 800), rng.randint(20, 500)
        mgr.allocate(i, [rng.randrange(1000) for _ in range(prompt)])
        mgr.append_slots(i, [rng.randrange(1000) for _ in range(output)])
        lens.append(prompt + output)
    stats = mgr.stats()
    assert stats.physical_tokens == stats.logical_tokens == sum(lens)
    assert stats.waste == pytest.approx(paged_waste(lens, 16)) and stats.waste < 0.04
    assert 0.6 < contiguous_reservation_waste(lens, max_len) < 0.8


def test_stats_count_shared_slots_once():
    mgr, _ = computed_manager(list(range(6)))
    mgr.fork("a", "b")
    stats = mgr.stats()
    assert (stats.logical_tokens, stats.physical_tokens, stats.used_blocks) == (12, 6, 2)
    assert stats.waste == pytest.approx(2 / 8)


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    mgr = BlockManager(4, 4)
    with pytest.raises(ValueError, match="empty prompt"):
        mgr.allocate("a", [])
    mgr.allocate("a", [1, 2])
    with pytest.raises(ValueError, match="already"):
        mgr.allocate("a", [1])
    with pytest.raises(ValueError, match="computed tokens only grow"):
        mgr.mark_computed("a", 3)
    with pytest.raises(KeyError, match="unknown sequence"):
        mgr.free("zz")


# ---- stateful property test ---------------------------------------------------------------------------------------
# Block (5, 6, 7, 8) follows three different parents, and (1, 2, 3, 4) / (1, 2, 0, 0) collide under the weak hash.
PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (9, 9, 9, 9, 5, 6, 7, 8), (1, 2, 0, 0, 5, 6, 7, 8),
            (5,) * 12]


class PagedMachine(RuleBasedStateMachine):
    """Random allocate/append/forward/fork/truncate/swap/free sequences against a shadow KV cache."""

    BS, NUM_BLOCKS, HOST_BLOCKS = 4, 12, 8
    CACHING = True
    HASH = staticmethod(hash_block_tokens)
    EVICTION: KVEvictionPolicy | H2OPolicy | None = None

    def __init__(self):
        super().__init__()
        self.mgr = BlockManager(self.NUM_BLOCKS, self.BS, enable_prefix_caching=self.CACHING,
                                num_host_blocks=self.HOST_BLOCKS, hash_fn=self.HASH, eviction=self.EVICTION)
        self.slots = {Residence.DEVICE: {}, Residence.HOST: {}}  # slot -> prefix tuple ending at its token
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_id = 0

    # -- helpers --
    def _ids(self, residence=Residence.DEVICE, where=lambda s: True):
        return [s for s in sorted(self.tokens) if self.mgr.residence(s) is residence and where(s)]

    def _uncomputed(self, s):
        return self.computed[s] < len(self.tokens[s])

    def _pick(self, data, residence=Residence.DEVICE, where=lambda s: True) -> int:
        return data.draw(st.sampled_from(self._ids(residence, where)))

    def _state(self):
        return observable_state(self.mgr, list(self.tokens))

    def _apply(self, copies):
        for c in copies:
            src = self.slots[Residence.HOST if c.kind is CopyKind.SWAP_IN else Residence.DEVICE]
            dst = self.slots[Residence.HOST if c.kind is CopyKind.SWAP_OUT else Residence.DEVICE]
            for o in range(self.BS):
                value = src.get(c.src * self.BS + o)
                dst.pop(c.dst * self.BS + o, None) if value is None else dst.__setitem__(c.dst * self.BS + o, value)

    # -- rules --
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=7))
    def allocate(self, prefix, suffix):
        prompt = list(prefix) + suffix or [0]
        sid, self.next_id = self.next_id, self.next_id + 1
        fits, before, hits_before = self.mgr.can_allocate(prompt), self._state(), self.mgr.prefix_stats.hit_tokens
        try:
            num_cached = self.mgr.allocate(sid, prompt)
        except OutOfBlocks:
            assert not fits and self._state() == before
            return
        assert fits and num_cached % self.BS == 0 and num_cached < len(prompt)
        assert self.mgr.prefix_stats.hit_tokens == hits_before + num_cached
        if not self.CACHING:
            assert num_cached == 0
        slots = self.mgr.slot_mapping(sid, 0, num_cached)  # prefix hits hold exactly this prompt's K/V
        assert [self.slots[Residence.DEVICE].get(s) for s in slots] == [tuple(prompt[: p + 1]) for p in
                                                                           range(num_cached)]
        self.tokens[sid], self.computed[sid] = prompt, num_cached

    @precondition(lambda self: self._ids(where=self._uncomputed))
    @rule(data=st.data())
    def forward(self, data):
        """The engine writes K/V for (a chunk of) the uncomputed tokens, then marks them computed."""
        sid = self._pick(data, where=self._uncomputed)
        n = len(self.tokens[sid])
        self.forward_to(sid, data.draw(st.one_of(st.just(n), st.integers(self.computed[sid] + 1, n))))

    def forward_to(self, sid, end):
        table = self.mgr.block_table(sid)
        for p, slot in zip(range(self.computed[sid], end), self.mgr.slot_mapping(sid, self.computed[sid], end),
                           strict=True):
            block = table[p // self.BS]  # writes go only to blocks this sequence owns alone and nobody caches
            assert self.mgr.device.ref_count(block) == 1 and not self.mgr.device.is_cached(block)
            self.slots[Residence.DEVICE][slot] = tuple(self.tokens[sid][: p + 1])
        self.mgr.mark_computed(sid, end)
        self.computed[sid] = end

    @precondition(lambda self: self._ids())
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, new):
        sid = self._pick(data)
        fits, before = self.mgr.can_append(sid, len(new)), self._state()
        try:
            copies = self.mgr.append_slots(sid, new)
        except OutOfBlocks:
            assert not fits and self._state() == before
            return
        assert fits and all(c.kind is CopyKind.COPY_ON_WRITE for c in copies)
        self._apply(copies)
        self.tokens[sid] += new

    @precondition(lambda self: self._ids(where=lambda s: not self._uncomputed(s)))
    @rule(data=st.data())
    def fork(self, data):
        sid = self._pick(data, where=lambda s: not self._uncomputed(s))
        child, self.next_id = self.next_id, self.next_id + 1
        self.mgr.fork(sid, child)
        self.tokens[child], self.computed[child] = list(self.tokens[sid]), self.computed[sid]

    @precondition(lambda self: self._ids())
    @rule(data=st.data())
    def truncate(self, data):
        sid = self._pick(data)
        self.truncate_to(sid, data.draw(st.integers(1, len(self.tokens[sid]))))

    def truncate_to(self, sid, keep):
        self.mgr.truncate(sid, keep)
        del self.tokens[sid][keep:]
        self.computed[sid] = min(self.computed[sid], keep)

    @precondition(lambda self: self._ids(where=lambda s: self.computed[s] > 1))
    @rule(data=st.data(), correction=st.integers(0, 2))
    def reject_speculative_tokens(self, data, correction):
        """Speculative decoding: roll back into the computed tokens, append the correction, compute it."""
        sid = self._pick(data, where=lambda s: self.computed[s] > 1)
        self.truncate_to(sid, data.draw(st.integers(1, self.computed[sid] - 1)))
        try:
            self._apply(self.mgr.append_slot(sid, correction))
        except OutOfBlocks:
            return
        self.tokens[sid].append(correction)
        self.forward_to(sid, len(self.tokens[sid]))

    @precondition(lambda self: self._ids())
    @rule(data=st.data())
    def swap_out(self, data):
        sid = self._pick(data)
        before = self._state()
        try:
            self._apply(self.mgr.swap_out(sid))
        except OutOfBlocks:
            assert self._state() == before

    @precondition(lambda self: self._ids(Residence.HOST))
    @rule(data=st.data())
    def swap_in(self, data):
        sid = self._pick(data, Residence.HOST)
        fits, before = self.mgr.can_swap_in(sid), self._state()
        try:
            self._apply(self.mgr.swap_in(sid))
        except OutOfBlocks:
            assert not fits and self._state() == before
            return
        assert fits

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(sid)
        del self.tokens[sid], self.computed[sid]

    @precondition(lambda self: len(self.tokens) > 3)
    @rule()
    def free_everything_returns_every_block(self):
        self.teardown()
        assert self.mgr.device.num_used == 0 and self.mgr.device.num_free == self.NUM_BLOCKS
        assert self.mgr.host.num_free == self.HOST_BLOCKS

    # -- invariants --
    @invariant()
    def ref_counts_equal_table_references_and_pools_partition_blocks(self):
        for residence, pool in ((Residence.DEVICE, self.mgr.device), (Residence.HOST, self.mgr.host)):
            refs = [0] * pool.num_blocks
            for sid in self.tokens:
                table = self.mgr.sequence(sid)
                if table.residence is residence:
                    for b in table.block_ids:
                        if b != EVICTED:
                            refs[b] += 1
            assert [pool.ref_count(b) for b in range(pool.num_blocks)] == refs
            unreferenced = {b for b in range(pool.num_blocks) if refs[b] == 0}
            evictable = pool.evictable_blocks()
            assert set(evictable) <= unreferenced and len(set(evictable)) == len(evictable)
            assert all(pool.is_cached(b) for b in evictable)
            assert pool.num_used + pool.num_free == pool.num_blocks and pool.num_free == len(unreferenced)

    @invariant()
    def every_sequence_reads_back_its_own_kv_through_its_block_table(self):
        for sid, tokens in self.tokens.items():
            table = self.mgr.sequence(sid)
            assert table.token_ids == tokens and len(table.block_ids) == -(-len(tokens) // self.BS)
            shadow = self.slots[table.residence]
            for p in range(self.computed[sid]):
                if table.block_ids[p // self.BS] == EVICTED:  # only blocks the policy may drop are freed
                    assert self._may_evict(sid, p)
                    continue
                assert shadow.get(table.block_ids[p // self.BS] * self.BS + p % self.BS) == tuple(tokens[: p + 1])

    @invariant()
    def chained_hashes_name_cached_leading_blocks(self):
        cached = self.mgr.device.cached_blocks()
        for sid, tokens in self.tokens.items():
            table = self.mgr.sequence(sid)
            assert len(table.block_hashes) <= self.computed[sid] // self.BS
            if table.residence is Residence.HOST:
                assert table.block_hashes == []
            for i in range(len(table.block_hashes)):
                if table.block_ids[i] == EVICTED:
                    continue
                assert cached[table.block_ids[i]] == tuple(tokens[i * self.BS : (i + 1) * self.BS])

    @invariant()
    def cache_entries_hold_exactly_their_tokens(self):
        for block, cached in self.mgr.device.cached_blocks().items():
            kv = [self.slots[Residence.DEVICE].get(block * self.BS + o) for o in range(self.BS)]
            assert all(v is not None for v in kv) and tuple(v[-1] for v in kv) == cached

    def _may_evict(self, sid, p) -> bool:
        """Whether the policy may have freed position p of ``sid``: no later query reads it (window, sinks)."""
        ev = self.EVICTION
        return ev is not None and ev.sink_tokens <= p < self.computed[sid] - ev.window_tokens + 1

    def teardown(self):
        for sid in list(self.tokens):
            self.mgr.free(sid)
            del self.tokens[sid], self.computed[sid]
        assert self.mgr.device.num_free == self.NUM_BLOCKS and self.mgr.host.num_free == self.HOST_BLOCKS


class CollidingHashMachine(PagedMachine):
    """A hash that ignores the parent and half the tokens: correctness must come from the token and parent checks."""

    HASH = staticmethod(lambda parent, tokens: bytes(tokens[:2]))


class NoCachingMachine(PagedMachine):
    CACHING = False


class WindowMachine(PagedMachine):
    """Sliding window with sinks: blocks leave the tables as sequences are computed.  Rollbacks stay within the
    uncomputed (speculative) tokens, as the engine's (below them the window's keys may be gone)."""

    EVICTION = KVEvictionPolicy(window_tokens=5, sink_tokens=2)

    @precondition(lambda self: self._ids())
    @rule(data=st.data())
    def truncate(self, data):
        sid = self._pick(data)
        self.truncate_to(sid, data.draw(st.integers(max(1, self.computed[sid]), len(self.tokens[sid]))))

    def reject_speculative_tokens(self):  # not a rule here: it rolls computed tokens back
        pass

    @invariant()
    def evicted_blocks_are_the_policys_and_the_rest_are_held(self):
        for sid in self.tokens:
            table = self.mgr.sequence(sid)
            evicted = {i for i, b in enumerate(table.block_ids) if b == EVICTED}
            assert evicted <= set(self.EVICTION.freeable_blocks(self.computed[sid], self.BS))


class H2OMachine(WindowMachine):
    """H2O: blocks are freed by their attention mass (a fixed pseudo-random mass per physical block here), so the
    evicted set has holes; no prefix caching under it."""

    EVICTION = H2OPolicy(window_tokens=5, sink_tokens=2, heavy_tokens=4)

    def __init__(self):
        super().__init__()
        self.mgr.attach_mass(lambda ids: [(b * 7919) % 13 for b in ids])
        assert not self.mgr.device.enable_prefix_caching

    def _may_evict(self, sid, p) -> bool:
        ev, bs = self.EVICTION, self.BS
        return -(-ev.sink_tokens // bs) <= p // bs < max(0, self.computed[sid] - ev.window_tokens) // bs

    @invariant()
    def evicted_blocks_are_the_policys_and_the_rest_are_held(self):
        ev, bs = self.EVICTION, self.BS
        for sid in self.tokens:
            table = self.mgr.sequence(sid)
            if table.residence is not Residence.DEVICE:
                continue
            recent = max(0, self.computed[sid] - ev.window_tokens) // bs
            heavy = [i for i in range(-(-ev.sink_tokens // bs), recent) if table.block_ids[i] != EVICTED]
            assert len(heavy) <= -(-ev.heavy_tokens // bs)  # over the budget: the lightest went


_settings = settings(max_examples=60, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestPagedInvariants = PagedMachine.TestCase
TestPagedInvariants.settings = _settings
TestPagedInvariantsWithHashCollisions = CollidingHashMachine.TestCase
TestPagedInvariantsWithHashCollisions.settings = _settings
TestPagedInvariantsWithoutPrefixCaching = NoCachingMachine.TestCase
TestPagedInvariantsWithoutPrefixCaching.settings = _settings
TestPagedInvariantsWithEviction = WindowMachine.TestCase
TestPagedInvariantsWithEviction.settings = _settings
TestPagedInvariantsWithH2O = H2OMachine.TestCase
TestPagedInvariantsWithH2O.settings = _settings


def test_eviction_frees_exactly_the_blocks_outside_window_and_sinks():
    mgr = BlockManager(16, 4, eviction=KVEvictionPolicy(window_tokens=6, sink_tokens=3))
    mgr.allocate("a", list(range(10)))
    mgr.mark_computed("a", 10)  # next query at 10 keeps 0..2 (sinks) and 5..10: block 1 (4..7) still holds 5..7
    assert EVICTED not in mgr.sequence("a").block_ids
    for t in range(10, 30):
        mgr.append_slot("a", t)
        mgr.mark_computed("a", t + 1)
        table = mgr.sequence("a")
        n = t + 1
        kept_blocks = {p // 4 for p in range(n) if p < 3 or p >= n - 6 + 1}
        assert {i for i, b in enumerate(table.block_ids) if b != EVICTED} == kept_blocks
        assert mgr.device.num_used == len(kept_blocks) <= KVEvictionPolicy(6, 3).max_blocks(4)
    assert mgr.block_table("a")[1] == 0  # attention sees a valid id where a block was freed (masked by position)
    mgr.free("a")
    assert mgr.device.num_free == 16


def test_h2o_frees_the_lightest_blocks_outside_sinks_and_window():
    mass = {}
    mgr = BlockManager(16, 4, eviction=H2OPolicy(window_tokens=4, sink_tokens=2, heavy_tokens=8))
    mgr.attach_mass(lambda ids: [mass[b] for b in ids])
    mgr.allocate("a", list(range(24)))  # 6 blocks: sink block 0, candidates 1..4 (block 5 holds the window)
    table = mgr.sequence("a").block_ids
    mass.update({b: m for b, m in zip(table, [0, 5.0, 1.0, 9.0, 2.0, 0.0], strict=True)})
    mgr.mark_computed("a", 24)  # 4 candidates, 2 heavy blocks allowed: the two lightest (2 and 4) go
    assert [i for i, b in enumerate(mgr.sequence("a").block_ids) if b == EVICTED] == [2, 4]
    assert mgr.device.num_used == 4 and mgr.block_table("a")[2] == EVICTED
    mgr.free("a")
    assert mgr.device.num_free == 16
