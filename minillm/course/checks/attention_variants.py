"""Checkers of notebook 03: MHA, GQA, MQA."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.course.checks.registry import CONFIGS, LLAMA2_7B, _close, _passed, exercise
from minillm.course.checks.roofline import prediction_checker


@exercise("3.1", "minillm.models.attention_variants.kv_bytes_gqa", "KV bytes per token for any number of K/V heads",
          "exercise 2.1's count with the num_kv_heads argument as H_kv and bytes_per_elem as the element size")
def check_kv_bytes_gqa(kv_bytes_gqa: Callable) -> None:
    """``kv_bytes_gqa(config, num_kv_heads, bytes_per_elem)`` for every H_kv dividing H_q, four element sizes."""
    def reference(config, h, size):
        return 2 * config.num_layers * h * config.head_dim * size

    got = kv_bytes_gqa(LLAMA2_7B, 8, 2)
    assert _close(got, 128 * 1024), (
        f"Llama-2-7B's shape (32 layers, head_dim 128) with 8 K/V heads in fp16: kv_bytes_gqa returned {got!r}, "
        "expected 131,072 bytes (128 KiB) per token — a quarter of the 512 KiB its 32 K/V heads need.")
    for name, config in CONFIGS.items():
        for h in [d for d in range(1, config.num_heads + 1) if config.num_heads % d == 0]:
            for size in (2, 4, 1, 0.5):
                got, expected = kv_bytes_gqa(config, h, size), reference(config, h, size)
                assert _close(got, expected), (
                    f"{name} (layers={config.num_layers}, H_q={config.num_heads}, its own H_kv="
                    f"{config.num_kv_heads}, head_dim={config.head_dim}) with num_kv_heads={h}, bytes_per_elem="
                    f"{size}: kv_bytes_gqa returned {got!r}, expected {expected:,g} bytes. Count the heads you are "
                    "asked about (the argument, not config.num_kv_heads) and the element size given.")
    _passed("3.1")


def _largest_new_tensor(fn: Callable, *args, **kwargs) -> tuple[object, int, str]:
    """Run ``fn(*args, **kwargs)``; return its result, the bytes of the largest tensor storage that any operation
    inside it created (storage of the inputs and views of them excluded), and that operation's name.

    Uses PyTorch's dispatch-mode hook, which sees every ATen operation, those inside library calls included
    (``torch.matmul`` broadcasting an operand materialises the broadcast copy: it shows up here).
    """
    try:  # private but long-stable PyTorch modules (1.13+); if a future release moves them, skip the watch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
    except ImportError:
        return fn(*args, **kwargs), 0, ""

    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    largest = [0, ""]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    if t.untyped_storage().nbytes() > largest[0]:
                        largest[:] = [t.untyped_storage().nbytes(), str(func)]
            return out

    with Watch():
        result = fn(*args, **kwargs)
    return result, largest[0], largest[1]


def _lengths_mask(lengths: list[int], L: int, S: int) -> torch.Tensor:
    """[B, 1, L, S] bool: row b's queries see its first lengths[b] keys (a batch of different lengths)."""
    return (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :].expand(-1, 1, L, S)


def _reference_attention(q, k, v, mask=None, *, causal=False, scale=None):
    """The checker's own attention in fp64: K/V heads repeated for their query heads (a copy is fine here)."""
    B, Hq, L, D = q.shape
    S, G = k.shape[2], Hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, dim=1), v.double().repeat_interleave(G, dim=1)  # (B, H_q, S, D)
    s = (q.double() @ kk.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)  # (B, H_q, L, S)
    if causal:
        s = s.masked_fill(torch.arange(S)[None, :] > torch.arange(L)[:, None] + (S - L), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vv).to(q.dtype)


@exercise("3.2", "minillm.kernels.reference.grouped_attention", "grouped-query attention by broadcasting",
          "consecutive query heads share a K/V head; let a view of q do the sharing, never a copy of K or V")
