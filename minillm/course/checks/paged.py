"""Checkers of notebook 05: paged attention and prefix caching."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from minillm.course.checks.registry import _passed, exercise
from minillm.course.checks.roofline import prediction_checker


def _allocator_state(a) -> dict:
    """What a BlockAllocator's observable state is: ref counts, free-list order, LRU order, cache entries."""
    return {"ref counts": [a.ref_count(b) for b in range(a.num_blocks)], "free list": list(a._free),
            "evictable (LRU order)": a.evictable_blocks(), "cache entries": sorted(a.cached_blocks())}


def _compare_allocators(mine, ref, where: str, hint: str) -> None:
    got, expected = _allocator_state(mine), _allocator_state(ref)
    for key in expected:
        assert got[key] == expected[key], (
            f"{where}: {key} is {got[key]}, expected {expected[key]}. {hint}")


@exercise("5.1", "minillm.kv.block_allocator.BlockAllocator.free", "free a block: reference counts",
          "only the last owner's free releases a block; a released prefix-cache entry must stay findable for "
          "later hits")
def check_block_free(allocator_class: type) -> None:
    """A ``BlockAllocator`` subclass with the student's ``free`` against the library's, on a scripted story
    (shared blocks, cached blocks, LRU order, reuse) and on random operation sequences; every observable state
    (ref counts, free-list and LRU order, cache entries) must match after every operation."""
    from minillm.kv.block_allocator import BlockAllocator, hash_block_tokens

    class Reference(BlockAllocator):  # the library's allocator with the checker's own free (never the fenced one)
        def free(self, block_id):
            if self._ref[block_id] == 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                if self.is_cached(block_id):
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    mine, ref = allocator_class(4, 2), Reference(4, 2)
    shared = "a shared block survives until its last owner frees it; only the last free releases it"
    story = [  # (description, operation, hint if the states then differ)
        ("allocate() twice", lambda a: [a.allocate(), a.allocate()], ""),
        ("fork([0, 1]): both blocks get a second owner", lambda a: a.fork([0, 1]), ""),
        ("free(0) while block 0 has 2 owners", lambda a: a.free(0), shared + "."),
        ("free(0) again: its last owner", lambda a: a.free(0),
         "with no owner left an uncached block goes to the end of the free list (self._free.append)."),
        ("register(1, ...): block 1 becomes a prefix-cache entry",
         lambda a: a.register(1, hash_block_tokens(None, [5, 6]), [5, 6], None), ""),
        ("free(1) while block 1 has 2 owners", lambda a: a.free(1), shared + "."),
        ("free(1) again: the last owner of a cached block", lambda a: a.free(1),
         "a prefix-cache entry keeps its K/V for later hits: it joins the LRU pool (self._evictable[block_id] = "
         "None), not the free list."),
        ("a prefix hit revives block 1 (incref), then free(1)", lambda a: (a.incref(1), a.free(1)),
         "the cached block goes back to the LRU pool, at its end (most recently released)."),
        ("allocate() four times: the free list first, then the LRU block is evicted",
         lambda a: [a.allocate() for _ in range(4)], "free() must put blocks where allocate() looks for them."),
        ("register(2) and (3) as cache entries, then free(3), free(2), free(0), free(1)",
         lambda a: (a.register(2, hash_block_tokens(None, [1, 2]), [1, 2], None),
                    a.register(3, hash_block_tokens(None, [3, 4]), [3, 4], None),
                    a.free(3), a.free(2), a.free(0), a.free(1)),
         "cached blocks enter the LRU pool in the order they are released (least recently released first); "
         "uncached ones the free list."),
    ]
    for i, (what, op, hint) in enumerate(story):
        got, expected = op(mine), op(ref)
        where = f"step {i + 1} of the story, {what}"
        assert got == expected, f"{where}: returned {got!r}, expected {expected!r}. {hint}"
        _compare_allocators(mine, ref, where, hint)
    try:
        mine.free(0)
    except RuntimeError:
        pass
    else:
        raise AssertionError("free(0) of a block whose reference count is 0 must raise RuntimeError (a double free), "
                             "expected the check kept before the fence to do it")
    rng = random.Random(0)  # random operation sequences, the same on both allocators
    for trial in range(20):
        mine, ref = allocator_class(6, 2), Reference(6, 2)
        held: list[int] = []
        log: list[str] = []
        for _ in range(60):
            r = rng.random()
            if r < 0.35 and mine.num_free:
                b, b_ref = mine.allocate(), ref.allocate()
                assert b == b_ref, (f"random run {trial} after {log[-6:]}: allocate() returned block {b}, expected "
                                    f"{b_ref}: freed blocks must join the free list / LRU pool at the end")
                held.append(b)
                log.append(f"allocate() -> {b}")
            elif r < 0.5 and held:
                b = rng.choice(held)
                mine.incref(b), ref.incref(b)
                held.append(b)
                log.append(f"incref({b})")
            elif r < 0.6 and held:
                b = rng.choice(held)
                tokens = [rng.randrange(100), rng.randrange(100)]
                h = hash_block_tokens(None, tokens)
                mine.register(b, h, tokens, None), ref.register(b, h, tokens, None)
                log.append(f"register({b})")
            elif held:
                b = held.pop(rng.randrange(len(held)))
                mine.free(b), ref.free(b)
                log.append(f"free({b})")
            _compare_allocators(mine, ref, f"random run {trial}, after {log[-6:]}",
                                "Lower the count; release only at zero: cached -> end of the LRU pool, else -> end "
                                "of the free list.")
    _passed("5.1")


