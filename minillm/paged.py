"""Paged KV-cache bookkeeping: block allocator, per-sequence block tables, prefix cache, copy-on-write, swap.

No tensors live here. The engine owns ``k_cache``/``v_cache`` of shape [num_blocks, block_size, H_kv, D] per layer;
this module only decides *which* physical block holds which tokens. Token position p of a sequence lives in slot
``block_ids[p // block_size] * block_size + p % block_size``, so the only memory a sequence wastes is the unused
tail of its last block (< block_size slots), against ``max_len - len`` for a contiguous reservation.

Prefix caching: a full block whose K/V is written is registered under a hash of its tokens chained with its
parent block's hash, so the hash names the whole prefix. A later prompt with the same leading blocks reuses them
(reference count + 1) and skips their prefill. Unreferenced cached blocks stay in an LRU "evictable" pool and are
reclaimed only when a fresh block is needed. A hash hit is trusted only after checking the stored tokens *and* the
identity of the parent cache entry, so even a colliding hash function can never serve wrong K/V.

Copies the engine must perform are returned as ``BlockCopy`` lists; execute them in the order they were returned,
before the next forward pass (a block freed by one call may be the destination of the next).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

HashFn = Callable[[bytes | None, Sequence[int]], bytes]


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for the request; nothing was allocated or changed."""


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Stable 128-bit id of a full block: BLAKE2b over the parent's hash and the tokens as little-endian int64.

    Same result in every process and on every machine (unlike Python's salted ``hash``); ~1 µs per 16-token block.
    """
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)  # root blocks: no parent bytes (other hashes are 16 B)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(frozen=True)
class _CacheEntry:
    block_hash: bytes
    token_ids: tuple[int, ...]
    parent_serial: int | None  # serial of the parent block's entry; None for a sequence's first block
    serial: int  # unique per registration, so an evicted-and-reused parent block can never match again


class BlockAllocator:
    """Fixed-size physical blocks with reference counts, a free list and an LRU pool of evictable cached blocks.

    A block is in exactly one state: referenced (ref > 0), free (ref 0, in the free list), or evictable
    (ref 0, still a prefix-cache entry, reused on a cache hit or reclaimed by ``allocate`` when the free list is empty).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int (16 is the usual choice), got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._entries: dict[int, _CacheEntry] = {}  # block id -> what it caches
        self._by_hash: dict[bytes, int] = {}  # hash -> block id; first registration wins
        self._next_serial = 0

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: truly free plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks still holding a prefix-cache entry."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    def ref_count(self, block_id: int) -> int:
        """How many block-table entries point at ``block_id``."""
        self._check(block_id)
        return self._ref[block_id]

    def allocate(self) -> int:
        """A block with ref count 1: from the free list, else by evicting the least recently used cached block."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use; free or preempt a sequence, "
                              "or configure more KV blocks")
        self._ref[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes evictable if it is a cache entry, else free."""
        self._check(block_id)
        if self._ref[block_id] == 0:
            raise RuntimeError(f"double free of block {block_id}: its reference count is already 0")
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            if block_id in self._entries:
                self._evictable[block_id] = None  # most recently released: evicted last
            else:
                self._free.append(block_id)

    def incref(self, block_id: int) -> None:
        """Add a reference to a referenced block, or revive an evictable cached block (a prefix-cache hit)."""
        self._check(block_id)
        if self._ref[block_id] == 0:
            if block_id not in self._evictable:
                raise RuntimeError(f"block {block_id} is free; allocate() it instead of incref()")
            del self._evictable[block_id]
        self._ref[block_id] += 1

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """Share ``block_ids`` with one more owner (every ref count + 1); returns them as a new list."""
        for block_id in block_ids:
            self.incref(block_id)
        return list(block_ids)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int], parent: int | None) -> int | None:
        """The cached block holding ``token_ids`` after the cached block ``parent`` (None: a first block), or None.

        Pure: changes no reference count. Verifies tokens and parent identity, so a hash collision is a miss.
        """
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        entry = self._entries[block_id]
        if parent is None:
            parent_serial = None
        elif parent in self._entries:
            parent_serial = self._entries[parent].serial
        else:
            return None  # an uncached parent cannot be verified
        if entry.parent_serial != parent_serial or entry.token_ids != tuple(token_ids):
            return None
        return block_id

    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int], parent: int | None) -> bool:
        """Make a full, written, referenced block a prefix-cache entry; True if it is one afterwards.

        ``parent`` (the previous block of the sequence) must itself be an entry, or the chain cannot be verified.
        False when caching is off, the parent is not cached, or the hash already names a different block.
        """
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(token_ids)} tokens, block_size is "
                             f"{self.block_size}")
        if self.ref_count(block_id) == 0:
            raise RuntimeError(f"block {block_id} is not allocated; only referenced blocks can be registered")
        if not self.enable_prefix_caching:
            return False
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            return existing == block_id  # registered before, e.g. by a forked sibling sharing this block
        if block_id in self._entries or (parent is not None and parent not in self._entries):
            return False
        parent_serial = None if parent is None else self._entries[parent].serial
        self._entries[block_id] = _CacheEntry(block_hash, tuple(token_ids), parent_serial, self._next_serial)
        self._by_hash[block_hash] = block_id
        self._next_serial += 1
        return True

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` is a prefix-cache entry (its contents must then never change)."""
        self._check(block_id)
        return block_id in self._entries

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Every prefix-cache entry: block id -> the tokens it holds (for tests and notebook pictures)."""
        return {block_id: entry.token_ids for block_id, entry in self._entries.items()}

    def evictable_blocks(self) -> list[int]:
        """Unreferenced cached blocks in eviction order (least recently released first)."""
        return list(self._evictable)

    def _uncache(self, block_id: int) -> None:
        entry = self._entries.pop(block_id)
        del self._by_hash[entry.block_hash]  # children of this entry become unreachable and age out of the LRU

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_blocks})")


class Residence(Enum):
    """Where a sequence's blocks live: device KV cache, or host memory after a swap-out."""

    DEVICE = "device"
    HOST = "host"


class CopyKind(Enum):
    """Which pools a ``BlockCopy`` moves between."""

    COPY_ON_WRITE = "device->device"
    SWAP_OUT = "device->host"
    SWAP_IN = "host->device"


@dataclass(frozen=True)
class BlockCopy:
    """Copy all ``block_size`` K and V rows of block ``src`` to block ``dst``, in every layer."""

    src: int
    dst: int
    kind: CopyKind


@dataclass
class BlockTable:
    """One sequence: logical block i lives in physical block ``block_ids[i]`` of the pool named by ``residence``."""

    block_ids: list[int]
    token_ids: list[int]  # every token that has a slot
    num_computed: int = 0  # leading tokens whose K/V is written (``mark_computed``)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the leading blocks that are entries
    residence: Residence = Residence.DEVICE


@dataclass
class PrefixHitStats:
    """Prefix-cache effectiveness: prompt tokens looked up and how many were served from the cache."""

    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens whose prefill was skipped."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class MemoryStats:
    """A snapshot of the device pool. ``physical_tokens`` counts filled slots once even when shared."""

    num_blocks: int
    block_size: int
    used_blocks: int  # referenced by at least one sequence
    free_blocks: int  # in the free list (holding nothing useful)
    evictable_blocks: int  # unreferenced but still serving prefix-cache hits; reclaimed on demand
    logical_tokens: int  # sum of sequence lengths
    physical_tokens: int  # distinct slots holding a token

    @property
    def waste(self) -> float:
        """Fraction of the slots in used blocks that hold no token (only partial last blocks contribute)."""
        slots = self.used_blocks * self.block_size
        return 1.0 - self.physical_tokens / slots if slots else 0.0


def paged_waste(seq_lens: Sequence[int], block_size: int = 16) -> float:
    """Fraction of slots wasted when each sequence holds ceil(len / block_size) blocks."""
    slots = sum(-(-n // block_size) * block_size for n in seq_lens)
    return 1.0 - sum(seq_lens) / slots if slots else 0.0


def contiguous_reservation_waste(seq_lens: Sequence[int], max_len: int) -> float:
    """Fraction of slots wasted when every sequence reserves ``max_len`` slots up front (the contiguous cache)."""
    if any(n > max_len for n in seq_lens):
        raise ValueError(f"a sequence is longer than max_len={max_len}; raise max_len")
    return 1.0 - sum(seq_lens) / (len(seq_lens) * max_len) if seq_lens else 0.0


class BlockManager:
    """Block tables for sequences (by id): allocation, prefix-cache hits, appends, forks, copy-on-write, swap.

    Typical engine use per step: ``allocate`` a new prompt (skip the returned number of cached tokens in prefill),
    ``append_slot`` each decoded token before the forward that writes its K/V, run the copies returned, feed
    ``slot_mapping``/``block_table`` to attention, then ``mark_computed`` so finished full blocks become cacheable.
    Preemption by recompute is ``free``; by swap, ``swap_out``/``swap_in`` (needs ``num_host_blocks``).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, hash_fn: HashFn = hash_block_tokens):
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0 (0 disables swapping), got {num_host_blocks!r}")
        self.device = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.host = BlockAllocator(num_host_blocks, block_size, False) if num_host_blocks else None
        self.block_size = block_size
        self.prefix_stats = PrefixHitStats()
        self._hash = hash_fn
        self._seqs: dict[Hashable, BlockTable] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` holds blocks (on device or host)."""
        return seq_id in self._seqs

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def allocate(self, seq_id: Hashable, prompt_token_ids: Sequence[int]) -> int:
        """Give a new sequence blocks for its whole prompt; returns how many leading tokens the cache already holds.

        All or nothing: raises ``OutOfBlocks`` without changing any state when the prompt does not fit.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks; free it first or use a new id")
        if len(prompt_token_ids) == 0:
            raise ValueError("cannot allocate an empty prompt: it needs at least one token")
        tokens = list(prompt_token_ids)
        hits, hashes = self._match_prefix(tokens)
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

        Token ids (not just a count) are needed so full blocks can be hashed for the prefix cache.
        All or nothing: raises ``OutOfBlocks`` without changing state when the blocks are not there.
        """
        table = self._table(seq_id)
        need = self._append_need(table, len(token_ids))
        if need > self.device.num_free:
            raise OutOfBlocks(f"appending {len(token_ids)} tokens to {seq_id!r} needs {need} blocks but "
                              f"{self.device.num_free} are free; preempt a sequence")
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

    def _register_full_blocks(self, table: BlockTable) -> None:
        bs = self.block_size
        while self.device.enable_prefix_caching and len(table.block_hashes) < table.num_computed // bs:
            i = len(table.block_hashes)
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
        self._seqs[child_id] = BlockTable(self.device.fork(parent.block_ids), list(parent.token_ids),
                                          parent.num_computed, list(parent.block_hashes))

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (roll back rejected speculative tokens); frees whole tail blocks."""
        table = self._table(seq_id)
        if not 1 <= num_tokens <= len(table.token_ids):
            raise ValueError(f"num_tokens={num_tokens} must lie in [1, {len(table.token_ids)}]; use free() to drop all")
        keep = self._blocks_for(num_tokens)
        for block_id in reversed(table.block_ids[keep:]):
            self.device.free(block_id)
        del table.block_ids[keep:], table.token_ids[num_tokens:], table.block_hashes[num_tokens // self.block_size :]
        table.num_computed = min(table.num_computed, num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or recompute-preempted sequence (device or host blocks)."""
        table = self._seqs.pop(seq_id, None)
        if table is None:
            raise KeyError(f"unknown sequence {seq_id!r}; it was never allocated or is already freed")
        pool = self.device if table.residence is Residence.DEVICE else self.host
        for block_id in reversed(table.block_ids):  # tail first: the LRU then evicts a prefix's tail before its head
            pool.free(block_id)

    # ---- swap (preemption by copying to host memory) -----------------------------------------------------------
    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Whether the device has a free block for every block of swapped-out ``seq_id``."""
        return len(self._table(seq_id, Residence.HOST).block_ids) <= self.device.num_free

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
        if len(table.block_ids) > dst.num_free:
            raise OutOfBlocks(f"moving {len(table.block_ids)} blocks to the {residence.value} but only "
                              f"{dst.num_free} are free there")
        new_ids = [dst.allocate() for _ in table.block_ids]
        copies = [BlockCopy(old, new, kind) for old, new in zip(table.block_ids, new_ids, strict=True)]
        for block_id in reversed(table.block_ids):
            src.free(block_id)
        table.block_ids, table.block_hashes, table.residence = new_ids, [], residence
        return copies

    # ---- what attention and the scheduler read -----------------------------------------------------------------
    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block of each logical block (a row of attention's ``block_tables``)."""
        return list(self._table(seq_id).block_ids)

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Flat cache slot (block_id * block_size + offset) of each token position in [start, end)."""
        table = self._table(seq_id)
        end = len(table.token_ids) if end is None else end
        if not 0 <= start <= end <= len(table.token_ids):
            raise ValueError(f"positions [{start}, {end}) are outside the {len(table.token_ids)} allocated tokens")
        bs = self.block_size
        return [table.block_ids[p // bs] * bs + p % bs for p in range(start, end)]

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
                    n = min(self.block_size, len(table.token_ids) - i * self.block_size)
                    filled[block_id] = max(filled.get(block_id, 0), n)
        return MemoryStats(self.device.num_blocks, self.block_size, self.device.num_used,
                           self.device.num_free - self.device.num_evictable, self.device.num_evictable,
                           logical, sum(filled.values()))
