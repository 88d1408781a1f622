"""Checkers of notebook 04: attention kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.course.checks.registry import _passed, exercise


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in fp64, the textbook formula: q [..., M, D], k/v [..., N, D] -> [..., M, D] fp32."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return (s.softmax(-1) @ v.double()).float()


@exercise("4.1", "minillm.kernels.reference.merge_attention_partials", "merge partial softmax results",
          "bring every split to one common max before adding; an empty split must weigh nothing")
def check_merge_attention_partials(merge_attention_partials: Callable) -> None:
    """``merge_attention_partials(m, den, o)`` of splits from ``attention_partial`` equals softmax attention over
    all keys: two halves, one split, empty splits first and in the middle, uneven splits, scores whose exp overflows."""
    from minillm.kernels.reference import attention_partial

    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    cases = [  # name, split edges over N = 40 keys, scale
        ("two halves", [0, 20, 40], 0.25),
        ("a single split (nothing to merge)", [0, 40], 0.25),
        ("uneven splits, the last holds one key", [0, 30, 39, 40], 0.25),
        ("an empty split in the middle (m = -inf, den = 0, o = 0)", [0, 10, 10, 40], 0.25),
        ("the first split empty", [0, 0, 25, 40], 0.25),
        ("large scores: exp(score) overflows fp32 unless rescaled by the max", [0, 13, 27, 40], 40.0),
    ]
    for name, edges, scale in cases:
        q = torch.randn(2, 3, 16, generator=g)  # 2 sequences × 3 query heads of one group, D = 16
        k, v = torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
        parts = [attention_partial(q, k[:, a:b], v[:, a:b], scale=scale) for a, b in zip(edges[:-1], edges[1:],
                                                                                            strict=True)]
        m = torch.stack([p[0] for p in parts], dim=-1)  # (2, 3, P)
        den = torch.stack([p[1] for p in parts], dim=-1)  # (2, 3, P)
        o = torch.stack([p[2] for p in parts], dim=-2)  # (2, 3, P, 16)
        got = merge_attention_partials(m.clone(), den.clone(), o.clone())
        expected = _softmax_attention(q, k, v, scale)
        where = (f"{name}: {len(parts)} splits of {[b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]} "
                 f"keys, m {tuple(m.shape)}, den {tuple(den.shape)}, o {tuple(o.shape)}")
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected shape {tuple(expected.shape)} (the split axis merged away).")
        assert torch.isfinite(got).all(), (
            f"{where}: the result has inf/NaN at {(~torch.isfinite(got)).nonzero()[:3].tolist()}; expected finite "
            "values. Subtract the largest max M before exponentiating (exp(m − M) ≤ 1), and give empty splits "
            "(m = -inf) weight exp(-inf) = 0.")
        torch.testing.assert_close(got.float(), expected, msg=lambda msg, where=where: (
            f"{where}: the merged output differs from softmax attention over all the keys. Each split's den and o "
            f"were summed under its own max m_p: rescale them by exp(m_p − M) to a common max before adding. {msg}"))
    _passed("4.1")


@exercise("4.2", "minillm.kernels.reference.flash_tile_step", "one tile of FlashAttention's online softmax",
          "everything summed so far is relative to the old max: when a tile raises the max, correct the sums "
          "before adding the tile")
def check_flash_tile_step(flash_tile_step: Callable) -> None:
    """``flash_tile_step`` from the empty state equals ``attention_partial`` of the first tile; folded over all
    tiles (sizes 1 to all keys, ragged, growing scores, GQA-shaped leading dims) the state matches the library's
    step after every tile and acc / den equals softmax attention."""
    from minillm.kernels.reference import attention_partial

    def reference(m, den, acc, q, kt, vt, scale):  # the checker's own fold, in fp64
        s = (q.double() @ kt.double().transpose(-1, -2)) * scale
        m_new = torch.maximum(m.double(), s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        keep = torch.exp(m.double() - m_new)
        return m_new.float(), (den.double() * keep + p.sum(-1)).float(), (acc.double() * keep[..., None]
                                                                             + p @ vt.double()).float()

    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    cases = [  # name, q shape [..., M, D], N keys, tile size, scale, key growth
        ("one tile holding every key", (2, 4, 16), 40, 40, 0.25, False),
        ("tiles of 16 keys, the last one ragged (8)", (2, 4, 16), 40, 16, 0.25, False),
        ("one key per tile", (1, 3, 8), 12, 1, 0.35, False),
        ("scores growing tile after tile (the max keeps rising; exp overflows without it)", (2, 4, 16), 48, 16,
         1.0, True),
        ("GQA: q viewed as [B, H_kv, G·L, D] against k [B, H_kv, N, D]", (1, 2, 6, 8), 24, 10, 8**-0.5, False),
    ]
    for name, q_shape, N, block, scale, growing in cases:
        q = torch.randn(q_shape, generator=g)
        lead, D = q_shape[:-2], q_shape[-1]
        k, v = torch.randn(*lead, N, D, generator=g), torch.randn(*lead, N, D, generator=g)
        if growing:
            k = k * torch.linspace(0.1, 30, N)[:, None]
        where = f"{name}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, tile size {block}, scale {scale:.3g}"
        mine = (torch.full(q_shape[:-1], float("-inf")), torch.zeros(q_shape[:-1]), torch.zeros(q_shape))
        ref = tuple(t.clone() for t in mine)
        for t, start in enumerate(range(0, N, block)):
            kt, vt = k[..., start : start + block, :], v[..., start : start + block, :]
            out = flash_tile_step(*(x.clone() for x in mine), q.clone(), kt.clone(), vt.clone(), scale)
            ref = reference(*ref, q, kt, vt, scale)
            if t == 0:  # from the empty state, one step is exactly this tile's partial softmax
                ref = attention_partial(q, kt, vt, scale=scale)
            assert isinstance(out, tuple) and len(out) == 3, (
                f"{where}: flash_tile_step returned {type(out).__name__}, expected the new state as a tuple "
                "(m, den, acc).")
            for label, got, exp in zip(("m (running max)", "den (running sum of exp)", "acc (unnormalised output)"),
                                       out, ref, strict=True):
                assert isinstance(got, torch.Tensor) and got.shape == exp.shape, (
                    f"{where}, after tile {t}: returned {label} of shape "
                    f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, expected "
                    f"{tuple(exp.shape)}.")
                step = f"{where}, after tile {t} (keys {start}..{min(N, start + block) - 1})"
                torch.testing.assert_close(got.float(), exp, msg=lambda msg, step=step, label=label: (
                    f"{step}: {label} differs "
                    "from the expected state. When the max rises from m to m_new, everything summed so far was "
                    f"relative to m: multiply den and acc by exp(m − m_new) before adding this tile. {msg}"))
            mine = out
        torch.testing.assert_close((mine[2] / mine[1][..., None]).float(), _softmax_attention(q, k, v, scale),
                                   msg=lambda msg, where=where: f"{where}: acc / den after the last tile differs "
                                   f"from softmax attention over all keys. {msg}")
    _passed("4.2")