def check_grouped_attention(grouped_attention: Callable) -> None:
    """``grouped_attention(q, k, v, mask, causal=, scale=)`` against the library's on MHA, GQA and MQA shapes,
    decode and (chunked) causal prefill, masks of different lengths; then that it makes no copy of K or V for
    the query heads: no tensor as large as K repeated G times may be created."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    cases = [  # name, (B, H_q, H_kv, L, S, D), mask lengths or None, causal, scale
        ("multi-head decode (H_kv = H_q)", (2, 4, 4, 1, 9, 8), None, False, None),
        ("grouped-query prefill, causal, L = S", (1, 6, 2, 7, 7, 8), None, True, None),
        ("grouped-query chunked prefill, causal, L < S (the queries are the last L positions)",
         (2, 6, 3, 3, 10, 4), None, True, None),
        ("multi-query (H_kv = 1) with a padding mask [B, 1, L, S]", (2, 4, 1, 3, 6, 8), [6, 4], False, None),
        ("grouped-query decode over rows of different lengths, mask [B, 1, 1, S]", (3, 8, 2, 1, 12, 16),
         [12, 5, 1], False, None),
        ("causal and a mask together, scale given", (2, 9, 3, 4, 8, 8), [8, 6], True, 0.05),
    ]
    for name, (B, Hq, Hkv, L, S, D), lengths, causal, scale in cases:
        q = torch.randn(B, Hq, L, D, generator=g)
        k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
        mask = None if lengths is None else _lengths_mask(lengths, L, S)
        got = grouped_attention(q.clone(), k.clone(), v.clone(), mask, causal=causal, scale=scale)
        expected = _reference_attention(q, k, v, mask, causal=causal, scale=scale)
        where = (f"{name}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, causal={causal}, scale={scale}"
                 + ("" if lengths is None else f", mask lengths {lengths}"))
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected a tensor of shape {tuple(expected.shape)} = [B, H_q, L, D].")
        torch.testing.assert_close(got, expected, msg=lambda m, where=where: (
            f"{where}: the output differs from the expected one. Query head h uses K/V head h // G (consecutive "
            f"heads share, as transformers' repeat_kv); causal query i sees keys j ≤ S − L + i. {m}"))
    for Hkv in (2, 1):  # no copies: K repeated for every query head is G times the size of K
        B, Hq, S, D = 2, 8, 64, 16
        q = torch.randn(B, Hq, 1, D, generator=g)
        k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
        mask = _lengths_mask([64, 40], 1, S)
        _, nbytes, op = _largest_new_tensor(grouped_attention, q, k, v, mask)
        repeated = B * Hq * S * D * k.element_size()
        assert nbytes < repeated, (
            f"decode with H_q={Hq}, H_kv={Hkv}, S={S}, D={D}: grouped_attention created a tensor of {nbytes:,} bytes "
            f"(in {op}), the size of K or V repeated for all {Hq} query heads; expected nothing that large (the "
            f"scores are {B * Hq * S * 4:,} bytes). Share each K/V head by viewing q as [B, H_kv, G·L, D] and "
            "multiplying by kᵀ directly: repeat_interleave copies K/V, and so does torch.matmul when it broadcasts "
            "an operand over an extra group dimension.")
    _passed("3.2")


def _reference_pool(w: torch.Tensor, Hq: int, Hkv: int, new: int, D: int) -> torch.Tensor:
    """The checker's own pooling in fp64, head by head: new head j = mean of old heads j·r … j·r + r − 1."""
    r, x = Hkv // new, w.double()
    q, k, v = x[: Hq * D], x[Hq * D : (Hq + Hkv) * D], x[(Hq + Hkv) * D :]

    def pool(t):
        return torch.cat([sum(t[(j * r + i) * D : (j * r + i + 1) * D] for i in range(r)) / r for j in range(new)])

    return torch.cat([q, pool(k), pool(v)])


@exercise("3.3", "minillm.models.attention_variants.pool_kv_weight", "MHA → GQA/MQA: mean-pool K/V heads",
          "q rows as they are; each new K/V head the mean of its group of old heads; the weight's dtype; "
          "validate first (optional hints below the exercise)")
