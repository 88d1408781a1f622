"""KV-cache storage and bookkeeping: ``contiguous`` (per-sequence slabs, notebooks 01-03), ``block_allocator`` and
``block_manager`` (paged bookkeeping, prefix cache, copy-on-write, swap), ``eviction`` (sliding window and
attention sinks: which blocks a sequence may free), ``paged_cache`` (the paged tensors and
attention over them), ``memory`` (how many blocks: the pool sized to the device)."""
