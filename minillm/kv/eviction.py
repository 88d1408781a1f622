"""KV eviction: which cached positions a sequence keeps as it grows, so which of its blocks can be freed.

One ``KVEvictionPolicy(window_tokens=W, sink_tokens=k)`` object covers both rules the engine runs:

- a sliding window (Mistral's ``sliding_window``, k = 0): the query at position q attends to keys (q - W, q];
- attention sinks (StreamingLLM, ``EngineConfig(kv_eviction="sink")``): the same window plus the first k keys,
  which soak up the attention mass a softmax must put somewhere; without them a window-only cache of a model
  trained with full attention degrades once the first tokens leave it.

A key at position j is kept for the query at position q iff j ≤ q and (j < k or q - j < W)
(``kernels.reference.kept_keys``: the one place that rule is written; every attention path masks with it).

The block manager calls ``freeable_blocks`` after each step's K/V is written: every future query sits at a
position ≥ the computed length n, so keys below n - W + 1 that are not sinks are never read again and the blocks
holding only such keys are freed.  A sequence's blocks then stay at most ``max_blocks`` however long it runs.

Block tables keep a placeholder (``EVICTED``) where a freed block was, rather than an offset: position p still
lives in ``block_ids[p // block_size]``, so slot mapping, prefix hashing and the kernels index tables exactly as
without eviction; the tables handed to attention carry block 0 there (a valid id, never read unmasked).  The
price is one table entry (4 bytes) per evicted block: the K/V is bounded, the table grows with the length.

Positions: keys keep the rotary position they were written at (no re-rotation).  That makes attention with
eviction exactly the full-cache attention under a mask (what the tests compare against), keeps a block's K/V a
function of its prefix only (prefix caching and forks stay valid) and costs nothing per step.  StreamingLLM
instead re-rotates keys to their positions within the cache, so the relative distances a query sees never exceed
the cache size — which matters past the model's trained context; here the length stays capped at the model's
``max_position_embeddings`` (the memory is constant, the position range is not extended).
"""

from __future__ import annotations

from dataclasses import dataclass

EVICTED = -1  # block-table placeholder of a freed block (logical index kept, no physical block)

KV_EVICTIONS = ("sink",)  # EngineConfig.kv_eviction values besides None


@dataclass(frozen=True)
class KVEvictionPolicy:
    """Keep the last ``window_tokens`` keys of each query and the first ``sink_tokens`` keys of the sequence."""

    window_tokens: int
    sink_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.window_tokens, bool) or not isinstance(self.window_tokens, int) or self.window_tokens < 1:
            raise ValueError(f"window_tokens must be a positive int (the recent keys each query sees), got "
                             f"{self.window_tokens!r}; pass e.g. window_tokens=1024")
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {self.sink_tokens!r}; StreamingLLM uses 4")
        if self.sink_tokens >= self.window_tokens:
            raise ValueError(f"sink_tokens={self.sink_tokens} must be smaller than window_tokens="
                             f"{self.window_tokens}: the sinks are a few first tokens beside a window of recent "
                             "ones; lower sink_tokens (4 is StreamingLLM's) or raise window_tokens")

    def freeable_blocks(self, num_computed: int, block_size: int) -> range:
        """Logical block indices no query at a position ≥ ``num_computed`` reads: every slot of them is below
        ``num_computed - W + 1`` and none is a sink.  Logical block i holds positions [i·block_size,
        (i + 1)·block_size); the result is one run of indices (possibly empty), as a ``range``."""
        ### BEGIN SOLUTION
        first = -(-self.sink_tokens // block_size)  # blocks holding a sink stay
        stop = (num_computed - self.window_tokens + 1) // block_size  # blocks ending at or before the window start
        return range(first, max(first, stop))
        ### END SOLUTION

    def max_blocks(self, block_size: int) -> int:
        """Blocks a decoding sequence holds at most: its sink blocks, the window's, and one being filled."""
        return -(-self.sink_tokens // block_size) + -(-self.window_tokens // block_size) + 1


def make_eviction_policy(sliding_window: int | None, kv_eviction: str | None, window_tokens: int | None,
                         sink_tokens: int) -> KVEvictionPolicy | None:
    """The engine's policy from the model's ``sliding_window`` and ``EngineConfig``'s eviction fields (which its
    constructor checked), or None (full attention, nothing evicted).  With both a model window and
    ``kv_eviction``, the window is the smaller one and the sinks are kept too."""
    if kv_eviction is None:
        return None if sliding_window is None else KVEvictionPolicy(sliding_window)
    window = window_tokens if sliding_window is None else min(window_tokens, sliding_window)
    return KVEvictionPolicy(window, sink_tokens)