def _manager_state(m, seq_ids) -> dict:
    state = {f"block table of {s!r}": m.block_table(s) for s in seq_ids if s in m}
    state.update({f"tokens of {s!r}": m.sequence(s).token_ids for s in seq_ids if s in m})
    state["ref counts"] = [m.device.ref_count(b) for b in range(m.device.num_blocks)]
    state["free blocks"] = m.device.num_free
    return state


@exercise("5.2", "minillm.kv.block_manager.BlockManager.append_slots",
          "grow a sequence: blocks on demand, copy-on-write",
          "never write into a block someone else can still read; take a new block only when the last one is full")
def check_append_slots(manager_class: type) -> None:
    """A ``BlockManager`` subclass with the student's ``append_slots`` against the library's: decode appends one
    token at a time, multi-token appends across block boundaries, forks (parallel sampling) whose first write
    copies the shared partial block, and random operation sequences.  Returned copies, block tables, tokens,
    ref counts and free blocks must match after every call."""
    from minillm.kv.block_allocator import BlockCopy, CopyKind
    from minillm.kv.block_manager import BlockManager

    class Reference(BlockManager):  # the library's manager with the checker's own append_slots
        def append_slots(self, seq_id, token_ids):
            table = self._table(seq_id)
            copies = []
            last_partial = len(table.token_ids) % self.block_size != 0
            if token_ids and last_partial:
                last = table.block_ids[-1]
                if self.device.ref_count(last) > 1 or self.device.is_cached(last):
                    new = self.device.allocate()
                    table.block_ids[-1] = new
                    self.device.free(last)
                    copies.append(BlockCopy(last, new, CopyKind.COPY_ON_WRITE))
            for t in token_ids:
                if len(table.token_ids) == len(table.block_ids) * self.block_size:
                    table.block_ids.append(self.device.allocate())
                table.token_ids.append(t)
            return copies

    def run(script, num_blocks=12, bs=4, caching=True):
        mine = manager_class(num_blocks, bs, enable_prefix_caching=caching)
        ref = Reference(num_blocks, bs, enable_prefix_caching=caching)
        ids = set()
        for what, op, hint in script:
            got, expected = op(mine), op(ref)
            ids |= {s for s in ("p", "c", "d", "q") if s in ref}
            assert got == expected, f"{what}: returned {got!r}, expected {expected!r}. {hint}"
            g, e = _manager_state(mine, ids), _manager_state(ref, ids)
            for key in e:
                assert g.get(key) == e[key], f"{what}: {key} is {g.get(key)}, expected {e[key]}. {hint}"

    jit = "a new block only when the last one is full (len(table.token_ids) % block_size == 0), before appending"
    cow = ("the last block is partial and shared (ref count > 1): copy-on-write — allocate a new block, put it "
           "in the table's place of the shared one, free the shared one, and return "
           "[BlockCopy(shared, new, CopyKind.COPY_ON_WRITE)]")
    run([
        ("allocate('p', 5 prompt tokens) with block_size 4", lambda m: m.allocate("p", [1, 2, 3, 4, 5]), ""),
        *[(f"append_slots('p', [{t}]) (decode token {t - 5})", lambda m, t=t: m.append_slots("p", [t]), jit)
          for t in range(6, 12)],
        ("append_slots('p', []) (nothing to add)", lambda m: m.append_slots("p", []),
         "no tokens, no blocks and no copies"),
        ("append_slots('p', 9 tokens at once)", lambda m: m.append_slots("p", list(range(20, 29))), jit),
    ])
    run([
        ("allocate('p', 6 prompt tokens) with block_size 4", lambda m: m.allocate("p", [1, 2, 3, 4, 5, 6]), ""),
        ("mark_computed('p', 6), fork('p' -> 'c') (parallel sampling, n = 2)",
         lambda m: (m.mark_computed("p", 6), m.fork("p", "c")), ""),
        ("append_slots('c', [7]): the child's first token goes into the shared partial block",
         lambda m: m.append_slots("c", [7]), cow),
        ("append_slots('p', [8]): the parent is now the last block's only owner",
         lambda m: m.append_slots("p", [8]), "a block with one owner is written in place: no copy"),
        ("append_slots('c', [9, 10, 11]): across a block boundary", lambda m: m.append_slots("c", [9, 10, 11]), jit),
        ("mark_computed('p', 7), fork('p' -> 'd'), append_slots('d', [12, 13])",
         lambda m: (m.mark_computed("p", 7), m.fork("p", "d"), m.append_slots("d", [12, 13])), cow),
        ("free('p'), free('c'), free('d')", lambda m: (m.free("p"), m.free("c"), m.free("d")), ""),
    ])
    run([
        ("allocate('p', 8 prompt tokens: two full blocks)", lambda m: m.allocate("p", list(range(1, 9))), ""),
        ("mark_computed('p', 8), fork('p' -> 'c')", lambda m: (m.mark_computed("p", 8), m.fork("p", "c")), ""),
        ("append_slots('c', [9]): the shared blocks are full", lambda m: m.append_slots("c", [9]),
         "full shared blocks are never written again: the child just gets a new block, no copy"),
    ])
    rng = random.Random(0)
    for trial in range(15):
        prompt = list(range(1, rng.randint(1, 9) + 1))
        script = [(f"random run {trial}: allocate('p', {len(prompt)} tokens)",
                   lambda m, p=prompt: m.allocate("p", p), "")]
        names = ["p"]
        for k in range(12):
            seq = rng.choice(names)
            if rng.random() < 0.2 and len(names) < 4:
                child = "cdq"[len(names) - 1]
                names.append(child)
                script.append((f"random run {trial}: mark_computed + fork({seq!r} -> {child!r})",
                               lambda m, s=seq, c=child: (m.mark_computed(s, m.num_tokens(s)), m.fork(s, c)), ""))
            else:
                toks = [rng.randrange(1, 50) for _ in range(rng.choice([1, 1, 1, 2, 5]))]
                script.append((f"random run {trial}, call {k}: append_slots({seq!r}, {toks})",
                               lambda m, s=seq, t=toks: m.append_slots(s, t), f"{jit}; {cow}"))
        run(script, num_blocks=100)
    _passed("5.2")


