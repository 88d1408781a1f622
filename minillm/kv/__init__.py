"""KV-cache storage and bookkeeping: ``contiguous`` (per-sequence slabs, notebooks 01-03), ``block_allocator`` and
``block_manager`` (paged bookkeeping, prefix cache, copy-on-write, swap), ``paged_cache`` (the paged tensors and
attention over them), ``memory`` (how many blocks: the pool sized to the device)."""
