"""The block manager: per-sequence block tables over a ``paged.BlockAllocator``, with prefix caching,
copy-on-write for shared blocks, forks (parallel sampling), truncation (speculative rollback), swap to host and
KV eviction (a ``kv.eviction`` policy: sliding window, attention sinks, H2O's heavy hitters) that frees the blocks
its rule drops, leaving ``EVICTED`` in their table entries.

It works on sequence ids and token lists and returns the ``BlockCopy`` operations the engine must run; see
``minillm.kv.block_allocator`` for the allocator, the data types and the slot arithmetic.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from minillm.kv.block_allocator import (
    BlockAllocator,
    BlockCopy,
    BlockTable,
    CopyKind,
    HashFn,
    MemoryStats,
    OutOfBlocks,
    PrefixHitStats,
    Residence,
    hash_block_tokens,
    slot_mapping,
)
from minillm.kv.eviction import EVICTED, BlockMass, EvictionPolicy


class BlockManager:
    """Block tables for sequences (by id): allocation, prefix-cache hits, appends, forks, copy-on-write, swap.

    Typical engine use per step: ``allocate`` a new prompt (skip the returned number of cached tokens in prefill),
    ``append_slot`` each decoded token before the forward that writes its K/V, run the copies returned, feed
    ``slot_mapping``/``block_table`` to attention, then ``mark_computed`` so finished full blocks become cacheable.
    Preemption by recompute is ``free``; by swap, ``swap_out``/``swap_in`` (needs ``num_host_blocks``).
    ``allocator`` is the ``BlockAllocator`` class of both pools (the course passes its own subclass here).
    ``eviction``: a ``kv.eviction`` policy (``KVEvictionPolicy``, ``H2OPolicy``) consulted by ``mark_computed``;
    the blocks it names are freed and their table entries become ``EVICTED`` (None: every block stays until the
    sequence is freed or truncated).  With eviction, ``truncate`` may drop only uncomputed (speculative) tokens,
    as the engine's rollback does: computed tokens rolled back would need keys that are already freed.  A policy
    that is not ``prefix_cacheable`` (H2O) turns prefix caching off; one that ``needs_mass`` reads the attention
    mass of blocks through ``attach_mass``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, hash_fn: HashFn = hash_block_tokens,
                 allocator: type[BlockAllocator] = BlockAllocator, eviction: EvictionPolicy | None = None):
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0 (0 disables swapping), got {num_host_blocks!r}")
        enable_prefix_caching = enable_prefix_caching and (eviction is None or eviction.prefix_cacheable)
        self.device = allocator(num_blocks, block_size, enable_prefix_caching)
        self.host = allocator(num_host_blocks, block_size, False) if num_host_blocks else None
        self.block_size = block_size
        self.prefix_stats = PrefixHitStats()
        self.eviction = eviction
        self._block_mass: BlockMass | None = None
        self._hash = hash_fn
        self._seqs: dict[Hashable, BlockTable] = {}

    def attach_mass(self, block_mass: BlockMass) -> None:
        """Where a mass-scored policy (H2O) reads the attention mass of physical blocks: the K/V cache's
        ``PagedKVCache.block_mass``, which exists only after the cache is built from this manager's pool size."""
        self._block_mass = block_mass

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` holds blocks (on device or host)."""
        return seq_id in self._seqs

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks(self, num_prompt_tokens: int, num_tokens: int) -> int:
        """The most blocks a sequence holds at once over its life: its whole prompt (allocated at admission) or, as
        it decodes to ``num_tokens`` slots, the policy's bound when one evicts (the blocks for every slot if not)."""
        if self.eviction is None:
            return self._blocks_for(max(num_prompt_tokens, num_tokens))
        return max(self._blocks_for(num_prompt_tokens),
                   min(self._blocks_for(num_tokens), self.eviction.max_blocks(self.block_size)))

    # ---- new sequences -----------------------------------------------------------------------------------------
    def _match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Longest run of cached leading blocks. The block holding the last prompt token is never matched:
        prefill must compute at least that token to produce the next token's logits."""
        hits: list[int] = []
        hashes: list[bytes] = []
        if not self.device.enable_prefix_caching:
            return hits, hashes
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            block = token_ids[i * bs : (i + 1) * bs]
            block_hash = self._hash(hashes[-1] if hashes else None, block)
            block_id = self.device.lookup(block_hash, block, hits[-1] if hits else None)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(block_hash)
        return hits, hashes

    def _prompt_shortfall(self, num_tokens: int, hits: list[int]) -> tuple[int, int]:
        """(new blocks needed, blocks available for them); a hit on an evictable block uses up a free one."""
        revived = sum(1 for block_id in hits if self.device.ref_count(block_id) == 0)
        return self._blocks_for(num_tokens) - len(hits), self.device.num_free - revived

    def can_allocate(self, tokens: int | Sequence[int]) -> bool:
        """Whether a prompt fits now. A length ignores prefix hits (an upper bound); a token list counts them."""
        if isinstance(tokens, int):
            return self._blocks_for(tokens) <= self.device.num_free
        need, available = self._prompt_shortfall(len(tokens), self._match_prefix(tokens)[0])
        return need <= available

    def allocate(self, seq_id: Hashable, prompt_token_ids: Sequence[int], use_prefix_cache: bool = True) -> int:
        """Give a new sequence blocks for its whole prompt; returns how many leading tokens the cache already holds
        (0 with ``use_prefix_cache=False``: every token is computed, and its full blocks are still cached after).

        All or nothing: raises ``OutOfBlocks`` without changing any state when the prompt does not fit.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks; free it first or use a new id")
        if len(prompt_token_ids) == 0:
            raise ValueError("cannot allocate an empty prompt: it needs at least one token")
        tokens = list(prompt_token_ids)
        hits, hashes = self._match_prefix(tokens) if use_prefix_cache else ([], [])
        need, available = self._prompt_shortfall(len(tokens), hits)
        if need > available:
            raise OutOfBlocks(f"a {len(tokens)}-token prompt needs {need} new blocks but {available} are free; "
                              "wait for a sequence to finish, preempt one, or configure more KV blocks")
        for block_id in hits:  # before allocating, so eviction cannot reclaim a block we are about to reuse
            self.device.incref(block_id)
        block_ids = hits + [self.device.allocate() for _ in range(need)]
        num_cached = len(hits) * self.block_size
        self._seqs[seq_id] = BlockTable(block_ids, tokens, num_cached, hashes)
        self.prefix_stats.requests += 1
        self.prefix_stats.query_tokens += len(tokens)
        self.prefix_stats.hit_tokens += num_cached
        return num_cached

    # ---- growing, forking, shrinking ---------------------------------------------------------------------------
    def _any_table(self, seq_id: Hashable) -> BlockTable:
        table = self._seqs.get(seq_id)
        if table is None:
            raise KeyError(f"unknown sequence {seq_id!r}; allocate() it first")
        return table

    def _table(self, seq_id: Hashable, residence: Residence = Residence.DEVICE) -> BlockTable:
        table = self._any_table(seq_id)
        if table.residence is not residence:
            fix = "swap_in() it first" if residence is Residence.DEVICE else "it is not swapped out"
            raise RuntimeError(f"sequence {seq_id!r} is on the {table.residence.value}; {fix}")
        return table

    def _needs_copy(self, table: BlockTable) -> bool:
        """A partial last block may be written in place only by its sole owner, and never if it is a cache entry."""
        if len(table.token_ids) % self.block_size == 0:
            return False
        last = table.block_ids[-1]
        return self.device.ref_count(last) > 1 or self.device.is_cached(last)

    def _append_need(self, table: BlockTable, n: int) -> int:
        if n == 0:
            return 0
        length = len(table.token_ids)
        return self._blocks_for(length + n) - self._blocks_for(length) + self._needs_copy(table)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether ``append_slots`` with ``num_tokens`` tokens would succeed now."""
        return self._append_need(self._table(seq_id), num_tokens) <= self.device.num_free

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int]) -> list[BlockCopy]:
        """Give each new token a slot, one block at a time as the last one fills; returns copy-on-write copies.

        ``table`` (a ``BlockTable``) holds the sequence's ``block_ids`` and ``token_ids`` (every token that has a
        slot). Just in time: a token gets a new block (``self.device.allocate()``) only when the last block is full
        (``len(table.token_ids) % self.block_size == 0``); then append the token to ``table.token_ids``.
        Copy-on-write first: if the partial last block is shared or a prefix-cache entry
        (``self._needs_copy(table)``), writing into it would change other owners' K/V, so the sequence takes a
        fresh block in its place, drops its reference to the shared one (``self.device.free``: allocate before
        you free, so the source keeps its contents) and returns ``BlockCopy(shared, new, CopyKind.COPY_ON_WRITE)``
        for the engine to run before the forward pass.
        Token ids (not just a count) are needed so full blocks can be hashed for the prefix cache.
        All or nothing: raises ``OutOfBlocks`` without changing state when the blocks are not there.
        """
        table = self._table(seq_id)
        need = self._append_need(table, len(token_ids))
        if need > self.device.num_free:
            raise OutOfBlocks(f"appending {len(token_ids)} tokens to {seq_id!r} needs {need} blocks but "
                              f"{self.device.num_free} are free; preempt a sequence")
        ### BEGIN SOLUTION
        copies: list[BlockCopy] = []
        if token_ids and self._needs_copy(table):
            shared = table.block_ids[-1]
            table.block_ids[-1] = self.device.allocate()  # allocated before the free: src keeps its contents
            self.device.free(shared)
            copies.append(BlockCopy(shared, table.block_ids[-1], CopyKind.COPY_ON_WRITE))
        for token in token_ids:
            if len(table.token_ids) % self.block_size == 0:
                table.block_ids.append(self.device.allocate())
            table.token_ids.append(token)
        return copies
        ### END SOLUTION

    def append_slot(self, seq_id: Hashable, token_id: int) -> list[BlockCopy]:
        """``append_slots`` for one decoded token."""
        return self.append_slots(seq_id, [token_id])

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that the first ``num_tokens`` tokens' K/V is written; full blocks among them become cacheable.

        Registration waits for this call (not ``allocate``) so that, with chunked prefill, no other sequence can
        hit a block whose K/V has not been written yet.
        """
        table = self._table(seq_id)
        if not table.num_computed <= num_tokens <= len(table.token_ids):
            raise ValueError(f"num_tokens={num_tokens} must lie in [{table.num_computed}, {len(table.token_ids)}]: "
                             "computed tokens only grow and cannot exceed the allocated ones")
        table.num_computed = num_tokens
        self._register_full_blocks(table)
        self._evict(table)

    def _evict(self, table: BlockTable) -> None:
        """Free the blocks the eviction policy names (tail first, as ``free``); their entries become ``EVICTED`` so
        positions keep their logical block."""
        if self.eviction is None:
            return
        for i in self.eviction.blocks_to_evict(table.block_ids, table.num_computed, self.block_size,
                                               self._block_mass):
            self.device.free(table.block_ids[i])
            table.block_ids[i] = EVICTED

    def _register_full_blocks(self, table: BlockTable) -> None:
        bs = self.block_size
        while self.device.enable_prefix_caching and len(table.block_hashes) < table.num_computed // bs:
            i = len(table.block_hashes)
            if table.block_ids[i] == EVICTED or (i and table.block_ids[i - 1] == EVICTED):
                return  # its K/V (or its parent's) is gone: the chain cannot grow past it
            block = table.token_ids[i * bs : (i + 1) * bs]
            block_hash = self._hash(table.block_hashes[-1] if i else None, block)
            if not self.device.register(table.block_ids[i], block_hash, block, table.block_ids[i - 1] if i else None):
                return  # same hash already names another block: later blocks cannot chain to this one
            table.block_hashes.append(block_hash)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent (parallel sampling n > 1); writes later copy-on-write."""
        parent = self._table(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists; fork into a new id")
        if parent.num_computed != len(parent.token_ids):
            raise RuntimeError(f"fork {parent_id!r} only after its K/V is written (mark_computed), otherwise both "
                               "sequences would write the same shared slots")
        self.device.fork(_held(parent.block_ids))  # evicted entries stay placeholders in both tables
        self._seqs[child_id] = BlockTable(list(parent.block_ids), list(parent.token_ids),
                                          parent.num_computed, list(parent.block_hashes))

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (roll back rejected speculative tokens); frees whole tail blocks.

        Contract on ``table`` (``self._table(seq_id)``): afterwards ``table.token_ids`` holds its first
        ``num_tokens`` tokens and ``table.block_ids`` just the blocks they need (``self._blocks_for(num_tokens)``:
        a partly filled last block stays); every dropped block is released with ``self.device.free`` (tail
        first: the prefix cache's LRU then evicts a chain's tail before its head; a block shared with a fork only
        loses this sequence's reference). ``table.block_hashes`` keeps only the hashes of blocks still full of
        kept tokens (``num_tokens // block_size`` at most): a prefix-cache hash must never cover a token that was
        rolled back. ``table.num_computed`` cannot exceed ``num_tokens``.
        """
        table = self._table(seq_id)
        if not 1 <= num_tokens <= len(table.token_ids):
            raise ValueError(f"num_tokens={num_tokens} must lie in [1, {len(table.token_ids)}]; use free() to drop all")
        ### BEGIN SOLUTION
        keep = self._blocks_for(num_tokens)
        for block_id in reversed(table.block_ids[keep:]):
            self.device.free(block_id)
        del table.block_ids[keep:], table.token_ids[num_tokens:], table.block_hashes[num_tokens // self.block_size :]
        table.num_computed = min(table.num_computed, num_tokens)
        ### END SOLUTION

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or recompute-preempted sequence (device or host blocks)."""
        table = self._seqs.pop(seq_id, None)
        if table is None:
            raise KeyError(f"unknown sequence {seq_id!r}; it was never allocated or is already freed")
        pool = self.device if table.residence is Residence.DEVICE else self.host
        for block_id in reversed(_held(table.block_ids)):  # tail first: the LRU evicts a prefix's tail before its head
            pool.free(block_id)

    # ---- swap (preemption by copying to host memory) -----------------------------------------------------------
    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Whether the device has a free block for every block of swapped-out ``seq_id``."""
        return len(_held(self._table(seq_id, Residence.HOST).block_ids)) <= self.device.num_free

    def swap_out(self, seq_id: Hashable) -> list[BlockCopy]:
        """Move a sequence to host blocks; returns device->host copies. Shared blocks are copied per sequence."""
        if self.host is None:
            raise RuntimeError("no host blocks: construct BlockManager(num_host_blocks=...) to swap, "
                               "or preempt by recompute with free()")
        return self._move(self._table(seq_id), self.device, self.host, Residence.HOST, CopyKind.SWAP_OUT)

    def swap_in(self, seq_id: Hashable) -> list[BlockCopy]:
        """Bring a swapped-out sequence back into fresh device blocks; returns host->device copies."""
        table = self._table(seq_id, Residence.HOST)
        copies = self._move(table, self.host, self.device, Residence.DEVICE, CopyKind.SWAP_IN)
        self._register_full_blocks(table)
        return copies

    def _move(self, table: BlockTable, src: BlockAllocator, dst: BlockAllocator, residence: Residence,
              kind: CopyKind) -> list[BlockCopy]:
        held = _held(table.block_ids)
        if len(held) > dst.num_free:
            raise OutOfBlocks(f"moving {len(held)} blocks to the {residence.value} but only "
                              f"{dst.num_free} are free there")
        new_ids = [EVICTED if old == EVICTED else dst.allocate() for old in table.block_ids]
        copies = [BlockCopy(old, new, kind) for old, new in zip(table.block_ids, new_ids, strict=True)
                  if old != EVICTED]
        for block_id in reversed(held):
            src.free(block_id)
        table.block_ids, table.block_hashes, table.residence = new_ids, [], residence
        return copies

    # ---- what attention and the scheduler read -----------------------------------------------------------------
    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block of each logical block (a row of attention's ``block_tables``); an evicted block reads as
        the policy's ``attention_placeholder``: block 0 under the window (never read: masked by position),
        ``EVICTED`` (-1) under H2O (attention skips it by the entry)."""
        table = self._table(seq_id)
        if self.eviction is None or self.eviction.attention_placeholder == EVICTED:
            return list(table.block_ids)
        return [self.eviction.attention_placeholder if b == EVICTED else b for b in table.block_ids]

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Flat cache slot (block_id * block_size + offset) of each token position in [start, end)."""
        table = self._table(seq_id)
        end = len(table.token_ids) if end is None else end
        if not 0 <= start <= end <= len(table.token_ids):
            raise ValueError(f"positions [{start}, {end}) are outside the {len(table.token_ids)} allocated tokens")
        return slot_mapping(table.block_ids, start, end, self.block_size)

    def sequence(self, seq_id: Hashable) -> BlockTable:
        """A copy of ``seq_id``'s block table and tokens, device or host (for schedulers, tests and pictures)."""
        t = self._any_table(seq_id)
        return BlockTable(list(t.block_ids), list(t.token_ids), t.num_computed, list(t.block_hashes), t.residence)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens that have a slot (on device or host)."""
        return len(self._any_table(seq_id).token_ids)

    def residence(self, seq_id: Hashable) -> Residence:
        """Whether ``seq_id``'s blocks are on the device or swapped out to the host."""
        return self._any_table(seq_id).residence

    def stats(self) -> MemoryStats:
        """Device pool usage; a shared block's filled slots count once (its fullest owner)."""
        filled: dict[int, int] = {}
        logical = 0
        for table in self._seqs.values():
            if table.residence is Residence.DEVICE:
                logical += len(table.token_ids)
                for i, block_id in enumerate(table.block_ids):
                    if block_id == EVICTED:
                        continue
                    n = min(self.block_size, len(table.token_ids) - i * self.block_size)
                    filled[block_id] = max(filled.get(block_id, 0), n)
        return MemoryStats(self.device.num_blocks, self.block_size, self.device.num_used,
                           self.device.num_free - self.device.num_evictable, self.device.num_evictable,
                           logical, sum(filled.values()))


def _held(block_ids: Sequence[int]) -> list[int]:
    """The entries of a block table that hold a block (``EVICTED`` placeholders left out)."""
    return [block_id for block_id in block_ids if block_id != EVICTED]
