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
without eviction.  What the tables handed to attention carry there is the policy's ``attention_placeholder``: under
the window, block 0 (a valid id, never read: its keys are masked by position, so every kernel — the Triton one
included, whose input checks refuse negative ids — runs exactly as without the placeholder); under H2O,
``EVICTED`` itself, the only sign of the eviction, which the reference, the native paged decode and the prefill
chunks skip (H2O attends on the reference, which also returns the attention mass it scores by).  The price is
one table entry (4 bytes) per evicted block: the K/V is bounded, the table grows with the length.

Positions: keys keep the rotary position they were written at (no re-rotation).  That makes attention with
eviction exactly the full-cache attention under a mask (what the tests compare against), keeps a block's K/V a
function of its prefix only (prefix caching and forks stay valid) and costs nothing per step.  StreamingLLM
instead re-rotates keys to their positions within the cache, so the relative distances a query sees never exceed
the cache size — which matters past the model's trained context; here the length stays capped at the model's
``max_position_embeddings`` (the memory is constant, the position range is not extended).

``H2OPolicy`` (``EngineConfig(kv_eviction="h2o")``) is the second policy behind the same interface
(``blocks_to_evict``, ``max_blocks``, ``attention_window``, ``attention_placeholder``): H2O's heavy hitters,
whose evicted set is not a positional rule, so attention skips evicted blocks by their table entry (``EVICTED``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

EVICTED = -1  # block-table placeholder of a freed block (logical index kept, no physical block)

KV_EVICTIONS = ("sink", "h2o")  # EngineConfig.kv_eviction values besides None

ALL_KEYS = 2**31 - 1  # an attention window no sequence reaches (int32 max: the kernels' widest int argument)

BlockMass = Callable[[Sequence[int]], list[float]]  # physical block ids -> the attention mass each holds


@dataclass(frozen=True)
class KVEvictionPolicy:
    """Keep the last ``window_tokens`` keys of each query and the first ``sink_tokens`` keys of the sequence."""

    window_tokens: int
    sink_tokens: int = 0
    needs_mass: ClassVar[bool] = False  # attention need not report per-key probabilities
    prefix_cacheable: ClassVar[bool] = True  # what it evicts is a function of the prefix: hashes stay valid
    attention_placeholder: ClassVar[int] = 0  # an evicted entry in attention's tables: masked by position anyway

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

    def blocks_to_evict(self, block_ids: Sequence[int], num_computed: int, block_size: int,
                        block_mass: BlockMass | None = None) -> list[int]:
        """Logical indices of the held blocks to free now, tail first (the block manager's one call).  The
        freeable blocks form a run from the policy's first index, so the walk stops at the first one already
        evicted: O(blocks freed) per call.  ``block_mass`` is unused (the rule is positional)."""
        freed = []
        for i in reversed(self.freeable_blocks(num_computed, block_size)):
            if block_ids[i] == EVICTED:
                break
            freed.append(i)
        return freed

    def attention_window(self) -> tuple[int, int]:
        """(window, sinks) attention masks by (``kernels.reference.kept_keys``)."""
        return self.window_tokens, self.sink_tokens


@dataclass(frozen=True)
class H2OPolicy:
    """H2O (Zhang et al., 2023, "Heavy-Hitter Oracle"): keep the first ``sink_tokens``, the last
    ``window_tokens`` and ``heavy_tokens`` more — the ones with the most accumulated attention mass — and evict
    the rest, so a sequence holds at most ``max_blocks`` blocks however long it runs.

    The score of a cached token is H2O's: the sum, over every layer, every query head and every query that has
    attended to it so far (prefill and decode rows alike), of the softmax probability put on it
    (``PagedKVCache.mass``; ``PagedAttention`` accumulates it, only for this policy).

    How this differs from the paper, and why: the paper evicts single tokens, separately per layer and head
    (each head keeps its own heavy hitters).  Here one decision covers a whole block for every layer and head at
    once: the block table is shared by all layers, the paged cache frees memory only in whole blocks, and keeping
    per-token choices would mean compacting (re-writing) K/V into fresh blocks.  So scores are summed over heads
    and layers, then over the block's tokens; when a sequence holds more than ``heavy_tokens`` worth of blocks
    that are neither sink blocks nor recent (a block holding any of the last ``window_tokens`` computed positions
    is recent), the lightest are freed (ties: the oldest first).  Budgets round up to whole blocks.  Attention
    then sees every causal key whose block is still held (``attention_window`` asks for no positional mask;
    evicted blocks read ``EVICTED`` in the tables and every attention path skips them).

    Prefix caching is off for a block manager running this policy (``prefix_cacheable``): which blocks a
    sequence evicts depends on how its prompt was chunked, so the K/V of a block computed after an eviction is
    not a function of its prefix alone.  Keys keep their original rotary positions, as with the window.
    """

    window_tokens: int
    sink_tokens: int
    heavy_tokens: int
    needs_mass: ClassVar[bool] = True
    prefix_cacheable: ClassVar[bool] = False
    attention_placeholder: ClassVar[int] = EVICTED  # attention skips the block by its entry

    def __post_init__(self):
        KVEvictionPolicy(self.window_tokens, self.sink_tokens)  # the same checks of the window and sinks
        if isinstance(self.heavy_tokens, bool) or not isinstance(self.heavy_tokens, int) or self.heavy_tokens < 1:
            raise ValueError(f"heavy_tokens must be a positive int (the heavy-hitter tokens kept beside the window "
                             f"and sinks), got {self.heavy_tokens!r}; pass e.g. heavy_tokens=window_tokens")

    def max_blocks(self, block_size: int) -> int:
        """Blocks a decoding sequence holds at most: sink and heavy blocks, the blocks the window spans (one more
        than its size when it starts mid-block) and one being filled."""
        return (-(-self.sink_tokens // block_size) + -(-self.heavy_tokens // block_size)
                + -(-self.window_tokens // block_size) + 2)

    def blocks_to_evict(self, block_ids: Sequence[int], num_computed: int, block_size: int,
                        block_mass: BlockMass | None = None) -> list[int]:
        """Logical indices of the lightest non-sink, non-recent held blocks beyond the heavy budget, tail first.
        Reads ``block_mass`` (one device read) only when there is something to evict."""
        first = -(-self.sink_tokens // block_size)  # blocks holding a sink stay
        recent = max(first, max(0, num_computed - self.window_tokens) // block_size)  # from here on: recent
        candidates = [i for i in range(first, recent) if block_ids[i] != EVICTED]
        excess = len(candidates) - -(-self.heavy_tokens // block_size)
        if excess <= 0:
            return []
        if block_mass is None:
            raise RuntimeError("H2OPolicy needs the attention mass of the cached blocks: give the block manager "
                               "the cache's reader (BlockManager.attach_mass)")
        mass = block_mass([block_ids[i] for i in candidates])
        lightest = sorted(range(len(candidates)), key=lambda t: (mass[t], t))[:excess]
        return sorted((candidates[t] for t in lightest), reverse=True)

    def attention_window(self) -> tuple[int, int]:
        """No positional mask (a window no sequence reaches): the tables' ``EVICTED`` entries decide."""
        return ALL_KEYS, 0


EvictionPolicy = KVEvictionPolicy | H2OPolicy  # what the block manager calls


def make_eviction_policy(sliding_window: int | None, kv_eviction: str | None, window_tokens: int | None,
                         sink_tokens: int, heavy_tokens: int | None = None, *,
                         global_layers: bool = False) -> EvictionPolicy | None:
    """The engine's policy from the model's ``sliding_window`` and ``EngineConfig``'s eviction fields (which its
    constructor checked), or None (full attention, nothing evicted).  With both a model window and
    ``kv_eviction="sink"``, the window is the smaller one and the sinks are kept too.  "h2o" needs exact
    attention over everything it keeps, which a windowed model's layers do not give: ValueError.
    ``global_layers``: some of the model's layers attend to every key (local:global): nothing is freed (each layer
    masks by its own window), and ``kv_eviction`` is refused (it would need a rule per kind of layer)."""
    if global_layers:
        if kv_eviction is not None:
            raise ValueError(f"kv_eviction={kv_eviction!r} with a model whose layers alternate sliding-window and "
                             "full attention is not supported: drop kv_eviction (its windowed layers mask by "
                             "their window; no block is freed while a full-attention layer reads it)")
        return None
    if kv_eviction is None:
        return None if sliding_window is None else KVEvictionPolicy(sliding_window)
    if kv_eviction == "h2o":
        if sliding_window is not None:
            raise ValueError(f'kv_eviction="h2o" with a sliding-window model (sliding_window={sliding_window}): '
                             "its layers already evict by position; drop kv_eviction or use kv_eviction=\"sink\"")
        return H2OPolicy(window_tokens, sink_tokens, heavy_tokens)
    window = window_tokens if sliding_window is None else min(window_tokens, sliding_window)
    return KVEvictionPolicy(window, sink_tokens)