def check_pool_kv_weight(pool_kv_weight: Callable) -> None:
    """``pool_kv_weight(weight, H_q, H_kv, new, D)`` against a head-by-head fp64 reference: MHA → GQA, MHA → MQA,
    GQA → MQA, the identity (new = H_kv), a 1-D bias, a bf16 weight (dtype kept); the q rows exactly unchanged;
    ValueError for a new head count that does not divide H_kv, for 0, and for a weight with the wrong rows."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    cases = [  # name, H_q, H_kv, new, D, trailing shape (hidden; () for a bias), dtype
        ("MHA → GQA (8 heads → 2)", 8, 8, 2, 4, (12,), torch.float32),
        ("MHA → MQA (6 heads → 1)", 6, 6, 1, 8, (10,), torch.float32),
        ("GQA → MQA (SmolLM2's 9 query / 3 K/V heads → 1)", 9, 3, 1, 8, (16,), torch.float32),
        ("GQA → GQA (12 / 6 → 3)", 12, 6, 3, 4, (7,), torch.float32),
        ("the identity (new = H_kv)", 4, 4, 4, 8, (6,), torch.float32),
        ("a bias (1-D), 8 / 4 → 2", 8, 4, 2, 8, (), torch.float32),
        ("a bfloat16 weight, 8 → 2", 8, 8, 2, 16, (24,), torch.bfloat16),
    ]
    for name, Hq, Hkv, new, D, rest, dtype in cases:
        w = torch.randn((Hq + 2 * Hkv) * D, *rest, generator=g).to(dtype)
        got = pool_kv_weight(w.clone(), Hq, Hkv, new, D)
        expected = _reference_pool(w, Hq, Hkv, new, D)
        where = (f"{name}: pool_kv_weight(<{dtype} {tuple(w.shape)}>, num_heads={Hq}, num_kv_heads={Hkv}, "
                 f"new_kv_heads={new}, head_dim={D})")
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == dtype, (
            f"{where} returned "
            f"{f'{tuple(got.shape)} {got.dtype}' if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected a {dtype} tensor of shape {tuple(expected.shape)} = "
            f"[(H_q + 2·new)·D{', hidden' if rest else ''}].")
        assert torch.equal(got[: Hq * D], w[: Hq * D]), (
            f"{where}: the first H_q·D = {Hq * D} rows (the query heads) changed; expected them returned as "
            "they are.")
        torch.testing.assert_close(got, expected.to(dtype), msg=lambda m, where=where: (
            f"{where}: the pooled K/V rows differ from the expected ones. New head j is the mean of the r = H_kv / "
            "new consecutive old heads j·r … j·r + r − 1 (query head h read K/V head h // G, so a group of query "
            f"heads keeps reading its own heads' mean), K and V alike, each head D rows. {m}"))
    for args, why in (((8, 4, 3, 4), "3 does not divide H_kv = 4"), ((8, 4, 0, 4), "0 K/V heads"),
                      ((8, 4, 2, 8), "the weight has the rows of head_dim 4, not 8")):
        w = torch.randn((args[0] + 2 * args[1]) * 4, 5, generator=g)
        try:
            pool_kv_weight(w, *args)
        except ValueError:
            continue
        raise AssertionError(f"pool_kv_weight(<{tuple(w.shape)}>, {', '.join(map(str, args))}) returned without a "
                             f"ValueError; expected one ({why}).")
    _passed("3.3")


check_prediction_mqa = prediction_checker(
    "3.0", "prediction_mqa", "minillm.course.predictions.predict_mqa_speedup",
    "the multi-query over multi-head decode speedup", "×", example=(2.5,), factor=4.0)


@exercise("3.4", "minillm.kv.eviction.KVEvictionPolicy.freeable_blocks", "the eviction rule: which blocks to free",
          "a block can go when every slot in it is below num_computed - window_tokens + 1 and none of its slots "
          "is a sink (position < sink_tokens); return range(first, stop), empty when nothing can go")
def check_freeable_blocks(policy_class: type) -> None:
    """``policy_class(window_tokens, sink_tokens).freeable_blocks(num_computed, block_size)`` on every computed
    length up to a few windows, for windows and sink counts on and off block boundaries: exactly the blocks whose
    every slot no future query keeps (query positions ≥ num_computed see keys (q - W, q] and the sinks)."""

    def kept_later(j: int, n: int, window: int, sinks: int) -> bool:  # key j read by some query q >= n
        return j < sinks or n - j < window

    for window, sinks, bs in [(8, 0, 4), (8, 4, 4), (10, 3, 4), (7, 0, 3), (16, 5, 4), (5, 1, 1), (6, 2, 16)]:
        policy = policy_class(window, sinks)
        for n in range(0, 4 * window + 2 * bs):
            got = policy.freeable_blocks(n, bs)
            assert got is not None, "freeable_blocks returned None: return the indices (a range)"
            got = list(got)
            want = [i for i in range(n // bs) if not any(kept_later(j, n, window, sinks)
                                                           for j in range(i * bs, (i + 1) * bs))]
            where = (f"window_tokens={window}, sink_tokens={sinks}, block_size={bs}, num_computed={n}: you free "
                     f"blocks {got}, expected {want}")
            for i in got:
                slots = range(i * bs, (i + 1) * bs)
                sink = [j for j in slots if j < sinks]
                assert not sink, (f"{where}; block {i} holds the sink position(s) {sink}: the "
                                  "first sink_tokens keys are kept for every query")
                inside = [j for j in slots if kept_later(j, n, window, sinks)]
                assert not inside, (f"{where}; block {i} holds position(s) {inside}, still inside the "
                                    f"window of the next query (position {n} sees keys {n - window + 1}..{n}): "
                                    "an off-by-one at the window's start")
            assert got == want, (f"{where} — every block all of whose "
                                 "slots are outside the window and past the sinks goes, in increasing order")
    _passed("3.4")