@exercise("5.3", "minillm.kv.block_allocator.slot_mapping", "slot mapping from a block table",
          "which logical block holds position p, where that block lives, and where p sits inside it")
def check_slot_mapping(slot_mapping: Callable) -> None:
    """``slot_mapping(block_ids, start, end, block_size)`` against the checker's own, on hand-made and fresh random
    tables."""
    def reference(block_ids, start, end, bs):
        flat = [b * bs + i for b in block_ids for i in range(bs)]  # every slot of the table, in position order
        return flat[start:end]

    rng = random.Random()
    cases = [([7, 2, 9], 0, 12, 4), ([7, 2, 9], 3, 6, 4), ([7, 2, 9], 5, 5, 4), ([7, 2, 9], 11, 12, 4),
             ([3], 0, 16, 16), ([5, 0, 4, 1], 0, 4, 1), ([0, 1, 2], 0, 40, 16)]
    cases += [(rng.sample(range(64), n), s, e, bs) for n, bs in ((5, 16), (9, 4), (3, 2))
              for s, e in [sorted(rng.sample(range(n * bs + 1), 2))]]
    for block_ids, start, end, bs in cases:
        got, expected = slot_mapping(list(block_ids), start, end, bs), reference(block_ids, start, end, bs)
        assert list(got) == expected, (
            f"slot_mapping(block_ids={block_ids}, start={start}, end={end}, block_size={bs}) returned {got!r}, "
            f"expected {expected}: position p lives in physical block block_ids[p // block_size], at offset "
            "p % block_size, and a block is block_size slots wide.")
    _passed("5.3")


