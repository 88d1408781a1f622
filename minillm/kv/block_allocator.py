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
from collections.abc import Callable, Sequence
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
        """Drop one reference to ``block_id``; when none is left, release the block.

        ``self._ref[block_id]`` counts the block-table entries pointing at the block (a fork shares every block,
        so a shared block has one reference per owner).  While others still hold it, a free only lowers the count:
        the block and its K/V stay.  The last free releases it: a prefix-cache entry (``self.is_cached(block_id)``)
        keeps its K/V for future hits and joins the LRU pool ``self._evictable`` (an OrderedDict of block id ->
        None, least recently released first, so add it at the end); any other block goes back to the free list
        ``self._free`` (a deque; append it).
        """
        self._check(block_id)
        if self._ref[block_id] == 0:
            raise RuntimeError(f"double free of block {block_id}: its reference count is already 0")
        ### BEGIN SOLUTION
        self._ref[block_id] -= 1
        if self._ref[block_id] > 0:
            return  # other owners still hold it: nothing is released
        if self.is_cached(block_id):
            self._evictable[block_id] = None  # most recently released: evicted last
        else:
            self._free.append(block_id)
        ### END SOLUTION

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


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slot of each token position in [start, end) of a sequence whose block table is ``block_ids``.

    The cache is one pool of ``num_blocks × block_size`` slots, physical block b owning slots
    ``b·block_size … (b+1)·block_size − 1``; the sequence's positions fill its blocks in table order, each block
    ``block_size`` positions.  ``block_ids`` must cover every position asked for.  -> ``end − start`` slot ids.
    """
    if not 0 <= start <= end <= len(block_ids) * block_size:
        raise ValueError(f"positions [{start}, {end}) are outside the {len(block_ids)} blocks of {block_size} slots")
    ### BEGIN SOLUTION
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
    ### END SOLUTION


def paged_waste(seq_lens: Sequence[int], block_size: int = 16) -> float:
    """Fraction of slots wasted when each sequence holds ceil(len / block_size) blocks."""
    slots = sum(-(-n // block_size) * block_size for n in seq_lens)
    return 1.0 - sum(seq_lens) / slots if slots else 0.0


def contiguous_reservation_waste(seq_lens: Sequence[int], max_len: int) -> float:
    """Fraction of slots wasted when every sequence reserves ``max_len`` slots up front (the contiguous cache)."""
    if any(n > max_len for n in seq_lens):
        raise ValueError(f"a sequence is longer than max_len={max_len}; raise max_len")
    return 1.0 - sum(seq_lens) / (len(seq_lens) * max_len) if seq_lens else 0.0