def _reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """The checker's own paged decode attention: one sequence and one query head at a time, in fp64."""
    B, H_q, D = q.shape
    bs, H_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(B, H_q, D, dtype=torch.float64)
    for b in range(B):
        n = int(seq_lens[b])
        blocks = [int(x) for x in block_tables[b, : -(-n // bs)]]
        k = torch.cat([k_cache[x] for x in blocks])[:n].double()  # (n, H_kv, D)
        v = torch.cat([v_cache[x] for x in blocks])[:n].double()
        for h in range(H_q):
            kv_head = h // (H_q // H_kv)
            p = ((k[:, kv_head] @ q[b, h].double()) * scale).softmax(0)  # (n,)
            out[b, h] = p @ v[:, kv_head]
    return out


@exercise("5.4", "minillm.kernels.reference.paged_decode_attention_ref", "decode attention through block tables",
          "gather each sequence's K/V rows into position order through its table (only the blocks it uses), "
          "then attend over the first seq_lens[b] positions")
def check_paged_decode_attention(paged_decode_attention: Callable) -> None:
    """``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)`` against the checker's own
    per-sequence loop on fresh random pools: MHA, GQA and MQA heads, lengths at and across block boundaries, one
    token, shuffled and interleaved blocks, tables padded with ids past the pool (never read), an explicit scale."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    cases = [  # name, (H_q, H_kv, D, block_size, num_blocks), seq_lens, padding id, scale
        ("grouped-query heads, lengths inside, at and past a block boundary", (6, 2, 8, 4, 24), [5, 8, 9], 0, None),
        ("multi-head (H_kv = H_q), one-token and full sequences", (4, 4, 16, 8, 12), [1, 16, 7], 0, None),
        ("multi-query (H_kv = 1), an explicit scale", (8, 1, 8, 4, 20), [13, 3], 0, 0.3),
        ("tables padded with ids past the pool: entries past a sequence's last block are never read",
         (6, 3, 8, 4, 16), [2, 11, 6], 10_000, None),
        ("the SmolLM2 head layout, 16-token blocks", (9, 3, 64, 16, 10), [33, 17], 0, None),
    ]
    for name, (Hq, Hkv, D, bs, nb), lens, pad, scale in cases:
        k_cache, v_cache = torch.randn(nb, bs, Hkv, D, generator=gen), torch.randn(nb, bs, Hkv, D, generator=gen)
        q = torch.randn(len(lens), Hq, D, generator=gen)
        order = torch.randperm(nb, generator=gen).tolist()  # blocks scattered over the pool
        width = max(-(-n // bs) for n in lens) + 1  # one spare column: every row is padded
        rows = []
        for n in lens:
            used = [order.pop() for _ in range(-(-n // bs))]
            rows.append(used + [pad] * (width - len(used)))
        tables, seq_lens = torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        expected = _reference_paged_attention(q, k_cache, v_cache, tables, seq_lens,
                                              D**-0.5 if scale is None else scale).float()
        where = (f"{name}: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} = [num_blocks, block_size, H_kv, D], "
                 f"block_tables {rows}, seq_lens {lens}, scale {scale}")
        try:
            got = paged_decode_attention(q.clone(), k_cache.clone(), v_cache.clone(), tables.clone(),
                                         seq_lens.clone(), scale=scale)
        except IndexError as e:
            raise AssertionError(f"{where}: raised IndexError ({e}): a table entry past a sequence's last block was "
                                 "read; only the first ceil(seq_lens[b] / block_size) entries are blocks.") from e
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected a tensor of shape {tuple(expected.shape)} = [B, H_q, D].")
        torch.testing.assert_close(got.float(), expected, msg=lambda m, where=where: (
            f"{where}: the output differs from attention over each sequence's own positions. Position p of "
            f"sequence b is in its table's block p // block_size; keys past seq_lens[b] must get no weight. {m}"))
    _passed("5.4")


def _triton_program(number: str, program: Callable):
    """``triton.jit(program)`` once Triton can run here (CUDA, or the interpreter on CPU): else a RuntimeError
    that says how to get there."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"exercise {number} needs the triton package (pip install triton; on CPU it runs "
                           "interpreted)")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"exercise {number} on CPU needs TRITON_INTERPRET=1 set before triton is imported: "
                           "restart the kernel and run the notebook's first cells (they set it)")
    import triton

    return triton.jit(program)


def _unwrap_interpreter(e: Exception) -> None:
    """The interpreter wraps what a program raised: a stub's NotImplementedError goes through unchanged."""
    if isinstance(e.__cause__, NotImplementedError):
        raise e.__cause__ from None


@exercise("5.5", "minillm.kernels.triton.paged_decode.paged_partial_program",
          "paged decode attention in Triton: walk the block table",
          "key n lives in physical block table[n // BLOCK_SIZE] at slot n % BLOCK_SIZE: load the table entries of "
          "a tile (masked past end), then K and V rows from those blocks; the online softmax of exercise 4.3")
def check_paged_partial_program(paged_partial_program: Callable) -> None:
    """Your pass-1 program, compiled with ``triton.jit`` and launched by the library's paged flash-decoding (its
    merge kernel included), against ``paged_decode_attention_ref`` (the gather, then attention) on fresh random
    pools: grouped-query, multi-query and multi-head groups, sequences of different lengths with a partial last
    block, tiles that span several scattered blocks, splits that cut sequences anywhere (and one past a short
    sequence), a head dim that is not a power of two, tables padded with a block full of NaN (never to be read
    unmasked).  Then the engine decodes with it: a small random model's greedy tokens through your kernel equal
    the engine's with the PyTorch reference.  On CPU it runs in Triton's interpreter (TRITON_INTERPRET=1 before
    the kernels are defined)."""
    import dataclasses

    from minillm.kernels.reference import paged_decode_attention_ref
    from minillm.kernels.triton.paged_decode import paged_decode_attention_triton

    kernel = _triton_program("5.5", paged_partial_program)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    cases = [  # name, (H_q, H_kv, D, block_size, num_blocks), seq_lens, split_size, block_n
        ("grouped-query, 4-token blocks: a 16-key tile spans four scattered blocks, partial last blocks",
         (6, 2, 16, 4, 20), [5, 23, 16], 64, 16),
        ("splits cutting the keys anywhere, one past a short sequence (m = -inf, l = 0)", (4, 1, 16, 8, 12),
         [40, 3], 24, 16),
        ("multi-head (G = 1), head dim 24, 16-token blocks, a one-token sequence", (3, 3, 24, 16, 8), [33, 1], 32,
         16),
    ]
    for name, (Hq, Hkv, D, bs, nb), lens, split, block in cases:
        k_cache, v_cache = torch.randn(nb, bs, Hkv, D, generator=gen), torch.randn(nb, bs, Hkv, D, generator=gen)
        k_cache[-1], v_cache[-1] = float("nan"), float("nan")  # the padding block: masked loads never see it
        q = torch.randn(len(lens), Hq, D, generator=gen)
        order = (torch.randperm(nb - 1, generator=gen)).tolist()  # blocks scattered over the pool
        width = max(-(-n // bs) for n in lens) + 1
        rows = []
        for n in lens:
            used = [order.pop() for _ in range(-(-n // bs))]
            rows.append(used + [nb - 1] * (width - len(used)))
        tables, seq_lens = torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens)
        where = (f"{name}: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} = [num_blocks, block_size, H_kv, D], "
                 f"block_tables {rows} (block {nb - 1} is NaN padding), seq_lens {lens}, {split} keys per split, "
                 f"tiles of {block}")
        try:
            got = paged_decode_attention_triton(*(t.to(device) for t in (q, k_cache, v_cache, tables, seq_lens)),
                                                split_size=split, block_n=block, partial_kernel=kernel).cpu()
        except Exception as e:
            _unwrap_interpreter(e)
            raise
        assert torch.isfinite(got).all(), (
            f"{where}: the output has inf/NaN at {(~torch.isfinite(got)).nonzero()[:3].tolist()}, expected finite "
            "values: keys past `end` must be masked in the loads (the NaN padding block) and score -inf, and an "
            "empty key range must leave m_i = -inf, l_i = 0, acc = 0.")
        tol = {} if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}  # GPU: fp32 dots may run in TF32
        torch.testing.assert_close(got, expected, **tol, msg=lambda m, where=where: (
            f"{where}: the output differs from paged_decode_attention_ref. Key n of the sequence is in physical "
            f"block table[n // BLOCK_SIZE], slot n % BLOCK_SIZE; rescale l_i and acc by 2^(m_old − m_new). {m}"))

    # the engine decodes through it: greedy tokens equal the PyTorch reference's
    from minillm.config import EngineConfig
    from minillm.course.checks.generation import _tiny_model
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling.params import SamplingParams

    model = _tiny_model(gen.initial_seed() % 1000).to(device)
    prompts = [[int(t) for t in torch.randint(1, 64, (n,), generator=gen)] for n in (3, 9, 14)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def tokens() -> list[list[int]]:
        engine = LLMEngine(model, config=EngineConfig(block_size=4, num_kv_blocks=24, enable_prefix_caching=False))
        outs = engine.generate(prompts, params)
        failed = [out.error for out in outs if out.finish_reason == "error"]
        if failed:
            raise AssertionError(f"the engine's decode through your kernel raised: {failed[0]}")
        return [list(out.token_ids) for out in outs]

    expected_tokens = tokens()
    library_ops = model.kernel_ops()

    def yours(q, k_cache, v_cache, block_tables, seq_lens, *, sm_scale=None):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, sm_scale=sm_scale,
                                             block_n=16, partial_kernel=kernel)

    model.kernel_ops = lambda: dataclasses.replace(library_ops, paged_decode_attention=yours)
    got_tokens = tokens()
    assert got_tokens == expected_tokens, (
        f"the engine decoding prompts of {[len(p) for p in prompts]} tokens (4-token blocks) through your kernel "
        f"produced {got_tokens}, expected the reference's greedy tokens {expected_tokens}.")
    _passed("5.5")


def check_prediction(predicted: float, measured: float, *, what: str, tolerance: float = 0.1) -> None:
    """A "predict, then measure" check: ``measured`` within ``tolerance`` (relative, default 10 %) of ``predicted``."""
    assert predicted > 0, f"the prediction of {what} must be positive, got {predicted}"
    err = abs(measured - predicted) / predicted
    assert err <= tolerance, (
        f"predicted {what} {predicted:,.4g}, measured {measured:,.4g} ({err:.1%} off, tolerance {tolerance:.0%}): "
        "recheck the formula behind the prediction.")
    print(f"✓ prediction holds: {what} within {err:.1%} of the measurement")


check_prediction_paged = prediction_checker(
    "5.0", "prediction_paged", "minillm.course.predictions.predict_paged_sequences",
    "the paged sequences that fit", "sequences", example=(1_000_000, 300.0, 16),
    bound=lambda budget, mean_len, block: budget / mean_len, factor=4.0)
